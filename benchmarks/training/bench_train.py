"""Real CPU training, 2 gloo ranks: the same tiny model, data and seed for every batching method.

Data: chitchat chats (answered ones) through the Qwen3 chat template and tokenizer, assistant-only labels,
cutoff 512, vocabulary densely remapped to 4,096 ids (:mod:`evenflow.data`; lengths stay real). Model: the
tiny random-init Qwen3 of the CPU calibration (:data:`evenflow.sim.calibrate.TINY_QWEN3`), AdamW, one thread
per rank. Token budget 2,048 per rank.

Methods: Standard / Sorted / offline oracle (their schedules, fed through a plain ``DataLoader``),
``online-dynamic-batching`` 0.1.2's real ``ODBDataLoader`` (join mode, buffer 256 = its README's 64 x 4
workers), and evenflow's real :class:`evenflow.DynamicBatchLoader` with ``planning="local"`` and
``planning="global"`` (the default at 2 ranks). Packing and varlen evenflow are not run:
they need varlen attention kernels that CPU SDPA lacks (they are simulated).

Every method runs the same loop: one ``all_reduce`` of ``[has batch, supervised tokens, more to come]`` per
step (a Join-style guard -- ODB's ranks can yield different batch counts, brief §5), the exact per-token loss
``sum CE * W / global tokens``, a manual gradient all_reduce (so each rank's forward+backward time is measured
without waiting on others), AdamW. Reported: wall time from the first batch, samples/s, real tokens/s,
padded efficiency, steps, per-step imbalance of measured compute time, final train loss, held-out eval loss,
and the simulator's prediction for the very batches trained (CPU-calibrated model) against the measurement.

Run: ``python benchmarks/training/bench_train.py [--quick]``; prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.*, <group>.*
from common import baselines as bl  # noqa: E402
from common.world import run_world  # noqa: E402

WORLD = 2
BUDGET = 2048
CUTOFF = 512
VOCAB = 4096
LR = 1e-3
SEED = 0
ODB_BUFFER = 256
EVENFLOW_METHODS = {"evenflow_local": "local", "evenflow_global": "global"}
"""evenflow's rows and the planning policy each passes (at 2 ranks the default, "auto", is "global")."""


def prepare(n_train: int, n_eval: int, path: Path) -> np.ndarray:
    """Tokenize ``n_train + n_eval`` chitchat chats, remap the vocabulary, save tensors; return train lengths."""
    import torch

    from evenflow.data import ChatDataset, VocabRemap, chitchat_conversations

    convs = chitchat_conversations()
    pick = np.random.default_rng(SEED).permutation(len(convs))[:n_train + n_eval]
    ds = ChatDataset([convs[i] for i in pick], cutoff=CUTOFF, name="chitchat")
    items = [ds[i] for i in range(len(ds))]
    remap = VocabRemap.from_dataset(items, full_vocab_size=ds.tokenizer.vocab_size, max_size=VOCAB)
    samples = []
    for it in items:
        ids = remap(it["input_ids"]).long()
        labels = torch.where(it["labels"] == -100, it["labels"], remap(it["labels"].clamp(min=0)).long())
        samples.append({"input_ids": ids, "labels": labels})
    torch.save({"train": samples[:n_train], "eval": samples[n_train:], "vocab": remap.size}, path)
    return np.array([len(s["input_ids"]) for s in samples[:n_train]], dtype=np.int64)


# -- inside each rank ----------------------------------------------------------------------------------------

