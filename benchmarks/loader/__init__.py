"""Loader benchmarks: batch quality and data-path overhead, metadata exchange, samples moved, the shard check."""
