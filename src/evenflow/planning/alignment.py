"""Alignment planner for the Distributed Group Alignment Problem (DGAP). Pure: no torch, no I/O.

Every rank runs the same round, in lockstep:

1. fill its buffer from its own stream until it holds ``buffer_size`` samples or the stream is exhausted;
2. plan local groups ([`evenflow.planning.grouping`][evenflow.planning.grouping]) and publish a
[`RankReport`][RankReport]; 3. all ranks gather the reports and evaluate [`decide_round()`][decide_round] -- the same
pure function on the same
   data, so they agree on the round's target ``T`` without talking again;
4. each rank applies the decision with [`RankPlanner.apply()`][RankPlanner.apply]: it emits exactly ``T`` slots (groups
or
   IDLE) and keeps the rest of its buffer for the next round.

NOTE [ The alignment rule ]
    T = max(1, min(max_r G_r, max_steps_per_round, min_{r active} N_r)), "active" = the rank holds at least
    one buffered sample (N_r > 0). Ranks with fewer groups than T split their costliest groups in halves;
    ranks with more keep T and recycle the rest; a rank with N_r = 0 emits T IDLE slots (join mode only).
    T <= N_r on every active rank, so splitting always finds a group of >= 2 samples and no active rank
    ever emits IDLE. Example, budget 8, T cap 4:

        rank 0 buffer [4, 4, 4, 4, 2, 2]  -> groups [[4,4], [4,4], [2,2]]   G=3, N=6
        rank 1 buffer [8, 1]              -> groups [[8], [1]]               G=2, N=2
        T = max(1, min(3, 4, 2)) = 2
        rank 0 keeps its 2 best groups, recycles the third; rank 1 emits both.

    Unlike the original protocol, no timing enters the decision: a round starts only with a full buffer or
    an exhausted stream, back-pressure (the trainer being behind) is a wait *before* the round, and T is
    capped by a constant instead of free queue slots. Batches are a function of seed, configuration, world
    size and data only.

NOTE [ Bounded waiting ]
    A sample is *old* once it has waited ``max_wait_rounds`` emitting rounds. Kept groups are chosen old
    first, oldest sample first; then by real tokens (fullest first). Every emitting round keeps at least one
    group of every active rank, so while a rank holds an old sample, its oldest sample leaves each round. A
    sample x becomes old after A = max_wait_rounds rounds; at most B - 1 samples (B = buffer_size) are older
    than x and in the buffer, each round removes the oldest, so x is emitted within A + B - 1 rounds of
    arriving ([`wait_bound()`][wait_bound]). Long samples cannot pile up into a sorted tail.

NOTE [ Termination ]
    Join mode ends the epoch when every rank reports an exhausted stream and an empty buffer; quota mode
    ends it when the first rank does, and the others keep what they hold for the next epoch. Each emitting
    round removes at least T >= 1 samples from every active rank, so an epoch of n samples on a rank ends
    within n emitting rounds plus the final (empty) round.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from .grouping import GroupingConfig, check_oversize, padded_length, plan, report_once

__all__ = [
    "PROTOCOL_VERSION",
    "AlignmentConfig",
    "RankReport",
    "RoundDecision",
    "Item",
    "Slot",
    "RankPlanner",
    "decide_round",
    "config_fingerprint",
    "wait_bound",
    "REPORT_WIDTH",
    "SLOT_WIDTH",
    "NO_VALUE",
]

PROTOCOL_VERSION = 1



@dataclass(frozen=True, kw_only=True)
class AlignmentConfig:
    """How ranks agree on each round. Batches never depend on timing."""

    join: bool = True
    """``True``: every sample of the epoch is emitted exactly once; ranks that run dry emit IDLE slots.
    ``False`` (quota): the epoch closes when the first rank runs dry; the rest is carried forward."""
    max_steps_per_round: int = 8
    """Cap on T, the steps one round emits. Larger rounds amortize the exchange and pair groups of similar
    cost across ranks better, but hold more ready batches (up to depth + T - 1)."""
    max_wait_rounds: int = 16
    """Rounds after which a buffered sample is *old*: its group goes before any young one. Not a bound on its own:
    one old group leaves a round, so when many are old at once a sample waits longer -- at most
    [`wait_bound()`][wait_bound] rounds (NOTE [ Bounded waiting ]; global planning: the samples buffered over all ranks
    in
    place of ``buffer_size``). Measured under global planning, chitchat resampled to 32,144 chats, budget 16,384,
    W = 2: one sample waited 107 of the epoch's 114 rounds."""
    buffer_size: int = 4096
    """Samples a rank buffers before a round: more samples give tighter groups, at host-memory cost.
    Measured on chat lengths with CV 2 (4 ranks, budget 16,384): 1,024 -> padded efficiency 0.93 and 1.09x
    the offline oracle's steps; 4,096 -> 0.98 and 1.03x (benchmarks/bench_loader.py)."""
    warmup_budgets: int | None = 32
    """Round r may also start once the buffer holds ``(warmup_budgets + r * max_steps_per_round) * token_budget``
    realized tokens, before it reaches ``buffer_size`` samples: the first batch does not wait for a whole buffer
    to be processed, yet every round still chooses among ~4x more groups than it emits (32 budgets of tokens
    for a round of 8), so early batches are as full as later ones. Counted in tokens, not samples: a sample
    count would starve rounds of short samples (measured: 256 samples of alpaca-like lengths gave 20 % more
    steps). Depends on data and round index only, never on timing. ``None``: always wait for buffer_size."""

    def __post_init__(self) -> None:
        for name in ("max_steps_per_round", "max_wait_rounds", "buffer_size", "warmup_budgets"):
            value = getattr(self, name)
            if value is None and name == "warmup_budgets":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def wait_bound(config: AlignmentConfig) -> int:
    """Most emitting rounds a sample can spend in a buffer (NOTE [ Bounded waiting ])."""
    return config.max_wait_rounds + config.buffer_size - 1


