"""DynamicBatchLoader on real gloo process worlds (CPU): the guarantees of brief section 4.

One spawned world per world size runs many scenarios, so the suite stays within its time budget. Every
world is polled with a timeout (tests/_dist.py); nothing can hang.
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import loader_scenarios as sc
from _dist import RankFailed, run_session, run_world

pytestmark = pytest.mark.multiprocess


def _world_body(rank, world, names):
    out = {}
    for name, fn, kwargs in names:
        out[name] = getattr(sc, fn)(rank, world, **kwargs)
    return out


def _scenarios(world):
    cases = [
        ("coverage", "sc_coverage", dict(n=601 if world != 4 else 103)),
        ("coverage_w1", "sc_coverage", dict(n=601 if world != 4 else 103, workers=1, context="fork")),
        ("quota", "sc_quota", dict()),
        ("iterable", "sc_iterable", dict()),
        ("exact_k1", "sc_exact_loss", dict()),
        ("exact_k3", "sc_exact_loss", dict(grad_accum_steps=3)),
    ]
    if world == 2:
        cases += [
            ("coverage_spawn", "sc_coverage", dict(n=601, workers=2, context="spawn")),
            ("coverage_forkserver", "sc_coverage", dict(n=601, workers=1, context="forkserver")),
            ("break", "sc_break", dict()),
            ("resume", "sc_resume", dict(stop_at=4)),
            ("resume_accum", "sc_resume", dict(stop_at=3, grad_accum_steps=2)),
            ("resume_iterable", "sc_resume", dict(stop_at=3, iterable=True)),
            ("iterable_w2", "sc_iterable", dict(workers=2)),
            ("minimal_collate", "sc_minimal_collate", dict()),
            ("one_worker", "sc_one_worker_default_buffer", dict()),
            ("oversize", "sc_oversize", dict()),
            ("exact_sum", "sc_exact_loss", dict(reduction="sum", grad_accum_steps=2)),
            ("summed", "sc_coverage", dict(n=301, cost="summed")),
            ("eval_mid_epoch", "sc_eval_mid_epoch", dict()),
        ]
    if world == 3:
        cases += [("break", "sc_break", dict()), ("resume", "sc_resume", dict(stop_at=6)),
                  ("balanced_resume", "sc_resume", dict(stop_at=6, balance=True)),
                  ("balanced_iterable", "sc_balanced", dict(iterable=True))]
    if world in (3, 4):
        cases += [("balanced", "sc_balanced", dict(n=601 if world != 4 else 103)),
                  # balance=True re-deals the local policy's groups: its baseline is the local policy
                  ("unbalanced", "sc_coverage", dict(n=601 if world != 4 else 103, buffer_size=32, seed=4,
                                                     planning="local")),
                  ("balanced_exact", "sc_exact_loss", dict(grad_accum_steps=2, balance=True))]
    return cases


_RESULTS: dict[int, list] = {}


def world_results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_world(_world_body, world, _scenarios(world), timeout=400)
    return _RESULTS[world]


WORLDS = [1, 2, 3, 4]


def _check_epoch(per_rank, n_expected=None, budget=sc.BUDGET, ids_key="ids", per_rank_ids=False):
    steps = [len(r) for r in per_rank]
    assert len(set(steps)) == 1, f"ranks yielded different step counts: {steps}"
    # Map-style ids are dataset indices (global); iterable ids are stream positions (unique per rank).
    ids = [(rank if per_rank_ids else 0, i) for rank, r in enumerate(per_rank) for s in r for i in s[ids_key]]
    assert len(ids) == len(set(ids)), "a sample was yielded twice"
    ids = [i for _, i in ids]
    if n_expected is not None:
        assert sorted(ids) == list(range(n_expected)), "samples missing from the epoch"
    for s in range(steps[0]):
        rows = [r[s] for r in per_rank]
        assert len({row["step"] for row in rows}) == 1
        assert sum(row["local"] for row in rows) == rows[0]["glob"], "sum of local loss tokens != global"
        assert sum(row["samples"] for row in rows) == rows[0]["gsamples"]
        for row in rows:
            assert row["numel"] <= budget or row["idle"], f"batch of shape {row['shape']} exceeds the budget"
            if row["idle"]:
                assert row["ids"] == [] and row["local"] == 0 and row["scale"] == 0.0
    return ids


@pytest.mark.parametrize("world", WORLDS)
def test_exactly_once_equal_steps_budgets(world):
    res = world_results(world)
    n = 601 if world != 4 else 103
    for name in ("coverage", "coverage_w1"):
        per_rank = [r[name]["steps"] for r in res]
        _check_epoch(per_rank, n)
        # len() is identical on every rank and never below the true number of steps.
        assert len({r[name]["first_len"] for r in res}) == 1
        assert res[0][name]["first_len"] >= len(per_rank[0])
        for s in range(len(per_rank[0])):
            bounds = {r[s]["bound"] for r in per_rank}
            assert len(bounds) == 1 and bounds.pop() >= len(per_rank[0])
    # Worker processes do not change a single batch.
    assert [r["coverage"]["steps"] for r in res] == [r["coverage_w1"]["steps"] for r in res]


def test_start_methods_and_workers_do_not_change_batches():
    res = world_results(2)
    base = [r["coverage"]["steps"] for r in res]
    for name in ("coverage_spawn", "coverage_forkserver"):
        assert [r[name]["steps"] for r in res] == base, f"{name} produced different batches"


def test_determinism_across_runs():
    again = run_world(_world_body, 2, [("coverage", "sc_coverage", dict(n=601))], timeout=200)
    assert [r["coverage"]["steps"] for r in again] == [r["coverage"]["steps"] for r in world_results(2)]


def test_own_longest_padding_and_mixed_order():
    res = world_results(2)
    rows = [s for r in res for s in r["coverage"]["steps"] if not s["idle"]]
    lengths = sc.long_tail_lengths(601)
    # Every batch is padded to its *own* longest sample (no lag-by-one sizing, brief section 5 trap 9).
    for row in rows:
        assert row["shape"] == (len(row["ids"]), max(int(lengths[i]) for i in row["ids"]))
    # Emission is not a sorted curriculum: the longest sample of each step is not monotone over the epoch.
    longest = [max(int(lengths[i]) for i in row["ids"]) for row in res[0]["coverage"]["steps"] if row["ids"]]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


@pytest.mark.parametrize("world", WORLDS)
def test_quota_mode_loses_nothing(world):
    res = world_results(world)
    epochs = len(res[0]["quota"]["epochs"])
    counts = collections.Counter()
    for r in res:
        for e in range(epochs):
            for s in r["quota"]["epochs"][e]:
                assert not s["idle"], "quota mode never yields IDLE batches"
                counts.update(s["ids"])
        counts.update(r["quota"]["carry"])
    for e in range(epochs):
        assert len({len(r["quota"]["epochs"][e]) for r in res}) == 1
    assert counts == collections.Counter({i: epochs for i in range(301)}), "quota mode lost or duplicated samples"


@pytest.mark.parametrize("world", WORLDS)
def test_iterable_uneven_streams(world):
    res = world_results(world)
    per_rank = [r["iterable"]["steps"] for r in res]
    gids = [g for r in per_rank for s in r for g in s["gid"] if not s["idle"]]
    expected = sorted(r_ * 100_000 + j for r_ in range(world) for j in range(res[r_]["iterable"]["count"]))
    assert sorted(gids) == expected
    _check_epoch(per_rank, per_rank_ids=True)
    if world == 2:
        more = [r["iterable_w2"]["steps"] for r in res]
        gids2 = [g for r in more for s in r for g in s["gid"] if not s["idle"]]
        assert sorted(gids2) == expected


def _reference(windows_per_rank, world, n):
    """Single-process float64 loss and gradient of each accumulation window, over the same samples."""
    ds = sc.TokenDataset(n, seed=5, vocab=sc.VOCAB)
    ds.lengths = np.clip(ds.lengths, 2, 300)
    model = sc.TinyLM()
    for w in range(len(windows_per_rank[0])):
        ids = [i for r in windows_per_rank for i in r[w]["ids"]]
        model.zero_grad()
        total_loss = torch.zeros((), dtype=torch.float64)
        tokens = 0
        for i in ids:
            s = ds[i]
            logits = torch.tanh(model.emb[s["input_ids"]]) @ model.out
            total_loss = total_loss + torch.nn.functional.cross_entropy(logits[:-1], s["labels"][1:],
                                                                        reduction="sum")
            tokens += int((s["labels"][1:] != -100).sum())
        ref = total_loss / tokens
        ref.backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
        yield w, ref.item(), grad, ids


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ["exact_k1", "exact_k3"])
def test_loss_and_gradients_equal_single_process(world, case):
    res = world_results(world)
    windows = [r[case] for r in res]
    assert len({len(w) for w in windows}) == 1
    seen = []
    for w, ref_loss, ref_grad, ids in _reference(windows, world, 90):
        seen += ids
        loss = sum(v for r in windows for v in r[w]["loss_sum"]) / world
        assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss)
        grad = windows[0][w]["grad"]
        for r in windows[1:]:
            np.testing.assert_array_equal(r[w]["grad"], grad)  # DDP: every rank holds the same gradient
        assert np.linalg.norm(grad - ref_grad) <= 1e-10 * np.linalg.norm(ref_grad)
    assert sorted(seen) == list(range(90))


def test_sum_reduction_with_accumulation_is_exact():
    res = world_results(2)
    windows = [r["exact_sum"] for r in res]
    for w, ref_loss, ref_grad, _ in _reference(windows, 2, 90):
        grad = windows[0][w]["grad"]
        assert np.linalg.norm(grad - ref_grad) <= 1e-10 * np.linalg.norm(ref_grad)


@pytest.mark.parametrize("world", [2, 3])
def test_break_mid_epoch_then_continue(world):
    res = world_results(world)
    assert all(len(r["break"]["broke"]) == 3 for r in res)
    assert len(res[0]["break"]["asym"]) == 2 and res[0]["break"]["stopped"] is None  # rank 0 broke at step 2
    for r in res[1:]:  # the others raise PeerStopped naming rank 0 and its step instead of ending silently
        assert r["break"]["stopped"][:2] == (0, 2), r["break"]["stopped"]
    _check_epoch([r["break"]["full"] for r in res], 401)


@pytest.mark.parametrize("world", [2, 3])
def test_resume_mid_epoch_loses_and_repeats_nothing(world):
    res = world_results(world)
    ids = [i for r in res for s in r["resume"]["before"] + r["resume"]["after"] for i in s["ids"]]
    assert sorted(ids) == list(range(401))
    assert len({len(r["resume"]["after"]) for r in res}) == 1
    if world == 2:
        ids = [i for r in res for s in r["resume_accum"]["before"] + r["resume_accum"]["after"] for i in s["ids"]]
        assert sorted(ids) == list(range(401))
        # Iterable keys are stream positions per rank: each rank's positions appear exactly once. A sample
        # trained away from its home rank (global planning, balancing) is keyed (home rank, position), and
        # so are the home rank's own then.
        keys = [(rank, i) if isinstance(i, int) else tuple(i) for rank, r in enumerate(res)
                for s in r["resume_iterable"]["before"] + r["resume_iterable"]["after"] for i in s["ids"]]
        assert len(keys) == len(set(keys)), "a stream sample was trained twice across the resume"
        for r in range(world):
            assert sorted(i for home, i in keys if home == r) == list(range(80 + 23 * r))


def test_collate_keeping_known_keys_keeps_step_info():
    res = world_results(2)
    per_rank = [r["minimal_collate"] for r in res]
    _check_epoch(per_rank, 97)
    assert all(s["glob"] > 0 for s in per_rank[0])


def test_default_buffer_with_one_worker_forms_real_batches():
    res = world_results(2)
    rows = [s for r in res for s in r["one_worker"] if not s["idle"]]
    assert np.mean([s["samples"] for s in rows]) > 4, "one worker must not mean one sample per batch"


def test_oversize_error_names_sample_and_knob():
    res = world_results(2)
    assert "PeerError: evenflow: rank 1 failed at sample index 17" in res[0]["oversize"]  # shuffle=False: rank 1's
    msg = res[1]["oversize"]
    assert "sample 17" in msg and str(sc.BUDGET + 5) in msg and "token_budget" in msg and "oversize" in msg


def test_summed_cost_uses_flat_rows():
    res = world_results(2)
    per_rank = [r["summed"]["steps"] for r in res]
    _check_epoch(per_rank, 301)
    assert all(s["shape"][0] == 1 for r in per_rank for s in r)


@pytest.mark.timeout(900)  # a hang guard; a loaded machine starts workers slowly, and that must not matter
@pytest.mark.parametrize("kind", ["worker", "bad"])
def test_failures_are_loud_and_shared(kind):
    # The peers' workers start 3 s late (a loaded machine): rank 1's error is still its worker's, and the
    # peers, which raise before their own workers are up, leave no worker behind (conftest's fixture checks).
    res = run_world(sc.sc_fault, 3, kind, 3, None, 3.0 if kind == "worker" else 0.0, timeout=600, allow_errors=True)
    assert "injected failure" in res[1]["error"] if kind == "worker" else "sample 10" in res[1]["error"]
    for r in (0, 2):
        assert res[r]["error"].startswith("PeerError: evenflow: rank 1 failed at sample index 10"), res[r]


def test_a_rank_whose_worker_is_still_starting_leaves_no_worker_behind():
    # Rank 1 gives up on its worker (worker_timeout=1 s) while the worker is still starting (4 s): torch's
    # worker then watches the wrong parent and would poll forever once rank 1 exits (issue 21, item 9; the
    # conftest fixture fails the test if any process is left).
    res = run_world(sc.sc_fault, 3, "slow_start", timeout=300, allow_errors=True)
    assert "delivered no sample within worker_timeout=1s" in res[1]["error"], res[1]
    for r in (0, 2):
        assert res[r]["error"].startswith("PeerError: evenflow: rank 1 failed"), res[r]


# Rank 1 dies between batches while its collation thread is anywhere in a round: whichever collective the
# peers are in (world exchange, planning-group exchange, two-level exchange), the error names rank 1.
@pytest.mark.parametrize("loader_kwargs", [{}, dict(planning="local"), dict(balance=True),
                                           dict(planning="global", planning_group=2)],
                         ids=["auto", "local", "balanced", "two_groups"])
@pytest.mark.parametrize("die_at", [1, 3])
def test_a_dead_rank_is_named(loader_kwargs, die_at):
    res = run_world(sc.sc_fault, 3, "exit", die_at, loader_kwargs, timeout=120, allow_errors=True)
    assert isinstance(res[1], RankFailed)
    for r in (0, 2):
        error = res[r]["error"]
        assert error and re.search(r"rank \d's (two-level )?metadata exchange failed", error), res[r]
        named = re.search(r"Rank\(s\) \[([\d, ]+)\] \(pid .*\) are no longer running", error)
        assert named, error
        dead = {int(x) for x in named.group(1).split(",")}
        # Rank 1 is named; so may be a peer that had already raised its own error and exited (two groups).
        assert 1 in dead and all(d == 1 or res[d]["error"] for d in dead), error


def test_a_dead_rank_is_named_in_the_sample_all_to_all():
    res = run_world(sc.sc_dead_peer_in_all_to_all, 3, timeout=120, allow_errors=True)
    for r in (0, 2):
        assert res[r] and res[r].startswith(f"evenflow: rank {r}'s sample all-to-all failed"), res[r]
        assert "Rank(s) [1]" in res[r] and "no longer running" in res[r], res[r]


def test_torchrun_launch(tmp_path):
    script = Path(__file__).with_name("torchrun_job.py")
    proc = run_session([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script), str(tmp_path)], timeout=180, what="the torchrun job",
                       on_timeout=lambda: f"; rank results written: {sorted(p.name for p in tmp_path.glob('rank*.txt'))}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = [int((tmp_path / f"rank{r}.txt").read_text().split()[0]) for r in range(2)]
    totals = [int((tmp_path / f"rank{r}.txt").read_text().split()[1]) for r in range(2)]
    assert counts[0] == counts[1] and sum(totals) == 301


@pytest.mark.parametrize("world", [3, 4])
def test_balanced_keeps_every_guarantee_and_evens_steps(world):
    res = world_results(world)
    n = 601 if world != 4 else 103
    per_rank = [r["balanced"]["steps"] for r in res]
    _check_epoch(per_rank, n)
    plain = [r["unbalanced"]["steps"] for r in res]
    assert [len(r) for r in plain] == [len(r) for r in per_rank], "balancing must not change the step count"

    def mean_imbalance(steps):
        costs = np.array([[s["padded"] for s in r] for r in steps], dtype=float)
        return float((costs.max(0) / costs.mean(0)).mean())

    # The same aligned groups, balanced: every step's max/mean cost is no worse, on average clearly better.
    assert mean_imbalance(per_rank) < mean_imbalance(plain)
    idle = lambda steps: sum(s["idle"] for r in steps for s in r)  # noqa: E731
    assert idle(per_rank) <= idle(plain)
    windows = [r["balanced_exact"] for r in res]
    for w, ref_loss, ref_grad, _ in _reference(windows, world, 90):
        loss = sum(v for r in windows for v in r[w]["loss_sum"]) / world
        assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss)
        assert np.linalg.norm(windows[0][w]["grad"] - ref_grad) <= 1e-10 * np.linalg.norm(ref_grad)


def test_balanced_resume_and_iterables():
    res = world_results(3)
    ids = [i for r in res for s in r["balanced_resume"]["before"] + r["balanced_resume"]["after"] for i in s["ids"]]
    assert sorted(ids) == list(range(401))
    steps = [r["balanced_iterable"]["steps"] for r in res]
    gids = [g for r in steps for s in r for g in s["gid"]]
    assert sorted(gids) == sorted(r * 100_000 + j for r in range(3) for j in range(60 + 37 * r))
    # Moved stream samples are named (source rank, position), so ids stay unique across ranks.
    assert len({i for r in steps for s in r for i in s["ids"]}) == len(gids)


def test_eval_loader_forked_while_training_thread_runs():
    res = world_results(2)
    train = [i for r in res for ids in r["eval_mid_epoch"]["train"] for i in ids]
    assert sorted(train) == list(range(301))
    assert sorted(i for r in res for i in r["eval_mid_epoch"]["evals"]) == list(range(50))
