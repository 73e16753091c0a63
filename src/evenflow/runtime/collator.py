"""The collation stage: one background thread per epoch that buffers, plans, aligns and collates.

Why a thread and not a process: the stage's own work is small (planning a 1,024-sample buffer takes well
under a millisecond, the two exchanges a few milliseconds), collate_fn's tensor copies release the GIL, and
a thread needs no pickling, inherits nothing through fork, and shares the process's gloo group. Workers stay
processes (the user's ``num_workers``) -- they run the expensive pipeline.

NOTE [ Round sequence ]
    Every rank, every round, finished or not, in this order:
        fill buffer -> wait for room (back-pressure, before the round) -> exchange 1 (RankReport)
        -> decide_round -> apply [global: plan, move] -> collate the round -> exchange 2 (slot counts, fixed
        width, and a flag: did this rank fail after exchange 1?) -> [balance=True: exchanges 3, 4, collate, one
        commit flag] -> [error rounds only: the error-detail exchange] -> act on the decision.
    A stop request, an error or the end of the epoch is *reported in an exchange* and acted upon only after
    the round's last exchange, so no rank ever leaves a peer waiting inside a collective. Which optional
    exchanges a round has follows from exchange 1, identically on every rank (NOTE [ Faults in the round
    sequence ] in evenflow/errors.py, NOTE [ Early stops ]). Calls into user code (the stream, ``length_fn``,
    ``collate_fn``) run on a helper thread under a bound (NOTE [ User code is bounded ] in calls.py).

NOTE [ The end of an epoch is agreed ]
    The round that finds every stream dry is not the last one: once this rank's trainer took every batch (or
    stopped), one more round is exchanged, and only a round without a stop or an error hands the trainer the
    end of the epoch. Without it a rank that stops at one of the last ``depth`` steps would stop after its
    peers' collation threads had finished, and they would end the epoch normally, having trained batches it
    never did. The extra round costs one exchange per epoch; a single rank skips it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from ..planning.alignment import NO_VALUE, SLOT_WIDTH, Item, RankPlanner, RankReport, RoundDecision, decide_round
from ..planning.grouping import GroupingConfig
from ..planning.loss import LossTokenRule, count_loss_tokens, loss_scale
from .calls import Stuck, UserCalls, WorkerDied
from .collate_extras import SampleError
from .comm import MetadataExchange
from ..errors import PeerError, PeerStopped, decode_detail, encode_detail, sample_of, trainer_failed
from .stream_check import StreamCheck
from ..step_info import STEP_INFO_KEY, StepInfo

if TYPE_CHECKING:  # balancing pulls in evenflow.balance; only balance=True loaders need it
    from .balancing import BalancedRound, StepRebalancer
    from .global_round import GlobalRound

__all__ = ["Handoff", "SampleSpec", "EpochPipeline", "Release", "default_batch_check", "MAX_VALUE"]

logger = logging.getLogger("evenflow")

# How long the collation thread waits for its idle helper thread to exit at the end of an epoch.
_HELPER_EXIT_S = 5.0


class Handoff:
    """Ready batches between the collation thread and the trainer, with back-pressure and a stop flag.

    A failure (this rank's or a peer's, NOTE [ Faults in the round sequence ]) jumps the queue: [`get()`][get]
    raises it before any batch still held. A peer's STOP(r, s) is raised once the trainer asks past step s.
    """

    def __init__(self, rank: int = 0) -> None:
        self._cond = threading.Condition()
        self._items: deque = deque()
        self.rank = rank
        self.stop_requested = False
        self.stop_step = NO_VALUE
        """Batches the trainer had taken when it asked to stop (reported as STOP(rank, step))."""
        self.trainer_error: BaseException | None = None
        """``close(exc)`` / ``with loader:``: the trainer's own exception, reported to peers as an error."""
        self._failure: BaseException | None = None
        self._peer_stop: tuple[int, int] | None = None
        self._defer_until: float | None = None

    def put(self, item: tuple) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """Raise ``exc`` at the trainer's next [`get()`][get], ahead of queued batches (a failed exchange, a peer's
        trainer error: the ranks cannot stay level any more)."""
        with self._cond:
            if self._failure is None:
                self._failure = exc
            self._cond.notify_all()

    def fail_in_order(self, exc: BaseException) -> None:
        """Raise ``exc`` once the trainer took the batches already handed over: every rank handed over the same
        steps, so every rank yields as many batches before raising (NOTE [ Faults in the round sequence ])."""
        self.put(("error", exc))

    def peer_stopped(self, rank: int, step: int) -> None:
        with self._cond:
            self._peer_stop = (rank, step)
            self._items.append(("stopped",))
            self._cond.notify_all()

    def get(self, alive: Callable[[], bool], taken: int = 0) -> tuple:
        """The next item for a trainer that has taken ``taken`` batches this epoch."""
        with self._cond:
            while True:
                if self._failure is not None:
                    raise self._failure
                if self._peer_stop is not None and not self.stop_requested and (
                        taken >= self._peer_stop[1] or (self._items and self._items[0][0] == "stopped")):
                    raise PeerStopped(*self._peer_stop, this_rank=self.rank)
                if self._items:
                    break
                if not alive():
                    raise RuntimeError("evenflow: the collation thread exited without a result")
                self._cond.wait(timeout=1.0)
            item = self._items.popleft()
            self._cond.notify_all()
            if item[0] == "error":
                raise item[1]
            return item

    def wait_for_room(self, depth: int) -> None:
        """Back-pressure before a round; also holds a deferred stop until its deadline (then it is a STOP)."""
        with self._cond:
            while not self.stop_requested:
                if self._defer_until is not None:
                    left = self._defer_until - time.monotonic()
                    if left <= 0:
                        self.stop_requested = True
                        break
                    self._cond.wait(timeout=left)
                elif self._ready() >= depth:
                    self._cond.wait()
                else:
                    break

    def defer_stop(self, step: int, grace_s: float) -> None:
        """The iterator closed inside ``with loader:``: run no new round for ``grace_s`` so that __exit__ can
        still turn the STOP into an error report (NOTE [ Early stops ])."""
        with self._cond:
            if not self.stop_requested:
                self.stop_step = step
                self._defer_until = time.monotonic() + grace_s
            self._cond.notify_all()

    def _ready(self) -> int:
        return sum(1 for item in self._items if item[0] == "batch")

    def stop_state(self) -> StopState:
        """The stop flag, its step and the trainer's error, read together. Read apart, a ``close(exc)`` landing
        between the reads is published as a bare STOP and peers raise PeerStopped, not PeerError."""
        with self._cond:
            return StopState(self.stop_requested, self.stop_step, self.trainer_error)

    def request_stop(self, step: int = NO_VALUE, error: BaseException | None = None) -> None:
        with self._cond:
            if not self.stop_requested and self._defer_until is None:
                self.stop_step = step
            if error is not None and self.trainer_error is None:
                self.trainer_error = error
            self.stop_requested = True
            self._cond.notify_all()


