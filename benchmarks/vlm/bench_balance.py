"""Benchmark cross-rank post-balancing (OrchMLLM): imbalance, planning time, bytes moved, tiny-MLLM steps.

Run:  python benchmarks/vlm/bench_balance.py [--quick]
Prints human-readable lines, then ONE JSON line last.

1. Per-phase imbalance before/after on long-tail text (real request lengths from the vidur trace in
   ../shared/data when present, else a log-normal stand-in) and on mixed image/audio/text batches, >= 8
   items per rank. Goal: max load <= 1.05 x max(largest item, mean load).
2. Planning time for 2,560 ranks x 32 items (goal < 20 ms) and the rank-level assignment at 2,560 ranks.
3. Bytes moved at 8 nodes x 8 ranks: naive bucket placement, + node-wise assignment, + locality (default).
4. The tiny MLLM on 4 CPU gloo ranks: step time with and without orchestration; planning time as a fraction
   of the step (goal < 2 %).
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from evenflow.balance import (QuadraticCost, Topology, assign_buckets, assign_buckets_milp,  # noqa: E402
                              balance, loads, lower_bound, lpt, lpt_batched, makespan, plan_balance, transfer_stats)
from evenflow.balance.phases import ExampleMeta, OrchestratorConfig, PhaseSpec, plan_step  # noqa: E402

VIDUR = ROOT.parent / "shared" / "data" / "vidur_splitwise_conv.csv"
TEXT_COST = QuadraticCost(alpha=24576.0, beta=1.0)
"""Attention-aware cost (Megatron/verl for hidden 4096): 6 * 4096 per token for linears + L**2 attention."""
VISION_COST = QuadraticCost(alpha=8192.0, beta=1.0)
AUDIO_COST = QuadraticCost(alpha=4096.0, beta=1.0)
GOAL_RATIO = 1.05
GOAL_PLAN_MS = 20.0
GOAL_OVERHEAD = 0.02


def text_lengths(rng: np.random.Generator, n: int) -> tuple[np.ndarray, str]:
    if VIDUR.exists():
        with open(VIDUR) as f:
            rows = list(csv.DictReader(f))
        pool = np.array([int(r["num_prefill_tokens"]) + int(r["num_decode_tokens"]) for r in rows])
        return rng.choice(pool, n), "vidur splitwise_conv (real request lengths)"
    return np.minimum(rng.lognormal(6.6, 1.0, n).astype(np.int64) + 1, 32768), "log-normal stand-in (no ../shared)"


def ratio_to_bound(costs: np.ndarray, assign: np.ndarray, ranks: int) -> float:
    return makespan(costs, assign, ranks) / lower_bound(costs, ranks)


def imbalance_text(rng: np.random.Generator, ranks: int, per_rank: int) -> dict:
    lengths, source = text_lengths(rng, ranks * per_rank)
    costs = TEXT_COST(lengths.astype(np.float64))
    sources = np.repeat(np.arange(ranks), per_rank)  # what random sampling handed each rank
    dest = np.asarray(plan_balance(costs, sources, ranks, ranks_per_node=8, item_bytes=lengths))
    before, after = loads(costs, sources, ranks), loads(costs, dest, ranks)
    out = {"data": source, "ranks": ranks, "items_per_rank": per_rank,
           "max_over_mean_before": float(before.max() / before.mean()),
           "max_over_mean_after": float(after.max() / after.mean()),
           "max_over_bound_before": ratio_to_bound(costs, sources, ranks),
           "max_over_bound_after": ratio_to_bound(costs, dest, ranks),
           "largest_item_over_mean": float(costs.max() / before.mean())}
    print(f"[text] {source}: {ranks} ranks x {per_rank}: max/mean {out['max_over_mean_before']:.3f} -> "
          f"{out['max_over_mean_after']:.3f}; max/bound {out['max_over_bound_before']:.3f} -> "
          f"{out['max_over_bound_after']:.3f} (goal <= {GOAL_RATIO})")
    return out


def mixed_metadata(rng: np.random.Generator, ranks: int, per_rank: int) -> list[list[ExampleMeta]]:
    lengths, _ = text_lengths(rng, ranks * per_rank)
    # Images: patch counts of real resolutions after 14 px patches + 2x2 merge (224..1344 px); audio: 25 Hz frames.
    patch_choices = np.array([64, 256, 576, 1024, 2304, 4096, 9216])
    meta = []
    for r in range(ranks):
        rank_meta = []
        for j in range(per_rank):
            kind = rng.random()
            images = tuple(int(x) for x in rng.choice(patch_choices, rng.integers(1, 4))) if kind < 0.45 else ()
            audio = tuple(int(4 * rng.integers(25, 25 * 30 // 4)) for _ in range(rng.integers(1, 3))) \
                if 0.35 < kind < 0.7 else ()
            media_tokens = sum(p // 4 for p in images) + sum(a // 4 for a in audio)
            length = int(lengths[r * per_rank + j]) + media_tokens
            rank_meta.append(ExampleMeta(length, int(lengths[r * per_rank + j]) // 2, (images, audio)))
        meta.append(rank_meta)
    return meta


MIXED_CONFIG = OrchestratorConfig(encoders={"vision": PhaseSpec(cost=VISION_COST, input_dim=1176, downsample=4),
                                            "audio": PhaseSpec(cost=AUDIO_COST, input_dim=128, downsample=4)},
                                  llm=PhaseSpec(cost=TEXT_COST), ranks_per_node=8)


def imbalance_mixed(rng: np.random.Generator, ranks: int, per_rank: int) -> dict:
    meta = mixed_metadata(rng, ranks, per_rank)
    t0 = time.perf_counter()
    plan = plan_step(meta, MIXED_CONFIG)
    plan_ms = (time.perf_counter() - t0) * 1e3
    out = {"ranks": ranks, "examples_per_rank": per_rank, "plan_ms": plan_ms, "phases": {}}
    for phase, (before, after) in plan.phase_loads().items():
        costs = plan.phase_costs[phase]
        bound = lower_bound(costs, ranks)
        out["phases"][phase] = {"items": int(costs.size), "max_over_mean_before": float(before.max() / before.mean()),
                                "max_over_mean_after": float(after.max() / after.mean()),
                                "max_over_bound_after": float(after.max() / bound),
                                "max_over_bound_before": float(before.max() / bound)}
        p = out["phases"][phase]
        print(f"[mixed] {phase:6s} {p['items']:5d} items: max/mean {p['max_over_mean_before']:.3f} -> "
              f"{p['max_over_mean_after']:.3f}; max/bound {p['max_over_bound_before']:.3f} -> "
              f"{p['max_over_bound_after']:.3f}")
    print(f"[mixed] plan_step for {ranks} ranks x {per_rank} examples (3 phases): {plan_ms:.1f} ms")
    return out


def best_of(fn, repeats: int, clock=time.perf_counter) -> tuple[float, float]:
    """(min, median) milliseconds of ``fn`` over ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times) * 1e3, statistics.median(times) * 1e3


