"""Issue 34: a user's sharding, resume, media and input mistakes are refused, never trained silently.

Every numbered case of the issue, on real gloo ranks: the scenarios (tests/mistakes_scenarios.py) run one after
the other in one world of 2 ranks, so the file pays for one world start-up. What e25fa43 did is in each test's
docstring; the statistical stream check's rates are measured in benchmarks/shard_check_sim.py.
"""

from __future__ import annotations

import re

import pytest

import mistakes_scenarios as sc
from _dist import run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD = 2
CALLS = [("split_padded", "sc_split_padded", ()), ("split_crops", "sc_split_crops", ()),
         ("unsplit_shuffled", "sc_unsplit_shuffled", ()), ("split_padded_streams", "sc_split_padded_streams", ()),
         ("rank_seeded_pixels", "sc_rank_seeded_pixels", ()), ("rank_seeded_tokens", "sc_rank_seeded_tokens", ()),
         ("rank_with_nothing", "sc_rank_with_nothing", ()), ("resume_other_dataset", "sc_resume_other_dataset", ()),
         ("resume_other_stream", "sc_resume_other_stream", ()), ("set_epoch", "sc_set_epoch_discards", ()),
         ("nested", "sc_nested", ()), ("nested_workers", "sc_nested", (1,)), ("opaque", "sc_opaque", ()),
         ("opaque_workers", "sc_opaque", (1,)),
         ("media_rows", "sc_bad_media", ("rows",)), ("media_grid_1d", "sc_bad_media", ("grid_1d",)),
         ("media_mask", "sc_bad_media", ("mask",)), ("config_names", "sc_config_names", ()),
         ("careless", "sc_careless", ())]


@pytest.fixture(scope="module")
def world():
    per_rank = run_world(sc.sc_many, WORLD, CALLS, timeout=560)
    return {name: [r[name] for r in per_rank] for name, _, _ in CALLS}


def _refused_everywhere(res, *phrases):
    """Every rank ended with an error, no rank trained a batch, and each error says every phrase."""
    for r, out in enumerate(res):
        assert out["type"] in ("ValueError", "PeerError"), (r, out["type"], out["text"][-3000:])
        assert not out["ids"], (r, out["ids"])
        for phrase in phrases:
            assert phrase in out["text"], (r, phrase, out["text"][-3000:])


def _trained_once(res, n):
    for out in res:
        assert out["type"] is None, out["text"][-3000:]
    ids = sorted(i for out in res for i in out["ids"])
    assert ids == list(range(n)), (len(ids), len(set(ids)))


def _message(out) -> str:
    """The exception's own message (the traceback's last ``Type: message`` line)."""
    lines = [line for line in out["text"].splitlines() if line.startswith(f"{out['type']}: ")]
    return lines[-1] if lines else ""


# -- 1 -----------------------------------------------------------------------------------------------------------------
def test_a_split_dataset_of_padded_samples_with_a_shared_prompt_is_refused(world):
    """e25fa43: lengths and the first 16 ids match on every rank, so 48 of 96 samples trained, then a normal end."""
    _refused_everywhere(world["split_padded"], "ranks disagree on the dataset", "pass the whole dataset")


def test_a_split_dataset_with_random_crops_is_refused_naming_the_flag(world):
    """e25fa43: one changed read dropped the whole fingerprint, and half the data trained."""
    _refused_everywhere(world["split_crops"], "token ids change between reads", "shard_check=False",
                        "pass the whole dataset")


# -- 2 -----------------------------------------------------------------------------------------------------------------
def test_unsplit_streams_each_shuffled_by_rank_are_refused_in_the_first_round(world):
    """e25fa43: only the first 8 samples were compared, for an exact match: 192 reads of 96 samples at W = 2."""
    _refused_everywhere(world["unsplit_shuffled"], "streams overlap", "split_dataset_by_node", "shard_check=False")
    assert all(out["steps"] == 0 for out in world["unsplit_shuffled"])  # refused before the first batch


# -- 3 -----------------------------------------------------------------------------------------------------------------
def test_split_streams_of_padded_samples_with_a_shared_prompt_train_once(world):
    """e25fa43: refused as identical streams (their lengths and first 16 ids match), with no way past."""
    _trained_once(world["split_padded_streams"], 96)


def test_a_whole_dataset_with_pixels_augmented_by_rank_trains_once(world):
    _trained_once(world["rank_seeded_pixels"], 40)


def test_token_augmentation_seeded_by_rank_is_refused_naming_the_flag_that_gets_past_it(world):
    """e25fa43: refused with no way past. Its content differs by rank exactly as a split dataset's does, so it
    is refused -- now naming shard_check=False, which trains it."""
    res = world["rank_seeded_tokens"]
    _refused_everywhere([r["refused"] for r in res], "ranks disagree on the dataset", "shard_check=False")
    _trained_once([r["passed"] for r in res], 40)


