"""A per-step callable the collation thread runs on every batch before handing it over: the next step's work done
while the current one trains (``DynamicBatchLoader.set_step_prefetch``).

NOTE [ Per-step prefetch ]
    The collation thread releases step s+1 while the trainer still runs step s (``depth`` batches ahead), so work
    that needs only the batch and a small exchange -- a balanced VLM step's metadata exchange and plan -- can be
    done there, off the step's critical path. The loader knows nothing of what the callable does (the layer
    above registers it: ``evenflow.vlm.BalancedVLM.prefetch_from``); it guarantees:

    * **Same order on every rank.** The callable runs for every released batch (IDLE ones too), in step order,
      after the round's last exchange (NOTE [ Round sequence ]): every rank releases the same steps at the same
      point, so a collective inside the callable meets its peers' -- on the loader's own gloo group, which this
      thread alone uses (never the training group: its collectives run on the trainer's thread, in another
      order).
    * **Before the batch is handed over.** The trainer takes batch s+1 only once its callable returned: what
      it stored is there when the step needs it.
    * **A failure stops the epoch at that step on every rank.** The callable must share its own failures with
      its peers in its collective (``GlobalOrchestrator.gather_examples`` does: the failing rank raises its
      error, every other rank ``PeerError`` naming it), so every rank's callable raises at the same
      step. The collation thread queues that exception behind the batches already handed over, releases
      nothing more and ends the epoch: the trainer gets it from ``next(loader)`` instead of batch s+1, within the
      step. A callable that raises on one rank only, before its collective, leaves its peers waiting until the
      group's ``timeout``: share failures inside the exchange, never before it.
    * **Stops are unchanged.** A ``break`` or ``max_steps`` stop is reported in the next round's first exchange
      as always; a callable's collective already under way is completed by every rank's collation thread first
      (none of them has read the stop yet), so no rank is left inside it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..step_info import LoaderTerms, StepInfo

__all__ = ["StepPrefetch", "bind_prefetch", "check_prefetch"]

StepPrefetch = Callable[[Mapping, StepInfo, object], None]
"""``prefetch(batch, info, group)``: ``batch`` the collated batch (its StepInfo not attached yet), ``info`` the
StepInfo the trainer will get with it (the same object), ``group`` the loader's gloo process group."""


def check_prefetch(fn: object) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"set_step_prefetch takes a callable prefetch(batch, info, group) or None, got "
                        f"{type(fn).__name__}")


def bind_prefetch(fn: StepPrefetch | None, group: object,
                  terms: LoaderTerms) -> Callable[[Mapping, StepInfo], None] | None:
    """What the collation thread calls per batch: ``fn`` with the loader's group, ``info`` already carrying the
    loader's terms (the trainer's side records them again when it takes the batch)."""
    if fn is None:
        return None

    def run(batch: Mapping, info: StepInfo) -> None:
        info.set_loader_terms(terms)
        fn(batch, info, group)
    return run
