"""How EVON's clipped step is scaled, chosen on calibration splits: full-size steps
(``snr_scaling=True``) against Adam's own step size (``"adam"``, min(1, ρ)) at multiples of the
step ratio, on small tabular tasks clean and with 30% random labels trained for many epochs.

Every run is ``payoff.py``'s task, loop and schedule (linear decay) at ``build_optimizer``'s
defaults but for the variant's ``snr_scaling`` and α (the step ratio × the multiple; the AdamW part
keeps the task's rate); the score is the NLL of the posterior mean on the calibration split, mean
over seeds. The test split is never read. AdamW (``torch.optim.AdamW``, weight decay 0.01) is the
reference. Figures: ``docs/defaults.md#snr-adam``.

    python benchmarks/step_scaling.py                       # 8 tasks × 6 variants × 3 seeds, ~15 min
    python benchmarks/step_scaling.py --tasks noisy_iris iris --seeds 1
    python benchmarks/step_scaling.py --variants "adam x2" --snr-average-beta 0.95   # ρ against a short window
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import payoff_tasks  # noqa: E402
import payoff_training  # noqa: E402

from hf_evon.optim import functional  # noqa: E402
from hf_evon.optim.defaults import STEP_RATIOS, lr_from_adamw_lr  # noqa: E402

TASKS = ("noisy_iris", "noisy_wine", "noisy_breast_cancer", "noisy_digits", "iris", "wine", "breast_cancer", "digits")
# label -> (snr_scaling, multiple of the full-size steps' ratio)
FULL_SIZE_RATIO = 0.8  # "whiten_rms" with snr_scaling=True
VARIANTS = {
    "full-size steps": (True, 1.0),
    "adam x1": ("adam", 1.0),
    "adam x1.5": ("adam", 1.5),
    "adam x2": ("adam", 2.0),
    "adam x2.5": ("adam", 2.5),
}


def calibration_nll(task: payoff_tasks.Task, seed: int, variant: tuple[bool | str, float] | None) -> float:
    model = task.make_model(seed)
    if variant is None:
        payoff_training.train_adamw(task, model, seed)
    else:
        snr, multiple = variant
        alpha = lr_from_adamw_lr(task.adamw_lr, step_ratio=FULL_SIZE_RATIO * multiple)
        payoff_training.train_evon(task, model, seed, lr=alpha, snr_scaling=snr)
    return float(F.nll_loss(*payoff_training.log_probs(model, task.cal, task.shift)))


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--variants", nargs="+", default=["AdamW", *VARIANTS], choices=["AdamW", *VARIANTS], help="the columns to run"
    )
    parser.add_argument(
        "--snr-average-beta",
        type=float,
        default=None,
        help="the EMA decay of the gradients' squared norm that ρ is measured against "
        "(hf_evon.optim.defaults.SNR_AVERAGE_BETA; set for this run in the step's module, which reads it each step)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    variants = {label: v for label, v in {"AdamW": None, **VARIANTS}.items() if label in args.variants}
    print(f"default: the step ratio {STEP_RATIOS[('whiten_rms', False)]} with min(1, ρ)", flush=True)
    print("| task | " + " | ".join(variants) + " |")
    print("|---" * (len(variants) + 1) + "|")
    table = {}
    library_beta = functional.SNR_AVERAGE_BETA
    if args.snr_average_beta is not None:
        functional.SNR_AVERAGE_BETA = args.snr_average_beta
    try:
        for name in args.tasks:
            tasks = [payoff_tasks.make_task(name, seed, False, development=True) for seed in range(args.seeds)]
            table[name] = {
                label: statistics.fmean(calibration_nll(t, s, v) for s, t in enumerate(tasks))
                for label, v in variants.items()
            }
            print(f"| {name} | " + " | ".join(f"{x:.3f}" for x in table[name].values()) + " |", flush=True)
    finally:  # the library's value again for whatever runs next in this process
        functional.SNR_AVERAGE_BETA = library_beta
    return table


if __name__ == "__main__":
    main()
