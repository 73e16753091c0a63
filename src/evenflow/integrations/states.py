"""Every rank's loader state in one object, for frameworks that write checkpoints from one process.

NOTE [ Gather states on the default group ]
    The loader's own gloo group belongs to its collation thread, which may be inside a round exchange at
    any moment; a second collective on that group from the training thread could pair with the wrong
    exchange on another rank. So states travel over the default process group, from the training thread,
    which every rank is running in lockstep when a framework saves a checkpoint. Entries are indexed by
    global rank.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["gather_states", "pick_state"]


def gather_states(mine: dict) -> list[dict]:
    """All ranks' loader states (a collective on the default group when distributed)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def pick_state(states: list[dict]) -> dict:
    """This rank's entry of :func:`gather_states`' result; refuses a different number of ranks."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if len(states) != world:
        raise ValueError(f"the checkpoint holds loader states of {len(states)} ranks but this job has {world}; "
                         "resume with the same number of ranks")
    return states[dist.get_rank() if world > 1 else 0]