class StopState(NamedTuple):
    """What [`Handoff.stop_state()`][Handoff.stop_state] read at once."""

    requested: bool
    step: int
    trainer_error: BaseException | None


@dataclass(frozen=True)
class Release:
    """One batch handed to the trainer."""

    batch: object
    info: StepInfo
    keys: list
    """Keys this rank owns at this step (NOTE [ Who owns a moved sample ]): committed as consumed."""


MAX_VALUE = 2**40
"""Largest length or resource a sample may report: sums over a buffer (4,096 x 2**40 < 2**63) stay in int64.
A larger value is a bug in ``length_fn``/``resources_fn`` (2**63 would overflow the exchanges themselves)."""


@dataclass(frozen=True, kw_only=True)
class SampleSpec:
    """How a raw sample is measured and validated (runs on the collation thread, per arriving sample)."""

    length_fn: Callable[[Mapping], int] | None
    resources_fn: Callable[[Mapping], Mapping[str, int]] | None
    resource_names: tuple[str, ...]
    loss_rule: LossTokenRule

    @property
    def user_calls(self) -> str:
        """What [`measure()`][measure] calls of the user's, as an error names it."""
        names = [n for n, fn in (("length_fn", self.length_fn), ("resources_fn", self.resources_fn)) if fn]
        return " / ".join(names) if names else "measuring a sample"

    def measure(self, key: object, sample: object) -> tuple[int, int, dict[str, int]]:
        """``(length, loss_tokens, resources)``; ValueError naming the dataset index on bad input."""
        if not isinstance(sample, Mapping):
            raise ValueError(f"sample {key}: expected a mapping with 'input_ids', got {type(sample).__name__}; "
                             "make the dataset return a dict such as {'input_ids': ..., 'labels': ...}")
        if "input_ids" not in sample:
            raise ValueError(f"sample {key}: no 'input_ids' key (keys: {sorted(map(str, sample))}); return the "
                             "tokenized sequence as 'input_ids'")
        n = _token_count(key, "input_ids", sample["input_ids"])
        if n == 0:
            raise ValueError(f"sample {key}: 'input_ids' is empty; filter empty samples out in the dataset")
        labels = sample.get("labels")
        if labels is not None and _token_count(key, "labels", labels) != n:
            raise ValueError(f"sample {key}: 'labels' has {_token_count(key, 'labels', labels)} entries but "
                             f"'input_ids' has {n}; they must align token for token")
        length = n
        if self.length_fn is not None:
            length = self.length_fn(sample)
            if isinstance(length, torch.Tensor):
                length = length.item()
            if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length <= 0:
                raise ValueError(f"sample {key}: length_fn returned {length!r}; it must return a positive int")
            if length > MAX_VALUE:
                raise ValueError(f"sample {key}: length_fn returned {length}, which no batch can hold (at most "
                                 f"2**40 tokens); it must return the sample's cost in tokens")
        tokens = count_loss_tokens(_as_array(labels if labels is not None else sample["input_ids"]), self.loss_rule)
        if self.resources_fn is not None:
            raw = dict(self.resources_fn(sample))
        else:
            missing = [name for name in self.resource_names if name not in sample]
            if missing:
                raise ValueError(f"sample {key}: extra_budgets names {missing} but the sample has no such key; "
                                 "add it to the sample or pass resources_fn")
            raw = {name: sample[name] for name in self.resource_names}
        resources = {}
        for name in self.resource_names:
            value = raw.get(name, 0)
            value = value.item() if isinstance(value, torch.Tensor) else value
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"sample {key}: resource {name!r} = {value!r} is not a non-negative int")
            if value > MAX_VALUE:
                raise ValueError(f"sample {key}: resource {name!r} = {value} is past any budget (at most 2**40); "
                                 "return the sample's own count of it")
            resources[name] = int(value)
        return int(length), tokens, resources


