"""Rank bodies for tests/test_mesh_cp_sp.py: the loader on a 2-D (dp x cp|sp) mesh of 4 gloo ranks.

The attentions below are *references* (not the product): differentiable on gloo (Ulysses through
``torch.distributed.nn.functional.all_to_all_single``), registered with transformers' ``AttentionInterface`` so a stock HF model runs
sharded. Ulysses: an all-to-all turns [heads, my tokens] into [my heads, every token], attention runs over the
whole row, a second all-to-all turns it back. Ring: keys and values of every CP rank are all-gathered (what a ring
passes around, at once; a hand-written autograd gather, see _GatherTokens), and each query attends to the keys of
its own document at or before its row position (the head-tail order undone by the shard indices). The
single-process reference is stock sdpa, each sample alone.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.nn.functional as F

import evenflow
from evenflow.runtime.shard import shard_indices_of

VOCAB = 97
BUDGET = 32                     # per data-parallel group: 2 x cp = 4 divides it, so does sp = 2
# Odd lengths; 31 > BUDGET / 2 (row / degree): that document spans every CP/SP rank.
LENGTHS = [5, 7, 3, 9, 11, 31, 13, 1, 15, 17, 21, 3, 9, 5, 19, 7]
CTX: dict = {}                  # the current batch's layout, set before each sharded forward


class Docs(torch.utils.data.Dataset):
    """Documents with a masked prompt; ``salt`` changes the tokens (a dataset built differently on some ranks)."""

    def __init__(self, salt: int = 0) -> None:
        g = torch.Generator().manual_seed(7 + salt)
        self.ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        labels = self.ids[i].clone()
        labels[: len(labels) // 3] = -100
        return {"input_ids": self.ids[i], "labels": labels}


# -- reference attentions ----------------------------------------------------------------------------------------
def _attend(module, q, k, v, allowed, scaling):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=q.dtype) @ v      # [B, H, q, D]


def _allowed(q_pos, k_pos):
    doc = CTX["doc"]
    return (doc[q_pos][:, None] == doc[k_pos][None, :]) & (k_pos[None, :] <= q_pos[:, None])


class _GatherTokens(torch.autograd.Function):
    """Every CP rank's ``x`` concatenated along dim 2; backward: the summed gradient of this rank's part.
    (``torch.distributed.nn.functional.all_gather``'s gloo backward scatters from *group* ranks as if they were
    global ones, so it fails on a subgroup that does not hold rank 0.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.size = group, x.shape[2]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        me = dist.get_rank(ctx.group)
        return grad[:, :, me * ctx.size:(me + 1) * ctx.size], None


def ring_attention(module, q, k, v, attention_mask, scaling=None, **_):
    ks, vs = _GatherTokens.apply(k, CTX["group"]), _GatherTokens.apply(v, CTX["group"])
    order = CTX["orders"]
    out = _attend(module, q, ks, vs, _allowed(order[CTX["rank"]], torch.cat(order)), scaling)
    return out.transpose(1, 2).contiguous(), None


def _exchange(x, split_dim, cat_dim):
    """All-to-all over the SP group: split ``split_dim`` into SP chunks, send chunk j to rank j, concatenate
    what arrives along ``cat_dim`` in rank order (differentiable)."""
    sp = CTX["degree"]
    parts = torch.stack(x.chunk(sp, dim=split_dim)).contiguous()
    got = dnn.all_to_all_single(torch.empty_like(parts), parts, group=CTX["group"])
    return torch.cat(got.unbind(0), dim=cat_dim)


def ulysses_attention(module, q, k, v, attention_mask, scaling=None, **_):
    q, k, v = (_exchange(x, 1, 2) for x in (q, k, v))         # [B, H/sp, N, D]
    pos = torch.arange(q.shape[2])
    out = _attend(module, q, k, v, _allowed(pos, pos), scaling)
    return _exchange(out, 2, 1).transpose(1, 2).contiguous(), None   # [B, n, H, D]


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name, fn in (("ref_ring", ring_attention), ("ref_ulysses", ulysses_attention)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, lambda *a, **k: None)  # the reference builds its own mask


def set_context(batch, placement) -> None:
    """The layout the reference attention needs: document of every row position, every rank's positions."""
    layout = placement.layout
    cu = batch["cu_seqlens_padded"].to(torch.long)
    CTX.update(degree=layout.degree, rank=placement.shard_rank, group=placement.peer_group,
               doc=torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(cu)),
               orders=[shard_indices_of(batch, layout, r) for r in range(layout.degree)])


