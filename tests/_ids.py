"""A map-style dataset whose samples name themselves: sample i is ``lengths[i]`` copies of i, so a batch (or a
packed row, where its positions restart) says which samples it holds."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


class IdsDataset(Dataset):
    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        row = torch.full((int(self.lengths[i]),), i)
        return {"input_ids": row, "labels": row}
