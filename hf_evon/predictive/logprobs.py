"""Log-probabilities of labels and their Bayesian model average: the one implementation of each.

Labels follow transformers' convention: ``-100`` marks a position that is not scored, and a
causal LM's labels are the input ids, so the logits at position ``t`` predict the label at
``t + 1`` (``shift=True``; :func:`hf_evon.modeling.is_causal_lm` says which models need it).
BMA averages *probabilities* over S posterior samples: ``log p̄ = log(1/S Σ_s exp(log p_s))``,
relative to their max (:func:`log_mean_prob`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hf_evon.modeling import problem_type

Tensor = torch.Tensor

__all__ = [
    "IGNORE_INDEX",
    "LogMeanExp",
    "PerOutput",
    "ValueMean",
    "count_label_items",
    "float64_log_softmax",
    "label_log_probs",
    "labelled_row_index",
    "labelled_rows",
    "log_mean_prob",
    "normalization_tolerance",
    "require_class_labels",
    "require_softmax_model",
    "shifted",
    "target_log_probs",
    "tempered",
    "require_scorable_labels",
    "unscorable_labels",
    "widened",
]

IGNORE_INDEX = -100  # transformers' label of a position that is not scored


def normalization_tolerance(dtype: torch.dtype) -> float:
    """How far a row of ``dtype``'s probabilities may sum from 1 (its log-probabilities' logsumexp
    from 0) and still be a distribution: half precision's softmax rows are off by up to ~4e-3."""
    return 1e-3 if torch.finfo(dtype).bits >= 32 else 5e-2


def require_class_labels(labels: Any, where: str) -> None:
    """Raise, naming ``where``, unless ``labels`` are class indices (an integer tensor): the log-
    probabilities here are of a softmax over classes or tokens, which a regression's or a multi-
    label model's floating-point targets do not index."""
    if not isinstance(labels, Tensor):  # an array or a list would reach the alignment check as "shaped ()"
        raise TypeError(
            f"{where} has labels of type {type(labels).__name__}: give class indices as a torch integer "
            "tensor (torch.as_tensor converts an array or a list)"
        )
    if labels.is_floating_point() or labels.is_complex():
        raise ValueError(
            f"{where} has floating-point labels ({labels.dtype}): a regression or multi-label target. "
            "Calibration and BMA log-likelihoods score class labels (integer indices, -100 not scored) "
            "under the model's softmax; a model without a class distribution has none to average"
        )


# transformers' problem types whose logits are no softmax's: each label's sigmoid, or the values themselves
NOT_SOFTMAX_PROBLEMS = ("multi_label_classification", "regression")


def require_softmax_model(model: Any, where: str) -> None:
    """Raise, naming ``where`` and the problem type, where ``model.config.problem_type`` (transformers',
    PEFT forwards it) says its logits are a multi-label classifier's (a sigmoid per label) or a
    regression's (values): a softmax over them, and a temperature chosen for it, mean nothing, whatever
    labels come with them."""
    problem = problem_type(model)
    if problem in NOT_SOFTMAX_PROBLEMS:
        raise ValueError(
            f"{where}: the model's problem_type {problem!r} has no class distribution (its logits are "
            f"{'per-label sigmoids' if problem == 'multi_label_classification' else 'values'}, not a softmax's): "
            "calibration and BMA log-likelihoods score class labels under the model's softmax"
        )

def unscorable_labels(labels: Tensor, classes: int) -> Tensor:
    """Where ``labels`` hold neither -100 nor one of ``classes`` (-1 for "no label", say)."""
    return labels.ne(IGNORE_INDEX) & (labels.lt(0) | labels.ge(classes))


def require_scorable_labels(labels: Tensor, classes: int, where: str) -> None:
    """Raise, naming ``where`` ("... batch 3 has") and the first such label, where ``labels`` hold
    one that is neither -100 nor one of ``classes`` (before a gather: on a GPU an index past the
    logits is a device-side assert). One host read."""
    bad = labels[unscorable_labels(labels, classes)]
    if bad.numel():
        raise ValueError(
            f"{where} label {int(bad[0])}, outside the model's {classes} classes (0 to {classes - 1}; "
            f"{IGNORE_INDEX} marks a target that is not scored)"
        )


