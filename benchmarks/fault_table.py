"""Measure the README's fault table: one fault on rank 1 of 3 real gloo ranks, what every rank sees, how fast.

    python benchmarks/fault_table.py [--kinds break_one,with_raise,...]

Runs the same scenarios as tests/test_faults.py (tests/loader_scenarios.py::sc_hostile, plus a DDP-style
all_reduce per step) and prints a markdown table, then one JSON line. "after" is wall time from the fault
(or, for data faults, from the start of the epoch) to the error on that rank.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import loader_scenarios as sc  # noqa: E402
from _dist import RankFailed, run_world  # noqa: E402

KINDS = ["break_one", "raise_one", "with_raise", "close_exc", "unpicklable", "blocking", "collate_mid",
         "collate_last", "length_fn", "balance_pickle", "start_fail", "len_mismatch", "exit", "ddp_raise"]


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


def measure(kind: str) -> dict:
    started = time.time()
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
        after = [r["after_s"] for r in peers if r["after_s"] is not None]
        print(f"| {m['kind']} | {own['sees'][:70]} | {peers[0]['sees'][:90]} | "
              f"{min(after) if after else '-'}-{max(after) if after else '-'} s |")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
