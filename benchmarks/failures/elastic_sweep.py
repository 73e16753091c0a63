"""Resume on another number of ranks (issue 20): a W -> W' sweep on fresh gloo process worlds.

    python benchmarks/failures/elastic_sweep.py      # every pair W != W' in 1..4 x policy x accumulation x mode
    python benchmarks/failures/soak.py --elastic     # the same, from the soak
    python benchmarks/failures/elastic_sweep.py --cases 8 --seed 3   # a seeded random slice (tests/test_elastic.py)

A case trains a map-style dataset for 1-3 epochs over a chain of process worlds: world sizes ``worlds[0]``
(fresh), then ``worlds[1]``, ... Each phase but the last stops at a window end after a random number of steps,
saves every rank's ``state_dict()``, and the next phase -- a new world of another size, every rank given the
JSON round-trip of the list of all saved states -- resumes with ``loader.load_state_dict(states)``. Real
loader, collation and gloo code; nothing is modelled.

Checked per case, over all phases: lost and duplicated sample-epochs (join: each sample of each epoch exactly
once counting the committed work before every save; quota: every sample-epoch trained exactly once or still
carried at the end), unequal step counts across the ranks of a phase, and the loss scale on every resumed
window: the ranks' ``mean loss x loss_scale`` summed over the window, divided by W', against the single-process
float64 per-token loss of the window's samples (relative error <= 1e-10). Policies: ``"local"``, ``"global"``
(the same explicit argument across the resume) and ``"auto"`` (resolves to local at 1 rank, global above, so
the policy itself changes on resume). The last line printed is one JSON object with the totals.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import evenflow

BUDGET = 600
VOCAB = 37
REL_TOL = 1e-10


@dataclass(frozen=True)
class Case:
    id: int
    worlds: tuple[int, ...]
    """World size of each phase: (W, W') or a longer chain (W, W', W'')."""
    stops: tuple[int, ...]
    """For each phase but the last: steps it runs (counted over its epochs) before it saves, at a window end."""
    planning: str
    grad_accum_steps: int
    join: bool
    epochs: int
    n: int
    seed: int
    buffer_size: int


class Samples(Dataset):
    """Samples with random token ids (so losses differ), a third of the labels masked, and their index."""

    def __init__(self, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = np.clip(rng.lognormal(4.0, 0.9, n).astype(np.int64) + 2, 2, 300)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        n = int(self.lengths[i])
        ids = torch.from_numpy(np.random.default_rng([self.seed, i]).integers(1, VOCAB, n))
        labels = ids.clone()
        labels[: n // 3] = -100
        return {"input_ids": ids, "labels": labels, "index": i}


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, 8, generator=g, dtype=torch.float64))
        self.out = torch.nn.Parameter(torch.randn(8, VOCAB, generator=g, dtype=torch.float64) * 0.3)

    def token_losses(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
        """(sum of supervised-token losses, their count): position i predicts label i+1."""
        with torch.no_grad():
            return self._token_losses(input_ids, labels)

    def _token_losses(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
        logits = torch.tanh(self.emb[input_ids]) @ self.out
        flat = labels[..., 1:].reshape(-1)
        loss = torch.nn.functional.cross_entropy(logits[..., :-1, :].reshape(-1, VOCAB), flat, ignore_index=-100,
                                                 reduction="sum")
        return float(loss), int((flat != -100).sum())


# -- one phase, on every rank of its world -----------------------------------------------------------------------
def run_phase(case: Case, phase: int, states: list | None) -> dict:
    """Train this phase of ``case``: resume from ``states`` (all saved ranks) if given, stop and save per the case."""
    loader = evenflow.DynamicBatchLoader(
        Samples(case.n, case.seed), token_budget=BUDGET, buffer_size=case.buffer_size, seed=case.seed,
        join=case.join, grad_accum_steps=case.grad_accum_steps, planning=case.planning,
        timeout=timedelta(seconds=60))
    model = TinyLM()
    start = 0
    if states is not None:
        loader.load_state_dict(states)
        start = states[0]["epoch"] + (1 if states[0]["finished"] else 0)
    stop = case.stops[phase] if phase < len(case.stops) else None
    steps, state, taken = [], None, 0
    with loader:
        for epoch in range(start, case.epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                info = evenflow.pop_step_info(batch)
                taken += 1
                scaled = 0.0
                if info.local_loss_tokens:
                    total, tokens = model.token_losses(batch["input_ids"], batch["labels"])
                    scaled = total / tokens * info.loss_scale  # what scale_loss(mean loss, info) backpropagates
                steps.append(dict(epoch=epoch, ids=[int(i) for i in info.sample_ids], scaled=scaled,
                                  window_end=info.window_end, world=info.world_size))
                if stop is not None and taken >= stop and info.window_end:
                    state = loader.state_dict()
                    break
            if state is not None:
                break
        if state is None:
            state = loader.state_dict()
    return dict(steps=steps, state=state, planning=loader.planning)


def _child(rank: int, world: int, tmp: str, jobs: list) -> None:
    torch.set_num_threads(1)
    out = []
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        try:
            for case, phase, states in jobs:
                try:
                    out.append(("ok", run_phase(case, phase, states)))
                except Exception as exc:  # noqa: BLE001 - a finding, reported with the case
                    out.append(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"))
                    break  # peers may be inside a collective: end this world
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        out.append(("error", f"{type(exc).__name__}: {exc}"))
    with open(os.path.join(tmp, f"result-{rank}.pkl.tmp"), "wb") as f:
        pickle.dump(out, f)
    os.replace(os.path.join(tmp, f"result-{rank}.pkl.tmp"), os.path.join(tmp, f"result-{rank}.pkl"))
    os._exit(0)


def run_world(jobs: list, world: int, deadline_s: float) -> list:
    """Run ``jobs`` [(case, phase, states)] in order on a fresh world; per job, the per-rank results or an error
    string ("hang" when the world passed its deadline)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_child, args=(r, world, tmp, jobs)) for r in range(world)]
        for p in procs:
            p.start()
        deadline, hung = time.monotonic() + deadline_s, False
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                hung = True
                for p in procs:
                    p.kill()
                break
            time.sleep(0.05)
        for p in procs:
            p.join(5)
        per_rank = []
        for r in range(world):
            try:
                with open(os.path.join(tmp, f"result-{r}.pkl"), "rb") as f:
                    per_rank.append(pickle.load(f))
            except FileNotFoundError:
                per_rank.append([])
    results = []
    for j in range(len(jobs)):
        got = [res[j] if j < len(res) else None for res in per_rank]
        if all(g is not None and g[0] == "ok" for g in got):
            results.append([g[1] for g in got])
        else:
            errors = [f"rank {r}: {g[1]}" for r, g in enumerate(got) if g is not None and g[0] == "error"]
            results.append(errors[0] if errors else "hang" if hung else "no result")
    return results


