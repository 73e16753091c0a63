"""Sample movement measured (issue 19): bytes moved per step and peak memory per rank, global vs local planning.

    python benchmarks/loader/bench_moves.py [--quick] [--world 2] [--repeats 2] [--compare-src /path/to/old/src]

Every run is one fresh world of W spawned gloo ranks (so ``ru_maxrss`` is that run's peak) running one real
epoch of DynamicBatchLoader (num_workers=0, default depth and buffer) over one of four sample kinds:

- ``tokens``  -- chat-like token ids (long-tail lengths, int64 input_ids and labels);
- ``media``   -- short token ids plus a 3x224x224 float32 image (602 KB) or 10 s of 16 kHz float32 audio
                 (640 KB) per sample, every sample costing its image/audio tokens;
- ``views``   -- a pre-tokenized corpus: every sample is a view ``corpus[a:b]`` of one 24 MB int64 tensor;
- ``payload`` -- few samples, each carrying a 50 MB float32 tensor (issue 19, item 8).

Per run and rank: steps, samples and bytes moved (``loader.moves``: every byte of the sample all-to-alls this
rank sent, and the own bytes of the moved tensors), the longest one round's move took, the epoch's wall time
and the peak RSS over the RSS after building the dataset. Arms are ABBA-interleaved (local, global, global,
local) per repeat; the JSON line gives medians and ranges over repeats.

``--compare-src`` (optional): the same ``tokens`` epoch on another source tree (e.g. ``git archive fbdadc2
src``), ABBA against this one, under both policies: what agreeing on every round before its batches are
released and the end-of-epoch exchange cost (the wall time of an epoch with no training step).

Prints human-readable lines, then one JSON line last. Timings here are only meaningful on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.*, <group>.*

from common.world import run_world  # noqa: E402

BUDGET = 8192
KINDS = ["tokens", "media", "views", "payload"]


def _lengths(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.5, 1.0, n).astype(np.int64) + 8, 8, BUDGET // 2)


class Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.lengths = _lengths(n, 0)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        ids = torch.full((int(self.lengths[i]),), i % 30_000 + 1, dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}


class Media(Dataset):
    """Half image samples (256 image tokens), half audio samples (500 audio tokens), plus text."""

    def __init__(self, n: int) -> None:
        self.lengths = np.clip(_lengths(n, 1) // 4, 8, 1024)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        extra = 256 if i % 2 == 0 else 500
        ids = torch.full((int(self.lengths[i]) + extra,), 7, dtype=torch.long)
        media = torch.rand(3, 224, 224) if i % 2 == 0 else torch.rand(160_000)
        return {"input_ids": ids, "labels": ids.clone(), "media": media}


class Views(Dataset):
    def __init__(self, n: int, corpus_tokens: int = 3_000_000) -> None:
        self.corpus = torch.arange(corpus_tokens, dtype=torch.long)
        self.lengths = _lengths(n, 2)
        self.starts = np.random.default_rng(2).integers(0, corpus_tokens - BUDGET, n)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        a = int(self.starts[i])
        view = self.corpus[a:a + int(self.lengths[i])]
        return {"input_ids": view, "labels": view}


class Payload(Dataset):
    """Samples that each carry a 50 MB float32 tensor (12.5 M floats)."""

    def __init__(self, n: int) -> None:
        self.lengths = _lengths(n, 3)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        ids = torch.full((int(self.lengths[i]),), 3, dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone(), "payload": torch.full((12_500_000,), float(i))}


def _keep_ids(samples: list) -> dict:
    """Collate: pad input_ids; touch every other tensor (a real collate would stack them)."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    touched = 0.0
    for i, s in enumerate(samples):
        ids[i, : len(s["input_ids"])] = s["input_ids"]
        for key in ("media", "payload"):
            if key in s:
                touched += float(s[key].view(-1)[0])
    return {"input_ids": ids, "touched": touched}


