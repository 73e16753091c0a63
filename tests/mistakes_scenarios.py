"""Issue 34's user mistakes, as scenarios run one after the other in one gloo world (tests/test_mistakes.py).

Each scenario returns, per rank, a plain dict: ``ids`` (the sample identities it trained), ``type`` and ``text``
(the exception that ended it, with its notes: the rank and sample it names) or ``None``, plus what it measured.
A scenario never raises: a world runs them all, so one that fails (at e25fa43: an unknown argument) reports
and the next one starts after a barrier.
"""

from __future__ import annotations

import pickle
import traceback
import warnings
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset

import evenflow

T = timedelta(seconds=40)
PROMPT = list(range(101, 121))  # a 20-token system prompt every sample starts with
WIDTH = 128  # every sample padded to this length (padding="max_length")


def _padded_rows(n: int = 96, seed: int = 0) -> list[dict]:
    """Chat-like samples after a shared system prompt, padded to a fixed length: equal lengths, equal first 20
    tokens (the shape that fooled the old check, which compared lengths and the first 16 ids)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        content = rng.integers(1000, 30000, int(rng.integers(5, 60))).tolist()
        ids = PROMPT + content + [0] * (WIDTH - len(PROMPT) - len(content))
        labels = [-100] * len(PROMPT) + content + [-100] * (WIDTH - len(PROMPT) - len(content))
        rows.append({"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "idx": i})
    return rows


def _distinct_rows(n: int, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": torch.tensor([7, i] + rng.integers(1, 500, int(rng.integers(2, 40))).tolist()), "idx": i}
            for i in range(n)]


class Rows(Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Stream(IterableDataset):
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


class RandomCrops(Dataset):
    """A random 32-token window of each long document on every read (unseeded): token ids change between reads."""

    def __init__(self, docs):
        self.docs = docs

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        doc = self.docs[i]
        start = int(torch.randint(0, len(doc) - 32, ()))
        return {"input_ids": doc[start:start + 32], "idx": int(doc[0])}


class Augmented(Dataset):
    """A whole multimodal dataset whose augmentation is seeded by (rank, index): pixels always; with
    ``tokens=True`` also the number of image tokens (a random resize changes the patch count)."""

    def __init__(self, rank, n=40, tokens=False):
        self.rank, self.n, self.tokens = rank, n, tokens

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 * self.rank + i)
        side = 4 + (int(torch.randint(0, 2, (), generator=g)) if self.tokens else 0)
        grid = torch.tensor([[1, side, side]])
        pad = [9] * (side * side // 4)  # image tokens after merging 2x2 patches
        return {"input_ids": torch.tensor([1, i] + pad + [2] * (i % 7)), "idx": i,
                "pixel_values": torch.randn(side * side, 12, generator=g), "image_grid_thw": grid}


def _record(loader, epoch=None) -> dict:
    """Train one epoch under ``with loader:``; the trained identities, or the exception that ended it."""
    ids, out = [], {"type": None, "text": "", "steps": 0}
    try:
        with loader:
            if epoch is not None:
                loader.set_epoch(epoch)
            for batch in loader:
                info = evenflow.pop_step_info(batch)
                out["steps"] += 1
                if not info.is_idle:
                    ids.extend(int(v) for v in batch["idx"])
    except Exception as exc:  # noqa: BLE001 - the scenario's outcome
        out.update(type=type(exc).__name__, text="".join(traceback.format_exception(exc)))
    out["ids"] = ids
    return out


def _failed(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "text": "".join(traceback.format_exception(exc)), "ids": [], "steps": 0}


def _loader(ds, **kw):
    return evenflow.DynamicBatchLoader(ds, **({"token_budget": 1024, "timeout": T} | kw))


# -- 1. a dataset split per rank -------------------------------------------------------------------------------
def sc_split_padded(rank, world):
    return _record(_loader(Rows(_padded_rows()[rank::world])))


def sc_split_crops(rank, world):
    g = torch.Generator().manual_seed(5)
    docs = [torch.cat([torch.tensor([i]), torch.randint(1, 30000, (200,), generator=g)]) for i in range(96)]
    return _record(_loader(RandomCrops(docs[rank::world])))


# -- 2. unsplit streams, each rank shuffling with its own seed ------------------------------------------------------
def sc_unsplit_shuffled(rank, world):
    rows = _distinct_rows(96)
    order = np.random.default_rng(rank).permutation(len(rows))
    return _record(_loader(Stream([rows[i] for i in order])))


# -- 3. correct data: split padded streams, rank-seeded augmentation --------------------------------------------
def sc_split_padded_streams(rank, world):
    return _record(_loader(Stream(_padded_rows()[rank::world])))


def sc_rank_seeded_pixels(rank, world):
    return _record(_loader(Augmented(rank)))


def sc_rank_seeded_tokens(rank, world):
    refused = _record(_loader(Augmented(rank, tokens=True)))
    try:
        passed = _record(_loader(Augmented(rank, tokens=True), shard_check=False))
    except Exception as exc:  # noqa: BLE001 - e25fa43 has no such argument
        passed = _failed(exc)
    return {"refused": refused, "passed": passed}


def sc_rank_with_nothing(rank, world):
    """A split stream where one rank has no sample at all (a rank with nothing to do): trains, no refusal."""
    rows = _padded_rows(40)
    return _record(_loader(Stream(rows if rank == 0 else []), idle_sample=rows[0]))


# -- 4. resume onto another dataset ---------------------------------------------------------------------------------
def _state_after(loader, steps):
    it = iter(loader)
    for _ in range(steps):
        evenflow.pop_step_info(next(it))
    state = loader.state_dict()
    loader.close()
    return state


def sc_resume_other_dataset(rank, world):
    rows = _padded_rows(96)
    state = _state_after(_loader(Rows(rows), token_budget=512), 2)
    other = _padded_rows(96, seed=9)  # same length, same prompt and padding, other samples
    out = {}
    try:
        _loader(Rows(other), token_budget=512).load_state_dict(state)
        out["other"] = None
    except Exception as exc:  # noqa: BLE001
        out["other"] = _failed(exc)
    same = _loader(Rows(rows), token_budget=512)
    same.load_state_dict(state)
    out["same"] = _record(same)
    out["trained_before"] = sorted(state["consumed"])
    old = {k: v for k, v in state.items() if k not in ("content", "config")} | {"version": 3}
    e25 = _loader(Rows(rows), token_budget=512)
    e25.load_state_dict(old)  # a state saved at e25fa43 (version 3) still resumes
    out["v3"] = _record(e25)
    return out


def sc_resume_other_stream(rank, world):
    rows = _distinct_rows(96)
    mine = rows[rank::world]
    state = _state_after(_loader(Stream(mine), token_budget=256, buffer_size=16), 2)
    other = [dict(r, input_ids=r["input_ids"] + 1) for r in mine]  # another stream of the same length
    refused = _loader(Stream(other), token_budget=256, buffer_size=16)
    refused.load_state_dict(state)
    same = _loader(Stream(mine), token_budget=256, buffer_size=16)
    same.load_state_dict(state)
    return {"other": _record(refused), "same": _record(same)}


# -- 5. set_epoch after loading a mid-epoch state ------------------------------------------------------------------
def sc_set_epoch_discards(rank, world):
    rows = _distinct_rows(120)
    state = _state_after(_loader(Rows(rows), token_budget=128), 3)
    out = {"epoch": state["epoch"]}
    loader = _loader(Rows(rows), token_budget=128)
    loader.load_state_dict(state)
    try:
        loader.set_epoch(state["epoch"] + 1)
        out["later"] = None
    except Exception as exc:  # noqa: BLE001
        out["later"] = _failed(exc)
    try:
        loader.set_epoch(state["epoch"] + 1, discard_resumed=True)
        out["discarded"] = _record(loader)
    except Exception as exc:  # noqa: BLE001 - e25fa43 has no discard_resumed
        out["discarded"] = _failed(exc)
    kept = _loader(Rows(rows), token_budget=128)
    kept.load_state_dict(state)
    out["kept"] = _record(kept, epoch=state["epoch"])  # the saved epoch itself: resumed
    out["trained_before"] = sorted(state["consumed"])
    return out


# -- 6. nested tensors under the default global planning -------------------------------------------------------
class Nested(Dataset):
    """Long-tail lengths (so global planning moves samples) and a nested tensor of two ragged parts each."""

    def __init__(self, n=60):
        rng = np.random.default_rng(3)
        self.lengths = np.clip(rng.lognormal(3.0, 1.0, n).astype(int) + 2, 2, 250)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        parts = torch.nested.nested_tensor([torch.arange(i % 5 + 1), torch.full((i % 3 + 2,), i)])
        return {"input_ids": torch.full((int(self.lengths[i]),), i), "parts": parts, "idx": i}


def expected_parts(i):
    return [list(range(i % 5 + 1)), [i] * (i % 3 + 2)]


def sc_nested(rank, world, workers=0):
    warnings.filterwarnings("ignore", message=".*nested tensors.*")
    loader = _loader(Nested(), token_budget=256, buffer_size=24, num_workers=workers,
                     worker_timeout=timedelta(seconds=30))
    out = {"type": None, "text": "", "ids": [], "parts": {}, "moved": 0}
    try:
        with loader:
            for batch in loader:
                info = evenflow.pop_step_info(batch)
                if info.is_idle:
                    continue
                for i, parts in zip(batch["idx"], batch["parts"]):
                    out["ids"].append(int(i))
                    out["parts"][int(i)] = [p.tolist() for p in parts.unbind()]
        out["moved"] = loader.moves.samples
    except Exception as exc:  # noqa: BLE001
        out.update(_failed(exc), parts={}, moved=loader.moves.samples)
    out["planning"] = loader.planning
    return out


class Opaque(Nested):
    """An MKL-DNN tensor in every sample: torch cannot pickle it, so it cannot travel to another rank."""

    def __getitem__(self, i):
        return {"input_ids": torch.full((int(self.lengths[i]),), i), "idx": i, "opaque": torch.ones(2, 2).to_mkldnn()}


def sc_opaque(rank, world, workers=0):
    return _record(_loader(Opaque(), token_budget=256, buffer_size=24, num_workers=workers,
                           worker_timeout=timedelta(seconds=30)))


# -- 7. the multimodal collate ----------------------------------------------------------------------------------------
class BadMedia(Dataset):
    def __init__(self, kind, n=12):
        self.kind, self.n = kind, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = {"input_ids": torch.full((6 + i % 4,), i), "idx": i}
        if self.kind == "rows":  # grids of 16 and 8 patches, 12 rows each: two samples' totals balance
            s["image_grid_thw"] = torch.tensor([[1, 4, 4]] if i % 2 else [[1, 2, 4]])
            s["pixel_values"] = torch.randn(12, 10)
        elif self.kind == "grid_1d":
            s["image_grid_thw"] = torch.tensor([1, 4, 4])
            s["pixel_values"] = torch.randn(16, 10)
        elif self.kind == "mask":
            s["input_features"] = torch.randn(8, 20)
            s["feature_attention_mask"] = torch.ones(15, dtype=torch.long)
        return s


def sc_bad_media(rank, world, kind):
    return _record(_loader(BadMedia(kind), planning="local"))


# -- 8. refusals that name what changed ---------------------------------------------------------------------------
def _states_of(**kw) -> list[dict]:
    state = _loader(Rows(_distinct_rows(40)), **kw).state_dict()
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, state)
    return got


def sc_config_names(rank, world):
    out = {}
    small, large = _states_of(token_budget=256), _states_of(token_budget=512)
    for name, states, kw in (("budgets", [small[0], large[1]], dict(token_budget=256)),
                             ("seed", small[rank], dict(token_budget=256, seed=1)),
                             ("grad_accum_steps", small[rank], dict(token_budget=256, grad_accum_steps=2))):
        try:
            _loader(Rows(_distinct_rows(40)), **kw).load_state_dict(states)
            out[name] = None
        except Exception as exc:  # noqa: BLE001
            out[name] = _failed(exc)
    return out


# -- 9. careless inputs -------------------------------------------------------------------------------------------
def sc_careless(rank, world):
    rows = _distinct_rows(8)
    inputs = {"dict_of_lists": {"input_ids": [r["input_ids"].tolist() for r in rows], "idx": list(range(8))},
              "dataloader": DataLoader(Rows(rows), batch_size=2),
              "path": "data/train.jsonl"}
    out = {}
    for name, ds in inputs.items():
        try:
            loader = _loader(ds)
            out[name] = _record(loader)
        except Exception as exc:  # noqa: BLE001
            out[name] = _failed(exc)
    for name, ds, kw in (("empty", [], {}), ("empty_streams", Stream([]), dict(idle_sample=rows[0]))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[name] = _record(_loader(ds, **kw))
        out[name]["warnings"] = [str(w.message) for w in caught]
    return out


def sc_many(rank, world, calls):
    """Run scenarios in order, a barrier between them, each result picklable (``calls``: [(name, fn, args)])."""
    results = {}
    for name, fn, args in calls:
        dist.barrier()
        try:
            results[name] = globals()[fn](rank, world, *args)
        except Exception as exc:  # noqa: BLE001 - recorded; the next scenario still runs
            results[name] = _failed(exc)
        pickle.dumps(results[name])
    return results
