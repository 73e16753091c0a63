"""TRL's ``SFTTrainer`` with evenflow batches: [`DynamicBatchSFTTrainer`][DynamicBatchSFTTrainer] (extra ``trl``).

    trainer = DynamicBatchSFTTrainer(model=model, args=SFTConfig(..., assistant_only_loss=True),
                                     train_dataset=chats, processing_class=tokenizer, token_budget=16384)
    trainer.train()

Written against TRL 1.16. What SFTTrainer does is kept: its dataset preparation (chat template, tokenization,
truncation to ``max_length``, the ``labels`` column it builds from ``assistant_masks`` / ``completion_mask``), its
collator (``DataCollatorForLanguageModeling``, padding-free when packing) as the loader's ``collate_fn``, its loss
(``compute_loss``, fused LM head) and its logged metrics (``mean_token_accuracy``, ``entropy``, ``num_tokens``).
What evenflow changes:

- Batches come from [`DynamicBatchLoader`][evenflow.DynamicBatchLoader] over the *prepared* dataset, so the
  loader counts supervised tokens from the very ``labels`` TRL's preparation produced (the collator only pads
  them with -100).
- The loss: TRL divides its summed token loss by ``num_items_in_batch`` (and multiplies by the number of processes
  under ``average_tokens_across_devices``); this class passes the evenflow window's global supervised tokens, which
  makes TRL's loss exactly ``mean * StepInfo.loss_scale`` (NOTE [ Loss scale ] in evenflow.planning.loss).
- IDLE batches (and the IDLE micro-batches that complete an epoch's last window) run the forward with every label
  ignored, so their loss is exactly 0 (NOTE [ TRL metrics over real tokens ] for what they add to the metrics).

NOTE [ Packing with TRL ]
    evenflow packs: each micro-batch is one padding-free row of at most ``token_budget`` tokens (TRL's own
    padding-free collator: ``position_ids`` restart per sequence, ``cu_seq_lens``, no cross-sequence attention),
    formed online from the buffer -- what TRL's offline ``packing_strategy="bfd"`` makes, without cutting or
    re-ordering anything offline. Any of the ways a TRL user asks for it selects it, each with ``cost="summed"``
    (the budget counts the row's tokens, rounded up to ``pad_to_multiple_of`` as the collator pads it):

    - ``SFTConfig(packing=True)`` (``packing_strategy="bfd"``, TRL's default): no offline packing;
      ``max_length`` truncates each sample, as TRL's preparation does without packing. ``"bfd_split"`` (cuts a
      long sample into pieces) and ``"wrapped"`` (cuts across samples) are refused: evenflow keeps samples whole.
    - ``SFTConfig(padding_free=True)``: ``max_length`` keeps truncating each sample (TRL alone refuses
      ``padding_free`` with ``max_length`` unless it packs offline; here the budget bounds the row).
    - ``cost="summed"``: TRL's collator is built padding-free. A ``data_collator`` passed with ``cost="summed"``
      must return one row; it is tried on two prepared samples at construction and refused if it pads rows
      (a padded ``[3, 532]`` batch would hold 1,596 tokens under a 1,024-token budget).

    ``trainer.args`` is then a copy with ``packing=False, padding_free=True``. ``cost="padded"`` with any of
    them is refused (packed rows cost their summed tokens).

NOTE [ TRL's vision data, packed ]
    TRL refuses ``packing`` and ``padding_free`` for a vision dataset (a first sample with ``image`` or
    ``images``) in ``SFTTrainer.__init__``, from the SFTConfig: TRL gets a copy without them, and what they ask
    for becomes the balanced step's layout (``packing=True`` or ``padding_free=True``: ``"packed"``, one row
    per micro-batch with ``[4, 1, N]`` position ids and no padding; neither: ``"padded"``). Each sample goes
    through TRL's own ``DataCollatorForVisionLanguageModeling`` alone (chat template, placeholders, pixels,
    TRL's label mask; a sample alone has no padding), the loader batches the processed samples under
    ``token_budget`` and ``max_encoder_rows``, and ``compute_loss`` is [`BalancedVLM`][evenflow.vlm.BalancedVLM]'s
    (NOTE [ A balanced VLM inside a trainer ] in evenflow.integrations.vlm_trainer): the exact global per-token
    loss; TRL's ``entropy`` / ``mean_token_accuracy`` are not computed (the step returns no logits).

    Videos: TRL's format has none, so evenflow reads them as it reads ``images``: a ``videos`` column (each video
    a list of frames, an array or a path) and one ``{"type": "video"}`` placeholder per video in the messages.
    Each placeholder is filled with its video before TRL's collator runs, and the processor's chat template hands
    them to its video processor (``pixel_values_videos``, ``video_grid_thw``). A dataset with videos and no images
    is recognized too (TRL sees an empty ``images`` list).

NOTE [ TRL metrics over real tokens ]
    TRL logs the mean over micro-batches of each micro-batch's ratio (entropy sum / supervised tokens of every
    rank), 0.0 for a micro-batch without supervised tokens. With evenflow's budgeted micro-batches of very
    different sizes, and the IDLE micro-batches that complete an epoch's last window, that mean is not the
    per-token value. Here ``entropy`` and ``mean_token_accuracy`` are token-weighted over the logging interval:
    sum over its micro-batches and ranks of the per-token values / their supervised tokens (the micro-batch's
    ratio times its ``StepInfo.global_loss_tokens``, which is TRL's own count of supervised tokens), so IDLE
    micro-batches add nothing. ``num_tokens`` counts the real tokens of every rank from the StepInfo (TRL's
    count would add IDLE placeholders and padding). Eval metrics are TRL's.

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

import copy
import itertools
from collections.abc import Mapping
from typing import Any

try:
    from trl import SFTTrainer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("evenflow.integrations.trl needs trl: pip install 'evenflow[trl]'") from exc

from ..planning.loss import IGNORE_INDEX
from ..step_info import STEP_INFO_KEY, StepInfo
from ..vlm import VLMConfig, WarmupConfig
from .hf import DynamicBatchTrainer
from .vlm_trainer import VLMBalancing

__all__ = ["DynamicBatchSFTTrainer"]

# TRL's per-micro-batch ratios that evenflow re-weights by supervised tokens (NOTE [ TRL metrics over real tokens ]).
_TOKEN_METRICS = ("entropy", "mean_token_accuracy")


class DynamicBatchSFTTrainer(VLMBalancing, DynamicBatchTrainer, SFTTrainer):
    """``trl.SFTTrainer`` whose training batches come from [`evenflow.DynamicBatchLoader`][evenflow.DynamicBatchLoader].

    Takes every ``SFTTrainer`` argument plus ``token_budget`` and the other ``DynamicBatchLoader`` options (see
    [`DynamicBatchTrainer`][evenflow.integrations.hf.DynamicBatchTrainer]). TRL's collator (or the
    ``data_collator`` passed) is the loader's ``collate_fn``. ``SFTConfig(packing=True)``,
    ``padding_free=True`` or ``cost="summed"``: evenflow packs each micro-batch into one padding-free row of at
    most ``token_budget`` tokens, ``max_length`` still truncating each sample (NOTE [ Packing with TRL ]).

    A vision dataset in TRL's format (``messages`` + ``images``, and ``videos`` where it has them, filled into
    ``{"type": "video"}`` placeholders as TRL fills images) with a processor as ``processing_class``: every
    step is balanced per phase by [`BalancedVLM`][evenflow.vlm.BalancedVLM], packed (``packing=True`` or
    ``padding_free=True``) or padded, each sample processed alone by TRL's own vision collator (NOTE [ TRL's
    vision data, packed ]). ``vlm_config`` / ``warmup``: as
    [`BalancedVLMTrainer`][evenflow.integrations.vlm_trainer.BalancedVLMTrainer].
    """

    def __init__(self, *args: Any, token_budget: int, vlm_config: VLMConfig | None = None,
                 warmup: WarmupConfig | None = None, **kwargs: Any) -> None:
        config = kwargs["args"] if "args" in kwargs else args[1] if len(args) > 1 else None
        collator = kwargs["data_collator"] if "data_collator" in kwargs else args[2] if len(args) > 2 else None
        dataset = kwargs["train_dataset"] if "train_dataset" in kwargs else args[3] if len(args) > 3 else None
        self.vlm_config = None
        if _is_vision_dataset(dataset):
            vlm_config, trl_config = _vision_choice(config, vlm_config, kwargs.get("cost"), collator)
            if "args" in kwargs or len(args) < 2:
                kwargs["args"] = trl_config
            else:
                args = (args[0], trl_config, *args[2:])
            if not _is_vision_dataset(dataset, ("image", "images")):
                # Videos only: TRL recognizes a vision dataset by its images, so it sees an empty list of them.
                if "train_dataset" in kwargs:
                    kwargs["train_dataset"] = _with_images(dataset)
                else:
                    args = (*args[:3], _with_images(dataset), *args[4:])
            super().__init__(*args, token_budget=token_budget, **kwargs)
            # Each sample through TRL's vision collator alone (a row without padding); evenflow's collate batches.
            self.train_dataset = ProcessedSamples(self.train_dataset, self.data_collator)
            self._user_collator = None
            self._init_balancing(vlm_config, warmup)
            self._token_sums, self._metric_tokens = {}, 0  # TRL's token metrics: none without TRL's loss
            return
        if vlm_config is not None or warmup is not None:
            raise ValueError("vlm_config= / warmup= balance a vision dataset (samples with 'images' or 'image', "
                             "TRL's rule); this dataset has none")
        packed, trl_config, truncation = _packing_choice(config, kwargs.get("cost"), collator)
        if packed:
            kwargs["cost"] = "summed"
        if isinstance(getattr(config, "pad_to_multiple_of", None), int):
            # TRL's collator pads rows (or the packed row) to this multiple: the planner must cost that shape.
            kwargs.setdefault("pad_to_multiple_of", config.pad_to_multiple_of)
        if trl_config is not config:
            if "args" in kwargs or len(args) < 2:
                kwargs["args"] = trl_config
            else:
                args = (args[0], trl_config, *args[2:])
        super().__init__(*args, token_budget=token_budget, **kwargs)
        # TRL built its collator in __init__ (or kept the user's): it is the loader's collate_fn.
        self._user_collator = self.data_collator
        if truncation is not None:
            max_length, mode = truncation
            self.args.max_length = max_length  # datasets TRL prepares later (evaluate) are truncated by TRL itself
            self.train_dataset = _truncated(self.train_dataset, max_length, mode, self.args.dataset_num_proc)
            self.eval_dataset = _truncated(self.eval_dataset, max_length, mode, self.args.dataset_num_proc)
        if packed and collator is not None:
            _check_one_row(self.data_collator, self.train_dataset)
        self._token_sums = dict.fromkeys(_TOKEN_METRICS, 0.0)
        self._metric_tokens = 0

    def _eval_samples(self, dataset):
        # A vision eval set: each sample through TRL's vision collator alone, as the training samples.
        return ProcessedSamples(dataset, self.data_collator) if self.vlm_config is not None else dataset

    def _model_input_names(self):
        # TRL's compute_loss filters nothing and adds its own kwargs (fused_lm_head, use_cache); its prepared
        # columns are model inputs already.
        return None

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None,
              **kwargs):
        if self.vlm_config is not None:
            self._vlm_begin(resume_from_checkpoint)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss and metrics, normalized by the evenflow window (see the module docstring); a vision
        dataset's: the balanced step's (NOTE [ TRL's vision data, packed ])."""
        if self.vlm_config is not None:
            return self._vlm_loss(model, inputs, return_outputs)
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
            self._weigh_token_metrics(info.global_loss_tokens)
        if live:
            return result
        loss, *rest = result if return_outputs else (result,)
        loss = loss * 0.0
        return (loss, *rest) if return_outputs else loss

    def _weigh_token_metrics(self, tokens: int) -> None:
        """Take TRL's ratios of this micro-batch back out of its lists and add them weighted by ``tokens``, the
        micro-batch's supervised tokens over all ranks (NOTE [ TRL metrics over real tokens ])."""
        metrics = self._metrics["train"]
        for name in _TOKEN_METRICS:
            values = metrics.get(name)
            if not values:
                continue
            ratio = values.pop()
            if not values:
                del metrics[name]  # TRL's log averages every list it holds: none may be left empty
            self._token_sums[name] += ratio * tokens
        self._metric_tokens += tokens

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, with ``entropy`` / ``mean_token_accuracy`` token-weighted over the interval."""
        if self.vlm_config is not None:
            logs = self._vlm_logs(logs)
        if self.model.training and self._metric_tokens:
            metrics = self._metrics["train"]
            for name, total in self._token_sums.items():
                metrics[name] = [total / self._metric_tokens]
            self._token_sums = dict.fromkeys(_TOKEN_METRICS, 0.0)
            self._metric_tokens = 0
        super().log(logs, start_time)


def _is_vision_dataset(dataset: Any, keys: tuple[str, ...] = ("image", "images", "videos")) -> bool:
    """TRL's own rule (``SFTTrainer.__init__``): the first sample has an ``image`` or ``images`` key; or, for
    evenflow, ``videos``."""
    if dataset is None or isinstance(dataset, Mapping):
        return False
    try:
        sample = next(iter(dataset))
    except (StopIteration, TypeError):
        return False
    return isinstance(sample, Mapping) and any(k in sample for k in keys)


def _with_images(dataset: Any) -> Any:
    """A video dataset as TRL's ``SFTTrainer`` recognizes vision data: an empty ``images`` list in every sample
    (a column added to a ``datasets.Dataset``, nothing re-encoded; a lazy map of an ``IterableDataset``)."""
    if hasattr(dataset, "add_column") and hasattr(dataset, "__len__"):
        return dataset.add_column("images", [[] for _ in range(len(dataset))])
    return dataset.map(lambda _: {"images": []})


def _vision_choice(config: Any, vlm_config: VLMConfig | None, cost: str | None, collator: Any
                   ) -> tuple[VLMConfig, Any]:
    """``(the step's config, the SFTConfig TRL sees)`` for a vision dataset (NOTE [ TRL's vision data, packed ]):
    TRL's refusal of packing / padding-free vision data is raised from the SFTConfig, so TRL gets a copy without
    them, and the layout they ask for is the balanced step's."""
    if config is None:
        raise ValueError("a vision dataset needs args=SFTConfig(...): packing=True (or padding_free=True) trains "
                         "packed rows, neither trains padded ones")
    if collator is not None:
        raise ValueError("a vision dataset is processed per sample by TRL's own vision collator, which evenflow "
                         "runs itself: drop data_collator")
    packing, padding_free = bool(config.packing), bool(config.padding_free)
    if packing and config.packing_strategy != "bfd":
        raise ValueError(f"SFTConfig(packing_strategy={config.packing_strategy!r}) cuts samples (and their images) "
                         "into pieces; evenflow keeps every sample whole: use packing_strategy='bfd'")
    layout = "packed" if packing or padding_free else "padded"
    if vlm_config is None:
        vlm_config = VLMConfig(layout=layout)
    elif vlm_config.layout != layout:
        asked = ("packing=True" if packing else "padding_free=True" if padding_free
                 else "neither packing nor padding_free")
        raise ValueError(f"SFTConfig({asked}) trains {layout} rows, but VLMConfig(layout={vlm_config.layout!r}) was "
                         f"passed: set VLMConfig(layout={layout!r}) or change the SFTConfig")
    if cost is not None and cost != ("summed" if layout == "packed" else "padded"):
        raise ValueError(f"cost={cost!r} with {layout} rows: drop cost= (it follows the layout)")
    if config.max_length is not None and config.truncation_mode != "keep_start":
        raise ValueError("truncation_mode='keep_end' cuts a sample's image placeholders (TRL refuses it for vision "
                         "data too): use 'keep_start'")
    trl_config = copy.copy(config)
    trl_config.packing = False  # what TRL refuses for vision data; evenflow packs instead
    trl_config.padding_free = False
    return vlm_config, trl_config


