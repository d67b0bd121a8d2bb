"""Post-hoc calibration of the sampling scale: grid search by held-out BMA NLL."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn

from hf_evon import EVONPosterior, build_optimizer
from hf_evon.predictive.calibration import calibrate_posterior
from hf_evon.predictive.logprobs import target_log_probs

# the calibration scores float32 logits with float32 exps (held_out.tempered_log_probs): each
# log-sum-exp within about 1e-6 of float64's, so an NLL of order 1 within this relative bound
FLOAT32_SCORING = 1e-6


def _mlp(seed: int, steps: int, logit_scale: float, fixed_batch: bool, **optimizer: object) -> tuple:
    """A 6-32-3 tanh MLP trained by EVON on labels drawn from softmax(logit_scale · x W): on fresh
    batches of 64, or ``fixed_batch``, on one batch of 64 throughout. Returns (model, posterior,
    the batch maker)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    w = torch.randn(6, 3)
    gen = torch.Generator().manual_seed(seed)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 6, generator=gen)
        return x, torch.distributions.Categorical(logits=logit_scale * x @ w).sample()

    fixed = batch(64) if fixed_batch else None
    opt = build_optimizer(model, seed=seed, **optimizer)
    for _ in range(steps):
        x, y = batch(64) if fixed is None else fixed
        with opt.sampled_params(train=True):
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, EVONPosterior.from_optimizer(opt, model), batch


def trained(seed: int = 0, steps: int = 30) -> tuple[nn.Module, EVONPosterior, list, list]:
    model, posterior, batch = _mlp(seed, steps, 2.0, False)
    return model, posterior, [batch(50) for _ in range(2)], [batch(50)]


def overfitted(seed: int = 0, steps: int = 300) -> tuple[nn.Module, EVONPosterior, list]:
    """An MLP trained on one fixed batch of 64 noisy labels: overconfident on held-out data (the
    mean's temperature there 4.8 at 300 steps, seed 0). Full-size steps (α 0.8, ``snr_scaling=True``):
    the defaults' min(1, ρ) keeps EVON from memorising the labels, which this case needs."""
    model, posterior, batch = _mlp(seed, steps, 0.7, True, lr=0.8, adamw_lr=1e-2, snr_scaling=True)
    return model, posterior, [batch(50) for _ in range(2)]


def as_trained(posterior: EVONPosterior) -> EVONPosterior:
    """``posterior`` as if EVON had trained it at its scale: no other trained ζ recorded to restore."""
    for key in ("trained_ess", "trained_ess_by_parameter"):
        posterior.config.pop(key, None)
    return posterior


def bma_nlls(model: nn.Module, posterior: EVONPosterior, batches: list, seeds: range) -> list[float]:
    """Reference: a plain loop over samples, averaging probabilities; NLL per example."""
    out = []
    for x, y in batches:
        probs = torch.zeros(len(y), 3, dtype=torch.float64)
        for s in seeds:
            with posterior.sampled(model, seed=s), torch.no_grad():
                probs += torch.softmax(model(x).double(), -1) / len(seeds)
        out += (-probs[torch.arange(len(y)), y].log()).tolist()
    return out


def bma_nll(model: nn.Module, posterior: EVONPosterior, batches: list, seeds: range) -> float:
    return statistics.fmean(bma_nlls(model, posterior, batches, seeds))


def draw_logits(model: nn.Module, posterior: EVONPosterior, batches: list, seeds: range) -> torch.Tensor:
    """Reference: every draw's logits of every example, by a plain loop ([S, examples, classes])."""
    out = []
    for s in seeds:
        with posterior.sampled(model, seed=s), torch.no_grad():
            out.append(torch.cat([model(x).double() for x, _ in batches]))
    return torch.stack(out)


def tempered_bma_nll(logits: torch.Tensor, y: torch.Tensor, t: float) -> float:
    """Reference: NLL of the average over draws of softmax(logits / t)."""
    probs = torch.softmax(logits / t, -1).mean(0)
    return float(-probs[torch.arange(len(y)), y].log().mean())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"grid": "13"}, ValueError, r"grid must hold finite multiples > 0; got \['1', '3'\]"),  # was [1, 3]
        ({"grid": [True]}, ValueError, r"grid must hold finite multiples > 0; got \[True\]"),  # was [1]
        ({"grid": []}, ValueError, r"grid must hold finite multiples > 0"),
        ({"shift_labels": "no"}, TypeError, r"shift_labels must be True, False or None; got 'no'"),  # was True
        ({"seed": 1.5}, TypeError, r"seed must be an integer"),
    ],
)
def test_calibration_arguments_are_not_coerced(kwargs, error, match) -> None:
    model, post, cal = overfitted()
    with pytest.raises(error, match=match):
        calibrate_posterior(model, post, cal, num_samples=2, **kwargs)


def test_labels_that_do_not_align_with_the_logits_are_named_for_a_direct_caller() -> None:
    # a torch IndexError from deep inside before (the trainer's path checked this, the function not)
    model, post, cal = overfitted()
    x, y = cal[0]
    with pytest.raises(ValueError, match=r"batch 0 \(counting from 0\): labels shaped \(1,\) do not align"):
        calibrate_posterior(model, post, [(x, y[:1])], num_samples=2)


@pytest.mark.parametrize("labels", [lambda y: y.numpy(), lambda y: y.tolist(), lambda y: None], ids=["array", "list", "none"])
def test_labels_that_are_not_a_tensor_are_named_by_their_type(labels) -> None:
    # refused as "labels shaped (20,) do not align with the model's logits (20, 3)", which they did
    model, post, cal = overfitted()
    x, y = cal[0]
    given = labels(y)
    with pytest.raises(TypeError, match=rf"batch 0 \(counting from 0\) has labels of type {type(given).__name__}: .*torch"):
        calibrate_posterior(model, post, [(x, given)], num_samples=2)


def test_one_target_has_no_standard_error_and_chooses_nothing_from_it() -> None:
    """The spread of one target's gain is unknown: its standard error was taken as 0, so any gain
    passed every "k standard errors" test and one confidently wrong example chose the grid's ends
    (0.001x the trained scale at T 8). With k > 0 nothing is taken from it; k = 0 still takes the
    lowest NLL, as documented."""
    model, post, cal = overfitted()
    x, y = cal[0]
    with torch.no_grad():
        own = model(x).log_softmax(-1).gather(1, y[:, None])[:, 0]
    i = int(own.argmin())  # the example the mean is most confidently wrong on
    one = [(x[i : i + 1], y[i : i + 1])]
    _, result = calibrate_posterior(model, post, one, num_samples=4, grid=[1.0, 0.01, 0.001])
    assert result.num_targets == 1 and result.temperature == 1.0
    assert result.ess in (result.trained_ess, math.inf)
    _, free = calibrate_posterior(model, post, one, num_samples=4, grid=[1.0, 0.01, 0.001], standard_errors=0.0)
    assert free.ess < free.trained_ess or free.temperature > 1.0  # more noise, or a softening


def test_a_wrapped_multi_label_model_is_refused_naming_its_problem_type() -> None:
    """A model handed over in its data-parallel wrapper (accelerate's prepare, ``nn.DataParallel``)
    has no ``config`` of its own: the problem_type check read none and calibrated a multi-label
    model's sigmoid outputs under a softmax. The wrapped model's problem_type is read and refused."""
    from transformers import PretrainedConfig

    model, post, cal = overfitted()
    model.config = PretrainedConfig(problem_type="multi_label_classification")
    with pytest.raises(ValueError, match=r"^calibrate_posterior: the model's problem_type 'multi_label_classification'"):
        calibrate_posterior(nn.DataParallel(model), post, cal, num_samples=2)


@pytest.mark.parametrize("temperature", [False, True])
def test_grid_nll_is_the_bma_nll_and_the_choice_is_the_grid_minimum(temperature: bool) -> None:
    """Each scale's NLL is the BMA NLL at its own best softening temperature (T >= 1 of the grid;
    at T = 1 with temperature=False or where softening does not help the mean), the mean's
    likewise, and with k = 0 and no min_gain the choice is the lowest of them: its ess and its
    temperature are the calibrated posterior's. The mean is overconfident here, so the
    temperatures are used."""
    from hf_evon.predictive.calibration import SOFTENING_TEMPERATURES, TEMPERATURE_GRID

    model, post, cal = overfitted()
    calibrated, result = calibrate_posterior(
        model, post, cal, grid=[0.1, 1.0, 10.0], num_samples=4, seed=7, standard_errors=0, min_gain=0,
        temperature=temperature,
    )  # fmt: skip
    assert result.trained_ess == post.ess
    assert [g / post.ess for g in result.grid] == pytest.approx([10.0, 1.0, 0.1])
    y = torch.cat([b[1] for b in cal])
    with torch.no_grad():
        # batch by batch, as the calibration evaluates it: a float32 forward of a batch of another
        # size may round differently (the kernels block the product by its shape)
        mean_logits = torch.cat([model(xb) for xb, _ in cal]).double()[None]
    mean_best = min((tempered_bma_nll(mean_logits, y, t), t) for t in TEMPERATURE_GRID)
    assert result.mean_temperature == mean_best[1] and mean_best[1] > 1  # recorded either way
    assert result.mean_nll == pytest.approx(tempered_bma_nll(mean_logits, y, 1.0), rel=FLOAT32_SCORING)
    temperatures = SOFTENING_TEMPERATURES if temperature else (1.0,)
    assert SOFTENING_TEMPERATURES[0] == 1.0 and min(SOFTENING_TEMPERATURES) == 1.0

    def best(logits: torch.Tensor) -> tuple[float, float]:
        return min((tempered_bma_nll(logits, y, t), t) for t in temperatures)

    for i, ess in enumerate(result.grid):
        nll, t = best(draw_logits(model, post.with_ess(ess), cal, range(7, 11)))
        assert result.nll[i] == pytest.approx(nll, rel=FLOAT32_SCORING)
        assert result.temperatures[i : i + 1] == ([t] if temperature else [])
    mean_choice = best(mean_logits)
    assert result.tempered_mean_nll == (pytest.approx(mean_choice[0], rel=FLOAT32_SCORING) if temperature else None)
    choices = [(*mean_choice, math.inf)] + [
        (nll, t, ess) for nll, t, ess in zip(result.nll, result.temperatures or [1.0] * 3, result.grid)
    ]
    nll, t, ess = min(choices)
    assert (result.ess, result.temperature) == (ess, t)
    assert (calibrated.ess, calibrated.temperature) == (ess, t)
    assert result.chosen_nll == pytest.approx(nll, rel=FLOAT32_SCORING)  # never above the mean's
    assert (t > 1) == temperature  # the softening is used here


