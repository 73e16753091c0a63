"""Randomized soak of DynamicBatchLoader's guarantees on real gloo process worlds (issue 10).

    python benchmarks/failures/soak.py                # make soak: >= 1,000 + >= 100 configurations, <= 30 min
    python benchmarks/failures/soak.py --configs 40 --fresh 3 --time-limit 110   # the slice `make test` runs
    python benchmarks/failures/soak.py --elastic      # resume at another world size: every W -> W' in 1..4 (issue 20)

Each configuration (seeded) draws: world size 1-5, map-style or iterable data (uneven and empty per-rank
streams; half the streams dealt to their DataLoader workers unevenly, one worker's share empty), workers 0-3 under fork/spawn/forkserver, buffer 1-4,096, accumulation 1-4, balance on/off, every
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

Issue 19 adds two draws: ``views`` (every sample a view of one shared corpus tensor) and, for about 30% of
the configurations, a *fault epoch* after the checked ones, with one of FAULTS injected: a stop near the end
(rank 1 breaks 1-3 steps before the epoch's last), a collate_fn that raises, a moved sample its receiver cannot
unpickle, a collate_fn that blocks past worker_timeout, a SIGKILLed DataLoader worker, ranks that disagree on
planning_group. Checked there: ``silent_ends`` (a rank ended the epoch normally although a peer stopped
early or failed), ``fault_unequal`` (ranks yielded different numbers of batches before a fault was raised),
``wrong_errors`` (anything but the fault's own error, PeerError or PeerStopped); ``faults_fired`` counts the
fault epochs in which the fault happened (a sample may stay home, a collate target may be carried on).
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
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset

import evenflow

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.*, <group>.*

# Every planning policy the loader runs; a new policy is one more entry here (it then runs in every
# configuration draw, and the soak totals cover it). The default, planning="auto", is not a policy of its own:
# it resolves to one of these from the configuration (NOTE [ The default planning policy ]), so the soak
# passes the policy explicitly and its totals are per resolved policy.
POLICIES = ["local", "global"] if "planning" in inspect.signature(evenflow.DynamicBatchLoader).parameters else ["local"]
CONTEXTS = ["fork", "spawn", "forkserver"]
MAX_TIME_LIMIT_S = 1800.0
"""The full soak's bound (issue 19): no world starts after it; a running one ends within its deadline."""
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
    views: bool = False
    """Samples are views of one shared corpus tensor (a moved one must travel as its own bytes)."""
    fault: str | None = None
    """One more epoch after the checked ones, with this fault injected (FAULTS); None: no fault epoch."""
    uneven: bool = False
    """Iterable: the stream's positions are dealt to the DataLoader workers in blocks of unequal length, the last
    worker's empty (files over workers), so torch stops workers at different times (at least 2 workers)."""
    pause_s: float = 0.0
    """Uneven, fresh: worker 0 pauses this long once per pass, so its siblings are gone for seconds meanwhile."""


