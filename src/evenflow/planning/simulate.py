"""Run the alignment protocol for W ranks in one process: the exact rounds the runtime runs, minus I/O.

The model checker, the property tests, the benchmarks and the cluster simulator use this; the runtime
([`evenflow.runtime.collator`][evenflow.runtime.collator]) drives the same [`RankPlanner`][RankPlanner] with real
exchanges.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .alignment import AlignmentConfig, RankPlanner, RankReport, RoundDecision, Slot, config_fingerprint, decide_round
from .grouping import GroupingConfig

__all__ = ["SampleMeta", "EpochTrace", "run_epoch", "make_planners"]


@dataclass(frozen=True)
class SampleMeta:
    """A sample as a stream yields it: an id, its realized length and optional costs."""

    key: object
    length: int
    loss_tokens: int = 0
    extra: tuple[tuple[str, int], ...] = ()


@dataclass
class EpochTrace:
    """What one epoch did, per step and per rank."""

    steps: list[list[Slot]] = field(default_factory=list)
    """``steps[s][r]``: the slot rank r emitted at step s (empty list = IDLE)."""
    rounds: list[tuple[list[RankReport], RoundDecision]] = field(default_factory=list)
    exchanges: list[list[str]] = field(default_factory=list)
    """Per rank, the sequence of exchanges it issued (must be identical across ranks)."""
    stopped: bool = False

    def keys(self, rank: int | None = None) -> list[object]:
        return [it.key for step in self.steps for r, slot in enumerate(step) if rank in (None, r) for it in slot]


def make_planners(world_size: int, grouping: GroupingConfig, alignment: AlignmentConfig,
                  seed: int = 0) -> list[RankPlanner]:
    return [RankPlanner(grouping, alignment, seed=seed) for _ in range(world_size)]


def run_epoch(planners: Sequence[RankPlanner], streams: Sequence[Iterator[SampleMeta]], *,
              unread: Sequence[int] | None = None, max_rounds: int | None = None,
              stop_at_round: int | None = None) -> EpochTrace:
    """Drive one epoch. ``streams[r]`` is rank r's iterator; ``unread[r]`` its known length (or None).

    Planners keep their buffers, so in quota mode calling this again with new streams carries leftovers.
    ``stop_at_round`` makes rank 0 request a stop at that round (as ``close()`` would).
    """
    world = len(planners)
    alignment = planners[0].alignment
    fp = config_fingerprint(planners[0].grouping, alignment, world)
    remaining = list(unread) if unread is not None else [-1] * world
    exhausted = [False] * world
    trace = EpochTrace(exchanges=[[] for _ in range(world)])
    rounds = 0
    while True:
        if max_rounds is not None and rounds >= max_rounds:
            raise RuntimeError(f"protocol did not terminate within {max_rounds} rounds")
        groups, reports = [], []
        for r, (planner, stream) in enumerate(zip(planners, streams)):
            while not planner.full and not exhausted[r]:
                meta = next(stream, None)
                if meta is None:
                    exhausted[r] = True
                    break
                if remaining[r] > 0:
                    remaining[r] -= 1
                planner.add(meta.key, meta.length, loss_tokens=meta.loss_tokens, extra=dict(meta.extra))
            if unread is not None and remaining[r] == 0:
                exhausted[r] = True  # a sized stream is exhausted once all its samples were read
            g = planner.plan_local()
            groups.append(g)
            stop = stop_at_round is not None and rounds == stop_at_round and r == 0
            reports.append(planner.report(fp, exhausted=exhausted[r], unread=max(remaining[r], 0)
                                          if unread is not None else -1, stop=stop, groups=g))
            trace.exchanges[r].append("report")
        decision = decide_round(reports, alignment)
        trace.rounds.append((reports, decision))
        slots = [planner.apply(decision, g) for planner, g in zip(planners, groups)]
        for r in range(world):
            trace.exchanges[r].append("counts")
        trace.steps.extend([list(step) for step in zip(*slots)] if decision.target else [])
        rounds += 1
        if decision.stop:
            trace.stopped = True
            return trace
        if decision.epoch_done:
            return trace