def _trained_posterior(model: nn.Module, loss: object, steps: int, **optimizer: object) -> EVONPosterior:
    """``steps`` sampled steps of ``build_optimizer(model, seed=0, **optimizer)`` on ``loss()``."""
    opt = build_optimizer(model, seed=0, **optimizer)
    for _ in range(steps):
        with opt.sampled_params(train=True):
            loss().backward()
        opt.step()
        opt.zero_grad()
    return EVONPosterior.from_optimizer(opt, model)


def _fixed_logit_data(n: int, seed: int = 0) -> list:
    """Labels drawn from softmax(z): a model returning scale·z has its best temperature near scale."""
    gen = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(n, 5, generator=gen)
    y = torch.distributions.Categorical(logits=z).sample()
    return [(z[: n // 2], y[: n // 2]), (z[n // 2 :], y[n // 2 :])]


def _point_posterior() -> EVONPosterior:
    from hf_evon.posterior.gaussian import MatrixFactors

    return EVONPosterior.from_factors(
        {"weight": MatrixFactors(None, None, torch.ones(1, 1), (1, 1), (1, 1), 1e4, 1e-3)}
    )


def test_an_underconfident_mean_is_sharpened_where_a_cross_validation_in_the_split_agrees() -> None:
    """An underconfident mean (best T < 1) on a split with many errors predicts at its best T when
    a 2-fold cross-validation over the targets (T chosen on every other target, scored on the rest)
    gains more than k standard errors and min_gain over T = 1: checked against a plain float64
    computation of that gain, on both sides of it; never with temperature=False; never where the
    split holds fewer than MIN_ERRORS_TO_SHARPEN targets the mean gives less than even odds."""
    from hf_evon.predictive.calibration import MIN_ERRORS_TO_SHARPEN, TEMPERATURE_GRID

    batches, posterior = _fixed_logit_data(2000), _point_posterior()
    _, under = calibrate_posterior(
        FixedLogits(0.5), posterior, batches, grid=[1.0], num_samples=2, keep_trained=False
    )
    assert under.mean_temperature < 1 and under.temperature == under.mean_temperature
    assert under.ess == math.inf and not under.scanned and under.tempered_mean_nll < under.mean_nll
    # the reference: log p(y) at every T; folds: every other target in order of log p(y) at T = 1
    z, y = torch.cat([b[0] for b in batches]).double() * 0.5, torch.cat([b[1] for b in batches])
    ll = torch.stack([torch.log_softmax(z / t, -1)[torch.arange(len(y)), y] for t in TEMPERATURE_GRID])
    one, cv = TEMPERATURE_GRID.index(1.0), torch.empty(len(y), dtype=torch.float64)
    assert len(set(ll[one].tolist())) == len(y)  # no ties: the order at T = 1 alone decides the folds
    ranked = ll[one].argsort()
    for fit in (0, 1):
        t = int(ll[:, ranked[fit::2]].mean(1).argmax())
        cv[ranked[1 - fit :: 2]] = ll[t, ranked[1 - fit :: 2]]
    relative = float((cv - ll[one]).mean()) / float(-ll[one].mean())
    for g, want in ((0.99 * relative, under.temperature), (1.01 * relative, 1.0)):
        _, result = calibrate_posterior(
            FixedLogits(0.5), posterior, batches, grid=[1.0], num_samples=2, min_gain=g
        )
        assert result.temperature == want
    _, plain = calibrate_posterior(
        FixedLogits(0.5), posterior, batches, grid=[1.0], num_samples=2, temperature=False
    )
    assert plain.temperature == 1.0 and plain.tempered_mean_nll is None
    _, strict = calibrate_posterior(
        FixedLogits(0.5), posterior, batches, grid=[1.0], num_samples=2, standard_errors=1000.0
    )
    assert strict.temperature == 1.0
    # few errors: confident, right labels (p(y) ≈ 0.93 at T = 1), so sharpening only looks good
    labels = torch.arange(400) % 5
    clean = [(8.0 * torch.nn.functional.one_hot(labels, 5).float(), labels)]
    _, few = calibrate_posterior(FixedLogits(0.5), posterior, clean, grid=[1.0], num_samples=2)
    below_even = int((torch.softmax(clean[0][0] * 0.5, -1)[torch.arange(400), labels] < 0.5).sum())
    assert below_even < MIN_ERRORS_TO_SHARPEN  # the case's premise
    assert few.mean_temperature < 1 and few.temperature == 1.0


def test_a_sharpened_mean_and_the_trained_posterior_share_one_temperature_scanned_or_screened() -> None:
    """Where the rule sharpens an underconfident mean (T < 1), every scale, the trained one too, is
    scored at that T, whether the scan scores the trained scale or the screen left it out: the same
    choice and the same NLL both ways, the reference's BMA NLL at that T. Before, the scanned
    trained scale was scored at T = 1 (NLL 0.999, the mean kept) and the screened one at T = 0.5
    (NLL 0.872, the trained posterior kept): a near-tie in the screen flipped the choice."""
    torch.manual_seed(0)  # _fixed_logit_data's labels come from the global generator
    batches, posterior = _fixed_logit_data(2000), _point_posterior()
    rule = dict(grid=[1.0], num_samples=2, standard_errors=2.0)
    _, plain = calibrate_posterior(FixedLogits(0.5), posterior, batches, **rule)
    sharpened = plain.temperature
    assert sharpened < 1 and not plain.scanned and plain.kept_trained  # the case's premise
    y = torch.cat([b[1] for b in batches])
    reference = tempered_bma_nll(draw_logits(FixedLogits(0.5), posterior, batches, range(2)), y, sharpened)
    assert plain.trained_nll == pytest.approx(reference, rel=FLOAT32_SCORING)
    results = []
    for screen_factor in (0.0, 1e6):  # the trained scale scored by the scan; screened out
        _, result = calibrate_posterior(
            FixedLogits(0.5), posterior, batches, **rule, always_scan=True, screen_factor=screen_factor
        )
        assert result.scanned and result.mean_temperature < 1
        assert result.temperature == sharpened and result.ess == posterior.ess
        assert result.trained_nll == pytest.approx(reference, rel=FLOAT32_SCORING)
        results.append(result)
    scored, screened = results
    assert scored.grid == [posterior.ess] and scored.temperatures == [sharpened]
    assert screened.screened == [posterior.ess] and screened.grid == []
    assert scored.trained_nll == screened.trained_nll


def test_the_temperature_choice_builds_its_tensors_on_the_inputs_device() -> None:
    """On CUDA, calibrate_posterior failed in the sharpening's cross-validation: its fold masks were
    built on the default device (the CPU) and indexed CUDA log-probs. Reproduced on the CPU under
    another default device: the choice must be the same whatever the default device is."""
    from hf_evon.predictive.calibration import TEMPERATURE_GRID, mean_temperature_choice

    batches = _fixed_logit_data(2000)
    z, y = torch.cat([b[0] for b in batches]).double() * 0.5, torch.cat([b[1] for b in batches])
    ll = torch.stack([torch.log_softmax(z / t, -1)[torch.arange(len(y)), y] for t in TEMPERATURE_GRID])
    chosen = mean_temperature_choice(ll, 2.0, 0.0)
    assert chosen < TEMPERATURE_GRID.index(1.0)  # the case's premise: the cross-validation ran and sharpened
    with torch.device("meta"):
        assert mean_temperature_choice(ll, 2.0, 0.0) == chosen


def test_the_sharpening_does_not_depend_on_the_order_the_targets_are_read_in() -> None:
    """The trainer reads a datasets.Dataset sorted by length and an IterableDataset in its own order,
    and the calibration is promised not to depend on it. The cross-validation took every other target
    in reading order as a fold, so the same 60 targets reordered went T = 0.5 one way and T = 1
    another (seed 0); its folds are now every other target in order of the mean's log p(label)."""
    from hf_evon.predictive.calibration import TEMPERATURE_GRID, mean_temperature_choice

    g = torch.Generator().manual_seed(0)
    z = 2 * torch.randn(60, 5, generator=g, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(z, -1), 1, generator=g)[:, 0]
    ll = torch.stack([torch.log_softmax(0.5 * z / t, -1)[torch.arange(60), y] for t in TEMPERATURE_GRID])
    chosen = mean_temperature_choice(ll, 0.5, 0.01)
    assert chosen < TEMPERATURE_GRID.index(1.0)  # the premise: this split is sharpened
    for p in range(8):
        perm = torch.randperm(60, generator=torch.Generator().manual_seed(p))
        assert mean_temperature_choice(ll[:, perm], 0.5, 0.01) == chosen, p
    # through calibrate_posterior: the rows of a batch reversed, the batches swapped
    batches = [(z[:30].float(), y[:30]), (z[30:].float(), y[30:])]
    backwards = [(x.flip(0), t.flip(0)) for x, t in reversed(batches)]
    _, forward = calibrate_posterior(FixedLogits(0.5), _point_posterior(), batches, grid=[1.0], num_samples=2)
    _, reverse = calibrate_posterior(FixedLogits(0.5), _point_posterior(), backwards, grid=[1.0], num_samples=2)
    assert forward.temperature == reverse.temperature == TEMPERATURE_GRID[chosen]


def test_an_overconfident_mean_is_softened_only_beyond_k_standard_errors() -> None:
    """A softening whose gain is within k standard errors of T = 1 is not taken."""
    batches, posterior = _fixed_logit_data(2000), _point_posterior()
    _, over = calibrate_posterior(FixedLogits(1.5), posterior, batches, grid=[1.0], num_samples=2)
    assert over.temperature > 1 and over.tempered_mean_nll < over.mean_nll
    # the same gain, asked to clear 1000 standard errors, is not taken
    _, strict = calibrate_posterior(
        FixedLogits(1.5), posterior, batches, grid=[1.0], num_samples=2, standard_errors=1000.0,
        keep_trained=False,
    )  # fmt: skip
    assert strict.temperature == 1.0 and strict.temperatures == [] and strict.ess == math.inf


def draw_probs(model: nn.Module, posterior: EVONPosterior, batches: list, seeds: range) -> list[list[float]]:
    """Reference: p(label) of every example under each draw, by a plain loop (draw-major)."""
    out = []
    for s in seeds:
        probs = []
        for x, y in batches:
            with posterior.sampled(model, seed=s), torch.no_grad():
                probs += torch.softmax(model(x).double(), -1)[torch.arange(len(y)), y].tolist()
        out.append(probs)
    return out


def stepwise_choice(candidates: list[list[list[float]]], k: float) -> int:
    """Reference rule, written from its definition with Python floats: ``candidates`` are draws ×
    examples of p(label), least noise first (the mean: one draw). Walking from the mean, a noisier
    candidate replaces the choice if its NLL is lower by more than k errors of the difference: the
    per-example one plus the jackknife over the common draw index (:func:`nll_excess`)."""
    choice = 0
    for i in range(1, len(candidates)):
        excess, error = nll_excess(candidates[i], candidates[choice])
        if -excess > k * error:
            choice = i
    return choice


def nll_excess(c: list[list[float]], ref: list[list[float]]) -> tuple[float, float]:
    """Reference, from the definition with Python floats: the BMA NLL of ``c`` above ``ref``'s (draws ×
    examples of p(label)) and its standard error, per example plus a jackknife over the common draw index."""

    def nlls(draws: list[list[float]], leave_out: int | None = None) -> list[float]:
        kept = [d for j, d in enumerate(draws) if j != leave_out or len(draws) == 1]
        return [-math.log(statistics.fmean(col)) for col in zip(*kept)]

    diff = [a - b for a, b in zip(nlls(c), nlls(ref))]
    var = statistics.variance(diff) / len(diff)
    s = max(len(c), len(ref))
    if s > 1:
        loo = [statistics.fmean(a - b for a, b in zip(nlls(c, j), nlls(ref, j))) for j in range(s)]
        var += (s - 1) / s * sum((v - statistics.fmean(loo)) ** 2 for v in loo)
    return statistics.fmean(diff), math.sqrt(var)


def test_a_noisier_scale_is_chosen_only_if_it_beats_the_choice_so_far_by_k_standard_errors() -> None:
    model, post, cal, _ = trained(seed=1, steps=100)  # a case where noise helps, a little
    x, y = zip(*cal)
    with torch.no_grad():
        mean = torch.softmax(model(torch.cat(x)).double(), -1)[torch.arange(100), torch.cat(y)]
    chosen = []
    for k in (0.0, 1.0, 3.0):
        _, result = calibrate_posterior(
            model, post, cal, grid=[10.0, 1.0, 0.1, 0.01, 1e-3], num_samples=4, seed=3, standard_errors=k,
            min_gain=0, temperature=False, always_scan=True, keep_trained=False,
        )  # fmt: skip
        candidates = [[mean.tolist()]] + [
            draw_probs(model, post.with_ess(e), cal, range(3, 7)) for e in result.grid
        ]
        index = stepwise_choice(candidates, k)
        assert result.ess == ([math.inf] + result.grid)[index]
        assert result.chosen_nll == ([result.mean_nll] + result.nll)[index]
        assert result.standard_errors == k
        chosen.append(result.multiplier)
    assert chosen[0] < math.inf and chosen[2] == math.inf  # the rule decides here: k=0 and k=3 differ


def test_the_trained_posterior_is_kept_unless_the_mean_beats_it_by_k_standard_errors_or_min_gain() -> None:
    """Where the mean is not overconfident (no scan), the trained posterior's S draws are scored
    against the mean and kept unless the mean's NLL is lower by more than k standard errors or by
    more than min_gain (relative): each bound checked against a plain-float reference on both
    sides of the measured excess, its NLL against a plain BMA loop, the passes counted;
    keep_trained=False keeps the mean, in one pass."""
    model, post, cal, _ = trained(seed=1, steps=100)
    noisy = as_trained(post.with_ess(post.ess * 1e-2))  # trained with more noise: the mean predicts better
    passes: list[int] = []
    model.register_forward_hook(lambda *_: passes.append(1))
    x, y = (torch.cat(v) for v in zip(*cal))
    with torch.no_grad():
        mean = torch.softmax(model(x).double(), -1)[torch.arange(len(y)), y].tolist()
    passes.clear()
    draws = draw_probs(model, noisy, cal, range(3, 7))
    excess, error = nll_excess(draws, [mean])
    assert excess > 0 and error > 0  # the premise: the mean is the better predictor here
    relative = excess / -statistics.fmean(math.log(p) for p in mean)  # of the mean's NLL
    common = dict(grid=[1.0, 0.1], num_samples=4, seed=3, temperature=False)
    bounds = [(0.99 * excess / error, 0.99, False), (1.01 * excess / error, 0.99, True)]  # k decides
    bounds += [(1e6, 0.99 * relative, False), (1e6, 1.01 * relative, True)]  # min_gain decides
    # the reference rule, walking from the trained posterior to the mean, agrees on the k bounds
    assert [stepwise_choice([draws, [mean]], k) for k, _, _ in bounds[:2]] == [1, 0]
    for k, gain, kept in bounds:
        passes.clear()
        calibrated, result = calibrate_posterior(model, noisy, cal, **common, standard_errors=k, min_gain=gain)
        assert not result.scanned and result.grid == [] and len(passes) == len(cal) * (1 + 4)
        reference = -statistics.fmean(math.log(statistics.fmean(c)) for c in zip(*draws))
        assert result.trained_nll == pytest.approx(reference, rel=FLOAT32_SCORING)
        assert result.kept_trained is kept
        assert result.ess == calibrated.ess == (noisy.ess if kept else math.inf)
        assert calibrated.config["trained_ess"] == noisy.ess
        assert result.chosen_nll == (result.trained_nll if kept else result.mean_nll)
        summary = result.summary()
        assert ("the posterior as trained" in summary) is kept
        assert ("predicted better than the trained posterior" in summary) is not kept
        if not kept:  # the gain and the bound that decided, so a tiny gain does not read as a clear one
            percent = 100 * (result.trained_nll - result.mean_nll) / result.mean_nll
            # (the two NLLs' float32 scoring, ~1e-6 of each, over their difference of ~0.5%)
            assert percent == pytest.approx(100 * relative, rel=1e-3)
            decided = f"more than {100 * gain:g}%)" if gain < relative else f"more than {k:g} standard error(s))"
            assert f"by {percent:.2g}%: " in summary and summary.count(decided) == 1
            assert ("less than" in summary) is (gain >= relative)
    passes.clear()
    _, dropped = calibrate_posterior(model, noisy, cal, **common, standard_errors=1e6, keep_trained=False)
    assert dropped.ess == math.inf and dropped.trained_nll is None and len(passes) == len(cal)
    assert dropped.to_json()["keep_trained"] is False
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="keep_trained must be True or False"):
            calibrate_posterior(model, noisy, cal, keep_trained=bad)


def test_a_scanned_trained_scale_is_judged_against_the_mean_without_more_passes() -> None:
    """Where the scan scored the trained scale (ζ × 1 in the grid) and no scale gained min_gain,
    its scan NLL and temperature decide and become the choice's: no extra pass; k = 0 keeps it
    exactly when its NLL is not above the mean's at the mean's temperature."""
    model, post, cal = overfitted()
    passes: list[int] = []
    model.register_forward_hook(lambda *_: passes.append(1))
    rule = dict(grid=[1.0, 0.1], num_samples=3, seed=7, standard_errors=0.0, screen_factor=0, min_gain=0.99)
    calibrated, result = calibrate_posterior(model, post, cal, **rule)
    assert result.scanned and len(passes) == len(cal) * (1 + 3 * len(result.grid))
    i = result.grid.index(post.ess)
    assert result.trained_nll == result.nll[i]
    assert result.kept_trained == (result.nll[i] <= result.tempered_mean_nll)
    assert result.kept_trained  # the premise of the next lines: the trained posterior predicts better
    assert (result.ess, result.temperature) == (post.ess, result.temperatures[i])
    assert (calibrated.ess, calibrated.temperature) == (post.ess, result.temperatures[i])
    assert result.chosen_nll == result.nll[i]


def test_a_screened_trained_scale_reuses_the_screens_draw() -> None:
    """Where the screen probed the trained scale (ζ × 1) and screened it out, the check against the
    mean reuses that probe as its first draw: one pass fewer per batch, and the same NLL and
    temperature as when the scan scores ×1 itself (screen_factor=0)."""
    model, post, cal = overfitted()
    rule = dict(grid=[1.0, 0.1], num_samples=3, seed=7, standard_errors=0.0, min_gain=0.99)
    _, scored = calibrate_posterior(model, post, cal, **rule, screen_factor=0)
    y = torch.cat([yb for _, yb in cal])
    t = scored.mean_temperature
    with torch.no_grad():
        mean = torch.log_softmax(torch.cat([model(xb) for xb, _ in cal]).double() / t, -1)
    moved = []
    for f in (1.0, 0.1):  # the screen's measure: the first draw's move at the mean's temperature
        with post.with_ess(post.ess * f).sampled(model, seed=7), torch.no_grad():
            logits = torch.cat([model(xb) for xb, _ in cal]).double()
        moved.append(float((torch.log_softmax(logits / t, -1) - mean)[torch.arange(len(y)), y].abs().mean()))
    assert moved[0] < moved[1]  # the premise: a factor between them screens ×1 out, not ×0.1
    nll = scored.tempered_mean_nll
    passes: list[int] = []
    model.register_forward_hook(lambda *_: passes.append(1))
    _, screened = calibrate_posterior(
        model, post, cal, **rule, screen_factor=math.sqrt(moved[0] * moved[1]) / (0.99 * nll)
    )
    assert screened.screened == [post.ess] and screened.grid == [post.ess * 0.1]
    # the mean; the probes of ×0.1 and ×1; the rest of ×0.1's draws and of ×1's
    assert len(passes) == len(cal) * (1 + 2 + 2 * (3 - 1))
    assert screened.trained_nll == scored.nll[scored.grid.index(post.ess)]
    assert (screened.ess, screened.temperature) == (scored.ess, scored.temperature)


@pytest.mark.parametrize("temperature", [False, True])
def test_a_scale_is_chosen_only_if_it_gains_min_gain_over_the_mean(temperature: bool) -> None:
    """The lowest NLL (k = 0) is kept if it is at least min_gain (relative) below the mean's (at
    the mean's own temperature with temperature=True), else ∞; checked on both sides of the
    measured relative gain."""
    from hf_evon.predictive.calibration import DEFAULT_MIN_GAIN, DEFAULT_STANDARD_ERRORS

    assert (DEFAULT_STANDARD_ERRORS, DEFAULT_MIN_GAIN) == (0.5, 0.01)
    # cases where noise helps, a little (the overfitted one also with a temperature)
    model, post, cal = overfitted() if temperature else trained(seed=1, steps=100)[:3]
    grid = [10.0, 1.0, 0.1, 0.01, 1e-3]
    argmin_rule = {
        "grid": grid, "num_samples": 4, "seed": 7 if temperature else 3, "standard_errors": 0,
        "temperature": temperature, "always_scan": True, "screen_factor": 0, "keep_trained": False,
    }  # fmt: skip
    _, argmin = calibrate_posterior(model, post, cal, **argmin_rule, min_gain=0)
    best = min(range(len(argmin.nll)), key=argmin.nll.__getitem__)
    mean = argmin.tempered_mean_nll if temperature else argmin.mean_nll
    assert argmin.nll[best] < mean and argmin.ess == argmin.grid[best]
    gain = 1.0 - argmin.nll[best] / mean
    for g, want in ((0.99 * gain, argmin.grid[best]), (1.01 * gain, math.inf)):
        calibrated, result = calibrate_posterior(model, post, cal, **argmin_rule, min_gain=g)
        assert result.ess == want and calibrated.ess == want and result.min_gain == g
        assert result.nll == argmin.nll  # the same scan; only the choice differs
        assert calibrated.config["calibration"]["min_gain"] == g
    for bad in (-0.1, 1.0, math.nan, True):
        with pytest.raises(ValueError, match="min_gain"):
            calibrate_posterior(model, post, cal, grid=grid, num_samples=1, min_gain=bad)


def test_a_gain_carried_by_a_few_examples_buys_more_noise_only_past_k_standard_errors() -> None:
    """251 held-out digits, of which 5 the mean gets confidently wrong. More noise rescues those 5
    a lot and costs each of the other 246 a little (on the quickstart's test digits such a choice
    once paid: NLL 0.106 vs 0.088 at the less noisy scale, ECE 0.037 vs 0.017, seed 2). The mean
    NLL is lower by 0.56 standard errors: a k above that keeps the less noisy scale, one below
    (the lowest NLL, k = 0, and the default 0.5, chosen on validation halves) takes the noisier."""
    from hf_evon.predictive.calibration import (
        DEFAULT_STANDARD_ERRORS,
        _bma_nll,
        _gain_and_error,
        _stepwise_choice,
    )

    gen = torch.Generator().manual_seed(2)
    n, s = 251, 8
    mean = -0.02 * torch.rand(1, n, generator=gen, dtype=torch.float64)
    mean[0, :5] = -4.0  # confidently wrong
    some = mean + 0.01 * torch.randn(s, n, generator=gen, dtype=torch.float64)  # a little noise
    some[:, :5] += 1.0
    more = some - 0.03  # every confident digit pays 0.03 ...
    more[:, :5] += 2.0  # ... and the five wrong ones gain 1.97 each: 9.85 vs 7.38 in all
    gain, error = _gain_and_error(more, some)
    assert float(_bma_nll(more).mean()) < float(_bma_nll(some).mean()) and -gain < error
    ratio = -gain / error  # the construction's point: between the default k and one standard error
    assert DEFAULT_STANDARD_ERRORS < ratio < 1.0
    assert _stepwise_choice([mean, some, more], 0.0) == 2
    assert _stepwise_choice([mean, some, more], 0.99 * ratio) == 2
    assert _stepwise_choice([mean, some, more], 1.01 * ratio) == 1
    assert _stepwise_choice([mean, some, more], 1.0) == 1
    assert _stepwise_choice([mean, some, more], DEFAULT_STANDARD_ERRORS) == 2


def test_a_small_gain_keeps_the_mean_and_a_clear_one_does_not() -> None:
    from hf_evon.predictive.calibration import _stepwise_choice

    gen = torch.Generator().manual_seed(0)
    mean = -torch.rand(1, 400, generator=gen, dtype=torch.float64)  # log p of the mean
    z = torch.randn(1, 400, generator=gen, dtype=torch.float64)
    z = 0.02 * (z - z.mean())  # per-example scatter: the error of a mean difference is ~0.001
    small = (mean + 0.0005 + z).repeat(4, 1)  # 4 equal draws, better by exactly 0.0005 on average
    clear = (mean + 0.01 + z).repeat(4, 1)  # better by 0.01, ten errors
    assert _stepwise_choice([mean, small], 1.0) == 0
    assert _stepwise_choice([mean, small], 0.0) == 1
    assert _stepwise_choice([mean, clear], 1.0) == 1
    # among finite scales too: a noisier scale must beat a less noisy one clearly
    assert _stepwise_choice([mean, clear, clear + 0.0005 + z.flip(1)], 1.0) == 1
    assert _stepwise_choice([mean, clear, clear + 0.0005 + z.flip(1)], 0.0) == 2


def test_a_gain_that_depends_on_the_draws_is_not_taken_for_a_better_scale() -> None:
    """Every example moves together with the draw (+0.3, -0.1, +0.05, -0.15 in log p): the BMA is
    better on average, every example agrees, yet another set of draws could well be worse."""
    from hf_evon.predictive.calibration import _gain_and_error, _stepwise_choice

    gen = torch.Generator().manual_seed(1)
    mean = -torch.rand(1, 400, generator=gen, dtype=torch.float64)
    shifts = torch.tensor([0.3, -0.1, 0.05, -0.15], dtype=torch.float64)[:, None]
    lucky = mean + shifts + 0.01 * torch.randn(4, 400, generator=gen, dtype=torch.float64)
    gain, error = _gain_and_error(lucky, mean)
    per_example = float((-torch.logsumexp(lucky, 0) + math.log(4) + mean[0]).std()) / math.sqrt(400)
    assert gain < -10 * per_example  # the per-example error alone would take it
    assert _stepwise_choice([mean, lucky], 1.0) == 0
    assert _stepwise_choice([mean, lucky], 0.0) == 1
    # the same average gain in every draw is real
    steady = mean + float(-gain) + 0.01 * torch.randn(4, 400, generator=gen, dtype=torch.float64)
    assert _stepwise_choice([mean, steady], 1.0) == 1


def test_noise_that_only_hurts_calibrates_to_the_mean() -> None:
    model, post, cal, _ = trained()
    loud = as_trained(post.with_ess(post.ess * 1e-6))  # std x1000: every sample is garbage
    calibrated, result = calibrate_posterior(model, loud, cal, grid=[1.0, 3.0], num_samples=2)
    assert result.ess == math.inf and calibrated.ess == math.inf
    with calibrated.sampled(model, seed=0):  # the calibrated posterior samples the mean exactly
        x = cal[0][0]
        sampled = model(x)
    assert torch.equal(sampled, model(x))


def test_the_scales_are_scored_only_where_the_mean_is_overconfident() -> None:
    """Averaging samples softens predictions: where the mean's best temperature on the data is not
    above 1, BMA is the mean and the pass at the mean is the only pass; always_scan=True scores
    the scales (here, at T = 1, to no gain); an overconfident mean is scanned by default."""
    model, post, cal, _ = trained(seed=1, steps=100)
    passes: list[int] = []
    model.register_forward_hook(lambda *_: passes.append(1))
    grid = [10.0, 1.0, 0.1]
    calibrated, gated = calibrate_posterior(model, post, cal, grid=grid, num_samples=2, keep_trained=False)
    assert gated.mean_temperature < 1 and not gated.scanned and (gated.grid, gated.nll) == ([], [])
    assert len(passes) == len(cal)  # the mean's pass alone
    assert calibrated.ess == math.inf and calibrated.config["calibration"]["scanned"] is False
    assert "no scale was scored" in gated.summary()
    passes.clear()
    _, full = calibrate_posterior(  # at T = 1: the sharpened mean's T would score every scale at it too
        model, post, cal, grid=grid, num_samples=2, always_scan=True, screen_factor=0, keep_trained=False,
        temperature=False,
    )  # fmt: skip
    assert full.scanned and full.grid == [post.ess * f for f in grid]
    assert len(passes) == len(cal) * (1 + 2 * len(grid)) and full.mean_nll == gated.mean_nll
    assert full.ess == math.inf and "no scale beat it" in full.summary()
    model, post, cal = overfitted()
    _, hot = calibrate_posterior(model, post, cal, grid=grid, num_samples=2)
    assert hot.mean_temperature > 1 and hot.scanned and len(hot.grid) > 0
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="always_scan must be True or False"):
            calibrate_posterior(model, post, cal, always_scan=bad)


def test_scales_too_quiet_to_move_the_predictions_are_screened_out_by_bisection() -> None:
    """Walking from little noise to much, a scale is not a candidate while its first draw moves
    log p(label) by less than screen_factor × min_gain of the mean's NLL (per target, on average, at
    the mean's temperature; a reference computation here); from the first scale that moves them
    more, every scale is scored with all its draws. That first scale is found by bisecting the grid
    with one draw per probe, the probes at or past it reused as first draws. With screen_factor=0
    every scale is scored, and the scored scales' NLLs are the same either way."""
    model, post, cal = overfitted()
    grid = [100.0, 10.0, 1.0, 0.1, 0.01]
    common = {"grid": grid, "num_samples": 3, "seed": 5, "standard_errors": 0.0, "keep_trained": False}
    passes: list[int] = []
    model.register_forward_hook(lambda *_: passes.append(1))
    _, full = calibrate_posterior(model, post, cal, **common, screen_factor=0)
    assert full.screened == [] and len(full.grid) == len(grid) and full.temperature > 1
    assert len(passes) == len(cal) * (1 + 3 * len(grid))
    # the reference: each scale's first draw against the mean, both at the mean's temperature
    y = torch.cat([yb for _, yb in cal])
    assert full.tempered_mean_nll is not None  # overconfident: the mean is scored at its best T
    t = full.mean_temperature

    def logp(m: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            logits = torch.cat([m(xb) for xb, _ in cal])  # batch by batch, as the calibration does
            return torch.log_softmax(logits.double() / t, -1).gather(1, y[:, None]).squeeze(1)

    mean_logp = logp(model)
    assert float(-mean_logp.mean()) == pytest.approx(full.tempered_mean_nll, rel=FLOAT32_SCORING)
    moved = []
    for f in grid:
        with post.with_ess(post.ess * f).sampled(model, seed=5):
            moved.append(float((logp(model) - mean_logp).abs().mean()))
    assert moved == sorted(moved)  # the same draw at every scale: more noise moves it further
    nll = float(-mean_logp.mean())
    # probes spent below the onset k (the bisection of [0, 5): k = 0 probes 2, 1, 0; k = 1 probes
    # 2, 1, 0; k = 2: 2, 1; k = 3: 2, 4, 3; k = 4: 2, 4, 3; k = 5: 2, 4), where walking the grid
    # spends k
    wasted = [0, 1, 1, 1, 2, 2]
    bounds = [moved[0] / 2, *(math.sqrt(a * b) for a, b in zip(moved, moved[1:])), 2 * moved[-1]]
    for k, move in enumerate(bounds):  # a tolerance between the k-th and the (k + 1)-th scale's moves
        factor = move / (0.01 * nll)
        passes.clear()
        _, screened = calibrate_posterior(model, post, cal, **common, screen_factor=factor)
        quiet = [post.ess * f for f in grid[:k]]
        assert screened.screened == pytest.approx(quiet) and screened.screen_factor == factor
        assert screened.grid == full.grid[k:] and screened.nll == full.nll[k:]
        assert len(passes) == len(cal) * (1 + wasted[k] + 3 * (len(grid) - k))
        assert screened.to_json()["screened"] == pytest.approx(quiet)
    for bad in (-1.0, math.inf, "2"):
        with pytest.raises(ValueError, match="screen_factor"):
            calibrate_posterior(model, post, cal, grid=grid, num_samples=1, screen_factor=bad)


def test_the_scan_stops_when_noise_has_clearly_taken_over() -> None:
    model, post, cal, _ = trained()
    grid = [1.0, 1e-5, 1e-6, 1e-8]
    _, result = calibrate_posterior(
        model, post, cal, grid=grid, num_samples=2, temperature=False, always_scan=True
    )
    assert len(result.nll) < 4
    assert result.nll[-1] > 2 * min([result.mean_nll, *result.nll])
    # with temperatures the rule reads the same T = 1 NLLs: a softmax at T = 8 rescues any noise
    # to about log C, which alone would keep a noisy task's scan going to the grid's end
    model, post, cal = overfitted()
    _, cold = calibrate_posterior(model, post, cal, grid=grid, num_samples=2, temperature=False)
    _, hot = calibrate_posterior(model, post, cal, grid=grid, num_samples=2)
    assert hot.tempered_mean_nll is not None and len(hot.grid) == len(cold.grid) < 4
    assert cold.nll[-1] > 2 * min([cold.mean_nll, *cold.nll]) and hot.nll[-1] < cold.nll[-1]


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
    """The targets, and the mean's temperature NLL, are the loss's: shifted, −100 ignored."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_evon.predictive.held_out import tempered_log_probs

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
    nll = -tempered_log_probs(out.logits, labels, True, [1.0, 2.0]).sum(1) / logp.numel()
    assert float(nll[0]) == pytest.approx(float(-logp.mean()), rel=FLOAT32_SCORING)
    assert float(nll[1]) == pytest.approx(
        float(-target_log_probs(out.logits / 2.0, labels, True).mean()), rel=1e-6
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grid": [0.0, 1.0]}, "grid"),
        ({"grid": [math.inf]}, "grid"),
        ({"num_samples": 0}, "num_samples"),
        ({"standard_errors": -1.0}, "standard_errors"),
        ({"standard_errors": math.nan}, "standard_errors"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    model, post, cal, _ = trained(steps=1)
    with pytest.raises(ValueError, match=match):
        calibrate_posterior(model, post, cal, **kwargs)


def test_an_optimizer_for_the_posterior_and_a_shift_without_a_sequence_are_named() -> None:
    """``calibrate_posterior(model, optimizer, ...)`` raised "'EVON' object has no attribute 'config'",
    and ``shift_labels=True`` with a classifier's (batch,) labels an IndexError inside the shift; each
    names its argument. The model keeps its mean."""
    import hf_evon

    model, post, cal, _ = trained(steps=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=r"calibrate_posterior: posterior must be an EVONPosterior; got EVON \("):
        calibrate_posterior(model, hf_evon.EVON(model.parameters()), cal)
    with pytest.raises(ValueError, match=r"labels shaped \(50,\) do not align with the model's logits \(50, \d+\) \(a causal LM"):
        calibrate_posterior(model, post, cal, shift_labels=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_a_numpy_sample_count_calibrates_as_its_int() -> None:
    """``num_samples=np.int64(4)``, which ``posterior.draw`` takes, was refused here ("must be an integer");
    it now gives what 4 gives, recorded as a Python int (the posterior's JSON record takes no NumPy type)."""
    import json

    import numpy as np

    model, post, cal, _ = trained(steps=1)
    want_post, want = calibrate_posterior(model, post, cal, num_samples=4, always_scan=True)
    got_post, got = calibrate_posterior(model, post, cal, num_samples=np.int64(4), always_scan=True)
    assert got == want and type(got.num_samples) is int
    assert json.dumps(got_post.config, default=str) == json.dumps(want_post.config, default=str)


def test_an_iterator_and_an_infinite_ess_are_refused() -> None:
    model, post, cal, _ = trained(steps=1)
    with pytest.raises(TypeError, match="re-iterable"):
        calibrate_posterior(model, post, iter(cal))
    with pytest.raises(ValueError, match="ess = inf"):
        calibrate_posterior(model, as_trained(post.with_ess(math.inf)), cal)
    # the model and the posterior swapped: named as such, before any pass (an AttributeError before)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module .*got EVONPosterior and Sequential"):
        calibrate_posterior(post, model, cal)


def test_a_posterior_of_another_model_is_refused_before_any_pass() -> None:
    """Where no sample is drawn (the mean not overconfident, keep_trained=False), a posterior that
    does not fit the model was never checked: calibrate_posterior returned it "calibrated" to the
    mean. It raises PosteriorMismatchError naming the tensors, as every sampling of it would."""
    from hf_evon import PosteriorMismatchError

    _, post, cal, _ = trained(steps=30)
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    with torch.no_grad():
        other[2].weight.mul_(0.01)  # an underconfident mean: no scale is scored
    with pytest.raises(PosteriorMismatchError, match=r"'0.weight' has shape \(16, 6\) in the model but \(32, 6\)"):
        calibrate_posterior(other, post, cal, keep_trained=False)


class FixedLogits(nn.Module):
    """Returns the logits it is given, times ``scale`` (a model whose temperature is known)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((1, 1), scale))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z * self.weight[0, 0]


@pytest.mark.parametrize("scale", [0.5, 1.0, 3.0])
def test_the_means_temperature_is_the_grid_point_of_least_nll(scale: float) -> None:
    """Labels drawn from softmax(z), a model that outputs scale·z: its best temperature is about
    scale (> 1: overconfident, which BMA can soften; < 1: underconfident, which it cannot), and the
    recorded one is exactly the grid point of least NLL by a plain float64 reference."""
    from hf_evon.posterior.gaussian import MatrixFactors
    from hf_evon.predictive.calibration import TEMPERATURE_GRID

    gen = torch.Generator().manual_seed(0)
    z = 2 * torch.randn(4000, 5, generator=gen)
    y = torch.distributions.Categorical(logits=z).sample()
    batches = [(z[:2000], y[:2000]), (z[2000:], y[2000:])]
    model = FixedLogits(scale)
    posterior = EVONPosterior.from_factors(
        {"weight": MatrixFactors(None, None, torch.ones(1, 1), (1, 1), (1, 1), 1e4, 1e-3)}
    )
    _, result = calibrate_posterior(model, posterior, batches, grid=[1.0], num_samples=2)
    reference = [float(nn.functional.cross_entropy(scale * z.double() / t, y)) for t in TEMPERATURE_GRID]
    assert result.mean_temperature == TEMPERATURE_GRID[reference.index(min(reference))]
    assert abs(math.log2(result.mean_temperature / scale)) <= 0.25  # within one grid step of the truth
    assert result.to_json()["mean_temperature"] == result.mean_temperature


@pytest.mark.parametrize("num_samples", [6, 8])
@pytest.mark.parametrize("k", [0.0, 0.5])
def test_draws_that_equal_the_mean_tie_with_it_and_the_mean_is_kept(num_samples: int, k: float) -> None:
    """A scale whose draws are below the weights' float32 resolution (ζ × 1e30) predicts exactly as
    the mean: its BMA NLL is the mean's, bit for bit, and the walk from the mean keeps the first of
    tied candidates (k = 0: the first lowest NLL; k > 0: no gain at all). Before, logsumexp − log S
    of S equal values was off in the last bit: the 8 draws' NLL 1.5091104326381326 against the mean's
    1.5091104326381324, and the 6 draws "beat" the mean even at k = 0.5 (ess 1e34 chosen)."""
    from hf_evon.posterior.gaussian import MatrixFactors

    model = FixedLogits(3.0)
    posterior = EVONPosterior.from_factors(
        {"weight": MatrixFactors(None, None, torch.ones(1, 1), (1, 1), (1, 1), 1e4, 1e-3)}
    )
    assert float(posterior.scale_ess(1e30).draw(num_samples, seed=0)["weight"].abs().max()) < 1e-16
    torch.manual_seed(0)  # _fixed_logit_data's labels come from the global generator
    _, result = calibrate_posterior(
        model, posterior, _fixed_logit_data(400), grid=[1e30], num_samples=num_samples, standard_errors=k,
        min_gain=0.0, temperature=False, always_scan=True, screen_factor=0.0, keep_trained=False,
    )  # fmt: skip
    assert result.grid == [1e4 * 1e30] and result.nll == [result.mean_nll]
    assert result.ess == math.inf


def test_one_causal_lm_rule_for_plain_peft_and_encoder_decoder_models() -> None:
    """hf_evon.modeling.is_causal_lm: shifted labels for causal LMs (PEFT-wrapped too), never for an
    encoder-decoder or a classifier; calibration and the trainer use this one rule."""
    from peft import LoraConfig, get_peft_model
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    from hf_evon.modeling import is_causal_lm

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        )
    )
    bart = BartForConditionalGeneration(
        BartConfig(
            vocab_size=50,
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_position_embeddings=32,
        )
    )
    bert = BertForSequenceClassification(
        BertConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    )
    lora = get_peft_model(gpt2, LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    assert is_causal_lm(llama) and is_causal_lm(gpt2) and is_causal_lm(lora)
    assert not is_causal_lm(bart) and not is_causal_lm(bert) and not is_causal_lm(torch.nn.Linear(2, 2))
    assert is_causal_lm(torch.nn.parallel.DataParallel(llama))
    # wrappers in any order: accelerate compiles the DDP module (compile(DDP(model)))
    assert is_causal_lm(torch.compile(torch.nn.parallel.DataParallel(llama)))
    assert is_causal_lm(torch.nn.parallel.DataParallel(torch.compile(lora)))
    assert not is_causal_lm(torch.compile(torch.nn.parallel.DataParallel(bart)))


def test_a_compiled_models_posterior_has_the_models_own_names(tmp_path) -> None:
    # torch.compile's wrapper put "_orig_mod." before every name and "OptimizedModule" as the class:
    # the posterior did not fit its own model, and sampled(compiled) refused the plain one's
    from conftest import one_step_optimizer
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_evon import EVONPosterior

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    compiled = torch.compile(torch.nn.parallel.DataParallel(model))
    opt = one_step_optimizer(model, 50)
    taken = EVONPosterior.from_optimizer(opt, compiled)
    assert list(taken.names) == list(EVONPosterior.from_optimizer(opt, model).names)
    assert all(name.startswith("transformer.") for name in taken.names)
    assert taken.config["model_class"] == "GPT2LMHeadModel"
    taken.save_pretrained(tmp_path, model_card=False)
    EVONPosterior.from_pretrained(tmp_path, model=model)  # fits the model it was taken from
    before = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    with taken.sampled(compiled, seed=0):
        assert not torch.equal(model.transformer.h[0].attn.c_attn.weight, before)
    assert torch.equal(model.transformer.h[0].attn.c_attn.weight, before)


def test_calibration_shifts_a_gpt2s_labels_unless_told_otherwise() -> None:
    """``shift_labels=None`` asks the one causal-LM rule: for GPT-2 (``GPT2LMHeadModel``) the
    search is the one with ``shift_labels=True``, and differs from the unshifted one."""
    from transformers import GPT2Config, GPT2LMHeadModel


    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    ids = torch.randint(0, 50, (4, 12))
    posterior = _trained_posterior(model, lambda: model(input_ids=ids, labels=ids).loss, 2, ess=1e4)
    batches = [{"input_ids": ids, "labels": ids}]
    results = {
        shift: calibrate_posterior(model, posterior, batches, grid=[1.0], num_samples=2, shift_labels=shift)[
            1
        ]
        for shift in (None, True, False)
    }
    assert results[None].nll == results[True].nll and results[None].mean_nll == results[True].mean_nll
    assert results[None].num_targets == 4 * 11 and results[False].num_targets == 4 * 12


def test_a_nan_in_the_held_out_inputs_is_refused_naming_the_batch() -> None:
    """Issue 33 item 9: one NaN input made every NLL NaN, and the search returned normally with
    "the mean", the temperature grid's end and a config reading "NLL nan vs nan"."""
    model, post, cal, _ = trained()
    x, y = cal[1]
    x = x.clone()
    x[3, 2] = float("nan")
    with pytest.raises(ValueError, match=r"batch 1 .*non-finite"):
        calibrate_posterior(model, post, [cal[0], (x, y)], grid=[1.0], num_samples=2)
    assert post.ess == post.config.get("trained_ess", post.ess)  # the posterior is untouched


@pytest.mark.parametrize("bad", [-1, 3])
def test_a_label_outside_the_classes_is_refused_naming_the_batch(bad) -> None:
    """-1 for "no label" (GLUE's test splits) or a class the model lacks failed inside the gather
    ("index out of bounds"; on a GPU a device-side assert that ends the process). Refused in the
    words of every label range check (require_scorable_labels): the first such batch, and its
    first such label, read once the pass has found it."""
    model, post, cal, _ = trained()
    x, y = cal[1]
    y, later = y.clone(), cal[0][1].clone()
    y[7], y[9], later[0] = bad, 5, 4
    message = (
        rf"^calibrate_posterior: batch 1 \(counting from 0\) has label {bad}, outside the model's 3 classes "
        r"\(0 to 2; -100 marks a target that is not scored\)$"
    )
    with pytest.raises(ValueError, match=message):
        calibrate_posterior(model, post, [cal[0], (x, y), (cal[0][0], later)], grid=[1.0], num_samples=2)
    y[9] = 1  # one of the classes again
    y[7] = -100  # not scored: accepted
    assert calibrate_posterior(model, post, [cal[0], (x, y)], grid=[1.0], num_samples=2)[1].num_targets == 2 * len(y) - 1


def test_regression_targets_are_refused_naming_the_batch() -> None:
    """Floating-point labels (a regression's) were cast to class indices: targets in [0, 1) all
    became class 0 and the calibration returned normally, larger ones failed with "index out of
    bounds"."""
    model, post, cal, _ = trained()
    x, y = cal[1]
    targets = torch.rand(y.shape, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"batch 1 \(counting from 0\) has floating-point labels \(torch.float32\)"):
        calibrate_posterior(model, post, [cal[0], (x, targets)], grid=[1.0], num_samples=2)
    assert calibrate_posterior(model, post, [cal[0], (x, y)], grid=[1.0], num_samples=2)[1].num_targets == 2 * len(y)


def test_a_single_logit_model_is_refused_naming_its_one_class() -> None:
    """A binary classifier with one logit (trained with BCEWithLogits) calibrated on class labels: the
    softmax of its one logit is 1 whatever the input, so labels all 0 "calibrated" on held-out NLL 0
    and returned normally, and a label 1 read as outside the model's classes. Both are refused before
    any sample is drawn, naming the logits' one class; so is the trainer's check of a calibration set."""
    from hf_evon.predictive.held_out import held_out_classes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = build_optimizer(model, seed=0)
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
    y = (x[:, 0] > 0).long()
    for _ in range(3):
        with opt.sampled_params(train=True):
            nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y.float()).backward()
        opt.step()
        opt.zero_grad()
    post = EVONPosterior.from_optimizer(opt, model)
    one_class = r"the model's logits \(64, 1\) have one class: .*single logit"
    for labels in (torch.zeros_like(y), y):
        with pytest.raises(ValueError, match=r"^calibrate_posterior: batch 0 \(counting from 0\): " + one_class):
            calibrate_posterior(model, post, [(x, labels)], grid=[1.0], num_samples=2)
        with pytest.raises(ValueError, match=r"^EVONTrainer: calibration_dataset: " + one_class):
            held_out_classes(model, (x, labels), False, "EVONTrainer: calibration_dataset")


def test_a_calibration_summary_says_what_was_chosen() -> None:
    """The one line the trainer and the quickstart print: the mean kept, or the scale chosen."""
    from hf_evon.predictive.calibration import CalibrationResult

    common = dict(trained_ess=2e4, grid=[2e4, 2e3], nll=[0.5, 0.4], mean_nll=0.6, num_samples=8,
                  num_targets=50, seed=0, mean_temperature=1.5)  # fmt: skip
    chosen = CalibrationResult(ess=2e3, **common).summary()
    assert "ess = 2000 = 0.1 x the trained 2e+04" in chosen and "NLL 0.4000 vs 0.6000" in chosen
    assert "50 targets" in chosen and "temperature there 1.50: overconfident" in chosen
    assert "at its temperature" not in chosen  # no tempered mean scored
    # the mean at its temperature beside the chosen scale: what the noise adds to a temperature
    tempered = CalibrationResult(ess=2e3, **common, tempered_mean_nll=0.45).summary()
    assert "NLL 0.4000 vs 0.6000 at the mean, 0.4500 at its temperature (50 targets" in tempered
    kept = CalibrationResult(ess=math.inf, **{**common, "mean_temperature": 0.9}).summary()
    assert "BMA is the mean" in kept and "NLL 0.6000 vs 0.6000" in kept and "not overconfident" in kept
    assert "at least" not in chosen + kept
    # the grid's largest temperature: the mean may be more overconfident than it says (it read "8.00: overconfident")
    capped = CalibrationResult(ess=2e3, **{**common, "mean_temperature": 8.0}).summary()
    assert "temperature there 8.00: overconfident, at least (the largest temperature scored, 8)" in capped


def _two_group_posterior(reverse: bool = False) -> tuple[nn.Module, EVONPosterior]:
    """An MLP whose two EVON groups train at ζ 1000 and 10: a posterior with two noise scales
    (``reverse``: the group at 10 first, so the top-level ζ is not that of the first name, "0.weight")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    from hf_evon import EVON

    groups = [{"params": [model[0].weight], "ess": 1e3}, {"params": [model[2].weight], "ess": 10.0}]
    opt = EVON(groups[::-1] if reverse else groups, seed=0)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    for _ in range(5):
        with opt.sampled_params(train=True):
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, EVONPosterior.from_optimizer(opt, model, max_basis_ratio=None)


@pytest.mark.parametrize("multiplier", [1.0, 0.01, math.inf])
def test_a_calibration_scales_every_groups_own_ess_and_remembers_each(multiplier: float, tmp_path) -> None:
    """A posterior of two EVON groups: the calibration set every group to the first group's ζ times
    the multiple, so "the posterior as trained" shrank the second group's std 10x, and restoring
    the trained scale (predict_uncertainty) did the same."""
    from hf_evon.predictive.calibration import CalibrationResult, trained_posterior

    _, post = _two_group_posterior()
    assert {n: f.ess for n, f in post.factors.items()} == {"0.weight": 1e3, "2.weight": 10.0}
    result = CalibrationResult(ess=post.ess * multiplier, trained_ess=post.ess, grid=[post.ess], nll=[1.0],
                               mean_nll=1.0, num_samples=2, num_targets=4, seed=0)  # fmt: skip
    calibrated = result.apply(post)
    for name in post.names:
        expected = post.std(name) / math.sqrt(multiplier)
        assert torch.allclose(calibrated.std(name), expected, rtol=1e-6, atol=0), name
        assert calibrated[name].ess == post[name].ess * multiplier
    assert calibrated.ess == result.ess and calibrated.config["trained_ess_by_parameter"] == {"2.weight": 10.0}
    calibrated.save_pretrained(tmp_path)
    for restored in (trained_posterior(calibrated), trained_posterior(EVONPosterior.from_pretrained(tmp_path))):
        assert {n: f.ess for n, f in restored.factors.items()} == {"0.weight": 1e3, "2.weight": 10.0}
        assert all(torch.equal(restored.std(n), post.std(n)) for n in post.names)
    again = result.apply(calibrated)  # applied to a calibrated posterior: from the trained one, not on top
    assert all(again[n].ess == calibrated[n].ess for n in post.names)


@pytest.mark.parametrize("multiplier", [0.01, math.inf])
def test_a_calibrated_posteriors_ess_is_the_chosen_one_whichever_group_comes_first(multiplier: float, tmp_path) -> None:
    """Where the first EVON group (the top-level ζ, 10) is not the first name's ("0.weight", at 1000), the
    calibrated posterior's ``ess`` (and the saved config's, the card's table) was the first name's ζ times the
    multiple, 1000 x 0.01, not the chosen 10 x 0.01 its calibration record names."""
    from hf_evon.predictive.calibration import CalibrationResult

    _, post = _two_group_posterior(reverse=True)
    assert post.ess == 10.0 and post["0.weight"].ess == 1e3
    result = CalibrationResult(ess=post.ess * multiplier, trained_ess=post.ess, grid=[post.ess], nll=[1.0],
                               mean_nll=1.0, num_samples=2, num_targets=4, seed=0)  # fmt: skip
    calibrated = result.apply(post)
    assert calibrated.ess == result.ess and calibrated["2.weight"].ess == result.ess
    assert calibrated["0.weight"].ess == 1e3 * multiplier
    calibrated.save_pretrained(tmp_path)
    assert EVONPosterior.from_pretrained(tmp_path).ess == result.ess


@pytest.mark.parametrize("reverse", [False, True])
def test_a_scale_set_by_hand_keeps_the_trained_one_for_the_calibration(reverse: bool) -> None:
    """``with_ess``/``scale_ess`` on an uncalibrated posterior recorded no trained ζ, so ``calibrate_posterior``
    took the hand-set scale for the trained one and searched its multiples; on a calibrated one they kept the
    calibration's record, which no longer described the scale."""
    from dataclasses import asdict

    from hf_evon.predictive.calibration import trained_posterior

    model, post = _two_group_posterior(reverse)
    torch.manual_seed(1)
    batches = [(torch.randn(16, 4), torch.randint(0, 3, (16,))) for _ in range(2)]
    kwargs = dict(grid=[0.01, 1.0], num_samples=2, always_scan=True)
    reference, result = calibrate_posterior(model, post, batches, **kwargs)
    by_name = {n: f.ess for n, f in post.factors.items()}
    for hand in (post.scale_ess(0.5), post.with_ess(5.0), post.with_ess({"0.weight": 2.0, "2.weight": 3.0}),
                 reference.with_ess(5.0), reference.scale_ess(3.0)):  # fmt: skip
        assert hand.config.get("calibration") is None and hand.config["trained_ess"] == post.ess
        restored = trained_posterior(hand)
        assert restored.ess == post.ess and {n: f.ess for n, f in restored.factors.items()} == by_name
        again, again_result = calibrate_posterior(model, hand, batches, **kwargs)
        assert asdict(again_result) == asdict(result)
        assert again.config == reference.config and {n: again[n].ess for n in post.names} == {
            n: reference[n].ess for n in post.names
        }


def test_scale_ess_keeps_the_groups_ratios_and_with_ess_takes_one_per_name() -> None:
    _, post = _two_group_posterior()
    half = post.scale_ess(4.0)
    assert {n: f.ess for n, f in half.factors.items()} == {"0.weight": 4e3, "2.weight": 40.0}
    assert all(torch.allclose(half.std(n), post.std(n) / 2, rtol=1e-6, atol=0) for n in post.names)
    assert post.with_ess(5.0)["2.weight"].ess == 5.0  # one ζ everywhere
    split = post.with_ess({"0.weight": 7.0, "2.weight": 9.0})
    assert split["0.weight"].ess == 7.0 and split["2.weight"].ess == 9.0
    with pytest.raises(KeyError, match="exactly the covered names"):
        post.with_ess({"0.weight": 7.0})
    with pytest.raises(TypeError, match="scale_ess: factor must be a number"):
        post.scale_ess("2")


def test_scale_ess_names_a_factor_not_above_0() -> None:
    """A factor <= 0 (or NaN) was reported as the product: ``scale_ess(-1)`` as "ess must be > 0; got
    -1000.0", a point mass's ``scale_ess(0)`` as "got nan", neither naming the factor given."""
    _, post = _two_group_posterior()
    for posterior in (post, post.with_ess(math.inf)):
        for factor in (-1.0, 0, math.nan, -math.inf):
            with pytest.raises(ValueError, match=rf"^scale_ess: factor must be > 0 \(inf for no noise\); got {factor!r}$"):
                posterior.scale_ess(factor)
    assert post.scale_ess(math.inf).is_point_mass


def test_batches_that_come_in_another_order_on_a_later_pass_are_refused() -> None:
    """BMA averages each target's probabilities over passes that each read the batches again: a
    DataLoader with shuffle=True paired one example's log-probabilities with another's, and the NLLs
    (on an MLP of 32 hidden units, 0.71 where the data's is 0.77) were silently wrong. An unshuffled DataLoader
    gives the list's result exactly; a shuffled one is refused by name."""
    from torch.utils.data import DataLoader, TensorDataset

    model, post = _two_group_posterior()
    x, y = torch.randn(64, 4, generator=torch.Generator().manual_seed(1)), torch.arange(64) % 3
    options = {"num_samples": 2, "grid": [1.0, 0.1], "always_scan": True, "temperature": False, "screen_factor": 0}
    _, listed = calibrate_posterior(model, post, [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)], **options)
    _, loaded = calibrate_posterior(model, post, DataLoader(TensorDataset(x, y), batch_size=16), **options)
    assert loaded.nll == listed.nll and loaded.mean_nll == listed.mean_nll and listed.nll
    torch.manual_seed(0)
    shuffled = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"^calibrate_posterior: batch 0 \(counting from 0\) holds other labels .*shuffle"):
        calibrate_posterior(model, post, shuffled, **options)
    assert model.training and all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))  # the mean, as given
    fewer = [[(x[:32], y[:32]), (x[32:], y[32:])], [(x[:32], y[:32])]]  # a later pass with fewer batches
    with pytest.raises(ValueError, match=r"^calibrate_posterior: a later pass over the batches gave 1 batches where the first gave 2"):
        calibrate_posterior(model, post, _Passes(fewer), **options)


