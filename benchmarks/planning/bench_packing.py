"""Packed steps against TRL's packing on the same realized lengths (issue 35): steps, fill, balance on time, loss.

One pack per rank per step, every method on the same lengths, truncated at the token budget B for every method
alike (so only samples <= B are scored, and nothing is split or truncated by any of them):

    evenflow         DynamicBatchLoader(cost="summed") at its defaults, time_cost=None (NOTE [ The default time
                     cost ]), replayed by evenflow.sim.global_schedule: the real loader's steps exactly
                     (tests/test_sim_matches_loader.py; ``--real`` checks one configuration on real gloo ranks here)
    evenflow_tokens  the same loader with time_cost=TimeCost(): the planner before issue 35 (token counts)
    trl_bfd          trl.pack_dataset(strategy="bfd") as SFTTrainer calls it (datasets' map, batches of 1,000),
                     the packs in a seeded RandomSampler order dealt to W ranks by accelerate's BatchSamplerShard
                     (one pack per rank, even_batches=True: the last step is topped up from the start)
    trl_bfd_split    the same with strategy="bfd_split" (TRL's no-truncation variant; with lengths <= B it packs
                     like "bfd")
    multipack        the multipack sampler's allocator (imoneoi/multipack_sampler, MIT; benchmarks/
                     multipack_allocator.py): first fit decreasing over the longest prefix that fills W bins, the
                     rest of the epoch dropped

Configurations: chitchat (all 7,168 chats through the Qwen3 template) x1 and x4, hh-rlhf (../shared/data) x1 and
x4, a ShareGPT4o-shaped set (evenflow.sim.datasets, 10,000) x1, at W = 4 and 8 and B = 16,384; chitchat x1 and x4
at B = 4,096.

Scores, per configuration and method:

* steps (and the lower bound ``ceil(tokens / (W B))``), fill = tokens trained / (steps W B);
* token and time imbalance per step (max / mean over ranks), mean and worst step; time under the planner's model
  ``f(L) = L + L^2 / 24,576`` per sequence, summed over a pack;
* ``over_bar``: steps whose time imbalance exceeds ``max(1.10, bound + 0.02)``, the bound being the best any deal
  of the step's own sequences could reach under the budget: ``max(mean, longest, W-th + (W+1)-th longest, the
  longest one's time plus the tokens its pack must still hold)`` over the mean;
* the critical path: ``sum over steps of the slowest rank / (all time / W)`` (1 = perfect balance), under the
  planner's model and under a separately fitted one (NOTE [ Scoring time balance honestly ]): Qwen3-8B's FLOPs
  on an H100 at MFU 0.4 (evenflow.sim.calibrate.gpu_cost_model), "timed" with 3 % noise on a calibration split of
  UltraChat-shaped lengths and fitted by least squares (evenflow.sim.timefit.fit_time_cost); its per-micro-batch
  constant is added to every rank that holds a pack;
* lost (never trained), repeated (trained more than once), truncated (trained shorter than its length).

    .venv/bin/python benchmarks/planning/bench_packing.py [--quick] [--real]

Prints a markdown table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.*, <group>.*
from common import real_data  # noqa: E402
from planning.multipack_allocator import multipack_steps  # noqa: E402

from evenflow.planning import GroupingConfig  # noqa: E402
from evenflow.planning.timecost import TimeCost, default_time_cost  # noqa: E402
from evenflow.sim import global_schedule  # noqa: E402
from evenflow.sim.calibrate import gpu_cost_model  # noqa: E402
from evenflow.sim.datasets import chitchat_lengths, paper_lengths  # noqa: E402
from evenflow.sim.timefit import fit_time_cost  # noqa: E402

METHODS = ("evenflow", "evenflow_tokens", "trl_bfd", "trl_bfd_split", "multipack")
BAR, SLACK = 1.10, 0.02
"""The issue's bar on the worst step: at most 1.10, or at most its bound + 0.02."""
SEED = 0


