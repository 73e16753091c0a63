"""What a balanced step's exchanges cost: bytes per exchange, intra- vs inter-node links, the time left on the
critical path (pure numpy; the simulator's communication model).

NOTE [ Pricing the exchanges ]
    A balanced step moves data: each encoder phase's input rows from their source rank to their encoding
    rank, the encoder outputs to the LLM rank of their example (and their gradients back in the backward),
    the text to its LLM rank; before any of it, one metadata all_gather and the plan. Balancing pays only if
    the slowest rank's saved compute exceeds what of this is left on the critical path. The model here:

    * an **all-to-all** lasts as long as its busiest link: per rank, the bytes it sends or receives to ranks of
      its own node over NVLink (``intra_bw`` per GPU), per node, the bytes crossing its NICs (``inter_bw`` per
      node, every rank's inter-node traffic shares them), plus a latency and ``per_peer`` seconds for each
      peer the busiest rank talks to (a ragged all-to-all is one message per non-empty pair);
    * an **all_gather** of ``b`` bytes per rank is a ring: ``(W - 1) b`` through the slowest link, plus a
      latency per ring step on gloo (``host_latency``, TCP) or per doubling on NCCL;
    * **gloo** (the loader's group, TCP) moves bytes at ``host_bw`` per node, intra- or inter-node alike (the
      host's NIC and loopback share the CPU's copies);
    * work in the **background** (the loader's thread, while the previous step trains) costs the step only
      what is left when the previous step ends: ``max(0, background - previous step)``.

    Every figure is an assumption, stated in ``LinkModel`` and overridable; none is measured here. The
    rearrangement that places buckets to keep bytes inside a node (``OrchestratorConfig.ranks_per_node``) is
    what makes inter-node bytes small: ``step_traffic`` counts them for any plan, node-aware or not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..balance.phases.plan import StepPlan

__all__ = ["LinkModel", "Traffic", "traffic", "all_to_all_s", "all_gather_s", "exposed_s", "step_traffic",
           "worth_balancing"]


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """The links a step's exchanges run on (defaults: an H100 SXM node, assumed, not measured)."""

    ranks_per_node: int = 8
    intra_bw: float = 360e9
    """Bytes/s one GPU sends (and receives) over NVLink inside a node (H100 SXM: 450 GB/s per direction
    nominal; ~360 achieved by NCCL's all-to-all)."""
    intra_latency: float = 10e-6
    """Seconds of fixed cost per NCCL collective inside one node."""
    inter_bw: float = 400e9
    """Bytes/s one node sends (and receives) to other nodes: 8 x 400 Gb/s InfiniBand NICs (8 x 50 GB/s)."""
    inter_latency: float = 25e-6
    """Seconds of fixed cost per NCCL collective spanning nodes."""
    per_peer: float = 2e-6
    """Seconds per peer the busiest rank exchanges with in one ragged all-to-all (one message per pair)."""
    host_bw: float = 6e9
    """Bytes/s of gloo (TCP) per node, sent or received (2-12 GB/s on 100-400 Gb/s Ethernet/IPoIB)."""
    host_latency: float = 50e-6
    """Seconds per gloo message (one TCP round of a ring step)."""

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        for name in ("intra_bw", "inter_bw", "host_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LinkModel.{name} must be > 0 bytes/s, got {getattr(self, name)!r}")
        for name in ("intra_latency", "inter_latency", "per_peer", "host_latency"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"LinkModel.{name} must be >= 0 s, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Traffic:
    """Bytes of one all-to-all, per rank and per node (``[world]`` / ``[nodes]`` float64 arrays)."""

    world: int
    ranks_per_node: int
    intra: np.ndarray
    """Per rank, max(sent, received) bytes to/from ranks of its own node (itself excluded)."""
    node: np.ndarray
    """Per node, max(sent, received) bytes to/from other nodes."""
    peers: np.ndarray
    """Per rank, max(ranks sent to, ranks received from), itself excluded."""
    moved_bytes: float
    """Bytes that left their rank."""
    inter_node_bytes: float
    """Bytes that left their node."""

    def __add__(self, other: Traffic) -> Traffic:  # two exchanges fused into one (same ranks)
        return Traffic(self.world, self.ranks_per_node, self.intra + other.intra, self.node + other.node,
                       np.maximum(self.peers, other.peers), self.moved_bytes + other.moved_bytes,
                       self.inter_node_bytes + other.inter_node_bytes)


def traffic(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, world: int, ranks_per_node: int) -> Traffic:
    """The all-to-all that moves item ``i`` (``nbytes[i]`` bytes) from rank ``src[i]`` to rank ``dst[i]``.

    >>> t = traffic(np.array([0, 0, 1]), np.array([1, 2, 1]), np.array([10., 20., 5.]), 4, 2)
    >>> t.intra.tolist(), t.node.tolist(), t.moved_bytes, t.inter_node_bytes
    ([10.0, 10.0, 0.0, 0.0], [20.0, 20.0], 30.0, 20.0)
    """
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.float64)
    nodes = -(-world // ranks_per_node)
    moved = src != dst
    s, d, b = src[moved], dst[moved], nbytes[moved]
    same = s // ranks_per_node == d // ranks_per_node
    intra = np.maximum(np.bincount(s[same], b[same], minlength=world), np.bincount(d[same], b[same], minlength=world))
    cross = ~same
    node = np.maximum(np.bincount(s[cross] // ranks_per_node, b[cross], minlength=nodes),
                      np.bincount(d[cross] // ranks_per_node, b[cross], minlength=nodes))
    pairs = np.unique(s * world + d)
    peers = np.maximum(np.bincount(pairs // world, minlength=world), np.bincount(pairs % world, minlength=world))
    return Traffic(world, ranks_per_node, intra, node, peers.astype(np.float64), float(b.sum()),
                   float(b[cross].sum()))


def all_to_all_s(t: Traffic, link: LinkModel, *, host: bool = False) -> float:
    """Seconds of one all-to-all (NOTE [ Pricing the exchanges ]); ``host``: over gloo (TCP) instead of NCCL.
    Every rank enters it, so it costs its latency even when nothing moves."""
    if host:  # TCP: every byte through the host's NIC, one message per peer
        per_rank_node = np.add.reduceat(t.intra, np.arange(0, t.world, t.ranks_per_node))
        busiest = float(np.max(per_rank_node + t.node[:len(per_rank_node)], initial=0.0))
        return busiest / link.host_bw + link.host_latency * max(1.0, float(t.peers.max(initial=0)))
    spans = t.world > t.ranks_per_node
    latency = link.inter_latency if spans else link.intra_latency
    busy = max(float(t.intra.max(initial=0)) / link.intra_bw, float(t.node.max(initial=0)) / link.inter_bw)
    return busy + latency + link.per_peer * float(t.peers.max(initial=0))


def all_gather_s(bytes_per_rank: float, world: int, link: LinkModel, *, host: bool = False) -> float:
    """Seconds of an all_gather of ``bytes_per_rank`` from each of ``world`` ranks (a ring; NOTE [ Pricing the
    exchanges ]). ``host``: over gloo (TCP: one latency per ring step)."""
    if world <= 1:
        return 0.0
    total = (world - 1) * float(bytes_per_rank)
    if host:
        return total / link.host_bw + (world - 1) * link.host_latency
    spans = world > link.ranks_per_node  # a ring crossing nodes runs through one NIC's share per rank
    bw = min(link.intra_bw, link.inter_bw / link.ranks_per_node) if spans else link.intra_bw
    latency = link.inter_latency if spans else link.intra_latency
    return total / bw + latency * math.ceil(math.log2(world))


def exposed_s(background_s: float, hidden_behind_s: float) -> float:
    """What work run in the background leaves on the critical path: the part past what it overlaps."""
    return max(0.0, float(background_s) - float(hidden_behind_s))


def step_traffic(plan: StepPlan, row_bytes: Mapping[str, tuple[float, float]], text_bytes_per_token: float, *,
                 ranks_per_node: int, restore: bool = False) -> dict[str, Traffic]:
    """The all-to-alls of one balanced step under ``plan``: ``"text"`` (examples to their LLM rank), and per
    encoder phase ``p``, ``"p:inputs"`` (input rows to the encoding rank) and ``"p:outputs"`` (output rows to
    the example's LLM rank -- or, ``restore=True``, back to the example's source rank, as an encoder-only
    reorder does). ``row_bytes[p] = (input bytes per row, output bytes per row)``. The backward pass moves each
    ``"p:outputs"`` again, reversed (same bytes, same links)."""
    world, out = plan.world, {}
    out["text"] = traffic(plan.source, plan.dest, plan.length * float(text_bytes_per_token), world, ranks_per_node)
    for p in plan.phases:
        it = plan.items[p]
        src = plan.source[it.example]
        back = src if restore else plan.dest[it.example]
        inb, outb = row_bytes[p]
        out[f"{p}:inputs"] = traffic(src, it.dest, it.rows * float(inb), world, ranks_per_node)
        out[f"{p}:outputs"] = traffic(it.dest, back, it.out_rows * float(outb), world, ranks_per_node)
    return out


def worth_balancing(unbalanced_s: Mapping[str, float], balanced_s: Mapping[str, float],
                    exchange_s: Mapping[str, float]) -> dict[str, bool]:
    """Per phase: does balancing it save more of the slowest rank's time than its exchanges leave on the critical
    path? ``unbalanced_s[p]`` / ``balanced_s[p]``: the phase's slowest rank without / with the plan;
    ``exchange_s[p]``: the exchanges only that phase adds. Pure: the same inputs (every rank's metadata, the
    same ``LinkModel``) give the same answer on every rank.

    >>> worth_balancing({"vision": 1.0, "llm": 2.0}, {"vision": 0.8, "llm": 1.99}, {"vision": 0.05, "llm": 0.02})
    {'vision': True, 'llm': False}
    """
    return {p: bool(unbalanced_s[p] - balanced_s[p] > exchange_s.get(p, 0.0)) for p in unbalanced_s}
