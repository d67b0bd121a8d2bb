"""What EVON's step must cost on a CPU: its matmul FLOPs against this machine's matmul speed.

Issue 32 asks a whole ``EVONTrainer`` run to take at most 1.5× ``Trainer`` + AdamW's time. This
measures, per training step of ``benchmarks/payoff.py``'s models (one training batch, one thread),
what EVON adds to an AdamW step and how much of that the maths alone must take:

* the time of a whole AdamW step (forward, backward, ``torch.optim.AdamW(fused=True)``) and of a
  whole EVON step (the sampled forward/backward, ``step()``), mean over two refresh cycles;
* EVON's extra matmul FLOPs per step (``optimizer_flops.flop_counter`` over the next two cycles,
  the sampled block's and ``step()``'s, less AdamW's forward/backward; the refresh's QR and the
  whitening's eigh, LAPACK calls, are not counted, so the floor is a lower bound);
* this machine's float32 matmul speed at the model's width (GFLOP/s of a square product);
* the floor: AdamW's step plus EVON's extra FLOPs at that speed, as a multiple of AdamW's step.
  A ratio target below the floor cannot be met by any implementation of the same maths.

    python benchmarks/step_floor.py                     # mlp, tiny_gpt2, minilm_full (~4 min)
    python benchmarks/step_floor.py --tasks mlp

Measured (one run, one thread, the shared 2-core machine: single steps vary by ±5 ms on the
GPT-2; steps 13-32 timed, the next 20 counted):

    | model       | AdamW step ms | EVON step ms | ratio | extra GFLOP | GFLOP/s | extra ms | floor |
    | mlp         |           0.9 |         12.6 | 14.74 |       0.778 |      91 |      8.6 | 11.04 |
    | tiny_gpt2   |          72.4 |        101.0 |  1.40 |       1.896 |      95 |     20.0 |  1.28 |
    | minilm_full |         914.7 |       2376.5 |  2.60 |     107.939 |     103 |   1049.4 |  2.15 |

Figures: docs/results.md#speed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import optimizer_flops  # noqa: E402
import payoff_tasks  # noqa: E402

from hf_evon import build_optimizer  # noqa: E402

# name -> (payoff.py's task, the width whose square product sets the matmul speed)
TASKS = {"mlp": ("digits", 256), "tiny_gpt2": ("tiny_gpt2", 128), "minilm_full": ("minilm_full", 384)}
WARMUP = 12  # past the first step's initialisation and the first refresh
TIMED = 20  # two refresh cycles of 10 updates


def matmul_gflops(width: int, repeats: int = 20) -> float:
    """This machine's float32 speed on a ``width``-square product (one thread)."""
    a, b = torch.randn(width, width), torch.randn(width, width)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * width**3 * repeats / (time.perf_counter() - start) / 1e9


def train_step(task: payoff_tasks.Task, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any) -> None:
    """One step as payoff.py trains: EVON's forward/backward inside a training sample."""
    sample = opt.sampled_params(train=True) if hasattr(opt, "sampled_params") else contextlib.nullcontext()
    with sample:
        payoff_tasks.loss_of(model, batch, task.shift).backward()
    opt.step()
    opt.zero_grad()


def measure(name: str) -> dict[str, float]:
    task_name, width = TASKS[name]
    task = payoff_tasks.make_task(task_name, 0, False)
    batch = task.train[0]
    out: dict[str, float] = {"gflops_per_s": matmul_gflops(width)}
    for kind in ("adamw", "evon"):
        model = task.make_model(0)
        model.train()
        if kind == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=task.adamw_lr, fused=True)
        else:
            opt = build_optimizer(model, learning_rate=task.adamw_lr, seed=0)
        for _ in range(WARMUP):
            train_step(task, model, opt, batch)
        seconds = []
        for _ in range(TIMED):
            start = time.process_time()
            train_step(task, model, opt, batch)
            seconds.append(time.process_time() - start)
        with optimizer_flops.flop_counter() as counter:  # apart: the counter's dispatch costs time
            for _ in range(TIMED):
                train_step(task, model, opt, batch)
        out[f"{kind}_ms"] = 1e3 * statistics.fmean(seconds)  # whole cycles: the refreshes included
        out[f"{kind}_gflop"] = counter.get_total_flops() / TIMED / 1e9
    extra = out["evon_gflop"] - out["adamw_gflop"]
    out["extra_gflop"] = extra
    out["extra_ms_at_peak"] = 1e3 * extra / out["gflops_per_s"]
    out["ratio"] = out["evon_ms"] / out["adamw_ms"]
    out["floor_ratio"] = (out["adamw_ms"] + out["extra_ms_at_peak"]) / out["adamw_ms"]
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| model | AdamW step ms | EVON step ms | ratio | EVON's extra matmul GFLOP | matmul GFLOP/s here | "
          "extra ms at that speed | floor ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for name in args.tasks:
        r = results[name] = measure(name)
        print(
            f"| {name} | {r['adamw_ms']:.1f} | {r['evon_ms']:.1f} | {r['ratio']:.2f} | {r['extra_gflop']:.3f} | "
            f"{r['gflops_per_s']:.0f} | {r['extra_ms_at_peak']:.1f} | {r['floor_ratio']:.2f} |",
            flush=True,
        )
    return results


if __name__ == "__main__":
    main()
