"""Launched by tests/test_exit.py: a rank whose script ends normally, then a probe of what is left at exit.

    exit_job.py OUT SCENARIO [--file RENDEZVOUS --rank R --world W]      (env:// under torchrun without --file)

Scenarios: ``open`` -- the loop stops after 3 batches with the iterator still held (a module-level ``batches``);
``mixed`` -- one whole epoch of a first loader (1 sample on 2 ranks: rank 1 has nothing to do), then ``open`` with
a second loader and 2 DataLoader workers and with a third one (two epochs open at exit, closed in whatever order
each rank finds them); ``peer-dies`` -- ``open``, and rank 1 kills itself (SIGKILL) after its 3 batches.

The probe is an ``atexit`` callback registered before the loader exists, so it runs after evenflow's own (they
run last-registered first), just before the interpreter finalizes. It writes OUT/probe-rank{r}.json: the live
threads and the multiprocessing children then.
"""

import atexit
import json
import multiprocessing
import os
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import evenflow


class Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = torch.full((8 + (i * 37) % 120,), i + 1, dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}


def probe(out: Path, rank: int) -> None:
    (out / f"probe-rank{rank}.json").write_text(json.dumps({
        "threads": [t.name for t in threading.enumerate()],
        "children": [p.pid for p in multiprocessing.active_children()]}))


def main() -> None:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    if "--file" in sys.argv:
        arg = {k: sys.argv[sys.argv.index(k) + 1] for k in ("--file", "--rank", "--world")}
        dist.init_process_group("gloo", init_method=f"file://{arg['--file']}", rank=int(arg["--rank"]),
                                world_size=int(arg["--world"]), timeout=timedelta(seconds=60))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    atexit.register(probe, out, rank)
    options = dict(token_budget=512, buffer_size=32, timeout=timedelta(seconds=30), worker_timeout=timedelta(seconds=20))
    if scenario == "mixed":
        for batch in evenflow.DynamicBatchLoader(Tokens(1), **options):
            evenflow.pop_step_info(batch)
    global batches  # outlive the loops, as at a script's top level
    batches = []
    for workers in (2, 0) if scenario == "mixed" else (0,):
        batches.append(iter(evenflow.DynamicBatchLoader(Tokens(256), num_workers=workers, **options)))
        for _ in range(3):
            evenflow.pop_step_info(next(batches[-1]))
    if scenario == "peer-dies" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    (out / f"trained-rank{rank}").write_text("")


if __name__ == "__main__":
    main()
