"""What the posterior's samples say about each prediction: the entropy of the BMA predictive,
split into the entropy each sample's prediction already has and the samples' disagreement.

For S posterior samples with predictive distributions ``p_s`` and their average ``p̄``:

* ``total = H[p̄]``, the entropy of the BMA predictive;
* ``aleatoric = (1/S) Σ_s H[p_s]``, the uncertainty every sample shares (noisy or ambiguous labels);
* ``epistemic = total − aleatoric``, the mutual information between the label and the weights
  (BALD; Houlsby et al. 2011): zero where every sample predicts alike, large where the data left
  the weights free to disagree, as on inputs unlike the training data.

A temperature on one model rescales the first two alike and never creates the third, which only
weights that vary can give (docs/results.md#epistemic-uncertainty). The arithmetic runs in
float64; ``epistemic`` is clamped at 0, its exact lower bound (Jensen's inequality), against
rounding.

A regression's outputs are values, not distributions: :class:`PredictiveSpread` is the samples'
mean and standard deviation, the epistemic spread (the weights' share of the predictive variance).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hf_evon.optim.checks import is_int
from hf_evon.predictive.logprobs import LogMeanExp, ValueMean, log_mean_prob, normalization_tolerance

Tensor = torch.Tensor

__all__ = [
    "PredictiveSpread",
    "PredictiveUncertainty",
    "SpreadAccumulator",
    "UncertaintyAccumulator",
    "entropy",
    "predictive_uncertainty",
]


class PredictiveUncertainty(NamedTuple):
    """Per-input entropies in nats, each shaped like the inputs' batch dimensions."""

    total: Tensor
    aleatoric: Tensor
    epistemic: Tensor


def entropy(log_probs: Tensor) -> Tensor:
    """``H[p] = −Σ_c p_c log p_c`` over the last dimension of log-probabilities, in float64
    (a class of probability 0, ``log p = −inf``, adds 0)."""
    log_probs = log_probs.double()
    p = log_probs.exp()
    return -torch.where(p > 0, p * log_probs, torch.zeros((), dtype=p.dtype, device=p.device)).sum(-1)


def _check(log_probs: Tensor, name: str) -> None:
    if not isinstance(log_probs, Tensor) or not log_probs.is_floating_point():
        got = getattr(log_probs, "dtype", type(log_probs).__name__)
        raise TypeError(f"{name} must be a floating-point tensor of log-probabilities; got {got}")
    if log_probs.ndim < 1 or log_probs.shape[-1] < 1:
        raise ValueError(f"{name} needs a last dimension of classes; got shape {tuple(log_probs.shape)}")
    if log_probs.shape[-1] == 1:  # the log_softmax of one logit is 0: every entropy would read 0
        raise ValueError(
            f"{name} has one class (shape {tuple(log_probs.shape)}): its only log-probability is 0 whatever "
            "the input, and so is every entropy. A binary classifier's single logit z (a sigmoid) is two "
            "classes: stack the log_softmax of the logits [0, z] (log(1 - sigmoid(z)), log sigmoid(z))"
        )


def _mass_off(log_probs: Tensor) -> Tensor:
    """The rows' largest ``|logsumexp|`` (a device number; NaN where a row is): above the dtype's
    rounding (:func:`~hf_evon.predictive.logprobs.normalization_tolerance`) these are not
    log-probabilities: logits or probabilities in their place would give negative "entropies", and
    a NaN row counts (NaN is not below any tolerance)."""
    if not log_probs.numel():
        return torch.zeros((), device=log_probs.device)
    return log_probs.logsumexp(-1).abs().max().float()


def _require_log_probs(off: Tensor, tolerance: float, name: str) -> None:
    value = off.item()
    if not value <= tolerance:  # NaN fails too
        raise ValueError(
            f"{name} must hold log-probabilities, each row's logsumexp 0 (log_softmax of the logits); "
            f"its rows are off by up to {value:.3g}"
        )


def _mean_entropy(first: Tensor, deviation_sum: Tensor, count: int) -> Tensor:
    """The samples' mean entropy as the first's plus their mean deviation from it: samples that
    agree give exactly the entropy of each (where a sum over S divided by S is off in the last bit)
    and, with :func:`~hf_evon.predictive.logprobs.log_mean_prob` exact there too, exactly 0 epistemic."""
    return first + deviation_sum / count


def predictive_uncertainty(sample_log_probs: Tensor, dim: int = 0) -> PredictiveUncertainty:
    """The decomposition for log-probabilities of S samples stacked along ``dim`` (classes last),
    e.g. ``torch.stack([model(x).log_softmax(-1) for each posterior sample])`` shaped (S, N, C)."""
    _check(sample_log_probs, "sample_log_probs")
    tolerance = normalization_tolerance(sample_log_probs.dtype)
    _require_log_probs(_mass_off(sample_log_probs), tolerance, "sample_log_probs")
    if sample_log_probs.ndim < 2:
        shape = tuple(sample_log_probs.shape)
        raise ValueError(f"sample_log_probs needs a samples and a classes dimension; got shape {shape}")
    if not is_int(dim) or not -sample_log_probs.ndim <= dim < sample_log_probs.ndim:
        raise ValueError(f"dim must be an axis of sample_log_probs (shape {tuple(sample_log_probs.shape)}); got {dim!r}")
    if sample_log_probs.shape[dim] == 0:  # their average would be log(0 / 0)
        shape = tuple(sample_log_probs.shape)
        raise ValueError(f"sample_log_probs has no samples along dim {dim} (shape {shape})")
    dim = int(dim) % sample_log_probs.ndim  # entropy() drops the classes axis: a negative dim would move
    if dim == sample_log_probs.ndim - 1:
        raise ValueError("dim must not be the last dimension: the classes are there")
    logp = sample_log_probs.double()
    total = entropy(log_mean_prob(logp, dim=dim))
    h = entropy(logp)
    first = h.select(dim, 0)
    aleatoric = _mean_entropy(first, (h - first.unsqueeze(dim)).sum(dim=dim), h.shape[dim])
    return PredictiveUncertainty(total, aleatoric, (total - aleatoric).clamp_(min=0.0))


