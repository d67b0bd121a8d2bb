"""Calibration metrics for (BMA) evaluation: accuracy, NLL, ECE and the Brier score.

One implementation, used by ``EVONTrainer.evaluate`` and by the ``evaluate`` modules shipped
in ``hf_evon/predictive/metrics_modules`` (load them offline with :func:`load_metric`, e.g.
``load_metric("ece")``, and combine them with other metrics in your ``compute_metrics``).

Every function takes ``predictions`` of shape ``(N, C)``, ``C >= 2`` (a binary classifier's single
logit ``z`` as the logits ``[0, z]``), and integer ``references`` of shape ``(N,)``. ``input_type`` says what the predictions are:

* ``"probs"`` (default): class probabilities, rows summing to one (within 1e-3; 5e-2 for float16
  and bfloat16 inputs, whose softmax rows are off by up to ~4e-3);
* ``"logits"``: unnormalised scores, turned into probabilities with a softmax;
* ``"log_probs"``: log-probabilities (e.g. a BMA predictive, ``logsumexp_s log p_s − log S``), each
  row's logsumexp 0 within the same tolerance.

Items whose reference equals ``ignore_index`` (default ``-100``, the transformers convention)
are left out, so flattened token-classification outputs can be passed directly. Inputs may
be numpy arrays, torch tensors or nested lists; the computation runs in float64 and every
function returns a Python ``float``.

Definitions (N items, C classes, ``p_i`` the predicted distribution of item ``i``, ``y_i`` its label):

* accuracy ``= (1/N) Σ_i [argmax_c p_ic = y_i]``;
* negative log-likelihood ``= −(1/N) Σ_i log p_{i, y_i}`` (natural log);
* Brier score ``= (1/N) Σ_i Σ_c (p_ic − [c = y_i])²``, the multi-class Brier score in ``[0, 2]``;
* expected calibration error (Guo et al., 2017) with ``n_bins`` equal-width confidence bins
  ``B_b = {i : (b−1)/n_bins < max_c p_ic ≤ b/n_bins}``:
  ``ECE = Σ_b (|B_b|/N) · |acc(B_b) − conf(B_b)|``, where ``acc`` is the fraction of correct
  argmax predictions and ``conf`` the mean top probability in the bin.
"""

from __future__ import annotations

import math
import os
from enum import Enum
from typing import Any

import torch

from hf_evon.optim.checks import is_int
from hf_evon.predictive.logprobs import normalization_tolerance

Tensor = torch.Tensor

__all__ = [
    "CALIBRATION_METRIC_KEYS",
    "INPUT_TYPES",
    "InputType",
    "METRIC_MODULES",
    "accuracy",
    "brier_score",
    "calibration_metrics",
    "expected_calibration_error",
    "item_statistics",
    "load_metric",
    "metric_module_path",
    "metrics_of_statistics",
    "negative_log_likelihood",
]

class InputType(str, Enum):
    """What the metrics' ``predictions`` hold (a plain string works too): probabilities, logits (a
    softmax is taken) or log-probabilities."""

    PROBS = "probs"
    LOGITS = "logits"
    LOG_PROBS = "log_probs"


INPUT_TYPES = tuple(m.value for m in InputType)
CALIBRATION_METRIC_KEYS = ("nll", "accuracy", "ece", "brier")  # what calibration_metrics returns

# module folder name -> accepted aliases for load_metric
METRIC_MODULES: dict[str, tuple[str, ...]] = {
    "expected_calibration_error": ("ece", "expected_calibration_error"),
    "brier_score": ("brier", "brier_score"),
    "negative_log_likelihood": ("nll", "negative_log_likelihood"),
}


def _as_tensor(x: Any, dtype: torch.dtype) -> Tensor:
    if isinstance(x, Tensor):
        return x.detach().to("cpu", dtype)
    return torch.as_tensor(x, dtype=dtype)


def _given_dtype(x: Any) -> torch.dtype:
    """The dtype ``x`` comes in (a numpy array's or a list's as torch reads it); integers are exact."""
    dtype = x.dtype if isinstance(x, Tensor) else torch.as_tensor(x).dtype
    return dtype if dtype.is_floating_point else torch.float64


