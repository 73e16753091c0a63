"""Moved to benchmarks/failures/soak.py (this stub keeps the old path running)."""
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "failures" / "soak.py"), run_name="__main__")
