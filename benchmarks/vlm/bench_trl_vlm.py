"""TRL's own VLM ``SFTTrainer`` against evenflow's TRL path, on the same work: 2 gloo ranks, real photos.

Run:  python benchmarks/vlm/bench_trl_vlm.py [--rounds 6] [--samples 60] [--quick]   (ONE JSON line last)

Data: chitchat exchanges (``evenflow.data.chitchat_conversations``) in TRL's VLM format (``messages`` +
``images``): a third text-only, the rest with one or two scikit-image photos of varied sizes; a held-out tenth.
The processor is a Qwen2-VL processor built offline (tests/_processor.py: the Qwen3 tokenizer, the Pillow image
processor, a Qwen2-VL chat template). Videos are out of this comparison: TRL's own VLM path has none (evenflow's
takes a ``videos`` column; tests/test_vlm_trainers.py trains it exactly), so a side-by-side run holds images only. The model: the stock ``Qwen2VLForConditionalGeneration`` built tiny from its config
with Qwen's full vocabulary (the same LM head in every arm), seeded, float32.

Arms, each one epoch of ``SFTTrainer`` on 2 gloo ranks, in ABBA order over rounds (the order reversed every
other round, so drift in the machine's load hits every arm alike):

- ``trl_padded``: TRL's ``SFTTrainer`` -- its vision collator, padded batches of ``per_device_train_batch_size``
  samples, its loss normalization -- with the same LM head as evenflow's (the stock logits and a summed
  cross-entropy): TRL's fused head also scores the entropy over the whole vocabulary at every position, pads
  included, for its metrics, which on a CPU would dominate the step; a speed-up must come from the batching;
- ``evenflow_packed``: ``DynamicBatchSFTTrainer`` with ``packing=True`` (which TRL refuses for vision data):
  token-budget micro-batches, one packed row each, every phase balanced;
- ``evenflow_padded``: the same, padded rows.

The same settings in every arm: gradient checkpointing on (TRL's default), ``max_length=None`` (no truncation),
whole sequences supervised (TRL's default label mask: every non-pad token), ``ddp_find_unused_parameters=True``,
``bf16=False``, AdamW at a constant LR, seed 0. Reported per arm: optimizer steps, the share of computed tokens
that are padding, real tokens per second of training (median and min-max over the rounds), the per-phase
imbalance (max / mean over the 2 ranks of vision patch rows encoded and of LLM tokens computed, pads
included, mean and max over micro-steps: TRL's as each rank's batch holds them, evenflow's after the plan), and the
held-out per-token loss after the epoch (one process, the stock forward).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # the offline processor shim (tests and benchmarks only)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.*

from common.world import run_world  # noqa: E402

WORLD = 2
ARMS = ("trl_padded", "evenflow_packed", "evenflow_padded")
BATCH = 7
"""TRL's ``per_device_train_batch_size``."""
TOKEN_BUDGET, PATCH_BUDGET = 2048, 2048
"""evenflow's per-rank budgets: about as many real tokens per micro-step as TRL's 7 samples hold."""
LR = 1e-4


def chats(count: int, seed: int = 0) -> list[dict]:
    """``count`` chitchat first exchanges in TRL's format, a third text-only, the rest with 1-2 photos."""
    from PIL import Image

    from _processor import photos
    from evenflow.data import chitchat_conversations

    rng = np.random.default_rng(seed)
    files = photos()
    out = []
    for i, conversation in enumerate(chitchat_conversations()[:count]):
        user, assistant = list(conversation)[:2]
        n_images = (0, 1, 2)[i % 3]
        images = []
        for _ in range(n_images):
            image = Image.open(files[int(rng.integers(len(files)))]).convert("RGB")
            side = int(rng.integers(160, 480))  # varied sizes: 16-64 merged tokens after the processor's cap
            images.append(image.resize((side, int(side * rng.uniform(0.6, 1.4)))))
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": user["content"]}]
        out.append({"messages": [{"role": "user", "content": content},
                                 {"role": "assistant", "content": [{"type": "text", "text": assistant["content"]}]}],
                    "images": images})
    return out


def _args(out: str, **extra):
    from trl import SFTConfig

    return SFTConfig(output_dir=out, num_train_epochs=1, learning_rate=LR, lr_scheduler_type="constant",
                     optim="adamw_torch", weight_decay=0.0, gradient_checkpointing=True, max_length=None,
                     bf16=False, ddp_find_unused_parameters=True, save_strategy="no", report_to=[], use_cpu=True,
                     dataloader_num_workers=0, disable_tqdm=True, seed=0, logging_steps=1000,
                     per_device_train_batch_size=BATCH, **extra)


