"""Baseline batching policies as :class:`evenflow.sim.Schedule` s, for the simulator and the CPU runs.

Every function takes the epoch's lengths (``lengths[i]`` tokens for sample i), the world size and the token
budget, and returns who trains what at which step. Ranks get their samples from the same seeded sharding as
evenflow (:func:`evenflow.sim.shard`) unless the policy needs the whole epoch (the oracle, packing).

* :func:`standard`  -- fixed batch size ``b = budget // longest sample of the epoch`` (so nothing can OOM).
* :func:`sorted_batches` -- HF ``group_by_length``: random megabatches of ``50 b`` samples sorted by length,
  cut into batches of ``b``; consecutive batches go to consecutive ranks (accelerate's batch sharding).
* :func:`oracle`    -- offline length cache (GMT/BMT-style): global sort, greedy grouping under the budget
  (the optimal contiguous partition), groups of similar cost dealt to the ranks of one step, steps shuffled.
* :func:`packing`   -- first-fit-decreasing into rows of ``budget`` tokens, varlen (summed) cost.
* :func:`odb_schedule` -- ``online-dynamic-batching`` 0.1.2: its real ``odb.grouping.grouping_data`` for W
  ranks in one process (see NOTE [ Driving ODB in one process ]).
* :func:`evenflow_local` / :func:`evenflow_balanced` -- the package's planners.
* :func:`evenflow_global` -- global planning: every round, groups over the union of all ranks' buffers
  (:func:`evenflow.planning.plan_global_round`), steps dealt by a fitted time cost.
* :func:`per_rank_oracle` -- each rank knows its whole shard in advance (offline), groups it optimally, and
  ranks are aligned to the busiest one: the limit of any rank-local policy.
* :func:`window_oracle` -- the global oracle restricted to what ``planning="global"`` can see: the epoch in
  windows of ``buffer_size`` samples per rank (each rank's shard, in the loader's order), each window sorted,
  grouped and dealt like :func:`oracle`, nothing carried between windows.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from unittest import mock

import numpy as np

from evenflow.planning import AlignmentConfig, GroupingConfig, plan
from evenflow.sim import Schedule, evenflow_schedule, shard

__all__ = ["standard", "sorted_batches", "oracle", "packing", "odb_schedule", "evenflow_local",
           "evenflow_balanced", "evenflow_global", "proposal_time_balanced", "per_rank_oracle", "window_oracle", "fixed_batch_size", "HF_MEGABATCH_MULT", "all_policies", "balance_available",
           "odb_available"]

HF_MEGABATCH_MULT = 50
"""transformers' ``get_length_grouped_indices`` default megabatch multiplier."""


