"""The entropy decomposition of the BMA predictive (hf_evon.predictive.uncertainty)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from conftest import ScalarReads

from hf_evon.predictive.logprobs import LogMeanExp, log_mean_prob
from hf_evon.predictive.uncertainty import (
    PredictiveSpread,
    PredictiveUncertainty,
    SpreadAccumulator,
    UncertaintyAccumulator,
    entropy,
    predictive_uncertainty,
)


def reference(probs: list[list[float]]) -> tuple[float, float, float]:
    """The three entropies of one input from its samples' probability rows, in plain Python."""
    s = len(probs)
    mean = [sum(row[c] for row in probs) / s for c in range(len(probs[0]))]
    h = lambda p: -sum(x * math.log(x) for x in p if x > 0)  # noqa: E731
    total, aleatoric = h(mean), sum(h(row) for row in probs) / s
    return total, aleatoric, total - aleatoric


def test_samples_that_agree_have_no_epistemic_part() -> None:
    logp = torch.full((6, 3, 4), -math.log(4.0))  # 6 samples, 3 inputs, uniform over 4 classes
    u = predictive_uncertainty(logp)
    assert torch.allclose(u.total, torch.full((3,), math.log(4.0), dtype=torch.float64), atol=1e-12)
    assert torch.allclose(u.aleatoric, u.total, atol=1e-12)
    assert torch.equal(u.epistemic, torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("num_samples", [2, 3, 6, 7, 8])
def test_equal_samples_give_exactly_the_means_log_probs_and_zero_epistemic(num_samples: int) -> None:
    """S copies of one prediction: log p̄ is that prediction bit for bit, stacked (log_mean_prob,
    predictive_uncertainty) or one at a time (LogMeanExp, UncertaintyAccumulator), so the epistemic
    part is exactly 0, a class of probability 0 included. Before, logsumexp − log S and logaddexp's
    running sum were off in the last bits: epistemic up to ~1e-15 where every sample agrees."""
    g = torch.Generator().manual_seed(0)
    one = torch.log_softmax(4 * torch.randn(50, 6, generator=g, dtype=torch.float64), -1)
    one[0, 0] = -math.inf  # a class the prediction rules out
    samples = one.expand(num_samples, -1, -1)
    assert torch.equal(log_mean_prob(samples), one)
    u = predictive_uncertainty(samples)
    assert torch.equal(u.epistemic, torch.zeros(50, dtype=torch.float64))
    assert torch.equal(u.total, u.aleatoric)
    average, acc = LogMeanExp(), UncertaintyAccumulator()
    for sample in samples:
        average.add(sample)
        acc.add(sample)
    assert torch.equal(average.value(), one) and torch.equal(acc.value(), one)
    assert torch.equal(acc.uncertainty().epistemic, torch.zeros(50, dtype=torch.float64))


def test_confident_samples_that_disagree_are_all_epistemic() -> None:
    # two samples, each certain, of different classes: p̄ = (1/2, 1/2, 0)
    logp = torch.tensor([[[0.0, -math.inf, -math.inf]], [[-math.inf, 0.0, -math.inf]]])
    u = predictive_uncertainty(logp)
    assert u.aleatoric.tolist() == [0.0]  # 0·log 0 adds nothing, not NaN
    assert u.total.item() == pytest.approx(math.log(2.0), abs=1e-12)
    assert u.epistemic.item() == pytest.approx(math.log(2.0), abs=1e-12)


def test_random_samples_match_the_plain_formulas() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(5, 7, 4, generator=gen)  # 5 samples, 7 inputs, 4 classes
    logp = logits.log_softmax(-1)
    u = predictive_uncertainty(logp)
    for i in range(7):
        total, aleatoric, epistemic = reference(logp[:, i].double().exp().tolist())
        assert u.total[i].item() == pytest.approx(total, abs=1e-12)
        assert u.aleatoric[i].item() == pytest.approx(aleatoric, abs=1e-12)
        assert u.epistemic[i].item() == pytest.approx(epistemic, abs=1e-12)
    assert bool((u.epistemic > 0).all())
    # samples along another dimension give the same numbers
    moved = predictive_uncertainty(logp.transpose(0, 1), dim=1)
    for a, b in zip(u, moved, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(moved, predictive_uncertainty(logp.transpose(0, 1), dim=np.int64(1)), strict=True):
        assert torch.equal(a, b)  # a NumPy integer is the axis it holds


def test_a_negative_samples_dim_means_what_it_means_for_torch() -> None:
    # (N, S, C): samples on axis 1 = -2; the entropies drop the classes axis, so -2 must be
    # resolved against the input's dimensions, not the entropies'
    gen = torch.Generator().manual_seed(1)
    logp = (3 * torch.randn(4, 5, 3, generator=gen)).log_softmax(-1)
    for a, b in zip(predictive_uncertainty(logp, dim=-2), predictive_uncertainty(logp, dim=1), strict=True):
        assert torch.equal(a, b)
    for i in range(4):
        total, aleatoric, _ = reference(logp[i].double().exp().tolist())
        assert predictive_uncertainty(logp, dim=-2).aleatoric[i].item() == pytest.approx(aleatoric, abs=1e-12)
        assert predictive_uncertainty(logp, dim=-2).total[i].item() == pytest.approx(total, abs=1e-12)


def test_one_sample_has_no_epistemic_part_at_any_temperature() -> None:
    logits = torch.tensor([[[2.0, -1.0, 0.5]]])
    for temperature in (0.5, 1.0, 3.0):
        u = predictive_uncertainty((logits / temperature).log_softmax(-1))
        assert u.epistemic.tolist() == [0.0]
        assert u.total.item() == pytest.approx(
            entropy((logits / temperature).log_softmax(-1))[0, 0].item(), abs=1e-12
        )


def test_accumulator_equals_the_stacked_decomposition() -> None:
    gen = torch.Generator().manual_seed(1)
    draws = [
        torch.randn(3, 5, 6, generator=gen).log_softmax(-1) for _ in range(4)
    ]  # e.g. (batch, tokens, vocab)
    acc = UncertaintyAccumulator()
    for d in draws:
        acc.add(d)
    stacked = predictive_uncertainty(torch.stack(draws))
    assert acc.count == 4
    assert torch.allclose(acc.value(), log_mean_prob(torch.stack(draws).double()), atol=1e-12)
    got = acc.uncertainty()
    assert isinstance(got, PredictiveUncertainty)
    for a, b in zip(got, stacked, strict=True):
        assert a.shape == (3, 5)
        assert torch.allclose(a, b, atol=1e-12)
    assert draws[0].dtype == torch.float32  # the caller's draws are not changed in place
    assert torch.equal(draws[0], torch.stack(draws)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_accumulators_keep_no_reference_to_a_callers_buffer(dtype) -> None:
    """A caller that copies each draw into one buffer gets the stacked result: the accumulators
    kept a float64 first draw by reference, so the buffer's later draws replaced it."""
    gen = torch.Generator().manual_seed(2)
    draws = [torch.randn(4, 5, generator=gen, dtype=dtype).log_softmax(-1) for _ in range(3)]
    acc, average, buffer = UncertaintyAccumulator(), LogMeanExp(), torch.empty(4, 5, dtype=dtype)
    for d in draws:
        buffer.copy_(d)
        acc.add(buffer)
        average.add(buffer)
    stacked = predictive_uncertainty(torch.stack(draws))
    for got, want in zip(acc.uncertainty(), stacked, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(average.value(), log_mean_prob(torch.stack(draws)), rtol=0, atol=1e-6)


def test_bad_input_is_named() -> None:
    with pytest.raises(TypeError, match="sample_log_probs must be a floating-point tensor"):
        predictive_uncertainty(torch.zeros(2, 3, dtype=torch.long))
    uniform = lambda *shape: torch.full(shape, -math.log(shape[-1]))  # noqa: E731
    with pytest.raises(ValueError, match="must not be the last dimension"):
        predictive_uncertainty(uniform(2, 3), dim=-1)
    with pytest.raises(ValueError, match="a samples and a classes dimension"):
        predictive_uncertainty(uniform(3))
    acc = UncertaintyAccumulator()
    with pytest.raises(ValueError, match="no samples added"):
        acc.uncertainty()
    acc.add(uniform(2, 3))
    with pytest.raises(ValueError, match=r"log_probs has shape \(2, 4\), the earlier samples \(2, 3\)"):
        acc.add(uniform(2, 4))
    assert acc.count == 1  # the refused sample left the accumulator as it was


def test_what_is_not_log_probabilities_or_an_axis_is_refused() -> None:
    # logits gave a total "entropy" of -5e5, probabilities -2, a NaN row was dropped, dim=3 of a
    # 3-D tensor wrapped to 0
    logits = 3 * torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(2))
    for bad in (logits, logits.softmax(-1)):
        with pytest.raises(ValueError, match=r"must hold log-probabilities, each row's logsumexp 0"):
            predictive_uncertainty(bad)
    with_nan = logits.log_softmax(-1)
    with_nan[1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"off by up to nan"):
        predictive_uncertainty(with_nan)
    for dim in (3, -4, "0"):
        with pytest.raises(ValueError, match=r"dim must be an axis of sample_log_probs \(shape \(4, 5, 3\)\)"):
            predictive_uncertainty(logits.log_softmax(-1), dim=dim)


def test_one_class_is_refused_naming_the_two_column_form_of_a_sigmoid() -> None:
    """A binary classifier's single logit, log_softmax-ed as the usage snippet does, is 0 whatever the
    input: every entropy came out 0, the samples' disagreement included. One class is refused by name,
    by the stacked decomposition and the accumulator alike; the two columns [0, z] it names give the
    Bernoulli entropies of sigmoid(z)."""
    z = torch.tensor([[[2.0], [-0.5]], [[0.5], [1.0]], [[-1.0], [0.0]]], dtype=torch.float64)  # (S, N, 1)
    with pytest.raises(ValueError, match=r"^sample_log_probs has one class \(shape \(3, 2, 1\)\).*\[0, z\]"):
        predictive_uncertainty(z.log_softmax(-1))
    acc = UncertaintyAccumulator()
    with pytest.raises(ValueError, match=r"^log_probs has one class \(shape \(2, 1\)\).*\[0, z\]"):
        acc.add(z[0].log_softmax(-1))
    assert acc.count == 0
    u = predictive_uncertainty(torch.cat([torch.zeros_like(z), z], -1).log_softmax(-1))
    for i in range(2):
        p = torch.sigmoid(z[:, i, 0]).tolist()
        expected = reference([[1 - q, q] for q in p])
        assert (u.total[i].item(), u.aleatoric[i].item(), u.epistemic[i].item()) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("shape", "dim"), [((0, 3, 5), 0), ((3, 0, 5), 1), ((4, 0, 5), -2)])
def test_an_empty_samples_axis_is_refused_by_name(shape, dim) -> None:
    """No samples along ``dim`` (a slice ``[:k]`` with k = 0) raised "math domain error" from the
    average's log(0); the inputs' own axes may be empty (an empty batch: empty entropies)."""
    with pytest.raises(ValueError, match=rf"sample_log_probs has no samples along dim {dim} \(shape {re.escape(str(shape))}\)"):
        predictive_uncertainty(torch.empty(shape), dim=dim)
    empty_batch = predictive_uncertainty(torch.full((2, 0, 5), -math.log(5.0)))
    assert all(part.shape == (0,) for part in empty_batch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_a_temperature_divides_low_precision_logits_in_float32(dtype):
    """bfloat16 logits / T rounded each quotient to 3 digits (0.08 nats of log p seen at T = 2^0.25)."""
    from types import SimpleNamespace

    from hf_evon.predictive.logprobs import tempered

    logits = (torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 8).to(dtype)
    t = 2**0.25
    out = tempered(logits, SimpleNamespace(temperature=t))
    assert out.dtype == torch.promote_types(dtype, torch.float32)
    exact = logits.double() / t
    torch.testing.assert_close(out.double(), exact, rtol=1e-6 if dtype != torch.float64 else 1e-15, atol=0)
    assert tempered(logits, SimpleNamespace(temperature=1.0)) is logits


def test_the_accumulators_results_read_the_host_once_and_average_once() -> None:
    """``predict_uncertainty`` reads ``value()`` (log p̄) and ``uncertainty()`` of each batch: each
    computed log p̄ anew (a copy the size of the logits) and read the host once to check the samples,
    two reads a batch. One now, and the same tensors bit for bit, also after more samples."""
    g = torch.Generator().manual_seed(0)
    samples = torch.log_softmax(torch.randn(4, 3, 5, generator=g, dtype=torch.float64), -1)

    def fed(n: int) -> tuple[UncertaintyAccumulator, LogMeanExp]:
        acc, average = UncertaintyAccumulator(), LogMeanExp()
        for s in samples[:n]:
            acc.add(s)
            average.add(s)
        return acc, average

    acc, average = fed(3)
    with ScalarReads() as reads:
        value, u = acc.value(), acc.uncertainty()
    assert reads.count == 1
    alone = fed(3)[0].uncertainty()  # read on its own
    assert torch.equal(value, average.value())
    assert all(torch.equal(a, b) for a, b in zip(u, alone, strict=True))
    acc.add(samples[3])  # a later sample: the results are of all four
    acc4, average4 = fed(4)
    assert torch.equal(acc.value(), average4.value())
    assert all(torch.equal(a, b) for a, b in zip(acc.uncertainty(), acc4.uncertainty(), strict=True))
    assert not torch.equal(acc.value(), value)


@pytest.mark.parametrize("equal_first", [1, 2, 3])
def test_draws_that_differ_only_after_equal_ones_average_as_stacked(equal_first: int) -> None:
    """LogMeanExp forms no sum while the draws equal the first; the first that differs is averaged
    with all of them: the same log p̄ as log_mean_prob over the stacked draws (a class ruled out by
    every draw included)."""
    g = torch.Generator().manual_seed(1)
    first = torch.log_softmax(3 * torch.randn(20, 5, generator=g, dtype=torch.float64), -1)
    first[:, 0] = -math.inf
    later = [torch.log_softmax(3 * torch.randn(20, 5, generator=g, dtype=torch.float64), -1) for _ in range(2)]
    for x in later:
        x[:, 0] = -math.inf
    draws = [first] * equal_first + later
    average = LogMeanExp()
    for x in draws:
        average.add(x)
    want = log_mean_prob(torch.stack(draws))
    assert torch.equal(average.value().isinf(), want.isinf())
    torch.testing.assert_close(average.value(), want, rtol=0, atol=1e-13)


def test_the_spread_of_a_regressions_samples_is_their_mean_and_their_standard_deviation_over_s() -> None:
    """SpreadAccumulator's mean is ValueMean's, the sum in arrival order over S; its std is sqrt(1/S Σ (y − mean)²),
    here against the plain-Python formula; samples that agree (large values, where Σy² − S·mean² cancels)
    spread by exactly 0; a sample of another shape or an integer one is refused, naming ``values``."""
    draws = [[1.0, -2.0], [3.0, 0.5], [2.5, 4.0], [-1.0, 1.0]]
    acc = SpreadAccumulator()
    for row in draws:
        acc.add(torch.tensor(row, dtype=torch.float32))
    spread = acc.spread()
    assert isinstance(spread, PredictiveSpread) and spread.mean.dtype == spread.std.dtype == torch.float64
    for j in range(2):
        column = [row[j] for row in draws]
        mean = sum(column) / 4
        assert spread.mean[j].item() == mean
        assert spread.std[j].item() == pytest.approx(math.sqrt(sum((y - mean) ** 2 for y in column) / 4), rel=1e-15)
    same = SpreadAccumulator()
    for _ in range(5):
        same.add(torch.full((3,), 1234.567, dtype=torch.float64))
    assert torch.equal(same.spread().std, torch.zeros(3, dtype=torch.float64))
    assert torch.equal(same.spread().mean, torch.full((3,), 1234.567, dtype=torch.float64))
    with pytest.raises(ValueError, match=re.escape("values has shape (3,), the earlier samples (2,)")):
        acc.add(torch.zeros(3))
    with pytest.raises(TypeError, match="values must be a floating-point tensor"):
        acc.add(torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="no samples added"):
        SpreadAccumulator().spread()
