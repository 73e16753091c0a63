"""The unsplit-stream check's detection and false-refusal rates, simulated on digests.

What it runs is the loader's own code: each rank's window of sample digests goes through
``evenflow.runtime.stream_check.sketch`` (the row a rank sends) and the gathered rows through ``stream_verdict``
(the refusal), exactly as in the first round whose windows are complete (NOTE [ Sharding mistakes ]). Only the
streams are simulated, a sample by its 62-bit digest:

- unsplit: N distinct samples; every rank reads all of them, shuffled with its own seed; its window is its first
  ``window`` samples (all of them when N <= window: that rank's stream is exhausted in the round).
- split, repeats in each stream ("own"): N distinct samples dealt round-robin to the ranks; each rank's stream
  then repeats ``dup`` of its own samples (a correctly split stream with naturally repeated samples).
- split, repeats in the data set ("dealt"): N distinct samples plus ``dup`` x N copies of samples drawn at
  random, shuffled, then dealt round-robin: a repeated sample's copies land on two ranks (W - 1) / W of the
  time -- the hard case, where split streams do share samples; its worst N is where the check's false
  refusals are (NOTE [ Sharding mistakes ]: at most ~0.3 % of seeds).

Streams read in order, their windows the first ``window`` samples of each rank (NOTE [ Neighbours dealt apart ]):

- neighbours: a crawl whose pages repeat in a row (``--neighbour-dup`` of them, 30 % by default) split
  interleaved, sample i to rank i mod W (``split_dataset_by_node`` when the shards do not divide by W): the
  copies of a page land on two ranks side by side; accepted means no false refusal.
- passes: a small data set (L samples, W window / 4 <= L < W window, not a multiple of W) repeated for two
  passes, then split interleaved: each sample trains twice an epoch, on two ranks; by content a rotated
  unsplit stream; refused.
- identical: unsplit, every rank reads the same order; rotated: unsplit, rank r starts ``r k`` samples in
  (k drawn in 1 .. window / 2); both refused.

Refused in the first round at the default buffer (4,096) means: before any batch when no warm-up round runs
earlier, else in the first round whose reads reach the window. ``--seeds`` seeds per (W, N); prints one JSON
line last::

    python benchmarks/loader/shard_check_sim.py --seeds 200
    python benchmarks/loader/shard_check_sim.py --seeds 200 --ordered-only   # the ordered rows alone
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from evenflow.runtime.stream_check import (ALPHA, MAX_WINDOW, MIN_SHARED, RATIO, sketch, sketch_width, stream_verdict,
                                           window_size)

DEFAULT_BUFFER = 4096
DETECT_N = (1_000, 10_000, 100_000, 1_000_000)
MISS_N = (2_000_000, 4_000_000, 16_000_000)
SPLIT_N = (1_000, 10_000, 30_000, 100_000, 300_000, 1_000_000)
WORLDS = (2, 4, 8, 16)


def _refused(windows: list[np.ndarray], window: int, world: int) -> bool:
    table = np.stack([sketch(w.tolist(), window, world) for w in windows])
    return stream_verdict(table, world) is not None


def unsplit(n: int, world: int, window: int, seed: int) -> bool:
    rng = np.random.default_rng([seed, n, world, 0])
    base = rng.integers(0, 2 ** 62, n, dtype=np.int64)
    take = min(window, n)
    windows = [base[rng.choice(n, take, replace=False)] for _ in range(world)]
    return _refused(windows, window, world)


def split(n: int, world: int, window: int, seed: int, dup: float, where: str) -> bool:
    rng = np.random.default_rng([seed, n, world, 1 if where == "dealt" else 2])
    base = rng.integers(0, 2 ** 62, n, dtype=np.int64)
    if where == "dealt":
        items = np.concatenate([base, base[rng.integers(0, n, int(round(dup * n)))]])
        rng.shuffle(items)
        shares = [items[r::world] for r in range(world)]
    else:
        shares = [base[r::world] for r in range(world)]
        shares = [np.concatenate([s, s[rng.integers(0, len(s), int(round(dup * len(s))))]]) for s in shares]
    windows = [s[rng.choice(len(s), min(window, len(s)), replace=False)] for s in shares]
    return _refused(windows, window, world)


ORDERED_WORLDS = (2, 4, 8)
ORDERED_N = 100_000


def _first_windows(shares: list[np.ndarray], window: int) -> list[np.ndarray]:
    return [s[:window] for s in shares]


def neighbours(world: int, window: int, seed: int, dup: float) -> bool:
    rng = np.random.default_rng([seed, world, 3])
    base = rng.integers(0, 2 ** 62, window * world, dtype=np.int64)
    stream = np.repeat(base, 1 + (rng.random(len(base)) < dup))
    return _refused(_first_windows([stream[r::world] for r in range(world)], window), window, world)


def passes(world: int, window: int, seed: int) -> bool:
    rng = np.random.default_rng([seed, world, 4])
    length = int(rng.integers(window // 4, window)) * world + int(rng.integers(1, world))  # not a multiple of W
    base = rng.integers(0, 2 ** 62, length, dtype=np.int64)
    stream = np.tile(base, 2)
    return _refused(_first_windows([stream[r::world] for r in range(world)], window), window, world)


def identical(world: int, window: int, seed: int, n: int = ORDERED_N) -> bool:
    rng = np.random.default_rng([seed, world, 5])
    base = rng.integers(0, 2 ** 62, n, dtype=np.int64)
    return _refused([base[:window]] * world, window, world)


def rotated(world: int, window: int, seed: int, n: int = ORDERED_N) -> bool:
    rng = np.random.default_rng([seed, world, 6])
    base = rng.integers(0, 2 ** 62, n, dtype=np.int64)
    k = int(rng.integers(1, window // 2 + 1))
    return _refused([np.roll(base, -r * k)[:window] for r in range(world)], window, world)


def ordered_rows(seeds: int, window: int, dup: float) -> dict:
    out: dict = {"neighbours_accepted": {}, "passes_refused": {}, "identical_refused": {}, "rotated_refused": {}}
    for world in ORDERED_WORLDS:
        rows = {"neighbours_accepted": seeds - sum(neighbours(world, window, s, dup) for s in range(seeds)),
                "passes_refused": sum(passes(world, window, s) for s in range(seeds)),
                "identical_refused": sum(identical(world, window, s) for s in range(seeds)),
                "rotated_refused": sum(rotated(world, window, s) for s in range(seeds))}
        for name, value in rows.items():
            out[name][f"W{world}"] = value
            print(f"{name} W={world}: {value}/{seeds}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--buffer-size", type=int, default=DEFAULT_BUFFER)
    parser.add_argument("--dup", type=float, default=0.05, help="duplicated fraction of the split streams")
    parser.add_argument("--neighbour-dup", type=float, default=0.3, help="pages repeated in a row (neighbours rows)")
    parser.add_argument("--ordered-only", action="store_true", help="only the streams read in order")
    parser.add_argument("--worlds", type=int, nargs="*", default=None, help="only these world sizes")
    parser.add_argument("--skip-large", action="store_true", help="skip the rows of 2M-16M samples")
    args = parser.parse_args()
    if args.worlds:
        global WORLDS, ORDERED_WORLDS
        WORLDS = tuple(w for w in WORLDS if w in args.worlds)
        ORDERED_WORLDS = tuple(w for w in ORDERED_WORLDS if w in args.worlds)
    window = window_size(args.buffer_size)
    started = time.perf_counter()
    out: dict = {"window": window, "max_window": MAX_WINDOW, "min_shared": MIN_SHARED, "ratio": RATIO,
                 "alpha": ALPHA, "seeds": args.seeds, "dup": args.dup, "neighbour_dup": args.neighbour_dup,
                 "sketch_width": {w: sketch_width(window, w) for w in WORLDS}}
    out["ordered"] = ordered_rows(args.seeds, window, args.neighbour_dup)
    if args.ordered_only:
        out["seconds"] = round(time.perf_counter() - started, 1)
        print(json.dumps(out))
        return
    detect, miss, accept = {}, {}, {"own": {}, "dealt": {}}
    for world in WORLDS:
        for n in DETECT_N:
            detect[f"W{world}_N{n}"] = sum(unsplit(n, world, window, s) for s in range(args.seeds))
            print(f"unsplit W={world} N={n:,}: refused {detect[f'W{world}_N{n}']}/{args.seeds}", flush=True)
        for where in ("own", "dealt"):
            for n in SPLIT_N:
                ok = args.seeds - sum(split(n, world, window, s, args.dup, where) for s in range(args.seeds))
                accept[where][f"W{world}_N{n}"] = ok
                print(f"split ({args.dup:.0%} repeated, {where}) W={world} N={n:,}: accepted {ok}/{args.seeds}",
                      flush=True)
    for world in () if args.skip_large else [w for w in (2, 4) if w in WORLDS]:
        for n in MISS_N:
            refused = sum(unsplit(n, world, window, s) for s in range(args.seeds))
            miss[f"W{world}_N{n}"] = args.seeds - refused
            print(f"unsplit W={world} N={n:,}: missed {args.seeds - refused}/{args.seeds}", flush=True)
    out.update(unsplit_refused=detect, unsplit_missed_large_n=miss, split_accepted=accept,
               min_refused_n_le_1m=min(detect.values()),
               min_accepted={where: min(v.values()) for where, v in accept.items()},
               false_refusals_dealt=sum(args.seeds - v for v in accept["dealt"].values()),
               trials_dealt=args.seeds * len(accept["dealt"]),
               expected_shared_pairs_w2_n1m=window ** 2 / 1_000_000, seconds=round(time.perf_counter() - started, 1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
