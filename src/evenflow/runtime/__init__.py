"""Runtime at the DataLoader boundary (public PyTorch APIs only).

Its errors (``PeerStopped``, ``PeerError``) live in [`evenflow.errors`][evenflow.errors] and ``StepInfo`` in
[`evenflow.step_info`][evenflow.step_info], on the ground floor, so the layers below the loader raise and read them too;
both are re-exported here.

- loader/      -- DynamicBatchLoader (loader.py: epochs, the trainer-facing iterator, state) and what it
                  delegates: config.py (argument checks, LoaderConfig), state.py (a saved state checked against
                  this loader), keys.py (the keyed sample streams it feeds the collator), idle.py (IDLE batches)
- collator.py  -- the per-epoch collation thread: fill, round (two fixed exchanges), collate, hand off
- calls.py     -- its calls into user code on a bounded helper thread; dead DataLoader workers seen at once
- transfer.py  -- how a sample moves to another rank: its tensors as their own bytes, the rest pickled
- source.py    -- per-rank sample streams on a plain DataLoader(batch_size=None); map-style sharding
- resume.py    -- validation of a loader state before resuming
- comm.py      -- the only torch.distributed code: rank/world/group resolution and the int64 all_gather
                  (PeerTable: whichever collective a dead peer breaks, the error names it)
- teardown.py  -- what is closed at interpreter exit, before finalization (NOTE [ Exit-time teardown ])
- balancing.py / global_round.py / planning.py -- balance=True, planning="global", which policy runs
- collate.py   -- PadCollate (right-padded rows) and FlatCollate (one varlen row)
- collate_extras.py -- the other keys of a batch: media rows, audio clips, metadata (never dropped silently)
- shard_check.py -- sharding mistakes caught at the first round (a dataset split twice: token content compared)
- stream_check.py -- unsplit IterableDataset streams caught from the digests of each rank's first samples
- mesh.py      -- the loader on a DeviceMesh: its data-parallel group, its CP/SP peers and their agreement check
- shard.py     -- shard_batch / unshard_batch: one shard-ready batch split for this CP/SP rank and back
- epoch_plan.py -- the epoch's exact step count from per-sample lengths (``lengths=``, PlannedLengths), via
                  evenflow.sim
"""

from .collate import FlatCollate, PadCollate
from ..errors import PeerError, PeerStopped
from .loader import DynamicBatchLoader, LoaderConfig
from .epoch_plan import dataset_lengths  # after .loader: epoch_plan imports the loader's config
from .shard import shard_batch, unshard_batch
from .source import shard_indices
from ..step_info import STEP_INFO_KEY, StepInfo, pop_step_info, scale_loss

__all__ = ["DynamicBatchLoader", "LoaderConfig", "FlatCollate", "PadCollate", "STEP_INFO_KEY", "StepInfo",
           "pop_step_info", "scale_loss", "shard_indices", "PeerError", "PeerStopped", "shard_batch", "unshard_batch",
           "dataset_lengths"]
