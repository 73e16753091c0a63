"""Real media through DynamicBatchLoader into the orchestrated tiny MLLM on 3 gloo ranks.

One spawned world runs one loader epoch (patch and frame budgets) with full orchestration, then one forced
step in which only rank 0 holds anything (one image sample and one text sample: no rank has audio, and at
least two ranks encode no image). Rank 0 recomputes every step on the whole global batch in one process
(float64) and compares gradients.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_world
from _media import CachedDataset, real_samples

pytestmark = pytest.mark.multiprocess
pytest.importorskip("transformers", reason="needs the demo extra: pip install 'evenflow[demo]'")
pytest.importorskip("espeakng_loader", reason="needs the audio extra: pip install 'evenflow[audio]'")
pytest.importorskip("chitchat_dataset", reason="needs the demo extra: pip install 'evenflow[demo]'")

WORLD = 3
REL_TOL = 1e-10
BUDGETS = dict(token_budget=400, extra_budgets={"num_patches": 520, "num_frames": 600})


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.full((p.numel(),), float("nan"),
                                                                                  dtype=torch.float64)
                      for p in model.parameters()])


def _reference(model, samples, fold, ocfg) -> torch.Tensor:
    """Gradient of the global per-token mean loss of ``samples``, one process, no exchange."""
    from evenflow.exchange import local_step
    from evenflow.testing import example_from_sample

    examples = [example_from_sample(s, fold, dtype=torch.float64) for s in samples]
    total = sum(ex.meta(ocfg).loss_tokens for ex in examples)
    model.zero_grad()
    loss = model.lm_loss_sum(local_step(examples, model.encoders(), ocfg, total_loss_tokens=total,
                                        dtype=torch.float64)) / total
    loss.backward()
    return _flat_grads(model)


def _train_step(model, orch, fold, samples, dataset, rank):
    """One orchestrated step; returns what the parent checks (gradients summed over ranks)."""
    from evenflow.testing import example_from_sample, orchestrated_step

    local = [example_from_sample(s, fold, dtype=torch.float64) for s in samples]
    model.zero_grad()
    res = orchestrated_step(model, orch, local, dtype=torch.float64)
    grads = _flat_grads(model)
    dist.all_reduce(grads)  # sum: the loss is already normalized by the global supervised tokens
    return res, grads


def _scenario(rank: int, world: int, samples: tuple) -> dict:
    from evenflow import DynamicBatchLoader, pop_step_info
    from evenflow.exchange import GlobalOrchestrator
    from evenflow.data.audio import AUDIO_PAD_ID
    from evenflow.data.multimodal import MediaCollate
    from evenflow.testing import TinyMLLM, TokenFold, orchestrator_config, real_media_config

    torch.set_num_threads(1)
    dataset = CachedDataset(samples)
    cfg = real_media_config(max_len=512)
    torch.manual_seed(0)
    model = TinyMLLM(cfg).double()
    image_pad = 151655  # Qwen3 <|image_pad|>
    fold = TokenFold(image_pad_id=image_pad, audio_pad_id=AUDIO_PAD_ID, config=cfg)
    ocfg = orchestrator_config(cfg, ranks_per_node=2)
    loader = DynamicBatchLoader(dataset, collate_fn=MediaCollate(), cost="summed", buffer_size=8, seed=1,
                                **BUDGETS)
    orch = GlobalOrchestrator(ocfg, group=dist.new_group(backend="gloo"))
    steps = []
    for batch in loader:
        info = pop_step_info(batch)
        mine = [] if info.is_idle else batch["samples"]
        ids = [None] * world
        dist.all_gather_object(ids, list(info.sample_ids) if not info.is_idle else [])
        res, grads = _train_step(model, orch, fold, mine, dataset, rank)
        ref = _reference(model, [dataset[i] for r in ids for i in r], fold, ocfg) if rank == 0 else None
        steps.append(_record(res, grads, ref, mine, ids, info))
    # Forced step: only rank 0 holds data -- one image sample and one text-only sample, no audio anywhere.
    kinds = [s["kind"] for s in samples]
    forced_ids = [kinds.index(1), kinds.index(0)] if rank == 0 else []
    res, grads = _train_step(model, orch, fold, [dataset[i] for i in forced_ids], dataset, rank)
    ref = _reference(model, [dataset[kinds.index(1)], dataset[kinds.index(0)]], fold, ocfg) if rank == 0 else None
    forced = _record(res, grads, ref, [dataset[i] for i in forced_ids], None, None)
    # The example script's training loop (optimizer steps included) on the same data and world.
    example = _load_example().train(dataset, mode="full", token_budget=BUDGETS["token_budget"],
                                    patch_budget=BUDGETS["extra_budgets"]["num_patches"],
                                    frame_budget=BUDGETS["extra_budgets"]["num_frames"], num_workers=0, max_len=512)
    return {"steps": steps, "forced": forced, "budgets_ok": all(s["within_budget"] for s in steps),
            "example": example}


def _load_example():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "mllm_train.py"
    spec = importlib.util.spec_from_file_location("mllm_train_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(res, grads, ref, mine, ids, info) -> dict:
    err = None
    if ref is not None:
        err = float((grads - ref).abs().max() / ref.abs().max())
    patches = sum(int(s["num_patches"]) for s in mine)
    frames = sum(int(s["num_frames"]) for s in mine)
    tokens = sum(len(s["input_ids"]) for s in mine)
    return {"grad_err": err, "loss": res.loss, "encoder_calls": res.encoder_calls,
            "encoded_items": res.encoded_items, "local_images": sum(int(s["num_patches"]) > 0 for s in mine),
            "local_audio": sum(int(s["num_frames"]) > 0 for s in mine), "fingerprint": res.fingerprint,
            "sample_ids": ids, "idle": bool(info.is_idle) if info is not None else not mine,
            "within_budget": tokens <= BUDGETS["token_budget"] and patches <= BUDGETS["extra_budgets"]["num_patches"]
            and frames <= BUDGETS["extra_budgets"]["num_frames"]}


@pytest.fixture(scope="module")
def world():
    samples = real_samples()
    return samples, run_world(_scenario, WORLD, samples, timeout=240.0, pg_timeout_s=120.0)


def test_equal_steps_and_exactly_once(world):
    samples, results = world
    counts = [len(r["steps"]) for r in results]
    assert len(set(counts)) == 1 and counts[0] > 1, counts
    seen = [i for step in results[0]["steps"] for per_rank in step["sample_ids"] for i in per_rank]
    assert sorted(seen) == list(range(len(samples)))
    assert all(r["budgets_ok"] for r in results)


def test_every_rank_computes_the_same_plan(world):
    _, results = world
    for k in range(len(results[0]["steps"])):
        assert len({r["steps"][k]["fingerprint"] for r in results}) == 1, k


def test_gradients_equal_the_float64_single_process_reference(world):
    _, results = world
    errs = [s["grad_err"] for s in results[0]["steps"]] + [results[0]["forced"]["grad_err"]]
    assert max(errs) < REL_TOL, errs


def test_every_rank_enters_every_encoder_even_without_media(world):
    _, results = world
    for r, res in enumerate(results):
        for s in res["steps"] + [res["forced"]]:
            assert s["encoder_calls"] == {"vision": 1, "audio": 1}, (r, s)
    # The loader epoch had steps where a rank held no image or no audio of its own ...
    assert any(s["local_images"] == 0 or s["local_audio"] == 0 for res in results for s in res["steps"])
    # ... and the forced step: ranks 1 and 2 hold nothing, no rank holds audio, at most one rank encodes the image.
    forced = [res["forced"] for res in results]
    assert [f["local_images"] for f in forced] == [1, 0, 0] and all(f["local_audio"] == 0 for f in forced)
    assert sum(f["encoded_items"]["vision"] for f in forced) == 1
    assert sum(f["encoded_items"]["vision"] == 0 for f in forced) == WORLD - 1
    assert all(f["encoded_items"]["audio"] == 0 for f in forced)
    assert sorted(f["idle"] for f in forced) == [False, True, True]


def test_the_example_script_trains_every_sample_once_on_every_rank(world):
    samples, results = world
    records = [r["example"] for r in results]
    assert len({len(r) for r in records}) == 1 and len(records[0]) > 1
    assert sum(rec["samples"] for rec in records[0]) == len(samples)  # global samples per step, summed
    assert all(math.isfinite(rec["loss"]) for r in records for rec in r)
    assert [rec["loss"] for rec in records[0]] == [rec["loss"] for rec in records[1]]  # all-reduced: same view