def configurations(quick: bool) -> list[tuple[str, np.ndarray, int, int]]:
    """(name, lengths, W, B): the issue's 14 (hh-rlhf ones skipped with a message when ../shared/data is absent)."""
    sets = {"chitchat": chitchat_lengths(real_data.CACHE_DIR, min_turns=1)}
    ok, why = real_data.available("hh_rlhf")
    if ok:
        sets["hh_rlhf"] = real_data.raw_lengths("hh_rlhf")
    else:
        print(why, file=sys.stderr)
    sets["sharegpt4o"] = paper_lengths("sharegpt4o", 10_000, seed=SEED)
    copies = {"chitchat": (1,) if quick else (1, 4), "hh_rlhf": (1,) if quick else (1, 4), "sharegpt4o": (1,)}
    out = [(f"{name} x{c}", np.tile(base, c), w, 16_384) for name, base in sets.items() for c in copies[name]
           for w in (4, 8)]
    out += [(f"chitchat x{c}", np.tile(sets["chitchat"], c), w, 4096) for c in ((1,) if quick else (1, 4))
            for w in (4, 8)]
    return [(n, np.minimum(ls, b).astype(np.int64), w, b) for n, ls, w, b in out]


# -- the methods: steps[t][r] = sample ids ---------------------------------------------------------------------

def evenflow_steps(lengths: np.ndarray, world: int, budget: int, time_cost: TimeCost | None) -> list:
    s = global_schedule(lengths, world_size=world, grouping=GroupingConfig(token_budget=budget, cost="summed"),
                        time_cost=time_cost, seed=SEED)
    return s.batches()


def trl_steps(lengths: np.ndarray, world: int, budget: int, strategy: str) -> list:
    """TRL's packs, dealt as the HF Trainer + accelerate deal them (see the module docstring)."""
    import torch
    from accelerate.data_loader import BatchSamplerShard
    from datasets import Dataset
    from torch.utils.data import BatchSampler, RandomSampler
    from datasets.utils.logging import disable_progress_bar
    from trl import pack_dataset

    disable_progress_bar()

    ids = np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)  # every token names its sample
    cuts = np.concatenate(([0], np.cumsum(lengths)))
    ds = Dataset.from_dict({"input_ids": [ids[cuts[i]:cuts[i + 1]] for i in range(lengths.size)]})
    packed = pack_dataset(ds, seq_length=budget, strategy=strategy).with_format("numpy")
    packs = []
    for row in packed:
        starts = np.concatenate(([0], np.cumsum(row["seq_lengths"])[:-1]))
        packs.append(row["input_ids"][starts].tolist())
    def shard(rank: int) -> list[int]:  # every process seeds its own sampler alike, as the trainer does
        sampler = BatchSampler(RandomSampler(range(len(packs)), generator=torch.Generator().manual_seed(SEED)), 1,
                               False)
        return [b for batch in BatchSamplerShard(sampler, num_processes=world, process_index=rank,
                                                 split_batches=False, even_batches=True) for b in batch]

    per_rank = [shard(r) for r in range(world)]
    return [[packs[per_rank[r][t]] for r in range(world)] for t in range(len(per_rank[0]))]


def method_steps(method: str, lengths: np.ndarray, world: int, budget: int) -> list:
    if method == "evenflow":
        return evenflow_steps(lengths, world, budget, None)
    if method == "evenflow_tokens":
        return evenflow_steps(lengths, world, budget, TimeCost())
    if method.startswith("trl_"):
        return trl_steps(lengths, world, budget, method[len("trl_"):])
    return multipack_steps(lengths, world, budget, seed=SEED)


# -- scores ------------------------------------------------------------------------------------------------------