# -- models ------------------------------------------------------------------------------------------------------
def qwen3(attn: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).to(dtype).train()


def qwen2_vl(attn: str, dtype: torch.dtype):
    """A stock ``Qwen2VLForConditionalGeneration``, random init, tiny (M-RoPE sections 2+1+1 of head_dim 8)."""
    import transformers

    text = dict(vocab_size=VOCAB + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4})
    config = transformers.Qwen2VLConfig(vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2),
                                        text_config=text, image_token_id=VOCAB, video_token_id=VOCAB + 1,
                                        vision_start_token_id=VOCAB + 2, vision_end_token_id=VOCAB + 3)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).to(dtype).train()
    if attn != "sdpa":
        model.set_attn_implementation({"text_config": attn})
    return model


# -- one run on the mesh -----------------------------------------------------------------------------------------
def _loader(mesh, dim, **kw):
    kw.setdefault("token_budget", BUDGET)
    return evenflow.DynamicBatchLoader(kw.pop("dataset", Docs()), cost="summed", mesh=mesh, dp_dims=("dp",),
                                       **{f"{'cp' if dim == 'cp' else 'sp'}_dim": dim}, seed=3, buffer_size=8,
                                       max_steps_per_round=2, timeout=timedelta(seconds=60), **kw)


def _forward(model, batch, loader, vlm=False):
    mine = evenflow.shard_batch(batch, loader.mesh)
    set_context(batch, loader.mesh)
    positions = mine["position_ids"]
    if vlm:  # 4 rows: text positions, then the M-RoPE rows (text-only documents: equal rows)
        four = batch["position_ids"][None].expand(4, *batch["position_ids"].shape)
        positions = evenflow.shard_batch({**batch, "position_ids": four}, loader.mesh)["position_ids"]
    logits = model(input_ids=mine["input_ids"], position_ids=positions, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mine["shift_labels"].reshape(-1),
                           ignore_index=-100, reduction="sum")


def train_run(mesh, dim, attn, dtype, *, grad_accum_steps=2, vlm=False):
    """Every window: the mesh-averaged gradient and loss, and the window's samples (each DP group's once)."""
    model = (qwen2_vl if vlm else qwen3)(attn, dtype)
    loader = _loader(mesh, dim, grad_accum_steps=grad_accum_steps)
    world = dist.get_world_size()
    windows, ids, loss = [], [], 0.0
    for batch in loader:
        info = evenflow.pop_step_info(batch)
        scaled = evenflow.scale_loss(_forward(model, batch, loader, vlm), info, reduction="sum")
        scaled.backward()
        loss += scaled.item()
        if loader.mesh.shard_rank == 0:
            ids.extend(info.sample_ids)
        if info.window_end:
            grads = {}
            for name, p in model.named_parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(g)                   # what FSDP2 over dp x cp does: the mean over every rank
                grads[name] = g / world
            total = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(total)
            every = [None] * world
            dist.all_gather_object(every, ids)
            windows.append((sorted(i for part in every for i in part), total.item() / world, grads))
            model.zero_grad()
            ids, loss = [], 0.0
    return windows


def reference(windows, dtype, vlm=False):
    """Single process, stock sdpa, each sample alone: the per-token mean over each window's samples."""
    model = (qwen2_vl if vlm else qwen3)("sdpa", dtype)
    data = Docs()
    worst_grad, worst_loss = 0.0, 0.0
    for ids, loss, grads in windows:
        total, tokens = 0.0, 0
        for i in ids:
            s = data[i]
            logits = model(input_ids=s["input_ids"][None], use_cache=False).logits[0]
            total = total + F.cross_entropy(logits[:-1], s["labels"][1:], ignore_index=-100, reduction="sum")
            tokens += int((s["labels"][1:] != -100).sum())
        ref = total / tokens
        ref.backward()
        worst_loss = max(worst_loss, abs(ref.item() - loss))
        for name, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            worst_grad = max(worst_grad, (g - grads[name]).abs().max().item())
        model.zero_grad()
    return worst_loss, worst_grad


def eval_run(mesh, dim, attn):
    """Eval loss: the mesh's summed shard losses over the steps' global supervised tokens (each counted once)."""
    model = qwen3(attn, torch.float64).eval()
    loader = _loader(mesh, dim)
    total, tokens = torch.zeros(1, dtype=torch.float64), 0
    with torch.no_grad():
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            total += _forward(model, batch, loader)
            tokens += info.global_loss_tokens
    dist.all_reduce(total)
    ref_model = qwen3("sdpa", torch.float64).eval()
    ref_total, ref_tokens = 0.0, 0
    with torch.no_grad():
        for s in Docs():
            logits = ref_model(input_ids=s["input_ids"][None], use_cache=False).logits[0]
            ref_total += F.cross_entropy(logits[:-1], s["labels"][1:], reduction="sum").item()
            ref_tokens += int((s["labels"][1:] != -100).sum())
    return (total.item() / tokens, ref_total / ref_tokens, tokens, ref_tokens)


