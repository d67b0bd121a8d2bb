"""benchmarks/posterior_vs_nuts.py: its Gaussian distances, its symmetry alignment and its --fast run."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
pytest.importorskip("pyro")
bench = pytest.importorskip("posterior_vs_nuts")
F64 = torch.float64


def test_gaussian_w2_matches_the_quantile_distance_of_the_two_gaussians() -> None:
    """W2 of 1-D laws is the L2 distance of their quantile functions: evaluated on a fine grid of
    one Gaussian's exact quantiles, the paper helper's empirical W2 is the closed form."""
    m1, s1, m2, s2 = 0.3, 0.7, -1.1, 1.9
    u = (torch.arange(200_000, dtype=F64) + 0.5) / 200_000
    quantiles = m2 + s2 * math.sqrt(2.0) * torch.erfinv(2 * u - 1)
    expected = bench.w2_to_gaussian(quantiles, m1, s1)
    got = float(bench.gaussian_w2(*(torch.tensor(v, dtype=F64) for v in (m1, s1, m2, s2))))
    assert got == pytest.approx(expected, rel=1e-4)
    assert got == pytest.approx(math.sqrt((m1 - m2) ** 2 + (s1 - s2) ** 2))


def test_gaussian_kl_matches_numerical_integration_and_is_asymmetric() -> None:
    m0, s0, m1, s1 = 0.2, 0.5, 1.0, 1.5
    x = torch.linspace(-12, 12, 400_001, dtype=F64)
    p = torch.distributions.Normal(m0, s0)
    q = torch.distributions.Normal(m1, s1)
    integrand = p.log_prob(x).exp() * (p.log_prob(x) - q.log_prob(x))
    numeric = float(torch.trapezoid(integrand, x))
    t = [torch.tensor(v, dtype=F64) for v in (m0, s0, m1, s1)]
    assert float(bench.gaussian_kl(*t)) == pytest.approx(numeric, rel=1e-6)
    assert float(bench.gaussian_kl(t[2], t[3], t[0], t[1])) != pytest.approx(numeric, rel=1e-2)
    assert float(bench.gaussian_kl(t[0], t[1], t[0], t[1])) == pytest.approx(0.0, abs=1e-12)


def _random_symmetry(theta: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    found = [
        (
            torch.randperm(bench.WIDTH, generator=gen),
            torch.randint(0, 2, (bench.WIDTH,), generator=gen) * 2.0 - 1,
        )
        for _ in range(2)
    ]
    return bench.apply_symmetry(theta, [(perm, sign.to(F64)) for perm, sign in found])


def test_a_permuted_sign_flipped_copy_is_the_same_function_and_alignment_undoes_it() -> None:
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(bench.NUM_PARAMS, generator=gen, dtype=F64)
    copy = _random_symmetry(theta, gen)
    assert not torch.allclose(copy, theta)
    grid = torch.linspace(-3, 3, 25, dtype=F64).reshape(-1, 1)
    torch.testing.assert_close(bench.forward(copy[None], grid), bench.forward(theta[None], grid))
    aligned = bench.apply_symmetry(copy, bench.symmetry(copy, theta))
    torch.testing.assert_close(aligned, theta)
    # a std vector follows the permutation, not the signs
    std = torch.rand(bench.NUM_PARAMS, generator=gen, dtype=F64)
    found = bench.symmetry(copy, theta)
    assert (bench.apply_symmetry(std, found, signs=False) > 0).all()


def test_the_flat_layout_is_the_models_parameter_order() -> None:
    model = bench.make_model(3)
    theta = bench._flat(model)
    assert theta.numel() == bench.NUM_PARAMS == len(bench.PARAM_NAMES)
    grid = torch.linspace(-3, 3, 11, dtype=F64).reshape(-1, 1)
    with torch.no_grad():
        torch.testing.assert_close(bench.forward(theta[None], grid)[0], model(grid)[:, 0])
        x, y = bench.make_data(10, 0)
        n = len(y)
        expected = n * bench.mean_nll(model(x), y) + 0.5 * bench.PRIOR_PRECISION * (theta**2).sum()
        torch.testing.assert_close(bench.potential(theta, x, y), expected)


def test_a_fast_run_never_writes_over_the_committed_results() -> None:
    """``--fast``, the documented smoke run, wrote its numbers over ``benchmarks/results/posterior_vs_nuts.*``
    (the ``--out-dir`` default in every mode); it now writes to the temporary directory by default."""
    import tempfile

    fast, full = bench.parse_args(["--fast"]), bench.parse_args([])
    assert fast.out_dir == str(Path(tempfile.gettempdir()) / "hf_evon_posterior_vs_nuts_fast")
    assert full.out_dir == bench.DEFAULT_OUT and bench.parse_args(["--fast", "--out-dir", "x"]).out_dir == "x"


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("posterior_vs_nuts")
    record = bench.run(["--fast", "--out-dir", str(out)])
    return record, out


def test_fast_run_writes_well_formed_outputs(fast_run: tuple[dict[str, Any], Path]) -> None:
    record, out = fast_run
    for ext in ("png", "md", "json"):
        assert (out / f"posterior_vs_nuts.{ext}").stat().st_size > 0
    saved = json.loads((out / "posterior_vs_nuts.json").read_text())
    assert saved["fast"] is True and saved["seed"] == 0 and saved["torch"] == torch.__version__
    assert saved["command"] == "python benchmarks/posterior_vs_nuts.py --fast --seed 0"
    summary = saved["results"]["summary"]
    assert list(summary) == list(bench.METHODS)
    keys = [
        f"{stat}_{region}" for stat in ("w2_f", "kl_y", "std_ratio") for region in ("data", "gap", "outside")
    ]
    for method in ("EVON default", "EVON price", "IVON default", "IVON price"):  # hf-evon's own rows
        row = summary[method]
        for key in keys + ["median_w2", "max_w2", "median_std_ratio"]:
            assert math.isfinite(row[key]) and row[key] >= 0, (method, key)
        assert row["kl_y_gap"] >= 0 and len(row["w2"]) == bench.NUM_PARAMS
    for method in ("ivon-opt", "Laplace"):  # peers: a number, or why there is none
        assert isinstance(summary[method], str) or math.isfinite(summary[method]["w2_f_gap"])
    md = (out / "posterior_vs_nuts.md").read_text()
    assert "| method |" in md and "--fast --seed 0" in md
    for method in bench.METHODS:
        assert f"| {method} |" in md
    grid = np.asarray(saved["results"]["grid"])
    assert len(saved["results"]["nuts"]["f_std"]) == len(grid)


def test_nuts_is_more_uncertain_in_the_gap_than_in_the_data(fast_run: tuple[dict[str, Any], Path]) -> None:
    """The reference itself behaves as a posterior must: f is pinned down where the data are
    (std near or below the noise σ) and free between the clusters."""
    record, _ = fast_run
    nuts = record["results"]["nuts"]
    assert nuts["median_f_std_gap"] > 3 * nuts["median_f_std_data"]
    assert nuts["median_f_std_data"] < 2 * bench.NOISE_STD
    assert all(c["step_size"] > 0 for c in nuts["chains"])
