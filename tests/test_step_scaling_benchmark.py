"""benchmarks/step_scaling.py: its "adam x2" column is the library's default step, so the table
behind DEFAULT_SNR_SCALING and STEP_RATIOS measures what users get."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
step_scaling = pytest.importorskip("step_scaling")
payoff_tasks = step_scaling.payoff_tasks
payoff_training = step_scaling.payoff_training


def test_the_default_column_is_build_optimizers_defaults() -> None:
    from hf_evon.optim.defaults import DEFAULT_SNR_SCALING, STEP_RATIOS

    snr, multiple = step_scaling.VARIANTS["adam x2"]
    assert snr == DEFAULT_SNR_SCALING
    assert step_scaling.FULL_SIZE_RATIO * multiple == STEP_RATIOS[("whiten_rms", False)]
    task = payoff_tasks.make_task("noisy_iris", 0, True)  # fast: 5 epochs
    torch.set_num_threads(1)
    measured = step_scaling.calibration_nll(task, 0, (snr, multiple))
    model = task.make_model(0)
    payoff_training.train_evon(task, model, 0)  # build_optimizer's defaults
    assert measured == float(F.nll_loss(*payoff_training.log_probs(model, task.cal, task.shift)))
    # another column trains another model
    assert step_scaling.calibration_nll(task, 0, step_scaling.VARIANTS["full-size steps"]) != measured


def test_snr_average_beta_flag_changes_the_step_for_the_run_only(monkeypatch) -> None:
    """``--snr-average-beta`` measures ρ against another window (docs/defaults.md#snr-adam): the
    default column moves, and the library's constant is back when the run ends."""
    from hf_evon.optim import functional

    make_task = payoff_tasks.make_task
    monkeypatch.setattr(payoff_tasks, "make_task", lambda name, seed, fast, **kw: make_task(name, seed, True, **kw))
    library = functional.SNR_AVERAGE_BETA
    argv = ["--tasks", "noisy_iris", "--seeds", "1", "--variants", "adam x2"]
    default = step_scaling.main(argv)["noisy_iris"]["adam x2"]
    short = step_scaling.main([*argv, "--snr-average-beta", "0.5"])["noisy_iris"]["adam x2"]
    assert functional.SNR_AVERAGE_BETA == library
    assert short != default
    assert step_scaling.main(argv)["noisy_iris"]["adam x2"] == default  # nothing left patched
