"""planning="auto", the default: the resolution rule the docs state, and what every rank then agrees on.

The rule (NOTE [ The default planning policy ] in evenflow/runtime/planning.py) is a function of the
configuration alone; the resolved policy, never "auto", is what the fingerprint and the first exchange compare.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import evenflow
import loader_scenarios as sc
from _dist import run_world
from evenflow.runtime.loader import LoaderConfig
from evenflow.runtime.planning import MAX_PLANNING_GROUP, resolve_planning

PAGE = Path(__file__).resolve().parents[1] / "docs" / "default-trains.md"
RULE = "2 <= world size <= 64"
"""The rule's wording, the same on the docs page, the loader's docstring and LoaderConfig.planning."""


def _auto(world, balance=False, planning_group=None):
    return resolve_planning("auto", world, balance=balance, planning_group=planning_group)


def test_auto_resolves_by_the_documented_rule():
    # global when 2 <= W <= 64 and balance=False ...
    assert [_auto(w) for w in (2, 3, 4, 8, 63, 64)] == ["global"] * 6
    # ... local for one rank (nothing to pool) and above 64 ranks (opt-in there) ...
    assert [_auto(w) for w in (1, 65, 256, 2560)] == ["local"] * 4
    assert MAX_PLANNING_GROUP == 64
    # ... unless planning_group is given, which opts into global planning at any scale >= 2 ranks ...
    assert [_auto(w, planning_group=8) for w in (65, 2560)] == ["global", "global"]
    assert _auto(1, planning_group=1) == "local"
    # ... and balance=True keeps the local policy (its rebalancer), at every world size.
    assert [_auto(w, balance=True) for w in (1, 2, 64, 65)] == ["local"] * 4
    assert _auto(128, balance=True, planning_group=8) == "local"
    # An explicit policy is never changed.
    for policy in ("local", "global"):
        assert all(resolve_planning(policy, w, balance=False, planning_group=None) == policy for w in (1, 4, 65))


def test_docs_state_the_rule_and_its_relation_to_balance():
    loader_doc = inspect.getdoc(evenflow.DynamicBatchLoader)
    config_doc = inspect.getsource(LoaderConfig)
    page = PAGE.read_text()
    for where, text in (("DynamicBatchLoader docstring", loader_doc), ("LoaderConfig.planning", config_doc),
                        ("docs/default-trains.md", page)):
        flat = " ".join(text.split())
        assert RULE in flat, f"{where} does not state the rule {RULE!r}"
        assert "balance=True" in flat and "planning_group" in flat, where
        assert '"auto"' in flat or "`auto`" in flat or "'auto'" in flat, where


def test_default_is_auto_resolved_once_at_construction():
    ds = sc.TokenDataset(8)
    assert inspect.signature(evenflow.DynamicBatchLoader).parameters["planning"].default == "auto"
    assert LoaderConfig.__dataclass_fields__["planning"].default == "auto"
    loaders = {p: evenflow.DynamicBatchLoader(ds, token_budget=sc.BUDGET, planning=p)
               for p in ("auto", "local", "global")}
    try:
        assert loaders["auto"].config.planning == "auto"
        assert loaders["auto"].planning == "local"  # one rank
        # The fingerprint records the resolved policy: a one-rank "auto" state is a "local" state.
        assert loaders["auto"].fingerprint == loaders["local"].fingerprint != loaders["global"].fingerprint
    finally:
        for loader in loaders.values():
            loader.close()
    with pytest.raises(ValueError, match="'auto', 'local', 'global'"):
        evenflow.DynamicBatchLoader(ds, token_budget=sc.BUDGET, planning="union")


# -- real gloo world (3 ranks) -------------------------------------------------------------------------------
def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def sc_auto_resolution(rank, world):
    """What "auto" resolves to here, and which saved states it accepts (no epoch needs to run)."""
    make = lambda **kw: evenflow.DynamicBatchLoader(sc.TokenDataset(60), token_budget=sc.BUDGET,  # noqa: E731
                                                    buffer_size=8, **kw)
    auto, local, glob, balanced = make(), make(planning="local"), make(planning="global"), make(balance=True)
    try:
        state = auto.state_dict()
        into_global = make(planning="global")
        into_local = make(planning="local")
        try:
            return dict(policies=(auto.planning, balanced.planning),
                        same_as_global=auto.fingerprint == glob.fingerprint,
                        same_as_local=auto.fingerprint == local.fingerprint,
                        into_global=_error(lambda: into_global.load_state_dict(state)),
                        into_local=_error(lambda: into_local.load_state_dict(state)))
        finally:
            into_global.close()
            into_local.close()
    finally:
        for loader in (auto, local, glob, balanced):
            loader.close()


def sc_auto_mismatch(rank, world):
    """Every rank passes "auto"; the last also passes balance=True, so it resolves to "local". The global ranks
    are refused at construction (before creating planning groups), the local one at its first epoch's check
    (which meets their construction check)."""
    loaders = []

    def run():
        loaders.append(evenflow.DynamicBatchLoader(sc.TokenDataset(60), token_budget=sc.BUDGET, buffer_size=8,
                                                   balance=rank == world - 1))
        sc.epoch_record(loaders[0])
    try:
        return _error(run)
    finally:
        for loader in loaders:
            loader.close()


def _body(rank, world):
    return dict(resolution=sc_auto_resolution(rank, world), mismatch=sc_auto_mismatch(rank, world))


WORLD = 3
_RESULTS: list = []


def results():
    if not _RESULTS:
        _RESULTS.extend(run_world(_body, WORLD, timeout=300))
    return _RESULTS


@pytest.mark.multiprocess
def test_auto_resolves_global_on_three_ranks_and_the_fingerprint_records_it():
    for r in results():
        res = r["resolution"]
        assert res["policies"] == ("global", "local"), res
        assert res["same_as_global"] and not res["same_as_local"], res
        assert res["into_global"] == "no error", res
        assert "cannot resume" in res["into_local"] and "planning='local'" in res["into_local"], res


@pytest.mark.multiprocess
def test_ranks_that_resolve_auto_differently_are_refused_naming_both_settings():
    for rank, r in enumerate(results()):
        message = r["mismatch"]
        assert message.startswith("ValueError: ranks disagree on the planning configuration"), (rank, message)
        assert "\"planning='global' (planning='auto' resolved) planning_group=3\": [0, 1]" in message, (rank, message)
        assert f"\"planning='local' (planning='auto' resolved) planning_group=3\": [{WORLD - 1}]" in message, (
            rank, message)
        assert "balance=" in message, (rank, message)
