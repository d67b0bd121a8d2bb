"""EVON's defaults give a useful posterior: ess="auto", the prior floor, posterior health."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from hf_evon import EVON, build_optimizer
from hf_evon.optim.defaults import (
    COLLAPSE_PRIOR_TO_SIGNAL,
    DEFAULT_FINETUNING_LR,
    DEFAULT_HESS_INIT,
    DEFAULT_INIT_STD_RATIO,
    DEFAULT_PRIOR_STD_RATIO,
    DEFAULT_WEIGHT_DECAY,
    default_hess_init,
    default_weight_decay,
    lr_from_adamw_lr,
    noise_std_ratio,
)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def one_sample(opt: EVON, model: nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 8, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    with opt.sampled_params(train=True):
        nn.functional.cross_entropy(model(x), y).backward()


def pooled_rms_sq(params: list[torch.Tensor]) -> float:
    return sum(float(p.detach().double().square().sum()) for p in params) / sum(p.numel() for p in params)


def test_default_ess_is_a_posterior_scaled_to_the_weights() -> None:
    """Before: EVON(...) defaulted to ess=inf (no posterior at all, silently)."""
    model = mlp()
    weights = [p for p in model.parameters() if p.ndim == 2]
    opt = EVON(weights)
    one_sample(opt, model)
    ess = opt.param_groups[0]["ess"]
    expected = 1.0 / (
        DEFAULT_INIT_STD_RATIO**2 * pooled_rms_sq(weights) * (DEFAULT_HESS_INIT + DEFAULT_WEIGHT_DECAY)
    )
    assert math.isfinite(ess)
    assert ess == pytest.approx(expected, rel=1e-6)
    # H = h0 everywhere at first: the RMS posterior std is exactly init_std_ratio x the RMS weight
    assert opt.posterior_health()["noise_to_signal"] == pytest.approx(DEFAULT_INIT_STD_RATIO, rel=1e-5)


def test_default_prior_std_is_a_quarter_of_the_weights_rms() -> None:
    """A collapsed Hessian (H = 0) leaves the prior's std 1/sqrt(ζδ): by default 5x the initial std,
    25% of the weights' RMS (before: δ = 2.5e-5 gave 1x the RMS, and long default runs grew the noise
    to it; earlier still δ = 1e-4 with ζ = N, or 1e-6 in EVONConfig, gave 3-1000x)."""
    model = mlp()
    weights = [p for p in model.parameters() if p.ndim == 2]
    opt = EVON(weights)
    one_sample(opt, model)
    g = opt.param_groups[0]
    rms = math.sqrt(pooled_rms_sq(weights))
    assert g["weight_decay"] == DEFAULT_WEIGHT_DECAY
    assert 1.0 / math.sqrt(g["ess"] * g["weight_decay"]) / rms == pytest.approx(DEFAULT_PRIOR_STD_RATIO, rel=1e-6)
    initial = 1.0 / math.sqrt(g["ess"] * (g["hess_init"] + g["weight_decay"]))
    assert 1.0 / math.sqrt(g["ess"] * g["weight_decay"]) / initial == pytest.approx(5.0, rel=1e-9)
    assert opt.posterior_health(warn=False)["prior_to_signal"] == pytest.approx(DEFAULT_PRIOR_STD_RATIO, rel=1e-6)


def test_the_default_prior_follows_each_groups_hess_init_and_explicit_values_win() -> None:
    torch.manual_seed(0)
    a, b, c = (nn.Parameter(torch.randn(6, 5)) for _ in range(3))
    opt = EVON([{"params": [a], "hess_init": 1e-3}, {"params": [b]}, {"params": [c], "weight_decay": 1e-7}])
    ratio = DEFAULT_INIT_STD_RATIO**2 / (DEFAULT_PRIOR_STD_RATIO**2 - DEFAULT_INIT_STD_RATIO**2)
    assert [g["weight_decay"] for g in opt.param_groups] == pytest.approx(
        [1e-3 * ratio, DEFAULT_HESS_INIT * ratio, 1e-7], rel=1e-12
    )
    assert default_weight_decay(0.5, 0.1, 0.2) == pytest.approx(0.5 * 0.01 / 0.03, rel=1e-12)
    with pytest.raises(ValueError, match="init_std_ratio"):
        EVON([a], init_std_ratio=DEFAULT_PRIOR_STD_RATIO)  # no prior broader than the start: name it
    with pytest.raises(ValueError, match="hess_init"):
        EVON([a], hess_init=float("nan"))  # the invalid argument is named, not the derived one


def test_build_optimizer_derives_the_prior_from_the_kinds_hess_init_and_keeps_a_recipes() -> None:
    from transformers import BertConfig, BertForSequenceClassification

    from hf_evon import EVONConfig

    model = mlp()
    evon_groups = lambda o: [g for g in o.param_groups if g["algorithm"] == "evon"]  # noqa: E731
    assert {g["weight_decay"] for g in evon_groups(build_optimizer(model))} == {DEFAULT_WEIGHT_DECAY}
    assert {g["weight_decay"] for g in evon_groups(build_optimizer(model, weight_decay=None, hess_init=0.1))} == {
        default_weight_decay(0.1)
    }
    assert {g["weight_decay"] for g in evon_groups(build_optimizer(model, recipe="nanogpt", weight_decay=None))} == {
        1e-6
    }
    # a pretrained model (name_or_path set) fully fine-tuned: h0 1e-3 and its prior
    bert = BertForSequenceClassification(
        BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    )
    bert.config._name_or_path = "some/pretrained-model"
    bert._weight_conversions = []  # what transformers' from_pretrained leaves
    kwargs = EVONConfig(output_dir="unused", report_to=[]).evon_optimizer_kwargs()
    assert kwargs["weight_decay"] is None
    opt = build_optimizer(bert, **kwargs)
    groups = evon_groups(opt)
    assert {g["hess_init"] for g in groups} == {default_hess_init(True)}
    assert {g["weight_decay"] for g in groups} == {default_weight_decay(default_hess_init(True))}
    # without learning_rate, the AdamW part runs at the fine-tuning rate α comes from, as EVONTrainer's
    # (it ran at 1e-3, 20x the 5e-5 of the body's steps)
    assert {g["lr"] for g in opt.param_groups if g["algorithm"] == "adamw"} == {DEFAULT_FINETUNING_LR}
    assert {g["lr"] for g in evon_groups(opt)} == {lr_from_adamw_lr(DEFAULT_FINETUNING_LR, finetuning=True)}


def test_auto_ess_of_an_all_zero_group_uses_the_fan_in() -> None:
    w = nn.Parameter(torch.zeros(4, 25))
    opt = EVON([w], hess_init=0.1, weight_decay=1e-3, init_std_ratio=0.1)
    with opt.sampled_params(train=True):
        (w.sum() ** 2).backward()
    assert opt.param_groups[0]["ess"] == pytest.approx(1.0 / (0.1**2 * (1.0 / 25) * (0.1 + 1e-3)), rel=1e-9)


def test_auto_ess_is_resolved_once_and_survives_a_state_dict_round_trip() -> None:
    model = mlp()
    opt = build_optimizer(model, seed=0)
    one_sample(opt, model)
    opt.step()
    opt.zero_grad()
    ess = next(g["ess"] for g in opt.param_groups if g["algorithm"] == "evon")
    with torch.no_grad():  # later weights do not change the chosen ζ
        for p in model.parameters():
            p.mul_(3.0)
    one_sample(opt, model, seed=1)
    assert next(g["ess"] for g in opt.param_groups if g["algorithm"] == "evon") == ess
    clone = build_optimizer(mlp(), seed=0)
    clone.load_state_dict(opt.state_dict())
    assert next(g["ess"] for g in clone.param_groups if g["algorithm"] == "evon") == ess


@pytest.mark.parametrize(
    ("kwargs", "name"), [({"ess": "automatic"}, "ess"), ({"init_std_ratio": 0.0}, "init_std_ratio")]
)
def test_bad_auto_ess_arguments_name_themselves(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        EVON([nn.Parameter(torch.ones(2, 2))], **kwargs)


def test_posterior_health_matches_a_closed_form() -> None:
    model = mlp()
    weights = [p for p in model.parameters() if p.ndim == 2]
    opt = EVON(weights, ess=500.0, weight_decay=1e-3)
    one_sample(opt, model)
    opt.step()
    opt.zero_grad()
    stats = opt.posterior_health(warn=False)
    hess = [opt.state[p]["hess"].double() for p in weights]
    var = [1.0 / (500.0 * (h + 1e-3)) for h in hess]  # rotation keeps the trace: Σ marginal var = Σ V
    ratios = [math.sqrt(float(v.sum()) / float(p.double().square().sum())) for v, p in zip(var, weights)]
    all_h = torch.cat([h.reshape(-1) for h in hess])
    assert stats["noise_to_signal"] == pytest.approx(
        math.sqrt(sum(float(v.sum()) for v in var) / sum(float(p.double().square().sum()) for p in weights)),
        rel=1e-5,
    )
    assert stats["noise_to_signal_max"] == pytest.approx(max(ratios), rel=1e-5)
    assert stats["hess_min"] == pytest.approx(float(all_h.min()), rel=1e-6)
    assert stats["hess_mean"] == pytest.approx(float(all_h.mean()), rel=1e-6)
    assert stats["hess_below_prior"] == pytest.approx(float((all_h < 1e-3).double().mean()))


def test_hess_mean_of_a_uniform_hessian_is_that_value() -> None:
    """Every H entry h0 (no update yet): the mean is h0 as H holds it, between hess_min and
    hess_max. The sum ran in H's float32, so the mean came out below the minimum (0.0099999991
    < 0.0099999998), and the logged evon/hess_mean, posterior_health()'s, with it."""
    model = mlp()
    weights = [p for p in model.parameters() if p.ndim == 2]
    opt = EVON(weights, ess=500.0)
    one_sample(opt, model)
    opt.step()  # the initialising step: H stays h0
    opt.zero_grad()
    h0 = float(torch.tensor(DEFAULT_HESS_INIT, dtype=torch.float32))
    assert all(bool(opt.state[p]["hess"].eq(h0).all()) for p in weights)
    stats = opt.posterior_health(warn=False)
    assert stats["hess_min"] == stats["hess_mean"] == stats["hess_max"] == h0
    assert stats["hess_init_share"] == pytest.approx(DEFAULT_HESS_INIT / h0, rel=1e-15)  # given / held h0


