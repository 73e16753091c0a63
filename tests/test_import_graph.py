"""Every import in ``src/evenflow`` points down the stated order of layers, and there are no import cycles in
``src/evenflow`` or ``benchmarks/``, read from the source.

The order is :data:`LAYERS` here and the module map of ``docs/design.md`` (a test checks that the two agree).

Every ``import`` statement counts wherever it stands: at module level, inside a function (a deferred import
still ties the two modules together; it only hides the cycle until the function runs), and inside ``if
TYPE_CHECKING:`` blocks (a type-only import is a design dependency too, and the cheapest to break: pass a small
object instead, or move the shared type to a module both can import). What is not counted: the implicit import
of a module's parent packages (``import a.b.c`` runs ``a/__init__`` and ``a/b/__init__``; a package's
``__init__`` that re-exports its submodules would otherwise close a trivial loop with each of them), and
``importlib.import_module`` with a computed name (``evenflow.__getattr__``'s lazy exports).

Edges go from a module to the module a statement loads: ``from .x import y`` loads ``x`` (or ``x.y`` when that is
a module of its own), ``from . import y`` loads the package's ``y``. ``benchmarks/`` scripts import each other by
bare name (``sys.path`` holds their folder), so a bare ``import name`` resolves to ``benchmarks/name.py`` where
that file exists.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, tuple[str, ...]]] = [  # bottom to top: (floor, the top-level packages or modules on it)
    ("ground", ("errors", "step_info", "quadratic", "lr", "memory", "deprecation")),
    ("planning", ("planning",)),
    ("balance", ("balance",)),
    ("data", ("data",)),
    ("sim", ("sim",)),
    ("exchange", ("exchange",)),
    ("runtime", ("runtime",)),
    ("vlm", ("vlm",)),
    ("integrations", ("integrations",)),
    ("api", ("evenflow",)),
    ("testing", ("testing",)),
    ("demo", ("demo",)),
    ("cli", ("cli",)),
]
"""A module may import from its own floor and from any floor below it, never from one above. The old import
paths that forward to a moved module (``evenflow.models``, ``evenflow.balance.orchestrator``, ...) import only
``evenflow.deprecation`` (ground), by name at first use, so they sit on any floor without an arrow upwards."""

OLD_PATHS = ("evenflow.models", "evenflow.balance.orchestrator", "evenflow.balance.dispatch", "evenflow.runtime.faults",
             "evenflow.runtime.step_info")
"""Modules kept only so that old imports work (a ``DeprecationWarning`` names the new home)."""


def _modules(root: Path, prefix: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root`` (a package's name is its ``__init__``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([prefix, *parts] if prefix else parts)] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def import_graph(roots: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over every tree of ``roots`` (``{prefix: folder}``; prefix ``""`` for a
    folder of scripts that import each other by bare name)."""
    modules: dict[str, Path] = {}
    for prefix, folder in roots.items():
        modules.update(_modules(folder, prefix))
    graph: dict[str, set[str]] = {name: set() for name in modules}

    def resolve(name: str) -> str | None:
        while name and name not in modules:  # `import a.b.c` where only a.b is ours: the deepest that is
            name = name.rpartition(".")[0]
        return name or None

    for name, path in modules.items():
        package = name if _is_package(path) else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # `from m import y` loads m.y when y is a module of its own, else m.
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
            for target in targets:
                found = resolve(target)
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each a set of modules that import each
    other, directly or through the others), sorted."""
    names = sorted(graph)
    index = {n: i for i, n in enumerate(names)}
    rows = [index[a] for a in names for b in graph[a]]
    cols = [index[b] for a in names for b in graph[a]]
    adjacency = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(names), len(names)))
    _, labels = connected_components(adjacency, directed=True, connection="strong")
    groups: dict[int, list[str]] = {}
    for n, label in zip(names, labels):
        groups.setdefault(int(label), []).append(n)
    return sorted(g for g in groups.values() if len(g) > 1)


def _edges_within(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    return [f"{a} -> {b}" for a in group for b in sorted(graph[a]) if b in group]


def top_level(module: str, package: str = "evenflow") -> str:
    """The top-level package or module of ``package`` that ``module`` is in (``package`` itself for its root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else package


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, tuple[str, ...]]],
                   package: str = "evenflow") -> list[str]:
    """Every import whose target sits on a higher floor than the importer, as ``"a (floor) -> b (floor)"``;
    a module on no floor is reported too, so a new package must be given one."""
    floor = {name: i for i, (_, names) in enumerate(layers) for name in names}
    found = []
    for a in sorted(graph):
        if top_level(a, package) not in floor:
            found.append(f"{a} is on no floor: add {top_level(a, package)!r} to LAYERS and docs/design.md")
            continue
        for b in sorted(graph[a]):
            fa, fb = floor[top_level(a, package)], floor.get(top_level(b, package), -1)
            if fb > fa:
                found.append(f"{a} ({layers[fa][0]}) -> {b} ({layers[fb][0]})")
    return found