class _Samples:
    """Map-style dataset over the saved samples; adds the dataset index for the collates that track ids."""

    def __init__(self, samples: list[dict]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        s = self.samples[i]
        return {"input_ids": s["input_ids"], "labels": s["labels"], "idx": int(i)}


def pad_collate(samples: list[dict]) -> dict:
    import torch

    n, longest = len(samples), max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(n, longest, dtype=torch.long)
    labels = torch.full((n, longest), -100, dtype=torch.long)
    mask = torch.zeros(n, longest, dtype=torch.long)
    for k, s in enumerate(samples):
        m = len(s["input_ids"])
        ids[k, :m], labels[k, :m], mask[k, :m] = s["input_ids"], s["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "ids": [s["idx"] for s in samples]}


def _schedule_stream(batches: list[list[int]], dataset: _Samples):
    for members in batches:
        yield pad_collate([dataset[i] for i in members]) if members else None


def _odb_stream(dataset: _Samples, shard_ids: list[int]):
    import odb

    loader = odb.ODBDataLoader(dataset, token_budget=BUDGET, batch_size=1, sampler=shard_ids, num_workers=2,
                               prefetch_factor=2, buffer_size=ODB_BUFFER, collate_fn=pad_collate, join=True)
    for batch in loader:
        for key in [k for k in batch if k not in ("input_ids", "labels", "attention_mask", "ids")]:
            batch.pop(key)  # ODB's metadata keys
        yield batch


def _evenflow_stream(dataset: _Samples, planning: str):
    from evenflow import DynamicBatchLoader, pop_step_info

    def collate(samples):
        return pad_collate(samples)

    loader = DynamicBatchLoader(dataset, token_budget=BUDGET, collate_fn=collate, num_workers=0, seed=SEED,
                                planning=planning)
    try:
        for batch in loader:
            info = pop_step_info(batch)
            yield None if info.is_idle else batch
    finally:
        loader.close()


def _train(rank: int, world: int, stream, data: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from evenflow.sim.calibrate import TINY_QWEN3

    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(Qwen3Config(**{**TINY_QWEN3, "vocab_size": data["vocab"]}))
    model.train()
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    idle = pad_collate([{**data["eval"][0], "idx": -1}])

    def loss_sum(batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        lab = batch["labels"][:, 1:]
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), lab.reshape(-1),
                               ignore_index=-100, reduction="sum"), int((lab != -100).sum())

    steps, t_first = [], None
    it = iter(stream)
    t_wait0 = time.perf_counter()
    while True:
        batch = next(it, StopIteration)
        more = batch is not StopIteration
        batch = None if batch is StopIteration else batch
        if t_first is None:
            t_first = time.perf_counter()
            startup = t_first - t_wait0
        local_tok = int((batch["labels"][:, 1:] != -100).sum()) if batch is not None else 0
        flags = torch.tensor([int(batch is not None), local_tok, int(more)], dtype=torch.long)
        dist.all_reduce(flags)
        if int(flags[2]) == 0:
            break
        global_tok = int(flags[1])
        t0 = time.perf_counter()
        loss, _ = loss_sum(batch if batch is not None else idle)
        scale = (world / global_tok) if (batch is not None and global_tok) else 0.0
        (loss * scale).backward()
        compute = time.perf_counter() - t0
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        opt.step()
        opt.zero_grad(set_to_none=False)
        stats = torch.tensor([float(loss.detach()) if batch is not None else 0.0], dtype=torch.float64)
        dist.all_reduce(stats)
        steps.append({"ids": batch["ids"] if batch is not None else [], "compute": compute,
                      "loss": float(stats[0]) / global_tok if global_tok else float("nan"),
                      "padded": int(batch["input_ids"].numel()) if batch is not None else 0,
                      "real": int(batch["attention_mask"].sum()) if batch is not None else 0})
    wall = time.perf_counter() - t_first
    eval_loss = None
    if rank == 0:
        model.eval()
        with torch.no_grad():
            tot, tok = 0.0, 0
            for k in range(0, len(data["eval"]), 8):
                b = pad_collate([{**s, "idx": -1} for s in data["eval"][k:k + 8]])
                ls, nt = loss_sum(b)
                tot, tok = tot + float(ls), tok + nt
            eval_loss = tot / tok
    dist.barrier()
    return {"steps": steps, "wall": wall, "startup": startup, "eval_loss": eval_loss}


def _rank_main(rank: int, world: int, data_path: str, schedules: dict, methods: list[str]) -> dict:
    import torch

    data = torch.load(data_path)
    dataset = _Samples(data["train"])
    from evenflow.sim import shard

    my_shard = shard(len(dataset), world, seed=SEED)[rank].tolist()
    out = {}
    for m in methods:
        if m in schedules:
            stream = _schedule_stream(schedules[m][rank], dataset)
        elif m == "odb_buf256":
            stream = _odb_stream(dataset, my_shard)
        elif m in EVENFLOW_METHODS:
            stream = _evenflow_stream(dataset, EVENFLOW_METHODS[m])
        else:
            raise ValueError(m)
        try:
            out[m] = _train(rank, world, stream, data)
        except Exception as exc:  # noqa: BLE001 - a method's failure is a result, not a benchmark crash
            import traceback

            out[m] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
            raise
    return out


# -- parent ---------------------------------------------------------------------------------------------------

def _summarize(name: str, per_rank: list[dict], lengths: np.ndarray, cpu_model) -> dict:
    from evenflow.sim import Schedule, simulate

    n_steps = len(per_rank[0]["steps"])
    comp = np.array([[r["steps"][s]["compute"] for r in per_rank] for s in range(n_steps)])
    busy = np.array([[bool(r["steps"][s]["ids"]) for r in per_rank] for s in range(n_steps)])
    real = sum(st["real"] for r in per_rank for st in r["steps"])
    padded = sum(st["padded"] for r in per_rank for st in r["steps"])
    samples = sum(len(st["ids"]) for r in per_rank for st in r["steps"])
    wall = max(r["wall"] for r in per_rank)
    imb = np.where(busy.any(axis=1), comp.max(axis=1) / np.maximum(comp.mean(axis=1), 1e-12), 1.0)
    losses = [st["loss"] for st in per_rank[0]["steps"] if np.isfinite(st["loss"])]
    sched = Schedule.from_steps([[r["steps"][s]["ids"] for r in per_rank] for s in range(n_steps)], WORLD, name=name)
    missing, dup = sched.coverage(len(lengths))
    predicted = simulate(sched, lengths, cpu_model)
    measured_compute = float(comp.max(axis=1).sum())
    return {"steps": n_steps, "samples": samples, "missing": int(len(missing)), "duplicated": int(len(dup)),
            "wall_s": wall, "startup_s": max(r["startup"] for r in per_rank), "samples_per_s": samples / wall,
            "tokens_per_s": real / wall, "padded_efficiency": real / padded if padded else 1.0,
            "mean_imbalance": float(imb.mean()), "final_train_loss": float(np.mean(losses[-5:])) if losses else None,
            "eval_loss": per_rank[0]["eval_loss"], "measured_compute_s": measured_compute,
            "predicted_compute_s": predicted.total_time - predicted.steps * cpu_model.step_overhead,
            "predicted_total_s": predicted.total_time}


def run(*, quick: bool = False, cpu_model=None) -> dict:
    """Train every method on 2 gloo ranks; ``cpu_model`` (a CPU-calibrated CostModel) enables predictions."""
    from evenflow.sim.calibrate import cpu_cost_model

    n_train, n_eval = (160, 16) if quick else (320, 32)
    cpu_model = cpu_model or cpu_cost_model(repeats=2)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="evenflow-train-") as tmp:
        path = Path(tmp) / "data.pt"
        lengths = prepare(n_train, n_eval, path)
        kw = dict(world_size=WORLD, token_budget=BUDGET, seed=SEED)
        scheds = {"standard": bl.standard(lengths, **kw), "sorted": bl.sorted_batches(lengths, **kw),
                  "oracle": bl.oracle(lengths, **kw)}
        per_rank = {k: [[step[r] for step in s.batches()] for r in range(WORLD)] for k, s in scheds.items()}
        methods = ["standard", "sorted", "oracle"] + (["odb_buf256"] if bl.odb_available()[0] else []) + \
            list(EVENFLOW_METHODS)
        prep = time.perf_counter() - t0
        results = run_world(_rank_main, WORLD, str(path), per_rank, methods, timeout=1500, pg_timeout_s=300)
    out = {"config": {"world": WORLD, "budget": BUDGET, "cutoff": CUTOFF, "n_train": n_train, "n_eval": n_eval,
                      "vocab": VOCAB, "lr": LR, "standard_batch": scheds["standard"].info["batch_size"]},
           "prep_s": prep, "methods": {}}
    for m in methods:
        out["methods"][m] = _summarize(m, [results[r][m] for r in range(WORLD)], lengths, cpu_model)
    ref = out["methods"]["standard"]["tokens_per_s"]
    for m, r in out["methods"].items():
        r["speedup"] = r["tokens_per_s"] / ref
    out["total_s"] = time.perf_counter() - t0
    return out


def markdown(res: dict) -> str:
    from common.report import table

    c = res["config"]
    rows = []
    ref = res["methods"]["standard"]["predicted_total_s"]
    for m, r in res["methods"].items():
        rows.append([m, r["steps"], f"{r['samples']} ({r['missing']} missing)", r["wall_s"], r["samples_per_s"],
                     r["tokens_per_s"], r["speedup"], ref / r["predicted_total_s"], r["padded_efficiency"],
                     r["mean_imbalance"], r["final_train_loss"], r["eval_loss"],
                     r["predicted_compute_s"] / r["measured_compute_s"]])
    return "\n".join([
        f"{c['world']} gloo ranks on this CPU, tiny Qwen3 (vocab {c['vocab']}), {c['n_train']} chitchat chats "
        f"(cutoff {c['cutoff']}), budget {c['budget']} tokens per rank (Standard batch {c['standard_batch']}), "
        f"AdamW lr {c['lr']}, seed fixed, one epoch. Eval loss: {c['n_eval']} held-out chats. 'sim/measured' = "
        "the simulator's compute time (CPU-calibrated model) for the very batches trained, over the measured sum "
        "of per-step maxima of forward+backward time.", "",
        table(["method", "steps", "samples", "wall (s)", "samples/s", "tokens/s", "speedup", "sim speedup",
               "padded eff", "mean imb", "train loss (last 5)", "eval loss", "sim/measured"], rows), "",
        "'sim speedup' = the simulator's speedup for the same batches. Fewer, larger optimizer steps at an unchanged "
        "learning rate leave a slightly higher loss after one epoch; the learning rate was not retuned per method."])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    res = run(quick=args.quick)
    print(markdown(res))
    print(json.dumps({"train_speedup_vs_standard": {m: round(r["speedup"], 3) for m, r in res["methods"].items()},
                      "eval_loss": {m: round(r["eval_loss"], 4) for m, r in res["methods"].items()}}))


if __name__ == "__main__":
    main()
