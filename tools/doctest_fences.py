"""A griffe extension for the documentation site: docstring doctests rendered as code.

The package's docstrings show their data as doctests (``>>>`` lines and the output under them), which Markdown
would otherwise run together as a paragraph and read ``[[0, 2], [1, 3]]`` as a link. This wraps each doctest
block in a ``pycon`` fence; the docstrings themselves stay plain (pytest runs them with ``--doctest-modules``).
"""

from __future__ import annotations

import griffe


def fence_doctests(text: str) -> str:
    """Each run of lines from a ``>>>`` line to the next blank line, fenced.

    >>> print(fence_doctests("Deal it.\\n\\n>>> 1 + 1\\n2\\n\\nDone."))
    Deal it.
    <BLANKLINE>
    ```pycon
    >>> 1 + 1
    2
    ```
    <BLANKLINE>
    Done.
    """
    out: list[str] = []
    inside = False
    for line in text.split("\n"):
        if not inside and line.lstrip().startswith(">>>"):
            out.append("```pycon")
            inside = True
        elif inside and not line.strip():
            out.append("```")
            inside = False
        out.append(line)
    if inside:
        out.append("```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
