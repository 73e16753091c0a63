"""Failure benchmarks: the soak, elastic resume sweep, fault table, and exit-time reproducers."""
