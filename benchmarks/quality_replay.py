"""Why evenflow's steps train worse or better at matched optimizer steps: a single-process replay of the demo.

The demo (``evenflow demo``) trains each arm on 2 gloo ranks. Its quality depends only on which samples
each optimizer step holds and in what order, so this script replays those steps in one process (the
exact per-token loss of a step is the same math on one rank as on two) and varies one thing at a time:

    fixed           random steps of 8 samples (the demo's fixed arm: batch 1 x 2 ranks x 4 accumulation)
    evenflow_4096   the planner's steps at the library's default buffer (a rank's whole shard buffered)
    evenflow_128    the same at buffer_size=128 (the demo's setting)
    global_128      global planning (planning="global", the library default at 2 ranks) at buffer_size=128
    shuffled_4096   evenflow_4096's steps in a random order (same steps: isolates the epoch order)
    counts_4096     random samples, in evenflow_4096's per-step sample counts (isolates the composition)
    *_sqrt          with the sqrt token LR rule (evenflow.TokenLRScaler) instead of none
    globalpairrand  global_128's groups, each round's groups re-paired into steps by a seeded permutation
                    (globalpairrandb: a second permutation -- the replay's noise between equivalent arms)
    globalfold      global_128's groups, each round's fewest-sample group paired with its most-sample one
    globalshuf / globalroundshuf   global_128_sqrt's steps shuffled over the epoch / within each round

    .venv/bin/python benchmarks/quality_replay.py                       # every arm, ~25 min on 2 cores
    .venv/bin/python benchmarks/quality_replay.py --arms fixed evenflow_128

Steps come from :func:`evenflow.sim.evenflow_schedule`, which drives the loader's own planner class, so
they are the loader's batches for the demo's seed. Two arms run at a time (one per core). One JSON line
last: ``{"arms": {name: {"heldout_loss", "optimizer_steps", "padded_efficiency"}}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np

ARMS = ("fixed", "fixed_sqrt", "evenflow_4096", "evenflow_128", "evenflow_128_sqrt", "shuffled_4096",
        "counts_4096", "global_128", "global_128_sqrt", "global_64_sqrt", "globalroundshuf_128_sqrt",
        "globalshuf_128_sqrt", "globalpairrand_128_sqrt", "globalpairrandb_128_sqrt", "globalfold_128_sqrt")


def _repair(steps: list[list[list[int]]], round_steps: list[int], mode: str, rng) -> list[list[list[int]]]:
    """Re-pair each round's groups into steps (same groups, so the same padded efficiency and step count).

    ``rand``: a seeded permutation of the round's groups, consecutive pairs form a step. ``fold``: groups sorted
    by sample count, the k-th most with the k-th fewest (every step mixes a few-sample group with a many-sample
    one). Steps keep the round's order by the earliest original step of their groups."""
    out, start = [], 0
    for n in round_steps:
        groups = [(start + t, g) for t in range(n) for g in steps[start + t]]
        world = max(len(steps[start + t]) for t in range(n))
        if len(groups) != n * world or world != 2:  # a round with IDLE slots: leave it
            out += steps[start:start + n]
            start += n
            continue
        if mode == "rand":
            perm = [groups[int(k)] for k in rng.permutation(len(groups))]
            pairs = [perm[2 * j:2 * j + 2] for j in range(n)]
        else:
            srt = sorted(groups, key=lambda x: (len(x[1]), x[0]))
            pairs = [[srt[j], srt[-1 - j]] for j in range(n)]
        pairs.sort(key=lambda p: min(x[0] for x in p))
        out += [[x[1] for x in p] for p in pairs]
        start += n
    return out