def _rss_mb() -> float:
    """Peak RSS since :func:`_reset_peak` (``VmHWM``); ``ru_maxrss`` where /proc has no VmHWM."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _reset_peak() -> None:
    """Start the peak at the current RSS (writing 5 to /proc/self/clear_refs, Linux >= 4.0). A spawned rank
    re-imports its parent's main module: under ``make bench`` that is run_all.py with every benchmark, whose
    import peak would otherwise hide the epoch's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _arm(rank: int, world: int, kind: str, policy: str, n: int, src: str | None) -> dict:
    if src:
        sys.path.insert(0, src)
    import evenflow  # noqa: PLC0415 - after choosing the source tree
    from datetime import timedelta  # noqa: PLC0415

    ds = {"tokens": Tokens, "media": Media, "views": Views, "payload": Payload}[kind](n)
    base = _current_rss_mb()
    _reset_peak()
    loader = evenflow.DynamicBatchLoader(ds, token_budget=BUDGET, planning=policy, collate_fn=_keep_ids,
                                         timeout=timedelta(seconds=300), worker_timeout=timedelta(seconds=240))
    started = time.perf_counter()
    steps = 0
    for batch in loader:
        evenflow.pop_step_info(batch)
        steps += 1
    wall = time.perf_counter() - started
    moves = getattr(loader, "moves", None)
    loader.close()
    out = dict(steps=steps, wall_s=wall, peak_rss_mb=_rss_mb(), base_rss_mb=base)
    if moves is not None:
        out.update(moved_samples=moves.samples, moved_bytes=moves.bytes, moved_tensor_bytes=moves.tensor_bytes,
                   move_s=moves.seconds, max_round_move_s=moves.max_round_seconds)
    return out


def _summary(runs: list[list[dict]]) -> dict:
    """Medians and ranges over repeats of per-run aggregates (sum over ranks of bytes, max over ranks of RSS)."""
    agg = []
    for ranks in runs:
        steps = ranks[0]["steps"]
        agg.append(dict(steps=steps, wall_s=max(r["wall_s"] for r in ranks),
                        peak_rss_mb=max(r["peak_rss_mb"] for r in ranks),
                        rss_over_base_mb=max(r["peak_rss_mb"] - r["base_rss_mb"] for r in ranks),
                        moved_samples=sum(r.get("moved_samples", 0) for r in ranks),
                        moved_bytes=sum(r.get("moved_bytes", 0) for r in ranks),
                        moved_tensor_bytes=sum(r.get("moved_tensor_bytes", 0) for r in ranks),
                        max_round_move_s=max(r.get("max_round_move_s", 0.0) for r in ranks)))
    out = {}
    for key in agg[0]:
        values = [a[key] for a in agg]
        out[key] = statistics.median(values)
        if key in ("wall_s", "peak_rss_mb", "rss_over_base_mb", "max_round_move_s"):
            out[key + "_range"] = [min(values), max(values)]
    steps = out["steps"]
    out["moved_bytes_per_step"] = out["moved_bytes"] / steps if steps else 0.0
    out["overhead_bytes_per_moved_sample"] = ((out["moved_bytes"] - out["moved_tensor_bytes"]) / out["moved_samples"]
                                              if out["moved_samples"] else 0.0)
    return out


