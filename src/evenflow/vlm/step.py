"""One balanced training step of a stock VLM: the loader's batch in, this rank's scaled loss out.

    loader = DynamicBatchLoader(dataset, token_budget=..., max_encoder_rows=patch_budget)
    vlm = BalancedVLM(DistributedDataParallel(model), group=dist.new_group(),
                      config=VLMConfig(max_encoder_rows=patch_budget))
    for batch in loader:
        info = evenflow.pop_step_info(batch)
        step = vlm(batch, info)           # collective on `group`: every rank, every step (IDLE ones too)
        step.loss.backward()              # DDP / FSDP average: the exact global per-token mean's gradient
        log(step.mean_loss)               # the global per-token mean, the same on every rank

Before anything moves, a step refuses what would train silently wrong ([`evenflow.vlm.checks`][evenflow.vlm.checks]): a
model nothing synchronizes, a loader with another encoder budget, a batch still holding its StepInfo, a step some
ranks skip.

What happens (NOTE [ Composed routing ] in evenflow.exchange): the adapter finds this rank's examples
and their media items and computes their positions; one all_gather shares the metadata (and any rank's
failure); every rank computes the same plan per phase; text with its positions moves in one all-to-all, each
encoder phase's inputs in one, the encoders run where the plan says, and their outputs go straight to the LLM
rank of their example in one differentiable all-to-all; the LLM runs on the stock model in the packed or
padded layout, and the summed token loss is scaled by ``world / window supervised tokens`` (NOTE [ Gradients do
not depend on the plan ]).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..balance.phases import OrchestratorConfig, PhaseBalance, PhaseSpec, StepPlan
from ..exchange import ExampleInputs, GlobalOrchestrator
from ..planning.loss import IGNORE_INDEX
from ..step_info import STEP_INFO_KEY, StepInfo
from . import checks
from .base import VLMAdapter, llm_batch
from .config import VLMConfig
from .families import adapter_for, unwrap_model
from .prefetch import PlanPrefetch
from .warmup import cost_from_state, cost_state

__all__ = ["BalancedVLM", "VLMStep"]

STATE_VERSION = 1


def _check_unused(model: torch.nn.Module, adapter: VLMAdapter) -> None:
    """Refuse a DDP wrapper that cannot train the model: parameters its stock forward never uses (the Omni
    thinker's ``audio_bos_eos_token``) get no gradient, and DDP without ``find_unused_parameters`` then fails
    in the next iteration's reduction, far from the cause."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or model.find_unused_parameters:
        return
    params = dict(unwrap_model(model).named_parameters())
    trained = [n for n in adapter.unused_parameters() if n in params and params[n].requires_grad]
    if trained:
        raise ValueError(f"the stock forward of {type(unwrap_model(model)).__name__} never uses {trained}: they get "
                         "no gradient, and DDP without find_unused_parameters then fails in its next reduction. "
                         "Freeze them (param.requires_grad_(False)) before wrapping, or wrap with "
                         "DistributedDataParallel(..., find_unused_parameters=True)")


@dataclass
class VLMStep:
    """What one rank did in one balanced step."""

    loss: torch.Tensor
    """This rank's scaled loss: backpropagate it; averaging gradients over ranks (DDP, FSDP) gives the
    gradient of the exact per-token mean over the window (sum them instead: divide by the world size)."""
    loss_sum: float
    """This rank's summed token loss (unscaled)."""
    loss_tokens: int
    """The denominator: the window's global supervised tokens (the step's, without a StepInfo)."""
    plan: StepPlan
    """The step's plan, identical on every rank (``plan.imbalance()``: per-phase max/mean before and after)."""
    examples: int = 0
    """LLM examples trained on this rank."""
    encoded: dict[str, int] = field(default_factory=dict)
    """Per encoder phase, items encoded on this rank."""
    _global_sum: tuple[Any, torch.Tensor] | None = field(default=None, repr=False)
    """The summed token loss over every rank, in flight: ``(work, tensor)`` of an async all_reduce."""

    def imbalance(self) -> dict[str, PhaseBalance]:
        return self.plan.imbalance()

    def _global_loss_sum(self) -> float:
        if self._global_sum is None:
            return self.loss_sum
        work, total = self._global_sum
        if work is not None:
            work.wait()
            self._global_sum = (None, total)
        return float(total)

    @property
    def mean_loss(self) -> float:
        """The step's loss as Hugging Face logs it: the summed token loss of every rank over the step's global
        supervised tokens -- the same number on every rank (no all-reduce of your own; read it on any rank or
        ranks, it was reduced during the step)."""
        tokens = self.plan.total_loss_tokens
        return self._global_loss_sum() / tokens if tokens else 0.0

    @property
    def window_loss(self) -> float:
        """This micro-step's share of its accumulation window's mean loss (every rank's summed token loss over
        the window's supervised tokens): summed over a window's micro-steps, the window's per-token mean -- what
        the optimizer step trained. Equals [`mean_loss`][mean_loss] with ``grad_accum_steps=1``."""
        return self._global_loss_sum() / self.loss_tokens if self.loss_tokens else 0.0


class BalancedVLM:
    """Per-phase balancing of a stock Hugging Face VLM over ``group`` (rank and world size read once, here).

    ``model``: the model to run the LLM forward through (DDP-wrapped, FSDP2-sharded or plain); the adapter
    works on the model under a DDP wrapper. ``group``: the process group the data moves on, over the same
    data-parallel ranks as the gradient average (its size is the loss scale's world size) but apart from the
    group DDP reduces on (e.g. ``dist.new_group()``); NCCL for device tensors.
    ``adapter``: the family's [`VLMAdapter`][evenflow.vlm.base.VLMAdapter] class (built here with the
    unwrapped model and ``config``); ``None``: found by [`adapter_for()`][evenflow.vlm.families.adapter_for].
    """

    def __init__(self, model: torch.nn.Module, *, group: dist.ProcessGroup, config: VLMConfig = VLMConfig(),
                 adapter: type[VLMAdapter] | None = None) -> None:
        self.model = model
        self.config = config
        if adapter is not None and not (isinstance(adapter, type) and issubclass(adapter, VLMAdapter)):
            raise TypeError(f"adapter must be a VLMAdapter subclass (built here with the model and config), got "
                            f"{adapter!r}")
        self.adapter = adapter_for(model, config) if adapter is None else adapter(unwrap_model(model), config)
        a = self.adapter
        _check_unused(model, a)
        self._calls = 0
        self._prefetch: PlanPrefetch | None = None  # NOTE [ The plan made in the background ] in prefetch.py
        self.orchestrator = GlobalOrchestrator(OrchestratorConfig(
            encoders=a.phases, llm=PhaseSpec(cost=a.llm_cost, balance=config.balance_config),
            ranks_per_node=config.ranks_per_node, balance=config.balance != "none", token_fields=a.token_fields,
            output_dim=a.hidden_size, metadata_words=config.metadata_words,
            cost_key=repr(config.time_cost.key()) if config.time_cost is not None else ""), group=group)
        self.world_size = self.orchestrator.world_size
        checks.check_gradient_sync(model, self.world_size, config.gradient_sync)  # NOTE [ Replicas cannot drift ...
        base = unwrap_model(model)
        first = next(base.parameters())
        self.device, self.dtype = first.device, first.dtype

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run must plan with: the per-phase costs (a warm-up fit is never redone on resume --
        NOTE [ Fitted once, the same everywhere ] in ``warmup.py``) and the plan key they give."""
        cost = self.config.time_cost
        return {"version": STATE_VERSION, "time_cost": None if cost is None else cost_state(cost),
                "plan_key": self.orchestrator.plan_key}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check that this balanced step plans as the saved one did; refuse otherwise, saying how to rebuild it.
        Build it with ``VLMConfig(time_cost=cost_from_state(state["time_cost"]))`` -- the same object the loader
        takes as ``time_cost=`` -- on every rank."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"BalancedVLM state has version {state.get('version')!r}; this evenflow reads "
                             f"{STATE_VERSION}")
        saved = None if state["time_cost"] is None else cost_from_state(state["time_cost"])
        if saved != self.config.time_cost or state["plan_key"] != self.orchestrator.plan_key:
            mine = self.config.time_cost.describe() if self.config.time_cost else "default"
            raise ValueError(f"this BalancedVLM does not plan as the saved one: its costs ({mine}) or settings "
                             f"differ from the saved ({saved.describe() if saved else 'default'}). Build it with "
                             "VLMConfig(time_cost=cost_from_state(state['time_cost'])) and the saved settings, on "
                             "every rank: a resumed run replans nothing and never refits")

    def encoders(self) -> dict[str, Callable[..., torch.Tensor]]:
        """Phase name -> the adapter's encoder for it (what [`run()`][run] hands the orchestrator; a phase without
        item metadata, such as audio clips, is called without it)."""
        def encoder(p: str) -> Callable[..., torch.Tensor]:
            def encode(rows: torch.Tensor, item_rows: list[int], meta: torch.Tensor | None = None) -> torch.Tensor:
                meta = torch.zeros(len(item_rows), 0, dtype=torch.long) if meta is None else meta
                return self.adapter.encode(p, rows, item_rows, meta)
            return encode
        return {p: encoder(p) for p in self.adapter.phases}

    def prepare(self, batch: Mapping[str, Any] | None, info: StepInfo | None = None
                ) -> tuple[list[ExampleInputs], StepPlan]:
        """This rank's examples and the step's plan (one collective: the metadata exchange). An IDLE step (or
        ``batch=None``) contributes no example -- an IDLE batch is a placeholder -- but its rank still takes part
        in every phase."""
        if self.config.prefetch:  # made on the loader's thread (NOTE [ The plan made in the background ])
            if self._prefetch is None:
                raise ValueError("VLMConfig(prefetch=True) but no loader makes this step's plan: call "
                                 "vlm.prefetch_from(loader) on every rank before iterating the loader")
            return self._prefetch.take(batch, info)
        idle = batch is None or (info is not None and info.is_idle)
        samples = info.local_samples if info is not None else None
        ids = info.sample_ids if info is not None else None
        own = info if info is not None else (batch or {}).get(STEP_INFO_KEY)
        terms = own.loader_terms if isinstance(own, StepInfo) else None

        def build() -> list[ExampleInputs]:
            # Raised inside the exchange: every other rank raises PeerError at the same point.
            checks.check_not_popped(batch)
            checks.check_loader_terms(terms, self.config.max_encoder_rows)
            return [] if idle else self.adapter.find_items(batch, samples=samples, sample_ids=ids)

        call, self._calls = self._calls, self._calls + 1
        checksum = (0, 0) if call != checks.CHECKSUM_CALL or self.config.gradient_sync == "unchecked" \
            else checks.replica_checksum(self.model)
        bound = checks.wait_bound(terms)
        try:
            local, meta = self.orchestrator.gather_examples(build, device=self.device, timeout=bound,
                                                            stamp=(checks.step_stamp(info), *checksum))
        except TimeoutError as exc:
            raise checks.missing_call(self.orchestrator.rank, info, bound) from exc
        stamps = self.orchestrator.stamps
        checks.check_step_stamps(stamps[:, 0], self.orchestrator.rank)
        checks.check_replicas(stamps[:, 1:3], self.orchestrator.rank)
        plan = self.orchestrator.plan(meta)
        if info is not None and plan.total_loss_tokens != info.global_loss_tokens:
            # Both sides are global: every rank raises here, together.
            raise ValueError(f"the step's examples hold {plan.total_loss_tokens} supervised tokens, the loader counted "
                             f"{info.global_loss_tokens}; the loader's loss_tokens rule and the labels of the "
                             "batch must agree (LossTokenRule)")
        return local, plan

    def prefetch_from(self, loader: Any) -> None:
        """Make each step's metadata exchange and plan on ``loader``'s collation thread, while the previous step
        trains (``VLMConfig(prefetch=True)``; NOTE [ The plan made in the background ] in ``prefetch.py``). Call
        it on every rank, before iterating ``loader`` -- a ``DynamicBatchLoader`` over the same
        ranks as this step's group -- and pass its batches with their own StepInfo."""
        if not self.config.prefetch:
            raise ValueError("prefetch_from(loader) needs VLMConfig(prefetch=True): build the step with it")
        self._prefetch = PlanPrefetch(self, loader)
        loader.set_step_prefetch(self._prefetch)

    def run(self, plan: StepPlan, local: Sequence[ExampleInputs], info: StepInfo | None = None, *,
            model: torch.nn.Module | None = None, encoders: Mapping[str, Callable[..., torch.Tensor]] | None = None
            ) -> VLMStep:
        """Move, encode, merge, forward: this rank's scaled loss (collective on ``group``)."""
        model = self.model if model is None else model
        llm = self.orchestrator.step(plan, local, encoders or self.encoders(), dtype=self.dtype, device=self.device,
                                     **({} if self._prefetch is None else self._prefetch.ahead(plan)))
        lb = llm_batch(llm, self.config.layout, field_widths=self.adapter.token_fields,
                       pad_token_id=self.adapter.pad_token_id, device=self.device)
        logits = self.adapter.forward(model, llm, lb)
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lb.targets.reshape(-1).to(logits.device),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        denominator = plan.total_loss_tokens
        if info is not None:
            info.mark_scaled()
            denominator = info.window_loss_tokens
        scale = self.world_size / denominator if denominator else 0.0
        # The logged loss is reduced now, asynchronously, on every rank: reading it later on rank 0 alone
        # then needs no collective (one all_reduce of one number per step, after the step's moves).
        total = loss_sum.detach().to(torch.float64).reshape(1).clone()
        work = dist.all_reduce(total, group=self.orchestrator.group, async_op=True)
        return VLMStep(loss=loss_sum * scale, loss_sum=float(loss_sum.detach()), loss_tokens=int(denominator),
                       plan=plan, examples=len(llm.input_ids),
                       encoded={p: int((plan.items[p].dest == self.orchestrator.rank).sum()) for p in plan.phases},
                       _global_sum=(work, total))

    def __call__(self, batch: Mapping[str, Any] | None, info: StepInfo | None = None, *,
                 model: torch.nn.Module | None = None) -> VLMStep:
        """[`prepare()`][prepare] then [`run()`][run]. ``model``: run the LLM through this one (e.g. the Trainer's
        wrapped model) instead of the one given at construction."""
        local, plan = self.prepare(batch, info)
        return self.run(plan, local, info, model=model)