def resume_run(mesh, dim, other_mesh, other_dim):
    """State after the first window; resume on the same mesh (same rest of the epoch) and on another degree."""
    planned = _loader(mesh, dim, grad_accum_steps=2, lengths=[len(x) for x in Docs().ids])  # len() exact
    full = [evenflow.pop_step_info(b).sample_ids for b in planned]
    loader = _loader(mesh, dim, grad_accum_steps=2)
    state = None
    for step, batch in enumerate(loader):
        info = evenflow.pop_step_info(batch)
        if info.window_end:
            state = loader.state_dict()
            done = step + 1
            break
    fresh = _loader(mesh, dim, grad_accum_steps=2)
    fresh.load_state_dict(state)
    rest = [evenflow.pop_step_info(b).sample_ids for b in fresh]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (loader.mesh.shard_rank, state))
    states = [st for shard_rank, st in every if shard_rank == 0]      # one per data-parallel rank, in order
    other = _loader(other_mesh, other_dim, grad_accum_steps=2)
    try:
        other.load_state_dict(states)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return rest == full[done:] and planned.planned_steps(0) == len(full), len(full), done, refused


def from_accelerate(mesh, dim):
    """The loader given accelerate's ParallelismConfig sits where the DeviceMesh puts it; both at once must agree."""
    from accelerate.parallelism_config import ParallelismConfig

    config = ParallelismConfig(dp_shard_size=2, **{f"{dim}_size": 2})
    placed = evenflow.DynamicBatchLoader(Docs(), token_budget=BUDGET, cost="summed", parallelism_config=config,
                                         timeout=timedelta(seconds=60)).mesh
    try:
        evenflow.DynamicBatchLoader(Docs(), token_budget=BUDGET, cost="summed", parallelism_config=config, mesh=mesh)
        clash = None
    except ValueError as exc:
        clash = str(exc)
    return placed == _loader(mesh, dim).mesh, clash


def mistake(kind, mesh, dim):
    """Each mistake's error on this rank: ``(type name, message)``."""
    try:
        if kind == "budget":
            _loader(mesh, dim, token_budget=BUDGET + 1)
        elif kind == "group":
            _loader(mesh, dim, process_group=dist.group.WORLD)
        elif kind == "peers":  # the dataset built per CP/SP coordinate: peers get other documents
            loader = _loader(mesh, dim, dataset=Docs(salt=mesh.get_local_rank(dim)))
            for batch in loader:
                evenflow.pop_step_info(batch)
        return None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, str(exc)


def one_mesh(rank, dim):
    """Every check on a dp=2 x ``dim``=2 mesh; ``timings``: seconds since the mesh was built, per check."""
    import time
    from torch.distributed.device_mesh import init_device_mesh

    t0 = time.monotonic()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", dim))
    attn = "ref_ring" if dim == "cp" else "ref_ulysses"
    out, t = {}, {}
    runs = {"fp64": train_run(mesh, dim, attn, torch.float64),
            "fp32": train_run(mesh, dim, attn, torch.float32, grad_accum_steps=1)}
    if dim == "sp":
        out["eval"] = eval_run(mesh, dim, attn)
        runs["vlm"] = train_run(mesh, dim, attn, torch.float64, vlm=True)
    t["train"] = time.monotonic() - t0
    for name, windows in runs.items():
        if rank == 0:
            dtype = torch.float32 if name == "fp32" else torch.float64
            out[name] = (len(windows), *reference(windows, dtype, vlm=name == "vlm"))
    t["reference"] = time.monotonic() - t0
    other = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", dim))
    out["resume"] = resume_run(mesh, dim, other, dim)
    for kind in ("budget", "group", "peers"):
        out[kind] = mistake(kind, mesh, dim)
    out["accelerate"] = from_accelerate(mesh, dim)
    out["timings"] = {**t, "mistakes": time.monotonic() - t0}
    return out


def world(rank, world_size):
    """One world of 4 ranks for both meshes (a world's start costs more than either mesh's checks)."""
    register()
    return {dim: one_mesh(rank, dim) for dim in ("sp", "cp")}
