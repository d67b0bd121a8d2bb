"""hf_evon.predictive.metrics against hand computations, and its evaluate modules (offline)."""

from __future__ import annotations

import math
import socket

import numpy as np
import pytest
import torch

from hf_evon import accuracy, brier_score, expected_calibration_error, negative_log_likelihood
from hf_evon.predictive.metrics import (
    InputType,
    calibration_metrics,
    item_statistics,
    load_metric,
    metric_module_path,
)

# 6 items, 3 classes; confidences 0.9, 0.8, 0.55, 0.5, 0.45, 0.7 (top class first column
# unless noted). Hand-made so every bin of a 5-bin ECE is easy to check.
PROBS = np.array(
    [
        [0.90, 0.05, 0.05],  # conf 0.90, pred 0, label 0: correct   -> bin (0.8, 1.0]
        [0.10, 0.80, 0.10],  # conf 0.80, pred 1, label 2: wrong     -> bin (0.6, 0.8]
        [0.55, 0.25, 0.20],  # conf 0.55, pred 0, label 0: correct   -> bin (0.4, 0.6]
        [0.25, 0.25, 0.50],  # conf 0.50, pred 2, label 2: correct   -> bin (0.4, 0.6]
        [0.45, 0.35, 0.20],  # conf 0.45, pred 0, label 1: wrong     -> bin (0.4, 0.6]
        [0.15, 0.70, 0.15],  # conf 0.70, pred 1, label 1: correct   -> bin (0.6, 0.8]
    ]
)
LABELS = np.array([0, 2, 0, 2, 1, 1])


def test_accuracy_nll_brier_by_hand():
    assert accuracy(PROBS, LABELS) == pytest.approx(4 / 6)
    picked = [0.90, 0.10, 0.55, 0.50, 0.35, 0.70]
    assert negative_log_likelihood(PROBS, LABELS) == pytest.approx(-np.mean(np.log(picked)))
    brier_rows = [
        0.1**2 + 0.05**2 + 0.05**2,
        0.1**2 + 0.8**2 + 0.9**2,
        0.45**2 + 0.25**2 + 0.2**2,
        0.25**2 + 0.25**2 + 0.5**2,
        0.45**2 + 0.65**2 + 0.2**2,
        0.15**2 + 0.3**2 + 0.15**2,
    ]
    assert brier_score(PROBS, LABELS) == pytest.approx(np.mean(brier_rows))


def test_ece_by_hand():
    # 5 bins: (0.4,0.6]: items 2,3,4 acc 2/3 conf 0.5; (0.6,0.8]: items 1,5 acc 1/2 conf 0.75;
    # (0.8,1]: item 0 acc 1 conf 0.9
    expected = 3 / 6 * abs(2 / 3 - 0.5) + 2 / 6 * abs(0.5 - 0.75) + 1 / 6 * abs(1 - 0.9)
    assert expected_calibration_error(PROBS, LABELS, n_bins=5) == pytest.approx(expected)
    # one bin: |accuracy - mean confidence|
    assert expected_calibration_error(PROBS, LABELS, n_bins=1) == pytest.approx(
        abs(4 / 6 - np.mean([0.9, 0.8, 0.55, 0.5, 0.45, 0.7]))
    )
    # a confidence exactly on a boundary (0.8 with 5 bins) belongs to the lower bin (0.6, 0.8]:
    # items 1 and 5 share it (0.25); in (0.8, 1] it would be 0.5·0.8 + 0.5·0.3 = 0.55
    assert expected_calibration_error(PROBS[[1, 5]], LABELS[[1, 5]], n_bins=5) == pytest.approx(0.25)


@pytest.mark.parametrize("conf, n_bins", [(0.55, 20), (9 / 11, 11), (2 / 3, 3)])
def test_a_confidence_on_any_boundary_falls_in_the_lower_bin(conf, n_bins):
    """The bin edges were linspace(0, 1, n+1), whose 11/20 is 0.5499999999999999: 0.55 went to the
    bin above. One item at conf (right) with one at the same edge's lower neighbour in the same
    bin (wrong) gives |1 - conf - lower| / 2; in two bins it would be (1 - conf + lower) / 2."""
    lower = conf - 0.5 / n_bins  # the middle of the bin below the edge: ((b-1)/n, b/n]
    probs = np.array([[conf, 1 - conf], [lower, 1 - lower]])
    labels = np.array([0, 1])
    expected = abs(1 - conf - lower) / 2  # one bin: accuracy 1/2, mean confidence (conf + lower)/2
    assert expected_calibration_error(probs, labels, n_bins=n_bins) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("classes", [8, 10, 20])
