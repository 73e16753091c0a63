"""Real media -> DynamicBatchLoader (token, patch and frame budgets) -> orchestrated tiny MLLM (CPU/gloo).

    torchrun --standalone --nproc-per-node 2 examples/mllm_train.py --samples 64 --mode full

Samples come from :class:`evenflow.data.multimodal.MultimodalChatDataset`: chitchat exchanges through the
Qwen3 template, scikit-image photos through the Qwen2-VL processor, the user's words spoken by eSpeak NG
and turned into Whisper log-mel frames -- all in the DataLoader workers, so the loader sees realized lengths.
Each step every rank shares its examples' metadata, all ranks compute the same per-phase plan (``--mode``:
``none`` keeps everything local, ``llm`` balances the LLM phase only, ``full`` balances vision, audio and LLM),
the encoders run on their balanced ranks and their outputs go straight to the LLM rank of their example. The
loss is normalized by the step's global supervised tokens, so summing gradients across ranks gives the exact
single-process gradient whatever the plan; IDLE batches (a rank with no data left) still run every encoder
and every collective on zero rows.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import evenflow
from evenflow.exchange import GlobalOrchestrator
from evenflow.data import QwenChatTokenizer, chitchat_conversations
from evenflow.data.audio import AUDIO_PAD_ID
from evenflow.data.multimodal import MediaCollate, MediaMix, MultimodalChatDataset
from evenflow.testing import (TinyMLLM, TokenFold, example_from_sample, orchestrated_step, orchestrator_config,
                             real_media_config)

MODES = {"none": dict(balance=False), "llm": dict(balance_encoders=False), "full": {}}


def build_dataset(samples: int, *, seed: int = 0, mix: MediaMix = MediaMix(), max_pixels: int = 128 * 28 * 28,
                  max_frames: int = 800, cutoff: int = 1024) -> MultimodalChatDataset:
    return MultimodalChatDataset(chitchat_conversations()[:samples], num_samples=samples, mix=mix,
                                 max_pixels=max_pixels, max_frames=max_frames, cutoff=cutoff, seed=seed)


def train(dataset, *, mode: str = "full", token_budget: int = 1024, patch_budget: int = 1024,
          frame_budget: int = 1600, num_workers: int = 1, lr: float = 1e-3, epochs: int = 1,
          max_len: int = 1024) -> list[dict]:
    """One run on the current process group; returns one record per step (the same on every rank)."""
    cfg = real_media_config(max_len=max_len)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyMLLM(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    fold = TokenFold(image_pad_id=QwenChatTokenizer().token_id("<|image_pad|>"), audio_pad_id=AUDIO_PAD_ID,
                     config=cfg)
    loader = evenflow.DynamicBatchLoader(
        dataset, collate_fn=MediaCollate(), cost="summed", token_budget=token_budget, num_workers=num_workers,
        extra_budgets={"num_patches": patch_budget, "num_frames": frame_budget}, buffer_size=64)
    orch = GlobalOrchestrator(orchestrator_config(cfg, **MODES[mode]), group=dist.new_group(backend="gloo"))
    records = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            local = [] if info.is_idle else [example_from_sample(s, fold) for s in batch["samples"]]
            optimizer.zero_grad()
            res = orchestrated_step(model, orch, local)
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)  # SUM: each rank's loss is already its share of the global per-token mean
            _unflatten(flat, grads)
            optimizer.step()
            loss = torch.tensor([res.loss], dtype=torch.float64)
            dist.all_reduce(loss)
            records.append({"step": info.step, "loss": float(loss), "samples": info.global_samples,
                            "wall_s": res.wall_s, "vision_s": res.times.vision, "audio_s": res.times.audio,
                            "llm_s": res.times.llm, "plan_s": res.times.plan, "routing_s": res.times.routing})
    loader.close()
    return records


def _unflatten(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--mode", choices=sorted(MODES), default="full")
    ap.add_argument("--token-budget", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if "RANK" not in os.environ:  # plain `python examples/mllm_train.py`: a world of one
        dist.init_process_group("gloo", init_method=f"file:///tmp/evenflow-mllm-{os.getpid()}", rank=0,
                                world_size=1, timeout=timedelta(minutes=5))
    else:
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    try:
        t0 = time.perf_counter()
        dataset = build_dataset(args.samples)
        records = train(dataset, mode=args.mode, token_budget=args.token_budget, num_workers=args.workers,
                        max_len=dataset.cutoff)
        if dist.get_rank() == 0:
            for r in records[:: max(1, len(records) // 10)]:
                print(f"step {r['step']:3d}  loss {r['loss']:.4f}  samples {r['samples']:2d}  "
                      f"vision {1e3 * r['vision_s']:.1f} ms  audio {1e3 * r['audio_s']:.1f} ms  "
                      f"llm {1e3 * r['llm_s']:.1f} ms  plan+route {1e3 * (r['plan_s'] + r['routing_s']):.2f} ms")
            print(json.dumps({"mode": args.mode, "steps": len(records), "final_loss": records[-1]["loss"],
                              "wall_s": round(time.perf_counter() - t0, 2)}))
    finally:
        dist.destroy_process_group()  # the pair of init_process_group (evenflow needs no teardown call)


if __name__ == "__main__":
    main()
