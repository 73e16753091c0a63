"""DynamicBatchLoader: online dynamic batching at the DataLoader boundary.

    loader = DynamicBatchLoader(dataset, token_budget=16384, num_workers=4)
    for batch in loader:
        info = pop_step_info(batch)
        scale_loss(model(**batch).loss, info).backward()

Mental model: plain DataLoader workers run the user's pipeline one sample at a time -> a collation thread
buffers samples, groups them under the budget, aligns group counts across ranks over a dedicated gloo group
(evenflow.planning.alignment), collates, and keeps up to ``depth`` batches ready -> the trainer pops them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from torch.utils.data import Dataset

from ..planning.alignment import AlignmentConfig, RankPlanner, config_fingerprint
from ..planning.grouping import CostModel, GroupingConfig, OversizePolicy
from ..planning.loss import LossTokenRule
from .collate import FlatCollate, PadCollate
from .collator import EpochPipeline, Handoff, Release, SampleSpec
from .comm import MetadataExchange, resolve_topology
from .source import StreamOptions, Streams, shard_indices
from .step_info import StepInfo

__all__ = ["DynamicBatchLoader", "LoaderConfig", "STATE_VERSION"]

logger = logging.getLogger("evenflow")

STATE_VERSION = 1
# How long close() waits for the collation thread beyond the exchange timeout before giving up on it.
_JOIN_MARGIN_S = 10.0


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """Everything that decides which samples form which batch (plus pipeline depth)."""

    grouping: GroupingConfig
    alignment: AlignmentConfig = field(default_factory=AlignmentConfig)
    seed: int = 0
    shuffle: bool = True
    depth: int = 4
    """Ready batches kept ahead of the trainer (back-pressure waits before a round, never inside it)."""
    grad_accum_steps: int = 1
    loss_tokens: LossTokenRule = field(default_factory=LossTokenRule)
    timeout: timedelta = timedelta(minutes=5)
    """Bound on every metadata exchange: a dead or stuck peer makes this rank raise after it."""
    balance: bool = False
    """Move samples between ranks' batches of each step so their costs match, and give ranks that would be
    IDLE real work (evenflow.runtime.balancing). Costs one more small exchange and one all-to-all per round."""

    def __post_init__(self) -> None:
        if not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"depth must be an integer >= 1, got {self.depth!r}")
        if not isinstance(self.grad_accum_steps, int) or self.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be an integer >= 1, got {self.grad_accum_steps!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")


class DynamicBatchLoader:
    """Token-budgeted batches formed after the real pipeline, step-aligned across data-parallel ranks.

    Guarantees (each tested with real gloo processes): every rank yields the same number of batches per
    epoch; with ``join=True`` every sample of the epoch is yielded exactly once across ranks (ranks that run
    dry yield IDLE batches); no batch exceeds a budget; ``scale_loss`` gives the exact global per-token
    loss; ``state_dict``/``load_state_dict`` resume without loss or repetition; errors on any rank end the
    epoch on every rank.

    Constructing a loader is a collective when ``torch.distributed`` is initialized and no
    ``process_group`` is given (it creates a gloo group): build it on every rank, in the same order.

    Datasets must not call ``torch.distributed`` inside ``__getitem__``/``__iter__``: workers started by
    spawn or forkserver have no process group. An ``IterableDataset`` is each rank's own stream (shard it
    by rank yourself, and by worker with ``get_worker_info()``); per-rank counts may differ.

    Memory: the buffer holds up to ``buffer_size`` processed samples per rank (host RAM ~ buffer_size x
    sample bytes; 4,096 chat samples of ~900 tokens with int64 ids and labels ~ 60 MB), plus up to
    ``depth + max_steps_per_round - 1`` collated batches. With ``num_workers > 0``, tensors under 1 MiB arrive
    pickled (copied into this process, NOTE [ Sample transport ] in source.py); larger ones (images, audio)
    stay in shared memory while buffered, so /dev/shm must hold the buffered large tensors plus
    ``prefetch_factor x num_workers`` in-flight samples.
    """

    def __init__(self, dataset: Dataset, *, token_budget: int, collate_fn: Callable | None = None,
                 num_workers: int = 0, join: bool = True, seed: int = 0, shuffle: bool = True,
                 buffer_size: int = 4096, depth: int = 4, cost: CostModel = "padded",
                 max_samples: int | None = None, extra_budgets: Mapping[str, int] | None = None,
                 oversize: OversizePolicy = "error", pad_to_multiple_of: int | None = None,
                 max_steps_per_round: int = 8, max_wait_rounds: int = 16, grad_accum_steps: int = 1,
                 length_fn: Callable | None = None, resources_fn: Callable | None = None,
                 loss_tokens: LossTokenRule | None = None, pad_token_id: int = 0,
                 prefetch_factor: int | None = None, persistent_workers: bool = False, pin_memory: bool = False,
                 multiprocessing_context: object = None, worker_init_fn: Callable | None = None,
                 process_group: object | None = None, timeout: timedelta = timedelta(minutes=5),
                 idle_sample: Mapping | None = None, balance: bool = False) -> None:
        grouping = GroupingConfig(token_budget=token_budget, cost=cost, max_samples=max_samples,
                                  extra_budgets=dict(extra_budgets or {}), oversize=oversize,
                                  pad_to_multiple_of=pad_to_multiple_of)
        alignment = AlignmentConfig(join=join, max_steps_per_round=max_steps_per_round,
                                    max_wait_rounds=max_wait_rounds, buffer_size=buffer_size)
        self.config = LoaderConfig(grouping=grouping, alignment=alignment, seed=seed, shuffle=shuffle, depth=depth,
                                   grad_accum_steps=grad_accum_steps, loss_tokens=loss_tokens or LossTokenRule(),
                                   timeout=timeout, balance=balance)
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        self.dataset = dataset
        if collate_fn is None:
            collate_cls = FlatCollate if cost == "summed" else PadCollate
            collate_fn = collate_cls(pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of)
        self.collate_fn = collate_fn
        self.spec = SampleSpec(length_fn=length_fn, resources_fn=resources_fn,
                               resource_names=tuple(grouping.extra_budgets), loss_rule=self.config.loss_tokens)
        self.streams = Streams(dataset, StreamOptions(
            num_workers=num_workers, prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory=pin_memory, multiprocessing_context=multiprocessing_context, worker_init_fn=worker_init_fn))
        self.topology = resolve_topology(process_group, timeout)
        self.exchange = MetadataExchange(self.topology)
        self.rank = self.topology.rank
        self.world_size = self.topology.world_size
        self.fingerprint = config_fingerprint(self.config.grouping, self.config.alignment, self.config.seed,
                                              self.config.shuffle, self.config.grad_accum_steps,
                                              self.config.loss_tokens, self.config.balance, self.world_size)
        self.idle_sample = idle_sample
        self._template: object | None = None
        self._epoch = 0
        self._pending_state: dict | None = None
        self._carry: list = []            # quota mode: keys carried into the current epoch (map-style)
        self._next_carry: list = []       # quota mode: keys the finished epoch leaves for the next one
        self._consumed: set = set()       # keys of completed accumulation windows, this epoch
        self._window_keys: list = []      # keys of the window in progress
        self._steps_done = 0              # steps yielded this epoch
        self._finished = False            # the current epoch ran to its end
        self._bound = -1                  # steps_bound of the last yielded batch
        self._pipeline: EpochPipeline | None = None
        self._handoff: Handoff | None = None
        self._planner: RankPlanner | None = None  # kept across epochs in quota mode (iterable carry)
        self._payloads: dict = {}
        self._iterable_stream: Iterator | None = None  # quota mode: the raw stream a carried epoch continues
        self._position = 0                # next stream position (iterable datasets)
        self._indices: list = []          # this epoch's index list (map-style)
        self.dropped: list = []
        """Keys removed under ``oversize="drop"`` (also logged and warned)."""

    # -- public API ----------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (map-style) and call ``dataset.set_epoch`` when the dataset has one."""
        state = self._pending_state
        if state is not None and epoch != state["epoch"]:
            if state["finished"] and epoch == state["epoch"] + 1:
                self._next_carry, self._finished = list(state["next_carry"]), True
            self._pending_state = None
        self._epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator:
        self._start_epoch()
        try:
            while True:
                kind, *payload = self._handoff.get(self._pipeline.is_alive)
                if kind == "batch":
                    release: Release = payload[0]
                    self._on_yield(release)
                    yield release.batch
                elif kind == "end":
                    self._finish_epoch()
                    return
                elif kind == "stopped":
                    return
                else:
                    raise payload[0]
        finally:
            self._stop_epoch()

    def __len__(self) -> int:
        """Upper bound on this epoch's steps, identical on every rank; tightens as the epoch runs.

        Trainers must stop on exhaustion, not on ``len``: the exact count depends on lengths not yet seen.
        """
        if self._bound >= 0:
            return self._bound
        if self.streams.iterable:
            raise TypeError("len() is unknown for an IterableDataset before its first batch; iterate to exhaustion")
        n = len(self.dataset)
        if self._carry or self._pending_state is not None:
            return 2 * n  # rank-local carry/resume state: only a rank-independent bound is safe here
        return -(-n // self.world_size)

    def close(self) -> None:
        """Stop the current epoch on every rank (coordinated through the protocol) and release workers."""
        self._stop_epoch()
        self._iterable_stream = None

    def __enter__(self) -> DynamicBatchLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        handoff = getattr(self, "_handoff", None)
        if handoff is not None:
            handoff.request_stop()

    def state_dict(self) -> dict:
        """Plain-data state at the last completed accumulation window of this rank (no collective).

        With ``grad_accum_steps > 1``, micro-steps of an unfinished window are not recorded: after a resume
        they are formed again (they never reached the optimizer).
        """
        return {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "world_size": self.world_size,
            "rank": self.rank,
            "token_budget": self.config.grouping.token_budget,
            "num_samples": None if self.streams.iterable else len(self.dataset),
            "join": self.config.alignment.join,
            "epoch": self._epoch,
            "finished": self._finished,
            "carry": list(self._carry),
            "next_carry": list(self._next_carry),
            "consumed": sorted(self._consumed),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Resume from :meth:`state_dict` (local to this rank). The next ``iter()`` continues that epoch."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}; it was saved by "
                             "an incompatible evenflow release")
        if state["world_size"] != self.world_size:
            raise ValueError(f"cannot resume: the state was saved with world_size={state['world_size']} but this "
                             f"job has {self.world_size}; each rank's shard would change. Resume with the same "
                             "data-parallel degree, or start the epoch afresh")
        if state["rank"] != self.rank:
            raise ValueError(f"state of rank {state['rank']} loaded on rank {self.rank}; load each rank's own state")
        if state["token_budget"] != self.config.grouping.token_budget:
            raise ValueError(f"cannot resume: token_budget changed from {state['token_budget']} to "
                             f"{self.config.grouping.token_budget}; resume with the saved budget")
        if state["fingerprint"] != self.fingerprint:
            raise ValueError("cannot resume: the loader configuration (seed, shuffle, budgets, buffer_size, join, "
                             "grad_accum_steps) differs from the saved one; use the saved configuration")
        if not self.streams.iterable and state["num_samples"] != len(self.dataset):
            raise ValueError(f"cannot resume: the dataset had {state['num_samples']} samples, now {len(self.dataset)}")
        if self.streams.iterable and not state["join"] and (state["carry"] or state["consumed"]):
            raise ValueError("cannot resume an IterableDataset in quota mode (join=False) mid-stream: its carried "
                             "samples live in memory only; resume at an epoch boundary or use join=True")
        self._stop_epoch()
        self._pending_state = dict(state)
        self._epoch = state["epoch"]

    # -- epoch lifecycle -----------------------------------------------------------------------------------
    def _start_epoch(self) -> None:
        self._stop_epoch()
        state, self._pending_state = self._pending_state, None
        if state is not None and not state["finished"]:
            carry, consumed = list(state["carry"]), set(state["consumed"])
        else:
            if state is not None:  # that epoch was complete: start the next pass with what it carried
                self._next_carry, self._finished = list(state["next_carry"]), True
            # Quota mode: a pass that ran to its end hands its leftovers to the next pass.
            carry, consumed = list(self._next_carry if self._finished else self._carry), set()
        self._carry, self._consumed, self._window_keys = carry, consumed, []
        self._steps_done, self._finished, self._bound, self._next_carry = 0, False, -1, []
        alignment = self.config.alignment
        keep_planner = not alignment.join and self.streams.iterable and self._planner is not None
        if not keep_planner:
            self._planner = RankPlanner(self.config.grouping, alignment, seed=self.config.seed)
            self._payloads = {}
        if self.streams.iterable:
            # Keys are stream positions; quota mode keeps counting across epochs so carried keys stay unique.
            if not keep_planner:
                self._position = 0
            fresh = self.streams.open()
            old = self._iterable_stream if keep_planner else None
            stream = _Numbered(self, _chain(old, fresh) if old is not None else fresh)
            total, skip = None, frozenset(consumed)
        else:
            shard = shard_indices(len(self.dataset), rank=self.rank, world_size=self.world_size, epoch=self._epoch,
                                  seed=self.config.seed, shuffle=self.config.shuffle)
            carried = set(carry)
            indices = [i for i in carry + [i for i in shard if i not in carried] if i not in consumed]
            stream = self.streams.open(indices)
            total, skip = len(indices), frozenset()
            self._indices = indices
        self._iterable_stream = stream.raw if self.streams.iterable else None
        self._handoff = Handoff()
        self._pipeline = EpochPipeline(
            planner=self._planner, stream=stream, total=total, skip=skip, exchange=self.exchange,
            fingerprint=self.fingerprint, spec=self.spec, collate_fn=self.collate_fn, handoff=self._handoff,
            epoch=self._epoch, depth=self.config.depth, grad_accum_steps=self.config.grad_accum_steps,
            payloads=self._payloads, template=self._idle_template, on_first_sample=self._remember_template,
            rebalancer=self._rebalancer())
        self._pipeline.start()

    def _on_yield(self, release: Release) -> None:
        info: StepInfo = release.info
        self._steps_done += 1
        self._bound = max(info.steps_bound, self._steps_done)
        self._window_keys.extend(release.keys)
        if info.window_end:
            self._consumed.update(self._window_keys)
            self._window_keys = []

    def _finish_epoch(self) -> None:
        self._finished = True
        planner = self._planner
        self.dropped.extend(k for k in planner.dropped if k not in self.dropped)
        if self.config.alignment.join:
            self._next_carry = []
            return
        # Quota mode: what this rank did not yield goes first next epoch (NOTE [ Termination ]).
        if self.streams.iterable:
            self._next_carry = [it.key for it in planner.buffer]
        else:
            pipeline = self._pipeline
            self._next_carry = [it.key for it in planner.buffer] + self._indices[pipeline.pulled:]
            logger.debug("evenflow quota mode: rank %d carries %d samples into the next epoch", self.rank,
                         len(self._next_carry))

    def _stop_epoch(self) -> None:
        pipeline, handoff = self._pipeline, self._handoff
        if pipeline is None:
            return
        handoff.request_stop()
        pipeline.join(self.config.timeout.total_seconds() + _JOIN_MARGIN_S)
        if pipeline.is_alive():
            logger.warning("evenflow: the collation thread of rank %d did not stop within the timeout; a peer "
                           "rank is probably no longer iterating", self.rank)
        self._pipeline = None
        self._handoff = None
        if not self.streams.iterable or self.config.alignment.join:
            self._iterable_stream = None

    def _rebalancer(self):
        if not self.config.balance:
            return None
        from .balancing import StepRebalancer  # imports evenflow.balance (scipy) only when asked for
        return StepRebalancer(self.exchange, self.config.grouping, self._payloads, pair_keys=self.streams.iterable)

    # -- IDLE batches --------------------------------------------------------------------------------------
    def _remember_template(self, sample: object) -> None:
        if self._template is None:
            self._template = sample

    def _idle_template(self) -> object:
        """A real sample to collate for IDLE steps (its loss is scaled by 0, so its labels stay real)."""
        if self._template is not None:
            return self._template
        if self.idle_sample is not None:
            return self.idle_sample
        if not self.streams.iterable and len(self.dataset) > 0:
            self._template = self.dataset[0]
            return self._template
        raise RuntimeError(f"rank {self.rank} must emit an IDLE batch but never received a sample (its "
                           "IterableDataset stream was empty); pass idle_sample={...} to DynamicBatchLoader")


def _chain(first: Iterator, second: Iterator) -> Iterator:
    yield from first
    yield from second


class _Numbered:
    """``(position, sample)`` over a raw stream, positions drawn from the loader's running counter."""

    def __init__(self, loader: DynamicBatchLoader, raw: Iterator) -> None:
        self.loader = loader
        self.raw = raw

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> tuple:
        sample = next(self.raw)
        key = self.loader._position
        self.loader._position += 1
        return key, sample