def test_a_given_probability_on_a_bin_edge_is_binned_as_given(classes):
    """A uniform prediction over C classes has confidence 1/C, the upper edge of bin (0, 1/C] with
    C bins. The confidence was read back as exp(log p), and exp(log(1/8)) is 0.12500000000000003
    (0.1 gave 0.10000000000000002): the item went to the bin above, beside a wrong item there, and
    the ECE of 8 classes was 0.34375 for the documented 0.53125. The given probabilities are binned."""
    uniform = np.full(classes, 1 / classes)  # conf 1/C, label 0 = argmax: right, bin (0, 1/C]
    above = np.full(classes, (1 - 1.5 / classes) / (classes - 1))
    above[0] = 1.5 / classes  # conf 1.5/C, label 1: wrong, bin (1/C, 2/C]
    probs, labels = np.stack([uniform, above]), np.array([0, 1])
    expected = (abs(1 - 1 / classes) + abs(0 - 1.5 / classes)) / 2  # each alone in its bin
    assert expected_calibration_error(probs, labels, n_bins=classes) == pytest.approx(expected, abs=1e-12)
    assert _ece_float64(probs, labels, classes) == pytest.approx(expected, abs=1e-12)
    assert calibration_metrics(probs, labels, n_bins=classes)["ece"] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("classes", [8, 10, 20])
def test_equal_logits_on_a_bin_edge_are_binned_as_their_softmax(classes):
    """Equal logits over C classes have softmax 1/C, the upper edge of bin (0, 1/C] with C bins; the
    confidence was read as exp(log_softmax), 0.12500000000000003 for C = 8, and the item went to the
    bin above, beside a wrong item there: the ECE of 8 classes was 0.34375 for the documented 0.53125."""
    above = np.full(classes, (1 - 1.5 / classes) / (classes - 1))
    above[0] = 1.5 / classes  # conf 1.5/C, label 1: wrong, bin (1/C, 2/C]
    logits, labels = np.stack([np.zeros(classes), np.log(above)]), np.array([0, 1])
    expected = (abs(1 - 1 / classes) + abs(0 - 1.5 / classes)) / 2  # each alone in its bin
    got = expected_calibration_error(logits, labels, n_bins=classes, input_type="logits")
    assert got == pytest.approx(expected, abs=1e-12)
    combined = calibration_metrics(logits, labels, input_type="logits", n_bins=classes)
    assert combined["ece"] == pytest.approx(expected, abs=1e-12)


def test_perfect_calibration_and_extremes():
    # confidence 0.75 on 4 items, 3 of them right: perfectly calibrated in its bin
    probs = np.array([[0.75, 0.25]] * 4)
    labels = np.array([0, 0, 0, 1])
    assert expected_calibration_error(probs, labels) == pytest.approx(0.0, abs=1e-12)
    onehot = np.eye(3)[LABELS]
    assert brier_score(onehot, LABELS) == 0.0 and negative_log_likelihood(onehot, LABELS) == 0.0
    # 0.0, not -0.0 (equal, but printed and logged as "-0.0")
    assert math.copysign(1.0, negative_log_likelihood(onehot, LABELS)) == 1.0
    wrong = np.eye(3)[(LABELS + 1) % 3]
    assert brier_score(wrong, LABELS) == pytest.approx(2.0)
    assert math.isinf(negative_log_likelihood(wrong, LABELS))