# -- the sweep ----------------------------------------------------------------------------------------------------
def _json(states: list[dict]) -> list[dict]:
    """What a checkpoint file gives back: tuples become lists (the loader reads either)."""
    return json.loads(json.dumps(states))


def run_cases(cases: list[Case], deadline_s: float = 240.0, time_limit: float = float("inf")) -> dict[int, object]:
    """Every case's phases, phase by phase; the cases of one phase with the same world size share a world."""
    started = time.monotonic()
    phases: dict[int, list] = {c.id: [] for c in cases}
    failed: dict[int, str] = {}
    for phase in range(max(len(c.worlds) for c in cases)):
        todo = collections.defaultdict(list)
        for c in cases:
            if phase < len(c.worlds) and c.id not in failed:
                states = _json([r["state"] for r in phases[c.id][-1]]) if phase else None
                todo[c.worlds[phase]].append((c, phase, states))
        for world, jobs in sorted(todo.items()):
            if time.monotonic() - started > time_limit:
                for c, _, _ in jobs:
                    failed.setdefault(c.id, "not run (time limit)")
                continue
            for (c, _, _), res in zip(jobs, run_world(jobs, world, deadline_s * len(jobs))):
                if isinstance(res, str):
                    failed[c.id] = res
                else:
                    phases[c.id].append(res)
    return {c.id: failed.get(c.id, phases[c.id]) for c in cases}


def check(case: Case, phases: list[list[dict]], model: TinyLM | None = None) -> dict:
    """Lost / duplicated sample-epochs, unequal step counts, and the loss scale on the resumed windows."""
    trained = collections.Counter()
    unequal, windows, scale_errors, worst = 0, 0, 0, 0.0
    ds, model = Samples(case.n, case.seed), model or TinyLM()
    per_sample: dict[int, tuple[float, int]] = {}

    def token_losses(i: int) -> tuple[float, int]:
        if i not in per_sample:
            s = ds[i]
            per_sample[i] = model.token_losses(s["input_ids"], s["labels"])
        return per_sample[i]

    for p, ranks in enumerate(phases):
        epochs = sorted({s["epoch"] for r in ranks for s in r["steps"]})
        for e in epochs:
            per_rank = [[s for s in r["steps"] if s["epoch"] == e] for r in ranks]
            unequal += len({len(x) for x in per_rank}) > 1
            for x in per_rank:
                for s in x:
                    trained.update((e, i) if case.join else i for i in s["ids"])
            if p == 0:
                continue  # the loss-scale check is about the resumed part
            split = [_windows(x) for x in per_rank]
            if len({len(w) for w in split}) > 1:
                unequal += 1
                continue
            for w in range(len(split[0])):
                steps = [s for rank in split for s in rank[w]]
                ids = [i for s in steps for i in s["ids"]]
                if not ids:
                    continue
                total = sum(token_losses(i)[0] for i in ids)
                tokens = sum(token_losses(i)[1] for i in ids)
                got = sum(s["scaled"] for s in steps) / len(ranks)
                ref = total / tokens if tokens else 0.0
                err = abs(got - ref) / max(abs(ref), 1e-300)
                windows += 1
                worst = max(worst, err)
                scale_errors += err > REL_TOL
    if case.join:
        expected = collections.Counter((e, i) for e in range(case.epochs) for i in range(case.n))
    else:
        expected = collections.Counter({i: case.epochs for i in range(case.n)})
        for r in phases[-1]:
            trained.update(k[1] if isinstance(k, (list, tuple)) else k for k in r["state"]["next_carry"])
    lost = sum((expected - trained).values())
    duplicated = sum((trained - expected).values())
    return dict(lost=lost, duplicated=duplicated, unequal_steps=unequal, scale_errors=scale_errors,
                windows_checked=windows, max_rel_err=worst)