def test_hess_init_share_follows_the_recursion_when_the_data_has_no_curvature() -> None:
    """Zero gradients: the Price estimate Ĥ is 0, so H_t obeys H ← β2·H + ½(1−β2)²H²/(H+δ)
    (IVON's correction) from h0 and the share is h0·β2ᵗ / H_t, computed here in float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    weights = [p for p in model.parameters() if p.ndim == 2]
    opt = EVON(weights, ess=1e4, weight_decay=1e-4, hess_estimator="price")
    h0, beta2, delta = DEFAULT_HESS_INIT, opt.param_groups[0]["betas"][1], 1e-4
    x = torch.randn(16, 8, dtype=torch.float64)
    h = h0
    for k in range(31):  # the first step sets up the eigenbases and leaves H at h0: t = k updates after it
        with opt.sampled_params(train=True):
            (0.0 * model(x).sum()).backward()
        opt.step()
        opt.zero_grad()
        t = k
        h = h if t == 0 else beta2 * h + 0.5 * (1 - beta2) ** 2 * h * h / (h + delta)
        if t in (0, 1, 30):
            assert float(opt.state[weights[0]]["hess"].max()) == pytest.approx(h, rel=1e-12)
            share = opt.posterior_health(warn=False)["hess_init_share"]
            assert share == pytest.approx(h0 * beta2**t / h, rel=1e-12)
    assert 0.99 < share < 1.0  # all of H is what h0 decayed to (the correction adds a little)


def test_hess_init_share_counts_only_the_updates_that_decay_h0_under_phased_gradients() -> None:
    """Phased gradients: the clean (odd) updates leave H alone, so after t updates the Price
    estimate has decayed h0 ⌈t/2⌉ times. The share was h0·β2ᵗ / H, which fell to ~β2^(t/2)
    while all of H was still h0's: a posterior that had learned nothing read as learned."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    weights = [p for p in model.parameters() if p.ndim == 2]
    opt = EVON(weights, ess=1e4, weight_decay=1e-4, hess_estimator="price", phased_gradients=True)
    h0, beta2, delta = DEFAULT_HESS_INIT, opt.param_groups[0]["betas"][1], 1e-4
    x = torch.randn(16, 8, dtype=torch.float64)
    h, decays = h0, 0
    for k in range(11):  # the first step sets up the eigenbases: t = k updates after it
        with opt.sampled_params(train=True):
            (0.0 * model(x).sum()).backward()
        opt.step()
        opt.zero_grad()
        t = k
        if t % 2 == 1:  # the update from count t - 1 (even) was a noisy one: H's only updates
            h, decays = beta2 * h + 0.5 * (1 - beta2) ** 2 * h * h / (h + delta), decays + 1
        assert float(opt.state[weights[0]]["step"]) == t
        assert float(opt.state[weights[0]]["hess"].max()) == pytest.approx(h, rel=1e-12)
        share = opt.posterior_health(warn=False)["hess_init_share"]
        assert share == pytest.approx(h0 * beta2**decays / h, rel=1e-12)
    assert decays == 5 and 0.9999 < share < 1.0


