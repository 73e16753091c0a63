"""Cluster simulation: every batching policy on every data set, priced by calibrated cost models.

What it measures (all simulated with the package's own planners, :mod:`evenflow.sim`):

1. cost models -- a fit to measured CPU timings of a tiny random-init Qwen3, and FLOP-derived H100 / H20
   coefficients for Qwen3-8B (NOTE [ GPU cost from FLOPs ] in ``evenflow/sim/calibrate.py``);
2. main table -- 8 ranks, token budget 16,384, cutoff 8,192: Standard, Sorted, offline oracle, Packing,
   online-dynamic-batching 0.1.2 (its real grouping code; README default buffer 256 and 1,024), evenflow
   local / balanced / varlen (summed), and a time-balanced proposal; speedup = real tokens per second over
   Standard's;
3. ablations -- token budget, buffer size, round size, length CV, short fraction, epoch size, step overhead;
4. scale -- 8 to 2,560 ranks: per-step imbalance of local vs balanced policies.

Run alone: ``python benchmarks/planning/bench_sim.py [--quick]`` (prints one JSON line last); ``run_all.py`` calls
:func:`run`.
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
from common.sim_setup import (ABLATION_SET, BUDGET, CUTOFF, MAIN_ORDER, OURS, PAPER_SORTED, PAPER_SPEEDUP,  # noqa: E402
                       WORLD)

from evenflow.planning import AlignmentConfig  # noqa: E402
from evenflow.sim import CostModel, simulate  # noqa: E402
from evenflow.sim.calibrate import cpu_cost_model, gpu_cost_model  # noqa: E402
from evenflow.sim.datasets import LengthShape, describe, matched_lengths  # noqa: E402
from evenflow.sim.timefit import fit_time_cost  # noqa: E402

CALIBRATION_SAMPLES = 4000
"""Lengths of the planner's calibration split (seed 1: disjoint draws from the epoch's seed 0)."""


def _log(msg: str) -> None:
    print(f"[bench_sim {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cost_models(quick: bool) -> dict[str, CostModel]:
    cpu = cpu_cost_model(repeats=2 if quick else 3)
    return {"H100": gpu_cost_model("H100"), "H20": gpu_cost_model("H20"), "CPU": cpu}


def _speedups(results: dict, base: str = "standard") -> dict[str, float]:
    ref = results[base].tokens_per_s
    return {k: r.tokens_per_s / ref for k, r in results.items()}


def planner_time_cost(name: str, model: CostModel):
    """The global planner's TimeCost: fitted to noisy timings of ``model`` on a separate calibration split
    (NOTE [ Scoring time balance honestly ]); the simulator still scores with ``model`` itself."""
    return fit_time_cost(model, real_data.load_lengths(name, CALIBRATION_SAMPLES, seed=1, cutoff=CUTOFF))


def main_table(sets: list[str], n: int, models: dict[str, CostModel]) -> dict:
    out = {"datasets": {}, "summary": {}, "speedup": {m: {} for m in models}, "info": {}, "build_s": {}}
    for name in sets:
        lengths = real_data.load_lengths(name, n, cutoff=CUTOFF)
        out["datasets"][name] = describe(lengths)
        t0 = time.perf_counter()
        scheds = bl.all_policies(lengths, world_size=WORLD, token_budget=BUDGET, cost_model=models["H100"],
                                 time_cost=planner_time_cost(name, models["H100"]))
        out["build_s"][name] = time.perf_counter() - t0
        for s in scheds.values():
            if not s.name.startswith("odb"):
                s.check_exactly_once(len(lengths))
        out["info"][name] = {k: s.info for k, s in scheds.items()}
        for mname, model in models.items():
            res = {k: simulate(s, lengths, model) for k, s in scheds.items()}
            out["speedup"][mname][name] = _speedups(res)
            if mname == "H100":
                out["summary"][name] = {k: r.summary() for k, r in res.items()}
        _log(f"main {name}: built in {out['build_s'][name]:.1f}s; evenflow_local "
             f"{out['speedup']['H100'][name]['evenflow_local']:.2f}x, oracle {out['speedup']['H100'][name]['oracle']:.2f}x")
    return out


def _ablate(lengths: np.ndarray, model: CostModel, policies: dict, budget: int = BUDGET) -> dict:
    res = {k: simulate(fn(lengths, budget), lengths, model) for k, fn in policies.items()}
    ref = res["standard"].tokens_per_s if "standard" in res else None
    return {k: {**r.summary(), "speedup": (r.tokens_per_s / ref if ref else None)} for k, r in res.items()}


def _std_policies(balanced: bool = True) -> dict:
    kw = dict(world_size=WORLD)
    pol = {
        "standard": lambda ls, b: bl.standard(ls, token_budget=b, **kw),
        "oracle": lambda ls, b: bl.oracle(ls, token_budget=b, **kw),
        "evenflow_local": lambda ls, b: bl.evenflow_local(ls, token_budget=b, **kw),
    }
    if bl.odb_available()[0]:
        pol["odb_buf1024"] = lambda ls, b: bl.odb_schedule(ls, token_budget=b, buffer_size=1024, **kw)
    if balanced and bl.balance_available():
        pol["evenflow_balanced"] = lambda ls, b: bl.evenflow_balanced(ls, token_budget=b, **kw)
    return pol


def ablations(n: int, model: CostModel, quick: bool) -> dict:
    out: dict = {}
    kw = dict(world_size=WORLD)
    base = real_data.load_lengths(ABLATION_SET, n, cutoff=CUTOFF)
    # token budget (cutoff follows the budget when the budget is smaller, so every sample fits)
    out["budget"] = {}
    for b in (4096, 8192, 16384, 32768):
        ls = np.minimum(base, b)
        out["budget"][b] = _ablate(ls, model, _std_policies(), budget=b)
    _log("ablation budget done")
    # buffer size: evenflow (round size and ageing at defaults) and ODB
    out["buffer"] = {}
    for buf in ((256, 1024, 4096) if quick else (256, 1024, 4096, 16384)):
        al = AlignmentConfig(buffer_size=buf)
        pol = {"standard": lambda ls, b: bl.standard(ls, token_budget=b, **kw),
               "oracle": lambda ls, b: bl.oracle(ls, token_budget=b, **kw),
               "evenflow_local": lambda ls, b, al=al: bl.evenflow_local(ls, token_budget=b, alignment=al, **kw)}
        if buf <= 4096 and bl.odb_available()[0]:
            pol["odb"] = lambda ls, b, buf=buf: bl.odb_schedule(ls, token_budget=b, buffer_size=buf, **kw)
        if bl.balance_available():
            pol["evenflow_balanced"] = lambda ls, b, al=al: bl.evenflow_balanced(ls, token_budget=b, alignment=al,
                                                                                 **kw)
        out["buffer"][buf] = _ablate(base, model, pol)
    _log("ablation buffer done")
    out["round"] = {}
    for t in (1, 2, 4, 8, 16):
        al = AlignmentConfig(max_steps_per_round=t)
        sched = bl.evenflow_local(base, token_budget=BUDGET, alignment=al, **kw)
        r = simulate(sched, base, model)
        out["round"][t] = {**r.summary(), "rounds": sched.info["rounds"]}
    ref = simulate(bl.oracle(base, token_budget=BUDGET, **kw), base, model).tokens_per_s
    for t in out["round"]:
        out["round"][t]["oracle_ratio"] = out["round"][t]["tokens_per_s"] / ref
    _log("ablation round size done")
    out["cv"] = {}
    for cv in (0.25, 0.5, 0.75, 1.0, 1.5):
        ls = matched_lengths(n, LengthShape(mean=1000, cv=cv, cutoff=CUTOFF))
        out["cv"][cv] = {**_ablate(ls, model, _std_policies()), "max_len": int(ls.max())}
    _log("ablation CV done")
    out["short"] = {}
    for p in (0.0, 0.1, 0.2, 0.3, 0.4):
        ls = matched_lengths(n, LengthShape(mean=800, cv=0.8, short_fraction=p, short_mean=128, cutoff=CUTOFF))
        out["short"][p] = {**_ablate(ls, model, _std_policies()), "measured_short": describe(ls)["short_fraction"],
                           "max_len": int(ls.max())}
    _log("ablation short fraction done")
    out["epoch"] = {}
    for size in ((4000, 16000) if quick else (5000, 20000, 80000)):
        ls = real_data.load_lengths(ABLATION_SET, size, cutoff=CUTOFF)
        pol = {k: v for k, v in _std_policies().items() if k != "odb_buf1024"}
        out["epoch"][size] = _ablate(ls, model, pol)
    _log("ablation epoch size done")
    out["warmup"] = warmup_ablation(n, model)
    _log("ablation warm-up done")
    out["keep_home"] = keep_home_ablation(base, model)
    _log("ablation keep-home tolerance done")
    out["overhead"] = {}
    scheds = {"standard": bl.standard(base, token_budget=BUDGET, **kw),
              "oracle": bl.oracle(base, token_budget=BUDGET, **kw),
              "evenflow_local": bl.evenflow_local(base, token_budget=BUDGET, **kw)}
    for ov in (0.0, 0.09, 0.3):
        m = gpu_cost_model("H100", step_overhead=ov)
        res = {k: simulate(s, base, m) for k, s in scheds.items()}
        out["overhead"][ov] = _speedups(res)
    return out


def keep_home_ablation(lengths: np.ndarray, model: CostModel) -> dict:
    """Global planning with ``keep_home_tolerance`` None / 0.02 / 0.05: throughput over the oracle against the
    fraction of tokens trained on another rank than the one that read them (each crosses the all-to-all)."""
    from evenflow.planning import GroupingConfig
    from evenflow.sim.global_policy import global_schedule

    ref = simulate(bl.oracle(lengths, world_size=WORLD, token_budget=BUDGET), lengths, model).tokens_per_s
    tc = planner_time_cost(ABLATION_SET, model)
    out = {}
    for tol in (None, 0.02, 0.05):
        sched = global_schedule(lengths, world_size=WORLD, grouping=GroupingConfig(token_budget=BUDGET), time_cost=tc,
                                keep_home_tolerance=tol)
        r = simulate(sched, lengths, model)
        out[str(tol)] = {"oracle_ratio": r.tokens_per_s / ref, "padded_efficiency": r.padded_efficiency,
                         "moved_token_fraction": sched.info["moved_tokens"] / float(lengths.sum())}
    return out


WARMUP_SETS = ("alpaca", "hh_rlhf", "chitchat", "sharegpt4o")


def warmup_ablation(n: int, model: CostModel) -> dict:
    """evenflow local with the alignment's buffer warm-up (default) and without it, against the oracle."""
    out = {}
    for name in WARMUP_SETS:
        if not real_data.available(name)[0]:
            continue
        ls = real_data.load_lengths(name, n, cutoff=CUTOFF)
        kw = dict(world_size=WORLD, token_budget=BUDGET)
        ref = simulate(bl.oracle(ls, **kw), ls, model)
        row = {"oracle_steps": ref.steps}
        for label, al in (("default", AlignmentConfig()), ("none", AlignmentConfig(warmup_budgets=None))):
            r = simulate(bl.evenflow_local(ls, alignment=al, **kw), ls, model)
            row[label] = {"steps": r.steps, "padded_efficiency": r.padded_efficiency,
                          "oracle_ratio": r.tokens_per_s / ref.tokens_per_s}
        row["default_warmup_budgets"] = AlignmentConfig().warmup_budgets
        out[name] = row
    return out


