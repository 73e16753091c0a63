"""Randomized soak of DynamicBatchLoader's guarantees on real gloo process worlds (issue 10).

    python benchmarks/soak.py                      # make soak: >= 1,000 + >= 100 configurations
    python benchmarks/soak.py --configs 40 --fresh 3 --time-limit 110   # the slice `make test` runs
    python benchmarks/soak.py --elastic            # resume at another world size: every W -> W' in 1..4 (issue 20)

Each configuration (seeded) draws: world size 1-5, map-style or iterable data (uneven and empty per-rank
streams), workers 0-3 under fork/spawn/forkserver, buffer 1-4,096, accumulation 1-4, balance on/off, every
planning policy the loader offers (POLICIES), join or quota mode over 1-3 epochs, padded or summed cost,
pad_to_multiple_of, oversize policy (with over-budget samples injected), and a resume at a random step.
It runs the real loader, collation and gloo exchange code; nothing is modelled.

Two kinds of configuration:
- *pooled*: one long-lived process world per world size runs many configurations in sequence over one
  gloo group (fast: no interpreter start-up per configuration);
- *fresh*: a new process world per configuration (fresh interpreters; start methods matter there).

Checks per configuration, over all ranks and epochs: lost and duplicated sample-epochs (join: each sample
of each epoch exactly once; quota: every sample-epoch trained exactly once or still carried), batches over
budget (``StepInfo.padded_tokens`` and the real tensor; ``oversize="alone"`` may exceed it alone), unequal
step counts across ranks, and hangs (a configuration past its deadline: its world is killed and counted).
Any exception is an error, with one expected exception: a map-style configuration whose every sample is over
the budget under ``oversize="alone"`` has no sample that could stand in for an IDLE batch, so a rank that must
emit one raises a clear error naming ``idle_sample=`` and its peers a PeerError carrying it -- counted as
``expected_idle_errors`` when every rank ends with it, as an error anywhere else (``expects_idle_error``).
The last line printed is one JSON object with the totals.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset

import evenflow

# Every planning policy the loader runs; a new policy is one more entry here (it then runs in every
# configuration draw, and the soak totals cover it). The default, planning="auto", is not a policy of its own:
# it resolves to one of these from the configuration (NOTE [ The default planning policy ]), so the soak
# passes the policy explicitly and its totals are per resolved policy.
POLICIES = ["local", "global"] if "planning" in inspect.signature(evenflow.DynamicBatchLoader).parameters else ["local"]
CONTEXTS = ["fork", "spawn", "forkserver"]
BUDGET = 512


@dataclass(frozen=True)
class Config:
    id: int
    world: int
    iterable: bool
    sizes: tuple[int, ...]
    """Samples per rank (iterable) or in total (map-style: sizes[0])."""
    workers: int
    context: str | None
    buffer_size: int
    grad_accum_steps: int
    balance: bool
    planning: str
    join: bool
    epochs: int
    cost: str
    pad_to_multiple_of: int | None
    oversize: str
    oversized: int
    """Over-budget samples injected (only when oversize != "error")."""
    persistent: bool
    resume_at: int | None
    """Save after this many steps of the last epoch (at a window end), resume on a fresh loader."""
    seed: int
    max_steps_per_round: int


def draw_config(rng: np.random.Generator, cid: int, *, fresh: bool, scale: float = 1.0) -> Config:
    """One seeded configuration; ``scale`` shrinks the data (the `make test` slice)."""
    world = int(rng.integers(1, 6))
    iterable = bool(rng.random() < 0.4)
    if iterable:
        sizes = tuple(int(rng.choice([0, rng.integers(1, 8), rng.integers(8, 120)], p=[0.15, 0.2, 0.65]))
                      for _ in range(world))
    else:
        sizes = (int(rng.choice([0, rng.integers(1, 12), rng.integers(12, 260)], p=[0.05, 0.15, 0.8])),)
    sizes = tuple(int(n * scale) if n > 12 else n for n in sizes)
    workers = int(rng.integers(0, 4)) if fresh else int(rng.choice([0, 0, 0, 1]))
    context = (str(rng.choice(CONTEXTS)) if fresh else "fork") if workers else None
    join = bool(rng.random() < 0.5)
    planning = str(rng.choice(POLICIES))
    balance = bool(rng.random() < 0.4) and planning == "local"
    oversize = str(rng.choice(["error", "alone", "drop"]))
    persistent = bool(workers and rng.random() < 0.3)
    resume_at = int(rng.integers(1, 8)) if rng.random() < 0.3 else None
    if iterable and (not join or persistent):
        # Quota + iterable mid-stream: refused by design (a stream's carried samples live in memory only).
        # Persistent workers: the soak's pass numbering lives in the workers' dataset copies (not resumable).
        resume_at = None
    return Config(id=cid, world=world, iterable=iterable, sizes=sizes, workers=workers, context=context,
                  buffer_size=int(np.exp(rng.uniform(0, np.log(4096)))), grad_accum_steps=int(rng.integers(1, 5)),
                  balance=balance, planning=planning, join=join, epochs=3 if not join else int(rng.integers(1, 4)),
                  cost=str(rng.choice(["padded", "summed"])), pad_to_multiple_of=[None, 8][int(rng.integers(0, 2))],
                  oversize=oversize, oversized=int(rng.integers(1, 3)) if oversize != "error" else 0,
                  persistent=persistent, resume_at=resume_at, seed=int(rng.integers(0, 2**31)),
                  max_steps_per_round=int(rng.integers(1, 9)))


# -- data ----------------------------------------------------------------------------------------------------
def _lengths(n: int, seed: int, oversized: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.5, 1.0, n).astype(np.int64) + 1, 1, BUDGET - 8)
    if oversized and n:
        lengths[rng.choice(n, size=min(oversized, n), replace=False)] = BUDGET + 5
    return lengths


class MapData(Dataset):
    def __init__(self, n: int, seed: int, oversized: int) -> None:
        self.lengths = _lengths(n, seed, oversized)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        ids = torch.full((int(self.lengths[i]),), i % 1000 + 1, dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}


class StreamData(IterableDataset):
    """Rank r's stream; each sample tagged ``pass * 100_000 + position`` so re-reads and skips show.

    Pass numbers: the epoch the pass was opened in, where the iterating dataset copy sees ``set_epoch`` at
    that time (fresh workers copy it when a pass opens; join mode without workers runs each pass inside its
    epoch); otherwise a count of ``__iter__`` calls on the iterating copy (persistent workers, quota mode
    without workers, where a pass can run on into later epochs)."""

    def __init__(self, rank: int, n: int, seed: int, oversized: int, by_epoch: bool) -> None:
        self.rank = rank
        self.lengths = _lengths(n, seed, oversized)
        self.by_epoch, self.epoch, self.passes = by_epoch, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        pass_id = self.epoch if self.by_epoch else self.passes
        self.passes += 1
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for j in range(wid, len(self.lengths), nw):
            yield {"input_ids": torch.ones(int(self.lengths[j]), dtype=torch.long), "tag": _tag(self.rank, pass_id, j)}


def _tag(rank: int, pass_id: int, position: int) -> int:
    """A stream sample's identity: balancing and global planning train samples on other ranks than their own."""
    return (rank * 1_000 + pass_id) * 100_000 + position