def _log_probs(
    predictions: Any, references: Any, input_type: InputType | str, ignore_index: int | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Validated ``(log p (N, C) float64, labels (N,) int64, p)`` with ignored items removed; ``p`` the
    given probabilities, or the logits' softmax, else (``input_type="log_probs"``) None."""
    if input_type not in INPUT_TYPES:  # an InputType is its string
        raise ValueError(f"input_type must be one of {INPUT_TYPES}; got {input_type!r}")
    input_type = InputType(input_type)
    preds = _as_tensor(predictions, torch.float64)
    labels = _as_tensor(references, torch.float64)
    if preds.numel() == 0 and labels.numel() == 0:  # [] and [] as the empty (0, C) input is named
        raise ValueError("no items to evaluate (empty input, or every reference is ignore_index)")
    if preds.ndim != 2:
        raise ValueError(f"predictions must have shape (N, C); got {tuple(preds.shape)}")
    if preds.shape[1] < 2:  # a softmax over one column is 1 whatever the input: every metric "perfect"
        columns = preds.shape[1]
        raise ValueError(
            f"predictions have {columns} column{'' if columns == 1 else 's'} (shape {tuple(preds.shape)}): "
            "the metrics score a distribution over at least two classes. A binary classifier's single "
            "logit z (a sigmoid) is scored as two columns: logits [0, z], whose softmax is [1 - sigmoid(z), "
            "sigmoid(z)], or probabilities [1 - p, p]; a regression's values have no class metrics"
        )
    if labels.ndim != 1 or labels.shape[0] != preds.shape[0]:
        raise ValueError(
            f"references must have shape (N,) matching predictions {tuple(preds.shape)}; got {tuple(labels.shape)}"
        )
    if not bool(torch.all(labels == labels.round())):
        raise ValueError("references must be integer class indices")
    if ignore_index is not None and not is_int(ignore_index):
        raise TypeError(f"ignore_index must be an integer or None; got {ignore_index!r}")
    labels = labels.long()
    if ignore_index is not None:
        keep = labels != ignore_index
        preds, labels = preds[keep], labels[keep]
    if preds.shape[0] == 0:
        raise ValueError("no items to evaluate (empty input, or every reference is ignore_index)")
    num_classes = preds.shape[1]
    if bool(((labels < 0) | (labels >= num_classes)).any()):
        raise ValueError(f"references must be in [0, {num_classes}); got values outside")
    if input_type is InputType.LOGITS:
        return torch.log_softmax(preds, dim=-1), labels, torch.softmax(preds, dim=-1)
    if input_type is InputType.LOG_PROBS:
        if bool((preds > 1e-6).any()):
            raise ValueError("log_probs must be <= 0")
        # logits that happen to be negative are no log-probabilities; a NaN row passes (its metrics are NaN)
        off = float(preds.logsumexp(-1).abs().nan_to_num(0.0).max())
        if off > normalization_tolerance(_given_dtype(predictions)):
            raise ValueError(
                f"log_probs must be log-probabilities, each row's logsumexp 0; its rows are off by up to {off:.3g} "
                "(pass input_type='logits' for unnormalised scores)"
            )
        return preds, labels, None
    # the rows' rounding is the given dtype's, not float64's: a bfloat16 softmax sums to 1 within ~4e-3
    atol = normalization_tolerance(_given_dtype(predictions))
    if bool((preds < 0).any()) or not torch.allclose(preds.sum(-1), torch.ones(()).double(), atol=atol):
        raise ValueError(
            "probs must be non-negative with rows summing to 1 (pass input_type='logits' or 'log_probs' otherwise)"
        )
    return preds.log(), labels, preds


def _statistics(predictions: Any, references: Any, input_type: InputType | str, ignore_index: int | None) -> Tensor:
    """:func:`item_statistics` of the validated input (:func:`_log_probs`)."""
    return item_statistics(*_log_probs(predictions, references, input_type, ignore_index))


def accuracy(
    predictions: Any, references: Any, input_type: InputType | str = "probs", ignore_index: int | None = -100
) -> float:
    """Fraction of items whose most probable class is the reference; NaN where a logit or
    log-probability is NaN (as the other metrics are: a diverged model's row has no most probable
    class, not class 0). Probabilities with a NaN are refused: their rows do not sum to 1."""
    return metrics_of_statistics(_statistics(predictions, references, input_type, ignore_index))["accuracy"]


def negative_log_likelihood(
    predictions: Any, references: Any, input_type: InputType | str = "probs", ignore_index: int | None = -100
) -> float:
    """Mean ``−log p(reference)`` (natural log); ``inf`` if a reference has probability 0."""
    return metrics_of_statistics(_statistics(predictions, references, input_type, ignore_index))["nll"]


def brier_score(
    predictions: Any, references: Any, input_type: InputType | str = "probs", ignore_index: int | None = -100
) -> float:
    """Mean over items of ``Σ_c (p_c − onehot_c)²`` (multi-class Brier score, in [0, 2])."""
    return metrics_of_statistics(_statistics(predictions, references, input_type, ignore_index))["brier"]


def expected_calibration_error(
    predictions: Any,
    references: Any,
    n_bins: int = 15,
    input_type: InputType | str = "probs",
    ignore_index: int | None = -100,
) -> float:
    """Top-label ECE with ``n_bins`` equal-width bins over the confidence (0, 1]."""
    return metrics_of_statistics(_statistics(predictions, references, input_type, ignore_index), _checked_bins(n_bins))["ece"]


def _checked_bins(n_bins: Any) -> int:
    if not is_int(n_bins) or n_bins < 1:
        raise ValueError(f"n_bins must be an integer >= 1; got {n_bins!r}")
    return int(n_bins)


def _binned_calibration_error(conf: Tensor, correct: Tensor, n_bins: int) -> float:
    """ECE of items' top-label confidences ``conf`` and whether that label is right (``correct``, 0/1)."""
    # bin b (0-based) holds (b/n, (b+1)/n]: its index is the number of inner boundaries strictly below
    # the confidence; b/n as a correctly rounded division (linspace's 11/20 is 0.5499999999999999)
    inner = torch.arange(1, n_bins, dtype=torch.float64) / n_bins
    bins = torch.searchsorted(inner, conf, side="left")
    acc_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, bins, correct)
    conf_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, bins, conf)
    # Σ_b (|B_b|/N) |acc_b − conf_b| = Σ_b |Σ_{i∈B_b} (correct_i − conf_i)| / N
    return float((acc_sum - conf_sum).abs().sum() / conf.shape[0])


