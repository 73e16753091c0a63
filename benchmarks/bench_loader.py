"""DynamicBatchLoader benchmarks (issue 3): batch quality on real chat lengths, and data-path overhead.

    .venv/bin/python benchmarks/bench_loader.py [--quick]

1. Quality. Real chitchat-dataset conversations rendered with the Qwen3 chat template and tokenizer
   (evenflow.data), 4 ranks, token budget 16,384, the loader's default buffer. The loader's batches are
   produced by the same RankPlanner/decide_round code it runs in training, driven in one process
   (evenflow.planning.run_epoch), so these figures are the loader's. Compared with an offline oracle that
   sorts the whole epoch, groups it greedily under the budget and deals groups to ranks in order.
2. Overhead. A real loader (1 rank, 1 worker) against a plain torch DataLoader that delivers *the same
   batches* (batch_sampler = evenflow's groups) with the same worker and collate, each step followed by a
   simulated 20 ms training step; runs alternate, medians. Twice: trainer-bound (real chat lengths, a
   0.5 ms stand-in pipeline) and data-bound (the real template + tokenizer, slower than the step).

Prints human-readable lines, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

import evenflow
from evenflow.planning import AlignmentConfig, GroupingConfig, SampleMeta, make_planners, plan_groups, run_epoch

sys.path.insert(0, str(Path(__file__).parent))
import baselines  # noqa: E402  (benchmarks/ is not a package)

CACHE = Path(__file__).with_name("results") / ".chitchat_lengths.npy"
BUDGET = 16_384
STEP_S = 0.020


def chitchat_lengths() -> np.ndarray:
    """Realized lengths of every chitchat conversation (>= 2 turns) through the Qwen3 template."""
    if CACHE.exists():
        return np.load(CACHE)
    from evenflow.data import ChatDataset, chitchat_conversations
    ds = ChatDataset(chitchat_conversations(), cutoff=BUDGET)
    lengths = np.array([len(ds[i]["input_ids"]) for i in range(len(ds))], dtype=np.int64)
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    np.save(CACHE, lengths)
    return lengths


def protocol_quality(lengths: np.ndarray, world: int, buffer_size: int, seed: int = 0) -> dict:
    alignment = AlignmentConfig(buffer_size=buffer_size)
    planners = make_planners(world, GroupingConfig(token_budget=BUDGET), alignment, seed=seed)
    order = np.random.default_rng([seed, 0]).permutation(len(lengths))  # the loader's shuffle + shard
    shards = [order[r::world] for r in range(world)]
    streams = [iter([SampleMeta(int(i), int(lengths[i])) for i in s]) for s in shards]
    trace = run_epoch(planners, streams, unread=[len(s) for s in shards])
    padded = np.array([[len(s) * max(it.length for it in s) if s else 0 for s in step] for step in trace.steps])
    real = sum(it.length for step in trace.steps for s in step for it in s)
    imbalance = padded.max(axis=1) / np.maximum(padded.mean(axis=1), 1)
    return dict(steps=len(trace.steps), padded_efficiency=real / padded.sum(), imbalance=float(imbalance.mean()),
                idle_slots=int(sum(1 for step in trace.steps for s in step if not s)))


def schedule_quality(schedule, lengths: np.ndarray) -> dict:
    """The same figures for a schedule from benchmarks/baselines.py (used for online-dynamic-batching)."""
    padded = np.zeros((schedule.num_steps, schedule.world_size))
    longest = np.zeros_like(padded)
    count = np.zeros_like(padded)
    np.maximum.at(longest, (schedule.step, schedule.rank), lengths[schedule.sample])
    np.add.at(count, (schedule.step, schedule.rank), 1)
    padded = longest * count
    imbalance = padded.max(axis=1) / np.maximum(padded.mean(axis=1), 1)
    return dict(steps=schedule.num_steps, padded_efficiency=float(lengths[schedule.sample].sum() / padded.sum()),
                imbalance=float(imbalance.mean()), missing=int(schedule.info.get("missing", 0)))


def oracle_quality(lengths: np.ndarray, world: int) -> dict:
    groups = plan_groups(lengths, token_budget=BUDGET)  # whole epoch known: optimal contiguous grouping
    costs = np.array([len(g) * lengths[g].max() for g in groups])
    costs = np.concatenate([costs, np.zeros(-len(costs) % world)])
    per_step = costs.reshape(-1, world)  # deal groups to ranks in sorted order: step t gets groups tW..tW+W-1
    return dict(steps=per_step.shape[0], padded_efficiency=float(lengths.sum() / costs.sum()),
                imbalance=float((per_step.max(1) / per_step.mean(1)).mean()))


class LengthDataset(torch.utils.data.Dataset):
    """Samples of given real lengths whose pipeline costs ``cost_s`` of CPU each (a stand-in tokenizer)."""

    def __init__(self, lengths: np.ndarray, cost_s: float) -> None:
        self.lengths, self.cost_s = lengths, cost_s

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        end = time.perf_counter() + self.cost_s
        while time.perf_counter() < end:
            pass
        ids = torch.full((int(self.lengths[i]),), 7, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}


def overhead(ds: torch.utils.data.Dataset, budget: int, repeats: int) -> dict:
    """Wall time of evenflow vs a plain DataLoader delivering the same batches, 20 ms per training step."""
    with evenflow.DynamicBatchLoader(ds, token_budget=budget, num_workers=1, seed=0) as loader:
        groups = [evenflow.pop_step_info(b).sample_ids for b in loader]
    collate = evenflow.PadCollate()

    def run_evenflow() -> float:
        start = time.perf_counter()
        with evenflow.DynamicBatchLoader(ds, token_budget=budget, num_workers=1, seed=0) as ld:
            for batch in ld:
                evenflow.pop_step_info(batch)
                time.sleep(STEP_S)
        return time.perf_counter() - start

    def run_plain() -> float:
        start = time.perf_counter()
        for _ in DataLoader(ds, batch_sampler=groups, num_workers=1, collate_fn=collate):
            time.sleep(STEP_S)
        return time.perf_counter() - start

    ours, plain = [], []
    for _ in range(repeats):
        ours.append(run_evenflow())
        plain.append(run_plain())
    return dict(steps=len(groups), evenflow_s=statistics.median(ours), plain_s=statistics.median(plain),
                ratio=statistics.median(ours) / statistics.median(plain))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller overhead run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = chitchat_lengths()
    cv = lengths.std() / lengths.mean()
    print(f"chitchat via Qwen3 template: {len(lengths)} conversations, mean {lengths.mean():.0f}, "
          f"median {np.median(lengths):.0f}, CV {cv:.2f}, max {lengths.max()}")
    # 57k samples: the real length distribution resampled (with replacement) to the size the issue names.
    big = np.random.default_rng(1).choice(lengths, 57_000, replace=True)
    result: dict = {"dataset": {"conversations": int(len(lengths)), "cv": round(float(cv), 3)}}
    for name, data in (("chitchat_real", lengths), ("chitchat_57k_resampled", big)):
        oracle = oracle_quality(data, 4)
        rows = {"oracle": oracle}
        for buffer_size in (1024, AlignmentConfig().buffer_size):
            q = protocol_quality(data, 4, buffer_size)
            q["steps_vs_oracle"] = q["steps"] / oracle["steps"]
            rows[f"evenflow_buffer{buffer_size}"] = q
        available = baselines.odb_available()[0]
        balanced = baselines.evenflow_balanced(data, world_size=4, token_budget=BUDGET)  # balance=True's planner
        q = schedule_quality(balanced, data)
        q["steps_vs_oracle"] = q["steps"] / oracle["steps"]
        rows["evenflow_balanced"] = q
        if available:  # online-dynamic-batching 0.1.2 (pip install 'evenflow[bench]'), its real grouping code
            for buffer_size in (256, 1024):  # its README default (64 x 4), and a larger buffer
                sched = baselines.odb_schedule(data, world_size=4, token_budget=BUDGET, buffer_size=buffer_size)
                q = schedule_quality(sched, data)
                q["steps_vs_oracle"] = q["steps"] / oracle["steps"]
                rows[f"odb_buffer{buffer_size}"] = q
        else:
            print("online-dynamic-batching not installed (pip install 'evenflow[bench]'): its rows are skipped")
        for key, q in rows.items():
            extra = f" steps/oracle {q['steps_vs_oracle']:.3f}" if "steps_vs_oracle" in q else ""
            print(f"{name:24s} {key:20s} steps {q['steps']:5d} padded eff {q['padded_efficiency']:.4f} "
                  f"imbalance {q['imbalance']:.3f}{extra}")
        result[name] = {k: {m: round(float(v), 4) for m, v in q.items()} for k, q in rows.items()}
    # Trainer-bound: real chat lengths, a 0.5 ms stand-in pipeline (data arrives faster than 20 ms steps).
    synthetic = LengthDataset(big[: 4000 if args.quick else 12000], cost_s=0.0005)
    ov = overhead(synthetic, BUDGET, 1 if args.quick else 3)
    print(f"overhead, trainer-bound ({ov['steps']} steps x {STEP_S * 1e3:.0f} ms): evenflow {ov['evenflow_s']:.2f} s, "
          f"plain DataLoader with the same batches {ov['plain_s']:.2f} s, ratio {ov['ratio']:.3f}")
    result["overhead_trainer_bound"] = {k: round(float(v), 4) for k, v in ov.items()}
    # Data-bound: the real template + tokenizer in one worker (slower than the simulated step).
    from evenflow.data import ChatDataset, chitchat_conversations
    real = ChatDataset(chitchat_conversations()[: 300 if args.quick else 1200], cutoff=4096)
    ov = overhead(real, 4096, 1 if args.quick else 3)
    print(f"overhead, data-bound real pipeline ({ov['steps']} steps): evenflow {ov['evenflow_s']:.2f} s, plain "
          f"{ov['plain_s']:.2f} s, ratio {ov['ratio']:.3f}")
    result["overhead_data_bound"] = {k: round(float(v), 4) for k, v in ov.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
