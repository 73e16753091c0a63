"""The balanced step's metadata exchange and plan, made for step s+1 on the loader's collation thread while step
s trains (``VLMConfig(prefetch=True)`` + ``BalancedVLM.prefetch_from``).

NOTE [ The plan made in the background ]
    Everything a step's plan needs is the batch and every rank's metadata: the adapter finds this rank's
    examples, one all_gather shares their metadata (and any rank's failure), and every rank plans alike. None
    of it needs the model's state, so the loader's collation thread does it when it releases the batch --
    over the loader's own gloo group, in step order on every rank (NOTE [ Per-step prefetch ] in
    ``evenflow/runtime/prefetch.py``) -- and the step finds its examples and plan waiting. The same batch and
    the same metadata give the same plan, so losses and gradients are the inline path's, bit for bit. This
    rank's routing of the plan (its orders and split sizes, pure) and its first sends (the text and encoder
    input rows in send order, on the host) are built there too.

    What stays on the step's path is what reads the trainer's side: that every rank called the step for the
    same loader step (a skipped call), and at the third call the replicas' parameter checksum (the model is
    being trained while the thread runs: only the trainer's thread reads it between optimizer steps). One
    all_gather of three words on the step's group carries both (NOTE [ Replicas cannot drift silently ] in
    ``checks.py``). A failure in the background -- a batch the adapter refuses, a peer that fails -- is shared
    by the exchange itself: every rank's loader raises it from ``next(loader)`` instead of the next batch.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..balance.phases import RankRouting, StepPlan, rank_routing
from ..exchange import ExampleInputs, GlobalOrchestrator
from ..errors import PeerError
from ..step_info import StepInfo
from . import checks

__all__ = ["PlanPrefetch", "check_loss_tokens"]

_FAILED = -1
"""The step-stamp word of a rank whose call was refused before the gather (stamps are >= 0)."""


def check_loss_tokens(plan: StepPlan, info: StepInfo | None) -> None:
    """The plan's supervised tokens against the loader's count; both are global: every rank raises together."""
    if info is not None and plan.total_loss_tokens != info.global_loss_tokens:
        raise ValueError(f"the step's examples hold {plan.total_loss_tokens} supervised tokens, the loader counted "
                         f"{info.global_loss_tokens}; the loader's loss_tokens rule and the labels of the batch must "
                         "agree (LossTokenRule)")


@dataclass(frozen=True)
class _Ready:
    info: weakref.ref
    local: list[ExampleInputs]
    plan: StepPlan
    routing: RankRouting
    send: Any
    """The step's first sends built on the host (``GlobalOrchestrator.send_buffers``), or None."""


