"""TRL's ``SFTTrainer`` with evenflow batches: :class:`DynamicBatchSFTTrainer` (extra ``trl``).

    trainer = DynamicBatchSFTTrainer(model=model, args=SFTConfig(..., assistant_only_loss=True),
                                     train_dataset=chats, processing_class=tokenizer, token_budget=16384)
    trainer.train()

Written against TRL 1.16. What SFTTrainer does is kept: its dataset preparation (chat template, tokenization,
truncation to ``max_length``, the ``labels`` column it builds from ``assistant_masks`` / ``completion_mask``), its
collator (``DataCollatorForLanguageModeling``, padding-free when ``padding_free=True``) as the loader's
``collate_fn``, its loss (``compute_loss``, fused LM head) and its logged metrics (``mean_token_accuracy``,
``entropy``, ``num_tokens``). What evenflow changes:

- Batches come from :class:`evenflow.DynamicBatchLoader` over the *prepared* dataset, so the loader counts
  supervised tokens from the very ``labels`` TRL's preparation produced (the collator only pads them with -100).
- The loss: TRL divides its summed token loss by ``num_items_in_batch`` (and multiplies by the number of processes
  under ``average_tokens_across_devices``); this class passes the evenflow window's global supervised tokens, which
  makes TRL's loss exactly ``mean * StepInfo.loss_scale`` (NOTE [ Loss scale ] in evenflow.planning.loss).
- IDLE batches (and the IDLE micro-batches that complete an epoch's last window) run the forward with every label
  ignored, so their loss is exactly 0 and they add nothing to ``mean_token_accuracy`` / ``entropy``;
  ``num_tokens`` counts the real tokens of every rank from the StepInfo (TRL's own count would add IDLE tokens).
- ``padding_free=True`` selects ``cost="summed"`` (the budget then counts tokens, not padded rows).

Masks (tests/test_trl.py checks every collated row position by position against them): TRL folds
``assistant_masks`` (``assistant_only_loss=True``) and ``completion_mask`` (prompt/completion data, with
``completion_only_loss``) into ``labels`` -- a token is supervised only where every applicable mask is 1 -- and the
loader counts exactly those labels (shifted, as the loss sums them). ``assistant_only_loss`` needs a chat template
with ``{% generation %}`` markers; TRL swaps in its training template only when the tokenizer's template is
identical to one of its own copies, else raises. A template from elsewhere (e.g. the Qwen3 one in
``evenflow.data.chat``) can be replaced with TRL's copy, e.g.
``tokenizer.chat_template = trl.chat_template_utils.qwen3_training_chat_template``.

Everything in NOTE [ HF Trainer contract ] (evenflow.integrations.hf) holds: units, resume, epochs. Base-class
order is fixed here (``DynamicBatchTrainer`` first): use this class rather than mixing the two by hand.
"""

from __future__ import annotations

from typing import Any

try:
    from trl import SFTTrainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("evenflow.integrations.trl needs trl: pip install 'evenflow[trl]'") from exc

from ..planning.loss import IGNORE_INDEX
from ..runtime.step_info import STEP_INFO_KEY, StepInfo
from .hf import DynamicBatchTrainer

__all__ = ["DynamicBatchSFTTrainer"]


class DynamicBatchSFTTrainer(DynamicBatchTrainer, SFTTrainer):
    """``trl.SFTTrainer`` whose training batches come from :class:`evenflow.DynamicBatchLoader`.

    Takes every ``SFTTrainer`` argument plus ``token_budget`` and the other ``DynamicBatchLoader`` options (see
    :class:`~evenflow.integrations.hf.DynamicBatchTrainer`). TRL's collator (or the ``data_collator`` passed) is
    the loader's ``collate_fn``. ``SFTConfig(packing=True)`` is refused: evenflow's budgeted batches replace TRL's
    offline packing (use ``padding_free=True`` for packed rows without cross-sequence attention).
    """

    def __init__(self, *args: Any, token_budget: int, **kwargs: Any) -> None:
        config = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(config, "packing", False):
            raise ValueError("SFTConfig(packing=True) packs samples offline into fixed-length rows, which takes away "
                             "what evenflow batches; set packing=False (and padding_free=True for varlen rows)")
        if getattr(config, "padding_free", False):
            kwargs.setdefault("cost", "summed")
        super().__init__(*args, token_budget=token_budget, **kwargs)
        # TRL built its collator in __init__ (or kept the user's): it is the loader's collate_fn.
        self._user_collator = self.data_collator

    def _model_input_names(self):
        # TRL's compute_loss filters nothing and adds its own kwargs (fused_lm_head, use_cache); its prepared
        # columns are model inputs already.
        return None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss and metrics, normalized by the evenflow window (see the module docstring)."""
        if STEP_INFO_KEY not in inputs:
            return SFTTrainer.compute_loss(self, model, inputs, return_outputs=return_outputs,
                                           num_items_in_batch=num_items_in_batch)
        info: StepInfo = inputs[STEP_INFO_KEY]
        info.mark_scaled()
        inputs = self._model_inputs({k: v for k, v in inputs.items() if k != STEP_INFO_KEY})
        training = model.training
        if training:
            self.evenflow_metrics.update(info)
        live = not info.is_idle and info.local_loss_tokens > 0 and info.window_loss_tokens > 0
        if not live and "labels" in inputs:
            # All labels ignored: TRL's loss is an exact, graph-connected 0 and the batch adds no metric counts.
            inputs["labels"] = inputs["labels"].new_full(inputs["labels"].shape, IGNORE_INDEX)
        # TRL: loss = sum / items (x processes when averaging across devices) == sum * W / window tokens.
        processes = self.accelerator.num_processes if self.args.average_tokens_across_devices else 1
        items = info.window_loss_tokens * processes / info.world_size if live else 1.0
        tokens_before = self._total_train_tokens
        result = SFTTrainer.compute_loss(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=items)
        if training:
            # Real tokens of every rank this step (identical on all ranks; IDLE placeholders excluded).
            self._total_train_tokens = tokens_before + info.global_real_tokens
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        if live:
            return result
        loss, *rest = result if return_outputs else (result,)
        loss = loss * 0.0
        return (loss, *rest) if return_outputs else loss
