"""Trainer integrations, each run for real on a 2-rank gloo CPU world (tests/_dist.py).

One spawned world runs every scenario (imports of transformers/lightning dominate the cost); each check compares
against a single-process float64 reference: every sample trained exactly once per epoch, the per-window loss and
gradient equal to the per-token reference, and a mid-epoch resume that repeats and loses nothing. Frameworks that
are not installed are skipped with the name of the extra that brings them.
"""

from __future__ import annotations

import collections
import importlib.util
import math
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

import integration_scenarios as sc
from _dist import run_world, scenario_results as _results

pytestmark = pytest.mark.multiprocess

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

HAS = {name: importlib.util.find_spec(name) is not None for name in ("transformers", "accelerate", "lightning")}
EXTRA = {"hf": ("transformers", "accelerate"), "accelerate": ("accelerate", "transformers"),
         "lightning": ("lightning", "transformers")}


def _needs(extra: str):
    missing = [m for m in EXTRA[extra] if not HAS[m]]
    return pytest.mark.skipif(bool(missing), reason=f"needs the '{extra}' extra ({', '.join(missing)} not installed): "
                                                    f"pip install 'evenflow[{extra}]'")


def _scenarios(out_dir: str) -> list:
    cases = [("ddp", "sc_ddp", ()), ("fsdp2", "sc_fsdp2", ()), ("eval", "sc_eval", ())]
    if all(HAS[m] for m in EXTRA["hf"]):
        cases += [("hf_epochs", "sc_hf_epochs", (out_dir,)), ("hf_resume", "sc_hf_resume", (out_dir,)),
                  ("accelerate", "sc_accelerate", (out_dir,))]
    if all(HAS[m] for m in EXTRA["lightning"]):
        cases += [("lightning", "sc_lightning", (out_dir,))]
    return cases


