"""Test helpers: tiny models built from configs for the tests, the benchmarks and the examples (random init, CPU,
never a download). Not the product: a model you train comes from Hugging Face, balanced by
[`evenflow.vlm`][evenflow.vlm].

- tiny_mllm.py -- ``TinyMLLM``: a small vision + audio + LLM model, float64-capable, and its orchestrator config
- mllm_step.py -- ``orchestrated_step``: one balanced step of it, with per-phase CPU times
- tiny_vlm.py  -- tiny stock Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Omni thinker from their configs, and a dense
                  vocabulary for them (imported by name: it needs transformers)
"""

from .mllm_step import PhaseTimes, StepResult, orchestrated_step
from .tiny_mllm import (TinyMLLM, TinyMLLMConfig, TokenFold, example_from_sample, make_examples, orchestrator_config,
                        real_media_config, split_rows)

__all__ = ["TinyMLLM", "TinyMLLMConfig", "TokenFold", "example_from_sample", "make_examples", "orchestrator_config",
           "real_media_config", "split_rows", "PhaseTimes", "StepResult", "orchestrated_step"]
