"""Moved to benchmarks/loader/bench_shard_check.py (this stub keeps the old path running)."""
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "loader" / "bench_shard_check.py"), run_name="__main__")