class UncertaintyAccumulator:
    """:func:`predictive_uncertainty` over samples that arrive one pass at a time, without keeping
    them: ``add`` each sample's log-probabilities (same shape every time), then ``value()`` is
    ``log p̄`` (as :class:`~hf_evon.predictive.logprobs.LogMeanExp`) and ``uncertainty()`` the
    decomposition. That the samples are log-probabilities is checked when a result is read (one
    read for all of them, not one per sample). ``value()`` is computed once per sample count (an
    LM's is the size of its logits), and ``uncertainty()`` reads it: the same tensor until the next
    ``add``."""

    def __init__(self) -> None:
        self._average = LogMeanExp()
        self._value: Tensor | None = None  # value() of the samples added so far
        self._first_entropy: Tensor | None = None  # the first sample's, and the others' deviations from it
        self._deviation_sum: Tensor | None = None
        self._off: Tensor | None = None  # the samples' largest _mass_off, on their device
        self._tolerance = 0.0

    @property
    def count(self) -> int:
        return self._average.count

    def add(self, log_probs: Tensor) -> None:
        _check(log_probs, "log_probs")
        earlier = self._average.total
        if earlier is not None and log_probs.shape != earlier.shape:
            raise ValueError(
                f"log_probs has shape {tuple(log_probs.shape)}, the earlier samples {tuple(earlier.shape)}"
            )
        off = _mass_off(log_probs)
        self._off = off if self._off is None else torch.maximum(self._off, off)  # NaN stays NaN
        self._tolerance = max(self._tolerance, normalization_tolerance(log_probs.dtype))
        logp = log_probs.double()
        h = entropy(logp)
        if self._first_entropy is None:
            self._first_entropy, self._deviation_sum = h, torch.zeros_like(h)
        else:
            self._deviation_sum.add_(h - self._first_entropy)
        self._average.add(logp)
        self._value = None

    def value(self) -> Tensor:
        if self._value is None:
            if self._off is not None:
                _require_log_probs(self._off, self._tolerance, "log_probs")
            self._value = self._average.value()
        return self._value

    def uncertainty(self) -> PredictiveUncertainty:
        if self._first_entropy is None:
            raise ValueError("UncertaintyAccumulator: no samples added")
        total = entropy(self.value())
        aleatoric = _mean_entropy(self._first_entropy, self._deviation_sum, self.count)
        return PredictiveUncertainty(total, aleatoric, (total - aleatoric).clamp_(min=0.0))


class PredictiveSpread(NamedTuple):
    """A regression's outputs under S posterior samples ``y_s``, each field shaped like the outputs:
    ``mean = 1/S Σ_s y_s`` (BMA's prediction) and ``std = sqrt(1/S Σ_s (y_s − mean)²)``, the samples'
    standard deviation (over S, not S − 1: one sample spreads by 0). ``std`` is the epistemic spread,
    the weights' share of the predictive variance; the labels' noise around each sample's output
    (aleatoric) is the likelihood's, which a model trained on squared error does not output."""

    mean: Tensor
    std: Tensor


class SpreadAccumulator:
    """:class:`PredictiveSpread` of values that arrive one sample at a time: ``add`` each sample's
    (same shape every time), then ``value()`` is the mean, :class:`~hf_evon.predictive.logprobs.ValueMean`'s
    (the same sum in the same order as BMA's average of values, so equal to it) and ``spread()`` the
    mean and standard deviation. The squared deviations accumulate in float64 by Welford's update:
    no cancellation between ``Σ y²`` and ``S·mean²``, and samples that agree spread by exactly 0."""

    def __init__(self) -> None:
        self._average = ValueMean()
        self._running: Tensor | None = None  # Welford's running mean, which the squared deviations need
        self._squares: Tensor | None = None

    @property
    def count(self) -> int:
        return self._average.count

    def add(self, values: Tensor) -> None:
        if not isinstance(values, Tensor) or not values.is_floating_point():
            got = getattr(values, "dtype", type(values).__name__)
            raise TypeError(f"values must be a floating-point tensor of a sample's outputs; got {got}")
        if self._running is not None and values.shape != self._running.shape:
            raise ValueError(f"values has shape {tuple(values.shape)}, the earlier samples {tuple(self._running.shape)}")
        values = values.double()
        self._average.add(values)
        if self._running is None:
            self._running, self._squares = values.clone(), torch.zeros_like(values)
        else:
            delta = values - self._running
            self._running.add_(delta / self.count)
            self._squares.add_(delta * (values - self._running))

    def value(self) -> Tensor:
        return self._average.value()

    def spread(self) -> PredictiveSpread:
        if self._squares is None:
            raise ValueError("SpreadAccumulator: no samples added")
        return PredictiveSpread(self.value(), (self._squares / self.count).sqrt())
