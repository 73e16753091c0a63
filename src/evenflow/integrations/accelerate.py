"""Hugging Face Accelerate: evenflow's loader stays *outside* ``accelerator.prepare``; evenflow owns accumulation.

    accelerator = Accelerator()                       # gradient_accumulation_steps=1 (evenflow owns windows)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = DynamicBatchLoader(ds, token_budget=8192, grad_accum_steps=4)
    checkpoint = LoaderCheckpoint(loader)
    accelerator.register_for_checkpointing(checkpoint)  # save_state / load_state carry every rank's position
    for batch, info in device_batches(loader, accelerator):
        with sync_window(accelerator, model, info):
            accelerator.backward(model(**batch).loss * info.loss_scale)
        if info.window_end:
            optimizer.step(); optimizer.zero_grad()

``LoaderCheckpoint`` (evenflow.integrations.states) gathers every rank's loader position into ``save_state``; a
``load_state`` on another number of processes re-deals the untrained rest of the epoch.

Written against accelerate 1.15. Why outside ``prepare``: ``prepare`` wraps only ``torch.utils.data.DataLoader``
instances and returns any other object unchanged (tests/test_integrations.py checks this), so evenflow's batches
would silently stay on the CPU; a prepared ``DataLoader`` would instead be re-sharded by rank, or with
``dispatch_batches`` broadcast from rank 0 -- both break variable-shape, rank-aligned batches. So the loader is
never prepared, and [`device_batches()`][device_batches] moves each batch with ``accelerate.utils.send_to_device``.

Why not ``accelerator.accumulate``: it syncs on its own step counter and on ``end_of_dataloader``, which only a
prepared loader reports, so an epoch's last, shorter window would never sync. [`sync_window()`][sync_window] uses the
loader's ``StepInfo.window_end`` instead. ``accelerator.backward`` divides the loss by the Accelerator's
``gradient_accumulation_steps``; keep that at 1 (checked) -- ``loss_scale`` already normalizes the window.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


try:
    from accelerate.utils import send_to_device
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("evenflow.integrations.accelerate needs accelerate: pip install 'evenflow[accelerate]'") from exc

from ..runtime.loader import DynamicBatchLoader
from .states import LoaderCheckpoint
from ..step_info import StepInfo, pop_step_info

__all__ = ["device_batches", "sync_window", "LoaderCheckpoint"]


def _check(accelerator) -> None:
    if accelerator.gradient_accumulation_steps != 1:
        raise ValueError(f"Accelerator(gradient_accumulation_steps={accelerator.gradient_accumulation_steps}) would "
                         "divide evenflow's already window-normalized loss again; keep it at 1 and pass "
                         "grad_accum_steps to DynamicBatchLoader")


def device_batches(loader: DynamicBatchLoader, accelerator) -> Iterator[tuple[dict, StepInfo]]:
    """One epoch of ``(batch on accelerator.device, StepInfo)``; IDLE batches included (run them: collectives)."""
    _check(accelerator)
    for batch in loader:
        info = pop_step_info(batch)
        yield send_to_device(batch, accelerator.device), info


def sync_window(accelerator, model, info: StepInfo) -> contextlib.AbstractContextManager:
    """``accelerator.no_sync(model)`` inside an accumulation window, a plain context on its last micro-step."""
    _check(accelerator)
    return contextlib.nullcontext() if info.window_end else accelerator.no_sync(model)