def test_a_rank_with_an_empty_split_stream_is_not_mistaken_for_a_mistake(world):
    _trained_once(world["rank_with_nothing"], 40)


# -- 4 -----------------------------------------------------------------------------------------------------------------
def test_resume_refuses_another_map_style_dataset_of_the_same_length(world):
    """e25fa43: only num_samples was compared, so another dataset of 96 samples resumed silently."""
    res = world["resume_other_dataset"]
    for out in res:
        other = out["other"]
        assert other is not None and other["type"] == "ValueError", other
        assert "dataset" in other["text"] and "content" in other["text"], other["text"]
    for key in ("same", "v3"):  # the saved dataset resumes -- also from a state of e25fa43 (version 3)
        before = sorted(i for out in res for i in out["trained_before"])
        after = sorted(i for out in res for i in out[key]["ids"])
        assert all(out[key]["type"] is None for out in res), [out[key]["text"] for out in res]
        assert sorted(before + after) == list(range(96)), key


def test_resume_refuses_another_stream_in_its_first_round(world):
    """e25fa43: an IterableDataset state had no fingerprint at all."""
    res = world["resume_other_stream"]
    _refused_everywhere([r["other"] for r in res], "cannot resume this IterableDataset")
    assert any("first 8 samples" in r["other"]["text"] for r in res)
    assert all(r["same"]["type"] is None for r in res)


# -- 5 -----------------------------------------------------------------------------------------------------------------
def test_set_epoch_refuses_to_discard_a_loaded_mid_epoch_state(world):
    """e25fa43: set_epoch(saved + 1) dropped the state silently; 102 of 120 samples of its epoch never trained."""
    res = world["set_epoch"]
    for out in res:
        later = out["later"]
        assert later is not None and later["type"] == "ValueError", later
        assert "discard_resumed=True" in later["text"] and f"epoch {out['epoch']}" in later["text"], later["text"]
    _trained_once([r["discarded"] for r in res], 120)  # asked for explicitly: the next epoch, whole
    before = sorted(i for out in res for i in out["trained_before"])
    after = sorted(i for out in res for i in out["kept"]["ids"])
    assert before and sorted(before + after) == list(range(120))


# -- 6 -----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["nested", "nested_workers"])
def test_nested_tensors_train_under_the_default_global_planning(world, name):
    """e25fa43: a bare `RuntimeError: reshape: ... nested ...` on every rank (global planning moved the sample
    as raw bytes); with workers, the worker transport failed the same way."""
    res = world[name]
    assert all(out["planning"] == "global" for out in res)
    _trained_once(res, 60)
    assert sum(out["moved"] for out in res) > 0  # samples did travel to another rank
    for out in res:
        assert all(parts == sc.expected_parts(i) for i, parts in out["parts"].items())


def test_a_tensor_torch_cannot_pickle_is_refused_by_name_on_every_rank_when_it_must_move(world):
    """What the transfer cannot carry as bytes and torch cannot pickle (an MKL-DNN tensor): its home rank names the
    sample, the destination and planning='local'; every peer raises PeerError naming it."""
    res = world["opaque"]
    own = [out for out in res if out["type"] == "TypeError"]
    assert len(own) >= 1 and all(out["type"] in ("TypeError", "PeerError") for out in res), [o["text"] for o in res]
    for out in res:
        assert "cannot be pickled" in out["text"] and "planning='local'" in out["text"], out["text"]
    assert len({out["steps"] for out in res}) == 1  # every rank yielded as many batches before raising


def test_a_tensor_torch_cannot_move_out_of_a_worker_is_named_not_waited_for(world):
    """The worker transport leaves nested, sparse and MKL-DNN tensors to torch; torch cannot move an MKL-DNN
    tensor (its queue feeder would drop the sample, and the rank would wait out worker_timeout): the worker
    refuses it, naming the sample and the key, on every rank."""
    res = world["opaque_workers"]
    assert all(out["type"] in ("TypeError", "PeerError") for out in res), [o["text"] for o in res]
    for out in res:
        assert "cannot leave its DataLoader worker" in out["text"] and "sample index" in out["text"], out["text"]
        assert "['opaque']" in out["text"] and "worker_timeout" not in _message(out), out["text"]


# -- 7 -----------------------------------------------------------------------------------------------------------------
def _own_error(res):
    """The ranks whose own collate refused a sample: their error names the sample's dataset index."""
    own = [out for out in res if out["type"] == "SampleError"]  # evenflow.runtime.collate_extras, a ValueError
    assert own and all(out["type"] in ("SampleError", "PeerError") for out in res), [out["text"] for out in res]
    for out in own:
        assert re.search(r"sample index \d+", out["text"]), out["text"]
    return own