def planning_time(rng: np.random.Generator, repeats: int) -> dict:
    ranks, per_rank = 2560, 32
    lengths, _ = text_lengths(rng, ranks * per_rank)
    costs = TEXT_COST(lengths.astype(np.float64))
    sources = np.repeat(np.arange(ranks), per_rank)
    lpt_batched(costs, ranks)  # warm up
    b_min, b_med = best_of(lambda: lpt_batched(costs, ranks), repeats)
    b_cpu, _ = best_of(lambda: lpt_batched(costs, ranks), repeats, clock=time.process_time)
    a_min, a_med = best_of(lambda: balance(costs, ranks), repeats)  # method="auto"
    h_min, _ = best_of(lambda: lpt(costs, ranks, refine=False), 1)
    buckets = lpt_batched(costs, ranks)
    topo = Topology(num_ranks=ranks, ranks_per_node=8)
    s_min, s_med = best_of(lambda: assign_buckets(buckets, sources, topo, item_bytes=lengths), max(1, repeats // 4))
    p_min, _ = best_of(lambda: plan_balance(costs, sources, ranks, ranks_per_node=8, item_bytes=lengths), 1)
    out = {"ranks": ranks, "items_per_rank": per_rank, "lpt_batched_ms_min": b_min, "lpt_batched_ms_median": b_med,
           "lpt_batched_cpu_ms_min": b_cpu,
           "auto_ms_median": a_med, "heap_lpt_ms": h_min, "ratio_batched": ratio_to_bound(costs, buckets, ranks),
           "assignment_2560_ms_min": s_min, "assignment_2560_ms_median": s_med, "plan_balance_total_ms": p_min}
    print(f"[plan] 2560 x 32: batched LPT {b_min:.1f} ms wall (median {b_med:.1f}, CPU {b_cpu:.1f}; goal < "
          f"{GOAL_PLAN_MS}), heap LPT "
          f"{h_min:.1f} ms; max/bound {out['ratio_batched']:.4f}")
    print(f"[plan] rank-level assignment (linear_sum_assignment 2560 x 2560): {s_min:.0f} ms (median "
          f"{s_med:.0f}); full plan_balance incl. locality: {p_min:.0f} ms -- overlapped with the step")
    return out


GOAL_PLAN_64_MS = 10.0
"""Issue 12: ``plan_balance`` at 64 ranks x 32 items well under 10 ms on one idle core, after warm-up."""
GOAL_PLAN_2560_MS = 100.0
"""Issue 12: ``plan_balance`` at 2,560 ranks x 32 items under 100 ms on one idle core, after warm-up."""


def _instance(rng: np.random.Generator, ranks: int, per_rank: int, skew: bool):
    lengths, _ = text_lengths(rng, ranks * per_rank)
    if skew:  # one source rank holds 80 % of the items (e.g. after a data-loading hiccup), the rest uniform
        sources = np.where(rng.random(ranks * per_rank) < 0.8, 0, rng.integers(0, ranks, ranks * per_rank))
    else:
        sources = np.repeat(np.arange(ranks), per_rank)
    return TEXT_COST(lengths.astype(np.float64)), sources, lengths


def _first_call_ms() -> float:
    """``plan_balance`` 64 x 32 in a fresh interpreter right after ``import evenflow``: the first-call stall."""
    code = ("import time, numpy as np, evenflow; from evenflow.balance import plan_balance; "
            "c = np.arange(1, 2049, dtype=float) * 24576; s = np.repeat(np.arange(64), 32); "
            "t = time.perf_counter(); plan_balance(c, s, 64, ranks_per_node=8); "
            "print((time.perf_counter() - t) * 1e3)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def plan_latency(rng: np.random.Generator, repeats: int) -> dict:
    """``plan_balance`` (the default config: LPT / batched LPT, greedy matching, locality) after warm-up, on
    uniform and skewed instances; the arms are interleaved so load swings hit all of them alike."""
    from evenflow.balance import warm_up

    warm_up()
    cases = {f"{r}x32_{'skewed' if sk else 'uniform'}": _instance(rng, r, 32, sk)
             for r in (64, 2560) for sk in (False, True)}
    wall: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for rep in range(repeats):
        names = list(cases) if rep % 2 == 0 else list(cases)[::-1]  # ABBA
        for name in names:
            c, s, ls = cases[name]
            ranks = int(name.split("x")[0])
            t0, c0 = time.perf_counter(), time.process_time()
            plan_balance(c, s, ranks, ranks_per_node=8, item_bytes=ls)
            wall[name].append((time.perf_counter() - t0) * 1e3)
            cpu[name].append((time.process_time() - c0) * 1e3)
    out = {name: {"wall_ms_min": min(wall[name]), "wall_ms_median": statistics.median(wall[name]),
                  "cpu_ms_min": min(cpu[name]), "cpu_ms_median": statistics.median(cpu[name])} for name in cases}
    out["first_call_ms_fresh_process"] = _first_call_ms()
    out["load_avg_1min"] = os.getloadavg()[0]
    for name in cases:
        r = out[name]
        goal = GOAL_PLAN_64_MS if name.startswith("64x") else GOAL_PLAN_2560_MS
        print(f"[latency] plan_balance {name}: wall min {r['wall_ms_min']:.1f} / median {r['wall_ms_median']:.1f} ms, "
              f"CPU min {r['cpu_ms_min']:.1f} ms (goal < {goal:g} ms idle core)")
    print(f"[latency] first call in a fresh process (64 x 32): {out['first_call_ms_fresh_process']:.1f} ms; "
          f"load average {out['load_avg_1min']:.1f}")
    return out


def bytes_moved(rng: np.random.Generator) -> dict:
    ranks, per_node, per_rank = 64, 8, 16
    lengths, _ = text_lengths(rng, ranks * per_rank)
    costs = TEXT_COST(lengths.astype(np.float64))
    nbytes = lengths * 2 * 4096  # bf16 hidden states of 4096 per token
    sources = np.repeat(np.arange(ranks), per_rank)
    topo = Topology(num_ranks=ranks, ranks_per_node=per_node)
    buckets = balance(costs, ranks)
    naive = buckets  # bucket b -> rank b
    lsa = assign_buckets(buckets, sources, topo, item_bytes=nbytes)[buckets]
    bott = assign_buckets_milp(buckets, sources, topo, item_bytes=nbytes, objective="bottleneck",
                               time_limit=20.0)[buckets]
    local = np.asarray(plan_balance(costs, sources, ranks, ranks_per_node=per_node, item_bytes=nbytes))
    out = {}
    for name, dest in (("naive", naive), ("node_assignment", lsa), ("bottleneck_milp", bott),
                       ("locality_default", local)):
        stats = transfer_stats(dest, sources, nbytes, topo)
        stats["max_over_bound"] = ratio_to_bound(costs, dest, ranks)
        out[name] = stats
        print(f"[bytes] 8x8 {name:17s}: inter {stats['inter_bytes'] / 2**20:9.1f} MiB, intra "
              f"{stats['intra_bytes'] / 2**20:8.1f} MiB, busiest link {stats['max_link_bytes'] / 2**20:8.1f} MiB, "
              f"max/bound {stats['max_over_bound']:.3f}")
    out["reduction_total_locality_vs_naive"] = out["naive"]["moved_bytes"] / max(out["locality_default"]["moved_bytes"], 1)
    out["reduction_inter_locality_vs_naive"] = out["naive"]["inter_bytes"] / max(out["locality_default"]["inter_bytes"], 1)
    print(f"[bytes] locality + node-wise assignment moves {out['reduction_total_locality_vs_naive']:.1f}x fewer "
          f"bytes ({out['reduction_inter_locality_vs_naive']:.1f}x fewer inter-node) than naive placement")
    return out


# -- the tiny MLLM on 4 gloo ranks ------------------------------------------------------------------------------

BENCH_MODEL = dict(d_model=64, n_heads=4, n_layers=2, max_len=2048)
"""Large enough that compute, not per-op overhead, dominates a step on one CPU core."""


def _long_tail_examples(rank: int, step: int, count: int):
    """Long-tail multimodal examples: log-normal text, some images (patches) and audio clips (frames)."""
    import torch

    from evenflow.exchange import ExampleInputs
    from evenflow.testing import TinyMLLMConfig

    cfg = TinyMLLMConfig(**BENCH_MODEL)
    g = np.random.default_rng([rank, step])
    tg = torch.Generator().manual_seed(int(g.integers(1 << 31)))
    out = []
    for _ in range(count):
        ids, sup, media = [], [], {"vision": [], "audio": []}
        for phase, p_items, rows_fn, unit, dim, token in (
                ("vision", 0.5, lambda: cfg.patch_merge * int(min(256, g.lognormal(4.0, 1.0)) + 1), cfg.patch_merge,
                 cfg.patch_dim, cfg.image_token_id),
                ("audio", 0.3, lambda: cfg.frame_stride * int(min(128, g.lognormal(3.0, 1.0)) + 1), cfg.frame_stride,
                 cfg.n_mels, cfg.audio_token_id)):
            for _ in range(int(g.random() < p_items) * int(g.integers(1, 3))):
                rows = rows_fn()
                media[phase].append(torch.randn(rows, dim, generator=tg, dtype=torch.float32))
                ids.append(torch.full((rows // unit,), token))
                sup.append(torch.zeros(rows // unit, dtype=torch.bool))
        n_text = int(min(1800, g.lognormal(4.5, 1.3))) + 2
        ids.append(torch.randint(3, cfg.vocab_size, (n_text,), generator=tg))
        sup.append(torch.ones(n_text, dtype=torch.bool))
        all_ids = torch.cat(ids)
        labels = torch.where(torch.cat(sup), all_ids, torch.full_like(all_ids, -100))
        out.append(ExampleInputs(input_ids=all_ids, labels=labels, media=media))
    return out


def fit_phase_costs() -> dict:
    """Time each phase of the bench model at a few sizes, fit gamma + alpha L + beta L^2 (one process).

    The fitted numbers are then given to every rank: a cost model must be identical on all ranks, so it is
    fitted once, never from per-rank timings.
    """
    import torch

    from evenflow.balance import fit_quadratic
    from evenflow.exchange import LLMInputs
    from evenflow.testing import TinyMLLM, TinyMLLMConfig

    torch.set_num_threads(1)
    cfg = TinyMLLMConfig(**BENCH_MODEL)
    torch.manual_seed(0)
    model = TinyMLLM(cfg)
    empty = torch.zeros(0, cfg.d_model)

    def timed(fn, repeats=3) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.thread_time()
            fn()
            best = min(best, time.thread_time() - t0)
        return best

    def lm(length: int) -> None:
        ids = torch.randint(3, cfg.vocab_size, (length,))
        batch = LLMInputs(example_ids=[0], input_ids=[ids], labels=[ids], media={"vision": empty, "audio": empty},
                          media_counts={"vision": [0], "audio": [0]}, total_loss_tokens=length)
        model.lm_loss_sum(batch).backward()

    def enc(encoder, dim: int, rows: int) -> None:
        encoder(torch.randn(rows, dim), [rows]).sum().backward()

    sizes = [64, 256, 512, 1024, 2048]
    costs = {"llm": fit_quadratic(sizes, [timed(lambda n=n: lm(n)) for n in sizes]),
             "vision": fit_quadratic(sizes, [timed(lambda n=n: enc(model.encode_vision, cfg.patch_dim, n))
                                             for n in sizes]),
             "audio": fit_quadratic(sizes, [timed(lambda n=n: enc(model.encode_audio, cfg.n_mels, n))
                                            for n in sizes])}
    for name, c in costs.items():
        print(f"[fit] {name:6s} seconds ~ {c.gamma:.2e} + {c.alpha:.2e} L + {c.beta:.2e} L^2")
    return costs


def _mllm_worker(rank: int, world: int, init: str, out_dir: str, steps: int, per_rank: int, costs: dict) -> None:
    import torch
    import torch.distributed as dist

    from evenflow.exchange import GlobalOrchestrator, local_step
    from evenflow.balance.phases import plan_step
    from evenflow.testing import TinyMLLM, TinyMLLMConfig, orchestrator_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        group = dist.new_group(backend="gloo")
        cfg = TinyMLLMConfig(**BENCH_MODEL)
        torch.manual_seed(0)
        model = TinyMLLM(cfg)
        ocfg = orchestrator_config(cfg, vision_cost=costs["vision"], audio_cost=costs["audio"],
                                   llm_cost=costs["llm"])
        orch = GlobalOrchestrator(ocfg, group=group)
        batches = [_long_tail_examples(rank, s, per_rank) for s in range(steps)]
        params = list(model.parameters())
        plan_step(orch.gather_metadata([ex.meta(ocfg) for ex in batches[0]]), ocfg)  # warm up (lazy imports)

        def sync_grads():
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=dist.group.WORLD)

        timings = {k: [] for k in ("local", "orch", "plan", "plan_cpu", "meta", "local_cpu", "orch_cpu")}
        for mode in ("local", "orch", "local", "orch"):  # interleaved, twice, to even out machine noise
            for s in range(steps):
                local = batches[s]
                dist.barrier(group=dist.group.WORLD)
                t0 = time.perf_counter()
                c0 = time.thread_time()  # CPU of this rank: blocking in gloo does not count
                model.zero_grad()
                if mode == "local":
                    total = torch.tensor([sum(ex.meta(ocfg).loss_tokens for ex in local)])
                    dist.all_reduce(total, group=dist.group.WORLD)
                    batch = local_step(local, model.encoders(), ocfg, total_loss_tokens=int(total))
                else:
                    tm = time.perf_counter()
                    meta = orch.gather_metadata([ex.meta(ocfg) for ex in local])
                    tp, cp = time.perf_counter(), time.thread_time()
                    plan = plan_step(meta, ocfg)  # pure: in training, computed for step t+1 during step t
                    timings["plan"].append(time.perf_counter() - tp)
                    timings["plan_cpu"].append(time.thread_time() - cp)
                    timings["meta"].append(tp - tm)
                    batch = orch.step(plan, local, model.encoders())
                loss = model.lm_loss_sum(batch) / batch.total_loss_tokens
                loss.backward()
                cpu = time.thread_time() - c0
                sync_grads()
                dist.barrier(group=dist.group.WORLD)
                if s > 0:  # step 0 warms up
                    timings[mode].append(time.perf_counter() - t0)
                    timings[mode + "_cpu"].append(cpu)
        torch.save(timings, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def tiny_mllm(steps: int, per_rank: int, costs: dict, world: int = 4, deadline_s: float = 500.0) -> dict:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        init = f"file://{tmp}/rendezvous"
        procs = [ctx.Process(target=_mllm_worker, args=(r, world, init, tmp, steps, per_rank, costs), daemon=True)
                 for r in range(world)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=max(0.0, deadline_s - (time.monotonic() - t0)))
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = "".join(f.read_text() for f in Path(tmp).glob("*.err"))
        if any(p.exitcode for p in procs) or errors:
            raise RuntimeError(f"tiny MLLM ranks failed: {[p.exitcode for p in procs]}\n{errors}")
        timings = [torch.load(Path(tmp, f"rank{r}.pt")) for r in range(world)]
    # Every step ends at a barrier: rank 0's clock is the step time.
    local = statistics.median(timings[0]["local"]) * 1e3
    orch = statistics.median(timings[0]["orch"]) * 1e3
    steps_n = len(timings[0]["orch"])
    per_step = lambda key: [max(t[key][i] for t in timings) for i in range(len(timings[0][key]))]  # noqa: E731
    plan = statistics.median(per_step("plan")) * 1e3
    plan_cpu = statistics.median(per_step("plan_cpu")) * 1e3
    meta = statistics.median(timings[0]["meta"]) * 1e3

    def critical(mode: str) -> tuple[float, float]:
        """Median over steps of (max over ranks of CPU ms, max / mean over ranks)."""
        cpu = [[t[mode + "_cpu"][i] for t in timings] for i in range(steps_n)]
        return (statistics.median(max(x) for x in cpu) * 1e3,
                statistics.median(max(x) / (sum(x) / len(x)) for x in cpu))

    cpu_local, imb_local = critical("local")
    cpu_orch, imb_orch = critical("orch")
    out = {"world": world, "examples_per_rank": per_rank, "steps_timed": steps_n, "cores": os.cpu_count(),
           "step_ms_without": local, "step_ms_with": orch, "wall_speedup": local / orch,
           "max_rank_cpu_ms_without": cpu_local, "max_rank_cpu_ms_with": cpu_orch,
           "cpu_max_over_mean_without": imb_local, "cpu_max_over_mean_with": imb_orch,
           "critical_path_speedup": cpu_local / cpu_orch, "plan_ms_wall": plan, "plan_ms_cpu": plan_cpu,
           "metadata_exchange_ms": meta, "plan_fraction_of_step": plan_cpu / orch}
    print(f"[mllm] tiny MLLM ({BENCH_MODEL}), {world} gloo ranks x {per_rank} examples on {os.cpu_count()} "
          f"cores: wall step {local:.0f} ms without -> {orch:.0f} ms with orchestration ({out['wall_speedup']:.2f}x)")
    print(f"[mllm] busiest rank's CPU per step {cpu_local:.0f} -> {cpu_orch:.0f} ms ({out['critical_path_speedup']:.2f}x;"
          f" max/mean {imb_local:.2f} -> {imb_orch:.2f}): the step time with one core per rank. With {world} ranks "
          f"on {os.cpu_count()} cores the wall time measures total work, which balancing does not change")
    print(f"[mllm] planning {plan_cpu:.2f} ms CPU ({plan:.2f} ms wall) = {100 * out['plan_fraction_of_step']:.2f} % of "
          f"the step (goal < {100 * GOAL_OVERHEAD:.0f} %); metadata exchange {meta:.2f} ms")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="text,mixed,plan,latency,bytes,mllm",
                        help="comma-separated sections to run (default: all)")
    args = parser.parse_args()
    only = set(args.only.split(","))
    rng = np.random.default_rng(args.seed)
    print(f"# bench_balance on {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}, numpy {np.__version__}")
    result = {"bench": "balance", "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    goals = {}
    if "text" in only:
        result["text"] = [imbalance_text(rng, 64, 8), imbalance_text(rng, 256, 16)]
    if "mixed" in only:
        result["mixed"] = [imbalance_mixed(rng, 64, 8), imbalance_mixed(rng, 256, 16)]
    if "text" in only or "mixed" in only:
        ratios = [t["max_over_bound_after"] for t in result.get("text", [])] + \
            [p["max_over_bound_after"] for m in result.get("mixed", []) for p in m["phases"].values()]
        goals.update(balance_max_over_bound=max(ratios), balance_ok=max(ratios) <= GOAL_RATIO)
    if "plan" in only:
        result["planning"] = planning_time(rng, 5 if args.quick else 15)
        goals.update(plan_2560x32_ms=result["planning"]["lpt_batched_ms_min"],
                     plan_2560x32_cpu_ms=result["planning"]["lpt_batched_cpu_ms_min"],
                     plan_ok=result["planning"]["lpt_batched_ms_min"] < GOAL_PLAN_MS)
    if "latency" in only:
        result["latency"] = plan_latency(rng, 5 if args.quick else 15)
        lat = result["latency"]
        goals.update(plan_balance_64x32_ms=lat["64x32_uniform"]["wall_ms_min"],
                     plan_balance_2560x32_ms=lat["2560x32_uniform"]["wall_ms_min"],
                     plan_balance_ok=(lat["64x32_uniform"]["wall_ms_min"] < GOAL_PLAN_64_MS
                                      and lat["2560x32_uniform"]["wall_ms_min"] < GOAL_PLAN_2560_MS))
    if "bytes" in only:
        result["bytes"] = bytes_moved(rng)
    if "mllm" in only:
        costs = fit_phase_costs()
        result["fitted_costs"] = {k: vars(v) for k, v in costs.items()}
        result["tiny_mllm"] = tiny_mllm(steps=5 if args.quick else 10, per_rank=8, costs=costs)
        goals.update(overhead_fraction=result["tiny_mllm"]["plan_fraction_of_step"],
                     overhead_ok=result["tiny_mllm"]["plan_fraction_of_step"] < GOAL_OVERHEAD)
    result["goals"] = goals
    print(json.dumps(result, default=float))


if __name__ == "__main__":
    main()
