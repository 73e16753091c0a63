"""The epoch's exact step count before it starts, from per-sample lengths alone (``DynamicBatchLoader(lengths=)``).

NOTE [ The planned epoch length ]
    Which samples form which batch depends only on the samples' lengths (and extra resources), the seed, the
    epoch and the configuration -- never on timing -- and evenflow.sim replays the loader step for step on
    lengths alone (tests/test_sim_matches_loader.py). So given every sample's length, the number of batches of
    any epoch is known before it starts: [`planned_steps()`][planned_steps] runs the simulator's public schedules
    ([`evenflow.sim.evenflow_schedule()`][evenflow.sim.evenflow_schedule] for ``planning="local"`` (``balance=True``
    moves samples, never steps), [`evenflow.sim.global_schedule()`][evenflow.sim.global_schedule] for ``"global"``), so
    planner changes carry over. ``len(loader)`` is then that count before and during the epoch -- what HF, Lightning and
    LR schedulers size themselves from -- instead of the upper bound ``ceil(N / W)`` (100 for a 25-step epoch) that
    tightens only as lengths arrive.

    Where the lengths come from ([`dataset_lengths()`][dataset_lengths]): a column the user has
    (``lengths=ds["length"]``), an HF ``datasets.Dataset``'s ``input_ids`` column read from its Arrow offsets in batches
    of rows (no token is converted to Python: 13 ms for 200,000 rows; a dataset with an indices mapping -- shuffled or
    filtered, as TRL's preparation leaves it -- copies each batch once: 2.9 s for 200,000 rows of ~200 tokens, measured
    on the 2-core development machine under load), or one pass of ``__getitem__`` over the dataset (the whole pipeline
    once: use a column when the pipeline is costly). They must be what the loader measures (``length_fn``, default
    ``len(input_ids)``): every batch checks the sum of its samples' given lengths against the measured one and raises on
    a mismatch, naming the samples (a wrong count would end HF's epoch early or leave its LR schedule unfinished).

    Cost of the simulation: ~2-30 us per sample per epoch on one CPU core (global planning is the faster),
    e.g. 50,000 samples on 2 ranks: 0.3 s (global), 1.4 s (local); run once per epoch, on first ``len()``.

    Covered: map-style datasets in join mode, a fresh epoch (not one resumed mid-way: its remaining steps depend
    on how the buffers were refilled, so it reports the bound), one planning group (``planning_group`` unset
    or equal to the world size), ``oversize="error"`` under global planning. Otherwise
    [`planned_steps()`][planned_steps] says why in its ``None`` reason and ``len()`` stays the bound.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .loader.config import LoaderConfig

__all__ = ["PlannedLengths", "planned_steps", "plan_coverage", "dataset_lengths", "as_plan_lengths", "is_hf_dataset"]


class PlannedLengths:
    """A loader's ``lengths=``: checked once, each epoch's step count simulated once, each batch checked against it.

    ``steps(epoch)`` is the epoch's batches per rank run from its start; ``mismatch(...)`` the error for a batch
    whose samples the loader measured at other lengths than these (``None`` when they agree).
    """

    def __init__(self, lengths: Sequence[int] | Mapping[str, Sequence[int]], *, num_samples: int | None,
                 config: LoaderConfig, world_size: int, planning: str, group_size: int) -> None:
        """``num_samples``: the map-style dataset's size; ``None`` for an ``IterableDataset`` (refused)."""
        if num_samples is None:
            raise ValueError("lengths= plans a map-style dataset's epochs; an IterableDataset has no per-index "
                             "lengths (drop lengths=)")
        why = plan_coverage(join=config.alignment.join, oversize=config.grouping.oversize, world_size=world_size,
                            planning=planning, group_size=group_size, iterable=False)
        if why:
            raise ValueError(f"lengths= cannot plan this loader's epochs: {why}; drop lengths= (len() is then an "
                             "upper bound)")
        self.tokens, self.extra = as_plan_lengths(lengths, num_samples, tuple(config.grouping.extra_budgets))
        self.config = config
        self.world_size = world_size
        self.planning = planning
        self._steps: dict[int, int] = {}  # epoch -> planned steps, simulated at the first ask

    def steps(self, epoch: int) -> int:
        if epoch not in self._steps:
            self._steps[epoch] = planned_steps(self.tokens, self.extra, self.config, world_size=self.world_size,
                                               planning=self.planning, epoch=epoch)
        return self._steps[epoch]

    def mismatch(self, sample_ids: list[int], measured: int, *, rank: int, epoch: int) -> ValueError | None:
        """A batch's samples must have the lengths the plan used; else len() and a trainer's schedule are wrong."""
        given = int(self.tokens[sample_ids].sum()) if sample_ids else 0
        if given == measured:
            return None
        return ValueError(
            f"rank {rank}, samples {sample_ids}: lengths= gives them {given} tokens but the loader measured "
            f"{measured}; the planned epoch length ({self._steps.get(epoch)} steps, len()) is wrong. Pass the "
            "lengths the loader measures (length_fn, default len(sample['input_ids']), after any truncation), e.g. "
            "evenflow.dataset_lengths(dataset)")


