"""The collation thread's calls into user code, run on a helper thread and waited for with a bound.

NOTE [ User code is bounded ]
    The collation thread must attend every exchange of every round: a rank that does not is a rank its peers
    wait for until ``timeout``, then cannot name. But it calls user code -- the stream's next sample (the
    dataset's ``__getitem__`` itself with ``num_workers=0``), ``length_fn``, ``resources_fn``, ``collate_fn``
    -- and a Python thread cannot be interrupted. So those calls run on one helper thread (a daemon: a call
    that never returns cannot keep the process alive), and the collation thread waits for them, checking
    every [`POLL_S`][POLL_S]:

    * a call running longer than the bound (``worker_timeout``) -> [`Stuck`][Stuck], naming the call and the
      sample; the collation thread reports it in the round's next exchange like any failure, so every peer
      raises PeerError naming this rank and the call within the round, and this rank's trainer raises it;
    * a DataLoader worker process that died (the out-of-memory killer's SIGKILL) while the stream waits for
      a sample -> [`WorkerDied`][WorkerDied] within about a second, naming the signal: torch itself would only
      notice at its own timeout, because its SIGCHLD check runs on the main thread, which is the trainer's
      here. A worker torch stopped because its shard ran out is not a death: it said so first (NOTE [ Workers
      that end early ] in source.py), and the watch skips it.

    One hop to the helper per round's fill and per round's collation (not per sample): the helper marks the
    start of every user call, so the bound applies to each call, not to a whole fill. After a Stuck the
    helper is abandoned (it may return some day; nothing waits for it) and the epoch ends in an error round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["POLL_S", "DEATH_GRACE_S", "Stuck", "WorkerDied", "UserCalls"]

POLL_S = 0.1
"""How often the collation thread looks at a call in progress."""
DEATH_GRACE_S = 1.0
"""A fetch that still has not returned this long after a worker was seen dead is a crash, not an epoch end
(at the end of a pass the DataLoader itself stops its workers while the last fetch returns)."""


class Stuck(RuntimeError):
    """A call into user code on the collation thread ran past its bound: args ``(what, key)``."""


class WorkerDied(RuntimeError):
    """A DataLoader worker process died while the stream waited for a sample: args ``(which workers, key)``."""


class UserCalls:
    """One daemon helper thread; [`run()`][run] hands it a job and waits (see NOTE [ User code is bounded ]).

    ``limit_s``: the bound on one user call. ``dead_workers``: returns a description of this epoch's dead
    DataLoader workers, or None (checked only while the helper waits for the stream's next sample).
    """

    def __init__(self, name: str, limit_s: float, dead_workers: Callable[[], str | None] | None = None) -> None:
        self.limit_s = limit_s
        self.dead_workers = dead_workers
        self._cond = threading.Condition()
        self._job: Callable[[], object] | None = None
        self._result: tuple[bool, object] | None = None
        self._call: tuple[str, object, float, bool] | None = None  # (what, key, deadline, is a fetch)
        self._closed = False
        self.abandoned = False
        """A call never returned (or a worker died under it): no more jobs are run."""
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- helper thread -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                if self._job is None:
                    return
                job = self._job
            try:
                result = (True, job())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting collation thread
                result = (False, exc)
            with self._cond:
                self._job, self._call, self._result = None, None, result
                self._cond.notify_all()

    def mark(self, what: str, key: object = None, *, fetch: bool = False, bounded: bool = True) -> None:
        """Called by a job on the helper thread before each user call: ``what`` and ``key`` (the sample) name
        it in a [`Stuck`][Stuck]. ``fetch``: the call waits for DataLoader workers (their deaths are watched);
        ``bounded=False``: no bound of ours (the DataLoader's own ``timeout`` bounds a wait for its workers,
        with a better message)."""
        self._call = (what, key, time.monotonic() + (self.limit_s if bounded else float("inf")), fetch)

    def unmark(self) -> None:
        """The user call marked last returned."""
        self._call = None

    # -- collation thread ----------------------------------------------------------------------------------
    def run(self, job: Callable[[], object]) -> object:
        """Run ``job`` on the helper thread; its result, or what it raised, or [`Stuck`][Stuck] /
        [`WorkerDied`][WorkerDied]."""
        if self.abandoned:
            raise RuntimeError("evenflow: the collation helper thread is still inside an earlier call that ran past "
                               "its bound; this epoch cannot continue")
        with self._cond:
            self._result, self._call, self._job = None, None, job
            self._cond.notify_all()
            dead_since = None
            while self._result is None:
                self._cond.wait(POLL_S)
                if self._result is not None:
                    break
                call = self._call
                now = time.monotonic()
                if call is not None and now > call[2]:
                    self.abandoned = True
                    raise Stuck(call[0], call[1])
                if call is not None and call[3] and self.dead_workers is not None:
                    dead = self.dead_workers()
                    dead_since = (dead_since or now) if dead else None
                    if dead and now - dead_since >= DEATH_GRACE_S:
                        self.abandoned = True
                        raise WorkerDied(dead, call[1])
            ok, value = self._result
        if not ok:
            raise value
        return value

    def close(self, wait_s: float = 0.0) -> None:
        """Let the helper thread exit once it is idle (a stuck one stays stuck, as a daemon), and wait up to
        ``wait_s`` until it has (not for an abandoned one): no helper outlives its epoch (NOTE [ Exit-time
        teardown ] in teardown.py)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if wait_s > 0 and not self.abandoned:
            self._thread.join(wait_s)