class _Passes:
    """Re-iterable batches: ``passes[0]`` until one pass has read them all, then ``passes[1]``."""

    def __init__(self, passes: list) -> None:
        self.passes, self.done = passes, False

    def __iter__(self):
        yield from self.passes[self.done]
        self.done = True


def test_a_prompt_tuned_lm_is_calibrated_on_the_tokens_its_loss_scores() -> None:
    """PEFT's prompt tuning prepends virtual tokens: the logits are longer than the labels and the
    last virtual token predicts the first label. The calibration refused it ("labels do not align")
    where the evaluation and the model's own loss score every label."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = peft.get_peft_model(
        LlamaForCausalLM(config), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    )
    ids = torch.randint(0, 64, (6, 10))
    loss = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    posterior = _trained_posterior(model, loss, 3, evon_patterns=["prompt_encoder"])
    assert posterior.names and all("prompt_encoder" in n for n in posterior.names)
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss  # the mean of -log p over all 6·10 labels
    _, result = calibrate_posterior(model, posterior, [{"input_ids": ids, "labels": ids}], grid=[1.0], num_samples=2)
    assert result.num_targets == ids.numel()
    assert result.mean_nll == pytest.approx(float(loss), rel=1e-5)


def test_mean_temperature_is_the_calibrations_rule_for_a_point_estimate() -> None:
    """``mean_temperature``: on logits 3x too confident for labels drawn from softmax(z), the grid's
    least-NLL temperature (found here by brute force); on a split the mean gets right, T = 1."""
    from hf_evon.predictive.calibration import TEMPERATURE_GRID, mean_temperature

    g = torch.Generator().manual_seed(0)
    z = torch.randn(20000, 5, generator=g, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(z, -1), 1, generator=g).squeeze(1)
    nll = [float(nn.functional.cross_entropy(3 * z / t, y)) for t in TEMPERATURE_GRID]
    best = TEMPERATURE_GRID[min(range(len(nll)), key=nll.__getitem__)]
    assert 2.5 < best < 3.5
    assert mean_temperature(3 * z, y) == best
    confident = torch.zeros(40, 3, dtype=torch.float64)
    confident[torch.arange(40), torch.arange(40) % 3] = 4.0  # every row right: nothing to sharpen on
    assert mean_temperature(confident, torch.arange(40) % 3) == 1.0


def test_a_tuple_output_led_by_its_loss_is_calibrated_on_its_logits() -> None:
    """An encoder-decoder without ``prepare_decoder_input_ids_from_labels`` is called with its
    labels, so a ``return_dict=False`` output leads with the loss: the calibration read that 0-d
    loss as the logits ('labels do not align')."""
    from types import SimpleNamespace

    class ToyEncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(is_encoder_decoder=True)
            self.emb = nn.Embedding(7, 4)
            self.head = nn.Linear(4, 7)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> tuple:
            logits = self.head(self.emb(input_ids))
            if labels is None:
                return (logits,)
            return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits

    torch.manual_seed(0)
    model = ToyEncoderDecoder()
    ids = torch.randint(0, 7, (6, 5))
    posterior = _trained_posterior(model, lambda: model(ids, labels=ids)[0], 2, evon_patterns=["head"])
    with torch.no_grad():
        loss = model(ids, labels=ids)[0]
    _, result = calibrate_posterior(model, posterior, [{"input_ids": ids, "labels": ids}], grid=[1.0], num_samples=2)
    assert result.num_targets == ids.numel()
    assert result.mean_nll == pytest.approx(float(loss), rel=1e-6)


def test_an_encoder_decoder_calibrates_on_pairs_as_on_dict_batches() -> None:
    """A T5 given (input_ids, labels) pairs was called as model(input_ids) and raised transformers'
    "You must specify exactly one of input_ids or inputs_embeds" from inside its decoder."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config)
    x = torch.randint(2, 40, (4, 6))
    y = x.flip(-1)
    posterior = _trained_posterior(model, lambda: model(input_ids=x, labels=y).loss, 2)
    with torch.no_grad():
        loss = float(model.eval()(input_ids=x, labels=y).loss)  # the calibration's forward: no dropout
    _, as_dict = calibrate_posterior(model, posterior, [{"input_ids": x, "labels": y}], grid=[1.0], num_samples=2)
    _, as_pair = calibrate_posterior(model, posterior, [(x, y)], grid=[1.0], num_samples=2)
    assert as_dict.mean_nll == pytest.approx(loss, rel=1e-6)
    assert (as_pair.num_targets, as_pair.mean_nll, as_pair.nll) == (as_dict.num_targets, as_dict.mean_nll, as_dict.nll)


