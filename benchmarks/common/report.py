"""Markdown for the benchmark report: tables from the results dicts, and verdicts computed from the numbers."""

from __future__ import annotations

from common.sim_setup import ABLATION_SET, BUDGET, CUTOFF, MAIN_ORDER, OURS, PAPER_SORTED, PAPER_SPEEDUP, WORLD

__all__ = ["sim_markdown", "table"]


def table(header: list[str], rows: list[list[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _pct(x: float) -> str:
    return f"{(x - 1) * 100:+.1f} %"


def cost_model_section(res: dict) -> str:
    rows = []
    for name, m in res["cost_models"].items():
        p = m["phases"][0]
        rows.append([name, f"{p['per_batch']:.3g}", f"{p['per_sample']:.3g}", f"{p['per_token']:.3g}",
                     f"{p['per_token_sq']:.3g}", f"{m['step_overhead']:.3g}", m["source"]])
    cpu = res["cost_models"]["CPU"]["meta"]
    ph = {k: m["phases"][0] for k, m in res["cost_models"].items()}
    skew = (ph["CPU"]["per_token_sq"] / ph["CPU"]["per_token"]) / (ph["H100"]["per_token_sq"] / ph["H100"]["per_token"])
    return "\n".join([
        "Per rank and phase: `per_batch + n x f(max L)` (padded) or `per_batch + sum f(L)` (varlen), "
        "`f(L) = gamma + alpha L + beta L^2`; step = `step_overhead + sum over phases of max over ranks` "
        "(NOTE [ Step time ], `src/evenflow/sim/costs.py`). Seconds:", "",
        table(["model", "per_batch", "gamma", "alpha (/token)", "beta (/token^2)", "step_overhead", "source"], rows),
        "",
        f"CPU fit: {cpu['points']} shapes, mean relative error {cpu['mean_rel_err']:.1%}, max {cpu['max_rel_err']:.1%} "
        "(the machine is shared, so single timings are noisy). The GPU rows follow NOTE [ GPU cost from FLOPs ] in "
        "`src/evenflow/sim/calibrate.py`: Qwen3-8B, 7.57e9 matmul parameters, bf16 dense peaks from NVIDIA "
        "datasheets (H100 SXM 989 TFLOPS, H20 148 TFLOPS) x an assumed MFU of 0.40; the step overhead (ZeRO-2 "
        "gradient reduce-scatter + parameter all-gather + Adam, 0.09 s) and per-batch launch cost (0.01 s) are "
        f"estimates. The tiny CPU model is attention-dominated (its beta/alpha is {skew:.0f}x the 8B model's), a "
        "different regime from the GPU one -- its column shows how conclusions move with the cost shape.",
    ])


def dataset_section(res: dict) -> str:
    rows = []
    for name, d in res["main"]["datasets"].items():
        rows.append([name, d["n"], f"{d['mean']:.0f}", f"{d['median']:.0f}", f"{d['p99']:.0f}", d["max"],
                     f"{d['cv']:.2f}", f"{d['short_fraction']:.2f}"])
    return "\n".join([
        f"All epochs have {res['config']['n_main']:,} samples, clipped at cutoff {CUTOFF:,} (a trainer's cutoff_len). "
        "Paper shapes: seeded log-normal mixtures with the published CV (means and MM-Mix's mix assumed, NOTE "
        "[ Paper-matched shapes ]); real sets: Qwen3 chat template + tokenizer on the real text, resampled to "
        "the epoch size; vidur: prompt + response tokens of a production trace. Short = below 256 tokens.", "",
        table(["data set", "n", "mean", "median", "p99", "max", "CV", "short"], rows),
        *([""] + [f"- skipped: {s}" for s in res["skipped"]] if res["skipped"] else []),
    ])


def main_section(res: dict) -> str:
    sp = res["main"]["speedup"]
    sets = list(sp["H100"])
    methods = [m for m in MAIN_ORDER if all(m in sp["H100"][s] for s in sets)]
    rows = []
    for s in sets:
        rows.append([s] + [sp["H100"][s][m] for m in methods] + [PAPER_SPEEDUP.get(s, "")])
    parts = [f"Speedup over Standard in real tokens per second, {WORLD} ranks, budget {BUDGET:,} tokens per rank, "
             "H100 cost model:", "", table(["data set"] + methods + ["ODB paper"], rows), ""]
    rows = []
    cols = [m for m in ("sorted", "oracle", "packing", "odb_buf256", "odb_buf1024", "evenflow_local",
                        "evenflow_balanced", "evenflow_global") if m in methods]
    for s in sets:
        for model in ("H20", "CPU"):
            rows.append([s, model] + [sp[model][s][m] for m in cols])
    parts += ["The same schedules under the H20 (paper hardware) and CPU-calibrated models:", "",
              table(["data set", "model"] + cols, rows), ""]
    rows = []
    for s in sets:
        for m in methods:
            r = res["main"]["summary"][s][m]
            info = res["main"]["info"][s][m]
            extra = ", ".join(f"{k}={v}" for k, v in info.items() if k in ("batch_size", "missing", "over_budget",
                                                                             "moved", "idle_slots",
                                                                             "token_fallback_steps"))
            rows.append([s, m, r["steps"], r["padded_efficiency"], r["mean_imbalance"], r["p95_imbalance"],
                         1.0 / r["load_efficiency"], r["max_batch_tokens"], extra])
    parts += ["<details><summary>Per policy: steps, padded efficiency (real/padded tokens), per-step imbalance "
              "(max/mean rank time), time-weighted imbalance (sum max / sum mean), largest batch</summary>", "",
              table(["data set", "policy", "steps", "padded eff", "mean imb", "p95 imb", "time-w imb", "max batch tok",
                     "notes"], rows), "", "</details>"]
    return "\n".join(parts)


def verdicts(res: dict) -> str:
    sp = res["main"]["speedup"]["H100"]
    summ = res["main"]["summary"]
    lines = []
    for s, v in sp.items():
        best_name = max(OURS, key=lambda m: v.get(m, 0))
        best = v[best_name]
        r_or = best / v["oracle"]
        odb_best = max((v[m] for m in ("odb_buf256", "odb_buf1024") if m in v), default=None)
        ef, orc = summ[s][best_name], summ[s]["oracle"]
        bits = [f"**{s}**: {best_name} {best:.2f}x over Standard"]
        if s in PAPER_SPEEDUP:
            bits.append(f"({'above' if best >= PAPER_SPEEDUP[s] else 'below'} the paper's {PAPER_SPEEDUP[s]:.2f}x)")
        bits.append(f"; {r_or:.3f} of the offline oracle ({'meets' if r_or >= 0.98 else 'misses'} 0.98: "
                    f"{ef['steps']} vs {orc['steps']} steps, padded efficiency {ef['padded_efficiency']:.3f} vs "
                    f"{orc['padded_efficiency']:.3f}, time-weighted imbalance {1 / ef['load_efficiency']:.3f} vs "
                    f"{1 / orc['load_efficiency']:.3f})")
        if odb_best is not None:
            bits.append(f"; {'ahead of' if best > odb_best else 'BEHIND'} online-dynamic-batching by "
                        f"{_pct(best / odb_best)} (its best buffer)")
        bits.append(f"; vs Sorted {_pct(best / v['sorted'])}")
        if s in PAPER_SORTED:
            bits.append(f" (Sorted here {v['sorted']:.2f}x vs paper {PAPER_SORTED[s]:.2f}x)")
        bits.append(f"; varlen evenflow vs Packing (FFD) {_pct(v['evenflow_local_summed'] / v['packing'])}.")
        lines.append("- " + "".join(bits))
    return "\n".join(lines)


def ablation_section(res: dict) -> str:
    ab = res["ablations"]
    parts = [f"On {ABLATION_SET}-shaped lengths ({res['config']['n_ablate']:,} samples), {WORLD} ranks, H100 model. "
             "Cells: speedup over Standard (oracle ratio = evenflow local throughput / oracle's)."]

    def sweep(key: str, label: str, cols: tuple[str, ...], extra=None) -> str:
        rows = []
        for x, by_m in ab[key].items():
            row = [x] + [by_m[m]["speedup"] if m in by_m else "" for m in cols]
            if "oracle" in by_m and "evenflow_local" in by_m:
                row.append(by_m["evenflow_local"]["tokens_per_s"] / by_m["oracle"]["tokens_per_s"])
            if extra:
                row += extra(by_m)
            rows.append(row)
        hdr = [label] + list(cols) + ["oracle ratio"] + (["notes"] if extra else [])
        return table(hdr, rows)

    cols = tuple(m for m in ("oracle", "odb_buf1024", "evenflow_local", "evenflow_balanced")
                 if m in ab["budget"][next(iter(ab["budget"]))])
    parts += ["", "**Token budget** (cutoff = min(8,192, budget)):", "", sweep("budget", "budget", cols)]
    parts += ["", "**Buffer size** (evenflow: samples per rank before a round; ODB: its `buffer_size`):", "",
              sweep("buffer", "buffer", ("oracle", "odb", "evenflow_local", "evenflow_balanced"),
                    lambda b: [f"evenflow padded eff {b['evenflow_local']['padded_efficiency']:.3f}, steps "
                               f"{b['evenflow_local']['steps']} (oracle {b['oracle']['steps']})"])]
    rows = [[t, r["steps"], r["rounds"], r["padded_efficiency"], r["mean_imbalance"], r["oracle_ratio"]]
            for t, r in ab["round"].items()]
    parts += ["", "**Round size** (`max_steps_per_round`, evenflow local). Depth (`depth`) does not change "
              "batch composition -- batches are a function of seed, config, world size and data -- it only decides "
              "how much exchange latency hides behind training (see the gloo section):", "",
              table(["T cap", "steps", "rounds", "padded eff", "mean imb", "oracle ratio"], rows)]
    parts += ["", "**Length CV** (mean 1,000, log-normal):", "",
              sweep("cv", "CV", cols, lambda b: [f"longest {b['max_len']}"])]
    parts += ["", "**Short fraction** (mean 800, CV 0.8; short component mean 128):", "",
              sweep("short", "short mix", cols,
                    lambda b: [f"measured <256: {b['measured_short']:.2f}, longest {b['max_len']}"])]
    parts += ["", "**Epoch size** (samples; the drain at the epoch end is a roughly fixed number of steps):", "",
              sweep("epoch", "epoch", ("oracle", "evenflow_local", "evenflow_balanced"))]
    if ab.get("warmup"):
        rows = [[name, w["default_warmup_budgets"], w["default"]["steps"], w["none"]["steps"], w["oracle_steps"],
                 w["default"]["padded_efficiency"], w["none"]["padded_efficiency"], w["default"]["oracle_ratio"],
                 w["none"]["oracle_ratio"]] for name, w in ab["warmup"].items()]
        parts += ["", "**Buffer warm-up** (`AlignmentConfig.warmup_budgets`: round r may start once the buffer holds "
                  "(warmup + 8 r) budgets of tokens), evenflow local with the default and with `warmup_budgets=None`:", "",
                  table(["data set", "warm-up", "steps", "steps (none)", "oracle steps", "padded eff",
                         "padded eff (none)", "oracle ratio", "oracle ratio (none)"], rows)]
    if ab.get("keep_home"):
        rows = [[tol, r["oracle_ratio"], r["padded_efficiency"], r["moved_token_fraction"]]
                for tol, r in ab["keep_home"].items()]
        parts += ["", "**Keep-home tolerance** of global planning (`GlobalPlanConfig.keep_home_tolerance`; padded "
                  "cost spent to keep samples on the rank that read them):", "",
                  table(["tolerance", "oracle ratio", "padded eff", "tokens moved (fraction)"], rows)]
    rows = [[ov, v["oracle"], v["evenflow_local"]] for ov, v in ab["overhead"].items()]
    parts += ["", "**Step overhead** of the H100 model (seconds per step; the only assumed GPU number that "
              "favours fewer, fuller steps):", "", table(["overhead", "oracle", "evenflow_local"], rows)]
    return "\n".join(parts)


def scale_section(res: dict) -> str:
    parts = [f"Whole epochs of {res['config']['scale_per_rank']} samples per rank (LLaVA-665k on 2,560 GPUs is "
             "~260 per rank per epoch), H100 model. Imbalance per step = max/mean of rank compute time; "
             "time-weighted = sum of step maxima / sum of step means (the slowdown against perfect balance). "
             "`evenflow_balanced` = `rebalance_step` on padded tokens (the package); `proposal_time_balanced` = "
             "proposal: the package's `padded_partition` on time `f(L)`, token-balanced fallback when the budget "
             "would break; `evenflow_global` = `plan_global_round` over the union of all buffers, steps dealt by a "
             "time cost fitted on a separate calibration split (scored by the H100 model itself)."]
    for name, by_w in res["scale"].items():
        rows = []
        for w, by_m in by_w.items():
            for m, r in by_m.items():
                rows.append([w, m, r["steps"], r["mean_imbalance"], r["median_imbalance"], r["p95_imbalance"],
                             r["time_weighted_imbalance"], r["oracle_ratio"], r["moved"] if r["moved"] is not None else ""])
        parts += ["", f"**{name}**:", "", table(["ranks", "policy", "steps", "mean imb", "median imb", "p95 imb",
                                                   "time-w imb", "oracle ratio", "samples moved"], rows)]
    return "\n".join(parts)


def sim_markdown(res: dict) -> str:
    return "\n\n".join([
        "## Cost models", cost_model_section(res),
        "## Data sets", dataset_section(res),
        f"## Simulated training at {WORLD} ranks", main_section(res),
        "### Verdicts (computed from the table)", verdicts(res),
        "## Ablations", ablation_section(res),
        "## Scale: 8 to 2,560 ranks", scale_section(res),
    ])
