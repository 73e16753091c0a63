"""Scenarios run inside real gloo process worlds (see _dist.run_world). Each returns plain data.

Kept module-level so spawn-started ranks can import them.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

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
                          bound=_bound(loader), window_end=info.window_end, window=info.window_loss_tokens,
                          samples=info.local_samples, gsamples=info.global_samples,
                          gid=list(batch["gid"]) if "gid" in batch else None))
        if stop_after is not None and len(steps) >= stop_after:
            break
    return steps


def _bound(loader) -> int:
    try:
        return len(loader)
    except TypeError:  # iterable datasets: unknown until their end
        return -1


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
    asym, stopped = [], None
    try:
        asym = epoch_record(loader, 1, stop_after=2 if rank == 0 else None)  # only rank 0 breaks
    except evenflow.PeerStopped as exc:
        stopped = (exc.rank, exc.step, str(exc))
    full = epoch_record(loader, 2)
    loader.close()
    return dict(broke=broke, asym=asym, full=full, stopped=stopped)


def sc_resume(rank, world, n=401, stop_at=5, grad_accum_steps=1, iterable=False, **kw):
    def make():
        ds = RankStream(rank, 80, 23) if iterable else TokenDataset(n)
        return evenflow.DynamicBatchLoader(ds, token_budget=BUDGET, buffer_size=32, seed=7,
                                           grad_accum_steps=grad_accum_steps, **kw)
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


class SlowStart:
    """A worker_init_fn that sleeps: workers that start slowly (a loaded machine, a heavy import)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, worker_id: int) -> None:
        time.sleep(self.seconds)


def sc_fault(rank, world, kind, die_at=3, loader_kwargs=None, peer_start_s=0.0):
    """kind: 'worker' (rank 1's worker raises), 'bad' (rank 1 gets a bad sample), 'exit' (rank 1 dies after
    ``die_at`` batches). ``loader_kwargs`` override the loader's (planning, balance...). ``peer_start_s``: the
    other ranks' workers take this long to start (the fault must not depend on how fast workers start)."""
    n = 200
    # shuffle=False: index i lives on rank i % world, so index 1 (and 1 + world) is rank 1's.
    ds = TokenDataset(n, fail_at=1 + 3 * world if kind == "worker" else None,
                      bad_at=1 + 3 * world if kind == "bad" else None)
    # Worker faults wait for real workers: their bounds leave room for a slow start on a loaded machine (the
    # fault itself is raised by the worker, so nothing waits for the bounds when all goes well).
    bounds = (dict(timeout=timedelta(seconds=300), worker_timeout=timedelta(seconds=240)) if kind == "worker"
              else dict(timeout=timedelta(seconds=15), worker_timeout=timedelta(seconds=10)))
    workers, slow = 0, None
    if kind == "worker":
        workers, slow = 1, SlowStart(peer_start_s) if rank != 1 and peer_start_s else None
    if kind == "slow_start" and rank == 1:  # rank 1's only worker is still starting when worker_timeout passes
        bounds = dict(timeout=timedelta(seconds=60), worker_timeout=timedelta(seconds=1))
        workers, slow = 1, SlowStart(4.0)
    kwargs = dict(token_budget=BUDGET, buffer_size=4, num_workers=workers, shuffle=False, worker_init_fn=slow,
                  **bounds) | (loader_kwargs or {})
    loader = evenflow.DynamicBatchLoader(ds, **kwargs)
    steps = 0
    try:
        for batch in loader:
            evenflow.pop_step_info(batch)
            steps += 1
            if kind == "exit" and rank == 1 and steps == die_at:
                os._exit(3)
    except Exception as exc:  # noqa: BLE001
        return dict(error=f"{type(exc).__name__}: {exc}", steps=steps)
    finally:
        loader.close()
    return dict(error=None, steps=steps)