FAULTS = ("stop_end", "collate_fail", "unpickle", "blocking", "kill_worker", "group_mismatch")
"""Issue 19's classes, injected in a last epoch: a stop near the end, a collate_fn that raises, a moved sample
its receiver cannot unpickle, a collate_fn that blocks past worker_timeout, a DataLoader worker killed by
SIGKILL (configurations with workers), ranks that disagree on planning_group (global planning, >= 2 ranks)."""


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
    cfg = Config(id=cid, world=world, iterable=iterable, sizes=sizes, workers=workers, context=context,
                 buffer_size=int(np.exp(rng.uniform(0, np.log(4096)))), grad_accum_steps=int(rng.integers(1, 5)),
                 balance=balance, planning=planning, join=join, epochs=3 if not join else int(rng.integers(1, 4)),
                 cost=str(rng.choice(["padded", "summed"])), pad_to_multiple_of=[None, 8][int(rng.integers(0, 2))],
                 oversize=oversize, oversized=int(rng.integers(1, 3)) if oversize != "error" else 0,
                 persistent=persistent, resume_at=resume_at, seed=int(rng.integers(0, 2**31)),
                 max_steps_per_round=int(rng.integers(1, 9)))
    # Drawn last, so that the fields above stay what they were for a given seed.
    views = bool(rng.random() < 0.3)
    fault = str(rng.choice(FAULTS)) if rng.random() < 0.3 else None
    if fault == "kill_worker" and not workers or fault == "group_mismatch" and planning != "global":
        fault = "collate_fail"
    if fault in ("stop_end", "group_mismatch", "unpickle") and world == 1:
        fault = None  # nothing to stop, disagree with, or move to
    cfg = replace(cfg, views=views, fault=fault)
    if iterable and rng.random() < 0.5:  # uneven worker shards: at least 2 workers, one of them with nothing
        cfg = replace(cfg, uneven=True, workers=max(workers, 2), context=context or "fork",
                      pause_s=UNEVEN_PAUSE_S if fresh else 0.0)
    return cfg


UNEVEN_PAUSE_S = 1.5
"""Longer than the dead-worker watch's grace (evenflow.runtime.calls.DEATH_GRACE_S): an exhausted sibling is
seen gone while the stream waits (NOTE [ Workers that end early ] in evenflow.runtime.source)."""


def worker_positions(n: int, workers: int, uneven: bool) -> list[list[int]]:
    """The stream positions each DataLoader worker yields: round-robin, or (``uneven``) worker 0 the first two
    thirds, the middle workers the rest in blocks, the last worker none."""
    if not uneven or workers < 2:
        return [list(range(w, n, max(workers, 1))) for w in range(max(workers, 1))]
    if workers == 2:
        return [list(range(n)), []]
    head = n - n // 3
    middle = [b.tolist() for b in np.array_split(np.arange(head, n), workers - 2)]
    return [list(range(head)), *middle, []]


def read_order(n: int, workers: int, uneven: bool) -> list[int]:
    """Positions in the order the DataLoader yields them: its workers in turn, an exhausted one skipped."""
    lists, out = worker_positions(n, workers, uneven), []
    for k in range(max((len(x) for x in lists), default=0)):
        out.extend(x[k] for x in lists if k < len(x))
    return out


# -- data ----------------------------------------------------------------------------------------------------
def _lengths(n: int, seed: int, oversized: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.5, 1.0, n).astype(np.int64) + 1, 1, BUDGET - 8)
    if oversized and n:
        lengths[rng.choice(n, size=min(oversized, n), replace=False)] = BUDGET + 5
    return lengths


CORPUS_TOKENS = 1 << 20
"""The shared corpus of ``views`` configurations (8 MiB of int64): every sample is a view into it."""


def _ids(n: int, fill: int, corpus: torch.Tensor | None, at: int) -> torch.Tensor:
    if corpus is None:
        return torch.full((n,), fill, dtype=torch.long)
    a = at % (CORPUS_TOKENS - BUDGET - 8)
    return corpus[a:a + n]


class MapData(Dataset):
    def __init__(self, n: int, seed: int, oversized: int, views: bool = False) -> None:
        self.lengths = _lengths(n, seed, oversized)
        self.corpus = torch.ones(CORPUS_TOKENS, dtype=torch.long) if views else None

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        ids = _ids(int(self.lengths[i]), i % 1000 + 1, self.corpus, 977 * i)
        return {"input_ids": ids, "labels": ids if self.corpus is not None else ids.clone()}


