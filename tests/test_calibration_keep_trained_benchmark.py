"""benchmarks/calibration_keep_trained.py: its test NLL, and what each row reports of the rule."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import calibration_keep_trained as bench  # noqa: E402
import payoff_tasks  # noqa: E402
import payoff_training  # noqa: E402

from hf_evon import EVONPosterior  # noqa: E402


def test_test_nll_is_the_bma_nll_of_tempered_samples_and_one_pass_for_the_mean() -> None:
    task = payoff_tasks.make_task("digits", 0, True)
    model = task.make_model(0)
    posterior = EVONPosterior.from_optimizer(payoff_training.train_evon(task, model, 0), model)
    x, y = torch.cat([b[0] for b in task.test]), torch.cat([b[1] for b in task.test])

    def probs(p: EVONPosterior, seed: int, t: float) -> torch.Tensor:
        with p.sampled(model, seed=seed), torch.no_grad():
            model.eval()
            return torch.softmax(model(x).double() / t, -1)[torch.arange(len(y)), y]

    tempered = posterior.with_temperature(1.5)
    reference = -torch.stack([probs(tempered, 7 + s, 1.5) for s in range(3)]).mean(0).log().mean()
    assert bench.test_nll(model, tempered, task, 3, 7) == pytest.approx(float(reference), rel=1e-9)
    mean = posterior.with_ess(math.inf).with_temperature(0.8)
    assert bench.test_nll(model, mean, task, 3, 7) == pytest.approx(float(-probs(mean, 0, 0.8).log().mean()), rel=1e-9)


def test_a_row_reports_the_rules_choice_and_the_nlls_it_read() -> None:
    row = bench.run("digits", 0, 2, True)
    assert row["cal_trained_nll"] is not None  # no scale beat the mean here: the trained posterior was scored
    # the two rules differ only where the trained posterior is kept: elsewhere the same choice, the same NLL
    assert (row["test_keep"] == row["test_mean_rule"]) is not row["kept_trained"]
