"""The simulated setting of ``bench_sim.py``, shared with the report that describes it (``report.py``).

Its own module so that the report can name the setting without importing the benchmark that imports the report.
"""

from __future__ import annotations

WORLD = 8
BUDGET = 16_384
CUTOFF = 8_192
PAPER_SPEEDUP = {"ultrachat": 1.77, "llava": 1.73, "sharegpt4o": 2.46, "mmmix": 4.43}
"""ODB paper, 8B model on 8 x H20, over fixed batching (MM-Mix: 4.43x on its production mix)."""
PAPER_SORTED = {"sharegpt4o": 1.03}
OURS = ("evenflow_local", "evenflow_balanced", "evenflow_global")
"""The package's padded policies: ``oracle_ratio`` is the best of these over the (padded) offline oracle."""
MAIN_ORDER = ("standard", "sorted", "oracle", "packing", "odb_buf256", "odb_buf1024", "evenflow_local",
              "evenflow_balanced", "evenflow_global", "evenflow_local_summed", "proposal_time_balanced")
ABLATION_SET = "sharegpt4o"
"""The data set whose lengths the ablations run on."""
