"""Checks on a loader state before it is resumed: schema and types here, cross-rank agreement in round 1.

A state is plain data (``DynamicBatchLoader.state_dict``). What this module refuses, with the field and
the fix named: missing or extra fields, wrong types (``consumed`` as a string, ``epoch`` as a string or a
bool), keys that are not sample keys of this dataset (``carry=[-1]``), duplicated keys, consumed keys that
this rank's epoch never held, ``finished`` inconsistent with what was consumed and carried, and an
IterableDataset resumed with another ``num_workers`` (its keys are stream positions, which depend on how
workers interleave). What one rank cannot see -- a torn checkpoint (rank 0 from step 3, rank 1 from step 6)
or a state loaded on some ranks only -- is refused in the epoch's first exchange, where every rank reports
``2 * step + finished`` of its state (``RankReport.resume``). A list of every rank's state (resume on any number
of ranks) is checked as one checkpoint at load time instead (evenflow.runtime.redeal.check_world).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["STATE_FIELDS", "check_schema", "validate_state", "key_order", "as_key"]

STATE_FIELDS = {
    "version": int, "fingerprint": int, "world_size": int, "rank": int, "token_budget": int,
    "num_samples": (int, type(None)), "join": bool, "epoch": int, "finished": bool, "step": int,
    "num_workers": int, "carry": list, "next_carry": list, "consumed": list, "stream": (list, type(None)),
    "content": (int, type(None)), "config": (dict, type(None)), "data": (dict, type(None)),
}
"""``stream``: None (the rank reads its shard of the epoch) or the keys dealt to it when the epoch was resumed on
another number of ranks (NOTE [ Re-dealing a resumed epoch ] in evenflow.runtime.redeal). ``content``: the data's
token-content fingerprint (a map-style dataset's few items, an iterable stream's first samples: NOTE [ Sharding
mistakes ] in evenflow.runtime.shard_check), None when it could not be taken, and None for a map-style dataset
since version 5, whose ``data`` holds more: its resume fingerprint (NOTE [ The resume fingerprint ] in
evenflow.runtime.resume_print; None for an IterableDataset and in states of earlier releases). ``config``: the
arguments that decide the batches, by name, so a refusal names the one that changed (None in states of earlier
releases)."""

_INT_LIMIT = 2 ** 62
"""No real counter comes near it; beyond it ``2 * step + 1`` would not fit the int64 round report."""


def key_order(key: object) -> tuple:
    """Sort keys of mixed kinds (ints, and ``(epoch, index)`` pairs carried across epochs)."""
    return (1, tuple(key)) if isinstance(key, tuple) else (0, key)


def as_key(value: object) -> object:
    """A key read back from a state: ints stay ints; 2-element lists (a state that went through JSON) or
    tuples become tuples. Anything else is returned as is and refused by [`validate_state()`][validate_state]."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return tuple(int(v) if _is_int(v) else v for v in value)
    return int(value) if _is_int(value) else value


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_schema(state: Mapping) -> None:
    """Refuse missing or unknown fields and wrong types (ValueError naming the field)."""
    missing = sorted(set(STATE_FIELDS) - set(state))
    extra = sorted(set(state) - set(STATE_FIELDS))
    if missing or extra:
        raise ValueError(f"cannot resume: the loader state lacks fields {missing} / has unknown fields {extra}; "
                         "pass the dict returned by DynamicBatchLoader.state_dict() unchanged")
    for name, kind in STATE_FIELDS.items():
        value = state[name]
        ok = isinstance(value, (list, tuple)) if kind is list else (
            _is_int(value) if kind is int else isinstance(value, kind) if kind is not bool else
            isinstance(value, (bool, np.bool_)))
        if kind == (int, type(None)):
            ok = value is None or _is_int(value)
        if kind == (list, type(None)):
            ok = value is None or isinstance(value, (list, tuple))
        if kind == (dict, type(None)):
            ok = value is None or isinstance(value, Mapping)
        if not ok:
            raise ValueError(f"cannot resume: state[{name!r}] is {type(value).__name__} {value!r:.60}, expected "
                             f"{_kind_name(kind)}; the state was modified or corrupted")
    if state["epoch"] < 0 or state["step"] < 0:
        raise ValueError(f"cannot resume: negative epoch {state['epoch']} or step {state['step']} in the state")
    for name in ("epoch", "step", "world_size", "rank", "token_budget", "num_samples", "num_workers"):
        if state[name] is not None and abs(state[name]) >= _INT_LIMIT:
            raise ValueError(f"cannot resume: state[{name!r}] is {state[name]}, beyond any real run (>= 2**62); the "
                             "state was modified or corrupted")
    if state["world_size"] < 1 or not 0 <= state["rank"] < state["world_size"]:
        raise ValueError(f"cannot resume: state says rank {state['rank']} of world_size {state['world_size']}; "
                         "the state was modified or corrupted")