def sc_dead_peer_in_all_to_all(rank, world):
    """Rank 1 exits after the peer table is known; the others then enter a sample all-to-all (the balanced and
    global rounds' exchange 4), which must fail naming rank 1 rather than with gloo's bare socket error."""
    from evenflow.exchange.dispatch import exchange_samples
    from evenflow.runtime.comm import MetadataExchange, resolve_topology

    topology = resolve_topology(None, timedelta(seconds=15))
    exchange = MetadataExchange(topology)
    table = exchange.all_gather(np.array([os.getpid(), 7], dtype=np.int64))  # (pid, host): one host
    exchange.peers.note(table[:, 0], table[:, 1])
    dist.barrier(group=topology.group)
    if rank == 1:
        os._exit(3)
    time.sleep(1.0)  # rank 1 is gone before the all-to-all starts
    try:
        with exchange.guarded("sample all-to-all"):
            exchange_samples([{"x": torch.ones(3)}] * world, list(range(world)), group=topology.group)
    except RuntimeError as exc:
        return str(exc)
    return None


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


# -- hostile conditions (issue 10): each returns what this rank saw, with wall-clock times ------------------
FAULT_STEP = 3


class HostileDataset(TokenDataset):
    """TokenDataset with one injected fault on the sample ``at``: an unpicklable value, a __getitem__ that
    blocks, or an exception."""

    def __init__(self, n: int, fault: str | None = None, at: int | None = None, seed: int = 0) -> None:
        super().__init__(n, seed=seed)
        self.fault, self.at = fault, at

    def __getitem__(self, i: int) -> dict:
        sample = super().__getitem__(i)
        if i == self.at and self.fault == "unpicklable":
            sample["handle"] = threading.Lock()
        elif i == self.at and self.fault == "blocking":
            time.sleep(120)  # bounded: past worker_timeout, yet no orphan outlives the test for long
        return sample


class FailingIterable(IterableDataset):
    def __iter__(self):
        raise OSError("injected: the shard file is missing")