class ProcessedSamples:
    """A vision dataset in TRL's format, each item processed alone by ``collator`` (TRL's
    ``DataCollatorForVisionLanguageModeling``: chat template, image placeholders, pixels, labels) into the
    per-sample form evenflow batches: token fields without their batch dimension, pixels and grids as the
    processor returns them. A sample alone has no padding."""

    _TOKEN_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids")

    def __init__(self, dataset: Any, collator: Any) -> None:
        self.dataset, self.collator = dataset, collator

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        sample = dict(self.dataset[index])
        videos = sample.pop("videos", None) or []
        if "image" not in sample:
            sample.setdefault("images", [])  # TRL's collator reads it; a video-only or text-only sample has none
        if videos:
            sample["messages"] = _with_videos(sample.get("messages"), videos, len(sample.get("images") or ()),
                                              index)
        batch = self.collator([sample])
        return {k: (v[0] if k in self._TOKEN_KEYS else v) for k, v in batch.items()}


def _with_videos(messages: Any, videos: list, images: int, index: int) -> list[dict]:
    """``messages`` with each ``{"type": "video"}`` placeholder holding its entry of ``videos``, in order (NOTE [
    TRL's vision data, packed ]): the processor's chat template then hands them to its video processor. String
    content (no placeholders) gets them at the start of the first user turn, after the image placeholders TRL
    puts there."""
    if not isinstance(messages, list):
        raise ValueError(f"sample {index} has videos but no 'messages': videos go with conversational samples "
                         "({'messages': [...], 'videos': [...]})")
    for v, video in enumerate(videos):
        if isinstance(video, (list, tuple)) and video and isinstance(video[0], Mapping) and "bytes" in video[0]:
            raise ValueError(f"sample {index}'s video {v} holds encoded frames ({{'path', 'bytes'}}), not images: "
                             "datasets stores a column of frame lists as bytes unless told otherwise; declare it, "
                             "e.g. dataset.cast_column('videos', datasets.List(datasets.List(datasets.Image())))")
    out, filled, placed = [], 0, False
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and message.get("role") == "user" and not placed:
            content = ([{"type": "image"}] * images + [{"type": "video"} for _ in videos]
                       + [{"type": "text", "text": content}])
            placed = True
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") == "video" and not any(k in part for k in ("video", "url", "path")):
                    if filled < len(videos):
                        part = {**part, "video": videos[filled]}
                    filled += 1
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    if filled != len(videos):
        raise ValueError(f"sample {index} has {len(videos)} videos but {filled} {{'type': 'video'}} placeholders in "
                         "its messages: put one placeholder where each video goes, in the order of 'videos'")
    return out


