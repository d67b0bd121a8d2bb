"""benchmarks/calibration_keep_trained.py: its test NLL, and what each row reports of the rule."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import calibration_keep_trained as bench  # noqa: E402
import payoff  # noqa: E402
import payoff_tasks  # noqa: E402
import payoff_training  # noqa: E402

from hf_evon import EVONPosterior  # noqa: E402


def test_calibrated_bma_is_the_bma_nll_of_tempered_samples_and_the_mean_at_inf() -> None:
    """payoff.calibrated_bma, which the benchmark scores both rules with: against a plain loop over
    softmax(logits / T) of draws 0..S-1, and the tempered mean where ζ = ∞."""
    task = payoff_tasks.make_task("digits", 0, True)
    model = task.make_model(0)
    posterior = EVONPosterior.from_optimizer(payoff_training.train_evon(task, model, 0), model)
    x, y = torch.cat([b[0] for b in task.test]), torch.cat([b[1] for b in task.test])
    mean = payoff_training.log_probs(model, task.test, task.shift)

    def probs(p: EVONPosterior, seed: int, t: float) -> torch.Tensor:
        with p.sampled(model, seed=seed), torch.no_grad():
            model.eval()
            return torch.softmax(model(x).double() / t, -1)[torch.arange(len(y)), y]

    def nll(p: EVONPosterior) -> float:
        return float(-payoff.calibrated_bma(task, model, p, mean, [3])[3].gather(1, y[:, None]).mean())

    tempered = posterior.with_temperature(1.5)
    reference = -torch.stack([probs(tempered, s, 1.5) for s in range(3)]).mean(0).log().mean()
    assert nll(tempered) == pytest.approx(float(reference), rel=1e-9)
    at_mean = posterior.with_ess(math.inf).with_temperature(0.8)
    assert nll(at_mean) == pytest.approx(float(-probs(at_mean, 0, 0.8).log().mean()), rel=1e-9)


def test_a_row_reports_the_rules_choice_and_the_nlls_it_read() -> None:
    row = bench.run("digits", 0, 2, True)
    assert row["cal_trained_nll"] is not None  # no scale beat the mean here: the trained posterior was scored
    # the two rules differ only where the trained posterior is kept: elsewhere the same choice, the same NLL
    assert (row["test_keep"] == row["test_mean_rule"]) is not row["kept_trained"]