def test_pixel_rows_that_do_not_match_their_grid_are_refused(world):
    """e25fa43: accepted; where two samples' totals balanced, one image got the other's patches."""
    for out in _own_error(world["media_rows"]):
        assert "'pixel_values'" in out["text"] and "'image_grid_thw'" in out["text"], out["text"]
        assert "12 rows" in out["text"], out["text"]


def test_a_one_dimensional_grid_is_refused(world):
    """e25fa43: collated to shape (3k,) instead of (k, 3)."""
    for out in _own_error(world["media_grid_1d"]):
        assert "'image_grid_thw'" in out["text"] and "(3,)" in out["text"] and "(num_images, 3)" in out["text"]


def test_a_feature_mask_of_the_wrong_length_names_the_key_and_the_sample(world):
    """e25fa43: a bare reshape error naming neither."""
    for out in _own_error(world["media_mask"]):
        assert "'feature_attention_mask'" in out["text"] and "20 frames" in out["text"], out["text"]


# -- 8 -----------------------------------------------------------------------------------------------------------------
def test_refusals_name_the_argument_that_differs_and_both_values(world):
    """e25fa43: a list mixing budgets said "different loader configurations (fingerprint=...)"; another seed or
    grad_accum_steps listed all nine candidates."""
    for out in world["config_names"]:
        budgets, seed, accum = out["budgets"], out["seed"], out["grad_accum_steps"]
        assert budgets and "token_budget" in budgets["text"] and "256" in budgets["text"] and "512" in budgets["text"]
        assert "fingerprint=" not in budgets["text"], budgets["text"]
        assert seed and "seed=0" in seed["text"] and "seed=1" in seed["text"], seed["text"]
        assert "grad_accum_steps" not in _message(seed), seed["text"]
        assert accum and "grad_accum_steps=1" in accum["text"] and "grad_accum_steps=2" in accum["text"]
        assert "seed" not in _message(accum), accum["text"]


# -- 9 -----------------------------------------------------------------------------------------------------------------
def test_careless_inputs_are_refused_at_construction_saying_what_was_passed_and_what_is_expected(world):
    """e25fa43: `KeyError: 0`; `'DataLoader' object is not subscriptable`; a path read character by character;
    an empty dataset gave 0 batches and no warning. An empty epoch is warned, not refused: it ends normally on
    every rank (an empty eval split, a filter that keeps nothing on purpose), but is almost always a mistake."""
    for out in world["careless"]:
        expect = {"dict_of_lists": ("a dict of columns", "list of per-sample dicts", "KeyError: 0"),
                  "dataloader": ("a DataLoader", "loader.dataset"),
                  "path": ("a str", "'data/train.jsonl'", "load it first")}
        for name, phrases in expect.items():
            got = out[name]
            assert got["type"] == "TypeError" and not got["steps"], (name, got)
            assert "in __init__" in got["text"] and "check_dataset" in got["text"], got["text"]  # at construction
            for phrase in phrases:
                assert phrase in _message(got), (name, phrase, got["text"][-2000:])
        for name in ("empty", "empty_streams"):
            empty = out[name]
            assert empty["type"] is None and empty["steps"] == 0, empty
            assert [w for w in empty["warnings"] if "no batch on any rank" in w and "empty" in w], empty["warnings"]


# -- the pure pieces, in this process ----------------------------------------------------------------------------
def test_token_digests_see_tokens_only_in_full():
    import torch

    from evenflow.runtime.shard_check import token_digest

    a = {"input_ids": torch.arange(300), "labels": torch.arange(300), "pixel_values": torch.randn(4, 4)}
    assert token_digest(a) == token_digest(dict(a, pixel_values=torch.randn(4, 4)))  # media may change
    assert token_digest(a) == token_digest({"input_ids": list(range(300)), "labels": list(range(300))})
    late = dict(a, input_ids=torch.cat([torch.arange(299), torch.tensor([7])]))  # differs at the 300th token
    assert token_digest(a) != token_digest(late) and token_digest(a) != token_digest(dict(a, labels=None))
    assert token_digest([1, 2]) is None and token_digest({"labels": [1]}) is None