def run(quick: bool, world: int, repeats: int, compare_src: str | None, kinds: list[str] = KINDS) -> dict:
    sizes = {"tokens": 600 if quick else 2000, "media": 200 if quick else 600, "views": 600 if quick else 2000,
             "payload": 12 if quick else 24}
    result: dict = {"world": world, "repeats": repeats, "budget": BUDGET, "kinds": {},
                    "load_before": os.getloadavg()[0]}
    for kind in kinds:
        runs: dict[str, list] = {"local": [], "global": []}
        for _ in range(repeats):
            for policy in ("local", "global", "global", "local"):  # ABBA
                runs[policy].append(run_world(_arm, world, kind, policy, sizes[kind], None, timeout=900))
        result["kinds"][kind] = {p: _summary(r) for p, r in runs.items()}
        for p in ("local", "global"):
            s = result["kinds"][kind][p]
            print(f"{kind:8s} {p:6s}: {s['steps']} steps, moved {s['moved_samples']} samples "
                  f"{s['moved_bytes'] / 2**20:.2f} MiB ({s['moved_bytes_per_step'] / 1024:.1f} KiB/step, "
                  f"{s['overhead_bytes_per_moved_sample']:.0f} B over the tensors per sample), longest round move "
                  f"{s['max_round_move_s']:.3f} s, epoch {s['wall_s']:.2f} s, peak RSS {s['peak_rss_mb']:.0f} MB "
                  f"(+{s['rss_over_base_mb']:.0f} over the dataset)", flush=True)
    if compare_src:
        cmp: dict[str, list] = {}
        for _ in range(repeats):
            for src_name, src in (("this", None), ("other", compare_src), ("other", compare_src), ("this", None)):
                for policy in ("local", "global"):
                    res = run_world(_arm, world, "tokens", policy, sizes["tokens"], src, timeout=900)
                    cmp.setdefault(f"{src_name}/{policy}", []).append(max(r["wall_s"] for r in res))
        result["compare"] = {k: dict(median_s=statistics.median(v), range_s=[min(v), max(v)]) for k, v in cmp.items()}
        for policy in ("local", "global"):
            this, other = result["compare"][f"this/{policy}"], result["compare"][f"other/{policy}"]
            print(f"tokens epoch, {policy}: this tree {this['median_s']:.3f} s, {compare_src} "
                  f"{other['median_s']:.3f} s (ratio {this['median_s'] / other['median_s']:.3f})", flush=True)
    result["load_after"] = os.getloadavg()[0]
    return result


def markdown(result: dict) -> str:
    """The report section of ``make bench`` (benchmarks/run_all.py): one row per sample kind and policy."""
    rows = ["| samples | policy | steps | moved samples | moved KiB / step | bytes over the tensors per moved sample "
            "| longest round move (s) | epoch wall (s, range) | peak RSS over the dataset (MB) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for kind, policies in result["kinds"].items():
        for policy, s in policies.items():
            lo, hi = s["wall_s_range"]
            rows.append(f"| {kind} | {policy} | {s['steps']:g} | {s['moved_samples']:g} | "
                        f"{s['moved_bytes_per_step'] / 1024:.1f} | {s['overhead_bytes_per_moved_sample']:.0f} | "
                        f"{s['max_round_move_s']:.3f} | {s['wall_s']:.2f} ({lo:.2f}-{hi:.2f}) | "
                        f"{s['rss_over_base_mb']:.0f} |")
    return (f"One real epoch of `DynamicBatchLoader` per run on {result['world']} spawned gloo ranks "
            f"(budget {result['budget']:,}, num_workers=0, no training step), local against global planning, "
            f"ABBA-interleaved, median of {result['repeats']} repeat(s) per arm; bytes are every byte of the sample "
            f"all-to-alls the ranks sent (`loader.moves`); peak RSS is the epoch's high-water mark over the RSS "
            f"after the dataset is built (the loader's own first imports count when the script runs alone, ~40 MB, "
            f"not here, where each spawned rank has imported the whole suite first). Load average "
            f"{result['load_before']:.1f} before, "
            f"{result['load_after']:.1f} after. `python benchmarks/loader/bench_moves.py` runs it alone (and "
            f"`--compare-src` against another source tree).\n\n" + "\n".join(rows))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compare-src", default=None, help="another evenflow src/ to compare the tokens epoch with")
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args(argv)
    out = run(args.quick, args.world, 1 if args.quick else args.repeats, args.compare_src, args.kinds.split(","))
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