IDLE = {"input_ids": torch.ones(1, dtype=torch.long), "tag": -1}


# -- one configuration on one rank ---------------------------------------------------------------------------
def _make(cfg: Config, rank: int, group) -> evenflow.DynamicBatchLoader:
    if cfg.iterable:
        by_epoch = (cfg.workers > 0 and not cfg.persistent) or (cfg.workers == 0 and cfg.join)
        ds = StreamData(rank, cfg.sizes[rank], cfg.seed + rank, cfg.oversized, by_epoch)
    else:
        ds = MapData(cfg.sizes[0], cfg.seed, cfg.oversized)
    kw = dict(planning=cfg.planning) if len(POLICIES) > 1 else {}
    return evenflow.DynamicBatchLoader(
        ds, token_budget=BUDGET, num_workers=cfg.workers, multiprocessing_context=cfg.context, join=cfg.join,
        persistent_workers=cfg.persistent,
        seed=cfg.seed, buffer_size=cfg.buffer_size, grad_accum_steps=cfg.grad_accum_steps, balance=cfg.balance,
        cost=cfg.cost, pad_to_multiple_of=cfg.pad_to_multiple_of, oversize=cfg.oversize,
        max_steps_per_round=cfg.max_steps_per_round, idle_sample=IDLE if cfg.iterable else None,
        process_group=group, timeout=timedelta(seconds=180), worker_timeout=timedelta(seconds=150), **kw)


