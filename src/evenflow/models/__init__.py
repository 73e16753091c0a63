"""Tiny models for tests and benchmarks (random init, CPU; never downloads weights)."""

from .tiny_mllm import TinyMLLM, TinyMLLMConfig, make_examples, orchestrator_config

__all__ = ["TinyMLLM", "TinyMLLMConfig", "make_examples", "orchestrator_config"]
