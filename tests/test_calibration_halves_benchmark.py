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


def test_the_replay_of_the_draws_calibrates_as_the_model_does() -> None:
    torch.manual_seed(0)
    task = payoff_tasks.make_task("noisy_digits", 0, True)
    model = task.make_model(0)
    posterior = EVONPosterior.from_optimizer(payoff_training.train_evon(task, model, 0), model)
    logits, y = halves.draws(task, model, posterior, 1000)
    stand_in = halves.ReplayPosterior(float(posterior.config.get("trained_ess", posterior.ess)))
    everything = torch.arange(y.numel())
    scored = []
    for kwargs in ({"always_scan": True, "screen_factor": 0.0}, {"always_scan": True}, {"standard_errors": 0.0}):
        _, real = calibrate_posterior(
            model, posterior, payoff_tasks.as_calibration_batches(task.cal), seed=1000, shift_labels=False, **kwargs
        )
        _, replayed = calibrate_posterior(
            halves.Replay(logits), stand_in, [(everything, y)], seed=1000, shift_labels=False, **kwargs
        )
        assert replayed.multiplier == pytest.approx(real.multiplier, rel=1e-12)
        assert replayed.temperature == real.temperature and replayed.scanned == real.scanned
        assert [g / real.trained_ess for g in real.grid] == pytest.approx([g / replayed.trained_ess for g in replayed.grid])
        assert replayed.nll == pytest.approx(real.nll, rel=1e-9) and replayed.mean_nll == pytest.approx(real.mean_nll, rel=1e-9)
        scored.append(len(real.grid))
    assert scored[0] == len(halves.DEFAULT_GRID) and scored[1] > 0  # the replay stood in for every scale
    # the held-out score is the tempered BMA NLL of the stored draws, the mean's at ess = inf
    t = 2.0
    mean_nll = float(torch.nn.functional.cross_entropy(logits[None] / t, y))
    assert halves.held_out_nll(logits, everything, y, math.inf, t, 1000) == pytest.approx(mean_nll, rel=1e-12)
    draws = torch.stack([torch.log_softmax(logits[(0.1, 1000 + s)] / t, -1) for s in range(8)])
    bma = -(torch.logsumexp(draws, 0) - math.log(8)).gather(1, y[:, None]).mean()
    assert halves.held_out_nll(logits, everything, y, 0.1, t, 1000) == pytest.approx(float(bma), rel=1e-12)