def _over_budget(cfg: Config, info, batch) -> bool:
    ids = batch["input_ids"]
    real = ids.numel() if cfg.cost == "summed" else ids.shape[0] * ids.shape[1]
    if cfg.cost == "summed" and cfg.pad_to_multiple_of:
        real = ids.numel()
    alone = info.local_samples == 1 and cfg.oversize == "alone"
    return not alone and (info.padded_tokens > BUDGET or real > BUDGET)


def _epoch(cfg: Config, loader, stop_after: int | None = None) -> tuple[list, int, int, dict | None]:
    """One pass over ``loader``: (trained keys, steps, batches over budget, state if it stopped early)."""
    seen, steps, over = [], 0, 0
    for batch in loader:
        info = evenflow.pop_step_info(batch)
        steps += 1
        over += _over_budget(cfg, info, batch)
        if not info.is_idle:
            seen.extend(batch["tag"] if cfg.iterable else info.sample_ids)
        if stop_after is not None and steps >= stop_after and info.window_end:
            return seen, steps, over, loader.state_dict()  # every rank stops here: the steps are aligned
    return seen, steps, over, None


def run_config(cfg: Config, rank: int, group) -> dict:
    """Train ``cfg.epochs`` epochs (resuming on a fresh loader mid-way through the last one if asked)."""
    loader = _make(cfg, rank, group)
    epochs, over = [], 0
    for epoch in range(cfg.epochs):
        loader.set_epoch(epoch)
        last = epoch == cfg.epochs - 1
        seen, steps, bad, state = _epoch(cfg, loader, cfg.resume_at if last else None)
        if state is not None:
            loader.close()
            loader = _make(cfg, rank, group)
            loader.load_state_dict(state)
            loader.set_epoch(epoch)
            more, more_steps, more_bad, _ = _epoch(cfg, loader)
            seen, steps, bad = seen + more, steps + more_steps, bad + more_bad
        over += bad
        epochs.append(dict(seen=[int(x) for x in seen], steps=steps))
    carry = loader.state_dict()["next_carry"]
    dropped = list(loader.dropped)
    loader.close()
    return dict(epochs=epochs, over=over, carry=[list(k) if isinstance(k, tuple) else k for k in carry],
                dropped=dropped)


