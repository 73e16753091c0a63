"""DynamicBatchLoader benchmarks (issue 3): batch quality on real chat lengths, and data-path overhead.

    .venv/bin/python benchmarks/loader/bench_loader.py [--quick]

1. Quality. Real chitchat-dataset conversations rendered with the Qwen3 chat template and tokenizer
   (evenflow.data), 4 ranks, token budget 16,384, the loader's default buffer. The loader's batches are
   produced by the same RankPlanner/decide_round code it runs in training, driven in one process
   (evenflow.planning.run_epoch), so these figures are the loader's. Compared with an offline oracle that
   sorts the whole epoch, groups it greedily under the budget and deals groups to ranks in order.
2. Overhead. A real loader (1 rank, 1 worker) against a plain torch DataLoader that delivers *the same
   batches* (batch_sampler = evenflow's groups) with the same worker and collate, each step followed by a
   simulated 20 ms training step; runs alternate, medians. Twice: trainer-bound (real chat lengths, a
   0.5 ms stand-in pipeline) and data-bound (the real template + tokenizer, slower than the step).

3. Real processes (issue 12). 4 gloo processes run the real DynamicBatchLoader with the local policy,
   ``balance=True`` and ``planning="global"`` on chitchat and hh-rlhf resampled x8 (Qwen3 template lengths,
   budget 16,384), next to online-dynamic-batching 0.1.2 (its real grouping code, driven in one process),
   the per-rank oracle, the global oracle and the window-limited oracle (benchmarks/common/baselines.py). Per
   policy: steps, padded efficiency, mean per-step imbalance (max/mean padded cost), payload bytes moved per
   step, and the data-path wall time of the epoch (no training; 4 processes on 2 cores: contended). Then
   the trainer-bound overhead of each policy against a plain DataLoader delivering the same per-rank
   batches, 20 ms per step, on 4 ranks (arms alternated, medians).
4. ``--overhead-only`` (issue 12): plain DataLoader, local and global planning in *one* world, ABBA-interleaved
   (each evenflow arm right next to a plain DataLoader delivering its per-rank batches), >= 5 rounds, a fixed
   synthetic compute time per step (a sleep plus a one-float all_reduce for the lockstep), per-round ratios'
   median, IQR and range, and the load average before and after.

Prints human-readable lines, then one JSON line last (``global_planning``: the real 4-rank global rows).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.*, <group>.*
from common import baselines  # noqa: E402
from common import real_data  # noqa: E402
from common.world import run_world  # noqa: E402

CACHE = Path(__file__).resolve().parents[1] / "results" / ".chitchat_lengths.npy"
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
    """The same figures for a schedule from benchmarks/common/baselines.py (used for online-dynamic-batching)."""
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


# -- 3. real processes: local, balance=True and planning="global" on 4 gloo ranks ---------------------------
REAL_WORLD = 4
REAL_SETS = {"chitchat_x8": "chitchat", "hh_rlhf_x8": "hh_rlhf"}
# Explicit policies: the default, planning="auto", is "global" at 4 ranks (and "local" with balance=True).
POLICIES = {"local": {"planning": "local"}, "balance": {"balance": True}, "global": {"planning": "global"}}
ID_BYTES = 8  # int64 input_ids: the payload that moves (pickled, plus a few dozen bytes per sample)


class TokenLengths(torch.utils.data.Dataset):
    """``input_ids`` of the given lengths and nothing else: the data path itself, no pipeline cost."""

    def __init__(self, lengths: np.ndarray, cost_s: float = 0.0) -> None:
        self.lengths, self.cost_s = lengths, cost_s

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        if self.cost_s:
            end = time.perf_counter() + self.cost_s
            while time.perf_counter() < end:
                pass
        return {"input_ids": torch.full((int(self.lengths[i]),), 7, dtype=torch.long)}


def _real_rank(rank: int, world: int, lengths: np.ndarray, policies: dict) -> dict:
    out = {}
    for name, kwargs in policies.items():
        start = time.perf_counter()
        steps = []
        with evenflow.DynamicBatchLoader(TokenLengths(lengths), token_budget=BUDGET, seed=0, **kwargs) as loader:
            for batch in loader:
                info = evenflow.pop_step_info(batch)
                steps.append((list(info.sample_ids), int(info.padded_tokens), int(info.real_tokens)))
        out[name] = dict(steps=steps, wall_s=time.perf_counter() - start)
    return out


def _real_quality(per_rank: list, lengths: np.ndarray) -> dict:
    """Steps, padded efficiency, mean imbalance and movement of one policy's real run (all ranks)."""
    n_steps = len(per_rank[0])
    assert all(len(r) == n_steps for r in per_rank), "ranks yielded different step counts"
    ids = sorted(i for r in per_rank for s in r for i in s[0])
    assert ids == list(range(len(lengths))), "a sample was lost or repeated"
    padded = np.array([[s[1] for s in r] for r in per_rank], dtype=np.float64)  # [world, steps]
    real = sum(s[2] for r in per_rank for s in r)
    home = np.empty(len(lengths), dtype=np.int64)
    for r, shard in enumerate(baselines._loader_shards(len(lengths), len(per_rank), 0)):
        home[shard] = r
    moved = sum(int(lengths[i]) for r, rows in enumerate(per_rank) for s in rows for i in s[0] if home[i] != r)
    return dict(steps=n_steps, padded_efficiency=real / padded.sum(),
                imbalance=float((padded.max(0) / np.maximum(padded.mean(0), 1)).mean()),
                bytes_moved_per_step=moved * ID_BYTES / n_steps)


