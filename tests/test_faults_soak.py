"""The seeded slice of the soak (benchmarks/failures/soak.py) that `make test` runs: real gloo worlds, every planning
policy, 0 lost / duplicated / over budget / unequal / hangs / errors. The full soak is `make soak`."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from failures import soak  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1000)]  # bounded by the soak deadlines; a loaded box is slow

POOLED, FRESH = 14, 1


def test_soak_slice_finds_nothing():
    out = soak.soak(seed=2026, pooled=POOLED, fresh=FRESH, time_limit=600, deadline_s=240, scale=0.25, max_world=3)
    assert out["configs"] == POOLED + FRESH, out  # nothing was cut by the time limit
    assert set(out["by_policy"]) == set(soak.POLICIES), out
    found = {k: out[k] for k in ("lost", "duplicated", "over_budget", "unequal_steps", "hangs", "errors",
                                 "silent_ends", "fault_unequal", "wrong_errors")}
    assert set(found.values()) == {0}, out
    assert out["faults_fired"] >= 1, out  # the slice injects issue 19's faults, and at least one fires


def _all_over_budget(planning: str, cid: int) -> soak.Config:
    """Two ranks, one map-style sample, over the budget, kept alone: rank 1's IDLE step has no placeholder."""
    base = soak.draw_config(np.random.default_rng(cid), cid, fresh=False)
    return dataclasses.replace(base, world=2, iterable=False, sizes=(1,), workers=0, context=None, oversize="alone",
                               oversized=1, join=True, epochs=1, resume_at=None, persistent=False, balance=False,
                               planning=planning)


def test_soak_expects_the_idle_sample_error_exactly_where_no_placeholder_exists():
    cfgs = [_all_over_budget(p, cid) for cid, p in enumerate(soak.POLICIES)]
    cfg = cfgs[0]
    assert all(soak.expects_idle_error(c) for c in cfgs)
    assert not soak.expects_idle_error(dataclasses.replace(cfg, sizes=(40,)))  # samples within the budget exist
    assert not soak.expects_idle_error(dataclasses.replace(cfg, oversize="drop"))
    assert not soak.expects_idle_error(dataclasses.replace(cfg, iterable=True, sizes=(1, 1)))  # idle_sample= given
    assert not soak.expects_idle_error(dataclasses.replace(cfg, sizes=(0,)))
    # The real loader, both policies: every rank ends with the error naming idle_sample= (rank 1 its own,
    # rank 0 the PeerError carrying it), and the soak counts it as expected, not as an error.
    results = soak.run_world(cfgs, 2, 240, "spawn")
    for c in cfgs:
        res = results[c.id]
        assert isinstance(res, soak.Failed) and res.only_idle_errors(), res
        assert res.per_rank[0].startswith("PeerError"), res.per_rank[0]
        assert res.per_rank[1].startswith("RuntimeError: rank 1 must emit an IDLE batch"), res.per_rank[1]
    out = soak.summarize(cfgs, results, seed=0, wall=0.0, n_pooled=len(cfgs))
    assert (out["expected_idle_errors"], out["errors"], out["failures"]) == (len(cfgs), 0, 0), out
    # The same error where a placeholder exists is an error; so is any other error where none exists.
    placeable = dataclasses.replace(cfg, sizes=(40,))
    out = soak.summarize([placeable], {placeable.id: results[cfg.id]}, seed=0, wall=0.0, n_pooled=1)
    assert (out["expected_idle_errors"], out["errors"]) == (0, 1), out
    other = soak.Failed("rank 0: ValueError: boom", ("ValueError: boom", results[cfg.id].per_rank[1]))
    out = soak.summarize([cfg], {cfg.id: other}, seed=0, wall=0.0, n_pooled=1)
    assert (out["expected_idle_errors"], out["errors"]) == (0, 1), out