def _step_bound(ls: np.ndarray, f, world: int, budget: int) -> float:
    """The least time of the slowest rank any deal of these sequences into W packs of <= B tokens can have: the
    mean, the longest sequence, two of the W + 1 longest in one pack, and the longest one's pack holding what
    the other W - 1 full packs cannot."""
    if not ls.size:
        return 0.0
    t = np.sort(f(ls))[::-1]
    bounds = [float(t.sum()) / world, float(t[0])]
    if t.size > world:
        bounds.append(float(t[world - 1] + t[world]))
    longest = int(ls[np.argmax(f(ls))])
    forced = max(0, int(ls.sum()) - (world - 1) * budget) - longest
    bounds.append(float(f(longest)) + max(0, forced) * f.alpha)
    return max(bounds)


def score(steps: list, lengths: np.ndarray, world: int, budget: int, planner, fitted, per_batch: float) -> dict:
    counts = np.bincount(np.fromiter((i for st in steps for g in st for i in g), np.int64), minlength=lengths.size)
    tok = np.array([[int(lengths[g].sum()) for g in st] for st in steps], dtype=np.float64)
    over = int((tok > budget).sum())
    t_plan = np.array([[float(planner(lengths[g]).sum()) if len(g) else 0.0 for g in st] for st in steps])
    t_fit = np.array([[float(fitted(lengths[g]).sum()) + per_batch if len(g) else 0.0 for g in st] for st in steps])
    imb = lambda x: x.max(axis=1) / np.maximum(x.mean(axis=1), 1e-300)  # noqa: E731
    bound = np.array([_step_bound(np.concatenate([lengths[g] for g in st]), planner, world, budget)
                      for st in steps]) / np.maximum(t_plan.mean(axis=1), 1e-300)
    ti = imb(t_plan)
    return {"steps": len(steps), "lower_bound": -(-int(lengths.sum()) // (world * budget)),
            "fill": float(tok.sum() / (len(steps) * world * budget)),
            "tok_imb_mean": float(imb(tok).mean()), "tok_imb_worst": float(imb(tok).max()),
            "time_imb_mean": float(ti.mean()), "time_imb_worst": float(ti.max()),
            "worst_step": int(np.argmax(ti)), "worst_step_bound": float(bound[np.argmax(ti)]),
            "over_bar": int((ti > np.maximum(BAR, bound + SLACK) + 1e-12).sum()),
            "critical_path": float(t_plan.max(axis=1).sum() / (t_plan.sum() / world)),
            "critical_path_fitted": float(t_fit.max(axis=1).sum() / (t_fit.sum() / world)),
            "lost": int((counts == 0).sum()), "repeated": int(np.maximum(counts - 1, 0).sum()), "truncated": 0,
            "over_budget_packs": over}


def fitted_model():
    """The separately fitted scorer: (per-sequence TimeCost in seconds, per-micro-batch seconds)."""
    hardware = gpu_cost_model("H100")
    calibration = paper_lengths("ultrachat", 4096, seed=SEED + 1, cutoff=16_384)
    return fit_time_cost(hardware, calibration, seed=SEED).phases[0], hardware.phases[0].per_batch


# -- the real loader, once -----------------------------------------------------------------------------------------

def real_rank_steps(rank: int, world: int, lengths: np.ndarray, budget: int, buffer_size: int | None = None) -> list:
    """One gloo rank's epoch through the real loader (``cost="summed"``): per step, the ids of the samples packed
    in this rank's row (sample i is ``lengths[i]`` copies of i; a sample starts where its positions restart)."""
    import torch
    from torch.utils.data import Dataset

    import evenflow

    class Ids(Dataset):
        def __len__(self):
            return lengths.size

        def __getitem__(self, i):
            row = torch.full((int(lengths[i]),), i)
            return {"input_ids": row, "labels": row}

    buffer = {} if buffer_size is None else {"buffer_size": buffer_size}
    loader = evenflow.DynamicBatchLoader(Ids(), token_budget=budget, cost="summed", seed=SEED,
                                         timeout=timedelta(minutes=10), **buffer)
    steps = []
    try:
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            starts = (batch["position_ids"].reshape(-1) == 0).nonzero().reshape(-1)
            steps.append([] if info.is_idle else sorted(int(batch["input_ids"].reshape(-1)[s]) for s in starts))
    finally:
        loader.close()
    return steps


def real_check(lengths: np.ndarray, world: int, budget: int) -> dict:
    """The real loader on ``world`` gloo ranks against its simulated steps (must be equal)."""
    from common.world import run_world

    started = time.perf_counter()
    per_rank = run_world(real_rank_steps, world, lengths, budget, timeout=1800)
    real = [[per_rank[r][t] for r in range(world)] for t in range(len(per_rank[0]))]
    sim = [[sorted(g) for g in st] for st in evenflow_steps(lengths, world, budget, None)]
    return {"equal": real == sim, "steps": len(real), "wall_s": round(time.perf_counter() - started, 1)}


# -- report --------------------------------------------------------------------------------------------------------

def markdown(rows: dict) -> str:
    head = ["| configuration | method | steps (bound) | fill | tokens mean / worst | time mean / worst (bound) | "
            "over bar | critical path | fitted | lost | repeated |", "|" + "---|" * 11]
    for (cfg, method), r in rows.items():
        head.append(f"| {cfg} | {method} | {r['steps']} ({r['lower_bound']}) | {r['fill']:.4f} | "
                    f"{r['tok_imb_mean']:.3f} / {r['tok_imb_worst']:.2f} | {r['time_imb_mean']:.3f} / "
                    f"{r['time_imb_worst']:.2f} ({r['worst_step_bound']:.2f}) | {r['over_bar']} | "
                    f"{r['critical_path']:.4f} | {r['critical_path_fitted']:.4f} | {r['lost']} | {r['repeated']} |")
    return "\n".join(head)


def run(quick: bool = False, real: bool = False) -> dict:
    planner = default_time_cost("summed").phases[0]
    fitted, per_batch = fitted_model()
    rows, timing = {}, {}
    for name, lengths, world, budget in configurations(quick):
        cfg = f"{name} W={world} B={budget}"
        for method in METHODS:
            started = time.perf_counter()
            rows[(cfg, method)] = score(method_steps(method, lengths, world, budget), lengths, world, budget, planner,
                                        fitted, per_batch)
            timing[method] = timing.get(method, 0.0) + time.perf_counter() - started
        print(f"[packing] {cfg} done", file=sys.stderr, flush=True)
    ours = [r for (c, m), r in rows.items() if m == "evenflow"]
    summary = {method: {"critical_path_max": max(r["critical_path"] for (c, m), r in rows.items() if m == method),
                        "critical_path_fitted_max": max(r["critical_path_fitted"] for (c, m), r in rows.items()
                                                        if m == method),
                        "over_bar": sum(r["over_bar"] for (c, m), r in rows.items() if m == method),
                        "steps_over_bound": sum(r["steps"] - r["lower_bound"] for (c, m), r in rows.items()
                                                if m == method),
                        "lost": sum(r["lost"] for (c, m), r in rows.items() if m == method),
                        "repeated": sum(r["repeated"] for (c, m), r in rows.items() if m == method),
                        "seconds": round(timing[method], 1)} for method in METHODS}
    out = {"configurations": len(ours), "summary": summary,
           "fitted_model": {"gamma": fitted.gamma, "alpha": fitted.alpha, "beta": fitted.beta, "per_batch": per_batch},
           "rows": {f"{c} | {m}": r for (c, m), r in rows.items()}}
    if real:
        name, lengths, world, budget = configurations(True)[0]
        out["real"] = {f"{name} W={world} B={budget}": real_check(lengths, world, budget)}
    out["markdown"] = markdown(rows)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="x1 copies only")
    ap.add_argument("--real", action="store_true", help="check the first configuration on real gloo ranks")
    args = ap.parse_args(argv)
    res = run(args.quick, args.real)
    print(res.pop("markdown"))
    print(json.dumps({"benchmark": "packing", **res}))


if __name__ == "__main__":
    main()