# -- checks ----------------------------------------------------------------------------------------------------
def check(cfg: Config, per_rank: list[dict]) -> dict:
    """lost, duplicated, over_budget, unequal_steps of one configuration (all ranks' results)."""
    unequal = sum(len({r["epochs"][e]["steps"] for r in per_rank}) > 1 for e in range(cfg.epochs))
    over = sum(r["over"] for r in per_rank)
    lost = dup = 0
    if cfg.iterable:
        everything = collections.Counter(t for r in per_rank for ep in r["epochs"] for t in ep["seen"])
        dup += sum(c - 1 for c in everything.values() if c > 1)
        for rank, r in enumerate(per_rank):
            l, d = _check_stream(cfg, rank, r, {t for t in everything if t // 100_000 // 1_000 == rank})
            lost, dup = lost + l, dup + d
    else:
        l, d = _check_map(cfg, per_rank)
        lost, dup = lost + l, dup + d
    return dict(lost=lost, duplicated=dup, over_budget=over, unequal_steps=unequal)


IDLE_ERROR = ("must emit an IDLE batch but the first", "over token_budget=", "idle_sample=")
"""What the loader's error says when no sample within the budget can be an IDLE placeholder
(``DynamicBatchLoader._first_within_budget``); a peer's PeerError carries the same message."""


def expects_idle_error(cfg: Config) -> bool:
    """Every sample over the budget under ``oversize="alone"``, map-style (iterable runs pass ``idle_sample``):
    an IDLE placeholder within the budget is impossible, so the loader may end with the ``idle_sample=`` error
    (it must, on every rank, when some rank has to emit an IDLE step; when none has to, the run is checked as
    any other)."""
    n = cfg.sizes[0]
    return (not cfg.iterable and cfg.oversize == "alone" and n > 0
            and bool((_lengths(n, cfg.seed, cfg.oversized) > BUDGET).all()))


@dataclass(frozen=True)
class Failed:
    """A configuration that raised: the first error's text, and every rank's error text (None: no error)."""

    detail: str
    per_rank: tuple[str | None, ...]

    def only_idle_errors(self) -> bool:
        """Every rank ended with the no-placeholder error (its own, or a peer's carried by PeerError)."""
        return all(e is not None and all(part in e.split("\n")[0] for part in IDLE_ERROR) for e in self.per_rank)


def _oversized(cfg: Config, n: int, seed: int) -> set:
    return set(np.flatnonzero(_lengths(n, seed, cfg.oversized) > BUDGET).tolist()) if cfg.oversize == "drop" else set()


def _check_map(cfg: Config, per_rank: list[dict]) -> tuple[int, int]:
    n = cfg.sizes[0]
    dropped = _oversized(cfg, n, cfg.seed)
    counts = collections.Counter(i for r in per_rank for ep in r["epochs"] for i in ep["seen"])
    if cfg.join:
        want = {i: cfg.epochs for i in range(n) if i not in dropped}
        per_epoch_dup = sum(c - 1 for r in [per_rank] for e in range(cfg.epochs)
                            for c in collections.Counter(i for rr in r for i in rr["epochs"][e]["seen"]).values()
                            if c > 1)
        lost = sum(max(0, w - counts.get(i, 0)) for i, w in want.items())
        return lost, per_epoch_dup + sum(max(0, c - want.get(i, 0)) for i, c in counts.items())
    carried = collections.Counter(k[1] if isinstance(k, list) else k for r in per_rank for k in r["carry"])
    lost = dup = 0
    for i in range(n):
        if i in dropped:
            continue
        total = counts.get(i, 0) + carried.get(i, 0)
        lost += max(0, cfg.epochs - total)
        dup += max(0, total - cfg.epochs)
    return lost, dup


def _check_stream(cfg: Config, rank: int, r: dict, trained: set) -> tuple[int, int]:
    """Rank ``rank``'s stream, against the tags of its samples trained on any rank (duplicates counted
    by the caller). ``r``: this rank's results (its carried buffer)."""
    n = cfg.sizes[rank]
    dropped = _oversized(cfg, n, cfg.seed + rank)
    dup = 0
    if cfg.join:  # every epoch is a full pass: tags (pass e, j) for every j
        occurrences = [_tag(rank, p, j) for p in range(cfg.epochs) for j in range(n) if j not in dropped]
        want = set(occurrences)
        lost = len(want - set(trained))
        return lost, dup + len(set(trained) - want)
    # Quota: untrained occurrences may only be the unread tail of the stream plus what the buffer carries.
    occurrences = [_tag(rank, p, j) for p in range(cfg.epochs) for j in range(n) if j not in dropped]
    untrained = [k for k, t in enumerate(occurrences) if t not in trained]
    tail = 0
    while tail < len(untrained) and untrained[-1 - tail] == len(occurrences) - 1 - tail:
        tail += 1
    lost = max(0, len(untrained) - tail - len(r["carry"]))
    return lost, dup + len(set(trained) - set(occurrences))


# -- process worlds ----------------------------------------------------------------------------------------------
def _child(rank: int, world: int, tmp: str, cfgs: list[Config]) -> None:
    torch.set_num_threads(1)
    progress = os.path.join(tmp, f"progress-{rank}")
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                                timeout=timedelta(seconds=240))
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=240)) if world > 1 else None
        try:
            for cfg in cfgs:
                with open(progress, "a") as f:
                    f.write(f"{cfg.id} {time.time()}\n")
                try:
                    result = ("ok", run_config(cfg, rank, group))
                except Exception as exc:  # noqa: BLE001 - an unexpected error is a finding, reported
                    result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}")
                with open(os.path.join(tmp, f"result-{cfg.id}-{rank}.pkl"), "wb") as f:
                    pickle.dump(result, f)
                if result[0] == "error":
                    break  # peers may be inside a collective: the parent restarts the world
        finally:
            dist.destroy_process_group()
    finally:
        os._exit(0)


