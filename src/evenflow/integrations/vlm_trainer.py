"""A stock Hugging Face VLM balanced per phase inside ``transformers.Trainer``: ``BalancedVLMTrainer``.

    trainer = BalancedVLMTrainer(model=model, args=TrainingArguments(...), train_dataset=samples,
                                 token_budget=4096, max_encoder_rows=4096, vlm_config=VLMConfig(layout="packed"))
    trainer.train()

``compute_loss`` runs [`BalancedVLM`][evenflow.vlm.BalancedVLM] on the Trainer's wrapped model; everything
else is [`DynamicBatchTrainer`][evenflow.integrations.hf.DynamicBatchTrainer] (units, resume, epochs: NOTE [ HF
Trainer contract ]).
The balancing half is [`VLMBalancing`][VLMBalancing], shared with the TRL path (``evenflow.integrations.trl``).

NOTE [ A balanced VLM inside a trainer ]
    One budget. The loader's ``max_encoder_rows`` and ``VLMConfig.max_encoder_rows`` are one number: the one given
    (to either) is used for both; two different ones are refused at construction. The layout picks the loader's
    cost: ``"packed"`` budgets summed tokens, ``"padded"`` padded ones.

    The step is built at the first ``compute_loss``, on the model the Trainer wrapped (DDP / FSDP2), so
    ``gradient_sync="detect"`` sees the wrapper; its gloo group is made in ``train()``, on every rank. The
    returned loss is ``BalancedVLM``'s ``loss_sum x W / window tokens`` (``loss_is_scaled_for_ga``), so HF's
    logged ``loss`` -- the mean over ranks and optimizer steps of what ``compute_loss`` returned -- is the exact
    global per-token mean of each window, averaged over the logging interval's windows.

    Costs. ``warmup=WarmupConfig(...)`` fits the per-phase costs once at the start of ``train()`` (collective);
    every checkpoint holds them (``evenflow_vlm.json``, the step's ``state_dict``) and a resumed ``train()``
    plans with the saved ones, bit for bit: nothing is refitted, so the resumed plans are the ones the run would
    have made.

    Logs. Every training log adds the loader's ``evenflow/*`` metrics (``StepMetrics``) and, per phase, the mean
    over the interval's steps of the plan's max / mean load: ``evenflow/imbalance_<phase>`` (after the plan) and
    ``evenflow/imbalance_<phase>_before`` (where the items were).

NOTE [ Evaluating a balanced VLM ]
    ``evaluate()`` (and the Trainer's ``eval_strategy``) runs the unwrapped model's stock forward with
    ``labels=`` on each rank's own padded batches of an evenflow eval loader (``eval_token_budget`` tokens, the
    training ``token_budget`` when unset; the same ``max_encoder_rows``): every eval sample once, IDLE batches run
    so sharded models stay in step, each rank's mean weighted by its supervised tokens and summed over ranks, so
    ``eval_loss`` is the exact per-token mean over the set. Nothing is balanced: no gradients wait on the slowest
    rank, and a padded batch is what the stock forward takes as it is (a packed VLM row needs M-RoPE positions
    the balanced step builds). HF's prediction loop (``predict()``, ``compute_metrics``) is not supported.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..step_info import STEP_INFO_KEY, StepInfo
from ..vlm import BalancedVLM, VLMConfig, VLMStep, WarmupConfig, cost_from_state, fit_phase_costs, unwrap_model
from .hf import DynamicBatchTrainer

__all__ = ["BalancedVLMTrainer", "VLM_STATE_FILE"]

VLM_STATE_FILE = "evenflow_vlm.json"
"""The balanced step's state in a checkpoint folder (its fitted costs and plan key; the same on every rank)."""


def vlm_loader_options(config: VLMConfig, options: dict) -> VLMConfig:
    """Reconcile the loader's options and ``config`` (NOTE [ A balanced VLM inside a trainer ]): one encoder
    budget for both, the loader's cost from the layout. Edits ``options``; returns the step's config."""
    rows, own = options.get("max_encoder_rows"), config.max_encoder_rows
    if rows is not None and own is not None and rows != own:
        raise ValueError(f"max_encoder_rows={rows} (the loader's) and VLMConfig(max_encoder_rows={own}) are one "
                         "budget: give it once, as max_encoder_rows=")
    rows = rows if rows is not None else own
    if rows is not None:
        options["max_encoder_rows"] = rows
        config = dataclasses.replace(config, max_encoder_rows=rows)
    cost = "summed" if config.layout == "packed" else "padded"
    if options.setdefault("cost", cost) != cost:
        raise ValueError(f"VLMConfig(layout={config.layout!r}) trains {cost} batches, but cost="
                         f"{options['cost']!r} was passed: drop cost= (it follows the layout)")
    return config


