"""Could EVON's measured curvature set the posterior's size, as a Bayesian posterior's would?

Under the default Fisher estimate H averages the squared mini-batch gradients (in the eigenbasis),
G_B = 1/B Σ ∇ℓ_i: near a mode E[G_B²] ≈ F/B, F the per-example Fisher, so the posterior of the
N-example likelihood, precision N·F, is 1/(ζ(H + δ)) at ζ = N·B. ``ess="auto"`` instead sets ζ so
that the pooled std is a fraction of the weights' RMS (docs/defaults.md#curvature-fit). Per task
and seed (payoff.py's models and loop, EVON at its defaults, the development splits: no test
rows), this prints the trained ζ and N·B, H's quantiles at the end of training, and the NLL on the
calibration split of the mean, of the mean at its best temperature there, and of BMA@16 at T = 1
at the trained ζ, at 10⁻², 10⁻⁴ and 10⁻⁶ of it, and at ζ = N·B.

    python benchmarks/bayesian_size.py --seeds 2     # five small tables, about a minute on two cores
    python benchmarks/bayesian_size.py --seeds 1 --tasks noisy_digits noisy_synthetic7 --train-at-nb

``--train-at-nb`` trains at ζ = N·B from the start (a given ζ keeps the default δ): variational
learning at the Bayesian size instead of a posterior rescaled after training.

Measured: docs/results.md#why-bma-gains-little-on-these-tasks.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import payoff_tasks  # noqa: E402
import payoff_training  # noqa: E402
from bma_headroom import bma_scores  # noqa: E402

from hf_evon.posterior import EVONPosterior  # noqa: E402

TASKS = ("digits", "noisy_digits", "noisy_wine", "noisy_synthetic7", "noisy_synthetic3")
FRACTIONS = (1.0, 1e-2, 1e-4, 1e-6)  # of the trained ζ


def run(name: str, seed: int, train_at_nb: bool = False) -> dict[str, Any]:
    torch.set_num_threads(1)
    task = payoff_tasks.make_task(name, seed, fast=False, development=True)
    model = task.make_model(seed)
    n, b = sum(len(y) for _, y in task.train), len(task.train[0][1])
    opt = payoff_training.train_evon(task, model, seed, **({"ess": float(n * b)} if train_at_nb else {}))
    evon = [g for g in opt.param_groups if g.get("algorithm", "evon") == "evon"]
    if len({g["ess"] for g in evon}) != 1:
        raise RuntimeError(f"{name}: one EVON group expected, got ζ {[g['ess'] for g in evon]}")
    zeta = evon[0]["ess"]
    hess = torch.cat([opt.state[p]["hess"].flatten().double() for g in evon for p in g["params"]])
    logp, labels = payoff_training.log_probs(model, task.cal, task.shift)
    temperature = payoff_training.fit_temperature(logp, labels)
    mean = payoff_training.scores(logp, labels)
    posterior = EVONPosterior.from_optimizer(opt, model)
    bma = {
        label: bma_scores(model, posterior.with_ess(ess), task.cal, task.shift)["nll"]
        for label, ess in [*((f"{f:g}", f * zeta) for f in FRACTIONS), ("N·B", n * b)]
    }
    return {
        "task": name,
        "seed": seed,
        "zeta": zeta,
        "nb": n * b,
        "delta": evon[0]["weight_decay"],
        "hess": torch.quantile(hess, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist(),
        "mean": mean["nll"],
        "accuracy": mean["accuracy"],
        "temperature": temperature,
        "mean_t": payoff_training.scores(torch.log_softmax(logp / temperature, -1), labels)["nll"],
        "bma": bma,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--train-at-nb", action="store_true", help="train at ζ = N·B instead of the defaults")
    args = ap.parse_args(argv)
    jobs = [(name, seed, args.train_at_nb) for name in args.tasks for seed in range(args.seeds)]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(run, *zip(*jobs)))
    labels = list(rows[0]["bma"])
    print("| task | seed | trained ζ | N·B / ζ | δ | H 10% / 50% / 90% | mean | accuracy | T | mean at T | "
          + " | ".join(f"BMA ζ×{k}" if k != "N·B" else "BMA ζ = N·B" for k in labels) + " |")  # fmt: skip
    print("|" + "---|" * (10 + len(labels)))
    for r in rows:
        h = " / ".join(f"{v:.1e}" for v in r["hess"])
        cells = " | ".join(f"{r['bma'][k]:.4g}" for k in labels)
        print(
            f"| {r['task']} | {r['seed']} | {r['zeta']:.2e} | {r['nb'] / r['zeta']:.1e} | {r['delta']:.1e} | {h} | "
            f"{r['mean']:.4f} | {r['accuracy']:.3f} | {r['temperature']:.2f} | {r['mean_t']:.4f} | {cells} |"
        )


if __name__ == "__main__":
    main()
