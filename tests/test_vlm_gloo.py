"""OrchMLLM on stock Qwen2-VL / Qwen2.5-VL, on 3 real gloo ranks: exact, hostile, and counted.

One spawned world runs every scenario (tests/vlm_scenarios.py); each rank reports, the tests below assert.
Exactness is against the unmodified stock forward and backward on the union of every rank's samples (the
global padded batch): loss and every parameter gradient (vision tower, text model, LM head). Float64 runs lift
the stock model's two internal float32 roundings (``float64_throughout``: RMSNorm and the vision rotary
embedding) -- without that, the unmodified model in float64 is only float32-exact, which is measured too;
float32 runs use the unmodified model.
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch

import vlm_scenarios as sc
from _dist import RankFailed, run_world, scenario_results as _ok

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD = 3
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni", "qwen3_vl")
LAYOUTS = ("padded", "packed")
SPLIT = {"video_slice": 1, "audio_slice": 1}
"""Packed float64 runs split every video into temporal patches and every clip at each attention window."""
WARMUP = dict(vision_rows=(16, 144, 576), llm_tokens=(16, 128, 512), repeats=2, clock="thread")
"""Sizes a tiny model's time grows over even on a loaded machine (thread CPU time, fastest of two)."""
FP64_TOL, FP32_TOL = 1e-10, 1e-5
CAP = 120
"""Patch rows per rank for the cap scenario: the uncapped plan puts 136 on one rank (asserted)."""


def _wrong_grid(per_rank):
    """Rank 2's image gets another image's grid and rows (1, 4, 8): 32 rows -> 8 tokens, where it has 6
    placeholders. Rows and grid agree, so the collate passes it; only the placeholders tell."""
    bad = copy.deepcopy(per_rank)
    bad[2][0]["image_grid_thw"] = torch.tensor([[1, 4, 8]])
    bad[2][0]["pixel_values"] = torch.randn(32, sc.PATCH)
    bad[2][0]["num_patches"] = 32
    return bad


def _world(rank: int, world: int, out_dir: str) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.new_group(backend="gloo")  # the orchestrator's group; gradients are summed on the default one
    per = sc.per_rank_samples()
    out: dict = {}

    def run(name, fn, *args, **kwargs):
        try:
            out[name] = fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - reported per scenario; the world goes on if every rank raised together
            out[name] = {"error": traceback.format_exc()}

    def exact(name, per_rank=per, **kwargs):
        opts = dict(family="qwen2_vl", layout="packed", dtype=torch.float64, lift=True, per_rank=per_rank)
        run(name, sc.run_exact, rank, world, group, **{**opts, **kwargs})

    for family in FAMILIES:
        fam = sc.per_rank_samples(family=family) if family in ("qwen2_5_omni", "qwen3_vl") else per
        for layout in LAYOUTS:
            # Packed float64 also splits videos into temporal patches and clips at the audio tower's windows
            # (the pieces are encoded on several ranks).
            exact(f"exact/{family}/{layout}/fp64", family=family, layout=layout, per_rank=fam,
                  config_kwargs=SPLIT if layout == "packed" else {})
            exact(f"exact/{family}/{layout}/fp32", family=family, layout=layout, dtype=torch.float32, lift=False,
                  per_rank=fam)
    exact("omni/no_audio", family="qwen2_5_omni", layout="padded", per_rank=per)  # no clip on any rank
    run("omni/ddp_unused", _ddp_unused, rank)
    run("fit/broadcast", _fit, rank, group)
    run("fit/mismatch", sc.expect_failure, _plan_with_cost, rank, group, per, bump=rank == 1)
    run("fit/state", _state_round_trip, group)
    run("docs/omni", _docs_omni)
    exact("after_fit_mismatch")
    exact("unmodified_fp64", lift=False)
    exact("empty_rank/none", per_rank=[per[0], [], per[2]], config_kwargs={"balance": "none"})
    exact("empty_rank/full", per_rank=[per[0], [], per[2]], family="qwen2_5_vl")
    exact("text_only", per_rank=sc.per_rank_text_only(), layout="padded")
    tokens = sc.supervised([s for r in per for s in r])
    infos = [sc.step_info(samples=per[r], world=world, global_tokens=tokens - sc.supervised(per[2]),
                          idle=r == 2, ids=[100 * r + j for j in range(len(per[r]))]) for r in range(world)]
    exact("idle_rank", infos=infos)
    run("token_mismatch", sc.expect_failure, sc.run_exact, rank, world, group, family="qwen2_vl", layout="packed",
        dtype=torch.float32, lift=False, per_rank=per,
        infos=[sc.step_info(samples=per[r], world=world, global_tokens=tokens + 1) for r in range(world)])
    exact("cap", config_kwargs={"max_encoder_rows": CAP})
    run("cap_infeasible", sc.expect_failure, sc.run_exact, rank, world, group, family="qwen2_vl", layout="packed",
        dtype=torch.float32, lift=False, per_rank=per, config_kwargs={"max_encoder_rows": 100})
    run("encoder_fails", sc.expect_failure, sc.run_exact, rank, world, group, family="qwen2_vl", layout="packed",
        dtype=torch.float32, lift=False, per_rank=per, adapter_cls=sc.failing_adapter(1))
    exact("after_encoder_failure")
    bad = _wrong_grid(per)
    bad_infos = [sc.step_info(samples=bad[r], world=world, global_tokens=tokens,
                              ids=[100 * r + j for j in range(len(bad[r]))]) for r in range(world)]
    run("wrong_grid", sc.expect_failure, sc.run_exact, rank, world, group, family="qwen2_vl", layout="padded",
        dtype=torch.float32, lift=False, per_rank=bad, infos=bad_infos, with_reference=False)
    exact("after_wrong_grid", layout="padded")
    run("collectives", sc.count_collectives, rank, world, group, per_rank=per)
    run("collectives_overflow", sc.count_collectives, rank, world, group, per_rank=sc.per_rank_many(),
        metadata_words=256)
    # Last: rank 1's process dies inside its encoder (no exception, no report). The others must not hang. What
    # every rank saw so far is saved first: rank 1 returns nothing.
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    run("peer_dies", sc.expect_failure, sc.run_exact, rank, world, group, family="qwen2_vl", layout="packed",
        dtype=torch.float32, lift=False, per_rank=per, adapter_cls=sc.failing_adapter(1, die=True),
        with_reference=False)
    return out


