"""Lightning: the progress bar's ETA comes from the loader's step bound, IDLE batches are never logged.

Real ``L.Trainer.fit`` runs on a 2-rank gloo CPU world (tests/lightning_scenarios.py, tests/_dist.py, one world for
all scenarios). Checked: the bar's train total is each batch's ``StepInfo.steps_bound`` (never below the batches
trained, the exact count at the epoch's end) while Lightning's loop still sees no ``len()`` and validates at every
epoch's end; an ``IterableDataset`` shows no total; a ``training_step`` that logs reflexively under
``EvenflowModule`` never logs an IDLE batch's value and its ``on_epoch`` mean counts real batches only -- and the
same module on ``L.LightningModule`` does log them (the scenario really produces the failure it guards against).
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("lightning", "transformers")),
                                 reason="needs the 'lightning' extra: pip install 'evenflow[lightning]'")]

from _dist import scenario_results as _results  # noqa: E402

REL = 1e-6  # logged values pass through float32 in Lightning's logger path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from _dist import run_world
    import lightning_scenarios
    out_dir = str(tmp_path_factory.mktemp("lightning"))
    return run_world(lightning_scenarios.world_body, 2, out_dir, timeout=300, pg_timeout_s=120)




def test_progress_bar_total_is_the_step_bound_and_validation_still_runs(world):
    res = _results(world, "bar")
    for rank, r in enumerate(res):
        # Lightning's loop has no length for the train loader (it would otherwise skip end-of-epoch validation).
        assert not r["train_loader_has_len"] and r["num_training_batches"] == float("inf")
        epochs = sorted({b["epoch"] for b in r["batches"]})
        assert epochs == [0, 1]
        for epoch in epochs:
            batches = [b for b in r["batches"] if b["epoch"] == epoch]
            trained = len(batches)
            assert [b["batch_idx"] for b in batches] == list(range(trained))
            for b in batches:
                assert b["steps_bound"] >= 0, "map-style batches carry a step bound"
                assert b["total"] == b["steps_bound"], (rank, b)       # the bound, refreshed at every batch
                assert b["total"] >= b["batch_idx"] + 1, (rank, b)     # never below the batches trained
            assert batches[0]["total"] > trained, "the bound should start loose and tighten (else this tests nothing)"
            assert len({b["total"] for b in batches}) > 1, "the total should change during the epoch"
            end = [e for e in r["epoch_ends"] if e["epoch"] == epoch]
            assert len(end) == 1 and end[0]["total"] == trained, (rank, end)
            if rank == 0:  # the enabled bar (Lightning disables it on other ranks) also shows n == total
                assert end[0]["n"] == trained
        # End-of-epoch validation ran once per epoch, after that epoch's last train batch.
        trained_per_epoch = {e: sum(1 for b in r["batches"] if b["epoch"] == e) for e in epochs}
        assert r["val_runs"] == [dict(epoch=e, trained=trained_per_epoch[e]) for e in epochs]
    # The bound is identical on every rank.
    assert [b["total"] for b in res[0]["batches"]] == [b["total"] for b in res[1]["batches"]]


def test_iterable_dataset_shows_no_total(world):
    for r in _results(world, "idle"):
        assert r["batches"] and all(b["steps_bound"] == -1 and b["total"] is None for b in r["batches"])
        assert [e["total"] for e in r["epoch_ends"]] == [None]


def _real_mean(seen):
    real = [s for s in seen if not s["idle"]]
    return sum(s["value"] * s["rows"] for s in real) / sum(s["rows"] for s in real)


def _synced_mean(seen, world=2):
    """Lightning's ``sync_dist=True`` epoch mean: all-reduced sum of value x batch size over the all-reduced batch
    sizes -- each divided by the world size, the integer batch-size total truncated (lightning_fabric ``_sync_ddp``
    copies ``result / world_size`` back into the integer tensor), as in Lightning 2.6."""
    return sum(s["value"] * s["rows"] for s in seen) / world / (sum(s["rows"] for s in seen) // world)


def _logged_steps(csv_rows, key):
    return {int(row["step"]): row[key] for row in csv_rows if key in row}


def test_idle_batches_are_never_logged_and_epoch_means_count_real_batches(world):
    res = _results(world, "idle")
    seen0, seen1 = res[0]["seen"], res[1]["seen"]
    idle = [s for s in seen0 if s["idle"]]
    assert idle and not any(s["idle"] for s in seen1), "rank 0 should run dry and train IDLE batches, rank 1 not"
    real_values = [s["value"] for s in seen0 if not s["idle"]]
    for key in ("train_loss_step", "train_loss_dict"):  # self.log and self.log_dict
        logged = _logged_steps(res[0]["csv"], key)
        assert logged, key
        for s in seen0:
            if s["step"] not in logged:
                continue
            value = logged[s["step"]]
            if s["idle"]:
                # Lightning's loggers repeat a key's last on_step value until it is logged again: at an IDLE step
                # they show the last real batch's value, never the placeholder's.
                assert value != pytest.approx(s["value"], rel=REL), (key, s)
                last_real = [x["value"] for x in seen0 if not x["idle"] and x["step"] < s["step"]][-1]
                assert value == pytest.approx(last_real, rel=REL), (key, s)
            else:
                assert value == pytest.approx(s["value"], rel=REL), (key, s)
        assert all(any(v == pytest.approx(x, rel=REL) for x in real_values) for v in logged.values()), key
    # on_epoch: Lightning's batch-size-weighted mean over the real batches only, on every rank.
    epoch = [row["train_loss_epoch"] for row in res[0]["csv"] if "train_loss_epoch" in row]
    assert epoch == [pytest.approx(_real_mean(seen0), rel=REL)]
    for r in res:
        assert r["callback_metrics"]["train_loss_epoch"] == pytest.approx(_real_mean(r["seen"]), rel=REL)
    # sync_dist=True all-reduces inside self.log, so it cannot be skipped on one rank: it warns once instead, and
    # the recommended value (scale_loss) makes the IDLE rank contribute exactly 0 -- the synced value at an IDLE
    # step of rank 0 is rank 1's own per-token loss.
    assert len(res[0]["warnings"]) == 1 and "'synced_loss'" in res[0]["warnings"][0] and not res[1]["warnings"]
    synced = _logged_steps(res[0]["csv"], "synced_loss")
    for s in idle:
        assert synced[s["step"]] == pytest.approx(seen1[s["step"]]["value"], rel=REL)
    # sync_dist=True, on_epoch only: all-reduced at the epoch's end, the IDLE batches weigh 0 in the global mean.
    for r in res:
        assert r["callback_metrics"]["epoch_synced"] == pytest.approx(
            _synced_mean([s for s in seen0 + seen1 if not s["idle"]]), rel=REL)


def test_without_evenflow_module_idle_batches_are_logged(world):
    """The control: the same training_step on a plain LightningModule logs every IDLE placeholder's loss."""
    res = _results(world, "idle_plain")
    seen0 = res[0]["seen"]
    assert any(s["idle"] for s in seen0)
    logged = _logged_steps(res[0]["csv"], "train_loss_step")
    assert [logged[s["step"]] for s in seen0] == [pytest.approx(s["value"], rel=REL) for s in seen0]
    all_mean = sum(s["value"] * s["rows"] for s in seen0) / sum(s["rows"] for s in seen0)
    assert res[0]["callback_metrics"]["train_loss_epoch"] == pytest.approx(all_mean, rel=REL)
    assert all_mean != pytest.approx(_real_mean(seen0), rel=REL)
    assert res[0]["callback_metrics"]["epoch_synced"] == pytest.approx(_synced_mean(seen0 + res[1]["seen"]), rel=REL)


