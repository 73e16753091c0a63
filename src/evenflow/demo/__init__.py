"""``evenflow demo``: time to quality of fixed batching, group_by_length and evenflow, on real chats, 2 gloo ranks.

- config.py  -- DemoConfig (data, model, budget, arms, LR schedule)
- prepare.py -- chitchat through the Qwen3 template/tokenizer, dense vocabulary remap
- plan.py    -- the planner-only dry run that matches the fixed arms' accumulation to evenflow's steps
- arms.py    -- each arm's batching as a stream of optimizer-step windows
- train.py   -- one rank: DDP over gloo, every arm's epoch in ABBA-interleaved timed chunks, held-out loss
- report.py  -- per-arm metrics, time to target, the verdict with medians, spreads and load warnings
- render.py  -- the printed table, JSON and PNG
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .config import ARMS, DemoConfig, quick_config, schedule_factor

__all__ = ["ARMS", "DemoConfig", "quick_config", "schedule_factor", "run_demo", "environment"]


def lr_text(config: DemoConfig, reference_tokens: int) -> str:
    """The LR line of the report: the schedule, and which arm trains under which token LR rule."""
    def rule(scaling: str) -> str:
        if scaling == "none":
            return "no token LR rule"
        return (f"{scaling} token LR rule (evenflow.TokenLRScaler): lr = schedule(step) x "
                f"{'sqrt(' if scaling == 'sqrt' else '('}supervised tokens in the step / {reference_tokens})")
    rules = f"evenflow: {rule(config.lr_scaling)}"
    if "evenflow_sqrt_lr" in config.arms and config.lr_scaling != "sqrt":
        rules += f"; evenflow_sqrt_lr: {rule('sqrt')}"
    return (f"{rules}; the fixed arms: none; peak {config.base_lr:g}, warm-up {config.warmup_fraction:.0%} then "
            f"cosine to {config.final_lr_fraction:g}x, in each arm's optimizer steps")


def environment(world_size: int) -> dict[str, Any]:
    """Versions, git revision, cores and load: what a reader needs to weigh the wall-clock figures."""
    import numpy
    import torch
    import transformers

    from .. import __version__

    try:
        root = Path(__file__).resolve().parents[3]
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
        git = {"revision": rev.stdout.strip() or None, "dirty": bool(dirty.stdout.strip()) if rev.returncode == 0
               else None}
    except (OSError, subprocess.SubprocessError):
        git = {"revision": None, "dirty": None}
    return {"evenflow": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": numpy.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "git": git, "cores": os.cpu_count(), "world_size": world_size, "load_before": list(os.getloadavg())}


def run_demo(config: DemoConfig, out_dir: str | os.PathLike[str], *, progress: bool = True,
             echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every arm on ``config.world_size`` spawned gloo ranks; write ``demo_report.{json,png}``.

    Returns the report (also written as JSON). Raises if a rank fails (the spawned ranks' error is re-raised).
    """
    import numpy as np
    import torch.multiprocessing as mp

    from .plan import match_arms
    from .prepare import prepare_data
    from .render import format_table, plot_report, write_json
    from .report import TIME_MODEL, add_time_to_target, summarize_arm, verdict
    from .train import rank_main

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    env = environment(config.world_size)
    echo(f"preparing {config.train_samples} + {config.heldout_samples} held-out chitchat conversations "
         f"(Qwen3 template, cutoff {config.cutoff}) ...")
    data = prepare_data(config)
    lengths = data.lengths
    matching = match_arms(config, lengths, data.loss_tokens)
    echo(f"  lengths: mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, max {lengths.max()}, "
         f"CV {lengths.std() / lengths.mean():.2f}; vocabulary remapped 151,669 -> {data.vocab_size} ids")
    echo(f"  dry run (planners only, planning={matching.planning!r} as the loader's defaults resolve): evenflow takes {matching.evenflow_steps} optimizer steps of "
         f"{matching.evenflow_samples_per_step:.1f} samples; fixed arms: batch {matching.fixed_batch_size} per rank "
         f"(largest whose batches of the longest sample fit {config.token_budget} tokens) x {matching.accumulation} "
         f"accumulation = {matching.fixed_steps} optimizer steps; {config.world_size} gloo ranks, "
         f"{config.rounds} ABBA rounds, arms: {', '.join(config.arms)}")
    prep_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory(prefix="evenflow-demo-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(rank_main, args=(config, data, matching, os.path.join(tmp, "rendezvous"), result_path, progress),
                 nprocs=config.world_size, join=True)
        with open(result_path, encoding="utf-8") as f:
            raw = json.load(f)

    arms = {name: {**summarize_arm(raw["arms"][name], raw["initial_heldout"]),
                   "composition": matching.composition[name]} for name in config.arms}
    target = add_time_to_target(arms)
    env["load_after"] = list(os.getloadavg())
    load = {"cores": env["cores"], "load1_during": [x for a in arms.values() for x in a["load1_per_round"]]}
    v = verdict(arms, load=load, world_size=config.world_size) if "evenflow" in arms else None
    text = lr_text(config, matching.reference_tokens)
    echo(f"tiny Qwen3 model: {raw['model_parameters'] / 1e6:.2f}M parameters, {config.num_layers} layers, "
         f"hidden {config.hidden_size}")
    if v is not None:
        echo(format_table(arms, v, batch_size=matching.fixed_batch_size, accumulation=matching.accumulation,
                          lr_text=text))
    report = {"config": asdict(config), "matching": matching.as_dict(), "vocab_size": data.vocab_size,
              "model_parameters": raw["model_parameters"], "lr_rule": text, "time_model": TIME_MODEL,
              "arms": arms, "verdict": v, "environment": env, "lengths": lengths.tolist(), "prepare_s": prep_s,
              "total_s": time.perf_counter() - t0}
    json_path, png_path = out / "demo_report.json", out / "demo_report.png"
    write_json(str(json_path), report)
    plot_report(str(png_path), lengths=lengths, arms=arms, cutoff=config.cutoff, token_budget=config.token_budget,
                target=target)
    echo(f"wrote {json_path} and {png_path} ({report['total_s']:.0f} s in all)")
    return report
