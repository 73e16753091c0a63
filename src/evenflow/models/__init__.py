"""Tiny models for tests and benchmarks (random init, CPU; never downloads weights)."""

from .mllm_step import PhaseTimes, StepResult, orchestrated_step
from .tiny_mllm import (TinyMLLM, TinyMLLMConfig, TokenFold, example_from_sample, make_examples, orchestrator_config,
                        real_media_config, split_rows)

__all__ = ["TinyMLLM", "TinyMLLMConfig", "TokenFold", "example_from_sample", "make_examples", "orchestrator_config",
           "real_media_config", "split_rows", "PhaseTimes", "StepResult", "orchestrated_step"]
