"""DataLoader workers that end at different times, or are killed: scenarios run inside real gloo worlds
(tests/_dist.run_world). Kept module-level so spawn- and forkserver-started workers can import them.

Every sample is tagged ``gid = rank * 100_000 + j``; a scenario returns the gids it trained (or the error it met),
so a test can check that every sample of every rank trained exactly once.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
from torch.utils.data import Dataset, IterableDataset

import evenflow

BUDGET = 512


def _sample(gid: int) -> dict:
    n = 3 + gid % 17
    return {"input_ids": torch.full((n,), gid % 30_000, dtype=torch.long), "gid": gid}


class UnevenShards(IterableDataset):
    """Worker 0 yields ``count`` samples, pausing ``pause_s`` once (a cold read) so it outlives its siblings by
    seconds, worker 1 a few and then ends, every other worker nothing (files dealt to workers: 10 files over 3
    workers). ``kill_at``: worker 0 SIGKILLs itself after that many samples, mid-shard."""

    def __init__(self, rank: int, count: int = 40, pause_s: float = 1.6, kill_at: int | None = None) -> None:
        self.rank, self.count, self.pause_s, self.kill_at = rank, count, pause_s, kill_at

    def ids(self) -> list[int]:
        return [self.rank * 100_000 + j for j in range(self.count)]

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid = info.id if info is not None else 0
        ids = self.ids()
        mine = ids[3:] if wid == 0 else ids[:3] if wid == 1 else []
        if info is None:
            mine = ids
        for k, gid in enumerate(mine):
            if self.kill_at is not None and wid == 0 and k == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if wid == 0 and k == 3:
                time.sleep(self.pause_s)
            yield _sample(gid)


class MapItems(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return _sample(i)


def _train(loader) -> list[int]:
    got = []
    for batch in loader:
        if evenflow.pop_step_info(batch).is_idle:
            continue  # a placeholder batch: its sample trains nothing
        got.extend(int(g) for g in batch["gid"])
    return got


def sc_uneven(rank, world, context, workers, persistent=False, epochs=1, count=40, only_rank=None, pause_s=1.6):
    """An iterable stream whose workers end seconds apart (worker 2 at once); every epoch's gids. ``only_rank``:
    the other ranks read without workers (spawn and forkserver workers each import torch: seconds on 2 cores)."""
    ds = UnevenShards(rank, count=count, pause_s=pause_s)
    if only_rank not in (None, rank):
        workers, context = 0, None
    loader = evenflow.DynamicBatchLoader(ds, token_budget=BUDGET, buffer_size=8, num_workers=workers,
                                         multiprocessing_context=context, persistent_workers=persistent,
                                         timeout=timedelta(seconds=60), worker_timeout=timedelta(seconds=30))
    out = []
    try:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            out.append(_train(loader))
    except Exception as exc:  # noqa: BLE001 - returned to the test, which names it
        return dict(epochs=out, expected=ds.ids(), error=f"{type(exc).__name__}: {exc}")
    finally:
        loader.close()
    return dict(epochs=out, expected=ds.ids(), error=None)


def sc_map_small(rank, world, context, workers, n=1):
    """A map-style dataset with fewer samples than ranks: some rank's workers get no index at all."""
    loader = evenflow.DynamicBatchLoader(MapItems(n), token_budget=BUDGET, buffer_size=8, num_workers=workers,
                                         multiprocessing_context=context, timeout=timedelta(seconds=60),
                                         worker_timeout=timedelta(seconds=30))
    try:
        return dict(epochs=[_train(loader)])
    finally:
        loader.close()


def sc_killed(rank, world, context, workers):
    """Rank 1's worker 0 SIGKILLs itself mid-shard: this rank's error (or PeerError), and how long it took."""
    ds = UnevenShards(rank, count=40, kill_at=5 if rank == 1 else None)
    loader = evenflow.DynamicBatchLoader(ds, token_budget=BUDGET, buffer_size=8, num_workers=workers,
                                         multiprocessing_context=context, timeout=timedelta(seconds=120),
                                         worker_timeout=timedelta(seconds=60))
    t0 = time.monotonic()
    try:
        _train(loader)
        return dict(type=None, error="", seconds=time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return dict(type=type(exc).__name__, error=str(exc), seconds=time.monotonic() - t0,
                    detail=getattr(exc, "detail", ""))
    finally:
        loader.close()


def sc_many(rank, world, calls):
    """Several scenarios in one world, in order: ``calls`` = [(name, function name, kwargs)]."""
    return {name: globals()[fn](rank, world, **kw) for name, fn, kw in calls}
