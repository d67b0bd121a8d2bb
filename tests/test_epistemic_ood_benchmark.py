"""benchmarks/epistemic_ood.py: its AUROC, its tasks' in- and out-of-distribution sets, its scores."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import epistemic_ood  # noqa: E402


def test_auroc_is_the_share_of_ood_scores_above_id_scores_ties_half() -> None:
    # pairs (in, out): (0,1) (0,3) (1,3) (2,3) higher, (1,1) tied, (2,1) lower: (4 + 0.5) / 6
    assert epistemic_ood.auroc(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([1.0, 3.0])) == 0.75
    assert epistemic_ood.auroc(torch.zeros(4), torch.zeros(3)) == 0.5
    assert epistemic_ood.auroc(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 5.0])) == 1.0


def test_digits_class_split_keeps_new_classes_out_of_training() -> None:
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    label_of = {row.tobytes(): label for row, label in zip((X / 16.0).astype(np.float32), y)}
    task, ood = epistemic_ood.digits_task("digits_classes", seed=0, fast=True)
    seen = [int(t) for split in (task.train, task.cal, task.test) for _, ys in split for t in ys]
    assert set(seen) == {0, 1, 2, 3, 4}
    ood_rows = torch.cat([x for x, _ in ood]).numpy()
    assert len(ood_rows) == sum(len(ys) for _, ys in task.test)
    # every OOD row is an image of a digit 5-9 (no two images of the data set are equal)
    labels = [label_of.get(row.tobytes()) for row in ood_rows]
    assert None not in labels and min(labels) >= 5
    assert task.make_model(0)[-1].out_features == 5


def test_digits_rotated_ood_is_the_test_split_turned() -> None:
    task, ood = epistemic_ood.digits_task("digits_rotated", seed=1, fast=True)
    test = torch.cat([x for x, _ in task.test]).reshape(-1, 8, 8)
    turned = torch.cat([x for x, _ in ood]).reshape(-1, 8, 8)
    assert torch.equal(turned, torch.rot90(test, 1, (1, 2)))
    assert float(test.max()) <= 1.0  # intensities / 16
    standard, _ = epistemic_ood.digits_task("digits_rotated", seed=1, fast=True, scaling="standard")
    x = torch.cat([x for x, _ in standard.train])
    assert torch.allclose(x.mean(0), torch.zeros(64), atol=1e-5)  # payoff.py's standardisation


def test_scores_tell_disagreeing_samples_from_agreeing_ones() -> None:
    """Two ID inputs whose samples agree (one confident, one uniform) and two OOD inputs whose
    confident samples disagree: the epistemic part ranks every OOD input above every ID input,
    the entropy ranks the uniform ID input above the OOD ones."""
    c = math.log(0.98), math.log(0.01)
    confident = [c[0], c[1], c[1]]
    uniform = [math.log(1 / 3)] * 3
    other = [c[1], c[0], c[1]]
    id_samples = torch.tensor([[confident, uniform], [confident, uniform]])  # (S=2, N=2, C=3)
    ood_samples = torch.tensor([[confident, other], [other, confident]])
    got = epistemic_ood.rows(id_samples, ood_samples, torch.tensor([0, 1]), sampled=True)
    assert got["epistemic AUROC"] == 1.0
    # H(p̄) of the OOD inputs (log 2 and a little) is below the uniform input's log 3, above the
    # confident one's
    assert got["entropy AUROC"] == 0.5
    assert got["ID accuracy"] == 0.5  # the uniform row's argmax is class 0, its label 1
    mean_only = epistemic_ood.rows(id_samples[:1], ood_samples[:1], torch.tensor([0, 1]), sampled=False)
    # one sample: both OOD rows are confident, tied with the confident ID row, below the uniform one
    assert "epistemic AUROC" not in mean_only
    assert mean_only["max-prob AUROC"] == mean_only["entropy AUROC"] == pytest.approx(0.25)


def test_class_split_sets_the_held_out_classes_aside() -> None:
    y = np.repeat(np.arange(7), 20)  # 140 rows, 7 classes
    train, cal, test, ood, _ = epistemic_ood.class_split(y, seed=3, held_out=5)
    ids = np.concatenate([train, cal, test])
    assert (len(train), len(cal), len(test)) == (60, 20, 20)  # 60/20/20 of the 100 rows of classes 0-4
    assert len(set(ids.tolist())) == 100 and set(y[ids].tolist()) == {0, 1, 2, 3, 4}
    assert len(ood) == len(test) and set(y[ood].tolist()) <= {5, 6}
    whole = epistemic_ood.class_split(y, seed=3, held_out=None)
    assert whole[3] is whole[2] and len(whole[0]) == 84  # nothing held out: the OOD rows are the test rows


def test_noisy_table_trains_on_five_classes_with_a_third_of_the_labels_redrawn() -> None:
    import payoff_tasks
    from sklearn.preprocessing import StandardScaler

    X, y = payoff_tasks.load_table("synthetic7")
    task, ood = epistemic_ood.noisy_table_task(seed=0, fast=True)
    train, _, test, held, _ = epistemic_ood.class_split(y, 0, 5)
    scaler = StandardScaler().fit(X[train])
    features = torch.cat([x for x, _ in task.train]).double()
    assert torch.allclose(features, torch.tensor(scaler.transform(X[train])), atol=1e-6)
    ood_features = torch.cat([x for x, _ in ood]).double()
    assert torch.allclose(ood_features, torch.tensor(scaler.transform(X[held])), atol=1e-6)
    assert set(y[held].tolist()) == {5, 6} and len(held) == len(test)
    labels = torch.cat([t for _, t in task.train]).numpy()
    assert set(labels.tolist()) == {0, 1, 2, 3, 4} and task.make_model(0)[-1].out_features == 5
    # 30% redrawn uniformly among 5 classes: a label differs from the true one with probability 0.24
    changed, n = float(np.mean(labels != y[train])), len(labels)
    assert abs(changed - 0.24) < 4.5 * math.sqrt(0.24 * 0.76 / n)
