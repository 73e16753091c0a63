"""Scenarios for tests/test_integrations.py, run inside real gloo process worlds (tests/_dist.py).

Kept module-level so spawn-started ranks can import them. Every scenario returns plain data (ids, losses, grads)
that the test compares against a single-process float64 reference.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

VOCAB = 64
IGNORE = -100


class ChatLike(Dataset):
    """Long-tail lengths (lognormal, 4..48 tokens), random ids, the first third of labels masked."""

    def __init__(self, n: int, seed: int = 0, max_len: int = 48) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = np.clip(rng.lognormal(2.6, 0.8, n).astype(np.int64), 4, max_len)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        n = int(self.lengths[i])
        ids = torch.from_numpy(np.random.default_rng([self.seed, i]).integers(1, VOCAB, n))
        labels = ids.clone()
        labels[: n // 3] = IGNORE
        return {"input_ids": ids, "labels": labels}


def tiny_llama(dtype=torch.float64, seed: int = 0):
    """A 1-layer, hidden-16 Llama with random weights (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype)


def reference_window(model, dataset, ids) -> tuple[float, np.ndarray]:
    """Single-process per-token mean loss over ``ids`` (one sample at a time) and its gradient."""
    model.zero_grad()
    total = torch.zeros((), dtype=torch.float64)
    tokens = 0
    for i in ids:
        s = dataset[i]
        logits = model(input_ids=s["input_ids"][None]).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits[:-1].to(torch.float64), s["labels"][1:],
                                                          ignore_index=IGNORE, reduction="sum")
        tokens += int((s["labels"][1:] != IGNORE).sum())
    loss = total / tokens
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()
    model.zero_grad()
    return float(loss.detach()), grad


# -- process setup -------------------------------------------------------------------------------------------
def torchrun_env(rank: int, world: int) -> None:
    """What ``torchrun`` exports. accelerate (and so HF Trainer) detects a multi-CPU job only from these; the
    gloo process group itself is already initialized by tests/_dist.py, so nothing else is rendezvoused."""
    import os
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)


def step_record(info) -> dict:
    return dict(epoch=info.epoch, step=info.step, ids=list(info.sample_ids), window_end=info.window_end,
                idle=info.is_idle, local=info.local_loss_tokens, window=info.window_loss_tokens)


