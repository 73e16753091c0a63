"""Issue 20: resume a loader state saved at W ranks on W' ranks, exactly once; what is refused, and why.

The states come from one real 3-rank gloo world (saved mid-epoch, at an epoch end, under each policy, in quota
mode, from iterable streams); the refusals are checked on 1-rank loaders in this process (every check runs
in ``load_state_dict``, before any collective). The W -> W' exactly-once sweep runs a seeded slice of
benchmarks/failures/elastic_sweep.py on fresh gloo worlds (the full sweep: ``python benchmarks/failures/soak.py
--elastic``).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

import evenflow
import loader_scenarios as sc
from _dist import run_world
from evenflow.runtime.redeal import check_world, redeal

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from failures import elastic_sweep  # noqa: E402

N = 400
BUDGET = sc.BUDGET


def _make(ds=None, **kw):
    kw.setdefault("token_budget", BUDGET)
    kw.setdefault("buffer_size", 16)
    kw.setdefault("seed", 7)
    return evenflow.DynamicBatchLoader(ds if ds is not None else sc.TokenDataset(N), **kw)


def _run(loader, epoch, stop=None):
    """Steps' sample ids of one epoch; with ``stop``, the state after that many steps (at a window end)."""
    loader.set_epoch(epoch)
    ids, state = [], None
    for batch in loader:
        info = evenflow.pop_step_info(batch)
        ids.append(list(info.sample_ids))
        if stop is not None and len(ids) >= stop and info.window_end:
            state = loader.state_dict()
            break
    if state is None:
        state = loader.state_dict()
    loader.close()
    return ids, state


def sc_states(rank, world):
    """Every kind of state the refusal tests need, saved by a real 3-rank world."""
    out = {}
    for name, kw, epoch, stop in [
            ("mid3", {}, 0, 3), ("mid6", {}, 0, 6), ("local", dict(planning="local"), 0, 3),
            ("epoch1", {}, 1, 3), ("quota", dict(join=False), 0, 3), ("other_seed", dict(seed=8), 0, 3),
            ("finished", {}, 0, None), ("accum", dict(grad_accum_steps=2), 0, 3)]:
        ids, state = _run(_make(**kw), epoch, stop)
        assert state["finished"] == (stop is None), (name, len(ids))  # mid-epoch states are mid-epoch
        out[name] = dict(ids=ids, state=state)
    for name, stop in [("iter_mid", 2), ("iter_end", None)]:
        ids, state = _run(_make(sc.RankStream(rank, 40, 11)), 0, stop)
        out[name] = dict(ids=ids, state=state)
    return out


_STATES: list = []


def saved(name: str) -> list[dict]:
    """The 3 ranks' states of ``name``, as they come back from JSON checkpoint files."""
    if not _STATES:
        _STATES.extend(run_world(sc_states, 3, timeout=300))
    return json.loads(json.dumps([r[name]["state"] for r in _STATES]))


def trained_before(name: str) -> list[int]:
    saved(name)
    return [i for r in _STATES for step in r[name]["ids"] for i in step]


def _refused(states, match, **kw):
    loader = _make(**kw)
    try:
        with pytest.raises(ValueError, match=match) as info:
            loader.load_state_dict(states)
    finally:
        loader.close()
    return str(info.value)


# -- item 1 on this process: 3 ranks -> 1 -------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["mid3", "accum", "local"])
def test_three_ranks_resume_on_one_exactly_once(name):
    kw = dict(planning="local") if name == "local" else dict(grad_accum_steps=2) if name == "accum" else {}
    loader = _make(**kw)
    assert loader.planning == "local"  # "auto" resolved to "global" on 3 ranks, to "local" here: allowed
    loader.load_state_dict(saved(name))
    after, state = _run(loader, 0)
    ids = trained_before(name) + [i for step in after for i in step]
    assert sorted(ids) == list(range(N))
    assert state["finished"] and state["world_size"] == 1


@pytest.mark.multiprocess
def test_quota_state_resumes_on_one_rank_every_sample_epoch_once_or_carried():
    loader = _make(join=False)
    loader.load_state_dict(saved("quota"))
    after, state = _run(loader, 0)
    ids = trained_before("quota") + [i for step in after for i in step]
    carried = [k[1] for k in state["next_carry"]]
    assert sorted(ids + carried) == list(range(N))
    after1, state1 = _run(_resumed(state, join=False), 1)  # the next epoch starts with what was carried
    ids1 = [i for step in after1 for i in step] + [k[1] for k in state1["next_carry"]]
    assert sorted(ids1) == sorted(list(range(N)) + carried)