def _kind_name(kind) -> str:
    if isinstance(kind, tuple):
        return " or ".join("None" if k is type(None) else k.__name__ for k in kind)
    return kind.__name__


def _check_keys(name: str, keys: Sequence, valid) -> None:
    seen = set()
    for key in keys:
        if not valid(key):
            raise ValueError(f"cannot resume: state[{name!r}] holds {key!r}, which is not a sample key of this "
                             "dataset (an index in range, or an (epoch, index) pair in quota mode)")
        if key in seen:
            raise ValueError(f"cannot resume: state[{name!r}] holds key {key!r} twice")
        seen.add(key)


def validate_state(state: Mapping, *, num_samples: int | None, shard: Sequence[int] | None,
                   num_workers: int, dropping: bool = False) -> dict:
    """Return a normalized copy of ``state`` or raise ValueError naming what is wrong.

    ``num_samples``/``shard``: ``len(dataset)`` and the state's rank's shard of its epoch -- or the explicit
    ``stream`` it was dealt (map-style), or None
    (iterable: keys are stream positions, only their form can be checked). ``dropping``: ``oversize="drop"``,
    whose dropped samples are neither consumed nor carried (the ``finished`` check is then skipped).
    """
    check_schema(state)
    out = dict(state)
    names = ("carry", "next_carry", "consumed") + (("stream",) if state["stream"] is not None else ())
    for name in names:
        out[name] = [as_key(k) for k in state[name]]
    if num_samples is None:
        if state["num_workers"] != num_workers:
            raise ValueError(f"cannot resume this IterableDataset with num_workers={num_workers}: the state was saved "
                             f"with num_workers={state['num_workers']}, and stream positions depend on how workers "
                             "interleave (samples would be lost and repeated). Resume with "
                             f"num_workers={state['num_workers']}")

        def valid(k):
            return (_is_int(k) and k >= 0) or (isinstance(k, tuple) and all(_is_int(v) and v >= 0 for v in k))
    else:
        def valid(k):
            if isinstance(k, tuple):
                return _is_int(k[0]) and 0 <= k[0] <= state["epoch"] and _is_int(k[1]) and 0 <= k[1] < num_samples
            return _is_int(k) and 0 <= k < num_samples
    for name in names:
        _check_keys(name, out[name], valid)
    if shard is not None:
        _check_epoch_keys(out, out["stream"] if out["stream"] is not None else shard, dropping)
    return out


def _check_epoch_keys(state: dict, shard: Sequence[int], dropping: bool) -> None:
    """Map-style: consumed and carried keys must be what this rank's epoch held; ``finished`` must agree."""
    held = set(state["carry"]) | set(shard)
    carry_ints = [k for k in state["carry"] if not isinstance(k, tuple)]
    if carry_ints:
        raise ValueError(f"cannot resume: state['carry'] holds plain indices {carry_ints[:5]}; carried samples are "
                         "(epoch, index) pairs -- the state was modified or saved by another release")
    foreign = [k for k in state["consumed"] if k not in held]
    if foreign:
        raise ValueError(f"cannot resume: state['consumed'] holds {len(foreign)} key(s) this rank's epoch "
                         f"{state['epoch']} never held (e.g. {foreign[:5]}); load each rank's own state, saved "
                         "with the same seed and world size")
    left = held - set(state["consumed"])
    if state["finished"] and not dropping:
        carried = set(state["next_carry"])
        expect = {k if isinstance(k, tuple) else (state["epoch"], k) for k in left}
        if state["join"] and left:
            raise ValueError(f"cannot resume: the state says epoch {state['epoch']} finished but {len(left)} of its "
                             "samples were never consumed; the 'finished' flag was modified")
        if not state["join"] and carried != expect:
            raise ValueError(f"cannot resume: the state says epoch {state['epoch']} finished but its next_carry does "
                             "not match the samples it left unconsumed; the state was modified")
    elif state["next_carry"]:
        raise ValueError("cannot resume: state['next_carry'] is set but 'finished' is False; the state was modified")
