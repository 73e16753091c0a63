"""Training benchmarks: real CPU training per batching method, and the held-out-loss replay of what steps train."""
