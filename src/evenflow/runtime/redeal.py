"""Resume a map-style epoch saved by W ranks on W' ranks: the list of all W states, re-dealt. Pure (no I/O).

NOTE [ Re-dealing a resumed epoch ]
    What a rank's state says about its epoch (NOTE [ Who owns a moved sample ] in balancing.py): its *stream*
    -- the keys it reads this epoch: ``carry`` (quota mode: ``(epoch, index)`` pairs carried in) then its
    shard of the epoch's permutation, or an explicit ``stream`` list when the epoch was itself re-dealt -- and
    ``consumed``, the keys of that stream trained in committed windows, wherever they were trained. So the
    untrained remainder of the whole world is the union over the W saved ranks of ``stream - consumed``: what
    sat in a buffer, was in flight to another rank, or was trained in an unfinished accumulation window is
    not consumed and is trained again after the resume (it never reached the optimizer).

    The re-deal is a function of the W states alone, so every new rank, given the same list, derives the same
    deal without talking to the others: the remainders in each old rank's stream order, interleaved (old rank
    0's first key, old rank 1's first key, ..., then every rank's second key), dealt round-robin to the W'
    new ranks. Example: old remainders [a0 a1 a2] and [b0 b1] on W'=3 -> R = a0 b0 a1 b1 a2 -> new rank 0
    reads [a0 b1], rank 1 [b0 a2], rank 2 [a1]. Carried keys lead every old stream, so they still lead the new
    ones. Each new rank records the keys dealt to it as its explicit ``stream`` (its state grows by them, like
    ``consumed`` does), which a later resume, at any world size, re-deals the same way. A finished quota-mode
    epoch re-deals its ``next_carry`` the same way; a finished join-mode epoch leaves nothing to re-deal.

    The deal does not depend on how the old run planned its steps (local, global, balanced): only on what it
    committed. Same W keeps the per-rank resume (each rank loads its own state, nothing is re-dealt).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .source import shard_indices

__all__ = ["SHARED_FIELDS", "check_world", "epoch_stream", "redeal"]

SHARED_FIELDS = ("version", "world_size", "epoch", "step", "finished", "fingerprint", "token_budget", "num_samples",
                 "join")
"""Fields every rank's state of one checkpoint has in common: states that differ there are not one checkpoint."""

_WHY = {
    "step": "states of different checkpoint steps (a torn checkpoint: some ranks' files are older)",
    "epoch": "states of different epochs",
    "finished": "states of one epoch's end and of its middle",
    "fingerprint": "states saved under different loader configurations",
    "token_budget": "states saved under different token budgets",
    "num_samples": "states of datasets of different lengths",
    "world_size": "states of jobs with different numbers of ranks",
}


def check_world(states: Sequence[Mapping]) -> list[Mapping]:
    """The states of one checkpoint, ordered by rank; ValueError naming what is missing, repeated or differs.

    ``states`` already passed the schema check. Refused: a rank without a state, two states of one rank, and
    states that differ in any of [`SHARED_FIELDS`][SHARED_FIELDS] (naming the field and which ranks hold which value).
    """
    for field in SHARED_FIELDS:
        values: dict = {}
        for i, s in enumerate(states):
            values.setdefault(repr(s[field]), []).append(int(s["rank"]) if "rank" in s else i)
        if len(values) > 1:
            shown = "; ".join(f"{field}={v} on rank(s) {r}" for v, r in values.items())
            raise ValueError(f"cannot resume: the loader states do not come from one checkpoint: "
                             f"{_WHY.get(field, field)} ({shown}); pass every rank's state from the same checkpoint")
    world = int(states[0]["world_size"])
    ranks = [int(s["rank"]) for s in states]
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise ValueError(f"cannot resume: the list holds two states of rank(s) {twice} (ranks {ranks}); pass each "
                         f"of the {world} saved ranks' states once, in any order")
    missing = sorted(set(range(world)) - set(ranks))
    outside = sorted(r for r in ranks if not 0 <= r < world)
    if missing or outside:
        raise ValueError(f"cannot resume: the checkpoint was saved by {world} ranks but the list holds states of ranks "
                         f"{sorted(ranks)}" + (f": rank(s) {missing} missing" if missing else "")
                         + (f": rank(s) {outside} out of range" if outside else "")
                         + f"; every new rank must pass all {world} saved states (evenflow_loader_rank<r>.json for "
                         f"r in 0..{world - 1}, or the checkpoint's 'ranks' list)")
    return sorted(states, key=lambda s: int(s["rank"]))


def epoch_stream(state: Mapping, *, num_samples: int, seed: int, shuffle: bool) -> list:
    """The keys the state's rank reads in its epoch, in order: carried keys, then its shard or explicit stream."""
    base = state.get("stream")
    if base is None:
        base = shard_indices(num_samples, rank=int(state["rank"]), world_size=int(state["world_size"]),
                             epoch=int(state["epoch"]), seed=seed, shuffle=shuffle)
    return list(state["carry"]) + list(base)


def _interleave(lists: Sequence[Sequence]) -> list:
    longest = max((len(x) for x in lists), default=0)
    return [x[j] for j in range(longest) for x in lists if j < len(x)]


def redeal(states: Sequence[Mapping], *, rank: int, world_size: int, num_samples: int, seed: int,
           shuffle: bool) -> dict:
    """Rank ``rank`` of ``world_size``'s state, re-dealt from the W validated ``states`` (ordered by rank).

    The result resumes like a state this rank saved itself: same epoch, step and finished flag, its share of
    the untrained remainder as ``stream`` (nothing consumed yet), or its share of the carried keys as
    ``next_carry`` when the epoch had finished (NOTE [ Re-dealing a resumed epoch ]).

    >>> s = dict(version=3, world_size=2, epoch=0, step=1, finished=False, carry=[], next_carry=[])
    >>> old = [dict(s, rank=0, stream=None, consumed=[0]), dict(s, rank=1, stream=None, consumed=[1, 3])]
    >>> [redeal(old, rank=r, world_size=3, num_samples=7, seed=0, shuffle=False)["stream"] for r in range(3)]
    [[2, 6], [5], [4]]
    """
    first = states[0]
    if first["finished"]:
        stream, rest = None, _interleave([list(s["next_carry"]) for s in states])
        _check_disjoint([list(s["next_carry"]) for s in states], "next_carry")
    else:
        held = [epoch_stream(s, num_samples=num_samples, seed=seed, shuffle=shuffle) for s in states]
        _check_disjoint(held, "stream")
        remainders = []
        for s, keys in zip(states, held):
            consumed = set(s["consumed"])
            remainders.append([k for k in keys if k not in consumed])
        stream, rest = _interleave(remainders)[rank::world_size], []
    out = dict(first)  # the shared fields (SHARED_FIELDS) and num_workers
    out.update(world_size=world_size, rank=rank, carry=[], consumed=[], stream=stream,
               next_carry=rest[rank::world_size])
    return out


def _check_disjoint(held: Sequence[Sequence], what: str) -> None:
    """A key in two ranks' streams would be trained twice: such states come from different runs."""
    owner: dict = {}
    for r, keys in enumerate(held):
        for k in keys:
            if owner.setdefault(k, r) != r:
                raise ValueError(f"cannot resume: sample key {k!r} is in the {what} of both rank {owner[k]} and rank "
                                 f"{r}; the states come from different runs (or were edited)")
