"""The package a user installs: a built wheel in a fresh venv runs ``--version``, ``--help`` and a 2-rank job.

The install commands of docs/install.md run as written, from a clone of a copy of the sources (so the working
tree gets no build/ or egg-info), into a venv made from the base interpreter: ``pip install .``, with extras,
then a wheel built with ``pip wheel`` and installed. Dependencies (torch, numpy, scipy, the extras) are *not*
reinstalled: installing the CPU torch wheel takes ~2 minutes here, so the fresh venv sees the dev
environment's site-packages through a ``.pth`` path entry (which adds
their modules but runs none of their ``.pth`` hooks, so the dev tree's editable evenflow stays invisible), and
the test checks that ``import evenflow`` resolves to the installed wheel and that every ``Requires-Dist`` of
the wheel is satisfied there. ``--help`` / ``--version`` must not import torch (checked by ``sys.modules``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = textwrap.dedent('''
    import json, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    import evenflow

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 37
        def __getitem__(self, i):
            return {"input_ids": torch.arange(2 + i % 9)}

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        loader = evenflow.DynamicBatchLoader(Data(), token_budget=24, timeout=timedelta(seconds=60))
        ids, steps = [], 0
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            evenflow.scale_loss(torch.zeros((), requires_grad=True), info).backward()
            ids += info.sample_ids
            steps += 1
        loader.close()
        with open(sys.argv[1] + f"/rank{dist.get_rank()}.json", "w") as f:
            json.dump({"ids": ids, "steps": steps, "file": evenflow.__file__}, f)
    finally:
        dist.destroy_process_group()
''')


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 240), **kw)
    assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A venv made from the base interpreter that sees the dev environment's packages (see the module doc)."""
    env = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    (Path(purelib) / "evenflow_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env


@pytest.fixture(scope="module")
def wheel(fresh_venv, tmp_path_factory) -> Path:
    """docs/install.md's commands as written, into ``fresh_venv``: a clone of the repository as it stands, ``pip
    install .``, with extras, then a wheel built and installed. pip runs with ``--no-index`` (every requirement
    must already be satisfied, nothing downloads) and without build isolation (the build backend comes from the
    dev environment). Returns the wheel, which is what the venv holds at the end."""
    from _snippets import snippet

    pytest.importorskip("build")
    repo = tmp_path_factory.mktemp("repository")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, repo / name)
    shutil.copytree(ROOT / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    _run(git[:3] + ["init", "-q"])
    _run(git[:3] + ["add", "."])
    _run(git + ["commit", "-qm", "the sources as they stand"])
    script = snippet("install").replace("<the evenflow repository>", str(repo))
    work = tmp_path_factory.mktemp("user")
    pip = f'pip() {{ "{sys.executable}" -m pip --python "{fresh_venv / "bin" / "python"}" "$@"; }}\n'
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_QUIET="1")
    _run(["bash", "-euo", "pipefail", "-c", pip + script], cwd=work, env=env, timeout=600)
    (whl,) = (work / "evenflow" / "dist").glob("evenflow-*.whl")
    return whl


def test_wheel_contents(wheel):
    import evenflow

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(f"evenflow-{evenflow.__version__}.dist-info/METADATA").decode()
        entry = z.read(f"evenflow-{evenflow.__version__}.dist-info/entry_points.txt").decode()
    assert "evenflow/py.typed" in names and "evenflow/integrations/trl.py" in names
    assert f"Version: {evenflow.__version__}" in meta
    assert "evenflow = evenflow.cli:main" in entry
    assert re.search(r"Provides-Extra: trl", meta)


def test_installed_wheel_runs_cli_and_a_two_rank_job(wheel, fresh_venv, tmp_path):
    python, exe = fresh_venv / "bin" / "python", fresh_venv / "bin" / "evenflow"
    import evenflow

    assert _run([str(exe), "--version"]).stdout.strip() == f"evenflow {evenflow.__version__}"
    assert "profile" in _run([str(exe), "--help"]).stdout
    probe = ("import sys, json, importlib.metadata as md, evenflow, evenflow.cli as c\n"
             "try:\n    c.main(['--help'])\nexcept SystemExit:\n    pass\n"
             "reqs = [r for r in md.requires('evenflow') if 'extra ==' not in r]\n"
             "print(json.dumps({'torch': 'torch' in sys.modules, 'file': evenflow.__file__, 'reqs': reqs}))")
    seen = json.loads(_run([str(python), "-c", probe]).stdout.strip().splitlines()[-1])
    assert seen["torch"] is False, "--help imported torch"
    assert seen["file"].startswith(str(fresh_venv)), seen["file"]
    for req in seen["reqs"]:  # the wheel's runtime requirements are importable in that venv
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        _run([str(python), "-c", f"import importlib.metadata as m; m.version({name!r})"])
    (tmp_path / "smoke.py").write_text(SMOKE)
    _run([str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
          str(tmp_path / "smoke.py"), str(tmp_path)], cwd=tmp_path, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["steps"] == ranks[1]["steps"]
    assert sorted(ranks[0]["ids"] + ranks[1]["ids"]) == list(range(37))
    assert all(r["file"].startswith(str(fresh_venv)) for r in ranks)


def test_help_and_version_do_not_import_torch():
    probe = ("import sys\nfrom evenflow import cli\n"
             "for argv in (['--help'], ['--version'], ['profile', '--help']):\n"
             "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
             "print('torch' in sys.modules)")
    out = _run([sys.executable, "-c", probe]).stdout.strip().splitlines()[-1]
    assert out == "False"
    assert importlib.metadata.version("evenflow") is not None