def calibration_metrics(
    predictions: Any,
    references: Any,
    input_type: InputType | str = "probs",
    n_bins: int = 15,
    ignore_index: int | None = -100,
) -> dict[str, float]:
    """``CALIBRATION_METRIC_KEYS`` (nll, accuracy, ece, brier) in one call (the keys ``EVONTrainer`` reports),
    through :func:`item_statistics`, as the trainer's token metrics are summed batch by batch."""
    return metrics_of_statistics(_statistics(predictions, references, input_type, ignore_index), _checked_bins(n_bins))


# the columns of :func:`item_statistics`
_LOGP_LABEL, _CORRECT, _CONF, _CONF_CORRECT, _BRIER, _NAN = range(6)


def item_statistics(logp: Tensor, labels: Tensor, probs: Tensor | None = None) -> Tensor:
    """What :func:`calibration_metrics` reads of each item of float64 log-probabilities ``logp``
    ``(..., C)`` with integer ``labels`` ``(...)``, six numbers an item (``(..., 6)``, 0 where a label
    is ``-100``), for :func:`metrics_of_statistics`: a set's metrics without its items' C
    probabilities held at once (a decoder's vocabulary). ValueError for a label outside ``[0, C)``.
    ``probs``: the probabilities themselves (given, or the softmax of given logits), for the confidences
    and the Brier score: ``exp(log p)`` is off in the last bit (``exp(log(1/8))`` is 0.12500000000000003),
    which moves a confidence on a bin's upper edge into the bin above. ValueError for fewer than two
    columns: one log-probability (a binary classifier's log-sigmoid) would score every item as class 0."""
    if logp.ndim < 1 or logp.shape[-1] < 2:
        raise ValueError(
            f"item_statistics: logp has {logp.shape[-1] if logp.ndim else 0} column"
            f"{'' if logp.ndim and logp.shape[-1] == 1 else 's'} (shape {tuple(logp.shape)}): the statistics "
            "score a distribution over at least two classes. A binary classifier's single logit z is two "
            "columns: the log_softmax of [0, z], (log(1 - sigmoid(z)), log sigmoid(z))"
        )
    ignored = labels == -100
    if bool(((labels < 0) | (labels >= logp.shape[-1]))[~ignored].any()):
        raise ValueError(f"references must be in [0, {logp.shape[-1]}); got values outside")
    safe = labels.masked_fill(ignored, 0).long()
    probs = logp.exp() if probs is None else probs.to(logp.dtype)
    conf, top = probs.max(-1)
    onehot = torch.nn.functional.one_hot(safe, logp.shape[-1]).to(probs.dtype)
    stats = torch.stack(
        [
            logp.gather(-1, safe[..., None]).squeeze(-1),
            (logp.argmax(-1) == safe).to(logp.dtype),
            conf,
            (top == safe).to(logp.dtype),
            (probs - onehot).square().sum(-1),
            torch.isnan(logp).any(-1).to(logp.dtype),
        ],
        dim=-1,
    )
    return stats.masked_fill(ignored[..., None], 0.0)


