"""The default collates collate every key of every sample by what it means, and never drop one silently.

NOTE [ Extra keys in the default collates ] (evenflow.runtime.collate_extras): image/audio keys are per-item rows
(an absent key adds no rows), other keys must be on every sample or the batch is refused naming the key and the
sample. Unit checks on the layout HF models consume, then real gloo worlds under global planning, where one
batch mixes samples that different ranks read.
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
import torch
from torch.utils.data import Dataset

import evenflow
from _dist import RankFailed, run_world
from evenflow.runtime.collate_extras import MissingKeyError

DIM = 12
TAGGED = 17


def _image(i: int, patches: int) -> dict:
    """A Qwen2-VL-style image sample whose patch rows all hold ``i`` (so a batch names its images)."""
    return {"input_ids": torch.full((patches // 4 + 3,), 5), "pixel_values": torch.full((patches, DIM), float(i)),
            "image_grid_thw": torch.tensor([[1, 2, patches // 2]])}


def _text(n: int) -> dict:
    return {"input_ids": torch.arange(1, n + 1)}


@pytest.mark.parametrize("collate", [evenflow.PadCollate(), evenflow.FlatCollate()], ids=["pad", "flat"])
def test_images_are_concatenated_whatever_the_patch_counts_and_text_only_samples_add_none(collate):
    equal = collate([_image(1, 16), _image(2, 16), _image(3, 16)])  # equal patch counts: still (N, DIM)
    assert equal["pixel_values"].shape == (48, DIM) and equal["image_grid_thw"].shape == (3, 3)
    mixed = collate([_text(5), _image(7, 8), _text(3), _image(9, 16)])  # text-only first (issue: KeyError)
    assert mixed["pixel_values"].shape == (24, DIM)
    assert mixed["pixel_values"][:8].eq(7).all() and mixed["pixel_values"][8:].eq(9).all()  # sample order
    assert mixed["image_grid_thw"].tolist() == [[1, 2, 4], [1, 2, 8]]
    image_first = collate([_image(7, 8), _text(5)])  # a text-only sample later in the batch is no error
    assert image_first["pixel_values"].shape == (8, DIM) and image_first["image_grid_thw"].shape == (1, 3)
    assert "pixel_values" not in collate([_text(2), _text(4)])


def test_audio_clips_are_padded_with_their_mask():
    a = {"input_ids": torch.arange(4), "input_features": torch.ones(80, 10)}
    b = {"input_ids": torch.arange(6), "input_features": 2 * torch.ones(80, 6)}
    out = evenflow.PadCollate()([_text(3), a, b])
    assert out["input_features"].shape == (2, 80, 10)
    assert out["feature_attention_mask"].tolist() == [[1] * 10, [1] * 6 + [0] * 4]
    assert out["input_features"][1, :, 6:].eq(0).all() and out["input_features"][1, :, :6].eq(2).all()


def test_a_metadata_key_missing_on_one_sample_is_refused_naming_it():
    samples = [_text(3), {**_text(4), "weight": torch.tensor(0.5)}, _text(2)]
    with pytest.raises(MissingKeyError, match=r"sample 0 of the batch \(of 3\) has no 'weight' key.*sample 1") as e:
        evenflow.PadCollate()(samples)
    assert e.value.position == 0
    ok = evenflow.PadCollate()([{**s, "weight": torch.tensor(1.0)} for s in samples])
    assert ok["weight"].shape == (3,)


def test_row_keys_are_configurable():
    samples = [{**_text(3), "boxes": torch.zeros(2, 4)}, _text(2), {**_text(2), "boxes": torch.ones(1, 4)}]
    out = evenflow.PadCollate(row_keys=("boxes",))(samples)
    assert out["boxes"].shape == (3, 4)


# -- real processes: global planning mixes ranks' samples in one batch -----------------------------------------

class _HalfImages(Dataset):
    """Even samples carry an image whose patch rows hold the sample index; odd samples are text-only.

    With ``tag=True`` sample ``TAGGED`` also carries a metadata key the others lack (as a sample from another
    source of a concatenated dataset can)."""

    def __init__(self, n: int, tag: bool = False) -> None:
        self.n, self.tag = n, tag

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = torch.full((8 + (i * 7) % 40,), i)
        sample = {"input_ids": ids, "labels": ids}
        if i % 2 == 0:
            patches = 4 * (1 + i % 3)
            sample["pixel_values"] = torch.full((patches, DIM), float(i))
            sample["image_grid_thw"] = torch.tensor([[1, 2, patches // 2]])
        if self.tag and i == TAGGED:
            sample["source"] = torch.tensor(i)
        return sample


def _images_reach_the_trainer(rank, world, n):
    loader = evenflow.DynamicBatchLoader(_HalfImages(n), token_budget=256, planning="global", buffer_size=16,
                                         timeout=timedelta(seconds=60))
    seen, images = [], []
    try:
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            if info.is_idle:
                continue
            ids = [int(row[0]) for row in batch["input_ids"]]
            seen.extend(ids)
            expected = [i for i in ids if i % 2 == 0]
            if "pixel_values" in batch:
                rows = batch["pixel_values"][:, 0].tolist()
                got = [int(v) for k, v in enumerate(rows) if k == 0 or v != rows[k - 1]]
                images.append((expected, got, batch["image_grid_thw"].shape[0]))
            else:
                images.append((expected, [], 0))
    finally:
        loader.close()
    return seen, images


@pytest.mark.multiprocess
def test_global_planning_keeps_every_image_of_every_batch():
    """Images on half the samples, 3 ranks, global planning: every batch holds exactly its samples' images, in
    order, whatever rank read them and whichever sample comes first (at fbdadc2: dropped when samples[0] was
    text-only, KeyError the other way)."""
    results = run_world(_images_reach_the_trainer, 3, 90, timeout=180)
    seen = sorted(i for ids, _ in results for i in ids)
    assert seen == list(range(90))
    batches = [b for _, images in results for b in images]
    assert batches and all(expected == got and grid == len(expected) for expected, got, grid in batches)
    assert sum(len(expected) for expected, _, _ in batches) == 45


def _tagged(rank, world, n):
    loader = evenflow.DynamicBatchLoader(_HalfImages(n, tag=True), token_budget=256, planning="global",
                                         buffer_size=16, timeout=timedelta(seconds=60))
    tagged = 0
    try:
        for batch in loader:
            evenflow.pop_step_info(batch)
            tagged += len(batch.get("source", []))
    finally:
        loader.close()
    return tagged


@pytest.mark.multiprocess
def test_a_key_on_some_samples_is_refused_on_every_rank_naming_the_sample():
    """A metadata key on half the samples: never silently dropped (at fbdadc2 it reached the trainer for a part
    of the samples that had it): the rank that collates such a batch raises naming the key and the sample's
    dataset index, every peer raises PeerError naming it too."""
    results = run_world(_tagged, 2, 60, timeout=180, allow_errors=True)
    assert all(isinstance(r, RankFailed) for r in results), results
    texts = [r.text for r in results]
    assert sorted(t.split(":")[0] for t in texts) == ["MissingKeyError", "PeerError"], texts
    for t in texts:  # both name the key, and the dataset index of a sample without it (not the tagged one)
        named = re.findall(r"sample index (\d+)", t)
        assert "'source'" in t and named and all(int(i) != TAGGED for i in named), t
