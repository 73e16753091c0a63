"""The user's own data for ``evenflow profile``: JSONL/JSON, Parquet or a saved HF ``datasets`` folder.

Record shapes understood (the common fine-tuning formats), each rendered through the user's tokenizer and
its chat template (a local folder; nothing is downloaded):

    {"messages": [{"role": "user", "content": ...}, ...]}               OpenAI / TRL conversational
    {"conversations": [{"from": "human", "value": ...}, ...]}           ShareGPT
    {"instruction": ..., "input": ..., "output": ...}                    alpaca
    {"prompt": [...] or str, "completion": [...] or str}                 TRL prompt-completion
    {"text": ...}                                                        plain language modelling
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from .deps import require

__all__ = ["load_records", "to_messages", "TokenizedRecords"]

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "function_call": "assistant", "observation": "tool", "tool": "tool"}


def load_records(path: str | Path) -> list[dict]:
    """All records of a ``.jsonl``/``.json``/``.parquet`` file, or of a folder saved by ``datasets``
    (``save_to_disk``) or holding such files."""
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            require("datasets", "reading a saved Hugging Face dataset folder")
            import datasets

            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
            return [dict(r) for r in loaded]
        files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json", ".parquet"))
        if not files:
            raise FileNotFoundError(f"{path} holds no .jsonl/.json/.parquet file and is not a saved datasets folder")
        return [r for f in files for r in load_records(f)]
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    if path.suffix == ".parquet":
        require("pyarrow", "reading Parquet files")
        import pyarrow.parquet as pq

        return pq.read_table(str(path)).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), start=1):  # editors count lines from 1
            if line.strip():
                records.append(_parse(line, path, number))
        return records
    data = _parse(text, path, None)
    if isinstance(data, Mapping):
        data = data.get("data", data.get("train"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of records (or {{'data': [...]}})")
    return data


def _parse(text: str, path: Path, line: int | None) -> object:
    """``json.loads`` whose error names the file and the line an editor shows (``line``: a JSONL line number)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"{path}:{line}" if line is not None else f"{path}:{exc.lineno}"
        raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); fix or remove that "
                         f"{'line' if line is not None else 'part'} of the file") from None


def _message_list(value: object) -> list[dict] | None:
    if isinstance(value, str):
        return None
    return [{"role": m["role"], "content": m["content"]} for m in value]


def to_messages(record: Mapping) -> list[dict] | str:
    """Chat messages for a record of one of the module's shapes, or plain text for ``{"text": ...}``."""
    if "messages" in record:
        return _message_list(record["messages"])
    if "conversations" in record:
        return [{"role": _SHAREGPT_ROLES.get(m.get("from", m.get("role")), "user"),
                 "content": m.get("value", m.get("content", ""))} for m in record["conversations"]]
    if "instruction" in record and "output" in record:
        prompt = record["instruction"] + (("\n" + record["input"]) if record.get("input") else "")
        messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
        return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return _message_list(prompt) + _message_list(completion)
    if "text" in record:
        return str(record["text"])
    raise ValueError(f"record with keys {sorted(record)} has none of the known shapes (messages, conversations, "
                     "instruction/output, prompt/completion, text)")


class TokenizedRecords:
    """Map-style view: ``{"input_ids": [...]}`` of each record through a local tokenizer and its chat template."""

    def __init__(self, records: Sequence[Mapping], tokenizer_dir: str | Path, *, chat_template: str | None = None):
        require("transformers", "tokenizing your data")
        from transformers import AutoTokenizer

        self.records = records
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        self.chat_template = chat_template

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        content = to_messages(self.records[i])
        if isinstance(content, str):
            ids = self.tokenizer(content)["input_ids"]
        else:
            ids = self.tokenizer.apply_chat_template(content, tokenize=True, chat_template=self.chat_template,
                                                     return_dict=True)["input_ids"]
        return {"input_ids": list(ids)}
