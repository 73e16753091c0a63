"""examples/vlm_train.py's three entry points on 3 gloo ranks, against the stock model trained on one process.

Each run trains a tiny stock Qwen2-VL / Qwen2.5-VL for 3 steps (4 micro-steps in 2 accumulation windows for one
of them) on real photos and pan videos (SGD, float32, the unmodified model): a plain loop under DDP (with and
without ``find_unused_parameters``), FSDP2 (``fully_shard`` on the vision and text blocks) and
``DynamicBatchTrainer``, with activation checkpointing in three of them. The reference trains the same initial
model on the union of every rank's samples of each step (the global padded batch, summed token loss / the
window's global supervised tokens); every step's loss and the whole parameter update must agree to 1e-5. The
docs page's blocks (docs/vlm.md) run on the same world.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from _dist import run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WORLD, SAMPLES, STEPS, LR, TOL = 3, 18, 3, 0.1, 1e-5
RUNS = {
    "ddp_find_unused": dict(entry="ddp", find_unused=True, family="qwen2_5_vl", layout="padded"),
    "ddp_checkpointing_accum2": dict(entry="ddp", checkpointing=True, accum=2, steps=4),
    "fsdp2_checkpointing": dict(entry="fsdp2", checkpointing=True, layout="padded"),
    "trainer_checkpointing": dict(entry="trainer", checkpointing=True),
    "trainer": dict(entry="trainer"),
}


class _Cached(torch.utils.data.Dataset):
    """The example's dataset, each sample processed once per process (the runs share it)."""

    def __init__(self, base) -> None:
        self.base, self.cache = base, {}

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        if index not in self.cache:
            self.cache[index] = self.base[index]
        return self.cache[index]


def _docs_page(rank: int, world: int) -> dict:
    """docs/vlm.md's blocks on this world: the loop trains an epoch; the chunked adapter gives the plain one's loss."""
    import contextlib
    import io

    import torch.distributed as dist

    from _snippets import snippet
    from evenflow import PadCollate
    from evenflow.vlm import BalancedVLM

    ns: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(snippet("vlm-quickstart"), ns)
    exec(snippet("vlm-adapter"), ns)
    ns["ChunkedQwenVL"].chunk_rows = 32  # every image is several tower calls
    samples = [ns["dataset"][i] for i in range(rank, len(ns["dataset"]), world)]
    batch = PadCollate()(samples)
    plain = BalancedVLM(ns["ddp"], group=dist.new_group(backend="gloo"))
    calls = [0]
    hook = ns["model"].model.visual.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    losses, tower_calls = [], []
    for vlm in (ns["vlm"], plain):
        calls[0] = 0
        out = torch.tensor([vlm(batch).loss_sum, calls[0]], dtype=torch.float64)
        dist.all_reduce(out)
        losses.append(float(out[0]))
        tower_calls.append(int(out[1]))
    hook.remove()
    return dict(printed=printed.getvalue().splitlines(), chunked=losses[0], plain=losses[1], calls=tower_calls)


def _world(rank: int, world: int, out_dir: str) -> dict:
    import integration_scenarios as isc

    isc.torchrun_env(rank, world)  # accelerate (the HF Trainer) reads the job from these
    sys.path.insert(0, str(EXAMPLES))
    import vlm_train

    try:
        docs = _docs_page(rank, world)
    except Exception:  # noqa: BLE001 - reported by its test
        docs = {"error": traceback.format_exc()}
    dataset, vocab = vlm_train.build_dataset(SAMPLES)
    dataset = _Cached(dataset)
    out = {}
    for name, run in RUNS.items():
        opts = {"steps": STEPS} | {k: v for k, v in run.items() if k != "entry"} | {"vocab": vocab}
        try:
            if run["entry"] == "trainer":
                out[name] = vlm_train.train_trainer(dataset, f"{out_dir}/{name}", lr=LR, **opts)
            else:
                out[name] = vlm_train.train(dataset, entry=run["entry"], lr=LR, **opts)
        except Exception:  # noqa: BLE001 - reported per run
            out[name] = {"error": traceback.format_exc()}
    out["docs"] = docs
    out["samples"] = dataset.cache  # what this rank loaded, processed: the reference needs no pipeline of its own
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(_world, WORLD, str(tmp_path_factory.mktemp("vlm_example")), timeout=540, pg_timeout_s=120)


