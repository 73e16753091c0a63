"""The next step's work on the loader's collation thread (NOTE [ Per-step prefetch ]) and the balanced VLM step's
metadata exchange and plan made there (NOTE [ The plan made in the background ]), on 3 real gloo ranks.

One spawned world runs every scenario (tests/prefetch_scenarios.py); each rank reports, the tests assert.
"""

from __future__ import annotations

import pytest

import prefetch_scenarios as ps
from _dist import run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

WORLD = 3


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(ps.world, WORLD, str(tmp_path_factory.mktemp("prefetch")), timeout=360, pg_timeout_s=60)


def _ok(world, name) -> list:
    res = [r[name] for r in world]
    for r, value in enumerate(res):
        assert "crash" not in value, f"rank {r}: {value['crash']}"
    return res


def test_the_callable_runs_on_the_collation_thread_before_each_batch_in_step_order(world):
    res = _ok(world, "hook_order")
    steps = {r["steps"] for r in res}
    assert len(steps) == 1 and steps.pop() >= 3
    for r in res:
        assert r["same_info"] and r["same_step"] and r["own_row"], r
        assert all(t.startswith("evenflow-collate") for t in r["threads"]), r["threads"]
        assert r["ahead"] >= 1  # step s+1's callable had run while step s trained


def test_a_failure_shared_by_the_callable_reaches_every_rank_at_that_step(world):
    res = _ok(world, "hook_fault")
    assert [r["steps"] for r in res] == [[0, 1]] * WORLD
    assert res[1]["error"] == "ValueError" and "injected" in res[1]["message"]
    for r in (0, 2):
        assert res[r]["error"] == "PeerError" and res[r]["peer"] == 1, res[r]


def test_a_stop_with_the_next_exchange_in_flight_exits_and_the_next_epoch_runs(world):
    res = _ok(world, "hook_stop")
    for r in res:
        assert r["first"] == [0, 1]
        assert r["stopped_s"] < 30
        assert r["second"] == list(range(len(res[0]["second"]))) and len(r["second"]) >= 3


@pytest.mark.parametrize("case", ["packed/1", "padded/1", "packed/2"])
def test_prefetched_plans_losses_and_every_gradient_equal_the_inline_ones(world, case):
    res = _ok(world, f"exact/{case}")
    for r in res:
        assert r["steps"] and r["plans"] and r["losses"] and r["grads"] and r["n"] >= 4, r
    assert res[1]["images"] == 0  # a rank with no image
    assert res[2]["idle"] >= 1  # a rank that trains IDLE steps
    assert res[0]["images"] >= 4


def test_an_adapter_failure_in_the_background_reaches_every_rank_as_peer_error(world):
    res = _ok(world, "vlm_fault")
    assert res[1]["error"] == "ValueError" and "injected" in res[1]["message"], res[1]
    for r in (0, 2):
        assert res[r]["error"] == "PeerError" and res[r]["peer"] == 1, res[r]
        assert "injected" in res[r]["message"]


def test_a_step_called_wrongly_on_one_rank_is_named_on_every_rank(world):
    res = _ok(world, "vlm_misuse")
    assert res[1]["error"] == "StepInfoMisuse" and "pop_step_info" in res[1]["message"], res[1]
    for r in (0, 2):
        assert res[r]["error"] == "PeerError" and res[r]["peer"] == 1, res[r]


def test_a_stop_in_flight_exits_and_a_checkpoint_resumes_to_the_same_losses(world):
    res = _ok(world, "stop_resume")
    for r in res:
        assert r["stopped"] == [0, 1] and r["stop_s"] < 60
        assert r["n"] >= 1 and r["losses"] and r["plans"] and r["grads"], r


def test_the_hf_trainer_path_trains_the_same_with_the_plan_prefetched(world):
    res = _ok(world, "trainer")
    for r in res:
        assert r["n"] == 3 and r["losses"] and r["params"], r
