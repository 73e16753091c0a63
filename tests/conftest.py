import sys
from pathlib import Path

# Test helpers (tests/_dist.py, tests/loader_scenarios.py) must be importable by spawned ranks too.
sys.path.insert(0, str(Path(__file__).parent))
