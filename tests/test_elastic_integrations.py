"""Issue 20 item 3: trainer checkpoints saved by 2 processes, resumed on another number of processes.

One 2-rank gloo world trains and checkpoints with the HF Trainer (``evenflow_loader_rank{r}.json`` per rank),
Lightning (``ModelCheckpoint``), Accelerate (``save_state`` with ``LoaderCheckpoint``),
``torch.distributed.checkpoint`` (``LoaderCheckpoint`` as the Stateful) and plain per-rank state files; a 1-rank
world resumes HF, Lightning, Accelerate and the plain files (``resume_from_checkpoint``, ``ckpt_path``,
``load_state``, ``load_state_dict(list)``), a 3-rank world the DCP one. The Accelerate, DCP and list recipes
are the code blocks of the README's "Elastic and multi-node" section, run as written.
Checked: every sample of each completed epoch trained exactly once over the work kept at the checkpoint plus
the resumed run, the token LR rule kept the reference it was saved with (budget x 2 ranks x accumulation, not
x 1), HF's epoch fraction did not restart from 0, and the bare loader given to DCP (which keeps one copy of a
value saved under one key on every rank) is refused naming the fix.
"""

from __future__ import annotations

import collections
import importlib.util
import sys
from pathlib import Path

import pytest

import elastic_integration_scenarios as esc
from _dist import run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

HAS = {m: importlib.util.find_spec(m) is not None for m in ("transformers", "accelerate", "lightning")}
WHICH = tuple(name for name, mods in (("hf", ("transformers", "accelerate")), ("accelerate", ("accelerate",)),
                                      ("lightning", ("lightning", "transformers"))) if all(HAS[m] for m in mods))


def _needs(name):
    return pytest.mark.skipif(name not in WHICH, reason=f"needs the '{name}' extra: pip install 'evenflow[{name}]'")


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("elastic_integrations"))
    two = run_world(esc.saved_by_two, 2, out, WHICH, timeout=600, pg_timeout_s=120)
    for name in WHICH + ("dcp",):
        for r in two:
            assert "error" not in r[name], r[name]["error"]
    step = esc.lightning_stop([x for r in two for x in r["lightning"]["record"]]) if "lightning" in WHICH else None
    one = run_world(esc.resumed_on_one, 1, out, WHICH, step, timeout=600, pg_timeout_s=120)
    three = run_world(esc.resumed_on_three, 3, out, timeout=300)
    return dict(two=two, one=one, three=three, lightning_step=step)


def _once(ids, n, what):
    counts = collections.Counter(ids)
    dup = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(set(range(n)) - set(counts))
    assert not dup and not missing, f"{what}: duplicated {dup[:10]}, missing {missing[:10]}"


@_needs("hf")
def test_hf_trainer_resumes_on_one_process_from_a_two_process_checkpoint(worlds):
    first = [r["hf"] for r in worlds["two"]]
    second = worlds["one"][0]["hf"]
    assert "error" not in second, second["error"]
    assert first[0]["global_step"] == second["global_step"] == esc.HF_STEPS
    kept = [x for r in first for x in r["record"] if x["global_step"] < esc.HF_SAVE]
    resumed = second["record"]
    assert resumed and min(x["global_step"] for x in resumed) == esc.HF_SAVE
    combined = kept + resumed
    epochs = sorted({x["epoch"] for x in combined})
    resumed_epoch = resumed[0]["epoch"]
    assert any(x["epoch"] == resumed_epoch for x in kept), "the checkpoint should lie inside an epoch"
    for epoch in epochs[:-1]:
        _once([i for x in combined if x["epoch"] == epoch for i in x["ids"]], 80, f"HF 2 -> 1 epoch {epoch}")
    last = [i for x in combined if x["epoch"] == epochs[-1] for i in x["ids"]]
    assert len(last) == len(set(last)), "max_steps cut the last epoch, but nothing in it may repeat"
    # The token LR rule keeps the reference of the 2-process run: 128 tokens x 2 ranks x 2 micro-batches.
    assert first[0]["reference"] == second["reference"] == 128 * 2 * 2
    # HF's epoch continues from the samples both ranks trained before the checkpoint, it does not restart.
    before = max(e for s, e in first[0]["epochs"] if s <= esc.HF_SAVE)
    after = min(e for s, e in second["epochs"] if s > esc.HF_SAVE)  # log_history holds the restored steps too
    assert after >= before, (before, after)


@_needs("lightning")
def test_lightning_resumes_on_one_device_from_a_two_device_checkpoint(worlds):
    first = [r["lightning"] for r in worlds["two"]]
    second = worlds["one"][0]["lightning"]
    assert "error" not in second, second["error"]
    stop = worlds["lightning_step"]
    kept = [x for r in first for x in r["record"] if x["global_step"] < stop]
    combined = kept + second["record"]
    for epoch in (0, 1):
        _once([i for x in combined if x["epoch"] == epoch for i in x["ids"]], 96, f"Lightning 2 -> 1 epoch {epoch}")
    assert second["references"] == first[0]["references"] == [192 * 2 * 2]


@_needs("accelerate")
def test_the_readme_accelerate_recipe_resumes_on_one_process_from_a_two_process_state(worlds):
    second = worlds["one"][0]["accelerate"]
    assert "error" not in second, second["error"]
    kept = []
    for r in worlds["two"]:
        windows = 0
        for row in r["accelerate"]["rows"]:  # the 2-process run saved after its SAVE_AT-th window
            if windows < esc.SAVE_AT:
                kept.append(row)
            windows += row["window_end"]
    assert second["start_epoch"] == kept[-1]["epoch"] == 0
    combined = kept + second["rows"]
    for epoch in (0, 1):
        _once([i for w in combined if w["epoch"] == epoch for i in w["ids"]], 200, f"Accelerate 2 -> 1 epoch {epoch}")


def test_the_readme_list_recipe_resumes_two_plain_state_files_on_one_rank(worlds):
    second = worlds["one"][0]["resume_list"]
    assert "error" not in second, second["error"]
    before = [i for r in worlds["two"] for i in r["dcp"]["ids"]]
    _once(before + second["ids"], 301, "list recipe 2 -> 1")


def test_the_readme_dcp_recipe_resumes_on_three_ranks_and_the_bare_loader_is_refused(worlds):
    before = [i for r in worlds["two"] for i in r["dcp"]["ids"]]
    after = worlds["three"]
    for r in after:
        assert "error" not in r["dcp"], r["dcp"]["error"]
    assert {r["dcp"]["start_epoch"] for r in after} == {0}
    _once(before + [i for r in after for i in r["dcp"]["ids"]], 301, "DCP 2 -> 3")
    for r in after:  # every rank got one rank's state (DCP kept one copy): refused, naming LoaderCheckpoint
        assert r["dcp"]["bare"] is not None and "LoaderCheckpoint(loader)" in r["dcp"]["bare"], r["dcp"]["bare"]
