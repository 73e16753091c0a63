"""The loader's ``balance=True`` policy: even out the cost of each aligned step across ranks.

After a round every rank holds T slots. For each step, every rank sees the lengths of every rank's slot
(one extra fixed-size exchange), evaluates the same pure plan
([`evenflow.balance.rebalance_step()`][evenflow.balance.rebalance_step]) and moves samples with one all-to-all per
round. Three collectives per round, issued by every rank in every round -- also when nothing moves, and in the round
that stops or ends the epoch (NOTE [ Round sequence ]).

NOTE [ Who owns a moved sample ]
    A sample belongs to the rank whose stream produced it, wherever it is trained. That rank records it as
    consumed when its own trainer passes the step the sample was trained at (ranks are in lockstep), so
    ``state_dict()`` stays per rank and ``load_state_dict()`` is not collective: each rank resumes its own
    stream minus what it owns and was consumed. Example: rank 0's index 42 trained on rank 1 at step 7 is
    committed by rank 0 after step 7. On another number of ranks the union of those remainders is re-dealt
    (NOTE [ Re-dealing a resumed epoch ] in redeal.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..exchange.dispatch import exchange_packed, pack_samples
from ..balance.rebalance import rebalance_step, step_costs
from ..planning.alignment import Item, Slot
from ..planning.grouping import GroupingConfig
from .comm import MetadataExchange
from .transfer import Moves, pack, peek, receive_failure, unpack

__all__ = ["BalancedRound", "StepRebalancer"]


@dataclass(frozen=True)
class BalancedRound:
    slots: list[Slot]
    """This rank's slots after moving samples (items from any rank)."""
    owned: list[list[object]]
    """Per step, the keys this rank *owns* (its original slot): what it commits as consumed."""
    padded: np.ndarray
    """``[T, world]`` cost of every rank's slot after balancing."""
    sources: list[list[int]]
    """Per step, the source rank of each item in ``slots``."""
    failed_ranks: tuple[int, ...] = ()
    """Ranks that could not serialize a sample they had to send: nothing moved, every rank goes to the error
    round (NOTE [ Faults in the round sequence ])."""
    error: BaseException | None = None
    """This rank's serialization error, if it is one of ``failed_ranks``."""
    error_key: object = None
    unshared: tuple[BaseException, object] | None = None
    """This rank could not unpack a sample it received (error, key): the peers do not know yet; the
    collator shares it (NOTE [ Receiving failures are shared ] in global_round.py)."""


