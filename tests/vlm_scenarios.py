"""Tiny stock Qwen2-VL / Qwen2.5-VL / Qwen2.5-Omni thinker / Qwen3-VL models and synthetic batches for the VLM
tests (no weights, no downloads).

Samples are what a dataset yields in the HF layout (``input_ids``, ``labels``, ``mm_token_type_ids``,
``pixel_values`` + ``image_grid_thw``, ``pixel_values_videos`` + ``video_grid_thw``, audio clips as
``input_features`` ``[clips, n_mels, frames]`` + ``feature_attention_mask``); batches go through the library's
own collates (``PadCollate``, ``FlatCollate``), so the adapter is tested on what the loader yields. The reference
is the unmodified stock forward on the global padded batch, its summed token loss divided by the global
supervised tokens (float64 where asked).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

VOCAB = 256
IMAGE_ID, VIDEO_ID, VISION_START, VISION_END = 250, 251, 252, 253
AUDIO_ID, AUDIO_START, AUDIO_END = 249, 247, 248
PATCH = 3 * 2 * 14 * 14
N_MELS = 16
"""Mel bins of the tiny Omni thinker's audio tower (80 or 128 in real ones: only the row width changes)."""
N_WINDOW = 8
"""The tiny audio tower's ``n_window``: it attends within windows of 16 frames, so short clips span several."""
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=0,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4})
SPECIAL = dict(image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=VISION_START,
               vision_end_token_id=VISION_END)
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni", "qwen3_vl")


