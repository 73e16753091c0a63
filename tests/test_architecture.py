"""Architecture rules, checked on the source (docs/style.md): public torch APIs only, no environment writes,
and ``__all__`` names only things that exist.

Private torch modules or names (``torch.utils.data._utils``, ``_MultiProcessingDataLoaderIter``,
``torch.distributed.distributed_c10d._...``, ``torch.testing._internal``) change without notice between torch
releases; the existing ODB package broke on exactly that. Writing ``os.environ`` changes the behaviour of the
user's whole process (and of every library in it) behind their back.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import evenflow

PACKAGE = Path(evenflow.__file__).resolve().parent
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def private_torch_uses(source: str) -> list[str]:
    """Every import of, or attribute access into, a private part of torch. Follows import aliases."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> dotted torch path it stands for
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    if any(_private(p) for p in a.name.split(".")):
                        found.append(f"line {node.lineno}: import {a.name}")
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "torch":
                for a in node.names:
                    path = f"{node.module}.{a.name}"
                    if any(_private(p) for p in path.split(".")):
                        found.append(f"line {node.lineno}: from {node.module} import {a.name}")
                    aliases[a.asname or a.name] = path
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = []
            inner = node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in aliases:
                path = ".".join([aliases[inner.id]] + parts[::-1])
                if any(_private(p) for p in parts):
                    found.append(f"line {node.lineno}: {path}")
    return sorted(set(found))


def environ_writes(source: str) -> list[str]:
    """Assignments, deletions and mutating calls on ``os.environ`` (or ``environ`` from os), and putenv."""
    tree = ast.parse(source)
    environ_names = {"environ"} if any(isinstance(n, ast.ImportFrom) and n.module == "os" and
                                       any(a.name == "environ" for a in n.names) for n in ast.walk(tree)) else set()

    def is_environ(expr: ast.AST) -> bool:
        if isinstance(expr, ast.Attribute) and expr.attr == "environ":
            return isinstance(expr.value, ast.Name) and expr.value.id == "os"
        return isinstance(expr, ast.Name) and expr.id in environ_names

    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if (isinstance(t, ast.Subscript) and is_environ(t.value)) or is_environ(t):
                found.append(f"line {node.lineno}: writes os.environ")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_environ(node.func.value) and node.func.attr in {"update", "setdefault", "pop", "popitem",
                                                                   "clear", "__setitem__", "__delitem__"}:
                found.append(f"line {node.lineno}: os.environ.{node.func.attr}(...)")
            if (isinstance(node.func.value, ast.Name) and node.func.value.id == "os"
                    and node.func.attr in {"putenv", "unsetenv"}):
                found.append(f"line {node.lineno}: os.{node.func.attr}(...)")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_torch(path):
    assert private_torch_uses(path.read_text()) == [], f"{path} uses private torch internals"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_environment_writes(path):
    assert environ_writes(path.read_text()) == [], f"{path} writes the process environment"


@pytest.mark.parametrize("snippet", [
    "from torch.utils.data._utils.collate import default_collate",
    "from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter",
    "import torch.utils.data._utils as u",
    "import torch\nx = torch.utils.data._utils.worker",
    "import torch.distributed as dist\ndist.distributed_c10d._world.group_count = 0",
    "from torch.distributed import distributed_c10d as c\nc._get_default_group()",
    "import torch.testing._internal.common_distributed",
    "from torch.testing import _internal",
])
def test_private_torch_detector_catches(snippet):
    assert private_torch_uses(snippet)


@pytest.mark.parametrize("snippet", [
    "import torch\nimport torch.distributed as dist\ndist.all_gather_object([], 1)\ntorch.__version__",
    "from torch.utils.data import DataLoader, get_worker_info",
    "import torch\nx = torch.utils.data.Sampler",
])
def test_private_torch_detector_allows_public(snippet):
    assert private_torch_uses(snippet) == []


@pytest.mark.parametrize("snippet", [
    "import os\nos.environ['MASTER_PORT'] = '0'",
    "import os\nos.environ.update(A='1')",
    "import os\nos.environ.setdefault('A', '1')",
    "import os\ndel os.environ['A']",
    "import os\nos.environ.pop('A', None)",
    "import os\nos.putenv('A', '1')",
    "from os import environ\nenviron['A'] = '1'",
])
def test_environ_detector_catches(snippet):
    assert environ_writes(snippet)


def test_environ_detector_allows_reads():
    assert environ_writes("import os\nr = os.environ.get('RANK')\nw = os.environ['WORLD_SIZE']") == []


# -- __all__ ---------------------------------------------------------------------------------------------------


def test_top_level_all_names_exist():
    assert len(evenflow.__all__) == len(set(evenflow.__all__)), "duplicate names in evenflow.__all__"
    missing = [name for name in evenflow.__all__ if not hasattr(evenflow, name)]
    assert missing == [], f"evenflow.__all__ names missing attributes: {missing}"
    assert "plan_groups" in evenflow.__all__  # the public contract of issue 2


def _static_all(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None


def _defined_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


@pytest.mark.parametrize("path", [p for p in SOURCES if _static_all(ast.parse(p.read_text())) is not None],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_all_names_something_defined(path):
    tree = ast.parse(path.read_text())
    names = _static_all(tree)
    assert len(names) == len(set(names)), f"duplicates in {path} __all__"
    assert sorted(set(names) - _defined_names(tree)) == [], f"{path}: __all__ names things it never defines"


def test_planning_all_resolves():
    planning = importlib.import_module("evenflow.planning")
    assert [n for n in planning.__all__ if not hasattr(planning, n)] == []