def _load_hub_named_weights(model, folder: str) -> None:
    """Load a checkpoint's weights saved under other names than the module's (NOTE [ A balanced VLM inside a
    trainer ]): transformers saves a Qwen-VL model under the Hub's key names (``visual.*``, ``model.layers.*``),
    and ``Trainer``'s resume loads the file by the module's own names (``model.visual.*``, ...) -- nothing
    matches, and the run would go on from its initial weights after a warning. ``from_pretrained`` renames them;
    the Trainer's own load then finds nothing to change."""
    from safetensors import safe_open

    base = unwrap_model(model)
    files = [name for name in os.listdir(folder) if name.endswith(".safetensors")]
    if not files:
        return  # not a safetensors checkpoint: the Trainer's own load
    saved: set[str] = set()
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            saved.update(f.keys())
    if saved <= set(base.state_dict()):
        return  # the module's own names: the Trainer's load is right
    first = next(base.parameters())
    loaded = type(base).from_pretrained(folder, dtype=first.dtype)
    base.load_state_dict(loaded.state_dict())


class _SaveVLMState(TrainerCallback):
    """Writes the balanced step's state next to each checkpoint (rank 0; it is the same on every rank)."""

    def __init__(self, balancing: VLMBalancing) -> None:
        self.balancing = balancing

    def on_save(self, args, state, control, **kwargs):
        vlm = self.balancing.vlm
        if vlm is None or not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, VLM_STATE_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(vlm.state_dict(), f)
        os.replace(path + ".tmp", path)


