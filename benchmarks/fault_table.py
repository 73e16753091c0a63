"""Moved to benchmarks/failures/fault_table.py (this stub keeps the old path running)."""
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "failures" / "fault_table.py"), run_name="__main__")
