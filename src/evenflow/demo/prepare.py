"""The demo's data: real chitchat conversations through the Qwen3 pipeline, then a dense vocabulary remap."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..data import ChatDataset, QwenChatTokenizer, RemappedDataset, VocabRemap, chitchat_conversations
from ..data.sources import Conversation
from .config import DemoConfig

__all__ = ["DemoData", "prepare_data"]


@dataclass(frozen=True)
class DemoData:
    """Train and held-out datasets (pipelines still run in ``__getitem__``) and what the runs need to know."""

    train: RemappedDataset
    heldout: RemappedDataset
    lengths: np.ndarray
    """Realized train lengths (tokens after template, tokenizer and cutoff) -- for the report, the HF arms'
    batch size and TRL's packs (which need every length before training); the evenflow loader does not get them,
    it observes lengths as samples arrive."""
    loss_tokens: np.ndarray
    """Supervised tokens per train sample."""
    vocab_size: int


def prepare_data(config: DemoConfig, conversations: Sequence[Conversation] | None = None,
                 name: str = "chitchat") -> DemoData:
    """Pick ``train_samples`` + ``heldout_samples`` conversations (seeded, disjoint) and build the remap.

    ``conversations``: the pool to draw from (default: the chitchat chats with a reply), ``name`` its name.
    Building the remap runs the real pipeline once over the train samples (a second or two per thousand
    chats); held-out ids the remap has not kept become ``unk``.
    """
    conversations = chitchat_conversations() if conversations is None else list(conversations)
    need = config.train_samples + config.heldout_samples
    if need > len(conversations):
        raise ValueError(f"train_samples + heldout_samples = {need} exceeds the {len(conversations)} {name} "
                         "conversations; lower them")
    order = np.random.default_rng(config.seed).permutation(len(conversations))
    tokenizer = QwenChatTokenizer()
    train = ChatDataset([conversations[i] for i in order[:config.train_samples]], tokenizer=tokenizer,
                        cutoff=config.cutoff, name=name)
    heldout = ChatDataset([conversations[i] for i in order[config.train_samples:need]], tokenizer=tokenizer,
                          cutoff=config.cutoff, name=f"{name}-heldout")
    lengths, loss_tokens, counts = [], [], np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for i in range(len(train)):
        sample = train[i]
        ids = sample["input_ids"].numpy()
        lengths.append(len(ids))
        loss_tokens.append(int(np.count_nonzero(sample["labels"].numpy()[1:] != -100)))
        counts += np.bincount(ids, minlength=tokenizer.vocab_size)
    remap = VocabRemap.from_counts(counts, max_size=config.vocab_size)
    return DemoData(train=RemappedDataset(train, remap), heldout=RemappedDataset(heldout, remap),
                    lengths=np.asarray(lengths, dtype=np.int64), loss_tokens=np.asarray(loss_tokens, np.int64),
                    vocab_size=remap.size)