class VLMBalancing:
    """The balancing half of a trainer: mixed in before ``DynamicBatchTrainer`` (or its TRL subclass).

    Keyword arguments: ``vlm_config`` ([`VLMConfig`][evenflow.vlm.VLMConfig]) and ``warmup``
    ([`WarmupConfig`][evenflow.vlm.WarmupConfig] or ``None``: the config's costs). See NOTE [ A balanced VLM
    inside a trainer ].
    """

    vlm: BalancedVLM | None = None

    def _init_balancing(self, vlm_config: VLMConfig, warmup: WarmupConfig | None) -> None:
        if not isinstance(vlm_config, VLMConfig):
            raise TypeError(f"vlm_config must be an evenflow.vlm.VLMConfig, got {type(vlm_config).__name__}")
        if warmup is not None and vlm_config.time_cost is not None:
            raise ValueError("warmup= fits the per-phase costs that VLMConfig(time_cost=...) already gives: pass one")
        self.vlm_config = vlm_loader_options(vlm_config, self.loader_options)
        self.warmup = warmup
        self.vlm = None
        self._vlm_group = None
        self._phase_sums: dict[str, list[float]] = {}
        self._phase_steps = 0
        self.add_callback(_SaveVLMState(self))

    def _vlm_setup(self, resume_dir: str | None) -> None:
        """Every rank, before training: the step's group, and its costs (saved ones on resume, else a warm-up)."""
        if not dist.is_initialized():
            raise RuntimeError("a balanced VLM trains under torch.distributed: launch with torchrun (a world of "
                               "one works: init_process_group('gloo', world_size=1, ...))")
        if self._vlm_group is None:
            self._vlm_group = dist.new_group(backend="gloo")  # balancing traffic off the gradient group
        config = self.vlm_config
        saved = os.path.join(resume_dir, VLM_STATE_FILE) if resume_dir else None
        if saved is not None and os.path.exists(saved):
            with open(saved) as f:
                state = json.load(f)
            if state["time_cost"] is not None:
                config = dataclasses.replace(config, time_cost=cost_from_state(state["time_cost"]))
            self._vlm_state = state
        else:
            self._vlm_state = None
            if self.warmup is not None and config.time_cost is None:
                cost = fit_phase_costs(self.model, group=self._vlm_group, config=self.warmup)
                config = dataclasses.replace(config, time_cost=cost)
        self.vlm_config = config
        self.vlm = None  # built on the wrapped model at the first step

    def balanced_step(self, model, inputs: dict, info: StepInfo) -> VLMStep:
        """One balanced step of the batch ``inputs`` (its StepInfo ``info`` taken out) through ``model``, the
        Trainer's wrapped model (collective). Override it to read each step (call ``super()`` and use the
        returned [`VLMStep`][evenflow.vlm.VLMStep]: its plan, ``imbalance()``, ``window_loss``)."""
        if self.vlm is None:
            self.vlm = BalancedVLM(model, group=self._vlm_group, config=self.vlm_config)
            if self._vlm_state is not None:
                self.vlm.load_state_dict(self._vlm_state)  # the saved plan key: refused if it would plan otherwise
        if model.training:
            self.evenflow_metrics.update(info)
        step = self.vlm(inputs, info, model=model)
        if model.training:
            for phase, b in step.imbalance().items():
                sums = self._phase_sums.setdefault(phase, [0.0, 0.0])
                sums[0] += b.after
                sums[1] += b.before
            self._phase_steps += 1
        return step

    def _vlm_begin(self, resume_from_checkpoint: str | bool | None) -> None:
        folder = resume_from_checkpoint
        if folder is True:
            folder = get_last_checkpoint(self.args.output_dir)
        if folder:
            _load_hub_named_weights(self.model, folder)
        self._vlm_setup(folder or None)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The stock model's exact per-token loss over the eval set (NOTE [ Evaluating a balanced VLM ]), identical
        on every rank: ``{prefix}_loss``, ``_samples``, ``_loss_tokens``, ``_runtime``. Collective."""
        if self.vlm_config is None:  # the TRL trainer on text data
            return super().evaluate(eval_dataset=eval_dataset, ignore_keys=ignore_keys,
                                    metric_key_prefix=metric_key_prefix)
        budget = self.eval_token_budget if self.eval_token_budget is not None else self.token_budget
        names = inspect.signature(unwrap_model(self.model).forward).parameters  # the keys the stock forward takes

        def stock_mean_loss(model, batch) -> torch.Tensor:  # its own mean loss (labels=) on a padded batch
            return model(**{k: v for k, v in batch.items() if k in names}, use_cache=False).loss

        return self._evenflow_evaluate(eval_dataset, metric_key_prefix, budget, {"cost": "padded", "collate_fn": None},
                                       stock_mean_loss)

    def _vlm_loss(self, model, inputs, return_outputs: bool):
        if STEP_INFO_KEY not in inputs:
            raise ValueError(f"{type(self).__name__} trains evenflow batches only (each holds its StepInfo): "
                             "evaluate() gives the eval loss; predict() and HF's prediction loop are not supported")
        info: StepInfo = inputs[STEP_INFO_KEY]
        step = self.balanced_step(model, {k: v for k, v in inputs.items() if k != STEP_INFO_KEY}, info)
        return (step.loss, None) if return_outputs else step.loss

    def _vlm_logs(self, logs: dict[str, float]) -> dict[str, float]:
        return {**logs, **self._phase_metrics()} if "loss" in logs else logs

    def _phase_metrics(self) -> dict[str, float]:
        steps, self._phase_steps = self._phase_steps, 0
        sums, self._phase_sums = self._phase_sums, {}
        out = {}
        for phase, (after, before) in sums.items():
            out[f"evenflow/imbalance_{phase}"] = after / steps
            out[f"evenflow/imbalance_{phase}_before"] = before / steps
        return out


class BalancedVLMTrainer(VLMBalancing, DynamicBatchTrainer):
    """A [`DynamicBatchTrainer`][evenflow.integrations.hf.DynamicBatchTrainer] that balances a stock VLM's
    phases every step.

    Takes every ``DynamicBatchTrainer`` argument plus ``vlm_config`` ([`VLMConfig`][evenflow.vlm.VLMConfig];
    its ``max_encoder_rows`` or the loader's, one budget) and ``warmup``
    ([`WarmupConfig`][evenflow.vlm.WarmupConfig]: fit the per-phase costs at the start of training, restored --
    not refitted -- on resume). The dataset yields the processor's per-sample output (the sample contract in
    docs/vlm.md). Logs the exact global loss and every ``evenflow/*`` metric, per-phase imbalance included
    (NOTE [ A balanced VLM inside a trainer ]).
    """

    def __init__(self, *args: Any, vlm_config: VLMConfig = VLMConfig(), warmup: WarmupConfig | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_balancing(vlm_config, warmup)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None,
              **kwargs):
        self._vlm_begin(resume_from_checkpoint)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """This rank's share of the exact global per-token loss, every phase balanced (collective)."""
        return self._vlm_loss(model, inputs, return_outputs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(self._vlm_logs(logs), start_time)
