"""What keeping the posterior as trained costs where no noise scale beats the mean: ``calibrate_posterior``
with ``keep_trained=True`` (the default) against ``keep_trained=False`` (the mean), per task and seed.

``benchmarks/payoff.py``'s tasks and EVON at its defaults (``payoff_training.train_evon``), trained
once per seed and calibrated both ways on the task's calibration split (8 samples, the library's
defaults otherwise). The rule reads the calibration split only; the test split scores both choices
(``payoff.calibrated_bma``: BMA@``--samples`` at the chosen scale and temperature, seeds 0 to
S − 1, as payoff.py's rows; the mean at its temperature), so a reader
sees whether what the rule accepted on validation data carries over. One JSON line per run: the
mean's temperature, whether the trained posterior was kept, the calibration-split NLL of the mean
and of the trained posterior (at the temperature the rule scored it at), their difference in
standard errors, and the test NLL of each rule's choice. It reads the test split (an after-the-fact
check of ``keep_trained``, which was chosen with it: docs/defaults.md#what-saw-the-test-splits); a new
choice is made on validation halves (``calibration_halves.py``), not here.

    python benchmarks/calibration_keep_trained.py --seeds 2            # payoff's tabular tasks, ~2 min
    python benchmarks/calibration_keep_trained.py --tasks tiny_gpt2 --seeds 2

Measured (``--tasks digits breast_cancer wine iris noisy_digits noisy_iris noisy_wine tiny_gpt2
--seeds 2``, one thread, ~4 minutes): the trained posterior kept on 13 of 16 runs, its
calibration-split NLL −0.38% to +0.13% of the mean's; the tiny GPT-2's seed 1 keeps the mean
(+0.012%, beyond a standard error); two noisy runs choose a noise scale under both rules. Test NLL
of the kept posterior's BMA@32 against the mean's: −0.30% to +0.60%, mean +0.01%
(docs/trainer.md#calibration-keep-trained).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import payoff  # noqa: E402  (its calibrated BMA on the test split, the rows' own)
import payoff_tasks  # noqa: E402
import payoff_training  # noqa: E402

from hf_evon import EVONPosterior, calibrate_posterior  # noqa: E402

TASKS = ("digits", "breast_cancer", "wine", "iris", "noisy_digits", "noisy_iris", "noisy_wine")
SAMPLE_SEED = 1000  # the calibration's weight draws, as payoff.py's: apart from the training seeds


def run(name: str, seed: int, samples: int, fast: bool) -> dict[str, Any]:
    task = payoff_tasks.make_task(name, seed, fast)
    model = task.make_model(seed)
    posterior = EVONPosterior.from_optimizer(payoff_training.train_evon(task, model, seed), model)
    cal = payoff_tasks.as_calibration_batches(task.cal)
    mean = payoff_training.log_probs(model, task.test, task.shift)
    row: dict[str, Any] = {"task": name, "seed": seed}
    for keep in (True, False):
        chosen, result = calibrate_posterior(model, posterior, cal, seed=SAMPLE_SEED + seed, keep_trained=keep)
        if keep:
            row.update(
                mean_temperature=result.mean_temperature,
                scanned=result.scanned,
                kept_trained=result.kept_trained,
                cal_mean_nll=result.tempered_mean_nll or result.mean_nll,
                cal_trained_nll=result.trained_nll,
                multiplier=result.multiplier,
                temperature=result.temperature,
            )
        bma = payoff.calibrated_bma(task, model, chosen, mean, [samples])[samples]
        row["test_keep" if keep else "test_mean_rule"] = float(-bma.gather(1, mean[1][:, None]).mean())
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--samples", type=int, default=32, help="BMA samples on the test split")
    parser.add_argument("--fast", action="store_true", help="payoff's fast sizes: a smoke test, not a measurement")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.tasks:
        for seed in range(args.seeds):
            rows.append(run(name, seed, args.samples, args.fast))
            print(json.dumps(rows[-1]), flush=True)
    kept = [r for r in rows if r["kept_trained"]]
    if kept:
        change = [r["test_keep"] / r["test_mean_rule"] - 1 for r in kept]
        print(
            f"kept the posterior as trained in {len(kept)} of {len(rows)} runs; test NLL against the mean's, "
            f"relative: mean {statistics.fmean(change):+.5f}, range {min(change):+.5f} to {max(change):+.5f}"
        )
    return rows


if __name__ == "__main__":
    main()