@pytest.mark.parametrize("gamma", [None, 2.0])
def test_hess_init_share_falls_when_the_data_has_curvature(gamma: float | None) -> None:
    """A loss with curvature 100 per weight. Without Hessian clipping H learns it and h0's
    share falls to almost 0; with the default γ = 2 the estimate is clipped to 2·H, so H grows
    by a factor ≤ β2 + (1−β2)·γ + (1−β2)² per update (the last term bounds IVON's correction)
    and 200 steps leave h0's share ≥ (β2 / that factor)ᵗ ≈ 0.14: H cannot follow the data fast."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False))
    opt = EVON(list(model.parameters()), ess=1e6, hess_clip_ratio=gamma, hess_estimator="price")
    for _ in range(200):
        with opt.sampled_params(train=True):
            (50.0 * model[0].weight.square().sum()).backward()  # Hessian 100·I
        opt.step()
        opt.zero_grad()
    stats = opt.posterior_health(warn=False)
    t, (_, beta2) = 199, opt.param_groups[0]["betas"]  # the first step only sets up the eigenbases
    if gamma is None:
        assert stats["hess_mean"] > 10.0 and stats["hess_init_share"] < 1e-3
    else:
        growth = beta2 + (1 - beta2) * gamma + (1 - beta2) ** 2
        assert stats["hess_max"] <= DEFAULT_HESS_INIT * growth**t * (1 + 1e-5)
        assert 0.1 < (beta2 / growth) ** t <= stats["hess_init_share"] < 1.0


def test_posterior_health_leaves_out_frozen_matrices_that_never_had_a_gradient() -> None:
    """Frozen matrices (``requires_grad=False``) in EVON's group, one sharing the trained matrix's
    bucket and one in a bucket of its own, never get a gradient: their H stayed h0 and counted in
    every statistic (a share of h0 near 1, a below-prior share near 0, the noise of weights never
    sampled). The statistics are the trained matrix's alone, computed here by hand (Price: h0·β2ᵗ)."""
    torch.manual_seed(0)
    trained, twin, other = nn.Linear(8, 6, bias=False), nn.Linear(8, 6, bias=False), nn.Linear(8, 5, bias=False)
    twin.weight.requires_grad_(False)
    other.weight.requires_grad_(False)
    delta, ess = 3e-2, 1e4
    opt = EVON([trained.weight, twin.weight, other.weight], ess=ess, weight_decay=delta, hess_estimator="price")
    x = torch.randn(16, 8)
    for _ in range(6):  # the first step sets up the eigenbases: 5 updates of H
        with opt.sampled_params(train=True):
            (trained(x).square().sum() + (twin(x) + other(x).sum()).sum()).backward()
        opt.step()
        opt.zero_grad()
    assert all(bool(opt.state[p.weight]["hess"].eq(DEFAULT_HESS_INIT).all()) for p in (twin, other))
    hess, w = opt.state[trained.weight]["hess"].double(), trained.weight.detach().double()
    h0, beta2 = DEFAULT_HESS_INIT, opt.param_groups[0]["betas"][1]
    stats = opt.posterior_health(warn=False)
    assert stats["hess_init_share"] == pytest.approx(h0 * beta2**5 * hess.numel() / float(hess.sum()), rel=1e-12)
    assert stats["hess_below_prior"] == float((opt.state[trained.weight]["hess"] < delta).double().mean())
    assert stats["hess_mean"] == pytest.approx(float(hess.mean()), rel=1e-12)
    assert (stats["hess_min"], stats["hess_max"]) == (float(hess.min()), float(hess.max()))
    var = 1.0 / (ess * (hess + delta))
    assert stats["noise_to_signal"] == pytest.approx(math.sqrt(float(var.sum() / w.square().sum())), rel=1e-5)
    assert stats["prior_to_signal"] == pytest.approx(
        math.sqrt(hess.numel() / (ess * delta) / float(w.square().sum())), rel=1e-5
    )


def test_runaway_noise_warns_once_naming_the_cause() -> None:
    """ess = N-style noise on a small model: the std dwarfs the weights (the issue's MLP case)."""
    model = mlp()
    opt = EVON([p for p in model.parameters() if p.ndim == 2], ess=50.0)
    one_sample(opt, model)
    with pytest.warns(RuntimeWarning, match="runaway posterior noise.*ess"):
        stats = opt.posterior_health()
    assert stats["noise_to_signal_max"] >= 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.posterior_health()  # once only


def _trained_at_defaults() -> tuple[EVON, list[torch.Tensor]]:
    """EVON at its defaults over the MLP's matrices (named "in", "hidden", "out") after three steps."""
    model = mlp()
    weights = [p for p in model.parameters() if p.ndim == 2]
    opt = EVON([{"params": weights, "param_names": ["in", "hidden", "out"]}])
    for seed in range(3):
        one_sample(opt, model, seed)
        opt.step()
        opt.zero_grad()
    return opt, weights


def test_runaway_noise_at_the_fitted_defaults_names_the_matrix_and_no_default_as_its_fix() -> None:
    """At the defaults (ess='auto', fitted to the pooled curvature) a matrix the loss drives towards
    zero ends with weights below its noise (a tiny BERT's attention query/key on a bag-of-words task:
    1.08x at step 100). The warning named no matrix and advised ess='auto', which was already set."""
    opt, weights = _trained_at_defaults()
    assert opt.posterior_health(warn=False)["noise_to_signal_max"] < 1.0  # every matrix watched
    with torch.no_grad():
        weights[1].mul_(1e-3)  # the hidden matrix shrank, its curvature (so its noise) unchanged
    std = float(opt.posterior_std(weights[1]).square().mean().sqrt())
    ratio = std / float(weights[1].detach().square().mean().sqrt())
    assert ratio > 1.0
    with pytest.warns(RuntimeWarning, match="runaway posterior noise") as caught:
        opt.posterior_health()
    message = str(caught[0].message)
    assert f"{ratio:.3g}x the RMS of hidden (shape (16, 16))" in message
    assert "ess='auto' (the default" not in message  # what the optimizer already runs with
    assert "shrank" in message


def _shrunk_hidden_matrix() -> tuple[EVON, list[torch.Tensor]]:
    """Three steps at the defaults, then the hidden matrix shrunk 1000x: its noise runs away (as above)."""
    opt, weights = _trained_at_defaults()
    with torch.no_grad():
        weights[1].mul_(1e-3)
    return opt, weights


def test_the_runaway_warning_names_the_parameter_a_bucket_member_stands_for() -> None:
    """Under FSDP2 a bucket member is its owner's full copy of a DTensor parameter, which the groups do
    not list (``hooks.model_param`` maps it back): the warning named "a parameter of shape (16, 16)"."""
    from hf_evon.optim.hooks import ShardingHooks

    opt, weights = _shrunk_hidden_matrix()
    (bucket, i) = next((b, i) for b in opt.buckets for i, q in enumerate(b.params) if q is weights[1])
    copy = weights[1].detach().clone().requires_grad_(True)  # the full copy that stands for it
    bucket.params[i] = copy

    class FullCopies(ShardingHooks):
        def model_param(self, q: torch.Tensor) -> torch.Tensor:
            return weights[1] if q is copy else q

    opt.sharding = FullCopies()
    with pytest.warns(RuntimeWarning, match="runaway posterior noise") as caught:
        opt.posterior_health()
    assert "x the RMS of hidden (shape (16, 16))" in str(caught[0].message)