def run_world(cfgs: list[Config], world: int, deadline_s: float, start_method: str) -> dict[int, object]:
    """Run ``cfgs`` in order on one world; restart it after a hang or an error. Returns id -> per-rank results,
    or "hang" / an error string."""
    out: dict[int, object] = {}
    todo = list(cfgs)
    ctx = mp.get_context(start_method)
    while todo:
        with tempfile.TemporaryDirectory() as tmp:
            procs = [ctx.Process(target=_child, args=(r, world, tmp, todo)) for r in range(world)]
            for p in procs:
                p.start()
            current, started = None, time.monotonic()
            while any(p.is_alive() for p in procs):
                now_cfg = _current(tmp, world)
                if now_cfg != current:
                    current, started = now_cfg, time.monotonic()
                if time.monotonic() - started > deadline_s:
                    for p in procs:
                        p.kill()
                    break
                time.sleep(0.05)
            for p in procs:
                p.join(5)
            done = _collect(tmp, todo, world, out)
            if done < len(todo):  # the first unfinished configuration hung or failed: skip it, go on
                cfg = todo[done]
                out.setdefault(cfg.id, _failure(tmp, cfg, world))
                todo = todo[done + 1:]
            else:
                todo = []
    return out


def _current(tmp: str, world: int):
    ids = []
    for r in range(world):
        try:
            with open(os.path.join(tmp, f"progress-{r}")) as f:
                lines = f.read().split("\n")
            ids.append(int(lines[-2].split()[0]) if len(lines) > 1 else None)
        except FileNotFoundError:
            ids.append(None)
    return tuple(ids)


def _load(tmp: str, cfg: Config, rank: int):
    try:
        with open(os.path.join(tmp, f"result-{cfg.id}-{rank}.pkl"), "rb") as f:
            return pickle.load(f)
    except (FileNotFoundError, EOFError):
        return None


def _failure(tmp: str, cfg: Config, world: int) -> Failed | str:
    """The first unfinished configuration of a world: "hang" (no rank raised), else a :class:`Failed`."""
    results = [_load(tmp, cfg, r) for r in range(world)]
    errors = tuple(res[1] if res is not None and res[0] == "error" else None for res in results)
    first = next((r for r, e in enumerate(errors) if e is not None), None)
    if first is None:
        return "hang"  # no result at all, or some ranks finished and the others never did
    return Failed(f"rank {first}: {errors[first]}", errors)


def _collect(tmp: str, todo: list[Config], world: int, out: dict) -> int:
    for k, cfg in enumerate(todo):
        results = [_load(tmp, cfg, r) for r in range(world)]
        if any(res is None or res[0] != "ok" for res in results):
            return k
        out[cfg.id] = [res[1] for res in results]
    return len(todo)


