"""FSDP2 (``fully_shard``) loop with the loader over the data-parallel dimension of a ``DeviceMesh``.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_train.py            # dp=2
    torchrun --standalone --nproc-per-node 2 examples/fsdp2_train.py --tp 2     # dp=1 x tp=2

The loader's metadata group is a gloo group over one data-parallel slice of the mesh (``dp_process_group``), so
tensor/context-parallel peers -- same dp coordinate -- form identical batches without talking (here the "tp"
ranks only replicate the model; a real job would apply its TP plan on ``mesh["tp"]``). FSDP2 all-gathers in
every forward and reduce-scatters in every synced backward: every rank runs every step, IDLE batches included,
and gradient sync is switched off inside an accumulation window with ``set_requires_gradient_sync``.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import evenflow
from evenflow.integrations import StepMetrics, dp_process_group
from _tiny import RandomChat, TinyCausalLM


def train(*, tp: int = 1, epochs: int = 2, accum: int = 2, token_budget: int = 256, n: int = 256, lr: float = 0.05,
          dtype=torch.float32, record_grads: bool = False, log_every: int = 5) -> dict:
    """Train; returns per-window records (this rank's sample ids, the global window loss, optionally the grads)."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world = dist.get_world_size()
    mesh = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    model = TinyCausalLM(dtype=dtype).to(device_type)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loader = evenflow.DynamicBatchLoader(RandomChat(n), token_budget=token_budget, grad_accum_steps=accum,
                                         buffer_size=64, process_group=dp_process_group(mesh, "dp"))
    dp_group = mesh.get_group("dp")
    meter, windows, window_loss, ids, steps = StepMetrics(), [], torch.zeros((), dtype=torch.float64), [], 0
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            meter.update(info)
            model.set_requires_gradient_sync(info.window_end)
            loss = evenflow.scale_loss(model(**{k: v.to(device_type) for k, v in batch.items()})["loss"], info)
            loss.backward()
            window_loss += loss.detach().double().cpu()
            ids.extend(info.sample_ids)
            if not info.window_end:
                continue
            grad = None
            if record_grads:
                grad = torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()]).cpu().numpy()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            dist.all_reduce(window_loss, group=dp_group)  # logging: the global per-token mean of the window
            windows.append(dict(epoch=epoch, step=steps, ids=ids, loss=float(window_loss) / loader.world_size,
                                grad=grad, batches=info.step + 1))
            window_loss, ids = torch.zeros((), dtype=torch.float64), []
            if steps % log_every == 0 and dist.get_rank() == 0:
                print(f"step {steps} epoch {epoch} loss {windows[-1]['loss']:.4f}", meter.summary(), flush=True)
    loader.close()
    return dict(windows=windows, dp_rank=loader.rank, dp_size=loader.world_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="size of the (replicated) tensor-parallel dimension")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(minutes=5))
    try:
        out = train(tp=args.tp, epochs=args.epochs)
        if dist.get_rank() == 0:
            print(f"done: {len(out['windows'])} optimizer steps on dp rank {out['dp_rank']} of {out['dp_size']}")
    finally:
        dist.destroy_process_group()  # the pair of init_process_group (evenflow needs no teardown call)


if __name__ == "__main__":
    main()
