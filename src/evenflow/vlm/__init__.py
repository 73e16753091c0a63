"""OrchMLLM on stock Hugging Face vision-language models: every phase balanced, exact against the stock model.

- base.py     -- the extension point: ``VLMAdapter`` (how a family's items are found, encoded, merged and
                 positioned), ``LLMBatch`` / ``llm_batch`` (packed or padded LLM rows), ``transformer_cost``
- qwen2_vl.py -- ``QwenVLAdapter``: Qwen2-VL and Qwen2.5-VL, images, videos and video time slices
- qwen_omni.py -- ``QwenOmniAdapter``: the Qwen2.5-Omni thinker, its audio tower as a second phase (clips cut at
                 its attention windows), its own audio merge
- qwen3_vl.py -- ``Qwen3VLAdapter``: Qwen3-VL, deepstack rows beside each merged token, videos frame by frame
- families.py -- ``adapter_for``: the known families, found by feature detection
- config.py   -- ``VLMConfig``: layout, balance mode, costs, the per-rank encoder-row cap
- warmup.py   -- ``fit_phase_costs``: a quadratic per phase from a short warm-up on the towers, the same on every
                 rank (the planners' ``TimeCost``), saved with ``BalancedVLM.state_dict``
- checks.py   -- what a step refuses before it trains: replicas nothing synchronizes, a step some ranks skip, a
                 loader with another encoder budget, a batch still holding its StepInfo
- step.py     -- ``BalancedVLM``: the loader's batch in, this rank's scaled loss out
  ([`evenflow.balance.phases`][evenflow.balance.phases]
                 plans, [`evenflow.exchange`][evenflow.exchange] moves the data)
- flops.py    -- FLOPs per item of a phase (the simulator's costs for real model shapes)

Everything a family of your own needs is exported here too (``BalancedVLM(..., adapter=...)``): ``VLMAdapter``,
``LLMBatch``, ``phase_cost``, ``split_examples`` and the orchestrator's types it handles -- ``PhaseSpec``,
``ExampleInputs``, ``LLMInputs``, ``ExampleError`` -- and the loader's ``StepInfo`` that every step takes.

Needs transformers (``pip install 'evenflow[hf]'``). See docs/vlm.md ("Balance a stock VLM"). The tiny models the
tests build from configs are `evenflow.testing.tiny_vlm`, not part of this package.
"""

from ..balance.phases import PhaseSpec
from ..errors import ExampleError
from ..exchange import ExampleInputs, LLMInputs
from ..step_info import StepInfo
from .base import PHASE_LENGTH_KEYS, LLMBatch, VLMAdapter, llm_batch, phase_cost, split_examples, transformer_cost
from .config import VLMConfig
from .families import FAMILIES, adapter_for, unwrap_model
from .qwen2_vl import KIND_IMAGE, KIND_VIDEO, QwenVLAdapter
from .qwen3_vl import Qwen3VLAdapter
from .qwen_omni import QwenOmniAdapter, audio_output_rows
from .step import BalancedVLM, VLMStep
from .warmup import WarmupConfig, cost_from_state, cost_state, fit_phase_costs, time_phases

__all__ = ["VLMAdapter", "LLMBatch", "llm_batch", "split_examples", "transformer_cost", "phase_cost",
           "PHASE_LENGTH_KEYS", "VLMConfig", "FAMILIES", "adapter_for", "unwrap_model", "QwenVLAdapter",
           "QwenOmniAdapter", "Qwen3VLAdapter", "audio_output_rows", "KIND_IMAGE", "KIND_VIDEO", "BalancedVLM",
           "VLMStep", "WarmupConfig", "fit_phase_costs", "time_phases", "cost_state", "cost_from_state",
           "PhaseSpec", "ExampleInputs", "LLMInputs", "ExampleError", "StepInfo"]
