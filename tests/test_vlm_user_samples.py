"""A VLM user's own samples on 2 real gloo ranks: nothing trains silently wrong.

The dataset is what a user builds: per-sample dicts from the stock ``Qwen2VLImageProcessorPil`` on scikit-image
photos, the image placeholder expanded by hand as ``Qwen2VLProcessor`` does (``grid.prod() // merge**2``
copies), text-only samples without pixel keys, and the same samples padded as a processor called with
``padding="max_length"`` pads them (left or right, ``attention_mask`` zeros, labels -100 there). The model is a
tiny stock Qwen2-VL built from its config, float32, unmodified. Exactness is against the stock forward and
backward on the union of every rank's (unpadded) samples of each accumulation window, in one process.

One spawned world runs every scenario; each rank reports, the tests below assert.
"""

from __future__ import annotations

import copy
import functools
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import vlm_scenarios as sc
from _dist import run_world
from _media import CachedDataset

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORLD = 2
TOL = 1e-5
PATCH_BUDGET = 128
"""``max_encoder_rows``: patch rows before merging per batch (each photo here is 48 or 64 rows)."""
ENCODER_ROWS_CAP = 64
"""A budget that binds: one photo per batch."""
MIN_PIXELS, MAX_PIXELS = 16 * 14 * 14, 64 * 14 * 14
PAD = 0
LOADER = dict(buffer_size=64, max_steps_per_round=4)
ONE_RANK_TIMEOUT_S = 8
"""The loader's ``timeout`` where only rank 0 calls the step: the step gives up after half of it."""


# -- the user's dataset ----------------------------------------------------------------------------------------
def _photos() -> list[Path]:
    """scikit-image's own photos (shipped in its wheel: no download)."""
    import importlib.util

    folder = Path(list(importlib.util.find_spec("skimage").submodule_search_locations)[0]) / "data"
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg"))[:8]


@functools.lru_cache(maxsize=1)
def user_samples() -> tuple[dict, ...]:
    """10 samples as a processor returns them for one conversation (batch dimension removed): 6 with a photo,
    4 text-only (no pixel keys); ``mm_token_type_ids`` on each, as ``Qwen2VLProcessor`` returns them."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    gen = torch.Generator().manual_seed(7)
    out = []
    photos = _photos()
    for i in range(10):
        prompt = torch.randint(1, 200, (3,), generator=gen).tolist()
        answer = torch.randint(1, 200, (int(torch.randint(4, 28, (1,), generator=gen)),), generator=gen).tolist()
        sample: dict = {}
        ids = list(prompt)
        if i % 5 < 3:  # a photo
            image = Image.open(photos[i % len(photos)]).convert("RGB")
            px = processor(images=[image], return_tensors="pt")
            grid = px["image_grid_thw"]
            tokens = int(grid.prod()) // processor.merge_size ** 2  # what Qwen2VLProcessor expands <|image_pad|> to
            ids += [sc.VISION_START] + [sc.IMAGE_ID] * tokens + [sc.VISION_END]
            sample.update(pixel_values=px["pixel_values"], image_grid_thw=grid)
        ids += answer
        input_ids = torch.tensor(ids)
        labels = input_ids.clone()
        labels[:len(ids) - len(answer)] = -100
        sample.update(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels,
                      mm_token_type_ids=(input_ids == sc.IMAGE_ID).long())
        out.append(sample)
    return tuple(out)


def padded(samples, side: str) -> list[dict]:
    """``padding="max_length"``: every sample to the longest + 5, pad id 0, mask 0 and labels -100 there."""
    width = max(len(s["input_ids"]) for s in samples) + 5
    out = []
    for s in samples:
        n = width - len(s["input_ids"])

        def pad(t, value):
            fill = torch.full((n,), value, dtype=t.dtype)
            return torch.cat([fill, t]) if side == "left" else torch.cat([t, fill])

        p = dict(s)
        p.update(input_ids=pad(s["input_ids"], PAD), attention_mask=pad(s["attention_mask"], 0),
                 labels=pad(s["labels"], -100), mm_token_type_ids=pad(s["mm_token_type_ids"], 0))
        out.append(p)
    return out


def _dataset(pad: str | None) -> CachedDataset:
    return CachedDataset(user_samples() if pad is None else padded(user_samples(), pad))


def _loader(dataset, layout: str, **kwargs):
    import evenflow

    cost = "summed" if layout == "packed" else "padded"
    options = dict(token_budget=160 if layout == "packed" else 128, cost=cost, **LOADER)
    return evenflow.DynamicBatchLoader(dataset, **{**options, **kwargs})


# -- scenarios, on every rank ----------------------------------------------------------------------------------
def _steps(rank: int, pad: str | None, layout: str, rows: int | None = None) -> dict:
    """The batches a loader makes of the samples: each step's sample ids and patch rows on this rank."""
    import evenflow

    budget = {} if rows is None else {"max_encoder_rows": rows}
    with _loader(_dataset(pad), layout, **budget) as loader:
        out: dict = dict(ids=[], rows=[])
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            out["ids"].append(sorted(info.sample_ids))
            out["rows"].append(0 if info.is_idle or "pixel_values" not in batch else batch["pixel_values"].shape[0])
    return out


