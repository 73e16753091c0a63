"""Real photos and pan videos -> DynamicBatchLoader -> a stock Qwen2-VL with every phase balanced (CPU/gloo).

    torchrun --standalone --nproc-per-node 2 examples/vlm_train.py                      # plain loop with DDP
    torchrun --standalone --nproc-per-node 2 examples/vlm_train.py --entry fsdp2        # FSDP2 fully_shard
    torchrun --standalone --nproc-per-node 2 examples/vlm_train.py --entry trainer      # HF DynamicBatchTrainer

The samples come from :class:`evenflow.data.multimodal.MultimodalChatDataset` (chitchat exchanges through the
Qwen3 template, scikit-image photos through the Qwen2-VL processor) and :class:`evenflow.data.video.
VideoChatDataset` (some photos become short pan videos). The model is the unmodified Hugging Face
``Qwen2VLForConditionalGeneration`` (or ``--family qwen2_5_vl``) built tiny from its config. What the balancing
adds to a training loop is two lines::

    vlm = BalancedVLM(model, group=dist.new_group(), config=VLMConfig(max_encoder_rows=PATCH_BUDGET))
    loss = vlm(batch, info).loss                  # instead of evenflow.scale_loss(model(**batch).loss, info)

Each step every rank shares its examples' metadata, all ranks compute the same plan per phase, images and video
time slices are encoded on their vision rank, their outputs go straight to the LLM rank of their example, and
the loss is the exact global per-token mean whatever the plan. The script prints each phase's imbalance
(max / mean load under the planner's cost model, before -> after) averaged over the steps.

DDP: every parameter takes part in every step on every rank (ranks without an image encode a dummy item
weighted 0, ranks without an example run one dummy token), so ``find_unused_parameters`` is not needed; with it
set, DDP still finds every parameter from the forward's outputs (the routed encoder outputs enter the forward
even when empty). FSDP2: the vision tower runs before the model's forward, so it is its own
``fully_shard`` root (its blocks under it), and so are each text layer, the token embedding, the final norm and
the LM head -- no unit wraps the whole model (see ``shard``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import evenflow
from evenflow.data import chitchat_conversations
from evenflow.data.multimodal import MediaMix, MultimodalChatDataset
from evenflow.data.video import VideoChatDataset
from evenflow.data.vocab import RemappedDataset, VocabRemap
from evenflow.vlm import BalancedVLM, VLMConfig, unwrap_model
from evenflow.testing.tiny_vlm import dense_vocab, tiny_vlm

PATCH_BUDGET = 1024
"""Vision patch rows per rank and step: the loader's budget and the balancer's cap alike."""


def build_dataset(samples: int, *, seed: int = 0, video_fraction: float = 0.4, frames: int = 4,
                  max_pixels: int = 64 * 28 * 28, vocab_size: int | None = 4096):
    """``(dataset, vocab)``: ``samples`` text, photo and pan-video chat samples (Qwen2-VL layout), their ids
    remapped to a ``vocab_size`` vocabulary (``None``: Qwen's own ids and ``vocab=None``)."""
    conversations = chitchat_conversations()[:samples]
    base = MultimodalChatDataset(conversations, num_samples=samples, seed=seed, layout="hf", max_pixels=max_pixels,
                                 mix=MediaMix(text=1, image=2, audio=0, both=0))
    dataset = VideoChatDataset(base, video_fraction=video_fraction, frames=frames, seed=seed)
    if vocab_size is None:
        return dataset, None
    vocab = dense_vocab(conversations, size=vocab_size)  # a CPU-sized output layer; lengths unchanged
    return RemappedDataset(dataset, vocab), vocab


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Activation (gradient) checkpointing, non-reentrant, under whichever name this transformers has."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})


def shard(model: torch.nn.Module, mesh=None) -> None:
    """FSDP2 units: each vision block under the vision tower, each text layer, the token embedding, the final
    norm and the LM head. FSDP2 takes the first unit to run forward as a root and refuses a root that contains
    a unit which already ran. The balanced step runs the vision tower before the model's forward, and the
    model's forward embeds the tokens before the text model's: so no unit may wrap the whole model, nor the text
    model around its embedding -- each piece is its own root."""
    from torch.distributed.fsdp import fully_shard

    visual, text = model.model.visual, model.model.language_model
    for block in visual.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(visual, mesh=mesh)
    for layer in text.layers:
        fully_shard(layer, mesh=mesh)
    for module in (text.embed_tokens, text.norm, model.lm_head):
        fully_shard(module, mesh=mesh)


def make_loader(dataset, *, token_budget: int = 1024, patch_budget: int = PATCH_BUDGET, accum: int = 1,
                seed: int = 0) -> evenflow.DynamicBatchLoader:
    return evenflow.DynamicBatchLoader(dataset, token_budget=token_budget, grad_accum_steps=accum, seed=seed,
                                       extra_budgets={"num_patches": patch_budget}, buffer_size=64)


class _Imbalance:
    """Mean over steps of each phase's max/mean load, before and after the plan."""

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] = {}
        self.steps = 0

    def add(self, step) -> None:
        for phase, b in step.imbalance().items():
            self.sums[phase] = self.sums.get(phase, np.zeros(3)) + (b.before, b.after, b.bound)
        self.steps += 1

    def summary(self) -> dict[str, dict[str, float]]:
        return {p: dict(zip(("before", "after", "bound"), np.round(s / max(self.steps, 1), 3).tolist()))
                for p, s in self.sums.items()}