def tiny_model(family: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    """A random-init stock model: ``"qwen2_vl"``, ``"qwen2_5_vl"`` (window attention: windows of 2x2 merged
    tokens in block 0, full attention in block 1), ``"qwen2_5_omni"`` (the thinker: Qwen2.5-VL's tower and an
    audio tower of ``n_window`` 8) or ``"qwen3_vl"`` (deepstack after vision blocks 0 and 1). sdpa attention."""
    import transformers

    torch.manual_seed(seed)
    window = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, window_size=56,
                  fullatt_block_indexes=[1])
    if family == "qwen2_vl":
        config = transformers.Qwen2VLConfig(vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2),
                                            text_config=dict(TEXT), **SPECIAL)
        cls = transformers.Qwen2VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(vision_config=window, text_config=dict(TEXT), **SPECIAL)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    elif family == "qwen2_5_omni":
        config = transformers.Qwen2_5OmniThinkerConfig(
            audio_config=dict(num_mel_bins=N_MELS, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=32,
                              d_model=16, n_window=N_WINDOW, output_dim=32, max_source_positions=64),
            vision_config=window, text_config=dict(TEXT), audio_token_index=AUDIO_ID, image_token_index=IMAGE_ID,
            video_token_index=VIDEO_ID, audio_start_token_id=AUDIO_START, audio_end_token_id=AUDIO_END,
            vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
        cls = transformers.Qwen2_5OmniThinkerForConditionalGeneration
    elif family == "qwen3_vl":
        text = dict(TEXT, head_dim=8, num_hidden_layers=3,
                    rope_parameters={**TEXT["rope_parameters"], "mrope_interleaved": True})
        config = transformers.Qwen3VLConfig(
            vision_config=dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                               patch_size=14, num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
            text_config=text, **SPECIAL)
        cls = transformers.Qwen3VLForConditionalGeneration
    else:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    config._attn_implementation = "sdpa"
    model = cls(config).to(dtype)
    model.train()
    return model


def audio_tokens(frames: int) -> int:
    """The thinker's audio rows (= placeholders) for a clip of ``frames`` mel frames."""
    after_conv = (frames - 1) // 2 + 1
    return max((after_conv - 2) // 2 + 1, 0)


def sample(gen: torch.Generator, text: int, media: list[tuple[str, object]], *, seconds: float | None = None,
           family: str = "qwen2_vl") -> dict:
    """One example: a 3-token prompt, each medium as ``<vs> pad x n <ve>`` (Qwen3-VL videos: one such run per
    temporal patch, after a timestamp token), each audio clip ``("audio", frames)`` as ``<as> pad x n <ae>``,
    then ``text`` supervised tokens."""
    ids = torch.randint(1, 200, (3,), generator=gen).tolist()
    px = {"image": [], "video": []}
    grids = {"image": [], "video": []}
    clips = []
    for kind, spec in media:
        if kind == "audio":
            clips.append(torch.randn(N_MELS, spec, generator=gen, dtype=torch.float64).float())
            ids += [AUDIO_START] + [AUDIO_ID] * audio_tokens(spec) + [AUDIO_END]
            continue
        t, h, w = spec
        token = IMAGE_ID if kind == "image" else VIDEO_ID
        if kind == "video" and family == "qwen3_vl":
            for _ in range(t):
                ids += [int(torch.randint(1, 200, (1,), generator=gen))] + [VISION_START] + [token] * (h * w // 4) \
                    + [VISION_END]
        else:
            ids += [VISION_START] + [token] * (t * h * w // 4) + [VISION_END]
        px[kind].append(torch.randn(t * h * w, PATCH, generator=gen, dtype=torch.float64).float())
        grids[kind].append([t, h, w])
    ids += torch.randint(1, 200, (text,), generator=gen).tolist()
    ids = torch.tensor(ids)
    types = (ids == IMAGE_ID).long() + 2 * (ids == VIDEO_ID).long()
    labels = ids.clone()
    labels[(types != 0) | (ids == AUDIO_ID)] = -100
    labels[:3] = -100
    out = {"input_ids": ids, "labels": labels, "mm_token_type_ids": types,
           "num_patches": sum(s[0] * s[1] * s[2] for k, s in media if k != "audio"),
           "num_frames": sum(s for k, s in media if k == "audio")}
    if px["image"]:
        out.update(pixel_values=torch.cat(px["image"]), image_grid_thw=torch.tensor(grids["image"]))
    if px["video"]:
        out.update(pixel_values_videos=torch.cat(px["video"]), video_grid_thw=torch.tensor(grids["video"]))
        if seconds is not None:
            out["second_per_grid_ts"] = torch.full((len(px["video"]),), seconds)
    if clips:
        longest = max(c.shape[1] for c in clips)
        out["input_features"] = torch.zeros(len(clips), N_MELS, longest)
        out["feature_attention_mask"] = torch.zeros(len(clips), longest, dtype=torch.long)
        for c, clip in enumerate(clips):
            out["input_features"][c, :, :clip.shape[1]] = clip
            out["feature_attention_mask"][c, :clip.shape[1]] = 1
    return out


def per_rank_samples(seed: int = 0, *, video: bool = True, family: str = "qwen2_vl") -> list[list[dict]]:
    """Three ranks: rank 0 heavy (two large images and a video), rank 1 text only, rank 2 one small image and
    long text -- so every phase moves, and ranks hold zero images or zero videos. The Omni thinker's examples
    also speak: rank 0 holds a 70-frame clip (4 attention windows and a tail) and a 37-frame one (35 % 4 == 3
    style rounding: 9 rows), rank 2 a 16-frame one; rank 1 holds no clip."""
    gen = torch.Generator().manual_seed(seed)
    omni = family == "qwen2_5_omni"

    def s(text, media, **kw):
        return sample(gen, text, media, family=family, **kw)

    rank0 = [s(6, [("image", (1, 8, 12))] + ([("audio", 37)] if omni else [])),
             s(4, [("image", (1, 12, 8))] + ([("audio", 70)] if omni else []) + [("image", (1, 4, 4))]),
             s(5, [("video", (3, 4, 8))] if video else [("image", (1, 8, 8))], seconds=0.5)]
    rank1 = [s(30, []), s(9, [])]
    rank2 = [s(40, ([("audio", 16)] if omni else []) + [("image", (1, 4, 6))])]
    return [rank0, rank1, rank2]


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of right-padded rows (the model's dtype; HF's labels= is a float32 mean)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")


def supervised(samples: list[dict]) -> int:
    return sum(int((s["labels"][1:] != -100).sum()) for s in samples)


def model_inputs(batch: dict, model: torch.nn.Module | None = None) -> dict:
    """The keys the stock forward takes (by its signature when ``model`` is given; the thinker names a video's
    seconds ``video_second_per_grid``)."""
    import inspect

    keys = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
            "mm_token_type_ids", "second_per_grid_ts", "input_features", "feature_attention_mask")
    out = {k: v for k, v in batch.items() if k in keys}
    if model is not None:
        names = inspect.signature(model.forward).parameters
        if "second_per_grid_ts" in out and "second_per_grid_ts" not in names:
            out["video_second_per_grid"] = out.pop("second_per_grid_ts")
        out = {k: v for k, v in out.items() if k in names}
    return out


def reference(model: torch.nn.Module, samples: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and every parameter's gradient of the stock forward on the global padded batch."""
    from evenflow import PadCollate

    batch = PadCollate()(samples)
    model.zero_grad(set_to_none=True)
    dtype = next(model.parameters()).dtype
    inputs = model_inputs(batch, model)
    for key in ("pixel_values", "pixel_values_videos", "input_features"):
        if key in inputs:
            inputs[key] = inputs[key].to(dtype)
    loss = loss_sum(model(**inputs, use_cache=False).logits, batch["labels"]) / supervised(samples)
    loss.backward()
    grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error (2-norm) of ``a`` against ``b``."""
    return float((a - b).detach().norm() / b.detach().norm())


def rel_err(grads: dict, ref: dict) -> float:
    """Largest relative error (2-norm) over parameters; a parameter missing a gradient counts as 1."""
    worst = 0.0
    for name, r in ref.items():
        g = grads.get(name)
        if g is None:
            return 1.0
        scale = float(r.norm()) or 1.0
        worst = max(worst, float((g - r).norm()) / scale)
    return worst


@contextlib.contextmanager
def one_thread_float64():
    """One torch thread (the towers' timings and roundings as on a rank) and :class:`float64_throughout`: what
    the one-process fact tests run under."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with float64_throughout():
            yield
    finally:
        torch.set_num_threads(threads)


class float64_throughout:
    """Within this context, the stock Qwen2-VL / Qwen2.5-VL modules keep float64 where they round to float32.

    The stock RMSNorm computes in float32 and the vision rotary embedding rotates q and k in float32, whatever
    the model's dtype. Per token that is deterministic, but a float64 matmul over a different set of rows (one
    rank's examples instead of the global batch) may differ in its last bit, and a float32 rounding turns that
    into a 1e-7 difference: the unmodified model in float64 is only as exact as float32. Lifting the two casts
    changes nothing but the rounding, so a float64 comparison at 1e-10 then tests the decomposition itself (a
    misrouted row or a wrong position is off by 1e-3 or more). The float32 tests run the unmodified model.
    """

    def __enter__(self) -> "float64_throughout":
        from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as omni
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as q25
        from transformers.models.qwen2_vl import modeling_qwen2_vl as q2
        from transformers.models.qwen3_vl import modeling_qwen3_vl as q3

        def rms_forward(norm, hidden):
            variance = hidden.pow(2).mean(-1, keepdim=True)
            return norm.weight * (hidden * torch.rsqrt(variance + norm.variance_epsilon))

        def rotary(module):
            def apply(q, k, cos, sin):
                cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
                return q * cos + module.rotate_half(q) * sin, k * cos + module.rotate_half(k) * sin
            return apply

        norms = (q2.Qwen2VLRMSNorm, q25.Qwen2_5_VLRMSNorm, omni.Qwen2_5OmniRMSNorm, q3.Qwen3VLTextRMSNorm)
        modules = (q2, q25, omni, q3)
        self._saved = [(n, "forward", n.forward) for n in norms] + \
            [(m, "apply_rotary_pos_emb_vision", m.apply_rotary_pos_emb_vision) for m in modules]
        for n in norms:
            n.forward = rms_forward
        for m in modules:
            m.apply_rotary_pos_emb_vision = rotary(m)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, value in self._saved:
            setattr(owner, name, value)


# -- scenarios run on every rank of a gloo world (tests/test_vlm_gloo.py) ------------------------------------
EXTERNAL = {"gradient_sync": "external"}
"""The scenarios sum gradients themselves (``_summed_grads``: a custom all-reduce), not through a wrapper."""


def _collate(samples: list[dict], layout: str) -> dict:
    from evenflow import FlatCollate, PadCollate

    return (PadCollate() if layout == "padded" else FlatCollate())(samples)


def _summed_grads(model: torch.nn.Module, world: int) -> dict[str, torch.Tensor]:
    """Gradients summed over ranks, divided by the world size (what DDP's average gives)."""
    import torch.distributed as dist

    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        out[name] = g / world
    return out


def run_exact(rank: int, world: int, group, *, family: str, layout: str, dtype: torch.dtype, lift: bool,
              per_rank: list[list[dict]], config_kwargs: dict | None = None, adapter_cls=None,
              infos: list | None = None, with_reference: bool = True) -> dict:
    """One balanced step against the stock reference on the union of every rank's samples (``with_reference=
    False``: no reference, for data the stock model itself refuses)."""
    import contextlib

    import torch.distributed as dist

    from evenflow.vlm import BalancedVLM, VLMConfig

    trained = [s for r, samples in enumerate(per_rank) for s in samples
               if infos is None or not infos[r].is_idle]
    with float64_throughout() if lift else contextlib.nullcontext():
        model = tiny_model(family, dtype)
        ref_loss, ref = reference(model, trained) if with_reference else (float("nan"), {})
        config = VLMConfig(layout=layout, **{**EXTERNAL, **(config_kwargs or {})})
        vlm = BalancedVLM(model, group=group, config=config, adapter=adapter_cls)
        step = vlm(_collate(per_rank[rank], layout) if per_rank[rank] else None, infos[rank] if infos else None)
        step.loss.backward()
    grads = _summed_grads(model, world)
    loss = torch.tensor([step.loss_sum / step.loss_tokens], dtype=torch.float64)
    dist.all_reduce(loss)
    rows = int(step.plan.items["vision"].rows[step.plan.items["vision"].dest == rank].sum())
    unused = set(vlm.adapter.unused_parameters())  # the stock forward never uses them (test_vlm_facts.py)
    missing = [n for n, p in model.named_parameters() if p.grad is None and n not in unused]
    items = {p: int((step.plan.source[step.plan.items[p].example] == rank).sum()) for p in step.plan.phases}
    return dict(loss=float(loss), ref_loss=ref_loss, grad_err=rel_err(grads, ref), examples=step.examples,
                encoded=step.encoded["vision"], encoded_by_phase=dict(step.encoded), held_items=items,
                encoded_rows=rows, missing_grads=missing, unused=sorted(unused), imbalance=step.imbalance(),
                fingerprint=step.plan.fingerprint())


def expect_failure(fn, *args, **kwargs) -> dict:
    """Run ``fn``; return what it raised (type, message, PeerError fields) and after how many seconds."""
    import time

    start = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the scenario reports what was raised
        return dict(type=type(exc).__name__, message=str(exc), rank=getattr(exc, "rank", None),
                    sample_index=getattr(exc, "sample_index", None), notes=list(getattr(exc, "__notes__", [])),
                    seconds=time.monotonic() - start)
    return dict(type=None)


class CollectiveCounter:
    """Wraps the ``torch.distributed`` collectives; counts calls per (name, group is the orchestrator's)."""

    NAMES = ("all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single", "all_reduce", "broadcast",
             "reduce_scatter_tensor", "all_gather_object", "gather", "scatter", "barrier", "send", "recv")

    def __init__(self, group) -> None:
        self.group = group
        self.calls: list[tuple[str, bool]] = []

    def __enter__(self) -> "CollectiveCounter":
        import torch.distributed as dist

        self._saved = {name: getattr(dist, name) for name in self.NAMES}

        def wrap(name, fn):
            def counted(*args, **kwargs):
                self.calls.append((name, kwargs.get("group") is self.group))
                return fn(*args, **kwargs)
            return counted

        for name, fn in self._saved.items():
            setattr(dist, name, wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def take(self) -> dict:
        out: dict = {}
        for name, ours in self.calls:
            key = name if ours else f"other:{name}"
            out[key] = out.get(key, 0) + 1
        self.calls = []
        return out


def failing_adapter(fail_rank: int, *, die: bool = False):
    """A Qwen adapter whose encoder raises on ``fail_rank`` (an encoder bug), or whose process dies there (the
    OOM killer: ``os._exit``, no exception, no report)."""
    import os

    import torch.distributed as dist

    from evenflow.vlm import QwenVLAdapter

    class FailingEncoder(QwenVLAdapter):
        def encode(self, phase, rows, item_rows, item_meta):
            if dist.get_rank() == fail_rank:
                if die:
                    os._exit(3)
                raise RuntimeError(f"encoder blew up on {len(item_rows)} items")
            return super().encode(phase, rows, item_rows, item_meta)

    return FailingEncoder


def step_info(*, samples: list[dict], world: int, global_tokens: int, idle: bool = False, ids: list[int] | None = None):
    """A StepInfo as the loader hands it (accumulation 1)."""
    from evenflow.step_info import StepInfo

    local = 0 if idle else supervised(samples)
    return StepInfo(step=0, epoch=0, is_idle=idle, local_samples=0 if idle else len(samples),
                    global_samples=0, local_loss_tokens=local, global_loss_tokens=global_tokens,
                    loss_scale=world * local / global_tokens, padded_tokens=0, real_tokens=0,
                    sample_ids=[] if idle else list(ids if ids is not None else range(len(samples))),
                    world_size=world, window_loss_tokens=global_tokens)


def per_rank_text_only(seed: int = 1) -> list[list[dict]]:
    gen = torch.Generator().manual_seed(seed)
    return [[sample(gen, 12, [])], [sample(gen, 20, []), sample(gen, 3, [])], [sample(gen, 7, [])]]


def per_rank_many(seed: int = 2, count: int = 24) -> list[list[dict]]:
    """Rank 0 holds ``count`` examples with two small images each: more metadata than 256 words."""
    gen = torch.Generator().manual_seed(seed)
    many = [sample(gen, 2, [("image", (1, 4, 4)), ("image", (1, 4, 4))]) for _ in range(count)]
    return [many, [sample(gen, 5, [])], [sample(gen, 5, [("image", (1, 4, 4))])]]


def count_collectives(rank: int, world: int, group, *, per_rank: list[list[dict]], metadata_words: int = 1024
                      ) -> dict:
    """Collectives of one balanced step (forward, then backward), by name, on the orchestrator's group or not."""
    from evenflow.vlm import BalancedVLM, VLMConfig

    model = tiny_model("qwen2_vl", torch.float32)
    vlm = BalancedVLM(model, group=group, config=VLMConfig(metadata_words=metadata_words, **EXTERNAL))
    batch = _collate(per_rank[rank], "packed")
    with CollectiveCounter(group) as counter:
        step = vlm(batch)
        forward = counter.take()
        step.loss.backward()
        backward = counter.take()
    return dict(forward=forward, backward=backward)


# -- the same step in one process (no exchange): tests/test_vlm_facts.py ------------------------------------
def local_llm(model: torch.nn.Module, samples: list[dict], layout: str = "packed", **config_kwargs):
    """``(adapter, LLMInputs, LLMBatch)`` of ``samples`` on one process: find, position, encode (no move)."""
    from evenflow.balance.phases import OrchestratorConfig
    from evenflow.exchange import local_step
    from evenflow.vlm import VLMConfig, adapter_for, llm_batch

    adapter = adapter_for(model, VLMConfig(layout=layout, **config_kwargs))
    examples = adapter.find_items(_collate(samples, layout))
    config = OrchestratorConfig(encoders=adapter.phases, token_fields=adapter.token_fields,
                                output_dim=adapter.hidden_size)
    dtype = next(model.parameters()).dtype
    encoders = {p: (lambda r, n, m=torch.zeros(0, 0, dtype=torch.long), p=p: adapter.encode(p, r, n, m))
                for p in adapter.phases}
    llm = local_step(examples, encoders, config, total_loss_tokens=supervised(samples), dtype=dtype)
    return adapter, llm, llm_batch(llm, layout, field_widths=adapter.token_fields)


def grads_of(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    out = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
           for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def targets_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                           reduction="sum")


def pooled(parts: list[torch.Tensor], like: torch.Tensor):
    """``BaseModelOutputWithPooling`` holding ``cat(parts)`` (or an empty slice of ``like``)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return BaseModelOutputWithPooling(pooler_output=(torch.cat(parts) if parts else like[:0],))
