"""Does a temperature chosen on held-out data carry over? EVON's mean at its defaults on
benchmarks/payoff.py's tasks; a temperature chosen on one half of the calibration split is scored on
the other half, both ways, seeds 0 and 1. Chosen by: the least NLL on the whole grid 0.125-8
("full"), on the softening half T >= 1 ("soft"), none ("none"), calibrate_posterior's rule
(``mean_temperature_choice``: softening where it beats T = 1 by ``DEFAULT_STANDARD_ERRORS`` standard
errors, sharpening where
the split has enough errors and a cross-validation within it agrees; "rule"), and that rule without
sharpening ("rule_soft"). Validation data only: the test split is not read.

    python benchmarks/temperature_halves.py          # ~10-15 min on one core
    python benchmarks/temperature_halves.py --tasks wine minilm_lora

Figures: docs/trainer.md#calibration-temperature.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import payoff_tasks  # noqa: E402
import payoff_training  # noqa: E402

from hf_evon.predictive.calibration import (  # noqa: E402
    DEFAULT_MIN_GAIN,
    DEFAULT_STANDARD_ERRORS,
    SOFTENING_TEMPERATURES,
    TEMPERATURE_GRID,
    mean_temperature_choice,
)
from hf_evon.predictive.held_out import tempered_log_probs  # noqa: E402

TASKS = ["digits", "breast_cancer", "wine", "noisy_digits", "tiny_gpt2", "minilm_lora", "minilm_noisy_lora"]


def nll(lp: torch.Tensor, y: torch.Tensor, t: float) -> float:
    return float(F.cross_entropy(lp / t, y))


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=TASKS)
    torch.set_num_threads(1)
    for name in ap.parse_args().tasks:
        run(name)


def run(name: str) -> None:
    res: dict[str, list[float]] = {"full": [], "soft": [], "none": [], "rule": [], "rule_soft": []}
    one = TEMPERATURE_GRID.index(1.0)
    for seed in (0, 1):
        task = payoff_tasks.make_task(name, seed, False, development=True)
        model = task.make_model(seed)
        payoff_training.train_evon(task, model, seed)
        lp, y = payoff_training.log_probs(model, task.cal, task.shift)
        n = len(y)
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        halves = [idx[: n // 2], idx[n // 2 :]]
        for a, b in (halves, halves[::-1]):
            for key, grid in (("full", TEMPERATURE_GRID), ("soft", SOFTENING_TEMPERATURES), ("none", (1.0,))):
                t = min(grid, key=lambda t: nll(lp[a], y[a], t))
                res[key].append(nll(lp[b], y[b], t))
            # log p(y) per temperature, [T, targets], as calibrate_posterior scores the mean
            per_t = tempered_log_probs(lp[a], y[a], False, TEMPERATURE_GRID)
            choice = mean_temperature_choice(per_t, DEFAULT_STANDARD_ERRORS, DEFAULT_MIN_GAIN)
            res["rule"].append(nll(lp[b], y[b], TEMPERATURE_GRID[choice]))
            res["rule_soft"].append(nll(lp[b], y[b], TEMPERATURE_GRID[max(choice, one)]))
    mean = {k: round(sum(v) / len(v), 4) for k, v in res.items()}
    print(f"{name}: held-out-half NLL {mean} ({n} calibration targets)", flush=True)


if __name__ == "__main__":
    main()
