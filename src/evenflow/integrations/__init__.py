"""Trainer integrations. Framework modules import their framework, so import them by name:

- hf.py          -- ``DynamicBatchTrainer``: transformers.Trainer with evenflow batches (extra ``hf``)
- hf_epochs.py   -- how HF's epoch loop is fitted onto evenflow epochs (train iterable, callbacks, progress bound)
- trl.py         -- ``DynamicBatchSFTTrainer``: TRL's SFTTrainer with evenflow batches (extra ``trl``)
- accelerate.py  -- ``device_batches``, ``sync_window``, ``LoaderCheckpoint``: loader kept out of ``prepare``
- states.py      -- ``LoaderCheckpoint``: every rank's loader state in one object (Accelerate, a DCP ``Stateful``)
- lightning.py   -- ``DynamicBatchDataModule``, ``EvenflowModule`` (IDLE batches never logged), ``EvenflowCallback``,
                   ``EvenflowProgressBar`` (ETA from the loader's step bound), ``training_loss`` (extra ``lightning``)
- evaluation.py  -- ``eval_loader`` (no shuffle, every sample once), ``evaluate_loss`` (exact per-token loss)
- metrics.py     -- ``StepMetrics``: per-step metrics dict from StepInfo, no communication
- mesh.py        -- ``dp_process_group``: the loader's gloo group over a DeviceMesh's data-parallel dimension;
                   ``destroy_process_groups``: the end of a job, with nothing left for interpreter exit

Plain DDP / FSDP2 loops need nothing beyond the loader: see examples/ddp_train.py and examples/fsdp2_train.py.
"""

from .evaluation import eval_loader, evaluate_loss
from .mesh import destroy_process_groups, dp_process_group, dp_rank_groups
from .metrics import StepMetrics
from .states import LoaderCheckpoint

__all__ = ["eval_loader", "evaluate_loss", "dp_process_group", "dp_rank_groups", "destroy_process_groups",
           "StepMetrics", "LoaderCheckpoint"]
