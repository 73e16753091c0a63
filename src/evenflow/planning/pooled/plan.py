"""Global round plan: groups over the union of every rank's buffer, equal-cost steps, least data moved. Pure.

Signature (what the runtime's global round calls on every rank, on the same gathered metadata)::

    plan_global_round(lengths, sources, num_ranks, *, config: GlobalPlanConfig, age=None, extra=None,
                      item_bytes=None, final=False, num_steps=None, progress=None) -> GlobalRoundPlan

* ``lengths[i]`` -- token count of buffered item i (the union of all ranks' buffers, in any fixed order;
  rank-major, arrival order within a rank is what the runtime uses);
* ``sources[i]`` -- the rank holding item i now; ``age[i]`` -- emitting rounds it has waited (default 0);
* ``extra[name][i]`` -- per-item resources for ``config.grouping.extra_budgets`` and for time-cost phases;
* ``item_bytes[i]`` -- bytes moved if item i changes rank (default: its length);
* ``final`` -- no rank will buffer another sample this epoch (join-mode drain): plan the rest evenly;
* ``num_steps`` -- T fixed by the caller (``None``: chosen from the buffer); the plan has exactly T steps;
* ``progress`` -- what the epoch emitted before ([`EpochProgress`][evenflow.planning.pooled.mix.EpochProgress]: the
  round index and the samples and tokens so far; every rank advances it the same way after each plan).

``GlobalRoundPlan``: ``num_steps`` = T; ``step[i]``, ``dest[i]`` = step and rank that train item i, both
``-1`` when the item stays buffered at ``sources[i]`` for a later round; ``slot_cost[t, r]`` = the planner's
time cost of rank r's batch at step t (0 = IDLE); ``slots()`` = ``[T][W]`` lists of item ids.

How a round is planned (every step is a function of the input only, ties broken by index):

1. **Groups** over the union under the token budget(s) ([`evenflow.planning.grouping`][evenflow.planning.grouping]'s
rule: sort by
   padded length, take the longest feasible run from the top -- the optimal contiguous partition). Equal
   padded lengths are ordered by source rank, so groups of equal-length items come from one rank when they
   can (free locality: the cost does not change).
2. **Balanced, mixed steps, sampled from the buffer** (``mix="stratified"``, the default;
   `evenflow.planning.pooled.mix`). ``T = min(max_steps, G // W)`` steps (at least 1; more, up to
   ``n // W``, while old groups wait). The groups are sorted by time cost
   ([`TimeCost`][evenflow.planning.timecost.TimeCost], token-counting by default) and cut into cost bands of whole
   steps, inside which any groups may share a step (costs within ``mix_tolerance``); each band is dealt by
   length strata, so a step mixes short and long groups (NOTE [ Stratified steps ]). From these candidate steps
   the round emits a systematic sample by mean sample length, the oldest item's step included once it waited
   ``max_wait_rounds`` (NOTE [ A round emits a sample of the buffer ]); the partial group at the short end and
   ``G mod W`` others stay buffered and regroup with the next arrivals. NOTE [ Drain sized from the remaining
   work ] covers ``final``; ``num_steps`` fixes T from outside (the runtime's alignment between planning groups,
   [`round_target()`][round_target]), and with fewer than ``T * W`` groups the costliest are split until every slot has
   work. ``mix="cost_order"`` is the older cost-ordered planner: blocks of W cost neighbours, the fullest chosen first
   (NOTE [ Choosing whole steps ]) -- steps as homogeneous in length as their costs, in a curriculum order.
   Padding-free packs (summed cost and a ``"summed"`` time cost): the chosen groups' samples are dealt again into
   the round's packs, mixed and balanced on time (NOTE [ Packed steps balanced on time ], packs.py).
3. **Step order**: by length key, ascending in even rounds and descending in odd ones; shortest-longest
   alternating with ``grad_accum_steps`` > 1 (NOTE [ Round order ]); ``cost_order``: costliest step first.
4. **Least movement.** Within a step the W groups are interchangeable: each goes to a rank by a
   maximum-weight matching on bytes already there (same node first, then same rank) -- exact
   (``scipy.optimize.linear_sum_assignment``) up to ``EXACT_MATCH_MAX_RANKS`` ranks; beyond, a sparse greedy
   matching that keeps at least half of the optimum's bytes (tests compare both with the exact one).

NOTE [ Keep-home tolerance ]
    Groups over the union mix ranks: with W ranks about (W-1)/W of the samples move. With
    ``keep_home_tolerance = tol``, padded lengths are put in bands of relative width tol and every sample
    plans as the longest of its band; inside a band samples sort by source rank, so consecutive runs -- the
    groups -- tend to come from one rank. A group's real cost is at most its planned cost (the real longest
    is at most the band's longest), so budgets hold; the price is up to tol of padded efficiency. Example,
    tol = 0.05: lengths 980 (rank 1), 990 (rank 0), 1000 (rank 1), 1010 (rank 0) share the band [972, 1021)
    and plan as 1010 each; by rank: [990, 1010 | 980, 1000] -- a budget of 2020 gives one group per rank,
    nothing moves (exact lengths pair 1000 with 1010 and 980 with 990: every group mixes ranks).

NOTE [ Drain sized from the remaining work ]
    With ``final=True`` and everything fitting in one round (``G <= max_steps * W``), the round emits
    ``T = ceil(G / W)`` steps -- as few as the oracle needs for the same items -- and re-plans the items
    into ``T * W`` groups under the smallest budget that still fits in ``T`` steps (binary search; the
    optimal group count only falls as the budget grows), then halves the costliest groups until every slot
    has work. Example, W = 4, budget 16: remaining items plan into 5 full groups -> T = 2 steps; a budget of
    ~10 gives 8 groups of ~10 tokens instead of 5 full groups and 3 IDLE ranks (2 of 8 slots near-empty).
    Quota mode (``join=False``) never drains into IDLE slots: with fewer than ``T * W`` items left it emits
    ``floor(n / W)`` whole steps and the rest carries into the next epoch, as NOTE [ The alignment rule ] has a
    rank with samples never emit IDLE.

>>> cfg = GlobalPlanConfig(grouping=GroupingConfig(token_budget=8), max_steps=2)
>>> p = plan_global_round([4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2], [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1], 2, config=cfg)
>>> p.num_steps, p.slots()  # the 4s and the 2s cost the same (8): every step mixes one of each
(2, [[[0, 1], [6, 7, 10, 11]], [[2, 3], [4, 5, 8, 9]]])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

# Step 1 and the drain live in groups.py, steps 3 and 4 in place.py, step 2 in mix.py; the entry point here.
from .groups import _drain_groups, _group_table, _split_to, _Table, global_groups
from .mix import EpochProgress, band_steps, length_keys, round_order, select_steps, systematic
from .lpt import balance_steps, drain_packs, pack_sums
from .packs import deal_round
from .place import _deal, _place
from ..grouping import GroupingConfig, padded_length
from ..timecost import TOKENS, TimeCost

__all__ = ["GlobalPlanConfig", "GlobalRoundPlan", "plan_global_round", "global_groups", "round_target", "EpochProgress"]

EXACT_MATCH_MAX_RANKS = 256
"""Up to this many ranks each step's placement is an exact assignment on a dense ``[W, W]`` score (measured:
0.03 ms per step at 64 ranks, 1.7 ms at 256); beyond, the sparse greedy matching (a dense score would be
6.5 M entries per step at 2,560 ranks)."""


@dataclass(frozen=True, kw_only=True)
class GlobalPlanConfig:
    """How a global round is planned. Frozen: part of the loader's configuration and fingerprint."""

    grouping: GroupingConfig
    """The token budget(s): hard constraints on every group (padded or summed cost)."""
    max_steps: int = 8
    """Most steps one round emits (the local protocol's ``max_steps_per_round``)."""
    max_wait_rounds: int = 16
    """An item that waited this many rounds is *old*: groups holding one go first (bounded waiting)."""
    time_cost: TimeCost = field(default_factory=TimeCost)
    """What a step balances, the budgets staying hard limits (default: tokens). Padded groups: which groups share a
    step (sorted by it); summed, with a ``"summed"`` layout: each pack's time, the sum of its sequences' (NOTE
    [ Packed steps balanced on time ]). Fixed before the epoch; the loader's is
    [`default_time_cost()`][evenflow.planning.timecost.default_time_cost] unless ``time_cost=`` is given."""
    ranks_per_node: int | None = None
    """Consecutive ranks per node for node-aware placement; ``None``: one node."""
    keep_home_tolerance: float | None = None
    """Padded cost ``(1 + tol)`` this may spend to keep samples home (NOTE [ Keep-home tolerance ]); ``None``:
    only exact ties are grouped by source (free). Off by default: it trades padded efficiency for bytes."""
    mix: Literal["stratified", "cost_order"] = "stratified"
    """How steps are composed and chosen. ``"stratified"``: each step mixes lengths within a cost band and a
    round emits a systematic sample of the buffer (`evenflow.planning.pooled.mix`). ``"cost_order"``: the
    older cost-ordered planner -- W cost neighbours per step, the fullest steps first, costliest first; steps as
    length-homogeneous as they come and ordered like a curriculum (kept as a benchmark baseline)."""
    mix_tolerance: float = 0.02
    """Groups whose time costs differ by at most this fraction share a band and mix (NOTE [ Stratified steps ]):
    the per-step imbalance it may add. 0 keeps only exact cost ties interchangeable."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step (the loader's ``grad_accum_steps``): how the stratified mix orders a
    round's steps (NOTE [ Round order ])."""
    join: bool = True
    """The loader's ``join``. ``False`` (quota mode): what a round does not emit carries into the next epoch, so
    the drain (``final``) emits at most ``n // W`` steps and never an IDLE slot while the round's items could fill
    it (NOTE [ Drain sized from the remaining work ]); join mode trains everything, IDLE slots included."""

    def __post_init__(self) -> None:
        if self.mix not in ("stratified", "cost_order"):
            raise ValueError(f"mix must be 'stratified' or 'cost_order', got {self.mix!r}")
        if not (isinstance(self.mix_tolerance, (int, float)) and not isinstance(self.mix_tolerance, bool)
                and 0 <= self.mix_tolerance < 1):
            raise ValueError(f"mix_tolerance must be a fraction in [0, 1), got {self.mix_tolerance!r}")
        if self.keep_home_tolerance is not None and not (
                isinstance(self.keep_home_tolerance, (int, float)) and 0 < self.keep_home_tolerance < 1):
            raise ValueError(f"keep_home_tolerance must be a fraction in (0, 1) or None, got "
                             f"{self.keep_home_tolerance!r}")
        if not isinstance(self.grouping, GroupingConfig):
            raise ValueError(f"grouping must be a GroupingConfig, got {type(self.grouping).__name__}")
        for name in ("max_steps", "max_wait_rounds", "grad_accum_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.ranks_per_node is not None and (isinstance(self.ranks_per_node, bool) or not isinstance(
                self.ranks_per_node, (int, np.integer)) or self.ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be an integer >= 1 or None, got {self.ranks_per_node!r}")
        if not isinstance(self.time_cost, TimeCost):
            raise ValueError(f"time_cost must be a TimeCost, got {type(self.time_cost).__name__}")


