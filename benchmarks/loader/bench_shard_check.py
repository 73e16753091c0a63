"""What the shard check costs per epoch (issue 34), on 2 real gloo ranks with real chitchat chats.

Two measurements, one JSON line last:

- its parts, each the median (and min..max) of repeated runs on each rank: the map-style content check
  (``content_print``: 2 x PICKS reads of ``evenflow.data``'s chitchat ``__getitem__`` -- chat template and
  tokenizer -- and their digests, once per loader); an iterable stream's window (digesting 4,096 samples of
  chitchat's real token content, ~740 tokens each); the gather of the window's sketch over the loader's gloo
  exchange; the verdict on the gathered table. The stream check runs once per loader, in the first round
  whose windows are complete; later epochs pay nothing.
- end to end: one epoch of an IterableDataset split per rank (4,096 chats each, budget 16,384, default buffer)
  with ``shard_check=True`` against ``False``, arms interleaved ABBA; the median of the per-pair differences
  and their spread. On a shared 2-core machine this is noise-bound: the parts say what the check adds.

    python benchmarks/loader/bench_shard_check.py [--pairs 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.*, <group>.*
from common.world import run_world  # noqa: E402

WINDOW = 4096
CHATS = 128  # chats tokenized once in the parent and cycled (a unique leading id each) into 4,096 per rank


def _timed(fn, reps: int) -> dict:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return {"median_ms": round(1e3 * statistics.median(times), 2), "min_ms": round(1e3 * min(times), 2),
            "max_ms": round(1e3 * max(times), 2), "reps": reps}


class _Stream(IterableDataset):
    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


def _samples(chats: list[dict], rank: int, n: int) -> list[dict]:
    out = []
    for k in range(n):
        base = chats[k % len(chats)]
        uid = torch.tensor([200_000 + rank * n + k])  # distinct samples: a correctly split stream
        out.append({"input_ids": torch.cat([uid, base["input_ids"]]), "labels": torch.cat([uid, base["labels"]])})
    return out


def _rank(rank: int, world: int, chats: list[dict], pairs: int) -> dict:
    import evenflow
    from evenflow.data import build_dataset
    from evenflow.runtime.comm import MetadataExchange, resolve_topology
    from evenflow.runtime.shard_check import content_print
    from evenflow.runtime.stream_check import StreamWindow, stream_verdict

    out: dict = {}
    chitchat = build_dataset("chitchat", cutoff=4096)
    out["content_print_chitchat"] = _timed(lambda: content_print(chitchat), 3)
    samples = _samples(chats, rank, WINDOW)

    def window():
        w = StreamWindow(WINDOW)
        for s in samples:
            w.add(s)
        return w

    out["window_digests_4096"] = _timed(window, 5)
    exchange = MetadataExchange(resolve_topology(None, timedelta(seconds=120)))
    row = window().sketch(world)
    out["sketch_gather"] = _timed(lambda: exchange.all_gather(row), 20)
    table = exchange.all_gather(row)
    out["verdict"] = _timed(lambda: stream_verdict(table, world), 20)
    out["refused"] = stream_verdict(table, world) is not None

    def epoch(check: bool) -> float:
        loader = evenflow.DynamicBatchLoader(_Stream(samples), token_budget=16384, shard_check=check,
                                             timeout=timedelta(seconds=300))
        t = time.perf_counter()
        with loader:
            for batch in loader:
                evenflow.pop_step_info(batch)
        return time.perf_counter() - t

    order = [True, False, False, True] * pairs
    times: dict = {True: [], False: []}
    for check in order[:2 * pairs]:
        times[check].append(epoch(check))
    out["epoch_s"] = {"on": [round(t, 3) for t in times[True]], "off": [round(t, 3) for t in times[False]]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=4, help="ABBA pairs of epochs (on, off)")
    args = parser.parse_args()
    from evenflow.data import build_dataset

    chitchat = build_dataset("chitchat", cutoff=4096)
    picks = np.random.default_rng(0).permutation(len(chitchat))[:CHATS]
    chats = [{k: chitchat[int(i)][k] for k in ("input_ids", "labels")} for i in picks]
    started = time.perf_counter()
    per_rank = run_world(_rank, 2, chats, args.pairs, timeout=3000)
    diffs = [on - off for r in per_rank for on, off in zip(r["epoch_s"]["on"], r["epoch_s"]["off"])]
    parts = {k: [r[k] for r in per_rank] for k in ("content_print_chitchat", "window_digests_4096", "sketch_gather",
                                                   "verdict")}
    stream_once_ms = max(sum(r[k]["median_ms"] for k in ("window_digests_4096", "sketch_gather", "verdict"))
                         for r in per_rank)
    out = {"world": 2, "window": WINDOW, "mean_tokens": round(float(np.mean([len(c["input_ids"]) for c in chats])), 1),
           "parts": parts, "map_check_once_ms": max(r["content_print_chitchat"]["median_ms"] for r in per_rank),
           "stream_check_once_ms": round(stream_once_ms, 2),
           "refused_split_streams": any(r["refused"] for r in per_rank),
           "epoch_s": [r["epoch_s"] for r in per_rank],
           "epoch_on_minus_off_s": {"median": round(statistics.median(diffs), 3), "min": round(min(diffs), 3),
                                    "max": round(max(diffs), 3), "pairs": len(diffs)},
           "seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
