"""Measure one training step's peak memory in this (fresh) process; print one JSON line. Used by test_budget.py.

    python tests/budget_probe.py '{"model_type": "llama", ...config...}' TOKENS [checkpointing]
CPU: peak RSS (``ru_maxrss``) over a forward+backward at TOKENS tokens, minus the resident memory just before
it (weights, gradients and AdamW state already allocated by a warm-up step); the static part is the byte count
of those tensors (RSS would also hold what model construction freed but the allocator kept).
"""

import json
import resource
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak() -> int:
    """Peak resident memory since the process started, or since :func:`reset_peak` succeeded."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def reset_peak() -> None:
    """Reset the peak (writing 5 to /proc/self/clear_refs, Linux >= 4.0), so that the measured step's peak is
    not hidden by model construction's; where the kernel refuses, the caller's validity check still holds."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def step(model, opt, tokens: int, vocab: int) -> None:
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # keep gradients allocated: they are part of the static memory


def main(config_json: str, tokens: int, checkpointing: bool) -> None:
    spec = json.loads(config_json)
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(0)
    before_model = resident()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, opt, 8, config.vocab_size)  # allocates gradients and both AdamW moments
    # Static memory, exactly: the bytes of every weight, gradient and optimizer-state tensor.
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    static = sum(t.numel() * t.element_size() for t in [*model.parameters(), *state]) + \
        sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    reset_peak()
    base, earlier_peak = resident(), peak()
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    model(input_ids=ids, labels=ids).loss.backward()
    # Peak RSS of the forward+backward over the resident memory just before it. Valid only if that peak is
    # above any earlier peak (model construction), which the caller checks: after a reset the earlier peak is
    # the resident memory itself (a few pages apart); without one it is model construction's, and the kernel
    # may have dropped file pages from the resident set since (another job's memory pressure), which a reset
    # makes irrelevant.
    print(json.dumps({"static": static, "activations": peak() - base, "earlier_peak": earlier_peak - base,
                      "params": sum(p.numel() for p in model.parameters())}))

if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), len(sys.argv) > 3 and sys.argv[3] == "checkpointing")
