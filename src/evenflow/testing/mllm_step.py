"""One orchestrated training step of the tiny MLLM on one rank, with per-phase CPU times.

    orch = GlobalOrchestrator(orchestrator_config(cfg), group=group)
    result = orchestrated_step(model, orch, local_examples)   # forward + backward; gradients not yet summed

NOTE [ Per-phase times ]
    A phase's time is the calling thread's CPU time (``time.thread_time``) spent in its forward *and*
    backward, so waiting for peers inside a collective is not counted and a loaded machine changes the
    numbers little (run with ``torch.set_num_threads(1)``: CPU autograd then runs on this thread). To time
    each encoder's backward apart from the LLM's, every encoder output enters the exchange as a detached leaf:
    ``loss.backward()`` stops at the leaves (LLM backward + the all-to-all's backward), then each encoder's
    graph is back-propagated with its leaf's gradient -- the same chain rule, split in three calls.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..balance.phases import StepPlan, rank_routing
from ..exchange import ExampleInputs, GlobalOrchestrator
from .tiny_mllm import TinyMLLM

__all__ = ["PhaseTimes", "StepResult", "orchestrated_step"]


@dataclass
class PhaseTimes:
    """CPU seconds of one rank in one step (NOTE [ Per-phase times ])."""

    vision: float = 0.0
    audio: float = 0.0
    llm: float = 0.0
    plan: float = 0.0
    """``plan_step`` on the gathered metadata (every rank computes the same plan)."""
    routing: float = 0.0
    """``rank_routing``: this rank's orders and split sizes from the plan."""

    def phase(self, name: str) -> float:
        return getattr(self, name)


@dataclass
class StepResult:
    """What one rank did in one step."""

    loss: float
    """This rank's share of the global per-token loss (sum over ranks = the step's loss)."""
    times: PhaseTimes
    wall_s: float
    encoder_calls: dict[str, int] = field(default_factory=dict)
    """Per phase, how often this rank ran the encoder (1 every step, also with zero items)."""
    encoded_items: dict[str, int] = field(default_factory=dict)
    llm_examples: int = 0
    fingerprint: str = ""
    plan: StepPlan | None = None
    """The step's plan (identical on every rank): item costs and loads per phase, for reporting."""


class _TimedEncoder:
    """Wraps an encoder: times its forward, hands the exchange a detached leaf, keeps the graph for later."""

    def __init__(self, fn, name: str, times: PhaseTimes) -> None:
        self.fn, self.name, self.times = fn, name, times
        self.calls, self.items = 0, 0
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, rows: torch.Tensor, item_rows: Sequence[int]) -> torch.Tensor:
        t0 = time.thread_time()
        y = self.fn(rows, item_rows)
        leaf = y.detach().requires_grad_(y.requires_grad)
        setattr(self.times, self.name, self.times.phase(self.name) + time.thread_time() - t0)
        self.calls += 1
        self.items += len(item_rows)
        self.pairs.append((y, leaf))
        return leaf

    def backward(self) -> None:
        t0 = time.thread_time()
        for y, leaf in self.pairs:
            if y.requires_grad:
                # A leaf no LLM example consumed still gets a zero gradient: the 0 * sum tie in lm_loss_sum.
                y.backward(leaf.grad if leaf.grad is not None else torch.zeros_like(y))
        setattr(self.times, self.name, self.times.phase(self.name) + time.thread_time() - t0)


def orchestrated_step(model: TinyMLLM, orch: GlobalOrchestrator, local: Sequence[ExampleInputs], *,
                      dtype: torch.dtype | None = None) -> StepResult:
    """Metadata exchange, plan, routed encoders, LLM loss, backward. Collective on ``orch.group``.

    Gradients are this rank's part of the exact global per-token mean: sum them across ranks (an
    ``all_reduce`` SUM, or DDP's average times the world size).
    """
    wall0 = time.perf_counter()
    times = PhaseTimes()
    meta = orch.gather_metadata([ex.meta(orch.config) for ex in local])
    t0 = time.thread_time()
    plan = orch.plan(meta)
    times.plan = time.thread_time() - t0
    t0 = time.thread_time()
    rank_routing(plan, orch.rank)  # timed here; orch.step derives the same routing again
    times.routing = time.thread_time() - t0
    encoders = {name: _TimedEncoder(fn, name, times) for name, fn in model.encoders().items()}
    batch = orch.step(plan, local, encoders, dtype=dtype)
    t0 = time.thread_time()
    loss = model.lm_loss_sum(batch) / batch.total_loss_tokens
    loss.backward()  # LLM backward and the all-to-all backward; stops at the encoders' leaves
    times.llm = time.thread_time() - t0
    for enc in encoders.values():
        enc.backward()
    return StepResult(loss=float(loss.detach()), times=times, wall_s=time.perf_counter() - wall0,
                      encoder_calls={n: e.calls for n, e in encoders.items()},
                      encoded_items={n: e.items for n, e in encoders.items()}, llm_examples=len(batch.input_ids),
                      fingerprint=plan.fingerprint(), plan=plan)