class StreamData(IterableDataset):
    """Rank r's stream; each sample tagged ``pass * 100_000 + position`` so re-reads and skips show.

    Pass numbers: the epoch the pass was opened in, where the iterating dataset copy sees ``set_epoch`` at
    that time (fresh workers copy it when a pass opens; join mode without workers runs each pass inside its
    epoch); otherwise a count of ``__iter__`` calls on the iterating copy (persistent workers, quota mode
    without workers, where a pass can run on into later epochs)."""

    def __init__(self, rank: int, n: int, seed: int, oversized: int, by_epoch: bool, views: bool = False,
                 uneven: bool = False, pause_s: float = 0.0) -> None:
        self.rank, self.uneven, self.pause_s = rank, uneven, pause_s
        self.lengths = _lengths(n, seed, oversized)
        self.by_epoch, self.epoch, self.passes = by_epoch, 0, 0
        self.corpus = torch.ones(CORPUS_TOKENS, dtype=torch.long) if views else None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        pass_id = self.epoch if self.by_epoch else self.passes
        self.passes += 1
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for k, j in enumerate(worker_positions(len(self.lengths), nw, self.uneven)[wid]):
            if k == 1 and wid == 0 and self.pause_s:
                time.sleep(self.pause_s)
            yield {"input_ids": _ids(int(self.lengths[j]), 1, self.corpus, 977 * j), "tag": _tag(self.rank, pass_id, j)}


def _tag(rank: int, pass_id: int, position: int) -> int:
    """A stream sample's identity: balancing and global planning train samples on other ranks than their own."""
    return (rank * 1_000 + pass_id) * 100_000 + position


IDLE = {"input_ids": torch.ones(1, dtype=torch.long), "tag": -1}


# -- one configuration on one rank ---------------------------------------------------------------------------
def _make(cfg: Config, rank: int, group, **overrides) -> evenflow.DynamicBatchLoader:
    if cfg.iterable:
        by_epoch = (cfg.workers > 0 and not cfg.persistent) or (cfg.workers == 0 and cfg.join)
        ds = StreamData(rank, cfg.sizes[rank], cfg.seed + rank, cfg.oversized, by_epoch, cfg.views, cfg.uneven,
                        cfg.pause_s)
    else:
        ds = MapData(cfg.sizes[0], cfg.seed, cfg.oversized, cfg.views)
    kw = dict(planning=cfg.planning) if len(POLICIES) > 1 else {}
    kw = dict(kw, dataset=overrides.pop("dataset", ds)) | overrides
    return evenflow.DynamicBatchLoader(
        token_budget=BUDGET, num_workers=cfg.workers, multiprocessing_context=cfg.context, join=cfg.join,
        persistent_workers=cfg.persistent,
        seed=cfg.seed, buffer_size=cfg.buffer_size, grad_accum_steps=cfg.grad_accum_steps, balance=cfg.balance,
        cost=cfg.cost, pad_to_multiple_of=cfg.pad_to_multiple_of, oversize=cfg.oversize,
        max_steps_per_round=cfg.max_steps_per_round, idle_sample=IDLE if cfg.iterable else None,
        process_group=group, **(dict(timeout=timedelta(seconds=180), worker_timeout=timedelta(seconds=150)) | kw))


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
    out = dict(epochs=epochs, over=over, carry=[list(k) if isinstance(k, tuple) else k for k in carry],
               dropped=dropped)
    if cfg.fault is not None:
        out["fault"] = run_fault(cfg, rank, group)
    return out


# -- the fault epoch (issue 19) ----------------------------------------------------------------------------------
FAULT_RANK = 1
"""The rank a fault is injected on (the last rank in a world of 2)."""


class _Collate:
    """The default collate, after a fault on the sample tagged ``at`` (``fail``: raise; ``block``: sleep past
    worker_timeout); it drops the ``trap`` key (an object that only loads on its home rank)."""

    def __init__(self, cost: str, pad: int | None, at: int | None, mode: str) -> None:
        self.inner = evenflow.FlatCollate(pad_to_multiple_of=pad) if cost == "summed" else evenflow.PadCollate(
            pad_to_multiple_of=pad)
        self.at, self.mode = at, mode

    def __call__(self, samples):
        if self.at is not None and any(int(s.get("tag", -2)) == self.at for s in samples):
            if self.mode == "fail":
                raise KeyError(f"injected collate failure on the sample tagged {self.at}")
            time.sleep(6)  # past the fault epoch's worker_timeout (2 s); bounded
        return self.inner([{k: v for k, v in s.items() if k != "trap"} for s in samples])


