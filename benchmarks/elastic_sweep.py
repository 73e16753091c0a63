"""Moved to benchmarks/failures/elastic_sweep.py (this stub keeps the old path running)."""
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "failures" / "elastic_sweep.py"), run_name="__main__")
