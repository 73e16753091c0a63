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

Run: ``python benchmarks/bench_gloo.py [--quick]``; prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _world import run_world  # noqa: E402

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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    res = run(quick=args.quick)
    print(markdown(res))
    print(json.dumps({"gloo_round_ms": {str(r["world"]): round(r["median_ms"], 3) for r in res["flat"]},
                      "flat_2560_ms": round(res["extrapolation"]["flat_2560_ms"], 1),
                      "hierarchical_2560_ms": round(res["extrapolation"]["hierarchical_2560_ms"], 1)}))


if __name__ == "__main__":
    main()