@pytest.fixture(scope="module")
def example(world):
    sys.path.insert(0, str(EXAMPLES))
    import vlm_train

    _, vocab = vlm_train.build_dataset(SAMPLES)  # the vocabulary only (no sample is processed here)
    samples = {i: s for r in world for i, s in r["samples"].items()}
    return vlm_train, samples, vocab


def _reference(vlm_train, dataset, vocab, family: str, windows: list[list[list[int]]]
               ) -> tuple[list[float], dict, dict]:
    """Per-step loss and the total parameter update of SGD on the stock model, one process: each step the
    global padded batch, summed token loss / the window's global supervised tokens, one update per window."""
    import vlm_scenarios as sc
    from evenflow import PadCollate

    model = vlm_train.tiny_vlm(family, vocab=vocab)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for window in windows:
        tokens = sum(sc.supervised([dataset[i] for i in ids]) for ids in window)
        model.zero_grad(set_to_none=True)
        for ids in window:
            batch = PadCollate()([dataset[i] for i in ids])
            loss = sc.loss_sum(model(**sc.model_inputs(batch), use_cache=False).logits, batch["labels"]) / tokens
            loss.backward()
            losses.append(float(loss.detach()))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    return losses, {n: (p.detach() - start[n]).numpy() for n, p in model.named_parameters()}, start


@pytest.mark.parametrize("name", list(RUNS))
def test_entry_point_trains_like_the_stock_model_on_one_process(world, example, name):
    res = [r[name] for r in world]
    for r, value in enumerate(res):
        if "error" in value:
            pytest.fail(f"run {name} failed on rank {r}:\n{value['error']}")
    steps = RUNS[name].get("steps", STEPS)
    counts = [len(r["records"]) for r in res]
    assert counts == [steps] * WORLD, counts
    windows, window = [], []
    for k in range(steps):
        window.append(sorted(i for r in res for i in r["records"][k]["ids"]))
        if res[0]["records"][k]["window_end"]:
            windows.append(window)
            window = []
    assert not window, "the run must end on a window's last step (the reference cannot see the rest of a window)"
    if RUNS[name].get("accum", 1) > 1:
        assert any(len(w) > 1 for w in windows), windows
    vlm_train, dataset, vocab = example
    losses, update, start = _reference(vlm_train, dataset, vocab, RUNS[name].get("family", "qwen2_vl"), windows)
    got = [rec["loss"] for rec in res[0]["records"]]
    np.testing.assert_allclose(got, losses, rtol=TOL)
    params = res[0]["params"]
    ours = np.concatenate([(params[n] - start[n].numpy()).ravel() for n in update])
    ref = np.concatenate([u.ravel() for u in update.values()])
    assert np.linalg.norm(ours - ref) <= TOL * np.linalg.norm(ref), np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    # Every phase was planned on every step, and the plan's imbalance is reported per phase.
    assert set(res[0]["imbalance"]) == {"vision", "llm"}
    assert all(v["after"] <= v["before"] + 1e-9 for v in res[0]["imbalance"].values())


def test_the_docs_page_runs_on_three_ranks(world):
    res = [r["docs"] for r in world]
    for r, value in enumerate(res):
        if "error" in value:
            pytest.fail(f"docs/vlm.md failed on rank {r}:\n{value['error']}")
    steps = [line for line in res[0]["printed"] if line.startswith("step ")]
    assert steps and all("imbalance after {'vision'" in line for line in steps), res[0]["printed"]
    assert res[0]["calls"][0] > res[0]["calls"][1] == WORLD, res[0]["calls"]  # chunked: more tower calls ...
    assert abs(res[0]["chunked"] - res[0]["plain"]) <= 1e-5 * abs(res[0]["plain"]), res[0]  # ... same loss