def real_rows(lengths: np.ndarray) -> dict:
    res = run_world(_real_rank, REAL_WORLD, lengths, POLICIES, timeout=1500)
    rows = {}
    kw = dict(world_size=REAL_WORLD, token_budget=BUDGET)
    rows["global_oracle"] = schedule_quality(baselines.oracle(lengths, **kw), lengths)
    rows["per_rank_oracle"] = schedule_quality(baselines.per_rank_oracle(lengths, **kw), lengths)
    buffer = AlignmentConfig().buffer_size
    rows[f"window_oracle_buf{buffer}"] = schedule_quality(baselines.window_oracle(lengths, buffer_size=buffer, **kw),
                                                          lengths)
    for name in POLICIES:
        q = _real_quality([r[name]["steps"] for r in res], lengths)
        q["data_path_wall_s"] = max(r[name]["wall_s"] for r in res)
        rows[f"real_{name}"] = q
    if baselines.odb_available()[0]:
        rows["odb_buffer1024"] = schedule_quality(baselines.odb_schedule(lengths, buffer_size=1024, **kw), lengths)
    oracle_steps = rows["global_oracle"]["steps"]
    for q in rows.values():
        q["steps_vs_global_oracle"] = q["steps"] / oracle_steps
    return rows


OVERHEAD_BUDGET = 4096
"""A smaller budget for the overhead rows: ~4 chat samples per batch, so hundreds of 20 ms steps per run
(trainer-bound: the 0.5 ms-per-sample pipeline is ~2 ms of worker time per step)."""


def _overhead_rank(rank: int, world: int, lengths: np.ndarray, kwargs: dict, repeats: int) -> dict:
    ds = TokenLengths(lengths, cost_s=0.0005)
    collate = evenflow.PadCollate()

    def run_evenflow() -> tuple[float, list]:
        start, groups = time.perf_counter(), []
        with evenflow.DynamicBatchLoader(ds, token_budget=OVERHEAD_BUDGET, seed=0, num_workers=1, **kwargs) as loader:
            for batch in loader:
                groups.append(evenflow.pop_step_info(batch).sample_ids)
                time.sleep(STEP_S)
        return time.perf_counter() - start, groups

    def run_plain(groups: list) -> float:
        import torch.distributed as dist

        start = time.perf_counter()
        for _ in DataLoader(ds, batch_sampler=[g for g in groups if g] or [[0]], num_workers=1, collate_fn=collate):
            time.sleep(STEP_S)
        for _ in range(sum(1 for g in groups if not g)):  # an IDLE step still trains (a zero-weight batch)
            time.sleep(STEP_S)
        dist.barrier()  # the step ends for everyone with the slowest rank, as with evenflow's lockstep
        return time.perf_counter() - start

    ours, plain = [], []
    for k in range(repeats):  # ABBA
        if k % 2 == 0:
            t, groups = run_evenflow()
            ours.append(t)
            plain.append(run_plain(groups))
        else:
            plain.append(run_plain(groups))
            ours.append(run_evenflow()[0])
    return dict(ours=ours, plain=plain, steps=len(groups))


