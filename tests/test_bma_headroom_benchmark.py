"""benchmarks/bma_headroom.py: its Fisher-shaped posterior has the Fisher it claims."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
headroom = pytest.importorskip("bma_headroom")

from hf_evon.posterior.gaussian import MatrixFactors  # noqa: E402
from hf_evon.posterior.posterior import EVONPosterior  # noqa: E402


def test_the_fisher_diagonal_in_the_eigenbasis_is_the_closed_form_of_a_softmax_regression() -> None:
    """A linear softmax classifier: ∇_W ℓ(x, y) = (p − e_y) xᵀ, so the Fisher's diagonal in the
    basis (Q_L, Q_R) is mean_i Σ_y p_iy (Q_Lᵀ (p_i − e_y) x_iᵀ Q_R)², in closed form."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, bias=False)
    x = torch.randn(7, 4)
    batches = [(x[:5], torch.zeros(5, dtype=torch.long)), (x[5:], torch.zeros(2, dtype=torch.long))]
    q_left, q_right = torch.linalg.qr(torch.randn(3, 3))[0], torch.linalg.qr(torch.randn(4, 4))[0]
    posterior = EVONPosterior.from_factors(
        {"weight": MatrixFactors(q_left, q_right, torch.ones(3, 4), (3, 4), (3, 4), 1e4, 1e-3)}
    )
    got = headroom.fisher_diagonal(model, posterior, batches)["weight"]
    with torch.no_grad():
        p = model(x).double().softmax(-1)
    want = torch.zeros(3, 4, dtype=torch.float64)
    for i in range(len(x)):
        for y in range(3):
            g = torch.outer(p[i] - torch.eye(3, dtype=torch.float64)[y], x[i].double())
            want += p[i, y] * (q_left.double().T @ g @ q_right.double()).square() / len(x)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-7)
    # the labels in the batches play no part: the expectation is over the model's own predictive
    relabelled = [(xb, torch.full_like(yb, 2)) for xb, yb in batches]
    assert torch.equal(headroom.fisher_diagonal(model, posterior, relabelled)["weight"], got)
