"""Helpers the benchmarks share: process worlds (world), baselines, real lengths, the report and its setting."""
