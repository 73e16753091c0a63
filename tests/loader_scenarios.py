"""Scenarios run inside real gloo process worlds (see _dist.run_world). Each returns plain data.

Kept module-level so spawn-started ranks can import them.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset

import evenflow

BUDGET = 2048


def long_tail_lengths(n: int, seed: int = 0, cap: int = BUDGET) -> np.ndarray:
    """Lognormal lengths with CV ~ 1.3 (chat-like), clipped to the budget; real data when available."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4.6, 1.0, n).astype(np.int64) + 2, 2, cap)


class TokenDataset(Dataset):
    """Map-style samples: ids are ``index`` repeated (so a batch reveals its samples); half the labels masked."""

    def __init__(self, n: int, seed: int = 0, fail_at: int | None = None, bad_at: int | None = None,
                 vocab: int = 0) -> None:
        self.lengths = long_tail_lengths(n, seed)
        self.fail_at = fail_at
        self.bad_at = bad_at
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        if i == self.fail_at:
            raise RuntimeError(f"injected failure while loading sample {i}")
        if i == self.bad_at:
            return {"tokens": [1, 2, 3]}
        n = int(self.lengths[i])
        if self.vocab:
            ids = torch.from_numpy(np.random.default_rng(i).integers(1, self.vocab, n))
        else:
            ids = torch.full((n,), i, dtype=torch.long)
        labels = ids.clone()
        labels[: n // 3] = -100
        return {"input_ids": ids, "labels": labels, "index": i}


class RankStream(IterableDataset):
    """Rank r yields ``base + step * r`` samples (uneven per-rank counts), keyed by a global id."""

    def __init__(self, rank: int, base: int, step: int) -> None:
        self.rank, self.count = rank, base + step * rank
        self.lengths = long_tail_lengths(self.count, seed=100 + rank)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for j in range(wid, self.count, nw):
            n = int(self.lengths[j])
            gid = self.rank * 100_000 + j
            yield {"input_ids": torch.full((n,), gid, dtype=torch.long), "gid": gid}


def epoch_record(loader, epoch: int | None = None, stop_after: int | None = None) -> list[dict]:
    if epoch is not None:
        loader.set_epoch(epoch)
    steps = []
    for batch in loader:
        info = evenflow.pop_step_info(batch)
        ids = batch["input_ids"]
        steps.append(dict(step=info.step, idle=info.is_idle, ids=list(info.sample_ids),
                          local=info.local_loss_tokens, glob=info.global_loss_tokens, scale=info.loss_scale,
                          padded=info.padded_tokens, shape=tuple(ids.shape), numel=int(ids.numel()),
                          bound=len(loader), window_end=info.window_end, window=info.window_loss_tokens,
                          samples=info.local_samples, gsamples=info.global_samples,
                          gid=list(batch["gid"]) if "gid" in batch else None))
        if stop_after is not None and len(steps) >= stop_after:
            break
    return steps


# -- scenarios ---------------------------------------------------------------------------------------------
def sc_coverage(rank, world, n=601, workers=0, context=None, buffer_size=64, seed=3, **kw):
    ds = TokenDataset(n)
    loader = evenflow.DynamicBatchLoader(ds, token_budget=BUDGET, buffer_size=buffer_size, num_workers=workers,
                                         multiprocessing_context=context, seed=seed, **kw)
    first_len = len(loader)
    rec = epoch_record(loader)
    loader.close()
    return dict(first_len=first_len, steps=rec)


def sc_quota(rank, world, n=301, epochs=3):
    loader = evenflow.DynamicBatchLoader(TokenDataset(n), token_budget=BUDGET, buffer_size=32, join=False, seed=1)
    per_epoch = [epoch_record(loader, e) for e in range(epochs)]
    carry = loader.state_dict()["next_carry"]
    loader.close()
    return dict(epochs=per_epoch, carry=carry)


def sc_break(rank, world, n=401):
    loader = evenflow.DynamicBatchLoader(TokenDataset(n), token_budget=BUDGET, buffer_size=32, num_workers=1)
    broke = epoch_record(loader, 0, stop_after=3)          # every rank breaks at step 3
    asym = epoch_record(loader, 1, stop_after=2 if rank == 0 else None)  # only rank 0 breaks
    full = epoch_record(loader, 2)
    loader.close()
    return dict(broke=broke, asym=asym, full=full)


def sc_resume(rank, world, n=401, stop_at=5, grad_accum_steps=1, iterable=False, balance=False):
    def make():
        ds = RankStream(rank, 80, 23) if iterable else TokenDataset(n)
        return evenflow.DynamicBatchLoader(ds, token_budget=BUDGET, buffer_size=32, seed=7,
                                           grad_accum_steps=grad_accum_steps, balance=balance)
    loader = make()
    loader.set_epoch(1)
    before, state = [], None
    for batch in loader:
        info = evenflow.pop_step_info(batch)
        before.append(dict(ids=list(info.sample_ids), window_end=info.window_end))
        if len(before) >= stop_at and info.window_end:
            state = loader.state_dict()
            break
    loader.close()
    fresh = make()
    fresh.load_state_dict(state)
    fresh.set_epoch(1)
    after = epoch_record(fresh)
    fresh.close()
    return dict(before=before, after=after, state_epoch=state["epoch"])


def sc_iterable(rank, world, workers=0):
    loader = evenflow.DynamicBatchLoader(RankStream(rank, 60, 37), token_budget=BUDGET, buffer_size=16,
                                         num_workers=workers)
    rec = epoch_record(loader)
    loader.close()
    return dict(steps=rec, count=RankStream(rank, 60, 37).count)


def sc_minimal_collate(rank, world):
    # A collate that keeps only the keys it knows must not lose the step info (brief section 5, trap 5).
    def collate(samples):
        width = max(len(s["input_ids"]) for s in samples)
        out = torch.zeros(len(samples), width, dtype=torch.long)
        for i, s in enumerate(samples):
            out[i, : len(s["input_ids"])] = s["input_ids"]
        return {"input_ids": out}
    loader = evenflow.DynamicBatchLoader(TokenDataset(97), token_budget=BUDGET, collate_fn=collate, buffer_size=16)
    rec = epoch_record(loader)
    loader.close()
    return rec


def sc_one_worker_default_buffer(rank, world):
    loader = evenflow.DynamicBatchLoader(TokenDataset(500), token_budget=BUDGET, num_workers=1)
    rec = epoch_record(loader)
    loader.close()
    return rec


def sc_oversize(rank, world):
    ds = TokenDataset(50)
    ds.lengths[17] = BUDGET + 5
    loader = evenflow.DynamicBatchLoader(ds, token_budget=BUDGET, buffer_size=8, shuffle=False)
    try:
        epoch_record(loader)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    finally:
        loader.close()
    return "no error"


def sc_fault(rank, world, kind):
    """kind: 'worker' (rank 1's worker raises), 'bad' (rank 1 gets a bad sample), 'exit' (rank 1 dies)."""
    n = 200
    # shuffle=False: index i lives on rank i % world, so index 1 (and 1 + world) is rank 1's.
    ds = TokenDataset(n, fail_at=1 + 3 * world if kind == "worker" else None,
                      bad_at=1 + 3 * world if kind == "bad" else None)
    loader = evenflow.DynamicBatchLoader(ds, token_budget=BUDGET, buffer_size=4, num_workers=1 if kind == "worker" else 0,
                                         shuffle=False, timeout=__import__("datetime").timedelta(seconds=15))
    steps = 0
    try:
        for batch in loader:
            evenflow.pop_step_info(batch)
            steps += 1
            if kind == "exit" and rank == 1 and steps == 3:
                os._exit(3)
    except Exception as exc:  # noqa: BLE001
        return dict(error=f"{type(exc).__name__}: {exc}", steps=steps)
    return dict(error=None, steps=steps)


# -- exact loss --------------------------------------------------------------------------------------------
VOCAB = 37


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, 8, generator=g, dtype=torch.float64))
        self.out = torch.nn.Parameter(torch.randn(8, VOCAB, generator=g, dtype=torch.float64) * 0.3)

    def forward(self, input_ids, labels, attention_mask=None, **_):
        logits = torch.tanh(self.emb[input_ids]) @ self.out
        # Causal-LM convention: position i predicts label i+1; mean over supervised tokens.
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100, reduction="mean")


