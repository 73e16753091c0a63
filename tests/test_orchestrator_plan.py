"""Orchestrator planning and routing, simulated for W ranks in one process (no torch.distributed)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evenflow.balance.phases import ExampleMeta, OrchestratorConfig, PhaseSpec, decode_metadata, encode_metadata, plan_step, rank_routing

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONFIG = OrchestratorConfig(encoders={"vision": PhaseSpec(input_dim=3, downsample=2),
                                      "audio": PhaseSpec(input_dim=2, downsample=4)}, ranks_per_node=2)


@st.composite
def metadata(draw):
    world = draw(st.integers(1, 5))
    out = []
    for _ in range(world):
        metas = []
        for _ in range(draw(st.integers(0, 4))):
            vision = tuple(2 * draw(st.integers(0, 8)) for _ in range(draw(st.integers(0, 3))))
            audio = tuple(4 * draw(st.integers(0, 6)) for _ in range(draw(st.integers(0, 2))))
            length = draw(st.integers(1, 60))
            metas.append(ExampleMeta(length, draw(st.integers(0, length)), (vision, audio)))
        out.append(metas)
    return out


def _simulate(plan, meta_by_rank):
    """Run every rank's routing with lists instead of collectives; return what each LLM rank assembles.

    Rows are tagged (phase, global item id, row) so that misrouting is visible.
    """
    W = plan.world
    routes = [rank_routing(plan, r) for r in range(W)]

    def exchange(sends, counts):  # sends[r]: list of rows in send order, counts[r][d]: rows to d
        out = [[] for _ in range(W)]
        for r in range(W):
            start = 0
            for d in range(W):
                out[d].append(sends[r][start:start + counts[r][d]])
                start += counts[r][d]
        return [[row for chunk in per_src for row in chunk] for per_src in out]

    encoded = [[] for _ in range(W)]
    for p in plan.phases:
        it = plan.items[p]
        sends = []
        for r in range(W):
            local = np.flatnonzero(plan.source[it.example] == r)
            rows = [(p, int(g), k) for g in local for k in range(int(it.rows[g]))]
            starts = np.concatenate(([0], np.cumsum(it.rows[local])))
            sends.append([rows[starts[j] + k] for j in routes[r].in_send_items[p]
                          for k in range(int(it.rows[local[j]]))])
        recv = exchange(sends, [routes[r].in_send[p] for r in range(W)])
        for v in range(W):
            # encoder: one output row per `downsample` input rows of the same item
            out_rows, pos = [], 0
            for n_rows in routes[v].enc_item_rows[p]:
                item = recv[v][pos][1] if n_rows else None
                assert all(row[1] == item for row in recv[v][pos:pos + n_rows])
                out_rows += [(p, item, k) for k in range(n_rows // CONFIG.encoders[p].downsample)]
                pos += n_rows
            assert pos == len(recv[v]) == sum(routes[v].in_recv[p])
            encoded[v].append(out_rows)
    cat = [[row for rows in encoded[v] for row in rows] for v in range(W)]
    sends = [[cat[v][i] for i in routes[v].out_send_index.tolist()] for v in range(W)]
    recv = exchange(sends, [routes[v].out_send for v in range(W)])
    assembled = {}
    for r in range(W):
        assert len(recv[r]) == sum(routes[r].out_recv)
        for p in plan.phases:
            rows = [recv[r][i] for i in routes[r].media_index[p].tolist()]
            start = 0
            for e, count in zip(routes[r].llm_examples.tolist(), routes[r].media_counts[p]):
                assembled[(p, e)] = rows[start:start + count]
                start += count
            assert start == len(rows)
    return assembled


def _config(mode: str) -> OrchestratorConfig:
    """``none``: nothing moves; ``llm``: only the LLM phase is balanced; ``full``: every phase."""
    encoders = {p: replace(spec, balanced=mode == "full") for p, spec in CONFIG.encoders.items()}
    return OrchestratorConfig(encoders=encoders, ranks_per_node=2, balance=mode != "none")


@SETTINGS
@given(metadata(), st.sampled_from(["none", "llm", "full"]))
def test_composed_routing_delivers_every_item_to_its_llm_rank(meta_by_rank, mode):
    config = _config(mode)
    plan = plan_step(meta_by_rank, config)
    assembled = _simulate(plan, meta_by_rank)
    for p in plan.phases:
        it = plan.items[p]
        down = config.encoders[p].downsample
        for e in range(plan.source.size):
            items = np.flatnonzero(it.example == e)
            want = [(p, int(g), k) for g in items for k in range(int(it.rows[g]) // down)]
            assert assembled[(p, e)] == want  # every output row, in placeholder order, on the right rank
    # each example trained exactly once
    trained = np.concatenate([rank_routing(plan, r).llm_examples for r in range(plan.world)])
    assert sorted(trained.tolist()) == list(range(plan.source.size))
    assert plan.fingerprint() == plan_step(meta_by_rank, config).fingerprint()


@SETTINGS
@given(metadata())
def test_metadata_round_trip(meta_by_rank):
    for metas in meta_by_rank:
        assert decode_metadata(encode_metadata(metas, 2), 2) == metas


def test_plan_balances_each_phase_separately():
    # Rank 0: big images, short texts. Rank 1: no images, long texts. Rank 2, 3: nothing.
    big = ExampleMeta(8, 4, ((64, 64), ()))
    long_text = ExampleMeta(200, 150, ((), ()))
    meta = [[big, big], [long_text, long_text, long_text], [], []]
    plan = plan_step(meta, CONFIG)
    loads = plan.phase_loads()
    assert loads["vision"][0].max() == 256 and loads["vision"][1].max() == 64  # 4 images over 4 ranks
    assert loads["llm"][0].max() == 600 and loads["llm"][1].max() == 200
    assert plan.total_loss_tokens == 2 * 4 + 3 * 150


def test_identity_plan_moves_nothing():
    meta = [[ExampleMeta(10, 5, ((4,), (8,)))], [ExampleMeta(30, 5, ((40,), ()))]]
    plan = plan_step(meta, OrchestratorConfig(encoders=CONFIG.encoders, balance=False))
    assert plan.dest.tolist() == [0, 1]
    assert plan.items["vision"].dest.tolist() == [0, 1]


def test_bad_metadata_names_the_example():
    with pytest.raises(ValueError, match=r"rank 1, example 0, vision item 0: 3 input rows.*downsample=2"):
        plan_step([[], [ExampleMeta(5, 1, ((3,), ()))]], CONFIG)
    with pytest.raises(ValueError, match=r"rank 0, example 0: metadata has 1 media phases"):
        plan_step([[ExampleMeta(5, 1, ((2,),))]], CONFIG)
    with pytest.raises(ValueError, match="input_dim"):
        OrchestratorConfig(encoders={"vision": PhaseSpec()})


def test_llm_only_balancing_keeps_encoder_items_home():
    # Rank 0: two long examples with big images; rank 1: nothing. LLM-only moves one example (and so one
    # image's output) to rank 1, but both images are still encoded on rank 0, where they were sampled.
    meta = [[ExampleMeta(100, 50, ((64,), (8,))), ExampleMeta(100, 50, ((64,), ()))], []]
    llm_only = plan_step(meta, _config("llm"))
    assert sorted(llm_only.dest.tolist()) == [0, 1]
    assert llm_only.items["vision"].dest.tolist() == [0, 0] and llm_only.items["audio"].dest.tolist() == [0]
    full = plan_step(meta, _config("full"))
    assert sorted(full.items["vision"].dest.tolist()) == [0, 1]
    assert plan_step(meta, _config("none")).dest.tolist() == [0, 0]