def metrics_of_statistics(stats: Tensor, n_bins: int = 15) -> dict[str, float]:
    """:func:`calibration_metrics` of items from their :func:`item_statistics` ``(N, 6)`` (the items
    to score only: none ignored)."""
    stats = stats.double()
    nan = bool(stats[:, _NAN].any())
    values = (
        0.0 - float(stats[:, _LOGP_LABEL].mean()),  # 0.0 - x, not -x: a perfect prediction's NLL is 0.0, not -0.0
        math.nan if nan else float(stats[:, _CORRECT].mean()),
        _binned_calibration_error(stats[:, _CONF].contiguous(), stats[:, _CONF_CORRECT].contiguous(), n_bins),
        float(stats[:, _BRIER].mean()),
    )
    return dict(zip(CALIBRATION_METRIC_KEYS, values, strict=True))


def metric_module_path(name: str) -> str:
    """Folder of the packaged ``evaluate`` module for ``name`` (``"ece"``, ``"brier"``, ``"nll"`` or full names)."""
    for folder, aliases in METRIC_MODULES.items():
        if name in aliases:
            return os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics_modules", folder)
    known = sorted(a for aliases in METRIC_MODULES.values() for a in aliases)
    raise ValueError(f"unknown hf-evon metric {name!r}; choose one of {known}")


def load_metric(name: str, **kwargs: Any) -> Any:
    """``evaluate.load`` of a packaged calibration metric, from its local folder (no network).

    ``name``: ``"ece"``/``"expected_calibration_error"``, ``"brier"``/``"brier_score"`` or
    ``"nll"``/``"negative_log_likelihood"``. ``kwargs`` go to ``evaluate.load``.
    """
    import evaluate

    return evaluate.load(metric_module_path(name), **kwargs)


def evaluate_metric_info(description: str, citation: str, inputs_description: str) -> Any:
    """The ``evaluate.MetricInfo`` shared by the packaged calibration modules (same inputs)."""
    import datasets
    import evaluate

    return evaluate.MetricInfo(
        description=description,
        citation=citation,
        inputs_description=inputs_description,
        features=datasets.Features(
            {
                "predictions": datasets.Sequence(datasets.Value("float64")),
                "references": datasets.Value("int64"),
            }
        ),
        reference_urls=["https://github.com/huggingface/evaluate"],
    )
