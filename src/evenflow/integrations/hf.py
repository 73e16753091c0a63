"""Hugging Face ``transformers.Trainer`` with evenflow batches: [`DynamicBatchTrainer`][DynamicBatchTrainer].

    trainer = DynamicBatchTrainer(model=model, args=TrainingArguments(..., gradient_accumulation_steps=4),
                                  train_dataset=tokenized, token_budget=16384)
    trainer.train()

Written against transformers 5.24 (its ``Trainer._inner_training_loop`` / ``_run_epoch``); every hook used is a
documented override point: ``get_train_dataloader``, ``get_batch_samples``, ``compute_loss`` (+ the
``loss_is_scaled_for_ga`` class attribute), ``log``, ``evaluate``, ``train`` and a ``TrainerCallback``.

NOTE [ HF Trainer contract ]
    Units. ``global_step``, ``max_steps``, ``warmup_steps``, ``logging_steps``, ``save_steps`` and the LR schedule
    all count *optimizer steps* = evenflow accumulation windows of ``gradient_accumulation_steps`` micro-batches
    (the last window of an epoch may be shorter). ``TrainingArguments.gradient_accumulation_steps`` is the
    loader's ``grad_accum_steps``; do not set it anywhere else.

    Loss, exactly once. ``compute_loss`` backpropagates ``mean_loss_r * StepInfo.loss_scale`` (NOTE [ Loss scale ]
    in evenflow.planning.loss) and the class sets ``loss_is_scaled_for_ga = True``, so ``training_step`` does not
    divide by the accumulation steps again, and ``get_batch_samples`` counts no ``num_items_in_batch`` of its own
    (it reports the loader's global window count, which evenflow already exchanged). A ``compute_loss_func`` gets
    ``num_items_in_batch = window_tokens / world_size``, so the HF contract "sum / num_items" yields the same
    scale. IDLE batches run the forward (DDP/FSDP collectives stay in step) and count exactly 0, never NaN.

    Epoch length. HF sizes an epoch from ``len(dataloader)``. With ``num_train_epochs`` (``max_steps <= 0``) and
    the samples' lengths known -- ``lengths=`` (a loader option), or taken automatically from an HF
    ``datasets.Dataset``'s ``input_ids`` column (Arrow offsets; up to 1M samples) -- every epoch is planned
    before it starts (NOTE [ The planned epoch length ] in evenflow.runtime.epoch_plan): the loader reports the
    longest remaining epoch's micro-batches, ``state.max_steps`` is the run's exact optimizer steps from step 0,
    and the LR scheduler's horizon is their sum (``create_scheduler``). Otherwise the loader reports the bound
    ``ceil(N / W)`` micro-batches per epoch; with ``max_steps > 0`` it reports no length, and HF loops epochs
    until ``max_steps``. Either way an
    epoch ends when the loader is exhausted: ``get_batch_samples`` sets ``control.should_epoch_stop`` on the
    first empty fetch. HF syncs gradients and steps the optimizer only every ``gradient_accumulation_steps``
    micro-batches, so an epoch's last, shorter window is completed with IDLE micro-batches (``loss_scale = 0``:
    at most ``gradient_accumulation_steps - 1`` extra forward/backward passes per epoch) and then applied.

    Resume. The loader's per-rank state is written next to each checkpoint (``evenflow_loader_rank{r}.json``,
    from ``on_save``) and loaded by ``get_train_dataloader`` when ``train(resume_from_checkpoint=...)``: each
    rank's own file, or -- on another number of processes -- every saved rank's file, from which the rest of
    the epoch is re-dealt (NOTE [ What an HF checkpoint folder must hold ] in evenflow.integrations.hf_epochs).
    With ``lr_scaling`` the token LR rule keeps the reference it was saved with. HF's own
    batch skipping works by counting batches of ``len(dataloader)``, which is only a bound here, so the trainer
    runs on a copy of ``args`` with ``ignore_data_skip=True``: nothing is skipped twice. The loader, not HF's epoch
    counter, owns the epoch number (HF's ``set_epoch`` is not forwarded; ``state.epoch`` is rewritten from the
    loader after every step).

    LR schedule. Schedules that depend on the total (linear, cosine, ...) are exact with planned epochs (above)
    or ``max_steps``; otherwise the horizon HF computes is the upper bound, and a warning says so. A mid-epoch
    resume re-forms the rest of that epoch's batches, so its remaining steps may differ from the plan by a few.

    Not used: ``per_device_train_batch_size`` (the token budget sizes batches), ``dataloader_drop_last`` (evenflow
    never drops), ``group_by_length`` / ``train_sampling_strategy`` (evenflow groups by realized length); the
    first three warn once, at the caller, when set away from HF's default.

    Metrics. ``state.epoch`` is the loader epoch + samples done / N (map-style join mode; exact, not HF's
    batches / bound). ``state.max_steps`` -- HF's progress-bar total and its stop bound -- is refreshed after
    every optimizer step to a still-valid upper bound (steps taken + what the loader's tightening bound leaves
    + whole epochs to come) and set to the steps taken when the run ends; under ``max_steps`` it is exact from
    the start. An ``IterableDataset`` has no length: HF needs ``max_steps`` and shows that. The final
    ``train_samples_per_second`` counts the samples trained (StepInfo), ``train_tokens_per_second`` and
    ``train_loss_tokens_per_second`` are added. After a mid-epoch resume the epoch fraction continues from the
    samples every rank had trained at the checkpoint when the folder holds every rank's file (else from 0).
    Packing: padding-free rows (``position_ids`` without ``attention_mask``) always reach the model with
    ``use_cache=False`` (NOTE [ Packing and the KV cache ] in evenflow.runtime.collate).
    Known HF behaviour kept as is: ``train_loss`` in the final metrics adds this rank's unreduced share for the
    steps after the last log (HF does the same with its own token averaging); the logged ``loss`` values are exact.
    ``num_input_tokens_seen`` counts IDLE placeholder tokens too. Hyperparameter search (``trial``) is untested.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import sys
import os
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch

try:
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import ProgressCallback
    from transformers.trainer_utils import get_last_checkpoint
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("evenflow.integrations.hf needs transformers and accelerate: pip install 'evenflow[hf]'"
                      ) from exc

from ..lr import TokenLRRule, TokenLRScaler
from ..planning.loss import LossTokenRule
from ..runtime.comm import sum_over
from ..runtime.loader import DynamicBatchLoader
from ..step_info import STEP_INFO_KEY, StepInfo
from .evaluation import eval_loader, evaluate_loss
from .hf_epochs import LOADER_STATE_FILE, BoundProgressCallback, EpochCallback, TrainBatches, read_loader_files
from .metrics import StepMetrics

__all__ = ["DynamicBatchTrainer", "LOADER_STATE_FILE"]

# Schedules whose shape does not depend on the total number of steps (exact under num_train_epochs too).
_HORIZON_FREE = {"constant", "constant_with_warmup", "inverse_sqrt", "reduce_lr_on_plateau"}
_LOADER_PARAMS = frozenset(name for name, p in inspect.signature(DynamicBatchLoader.__init__).parameters.items()
                           if p.kind is p.KEYWORD_ONLY)
# Padding-free kwargs HF models take through ``**kwargs`` (flash attention), kept by the column filter.
_PACKING_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})


def _has_encoder_tower(model: Any) -> bool:
    """A multimodal model: its config has a vision or audio sub-config (Qwen2-VL, LLaVA, the Omni thinker...)."""
    config = getattr(model, "config", None)
    return any(getattr(config, name, None) is not None for name in ("vision_config", "audio_config"))


class DynamicBatchTrainer(Trainer):
    """A ``transformers.Trainer`` whose training batches come from
    [`evenflow.DynamicBatchLoader`][evenflow.DynamicBatchLoader].

    ``token_budget`` and any other ``DynamicBatchLoader`` option (``buffer_size``, ``join``, ``cost``,
    ``collate_fn``, ``num_workers``...) are keyword arguments; unset data-loading options default from
    ``TrainingArguments`` (``dataloader_num_workers``, ``dataloader_pin_memory``, ``dataloader_persistent_workers``,
    ``dataloader_prefetch_factor``, ``dataloader_multiprocessing_context``, ``data_seed``/``seed``); an explicit
    ``data_collator`` is the loader's ``collate_fn``. ``eval_token_budget`` makes [`evaluate()`][evaluate] use evenflow
    batching and report the exact per-token loss. ``lr_scaling="sqrt"`` / ``"linear"`` (or a
    [`evenflow.TokenLRRule`][evenflow.TokenLRRule]) scales every optimizer step's LR by its window's global supervised
    tokens (evenflow.lr; the scaler is ``trainer.lr_scaler``). See NOTE [ HF Trainer contract ] for units, loss, epochs
    and resume.

    A model with a vision or audio tower gets ``ddp_find_unused_parameters=True`` unless the arguments set it: a
    text-only or IDLE batch leaves the tower out of the graph.

    The per-step `StepMetrics` are added to every training log
    (``evenflow/imbalance``, ``evenflow/local_padded_efficiency``, ``evenflow/idle_steps``...).
    """

    # compute_loss returns the loss already normalized over the whole accumulation window and all ranks.
    loss_is_scaled_for_ga = True

    def __init__(self, *args: Any, token_budget: int, eval_token_budget: int | None = None,
                 lr_scaling: TokenLRRule | str | None = None, **kwargs: Any) -> None:
        if "loss_is_scaled_for_ga" not in vars(Trainer) or "get_batch_samples" not in vars(Trainer):
            raise ImportError("DynamicBatchTrainer needs a transformers Trainer with `loss_is_scaled_for_ga` and "
                              "`get_batch_samples` (written against 5.24); without them HF would divide the loss by "
                              "the accumulation steps a second time. Upgrade transformers")
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _LOADER_PARAMS}
        if "grad_accum_steps" in options:
            raise TypeError("DynamicBatchTrainer takes the accumulation from TrainingArguments.gradient_accumulation_"
                            "steps; do not pass grad_accum_steps")
        # Only a collator the user passed replaces evenflow's PadCollate: Trainer's fallbacks
        # (default_data_collator, DataCollatorWithPadding) do not pad labels.
        self._user_collator = kwargs.get("data_collator", args[2] if len(args) > 2 else None)
        super().__init__(*args, **kwargs)
        if self.args.auto_find_batch_size:
            raise ValueError("auto_find_batch_size does not apply: token_budget sets the batch size; lower it instead")
        if self.label_smoother is not None:
            raise ValueError("label_smoothing_factor != 0 is not supported by DynamicBatchTrainer (its smoother "
                             "normalizes by the local batch); pass a compute_loss_func that honors num_items_in_batch")
        if not self.args.ignore_data_skip:
            # A copy we own: the loader restores its exact position, HF must not skip batches on top of it.
            self.args = copy.copy(self.args)
            self.args.ignore_data_skip = True
        if self.args.ddp_find_unused_parameters is None and _has_encoder_tower(self.model):
            # A text-only or IDLE batch leaves the vision / audio tower out of the graph, and DDP without
            # find_unused_parameters then fails in its next reduction (TRL sets it for VLMs too).
            self.args = copy.copy(self.args)
            self.args.ddp_find_unused_parameters = True
        self.token_budget = token_budget
        self.eval_token_budget = eval_token_budget
        self.lr_rule = TokenLRRule.coerce(lr_scaling)
        self.lr_scaler: TokenLRScaler | None = None
        self.loader_options = options
        self.evenflow_metrics = StepMetrics()
        self.train_batches: TrainBatches | None = None
        self._resume_dir: str | None = None
        self._resume_lr: dict | None = None
        self._eval_loaders: dict = {}
        _warn_ignored_arguments(self.args)
        self._forward_keys = self._model_input_names()
        forward = self.accelerator.unwrap_model(self.model).forward
        self._takes_use_cache = "use_cache" in inspect.signature(forward).parameters
        self.add_callback(EpochCallback(self))
        if any(isinstance(cb, ProgressCallback) for cb in self.callback_handler.callbacks):
            # HF's bar sizes itself once from the first bound; ours follows the bound as it tightens (after
            # EpochCallback, which refreshes state.max_steps).
            self.remove_callback(ProgressCallback)
            self.add_callback(BoundProgressCallback)

    # -- data --------------------------------------------------------------------------------------------------
    def _loader_kwargs(self) -> dict:
        a = self.args
        defaults = {"num_workers": a.dataloader_num_workers, "pin_memory": a.dataloader_pin_memory,
                    "persistent_workers": a.dataloader_persistent_workers,
                    "prefetch_factor": a.dataloader_prefetch_factor,
                    "multiprocessing_context": a.dataloader_multiprocessing_context,
                    "seed": a.data_seed if a.data_seed is not None else a.seed}
        if self._user_collator is not None:
            defaults["collate_fn"] = self._user_collator
        pad_id = getattr(self.processing_class, "pad_token_id", None)
        if isinstance(pad_id, int):
            defaults["pad_token_id"] = pad_id
        config = getattr(self.model, "config", None)
        if getattr(config, "is_encoder_decoder", False):
            defaults["loss_tokens"] = LossTokenRule(shift=False)  # seq2seq labels are not shifted inside the model
        return {**defaults, **self.loader_options}

    def get_train_dataloader(self) -> TrainBatches:
        """Build the evenflow training loader (collective: every rank) and restore its state when resuming."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        self.close_train_loader()
        epoch_mode = self.args.max_steps <= 0
        if epoch_mode and not hasattr(self.train_dataset, "__len__"):
            raise ValueError("an IterableDataset has no epoch length: set TrainingArguments.max_steps "
                             "(optimizer steps)")
        max_epochs = None
        if epoch_mode:
            epochs = self.args.num_train_epochs
            if epochs != int(epochs):
                raise ValueError(f"num_train_epochs={epochs}: evenflow epochs are whole passes (each sample once); "
                                 "use an integer, or max_steps for a partial epoch")
            max_epochs = int(epochs)
        options = self._loader_kwargs()
        if epoch_mode and "lengths" not in options:
            lengths = _auto_lengths(self.train_dataset, options, self.args.world_size)
            if lengths is not None:
                options["lengths"] = lengths  # NOTE [ The planned epoch length ]: len() and the horizon exact
        loader = DynamicBatchLoader(self.train_dataset, token_budget=self.token_budget,
                                    grad_accum_steps=self.args.gradient_accumulation_steps, **options)
        batches = TrainBatches(loader, accum=self.args.gradient_accumulation_steps, sized=epoch_mode,
                                max_epochs=max_epochs)
        schedule = getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type)
        if epoch_mode and schedule not in _HORIZON_FREE and batches.planned_total() is None:
            warnings.warn(f"lr_scheduler_type={schedule!r} with num_train_epochs: HF sets the schedule's horizon "
                          "from len(train_dataloader), which for evenflow is an upper bound on the optimizer "
                          "steps, so the schedule will not reach its end. Pass lengths= (each sample's length, e.g. "
                          "a dataset column; NOTE [ The planned epoch length ]) for the exact count, or set max_steps.",
                          stacklevel=2)
        self._resume_lr = None
        if self._resume_dir is not None:
            try:
                files = read_loader_files(self._resume_dir, loader.rank, loader.world_size)
                batches.load(files)
            except BaseException:
                loader.close()
                raise
            self._resume_lr = (files[0] if isinstance(files, list) else files).get("lr_scaler")  # same on every rank
        self.train_batches = batches
        join = loader.config.alignment.join
        self.evenflow_metrics = StepMetrics(epoch_samples=len(self.train_dataset) if epoch_mode and join else None)
        if batches.resumed_done:
            self.evenflow_metrics.resumed(batches.epoch, batches.resumed_done)
        return batches

    def close_train_loader(self) -> None:
        """Stop the training loader's epoch on every rank and release its workers (also done at train end)."""
        if self.train_batches is not None:
            self.train_batches.close()
            self.train_batches = None

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Fetch one accumulation window; end HF's epoch when the loader is exhausted."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batches:
            self.control.should_epoch_stop = True
            return batches, None
        infos = [b[STEP_INFO_KEY] for b in batches if isinstance(b, Mapping) and STEP_INFO_KEY in b]
        if len(infos) != len(batches):
            return batches, None  # not evenflow batches (a user override of get_train_dataloader)
        if not infos[-1].window_end:
            raise RuntimeError("evenflow: HF's accumulation chunk does not end on an evenflow window boundary; "
                               "gradient_accumulation_steps must not change after the trainer was built")
        if self.lr_scaler is not None:
            self.lr_scaler.observe(infos[0].window_loss_tokens)  # the coming optimizer step's LR factor
        return batches, infos[0].window_loss_tokens

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """``Trainer.create_scheduler`` over the run's exact optimizer steps when the epochs are planned.

        HF passes ``epochs x ceil(len(train_dataloader) / accumulation)``; evenflow epochs differ in length, so with
        ``lengths=`` (or an HF dataset's own ``input_ids`` lengths) the horizon is the sum of every planned epoch's
        windows instead (NOTE [ The planned epoch length ]).
        """
        batches = self.train_batches
        total = batches.planned_total() if batches is not None and self.args.max_steps <= 0 else None
        return super().create_scheduler(num_training_steps=total or num_training_steps, optimizer=optimizer)

    def create_optimizer(self, model=None):
        """``Trainer.create_optimizer``; with ``lr_scaling`` also attaches the token LR rule (evenflow.lr) to it.

        The rule scales each optimizer step's LR by the window's global supervised tokens relative to
        ``reference_tokens`` (default ``token_budget x world_size x gradient_accumulation_steps``); HF's scheduler
        keeps stepping the unscaled LR.
        """
        optimizer = super().create_optimizer(model)
        if self.lr_rule is not None and (self.lr_scaler is None or self.lr_scaler.optimizer is not optimizer):
            if self.lr_scaler is not None:
                self.lr_scaler.remove()
            reference = self.lr_rule.resolve(token_budget=self.token_budget, world_size=self.args.world_size,
                                             grad_accum_steps=self.args.gradient_accumulation_steps)
            self.lr_scaler = TokenLRScaler(optimizer, scaling=self.lr_rule.scaling, reference_tokens=reference)
            if self._resume_lr is not None:  # the reference the run was saved with (maybe on another world size)
                self.lr_scaler.load_state_dict(self._resume_lr)
        return optimizer

    # -- loss --------------------------------------------------------------------------------------------------
    def _model_input_names(self) -> frozenset | None:
        if not self.args.remove_unused_columns:
            return None
        model = self.accelerator.unwrap_model(self.model)
        params = inspect.signature(model.forward).parameters.values()
        named = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        return frozenset(named | set(self.label_names) | {"label", "label_ids"} | _PACKING_KEYS)

    def _model_inputs(self, inputs: Mapping) -> dict:
        keys = self._forward_keys
        out = dict(inputs) if keys is None else {k: v for k, v in inputs.items() if k in keys}
        if self._takes_use_cache and "position_ids" in out and "attention_mask" not in out and "use_cache" not in out:
            # A packed row from a user collator: without this HF builds a KV cache, skips its packed-sequence
            # detection and lets the sequences attend to each other (NOTE [ Packing and the KV cache ]).
            out["use_cache"] = False
        return out

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """This rank's share of the exact global per-token loss (NOTE [ HF Trainer contract ])."""
        if STEP_INFO_KEY not in inputs:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        info: StepInfo = inputs[STEP_INFO_KEY]
        info.mark_scaled()  # the loss below is scaled by it (NOTE [ Misuse is loud ])
        inputs = self._model_inputs({k: v for k, v in inputs.items() if k != STEP_INFO_KEY})
        if model.training:
            self.evenflow_metrics.update(info)
        live = not info.is_idle and info.local_loss_tokens > 0 and info.window_loss_tokens > 0
        if self.compute_loss_func is not None:
            labels = inputs.pop("labels", None)
            outputs = model(**inputs)
            # HF contract: compute_loss_func returns sum / num_items_in_batch.
            items = info.window_loss_tokens / info.world_size if info.window_loss_tokens else 1.0
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=items)
            loss = loss if live else loss * 0.0
        else:
            outputs = model(**inputs)
            mean = outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]
            if live:
                loss = mean * info.loss_scale
            elif info.local_loss_tokens > 0 or info.is_idle:
                loss = mean * 0.0  # IDLE batches carry real labels: the mean is finite
            else:
                # No supervised token here: the model's mean is 0/0 = NaN. A zero built from the logits keeps every
                # parameter in the graph (DDP expects its gradient) without touching the NaN.
                logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[1]
                loss = logits.sum() * 0.0
        return (loss, outputs) if return_outputs else loss

    # -- logging, training entry, evaluation ------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the evenflow step metrics of the logging interval to training logs; honest end-of-train speeds.

        HF's ``train_samples_per_second`` assumes ``per_device_train_batch_size`` samples per micro-batch; here
        it is the samples actually trained (all ranks, from the StepInfo) / ``train_runtime``, and
        ``train_tokens_per_second`` / ``train_loss_tokens_per_second`` are added the same way.
        """
        if "loss" in logs:
            logs = {**logs, **self.evenflow_metrics.summary()}
        batches = self.train_batches
        runtime = logs.get("train_runtime")
        if runtime and batches is not None:
            done = batches.trained
            logs = {**logs, "train_samples_per_second": round(done["samples"] / runtime, 3),
                    "train_tokens_per_second": round(done["real_tokens"] / runtime, 3),
                    "train_loss_tokens_per_second": round(done["loss_tokens"] / runtime, 3),
                    "train_samples": done["samples"]}
        super().log(logs, start_time)

    def store_flos(self) -> None:
        """``Trainer.store_flos``, its sum over ranks on CPU (gloo) with the tensors released before it returns: it
        is the last collective of ``train()``, so it often races the interpreter's exit (NOTE [ Exit-time
        teardown ] in evenflow.runtime.teardown). Other devices: HF's own."""
        if self.args.world_size <= 1 or self.args.device.type != "cpu":
            return super().store_flos()
        self.state.total_flos += sum_over(float(self.current_flos), None)
        self.current_flos = 0

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None,
              **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint`` also restores each rank's loader position."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        self._resume_dir = resume_from_checkpoint or None
        try:
            return super().train(resume_from_checkpoint=self._resume_dir, trial=trial,
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            self._resume_dir = None
            self.close_train_loader()

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """With ``eval_token_budget``: evenflow eval batches and the exact per-token loss; else ``Trainer.evaluate``.

        The evenflow path reports ``{prefix}_loss`` (sum of token losses / supervised tokens over the whole set,
        identical on every rank), ``{prefix}_samples``, ``{prefix}_loss_tokens`` and ``{prefix}_runtime``; it runs
        no ``compute_metrics`` (that needs HF's prediction loop: leave ``eval_token_budget`` unset for it).
        """
        if self.eval_token_budget is None:
            return super().evaluate(eval_dataset=eval_dataset, ignore_keys=ignore_keys,
                                    metric_key_prefix=metric_key_prefix)
        return self._evenflow_evaluate(eval_dataset, metric_key_prefix, self.eval_token_budget, {},
                                       lambda m, b: _mean_loss(m(**self._model_inputs(b))))

    def _evenflow_evaluate(self, eval_dataset, metric_key_prefix: str, token_budget: int, overrides: dict,
                           forward) -> dict[str, float]:
        """``evaluate()``'s evenflow path: ``forward(model, batch)`` (the batch's mean loss) over an
        ``eval_loader`` of the loader's options with ``overrides``, built once per dataset."""
        key = eval_dataset if isinstance(eval_dataset, str) else "eval" if eval_dataset is None else id(eval_dataset)
        if isinstance(eval_dataset, str):
            dataset = self.eval_dataset[eval_dataset]
        else:
            dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if key not in self._eval_loaders:  # built once per dataset (construction is collective)
            options = {k: v for k, v in self._loader_kwargs().items() if k not in ("seed", "persistent_workers")}
            self._eval_loaders[key] = eval_loader(self._eval_samples(dataset), token_budget=token_budget,
                                                  **{**options, **overrides})
        start = time.time()
        result = evaluate_loss(self.model, self._eval_loaders[key], device=self.args.device, forward=forward)
        p = metric_key_prefix
        metrics = {f"{p}_loss": result["loss"], f"{p}_samples": result["samples"],
                   f"{p}_loss_tokens": result["loss_tokens"], f"{p}_runtime": round(time.time() - start, 4)}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _eval_samples(self, dataset):
        """The samples an eval loader batches (the TRL vision path processes each one first)."""
        return dataset


# TrainingArguments that size or shape fixed batches; evenflow's token budget replaces them.
_IGNORED_ARGS = {"per_device_train_batch_size": "token_budget sizes each batch",
                 "dataloader_drop_last": "evenflow trains every sample exactly once, it never drops",
                 "group_by_length": "evenflow groups by realized length already"}


def _warn_ignored_arguments(args) -> None:
    """One warning, pointing at the user's call, for fixed-batch arguments set away from HF's default."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    changed = [f"{name}={getattr(args, name)!r} ({why})" for name, why in _IGNORED_ARGS.items()
               if hasattr(args, name) and getattr(args, name) != defaults.get(name)]
    if changed:
        warnings.warn("DynamicBatchTrainer ignores " + "; ".join(changed) + ". Batches are formed by evenflow under "
                      "token_budget", UserWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """Stack level of the first frame outside evenflow, transformers and trl (the user's constructor call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.split(".")[0] in ("evenflow", "transformers", "trl"):
            return level
        frame, level = frame.f_back, level + 1
    return 2


# Above this many samples an HF dataset's epochs are not planned automatically (the simulation costs ~2-30 us per
# sample and epoch at train start); pass lengths= to plan them anyway.
_AUTO_PLAN_LIMIT = 1_000_000


def _auto_lengths(dataset, options: dict, world_size: int):
    """An HF ``datasets.Dataset``'s ``input_ids`` lengths (Arrow offsets, no token read) when the loader can plan
    its epochs from them (NOTE [ The planned epoch length ]), else None: ``len()`` stays the bound."""
    from ..runtime.epoch_plan import dataset_lengths, is_hf_dataset, plan_coverage
    from ..runtime.planning import default_planning_group, resolve_planning

    if (not is_hf_dataset(dataset) or "input_ids" not in dataset.column_names or options.get("length_fn")
            or options.get("extra_budgets") or len(dataset) > _AUTO_PLAN_LIMIT):
        return None
    group = options.get("planning_group")
    planning = resolve_planning(options.get("planning", "auto"), world_size, balance=options.get("balance", False),
                                planning_group=group)
    if plan_coverage(join=options.get("join", True), oversize=options.get("oversize", "error"), world_size=world_size,
                     planning=planning, group_size=group or default_planning_group(world_size), iterable=False):
        return None
    return dataset_lengths(dataset)


def _mean_loss(outputs) -> torch.Tensor:
    return outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]