def _world_body(rank, world, cases):
    sc.torchrun_env(rank, world)
    out = {}
    for name, fn, args in cases:
        try:
            out[name] = getattr(sc, fn)(rank, world, *args)
        except Exception:  # noqa: BLE001 - report per scenario; the others still run
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """References are tiny sequential forwards: intra-op threads only contend on a loaded CI machine (100x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("integrations"))
    return run_world(_world_body, 2, _scenarios(out_dir), timeout=420, pg_timeout_s=120)




# -- references -------------------------------------------------------------------------------------------------
def _tiny_reference(ids, dataset, model):
    """Per-token mean loss and gradient of examples/_tiny.TinyCausalLM over ``ids``, one sample at a time."""
    model.zero_grad()
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    for i in ids:
        s = dataset[i]
        logits = model(input_ids=s["input_ids"][None])["logits"][0]
        total = total + torch.nn.functional.cross_entropy(logits[:-1], s["labels"][1:], ignore_index=-100,
                                                          reduction="sum")
        tokens += int((s["labels"][1:] != -100).sum())
    loss = total / tokens
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()
    model.zero_grad()
    return float(loss.detach()), grad


def _llama_reference(ids, dataset, model):
    return sc.reference_window(model, dataset, ids)


def _close(a, b, rtol):
    return abs(a - b) <= rtol * abs(b)


def _grad_close(g, ref, rtol):
    return np.linalg.norm(g - ref) <= rtol * np.linalg.norm(ref)


def _epoch_ids(per_rank_windows, epoch):
    return [i for windows in per_rank_windows for w in windows if w["epoch"] == epoch for i in w["ids"]]


def _assert_once(ids, n, what):
    counts = collections.Counter(ids)
    dup = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(set(range(n)) - set(counts))
    assert not dup and not missing, f"{what}: duplicated {dup[:10]}, missing {missing[:10]}"


def _check_windows(per_rank, dataset, model, reference, rtol):
    """Same window count on every rank; loss and (DDP-synced) gradient of each window equal the reference."""
    assert len({len(w) for w in per_rank}) == 1, "ranks ran different numbers of optimizer steps"
    for w in range(len(per_rank[0])):
        ids = [i for windows in per_rank for i in windows[w]["ids"]]
        ref_loss, ref_grad = reference(ids, dataset, model)
        assert _close(per_rank[0][w]["loss"], ref_loss, rtol), (w, per_rank[0][w]["loss"], ref_loss)
        if per_rank[0][w].get("grad") is not None:
            np.testing.assert_allclose(per_rank[0][w]["grad"], per_rank[1][w]["grad"], rtol=0, atol=1e-12)
            assert _grad_close(per_rank[0][w]["grad"], ref_grad, rtol), w


# -- plain loops --------------------------------------------------------------------------------------------------
def test_ddp_loop_exact_once_and_resume(world):
    from _tiny import RandomChat, TinyCausalLM
    res = _results(world, "ddp")
    data, model = RandomChat(96), TinyCausalLM(dtype=torch.float64)
    full = [r["full"] for r in res]
    for epoch in (0, 1):
        _assert_once(_epoch_ids(full, epoch), 96, f"DDP epoch {epoch}")
    _check_windows(full, data, model, _tiny_reference, 1e-10)
    # Evaluation with the same batching: exact per-token loss over the whole eval set, same on every rank.
    ref_eval, _ = _tiny_reference(range(64), RandomChat(64, seed=1), model)
    assert res[0]["eval"] == res[1]["eval"] and _close(res[0]["eval"]["loss"], ref_eval, 1e-10)
    # Preempted at a mid-epoch step, resumed from each rank's checkpoint: nothing repeated, nothing lost.
    stop = res[0]["stop"]
    assert [w["step"] for w in res[0]["first"]][-1] == stop
    combined = [r["first"] + r["second"] for r in res]
    for epoch in (0, 1):
        _assert_once(_epoch_ids(combined, epoch), 96, f"DDP resumed epoch {epoch}")
    assert res[0]["second"][0]["step"] == stop + 1
    _check_windows([r["second"] for r in res], data, model, _tiny_reference, 1e-10)


def test_fsdp2_loop_exact_and_mesh_peers_share_batches(world):
    from _tiny import RandomChat, TinyCausalLM
    res = _results(world, "fsdp2")
    dp = [r["dp"]["windows"] for r in res]
    _assert_once(_epoch_ids(dp, 0), 96, "FSDP2 epoch 0")
    _check_windows(dp, RandomChat(96), TinyCausalLM(dtype=torch.float64), _tiny_reference, 1e-10)
    # dp=1 x tp=2: both ranks are data-parallel rank 0 of 1, and see identical batches covering everything.
    tp = [r["tp"] for r in res]
    assert all(t["dp_rank"] == 0 and t["dp_size"] == 1 for t in tp)
    assert [w["ids"] for w in tp[0]["windows"]] == [w["ids"] for w in tp[1]["windows"]]
    _assert_once(_epoch_ids([tp[0]["windows"]], 0), 96, "FSDP2 tp peer")


def test_eval_loader_every_sample_once_no_side_effects(world):
    from _tiny import RandomChat, TinyCausalLM
    res = _results(world, "eval")
    for p in range(2):
        ids = [i for r in res for s in r["passes"][p] for i in s["ids"]]
        _assert_once(ids, 61, f"eval pass {p}")
    assert [r["passes"][0] for r in res] == [r["passes"][1] for r in res], "two eval passes differ"
    ref, _ = _tiny_reference(range(61), RandomChat(61, seed=2), TinyCausalLM(dtype=torch.float64))
    for r in res:
        assert _close(r["result"]["loss"], ref, 1e-10) and r["result"]["samples"] == 61
        assert r["train_state_same"] and r["params_same"] and not r["grads"] and r["training"]


# -- Hugging Face Trainer -------------------------------------------------------------------------------------------
def _hf_windows(record, logs=None, grads=None):
    """Group micro-batch records by optimizer step; attach HF's logged loss and the recorded gradient."""
    windows = collections.OrderedDict()
    for r in record:
        windows.setdefault(r["global_step"], []).append(r)
    out = []
    for k, (step, micro) in enumerate(windows.items()):
        out.append(dict(epoch=micro[0]["epoch"], step=step + 1, ids=[i for m in micro for i in m["ids"]],
                        micro=len(micro), padding=sum(1 for m in micro if m["idle"] and not m["ids"]),
                        loss=logs[k]["loss"] if logs else None, grad=grads[k] if grads else None))
    return out