def shifted(logits: Tensor, labels: Tensor, shift: bool) -> tuple[Tensor, Tensor]:
    """``(logits, labels)`` aligned so that ``logits[..., t, :]`` scores ``labels[..., t]``.

    ``shift`` (a causal LM): position t predicts label t+1; where the logits are longer than the
    labels (PEFT's prompt tuning prepends V virtual tokens), the last virtual token predicts the
    first label, as in its loss, and every label is scored."""
    if shift:
        virtual = logits.shape[1] - labels.shape[1]
        if virtual > 0:
            return logits[:, virtual - 1 : virtual - 1 + labels.shape[1]], labels
        return logits[:, :-1], labels[:, 1:]
    return logits, labels


def count_label_items(labels: Tensor | None, shift: bool) -> Tensor | None:
    """The items a mean loss averages over: labels other than -100 (causal LMs: from position 1)."""
    if not isinstance(labels, Tensor):
        return None
    if shift:
        labels = labels[..., 1:]
    return labels.ne(IGNORE_INDEX).sum()


def label_log_probs(log_probs: Tensor, labels: Tensor) -> Tensor:
    """``log p(label)`` at every position of full log-probabilities ``log_probs`` (``labels.shape +
    (C,)``), shaped like ``labels``; 0 where the label is -100."""
    keep = labels.ne(IGNORE_INDEX)
    picked = log_probs.gather(-1, labels.masked_fill(~keep, 0).unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(~keep, 0.0)


def labelled_row_index(logits: Tensor, labels: Tensor, shift: bool) -> tuple[Tensor, Tensor]:
    """(row indices into ``logits.reshape(-1, classes)``, labels) of the scored targets only: shifted
    if ``shift``, -100 dropped. An index, not the rows: an LM's scored rows are most of its logits,
    which a reader taking them chunk by chunk then never copies whole."""
    rows = torch.arange(logits.shape[:-1].numel(), device=logits.device).reshape(logits.shape[:-1])
    rows, labels = shifted(rows[..., None], labels, shift)
    target = labels.reshape(-1)
    keep = target.ne(IGNORE_INDEX)
    return rows.reshape(-1)[keep], target[keep].long()


def labelled_rows(logits: Tensor, labels: Tensor, shift: bool) -> tuple[Tensor, Tensor]:
    """(logit rows, labels) of the scored targets only, flattened: shifted if ``shift``, -100 dropped."""
    index, target = labelled_row_index(logits, labels, shift)
    return logits.reshape(-1, logits.shape[-1]).index_select(0, index), target


def target_log_probs(logits: Tensor, labels: Tensor, shift: bool) -> Tensor:
    """log p(label) for every scored target (−100 ignored), flattened, in float64."""
    rows, target = labelled_rows(logits, labels, shift)
    return torch.log_softmax(rows.double(), dim=-1).gather(1, target[:, None]).squeeze(1)


def _shift(peak: Tensor) -> Tensor:
    """The shift the exps are taken relative to: the peak where finite, else 0 (all −inf: exp(−inf)
    = 0 and the result −inf, not NaN; +inf or NaN: carried into the sum)."""
    return torch.where(torch.isfinite(peak), peak, torch.zeros((), dtype=peak.dtype, device=peak.device))


def log_mean_prob(log_probs: Tensor, dim: int = 0) -> Tensor:
    """BMA: ``log(mean_s exp(log_probs_s))`` over ``dim`` (averages probabilities), as ``shift +
    log(mean exp(x − shift))`` with the values' max as the shift: S equal values give exactly their
    value (S ones sum to S, whose mean is 1, whose log is 0), where ``logsumexp − log S`` is off in the
    last bits, so samples that agree have exactly the mean's log-probabilities (and 0 epistemic
    uncertainty) and a calibration scale whose draws equal the mean ties with it."""
    shift = _shift(log_probs.amax(dim, keepdim=True))
    return shift.squeeze(dim) + ((log_probs - shift).exp().sum(dim) / log_probs.shape[dim]).log()


def float64_log_softmax(logits: Tensor) -> Tensor:
    """Log-probabilities in float64: the metrics sum them over whole evaluation sets."""
    return torch.log_softmax(logits.double(), dim=-1)


def widened(logits: Tensor) -> Tensor:
    """``logits`` in float32 at least: half precision's are widened, a float64 model's keep float64."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def tempered(logits: Tensor, posterior: object) -> Tensor:
    """``logits / T`` for the posterior's BMA temperature ``T`` (``posterior.temperature``, 1 when it
    has none; then ``logits`` itself): the calibrated predictive is ``1/S Σ_s softmax(logits_s / T)``.
    Divided in float32 at least: bfloat16 logits / T would round each to 3 significant digits."""
    temperature = float(getattr(posterior, "temperature", 1.0))
    if temperature == 1.0:
        return logits
    return widened(logits) / temperature


class LogMeanExp:
    """:func:`log_mean_prob` over draws that arrive one at a time (one pass per posterior sample): a
    running log-sum-exp, in place (an LM's averages are the size of its full-vocabulary logits). While
    every draw equals the first (a posterior without noise: the mean S times) no sum is formed and
    ``value()`` is that draw exactly, where a running sum is off in the last bits; the comparison runs
    until the first draw that differs (one device read each)."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.count = 0
        self._equal = True  # every draw so far is the first

    def add(self, log_probs: Tensor) -> None:
        if self.total is None:  # a copy: the caller may write its next draw into the same tensor
            self.total = log_probs.clone()
        elif not (self._equal and torch.equal(log_probs, self.total)):
            if self._equal:  # total holds the first draw, count times over: its log-sum-exp
                self._equal = False
                self.total.add_(math.log(self.count))
            torch.logaddexp(self.total, log_probs, out=self.total)
        self.count += 1

    def value(self) -> Tensor:
        if self.total is None:
            raise ValueError("LogMeanExp: no draws added")
        return self.total.clone() if self._equal else self.total - math.log(self.count)


class PerOutput:
    """One accumulator per distribution of a model that has several (extractive QA's start and end)."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def add(self, values: tuple[Tensor, ...]) -> None:
        for part, value in zip(self.parts, values, strict=True):
            part.add(value)

    def value(self) -> tuple[Tensor, ...]:
        return tuple(part.value() for part in self.parts)


class ValueMean:
    """The arithmetic mean of draws that arrive one at a time (what BMA averages where the model's
    outputs are values or independent probabilities, not a softmax's logits)."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.count = 0

    def add(self, values: Tensor) -> None:
        self.total = values.clone() if self.total is None else self.total.add_(values)
        self.count += 1

    def value(self) -> Tensor:
        if self.total is None:
            raise ValueError("ValueMean: no draws added")
        return self.total / self.count


def sample_target_log_probs(logits: Tensor, targets: Tensor, scored: slice, labels: Tensor, posterior: object) -> Tensor:
    """``bma_log_likelihood``'s ``log p(target)`` under one sample's ``(B, T, V)`` logits at positions
    ``scored`` (tempered, in float32 at least: a float64 model's in float64; 0 where the target is -100).
    ValueError, naming the shapes, for logits holding no distribution per position of ``labels`` (a
    sequence classifier's ``(B, C)``), and naming the label, for a target outside the vocabulary."""
    if logits.dim() != 3 or logits[:, scored].shape[1] != targets.shape[1]:
        raise ValueError(
            f"bma_log_likelihood: the model's logits {tuple(logits.shape)} hold no distribution per position "
            f"of labels {tuple(labels.shape)}: it scores the tokens of a language model (or a token classifier)"
        )
    require_scorable_labels(targets, logits.shape[-1], "bma_log_likelihood: labels have")
    return label_log_probs(torch.log_softmax(tempered(widened(logits[:, scored]), posterior), dim=-1), targets)
