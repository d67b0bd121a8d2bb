"""The main job on an embedded default: train a small classifier with EVON's defaults,
calibrate the posterior's sampling scale on held-out data, evaluate at the posterior mean and
with Bayesian model averaging (BMA), save model + posterior, and check that the saved
posterior reloads and reproduces the BMA numbers.

Data: scikit-learn's bundled handwritten digits (8×8 images, 10 classes), no network; 20% of
the training images are held out for the calibration (never the test images). Compares
against AdamW (its default rate 1e-3) with the same model, budget and schedule (linear decay,
transformers' default), over 3 splits and initialisations, so the table says what the posterior
buys here and what it does not.

The budget (``--epochs``) trains to convergence, where AdamW starts to overfit (its test NLL and
ECE are higher than at half the budget) and a posterior is worth having. The calibration scores
noise scales only where the mean is overconfident on the held-out images (its best temperature
above 1); elsewhere it keeps the posterior as trained, BMA predicts as the mean does, and its
samples' disagreement is there to flag inputs unlike the digits. Where it scores them, each step
towards more noise must gain ``DEFAULT_STANDARD_ERRORS`` standard errors of the held-out NLL
(chosen on validation halves of other tasks, docs/trainer.md#calibration-standard-errors), and a
scale chosen on the held-out images can cost a little on the test images. Averaging samples can
only soften predictions, so where the mean is not overconfident it has nothing to fix
(``benchmarks/bma_headroom.py``). BMA's gains here are small at every budget because the mean's
default L2 pull (``mean_weight_decay``: the precision of a prior whose std is a quarter of the
weights' RMS; the posterior's own δ is fitted to the curvature) already regularises it.
Measured figures: docs/results.md#quickstart.

    python examples/quickstart.py                # 25-40 s on 2 idle CPU cores
    python examples/quickstart.py --epochs 30 --bma-samples 64 --seeds 6
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch
from safetensors.torch import load_model, save_model
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch import nn

from hf_evon import EVONPosterior, build_optimizer, calibrate_posterior
from hf_evon.fileio import file_on_the_way
from hf_evon.predictive.calibration import CalibrationResult
from hf_evon.predictive.metrics import calibration_metrics


def make_model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10)
    )


def load_data(seed: int) -> tuple[torch.Tensor, ...]:
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.3, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_tr)  # standardised pixels, as for any tabular input
    x_tr, x_te = scaler.transform(x_tr), scaler.transform(x_te)
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


@torch.no_grad()
def bma_log_probs(
    model: nn.Module, posterior: EVONPosterior, x: torch.Tensor, samples: int, seed: int
) -> torch.Tensor:
    """log of the sample-averaged class probabilities (log-mean-exp of log-softmax), each at the
    posterior's calibrated temperature (``softmax(logits / T)``)."""
    logps = []
    for s in range(samples):
        with posterior.sampled(model, seed=seed + s):
            logps.append((model(x) / posterior.temperature).log_softmax(-1))
    return torch.logsumexp(torch.stack(logps), 0) - torch.log(torch.tensor(float(samples)))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: tuple, args: argparse.Namespace, seed: int) -> None:
    """Linear decay of the rate to 0 (transformers' default schedule, and benchmarks/payoff.py's)."""
    x_tr, y_tr = data[0], data[1]
    gen = torch.Generator().manual_seed(seed)
    steps = args.epochs * (len(x_tr) // args.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 - i / steps)
    evon = getattr(optimizer, "sampled_params", None)
    for _ in range(args.epochs):
        perm = torch.randperm(len(x_tr), generator=gen)
        for i in range(0, len(perm) - args.batch_size + 1, args.batch_size):
            idx = perm[i : i + args.batch_size]
            with evon(train=True) if evon else torch.enable_grad():
                nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
            optimizer.step()
            optimizer.zero_grad()
            sched.step()


def split_data(seed: int) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, torch.Tensor]]]:
    """((train x, train y, test x, test y), calibration batches): 20% of the training images are
    held out of training, for the calibration only."""
    x_tr, y_tr, x_te, y_te = load_data(seed)
    n_cal = len(x_tr) // 5
    return (x_tr[n_cal:], y_tr[n_cal:], x_te, y_te), [(x_tr[:n_cal], y_tr[:n_cal])]


def train_evon(seed: int, args: argparse.Namespace, data: tuple) -> tuple[nn.Module, EVONPosterior]:
    """A fresh model trained with EVON's defaults, and its (uncalibrated) posterior."""
    torch.manual_seed(seed)
    model = make_model(args.width)
    optimizer = build_optimizer(model, seed=seed)  # the defaults: ess="auto", see hf_evon.optim.evon
    train(model, optimizer, data, args, seed)
    return model, EVONPosterior.from_optimizer(optimizer, model)


