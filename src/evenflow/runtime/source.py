"""Per-rank sample streams built on a plain public ``torch.utils.data.DataLoader`` (batch_size=None).

Map-style datasets are sharded by the loader: a seeded permutation of all indices, dealt round-robin to
ranks, with *no padding duplicates* (601 samples on 3 ranks -> 201/200/200). Iterable datasets are each
rank's own stream; the key of a sample is its position in that stream.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from .comm import pid_alive

__all__ = ["shard_indices", "check_dataset", "StreamOptions", "Streams"]


def shard_indices(num_samples: int, *, rank: int, world_size: int, epoch: int, seed: int,
                  shuffle: bool) -> list[int]:
    """This rank's indices for ``epoch``: deterministic, disjoint across ranks, covering every index once.

    >>> shard_indices(5, rank=1, world_size=2, epoch=0, seed=0, shuffle=False)
    [1, 3]
    """
    order = (np.random.default_rng([seed, epoch]).permutation(num_samples) if shuffle
             else np.arange(num_samples))
    return order[rank::world_size].tolist()


class _IndexList(Sampler[int]):
    """A sampler over an explicit index list (reset per epoch; persistent workers see the new list)."""

    def __init__(self) -> None:
        self.indices: list[int] = []

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return len(self.indices)


class _WithIndex(Dataset):
    """Return ``(index, sample)`` so the stream knows which dataset index each sample came from."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, index: int):
        return index, self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)


# NOTE [ Sample transport ]
#     Workers hand over one sample at a time. A torch tensor crosses the process boundary as a shared-memory
#     handle, which costs ~0.6 ms per tensor here, whatever its size: 2 tensors x 3,000 samples took 4.0 s,
#     the same data as numpy arrays (pickled through the pipe) 0.5 s. So small CPU tensors travel as numpy
#     and become tensors again on arrival (torch.from_numpy, no copy); large ones keep shared memory.
_PICKLE_MAX_BYTES = 1 << 20


class _Packed:
    """A small tensor travelling as a numpy array (see NOTE [ Sample transport ])."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


def _pack(item):
    """Worker side: small CPU tensors -> [`_Packed`][_Packed], inside dicts, lists and tuples; refuse what cannot
    leave the worker (NOTE [ Samples that cannot be pickled ])."""
    _check_picklable(item)
    return _pack_value(item)


def _dense(obj: torch.Tensor) -> bool:
    """A plain strided tensor (what numpy and ``untyped_storage`` take). Nested, sparse, quantized or opaque
    (MKL-DNN) tensors and subclasses are left to torch's own worker transport, which carries each of them."""
    return type(obj) is torch.Tensor and obj.layout == torch.strided and not obj.is_nested and not obj.is_quantized


def _pack_value(obj):
    if isinstance(obj, torch.Tensor):
        if not _dense(obj):
            return obj
        nbytes = obj.numel() * obj.element_size()
        if (obj.device.type == "cpu" and not obj.requires_grad and obj.dtype in _NUMPY_DTYPES
                and nbytes < _PICKLE_MAX_BYTES):
            return _Packed(obj.numpy())  # a numpy view pickles its own bytes only
        if obj.device.type == "cpu" and obj.untyped_storage().nbytes() > nbytes:
            return obj.clone()  # a view of a larger tensor: shared memory would hold (and copy) all of its storage
        return obj
    if type(obj) is dict:
        return {k: _pack_value(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_pack_value(v) for v in obj)
    return obj


# NOTE [ Samples that cannot be pickled ]
#     A worker hands its result to a queue feeder thread, which pickles it; when that fails (a lock, an open
#     file, a generator in the sample) the feeder prints a traceback and *drops* the sample, and the main
#     process waits for it forever. So the worker pickles every leaf that is not a dense tensor, array or
#     plain value itself (cheap: token samples have none) and raises, naming the sample index; the DataLoader
#     re-raises that in the main process like any dataset error.
_PLAIN = (torch.Tensor, np.ndarray, np.generic, str, bytes, int, float, bool, type(None))


def _check_picklable(item) -> None:
    index, sample = item if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int) else (None, item)
    for path, leaf in _leaves(sample, "sample"):
        try:
            pickle.dumps(leaf)
        except Exception as exc:  # noqa: BLE001 - any pickling failure
            where = f"sample index {index}" if index is not None else "a sample of the stream"
            raise TypeError(f"{where}: {path} is a {type(leaf).__name__} that cannot be pickled ({exc}), so it "
                            "cannot leave its DataLoader worker; return tensors, arrays, numbers or strings from "
                            "the dataset (open files and locks inside __getitem__, not in the sample)") from exc


