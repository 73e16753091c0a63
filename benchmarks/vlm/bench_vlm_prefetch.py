"""What the balanced step does before its first encoder call, inline or with the plan made in the loader's thread.

Run:  python benchmarks/vlm/bench_vlm_prefetch.py [--rounds 8] [--steps 4] [--quick]      (ONE JSON line last)

2 gloo ranks, torch threads 1, the model and data of ``benchmarks/vlm/bench_vlm.py`` unchanged: the stock
Qwen2.5-Omni thinker built tiny from its config by ``evenflow.testing.tiny_vlm`` (its dimensions are printed),
chitchat exchanges with scikit-image photos, pan videos and eSpeak NG speech through the stock processors, the
same token / patch / frame budgets, planned on a warm-up fit, videos and clips split (bench_vlm's ``split`` arm).

Two arms on the same batches (each round opens epoch ``round`` of each arm's loader), interleaved ABBA over
``--rounds`` rounds of ``--steps`` measured steps (after one warm-up step):

- ``inline``: ``VLMConfig(prefetch=False)``: the step finds its examples, exchanges the metadata and plans;
- ``prefetched``: ``VLMConfig(prefetch=True)`` + ``vlm.prefetch_from(loader)``: the loader's collation thread
  did that for this step while the previous one trained; the step gathers three check words.

Measured per rank (``time.thread_time`` of the trainer's thread: waiting in a collective costs no CPU): the
step's **path before its first encoder call** (from the call to ``vlm`` to the first encoder's entry: examples,
metadata exchange, plan, the checks, and the moves of the encoder inputs -- the same in both arms), the whole
step's CPU (forward and backward), the plan's own time (``plan_step``, on whichever thread runs it) and the
collation thread's CPU spent in the prefetch callable (moved off the path, not removed). Per arm: median and
spread (min-max) over rounds of each round's median. Wall time per step is reported, never judged: the
machine's load average is printed with it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from os import getloadavg
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.*, <group>.*

from common.world import run_world  # noqa: E402
from vlm import bench_vlm as bv  # noqa: E402

WORLD = 2
ARMS = ("inline", "prefetched")
FAMILY = "qwen2_5_omni"
GOAL_SHARE = 0.02
"""The prefetched path before the first encoder call: at most this share of the step's CPU time."""


