"""Moved to benchmarks/planning/bench_packing.py (this stub keeps the old path running)."""
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "planning" / "bench_packing.py"), run_name="__main__")
