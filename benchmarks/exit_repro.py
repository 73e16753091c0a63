"""Moved to benchmarks/failures/exit_repro.py (this stub keeps the old path running)."""
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "failures" / "exit_repro.py"), run_name="__main__")