class _Clock:
    """Thread CPU seconds of the wrapped call on whichever thread runs it (benchmark instrumentation)."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, []

    def __call__(self, *args, **kwargs):
        t = time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds.append(time.thread_time() - t)


def _rank(rank: int, world: int, rounds: int, steps: int, samples: int) -> dict:
    import torch
    import torch.distributed as dist

    from evenflow import DynamicBatchLoader, pop_step_info
    from evenflow.data import chitchat_conversations
    from evenflow.data.multimodal import MediaMix, MultimodalChatDataset
    from evenflow.data.video import VideoChatDataset
    from evenflow.data.vocab import RemappedDataset
    from evenflow.testing.tiny_vlm import dense_vocab, tiny_vlm
    from evenflow.vlm import BalancedVLM, VLMConfig, WarmupConfig, fit_phase_costs

    torch.set_num_threads(1)
    chats = chitchat_conversations()[:samples]
    vocab = dense_vocab(chats)
    model = tiny_vlm(FAMILY, vocab=vocab)
    group = dist.new_group(backend="gloo")
    cost = fit_phase_costs(model, group=group, config=WarmupConfig(**bv.PLANNER_SIZES, **bv.TIMING))
    mix = MediaMix(**bv.MIX[FAMILY])
    dataset = RemappedDataset(VideoChatDataset(
        MultimodalChatDataset(chats, num_samples=samples, mix=mix, layout="hf", max_pixels=bv.DATA["max_pixels"],
                              seed=0),
        video_fraction=bv.DATA["video_fraction"], frames=bv.DATA["frames"], seed=0, fps=bv.DATA["fps"]), vocab)
    budgets = dict(bv.BUDGETS)
    extra = {"num_patches": budgets["num_patches"], "num_frames": budgets["num_frames"]}
    loaders, vlms = {}, {}
    for arm in ARMS:
        loaders[arm] = DynamicBatchLoader(dataset, token_budget=budgets["token_budget"], num_workers=1,
                                          buffer_size=64, extra_budgets=extra)
        vlms[arm] = BalancedVLM(model, group=group, config=VLMConfig(
            time_cost=cost, max_encoder_rows=budgets["num_patches"], gradient_sync="external",
            prefetch=arm == "prefetched", **bv.SPLIT))
    vlms["prefetched"].prefetch_from(loaders["prefetched"])
    plans = {"inline": _Clock(vlms["inline"].orchestrator.plan)}
    vlms["inline"].orchestrator.plan = plans["inline"]
    background = vlms["prefetched"]._prefetch
    plans["prefetched"] = _Clock(background.orchestrator.plan)
    background.orchestrator.plan = plans["prefetched"]
    hook = _Clock(background)  # the collation thread's CPU in the callable
    loaders["prefetched"].set_step_prefetch(hook)
    rows = {arm: [] for arm in ARMS}
    for r in range(rounds):
        for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):  # ABBA: A B | B A | A B ...
            vlm, loader = vlms[arm], loaders[arm]
            loader.set_epoch(r)
            plans[arm].seconds.clear()
            hook.seconds.clear()
            per_step, last = [], None
            for i, batch in enumerate(loader):
                now = time.perf_counter()
                wall, last = (now - last if last is not None else None), now
                info = pop_step_info(batch)
                model.zero_grad(set_to_none=True)
                first = []

                def entered(p, fn):
                    def encode(*args):
                        if not first:
                            first.append(time.thread_time())
                        return fn(*args)
                    return encode
                t0 = time.thread_time()
                local, plan = vlm.prepare(batch, info)
                step = vlm.run(plan, local, info, encoders={p: entered(p, f) for p, f in vlm.encoders().items()})
                step.loss.backward()
                total = time.thread_time() - t0
                if i >= 1:  # the first step of a round warms up (and has no previous step to overlap)
                    per_step.append((first[0] - t0, total, wall))
                if len(per_step) == steps:
                    break
            loader.close()
            path, total, wall = np.array(per_step).T
            rows[arm].append(dict(path_ms=1e3 * float(np.median(path)), step_ms=1e3 * float(np.median(total)),
                                  share=float(np.median(path / total)), wall_ms=1e3 * float(np.median(wall)),
                                  plan_ms=1e3 * float(np.median(plans[arm].seconds or [0.0])),
                                  background_ms=1e3 * float(np.median(hook.seconds or [0.0])) if arm == "prefetched"
                                  else 0.0))
    dims = {k: getattr(model.config.text_config, k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    dims["vision_depth"] = model.config.vision_config.depth
    dims["audio_layers"] = model.config.audio_config.encoder_layers
    return {"rows": rows, "dims": dims, "params": sum(p.numel() for p in model.parameters())}


def summarize(ranks: list[dict]) -> dict:
    out = {}
    for arm in ARMS:
        per_rank = []
        for res in ranks:
            rows = res["rows"][arm]
            per_rank.append({k: {"median": round(float(np.median([x[k] for x in rows])), 3),
                                 "min": round(float(min(x[k] for x in rows)), 3),
                                 "max": round(float(max(x[k] for x in rows)), 3)} for k in rows[0]})
        out[arm] = per_rank
    return out


def goals(summary: dict) -> dict:
    """Per rank: prefetched path <= 2 % of the step; below inline by at least the inline plan's time."""
    out = []
    for r, (inl, pre) in enumerate(zip(summary["inline"], summary["prefetched"])):
        out.append({"rank": r, "share_le_2pct": pre["share"]["median"] <= GOAL_SHARE,
                    "saved_ge_plan": inl["path_ms"]["median"] - pre["path_ms"]["median"] >= inl["plan_ms"]["median"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="ABBA rounds (>= 8 for a figure)")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per arm and round")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 2 steps (a smoke run, not a figure)")
    args = ap.parse_args()
    rounds, steps = (2, 2) if args.quick else (args.rounds, args.steps)
    load = getloadavg()
    t0 = time.perf_counter()
    ranks = run_world(_rank, WORLD, rounds, steps, 24 * (steps + 2) * WORLD, timeout=3000.0)
    summary = summarize(ranks)
    res = {"bench": "vlm_prefetch", "world": WORLD, "rounds": rounds, "steps": steps, "dims": ranks[0]["dims"],
           "params": ranks[0]["params"], "arms": summary, "goal_met": goals(summary),
           "loadavg_before": [round(x, 2) for x in load], "loadavg_after": [round(x, 2) for x in getloadavg()],
           "wall_s": round(time.perf_counter() - t0, 1)}
    for arm in ARMS:
        for r, s in enumerate(summary[arm]):
            print(f"{arm:>10} rank {r}: path before the first encoder {s['path_ms']['median']:.2f} ms CPU "
                  f"(min {s['path_ms']['min']:.2f}, max {s['path_ms']['max']:.2f}) = "
                  f"{100 * s['share']['median']:.2f} % "
                  f"of the step's {s['step_ms']['median']:.1f} ms; plan {s['plan_ms']['median']:.2f} ms; background "
                  f"{s['background_ms']['median']:.2f} ms; wall {s['wall_ms']['median']:.1f} ms per step")
    print(f"load average {res['loadavg_before']} -> {res['loadavg_after']}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
