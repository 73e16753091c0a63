"""Per-phase balance of a Qwen2.5-VL-7B-shaped three-modality model, simulated at 8, 64 and 2,560 ranks.

Run:  python benchmarks/vlm/bench_vlm_sim.py [--quick]        (prints lines, then ONE JSON line last)

The step: every rank holds the pinned ``"omni_mix"`` shape (``evenflow.sim.datasets``: 4 examples of text,
images, videos and speech per rank; NOTE [ The pinned three-modality shape ]). The model: Qwen2.5-VL-7B's vision
tower and text model with Qwen2.5-Omni-7B's audio tower (``evenflow.vlm.flops``), costs in training
FLOPs. The planner is the package's own ``plan_step`` with the adapters' item rules (a video costs its frames,
a clip its windows) on per-phase quadratics **fitted by least squares to the FLOPs of a calibration split**
(another seed); each plan is **scored with the exact FLOP count** of every item (partial attention windows at a
frame's edges, a clip's last window, causal attention) -- never with the planner's own coefficients (NOTE
[ Scoring time balance honestly ] in evenflow.planning.timecost).

Arms, per world: ``none`` (every item where it was loaded), ``balanced`` (every phase balanced, items whole),
``split`` (balanced, videos cut into items of ``VIDEO_SLICE`` temporal patches and clips at every
``AUDIO_SLICE`` windows of 200 frames -- exact for the real towers, tests/test_vlm_families.py). Reported per
phase: max / mean of the per-rank FLOPs, mean over steps, beside the indivisible-item bound (largest item /
mean; splitting lowers it). Goal: the split arm <= 1.05, or <= bound + 0.02.

Also: the time of ``plan_step`` + ``rank_routing`` (one rank) per step, single process, median of 20 steps at
2,560 ranks (thread CPU time, and wall time: the machine is shared), for the package's default planner settings
and without the locality pass; and the orchestrator's share of a step: that time over the simulated step time
on H100s (each phase as long as its slowest rank at 989 TFLOP/s x 40 % MFU).

And the balanced step priced with its exchanges (``evenflow.sim.exchange_cost``, NOTE [ Pricing the exchanges ]:
stated, overridable NVLink / InfiniBand / gloo links) at 8, 64, 512 and 2,560 ranks, on ``omni_mix`` and on its
photos alone (``image_only``), split items: arms ``none``, ``inline`` (metadata exchange and plan in the step,
the plan's CPU time measured here), ``prefetched`` (both in the loader's thread, charged only past the previous
step), ``prefetched_media`` (also the media rows over gloo; host memory of two steps' media), ``vision_only``
(an encoder-only reorder, outputs sent back to their source rank) with and without overlap. Per arm: ``step_s``,
its compute / exchange / hidden parts, per-phase imbalance, inter-node bytes with and without the node-wise
placement; the per-phase ``worth_balancing`` rate and the gain over what stays on the path; and the
Megatron-Bridge setting (8 ranks of photos: their spread 1.27 -> 1.07, steps 755 / 798 / 811 ms), reported
either way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

WORLDS = (8, 64, 2560)
STEPS = {8: 40, 64: 20, 2560: 3}
"""Steps averaged per world (seeded; 2,560 ranks hold 10,240 examples per step)."""
TIMED_STEPS = 20
VIDEO_SLICE = 4
"""Temporal patches per video item in the split arm (8 frames)."""
AUDIO_SLICE = 2
"""Attention windows (200 frames each) per audio item in the split arm (4 s). Finer is not always better: past
16,384 items a phase is planned by batched LPT (`BalanceConfig(method="auto")`), which balances less tightly."""
RANKS_PER_NODE = 8
GOAL, SLACK = 1.05, 0.02
PEAK_FLOPS, MFU = 989e12, 0.40
"""H100 SXM bf16 dense peak (datasheet) and an assumed MFU (NOTE [ GPU cost from FLOPs ])."""
CALIBRATION_SEED = 10_000
ARMS = ("none", "balanced", "split")
PHASES = ("vision", "audio", "llm")


def fitted_costs() -> dict:
    """The planner's per-phase quadratics: least squares on the exact FLOPs of a calibration split."""
    from evenflow.balance import fit_quadratic
    from evenflow.vlm.flops import audio_clip_flops, llm_example_flops, vision_frame_flops
    from evenflow.sim.datasets import example_tokens, three_modality_examples

    calib = [e for r in three_modality_examples(64, seed=CALIBRATION_SEED) for e in r]
    frames = [(h, w) for e in calib for h, w in e["images"]] + [(h, w) for e in calib for _, h, w in e["videos"]]
    h, w = np.array(frames).T
    window = 200
    clips = np.array([f for e in calib for f in e["audio"]])
    chunks = np.unique(np.minimum(clips, window))  # single windows: the tower's unit of attention
    tokens = np.array([example_tokens(e) for e in calib])
    return {"vision": fit_quadratic(h * w, vision_frame_flops(h, w)),
            "audio": fit_quadratic(chunks, audio_clip_flops(chunks)),
            "llm": fit_quadratic(tokens, llm_example_flops(tokens))}