def test_the_runaway_warning_names_no_matrix_of_this_rank_below_the_pooled_maximum() -> None:
    """Sharded, the maximum is over every rank's matrices (``pool_rows``): where another rank's matrix
    has the larger ratio, this rank named its own runaway matrix beside the other's ratio."""
    from hf_evon.optim.hooks import ShardingHooks

    opt, weights = _shrunk_hidden_matrix()
    local = opt.posterior_health(warn=False)["noise_to_signal_max"]
    assert local > 1.0
    opt._health_warned.clear()

    class TwoRanks(ShardingHooks):
        def pool_rows(self, rows: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
            other = rows[:1].clone()
            other[0, 6] = 10 * local  # another rank's matrix, further gone than this rank's
            return torch.cat([rows, other]), 2 * count

    opt.sharding = TwoRanks()
    with pytest.warns(RuntimeWarning, match="runaway posterior noise") as caught:
        opt.posterior_health()
    message = str(caught[0].message)
    assert f"its std is {10 * local:.3g}x the RMS of a weight matrix," in message
    assert "hidden" not in message


def test_posterior_health_inside_a_sample_measures_the_mean_weights() -> None:
    """Inside ``sampled_params`` the weights hold a sample: the RMS weight was the sample's, so
    ess=50 noise of ~16x the mean's RMS read as ~1x (noise over mean plus noise) and the runaway
    check missed it; the statistics are of the posterior, whose weights are the mean."""
    model = mlp()
    weights = [p for p in model.parameters() if p.ndim == 2]
    opt = EVON(weights, ess=50.0, weight_decay=1e-3)
    for seed in range(2):
        one_sample(opt, model, seed)
        opt.step()
        opt.zero_grad()
    outside, mean = opt.posterior_health(warn=False), weights[0].detach().clone()
    assert outside["noise_to_signal_max"] > 1.0
    for train in (False, True):
        with opt.sampled_params(train=train):
            assert not torch.equal(weights[0], mean)  # a sample is in
            inside = opt.posterior_health(warn=False)
        assert inside == pytest.approx(outside, rel=1e-6)
        opt.discard_samples()


def test_the_runaway_watch_resumes_with_the_state() -> None:
    """A resumed run rebuilt the watch from the weights at the resume: LoRA's B, grown from zero
    but still below its noise, was watched at once, and the health check reported (and warned of)
    runaway noise the uninterrupted run did not see."""

    def make() -> tuple[nn.Parameter, nn.Parameter, EVON]:
        torch.manual_seed(0)
        a, b = nn.Parameter(torch.randn(4, 16) / 4), nn.Parameter(torch.zeros(16, 4))
        return a, b, EVON([a, b], seed=0)

    x = torch.randn(32, 16)
    a, b, opt = make()
    for _ in range(2):
        with opt.sampled_params(train=True):
            (x @ a.T @ b.T).square().mean().backward()
        opt.step()
        opt.zero_grad()
    saved = copy.deepcopy(opt.state_dict())
    a2, b2, resumed = make()
    with torch.no_grad():
        a2.copy_(a)
        b2.copy_(b)
    resumed.load_state_dict(saved)
    straight = opt.posterior_health(warn=False)
    assert float(opt.posterior_std(b).square().mean().sqrt()) > float(b.detach().square().mean().sqrt()) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resumed.posterior_health() == straight
    assert straight["noise_to_signal_max"] < 1.0  # A's alone: B is not watched yet


def test_a_zero_initialised_matrix_is_watched_for_runaway_noise_once_it_outgrows_its_noise() -> None:
    """LoRA's B starts at zero, so its noise is infinitely larger than its weights until training
    has grown it: with EVONTrainer's health logged at the first steps (logging_steps=1, as TRL's
    examples do) every LoRA run warned "runaway posterior noise ... 7.5e+17x", naming a cause
    (ess too small) that was not there. B is left out of the per-matrix maximum until its noise
    is below its RMS; from then on it is watched like any other matrix."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(4, 16) / 4), nn.Parameter(torch.zeros(16, 4))
    opt = EVON([a, b])  # the defaults: ess="auto" sizes the noise from A (B says nothing of scale)
    x = torch.randn(32, 16)

    def step() -> None:
        with opt.sampled_params(train=True):
            (x @ a.T @ b.T).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def noise_to_signal(p: torch.Tensor) -> float:
        group = opt.param_groups[0]
        var = 1.0 / (group["ess"] * (opt.state[p]["hess"].double() + group["weight_decay"]))
        return math.sqrt(float(var.sum() / p.detach().double().square().sum()))

    step()  # sets up the eigenbases: B is still exactly zero, H = h0, and A's noise is the auto 5%
    assert noise_to_signal(a) == pytest.approx(DEFAULT_INIT_STD_RATIO, rel=1e-5)
    step()  # B's first update: non-zero, far below its noise (health first checked here when logging_steps=2)
    assert noise_to_signal(b) > 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = opt.posterior_health()
    assert stats["noise_to_signal_max"] == pytest.approx(noise_to_signal(a), rel=1e-5)  # A's alone
    with torch.no_grad():
        b.copy_(torch.randn(16, 4))  # trained into a scale of its own: watched from now on
    assert opt.posterior_health(warn=False)["noise_to_signal_max"] < 1.0
    with torch.no_grad():
        b.mul_(1e-6)  # and its noise now swamps it
    with pytest.warns(RuntimeWarning, match="runaway posterior noise"):
        assert opt.posterior_health()["noise_to_signal_max"] > 1.0


def test_a_watched_matrix_pruned_to_zero_leaves_the_runaway_watch() -> None:
    """AdaLoRA's final allocation can prune every rank of a ``lora_E`` to exactly 0 (off, not uncertain:
    samples keep it 0). Watched before, its ratio became sqrt(Σ V / tiny): ``noise_to_signal_max``
    1.9e151 in the logs and a runaway warning naming the pruned matrix. A matrix that is exactly 0 has
    no scale to compare its noise with, as before it was first watched."""
    torch.manual_seed(0)
    a, e = nn.Parameter(torch.randn(4, 16) / 4), nn.Parameter(torch.randn(8, 1))
    opt = EVON([a, e])
    x = torch.randn(32, 16)
    for _ in range(3):
        with opt.sampled_params(train=True):
            ((x @ a.T).sum(1, keepdim=True) @ e.T).square().mean().backward()
        opt.step()
        opt.zero_grad()
    group = opt.param_groups[0]
    ratio = lambda p: math.sqrt(float((1.0 / (group["ess"] * (opt.state[p]["hess"].double() + group["weight_decay"]))).sum() / p.detach().double().square().sum()))  # noqa: E731
    assert opt.posterior_health(warn=False)["noise_to_signal_max"] == pytest.approx(max(ratio(a), ratio(e)), rel=1e-5)
    with torch.no_grad():
        e.zero_()  # every rank pruned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = opt.posterior_health()
    assert stats["noise_to_signal_max"] == pytest.approx(ratio(a), rel=1e-5)


@pytest.mark.parametrize("estimator", ["fisher", "price"])
def test_the_collapse_warning_names_the_cause_of_the_estimator_in_use(estimator: str) -> None:
    """Under the default Fisher estimate H is the squared gradients' average, not h0's decay (its
    ``hess_init_share`` is 0), but the warning named "a noise-dominated Hessian estimate ... decays as
    hess_init·betas[1]^t" and "a larger betas[1]" as the fix. And a share of 99.5% read "100%"."""
    model = mlp()
    weights = [p for p in model.parameters() if p.ndim == 2]
    opt = EVON(weights, weight_decay=2.5e-5, hess_estimator=estimator)
    one_sample(opt, model)
    for p in weights:
        opt.state[p]["hess"].fill_(1e-9)
    opt.state[weights[0]]["hess"].view(-1)[0] = 1.0  # 431 of the 432 entries below δ: 99.8%
    with pytest.warns(RuntimeWarning, match="collapsed to the prior") as caught:
        stats = opt.posterior_health()
    text = next(str(w.message) for w in caught if "collapsed to the prior" in str(w.message))
    assert 0.995 < stats["hess_below_prior"] < 1.0 and f"in {math.floor(100 * stats['hess_below_prior'])}% of" in text
    assert ("betas[1]" in text) is (estimator == "price") and "weight_decay=None" in text
    if estimator == "fisher":
        assert "above most of the data's curvature" in text


