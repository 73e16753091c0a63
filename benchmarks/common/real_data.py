"""Sample lengths of the benchmark data sets: paper-matched shapes, chitchat and ../shared/data.

Real text goes through the real Qwen3 chat template and tokenizer (:func:`evenflow.sim.datasets.chat_lengths`);
the conversation readers are the package's own (:mod:`evenflow.data.sources`). Lengths are cached in a temp
directory so reruns are fast. ``../shared/data`` sets are skipped with a message when the folder is absent.

Every data set is resampled (seeded, with replacement for the small real sets) to the same epoch size, so
policies are compared on epochs of equal length: the epoch-end drain costs about the same number of steps
whatever the epoch size, so its share depends on the size (see the epoch-size ablation).
"""

from __future__ import annotations

import csv
import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

from evenflow.sim.datasets import PAPER_SHAPES, chat_lengths, chitchat_lengths, paper_lengths

__all__ = ["CACHE_DIR", "PAPER_SETS", "REAL_SETS", "load_lengths", "raw_lengths", "available", "shared_dir"]

CACHE_DIR = Path(tempfile.gettempdir()) / "evenflow-bench-cache"
PAPER_SETS = tuple(PAPER_SHAPES)
REAL_SETS = ("chitchat", "alpaca", "glaive", "hh_rlhf", "vidur")
_SHARED = {"alpaca": "llamafactory_alpaca_en_demo.json", "glaive": "llamafactory_glaive_toolcall_en_demo.json",
           "hh_rlhf": "hh_rlhf_harmless_base_test.jsonl.gz", "vidur": "vidur_splitwise_conv.csv"}


def shared_dir() -> Path | None:
    """``../shared/data`` relative to the repository root (``parents[2]`` of this file), if present."""
    p = Path(__file__).resolve().parents[2].parent / "shared" / "data"
    return p if p.is_dir() else None


def available(name: str) -> tuple[bool, str]:
    """Whether a data set can be loaded here, and why not."""
    if name in PAPER_SETS or name == "chitchat":
        return True, ""
    d = shared_dir()
    if d is None or not (d / _SHARED[name]).is_file():
        return False, f"{name}: ../shared/data/{_SHARED[name]} not found (benchmark data, not shipped) -- skipped"
    return True, ""


def _cached(name: str, source: Path, compute) -> np.ndarray:
    st = source.stat()
    key = hashlib.blake2b(f"{name}:{st.st_size}:{int(st.st_mtime)}".encode(), digest_size=6).hexdigest()
    path = CACHE_DIR / f"{name}_qwen3_{key}.npy"
    if path.exists():
        return np.load(path)
    lengths = np.asarray(compute(), dtype=np.int64)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
    np.save(tmp, lengths)
    os.replace(tmp, path)
    return lengths


def raw_lengths(name: str) -> np.ndarray:
    """The data set's own lengths (no resampling, no cutoff)."""
    if name == "chitchat":
        return chitchat_lengths(CACHE_DIR)
    ok, why = available(name)
    if not ok:
        raise FileNotFoundError(why)
    from evenflow.data import sources

    path = shared_dir() / _SHARED[name]
    if name == "alpaca":
        return _cached(name, path, lambda: chat_lengths(sources.read_alpaca(path)))
    if name == "glaive":
        def glaive():
            convs, tools = sources.read_sharegpt(path)
            return chat_lengths(convs, tools=tools)
        return _cached(name, path, glaive)
    if name == "hh_rlhf":
        return _cached(name, path, lambda: chat_lengths(sources.read_hh_rlhf(path)))
    if name == "vidur":  # a production trace of request sizes: prompt + response tokens per conversation
        with open(path) as f:
            rows = list(csv.DictReader(f))
        return np.array([int(r["num_prefill_tokens"]) + int(r["num_decode_tokens"]) for r in rows], dtype=np.int64)
    raise KeyError(f"unknown data set {name!r}")


def load_lengths(name: str, n: int, *, seed: int = 0, cutoff: int = 8192) -> np.ndarray:
    """``n`` lengths of data set ``name``, clipped to ``cutoff`` (truncation, as a trainer's cutoff_len does).

    Paper shapes are drawn from their matched distribution; real sets are resampled from their own lengths
    (a seeded permutation repeated, so each real sample appears ``n / size`` times, +-1).
    """
    if name in PAPER_SETS:
        return paper_lengths(name, n, seed=seed, cutoff=cutoff)
    raw = raw_lengths(name)
    rng = np.random.default_rng(seed)
    reps = -(-n // len(raw))
    idx = np.concatenate([rng.permutation(len(raw)) for _ in range(reps)])[:n]
    return np.clip(raw[idx], 1, cutoff)
