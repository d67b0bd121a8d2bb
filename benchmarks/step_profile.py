"""Where EVON's step spends its time: torch.profiler over the step on GPT-2-small block matrices.

GPU (the setting of ``optimizer_step.py``; the gradients are random, the model never runs)::

    python benchmarks/step_profile.py --device cuda

CPU (a 1-layer, 128-wide GPT-2 so it finishes in seconds)::

    python benchmarks/step_profile.py --device cpu

Prints the step's median time with a device sync after it and its host time without one (equal
times mean the host's launches, not the device, set the pace), the profiler's tables sorted by
device and by host time, kernels launched and host syncs (``cudaStreamSynchronize``) per step.

Measured on an H100 (torch 2.11, the 48 matrices, default settings, staggered refresh): 133 ms
per step synced and 134 ms host time; 6,985 kernels and 10.6 stream syncs per step, 47% of the
device time in ``linalg_cholesky_ex`` (the refresh's CholeskyQR3): cuSOLVER's blocked Cholesky
launches hundreds of small kernels per matrix, so the step is bound by launches
(benchmarks/results/gpu_h100/evon_step_profile.log). On an H200 at today's code (each
CholeskyQR pass asks for the lower factor, the staggered refresh's member indices are cached on
the device): 94.4 ms synced, 58.4 ms host time, 1.0 stream sync per step, 34% of the device time
in the Cholesky (benchmarks/results/gpu_h200/step_profile_lower_cholesky.log).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import GPT2Config, GPT2LMHeadModel

from hf_evon import EVON, build_param_groups

sys.path.insert(0, str(Path(__file__).resolve().parent))
from optimizer_step import EVON_SETTINGS  # noqa: E402


def gpt2_block_step(device: str, **settings: object) -> tuple[EVON, Callable[[], None]]:
    """EVON over GPT-2's block matrices (GPT-2 small on CUDA, a 1-layer 128-wide one elsewhere) at
    ``EVON_SETTINGS`` updated by ``settings``, and a function that samples and sets random gradients."""
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")
    cuda = device == "cuda"
    config = GPT2Config(n_positions=1024) if cuda else GPT2Config(n_layer=1, n_embd=128, n_head=2, vocab_size=256)
    model = GPT2LMHeadModel(config).to(device)
    groups = [g for g in build_param_groups(model) if g["algorithm"] == "evon"]
    opt = EVON([{"params": g["params"]} for g in groups], **{**EVON_SETTINGS, **settings})
    params = [p for g in groups for p in g["params"]]

    def sample_and_grad() -> None:
        with opt.sampled_params(train=True):
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3

    return opt, sample_and_grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=10, help="profiled steps (after 12 warm-up and 30 timed)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    opt, sample_and_grad = gpt2_block_step(args.device)
    params = [p for g in opt.param_groups for p in g["params"]]
    for _ in range(12):
        sample_and_grad()
        opt.step()
    synced, host = [], []
    for timed in (synced, host):
        for _ in range(30 if timed is synced else 10):
            sample_and_grad()
            sync()
            t0 = time.perf_counter()
            opt.step()
            if timed is synced:
                sync()
            timed.append(1e3 * (time.perf_counter() - t0))
            sync()
    print(f"{len(params)} matrices on {args.device}")
    print(f"step ms: median {statistics.median(synced):.2f} (synced), host time {statistics.median(host):.2f}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            sample_and_grad()
            opt.step()
        sync()
    table = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(table.table(sort_by=sort, row_limit=14, max_name_column_width=60))
    if cuda:
        print(table.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))
        kernels = sum(e.count for e in table if e.device_type == torch.autograd.DeviceType.CUDA)
        syncs = sum(e.count for e in table if e.key == "cudaStreamSynchronize")
        print(f"per sample + step: {kernels / args.steps:.1f} kernels, {syncs / args.steps:.1f} stream syncs")


if __name__ == "__main__":
    main()