def test_collapse_to_a_broad_prior_warns_once() -> None:
    model = mlp()
    weights = [p for p in model.parameters() if p.ndim == 2]
    opt = EVON(weights, weight_decay=2.5e-5)  # the prior's std is the weights' RMS (the old default)
    one_sample(opt, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.posterior_health()  # healthy at the start: no warning
    for p in weights:
        opt.state[p]["hess"].fill_(1e-9)  # what a noise-dominated estimate decays to
    with pytest.warns(RuntimeWarning, match="collapsed to the prior.*weight_decay=None"):
        stats = opt.posterior_health()
    assert stats["hess_below_prior"] == 1.0 and stats["prior_to_signal"] >= COLLAPSE_PRIOR_TO_SIGNAL


def test_a_decayed_hessian_leaves_the_default_noise_at_the_priors_quarter_of_the_rms() -> None:
    """Before, the default prior let the noise of a decayed H grow to the weights' RMS, and warned."""
    model = mlp()
    weights = [p for p in model.parameters() if p.ndim == 2]
    opt = EVON(weights)
    one_sample(opt, model)
    for p in weights:
        opt.state[p]["hess"].fill_(1e-9)
    g = opt.param_groups[0]
    expected = math.sqrt(1.0 / (g["ess"] * (1e-9 + g["weight_decay"])) / pooled_rms_sq(weights))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = opt.posterior_health()
    assert stats["hess_below_prior"] == 1.0
    assert stats["noise_to_signal"] == pytest.approx(expected, rel=1e-5)
    assert stats["noise_to_signal"] < 1.001 * DEFAULT_PRIOR_STD_RATIO


def test_a_long_default_run_neither_runs_away_nor_warns() -> None:
    """The long run in miniature. Under the Price estimate H follows h0·β2ᵗ down (the clipped
    estimate is mostly noise), so after ~800 steps the noise is the prior's; with the old default
    prior (δ = 2.5e-5) this run warned of a collapse to the prior at step 1400 (H < δ in 80% of
    the entries), and its noise kept growing: 0.276 of the weights' RMS at step 1400 against 0.093
    with the default δ. Under the defaults (the Fisher estimate, ζ and δ fitted to it) most of H is
    above the prior at the end, and the noise stays at its fitted level."""
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = (x[:, :3].sum(-1) > 0).long() + (x[:, 3] > 1).long()
    caught, stats = [], {}
    price = dict(hess_estimator="price", step_curvature="entry")
    for name, kwargs in (("price", price), ("old prior", dict(price, weight_decay=2.5e-5)), ("defaults", {})):
        model = mlp()
        opt = build_optimizer(model, seed=0, **kwargs)
        opt.health_check_every = 200
        gen = torch.Generator().manual_seed(0)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for _ in range(1400):
                i = torch.randint(0, 256, (32,), generator=gen)
                with opt.sampled_params(train=True):
                    nn.functional.cross_entropy(model(x[i]), y[i]).backward()
                opt.step()
                opt.zero_grad()
        stats[name] = opt.posterior_health(warn=False)
        caught += [str(w.message) for w in record if name != "old prior" and issubclass(w.category, RuntimeWarning)]
    assert caught == []
    assert stats["price"]["hess_below_prior"] > 0.5  # decayed, and bounded by the prior
    assert stats["price"]["noise_to_signal_max"] < 2 * DEFAULT_PRIOR_STD_RATIO
    # the old prior: the noise grows on past the default prior's bound (its prior has std 0.35x
    # the weights' RMS by now, as they grew: under COLLAPSE_PRIOR_TO_SIGNAL, so no warning either)
    assert stats["old prior"]["noise_to_signal"] > 2 * stats["price"]["noise_to_signal"]
    # the defaults: the data's curvature, at the fitted noise level
    assert stats["defaults"]["hess_below_prior"] <= 0.5 and stats["defaults"]["hess_init_share"] == 0.0
    assert stats["defaults"]["noise_to_signal"] == pytest.approx(noise_std_ratio(1400), rel=0.25)
    assert stats["defaults"]["noise_to_signal_max"] < 2 * DEFAULT_PRIOR_STD_RATIO


def test_step_checks_health_periodically() -> None:
    model = mlp()
    opt = EVON([p for p in model.parameters() if p.ndim == 2], ess=50.0)
    opt.health_check_every = 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(3):
            one_sample(opt, model, seed=s)
            opt.step()
            opt.zero_grad()
    assert sum("runaway" in str(w.message) for w in caught) == 1


@pytest.mark.parametrize("name", ["nanogpt", "llama", "clip-finetuning"])
def test_recipes_are_the_paper_tables_and_explicit_arguments_win(name: str) -> None:
    from hf_evon import RECIPES

    model = mlp()
    opt = build_optimizer(model, recipe=name, lr=0.123)
    group = next(g for g in opt.param_groups if g["algorithm"] == "evon")
    for key, value in RECIPES[name].items():
        if key != "lr":
            assert group[key] == (tuple(value) if isinstance(value, tuple) else value), key
    assert group["lr"] == 0.123


@pytest.mark.parametrize("name", ["nanogpt", "clip-finetuning"])
def test_a_recipes_rate_is_the_papers_for_lora_adapters_too(name: str) -> None:
    """A LoRA model's adapters took the default adapter scale times the recipe's α (nanogpt 0.0172 →
    0.043, clip-finetuning 0.055 → 0.1375): a scale that sizes an α derived from an AdamW rate, which a
    recipe's tabled α is not. Under a recipe every EVON group runs at its α; adapter_lr_scale given wins."""
    import peft

    from hf_evon import RECIPES

    model = peft.get_peft_model(mlp(), peft.LoraConfig(r=2, target_modules=["0", "2"]))
    rates = {g["lr"] for g in build_optimizer(model, recipe=name).param_groups if g["algorithm"] == "evon"}
    assert rates == {RECIPES[name]["lr"]}
    scaled = build_optimizer(model, recipe=name, adapter_lr_scale=0.5).param_groups
    assert {g["lr"] for g in scaled if g["algorithm"] == "evon"} == {RECIPES[name]["lr"] * 0.5}


def test_the_nanogpt_recipe_is_its_table_row() -> None:
    """Spot check against the paper's Table (EVON (NanoGPT)): ζ 5.27e6, h0 0.582, α 1.72e-2,
    β1 0.943, 1-β2 9.12e-4, δ 1e-6, β3 0.995, γ 1.5."""
    from hf_evon import RECIPES

    r = RECIPES["nanogpt"]
    assert (
        r["ess"],
        r["hess_init"],
        r["lr"],
        r["weight_decay"],
        r["shampoo_beta"],
        r["hess_clip_ratio"],
    ) == (
        5.27e6,
        0.582,
        1.72e-2,
        1e-6,
        0.995,
        1.5,
    )
    assert r["betas"][0] == 0.943 and 1 - r["betas"][1] == pytest.approx(9.12e-4)


def test_an_unknown_recipe_names_the_choices() -> None:
    with pytest.raises(ValueError, match="clip-finetuning"):
        build_optimizer(mlp(), recipe="gpt5")


def test_lora_adapters_get_their_own_group_at_adamws_step() -> None:
    import peft

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"]))
    opt = build_optimizer(model, lr=0.03, clip="element")
    evon = [g for g in opt.param_groups if g["algorithm"] == "evon"]
    adapters = [g for g in evon if all("lora_" in n for n in g["param_names"])]
    assert len(adapters) == 1 and adapters[0]["lr"] == pytest.approx(0.03 * 2.5)  # 1.0 / 0.4
    # the default clip ("whiten_rms"): adapters at 0.625x, so their steps have entry RMS 1.6·0.625 = 1.0·rate
    whitened = build_optimizer(model, learning_rate=1e-3)
    rates = sorted(g["lr"] for g in whitened.param_groups if g["algorithm"] == "evon")
    assert rates == pytest.approx([0.1], rel=1e-12)  # 1.6 · 1e-3 / 0.01 · 0.625
    assert sorted(adapters[0]["param_names"]) == sorted(
        n for n, p in model.named_parameters() if "lora_" in n and p.requires_grad
    )
    # every clip mode's adapters step at ADAPTER_STEP_RATIO·rate per entry, AdamW's step: the scale
    # undoes the mode's step ratio (LoRA through PEFT and full fine-tuning's new head alike)
    from hf_evon.optim.defaults import (
        ADAPTER_STEP_RATIO,
        STEP_RATIOS,
        default_adapter_lr_scale,
        lr_from_adamw_lr,
    )

    assert ADAPTER_STEP_RATIO == 1.0
    for clip, finetuning in STEP_RATIOS:
        alpha = lr_from_adamw_lr(2e-4, clip=clip, finetuning=finetuning)
        scale = default_adapter_lr_scale(clip, finetuning)
        assert alpha * scale * 0.01 == pytest.approx(ADAPTER_STEP_RATIO * 2e-4, rel=1e-12)
    assert default_adapter_lr_scale("whiten", True) == pytest.approx(1 / STEP_RATIOS[("element", True)])
    same = build_optimizer(model, lr=0.03, adapter_lr_scale=1)
    assert [g["lr"] for g in same.param_groups if g["algorithm"] == "evon"] == [0.03]
    with pytest.raises(ValueError, match="adapter_lr_scale"):
        build_optimizer(model, adapter_lr_scale=0)
    # inf was taken, and refused as the adapters' "Invalid lr: inf", an argument not given
    with pytest.raises(ValueError, match=r"Invalid adapter_lr_scale: inf \(must be None or a finite number > 0\)"):
        build_optimizer(model, adapter_lr_scale=float("inf"))


@pytest.mark.parametrize("kind", ["lora_embedding", "lokr", "loha", "ia3"])
def test_every_peft_adapter_kind_gets_the_adapter_rate(kind: str) -> None:
    """Whatever PEFT adds and trains is new inside the pretrained model, not only lora_A/lora_B:
    LoRA on an embedding (lora_embedding_A/B), LoKr's, LoHa's and IA3's factors step at the
    adapters' rate too (they stepped at the whole rate, 1.6× AdamW's step under "whiten_rms")."""
    import peft

    torch.manual_seed(0)

    class Base(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(20, 16)
            self.proj = nn.Linear(16, 16)
            self.out = nn.Linear(16, 3)

    config = {
        "lora_embedding": peft.LoraConfig(r=2, target_modules=["emb", "proj"]),
        "lokr": peft.LoKrConfig(r=2, target_modules=["proj"]),
        "loha": peft.LoHaConfig(r=2, target_modules=["proj"]),
        "ia3": peft.IA3Config(target_modules=["proj"], feedforward_modules=[]),
    }[kind]
    model = peft.get_peft_model(Base(), config)
    opt = build_optimizer(model, learning_rate=1e-3)
    evon = [(n, g["lr"]) for g in opt.param_groups if g["algorithm"] == "evon" for n in g["param_names"]]
    assert evon and all(lr == pytest.approx(0.1, rel=1e-12) for _, lr in evon), evon  # 1.6·1e-3/0.01·0.625


@pytest.mark.parametrize("tied", [True, False])
def test_trainable_tokens_on_a_tied_head_are_an_adapters_tensor(tied: bool) -> None:
    """LoRA with ``trainable_token_indices`` on a GPT-2 whose head is tied to its embedding: PEFT's
    TrainableTokensWrapper is then the head, and its token delta was counted as the head's own weight
    (AdamW: no posterior, no warning), while untied it is EVON's. Either way it is an adapter's tensor,
    at the adapters' rate beside the LoRA factors."""
    import peft
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16, tie_word_embeddings=tied))
    config = peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, trainable_token_indices=[3, 5])
    opt = build_optimizer(peft.get_peft_model(base, config))
    where = {n: (g["algorithm"], g["lr"]) for g in opt.param_groups for n in g["param_names"]}
    (delta,) = [n for n in where if "trainable_tokens_delta" in n]
    lora = [v for n, v in where.items() if "lora_" in n]
    assert lora and where[delta] == lora[0] and lora[0][0] == "evon"


