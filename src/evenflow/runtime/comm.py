"""The one module that talks to torch.distributed for the loader's metadata.

Rank, world size and the gloo group are resolved once here, on the constructing thread, and then passed
around as plain values. Every collective names its group, and its tensors are freed on the calling thread, never
by the backend's worker thread ([`release()`][release], NOTE [ Exit-time teardown ] in teardown.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .teardown import close_at_exit

__all__ = ["Topology", "resolve_topology", "PeerTable", "MetadataExchange", "PlanningGroups", "planning_groups",
           "TwoLevelExchange", "pid_alive", "release", "sum_over"]

logger = logging.getLogger("evenflow")

# A backend's worker thread drops a finished collective's tensors microseconds after the caller wakes -- or, on
# a loaded machine, a little later; this only bounds the wait if it somehow does not (NOTE [ Exit-time
# teardown ], case 2).
_RELEASE_BOUND_S = 5.0
# How many exchanges' tensors a MetadataExchange keeps before freeing the oldest, and how many bytes at most beside
# the newest exchange's (global planning gathers every buffered sample's metadata: MBs at 64 ranks).
_HELD_EXCHANGES = 4
_HELD_BYTES = 1 << 20


class _Marker:
    """A value in a worker thread's thread-local storage: freed when that thread's Python thread state ends."""


def release(buffers: list) -> None:
    """Empty ``buffers`` -- the tensors a collective that returned was given, referenced nowhere else -- and wait
    until whichever thread frees them is done with Python.

    Usually this thread frees them here. But the process group's worker thread may still hold the finished work:
    torch then keeps the tensors' Python objects alive from C++, and the worker frees them -- taking the GIL,
    dropping it while torch frees the storage, taking it back -- under a temporary Python thread state. Were the
    interpreter to begin finalizing meanwhile, the worker would be ended inside a C++ destructor and the process
    would abort (NOTE [ Exit-time teardown ], case 2). So a tensor freed on another thread counts as released
    once that thread's thread state is cleared: a marker put in its thread-local storage is freed then. No tensor
    is ever dereferenced through the weak references (torch warns on a dereferenced one it frees from C++).
    """
    waiter = threading.get_ident()
    cond = threading.Condition()
    left = [len(buffers)]
    local = threading.local()
    markers: list[weakref.ref] = []

    def settled(_ref: weakref.ref | None = None) -> None:
        with cond:
            left[0] -= 1
            cond.notify_all()

    def freed(_ref: weakref.ref) -> None:
        if threading.get_ident() == waiter:  # freed by buffers.clear() below
            settled()
            return
        marker = _Marker()
        markers.append(weakref.ref(marker, settled))
        local.markers = [*getattr(local, "markers", ()), marker]

    refs = [weakref.ref(t, freed) for t in buffers]
    buffers.clear()
    deadline = time.monotonic() + _RELEASE_BOUND_S
    with cond:
        while left[0] > 0 and (wait := deadline - time.monotonic()) > 0:
            cond.wait(wait)
        late = left[0]
    if late:
        logger.debug("evenflow: %d tensor(s) of a collective were not released by its worker thread within %.0f s",
                     late, _RELEASE_BOUND_S)
    del refs, markers


def sum_over(value: float, group: object | None) -> float:
    """``value`` summed over the ranks of ``group`` (the default group when None; a CPU backend such as gloo) in
    float64, its tensor released before it returns ([`release()`][release]); collective."""
    buffers = [torch.tensor(value, dtype=torch.float64)]
    dist.all_reduce(buffers[0], group=group)
    total = float(buffers[0])
    release(buffers)
    return total


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    group: object | None
    """The gloo process group for metadata (None when world_size == 1 and no group was given)."""


def resolve_topology(process_group: object | None, timeout: timedelta) -> Topology:
    """Resolve rank, world size and the metadata group. Collective when it creates a group.

    Constructing a loader in a distributed job therefore must happen on every rank, in the same order
    (like any ``new_group``). A passed ``process_group`` is used as is; it must support CPU tensors (gloo).
    """
    if process_group is not None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("process_group was given but torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group first")
        return Topology(dist.get_rank(process_group), dist.get_world_size(process_group), process_group)
    if not dist.is_available() or not dist.is_initialized():
        return Topology(0, 1, None)
    if dist.get_world_size() == 1:
        return Topology(0, 1, None)
    # A dedicated gloo group: metadata stays on CPU and off the training (NCCL) group, and a timeout bounds
    # every wait (new_group's default would wait 30 minutes).
    group = dist.new_group(backend="gloo", timeout=timeout)
    return Topology(dist.get_rank(group), dist.get_world_size(group), group)


# How long a failed exchange keeps looking for a peer on this host that is exiting (see PeerTable.who_died).
_EXIT_SETTLE_S = 1.0


class PeerTable:
    """``(pid, host)`` of every rank of the metadata group, from the first round's reports.

    One table is shared by every exchange of a loader (the flat or two-level world exchange, the planning
    group's exchange, the sample all-to-alls), so whichever collective a dead peer breaks, the error names
    it: gloo's own error names no rank ("Connection closed by peer [10.0.0.7]:41532").
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        """This rank in the metadata group: its row of the table, and the rank the errors name."""
        self.rows: list[tuple[int, int]] | None = None

    @property
    def known(self) -> bool:
        return self.rows is not None

    def note(self, pids: np.ndarray, hosts: np.ndarray) -> None:
        self.rows = list(zip(pids.tolist(), hosts.tolist()))

    def failure(self, what: str, exc: BaseException) -> RuntimeError:
        """The error to raise when ``what`` (a collective) failed with ``exc``."""
        return RuntimeError(
            f"evenflow: rank {self.rank}'s {what} failed ({type(exc).__name__}: {exc}). {self.who_died()} Check "
            "the other ranks' logs (a rank that failed prints its own error)")

    def who_died(self) -> str:
        """Name the dead ranks among those on this host; ranks on other hosts cannot be checked from here."""
        generic = "A peer rank most likely died, stopped iterating its loader, or built a different loader."
        if not self.rows:
            return generic
        me, rows = self.rank, self.rows
        host = rows[me][1]
        local = [r for r, (pid, h) in enumerate(rows) if r != me and h == host and pid > 0]
        # A dying process closes its sockets (gloo's error) a moment before the kernel marks it exited, so an
        # empty answer is checked again for a bounded while: this runs only on a failed exchange.
        deadline = time.monotonic() + _EXIT_SETTLE_S
        while not (dead := [r for r in local if not pid_alive(rows[r][0])]) and local and time.monotonic() < deadline:
            time.sleep(0.05)
        remote = [r for r, (_, h) in enumerate(rows) if h != host]
        if dead:
            return (f"Rank(s) {dead} (pid {[rows[r][0] for r in dead]}) are no longer running: they died (killed, "
                    "out of memory, or exited) during the epoch.")
        tail = f"; ranks {remote} are on other hosts and could not be checked" if remote else ""
        return (f"Every rank on this host is still running{tail}: a peer most likely stopped iterating its loader "
                "(or is stuck in its own code) without closing it.")


class MetadataExchange:
    """Fixed-size int64 all_gather over the metadata group (identity when world_size == 1).

    ``peers``: the loader's shared [`PeerTable`][PeerTable] (an exchange over a sub-group passes the world one, so
    its errors name world ranks); a new one for ``topology.rank`` by default.
    """

    def __init__(self, topology: Topology, peers: PeerTable | None = None) -> None:
        self.topology = topology
        self.peers = peers if peers is not None else PeerTable(topology.rank)
        self._held: deque[list] = deque()
        """The last exchanges' tensors, freed a few exchanges later or at exit (NOTE [ Exit-time teardown ])."""
        self._held_bytes: deque[int] = deque()
        close_at_exit(self, after_loaders=True)

    def close(self) -> None:
        """Free the last exchanges' tensors, waiting for the process group's worker to have dropped them (at
        interpreter exit, once every loader's epoch is closed; the next exchange would allocate new ones)."""
        while self._held:
            self._release_oldest()

    def __del__(self) -> None:
        # Freed before exit -- a script's loader is often a local of a function that returns just before the
        # interpreter exits, taking its exchange with it, and the weak registration then closes nothing: the last
        # exchange's tensors are released here, waiting for the group's worker as close() does (measured: the
        # loader's last exchange aborted 2 runs in 21 of benchmarks/exit_repro.py without this).
        if getattr(self, "_held", None):
            self.close()

    def _hold(self, buffers: list) -> None:
        """Keep ``buffers`` (the only references to a finished collective's tensors) for
        [`_HELD_EXCHANGES`][_HELD_EXCHANGES] exchanges (fewer when the older ones pass [`_HELD_BYTES`][_HELD_BYTES]): by
        then the group's worker threads have long dropped the work that held them too, so they are freed on this thread
        and no worker needs the GIL for them ([`release()`][release] waits for one that still does)."""
        self._held.append(buffers)
        self._held_bytes.append(sum(t.numel() * t.element_size() for t in buffers))
        while len(self._held) > 1 and (len(self._held) > _HELD_EXCHANGES or sum(self._held_bytes) > _HELD_BYTES):
            self._release_oldest()

    def _release_oldest(self) -> None:
        self._held_bytes.popleft()
        release(self._held.popleft())

    @contextmanager
    def guarded(self, what: str) -> Iterator[None]:
        """Raise a collective's failure inside the block as ``peers.failure(what, ...)``."""
        try:
            yield
        except Exception as exc:  # gloo raises RuntimeError/DistBackendError on timeouts and dead peers
            raise self.peers.failure(what, exc) from exc

    def all_gather(self, row: np.ndarray) -> np.ndarray:
        """``row`` (1-D int64, same size on every rank) -> ``[world_size, size]``."""
        row = np.ascontiguousarray(row, dtype=np.int64)
        if self.topology.world_size == 1:
            return row[None].copy()
        buffers = [torch.from_numpy(row), *(torch.empty(row.shape, dtype=torch.int64)
                                            for _ in range(self.topology.world_size))]
        with self.guarded("metadata exchange"):
            dist.all_gather(buffers[1:], buffers[0], group=self.topology.group)
        self._hold(buffers)
        return torch.stack(buffers[1:]).numpy()


def pid_alive(pid: int) -> bool:
    """Is process ``pid`` running (a zombie -- exited, not yet reaped -- is not)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) still answers kill(pid, 0)
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


# -- planning groups (planning="global"): a metadata exchange within each group, and one across groups ------
@dataclass(frozen=True)
class PlanningGroups:
    """Consecutive blocks of ``size`` ranks of the metadata group (the last may be smaller)."""

    inner: Topology
    """This rank inside its planning group (the whole metadata group when there is one group)."""
    index: int
    """Which planning group this rank is in."""
    starts: tuple[int, ...]
    """First rank of every planning group (ranks of the metadata group)."""
    leaders: object | None
    """gloo group of the first rank of every planning group (None with one group)."""


def planning_groups(topology: Topology, size: int, timeout: timedelta) -> PlanningGroups:
    """Build the planning groups; collective over the metadata group when there is more than one group
    (every rank creates every group, in the same order, as ``new_group`` requires)."""
    world = topology.world_size
    starts = tuple(range(0, world, size))
    index = topology.rank // size
    if len(starts) == 1:
        return PlanningGroups(topology, 0, starts, None)
    members = [list(range(s, min(s + size, world))) for s in starts]
    to_global = [dist.get_global_rank(topology.group, r) for r in range(world)]
    mine = None
    for g, ranks in enumerate(members):
        pg = dist.new_group([to_global[r] for r in ranks], backend="gloo", timeout=timeout)
        if g == index:
            mine = pg
    leaders = dist.new_group([to_global[s] for s in starts], backend="gloo", timeout=timeout)
    inner = Topology(topology.rank - starts[index], len(members[index]), mine)
    return PlanningGroups(inner, index, starts, leaders)


class TwoLevelExchange(MetadataExchange):
    """The same ``[world_size, size]`` result as [`MetadataExchange`][MetadataExchange], gathered in two levels.

    A ring all_gather over W ranks takes W - 1 hops; this takes (k - 1) inside the planning group, then
    (W/k - 1) among the group leaders, then a broadcast inside the group (log2 k hops): at 2,560 ranks in
    groups of 64, ~110 hops instead of 2,559 (benchmarks/bench_gloo.py measures and models it).
    """

    def __init__(self, topology: Topology, groups: PlanningGroups) -> None:
        super().__init__(topology)
        self.groups = groups
        self.inner = MetadataExchange(groups.inner, self.peers)
        self._leader = dist.get_global_rank(topology.group, groups.starts[groups.index])

    def all_gather(self, row: np.ndarray) -> np.ndarray:
        row = np.ascontiguousarray(row, dtype=np.int64)
        g, world = self.groups, self.topology.world_size
        block = self.inner.all_gather(row)  # [k, size] of this planning group
        widest = max(b - a for a, b in zip(g.starts, g.starts[1:] + (world,)))
        buffers = [torch.empty((world, row.size), dtype=torch.int64)]
        table = buffers[0]
        with self.guarded("two-level metadata exchange"):
            if g.inner.rank == 0:
                buffers.append(torch.zeros((widest, row.size), dtype=torch.int64))
                buffers[-1][:len(block)] = torch.from_numpy(block)
                out = [torch.empty_like(buffers[-1]) for _ in g.starts]
                dist.all_gather(out, buffers[-1], group=g.leaders)
                for s, start in enumerate(g.starts):
                    end = g.starts[s + 1] if s + 1 < len(g.starts) else world
                    table[start:end] = out[s][:end - start]
                buffers.extend(out)
                del out
            dist.broadcast(table, src=self._leader, group=g.inner.group)
        self._hold(buffers)
        return table.numpy().copy()
