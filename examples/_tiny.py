"""Tiny synthetic data and models shared by the examples: everything runs on CPU in seconds, nothing downloads.

Real jobs replace ``RandomChat`` with their tokenized dataset (one unpadded sample per item, a dict with
``input_ids`` and ``labels``) and the model with theirs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

VOCAB = 64
IGNORE = -100


class RandomChat(Dataset):
    """Chat-like long-tail lengths (4..48 tokens), random token ids, the first third of labels masked (prompt)."""

    def __init__(self, n: int = 256, seed: int = 0, max_len: int = 48) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = np.clip(rng.lognormal(2.6, 0.8, n).astype(np.int64), 4, max_len)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        n = int(self.lengths[i])
        ids = torch.from_numpy(np.random.default_rng([self.seed, i]).integers(1, VOCAB, n))
        labels = ids.clone()
        labels[: n // 3] = IGNORE
        return {"input_ids": ids, "labels": labels}


class Block(torch.nn.Module):
    """Mix each position with the running mean of the positions up to it (causal, no mask needed)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(2 * dim, dim)

    def forward(self, h):
        steps = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype)[None, :, None]
        return torch.tanh(self.mix(torch.cat([h, h.cumsum(1) / steps], -1))) + h


class TinyCausalLM(torch.nn.Module):
    """A causal LM without attention masks: position t mixes token t with the running mean of tokens <= t, so
    right padding never changes a real position. ``forward`` follows the HF convention (shifted labels, mean
    over supervised tokens) and returns ``{"loss", "logits"}``."""

    def __init__(self, dim: int = 16, layers: int = 2, seed: int = 0, dtype=torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(VOCAB, dim)
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.to(dtype)

    def forward(self, input_ids, labels=None, attention_mask=None, **_):
        h = self.emb(input_ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                                     ignore_index=IGNORE)
        return {"loss": loss, "logits": logits}


def tiny_llama(dtype=torch.float32, seed: int = 0):
    """A 1-layer, hidden-16 ``transformers`` Llama with random weights (for the framework examples)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype)