def _arm(rank: int, arm: str, data: list[dict], out: str) -> dict:
    """One epoch of ``arm``; this rank's micro-steps (tokens computed, real tokens, vision rows) and the time."""
    import datasets
    import torch
    from trl import SFTTrainer

    from _processor import local_processor
    from evenflow.integrations.trl import DynamicBatchSFTTrainer
    from evenflow.step_info import STEP_INFO_KEY
    from evenflow.testing.tiny_vlm import tiny_vlm

    steps: list[tuple[int, int, int]] = []

    def record(inputs) -> None:
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        real = int(mask.sum()) if mask is not None else int(ids.numel())
        rows = int(inputs["pixel_values"].shape[0]) if "pixel_values" in inputs else 0
        info = inputs.get(STEP_INFO_KEY)
        if info is not None and info.is_idle:
            real, rows = 0, 0
        steps.append((int(ids.numel()), real, rows))

    class TRL(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            """TRL's normalization with evenflow's head: the stock logits and a summed cross-entropy (TRL's fused
            head also scores the entropy over the whole vocabulary at every position, pads included)."""
            record(inputs)
            inputs = dict(inputs)
            labels = inputs.pop("labels")
            logits = model(**inputs, use_cache=False).logits
            summed = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                       ignore_index=-100, reduction="sum")
            items = num_items_in_batch if num_items_in_batch is not None else (labels[:, 1:] != -100).sum()
            loss = summed / torch.as_tensor(items).clamp(min=1)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * self.accelerator.num_processes  # as TRL: DDP averages over ranks
            return (loss, None) if return_outputs else loss

    planned: list[tuple[list[float], list[float]]] = []

    class Ours(DynamicBatchSFTTrainer):
        def compute_loss(self, model, inputs, *a, **k):
            record(inputs)
            return super().compute_loss(model, inputs, *a, **k)

        def balanced_step(self, model, inputs, info):
            step = super().balanced_step(model, inputs, info)
            planned.append(_planned_loads(step.plan, self.vlm_config.layout))
            return step

    model = tiny_vlm("qwen2_vl", dtype=torch.float32, seed=0)
    dataset = datasets.Dataset.from_list(data)
    if arm == "trl_padded":
        trainer = TRL(model=model, args=_args(out), train_dataset=dataset, processing_class=local_processor())
    else:
        trainer = Ours(model=model, args=_args(out, packing=arm == "evenflow_packed"), train_dataset=dataset,
                       processing_class=local_processor(), token_budget=TOKEN_BUDGET,
                       max_encoder_rows=PATCH_BUDGET, buffer_size=32)
    result = trainer.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()} if rank == 0 else None
    return dict(steps=steps, seconds=result.metrics["train_runtime"], optimizer_steps=trainer.state.global_step,
                params=params, planned=planned)


def _planned_loads(plan, layout: str) -> tuple[list[float], list[float]]:
    """Per rank, after the plan: vision patch rows encoded, and LLM tokens computed (packed: the examples'
    tokens; padded: examples x the longest)."""
    world = plan.world
    vision = plan.items.get("vision")
    rows = (np.bincount(vision.dest, weights=vision.rows, minlength=world) if vision is not None
            else np.zeros(world))
    tokens = np.zeros(world)
    for r in range(world):
        mine = plan.length[plan.dest == r]
        if len(mine):
            tokens[r] = mine.sum() if layout == "packed" else len(mine) * mine.max()
    return rows.tolist(), tokens.tolist()


def _held_out_loss(params: dict, held: list[dict]) -> float:
    import torch
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from _processor import local_processor
    from evenflow.testing.tiny_vlm import tiny_vlm

    model = tiny_vlm("qwen2_vl", dtype=torch.float32, seed=0)
    model.load_state_dict(params)
    model.eval()
    collate = DataCollatorForVisionLanguageModeling(processor=local_processor())
    total, tokens = 0.0, 0
    with torch.no_grad():
        for chat in held:
            batch = collate([dict(chat)])
            labels = batch.pop("labels")
            logits = model(**batch, use_cache=False).logits
            total += float(torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100,
                                                             reduction="sum"))
            tokens += int((labels[0, 1:] != -100).sum())
    return total / tokens