@_needs("hf")
def test_hf_trainer_epochs_exact_once_and_eval(world):
    res = _results(world, "hf_epochs")
    data, model = sc.ChatLike(80), sc.tiny_llama()
    per_rank = [_hf_windows(r["record"], r["logs"], r["grads"]) for r in res]
    for epoch in (0, 1):
        _assert_once(_epoch_ids(per_rank, epoch), 80, f"HF epoch {epoch}")
    assert {w["epoch"] for w in per_rank[0]} == {0, 1}, "HF ran past the requested epochs"
    # Every optimizer step is one evenflow window of gradient_accumulation_steps micro-batches (an epoch's
    # shorter last window is completed with IDLE micro-batches), and HF counted exactly those steps.
    assert all(w["micro"] == 3 for w in per_rank[0])
    assert any(w["padding"] for w in per_rank[0]), "this data should end an epoch on a shorter window"
    assert res[0]["global_step"] == len(per_rank[0]) and res[0]["epoch"] == 2.0
    assert all(math.isfinite(log["loss"]) for log in res[0]["logs"])
    # HF computes its causal-LM loss in float32: the reference agrees to float32 rounding.
    _check_windows(per_rank, data, model, _llama_reference, 2e-6)
    ref_eval, _ = sc.reference_window(model, sc.ChatLike(37, seed=1), range(37))
    for r in res:
        assert r["eval"]["eval_samples"] == 37 and _close(r["eval"]["eval_loss"], ref_eval, 2e-6)


@_needs("hf")
def test_hf_trainer_max_steps_resume_loses_and_repeats_nothing(world):
    res = _results(world, "hf_resume")
    step = res[0]["resume_step"]
    assert res[0]["resume_epoch"] >= 1, "the resume point should lie inside a later epoch"
    first = [_hf_windows(r["first"]["record"]) for r in res]
    second = [_hf_windows(r["second"]["record"]) for r in res]
    assert res[0]["first"]["global_step"] == res[0]["second"]["global_step"] == 14  # max_steps, exactly
    assert second[0][0]["step"] == step + 1
    combined = [[w for w in f if w["step"] <= step] + s for f, s in zip(first, second)]
    epochs = sorted({w["epoch"] for w in first[0]})
    assert len(epochs) >= 3, "max_steps should span epochs"
    for epoch in epochs[:-1]:  # complete epochs: each sample once, with or without the resume
        _assert_once(_epoch_ids(first, epoch), 80, f"HF first run epoch {epoch}")
        _assert_once(_epoch_ids(combined, epoch), 80, f"HF resumed run epoch {epoch}")
    last = epochs[-1]  # the epoch max_steps cut: the resumed run trained the same samples
    assert sorted(_epoch_ids(combined, last)) == sorted(_epoch_ids(first, last))


# -- Accelerate ------------------------------------------------------------------------------------------------------
@_needs("accelerate")
def test_accelerate_loop_exact_once_and_resume(world):
    from _tiny import RandomChat
    res = _results(world, "accelerate")
    data, model = RandomChat(96), sc.tiny_llama()
    full = [r["full"] for r in res]
    for epoch in (0, 1):
        _assert_once(_epoch_ids(full, epoch), 96, f"accelerate epoch {epoch}")
    _check_windows(full, data, model, _llama_reference, 2e-6)
    save = res[0]["save"]
    combined = [[w for w in r["saved"] if w["step"] <= save] + r["resumed"] for r in res]
    for epoch in (0, 1):
        _assert_once(_epoch_ids(combined, epoch), 96, f"accelerate resumed epoch {epoch}")
    assert res[0]["resumed"][0]["step"] == save + 1
    _check_windows([r["resumed"] for r in res], data, model, _llama_reference, 2e-6)


# -- Lightning --------------------------------------------------------------------------------------------------
def _lightning_windows(per_rank_records, grads=None):
    """Per optimizer step: the ids of both ranks and the global loss (Lightning's returned losses / k / W)."""
    steps = collections.OrderedDict()
    for rank, record in enumerate(per_rank_records):
        for r in record:
            entry = steps.setdefault(r["global_step"], dict(epoch=r["epoch"], ids=[[], []], loss=0.0))
            entry["ids"][rank].extend(r["ids"])
            entry["loss"] += r["loss"] / 2 / 2  # undo training_loss's x accumulate_grad_batches, then mean over W
    out = [[], []]
    for k, (step, e) in enumerate(steps.items()):
        for rank in range(2):
            out[rank].append(dict(epoch=e["epoch"], step=step + 1, ids=e["ids"][rank], loss=e["loss"],
                                  grad=grads[rank][k] if grads else None))
    return out