def _exact(rank: int, world: int, *, pad: str | None, layout: str, accum: int = 1, rows: int | None = None) -> dict:
    """The user's loop -- DDP, the loader, the balanced step -- against the stock model on the union of each
    window's unpadded samples: the logged loss and every gradient."""
    import torch.distributed as dist

    import evenflow
    from evenflow.vlm import BalancedVLM, VLMConfig

    model = sc.tiny_model("qwen2_vl", torch.float32)
    ref_model = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    vlm = BalancedVLM(ddp, group=dist.new_group(backend="gloo"),
                      config=VLMConfig(layout=layout, max_encoder_rows=rows))
    truth = user_samples()
    worst = dict(loss=0.0, grad=0.0)
    windows, ids, logged = 0, [], 0.0
    options = {"max_samples": 1} if accum > 1 else {}  # several accumulation windows of 10 samples
    options.update({} if rows is None else {"max_encoder_rows": rows})
    with _loader(_dataset(pad), layout, grad_accum_steps=accum, **options) as loader:
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            with ddp.no_sync() if not info.window_end else _nothing():
                step = vlm(batch, info)
                step.loss.backward()
            ids += list(info.sample_ids)
            logged += step.window_loss
            if accum == 1:
                assert step.window_loss == step.mean_loss
            if not info.window_end:
                continue
            every = [None] * world
            dist.all_gather_object(every, ids)
            union = [truth[i] for r in every for i in r]
            ref_loss, ref_grads = sc.reference(ref_model, union)
            grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
            worst["loss"] = max(worst["loss"], abs(logged - ref_loss) / abs(ref_loss))
            worst["grad"] = max(worst["grad"], sc.rel_err(grads, ref_grads))
            model.zero_grad(set_to_none=True)
            windows, ids, logged = windows + 1, [], 0.0
    return dict(worst, windows=windows)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _unwrapped(rank: int) -> dict:
    import torch.distributed as dist

    from evenflow.vlm import BalancedVLM

    return sc.expect_failure(BalancedVLM, sc.tiny_model("qwen2_vl", torch.float32),
                             group=dist.new_group(backend="gloo"))


