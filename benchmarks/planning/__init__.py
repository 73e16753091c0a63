"""Planning benchmarks: planner speed, simulated clusters, packing, step composition, and their experiments."""
