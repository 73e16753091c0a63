"""Issue 10, classes 5 and 7: states that must be refused on load, and reporting that must be right.

In one process (world size 1): what a single rank can check. Cross-rank refusals (torn checkpoints, a state
loaded on some ranks only, datasets of different length) run on real worlds in test_faults.py.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch

import evenflow
import loader_scenarios as sc


def _loader(ds=None, **kw):
    kw.setdefault("token_budget", sc.BUDGET)
    kw.setdefault("buffer_size", 16)
    kw.setdefault("seed", 7)
    return evenflow.DynamicBatchLoader(ds if ds is not None else sc.TokenDataset(120), **kw)


def _state_after(loader, steps):
    for k, batch in enumerate(loader, 1):
        evenflow.pop_step_info(batch)
        if k == steps:
            state = loader.state_dict()
            break
    loader.close()
    return state


@pytest.fixture(scope="module")
def mid_state():
    return _state_after(_loader(), 3)


@pytest.fixture(scope="module")
def quota_state():
    loader = _loader(join=False)
    for batch in loader:
        evenflow.pop_step_info(batch)
    state = loader.state_dict()
    loader.close()
    return state


TAMPER = {
    "consumed_as_string": (lambda s: s.update(consumed="0,1,2"), "state['consumed'] is str"),
    "epoch_as_string": (lambda s: s.update(epoch="0"), "state['epoch'] is str"),
    "epoch_as_bool": (lambda s: s.update(epoch=True), "state['epoch'] is bool"),
    "carry_minus_one": (lambda s: s.update(carry=[-1]), "not a sample key"),
    "consumed_out_of_range": (lambda s: s["consumed"].append(10_000), "not a sample key"),
    "consumed_twice": (lambda s: s["consumed"].append(s["consumed"][0]), "twice"),
    "missing_field": (lambda s: s.pop("step"), "lacks fields ['step']"),
    "extra_field": (lambda s: s.update(sampler=1), "unknown fields ['sampler']"),
    "finished_flipped": (lambda s: s.update(finished=True), "finished but"),
    "step_negative": (lambda s: s.update(step=-2), "negative"),
}


@pytest.mark.parametrize("name", sorted(TAMPER))
def test_tampered_states_are_refused_naming_the_field(mid_state, name):
    state = copy.deepcopy(mid_state)
    edit, text = TAMPER[name]
    edit(state)
    with pytest.raises(ValueError, match="cannot resume") as info:
        _loader().load_state_dict(state)
    assert text in str(info.value), str(info.value)


def test_consumed_indices_outside_the_ranks_shard_are_refused(mid_state):
    # As rank 0 of 2 would check it: the even indices are its shard, an odd consumed index is someone else's.
    from evenflow.runtime.resume import validate_state
    state = copy.deepcopy(mid_state)
    state["consumed"] = [0, 2, 3]
    with pytest.raises(ValueError, match="never held"):
        validate_state(state, num_samples=120, shard=list(range(0, 120, 2)), num_workers=0)
    state["consumed"] = [0, 2, 4]
    assert validate_state(state, num_samples=120, shard=list(range(0, 120, 2)), num_workers=0)["consumed"] == [0, 2, 4]


def test_quota_finished_state_with_wrong_carry_is_refused(quota_state):
    assert quota_state["finished"]
    state = copy.deepcopy(quota_state)
    state["next_carry"] = state["next_carry"] + [(0, 5)] if (0, 5) not in state["next_carry"] else []
    with pytest.raises(ValueError, match="next_carry does not match"):
        _loader(join=False).load_state_dict(state)


def test_untouched_states_still_load(mid_state, quota_state):
    _loader().load_state_dict(copy.deepcopy(mid_state))
    _loader(join=False).load_state_dict(copy.deepcopy(quota_state))


def test_iterable_resume_with_other_num_workers_is_refused():
    state = _state_after(_loader(sc.RankStream(0, 80, 0)), 2)
    with pytest.raises(ValueError, match="num_workers=1.*saved with num_workers=0"):
        _loader(sc.RankStream(0, 80, 0), num_workers=1, worker_timeout=timedelta(seconds=60)).load_state_dict(state)


# -- class 7: reporting ------------------------------------------------------------------------------------
def test_len_before_an_epoch_is_that_epochs_bound():
    loader = _loader(sc.TokenDataset(300))
    for batch in loader:
        evenflow.pop_step_info(batch)
    ran = len(loader)
    loader.set_epoch(1)
    assert len(loader) == 300 >= ran  # the rank-independent bound of the new epoch, not the old count
    loader.close()


def test_len_of_an_iterable_is_unknown_not_the_steps_so_far():
    loader = _loader(sc.RankStream(0, 50, 0))
    it = iter(loader)
    evenflow.pop_step_info(next(it))
    with pytest.raises(TypeError, match="unknown for an IterableDataset"):
        len(loader)
    it.close()
    loader.close()


def test_summed_padded_tokens_are_the_real_row():
    class Fixed(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            n = 170 if i < 3 else 2
            return {"input_ids": torch.ones(n, dtype=torch.long)}
    loader = _loader(Fixed(), token_budget=512, cost="summed", pad_to_multiple_of=8, shuffle=False)
    infos = []
    for batch in loader:
        info = evenflow.pop_step_info(batch)
        infos.append(info)
        assert info.padded_tokens == batch["input_ids"].numel() <= 512
    assert sum(i.real_tokens for i in infos) == 512


class _Bad(torch.utils.data.Dataset):
    def __init__(self, kind):
        self.kind = kind

    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == 7 and self.kind == "raise":
            raise RuntimeError("decoder exploded")
        ids = torch.ones(5, dtype=torch.long)
        if i == 7 and self.kind == "bool":
            ids = torch.ones(5, dtype=torch.bool)
        if i == 7 and self.kind == "ragged":
            return {"input_ids": [[1, 2], [3]]}
        return {"input_ids": ids, "index": i}


@pytest.mark.parametrize("kind, workers, context", [
    ("raise", 0, None), ("raise", 1, "fork"), ("raise", 1, "spawn"), ("bool", 0, None), ("ragged", 0, None)])
def test_bad_samples_name_their_index(kind, workers, context):
    loader = _loader(_Bad(kind), num_workers=workers, multiprocessing_context=context, shuffle=False,
                     worker_timeout=timedelta(seconds=120))
    with pytest.raises(Exception) as info:
        for batch in loader:
            evenflow.pop_step_info(batch)
    text = str(info.value) + " ".join(getattr(info.value, "__notes__", []))
    assert "sample index 7" in text or "sample 7" in text, text
    loader.close()


def test_collate_returning_a_list_names_the_samples():
    loader = _loader(sc.TokenDataset(20), collate_fn=lambda samples: [s["input_ids"] for s in samples])
    with pytest.raises(TypeError, match=r"collate_fn returned list for samples \[\d+"):
        for batch in loader:
            pass
    loader.close()


def test_worker_timeout_must_leave_room_for_the_report():
    with pytest.raises(ValueError, match="worker_timeout=.* must be shorter than timeout"):
        _loader(num_workers=1, timeout=timedelta(seconds=30), worker_timeout=timedelta(seconds=30))
