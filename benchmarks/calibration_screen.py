"""What the calibration's screen saves, and whether it changes a choice: ``calibrate_posterior`` at
its defaults (``screen_factor`` 2.5) against ``screen_factor=0`` (every scale scored), per task
and seed.

The tasks are those where the scan runs (EVON's mean overconfident on the calibration split):
payoff's ``noisy_digits`` and examples/paper/table2_finetune.py's noisy MiniLM tasks (30 training
texts per class, 30% of every split's labels random, 20 epochs; ``<task>/lora`` or ``/full``),
EVON at ``build_optimizer``'s defaults (``payoff_training.train_evon``), calibrated on the task's
calibration split with payoff's seed. Per run it prints one JSON line: the training's seconds and,
per rule, the passes over the calibration split (a forward hook counts them), the seconds, the
choice (multiplier of the trained ζ, temperature), its calibration-split NLL and the scales
screened out; where the two rules choose differently, each choice's test BMA@8 NLL. It reads the
test split (an after-the-fact check of ``SCREEN_FACTOR``, which was chosen with it:
docs/defaults.md#what-saw-the-test-splits); a new choice is made on validation halves
(``calibration_halves.py``), not here.

    python benchmarks/calibration_screen.py --tasks noisy_digits docstring_topic/lora --seeds 0 1 --jobs 2

Figures: docs/trainer.md#calibration-screen.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples", "paper"))
import payoff  # noqa: E402
import payoff_tasks  # noqa: E402
import payoff_training  # noqa: E402
import table2_finetune as t2  # noqa: E402

from hf_evon import EVONPosterior  # noqa: E402
from hf_evon.predictive.calibration import calibrate_posterior  # noqa: E402

RULES = {"screened": None, "every scale": 0.0}  # rule -> screen_factor (None: the default)
TASKS = t2.task_names(False)  # noisy_digits and every <text task>/<lora|full>


def make_task(name: str, seed: int) -> payoff_tasks.Task:
    """Table 2's task on the CPU (its texts built only for a text task)."""
    data = {} if name == "noisy_digits" else t2.text_data([name.split("/")[0]])
    return t2.make_task(name, seed, False, data, "cpu")


def run(name: str, seed: int) -> dict[str, Any]:
    task = make_task(name, seed)
    model = task.make_model(seed)
    start = time.perf_counter()
    opt = payoff_training.train_evon(task, model, seed)
    row: dict[str, Any] = {"task": name, "seed": seed, "train_seconds": time.perf_counter() - start}
    posterior = EVONPosterior.from_optimizer(opt, model)
    batches = payoff_tasks.as_calibration_batches(task.cal)
    calls: list[int] = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    chosen = {}
    for rule, factor in RULES.items():
        calls.clear()
        start = time.perf_counter()
        calibrated, result = calibrate_posterior(
            model, posterior, batches, shift_labels=task.shift, seed=1000 + seed, screen_factor=factor
        )
        row[rule] = {
            "seconds": time.perf_counter() - start,
            "passes": len(calls) / len(batches),
            "multiplier": result.multiplier,
            "temperature": result.temperature,
            "calibration_nll": result.chosen_nll,
            "screened": [s / result.trained_ess for s in result.screened],
            "mean_temperature": result.mean_temperature,
        }
        chosen[rule] = calibrated
    hook.remove()
    a, b = (row[r] for r in RULES)
    if (a["multiplier"], a["temperature"]) != (b["multiplier"], b["temperature"]):
        mean = payoff_training.log_probs(model, task.test, task.shift)
        for rule, calibrated in chosen.items():
            logp = payoff.calibrated_bma(task, model, calibrated, mean, [8])[8]
            row[rule]["test_nll"] = payoff_training.scores(logp, mean[1])["nll"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # t2.make_task takes any variant but "lora" for full fine-tuning: a name is checked here, before any run
    ap.add_argument("--tasks", nargs="+", default=["noisy_digits", "docstring_topic/lora"], choices=TASKS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    rows = payoff.print_rows(run, args.tasks, args.seeds, args.jobs)
    same = sum((r["screened"]["multiplier"], r["screened"]["temperature"]) == (
        r["every scale"]["multiplier"], r["every scale"]["temperature"]) for r in rows)  # fmt: skip
    passes = {rule: sum(r[rule]["passes"] for r in rows) for rule in RULES}
    seconds = {rule: sum(r[rule]["seconds"] for r in rows) for rule in RULES}
    train = sum(r["train_seconds"] for r in rows)
    print(
        f"same choice in {same} of {len(rows)} runs; passes {passes['screened']:.0f} vs {passes['every scale']:.0f}; "
        f"calibration / training {seconds['screened'] / train:.2f} vs {seconds['every scale'] / train:.2f}"
    )


if __name__ == "__main__":
    main()
