"""The loader's ``planning="global"`` policy: each round is planned over the union of a planning group's buffers.

Per round, after exchange 1 (the rank reports, NOTE [ Round sequence ] in collator.py), instead of each rank
choosing its own groups:

    exchange A (inside the planning group): every buffered sample's (length, age, extras) -- metadata only
    [more than one planning group: exchange B, every group's union groups and samples, to agree on T by
    evenflow.planning.pooled.plan.round_target; one group: the plan chooses T itself]
    every rank evaluates the same pure plan (evenflow.planning.pooled.plan.plan_global_round over the
    group's k ranks, with the group's buffers as the union)
    exchange F (world-wide): one flag per rank -- did planning or pickling fail? (NOTE [ Planning failures
    are shared ]); any flag turns the round into an error round on every rank
    one all-to-all (inside the group) moves the samples that are trained away from home (skipped when none;
    NOTE [ Moved samples ] in transfer.py: their tensors travel as their own bytes)
    exchange 2 (as in every round): the post-plan slot counts, so loss denominators stay exact, and one flag
    per rank -- could it unpack what it received and collate the round? (NOTE [ Receiving failures are
    shared ])

How it relates to ``balance=True``: balancing re-deals the samples of groups every rank already formed
from its own buffer, step by step, so it can only even out what the local groups allow (measured: chitchat,
4 ranks, 1.11 per-step imbalance with balancing). Global planning forms the groups themselves over every
rank's buffer, so each step's groups are the closest-cost ones of the whole group's window -- the offline
oracle restricted to the buffers. It subsumes ``balance=True`` (the two are not combined). Ownership and
resume are the same as balancing's (NOTE [ Who owns a moved sample ] in balancing.py): a sample is
committed by the rank whose stream produced it, at the step it was trained, wherever it was trained.

Every rank of a round that emits (decision.target > 0) issues the same collectives, because the decision
is the same everywhere; a stop/error/end round issues none of them.

What overlaps training: the whole round (exchanges, planning, the all-to-all, collation) runs on the
collation thread while the trainer consumes up to ``depth`` ready batches of earlier rounds, so round r+1
is planned while round r trains. What does not: the first round of an epoch (nothing to train yet), and a
round that needs more time than ``depth`` steps of training take (measured: the pure plan costs ~5 ms at
4 ranks x 4,096 samples and ~40 ms CPU at 64 x 4,096, mostly the union grouping). A failure while planning
round r+1 is raised on every rank after the batches of round r and before any of round r+1 (PeerError on the
peers): every rank yields the same number of batches first (NOTE [ Faults in the round sequence ]).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..exchange.dispatch import exchange_packed, pack_samples
from ..planning.alignment import AlignmentConfig, Item, RankPlanner, RoundDecision, Slot
from ..planning.pooled.plan import EpochProgress, GlobalPlanConfig, global_groups, plan_global_round, round_target
from ..planning.grouping import GroupingConfig
from ..planning.timecost import TimeCost, default_time_cost
from .balancing import BalancedRound
from .comm import MetadataExchange, PlanningGroups
from .transfer import Moves, pack, peek, receive_failure, unpack

__all__ = ["GlobalRound"]

_SAMPLES_COL = 2  # RankReport columns: buffered samples, unread samples
_UNREAD_COL = 4


@dataclass(frozen=True)
class _Union:
    """The buffered samples of one planning group, member-major (``src`` is the rank *within* the group)."""

    src: np.ndarray
    """Member (0..k-1) whose stream produced each sample."""
    pos: np.ndarray
    """Position of each sample in its member's buffer."""
    length: np.ndarray
    wait: np.ndarray
    """Emitting rounds the sample has spent buffered (its age)."""
    extra: dict[str, np.ndarray]

    @classmethod
    def from_rows(cls, rows: np.ndarray, counts: Sequence[int], extra_names: Sequence[str]) -> _Union:
        """``rows[m, j]`` = (length, wait, extras...) of member m's j-th sample; ``counts[m]`` of them are real."""
        src = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        pos = np.arange(len(src), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        flat = rows[src, pos]
        extra = {name: flat[:, 2 + f] for f, name in enumerate(extra_names)}
        return cls(src, pos, flat[:, 0].astype(np.int64), flat[:, 1].astype(np.int64), extra)

    def __len__(self) -> int:
        return len(self.length)


@dataclass(frozen=True)
class _Round:
    slots: list[Slot]
    owned: list[list[object]]
    failed_ranks: tuple[int, ...] = ()
    failure: tuple[BaseException, object] | None = None
    """This rank's own serialization error and the sample's key, when it is one of ``failed_ranks``."""


class GlobalRound:
    """Plans and moves one round's samples for this rank (see the module docstring)."""

    def __init__(self, exchange: MetadataExchange, groups: PlanningGroups, grouping: GroupingConfig,
                 alignment: AlignmentConfig, payloads: dict, *, pair_keys: bool, moves: Moves | None = None,
                 grad_accum_steps: int = 1, time_cost: TimeCost | None = None) -> None:
        self.exchange = exchange
        """World-wide exchange (flat or two-level): exchange B and the fingerprints."""
        self.groups = groups
        self.inner = MetadataExchange(groups.inner, exchange.peers)  # its errors name world ranks
        self.grouping = grouping
        self.alignment = alignment
        self.payloads = payloads
        self.pair_keys = pair_keys
        """Stream positions are only unique per rank: received samples are keyed ``(source rank, position)``."""
        self.world = exchange.topology.world_size
        self.rank = exchange.topology.rank
        self.extra_names = tuple(grouping.extra_budgets)
        self.config = GlobalPlanConfig(grouping=grouping, max_steps=alignment.max_steps_per_round,
                                       max_wait_rounds=alignment.max_wait_rounds, grad_accum_steps=grad_accum_steps,
                                       join=alignment.join,
                                       time_cost=time_cost or default_time_cost(grouping.cost))
        self.moves = moves if moves is not None else Moves()
        """The loader's count of what this rank sent to peers (``loader.moves``)."""
        self.progress = EpochProgress()
        """What this epoch emitted so far in the planning group (the same on every member; NOTE [ A round emits a
        sample of the buffer ]). One GlobalRound per epoch, so it starts at zero, also after a resume."""
        self._last: _Round | None = None

    # -- the collator's hooks ------------------------------------------------------------------------------
    def plan(self, planner: RankPlanner, table: np.ndarray,
             decision: RoundDecision) -> tuple[list[Slot], RoundDecision, tuple[BaseException, object] | None]:
        """This rank's slots for an emitting round, the decision with the round's T and steps bound, and this
        rank's failure to receive a moved sample (error, key), which the collator shares in exchange 2.

        NOTE [ Planning failures are shared ]
            Planning runs on the collation thread, rounds ahead of the trainer (up to ``depth`` batches). If
            planning or serializing round r+1 fails on any rank, that rank still takes part in every exchange
            of the round with neutral values, and one flag exchange before the all-to-all tells every rank:
            all of them turn the round into an error round (the peers raise PeerError naming the rank), so
            nobody waits in a collective until the timeout.
        """
        g = self.groups
        start, k, me = g.starts[g.index], g.inner.world_size, g.inner.rank
        counts = table[start:start + k, _SAMPLES_COL].astype(np.int64)
        rows, failure = self._gather_metadata(planner, int(counts.max()))  # exchange A
        buf, plan, home, outgoing, dest, packing = None, [], {}, [], [], 0.0
        try:
            buf = _Union.from_rows(rows, counts, self.extra_names)
        except Exception as exc:  # noqa: BLE001 - shared below (NOTE [ Planning failures are shared ])
            failure = failure or (exc, None)
        target = self._target(buf)  # exchange B (> 1 group); None: the plan chooses
        if failure is None and buf is not None:
            try:
                plan = self._plan(buf, target, final=self._final(table))
                target = len(plan)
                mine = [int(buf.pos[i]) for step in plan for slot in step for i in slot if buf.src[i] == me]
                home = dict(zip(mine, planner.take(mine)))
                started = time.perf_counter()
                outgoing, dest, failure = self._serialize(buf, plan, home)
                packing = time.perf_counter() - started
            except Exception as exc:  # noqa: BLE001
                failure = (exc, None)
        # Any T >= 1 on a failed round: every rank turns it into an error round below.
        decision = dataclasses.replace(decision, target=target or 1, steps_bound=self._bound(table))
        failed = np.flatnonzero(self.exchange.all_gather(np.array([failure is not None], dtype=np.int64))[:, 0])
        if len(failed):  # every rank learns it here: the round becomes an error round everywhere
            self._last = _Round([], [], tuple(int(r) for r in failed), failure)
            return [], decision, None
        started = time.perf_counter()
        received, late = self._move(buf, plan, outgoing, dest)
        if outgoing:  # this group moved samples
            self.moves.timed(packing + time.perf_counter() - started)
        if late is not None:  # the collator shares it in exchange 2 (NOTE [ Receiving failures are shared ])
            self._last = None
            return [], decision, late
        slots, owned = [], []
        for step in plan:
            slots.append([home[int(buf.pos[i])] if buf.src[i] == me else received[int(i)] for i in step[me]])
            owned.append([home[int(buf.pos[i])].key for slot in step for i in slot if buf.src[i] == me])
        self._last = _Round(slots, owned)
        return slots, decision, None

    def __call__(self, slots: list[Slot], counts: np.ndarray, target: int) -> BalancedRound:
        """The collator's ``rebalancer`` hook, after exchange 2: what each step owns and every rank's cost."""
        if target == 0 or self._last is None:
            return BalancedRound([], [], np.zeros((0, self.world), dtype=np.int64), [])
        last, self._last = self._last, None
        if last.failed_ranks:
            error, key = last.failure if last.failure is not None else (None, None)
            return BalancedRound([], [], np.zeros((0, self.world), dtype=np.int64), [], last.failed_ranks, error, key)
        padded = counts[:, :len(last.slots), 2].T.copy()  # [T, world] from the post-plan slot counts
        return BalancedRound(last.slots, last.owned, padded, [])

    # -- exchanges -----------------------------------------------------------------------------------------
    def _gather_metadata(self, planner: RankPlanner, width: int) -> tuple[np.ndarray, tuple | None]:
        """Exchange A: ``[k, width, 2 + extras]`` (length, age, extras...) of every member's buffer, and this
        rank's failure to write its row (it then sends zeros and shares the failure at the flag exchange)."""
        fields = 2 + len(self.extra_names)
        mine = np.zeros((max(width, 1), fields), dtype=np.int64)
        failure = None
        try:
            for j, it in enumerate(planner.buffer):
                mine[j, 0], mine[j, 1] = it.length, planner.rounds - it.arrived
                for f, name in enumerate(self.extra_names, start=2):
                    mine[j, f] = it.extra.get(name, 0)
        except Exception as exc:  # noqa: BLE001 - e.g. a value past int64 (SampleSpec refuses them first)
            mine[:], failure = 0, (exc, planner.buffer[j].key)
        k = self.groups.inner.world_size
        return self.inner.all_gather(mine.ravel()).reshape(k, max(width, 1), fields), failure

    def _target(self, buf: _Union | None) -> int | None:
        """T agreed between planning groups (exchange B), or ``None`` with one group (the plan chooses T)."""
        g = self.groups
        if len(g.starts) == 1:
            return None
        mine = np.zeros(2, dtype=np.int64)  # (union groups, union samples); zeros when the buffer failed
        try:
            if buf is not None and len(buf):
                mine[:] = len(global_groups(buf.length, buf.src, self.grouping, buf.extra)), len(buf)
        except Exception:  # noqa: BLE001 - the plan below raises it again and shares it
            pass
        table = self.exchange.all_gather(mine)  # world-wide, two-level
        return round_target(table[list(g.starts), 0], table[list(g.starts), 1], _sizes(g.starts, self.world),
                            self.alignment.max_steps_per_round)

    def _plan(self, buf: _Union, target: int | None, *, final: bool) -> list[list[list[int]]]:
        """``out[s][m]``: union indices member m trains at step s (ascending = (member, position)), [] = IDLE.

        One group with an empty union (every buffer drained while the round emits): one IDLE step."""
        k = self.groups.inner.world_size
        p = plan_global_round(buf.length, buf.src, k, config=self.config, age=buf.wait, extra=buf.extra,
                              final=final, num_steps=target if target is not None or len(buf) else 1,
                              progress=self.progress)
        self.progress = self.progress.advance(buf.length, p.emitted)
        return p.slots()

    def _final(self, table: np.ndarray) -> bool:
        """No rank of this planning group will buffer another sample this epoch (known unread counts of 0):
        the plan sizes the drain from the remaining work (NOTE [ Drain sized from the remaining work ])."""
        g = self.groups
        return bool((table[g.starts[g.index]:g.starts[g.index] + g.inner.world_size, _UNREAD_COL] == 0).all())

    def _move(self, buf: _Union, plan: list[list[list[int]]], outgoing: list,
              dest: list) -> tuple[dict[int, Item], tuple[BaseException, object] | None]:
        """One all-to-all inside the planning group (skipped when nothing moves: every member knows from the
        shared plan); returns the received items by union index, and this rank's failure to unpack one.

        NOTE [ Receiving failures are shared ]
            Unpickling a moved sample runs the receiver's code on the sender's bytes (NOTE [ Moved samples ] in
            transfer.py): a class only the sender can import, a ``__reduce__`` that raises, a MemoryError. The
            receiver then names the sample, its sender and the fix, keeps going through the round, and raises
            a flag in exchange 2 (collator.py); every rank turns the round into an error round, so the peers
            raise PeerError naming it in the same round instead of waiting for a collective it never joins.
        """
        me, k = self.groups.inner.rank, self.groups.inner.world_size
        if k == 1 or not any(buf.src[i] != d for step in plan for d, slot in enumerate(step) for i in slot):
            return {}, None
        expected = [int(i) for src in range(k) if src != me  # arrival order: by source, then its send order
                    for step in plan for i in step[me] if buf.src[i] == src]
        with self.exchange.guarded("sample all-to-all"):
            arrived = exchange_packed(outgoing, group=self.groups.inner.group)
        if len(arrived) != len(expected):  # pragma: no cover - every rank evaluates the same plan
            raise RuntimeError(f"evenflow: rank {self.rank} expected {len(expected)} samples from its planning "
                               f"group and received {len(arrived)}; ranks disagree on the round plan")
        received = {}
        for i, packed in zip(expected, arrived):
            src_rank = self.groups.starts[self.groups.index] + int(buf.src[i])
            try:
                item, sample = unpack(packed)
            except Exception as exc:  # noqa: BLE001 - MemoryError included: named, then shared
                return received, receive_failure(exc, peek(packed).key, src_rank, self.rank, "planning='global'",
                                                 "planning='local'")
            key = (src_rank, item.key) if self.pair_keys else item.key
            self.payloads[key] = sample
            received[i] = Item(key, item.length, item.loss_tokens, item.extra)
        return received, None

    def _serialize(self, buf: _Union, plan: list[list[list[int]]], home: dict[int, Item]):
        """Pack what this rank sends, in the receivers' arrival order: (step, destination, slot order); one
        buffer per member of the planning group (NOTE [ Moved samples ] in transfer.py)."""
        me, k = self.groups.inner.rank, self.groups.inner.world_size
        outgoing, dest = [], []
        for step in plan:
            for d, slot in enumerate(step):
                for i in (i for i in slot if buf.src[i] == me and d != me):
                    it = home[int(buf.pos[i])]
                    try:
                        packed = pack(it, self.payloads[it.key])
                    except Exception as exc:  # noqa: BLE001 - a lock, an open file, a lambda...
                        return [], [], (TypeError(
                            f"planning='global' must send sample {it.key!r} from rank {self.rank} to rank "
                            f"{self.groups.starts[self.groups.index] + d} but it cannot be pickled "
                            f"({type(exc).__name__}: {exc}); return picklable samples (tensors, numbers, "
                            "strings) from the dataset, or use planning='local'"), it.key)
                    del self.payloads[it.key]
                    outgoing.append(packed)
                    dest.append(d)
        if not outgoing and not any(buf.src[i] != d for step in plan for d, slot in enumerate(step) for i in slot):
            return [], [], None  # nothing moves in this planning group: no all-to-all
        chunks = pack_samples(outgoing, dest, k)
        self.moves.count(chunks, me, outgoing)
        return chunks, dest, None

    # -- the steps bound -----------------------------------------------------------------------------------
    def _bound(self, table: np.ndarray) -> int:
        """Upper bound on the epoch's remaining steps including this round's (identical on every rank).

        A planning group of k ranks holding n samples in all (buffered + unread) needs at most ceil(n / k)
        steps when every step takes >= min(k, remaining) of them. That holds when a rank that is not exhausted
        always buffers >= k samples (buffer_size >= k and warm-up rounds of >= k budgets, no over-budget
        "alone" samples); otherwise every step takes >= 1 sample and n is the bound.
        """
        unread = table[:, _UNREAD_COL]
        if (unread < 0).any():
            return -1
        left = table[:, _SAMPLES_COL] + unread
        g = self.groups
        sizes = _sizes(g.starts, self.world)
        warm = self.alignment.warmup_budgets
        dense = (self.alignment.buffer_size >= max(sizes) and (warm is None or warm >= max(sizes))
                 and self.grouping.oversize != "alone")
        bound = 0
        for start, k in zip(g.starts, sizes):
            n = int(left[start:start + k].sum())
            bound = max(bound, -(-n // k) if dense else n)
        return bound


def _sizes(starts: Sequence[int], world: int) -> list[int]:
    return [b - a for a, b in zip(starts, tuple(starts[1:]) + (world,))]
