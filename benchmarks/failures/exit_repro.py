"""Reproducer of the exit-time aborts (issue 36): 2-rank torchrun jobs that end normally, counted by exit code.

    python benchmarks/failures/exit_repro.py                           # every scenario, 20 runs each
    python benchmarks/failures/exit_repro.py --scenario open-epoch --runs 100
    python benchmarks/failures/exit_repro.py --root /tmp/evenflow-e25  # the library of another checkout

A run aborts when a rank prints ``terminate called without an active exception`` (std::terminate, SIGABRT: the
launcher reports exit code -6). Scenarios (each a job that trains and ends without an error):

* ``open-epoch`` -- the training loop stops at ``max_steps`` with the loader's iterator still held (a module-level
  ``batches = iter(loader)``), and the script ends. The epoch's collation thread and its helper (daemon threads)
  are still running torch ops and gloo exchanges when the interpreter finalizes.
* ``last-exchange`` -- one full epoch, then the script ends at once: the loader's last exchange (the round that
  confirms the end of the epoch) is the job's last collective. The gloo worker threads are made slow to finish
  their work (``SCHED_IDLE`` for the ``pt_gloo_runloop`` threads while ``--hogs`` busy processes keep a core
  busy), so a worker drops the exchange's finished work -- and the tensors whose Python objects torch then frees
  on that thread -- after finalization began, as a loaded machine does now and then.
* ``hf-last-gather`` -- ``DynamicBatchTrainer`` (transformers) on a tiny model, same slowed workers: the job's
  last collective is the Trainer's own (``store_flos``), on the default group.
* ``user-last-allreduce`` -- one evenflow epoch, then the script's own ``all_reduce`` on the default group is the
  job's last collective (slowed workers); ``-plain``: the same job with evenflow never imported (a few
  ``all_reduce`` calls instead of the epoch); ``-destroy``: as the first, with
  ``evenflow.integrations.destroy_process_groups()`` as the script's last line.

Why each aborts, and what evenflow does about it: NOTE [ Exit-time teardown ] in src/evenflow/runtime/teardown.py.
Prints one line per run, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAIN = HERE.parents[1]
SCENARIOS = ("open-epoch", "last-exchange", "hf-last-gather", "user-last-allreduce", "user-last-allreduce-plain",
             "user-last-allreduce-destroy")
USER_LAST = SCENARIOS[3:]


# -- the job (one rank) -------------------------------------------------------------------------------------
def _slow_gloo_workers() -> None:
    """SCHED_IDLE for this process's gloo worker threads (Linux, per thread id): they run only on an idle core, so
    the trainer's thread, woken by a finished collective, preempts the worker before it drops that work."""
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "pt_gloo_runloop":
                    os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass  # a thread that just exited


