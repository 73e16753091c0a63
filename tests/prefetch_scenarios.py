"""Scenarios for the loader's per-step prefetch (NOTE [ Per-step prefetch ]) and the balanced VLM step's plan made
in the background (NOTE [ The plan made in the background ]), run inside one real gloo world (tests/_dist.py).

Every rank reads its own stream: rank 0 photos, rank 1 text only (a rank with no image), rank 2 two samples (it
runs dry and trains IDLE steps), so the loader plans locally and each step's plan moves images between ranks.
Kept module-level so spawn-started ranks can import them.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
import traceback

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

import vlm_scenarios as sc

LR = 0.1


class RankStream(IterableDataset):
    """Rank 0: nine samples with a photo; rank 1: nine text-only samples; rank 2: two samples, one with a photo."""

    def __iter__(self):
        rank = dist.get_rank()
        gen = torch.Generator().manual_seed(100 + rank)
        grids = [(1, 4, 4), (1, 8, 8), (1, 4, 8), (1, 8, 4), (1, 4, 4), (1, 8, 8), (1, 4, 8), (1, 8, 4), (1, 4, 4)]
        if rank == 0:
            specs = [(6 + 3 * i, [("image", g)]) for i, g in enumerate(grids)]
        elif rank == 1:
            specs = [(10 + 4 * i, []) for i in range(9)]
        else:
            specs = [(12, [("image", (1, 4, 8))]), (20, [])]
        for text, media in specs:
            s = sc.sample(gen, text, media)
            s.pop("num_patches"), s.pop("num_frames")
            yield s


def loader(layout: str = "packed", *, accum: int = 1, **kwargs):
    import evenflow

    cost = "summed" if layout == "packed" else "padded"
    idle = sc.sample(torch.Generator().manual_seed(9), 4, [])  # a resumed rank 2 may have no sample left
    idle.pop("num_patches"), idle.pop("num_frames")
    return evenflow.DynamicBatchLoader(RankStream(), token_budget=64, cost=cost, planning="local",
                                       grad_accum_steps=accum, buffer_size=8, max_steps_per_round=2,
                                       idle_sample=idle, **kwargs)


def report(fn, *args, **kwargs) -> dict:
    """``fn``'s result, or what it raised (type, message, PeerError's rank)."""
    try:
        return dict(fn(*args, **kwargs), error=None)
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        return dict(error=type(exc).__name__, message=str(exc), peer=getattr(exc, "rank", None),
                    trace=traceback.format_exc())


# -- the loader's hook, on its own ---------------------------------------------------------------------------
def hook_order(rank: int, world: int) -> dict:
    """Every batch's callable ran on the collation thread, before the batch was handed over, over the loader's
    group, with the same step on every rank; and it ran ahead of the trainer."""
    import evenflow

    seen: dict = {}

    def prefetch(batch, info, group):
        row = torch.tensor([info.step, int(batch["input_ids"].numel()), int(info.is_idle)])
        out = [torch.zeros_like(row) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, row, group=group)
        seen[info.step] = (info, torch.stack(out), threading.current_thread().name, time.monotonic())

    res = dict(steps=0, same_step=True, own_row=True, same_info=True, threads=set(), ahead=0)
    with loader() as ld:
        ld.set_step_prefetch(prefetch)
        for batch in ld:
            info = evenflow.pop_step_info(batch)
            got, table, thread, _ = seen[info.step]
            res["same_info"] &= got is info
            res["same_step"] &= bool((table[:, 0] == info.step).all())
            res["own_row"] &= int(table[rank, 1]) == int(batch["input_ids"].numel())
            res["threads"].add(thread)
            time.sleep(0.05)  # the trainer is slow: the next batches' callables run meanwhile
            res["ahead"] += (info.step + 1) in seen
            res["steps"] += 1
    res["threads"] = sorted(res["threads"])
    return res


def hook_fault(rank: int, world: int) -> dict:
    """A callable that fails on rank 1 at step 2 and shares it in its exchange: every rank trained steps 0 and 1,
    then ``next(loader)`` raised (rank 1 its own error, the others PeerError naming rank 1)."""
    import evenflow
    from evenflow import PeerError

    def prefetch(batch, info, group):
        bad = rank == 1 and info.step == 2
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(flags, torch.tensor([int(bad)]), group=group)
        if bad:
            raise ValueError("injected prefetch failure on rank 1 at step 2")
        if any(int(f) for f in flags):
            raise PeerError(1, "ValueError", "injected prefetch failure on rank 1 at step 2", None, this_rank=rank)

    steps: list = []

    def run():
        with loader() as ld:
            ld.set_step_prefetch(prefetch)
            for batch in ld:
                steps.append(evenflow.pop_step_info(batch).step)
        return {}
    out = report(run)
    return dict(out, steps=steps)


def hook_stop(rank: int, world: int) -> dict:
    """Every rank stops after step 1 while step 2's (slow) callable is in its exchange; the loader then runs
    another epoch to its end with the callable."""
    import evenflow

    calls = []

    def prefetch(batch, info, group):
        time.sleep(0.2)
        t = torch.tensor([info.step])
        dist.all_reduce(t, group=group)
        calls.append((info.epoch, info.step))

    ld = loader()
    ld.set_step_prefetch(prefetch)
    started = time.monotonic()
    first = []
    for batch in ld:
        first.append(evenflow.pop_step_info(batch).step)
        if len(first) == 2:
            break
    stopped_s = time.monotonic() - started
    ld.set_epoch(1)
    second = [evenflow.pop_step_info(b).step for b in ld]
    ld.close()
    return dict(first=first, second=second, stopped_s=stopped_s, calls=len(calls))


# -- the balanced VLM step ------------------------------------------------------------------------------------
def _train(rank: int, *, layout: str, accum: int, prefetch: bool, trainer_adapter=None, stop_after: int | None = None,
           state: dict | None = None, save_after: int | None = None, unpopped: int | None = None) -> dict:
    """The user's loop (DDP, SGD, the loader, the balanced step): per step, the loss and every gradient."""
    import evenflow
    from evenflow.step_info import STEP_INFO_KEY
    from evenflow.vlm import BalancedVLM, VLMConfig

    model = sc.tiny_model("qwen2_vl", torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ld = loader(layout, accum=accum)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        ld.load_state_dict(state["loader"])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    vlm = BalancedVLM(ddp, group=dist.new_group(backend="gloo"), adapter=trainer_adapter,
                      config=VLMConfig(layout=layout, prefetch=prefetch))
    if prefetch:
        vlm.prefetch_from(ld)
    out: dict = dict(steps=[], idle=0, images=0, losses=[], grads=[], fingerprints=[], saved=None)
    with ld:
        for batch in ld:
            info = evenflow.pop_step_info(batch)
            if rank == unpopped and len(out["steps"]) == 1:  # a user's mistake on one rank: the info left in
                batch[STEP_INFO_KEY] = info
            with contextlib.nullcontext() if info.window_end else ddp.no_sync():
                step = vlm(batch, info)
                step.loss.backward()
            out["steps"].append(info.step)
            out["idle"] += info.is_idle
            out["images"] += 0 if info.is_idle else int(batch.get("image_grid_thw", torch.zeros(0, 3)).shape[0])
            out["losses"].append((step.loss_sum, step.window_loss))
            out["fingerprints"].append(step.plan.fingerprint())
            out["grads"].append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
            if info.window_end:
                optimizer.step()
                optimizer.zero_grad()
                if save_after is not None and len(out["steps"]) == save_after:
                    out["saved"] = dict(model=copy.deepcopy(model.state_dict()),
                                        optimizer=copy.deepcopy(optimizer.state_dict()), loader=ld.state_dict())
            if stop_after is not None and len(out["steps"]) == stop_after:
                break
    return out


def _same(a: dict, b: dict) -> dict:
    return dict(steps=a["steps"] == b["steps"], losses=a["losses"] == b["losses"],
                plans=a["fingerprints"] == b["fingerprints"],
                grads=len(a["grads"]) == len(b["grads"])
                and all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"])),
                n=len(a["steps"]), idle=a["idle"], images=a["images"])


def vlm_exact(rank: int, world: int, layout: str, accum: int) -> dict:
    """Inline and prefetched: the same plans, losses and every gradient, bit for bit."""
    inline = _train(rank, layout=layout, accum=accum, prefetch=False)
    return _same(inline, _train(rank, layout=layout, accum=accum, prefetch=True))


def _failing_adapter():
    from evenflow.vlm import QwenVLAdapter

    class FailsOnRank1Step1(QwenVLAdapter):
        calls = 0

        def find_items(self, batch, **kwargs):
            type(self).calls += 1
            if dist.get_rank() == 1 and type(self).calls == 2:
                raise ValueError("injected: the adapter refuses rank 1's second batch")
            return super().find_items(batch, **kwargs)
    return FailsOnRank1Step1


def vlm_fault(rank: int, world: int) -> dict:
    """The adapter fails in the background exchange on rank 1's second batch: every rank trained one step, then
    its loader raised -- rank 1 the adapter's error, ranks 0 and 2 PeerError naming rank 1."""
    return report(lambda: dict(n=len(_train(rank, layout="packed", accum=1, prefetch=True,
                                             trainer_adapter=_failing_adapter())["steps"])))


def vlm_misuse(rank: int, world: int) -> dict:
    """Rank 1 calls the step with its StepInfo still in the batch: refused there, and named on every other rank
    (through the step's one gather), not a wait for the timeout."""
    return report(lambda: dict(n=len(_train(rank, layout="packed", accum=1, prefetch=True, unpopped=1)["steps"])))


def vlm_stop_and_resume(rank: int, world: int) -> dict:
    """A stop after step 1 with step 2's exchange in flight exits on every rank; a checkpoint taken after step 1
    resumes to the uninterrupted run's losses and gradients."""
    whole = _train(rank, layout="packed", accum=1, prefetch=True, save_after=2)
    started = time.monotonic()
    stopped = _train(rank, layout="packed", accum=1, prefetch=True, stop_after=2)
    stop_s = time.monotonic() - started
    resumed = _train(rank, layout="packed", accum=1, prefetch=True, state=whole["saved"])
    # A resumed loader numbers its steps from 0 again, and DDP's first iteration reduces in other buckets than
    # later ones (rounding: ~1e-8), so the gradients are compared to a tolerance; losses and plans bit for bit.
    tail, got = whole["grads"][2:], resumed["grads"]
    close = len(tail) == len(got) and all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(tail, got))
    return dict(stopped=stopped["steps"], stop_s=stop_s, n=len(got), losses=whole["losses"][2:] == resumed["losses"],
                plans=whole["fingerprints"][2:] == resumed["fingerprints"], grads=close)


