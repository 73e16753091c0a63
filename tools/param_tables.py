"""A griffe extension for the documentation site: a docstring's list of parameters rendered as a table.

``DynamicBatchLoader`` documents its many keywords in groups, one bullet each (``- ``name``: what it does``), under
a line naming the group ("*The epoch*:"); Sphinx-style ``:param:`` fields would lose the groups. On the site each
such list becomes a table -- parameter, default (read off the signature), what -- under its group's line, so the
reference reads as the docstring is organized. A list is converted only when every bullet opens with names of the
object's own parameters; any other list stays a list. The docstrings themselves stay as they are.
"""

from __future__ import annotations

import re

import griffe

_BULLET = re.compile(r"- (?P<names>``\w+``(?:(?:, | / | or | and )``\w+``)*): (?P<what>.*)")
_NAME = re.compile(r"``(\w+)``")


def _cell(text: str) -> str:
    """``text`` safe in a table cell: a pipe outside a code span would end the cell."""
    parts = re.split(r"(``.*?``|`[^`]*`)", text)
    return "".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def _items(lines: list[str]) -> list[tuple[str, str]] | None:
    """A bullet list's items as (names, what), or None when a line is neither a bullet nor its continuation."""
    items: list[list[str]] = []
    for line in lines:
        if line.startswith("- "):
            items.append([line])
        elif line.startswith("  ") and items:
            items[-1].append(line.strip())
        else:
            return None
    out = []
    for item in items:
        m = _BULLET.fullmatch(" ".join(item))
        if m is None:
            return None
        out.append((m.group("names"), m.group("what")))
    return out


def parameter_tables(text: str, defaults: dict[str, str | None]) -> str:
    """Each run of bullet lines whose items all open with names in ``defaults`` (a parameter's default as
    source, ``None`` when required), as a table.

    >>> print(parameter_tables("*Size*:\\n\\n- ``a``: the first\\n  one.\\n- ``b``, ``c``: more | less\\n\\nEnd.",
    ...                        {"a": None, "b": "0", "c": "'x'"}))
    *Size*:
    <BLANKLINE>
    | parameter | default | what |
    |---|---|---|
    | ``a`` | required | the first one. |
    | ``b``, ``c`` | `0`, `'x'` | more \\| less |
    <BLANKLINE>
    End.
    """
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("- "):
            out.append(lines[i])
            i += 1
            continue
        j = i
        while j < len(lines) and (lines[j].startswith("- ") or (lines[j].startswith("  ") and lines[j].strip())):
            j += 1
        items = _items(lines[i:j])
        if items is None or not all(n in defaults for names, _ in items for n in _NAME.findall(names)):
            out.extend(lines[i:j])
        else:
            out += ["| parameter | default | what |", "|---|---|---|"]
            for names, what in items:
                shown = [defaults[n] for n in _NAME.findall(names)]
                default = ", ".join("required" if d is None else f"`{d}`" for d in shown)
                out.append(f"| {names} | {_cell(default)} | {_cell(what)} |")
        i = j
    return "\n".join(out)


class ParameterTables(griffe.Extension):
    def on_class_members(self, *, cls: griffe.Class, **kwargs: object) -> None:
        init = cls.members.get("__init__")
        if cls.docstring is None or not isinstance(init, griffe.Function) or "\n- ``" not in cls.docstring.value:
            return
        defaults = {p.name: None if p.default is None else str(p.default) for p in init.parameters
                    if p.name not in ("self",) and p.kind not in (griffe.ParameterKind.var_keyword,
                                                                   griffe.ParameterKind.var_positional)}
        cls.docstring.value = parameter_tables(cls.docstring.value, defaults)