class _LastFails:
    """A collate_fn that fails on a chosen sample (picklable for spawn)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.inner = evenflow.PadCollate()

    def __call__(self, samples):
        if any(int(s["index"]) == self.at for s in samples):
            raise KeyError(f"injected collate failure on sample {self.at}")
        return self.inner(samples)


def _length_fails(at):
    def length(sample):
        if int(sample["index"]) == at:
            raise KeyError("num_tokens")
        return len(sample["input_ids"])
    return length


def _outcome(steps, exc, t_fault=None):
    out = dict(steps=steps, t_error=time.time(), t_fault=t_fault, error=None, type=None, attrs=None)
    if exc is not None:
        out.update(error=f"{type(exc).__name__}: {exc}", type=type(exc).__name__,
                   attrs={k: getattr(exc, k) for k in ("rank", "step", "type_name", "detail", "sample_index")
                          if hasattr(exc, k)})
    return out


def _loop(loader, body=None, epoch=0):
    """Iterate one epoch; ``body(step)`` may raise or return 'break'. Returns (steps, exception or None)."""
    steps = 0
    loader.set_epoch(epoch)
    try:
        for batch in loader:
            evenflow.pop_step_info(batch)
            steps += 1
            if body is not None and body(steps) == "break":
                break
    except Exception as exc:  # noqa: BLE001
        return steps, exc
    return steps, None


def sc_hostile(rank, world, kind):
    """One fault of issue 10 on rank 1 (``kind``); every rank reports what it saw and when."""
    # Generous bounds for a loaded 2-core box (worker start-up alone took > 20 s at load 30); only the
    # 'blocking' fault waits for worker_timeout, so it gets a short one.
    # worker_timeout is a per-rank setting (not compared across ranks): only rank 1 waits on its blocked sample.
    short = dict(timeout=timedelta(seconds=120),
                 worker_timeout=timedelta(seconds=20 if kind == "blocking" and rank == 1 else 90))
    t_fault = [None]

    def at_step(action):
        def body(step):
            if rank == 1 and step == FAULT_STEP:
                t_fault[0] = time.time()
                return action()
        return body

    def boom():
        raise ZeroDivisionError("injected trainer failure (say, an OOM)")

    if kind in ("break_one", "raise_one", "break_all"):
        loader = evenflow.DynamicBatchLoader(TokenDataset(301), token_budget=BUDGET, buffer_size=16, **short)
        if kind == "break_all":
            res = _loop(loader, lambda step: "break" if step == FAULT_STEP else None)
            again = _loop(loader, epoch=1)
            loader.close()
            return dict(_outcome(*res), again=_outcome(*again))
        res = _loop(loader, at_step((lambda: "break") if kind == "break_one" else boom))
        loader.close()
        return _outcome(*res, t_fault[0])
    if kind == "with_raise":  # the exception leaves the loop and the with block: __exit__ reports it
        steps = 0
        try:
            with evenflow.DynamicBatchLoader(TokenDataset(301), token_budget=BUDGET, buffer_size=16,
                                             **short) as loader:
                for batch in loader:
                    evenflow.pop_step_info(batch)
                    steps += 1
                    at_step(boom)(steps)
        except Exception as exc:  # noqa: BLE001
            return _outcome(steps, exc, t_fault[0])
        return _outcome(steps, None)
    if kind == "close_exc":
        loader = evenflow.DynamicBatchLoader(TokenDataset(301), token_budget=BUDGET, buffer_size=16, **short)

        def body(step):
            try:
                at_step(boom)(step)
            except ZeroDivisionError as exc:
                loader.close(exc)
                raise
        res = _loop(loader, body)
        loader.close()
        return _outcome(*res, t_fault[0])
    return _data_fault(rank, world, kind, short)


def _data_fault(rank, world, kind, short):
    """Data faults: shuffle=False, so index i lives on rank i % world; the fault is on rank 1's 6th sample."""
    at = 1 + 5 * world
    n = 40 if kind == "collate_last" else 200
    if kind == "collate_last":
        at = n - 1 - (n - 2) % world  # rank 1's last sample (i % world == 1): in the last window
    kw = dict(token_budget=BUDGET, buffer_size=4, shuffle=False, **short)
    t0 = time.time()
    if kind in ("unpicklable", "blocking"):
        ds = HostileDataset(n, kind if rank == 1 else None, at)
        loader = evenflow.DynamicBatchLoader(ds, num_workers=1, **kw)
    elif kind in ("collate_mid", "collate_last"):
        # planning="local": the batch holding sample `at` is collated on its home rank, 1 (global planning may
        # train it elsewhere: "collate_global")
        loader = evenflow.DynamicBatchLoader(TokenDataset(n), collate_fn=_LastFails(at), planning="local",
                                             grad_accum_steps=4 if kind == "collate_last" else 1, **kw)
    elif kind == "collate_global":  # the rank that trains sample `at` fails, wherever global planning put it
        loader = evenflow.DynamicBatchLoader(TokenDataset(n), collate_fn=_LastFails(at), planning="global", **kw)
    elif kind == "length_fn":
        loader = evenflow.DynamicBatchLoader(TokenDataset(n), length_fn=_length_fails(at), **kw)
    elif kind == "balance_pickle":
        ds = HostileDataset(n, "unpicklable" if rank == 1 else None, None)
        ds.at = None
        loader = evenflow.DynamicBatchLoader(_AllUnpicklable(ds) if rank == 1 else ds, balance=True, **kw)
    elif kind == "start_fail":
        loader = evenflow.DynamicBatchLoader(FailingIterable() if rank == 1 else RankStream(rank, 60, 7),
                                             token_budget=BUDGET, buffer_size=4, **short)
    elif kind == "len_mismatch":
        loader = evenflow.DynamicBatchLoader(TokenDataset(n - 3 if rank == 1 else n), **kw)
    else:
        raise ValueError(kind)
    res = _loop(loader)
    loader.close()
    return _outcome(*res, t0)


