"""How a sample moves to another rank (``planning="global"``, ``balance=True``): its tensors as their own bytes.

NOTE [ Moved samples ]
    A moved sample arrives as exactly what its home rank would have collated, and costs its own bytes. Pickling
    a torch tensor pickles its whole storage: a 220-token view ``corpus[a:b]`` of a pre-tokenized 21 MB corpus
    pickles 21 MB. So a sample is pickled with every plain CPU tensor replaced by a reference (pickle's
    ``persistent_id`` hook, the mechanism ``torch.save`` itself uses), and the tensors travel beside it through
    [`evenflow.exchange.dispatch.pack_samples()`][evenflow.exchange.dispatch.pack_samples] as (dtype, shape, their own
    bytes): a view of 220 int64 costs 1,760 bytes plus its share of a small header, and arrives as a compact tensor of
    its own.

    What is still pickled is the sample's structure: keys, numbers, strings, numpy arrays (which pickle only
    their own data), other objects. The receiver unpickles it (README, "Trust model": the ranks of one job
    trust each other, as torch's object collectives do). The sample's key, length and loss tokens travel as
    int64 beside the pickle, so a receiver that cannot unpickle (a class only the sender can import, a
    ``__reduce__`` that raises, a MemoryError) still names the sample and its sender.

    Tensors that are not plain, dense, CPU and grad-free (subclasses, nested, sparse or quantized tensors, a
    tensor that requires grad) are left to torch's own pickling, storage and all. A nested tensor's layout is
    ``torch.strided`` too, but its bytes are not one flat buffer (``reshape(-1)`` refuses it): e25fa43 sent it as
    one and every rank failed with a bare ``RuntimeError: reshape``. What torch cannot pickle either (an MKL-DNN
    tensor) is refused on its home rank, naming the sample and the fix (``planning='local'``), on every rank.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..planning.alignment import Item
from ..errors import sample_of

__all__ = ["pack", "peek", "unpack", "Arrival", "receive_failure", "Moves"]

_META, _HEAD = "meta", "head"
"""Keys of a packed sample: the pickled structure (uint8) and (length, loss tokens, key...) as int64."""


def _plain(obj: object) -> bool:
    """A tensor whose own bytes, dtype and shape are all of it (see NOTE [ Moved samples ])."""
    return (type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided
            and not obj.is_nested and not obj.requires_grad and not obj.is_quantized and not obj.is_conj()
            and not obj.is_neg())


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj: object) -> int | None:
        if _plain(obj):
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: object) -> torch.Tensor:
        return self.tensors[int(pid)]


def _key_words(key: object) -> list[int] | None:
    """A runtime key as int64 words: an index or stream position ``[k]``, a carried ``(epoch, index)`` pair
    ``[e, k]``; None for any other key (it then travels inside the pickle only)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return [key]
    if (isinstance(key, tuple) and len(key) == 2
            and all(isinstance(k, int) and not isinstance(k, bool) for k in key)):
        return list(key)
    return None


@dataclass
class Moves:
    """What this rank sent to peers since its loader was built (``loader.moves``; zeros under local planning
    without ``balance=True``)."""

    samples: int = 0
    """Samples sent to another rank."""
    bytes: int = 0
    """Bytes of the sample all-to-alls this rank sent (every byte on the wire: headers, pickles, tensors)."""
    tensor_bytes: int = 0
    """The own bytes of the plain tensors in those samples (NOTE [ Moved samples ]: ``bytes`` exceeds it by
    the pickled rest and a small header per sample)."""
    seconds: float = 0.0
    """Wall time this rank spent moving samples (packing, the all-to-all, unpacking), over all rounds."""
    max_round_seconds: float = 0.0
    """The longest one round's move took on this rank (compare with ``timeout``: a move is one collective)."""

    def timed(self, seconds: float) -> None:
        """Add one round's move time."""
        self.seconds += seconds
        self.max_round_seconds = max(self.max_round_seconds, seconds)

    def count(self, chunks: list[torch.Tensor], rank: int, packed: list[dict[str, torch.Tensor]]) -> None:
        """Count one all-to-all: ``chunks`` as
        [`evenflow.exchange.dispatch.pack_samples()`][evenflow.exchange.dispatch.pack_samples] built them."""
        self.samples += len(packed)
        self.bytes += sum(c.numel() for d, c in enumerate(chunks) if d != rank)
        self.tensor_bytes += sum(t.numel() * t.element_size() for p in packed for k, t in p.items()
                                 if k not in (_META, _HEAD))


def pack(item: Item, sample: object) -> dict[str, torch.Tensor]:
    """The sample as [`evenflow.exchange.dispatch.pack_samples()`][evenflow.exchange.dispatch.pack_samples] sends it.
    Raises what pickling raises."""
    buf, tensors = io.BytesIO(), []
    _Pickler(buf, tensors).dump((item.key, dict(item.extra), sample))
    words = _key_words(item.key) or []
    out = {_META: torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8),
           _HEAD: torch.tensor([item.length, item.loss_tokens, *words], dtype=torch.int64)}
    out.update((f"t{i}", t) for i, t in enumerate(tensors))
    return out


@dataclass(frozen=True)
class Arrival:
    """What a packed sample says before it is unpickled: enough to name it if unpickling fails."""

    key: object
    """The sample's key at its home rank (None when the key is not an int or an int pair)."""
    length: int
    loss_tokens: int


def peek(packed: Mapping[str, torch.Tensor]) -> Arrival:
    head = packed[_HEAD].tolist()
    key = None if len(head) == 2 else head[2] if len(head) == 3 else tuple(head[2:])
    return Arrival(key, int(head[0]), int(head[1]))


def unpack(packed: Mapping[str, torch.Tensor]) -> tuple[Item, object]:
    """The inverse of [`pack()`][pack]: the sample's planner item (its home key) and the sample, with fresh tensors."""
    tensors = [packed[f"t{i}"] for i in range(len(packed) - 2)]
    key, extra, sample = _Unpickler(io.BytesIO(packed[_META].numpy().tobytes()), tensors).load()
    head = peek(packed)
    return Item(key, head.length, head.loss_tokens, extra), sample


def receive_failure(exc: BaseException, key: object, sender: int, receiver: int, policy: str,
                    alternative: str) -> tuple[BaseException, object]:
    """The receiving rank's error for a moved sample it cannot unpack, and the sample's key (for PeerError)."""
    index = sample_of(key)
    what = f"sample index {index}" if index is not None else "a sample"
    memory = (" (out of host memory while receiving it: lower buffer_size= or the size of a sample)"
              if isinstance(exc, MemoryError) else "")
    err = RuntimeError(
        f"evenflow: rank {receiver} cannot unpickle {what} that rank {sender} sent it under {policy} "
        f"({type(exc).__name__}: {exc}){memory}. A moved sample is pickled on its home rank and unpickled on the "
        "rank that trains it: every class inside a sample must be importable and loadable on every rank (define "
        "it in a module every rank imports, not in one rank's __main__), or return plain tensors, numbers and "
        f"strings from the dataset, or use {alternative} so that samples stay on their rank")
    err.__cause__ = exc
    return err, key
