"""Does a temperature chosen on held-out data carry over? EVON's mean at its defaults on
benchmarks/payoff.py's tasks; a temperature chosen on one half of the calibration split (the whole
grid 0.125-8, the softening half T >= 1, or none) is scored on the other half, both ways, seeds 0
and 1. Validation data only: the test split is not read.

    python benchmarks/temperature_halves.py          # ~10 min on one core

Figures: docs/trainer.md#calibration-temperature.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import payoff  # noqa: E402

from hf_evon import build_optimizer  # noqa: E402
from hf_evon.predictive.calibration import SOFTENING_TEMPERATURES, TEMPERATURE_GRID  # noqa: E402

TASKS = ["digits", "breast_cancer", "wine", "noisy_digits", "minilm_lora"]


def nll(lp: torch.Tensor, y: torch.Tensor, t: float) -> float:
    return float(F.cross_entropy(lp / t, y))


def main() -> None:
    torch.set_num_threads(1)
    for name in TASKS:
        run(name)


def run(name: str) -> None:
    res: dict[str, list[float]] = {"full": [], "soft": [], "none": []}
    for seed in (0, 1):
        task = payoff.make_task(name, seed, False)
        model = task.make_model(seed)
        opt = build_optimizer(model, learning_rate=task.adamw_lr, seed=seed)
        payoff.train(task, model, opt, seed, sampled=functools.partial(opt.sampled_params, train=True))
        lp, y = payoff.log_probs(model, task.cal, task.shift)
        n = len(y)
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        halves = [idx[: n // 2], idx[n // 2 :]]
        for a, b in (halves, halves[::-1]):
            for key, grid in (("full", TEMPERATURE_GRID), ("soft", SOFTENING_TEMPERATURES), ("none", (1.0,))):
                t = min(grid, key=lambda t: nll(lp[a], y[a], t))
                res[key].append(nll(lp[b], y[b], t))
    mean = {k: round(sum(v) / len(v), 4) for k, v in res.items()}
    print(f"{name}: held-out-half NLL {mean} ({n} calibration targets)", flush=True)


if __name__ == "__main__":
    main()
