"""Issue 10, class 4: quota mode (join=False) conserves every sample-epoch across epochs.

Map-style: over 3 epochs every index is trained 3 times, or is still carried (counted once per carry);
with and without balance=True (carried keys are (epoch, index) pairs, so they never collide with another
rank's new shard), with persistent workers and with a mid-epoch resume. Iterable: each (pass, position) of
a rank's stream is trained at most once, and what is untrained is the unread tail plus the carried buffer.
"""

from __future__ import annotations

import collections

import pytest

import loader_scenarios as sc
from _dist import run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1000)]  # one world builds all results

CASES = {
    "plain": dict(),
    "balance": dict(balance=True),
    "persistent": dict(workers=1, persistent=True),
    "resume": dict(resume_at=2),
    "iterable": dict(iterable=True),
    "iterable_persistent": dict(iterable=True, workers=1, persistent=True),
    "iterable_balance": dict(iterable=True, balance=True),
}


def _body(rank, world, cases):
    return {name: sc.sc_quota_conserve(rank, world, **kw) for name, kw in cases.items()}


_RES = {}


def results():
    if not _RES:
        _RES.update(enumerate(run_world(_body, 3, CASES, timeout=400)))
    return [_RES[r] for r in range(3)]


@pytest.mark.parametrize("case", ["plain", "balance", "persistent", "resume"])
def test_map_style_quota_conserves_every_sample_epoch(case):
    per_rank = [r[case] for r in results()]
    trained = collections.Counter(i for r in per_rank for i in r["trained"])
    carried = collections.Counter(k[1] for r in per_rank for k in r["carry"])
    assert all(isinstance(k, tuple) for r in per_rank for k in r["carry"])
    totals = {i: trained[i] + carried[i] for i in range(97)}
    assert set(totals.values()) == {3}, {i: t for i, t in totals.items() if t != 3}


@pytest.mark.parametrize("case", ["iterable", "iterable_persistent", "iterable_balance"])
def test_iterable_quota_never_repeats_or_skips(case):
    per_rank = [r[case] for r in results()]
    everything = [t for r in per_rank for t in r["trained"]]  # balance=True trains samples on other ranks
    assert len(everything) == len(set(everything)), "a stream sample was trained twice"
    for rank, r in enumerate(per_rank):
        done = {t for t in everything if t[0] == rank}
        occurrences = [(rank, p, j) for p in range(3) for j in range(r["count"])]
        assert done <= set(occurrences)
        untrained = [k for k, t in enumerate(occurrences) if t not in done]
        tail = 0  # the unread end of the stream
        while tail < len(untrained) and untrained[-1 - tail] == len(occurrences) - 1 - tail:
            tail += 1
        skipped = [occurrences[k] for k in untrained[:len(untrained) - tail]]
        assert len(skipped) <= len(r["carry"]), (rank, skipped)  # only the carried buffer may lie behind
