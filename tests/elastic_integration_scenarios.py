"""Scenarios for tests/test_elastic_integrations.py: checkpoints saved by 2 ranks, resumed on 1 or 3.

Kept module-level so spawn-started ranks can import them. Each returns plain data (sample ids per step, the
LR reference, the epoch HF reported), or the error text. The Accelerate, DCP and list recipes are the code
blocks of the documentation (docs/elastic.md, docs/quickstart/accelerate.md), executed as written
(``snippet``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import traceback
from pathlib import Path

import torch

from evenflow import STEP_INFO_KEY

import integration_scenarios as isc
import loader_scenarios as lsc
from _snippets import snippet

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


# -- the documentation's recipes (docs/elastic.md, docs/quickstart/accelerate.md), executed as written -------------------------------------------------
SAVE_AT = 3


class Recorded:
    """The loader as the snippets see it, recording each batch's (epoch, sample ids, window end)."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.rows: list = []

    def __iter__(self):
        for batch in self.loader:
            info = batch[STEP_INFO_KEY]
            self.rows.append(dict(epoch=info.epoch, ids=list(info.sample_ids), window_end=info.window_end))
            yield batch

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _Out(dict):
    __getattr__ = dict.__getitem__


class TinyModel(torch.nn.Module):
    """Returns ``.loss`` like an HF model (the recipes call ``model(**batch).loss``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(512, 4, dtype=torch.float64)

    def forward(self, input_ids, labels=None, attention_mask=None, **_):
        return _Out(loss=self.emb(input_ids % 512).pow(2).mean())


def _loader(n=301):
    import evenflow
    return evenflow.DynamicBatchLoader(lsc.TokenDataset(n), token_budget=lsc.BUDGET, buffer_size=16, seed=4,
                                       grad_accum_steps=2)


def accelerate_snippet(out_dir, resume=None):
    loader = Recorded(_loader(200))
    model = TinyModel()
    scope = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loader=loader, epochs=2,
                 resume=resume, save_at=None if resume else SAVE_AT, out_dir=os.path.join(out_dir, "accelerate"))
    exec(snippet("accelerate"), scope)  # noqa: S102 - the documentation's own code
    loader.close()
    return dict(rows=loader.rows, start_epoch=scope["checkpoint"].start_epoch)


def dcp_save(out_dir, stop=6):
    """Train 6 steps, then the docs' dcp-save; the bare loader saved too (the wrong way), and each rank's
    plain state file for the resume-list recipe."""
    import torch.distributed.checkpoint as dcp

    import evenflow
    loader, ids = _loader(), []
    for batch in loader:
        info = evenflow.pop_step_info(batch)
        ids.extend(info.sample_ids)
        if info.step + 1 >= stop and info.window_end:
            break
    exec(snippet("dcp-save"), dict(loader=loader, path=os.path.join(out_dir, "dcp")))  # noqa: S102
    dcp.save({"loader": loader}, checkpoint_id=os.path.join(out_dir, "dcp_bare"))
    state = loader.state_dict()
    Path(out_dir, "plain").mkdir(exist_ok=True)
    Path(out_dir, "plain", f"loader_rank{state['rank']}.json").write_text(json.dumps(state))
    loader.close()
    return dict(ids=ids)


def dcp_resume(out_dir):
    import torch.distributed.checkpoint as dcp

    import evenflow
    from evenflow.integrations import LoaderCheckpoint
    loader = _loader()
    scope = dict(loader=loader, path=os.path.join(out_dir, "dcp"), dcp=dcp, LoaderCheckpoint=LoaderCheckpoint)
    exec(snippet("dcp-load"), scope)  # noqa: S102
    ids = [i for batch in loader for i in evenflow.pop_step_info(batch).sample_ids]
    loader.close()
    bare = _loader()
    try:
        dcp.load({"loader": bare}, checkpoint_id=os.path.join(out_dir, "dcp_bare"))
        refused = None
    except Exception as exc:  # noqa: BLE001
        refused = f"{type(exc).__name__}: {exc}"
    bare.close()
    return dict(ids=ids, start_epoch=scope["checkpoint"].start_epoch, bare=refused)


def resume_list(out_dir):
    import evenflow
    loader = _loader()
    exec(snippet("resume-list"), dict(json=json, loader=loader, ckpt=os.path.join(out_dir, "plain"),  # noqa: S102
                                      saved_world_size=2))
    ids = [i for batch in loader for i in evenflow.pop_step_info(batch).sample_ids]
    loader.close()
    return dict(ids=ids)


# -- the worlds ------------------------------------------------------------------------------------------------------
def saved_by_two(rank, world, out_dir, which):
    isc.torchrun_env(rank, world)
    out = {}
    if "hf" in which:
        out["hf"] = _guard(hf_run, out_dir)
    if "lightning" in which:
        out["lightning"] = _guard(lightning_run, out_dir, world)
    if "accelerate" in which:
        out["accelerate"] = _guard(accelerate_snippet, out_dir)
    out["dcp"] = _guard(dcp_save, out_dir)
    return out


def resumed_on_one(rank, world, out_dir, which, lightning_step):
    isc.torchrun_env(rank, world)
    out = {}
    if "hf" in which:
        out["hf"] = _guard(hf_run, out_dir, os.path.join(out_dir, "hf", f"checkpoint-{HF_SAVE}"))
    if "lightning" in which:
        path = glob.glob(os.path.join(out_dir, "lightning", "ckpt", f"*step={lightning_step}.ckpt"))
        out["lightning"] = _guard(lightning_run, out_dir, world, path[0] if path else "missing")
    if "accelerate" in which:
        out["accelerate"] = _guard(accelerate_snippet, out_dir, os.path.join(out_dir, "accelerate"))
    out["resume_list"] = _guard(resume_list, out_dir)
    return out


def resumed_on_three(rank, world, out_dir):
    isc.torchrun_env(rank, world)
    return dict(dcp=_guard(dcp_resume, out_dir))