class PlanPrefetch:
    """The per-step callable a ``BalancedVLM`` registers with a loader, and what the step takes from it."""

    def __init__(self, vlm: Any, loader: Any) -> None:
        """``vlm``: the ``evenflow.vlm.BalancedVLM`` (not imported: it imports this module)."""
        group = loader.topology.group
        if group is None:
            raise ValueError("VLMConfig(prefetch=True) plans over the loader's gloo group, and this one-rank loader "
                             "has none: give it one, DynamicBatchLoader(..., process_group=dist.new_group("
                             "backend='gloo'))")
        mesh = getattr(loader, "mesh", None)
        if mesh is not None and getattr(mesh, "degree", 1) > 1:
            raise ValueError("VLMConfig(prefetch=True) with a CP/SP mesh: the loader hands each peer a new StepInfo, "
                             "which the background plan cannot follow; leave prefetch=False on a mesh")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if (rank, world) != (vlm.orchestrator.rank, vlm.world_size):
            raise ValueError(f"the loader's group puts this process at rank {rank} of {world}, the balanced step's "
                             f"group at rank {vlm.orchestrator.rank} of {vlm.world_size}: both must span the same "
                             "data-parallel ranks in the same order (build the step's group over the loader's ranks)")
        self.vlm = vlm
        self.orchestrator = GlobalOrchestrator(vlm.orchestrator.config, group=group)
        """The metadata exchange on the loader's group, on CPU (the step's own orchestrator keeps its group)."""
        self._ready: dict[tuple[int, int], _Ready] = {}
        self._ahead: tuple[StepPlan, RankRouting, Any] | None = None
        self._lock = threading.Lock()

    # -- on the loader's collation thread ------------------------------------------------------------------------
    def __call__(self, batch: Mapping[str, Any], info: StepInfo, group: object) -> None:
        vlm, terms = self.vlm, info.loader_terms

        def build() -> list[ExampleInputs]:  # raised inside the exchange: peers raise PeerError there
            checks.check_loader_terms(terms, vlm.config.max_encoder_rows)
            if info.is_idle:
                return []
            return vlm.adapter.find_items(batch, samples=info.local_samples, sample_ids=info.sample_ids)

        local, meta = self.orchestrator.gather_examples(build, device="cpu")
        plan = self.orchestrator.plan(meta)
        check_loss_tokens(plan, info)
        routing = rank_routing(plan, self.orchestrator.rank)  # this rank's orders and splits: pure, ahead too
        try:  # the text and encoder input rows in send order, on the host (the step moves them to the device)
            send = self.orchestrator.send_buffers(plan, routing, local, vlm.dtype)
        except Exception:  # noqa: BLE001 - left to the step, which shares a failure there with every rank
            send = None
        with self._lock:  # entries of steps never trained (a break) are dropped once their StepInfo is gone
            self._ready = {k: v for k, v in self._ready.items() if v.info() is not None}
            self._ready[(info.epoch, info.step)] = _Ready(weakref.ref(info), local, plan, routing, send)

    # -- on the trainer's thread ---------------------------------------------------------------------------------
    def take(self, batch: Mapping[str, Any] | None, info: StepInfo | None) -> tuple[list[ExampleInputs], StepPlan]:
        vlm = self.vlm
        failure, ready = None, None
        try:  # a misused call is refused on this rank and, through the gather below, named on every other one
            checks.check_not_popped(batch)
            with self._lock:
                ready = None if info is None else self._ready.pop((info.epoch, info.step), None)
            if ready is None or ready.info() is not info:
                raise ValueError("VLMConfig(prefetch=True): no plan was made in the background for this batch. Pass "
                                 "the loader's batches with their own StepInfo (info = evenflow.pop_step_info(batch); "
                                 "vlm(batch, info)) and register the step with that loader before iterating it: "
                                 "vlm.prefetch_from(loader), on every rank")
        except Exception as exc:  # noqa: BLE001 - raised after the gather, on every rank
            failure = exc
        call, vlm._calls = vlm._calls, vlm._calls + 1
        checksum = (0, 0) if call != checks.CHECKSUM_CALL or vlm.config.gradient_sync == "unchecked" \
            else checks.replica_checksum(vlm.model)
        stamp = _FAILED if failure is not None else checks.step_stamp(info)
        stamps = self._gather((stamp, *checksum), info)
        rank = vlm.orchestrator.rank
        if failure is not None:
            raise failure
        failed = np.flatnonzero(stamps[:, 0] == _FAILED)
        if failed.size:
            r = int(failed[0])
            raise PeerError(r, "ValueError", "its balanced step was called with a batch it cannot take (its own error "
                            "says why)", None, this_rank=rank)
        checks.check_step_stamps(stamps[:, 0], rank)
        checks.check_replicas(stamps[:, 1:3], rank)
        self._ahead = (ready.plan, ready.routing, ready.send)
        return ready.local, ready.plan

    def ahead(self, plan: StepPlan) -> dict[str, Any]:
        """``GlobalOrchestrator.step``'s ``routing=`` and ``send=`` for ``plan`` if they were built in the
        background (the plan last taken), else nothing."""
        held = self._ahead
        return {} if held is None or held[0] is not plan else {"routing": held[1], "send": held[2]}

    def _gather(self, words: tuple[int, ...], info: StepInfo | None) -> np.ndarray:
        """``[world, 3]``: every rank's words, on the step's group, bounded as the inline exchange is."""
        vlm = self.vlm
        row = torch.tensor(words, dtype=torch.int64, device=vlm.device)
        out = [torch.empty_like(row) for _ in range(vlm.world_size)]
        bound = None if info is None else checks.wait_bound(info.loader_terms)
        work = dist.all_gather(out, row, group=vlm.orchestrator.group, async_op=True)
        if bound is None:
            work.wait()
        else:
            try:
                work.wait(bound)
            except RuntimeError as exc:  # gloo and NCCL report a timed-out wait as a RuntimeError
                raise checks.missing_call(vlm.orchestrator.rank, info, bound) from exc
        return torch.stack(out).cpu().numpy()