def package_graph(graph: dict[str, set[str]], package: str = "evenflow") -> dict[str, set[str]]:
    """The graph of top-level packages: an edge wherever one of a package's modules imports another's."""
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(top_level(a, package), set()).update(
            top_level(b, package) for b in targets if top_level(b, package) != top_level(a, package))
    return out


def _package_graph_without_old_paths() -> tuple[dict[str, set[str]], dict[str, Path]]:
    modules = _modules(ROOT / "src" / "evenflow", "evenflow")
    graph = import_graph({"evenflow": ROOT / "src" / "evenflow"})
    return {a: b for a, b in graph.items() if not a.startswith(OLD_PATHS)}, modules


def test_every_import_points_down_the_layers():
    graph, _ = _package_graph_without_old_paths()
    floors = [name for _, names in LAYERS for name in names]
    assert len(floors) == len(set(floors))
    assert not upward_imports(graph, LAYERS), "imports that run up the layers (move the shared piece down, or " \
        "pass it in from above):\n  " + "\n  ".join(upward_imports(graph, LAYERS))
    packages = package_graph(graph)
    assert "exchange" in packages["runtime"] and "balance" in packages["sim"]  # the graph was read
    assert cycles(packages) == []


def test_old_import_paths_only_forward():
    """An old path is one line that forwards by name: it may import nothing of evenflow but the forwarder (an
    import of its new home would be an arrow up from, e.g., ``balance`` to ``exchange``)."""
    graph = import_graph({"evenflow": ROOT / "src" / "evenflow"})
    modules = _modules(ROOT / "src" / "evenflow", "evenflow")
    old = sorted(name for name in graph if name.startswith(OLD_PATHS))
    assert len(old) == 23
    for name in old:
        assert graph[name] == {"evenflow.deprecation"}, (name, graph[name])
        assert "__getattr__ = moved(__name__, " in modules[name].read_text()


def test_a_planted_upward_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "a.py").write_text("from ..low import b\n")
    (pkg / "low" / "b.py").write_text("X = 1\n")
    layers = [("low", ("low",)), ("high", ("high",)), ("api", ("pkg",))]
    assert upward_imports(import_graph({"pkg": pkg}), layers, "pkg") == []
    for planted in ("from ..high import a\n",  # module level
                    "def f():\n    from ..high.a import g\n",  # deferred
                    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.high.a\n"):  # type-only
        (pkg / "low" / "c.py").write_text(planted)
        assert upward_imports(import_graph({"pkg": pkg}), layers, "pkg") == ["pkg.low.c (low) -> pkg.high.a (high)"]
    (pkg / "low" / "c.py").write_text("from .. import high\n")
    assert upward_imports(import_graph({"pkg": pkg}), layers, "pkg") == ["pkg.low.c (low) -> pkg.high (high)"]
    (pkg / "new").mkdir()
    (pkg / "new" / "__init__.py").write_text("")
    assert "pkg.new is on no floor" in upward_imports(import_graph({"pkg": pkg}), layers, "pkg")[-1]


def test_design_page_states_the_same_layers():
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("<!-- layers -->")[1]
    rows = [line for line in block.splitlines() if line.startswith("| ") and not line.startswith("| floor")]
    stated = [(row.split("|")[1].strip(), tuple(sorted(n.strip(" `") for n in row.split("|")[2].split(","))))
              for row in rows]
    assert stated == [(name, tuple(sorted(names))) for name, names in reversed(LAYERS)]


def test_no_import_cycles_in_the_package_or_the_benchmarks():
    graph = import_graph({"evenflow": ROOT / "src" / "evenflow", "": ROOT / "benchmarks"})
    assert len(graph) > 100  # the whole package was read
    assert "evenflow.runtime.loader.loader" in graph["evenflow.runtime.loader"]
    found = cycles(graph)
    assert not found, "import cycles (break each by moving the shared piece to a module both import):\n" + \
        "\n".join("  " + ", ".join(_edges_within(graph, g)) for g in found)


def test_a_planted_cycle_is_found_including_deferred_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .sub import b\nA = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import C\n    return C\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\nC = 2\n")
    (pkg / "d.py").write_text("import pkg.c\nfrom . import a\n")
    graph = import_graph({"pkg": pkg})
    assert graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.d"] == {"pkg.c", "pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (pkg / "c.py").write_text("C = 2\n")  # the type-only import removed: no cycle left
    assert cycles(import_graph({"pkg": pkg})) == []


def test_scripts_that_import_each_other_by_bare_name(tmp_path):
    (tmp_path / "bench_x.py").write_text("def main():\n    from report import table\n")
    (tmp_path / "report.py").write_text("from bench_x import main\n")
    assert cycles(import_graph({"": tmp_path})) == [["bench_x", "report"]]
