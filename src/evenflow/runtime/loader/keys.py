"""The keys of one epoch's samples, as the loader reads them (evenflow.runtime.loader).

A key names a sample in the loader's state (consumed, carried) and in errors: a dataset index for a map-style
dataset (listed up front, in shard order), a stream position for an IterableDataset (counted as samples arrive,
across epochs in quota mode). In quota mode a carried map-style key becomes an ``(epoch, index)`` pair, and an
iterable epoch continues the previous pass's unread rest before its own. A worker that delivers no sample in
time becomes an error naming the key it was waited for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta

from ...errors import sample_of
from ..source import Streams
from ..stream_check import StreamWindow


def _continued(streams: Streams, old: Iterator | None) -> Iterator:
    """A new pass over an iterable dataset; with ``old`` (quota mode) the last pass's unread rest comes first."""
    if old is None:
        return streams.open()
    if streams.persistent:
        # Persistent workers: opening resets the one worker iterator, which would drop the unread rest of
        # the old pass (and re-read its start). Open the new pass only once the old one is exhausted.
        return _chain(old, _deferred(streams.open))
    return _chain(old, streams.open())


def _chain(first: Iterator, second: Iterator) -> Iterator:
    yield from first
    yield from second


def _deferred(open_stream: Callable[[], Iterator]) -> Iterator:
    yield from open_stream()


def _carried(key: object, epoch: int) -> object:
    """Quota mode, map-style: the key a sample of ``epoch`` keeps when it is carried into later epochs."""
    return key if isinstance(key, tuple) else (epoch, key)


class _Keyed:
    """``(key, sample)`` over a map-style stream of ``(index, sample)``: keys in the order they were listed."""

    def __init__(self, keys: list, raw: Iterator) -> None:
        self.keys = keys
        self.raw = raw
        self.position = 0

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> tuple:
        index, sample = next(self.raw)
        key = self.keys[self.position]
        self.position += 1
        return key, sample


class StreamPosition:
    """The next stream position of an iterable dataset: the key its next sample gets.

    The loader owns one and keeps it across the passes of quota mode, so carried keys stay unique; each
    pass's [`_Numbered`][_Numbered] draws from it.
    """

    def __init__(self) -> None:
        self.value = 0


class _Numbered:
    """``(position, sample)`` over a raw stream, positions drawn from a running [`StreamPosition`][StreamPosition];
    every sample read also goes to the epoch's [`StreamWindow`][evenflow.runtime.stream_check.StreamWindow] (the
    unsplit-stream check and the resume fingerprint: NOTE [ Sharding mistakes ]), which raises when a resumed stream is
    not the saved one -- an error of this rank's stream, reported to every rank like a failing ``__iter__``."""

    def __init__(self, position: StreamPosition, raw: Iterator, window: StreamWindow | None = None) -> None:
        self.position = position
        self.raw = raw
        self.window = window

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> tuple:
        try:
            sample = next(self.raw)
        except StopIteration:
            if self.window is not None:
                self.window.end()
            raise
        key = self.position.value
        self.position.value += 1
        if self.window is not None:
            self.window.add(sample)
        return key, sample


def _fetch_error(exc: BaseException, key: object, *, rank: int, worker_timeout: timedelta) -> BaseException:
    """A DataLoader timeout as what it means here, naming the sample it waited for; other errors as they are."""
    if "DataLoader timed out" not in str(exc):
        return exc
    where = f"sample index {sample_of(key)}" if sample_of(key) is not None else "the next sample"
    err = RuntimeError(
        f"evenflow: rank {rank}'s DataLoader workers delivered no sample within worker_timeout="
        f"{worker_timeout.total_seconds():g}s while it waited for {where}: a __getitem__/__iter__ that "
        "blocks, a worker that died, or a sample that cannot be pickled to leave its worker (a lock, an open "
        "file). If decoding is legitimately this slow, raise worker_timeout= (and timeout= above it)")
    err.__cause__ = exc
    return err
