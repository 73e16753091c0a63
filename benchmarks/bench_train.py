"""Moved to benchmarks/training/bench_train.py (this stub keeps the old path running)."""
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "training" / "bench_train.py"), run_name="__main__")
