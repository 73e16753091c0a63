"""Moved to benchmarks/vlm/bench_balance.py (this stub keeps the old path running)."""
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "vlm" / "bench_balance.py"), run_name="__main__")
