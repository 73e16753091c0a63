"""Moved to benchmarks/loader/bench_gloo.py (this stub keeps the old path running)."""
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "loader" / "bench_gloo.py"), run_name="__main__")