class _AllUnpicklable(Dataset):
    """Every sample carries a lock (fine with num_workers=0, until balance=True must send one to a peer)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i):
        sample = self.inner[i]
        sample["handle"] = threading.Lock()
        return sample


def sc_torn_resume(rank, world, kind):
    """kind 'torn': rank 0 resumes from step 3, the others from step 6; 'one_loads': only rank 0 loads."""
    make = lambda: evenflow.DynamicBatchLoader(TokenDataset(301), token_budget=BUDGET, buffer_size=16, seed=7,  # noqa: E731
                                               timeout=timedelta(seconds=30))
    loader, states = make(), {}
    for step, batch in enumerate(loader, 1):
        evenflow.pop_step_info(batch)
        if step in (3, 6):
            states[step] = loader.state_dict()
        if step == 6:
            break
    loader.close()
    fresh = make()
    if kind == "torn":
        fresh.load_state_dict(states[3 if rank == 0 else 6])
    elif rank == 0:
        fresh.load_state_dict(states[3])
    res = _loop(fresh)
    fresh.close()
    return _outcome(*res)


def sc_quota_conserve(rank, world, n=97, epochs=3, balance=False, workers=0, persistent=False, resume_at=None,
                      iterable=False):
    """Quota mode over ``epochs``: which samples (and stream passes) each rank trained, and what it carries."""
    def make():
        ds = PassStream(rank, 40, 17, by_epoch=workers > 0 and not persistent) if iterable else TokenDataset(n, seed=3)
        return evenflow.DynamicBatchLoader(ds, token_budget=BUDGET, buffer_size=8, join=False, seed=5,
                                           balance=balance, num_workers=workers, persistent_workers=persistent,
                                           timeout=timedelta(seconds=60), worker_timeout=timedelta(seconds=30))
    loader, trained = make(), []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for step, batch in enumerate(loader, 1):
            info = evenflow.pop_step_info(batch)
            trained.extend(batch["tag"] if iterable else info.sample_ids)
            if resume_at is not None and epoch == 1 and step == resume_at and info.window_end:
                state = loader.state_dict()
                loader.close()
                loader = make()
                loader.load_state_dict(state)
                break
        else:
            continue
        loader.set_epoch(1)
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            trained.extend(batch["tag"] if iterable else info.sample_ids)
    state = loader.state_dict()
    loader.close()
    return dict(trained=[tuple(t) if isinstance(t, list) else t for t in trained], carry=state["next_carry"],
                count=(40 + 17 * rank) if iterable else None)


class PassStream(IterableDataset):
    """Rank r's stream of ``base + step * r`` samples, each tagged (rank, pass, position): a re-read or skipped
    sample shows. Passes are counted per __iter__ call on the iterating copy (num_workers=0, persistent
    workers), or are the epoch the pass was opened in (fresh workers copy the dataset when a pass opens)."""

    def __init__(self, rank: int, base: int, step: int, by_epoch: bool) -> None:
        self.rank, self.count, self.by_epoch = rank, base + step * rank, by_epoch
        self.lengths = long_tail_lengths(self.count, seed=200 + rank, cap=BUDGET // 4)
        self.epoch, self.passes = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        pass_id = self.epoch if self.by_epoch else self.passes
        self.passes += 1
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for j in range(wid, self.count, nw):
            n = int(self.lengths[j])
            yield {"input_ids": torch.full((n,), j, dtype=torch.long), "tag": (self.rank, pass_id, j)}


def sc_many(rank, world, calls):
    """Run several scenarios in one process world, in order: ``calls`` = [(name, function name, args)]."""
    return {name: globals()[fn](rank, world, *args) for name, fn, args in calls}


# -- moved samples and bounded user code (issue 19): each returns what this rank saw ------------------------
class IdsCollate:
    """Pads input_ids/labels and records each sample's storage size (a moved view must arrive compact)."""

    def __init__(self, fail_at: int | None = None, sleep_at: int | None = None) -> None:
        self.fail_at, self.sleep_at = fail_at, sleep_at

    def __call__(self, samples):
        indices = [int(s["index"]) for s in samples]
        if self.fail_at in indices:
            raise KeyError(f"injected collate failure on sample {self.fail_at}")
        if self.sleep_at in indices:
            time.sleep(30)  # past worker_timeout; bounded, so the abandoned thread ends within the world's life
        width = max(len(s["input_ids"]) for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : len(s["input_ids"])] = s["input_ids"]
        return {"input_ids": ids, "index": indices,
                "storage": [s["input_ids"].untyped_storage().nbytes() for s in samples]}


def _raise_on_load(kind: str):
    if kind == "memory":
        raise MemoryError("injected: no memory to rebuild this object")
    raise ValueError("injected: this object refuses to be unpickled")


class LoadFails:
    """Pickles fine on the sender; unpickling it raises (``kind``: "reduce" -> ValueError, "memory")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __reduce__(self):
        return _raise_on_load, (self.kind,)


ONLY_ON_SENDER = "evenflow_test_only_on_the_sender"


class OnlyOnSender:
    """A class the receiver cannot import: its module exists only in the sending rank's process."""


def _install_only_on_sender() -> None:
    import sys
    import types
    module = types.ModuleType(ONLY_ON_SENDER)
    module.OnlyOnSender = OnlyOnSender
    OnlyOnSender.__module__ = ONLY_ON_SENDER
    sys.modules[ONLY_ON_SENDER] = module