def _resumed(state, **kw):
    loader = _make(**kw)
    loader.load_state_dict(state)
    return loader


@pytest.mark.multiprocess
def test_an_epoch_end_resumes_on_any_number_of_ranks_and_the_next_epoch_is_whole():
    loader = _make()
    loader.load_state_dict(saved("finished"))
    ids, _ = _run(loader, 1)
    assert sorted(i for step in ids for i in step) == list(range(N))
    loader = _make(sc.RankStream(0, 40, 11))  # an IterableDataset at an epoch end (join): nothing to re-deal
    loader.load_state_dict(saved("iter_end"))
    loader.close()


@pytest.mark.multiprocess
def test_a_redealt_state_saved_again_resumes_on_its_own_and_in_a_list():
    loader = _make()
    loader.load_state_dict(saved("mid6"))
    first, state = _run(loader, 0, stop=2)
    assert state["stream"] is not None and state["world_size"] == 1
    rest, _ = _run(_resumed(copy.deepcopy(state)), 0)
    listed, _ = _run(_resumed([json.loads(json.dumps(state))]), 0)
    assert rest == listed
    ids = trained_before("mid6") + [i for step in first + rest for i in step]
    assert sorted(ids) == list(range(N))


# -- item 2: refusals ----------------------------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_a_missing_rank_is_refused_naming_it():
    msg = _refused(saved("mid3")[:2], r"saved by 3 ranks .* rank\(s\) \[2\] missing")
    assert "evenflow_loader_rank<r>.json" in msg


@pytest.mark.multiprocess
def test_two_states_of_one_rank_are_refused():
    states = saved("mid3")
    _refused([states[0], states[1], states[1]], r"two states of rank\(s\) \[1\]")


@pytest.mark.multiprocess
def test_states_of_different_steps_epochs_or_configurations_are_refused_naming_what_differs():
    mid3, mid6, epoch1, seed8 = saved("mid3"), saved("mid6"), saved("epoch1"), saved("other_seed")
    assert mid3[0]["step"] != mid6[0]["step"]
    msg = _refused([mid3[0], mid6[1], mid3[2]], "do not come from one checkpoint: states of different checkpoint steps")
    assert f"step={mid6[1]['step']} on rank(s) [1]" in msg
    _refused([mid3[0], mid3[1], epoch1[2]], "states of different epochs")
    _refused([mid3[0], seed8[1], mid3[2]], "states saved under different loader configurations")
    _refused([mid3[0], saved("finished")[1], mid3[2]], "do not come from one checkpoint")


@pytest.mark.multiprocess
def test_another_dataset_budget_or_explicit_argument_is_refused():
    mid3 = saved("mid3")
    _refused(mid3, "the dataset had 400 samples, now 401", ds=sc.TokenDataset(N + 1))
    _refused(mid3, "token_budget changed from 2048 to 1024", token_budget=1024)
    _refused(mid3, "configuration .* differs", buffer_size=32)
    # The user said planning="local" on 3 ranks: "auto" (global there) is another policy at that world size.
    msg = _refused(saved("local"), "configuration .* differs")
    assert "planning='global' (planning_group=3) at the saved world size 3" in msg
    _refused(mid3, "configuration .* differs", planning="local")  # "auto" ran global on 3 ranks


@pytest.mark.multiprocess
def test_one_rank_state_on_another_world_size_is_refused_pointing_at_the_list():
    msg = _refused(saved("mid3")[1], r"world_size=3, and this job has 1 ranks")
    assert "load_state_dict([state_0, ..., state_2])" in msg


@pytest.mark.multiprocess
def test_an_iterable_stream_mid_epoch_on_another_world_size_is_refused_saying_why():
    msg = _refused(saved("iter_mid"), "cannot resume this IterableDataset on 1 ranks", ds=sc.RankStream(0, 40, 11))
    assert "belongs to the rank that read it" in msg and "map-style" in msg and "same number of ranks" in msg


@pytest.mark.multiprocess
def test_edited_states_that_would_train_a_sample_twice_are_refused():
    states = saved("mid3")
    other = [k for k in range(N) if k not in states[0]["consumed"]][0]
    states[0]["stream"] = sorted(set(states[0]["consumed"]) | {other})
    states[1]["stream"] = sorted(set(states[1]["consumed"]) | {other})
    states[2]["stream"] = sorted(states[2]["consumed"])
    _refused(states, f"sample key {other} is in the stream of both rank 0 and rank 1")
    states = saved("mid3")
    states[0]["consumed"].append(next(k for k in states[1]["consumed"]))
    _refused(states, "never held")


