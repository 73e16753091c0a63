"""Every rank's loader state in one object, for checkpoints written from one process or deduplicated across ranks.

    checkpoint = LoaderCheckpoint(loader)
    accelerator.register_for_checkpointing(checkpoint)          # Accelerate: save_state / load_state
    dcp.save({"loader": checkpoint, ...}, checkpoint_id=path)    # torch.distributed.checkpoint: a Stateful
    dcp.load({"loader": checkpoint, ...}, checkpoint_id=path)    # on any number of ranks
    loader.set_epoch(checkpoint.start_epoch)

NOTE [ Gather states on the default group ]
    The loader's own gloo group belongs to its collation thread, which may be inside a round exchange at
    any moment; a second collective on that group from the training thread could pair with the wrong
    exchange on another rank. So states travel over the default process group, from the training thread,
    which every rank is running in lockstep when a framework saves a checkpoint. Entries are indexed by
    global rank.

Why a gathered list: a loader's state is per rank, but single-writer checkpoints (Accelerate's custom objects,
Lightning) keep only the main process's copy, and ``torch.distributed.checkpoint`` keeps *one* copy of a
non-tensor value saved under the same key on every rank. Gathered, every rank saves the same list, so the one
copy kept holds every rank's state; loading passes that list to ``loader.load_state_dict``, which resumes each
rank's own state on the same number of ranks and re-deals the untrained remainder on another number (NOTE
[ Re-dealing a resumed epoch ] in evenflow.runtime.redeal). The list travels as one JSON text: DCP flattens a
list of mappings into one key per entry (``loader.ranks.0.epoch``, ...), so a checkpoint of 2 ranks would not
load into the template of a 3-rank job ("Missing key in checkpoint state_dict: loader.ranks.2.version").
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch.distributed as dist

__all__ = ["gather_states", "LoaderCheckpoint", "resume_epoch"]


def gather_states(mine: dict) -> list[dict]:
    """All ranks' loader states (a collective on the default group when distributed)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def resume_epoch(states: list[Mapping]) -> int:
    """The epoch to pass to ``set_epoch`` after loading ``states``: the saved one, or the next when it had ended."""
    return int(states[0]["epoch"]) + (1 if states[0]["finished"] else 0)


class LoaderCheckpoint:
    """Every rank's loader state as one object with ``state_dict`` / ``load_state_dict`` (a DCP ``Stateful``).

    ``state_dict`` gathers every rank's state over the default group: a collective, so call it (or let the
    framework call it) on every rank -- Accelerate's ``save_state`` and ``dcp.save`` / ``dcp.load`` do.
    ``load_state_dict`` is local. After a load, `start_epoch` is the epoch to pass to
    ``loader.set_epoch``.
    """

    VERSION = 2
    """2: ``ranks`` is the JSON text of the list (1: the list itself, still read)."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.start_epoch = 0

    def state_dict(self) -> dict:
        return {"version": self.VERSION, "ranks": json.dumps(gather_states(self.loader.state_dict()))}

    def load_state_dict(self, state: Mapping) -> None:
        if not isinstance(state, Mapping) or state.get("version") not in (1, 2) or "ranks" not in state:
            raise ValueError(f"LoaderCheckpoint: expected {{'version': {self.VERSION}, 'ranks': ...}}, got "
                             f"{type(state).__name__} {str(state)[:80]}; load what LoaderCheckpoint.state_dict saved")
        ranks = state["ranks"]
        states = json.loads(ranks) if isinstance(ranks, (str, bytes)) else list(ranks)
        self.loader.load_state_dict(states)  # same number of ranks: each its own; another: re-dealt
        self.start_epoch = resume_epoch(states)