def test_the_causal_lm_rule_agrees_with_each_models_own_loss() -> None:
    """A model's labels are shifted where its own loss shifts them: XLNet's and XLM's LM heads are
    in transformers' causal-LM mapping, but their loss scores position t against label t (before,
    the posterior metrics and the calibration shifted their labels and scored other targets)."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        XLMConfig,
        XLMWithLMHeadModel,
        XLNetConfig,
        XLNetLMHeadModel,
    )

    from hf_evon.modeling import is_causal_lm

    torch.manual_seed(0)
    models = [
        GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)),
        XLNetLMHeadModel(XLNetConfig(vocab_size=50, d_model=16, n_layer=1, n_head=2, d_inner=32, dropout=0.0)),
        XLMWithLMHeadModel(XLMConfig(vocab_size=50, emb_dim=16, n_layers=1, n_heads=2, dropout=0.0)),
    ]
    ids = torch.randint(3, 50, (2, 8))
    for model in models:
        model.eval()
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids)
        logits = out.logits.float()
        unshifted = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        shifted = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        assert not torch.isclose(unshifted, shifted, rtol=1e-3)  # the check can tell them apart
        assert is_causal_lm(model) == bool(torch.isclose(out.loss, shifted, rtol=1e-5)), type(model).__name__
        assert is_causal_lm(model) != bool(torch.isclose(out.loss, unshifted, rtol=1e-5)), type(model).__name__


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_entries", [1 << 18, 5 * 40, 1])  # one chunk; 5 rows and a ragged end; 1 row
def test_tempered_log_probs_are_log_softmax_at_each_temperature_and_leave_the_logits_alone(
    chunk_entries: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every temperature's log p(label) is log_softmax(logits / T)'s in float64, for logits that
    would overflow exp unshifted (±800), whatever the chunks the rows are scored in: to 1e-12 for
    float64 logits, within the float32 exps' error for float32 and bfloat16 ones (whose
    differences from their row's maximum are exact in float32); the logits are read, not shifted
    in place."""
    from hf_evon.predictive import held_out
    from hf_evon.predictive.held_out import tempered_log_probs

    monkeypatch.setattr(held_out, "_CHUNK_ENTRIES", chunk_entries)
    from hf_evon.predictive.logprobs import labelled_rows

    torch.manual_seed(0)
    logits = torch.randn(3, 6, 40, dtype=torch.float64) * 5
    logits[0, 0, 7] = 800.0
    logits[1, 2, 3] = -800.0
    logits = logits.to(dtype)
    labels = torch.randint(0, 40, (3, 6))
    labels[2, :2] = -100
    temperatures = [0.25, 1.0, 2.0 ** 0.25, 3.0]
    tolerance = 1e-12 if dtype == torch.float64 else FLOAT32_SCORING
    before = logits.clone()
    for shift in (True, False):  # unshifted, the rows are a view of the logits
        got = tempered_log_probs(logits, labels, shift, temperatures)
        assert torch.equal(logits, before)
        rows, target = labelled_rows(logits, labels, shift)
        for i, t in enumerate(temperatures):
            expected = torch.log_softmax(rows.double() / t, dim=-1).gather(1, target[:, None]).squeeze(1)
            assert got.dtype == torch.float64
            assert torch.allclose(got[i], expected, rtol=tolerance, atol=tolerance), float((got[i] - expected).abs().max())
        assert torch.isfinite(got).all()


