"""Per-phase balance of a three-modality MLLM on real media: no balancing vs LLM-only vs full orchestration.

Run:  python benchmarks/vlm/bench_mllm.py [--quick]       (prints lines, then ONE JSON line last)

1. **4 real gloo ranks** (CPU): the real pipeline (:class:`evenflow.data.multimodal.MultimodalChatDataset`,
   default mix) in DataLoader workers -> ``DynamicBatchLoader`` (summed tokens + patch and frame budgets) ->
   the tiny MLLM, orchestrated. Every step runs the three arms on the *same* batches, in rotating order
   (ABC, BCA, CAB, ...). Phase times are CPU times of forward + backward (NOTE [ Per-phase times ] in
   ``evenflow.testing.mllm_step``). Imbalance of a phase = sum over steps of the slowest rank's time / sum of
   the mean rank's time. Step time (critical path) = sum over steps of max(vision + audio) + max(LLM) +
   max(plan + routing): each phase ends in an exchange, so the slowest rank sets it.
2. **Simulated 64 and 2,560 ranks**: per-rank batches packed from the real samples' measured (length,
   patches, frames) under the same budgets, planned by the package's ``plan_step``; phase loads from a
   per-phase ``gamma + alpha L + beta L^2`` fitted to this machine's measured encoder/LLM times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.*, <group>.*

from common.world import run_world  # noqa: E402

ARMS = ("none", "llm", "full", "windowed")
ARM_LABEL = {"none": "no balancing", "llm": "LLM-only balancing", "full": "full orchestration",
             "windowed": "full, audio in 4 s windows"}
AUDIO_WINDOW = 400
"""Frames per audio item in the ``windowed`` arm (4 s, Whisper-style fixed windows): a long clip becomes
several items that can be encoded on different ranks (exact for the row-wise tiny encoder)."""
PHASES = ("vision", "audio", "llm")
GOAL_IMBALANCE = 1.05
GOAL_OVERHEAD = 0.02
MODEL = dict(d_model=96, n_layers=3, n_heads=4, vocab_size=512)
BUDGETS = dict(token_budget=1536, num_patches=4096, num_frames=6000)
SIM_WORLDS = (64, 2560)


# -- calibration: fit each phase's cost on this machine --------------------------------------------------------

def _time_fwd_bwd(fn, repeats: int = 5) -> float:
    """Fastest of ``repeats`` forward+backward CPU times: contention only ever adds time."""
    best = []
    for _ in range(repeats):
        t0 = time.thread_time()
        out = fn()
        out.sum().backward()
        best.append(time.thread_time() - t0)
    return min(best)


def calibrate(model, cfg) -> dict:
    """Per-phase cost from forward+backward CPU times at several sizes (one process).

    The encoders work row-wise on all of a rank's items in one call, so k items of n_i rows cost
    ``c + alpha * sum(n_i)`` (+ beta for any superlinear part): ``c`` is per *call*, paid by every rank every
    step (also with zero rows), so it cannot be balanced and is left out of the per-item planning cost
    (``gamma = 0``). The LLM runs one sequence per example: its ``gamma`` is a real per-example cost.
    """
    import torch

    from evenflow.balance import QuadraticCost, fit_quadratic
    from evenflow.exchange import LLMInputs

    g = torch.Generator().manual_seed(0)
    out, per_call = {}, {}
    for phase, dim, sizes in (("vision", cfg.patch_dim, (64, 256, 768, 1536, 2048, 4096)),
                              ("audio", cfg.n_mels, (80, 200, 400, 800, 1600, 3200))):
        enc = model.encoders()[phase]
        times = [_time_fwd_bwd(lambda n=n: enc(torch.randn(n, dim, generator=g), [n])) for n in sizes]
        fit = fit_quadratic(sizes, times)
        out[phase] = QuadraticCost(gamma=0.0, alpha=fit.alpha, beta=fit.beta)
        per_call[phase] = fit.gamma
    lengths = (32, 64, 128, 256, 512, 1024, 1536)

    def llm(n: int):
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=g)
        batch = LLMInputs(example_ids=[0], input_ids=[ids], labels=[ids],
                          media={p: torch.zeros(0, cfg.d_model) for p in ("vision", "audio")},
                          media_counts={"vision": [0], "audio": [0]}, total_loss_tokens=n)
        return model.lm_loss_sum(batch)

    out["llm"] = fit_quadratic(lengths, [_time_fwd_bwd(lambda n=n: llm(n)) for n in lengths])
    return {"costs": out, "per_call_s": per_call}


def _bound(plan, phase: str) -> tuple[float, float]:
    """(lower bound on the max load, mean load) of one phase: no plan beats max(mean, largest item)."""
    c = plan.phase_costs[phase]
    mean = float(c.sum()) / plan.world
    return (max(mean, float(c.max())) if c.size else 0.0), mean


# -- the 4-rank run ------------------------------------------------------------------------------------------

def _rank_main(rank: int, world: int, num_samples: int) -> dict:
    import torch
    import torch.distributed as dist

    from evenflow import DynamicBatchLoader, pop_step_info
    from evenflow.exchange import GlobalOrchestrator
    from evenflow.data import QwenChatTokenizer, chitchat_conversations
    from evenflow.data.audio import AUDIO_PAD_ID
    from evenflow.data.multimodal import MediaCollate, MultimodalChatDataset
    from evenflow.testing import (TinyMLLM, TokenFold, example_from_sample, orchestrated_step, orchestrator_config,
                                 real_media_config)

    torch.set_num_threads(1)
    cfg = real_media_config(max_len=2048, **MODEL)
    torch.manual_seed(0)
    model = TinyMLLM(cfg)
    calib = [calibrate(model, cfg) if rank == 0 else None]
    dist.broadcast_object_list(calib, src=0)  # one cost model, the same on every rank
    costs = calib[0]["costs"]
    group = dist.new_group(backend="gloo")
    modes = {"none": dict(balance=False), "llm": dict(balance_encoders=False), "full": {}, "windowed": {}}
    orchs = {arm: GlobalOrchestrator(orchestrator_config(cfg, vision_cost=costs["vision"], audio_cost=costs["audio"],
                                                         llm_cost=costs["llm"], **modes[arm]), group=group)
             for arm in ARMS}
    fold = TokenFold(image_pad_id=QwenChatTokenizer().token_id("<|image_pad|>"), audio_pad_id=AUDIO_PAD_ID, config=cfg)
    dataset = MultimodalChatDataset(chitchat_conversations()[:num_samples], num_samples=num_samples, cutoff=2048)
    # planning="local": the orchestrator balances each step's phases itself over the groups every rank formed;
    # the figures in benchmarks/results/2026-12-01_*_mllm.md were measured so (global planning is not).
    loader = DynamicBatchLoader(dataset, collate_fn=MediaCollate(), cost="summed", num_workers=1, buffer_size=64,
                                token_budget=BUDGETS["token_budget"], planning="local",
                                extra_budgets={"num_patches": BUDGETS["num_patches"],
                                               "num_frames": BUDGETS["num_frames"]})
    steps, profile = [], []
    for k, batch in enumerate(loader):
        info = pop_step_info(batch)
        samples = [] if info.is_idle else batch["samples"]
        local = [example_from_sample(s, fold) for s in samples]
        windowed = [example_from_sample(s, fold, audio_window=AUDIO_WINDOW) for s in samples]
        profile += [(len(s["input_ids"]), int(s["num_patches"]), int(s["num_frames"])) for s in samples]
        row = {}
        for arm in ARMS[k % len(ARMS):] + ARMS[:k % len(ARMS)]:  # rotate the order: no arm always runs first
            model.zero_grad()
            res = orchestrated_step(model, orchs[arm], windowed if arm == "windowed" else local)
            t = res.times
            vec = torch.tensor([t.vision, t.audio, t.llm, t.plan, t.routing, res.wall_s,
                                res.encoded_items["vision"], res.encoded_items["audio"], res.llm_examples],
                               dtype=torch.float64)
            gathered = [torch.empty_like(vec) for _ in range(world)]
            dist.all_gather(gathered, vec)
            row[arm] = torch.stack(gathered).numpy()
            if arm in ("full", "windowed"):
                loads = res.plan.phase_loads()
                row[f"bound_{arm}"] = {p: _bound(res.plan, p) for p in PHASES}
                row[f"planned_{arm}"] = {p: (float(loads[p][1].max()), float(loads[p][1].mean())) for p in PHASES}
        steps.append(row)
    loader.close()
    everyone = [None] * world
    dist.all_gather_object(everyone, profile)
    return {"steps": steps, "profile": [p for per in everyone for p in per], "costs": costs,
            "per_call_s": calib[0]["per_call_s"]}


def _summarize(steps: list[dict], world: int, warmup: int = 1) -> dict:
    steps = steps[warmup:]
    out = {}
    for arm in ARMS:
        mats = np.stack([s[arm] for s in steps])  # [steps, ranks, 9]
        phase = {p: mats[:, :, i] for i, p in enumerate(PHASES)}
        imb = {p: float(phase[p].max(1).sum() / phase[p].mean(1).sum()) if phase[p].sum() else 1.0 for p in PHASES}
        overhead = (mats[:, :, 3] + mats[:, :, 4]).max(1)
        crit = (phase["vision"] + phase["audio"]).max(1) + phase["llm"].max(1) + overhead
        out[arm] = {"imbalance": imb, "critical_path_s": float(crit.sum()),
                    "median_step_ms": 1e3 * float(np.median(crit)),
                    "median_wall_ms": 1e3 * float(np.median(mats[:, :, 5].max(1))),
                    "plan_routing_ms": 1e3 * float(np.median(overhead)),
                    "overhead_fraction": float(overhead.sum() / crit.sum())}
    full = np.stack([s["full"] for s in steps])
    out["steps"] = len(steps)
    for arm in ("full", "windowed"):
        for key in ("bound", "planned"):
            out[f"{key}_{arm}"] = {p: sum(s[f"{key}_{arm}"][p][0] for s in steps)
                                   / max(sum(s[f"{key}_{arm}"][p][1] for s in steps), 1e-300) for p in PHASES}
    out["few_items_share"] = {p: float((full[:, :, 6 + i].sum(1) < world).mean()) for i, p in
                              enumerate(("vision", "audio"))}
    out["few_items_share"]["llm"] = float((full[:, :, 8].sum(1) < world).mean())
    return out


# -- the simulation at 64 / 2,560 ranks ------------------------------------------------------------------------

def _pack(profile: np.ndarray, rng: np.random.Generator, world: int) -> list[list[tuple[int, int, int]]]:
    """Per-rank batches: random samples added while every budget holds (what the loader's grouping enforces)."""
    limits = np.array([BUDGETS["token_budget"], BUDGETS["num_patches"], BUDGETS["num_frames"]])
    out = []
    for _ in range(world):
        used, batch = np.zeros(3, np.int64), []
        for i in rng.permutation(len(profile)):
            if (used + profile[i] > limits).any():
                if batch:
                    break
                continue
            used += profile[i]
            batch.append(tuple(int(v) for v in profile[i]))
        out.append(batch)
    return out


def simulate(profile: list, costs: dict, worlds=SIM_WORLDS, steps: dict | None = None) -> dict:
    from evenflow.balance import BalanceConfig
    from evenflow.balance.phases import ExampleMeta, OrchestratorConfig, PhaseSpec, plan_step
    from evenflow.testing import split_rows

    steps = steps or {64: 20, 2560: 3}
    prof = np.asarray(profile, dtype=np.int64)
    # One node per 8 ranks would only permute balanced buckets (bytes moved, not balance): skip the assignment.
    bc = BalanceConfig(node_assignment=False)
    cfg = OrchestratorConfig(encoders={"vision": PhaseSpec(cost=costs["vision"], input_dim=1176, downsample=4, balance=bc),
                                       "audio": PhaseSpec(cost=costs["audio"], input_dim=80, downsample=4, balance=bc)},
                             llm=PhaseSpec(cost=costs["llm"], balance=bc))
    out = {}
    for world in worlds:
        rng = np.random.default_rng(world)
        sums = {arm: {p: [0.0, 0.0] for p in PHASES} for arm in ARMS}
        crit = {arm: 0.0 for arm in ARMS}
        plan_s = []
        few = {p: 0 for p in PHASES}
        bound = {p: [0.0, 0.0] for p in PHASES}
        for _ in range(steps[world]):
            batches = _pack(prof, rng, world)
            meta = [[ExampleMeta(L, 1, ((P,) if P else (), (F,) if F else ())) for L, P, F in b] for b in batches]
            t0 = time.perf_counter()
            plan = plan_step(meta, cfg)
            plan_s.append(time.perf_counter() - t0)
            loads = plan.phase_loads()
            meta_w = [[ExampleMeta(L, 1, ((P,) if P else (), tuple(split_rows(F, AUDIO_WINDOW, 4)) if F else ()))
                       for L, P, F in b] for b in batches]
            loads_w = plan_step(meta_w, cfg).phase_loads()
            for p in PHASES:
                n_items = plan.items[p].example.size if p != "llm" else plan.source.size
                few[p] += n_items < world
                lb, mean = _bound(plan, p)
                bound[p][0] += lb
                bound[p][1] += mean
            for arm in ARMS:
                chosen = {p: loads[p][1] if arm == "full" or (arm == "llm" and p == "llm") else loads[p][0]
                          for p in PHASES}
                if arm == "windowed":
                    chosen = {p: loads_w[p][1] for p in PHASES}
                for p in PHASES:
                    sums[arm][p][0] += float(chosen[p].max())
                    sums[arm][p][1] += float(chosen[p].mean())
                crit[arm] += float((chosen["vision"] + chosen["audio"]).max() + chosen["llm"].max())
        out[world] = {arm: {"imbalance": {p: s[0] / s[1] if s[1] else 1.0 for p, s in sums[arm].items()},
                            "modelled_step_s": crit[arm] / steps[world]} for arm in ARMS}
        out[world]["plan_ms"] = 1e3 * statistics.median(plan_s)
        out[world]["steps"] = steps[world]
        out[world]["few_items_share"] = {p: few[p] / steps[world] for p in PHASES}
        out[world]["bound"] = {p: b[0] / b[1] if b[1] else 1.0 for p, b in bound.items()}
    return out


def run(quick: bool = False) -> dict:
    num_samples = 96 if quick else 768
    t0 = time.perf_counter()
    results = run_world(_rank_main, 4, num_samples, timeout=1500.0)
    real = _summarize(results[0]["steps"], 4)
    costs = results[0]["costs"]
    sim = simulate(results[0]["profile"], costs, steps={64: 8, 2560: 2} if quick else None)
    prof = np.asarray(results[0]["profile"])
    return {"real": real, "sim": {str(k): v for k, v in sim.items()}, "samples": int(prof.shape[0]),
            "costs": {p: (c.gamma, c.alpha, c.beta) for p, c in costs.items()}, "per_call_s": results[0]["per_call_s"],
            "profile_stats": {"mean_length": float(prof[:, 0].mean()), "image_share": float((prof[:, 1] > 0).mean()),
                              "audio_share": float((prof[:, 2] > 0).mean()),
                              "mean_patches_per_image": float(prof[prof[:, 1] > 0, 1].mean()),
                              "mean_frames_per_clip": float(prof[prof[:, 2] > 0, 2].mean())},
            "model": MODEL, "budgets": BUDGETS, "wall_s": time.perf_counter() - t0}


def goals(res: dict) -> dict:
    full = res["real"]["full"]
    sim = res["sim"][str(max(SIM_WORLDS))]
    out = {"overhead_ok": full["overhead_fraction"] <= GOAL_OVERHEAD}
    for arm in ("full", "windowed"):
        out[f"real_4_{arm}_ok"] = {p: res["real"][arm]["imbalance"][p] <= GOAL_IMBALANCE for p in PHASES}
        out[f"sim_2560_{arm}_ok"] = {p: sim[arm]["imbalance"][p] <= GOAL_IMBALANCE for p in PHASES}
    return out


def markdown(res: dict) -> str:
    r, g = res["real"], goals(res)
    ps = res["profile_stats"]
    lines = [f"Real mix: {res['samples']} samples of the builder's default mix (chitchat + scikit-image photos + "
             f"eSpeak NG speech; {ps['image_share']:.0%} with an image, {ps['audio_share']:.0%} with audio, mean "
             f"LLM length {ps['mean_length']:.0f} tokens, {ps['mean_patches_per_image']:.0f} patches per image, "
             f"{ps['mean_frames_per_clip']:.0f} frames per clip); tiny MLLM {res['model']}; budgets {res['budgets']} "
             f"(summed tokens). 4 gloo ranks, {r['steps']} measured steps (first dropped as warm-up), each arm on "
             "the same batches in rotating order.", "",
             "| arm (4 real ranks) | vision imb. | audio imb. | LLM imb. | step (critical path, median) | wall step (median) | plan + routing |",
             "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        a = r[arm]
        lines.append(f"| {ARM_LABEL[arm]} | {a['imbalance']['vision']:.3f} | {a['imbalance']['audio']:.3f} | "
                     f"{a['imbalance']['llm']:.3f} | {a['median_step_ms']:.1f} ms | {a['median_wall_ms']:.1f} ms | "
                     f"{a['plan_routing_ms']:.2f} ms ({a['overhead_fraction']:.1%}) |")
    for key, label in (("planned", "planned (cost model) with"), ("bound", "lower bound (max(mean, largest item)) for")):
        for arm in ("full", "windowed"):
            cb = r[f"{key}_{arm}"]
            lines.append(f"| {label} {ARM_LABEL[arm]} | {cb['vision']:.3f} | {cb['audio']:.3f} | {cb['llm']:.3f} | | | |")
    few = r["few_items_share"]
    lines += ["", f"Steps holding fewer items of a phase than ranks (4): vision {few['vision']:.0%}, audio "
              f"{few['audio']:.0%}, LLM examples {few['llm']:.0%}.", "",
              "| simulated | arm | vision imb. | audio imb. | LLM imb. | modelled step | plan_step time |",
              "|---|---|---|---|---|---|---|"]
    for w, by_arm in res["sim"].items():
        for arm in ARMS:
            a = by_arm[arm]
            lines.append(f"| {int(w):,} ranks ({by_arm['steps']} steps) | {ARM_LABEL[arm]} | "
                         f"{a['imbalance']['vision']:.3f} | {a['imbalance']['audio']:.3f} | {a['imbalance']['llm']:.3f} | "
                         f"{1e3 * a['modelled_step_s']:.1f} ms | {by_arm['plan_ms']:.0f} ms |")
        b = by_arm["bound"]
        lines.append(f"| {int(w):,} ranks | lower bound | {b['vision']:.3f} | {b['audio']:.3f} | {b['llm']:.3f} | | |")
    c = res["costs"]
    lines += ["", "Fitted per-phase cost (CPU seconds; gamma + alpha L + beta L^2, L = patches / frames / tokens): "
              + "; ".join(f"{p} ({v[0]:.2e}, {v[1]:.2e}, {v[2]:.2e})" for p, v in c.items())
              + "; per encoder call, paid by every rank every step and not balanceable: "
              + ", ".join(f"{p} {1e3 * v:.2f} ms" for p, v in res["per_call_s"].items()) + ".", "",
              "Goals (<= 1.05 per phase): "
              + "; ".join(f"{where} with {ARM_LABEL[arm]}: " + ", ".join(f"{p} {'met' if ok else 'NOT met'}"
                                                                         for p, ok in g[f"{key}_{arm}_ok"].items())
                          for key, where in (("real_4", "4 real ranks"), ("sim_2560", "simulated 2,560 ranks"))
                          for arm in ("full", "windowed"))
              + f". Planning + routing <= 2 % of the step: {'met' if g['overhead_ok'] else 'NOT met'}"
              f" ({r['full']['overhead_fraction']:.1%} with full orchestration)."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    res = run(quick=args.quick)
    print(markdown(res))
    print(json.dumps({"real_4": {a: res["real"][a]["imbalance"] for a in ARMS},
                      "overhead_fraction": res["real"]["full"]["overhead_fraction"],
                      "sim": {w: {a: v[a]["imbalance"] for a in ARMS} for w, v in res["sim"].items()},
                      "goals": goals(res), "wall_s": round(res["wall_s"], 1)}, default=float))


if __name__ == "__main__":
    main()