def _world(rank: int, world: int, rounds: int, samples: int, out: str) -> dict:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", OMP_NUM_THREADS="1")
    data = chats(samples + samples // 10)
    train, held = data[:samples], data[samples:]
    runs: dict[str, list] = {arm: [] for arm in ARMS}
    for k in range(rounds):
        order = ARMS if k % 2 == 0 else ARMS[::-1]
        for arm in order:
            runs[arm].append(_arm(rank, arm, train, f"{out}/{arm}-{k}"))
    held_loss = {arm: _held_out_loss(runs[arm][0]["params"], held) for arm in ARMS} if rank == 0 else None
    for arm in ARMS:
        for r in runs[arm]:
            r.pop("params")
    return dict(runs=runs, held_loss=held_loss)


def _summary(per_rank: list[dict]) -> dict:
    out = {}
    for arm in ARMS:
        rounds = len(per_rank[0]["runs"][arm])
        speeds, pads = [], []
        for k in range(rounds):
            steps = [r["runs"][arm][k]["steps"] for r in per_rank]
            computed = sum(s[0] for rs in steps for s in rs)
            real = sum(s[1] for rs in steps for s in rs)
            seconds = max(r["runs"][arm][k]["seconds"] for r in per_rank)
            speeds.append(real / seconds)
            pads.append(1 - real / computed)
        steps0 = [r["runs"][arm][0]["steps"] for r in per_rank]
        n = min(len(s) for s in steps0)
        if arm == "trl_padded":  # each rank's own batch: vision rows, tokens computed (pads included)
            loads = {name: [[steps0[r][i][col] for r in range(len(per_rank))] for i in range(n)]
                     for name, col in (("vision", 2), ("llm", 0))}
        else:  # after the plan (the same on every rank): where the rows are encoded, the tokens computed
            planned = per_rank[0]["runs"][arm][0]["planned"]
            loads = {"vision": [p[0] for p in planned], "llm": [p[1] for p in planned]}
        imb = {}
        for name, per_step in loads.items():
            ratios = [max(x) / np.mean(x) for x in per_step if np.mean(x) > 0]
            imb[name] = dict(mean=round(float(np.mean(ratios)), 3), max=round(float(np.max(ratios)), 3))
        out[arm] = dict(optimizer_steps=per_rank[0]["runs"][arm][0]["optimizer_steps"], micro_steps=n,
                        padded_share=round(float(np.median(pads)), 3),
                        real_tokens_per_s=dict(median=round(float(np.median(speeds)), 1),
                                               min=round(float(min(speeds)), 1), max=round(float(max(speeds)), 1)),
                        imbalance=imb, held_out_loss=round(per_rank[0]["held_loss"][arm], 4))
    out["packed_over_trl_median"] = round(out["evenflow_packed"]["real_tokens_per_s"]["median"]
                                          / out["trl_padded"]["real_tokens_per_s"]["median"], 3)
    return out


def run(rounds: int = 6, samples: int = 60, quick: bool = False) -> dict:
    import tempfile

    if quick:
        rounds, samples = 2, 24
    load = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="evenflow-trl-vlm-") as out:
        per_rank = run_world(_world, WORLD, rounds, samples, out, timeout=3000, pg_timeout_s=300)
    res = _summary(per_rank)
    res.update(rounds=rounds, samples=samples, world=WORLD, seconds=round(time.perf_counter() - t0, 1),
               load_before=[round(x, 2) for x in load], load_after=[round(x, 2) for x in os.getloadavg()])
    return res


def markdown(res: dict) -> str:
    lines = [f"{res['samples']} chats (a third text-only, the rest 1-2 real photos), 2 gloo ranks, one epoch per "
             f"arm, {res['rounds']} rounds in ABBA order; load average {res['load_before']} before, "
             f"{res['load_after']} after (a shared machine). Videos are out of this comparison: TRL's own "
             "VLM path has none.", "",
             "| arm | optimizer steps | padded share | real tokens/s median (min-max) | vision imbalance mean / max "
             "| LLM imbalance mean / max | held-out loss |", "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        a = res[arm]
        s, i = a["real_tokens_per_s"], a["imbalance"]
        lines.append(f"| {arm} | {a['optimizer_steps']} | {a['padded_share']:.3f} | {s['median']:.1f} "
                     f"({s['min']:.1f}-{s['max']:.1f}) | {i['vision']['mean']:.3f} / {i['vision']['max']:.3f} | "
                     f"{i['llm']['mean']:.3f} / {i['llm']['max']:.3f} | {a['held_out_loss']:.4f} |")
    lines += ["", f"evenflow packed / TRL padded, median real tokens/s: **{res['packed_over_trl_median']:.3f}x**."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    res = run(rounds=args.rounds, samples=args.samples, quick=args.quick)
    print(markdown(res), file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
