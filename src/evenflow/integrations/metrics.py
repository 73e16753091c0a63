"""Per-step metrics from the loader's StepInfo, as a plain ``dict`` for any framework's logger. No communication.

    meter = StepMetrics()
    for batch in loader:
        info = pop_step_info(batch)
        meter.update(info)
        ...
        if step % 10 == 0:
            logger.log(meter.summary())   # resets the interval

Every value comes from [`StepInfo`][evenflow.StepInfo], which already carries the cross-rank numbers of its step
(global samples and supervised tokens, max/mean padded cost), so a summary costs no collective and never hangs a
rank that logs alone. Values named ``local_*`` describe this rank only; the others are identical on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..step_info import StepInfo

__all__ = ["StepMetrics", "METRIC_PREFIX"]

METRIC_PREFIX = "evenflow/"


class StepMetrics:
    """Accumulate [`StepInfo`][StepInfo] over an interval and summarize it.

    ``summary()`` keys (prefixed ``evenflow/``):

    - ``steps``: micro-steps in the interval; ``idle_steps``: those where this rank was IDLE (no data).
    - ``local_padded_efficiency``: this rank's real tokens / padded tokens (1.0 = no padding).
    - ``imbalance``: mean over steps of max/mean batch cost across ranks (1.0 = perfectly balanced);
      ``imbalance_max``: the worst step.
    - ``local_tokens_per_s``: this rank's real (unpadded) tokens per second of wall time.
    - ``samples_per_s`` / ``loss_tokens_per_s``: all ranks' samples and supervised tokens per second.
    - ``epoch``, ``epoch_progress``: epoch of the last step and its fraction done: samples / ``epoch_samples`` when
      given (exact), else steps / the ``len(loader)`` bound (an underestimate while the bound is loose).

    A 2-rank step where rank 0 holds [3 rows x 8] = 24 padded tokens with 20 real, and rank 1 holds 16 padded:
    local_padded_efficiency (rank 0) = 20/24 = 0.83, imbalance = 24 / 20 = 1.2.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, *, epoch_samples: int | None = None) -> None:
        self.clock = clock
        self.epoch_samples = epoch_samples
        """Samples in one epoch over all ranks (map-style join mode: ``len(dataset)``); ``epoch_progress`` is then
        samples done / this, else the step count over the loader's step bound (a lower estimate)."""
        self._epoch = -1
        self._epoch_done = 0
        self._start = clock()
        self.idle_total = 0
        """IDLE steps of this rank since construction (not reset by ``summary``)."""
        self._last: StepInfo | None = None
        self._reset_interval()

    def _reset_interval(self) -> None:
        self.steps = 0
        self.idle_steps = 0
        self.real_tokens = 0
        self.padded_tokens = 0
        self.samples = 0
        self.loss_tokens = 0
        self.imbalance_sum = 0.0
        self.imbalance_max = 1.0

    def update(self, info: StepInfo) -> None:
        """Record one micro-step (call once per batch, IDLE batches included)."""
        self.steps += 1
        if info.is_idle:
            self.idle_steps += 1
            self.idle_total += 1
        else:
            self.real_tokens += info.real_tokens
            self.padded_tokens += info.padded_tokens
        self.samples += info.global_samples
        if info.epoch != self._epoch:
            self._epoch, self._epoch_done = info.epoch, 0
        self._epoch_done += info.global_samples
        self.loss_tokens += info.global_loss_tokens
        self.imbalance_sum += info.imbalance
        self.imbalance_max = max(self.imbalance_max, info.imbalance)
        self._last = info

    def resumed(self, epoch: int, samples_done: int) -> None:
        """The run resumed ``epoch`` with ``samples_done`` of its samples already trained (all ranks, before the
        checkpoint): ``epoch_progress`` continues from there instead of restarting at 0."""
        self._epoch, self._epoch_done = epoch, samples_done

    def _progress(self, last: StepInfo) -> float:
        if self.epoch_samples:
            return min(self._epoch_done / self.epoch_samples, 1.0)
        return (last.step + 1) / last.steps_bound if last.steps_bound > 0 else 0.0

    def summary(self, reset: bool = True) -> dict[str, float]:
        """The interval's metrics as ``{name: float}``; empty when no step was recorded since the last reset."""
        if self.steps == 0:
            return {}
        now = self.clock()
        elapsed = max(now - self._start, 1e-9)
        last = self._last
        out = {
            "steps": float(self.steps),
            "idle_steps": float(self.idle_steps),
            "local_padded_efficiency": self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0,
            "imbalance": self.imbalance_sum / self.steps,
            "imbalance_max": self.imbalance_max,
            "local_tokens_per_s": self.real_tokens / elapsed,
            "samples_per_s": self.samples / elapsed,
            "loss_tokens_per_s": self.loss_tokens / elapsed,
            "epoch": float(last.epoch),
            "epoch_progress": self._progress(last),
        }
        if reset:
            self._start = now
            self._reset_interval()
        return {METRIC_PREFIX + k: v for k, v in out.items()}