@_needs("lightning")
def test_lightning_datamodule_exact_once_resume_and_metrics(world):
    from _tiny import RandomChat
    res = _results(world, "lightning")
    data, model = RandomChat(96), sc.tiny_llama()
    first = _lightning_windows([r["first"] for r in res], [r["grads"] for r in res])
    for epoch in (0, 1):
        _assert_once(_epoch_ids(first, epoch), 96, f"Lightning epoch {epoch}")
    assert res[0]["global_step"] == len(first[0])
    _check_windows(first, data, model, _llama_reference, 2e-6)
    # Validation over evenflow eval batches with a token-weighted MeanMetric: the exact per-token loss.
    ref_val, _ = sc.reference_window(model, RandomChat(64, seed=1), range(64))
    assert _close(res[0]["val_loss"], ref_val, 2e-6)
    # Resumed from a mid-epoch checkpoint (Lightning had already fetched the next batch when it saved).
    stop = res[0]["stop"]
    kept = [[r for r in x["first"] if r["global_step"] < stop] for x in res]
    combined = _lightning_windows([k + x["resumed"] for k, x in zip(kept, res)])
    for epoch in (0, 1):
        _assert_once(_epoch_ids(combined, epoch), 96, f"Lightning resumed epoch {epoch}")
    metrics = res[0]["metrics"]
    assert metrics and {"evenflow/imbalance", "evenflow/idle_steps", "evenflow/local_padded_efficiency",
                        "evenflow/local_tokens_per_s"} <= set(metrics[0])


# -- in-process checks -------------------------------------------------------------------------------------------
def test_step_metrics_summary_and_reset():
    from evenflow import StepInfo
    from evenflow.integrations import StepMetrics
    clock = iter([0.0, 2.0, 3.0]).__next__
    meter = StepMetrics(clock=clock)
    common = dict(epoch=1, global_samples=5, global_loss_tokens=30, world_size=2, steps_bound=10)
    meter.update(StepInfo(step=0, is_idle=False, local_samples=3, local_loss_tokens=20, loss_scale=1.3,
                          padded_tokens=24, real_tokens=20, max_padded_tokens=24, mean_padded_tokens=20.0, **common))
    meter.update(StepInfo(step=1, is_idle=True, local_samples=0, local_loss_tokens=0, loss_scale=0.0,
                          padded_tokens=8, real_tokens=8, max_padded_tokens=32, mean_padded_tokens=20.0, **common))
    out = meter.summary()
    assert out["evenflow/steps"] == 2 and out["evenflow/idle_steps"] == 1
    assert out["evenflow/local_padded_efficiency"] == 20 / 24  # IDLE placeholders are not counted as work
    assert out["evenflow/imbalance"] == (1.2 + 1.6) / 2 and out["evenflow/imbalance_max"] == 1.6
    assert out["evenflow/local_tokens_per_s"] == 10.0 and out["evenflow/samples_per_s"] == 5.0
    assert out["evenflow/epoch"] == 1.0 and out["evenflow/epoch_progress"] == 0.2
    assert meter.summary() == {} and meter.idle_total == 1