def _moves_under_binding_clip(opt: EVON, model: nn.Module) -> list[torch.Tensor]:
    """Each EVON matrix's change in the second step, under full-rank gradients far above H."""
    evon_params = [p for g in opt.param_groups if g["algorithm"] == "evon" for p in g["params"]]
    gen = torch.Generator().manual_seed(0)
    for t in range(2):  # the first step only initialises the eigenbases
        before = [p.detach().clone() for p in evon_params]
        one_sample(opt, model, seed=t)
        for p in model.parameters():
            p.grad = 1e3 * torch.randn(p.shape, generator=gen)  # H << |momentum|: the clip binds
        opt.step()
        opt.zero_grad()
    return [p.detach() - old for p, old in zip(evon_params, before)]


def test_learning_rate_is_adamws_rate_and_sets_an_alpha_of_equal_step_size() -> None:
    from hf_evon.optim.defaults import STEP_RATIOS, lr_from_adamw_lr

    model = mlp()
    # from scratch the default clip is "whiten_rms": entry RMS α·radius = 1.6·rate (before min(1, ρ),
    # which is 1 on the first update: m̂ is one gradient)
    opt = build_optimizer(model, learning_rate=5e-5)
    rates = {g["algorithm"]: g["lr"] for g in opt.param_groups}
    assert rates == {"evon": pytest.approx(0.008, rel=1e-12), "adamw": 5e-5}
    assert {g["clip"] for g in opt.param_groups if g["algorithm"] == "evon"} == {"whiten_rms"}
    for move in _moves_under_binding_clip(opt, model):
        # Newton–Schulz leaves singular values in ~[0.7, 1.2], not exactly 1
        rms = move.square().mean().sqrt().item()
        assert 0.6 * 1.6 * 5e-5 < rms < 1.25 * 1.6 * 5e-5, rms
    # the step-size rule: α·radius = ratio·rate for every radius, the ratio of the clip mode
    for radius in (0.01, 0.5):
        for clip, finetuning in STEP_RATIOS:
            alpha = lr_from_adamw_lr(3e-4, radius, clip=clip, finetuning=finetuning)
            assert alpha * radius == pytest.approx(STEP_RATIOS[(clip, finetuning)] * 3e-4, rel=1e-12)
    assert STEP_RATIOS[("element", False)] == 0.4 and STEP_RATIOS[("whiten_rms", False)] == 1.6
    with pytest.raises(ValueError, match="clip"):
        lr_from_adamw_lr(1e-3, clip="whiten")  # no measured ratio: α is the user's to set
    # clip=None (EVONConfig's unset evon_clip) is the default, or the recipe's own clip
    assert {g["clip"] for g in build_optimizer(model, clip=None).param_groups} == {"whiten_rms"}
    recipe_clip = build_optimizer(model, recipe="clip-finetuning", clip=None).param_groups
    assert {g["clip"] for g in recipe_clip} == {"whiten"}
    # the paper's per-entry step: every entry's Newton step exceeds the radius here
    opt = build_optimizer(model, learning_rate=5e-5, clip="element", hess_estimator="price", step_curvature="entry")
    assert {g["algorithm"]: g["lr"] for g in opt.param_groups} == {
        "evon": pytest.approx(0.002, rel=1e-12),
        "adamw": 5e-5,
    }
    # the element clip acts in the weights' own basis: every entry moves by exactly α·radius = 0.4·rate
    moves = torch.cat([m.abs().flatten() for m in _moves_under_binding_clip(opt, model)])
    assert torch.allclose(moves, torch.full_like(moves, 0.4 * 5e-5), rtol=1e-3)
    # explicit α, explicit AdamW rate and a recipe's α win over the derived ones
    both = build_optimizer(model, learning_rate=5e-5, lr=0.07, adamw_lr=1e-2)
    assert {g["algorithm"]: g["lr"] for g in both.param_groups} == {"evon": 0.07, "adamw": 1e-2}
    recipe = build_optimizer(model, learning_rate=5e-5, recipe="nanogpt")
    from hf_evon import RECIPES

    assert {g["algorithm"]: g["lr"] for g in recipe.param_groups} == {
        "evon": RECIPES["nanogpt"]["lr"],
        "adamw": 5e-5,
    }
    with pytest.raises(ValueError, match="adamw_lr"):
        lr_from_adamw_lr(float("nan"))
    for bad_ratio in (0.0, float("inf"), -0.5):
        with pytest.raises(ValueError, match="step_ratio"):
            lr_from_adamw_lr(1e-3, step_ratio=bad_ratio)
    for bad in (float("nan"), -1e-3, "1e-3", True):  # named as learning_rate even when α is given
        with pytest.raises(ValueError, match="learning_rate"):
            build_optimizer(model, learning_rate=bad, lr=0.02)
    # beyond float32, or an α = ratio·rate/radius beyond it: named as given, not as adamw_lr or lr
    for given in ({"learning_rate": 1e39}, {"learning_rate": 1e39, "adamw_lr": 1e-3}, {"learning_rate": 1e38}):
        with pytest.raises(ValueError, match=r"learning_rate(=|: )1e\+3[89]"):
            build_optimizer(model, **given)
    with pytest.raises(ValueError, match=r"sized from clip_radius=1e-300"):
        build_optimizer(model, clip_radius=1e-300)
    assert build_optimizer(model, learning_rate=1e30).param_groups[0]["lr"] == lr_from_adamw_lr(1e30)  # in range


