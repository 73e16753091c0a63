"""How HF's epoch loop is fitted onto evenflow epochs (NOTE [ HF Trainer contract ] in evenflow.integrations.hf).

- [`TrainBatches`][TrainBatches] -- the iterable ``Trainer`` trains on: one loader epoch per ``iter()``, the epoch's
  last accumulation window completed with IDLE micro-batches, ``len()`` the per-epoch bound (or none, under max_steps).
- [`EpochCallback`][EpochCallback] -- keeps ``TrainerState.epoch`` on the loader's epochs, ends HF's epoch loop when the
  requested evenflow epochs are done, writes each rank's loader state into every checkpoint folder.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from collections.abc import Mapping, Sequence

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..runtime.loader import DynamicBatchLoader
from ..runtime.redeal import epoch_stream
from ..step_info import STEP_INFO_KEY, StepInfo

__all__ = ["TrainBatches", "EpochCallback", "BoundProgressCallback", "LOADER_STATE_FILE", "read_loader_files"]

logger = logging.getLogger("evenflow")

LOADER_STATE_FILE = "evenflow_loader_rank{rank}.json"
"""Per-rank loader state inside each checkpoint folder (plain JSON): ``{"version", "loader"[, "lr_scaler"]}``."""
_STATE_FILE_VERSION = 1


def read_loader_files(folder: str, rank: int, world_size: int) -> list[dict] | dict:
    """The checkpoint files' contents to resume ``rank`` of ``world_size`` from: every saved rank's when the folder
    holds them all (any number of ranks), else this rank's own (the same number of ranks only).

    NOTE [ What an HF checkpoint folder must hold ]
        Each rank writes its own ``evenflow_loader_rank<r>.json``. Resuming on the same number of ranks needs
        only each rank's own file (node-local checkpoint folders work). Resuming on another number needs, on
        every rank, *all* the files the saved job wrote (rank 0 .. W-1): every new rank re-deals the untrained
        rest of the epoch from all of them. Keep checkpoints on a file system every node sees, or copy the files
        into each node's folder.
    """
    own = os.path.join(folder, LOADER_STATE_FILE.format(rank=rank))
    present = sorted(glob.glob(os.path.join(folder, LOADER_STATE_FILE.format(rank="*"))))
    if not present:
        raise FileNotFoundError(f"{own} is missing: checkpoint {folder} was not written by DynamicBatchTrainer, so the "
                                "loader cannot resume its epoch position; resume from a DynamicBatchTrainer checkpoint "
                                "or start a new run")
    first = _read(own if os.path.isfile(own) else present[0])
    saved_world = first.get("loader", {}).get("world_size") if isinstance(first.get("loader"), Mapping) else None
    if not isinstance(saved_world, int) or saved_world < 1:
        raise ValueError(f"{own if os.path.isfile(own) else present[0]} is not an evenflow loader file (no "
                         "'loader' state with a world_size); resume from a DynamicBatchTrainer checkpoint")
    paths = [os.path.join(folder, LOADER_STATE_FILE.format(rank=r)) for r in range(saved_world)]
    if all(os.path.isfile(p) for p in paths):
        return [_read(p) for p in paths]
    if saved_world == world_size and os.path.isfile(own):
        return first
    found = sorted(int(p.rsplit("rank", 1)[1].split(".")[0]) for p in present)
    raise FileNotFoundError(
        f"checkpoint {folder} was saved by {saved_world} ranks and this job has {world_size}: every rank needs all "
        f"{saved_world} loader files evenflow_loader_rank0..{saved_world - 1}.json in its checkpoint folder to re-deal "
        f"the rest of the epoch, and this one holds ranks {found}. Put checkpoints on a file system every node "
        "sees, or copy the files into each node's checkpoint folder (NOTE [ What an HF checkpoint folder must hold ])")


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


class TrainBatches:
    """The iterable HF trains on: evenflow epochs, the last window padded to full length, a length policy.

    One ``iter()`` runs one loader epoch (the next one the loader has not finished). ``len()`` is the per-epoch
    bound when HF sizes by epochs and raises ``TypeError`` (HF's "no length") when it runs by ``max_steps``.
    """

    def __init__(self, loader: DynamicBatchLoader, *, accum: int, sized: bool, max_epochs: int | None) -> None:
        self.loader = loader
        self.dataset = loader.dataset  # HF's num_examples() reads it (logging only)
        self.accum = accum
        self.sized = sized
        self.max_epochs = max_epochs
        self.epoch = 0
        """The next loader epoch to run (advanced when one is exhausted)."""
        self.last_info: StepInfo | None = None
        self.samples_done = 0
        """Samples of the current epoch handed out so far, over all ranks (from ``StepInfo.global_samples``)."""
        self.trained = {"samples": 0, "real_tokens": 0, "loss_tokens": 0}
        """Totals over all ranks since construction, from the StepInfo of every batch (padding copies count 0)."""
        self._active = None   # the generator HF is consuming
        self._inner = None    # the loader's iterator while an epoch is in flight
        self.resumed_done = 0
        """Samples of the resumed epoch every rank had trained at the checkpoint (0 until the epoch starts)."""

    def planned_windows(self, epoch: int, fresh: bool = False) -> int | None:
        """Optimizer steps (windows) of ``epoch`` planned from the loader's ``lengths=``, or None (NOTE [ The
        planned epoch length ]); ``fresh``: as run from its start even if it was resumed mid-way."""
        steps = self.loader.fresh_planned_steps(epoch) if fresh else self.loader.planned_steps(epoch)
        return None if steps is None else -(-steps // self.accum)

    def planned_total(self) -> int | None:
        """Optimizer steps of the whole run (every epoch from its start), or None: the LR schedule's horizon."""
        if self.max_epochs is None:
            return None
        windows = [self.planned_windows(e, fresh=True) for e in range(self.max_epochs)]
        return None if None in windows or not windows else sum(windows)

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("evenflow train loader: HF runs by max_steps, the epoch length is not known in advance")
        if self.max_epochs is not None and self.epoch < self.max_epochs:
            # Planned: the longest epoch still to run, in micro-batches (HF runs every epoch to this count at most
            # and stops it on exhaustion; its LR horizon comes from planned_total, see create_scheduler).
            windows = [self.planned_windows(e) for e in range(self.epoch, self.max_epochs)]
            if None not in windows:
                return max(windows) * self.accum
        n = len(self.loader.dataset)
        world = self.loader.world_size
        # Join mode: each rank with data contributes a sample to every step, so steps <= max shard = ceil(N/W),
        # for a fresh or a resumed epoch alike (quota mode: carried samples may add up to N more per rank).
        return -(-n // world) if self.loader.config.alignment.join else 2 * n

    def __iter__(self):
        self.finish_epoch()
        self._active = self._run()
        return self._active

    def _run(self):
        while self.max_epochs is None or self.epoch < self.max_epochs:
            epoch = self.epoch
            self.loader.set_epoch(epoch)
            self._inner = iter(self.loader)
            steps, window, last = 0, 0, None
            self.samples_done, self.resumed_done = self.resumed_done, 0  # the epoch fraction continues
            for batch in self._inner:
                info = batch[STEP_INFO_KEY]
                steps, window, last = steps + 1, window + 1, batch
                self.last_info = info
                self._count(info)
                yield batch
                if info.window_end:
                    window_len, window = window, 0
            self._inner = None
            self.epoch = epoch + 1
            if steps:  # an epoch resumed exactly at its end yields nothing: go on to the next one
                yield from self._padding(last, window_len)
                return

    def _padding(self, last: Mapping, window_len: int):
        """IDLE micro-batches that complete the epoch's last window to ``accum`` micro-batches.

        HF syncs gradients and steps the optimizer every ``accum`` micro-batches (or at its own epoch bound). With
        ``accum = 3`` and an epoch of 7 steps, windows are [3, 3, 1]: two copies of the last batch follow it with
        ``loss_scale = 0``, so the third window reaches HF's sync point and is applied, unchanged.
        """
        info: StepInfo = last[STEP_INFO_KEY]
        # Nothing is trained by these copies on any rank: every count is 0, so metrics do not count them twice.
        pad = dataclasses.replace(info, is_idle=True, local_samples=0, local_loss_tokens=0, loss_scale=0.0,
                                  padded_tokens=0, real_tokens=0, sample_ids=[], window_end=True, global_samples=0,
                                  global_loss_tokens=0, global_real_tokens=0, max_padded_tokens=0,
                                  mean_padded_tokens=0.0)
        for _ in range(-window_len % self.accum):
            yield {**last, STEP_INFO_KEY: pad}

    def finish_epoch(self) -> None:
        """Close the pass HF stopped consuming. Normally the loader is at its end (HF stopped on its exact bound)."""
        active, inner = self._active, self._inner
        self._active = self._inner = None
        if active is not None:
            active.close()
        if inner is None:
            return
        try:
            next(inner)
        except StopIteration:
            pass
        else:
            logger.warning("evenflow: the trainer ended epoch %d before the loader was exhausted; its remaining "
                           "samples are skipped", self.epoch)
            inner.close()
        self.epoch += 1

    def _count(self, info: StepInfo) -> None:
        self.samples_done += info.global_samples
        self.trained["samples"] += info.global_samples
        self.trained["real_tokens"] += info.global_real_tokens
        self.trained["loss_tokens"] += info.global_loss_tokens

    def epoch_float(self) -> float:
        """Loader epoch + fraction of its samples handed out, for ``TrainerState.epoch``.

        Map-style join mode: each sample of the epoch is trained exactly once, so samples done / N is exact (HF's
        "batches done / len" is not: ``len`` is only an upper bound, and the epoch would jump from 0.1 to 1.0).
        Otherwise (quota mode, iterable) the step bound gives the fraction.
        """
        info = self.last_info
        if info is None or info.epoch != self.epoch or self._inner is None:
            return float(self.epoch)
        if self.loader.config.alignment.join and hasattr(self.loader.dataset, "__len__") and len(self.loader.dataset):
            return info.epoch + min(self.samples_done / len(self.loader.dataset), 1.0)
        return info.epoch + min((info.step + 1) / info.steps_bound, 1.0) if info.steps_bound > 0 else float(info.epoch)

    def max_steps_bound(self, global_step: int) -> int | None:
        """Upper bound on the run's optimizer steps at ``global_step``, from the latest StepInfo; None under max_steps.

        Steps taken, plus the windows the current epoch can still hold (``ceil((steps_bound - steps done) /
        accum)``; the loader's bound tightens as lengths are seen), plus ``ceil(len(self) / accum)`` for every
        epoch still to come. Called at the end of an optimizer step, i.e. on a window boundary.
        """
        if not self.sized or self.max_epochs is None:
            return None
        info = self.last_info
        open_epoch = self._inner is not None and info is not None and info.epoch == self.epoch
        first_ahead = self.epoch + (1 if open_epoch else 0)
        planned = [self.planned_windows(e) for e in range(first_ahead, self.max_epochs)]
        if open_epoch:
            current = self.planned_windows(self.epoch)
            done = -(-(info.step + 1) // self.accum)
            left = (current - done if current is not None else
                    -(-max(info.steps_bound - (info.step + 1), 0) // self.accum))
        else:
            left = 0
        if None in planned:
            per_epoch = -(-len(self) // self.accum)
            return global_step + max(left, 0) + len(planned) * per_epoch
        return global_step + max(left, 0) + sum(planned)

    def state(self, lr_scaler=None) -> dict:
        out = {"version": _STATE_FILE_VERSION, "loader": self.loader.state_dict()}
        if lr_scaler is not None:
            out["lr_scaler"] = lr_scaler.state_dict()  # the reference survives a resume on another world size
        return out

    def load(self, files: Mapping | Sequence[Mapping]) -> None:
        """Resume from checkpoint files' contents: this rank's own, or every saved rank's (any number of ranks)."""
        many = not isinstance(files, Mapping)
        for content in files if many else [files]:
            if not isinstance(content, Mapping) or content.get("version") != _STATE_FILE_VERSION:
                version = content.get("version") if isinstance(content, Mapping) else type(content).__name__
                raise ValueError(f"evenflow checkpoint file version {version!r} is not {_STATE_FILE_VERSION}")
        states = [f["loader"] for f in files] if many else files["loader"]
        self.loader.load_state_dict(states)
        first = states[0] if many else states
        self.epoch = first["epoch"] + (1 if first["finished"] else 0)
        if many and not first["finished"]:
            self.resumed_done = self._done_before(states)

    def _done_before(self, states: Sequence[Mapping]) -> int:
        """Samples of the resumed epoch every rank had trained at the checkpoint: the epoch fraction continues
        from there (map-style join mode, where each sample counts once; else 0)."""
        loader = self.loader
        if not loader.config.alignment.join or loader.streams.iterable:
            return 0
        n, config = len(loader.dataset), loader.config
        left = sum(len(epoch_stream(s, num_samples=n, seed=config.seed, shuffle=config.shuffle)) - len(s["consumed"])
                   for s in states)
        return max(n - left, 0)

    def close(self) -> None:
        active, inner = self._active, self._inner
        self._active = self._inner = None
        if active is not None:
            active.close()
        if inner is not None:
            inner.close()
        self.loader.close()


class EpochCallback(TrainerCallback):
    """Keeps HF's epoch bookkeeping on the loader's epochs and saves the loader state with each checkpoint."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer  # a DynamicBatchTrainer: reads its ``train_batches``

    def on_train_begin(self, args, state, control, **kwargs):
        batches = self.trainer.train_batches
        if batches is not None:
            bound = batches.max_steps_bound(state.global_step)
            if bound is not None:  # exact when the epochs are planned: the progress bar's total from step 0
                state.max_steps = max(bound, state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        batches = self.trainer.train_batches
        if batches is not None:
            state.epoch = batches.epoch_float()
            bound = batches.max_steps_bound(state.global_step)
            if bound is not None:
                # Still an upper bound (HF's flow callback stops at it), now tightened: the progress bar total.
                state.max_steps = max(bound, state.global_step)

    def on_epoch_end(self, args, state, control, **kwargs):
        batches = self.trainer.train_batches
        if batches is None or control.should_training_stop:
            return  # stopping mid-epoch (max_steps, early stopping): the loader is closed at train end
        batches.finish_epoch()
        state.epoch = float(batches.epoch)
        if batches.max_epochs is not None and batches.epoch >= batches.max_epochs:
            control.should_training_stop = True
            state.max_steps = state.global_step  # the run's exact length, now known: the bar ends at 100 %


    def on_save(self, args, state, control, **kwargs):
        batches = self.trainer.train_batches
        if batches is None:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, LOADER_STATE_FILE.format(rank=batches.loader.rank))
        with open(path + ".tmp", "w") as f:
            json.dump(batches.state(self.trainer.lr_scaler), f)
        os.replace(path + ".tmp", path)

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.close_train_loader()


class BoundProgressCallback(ProgressCallback):
    """HF's progress bar with its total refreshed from ``state.max_steps`` (the tightening evenflow bound)."""

    def on_step_end(self, args, state, control, **kwargs):
        bar = self.training_bar
        if bar is not None and bar.total != state.max_steps:
            bar.total = state.max_steps
            bar.refresh()
        super().on_step_end(args, state, control, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        bar = self.training_bar
        if bar is not None and bar.total != state.global_step:
            bar.total = state.global_step
            bar.update(state.global_step - bar.n)
        super().on_train_end(args, state, control, **kwargs)
