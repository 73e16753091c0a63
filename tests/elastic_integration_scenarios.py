"""Scenarios for tests/test_elastic_integrations.py: checkpoints saved by 2 ranks, resumed on 1 or 3.

Kept module-level so spawn-started ranks can import them. Each returns plain data (sample ids per step, the
LR reference, the epoch HF reported), or the error text.
"""

from __future__ import annotations

import glob
import os
import traceback

import torch

import integration_scenarios as isc
import loader_scenarios as lsc

HF_STEPS, HF_SAVE = 14, 6


def _guard(fn, *args):
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported per scenario; the others still run
        return {"error": traceback.format_exc()}


# -- Hugging Face Trainer ----------------------------------------------------------------------------------------
def hf_run(out_dir, resume=None):
    RecordingTrainer, _ = isc._hf_classes()
    args = isc._hf_args(os.path.join(out_dir, "hf"), gradient_accumulation_steps=2, max_steps=HF_STEPS,
                        learning_rate=0.05, optim="sgd", save_strategy="steps", save_steps=HF_SAVE)
    trainer = RecordingTrainer(model=isc.tiny_llama(), args=args, train_dataset=isc.ChatLike(80, seed=3),
                               token_budget=128, buffer_size=16, lr_scaling="sqrt")
    trainer.record = []
    out = trainer.train(resume_from_checkpoint=resume)
    epochs = [(log["step"], log["epoch"]) for log in trainer.state.log_history if "loss" in log]
    return dict(record=trainer.record, global_step=out.global_step, reference=trainer.lr_scaler.reference_tokens,
                epochs=epochs)


# -- Lightning ---------------------------------------------------------------------------------------------------
def lightning_run(out_dir, devices, ckpt_path=None):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from evenflow.integrations.lightning import EvenflowCallback
    lightning_train, RecordingModule, _ = isc._lightning_classes()
    root = os.path.join(out_dir, "lightning")
    references = set()

    class References(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            for cb in trainer.callbacks:
                if isinstance(cb, EvenflowCallback):
                    references.update(s.reference_tokens for s in cb.lr_scalers)

    callbacks = (References(),) if ckpt_path else (
        References(), ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=1, save_top_k=-1))
    module = RecordingModule()
    trainer = lightning_train.fit(module=module, callbacks=callbacks, epochs=2, accum=2, n=96, token_budget=192,
                                  root=root, devices=devices, ckpt_path=ckpt_path, lr_scaling="sqrt",
                                  progress_bar=False)
    return dict(record=module.record, global_step=trainer.global_step, references=sorted(references))


def lightning_stop(record) -> int:
    """An optimizer step strictly inside epoch 1 (Lightning's checkpoint names count steps done)."""
    windows = [dict(epoch=r["epoch"], step=r["global_step"] + 1) for r in record if r["window_end"]]
    return isc._mid_epoch_step(windows)


# -- Accelerate ------------------------------------------------------------------------------------------------------
def accelerate_run(out_dir, save_at=None, resume=None):
    isc._examples()
    import accelerate_train
    out = os.path.join(out_dir, "accelerate")
    res = accelerate_train.train(epochs=2, accum=2, n=96, token_budget=192, lr=0.0, dtype=torch.float64,
                                 out_dir=out, save_at=save_at, resume=resume)
    return dict(windows=res["windows"])


# -- torch.distributed.checkpoint ---------------------------------------------------------------------------------
def _dcp_loader():
    import evenflow
    return evenflow.DynamicBatchLoader(lsc.TokenDataset(301), token_budget=lsc.BUDGET, buffer_size=16, seed=4,
                                       grad_accum_steps=2)


def dcp_save(out_dir, stop=6):
    """Train 6 steps, then dcp.save the gathered LoaderCheckpoint, and the bare loader (the wrong way)."""
    import torch.distributed.checkpoint as dcp

    import evenflow
    from evenflow.integrations import LoaderCheckpoint
    loader = _dcp_loader()
    ckpt = LoaderCheckpoint(loader)
    ids = []
    for batch in loader:
        info = evenflow.pop_step_info(batch)
        ids.extend(info.sample_ids)
        if info.step + 1 >= stop and info.window_end:
            break
    dcp.save({"loader": ckpt}, checkpoint_id=os.path.join(out_dir, "dcp"))
    dcp.save({"loader": loader}, checkpoint_id=os.path.join(out_dir, "dcp_bare"))
    loader.close()
    return dict(ids=ids)


def dcp_resume(out_dir):
    import torch.distributed.checkpoint as dcp

    import evenflow
    from evenflow.integrations import LoaderCheckpoint
    loader = _dcp_loader()
    ckpt = LoaderCheckpoint(loader)
    dcp.load({"loader": ckpt}, checkpoint_id=os.path.join(out_dir, "dcp"))
    loader.set_epoch(ckpt.start_epoch)
    ids = [i for batch in loader for i in evenflow.pop_step_info(batch).sample_ids]
    loader.close()
    bare = _dcp_loader()
    try:
        dcp.load({"loader": bare}, checkpoint_id=os.path.join(out_dir, "dcp_bare"))
        refused = None
    except Exception as exc:  # noqa: BLE001
        refused = f"{type(exc).__name__}: {exc}"
    bare.close()
    return dict(ids=ids, start_epoch=ckpt.start_epoch, bare=refused)


# -- the worlds ------------------------------------------------------------------------------------------------------
def saved_by_two(rank, world, out_dir, which):
    isc.torchrun_env(rank, world)
    out = {}
    if "hf" in which:
        out["hf"] = _guard(hf_run, out_dir)
    if "lightning" in which:
        out["lightning"] = _guard(lightning_run, out_dir, world)
    if "accelerate" in which:
        full = _guard(accelerate_run, out_dir)
        if "error" not in full:
            save = isc._mid_epoch_step(full["windows"])
            out["accelerate"] = _guard(accelerate_run, out_dir, save)
            out["accelerate_save"] = save
    out["dcp"] = _guard(dcp_save, out_dir)
    return out


def resumed_on_one(rank, world, out_dir, which, lightning_step, accelerate_save):
    isc.torchrun_env(rank, world)
    out = {}
    if "hf" in which:
        out["hf"] = _guard(hf_run, out_dir, os.path.join(out_dir, "hf", f"checkpoint-{HF_SAVE}"))
    if "lightning" in which:
        path = glob.glob(os.path.join(out_dir, "lightning", "ckpt", f"*step={lightning_step}.ckpt"))
        out["lightning"] = _guard(lightning_run, out_dir, world, path[0] if path else "missing")
    if "accelerate" in which:
        out["accelerate"] = _guard(accelerate_run, out_dir, None,
                                   os.path.join(out_dir, "accelerate", f"step_{accelerate_save}"))
    return out


def resumed_on_three(rank, world, out_dir):
    return dict(dcp=_guard(dcp_resume, out_dir))
