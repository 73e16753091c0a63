"""Exit codes of whole jobs: every example, and the TRL quick start, launched as a user would, many times.

    python benchmarks/failures/exit_sweep.py                      # 20 runs of each target (about an hour on 2 cores)
    python benchmarks/failures/exit_sweep.py --runs 5 --only ddp_train trl_quickstart
    python benchmarks/failures/exit_sweep.py --root /tmp/evenflow-e25 --report out.md   # another checkout's library

Each target runs as its own job: ``examples/*.py`` under ``torchrun --standalone --nproc-per-node 2`` (Ray under
its own launcher, ``python examples/ray_train.py``) with every ``destroy_process_groups()`` call replaced by
``pass`` (a user does not have to call it), and the TRL quick start (the ``trl`` snippet of the docs) under
torchrun. A run fails when the launcher exits non-zero, when any process printed ``terminate called`` (an abort
at exit), or past ``--timeout``. The library is ``ROOT/src`` (``PYTHONPATH``), the examples ``ROOT/examples``.
Prints one line per run, then one JSON line last; ``--report`` also writes the table as Markdown.
Issue 36: the exit-time aborts this sweep looks for are explained in NOTE [ Exit-time teardown ]
(src/evenflow/runtime/teardown.py) and docs/failures.md, "Exit codes".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.*, <group>.*
from failures.exit_repro import launch  # noqa: E402

HERE = Path(__file__).resolve().parent
MAIN = HERE.parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
# Short runs of each example: the end of a job is what is measured, not its length.
TARGETS = {
    "ddp_train": ["--epochs", "1"],
    "fsdp2_train": ["--epochs", "1"],
    "hf_trainer": ["--max-steps", "6", "--output-dir", "hf_out"],
    "accelerate_train": [],
    "lightning_train": ["--epochs", "1"],
    "mllm_train": ["--samples", "24"],
    "ray_train": ["--workers", "2", "--stop-at", "3", "--storage", "{cwd}/ray_out"],
    "trl_quickstart": [],
}
_CALL = re.compile(r"^(\s*)destroy_process_groups\(\)(\s*#.*)?$", re.M)


def without_destroy(source: str) -> str:
    """``source`` with every bare ``destroy_process_groups()`` statement replaced by ``pass``."""
    return _CALL.sub(lambda m: f"{m.group(1)}pass  # destroy_process_groups() removed by exit_sweep", source)


def prepare(root: Path, work: Path) -> Path:
    """Copy ``root/examples`` into ``work`` without the calls, and write the TRL quick start next to them."""
    dest = work / "examples"
    dest.mkdir(parents=True)
    for path in (root / "examples").glob("*.py"):
        (dest / path.name).write_text(without_destroy(path.read_text()))
    sys.path.insert(0, str(MAIN / "tests"))
    from _snippets import snippet  # the quick start as the docs show it (this checkout's docs)

    # Not trl.py: the script's folder comes first on sys.path, and that name would shadow the trl package.
    (dest / "trl_quickstart.py").write_text(without_destroy(snippet("trl")))
    return dest


def command(name: str, examples: Path, cwd: Path) -> list[str]:
    args = [a.format(cwd=cwd) for a in TARGETS[name]]
    script = str(examples / f"{name}.py")
    return [sys.executable, script, *args] if name == "ray_train" else [*TORCHRUN, script, *args]


def run_once(name: str, examples: Path, root: Path, timeout: float) -> dict:
    cwd = Path(tempfile.mkdtemp(prefix=f"exit-{name}-"))
    env = dict(os.environ, PYTHONPATH=str(root / "src"), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", TOKENIZERS_PARALLELISM="false")
    code, out, seconds = launch(command(name, examples, cwd), cwd=cwd, env=env, timeout=timeout)
    aborts = out.count("terminate called")
    exits = sorted(set(re.findall(r"exitcode\s*:\s*(-?\d+)", out)))  # torchrun's per-rank report
    failed = code != 0 or aborts > 0
    result = dict(target=name, code=code, aborts=aborts, rank_exit_codes=exits, failed=failed, seconds=seconds)
    if failed:
        result["tail"] = out[-3000:]
    shutil.rmtree(cwd, ignore_errors=True)
    return result


def markdown(summary: dict, root: Path) -> str:
    lines = [f"# Exit sweep: {summary['runs']} runs per target ({time.strftime('%Y-%m-%d')})", "",
             f"Library: `{root}/src` at `{summary['commit']}`; {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores; Python {platform.python_version()}; command: `{summary['command']}`.", "",
             "| target | runs | failed | aborts (`terminate called`) | median s |", "|---|---|---|---|---|"]
    for name, t in summary["targets"].items():
        lines.append(f"| {name} | {t['runs']} | {t['failed']} | {t['aborts']} | {t['median_s']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--only", nargs="*", choices=sorted(TARGETS), default=None)
    parser.add_argument("--root", type=Path, default=MAIN, help="the checkout whose src/ and examples/ run")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--report", type=Path, default=None, help="also write the table here (Markdown)")
    cli = parser.parse_args()
    root = cli.root.resolve()
    names = cli.only or list(TARGETS)
    work = Path(tempfile.mkdtemp(prefix="exit-sweep-"))
    examples = prepare(root, work)
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    runs: list[dict] = []
    for name in names:
        for i in range(cli.runs):
            r = run_once(name, examples, root, cli.timeout)
            runs.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "tail"}), flush=True)
            if r["failed"]:
                print(r["tail"], file=sys.stderr, flush=True)
    targets = {}
    for name in names:
        mine = [r for r in runs if r["target"] == name]
        secs = sorted(r["seconds"] for r in mine)
        targets[name] = dict(runs=len(mine), failed=sum(r["failed"] for r in mine),
                             aborts=sum(r["aborts"] > 0 for r in mine), median_s=secs[len(secs) // 2])
    summary = dict(runs=cli.runs, commit=commit, command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                   targets=targets, failures=sum(t["failed"] for t in targets.values()))
    if cli.report is not None:
        cli.report.write_text(markdown(summary, root))
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
