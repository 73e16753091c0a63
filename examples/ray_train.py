"""Ray Train with evenflow batches: ``TorchTrainer`` on CPU workers, checkpoints through ``ray.train.report``,
resumed on another number of workers.

    python examples/ray_train.py                               # 2 workers, stops (like a preemption) at step 6
    python examples/ray_train.py --workers 3 --resume last     # resumes that checkpoint on 3 workers
    python examples/ray_train.py --workers 1-4 --resume last   # elastic: ScalingConfig(num_workers=(1, 4))

Inside ``train_loop_per_worker`` Ray Train has already initialized ``torch.distributed`` (gloo on CPU), so the
loader is built as in any DDP loop. A checkpoint holds every worker's loader state -- gathered over the default
group (``gather_states``, a collective every worker runs at the same step) and written by worker 0 -- beside the
model. A run started with ``resume_from_checkpoint`` (or restarted by Ray after a failure, or resized by an
elastic ``ScalingConfig``) passes that list to ``loader.load_state_dict``: on another number of workers the
untrained rest of the epoch is re-dealt, so every sample is still trained exactly once. Ray restarts a resized
worker group from the latest reported checkpoint; on one machine nothing triggers a resize, so the elastic form
is shown, not exercised (tests/test_ray_train.py resumes on another fixed number of workers).

Every worker also writes the sample ids it trained to ``log_dir`` (the tests count them); drop that in a real job.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

import evenflow
from evenflow.integrations.states import gather_states, resume_epoch

EXAMPLES = str(Path(__file__).resolve().parent)


def train_loop(config: dict) -> None:
    """``train_loop_per_worker``: one worker of the data-parallel job."""
    import sys

    import ray.train
    import ray.train.torch
    if EXAMPLES not in sys.path:  # workers are fresh processes
        sys.path.insert(0, EXAMPLES)
    from _tiny import RandomChat, TinyCausalLM

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    model = TinyCausalLM()
    loader = evenflow.DynamicBatchLoader(RandomChat(config["n"]), token_budget=config["token_budget"],
                                         grad_accum_steps=config["accum"], buffer_size=32, seed=1)
    start_epoch, step = 0, 0
    # Ray's own on a restart or a resize of this run's worker group; else the one this run was told to resume.
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None and config.get("resume"):
        checkpoint = ray.train.Checkpoint(config["resume"])
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            states = json.loads(Path(folder, "loader.json").read_text())  # every saved worker's state
            saved = torch.load(Path(folder, "model.pt"))
        model.load_state_dict(saved["model"])
        loader.load_state_dict(states)  # another number of workers: the rest of the epoch is re-dealt
        start_epoch, step = resume_epoch(states), saved["step"]
    model = ray.train.torch.prepare_model(model)  # DDP over Ray's process group
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    if checkpoint is not None:
        optimizer.load_state_dict(saved["optimizer"])
    log = Path(config["log_dir"], f"run{config['run']}-rank{rank}-of{world}.jsonl")
    with loader, open(log, "a") as trained:
        for epoch in range(start_epoch, config["epochs"]):
            loader.set_epoch(epoch)
            for batch in loader:
                info = evenflow.pop_step_info(batch)
                evenflow.scale_loss(model(**batch)["loss"], info).backward()
                trained.write(json.dumps(dict(epoch=epoch, step=step, ids=info.sample_ids)) + "\n")
                if not info.window_end:
                    continue
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                if step % config["save_every"] == 0 or step == config["stop_at"]:
                    _report(loader, model, optimizer, step, epoch, rank)
                if step == config["stop_at"]:
                    return  # a preemption, at a checkpoint: the work after it would be redone anyway
    _report(loader, model, optimizer, step, config["epochs"] - 1, rank)


def _report(loader, model, optimizer, step: int, epoch: int, rank: int) -> None:
    import ray.train
    states = gather_states(loader.state_dict())  # collective: every worker is at this step
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if rank == 0:
            Path(folder, "loader.json").write_text(json.dumps(states))
            module = model.module if hasattr(model, "module") else model
            torch.save(dict(model=module.state_dict(), optimizer=optimizer.state_dict(), step=step),
                       Path(folder, "model.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report({"step": step, "epoch": epoch}, checkpoint=checkpoint)


def fit(*, workers: int | tuple[int, int] = 2, storage: str, name: str = "evenflow", run: int = 0,
        log_dir: str | None = None, resume: str | None = None, stop_at: int = -1, epochs: int = 2, n: int = 160,
        token_budget: int = 256, accum: int = 2, save_every: int = 3, lr: float = 0.05,
        cpus_per_worker: float = 0.5):
    """Run one ``TorchTrainer`` fit; returns Ray's ``Result`` (``result.checkpoint.path`` resumes the next run).

    ``resume``: a checkpoint folder this run starts from (Ray Train 2's replacement for the deprecated
    ``TorchTrainer(resume_from_checkpoint=...)``: the train loop loads it when Ray has none of its own).
    ``workers``: a number, or ``(min, max)`` for an elastic ``ScalingConfig``."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    log_dir = log_dir or os.path.join(storage, "trained")
    os.makedirs(log_dir, exist_ok=True)
    config = dict(n=n, token_budget=token_budget, accum=accum, epochs=epochs, save_every=save_every,
                  stop_at=stop_at, lr=lr, log_dir=log_dir, run=run, resume=resume)
    trainer = TorchTrainer(
        train_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False,
                                     resources_per_worker={"CPU": cpus_per_worker}),
        run_config=RunConfig(storage_path=storage, name=f"{name}-{run}"))
    return trainer.fit()


def main() -> None:
    import ray
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2", help="a number, or MIN-MAX for an elastic ScalingConfig")
    parser.add_argument("--resume", default=None, help="a checkpoint folder, or 'last' (this script's last one)")
    parser.add_argument("--storage", default=os.path.abspath("ray_out"))
    parser.add_argument("--stop-at", type=int, default=None)
    cli = parser.parse_args()
    low, _, high = cli.workers.partition("-")
    workers = (int(low), int(high)) if high else int(low)
    marker = Path(cli.storage, "last_checkpoint")
    resume = cli.resume
    if resume == "last":
        resume = marker.read_text()
    # One machine, loopback only (on Linux Ray turns 127.0.0.1 into the routable address unless
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is exported before python starts). A cluster: ray.init() / ray.init(address).
    ray.init(_node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False,
             runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}})
    result = fit(workers=workers, storage=cli.storage, run=1 if resume else 0, resume=resume,
                 stop_at=cli.stop_at if cli.stop_at is not None else (-1 if resume else 6))
    if result.checkpoint is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(result.checkpoint.path)
    print("done:", result.metrics, "checkpoint:", result.checkpoint.path if result.checkpoint else None)
    ray.shutdown()


if __name__ == "__main__":
    main()