def test_evons_default_rate_follows_its_clip_mode() -> None:
    """lr=None: AdamW's default 1e-3 through the clip mode's measured step ratio (α·radius = ratio·1e-3)."""
    params = list(mlp().parameters())
    assert EVON(params).defaults["lr"] == pytest.approx(1.6 * 1e-3 / 0.01, rel=1e-12)  # "whiten_rms"
    assert EVON(params, clip="element").defaults["lr"] == pytest.approx(0.4 * 1e-3 / 0.01, rel=1e-12)
    assert EVON(params, clip="element", clip_radius=0.1).defaults["lr"] == pytest.approx(0.4 * 1e-3 / 0.1)
    assert EVON(params, clip="spectral").defaults["lr"] == pytest.approx(0.04)  # no ratio: the element one
    assert EVON(params).defaults["snr_scaling"] == "adam"  # DEFAULT_SNR_SCALING
    assert EVON(params, lr=0.3, clip="element").defaults["lr"] == 0.3
    with pytest.raises(ValueError, match="clip"):
        EVON(params, clip="sign")


def test_clipped_steps_shrink_when_the_gradients_fade() -> None:
    """The quickstart's failure, reduced: a clipped step kept its size (α·radius) after the data
    were fitted, so a rate held high made the mean wander. With ``snr_scaling`` the step is
    scaled by min(1, ρ/ρ₀) (ρ = ‖m̂‖ / sqrt(EMA‖G‖²), ρ₀ = sqrt((1−β1)/(1+β1))), computed here
    from the gradient sequence alone: 1 while a steady gradient carries signal, ≪ 1 once the
    gradients fade to small noise. Same gradients, same bases, no prior term (δ = 0: U does not
    depend on the weights): the two runs differ only by the scale."""
    from hf_evon.optim.defaults import SNR_AVERAGE_BETA, snr_floor

    gen = torch.Generator().manual_seed(0)
    steady = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    grads = [steady] * 40 + [1e-2 * torch.randn(6, 4, generator=gen, dtype=torch.float64) for _ in range(160)]
    betas = (0.95, 0.995)
    runs = {}
    for scaled in (True, False, "adam"):
        w = nn.Parameter(torch.zeros(6, 4, dtype=torch.float64))
        opt = EVON([w], lr=0.1, ess=float("inf"), betas=betas, weight_decay=0.0, clip="whiten_rms", snr_scaling=scaled)
        steps = []
        for g in grads:
            before = w.detach().clone()
            w.grad = g.clone()
            opt.step()
            steps.append(float((w.detach() - before).norm()))
        runs[scaled] = steps[1:]  # the first step only builds the eigenbases
    # the expected scale, from the gradients (the first one only initialised the bases)
    m = v = 0.0
    expected, expected_adam = [], []
    for t, g in enumerate(grads[1:], start=1):
        m = betas[0] * m + (1 - betas[0]) * g
        v = SNR_AVERAGE_BETA * v + (1 - SNR_AVERAGE_BETA) * float(g.square().sum())
        rho = float((m / (1 - betas[0] ** t)).norm()) / math.sqrt(v / (1 - SNR_AVERAGE_BETA**t))
        expected.append(min(1.0, rho / snr_floor(betas[0])))
        expected_adam.append(min(1.0, rho))
    measured = [a / b for a, b in zip(runs[True], runs[False])]
    torch.testing.assert_close(torch.tensor(measured), torch.tensor(expected), rtol=1e-6, atol=1e-9)
    # snr_scaling="adam" (full fine-tuning's default): min(1, ρ), Adam's own step size, no knee
    measured_adam = [a / b for a, b in zip(runs["adam"], runs[False])]
    torch.testing.assert_close(torch.tensor(measured_adam), torch.tensor(expected_adam), rtol=1e-6, atol=1e-9)
    assert measured_adam[0] == pytest.approx(1.0) and max(measured_adam[-50:]) < 0.1 * snr_floor(betas[0]) + 1e-3
    assert measured[:39] == pytest.approx([1.0] * 39)  # signal: the full step
    assert max(measured[-50:]) < 0.1  # faded: a tenth of the step or less
    # the old step keeps α·radius in RMS: Newton–Schulz with Muon's coefficients leaves the singular
    # values in about [0.7, 1.2], never near 0
    unscaled_rms = torch.tensor(runs[False][-50:]) / math.sqrt(24) / (0.1 * 0.01)
    assert 0.7 <= float(unscaled_rms.min()) and float(unscaled_rms.max()) <= 1.2


