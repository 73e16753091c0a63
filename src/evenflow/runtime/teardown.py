"""Nothing of evenflow's is left running when the interpreter finalizes: NOTE [ Exit-time teardown ].

NOTE [ Exit-time teardown ]
    A job that trained and ended normally could still die at exit with ``terminate called without an active
    exception`` (SIGABRT; torchrun reports exit code -6 and the job as failed). Core dumps of the aborting ranks
    show the mechanism: CPython before 3.14 ends any thread that asks for the GIL once ``Py_FinalizeEx`` has
    begun -- right after the ``atexit`` callbacks -- with ``pthread_exit``, and its forced unwind calls
    ``std::terminate`` when it crosses a C++ frame that may not throw, a destructor (3.14 parks such a thread
    instead: cpython gh-87135). Two kinds of threads asked for the GIL from such frames:

    1. evenflow's collation thread and its helper (daemon threads) while an epoch is still open at exit -- an
       iterator kept after the loop stopped at ``max_steps``: they are inside torch ops or a gloo exchange,
       whose bindings take the GIL back in a destructor.
    2. A ``ProcessGroupGloo`` worker thread (``c10d::ProcessGroupGloo::runLoop``) dropping a finished work
       (``~AsyncAllgatherWork``) after the caller's Python tensors died: torch then keeps their Python objects
       alive from C++ and frees them on that thread (``TensorImpl::decref_pyobject`` -> ``THPVariable_dealloc``),
       taking the GIL, dropping it while the storage is freed, taking it back. A collective in the last
       milliseconds of a job races finalization: the loader's last exchange, or HF ``Trainer``'s own
       ``store_flos`` all_gather at the end of ``train()`` (the TRL aborts examined were in the *default*
       group's worker, freeing that all_gather's tensors).

    benchmarks/exit_repro.py forces each case; at e25fa43 an open epoch aborted 14 runs in 20, the loader's
    last exchange 2 in 20 and the Trainer's last all_gather 4 in 20 (their gloo workers slowed).

    What evenflow does, so that no such thread is left behind:

    * an ``atexit`` callback (registered by the first loader; it runs before finalization, interpreter intact)
      closes every epoch still open -- all loaders at once, since a peer may close its loaders in another order
      and each close runs one more round -- joining the collation thread and its helper and shutting the
      epoch's DataLoader workers down; then it frees every exchange's last tensors as below;
    * a [`MetadataExchange`][evenflow.runtime.comm.MetadataExchange] keeps each exchange's tensors for a few exchanges,
      so the worker has dropped the work before Python frees them, on the collation thread; the last ones are
      released at exit, or when the exchange is freed before (a loader local to a function that returns just
      before the script ends: the weak registration above then closes nothing);
      [`release()`][evenflow.runtime.comm.release] frees tensors and waits until the thread that frees them is done
      with Python (its temporary thread state is deleted), for those still held and for one-off collectives
      (``sum_over``: ``evaluate_loss``, and the HF integration's ``store_flos``).

    A process group itself needs nothing: destroyed during finalization it joins idle worker threads, which
    never take the GIL. Not covered: a collective of code that is not evenflow's -- your own ``all_reduce``,
    another library's metrics, torch's ``all_gather_object`` under ``gather_states`` (a checkpoint's loader
    states) -- in the last moments before exit; end such a script as its framework says
    (``dist.destroy_process_group()``, Accelerate's ``end_training()``) or with
    ``evenflow.integrations.destroy_process_groups()`` (docs/failures.md, "Exit codes"). And a user call the
    helper thread was abandoned in (past ``worker_timeout``) stays where it is.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref

__all__ = ["close_at_exit", "forget_at_exit"]

logger = logging.getLogger("evenflow")

_open = (weakref.WeakSet(), weakref.WeakSet())
"""What to ``close()`` at exit, in two passes: loaders with an open epoch, then metadata exchanges (whose last
tensors a closing epoch may have just used). Held weakly: an object freed earlier is gone."""
_lock = threading.Lock()
_registered = False


def close_at_exit(obj: object, *, after_loaders: bool = False) -> None:
    """Call ``obj.close()`` at interpreter exit, before finalization, unless [`forget_at_exit()`][forget_at_exit] came
    first."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_close_all)
            _registered = True
        _open[1 if after_loaders else 0].add(obj)


def forget_at_exit(obj: object) -> None:
    with _lock:
        for objects in _open:
            objects.discard(obj)


def _close_all() -> None:
    for objects in _open:
        with _lock:
            pending = list(objects)
        # Every loader at once: closing one runs a last round with its peers, and a peer may close its loaders in
        # another order -- one at a time, two ranks would each wait in a round the other has not reached yet.
        closers = [threading.Thread(target=_close, args=(obj,), name="evenflow-exit", daemon=True) for obj in pending]
        for thread in closers:
            thread.start()
        for thread in closers:
            thread.join()  # each close() is bounded (a loader's by its timeout)


def _close(obj: object) -> None:
    try:
        obj.close()
    except Exception:  # noqa: BLE001 - exiting: report it and close the others
        logger.exception("evenflow: closing %s at interpreter exit failed", type(obj).__name__)