def run_seed(
    seed: int, args: argparse.Namespace
) -> tuple[dict, nn.Module, EVONPosterior, CalibrationResult, torch.Tensor, torch.Tensor]:
    """AdamW and EVON on one split and initialisation; EVON's sampling scale calibrated on images
    held out of its training (with as many samples as BMA uses), then mean and BMA on the test split."""
    torch.manual_seed(seed)
    data, calibration_batches = split_data(seed)
    x_te, y_te = data[2], data[3]
    rows = {}
    baseline = make_model(args.width)
    train(baseline, torch.optim.AdamW(baseline.parameters(), weight_decay=1e-2), data, args, seed)
    with torch.no_grad():
        rows["AdamW"] = calibration_metrics(baseline(x_te).log_softmax(-1), y_te, input_type="log_probs")

    model, trained = train_evon(seed, args, data)
    posterior, calibration = calibrate_posterior(
        model, trained, calibration_batches, num_samples=args.bma_samples, seed=seed
    )
    with torch.no_grad():
        rows["EVON (mean)"] = calibration_metrics(model(x_te).log_softmax(-1), y_te, input_type="log_probs")
    bma = bma_log_probs(model, posterior, x_te, args.bma_samples, seed=1234)
    rows[f"EVON (BMA@{args.bma_samples})"] = calibration_metrics(bma, y_te, input_type="log_probs")
    return rows, model, posterior, calibration, x_te, bma


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each flag's default after its help."""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument(
        "--output-dir",
        default="outputs/quickstart",
        help="where the model and posterior of one seed (the first whose calibrated BMA samples) and every "
        "seed's metrics.json go",
    )
    ap.add_argument("--epochs", type=int, default=60, help="passes over the training images")
    ap.add_argument("--batch-size", type=int, default=64, help="images per step")
    ap.add_argument("--width", type=int, default=256, help="the MLP's two hidden layers' width")
    ap.add_argument("--bma-samples", type=int, default=32, help="posterior samples BMA averages")
    ap.add_argument("--seeds", type=int, default=3, help="splits and initialisations; the table is their mean")
    args = ap.parse_args(argv)
    for name in ("seeds", "epochs", "batch_size", "width", "bma_samples"):  # a count of 0 or less trains nothing
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if (blocking := file_on_the_way(args.output_dir)) is not None:
        ap.error(f"--output-dir: {blocking} is a file, not a directory")
    train_rows = len(split_data(0)[0][0])  # the same for every seed
    if args.batch_size > train_rows:  # no full batch: no step
        ap.error(f"--batch-size must be at most the training split's {train_rows} images; got {args.batch_size}")
    t0 = time.time()
    per_seed, calibrations, saved = [], [], None
    for seed in range(args.seeds):
        rows, model, posterior, calibration, x_te, bma = run_seed(seed, args)
        per_seed.append(rows)
        calibrations.append(calibration)
        # saved: the first seed whose calibrated BMA samples (so the reload check samples), else seed 0
        if saved is None or (math.isinf(saved[2].ess) and not math.isinf(posterior.ess)):
            saved = seed, model, posterior, x_te, bma
    saved_seed, model, posterior, x_te, saved_bma = saved
    os.makedirs(args.output_dir, exist_ok=True)
    save_model(model, os.path.join(args.output_dir, "model.safetensors"))
    posterior.save_pretrained(args.output_dir)
    with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
        # the saved model's seed and shape: what rebuilds it and finds its test split (split_data(seed))
        json.dump({"saved_seed": saved_seed, "width": args.width, "epochs": args.epochs, "per_seed": per_seed}, f, indent=1)

    # reload from disk, as a user elsewhere would, and check the BMA numbers are reproduced
    reloaded = make_model(args.width)
    load_model(reloaded, os.path.join(args.output_dir, "model.safetensors"))
    again = bma_log_probs(
        reloaded, EVONPosterior.from_pretrained(args.output_dir), x_te, args.bma_samples, seed=1234
    )
    reproduced = torch.equal(again, saved_bma)

    n_test = len(x_te)
    print(f"digits: {n_test} test images per seed, {args.seeds} seed(s); {time.time() - t0:.0f} s")
    print(f"{'mean over seeds':18s} {'accuracy':>9s} {'NLL':>7s} {'ECE':>7s} {'Brier':>7s}")
    names = list(per_seed[0])
    avg = {n: {k: statistics.fmean(r[n][k] for r in per_seed) for k in per_seed[0][n]} for n in names}
    for name, m in avg.items():
        print(f"{name:18s} {m['accuracy']:9.4f} {m['nll']:7.4f} {m['ece']:7.4f} {m['brier']:7.4f}")
    for seed, c in enumerate(calibrations):
        print(f"seed {seed}: {c.summary()}")
    mean, averaged = avg["EVON (mean)"], avg[names[-1]]
    print(
        f"BMA vs the mean on test: NLL {averaged['nll']:.4f} vs {mean['nll']:.4f}, "
        f"ECE {averaged['ece']:.4f} vs {mean['ece']:.4f}"
    )
    print(repr(posterior))
    print(f"saved seed {saved_seed}'s model + posterior to {args.output_dir}/; reloaded BMA identical: {reproduced}")
    if not reproduced:
        raise SystemExit("the reloaded posterior did not reproduce the BMA predictions")


if __name__ == "__main__":
    main()