def _packing_choice(config: Any, cost: str | None, collator: Any) -> tuple[bool, Any, tuple[int, str] | None]:
    """``(packed, config for TRL, (max_length, truncation_mode) to apply after TRL's preparation or None)``.

    NOTE [ Packing with TRL ]: packing / padding_free / cost="summed" all mean one padding-free row per micro-batch.
    """
    packing = bool(getattr(config, "packing", False))
    padding_free = bool(getattr(config, "padding_free", False))
    if packing and config.packing_strategy != "bfd":
        raise ValueError(f"SFTConfig(packing_strategy={config.packing_strategy!r}) cuts samples into pieces, and "
                         "evenflow keeps every sample whole (each trained exactly once); use packing_strategy='bfd' "
                         "(evenflow then packs each micro-batch into one row of <= token_budget tokens, truncating "
                         "samples to max_length) or split long samples in the dataset")
    packed = packing or padding_free or cost == "summed"
    if not packed:
        return False, config, None
    asked = "packing=True" if packing else "padding_free=True" if padding_free else None
    if cost == "padded":
        raise ValueError(f"SFTConfig({asked}) makes one padding-free row per micro-batch, which costs its summed "
                         "tokens: drop cost='padded' (cost='summed' is selected)")
    if collator is not None:
        if asked:
            raise ValueError(f"SFTConfig({asked}) builds TRL's padding-free collator, which a data_collator cannot "
                             "replace (TRL's rule): drop data_collator, or pass cost='summed' with a collator that "
                             "returns one flattened row")
        return True, config, None  # the user's collator must flatten: tried at construction (_check_one_row)
    if config is None:
        raise ValueError("cost='summed' builds TRL's padding-free collator from the SFTConfig: pass "
                         "args=SFTConfig(..., padding_free=True)")
    trl_config = copy.copy(config)
    trl_config.packing = False
    trl_config.padding_free = True
    truncation = None
    if config.max_length is not None:
        # TRL refuses padding_free with max_length unless it packs offline; evenflow's budget bounds the row, and
        # each sample is truncated to max_length after TRL's preparation (as TRL would without packing).
        trl_config.max_length = None
        skip = (config.dataset_kwargs or {}).get("skip_prepare_dataset", False)
        truncation = None if skip else (config.max_length, config.truncation_mode)
    return True, trl_config, truncation