def _record(step, info, loss: torch.Tensor) -> dict:
    return dict(step=info.step, ids=list(info.sample_ids), loss=float(loss), window_end=info.window_end,
                examples=step.examples, encoded=step.encoded,
                imbalance={p: b.after for p, b in step.imbalance().items()})


def _global_loss(step) -> torch.Tensor:
    """The window's exact per-token loss (this rank's summed share, all-reduced): for logging."""
    loss = torch.tensor([step.loss_sum / step.loss_tokens if step.loss_tokens else 0.0], dtype=torch.float64)
    dist.all_reduce(loss)
    return loss


def _params(model: torch.nn.Module) -> dict[str, np.ndarray] | None:
    """Every parameter in full on rank 0 (FSDP2 shards gathered; collective), None elsewhere."""
    out = {}
    for name, p in unwrap_model(model).named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().cpu().numpy().copy()
    return out if dist.get_rank() == 0 else None


def train(dataset, *, entry: str = "ddp", family: str = "qwen2_vl", vocab: VocabRemap | None = None,
          steps: int | None = None, lr: float = 0.1, layout: str = "packed", checkpointing: bool = False,
          find_unused: bool = False, accum: int = 1, token_budget: int = 1024, patch_budget: int = PATCH_BUDGET,
          balance: str = "full") -> dict:
    """A plain loop under DDP (``entry="ddp"``) or FSDP2 (``"fsdp2"``) on the current process group; returns the
    per-step records (this rank's sample ids, the global loss), the plan's mean imbalance and rank 0's final
    parameters. ``steps``: stop after that many (over epochs); ``None``: one epoch."""
    model = tiny_vlm(family, vocab=vocab)
    if checkpointing:
        enable_checkpointing(model)
    if entry == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
    elif entry == "fsdp2":
        shard(model)
        wrapped = model
    else:
        raise ValueError(f"entry must be 'ddp' or 'fsdp2' here (the trainer: train_trainer), got {entry!r}")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loader = make_loader(dataset, token_budget=token_budget, patch_budget=patch_budget, accum=accum)
    vlm = BalancedVLM(wrapped, group=dist.new_group(backend="gloo"),  # balancing traffic off the gradient group
                      config=VLMConfig(layout=layout, balance=balance, max_encoder_rows=patch_budget))
    records, imbalance, epoch = [], _Imbalance(), 0
    while True:
        loader.set_epoch(epoch)
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            sync = contextlib.nullcontext() if info.window_end or entry != "ddp" else wrapped.no_sync()
            if entry == "fsdp2":
                for unit in model.modules():
                    if hasattr(unit, "set_requires_gradient_sync"):
                        unit.set_requires_gradient_sync(info.window_end)
            with sync:
                step = vlm(batch, info)       # IDLE steps too: every rank enters every collective
                step.loss.backward()
            imbalance.add(step)
            records.append(_record(step, info, _global_loss(step)))
            if info.window_end:
                optimizer.step()
                optimizer.zero_grad()
            if steps is not None and len(records) == steps:
                break                         # on every rank at the same step
        if steps is None or len(records) == steps:
            break
        epoch += 1
    loader.close()
    return dict(records=records, imbalance=imbalance.summary(), params=_params(model))