def _ddp_unused(rank: int) -> dict:
    """The thinker's audio_bos_eos_token never gets a gradient: a DDP wrapper without find_unused_parameters is
    refused by name; with it, or with the parameter frozen, the balanced step builds."""
    import torch.distributed as dist

    from evenflow.vlm import BalancedVLM

    model = sc.tiny_model("qwen2_5_omni", torch.float32)
    group = dist.new_group(backend="gloo")
    refused = sc.expect_failure(BalancedVLM, torch.nn.parallel.DistributedDataParallel(model), group=group)
    BalancedVLM(torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True), group=group)
    model.model.audio_tower.audio_bos_eos_token.weight.requires_grad_(False)
    BalancedVLM(torch.nn.parallel.DistributedDataParallel(model), group=group)
    return refused


def _fit(rank: int, group) -> dict:
    """Every rank fits from its own timings; what it returns is rank 0's fit, bit for bit."""
    from evenflow.vlm import WarmupConfig, fit_phase_costs, time_phases

    model = sc.tiny_model("qwen2_vl", torch.float32)
    cost = fit_phase_costs(model, group=group, config=WarmupConfig(**WARMUP))
    own = time_phases(model, config=WarmupConfig(**WARMUP))
    return dict(key=cost.key(), own_seconds=[t for p in own.values() for _, t in p],
                grads=[n for n, p in model.named_parameters() if p.grad is not None])


def _cost(bump: bool):
    """A fitted-looking cost; ``bump``: alpha one ulp higher (what two ranks fitting on their own give)."""
    import math

    from evenflow.planning import PhaseTime, TimeCost

    alpha = 2.5e-5
    return TimeCost(phases=(PhaseTime(length_key="num_patches", alpha=math.nextafter(alpha, 1) if bump else alpha,
                                      beta=1e-8), PhaseTime(alpha=3e-5, beta=2e-8)), layout="summed", source="fit")


def _plan_with_cost(rank: int, group, per, *, bump: bool) -> None:
    from evenflow.vlm import BalancedVLM, VLMConfig

    vlm = BalancedVLM(sc.tiny_model("qwen2_vl", torch.float32), group=group,
                      config=VLMConfig(time_cost=_cost(bump), gradient_sync="external"))
    vlm(sc._collate(per[rank], "packed"))


def _state_round_trip(group) -> dict:
    from evenflow.vlm import BalancedVLM, VLMConfig, cost_from_state

    model = sc.tiny_model("qwen2_vl", torch.float32)
    state = BalancedVLM(model, group=group, config=VLMConfig(time_cost=_cost(False), **sc.EXTERNAL)).state_dict()
    resumed = BalancedVLM(model, group=group, config=VLMConfig(time_cost=cost_from_state(state["time_cost"]),
                                                               **sc.EXTERNAL))
    resumed.load_state_dict(state)
    other = BalancedVLM(model, group=group, config=VLMConfig(time_cost=_cost(True), **sc.EXTERNAL))
    return dict(refused=sc.expect_failure(other.load_state_dict, state),
                same_key=resumed.orchestrator.plan_key == state["plan_key"])


