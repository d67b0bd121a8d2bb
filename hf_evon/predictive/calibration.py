"""Post-hoc calibration of a posterior's sampling scale on held-out data.

EVON trains with an effective sample size ζ that tempers the posterior (``ess="auto"`` makes
ζ ≫ N so the noise never swamps the weights); the best scale for *predicting* is a separate
question, answered on data the model did not train on. Like laplace-torch's
``optimize_prior_precision(method="gridsearch", val_loader=...)`` for its prior precision,
:func:`calibrate_posterior` scans ζ over a grid of multiples of the trained value and keeps
one by Bayesian-model-averaging NLL: walking from the mean (ζ = ∞) towards more noise, a
noisier scale replaces the choice so far only if its NLL is lower by more than half a standard
error of the difference (``standard_errors=0.5``), and the final choice must beat the mean's NLL
by at least ``min_gain`` (1%). Else the choice is the posterior as trained, unless the mean (ζ =
∞, every sample the mean) predicts better than it by more than half a standard error or 1%
(below), so on the calibration data BMA is never worse than the mean by more than the smaller of
the two.

Where the mean is overconfident on the held-out data (``temperature=True``, the default), each
scale, the mean included, is scored with its own softmax temperature T >= 1: the predictive is
``p̄ = 1/S Σ_s softmax(logits_s / T)``. Averaging samples can only soften predictions, and a mean
that is many times overconfident needs so much noise to be softened that the noise costs accuracy;
T does that part, and a scale is kept only where the weight noise adds to what T alone achieves
(the same standard-error and ``min_gain`` rules, against the mean at its own T).
measured: docs/trainer.md#calibration-temperature
Where the mean is not overconfident (its best T is not above 1), no other scale is scored:
averaging samples only softens (measured: docs/trainer.md#calibration-scan-gate). An underconfident
mean is sharpened (T < 1) only under ``MIN_ERRORS_TO_SHARPEN``'s rule, and then every scale the
calibration scores, the trained one included, is scored at the mean's T, scanned or not
(measured: docs/trainer.md#calibration-sharpening).

Where no scale beats the mean, the posterior EVON trained (ζ × 1) is kept unless the mean
predicts better than it by more than the same k standard errors or by more than ``min_gain``
(``keep_trained=True``): near the mean its samples cost no held-out NLL, and their disagreement
is the epistemic uncertainty that flags inputs unlike the training data, which the mean's single
prediction cannot show (measured: docs/trainer.md#calibration-keep-trained).

The chosen ζ and T become the returned posterior's ``ess`` and ``temperature`` (so BMA evaluation,
``generate_bma``, ``bma_log_likelihood``, the CLI and the model card use them without being told),
and the search is recorded in its config under ``"calibration"`` (``trained_ess`` keeps the value
the optimizer learned with). Report metrics on other examples than the calibration ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from hf_evon.modeling import is_causal_lm
from hf_evon.optim.checks import is_real as _is_real
from hf_evon.optim.checks import sample_count
from hf_evon.optim.noise import resolve_seed
from hf_evon.predictive.held_out import scored_pass, tempered_log_probs
from hf_evon.predictive.logprobs import log_mean_prob, require_softmax_model

Tensor = torch.Tensor

# Multiples of the trained ζ. Smaller ζ = more noise: "auto" trains with a small, tempered noise
# and BMA usually wants more of it; ∞ (the posterior mean) is always a candidate besides these.
# measured: docs/trainer.md#calibration-grid
DEFAULT_GRID: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)
DEFAULT_NUM_SAMPLES = 8  # as EVONConfig.bma_num_samples
# A noisy scale is kept only if its held-out BMA NLL is at least this fraction below the mean's,
# else BMA is the mean: smaller gains on the calibration split do not carry over to test.
# measured: docs/trainer.md#calibration-min-gain
DEFAULT_MIN_GAIN = 0.01
# Each step towards more noise (and softening the mean) must lower the held-out NLL by more than
# this many standard errors of the difference (targets and draws: a jackknife over the draw
# index). NLL's optimum sits next to a cliff (more noise soon ruins every prediction), and on a few
# hundred examples a gain carried by the handful the mean gets confidently wrong often oversteps it.
# measured on validation halves: docs/trainer.md#calibration-standard-errors
DEFAULT_STANDARD_ERRORS = 0.5
# Softmax temperatures, 0.125-8 in steps of 19% (a step off the optimum costs well under 1% of
# NLL): the mean's best T among them is recorded with every calibration (> 1: overconfident there).
TEMPERATURE_GRID: tuple[float, ...] = tuple(2.0 ** (k / 4) for k in range(-12, 13))
# The temperatures a noise scale is scored at where the mean is softened: softening, since samples
# only soften (elsewhere every scale is scored at the mean's T, a sharpened one included). Each costs
# one log-sum-exp over the classes per target and pass (a vocabulary's width for LMs).
# measured: docs/trainer.md#calibration-temperature
SOFTENING_TEMPERATURES: tuple[float, ...] = tuple(t for t in TEMPERATURE_GRID if t >= 1.0)
# Walking from little noise to much, a scale is scored with all its S draws only from the first
# whose first draw moves the held-out log p(label) by at least this many times ``min_gain`` of the
# mean's NLL (per target, on average); the scales before it are screened out. BMA's gain over the
# mean is second order in the draws' moves, and along the walk (the same seeds at every scale) the
# draws move further, so that first scale is found by bisecting the grid, one draw per probe. (The
# mean move over many targets grows with the noise; a handful of targets whose log p peaks between
# two scales can break that, and the bisection may then skip a scale a walk would score.)
# 0 (or min_gain = 0): every scale is scored.
# measured: docs/trainer.md#calibration-screen
SCREEN_FACTOR = 2.5
# An underconfident mean is sharpened (T < 1) only where the held-out split holds at least this
# many targets the mean gives less than even odds, and a cross-validation within the split says it
# carries over: sharpening is rewarded on the targets the mean gets right, and a split with few
# errors cannot show what it costs on the confident errors it has not met.
# measured: docs/trainer.md#calibration-sharpening
MIN_ERRORS_TO_SHARPEN = 10


@dataclass
class CalibrationResult:
    """What :func:`calibrate_posterior` tried and chose (``ess = inf``: BMA = the mean)."""

    ess: float
    trained_ess: float
    grid: list[float]
    nll: list[float]
    mean_nll: float
    num_samples: int
    num_targets: int
    seed: int
    standard_errors: float = DEFAULT_STANDARD_ERRORS
    min_gain: float = DEFAULT_MIN_GAIN
    # the mean's best temperature on the same data (TEMPERATURE_GRID; > 1: overconfident, the
    # only case averaging samples can help); None where not measured
    mean_temperature: float | None = None
    # the chosen temperature (1: none), each scale's own (aligned with grid), and the mean's NLL at
    # its own temperature; the last two are empty/None where every scale was scored at T = 1
    # (temperature=False, or the mean's rule kept T = 1: neither softened nor sharpened)
    temperature: float = 1.0
    temperatures: list[float] = field(default_factory=list)
    tempered_mean_nll: float | None = None
    # False: the mean was not overconfident, so no scale was scored but the trained one (keep_trained)
    scanned: bool = True
    # the ess values screened out (SCREEN_FACTOR): too little noise to move the predictions
    screened: list[float] = field(default_factory=list)
    screen_factor: float = SCREEN_FACTOR
    # whether the trained posterior was checked against the mean where no scale beat it, and its
    # held-out BMA NLL at its temperature there (None: not checked)
    keep_trained: bool = True
    trained_nll: float | None = None

    @property
    def multiplier(self) -> float:
        return self.ess / self.trained_ess

    @property
    def chosen_nll(self) -> float:
        """The held-out BMA NLL at the chosen ``ess`` and ``temperature`` (the mean's when ess = inf)."""
        if self.ess in self.grid:
            return self.nll[self.grid.index(self.ess)]
        if self.kept_trained:
            return self.trained_nll
        return self.mean_nll if self.tempered_mean_nll is None else self.tempered_mean_nll

    @property
    def kept_trained(self) -> bool:
        """The trained posterior kept: no scale beat the mean, and the mean did not beat it."""
        return self.trained_nll is not None and self.ess == self.trained_ess

    def summary(self) -> str:
        """One line: the chosen scale, the held-out NLLs and the mean's temperature there."""
        unscanned = (
            f"the mean is not overconfident there: no {'other ' if self.keep_trained else ''}scale was "
            "scored; always_scan=True scores them"
        )
        if self.kept_trained:
            scale = (
                f"ess = {self.ess:.4g}: the posterior as trained (the mean did not predict better by more than "
                f"{self.standard_errors:g} standard error(s) or {100 * self.min_gain:g}%"
                + ("" if self.scanned else f"; {unscanned}")
                + ")"
            )
        elif self.trained_nll is not None:
            # which bound decided: a gain under min_gain is one only by its standard errors, and the
            # reader sees how small it is
            mean_nll = self.chosen_nll
            percent = 100 * (self.trained_nll - mean_nll) / mean_nll if mean_nll else math.inf
            bound = (
                f"more than {100 * self.min_gain:g}%"
                if percent > 100 * self.min_gain
                else f"less than {100 * self.min_gain:g}% but more than {self.standard_errors:g} standard error(s)"
            )
            scale = (
                f"ess = inf: BMA is the mean (it predicted better than the trained posterior, NLL "
                f"{self.trained_nll:.4f}, by {percent:.2g}%: {bound})"
            )
        elif not self.scanned:
            scale = f"ess = inf: BMA is the mean ({unscanned}; weight noise only softens)"
        elif math.isinf(self.ess):
            scale = (
                f"ess = inf: BMA is the mean (no scale beat it by {self.standard_errors:g} standard "
                f"error(s) and {100 * self.min_gain:g}%)"
            )
        else:
            scale = f"ess = {self.ess:.4g} = {self.multiplier:.3g} x the trained {self.trained_ess:.4g}"
        if self.screened:
            scale += f"; {len(self.screened)} quieter scale(s) screened out (too little noise to move the predictions)"
        temperature = ""
        if self.mean_temperature is not None:
            confident = "overconfident" if self.mean_temperature > 1 else "not overconfident"
            if self.mean_temperature >= TEMPERATURE_GRID[-1]:  # the grid's end: a larger one may fit better
                confident += f", at least (the largest temperature scored, {TEMPERATURE_GRID[-1]:g})"
            temperature = f"; the mean's temperature there {self.mean_temperature:.2f}: {confident}"
        # the mean at its own temperature beside a chosen noise scale: what the noise adds to a temperature
        tempered = self.tempered_mean_nll is not None and self.chosen_nll != self.tempered_mean_nll
        at_temperature = f", {self.tempered_mean_nll:.4f} at its temperature" if tempered else ""
        return (
            f"calibrated sampling scale {scale}, temperature {self.temperature:.3g}; held-out NLL "
            f"{self.chosen_nll:.4f} vs {self.mean_nll:.4f} at the mean{at_temperature} ({self.num_targets} "
            f"targets{temperature})"
        )

    def apply(self, posterior: Any) -> Any:
        """``posterior`` sampled at the chosen ``ess`` and predicting at the chosen ``temperature``,
        its config recording the trained ζ and this search (what a saved posterior and its model
        card report)."""
        trained = trained_posterior(posterior)
        factors = getattr(trained, "factors", {})  # (stand-ins for other posteriors hold one ζ)
        others = {n: f.ess for n, f in factors.items() if f.ess != trained.ess}  # groups trained at another ζ
        # each parameter's trained ζ times the chosen multiple (exactly ``ess`` for the top level's)
        ess = {n: f.ess / trained.ess * self.ess for n, f in factors.items()} if others else self.ess
        calibrated = trained.with_ess(ess).with_temperature(self.temperature)
        calibrated.config["trained_ess"] = self.trained_ess
        calibrated.config.pop("trained_ess_by_parameter", None)
        if others:
            calibrated.config["trained_ess_by_parameter"] = others
            calibrated.config["ess"] = self.ess  # the top level's choice (with_ess's is the first name's)
        calibrated.config["calibration"] = self.to_json()
        return calibrated

    def to_json(self) -> dict[str, Any]:
        """JSON-safe (``inf`` as the string ``"inf"``, as in the posterior config)."""

        def enc(x: float) -> float | str:
            return "inf" if math.isinf(x) else float(x)

        d = asdict(self)
        d["ess"], d["trained_ess"] = enc(self.ess), enc(self.trained_ess)
        d["grid"] = [enc(x) for x in self.grid]
        d["screened"] = [enc(x) for x in self.screened]
        d["chosen_nll"] = self.chosen_nll
        d["method"] = "gridsearch (BMA NLL on held-out data)"
        return d


def calibrate_posterior(
    model: nn.Module,
    posterior: Any,
    batches: Iterable[Any],
    *,
    grid: Sequence[float] | None = None,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    seed: int = 0,
    shift_labels: bool | None = None,
    standard_errors: float | None = None,
    min_gain: float | None = None,
    temperature: bool = True,
    always_scan: bool = False,
    screen_factor: float | None = None,
    keep_trained: bool = True,
) -> tuple[Any, CalibrationResult]:
    """Choose the posterior's sampling ζ and softmax temperature T by BMA NLL on ``batches`` (held-out data).

    ``batches`` is re-iterable (a list or a DataLoader, read in the same order on every pass: one with
    ``shuffle=True`` is refused) of dicts with ``labels`` (HF models;
    −100 ignored; causal LMs' labels are shifted, ``shift_labels=None`` detects them) or of
    ``(inputs, labels)`` pairs (plain modules returning logits). ``grid`` holds multiples of
    the trained ζ (> 0); ζ = ∞ (the mean) is always a candidate. The same seeds are used at
    every ζ (common random numbers), so the scan compares scales, not noise draws. The scan
    runs from little noise to much and stops once the NLL exceeds twice the best so far
    (more noise only makes it worse from there; a mere rise is no reason to stop, the NLL can
    fall again further on: docs/trainer.md#calibration-scan).

    The choice starts at the mean (ζ = ∞) and walks the candidates from large ζ to small: one
    replaces the choice so far if its NLL is lower by more than ``standard_errors`` (k) standard
    errors of their difference (the error counts the targets, paired per-target differences, and
    the S draws, a jackknife, S ≥ 2, since a few lucky draws improve every target at once); k = 0
    gives the lowest NLL. The final choice is kept only if its NLL is at least ``min_gain``
    (relative) below the mean's; else the mean, or, with ``keep_trained``, the trained posterior
    (ζ × 1, at its own temperature as the scan scored it, else at the mean's, or at its own
    softening one where the mean is softened) unless the mean's NLL is lower than its by more
    than k standard errors or by more than ``min_gain`` (relative to the mean's).

    ``temperature=True``: where softening the mean (its least-NLL T of ``SOFTENING_TEMPERATURES``,
    T >= 1) beats T = 1 by more than k standard errors, every candidate, the mean included, is
    scored at its own best T (``p̄ = 1/S Σ_s softmax(logits_s / T)``) and the rules above compare
    those NLLs; otherwise, and with ``temperature=False``, all are scored at T = 1. An
    underconfident mean (best T < 1) predicts at its best T where the split holds at least
    ``MIN_ERRORS_TO_SHARPEN`` targets it gives less than even odds and a 2-fold cross-validation
    within the split gains k standard errors and ``min_gain`` over T = 1
    (:func:`mean_temperature_choice`); every scale scored, the trained one included (scanned,
    screened out or not scanned), is then scored at that T too. Either way the result records the
    mean's own best T of ``TEMPERATURE_GRID`` (``mean_temperature``; > 1: overconfident, the only
    case averaging samples helps).

    The noise scales are scored only where the mean is overconfident there (its best T > 1;
    ``always_scan=True``: always): averaging samples softens predictions, so where the mean is
    not overconfident only the trained scale is scored against it (S passes), not the S ×
    len(grid) of the scan (docs/trainer.md#calibration-scan-gate). Where they are scored, the
    scales whose first draw moves the log-likelihoods by less than ``screen_factor`` ×
    ``min_gain`` of the mean's NLL (per target, on average, at the mean's temperature), up to the
    first one that moves them more, are not candidates (``screened``;
    docs/trainer.md#calibration-screen). The moves grow along the walk, so that first scale is
    found by bisecting the grid: about log2(len(grid) + 1) passes of one draw each, the probes at
    or past it reused as those scales' first draws. Memory: the log-probabilities of every
    target are kept, 8 bytes × S × targets per scale (× 13 temperatures while a scale is scored).

    ``grid``, ``standard_errors``, ``min_gain``, ``screen_factor`` left None take ``DEFAULT_GRID``,
    ``DEFAULT_STANDARD_ERRORS`` (0.5), ``DEFAULT_MIN_GAIN`` (0.01), ``SCREEN_FACTOR`` (2.5; 0: no screen).
    Returns the calibrated posterior (``ess`` and ``temperature`` = the choice; config ``calibration``
    and ``trained_ess``) and the :class:`CalibrationResult`. The model is left at its mean.
    """
    if not isinstance(model, nn.Module) or isinstance(posterior, nn.Module):
        raise TypeError(
            "calibrate_posterior(model, posterior, batches): model must be a torch.nn.Module and posterior "
            f"the model's posterior; got {type(model).__name__} and {type(posterior).__name__}"
        )
    require_softmax_model(model, "calibrate_posterior")
    grid, seed = DEFAULT_GRID if grid is None else grid, resolve_seed(seed)
    standard_errors = DEFAULT_STANDARD_ERRORS if standard_errors is None else standard_errors
    min_gain = DEFAULT_MIN_GAIN if min_gain is None else min_gain
    screen_factor = SCREEN_FACTOR if screen_factor is None else screen_factor
    factors = [] if isinstance(grid, str) else sorted({float(f) for f in grid if not isinstance(f, bool)}, reverse=True)
    if not factors or len(factors) != len(set(grid)) or any(not (f > 0.0 and math.isfinite(f)) for f in factors):
        raise ValueError(f"calibrate_posterior: grid must hold finite multiples > 0; got {list(grid)!r}")
    num_samples = sample_count(num_samples, "calibrate_posterior: ")
    flags = (("temperature", temperature), ("always_scan", always_scan), ("keep_trained", keep_trained))
    for name, flag in flags:
        if not isinstance(flag, bool):
            raise ValueError(f"calibrate_posterior: {name} must be True or False; got {flag!r}")
    if not (_is_real(standard_errors) and standard_errors >= 0.0 and math.isfinite(standard_errors)):
        raise ValueError(
            f"calibrate_posterior: standard_errors must be a finite number >= 0; got {standard_errors!r}"
        )
    if not (_is_real(screen_factor) and screen_factor >= 0.0 and math.isfinite(screen_factor)):
        raise ValueError(
            f"calibrate_posterior: screen_factor must be a finite number >= 0; got {screen_factor!r}"
        )
    if not (_is_real(min_gain) and 0.0 <= min_gain < 1.0):
        raise ValueError(f"calibrate_posterior: min_gain must be a number in [0, 1); got {min_gain!r}")
    if not isinstance(batches, Sequence) and iter(batches) is batches:
        raise TypeError(
            "calibrate_posterior: batches must be re-iterable (a list or a DataLoader), not an iterator"
        )
    if not (hasattr(posterior, "config") and hasattr(posterior, "with_ess")):  # an EVON given for its posterior
        raise TypeError(
            f"calibrate_posterior: posterior must be an EVONPosterior; got {type(posterior).__name__} "
            "(EVONPosterior.from_optimizer(optimizer, model) makes one of a trained optimizer)"
        )
    base = trained_posterior(posterior)  # the grid multiplies each parameter's trained ζ
    trained = float(base.ess)
    if math.isinf(trained):
        raise ValueError("calibrate_posterior: the posterior has ess = inf (no noise) and nothing to calibrate")
    # before any pass: a choice may draw no sample that would check it (a duck-typed posterior,
    # benchmarks/calibration_halves.py's replay of recorded draws, has no model to check against)
    if hasattr(base, "check_model"):
        base.check_model(model)
    if shift_labels is not None and not isinstance(shift_labels, bool):  # 'no' would be True
        raise TypeError(f"calibrate_posterior: shift_labels must be True, False or None; got {shift_labels!r}")
    shift = is_causal_lm(model) if shift_labels is None else shift_labels
    was_training = model.training
    model.eval()
    one = TEMPERATURE_GRID.index(1.0)
    try:
        first_labels: list[Any] = []  # every later pass must read these: the same targets in the same order
        mean_logp = scored_pass(model, batches, shift, TEMPERATURE_GRID, check=True, first_labels=first_labels)
        if mean_logp.shape[1] == 0:
            raise ValueError("calibrate_posterior: the batches hold no labelled targets")
        mean_t_nll = -mean_logp.mean(1)
        best_t = int(mean_t_nll.argmin())
        mean_nll = float(mean_t_nll[one])
        start = mean_temperature_choice(mean_logp, standard_errors, min_gain) if temperature else one
        scanned = always_scan or best_t > one  # the mean overconfident there: noise may help
        scales = factors if scanned else []
        # a softened mean: every scale at its own softening T; else every scale (the trained one too,
        # scanned or not) at the mean's T, a sharpened one included: the rule admits it for all alike
        temperatures = SOFTENING_TEMPERATURES if start > one else (TEMPERATURE_GRID[start],)
        # per candidate: log p of each draw at its own temperature, [S, targets]
        draws, chosen_t = [mean_logp[start][None]], [TEMPERATURE_GRID[start]]
        tried, nlls = [], []
        # the stop rule reads NLLs at temperatures[0] (T = 1 where the mean is softened: a softening
        # temperature rescues any noise to ~log C), starting from the mean's NLL at that T
        best = float(mean_t_nll[TEMPERATURE_GRID.index(temperatures[0])])
        # the screen compares a scale's first draw with the mean at the mean's own temperature
        screen_t, screen_ref = temperatures.index(TEMPERATURE_GRID[start]), mean_logp[start]
        tolerance = screen_factor * min_gain * float(-screen_ref.mean())
        first: dict[int, Tensor] = {}  # a scale's first draw, [T, targets], drawn by the screen

        def moves(i: int) -> bool:
            """Does scale i's first draw move the predictions by the screen's tolerance?"""
            with base.scale_ess(scales[i]).sampled(model, seed=seed):
                first[i] = scored_pass(model, batches, shift, temperatures, first_labels=first_labels)
            return float((first[i][screen_t] - screen_ref).abs().mean()) >= tolerance

        def score(factor: float, ts: Sequence[float], first_draw: Tensor | None) -> tuple[Tensor, int, Tensor]:
            """S draws at ζ = trained × factor at every T of ``ts`` (``first_draw``: the screen's pass at
            ``seed``): (their log p at the least-NLL T, [S, targets]; that T's index; BMA NLL per T)."""
            candidate = base.scale_ess(factor)
            logps = [] if first_draw is None else [first_draw]
            for s in range(len(logps), num_samples):
                with candidate.sampled(model, seed=seed + s):
                    logps.append(scored_pass(model, batches, shift, ts, first_labels=first_labels))
            stacked = torch.stack(logps)  # [S, T, targets]
            t_nll = _bma_nll(stacked).mean(-1)
            t = int(t_nll.argmin())
            return stacked[:, t].clone(), t, t_nll

        onset = _first_true(moves, len(scales)) if tolerance > 0.0 else 0
        screened = [trained * f for f in scales[:onset]]
        for i in range(onset, len(scales)):
            logp, t, t_nll = score(scales[i], temperatures, first.get(i))
            draws.append(logp)
            chosen_t.append(temperatures[t])
            tried.append(trained * scales[i])
            nlls.append(float(t_nll[t]))
            stop_nll = float(t_nll[0])
            best = min(best, stop_nll)
            if stop_nll > 2.0 * best:
                break
        reference = float(mean_t_nll[start])  # the mean's NLL at its own temperature (T = 1 without)
        index = _stepwise_choice(draws, standard_errors)
        if index > 0 and nlls[index - 1] > (1.0 - min_gain) * reference:
            index = 0  # not a gain worth the noise: the mean
        trained_nll, keep = None, False
        if index == 0 and keep_trained:
            if trained in tried:  # scored by the scan, at its own temperature
                j = tried.index(trained) + 1
                trained_logp, trained_t, trained_nll = draws[j], chosen_t[j], nlls[j - 1]
            else:  # screened out or not scanned: at the temperatures the scan scores a scale at
                probed = first.get(scales.index(1.0)) if 1.0 in scales else None
                trained_logp, t, t_nll = score(1.0, temperatures, probed)
                trained_t, trained_nll = temperatures[t], float(t_nll[t])
            excess, error = _gain_and_error(trained_logp, draws[0])
            keep = not _beyond(excess, standard_errors, error) and excess <= min_gain * reference
    finally:
        model.train(was_training)
    result = CalibrationResult(
        ess=trained if keep else ([math.inf] + tried)[index],
        trained_ess=trained,
        grid=tried,
        nll=nlls,
        mean_nll=mean_nll,
        num_samples=num_samples,
        num_targets=int(mean_logp.shape[1]),
        seed=seed,
        standard_errors=float(standard_errors),
        min_gain=float(min_gain),
        mean_temperature=TEMPERATURE_GRID[best_t],
        temperature=trained_t if keep else chosen_t[index],
        temperatures=chosen_t[1:] if start != one else [],
        tempered_mean_nll=reference if start != one else None,
        scanned=scanned,
        screened=screened,
        screen_factor=float(screen_factor),
        keep_trained=keep_trained,
        trained_nll=trained_nll,
    )
    return result.apply(posterior), result


def trained_posterior(posterior: Any) -> Any:
    """``posterior`` at the noise scale EVON trained: a calibrated (or ``with_ess``/``scale_ess``) posterior's
    ζ put back from what :meth:`CalibrationResult.apply` (or ``with_ess``) records (``trained_ess``;
    ``trained_ess_by_parameter`` for the parameters of groups trained at another ζ); one without a record as it is."""
    trained = posterior.config.get("trained_ess")
    if trained is None:
        return posterior
    by_name = posterior.config.get("trained_ess_by_parameter")
    if not by_name:
        return posterior.with_ess(float(trained))
    restored = posterior.with_ess({n: float(by_name.get(n, trained)) for n in posterior.names})
    restored.config["ess"] = float(trained)  # the top level's trained ζ (with_ess's is the first name's)
    return restored


def mean_temperature(
    logits: Tensor,
    labels: Tensor,
    shift: bool = False,
    standard_errors: float = DEFAULT_STANDARD_ERRORS,
    min_gain: float = DEFAULT_MIN_GAIN,
) -> float:
    """The temperature the calibration gives a point estimate's ``logits`` on held-out ``labels``
    (:func:`mean_temperature_choice` on ``TEMPERATURE_GRID``): temperature scaling under the rules
    ``calibrate_posterior`` applies to EVON's mean (-100 labels ignored; ``shift``: a causal LM's)."""
    per_temperature = tempered_log_probs(logits, labels, shift, TEMPERATURE_GRID)
    return TEMPERATURE_GRID[mean_temperature_choice(per_temperature, standard_errors, min_gain)]


def mean_temperature_choice(mean_logp: Tensor, standard_errors: float, min_gain: float) -> int:
    """``TEMPERATURE_GRID`` index of the temperature the mean predicts with, from its log p(label)
    at every temperature (``[T, targets]``): the least-NLL T >= 1 where it beats T = 1 by more
    than ``standard_errors`` standard errors (an overconfident mean), else :func:`_sharpening`'s."""
    one = TEMPERATURE_GRID.index(1.0)
    soft = one + int(mean_logp[one:].mean(1).argmax())
    if soft != one:
        excess, error = _gain_and_error(mean_logp[soft][None], mean_logp[one][None])
        if _beyond(-excess, standard_errors, error):
            return soft
    return _sharpening(mean_logp, one, standard_errors, min_gain)


def _sharpening(mean_logp: Tensor, one: int, standard_errors: float, min_gain: float) -> int:
    """``TEMPERATURE_GRID`` index of the temperature below 1 an underconfident mean predicts with,
    or ``one`` (T = 1). The whole split's best T is kept only if the split holds at least
    ``MIN_ERRORS_TO_SHARPEN`` targets the mean gives less than even odds, and a 2-fold cross-
    validation within it (T chosen on every other target in order of their log p(label) at T = 1,
    scored on the rest, both ways: folds that do not depend on the order the split is read in)
    beats T = 1 by more than ``standard_errors`` standard errors (paired per target) and ``min_gain``."""
    nll = -mean_logp.mean(1)
    best = int(nll.argmin())
    if best >= one or int((mean_logp[one] < math.log(0.5)).sum()) < MIN_ERRORS_TO_SHARPEN:
        return one
    n = mean_logp.shape[1]
    # the folds: every other target in order of log p(label) at T = 1 (ties: at the other Ts), not
    # in reading order, which the trainer changes (a Dataset sorted by length, a stream as it comes)
    order = torch.arange(n, device=mean_logp.device)
    for row in [*range(mean_logp.shape[0] - 1, -1, -1), one]:  # stable sorts: the last is the first key
        order = order[torch.sort(mean_logp[row, order], stable=True).indices]
    parity = torch.empty_like(order)
    parity[order] = torch.arange(n, device=mean_logp.device) % 2
    halves = (parity == 0, parity == 1)
    held_out = torch.empty(n, dtype=mean_logp.dtype, device=mean_logp.device)
    for fit, score in (halves, halves[::-1]):
        held_out[score] = mean_logp[int(mean_logp[:, fit].mean(1).argmax()), score]
    excess, error = _gain_and_error(held_out[None], mean_logp[one][None])  # NLL above T = 1's
    if _beyond(-excess, standard_errors, error) and -excess >= min_gain * float(nll[one]):
        return best
    return one


def _first_true(predicate: Callable[[int], bool], n: int) -> int:
    """The least i in [0, n) with ``predicate(i)`` (n if none), for a predicate that is false up to
    some index and true from it on: a bisection, about log2(n + 1) calls instead of up to n."""
    low, high = 0, n
    while low < high:
        middle = (low + high) // 2
        if predicate(middle):
            high = middle
        else:
            low = middle + 1
    return low


def _bma_nll(logps: Tensor) -> Tensor:
    """Per-target NLL of the average of the draws' probabilities (``logps``: [S, targets]).

    :func:`~hf_evon.predictive.logprobs.log_mean_prob`: S equal draws give exactly their own NLL,
    so a scale whose draws predict as the mean ties with it exactly and the rules keep the first of
    tied candidates."""
    return -log_mean_prob(logps, 0)


def _gain_and_error(draws: Tensor, best: Tensor) -> tuple[float, float]:
    """Mean NLL of ``draws`` above ``best``'s and its standard error, from both sources of
    error: the targets (paired differences) and the draws, which every target shares, so a
    lucky set of S draws looks like a gain on every target (jackknife over the draw index,
    common to both: the same seeds). A candidate without draws (the mean) adds no draw error.
    One target has no spread to measure: its error is infinite, so no rule with k > 0 takes a
    gain from it (:func:`_beyond`)."""
    diff = _bma_nll(draws) - _bma_nll(best)
    n = diff.numel()
    if n < 2:
        return float(diff.mean()), math.inf
    var = float(diff.var()) / n
    s = max(draws.shape[0], best.shape[0])
    if s > 1:
        drop = lambda x, k: x if x.shape[0] == 1 else torch.cat([x[:k], x[k + 1 :]])  # noqa: E731
        loo = torch.stack([(_bma_nll(drop(draws, k)) - _bma_nll(drop(best, k))).mean() for k in range(s)])
        var += float((loo - loo.mean()).square().sum()) * (s - 1) / s
    return float(diff.mean()), math.sqrt(var)


def _beyond(gain: float, standard_errors: float, error: float) -> bool:
    """Whether ``gain`` exceeds ``standard_errors`` standard errors ``error`` (k = 0: any gain > 0,
    also where the error is infinite)."""
    return gain > (standard_errors * error if standard_errors else 0.0)


def _stepwise_choice(draws: list[Tensor], standard_errors: float) -> int:
    """Index of the choice when walking from the least noise (the mean) to the most: a noisier
    candidate replaces the current choice only if its BMA NLL is lower by more than
    ``standard_errors`` standard errors of their difference (k = 0: the first lowest NLL)."""
    choice = 0
    for i in range(1, len(draws)):
        excess, error = _gain_and_error(draws[i], draws[choice])
        if _beyond(-excess, standard_errors, error):
            choice = i
    return choice