def default_batch_check(grouping: GroupingConfig) -> Callable[[Mapping, list, list], None]:
    """With the default collates, the batch's ``input_ids`` is the shape the planner costs (rows x padded
    length, or one padded row): larger than the budget means a ``length_fn`` that under-reports a sample.

    >>> check = default_batch_check(GroupingConfig(token_budget=8))
    >>> check({"input_ids": torch.zeros(2, 6)}, [Item(3, 1), Item(4, 6)],
    ...       [{"input_ids": [0] * 6}] * 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: the default collate built a batch of 12 tokens (2 x 6) for samples [3, 4], over token_budget=8: \
length_fn returned 1 for sample 3 but its 'input_ids' holds 6 tokens. ...
    """
    def check(batch: Mapping, items: list, samples: list) -> None:
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.numel() <= grouping.token_budget:
            return
        if len(items) == 1 and grouping.oversize == "alone":
            return  # an over-budget sample kept alone on purpose
        short = [(it.key, it.length, _token_count(it.key, "input_ids", s["input_ids"])) for it, s in zip(items, samples)
                 if isinstance(s, Mapping) and "input_ids" in s]
        short = [(k, length, n) for k, length, n in short if n > length]
        if not short:
            return  # not a length_fn problem: the collate is not the one the planner costs
        key, length, n = short[0]
        shape = " x ".join(map(str, ids.shape))
        raise ValueError(f"the default collate built a batch of {ids.numel()} tokens ({shape}) for samples "
                         f"{[sample_of(it.key) for it in items]}, over token_budget={grouping.token_budget}: length_fn "
                         f"returned {length} for sample {sample_of(key)} but its 'input_ids' holds {n} tokens. Under "
                         "the default collates length_fn must return at least len(input_ids) (add what else a sample "
                         "costs, e.g. image tokens, on top of it), or pass a collate_fn of your own that builds what "
                         "length_fn measures")
    return check