@pytest.mark.parametrize(
    "case", ["unshifted", "shifted", "virtual tokens", "not contiguous", "2-D classifier", "no label"]
)
def test_the_scored_rows_are_found_by_index_without_copying_the_logits(case: str) -> None:
    """``labelled_row_index`` names the rows of ``logits.reshape(-1, classes)`` that ``labelled_rows``
    selects, in order, with the same labels: unshifted, a causal LM's shift, prompt tuning's
    virtual tokens (the logits longer than the labels), logits that are a non-contiguous view, a
    classifier's [batch, classes], and no scored label at all. ``tempered_log_probs`` reads the
    rows by this index, chunk by chunk, instead of copying every scored row out of the logits
    (twice for a shifted LM: the shifted view's reshape and the mask)."""
    from hf_evon.predictive.logprobs import labelled_row_index, labelled_rows

    gen = torch.Generator().manual_seed(1)
    shift = case in ("shifted", "virtual tokens", "not contiguous")
    if case == "2-D classifier":
        logits, labels = torch.randn(7, 5, generator=gen), torch.tensor([0, 4, -100, 2, 1, -100, 3])
    else:
        logits = torch.randn(3, 9 if case == "virtual tokens" else 6, 11, generator=gen)
        labels = torch.randint(0, 11, (3, 6), generator=gen)
        labels[1, 2:4] = -100
        if case == "no label":
            labels[:] = -100
        if case == "not contiguous":
            logits = torch.randn(3, 11, 6, generator=gen).transpose(1, 2)
    rows, target = labelled_rows(logits, labels, shift)
    index, indexed_target = labelled_row_index(logits, labels, shift)
    assert torch.equal(logits.reshape(-1, logits.shape[-1])[index], rows)
    assert torch.equal(indexed_target, target) and len(index) == len(target)
    assert len(index) == (0 if case == "no label" else int((labels[:, 1:] if shift and case != "virtual tokens" else labels).ne(-100).sum()))