def sc_exact_loss(rank, world, grad_accum_steps=1, n=90, reduction="mean", balance=False):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = TinyLM()
    ddp = DDP(model) if world > 1 else model
    ds = TokenDataset(n, seed=5, vocab=VOCAB)
    ds.lengths = np.clip(ds.lengths, 2, 300)
    loader = evenflow.DynamicBatchLoader(ds, token_budget=600, buffer_size=16, seed=2,
                                         grad_accum_steps=grad_accum_steps, balance=balance)
    windows, ids, losses = [], [], []
    for batch in loader:
        info = evenflow.pop_step_info(batch)
        ids.extend(info.sample_ids)
        if reduction == "sum":
            logits = torch.tanh(model.emb[batch["input_ids"]]) @ model.out
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                     batch["labels"][:, 1:].reshape(-1), reduction="sum")
            scaled = evenflow.scale_loss(loss, info, reduction="sum")
        else:
            scaled = evenflow.scale_loss(ddp(**batch), info)
        assert torch.isfinite(scaled)
        scaled.backward()
        losses.append(float(scaled.detach()))
        if info.window_end:
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
            if world > 1 and reduction == "sum":
                dist.all_reduce(grads)
                grads /= world
            windows.append(dict(ids=ids, grad=grads.numpy(), loss_sum=losses))
            ids, losses = [], []
            for p in model.parameters():
                p.grad = None
    loader.close()
    return windows


def sc_balanced(rank, world, n=401, iterable=False, **kw):
    ds = RankStream(rank, 60, 37) if iterable else TokenDataset(n)
    loader = evenflow.DynamicBatchLoader(ds, token_budget=BUDGET, buffer_size=32, seed=4, balance=True, **kw)
    rec = epoch_record(loader)
    loader.close()
    return dict(steps=rec)


def sc_eval_mid_epoch(rank, world):
    """Mid-epoch evaluation: a second loader forks its workers while the first one's collation thread runs."""
    train = evenflow.DynamicBatchLoader(TokenDataset(301), token_budget=BUDGET, buffer_size=32, num_workers=1,
                                        multiprocessing_context="fork")
    evals, steps = [], []
    for batch in train:
        steps.append(evenflow.pop_step_info(batch).sample_ids)
        if len(steps) == 3:
            with evenflow.DynamicBatchLoader(TokenDataset(50, seed=9), token_budget=BUDGET, shuffle=False,
                                             num_workers=1, multiprocessing_context="fork") as ev:
                evals = [i for b in ev for i in evenflow.pop_step_info(b).sample_ids]
    train.close()
    return dict(train=steps, evals=evals)