@dataclass(frozen=True)
class GlobalRoundPlan:
    """One round for all ranks. Arrays are indexed by item (position in the union)."""

    num_steps: int
    step: np.ndarray
    """Step of the round that trains item i, or -1 (stays buffered)."""
    dest: np.ndarray
    """Rank that trains item i, or -1 (stays buffered on its source rank)."""
    slot_cost: np.ndarray
    """``[num_steps, W]`` planner time cost of each batch (0: IDLE)."""

    @property
    def emitted(self) -> np.ndarray:
        return np.flatnonzero(self.step >= 0)

    @property
    def kept(self) -> np.ndarray:
        return np.flatnonzero(self.step < 0)

    def slots(self) -> list[list[list[int]]]:
        """``out[t][r]``: item ids rank r trains at step t (ascending id)."""
        world = self.slot_cost.shape[1]
        emitted = self.emitted
        slot = self.step[emitted] * world + self.dest[emitted]
        order = np.argsort(slot, kind="stable")  # stable: ascending id within a slot
        ids = emitted[order].tolist()
        cuts = np.searchsorted(slot[order], np.arange(self.num_steps * world + 1)).tolist()
        return [[ids[cuts[t * world + r]:cuts[t * world + r + 1]] for r in range(world)]
                for t in range(self.num_steps)]