def test_tempered_log_probs_holds_a_chunk_of_the_rows_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring an LM's logits allocates nothing larger than a chunk of rows (here 2,048 entries, two
    rows of 1,000 classes) and the per-target vectors: the scored rows are never copied out of the
    logits whole. Before, ``labelled_rows`` copied all of them, twice for a shifted LM (the
    shifted view's reshape, then the mask): 4 × 31 × 1,000 entries."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_evon.predictive import held_out

    monkeypatch.setattr(held_out, "_CHUNK_ENTRIES", 2048)
    logits = torch.randn(4, 32, 1000, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(1))

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            inputs = [*args, *(kwargs or {}).values()]
            read = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in read:  # not a view
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    with Largest():
        got = held_out.tempered_log_probs(logits, labels, True, [1.0, 2.0])
    expected = torch.log_softmax(logits[:, :-1].double() / 2.0, -1).gather(-1, labels[:, 1:, None]).reshape(-1)
    torch.testing.assert_close(got[1], expected, rtol=0, atol=FLOAT32_SCORING)
    assert Largest.numel == 2 * 1000  # a chunk: two rows


def test_calibrating_a_model_without_peft_does_not_import_peft() -> None:
    """A plain torch model's calibration imported peft (and with it transformers) to look for PEFT's
    tuner layers, seconds on the first call: no model can hold one unless peft is imported."""
    import subprocess
    import sys

    code = """
import sys
import torch
from torch import nn
from hf_evon import EVONPosterior, build_optimizer
from hf_evon.predictive.calibration import calibrate_posterior
torch.manual_seed(0)
model = nn.Linear(4, 3)
opt = build_optimizer(model, seed=0)
x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
with opt.sampled_params(train=True):
    nn.functional.cross_entropy(model(x), y).backward()
opt.step()
calibrate_posterior(model, EVONPosterior.from_optimizer(opt, model), [(x, y)], always_scan=True)
print(sorted(m for m in ("peft", "transformers") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_batch_whose_labels_are_all_ignored_adds_no_targets() -> None:
    """A held-out batch whose labels are all -100 (or an LM batch of one-token rows) raised
    UnboundLocalError inside the temperature scoring, which read its chunk loop's variable after a
    loop that never ran. Such a batch adds no targets: the calibration equals the one without it;
    with no labelled target anywhere it is refused by name."""
    model, posterior, cal, _ = trained()
    x, _ = cal[0]
    ignored = (torch.randn_like(x), torch.full((len(x),), -100))
    _, alone = calibrate_posterior(model, posterior, cal, seed=0, num_samples=4)
    _, with_it = calibrate_posterior(model, posterior, [*cal, ignored], seed=0, num_samples=4)
    assert (with_it.ess, with_it.temperature, with_it.chosen_nll) == (alone.ess, alone.temperature, alone.chosen_nll)
    with pytest.raises(ValueError, match="hold no labelled targets"):
        calibrate_posterior(model, posterior, [ignored], seed=0, num_samples=4)