# -- driver --------------------------------------------------------------------------------------------------------
def soak(seed: int, pooled: int, fresh: int, time_limit: float, deadline_s: float = 300.0, scale: float = 1.0,
         max_world: int = 5) -> dict:
    started = time.monotonic()
    rng = np.random.default_rng(seed)
    cfgs = [_capped(draw_config(rng, i, fresh=False, scale=scale), max_world) for i in range(pooled)]
    fresh_cfgs = [_capped(draw_config(rng, pooled + i, fresh=True, scale=scale), max_world) for i in range(fresh)]
    results: dict[int, object] = {}
    by_world = collections.defaultdict(list)
    for cfg in cfgs:
        by_world[cfg.world].append(cfg)
    # Fresh worlds first (each costs interpreter start-ups), interleaved with pooled chunks so that a time
    # limit cuts both kinds, never one whole kind.
    chunks = [(w, group[i:i + 50]) for w, group in sorted(by_world.items()) for i in range(0, len(group), 50)]
    queue = []
    for k in range(max(len(chunks), len(fresh_cfgs))):
        if k < len(fresh_cfgs):
            queue.append(("fresh", fresh_cfgs[k].world, [fresh_cfgs[k]]))
        if k < len(chunks):
            queue.append(("pooled", chunks[k][0], chunks[k][1]))
    for kind, world, batch in queue:
        if time.monotonic() - started > time_limit:
            break
        results.update(run_world(batch, world, deadline_s, "spawn"))
    return summarize(cfgs + fresh_cfgs, results, seed, time.monotonic() - started, len(cfgs))


def _capped(cfg: Config, max_world: int) -> Config:
    if cfg.world <= max_world:
        return cfg
    from dataclasses import replace
    return replace(cfg, world=max_world, sizes=cfg.sizes[:max_world] if cfg.iterable else cfg.sizes)


def summarize(cfgs: list[Config], results: dict, seed: int, wall: float, n_pooled: int) -> dict:
    totals = dict(lost=0, duplicated=0, over_budget=0, unequal_steps=0, hangs=0, errors=0, expected_idle_errors=0)
    kinds = collections.Counter()
    by_policy = collections.defaultdict(lambda: collections.Counter())
    failures = []
    for cfg in cfgs:
        if cfg.id not in results:
            continue
        res = results[cfg.id]
        kinds["configs"] += 1
        kinds["fresh" if cfg.id >= n_pooled else "pooled"] += 1
        if res == "hang":
            found = dict(hangs=1)
        elif isinstance(res, Failed):
            expected = expects_idle_error(cfg) and res.only_idle_errors()
            found = dict(expected_idle_errors=1) if expected else dict(errors=1)
        else:
            found = check(cfg, res)
        for k, v in found.items():
            totals[k] += v
            by_policy[cfg.planning][k] += v
        by_policy[cfg.planning]["configs"] += 1
        if any(v for k, v in found.items() if k != "expected_idle_errors"):
            failures.append(dict(config=asdict(cfg), found=found,
                                 detail=res.detail if isinstance(res, Failed) else None))
    for f in failures[:20]:
        print("FAILED", json.dumps(f, default=str)[:3000], flush=True)
    return dict(configs=kinds["configs"], pooled=kinds["pooled"], fresh=kinds["fresh"], **totals, policies=POLICIES,
                seed=seed, wall_s=round(wall, 1),
                by_policy={k: dict(v) for k, v in by_policy.items()}, failures=len(failures))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", type=int, default=1000, help="pooled configurations (long-lived worlds)")
    parser.add_argument("--fresh", type=int, default=100, help="configurations each on a fresh process world")
    parser.add_argument("--time-limit", type=float, default=1800.0, help="seconds; stops starting new worlds after")
    parser.add_argument("--deadline", type=float, default=300.0, help="per-configuration seconds before a hang")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the data sizes (the make-test slice)")
    parser.add_argument("--max-world", type=int, default=5)
    parser.add_argument("--elastic", action="store_true", help="instead: the W -> W' resume sweep "
                        "(benchmarks/elastic_sweep.py, every pair in 1..4; --configs N runs a random slice of N)")
    args = parser.parse_args(argv)
    if args.elastic:
        from elastic_sweep import sweep  # benchmarks/ is the script's own folder
        out = sweep(args.seed, None if "--configs" not in (argv or sys.argv) else args.configs, min(args.max_world, 4),
                    args.time_limit)
        print(json.dumps(out), flush=True)
        return out
    out = soak(args.seed, args.configs, args.fresh, args.time_limit, args.deadline, args.scale, args.max_world)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