def _leaves(obj, path: str):
    if isinstance(obj, torch.Tensor) and not _dense(obj):
        # Nested, sparse, quantized tensors and subclasses travel through torch's own transport; an MKL-DNN tensor
        # cannot (no storage): its feeder thread would fail and drop the sample. Pickled once here, rare.
        yield path, obj
        return
    if isinstance(obj, _PLAIN):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, obj


def _unpack(obj):
    if isinstance(obj, _Packed):
        return torch.from_numpy(obj.array)
    if type(obj) is dict:
        return {k: _unpack(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_unpack(v) for v in obj)
    return obj


_NUMPY_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                 torch.float32, torch.float64}


def _identity(x):
    return x


def _checked(x):
    """Worker side with pin_memory (tensors stay tensors): only the pickling check of [`_pack()`][_pack]."""
    _check_picklable(x)
    return x


def _started(loader: DataLoader) -> Iterator:
    yield from loader


def _unpacked(stream: Iterator) -> Iterator:
    for item in stream:
        yield _unpack(item)


@dataclass(frozen=True, kw_only=True)
class StreamOptions:
    """What is passed straight to the worker ``DataLoader``; see ``torch.utils.data.DataLoader``."""

    num_workers: int = 0
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    pin_memory: bool = False
    multiprocessing_context: object = None
    worker_init_fn: object = None
    timeout: float = 0


# NOTE [ Workers that end early ]
#     Every worker notes its pid in a shared array (its slot: 0 = not started yet), so the collation thread sees
#     a dead worker at once (NOTE [ User code is bounded ] in calls.py). But torch stops an IterableDataset's
#     worker as soon as *its* shard is exhausted, while its siblings go on: with shards of different lengths
#     (10 files over 3 workers, an empty shard) a worker that finished looks exactly like one the out-of-memory
#     killer took. So the worker says goodbye: the stream it iterates ([`_Goodbye`][_Goodbye]) negates its slot when
#     the user's iterator ends normally, and the watch skips negative slots; a worker killed mid-shard never
#     gets there. A map-style dataset's workers are stopped together, by the DataLoader, once every index of
#     the pass was served: the watch stands down from then on ([`Streams.open()`][Streams.open]). A dead worker's exit
#     status (``multiprocessing.active_children``' Process objects, public) names the signal that ended it.
class _NotePid:
    """The workers' ``worker_init_fn``: note this worker's pid, then run the user's
    ([`Streams.dead_workers()`][Streams.dead_workers])."""

    def __init__(self, pids, user_fn) -> None:
        self.pids = pids
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        self.pids[worker_id] = os.getpid()
        if self.user_fn is not None:
            self.user_fn(worker_id)


class _Goodbye(IterableDataset):
    """The user's IterableDataset as the workers iterate it: a worker whose shard ended normally negates its slot
    (NOTE [ Workers that end early ]); each pass re-marks it first (persistent workers start a pass anew)."""

    def __init__(self, dataset: IterableDataset, pids) -> None:
        self.dataset = dataset
        self.pids = pids

    def __iter__(self) -> Iterator:
        info = torch.utils.data.get_worker_info()
        if info is None:  # pragma: no cover - the DataLoader runs it in workers only
            yield from self.dataset
            return
        pid = os.getpid()
        self.pids[info.id] = pid
        yield from self.dataset
        self.pids[info.id] = -pid


