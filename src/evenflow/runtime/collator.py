"""The collation stage: one background thread per epoch that buffers, plans, aligns and collates.

Why a thread and not a process: the stage's own work is small (planning a 1,024-sample buffer takes well
under a millisecond, the two exchanges a few milliseconds), collate_fn's tensor copies release the GIL, and
a thread needs no pickling, inherits nothing through fork, and shares the process's gloo group. Workers stay
processes (the user's ``num_workers``) -- they run the expensive pipeline.

NOTE [ Round sequence ]
    Every rank, every round, finished or not, in this order:
        fill buffer -> wait for room (back-pressure, before the round) -> exchange 1 (RankReport)
        -> decide_round -> apply -> exchange 2 (slot counts, fixed width) -> act on the decision.
    A stop request, an error or the end of the epoch is *reported in exchange 1* and acted upon only after
    exchange 2, so no rank ever leaves a peer waiting inside a collective.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..planning.alignment import SLOT_WIDTH, RankPlanner, RankReport, decide_round
from ..planning.loss import LossTokenRule, count_loss_tokens, loss_scale
from .comm import MetadataExchange
from .step_info import STEP_INFO_KEY, StepInfo

if TYPE_CHECKING:  # balancing pulls in evenflow.balance; only balance=True loaders need it
    from .balancing import BalancedRound, StepRebalancer

__all__ = ["Handoff", "SampleSpec", "EpochPipeline", "Release"]

logger = logging.getLogger("evenflow")


class Handoff:
    """Ready batches between the collation thread and the trainer, with back-pressure and a stop flag."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: deque = deque()
        self.stop_requested = False

    def put(self, item: tuple) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def get(self, alive: Callable[[], bool]) -> tuple:
        with self._cond:
            while not self._items:
                if not alive():
                    raise RuntimeError("evenflow: the collation thread exited without a result")
                self._cond.wait(timeout=1.0)
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def wait_for_room(self, depth: int) -> None:
        with self._cond:
            while self._ready() >= depth and not self.stop_requested:
                self._cond.wait()

    def _ready(self) -> int:
        return sum(1 for item in self._items if item[0] == "batch")

    def request_stop(self) -> None:
        with self._cond:
            self.stop_requested = True
            self._cond.notify_all()


@dataclass(frozen=True)
class Release:
    """One batch handed to the trainer."""

    batch: object
    info: StepInfo
    keys: list
    """Keys this rank owns at this step (NOTE [ Who owns a moved sample ]): committed as consumed."""


@dataclass(frozen=True, kw_only=True)
class SampleSpec:
    """How a raw sample is measured and validated (runs on the collation thread, per arriving sample)."""

    length_fn: Callable[[Mapping], int] | None
    resources_fn: Callable[[Mapping], Mapping[str, int]] | None
    resource_names: tuple[str, ...]
    loss_rule: LossTokenRule

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
            resources[name] = int(value)
        return int(length), tokens, resources


def _token_count(key: object, name: str, value: object) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ValueError(f"sample {key}: {name!r} must be 1-D, got shape {tuple(value.shape)}; return one "
                             "unpadded sequence per sample (the loader batches)")
        if value.is_floating_point() or value.is_complex():
            raise ValueError(f"sample {key}: {name!r} has dtype {value.dtype}; token ids must be integers")
        return value.numel()
    if isinstance(value, (list, tuple, np.ndarray)):
        arr = np.asarray(value)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"sample {key}: {name!r} must be a 1-D sequence of ints")
        return int(arr.size)
    raise ValueError(f"sample {key}: {name!r} has type {type(value).__name__}; use a 1-D LongTensor or a list of ints")


def _as_array(value: object) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


