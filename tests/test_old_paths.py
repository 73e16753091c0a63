"""Every import path that worked before the package moved keeps working: the same object, and a
``DeprecationWarning`` that names the new home."""

from __future__ import annotations

import importlib
import warnings

import pytest

pytest.importorskip("transformers")  # evenflow.vlm needs it

MOVED = {  # old module -> its new home(s)
    "evenflow.models": ["evenflow.testing"],
    "evenflow.models.tiny_mllm": ["evenflow.testing.tiny_mllm"],
    "evenflow.models.mllm_step": ["evenflow.testing.mllm_step"],
    "evenflow.models.hf_vlm": ["evenflow.vlm"],
    "evenflow.models.hf_vlm.tiny": ["evenflow.testing.tiny_vlm"],
    **{f"evenflow.models.hf_vlm.{m}": [f"evenflow.vlm.{m}"]
       for m in ("base", "config", "families", "flops", "qwen2_vl", "qwen3_vl", "qwen_omni", "step", "warmup")},
    "evenflow.balance.orchestrator": ["evenflow.balance.phases", "evenflow.exchange", "evenflow.errors"],
    **{f"evenflow.balance.orchestrator.{m}": [f"evenflow.balance.phases.{m}"] for m in ("meta", "plan", "routing")},
    "evenflow.balance.orchestrator.runtime": ["evenflow.exchange.orchestrator"],
    "evenflow.balance.orchestrator.failures": ["evenflow.exchange.failures"],
    "evenflow.balance.dispatch": ["evenflow.exchange.dispatch"],
    "evenflow.runtime.faults": ["evenflow.errors"],
    "evenflow.runtime.step_info": ["evenflow.step_info"],
}

ORCHESTRATOR_NAMES = [  # what `evenflow.balance.orchestrator` exported before it was split
    "PhaseSpec", "OrchestratorConfig", "ExampleMeta", "ExampleInputs", "PhasePlan", "StepPlan", "PhaseBalance",
    "RankRouting", "LLMInputs", "GlobalOrchestrator", "plan_step", "rank_routing", "encode_metadata",
    "decode_metadata", "local_step", "check_examples", "Encoder", "ItemRule", "ExampleError"]


def _names(old: str) -> list[str]:
    if old == "evenflow.balance.orchestrator":
        return ORCHESTRATOR_NAMES
    names = list(importlib.import_module(MOVED[old][0]).__all__)
    assert names, old
    return names


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_same_object_and_names_the_new_home(old):
    module = importlib.import_module(old)
    for name in _names(old):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(module, name)
        homes = [h for h in MOVED[old] if hasattr(importlib.import_module(h), name)]
        assert homes and value is getattr(importlib.import_module(homes[0]), name), (old, name)
        assert [w.category for w in caught] == [DeprecationWarning], (old, name)
        assert f"moved to {homes[0]}:" in str(caught[0].message)


def test_from_import_of_an_old_path_warns_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from evenflow.models.hf_vlm import BalancedVLM  # noqa: F401
    assert caught and all(w.filename == __file__ for w in caught)
    assert "evenflow.models.hf_vlm.BalancedVLM moved to evenflow.vlm" in str(caught[0].message)


def test_an_old_path_names_what_it_does_not_have():
    import evenflow.runtime.faults as faults
    with pytest.raises(AttributeError, match="its names moved to evenflow.errors"):
        faults.NoSuchName  # noqa: B018


def test_old_submodule_imports_keep_working():
    import evenflow.balance.orchestrator.runtime as old_runtime
    import evenflow.exchange.orchestrator as new_runtime
    from evenflow.models.hf_vlm import tiny
    from evenflow.testing import tiny_vlm
    with pytest.warns(DeprecationWarning, match="evenflow.exchange.orchestrator"):
        assert old_runtime.GlobalOrchestrator is new_runtime.GlobalOrchestrator
    with pytest.warns(DeprecationWarning, match="evenflow.testing.tiny_vlm"):
        assert tiny.tiny_vlm is tiny_vlm.tiny_vlm
