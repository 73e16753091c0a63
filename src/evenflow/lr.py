"""Learning rate for variable batches: scale each optimizer step's LR by the step's global supervised tokens.

With evenflow a step holds as many samples as fit the token budget, so its supervised-token count ``T`` varies
from step to step (fixed batches vary too, less visibly). The exact per-token loss (NOTE [ Loss scale ] in
evenflow.planning.loss) makes the gradient a *mean* over ``T`` tokens, so a step with more tokens has a less
noisy gradient and can take a larger step. DeepSpeed's variable-batch LR scaling is the anchor::

    lr_step = lr_schedule(step) * factor(T / T_ref)      linear: factor = T / T_ref   (SGD-style)
                                                         sqrt:   factor = sqrt(T / T_ref)   (Adam-style)
                                                         none:   factor = 1

Worked example, ``T_ref = 8192`` (budget 4096 x 2 ranks x 1 accumulation step): a step with 2,048 supervised
tokens gets ``sqrt`` factor 0.5, one with 8,192 gets 1.0; a step with no supervised token gets 0 (its gradient
is zero anyway). Units are optimizer steps: ``T`` is the whole accumulation window across all ranks
(``StepInfo.window_loss_tokens``), and the schedule underneath (any ``torch.optim.lr_scheduler``) keeps counting
optimizer steps and never sees the scaled value.

How: [`TokenLRScaler`][TokenLRScaler] registers a step pre-hook and post-hook on the optimizer (public
``torch.optim.Optimizer`` API). The pre-hook multiplies every param group's ``lr`` by the factor of the tokens
last passed to [`observe()`][TokenLRScaler.observe]; the post-hook puts the unscaled values back before the LR
scheduler steps. So it composes with any scheduler, and with trainers that call ``optimizer.step()``
themselves (the HF and Lightning integrations take ``lr_scaling=`` and call ``observe`` for you)::

    scaler = evenflow.TokenLRScaler(optimizer, scaling="sqrt", token_budget=16384, world_size=W)
    for batch in loader:
        info = evenflow.pop_step_info(batch)
        evenflow.scale_loss(model(**batch).loss, info).backward()
        if info.window_end:
            scaler.observe(info.window_loss_tokens)
            optimizer.step(); optimizer.zero_grad(); scheduler.step()
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["LRScaling", "TokenLRRule", "lr_factor", "default_reference_tokens", "TokenLRScaler"]

LRScaling = Literal["linear", "sqrt", "none"]
_SCALINGS = ("linear", "sqrt", "none")


def lr_factor(tokens: int, reference_tokens: int, scaling: LRScaling) -> float:
    """The multiplier of one optimizer step's LR.

    >>> lr_factor(2048, 8192, "sqrt"), lr_factor(2048, 8192, "linear"), lr_factor(2048, 8192, "none")
    (0.5, 0.25, 1.0)
    """
    if scaling not in _SCALINGS:
        raise ValueError(f"lr scaling must be one of {_SCALINGS}, got {scaling!r}")
    if not reference_tokens > 0:
        raise ValueError(f"reference_tokens must be positive, got {reference_tokens!r}")
    if tokens < 0:
        raise ValueError(f"a step's supervised-token count cannot be negative, got {tokens}")
    if scaling == "none":
        return 1.0
    ratio = tokens / reference_tokens
    return ratio if scaling == "linear" else math.sqrt(ratio)


def default_reference_tokens(token_budget: int, world_size: int = 1, grad_accum_steps: int = 1) -> int:
    """The reference when the user gives none: a full budget on every rank in every micro-step of the window.

    That is the largest step the loader can form (padded tokens bound supervised tokens), so factors are
    ``<= 1`` and the LR you set is the LR of a full step. Pass ``reference_tokens`` to anchor it elsewhere, e.g.
    at the mean tokens per step of a previous fixed-batch run whose LR you trust.
    """
    for name, value in (("token_budget", token_budget), ("world_size", world_size),
                        ("grad_accum_steps", grad_accum_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return token_budget * world_size * grad_accum_steps


@dataclass(frozen=True, kw_only=True)
class TokenLRRule:
    """Which scaling, relative to which reference. ``reference_tokens=None`` means
    [`default_reference_tokens()`][default_reference_tokens] of the loader's budget, world size and accumulation."""

    scaling: LRScaling = "sqrt"
    """``"sqrt"`` (Adam-family optimizers), ``"linear"`` (SGD), ``"none"`` (the schedule's LR as is)."""
    reference_tokens: int | None = None
    """Global supervised tokens per optimizer step at which the factor is 1."""

    def __post_init__(self) -> None:
        if self.scaling not in _SCALINGS:
            raise ValueError(f"TokenLRRule.scaling must be one of {_SCALINGS}, got {self.scaling!r}")
        ref = self.reference_tokens
        if ref is not None and (isinstance(ref, bool) or not isinstance(ref, int) or ref < 1):
            raise ValueError(f"TokenLRRule.reference_tokens must be a positive integer or None, got {ref!r}")

    def resolve(self, *, token_budget: int, world_size: int = 1, grad_accum_steps: int = 1) -> int:
        """The reference in effect: the user's, else the default."""
        if self.reference_tokens is not None:
            return self.reference_tokens
        return default_reference_tokens(token_budget, world_size, grad_accum_steps)

    @classmethod
    def coerce(cls, value: TokenLRRule | str | None) -> TokenLRRule | None:
        """``"sqrt"`` / ``"linear"`` -> a rule with the default reference; ``None`` / ``"none"`` -> off."""
        if value is None or value == "none":
            return None
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(scaling=value)  # type: ignore[arg-type]  (checked in __post_init__)
        raise TypeError(f"lr_scaling must be 'sqrt', 'linear', 'none', None or a TokenLRRule, got {value!r}")