def test_dp_rank_groups_of_a_mesh():
    from types import SimpleNamespace

    from evenflow.integrations import dp_rank_groups
    mesh = SimpleNamespace(mesh=torch.arange(8).reshape(2, 4), mesh_dim_names=("dp", "tp"), ndim=2)
    assert dp_rank_groups(mesh, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dp_rank_groups(mesh, "tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dp_rank_groups(mesh, 0) == dp_rank_groups(mesh, "dp")
    with pytest.raises(ValueError, match="no dimension named 'cp'"):
        dp_rank_groups(mesh, "cp")


def test_eval_loader_refuses_training_options():
    from _tiny import RandomChat

    from evenflow.integrations import eval_loader
    with pytest.raises(ValueError, match="shuffle=False"):
        eval_loader(RandomChat(8), token_budget=64, shuffle=True)
    loader = eval_loader(RandomChat(8), token_budget=64, shuffle=False)
    assert not loader.config.shuffle and loader.config.alignment.join and loader.config.grad_accum_steps == 1


@_needs("hf")
def test_hf_trainer_options_and_args_copy(tmp_path):
    from transformers import TrainingArguments

    from evenflow.integrations.hf import DynamicBatchTrainer
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    model = sc.tiny_llama(torch.float32)
    with pytest.raises(TypeError, match="gradient_accumulation_steps"):
        DynamicBatchTrainer(model=model, args=args, train_dataset=sc.ChatLike(8), token_budget=64, grad_accum_steps=2)
    trainer = DynamicBatchTrainer(model=model, args=args, train_dataset=sc.ChatLike(8), token_budget=64,
                                  buffer_size=8, num_workers=0)
    assert trainer.loader_options == {"buffer_size": 8, "num_workers": 0}
    # HF must not skip batches on resume (the loader restores its position): a private copy says so.
    assert trainer.args.ignore_data_skip and not args.ignore_data_skip
    assert trainer.loss_is_scaled_for_ga is True


@_needs("hf")
def test_hf_example_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / "hf_trainer.py"), "--output-dir", str(tmp_path), "--max-steps", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "eval_loss" in proc.stdout
    for rank in range(2):  # the loader position travels with the checkpoint, one file per rank
        assert (tmp_path / "checkpoint-6" / f"evenflow_loader_rank{rank}.json").is_file()


_CYCLE_SCRIPT = """
import gc, sys, tempfile, weakref
from datetime import timedelta
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from _tiny import RandomChat
from evenflow import DynamicBatchLoader
from evenflow.integrations import destroy_process_groups
dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rdv", rank=0, world_size=1)
gc.disable()  # only destroy_process_groups may collect
loader = DynamicBatchLoader(RandomChat(8), token_budget=64, num_workers=0,
                            process_group=dist.new_group(backend="gloo", timeout=timedelta(seconds=30)))
cycle = [loader]
cycle.append(cycle)
alive = weakref.ref(loader)
del loader, cycle
print("held by the cycle:", alive() is not None)
destroy_process_groups()
print("freed:", alive() is None, "initialized:", dist.is_initialized())
"""


def test_destroy_process_groups_frees_cycles_before_exit():
    """A loader in a reference cycle holds its gloo group until a collection; left to interpreter exit, that
    teardown can abort the process (examples/hf_trainer.py did, once in CI). The helper collects first."""
    proc = subprocess.run([sys.executable, "-c", _CYCLE_SCRIPT, str(EXAMPLES)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["held by the cycle: True", "freed: True initialized: False"], proc.stdout


class _Unsupervised(torch.utils.data.Dataset):
    """Samples 0-5 have no supervised token at all (every label -100): their batches' mean loss is 0/0."""

    def __init__(self) -> None:
        self.data = sc.ChatLike(12, seed=4)

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i):
        s = self.data[i]
        if i < 6:
            s["labels"] = torch.full_like(s["labels"], -100)
        return s


@_needs("hf")
def test_hf_trainer_never_nan_on_unsupervised_windows(tmp_path):
    from transformers import TrainingArguments

    from evenflow.integrations.hf import DynamicBatchTrainer
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", num_train_epochs=1,
                             gradient_accumulation_steps=2, logging_steps=1, learning_rate=0.1, optim="sgd",
                             lr_scheduler_type="constant", save_strategy="no", disable_tqdm=True,
                             dataloader_pin_memory=False)
    model = sc.tiny_llama(torch.float32)
    trainer = DynamicBatchTrainer(model=model, args=args, train_dataset=_Unsupervised(), token_budget=48,
                                  max_samples=1, shuffle=False, buffer_size=2)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(math.isfinite(x) for x in losses)
    assert losses[0] == 0.0  # the first window holds no supervised token: it contributes exactly nothing
    assert all(torch.isfinite(p).all() for p in model.parameters())


@_needs("hf")
def test_hf_trainer_epoch_exactly_at_its_length_bound(tmp_path):
    """One sample per step: the epoch is exactly len(dataloader) long, so HF stops on its count, not on the
    loader's exhaustion, and the last window (1 of 3 micro-batches) is applied at HF's epoch-end sync."""
    RecordingTrainer, _ = sc._hf_classes()
    args = sc._hf_args(str(tmp_path), gradient_accumulation_steps=3, num_train_epochs=2, learning_rate=0.0,
                       lr_scheduler_type="constant")
    trainer = RecordingTrainer(model=sc.tiny_llama(torch.float32), args=args, train_dataset=sc.ChatLike(10),
                               token_budget=64, max_samples=1, buffer_size=4)
    trainer.record = []
    out = trainer.train()
    windows = _hf_windows(trainer.record)
    for epoch in (0, 1):
        _assert_once(_epoch_ids([windows], epoch), 10, f"epoch {epoch}")
    assert [w["epoch"] for w in windows] == [0] * 4 + [1] * 4 and out.global_step == 8
    assert trainer.state.epoch == 2.0