def vlm_trainer(rank: int, world: int, out_dir: str) -> dict:
    """``DynamicBatchTrainer`` with the balanced step in ``compute_loss``, inline and prefetched: the same losses
    and final parameters, bit for bit."""
    import integration_scenarios as isc
    from transformers import TrainingArguments

    from evenflow.integrations.hf import DynamicBatchTrainer
    from evenflow.step_info import STEP_INFO_KEY
    from evenflow.vlm import BalancedVLM, VLMConfig

    isc.torchrun_env(rank, world)

    class BalancedTrainer(DynamicBatchTrainer):
        def __init__(self, *args, vlm_config, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.vlm = BalancedVLM(self.model, group=dist.new_group(backend="gloo"), config=vlm_config)
            self.losses = []

        def get_train_dataloader(self):
            batches = super().get_train_dataloader()
            if self.vlm.config.prefetch:
                self.vlm.prefetch_from(batches.loader)
            return batches

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            info = inputs[STEP_INFO_KEY]
            step = self.vlm({k: v for k, v in inputs.items() if k != STEP_INFO_KEY}, info, model=model)
            self.losses.append(step.loss_sum)
            return (step.loss, None) if return_outputs else step.loss

    out = {}
    for prefetch in (False, True):
        model = sc.tiny_model("qwen2_vl", torch.float32)
        args = TrainingArguments(output_dir=f"{out_dir}/{prefetch}", max_steps=3, learning_rate=LR, optim="sgd",
                                 lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
                                 save_strategy="no", report_to=[], remove_unused_columns=False, use_cpu=True,
                                 dataloader_num_workers=0, disable_tqdm=True, seed=0, logging_steps=100)
        trainer = BalancedTrainer(model=model, args=args, train_dataset=RankStream(), token_budget=64, cost="summed",
                                  planning="local", buffer_size=8, max_steps_per_round=2,
                                  vlm_config=VLMConfig(prefetch=prefetch, gradient_sync="external"))
        trainer.train()
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        out[prefetch] = dict(losses=trainer.losses, params=params)
    return dict(losses=out[False]["losses"] == out[True]["losses"], n=len(out[True]["losses"]),
                params=torch.equal(out[False]["params"], out[True]["params"]))


def world(rank: int, world: int, out_dir: str) -> dict:
    torch.set_num_threads(1)
    out: dict = {}

    def run(name, fn, *args):
        started = time.monotonic()
        try:
            out[name] = fn(rank, world, *args)
        except Exception:  # noqa: BLE001 - reported per scenario
            out[name] = {"crash": traceback.format_exc()}
        out[name]["seconds"] = round(time.monotonic() - started, 2)

    run("hook_order", hook_order)
    run("hook_fault", hook_fault)
    run("hook_stop", hook_stop)
    for layout, accum in (("packed", 1), ("padded", 1), ("packed", 2)):
        run(f"exact/{layout}/{accum}", vlm_exact, layout, accum)
    run("vlm_fault", vlm_fault)
    run("vlm_misuse", vlm_misuse)
    run("stop_resume", vlm_stop_and_resume)
    run("trainer", vlm_trainer, out_dir)
    return out
