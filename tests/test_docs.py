"""The README and the documentation site cannot rot: every runnable block runs in a test, the pages cover what
the code defines, and the README stays a page a new user reads in five minutes.

The site itself is built by ``make docs`` (``mkdocs build --strict``, in CI after ``make test``): a broken link,
a missing include or a docstring reference that does not resolve fails it.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from html.parser import HTMLParser
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
    listed = dict(re.findall(r"^\| (.+?) \| `(evenflow/[\w/]+\.py)` \|", (ROOT / "docs" / "design-notes.md").read_text(),
                             re.M))
    defined = _notes_defined()
    assert len(defined) > 40
    assert listed == defined, (f"missing from docs/design-notes.md: {sorted(set(defined) - set(listed))}; listed but not "
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
    # The trainers that balance a VLM: every public class of evenflow.integrations.vlm_trainer, and TRL's.
    from evenflow.integrations import vlm_trainer
    trainers = {f"integrations.vlm_trainer.{n}" for n in vlm_trainer.__all__
                if isinstance(getattr(vlm_trainer, n), type)} | {"integrations.trl.DynamicBatchSFTTrainer"}
    shown = set(re.findall(r"^::: evenflow\.(integrations\.\w+\.\w+)$", page, re.M))
    assert trainers <= shown, f"not on docs/reference/vlm.md: {sorted(trainers - shown)}"


# -- pages for users: the sources and the built site ---------------------------------------------------------------

README_MAX_WORDS = 1200
# A research log's marks: an issue number, a commit hash (7-40 hex digits, at least one digit and one letter, so
# neither a plain number nor a word like "defaced" counts). Their home is benchmarks/results/ (and a changelog).
_ISSUE = re.compile(r"\bissues?\s+#?\d+", re.I)
_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
_ROLE = re.compile(r":(?:class|meth|attr|func):")
_DESIGN = re.compile(r"design(?:-[\w-]+)?\.md$")
_FENCED = re.compile(r"^([ \t]*)(`{3,}).*?^\1\2[ \t]*$", re.S | re.M)
_LINK_SPAN = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\([^)]*\)")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _prose(text: str) -> str:
    """The page without its fenced blocks (verbatim output may print a commit: what the demo ran on), blanked
    rather than cut so that offsets keep their line numbers."""
    return _FENCED.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _history_marks(name: str, text: str, prose: str) -> list[str]:
    found = [f"{name}:{_line(text, m.start())}: {m.group(0)!r}" for m in _ISSUE.finditer(text)]
    return found + [f"{name}:{_line(prose, m.start())}: {m.group(0)!r}" for m in _HASH.finditer(prose)]


def _repo_file(name: str) -> bool:
    """Whether ``name`` (a backticked span) is a path of a file in the repository, relative to its root."""
    if not re.fullmatch(r"[\w.-]+(?:/[\w.-]+)*", name) or ("/" not in name and "." not in name):
        return False
    return (ROOT / name).is_file()


def _unlinked_paths(name: str, text: str) -> list[str]:
    prose = _prose(text)
    inside = [m.span() for m in _LINK_SPAN.finditer(prose)]
    return [f"{name}:{_line(prose, m.start())}: {m.group(1)}" for m in re.finditer(r"`([^`\n]+)`", prose)
            if _repo_file(m.group(1)) and not any(a <= m.start() < b for a, b in inside)]


def test_readme_is_read_in_five_minutes():
    words = len((ROOT / "README.md").read_text().split())
    assert words <= README_MAX_WORDS, f"README.md has {words} words (at most {README_MAX_WORDS}: move detail to docs/)"


def test_pages_carry_no_issue_numbers_or_commit_hashes():
    """Issue numbers and commit hashes are development history: they belong in benchmarks/results/."""
    found = []
    for page in pages():
        text = page.read_text()
        found += _history_marks(_rel(page), text, _prose(text))
    assert not found, "development history on user pages (move it to benchmarks/results/ or say it as a fact): " \
                      + "; ".join(found)


def test_note_pointers_only_on_the_design_pages():
    """A user needs a sentence, not ``NOTE [ X ] in src/...``: the NOTE names are the design pages' index."""
    found = [f"{_rel(p)}:{_line(p.read_text(), m.start())}" for p in pages() if not _DESIGN.search(p.name)
             for m in re.finditer(r"NOTE \[", p.read_text())]
    assert not found, "NOTE pointers outside the design pages (say what it means instead): " + ", ".join(found)


def test_repository_files_named_on_pages_are_links():
    found = [hit for page in pages() for hit in _unlinked_paths(_rel(page), page.read_text())]
    assert not found, "repository files named in backticks without a link (write [`path`](relative/path)): " \
                      + "; ".join(found)


