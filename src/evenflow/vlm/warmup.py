"""Per-phase costs fitted from a short warm-up on the model's own towers, once, identical on every rank.

    costs = fit_phase_costs(model, group=group)             # collective: every rank times, rank 0's fit wins
    vlm = BalancedVLM(model, group=group, config=VLMConfig(time_cost=costs))
    loader = DynamicBatchLoader(..., cost="summed", time_cost=costs)   # the same object plans the loader
    checkpoint["vlm"] = vlm.state_dict()                     # the fitted costs travel with the checkpoint

NOTE [ Fitted once, the same everywhere ]
    A plan is a function of the costs, and every rank computes it on its own (NOTE [ The plan key ]), so the
    costs must be bit-identical on every rank. Timings never are: each rank times its own towers, under its
    own load. So every rank runs the same warm-up (the same sizes in the same order -- with FSDP2 the towers'
    forward and backward are collective, and then every rank must enter them), and the coefficients of rank
    ``src`` are broadcast as float64: every rank builds the same [`TimeCost`][evenflow.planning.TimeCost] from the
    same bits. A fit is never redone mid-run or on resume -- timings would differ, and so would the plans: the
    costs are saved in the state ([`BalancedVLM.state_dict()`][BalancedVLM.state_dict]) and loaded on every rank. A rank
    that plans with other costs anyway (it fitted on its own, or loaded another checkpoint) is refused in the first
    step's metadata exchange with [`PeerError`][evenflow.PeerError] on every rank.

Each phase is timed forward + backward on items of a few sizes (a vision frame of ``L`` patch rows, one audio
window of ``L`` mel frames -- ``items_per_call`` copies of it in one call, the time divided among them -- one
text-only example of ``L`` tokens), the fastest of ``repeats``, and fitted
by least squares (NOTE [ Fitting a phase's cost ] in ``evenflow.balance.costs``). An encoder's per-call time is
paid by every rank every step (a dummy item included), so it is no item's cost: its gamma is set to 0.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..balance.costs import fit_quadratic
from ..errors import PeerError
from ..planning.timecost import PhaseTime, TimeCost
from .base import PHASE_LENGTH_KEYS, VLMAdapter
from .config import VLMConfig
from .families import adapter_for, unwrap_model

__all__ = ["WarmupConfig", "fit_phase_costs", "time_phases", "cost_state", "cost_from_state", "COST_STATE_VERSION"]

COST_STATE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class WarmupConfig:
    """What the warm-up times. The defaults suit real towers on a GPU; tiny CPU models need smaller sizes."""

    vision_rows: tuple[int, ...] = (256, 1024, 2304, 4096, 6400)
    """Patch rows of one frame (square grids of whole merged tokens)."""
    audio_fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    """Lengths of one audio item, as fractions of the tower's attention window (``2 * n_window`` frames): the
    tower attends within windows, so a window's cost is what an item's cost is made of."""
    llm_tokens: tuple[int, ...] = (256, 1024, 2048, 4096, 8192)
    """Tokens of one text-only example."""
    repeats: int = 3
    """Each size is timed this many times; the fastest counts (contention only ever adds time)."""
    clock: Literal["wall", "thread"] = "wall"
    """``"wall"`` (``perf_counter``; CUDA synchronized) or ``"thread"`` (this thread's CPU time: with
    ``torch.set_num_threads(1)`` on a CPU shared by several ranks, what the rank itself spent)."""
    items_per_call: int = 1
    """An encoder is timed on this many copies of the item in one call, and the time divided among them: a step
    encodes many items per call, and a call's own overhead is no item's cost. Where one item is a few
    milliseconds (a tiny tower on a CPU), the overhead swamps how an item's time grows with its size: on the
    tiny Omni audio tower, three fits of single items put a 100-frame piece at 0.31-0.50 of a 200-frame one,
    three of 8 per call at 0.47-0.50. The LLM phase is always one example."""

    def __post_init__(self) -> None:
        for name in ("vision_rows", "audio_fractions", "llm_tokens"):
            values = getattr(self, name)
            if len(set(values)) < 3 or min(values) <= 0:
                raise ValueError(f"WarmupConfig.{name} needs at least 3 distinct positive sizes (a quadratic has "
                                 f"three coefficients), got {values!r}")
        for name in ("repeats", "items_per_call"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WarmupConfig.{name} must be a positive integer, got {value!r}")
        if self.clock not in ("wall", "thread"):
            raise ValueError(f"WarmupConfig.clock must be 'wall' or 'thread', got {self.clock!r}")


def _seconds(fn, *, repeats: int, clock: str, device: torch.device) -> float:
    """Fastest forward + backward of ``fn()``."""
    tick = time.thread_time if clock == "thread" else time.perf_counter
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = tick()
        fn().float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, tick() - t0)
    return best


def _sizes(adapter: VLMAdapter, config: WarmupConfig) -> dict[str, list[int]]:
    sizes = {"vision": list(config.vision_rows), "llm": list(config.llm_tokens)}
    if "audio" in adapter.phases:
        window = int(getattr(adapter, "window"))
        sizes["audio"] = sorted({max(4, round(f * window)) for f in config.audio_fractions})
    return {p: s for p, s in sizes.items() if p == "llm" or p in adapter.phases}


def time_phases(model: torch.nn.Module, adapter: VLMAdapter | None = None, *, config: WarmupConfig = WarmupConfig()
                ) -> dict[str, list[tuple[int, float]]]:
    """Per phase, ``(size, seconds)`` of forward + backward on single items (one process; no communication when
    ``model`` is plain or DDP-wrapped -- the unwrapped model runs). Leaves every gradient ``None``."""
    base = unwrap_model(model)
    adapter = adapter or adapter_for(base, VLMConfig())
    param = next(base.parameters())
    device, dtype = param.device, param.dtype
    vocab = int(base.get_input_embeddings().num_embeddings)
    out: dict[str, list[tuple[int, float]]] = {}
    for phase, sizes in _sizes(adapter, config).items():
        out[phase] = []
        for size in sizes:
            if phase == "llm":
                ids = torch.arange(size, device=device)[None] % max(2, vocab // 2) + 1  # plain text ids

                def run(ids=ids):
                    return base(input_ids=ids, use_cache=False).logits
                actual = size
            else:
                rows, item_rows, meta = adapter.warmup_item(phase, size)
                actual = int(sum(item_rows))
                k = config.items_per_call
                rows = torch.cat([rows] * k).to(device=device, dtype=dtype)
                item_rows, meta = list(item_rows) * k, torch.cat([meta] * k)

                def run(phase=phase, rows=rows, item_rows=item_rows, meta=meta):
                    return adapter.encode(phase, rows, item_rows, meta)
            calls = config.items_per_call if phase != "llm" else 1
            seconds = _seconds(run, repeats=config.repeats, clock=config.clock, device=device) / calls
            out[phase].append((actual, seconds))
    base.zero_grad(set_to_none=True)
    return out


def fit_phase_costs(model: torch.nn.Module, *, group: dist.ProcessGroup | None = None,
                    adapter: VLMAdapter | None = None, config: WarmupConfig = WarmupConfig(), src: int = 0
                    ) -> TimeCost:
    """A quadratic per phase from a short warm-up, as the planners' [`TimeCost`][evenflow.planning.TimeCost]
    (``layout="summed"``; phases on [`PHASE_LENGTH_KEYS`][evenflow.vlm.PHASE_LENGTH_KEYS]), identical on every rank of
    ``group``: every rank times, rank ``src``'s coefficients are broadcast (NOTE [ Fitted once, the same
    everywhere ]). Collective on ``group`` (``None``: one process, no broadcast). Call it before the first
    step; it leaves every gradient ``None``."""
    base = unwrap_model(model)
    adapter = adapter or adapter_for(base, VLMConfig())
    rank = dist.get_rank(group) if group is not None else src
    phases = list(_sizes(adapter, config))
    coef = torch.zeros(len(phases), 3, dtype=torch.float64)
    failure: Exception | None = None
    try:  # every rank times (collective towers under FSDP2 must match); only src's timings are fitted
        timings = time_phases(base, adapter, config=config)
        if rank == src:
            coef = _fit(timings)
    except Exception as exc:  # noqa: BLE001 - reported to every rank below, then raised
        failure = exc
    if group is not None:  # one exchange: each rank's status, and src's coefficients
        backend = dist.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        row = torch.cat([torch.tensor([float(failure is not None)], dtype=torch.float64), coef.reshape(-1)])
        rows = [torch.empty_like(row, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, row.to(device), group=group)
        table = torch.stack(rows).cpu()
        if failure is None and bool(table[:, 0].any()):
            first = int(torch.nonzero(table[:, 0]).flatten()[0])
            raise PeerError(first, "RuntimeError", "its warm-up of the per-phase costs failed (its log says why)",
                            None, this_rank=rank)
        coef = table[src, 1:].reshape(len(phases), 3)
    if failure is not None:
        raise failure
    kind = getattr(getattr(base, "config", None), "model_type", type(base).__name__)
    sizes_text = "; ".join(f"{p} {[s for s, _ in timings[p]]}" for p in phases)  # the same sizes on every rank
    per_call = f"; encoders {config.items_per_call} items a call" if config.items_per_call > 1 else ""
    return TimeCost(phases=tuple(PhaseTime(length_key=PHASE_LENGTH_KEYS[p], gamma=float(c[0]), alpha=float(c[1]),
                                           beta=float(c[2])) for p, c in zip(phases, coef.tolist())),
                    layout="summed", source=f"warm-up fit of {kind} on rank {src} ({config.clock} seconds, forward + "
                                            f"backward; {sizes_text}{per_call})")


def _fit(timings: Mapping[str, list[tuple[int, float]]]) -> torch.Tensor:
    """``[phase, (gamma, alpha, beta)]``; an encoder's gamma is 0 (its per-call time is no item's)."""
    coef = torch.zeros(len(timings), 3, dtype=torch.float64)
    for i, (phase, pairs) in enumerate(timings.items()):
        sizes, seconds = zip(*pairs)
        fit = fit_quadratic(sizes, seconds)
        if fit.alpha == 0 and fit.beta == 0:
            raise ValueError(f"the warm-up could not tell the {phase} phase's sizes apart (seconds "
                             f"{[f'{t:.3g}' for t in seconds]} for sizes {list(sizes)}): its time does not grow with "
                             "the item, so the fit would balance nothing. Time larger sizes (WarmupConfig), or pass "
                             "that phase's cost yourself (VLMConfig.time_cost)")
        coef[i] = torch.tensor([0.0 if phase != "llm" else fit.gamma, fit.alpha, fit.beta], dtype=torch.float64)
    return coef


def cost_state(cost: TimeCost) -> dict[str, Any]:
    """A [`TimeCost`][evenflow.planning.TimeCost] as plain data for a checkpoint (floats exact: ``float.hex``)."""
    return {"version": COST_STATE_VERSION, "layout": cost.layout, "source": cost.source,
            "phases": [{"length_key": p.length_key, "gamma": float(p.gamma).hex(), "alpha": float(p.alpha).hex(),
                        "beta": float(p.beta).hex()} for p in cost.phases]}


def cost_from_state(state: Mapping[str, Any]) -> TimeCost:
    """Inverse of [`cost_state()`][cost_state]: the same coefficients, bit for bit (so the same plan key)."""
    version = state.get("version")
    if version != COST_STATE_VERSION:
        raise ValueError(f"saved costs have version {version!r}; this evenflow reads version {COST_STATE_VERSION}")
    phases: Sequence[Mapping[str, str]] = state["phases"]
    return TimeCost(phases=tuple(PhaseTime(length_key=p["length_key"], gamma=float.fromhex(p["gamma"]),
                                           alpha=float.fromhex(p["alpha"]), beta=float.fromhex(p["beta"]))
                                 for p in phases), layout=state["layout"], source=state["source"])