def test_a_rank_with_only_idle_batches_keeps_synced_epoch_logs_in_step(world):
    """Rank 0 has no sample at all: it never logs a per-rank value, yet an ``on_epoch`` ``sync_dist=True`` log still
    reaches the epoch-end all-reduce on both ranks (weight 0), so nobody hangs and the mean is rank 1's."""
    res = _results(world, "idle_empty")
    assert res[0]["seen"] and all(s["idle"] for s in res[0]["seen"])
    assert not any(s["idle"] for s in res[1]["seen"])
    assert "train_loss_epoch" not in res[0]["callback_metrics"]
    assert not [row for row in res[0]["csv"] if "train_loss_step" in row or "train_loss_epoch" in row]
    for r in res:
        assert r["callback_metrics"]["epoch_synced"] == pytest.approx(_synced_mean(res[1]["seen"]), rel=REL)


# -- in-process ----------------------------------------------------------------------------------------------------
def test_evenflow_module_guards_every_training_step_and_keeps_signatures(monkeypatch):
    import inspect

    import lightning as L

    from evenflow import STEP_INFO_KEY, StepInfo, pop_step_info
    from evenflow.integrations.lightning import EvenflowModule

    def info(idle):
        return StepInfo(step=0, epoch=0, is_idle=idle, local_samples=0 if idle else 1, global_samples=1,
                        local_loss_tokens=0 if idle else 3, global_loss_tokens=3, loss_scale=0.0 if idle else 1.0,
                        padded_tokens=4, real_tokens=4)

    class Base(EvenflowModule):
        def __init__(self):
            super().__init__()
            self.logged = []

        def training_step(self, batch, batch_idx):
            self.log("base", 1.0)
            return batch_idx

    class Child(Base):  # pops the info, then calls super(): the inner step still knows it is IDLE
        def training_step(self, batch, batch_idx):
            pop_step_info(batch)
            self.log("child", 1.0)
            out = super().training_step(batch, batch_idx)
            self.log("after", 1.0)
            return out

    calls = []

    def record(self, name, value, *args, **kwargs):  # stands in for LightningModule.log (no trainer attached)
        calls.append(name)

    monkeypatch.setattr(L.LightningModule, "log", record)
    module = Child()
    assert module.training_step({STEP_INFO_KEY: info(True)}, 3) == 3 and calls == []
    assert module.training_step({STEP_INFO_KEY: info(False)}, 4) == 4 and calls == ["child", "base", "after"]
    calls.clear()
    module.log_dict({"a": 1.0})   # LightningModule.log_dict goes through self.log: guarded the same way
    module.training_step({STEP_INFO_KEY: info(True)}, 5)
    module.log("outside", 1.0)    # outside training_step (epoch-end hooks ...) nothing is skipped
    assert calls == ["a", "outside"]
    assert list(inspect.signature(Child.training_step).parameters) == ["self", "batch", "batch_idx"]
