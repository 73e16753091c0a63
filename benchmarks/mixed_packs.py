"""Moved to benchmarks/planning/mixed_packs.py (this stub keeps the old path running)."""
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "planning" / "mixed_packs.py"), run_name="__main__")