def config_fingerprint(*parts: object) -> int:
    """A 62-bit integer naming a configuration; equal on every rank iff the parts are equal.

    Uses blake2b of the ``repr`` (Python's ``hash`` is salted per process, so it cannot be compared across
    ranks).
    """
    text = repr((PROTOCOL_VERSION,) + tuple(_canonical(p) for p in parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def _canonical(obj: object) -> object:
    if hasattr(obj, "__dataclass_fields__"):
        return (type(obj).__name__,) + tuple((f.name, _canonical(getattr(obj, f.name))) for f in fields(obj))
    if isinstance(obj, Mapping):
        return tuple(sorted((str(k), _canonical(v)) for k, v in obj.items()))
    return obj


REPORT_WIDTH = 15
"""int64 fields of one rank's report: fingerprint, groups, samples, exhausted, unread, stop, error, stop_step,
epoch, data, resume, pid, host, stream, content (see [`RankReport`][RankReport])."""

NO_VALUE = -1
"""``stop_step`` / ``resume`` / ``pid`` / ``host`` when a rank has nothing to report there."""


@dataclass(frozen=True)
class RankReport:
    """What one rank publishes in the first exchange of a round."""

    fingerprint: int
    num_groups: int
    num_samples: int
    exhausted: bool
    """The rank's stream will deliver no more samples this epoch."""
    unread: int
    """Samples still in the rank's stream (not yet buffered), or -1 when unknown (iterable datasets)."""
    stop: bool = False
    error: bool = False
    """The rank failed (loading, measuring, collating, or its trainer via ``close(exc)``): every rank then
    issues one more fixed-size exchange carrying the error's details (NOTE [ Faults in the round sequence ])."""
    stop_step: int = NO_VALUE
    """With ``stop``: the batches this rank's trainer had taken when it stopped (NOTE [ Early stops ])."""
    epoch: int = 0
    data: int = 0
    """Fingerprint of what the rank's shard depends on (``len(dataset)``, stream kind): ranks that disagree
    would train overlapping shards."""
    resume: int = NO_VALUE
    """``2 * step + finished`` of the loaded state this epoch resumed from, or -1 (no state): torn
    checkpoints are refused."""
    pid: int = NO_VALUE
    host: int = NO_VALUE
    """Process id and host fingerprint: survivors of a failed exchange name the ranks that died."""
    stream: int = NO_VALUE
    """Iterable datasets, until the unsplit-stream check ran: how many of its window's samples this rank has
    digested; when every rank's window is complete (or its stream dry), every rank gathers them once (NOTE
    [ Sharding mistakes ] in evenflow.runtime.shard_check). NO_VALUE: no check (map-style, off, done)."""
    content: int = NO_VALUE
    """Map-style datasets: fingerprint of a few items' token content (NOTE [ Sharding mistakes ]), or NO_VALUE
    when this rank could not compare them -- compared only among the ranks that could."""

    def to_array(self) -> np.ndarray:
        return np.array([self.fingerprint, self.num_groups, self.num_samples, int(self.exhausted), self.unread,
                         int(self.stop), int(self.error), self.stop_step, self.epoch, self.data, self.resume,
                         self.pid, self.host, self.stream, self.content], dtype=np.int64)

    @classmethod
    def from_array(cls, row: Sequence[int]) -> RankReport:
        f, g, n, ex, unread, stop, err, *rest = np.asarray(row, dtype=np.int64).tolist()  # plain ints, fast
        return cls(f, g, n, bool(ex), unread, bool(stop), bool(err), *rest)


@dataclass(frozen=True)
class RoundDecision:
    """The outcome of one round, identical on every rank."""

    target: int
    """T: slots every rank emits this round (0 when the round ends the epoch or the run)."""
    epoch_done: bool
    stop: bool
    """Some rank asked to stop (``close()`` or a break): every rank leaves the loop after this round."""
    error_ranks: tuple[int, ...]
    """Ranks that reported an error: every rank raises after this round."""
    steps_bound: int
    """Upper bound on the steps left in the epoch *including* this round's ``target`` (-1 if unknown)."""
    stop_rank: int = NO_VALUE
    """With ``stop``: the stopping rank with the fewest steps taken (lowest rank on ties)."""
    stop_step: int = NO_VALUE
    """With ``stop``: that rank's steps taken; a peer asking for a batch past it raises ``PeerStopped``."""


def _check_agreement(table: np.ndarray, *, config_only: bool = False) -> None:
    """Refuse reports whose configuration, epoch, data or resume state differ across ranks (naming them); a
    map-style dataset's content too (NOTE [ Sharding mistakes ] in evenflow.runtime.shard_check).
    ``config_only``: the configuration alone (a round in which a rank reports an error)."""
    for col, what, fix in _AGREEMENT[:1] if config_only else _AGREEMENT:
        values = table[:, col]
        if (values != values[0]).any():
            by_value = {_show(col, int(v)): np.flatnonzero(values == v).tolist() for v in np.unique(values)}
            raise ValueError(f"ranks disagree on {what} ({'value -> ranks'}: {by_value}); {fix}")
    if config_only:
        return
    content = table[:, _CONTENT_COL]
    known = content[content != NO_VALUE]
    if (known != known[:1]).any():
        col, what, fix = _AGREEMENT[2]
        by_value = {int(v): np.flatnonzero(content == v).tolist() for v in np.unique(known)}
        raise ValueError(f"ranks disagree on {what} ({'value -> ranks'}: {by_value}); {fix}")


def _show(col: int, value: int) -> object:
    if col == _RESUME_COL:
        return "no state" if value < 0 else f"step {value // 2}{' (finished)' if value % 2 else ''}"
    return value


_RESUME_COL = 10
_CONTENT_COL = 14
_AGREEMENT = (
    (0, "the loader configuration (fingerprint)", "every rank must build its loader with the same seed, budgets, "
        "buffer_size, join, balance, grad_accum_steps and world size"),
    (8, "the epoch", "call loader.set_epoch(epoch) with the same epoch on every rank"),
    (9, "the dataset (len(), kind, or the token content of a few items read at the same indices)",
        "every rank must see the same map-style dataset, which the loader shards by index itself. A dataset already "
        "split per rank (datasets.distributed.split_dataset_by_node, Dataset.shard(num_shards=W, index=rank)) would "
        "be split again and train 1/W of the data: pass the whole dataset on every rank. Else check for a partly "
        "written file or a rank-dependent filter; a whole dataset whose __getitem__ changes token ids by rank "
        "(augmentation seeded by rank) looks the same as a split one: pass shard_check=False"),
    (_RESUME_COL, "the resumed state (step counter)", "load every rank's state from the same checkpoint step, or "
        "none of them (a torn or partial checkpoint would repeat or skip samples)"),
)


def decide_round(reports: Sequence[RankReport] | np.ndarray, config: AlignmentConfig) -> RoundDecision:
    """Evaluate NOTE [ The alignment rule ] on the gathered reports. Deterministic and pure.

    ``reports`` is one [`RankReport`][RankReport] per rank, or the gathered ``[world, REPORT_WIDTH]`` int64 array
    itself (what the runtime passes: at 2,560 ranks, building report objects would cost more than deciding).

    >>> r = lambda g, n, ex=False: RankReport(7, g, n, ex, 0)
    >>> decide_round([r(3, 6), r(2, 2)], AlignmentConfig()).target
    2
    >>> decide_round([r(0, 0, True), r(5, 40)], AlignmentConfig()).target  # rank 0 emits 5 IDLE slots
    5
    >>> decide_round([r(0, 0, True), r(5, 40)], AlignmentConfig(join=False)).epoch_done
    True
    """
    if isinstance(reports, np.ndarray):
        table = reports.astype(np.int64, copy=False).reshape(-1, REPORT_WIDTH)
    else:
        table = np.array([r.to_array() for r in reports], dtype=np.int64).reshape(-1, REPORT_WIDTH)
    if not len(table):
        raise ValueError("decide_round needs one report per rank, got none")
    groups, samples, exhausted, unread, stop_flags, errors, stop_steps = table[:, 1:8].T
    # A rank that reports an error may have no epoch, data or state to agree on (a load_state_dict it refused,
    # reported before it exits): its error is the cause, and the error round names it on every rank. The
    # configuration must still agree -- the round's exchanges are sized by it.
    _check_agreement(table, config_only=bool(errors.any()))
    bad = (samples < 0) | (groups < 0) | (groups > samples) | ((samples > 0) & (groups == 0))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"rank {i} sent inconsistent metadata: {int(groups[i])} groups for {int(samples[i])} "
                         "samples; ranks may be running different evenflow versions")
    error_ranks = tuple(np.flatnonzero(errors).tolist())
    stop = bool(stop_flags.any())
    dry = (exhausted != 0) & (samples == 0)
    epoch_done = bool(dry.all() if config.join else dry.any())
    if error_ranks or stop or epoch_done:
        stop_rank = stop_step = NO_VALUE
        if stop:
            stoppers = np.flatnonzero(stop_flags)
            stop_rank = int(stoppers[np.argmin(stop_steps[stoppers])])
            stop_step = int(stop_steps[stop_rank])
        return RoundDecision(0, epoch_done, stop, error_ranks, 0 if epoch_done else -1, stop_rank, stop_step)
    active = samples[samples > 0]
    if not len(active):
        # A round starts only with a full buffer or an exhausted stream, so an empty buffer means exhausted.
        raise ValueError(f"every rank reported an empty buffer but ranks {np.flatnonzero(~dry).tolist()} "
                         "did not report an exhausted stream; a round must start with a full buffer or an "
                         "exhausted stream -- ranks may be running different evenflow versions")
    target = max(1, min(int(groups.max()), config.max_steps_per_round, int(active.min())))
    # Every step has >= 1 sample from each active rank, so no rank holds more steps than samples.
    bound = -1 if (unread < 0).any() else int((samples + unread).max())
    return RoundDecision(target, False, False, error_ranks, bound)


@dataclass
class Item:
    """One buffered sample, as the planner sees it (metadata only; the runtime keeps the payload)."""

    key: object
    """Dataset index, stream position, or any hashable id -- reported back in the emitted slots."""
    length: int
    loss_tokens: int = 0
    extra: Mapping[str, int] = field(default_factory=dict)
    seq: int = -1
    """Arrival order on this rank (set by [`RankPlanner.add()`][RankPlanner.add]): lower is older."""
    arrived: int = -1
    """Emitting round at which the sample entered the buffer."""


Slot = list  # list[Item]; an empty list is an IDLE slot.

SLOT_WIDTH = 4
"""int64 fields per slot in the second exchange: samples, loss tokens, padded tokens, real tokens."""


class RankPlanner:
    """The per-rank half of the protocol: a buffer of [`Item`][Item] and the round logic over it.

    The runtime, the model checker and the simulator all drive this same class.
    """

    def __init__(self, grouping: GroupingConfig, alignment: AlignmentConfig, *, seed: int = 0) -> None:
        self.grouping = grouping
        self.alignment = alignment
        self.seed = seed
        self.buffer: list[Item] = []
        # Columns of the buffer, kept in step with it: rounds read them as arrays (thousands of samples).
        self._lengths: list[int] = []
        self._seqs: list[int] = []
        self._arrivals: list[int] = []
        self._tokens = 0  # sum of buffered lengths
        self.rounds = 0
        """Emitting rounds so far (the ageing clock; also seeds the in-round emission order)."""
        self._next_seq = 0
        self.dropped: list[object] = []
        """Keys removed under ``oversize="drop"``."""
        self.alone: list[object] = []
        """Keys that got their own over-budget group under ``oversize="alone"``."""

    # -- buffer --------------------------------------------------------------------------------------------
    def add(self, key: object, length: int, *, loss_tokens: int = 0,
            extra: Mapping[str, int] | None = None) -> bool:
        """Buffer one sample. Returns False if it was dropped (``oversize="drop"``); raises under ``"error"``."""
        extra = dict(extra or {})
        message = check_oversize(length, extra, self.grouping, key)
        if message is not None:
            if self.grouping.oversize == "error":
                raise ValueError(message)
            if self.grouping.oversize == "drop":
                self.dropped.append(key)
                reason = message.split(";")[0]
                report_once(f"evenflow dropped 1 over-budget sample(s) [{key!r}] (oversize='drop'): {reason}",
                            stacklevel=2)
                return False
            self.alone.append(key)
        self.buffer.append(Item(key, int(length), int(loss_tokens), extra, self._next_seq, self.rounds))
        self._lengths.append(int(length))
        self._tokens += int(length)
        self._seqs.append(self._next_seq)
        self._arrivals.append(self.rounds)
        self._next_seq += 1
        return True

    @property
    def full(self) -> bool:
        """The buffer holds enough to enter the next round: ``buffer_size`` samples, or enough tokens during
        warm-up (see ``AlignmentConfig.warmup_budgets``)."""
        return self.enough(len(self.buffer), self._tokens)

    def enough(self, samples: int, tokens: int) -> bool:
        """Would a buffer of ``samples`` holding ``tokens`` enter this planner's next round? (The fill rule.)"""
        if samples >= self.alignment.buffer_size:
            return True
        warmup = self.alignment.warmup_budgets
        if warmup is None:
            return False
        budgets = warmup + self.rounds * self.alignment.max_steps_per_round
        return tokens >= budgets * self.grouping.token_budget

    # -- round ---------------------------------------------------------------------------------------------
    def plan_local(self) -> list[list[int]]:
        """Groups over the current buffer, as positions into ``self.buffer``."""
        if not self.buffer:
            return []
        extra = {name: [it.extra.get(name, 0) for it in self.buffer] for name in self.grouping.extra_budgets}
        return plan(np.array(self._lengths, dtype=np.int64), self.grouping, extra=extra).groups

    def report(self, fingerprint: int, *, exhausted: bool, unread: int, stop: bool = False,
               error: bool = False, groups: list[list[int]] | None = None, stop_step: int = NO_VALUE) -> RankReport:
        groups = self.plan_local() if groups is None else groups
        return RankReport(fingerprint, len(groups), len(self.buffer), exhausted, unread, stop, error, stop_step)

    def apply(self, decision: RoundDecision, groups: list[list[int]] | None = None) -> list[Slot]:
        """Emit ``decision.target`` slots and keep the rest buffered. ``groups`` is what `report()` used."""
        target = decision.target
        if target == 0:
            return []
        if not self.buffer:
            self.rounds += 1
            return [[] for _ in range(target)]
        groups = self.plan_local() if groups is None else [list(g) for g in groups]
        if len(groups) > target:
            groups = self._select(groups, target)
        while len(groups) < target:
            groups = self._split_costliest(groups)
        slots = [[self.buffer[i] for i in g] for g in groups]
        self._remove({i for g in groups for i in g})
        slots = self._emission_order(slots)
        self.rounds += 1
        return slots

    def take(self, positions: Sequence[int]) -> list[Item]:
        """Remove the samples at ``positions`` from the buffer and count one emitting round (the ageing clock):
        what [`apply()`][apply] does once a round's slots are chosen, for plans made over several ranks' buffers
        (``planning="global"``, evenflow.planning.pooled.plan). Returns the removed items in that order."""
        taken = [self.buffer[int(i)] for i in positions]
        self._remove({int(i) for i in positions})
        self.rounds += 1
        return taken

    def _remove(self, chosen: set[int]) -> None:
        """Drop buffer positions ``chosen``, keeping the per-item columns aligned with the buffer."""
        keep = [i for i in range(len(self.buffer)) if i not in chosen]
        self.buffer = [self.buffer[i] for i in keep]
        self._lengths = [self._lengths[i] for i in keep]
        self._tokens = sum(self._lengths)
        self._seqs = [self._seqs[i] for i in keep]
        self._arrivals = [self._arrivals[i] for i in keep]

    def _cost(self, items: Sequence[Item]) -> int:
        # The shape the default collate builds: padded rows, or one row padded once (FlatCollate): rounding
        # each sample up would overstate summed cost (lengths 3 x 170 + 2 under multiple 8: 520, not 512).
        lengths = np.array([it.length for it in items], dtype=np.int64)
        if self.grouping.cost == "padded":
            return int(len(lengths) * padded_length(lengths, self.grouping.pad_to_multiple_of).max())
        return int(padded_length(lengths.sum(keepdims=True), self.grouping.pad_to_multiple_of)[0])

    def _select(self, groups: list[list[int]], target: int) -> list[list[int]]:
        # Vectorized over the buffer (this runs every round on thousands of samples). Sort key per group:
        # old groups first, by their oldest sample; then the rest by real tokens (fullest first), then age.
        seq = np.array(self._seqs, dtype=np.int64)
        old = self.rounds - np.array(self._arrivals, dtype=np.int64) >= self.alignment.max_wait_rounds
        length = np.array(self._lengths, dtype=np.int64)
        flat = np.fromiter((i for g in groups for i in g), np.int64)
        starts = np.cumsum([0] + [len(g) for g in groups[:-1]])
        oldest = np.minimum.reduceat(seq[flat], starts)
        is_old = np.maximum.reduceat(old[flat], starts)
        real = np.add.reduceat(length[flat], starts)
        # np.lexsort sorts by the last key first: (not old, oldest-if-old, -real-if-not-old, oldest).
        order = np.lexsort((oldest, np.where(is_old, 0, -real), np.where(is_old, oldest, 0), ~is_old))
        return [groups[int(k)] for k in order[:target]]

    def _split_costliest(self, groups: list[list[int]]) -> list[list[int]]:
        # Halve (not peel) the costliest splittable group: contiguous halves of its length-sorted members.
        candidates = [k for k, g in enumerate(groups) if len(g) >= 2]
        if not candidates:  # pragma: no cover - guarded by T <= N_r (NOTE [ The alignment rule ])
            raise AssertionError("alignment asked for more groups than buffered samples")
        costs = [(self._cost([self.buffer[i] for i in groups[k]]), -k) for k in candidates]
        k = candidates[costs.index(max(costs))]
        members = sorted(groups[k], key=lambda i: (self.buffer[i].length, self.buffer[i].seq))
        half = len(members) // 2
        return groups[:k] + [members[half:], members[:half]] + groups[k + 1:]

    def _emission_order(self, slots: list[Slot]) -> list[Slot]:
        # Costliest first on every rank, so step k of a round pairs groups of similar cost across ranks; then
        # one permutation shared by all ranks (seeded by seed and round), so lengths still mix across steps.
        slots.sort(key=lambda s: (-self._cost(s), min(it.seq for it in s)))
        perm = np.random.default_rng([self.seed, self.rounds, len(slots)]).permutation(len(slots))
        return [slots[int(p)] for p in perm]

    def slot_counts(self, slots: Sequence[Slot], width: int) -> np.ndarray:
        """The second exchange's payload: ``[width, SLOT_WIDTH]`` int64, zero rows past ``len(slots)``."""
        out = np.zeros((width, SLOT_WIDTH), dtype=np.int64)
        for s, items in enumerate(slots):
            if items:
                out[s] = (len(items), sum(it.loss_tokens for it in items), self._cost(items),
                          sum(it.length for it in items))
        return out
