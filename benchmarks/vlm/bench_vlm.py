"""Per-phase balance of a stock VLM on real media, 4 gloo ranks: unbalanced / balanced / with splitting.

Run:  python benchmarks/vlm/bench_vlm.py [--steps 16] [--family qwen2_5_omni] [--budget-scale 1] [--quick]
      (ONE JSON line last)

Data: chitchat exchanges through the Qwen3 template; scikit-image photos through the Qwen2-VL image processor
(:class:`evenflow.data.multimodal.MultimodalChatDataset`), 40 % of them pan videos of 4 or 8 frames
(:class:`evenflow.data.video.VideoChatDataset`); for the Qwen2.5-Omni thinker (the default) also eSpeak NG
speech (a spoken question, alone or with a photo) as Whisper log-mel frames. A DataLoader worker ->
``DynamicBatchLoader`` (token, patch and frame budgets) -> the stock model built tiny from its config
(vocabulary remapped to the chats' ids; the thinker's audio tower has the real 2-second attention windows).

Every step runs three arms on the *same* batch, in rotating order, forward and backward, no optimizer step (so
every arm sees the same weights): ``none`` (nothing moves), ``full`` (every phase balanced, items whole) and
``split`` (balanced, videos cut into temporal patches and clips at the audio tower's windows,
``VLMConfig(video_slice=1, audio_slice=1)``). Reported per phase:

- the **plan's imbalance** -- max / mean of the per-rank loads, mean over steps -- under the planner's cost
  model (:func:`evenflow.vlm.fit_phase_costs`: a warm-up fit on rank 0's towers, broadcast) and,
  the figure that counts, **scored with a model fitted separately** (another warm-up, other sizes, on rank 1;
  NOTE [ Scoring time balance honestly ]), beside two lower bounds under that scorer, the indivisible-item
  bound and the stronger pigeonhole bound (:func:`pigeonhole_bound`); the goal for the split arm: <= 1.05, or
  <= the pigeonhole bound + 0.02;
- the **measured thread CPU time** of each phase on each rank (``time.thread_time``, one thread: waiting in a
  collective costs no CPU), forward and backward (each encoder's output enters the exchange as a detached
  leaf), as median and IQR over steps of the slowest rank's time and of max / mean over ranks;
- **collectives per step** on the orchestrator's group (forward, backward), counted on one step per arm;
- the **orchestrator's share** of the step's CPU time: finding the items and positions, the metadata
  exchange, the plan and the data moves (everything but the encoders and the LLM), over the whole step.
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.*, <group>.*

from common.world import run_world  # noqa: E402

ARMS = ("none", "full", "split")
WORLD = 4
GOAL, SLACK = 1.05, 0.02
BUDGETS = dict(token_budget=2048, num_patches=4096, num_frames=4000)
DATA = dict(max_pixels=256 * 28 * 28, video_fraction=0.4, frames=(4, 8), fps=2.0)
MIX = {"qwen2_5_omni": dict(text=1, image=2, audio=1, both=1), "default": dict(text=1, image=2, audio=0, both=0)}
SPLIT = dict(video_slice=1, audio_slice=1)
WARMUP = 2
"""Steps dropped from the statistics (lazy initialization, first-call costs)."""
PLANNER_SIZES = dict(vision_rows=(16, 64, 144, 256, 576, 1024), llm_tokens=(32, 128, 256, 512, 1024, 2048))
TIMING = dict(clock="thread", repeats=5, items_per_call=8)
"""Both warm-ups: thread CPU time (4 ranks share 2 cores), fastest of 5, 8 items a call (a tiny tower's per-call
overhead otherwise swamps how an item's time grows: ``WarmupConfig.items_per_call``)."""
SCORER_SIZES = dict(vision_rows=(36, 100, 196, 400, 784), llm_tokens=(48, 192, 384, 768, 1536),
                    audio_fractions=(0.15, 0.35, 0.55, 0.8, 0.95))
"""The scorer's warm-up: other sizes, timed on another rank -- a fit the planner never saw. Five sizes per phase:
with three, a quadratic interpolates the timings' noise exactly (an audio scorer of ``0 L + 7e-8 L^2`` against the
planner's ``4.9e-5 L + 2.8e-8 L^2`` in one run)."""
COLLECTIVES = ("all_gather", "all_to_all_single", "all_reduce", "broadcast", "all_gather_into_tensor",
               "reduce_scatter_tensor", "barrier")


class _Timed:
    """An encoder whose output enters the exchange as a detached leaf; its forward and backward are timed."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.forward_seconds, self.pairs = fn, 0.0, 0.0, []

    def __call__(self, *args):
        t0 = time.thread_time()
        y = self.fn(*args)
        leaf = y.detach().requires_grad_(y.requires_grad)
        self.forward_seconds += time.thread_time() - t0
        self.seconds = self.forward_seconds
        self.pairs.append((y, leaf))
        return leaf

    def backward(self) -> None:
        import torch

        t0 = time.thread_time()
        for y, leaf in self.pairs:
            if y.requires_grad:
                y.backward(leaf.grad if leaf.grad is not None else torch.zeros_like(y))
        self.seconds += time.thread_time() - t0


class _Counted:
    """Counts ``torch.distributed`` collectives issued on ``group`` while active (benchmark instrumentation)."""

    def __init__(self, group) -> None:
        self.group, self.calls = group, {}

    def __enter__(self):
        import torch.distributed as dist

        self.saved = {n: getattr(dist, n) for n in COLLECTIVES}

        def wrap(name, fn):
            def counted(*args, **kwargs):
                if kwargs.get("group") is self.group:
                    self.calls[name] = self.calls.get(name, 0) + 1
                return fn(*args, **kwargs)
            return counted

        for n, fn in self.saved.items():
            setattr(dist, n, wrap(n, fn))
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for n, fn in self.saved.items():
            setattr(dist, n, fn)

    def take(self) -> dict:
        out, self.calls = self.calls, {}
        return out


def _scorer(timings: dict) -> dict:
    from evenflow.balance import QuadraticCost, fit_quadratic

    out = {}
    for phase, pairs in timings.items():
        fit = fit_quadratic(*zip(*pairs))
        out[phase] = QuadraticCost(gamma=0.0 if phase != "llm" else fit.gamma, alpha=fit.alpha, beta=fit.beta)
    return out


def scored_loads(plan, scorer: dict, window: int | None) -> dict:
    """Per phase, ``(loads before, loads after, item costs)`` under the scorer's costs, with the adapters' item
    rules (a video costs its frames, a clip its windows)."""
    from evenflow.vlm.qwen2_vl import vision_item_cost
    from evenflow.vlm.qwen_omni import audio_item_cost

    out = {}
    for p in plan.phases:
        it = plan.items[p]
        cost = vision_item_cost(scorer[p], it.meta) if p == "vision" else audio_item_cost(scorer[p], window, it.rows)
        out[p] = (np.bincount(plan.source[it.example], weights=cost, minlength=plan.world),
                  np.bincount(it.dest, weights=cost, minlength=plan.world), cost)
    llm = np.asarray(scorer["llm"](plan.length.astype(np.float64)))
    out["llm"] = (np.bincount(plan.source, weights=llm, minlength=plan.world),
                  np.bincount(plan.dest, weights=llm, minlength=plan.world), llm)
    return out


def pigeonhole_bound(costs: np.ndarray, world: int) -> float:
    """A lower bound on max / mean for every plan of these items (whole, as planned) on ``world`` ranks, stronger
    than the indivisible-item bound when a rank holds a few items: among the ``k * W + 1`` largest, some rank holds
    ``k + 1``, so its load is at least the ``k + 1`` smallest of them. 21 equal pieces on 4 ranks: the indivisible
    bound 1.0, this one 1.143 (6 / 5.25), which every plan reaches at best."""
    c = np.sort(np.asarray(costs, dtype=np.float64))[::-1]
    mean = c.sum() / world
    best = max(c[0] if c.size else 0.0, mean)
    for k in range(1, (c.size - 1) // world + 1):
        best = max(best, float(c[k * world - k:k * world + 1].sum()))
    return float(best / mean)


def _rank_main(rank: int, world: int, steps: int, samples: int, family: str, budgets: dict) -> dict:
    import torch
    import torch.distributed as dist

    from evenflow import DynamicBatchLoader, pop_step_info
    from evenflow.data import chitchat_conversations
    from evenflow.data.multimodal import MediaMix, MultimodalChatDataset
    from evenflow.data.video import VideoChatDataset
    from evenflow.data.vocab import RemappedDataset
    from evenflow.vlm import BalancedVLM, VLMConfig, WarmupConfig, fit_phase_costs, time_phases
    from evenflow.testing.tiny_vlm import dense_vocab, tiny_vlm

    torch.set_num_threads(1)
    chats = chitchat_conversations()[:samples]
    vocab = dense_vocab(chats)
    model = tiny_vlm(family, vocab=vocab)
    group = dist.new_group(backend="gloo")
    t0 = time.perf_counter()
    cost = fit_phase_costs(model, group=group, config=WarmupConfig(**PLANNER_SIZES, **TIMING))
    fit_s = time.perf_counter() - t0
    scorer = [_scorer(time_phases(model, config=WarmupConfig(**SCORER_SIZES, **TIMING)))
              if rank == 1 else None]
    dist.broadcast_object_list(scorer, src=1)  # the scorer's fit, from another rank than the planner's
    scorer = scorer[0]
    media = MultimodalChatDataset(chats, num_samples=samples, mix=MediaMix(**MIX.get(family, MIX["default"])),
                                  layout="hf", max_pixels=DATA["max_pixels"], seed=0)
    videos = VideoChatDataset(media, video_fraction=DATA["video_fraction"], frames=DATA["frames"], seed=0,
                              fps=DATA["fps"])
    dataset = RemappedDataset(videos, vocab)
    extra = {"num_patches": budgets["num_patches"]}
    if family == "qwen2_5_omni":
        extra["num_frames"] = budgets["num_frames"]
    loader = DynamicBatchLoader(dataset, token_budget=budgets["token_budget"], num_workers=1, buffer_size=64,
                                extra_budgets=extra)
    vlms = {arm: BalancedVLM(model, group=group, config=VLMConfig(
        balance="none" if arm == "none" else "full", time_cost=cost, max_encoder_rows=budgets["num_patches"],
        gradient_sync="external", **(SPLIT if arm == "split" else {}))) for arm in ARMS}  # timed, never stepped
    window = getattr(vlms["full"].adapter, "window", None)
    step_time = {}
    for arm, vlm in vlms.items():  # the orchestrator's own step, timed (benchmark instrumentation)
        def timed(*args, _inner=vlm.orchestrator.step, **kwargs):
            t = time.thread_time()
            try:
                return _inner(*args, **kwargs)
            finally:
                step_time["s"] = time.thread_time() - t
        vlm.orchestrator.step = timed
    records, epoch, collectives = [], 0, {}
    marks = [time.perf_counter()]
    while len(records) < steps:
        loader.set_epoch(epoch)
        for batch in loader:
            info = pop_step_info(batch)
            row = {}
            k = len(records) % len(ARMS)
            for arm in ARMS[k:] + ARMS[:k]:  # rotating order
                model.zero_grad(set_to_none=True)
                vlm = vlms[arm]
                count = len(records) == steps - 1
                with _Counted(group) as counter:
                    t0 = time.thread_time()
                    local, plan = vlm.prepare(batch, info)
                    prepare_s = time.thread_time() - t0
                    encs = {p: _Timed(f) for p, f in vlm.encoders().items()}
                    t0 = time.thread_time()
                    step = vlm.run(plan, local, info, encoders=encs)
                    forward_s = time.thread_time() - t0
                    forward = counter.take()
                    t0 = time.thread_time()
                    step.loss.backward()  # the LLM and the all-to-all; stops at the encoders' leaves
                    backward_s = time.thread_time() - t0
                    backward = counter.take()
                for enc in encs.values():
                    enc.backward()
                if count:
                    collectives[arm] = {"forward": forward, "backward": backward}
                enc_forward = sum(e.forward_seconds for e in encs.values())
                enc_backward = sum(e.seconds for e in encs.values()) - enc_forward
                # The orchestrator: finding items and positions, the metadata exchange, the plan (prepare) and
                # the data moves (its step without the encoders). The all-to-all's backward counts as the LLM's.
                orch_s = prepare_s + step_time["s"] - enc_forward
                llm_s = forward_s - step_time["s"] + backward_s
                total = prepare_s + forward_s + backward_s + enc_backward
                phases = [encs[p].seconds for p in plan.phases]
                mine = torch.tensor(phases + [llm_s, orch_s, total], dtype=torch.float64)
                gathered = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(gathered, mine)
                scored = scored_loads(plan, scorer, window)
                row[arm] = {"times": torch.stack(gathered).numpy(),
                            "planner": {p: (b.before, b.after, b.bound) for p, b in step.imbalance().items()},
                            "scored": {p: (float(b.max() / (b.sum() / world)), float(a.max() / (a.sum() / world)),
                                           max(float(c.max(initial=0)), float(c.sum()) / world) / (float(c.sum()) / world),
                                           pigeonhole_bound(c, world))
                                       if c.sum() > 0 else (1.0, 1.0, 1.0, 1.0) for p, (b, a, c) in scored.items()},
                            "items": {p: int(plan.items[p].rows.size) for p in plan.phases},
                            "examples": int(plan.source.size), "tokens": int(plan.length.sum())}
            records.append(row)
            marks.append(time.perf_counter())
            if len(records) == steps:
                break
        epoch += 1
    loader.close()
    return {"records": records, "phases": list(vlms["full"].adapter.phases) + ["llm"], "fit_s": fit_s,
            "cost": cost.describe(), "scorer": {p: (c.gamma, c.alpha, c.beta) for p, c in scorer.items()},
            "collectives": collectives, "step_wall_s": np.diff(marks).round(2).tolist()}


def _q(values: np.ndarray) -> dict:
    lo, mid, hi = np.percentile(values, [25, 50, 75])
    return {"median": round(float(mid), 4), "iqr": round(float(hi - lo), 4)}


def summarize(records: list[dict], phases: list[str]) -> dict:
    rec = records[WARMUP:]
    out = {"steps": len(rec)}
    for arm in ARMS:
        times = np.stack([r[arm]["times"] for r in rec])  # [steps, ranks, (encoders..., llm, orchestrator, total)]
        arm_out = {}
        for i, p in enumerate(phases):
            t = times[:, :, i]
            planner = np.array([r[arm]["planner"][p] for r in rec])  # [steps, (before, after, bound)]
            scored = np.array([r[arm]["scored"][p] for r in rec])
            col = 0 if arm == "none" else 1
            after = scored[:, col]
            within = (after <= GOAL) | (after <= scored[:, 3] + SLACK)  # the pigeonhole bound: >= the other
            arm_out[p] = {"plan_imbalance": round(float(after.mean()), 4), "bound": round(float(scored[:, 2].mean()), 4),
                          "pigeonhole_bound": round(float(scored[:, 3].mean()), 4),
                          "planner_scored": round(float(planner[:, col].mean()), 4),
                          "steps_within_goal": round(float(within.mean()), 3),
                          "slowest_rank_ms": _q(1e3 * t.max(1)),
                          "measured_imbalance": _q(t.max(1) / np.maximum(t.mean(1), 1e-12))}
        share = times[:, :, -2] / np.maximum(times[:, :, -1], 1e-12)
        arm_out["orchestrator_share"] = _q(share.reshape(-1))
        arm_out["orchestrator_ms"] = _q(1e3 * times[:, :, -2].max(1))
        arm_out["step_cpu_ms"] = _q(1e3 * times[:, :, -1].max(1))
        out[arm] = arm_out
    out["mean_items_per_step"] = {p: float(np.mean([r["split"]["items"][p] for r in rec])) for p in phases[:-1]}
    out["mean_items_per_step_whole"] = {p: float(np.mean([r["full"]["items"][p] for r in rec])) for p in phases[:-1]}
    out["mean_examples_per_step"] = float(np.mean([r["full"]["examples"] for r in rec]))
    out["mean_tokens_per_step"] = float(np.mean([r["full"]["tokens"] for r in rec]))
    return out


def goals(summary: dict, phases: list[str]) -> dict:
    """Per phase: the split arm's mean scored plan imbalance <= 1.05, or <= its mean pigeonhole bound + 0.02 (a
    lower bound for every plan of the same pieces, never below the indivisible-item bound)."""
    s = summary["split"]
    return {p: bool(s[p]["plan_imbalance"] <= GOAL or s[p]["plan_imbalance"] <= s[p]["pigeonhole_bound"] + SLACK)
            for p in phases}


def run(quick: bool = False, *, steps: int = 16, family: str = "qwen2_5_omni", budget_scale: int = 1) -> dict:
    """``budget_scale``: every budget (tokens, patches, frames) times this -- more items per rank and step."""
    steps = (4 if quick else steps) + WARMUP
    budgets = {k: v * budget_scale for k, v in BUDGETS.items()}
    samples = 24 * budget_scale * steps  # ~3 samples per rank and step per budget, with room for the buffer
    t0 = time.perf_counter()
    results = run_world(_rank_main, WORLD, steps, samples, family, budgets, timeout=3000.0)
    phases = results[0]["phases"]
    summary = summarize(results[0]["records"], phases)
    return {"bench": "vlm", "family": family, "world": WORLD, "budgets": budgets, "data": DATA, "phases": phases,
            "cost": results[0]["cost"], "scorer": results[0]["scorer"], "fit_s": round(results[0]["fit_s"], 1),
            "collectives": results[0]["collectives"], "step_wall_s": results[0]["step_wall_s"], **summary, "goal_met": goals(summary, phases),
            "wall_s": round(time.perf_counter() - t0, 1)}


def markdown(res: dict) -> str:
    phases = res["phases"]
    lines = [f"Real media, 4 gloo ranks, {res['family']} built tiny from its config, {res['steps']} measured steps "
             f"(after {WARMUP} warm-up) of chitchat + photos + pan videos" + (" + eSpeak speech" if "audio" in phases
                                                                              else "") +
             f" (budgets per rank: {res['budgets']['token_budget']:,} tokens, {res['budgets']['num_patches']:,} patch "
             f"rows, {res['budgets']['num_frames']:,} mel frames; {res['mean_examples_per_step']:.1f} examples per step; "
             "items per step whole / split: "
             + ", ".join(f"{p} {res['mean_items_per_step_whole'][p]:.1f} / {res['mean_items_per_step'][p]:.1f}"
                         for p in phases[:-1]) + "). The planner's costs: a warm-up fit on rank 0 "
             f"({res['fit_s']} s, broadcast); plans scored with another fit (rank 1, other sizes).", "",
             "| arm | phase | plan imbalance (scored) | bound | pigeonhole bound | planner's view | steps within goal | "
             "slowest rank, ms (IQR) | measured max/mean (IQR) |", "|---|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        for p in phases:
            s = res[arm][p]
            lines.append(f"| {arm} | {p} | {s['plan_imbalance']:.3f} | {s['bound']:.3f} | {s['pigeonhole_bound']:.3f} | "
                         f"{s['planner_scored']:.3f} | "
                         f"{s['steps_within_goal']:.0%} | {s['slowest_rank_ms']['median']:.1f} "
                         f"({s['slowest_rank_ms']['iqr']:.1f}) | {s['measured_imbalance']['median']:.3f} "
                         f"({s['measured_imbalance']['iqr']:.3f}) |")
    lines += ["", "| arm | orchestrator's share of step CPU (IQR) | orchestrator ms, slowest rank | step CPU ms, slowest "
              "rank | collectives forward | backward |", "|---|---|---|---|---|---|"]
    for arm in ARMS:
        a, c = res[arm], res["collectives"].get(arm, {})
        lines.append(f"| {arm} | {100 * a['orchestrator_share']['median']:.1f} % ({100 * a['orchestrator_share']['iqr']:.1f}) | "
                     f"{a['orchestrator_ms']['median']:.1f} | {a['step_cpu_ms']['median']:.1f} | "
                     f"{c.get('forward')} | {c.get('backward')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="measured steps + %d warm-up" % WARMUP)
    ap.add_argument("--family", choices=("qwen2_5_omni", "qwen2_vl", "qwen2_5_vl"), default="qwen2_5_omni")
    ap.add_argument("--budget-scale", type=int, default=1, help="every budget times this (default %(default)s: "
                    f"{BUDGETS})")
    ap.add_argument("--quick", action="store_true", help="4 steps (a smoke run, not a figure)")
    args = ap.parse_args()
    res = run(args.quick, steps=args.steps, family=args.family, budget_scale=args.budget_scale)
    print(markdown(res))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
