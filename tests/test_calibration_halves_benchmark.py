"""benchmarks/calibration_halves.py measures the library's own calibration rule: its replay of the
stored draws gives exactly what ``calibrate_posterior`` gives on the model itself."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
halves = pytest.importorskip("calibration_halves")
import payoff_tasks  # noqa: E402
import payoff_training  # noqa: E402

from hf_evon import EVONPosterior, calibrate_posterior  # noqa: E402
from hf_evon.predictive.metrics import calibration_metrics  # noqa: E402


def held_out_nll(logits, index, y, ess_factor, temperature, seed) -> float:
    """BMA NLL of a choice on the examples ``index``, from the script's log-predictive."""
    return float(-halves.held_out_log_probs(logits, index, ess_factor, temperature, seed).gather(1, y[index, None]).mean())


def test_the_replay_of_the_draws_calibrates_as_the_model_does() -> None:
    torch.manual_seed(0)
    task = payoff_tasks.make_task("noisy_digits", 0, True)
    model = task.make_model(0)
    posterior = EVONPosterior.from_optimizer(payoff_training.train_evon(task, model, 0), model)
    logits, y = halves.draws(task, model, posterior, 1000)
    stand_in = halves.ReplayPosterior(float(posterior.config.get("trained_ess", posterior.ess)))
    everything = torch.arange(y.numel())
    scored = []
    for kwargs in (
        {"always_scan": True, "screen_factor": 0.0},
        {"always_scan": True},
        {"standard_errors": 0.0},
        {"always_scan": True, "screen_factor": 5.0, "keep_trained": False},
    ):
        _, real = calibrate_posterior(
            model, posterior, payoff_tasks.as_calibration_batches(task.cal), seed=1000, shift_labels=False, **kwargs
        )
        _, replayed = calibrate_posterior(
            halves.Replay(logits), stand_in, [(everything, y)], seed=1000, shift_labels=False, **kwargs
        )
        assert replayed.multiplier == pytest.approx(real.multiplier, rel=1e-12)
        assert replayed.temperature == real.temperature and replayed.scanned == real.scanned
        assert [g / real.trained_ess for g in real.grid] == pytest.approx([g / replayed.trained_ess for g in replayed.grid])
        # the replay holds float32 log-probs (logits less their log-sum-exp) where the model gives logits: at
        # the sharpened mean's temperature (T 0.35 here), at which every scale is scored, each divides by T
        # with its own float32 rounding, so the NLLs agree to float32's resolution, not to float64's
        assert replayed.nll == pytest.approx(real.nll, rel=1e-7) and replayed.mean_nll == pytest.approx(real.mean_nll, rel=1e-7)
        assert replayed.temperature < 1  # the case the tolerance is for
        screened = [g / real.trained_ess for g in real.screened]
        assert screened == pytest.approx([g / replayed.trained_ess for g in replayed.screened])
        scored.append(len(real.grid))
    assert scored[0] == len(halves.DEFAULT_GRID) and scored[1] > 0  # the replay stood in for every scale
    # the held-out score is the tempered BMA NLL of the stored draws, the mean's at ess = inf
    t = 2.0
    mean_nll = float(torch.nn.functional.cross_entropy(logits[None] / t, y))
    assert held_out_nll(logits, everything, y, math.inf, t, 1000) == pytest.approx(mean_nll, rel=1e-12)
    draws = torch.stack([torch.log_softmax(logits[(0.1, 1000 + s)] / t, -1) for s in range(8)])
    bma = -(torch.logsumexp(draws, 0) - math.log(8)).gather(1, y[:, None]).mean()
    assert held_out_nll(logits, everything, y, 0.1, t, 1000) == pytest.approx(float(bma), rel=1e-12)
    # a rule's score: each half's choice scored on the other half's targets, weighted by their count
    even, odd = torch.arange(0, y.numel(), 2), torch.arange(1, y.numel(), 2)
    for k, g, options in ((0.0, 0.0, {}), (1.0, 0.01, {}), (0.5, 0.01, {"temperature": False})):
        row = halves.rule_scores(logits, y, stand_in, 1000, k, g, **options)
        if options:  # the options reach the rule: every choice at T = 1
            assert [t for _, t in row["choices"]] == [1.0, 1.0]
        (m0, t0), (m1, t1) = row["choices"]
        want = held_out_nll(logits, odd, y, m0, t0, 1000) * len(odd)
        want += held_out_nll(logits, even, y, m1, t1, 1000) * len(even)
        assert row["nll"] == pytest.approx(want / y.numel(), rel=1e-9)
        by_hand = torch.cat([
            halves.held_out_log_probs(logits, odd, m0, t0, 1000), halves.held_out_log_probs(logits, even, m1, t1, 1000)
        ])  # fmt: skip
        ece = calibration_metrics(by_hand, y[torch.cat([odd, even])], input_type="log_probs", ignore_index=None)["ece"]
        assert row["ece"] == ece
        # the scales each half's screen left out, as the rule's own result counts them
        for (fit, _), count in zip(((even, odd), (odd, even)), row["screened"]):
            _, own = calibrate_posterior(halves.Replay(logits), stand_in, [(fit, y[fit])], seed=1000,
                                         standard_errors=k, min_gain=g, shift_labels=False, **options)  # fmt: skip
            assert count == len(own.screened)


def test_the_summary_counts_each_rules_runs_below_and_above_the_defaults() -> None:
    """Every k is run at min_gain 0.01 and every other min_gain at k = 1, no rule twice, the
    library's defaults among them; the table averages each rule's held-out-half NLL and counts the
    runs it beats / loses to the defaults' rule on."""
    from hf_evon.predictive.calibration import DEFAULT_MIN_GAIN, DEFAULT_STANDARD_ERRORS

    assert halves.RULES[halves.DEFAULT_RULE] == (DEFAULT_STANDARD_ERRORS, DEFAULT_MIN_GAIN)
    assert len(set(halves.RULES.values())) == len(halves.RULES)
    assert {g for _, g in halves.RULES.values()} == set(halves.MIN_GAINS)
    assert {k for k, _ in halves.RULES.values()} == set(halves.KS)
    base = {rule: {"nll": 1.0, "ece": 0.1} for rule in [*halves.RULES, *halves.OPTIONS]}
    rows = [{**base, "g=0": {"nll": 0.5, "ece": 0.2}}, {**base, "g=0": {"nll": 2.0, "ece": 0.3}}, base]
    table = halves.summary(rows).splitlines()
    assert "| g=0 | 1.16667 | 1 / 1 | 0.2000 |" in table
    assert f"| {halves.DEFAULT_RULE} | 1.00000 | 0 / 0 | 0.1000 |" in table
