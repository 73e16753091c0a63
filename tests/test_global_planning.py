"""planning="global" on real gloo worlds (3 and 4 ranks): every loader guarantee, and better-balanced steps.

One spawned world per size runs every scenario (tests/_dist.py: file:// rendezvous, hard deadline). The pure
round planner (evenflow.planning.pooled.plan, as the runtime calls it) is checked against brute force in one process.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
import torch

import evenflow
import loader_scenarios as sc
from _dist import run_world
from evenflow.planning import GroupingConfig
from evenflow.planning.pooled.plan import GlobalPlanConfig, global_groups, plan_global_round, round_target
from test_loader_dist import _check_epoch, _reference

GLOBAL = dict(planning="global")


# -- scenarios (module level: spawned ranks import them) -----------------------------------------------------
def sc_exact(rank, world, grad_accum_steps=1, **kw):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = sc.TinyLM()
    ddp = DDP(model)
    ds = sc.TokenDataset(90, seed=5, vocab=sc.VOCAB)
    ds.lengths = np.clip(ds.lengths, 2, 300)
    loader = evenflow.DynamicBatchLoader(ds, token_budget=600, buffer_size=16, seed=2,
                                         grad_accum_steps=grad_accum_steps, **kw)
    windows, ids, losses = [], [], []
    for batch in loader:
        info = evenflow.pop_step_info(batch)
        ids.extend(info.sample_ids)
        scaled = evenflow.scale_loss(ddp(**batch), info)
        scaled.backward()
        losses.append(float(scaled.detach()))
        if info.window_end:
            windows.append(dict(ids=ids, grad=torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy(),
                                loss_sum=losses))
            ids, losses = [], []
            for p in model.parameters():
                p.grad = None
    loader.close()
    return windows


def sc_quota(rank, world, epochs=3, **kw):
    loader = evenflow.DynamicBatchLoader(sc.TokenDataset(301), token_budget=sc.BUDGET, buffer_size=32, join=False,
                                         seed=1, **kw)
    per_epoch = [sc.epoch_record(loader, e) for e in range(epochs)]
    carry = loader.state_dict()["next_carry"]
    loader.close()
    return dict(epochs=per_epoch, carry=carry)


def sc_iterable(rank, world, workers=0, **kw):
    loader = evenflow.DynamicBatchLoader(sc.RankStream(rank, 60, 37), token_budget=sc.BUDGET, buffer_size=16,
                                         num_workers=workers, **kw)
    rec = sc.epoch_record(loader)
    loader.close()
    return dict(steps=rec, count=sc.RankStream(rank, 60, 37).count)


def sc_mismatch(rank, world):
    """The global ranks are refused when their loader is built (before any planning group is created), the
    local one at its first epoch's check, which meets theirs."""
    planning = "local" if rank == world - 1 else "global"
    loaders = []
    try:
        loaders.append(evenflow.DynamicBatchLoader(sc.TokenDataset(60), token_budget=sc.BUDGET, buffer_size=8,
                                                   planning=planning))
        sc.epoch_record(loaders[0])
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    finally:
        for loader in loaders:
            loader.close()
    return "no error"


def _scenarios(world, n):
    grouped = dict(planning_group=2, **GLOBAL)  # world 3: groups {0, 1} and {2} -- uneven, two-level exchange
    return [
        ("local", "sc_coverage", dict(n=n, buffer_size=64, seed=4, planning="local")),  # the baseline
        ("global", "sc_coverage", dict(n=n, buffer_size=64, seed=4, **GLOBAL)),
        ("global_w1", "sc_coverage", dict(n=n, buffer_size=64, seed=4, workers=1, context="fork", **GLOBAL)),
        ("global_spawn", "sc_coverage", dict(n=n, buffer_size=64, seed=4, workers=1, context="spawn", **GLOBAL)),
        ("quota", "sc_quota", GLOBAL),
        ("iterable", "sc_iterable", GLOBAL),
        ("exact_k1", "sc_exact", GLOBAL),
        ("exact_k3", "sc_exact", dict(grad_accum_steps=3, **GLOBAL)),
        ("resume", "sc_resume", dict(stop_at=5, **GLOBAL)),
        ("resume_iterable_accum", "sc_resume", dict(stop_at=4, iterable=True, grad_accum_steps=2, **GLOBAL)),
        ("mismatch", "sc_mismatch", {}),
        ("grouped", "sc_coverage", dict(n=n, buffer_size=64, seed=4, **grouped)),
        ("grouped_quota", "sc_quota", grouped),
        ("grouped_iterable", "sc_iterable", grouped),
        ("grouped_exact", "sc_exact", dict(grad_accum_steps=2, **grouped)),
    ]


def _body(rank, world, cases):
    out = {}
    for name, fn, kwargs in cases:
        target = globals().get(fn) or getattr(sc, fn)
        out[name] = target(rank, world, **kwargs)
    return out