def _docs_omni() -> dict:
    """docs/vlm.md's Omni block on this world: a warm-up fit, an epoch of real speech, photos and videos with every
    clip cut at the tower's windows, and the saved costs resumed."""
    import contextlib
    import io

    from _snippets import snippet

    ns: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(snippet("vlm-omni"), ns)
    return dict(printed=printed.getvalue().splitlines(), key=repr(ns["costs"].key()),
                saved_key=ns["saved"]["plan_key"], resumed_key=ns["resumed"].orchestrator.plan_key)


PG_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("vlm_gloo")
    results = run_world(_world, WORLD, str(out_dir), timeout=540, pg_timeout_s=PG_TIMEOUT_S, allow_errors=True)
    for r in (0, 2):  # rank 1 dies in the last scenario; the others report
        if isinstance(results[r], RankFailed):
            raise results[r]
    if not isinstance(results[1], RankFailed):
        pytest.fail(f"rank 1 should have died in its encoder, it returned: {sorted(results[1])}")
    saved = out_dir / "rank1.pt"
    if not saved.exists():
        raise results[1]
    return [*results[:1], {**torch.load(saved, weights_only=False), "died": results[1]}, *results[2:]]




def _assert_exact(world, name, tol):
    res = _ok(world, name)
    assert len({r["fingerprint"] for r in res}) == 1, "ranks computed different plans"
    r = res[0]
    assert abs(r["loss"] - r["ref_loss"]) <= tol * abs(r["ref_loss"]), (name, r["loss"], r["ref_loss"])
    assert r["grad_err"] <= tol, (name, r["grad_err"])
    assert all(not x["missing_grads"] for x in res), [x["missing_grads"] for x in res]  # every param, every rank
    return res


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_loss_and_every_gradient_equal_the_stock_forward(world, family, layout, precision):
    res = _assert_exact(world, f"exact/{family}/{layout}/{precision}", FP64_TOL if precision == "fp64" else FP32_TOL)
    # Every phase moved something: the plan is not the identity.
    for phase in res[0]["imbalance"]:
        assert res[0]["imbalance"][phase].after < res[0]["imbalance"][phase].before, phase
    split = precision == "fp64" and layout == "packed"
    # The 3-frame video travels as 3 items when split -- and always for Qwen3-VL, whose frames are runs of their own.
    assert sum(r["encoded"] for r in res) == 4 + (3 if split or family == "qwen3_vl" else 1)
    if family == "qwen2_5_omni":
        assert [r["held_items"]["audio"] for r in res][1] == 0  # rank 1 holds no audio clip
        # Clips of 37, 70 and 16 frames; cut at every 16-frame window: 3 + 5 + 1 items.
        assert sum(r["encoded_by_phase"]["audio"] for r in res) == (9 if split else 3)
        assert res[0]["unused"] == ["model.audio_tower.audio_bos_eos_token.weight"]


def test_the_unmodified_model_in_float64_is_float32_exact(world):
    """Measured, not the bar: the stock RMSNorm and vision rotary round to float32 inside a float64 model."""
    r = _ok(world, "unmodified_fp64")[0]
    assert r["grad_err"] <= 1e-6, r["grad_err"]


@pytest.mark.parametrize("name", ["empty_rank/none", "empty_rank/full", "text_only", "idle_rank"])
def test_ranks_with_no_image_no_video_or_no_example(world, name):
    res = _assert_exact(world, name, FP64_TOL)
    if name == "empty_rank/none":
        assert [r["examples"] for r in res] == [3, 0, 1]       # rank 1 trains nothing: a dummy token
        assert [r["encoded"] for r in res] == [4, 0, 1]        # ranks 1: a dummy vision item (weight 0)
    if name == "text_only":
        assert all(r["encoded"] == 0 for r in res)              # every rank ran the tower on a dummy item
    if name == "idle_rank":
        assert res[2]["examples"] >= 0 and sum(r["examples"] for r in res) == 5  # rank 2's batch trained nowhere


def test_a_loss_token_count_that_disagrees_with_the_loader_is_refused_on_every_rank(world):
    res = _ok(world, "token_mismatch")
    assert all(r["type"] == "ValueError" and "LossTokenRule" in r["message"] for r in res), res


def test_the_encoder_row_cap_holds(world):
    uncapped = _ok(world, "exact/qwen2_vl/packed/fp64")
    assert max(r["encoded_rows"] for r in uncapped) > CAP   # the scenario makes the cap bind
    capped = _assert_exact(world, "cap", FP64_TOL)
    assert max(r["encoded_rows"] for r in capped) <= CAP


def test_an_infeasible_cap_is_refused_on_every_rank(world):
    res = _ok(world, "cap_infeasible")
    assert all(r["type"] == "ValueError" and "max_encoder_rows=100" in r["message"] for r in res), res