def scale(per_rank: int, worlds: tuple[int, ...], model: CostModel, sets: tuple[str, ...]) -> dict:
    """Per-step imbalance from 8 to 2,560 ranks, ``per_rank`` samples each (the whole epoch)."""
    out: dict = {}
    for name in sets:
        out[name] = {}
        for w in worlds:
            ls = real_data.load_lengths(name, w * per_rank, cutoff=CUTOFF)
            kw = dict(world_size=w, token_budget=BUDGET)
            t0 = time.perf_counter()
            scheds = {"standard": bl.standard(ls, **kw), "oracle": bl.oracle(ls, **kw),
                      "evenflow_local": bl.evenflow_local(ls, **kw),
                      "evenflow_global": bl.evenflow_global(ls, time_cost=planner_time_cost(name, model), **kw)}
            if bl.balance_available():
                scheds["evenflow_balanced"] = bl.evenflow_balanced(ls, local=scheds["evenflow_local"], **kw)
                scheds["proposal_time_balanced"] = bl.proposal_time_balanced(scheds["evenflow_local"], ls,
                                                                             token_budget=BUDGET, cost_model=model)
            build = time.perf_counter() - t0
            res = {k: simulate(s, ls, model) for k, s in scheds.items()}
            ref = res["oracle"].tokens_per_s
            out[name][w] = {k: {**r.summary(), "median_imbalance": float(np.median(r.step_imbalance)),
                                "time_weighted_imbalance": 1.0 / r.load_efficiency,
                                "oracle_ratio": r.tokens_per_s / ref, "moved": scheds[k].info.get("moved"),
                                "steps_x_oracle": r.steps / res["oracle"].steps}
                            for k, r in res.items()}
            _log(f"scale {name} W={w}: built in {build:.1f}s")
    return out


