"""Issue 20 item 5: Ray Train (``evenflow[ray]``) -- a run on 2 workers checkpointed through ``ray.train.report``,
resumed by ``TorchTrainer(resume_from_checkpoint=...)`` on 3 workers: every sample trained exactly once.

tests/ray_job.py runs examples/ray_train.py in its own process and session (Ray starts many processes: on a
timeout the whole session is stopped) with a local Ray bound to loopback (``_node_ip_address="127.0.0.1"``,
``num_cpus=4``, ``GLOO_SOCKET_IFNAME=lo`` for the processes Ray starts), workers at 0.5 CPU each. Skipped only
when ray is not installed or Ray itself cannot start here, with the reason.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _dist import run_session

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="needs the 'ray' extra: pip install 'evenflow[ray]'")]

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 240


def test_ray_train_resumes_a_two_worker_checkpoint_on_three_workers_exactly_once(tmp_path):
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: Ray keeps 127.0.0.1 as the node address (on Linux it otherwise
    # replaces it with the routable one, and Ray Train would give that to torch.distributed as MASTER_ADDR).
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "examples"),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = run_session([sys.executable, str(ROOT / "tests" / "ray_job.py"), str(tmp_path)], timeout=DEADLINE_S,
                       what="the Ray job", stderr=subprocess.STDOUT, env=env)
    output = proc.stdout
    if proc.returncode == 3 and "RAY_CANNOT_START" in output:
        pytest.skip("Ray cannot start on this machine: " + output.split("RAY_CANNOT_START", 1)[1].strip()[:500])
    assert proc.returncode == 0, output[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["first_error"] is None and result["second_error"] is None, result
    logs = collections.defaultdict(list)
    for path in (tmp_path / "trained").glob("run*-rank*-of*.jsonl"):
        run, world = int(path.name[3]), int(path.name.rsplit("-of", 1)[1].split(".")[0])
        logs[(run, world)] += [json.loads(line) for line in path.read_text().splitlines()]
    assert set(logs) == {(0, 2), (1, 3)}, sorted(logs)  # 2 workers, then 3 (files: one per worker)
    assert len(list((tmp_path / "trained").glob("run1-*"))) == 3
    assert max(r["step"] for r in logs[(0, 2)]) < result["stop"] <= min(r["step"] for r in logs[(1, 3)])
    for epoch in (0, 1):
        ids = [i for rows in logs.values() for r in rows if r["epoch"] == epoch for i in r["ids"]]
        counts = collections.Counter(ids)
        assert sorted(counts) == list(range(120)) and set(counts.values()) == {1}, (
            f"epoch {epoch}: duplicated {[i for i, c in counts.items() if c > 1][:10]}, "
            f"missing {sorted(set(range(120)) - set(counts))[:10]}")
    assert result["second"]["epoch"] == 1


def test_the_docs_ray_blocks_are_excerpts_of_the_example_this_file_runs():
    from _snippets import is_excerpt, snippet

    for name in ("ray-resume", "ray-report"):
        assert is_excerpt(snippet(name), ROOT / "examples" / "ray_train.py"), name
    assert not is_excerpt(snippet("ray-resume").replace("resume_epoch", "resumed_epoch"),
                          ROOT / "examples" / "ray_train.py")
