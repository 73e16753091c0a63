"""The sample an IDLE batch collates (evenflow.runtime.loader).

A rank with no samples left in a step still runs the step -- forward, backward, its share of the gradient
all-reduce -- on an IDLE batch whose loss ``scale_loss`` multiplies by 0. That batch must be a real sample of
this dataset (its keys and dtypes are what the model takes; its labels stay real, only scaled away) and it must
be within the budget (an IDLE batch is never an over-budget one). In order of preference: the first sample this
rank buffered, the user's ``idle_sample=``, or the first dataset item within the budget. For example, a rank of a
map-style dataset ``[600 tokens, 700 tokens, 12 tokens]`` under ``token_budget=512, oversize="alone"`` that must
go IDLE before it buffered anything collates the 12-token sample.
"""

from __future__ import annotations

from collections.abc import Mapping

# How many dataset indices the placeholder search may read (map-style, only when no sample was buffered yet).
_SCAN = 1024


class IdleTemplate:
    """``remember(sample)`` at each buffered sample (keeps the first); ``template()`` when a step goes IDLE."""

    def __init__(self, *, dataset: object, idle_sample: Mapping | None, token_budget: int, rank: int,
                 iterable: bool) -> None:
        self.dataset = dataset
        self.idle_sample = idle_sample
        self.token_budget = token_budget
        self.rank = rank
        self.iterable = iterable
        self._sample: object | None = None

    def remember(self, sample: object) -> None:
        if self._sample is None:
            self._sample = sample

    def template(self) -> object:
        """A real sample to collate for an IDLE step (its loss is scaled by 0, so its labels stay real)."""
        if self._sample is not None:
            return self._sample
        if self.idle_sample is not None:
            return self.idle_sample
        if not self.iterable and len(self.dataset) > 0:
            self._sample = self._first_within_budget()
            return self._sample
        raise RuntimeError(f"rank {self.rank} must emit an IDLE batch but never received a sample (its "
                           "IterableDataset stream was empty); pass idle_sample={...} to DynamicBatchLoader")

    def _first_within_budget(self) -> object:
        """The first dataset sample whose tokens fit the budget.

        Reached only when this rank must emit an IDLE step before it buffered any sample within the budget
        (e.g. it only ever received ``oversize="alone"`` samples); dataset[0] may itself be over the budget.
        """
        n = min(len(self.dataset), _SCAN)
        for index in range(n):
            sample = self.dataset[index]
            ids = sample.get("input_ids") if isinstance(sample, Mapping) else None
            if ids is not None and len(ids) <= self.token_budget:
                return sample
        raise RuntimeError(f"rank {self.rank} must emit an IDLE batch but the first {n} dataset samples are all "
                           f"over token_budget={self.token_budget}, so none can stand in as its placeholder; pass "
                           "idle_sample={...} (a small sample) to DynamicBatchLoader")
