"""A stock VLM balanced inside HF Trainer and TRL's SFTTrainer, on 3 gloo ranks, against one process.

The data is TRL's own VLM format (``messages`` + ``images``: real scikit-image photos, a third of the chats
text-only), with short videos (pans across a photo) in a ``videos`` column, processed per sample by TRL's vision
collator with a Qwen2-VL processor built offline (tests/_processor.py). The model is a tiny stock Qwen2-VL (float32,
Qwen's full vocabulary). Every run trains 2 optimizer steps of ``gradient_accumulation_steps=2`` with SGD; each
optimizer step's gradients, read just before the update, must equal the stock forward and backward in one process on
the union of every rank's samples of that window (summed token loss / the window's supervised tokens), to 1e-5: TRL
packed and padded, and the Trainer. ``evaluate()`` (before training, and the padded TRL run's
``eval_strategy="steps"``) must give the stock model's per-token loss over the eval set, on every rank. The Trainer
and TRL packed runs save a checkpoint after their first step and a new trainer resumes from it: its second step's
gradients must be the same (the Trainer's with the fitted costs restored, not refitted). The VLM page's Trainer and
TRL blocks run as written on 2 ranks.
"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch

from _dist import run_world, scenario_results as _ok

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD, PAGE_WORLD, SAMPLES, EVAL, LR, TOL = 3, 2, 15, 6, 0.1, 1e-5
PATCH_BUDGET = 512
"""``max_encoder_rows``: two of these photos (64-256 patch rows each) per rank and micro-step."""


VIDEOS = {0: 4, 4: 3, 6: 4, 12: 2}
"""Sample -> frames of its one video (3: an odd count, the last frame repeated to fill a temporal patch). Samples
0, 6 and 12 hold only a video, 4 an image and a video."""


def chats(count: int = SAMPLES) -> list[dict]:
    """TRL's format: a third with one photo, a third with two, the rest text-only; four of them with a short video
    (a pan across a photo), one more ``{"type": "video"}`` placeholder and a ``videos`` entry, as for images."""
    from PIL import Image

    from _processor import photos

    files = photos()
    words = "the cat sat on a mat while two dogs ran past the old red barn".split()
    out = []
    for i in range(count):
        n_images = (0, 1, 2)[i % 3]
        question = " ".join(words[(i + k) % len(words)] for k in range(3 + i % 5))
        answer = " ".join(words[(2 * i + k) % len(words)] for k in range(2 + (7 * i) % 9))
        videos = [_pan(files[i % len(files)], VIDEOS[i])] if i in VIDEOS else []
        content = ([{"type": "image"}] * n_images + [{"type": "video"}] * len(videos)
                   + [{"type": "text", "text": question}])
        out.append({"messages": [{"role": "user", "content": content},
                                 {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                    "images": [Image.open(files[(i + k) % len(files)]).convert("RGB") for k in range(n_images)],
                    "videos": videos})
    return out


def _pan(path, frames: int) -> list:
    """``frames`` 112 x 112 crops sliding across a photo (4 x 4 merged tokens a frame)."""
    from PIL import Image

    photo = Image.open(path).convert("RGB").resize((224, 112))
    return [photo.crop((28 * f, 0, 28 * f + 112, 112)) for f in range(frames)]


def dataset(items: list[dict]):
    """``items`` as a ``datasets.Dataset``, the ``videos`` column declared as frames (datasets would otherwise
    store a list of lists of images as encoded bytes)."""
    import datasets

    return datasets.Dataset.from_list(items).cast_column("videos", datasets.List(datasets.List(datasets.Image())))


class Chats(torch.utils.data.Dataset):
    def __init__(self, items: list[dict]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return dict(self.items[index])


def _model():
    """A fresh copy of the seeded tiny model (building one initializes Qwen's full vocabulary: ~3 s)."""
    import copy

    return copy.deepcopy(_initial_model())


@functools.lru_cache(maxsize=1)
def _initial_model():
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
    """Train; with an eval set (the first ``EVAL`` chats), ``evaluate()`` first, before any step."""
    before = trainer.evaluate() if trainer.eval_dataset is not None and resume is None else None
    ids = _ids_recorder(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return dict(ids=ids, grads=grads.windows, logs=grads.logs, cost=trainer.vlm_config.time_cost, eval=before)


def _trl(rank: int, out: str, packing: bool) -> dict:
    """DynamicBatchSFTTrainer; packed, also a checkpoint after step 1 and a fresh trainer resumed from it."""
    from _processor import local_processor
    from evenflow.integrations.trl import DynamicBatchSFTTrainer

    def build(callback):
        # Packed: a checkpoint after step 1. Padded: evaluated before training and after every step.
        extra = dict(save_strategy="steps", save_steps=1) if packing else dict(eval_strategy="steps", eval_steps=1)
        return DynamicBatchSFTTrainer(model=_model(), args=_args("trl", out, packing=packing, **extra),
                                      train_dataset=dataset(chats()), processing_class=local_processor(),
                                      eval_dataset=None if packing else dataset(chats(EVAL)),
                                      token_budget=320, max_encoder_rows=PATCH_BUDGET, buffer_size=16,
                                      callbacks=[callback])

    grads = _Grads()
    first = _run(build(grads), grads)
    if not packing:
        return first
    grads = _Grads()
    return dict(first, resumed=_run(build(grads), grads, resume=f"{out}/checkpoint-1"))


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
                                  train_dataset=samples, eval_dataset=torch.utils.data.Subset(samples, range(EVAL)),
                                  token_budget=320, max_encoder_rows=PATCH_BUDGET,
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
            mock.patch.object(datasets, "load_dataset", lambda *a, **k: dataset(chats())):
        exec(snippet(name), ns)
    trainer = ns["trainer"]
    return dict(steps=trainer.state.global_step, logs=[dict(e) for e in trainer.state.log_history])


def _scenarios(rank: int, world: int, out: str, names: tuple[str, ...]) -> dict:
    import integration_scenarios as isc

    isc.torchrun_env(rank, world)
    scenarios = {"trl_packed": lambda: _trl(rank, f"{out}/trl_packed", True),
                 "trl_padded": lambda: _trl(rank, f"{out}/trl_padded", False),
                 "trainer": lambda: _trainer(rank, f"{out}/trainer"),
                 "vlm-trainer": lambda: _page("vlm-trainer", f"{out}/page_trainer"),
                 "vlm-trl": lambda: _page("vlm-trl", f"{out}/page_trl")}
    res = {}
    for name in names:
        try:
            res[name] = scenarios[name]()
        except Exception:  # noqa: BLE001 - reported by its test
            res[name] = {"error": traceback.format_exc()}
    return res


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The exactness runs, on 3 ranks."""
    return run_world(_scenarios, WORLD, str(tmp_path_factory.mktemp("vlm_trainers")),
                     ("trl_packed", "trl_padded", "trainer"), timeout=540, pg_timeout_s=120)


@pytest.fixture(scope="module")
def page_world(tmp_path_factory):
    """The VLM page's blocks, on 2 ranks as a user's ``torchrun --nproc-per-node 2`` runs them."""
    return run_world(_scenarios, PAGE_WORLD, str(tmp_path_factory.mktemp("vlm_pages")), ("vlm-trainer", "vlm-trl"),
                     timeout=540, pg_timeout_s=120)


def _reference(windows: list[list[int]]) -> tuple[list[dict[str, torch.Tensor]], list[float], list[float]]:
    """SGD on the stock model in one process: each window's gradients of (summed token loss / its tokens), that
    loss, and the eval set's per-token loss before the first window and after each."""
    import vlm_scenarios as sc
    from _processor import local_processor
    from evenflow import PadCollate
    from evenflow.integrations.trl import ProcessedSamples
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    samples = ProcessedSamples(Chats(chats()), DataCollatorForVisionLanguageModeling(processor=local_processor()))
    model = _model()

    def loss_of(ids: list[int]) -> torch.Tensor:
        batch = PadCollate()([samples[i] for i in ids])
        tokens = int((batch["labels"][:, 1:] != -100).sum())
        return sc.loss_sum(model(**sc.model_inputs(batch), use_cache=False).logits, batch["labels"]) / tokens

    def evaluated() -> float:
        with torch.no_grad():
            return float(loss_of(list(range(EVAL))))

    out, losses, evals = [], [], [evaluated()]
    for ids in windows:
        model.zero_grad(set_to_none=True)
        loss = loss_of(ids)
        loss.backward()
        losses.append(float(loss.detach()))
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
        evals.append(evaluated())
    return out, losses, evals


def _windows(res: list[dict]) -> list[list[int]]:
    """Each optimizer step's samples over every rank (2 micro-steps a window)."""
    steps = len(res[0]["ids"])
    assert all(len(r["ids"]) == steps for r in res) and steps == 4, [len(r["ids"]) for r in res]
    return [sorted(i for r in res for k in (2 * w, 2 * w + 1) for i in r["ids"][k]) for w in range(steps // 2)]


def _check_exact(res: list[dict], windows: list[list[int]]) -> list[float]:
    """The gradients and logged losses of each window; returns the reference eval losses (before, after each)."""
    import vlm_scenarios as sc

    ref, losses, evals = _reference(windows)
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
    return evals


def _check_eval(res: list[dict], want: list[float]) -> None:
    """``evaluate()`` before training and every ``eval_loss`` logged after a step: the stock model's per-token
    loss over the eval set, the same on every rank."""
    got = [r["eval"]["eval_loss"] for r in res]
    assert got == [got[0]] * len(res) and got[0] == pytest.approx(want[0], rel=TOL), (got, want)
    assert res[0]["eval"]["eval_samples"] == EVAL
    during = [e["eval_loss"] for e in res[0]["logs"] if "eval_loss" in e][1:]  # the first is evaluate()'s
    assert during == pytest.approx(want[1:1 + len(during)], rel=TOL), (during, want)




@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_trl_vision_sft_trains_exactly_the_stock_models_gradients(world, layout):
    res = _ok(world, f"trl_{layout}")
    windows = _windows(res)
    assert sorted(i for w in windows for i in w) == sorted(set(i for w in windows for i in w))  # each sample once
    evals = _check_exact(res, windows)
    # Some window trained a video; a micro-step on some rank held nothing to encode (no image, no video).
    assert any(i in VIDEOS for w in windows for i in w), windows
    media = [len(c["images"]) + len(c["videos"]) for c in chats()]
    assert any(not any(media[i] for i in ids) for r in res for ids in r["ids"]), [r["ids"] for r in res]
    if layout == "packed":
        _check_resumed(res)
    else:  # evaluated before training and after each optimizer step
        _check_eval(res, evals)
        assert len([e for e in res[0]["logs"] if "eval_loss" in e]) == 3


def _check_resumed(first: list[dict], resumed: list[dict] | None = None) -> None:
    """The trainer resumed from the checkpoint after step 1 trains the second window only: the same samples on
    every rank, the same gradients."""
    import vlm_scenarios as sc

    resumed = resumed if resumed is not None else [r["resumed"] for r in first]
    assert [r["ids"] for r in resumed] == [r["ids"][2:] for r in first]
    assert sc.rel_err(resumed[0]["grads"][0], first[0]["grads"][1]) <= TOL


def test_trainer_trains_exactly_and_resumes_with_its_fitted_costs(world):
    res = _ok(world, "trainer")
    first = [r["first"] for r in res]
    resumed = [r["resumed"] for r in res]
    windows = _windows(first)
    _check_eval(first, _check_exact(first, windows))
    _check_resumed(first, resumed)
    assert res[0]["fits"] == (1, 0), res[0]["fits"]  # fitted once, restored on resume
    assert resumed[0]["cost"] == first[0]["cost"] is not None


@pytest.mark.parametrize("name", ["vlm-trainer", "vlm-trl"])
def test_the_vlm_pages_trainer_blocks_run_as_written(page_world, name):
    res = _ok(page_world, name)
    assert [r["steps"] for r in res] == [2] * PAGE_WORLD
    logged = [e for e in res[0]["logs"] if "loss" in e]
    assert len(logged) == 2 and all("evenflow/imbalance_vision" in e for e in logged), logged


# -- refusals, at construction (one process) ------------------------------------------------------------------
def _sft(tmp_path, **kwargs):
    from trl import SFTConfig

    from _processor import local_processor
    from evenflow.integrations.trl import DynamicBatchSFTTrainer

    config = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], max_length=None)
    config.update(kwargs.pop("config", {}))
    return DynamicBatchSFTTrainer(model=_model(), args=SFTConfig(**config),
                                  train_dataset=kwargs.pop("train_dataset", None) or dataset(chats(3)),
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


def test_a_video_only_dataset_is_vision_data_and_its_videos_reach_the_processor(tmp_path):
    """TRL recognizes vision data by ``images``; a dataset of videos alone must not be tokenized as text."""
    items = [{k: v for k, v in c.items() if k != "images"} for c in chats(13) if not c["images"]]
    assert [bool(c["videos"]) for c in items] == [True, False, True, False, True]
    # Plain-string turns (no placeholders): the videos go first in the user turn, where TRL puts a string turn's
    # images (the structured placeholders are the 3-rank runs').
    for item in items:
        item["messages"] = [{**m, "content": m["content"][-1]["text"]} for m in item["messages"]]
    trainer = _sft(tmp_path, config=dict(packing=True), train_dataset=dataset(items))
    assert trainer.vlm_config is not None and trainer.vlm_config.layout == "packed"
    video = trainer.processing_class.video_token_id
    for i in (0, 2):
        sample = trainer.train_dataset[i]
        assert "pixel_values" not in sample and sample["video_grid_thw"].tolist() == [[2, 8, 8]]
        assert int((sample["input_ids"] == video).sum()) == 2 * 8 * 8 // 4
    assert "video_grid_thw" not in trainer.train_dataset[1]


@pytest.mark.parametrize("mistake, match", [
    ("no placeholder", r"1 videos but 0 \{'type': 'video'\} placeholders"),
    ("undeclared column", r"cast_column\('videos'"),
])
def test_a_video_sample_the_processor_would_misread_is_refused_naming_the_fix(tmp_path, mistake, match):
    import datasets

    items = chats(1)
    if mistake == "no placeholder":
        items[0]["messages"][0]["content"] = items[0]["messages"][0]["content"][1:]
        data = dataset(items)
    else:
        data = datasets.Dataset.from_list(items)
    trainer = _sft(tmp_path, config=dict(packing=True), train_dataset=data)
    with pytest.raises(ValueError, match=match):
        trainer.train_dataset[0]
