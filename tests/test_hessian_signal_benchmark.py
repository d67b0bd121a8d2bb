"""benchmarks/hessian_signal.py: its antithetic pairs give the noise-free Price estimate it claims."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
signal = pytest.importorskip("hessian_signal")


def test_an_antithetic_pair_estimates_a_quadratics_curvature_exactly() -> None:
    """Loss ½ Σ c ⊙ W²: a pair's estimate is c ⊙ z² (independent draws add c ⊙ M ⊙ z / σ), so
    H after the step is the IVON update of that closed form (no clipping, Q = I)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4))
    c = torch.rand(3, 4) + 0.5
    beta2, ess, delta = 0.9, 1e4, 1e-3
    opt = signal.AntitheticEVON(
        [w], lr=0.0, ess=ess, hess_init=0.1, betas=(0.9, beta2), weight_decay=delta, mc_samples=2,
        hess_clip_ratio=None, identity_basis=True, clip="none", seed=1, hess_estimator="price",
    )  # fmt: skip

    def sample() -> torch.Tensor:
        with opt.sampled_params(train=True):
            noise = opt.current_noise(w).clone() if opt.buckets[0].initialized else None
            (0.5 * (c * w.square()).sum()).backward()
        return noise

    for _ in range(2):  # the first step only sets up the (identity) bases
        sample(), sample()
        opt.step()
        opt.zero_grad()
    hess = opt.state[w]["hess"].clone()
    first, second = sample(), sample()
    assert torch.equal(second, -first)  # the pair: z, then −z
    z = first * torch.sqrt(ess * (hess + delta))
    h_hat = c * z.square()
    expected = beta2 * hess + (1 - beta2) * h_hat + ((1 - beta2) * (hess - h_hat)).square() / (2 * (hess + delta))
    opt.step()
    torch.testing.assert_close(opt.state[w]["hess"], expected, rtol=1e-5, atol=0)
    assert not math.isclose(float(expected.mean()), float(hess.mean()))  # the step did move H


def test_the_script_records_the_price_estimate_of_every_matrix_and_restores_the_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``run`` wraps the step's Hessian candidate to record it; it reached for a method EVON no
    longer has (``EVON._hessian_candidate``: AttributeError before any training). On digits cut to
    6 batches and 1 epoch (5 recorded steps) it prints a row for each of the MLP's three matrices
    per sampling mode, and the step's own candidate is back in place afterwards."""
    import dataclasses

    from hf_evon.optim import update

    real_make_task, candidate = signal.payoff_tasks.make_task, update.hessian_candidate

    def small(name: str, seed: int, fast: bool) -> object:
        task = real_make_task(name, seed, True)
        return dataclasses.replace(task, epochs=1, train=task.train[:6], test=task.test[:2])

    monkeypatch.setattr(signal.payoff_tasks, "make_task", small)
    for antithetic in (False, True):
        signal.run(antithetic, 0)
    out = capsys.readouterr().out
    assert out.count("(256, 64) δ") == out.count("(256, 256) δ") == out.count("(10, 256) δ") == 2
    assert out.count("test NLL") == 2
    assert update.hessian_candidate is candidate