class Tagged(Dataset):
    """TokenDataset samples with ``extra`` added to every sample (only on the rank that builds it so)."""

    def __init__(self, inner, extra=None) -> None:
        self.inner, self.extra = inner, extra

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i):
        sample = self.inner[i]
        if self.extra is not None:
            sample["extra"] = self.extra
        return sample


class ViewCorpus(Dataset):
    """A pre-tokenized corpus: every sample is a view of one big tensor (``corpus[a:b]``)."""

    def __init__(self, n: int, seed: int = 0, corpus_tokens: int = 3_000_000) -> None:
        self.corpus = torch.arange(corpus_tokens, dtype=torch.long)
        lengths = long_tail_lengths(n, seed)
        self.starts = np.random.default_rng(seed).integers(0, corpus_tokens - BUDGET, n)
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i):
        a = int(self.starts[i])
        view = self.corpus[a:a + int(self.lengths[i])]
        return {"input_ids": view, "labels": view, "index": i}


def _length_value(value, at=None):
    def length(sample):
        return value if at is None or int(sample["index"]) == at else len(sample["input_ids"])
    return length


def _resources_value(value, at):
    def resources(sample):
        return {"num_patches": value if int(sample["index"]) == at else 1}
    return resources


class NotePid:
    """worker_init_fn: write this worker's pid to ``{prefix}-{worker_id}`` (the test kills one)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __call__(self, worker_id: int) -> None:
        with open(f"{self.prefix}-{worker_id}", "w") as f:
            f.write(str(os.getpid()))


def sc_moved(rank, world, kind, tmp=None):
    """One issue-19 fault (``kind``); the faulty rank is 1. Returns _outcome(...) plus kind-specific fields."""
    t0 = time.time()  # the fault table's "after" for data faults: from the start of the epoch
    bounds = dict(timeout=timedelta(seconds=120), worker_timeout=timedelta(seconds=90))
    kw = dict(token_budget=BUDGET, buffer_size=16, shuffle=False, **bounds)
    policy = "global"
    if kind.startswith("unpickle:"):
        _, how, policy = kind.split(":")
        if rank == 1 and how == "module":
            _install_only_on_sender()
        extra = None if rank != 1 else OnlyOnSender() if how == "module" else LoadFails(how)
        plan = dict(planning="global") if policy == "global" else dict(planning="local", balance=True)
        loader = evenflow.DynamicBatchLoader(Tagged(TokenDataset(200), extra), collate_fn=IdsCollate(), **plan, **kw)
        res = _loop(loader)
        loader.close()
        return _outcome(*res, t0)
    if kind == "views":
        ds = ViewCorpus(200)
        loader = evenflow.DynamicBatchLoader(ds, collate_fn=IdsCollate(), planning="global", **kw)
        seen, exact = [], True
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            seen.extend(zip(batch["index"], batch["storage"]))
            exact &= list(info.sample_ids) == batch["index"]
            for i, row in zip(batch["index"], batch["input_ids"]):  # what the home rank would have collated
                ids = ds[i]["input_ids"]
                exact &= bool((row[: len(ids)] == ids).all()) and not row[len(ids):].any()
        moves = getattr(loader, "moves", None)  # (fbdadc2 had no count: the storage check below fails there)
        loader.close()
        return dict(seen=seen, moves=(moves.samples, moves.bytes, moves.tensor_bytes) if moves else None, exact=exact)
    if kind.startswith("stop_end:"):
        policy = kind.split(":")[1]
        loader = evenflow.DynamicBatchLoader(TokenDataset(120), token_budget=BUDGET, buffer_size=16, seed=3,
                                             planning=policy, **bounds)
        total, _ = _loop(loader)
        out = dict(total=total, stops=[])
        def body(step):
            if rank == 1 and step >= stop_at - 2:
                time.sleep(0.3)  # rank 1 trains slowly at the end: its peers' pipelines finish the epoch first
            return "break" if rank == 1 and step == stop_at else None
        for back in (3, 2, 1):
            stop_at = total - back
            steps, exc = _loop(loader, body)
            out["stops"].append(dict(stop_at=stop_at, **_outcome(steps, exc)))
        loader.close()
        return out
    if kind.startswith("collate_equal:"):
        policy = kind.split(":")[1]
        at = 1 + 20 * world  # a sample of rank 1's shard (shuffle=False), mid-epoch
        loader = evenflow.DynamicBatchLoader(TokenDataset(300), collate_fn=IdsCollate(fail_at=at), planning=policy,
                                             **kw)
        # The peers train slowly: they still hold ready batches when the failure is known.
        res = _loop(loader, (lambda step: time.sleep(0.05)) if rank != 1 else None)
        loader.close()
        return _outcome(*res, t0)
    if kind == "group_mismatch":
        t0 = time.time()
        try:
            evenflow.DynamicBatchLoader(TokenDataset(50), token_budget=BUDGET, planning="global",
                                        planning_group=2 if rank == 0 else 3, timeout=timedelta(seconds=60))
        except Exception as exc:  # noqa: BLE001
            return _outcome(0, exc, t0)
        return _outcome(0, None, t0)
    if kind.startswith("blocking:"):
        what = kind.split(":")[1]
        at = 1 + 8 * world
        stuck = dict(collate_fn=IdsCollate(sleep_at=at if rank == 1 else None)) if what == "collate_fn" else dict(
            collate_fn=IdsCollate(), length_fn=_sleepy_length(at if rank == 1 else None))
        loader = evenflow.DynamicBatchLoader(TokenDataset(200), token_budget=BUDGET, buffer_size=8, shuffle=False,
                                             timeout=timedelta(seconds=60), worker_timeout=timedelta(seconds=3),
                                             **stuck)
        res = _loop(loader)
        loader.close()
        return _outcome(*res, t0)
    if kind == "kill_worker":
        prefix = f"{tmp}/pid-{rank}"
        loader = evenflow.DynamicBatchLoader(_SlowItems(TokenDataset(600)), token_budget=BUDGET, buffer_size=8,
                                             num_workers=2 if rank == 1 else 0, worker_init_fn=NotePid(prefix),
                                             timeout=timedelta(seconds=120), worker_timeout=timedelta(seconds=60))
        t_kill = [None]

        def body(step):
            if rank == 1 and step == FAULT_STEP:
                with open(f"{prefix}-0") as f:
                    os.kill(int(f.read()), 9)
                t_kill[0] = time.time()
        res = _loop(loader, body)
        loader.close()
        return _outcome(*res, t_kill[0])
    if kind.startswith("length_under:"):
        policy = kind.split(":")[1]
        loader = evenflow.DynamicBatchLoader(TokenDataset(200), length_fn=_length_value(1), planning=policy, **kw)
        res = _loop(loader)
        loader.close()
        return _outcome(*res, t0)
    if kind.startswith("overflow:"):
        _, what, policy = kind.split(":")
        at = 1 + 5 * world
        # oversize="alone" keeps the sample (under "error" it is refused as over the budget, under "drop"
        # dropped): its value then reaches the planner and the exchanges (fbdadc2: a bare OverflowError).
        spec = (dict(length_fn=_length_value(2**63, at if rank == 1 else -1)) if what == "length" else
                dict(extra_budgets={"num_patches": 64}, resources_fn=_resources_value(2**63, at if rank == 1 else -1)))
        spec["oversize"] = "alone"
        loader = evenflow.DynamicBatchLoader(TokenDataset(200), planning=policy, **spec, **kw)
        res = _loop(loader)
        loader.close()
        return _outcome(*res, t0)
    if kind == "quota_len":
        ds = TokenDataset(301)
        ds.lengths[:] = np.where(np.arange(301) % world == 1, 1500, 10)  # rank 1's samples train 1 per batch
        loader = evenflow.DynamicBatchLoader(ds, token_budget=BUDGET, buffer_size=32, join=False, shuffle=False,
                                             **bounds)
        lens, carry = [], []
        for epoch in range(3):
            loader.set_epoch(epoch)
            lens.append(len(loader))
            _loop(loader, epoch=epoch)
            carry.append(len(loader.state_dict()["next_carry"]))
        loader.close()
        return dict(lens=lens, carry=carry)
    raise ValueError(kind)


def _sleepy_length(at):
    def length(sample):
        if at is not None and int(sample["index"]) == at:
            time.sleep(30)  # past worker_timeout; bounded
        return len(sample["input_ids"])
    return length


class _SlowItems(Dataset):
    """A dataset whose samples take a moment to load (so a killed worker is still needed)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i):
        time.sleep(0.01)
        return self.inner[i]
