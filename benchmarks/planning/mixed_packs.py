"""An experiment, not a library feature: padding-free packs dealt to mix every length (issue 18).

A padding-free pack (``cost="summed"``) costs its token sum whatever it mixes, yet best fit decreasing -- the
library's summed-cost grouping -- makes packs length-homogeneous: the long samples open the packs and the short
ones fill the gaps they leave, so a pack is two 7,000-token chats or 300 greetings. Longest-processing-time
instead -- each sample, longest first, into the pack with the fewest tokens so far -- deals the packs like
cards: every pack holds a slice of every length stratum, and they end within one short sample of each other.

:func:`mixed_packing` swaps that deal into :mod:`evenflow.planning.grouping` for a ``with`` block (keeping best
fit's pack count, else best fit's packs). Measured in ``evenflow.sim`` (global planning, budget 16,384, W = 2 / 4
/ 8): H on chitchat 2.28 / 3.77 / 7.63 -> 0.96 / 1.83 / 3.11, mmmix 6.33 -> 0.06 at W = 2, llava 26.1 -> 8.0 at
W = 8, steps equal or one more, balance as tight, the 64 x 4,096 round plan in 1.15x the time. What it trains
(``quality_replay.py --arms packed packed_sorted packed_shuffled``): no better than best fit's packs on hh-rlhf or
chitchat -- so the library keeps best fit.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from unittest import mock

import numpy as np

EXACT_DEALS = 3
"""Deals placed one sample at a time at the short end, where the packs even out."""


def deal_packs(lengths: np.ndarray, order: np.ndarray, cap: int, count: int) -> list[list[int]] | None:
    """``count`` packs, each sample of ``order`` (longest first) into the lightest; None if one would overflow.

    >>> deal_packs(np.array([6, 5, 4, 3, 1, 1]), np.arange(6), 10, 2)  # best fit: [6, 4] and [5, 3, 1, 1]
    [[0, 3, 4], [1, 2, 5]]
    """
    if count < 1:
        return None
    sizes = lengths[order]
    tokens = np.zeros(count, dtype=np.int64)
    pack_of = np.empty(len(order), dtype=np.int64)
    # A deal at a time while the samples are long: the next count // 2 go to the packs lightest at the deal's
    # start (the heavy half -- a 16,000-token opener -- skips it); the last deals' short samples one at a time.
    width = max(1, count // 2)
    exact = max(0, len(order) - EXACT_DEALS * width)
    for start in range(0, exact, width):
        deal = sizes[start:min(start + width, exact)]
        lightest = np.argsort(tokens, kind="stable")[:deal.size]
        if (tokens[lightest] + deal > cap).any():
            return None
        tokens[lightest] += deal
        pack_of[start:start + deal.size] = lightest
    heap = list(zip(tokens.tolist(), range(count)))
    heapq.heapify(heap)
    for k in range(exact, len(order)):
        total, p = heap[0]
        if total + int(sizes[k]) > cap:
            return None
        pack_of[k] = p
        heapq.heapreplace(heap, (total + int(sizes[k]), p))
    by_pack = np.argsort(pack_of, kind="stable")
    bounds = np.searchsorted(pack_of[by_pack], np.arange(count + 1))
    if (bounds[1:] == bounds[:-1]).any():  # a pack left empty: fewer samples than packs
        return None
    return [order[by_pack[lo:hi]].tolist() for lo, hi in zip(bounds[:-1], bounds[1:])]


@contextmanager
def mixed_packing() -> Iterator[None]:
    """Within the block, summed-cost grouping deals best fit's pack count mixed (where it fits)."""
    from evenflow.planning import grouping

    best_fit = grouping._plan_summed

    def plan_summed(lengths, idx, extra, config):
        groups = best_fit(lengths, idx, extra, config)
        if config.extra_budgets or config.max_samples is not None or not groups:
            return groups
        cap = config.token_budget
        if config.pad_to_multiple_of:
            cap = (cap // config.pad_to_multiple_of) * config.pad_to_multiple_of
        order = idx[np.argsort(-lengths[idx], kind="stable")]
        return deal_packs(lengths, order, cap, len(groups)) or groups

    with mock.patch.object(grouping, "_plan_summed", plan_summed):
        yield


def main() -> None:
    """Best fit's packs against dealt ones, global planning over the composition benchmark's data sets."""
    import json
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.*, <group>.*
    from planning import bench_composition as bc  # noqa: E402

    from evenflow.planning import GroupingConfig
    from evenflow.planning.pooled import GlobalPlanConfig, plan_global_round
    from evenflow.sim import global_schedule
    from evenflow.sim.composition import step_composition

    grouping = GroupingConfig(token_budget=bc.BUDGET, cost="summed", oversize="alone")
    out: dict = {}
    for name, ls in bc.datasets(False).items():
        for world in bc.WORLDS:
            row = out.setdefault(name, {})[str(world)] = {}
            for arm in ("best_fit", "dealt"):
                with mixed_packing() if arm == "dealt" else nullcontext():
                    s = global_schedule(ls, world_size=world, grouping=grouping)
                tokens = np.zeros((s.num_steps, world))
                np.add.at(tokens, (s.step, s.rank), ls[s.sample])
                comp = step_composition(s, ls)
                row[arm] = {"steps": int(s.num_steps), "H": round(float(comp["H"]), 2),
                            "q_cv": round(float(comp["q_cv"]), 3), "late": round(float(comp["late"]), 2),
                            "imbalance": round(float((tokens.max(1) / np.maximum(tokens.mean(1), 1)).mean()), 3)}
            print(f"{name:12s} W={world}  best fit {row['best_fit']}  dealt {row['dealt']}", flush=True)
    rng = np.random.default_rng(0)  # plan latency at 64 ranks x 4,096, ABBA
    world, n = 64, 64 * 4096
    ls = np.clip(rng.lognormal(5.6, 1.0, n).astype(np.int64) + 8, 8, 8192)
    src = np.repeat(np.arange(world), 4096)
    config = GlobalPlanConfig(grouping=GroupingConfig(token_budget=bc.BUDGET, cost="summed"))
    times: dict = {"best_fit": [], "dealt": []}
    for arm in ["best_fit", "dealt", "dealt", "best_fit"] * 3:
        t0 = time.perf_counter()
        with mixed_packing() if arm == "dealt" else nullcontext():
            plan_global_round(ls, src, world, config=config)
        times[arm].append(time.perf_counter() - t0)
    ratio = float(np.median(times["dealt"]) / np.median(times["best_fit"]))
    best, dealt = (float(np.median(times[k])) for k in ("best_fit", "dealt"))
    print(f"round plan 64 x 4,096: best fit {best:.2f} s, dealt {dealt:.2f} s")
    print(json.dumps({"benchmark": "mixed_packs", "latency_ratio": round(ratio, 3), "rows": out}))


if __name__ == "__main__":
    main()