# -- input checks ----------------------------------------------------------------------------------------------

def _as_int_array(values: Sequence[int] | np.ndarray, n: int | None, what: str, minimum: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (n is not None and arr.shape[0] != n):
        raise ValueError(f"{what} has shape {arr.shape}, expected ({n if n is not None else 'n'},): one per item")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < minimum:
        i = int(np.argmin(arr))
        raise ValueError(f"item {i}: {what} {int(arr[i])} is below {minimum}")
    return arr


def _inputs(lengths, sources, num_ranks, age, extra, item_bytes, config):
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
    ls = _as_int_array(lengths, None, "length", 1)
    n = ls.size
    src = _as_int_array(sources, n, "source rank", 0)
    if n and src.max() >= num_ranks:
        i = int(np.argmax(src))
        raise ValueError(f"item {i}: source rank {int(src[i])} is outside [0, {num_ranks}); pass the rank that "
                         "buffers the item, or the right num_ranks")
    ages = np.zeros(n, dtype=np.int64) if age is None else _as_int_array(age, n, "age", 0)
    needed = set(config.grouping.extra_budgets) | (set(config.time_cost.length_keys) - {TOKENS})
    missing = needed - set(extra or {})
    if missing:
        raise ValueError(f"per-item values for {sorted(missing)} are needed (extra_budgets or time_cost phases) but "
                         "were not given; pass extra={name: values}")
    ext = {k: _as_int_array(v, n, f"extra[{k!r}]", 0) for k, v in (extra or {}).items() if k in needed}
    nbytes = ls.astype(np.float64) if item_bytes is None else np.asarray(item_bytes, dtype=np.float64)
    if nbytes.shape != (n,) or (n and (not np.all(np.isfinite(nbytes)) or nbytes.min() < 0)):
        raise ValueError(f"item_bytes must be {n} finite numbers >= 0, got shape {nbytes.shape}")
    return ls, src, ages, ext, nbytes


# -- 2. which groups go this round -----------------------------------------------------------------------------

def _group_stats(table: _Table, lengths: np.ndarray, ages: np.ndarray, extra: Mapping[str, np.ndarray],
                 time_cost: TimeCost) -> tuple[np.ndarray, ...]:
    """Per group: (oldest age, real tokens, lowest id, time cost, samples, length key), by reduceat over the order
    the slices tile (length key: [`length_keys()`][evenflow.planning.pooled.mix.length_keys])."""
    asc = np.argsort(table.lo, kind="stable")  # the greedy's lo descend: numpy detects the reversal
    starts = table.lo[asc]
    stats = np.empty((4, len(table)), dtype=np.int64)
    stats[:, asc] = (np.maximum.reduceat(ages[table.order], starts),
                     np.add.reduceat(lengths[table.order], starts),
                     np.minimum.reduceat(table.order, starts),
                     np.diff(np.append(starts, table.order.size)))
    times = np.zeros(len(table))
    for phase in time_cost.phases:
        v = (lengths if phase.length_key == TOKENS else extra[phase.length_key])[table.order]
        active = v > 0
        count = np.add.reduceat(active.astype(np.int64), starts)
        if time_cost.layout == "padded":
            work = count * phase(np.maximum.reduceat(v, starts))
        else:
            work = np.add.reduceat(np.where(active, phase(v), 0.0), starts)
        times[asc] += np.where(count > 0, work, 0.0)
    keys = np.empty(len(table))
    keys[asc] = length_keys(lengths, table.order, np.repeat(np.arange(len(table)), np.diff(np.append(
        starts, table.order.size))), len(table))
    return stats[0], stats[1], stats[2], times, stats[3], keys


def _choose(table: _Table, stats: tuple[np.ndarray, ...], steps: int, world: int,
            max_wait: int) -> list[np.ndarray]:
    """The ``steps * world`` groups to emit, as ``steps`` blocks of W groups of similar time cost.

    NOTE [ Choosing whole steps ]
        Picking the best T*W groups one by one and dealing them afterwards mixes costs at block borders
        (measured: one step at 1.9 max/min on chat lengths with attention). Instead the buffer is dealt
        like the global oracle deals an epoch -- all groups sorted by time cost, W consecutive ones per
        block -- and whole blocks are chosen: blocks holding an old item first (oldest first), then the
        fullest in real tokens. ``G mod W`` groups cannot fill a block: the least full non-old ones stay
        out (they regroup with the next arrivals), so every chosen step is as even as the oracle's.
        Bounded waiting: the block holding the oldest old item goes every round, so an item is emitted
        within ``max_wait_rounds + (items buffered over all ranks) - 1`` rounds -- the local protocol's
        argument (NOTE [ Bounded waiting ]) with the union of the buffers in place of one rank's.
    """
    oldest, real, first, times = stats[:4]
    count = steps * world
    if count >= len(table):
        return [table.group(k) for k in range(len(table))]
    is_old = oldest >= max_wait
    spare = len(table) % world
    # the `spare` least full groups, old ones last: they sit out this round
    out_first = np.lexsort((-first, real, is_old))
    rest = np.sort(out_first[spare:])
    by_time = rest[np.lexsort((first[rest], -times[rest]))].reshape(-1, world)
    b_old = oldest[by_time].max(axis=1)
    b_is_old = b_old >= max_wait
    b_real = real[by_time].sum(axis=1)
    b_first = first[by_time].min(axis=1)
    picked = np.lexsort((b_first, np.where(b_is_old, 0, -b_real), -np.where(b_is_old, b_old, 0), ~b_is_old))
    chosen = by_time[np.sort(picked[:steps])].ravel()
    return [table.group(int(k)) for k in chosen.tolist()]


def _packed(config: GlobalPlanConfig) -> int:
    """The token cap of a padding-free pack when steps are balanced on a per-sequence time (NOTE [ Packed steps
    balanced on time ]), else 0: summed cost, a ``"summed"`` time cost, no extra budgets (their sums would need
    their own rooms in the deal; those packs stay best fit's)."""
    g = config.grouping
    if g.cost != "summed" or config.time_cost.layout != "summed" or g.extra_budgets:
        return 0
    return g.token_budget // g.pad_to_multiple_of * g.pad_to_multiple_of if g.pad_to_multiple_of else g.token_budget


def _num_steps(num_groups: int, num_old: int, num_items: int, world: int, config: GlobalPlanConfig,
               final: bool) -> int:
    """Full steps, or more to let old groups go -- but no more than the items can fill (``n // W``: every
    step then trains >= W samples, which the runtime's steps bound relies on)."""
    if final:  # quota mode: the items that cannot fill a whole step carry (NOTE [ Drain sized from ... ])
        steps = min(-(-num_groups // world), config.max_steps)
        return steps if config.join else max(1, min(steps, num_items // world))
    full = max(1, min(config.max_steps, num_groups // world))
    return max(full, min(config.max_steps, -(-num_old // world), num_items // world))


def round_target(groups: Sequence[int], samples: Sequence[int], sizes: Sequence[int], cap: int) -> int:
    """T shared by several planning groups (pass it as ``num_steps`` to each group's plan).

    NOTE [ The alignment rule ] with planning groups in place of ranks, from every group's union groups G_g
    ([`global_groups()`][global_groups]), samples N_g and size k_g:
    ``T = max(1, min(max_g floor(G_g / k_g), cap, min_{g active} floor(N_g / k_g)))`` -- max-based, so no
    group waits for the slowest, and capped by the samples so splitting can fill ``T * k_g`` slots of every
    group that has samples.

    >>> round_target([20, 3], [90, 9], [4, 4], 8)   # group 0 could fill 5 steps, group 1 only 2 (9 samples)
    2
    >>> round_target([2], [3], [4], 8)              # the tail: 1 step, 3 real slots, 1 IDLE
    1
    """
    g, n, k = (np.asarray(v, dtype=np.int64) for v in (groups, samples, sizes))
    active = n > 0
    if not active.any():
        return 1
    return int(max(1, min(int((g // k).max()), cap, int((n[active] // k[active]).min()))))


# -- 2'. stratified: which steps go this round (evenflow.planning.pooled.mix) ---------------------------------

def _open_groups(table: _Table, lengths: np.ndarray, grouping: GroupingConfig) -> np.ndarray:
    """Groups that could still take an item as long as their longest (padded) or their shortest (summed): the
    partial group at the short end of the greedy cut. They fill up if they wait."""
    asc = np.argsort(table.lo, kind="stable")
    starts = table.lo[asc]
    sizes = np.diff(np.append(starts, table.order.size))
    out = np.zeros(len(table), dtype=bool)
    if grouping.cost == "padded":
        top = np.maximum.reduceat(padded_length(lengths, grouping.pad_to_multiple_of)[table.order], starts)
        fits = (sizes + 1) * top <= grouping.token_budget
    else:
        ls = lengths[table.order]
        fits = np.add.reduceat(ls, starts) + np.minimum.reduceat(ls, starts) <= grouping.token_budget
    if grouping.max_samples is not None:
        fits &= sizes < grouping.max_samples
    out[asc] = fits
    return out


def _choose_stratified(table: _Table, stats: tuple[np.ndarray, ...], lengths: np.ndarray, steps: int, world: int,
                       config: GlobalPlanConfig, progress: EpochProgress, final: bool) -> list[np.ndarray]:
    """``steps * W`` groups, step-major (W per step): candidate steps from the cost bands, a systematic sample of
    them (NOTE [ A round emits a sample of the buffer ]). ``final``: nothing arrives any more, so an open group
    would only wait for the drain -- it is a candidate like the others."""
    oldest, real, first, times, sizes, keys = stats
    g = len(table)
    is_old = oldest >= config.max_wait_rounds
    open_ = _open_groups(table, lengths, config.grouping) & ~is_old & (not final)
    candidates = max(steps, min(g // world, (g - int(open_.sum())) // world))
    # Sitting out: open groups first, then a systematic sample by length key of the rest (old ones last), so
    # the ``G mod W`` groups that wait are not always the least full -- those are the long ones (sawtooth).
    rest = np.flatnonzero(~open_)
    rest = rest[np.lexsort((rest, keys[rest], is_old[rest]))]
    young = int((~is_old[rest]).sum())
    spare = g - candidates * world - min(int(open_.sum()), g - candidates * world)
    sit_out = np.concatenate((np.flatnonzero(open_)[:g - candidates * world],
                              rest[systematic(young, spare, progress.round)] if spare <= young else rest[:spare]))
    cand = np.setdiff1d(np.arange(g), sit_out)
    blocks = cand[band_steps(times[cand], keys[cand], world, config.mix_tolerance)]
    chosen = select_steps(np.stack((sizes[blocks].sum(axis=1), real[blocks].sum(axis=1)), axis=1),
                          oldest[blocks].max(axis=1), steps, progress=progress,
                          buffered=(lengths.size, int(lengths.sum())), max_wait=config.max_wait_rounds)
    return [table.group(int(k)) for k in blocks[chosen].ravel()]


SHORTFALL = 0.001
"""A round's mixed deal may place this fraction fewer tokens than best fit's packs hold; beyond, best fit's packs
go (NOTE [ Packed steps balanced on time ]): a round that trains fewer tokens adds steps at the epoch's end."""


def _deal_packed(groups: list[np.ndarray], lengths: np.ndarray, ages: np.ndarray, item_time: np.ndarray, world: int,
                 steps: int, config: GlobalPlanConfig, round_index: int,
                 final: bool) -> tuple[list[np.ndarray], np.ndarray] | None:
    """The chosen packs' items dealt again into mixed, time-balanced steps ([`deal_round()`][deal_round]) in NOTE [
    Round
    order ]; ``None`` when the drain cannot place every item that way (best fit's packs go instead)."""
    items = np.sort(np.concatenate(groups))
    most, cap = config.grouping.max_samples, _packed(config)
    oldest = int(ages[items].max())
    first = (ages == oldest) if oldest >= config.max_wait_rounds else np.zeros(len(lengths), dtype=bool)
    spare = np.setdiff1d(np.arange(len(lengths)), items, assume_unique=True)
    drain = final and len(items) == len(lengths)
    packs, unplaced = deal_round(items, lengths, item_time, first, steps, world, cap, most, spare, drain)
    if unplaced.size and drain:
        return None  # the drain trains everything: best fit's packs, dealt on time
    if int(pack_sums(packs, lengths).sum()) < (1 - SHORTFALL) * int(lengths[items].sum()):
        return None
    held = [k for k, g in enumerate(packs) if len(g)]
    if not held:
        return None
    out = [packs[k] for k in held]
    member = np.concatenate(out)
    step_of_group = np.asarray(held, dtype=np.int64) // world
    keys = length_keys(lengths, member, np.repeat(step_of_group, [len(g) for g in out]), steps)
    position = np.empty(steps, dtype=np.int64)
    position[round_order(keys, round_index, config.grad_accum_steps)] = np.arange(steps)
    slot = position[step_of_group] * world + np.asarray(held, dtype=np.int64) % world
    return balance_steps(out, slot, lengths, item_time, world, steps, cap, most, redeal=False)


def _compose(groups: list[np.ndarray], times: np.ndarray, keys: np.ndarray, lengths: np.ndarray, world: int,
             steps: int, config: GlobalPlanConfig, round_index: int, *, dealt: bool) -> np.ndarray:
    """Slot of each group for the stratified mix: steps (``dealt``: W consecutive groups; otherwise formed here by
    cost bands) in NOTE [ Round order ]. Fewer groups than slots (a drain that could not split): the IDLE
    slots spread over the steps (``_deal``)."""
    if len(groups) < steps * world:
        return _deal(groups, times, world, steps)
    blocks = (np.arange(len(groups)).reshape(-1, world) if dealt
              else band_steps(times, keys, world, config.mix_tolerance))
    member = np.concatenate([groups[k] for k in blocks.ravel()])
    step_of = np.repeat(np.arange(steps), [sum(len(groups[k]) for k in b) for b in blocks])
    step_keys = length_keys(lengths, member, step_of, steps)
    slot = np.empty(len(groups), dtype=np.int64)
    slot[blocks[round_order(step_keys, round_index, config.grad_accum_steps)].ravel()] = np.arange(len(groups))
    return slot


# -- entry point -------------------------------------------------------------------------------------------------

def plan_global_round(lengths: Sequence[int] | np.ndarray, sources: Sequence[int] | np.ndarray, num_ranks: int, *,
                      config: GlobalPlanConfig, age: Sequence[int] | np.ndarray | None = None,
                      extra: Mapping[str, Sequence[int] | np.ndarray] | None = None,
                      item_bytes: Sequence[float] | np.ndarray | None = None, final: bool = False,
                      num_steps: int | None = None, progress: EpochProgress | None = None) -> GlobalRoundPlan:
    """Plan one global round (module docstring). Deterministic: same input, same plan, on every rank.

    Every emitted group is within every budget; every item is emitted at most once (``step``/``dest``) and
    the kept ones are exactly ``kept``; every step has W slots, IDLE only when fewer items than slots remain.
    With ``num_steps`` the plan has exactly that many steps (all IDLE without items). ``progress``: what the
    epoch emitted before this round ([`EpochProgress`][EpochProgress]; only the stratified mix reads it).
    """
    ls, src, ages, ext, nbytes = _inputs(lengths, sources, num_ranks, age, extra, item_bytes, config)
    world, n = int(num_ranks), ls.size
    if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer))
                                  or num_steps < 1):
        raise ValueError(f"num_steps must be an integer >= 1 or None, got {num_steps!r}")
    if n == 0:
        steps = num_steps or 0
        return GlobalRoundPlan(steps, np.empty(0, np.int64), np.empty(0, np.int64), np.zeros((steps, world)))
    stratified = config.mix == "stratified"
    progress = progress or EpochProgress()
    table = _group_table(ls, src, config.grouping, ext, config.keep_home_tolerance)
    stats = _group_stats(table, ls, ages, ext, config.time_cost)
    steps = num_steps or _num_steps(len(table), int((stats[0] >= config.max_wait_rounds).sum()), n, world,
                                    config, final)
    dealt = False
    packed = _packed(config)
    item_time = config.time_cost.item_times({TOKENS: ls, **ext}) if packed else None
    if final and len(table) <= steps * world:
        groups = packed and drain_packs(table.order, ls, item_time, steps * world, packed, config.grouping.max_samples)
        groups = groups or _drain_groups(ls, src, ext, config.grouping, table, steps * world,
                                         config.keep_home_tolerance)
    elif stratified and steps * world < len(table):
        groups = _choose_stratified(table, stats, ls, steps, world, config, progress, final)
        dealt = True
    else:
        groups = _choose(table, stats, steps, world, config.max_wait_rounds)
        groups = _split_to(groups, ls, config.grouping, steps * world)
    steps = num_steps or min(steps, len(groups))  # fewer items than ranks: one step, some IDLE
    packs = _deal_packed(groups, ls, ages, item_time, world, steps, config, progress.round, final) \
        if packed and stratified else None
    if packs is not None:  # NOTE [ Packed steps balanced on time ]
        groups, slot_of_group = packs
        member = np.concatenate(groups)
        group_of = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
        times = np.bincount(group_of, weights=item_time[member], minlength=len(groups))
    else:
        member = np.concatenate(groups)
        group_of = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
        lens = {TOKENS: ls[member], **{k: v[member] for k, v in ext.items()}}
        times = config.time_cost.group_times(lens, group_of, len(groups))
        if stratified:
            keys = length_keys(ls, member, group_of, len(groups))
            slot_of_group = _compose(groups, times, keys, ls, world, steps, config, progress.round, dealt=dealt)
        else:
            slot_of_group = _deal(groups, times, world, steps)
        if packed:
            groups, slot_of_group = balance_steps(groups, slot_of_group, ls, item_time, world, steps, packed,
                                                  config.grouping.max_samples)
            member = np.concatenate(groups)
            group_of = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
            times = np.bincount(group_of, weights=item_time[member], minlength=len(groups))
    slot_of_item = slot_of_group[group_of]
    rank_of_slot = _place(slot_of_item, src[member], nbytes[member], world, steps, config.ranks_per_node or world,
                          exact=world <= EXACT_MATCH_MAX_RANKS)
    step = np.full(n, -1, dtype=np.int64)
    dest = np.full(n, -1, dtype=np.int64)
    step[member] = slot_of_item // world
    dest[member] = rank_of_slot[slot_of_item]
    slot_cost = np.zeros((steps, world))
    slot_cost[slot_of_group // world, rank_of_slot[slot_of_group]] = times
    return GlobalRoundPlan(steps, step, dest, slot_cost)