def test_input_types_agree_and_ignore_index():
    logits = torch.randn(50, 4, generator=torch.Generator().manual_seed(0)) * 3
    labels = torch.randint(0, 4, (50,), generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(logits, -1)
    logp = torch.log_softmax(logits, -1)
    for fn in (accuracy, negative_log_likelihood, brier_score, expected_calibration_error):
        ref = fn(probs, labels)
        assert fn(logits, labels, input_type="logits") == pytest.approx(ref, rel=1e-6)
        assert fn(logp, labels, input_type="log_probs") == pytest.approx(ref, rel=1e-6)
        assert fn(logits, labels, input_type=InputType.LOGITS) == fn(logits, labels, input_type="logits")
        assert fn(logp, labels, input_type=InputType.LOG_PROBS) == fn(logp, labels, input_type="log_probs")
        assert fn(probs.tolist(), labels.tolist()) == pytest.approx(ref, rel=1e-6)
        # ignored items are left out
        padded = torch.cat([labels, torch.full((7,), -100)])
        extra = torch.cat([probs, torch.full((7, 4), 0.25)])
        assert fn(extra, padded) == pytest.approx(ref, rel=1e-12)
    combined = calibration_metrics(logits, labels, input_type="logits")
    assert combined == pytest.approx(
        {
            "nll": negative_log_likelihood(probs, labels),
            "accuracy": accuracy(probs, labels),
            "ece": expected_calibration_error(probs, labels),
            "brier": brier_score(probs, labels),
        },
        rel=1e-6,
    )


def _ece_float64(probs: np.ndarray, labels: np.ndarray, n_bins: int = 15) -> float:
    conf, pred = probs.max(-1), probs.argmax(-1)
    bins = np.clip(np.ceil(conf * n_bins).astype(int) - 1, 0, n_bins - 1)  # (b-1)/n < conf <= b/n
    return sum(
        (bins == b).mean() * abs((pred == labels)[bins == b].mean() - conf[bins == b].mean())
        for b in range(n_bins)
        if (bins == b).any()
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, np.float16])
def test_half_precision_probabilities_are_scored_as_given(dtype):
    """A half-precision softmax's rows sum to 1 only within its rounding (bfloat16: 2.4e-3 here): the
    metrics take them, and score them as float64 maths on the very values given."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(512, 10, generator=gen) * 4
    labels = logits.topk(2).indices[torch.arange(512), torch.arange(512) % 2]  # first or second choice
    if dtype is np.float16:
        probs = torch.softmax(logits.half(), -1).numpy()
    else:
        probs = torch.softmax(logits.to(dtype), -1)
    p = np.asarray(torch.as_tensor(probs).double())
    y = labels.numpy()
    assert np.abs(p.sum(-1) - 1).max() > (1e-3 if dtype is torch.bfloat16 else 1e-4)
    nll = -np.log(p[np.arange(512), y]).mean()
    assert np.isfinite(nll) and negative_log_likelihood(probs, labels) == pytest.approx(nll, rel=1e-12)
    assert accuracy(probs, labels) == (p.argmax(-1) == y).mean()
    onehot = np.eye(10)[y]
    assert brier_score(probs, labels) == pytest.approx(((p - onehot) ** 2).sum(-1).mean(), rel=1e-12)
    assert expected_calibration_error(probs, labels) == pytest.approx(_ece_float64(p, y), rel=1e-12)
    # the tolerance is the given dtype's: rows off by 0.2 are refused in half precision, and float32 rows
    # off by the bfloat16 rows' 2.4e-3 are refused
    with pytest.raises(ValueError, match="rows summing to 1"):
        negative_log_likelihood(torch.tensor([[0.6, 0.6]], dtype=torch.bfloat16), [0])
    if dtype is torch.bfloat16:
        with pytest.raises(ValueError, match="rows summing to 1"):
            negative_log_likelihood(probs.float(), labels)


@pytest.mark.parametrize(
    "predictions,references,kwargs,match",
    [
        ([[0.5, 0.5]], [0, 1], {}, "references must have shape"),
        ([0.5, 0.5], [0], {}, r"shape \(N, C\)"),
        ([[0.7, 0.7]], [0], {}, "rows summing to 1"),
        ([[0.5, 0.5]], [2], {}, r"in \[0, 2\)"),
        ([[0.5, 0.5]], [0.5], {}, "integer"),
        ([[0.5, 0.5]], [-100], {}, "no items"),
        ([], [], {}, "^no items to evaluate"),  # as an empty (0, C) input: not "must have shape (N, C)"
        ([[0.5, 0.5]], [0], {"input_type": "softmax"}, "input_type"),
        ([[0.1, -0.2]], [0], {"input_type": "log_probs"}, "<= 0"),
    ],
)
def test_invalid_inputs(predictions, references, kwargs, match):
    with pytest.raises(ValueError, match=match):
        negative_log_likelihood(predictions, references, **kwargs)


@pytest.mark.parametrize("input_type", ["log_probs", "logits"])
def test_a_nan_prediction_makes_every_metric_nan(input_type):
    # accuracy scored a NaN row as class 0 (argmax of NaN) while the others were NaN: a diverged
    # model's evaluation read as a number; NaN (not an error) keeps a training run's evaluation going
    predictions, references = [[math.log(0.9), math.log(0.1)], [float("nan")] * 2], [0, 0]
    for metric in (accuracy, negative_log_likelihood, brier_score, expected_calibration_error):
        assert math.isnan(metric(predictions, references, input_type=input_type)), metric.__name__

@pytest.mark.parametrize("function", [accuracy, negative_log_likelihood, brier_score, expected_calibration_error])
def test_log_probs_that_are_no_distribution_are_refused(function):
    """``input_type="log_probs"`` checked only that the values were <= 0: logits that happen to be
    negative passed as log-probabilities, and the NLL of [[-1, -2], [-0.5, -3]] with labels [0, 1]
    came out 2.0 where their softmax's is 1.45. Rows whose logsumexp is not 0 are refused, as
    probabilities whose rows do not sum to 1 are; a NaN row still gives NaN."""
    logits, labels = [[-1.0, -2.0], [-0.5, -3.0]], [0, 1]
    with pytest.raises(ValueError, match=r"log_probs.*logsumexp.*off by up to 0\.687"):
        function(logits, labels, input_type="log_probs")
    log_probs = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), -1)
    expected = function(logits, labels, input_type="logits")
    assert function(log_probs, labels, input_type="log_probs") == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("function", [accuracy, negative_log_likelihood, brier_score, expected_calibration_error])
def test_one_column_of_predictions_is_refused_naming_the_two_column_form(function):
    """A binary classifier's single logit (BCEWithLogits) passed as ``(N, 1)`` logits was softmaxed
    over its one column, probability 1 for class 0 whatever the input: on references that are all 0
    every metric read perfect (NLL 0, accuracy 1), and a reference 1 read "outside [0, 1)". One
    column is refused, naming predictions and the two columns that give its sigmoid, whose metrics
    are the Bernoulli ones: softmax([0, z]) = [1 - sigmoid(z), sigmoid(z)]."""
    z = torch.tensor([[2.0], [-1.0], [0.5]], dtype=torch.float64)
    for input_type, given in (("logits", z), ("probs", torch.sigmoid(z)), ("log_probs", z.sigmoid().log())):
        with pytest.raises(ValueError, match=r"^predictions have 1 column \(shape \(3, 1\)\).*two columns"):
            function(given, [0, 0, 0], input_type=input_type)
    two = torch.cat([torch.zeros_like(z), z], dim=1)
    p = torch.sigmoid(z).squeeze(1)
    labels = torch.tensor([1, 0, 0])
    expected = {
        negative_log_likelihood: float(-torch.where(labels == 1, p, 1 - p).log().mean()),
        accuracy: 2 / 3,  # sigmoid(z) > 1/2 predicts 1: wrong for the third input only
        brier_score: float((2 * (p - labels) ** 2).mean()),
        # bins of 15: conf 0.8808 (right), 0.7311 (right), 0.6225 (wrong) in three bins of one each
        expected_calibration_error: float(
            ((1 - torch.sigmoid(torch.tensor(2.0, dtype=torch.float64)))
             + (1 - torch.sigmoid(torch.tensor(1.0, dtype=torch.float64)))
             + torch.sigmoid(torch.tensor(0.5, dtype=torch.float64))) / 3
        ),
    }[function]
    assert function(two, labels, input_type="logits") == pytest.approx(expected, rel=1e-12)


def test_item_statistics_of_one_column_is_refused_naming_log_probabilities():
    """``item_statistics`` (the trainer's token metrics, ``metrics_of_statistics``'s input) took ``(N, 1)``
    log-probabilities silently: a binary classifier's log-sigmoid column scored every item as correct with
    confidence ``p`` (its probability of class 1, read as that of class 0), so on references 0 the accuracy
    read 1 whatever the model said. One column is refused, as ``calibration_metrics`` refuses it."""
    logp = torch.sigmoid(torch.tensor([[2.0], [-1.0], [0.5]], dtype=torch.float64)).log()
    with pytest.raises(ValueError, match=r"^item_statistics: logp has 1 column \(shape \(3, 1\)\).*two columns"):
        item_statistics(logp, torch.tensor([0, 0, 0]))
    two = torch.log_softmax(torch.cat([torch.zeros(3, 1), logp.exp().logit()], 1), -1)  # [1 - p, p]
    stats = item_statistics(two, torch.tensor([0, 0, 0]))
    assert stats[:, 1].tolist() == [0.0, 1.0, 0.0]  # the argmax is class 0 where p < 1/2 only


def test_an_ignore_index_that_is_not_an_integer_is_named():
    with pytest.raises(TypeError, match=r"ignore_index must be an integer or None; got 'x'"):
        brier_score([[0.5, 0.5]], [0], ignore_index="x")
    assert negative_log_likelihood([[0.0, float("-inf")]], [0], input_type="logits") == 0.0  # -inf: p = 0


def test_ece_bins_validated():
    with pytest.raises(ValueError, match="n_bins"):
        expected_calibration_error(PROBS, LABELS, n_bins=0)
    with pytest.raises(ValueError, match="n_bins"):
        calibration_metrics(PROBS, LABELS, n_bins=True)


def test_numpy_integers_are_integers_as_in_every_other_argument():
    """``n_bins`` and ``ignore_index`` from a NumPy config are taken as the ints they hold (as
    ``num_samples`` is), the same numbers as with Python ints."""
    labels = [LABELS[0], -7, *LABELS[1:]]
    probs = [PROBS[0], PROBS[0], *PROBS[1:]]
    expected = calibration_metrics(probs, labels, n_bins=4, ignore_index=-7)
    assert expected == calibration_metrics(PROBS, LABELS, n_bins=4)  # the -7 row left out
    assert calibration_metrics(probs, labels, n_bins=np.int32(4), ignore_index=np.int64(-7)) == expected
    assert expected_calibration_error(probs, labels, n_bins=np.int64(4), ignore_index=-7) == expected["ece"]


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access is not allowed in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize(
    "alias,key,fn,extra",
    [
        ("ece", "expected_calibration_error", expected_calibration_error, {"n_bins": 5}),
        ("expected_calibration_error", "expected_calibration_error", expected_calibration_error, {}),
        ("brier", "brier_score", brier_score, {}),
        ("nll", "negative_log_likelihood", negative_log_likelihood, {}),
    ],
)
def test_evaluate_modules_load_offline_and_agree(no_network, alias, key, fn, extra):
    metric = load_metric(alias)
    result = metric.compute(predictions=PROBS.tolist(), references=LABELS.tolist(), **extra)
    assert set(result) == {key}
    assert result[key] == pytest.approx(fn(PROBS, LABELS, **extra), rel=1e-12)
    # batches added incrementally, logits input
    logits = np.log(PROBS) + 1.7
    for row, label in zip(logits, LABELS):
        metric.add(predictions=row.tolist(), references=int(label))
    again = metric.compute(input_type="logits", **extra)
    assert again[key] == pytest.approx(result[key], rel=1e-9)


def test_evaluate_module_path_and_unknown_name():
    import evaluate

    path = metric_module_path("brier")
    assert path.endswith("metrics_modules/brier_score")
    assert evaluate.load(path).compute(predictions=PROBS.tolist(), references=LABELS.tolist())[
        "brier_score"
    ] == pytest.approx(brier_score(PROBS, LABELS))
    with pytest.raises(ValueError, match="unknown hf-evon metric"):
        load_metric("accuracy")