_EXPECTED = ("expected a map-style dataset -- len(dataset) and dataset[i] -> {'input_ids': ..., 'labels': ...}: a "
             "list of per-sample dicts, a torch Dataset, a datasets.Dataset -- or a torch IterableDataset")


def check_dataset(dataset: object) -> None:
    """Refuse what is not a dataset, at construction and before any collective, saying what was passed and what
    is expected (every rank passes the same kind of object, so every rank refuses it alike). A torch
    ``Dataset`` subclass is trusted; other objects must index by position and have a length."""
    if isinstance(dataset, (IterableDataset, Dataset)):
        return
    what = type(dataset).__name__
    if isinstance(dataset, (str, bytes, os.PathLike)):
        raise TypeError(f"DynamicBatchLoader got a {what} as its dataset ({str(dataset)[:80]!r}), which it would read "
                        f"character by character; {_EXPECTED}. If it names a file, load it first: "
                        "datasets.load_dataset('json', data_files=path)['train'], or json.load into a list of dicts")
    if isinstance(dataset, DataLoader):
        raise TypeError("DynamicBatchLoader got a DataLoader as its dataset; it runs the DataLoader itself (its "
                        "workers: num_workers=, prefetch_factor=, ...) and forms the batches by token_budget=. Pass "
                        f"the DataLoader's dataset (loader.dataset) instead; {_EXPECTED}")
    if isinstance(dataset, Mapping):
        keys = list(dataset)[:6]
        if keys and all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
            return  # {0: sample, 1: sample, ...} indexes by position: a map-style dataset
        values = [dataset[k] for k in keys]
        if values and all(hasattr(v, "column_names") or isinstance(v, (Dataset, IterableDataset)) for v in values):
            raise TypeError(f"DynamicBatchLoader got a {what} of splits {keys} as its dataset (what "
                            "datasets.load_dataset returns without split=); pass one split, e.g. dataset['train']")
        raise TypeError(f"DynamicBatchLoader got a dict of columns (a {what} with keys {keys}) as its dataset; "
                        "indexing it by position fails (KeyError: 0). Pass a list of per-sample dicts "
                        "([dict(zip(d, row)) for row in zip(*d.values())]) or datasets.Dataset.from_dict(d); "
                        f"{_EXPECTED}")
    if isinstance(dataset, Iterator):
        raise TypeError(f"DynamicBatchLoader got a {what} (an iterator, readable once) as its dataset; wrap it in a "
                        "torch IterableDataset whose __iter__ creates it anew each epoch (and shards it by rank), or "
                        f"materialize it as a list; {_EXPECTED}")
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(f"DynamicBatchLoader got a {what} as its dataset; {_EXPECTED}")