def _hooks_removed(rank: int) -> dict:
    """DDP whose comm hook hands back each rank's own gradients (the all-reduce removed): it looks synced at
    construction, and its replicas drift from the first optimizer step."""
    import torch.distributed as dist

    from evenflow import PadCollate
    from evenflow.vlm import BalancedVLM

    def local_only(state, bucket):
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    model = sc.tiny_model("qwen2_vl", torch.float32)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, local_only)
    vlm = BalancedVLM(ddp, group=dist.new_group(backend="gloo"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    samples = user_samples()
    calls = 0
    try:
        for call in range(4):
            mine = [samples[(2 * call + rank) % len(samples)], samples[(2 * call + rank + 5) % len(samples)]]
            calls = call
            vlm(PadCollate()(mine)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as exc:  # noqa: BLE001 - reported
        return dict(type=type(exc).__name__, message=str(exc), call=calls)
    return dict(type=None, call=calls)


def _no_step_info(rank: int) -> dict:
    """The loader's batch handed to the step with its StepInfo still in it."""
    import torch.distributed as dist

    from evenflow.vlm import BalancedVLM, VLMConfig

    model = sc.tiny_model("qwen2_vl", torch.float32)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    vlm = BalancedVLM(ddp, group=dist.new_group(backend="gloo"))
    calls = 0
    start = time.monotonic()
    try:
        with _loader(_dataset(None), "padded") as loader:
            for batch in loader:
                vlm(batch).loss.backward()
                calls += 1
    except Exception as exc:  # noqa: BLE001 - reported
        return dict(type=type(exc).__name__, message=str(exc), calls=calls, seconds=time.monotonic() - start)
    return dict(type=None, calls=calls)


def _budgets(rank: int, loader_kwargs: dict, vlm_rows: int | None) -> dict:
    """A loader and a balanced step with different encoder budgets: refused before the first step trains."""
    import torch.distributed as dist

    import evenflow
    from evenflow.vlm import BalancedVLM, VLMConfig

    model = sc.tiny_model("qwen2_vl", torch.float32)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    vlm = BalancedVLM(ddp, group=dist.new_group(backend="gloo"), config=VLMConfig(max_encoder_rows=vlm_rows))
    trained = 0
    try:
        with evenflow.DynamicBatchLoader(_dataset(None), token_budget=128, **LOADER, **loader_kwargs) as loader:
            for batch in loader:
                info = evenflow.pop_step_info(batch)
                vlm(batch, info).loss.backward()
                trained += 1
    except Exception as exc:  # noqa: BLE001 - reported
        return dict(type=type(exc).__name__, message=str(exc), trained=trained)
    return dict(type=None, trained=trained)


def _one_rank_calls(rank: int) -> dict:
    """Only rank 0 calls the balanced step; rank 1 iterates the loader without it. Last scenario: the step's
    group is left with rank 0's unanswered exchange, which rank 1 answers at the end."""
    import torch.distributed as dist

    import evenflow
    from evenflow.vlm import BalancedVLM, VLMConfig

    model = sc.tiny_model("qwen2_vl", torch.float32)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    group = dist.new_group(backend="gloo")
    vlm = BalancedVLM(ddp, group=group)
    start = time.monotonic()
    out: dict = dict(type=None)
    try:
        with _loader(_dataset(None), "padded", timeout=timedelta(seconds=ONE_RANK_TIMEOUT_S)) as loader:
            for batch in loader:
                info = evenflow.pop_step_info(batch)
                if rank == 0:
                    vlm(batch, info).loss.backward()
    except Exception as exc:  # noqa: BLE001 - reported
        out = dict(type=type(exc).__name__, message=str(exc), rank=getattr(exc, "rank", None))
    out["seconds"] = time.monotonic() - start
    if rank == 1:  # answer rank 0's exchange, so no collective is left open on the group
        row = torch.zeros(vlm.config.metadata_words, dtype=torch.int64)
        work = dist.all_gather([torch.empty_like(row) for _ in range(WORLD)], row, group=group, async_op=True)
        try:
            work.wait(timedelta(seconds=10))
        except RuntimeError:
            pass
    return out


def _loader_only_ddp(rank: int) -> dict:
    """The loader alone under DDP with find_unused_parameters=True: a text-only epoch with an IDLE step trains
    (the stock forward, scale_loss); the vision tower gets no gradient and DDP does not mind."""
    import torch.distributed as dist

    import evenflow

    model = sc.tiny_model("qwen2_vl", torch.float32)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    text = [s for s in user_samples() if "pixel_values" not in s][:3]
    steps, idle = 0, 0
    with evenflow.DynamicBatchLoader(CachedDataset(text), token_budget=48, max_samples=1, **LOADER) as loader:
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            inputs = sc.model_inputs(batch, model)
            out = ddp(**inputs, labels=batch["labels"], use_cache=False)
            evenflow.scale_loss(out.loss, info).backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            idle += int(info.is_idle)
    total = torch.tensor([sum(float(p.detach().double().sum()) for p in model.parameters())], dtype=torch.float64)
    every = [torch.zeros_like(total) for _ in range(WORLD)]
    dist.all_gather(every, total)
    return dict(steps=steps, idle=idle, checksums=[float(t) for t in every])


def _world(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out: dict = {"seconds": {}}

    def run(name, fn, *args, **kwargs):
        start = time.monotonic()
        try:
            out[name] = fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - reported per scenario
            out[name] = {"error": traceback.format_exc()}
        out["seconds"][name] = round(time.monotonic() - start, 2)

    for pad in (None, "left", "right"):
        run(f"steps/{pad}", _steps, rank, pad, "padded")
    run("steps/left/packed", _steps, rank, "left", "packed")
    run("steps/None/packed", _steps, rank, None, "packed")
    run("steps/rows", _steps, rank, "left", "padded", rows=ENCODER_ROWS_CAP)
    run("exact/left/padded", _exact, rank, world, pad="left", layout="padded")
    run("exact/right/packed/rows", _exact, rank, world, pad="right", layout="packed", rows=PATCH_BUDGET)
    run("exact/left/packed/accum2", _exact, rank, world, pad="left", layout="packed", accum=2)
    run("unwrapped", _unwrapped, rank)
    run("hooks_removed", _hooks_removed, rank)
    run("no_step_info", _no_step_info, rank)
    run("budgets/new", _budgets, rank, dict(max_encoder_rows=PATCH_BUDGET), 256)
    run("budgets/extra", _budgets, rank, dict(extra_budgets={"num_patches": PATCH_BUDGET}), None)
    run("loader_only_ddp", _loader_only_ddp, rank)
    run("one_rank", _one_rank_calls, rank)
    return out


@pytest.fixture(scope="module")
def world():
    return run_world(_world, WORLD, timeout=240, pg_timeout_s=60)


def _ok(world, name) -> list:
    """Every rank's report of scenario ``name``; one that raised fails the test with its traceback."""
    reports = [res[name] for res in world]
    raised = [(r, x["error"]) for r, x in enumerate(reports) if isinstance(x, dict) and "error" in x]
    if raised:
        pytest.fail("\n".join(f"scenario {name} raised on rank {r}:\n{text}" for r, text in raised))
    return reports


# -- padding -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["left", "right", "left/packed"])
def test_padded_samples_cost_only_their_real_tokens(world, name):
    """A processor's padding (left or right) makes the same batches as the unpadded samples: the same steps,
    each of the same samples."""
    unpadded = "steps/None/packed" if name.endswith("packed") else "steps/None"
    assert [r["ids"] for r in _ok(world, f"steps/{name}")] == [r["ids"] for r in _ok(world, unpadded)]


def test_the_encoder_budget_is_read_off_the_grids(world):
    """``max_encoder_rows`` alone (no per-sample key to invent): no batch holds more patch rows."""
    free = [rows for r in _ok(world, "steps/None") for rows in r["rows"]]
    capped = [rows for r in _ok(world, "steps/rows") for rows in r["rows"]]
    assert max(free) > ENCODER_ROWS_CAP >= max(capped), (free, capped)
    assert sum(free) == sum(capped)  # every photo trained, none dropped


@pytest.mark.parametrize("name", ["exact/left/padded", "exact/right/packed/rows", "exact/left/packed/accum2"])
def test_padded_samples_train_exactly_what_the_stock_model_trains_on_the_unpadded_ones(world, name):
    res = _ok(world, name)
    for r in res:
        assert r["windows"] >= 2, r
        assert r["loss"] <= TOL, (name, r)   # the logged global mean (step.mean_loss / window_loss)
        assert r["grad"] <= TOL, (name, r)   # every parameter, after DDP's average


# -- replicas ----------------------------------------------------------------------------------------------------
def test_an_unwrapped_model_is_refused_at_construction(world):
    for r in _ok(world, "unwrapped"):
        assert r["type"] == "ValueError", r
        assert "DistributedDataParallel" in r["message"] and "fully_shard" in r["message"], r
        assert "gradient_sync='external'" in r["message"], r


def test_replicas_whose_sync_was_removed_are_refused_at_the_third_step_on_every_rank(world):
    for r in _ok(world, "hooks_removed"):
        assert r["type"] == "RuntimeError" and r["call"] == 2, r
        assert "parameters differ across ranks" in r["message"], r


# -- errors that lead to the fix -----------------------------------------------------------------------------------
def test_a_step_called_without_its_step_info_raises_at_once_naming_pop_step_info(world):
    for r in _ok(world, "no_step_info"):
        assert r["calls"] == 0, r                          # the first call, nothing trained
        assert r["type"] in ("StepInfoMisuse", "PeerError"), r
        assert "pop_step_info" in r["message"] and "vlm(batch, info)" in r["message"], r
        assert "scale_loss(loss" not in r["message"], r   # not the plain loop's fix


@pytest.mark.parametrize("name", ["budgets/new", "budgets/extra"])
def test_a_loader_and_a_step_with_different_encoder_budgets_are_refused_before_step_0(world, name):
    for r in _ok(world, name):
        assert r["trained"] == 0, r
        assert r["type"] in ("ValueError", "PeerError"), r
        assert f"max_encoder_rows={PATCH_BUDGET}" in r["message"], r


def test_a_step_called_on_one_rank_only_fails_within_the_loaders_timeout_naming_the_call(world):
    res = _ok(world, "one_rank")
    assert res[0]["type"] == "TimeoutError" and "balanced step" in res[0]["message"], res[0]
    assert "vlm(batch, info)" in res[0]["message"], res[0]
    assert res[1]["type"] == "PeerError" and res[1]["rank"] == 0, res[1]
    assert "balanced step" in res[1]["message"], res[1]          # the call, not the loader
    assert all(r["seconds"] < ONE_RANK_TIMEOUT_S for r in res), res  # within the loader's timeout


# -- the loader alone under DDP ------------------------------------------------------------------------------------
def test_the_loader_alone_under_ddp_with_find_unused_parameters_trains_a_text_only_and_idle_epoch(world):
    res = _ok(world, "loader_only_ddp")
    assert res[0]["steps"] == res[1]["steps"] == 2, res
    assert sum(r["idle"] for r in res) == 1, res
    assert res[0]["checksums"][0] == res[0]["checksums"][1], res  # the replicas stayed equal


def test_the_hf_trainer_finds_unused_parameters_for_a_model_with_a_vision_tower(tmp_path):
    from transformers import TrainingArguments

    from evenflow.integrations.hf import DynamicBatchTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no",
                             remove_unused_columns=False, disable_tqdm=True)
    trainer = DynamicBatchTrainer(model=sc.tiny_model("qwen2_vl", torch.float32), args=args,
                                  train_dataset=CachedDataset(user_samples()), token_budget=128)
    assert trainer.args.ddp_find_unused_parameters is True
    assert args.ddp_find_unused_parameters is None                 # the user's arguments are not changed
    off = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no",
                            remove_unused_columns=False, disable_tqdm=True, ddp_find_unused_parameters=False)
    kept = DynamicBatchTrainer(model=sc.tiny_model("qwen2_vl", torch.float32), args=off,
                               train_dataset=CachedDataset(user_samples()), token_budget=128)
    assert kept.args.ddp_find_unused_parameters is False          # an explicit choice stands


# -- one process: what the loader reads off a sample ---------------------------------------------------------------
def test_a_sample_over_the_encoder_budget_is_refused_naming_the_budget():
    import evenflow

    with evenflow.DynamicBatchLoader(CachedDataset(user_samples()), token_budget=128, max_encoder_rows=32) as loader:
        with pytest.raises(Exception, match=r"num_patches=(48|64) exceeds max_encoder_rows=32"):
            for batch in loader:
                evenflow.pop_step_info(batch)


def test_a_mask_with_zeros_between_real_tokens_is_refused_before_the_first_step_naming_the_sample():
    import evenflow

    samples = list(user_samples())
    holed = dict(samples[3], attention_mask=samples[3]["attention_mask"].clone())
    holed["attention_mask"][2] = 0
    samples[3] = holed
    with evenflow.DynamicBatchLoader(CachedDataset(samples), token_budget=128, shuffle=False) as loader:
        with pytest.raises(Exception, match=r"sample 3: 'attention_mask' has zeros between real tokens"):
            next(iter(loader))
