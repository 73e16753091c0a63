"""A stock VLM balanced inside HF Trainer and TRL's SFTTrainer, on 3 gloo ranks, against one process.

The data is TRL's own VLM format (``messages`` + ``images``: real scikit-image photos, a third of the chats
text-only), processed per sample by TRL's vision collator with a Qwen2-VL processor built offline
(tests/_processor.py). The model is a tiny stock Qwen2-VL (float32, Qwen's full vocabulary). Every run trains 2
optimizer steps of ``gradient_accumulation_steps=2`` with SGD; each optimizer step's gradients, read just before
the update, must equal the stock forward and backward in one process on the union of every rank's samples of
that window (summed token loss / the window's supervised tokens), to 1e-5. The Trainer run saves a checkpoint
after its first step and a new trainer resumes from it: its second step's gradients must be the same, with the
fitted costs restored, not refitted. The VLM page's Trainer and TRL blocks run on the same world.

The padded TRL path differs only in the step's layout (the step itself is exact padded too: tests/test_vlm_gloo.py);
here its selection is checked at construction, and benchmarks/vlm/bench_trl_vlm.py trains it.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from _dist import run_world, scenario_results as _ok

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD, SAMPLES, LR, TOL = 3, 15, 0.1, 1e-5
PATCH_BUDGET = 512
"""``max_encoder_rows``: two of these photos (64-256 patch rows each) per rank and micro-step."""


def chats(count: int = SAMPLES) -> list[dict]:
    """TRL's format: a third text-only, the rest with one or two photos."""
    from PIL import Image

    from _processor import photos

    files = photos()
    words = "the cat sat on a mat while two dogs ran past the old red barn".split()
    out = []
    for i in range(count):
        n_images = (0, 1, 2)[i % 3]
        question = " ".join(words[(i + k) % len(words)] for k in range(3 + i % 5))
        answer = " ".join(words[(2 * i + k) % len(words)] for k in range(2 + (7 * i) % 9))
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": question}]
        out.append({"messages": [{"role": "user", "content": content},
                                 {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                    "images": [Image.open(files[(i + k) % len(files)]).convert("RGB") for k in range(n_images)]})
    return out


class Chats(torch.utils.data.Dataset):
    def __init__(self, items: list[dict]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return dict(self.items[index])


def _model():
    from evenflow.testing.tiny_vlm import tiny_vlm

    return tiny_vlm("qwen2_vl", dtype=torch.float32, seed=0)


class _Grads:
    """A callback: each optimizer step's gradients (rank 0) and the sample ids of its micro-steps (this rank)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Grads(TrainerCallback):
            def __init__(self) -> None:
                self.windows: list[dict] = []
                self.logs: list[dict] = []

            def on_log(self, args, state, control, logs=None, **kwargs):
                self.logs.append(dict(logs or {}))

            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                import evenflow.vlm as vlm

                base = vlm.unwrap_model(model)
                self.windows.append({n: p.grad.detach().clone() for n, p in base.named_parameters()
                                     if p.grad is not None})

        return Grads()


def _ids_recorder(trainer) -> list[list[int]]:
    """Wraps ``trainer.balanced_step`` (test only) to record each micro-step's sample ids on this rank."""
    ids: list[list[int]] = []
    step = trainer.balanced_step

    def recorded(model, inputs, info):
        ids.append([int(i) for i in info.sample_ids])
        return step(model, inputs, info)

    trainer.balanced_step = recorded
    return ids


def _args(kind: str, out: str, **extra):
    common = dict(output_dir=out, max_steps=2, gradient_accumulation_steps=2, learning_rate=LR, optim="sgd",
                  lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, logging_steps=1,
                  save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                  seed=0, remove_unused_columns=False)
    common.update(extra)
    if kind == "trl":
        from trl import SFTConfig

        return SFTConfig(**common, max_length=None, bf16=False)  # TRL's default is bf16 autocast, even on CPU
    from transformers import TrainingArguments

    return TrainingArguments(**common)


def _run(trainer, grads, resume: str | None = None) -> dict:
    ids = _ids_recorder(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return dict(ids=ids, grads=grads.windows, logs=grads.logs, cost=trainer.vlm_config.time_cost)


def _trl(rank: int, out: str, packing: bool) -> dict:
    import datasets

    from _processor import local_processor
    from evenflow.integrations.trl import DynamicBatchSFTTrainer

    grads = _Grads()
    trainer = DynamicBatchSFTTrainer(model=_model(), args=_args("trl", out, packing=packing),
                                     train_dataset=datasets.Dataset.from_list(chats()),
                                     processing_class=local_processor(),
                                     token_budget=320, max_encoder_rows=PATCH_BUDGET, buffer_size=16,
                                     callbacks=[grads])
    return _run(trainer, grads)


def _trainer(rank: int, out: str) -> dict:
    """BalancedVLMTrainer with a warm-up, a checkpoint after step 1, then a fresh trainer resumed from it."""
    from _processor import local_processor
    from evenflow.integrations import vlm_trainer
    from evenflow.integrations.trl import ProcessedSamples
    from evenflow.integrations.vlm_trainer import BalancedVLMTrainer
    from evenflow.vlm import VLMConfig, WarmupConfig
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    samples = ProcessedSamples(Chats(chats()), DataCollatorForVisionLanguageModeling(processor=local_processor()))
    fits = []
    fit = vlm_trainer.fit_phase_costs
    vlm_trainer.fit_phase_costs = lambda *a, **k: (fits.append(1), fit(*a, **k))[1]

    def build(callback):
        return BalancedVLMTrainer(model=_model(), args=_args("hf", out, save_strategy="steps", save_steps=1),
                                  train_dataset=samples, token_budget=320, max_encoder_rows=PATCH_BUDGET,
                                  buffer_size=16, vlm_config=VLMConfig(layout="packed"), callbacks=[callback],
                                  warmup=WarmupConfig(vision_rows=(16, 64, 144), llm_tokens=(32, 64, 128),
                                                      repeats=1, clock="thread"))

    grads = _Grads()
    first = _run(build(grads), grads)
    fitted = len(fits)
    grads = _Grads()
    resumed = _run(build(grads), grads, resume=f"{out}/checkpoint-1")
    return dict(first=first, resumed=resumed, fits=(fitted, len(fits) - fitted))


def _page(name: str, out: str) -> dict:
    """docs/vlm.md's block ``name`` as a user runs it, with what it would download substituted: the processor
    (tests/_processor.py), the model (the tiny stock Qwen2-VL) and the dataset (these chats)."""
    import os
    from unittest import mock

    import datasets
    import transformers

    import _processor
    from _snippets import snippet

    os.makedirs(out, exist_ok=True)
    os.chdir(out)
    ns: dict = {}
    with _processor.install(), \
            mock.patch.object(transformers.Qwen2VLForConditionalGeneration, "from_pretrained",
                              lambda *a, **k: _model()), \
            mock.patch.object(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(chats())):
        exec(snippet(name), ns)
    trainer = ns["trainer"]
    return dict(steps=trainer.state.global_step, logs=[dict(e) for e in trainer.state.log_history])


def _world(rank: int, world: int, out: str) -> dict:
    import integration_scenarios as isc

    isc.torchrun_env(rank, world)
    res = {}
    for name, fn in (("trl_packed", lambda: _trl(rank, f"{out}/trl_packed", True)),
                     ("trainer", lambda: _trainer(rank, f"{out}/trainer")),
                     ("vlm-trainer", lambda: _page("vlm-trainer", f"{out}/page_trainer")),
                     ("vlm-trl", lambda: _page("vlm-trl", f"{out}/page_trl"))):
        try:
            res[name] = fn()
        except Exception:  # noqa: BLE001 - reported by its test
            res[name] = {"error": traceback.format_exc()}
    return res


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(_world, WORLD, str(tmp_path_factory.mktemp("vlm_trainers")), timeout=540, pg_timeout_s=120)


def _reference(windows: list[list[int]]) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """SGD on the stock model in one process: each window's gradients of (summed token loss / its tokens), and
    that loss."""
    import vlm_scenarios as sc
    from _processor import local_processor
    from evenflow import PadCollate
    from evenflow.integrations.trl import ProcessedSamples
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    samples = ProcessedSamples(Chats(chats()), DataCollatorForVisionLanguageModeling(processor=local_processor()))
    model = _model()
    out, losses = [], []
    for ids in windows:
        batch = PadCollate()([samples[i] for i in ids])
        tokens = int((batch["labels"][:, 1:] != -100).sum())
        model.zero_grad(set_to_none=True)
        loss = sc.loss_sum(model(**sc.model_inputs(batch), use_cache=False).logits, batch["labels"]) / tokens
        loss.backward()
        losses.append(float(loss.detach()))
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    return out, losses


def _windows(res: list[dict]) -> list[list[int]]:
    """Each optimizer step's samples over every rank (2 micro-steps a window)."""
    steps = len(res[0]["ids"])
    assert all(len(r["ids"]) == steps for r in res) and steps == 4, [len(r["ids"]) for r in res]
    return [sorted(i for r in res for k in (2 * w, 2 * w + 1) for i in r["ids"][k]) for w in range(steps // 2)]


def _check_exact(res: list[dict], windows: list[list[int]]) -> None:
    import vlm_scenarios as sc

    ref, losses = _reference(windows)
    assert len(res[0]["grads"]) == len(windows)
    for got, want in zip(res[0]["grads"], ref):
        assert set(got) == set(want)
        assert sc.rel_err(got, want) <= TOL, sc.rel_err(got, want)
    # Logged: each optimizer step's exact global per-token loss, and the evenflow metrics, per phase too.
    logged = [entry for entry in res[0]["logs"] if "loss" in entry]
    assert [e["loss"] for e in logged] == pytest.approx(losses, rel=TOL)
    for key in ("evenflow/imbalance_vision", "evenflow/imbalance_vision_before", "evenflow/imbalance_llm",
                "evenflow/imbalance", "evenflow/local_padded_efficiency", "evenflow/idle_steps"):
        assert all(key in e for e in logged), (key, logged)




def test_trl_vision_sft_packed_trains_exactly_the_stock_models_gradients(world):
    res = _ok(world, "trl_packed")
    windows = _windows(res)
    assert sorted(i for w in windows for i in w) == sorted(set(i for w in windows for i in w))  # each sample once
    _check_exact(res, windows)
    # A micro-step on some rank held no image (a third of the chats are text-only).
    images = [len(c["images"]) for c in chats()]
    assert any(not any(images[i] for i in ids) for r in res for ids in r["ids"]), [r["ids"] for r in res]


def test_trainer_trains_exactly_and_resumes_with_its_fitted_costs(world):
    res = _ok(world, "trainer")
    first = [r["first"] for r in res]
    resumed = [r["resumed"] for r in res]
    windows = _windows(first)
    _check_exact(first, windows)
    # The resumed trainer trains the second window only, with the same samples and gradients.
    assert [r["ids"] for r in resumed] == [r["ids"][2:] for r in first]
    import vlm_scenarios as sc

    assert sc.rel_err(resumed[0]["grads"][0], first[0]["grads"][1]) <= TOL
    assert res[0]["fits"] == (1, 0), res[0]["fits"]  # fitted once, restored on resume
    assert resumed[0]["cost"] == first[0]["cost"] is not None


@pytest.mark.parametrize("name", ["vlm-trainer", "vlm-trl"])
def test_the_vlm_pages_trainer_blocks_run_as_written(world, name):
    res = _ok(world, name)
    assert [r["steps"] for r in res] == [2] * WORLD
    logged = [e for e in res[0]["logs"] if "loss" in e]
    assert len(logged) == 2 and all("evenflow/imbalance_vision" in e for e in logged), logged


# -- refusals, at construction (one process) ------------------------------------------------------------------
def _sft(tmp_path, **kwargs):
    import datasets
    from trl import SFTConfig

    from _processor import local_processor
    from evenflow.integrations.trl import DynamicBatchSFTTrainer

    config = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], max_length=None)
    config.update(kwargs.pop("config", {}))
    return DynamicBatchSFTTrainer(model=_model(), args=SFTConfig(**config),
                                  train_dataset=datasets.Dataset.from_list(chats(3)),
                                  processing_class=local_processor(), token_budget=320, **kwargs)


@pytest.mark.parametrize("case, match", [
    (dict(config=dict(packing=False), vlm_config="packed"), r"VLMConfig\(layout='padded'\)"),
    (dict(config=dict(packing=True, packing_strategy="wrapped")), "packing_strategy='bfd'"),
    (dict(config=dict(packing=True), data_collator=lambda rows: rows), "drop data_collator"),
    (dict(config=dict(packing=True), max_encoder_rows=256, vlm_config=512), "give it once"),
])
def test_a_vision_sft_setup_that_would_train_otherwise_is_refused_naming_the_fix(tmp_path, case, match):
    from evenflow.vlm import VLMConfig

    case = dict(case)
    if "vlm_config" in case:
        value = case["vlm_config"]
        case["vlm_config"] = VLMConfig(layout=value) if isinstance(value, str) else VLMConfig(max_encoder_rows=value)
    with pytest.raises(ValueError, match=match):
        _sft(tmp_path, **case)


@pytest.mark.parametrize("packing, layout", [(True, "packed"), (False, "padded")])
def test_the_sft_config_picks_the_balanced_steps_layout_and_trl_sees_no_packing(tmp_path, packing, layout):
    trainer = _sft(tmp_path, config=dict(packing=packing))
    assert trainer.vlm_config.layout == layout
    assert trainer.loader_options["cost"] == ("summed" if packing else "padded")
    assert not trainer.args.packing and not trainer.args.padding_free  # what TRL refuses for vision data
    sample = trainer.train_dataset[1]  # processed alone by TRL's collator: one row, no batch dimension
    assert sample["input_ids"].dim() == 1 and "pixel_values" in sample
