"""The README and the documentation site cannot rot: every runnable block runs in a test, the pages cover what
the code defines, and the README stays a page a new user reads in five minutes.

The site itself is built by ``make docs`` (``mkdocs build --strict``, in CI after ``make test``): a broken link,
a missing include or a docstring reference that does not resolve fails it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _snippets import ROOT, RUNNABLE, all_snippets, blocks, pages

TESTS = Path(__file__).resolve().parent
README_MAX_LINES = 250


def _test_sources() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(TESTS.glob("*.py")) if p.name not in ("_snippets.py", "test_docs.py")}


def test_every_runnable_block_on_every_page_is_tagged():
    untagged = [f"{b.page.relative_to(ROOT)}:{b.line} ({b.lang})" for page in pages() for b in blocks(page)
                if b.lang in RUNNABLE and b.name is None]
    assert not untagged, ("these python/bash blocks have no `<!-- snippet: name -->` tag on the line before them "
                          "(tag them and run them in a test, or show output in a plain fence): " + ", ".join(untagged))


def test_every_tagged_block_is_run_by_a_test():
    """A test runs a snippet by name (``snippet("name")``); a name no test file mentions next to ``_snippets``
    is a block nobody runs."""
    users = {p: src for p, src in _test_sources().items() if "_snippets" in src}
    idle = [f"{s.name} ({s.page.relative_to(ROOT)}:{s.line})" for s in all_snippets().values()
            if not any(re.search(rf"""["']{re.escape(s.name)}["']""", src) for src in users.values())]
    assert not idle, "snippets no test runs: " + ", ".join(idle)


def test_pages_and_readme_are_the_ones_the_site_builds():
    nav = (ROOT / "mkdocs.yml").read_text()
    docs = ROOT / "docs"
    listed = set(re.findall(r"([\w/-]+\.md)\s*$", nav, re.M))
    on_disk = {str(p.relative_to(docs)) for p in docs.rglob("*.md")}
    assert on_disk == listed, f"pages not in mkdocs.yml's nav: {sorted(on_disk - listed)}; in the nav but missing: " \
                              f"{sorted(listed - on_disk)}"
    for page in pages():  # what a page includes from the README exists there (mkdocs --strict checks it too)
        for section in re.findall(r'--8<-- "README.md:(\w+)"', page.read_text()):
            assert f"--8<-- [start:{section}]" in (ROOT / "README.md").read_text(), (page, section)


def test_readme_is_a_users_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for heading in ("## Install", "## Quick start", "## Two commands", "## Integrations", "## Guarantees",
                    "## Figures", "## Documentation"):
        assert heading in text, heading
    figures = text.split("## Figures", 1)[1].split("\n## ", 1)[0]
    assert 1 <= len([r for r in figures.splitlines() if r.startswith("| ") and "---" not in r]) - 1 <= 10
    assert "pip install evenflow" not in text  # not on the index: install from the repository
    for target in re.findall(r"\]\(((?:docs|examples|benchmarks)/[^)#]+)", text):
        assert (ROOT / target).exists(), f"the README links to {target}, which does not exist"


def _notes_defined() -> dict[str, str]:
    found = {}
    for path in sorted((ROOT / "src" / "evenflow").rglob("*.py")):
        for m in re.finditer(r"^\s*(?:# )?NOTE \[ (.+?) \]\s*$", path.read_text(), re.M):
            found[m.group(1)] = str(path.relative_to(ROOT / "src"))
    return found


def test_the_design_page_lists_every_note_where_it_is_defined():
    listed = dict(re.findall(r"^\| (.+?) \| `(evenflow/[\w/]+\.py)` \|", (ROOT / "docs" / "design.md").read_text(),
                             re.M))
    defined = _notes_defined()
    assert len(defined) > 40
    assert listed == defined, (f"missing from docs/design.md: {sorted(set(defined) - set(listed))}; listed but not "
                               f"defined (or elsewhere): {sorted(k for k in listed if defined.get(k) != listed[k])}")


@pytest.mark.parametrize("name", ["fsdp2", "plain", "accelerate"])
def test_snippet_lookup_names_the_page(name):
    s = all_snippets()[name]
    assert s.page.suffix == ".md" and s.code.strip() and s.lang == "python"


def test_a_block_without_a_tag_is_found(tmp_path, monkeypatch):
    import _snippets

    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("x\n\n<!-- snippet: a -->\n```python\nprint(1)\n```\n\n```bash\nls\n```\n")
    (tmp_path / "docs" / "p.md").write_text("```text\nout\n```\n<!-- snippet: a -->\n```bash\nls\n```\n")
    monkeypatch.setattr(_snippets, "ROOT", tmp_path)
    found = [(b.name, b.lang) for p in _snippets.pages() for b in _snippets.blocks(p)]
    assert found == [("a", "python"), (None, "bash"), (None, "text"), ("a", "bash")]
    with pytest.raises(ValueError, match="tagged twice"):
        _snippets.all_snippets()


def test_the_api_reference_lists_every_public_vlm_name():
    from evenflow import vlm
    page = (ROOT / "docs" / "reference" / "vlm.md").read_text()
    listed = set(re.findall(r"^::: evenflow\.vlm\.(\w+)$", page, re.M))
    assert listed == set(vlm.__all__), f"not on docs/reference/vlm.md: {sorted(set(vlm.__all__) - listed)}"
