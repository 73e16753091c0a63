"""Run ``fn(rank, world_size, *args)`` on W spawned gloo processes: file:// rendezvous, hard deadline.

Results come back pickled through files; a rank's exception comes back as its traceback text. Survivors are
killed at the deadline, so a benchmark can never hang.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta

__all__ = ["run_world", "WorldFailed"]


class WorldFailed(RuntimeError):
    pass


def _child(fn, rank: int, world: int, tmp: str, args: tuple, pg_timeout_s: float, threads: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    out = os.path.join(tmp, f"result-{rank}.pkl")
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout_s))
        try:
            result = ("ok", fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(out + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(out + ".tmp", out)
    os._exit(0)  # skip interpreter teardown (rare gloo teardown aborts); everything is flushed


def run_world(fn, world_size: int, *args, timeout: float = 300.0, pg_timeout_s: float = 120.0,
              threads: int = 1) -> list:
    """Per-rank return values of ``fn``; raises :class:`WorldFailed` on a rank error or the deadline."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="evenflow-world-") as tmp:
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, tmp, args, pg_timeout_s, threads))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs):
                if time.monotonic() > deadline:
                    raise WorldFailed(f"{world_size} processes did not finish within {timeout:.0f} s")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
        results = []
        for r, p in enumerate(procs):
            path = os.path.join(tmp, f"result-{r}.pkl")
            if not os.path.exists(path):
                raise WorldFailed(f"rank {r} exited with code {p.exitcode} and no result")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise WorldFailed(f"rank {r} failed:\n{value}")
            results.append(value)
    return results
