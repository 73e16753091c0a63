"""A job that ends normally exits 0 on every rank (issue 36, NOTE [ Exit-time teardown ] in evenflow.runtime.teardown).

The exit loop runs real ranks to a real interpreter exit (tests/exit_job.py): an epoch left open at exit (with and
without DataLoader workers), after a finished epoch where one rank had nothing to do, and a peer killed while this
rank still holds an open epoch. Each rank's last ``atexit`` callback records what is still running just before the
interpreter finalizes: none of evenflow's threads, no DataLoader worker. The rest checks :func:`release`, which keeps
a worker thread from freeing a collective's tensors under a finalizing interpreter, in one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from _dist import run_session
from evenflow.runtime import comm
from evenflow.runtime.comm import release

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).with_name("exit_job.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))


def _left_at_exit(out: Path, rank: int) -> dict:
    probe = json.loads((out / f"probe-rank{rank}.json").read_text())
    return {"evenflow threads": [t for t in probe["threads"] if t.startswith("evenflow-")],
            "DataLoader workers": probe["children"]}


# -- the exit loop ------------------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_job_that_ends_normally_exits_zero_with_nothing_left_running(tmp_path):
    """Under torchrun: an epoch finished (one rank had nothing to do), then two left open, one with DataLoader
    workers. At e25fa43 this aborted (``terminate called without an active exception``, exit -6: the open epochs'
    collation threads were inside torch and gloo calls when Python finalized) or left threads and workers behind."""
    proc = run_session([*TORCHRUN, str(JOB), str(tmp_path), "mixed"], timeout=180, what="exit_job.py mixed",
                       env=_env(), cwd=tmp_path, stderr=subprocess.STDOUT)
    assert "terminate called" not in proc.stdout, proc.stdout[-3000:]
    assert proc.returncode == 0, proc.stdout[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"trained-rank{rank}").exists()
        assert _left_at_exit(tmp_path, rank) == {"evenflow threads": [], "DataLoader workers": []}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_peer_killed_while_this_rank_holds_an_open_epoch(tmp_path):
    """Rank 1 is SIGKILLed after its batches; rank 0's script then ends with its epoch open. Closing that epoch at
    exit runs one more round, which finds the peer gone at once (gloo: connection closed): rank 0 still exits 0,
    promptly, with nothing left running. Plain processes, not torchrun, which would stop rank 0 itself."""
    rendezvous = tmp_path / "rendezvous"
    ranks = [subprocess.Popen([sys.executable, str(JOB), str(tmp_path), "peer-dies", "--file", str(rendezvous),
                               "--rank", str(r), "--world", "2"], env=_env(), cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        out0, _ = ranks[0].communicate(timeout=90)
        ranks[1].communicate(timeout=30)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert ranks[1].returncode == -9
    assert "terminate called" not in out0, out0[-3000:]
    assert ranks[0].returncode == 0, out0[-3000:]
    assert _left_at_exit(tmp_path, 0) == {"evenflow threads": [], "DataLoader workers": []}


# -- release(): what a collective's caller waits for ------------------------------------------------------
def _held_by_thread(tensor: torch.Tensor, drop: threading.Event, after_drop_s: float, exited: list) -> threading.Thread:
    """A thread that holds ``tensor`` -- as a gloo worker holds a finished work -- until ``drop``, then keeps its
    Python thread state ``after_drop_s`` longer (a worker still inside the tensor's deallocation)."""
    def body(held=[tensor]):  # noqa: B006 - the thread's own reference
        drop.wait(30)
        held.clear()
        time.sleep(after_drop_s)
        exited.append(time.monotonic())
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(30)
def test_release_returns_at_once_for_tensors_freed_here():
    buffers = [torch.zeros(4), torch.ones(2)]
    start = time.monotonic()
    release(buffers)
    assert buffers == [] and time.monotonic() - start < 0.5


@pytest.mark.timeout(30)
def test_release_waits_until_the_thread_that_frees_a_tensor_is_done_with_python():
    """The tensor is freed on the other thread; release() returns only once that thread's thread state is gone --
    not when the tensor died, 0.3 s earlier (the weak reference's callback)."""
    drop, exited = threading.Event(), []
    buffers = [torch.zeros(4)]
    thread = _held_by_thread(buffers[0], drop, 0.3, exited)
    threading.Timer(0.2, drop.set).start()
    release(buffers)
    returned = time.monotonic()
    thread.join(5)
    assert exited and returned >= exited[0]


@pytest.mark.timeout(30)
def test_release_is_bounded_when_a_tensor_is_never_dropped(monkeypatch):
    monkeypatch.setattr(comm, "_RELEASE_BOUND_S", 0.3)
    drop, exited = threading.Event(), []
    buffers = [torch.zeros(4)]
    thread = _held_by_thread(buffers[0], drop, 0.0, exited)
    start = time.monotonic()
    release(buffers)  # the holder never lets go within the bound: give up after it, do not hang the exchange
    assert 0.25 < time.monotonic() - start < 3.0
    drop.set()
    thread.join(5)


@pytest.mark.timeout(30)
def test_an_exchange_keeps_its_last_tensors_for_a_few_exchanges_then_frees_them_on_its_own_thread():
    """MetadataExchange frees an exchange's tensors a few exchanges later (by then the gloo worker dropped the
    work), sooner when they are large, and every one at ``close()`` (run at exit, after the loaders' epochs)."""
    exchange = comm.MetadataExchange(comm.Topology(0, 2, None))
    freed: list[int] = []
    refs = []
    for i in range(6):
        buffers = [torch.zeros(3), torch.zeros(3)]
        refs += [weakref.ref(t, lambda _r, i=i: freed.append(i)) for t in buffers]
        exchange._hold(buffers)
        del buffers
    assert freed == [0, 0, 1, 1] and len(exchange._held) == comm._HELD_EXCHANGES
    exchange._hold([torch.zeros(comm._HELD_BYTES // 4, dtype=torch.int32)])  # a large one: only it is kept
    assert freed == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5] and len(exchange._held) == 1
    exchange.close()
    assert len(exchange._held) == 0


@pytest.mark.timeout(30)
def test_an_exchange_freed_before_exit_releases_its_last_tensors_as_close_does():
    """A loader local to a function that returns just before exit takes its exchange with it: the last exchange's
    tensors, still held by the worker thread here, are released when the exchange is freed -- it returns only once
    that thread is done with Python, as close() at exit would."""
    exchange = comm.MetadataExchange(comm.Topology(0, 2, None))
    drop, exited = threading.Event(), []
    buffers = [torch.zeros(3)]
    thread = _held_by_thread(buffers[0], drop, 0.3, exited)
    exchange._hold(buffers)
    del buffers
    threading.Timer(0.2, drop.set).start()
    del exchange
    returned = time.monotonic()
    thread.join(5)
    assert exited and returned >= exited[0]