def real_overhead(lengths: np.ndarray, repeats: int) -> dict:
    out = {}
    for name, kwargs in POLICIES.items():
        res = run_world(_overhead_rank, REAL_WORLD, lengths, kwargs, repeats, timeout=1500)
        ours = [max(r["ours"][k] for r in res) for k in range(repeats)]
        plain = [max(r["plain"][k] for r in res) for k in range(repeats)]
        ratios = [a / b for a, b in zip(ours, plain)]
        out[name] = dict(steps=res[0]["steps"], evenflow_s=statistics.median(ours), plain_s=statistics.median(plain),
                         ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
    return out


# -- 4. trainer-bound overhead, every arm in one world, ABBA-interleaved (issue 12) ---------------------------
OVERHEAD_ARMS = {"local": {"planning": "local"}, "global": {"planning": "global"}}
"""The evenflow arms; each is paired with a plain DataLoader arm delivering that arm's per-rank batches."""


def _abba_rank(rank: int, world: int, lengths: np.ndarray, rounds: int, step_s: float) -> dict:
    """Every arm in this one world, ``rounds`` times, in ABBA order (``plain_local, local, plain_global, global``
    then reversed). A step is ``step_s`` of synthetic compute (a sleep: the CPU stays free for the data path,
    as under a GPU) and one small all_reduce (the gradient sync that puts ranks in lockstep)."""
    import torch.distributed as dist

    ds = TokenLengths(lengths, cost_s=0.0005)
    collate = evenflow.PadCollate()
    sync = torch.zeros(1)

    def step() -> None:
        time.sleep(step_s)
        dist.all_reduce(sync)

    def run_evenflow(kwargs: dict) -> tuple[tuple[float, float], list]:
        groups, first = [], None
        dist.barrier()
        start = time.perf_counter()
        with evenflow.DynamicBatchLoader(ds, token_budget=OVERHEAD_BUDGET, seed=0, num_workers=1, **kwargs) as ld:
            for batch in ld:
                first = first or time.perf_counter()
                groups.append(evenflow.pop_step_info(batch).sample_ids)
                step()
        end = time.perf_counter()
        return (end - start, end - first), groups

    def run_plain(groups: list) -> tuple[float, float]:
        dist.barrier()
        start, first = time.perf_counter(), None
        real = [g for g in groups if g]
        batches = iter(DataLoader(ds, batch_sampler=real, num_workers=1, collate_fn=collate)) if real else None
        for g in groups:  # IDLE steps stay where evenflow put them: the step still trains (a zero-weight batch)
            if g:
                next(batches)
            first = first or time.perf_counter()
            step()
        end = time.perf_counter()
        return end - start, end - first

    groups = {name: run_evenflow(kw)[1] for name, kw in OVERHEAD_ARMS.items()}  # warm-up; the plain arms' batches
    order = [a for name in OVERHEAD_ARMS for a in (f"plain_{name}", name)]
    times: dict[str, list[float]] = {a: [] for a in order}
    for k in range(rounds):
        for arm in (order if k % 2 == 0 else order[::-1]):
            if arm.startswith("plain_"):
                times[arm].append(run_plain(groups[arm[len("plain_"):]]))
            else:
                t, again = run_evenflow(OVERHEAD_ARMS[arm])
                if again != groups[arm]:
                    raise RuntimeError(f"rank {rank}: the {arm} arm's batches changed between runs")
                times[arm].append(t)
    return dict(times=times, steps={name: len(g) for name, g in groups.items()})


def _spread(values: list[float]) -> dict:
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) >= 2 else (values[0],) * 3
    return {k: round(v, 4) for k, v in dict(median=statistics.median(values), min=min(values), max=max(values),
                                            q1=q1, q3=q3).items()}


def overhead_abba(n: int, rounds: int, world: int, step_s: float = STEP_S) -> dict:
    """Trainer-bound overhead of each planning policy against a plain DataLoader with the same batches:
    per-round ratios (an arm and its plain twin run back to back in the same round), median and spread."""
    import os

    lengths = real_data.load_lengths("chitchat", n, cutoff=OVERHEAD_BUDGET)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    res = run_world(_abba_rank, world, lengths, rounds, step_s, timeout=3000)
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()
    out = {"world": world, "samples": n, "rounds": rounds, "step_ms": step_s * 1e3, "budget": OVERHEAD_BUDGET,
           "cores": os.cpu_count(), "loadavg_before": [round(v, 2) for v in load_before],
           "loadavg_after": [round(v, 2) for v in load_after], "wall_s": round(wall, 1), "arms": {}}
    for name in OVERHEAD_ARMS:
        steps = res[0]["steps"][name]
        out["arms"][name] = dict(steps=steps, synthetic_compute_s=round(steps * step_s, 2))
        # which=0: the whole run (worker start-up and the first round included); 1: from the first batch on
        for which, label in ((0, ""), (1, "_from_first_batch")):
            ours = [max(r["times"][name][k][which] for r in res) for k in range(rounds)]  # the slowest rank
            plain = [max(r["times"][f"plain_{name}"][k][which] for r in res) for k in range(rounds)]
            out["arms"][name].update({f"evenflow_s{label}": _spread(ours), f"plain_s{label}": _spread(plain),
                                      f"ratio{label}": _spread([a / b for a, b in zip(ours, plain)])})
    return out


