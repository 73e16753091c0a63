"""Run by tests/test_ray_train.py in its own process: examples/ray_train.py on a local Ray bound to loopback.

    ray_job.py OUT

Run 0: 2 workers, stopped at optimizer step 4 (a checkpoint is reported there). Run 1: resumed from that checkpoint
on 3 workers, to the end of epoch 2. Writes OUT/result.json; exit code 3 with ``RAY_CANNOT_START`` when Ray
itself does not start here (the test then skips, naming the reason).
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import ray  # noqa: E402

import ray_train  # noqa: E402

STOP = 4

if __name__ == "__main__":
    out = os.path.abspath(sys.argv[1])
    try:
        # Loopback only: Ray's own addresses, and gloo in its workers (GLOO_SOCKET_IFNAME for the processes Ray
        # starts), never another interface.
        ray.init(_node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False, object_store_memory=200 << 20,
                 runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
                                           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    except Exception as exc:  # noqa: BLE001
        print(f"RAY_CANNOT_START {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    try:
        kw = dict(storage=os.path.join(out, "ray"), log_dir=os.path.join(out, "trained"), n=120, epochs=2)
        first = ray_train.fit(workers=2, run=0, stop_at=STOP, **kw)
        second = ray_train.fit(workers=3, run=1, resume=first.checkpoint.path, **kw)
        result = dict(first=first.metrics, second=second.metrics, stop=STOP,
                      first_error=str(first.error) if first.error else None,
                      second_error=str(second.error) if second.error else None)
        # A file, not stdout: Ray's processes keep logging to the same stream until shutdown.
        Path(out, "result.json").write_text(json.dumps(result))
    finally:
        ray.shutdown()
