"""Resumes onto reordered data, refusals that depend on one rank's state, and ``discard_resumed`` -- scenarios run
one after the other in one gloo world (tests/test_resume_reorder.py), each returning a plain dict per rank.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import evenflow
from mistakes_scenarios import Rows, Stream, _distinct_rows, _failed, _record, _state_after

T = timedelta(seconds=20)
FILES, PER_FILE = 16, 10


def file_rows() -> list[list[dict]]:
    """16 "files" of 10 samples, distinct token content; in every file the first sample is the shortest and
    samples 5 and 7 have the same length (what a dedup pass may order either way)."""
    rng = np.random.default_rng(4)
    files = []
    for f in range(FILES):
        lengths = [3] + rng.integers(6, 40, PER_FILE - 1).tolist()
        lengths[7] = lengths[5]
        files.append([{"input_ids": torch.tensor([f, j] + rng.integers(1, 900, n - 2).tolist()), "idx": f * PER_FILE + j}
                      for j, n in enumerate(lengths)])
    return files


def reorders(files: list[list[dict]]) -> dict[str, list[dict]]:
    """The same samples in another order, each leaving indices 0, 20, ..., 140 (the first sample of every even
    file: what an 8-item fingerprint reads) in place."""
    swapped = list(files)
    swapped[1], swapped[3] = swapped[3], swapped[1]  # os.listdir on another file system
    by_length = [f[:1] + sorted(f[1:], key=lambda r: (len(r["input_ids"]), int(r["input_ids"][-1]))) for f in files]
    tie = [list(f) for f in files]
    tie[2][5], tie[2][7] = tie[2][7], tie[2][5]  # two samples of equal length, one file
    return {"files_swapped": sum(swapped, []), "sorted_in_files": sum(by_length, []), "equal_length_swap": sum(tie, [])}


def _lengths(rows: list[dict]) -> list[int]:
    return [len(r["input_ids"]) for r in rows]


def _loader(rows, **kw):
    return evenflow.DynamicBatchLoader(Rows(rows), **({"token_budget": 128, "timeout": T, "buffer_size": 16} | kw))


def sc_reordered_resume(rank, world):
    files = file_rows()
    rows = sum(files, [])
    out = {}
    for known in (False, True):
        kw = {"lengths": _lengths(rows)} if known else {}
        state = _state_after(_loader(rows, **kw), 3)
        for name, other in reorders(files).items():
            loader = _loader(other, **({"lengths": _lengths(other)} if known else {}))
            try:
                loader.load_state_dict(state)
                out[(name, known)] = _record(loader)  # accepted: what it trained
                out[(name, known)]["accepted"] = True
            except Exception as exc:  # noqa: BLE001 - the refusal
                out[(name, known)] = _failed(exc) | {"accepted": False}
        same = _loader(rows, **kw)
        same.load_state_dict(state)
        out[("same", known)] = _record(same) | {"before": sorted(int(rows[k]["idx"]) for k in state["consumed"])}
    return out


def sc_quota_carry_on_one_rank(rank, world):
    """Quota mode, local planning: rank 0 reads long samples, rank 1 short ones, so rank 1 runs dry first and
    only rank 0 carries into the next epoch. ``set_epoch(saved + 2)`` would drop rank 0's carry."""
    rows = [{"input_ids": torch.full((40 if i % 2 == 0 else 4,), i), "idx": i} for i in range(40)]
    kw = dict(join=False, planning="local", shuffle=False, token_budget=64, buffer_size=8, max_steps_per_round=2)
    loader = _loader(rows, **kw)
    _record(loader)
    state = loader.state_dict()
    loader.close()
    out = {"carries": len(state["next_carry"]), "epoch": state["epoch"]}
    resumed = _loader(rows, **kw)
    resumed.load_state_dict(state)
    try:
        resumed.set_epoch(state["epoch"] + 2)
        out["later"] = None
    except Exception as exc:  # noqa: BLE001
        out["later"] = _failed(exc)
    if out["later"] is None:  # accepted here: train it, as a script would (the peer may have refused)
        out["trained"] = _record(resumed)
    return out


def sc_refused_on_one_rank(rank, world):
    """A refusal only one rank makes: its node's copy of the data lists the files in another order, or it loads
    another rank's state. The refusing rank ends there (``close()``: what the exit hook runs when the refusal
    ends the script); its peer resumed and iterates."""
    files = file_rows()
    rows = sum(files, [])
    state = _state_after(_loader(rows), 3)
    out = {}
    loader = _loader(reorders(files)["files_swapped"] if rank == 0 else rows)
    for name, saved in (("order", state), ("rank", _rank0(state))):
        try:
            loader.load_state_dict(saved)
            out[name] = _record(loader)
        except Exception as exc:  # noqa: BLE001 - the refusal, on this rank only
            out[name] = _failed(exc)
            loader.close()
        loader = _loader(rows)
    return out


def _rank0(state: dict) -> dict:
    """Rank 0's state, on every rank (a checkpoint that kept one copy)."""
    box = [state]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sc_discard_at_the_saved_epoch(rank, world):
    """``set_epoch(saved, discard_resumed=True)`` called up front: the epoch starts afresh."""
    out = {}
    rows = _distinct_rows(96)
    mine = rows[rank::world]
    state = _state_after(evenflow.DynamicBatchLoader(Stream(mine), token_budget=256, buffer_size=16, timeout=T), 2)
    other = [dict(r, input_ids=r["input_ids"] + 1) for r in mine]  # another stream: the documented way past
    fresh = evenflow.DynamicBatchLoader(Stream(other), token_budget=256, buffer_size=16, timeout=T)
    fresh.load_state_dict(state)
    try:
        fresh.set_epoch(state["epoch"], discard_resumed=True)
        out["stream"] = _record(fresh)
    except Exception as exc:  # noqa: BLE001
        out["stream"] = _failed(exc)
    rows = _distinct_rows(120)
    state = _state_after(_loader(rows), 3)
    again = _loader(rows)
    again.load_state_dict(state)
    again.set_epoch(state["epoch"], discard_resumed=True)
    out["map"] = _record(again)
    return out


def sc_many(rank, world, calls):
    """Run scenarios in order, a barrier between them (``calls``: [(name, fn)]); a failing one is recorded."""
    results = {}
    for name, fn in calls:
        dist.barrier()
        try:
            results[name] = globals()[fn](rank, world)
        except Exception as exc:  # noqa: BLE001 - recorded; the next scenario still runs
            results[name] = _failed(exc)
        pickle.dumps(results[name])
    return results
