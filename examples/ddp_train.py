"""Plain DDP training loop with evenflow batches (CPU/gloo or GPU/NCCL).

    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py --epochs 2

Every rank runs every step -- IDLE batches included, their loss scaled by exactly 0 -- so DDP's all-reduce, and
any other collective the step issues, happen the same number of times on every rank whatever engine runs the
model. The loader owns gradient accumulation (``no_sync`` until ``StepInfo.window_end``) and ``scale_loss`` makes
the loss the exact global per-token mean: do not also divide by the accumulation steps. Resume: each rank saves
its own ``loader.state_dict()`` next to the model (see ``checkpoint``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import evenflow
from evenflow.integrations import StepMetrics, eval_loader, evaluate_loss
from _tiny import RandomChat, TinyCausalLM


def train(*, epochs: int = 2, accum: int = 2, token_budget: int = 256, n: int = 256, lr: float = 0.05,
          dtype=torch.float32, stop_after: int | None = None, resume: dict | None = None, record_grads: bool = False,
          log_every: int = 5) -> dict:
    """Train; returns per-window records (this rank's sample ids, the global window loss) and a checkpoint.

    ``stop_after``: stop after that many optimizer steps (a "preempted" job); ``resume``: a checkpoint from it.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = TinyCausalLM(dtype=dtype).to(device)
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loader = evenflow.DynamicBatchLoader(RandomChat(n), token_budget=token_budget, grad_accum_steps=accum,
                                         buffer_size=64, seed=0)
    start_epoch, steps = 0, 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        loader.load_state_dict(resume["loader"])   # this rank's own state
        start_epoch, steps = resume["epoch"], resume["steps"]
    meter, windows, window_loss, ids = StepMetrics(), [], torch.zeros((), dtype=torch.float64), []
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            meter.update(info)
            batch = {k: v.to(device) for k, v in batch.items()}
            with contextlib.nullcontext() if info.window_end else ddp.no_sync():
                loss = evenflow.scale_loss(ddp(**batch)["loss"], info)  # IDLE: exactly 0, still a full step
                loss.backward()
            window_loss += loss.detach().double().cpu()
            ids.extend(info.sample_ids)
            if not info.window_end:
                continue
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu().numpy() if record_grads else None
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            dist.all_reduce(window_loss)  # logging only: sum of the ranks' shares / W = the global per-token mean
            windows.append(dict(epoch=epoch, step=steps, ids=ids, loss=float(window_loss) / dist.get_world_size(),
                                grad=grad))
            window_loss, ids = torch.zeros((), dtype=torch.float64), []
            if steps % log_every == 0 and dist.get_rank() == 0:
                print(f"step {steps} epoch {epoch} loss {windows[-1]['loss']:.4f}", meter.summary(), flush=True)
            if steps == stop_after:
                ckpt = checkpoint(model, optimizer, loader, epoch, steps)
                loader.close()
                return dict(windows=windows, checkpoint=ckpt)
    # Evaluation: same batching, no shuffle, every sample once; exact per-token loss on every rank.
    val = evaluate_loss(model, eval_loader(RandomChat(64, seed=1), token_budget=token_budget), device=device)
    if dist.get_rank() == 0:
        print("eval", val, flush=True)
    loader.close()
    return dict(windows=windows, eval=val, checkpoint=checkpoint(model, optimizer, loader, epochs, steps))


def checkpoint(model, optimizer, loader, epoch: int, steps: int) -> dict:
    """What a rank saves (``torch.save`` it to ``ckpt/rank{r}.pt``): DDP replicas share the model, not the data."""
    state = loader.state_dict()
    return dict(model=model.state_dict(), optimizer=optimizer.state_dict(), loader=state, steps=steps,
                epoch=state["epoch"] + (1 if state["finished"] else 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--token-budget", type=int, default=256)
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timedelta(minutes=5))
    try:
        out = train(epochs=args.epochs, accum=args.accum, token_budget=args.token_budget)
        if dist.get_rank() == 0:
            print(f"done: {len(out['windows'])} optimizer steps, eval loss {out['eval']['loss']:.4f}")
    finally:
        dist.destroy_process_group()  # the pair of init_process_group (evenflow needs no teardown call)


if __name__ == "__main__":
    main()