def _windows(steps: list[dict]) -> list[list[dict]]:
    out, cur = [], []
    for s in steps:
        cur.append(s)
        if s["window_end"]:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def _case(cid: int, rng: np.random.Generator, worlds: tuple[int, ...], planning: str, accum: int,
          join: bool) -> Case:
    epochs = int(rng.integers(1, 3)) if join else int(rng.integers(2, 4))
    return Case(id=cid, worlds=worlds, stops=tuple(int(rng.integers(1, 14)) for _ in worlds[:-1]), planning=planning,
                grad_accum_steps=accum, join=join, epochs=epochs, n=int(rng.integers(40, 160)),
                seed=int(rng.integers(0, 2**31)), buffer_size=int(rng.choice([4, 8, 16, 32])))


def full_sweep(seed: int, max_world: int = 4) -> list[Case]:
    """Every ordered pair W != W' in 1..max_world x {local, global} x accumulation {1, 2} x {join, quota}, plus
    planning="auto" and three-world chains on a random subset; random stop steps and sizes."""
    rng = np.random.default_rng(seed)
    cases = []
    pairs = [(a, b) for a in range(1, max_world + 1) for b in range(1, max_world + 1) if a != b]
    for (a, b), planning, accum, join in itertools.product(pairs, ("local", "global"), (1, 2), (True, False)):
        cases.append(_case(len(cases), rng, (a, b), planning, accum, join))
    for _ in range(len(pairs)):
        worlds = tuple(int(w) for w in rng.integers(1, max_world + 1, size=int(rng.integers(2, 4))))
        cases.append(_case(len(cases), rng, worlds, "auto", int(rng.integers(1, 3)), bool(rng.random() < 0.5)))
    return cases


def random_slice(seed: int, count: int, max_world: int = 4) -> list[Case]:
    """``count`` cases drawn from the sweep's space (the seeded slice tests/test_elastic.py runs)."""
    rng = np.random.default_rng(seed)
    pairs = [(a, b) for a in range(1, max_world + 1) for b in range(1, max_world + 1) if a != b]
    cases = []
    for cid in range(count):
        a, b = pairs[int(rng.integers(len(pairs)))]
        planning = ("local", "global", "auto")[cid % 3]
        cases.append(_case(cid, rng, (a, b), planning, 1 + cid % 2, cid % 4 < 2))
    return cases


def summarize(cases: list[Case], results: dict[int, object], seed: int, wall: float) -> dict:
    totals = dict(lost=0, duplicated=0, unequal_steps=0, scale_errors=0, errors=0, hangs=0, windows_checked=0)
    worst, failures = 0.0, []
    for c in cases:
        res = results.get(c.id)
        if isinstance(res, str):
            totals["hangs" if res == "hang" else "errors"] += 1
            failures.append(dict(case=asdict(c), error=res[:2000]))
            continue
        found = check(c, res)
        worst = max(worst, found.pop("max_rel_err"))
        for k, v in found.items():
            totals[k] += v
        if any(found[k] for k in ("lost", "duplicated", "unequal_steps", "scale_errors")):
            failures.append(dict(case=asdict(c), found=found))
    for f in failures[:20]:
        print("FAILED", json.dumps(f, default=str)[:3000], flush=True)
    pairs = sorted({c.worlds for c in cases})
    return dict(cases=len(cases), **totals, max_rel_err=worst, world_chains=len(pairs), seed=seed,
                wall_s=round(wall, 1), failures=len(failures))


def sweep(seed: int = 0, count: int | None = None, max_world: int = 4, time_limit: float = float("inf")) -> dict:
    started = time.monotonic()
    cases = full_sweep(seed, max_world) if count is None else random_slice(seed, count, max_world)
    results = run_cases(cases, time_limit=time_limit)
    return summarize(cases, results, seed, time.monotonic() - started)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=None, help="a random slice of this many cases (default: all)")
    parser.add_argument("--max-world", type=int, default=4)
    parser.add_argument("--time-limit", type=float, default=float("inf"), help="seconds; no new world after")
    args = parser.parse_args(argv)
    out = sweep(args.seed, args.cases, args.max_world, args.time_limit)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