def _tokens(n: int):
    import torch
    from torch.utils.data import Dataset

    class Tokens(Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> dict:
            ids = torch.full((8 + (i * 37) % 120,), i + 1, dtype=torch.long)
            return {"input_ids": ids, "labels": ids.clone()}

    return Tokens()


def _user_last(scenario: str) -> None:
    """The script's own all_reduce is its last collective (after an evenflow epoch unless ``-plain``)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if scenario.endswith("-plain"):
        for i in range(20):
            dist.all_reduce(torch.ones(64))
            if i == 0:
                _slow_gloo_workers()
    else:
        import evenflow

        loader = evenflow.DynamicBatchLoader(_tokens(256), token_budget=512, buffer_size=32, num_workers=2,
                                             timeout=timedelta(seconds=30), worker_timeout=timedelta(seconds=20))
        for i, batch in enumerate(loader):
            evenflow.pop_step_info(batch)
            if i == 0:
                _slow_gloo_workers()
    total = torch.ones(1)
    dist.all_reduce(total)  # the user's own metric: the job's last collective
    print(f"rank {dist.get_rank()}: trained ({int(total)})", flush=True)
    if scenario.endswith("-destroy"):
        from evenflow.integrations import destroy_process_groups

        destroy_process_groups()


def job(scenario: str) -> None:
    if scenario in USER_LAST:
        return _user_last(scenario)
    from datetime import timedelta

    import torch.distributed as dist

    import evenflow

    if scenario == "hf-last-gather":
        return _hf_job()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    # open-epoch: the dataset and collate_fn run on the collation thread's helper (num_workers=0), as they do
    # for a map-style dataset that is cheap to read.
    loader = evenflow.DynamicBatchLoader(_tokens(256), token_budget=512, buffer_size=32,
                                         num_workers=0 if scenario == "open-epoch" else 2,
                                         timeout=timedelta(seconds=30), worker_timeout=timedelta(seconds=20))
    if scenario == "open-epoch":
        global batches  # the loop's iterator outlives the loop, as in a script's top level
        batches = iter(loader)
        for _ in range(3):  # max_steps = 3
            evenflow.pop_step_info(next(batches))
    else:
        for i, batch in enumerate(loader):
            evenflow.pop_step_info(batch)
            if i == 0:
                _slow_gloo_workers()  # every group's workers exist and are named by now
    print(f"rank {dist.get_rank()}: trained", flush=True)


def _hf_job() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    from evenflow.integrations.hf import DynamicBatchTrainer

    class Slow(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            _slow_gloo_workers()

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    args = TrainingArguments(output_dir="hf_out", use_cpu=True, max_steps=4, logging_steps=2, report_to="none",
                             save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False)
    trainer = DynamicBatchTrainer(model=model, args=args, train_dataset=_tokens(64), token_budget=256,
                                  buffer_size=16, callbacks=[Slow()])
    trainer.train()


# -- the launcher -------------------------------------------------------------------------------------------
def _hog() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def run_once(scenario: str, root: Path, timeout: float) -> dict:
    cwd = tempfile.mkdtemp(prefix="exit-repro-")
    env = dict(os.environ, PYTHONPATH=str(root / "src"), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), "--job", scenario]
    code, out, seconds = launch(cmd, cwd=cwd, env=env, timeout=timeout)
    trained = out.count(": trained") + out.count("train_runtime")
    return dict(scenario=scenario, code=code, aborted="terminate called" in out, trained=trained, seconds=seconds,
                tail=out[-1500:] if code != 0 else "")


def launch(cmd: list[str], *, cwd, env: dict, timeout: float) -> tuple[int | str, str, float]:
    """Run a job in a session of its own, stdout and stderr together; past ``timeout`` its whole process group is
    killed. Returns the exit code (``"timeout"``), the output and the seconds it took."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = "timeout"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return code, out, round(time.monotonic() - start, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("all", *SCENARIOS), default="all")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--root", type=Path, default=MAIN, help="the checkout whose src/ the jobs import")
    parser.add_argument("--hogs", type=int, default=1, help="busy processes while slowed-worker scenarios run")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--job", choices=SCENARIOS, help=argparse.SUPPRESS)  # one rank of a launched job
    cli = parser.parse_args()
    if cli.job:
        return job(cli.job)
    root = cli.root.resolve()
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    summary = {}
    for scenario in SCENARIOS if cli.scenario == "all" else (cli.scenario,):
        hogs = [_hog() for _ in range(cli.hogs)] if scenario != "open-epoch" else []
        try:
            runs = []
            for _ in range(cli.runs):
                r = run_once(scenario, root, cli.timeout)
                runs.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "tail"}), flush=True)
                if r["code"] != 0:
                    print(r["tail"], file=sys.stderr, flush=True)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        summary[scenario] = dict(runs=len(runs), aborted=sum(r["aborted"] for r in runs),
                                 failed=sum(r["code"] != 0 for r in runs),
                                 exit_codes=dict(Counter(str(r["code"]) for r in runs)),
                                 median_s=sorted(r["seconds"] for r in runs)[len(runs) // 2])
    print(json.dumps({"commit": commit, "root": str(root), "scenarios": summary}))


if __name__ == "__main__":
    main()