def test_an_encoder_failure_reaches_every_rank_as_peer_error(world):
    res = _ok(world, "encoder_fails")
    assert res[1]["type"] == "RuntimeError" and "encoder blew up" in res[1]["message"]
    assert any("rank 1" in note for note in res[1]["notes"])
    for r in (0, 2):
        assert res[r]["type"] == "PeerError" and res[r]["rank"] == 1, res[r]
        assert "RuntimeError" in res[r]["message"] and "encoder blew up" in res[r]["message"]
    _assert_exact(world, "after_encoder_failure", FP64_TOL)  # nobody hung, the group still works


def test_a_wrong_grid_reaches_every_rank_naming_the_sample(world):
    res = _ok(world, "wrong_grid")
    assert res[2]["type"] == "ExampleError" and "(1, 4, 8)" in res[2]["message"], res[2]
    assert res[2]["sample_index"] == 200
    for r in (0, 1):
        assert res[r]["type"] == "PeerError" and res[r]["rank"] == 2 and res[r]["sample_index"] == 200, res[r]
        assert "placeholder run has 6" in res[r]["message"]
    _assert_exact(world, "after_wrong_grid", FP64_TOL)


def test_the_thinker_with_no_audio_anywhere_is_exact(world):
    res = _assert_exact(world, "omni/no_audio", FP64_TOL)
    assert all(r["encoded_by_phase"]["audio"] == 0 for r in res)  # every rank encoded a dummy clip


def test_ddp_without_find_unused_parameters_is_refused_for_the_thinker(world):
    for r in _ok(world, "omni/ddp_unused"):
        assert r["type"] == "ValueError" and "audio_bos_eos_token" in r["message"], r


def test_a_warm_up_fit_is_the_same_on_every_rank(world):
    res = _ok(world, "fit/broadcast")
    assert len({repr(r["key"]) for r in res}) == 1                    # rank 0's coefficients everywhere ...
    assert len({tuple(r["own_seconds"]) for r in res}) == WORLD       # ... though every rank timed its own
    assert all(not r["grads"] for r in res)                           # the warm-up leaves no gradient


def test_a_fit_that_differs_across_ranks_is_refused_on_every_rank(world):
    res = _ok(world, "fit/mismatch")
    for r in res:  # rank 1's alpha is one ulp off: refused in the first metadata exchange, before any data moves
        assert r["type"] == "PeerError" and r["rank"] == 1 and "plan key" in r["message"], r
        assert r["seconds"] < PG_TIMEOUT_S / 2
    _assert_exact(world, "after_fit_mismatch", FP64_TOL)


def test_saved_costs_resume_bit_for_bit_and_other_costs_are_refused(world):
    for r in _ok(world, "fit/state"):
        assert r["same_key"]
        assert r["refused"]["type"] == "ValueError" and "cost_from_state" in r["refused"]["message"]


def test_the_docs_omni_block_runs_on_three_ranks(world):
    res = _ok(world, "docs/omni")
    assert len({r["key"] for r in res}) == 1                      # one fit, the same bits on every rank
    assert all(r["resumed_key"] == r["saved_key"] for r in res)   # resumed from the state, not refitted
    for r in res:
        assert "num_frames" in r["printed"][0], r["printed"][:1]  # the audio phase was fitted too
        assert any(line.startswith("step ") for line in r["printed"]), r["printed"]


def test_collectives_per_step(world):
    """Forward: one metadata all_gather, one all-to-all for text + positions, one per encoder phase in, one out,
    one all_reduce of the summed loss (the logged mean); backward: exactly one. Nothing on any other group
    (gradient sync is the caller's)."""
    for r in _ok(world, "collectives"):
        assert r["forward"] == {"all_gather": 1, "all_to_all_single": 3, "all_reduce": 1}, r
        assert r["backward"] == {"all_to_all_single": 1}, r
    for r in _ok(world, "collectives_overflow"):  # metadata past metadata_words: a second all_gather
        assert r["forward"] == {"all_gather": 2, "all_to_all_single": 3, "all_reduce": 1}, r
        assert r["backward"] == {"all_to_all_single": 1}, r


def test_a_peer_that_dies_in_its_encoder_ends_the_step_on_every_other_rank(world):
    """No report can come from a dead process: the survivors' next exchange fails (gloo sees the closed
    connection) well before the process-group timeout -- an error, never a hang."""
    assert isinstance(world[1]["died"], RankFailed) and "exited with code 3" in world[1]["died"].text
    for r in (0, 2):
        res = world[r]["peer_dies"]
        assert "error" not in res and res["type"] is not None, res
        assert res["seconds"] < PG_TIMEOUT_S / 2, res
