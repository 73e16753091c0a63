"""An MkDocs hook: a repository file that a page links to opens on the site.

The repository has no public address to point ``repo_url`` at, so the site carries the files its pages name.
A page links a repository file with a plain relative path (``[`examples/vlm_train.py`](../examples/vlm_train.py)``),
which works in a clone and on any Git host; here every such link to a file outside ``docs/`` is pointed at a
page of its own under ``repo/`` that shows the file's text (kept out of search and out of the nav), and an
image is copied as it is. A link to a file that does not exist is left alone, so ``--strict`` still fails on it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "repo/"
IMAGES = (".png", ".jpg", ".jpeg", ".svg", ".gif")
LANG = {".py": "python", ".md": "markdown", ".toml": "toml", ".yml": "yaml", ".yaml": "yaml", ".json": "json",
        ".jsonl": "json", ".txt": "text", ".sh": "bash", ".cfg": "ini"}
_LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")


def _target(page_uri: str, href: str, docs: Path) -> str | None:
    """The repository path (``examples/x.py``) a page's relative link names outside docs/, or ``None``."""
    if "://" in href or href.startswith(("/", "mailto:")):
        return None
    path = (docs / posixpath.dirname(page_uri) / href).resolve()
    try:
        rel = path.relative_to(ROOT)
    except ValueError:
        return None
    if rel.parts and rel.parts[0] == docs.name or not path.is_file():
        return None
    return rel.as_posix()


def _site_uri(rel: str) -> str:
    return PREFIX + rel if rel.endswith(IMAGES) else PREFIX + rel + ".md"


def _page(rel: str) -> str:
    text = (ROOT / rel).read_text(errors="replace")
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    # A line that is only a snippet marker would be read by pymdownx.snippets as an include: shown, not run.
    text = re.sub(r"^(\s*)(-+8<-+)", lambda m: m.group(1) + "\u200b" + m.group(2), text, flags=re.M)
    lang = LANG.get(Path(rel).suffix, "text")
    return f"---\nsearch:\n  exclude: true\n---\n\n# `{rel}`\n\n{fence}{lang}\n{text}\n{fence}\n"


def on_files(files: Files, config) -> Files:
    docs = Path(config["docs_dir"]).resolve()
    wanted: set[str] = set()
    for page in docs.rglob("*.md"):
        uri = page.relative_to(docs).as_posix()
        for m in _LINK.finditer(page.read_text()):
            rel = _target(uri, m.group(2), docs)
            if rel is not None:
                wanted.add(rel)
    for rel in sorted(wanted):
        content = (ROOT / rel).read_bytes() if rel.endswith(IMAGES) else _page(rel)
        files.append(File.generated(config, _site_uri(rel), content=content,
                                    inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs = Path(config["docs_dir"]).resolve()
    uri = page.file.src_uri
    if uri.startswith(PREFIX):
        return markdown

    def point(m: re.Match) -> str:
        rel = _target(uri, m.group(2), docs)
        if rel is None:
            return m.group(0)
        return m.group(1) + posixpath.relpath(_site_uri(rel), posixpath.dirname(uri) or ".") + m.group(3)

    return _LINK.sub(point, markdown)
