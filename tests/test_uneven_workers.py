"""DataLoader workers that end at different times train every sample once; a killed one is still reported.

torch stops an iterable dataset's worker as soon as its shard is exhausted, while its siblings go on; the
loader's dead-worker watch must tell that worker (it said goodbye) from one that was killed mid-shard (it did
not). One real gloo world of 2 ranks runs every scenario in turn: fork, spawn and forkserver workers (the last
two on one rank, the other reading without workers), with and without persistent workers (worker 2's shard is
empty), a map-style dataset with an empty rank, and a worker
SIGKILLed mid-shard. The full matrix (W = 1 and 2, num_workers 2-4, empty streams) runs in ``make soak``.
"""

from __future__ import annotations

import pytest

import worker_scenarios as ws
from _dist import run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD = 2
CALLS = [("fork:persistent", "sc_uneven", dict(context="fork", workers=3, persistent=True, epochs=2, pause_s=0.0)),
         ("spawn", "sc_uneven", dict(context="spawn", workers=2, only_rank=0, pause_s=3.0)),
         ("forkserver", "sc_uneven", dict(context="forkserver", workers=2, only_rank=1)),
         ("map:fork", "sc_map_small", dict(context="fork", workers=2)),
         ("killed", "sc_killed", dict(context="fork", workers=3))]


@pytest.fixture(scope="module")
def world():
    per_rank = run_world(ws.sc_many, WORLD, CALLS, timeout=500)
    return {name: [r[name] for r in per_rank] for name, _, _ in CALLS}


@pytest.mark.parametrize("name", ["fork:persistent", "spawn", "forkserver"])
def test_workers_that_end_unevenly_train_every_sample_once(world, name):
    res = world[name]
    assert all(out["error"] is None for out in res), [out["error"] for out in res]
    for epoch in range(len(res[0]["epochs"])):
        got = sorted(g for out in res for g in out["epochs"][epoch])
        want = sorted(g for out in res for g in out["expected"])
        assert got == want, (name, epoch, len(got), len(want))


def test_a_rank_whose_map_workers_get_no_index_ends_its_epoch_normally(world):
    res = world["map:fork"]
    assert sorted(g for out in res for g in out["epochs"][0]) == [0], res


def test_a_worker_killed_mid_shard_is_reported_as_killed_naming_the_signal(world):
    own, peer = world["killed"][1], world["killed"][0]
    assert own["type"] == "RuntimeError", own
    assert "DataLoader worker 0 (pid" in own["error"] and "killed by SIGKILL" in own["error"], own
    assert "out-of-memory" in own["error"], own
    assert peer["type"] == "PeerError" and "killed by SIGKILL" in peer["detail"], peer
    # worker_timeout is 60 s: the watch (0.1 s polls, 1 s grace) reports it within seconds.
    assert own["seconds"] < 20 and peer["seconds"] < 20, (own, peer)