def as_plan_lengths(lengths: Sequence[int] | Mapping[str, Sequence[int]], num_samples: int,
                    extra_names: Sequence[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(tokens, {extra name: values})`` validated against the dataset size and the extra budgets."""
    if isinstance(lengths, Mapping):
        if "tokens" not in lengths:
            raise ValueError(f"lengths= as a mapping needs a 'tokens' entry (the lengths length_fn measures), got "
                             f"{sorted(lengths)}")
        tokens, extra = lengths["tokens"], {k: v for k, v in lengths.items() if k != "tokens"}
    else:
        tokens, extra = lengths, {}
    missing = [name for name in extra_names if name not in extra]
    if missing:
        raise ValueError(f"extra_budgets names {missing}: pass lengths={{'tokens': [...], "
                         f"{', '.join(repr(m) + ': [...]' for m in missing)}}} (one value per sample)")
    out = {"tokens": np.asarray(tokens, dtype=np.int64).reshape(-1)}
    out.update({k: np.asarray(extra[k], dtype=np.int64).reshape(-1) for k in extra_names})
    for name, values in out.items():
        if len(values) != num_samples:
            raise ValueError(f"lengths[{name!r}] has {len(values)} entries for a dataset of {num_samples} samples; "
                             "give one per dataset index")
    if (out["tokens"] <= 0).any():
        i = int(np.flatnonzero(out["tokens"] <= 0)[0])
        raise ValueError(f"lengths: sample {i} has length {int(out['tokens'][i])}; lengths must be positive")
    tokens = out.pop("tokens")
    return tokens, out


def plan_coverage(*, join: bool, oversize: str, world_size: int, planning: str, group_size: int,
                  iterable: bool) -> str:
    """Why a loader configuration's epochs cannot be planned ahead, or ``""`` when they can."""
    if iterable:
        return "an IterableDataset has no per-index lengths"
    if not join:
        return "join=False (quota mode) carries samples across epochs"
    if planning == "global" and group_size < world_size:
        return f"planning groups of {group_size} ranks (the simulator plans one group)"
    if planning == "global" and oversize != "error":
        return f"oversize={oversize!r} under global planning"
    return ""


def planned_steps(tokens: np.ndarray, extra: Mapping[str, np.ndarray], config: LoaderConfig, *, world_size: int,
                  planning: str, epoch: int) -> int:
    """Batches each rank yields in ``epoch`` (NOTE [ The planned epoch length ]); check
    [`plan_coverage()`][plan_coverage] first.

    The simulator deals epoch 0's shards; the loader deals ``epoch``'s (seeded by ``[seed, epoch]``, or in order
    without shuffle). Giving the simulator's sample ``sim[r][j]`` the length of the loader's ``real[r][j]`` makes
    every rank read the same length sequence as the loader, so the step count is the loader's.
    """
    from ..sim import evenflow_schedule, global_schedule, shard

    n = len(tokens)
    sim = shard(n, world_size, seed=config.seed, epoch=0, shuffle=True)
    real = shard(n, world_size, seed=config.seed, epoch=epoch, shuffle=config.shuffle)
    order = np.empty(n, dtype=np.int64)
    for s, r in zip(sim, real):
        order[s] = r
    policy = global_schedule if planning == "global" else evenflow_schedule
    schedule = policy(tokens[order], world_size=world_size, grouping=config.grouping, alignment=config.alignment,
                      seed=config.seed, extra={k: v[order] for k, v in extra.items()} or None)
    return int(schedule.num_steps)


def dataset_lengths(dataset: Sequence, length_fn=None) -> np.ndarray:
    """Every sample's length as the loader measures it (NOTE [ The planned epoch length ] for the cost).

    An HF ``datasets.Dataset`` with an ``input_ids`` list column and no ``length_fn``: the Arrow offsets (no
    token read). Otherwise one pass of ``dataset[i]`` over every index (``length_fn(sample)``, default
    ``len(sample["input_ids"])``).
    """
    if length_fn is None and is_hf_dataset(dataset) and "input_ids" in dataset.column_names:
        import pyarrow.compute as pc

        # Batches of rows as Arrow tables: slices of the memory-mapped file (copies only under an indices
        # mapping, e.g. after shuffle/filter), so memory stays bounded by one batch.
        table = dataset.select_columns(["input_ids"]).with_format("arrow")
        parts = [pc.list_value_length(batch["input_ids"]).to_numpy(zero_copy_only=False)
                 for batch in table.iter(batch_size=65_536)]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    out = np.empty(len(dataset), dtype=np.int64)
    for i in range(len(dataset)):
        sample = dataset[i]
        out[i] = int(length_fn(sample)) if length_fn is not None else len(sample["input_ids"])
    return out


def is_hf_dataset(dataset: object) -> bool:
    return any(c.__module__.startswith("datasets.") and c.__name__ == "Dataset" for c in type(dataset).__mro__)