def _steps(arm: str, lengths: np.ndarray, seed: int) -> list[list[list[int]]]:
    """The arm's optimizer steps, each a list of padded micro-batches (lists of sample indices)."""
    from evenflow.planning import AlignmentConfig, GroupingConfig
    from evenflow.sim import evenflow_schedule, global_schedule

    rng = np.random.default_rng(seed)
    if arm.startswith("fixed"):
        order = rng.permutation(len(lengths))
        return [[[int(i)] for i in order[j:j + 8]] for j in range(0, len(order), 8)]
    buffer = int(arm.split("_")[1])
    policy = global_schedule if arm.startswith("global") else evenflow_schedule
    schedule = policy(lengths, world_size=2, grouping=GroupingConfig(token_budget=4096),
                      alignment=AlignmentConfig(buffer_size=buffer), seed=seed)
    steps = [[[int(i) for i in g] for g in step if len(g)] for step in schedule.batches()]
    if arm.startswith("globalpairrandb"):  # a second seeded permutation: the arm-to-arm noise of a re-pairing
        return _repair(steps, schedule.info["round_steps"], "rand", np.random.default_rng(seed + 1000))
    if arm.startswith("globalpairrand"):
        return _repair(steps, schedule.info["round_steps"], "rand", rng)
    if arm.startswith("globalfold"):
        return _repair(steps, schedule.info["round_steps"], "fold", rng)
    if arm.startswith("shuffled") or arm.startswith("globalshuf"):
        return [steps[int(k)] for k in rng.permutation(len(steps))]
    if arm.startswith("globalroundshuf"):  # each round's steps in a random order (rounds stay in sequence)
        out, start = [], 0
        for n in schedule.info["round_steps"]:
            out += [steps[start + int(k)] for k in rng.permutation(n)]
            start += n
        return out
    if arm.startswith("counts"):
        order, out, j = rng.permutation(len(lengths)), [], 0
        for step in steps:
            n = sum(len(g) for g in step)
            out.append([[int(i)] for i in order[j:j + n]])
            j += n
        return out
    return steps


def _imbalance(steps, lengths) -> float:
    """Mean over steps of max / mean padded cost of the step's 2 ranks (IDLE ranks count as 0); meaningless for the
    fixed arms, whose 8 micro-batches per step are not ranks."""
    r = []
    for s in steps:
        c = [len(g) * int(lengths[g].max()) for g in s] + [0] * (2 - len(s))
        r.append(max(c) / (sum(c) / len(c)))
    return float(np.mean(r))


def run_arm(arm: str, seed: int = 0) -> dict:
    import torch

    from evenflow.demo.config import DemoConfig, schedule_factor
    from evenflow.demo.prepare import prepare_data
    from evenflow.demo.train import build_model, sum_loss
    from evenflow.runtime import PadCollate

    torch.set_num_threads(1)
    config = DemoConfig(seed=seed)
    data = prepare_data(config)
    steps = _steps(arm, data.lengths, seed)
    tokens = [sum(int(data.loss_tokens[i]) for g in s for i in g) for s in steps]
    reference = round(sum(tokens) / len(tokens))
    model = build_model(config, data.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=config.base_lr, betas=(0.9, 0.95), weight_decay=0.0)
    collate = PadCollate(pad_token_id=0)
    for k, step in enumerate(steps):
        factor = schedule_factor(k, len(steps), config)
        if arm.endswith("_sqrt"):
            factor *= (tokens[k] / reference) ** 0.5
        for group in opt.param_groups:
            group["lr"] = config.base_lr * factor
        for g in step:
            loss, _ = sum_loss(model, collate([data.train[i] for i in g]))
            (loss / tokens[k]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    total = np.zeros(2)
    with torch.no_grad():
        for i in range(len(data.heldout)):
            s = data.heldout[i]
            loss, n = sum_loss(model, {"input_ids": s["input_ids"][None], "labels": s["labels"][None]})
            total += (loss.item(), n)
    padded = sum(len(g) * int(data.lengths[g].max()) for s in steps for g in s)
    return {"arm": arm, "heldout_loss": round(float(total[0] / total[1]), 4), "optimizer_steps": len(steps),
            "padded_efficiency": round(int(data.lengths.sum()) / padded, 4),
            "rank_imbalance": round(_imbalance(steps, data.lengths), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    results = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        for r in pool.map(run_arm, args.arms, [args.seed] * len(args.arms)):
            print(f"{r['arm']:<20} held-out {r['heldout_loss']:.4f}  steps {r['optimizer_steps']}  "
                  f"padded eff {r['padded_efficiency']:.3f}", file=sys.stderr, flush=True)
            results[r.pop("arm")] = r
    print(json.dumps({"benchmark": "quality_replay", "seed": args.seed, "arms": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
