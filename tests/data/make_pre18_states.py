"""Regenerate ``pre18_states.json``: loader states saved mid-epoch by evenflow at fbdadc2, the planner before
issue 18 (global planning, 2 ranks), and the samples each rank trained before saving.

    git archive fbdadc2 src | tar -x -C /tmp/pre18
    PYTHONPATH=/tmp/pre18/src .venv/bin/python tests/data/make_pre18_states.py

The states are data: ``tests/test_step_composition.py`` resumes them with today's planner.
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _dist import run_world  # noqa: E402
from loader_scenarios import BUDGET, TokenDataset  # noqa: E402

N, STOP = 401, 4


def _save(rank, world):
    import evenflow

    loader = evenflow.DynamicBatchLoader(TokenDataset(N), token_budget=BUDGET, buffer_size=32, seed=7)
    loader.set_epoch(1)
    trained = []
    for step, batch in enumerate(loader, start=1):
        trained += list(evenflow.pop_step_info(batch).sample_ids)
        if step == STOP:  # every rank breaks at the same step: a normal mid-epoch stop
            break
    state = loader.state_dict()
    loader.close()
    return {"trained": trained, "state": state, "planning": loader.planning, "version": evenflow.__version__}


if __name__ == "__main__":
    out = run_world(_save, 2, timeout=300)
    assert all(r["planning"] == "global" for r in out)
    (HERE / "pre18_states.json").write_text(json.dumps({"n": N, "world": 2, "ranks": out}))
    print("wrote", HERE / "pre18_states.json", [len(r["trained"]) for r in out])
