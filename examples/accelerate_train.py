"""Accelerate loop with evenflow batches: the loader stays out of ``accelerator.prepare``.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py
    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py --resume accelerate_out/step_6

``accelerator.prepare`` only wraps ``torch.utils.data.DataLoader`` objects (it returns evenflow's loader untouched),
so ``device_batches`` moves each batch to ``accelerator.device``; the loader owns accumulation windows
(``sync_window``), and ``Accelerator(gradient_accumulation_steps=1)`` keeps ``accelerator.backward`` from dividing
the window-normalized loss again. ``LoaderCheckpoint`` puts every rank's loader position into ``save_state``.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator, PartialState

import evenflow
from evenflow.integrations import StepMetrics
from evenflow.integrations.accelerate import LoaderCheckpoint, device_batches, sync_window
from _tiny import RandomChat, tiny_llama


def train(*, epochs: int = 2, accum: int = 2, token_budget: int = 256, n: int = 256, lr: float = 3e-3,
          dtype=torch.float32, save_at: int | None = None, resume: str | None = None, out_dir: str = "accelerate_out",
          record_grads: bool = False, log_every: int = 5) -> dict:
    """Train; returns per-window records (this rank's sample ids, the window loss share, optionally grads)."""
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = tiny_llama(dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = evenflow.DynamicBatchLoader(RandomChat(n), token_budget=token_budget, grad_accum_steps=accum,
                                         buffer_size=64)
    assert accelerator.prepare(loader) is loader  # prepare leaves it alone: hence device_batches below
    position = LoaderCheckpoint(loader)
    accelerator.register_for_checkpointing(position)
    steps = 0
    if resume is not None:
        accelerator.load_state(resume)
        steps = int(resume.rstrip("/").rsplit("_", 1)[-1])
    meter, windows, share, ids = StepMetrics(), [], 0.0, []
    for epoch in range(position.start_epoch, epochs):
        loader.set_epoch(epoch)
        for batch, info in device_batches(loader, accelerator):
            meter.update(info)
            with sync_window(accelerator, model, info):
                loss = evenflow.scale_loss(model(**batch).loss, info)
                accelerator.backward(loss)
            share += float(loss.detach())
            ids.extend(info.sample_ids)
            if not info.window_end:
                continue
            grad = None
            if record_grads:
                grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu().numpy()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            # gather(): the global window loss for logging = sum of the ranks' shares / W.
            total = accelerator.gather(torch.tensor([share], device=accelerator.device)).sum().item()
            windows.append(dict(epoch=epoch, step=steps, ids=ids, loss=total / accelerator.num_processes, grad=grad))
            share, ids = 0.0, []
            if steps % log_every == 0:
                metrics = {"loss": windows[-1]["loss"], **meter.summary()}
                accelerator.log(metrics, step=steps)  # to the configured trackers (log_with=...), if any
                accelerator.print(f"step {steps}", metrics)
            if steps == save_at:
                accelerator.save_state(os.path.join(out_dir, f"step_{steps}"))
    loader.close()
    return dict(windows=windows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save-at", type=int, default=6)
    cli = parser.parse_args()
    out = train(resume=cli.resume, save_at=cli.save_at)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"done: {len(out['windows'])} optimizer steps in this run")
    # The end of an Accelerate script (what accelerator.end_training() does, trackers aside): the process group
    # Accelerate started is destroyed, so the window gather above is not left to race the interpreter's exit.
    # evenflow itself needs no call (docs/failures.md, "Exit codes").
    PartialState().destroy_process_group()


if __name__ == "__main__":
    main()
