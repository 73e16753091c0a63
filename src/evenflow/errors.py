"""The errors every layer raises, and how a failure's detail travels between ranks.

[`PeerStopped`][PeerStopped] and [`PeerError`][PeerError] (what a rank sees when a peer stops early or fails),
[`StepInfoMisuse`][StepInfoMisuse] (a batch went on without its step info taken out), [`ExampleError`][ExampleError]
(one example of a multimodal batch is unusable), and the fixed-width int64 encoding of a failure that the loader's
rounds and the orchestrator's exchanges carry ([`encode_detail()`][encode_detail], [`decode_detail()`][decode_detail]).
Nothing here imports torch.

NOTE [ Faults in the round sequence ]
    Every failure on a rank -- a worker's exception or death, a sample that cannot be measured, a
    ``collate_fn`` or ``length_fn`` error or one that blocks past ``worker_timeout``, a sample that cannot be
    pickled or unpickled on its way to another rank, an epoch that cannot start, or the trainer's own
    exception passed to ``close(exc)`` / raised inside ``with loader:`` -- raises a flag in that rank's next
    exchange that carries flags: exchange 1 of the next round for what happens while filling the buffer;
    exchange 2 of the same round for what happens after exchange 1 (receiving a moved sample, collating the
    round: every round is collated before exchange 2); the commit exchange under ``balance=True``, whose
    samples move after exchange 2. Every rank sees the flag, so every rank then issues one more fixed-size
    all_gather ([`DETAIL_WIDTH`][DETAIL_WIDTH] int64: sample index, type name, message as truncated UTF-8, and whether
    the trainer failed) and no other collective. Rounds without an error cost nothing extra. Custom exception
    classes need not pickle: only text travels.

    A round's batches are handed to the trainers only once every rank collated them, so every rank has handed
    over the same steps when an error round comes. A loader failure is raised after those (the failing rank
    re-raises its own exception, with a note naming its rank and sample; every peer raises
    [`PeerError`][PeerError]), so every rank yields the same number of batches before raising: under DDP no rank
    waits in a gradient all_reduce that a failed peer never joins. A peer's *trainer* failure is raised ahead
    of the batches still held: that rank has left its loop, nothing keeps the ranks level any more.

NOTE [ Early stops ]
    A generator cannot tell a ``break`` from an exception leaving the loop. When rank r's iterator is closed
    early, r reports STOP(r, s) in its next round, s = batches its trainer took. Every rank ends the epoch
    after that round; a peer still iterating raises [`PeerStopped`][PeerStopped] when it asks for batch s + 1 if it
    already knows of the stop, else at its next request: it may yield the batches it held ready before it
    learned (up to ``depth`` plus one round's steps), never an end of epoch. That holds at the end too: the
    epoch's last round is followed by one more exchange once every trainer took its last batch (NOTE [ The end
    of an epoch is agreed ] in collator.py), so a rank that stops at the last steps is still seen. Ranks that
    all stop at the same step never ask for batch s + 1: that is a normal coordinated stop, and so is a stop
    after the epoch's last batch. A peer blocked in the user's own collective (a DDP all_reduce waiting for r)
    cannot be pre-empted by the loader; it sees that collective's timeout.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PeerStopped", "PeerError", "StepInfoMisuse", "ExampleError", "DETAIL_WIDTH", "encode_detail",
           "decode_detail", "trainer_failed", "sample_of"]

_TYPE_BYTES = 64
_MESSAGE_BYTES = 1024
_HEADER = 5  # has_index, index, len(type), len(message), trainer (the rank's trainer failed, not its loader)
DETAIL_WIDTH = _HEADER + (_TYPE_BYTES + _MESSAGE_BYTES) // 8
"""int64 words of the error-detail exchange (issued only on rounds where some rank reported an error)."""


class PeerStopped(RuntimeError):
    """A peer rank stopped iterating at ``step`` (a ``break``, an exception leaving its loop, ``close()``),
    and this rank asked for a batch past that step (NOTE [ Early stops ])."""

    def __init__(self, rank: int, step: int, *, this_rank: int) -> None:
        super().__init__(
            f"evenflow: rank {rank} stopped iterating its loader after {step} step(s) of this epoch, so rank "
            f"{this_rank} cannot get step {step + 1}. If rank {rank} broke out of its loop on purpose, break at "
            "the same step on every rank; if it failed, its own log has the error (use `with loader:` or "
            "loader.close(exc) to have its error raised here as PeerError)")
        self.rank = rank
        self.step = step


class PeerError(RuntimeError):
    """A peer rank failed; raised on every other rank within one round (NOTE [ Faults in the round sequence ]).

    Attributes: ``rank``, ``type_name`` (the original exception's class name), ``detail`` (its message,
    truncated to 1 KiB of UTF-8) and ``sample_index`` (the dataset index or stream position, or None).
    """

    def __init__(self, rank: int, type_name: str, detail: str, sample_index: int | None, *,
                 this_rank: int) -> None:
        where = f" at sample index {sample_index}" if sample_index is not None else ""
        super().__init__(f"evenflow: rank {rank} failed{where} with {type_name}: {detail} (seen on rank "
                         f"{this_rank}; rank {rank}'s log has the traceback)")
        self.rank = rank
        self.type_name = type_name
        self.detail = detail
        self.sample_index = sample_index


class StepInfoMisuse(RuntimeError):
    """A batch went on without its [`StepInfo`][evenflow.StepInfo] being taken out (NOTE [ Misuse is loud ] in
    `evenflow.step_info`)."""


class ExampleError(ValueError):
    """One example of a rank's batch is unusable (its media do not match its grid or its placeholders).

    ``example``: its position in the rank's batch; ``sample_index``: its dataset index when known (peers'
    [`PeerError`][PeerError] reports it).
    """

    def __init__(self, message: str, *, example: int, sample_index: int | None = None) -> None:
        where = f"example {example} of this rank's batch" + (
            f" (dataset index {sample_index})" if sample_index is not None else "")
        super().__init__(f"{where}: {message}")
        self.example = example
        self.sample_index = sample_index


def sample_of(key: object) -> int | None:
    """The user-facing sample index of an internal key: an int; ``(epoch, index)`` for a sample carried
    across epochs in quota mode; ``(source rank, position)`` for a balanced iterable sample."""
    if isinstance(key, tuple) and len(key) == 2:
        key = key[1]
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return int(key)
    return None


def _text(value: str, limit: int) -> bytes:
    data = value.encode("utf-8")
    if len(data) > limit:
        # Keep the head and the tail: a worker's error is "Caught X in DataLoader worker..." + a traceback
        # whose *last* line is the actual error.
        head = limit // 4
        data = data[:head] + b" [...] " + data[-(limit - head - 7):]
    return data.decode("utf-8", errors="ignore").encode("utf-8")[:limit]  # never cut a character in half


def encode_detail(exc: BaseException | None, sample_index: int | None, *, trainer: bool = False) -> np.ndarray:
    """This rank's row of the error-detail exchange (all zeros when it did not fail). ``trainer``: the failure
    is the trainer's own (``close(exc)``), not the loader's: peers raise it at once, not after their batches."""
    row = np.zeros(DETAIL_WIDTH, dtype=np.int64)
    if exc is None:
        return row
    name, message = _text(type(exc).__name__, _TYPE_BYTES), _text(str(exc), _MESSAGE_BYTES)
    row[:_HEADER] = [sample_index is not None, sample_index or 0, len(name), len(message), trainer]
    raw = np.zeros(_TYPE_BYTES + _MESSAGE_BYTES, dtype=np.uint8)
    raw[:len(name)] = np.frombuffer(name, dtype=np.uint8)
    raw[_TYPE_BYTES:_TYPE_BYTES + len(message)] = np.frombuffer(message, dtype=np.uint8)
    row[_HEADER:] = raw.view(np.int64)
    return row


def trainer_failed(row: np.ndarray) -> bool:
    """Whether a row of [`encode_detail()`][encode_detail] reports the trainer's own failure."""
    return bool(row[4])


def decode_detail(row: np.ndarray) -> tuple[str, str, int | None]:
    """``(type name, message, sample index)`` from a row of [`encode_detail()`][encode_detail]."""
    has_index, index, n_name, n_message, _ = (int(v) for v in row[:_HEADER])
    raw = np.ascontiguousarray(row[_HEADER:], dtype=np.int64).view(np.uint8)
    name = raw[:n_name].tobytes().decode("utf-8", errors="replace")
    message = raw[_TYPE_BYTES:_TYPE_BYTES + n_message].tobytes().decode("utf-8", errors="replace")
    return name, message, index if has_index else None
