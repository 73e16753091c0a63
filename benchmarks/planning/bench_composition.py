"""What the steps are made of (issue 18): composition beside batching, every policy, simulated and on real ranks.

For each data set and world size (token budget 16,384, the loader's default buffer), every policy's epoch is
scored on batching -- optimizer steps (and the global oracle's), padded efficiency, mean per-step imbalance
(max / mean padded cost) -- and on composition (:mod:`evenflow.sim.composition`): H, H_g, late, q_cv, rough,
timing.

    default    planning="auto" at 2-8 ranks = global planning, stratified mix (issue 18)
    today      global planning as before issue 18 (GlobalPlanConfig(mix="cost_order"))
    local      planning="local" (each rank plans its own buffer)
    balanced   planning="local" with balance=True
    standard   random fixed batches: the largest batch that fits the longest sample, DistributedSampler order

Data: ``chitchat`` = the 4,018 answered chitchat chats through the Qwen3 template (the 9 over the budget cut
to it, as a ``cutoff_len`` of 16,384 would), ``chitchat_x8`` = resampled to 32,144 and cut at 8,192, the four paper shapes (8,000
lengths each). Then:

* the frontier: per-step imbalance against H_g as ``mix_tolerance`` widens the cost bands, next to the bound a
  perfect mix within bands would reach (NOTE [ Stratified steps ]) -- why H_g <= 1 is out of reach at W = 8;
* accumulation: the same token budget per optimizer step split into 2 micro-batches per rank
  (``token_budget=8192, grad_accum_steps=2``) -- a step holds 2W length-homogeneous micro-batches instead of W,
  and the round order (NOTE [ Round order ]) pairs a short one with a long one inside each window;
* the real loader: 4 gloo ranks running ``DynamicBatchLoader`` with its defaults on chitchat x1 (all 7,168
  chats) and hh-rlhf x4, composition and batching of what the ranks really trained; then the same with
  ``token_budget=8192, grad_accum_steps=2``.

    .venv/bin/python benchmarks/planning/bench_composition.py [--quick] [--skip-real]

Prints a markdown report, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.*, <group>.*
from common import baselines as bl  # noqa: E402
from common import real_data  # noqa: E402
from common.world import run_world  # noqa: E402

from evenflow.planning import GroupingConfig  # noqa: E402
from evenflow.planning.pooled.plan import global_groups  # noqa: E402
from evenflow.sim import Schedule, balanced_schedule, evenflow_schedule, global_schedule  # noqa: E402
from evenflow.sim.composition import step_composition  # noqa: E402

BUDGET = 16_384
WORLDS = (2, 4, 8)
POLICIES = ("default", "today", "local", "balanced", "standard")
TOLERANCES = (0.0, 0.02, 0.05, 0.1, 0.2)
REAL_WORLD = 4


def datasets(quick: bool) -> dict[str, np.ndarray]:
    out = {"chitchat": np.minimum(real_data.raw_lengths("chitchat"), BUDGET),
           "chitchat_x8": real_data.load_lengths("chitchat", 32_144)}
    for name in real_data.PAPER_SETS:
        out[name] = real_data.load_lengths(name, 8_000)
    return {k: v for k, v in out.items() if k in ("chitchat", "sharegpt4o")} if quick else out


def batching(schedule: Schedule, lengths: np.ndarray) -> dict:
    """Steps, padded efficiency (real / padded tokens) and mean per-step imbalance (max / mean padded cost)."""
    longest = np.zeros((schedule.num_steps, schedule.world_size))
    count = np.zeros_like(longest)
    np.maximum.at(longest, (schedule.step, schedule.rank), lengths[schedule.sample])
    np.add.at(count, (schedule.step, schedule.rank), 1)
    padded = longest * count
    return {"steps": int(schedule.num_steps), "padded_efficiency": float(lengths[schedule.sample].sum() / padded.sum()),
            "imbalance": float((padded.max(axis=1) / np.maximum(padded.mean(axis=1), 1)).mean())}


def schedules(lengths: np.ndarray, world: int, grouping: GroupingConfig) -> dict[str, Schedule]:
    local = evenflow_schedule(lengths, world_size=world, grouping=grouping)
    return {"default": global_schedule(lengths, world_size=world, grouping=grouping),
            "today": global_schedule(lengths, world_size=world, grouping=grouping, mix="cost_order"),
            "local": local, "balanced": balanced_schedule(local, lengths, token_budget=BUDGET),
            "standard": bl.standard(np.minimum(lengths, BUDGET), world_size=world, token_budget=BUDGET)}


def sim_table(sets: dict[str, np.ndarray]) -> dict:
    out: dict = {}
    grouping = GroupingConfig(token_budget=BUDGET, oversize="alone")
    for name, ls in sets.items():
        for world in WORLDS:
            oracle = bl.oracle(np.minimum(ls, BUDGET), world_size=world, token_budget=BUDGET).num_steps
            row = out.setdefault(name, {})[str(world)] = {"oracle_steps": oracle}
            for policy, s in schedules(ls, world, grouping).items():
                row[policy] = {**batching(s, ls), **{k: float(v) for k, v in step_composition(s, ls).items()}}
            print(f"[composition] {name} W={world} done", file=sys.stderr, flush=True)
    return out


def accumulation(sets: dict[str, np.ndarray]) -> dict:
    """The default with the budget split over 2 accumulated micro-batches: composition per optimizer step."""
    out: dict = {}
    grouping = GroupingConfig(token_budget=BUDGET // 2, oversize="alone")
    for name, ls in sets.items():
        for world in WORLDS:
            s = global_schedule(ls, world_size=world, grouping=grouping, grad_accum_steps=2)
            comp = step_composition(s, ls, grad_accum_steps=2)
            out.setdefault(name, {})[str(world)] = {**batching(s, ls), "steps": int(comp["S"]),
                                                     "over_budget": int((ls > BUDGET // 2).sum()),
                                                     **{k: float(v) for k, v in comp.items() if k != "S"}}
    return out


def _band_bound(times: np.ndarray, keys: np.ndarray, tokens: np.ndarray, world: int, tol: float) -> float:
    """Var of the step key if every cost band (ratio <= 1 + tol, whole steps) were mixed perfectly: each of its
    steps would have the band's token-weighted key. A lower bound for any deal that stays within the bands."""
    g = len(times) // world * world
    order = np.argsort(-times, kind="stable")[:g]
    m = []
    i = 0
    while i < g:
        j = i + world
        while j + world <= g and times[order[i]] <= (1 + tol) * times[order[j + world - 1]]:
            j += world
        band = order[i:j]
        m += [float((keys[band] * tokens[band]).sum() / tokens[band].sum())] * ((j - i) // world)
        i = j
    return float(np.var(m))


def frontier(sets: dict[str, np.ndarray]) -> dict:
    """Imbalance vs H_g over mix_tolerance at W = 4 and 8, and the within-band bound on H_g."""
    out: dict = {}
    rng = np.random.default_rng(0)
    for name in ("chitchat_x8", "sharegpt4o"):
        if name not in sets:
            continue
        ls = sets[name]
        grouping = GroupingConfig(token_budget=BUDGET, oversize="alone")
        groups = global_groups(ls, np.zeros(ls.size, np.int64), grouping)
        times = np.array([len(g) * ls[g].max() for g in groups], dtype=np.float64)
        tokens = np.array([ls[g].sum() for g in groups], dtype=np.float64)
        keys = np.array([float((ls[g] * np.log(ls[g])).sum() / ls[g].sum()) for g in groups])
        for world in (4, 8):
            g = len(groups) // world * world
            deal = np.argsort(-times, kind="stable")[:g]
            random_var = np.mean([np.var((keys[p] * tokens[p]).sum(1) / tokens[p].sum(1))
                                  for p in (rng.permutation(deal).reshape(-1, world) for _ in range(64))])
            for tol in TOLERANCES:
                s = global_schedule(ls, world_size=world, grouping=grouping, mix_tolerance=tol)
                out.setdefault(name, {}).setdefault(str(world), {})[str(tol)] = {
                    "imbalance": batching(s, ls)["imbalance"], "H_g": float(step_composition(s, ls)["H_g"]),
                    "H_g_band_bound": _band_bound(times, keys, tokens, world, tol) / random_var}
    return out


# -- the real loader on 4 gloo ranks ----------------------------------------------------------------------

def _real_rank(rank: int, world: int, lengths: np.ndarray, accum: int = 1) -> list:
    import evenflow
    from loader.bench_loader import TokenLengths

    steps = []
    with evenflow.DynamicBatchLoader(TokenLengths(lengths), token_budget=BUDGET // accum, grad_accum_steps=accum,
                                     seed=0, oversize="alone") as loader:
        for batch in loader:
            steps.append(list(evenflow.pop_step_info(batch).sample_ids))
    return steps


def real_loader(quick: bool) -> dict:
    from evenflow.sim.datasets import chitchat_lengths

    sets = {"chitchat_x1": chitchat_lengths(real_data.CACHE_DIR, min_turns=1)}
    if real_data.available("hh_rlhf")[0]:
        hh = real_data.raw_lengths("hh_rlhf")
        sets["hh_rlhf_x4"] = real_data.load_lengths("hh_rlhf", (1 if quick else 4) * hh.size, cutoff=BUDGET)
    out = {}
    grouping = GroupingConfig(token_budget=BUDGET, oversize="alone")
    for name, ls in sets.items():
        t0 = time.perf_counter()
        today = global_schedule(ls, world_size=REAL_WORLD, grouping=grouping, mix="cost_order")
        oracle = bl.oracle(np.minimum(ls, BUDGET), world_size=REAL_WORLD, token_budget=BUDGET)
        out[name] = {"samples": int(ls.size), "oracle_steps": oracle.num_steps,
                     "today_sim": {**batching(today, ls),
                                   **{k: float(v) for k, v in step_composition(today, ls).items()}}}
        out[name]["over_budget"] = {"1": int((ls > BUDGET).sum()), "2": int((ls > BUDGET // 2).sum())}
        for accum, key in ((1, "real_default"), (2, "real_accum2")):
            per_rank = run_world(_real_rank, REAL_WORLD, ls, accum, timeout=1800)
            n_steps = len(per_rank[0])
            assert all(len(r) == n_steps for r in per_rank), "ranks yielded different step counts"
            s = Schedule.from_steps([[per_rank[r][k] for r in range(REAL_WORLD)] for k in range(n_steps)], REAL_WORLD)
            s.check_exactly_once(ls.size)
            comp = step_composition(s, ls, grad_accum_steps=accum)
            out[name][key] = {**batching(s, ls), "steps": int(comp["S"]),
                              **{k: float(v) for k, v in comp.items() if k != "S"}}
        out[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"[composition] real loader {name} done ({out[name]['wall_s']} s)", file=sys.stderr, flush=True)
    return out


# -- report ------------------------------------------------------------------------------------------------

def _row(name: str, p: dict) -> str:
    return (f"| {name} | {p['steps']} | {p['padded_efficiency']:.3f} | {p['imbalance']:.3f} | {p['H']:.2f} | "
            f"{p['H_g']:.2f} | {p['late']:.2f} | {p['q_cv']:.3f} | {p['rough']:.2f} | {p['timing']:.2f} |")


def markdown(res: dict) -> str:
    head = ["| policy | steps | padded eff. | imbalance | H | H_g | late | q_cv | rough | timing |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    md = ["Random batching: H ~ 1, late ~ 0.25, q_cv a few hundredths, rough ~ 1. H_g <= 1: as mixed as the same "
          "micro-batches dealt at random. rough: how unlike consecutive optimizer steps are (~H for steps in a random "
          "order, up to ~2H alternating). timing: the largest distance from 0.5 of a length tenth's mean position "
          "in the epoch (random: a few hundredths). Goals (issue 18, `default`): H_g <= 1.0, late 0.25 +- 0.03, q_cv <= 0.05; steps / "
          "efficiency / imbalance within 0.005x / 0.006 / 0.01 of `today`.", ""]
    for name, by_w in res["sim"].items():
        for w, row in by_w.items():
            md += [f"**{name}, W = {w}** (global oracle: {row['oracle_steps']} steps)", "", *head]
            md += [_row(p, row[p]) for p in POLICIES if p in row] + [""]
    if res.get("accumulation"):
        md += ["**Accumulation** (the default at `token_budget=8192, grad_accum_steps=2`: the same tokens per optimizer "
               "step in 2W micro-batches; steps = optimizer steps, imbalance per micro-step; `alone` = samples longer than "
               "8,192, trained alone above the micro-batch budget -- where it is not 0 the split is no real option):", "",
               "| data | W | steps (vs W micro-batches) | padded eff. | imbalance | H | H_g | late | q_cv | rough | timing "
               "| alone |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, by_w in res["accumulation"].items():
            for w, p in by_w.items():
                one = res["sim"][name][w]["default"]
                md.append(f"| {name} | {w} | {p['steps']} ({one['steps']}) | {p['padded_efficiency']:.3f} | "
                          f"{p['imbalance']:.3f} | {p['H']:.2f} | {p['H_g']:.2f} | {p['late']:.2f} | {p['q_cv']:.3f} | "
                          f"{p['rough']:.2f} | {p['timing']:.2f} | {p['over_budget']} |")
        md.append("")
    if res.get("frontier"):
        md += ["**Frontier** (`mix_tolerance` -> mean imbalance, H_g, and H_g's bound for a perfect mix inside the "
               "bands):", "", "| data | W | " + " | ".join(str(t) for t in TOLERANCES) + " |",
               "|---|---|" + "---|" * len(TOLERANCES)]
        for name, by_w in res["frontier"].items():
            for w, row in by_w.items():
                md.append(f"| {name} | {w} | " + " | ".join(
                    f"{row[str(t)]['imbalance']:.3f} / {row[str(t)]['H_g']:.2f} (>= {row[str(t)]['H_g_band_bound']:.2f})"
                    for t in TOLERANCES) + " |")
        md.append("")
    if res.get("real"):
        md += [f"**Real loader, {REAL_WORLD} gloo ranks, defaults** (`today` = the pre-issue-18 planner, simulated; "
               "the simulator equals the loader step for step):", "", *head]
        for name, r in res["real"].items():
            alone = r["over_budget"]
            md += [_row(f"{name} default (real, oracle {r['oracle_steps']}; {alone['1']} alone)", r["real_default"]),
                   _row(f"{name} default, 8,192 x accumulation 2 (real; steps = optimizer steps; {alone['2']} alone)",
                        r["real_accum2"]),
                   _row(f"{name} today (sim)", r["today_sim"])]
    return "\n".join(md)


def summary(res: dict) -> dict:
    d = {f"{n}_W{w}": {k: round(row["default"][k], 3)
                       for k in ("H", "H_g", "late", "q_cv", "rough", "timing", "imbalance")}
         for n, by_w in res["sim"].items() for w, row in by_w.items()}
    d.update({f"accum2_{n}_W{w}": {k: round(p[k], 3) for k in ("steps", "H", "H_g", "late", "q_cv", "rough", "timing",
                                                                   "imbalance")}
              for n, by_w in res.get("accumulation", {}).items() for w, p in by_w.items()})
    for n, r in res.get("real", {}).items():
        for key, tag in (("real_default", "real"), ("real_accum2", "real_accum2")):
            d[f"{tag}_{n}"] = {k: round(r[key][k], 3) for k in ("steps", "H", "H_g", "late", "q_cv", "rough", "timing",
                                                                 "imbalance")}
    return d


def run(quick: bool = False, real: bool = True) -> dict:
    sets = datasets(quick)
    res = {"sim": sim_table(sets), "accumulation": accumulation(sets), "frontier": frontier(sets)}
    if real:
        res["real"] = real_loader(quick)
    res["json"] = summary(res)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-real", action="store_true")
    args = ap.parse_args(argv)
    res = run(args.quick, not args.skip_real)
    print(markdown(res))
    print(json.dumps({"benchmark": "composition", **res["json"]}))


if __name__ == "__main__":
    main()
