"""Run a function on W real gloo processes: file:// rendezvous (no ports), polled with a timeout.

The child runs ``fn(rank, world_size, *args)`` and its return value comes back pickled; an exception comes
back as its formatted traceback. Survivors are killed when the deadline passes, so no test can hang.
:func:`run_session` does the same for a launched command (torchrun, a Ray driver): its whole process group.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist


class RankFailed(RuntimeError):
    def __init__(self, rank: int, text: str) -> None:
        super().__init__(f"rank {rank} failed:\n{text}")
        self.rank = rank
        self.text = text


def _child(fn, rank: int, world: int, tmp: str, args: tuple, pg_timeout_s: float) -> None:
    out = os.path.join(tmp, f"result-{rank}.pkl")
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout_s))
        try:
            result = ("ok", fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(out + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(out + ".tmp", out)
    end_children()
    os._exit(0)  # skip interpreter teardown: nothing left to flush, and it avoids rare gloo teardown aborts


def end_children(grace_s: float = 5.0) -> None:
    """Terminate this process's multiprocessing children (DataLoader workers a scenario left open) before an
    ``os._exit``, which skips multiprocessing's own exit handler: a worker still starting when its parent
    exits would watch the wrong parent and never exit (conftest's fixture fails a test that leaves one)."""
    children = mp.active_children()
    for p in children:
        p.terminate()
    for p in children:
        p.join(grace_s)
        if p.is_alive():
            p.kill()
            p.join(grace_s)


def run_world(fn, world_size: int, *args, timeout: float = 120.0, start_method: str = "spawn",
              pg_timeout_s: float = 60.0, allow_errors: bool = False) -> list:
    """Results per rank. With ``allow_errors`` a failed rank's entry is a :class:`RankFailed` instead of raising."""
    ctx = mp.get_context(start_method)
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, tmp, args, pg_timeout_s), daemon=False)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                for p in procs:
                    if p.is_alive():
                        p.kill()
                for p in procs:
                    p.join(5)
                raise TimeoutError(f"process world of {world_size} did not finish within {timeout:.0f} s")
            time.sleep(0.05)
        results = []
        for r, p in enumerate(procs):
            path = os.path.join(tmp, f"result-{r}.pkl")
            if not os.path.exists(path):
                results.append(RankFailed(r, f"exited with code {p.exitcode} and no result"))
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            results.append(value if status == "ok" else RankFailed(r, value))
    if not allow_errors:
        for res in results:
            if isinstance(res, RankFailed):
                raise res
    return results


def run_session(cmd: Sequence[str], *, timeout: float, what: str, stderr: int = subprocess.PIPE,
                on_timeout: Callable[[], str] = str, **popen: object) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session and return it completed; past ``timeout`` kill its whole process group
    (a launcher's ranks and their workers too: ``subprocess.run``'s timeout kills the launcher alone) and fail
    the test naming ``what``, ``on_timeout()`` (e.g. which ranks wrote their results) and the output's tail."""
    import pytest

    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
                            **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"{what} did not end within {timeout} s{on_timeout()}:\n{(err or out or '')[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def scenario_results(world, name: str) -> list:
    """Every rank's result of scenario ``name`` in a shared world (a list of per-rank dicts of results); a rank
    whose scenario raised fails the test with that rank's traceback."""
    import pytest

    res = [r[name] for r in world]
    for r, value in enumerate(res):
        if isinstance(value, dict) and "error" in value:
            pytest.fail(f"scenario {name} failed on rank {r}:\n{value['error']}")
    return res
