"""Whether saved loader states may resume on this loader (``DynamicBatchLoader.load_state_dict``), the
configuration fingerprint they are compared by, and the state this rank resumes from.

``load_state_dict`` takes one rank's state (that rank resumes its own epoch, same world size) or the list of
every saved rank's state (any world size: at another one, the untrained remainder is re-dealt, NOTE
[ Re-dealing a resumed epoch ] in evenflow.runtime.redeal). Refused in the order a user hits the problem,
each time naming the fix: something that is not a state (a path, a trainer's checkpoint file, a wrapper
holding the states), a state of another evenflow release (``version``), a malformed one
([`check_schema()`][evenflow.runtime.resume.check_schema]), a list that is not one checkpoint (a rank missing or twice,
different steps, epochs, budgets or configurations: [`check_world()`][evenflow.runtime.redeal.check_world]), another
``token_budget`` or configuration (the fingerprint; the ``config`` a state carries names the argument that
changed and both values), another dataset (its sample count, then its token content: NOTE [ Sharding mistakes ]
in evenflow.runtime.shard_check), keys a saved epoch never held
([`validate_state()`][evenflow.runtime.resume.validate_state]), an IterableDataset in quota mode stopped mid-stream, and
an IterableDataset stopped mid-epoch resumed on another number of ranks. The loader changes nothing before every check
passed.

What is fingerprinted: for a map-style dataset (``data``), the token content of ``READS`` items spread over it
and, with ``lengths=``, every sample's length in index order (NOTE [ The resume fingerprint ] in
evenflow.runtime.resume_print: a reordered dataset is refused too; a part that could not be taken is not
compared, and the resume warns naming why); a version-4 state's ``content`` (8 items) is compared as it was.
For an IterableDataset (``content``), the token content of the first ``PICKS`` samples of the
saved epoch's stream on that rank, checked when the resumed epoch re-reads them (its first round: a different
stream is refused on every rank; a state saved at an epoch end is not checked -- its next epoch is a new
pass). A state saved at e25fa43 (version 3) has neither ``content`` nor ``config``: it loads, its dataset
compared by sample count only, and a changed configuration is refused as before, without naming the argument.

``set_epoch`` after loading a state: an epoch other than the saved one would discard what the state resumes
(the rest of its epoch, or a quota-mode carry): refused on every rank alike ([`discarded()`][discarded]) unless
``set_epoch(e, discard_resumed=True)``, which drops the state for any ``e``, the saved epoch included (that epoch
then starts afresh, nothing carried).

What may change on resume is the job shape: the world size, the policy ``planning="auto"`` resolves to, and
the default ``planning_group``. A state is compared with the fingerprint this loader's own arguments give *at
the saved world size*, so only an argument the user changed is refused.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch.utils.data import Dataset

from ...planning.alignment import config_fingerprint
from ...planning.timecost import TimeCost
from ..planning import default_planning_group, resolve_planning
from ..shard_check import PICKS
from ..redeal import check_world, redeal
from ..resume_print import ResumePrint, compare_prints
from ..resume import check_schema, validate_state
from ..source import shard_indices
from .config import LoaderConfig

__all__ = ["STATE_VERSION", "ResumeContext", "resume_state", "shape_at", "config_values", "discarded"]

STATE_VERSION = 5
"""5 added ``data`` (a map-style dataset's resume fingerprint; read as None from earlier versions); 4 added
``content`` and ``config`` (read as None from versions 2 and 3); 3 added ``stream`` (a re-dealt epoch's keys;
version-2 states are read as ``stream=None``)."""
_READABLE = (2, 3, 4, 5)


def _fingerprint(config: LoaderConfig, world_size: int, planning: str, planning_group: int) -> int:
    """What a state must have been saved under to resume: everything that decides the batches, and the job shape.

    The time cost counts where it plans (``planning="global"``) and differs from ``TimeCost()``, the cost every
    loader planned with before ``time_cost=`` existed: a state saved then has the same fingerprint as one
    saved with ``time_cost=TimeCost()`` now ([`_check_config()`][_check_config] names that argument when it is
    needed)."""
    parts = (config.grouping, config.alignment, config.seed, config.shuffle, config.grad_accum_steps,
             config.loss_tokens, config.balance, world_size, planning, planning_group)
    time_cost = config.planning_time_cost
    if planning == "global" and time_cost != TimeCost():
        parts += (time_cost.key(),)
    if config.shard is not None:  # another CP/SP split pads documents otherwise: other batches
        parts += (config.shard.style, config.shard.degree)
    return config_fingerprint(*parts)


def config_values(config: LoaderConfig) -> dict:
    """The arguments that decide the batches, by the loader's argument names (a state's ``config``: plain data)."""
    g, a = config.grouping, config.alignment
    return {"token_budget": g.token_budget, "cost": g.cost, "max_samples": g.max_samples,
            "extra_budgets": dict(sorted(g.extra_budgets.items())), "oversize": g.oversize,
            "pad_to_multiple_of": g.pad_to_multiple_of, "join": a.join, "max_steps_per_round": a.max_steps_per_round,
            "max_wait_rounds": a.max_wait_rounds, "buffer_size": a.buffer_size, "warmup_budgets": a.warmup_budgets,
            "seed": config.seed, "shuffle": config.shuffle, "grad_accum_steps": config.grad_accum_steps,
            "loss_tokens": dataclasses.asdict(config.loss_tokens), "balance": config.balance,
            "planning": config.planning, "planning_group": config.planning_group,
            "time_cost": None if config.time_cost is None else config.time_cost.describe(),
            "mesh": None if config.shard is None else f"{config.shard.style} over {config.shard.degree} ranks"}


def _changes(saved: Mapping, now: Mapping) -> list[str]:
    """``"seed=0 -> seed=1"`` for every argument that differs (a state that went through JSON compares alike)."""
    return [f"{k}={saved.get(k)!r} -> {k}={now.get(k)!r}" for k in now if _plain(saved.get(k)) != _plain(now.get(k))]


def _plain(value: object) -> object:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return list(value) if isinstance(value, tuple) else value


def shape_at(config: LoaderConfig, world_size: int) -> tuple[str, int]:
    """(policy, planning group) this configuration runs at ``world_size`` (``"auto"`` and the default group
    resolved there, as [`setup_planning()`][evenflow.runtime.planning.setup_planning] does)."""
    policy = resolve_planning(config.planning, world_size, balance=config.balance,
                              planning_group=config.planning_group)
    group = default_planning_group(world_size) if config.planning_group is None else config.planning_group
    return policy, group


@dataclass(frozen=True, kw_only=True)
class ResumeContext:
    """What a loader resuming a state is: its job shape, configuration and data."""

    config: LoaderConfig
    world_size: int
    rank: int
    dataset: Dataset
    iterable: bool
    num_workers: int
    content: Callable[[], int | None] = lambda: None
    """This loader's 8-item data fingerprint (a version-4 state's ``content``; NOTE [ Sharding mistakes ])."""
    data: Callable[[int | None], ResumePrint | None] = lambda reads: None
    """This loader's resume fingerprint over the first ``reads`` items a state read (map-style: read on demand,
    once per loader; NOTE [ The resume fingerprint ])."""

    def fingerprint_at(self, world_size: int) -> int:
        return _fingerprint(self.config, world_size, *shape_at(self.config, world_size))


_ONE_COPY = (". A checkpoint that keeps one copy of a value saved under one key on every rank "
             "(torch.distributed.checkpoint) must hold LoaderCheckpoint(loader) (evenflow.integrations), which gathers "
             "every rank's state, not the loader itself")


def resume_state(saved: object, ctx: ResumeContext) -> dict:
    """The normalized state this rank resumes from, or ValueError naming what is wrong and the fix.

    ``saved``: one rank's state (same world size: this rank's own) or the list of every saved rank's state (any
    world size; every new rank passes the same list).
    """
    if isinstance(saved, Mapping) or not isinstance(saved, Sequence) or isinstance(saved, (str, bytes)):
        state = _as_state(saved)
        if state["world_size"] != ctx.world_size:
            raise ValueError(f"cannot resume: this is rank {state['rank']}'s state of a job with world_size="
                             f"{state['world_size']}, and this job has {ctx.world_size} ranks; to resume on another "
                             f"number of ranks pass every saved rank's state, on every new rank: "
                             f"loader.load_state_dict([state_0, ..., state_{state['world_size'] - 1}]){_ONE_COPY}")
        if state["rank"] != ctx.rank:
            raise ValueError(f"state of rank {state['rank']} loaded on rank {ctx.rank}; load each rank's own state "
                             f"(or pass the list of every rank's state){_ONE_COPY}")
        _check_config(state, ctx)
        return _validated(state, ctx)
    states = [_as_state(s, f" (entry {i} of the list)") for i, s in enumerate(saved)]
    if not states:
        raise ValueError("cannot resume: load_state_dict got an empty list; pass every saved rank's state")
    _check_one_configuration(states)
    states = check_world(states)
    _check_config(states[0], ctx)
    states = [_validated(s, ctx) for s in states]
    if states[0]["world_size"] == ctx.world_size:
        return states[ctx.rank]  # same job shape: each rank resumes its own epoch, as with a single state
    if ctx.iterable and not (states[0]["finished"] and not any(s["next_carry"] for s in states)):
        raise ValueError(
            f"cannot resume this IterableDataset on {ctx.world_size} ranks from a state of {states[0]['world_size']} "
            f"ranks saved mid-epoch (epoch {states[0]['epoch']}, step {states[0]['step']}): an IterableDataset is "
            "each rank's own stream (you shard it by rank), so a saved stream position belongs to the rank that "
            "read it and no other rank can continue it. Resume on the same number of ranks, or from a checkpoint "
            "taken at an epoch end (join=True), or use a map-style dataset (the loader re-deals its remainder)")
    return redeal(states, rank=ctx.rank, world_size=ctx.world_size,
                  num_samples=0 if ctx.iterable else len(ctx.dataset), seed=ctx.config.seed, shuffle=ctx.config.shuffle)


def _as_state(obj: object, where: str = "") -> dict:
    """``obj`` as a schema-checked state of this release, or ValueError saying what it is and what to pass."""
    expected = ("expected the dict returned by DynamicBatchLoader.state_dict(), or the list of every rank's such "
                "dict")
    if isinstance(obj, (str, bytes, os.PathLike)):
        raise ValueError(f"cannot resume: load_state_dict got a {type(obj).__name__}{where} ({str(obj)[:60]!r}), "
                         f"{expected}; if it names a file, load it first (json.load / torch.load)")
    if not isinstance(obj, Mapping):
        raise ValueError(f"cannot resume: load_state_dict got a {type(obj).__name__}{where}, {expected}")
    keys = set(obj)
    if "loader" in keys and "fingerprint" not in keys:
        raise ValueError(f"cannot resume: this{where} is the content of a DynamicBatchTrainer checkpoint file "
                         "(evenflow_loader_rank<r>.json: {'version', 'loader', ...}), not a loader state; pass its "
                         "'loader' entry (or every rank's file's 'loader' entries as a list), or resume through "
                         "DynamicBatchTrainer.train(resume_from_checkpoint=...)")
    if "ranks" in keys and "fingerprint" not in keys:
        raise ValueError(f"cannot resume: this{where} is an evenflow checkpoint wrapper ({{'version', 'ranks'}}, "
                         "saved by LoaderCheckpoint or the Lightning data module), not a loader state; pass its "
                         "'ranks' list, or load it through the object that saved it")
    if "version" not in keys or "fingerprint" not in keys:
        raise ValueError(f"cannot resume: the mapping{where} is not an evenflow loader state (its keys: "
                         f"{sorted(map(str, keys))[:8]}); {expected}")
    version = obj["version"]
    if version not in _READABLE or isinstance(version, bool):
        raise ValueError(f"cannot resume: loader state version {version!r}{where} was saved by an incompatible "
                         f"evenflow release (this one reads versions {list(_READABLE)}); resume with the release "
                         "that saved it, or start the epoch afresh")
    state = dict(obj)
    if version == 2 and "stream" not in state:
        state.update(stream=None)
    if version in (2, 3):  # e25fa43 and earlier: no content fingerprint, no named configuration
        state.update(content=state.get("content"), config=state.get("config"))
    if version in (2, 3, 4):
        state.update(version=STATE_VERSION, data=state.get("data"))
    check_schema(state)  # fields and types first: the checks below read them
    return state


def _check_one_configuration(states: Sequence[Mapping]) -> None:
    """A list of states saved under different arguments is not one checkpoint: name the arguments and ranks."""
    configs = [s["config"] if s["config"] is not None else {"token_budget": s["token_budget"]} for s in states]
    for name in (k for k in configs[0] if all(k in c for c in configs)):
        by_value: dict = {}
        for s, c in zip(states, configs):
            by_value.setdefault(repr(_plain(c.get(name))), []).append(int(s["rank"]))
        if len(by_value) > 1:
            shown = "; ".join(f"{name}={v} on rank(s) {r}" for v, r in by_value.items())
            raise ValueError(f"cannot resume: the loader states do not come from one checkpoint: states saved under "
                             f"different loader configurations: different {name} ({shown}); pass every rank's "
                             "state from the same checkpoint")


def _check_config(state: Mapping, ctx: ResumeContext) -> None:
    """Refuse another budget or configuration: compared at the saved world size (only explicit arguments)."""
    token_budget = ctx.config.grouping.token_budget
    if state["token_budget"] != token_budget:
        raise ValueError(f"cannot resume: token_budget changed from {state['token_budget']} to "
                         f"{token_budget}; resume with the saved budget (token_budget={state['token_budget']})")
    world = state["world_size"]
    if state["fingerprint"] != ctx.fingerprint_at(world):
        policy, group = shape_at(ctx.config, world)
        legacy = dataclasses.replace(ctx.config, time_cost=TimeCost())
        if state["fingerprint"] == _fingerprint(legacy, world, policy, group):
            raise ValueError(f"cannot resume: this state was planned with time_cost=TimeCost() (token counts: every "
                             "loader before time_cost= existed), and this loader balances "
                             f"{ctx.config.planning_time_cost.describe()}; pass time_cost=evenflow.planning."
                             "TimeCost() to resume it with the cost it was planned with, or start the epoch afresh")
        at = "" if world == ctx.world_size else f" at the saved world size {world}"
        changes = _changes(state["config"], config_values(ctx.config)) if state["config"] is not None else []
        if changes:  # name them (a state of e25fa43 or earlier has no config: the message below lists candidates)
            raise ValueError(f"cannot resume: the loader configuration (what decides the batches) differs from the "
                             f"saved one: {'; '.join(changes)} "
                             f"(saved -> this loader); this loader runs planning={policy!r} (planning_group={group})"
                             f"{at}. Pass the saved value(s) to resume it (the world size, what planning='auto' "
                             "resolves to and the default planning_group may change)")
        raise ValueError("cannot resume: the loader configuration (seed, shuffle, budgets, buffer_size, join, "
                         "grad_accum_steps, balance, planning policy, planning_group, time_cost) differs from the "
                         f"saved one; this loader runs planning={policy!r} (planning_group={group}){at}. Use the saved "
                         "configuration (a state saved while planning='local' was the default needs "
                         "planning='local'; the world size, what planning='auto' resolves to and the default "
                         "planning_group may change)")


def _validated(state: Mapping, ctx: ResumeContext) -> dict:
    """The normalized copy of ``state`` ([`validate_state()`][evenflow.runtime.resume.validate_state]), once it fits the
    data."""
    dataset, iterable = ctx.dataset, ctx.iterable
    if not iterable and state["num_samples"] != len(dataset):
        raise ValueError(f"cannot resume: the dataset had {state['num_samples']} samples, now {len(dataset)}; "
                         "resume with the dataset the state was saved with")
    if not iterable and state["content"] is not None:
        now = ctx.content()
        if now is not None and now != state["content"]:
            raise ValueError(
                f"cannot resume on rank {ctx.rank}: the dataset is not the one the state was saved with: both have "
                f"{len(dataset)} samples, but the token content (input_ids and labels) of {PICKS} items spread over it "
                f"differs (saved fingerprint {state['content']}, this dataset's {now}). Its indices would name other "
                "samples: some would train twice, others never. Resume with the saved dataset (same samples, order and "
                "tokenization), or start the epoch afresh without the state")
    if not iterable and state["data"] is not None:  # NOTE [ The resume fingerprint ]
        saved = state["data"]
        reads = saved.get("reads") if isinstance(saved, Mapping) else None
        now = ctx.data(reads if isinstance(reads, int) and not isinstance(reads, bool) and reads >= 0 else None)
        refusal, warning = compare_prints(saved, now, rank=ctx.rank, n=len(dataset))
        if refusal is not None:
            raise refusal
        if warning:
            warnings.warn(warning, stacklevel=4)
    shard = None
    if not iterable:  # what the saved epoch held: its re-dealt stream, else its shard (consumed keys come from it)
        shard = state["stream"] if state["stream"] is not None else shard_indices(
            len(dataset), rank=state["rank"], world_size=state["world_size"], epoch=state["epoch"],
            seed=ctx.config.seed, shuffle=ctx.config.shuffle)
    state = validate_state(state, num_samples=None if iterable else len(dataset), shard=shard,
                           num_workers=ctx.num_workers, dropping=ctx.config.grouping.oversize == "drop")
    if iterable and not state["join"] and (state["carry"] or state["consumed"]):
        raise ValueError("cannot resume an IterableDataset in quota mode (join=False) mid-stream: its carried "
                         "samples live in memory only; resume at an epoch boundary or use join=True")
    return state



def discarded(state: Mapping, epoch: int) -> str | None:
    """What ``set_epoch(epoch)`` would discard of a loaded, not yet started ``state`` (None: nothing): the rest of
    its epoch, or the samples a finished quota-mode epoch carries into the next one.

    Decided on the facts every rank's state of one checkpoint shares (``epoch``, ``finished``, ``join``: the first
    exchange refuses states that differ there), never on what this rank alone holds: a quota-mode carry is one
    rank's (rank 0 may carry 9 samples and rank 1 none), and a refusal on the carrying rank only would leave its
    peers waiting in the epoch's first exchange. So ``set_epoch`` refuses on every rank alike, or on none."""
    saved = state["epoch"]
    if epoch == saved or (state["finished"] and (state["join"] or epoch == saved + 1)):
        return None
    if state["finished"]:
        mine = len(state["next_carry"])
        what = (f"samples that epoch {saved} carries into epoch {saved + 1} (quota mode): this rank carries {mine}"
                + ("" if mine else ", but a peer's state may carry some, and every rank refuses alike"))
    else:
        what = (f"rest of epoch {saved}, which it resumes (saved at step {state['step']}; this rank had trained "
                f"{len(state['consumed'])} of its samples): the others would never train")
    then = "" if state["finished"] else f", and set_epoch({saved + 1}) once it ends"
    return (f"set_epoch({epoch}) after load_state_dict would discard the loaded state's {what}. To resume, call "
            f"set_epoch({saved + 1 if state['finished'] else saved}){then} (LoaderCheckpoint.start_epoch gives it); "
            f"to drop the state on purpose, call loader.set_epoch({epoch}, discard_resumed=True)")
