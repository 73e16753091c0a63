"""``evenflow demo``: fixed batching vs evenflow, one epoch each, on real chats, a tiny Qwen3 model, 2 gloo ranks.

- config.py  -- DemoConfig (data, model, budget) and the stated learning-rate rule
- prepare.py -- chitchat through the Qwen3 template/tokenizer, dense vocabulary remap
- train.py   -- one rank: DDP over gloo, the evenflow epoch, then the fixed-batch epoch, held-out loss
- report.py  -- metrics, the printed table, JSON and PNG
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .config import DemoConfig, lr_for_step, quick_config

__all__ = ["DemoConfig", "quick_config", "lr_for_step", "run_demo"]

LR_RULE = ("square-root scaling by tokens per step (Adam): lr = base_lr * sqrt(supervised tokens in the step / "
           "reference_tokens), the same rule for both runs")


def run_demo(config: DemoConfig, out_dir: str | os.PathLike[str], *, progress: bool = True,
             echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run both epochs on ``config.world_size`` spawned gloo ranks; write ``demo_report.{json,png}``.

    Returns the report (also written as JSON). Raises if a rank fails (the spawned ranks' error is re-raised).
    """
    import numpy as np
    import torch.multiprocessing as mp

    from .prepare import prepare_data
    from .report import format_table, plot_report, summarize_run, write_json
    from .train import rank_main

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    echo(f"preparing {config.train_samples} + {config.heldout_samples} held-out chitchat conversations "
         f"(Qwen3 template, cutoff {config.cutoff}) ...")
    data = prepare_data(config)
    lengths = data.lengths
    fixed_batch_size = max(1, config.token_budget // int(lengths.max()))
    echo(f"  lengths: mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, max {lengths.max()}, "
         f"CV {lengths.std() / lengths.mean():.2f}; vocabulary remapped 151,669 -> {data.vocab_size} ids")
    echo(f"  token budget {config.token_budget} per rank; fixed batch size {fixed_batch_size} (largest whose "
         f"batches of the longest sample, {lengths.max()} tokens, fit); {config.world_size} gloo ranks")
    prep_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory(prefix="evenflow-demo-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(rank_main, args=(config, data, os.path.join(tmp, "rendezvous"), result_path, fixed_batch_size,
                                  progress), nprocs=config.world_size, join=True)
        with open(result_path, encoding="utf-8") as f:
            raw = json.load(f)

    summary = {run: summarize_run(raw[run]) for run in ("fixed", "evenflow")}
    params = raw["fixed"]["model_parameters"]
    table = format_table(summary, fixed_batch_size=fixed_batch_size)
    echo(f"tiny Qwen3 model: {params / 1e6:.2f}M parameters, {config.num_layers} layers, hidden {config.hidden_size}")
    echo(table)
    echo(f"learning rate: {LR_RULE}; base_lr {config.base_lr:g} at {config.reference_tokens} tokens "
         f"(mean lr: fixed {summary['fixed']['mean_lr']:.2e}, evenflow {summary['evenflow']['mean_lr']:.2e})")
    report = {
        "config": asdict(config), "fixed_batch_size": fixed_batch_size, "vocab_size": data.vocab_size,
        "model_parameters": params, "lr_rule": LR_RULE,
        "speedup_samples_per_s": summary["evenflow"]["samples_per_s"] / summary["fixed"]["samples_per_s"],
        "runs": summary, "lengths": lengths.tolist(), "prepare_s": prep_s,
        "total_s": time.perf_counter() - t0,
    }
    json_path, png_path = out / "demo_report.json", out / "demo_report.png"
    write_json(str(json_path), report)
    plot_report(str(png_path), lengths=lengths, summary=summary, cutoff=config.cutoff,
                token_budget=config.token_budget)
    echo(f"wrote {json_path} and {png_path} ({report['total_s']:.0f} s in all)")
    return report
