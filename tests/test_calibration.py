"""Post-hoc calibration of the sampling scale: grid search by held-out BMA NLL."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hf_evon import EVONPosterior, build_optimizer
from hf_evon.calibration import calibrate_posterior, target_log_probs


def trained(seed: int = 0, steps: int = 30) -> tuple[nn.Module, EVONPosterior, list, list]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    w = torch.randn(6, 3)
    gen = torch.Generator().manual_seed(seed)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 6, generator=gen)
        return x, torch.distributions.Categorical(logits=2 * x @ w).sample()

    opt = build_optimizer(model, seed=seed)
    for _ in range(steps):
        x, y = batch(64)
        with opt.sampled_params(train=True):
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, EVONPosterior.from_optimizer(opt, model), [batch(50) for _ in range(2)], [batch(50)]


def bma_nll(model: nn.Module, posterior: EVONPosterior, batches: list, seeds: range) -> float:
    """Reference: a plain loop over samples, averaging probabilities."""
    total, count = 0.0, 0
    for x, y in batches:
        probs = torch.zeros(len(y), 3, dtype=torch.float64)
        for s in seeds:
            with posterior.sampled(model, seed=s), torch.no_grad():
                probs += torch.softmax(model(x).double(), -1) / len(seeds)
        total -= float(probs[torch.arange(len(y)), y].log().sum())
        count += len(y)
    return total / count


def test_grid_nll_is_the_bma_nll_and_the_choice_is_the_grid_minimum() -> None:
    model, post, cal, _ = trained()
    calibrated, result = calibrate_posterior(model, post, cal, grid=[0.1, 1.0, 10.0], num_samples=4, seed=7)
    assert result.trained_ess == post.ess
    assert [g / post.ess for g in result.grid] == pytest.approx([10.0, 1.0, 0.1])
    for ess, nll in zip(result.grid, result.nll):
        assert nll == pytest.approx(bma_nll(model, post.with_ess(ess), cal, range(7, 11)), rel=1e-9)
    x, y = zip(*cal)
    with torch.no_grad():
        mean_nll = float(nn.functional.cross_entropy(model(torch.cat(x)).double(), torch.cat(y)))
    assert result.mean_nll == pytest.approx(mean_nll, rel=1e-9)
    best = min([(result.mean_nll, math.inf)] + list(zip(result.nll, result.grid)))
    assert result.ess == best[1]
    assert calibrated.ess == best[1]
    assert result.nll_at_best == best[0]  # the NLL of the chosen ζ (∞ included: never above the mean's)


def test_noise_that_only_hurts_calibrates_to_the_mean() -> None:
    model, post, cal, _ = trained()
    loud = post.with_ess(post.ess * 1e-6)  # std x1000: every sample is garbage
    calibrated, result = calibrate_posterior(model, loud, cal, grid=[1.0, 3.0], num_samples=2)
    assert result.ess == math.inf and calibrated.ess == math.inf
    with calibrated.sampled(model, seed=0):  # the calibrated posterior samples the mean exactly
        x = cal[0][0]
        sampled = model(x)
    assert torch.equal(sampled, model(x))


def test_the_scan_stops_when_noise_has_clearly_taken_over() -> None:
    model, post, cal, _ = trained()
    _, result = calibrate_posterior(model, post, cal, grid=[1.0, 1e-4, 1e-5, 1e-6], num_samples=2)
    assert len(result.nll) < 4
    assert result.nll[-1] > 2 * min([result.mean_nll, *result.nll])


def test_calibration_is_recorded_in_the_posterior_file(tmp_path) -> None:
    model, post, cal, _ = trained()
    calibrated, result = calibrate_posterior(model, post, cal, grid=[0.3, 1.0], num_samples=2)
    calibrated.save_pretrained(tmp_path)
    loaded = EVONPosterior.from_pretrained(tmp_path)
    assert loaded.ess == result.ess
    assert loaded.config["trained_ess"] == pytest.approx(post.ess)
    record = loaded.config["calibration"]
    assert record["nll"] == pytest.approx(result.nll)
    assert record["num_samples"] == 2 and record["num_targets"] == 100
    # calibrating again starts from the trained ζ, not from the calibrated one
    _, again = calibrate_posterior(model, calibrated, cal, grid=[1.0], num_samples=2)
    assert again.trained_ess == pytest.approx(post.ess)


def test_causal_lm_targets_are_shifted_like_the_model_loss() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)).eval()
    ids = torch.randint(0, 50, (3, 12))
    labels = ids.clone()
    labels[0, :4] = -100
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    logp = target_log_probs(out.logits, labels, shift=True)
    assert float(-logp.mean()) == pytest.approx(float(out.loss), rel=1e-5)
    assert logp.numel() == int(labels[:, 1:].ne(-100).sum())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"grid": [0.0, 1.0]}, "grid"), ({"grid": [math.inf]}, "grid"), ({"num_samples": 0}, "num_samples")],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    model, post, cal, _ = trained(steps=1)
    with pytest.raises(ValueError, match=match):
        calibrate_posterior(model, post, cal, **kwargs)


def test_an_iterator_and_an_infinite_ess_are_refused() -> None:
    model, post, cal, _ = trained(steps=1)
    with pytest.raises(TypeError, match="re-iterable"):
        calibrate_posterior(model, post, iter(cal))
    with pytest.raises(ValueError, match="ess = inf"):
        calibrate_posterior(model, post.with_ess(math.inf), cal)
