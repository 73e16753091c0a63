"""The code blocks of the README and the documentation site, by name: one mechanism for every page.

A runnable block is tagged with an HTML comment on the line before its fence::

    <!-- snippet: trl -->
    ```python
    ...
    ```

Names are unique across ``README.md`` and ``docs/**/*.md``. Every ``python`` or ``bash`` block on every page
carries a tag, and every tag is run by a test (``tests/test_docs.py`` checks both on the source: a block nobody
runs is a block that can rot). Output and other illustrations use a plain fence or ``text``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = ("python", "bash")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
_TAG = re.compile(r"<!-- snippet: (?P<name>[\w-]+) -->")


@dataclass(frozen=True)
class Snippet:
    name: str | None
    """The tag's name; ``None`` for an untagged block."""
    page: Path
    lang: str
    code: str
    line: int
    """1-based line of the opening fence."""


def pages() -> list[Path]:
    """README.md, then every Markdown page of the documentation site, in a fixed order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[Snippet]:
    """Every fenced block of ``page``, with the tag on the line before it (if any)."""
    text = page.read_text()
    found = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()  # the line before the fence
        tag = _TAG.fullmatch(before)
        indent = m.group("indent")
        code = "\n".join(line.removeprefix(indent) for line in m.group("body").split("\n"))
        found.append(Snippet(tag.group("name") if tag else None, page, m.group("lang"), code,
                             text.count("\n", 0, m.start()) + 1))
    return found


def all_snippets() -> dict[str, Snippet]:
    """Every tagged block of every page by name; a name used twice is an error."""
    out: dict[str, Snippet] = {}
    for page in pages():
        for block in blocks(page):
            if block.name is None:
                continue
            if block.name in out:
                first = out[block.name]
                raise ValueError(f"snippet {block.name!r} is tagged twice: {first.page.relative_to(ROOT)}:"
                                 f"{first.line} and {page.relative_to(ROOT)}:{block.line}")
            out[block.name] = block
    return out


def snippet(name: str) -> str:
    """The code of the block tagged ``<!-- snippet: name -->`` on any page."""
    found = all_snippets().get(name)
    if found is None:
        raise LookupError(f"no page of README.md or docs/ has a snippet {name!r}")
    return found.code


def is_excerpt(code: str, path: Path) -> bool:
    """Whether ``code`` is a contiguous run of lines of the file at ``path``, up to indentation (a page that
    shows part of an example which a test runs whole)."""
    want = [line.strip() for line in code.strip("\n").split("\n")]
    have = [line.strip() for line in path.read_text().split("\n")]
    return any(have[i:i + len(want)] == want for i in range(len(have) - len(want) + 1))