def fixed_batch_size(lengths: np.ndarray, token_budget: int) -> int:
    """The largest fixed batch size whose padded batch of the epoch's longest sample fits the budget."""
    return max(1, token_budget // int(np.max(lengths)))


def standard(lengths: np.ndarray, *, world_size: int, token_budget: int, seed: int = 0,
             batch_size: int | None = None) -> Schedule:
    """Random order, fixed batch size, each rank batches its own shard (DistributedSampler + DataLoader)."""
    b = batch_size or fixed_batch_size(lengths, token_budget)
    shards = shard(len(lengths), world_size, seed=seed)
    batches = [[s[k:k + b].tolist() for k in range(0, len(s), b)] for s in shards]
    return Schedule.from_rank_batches(batches, name="standard", info={"batch_size": b})


def sorted_batches(lengths: np.ndarray, *, world_size: int, token_budget: int, seed: int = 0,
                   batch_size: int | None = None) -> Schedule:
    """HF ``group_by_length`` (LengthGroupedSampler) with accelerate's batch sharding across ranks."""
    b = batch_size or fixed_batch_size(lengths, token_budget)
    n = len(lengths)
    perm = np.random.default_rng(seed).permutation(n)
    mult = max(1, min(n // (b * 4), HF_MEGABATCH_MULT))
    mega = mult * b
    order = []
    for k in range(0, n, mega):
        chunk = perm[k:k + mega]
        order.extend(chunk[np.argsort(-lengths[chunk], kind="stable")].tolist())
    flat = [order[k:k + b] for k in range(0, n, b)]
    steps = [flat[k:k + world_size] for k in range(0, len(flat), world_size)]
    return Schedule.from_steps(steps, world_size, name="sorted", info={"batch_size": b, "megabatch": mega})


def _deal(groups: list[list[int]], costs: np.ndarray, world_size: int, seed: int) -> list[list[list[int]]]:
    # Similar-cost groups share a step (costliest first), then the steps are shuffled.
    order = np.argsort(-costs, kind="stable")
    ranked = [groups[i] for i in order]
    steps = [ranked[k:k + world_size] for k in range(0, len(ranked), world_size)]
    perm = np.random.default_rng(seed).permutation(len(steps))
    return [steps[i] for i in perm]


def oracle(lengths: np.ndarray, *, world_size: int, token_budget: int, seed: int = 0) -> Schedule:
    """Whole-epoch lengths known in advance: global sort + greedy grouping under the budget, dealt to ranks."""
    groups = plan(lengths, GroupingConfig(token_budget=token_budget)).groups
    costs = np.array([len(g) * lengths[g].max() for g in groups], dtype=np.float64)
    return Schedule.from_steps(_deal(groups, costs, world_size, seed), world_size, name="oracle",
                               info={"groups": len(groups)})


def _loader_shards(n: int, world_size: int, seed: int) -> list[np.ndarray]:
    from evenflow.runtime.source import shard_indices  # the loader's own sharding (epoch 0)

    return [np.asarray(shard_indices(n, rank=r, world_size=world_size, epoch=0, seed=seed, shuffle=True))
            for r in range(world_size)]


def per_rank_oracle(lengths: np.ndarray, *, world_size: int, token_budget: int, seed: int = 0) -> Schedule:
    """Each rank groups its whole shard offline (optimal contiguous grouping); steps = the busiest rank's
    groups; each rank's groups costliest first, so step k pairs the k-th costliest groups of every rank."""
    cfg = GroupingConfig(token_budget=token_budget)
    batches = []
    for shard in _loader_shards(len(lengths), world_size, seed):
        groups = [shard[g].tolist() for g in plan(lengths[shard], cfg).groups]
        groups.sort(key=lambda g: -len(g) * int(lengths[g].max()))
        batches.append(groups)
    return Schedule.from_rank_batches(batches, name="per_rank_oracle")


def window_oracle(lengths: np.ndarray, *, world_size: int, token_budget: int, buffer_size: int,
                  seed: int = 0) -> Schedule:
    """The global oracle per window of ``buffer_size`` samples from every rank's shard (see the module doc)."""
    shards = _loader_shards(len(lengths), world_size, seed)
    cfg = GroupingConfig(token_budget=token_budget)
    steps: list = []
    for start in range(0, max(len(s) for s in shards), buffer_size):
        window = np.concatenate([s[start:start + buffer_size] for s in shards])
        groups = [window[g].tolist() for g in plan(lengths[window], cfg).groups]
        costs = np.array([len(g) * lengths[g].max() for g in groups], dtype=np.float64)
        steps.extend(_deal(groups, costs, world_size, seed + start))
    return Schedule.from_steps(steps, world_size, name=f"window_oracle_buf{buffer_size}",
                               info={"buffer_size": buffer_size})


def packing(lengths: np.ndarray, *, world_size: int, token_budget: int, seed: int = 0) -> Schedule:
    """First-fit-decreasing into rows of ``token_budget`` tokens (varlen attention, summed cost).

    Rows are dealt to ranks in random order (what packed-dataset trainers do).
    """
    order = np.argsort(-lengths, kind="stable")
    free = np.empty(0, dtype=np.int64)
    rows: list[list[int]] = []
    for i in order.tolist():
        size = int(lengths[i])
        fits = np.flatnonzero(free >= size)
        if len(fits):
            r = int(fits[0])
            free[r] -= size
            rows[r].append(i)
        else:
            rows.append([i])
            free = np.append(free, token_budget - size)
    perm = np.random.default_rng(seed).permutation(len(rows))
    rows = [rows[i] for i in perm]
    steps = [rows[k:k + world_size] for k in range(0, len(rows), world_size)]
    return Schedule.from_steps(steps, world_size, layout="summed", name="packing", info={"rows": len(rows)})


def evenflow_local(lengths: np.ndarray, *, world_size: int, token_budget: int, seed: int = 0,
                   alignment: AlignmentConfig = AlignmentConfig(), cost: str = "padded") -> Schedule:
    """The evenflow protocol; ``alignment`` defaults to the package's defaults (buffer, round size, ageing)."""
    name = "evenflow_local" if cost == "padded" else "evenflow_local_summed"
    return evenflow_schedule(lengths, world_size=world_size, seed=seed, alignment=alignment,
                             grouping=GroupingConfig(token_budget=token_budget, cost=cost), name=name)


def evenflow_balanced(lengths: np.ndarray, *, world_size: int, token_budget: int, seed: int = 0,
                      alignment: AlignmentConfig = AlignmentConfig(), local: Schedule | None = None) -> Schedule:
    """evenflow local, then :func:`evenflow.balance.rebalance_step` re-deals each step's samples across ranks."""
    from evenflow.sim import balanced_schedule  # needs evenflow.balance

    if local is None:
        local = evenflow_local(lengths, world_size=world_size, token_budget=token_budget, seed=seed,
                               alignment=alignment)
    return balanced_schedule(local, lengths, token_budget=token_budget)


def evenflow_global(lengths: np.ndarray, *, world_size: int, token_budget: int, seed: int = 0,
                    alignment: AlignmentConfig = AlignmentConfig(), time_cost=None) -> Schedule:
    """Global round planning (:func:`evenflow.sim.global_policy.global_schedule`); ``time_cost`` is the
    planner's :class:`~evenflow.planning.TimeCost` (fitted on a calibration split; tokens when None)."""
    from evenflow.sim.global_policy import global_schedule

    return global_schedule(lengths, world_size=world_size, grouping=GroupingConfig(token_budget=token_budget),
                           alignment=alignment, time_cost=time_cost, seed=seed)


# -- online-dynamic-batching 0.1.2, for real -----------------------------------------------------------------
#
# NOTE [ Driving ODB in one process ]
#     ODB's grouping lives in ``odb.grouping.grouping_data(data_buffer, ..., ddp_group, ...)``, which does
#     local work, ONE ``dist.all_gather_into_tensor`` of per-rank metadata, then deterministic alignment.
#     Before the gather it only reads its inputs (it sorts into new lists, builds new groups), so W ranks
#     can run it in one process in two passes: pass 1 calls it on every rank with a stand-in ``dist`` whose
#     all_gather raises with the rank's tensor; pass 2 calls it again with a stand-in that returns the
#     gathered tensor. The surrounding collate loop (``odb.collate.collate_loop_odb``: warm-up trigger
#     ``len(idx_buffer) >= int(buffer_size * counter)`` with counter 0, 0.05, ... 1.0; ``idx_budget`` = new
#     indices this round; overflow recycling; one output slot per index, IDLE slots skipped by the trainer;
#     the join-mode finishing calls) is replayed line by line in :class:`_OdbRank`. A rank's k-th yielded
#     batch pairs with every other rank's k-th, as DDP pairs them.

ODB_ITER_SEED = 67108
"""``DataLoader._iter_random_seed`` of ODB's first epoch (odb/core.py), which seeds its group shuffle."""


class _Captured(Exception):
    def __init__(self, tensor):
        super().__init__("captured")
        self.tensor = tensor


class _FakeDist:
    """The three ``torch.distributed`` calls ``grouping_data`` makes, for one simulated rank."""

    def __init__(self, world_size: int, rank: int, gathered=None) -> None:
        self.world_size, self.rank, self.gathered = world_size, rank, gathered

    def get_world_size(self, group=None) -> int:
        return self.world_size

    def get_rank(self, group=None) -> int:
        return self.rank

    def all_gather_into_tensor(self, out, inp, group=None) -> None:
        if self.gathered is None:
            raise _Captured(inp.clone())
        out.copy_(self.gathered)


class _OdbRank:
    """One rank's ``collate_loop_odb`` state machine (see the NOTE above)."""

    def __init__(self, ids: np.ndarray, lengths: np.ndarray, buffer_size: int, warmup: bool) -> None:
        import torch

        self._torch = torch
        self.ids = iter(ids.tolist())
        self.lengths = lengths
        self.buffer_size = buffer_size
        self.counter = 0.0 if warmup else 1.0
        self.idx_buffer: list[int] = []
        self.data_buffer: list[list[dict]] = []
        self.round = 0
        self.rg = random.Random(ODB_ITER_SEED)
        self.is_finished = False
        self.all_finished = False
        self.pending_counter = False
        self.yielded: list[list[int]] = []
        self.over_budget = 0
        self.lost = 0

    def next_call(self) -> bool | None:
        """Read samples until the loop would call ``grouping_data``; return its ``is_finished`` argument."""
        if self.all_finished:
            return None
        if not self.is_finished:
            for i in self.ids:
                # A bool tensor of length L: get_input_length sees L tokens; 1 byte per token of memory.
                self.idx_buffer.append(i)
                self.data_buffer.append([{"input_ids": self._torch.empty(int(self.lengths[i]), dtype=self._torch.bool),
                                          "_key": i}])
                if len(self.idx_buffer) >= int(self.buffer_size * self.counter):
                    self.pending_counter = True
                    return False
            self.is_finished = True
        return not self.idx_buffer  # finishing: flush new indices first, then announce "finished"

    def finish_call(self, is_finished: bool, result, token_budget: int) -> None:
        grouped, overflow, all_finished, skip = result
        idx_budget = len(self.idx_buffer)
        self.all_finished = all_finished
        if self.pending_counter:
            self.counter = min(1.0, self.counter + 0.05)
            self.pending_counter = False
        self.data_buffer.clear()
        self.data_buffer.extend([[s] for s in overflow])
        if skip or (is_finished and idx_budget == 0):
            return
        self.rg.shuffle(grouped)
        for k, batch in enumerate(grouped):
            if k >= idx_budget:  # more groups than output slots: never yielded
                self.lost += len(batch)
                continue
            keys = [s["_key"] for s in batch]
            if len(keys) * max(int(self.lengths[i]) for i in keys) > token_budget:
                self.over_budget += 1
            self.yielded.append(keys)
        self.idx_buffer.clear()


def odb_schedule(lengths: np.ndarray, *, world_size: int, token_budget: int, buffer_size: int, seed: int = 0,
                 warmup: bool = True, name: str | None = None) -> Schedule:
    """``online-dynamic-batching`` 0.1.2 in join mode (its default), W ranks, its real grouping code.

    ``buffer_size``: ODB's default is ``prefetch_factor x num_workers`` (its README: 64 x 4 = 256).
    Samples ODB never yields (brief §5: join loses samples with uneven counts) are counted in
    ``info["missing"]``; over-budget batches (its lag-by-one sizing) in ``info["over_budget"]``.
    """
    import odb.grouping as og
    import torch

    lengths = np.asarray(lengths, dtype=np.int64)
    ranks = [_OdbRank(ids, lengths, buffer_size, warmup) for ids in shard(len(lengths), world_size, seed=seed)]
    calls = 0
    while not all(r.all_finished for r in ranks):
        flags = [r.next_call() for r in ranks]
        if any(f is None for f in flags):
            raise RuntimeError("ODB ranks disagree on termination (a rank left the collective loop)")
        kwargs = [dict(data_buffer=r.data_buffer, max_input_length=token_budget, ddp_group=object(),
                       is_finished=f, idx_budget=len(r.idx_buffer), join_mode=True, loss_scaling=False,
                       max_groups=buffer_size, max_patches=0, group_order_flip="none",
                       random_seed=ODB_ITER_SEED, grouping_round=r.round) for r, f in zip(ranks, flags)]
        infos = []
        for rank, kw in enumerate(kwargs):
            with mock.patch.object(og, "dist", _FakeDist(world_size, rank)):
                try:
                    og.grouping_data(**kw)
                except _Captured as cap:
                    infos.append(cap.tensor)
                else:  # pragma: no cover - grouping_data always gathers when ddp_group is set
                    raise RuntimeError("grouping_data returned without its all_gather")
        gathered = torch.cat(infos)
        for rank, (r, kw) in enumerate(zip(ranks, kwargs)):
            with mock.patch.object(og, "dist", _FakeDist(world_size, rank, gathered)):
                result = og.grouping_data(**kw)
            r.round += 1
            r.finish_call(kw["is_finished"], result, token_budget)
        calls += 1
    sched = Schedule.from_rank_batches([r.yielded for r in ranks],
                                       name=name or f"odb_buf{buffer_size}")
    missing, _ = sched.coverage(len(lengths))
    counts = [len(r.yielded) for r in ranks]
    sched.info.update(calls=calls, missing=int(len(missing)), over_budget=sum(r.over_budget for r in ranks),
                      step_count_spread=max(counts) - min(counts), buffer_size=buffer_size)
    return sched


def proposal_time_balanced(local: Schedule, lengths: np.ndarray, *, token_budget: int, cost_model,
                           name: str = "proposal_time_balanced") -> Schedule:
    """PROPOSAL, not the package's policy: rebalance each step on *time* instead of padded tokens.

    Per step, :func:`evenflow.balance.padded_partition` (the package's exact padded min-max split) on unit
    costs ``f(L) = gamma + alpha L + beta L^2`` of the cost model's first phase; a step whose time-optimal
    split would break the token budget keeps :func:`evenflow.balance.rebalance_step`'s token-balanced split.
    Bucket b goes to rank b (the simulator does not charge the all-to-all).
    """
    from evenflow.balance import padded_partition, rebalance_step

    phase = cost_model.phases[0]
    lengths = np.asarray(lengths, dtype=np.int64)
    steps, fallback, moved = [], 0, 0
    for step in local.batches():
        ids = np.array([i for g in step for i in g], dtype=np.int64)
        home = {i: r for r, g in enumerate(step) for i in g}
        if len(ids) == 0:
            steps.append(step)
            continue
        bucket = padded_partition(phase.sample_cost(lengths[ids]), local.world_size)
        new = [ids[bucket == b].tolist() for b in range(local.world_size)]
        if any(g and len(g) * int(lengths[g].max()) > token_budget for g in new):
            fallback += 1
            new = rebalance_step(step, [lengths[g].tolist() for g in step], budget=token_budget)
        moved += sum(1 for r, g in enumerate(new) for i in g if home[i] != r)
        steps.append(new)
    return Schedule.from_steps(steps, local.world_size, name=name,
                               info={**local.info, "moved": moved, "token_fallback_steps": fallback})


def all_policies(lengths: np.ndarray, *, world_size: int, token_budget: int, seed: int = 0,
                 odb_buffers: Sequence[int] = (256, 1024), balanced: bool = True,
                 cost_model=None, time_cost=None) -> dict[str, Schedule]:
    """Every policy on one epoch (balanced only when ``evenflow.balance`` works; the time-balanced proposal
    only with a ``cost_model``)."""
    kw = dict(world_size=world_size, token_budget=token_budget, seed=seed)
    out = {"standard": standard(lengths, **kw), "sorted": sorted_batches(lengths, **kw),
           "oracle": oracle(lengths, **kw), "packing": packing(lengths, **kw)}
    if odb_available()[0]:
        for b in odb_buffers:
            out[f"odb_buf{b}"] = odb_schedule(lengths, buffer_size=b, **kw)
    out["evenflow_local"] = evenflow_local(lengths, **kw)
    out["evenflow_local_summed"] = evenflow_local(lengths, cost="summed", **kw)
    out["evenflow_global"] = evenflow_global(lengths, time_cost=time_cost, **kw)
    if balanced and balance_available():
        out["evenflow_balanced"] = evenflow_balanced(lengths, local=out["evenflow_local"], **kw)
        if cost_model is not None:
            out["proposal_time_balanced"] = proposal_time_balanced(out["evenflow_local"], lengths,
                                                                   token_budget=token_budget, cost_model=cost_model)
    return out


ODB_VERSION = "0.1.2"


def odb_available() -> tuple[bool, str]:
    """Whether ``online-dynamic-batching`` 0.1.2 is installed (benchmarks only), and why not."""
    from importlib import metadata

    try:
        version = metadata.version("online-dynamic-batching")
    except metadata.PackageNotFoundError:
        return False, (f"online-dynamic-batching is not installed -- ODB rows skipped; pip install "
                       f"online-dynamic-batching=={ODB_VERSION} (benchmarks only)")
    if version != ODB_VERSION:
        return False, f"online-dynamic-batching {version} installed, the comparison drives {ODB_VERSION} -- ODB rows skipped"
    return True, ""


def balance_available() -> bool:
    """Whether the post-balancing planner exists and works in this checkout."""
    try:
        from evenflow.balance import rebalance_step

        return rebalance_step([[0, 1], []], [[2, 2], []], budget=4) is not None
    except (ImportError, NotImplementedError):
        return False