def _truncated(dataset: Any, max_length: int, mode: str, num_proc: int | None) -> Any:
    """TRL's own truncation of a prepared dataset (``input_ids`` / ``labels`` to ``max_length``, keep_start or
    keep_end), then TRL's filter of samples left without a supervised token."""
    if dataset is None:
        return None
    if isinstance(dataset, Mapping):
        return {name: _truncated(d, max_length, mode, num_proc) for name, d in dataset.items()}
    if mode not in ("keep_start", "keep_end"):
        raise ValueError(f"Unsupported truncation mode: {mode}, expected 'keep_start' or 'keep_end'")
    cut = slice(None, max_length) if mode == "keep_start" else slice(-max_length, None)
    kwargs = {"num_proc": num_proc} if hasattr(dataset, "__len__") else {}
    dataset = dataset.map(lambda ex: {"input_ids": ex["input_ids"][cut], "labels": ex["labels"][cut]}, **kwargs)
    return dataset.filter(lambda ex: any(t != IGNORE_INDEX for t in ex["labels"]), **kwargs)


def _check_one_row(collator: Any, dataset: Any) -> None:
    """cost="summed" budgets a batch's summed tokens: the collator must flatten it into one row (NOTE [ Packing
    with TRL ]). Tried on the first two prepared samples."""
    if isinstance(collator, DataCollatorForLanguageModeling) and collator.padding_free:
        return
    samples = ([dataset[i] for i in range(min(2, len(dataset)))] if hasattr(dataset, "__len__")
               else list(itertools.islice(iter(dataset), 2)))
    if len(samples) < 2:
        return
    ids = collator(samples)["input_ids"]
    if getattr(ids, "dim", lambda: 1)() > 1 and ids.shape[0] > 1:
        raise ValueError(f"cost='summed' budgets the summed tokens of a batch, but data_collator "
                         f"({type(collator).__name__}) returned padded rows {list(ids.shape)} for two samples: a "
                         "batch would hold rows x longest tokens, over token_budget. Use SFTConfig(padding_free="
                         "True) without a data_collator (TRL's padding-free collator), a collator that returns one "
                         "flattened row, or cost='padded'")
