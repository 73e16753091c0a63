"""Launched by tests/test_torchrun_elastic.py under two elastic torchrun agents (c10d rendezvous, env://).

    elastic_job.py OUT N EVERY DELAY

One epoch of N samples. Every EVERY steps (at a window end) every rank writes its loader state and the sample
ids it trained since the previous checkpoint into OUT/ckpt/<name>/, a barrier follows, and rank 0 marks the
checkpoint COMMITTED (a checkpoint some rank died in the middle of is never marked, so never resumed).
A (re)started worker resumes from the newest committed checkpoint: it passes the states of *all* the ranks that
wrote it -- of another world size after an elastic re-formation -- to ``loader.load_state_dict``. At the end of
the epoch each rank writes OUT/done-g<restart>-rank<r>.json: the ids trained since the last checkpoint and the
checkpoint it continued from, so the test can walk the committed chain and count every sample.
"""

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

import evenflow
from loader_scenarios import TokenDataset


def _write(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _latest(ckpt: Path) -> str | None:
    done = [d.name for d in ckpt.iterdir() if (d / "COMMITTED").exists()] if ckpt.exists() else []
    return max(done, key=lambda name: int(name.split("-")[1]), default=None)


def main() -> None:
    out, n, every, delay = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = out / "ckpt"
    loader = evenflow.DynamicBatchLoader(TokenDataset(n), token_budget=2048, buffer_size=16, seed=3,
                                         timeout=timedelta(seconds=15))
    prev, counter = _latest(ckpt), 0
    if prev is not None:
        meta = json.loads((ckpt / prev / "meta.json").read_text())
        states = [json.loads((ckpt / prev / f"loader-rank{r}.json").read_text()) for r in range(meta["world_size"])]
        loader.load_state_dict(states)  # any saved world size: the untrained remainder is re-dealt
        counter = meta["counter"]
    ids: list = []
    with loader:
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            ids.extend(info.sample_ids)
            time.sleep(delay)  # a training step
            if info.window_end and (info.step + 1) % every == 0:
                counter += 1
                name = f"ckpt-{counter}-g{restart}"
                folder = ckpt / name
                folder.mkdir(parents=True, exist_ok=True)
                _write(folder / f"loader-rank{rank}.json", loader.state_dict())
                _write(folder / f"ids-rank{rank}.json", ids)
                dist.barrier()  # every rank's files are written (a rank that died leaves it unmarked)
                if rank == 0:
                    _write(folder / "meta.json", dict(world_size=world, counter=counter, prev=prev, restart=restart))
                    _write(folder / "COMMITTED", {})
                prev, ids = name, []
    _write(out / f"done-g{restart}-rank{rank}.json", dict(world_size=world, prev=prev, ids=ids))
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001 - a peer died: report and leave at once (gloo teardown could block)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
