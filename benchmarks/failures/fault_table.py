"""Measure the README's fault table: one fault on rank 1 of 3 real gloo ranks, what every rank sees, how fast.

    python benchmarks/failures/fault_table.py [--kinds break_one,with_raise,...]

Runs the same scenarios as tests/test_faults.py and tests/test_moved_samples.py (tests/loader_scenarios.py::
sc_hostile and sc_moved, plus a DDP-style all_reduce per step) and prints a markdown table, then one JSON
line. "after" is wall time from the fault (the kill of a worker, a trainer's break or raise; for other data
faults, the start of the epoch) to the error on that rank.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import loader_scenarios as sc  # noqa: E402
from _dist import RankFailed, run_world  # noqa: E402

KINDS = ["break_one", "raise_one", "with_raise", "close_exc", "unpicklable", "blocking", "collate_mid",
         "collate_last", "length_fn", "balance_pickle", "start_fail", "len_mismatch", "exit", "ddp_raise",
         # issue 19 (tests/loader_scenarios.py::sc_moved): receiver-side unpickle, a view corpus, a stop near the
         # end, a planning_group mismatch, blocking user code on the collation thread, a SIGKILLed worker
         "unpickle:module:global", "unpickle:reduce:balance", "views", "stop_end:global", "stop_end:local",
         "group_mismatch", "blocking:collate_fn", "blocking:length_fn", "kill_worker", "collate_equal:global",
         "length_under:global", "overflow:length:global"]
MOVED = {k for k in KINDS if ":" in k or k in ("views", "group_mismatch", "kill_worker")}


def sc_extra(rank, world, kind):
    """Faults not in sc_hostile: a rank that dies, and a trainer error under a per-step all_reduce (DDP)."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import evenflow
    loader = evenflow.DynamicBatchLoader(sc.TokenDataset(301), token_budget=sc.BUDGET, buffer_size=16,
                                         timeout=timedelta(seconds=60))
    steps, t_fault = 0, None
    try:
        for batch in loader:
            evenflow.pop_step_info(batch)
            steps += 1
            if rank == 1 and steps == sc.FAULT_STEP:
                t_fault = time.time()
                if kind == "exit":
                    os._exit(3)
                raise ZeroDivisionError("injected trainer failure")
            if kind == "ddp_raise":
                dist.all_reduce(torch.ones(1))  # the user's own collective: gloo default timeout (60 s here)
    except Exception as exc:  # noqa: BLE001
        return sc._outcome(steps, exc, t_fault)
    finally:
        loader.close()
    return sc._outcome(steps, None, t_fault)


def _moved_rows(kind: str, res: list, started: float) -> list:
    """sc_moved's results as rows: the views and stop_end kinds are not single faults (see their tests)."""
    rows = []
    t_fault = next((r["t_fault"] for r in res if isinstance(r, dict) and r.get("t_fault")), started)
    for rank, r in enumerate(res):
        if isinstance(r, RankFailed):
            rows.append(dict(rank=rank, sees="process died", after_s=None))
        elif kind == "views":
            samples, wire, tensor = r["moves"]
            rows.append(dict(rank=rank, sees=f"no error; sent {samples} samples, {wire} B on the wire for {tensor} B "
                                             "of their tensors", after_s=None, steps=len(r["seen"])))
        elif kind.startswith("stop_end"):
            seen = "; ".join(f"stop at {s['stop_at']}/{r['total']}: {(s['error'] or 'no error')[:60]}"
                             for s in r["stops"])
            rows.append(dict(rank=rank, sees=seen, after_s=None, steps=r["total"]))
        else:
            rows.append(dict(rank=rank, sees=(r["error"] or "no error")[:160].replace("\n", " "),
                             after_s=round(r["t_error"] - t_fault, 2), steps=r["steps"]))
    return rows


def measure(kind: str) -> dict:
    started = time.time()
    if kind in MOVED:
        with tempfile.TemporaryDirectory() as tmp:
            res = run_world(sc.sc_moved, 3, kind, tmp, timeout=300, allow_errors=True)
        return dict(kind=kind, ranks=_moved_rows(kind, res, started))
    if kind in ("exit", "ddp_raise"):
        res = run_world(sc_extra, 3, kind, timeout=300, allow_errors=True)
    else:
        res = run_world(sc.sc_hostile, 3, kind, timeout=300, allow_errors=True)
    t_fault = next((r["t_fault"] for r in res if isinstance(r, dict) and r.get("t_fault")), started)
    rows = []
    for rank, r in enumerate(res):
        if isinstance(r, RankFailed):
            rows.append(dict(rank=rank, sees="process died", after_s=None))
        else:
            rows.append(dict(rank=rank, sees=(r["error"] or "no error")[:160].replace("\n", " "),
                             after_s=round(r["t_error"] - t_fault, 2), steps=r["steps"]))
    return dict(kind=kind, ranks=rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args()
    out = [measure(k) for k in args.kinds.split(",")]
    print("| fault (rank 1 of 3) | rank 1 sees | peers see | peers raise after |")
    print("|---|---|---|---|")
    for m in out:
        own, peers = m["ranks"][1], [r for r in m["ranks"] if r["rank"] != 1]
        if m["kind"].startswith("unpickle"):  # the receiver fails, rank 1 (the sender) is a peer
            own = next((r for r in m["ranks"] if "cannot unpickle" in r["sees"] and "PeerError" not in r["sees"]), own)
            peers = [r for r in m["ranks"] if r is not own]
        after = [r["after_s"] for r in peers if r["after_s"] is not None]
        print(f"| {m['kind']} | {own['sees'][:70]} | {peers[0]['sees'][:90]} | "
              f"{min(after) if after else '-'}-{max(after) if after else '-'} s |")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