_RESULTS: dict[int, list] = {}


# One odd world keeps the suite within its time budget (~1 minute); WORLDS = [3, 4] was run for the issue.
WORLDS = [3]
N = 301


def results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_world(_body, world, _scenarios(world, N), timeout=400)
    return _RESULTS[world]


def _imbalance(per_rank) -> float:
    costs = np.array([[s["padded"] for s in r] for r in per_rank], dtype=float)
    return float((costs.max(0) / np.maximum(costs.mean(0), 1)).mean())


# -- gloo tests ----------------------------------------------------------------------------------------------
multiprocess = pytest.mark.multiprocess


@multiprocess
@pytest.mark.parametrize("world", WORLDS)
def test_global_exactly_once_equal_steps_budgets_and_bounds(world):
    res = results(world)
    names = ["global", "global_w1", "global_spawn", "grouped"]
    for name in names:
        per_rank = [r[name]["steps"] for r in res]
        _check_epoch(per_rank, N)
        assert len({r[name]["first_len"] for r in res}) == 1
        assert res[0][name]["first_len"] >= len(per_rank[0]), "len() before the epoch must bound its steps"
        for s in range(len(per_rank[0])):
            bounds = {r[s]["bound"] for r in per_rank}
            assert len(bounds) == 1 and bounds.pop() >= len(per_rank[0])
    # Deterministic: the same batches on a second run, with a worker process, and with spawned workers.
    for name in ("global_w1", "global_spawn"):
        assert [r[name]["steps"] for r in res] == [r["global"]["steps"] for r in res]


@multiprocess
@pytest.mark.parametrize("world", WORLDS)
def test_global_steps_are_better_balanced_and_no_longer_than_local(world):
    res = results(world)
    local = [r["local"]["steps"] for r in res]
    for name, ranks in (("global", range(world)), ("grouped", (0, 1))):
        glob = [r[name]["steps"] for r in res]
        assert len(glob[0]) <= len(local[0]), f"{name}: {len(glob[0])} steps vs local {len(local[0])}"
        # A planning group evens out its own ranks' steps (groups are only aligned in step count).
        inside, before = _imbalance([glob[r] for r in ranks]), _imbalance([local[r] for r in ranks])
        assert inside < before, (name, inside, before)
        # Moving samples means some rank trains another rank's sample (otherwise this test proves nothing).
        home = {i: rk for rk, r in enumerate(local) for s in r for i in s["ids"]}
        assert any(home[i] != rk for rk, r in enumerate(glob) for s in r for i in s["ids"])


@multiprocess
@pytest.mark.parametrize("world", WORLDS)
def test_global_quota_mode_loses_nothing(world):
    res = results(world)
    for name in ("quota", "grouped_quota"):
        epochs = len(res[0][name]["epochs"])
        counts = collections.Counter()
        for r in res:
            for e in range(epochs):
                for s in r[name]["epochs"][e]:
                    counts.update(s["ids"])
            counts.update(r[name]["carry"])
        for e in range(epochs):
            assert len({len(r[name]["epochs"][e]) for r in res}) == 1
        assert counts == collections.Counter({i: epochs for i in range(301)}), f"{name} lost or duplicated samples"


@multiprocess
@pytest.mark.parametrize("world", WORLDS)
def test_global_iterable_uneven_streams(world):
    res = results(world)
    for name in ("iterable", "grouped_iterable"):
        per_rank = [r[name]["steps"] for r in res]
        gids = [g for r in per_rank for s in r for g in s["gid"] if not s["idle"]]  # IDLE: a template sample
        assert sorted(gids) == sorted(rk * 100_000 + j for rk in range(world) for j in range(res[rk][name]["count"]))
        # Moved stream samples are named (source rank, position): ids stay unique across ranks.
        assert len({i for r in per_rank for s in r for i in s["ids"]}) == len(gids)
        assert len({len(r) for r in per_rank}) == 1


@multiprocess
@pytest.mark.parametrize("world", WORLDS)
def test_global_loss_and_gradients_equal_single_process(world):
    res = results(world)
    for case in ("exact_k1", "exact_k3", "grouped_exact"):
        windows = [r[case] for r in res]
        assert len({len(w) for w in windows}) == 1
        seen = []
        for w, ref_loss, ref_grad, ids in _reference(windows, world, 90):
            seen += ids
            loss = sum(v for r in windows for v in r[w]["loss_sum"]) / world
            assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss), case
            assert np.linalg.norm(windows[0][w]["grad"] - ref_grad) <= 1e-10 * np.linalg.norm(ref_grad), case
        assert sorted(seen) == list(range(90))