def _load_only_at(home: int):
    if os.getpid() != home:
        raise ValueError(f"injected: this object loads only in process {home}")
    return _Trap(home)


class _Trap:
    """Pickles anywhere; unpickles only in its home process (a rank's own worker hands it to that rank)."""

    def __init__(self, home: int) -> None:
        self.home = home

    def __reduce__(self):
        return _load_only_at, (self.home,)


class _Faulty(Dataset):
    """The configuration's map-style data, tagged; on the fault rank every sample carries a :class:`_Trap` that
    loads only in that rank's process (``home``: its pid, recorded before any worker starts)."""

    def __init__(self, inner: MapData, home: int | None) -> None:
        self.inner, self.home = inner, home

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict:
        sample = dict(self.inner[i], tag=i)
        if self.home is not None:
            sample["trap"] = _Trap(self.home)
        return sample


class _FaultyStream(IterableDataset):
    def __init__(self, inner: StreamData, home: int | None) -> None:
        self.inner, self.home = inner, home

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self):
        for sample in self.inner:
            if self.home is not None:
                sample["trap"] = _Trap(self.home)
            yield sample


class _NotePid:
    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, worker_id: int) -> None:
        if worker_id == 0:
            with open(self.path, "w") as f:
                f.write(str(os.getpid()))


def _fault_data(cfg: Config, rank: int) -> Dataset:
    trap = os.getpid() if cfg.fault == "unpickle" and rank == FAULT_RANK else None
    if cfg.iterable:
        by_epoch = (cfg.workers > 0 and not cfg.persistent) or (cfg.workers == 0 and cfg.join)
        return _FaultyStream(StreamData(rank, cfg.sizes[rank], cfg.seed + rank, cfg.oversized, by_epoch, cfg.views,
                                        cfg.uneven, cfg.pause_s), trap)
    return _Faulty(MapData(cfg.sizes[0], cfg.seed, cfg.oversized, cfg.views), trap)


