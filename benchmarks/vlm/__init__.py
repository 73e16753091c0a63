"""Multimodal benchmarks: cross-rank post-balancing, the tiny MLLM and stock VLMs per phase, simulated at scale."""