# -- issue 19 item 8: things that are not a state ------------------------------------------------------------------
@pytest.mark.multiprocess
def test_what_is_not_a_state_is_refused_naming_it_and_the_fix():
    state = saved("mid3")[0]
    assert "load it first" in _refused("/ckpt/evenflow_loader_rank0.json", "got a str")
    assert "pass its 'loader' entry" in _refused({"version": 1, "loader": state}, "DynamicBatchTrainer checkpoint file")
    _refused({"version": 1, "loader": state, "lr_scaler": {}}, "DynamicBatchTrainer checkpoint file")
    assert "pass its 'ranks' list" in _refused({"version": 1, "ranks": [state]}, "checkpoint wrapper")
    _refused({"weight": 1.0}, "not an evenflow loader state")
    _refused(42, "got a int")
    _refused(None, "got a NoneType")
    _refused({**state, "version": 7}, "version 7 .* incompatible evenflow release")
    _refused([state, "x", state], r"got a str \(entry 1 of the list\)")
    _refused([], "empty list")


def test_a_step_of_two_to_the_seventy_is_refused_not_an_overflow():
    loader = _make()
    for batch in loader:
        evenflow.pop_step_info(batch)
        break
    state = loader.state_dict()
    loader.close()
    for field in ("step", "epoch"):
        with pytest.raises(ValueError, match=rf"state\['{field}'\] is {2**70}, beyond any real run"):
            _make().load_state_dict({**state, field: 2**70})


def test_a_version_2_state_still_loads():
    loader = _make()
    for batch in loader:
        evenflow.pop_step_info(batch)
        break
    state = loader.state_dict()
    loader.close()
    old = {k: v for k, v in state.items() if k != "stream"} | {"version": 2}
    resumed = _make()
    resumed.load_state_dict(old)
    assert resumed.state_dict()["stream"] is None
    resumed.close()


# -- the re-deal itself -------------------------------------------------------------------------------------------
def test_the_redeal_partitions_the_remainder_the_same_way_on_every_new_rank():
    base = dict(version=3, world_size=3, epoch=0, step=2, finished=False, next_carry=[], stream=None, fingerprint=1,
                token_budget=9, num_samples=40, join=True)
    states = [dict(base, rank=0, carry=[(0, 5)], consumed=[(0, 5)]), dict(base, rank=1, carry=[], consumed=[]),
              dict(base, rank=2, carry=[], consumed=[])]
    from evenflow.runtime.source import shard_indices
    for r, s in enumerate(states):
        s["consumed"] += shard_indices(40, rank=r, world_size=3, epoch=0, seed=1, shuffle=True)[:4]
    untrained = set(range(40)) - {k for s in states for k in s["consumed"]}
    for new_world in (1, 2, 4, 7):
        deals = [redeal(states, rank=r, world_size=new_world, num_samples=40, seed=1, shuffle=True)
                 for r in range(new_world)]
        keys = [k for d in deals for k in d["stream"]]
        assert sorted(keys) == sorted(untrained) and len(keys) == len(set(keys))
        assert max(map(len, (d["stream"] for d in deals))) - min(map(len, (d["stream"] for d in deals))) <= 1
        shuffled = check_world([copy.deepcopy(s) for s in states[::-1]])  # any order: sorted by rank first
        again = [redeal(shuffled, rank=r, world_size=new_world, num_samples=40, seed=1, shuffle=True)
                 for r in range(new_world)]
        assert again == deals


# -- the real-process sweep slice ------------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_sweep_slice_loses_and_repeats_nothing_and_scales_the_loss_exactly():
    cases = elastic_sweep.random_slice(seed=20, count=12)
    assert {c.planning for c in cases} == {"local", "global", "auto"}
    assert {c.grad_accum_steps for c in cases} == {1, 2} and {c.join for c in cases} == {True, False}
    results = elastic_sweep.run_cases(cases)
    out = elastic_sweep.summarize(cases, results, 20, 0.0)
    assert out["errors"] == out["hangs"] == 0, out
    assert out["lost"] == out["duplicated"] == out["unequal_steps"] == out["scale_errors"] == 0, out
    assert out["windows_checked"] > 50 and out["max_rel_err"] <= elastic_sweep.REL_TOL, out


def test_step_metrics_epoch_progress_continues_after_a_resume():
    from evenflow.integrations import StepMetrics
    loader = _make()
    batch = next(iter(loader))
    info = evenflow.pop_step_info(batch)
    loader.close()
    meter = StepMetrics(epoch_samples=N)
    meter.resumed(info.epoch, 100)  # 100 samples of this epoch trained before the checkpoint, on any world size
    meter.update(info)
    assert meter.summary()["evenflow/epoch_progress"] == (100 + info.global_samples) / N