def _token_count(key: object, name: str, value: object) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ValueError(f"sample {key}: {name!r} must be 1-D, got shape {tuple(value.shape)}; return one "
                             "unpadded sequence per sample (the loader batches)")
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"sample {key}: {name!r} has dtype {value.dtype}; token ids must be integers "
                             "(a bool tensor is usually a mask passed in the wrong key)")
        return value.numel()
    if isinstance(value, (list, tuple, np.ndarray)):
        try:
            arr = np.asarray(value)
        except ValueError:  # ragged nested lists
            arr = None
        if arr is None or arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"sample {key}: {name!r} must be a 1-D sequence of ints (got a ragged, nested or "
                             "non-integer sequence); return one unpadded sequence of token ids per sample")
        return int(arr.size)
    raise ValueError(f"sample {key}: {name!r} has type {type(value).__name__}; use a 1-D LongTensor or a list of ints")


def _as_array(value: object) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


class EpochPipeline(threading.Thread):
    """Runs the rounds of one epoch (NOTE [ Round sequence ]) and feeds [`Handoff`][Handoff]."""

    def __init__(self, *, planner: RankPlanner, stream: Iterator | None, total: int | None, skip: frozenset,
                 exchange: MetadataExchange, fingerprint: int, spec: SampleSpec, collate_fn: Callable,
                 handoff: Handoff, epoch: int, depth: int, grad_accum_steps: int, payloads: dict,
                 template: Callable[[], object], on_first_sample: Callable[[object], None],
                 rebalancer: StepRebalancer | None = None, key_at: Callable[[int], object] | None = None,
                 report_fields: Mapping[str, int] | None = None, error: BaseException | None = None,
                 describe_fetch_error: Callable[[BaseException, object], BaseException] | None = None,
                 global_round: GlobalRound | None = None, planning_check: Callable[[], None] | None = None,
                 call_limit: timedelta | None = None, workers: bool = False,
                 dead_workers: Callable[[], str | None] | None = None,
                 check_batch: Callable[[object, list], None] | None = None,
                 stream_check: StreamCheck | None = None,
                 prefetch: Callable[[object, StepInfo], None] | None = None) -> None:
        super().__init__(name=f"evenflow-collate-e{epoch}", daemon=True)
        self.planner = planner
        self.stream = stream
        self.total = total
        """Samples in this epoch's stream when known (map-style), else None."""
        self.skip = skip
        self.exchange = exchange
        self.fingerprint = fingerprint
        self.spec = spec
        self.collate_fn = collate_fn
        self.handoff = handoff
        self.epoch = epoch
        self.depth = depth
        self.k = grad_accum_steps
        self.payloads = payloads
        self.template = template
        self.on_first_sample = on_first_sample
        self.rebalancer = rebalancer
        self.global_round = global_round
        """planning="global": plans each emitting round over the planning group's buffers (global_round.py)."""
        self.moves_after_counts = rebalancer is not None and global_round is None
        """balance=True: samples move after exchange 2, so a round is collated after it (NOTE [ Round sequence ])."""
        self.planning_check = planning_check
        """The epoch's first exchange: refuses peers with another planning configuration (every policy)."""
        self.key_at = key_at or (lambda pulled: pulled)
        """The key of the ``pulled``-th sample of the stream (names the sample a failed fetch was for)."""
        self.report_fields = dict(report_fields or {})
        """Constant RankReport fields of this epoch: epoch, data, resume, pid, host."""
        self.describe_fetch_error = describe_fetch_error
        self.call_limit = call_limit if call_limit is not None else timedelta(minutes=4)
        self.workers = workers
        """The stream waits for DataLoader workers (their own ``timeout`` bounds it; their deaths are watched)."""
        self.calls = UserCalls(f"evenflow-user-e{epoch}", self.call_limit.total_seconds(), dead_workers)
        self.check_batch = check_batch
        """The default collates: a batch larger than the budget means a ``length_fn`` that underestimates."""
        self.stream_check = stream_check
        """Iterable streams: the unsplit-stream check, gathered once (NOTE [ Sharding mistakes ] in shard_check.py)."""
        self.prefetch = prefetch
        """Run on every batch before it is handed over (NOTE [ Per-step prefetch ] in prefetch.py)."""
        self.prefetch_error: BaseException | None = None
        self.pulled = 0
        self.exhausted = total == 0 or stream is None
        self.error: BaseException | None = error
        self.error_key: object = None
        """The sample ``error`` is about (None: not about one sample)."""
        self.step = 0
        self.pending: list = []
        self.ending = False
        """The epoch's last round ran: one more round confirms the end (NOTE [ The end of an epoch is agreed ])."""
        self.world = exchange.topology.world_size
        self.pair_ids = rebalancer is not None and rebalancer.pair_keys
        self.width = planner.alignment.max_steps_per_round

    # -- thread body ---------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            if self.planning_check is not None:
                self.planning_check()
            while self._round():
                pass
        except BaseException as exc:  # exchange failure or a bug: nothing more can be exchanged safely
            self.handoff.fail(exc)
        finally:
            self.calls.close(wait_s=_HELPER_EXIT_S)  # idle here (unless abandoned): it exits at once

    def _round(self) -> bool:
        """One round of NOTE [ Round sequence ]; False once the epoch is over on every rank."""
        if self.prefetch_error is not None:  # every rank's failed at the same step (NOTE [ Per-step prefetch ])
            return False
        confirming = self.ending
        if not confirming:
            self._fill()
        self.handoff.wait_for_room(1 if confirming else self.depth)  # confirming: the trainer took every batch
        started = time.perf_counter()
        stop = self.handoff.stop_state()  # one read: see close(exc)'s stop and error both, or neither
        failure = self._reported_failure(stop.trainer_error)
        groups = self.planner.plan_local() if failure is None else []
        table = self.exchange.all_gather(self._report(groups, failure, stop).to_array())
        decision = decide_round(table, self.planner.alignment)
        if not self.exchange.peers.known:
            self.exchange.peers.note(table[:, 11], table[:, 12])  # names dead ranks if a later exchange fails
        if self.stream_check is not None and not (decision.error_ranks or decision.stop):
            refused = self.stream_check.after(table, self.exchange)  # one more exchange, once, every rank alike
            if refused is not None:  # every rank refuses in this round, after the batches all ranks released
                self.handoff.fail_in_order(refused)
                return False
        if self.global_round is not None and decision.target:  # same on every rank: all plan, or none
            slots, decision, unshared = self.global_round.plan(self.planner, table, decision)
            if unshared is not None:  # a moved sample this rank cannot unpack: shared in exchange 2
                self._fail(*unshared)
        else:
            slots = self.planner.apply(decision, groups) if failure is None else []
        emits = decision.target > 0 and not decision.error_ranks
        batches = self._collate_all(slots) if emits and not self.moves_after_counts else None
        counts = self.planner.slot_counts(slots, self.width)
        # Exchange 2 carries one more word: did this rank fail after exchange 1 (receiving or collating)?
        row = np.append(counts.ravel(), np.int64(self.error is not None and emits))
        out = self.exchange.all_gather(row)
        gathered = out[:, :-1].reshape(self.world, self.width, SLOT_WIDTH)
        late = tuple(int(r) for r in np.flatnonzero(out[:, -1]))
        error_ranks, balanced = self._balance(slots, gathered, decision, late)
        if self.moves_after_counts and emits and not error_ranks:
            batches = self._collate_all(balanced.slots)
            error_ranks = self._commit()
        logger.debug("evenflow round: epoch %d step %d T=%d (%.2f ms)", self.epoch, self.step, decision.target,
                     1e3 * (time.perf_counter() - started))
        if error_ranks:
            self._error_round(error_ranks)
            return False
        if decision.stop:
            self._on_stop(decision, confirming)
            return False
        self._emit(batches or [], slots, gathered, decision.steps_bound, balanced)
        if decision.epoch_done:
            self._release()
            if confirming or self.world == 1:
                self.handoff.put(("end",))
                return False
            self.ending = True
        return True

    def _reported_failure(self, trainer_error: BaseException | None) -> BaseException | None:
        """What this rank reports as its failure: its own loader error first, else the trainer's (``close(exc)``)."""
        return self.error if self.error is not None else trainer_error

    def _report(self, groups: list, failure: BaseException | None, stop: StopState) -> RankReport:
        ok = failure is None
        return RankReport(self.fingerprint, len(groups), len(self.planner.buffer) if ok else 0, self.exhausted,
                          self._unread(), stop.requested, not ok, stop.step if stop.requested else NO_VALUE,
                          **self.report_fields,
                          stream=NO_VALUE if self.stream_check is None else self.stream_check.reported())

    def _balance(self, slots: list, gathered: np.ndarray, decision: RoundDecision,
                 late: tuple[int, ...]) -> tuple[tuple, object]:
        """The rebalancer hook (balance=True: exchanges 3 and 4, every round, target 0 on stop/error/end rounds;
        global planning: no exchange). Returns the ranks in error after this round (the decision's, those that
        failed after exchange 1, or those that failed to send balanced samples)."""
        failed = tuple(sorted(set(decision.error_ranks) | set(late)))
        if self.rebalancer is None:
            return failed, None
        target = 0 if failed else decision.target
        outcome = self.rebalancer(slots, gathered, target)
        if outcome.failed_ranks:  # every rank got the same flags: all go to the error round together
            if outcome.error is not None:
                self.error, self.error_key = outcome.error, outcome.error_key
            return tuple(sorted(set(failed) | set(outcome.failed_ranks))), None
        if outcome.unshared is not None:  # shared by the commit exchange
            self._fail(*outcome.unshared)
        return failed, outcome

    def _commit(self) -> tuple[int, ...]:
        """balance=True: after collating the round, one flag per rank -- did receiving or collating fail? (The
        other policies carry this flag in exchange 2, which they reach with the round already collated.)"""
        flags = self.exchange.all_gather(np.array([self.error is not None], dtype=np.int64))
        return tuple(int(r) for r in np.flatnonzero(flags[:, 0]))

    def _error_round(self, error_ranks: tuple) -> None:
        """The one extra exchange of an error round (NOTE [ Faults in the round sequence ])."""
        failure = self._reported_failure(self.handoff.trainer_error)
        index = sample_of(self.error_key) if failure is self.error else None
        mine = encode_detail(failure if self._rank() in error_ranks else None, index,
                             trainer=failure is not None and failure is not self.error)
        table = self.exchange.all_gather(mine)
        if self._rank() in error_ranks:
            if failure is self.error and self.error is not None:
                self.handoff.fail_in_order(self.error)
            else:
                self.handoff.put(("stopped",))  # the trainer's own error: it is already propagating
            return
        first = error_ranks[0]
        name, message, sample = decode_detail(table[first])
        error = PeerError(first, name, message, sample, this_rank=self._rank())
        if trainer_failed(table[first]):  # that rank's trainer has left its loop: raise now
            self.handoff.fail(error)
        else:  # a loader failure: after the batches every rank released (NOTE [ Faults in the round sequence ])
            self.handoff.fail_in_order(error)

    def _on_stop(self, decision: RoundDecision, confirming: bool) -> None:
        if self.handoff.stop_requested:
            self.handoff.put(("stopped",))
        elif confirming and decision.stop_step >= self.step:
            # The stopping rank took every batch of the epoch before it stopped: nobody trained more than it.
            self.handoff.put(("end",))
        else:
            self.handoff.peer_stopped(decision.stop_rank, decision.stop_step)

    def _unread(self) -> int:
        return -1 if self.total is None else self.total - self.pulled

    # -- calls into user code (NOTE [ User code is bounded ] in calls.py) -----------------------------------
    def _fill(self) -> None:
        if self.error is not None or self.planner.full or self.exhausted:
            return
        try:
            self.calls.run(self._fill_job)
        except (Stuck, WorkerDied) as exc:
            self._fail(*self._bounded_error(exc))

    def _fill_job(self) -> None:
        """On the helper thread: buffer samples until the buffer is full or the stream is exhausted."""
        planner, calls = self.planner, self.calls
        while self.error is None and not planner.full and not self.exhausted:
            key = self.key_at(self.pulled)
            calls.mark(f"dataset (__getitem__/__iter__) on {_named(key, 'the next sample')}", key, fetch=True,
                       bounded=not self.workers)
            try:
                key, sample = next(self.stream)
            except StopIteration:
                self.exhausted = True
                break
            except Exception as exc:  # a worker's exception, re-raised by the DataLoader with its traceback
                if not calls.abandoned:
                    self._fail(self._fetch_error(exc), self.key_at(self.pulled))
                break
            finally:
                calls.unmark()
            if calls.abandoned:  # the collation thread gave up on this call and ended the epoch
                return
            self.pulled += 1
            if self.total is not None and self.pulled >= self.total:
                self.exhausted = True  # all indices read: no need to wait for StopIteration
            if key in self.skip:
                continue  # consumed before a resume (iterable replay)
            calls.mark(f"{self.spec.user_calls} on {_named(key, 'a sample')}", key)
            try:
                length, tokens, resources = self.spec.measure(key, sample)
                kept = planner.add(key, length, loss_tokens=tokens, extra=resources)
            except Exception as exc:  # bad input, or the user's length_fn / resources_fn failing
                if not calls.abandoned:
                    self._fail(exc, key)
                break
            finally:
                calls.unmark()
            if calls.abandoned:
                return
            if kept:
                self.payloads[key] = sample
                if length <= planner.grouping.token_budget:  # an IDLE batch must not be an over-budget one
                    self.on_first_sample(sample)

    def _collate_all(self, slots: list) -> list | None:
        """Collate every step of the round on the helper thread; None (and this rank's error set) on failure."""
        try:
            batches, failure = self.calls.run(lambda: self._collate_job(slots))
        except (Stuck, WorkerDied) as exc:
            batches, failure = None, self._bounded_error(exc)
        if failure is not None:
            self._fail(*failure)
            return None
        return batches

    def _collate_job(self, slots: list) -> tuple[list | None, tuple | None]:
        batches = []
        for items in slots:
            keys = [it.key for it in items]
            self.calls.mark(f"collate_fn (samples {[sample_of(k) for k in keys]})" if keys else
                            "collate_fn (an IDLE batch's placeholder)", keys[0] if keys else None)
            try:
                samples = [self.payloads.pop(k) for k in keys] if items else [self.template()]
                batch = self.collate_fn(samples)
                if not isinstance(batch, Mapping):
                    raise TypeError(f"collate_fn returned {type(batch).__name__} for samples "
                                    f"{[sample_of(k) for k in keys]}; evenflow attaches its StepInfo to a mapping "
                                    "batch, so collate_fn must return a dict (e.g. {'input_ids': ..., 'labels': ...})")
                if self.check_batch is not None and items:
                    self.check_batch(batch, items, samples)
            except Exception as exc:  # reported in this round's exchange 2 (or the commit exchange)
                # A default collate's SampleError names the sample by its position in the batch.
                at = exc.position if isinstance(exc, SampleError) and 0 <= exc.position < len(keys) else 0
                return None, (exc, keys[at] if keys else None)
            finally:
                self.calls.unmark()
            if self.calls.abandoned:  # the collation thread gave up on this call and ended the epoch
                return None, None
            batches.append(batch)
        return batches, None

    def _bounded_error(self, exc: Stuck | WorkerDied) -> tuple[BaseException, object]:
        what, key = exc.args
        if isinstance(exc, WorkerDied):
            err = RuntimeError(
                f"evenflow: rank {self._rank()}'s {what} died while the loader waited for "
                f"{_named(key, 'the next sample')}: it was killed (the out-of-memory killer sends SIGKILL; see the "
                "kernel log, e.g. `dmesg`) or it exited. Lower the memory the pipeline needs (num_workers=, "
                "prefetch_factor=, the size of a sample)")
        else:
            err = TimeoutError(
                f"evenflow: rank {self._rank()}'s {what} did not return within "
                f"worker_timeout={self.call_limit.total_seconds():g}s on the collation thread (it blocks, or is "
                "this slow); every rank stops this epoch. Fix the call, or raise worker_timeout= (and timeout= "
                "above it) if it is legitimately this slow")
        return err, key

    def _fetch_error(self, exc: BaseException) -> BaseException:
        return self.describe_fetch_error(exc, self.key_at(self.pulled)) if self.describe_fetch_error else exc

    def _fail(self, exc: BaseException, key: object) -> None:
        """Record this rank's failure; it is reported in the round's next exchange that carries flags."""
        if self.error is not None:
            return
        self.error, self.error_key = exc, key
        index = sample_of(key)
        note = f"evenflow: on rank {self._rank()}" + (f", sample index {index}" if index is not None else "")
        if hasattr(exc, "add_note"):  # Python >= 3.11: the original exception names the rank and sample
            exc.add_note(note)
        else:  # pragma: no cover - Python 3.10
            logger.error("%s: %s: %s", note, type(exc).__name__, exc)

    # -- steps and windows ---------------------------------------------------------------------------------
    def _emit(self, batches: list, slots: list, gathered: np.ndarray, steps_bound: int,
              balanced: BalancedRound | None) -> None:
        first = self.step
        for s, items in enumerate(slots):
            col = gathered[:, s, :]  # [world, (samples, loss tokens, padded, real)]; sums survive balancing
            local, padded, owned = col[self._rank()], col[:, 2], [it.key for it in items]
            if balanced is not None:
                items, padded, owned = balanced.slots[s], balanced.padded[s], balanced.owned[s]
                local = (len(items), sum(it.loss_tokens for it in items), int(padded[self._rank()]),
                         sum(it.length for it in items))
            self.pending.append(dict(step=self.step, items=items, local=local, owned=owned, batch=batches[s],
                                     global_loss=int(col[:, 1].sum()), global_samples=int(col[:, 0].sum()),
                                     global_real=int(col[:, 3].sum()),
                                     max_padded=int(padded.max()), mean_padded=float(padded.mean()),
                                     bound=first + steps_bound if steps_bound >= 0 else -1))
            self.step += 1
            if len(self.pending) == self.k:
                self._release()

    def _rank(self) -> int:
        return self.exchange.topology.rank

    def _release(self) -> None:
        """Hand over a whole accumulation window: its loss denominator is now known on every rank."""
        if not self.pending:
            return
        window_tokens = sum(p["global_loss"] for p in self.pending)
        last = len(self.pending) - 1
        for i, p in enumerate(self.pending):
            items = p["items"]
            local = p["local"]
            keys = [it.key for it in items]
            ids = [k if not self.pair_ids or isinstance(k, tuple) else (self._rank(), k) for k in keys]
            if not self.pair_ids:
                ids = [sample_of(k) if isinstance(k, tuple) else k for k in ids]  # carried: report the index
            info = StepInfo(step=p["step"], epoch=self.epoch, is_idle=not items, local_samples=int(local[0]),
                            global_samples=p["global_samples"], local_loss_tokens=int(local[1]),
                            global_loss_tokens=p["global_loss"],
                            loss_scale=loss_scale(int(local[1]), window_tokens, self.world),
                            padded_tokens=int(local[2]), real_tokens=int(local[3]), sample_ids=ids,
                            global_real_tokens=p["global_real"],
                            world_size=self.world, window_loss_tokens=window_tokens, window_end=i == last,
                            max_padded_tokens=p["max_padded"], mean_padded_tokens=p["mean_padded"],
                            steps_bound=p["bound"])
            if self.prefetch is not None and not self._prefetch(p["batch"], info):
                break
            self.handoff.put(("batch", Release(_attach(p["batch"], info), info, p["owned"])))
        self.pending = []

    def _prefetch(self, batch: object, info: StepInfo) -> bool:
        """The registered per-step callable on ``batch`` (NOTE [ Per-step prefetch ]); False once it failed: its
        exception is queued behind the batches already handed over, and nothing more is released."""
        if self.prefetch_error is not None:
            return False
        try:
            self.prefetch(batch, info)
        except BaseException as exc:  # noqa: BLE001 - shared by the callable's own exchange: every rank is here
            self.prefetch_error = exc
            self.handoff.fail_in_order(exc)
            return False
        return True


def _named(key: object, otherwise: str) -> str:
    return f"sample index {sample_of(key)}" if sample_of(key) is not None else otherwise


def _attach(batch: object, info: StepInfo) -> object:
    if isinstance(batch, MutableMapping):
        batch[STEP_INFO_KEY] = info
        return batch
    if isinstance(batch, Mapping):
        out = dict(batch)
        out[STEP_INFO_KEY] = info
        return out
    raise TypeError(f"collate_fn returned {type(batch).__name__}; evenflow attaches its StepInfo to a mapping batch, "
                    "so collate_fn must return a dict (e.g. {'input_ids': ..., 'labels': ...})")