# -- report ------------------------------------------------------------------------------------------------

def _fmt(x: float, nd: int = 2) -> str:
    return f"{x:.{nd}f}"


def plots(res: dict, out_dir: Path, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    # 1. speedups per dataset
    sp = res["main"]["speedup"]["H100"]
    sets = list(sp)
    methods = [m for m in MAIN_ORDER if m != "standard" and all(m in sp[s] for s in sets)]
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(sets)), 4.2))
    width = 0.8 / len(methods)
    for k, m in enumerate(methods):
        ax.bar(np.arange(len(sets)) + k * width, [sp[s][m] for s in sets], width, label=m)
    for i, s in enumerate(sets):
        if s in PAPER_SPEEDUP:
            ax.hlines(PAPER_SPEEDUP[s], i - 0.1, i + 0.9, colors="k", linestyles="dashed")
    ax.set_xticks(np.arange(len(sets)) + 0.4 - width / 2, sets)
    ax.set_ylabel("speedup over Standard (real tokens/s)")
    ax.set_title(f"Simulated, {WORLD} ranks, H100 cost model (dashed: ODB paper)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    p = out_dir / f"{stem}_speedup.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p.name)
    # 2. ablations
    ab = res["ablations"]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    panels = [("budget", "token budget", True), ("buffer", "buffer size (samples)", True),
              ("cv", "length CV (mean 1000)", False), ("short", "short fraction (CV 0.8)", False),
              ("epoch", "epoch size (samples)", True)]
    for ax, (key, label, logx) in zip(axes.flat, panels):
        xs = list(ab[key])
        for m in ("oracle", "odb_buf1024", "odb", "evenflow_local", "evenflow_balanced"):
            ys = [ab[key][x].get(m, {}).get("speedup") if isinstance(ab[key][x].get(m), dict) else None for x in xs]
            if any(y is not None for y in ys):
                ax.plot([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], "o-", label=m)
        ax.set_xlabel(label)
        ax.set_ylabel("speedup over Standard")
        if logx:
            ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    ax = axes.flat[5]
    ts = list(ab["round"])
    ax.plot(ts, [ab["round"][t]["oracle_ratio"] for t in ts], "o-", label="evenflow_local / oracle")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max steps per round (T cap)")
    ax.set_ylabel("throughput / oracle")
    ax.legend(fontsize=7)
    fig.suptitle(f"Ablations on {ABLATION_SET}-shaped lengths, {WORLD} ranks, H100 cost model")
    fig.tight_layout()
    p = out_dir / f"{stem}_ablations.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p.name)
    # 3. imbalance vs world size
    sc = res["scale"]
    fig, axes = plt.subplots(1, len(sc), figsize=(6 * len(sc), 4), squeeze=False)
    for ax, (name, by_w) in zip(axes.flat, sc.items()):
        ws = list(by_w)
        for m in ("oracle", "evenflow_local", "evenflow_balanced", "proposal_time_balanced"):
            if m in by_w[ws[0]]:
                ax.plot(ws, [by_w[w][m]["time_weighted_imbalance"] for w in ws], "o-", label=m)
        ax.axhline(1.05, color="k", ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel("time-weighted imbalance (sum max / sum mean)")
        ax.set_title(f"{name}, {res['config']['scale_per_rank']} samples per rank")
        ax.legend(fontsize=7)
    fig.tight_layout()
    p = out_dir / f"{stem}_scale.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p.name)
    # 4. calibration fit
    cpu = res["cost_models"]["CPU"]
    timings = cpu["meta"]["timings"]
    ph = cpu["phases"][0]
    pred = [ph["per_batch"] + b * (ph["per_sample"] + ph["per_token"] * ln + ph["per_token_sq"] * ln * ln)
            for b, ln, _ in timings]
    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.loglog([t for _, _, t in timings], pred, "o")
    lim = [min(pred + [t for *_, t in timings]), max(pred + [t for *_, t in timings])]
    ax.plot(lim, lim, "k--", lw=0.8)
    ax.set_xlabel("measured fwd+bwd (s)")
    ax.set_ylabel("fitted model (s)")
    ax.set_title("CPU calibration: tiny Qwen3")
    fig.tight_layout()
    p = out_dir / f"{stem}_calibration.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p.name)
    return paths


def _model_dict(m: CostModel) -> dict:
    return {"source": m.source, "step_overhead": m.step_overhead,
            "phases": [{k: getattr(p, k) for k in ("name", "per_batch", "per_sample", "per_token", "per_token_sq")}
                       for p in m.phases],
            "meta": {k: v for k, v in m.meta.items()}}


def json_summary(res: dict) -> dict:
    sp = res["main"]["speedup"]["H100"]
    speedup = {s: {m: round(x, 3) for m, x in v.items() if m != "standard"} for s, v in sp.items()}
    ratio = {}
    for s, v in sp.items():
        best = max(v[m] for m in OURS if m in v)
        ratio[s] = round(best / v["oracle"], 4)
    packing_ratio = {s: round(v["evenflow_local_summed"] / v["packing"], 4) for s, v in sp.items()}
    global_ratio = {s: round(v["evenflow_global"] / v["oracle"], 4) for s, v in sp.items() if "evenflow_global" in v}
    out = {"speedup_vs_standard": speedup, "oracle_ratio": ratio, "packing_ratio": packing_ratio,
           "global_oracle_ratio": global_ratio,
           "cost_model": "H100 FLOPs x MFU 0.40, Qwen3-8B", "world_size": WORLD, "token_budget": BUDGET}
    sc = res.get("scale", {})
    for name, by_w in sc.items():
        w = max(by_w)
        if "evenflow_balanced" in by_w[w]:
            out.setdefault("balanced_imbalance_max_world", {})[name] = {
                "world": w, "time_weighted": round(by_w[w]["evenflow_balanced"]["time_weighted_imbalance"], 3),
                "median_step": round(by_w[w]["evenflow_balanced"]["median_imbalance"], 3),
                "local_time_weighted": round(by_w[w]["evenflow_local"]["time_weighted_imbalance"], 3)}
        if "evenflow_global" in by_w[w]:
            g = by_w[w]["evenflow_global"]
            out.setdefault("global_at_max_world", {})[name] = {
                "world": w, "time_weighted": round(g["time_weighted_imbalance"], 3), "steps": g["steps"],
                "oracle_steps": by_w[w]["oracle"]["steps"], "oracle_ratio": round(g["oracle_ratio"], 4)}
    return out


def run(*, quick: bool = False, out_dir: Path | None = None, stem: str = "sim") -> dict:
    t_start = time.perf_counter()
    n_main = 8000 if quick else 30000
    n_ablate = 6000 if quick else 20000
    per_rank = 64 if quick else 256
    worlds = (8, 64, 512) if quick else (8, 64, 512, 2560)
    res: dict = {"config": {"world": WORLD, "budget": BUDGET, "cutoff": CUTOFF, "n_main": n_main,
                            "n_ablate": n_ablate, "scale_per_rank": per_rank, "worlds": worlds,
                            "alignment_defaults": AlignmentConfig().__dict__},
                 "skipped": [], "timings_s": {}}
    t0 = time.perf_counter()
    models = cost_models(quick)
    res["cost_models"] = {k: _model_dict(m) for k, m in models.items()}
    res["_cpu_model"] = models["CPU"]  # reused by the real CPU runs' predictions (not serialized)
    res["timings_s"]["calibration"] = time.perf_counter() - t0
    _log(f"cost models ready ({res['timings_s']['calibration']:.0f}s)")
    sets = []
    for name in real_data.PAPER_SETS + real_data.REAL_SETS:
        ok, why = real_data.available(name)
        if ok:
            sets.append(name)
        else:
            res["skipped"].append(why)
            _log(why)
    ok, why = bl.odb_available()
    if not ok:
        res["skipped"].append(why)
        _log(why)
    if quick:
        sets = [s for s in sets if s in ("ultrachat", "sharegpt4o", "chitchat")]
    t0 = time.perf_counter()
    res["main"] = main_table(sets, n_main, models)
    res["timings_s"]["main"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    res["ablations"] = ablations(n_ablate, models["H100"], quick)
    res["timings_s"]["ablations"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    res["scale"] = scale(per_rank, worlds, models["H100"], ("sharegpt4o",) if quick else ("sharegpt4o", "llava"))
    res["timings_s"]["scale"] = time.perf_counter() - t0
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        res["plots"] = plots(res, out_dir, stem)
    res["json"] = json_summary(res)
    res["timings_s"]["total"] = time.perf_counter() - t_start
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small epochs and fewer configurations (development)")
    ap.add_argument("--out-dir", type=Path, default=None, help="write PNG plots here")
    args = ap.parse_args(argv)
    res = run(quick=args.quick, out_dir=args.out_dir)
    from common.report import sim_markdown  # noqa: PLC0415

    print(sim_markdown(res))
    print(json.dumps(res["json"]))


if __name__ == "__main__":
    main()
