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
import os
import warnings
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from functools import partial

from torch.utils.data import Dataset

from ...planning.alignment import NO_VALUE, RankPlanner, config_fingerprint
from ...planning.grouping import CostModel, OversizePolicy
from ...planning.loss import LossTokenRule
from ...planning.timecost import TimeCost
from ..collator import EpochPipeline, Handoff, Release, SampleSpec, default_batch_check
from ..comm import resolve_topology
from ..epoch_plan import PlannedLengths
from ..mesh import PeerAgreement, mesh_release, resolve_mesh, shard_length_fn, shard_lengths
from ...errors import sample_of
from ..planning import PlanningChoice, setup_planning
from ..resume import key_order
from ..resume_print import ResumePrint, resume_print
from ..shard_check import ContentPrint, content_print
from ..source import StreamOptions, Streams, shard_indices
from ...step_info import LoaderTerms, StepInfo, UsageCheck, UsageTracker
from ..prefetch import StepPrefetch, bind_prefetch, check_prefetch
from ..stream_check import StreamCheck, StreamWindow, window_size
from ..teardown import close_at_exit, forget_at_exit
from ..transfer import Moves
from ..samples import unpadded
from .config import (LoaderConfig, _check_workers, _default_collate, _encoder_budgets, _loader_config,
                     _media_resources_fn, _unknown_arguments)
from .idle import IdleTemplate
from .keys import StreamPosition, _carried, _continued, _fetch_error, _Keyed, _Numbered
from .state import STATE_VERSION, ResumeContext, _fingerprint, config_values, discarded, resume_state

__all__ = ["DynamicBatchLoader", "LoaderConfig", "STATE_VERSION"]

logger = logging.getLogger("evenflow")

# How long close() waits for the collation thread beyond the exchange timeout before giving up on it.
_JOIN_MARGIN_S = 10.0
# Inside `with loader:`, how long a closed iterator waits for __exit__ to say whether an exception ended
# the loop (then peers raise PeerError) before it reports a plain STOP (NOTE [ Early stops ]).
_EXIT_GRACE_S = 2.0


