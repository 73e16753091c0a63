"""A trainer error passed to ``close(exc)`` is reported *with* its stop, never as a bare STOP.

Found by CI (tests/test_faults.py, ``close_exc``, once in ~30 runs): the collation thread read the trainer's error
at the start of a round and its stop flag a moment later, so a ``close(exc)`` landing in between published
STOP without the error, and the peers raised PeerStopped instead of PeerError. Here the close is made to land
in that window every time: the planner pauses inside the round until the trainer has closed the loader.
"""

from __future__ import annotations

import threading
import time

import evenflow
from evenflow.planning.alignment import RankPlanner, RankReport
from evenflow.runtime import collator
from evenflow.runtime.loader import loader as loader_module

from loader_scenarios import BUDGET, TokenDataset


def test_close_with_an_error_mid_round_reports_the_error_with_the_stop(monkeypatch):
    armed, window_open, closing = threading.Event(), threading.Event(), threading.Event()
    reports: list[RankReport] = []

    class PausingPlanner(RankPlanner):
        def plan_local(self):
            if armed.is_set() and not window_open.is_set():
                window_open.set()  # the round already read this rank's failure state: hold it here
                closing.wait(30)
                time.sleep(0.3)  # let close(exc) record the stop and the error
            return super().plan_local()

    def recording_decide(table, alignment):
        reports.extend(RankReport.from_array(row) for row in table)
        return decide_round(table, alignment)

    decide_round = collator.decide_round
    monkeypatch.setattr(loader_module, "RankPlanner", PausingPlanner)
    monkeypatch.setattr(collator, "decide_round", recording_decide)

    loader = evenflow.DynamicBatchLoader(TokenDataset(300), token_budget=BUDGET, buffer_size=16, shuffle=False)
    for batch in loader:
        evenflow.pop_step_info(batch)
        armed.set()
        assert window_open.wait(30), "the next round never started"
        closing.set()
        loader.close(ZeroDivisionError("injected trainer failure"))
        break

    stops = [r for r in reports if r.stop]
    assert stops, reports
    assert all(r.error for r in stops), f"a STOP was published without the trainer's error: {stops}"
