"""Issue 10, classes 1-3 and 6-8: every fault on one rank reaches every rank within one round, by name.

Real gloo process worlds (file:// rendezvous, hard timeouts, tests/_dist.py). The fault is always on rank 1;
``t_error - t_fault`` is what the README's fault table reports.
"""

from __future__ import annotations

import pytest

import loader_scenarios as sc
from _dist import run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1000)]  # one world builds all results

WORLD = 3


HOSTILE = ["break_one", "raise_one", "break_all", "with_raise", "close_exc", "unpicklable", "blocking",
           "collate_mid", "collate_last", "collate_global", "length_fn", "balance_pickle", "start_fail",
           "len_mismatch"]
TORN = ["torn", "one_loads"]
_RESULTS: dict = {}


def _world(kind):
    """Every fault runs in one process world, one after the other (a fault leaves the process group usable:
    every rank raised and closed its loader), so the suite pays for one world start-up."""
    if not _RESULTS:
        calls = [(k, "sc_hostile", (k,)) for k in HOSTILE] + [(k, "sc_torn_resume", (k,)) for k in TORN]
        per_rank = run_world(sc.sc_many, WORLD, calls, timeout=900)
        _RESULTS.update({k: [r[k] for r in per_rank] for k in HOSTILE + TORN})
    return _RESULTS[kind]


def _peers(res):
    return [r for i, r in enumerate(res) if i != 1]


@pytest.mark.parametrize("kind", ["break_one", "raise_one"])
def test_one_rank_leaving_its_loop_stops_peers_loudly(kind):
    res = _world(kind)
    assert res[1]["steps"] == sc.FAULT_STEP and res[1]["type"] in (None, "ZeroDivisionError")
    for r in _peers(res):
        assert r["type"] == "PeerStopped", r
        assert r["attrs"]["rank"] == 1 and r["attrs"]["step"] == sc.FAULT_STEP, r
        assert "rank 1 stopped iterating its loader after 3 step(s)" in r["error"]
        # The peer never trains past the stop without being told (it may hold batches made before it).
        assert r["steps"] >= sc.FAULT_STEP


def test_all_ranks_breaking_at_the_same_step_is_a_normal_stop():
    res = _world("break_all")
    for r in res:
        assert r["error"] is None and r["steps"] == sc.FAULT_STEP, r
        assert r["again"]["error"] is None and r["again"]["steps"] > sc.FAULT_STEP
    assert len({r["again"]["steps"] for r in res}) == 1


@pytest.mark.parametrize("kind", ["with_raise", "close_exc"])
def test_trainer_error_reported_as_error(kind):
    res = _world(kind)
    assert res[1]["type"] == "ZeroDivisionError"
    for r in _peers(res):
        assert r["type"] == "PeerError", r
        assert r["attrs"]["rank"] == 1 and r["attrs"]["type_name"] == "ZeroDivisionError", r
        assert "injected trainer failure" in r["attrs"]["detail"]
        assert r["attrs"]["sample_index"] is None


@pytest.mark.parametrize("kind, own_type, text", [
    ("unpicklable", "TypeError", "cannot be pickled"),
    ("blocking", "RuntimeError", "worker_timeout=20s"),
    ("collate_mid", "KeyError", "injected collate failure"),
    ("collate_last", "KeyError", "injected collate failure"),
    ("length_fn", "KeyError", "num_tokens"),
    ("balance_pickle", "TypeError", "cannot be pickled"),
    ("start_fail", "OSError", "shard file is missing"),
])
def test_data_faults_reach_every_rank_with_the_sample(kind, own_type, text):
    res = _world(kind)
    own = res[1]
    assert own["type"] == own_type and text in own["error"], own
    for r in _peers(res):
        assert r["type"] == "PeerError", r
        assert r["attrs"]["rank"] == 1 and r["attrs"]["type_name"] == own_type, r
        assert text in r["attrs"]["detail"], r
        if kind not in ("start_fail", "balance_pickle"):
            assert r["attrs"]["sample_index"] is not None and r["attrs"]["sample_index"] % WORLD == 1, r
        # Within one round: peers raise after the same error round as the failing rank, far inside the 120 s
        # exchange timeout (10 s leaves room for a loaded machine).
        assert abs(r["t_error"] - own["t_error"]) < 10, (r, own)


def test_collate_failure_under_global_planning_reaches_every_rank_from_the_rank_that_trains_the_sample():
    res = _world("collate_global")
    own = [r for r in res if r["type"] == "KeyError"]
    assert len(own) == 1, res  # exactly one rank collated the failing batch
    failed = res.index(own[0])
    assert "injected collate failure on sample 16" in own[0]["error"], own
    for rank, r in enumerate(res):
        if rank == failed:
            continue
        assert r["type"] == "PeerError", r
        assert r["attrs"]["rank"] == failed and r["attrs"]["type_name"] == "KeyError", r
        assert "injected collate failure on sample 16" in r["attrs"]["detail"], r
        assert r["attrs"]["sample_index"] is not None, r
        assert abs(r["t_error"] - own[0]["t_error"]) < 10, (r, own)


def test_datasets_of_different_length_are_refused_on_every_rank():
    res = _world("len_mismatch")
    for r in res:
        assert r["type"] == "ValueError" and "ranks disagree on the dataset" in r["error"], r
        assert r["steps"] == 0


@pytest.mark.parametrize("kind", ["torn", "one_loads"])
def test_torn_or_partial_checkpoints_are_refused(kind):
    res = _world(kind)
    for r in res:
        assert r["type"] == "ValueError" and "ranks disagree on the resumed state" in r["error"], r
        assert "step 3" in r["error"] and r["steps"] == 0