def test_a_path_outside_a_link_is_found():
    text = "Run `examples/vlm_train.py` or [`examples/README.md`](../examples/README.md); `no/such.py`, `x`.\n" \
           "```text\nexamples/vlm_train.py `Makefile`\n```\nfrom commit e25fa43 (issue 19), not 1234567.\n"
    assert _unlinked_paths("p.md", text) == ["p.md:1: examples/vlm_train.py"]
    assert _history_marks("p.md", text, _prose(text)) == ["p.md:5: 'issue 19'", "p.md:5: 'e25fa43'"]


# The built site: once per test session, into a temporary directory (~6 s of CPU).
class _Html(HTMLParser):
    """A page's text outside ``<pre>`` (and the theme's scripts), and each ``<code>`` span outside a link."""

    def __init__(self):
        super().__init__()
        self.text: list[str] = []
        self.unlinked: list[str] = []
        self._pre = self._a = 0
        self._code: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag in ("pre", "script", "style"):
            self._pre += 1
        elif tag == "a":
            self._a += 1
        elif tag == "code" and not self._pre:
            self._code = [] if not self._a else None

    def handle_endtag(self, tag):
        if tag in ("pre", "script", "style"):
            self._pre -= 1
        elif tag == "a":
            self._a -= 1
        elif tag == "code" and self._code is not None:
            self.unlinked.append("".join(self._code))
            self._code = None

    def handle_data(self, data):
        if not self._pre:
            self.text.append(data)
        if self._code is not None:
            self._code.append(data)


@pytest.fixture(scope="module")
def site_html(tmp_path_factory) -> dict[str, str]:
    """Every page of the site as built by ``mkdocs build --strict`` (what ``make docs`` runs), by path; a
    repository file shown verbatim (``repo/``) and the theme's own files left out."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("needs the docs extra: pip install '.[docs]' (make test installs it)")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {rel: path.read_text() for path in sorted(out.rglob("*.html"))
            if not (rel := str(path.relative_to(out))).startswith(("repo/", "assets/")) and rel != "404.html"}


@pytest.fixture(scope="module")
def site(site_html) -> dict[str, _Html]:
    parsed = {}
    for rel, html in site_html.items():
        page = _Html()
        page.feed(html)
        parsed[rel] = page
    return parsed


@pytest.mark.timeout(360)
def test_the_site_shows_no_raw_sphinx_role(site):
    found = [f"{rel}: {len(_ROLE.findall(''.join(p.text)))}" for rel, p in site.items() if _ROLE.search("".join(p.text))]
    assert not found, "raw :class:/:meth:/:attr:/:func: roles on the site (write [Name][evenflow.Name]): " + \
                      ", ".join(found)


@pytest.mark.timeout(360)
def test_the_site_carries_no_issue_numbers_or_commit_hashes(site):
    texts = {rel: "".join(p.text) for rel, p in site.items()}
    found = [hit for rel, text in texts.items() for hit in _history_marks(rel, text, text)]
    assert not found, "development history on the site: " + "; ".join(found[:40])


@pytest.mark.timeout(360)
def test_the_site_links_every_repository_file_it_names(site):
    found = [f"{rel}: {code}" for rel, p in site.items() for code in p.unlinked if _repo_file(code)]
    assert not found, "repository files named on the site without a link: " + "; ".join(found)


@pytest.mark.timeout(360)
def test_the_loader_reference_tables_every_keyword_in_its_seven_groups(site_html):
    """DynamicBatchLoader's keywords read as tables, one per concern of its docstring, and no keyword is missing
    (tools/param_tables.py turns the docstring's bullet lists into them)."""
    import inspect

    import evenflow

    page = site_html["reference/loader/index.html"]
    loader = page.split('id="evenflow.DynamicBatchLoader"', 1)[1].split('class="doc doc-object doc-class"', 1)[0]
    tables = re.findall(r"<table>\s*<thead>\s*<tr>\s*<th>parameter</th>(.*?)</table>", loader, re.S)
    assert len(tables) == 7, f"{len(tables)} parameter tables for DynamicBatchLoader's 7 concerns"
    shown = {name for table in tables for cell in re.findall(r"<tr>\s*<td>(.*?)</td>", table, re.S)
             for name in re.findall(r"<code>(\w+)</code>", cell)}
    keywords = {p.name for p in inspect.signature(evenflow.DynamicBatchLoader).parameters.values()
                if p.kind is not p.VAR_KEYWORD}
    assert shown == keywords, f"missing from the tables: {sorted(keywords - shown)}; not keywords: " \
                              f"{sorted(shown - keywords)}"


def test_parameter_tables_do_what_their_doctest_says():
    import doctest

    spec = importlib.util.spec_from_file_location("param_tables", ROOT / "tools" / "param_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = doctest.testmod(module)
    assert result.attempted and not result.failed, result


def test_the_module_map_names_every_package_and_module():
    text = (ROOT / "docs" / "design.md").read_text()
    module_map = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    names = [p.name for p in sorted((ROOT / "src" / "evenflow").iterdir())
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")]
    missing = [n for n in names if f"src/evenflow/{n}" not in module_map and f"`{n}`" not in module_map]
    assert not missing, f"docs/design.md's module map does not name: {missing}"