class DynamicBatchLoader:
    """Token-budgeted batches formed after the real pipeline, step-aligned across data-parallel ranks.

    Guarantees (each tested with real gloo processes): every rank yields the same number of batches per
    epoch; with ``join=True`` every sample of the epoch is yielded exactly once across ranks (ranks that run
    dry yield IDLE batches); no batch exceeds a budget; ``scale_loss`` gives the exact global per-token
    loss; ``state_dict``/``load_state_dict`` resume without loss or repetition (on another number of ranks
    too, from the list of every rank's state: NOTE [ Re-dealing a resumed epoch ]); errors on any rank end the
    epoch on every rank within one round (peers raise [`evenflow.PeerError`][evenflow.PeerError]; a rank that leaves its
    loop early makes peers raise [`evenflow.PeerStopped`][evenflow.PeerStopped], NOTE [ Early stops ] in
    evenflow/errors.py). Use ``with loader:`` (or ``loader.close(exc)``) so that a trainer exception reaches peers as an
    error.

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

    Arguments (keyword-only after ``dataset``; there is no ``batch_size``: the budget sizes batches). They come
    in seven concerns, in this order in the signature. At construction, unknown names are refused first (naming
    the evenflow name of a DataLoader argument), then what decides batches becomes one frozen, validated
    [`LoaderConfig`][LoaderConfig] (``grouping``, ``alignment``, ...; evenflow.runtime.loader.config), then the workers'
    arguments are checked.

    *What one batch may hold* ([`GroupingConfig`][evenflow.planning.grouping.GroupingConfig]):

    - ``token_budget``: the cost one batch may have on one rank: padded tokens (rows x longest) under
      ``cost="padded"``, summed tokens under ``cost="summed"``.
    - ``cost``: ``"padded"`` or ``"summed"`` (padding-free; switches the default collate to ``FlatCollate``).
    - ``max_samples``: cap on samples per batch (``None``: no cap).
    - ``max_encoder_rows``: the vision encoder's budget, patch rows before merging per batch (what
      ``pixel_values`` holds: ``t * h * w`` summed over ``image_grid_thw`` and ``video_grid_thw``), read off each
      sample's grids; give [`evenflow.vlm.VLMConfig`][evenflow.vlm.VLMConfig] the same ``max_encoder_rows`` (a step
      refuses a loader with another one before it trains).
    - ``extra_budgets``: further per-batch budgets, e.g. ``{"num_frames": 3000}``; values come from
      ``resources_fn``, else the sample keys of that name (``num_patches`` and ``num_frames`` are read off the
      grids and audio clips when a sample has no such key).
    - ``oversize``: a sample over a budget on its own: ``"error"`` (default), ``"alone"`` (its own batch) or
      ``"drop"`` (removed, counted in [`dropped`][dropped]).
    - ``pad_to_multiple_of``: round each batch's padded length up (the planner costs the rounded shape).
    - ``length_fn``: ``sample -> int`` cost length (default ``len(sample["input_ids"])``). A sample a processor
      padded (zeros in its ``attention_mask``, left or right) is first cut to its real tokens: it trains and
      costs what its unpadded form does.
    - ``resources_fn``: ``sample -> {name: int}`` for ``extra_budgets``.

    *How a batch is built*:

    - ``collate_fn``: turns a list of samples into a batch dict; default [`PadCollate`][PadCollate] (padded) or
      [`FlatCollate`][FlatCollate] (summed). The loader adds the StepInfo after it.
    - ``pad_token_id``: padding id for the default collate.
    - ``idle_sample``: a sample to collate for IDLE batches when a rank never saw one (empty iterable streams;
      evenflow.runtime.loader.idle).

    *The epoch*:

    - ``dataset``: map-style ``Dataset`` (sharded across ranks by the loader) or ``IterableDataset`` (each rank's
      own stream). Samples are mappings with ``input_ids`` and optional ``labels``.
    - ``join``: ``True`` -- each sample of the epoch exactly once across ranks, ranks that run dry yield IDLE
      batches; ``False`` -- quota mode: leftovers carry over into the next epoch.
    - ``seed``, ``shuffle``: the per-epoch shuffle of the map-style index order (``set_epoch`` reseeds).
    - ``lengths``: every sample's length as the loader measures it (``length_fn``, default ``len(input_ids)``),
      known before the epoch -- a dataset column, or `evenflow.dataset_lengths()` (an HF
      dataset's Arrow offsets, or one pass); a mapping ``{"tokens": ..., name: ...}`` adds ``extra_budgets``
      values. ``len(loader)`` is then each epoch's exact step count, before and during it (NOTE [ The planned
      epoch length ] in epoch_plan.py: what it covers and costs); every batch checks the lengths it was planned
      with. Map-style datasets only.
    - ``shard_check``: refuse, in an epoch's first rounds, a map-style dataset already split per rank (the ranks'
      few items differ in token content, or change between reads) and IterableDataset streams that are not
      (the ranks' first samples overlap far beyond natural repeats); ``False`` turns both checks off, for a
      whole dataset whose token augmentation depends on the rank or changes on every read, or overlapping
      streams by design (NOTE [ Sharding mistakes ] in evenflow.runtime.shard_check; docs/mistakes.md).

    *Planning across ranks* ([`AlignmentConfig`][evenflow.planning.alignment.AlignmentConfig] and the policy):

    - ``planning``: ``"local"`` (each rank groups its own buffer), ``"global"`` (a planning group's ranks group
      the union of their buffers' metadata; subsumes ``balance``) or ``"auto"`` (default): ``"global"`` when
      2 <= world size <= 64 (or ``planning_group`` is given) and ``balance=False``, else ``"local"`` --
      decided once at construction from these arguments alone, so every rank resolves the same policy;
      [`planning`][planning] is the resolved one. ``balance=True`` with ``"auto"`` runs the local policy with its
      rebalancer; ``planning="global", balance=True`` is refused. See [`LoaderConfig`][LoaderConfig]. Global steps pack
      tightest, each mixing length strata, in no length curriculum; what they trained in the demo's replay
      (not yet as well as random batches everywhere) is on the page "What the default trains".
    - ``planning_group``: ranks per planning group under global planning (``None``: all ranks up to 64, else
      blocks of 8).
    - ``balance``: even out per-step costs across ranks by moving samples (one all-to-all per round). Under
      ``balance=True`` and ``planning="global"`` a sample may train on another rank: it moves as its tensors'
      own bytes plus a pickle of the rest ([`moves`][moves] counts them; the ranks of a job must trust each
      other's pickles: the failures page, "Trust model").
    - ``buffer_size``: processed samples buffered per rank before grouping (more: fuller batches, more RAM;
      the default policy mixes lengths within each step and emits no length curriculum at any size -- the page
      "What the default trains").
    - ``max_steps_per_round``: most batches one alignment round emits per rank.
    - ``time_cost``: what global planning balances across a step's ranks, a
      [`TimeCost`][evenflow.planning.timecost.TimeCost] (``None``: padded tokens under ``cost="padded"``, a
      per-sequence ``L + L^2 / 24,576`` summed over each pack under ``cost="summed"``, NOTE [ The default time
      cost ]); ``TimeCost.from_model(model.config)`` counts a model's FLOPs, ``evenflow profile`` prints it. With
      ``grad_accum_steps > 1`` each micro-batch is balanced, which balances the step too (NOTE [ Packed steps
      balanced on time ]).
    - ``max_wait_rounds``: rounds after which a buffered sample is prioritized. Not the wait's bound: that is
      ``max_wait_rounds + buffer_size - 1`` rounds under local planning and ``max_wait_rounds`` plus the
      samples buffered over all ranks under global (one old step leaves a round; NOTE [ Bounded waiting ]).
    - ``depth``: ready batches kept ahead of the trainer.

    *The optimizer step*:

    - ``grad_accum_steps``: micro-batches per optimizer step; ``loss_scale`` spans the whole window (and the
      default policy orders a round's steps for it: NOTE [ Round order ]).
    - ``loss_tokens``: [`LossTokenRule`][evenflow.LossTokenRule] -- which labels count as supervised (shift, ignore
      index).
    - ``usage_check``: ``"taken"`` (default) raises [`StepInfoMisuse`][evenflow.errors.StepInfoMisuse] a few
      fetches after a batch whose StepInfo was never popped; ``"scaled"`` also requires ``scale_loss`` (or
      ``info.mark_scaled()``); ``"off"`` disables the check (NOTE [ Misuse is loud ]).

    *DataLoader workers*:

    - ``num_workers``, ``prefetch_factor``, ``persistent_workers``, ``pin_memory``, ``multiprocessing_context``,
      ``worker_init_fn``: as in ``torch.utils.data.DataLoader``, for the workers that run the dataset one sample
      at a time.
    - ``worker_timeout``: bound on every wait for a DataLoader worker's next sample (a blocked ``__getitem__``)
      and on every call into user code on the collation thread (``collate_fn``, ``length_fn``,
      ``resources_fn``, ``__getitem__`` with ``num_workers=0``); the rank then raises naming the call and the
      sample, and its peers raise ``PeerError`` in the same round. A worker that dies (the OOM killer) is
      reported within about a second. Must be below ``timeout`` so the report reaches peers first (with
      ``num_workers=0`` a larger one is cut to ``timeout / 2``); raise both for slow decoding.

    *The ranks*:

    - ``process_group``: the gloo group for the metadata exchange (default: a new gloo group over the world).
    - ``timeout``: bound on every metadata exchange; a dead peer makes this rank raise after it.
    - ``mesh``, ``dp_dims``, ``cp_dim`` / ``sp_dim``, ``parallelism_config``: a ``DeviceMesh`` (or accelerate's
      ``ParallelismConfig``) with context- or sequence-parallel ranks (evenflow.runtime.mesh): the loader plans
      over the data-parallel dims, every CP/SP peer gets the same shard-ready batch (checked every batch), the
      budget is per data-parallel group, and ``StepInfo`` counts the loss over the whole mesh. Split a batch
      with [`evenflow.shard_batch()`][evenflow.shard_batch] (docs/long-context.md).
    """

    def __init__(self, dataset: Dataset, *,
                 # what one batch may hold
                 token_budget: int, cost: CostModel = "padded", max_samples: int | None = None,
                 extra_budgets: Mapping[str, int] | None = None, oversize: OversizePolicy = "error",
                 pad_to_multiple_of: int | None = None, length_fn: Callable | None = None,
                 resources_fn: Callable | None = None, max_encoder_rows: int | None = None,
                 # how a batch is built
                 collate_fn: Callable | None = None, pad_token_id: int = 0, idle_sample: Mapping | None = None,
                 # the epoch
                 join: bool = True, seed: int = 0, shuffle: bool = True,
                 lengths: Sequence[int] | Mapping[str, Sequence[int]] | None = None, shard_check: bool = True,
                 # planning across ranks
                 planning: PlanningChoice = "auto", planning_group: int | None = None, balance: bool = False,
                 buffer_size: int = 4096, max_steps_per_round: int = 8, max_wait_rounds: int = 16, depth: int = 4,
                 time_cost: TimeCost | None = None,
                 # the optimizer step
                 grad_accum_steps: int = 1, loss_tokens: LossTokenRule | None = None,
                 usage_check: UsageCheck = "taken",
                 # DataLoader workers
                 num_workers: int = 0, prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory: bool = False, multiprocessing_context: object = None,
                 worker_init_fn: Callable | None = None, worker_timeout: timedelta = timedelta(minutes=4),
                 # the ranks
                 process_group: object | None = None, timeout: timedelta = timedelta(minutes=5),
                 mesh: object = None, dp_dims: str | Sequence[str] | None = None, cp_dim: str | None = None,
                 sp_dim: str | None = None, parallelism_config: object = None,
                 **unknown: object) -> None:
        if unknown:
            raise TypeError(_unknown_arguments(unknown))
        self.mesh = resolve_mesh(mesh=mesh, parallelism_config=parallelism_config, dp_dims=dp_dims, cp_dim=cp_dim,
                                 sp_dim=sp_dim, process_group=process_group, timeout=timeout)
        """Where this rank sits on the mesh (``MeshPlacement``; ``None`` without ``mesh=``): ``shard_batch``'s
        argument."""
        shard = None if self.mesh is None else self.mesh.layout
        process_group = process_group if self.mesh is None else self.mesh.dp_group
        length_fn, lengths = shard_length_fn(length_fn, shard), shard_lengths(lengths, shard)
        extra_budgets = _encoder_budgets(extra_budgets, max_encoder_rows)
        resources_fn = _media_resources_fn(resources_fn, extra_budgets, derive=max_encoder_rows is not None)
        self.config = _loader_config(
            token_budget=token_budget, cost=cost, max_samples=max_samples, extra_budgets=extra_budgets,
            oversize=oversize, pad_to_multiple_of=pad_to_multiple_of, join=join,
            max_steps_per_round=max_steps_per_round, max_wait_rounds=max_wait_rounds, buffer_size=buffer_size,
            seed=seed, shuffle=shuffle, depth=depth, grad_accum_steps=grad_accum_steps, loss_tokens=loss_tokens,
            timeout=timeout, balance=balance, planning=planning, planning_group=planning_group,
            time_cost=time_cost, shard=shard)
        _check_workers(num_workers, worker_timeout, timeout)
        self.worker_timeout = worker_timeout
        self.num_workers = num_workers
        self.dataset = dataset
        self.collate_fn = (_default_collate(cost, pad_token_id, pad_to_multiple_of, shard) if collate_fn is None
                           else collate_fn)
        # The default collates build what the planner costs: a larger batch is a length_fn that under-reports.
        self._check_batch = default_batch_check(self.config.grouping) if collate_fn is None else None
        self.spec = SampleSpec(length_fn=length_fn, resources_fn=resources_fn,
                               resource_names=tuple(self.config.grouping.extra_budgets),
                               loss_rule=self.config.loss_tokens)
        self.streams = Streams(dataset, StreamOptions(
            num_workers=num_workers, prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory=pin_memory, multiprocessing_context=multiprocessing_context, worker_init_fn=worker_init_fn,
            timeout=worker_timeout.total_seconds() if num_workers > 0 else 0))
        self.topology = resolve_topology(process_group, timeout)
        self.rank, self.world_size = self.topology.rank, self.topology.world_size
        # Resolves planning="auto" (NOTE [ The default planning policy ]). Collective when the policy is "global"
        # with more than one planning group (it creates their gloo groups).
        self._planning = setup_planning(planning, planning_group, self.topology, timeout, balance=balance)
        self.planning = self._planning.policy
        """The planning policy this loader runs: ``"local"`` or ``"global"`` (``"auto"`` resolved)."""
        self.exchange = self._planning.exchange
        # The resolved policy, not "auto": a state saved under one policy never resumes under the other.
        self.fingerprint = _fingerprint(self.config, self.world_size, self.planning, self._planning.size)
        self._idle = IdleTemplate(dataset=dataset, idle_sample=idle_sample, token_budget=token_budget, rank=self.rank,
                                  iterable=self.streams.iterable)
        self._init_state()
        self.dropped: list = []
        """Keys removed under ``oversize="drop"`` (each also warned once)."""
        if not isinstance(shard_check, bool):
            raise ValueError(f"shard_check must be True or False, got {shard_check!r}")
        self.shard_check = shard_check
        self._content: ContentPrint | None = None  # NOTE [ Sharding mistakes ]: read once per loader, on demand
        self._data_print: ResumePrint | None = None  # NOTE [ The resume fingerprint ]: likewise
        # Iterable streams: the unsplit-stream check, run once per loader (NOTE [ Sharding mistakes ]).
        self._stream_check = (StreamCheck(window_size(self.config.alignment.buffer_size), self.world_size)
                              if self.streams.iterable and shard_check and self.world_size > 1 else None)
        # NOTE [ The planned epoch length ] in epoch_plan.py
        self._lengths = None if lengths is None else PlannedLengths(
            lengths, num_samples=None if self.streams.iterable else len(dataset), config=self.config,
            world_size=self.world_size, planning=self.planning, group_size=self._planning.size or self.world_size)
        self.moves = Moves()
        """Samples (and bytes) this rank sent to peers: under ``planning="global"`` or ``balance=True`` a sample
        may train on another rank (NOTE [ Moved samples ] in evenflow/runtime/transfer.py)."""
        self._usage = UsageTracker(usage_check, lag=grad_accum_steps + 1)  # NOTE [ Misuse is loud ]
        self._agreement = PeerAgreement(self.mesh) if self.mesh and len(self.mesh.peer_ranks) > 1 else None
        self.terms = LoaderTerms(max_encoder_rows=extra_budgets.get("num_patches"),
                                 timeout_s=timeout.total_seconds())
        """What a step consuming these batches must agree with; every StepInfo carries it (``loader_terms``)."""
        self._step_prefetch: StepPrefetch | None = None  # NOTE [ Per-step prefetch ] in prefetch.py

    def set_step_prefetch(self, prefetch: StepPrefetch | None) -> None:
        """Run ``prefetch(batch, info, group)`` on the collation thread for every batch, before it is handed over
        -- step s+1's while step s trains -- with ``group`` this loader's gloo group (NOTE [ Per-step prefetch ]
        in evenflow/runtime/prefetch.py). Set it on every rank, before an epoch starts; ``None`` removes it.
        A layer above registers it (``BalancedVLM.prefetch_from(loader)``)."""
        check_prefetch(prefetch)
        if self._pipeline is not None and self._pipeline.is_alive():
            raise RuntimeError("set_step_prefetch while an epoch is running: set it before iterating the loader, "
                               "on every rank (its collectives must start at the same step everywhere)")
        self._step_prefetch = prefetch

    def _init_state(self) -> None:
        """The state of epochs, resume and quota-mode carry: every private attribute they change, set once here."""
        self._epoch = 0
        self._pending_state: dict | None = None
        self._refused: ValueError | None = None  # a state load_state_dict refused, not yet reported to peers
        self._carry: list = []            # quota mode: keys carried into the current epoch (map-style)
        self._next_carry: list = []       # quota mode: keys the finished epoch leaves for the next one
        self._consumed: set = set()       # keys of completed accumulation windows, this epoch
        self._window_keys: list = []      # keys of the window in progress
        self._steps_done = 0              # steps yielded this epoch
        self._committed = 0               # steps of completed accumulation windows, this epoch (state "step")
        self._resume = NO_VALUE           # 2 * step + finished of the state this epoch resumed from (RankReport)
        self._resumed_epoch: int | None = None  # the epoch last resumed mid-way (not planned ahead)
        self._resumed_content: int | None = None  # its state's stream fingerprint (iterable: checked on re-read)
        self._window = StreamWindow(0)    # iterable: the epoch stream's first samples (NOTE [ Sharding mistakes ])
        self._entered = False             # inside `with loader:` (NOTE [ Early stops ])
        self._keys: list = []             # this epoch's sample keys in stream order (map-style)
        self._stream: list | None = None  # a re-dealt epoch's keys, else None: the shard (NOTE [ Re-dealing ...
        #                                   a resumed epoch ] in redeal.py)
        self._finished = False            # the current epoch ran to its end
        self._bound = -1                  # steps_bound of the last yielded batch
        self._pipeline: EpochPipeline | None = None
        self._handoff: Handoff | None = None
        self._planner: RankPlanner | None = None  # kept across epochs in quota mode (iterable carry)
        self._payloads: dict = {}
        self._iterable_stream: Iterator | None = None  # quota mode: the raw stream a carried epoch continues
        self._position = StreamPosition()  # next stream position (iterable datasets)
        self._passes = 0                  # epochs started on this loader (the same count on every rank)

    # -- public API ----------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int, *, discard_resumed: bool = False) -> None:
        """Reshuffle for ``epoch`` (map-style) and call ``dataset.set_epoch`` when the dataset has one.

        After ``load_state_dict``, an epoch other than the one the state resumes would discard it (the rest of
        its epoch, or a quota-mode carry): refused on every rank alike, unless ``discard_resumed=True``, which
        drops the loaded state for any ``epoch`` (the saved one too: it then starts from its beginning, nothing
        carried -- the way past a state that does not fit the data, e.g. another stream).
        """
        state = self._pending_state
        lost = None if state is None else discarded(state, epoch)
        if lost is not None and not discard_resumed:
            raise ValueError(f"evenflow: rank {self.rank}: {lost}")
        if state is not None and discard_resumed:
            self._pending_state, self._carry, self._next_carry, self._finished = None, [], [], False
        elif state is not None and epoch != state["epoch"]:
            if state["finished"] and epoch == state["epoch"] + 1:
                self._next_carry, self._finished = list(state["next_carry"]), True
            self._pending_state = None
        if epoch != self._epoch:
            self._bound = -1
        self._epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator:
        self._start_epoch()
        try:
            while True:
                self._usage.check(self.rank)
                kind, *payload = self._handoff.get(self._pipeline.is_alive, self._steps_done)
                if kind == "batch":
                    release: Release = mesh_release(payload[0], self.mesh)  # NOTE [ Loss scale ]: over DP x CP
                    self._agree(release.info, release.batch)
                    release.info.set_loader_terms(self.terms)
                    self._on_yield(release)
                    self._usage.handed_out(release.info)
                    yield release.batch
                elif kind == "end":
                    self._agree(None, None)
                    self._finish_epoch()
                    return
                else:  # "stopped": this rank's own stop or error round
                    return
        finally:
            self._close_iterator()

    def __len__(self) -> int:
        """Upper bound on this epoch's steps, identical on every rank; tightens as the epoch runs.

        Trainers must stop on exhaustion, not on ``len``: the exact count depends on lengths not yet seen --
        unless they were given (``lengths=``): then it is the epoch's exact count ([`planned_steps()`][planned_steps]).
        """
        planned = self.planned_steps()
        if planned is not None:
            return planned
        if self._bound >= 0:
            return self._bound
        if self.streams.iterable:
            raise TypeError("len() is unknown for an IterableDataset (its length is only known at its end); "
                            "iterate to exhaustion, or give the trainer a step count")
        n = len(self.dataset)
        # Quota mode: after a first pass any rank may carry samples (and another none), so whether this rank
        # carries must not decide: every rank answers the bound that holds with a carry. Likewise on resume.
        carried = not self.config.alignment.join and self._passes > 0
        if carried or self._pending_state is not None:
            return 2 * n
        return -(-n // self.world_size)

    def planned_steps(self, epoch: int | None = None) -> int | None:
        """Exact batches per rank of ``epoch`` (default: the current one) from ``lengths=``, before it starts.

        ``None`` without ``lengths``, for a configuration the planner cannot replay (see
        `evenflow.runtime.epoch_plan.plan_coverage()`), or for an epoch resumed mid-way from a state. Identical
        on every rank; computed once per epoch (NOTE [ The planned epoch length ]).
        """
        if self._lengths is None:
            return None
        epoch = self._epoch if epoch is None else epoch
        pending = self._pending_state
        if (pending is not None and pending["epoch"] == epoch and not pending["finished"]) or (
                epoch == self._resumed_epoch):
            return None
        return self.fresh_planned_steps(epoch)

    def fresh_planned_steps(self, epoch: int) -> int | None:
        """[`planned_steps()`][planned_steps] of ``epoch`` run from its start, resumed or not (a schedule's horizon)."""
        return None if self._lengths is None else self._lengths.steps(epoch)

    def close(self, exc: BaseException | None = None) -> None:
        """Stop the current epoch on every rank (coordinated through the protocol) and release workers.

        ``exc``: the exception that ends training on this rank; peers then raise
        [`evenflow.PeerError`][evenflow.PeerError] naming it instead of [`evenflow.PeerStopped`][evenflow.PeerStopped]
        (NOTE [ Faults in the round sequence ]). Call it
        while the loop's iterator is still open (inside the loop's ``except``), or use ``with loader:``.
        """
        refused, self._refused = self._refused, None
        if refused is not None and self._pipeline is None:
            # load_state_dict refused a state on this rank only (its own copy of the data, another rank's state):
            # peers that resumed wait in their epoch's first exchange. One round reporting the refusal -- here, or
            # from the exit hook when the refusal ends the script -- makes them raise PeerError naming it.
            self._start_epoch(refusal=refused)
            self._pipeline.join(self.config.timeout.total_seconds() + _JOIN_MARGIN_S)
        self._stop_epoch(exc)
        self._iterable_stream = None

    def __enter__(self) -> DynamicBatchLoader:
        self._entered = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._entered = False
        self.close(exc)

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
            "step": self._committed,
            "num_workers": self.num_workers,
            "carry": list(self._carry),
            "next_carry": list(self._next_carry),
            "consumed": sorted(self._consumed, key=key_order),
            "stream": None if self._stream is None else list(self._stream),
            "content": self._window.fingerprint() if self.streams.iterable else None,
            "config": config_values(self.config),
            "data": None if self.streams.iterable else self._resume_print().as_state(),
        }

    def load_state_dict(self, state: Mapping | Sequence[Mapping]) -> None:
        """Resume from [`state_dict()`][state_dict]. The next ``iter()`` continues that epoch. Not collective.

        ``state``: this rank's own state (the same number of ranks resumes, each rank its own epoch), or the
        list of *every* saved rank's state, which every rank passes alike: on the same number of ranks each
        takes its own; on another number the untrained remainder of the epoch is re-dealt to the new ranks,
        identically on each (map-style datasets; NOTE [ Re-dealing a resumed epoch ] in
        evenflow.runtime.redeal). An ``IterableDataset`` resumes on another number of ranks only from a state
        saved at an epoch end: its stream positions belong to the rank that read them.

        A refusal raises on this rank; if the refusal is this rank's alone and the script ends on it (or calls
        [`close()`][close]), one round reports it, so peers that resumed raise
        [`evenflow.PeerError`][evenflow.PeerError] naming it instead of waiting for ``timeout``.
        """
        try:
            state = resume_state(state, ResumeContext(
                config=self.config, world_size=self.world_size, rank=self.rank, dataset=self.dataset,
                iterable=self.streams.iterable, num_workers=self.num_workers,
                content=lambda: self._content_print().value, data=self._resume_print))
        except ValueError as exc:  # reported to peers if this rank closes or exits without iterating (close())
            self._refused = exc
            close_at_exit(self)
            raise
        self._refused = None
        self._stop_epoch()
        self._pending_state = dict(state)
        self._epoch = state["epoch"]
        self._bound = -1

    # -- epoch lifecycle -----------------------------------------------------------------------------------
    def _start_epoch(self, refusal: BaseException | None = None) -> None:
        self._stop_epoch()
        self._refused = None  # iterated: the first exchange compares every rank's resumed state itself
        self._usage.reset()
        self._passes += 1
        carry, consumed = self._begin_state()
        self._carry, self._consumed, self._window_keys = carry, consumed, []
        self._steps_done, self._committed, self._finished, self._bound, self._next_carry = 0, 0, False, -1, []
        alignment = self.config.alignment
        keep_planner = not alignment.join and self.streams.iterable and self._planner is not None
        if not keep_planner:
            self._planner = RankPlanner(self.config.grouping, alignment, seed=self.config.seed)
            self._payloads = {}
        # A failure here (a dataset whose len() raises) is reported through the epoch's first round like any
        # other, so peers raise PeerError instead of waiting for the timeout; so is a worker that cannot start
        # (workers start at the stream's first sample, on the collation thread's helper: source.py).
        error, stream, total, skip = None, None, 0, frozenset()
        try:
            if refusal is not None:  # close() after a refused load_state_dict: this round only reports it
                raise refusal
            stream, total, skip = self._open_stream(carry, consumed, keep_planner)
            stream = unpadded(stream)  # a processor's padding costs and trains nothing (evenflow.runtime.samples)
            if not self.streams.iterable and self.shard_check and self.world_size > 1:
                unstable = self._content_print().error(self.rank)  # NOTE [ Sharding mistakes ]
                if unstable is not None:
                    raise unstable
                if (note := self._content_print().warning(self.rank)) is not None:
                    warnings.warn(note, stacklevel=2)  # nothing to compare: never a silent pass
        except Exception as exc:  # noqa: BLE001 - reported to every rank (NOTE [ Faults in the round sequence ])
            error = exc
        self._handoff = Handoff(self.rank)
        self._pipeline = EpochPipeline(
            planner=self._planner, stream=stream, total=total, skip=skip, exchange=self.exchange,
            fingerprint=self.fingerprint, spec=self.spec, collate_fn=self.collate_fn, handoff=self._handoff,
            epoch=self._epoch, depth=self.config.depth, grad_accum_steps=self.config.grad_accum_steps,
            payloads=self._payloads, template=self._idle.template, on_first_sample=self._idle.remember,
            rebalancer=(global_round := self._global_round()) or self._rebalancer(), global_round=global_round,
            planning_check=self._planning.check, key_at=self._key_at, report_fields=self._report_fields(),
            error=error, describe_fetch_error=partial(_fetch_error, rank=self.rank, worker_timeout=self.worker_timeout),
            call_limit=self._call_limit(), workers=self.num_workers > 0, dead_workers=self.streams.dead_workers,
            check_batch=self._check_batch, stream_check=self._stream_check,
            prefetch=bind_prefetch(self._step_prefetch, self.topology.group, self.terms))
        self._pipeline.start()
        close_at_exit(self)  # an epoch still open at exit is closed before finalization (NOTE [ Exit-time teardown ])

    def _begin_state(self) -> tuple[list, set]:
        """This epoch's carried keys and already-consumed keys, from a pending resume state or the last pass."""
        state, self._pending_state = self._pending_state, None
        self._resume, self._stream = NO_VALUE, None
        if state is not None and not state["finished"]:
            self._resume, self._stream = 2 * state["step"], state["stream"]
            self._resumed_epoch, self._resumed_content = state["epoch"], state["content"]
            return list(state["carry"]), set(state["consumed"])
        if state is not None:  # that epoch was complete: start the next pass with what it carried
            self._resume = 2 * state["step"] + 1
            self._next_carry, self._finished = list(state["next_carry"]), True
        # Quota mode: a pass that ran to its end hands its leftovers to the next pass.
        return list(self._next_carry if self._finished else self._carry), set()

    def _open_stream(self, carry: list, consumed: set, keep_planner: bool) -> tuple[Iterator, int | None, frozenset]:
        if self.streams.iterable:
            # Keys are stream positions; quota mode keeps counting across epochs so carried keys stay unique.
            if not keep_planner:
                self._position.value = 0
            raw = _continued(self.streams, self._iterable_stream if keep_planner else None)
            self._iterable_stream = raw
            self._keys = []
            expected = self._resumed_content if consumed else None  # a mid-epoch resume re-reads its stream
            self._resumed_content = None
            self._window = StreamWindow(0 if self._stream_check is None else self._stream_check.window,
                                        expected_head=expected, rank=self.rank)
            if self._stream_check is not None:
                self._stream_check.epoch(self._window)
            return _Numbered(self._position, raw, self._window), None, frozenset(consumed)
        shard = self._stream if self._stream is not None else shard_indices(
            len(self.dataset), rank=self.rank, world_size=self.world_size, epoch=self._epoch, seed=self.config.seed,
            shuffle=self.config.shuffle)
        # Carried keys are (epoch, index) pairs, so a carried index that is also in this epoch's shard (of this
        # rank or, with balance=True, of another) is a second, distinct sample-epoch, never deduplicated away.
        keys = [k for k in carry + shard if k not in consumed]
        self._keys = keys
        self._iterable_stream = None
        return _Keyed(keys, self.streams.open([sample_of(k) for k in keys])), len(keys), frozenset()

    def _key_at(self, pulled: int) -> object:
        """The key of the ``pulled``-th sample of this epoch's stream (names a sample whose fetch failed)."""
        if self.streams.iterable:
            return self._position.value
        return self._keys[pulled] if pulled < len(self._keys) else None

    def _report_fields(self) -> dict:
        try:
            kind = "iterable" if self.streams.iterable else ("map", len(self.dataset))
            checked = not self.streams.iterable and self.shard_check and self.world_size > 1
            content = self._content_print().compared if checked else NO_VALUE
        except Exception:  # noqa: BLE001 - len() failing is reported by _open_stream in the same round
            kind, content = "len() failed", NO_VALUE
        return dict(epoch=self._epoch, data=config_fingerprint(kind), resume=self._resume, pid=os.getpid(),
                    host=_HOST, content=content)

    def _resume_print(self, reads: int | None = None) -> ResumePrint:
        """This map-style dataset's resume fingerprint (NOTE [ The resume fingerprint ] in resume_print.py): read
        once per loader, when it saves its first state or loads one (``reads``: the items that state read)."""
        cached = self._data_print
        if cached is None or (reads is not None and cached.reads != reads):
            planned = self._lengths
            lengths = None if planned is None else [planned.tokens, *(planned.extra[k] for k in sorted(planned.extra))]
            self._data_print = resume_print(self.dataset, lengths, self._call_limit().total_seconds(), reads=reads)
        return self._data_print

    def _content_print(self) -> ContentPrint:
        """A few items' token content, equal on every rank iff the ranks hold the same dataset (NOTE [ Sharding
        mistakes ] in shard_check.py); read once per loader, when peers compare it or a state records it, within
        ``worker_timeout`` a read (past it: refused)."""
        if self._content is None:
            self._content = content_print(self.dataset, self._call_limit().total_seconds())
        return self._content

    def _on_yield(self, release: Release) -> None:
        info: StepInfo = release.info
        self._check_planned(info)
        self._steps_done += 1
        if not self.streams.iterable:  # iterable epochs have no bound before their end (len() raises)
            self._bound = max(info.steps_bound, self._steps_done)
        self._window_keys.extend(release.keys)
        if info.window_end:
            self._consumed.update(self._window_keys)
            self._window_keys = []
            self._committed = self._steps_done

    def _agree(self, info: StepInfo | None, batch: object) -> None:
        """CP/SP peers must hold the same batch (or all end): one small all-gather over them, refused on each."""
        if self._agreement is None:
            return
        exc = self._agreement.check(info, batch, self._epoch)
        if exc is not None:
            self._stop_epoch(exc)
            raise exc

    def _check_planned(self, info: StepInfo) -> None:
        """A planned epoch: a batch measured at other lengths than ``lengths=`` gave is this rank's error, and it
        reaches every peer (NOTE [ The planned epoch length ])."""
        exc = None if self._lengths is None else self._lengths.mismatch(info.sample_ids, info.real_tokens,
                                                                        rank=self.rank, epoch=self._epoch)
        if exc is not None:
            self._stop_epoch(exc)
            raise exc

    def _finish_epoch(self) -> None:
        self._finished = True
        if self._steps_done == 0 and self._resume == NO_VALUE:  # the same on every rank: steps are aligned
            warnings.warn(f"evenflow: epoch {self._epoch} yielded no batch on any rank: the dataset is empty on every "
                          "rank (len(dataset) == 0, or every rank's IterableDataset stream ended at once) -- a filter "
                          "that removed every sample, an empty split or file, a stream sharded to nothing. Nothing "
                          "trained. (Warned, not refused: an empty epoch is consistent on every rank and ends "
                          "normally; a rank with nothing to do while its peers train is not warned.)",
                          stacklevel=3)
        self._bound = -1  # len() before the next epoch is that epoch's bound, not this one's
        planner = self._planner
        self.dropped.extend(k for k in planner.dropped if k not in self.dropped)
        if self.config.alignment.join:
            self._next_carry = []
            return
        # Quota mode: what this rank did not yield goes first next epoch (NOTE [ Termination ]).
        if self.streams.iterable:
            self._next_carry = [it.key for it in planner.buffer]
        else:
            unread = self._keys[self._pipeline.pulled:]
            self._next_carry = [_carried(it.key, self._epoch) for it in planner.buffer] + [
                _carried(k, self._epoch) for k in unread]
            logger.debug("evenflow quota mode: rank %d carries %d samples into the next epoch", self.rank,
                         len(self._next_carry))

    def _close_iterator(self) -> None:
        """The epoch's generator is closed: at its end, on a break, or by an exception leaving the loop."""
        pipeline, handoff = self._pipeline, self._handoff
        if pipeline is None:
            return
        if self._entered and pipeline.is_alive():
            # Inside `with loader:` an exception leaving the loop reaches __exit__ right after this: give it the
            # chance to report an error rather than a STOP (NOTE [ Early stops ]).
            handoff.defer_stop(self._steps_done, _EXIT_GRACE_S)
            return
        self._stop_epoch()

    def _stop_epoch(self, error: BaseException | None = None) -> None:
        pipeline, handoff = self._pipeline, self._handoff
        if pipeline is None:
            return
        handoff.request_stop(self._steps_done, error)
        pipeline.join(self.config.timeout.total_seconds() + _JOIN_MARGIN_S)
        if pipeline.is_alive():
            logger.warning("evenflow: the collation thread of rank %d did not stop within the timeout; a peer "
                           "rank is probably no longer iterating", self.rank)
        self._pipeline = None
        self._handoff = None
        forget_at_exit(self)
        if not self.streams.iterable or self.config.alignment.join or pipeline.calls.abandoned:
            self._iterable_stream = None  # (abandoned: a helper thread may still be inside that stream)

    def _call_limit(self) -> timedelta:
        """The bound on one call into user code on the collation thread (NOTE [ User code is bounded ]):
        ``worker_timeout``, which must be below ``timeout`` so that the report reaches the peers before their
        exchange times out; with ``num_workers=0`` that is not required, and a larger one is cut to half of it."""
        return self.worker_timeout if self.worker_timeout < self.config.timeout else self.config.timeout / 2

    def _global_round(self):
        if self._planning.groups is None:
            return None
        from ..global_round import GlobalRound  # imports scipy only when asked for
        return GlobalRound(self.exchange, self._planning.groups, self.config.grouping, self.config.alignment,
                           self._payloads, pair_keys=self.streams.iterable, moves=self.moves,
                           grad_accum_steps=self.config.grad_accum_steps,
                           time_cost=self.config.planning_time_cost)

    def _rebalancer(self):
        if not self.config.balance:
            return None
        from ..balancing import StepRebalancer  # imports evenflow.balance (scipy) only when asked for
        return StepRebalancer(self.exchange, self.config.grouping, self._payloads, pair_keys=self.streams.iterable,
                              moves=self.moves)


_HOST = config_fingerprint(socket.gethostname())
"""This host, as ranks compare it: a failed exchange names the dead ranks it can check (same host)."""
