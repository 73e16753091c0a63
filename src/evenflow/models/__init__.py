"""Tiny models for tests and benchmarks (random init, CPU; never downloads weights).

``evenflow.models.hf_vlm`` -- stock Hugging Face VLMs (Qwen2-VL, Qwen2.5-VL) balanced per phase -- is imported by
name (it needs transformers: ``pip install 'evenflow[hf]'``).
"""

from .mllm_step import PhaseTimes, StepResult, orchestrated_step
from .tiny_mllm import (TinyMLLM, TinyMLLMConfig, TokenFold, example_from_sample, make_examples, orchestrator_config,
                        real_media_config, split_rows)

__all__ = ["TinyMLLM", "TinyMLLMConfig", "TokenFold", "example_from_sample", "make_examples", "orchestrator_config",
           "real_media_config", "split_rows", "PhaseTimes", "StepResult", "orchestrated_step"]
