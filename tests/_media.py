"""Real three-modality samples for the multimodal tests, built once per process and cached.

The pipeline (Qwen3 template, Qwen2-VL processor, eSpeak NG + Whisper log-mel) runs once in the test
session's parent; spawned ranks receive the finished samples (pickled), so the media are synthesized once.
"""

from __future__ import annotations

from functools import lru_cache

import torch

NUM_SAMPLES = 24
MAX_PIXELS = 64 * 28 * 28
"""At most 64 image tokens (256 patches) per image: keeps the float64 tiny model fast."""
MAX_FRAMES = 400
"""At most 4 s of speech (100 audio tokens)."""
CUTOFF = 512


def dataset_kwargs() -> dict:
    return dict(num_samples=NUM_SAMPLES, max_pixels=MAX_PIXELS, max_frames=MAX_FRAMES, cutoff=CUTOFF, seed=3)


@lru_cache(maxsize=2)
def real_samples(num_samples: int = NUM_SAMPLES) -> tuple[dict, ...]:
    from evenflow.data import chitchat_conversations
    from evenflow.data.multimodal import MultimodalChatDataset

    kwargs = dataset_kwargs() | {"num_samples": num_samples}
    ds = MultimodalChatDataset(chitchat_conversations()[:num_samples], **kwargs)
    return tuple(ds[i] for i in range(len(ds)))


class CachedDataset(torch.utils.data.Dataset):
    """Map-style view of already processed samples (what the real dataset returned for each index)."""

    def __init__(self, samples) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return dict(self.samples[index])