def print_overhead_abba(ov: dict) -> None:
    busy = ov["loadavg_before"][0] > 0.5 * ov["cores"] or ov["loadavg_after"][0] > 0.5 * ov["cores"]
    print(f"trainer-bound overhead, {ov['world']} ranks, {ov['samples']} chitchat samples, budget {ov['budget']}, "
          f"{ov['step_ms']:.0f} ms synthetic step + all_reduce, {ov['rounds']} ABBA rounds; load average "
          f"{ov['loadavg_before'][0]:.1f} before / {ov['loadavg_after'][0]:.1f} after on {ov['cores']} cores"
          f"{' (contended: other work shares the cores)' if busy else ''}")
    for name, a in ov["arms"].items():
        for label, what in (("", "whole run"), ("_from_first_batch", "from the first batch")):
            r, e, p = a[f"ratio{label}"], a[f"evenflow_s{label}"], a[f"plain_s{label}"]
            print(f"  {name:6s} {a['steps']} steps ({a['synthetic_compute_s']:.1f} s of steps), {what}: evenflow "
                  f"median {e['median']:.2f} s, plain DataLoader {p['median']:.2f} s; per-round ratio median "
                  f"{r['median']:.3f} (IQR {r['q1']:.3f}-{r['q3']:.3f}, range {r['min']:.3f}-{r['max']:.3f})")


def real_section(quick: bool) -> dict:
    result = real_quality_section(quick)
    result["overhead_trainer_bound_4ranks"] = real_overhead_section(quick)
    return result


def real_quality_section(quick: bool) -> dict:
    """Section 3's quality rows (what ``run_all.py`` runs): ~5 minutes on this machine."""
    result = {}
    for key, name in REAL_SETS.items():
        raw = real_data.raw_lengths(name)
        n = (2 if quick else 8) * len(raw)
        lengths = real_data.load_lengths(name, n, cutoff=BUDGET)
        rows = real_rows(lengths)
        for row, q in rows.items():
            moved = f" moved {q['bytes_moved_per_step'] / 1e3:7.1f} kB/step" if "bytes_moved_per_step" in q else ""
            wall = f" wall {q['data_path_wall_s']:.1f} s" if "data_path_wall_s" in q else ""
            print(f"{key:12s} (n={n}) {row:24s} steps {q['steps']:5d} ({q['steps_vs_global_oracle']:.3f}x oracle) "
                  f"padded eff {q['padded_efficiency']:.4f} imbalance {q['imbalance']:.3f}{moved}{wall}")
        result[key] = {"samples": n, **{k: {m: round(float(v), 4) for m, v in q.items()} for k, q in rows.items()}}
    return result


def real_overhead_section(quick: bool) -> dict:
    lengths = real_data.load_lengths("chitchat", 2000 if quick else 6000, cutoff=OVERHEAD_BUDGET)
    ov = real_overhead(lengths, 2 if quick else 4)
    for name, o in ov.items():
        print(f"overhead, trainer-bound, 4 ranks, {name}: {o['steps']} steps x {STEP_S * 1e3:.0f} ms, evenflow "
              f"{o['evenflow_s']:.2f} s vs plain {o['plain_s']:.2f} s, ratio {o['ratio']:.3f} "
              f"[{o['ratio_min']:.3f}, {o['ratio_max']:.3f}] (contended: 4 processes + workers on 2 cores)")
    return {k: {m: round(float(v), 4) for m, v in o.items()} for k, o in ov.items()}


def global_planning_summary(real: dict) -> dict:
    """The ``global_planning`` key of the final JSON line: the real 4-rank global rows per data set."""
    return {key: {"steps_x_global_oracle": real[key]["real_global"]["steps_vs_global_oracle"],
                  "padded_eff": real[key]["real_global"]["padded_efficiency"],
                  "imbalance_mean": real[key]["real_global"]["imbalance"]} for key in REAL_SETS if key in real}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller overhead run")
    parser.add_argument("--real-only", action="store_true", help="only section 3 (real 4-rank processes)")
    parser.add_argument("--overhead-only", action="store_true",
                        help="only section 4: plain DataLoader vs local vs global, ABBA-interleaved in one world")
    parser.add_argument("--world", type=int, default=2, help="ranks for --overhead-only")
    parser.add_argument("--rounds", type=int, default=6, help="ABBA rounds for --overhead-only (>= 5)")
    parser.add_argument("--samples", type=int, default=3000, help="chitchat samples for --overhead-only")
    args = parser.parse_args()
    if args.overhead_only:
        ov = overhead_abba(args.samples, args.rounds, args.world)
        print_overhead_abba(ov)
        print(json.dumps({"overhead_abba": ov}))
        return
    if args.real_only:
        real = real_section(args.quick)
        print(json.dumps({"real_4ranks": real, "global_planning": global_planning_summary(real)}))
        return
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
    result["real_4ranks"] = real_section(args.quick)
    result["global_planning"] = global_planning_summary(result["real_4ranks"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
