"""The seeded slice of the soak (benchmarks/soak.py) that `make test` runs: real gloo worlds, every planning
policy, 0 lost / duplicated / over budget / unequal / hangs / errors. The full soak is `make soak`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import soak  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1000)]  # bounded by the soak deadlines; a loaded box is slow

POOLED, FRESH = 14, 1


def test_soak_slice_finds_nothing():
    out = soak.soak(seed=2026, pooled=POOLED, fresh=FRESH, time_limit=600, deadline_s=240, scale=0.25, max_world=3)
    assert out["configs"] == POOLED + FRESH, out  # nothing was cut by the time limit
    assert set(out["by_policy"]) == set(soak.POLICIES), out
    found = {k: out[k] for k in ("lost", "duplicated", "over_budget", "unequal_steps", "hangs", "errors")}
    assert set(found.values()) == {0}, out