class Streams:
    """Owns the worker DataLoader and hands out one ``(key, sample)`` iterator per epoch."""

    def __init__(self, dataset: Dataset, options: StreamOptions) -> None:
        check_dataset(dataset)
        self.iterable = isinstance(dataset, IterableDataset)
        self.dataset = dataset
        self.num_workers = options.num_workers
        # pin_memory pins what the DataLoader returns, so packed arrays would escape it: keep tensors then.
        self.packed = options.num_workers > 0 and not options.pin_memory
        self.persistent = options.persistent_workers and options.num_workers > 0
        transport = _pack if self.packed else _checked if options.num_workers else _identity
        # Every worker notes its pid in shared memory, so a worker that dies (the OOM killer) is seen at once
        # (NOTE [ User code is bounded ] in calls.py); 0 = not started yet.
        self.pids = (_context(options.multiprocessing_context).Array("q", options.num_workers, lock=False)
                     if options.num_workers else None)
        init = _NotePid(self.pids, options.worker_init_fn) if options.num_workers else options.worker_init_fn
        kwargs = dict(batch_size=None, collate_fn=transport, num_workers=options.num_workers,
                      persistent_workers=options.persistent_workers and options.num_workers > 0,
                      pin_memory=options.pin_memory, multiprocessing_context=options.multiprocessing_context,
                      worker_init_fn=init, timeout=options.timeout)
        if options.num_workers > 0 and options.prefetch_factor is not None:
            kwargs["prefetch_factor"] = options.prefetch_factor
        self.ending = False
        """The DataLoader is stopping this pass's workers: every index of a map-style pass was served."""
        self.procs: dict = {}
        """pid -> multiprocessing Process of the workers seen running (their exit status names a signal)."""
        if self.iterable:
            self.sampler = None
            self.loader = DataLoader(_Goodbye(dataset, self.pids) if self.pids is not None else dataset, **kwargs)
        else:
            self.sampler = _IndexList()
            self.loader = DataLoader(_WithIndex(dataset), sampler=self.sampler, **kwargs)

    def open(self, indices: Sequence[int] | None = None) -> Iterator:
        """The epoch's stream: ``(index, sample)`` pairs for map-style datasets, raw samples for iterable ones
        (the loader numbers them). The workers start at the first ``next()``, on the thread that reads the
        stream -- the collation thread's helper, not the trainer's (main) thread: there torch would install its
        SIGCHLD handler, which raises a dead worker's error at an arbitrary point of the trainer's code (or
        not at all when the process was reaped first); evenflow watches its workers itself (calls.py)."""
        if not self.iterable:
            self.sampler.indices = list(indices)
        if self.pids is not None:
            # Non-persistent: last pass's workers are gone, this pass's note theirs. Persistent: the same workers
            # start a new pass, none has said goodbye to it yet (NOTE [ Workers that end early ]).
            self.pids[:] = [abs(p) if self.persistent else 0 for p in self.pids[:]]
        self.ending = not self.iterable and not self.sampler.indices
        stream = _started(self.loader)
        if not self.iterable and not self.persistent:
            stream = self._last_index_noted(stream, len(self.sampler.indices))
        return _unpacked(stream) if self.packed else stream

    def _last_index_noted(self, stream: Iterator, count: int) -> Iterator:
        for served, item in enumerate(stream, 1):
            if served >= count:
                self.ending = True  # what follows is the DataLoader stopping its workers
            yield item

    def dead_workers(self) -> str | None:
        """This pass's workers that died before their shard ended, e.g. ``"DataLoader worker 1 (pid 4242, killed
        by SIGKILL)"``, or None (NOTE [ Workers that end early ])."""
        if self.pids is None or self.ending:
            return None
        noted = [(w, pid) for w, pid in enumerate(self.pids[:]) if pid > 0]
        if any(pid not in self.procs for _, pid in noted):  # new workers: keep their Process objects (and no others)
            running = {p.pid: p for p in multiprocessing.active_children()}
            self.procs = {pid: self.procs.get(pid) or running[pid] for _, pid in noted
                          if pid in self.procs or pid in running}
        dead = [(w, pid) for w, pid in noted if not pid_alive(pid)]
        if not dead:
            return None
        return ", ".join(f"DataLoader worker {w} (pid {pid}, {self._how_it_ended(pid)})" for w, pid in dead)

    def _how_it_ended(self, pid: int) -> str:
        proc = self.procs.get(pid)
        code = proc.exitcode if proc is not None else None
        if code is None:
            return "exit status not seen"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code} before its shard ended"


def _context(context: object):
    """The multiprocessing context the DataLoader starts its workers with (its default: torch.multiprocessing's)."""
    if context is None:
        return torch.multiprocessing.get_context()
    if isinstance(context, str):
        return torch.multiprocessing.get_context(context)
    return context

