"""Moved to benchmarks/loader/shard_check_sim.py (this stub keeps the old path running)."""
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "loader" / "shard_check_sim.py"), run_name="__main__")
