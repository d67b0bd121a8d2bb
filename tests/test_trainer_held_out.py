"""Held-out data as ``Trainer`` users hand it over: labels under the trainer's ``label_names``
(evaluation's posterior metrics and the calibration read them as the Trainer's own pass does), and
a calibration split refused wherever it is also an evaluation set."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_trainer import classification_data, config
from torch import nn
from transformers import Trainer

from hf_evon import EVONTrainer
from hf_evon.trainer import EVONTrainerMixin


class Classifier(nn.Module):
    """A small classifier whose ``forward`` names its labels ``label_name`` (a plain module:
    transformers finds no label names in its signature unless told)."""

    def __init__(self, label_name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.label_name = label_name
        self.embed, self.hidden, self.out = nn.Embedding(100, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor, **labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.out(torch.tanh(self.hidden(self.embed(input_ids).mean(1))))
        target = labels.get(self.label_name)
        out = {"logits": logits}
        if target is not None:
            out["loss"] = nn.functional.cross_entropy(logits, target)
        return out


def _named(data, name: str):
    return data if name == "labels" else data.rename_column("labels", name)


def _run(tmp_path, name: str) -> tuple[EVONTrainer, dict[str, float]]:
    trainer = EVONTrainer(
        model=Classifier(name),
        args=config(tmp_path / name, max_steps=3, bma_num_samples=2, label_names=[name]),
        train_dataset=_named(classification_data(48, 0), name),
        eval_dataset=_named(classification_data(32, 1), name),
        calibration_dataset=_named(classification_data(40, 2), name),
    )
    trainer.train()
    return trainer, trainer.evaluate()


def test_labels_under_the_trainers_label_names_give_the_same_posterior_metrics_and_calibration(tmp_path) -> None:
    """``label_names=["targets"]``: the same model, data and seed as with ``labels`` give the same
    mean and BMA metrics and the same calibration (before, evaluate() dropped those metrics and
    the calibration split was refused for having no 'labels')."""
    reference, want = _run(tmp_path, "labels")
    renamed, got = _run(tmp_path, "targets")
    families = [k for k in want if k.startswith(("eval_mean_", "eval_bma_"))]
    assert {"eval_mean_nll", "eval_bma_nll", "eval_bma_accuracy"} <= set(families)
    assert {k: got.get(k) for k in families} == {k: want[k] for k in families}
    assert renamed.calibration is not None and reference.calibration is not None
    assert renamed.calibration.nll == reference.calibration.nll
    assert renamed.calibration.mean_nll == reference.calibration.mean_nll
    assert renamed.calibration.ess == reference.calibration.ess


def test_a_calibration_split_that_is_an_eval_set_is_refused_before_training(tmp_path) -> None:
    """Passed positionally, or as one of a dict of eval sets, the eval set is still the eval set:
    refused when the trainer is made (before, the positional one failed after the whole run and a
    dict's was calibrated on); and ``calibrate()`` refuses a dict's member too."""
    held_out = classification_data(32, 1)
    args = config(tmp_path, max_steps=1)
    with pytest.raises(ValueError, match="calibration_dataset is the eval_dataset"):
        EVONTrainer(Classifier("labels"), args, None, classification_data(), held_out, calibration_dataset=held_out)
    with pytest.raises(ValueError, match="calibration_dataset is the eval_dataset"):
        EVONTrainer(
            model=Classifier("labels"), args=args, train_dataset=classification_data(),
            eval_dataset={"dev": held_out}, calibration_dataset=held_out,
        )  # fmt: skip

    class PassingTrainer(Trainer):  # a subclass whose __init__ hides eval_dataset in **kwargs
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    class EVONPassingTrainer(EVONTrainerMixin, PassingTrainer):
        pass

    with pytest.raises(ValueError, match="calibration_dataset is the eval_dataset"):
        EVONPassingTrainer(
            model=Classifier("labels"), args=args, train_dataset=classification_data(), eval_dataset=held_out,
            calibration_dataset=held_out,
        )  # fmt: skip
    trainer = EVONTrainer(
        model=Classifier("labels"), args=args, train_dataset=classification_data(), eval_dataset={"dev": held_out}
    )
    trainer.train()
    with pytest.raises(ValueError, match="dataset is the eval_dataset"):
        trainer.calibrate(held_out)
    assert trainer.calibrate(classification_data(40, 2)).num_targets == 40  # another split is fine


def test_the_training_set_is_refused_as_the_calibration_split(tmp_path) -> None:
    """``calibration_dataset=train_dataset`` (and ``calibrate(train_dataset)``) was accepted: the noise
    scale and temperature were chosen on the examples the model was trained on, and the summary called
    that NLL held-out. Refused by name when the trainer is made and by ``calibrate()``."""
    train = classification_data()
    args = config(tmp_path, max_steps=1)
    with pytest.raises(ValueError, match="^calibration_dataset is the train_dataset"):
        EVONTrainer(model=Classifier("labels"), args=args, train_dataset=train, calibration_dataset=train)
    trainer = EVONTrainer(model=Classifier("labels"), args=args, train_dataset=train)
    trainer.train()
    with pytest.raises(ValueError, match=r"^calibrate\(\): dataset is the train_dataset"):
        trainer.calibrate(train)
    assert trainer.calibrate(classification_data(40, 2)).num_targets == 40  # another split is fine


def test_bma_metrics_on_the_split_the_calibration_chose_on_warn_that_they_are_not_held_out(tmp_path) -> None:
    """``calibrate(eval)`` is refused, but ``evaluate(calibration split)`` and ``predict(bma=True)`` on it
    reported ``eval_bma_*`` at the scale and temperature chosen on those very examples, silently. They
    warn; another split does not."""
    split, other = classification_data(32, 1), classification_data(40, 2)
    args = config(tmp_path, max_steps=1, bma_num_samples=2)
    trainer = EVONTrainer(model=Classifier("labels"), args=args, train_dataset=classification_data(), calibration_dataset=split)
    trainer.train()
    assert trainer.calibration is not None
    with pytest.warns(UserWarning, match=r"^evaluate\(\): this dataset is the split the posterior's noise scale"):
        trainer.evaluate(split)
    with pytest.warns(UserWarning, match=r"^predict\(bma=True\): this dataset is the split"):
        trainer.predict(split, bma=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        trainer.evaluate(other)
        trainer.predict(other, bma=True)