class TokenLRScaler:
    """Scale every ``optimizer.step()`` by [`lr_factor()`][lr_factor] of the tokens given to [`observe()`][observe] for
    it.

    ``optimizer`` is a ``torch.optim.Optimizer`` (a trainer's wrapper is unwrapped through its ``optimizer``
    attribute). Either pass ``reference_tokens``, or ``token_budget`` (and ``world_size``,
    ``grad_accum_steps``) for the default reference. Call [`observe()`][observe] once before every optimizer step: a
    step with no observed count raises, because silently reusing the previous step's count is a wrong LR that
    nothing would show. `remove()` detaches the hooks. [`state_dict()`][state_dict] /
    [`load_state_dict()`][load_state_dict] keep the reference across a resume, also on another number of ranks.
    """

    def __init__(self, optimizer: Any, *, scaling: LRScaling = "sqrt", reference_tokens: int | None = None,
                 token_budget: int | None = None, world_size: int = 1, grad_accum_steps: int = 1) -> None:
        rule = TokenLRRule(scaling=scaling, reference_tokens=reference_tokens)
        if reference_tokens is None and token_budget is None:
            raise ValueError("TokenLRScaler needs reference_tokens, or token_budget (with world_size and "
                             "grad_accum_steps) for the default reference budget x world x accumulation")
        self.scaling: LRScaling = scaling
        self.reference_tokens = rule.resolve(token_budget=token_budget or 1, world_size=world_size,
                                             grad_accum_steps=grad_accum_steps)
        self.optimizer = _torch_optimizer(optimizer)
        self.last_factor = 1.0
        """Factor of the most recent step."""
        self.last_lrs: list[float] = []
        """Scaled LR of every param group at the most recent step (what the update used)."""
        self._tokens: int | None = None
        self._saved: list[float] | None = None
        self._handles = [self.optimizer.register_step_pre_hook(self._before_step),
                         self.optimizer.register_step_post_hook(self._after_step)]

    def observe(self, tokens: int) -> float:
        """Set the global supervised tokens of the coming optimizer step; returns its factor."""
        factor = lr_factor(int(tokens), self.reference_tokens, self.scaling)
        self._tokens = int(tokens)
        return factor

    def state_dict(self) -> dict:
        """The scaling and the reference in effect: save it with the checkpoint (it is plain data)."""
        return {"scaling": self.scaling, "reference_tokens": self.reference_tokens}

    def load_state_dict(self, state: dict) -> None:
        """Keep the reference the run was saved with.

        The default reference is ``token_budget x world_size x grad_accum_steps``; a job resumed on fewer ranks
        would derive a smaller one and raise every step's factor, although its steps now hold fewer tokens. With
        the saved reference a step of the resumed job gets the factor a step of the same tokens got before:
        16,384 tokens against 32,768 (budget 4,096 x 8 ranks) is 0.71 (sqrt) on 4 ranks as on 8.
        """
        if state.get("scaling") != self.scaling:
            raise ValueError(f"TokenLRScaler: the checkpoint was saved with scaling={state.get('scaling')!r}, this "
                             f"scaler has scaling={self.scaling!r}; resume with the saved scaling")
        reference = state.get("reference_tokens")
        if isinstance(reference, bool) or not isinstance(reference, int) or reference < 1:
            raise ValueError(f"TokenLRScaler: saved reference_tokens {reference!r} is not a positive integer")
        self.reference_tokens = reference

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._tokens is None:
            raise RuntimeError("TokenLRScaler: optimizer.step() ran without a token count for this step; call "
                               "scaler.observe(info.window_loss_tokens) before every optimizer step (or pass "
                               "lr_scaling=None to turn the rule off)")
        self.last_factor = lr_factor(self._tokens, self.reference_tokens, self.scaling)
        self._tokens = None
        self._saved = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = _times(group["lr"], self.last_factor)
        self.last_lrs = [float(group["lr"]) for group in optimizer.param_groups]

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # Put the schedule's values back before the scheduler steps: chainable schedulers (StepLR, ...) derive
        # the next LR from the current one and must never see a scaled value.
        if self._saved is not None:
            for group, lr in zip(optimizer.param_groups, self._saved):
                group["lr"] = lr
            self._saved = None


def _times(lr: Any, factor: float) -> Any:
    # A tensor LR (capturable / fused optimizers) is scaled in place of its value, keeping it a tensor.
    return lr * factor if not isinstance(lr, torch.Tensor) else lr.detach().clone().mul_(factor)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` itself: accelerate's and Lightning's wrappers keep it in ``.optimizer``."""
    inner = optimizer
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"TokenLRScaler needs a torch.optim.Optimizer (or a wrapper holding one in .optimizer), "
                        f"got {type(optimizer).__name__}")
    return inner