def _fault_target(cfg: Config) -> int | None:
    """The tag of the sample a collate fault fires on: the middle of the fault rank's (or the only) stream."""
    if cfg.iterable:
        n = cfg.sizes[min(FAULT_RANK, cfg.world - 1)]
        return _tag(min(FAULT_RANK, cfg.world - 1), cfg.epochs, n // 2) if n else None
    return cfg.sizes[0] // 2 if cfg.sizes[0] else None


def _pass(loader, epoch: int, body=None) -> dict:
    """One epoch; ``body(step)`` may return "break". What this rank saw: steps, and how the epoch ended."""
    loader.set_epoch(epoch)
    steps = 0
    try:
        for batch in loader:
            evenflow.pop_step_info(batch)
            steps += 1
            if body is not None and body(steps) == "break":
                return dict(steps=steps, ended="break", error=None)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return dict(steps=steps, ended="error", error=f"{type(exc).__name__}: {str(exc)[:400]}")
    return dict(steps=steps, ended="normally", error=None)


def run_fault(cfg: Config, rank: int, group) -> dict:
    """The fault epoch: what this rank saw (checked by :func:`check_fault` against every rank's outcome)."""
    epoch = cfg.epochs  # a fresh epoch after the checked ones
    kind = cfg.fault
    faulty = rank == min(FAULT_RANK, cfg.world - 1)
    collate = dict(collate_fn=_Collate(cfg.cost, cfg.pad_to_multiple_of, _fault_target(cfg),
                                       "fail" if kind == "collate_fail" else "block"))
    if kind == "group_mismatch":
        try:
            loader = _make(cfg, rank, group, planning_group=1 if rank == 0 else cfg.world)
        except Exception as exc:  # noqa: BLE001
            return dict(steps=0, ended="error", error=f"{type(exc).__name__}: {str(exc)[:400]}")
        out = _pass(loader, epoch)
        loader.close()
        return out
    if kind == "stop_end":
        loader = _make(cfg, rank, group)
        total = _pass(loader, epoch)["steps"]
        stop_at = max(1, total - 1 - cfg.seed % 3)
        out = _pass(loader, epoch, (lambda step: "break" if faulty and step == stop_at else None))
        loader.close()
        return dict(out, stop_at=stop_at, stopper=faulty)
    # worker_timeout bounds the blocking call (2 s); for the other faults it only has to let DataLoader workers
    # start: 5 ranks x 3 spawn/forkserver workers each import torch, ~30 s on 2 cores (10 s timed out there).
    bounds = dict(timeout=timedelta(seconds=60), worker_timeout=timedelta(seconds=2 if kind == "blocking" else 45))
    extra = {}
    if kind == "kill_worker":
        path = os.path.join(tempfile.gettempdir(), f"evenflow-soak-{os.getpid()}-{cfg.id}")
        extra = dict(worker_init_fn=_NotePid(path))

        def body(step):
            if faulty and step == 2:
                with open(path) as f:
                    try:
                        os.kill(int(f.read()), 9)
                    except ProcessLookupError:  # the worker already finished its stream: nothing to kill
                        pass
        loader = _make(cfg, rank, group, dataset=_fault_data(cfg, rank), **collate, **bounds, **extra)
        out = _pass(loader, epoch, body)
    else:
        loader = _make(cfg, rank, group, dataset=_fault_data(cfg, rank), **collate, **bounds)
        out = _pass(loader, epoch)
    loader.close()
    return out


FAULT_ERRORS = {"collate_fail": ("KeyError", "injected collate failure"),
                "unpickle": ("RuntimeError", "cannot unpickle"),
                "blocking": ("TimeoutError", "did not return within worker_timeout"),
                "kill_worker": ("RuntimeError", "died while the loader waited"),
                "group_mismatch": ("ValueError", "ranks disagree on the planning configuration")}
"""A fault's own error on the rank it hits: (type, a phrase of its message); every other rank: PeerError."""


def check_fault(cfg: Config, per_rank: list[dict]) -> dict:
    """silent_ends: a rank ended the fault epoch normally although a peer stopped early or failed (the fault
    reached it as nothing); fault_unequal: ranks yielded different numbers of batches before a loader fault;
    wrong_errors: a rank raised something else than the fault's own error or a PeerError/PeerStopped naming
    it; faults_fired: the fault happened (a collate target may be carried past the epoch, a sample may stay
    home)."""
    outs = [r["fault"] for r in per_rank]
    found = dict(silent_ends=0, fault_unequal=0, wrong_errors=0, faults_fired=0)
    if cfg.fault == "stop_end":
        stopper = next(o for o in outs if o["stopper"])
        if stopper["ended"] == "break":
            found["faults_fired"] = 1
            for o in outs:
                if o is stopper:
                    continue
                if o["ended"] == "normally" and o["steps"] > stopper["steps"]:
                    found["silent_ends"] += 1
                elif o["ended"] == "error" and not o["error"].startswith("PeerStopped"):
                    found["wrong_errors"] += 1
        return found
    raised = [o for o in outs if o["ended"] == "error"]
    if not raised:
        return found
    found["faults_fired"] = 1
    found["silent_ends"] = sum(o["ended"] != "error" for o in outs)
    found["fault_unequal"] = int(len({o["steps"] for o in outs}) > 1)
    own_type, phrase = FAULT_ERRORS[cfg.fault]
    for o in raised:
        ok = o["error"].startswith("PeerError") or (o["error"].startswith(own_type) and phrase in o["error"])
        found["wrong_errors"] += not ok or (o["error"].startswith("PeerError") and phrase not in o["error"]
                                            and cfg.fault != "group_mismatch")
    return found


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
    found = dict(lost=lost, duplicated=dup, over_budget=over, unequal_steps=unequal)
    if cfg.fault is not None:
        found.update(check_fault(cfg, per_rank), fault_configs=1)
    return found


IDLE_ERROR = ("must emit an IDLE batch but the first", "over token_budget=", "idle_sample=")
"""What the loader's error says when no sample within the budget can be an IDLE placeholder
(``evenflow.runtime.loader.idle.IdleTemplate``); a peer's PeerError carries the same message."""


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
    # A pass runs on across epochs here, and a pass tagged by the epoch it opened in skips the numbers of the
    # epochs its predecessor spanned (pass 0 read in epochs 0-2, the next opened in epoch 2: tags 0, 2; when
    # the worker copy is made decides which). So the passes are numbered in the order they were seen: a
    # sample skipped inside a pass still counts as lost; a whole pass skipped would not (none is expected:
    # a pass is opened only when the one before it ends).
    order = {p: k for k, p in enumerate(sorted({t // 100_000 - rank * 1_000 for t in trained}))}
    trained = {_tag(rank, order[t // 100_000 - rank * 1_000], t % 100_000) for t in trained}
    order = read_order(n, cfg.workers, cfg.uneven)  # the unread tail is the end of the workers' interleave
    occurrences = [_tag(rank, p, j) for p in range(cfg.epochs) for j in order if j not in dropped]
    untrained = [k for k, t in enumerate(occurrences) if t not in trained]
    tail = 0
    while tail < len(untrained) and untrained[-1 - tail] == len(occurrences) - 1 - tail:
        tail += 1
    lost = max(0, len(untrained) - tail - len(r["carry"]))
    return lost, dup + len(set(trained) - set(occurrences))


# -- process worlds ----------------------------------------------------------------------------------------------
def _child(rank: int, world: int, tmp: str, cfgs: list[Config], stop_at: float = float("inf")) -> None:
    torch.set_num_threads(1)
    progress = os.path.join(tmp, f"progress-{rank}")
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                                timeout=timedelta(seconds=240))
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=240)) if world > 1 else None
        try:
            for cfg in cfgs:
                if _past(stop_at):
                    break  # the time limit: start no configuration (every rank stops before the same one)
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
        _end_children()
        os._exit(0)


def _end_children() -> None:
    """Terminate DataLoader workers a configuration left (a killed-worker fault, an abandoned fetch) before
    os._exit, which skips multiprocessing's own exit handler (tests/_dist.py::end_children)."""
    children = mp.active_children()
    for p in children:
        p.terminate()
    for p in children:
        p.join(5)
        if p.is_alive():
            p.kill()


def _past(stop_at: float) -> bool:
    """Has the time limit passed on any rank? (One all_reduce: every rank stops before the same configuration.)"""
    flag = torch.tensor([float(time.time() > stop_at)])
    if dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _started(tmp: str, world: int, cid: int) -> bool:
    """Did any rank start configuration ``cid`` (a progress line)?"""
    for r in range(world):
        try:
            with open(os.path.join(tmp, f"progress-{r}")) as f:
                if any(line.split()[:1] == [str(cid)] for line in f):
                    return True
        except FileNotFoundError:
            pass
    return False


def run_world(cfgs: list[Config], world: int, deadline_s: float, start_method: str,
              stop_at: float = float("inf")) -> dict[int, object]:
    """Run ``cfgs`` in order on one world; restart it after a hang or an error. Returns id -> per-rank results,
    or "hang" / an error string. After ``stop_at`` (time.time()) no configuration starts (none is reported)."""
    out: dict[int, object] = {}
    todo = list(cfgs)
    ctx = mp.get_context(start_method)
    while todo and time.time() <= stop_at:
        with tempfile.TemporaryDirectory() as tmp:
            procs = [ctx.Process(target=_child, args=(r, world, tmp, todo, stop_at)) for r in range(world)]
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
            if done < len(todo) and not _started(tmp, world, todo[done].id):
                return out  # the time limit: the rest was never started
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
    stop_at = time.time() + time_limit - (time.monotonic() - started)
    for kind, world, batch in queue:
        if time.time() > stop_at:
            break
        results.update(run_world(batch, world, deadline_s, "spawn", stop_at))
    return summarize(cfgs + fresh_cfgs, results, seed, time.monotonic() - started, len(cfgs))


def _capped(cfg: Config, max_world: int) -> Config:
    if cfg.world <= max_world:
        return cfg
    from dataclasses import replace
    return replace(cfg, world=max_world, sizes=cfg.sizes[:max_world] if cfg.iterable else cfg.sizes)


def summarize(cfgs: list[Config], results: dict, seed: int, wall: float, n_pooled: int) -> dict:
    totals = dict(lost=0, duplicated=0, over_budget=0, unequal_steps=0, hangs=0, errors=0, expected_idle_errors=0,
                  silent_ends=0, fault_unequal=0, wrong_errors=0, fault_configs=0, faults_fired=0)
    fired = collections.Counter()
    kinds = collections.Counter()
    by_policy = collections.defaultdict(lambda: collections.Counter())
    failures = []
    for cfg in cfgs:
        if cfg.id not in results:
            continue
        res = results[cfg.id]
        kinds["configs"] += 1
        kinds["fresh" if cfg.id >= n_pooled else "pooled"] += 1
        kinds["iterable"] += cfg.iterable
        kinds["uneven"] += cfg.uneven
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
        if found.get("faults_fired"):
            fired[cfg.fault] += 1
        if any(v for k, v in found.items() if k not in NOT_FINDINGS):
            failures.append(dict(config=asdict(cfg), found=found,
                                 detail=res.detail if isinstance(res, Failed) else None))
    for f in failures[:20]:
        print("FAILED", json.dumps(f, default=str)[:3000], flush=True)
    return dict(configs=kinds["configs"], pooled=kinds["pooled"], fresh=kinds["fresh"], iterable=kinds["iterable"],
                uneven_workers=kinds["uneven"], **totals, policies=POLICIES,
                seed=seed, wall_s=round(wall, 1), faults_fired_by_kind=dict(fired),
                by_policy={k: dict(v) for k, v in by_policy.items()}, failures=len(failures))


NOT_FINDINGS = ("expected_idle_errors", "fault_configs", "faults_fired")
"""Counts in a configuration's result that are not problems."""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", type=int, default=1000, help="pooled configurations (long-lived worlds)")
    parser.add_argument("--fresh", type=int, default=100, help="configurations each on a fresh process world")
    parser.add_argument("--time-limit", type=float, default=1800.0,
                        help="seconds (at most 1800): no new world starts after it; the running one finishes")
    parser.add_argument("--deadline", type=float, default=300.0, help="per-configuration seconds before a hang")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the data sizes (the make-test slice)")
    parser.add_argument("--max-world", type=int, default=5)
    parser.add_argument("--elastic", action="store_true", help="instead: the W -> W' resume sweep "
                        "(benchmarks/failures/elastic_sweep.py, every pair in 1..4; --configs N runs a random slice "
                        "of N)")
    args = parser.parse_args(argv)
    if args.time_limit > MAX_TIME_LIMIT_S:
        parser.error(f"--time-limit is at most {MAX_TIME_LIMIT_S:g} s (the full soak is bounded by 30 minutes)")
    if args.elastic:
        from failures.elastic_sweep import sweep
        out = sweep(args.seed, None if "--configs" not in (argv or sys.argv) else args.configs, min(args.max_world, 4),
                    args.time_limit)
        print(json.dumps(out), flush=True)
        return out
    out = soak(args.seed, args.configs, args.fresh, args.time_limit, args.deadline, args.scale, args.max_world)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
