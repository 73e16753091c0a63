"""The simulator's communication model (NOTE [ Pricing the exchanges ] in evenflow.sim.exchange_cost) and the
bench arms built on it (benchmarks/vlm/bench_vlm_sim.py): bytes land on the right links, the background is
charged only past the previous step, and the arms keep their order by construction."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

from evenflow.balance.phases import ExampleMeta, OrchestratorConfig, PhaseSpec, plan_step
from evenflow.sim.exchange_cost import (LinkModel, all_gather_s, all_to_all_s, exposed_s, step_traffic, traffic,
                                        worth_balancing)

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_bytes_split_by_link():
    # 4 ranks, 2 a node: 0->1 stays in node 0, 0->2 crosses, 3->3 does not move
    t = traffic(np.array([0, 0, 3]), np.array([1, 2, 3]), np.array([100., 40., 999.]), 4, 2)
    assert t.intra.tolist() == [100, 100, 0, 0]
    assert t.node.tolist() == [40, 40]
    assert (t.moved_bytes, t.inter_node_bytes) == (140, 40)
    assert t.peers.tolist() == [2, 1, 1, 0]


def test_node_nics_are_shared():
    # Every rank of node 0 sends 1 GB to node 1: the node's NICs carry 8 GB, not 1.
    link = LinkModel(ranks_per_node=8, per_peer=0.0, inter_latency=0.0)
    src, dst = np.arange(8), np.arange(8) + 8
    t = traffic(src, dst, np.full(8, 1e9), 16, 8)
    assert all_to_all_s(t, link) == pytest.approx(8e9 / link.inter_bw)
    # the same bytes inside one node go over each GPU's own NVLink
    t2 = traffic(src, (src + 1) % 8, np.full(8, 1e9), 8, 8)
    assert all_to_all_s(t2, LinkModel(per_peer=0.0, intra_latency=0.0)) == pytest.approx(1e9 / 360e9)


def test_nothing_moved_still_costs_a_latency():
    t = traffic(np.arange(4), np.arange(4), np.ones(4), 4, 2)
    link = LinkModel(ranks_per_node=2)
    assert t.moved_bytes == 0 and all_to_all_s(t, link) == pytest.approx(link.inter_latency)


def test_gloo_ring_latency_grows_with_the_world():
    link = LinkModel()
    small, big = all_gather_s(8192, 64, link, host=True), all_gather_s(8192, 2560, link, host=True)
    assert big > 2559 * link.host_latency and small < big / 30
    assert all_gather_s(8192, 2560, link) < big / 10  # NCCL: latency per doubling, not per ring step
    assert all_gather_s(8192, 1, link, host=True) == 0.0


def test_background_costs_only_past_the_previous_step():
    assert exposed_s(0.05, 0.8) == 0.0
    assert exposed_s(1.0, 0.8) == pytest.approx(0.2)


def test_worth_balancing_is_per_phase():
    got = worth_balancing({"vision": 1.0, "audio": 0.5, "llm": 2.0}, {"vision": 0.7, "audio": 0.49, "llm": 1.0},
                          {"vision": 0.1, "audio": 0.02, "llm": 1.5})
    assert got == {"vision": True, "audio": False, "llm": False}


@pytest.mark.parametrize("field, value", [("intra_bw", 0.0), ("host_latency", -1.0), ("ranks_per_node", 0)])
def test_link_model_refuses_nonsense(field, value):
    with pytest.raises(ValueError, match=field):
        LinkModel(**{field: value})


def _plan(ranks_per_node):
    # 4 ranks on 2 nodes; rank 0 holds three heavy images, the rest light ones
    config = OrchestratorConfig(encoders={"vision": PhaseSpec(input_dim=4)}, llm=PhaseSpec(),
                                ranks_per_node=ranks_per_node)
    heavy = [ExampleMeta(length=64, loss_tokens=8, media=((400,),)) for _ in range(3)]
    light = [ExampleMeta(length=64, loss_tokens=8, media=((20,),))]
    return plan_step([heavy, light, light, light], config)


def test_step_traffic_counts_every_move_and_restore_goes_home():
    plan = _plan(2)
    t = step_traffic(plan, {"vision": (10.0, 100.0)}, 8.0, ranks_per_node=2)
    it = plan.items["vision"]
    src = plan.source[it.example]
    assert t["vision:inputs"].moved_bytes == pytest.approx(float((it.rows * 10.0)[src != it.dest].sum()))
    assert t["vision:inputs"].moved_bytes > 0  # rank 0's images are spread
    back = step_traffic(plan, {"vision": (10.0, 100.0)}, 8.0, ranks_per_node=2, restore=True)
    home = it.dest != src
    assert back["vision:outputs"].moved_bytes == pytest.approx(float((it.out_rows * 100.0)[home].sum()))


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    yield importlib.import_module("vlm.bench_vlm_sim")
    sys.path.remove(str(BENCHMARKS))


def test_bench_arms_keep_their_order(bench):
    costs = bench.fitted_costs()
    res = bench.simulate_exchanges(16, costs, 1, "omni_mix")
    a = {k: v for k, v in res.items() if k in bench.EXCHANGE_ARMS}
    assert a["none"]["exchange_s"] == 0.0 and a["none"]["inter_node_bytes"] == 0.0
    # the same plan: the same compute; the background only removes work from the path
    assert a["prefetched"]["compute_s"] == a["inline"]["compute_s"]
    assert a["prefetched"]["step_s"] < a["inline"]["step_s"]
    assert a["vision_only_overlap"]["step_s"] <= a["vision_only"]["step_s"]
    assert a["vision_only"]["audio_imbalance"] == a["none"]["audio_imbalance"]  # only vision moved
    assert a["inline"]["inter_node_bytes"] <= a["inline"]["inter_node_bytes_flat"]
    for arm in a.values():
        assert arm["step_s"] == pytest.approx(arm["compute_s"] + arm["exchange_s"], abs=2e-6)