def test_the_stream_verdict_counts_pairs_across_and_within_ranks():
    import numpy as np

    from evenflow.runtime.stream_check import shared_pairs, sketch, stream_verdict

    assert shared_pairs(np.array([[5, 5, 9], [9, 7, -1]])) == (1, 1)  # 9 on both ranks; 5 twice on rank 0
    assert shared_pairs(np.array([[3, 3], [3, -1]])) == (2, 1)
    same = list(range(100, 116))
    assert "streams overlap" in stream_verdict(np.stack([sketch(same, 16, 2)] * 2), 2)
    assert stream_verdict(np.stack([sketch(same[:8], 16, 2), sketch(same[8:], 16, 2)]), 2) is None
    # Natural repeats: every sample twice, its copies dealt at random -> as many pairs across as within ranks.
    rng = np.random.default_rng(0)
    items = rng.permutation(np.repeat(np.arange(1000, 1400), 2))
    assert stream_verdict(np.stack([sketch(items[r::2].tolist(), 4096, 2) for r in range(2)]), 2) is None
    assert stream_verdict(np.stack([sketch(same, 16, 1)]), 1) is None


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_the_multimodal_collate_names_the_key_the_sample_and_the_fix():
    import torch

    from evenflow import PadCollate
    from evenflow.runtime.collate_extras import SampleError

    ok = {"input_ids": torch.ones(3, dtype=torch.long), "pixel_values": torch.zeros(16, 4),
          "image_grid_thw": torch.tensor([[1, 4, 4]])}
    video = {"input_ids": torch.ones(2, dtype=torch.long), "pixel_values_videos": torch.zeros(8, 4),
             "video_grid_thw": torch.tensor([[2, 2, 2]])}
    batch = PadCollate()([ok, video, dict(ok, pixel_values=torch.zeros(20, 4), image_grid_thw=torch.tensor(
        [[1, 4, 4], [1, 2, 2]]))])
    assert batch["pixel_values"].shape == (36, 4) and batch["image_grid_thw"].shape == (3, 3)
    cases = [(dict(ok, pixel_values=torch.zeros(12, 4)), 1, "'pixel_values' has 12 rows"),
             (dict(video, pixel_values_videos=torch.zeros(9, 4)), 1, "'pixel_values_videos' has 9 rows"),
             (dict(ok, image_grid_thw=torch.tensor([1, 4, 4])), 1, "(num_images, 3)"),
             ({"input_ids": torch.ones(2, dtype=torch.long), "input_features": torch.zeros(2, 8, 20),
               "feature_attention_mask": torch.ones(20)}, 1, "(2, 20)")]
    for bad, at, phrase in cases:
        try:
            PadCollate()([ok, bad])
        except SampleError as exc:
            assert exc.position == at and phrase in str(exc), (phrase, str(exc))
        else:
            raise AssertionError(f"accepted: {phrase}")
    nested = [{"input_ids": torch.ones(2, dtype=torch.long), "parts": torch.nested.nested_tensor([torch.ones(i + 1)])}
              for i in range(2)]
    assert isinstance(PadCollate()(nested)["parts"], list)  # ragged: handed over as a list, never stacked


def test_set_epoch_discards_only_what_it_says():
    from evenflow.runtime.loader.state import discarded

    mid = dict(epoch=2, step=3, finished=False, consumed=[1, 2], next_carry=[], join=True)
    assert discarded(mid, 2) is None and "rest of epoch 2" in discarded(mid, 3) and discarded(mid, 1)
    done = dict(mid, finished=True)
    assert discarded(done, 3) is None and discarded(done, 7) is None  # join mode: nothing carried
    carry = dict(done, next_carry=[(2, 5)], join=False)
    assert discarded(carry, 3) is None and "this rank carries 1" in discarded(carry, 4)
    assert "a peer's state may carry" in discarded(dict(carry, next_carry=[]), 4)  # refused on every rank alike


def test_what_is_not_a_dataset_is_named():
    import pytest as _pytest
    import torch

    from evenflow.runtime.source import check_dataset

    check_dataset({0: {"input_ids": [1]}, 1: {"input_ids": [2]}})  # positions as keys: a map-style dataset
    check_dataset([])  # empty: warned at the epoch's end, not refused
    with _pytest.raises(TypeError, match=r"of splits \['train', 'test'\].*dataset\['train'\]"):
        check_dataset({"train": torch.utils.data.TensorDataset(torch.ones(2)),
                       "test": torch.utils.data.TensorDataset(torch.ones(1))})
    with _pytest.raises(TypeError, match="an iterator, readable once"):
        check_dataset(iter([{"input_ids": [1]}]))
    with _pytest.raises(TypeError, match="got a int as its dataset"):
        check_dataset(3)


@pytest.mark.parametrize("name", ["mistakes-set-epoch", "mistakes-columns"])
def test_the_pages_examples_print_what_the_page_shows(name):
    """docs/mistakes.md: each example runs, and prints the output shown under it."""
    import contextlib
    import io

    from _snippets import all_snippets, blocks, snippet

    page = all_snippets()[name].page
    shown = blocks(page)
    after = shown[[b.name for b in shown].index(name) + 1]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(snippet(name), {"__name__": "__snippet__"})  # noqa: S102 - the page's own code
    assert out.getvalue() == after.code, out.getvalue()
