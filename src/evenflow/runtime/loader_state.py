"""Whether a saved loader state may resume on this loader (``DynamicBatchLoader.load_state_dict``), and the
configuration fingerprint it is compared by.

Refused in the order a user hits the problem, each time naming the fix: a state of another evenflow release
(``version``), a malformed one (:func:`~evenflow.runtime.resume.check_schema`), one saved by another job shape
(world size, rank), another ``token_budget`` or configuration (the fingerprint), another dataset (sample count),
keys its saved epoch never held (:func:`~evenflow.runtime.resume.validate_state`), and an IterableDataset in
quota mode stopped mid-stream. The loader changes nothing before every check passed.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch.utils.data import Dataset

from ..planning.alignment import config_fingerprint
from .loader_config import LoaderConfig
from .resume import check_schema, validate_state
from .source import shard_indices

__all__ = ["STATE_VERSION"]

STATE_VERSION = 2


def _fingerprint(config: LoaderConfig, world_size: int, planning: str, planning_group: int) -> int:
    """What a state must have been saved under to resume: everything that decides the batches, and the job shape."""
    return config_fingerprint(config.grouping, config.alignment, config.seed, config.shuffle, config.grad_accum_steps,
                              config.loss_tokens, config.balance, world_size, planning, planning_group)


def _check_saved_by(state: Mapping, *, world_size: int, rank: int, token_budget: int, fingerprint: int,
                    planning: str, planning_group: int) -> None:
    """Refuse a state this loader could not have saved: another release, job shape, budget or configuration."""
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
        raise ValueError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}; it was saved by "
                         "an incompatible evenflow release")
    check_schema(state)  # fields and types first: the checks below read them
    if state["world_size"] != world_size:
        raise ValueError(f"cannot resume: the state was saved with world_size={state['world_size']} but this "
                         f"job has {world_size}; each rank's shard would change. Resume with the same "
                         "data-parallel degree, or start the epoch afresh")
    if state["rank"] != rank:
        raise ValueError(f"state of rank {state['rank']} loaded on rank {rank}; load each rank's own state")
    if state["token_budget"] != token_budget:
        raise ValueError(f"cannot resume: token_budget changed from {state['token_budget']} to "
                         f"{token_budget}; resume with the saved budget")
    if state["fingerprint"] != fingerprint:
        raise ValueError("cannot resume: the loader configuration (seed, shuffle, budgets, buffer_size, join, "
                         "grad_accum_steps, balance, planning policy and planning_group) differs from the saved "
                         f"one; this loader runs planning={planning!r} (planning_group="
                         f"{planning_group}). Use the saved configuration (a state saved while "
                         "planning='local' was the default needs planning='local')")


def _validated(state: Mapping, *, dataset: Dataset, iterable: bool, rank: int, world_size: int, seed: int,
               shuffle: bool, num_workers: int, dropping: bool) -> dict:
    """The normalized copy of ``state`` (:func:`~evenflow.runtime.resume.validate_state`), once it fits the data."""
    if not iterable and state["num_samples"] != len(dataset):
        raise ValueError(f"cannot resume: the dataset had {state['num_samples']} samples, now {len(dataset)}")
    shard = None
    if not iterable:  # the shard of the saved epoch: consumed and carried keys must come from it
        shard = shard_indices(len(dataset), rank=rank, world_size=world_size, epoch=state["epoch"],
                              seed=seed, shuffle=shuffle)
    state = validate_state(state, num_samples=None if iterable else len(dataset), shard=shard,
                           num_workers=num_workers, dropping=dropping)
    if iterable and not state["join"] and (state["carry"] or state["consumed"]):
        raise ValueError("cannot resume an IterableDataset in quota mode (join=False) mid-stream: its carried "
                         "samples live in memory only; resume at an epoch boundary or use join=True")
    return state
