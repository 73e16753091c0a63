"""Real conversations as lists of ``{"role", "content"}`` messages, from packaged and on-disk sources.

* ``chitchat_conversations`` -- PyPI ``chitchat-dataset``: 7,168 real human-human chats. The first speaker
  becomes ``user``, the other ``assistant``; consecutive messages of one speaker form one turn.
* ``read_alpaca`` / ``read_sharegpt`` / ``read_hh_rlhf`` -- the formats in ``../shared/data/`` (benchmarks
  and tests only; a fresh clone has no such folder, so these raise ``FileNotFoundError`` naming the path).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .deps import require

__all__ = ["chitchat_conversations", "read_alpaca", "read_sharegpt", "read_hh_rlhf", "shared_data_dir",
           "shared_data_file", "SHARED_FILES"]

Conversation = list[dict[str, str]]

SHARED_FILES = {
    "alpaca": "llamafactory_alpaca_en_demo.json",
    "sharegpt": "llamafactory_glaive_toolcall_en_demo.json",
    "hh-rlhf": "hh_rlhf_harmless_base_test.jsonl.gz",
}
"""Reader name -> file name in ``../shared/data/``."""


def chitchat_conversations(*, min_turns: int = 2) -> list[Conversation]:
    """All chitchat conversations with at least ``min_turns`` speaker turns, in the package's order.

    About 44 % of the chats have a single speaker turn (one person, nobody answered): with ``min_turns=2``
    (default) they are skipped, since a chat without an assistant turn has nothing to supervise.
    """
    if min_turns < 1:
        raise ValueError(f"min_turns must be >= 1, got {min_turns}")
    require("chitchat_dataset", "the chitchat chat data")
    spec = importlib.util.find_spec("chitchat_dataset")
    path = Path(spec.origin).parent / "dataset.json"
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    out = []
    for chat in raw.values():
        turns: list[tuple[str, str]] = []  # (sender, text)
        for message in chat["messages"]:
            sender = message[0]["sender"]
            text = "\n".join(u["text"] for u in message)
            if turns and turns[-1][0] == sender:
                turns[-1] = (sender, turns[-1][1] + "\n" + text)
            else:
                turns.append((sender, text))
        if len(turns) < min_turns:
            continue
        first = turns[0][0]
        out.append([{"role": "user" if s == first else "assistant", "content": t} for s, t in turns])
    return out


def shared_data_dir(root: str | os.PathLike[str] | None = None) -> Path | None:
    """The ``shared/data`` folder next to the project, or ``None`` when absent.

    Looks in ``root`` if given, else ``../shared/data`` from the working directory, else next to this
    source checkout (``<repo>/../shared/data``, for editable installs).
    """
    if root is not None:
        p = Path(root)
        return p if p.is_dir() else None
    candidates = [Path.cwd().parent / "shared" / "data", Path(__file__).resolve().parents[4] / "shared" / "data"]
    return next((p for p in candidates if p.is_dir()), None)


def shared_data_file(name: str, root: str | os.PathLike[str] | None = None) -> Path:
    """Path of a shared data file by reader name (``"alpaca"``, ``"sharegpt"``, ``"hh-rlhf"``).

    Raises ``FileNotFoundError`` naming where it looked: these files are for benchmarks and tests and are not
    shipped with evenflow.
    """
    if name not in SHARED_FILES:
        raise ValueError(f"unknown shared data set {name!r}; known: {sorted(SHARED_FILES)}")
    folder = shared_data_dir(root)
    looked = Path(root) if root is not None else Path.cwd().parent / "shared" / "data"
    if folder is None or not (folder / SHARED_FILES[name]).is_file():
        where = (folder or looked) / SHARED_FILES[name]
        raise FileNotFoundError(f"{name} data not found at {where}: the ../shared/data/ benchmark files are not "
                                "part of evenflow; run from a checkout that has them, pass --data-dir, or use "
                                "--dataset chitchat (installed with `pip install 'evenflow[demo]'`)")
    return folder / SHARED_FILES[name]


def read_alpaca(path: str | os.PathLike[str]) -> list[Conversation]:
    """Alpaca records (``instruction``, optional ``input``, ``output``, optional ``system``) -> one user turn
    (instruction, blank line, input) and one assistant turn."""
    records = _load_json(path)
    out = []
    for r in records:
        prompt = r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")
        conv = [{"role": "system", "content": r["system"]}] if r.get("system") else []
        conv += [{"role": "user", "content": prompt}, {"role": "assistant", "content": r["output"]}]
        out.append(conv)
    return out


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "function_call": "assistant", "observation": "tool", "tool": "tool", "system": "system"}


def read_sharegpt(path: str | os.PathLike[str]) -> tuple[list[Conversation], list[list[Any] | None]]:
    """ShareGPT records (``conversations`` of ``{"from", "value"}``, optional ``system`` and ``tools``) ->
    ``(conversations, tools)``; ``function_call`` turns are assistant turns, ``observation`` turns tool turns
    (the Qwen3 template wraps those in ``<tool_response>``)."""
    records = _load_json(path)
    convs, tools = [], []
    for i, r in enumerate(records):
        conv = [{"role": "system", "content": r["system"]}] if r.get("system") else []
        for turn in r["conversations"]:
            role = _SHAREGPT_ROLES.get(turn["from"])
            if role is None:
                raise ValueError(f"{path}: record {i} has a turn from {turn['from']!r}; known: "
                                 f"{sorted(_SHAREGPT_ROLES)}")
            conv.append({"role": role, "content": turn["value"]})
        convs.append(conv)
        raw_tools = r.get("tools")
        tools.append(json.loads(raw_tools) if isinstance(raw_tools, str) and raw_tools.strip() else raw_tools)
    return convs, tools


_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")


def read_hh_rlhf(path: str | os.PathLike[str], *, field: str = "chosen") -> list[Conversation]:
    """hh-rlhf JSONL(.gz) records; the ``field`` dialogue (``chosen`` by default) split on its
    ``\\n\\nHuman: `` / ``\\n\\nAssistant: `` markers."""
    opener = gzip.open if str(path).endswith(".gz") else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(split_hh_dialogue(json.loads(line)[field]))
    return out


def split_hh_dialogue(text: str) -> Conversation:
    """``"\\n\\nHuman: hi\\n\\nAssistant: hello"`` -> user "hi", assistant "hello"."""
    parts = _HH_TURN.split(text)
    # parts = [preamble, "Human", text, "Assistant", text, ...]
    return [{"role": "user" if who == "Human" else "assistant", "content": body.strip()}
            for who, body in zip(parts[1::2], parts[2::2])]


def _load_json(path: str | os.PathLike[str]) -> Sequence[dict[str, Any]]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    with open(path, encoding="utf-8") as f:
        return json.load(f)
