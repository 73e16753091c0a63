"""Moved to benchmarks/training/quality_replay.py (this stub keeps the old path running)."""
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent / "training" / "quality_replay.py"), run_name="__main__")
