"""Launched by tests/test_loader_dist.py under `torchrun --standalone`: env:// rendezvous, 2 ranks."""

import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

import evenflow
from loader_scenarios import TokenDataset

if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        loader = evenflow.DynamicBatchLoader(TokenDataset(301), token_budget=2048, buffer_size=32, num_workers=1)
        steps, samples = 0, 0
        for batch in loader:
            samples += evenflow.pop_step_info(batch).local_samples
            steps += 1
        loader.close()
        Path(sys.argv[1], f"rank{dist.get_rank()}.txt").write_text(f"{steps} {samples}")
    finally:
        dist.destroy_process_group()
