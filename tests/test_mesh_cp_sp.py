"""The loader on a context- / sequence-parallel mesh: shard-ready batches, exact loss over DP x CP/SP, mistakes.

Two module-level worlds of 4 gloo ranks, dp=2 x sp=2 (Ulysses) and dp=2 x cp=2 (ring), each running every
multi-process check once (tests/mesh_scenarios.py: reference attentions registered through transformers'
``AttentionInterface``). Exactness is against stock sdpa in one process, each sample alone, per-token mean over
the same global batch: fp64 <= 1e-10, fp32 <= 1e-5. The single-process tests below pin the layout itself.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

import evenflow
from evenflow.planning.shard import ShardLayout, shard_token_indices
from evenflow.runtime.collate import FlatCollate, PadCollate

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason="needs the 'hf' extra: pip install 'evenflow[hf]'")


# -- the layout, in one process -----------------------------------------------------------------------------------
def _docs(*lengths, start=1):
    g = torch.Generator().manual_seed(sum(lengths))
    return [{"input_ids": torch.randint(start, 50, (n,), generator=g)} for n in lengths]


@pytest.mark.parametrize("degree", [1, 2, 3])
def test_ring_rows_pad_each_document_and_split_head_tail(degree):
    samples = _docs(5, 3, 9, 1)
    layout = ShardLayout("ring", degree)
    batch = FlatCollate(shard=layout)(samples)
    cu = batch["cu_seqlens_padded"].tolist()
    assert all((b - a) % (2 * degree) == 0 for a, b in zip(cu, cu[1:]))
    assert batch["cu_seqlens_unpadded"].tolist() == [0, 5, 8, 17, 18]
    # every rank holds the same number of tokens of every document: chunk r and chunk 2C-1-r
    shards = [evenflow.shard_batch(batch, degree, style="ring", rank=r) for r in range(degree)]
    assert len({s["input_ids"].shape[1] for s in shards}) == 1
    seg = cu[1] - cu[0]
    chunk = seg // (2 * degree)
    last = degree - 1
    assert shard_token_indices([seg], layout, last)[:chunk].tolist() == list(range(last * chunk, (last + 1) * chunk))
    back = evenflow.unshard_batch(shards, style="ring")
    for key in ("input_ids", "labels", "shift_labels", "position_ids"):
        assert torch.equal(back[key], batch[key]), key


@pytest.mark.parametrize("style", ["ring", "ulysses"])
def test_shift_labels_never_cross_a_document_and_count_what_the_loader_counts(style):
    samples = _docs(5, 3, 9)
    for s in samples:
        s["labels"] = s["input_ids"].clone()
        s["labels"][:2] = -100
    batch = FlatCollate(shard=ShardLayout(style, 2))(samples)
    shift, ids = batch["shift_labels"][0], batch["input_ids"][0]
    cu = batch["cu_seqlens_padded"].tolist()
    real = torch.diff(batch["cu_seqlens_unpadded"]).tolist()
    for i, (a, n) in enumerate(zip(cu, real)):
        doc = samples[i]["labels"]
        assert shift[a:a + n - 1].tolist() == doc[1:].tolist()          # predicts its own successor
        assert shift[a + n - 1:cu[i + 1]].eq(-100).all()                 # its last token and its padding: none
    assert ids.shape[0] % (2 if style == "ulysses" else 4) == 0
    counted = sum(evenflow.count_loss_tokens(s["labels"]) for s in samples)
    assert int((shift != -100).sum()) == counted


def test_ulysses_rows_pad_the_row_and_keep_position_rows():
    batch = FlatCollate(shard=ShardLayout("ulysses", 4))(_docs(5, 6))
    assert batch["input_ids"].shape[1] == 12 and batch["cu_seqlens_unpadded"].tolist() == [0, 5, 11]
    four = {**batch, "position_ids": torch.stack([batch["position_ids"] + k for k in range(4)])}  # [4, 1, N]
    shard = evenflow.shard_batch(four, 4, style="ulysses", rank=1)
    assert shard["position_ids"].shape == (4, 1, 3)
    assert shard["position_ids"][2, 0].tolist() == [p + 2 for p in four["position_ids"][0, 0, 3:6].tolist()]
    assert torch.equal(evenflow.unshard_batch([evenflow.shard_batch(four, 4, style="ulysses", rank=r)
                                               for r in range(4)], style="ulysses")["position_ids"],
                       four["position_ids"])


def test_padded_rows_split_like_torch_head_tail():
    batch = PadCollate(shard=ShardLayout("ring", 2))(_docs(6, 3))
    assert batch["input_ids"].shape == (2, 8)
    shard = evenflow.shard_batch(batch, 2, style="ring", rank=0)
    assert torch.equal(shard["input_ids"], batch["input_ids"][:, [0, 1, 6, 7]])
    assert torch.equal(batch["shift_labels"][:, :-1], batch["labels"][:, 1:])


def test_budget_and_segments_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"token_budget=50 is not a multiple of 4 .*token_budget=48 or 52"):
        ShardLayout("ring", 2).check_budget(50)
    with pytest.raises(ValueError, match="pad every document to a multiple of 4"):
        shard_token_indices([6], ShardLayout("ring", 2), 0)
    with pytest.raises(ValueError, match="style='ring'"):
        evenflow.shard_batch({"input_ids": torch.zeros(1, 4)}, 2, rank=0)


def test_the_pages_shard_example_runs():
    from _snippets import snippet

    exec(snippet("long-context-shard"), {})  # noqa: S102 - the documentation's own code


def test_scale_loss_counts_the_whole_mesh():
    info = evenflow.StepInfo(step=0, epoch=0, is_idle=False, local_samples=1, global_samples=2, local_loss_tokens=3,
                             global_loss_tokens=4, loss_scale=2 * 2 * 3 / 4, padded_tokens=8, real_tokens=8,
                             world_size=2, window_loss_tokens=4, shard_degree=2)
    assert evenflow.scale_loss(torch.tensor(1.0), info, reduction="sum").item() == 1.0  # 2 x 2 ranks / 4 tokens


# -- real processes: one world per mesh ----------------------------------------------------------------------------
@functools.cache
def _both() -> list:
    from _dist import run_world

    import mesh_scenarios

    return run_world(mesh_scenarios.world, 4, timeout=600, pg_timeout_s=120)


def _world(dim: str) -> list:
    """Per rank, the results of the checks on the dp=2 x ``dim``=2 mesh (one module-level world for both)."""
    return [rank[dim] for rank in _both()]


MESHES = [pytest.param("sp", marks=[needs_hf, pytest.mark.multiprocess]),
          pytest.param("cp", marks=[needs_hf, pytest.mark.multiprocess])]


@pytest.mark.parametrize("dim", MESHES)
def test_loss_and_every_gradient_equal_one_process(dim):
    out = _world(dim)[0]
    windows, loss64, grad64 = out["fp64"]
    assert windows >= 2                            # grad_accum_steps=2, more than one optimizer step
    assert loss64 <= 1e-10 and grad64 <= 1e-10, out["fp64"]
    _, loss32, grad32 = out["fp32"]
    assert loss32 <= 1e-5 and grad32 <= 1e-5, out["fp32"]


@pytest.mark.parametrize("dim", MESHES[:1])
def test_eval_loss_under_sp_equals_one_process(dim):
    mesh_loss, ref_loss, tokens, ref_tokens = _world(dim)[0]["eval"]
    assert tokens == ref_tokens                    # each supervised token counted once, not once per SP rank
    assert abs(mesh_loss - ref_loss) <= 1e-10


@pytest.mark.parametrize("dim", MESHES[:1])
def test_stock_qwen2_vl_with_four_position_rows_under_sp(dim):
    windows, loss, grad = _world(dim)[0]["vlm"]
    assert windows >= 1 and loss <= 1e-10 and grad <= 1e-10, (loss, grad)


@pytest.mark.parametrize("dim", MESHES)
def test_resume_same_mesh_exact_other_degree_refused(dim):
    for same, steps, done, refused in (rank["resume"] for rank in _world(dim)):
        assert same and 0 < done < steps          # resumed mid-epoch, the rest equal to the uninterrupted run
        assert refused is not None and "mesh=" in refused and "over 2 ranks" in refused and "over 4 ranks" in refused


@pytest.mark.parametrize("dim", MESHES)
def test_accelerate_parallelism_config_gives_the_same_placement(dim):
    for same, clash in (rank["accelerate"] for rank in _world(dim)):
        assert same                                 # dp_shard x cp|sp laid out as accelerate builds its mesh
        assert clash is not None and "parallelism_config=" in clash and "pass one of them" in clash


@pytest.mark.parametrize("dim", MESHES)
def test_mistakes_refused_on_every_rank(dim):
    ranks = _world(dim)
    for rank, out in enumerate(ranks):
        kind, text = out["budget"]
        assert kind == "ValueError" and "not a multiple of" in text and "token_budget=" in text
        kind, text = out["group"]
        assert kind == "ValueError" and f"rank {rank}" in text and "process_group=" in text and "dp_dims=" in text
        kind, text = out["peers"]
        assert kind in ("ValueError", "PeerError"), out["peers"]
        assert "were handed different batches" in text, text
    assert any(out["peers"][0] == "ValueError" for out in ranks)