def orchestrator_config(costs: dict, *, balance: bool, locality: bool = True,
                        ranks_per_node: int | None = RANKS_PER_NODE, only: str | None = None):
    """``only``: balance that phase alone (the others stay where they were loaded); ``ranks_per_node=None``:
    placement without the node-wise rearrangement."""
    from evenflow.balance import BalanceConfig
    from evenflow.balance.phases import OrchestratorConfig, PhaseSpec
    from evenflow.vlm.qwen2_vl import vision_item_cost
    from evenflow.vlm.qwen_omni import audio_item_cost

    planner = BalanceConfig() if locality else BalanceConfig(locality_tolerance=None)
    on = {p: only is None or p == only for p in PHASES}
    return OrchestratorConfig(
        encoders={"vision": PhaseSpec(cost=costs["vision"], input_dim=1176, downsample=4, meta_width=4,
                                      item_cost=lambda rows, meta: vision_item_cost(costs["vision"], meta),
                                      output_rows=lambda rows, meta: rows // 4, balance=planner,
                                      balanced=on["vision"]),
                  "audio": PhaseSpec(cost=costs["audio"], input_dim=128, balance=planner, balanced=on["audio"],
                                     item_cost=lambda rows, meta: audio_item_cost(costs["audio"], 200, rows),
                                     output_rows=lambda rows, meta: np.maximum(((rows - 1) // 2 - 1) // 2 + 1, 0))},
        llm=PhaseSpec(cost=costs["llm"], balance=planner, balanced=on["llm"]), ranks_per_node=ranks_per_node,
        balance=balance)


def metadata(step: list[list[dict]], *, split: bool) -> list[list]:
    """Per rank, ``ExampleMeta`` of its examples: vision items ``(kind, t, h, w)``, audio items in frames."""
    from evenflow.balance.phases import ExampleMeta
    from evenflow.sim.datasets import example_tokens

    out = []
    for examples in step:
        metas = []
        for e in examples:
            vision = [((0, 1, h, w), h * w) for h, w in e["images"]]
            for t, h, w in e["videos"]:
                k = VIDEO_SLICE if split else t
                vision += [((1, min(k, t - t0), h, w), min(k, t - t0) * h * w) for t0 in range(0, t, k)]
            piece = 200 * AUDIO_SLICE
            audio = [min(piece, f - f0) for f in e["audio"] for f0 in range(0, f, piece if split else f)]
            L = example_tokens(e)
            metas.append(ExampleMeta(L, e["text"] // 2, (tuple(r for _, r in vision), tuple(audio)),
                                     (tuple(m for m, _ in vision), tuple(() for _ in audio))))
        out.append(metas)
    return out


def exact_loads(plan) -> dict:
    """Per phase, ``(loads per rank, exact FLOPs per item)`` of ``plan``'s placement."""
    from evenflow.vlm.flops import audio_clip_flops, llm_example_flops, vision_frame_flops

    it = plan.items["vision"]
    vision = it.meta[:, 1] * vision_frame_flops(it.meta[:, 2], it.meta[:, 3])
    audio = audio_clip_flops(plan.items["audio"].rows)
    llm = llm_example_flops(plan.length)
    dests = {"vision": it.dest, "audio": plan.items["audio"].dest, "llm": plan.dest}
    return {p: (np.bincount(dests[p], weights=c, minlength=plan.world), c)
            for p, c in (("vision", vision), ("audio", audio), ("llm", llm))}


def simulate(world: int, costs: dict, steps: int) -> dict:
    from evenflow.balance.phases import plan_step
    from evenflow.sim.datasets import three_modality_examples

    configs = {"none": orchestrator_config(costs, balance=False), "balanced": orchestrator_config(costs, balance=True),
               "split": orchestrator_config(costs, balance=True)}
    rows = {arm: {p: [] for p in PHASES} for arm in ARMS}
    step_s = {arm: [] for arm in ARMS}
    for s in range(steps):
        step = three_modality_examples(world, seed=s)
        for arm in ARMS:
            plan = plan_step(metadata(step, split=arm == "split"), configs[arm])
            loads = exact_loads(plan)
            step_s[arm].append(sum(float(v[0].max()) for v in loads.values()) / (PEAK_FLOPS * MFU))
            for p, (load, item) in loads.items():
                mean = float(load.sum()) / world
                rows[arm][p].append((float(load.max()) / mean, max(float(item.max(initial=0)), mean) / mean))
    out = {}
    for arm in ARMS:
        out[arm] = {p: {"imbalance": round(float(np.mean([r[0] for r in v])), 4),
                        "bound": round(float(np.mean([r[1] for r in v])), 4)} for p, v in rows[arm].items()}
        out[arm]["step_s"] = round(float(np.median(step_s[arm])), 4)
    return out


# -- the exchanges priced (NOTE [ Pricing the exchanges ] in evenflow.sim.exchange_cost) -----------------------

EXCHANGE_WORLDS = (8, 64, 512, 2560)
EXCHANGE_STEPS = {8: 16, 64: 8, 512: 3, 2560: 2}
EXCHANGE_ARMS = ("none", "inline", "prefetched", "prefetched_media", "vision_only", "vision_only_overlap")
ROW_BYTES = {"vision": (1176 * 2, 3584 * 2), "audio": (128 * 2, 3584 * 2)}
"""Bytes per input row and per output row of each encoder phase, bf16: a vision patch row (3 x 2 x 14 x 14
values), a mel frame (128 bins), an output row of the LLM's width (3,584)."""
TEXT_BYTES_PER_TOKEN = 8 * 5
"""int64 per token: input id, label and three M-RoPE position ids."""
METADATA_BYTES = 8 * 1024
"""One rank's row of the metadata all_gather (``METADATA_WORDS`` int64 words)."""
MB_WORLD = 8
"""Megatron-Bridge's comparison: one node of 8 ranks, image-only, 4 samples each (32 samples a micro-batch, as
its PR's "18-24 of 32 samples moved" reads; its DP and image sizes are not stated beyond that -- assumed)."""


def image_only_shape():
    from evenflow.sim.datasets import THREE_MODALITY_SHAPES

    import dataclasses
    return dataclasses.replace(THREE_MODALITY_SHAPES["omni_mix"], kinds=(("image", 1.0),),
                               note="omni_mix's photos alone: every example one or two images beside its text")


def _phase_seconds(plan) -> dict[str, float]:
    """Per phase, the slowest rank's seconds (exact FLOPs at PEAK_FLOPS x MFU)."""
    return {p: float(load.max()) / (PEAK_FLOPS * MFU) for p, (load, _) in exact_loads(plan).items()}


def _moves(plan, link, *, restore: bool = False, phases=("vision", "audio"), host_inputs: bool = False) -> dict:
    """Seconds of a plan's all-to-alls: text, each phase's inputs (over gloo with ``host_inputs``), the outputs of
    every phase in one exchange, forward and backward; and the bytes that crossed nodes."""
    from evenflow.sim.exchange_cost import all_to_all_s, step_traffic

    t = step_traffic(plan, ROW_BYTES, TEXT_BYTES_PER_TOKEN, ranks_per_node=RANKS_PER_NODE, restore=restore)
    inputs = {p: all_to_all_s(t[f"{p}:inputs"], link, host=host_inputs) for p in phases}
    outputs = t[f"{phases[0]}:outputs"]
    for p in phases[1:]:
        outputs = outputs + t[f"{p}:outputs"]
    text = 0.0 if restore else all_to_all_s(t["text"], link)
    # bytes that cross nodes in a step: inputs once, outputs twice (their gradients come back), the text once
    inter = sum(t[f"{p}:inputs"].inter_node_bytes for p in phases) + 2 * outputs.inter_node_bytes
    inter += 0.0 if restore else t["text"].inter_node_bytes
    return {"text": text, "inputs": inputs, "outputs": 2 * all_to_all_s(outputs, link), "inter_node_bytes": inter}


def exchange_step(step: list[list[dict]], configs: dict, link) -> dict:
    """Every arm's step time and parts for one step (NOTE [ Pricing the exchanges ])."""
    from evenflow.balance.phases import plan_step, rank_routing
    from evenflow.sim.exchange_cost import all_gather_s, exposed_s

    world = len(step)
    meta = metadata(step, split=True)

    def timed(name):
        c0 = time.thread_time()
        plan = plan_step(meta, configs[name])
        rank_routing(plan, 0)
        return plan, time.thread_time() - c0

    (none, _), (full, plan_s), (flat, _) = timed("none"), timed("full"), timed("flat")
    (vis, vis_plan_s), (vis_flat, _) = timed("vision"), timed("vision_flat")
    nccl_meta = all_gather_s(METADATA_BYTES, world, link)
    gloo_meta = all_gather_s(METADATA_BYTES, world, link, host=True)
    compute = {"none": _phase_seconds(none), "full": _phase_seconds(full), "vision": _phase_seconds(vis)}
    m_full, m_flat = _moves(full, link), _moves(flat, link)
    m_host = _moves(full, link, host_inputs=True)
    m_vis, m_vis_flat = (_moves(p, link, restore=True, phases=("vision",)) for p in (vis, vis_flat))
    moves_full = m_full["text"] + sum(m_full["inputs"].values()) + m_full["outputs"]
    moves_vis = m_vis["inputs"]["vision"] + m_vis["outputs"]
    c_full, c_vis = sum(compute["full"].values()), sum(compute["vision"].values())
    # prefetched: metadata (gloo) + plan ride the loader's thread while the previous step (this one's length) runs
    pre = c_full + moves_full
    host_media = sum(m_host["inputs"].values())
    pre_media_path = c_full + m_full["text"] + m_full["outputs"]
    media = {p: np.bincount(np.asarray(full.items[p].dest), weights=full.items[p].rows * ROW_BYTES[p][0],
                            minlength=world) for p in ("vision", "audio")}
    arms = {
        "none": dict(compute_s=sum(compute["none"].values()), exchange_s=0.0, hidden_s=0.0, plan=compute["none"],
                     traffic=None, flat=None),
        "inline": dict(compute_s=c_full, exchange_s=nccl_meta + plan_s + moves_full, hidden_s=0.0,
                       plan=compute["full"], traffic=m_full, flat=m_flat),
        "prefetched": dict(compute_s=c_full, exchange_s=moves_full + exposed_s(gloo_meta + plan_s, pre),
                           hidden_s=min(gloo_meta + plan_s, pre), plan=compute["full"], traffic=m_full, flat=m_flat),
        "prefetched_media": dict(
            compute_s=c_full, hidden_s=min(gloo_meta + plan_s + host_media, pre_media_path), plan=compute["full"],
            exchange_s=m_full["text"] + m_full["outputs"] + exposed_s(gloo_meta + plan_s + host_media, pre_media_path),
            traffic=m_full, flat=m_flat, host_media_gb=round(2 * float(sum(media.values()).max()) / 1e9, 3)),
        "vision_only": dict(compute_s=c_vis, exchange_s=nccl_meta + vis_plan_s + moves_vis, hidden_s=0.0,
                            plan=compute["vision"], traffic=m_vis, flat=m_vis_flat),
        # overlapped: the reorder's exchanges run beside the LLM phase they do not feed (Megatron-Bridge's option)
        "vision_only_overlap": dict(compute_s=c_vis, exchange_s=exposed_s(nccl_meta + vis_plan_s + moves_vis,
                                                                          compute["vision"]["llm"]),
                                    hidden_s=min(nccl_meta + vis_plan_s + moves_vis, compute["vision"]["llm"]),
                                    plan=compute["vision"], traffic=m_vis, flat=m_vis_flat),
    }
    plans = {"none": none, "full": full, "vision": vis}
    which = {"none": "none", "vision_only": "vision", "vision_only_overlap": "vision"}
    out = {}
    for arm, a in arms.items():
        loads = exact_loads(plans[which.get(arm, "full")])
        out[arm] = {"step_s": a["compute_s"] + a["exchange_s"], "compute_s": a["compute_s"],
                    "exchange_s": a["exchange_s"], "hidden_s": a["hidden_s"],
                    "plan_s": 0.0 if arm == "none" else vis_plan_s if arm.startswith("vision") else plan_s,
                    **{f"{p}_imbalance": float(l.max() / max(l.mean(), 1e-30)) for p, (l, _) in loads.items()},
                    "inter_node_bytes": 0.0 if a["traffic"] is None else a["traffic"]["inter_node_bytes"],
                    "inter_node_bytes_flat": 0.0 if a["flat"] is None else a["flat"]["inter_node_bytes"]}
        if "host_media_gb" in a:
            out[arm]["host_media_gb"] = a["host_media_gb"]
    phase_exchange = {"vision": m_full["inputs"]["vision"] + m_full["outputs"] / 2,
                      "audio": m_full["inputs"]["audio"] + m_full["outputs"] / 2, "llm": m_full["text"]}
    from evenflow.sim.exchange_cost import worth_balancing
    out["worth"] = worth_balancing(compute["none"], compute["full"], phase_exchange)
    return out


def simulate_exchanges(world: int, costs: dict, steps: int, shape, link=None) -> dict:
    """Per arm, the median over ``steps`` seeded steps of its step time and parts, the mean of its imbalances."""
    from evenflow.sim.datasets import three_modality_examples
    from evenflow.sim.exchange_cost import LinkModel

    link = link or LinkModel(ranks_per_node=RANKS_PER_NODE)
    configs = {"none": orchestrator_config(costs, balance=False), "full": orchestrator_config(costs, balance=True),
               "flat": orchestrator_config(costs, balance=True, ranks_per_node=None),
               "vision": orchestrator_config(costs, balance=True, only="vision"),
               "vision_flat": orchestrator_config(costs, balance=True, only="vision", ranks_per_node=None)}
    rows = [exchange_step(three_modality_examples(world, shape, seed=s), configs, link) for s in range(steps)]
    out = {}
    for arm in EXCHANGE_ARMS:
        keys = rows[0][arm].keys()
        agg = {k: float(np.mean([r[arm][k] for r in rows])) if k.endswith("imbalance") else
               float(np.median([r[arm][k] for r in rows])) for k in keys}
        out[arm] = {k: round(v, 4 if k.endswith(("imbalance", "_s")) or k == "host_media_gb" else 0)
                    for k, v in agg.items()}
        for k in ("step_s", "compute_s", "exchange_s", "hidden_s", "plan_s"):
            out[arm][k] = round(agg[k], 6)
    out["worth"] = {p: float(np.mean([r["worth"][p] for r in rows])) for p in PHASES}
    # Fraction of the steps in which balancing the phase saves more than its exchanges cost (worth_balancing).
    gain = out["none"]["step_s"] - out["prefetched"]["compute_s"]
    out["gain_over_exchange"] = round(gain / out["prefetched"]["exchange_s"], 1) if out["prefetched"]["exchange_s"] \
        else None
    # How many times slower every link may be before the prefetched arm's exchanges eat its gain (break-even).
    return out


def run_exchanges(costs: dict, quick: bool = False) -> dict:
    from evenflow.sim.exchange_cost import LinkModel

    link = LinkModel(ranks_per_node=RANKS_PER_NODE)
    shapes = {"omni_mix": "omni_mix", "image_only": image_only_shape()}
    out = {"link": {k: getattr(link, k) for k in link.__dataclass_fields__}, "shapes": {}}
    for name, shape in shapes.items():
        out["shapes"][name] = {str(w): simulate_exchanges(w, costs, max(1, EXCHANGE_STEPS[w] // 4) if quick
                                                         else EXCHANGE_STEPS[w], shape, link)
                               for w in EXCHANGE_WORLDS}
    mb = out["shapes"]["image_only"][str(MB_WORLD)]
    out["megatron_bridge"] = {"world": MB_WORLD, "vision_spread": [mb["none"]["vision_imbalance"],
                                                                   mb["vision_only"]["vision_imbalance"]],
                              "step_s": {a: mb[a]["step_s"] for a in ("vision_only_overlap", "none", "vision_only")},
                              "theirs": {"vision_spread": [1.27, 1.07],
                                         "step_s": {"vision_only_overlap": 0.755, "none": 0.798, "vision_only": 0.811}}}
    return out


def exchange_goals(ex: dict) -> dict:
    """Where balancing pays (the best balanced arm beats ``none``), ``prefetched`` is ahead of ``inline`` and of
    both ``vision_only`` arms; and the Megatron-Bridge comparison: spread within 0.05 and step order."""
    out = {}
    for shape, worlds in ex["shapes"].items():
        for w, arms in worlds.items():
            pays = arms["prefetched"]["step_s"] < arms["none"]["step_s"]
            ahead = all(arms["prefetched"]["step_s"] <= arms[a]["step_s"]
                        for a in ("inline", "vision_only", "vision_only_overlap"))
            out[f"{shape}_{w}"] = {"pays": bool(pays), "prefetched_ahead": bool(ahead or not pays)}
    mb = ex["megatron_bridge"]
    s = mb["step_s"]
    out["megatron_bridge"] = {
        "spread_within_0.05": bool(abs(mb["vision_spread"][0] - 1.27) <= 0.05 and abs(mb["vision_spread"][1] - 1.07)
                                   <= 0.05),
        "order_overlap_none_inline": bool(s["vision_only_overlap"] < s["none"] < s["vision_only"])}
    return out


def exchange_markdown(ex: dict) -> str:
    link = ex["link"]
    lines = ["", "The balanced step's exchanges priced (`evenflow.sim.exchange_cost`, assumed links: NVLink "
             f"{link['intra_bw'] / 1e9:.0f} GB/s per GPU, InfiniBand {link['inter_bw'] / 1e9:.0f} GB/s per node, "
             f"gloo {link['host_bw'] / 1e9:.0f} GB/s per node, {link['ranks_per_node']} ranks a node; plan times "
             "measured here, on this CPU). Step = compute of the slowest rank per phase + what of the exchanges is "
             "left on the critical path (ms); inter-node MB per step with / without the node-wise placement.", "",
             "| shape | ranks | arm | step ms | compute | exchange | hidden | vision | audio | LLM | inter-node MB "
             "(flat) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, worlds in ex["shapes"].items():
        for w, arms in worlds.items():
            for arm in EXCHANGE_ARMS:
                a = arms[arm]
                lines.append(f"| {shape} | {int(w):,} | {arm} | {1e3 * a['step_s']:.1f} | {1e3 * a['compute_s']:.1f} "
                             f"| {1e3 * a['exchange_s']:.2f} | {1e3 * a['hidden_s']:.2f} | "
                             f"{a['vision_imbalance']:.3f} | {a['audio_imbalance']:.3f} | {a['llm_imbalance']:.3f} | "
                             f"{a['inter_node_bytes'] / 1e6:.1f} ({a['inter_node_bytes_flat'] / 1e6:.1f}) |")
    mb = ex["megatron_bridge"]
    lines += ["", f"Megatron-Bridge's setting (image-only, {mb['world']} ranks): vision spread "
              f"{mb['vision_spread'][0]:.3f} -> {mb['vision_spread'][1]:.3f} (theirs 1.27 -> 1.07); step "
              + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in mb["step_s"].items())
              + " (theirs 755 / 798 / 811 ms)."]
    return "\n".join(lines)


def time_plan(costs: dict, *, locality: bool, steps: int = TIMED_STEPS, world: int = 2560) -> dict:
    """``plan_step`` + ``rank_routing`` (rank 7) of the split arm at ``world`` ranks: median and IQR over ``steps``
    steps (metadata built beforehand: in a run it comes decoded from the exchange)."""
    from evenflow.balance.phases import plan_step, rank_routing
    from evenflow.sim.datasets import three_modality_examples

    config = orchestrator_config(costs, balance=True, locality=locality)
    metas = [metadata(three_modality_examples(world, seed=100 + s), split=True) for s in range(steps)]
    plan_step(metas[0], config)  # first-call costs (numpy's), paid once per process
    cpu, wall = [], []
    for meta in metas:
        c0, w0 = time.thread_time(), time.perf_counter()
        rank_routing(plan_step(meta, config), 7)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)

    def q(v):
        lo, mid, hi = np.percentile(1e3 * np.asarray(v), [25, 50, 75])
        return {"median_ms": round(float(mid), 1), "iqr_ms": round(float(hi - lo), 1)}

    return {"cpu": q(cpu), "wall": q(wall), "steps": steps}


def run(quick: bool = False) -> dict:
    t0 = time.perf_counter()
    costs = fitted_costs()
    worlds = {}
    for world in WORLDS:
        worlds[str(world)] = simulate(world, costs, max(2, STEPS[world] // 4) if quick else STEPS[world])
    timing = {"default": time_plan(costs, locality=True, steps=5 if quick else TIMED_STEPS),
              "no_locality": time_plan(costs, locality=False, steps=5 if quick else TIMED_STEPS)}
    big = worlds[str(WORLDS[-1])]["split"]
    share = {k: round(v["cpu"]["median_ms"] / 1e3 / big["step_s"], 4) for k, v in timing.items()}
    exchanges = run_exchanges(costs, quick=quick)
    return {"worlds": worlds, "timing_2560": timing, "orchestrator_share_2560": share, "exchanges": exchanges,
            "costs": {p: (c.gamma, c.alpha, c.beta) for p, c in costs.items()}, "quick": quick,
            "wall_s": round(time.perf_counter() - t0, 1)}


def goals(res: dict) -> dict:
    """At 2,560 ranks, per phase of the split arm: <= 1.05 or <= bound + 0.02; and plan + routing <= 100 ms."""
    big = res["worlds"][str(WORLDS[-1])]["split"]
    out = {p: bool(big[p]["imbalance"] <= GOAL or big[p]["imbalance"] <= big[p]["bound"] + SLACK) for p in PHASES}
    out["plan_routing_100ms"] = {k: bool(v["cpu"]["median_ms"] <= 100) for k, v in res["timing_2560"].items()}
    out["exchanges"] = exchange_goals(res["exchanges"])
    return out


def markdown(res: dict) -> str:
    lines = ["Simulated: the pinned `omni_mix` step (4 examples per rank of text, images, videos and speech; "
             "`evenflow.sim.datasets`) on a Qwen2.5-VL-7B-shaped model with Qwen2.5-Omni-7B's audio tower, costs in "
             "training FLOPs (`evenflow.vlm.flops`). Planned by `plan_step` on quadratics fitted to a "
             "calibration split; scored with each item's exact FLOP count. Per phase: max / mean of the per-rank "
             "FLOPs, mean over steps (bound: largest item / mean).", "",
             "| ranks | arm | vision | audio | LLM | step on H100s (s) |", "|---|---|---|---|---|---|"]
    for world, arms in res["worlds"].items():
        for arm in ARMS:
            a = arms[arm]
            cells = " | ".join(f"{a[p]['imbalance']:.3f} (bound {a[p]['bound']:.3f})" for p in PHASES)
            lines.append(f"| {int(world):,} | {arm} | {cells} | {a['step_s']:.3f} |")
    t = res["timing_2560"]
    lines += ["", f"`plan_step` + `rank_routing` for one rank at 2,560 ranks (split arm, single process, "
              f"{t['default']['steps']} steps): default planner {t['default']['cpu']['median_ms']} ms CPU median "
              f"(IQR {t['default']['cpu']['iqr_ms']}; wall {t['default']['wall']['median_ms']} ms), without the "
              f"locality pass {t['no_locality']['cpu']['median_ms']} ms (IQR {t['no_locality']['cpu']['iqr_ms']}; wall "
              f"{t['no_locality']['wall']['median_ms']} ms). Share of the simulated 2,560-rank step if not overlapped: "
              + ", ".join(f"{k} {100 * v:.1f} %" for k, v in res["orchestrator_share_2560"].items()) + "."]
    return "\n".join(lines) + exchange_markdown(res["exchanges"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke run, not a figure)")
    args = ap.parse_args()
    res = run(quick=args.quick)
    print(markdown(res))
    print(json.dumps({"bench": "vlm_sim", **res, "goal_met": goals(res)}))


if __name__ == "__main__":
    main()
