"""Node-wise rearrangement (assignment vs MILP vs brute force) and cost models. Pure, one process."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evenflow.balance import (QuadraticCost, Topology, assign_buckets, assign_buckets_milp, fit_quadratic, item_costs,
                              link_loads, padded_cost, summed_cost, topology_from_env, transfer_bytes,
                              transfer_matrices)

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def instances(draw, max_ranks=6):
    per_node = draw(st.integers(1, 3))
    ranks = draw(st.integers(1, max_ranks))
    n = draw(st.integers(0, 14))
    buckets = draw(st.lists(st.integers(0, ranks - 1), min_size=n, max_size=n))
    sources = draw(st.lists(st.integers(0, ranks - 1), min_size=n, max_size=n))
    nbytes = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
    return Topology(num_ranks=ranks, ranks_per_node=min(per_node, ranks)), buckets, sources, nbytes


def _objective(rank_of_bucket, buckets, sources, nbytes, topo):
    return transfer_bytes(np.asarray(rank_of_bucket)[np.asarray(buckets, dtype=np.int64)], sources, nbytes, topo)


@SETTINGS
@given(instances())
def test_assignment_equals_milp_optimum(inst):
    topo, buckets, sources, nbytes = inst
    lsa = assign_buckets(buckets, sources, topo, item_bytes=nbytes)
    milp = assign_buckets_milp(buckets, sources, topo, item_bytes=nbytes, objective="total")
    assert sorted(lsa.tolist()) == list(range(topo.num_ranks))  # a permutation
    assert _objective(lsa, buckets, sources, nbytes, topo) == _objective(milp, buckets, sources, nbytes, topo)


@SETTINGS
@given(instances(max_ranks=5))
def test_assignment_and_bottleneck_match_brute_force(inst):
    topo, buckets, sources, nbytes = inst
    R = topo.num_ranks
    best_total, best_link = None, None
    for perm in itertools.permutations(range(R)):
        dest = np.asarray(perm)[np.asarray(buckets, dtype=np.int64)]
        total = transfer_bytes(dest, sources, nbytes, topo)
        out, into = link_loads(dest, sources, nbytes, topo)
        link = (max(out.max(initial=0), into.max(initial=0)), total[0])
        best_total = total if best_total is None else min(best_total, total)
        best_link = link if best_link is None else min(best_link, link)
    lsa = assign_buckets(buckets, sources, topo, item_bytes=nbytes)
    assert _objective(lsa, buckets, sources, nbytes, topo) == best_total
    bott = assign_buckets_milp(buckets, sources, topo, item_bytes=nbytes, objective="bottleneck")
    dest = bott[np.asarray(buckets, dtype=np.int64)]
    out, into = link_loads(dest, sources, nbytes, topo)
    assert (max(out.max(initial=0), into.max(initial=0)), transfer_bytes(dest, sources, nbytes, topo)[0]) == best_link


def test_rearrangement_note_example():
    topo = Topology(num_ranks=2, ranks_per_node=1)
    # bucket 0 = items from rank 1, bucket 1 = items from rank 0: the swap moves nothing.
    assert assign_buckets([0, 0, 1], [1, 1, 0], topo, item_bytes=[5, 5, 7]).tolist() == [1, 0]
    inter, intra = transfer_matrices(np.array([0, 0, 1]), np.array([1, 1, 0]), np.array([5., 5., 7.]), topo)
    assert inter.tolist() == [[10, 0], [0, 7]] and intra.tolist() == [[0, 0], [0, 0]]


def test_fewer_buckets_than_ranks_and_huge_byte_counts():
    topo = Topology(num_ranks=4, ranks_per_node=2)
    out = assign_buckets([0, 1], [3, 2], topo, item_bytes=[1e12, 3e12], num_buckets=2)
    assert out.tolist() == [3, 2]  # exact in coarser units, still keeps both home
    with pytest.raises(ValueError, match="at most"):
        assign_buckets([0], [0], topo, num_buckets=5)


def test_topology_from_env_reads_only():
    env = {"LOCAL_WORLD_SIZE": "8"}
    assert topology_from_env(64, environ=env) == Topology(num_ranks=64, ranks_per_node=8)
    assert env == {"LOCAL_WORLD_SIZE": "8"}
    assert topology_from_env(4, environ={}).num_nodes == 1
    with pytest.raises(ValueError, match="ranks_per_node explicitly"):
        topology_from_env(4, environ={"LOCAL_WORLD_SIZE": "x"})
    with pytest.raises(ValueError, match="outside"):
        topology_from_env(4, environ={"LOCAL_WORLD_SIZE": "9"})
    assert Topology(num_ranks=6, ranks_per_node=4).node_of(np.arange(6)).tolist() == [0, 0, 0, 0, 1, 1]


# -- costs -----------------------------------------------------------------------------------------------------

def test_quadratic_cost_and_shapes():
    c = QuadraticCost(gamma=1.0, alpha=2.0, beta=0.5)
    assert c(4) == 17.0
    assert c(np.array([0, 2])).tolist() == [1.0, 7.0]
    assert summed_cost([2, 3]) == 5.0 and summed_cost([2, 3], c) == 7.0 + 11.5
    assert padded_cost([2, 3, 8]) == 24.0 and padded_cost([2, 3, 8], c) == 3 * c(8)
    assert padded_cost([]) == 0.0
    with pytest.raises(ValueError, match="beta=-1.*negative"):
        QuadraticCost(beta=-1.0)


@settings(max_examples=40, deadline=None)
@given(st.floats(0, 1e3), st.floats(0, 10), st.floats(0, 1e-2))
def test_fit_recovers_coefficients(gamma, alpha, beta):
    lengths = np.array([64, 256, 1024, 2048, 4096, 8192], dtype=float)
    fit = fit_quadratic(lengths, gamma + alpha * lengths + beta * lengths ** 2)
    pred = fit(lengths)
    truth = gamma + alpha * lengths + beta * lengths ** 2
    assert np.allclose(pred, truth, rtol=1e-6, atol=1e-6 * max(1.0, truth.max()))


def test_fit_scales_to_seconds_and_clips_noise():
    lengths = np.array([256, 512, 1024, 2048, 4096], dtype=float)
    fit = fit_quadratic(lengths, 1e-5 + 3e-8 * lengths + 2e-12 * lengths ** 2)
    assert fit.gamma == pytest.approx(1e-5) and fit.alpha == pytest.approx(3e-8) and fit.beta == pytest.approx(2e-12)
    # A purely linear phase with noise: beta would come out negative; it is clipped to 0 and the rest refit.
    noisy = 5.0 + 2.0 * lengths - 1e-6 * lengths ** 2
    assert fit_quadratic(lengths, noisy).beta == 0.0
    with pytest.raises(ValueError, match="negative"):
        fit_quadratic(lengths, noisy, clip_negative=False)
    with pytest.raises(ValueError, match="at least 3 distinct lengths"):
        fit_quadratic([1, 1, 2], [1, 1, 2])
    with pytest.raises(ValueError, match="measurement 1: time"):
        fit_quadratic([1, 2, 3], [1, float("nan"), 3])


def test_item_costs_any_callable_and_errors():
    assert item_costs(["ab", "abcd"], len).tolist() == [2.0, 4.0]
    with pytest.raises(ValueError, match="item 1: cost_fn returned 'x'"):
        item_costs([1, 2], lambda it: "x" if it == 2 else 1.0)
    with pytest.raises(ValueError, match="item 0: cost -1.0 is negative"):
        item_costs([1], lambda it: -1)


# -- architecture ----------------------------------------------------------------------------------------------

def test_layers_pure_planning_has_no_torch_and_nothing_private():
    import ast
    from pathlib import Path

    import evenflow.balance as pkg

    root = Path(pkg.__file__).parent
    pure = {"costs.py", "planners.py", "topology.py", "rebalance.py", "padded.py", "locality.py",
            "orchestrator/meta.py", "orchestrator/plan.py", "orchestrator/routing.py"}
    for path in sorted(root.rglob("*.py")) + sorted((root.parent / "models").glob("*.py")):
        name = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
        tree = ast.parse(path.read_text())
        mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(m.startswith("torch._") or "._" in m for m in mods), (path.name, mods)
        if name in pure:
            assert not any(m.split(".")[0] == "torch" for m in mods), (name, mods)
        if name not in ("dispatch.py", "orchestrator/runtime.py"):
            assert "torch.distributed" not in mods, name
        # environment variables are only read, never written
        for n in ast.walk(tree):
            if isinstance(n, (ast.Assign, ast.AugAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                assert not any("environ" in ast.dump(t) for t in targets), path.name