def train_trainer(dataset, out_dir: str, *, family: str = "qwen2_vl", vocab: VocabRemap | None = None, steps: int = 3,
                  lr: float = 0.1, layout: str = "packed", checkpointing: bool = False, token_budget: int = 1024,
                  patch_budget: int = PATCH_BUDGET) -> dict:
    """``BalancedVLMTrainer`` (HF Trainer, the balanced step as its loss); same return as train."""
    from transformers import TrainingArguments

    from evenflow.integrations.vlm_trainer import BalancedVLMTrainer

    class RecordingTrainer(BalancedVLMTrainer):
        """Each step's sample ids, global loss and imbalance, for the records this script prints."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.records, self.imbalance = [], _Imbalance()

        def balanced_step(self, model, inputs, info):
            step = super().balanced_step(model, inputs, info)
            self.imbalance.add(step)
            self.records.append(_record(step, info, torch.tensor([step.window_loss])))
            return step

    model = tiny_vlm(family, vocab=vocab)
    args = TrainingArguments(output_dir=out_dir, max_steps=steps, learning_rate=lr, optim="sgd",
                             lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, logging_steps=1,
                             save_strategy="no", report_to=[], remove_unused_columns=False, use_cpu=True,
                             gradient_checkpointing=checkpointing,
                             gradient_checkpointing_kwargs={"use_reentrant": False} if checkpointing else None,
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=dataset, token_budget=token_budget,
                               max_encoder_rows=patch_budget, buffer_size=64, vlm_config=VLMConfig(layout=layout))
    trainer.train()
    return dict(records=trainer.records, imbalance=trainer.imbalance.summary(), params=_params(model))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entry", choices=("ddp", "fsdp2", "trainer"), default="ddp")
    ap.add_argument("--family", choices=("qwen2_vl", "qwen2_5_vl"), default="qwen2_vl")
    ap.add_argument("--layout", choices=("packed", "padded"), default="packed")
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--vocab", type=int, default=4096, help="remap the ids to this many (0: Qwen's own vocabulary)")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: one epoch)")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing in every block")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if "RANK" not in os.environ:  # plain `python examples/vlm_train.py`: a world of one
        dist.init_process_group("gloo", init_method=f"file:///tmp/evenflow-vlm-{os.getpid()}", rank=0,
                                world_size=1, timeout=timedelta(minutes=5))
    else:
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    try:
        dataset, vocab = build_dataset(args.samples, vocab_size=args.vocab or None)
        common = dict(family=args.family, vocab=vocab, layout=args.layout, checkpointing=args.checkpointing)
        if args.entry == "trainer":
            out = train_trainer(dataset, f"/tmp/evenflow-vlm-trainer-{os.getpid()}", steps=args.steps or 3, **common)
        else:
            out = train(dataset, entry=args.entry, steps=args.steps, **common)
        if dist.get_rank() == 0:
            for r in out["records"]:
                print(f"step {r['step']:3d}  loss {r['loss']:.4f}  imbalance after "
                      + "  ".join(f"{p} {v:.3f}" for p, v in r["imbalance"].items()))
            print("per-phase imbalance (mean over steps, max/mean load):")
            for phase, v in out["imbalance"].items():
                print(f"  {phase:6s} {v['before']:.3f} -> {v['after']:.3f}  (bound {v['bound']:.3f})")
            print(json.dumps({"entry": args.entry, "steps": len(out["records"]), "imbalance": out["imbalance"]}))
    finally:
        dist.destroy_process_group()  # the pair of init_process_group (evenflow needs no teardown call)


if __name__ == "__main__":
    main()
