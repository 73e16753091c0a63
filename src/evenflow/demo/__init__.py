"""``evenflow demo``: what a user decides between -- HF ``Trainer``'s padded batches, ``group_by_length``, TRL's
packing, evenflow -- on real chats, 2 gloo ranks: speed, held-out loss, time to the reference's loss.

- config.py    -- DemoConfig (data, model, budget, arms, LR schedule)
- prepare.py   -- chitchat through the Qwen3 template/tokenizer, dense vocabulary remap
- steps.py     -- which samples each arm's optimizer steps hold (shared with benchmarks/quality_replay.py)
- plan.py      -- the dry run: evenflow's steps from its planners, the HF and TRL arms' plans from them
- arms.py      -- each arm's batching as a stream of optimizer-step windows
- attention.py -- causal attention per packed sequence (a CPU varlen kernel), for every arm
- train.py     -- one rank: DDP over gloo, every arm's epoch in ABBA-interleaved timed chunks, held-out loss
- report.py    -- per-arm metrics, the one throughput figure, time to target, load warnings
- replay.py    -- the quality verdict from the replay's stored rows (paired 95 % interval over seeds)
- render.py    -- the printed table, JSON and PNG
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

from .config import ARMS, REFERENCE, DemoConfig, quick_config, schedule_factor

__all__ = ["ARMS", "REFERENCE", "DemoConfig", "quick_config", "schedule_factor", "run_demo", "environment"]


def lr_text(config: DemoConfig, reference_tokens: int) -> str:
    """The LR line of the JSON: the schedule, and which arm trains under which token LR rule."""
    if config.lr_scaling == "none":
        rule = "no token LR rule in any arm (the rule is opt-in)"
    else:
        rule = (f"evenflow arms: {config.lr_scaling} token LR rule (evenflow.TokenLRScaler), reference "
                f"{reference_tokens} supervised tokens per step; the HF and TRL arms: none")
    return (f"{rule}; peak {config.base_lr:g}, warm-up {config.warmup_fraction:.0%} then cosine to "
            f"{config.final_lr_fraction:g}x, in each arm's optimizer steps")


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
    import torch.multiprocessing as mp

    from .plan import match_arms
    from .prepare import prepare_data
    from .render import format_table, plot_report, write_json
    from .replay import compare, load_rows, rows_commit
    from .report import TIME_MODEL, add_time_to_target, summarize_arm, verdict
    from .train import rank_main

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    env = environment(config.world_size)
    echo(f"load average at start: {' '.join(f'{x:.2f}' for x in env['load_before'])} (1, 5, 15 min) on "
         f"{env['cores']} cores; {config.world_size} gloo ranks of one thread each")
    echo(f"preparing {config.train_samples} + {config.heldout_samples} held-out chitchat conversations "
         f"(Qwen3 template, cutoff {config.cutoff}) ...")
    data = prepare_data(config)
    lengths = data.lengths
    matching = match_arms(config, lengths, data.loss_tokens)
    echo(f"  lengths: mean {lengths.mean():.0f}, max {lengths.max()}, CV {lengths.std() / lengths.mean():.2f}; "
         f"dry run (planning={matching.planning!r}): evenflow {matching.evenflow_steps} optimizer steps, HF batch "
         f"{matching.batch_size} per rank; {config.rounds} ABBA rounds")
    prep_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory(prefix="evenflow-demo-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(rank_main, args=(config, data, matching, os.path.join(tmp, "rendezvous"), result_path, progress),
                 nprocs=config.world_size, join=True)
        with open(result_path, encoding="utf-8") as f:
            raw = json.load(f)

    plans = matching.as_dict()["arms"]
    arms = {name: {**summarize_arm(raw["arms"][name], raw["initial_heldout"]), "plan": plans[name]}
            for name in config.arms}
    target = add_time_to_target(arms)
    env["load_after"] = list(os.getloadavg())
    own = {name: {"fingerprint": plan.fingerprint, "steps": plan.optimizer_steps}
           for name, plan in matching.arms.items()}
    rows = load_rows()
    comparisons = {name: compare(name, rows, config, own=own).as_dict() for name in arms if name != REFERENCE}
    load = {"cores": env["cores"], "load1_during": [x for a in arms.values() for x in a["load1_per_round"]]}
    v = verdict(arms, comparisons, load=load, world_size=config.world_size, rows_commit=rows_commit())
    echo(f"tiny Qwen3 model: {raw['model_parameters'] / 1e6:.2f}M parameters, {config.num_layers} layers, "
         f"hidden {config.hidden_size}; every arm one epoch of the same samples from the same init")
    echo(format_table(arms, v, matching, rounds=config.rounds, token_budget=config.token_budget))
    report = {"config": asdict(config), "matching": {k: w for k, w in matching.as_dict().items() if k != "arms"},
              "vocab_size": data.vocab_size, "model_parameters": raw["model_parameters"],
              "lr_rule": lr_text(config, matching.reference_tokens), "time_model": TIME_MODEL, "arms": arms,
              "verdict": v, "environment": env, "lengths": lengths.tolist(), "prepare_s": prep_s,
              "total_s": time.perf_counter() - t0}
    json_path, png_path = out / "demo_report.json", out / "demo_report.png"
    write_json(str(json_path), report)
    plot_report(str(png_path), arms=arms, target=target)
    echo(f"wrote {json_path} and {png_path} ({report['total_s']:.0f} s in all)")
    return report