class StepRebalancer:
    def __init__(self, exchange: MetadataExchange, grouping: GroupingConfig, payloads: dict, *,
                 pair_keys: bool, moves: Moves | None = None) -> None:
        self.exchange = exchange
        self.moves = moves if moves is not None else Moves()
        """The loader's count of what this rank sent to peers (``loader.moves``)."""
        self.pair_keys = pair_keys
        """Stream positions are only unique per rank: received samples are keyed ``(source rank, position)``."""
        self.grouping = grouping
        self.payloads = payloads
        self.rank = exchange.topology.rank
        self.world = exchange.topology.world_size
        self.extra_names = tuple(grouping.extra_budgets)

    def __call__(self, slots: list[Slot], counts: np.ndarray, target: int) -> BalancedRound:
        """``counts``: the gathered ``[world, width, SLOT_WIDTH]`` slot counts of this round."""
        fields = 1 + len(self.extra_names)
        n_max = int(counts[:, :, 0].max()) if target else 0
        width = counts.shape[1]
        # Exchange 3: every slot's per-sample (length, extras...), zero-padded to the round's largest slot.
        mine = np.zeros((width, max(n_max, 1), fields), dtype=np.int64)
        for s, items in enumerate(slots):
            for j, it in enumerate(items):
                mine[s, j] = [it.length] + [it.extra.get(name, 0) for name in self.extra_names]
        table = self.exchange.all_gather(mine.ravel()).reshape(self.world, width, max(n_max, 1), fields)
        plans = [self._plan_step(table[:, s], counts[:, s, 0]) for s in range(target)]
        # Exchange 4: one all-to-all of the samples that change rank.
        started = time.perf_counter()
        outgoing, dest, error, error_key = self._serialize(plans, slots)
        if any(d != src for plan in plans for d, group in enumerate(plan) for src, _ in group):
            # Something moves this round (every rank knows from the plans): agree that every sender could
            # serialize before entering the all-to-all, so a sample that does not pickle cannot strand peers.
            failed = np.flatnonzero(self.exchange.all_gather(np.array([error is not None], dtype=np.int64))[:, 0])
            if len(failed):
                return BalancedRound([], [], np.zeros((0, self.world), dtype=np.int64), [],
                                     tuple(failed.tolist()), error, error_key)
        received = []
        if self.world > 1:
            chunks = pack_samples(outgoing, dest, self.world)
            self.moves.count(chunks, self.rank, outgoing)
            with self.exchange.guarded("sample all-to-all"):
                received = exchange_packed(chunks, group=self.exchange.topology.group)
        arrived = iter(received)
        # Arrival order is (source rank, position at source); recompute every source's send order from the plans.
        incoming: dict[tuple[int, int, int], Item] = {}
        for src in range(self.world):
            if src == self.rank:
                continue
            for s, plan in enumerate(plans):
                for j_src, j in plan[self.rank]:
                    if j_src == src:
                        packed = next(arrived)
                        try:
                            item, sample = unpack(packed)
                        except Exception as exc:  # noqa: BLE001 - named here, shared by the collator
                            failure = receive_failure(exc, peek(packed).key, src, self.rank, "balance=True",
                                                      "balance=False")
                            return BalancedRound([], [], np.zeros((0, self.world), dtype=np.int64), [],
                                                 unshared=failure)
                        key = (src, item.key) if self.pair_keys else item.key
                        self.payloads[key] = sample
                        incoming[(s, src, j)] = Item(key, item.length, item.loss_tokens, item.extra)
        if received or outgoing:
            self.moves.timed(time.perf_counter() - started)
        new_slots, owned, sources = [], [], []
        padded = np.zeros((target, self.world), dtype=np.int64)
        for s, plan in enumerate(plans):
            new_slots.append([slots[s][j] if src == self.rank else incoming[(s, src, j)] for src, j in plan[self.rank]])
            sources.append([src for src, _ in plan[self.rank]])
            owned.append([it.key for it in slots[s]])
            lengths = [[int(table[src, s, j, 0]) for src, j in group] for group in plan]
            padded[s] = step_costs(lengths, cost=self.grouping.cost,
                                   pad_to_multiple_of=self.grouping.pad_to_multiple_of)
        return BalancedRound(new_slots, owned, padded, sources)

    def _serialize(self, plans: list, slots: list[Slot]) -> tuple[list, list, BaseException | None, object]:
        outgoing, dest = [], []
        for s, plan in enumerate(plans):
            for d, group in enumerate(plan):
                for src, j in group:
                    if src == self.rank and d != self.rank:
                        it = slots[s][j]
                        try:
                            packed = pack(it, self.payloads[it.key])  # NOTE [ Moved samples ] in transfer.py
                        except Exception as exc:  # noqa: BLE001 - a lock, an open file, a lambda...
                            err = TypeError(f"balance=True must send sample {it.key!r} to rank {d} but it cannot "
                                            f"be pickled ({type(exc).__name__}: {exc}); return picklable samples "
                                            "(tensors, numbers, strings) from the dataset, or use balance=False")
                            return [], [], err, it.key
                        del self.payloads[it.key]
                        outgoing.append(packed)
                        dest.append(d)
        return outgoing, dest, None, None

    def _plan_step(self, table: np.ndarray, counts: np.ndarray) -> list[list[tuple[int, int]]]:
        """The same on every rank: ``table[r, j]`` = (length, extras) of rank r's j-th sample at this step."""
        groups = [[(r, j) for j in range(int(counts[r]))] for r in range(self.world)]
        lengths = [[int(table[r, j, 0]) for j in range(int(counts[r]))] for r in range(self.world)]
        cfg = self.grouping
        if max(step_costs(lengths, cost=cfg.cost, pad_to_multiple_of=cfg.pad_to_multiple_of)) > cfg.token_budget:
            return groups  # an oversize="alone" sample: its step stays as aligned
        plan = rebalance_step(groups, lengths, budget=self.grouping.token_budget, cost=self.grouping.cost,
                              pad_to_multiple_of=self.grouping.pad_to_multiple_of)
        if self._within_other_budgets(plan, table):
            return plan
        return groups  # balancing only sees tokens: keep the aligned groups when it would break another budget

    def _within_other_budgets(self, plan: Sequence[Sequence[tuple[int, int]]], table: np.ndarray) -> bool:
        cfg = self.grouping
        for group in plan:
            if cfg.max_samples is not None and len(group) > cfg.max_samples:
                return False
            for f, name in enumerate(self.extra_names, start=1):
                if sum(int(table[r, j, f]) for r, j in group) > cfg.extra_budgets[name]:
                    return False
        return True
