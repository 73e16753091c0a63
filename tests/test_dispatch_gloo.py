"""Real multi-process gloo tests for dispatch and the multi-phase orchestrator.

One spawned world of 4 ranks runs every scenario (spawning costs seconds; scenarios cost milliseconds), each
rank saves what it saw, and the tests below assert on it. Rendezvous is a ``file://`` in a tmp dir (no
ports), every collective has a 60 s timeout, children are joined with a deadline and killed past it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.multiprocess

WORLD = 4
DEADLINE_S = 240.0
REL_TOL = 1e-10


# -- the world -----------------------------------------------------------------------------------------------

def _entry(rank: int, world: int, init: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        results = _run_all(rank, world)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo_world")
    ctx = mp.get_context("spawn")
    init = f"file://{out / 'rendezvous'}"
    procs = [ctx.Process(target=_entry, args=(r, WORLD, init, str(out)), daemon=True) for r in range(WORLD)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=max(0.0, DEADLINE_S - (time.monotonic() - t0)))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        errors = "\n".join(f.read_text() for f in sorted(out.glob("rank*.err")))
        if alive:
            pytest.fail(f"ranks {alive} still running after {DEADLINE_S}s (hang?)\n{errors}")
        codes = [p.exitcode for p in procs]
        if any(codes):
            pytest.fail(f"rank exit codes {codes}\n{errors}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    results[0]["_wall_s"] = time.monotonic() - t0
    return results


def _run_all(rank: int, world: int) -> dict:
    balance_group = dist.new_group(backend="gloo")  # balancing traffic off the gradient group
    res = {}
    res["samples_roundtrip"] = _scenario_samples(rank, world, balance_group)
    res["samples_empty"] = _scenario_samples_empty(rank, world, balance_group)
    res["rows_grad"] = _scenario_rows_grad(rank, world, balance_group)
    res["mllm_mixed"] = _scenario_mllm(rank, world, balance_group, layout="mixed")
    res["mllm_text_only"] = _scenario_mllm(rank, world, balance_group, layout="text_only")
    res["mllm_few"] = _scenario_mllm(rank, world, balance_group, layout="few")
    res["mllm_idle_rank"] = _scenario_mllm(rank, world, balance_group, layout="idle_rank")
    return res


# -- scenarios (run inside the children) ---------------------------------------------------------------------

def _samples_of(rank: int) -> tuple[list[dict], list[int]]:
    """Deterministic per-rank samples of mixed dtypes/shapes, and their destinations (rank 3 sends nothing)."""
    g = torch.Generator().manual_seed(100 + rank)
    if rank == 3:
        return [], []
    samples, dest = [], []
    for j in range(3 + rank):
        n = int(torch.randint(0, 5, (1,), generator=g))
        samples.append({
            "input_ids": torch.randint(0, 1000, (n,), generator=g),
            "pixels": torch.randn(n, 3, dtype=torch.float64, generator=g),
            "mask": torch.rand(n, generator=g) > 0.5,
            "weight": torch.tensor(float(j), dtype=torch.float16),
            "small": torch.randint(0, 7, (2, 2), generator=g, dtype=torch.int8),
        })
        dest.append([0, 1, 2][(rank + j) % 3] if rank != 0 else 1)  # rank 3 receives nothing
    return samples, dest


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                        and torch.equal(a[k], b[k]) for k in a)


def _scenario_samples(rank: int, world: int, group) -> dict:
    from evenflow.exchange.dispatch import arrival_order, exchange_samples

    mine, dest = _samples_of(rank)
    got = exchange_samples(mine, dest, group=group)
    all_dest = [_samples_of(r)[1] for r in range(world)]
    origin = arrival_order(all_dest, rank)
    expected = [_samples_of(s)[0][j] for s, j in origin]
    ok_forward = len(got) == len(expected) and all(_same(a, b) for a, b in zip(got, expected))
    back = exchange_samples(got, [s for s, _ in origin], group=group)  # inverse exchange
    # They come back grouped by the rank they visited, in their original order within each group.
    order = sorted(range(len(mine)), key=lambda j: (dest[j], j))
    ok_back = len(back) == len(mine) and all(_same(back[k], mine[j]) for k, j in enumerate(order))
    return {"forward": ok_forward, "back": ok_back, "received": len(got)}


def _scenario_samples_empty(rank: int, world: int, group) -> dict:
    from evenflow.exchange.dispatch import exchange_samples

    got = exchange_samples([], [], group=group)
    return {"received": len(got)}


def _scenario_rows_grad(rank: int, world: int, group) -> dict:
    from evenflow.exchange.dispatch import all_to_all_rows

    # Rank r sends (r + d) % 3 rows to rank d: some splits are 0; row values encode (src, dest, k).
    send = [(rank + d) % 3 for d in range(world)]
    recv = [(s + rank) % 3 for s in range(world)]
    vals = [1000 * rank + 100 * d + k for d in range(world) for k in range(send[d])]
    x = torch.tensor(vals, dtype=torch.float64).reshape(-1, 1).repeat(1, 2).requires_grad_(True)
    y = all_to_all_rows(x, send, recv, group=group)
    want = [1000 * s + 100 * rank + k for s in range(world) for k in range(recv[s])]
    ok_fwd = y[:, 0].tolist() == [float(v) for v in want]
    # d loss / d y = 2 * y on the receiver; the backward must bring 2 * x back to the sender.
    (y * y).sum().backward()
    ok_bwd = torch.equal(x.grad, 2 * x.detach())
    # recv_counts=None exchanges the counts first.
    y2 = all_to_all_rows(x.detach(), send, None, group=group)
    return {"forward": ok_fwd, "backward": ok_bwd, "counts_exchanged": torch.equal(y2, y.detach())}


def _examples_for(layout: str, rank: int):
    from evenflow.testing import TinyMLLMConfig, make_examples

    cfg = TinyMLLMConfig()
    g = torch.Generator().manual_seed(7 * rank + 1)
    if layout == "mixed":  # uneven counts and sizes; rank 3 text-only (no images, no audio)
        if rank == 3:
            return make_examples(g, 3, cfg, max_images=0, max_audio=0)
        return make_examples(g, [5, 1, 3][rank], cfg, max_images=3, max_patches=24 if rank == 0 else 8,
                             max_audio=2 if rank == 1 else 1, max_frames=48)
    if layout == "text_only":  # no rank has any image or audio
        return make_examples(g, 2 + rank, cfg, max_images=0, max_audio=0)
    if layout == "few":  # fewer examples than ranks, all on rank 0
        return make_examples(g, 2, cfg, max_images=2, max_audio=1) if rank == 0 else []
    if layout == "idle_rank":  # rank 1 holds nothing, rank 2 holds one huge multimodal example
        if rank == 1:
            return []
        if rank == 2:
            return make_examples(g, 1, cfg, max_text=64, max_images=3, max_patches=32, max_audio=2, max_frames=64)
        return make_examples(g, 4, cfg, max_text=8, max_images=1, max_patches=4, max_audio=0)
    raise AssertionError(layout)


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else None for p in model.parameters()]


def _rel_err(a: list, b: list) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            return float("inf")
        scale = max(float(y.abs().max()), 1e-300) if y.numel() else 1.0
        worst = max(worst, float((x - y).abs().max()) / scale if x.numel() else 0.0)
    return worst


def _scenario_mllm(rank: int, world: int, group, *, layout: str) -> dict:
    from evenflow.exchange import GlobalOrchestrator, local_step
    from evenflow.balance.phases import rank_routing
    from evenflow.testing import TinyMLLM, TinyMLLMConfig, orchestrator_config

    cfg = TinyMLLMConfig()
    torch.manual_seed(0)
    model = TinyMLLM(cfg).double()
    ocfg = orchestrator_config(cfg, ranks_per_node=2)
    all_examples = [_examples_for(layout, r) for r in range(world)]
    local = all_examples[rank]
    total = sum(ex.meta(ocfg).loss_tokens for exs in all_examples for ex in exs)

    # Single-process reference: this rank computes the whole global batch alone.
    everything = [ex for exs in all_examples for ex in exs]
    model.zero_grad()
    ref_loss = model.lm_loss_sum(local_step(everything, model.encoders(), ocfg, total_loss_tokens=total,
                                            dtype=torch.float64)) / total
    ref_loss.backward()
    ref_grads = _grads(model)

    def reduced(loss: torch.Tensor) -> tuple[float, list]:
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=dist.group.WORLD)
        grads = _grads(model)
        for g_ in grads:
            if g_ is not None:
                dist.all_reduce(g_, group=dist.group.WORLD)  # sum: the loss is already globally normalized
        return float(loss), grads

    # Without orchestration: every phase runs where the data is.
    model.zero_grad()
    base = model.lm_loss_sum(local_step(local, model.encoders(), ocfg, total_loss_tokens=total,
                                        dtype=torch.float64)) / total
    base.backward()
    every_param_local = all(p.grad is not None for p in model.parameters())
    base_loss, base_grads = reduced(base)

    # With orchestration: one metadata exchange, a plan per phase, composed routing.
    orch = GlobalOrchestrator(ocfg, group=group)
    meta = orch.gather_metadata([ex.meta(ocfg) for ex in local])
    plan = orch.plan(meta)
    fingerprints = [None] * world
    dist.all_gather_object(fingerprints, plan.fingerprint(), group=group)
    model.zero_grad()
    batch = orch.step(plan, local, model.encoders(), dtype=torch.float64)
    loss = model.lm_loss_sum(batch) / batch.total_loss_tokens
    loss.backward()
    every_param_orch = all(p.grad is not None for p in model.parameters())
    orch_loss, orch_grads = reduced(loss)

    # The identity plan through the same exchange code (balance=False) must agree too.
    ident = GlobalOrchestrator(orchestrator_config(cfg, balance=False), group=group)
    plan0 = ident.plan(meta)
    model.zero_grad()
    loss0 = model.lm_loss_sum(ident.step(plan0, local, model.encoders(), dtype=torch.float64)) / total
    loss0.backward()
    ident_loss, ident_grads = reduced(loss0)

    loads = plan.phase_loads()
    return {
        "ref_loss": float(ref_loss.detach()), "base_loss": base_loss, "orch_loss": orch_loss, "ident_loss": ident_loss,
        "grad_err_orch_vs_ref": _rel_err(orch_grads, ref_grads),
        "grad_err_orch_vs_base": _rel_err(orch_grads, base_grads),
        "grad_err_base_vs_ref": _rel_err(base_grads, ref_grads),
        "grad_err_ident_vs_ref": _rel_err(ident_grads, ref_grads),
        "every_param_local": every_param_local, "every_param_orch": every_param_orch,
        "fingerprints": fingerprints, "llm_examples": len(batch.input_ids),
        "moved_examples": int((plan.dest != plan.source).sum()),
        "max_load_before": {p: float(b.max()) for p, (b, a) in loads.items()},
        "max_load_after": {p: float(a.max()) for p, (b, a) in loads.items()},
        "local_examples": len(local),
        "encoded_items": sum(len(v) for v in rank_routing(plan, rank).enc_item_rows.values()),
    }


# -- assertions (parent) -------------------------------------------------------------------------------------

def test_world_finishes_quickly(world_results):
    assert world_results[0]["_wall_s"] < DEADLINE_S


def test_exchange_samples_round_trip(world_results):
    for r, res in enumerate(world_results):
        s = res["samples_roundtrip"]
        assert s["forward"], f"rank {r} received the wrong samples"
        assert s["back"], f"rank {r} did not get its samples back from the inverse exchange"
    assert world_results[3]["samples_roundtrip"]["received"] == 0  # rank 3 sends and receives nothing


def test_exchange_samples_all_empty(world_results):
    assert [res["samples_empty"]["received"] for res in world_results] == [0] * WORLD


def test_differentiable_all_to_all(world_results):
    for r, res in enumerate(world_results):
        assert res["rows_grad"] == {"forward": True, "backward": True, "counts_exchanged": True}, r


@pytest.mark.parametrize("layout", ["mixed", "text_only", "few", "idle_rank"])
def test_orchestrated_loss_and_gradients_match(world_results, layout):
    for r, res in enumerate(world_results):
        m = res[f"mllm_{layout}"]
        ref = m["ref_loss"]
        for name in ("base_loss", "orch_loss", "ident_loss"):
            assert abs(m[name] - ref) <= REL_TOL * abs(ref), (layout, r, name, m[name], ref)
        for name in ("grad_err_orch_vs_ref", "grad_err_orch_vs_base", "grad_err_base_vs_ref",
                     "grad_err_ident_vs_ref"):
            assert m[name] < REL_TOL, (layout, r, name, m[name])
        assert m["every_param_local"] and m["every_param_orch"], (layout, r)


@pytest.mark.parametrize("layout", ["mixed", "text_only", "few", "idle_rank"])
def test_every_rank_computes_the_same_plan(world_results, layout):
    for res in world_results:
        fps = res[f"mllm_{layout}"]["fingerprints"]
        assert len(set(fps)) == 1
    assert len({res[f"mllm_{layout}"]["fingerprints"][0] for res in world_results}) == 1


def test_orchestration_balances_and_moves(world_results):
    mixed = world_results[0]["mllm_mixed"]
    assert mixed["moved_examples"] > 0
    for phase in ("vision", "audio", "llm"):
        assert mixed["max_load_after"][phase] <= mixed["max_load_before"][phase]
    assert mixed["max_load_after"]["llm"] < mixed["max_load_before"]["llm"]
    few = [res["mllm_few"]["llm_examples"] for res in world_results]
    assert sum(few) == 2 and max(few) == 1  # two examples on two ranks, not both on rank 0
    # Rank 1 holds nothing and rank 2 one huge example: the LLM phase cannot split an example, but its
    # images and audio spread, so the empty rank encodes some of them.
    idle = world_results[0]["mllm_idle_rank"]
    assert world_results[1]["mllm_idle_rank"]["encoded_items"] >= 1
    assert idle["max_load_after"]["vision"] < idle["max_load_before"]["vision"]