# -- Hugging Face Trainer --------------------------------------------------------------------------------------
def _hf_classes():
    from transformers import TrainerCallback

    from evenflow import STEP_INFO_KEY
    from evenflow.integrations.hf import DynamicBatchTrainer

    class RecordingTrainer(DynamicBatchTrainer):
        """Records each micro-batch's StepInfo (compute_loss sees it before the model does)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.record.append(dict(step_record(inputs[STEP_INFO_KEY]), global_step=self.state.global_step))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class GradRecorder(TrainerCallback):
        def __init__(self) -> None:
            self.grads = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy())

    return RecordingTrainer, GradRecorder


def _hf_args(out_dir, **kw):
    from transformers import TrainingArguments
    base = dict(output_dir=out_dir, per_device_train_batch_size=1, logging_steps=1, save_strategy="no",
                report_to="none", use_cpu=True, dataloader_pin_memory=False, disable_tqdm=True, seed=0)
    return TrainingArguments(**{**base, **kw})


def sc_hf_epochs(rank, world, out_dir, n=80, accum=3, epochs=2):
    """num_train_epochs mode, lr=0: per-window loss/gradient vs reference, coverage, eval with evenflow batches."""
    RecordingTrainer, GradRecorder = _hf_classes()
    grads = GradRecorder()
    args = _hf_args(out_dir, gradient_accumulation_steps=accum, num_train_epochs=epochs, learning_rate=0.0,
                    max_grad_norm=0.0, lr_scheduler_type="constant")
    # planning="local": the test needs an epoch that ends on a shorter window (IDLE-padded), which depends on
    # the exact step counts of the local policy for this data (the default, global at 2 ranks, ends both on
    # full windows); sc_hf_resume runs the default.
    trainer = RecordingTrainer(model=tiny_llama(), args=args, train_dataset=ChatLike(n),
                               eval_dataset=ChatLike(37, seed=1), token_budget=128, eval_token_budget=160,
                               buffer_size=16, callbacks=[grads], planning="local")
    trainer.record = []
    out = trainer.train()
    metrics = trainer.evaluate()
    logs = [dict(loss=l["loss"], step=l["step"], idle=l["evenflow/idle_steps"], imbalance=l["evenflow/imbalance"])
            for l in trainer.state.log_history if "loss" in l]
    return dict(record=trainer.record, logs=logs, grads=grads.grads, global_step=out.global_step,
                eval=metrics, epoch=trainer.state.epoch)


def sc_hf_resume(rank, world, out_dir, n=80, accum=2, max_steps=14, save_steps=3):
    """max_steps mode with SGD: stop nowhere, checkpoint every few steps, resume mid-epoch and compare."""
    import os
    RecordingTrainer, _ = _hf_classes()

    def run(resume=None):
        args = _hf_args(os.path.join(out_dir, "resume"), gradient_accumulation_steps=accum, max_steps=max_steps,
                        learning_rate=0.05, optim="sgd", save_strategy="steps", save_steps=save_steps)
        trainer = RecordingTrainer(model=tiny_llama(), args=args, train_dataset=ChatLike(n, seed=3),
                                   token_budget=128, buffer_size=16)
        trainer.record = []
        out = trainer.train(resume_from_checkpoint=resume)
        logs = [dict(loss=l["loss"], step=l["step"]) for l in trainer.state.log_history if "loss" in l]
        return dict(record=trainer.record, logs=logs, global_step=out.global_step)

    first = run()
    # A checkpoint strictly inside an epoch after the first one (exercises HF's epoch arithmetic), else any.
    ends = {}  # global step after each window -> (epoch, last window of its epoch?)
    rec = [r for r in first["record"]]
    for i, r in enumerate(rec):
        if r["window_end"] and (i + 1 == len(rec) or rec[i + 1]["global_step"] != r["global_step"]):
            nxt = rec[i + 1] if i + 1 < len(rec) else None
            ends[r["global_step"] + 1] = (r["epoch"], nxt is None or nxt["epoch"] != r["epoch"])
    saved = [s for s in range(save_steps, max_steps, save_steps) if s in ends and not ends[s][1]]
    later = [s for s in saved if ends[s][0] >= 1]
    step = (later or saved)[0]
    second = run(os.path.join(out_dir, "resume", f"checkpoint-{step}"))
    return dict(first=first, second=second, resume_step=step, resume_epoch=ends[step][0])


# -- examples run inside the world (plain DDP, FSDP2, Accelerate, Lightning) -----------------------------------
def _examples():
    import sys
    from pathlib import Path
    path = str(Path(__file__).resolve().parent.parent / "examples")
    if path not in sys.path:
        sys.path.insert(0, path)


def _mid_epoch_step(windows: list, epoch: int = 1) -> int:
    """An optimizer step strictly inside ``epoch`` (not its last window), else inside any epoch."""
    last = {}
    for w in windows:
        last[w["epoch"]] = w["step"]
    inside = [w["step"] for w in windows if w["step"] != last[w["epoch"]]]
    later = [w["step"] for w in windows if w["epoch"] == epoch and w["step"] != last[epoch]]
    return (later or inside)[len(later or inside) // 2]


def sc_ddp(rank, world, n=96, accum=3):
    _examples()
    import ddp_train
    kw = dict(epochs=2, accum=accum, n=n, token_budget=192, lr=0.0, dtype=torch.float64)
    full = ddp_train.train(record_grads=True, **kw)
    stop = _mid_epoch_step(full["windows"])
    first = ddp_train.train(stop_after=stop, **kw)
    second = ddp_train.train(resume=first["checkpoint"], record_grads=True, **kw)
    return dict(full=full["windows"], eval=full["eval"], first=first["windows"], second=second["windows"], stop=stop)


def sc_fsdp2(rank, world, n=96, accum=2):
    _examples()
    import fsdp2_train
    kw = dict(epochs=1, accum=accum, n=n, token_budget=192, lr=0.0, dtype=torch.float64)
    dp = fsdp2_train.train(tp=1, record_grads=True, **kw)
    tp = fsdp2_train.train(tp=world, **kw)  # dp=1: every rank is a "tensor-parallel" peer of the others
    return dict(dp=dp, tp=tp)


def sc_accelerate(rank, world, out_dir, n=96, accum=2):
    import os
    _examples()
    import accelerate_train
    out = os.path.join(out_dir, "accelerate")
    kw = dict(epochs=2, accum=accum, n=n, token_budget=192, lr=0.0, dtype=torch.float64, record_grads=True,
              out_dir=out)
    full = accelerate_train.train(**kw)
    save = _mid_epoch_step(full["windows"])
    saved = accelerate_train.train(save_at=save, **kw)
    resumed = accelerate_train.train(resume=os.path.join(out, f"step_{save}"), **kw)
    return dict(full=full["windows"], saved=saved["windows"], resumed=resumed["windows"], save=save)


def _lightning_classes():
    import lightning as L
    _examples()
    import lightning_train

    from evenflow import STEP_INFO_KEY

    class RecordingModule(lightning_train.TinyModule):
        def __init__(self) -> None:
            super().__init__(lr=0.0, dtype=torch.float64)
            self.record = []

        def training_step(self, batch, batch_idx):
            info = batch[STEP_INFO_KEY]
            loss = super().training_step(batch, batch_idx)
            self.record.append(dict(step_record(info), loss=float(loss.detach()), global_step=self.trainer.global_step,
                                    batch_idx=batch_idx))
            return loss

    class GradRecorder(L.Callback):
        def __init__(self) -> None:
            self.grads = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads.append(torch.cat([p.grad.reshape(-1) for p in pl_module.parameters()]).numpy().copy())

    return lightning_train, RecordingModule, GradRecorder


def sc_lightning(rank, world, out_dir, n=96, accum=2):
    import glob
    import os

    from lightning.pytorch.callbacks import ModelCheckpoint
    lightning_train, RecordingModule, GradRecorder = _lightning_classes()
    root = os.path.join(out_dir, "lightning")
    kw = dict(epochs=2, accum=accum, n=n, token_budget=192, root=root)
    grads = GradRecorder()
    ckpt = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=1, save_top_k=-1)
    module = RecordingModule()
    trainer = lightning_train.fit(module=module, callbacks=(grads, ckpt), **kw)
    first = module.record
    windows = [dict(epoch=r["epoch"], step=r["global_step"] + 1) for r in first if r["window_end"]]
    stop = _mid_epoch_step(windows)
    path = glob.glob(os.path.join(root, "ckpt", f"*step={stop}.ckpt"))
    resumed = RecordingModule()
    lightning_train.fit(module=resumed, ckpt_path=path[0], **kw)
    metrics = trainer.callbacks[0].history  # EvenflowCallback
    return dict(first=first, grads=grads.grads, resumed=resumed.record, stop=stop, metrics=metrics,
                val_loss=float(trainer.callback_metrics["val_loss"]), global_step=trainer.global_step)


def sc_eval(rank, world, n=61):
    """eval_loader/evaluate_loss: every sample once per pass, identical passes, no effect on a training loader."""
    _examples()
    from _tiny import RandomChat, TinyCausalLM

    import evenflow
    from evenflow.integrations import eval_loader, evaluate_loss

    train = evenflow.DynamicBatchLoader(RandomChat(40), token_budget=128, buffer_size=8)
    train.set_epoch(0)
    it = iter(train)
    next(it)
    before = train.state_dict()
    model = TinyCausalLM(dtype=torch.float64)
    params = [p.detach().clone() for p in model.parameters()]
    loader = eval_loader(RandomChat(n, seed=2), token_budget=128, buffer_size=8)
    passes = []
    for _ in range(2):
        passes.append([step_record(evenflow.pop_step_info(b)) for b in loader])
    result = evaluate_loss(model, loader)
    after = train.state_dict()
    unchanged = all(torch.equal(p, q) for p, q in zip(params, model.parameters()))
    grads = any(p.grad is not None for p in model.parameters())
    it.close()
    train.close()
    loader.close()
    return dict(passes=passes, result=result, train_state_same=before == after, params_same=unchanged,
                grads=grads, training=model.training)