@multiprocess
@pytest.mark.parametrize("world", WORLDS)
def test_global_resume_mid_epoch(world):
    res = results(world)
    for name in ("resume",):
        ids = [i for r in res for s in r[name]["before"] + r[name]["after"] for i in s["ids"]]
        assert sorted(ids) == list(range(401)), name
        assert len({len(r[name]["after"]) for r in res}) == 1
    name = "resume_iterable_accum"
    ids = [i for r in res for s in r[name]["before"] + r[name]["after"] for i in s["ids"]]
    expected = sorted((rk, j) for rk in range(world) for j in range(80 + 23 * rk))
    # Own samples are reported as (rank, position) too, so the whole epoch is one set of pairs.
    assert sorted(tuple(i) for i in ids) == expected


@multiprocess
@pytest.mark.parametrize("world", WORLDS)
def test_planning_mismatch_is_refused_naming_both_settings(world):
    for message in (r["mismatch"] for r in results(world)):
        assert "planning='global'" in message and "planning='local'" in message, message
        assert f"[{world - 1}]" in message, message


# -- the pure round planner ----------------------------------------------------------------------------------
def _buffer(rng, k, n, wait_max=3):
    """A planning group's union as the runtime builds it: member-major (length, source member, wait)."""
    counts = rng.integers(0, n, k)
    src = np.repeat(np.arange(k), counts)
    return rng.integers(1, 300, src.size), src, rng.integers(0, wait_max, src.size)


@pytest.mark.parametrize("seed", range(6))
def test_round_plan_budgets_once_and_equal_cost_steps(seed):
    rng = np.random.default_rng(seed)
    cfg = GroupingConfig(token_budget=600)
    k = int(rng.integers(2, 6))
    length, src, wait = _buffer(rng, k, 40)
    target = round_target([len(global_groups(length, src, cfg))], [length.size], [k], 8)
    p = plan_global_round(length, src, k, config=GlobalPlanConfig(grouping=cfg, max_wait_rounds=2), age=wait,
                          num_steps=target)
    out = p.slots()
    used = [i for step in out for slot in step for i in slot]
    assert len(used) == len(set(used))
    assert len(out) == target and all(len(step) == k for step in out)
    for step in out:
        for slot in step:
            if slot:
                assert len(slot) * length[slot].max() <= 600
    if length.size >= target * k:
        assert all(slot for step in out for slot in step), "no IDLE slot while samples remain"
    # Bounded waiting: every old sample's group goes first, so the oldest sample always leaves.
    if length.size:
        assert int(np.argmax(wait)) in used or wait.max() < 2


@pytest.mark.parametrize("seed", range(4))
def test_round_plan_assignment_keeps_most_tokens_home(seed):
    # Brute force over every assignment of a step's groups to ranks: the plan keeps the most tokens home.
    rng = np.random.default_rng(100 + seed)
    cfg = GroupingConfig(token_budget=900)
    k = 4
    length, src, _ = _buffer(rng, k, 30)
    p = plan_global_round(length, src, k, config=GlobalPlanConfig(grouping=cfg, max_wait_rounds=99), num_steps=1)
    step = p.slots()[0]
    home = lambda assign: sum(int(length[i]) for m, slot in enumerate(assign) for i in slot  # noqa: E731
                              if src[i] == m)
    best = max(home(perm) for perm in itertools.permutations(step))
    assert home(step) == best


def test_fixed_num_steps_splits_to_fill_every_slot_and_pads_an_empty_union():
    cfg = GlobalPlanConfig(grouping=GroupingConfig(token_budget=600))
    length, src = np.full(12, 100), np.repeat(np.arange(4), 3)  # two full groups of 6
    p = plan_global_round(length, src, 4, config=cfg, num_steps=3)
    assert p.num_steps == 3 and all(slot for step in p.slots() for slot in step)
    assert (p.dest == src).all()  # each split half lands where its samples are
    empty = plan_global_round([], [], 4, config=cfg, num_steps=2)
    assert empty.num_steps == 2 and empty.slots() == [[[], [], [], []], [[], [], [], []]]


def test_round_target_is_max_based_between_groups():
    assert round_target([40, 4], [200, 60], [4, 4], 8) == 8     # group 1 splits to fill 8 steps x 4
    assert round_target([40, 4], [200, 12], [4, 4], 8) == 3     # ... but only as far as its samples allow
    assert round_target([1, 0], [2, 0], [4, 4], 8) == 1         # the tail: IDLE slots, one step


def test_planning_arguments_are_checked_at_construction():
    ds = sc.TokenDataset(8)
    with pytest.raises(ValueError, match="balance=False"):
        evenflow.DynamicBatchLoader(ds, token_budget=sc.BUDGET, planning="global", balance=True)
    with pytest.raises(ValueError, match="one of 'auto', 'local', 'global'"):
        evenflow.DynamicBatchLoader(ds, token_budget=sc.BUDGET, planning="union")
    with pytest.raises(ValueError, match="planning_group=2 exceeds the world size 1"):
        evenflow.DynamicBatchLoader(ds, token_budget=sc.BUDGET, planning="global", planning_group=2)
