"""Latency of evenflow's metadata exchange over gloo on loopback, 2 to 16 processes, and what it implies at 2,560.

Each protocol round issues two ``all_gather`` s of small int64 rows over the loader's gloo group: the rank
report (``REPORT_WIDTH`` = 7 values) and the slot counts (``T x SLOT_WIDTH`` = 4 x 4 values). We time both,
back to back, as :class:`evenflow.runtime.comm.MetadataExchange` issues them (list ``all_gather``), plus a
two-level (hierarchical) exchange on 16 processes: gather inside "nodes" of 4, gather among the node
leaders, broadcast inside the node.

Gloo's all_gather is a ring: W - 1 hops, so latency grows linearly with W. We extrapolate to 2,560 ranks
with three per-hop costs: a linear fit over 2-16 processes, the cost measured at 2 processes, and an assumed
datacenter 30 us. Caveat: on this machine 16 processes share 2 cores, so every hop includes a context switch;
per-hop costs measured here are upper bounds for a real cluster's ~10-50 us.

``--global-round`` measures instead the exchanges of one ``planning="global"`` round with the loader's own
classes (evenflow.runtime.comm: flat, or two-level with planning groups), on 2-16 processes, derives the
per-hop cost from the 2-4 process runs and models the round to 2,560 ranks.

Run: ``python benchmarks/loader/bench_gloo.py [--quick] [--global-round]``; prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.*, <group>.*
from common.world import run_world  # noqa: E402

REPORT_WIDTH = 7
COUNTS_WIDTH = 4 * 4
TARGET_WORLD = 2560
GPUS_PER_NODE = 8


def _flat(rank: int, world: int, iters: int, warmup: int) -> list[float]:
    import torch
    import torch.distributed as dist

    report = torch.full((REPORT_WIDTH,), rank, dtype=torch.int64)
    counts = torch.full((COUNTS_WIDTH,), rank, dtype=torch.int64)
    out_r = [torch.empty_like(report) for _ in range(world)]
    out_c = [torch.empty_like(counts) for _ in range(world)]
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        dist.all_gather(out_r, report)
        dist.all_gather(out_c, counts)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    assert int(out_r[world - 1][0]) == world - 1
    return times


def _hierarchical(rank: int, world: int, node_size: int, iters: int, warmup: int) -> list[float]:
    import torch
    import torch.distributed as dist

    nodes = world // node_size
    node_groups = [dist.new_group(list(range(n * node_size, (n + 1) * node_size)), backend="gloo")
                   for n in range(nodes)]
    leaders = dist.new_group([n * node_size for n in range(nodes)], backend="gloo")
    node, local = divmod(rank, node_size)
    group = node_groups[node]
    row = torch.full((REPORT_WIDTH + COUNTS_WIDTH,), rank, dtype=torch.int64)
    inner = [torch.empty_like(row) for _ in range(node_size)]
    node_block = torch.empty(node_size * row.numel(), dtype=torch.int64)
    outer = [torch.empty_like(node_block) for _ in range(nodes)]
    everything = torch.empty(world * row.numel(), dtype=torch.int64)
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        dist.all_gather(inner, row, group=group)
        if local == 0:
            torch.cat(inner, out=node_block)
            dist.all_gather(outer, node_block, group=leaders)
            torch.cat(outer, out=everything)
        dist.broadcast(everything, src=node * node_size, group=group)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    assert int(everything[-1]) == world - 1
    return times


def _per_iteration_max(results: list[list[float]]) -> np.ndarray:
    # A round ends for everyone when the slowest rank is done.
    return np.max(np.array(results), axis=0)


def run(quick: bool = False, worlds: tuple[int, ...] = (2, 4, 8, 16)) -> dict:
    iters = 60 if quick else 200
    rows = []
    for w in worlds:
        t0 = time.perf_counter()
        t = _per_iteration_max(run_world(_flat, w, max(40, iters // (1 + w // 8)), 10, timeout=300))
        rows.append({"world": w, "median_ms": float(np.median(t) * 1e3), "p95_ms": float(np.percentile(t, 95) * 1e3),
                     "wall_s": time.perf_counter() - t0})
    hier = None
    if 16 in worlds:
        t = _per_iteration_max(run_world(_hierarchical, 16, 4, max(40, iters // 3), 10, timeout=300))
        hier = {"world": 16, "node_size": 4, "median_ms": float(np.median(t) * 1e3),
                "p95_ms": float(np.percentile(t, 95) * 1e3)}
    w = np.array([r["world"] for r in rows], dtype=np.float64)
    m = np.array([r["median_ms"] for r in rows])
    b, a = np.polyfit(w - 1, m, 1)
    a, b = max(a, 0.0), max(b, 1e-4)
    # Per hop at W = 2 (2 all_gathers of 1 hop each per round): the least oversubscribed measurement.
    hop2 = rows[0]["median_ms"] / 2 if rows[0]["world"] == 2 else b / 2
    nodes = TARGET_WORLD // GPUS_PER_NODE

    def flat(hop_ms: float, world: int) -> float:  # per round: 2 ring all_gathers of world - 1 hops
        return 2 * hop_ms * (world - 1)

    def two_level(hop_ms: float) -> float:  # inner gather + leader gather + inner broadcast (~1 inner gather)
        return 2 * flat(hop_ms, GPUS_PER_NODE) + flat(hop_ms, nodes)

    extrap = {"fit_ms": {"a": a, "b_per_world": b}, "hop_ms_at_2": hop2}
    for label, hop in (("fit", b / 2), ("hop2", hop2), ("dc30us", 0.030)):
        extrap[f"flat_2560_ms_{label}"] = flat(hop, TARGET_WORLD)
        extrap[f"hier_2560_ms_{label}"] = two_level(hop)
    extrap["flat_2560_ms"] = extrap["flat_2560_ms_hop2"]
    extrap["hierarchical_2560_ms"] = extrap["hier_2560_ms_hop2"]
    return {"flat": rows, "hierarchical16": hier, "extrapolation": extrap}


# -- the planning="global" round's exchanges, with the loader's own classes ---------------------------------
GLOBAL_BUFFER = 4096
"""Buffered samples per rank in the global round measurement (the loader's default buffer_size)."""


def _global_round(rank: int, world: int, group: int, iters: int, warmup: int) -> list[float]:
    """One planning="global" round's metadata, as the loader issues it: exchange 1 (report, world-wide; flat
    or two-level), exchange A (every buffered sample's length and age, inside the planning group), exchange
    B (union groups/samples, world-wide; only with > 1 planning group), exchange 2 (slot counts, world-wide)."""
    from datetime import timedelta

    from evenflow.runtime.comm import MetadataExchange, TwoLevelExchange, planning_groups, resolve_topology

    topology = resolve_topology(None, timedelta(seconds=120))
    groups = planning_groups(topology, group, timedelta(seconds=120))
    world_x = TwoLevelExchange(topology, groups) if len(groups.starts) > 1 else MetadataExchange(topology)
    inner = MetadataExchange(groups.inner)
    report = np.full(13, rank, dtype=np.int64)
    rows = np.full(GLOBAL_BUFFER * 2, rank, dtype=np.int64)
    counts = np.full(COUNTS_WIDTH * 2, rank, dtype=np.int64)  # 8 steps x 4 fields
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        table = world_x.all_gather(report)
        inner.all_gather(rows)
        if len(groups.starts) > 1:
            world_x.all_gather(report[:2])
        world_x.all_gather(counts)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    assert int(table[world - 1][0]) == world - 1
    return times


def global_round(quick: bool = False, worlds: tuple[int, ...] = (2, 4, 8, 16), group: int = 4) -> dict:
    """Round latency of the global policy's exchanges: one planning group of all ranks vs groups of ``group``
    ranks (two-level), and the model to 2,560 ranks from the per-hop cost measured at 2-4 processes."""
    iters = 20 if quick else 60
    rows = []
    for w in worlds:
        for g in sorted({w, min(group, w)}):
            t = _per_iteration_max(run_world(_global_round, w, g, iters, 5, timeout=600))
            rows.append({"world": w, "planning_group": g, "median_ms": float(np.median(t) * 1e3),
                         "p95_ms": float(np.percentile(t, 95) * 1e3), "contended": w > 4})
    small = [r for r in rows if r["world"] <= 4 and r["planning_group"] == r["world"]]
    # One round with one group: exchanges 1, A (64 KiB rows) and 2, each a ring all_gather of W - 1 hops.
    hop = float(np.median([r["median_ms"] / (3 * (r["world"] - 1)) for r in small]))

    def hops(world: int, k: int) -> int:  # ring all_gathers; two-level = inner + leaders + log2(k) broadcast
        n = world // k
        two_level = (k - 1) + (n - 1) + int(np.ceil(np.log2(max(k, 2)))) if n > 1 else world - 1
        return 2 * two_level + (k - 1) + (two_level if n > 1 else 0)  # 1, [B,] 2 world-wide; A inside the group

    model = {f"W{w}_k{k}_ms": hop * hops(w, k) for w, k in ((64, 64), (2560, 8), (2560, 64), (2560, 2560))}
    return {"rows": rows, "hop_ms": hop, "model": model}


def markdown(res: dict, step_s: float | None = None, steps_per_round: int = 4) -> str:
    lines = ["| processes | flat round median (ms) | p95 (ms) |", "|---:|---:|---:|"]
    for r in res["flat"]:
        lines.append(f"| {r['world']} | {r['median_ms']:.2f} | {r['p95_ms']:.2f} |")
    h = res["hierarchical16"]
    if h:
        lines.append(f"| 16 (2-level, nodes of {h['node_size']}) | {h['median_ms']:.2f} | {h['p95_ms']:.2f} |")
    e = res["extrapolation"]
    lines += ["", "| per-hop cost assumed | flat round at 2,560 (ms) | two-level round at 2,560 (ms) |",
              "|---|---:|---:|"]
    for label, what in (("fit", f"fit over 2-16 processes ({e['fit_ms']['b_per_world'] / 2:.2f} ms/hop, "
                                "oversubscribed)"),
                        ("hop2", f"measured at 2 processes ({e['hop_ms_at_2']:.2f} ms/hop)"),
                        ("dc30us", "datacenter TCP, 0.03 ms/hop (assumed)")):
        lines.append(f"| {what} | {e[f'flat_2560_ms_{label}']:.0f} | {e[f'hier_2560_ms_{label}']:.0f} |")
    lines.append("")
    lines.append("Two-level = all_gather inside each node of 8, all_gather among the 320 node leaders, broadcast "
                 "inside the node: 2 x 7 + 319 hops instead of 2,559.")
    if step_s:
        budget = step_s * steps_per_round * 1e3
        flat_ms, hier_ms = e["flat_2560_ms"], e["hierarchical_2560_ms"]
        lines.append(f"A round feeds {steps_per_round} steps of ~{step_s:.2f} s (simulated H100 step at the "
                     f"budget) = {budget:.0f} ms of training to hide behind (the loader overlaps rounds with "
                     f"training up to `depth`). With the per-hop cost measured here, the flat exchange needs "
                     f"{flat_ms / budget:.0%} of that window ({'hidden' if flat_ms < budget else 'NOT hidden'}); "
                     f"the two-level one {hier_ms / budget:.0%} ({'hidden' if hier_ms < budget else 'NOT hidden'}). "
                     f"With datacenter-like hops the flat exchange needs {e['flat_2560_ms_dc30us'] / budget:.1%}.")
        return "\n".join(lines)


def global_markdown(res: dict) -> str:
    lines = ["| processes | planning group | round median (ms) | p95 (ms) |", "|---:|---:|---:|---:|"]
    for r in res["rows"]:
        tag = " (contended: >4 processes on 2 cores)" if r["contended"] else ""
        lines.append(f"| {r['world']}{tag} | {r['planning_group']} | {r['median_ms']:.2f} | {r['p95_ms']:.2f} |")
    lines += ["", f"Per-hop cost measured at 2-4 processes: {res['hop_ms']:.3f} ms. Modelled round latency "
              "(hops x that cost; planning time not included): " + ", ".join(
                  f"{k.replace('_ms', '')} {v:.0f} ms" for k, v in res["model"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--global-round", action="store_true", help="only the planning='global' round exchanges")
    args = ap.parse_args(argv)
    if args.global_round:
        res = global_round(quick=args.quick)
        print(global_markdown(res))
        print(json.dumps({"global_round": res}))
        return
    res = run(quick=args.quick)
    print(markdown(res))
    print(json.dumps({"gloo_round_ms": {str(r["world"]): round(r["median_ms"], 3) for r in res["flat"]},
                      "flat_2560_ms": round(res["extrapolation"]["flat_2560_ms"], 1),
                      "hierarchical_2560_ms": round(res["extrapolation"]["hierarchical_2560_ms"], 1)}))


if __name__ == "__main__":
    main()