class EpochPipeline(threading.Thread):
    """Runs the rounds of one epoch (NOTE [ Round sequence ]) and feeds :class:`Handoff`."""

    def __init__(self, *, planner: RankPlanner, stream: Iterator, total: int | None, skip: frozenset,
                 exchange: MetadataExchange, fingerprint: int, spec: SampleSpec, collate_fn: Callable,
                 handoff: Handoff, epoch: int, depth: int, grad_accum_steps: int, payloads: dict,
                 template: Callable[[], object], on_first_sample: Callable[[object], None],
                 rebalancer: StepRebalancer | None = None) -> None:
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
        self.pulled = 0
        self.exhausted = total == 0
        self.error: BaseException | None = None
        self.step = 0
        self.pending: list = []
        self.world = exchange.topology.world_size
        self.pair_ids = rebalancer is not None and rebalancer.pair_keys
        self.width = planner.alignment.max_steps_per_round

    # -- thread body ---------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._rounds()
        except BaseException as exc:  # exchange failure or a bug: nothing more can be exchanged safely
            self.handoff.put(("error", exc))

    def _rounds(self) -> None:
        while True:
            self._fill()
            self.handoff.wait_for_room(self.depth)
            started = time.perf_counter()
            ok = self.error is None
            groups = self.planner.plan_local() if ok else []
            report = RankReport(self.fingerprint, len(groups), len(self.planner.buffer) if ok else 0,
                                self.exhausted, self._unread(), self.handoff.stop_requested, not ok)
            table = self.exchange.all_gather(report.to_array())
            decision = decide_round(table, self.planner.alignment)
            slots = self.planner.apply(decision, groups) if ok else []
            counts = self.planner.slot_counts(slots, self.width)
            gathered = self.exchange.all_gather(counts.ravel()).reshape(self.world, self.width, SLOT_WIDTH)
            # balance=True: exchanges 3 and 4 (every round; target is 0 on rank-wide stop/error/end rounds).
            balanced = self.rebalancer(slots, gathered, decision.target) if self.rebalancer is not None else None
            logger.debug("evenflow round: epoch %d step %d T=%d reports=%s (%.2f ms)", self.epoch, self.step,
                         decision.target, table[:, 1:4].tolist(),
                         1e3 * (time.perf_counter() - started))
            if self.error is not None:
                self.handoff.put(("error", self.error))
                return
            if decision.error_ranks:
                self.handoff.put(("error", RuntimeError(
                    f"evenflow: rank(s) {list(decision.error_ranks)} failed while loading or collating; their own "
                    "logs carry the original error and traceback")))
                return
            if decision.stop:
                self.handoff.put(("stopped",))
                return
            self._emit(slots, gathered, decision.steps_bound, balanced)
            if decision.epoch_done:
                self._release()
                self.handoff.put(("end",))
                return

    def _unread(self) -> int:
        return -1 if self.total is None else self.total - self.pulled

    def _fill(self) -> None:
        planner = self.planner
        while self.error is None and not planner.full and not self.exhausted:
            try:
                key, sample = next(self.stream)
            except StopIteration:
                self.exhausted = True
                break
            except Exception as exc:  # a worker's exception, re-raised by the DataLoader with its traceback
                self.error = exc
                break
            self.pulled += 1
            if self.total is not None and self.pulled >= self.total:
                self.exhausted = True  # all indices read: no need to wait for StopIteration
            if key in self.skip:
                continue  # consumed before a resume (iterable replay)
            try:
                length, tokens, resources = self.spec.measure(key, sample)
                kept = planner.add(key, length, loss_tokens=tokens, extra=resources)
            except ValueError as exc:
                self.error = exc
                break
            if kept:
                self.payloads[key] = sample
                self.on_first_sample(sample)

    # -- steps and windows ---------------------------------------------------------------------------------
    def _emit(self, slots: list, gathered: np.ndarray, steps_bound: int, balanced: BalancedRound | None) -> None:
        first = self.step
        for s, items in enumerate(slots):
            col = gathered[:, s, :]  # [world, (samples, loss tokens, padded, real)]; sums survive balancing
            local, padded, owned = col[self._rank()], col[:, 2], [it.key for it in items]
            if balanced is not None:
                items, padded, owned = balanced.slots[s], balanced.padded[s], balanced.owned[s]
                local = (len(items), sum(it.loss_tokens for it in items), int(padded[self._rank()]),
                         sum(it.length for it in items))
            self.pending.append(dict(step=self.step, items=items, local=local, owned=owned,
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
            info = StepInfo(step=p["step"], epoch=self.epoch, is_idle=not items, local_samples=int(local[0]),
                            global_samples=p["global_samples"], local_loss_tokens=int(local[1]),
                            global_loss_tokens=p["global_loss"],
                            loss_scale=loss_scale(int(local[1]), window_tokens, self.world),
                            padded_tokens=int(local[2]), real_tokens=int(local[3]), sample_ids=ids,
                            global_real_tokens=p["global_real"],
                            world_size=self.world, window_loss_tokens=window_tokens, window_end=i == last,
                            max_padded_tokens=p["max_padded"], mean_padded_tokens=p["mean_padded"],
                            steps_bound=p["bound"])
            try:
                samples = [self.payloads.pop(k) for k in keys] if items else [self.template()]
                batch = _attach(self.collate_fn(samples), info)
            except Exception as exc:  # reported in the next round's exchange, raised here after it
                self.error = exc
                self.pending = []
                return
            self.handoff.put(("batch", Release(batch, info, p["owned"])))
        self.pending = []


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