def test_build_optimizer_says_when_evon_trains_none_of_the_parameters():
    """PEFT's prompt tuning of a causal LM trains one embedding, which goes to AdamW: the run was
    AdamW's, with no posterior and no word of it until BMA said "train with EVON first"."""
    import warnings

    from peft import PromptTuningConfig, TaskType, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_evon import build_optimizer

    base = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    prompted = get_peft_model(base, PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4))
    with pytest.warns(UserWarning, match="EVON trains none of this model's parameters"):
        opt = build_optimizer(prompted)
    assert not any(g["params"] for g in opt.param_groups if g["algorithm"] == "evon")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="EVON trains none")
        build_optimizer(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))


def test_learning_rate_takes_numpy_numbers_as_every_other_rate_does() -> None:
    """build_optimizer's learning_rate refused np.float32 ("must be a finite number >= 0"), which
    adamw_lr, lr and EVONConfig take: a rate read from a NumPy sweep grid. It now gives the groups
    a float's rates, as Python numbers (a state dict of NumPy numbers needs NumPy to load)."""
    import numpy as np

    model = mlp()
    rate = np.float32(3e-4)
    ours = build_optimizer(model, learning_rate=rate)
    theirs = build_optimizer(model, learning_rate=float(rate))
    rates = [(g["algorithm"], g["lr"]) for g in ours.param_groups]
    assert rates == [(g["algorithm"], g["lr"]) for g in theirs.param_groups]
    assert all(type(g["lr"]) is float for g in ours.param_groups)
    with pytest.raises(ValueError, match="learning_rate"):
        build_optimizer(model, learning_rate=np.float32("nan"))


def test_lr_from_adamw_lr_refuses_an_infinite_radius() -> None:
    """``lr_from_adamw_lr(1e-3, clip_radius=inf)`` returned α = 0 (a rate that trains nothing) where
    build_optimizer and EVONConfig refuse that radius."""
    from hf_evon.optim.defaults import lr_from_adamw_lr

    with pytest.raises(ValueError, match=r"Invalid clip_radius: inf \(must be a finite number > 0\)"):
        lr_from_adamw_lr(1e-3, clip_radius=float("inf"))


def test_pretrained_name_tells_loaded_weights_from_a_config_by_what_from_pretrained_leaves(tmp_path):
    """Pins the transformers behaviour ``modeling.pretrained_name`` relies on: ``from_pretrained`` sets
    ``config._name_or_path`` and leaves the private ``_weight_conversions`` on the model; ``from_config``
    of the same config keeps the name but not the list (a model trained from scratch)."""
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        BertConfig,
        BertForSequenceClassification,
    )

    from hf_evon.modeling import pretrained_name

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertForSequenceClassification(config).save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert loaded._weight_conversions is not None and pretrained_name(loaded) == str(tmp_path)
    scratch = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(tmp_path))
    assert scratch.config._name_or_path == str(tmp_path) and pretrained_name(scratch) == ""


@pytest.mark.parametrize("scale", [2e19, 1e-30])
def test_auto_ess_reads_the_weights_scale_where_float32_squares_over_or_underflow(scale: float) -> None:
    """Σ p² was taken in float32: weights of 2e19 squared to inf (ζ = 0, refused as an invalid ess at the
    first call) and weights of 1e-30 to 0 (read as all-zero: the fan-in's scale, noise 1e28 times the
    weights). In float64, ζ is its closed form 1/(ρ²·mean p²·(h0 + δ)) at both scales."""
    w = nn.Parameter(torch.full((4, 25), scale))
    opt = EVON([w], hess_init=1e-3, weight_decay=1e-3, init_std_ratio=0.1)
    with opt.sampled_params(train=True):
        w.sum().backward()
    expected = 1.0 / (0.1**2 * float(torch.tensor(scale, dtype=torch.float32)) ** 2 * (1e-3 + 1e-3))
    assert opt.param_groups[0]["ess"] == pytest.approx(expected, rel=1e-9, abs=0.0)


def test_auto_ess_whose_prior_float32_cannot_hold_is_refused_naming_auto_and_the_group() -> None:
    """Weights of 1e20: 5% of their RMS asks for a prior variance beyond float32. The refusal names
    ess='auto' and the group (it named an ess of 4.6e-36 the user never set), and leaves ess as it was."""
    w = nn.Parameter(torch.full((4, 4), 1e20))
    opt = EVON([w])
    with pytest.raises(ValueError, match=r"param_groups\[0\]: ess='auto' .* beyond float32"):
        with opt.sampled_params(train=True):
            pass
    assert opt.param_groups[0]["ess"] == "auto"
