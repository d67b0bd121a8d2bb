"""Evaluation users can afford: one mean pass, BMA's own progress bar, BMA every k evaluations, BMA predict."""

from __future__ import annotations

import collections
import json
import math
import os
import re
import sys
import warnings

import numpy as np
import pytest
import torch
from conftest import count_forwards, stop_persistent_workers
from test_trainer import _direct_bma, classification_data, config, lm_data, tiny_bert, tiny_gpt2
from transformers import TrainerCallback

from hf_evon import EVONTrainer
from hf_evon.posterior.model_card import format_value
from hf_evon.predictive.calibration import CalibrationResult
from hf_evon.predictive.uncertainty import PredictiveUncertainty, predictive_uncertainty


def _trained(tmp_path, make=tiny_bert, train=None, evaluation=None, **overrides) -> EVONTrainer:
    values = dict(max_steps=2, evon_ess=60.0, bma_num_samples=2, bma_seed=3)
    values.update(overrides)
    trainer = EVONTrainer(
        model=make(),
        args=config(tmp_path, **values),
        train_dataset=classification_data() if train is None else train,
        eval_dataset=classification_data(48, seed=1) if evaluation is None else evaluation,
    )
    trainer.train()
    return trainer


def _without_runtime(metrics: dict) -> dict:
    """``metrics`` less the runtime ones ``Trainer.predict`` adds (``speed_metrics``), which vary."""
    return {k: v for k, v in metrics.items() if not k.endswith(("_runtime", "_samples_per_second", "_steps_per_second"))}


def _averaged_softmax(trainer: EVONTrainer, batch: dict, seeds: tuple[int, ...]) -> torch.Tensor:
    """The BMA probabilities of ``batch``, computed directly: one sampled forward per seed."""
    trainer.model.eval()
    samples = []
    with torch.no_grad():
        for seed in seeds:
            with trainer.current_posterior().sampled(trainer.model, seed=seed):
                samples.append(torch.softmax(trainer.model(**batch).logits.double(), -1))
    return torch.stack(samples).mean(0)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_evaluate_reuses_the_trainers_mean_pass(tmp_path, kind):
    """1 + S passes per evaluation (was 2 + S), with the same metrics as one computed on its own."""
    if kind == "bert":
        trainer = _trained(tmp_path)  # 48 eval examples, batches of 16: 3 batches
        batches = 3
    else:
        trainer = _trained(tmp_path, tiny_gpt2, lm_data(16), lm_data(20, seed=1))  # 2 batches (16 + 4)
        batches = 2
    calls = count_forwards(trainer.model)
    metrics = trainer.evaluate()
    assert calls[0] == (1 + 2) * batches
    # the same numbers as the stand-alone computation (its own pass at the mean)
    alone = trainer.posterior_metrics(trainer.get_eval_dataloader())
    assert {k for k in metrics if "_mean_" in k or "_bma_" in k} == set(alone)
    for key, value in alone.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_bma_has_its_own_progress_bar(tmp_path, capsys):
    trainer = _trained(tmp_path, disable_tqdm=False)
    capsys.readouterr()
    trainer.evaluate()
    err = capsys.readouterr().err
    assert "BMA evaluation (2 posterior samples)" in err
    assert "/6 " in err or "/6[" in err  # 2 samples × 3 batches
    quiet = _trained(tmp_path / "q", disable_tqdm=True)
    capsys.readouterr()
    quiet.evaluate()
    assert "BMA evaluation" not in capsys.readouterr().err


@pytest.mark.parametrize("every,with_bma", [(1, [1, 2, 3, 4]), (2, [2, 4]), (3, [3, 4]), (0, [4])])
def test_bma_every_k_evaluations_or_only_at_the_end(tmp_path, every, with_bma):
    trainer = _trained(
        tmp_path, max_steps=4, eval_strategy="steps", eval_steps=1, bma_eval_every=every, logging_steps=10
    )
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [1, 2, 3, 4]
    assert [h["step"] for h in evals if "eval_bma_nll" in h] == with_bma
    assert all("eval_mean_nll" in h for h in evals)  # the mean metrics come with every evaluation
    assert "eval_bma_nll" in trainer.evaluate()  # outside train(): always


def test_the_bma_eval_every_help_says_the_last_evaluation_runs_bma_for_every_k() -> None:
    """bma_eval_every's help said only 0 runs BMA at the evaluation at which training stops; every k
    does (k=3 over 4 evaluations: the 3rd and the 4th, as the test above pins)."""
    from hf_evon import EVONConfig

    help_text = " ".join(EVONConfig.__dataclass_fields__["bma_eval_every"].metadata["help"].split())
    assert "and at the evaluation at which training stops, whatever k" in help_text


class _EvaluatesMidTraining(TrainerCallback):
    """At the end of step ``step``: ``trainer.evaluate(data, **kwargs)`` and the stand-alone
    ``posterior_metrics`` of ``data``, on the weights of that step."""

    def __init__(self, trainer, data, step: int, **kwargs) -> None:  # noqa: ANN001
        self.trainer, self.data, self.step, self.kwargs = trainer, data, step, kwargs
        self.metrics: dict = {}
        self.alone: dict = {}

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if state.global_step == self.step:
            self.metrics = self.trainer.evaluate(self.data, **self.kwargs)
            self.alone = self.trainer.posterior_metrics(self.trainer.get_eval_dataloader(self.data))


@pytest.mark.parametrize("bma", [True, False])
def test_evaluate_bma_true_runs_the_bma_passes_where_bma_eval_every_skips_them(tmp_path, bma):
    """``evaluate(dev, bma=True)`` from a callback during ``train()`` (bma_eval_every=0: no BMA
    before the end) raised TypeError ("Trainer.evaluate() got an unexpected keyword argument
    'bma'"); it runs the BMA passes, whose metrics are the stand-alone ones; ``evaluate(dev)`` still
    skips them there."""
    dev = classification_data(20, seed=1)
    trainer = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path, max_steps=3, evon_ess=60.0, bma_num_samples=2, bma_eval_every=0),
        train_dataset=classification_data(),
    )  # fmt: skip
    callback = _EvaluatesMidTraining(trainer, dev, step=1, **({"bma": True} if bma else {}))
    trainer.add_callback(callback)
    trainer.train()
    assert set(callback.alone) == {f"eval_{w}_{m}" for w in ("mean", "bma") for m in ("nll", "accuracy", "ece", "brier")}
    assert ("eval_bma_nll" in callback.metrics) is bma and "eval_mean_nll" in callback.metrics
    for key in callback.metrics.keys() & callback.alone.keys():
        assert callback.metrics[key] == pytest.approx(callback.alone[key], rel=1e-9, abs=1e-12), key


class _EmbeddingHead(torch.nn.Module):
    """A seeded classifier of 8-token rows (vocabulary 100): an embedding and a linear head to 3
    logits over the flattened embeddings; a test subclasses it with the forward it calls them by."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(100, 16), torch.nn.Linear(16 * 8, 3)


class _StopsTraining(TrainerCallback):
    """Stops training at ``step``: on that step's evaluation metrics (as ``EarlyStoppingCallback``
    does, after the evaluation's passes) or at the step's end (before its evaluation)."""

    def __init__(self, step: int, event: str) -> None:
        self.step, self.event = step, event

    def on_evaluate(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if self.event == "on_evaluate" and state.global_step == self.step:
            control.should_training_stop = True

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if self.event == "on_step_end" and state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.parametrize(
    "every,stop,event,with_bma",
    [(0, 2, "on_evaluate", [2]), (2, 3, "on_evaluate", [2, 3]), (0, 2, "on_step_end", [2])],
)
def test_the_evaluation_at_which_training_stops_early_carries_bma(tmp_path, every, stop, event, with_bma):
    """bma_eval_every=0 runs BMA at the evaluation at which training ends: also where a callback
    ends it before max_steps (EarlyStoppingCallback decides after the evaluation's passes), on the
    weights that evaluation scored; the model card reports it beside the mean."""
    trainer = EVONTrainer(
        model=tiny_bert(),
        args=config(tmp_path, max_steps=6, eval_strategy="steps", eval_steps=1, bma_eval_every=every,
                    logging_steps=10, evon_ess=60.0, bma_num_samples=2, bma_seed=3),
        train_dataset=classification_data(),
        eval_dataset=classification_data(48, seed=1),
        callbacks=[_StopsTraining(stop, event)],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    # no compute_metrics: nothing can clash with EVON's metrics (Trainer.log adds "epoch" to what it is given)
    assert [str(w.message) for w in caught if "clashes" in str(w.message)] == []
    history = trainer.state.log_history
    assert [h["step"] for h in history if "eval_loss" in h] == list(range(1, stop + 1))
    assert [h["step"] for h in history if "eval_bma_nll" in h] == with_bma
    reference = trainer.posterior_metrics(trainer.get_eval_dataloader())  # the last step's weights
    logged = {k: v for h in history if h["step"] == stop for k, v in h.items() if k.startswith("eval_")}
    for key in ("eval_mean_nll", "eval_bma_nll", "eval_bma_accuracy", "eval_bma_ece", "eval_bma_brier"):
        assert logged[key] == pytest.approx(reference[key], rel=1e-6, abs=1e-9), key
    trainer.save_model()
    card = (tmp_path / "out" / "README.md").read_text()
    row = f"| nll | {format_value(logged['eval_mean_nll'])} | {format_value(logged['eval_bma_nll'])} |"
    assert row in card.splitlines()


def test_the_stopping_evaluation_carries_bma_on_every_eval_dataset(tmp_path):
    """With several eval datasets the Trainer evaluates them one after the other, and a callback may
    stop on the last one's metrics: the earlier datasets' evaluations at that step went without BMA."""

    class StopsOnTheSecond(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
            if state.global_step == 2 and any(k.startswith("eval_second_") for k in metrics):
                control.should_training_stop = True

    trainer = EVONTrainer(
        model=tiny_bert(),
        args=config(tmp_path, max_steps=6, eval_strategy="steps", eval_steps=1, bma_eval_every=0,
                    logging_steps=10, evon_ess=60.0, bma_num_samples=2, bma_seed=3),
        train_dataset=classification_data(),
        eval_dataset={"first": classification_data(32, seed=1), "second": classification_data(32, seed=2)},
        callbacks=[StopsOnTheSecond()],
    )  # fmt: skip
    trainer.train()
    history = trainer.state.log_history
    for name in ("first", "second"):
        assert [h["step"] for h in history if f"eval_{name}_loss" in h] == [1, 2]
        assert [h["step"] for h in history if f"eval_{name}_bma_nll" in h] == [2], name
    reference = trainer.posterior_metrics(trainer.get_eval_dataloader(classification_data(32, seed=1)))
    logged = next(h for h in history if "eval_first_bma_nll" in h)
    assert logged["eval_first_bma_nll"] == pytest.approx(reference["eval_bma_nll"], rel=1e-6)


def test_a_resumed_run_runs_bma_at_the_evaluations_the_uninterrupted_one_does(tmp_path):
    """The count of evaluations restarted at each train(): resumed at step 3 with bma_eval_every=2,
    the BMA passes ran at steps 5 and 6 (the end) instead of 4 and 6 (the run's 4th and 6th)."""
    common = dict(max_steps=6, eval_strategy="steps", eval_steps=1, bma_eval_every=2, logging_steps=10,
                  save_strategy="steps", save_steps=3)  # fmt: skip
    straight = _trained(tmp_path / "straight", **common)
    resumed = EVONTrainer(
        model=tiny_bert(),
        args=config(tmp_path / "resumed", evon_ess=60.0, bma_num_samples=2, bma_seed=3, **common),
        train_dataset=classification_data(),
        eval_dataset=classification_data(48, seed=1),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "out" / "checkpoint-3"))
    for trainer in (straight, resumed):
        evals = [h for h in trainer.state.log_history if "eval_loss" in h]
        assert [h["step"] for h in evals] == [1, 2, 3, 4, 5, 6]
        assert [h["step"] for h in evals if "eval_bma_nll" in h] == [2, 4, 6]


@pytest.mark.parametrize("every,with_bma", [(1, [0, 1, 2, 3, 4]), (2, [2, 4]), (3, [3, 4]), (0, [4])])
def test_the_evaluation_on_start_counts_toward_no_bma_eval_every(tmp_path, every, with_bma):
    """``eval_on_start=True`` with bma_eval_every=2: the evaluation before the first step counted as
    the run's first, so BMA ran at steps 1, 3 and 4 instead of the 2nd and 4th evaluations of training
    (steps 2 and 4). The start evaluation is extra: BMA there with bma_eval_every=1 only."""
    trainer = _trained(
        tmp_path, max_steps=4, eval_strategy="steps", eval_steps=1, bma_eval_every=every, logging_steps=10,
        eval_on_start=True,
    )  # fmt: skip
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [0, 1, 2, 3, 4]
    assert [h["step"] for h in evals if "eval_bma_nll" in h] == with_bma


def test_a_resumed_run_evaluating_on_start_runs_bma_at_the_evaluations_the_uninterrupted_one_does(tmp_path):
    """Resumed at step 3 (no evaluation there: eval_steps=2) with ``eval_on_start=True``: the start
    evaluation at step 3 counted as the run's second, so the one at step 4 (the 2nd of training,
    bma_eval_every=2) ran no BMA; it runs it, as the uninterrupted run does, and the one at 3 none."""
    common = dict(max_steps=6, eval_strategy="steps", eval_steps=2, bma_eval_every=2, logging_steps=10,
                  save_strategy="steps", save_steps=3)  # fmt: skip
    straight = _trained(tmp_path / "straight", **common)
    resumed = EVONTrainer(
        model=tiny_bert(),
        args=config(tmp_path / "resumed", evon_ess=60.0, bma_num_samples=2, bma_seed=3, eval_on_start=True, **common),
        train_dataset=classification_data(),
        eval_dataset=classification_data(48, seed=1),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "out" / "checkpoint-3"))
    for trainer, steps in ((straight, [2, 4, 6]), (resumed, [2, 3, 4, 6])):
        evals = [h for h in trainer.state.log_history if "eval_loss" in h]
        assert [h["step"] for h in evals] == steps
        assert [h["step"] for h in evals if "eval_bma_nll" in h] == [4, 6]


def test_predict_bma_returns_averaged_probabilities_classification(tmp_path):
    trainer = _trained(tmp_path, bma_num_samples=3)
    test = classification_data(40, seed=2)  # batches of 16, 16, 8
    out = trainer.predict(test, bma=True)
    _, bma, _ = _direct_bma(trainer.model, trainer.current_posterior(), test, seeds=[3, 4, 5])
    batch = {k: torch.tensor(v) for k, v in test[:].items()}
    expected = _averaged_softmax(trainer, batch, (3, 4, 5))
    assert out.predictions.shape == (40, 3)
    np.testing.assert_allclose(out.predictions, expected.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(out.label_ids, np.asarray(test["labels"]))
    for key in ("nll", "accuracy", "ece", "brier"):
        assert out.metrics[f"test_bma_{key}"] == pytest.approx(bma[key], rel=1e-5, abs=1e-7), key
    # bma=False is the Trainer's own predict: logits at the mean
    plain = trainer.predict(test)
    with torch.no_grad():
        np.testing.assert_allclose(
            plain.predictions, trainer.model(**batch).logits.numpy(), rtol=1e-5, atol=1e-6
        )



def test_bma_predictions_report_as_trainer_predict_does(tmp_path):
    """predict(bma=True) and predict_uncertainty() fire the callbacks' ``on_predict`` with their
    metrics and add the runtime metrics ``Trainer.predict`` adds, and with
    ``eval_do_concat_batches=False`` return per-batch lists as it does (before: no event, no
    runtime metrics, one concatenated array)."""

    class Seen(TrainerCallback):
        def __init__(self) -> None:
            self.metrics: list[dict] = []

        def on_predict(self, args, state, control, metrics, **kwargs):
            self.metrics.append(dict(metrics))

    seen = Seen()
    trainer = _trained(tmp_path, bma_num_samples=2)
    trainer.add_callback(seen)
    test = classification_data(40, seed=2)  # batches of 16, 16, 8
    plain, bma, spread = trainer.predict(test), trainer.predict(test, bma=True), trainer.predict_uncertainty(test)
    runtime = {"test_runtime", "test_samples_per_second", "test_steps_per_second"}
    for out in (plain, bma, spread):
        assert runtime <= set(out.metrics)
    assert seen.metrics == [plain.metrics, bma.metrics, spread.metrics]
    assert bma.metrics["test_samples_per_second"] == pytest.approx(40 / bma.metrics["test_runtime"], rel=0.05)
    trainer.args.eval_do_concat_batches = False
    per_batch, spread_per_batch = trainer.predict(test, bma=True), trainer.predict_uncertainty(test)
    assert [p.shape for p in per_batch.predictions] == [(16, 3), (16, 3), (8, 3)]
    np.testing.assert_array_equal(np.concatenate(per_batch.predictions), bma.predictions)
    np.testing.assert_array_equal(np.concatenate(per_batch.label_ids), bma.label_ids)
    assert [len(e) for e in spread_per_batch.predictions.epistemic] == [16, 16, 8]
    np.testing.assert_array_equal(np.concatenate(spread_per_batch.predictions.total), spread.predictions.total)


@pytest.mark.parametrize("batch_eval_metrics", [False, True])
def test_predict_bma_runs_the_users_compute_metrics_and_preprocess_logits_for_metrics(tmp_path, batch_eval_metrics):
    """``Trainer.predict`` passes each batch's logits through ``preprocess_logits_for_metrics`` and
    scores the set with ``compute_metrics``; predict(bma=True) skipped both: predictions of an LM's
    full vocabulary could not be reduced, and the user's metrics were missing. With
    ``batch_eval_metrics`` the Trainer hands ``compute_metrics`` torch tensors, and so does
    predict(bma=True) (it handed numpy arrays, which a compute_metrics using torch operations fails on)."""
    calls = []

    def accuracy(prediction, compute_result=None):
        calls.append((compute_result, type(prediction.predictions), type(prediction.label_ids)))
        hits = prediction.predictions == prediction.label_ids
        return {"agreement": float(hits.sum()) / len(hits)}

    trainer = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path, max_steps=2, evon_ess=60.0, bma_num_samples=3, bma_seed=3,
                                       batch_eval_metrics=batch_eval_metrics),
        train_dataset=classification_data(), compute_metrics=accuracy,
        preprocess_logits_for_metrics=lambda probs, labels: probs.argmax(-1),
    )  # fmt: skip
    trainer.train()
    test = classification_data(40, seed=2)  # batches of 16, 16, 8
    out = trainer.predict(test, bma=True)
    batch = {k: torch.tensor(v) for k, v in test[:].items() if k != "labels"}
    expected = _averaged_softmax(trainer, batch, (3, 4, 5)).argmax(-1)
    np.testing.assert_array_equal(out.predictions, expected.numpy())
    assert out.metrics["test_agreement"] == float((expected.numpy() == np.asarray(test["labels"])).mean())
    assert out.metrics["test_agreement"] == pytest.approx(out.metrics["test_bma_accuracy"], abs=1e-12)
    assert calls == [(True, torch.Tensor, torch.Tensor) if batch_eval_metrics else (None, np.ndarray, np.ndarray)]


@pytest.mark.parametrize("batch_eval_metrics", [False, True])
def test_predict_bma_reports_the_users_numpy_and_tensor_metrics_as_python_numbers(tmp_path, batch_eval_metrics):
    """``Trainer.predict`` turns the numpy scalars and one-element tensors a ``compute_metrics``
    returns into Python numbers (``denumpify_detensorize``); predict(bma=True) kept them, so
    ``trainer.save_metrics("test", out.metrics)`` failed (float32 / Tensor is not JSON serializable)."""

    def agreement(prediction, compute_result=None):
        hits = prediction.predictions.argmax(-1) == prediction.label_ids
        if batch_eval_metrics:  # torch tensors, as the Trainer hands them in that mode
            return {"agreement": hits.float().mean(), "count": hits.sum()}
        return {"agreement": hits.astype(np.float32).mean(), "count": hits.sum()}

    trainer = _trained(tmp_path, batch_eval_metrics=batch_eval_metrics)
    trainer.compute_metrics = agreement
    test = classification_data(40, seed=2)
    plain, bma = trainer.predict(test), trainer.predict(test, bma=True)
    hits = bma.predictions.argmax(-1) == bma.label_ids
    for out in (plain, bma):
        assert {k: type(out.metrics[k]) for k in ("test_agreement", "test_count")} == {
            "test_agreement": float, "test_count": int,
        }  # fmt: skip
    assert bma.metrics["test_count"] == int(hits.sum())
    assert bma.metrics["test_agreement"] == float(hits.astype(np.float32).mean())
    trainer.save_metrics("test", bma.metrics)
    with open(os.path.join(trainer.args.output_dir, "test_results.json")) as f:
        assert json.load(f)["test_count"] == int(hits.sum())


def test_predict_bma_reports_the_memory_metrics_trainer_predict_reports(tmp_path):
    """With ``skip_memory_metrics=False`` ``Trainer.predict`` adds ``test_mem_*``; predict(bma=True)
    added none. A failed predict(bma=True) leaves the tracker free for the next call's metrics."""
    pytest.importorskip("psutil")
    trainer = _trained(tmp_path, skip_memory_metrics=False)
    test = classification_data(40, seed=2)
    memory = {k for k in trainer.predict(test).metrics if k.startswith("test_mem_")}
    assert memory and {k for k in trainer.predict(test, bma=True).metrics if k.startswith("test_mem_")} == memory
    trainer.compute_metrics, trainer.args.include_for_metrics = (lambda p: {}), ["loss"]
    with pytest.raises(ValueError, match=r"include_for_metrics=\['loss'\]"):
        trainer.predict(test, bma=True)  # refused inside the tracked call
    trainer.compute_metrics, trainer.args.include_for_metrics = None, []
    assert any(k.startswith("eval_mem_") for k in trainer.evaluate())
    assert {k for k in trainer.predict(test, bma=True).metrics if k.startswith("test_mem_")} == memory

@pytest.mark.parametrize("concat", [True, False], ids=["concatenated", "per-batch"])
def test_predict_bma_on_an_iterable_dataset_reports_the_speed_trainer_predict_reports(tmp_path, concat):
    """A streamed test set has no length: ``Trainer.predict`` reports its samples and steps per second
    from the rows it saw; predict(bma=True) reported neither. Both now report the same keys, from
    the rows predicted (a list of batches with ``eval_do_concat_batches=False``)."""

    class Stream(torch.utils.data.IterableDataset):
        def __init__(self, rows):  # noqa: ANN001
            self.rows = list(rows)

        def __iter__(self):  # noqa: ANN204
            return iter({"input_ids": r["input_ids"], "labels": r["labels"]} for r in self.rows)

    trainer = _trained(tmp_path, eval_do_concat_batches=concat, per_device_eval_batch_size=5)
    test = Stream(classification_data(13, seed=2))
    plain = set(trainer.predict(test).metrics)
    averaged = trainer.predict(test, bma=True).metrics
    assert {"test_samples_per_second", "test_steps_per_second"} <= plain
    assert {"test_samples_per_second", "test_steps_per_second"} <= set(averaged)
    # 13 rows in ceil(13 / 5) = 3 batches: speed_metrics rounds the runtime to 4 decimals and each
    # rate, of the unrounded runtime, to 3, so the true runtime lies within 5e-5 of the one reported
    runtime, samples, steps = (averaged[f"test_{k}"] for k in ("runtime", "samples_per_second", "steps_per_second"))
    for rows, rate in ((13, samples), (3, steps)):
        assert rows / (runtime + 5e-5) - 5e-4 <= rate <= rows / max(runtime - 5e-5, 1e-12) + 5e-4, (rows, rate, runtime)


@pytest.mark.parametrize(
    "problem, inferred",
    [("regression", False), ("multi_label_classification", False), ("multi_label_classification", True)],
)
def test_predict_bma_averages_a_regressions_outputs_and_a_multi_label_models_sigmoids(tmp_path, problem, inferred):
    """predict(bma=True) took a softmax over every model's last axis: a regression's one output
    came back as probability 1.0 everywhere, a multi-label model's as a distribution over labels.
    ``inferred``: the config has no problem_type, which transformers sets from the float labels in
    the first labelled forward; the first predict(bma=True) averaged softmaxes, the second sigmoids."""
    from datasets import Dataset

    def data(n: int, seed: int) -> Dataset:
        ids = torch.randint(3, 100, (n, 8), generator=torch.Generator().manual_seed(seed))
        if problem == "regression":
            labels = (ids[:, 1].double() / 100).tolist()
        else:
            labels = torch.stack([ids[:, 1] % 2, ids[:, 2] % 2, ids[:, 3] % 2], 1).float().tolist()
        return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels})

    def make() -> torch.nn.Module:
        model = tiny_bert(num_labels=1 if problem == "regression" else 3)
        model.config.problem_type = problem
        return model

    trainer = _trained(tmp_path, make, data(48, 0), data(16, 1), bma_num_samples=3, eval_strategy="no")
    if inferred:
        trainer.model.config.problem_type = None
    test = data(40, 2)
    out = trainer.predict(test, bma=True)
    assert trainer.model.config.problem_type == problem
    batch = {k: torch.tensor(v) for k, v in test[:].items() if k != "labels"}
    trainer.model.eval()
    samples = []
    with torch.no_grad():
        for seed in (3, 4, 5):
            with trainer.current_posterior().sampled(trainer.model, seed=seed):
                logits = trainer.model(**batch).logits.double()
                samples.append(logits if problem == "regression" else torch.sigmoid(logits))
    expected = torch.stack(samples).mean(0)
    assert out.predictions.shape == expected.shape == (40, 1 if problem == "regression" else 3)
    assert expected.std(0).min() > 1e-3  # the predictions differ across inputs: not a constant
    np.testing.assert_allclose(out.predictions, expected.numpy(), rtol=1e-5, atol=1e-6)
    assert not any(key.startswith("test_bma_") for key in out.metrics)  # no class metrics to report


class _MultiLabelModule(torch.nn.Module):
    """A plain (non-transformers) multi-label classifier: 3 logits, BCEWithLogits on float 0/1 labels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

    def forward(self, x, labels=None):
        logits = self.net(x)
        if labels is None:
            return {"logits": logits}
        return {"loss": torch.nn.functional.binary_cross_entropy_with_logits(logits, labels), "logits": logits}


def test_predict_bma_of_a_plain_module_with_float_labels_asks_for_its_problem_type(tmp_path):
    """A plain multi-label module (no config.problem_type) trained on float 0/1 labels shaped like its
    logits: predict(bma=True) and predict_uncertainty averaged softmaxes over its labels, a distribution
    where each label is a yes/no of its own. Floating-point labels beside several outputs name no
    averaging (sigmoids, values or soft class targets' softmaxes): refused naming the labels and
    problem_type; given a config with problem_type "multi_label_classification", the sigmoids' mean."""
    from datasets import Dataset
    from transformers import PretrainedConfig

    def data(n: int, seed: int) -> Dataset:
        x = torch.randn(n, 5, generator=torch.Generator().manual_seed(seed))
        return Dataset.from_dict({"x": x.tolist(), "labels": (x[:, :3] > 0).float().tolist()})

    trainer = _trained(tmp_path, _MultiLabelModule, data(48, 0), data(16, 1), eval_strategy="no",
                       bma_num_samples=3, remove_unused_columns=False)  # fmt: skip
    test = data(20, 2)
    for caller, call in (
        (r"predict\(bma=True\)", lambda: trainer.predict(test, bma=True)),
        (r"predict_uncertainty\(\)", lambda: trainer.predict_uncertainty(test)),
    ):
        refused = rf"^{caller}: the model has no config\.problem_type.*labels are floating point"
        with pytest.raises(ValueError, match=refused + r" \(torch\.float32, shape \(16, 3\)\).*'multi_label_classification'"):
            call()
    trainer.model.config = PretrainedConfig(problem_type="multi_label_classification")
    out = trainer.predict(test, bma=True)
    x = torch.tensor(test["x"])
    trainer.model.eval()
    with torch.no_grad():
        samples = []
        for seed in (3, 4, 5):
            with trainer.current_posterior().sampled(trainer.model, seed=seed):
                samples.append(torch.sigmoid(trainer.model(x)["logits"].double()))
    expected = torch.stack(samples).mean(0)
    assert expected.std(0).min() > 1e-3
    np.testing.assert_allclose(out.predictions, expected.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("return_dict, positions", [(True, True), (False, True), (False, False)])
def test_predict_bma_of_extractive_qa_averages_the_start_and_the_end_distributions(tmp_path, return_dict, positions):
    """An extractive QA model returns ``start_logits`` and ``end_logits`` and no ``logits``:
    predict(bma=True) failed with KeyError 'logits'. It now returns, as ``Trainer.predict`` does
    its logits, a pair: the averaged start and end probabilities over the positions. A tuple
    output (``return_dict=False``) raised IndexError where the batch had the start and end
    positions (label names other than ``labels``) and dropped the end distribution without them.
    ``label_ids`` are the start and end positions and ``compute_metrics`` scores them, as in
    ``Trainer.predict``: predict(bma=True) read a ``labels`` key only, returned None and skipped it."""
    trainer = _trained(tmp_path, _tiny_qa, _qa_data(48, 0), _qa_data(16, 1), bma_num_samples=3, eval_strategy="no")
    test = _qa_data(20, 2)
    if not positions:
        test = test.remove_columns(["start_positions", "end_positions"])
    trainer.model.config.return_dict = return_dict

    def hits(prediction) -> dict[str, float]:
        (start, end), (start_label, end_label) = prediction.predictions, prediction.label_ids
        return {"start_hits": float((start.argmax(-1) == start_label).mean()),
                "end_hits": float((end.argmax(-1) == end_label).mean())}  # fmt: skip

    trainer.compute_metrics = hits
    out = trainer.predict(test, bma=True)
    batch = {"input_ids": torch.tensor(test["input_ids"])}
    trainer.model.eval()
    starts, ends = [], []
    with torch.no_grad():
        for seed in (3, 4, 5):
            with trainer.current_posterior().sampled(trainer.model, seed=seed):
                start_logits, end_logits = trainer.model(**batch, return_dict=False)
            starts.append(torch.softmax(start_logits.double(), -1))
            ends.append(torch.softmax(end_logits.double(), -1))
    assert isinstance(out.predictions, tuple) and len(out.predictions) == 2
    for got, samples in zip(out.predictions, (starts, ends), strict=True):
        expected = torch.stack(samples).mean(0)
        assert got.shape == expected.shape == (20, 8)
        assert (torch.stack(samples)[0] - expected).abs().max() > 1e-3  # the samples differ
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-6)
    if not positions:
        assert out.label_ids is None and _without_runtime(out.metrics) == {}
        return
    labels = (np.asarray(test["start_positions"]), np.asarray(test["end_positions"]))
    assert isinstance(out.label_ids, tuple) and len(out.label_ids) == 2
    for got, expected in zip(out.label_ids, labels, strict=True):
        np.testing.assert_array_equal(got, expected)
    assert _without_runtime(out.metrics) == {
        f"test_{name}_hits": float((torch.stack(samples).mean(0).argmax(-1).numpy() == label).mean())
        for name, samples, label in (("start", starts, labels[0]), ("end", ends, labels[1]))
    }


def test_predict_bma_causal_lm(tmp_path):
    trainer = _trained(tmp_path, tiny_gpt2, lm_data(16), lm_data(8, seed=1), bma_num_samples=2, bma_seed=0)
    test = lm_data(6, seed=2)
    out = trainer.predict(test, bma=True)
    _, bma_nll, _ = _direct_bma(trainer.model, trainer.current_posterior(), test, [0, 1], causal=True)
    assert out.predictions.shape == (6, 12, 100)
    np.testing.assert_allclose(out.predictions.sum(-1), 1.0, rtol=1e-5)
    assert out.metrics["test_bma_nll"] == pytest.approx(bma_nll, rel=1e-5)
    assert out.metrics["test_bma_perplexity"] == pytest.approx(math.exp(bma_nll), rel=1e-5)


def _labelled_forwards(model: torch.nn.Module) -> list[bool]:
    """Per forward of ``model`` from here on: whether it was handed labels."""
    seen: list[bool] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append("labels" in kwargs), with_kwargs=True)
    return seen


def _multi_label_data(n: int, seed: int):
    from datasets import Dataset

    ids = torch.randint(3, 100, (n, 8), generator=torch.Generator().manual_seed(seed))
    labels = torch.stack([ids[:, 1] % 2, ids[:, 2] % 2, ids[:, 3] % 2], 1).float()
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


@pytest.mark.parametrize("kind", ["bert", "gpt2", "multi_label"])
def test_bma_passes_compute_no_loss_and_give_the_labelled_forwards_results(tmp_path, kind, monkeypatch):
    """The BMA passes of predict/evaluate with bma handed every one of their S x batches forwards the
    labels, so each computed a loss it threw away (an LM's: a float copy of its logits and a
    cross-entropy over every position). Only the first labelled forward of a model whose
    ``config.problem_type`` is unset keeps them (transformers sets it there, multi-label from float
    labels, and predict(bma=True) reads it); the predictions and metrics are bit for bit those of
    forwards that all get the labels."""
    from hf_evon.trainer import calibration_data

    if kind == "gpt2":
        trainer = _trained(tmp_path, tiny_gpt2, lm_data(16), lm_data(20, seed=1), bma_num_samples=3)
        test = lm_data(40, seed=2)
    elif kind == "bert":
        trainer = _trained(tmp_path, bma_num_samples=3)
        test = classification_data(40, seed=2)
    else:
        make = lambda: tiny_bert(num_labels=3)  # noqa: E731
        trainer = _trained(tmp_path, make, _multi_label_data(48, 0), _multi_label_data(16, 1), bma_num_samples=3)
        test = _multi_label_data(40, 2)
    unset = kind == "multi_label"  # trained on float labels: the training forward set it

    def run() -> tuple[np.ndarray, dict, dict]:
        if unset:
            trainer.model.config.problem_type = None
        out = trainer.predict(test, bma=True)
        metrics = {} if unset else trainer.posterior_metrics(trainer.get_eval_dataloader())
        return out.predictions, _without_runtime(out.metrics), metrics

    seen = _labelled_forwards(trainer.model)
    predictions, predict_metrics, metrics = run()
    first = kind != "bert"  # an LM's config has no problem_type either: its first forward keeps them
    batches = 0 if unset else len(trainer.get_eval_dataloader())
    # predict: S passes over 3 batches; the metrics: the mean's pass, then S passes
    expected = [first] + [False] * (3 * 3 - 1) + [False] * batches + ([first] + [False] * (3 * batches - 1)) * bool(batches)
    assert seen == expected and len(seen) == 9 + 4 * batches
    assert trainer.model.config.problem_type == (None if kind == "gpt2" else "single_label_classification"
                                                 if kind == "bert" else "multi_label_classification")
    scoring = calibration_data.scoring_inputs
    monkeypatch.setattr(
        calibration_data, "scoring_inputs", lambda model, batch, names, keep=False: scoring(model, batch, names, True)
    )
    seen.clear()
    labelled = run()
    assert seen == [True] * len(expected)
    np.testing.assert_array_equal(predictions, labelled[0])
    assert (predict_metrics, metrics) == labelled[1:] and (predict_metrics or unset)


# the trainer's float32 logits in batches against the direct ones of all rows at once differ by
# about 1e-7, which an entropy carries as an absolute error of the same order (measured up to 3e-7)
ENTROPY_ATOL = 1e-6


def _direct_uncertainty(trainer, posterior, batch, seeds, temperature=1.0):
    """The decomposition computed directly: one sampled forward per seed, stacked."""
    trainer.model.eval()
    logps = []
    with torch.no_grad():
        for seed in seeds:
            with posterior.sampled(trainer.model, seed=seed):
                logps.append(torch.log_softmax(trainer.model(**batch).logits.double() / temperature, -1))
    return predictive_uncertainty(torch.stack(logps))


def test_predict_uncertainty_classification_equals_a_direct_computation(tmp_path):
    trainer = _trained(tmp_path, bma_num_samples=3)
    test = classification_data(40, seed=2)  # batches of 16, 16, 8
    out = trainer.predict_uncertainty(test)
    batch = {k: torch.tensor(v) for k, v in test[:].items() if k != "labels"}
    expected = _direct_uncertainty(trainer, trainer.current_posterior(), batch, (3, 4, 5))
    assert isinstance(out.predictions, PredictiveUncertainty)
    for got, want in zip(out.predictions, expected, strict=True):
        assert got.shape == (40,)
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=ENTROPY_ATOL)
    assert float(expected.epistemic.min()) > 0  # the samples disagree: a part that can be wrong
    np.testing.assert_array_equal(out.label_ids, np.asarray(test["labels"]))
    bma = trainer.predict(test, bma=True).metrics
    # the same passes' {prefix}_bma_* metrics
    assert _without_runtime(out.metrics) == pytest.approx(_without_runtime(bma), rel=1e-9)


def test_predict_uncertainty_draws_at_the_trained_scale_unless_asked(tmp_path):
    """A calibration that keeps the mean (ess = inf) leaves samples that never disagree;
    predict_uncertainty draws at the trained scale, at the calibrated temperature."""
    trained = _trained(tmp_path, bma_num_samples=3)
    posterior = trained.current_posterior()
    kept_mean = CalibrationResult(
        ess=math.inf, trained_ess=posterior.ess, grid=[posterior.ess], nll=[1.0], mean_nll=0.9,
        num_samples=3, num_targets=40, seed=0, temperature=1.5,
    )  # fmt: skip
    trainer = EVONTrainer(
        model=trained.model, args=config(tmp_path / "c", bma_num_samples=3, bma_seed=3),
        posterior=kept_mean.apply(posterior),
    )  # fmt: skip
    test = classification_data(24, seed=2)
    batch = {k: torch.tensor(v) for k, v in test[:].items() if k != "labels"}
    out = trainer.predict_uncertainty(test)
    expected = _direct_uncertainty(trainer, posterior, batch, (3, 4, 5), temperature=1.5)
    for got, want in zip(out.predictions, expected, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=ENTROPY_ATOL)
    calibrated = trainer.predict_uncertainty(test, calibrated_scale=True).predictions
    np.testing.assert_array_equal(calibrated.epistemic, np.zeros(24, dtype=np.float32))
    mean = _direct_uncertainty(trainer, posterior.with_ess(math.inf), batch, (0,), temperature=1.5)
    np.testing.assert_allclose(calibrated.total, mean.total.numpy(), rtol=1e-5, atol=ENTROPY_ATOL)
    np.testing.assert_allclose(calibrated.aleatoric, calibrated.total, rtol=1e-6)


def test_predict_uncertainty_of_a_causal_lm_is_per_position(tmp_path):
    trainer = _trained(tmp_path, tiny_gpt2, lm_data(16), lm_data(8, seed=1), bma_num_samples=2, bma_seed=0)
    test = lm_data(6, seed=2)
    out = trainer.predict_uncertainty(test)
    batch = {k: torch.tensor(v) for k, v in test[:].items() if k != "labels"}
    expected = _direct_uncertainty(trainer, trainer.current_posterior(), batch, (0, 1))
    for got, want in zip(out.predictions, expected, strict=True):
        assert got.shape == (6, 12)
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=ENTROPY_ATOL)


def test_predict_uncertainty_needs_a_softmax_or_a_regression(tmp_path):
    """A multi-label classifier's sigmoids are neither one softmax's classes nor a regression's values:
    refused, saying how their entropies split under posterior samples."""
    from datasets import Dataset

    def data(n: int, seed: int) -> Dataset:
        ids = torch.randint(3, 100, (n, 8), generator=torch.Generator().manual_seed(seed))
        return Dataset.from_dict({"input_ids": ids.tolist(), "labels": (ids[:, 1:4] % 2).float().tolist()})

    def make() -> torch.nn.Module:
        model = tiny_bert(num_labels=3)
        model.config.problem_type = "multi_label_classification"
        return model

    trainer = _trained(tmp_path, make, data(32, 0), data(16, 1), eval_strategy="no")
    refused = r"one softmax output .* or a regression's values .* of kind 'sigmoid'.*predictive_uncertainty splits"
    with pytest.raises(ValueError, match=refused):
        trainer.predict_uncertainty(data(8, 2))
    with pytest.raises(ValueError, match=r"predict_uncertainty\(\) needs a posterior"):
        EVONTrainer(model=tiny_bert(), args=config(tmp_path / "u")).predict_uncertainty(classification_data(8))


class _TwoValueRegressor(torch.nn.Module):
    """A plain (non-transformers) regression of two values per input, MSE on float targets; its config,
    transformers' own, says only problem_type "regression"."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        self.config = PretrainedConfig(problem_type="regression")

    def forward(self, x, labels=None):
        logits = self.net(x)
        if labels is None:
            return {"logits": logits}
        return {"loss": torch.nn.functional.mse_loss(logits, labels), "logits": logits}


@pytest.mark.parametrize("plain", [False, True])
def test_predict_uncertainty_of_a_regression_is_the_bma_mean_and_the_samples_spread(tmp_path, plain):
    """predict_uncertainty refused a regression ("needs a model with one softmax output"), and
    predict(bma=True) gave only the samples' mean: nothing said how far the samples' outputs spread.
    It returns, per input and output, predict(bma=True)'s mean (exactly) and the standard deviation
    over the S samples drawn with seeds bma_seed + s; a posterior without noise spreads by exactly 0."""
    from datasets import Dataset

    from hf_evon.predictive.uncertainty import PredictiveSpread

    def data(n: int, seed: int) -> Dataset:
        generator = torch.Generator().manual_seed(seed)
        if plain:
            x = torch.randn(n, 5, generator=generator)
            return Dataset.from_dict({"x": x.tolist(), "labels": torch.stack([x[:, 0], x[:, 1] * x[:, 2]], 1).tolist()})
        ids = torch.randint(3, 100, (n, 8), generator=generator)
        return Dataset.from_dict({"input_ids": ids.tolist(), "labels": (ids[:, 1].double() / 100).tolist()})

    def make() -> torch.nn.Module:
        if plain:
            return _TwoValueRegressor()
        model = tiny_bert(num_labels=1)
        model.config.problem_type = "regression"
        return model

    trainer = _trained(tmp_path, make, data(48, 0), data(16, 1), eval_strategy="no", bma_num_samples=3,
                       remove_unused_columns=not plain)  # fmt: skip
    test = data(40, 2)  # batches of 16, 16, 8
    out = trainer.predict_uncertainty(test)
    assert isinstance(out.predictions, PredictiveSpread)
    np.testing.assert_array_equal(out.predictions.mean, trainer.predict(test, bma=True).predictions)
    batch = {k: torch.tensor(v) for k, v in test[:].items() if k != "labels"}
    trainer.model.eval()
    samples = []
    with torch.no_grad():
        for s in range(3):
            with trainer.current_posterior().sampled(trainer.model, seed=trainer.args.bma_seed + s):
                output = trainer.model(**batch)
                samples.append((output["logits"] if plain else output.logits).double())
    samples = torch.stack(samples)
    mean, std = samples.mean(0), samples.std(0, correction=0)
    assert out.predictions.mean.shape == out.predictions.std.shape == mean.shape == (40, 2 if plain else 1)
    assert float(std.min()) > 1e-4  # the samples disagree on every input: a spread that can be wrong
    np.testing.assert_allclose(out.predictions.mean, mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.predictions.std, std.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(out.label_ids, np.asarray(test["labels"], dtype=np.float32))
    assert not any(key.startswith("test_bma_") for key in out.metrics)  # no class metrics to report
    point = EVONTrainer(model=trainer.model, args=config(tmp_path / "p", bma_num_samples=3),
                        posterior=trainer.current_posterior().with_ess(math.inf))  # fmt: skip
    still = point.predict_uncertainty(test, calibrated_scale=True).predictions
    np.testing.assert_array_equal(still.std, np.zeros_like(still.mean))
    np.testing.assert_array_equal(still.mean, point.predict(test, bma=True).predictions)


def test_predict_bma_needs_a_posterior_and_samples(tmp_path):
    untrained = EVONTrainer(model=tiny_bert(), args=config(tmp_path), eval_dataset=classification_data(8))
    with pytest.raises(ValueError, match="needs a posterior"):
        untrained.predict(classification_data(8), bma=True)
    trainer = _trained(tmp_path / "t")
    trainer.args.bma_num_samples = 0
    with pytest.raises(ValueError, match="bma_num_samples = 0"):
        trainer.predict(classification_data(8), bma=True)


def test_evaluate_bma_true_needs_a_posterior_and_samples(tmp_path):
    """``evaluate(bma=True)`` without a posterior or with ``bma_num_samples=0`` returned no eval_bma_*
    (a log line at most); it raises, naming what is missing, as ``predict(bma=True)`` does."""
    untrained = EVONTrainer(model=tiny_bert(), args=config(tmp_path), eval_dataset=classification_data(8))
    with pytest.raises(ValueError, match=r"evaluate\(bma=True\) needs a posterior"):
        untrained.evaluate(bma=True)
    trainer = _trained(tmp_path / "t")
    trainer.args.bma_num_samples = 0
    with pytest.raises(ValueError, match="bma_num_samples = 0"):
        trainer.evaluate(bma=True)
    metrics = trainer.evaluate()  # the refused call left no evaluation behind: the plain one runs
    assert "eval_mean_nll" in metrics and "eval_bma_nll" not in metrics


def test_predict_bma_refuses_keywords_the_trainers_predict_does_not_take(tmp_path):
    """``predict(test, bma=True, num_samples=4)`` ignored the keyword (the samples stay
    ``bma_num_samples``) where ``Trainer.predict`` raises TypeError; it raises too, naming it."""
    trainer = _trained(tmp_path)
    with pytest.raises(TypeError, match="'num_samples'"):
        trainer.predict(classification_data(8), bma=True, num_samples=4)
    with pytest.raises(TypeError, match="'num_samples'"):
        trainer.predict(classification_data(8), num_samples=4)  # as without bma


def test_bma_every_k_counts_an_evaluation_of_several_datasets_once(tmp_path):
    evaluation = {"a": classification_data(16, seed=1), "b": classification_data(16, seed=2)}
    trainer = _trained(
        tmp_path, evaluation=evaluation, max_steps=4, eval_strategy="steps", eval_steps=1, bma_eval_every=2
    )
    for name in ("a", "b"):
        evals = [h for h in trainer.state.log_history if f"eval_{name}_loss" in h]
        assert [h["step"] for h in evals if f"eval_{name}_bma_nll" in h] == [2, 4], name


def test_bma_of_a_posterior_without_noise_is_the_mean_without_sampled_passes(tmp_path):
    """Issue 33 §3: a posterior calibrated to the mean (ζ = inf) still ran S identical sampled
    passes per evaluation. Now evaluate() runs the mean's pass only and reports it as BMA, and
    predict(bma=True) runs one pass; the numbers are what the S passes gave."""
    trainer = _trained(tmp_path, bma_num_samples=3)  # 48 eval examples, batches of 16: 3 batches
    trainer.posterior = trainer.current_posterior().with_ess(math.inf)
    trainer._posterior_from_checkpoint = True  # current_posterior() is this one (as after a calibration)
    assert trainer.current_posterior().is_point_mass and not trainer.posterior.with_ess(60.0).is_point_mass
    calls = count_forwards(trainer.model)
    metrics = trainer.evaluate()
    assert calls[0] == 3  # the mean's pass alone (S = 3 sampled passes more before)
    for key in ("nll", "accuracy", "ece"):
        assert metrics[f"eval_bma_{key}"] == metrics[f"eval_mean_{key}"]
    # what the sampled passes give: BMA over 3 draws of the noiseless posterior, computed directly
    data = classification_data(48, seed=1)
    _, direct, _ = _direct_bma(trainer.model, trainer.current_posterior(), data, seeds=[3, 4, 5])
    assert metrics["eval_bma_nll"] == pytest.approx(direct["nll"], rel=1e-5)
    calls[0] = 0
    out = trainer.predict(data, bma=True)
    assert calls[0] == 3  # one pass (3 batches), not 3 × 3
    assert out.metrics["test_bma_nll"] == pytest.approx(direct["nll"], rel=1e-5)


def test_bma_evaluation_and_prediction_use_the_posteriors_temperature(tmp_path):
    """A calibrated temperature T is part of the predictive: evaluate() and predict(bma=True)
    average softmax(logits / T) over the samples. A noiseless posterior with T != 1 is not the
    mean's pass: one pass at the mean, tempered. (T = 0.01: the barely trained model's logits are
    nearly equal, and only a sharpening makes the temperature show in the NLL.)"""
    from hf_evon.predictive.metrics import calibration_metrics

    trainer = _trained(tmp_path, bma_num_samples=3)
    data = classification_data(48, seed=1)
    batch = {k: torch.tensor(v) for k, v in data[:].items()}
    noisy = trainer.current_posterior()
    trainer._posterior_from_checkpoint = True  # current_posterior() is trainer.posterior
    cases = ((noisy.with_temperature(0.01), [3, 4, 5]), (noisy.with_ess(math.inf).with_temperature(0.01), [None]))
    for posterior, seeds in cases:
        trainer.posterior = posterior
        trainer.model.eval()
        with torch.no_grad():
            logps = []
            for seed in seeds:
                with posterior.sampled(trainer.model, seed=seed) if seed is not None else torch.no_grad():
                    tempered = trainer.model(**batch).logits.double() / 0.01
                    logps.append(torch.log_softmax(tempered, -1))
        expected = torch.logsumexp(torch.stack(logps), 0) - math.log(len(seeds))
        direct = calibration_metrics(expected, batch["labels"], "log_probs")
        calls = count_forwards(trainer.model)
        metrics = trainer.evaluate()
        assert calls[0] == 3 + 3 * len(seeds)  # the Trainer's pass, then one per sample (or the mean's)
        for key in ("nll", "accuracy", "ece"):
            assert metrics[f"eval_bma_{key}"] == pytest.approx(direct[key], rel=1e-5, abs=1e-7), key
        assert metrics["eval_bma_nll"] != pytest.approx(metrics["eval_mean_nll"], rel=1e-3)
        out = trainer.predict(data, bma=True)
        # predict's float32 log-softmax of logits / T (|·| up to ~100 at T = 0.01) is off by a few
        # float32 ulps of that size: relative to p, 8 ulps of the largest tempered logit (6e-4 with
        # the noisy samples here), and at least the 1e-5 of smaller logits' other rounding
        rtol = max(1e-5, 8 * torch.finfo(torch.float32).eps * float(tempered.abs().max()))
        np.testing.assert_allclose(out.predictions, expected.exp().numpy(), rtol=rtol, atol=1e-7)


def test_predict_bma_runs_its_passes_in_chunks_with_the_same_numbers(tmp_path, monkeypatch):
    """predict(bma=True) held every batch's averaged log-probabilities (a causal LM's whole vocabulary,
    in float64) until the last sample's pass over the whole set. The passes now run chunk by chunk
    (``SAMPLE_PASS_CHUNK_BYTES``): at most one chunk's averages are alive, each sample is drawn once
    per chunk, and predictions and metrics are exactly those of one chunk."""
    from hf_evon.posterior import EVONPosterior
    from hf_evon.trainer import prediction, sampled_passes

    live, peak, draws = [0], [0], [0]

    class CountedLogMeanExp(prediction.LogMeanExp):
        def __init__(self) -> None:
            super().__init__()
            live[0] += 1
            peak[0] = max(peak[0], live[0])

        def __del__(self) -> None:
            live[0] -= 1

    sampled = EVONPosterior.sampled

    def counted_sampled(self, *args, **kwargs):
        draws[0] += 1
        return sampled(self, *args, **kwargs)

    monkeypatch.setattr(prediction, "LogMeanExp", CountedLogMeanExp)
    monkeypatch.setattr(EVONPosterior, "sampled", counted_sampled)
    trainer = _trained(tmp_path, tiny_gpt2, lm_data(16), lm_data(20, seed=1), bma_num_samples=3)
    test = lm_data(40, seed=2)  # batches of 16, 16, 8

    def run() -> tuple:
        peak[0] = draws[0] = 0
        out = trainer.predict(test, bma=True)
        return out, peak[0], draws[0]

    whole, whole_peak, whole_draws = run()
    assert (whole_peak, whole_draws) == (3, 3)  # one chunk: all 3 batches' averages, 3 samples drawn
    monkeypatch.setattr(sampled_passes, "SAMPLE_PASS_CHUNK_BYTES", 1)  # a chunk of one batch
    chunked, chunked_peak, chunked_draws = run()
    assert (chunked_peak, chunked_draws) == (1, 9)
    assert chunked.predictions.shape == (40, 12, 100)
    np.testing.assert_array_equal(chunked.predictions, whole.predictions)
    np.testing.assert_array_equal(chunked.label_ids, whole.label_ids)
    assert chunked.metrics.keys() == whole.metrics.keys()
    for key in ("test_bma_nll", "test_bma_perplexity"):
        assert chunked.metrics[key] == whole.metrics[key], key
    # one batch's inputs and averages in bytes: a budget of two batches makes chunks of 2 and 1
    batch_bytes = 16 * 12 * 8 * 3 + 16 * 12 * 100 * 8  # ids, mask, labels (int64); float64 log p̄
    monkeypatch.setattr(sampled_passes, "SAMPLE_PASS_CHUNK_BYTES", 2 * batch_bytes)
    pairs, pairs_peak, pairs_draws = run()
    assert (pairs_peak, pairs_draws) == (2, 6)
    np.testing.assert_array_equal(pairs.predictions, whole.predictions)


@pytest.mark.parametrize("world", [1, 2])
def test_predict_bma_over_processes_in_chunks_keeps_every_row_once(tmp_path, world):
    """With two processes the last global batch is padded with duplicates, which gather_for_metrics
    drops by where the loader stands. The chunked passes read later batches before they gather
    earlier ones, so each batch's kept rows are fixed when it is read: both chunkings return the 20
    rows once, in order, as the posterior's samples give them directly, and evaluate()'s BMA NLL is
    theirs. Processes whose first batches would size their chunks differently agree on one size
    (their gathers pair up in order), with the same predictions. predict_uncertainty's entropies
    come through the same gathers, each row once."""
    from launcher import torchrun

    torchrun(world, os.path.join(os.path.dirname(__file__), "bma_predict_worker.py"), str(tmp_path))
    saved = torch.load(tmp_path / "rank0.pt", weights_only=False)
    for key in ("whole", "chunked", "uneven"):
        out = saved[key]
        assert out.predictions.shape == (20, 3), key
        np.testing.assert_array_equal(out.label_ids, np.asarray(saved["labels"]))
        np.testing.assert_allclose(out.predictions, saved["direct"].numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(saved["chunked"].predictions, saved["whole"].predictions)
    np.testing.assert_array_equal(saved["uneven"].predictions, saved["whole"].predictions)
    assert saved["chunked"].metrics["test_bma_nll"] == saved["whole"].metrics["test_bma_nll"]
    labels = torch.tensor(saved["labels"])
    nll = -saved["direct"].log().gather(1, labels[:, None]).mean().item()  # the 20 rows, each once
    for key in ("evaluate", "evaluate_chunked"):
        assert saved[key]["eval_bma_nll"] == pytest.approx(nll, rel=1e-6), key
    for got, want in zip(saved["uncertainty"].predictions, saved["direct_uncertainty"], strict=True):
        assert got.shape == (20,)  # every row once: the duplicates padding the last batch dropped
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=ENTROPY_ATOL)


def _word_tokenizer(padding_side: str = "right"):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, 100)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        pad_token="<pad>", unk_token="<unk>", eos_token="<eos>", padding_side=padding_side,
    )  # fmt: skip


def _rows_of_many_lengths(n: int, labels: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, 100, (3 + int(torch.randint(0, 20, (1,), generator=gen)),), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": ids[1] % 3} if labels else {"input_ids": ids})
    return rows


def test_bma_passes_score_the_examples_the_mean_pass_scores_when_the_last_batch_is_dropped(tmp_path) -> None:
    # read by length, the BMA passes dropped the longest examples, the mean pass the last batch
    from datasets import Dataset
    from transformers import DataCollatorWithPadding

    trained = _trained(tmp_path)
    quiet = trained.current_posterior().with_ess(1e15)  # no noise to speak of: BMA is the mean
    args = config(tmp_path / "e", per_device_eval_batch_size=8, dataloader_drop_last=True)
    collator = DataCollatorWithPadding(_word_tokenizer())
    trainer = EVONTrainer(model=trained.model, args=args, posterior=quiet, data_collator=collator)
    metrics = trainer.evaluate(Dataset.from_list(_rows_of_many_lengths(20, labels=True)))
    assert metrics["eval_bma_nll"] == pytest.approx(metrics["eval_mean_nll"], rel=1e-6)
    assert metrics["eval_bma_accuracy"] == metrics["eval_mean_accuracy"]


def test_left_padded_batches_keep_the_dataset_order_in_bma_passes_and_calibration(tmp_path) -> None:
    # re-batched by length, a left-padded row's padding (and so its positions) changed
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling

    from hf_evon import calibrate_posterior

    rows = _rows_of_many_lengths(24, labels=False)
    collator = DataCollatorForLanguageModeling(_word_tokenizer("left"), mlm=False)
    trained = EVONTrainer(
        model=tiny_gpt2(), args=config(tmp_path, max_steps=2), train_dataset=Dataset.from_list(rows), data_collator=collator
    )
    trained.train()
    quiet = trained.current_posterior().with_ess(1e15)
    args = config(tmp_path / "e", per_device_eval_batch_size=5)
    trainer = EVONTrainer(model=trained.model, args=args, posterior=quiet, data_collator=collator)
    metrics = trainer.evaluate(Dataset.from_list(rows))
    assert metrics["eval_bma_nll"] == pytest.approx(metrics["eval_mean_nll"], rel=1e-6)
    result = trainer.calibrate(Dataset.from_list(rows[:12]), temperature=False, num_samples=2)
    in_order = [collator(rows[i : min(i + 5, 12)]) for i in range(0, 12, 5)]
    _, reference = calibrate_posterior(trained.model, quiet, in_order, num_samples=2, temperature=False, shift_labels=True)
    assert result.mean_nll == pytest.approx(reference.mean_nll, rel=1e-6)


@pytest.mark.parametrize("order_kept_by", ["left_padding", "drop_last"])
def test_bma_passes_over_a_length_grouped_eval_loader_batch_as_its_mean_pass(tmp_path, order_kept_by) -> None:
    """train_sampling_strategy="group_by_length" gives the eval loader a LengthGroupedSampler, whose
    shuffled order draws from its own generator on every read: the BMA passes read the loader again
    and got other batches than the mean pass (other left padding, other rows dropped), so a posterior
    without noise reported eval_bma_nll 4.5981 against eval_mean_nll 4.5839 on a left-padded LM."""
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling

    rows = _rows_of_many_lengths(24, labels=False)
    side, drop_last = ("left", False) if order_kept_by == "left_padding" else ("right", True)
    collator = DataCollatorForLanguageModeling(_word_tokenizer(side), mlm=False)
    trained = EVONTrainer(
        model=tiny_gpt2(), args=config(tmp_path, max_steps=2), train_dataset=Dataset.from_list(rows), data_collator=collator
    )
    trained.train()
    quiet = trained.current_posterior().with_ess(1e15)  # no noise to speak of: BMA is the mean
    args = config(
        tmp_path / "e", per_device_eval_batch_size=5, train_sampling_strategy="group_by_length",
        dataloader_drop_last=drop_last,
    )  # fmt: skip
    trainer = EVONTrainer(model=trained.model, args=args, posterior=quiet, data_collator=collator)
    for _ in range(2):  # each evaluation's passes read one order
        metrics = trainer.evaluate(Dataset.from_list(rows))
        assert metrics["eval_bma_nll"] == pytest.approx(metrics["eval_mean_nll"], rel=1e-6)


def _trained_masked_lm(tmp_path, **overrides) -> EVONTrainer:
    """A tiny BERT masked LM trained 2 steps without noise (so BMA is the mean), its train and eval
    set 24 rows of many lengths read through a collator that masks at random on every read."""
    from datasets import Dataset
    from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling

    tokenizer = _word_tokenizer()
    tokenizer.mask_token = "t99"
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.3)
    rows = Dataset.from_list(_rows_of_many_lengths(24, labels=False))
    torch.manual_seed(0)
    model = BertForMaskedLM(
        BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
    )  # fmt: skip
    args = config(tmp_path, max_steps=2, evon_ess=1e15, **overrides)  # no noise: BMA is the mean
    trainer = EVONTrainer(model=model, args=args, train_dataset=rows, eval_dataset=rows, data_collator=collator)
    trainer.train()
    return trainer


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (1, False), (1, True)])
def test_bma_passes_of_a_masked_lm_score_the_masks_its_mean_pass_scores(tmp_path, workers, persistent) -> None:
    """DataCollatorForLanguageModeling(mlm=True) masks at random on every read: the BMA passes, over
    the eval set sorted by length, scored other masked tokens than the mean pass, so a posterior
    without noise reported eval_bma_nll 4.6093 against eval_mean_nll 4.6212. A persistent worker's
    masks are not drawn again (its generator lives in the worker): 4.6164 against 4.6334 there."""
    trainer = _trained_masked_lm(
        tmp_path, dataloader_num_workers=workers, dataloader_persistent_workers=persistent
    )
    try:
        for _ in range(2):  # each evaluation draws its own masks, the same in each of its passes
            metrics = trainer.evaluate()
            assert metrics["eval_bma_nll"] == pytest.approx(metrics["eval_mean_nll"], rel=1e-6)
            assert metrics["eval_bma_accuracy"] == metrics["eval_mean_accuracy"]
    finally:
        stop_persistent_workers(trainer)


def test_posterior_metrics_of_a_masked_lm_score_the_same_masks_in_every_pass(tmp_path) -> None:
    """posterior_metrics(loader) read a masking collator's loader once for its mean pass and once per
    BMA pass, each read drawing other masks: a posterior without noise reported eval_bma_nll apart
    from eval_mean_nll. Every pass now reads the masks the first drew, as evaluate()'s do."""
    trainer = _trained_masked_lm(tmp_path)
    metrics = trainer.posterior_metrics(trainer.get_eval_dataloader())
    assert metrics["eval_bma_nll"] == pytest.approx(metrics["eval_mean_nll"], rel=1e-6)
    assert metrics["eval_bma_accuracy"] == metrics["eval_mean_accuracy"]


def test_bma_passes_during_training_leave_the_trained_weights_as_they_are_without_them(tmp_path) -> None:
    """The BMA passes read the eval set by another loader, whose read draws its workers' seed from
    torch's generator: training with dropout after an evaluation with BMA drew other masks than after
    one without, and ended at other weights (by up to 4.6e-3) as bma_eval_every varied."""
    from transformers import DataCollatorWithPadding

    weights = []
    for every in (1, 100):  # BMA at every evaluation, or at the last one only
        trainer = EVONTrainer(
            model=tiny_bert(dropout=0.1),
            args=config(tmp_path / str(every), max_steps=4, eval_strategy="steps", eval_steps=1, bma_eval_every=every),
            train_dataset=classification_data(),
            eval_dataset=_rows_of_many_lengths(20, labels=True),
            data_collator=DataCollatorWithPadding(_word_tokenizer()),
        )
        trainer.train()
        weights.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
    assert torch.equal(weights[0], weights[1])


def test_a_prompt_tuned_lm_is_scored_as_its_own_loss_scores_it(tmp_path):
    """PEFT's prompt tuning prepends virtual tokens: the logits are longer than the labels, and its
    loss scores every label, the first from the last virtual token. eval_mean_nll scored the labels
    against the virtual positions' logits, and eval_loss divided the loss by one item per row too few
    (as for a shifted count): both now equal the model's own loss and plain Trainer's eval_loss."""
    from peft import PromptTuningConfig, TaskType, get_peft_model
    from transformers import Trainer, TrainingArguments

    evaluation = lm_data(8, seed=1)
    losses = {}
    for kind in ("plain", "evon"):
        torch.manual_seed(0)
        model = get_peft_model(tiny_gpt2(), PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4))
        if kind == "plain":
            args = TrainingArguments(str(tmp_path / kind), report_to=[], use_cpu=True, per_device_eval_batch_size=8)
            losses[kind] = Trainer(model=model, args=args, eval_dataset=evaluation).evaluate()
        else:
            args = config(tmp_path / kind, bma_num_samples=0, per_device_eval_batch_size=8)
            losses[kind] = EVONTrainer(model=model, args=args, eval_dataset=evaluation).evaluate()
    model.eval()
    batch = {k: torch.tensor(v) for k, v in evaluation[:].items()}
    with torch.no_grad():
        own = model(**batch)
    assert own.logits.shape[1] == batch["labels"].shape[1] + 4
    assert losses["evon"]["eval_loss"] == pytest.approx(losses["plain"]["eval_loss"], rel=1e-6)
    assert losses["evon"]["eval_loss"] == pytest.approx(float(own.loss), rel=1e-6)
    assert losses["evon"]["eval_mean_nll"] == pytest.approx(float(own.loss), rel=1e-6)


def test_a_float64_lms_mean_nll_is_its_float64_nll(tmp_path):
    """A float64 causal LM's eval_mean_nll and eval_bma_nll are its NLLs computed in float64 (the
    metrics run in float64): its log-probabilities were taken in float32 (log_softmax(logits.float())),
    eval_mean_nll 4.587062248816857 for 4.587062246170191."""
    evaluation = lm_data(8, seed=1)
    trainer = _trained(tmp_path, make=lambda: tiny_gpt2().double(), train=lm_data(), evaluation=evaluation)
    metrics = trainer.evaluate()
    mean, bma, _ = _direct_bma(trainer.model, trainer.current_posterior(), evaluation, seeds=[3, 4], causal=True)
    assert metrics["eval_mean_nll"] == pytest.approx(mean, rel=1e-13, abs=0)
    assert metrics["eval_bma_nll"] == pytest.approx(bma, rel=1e-13, abs=0)


@pytest.mark.parametrize("nll, perplexity", [(3.0, math.exp(3.0)), (709.7, math.exp(709.7)), (801.0, math.inf),
                                              (math.inf, math.inf)])  # fmt: skip
def test_an_lms_perplexity_is_inf_where_exp_of_its_nll_overflows(nll, perplexity):
    """exp(min(nll, 700)) reported 1.01e304 for an NLL of 801 or inf (a label at a -inf logit)."""
    from hf_evon.trainer.evaluation import MetricAccumulator

    acc = MetricAccumulator.__new__(MetricAccumulator)
    acc.task, acc.outputs = "causal_lm", [(torch.tensor([[nll * 4, 4.0]], dtype=torch.float64), torch.empty(0))]
    assert acc.summary() == {"nll": nll, "perplexity": perplexity}


@pytest.mark.parametrize("task", ["classification", "token_classification"])
def test_an_evaluation_whose_labels_are_all_ignored_reports_nan(tmp_path, task):
    """Labels all -100 (nothing scored): evaluate() of a classifier raised 'no items to evaluate'
    and lost its eval_loss too, where a causal LM's reports NaN. Every class metric is NaN now, as
    the model's own mean loss is."""
    from datasets import Dataset
    from transformers import BertConfig, BertForTokenClassification

    from hf_evon import EVONPosterior, build_optimizer

    if task == "classification":
        model = tiny_bert()
    else:
        torch.manual_seed(0)
        model = BertForTokenClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                      num_attention_heads=2, intermediate_size=64, num_labels=4))  # fmt: skip
    ids = torch.randint(3, 100, (10, 6), generator=torch.Generator().manual_seed(0))
    labels = torch.full((10,) if task == "classification" else (10, 6), -100)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
    posterior = EVONPosterior.from_optimizer(build_optimizer(model), model)
    trainer = EVONTrainer(model=model, args=config(tmp_path, bma_num_samples=2), posterior=posterior, eval_dataset=data)
    metrics = trainer.evaluate()
    keys = [f"eval_{kind}_{m}" for kind in ("mean", "bma") for m in ("nll", "accuracy", "ece", "brier")]
    assert all(math.isnan(metrics[key]) for key in ["eval_loss", *keys])
    predicted = trainer.predict(data, bma=True).metrics
    assert all(math.isnan(predicted[f"test_bma_{m}"]) for m in ("nll", "accuracy", "ece", "brier"))


def test_predict_bma_gives_compute_metrics_the_inputs_include_for_metrics_asks_for(tmp_path):
    """include_for_metrics=["inputs"]: predict() handed compute_metrics the inputs and
    predict(bma=True) handed it None; "loss", which BMA has no per-batch value of, is refused by name."""
    seen = []

    def compute_metrics(p):  # noqa: ANN001, ANN202
        seen.append(p.inputs)
        return {"rows": float(len(p.label_ids))}

    test = classification_data(40, seed=2)  # batches of 16, 16, 8: the inputs padded across them
    trainer = _trained(tmp_path, bma_num_samples=2, include_for_metrics=["inputs"])
    trainer.compute_metrics = compute_metrics
    trainer.predict(test)
    out = trainer.predict(test, bma=True)
    assert out.metrics["test_rows"] == 40.0
    assert seen[1] is not None and np.array_equal(seen[1], seen[0])
    trainer.args.include_for_metrics = ["inputs", "loss"]
    with pytest.raises(ValueError, match=r"include_for_metrics=\['loss'\]"):
        trainer.predict(test, bma=True)


def test_predict_bma_reads_labels_of_a_forward_that_names_none(tmp_path):
    """A forward taking ``**batch`` names no label, so transformers' ``label_names`` is empty:
    ``predict(bma=True)`` returned no label_ids and no test_bma_* metrics where ``evaluate()``
    reports eval_bma_* from the batch's ``labels``."""
    nn = torch.nn

    class Net(_EmbeddingHead):
        def forward(self, **batch):  # noqa: ANN003, ANN201
            logits = self.head(self.emb(batch["input_ids"]).flatten(1))
            out = {"logits": logits}
            if batch.get("labels") is not None:
                out["loss"] = nn.functional.cross_entropy(logits, batch["labels"])
            return out

    held_out = classification_data(16, seed=3)
    trainer = EVONTrainer(
        model=Net(),
        args=config(tmp_path, max_steps=3, remove_unused_columns=False, bma_num_samples=2),
        train_dataset=classification_data(48),
        eval_dataset=held_out,
    )
    assert trainer.label_names == []
    trainer.train()
    out = trainer.predict(held_out, bma=True)
    assert np.array_equal(out.label_ids, np.asarray(held_out["labels"]))
    evaluated = trainer.evaluate()
    assert out.metrics["test_bma_nll"] == pytest.approx(evaluated["eval_bma_nll"], rel=1e-6)


def test_predict_bma_converts_its_predictions_to_numpy_once(tmp_path, monkeypatch):
    """compute_metrics reads the arrays predict(bma=True) returns: each gathered tensor is copied to
    the host and converted once (the predictions and labels were converted for compute_metrics and
    again for the output: a second device-to-host copy of the whole set on an accelerator)."""
    seen = []

    def compute_metrics(p):  # noqa: ANN001, ANN202
        seen.append(p)
        return {"rows": float(len(p.label_ids))}

    trainer = _trained(tmp_path, bma_num_samples=2)
    trainer.compute_metrics = compute_metrics
    converted = []
    numpy = torch.Tensor.numpy

    def counted(tensor, *args, **kwargs):  # noqa: ANN001, ANN202
        converted.append((tensor.data_ptr(), tuple(tensor.shape)))
        return numpy(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "numpy", counted)
    out = trainer.predict(classification_data(40, seed=2), bma=True)
    assert [c for c, n in collections.Counter(converted).items() if n > 1] == []
    assert out.predictions is seen[0].predictions and out.label_ids is seen[0].label_ids
    assert out.predictions.shape == (40, 3) and out.metrics["test_rows"] == 40.0


def test_the_evon_passes_give_the_model_what_its_forward_takes(tmp_path):
    """A custom ``compute_loss`` takes entries out of the batch before the forward (the labels of a
    model whose ``forward`` has no ``labels``, per-example weights), so the Trainer's pass runs; the
    BMA passes of ``evaluate()`` and ``predict(bma=True)`` raised TypeError (``forward() got an
    unexpected keyword argument 'labels'``), and the calibration one for ``'weight'``. They give the
    forward the entries it takes and score the labels, as on the batch without the others."""
    from transformers.modeling_outputs import SequenceClassifierOutput

    from hf_evon.predictive.metrics import calibration_metrics

    nn = torch.nn

    class Net(_EmbeddingHead):
        def forward(self, input_ids):  # noqa: ANN001, ANN201
            return SequenceClassifierOutput(logits=self.head(self.emb(input_ids).flatten(1)))

    class Weighted(EVONTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
            labels, weight = inputs.pop("labels"), inputs.pop("weight")
            outputs = model(**inputs)
            loss = (nn.functional.cross_entropy(outputs.logits, labels, reduction="none") * weight).mean()
            return (loss, outputs) if return_outputs else loss

    def weighted(data):  # noqa: ANN001, ANN202
        return data.map(lambda row: {"weight": 1.0})

    held_out = classification_data(16, seed=3)
    args = config(tmp_path, max_steps=3, remove_unused_columns=False, label_names=["labels"], bma_num_samples=2, bma_seed=3)
    trainer = Weighted(
        model=Net(), args=args, train_dataset=weighted(classification_data(48)), eval_dataset=weighted(held_out)
    )
    trainer.train()
    expected = _averaged_softmax(trainer, {"input_ids": torch.tensor(held_out["input_ids"])}, (3, 4))
    reference = calibration_metrics(expected.log(), torch.tensor(held_out["labels"]), "log_probs", n_bins=15)
    metrics = trainer.evaluate()
    for key in ("nll", "accuracy", "ece", "brier"):
        assert metrics[f"eval_bma_{key}"] == pytest.approx(reference[key], rel=1e-6, abs=1e-9), key
    out = trainer.predict(weighted(held_out), bma=True)
    np.testing.assert_allclose(out.predictions, expected.numpy(), rtol=1e-5, atol=1e-7)
    assert trainer.calibrate(weighted(classification_data(16, seed=5)), grid=(0.5,)).num_targets == 16


def test_predict_bma_honours_prediction_loss_only(tmp_path):
    """``prediction_loss_only=True``: ``Trainer.predict`` returns no predictions and no labels and
    calls neither ``preprocess_logits_for_metrics`` nor ``compute_metrics``; predict(bma=True)
    gathered and returned the averaged probabilities, the labels, and scored them anyway. Its
    ``test_bma_*`` metrics (the BMA's losses) stay those of a run without the flag."""
    calls = []

    def compute_metrics(p):  # noqa: ANN001, ANN202
        calls.append("compute_metrics")
        return {"rows": float(len(p.label_ids))}

    def preprocess(probs, labels):  # noqa: ANN001, ANN202
        calls.append("preprocess")
        return probs

    trainer = _trained(tmp_path, bma_num_samples=2)
    trainer.compute_metrics, trainer.preprocess_logits_for_metrics = compute_metrics, preprocess
    test = classification_data(40, seed=2)
    full = trainer.predict(test, bma=True)
    assert calls == ["preprocess"] * 3 + ["compute_metrics"]
    calls.clear()
    trainer.args.prediction_loss_only = True
    plain, bma = trainer.predict(test), trainer.predict(test, bma=True)
    assert plain.predictions is None and plain.label_ids is None
    assert type(bma.predictions) is type(bma.label_ids) is type(None)
    assert calls == []
    assert "test_rows" not in bma.metrics
    keys = [f"test_bma_{m}" for m in ("nll", "accuracy", "ece", "brier")]
    assert [bma.metrics[k] for k in keys] == [full.metrics[k] for k in keys]


def test_predict_uncertainty_returns_its_arrays_under_prediction_loss_only(tmp_path):
    """predict_uncertainty() is called for its arrays, so ``prediction_loss_only`` (which empties
    ``predict``'s and ``predict(bma=True)``'s predictions, as ``Trainer.predict``'s) leaves them and the
    labels as they are without it, and the same ``test_bma_*`` metrics."""
    trainer = _trained(tmp_path, bma_num_samples=2)
    test = classification_data(40, seed=2)
    full = trainer.predict_uncertainty(test)
    trainer.args.prediction_loss_only = True
    assert trainer.predict(test, bma=True).predictions is None
    out = trainer.predict_uncertainty(test)
    assert isinstance(out.predictions, PredictiveUncertainty)
    for got, want in zip(out.predictions, full.predictions, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(out.label_ids, np.asarray(test["labels"]))
    assert _without_runtime(out.metrics) == _without_runtime(full.metrics)


def test_evaluate_bma_true_snapshots_the_posterior_once(tmp_path, monkeypatch):
    """``evaluate(bma=True)`` took two snapshots of the optimizer's posterior (a copy of every factor
    each): one to check that there is one, one for the BMA passes. One now, with the same metrics
    as the BMA passes over the one posterior (``posterior_metrics``, the same seeds)."""
    from hf_evon import EVONPosterior

    trainer = _trained(tmp_path, bma_num_samples=3)
    alone = trainer.posterior_metrics(trainer.get_eval_dataloader())
    taken = []
    snapshot = EVONPosterior.from_optimizer.__func__

    def counted(cls, *args, **kwargs):
        taken.append(1)
        return snapshot(cls, *args, **kwargs)

    monkeypatch.setattr(EVONPosterior, "from_optimizer", classmethod(counted))
    metrics = trainer.evaluate(bma=True)
    assert len(taken) == 1
    for key in ("eval_bma_nll", "eval_bma_accuracy", "eval_bma_ece", "eval_bma_brier"):
        assert metrics[key] == pytest.approx(alone[key], rel=1e-12, abs=1e-15), key


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_the_posterior_metrics_copy_to_the_host_once_per_evaluation(tmp_path, monkeypatch, kind):
    """The mean metrics (read in the Trainer's pass) and the BMA ones copied every batch's gathered
    log-probabilities (and labels) to the host as it came: on a GPU a host sync per batch, in the
    Trainer's pass too. They stay on the device until the summary now: one copy per field and
    metric set (a classifier's log-probabilities and labels, an LM's NLL sums), with the same
    metrics as the stand-alone computation."""
    if kind == "bert":
        trainer, fields = _trained(tmp_path), 2  # 3 batches
    else:
        trainer, fields = _trained(tmp_path, tiny_gpt2, lm_data(16), lm_data(20, seed=1)), 1  # 2 batches
    alone = trainer.posterior_metrics(trainer.get_eval_dataloader())
    copies = [0]
    to_host = torch.Tensor.cpu
    here = os.path.join("hf_evon", "trainer", "evaluation.py")

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN202
        copies[0] += sys._getframe(1).f_code.co_filename.endswith(here) and self.numel() > 0  # an LM has no labels
        return to_host(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    metrics = trainer.evaluate(bma=True)
    assert copies[0] == 2 * fields  # the mean's and the BMA's metric sets
    for key, value in alone.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_predict_bma_joins_the_batches_once_as_nested_concat_would(tmp_path, monkeypatch):
    """``predict(bma=True)`` and ``predict_uncertainty`` joined each batch to the ones before it
    (``nested_concat``, batch after batch): every earlier batch copied again at each batch, an LM's
    probabilities most of the time of a large set. One join now, to the same arrays: each batch
    padded with -100 to the longest, as folding the per-batch arrays with ``nested_concat`` gives."""
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling
    from transformers.trainer_pt_utils import nested_concat

    from hf_evon.trainer import prediction

    trained = _trained(tmp_path, tiny_gpt2, lm_data(16), lm_data(8, seed=1))
    rows = [{"input_ids": r["input_ids"]} for r in _rows_of_many_lengths(10, labels=False)]
    collator = DataCollatorForLanguageModeling(_word_tokenizer(), mlm=False)

    def trainer(concat: bool) -> EVONTrainer:
        args = config(tmp_path / str(concat), per_device_eval_batch_size=4, bma_num_samples=2, eval_do_concat_batches=concat)
        return EVONTrainer(model=trained.model, args=args, posterior=trained.current_posterior(), data_collator=collator)

    joins = [0]

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        joins[0] += 1
        return nested_concat(*args, **kwargs)

    monkeypatch.setattr(prediction, "nested_concat", counted, raising=False)
    test = Dataset.from_list(rows)  # batches of 4, 4 and 2 rows, each padded to its own longest
    out, by_batch = trainer(True).predict(test, bma=True), trainer(False).predict(test, bma=True)
    u, u_by_batch = trainer(True).predict_uncertainty(test), trainer(False).predict_uncertainty(test)
    assert joins[0] == 0
    widths = {p.shape[1] for p in by_batch.predictions}
    assert len(by_batch.predictions) == 3 and len(widths) > 1  # ragged: the join pads

    def folded(parts):  # noqa: ANN001, ANN202
        total = parts[0]
        for part in parts[1:]:
            total = nested_concat(total, part, padding_index=-100)
        return total

    for joined, parts in [(out.predictions, by_batch.predictions), (out.label_ids, by_batch.label_ids)]:
        expected = folded(parts)
        assert joined.dtype == expected.dtype and np.array_equal(joined, expected)
    for field in ("total", "aleatoric", "epistemic"):
        assert np.array_equal(getattr(u.predictions, field), folded(getattr(u_by_batch.predictions, field)))


@pytest.mark.parametrize("task", ["classification", "token_classification", "causal_lm"])
def test_a_summarised_metric_accumulator_holds_one_host_copy(tmp_path, task):
    """The accumulators keep each batch on its device until the summary; an evaluation whose BMA
    passes wait for the end of training (``bma_eval_every``) kept its mean accumulator's batches
    there until the next evaluation, through the training steps between. The summary joins them on
    the host and keeps that one copy, and a second summary gives the same metrics."""
    from hf_evon.trainer.evaluation import MetricAccumulator

    trainer = _trained(tmp_path, max_steps=1)
    acc = MetricAccumulator(trainer, task)
    g = torch.Generator().manual_seed(0)
    for width in (5, 7, 6):  # token batches of different lengths
        labels = torch.randint(0, 3, (4,) if task == "classification" else (4, width), generator=g)
        labels[0, ...] = -100
        shape = (4, 3) if task == "classification" else (4, width, 3)
        logp = torch.log_softmax(torch.randn(shape, generator=g, dtype=torch.float64), -1)
        if task == "causal_lm":
            logp = logp.gather(-1, labels[:, 1:].clamp(min=0)[..., None]).squeeze(-1)
        acc.add(logp, labels)
    first = acc.summary()
    assert len(acc.outputs) == 1 and all(t.device.type == "cpu" for t in acc.outputs[0])
    assert acc.summary() == first


def _qa_data(n: int, seed: int):
    from datasets import Dataset

    ids = torch.randint(3, 100, (n, 8), generator=torch.Generator().manual_seed(seed))
    return Dataset.from_dict(
        {"input_ids": ids.tolist(), "start_positions": (ids[:, 0] % 4).tolist(), "end_positions": (4 + ids[:, 1] % 4).tolist()}
    )


def _tiny_qa() -> torch.nn.Module:
    from transformers import BertConfig, BertForQuestionAnswering

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    return BertForQuestionAnswering(config)


def test_evaluate_of_extractive_qa_warns_once_naming_its_label_names(tmp_path, monkeypatch):
    """An extractive QA model's batches carry two label tensors (``start_positions``,
    ``end_positions``), which the mean/BMA metrics (one class label tensor against one logits
    tensor) do not score: evaluate() returned no eval_mean_*/eval_bma_* metrics and said nothing.
    It warns once per trainer, naming the label names; the model's own eval_loss stays."""
    import hf_evon.trainer.evaluation as evaluation

    trainer = _trained(tmp_path, _tiny_qa, _qa_data(32, 0), _qa_data(16, 1), eval_strategy="no")
    warned: list[str] = []
    monkeypatch.setattr(evaluation.logger, "warning", lambda message, *a, **k: warned.append(message))
    for _ in range(2):
        metrics = trainer.evaluate()
        assert "eval_loss" in metrics and not any("_mean_" in k or "_bma_" in k for k in metrics), metrics
    assert len(warned) == 1 and "['start_positions', 'end_positions']" in warned[0], warned
    assert "eval_mean_" in warned[0]


def test_a_calibration_of_extractive_qa_names_its_several_label_tensors(tmp_path):
    """A calibration split (or calibrate(dataset)) of extractive QA batches was refused as having "no
    'labels'" though they hold the trainer's two label tensors; the refusal names them, before training."""
    message = "label_names = ['start_positions', 'end_positions'] are several (extractive QA's start and end positions)"
    trainer = EVONTrainer(model=_tiny_qa(), args=config(tmp_path / "split", max_steps=1),
                          train_dataset=_qa_data(16, 0), calibration_dataset=_qa_data(6, 2))  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer.train()
    assert trainer.state.global_step == 0
    trainer = _trained(tmp_path / "called", _tiny_qa, _qa_data(16, 0), _qa_data(8, 1), eval_strategy="no")
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer.calibrate(_qa_data(6, 2))


def test_evaluate_of_one_label_tensor_against_several_distributions_is_refused_by_name(tmp_path, monkeypatch):
    """One label tensor (``label_names=["start_positions"]``) against an output of several
    distributions (``start_logits``, ``end_logits``, no ``logits``): evaluate() raised AttributeError
    ('tuple' object has no attribute 'shape') in the mean pass, losing the Trainer's own metrics.
    It skips the mean/BMA metrics with one warning saying so (2 distributions against one label
    tensor), and evaluate(bma=True) raises a ValueError saying it; the model's eval_loss stays."""
    import hf_evon.trainer.evaluation as evaluation

    trainer = _trained(
        tmp_path, _tiny_qa, _qa_data(32, 0), _qa_data(16, 1), eval_strategy="no", label_names=["start_positions"]
    )
    warned: list[str] = []
    monkeypatch.setattr(evaluation.logger, "warning", lambda message, *a, **k: warned.append(message))
    for _ in range(2):
        metrics = trainer.evaluate()
        assert "eval_loss" in metrics and not any("_mean_" in k or "_bma_" in k for k in metrics), metrics
    assert len(warned) == 1 and "2 distributions" in warned[0] and "eval_mean_" in warned[0], warned
    with pytest.raises(ValueError, match=r"^evaluate\(bma=True\): .*2 distributions"):
        trainer.evaluate(bma=True)


@pytest.mark.parametrize("kind", ["unlabelled", "qa"])
def test_evaluate_bma_true_refuses_batches_it_cannot_score_before_any_forward(tmp_path, kind):
    """evaluate(bma=True) of a set without labels raised its ValueError only after the first batch's
    forward; one of extractive QA batches (two label tensors) returned no eval_bma_* and said nothing.
    Both raise before any forward, naming the label names, and leave no evaluation behind."""
    if kind == "unlabelled":
        trainer = _trained(tmp_path, max_steps=1)
        dev, names, why = classification_data(16, seed=1).remove_columns("labels"), "['labels']", "no labels"
    else:
        trainer = _trained(tmp_path, _tiny_qa, _qa_data(32, 0), _qa_data(16, 1), max_steps=1, eval_strategy="no")
        dev, names, why = _qa_data(16, 1), "['start_positions', 'end_positions']", "several label tensors"
    calls = count_forwards(trainer.model)
    with pytest.raises(ValueError, match=rf"^evaluate\(bma=True\): .*{why}.*{names}".replace("[", r"\[")):
        trainer.evaluate(dev, bma=True)
    assert calls[0] == 0
    assert not trainer._evon_in_evaluate and not trainer._evon_bma_asked and trainer._evon_evaluation is None


def test_evaluate_of_a_regression_warns_once_and_bma_true_is_refused(tmp_path, monkeypatch):
    """A regression's outputs are no class distribution for the mean/BMA metrics: every evaluate()
    logged the same warning again, and evaluate(bma=True), which asks for eval_bma_*, returned none
    and raised nothing. The warning comes once per trainer; evaluate(bma=True) raises a ValueError
    naming the logits' and labels' shapes, and leaves no evaluation behind."""
    from datasets import Dataset

    import hf_evon.trainer.evaluation as evaluation

    def data(n: int, seed: int) -> Dataset:
        ids = torch.randint(3, 100, (n, 8), generator=torch.Generator().manual_seed(seed))
        return Dataset.from_dict({"input_ids": ids.tolist(), "labels": (ids[:, 1].double() / 100).tolist()})

    def make() -> torch.nn.Module:
        model = tiny_bert(num_labels=1)
        model.config.problem_type = "regression"
        return model

    trainer = _trained(tmp_path, make, data(32, 0), data(16, 1), eval_strategy="no", max_steps=1)
    warned: list[str] = []
    monkeypatch.setattr(evaluation.logger, "warning", lambda message, *a, **k: warned.append(message))
    for _ in range(2):
        metrics = trainer.evaluate()
        assert "eval_loss" in metrics and not any("_mean_" in k or "_bma_" in k for k in metrics), metrics
    assert len(warned) == 1 and "logits (16, 1) and labels (16,)" in warned[0], warned
    with pytest.raises(ValueError, match=r"^evaluate\(bma=True\): .*logits \(16, 1\) and labels \(16,\)"):
        trainer.evaluate(bma=True)
    assert not trainer._evon_in_evaluate and not trainer._evon_bma_asked and trainer._evon_evaluation is None


@pytest.mark.parametrize("problem", ["multi_label", "regression", "regression_of_one_column"])
def test_evaluating_a_model_without_class_logits_runs_no_pass_beyond_the_trainers(tmp_path, monkeypatch, problem):
    """A multi-label classifier's logits (16, 3) against float labels (16, 3), or a regression's (16, 1)
    against labels (16, 1), are no class distribution, but evaluate() took such a batch for one whose
    forward gave nothing to read and ran one more forward at the mean to find that out (every
    evaluate(), and each under prediction_loss_only). The batch's own forward decides it: evaluate() and
    predict() run the forwards a plain Trainer runs on the same model and data, and warn as before."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    import hf_evon.trainer.evaluation as evaluation

    outputs = 3 if problem == "multi_label" else 1
    shown = {"multi_label": "(16, 3)", "regression": "(16,)", "regression_of_one_column": "(16, 1)"}[problem]

    def data(n: int, seed: int) -> Dataset:
        ids = torch.randint(3, 100, (n, 8), generator=torch.Generator().manual_seed(seed))
        labels = ids[:, 1:4] % 2 if problem == "multi_label" else ids[:, 1:2] / 100
        labels = labels.squeeze(-1) if problem == "regression" else labels
        return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.float().tolist()})

    def scored(prediction) -> dict[str, float]:  # noqa: ANN001
        return {"rows": float(len(prediction.predictions))}

    dev = data(40, 1)  # batches of 16: three
    trainer = _trained(tmp_path, lambda: tiny_bert(num_labels=outputs), data(16, 0), dev, eval_strategy="no", max_steps=1)
    expected_problem = "multi_label_classification" if problem == "multi_label" else "regression"
    assert trainer.model.config.problem_type == expected_problem  # inferred by transformers from the labels
    warned: list[str] = []
    monkeypatch.setattr(evaluation.logger, "warning", lambda message, *a, **k: warned.append(message))
    calls = count_forwards(trainer.model)

    def forwards(runner, call: str = "evaluate", **settings) -> int:  # noqa: ANN001
        """The forwards of ``runner.<call>()`` (``predict``: of ``dev``), under the args ``settings``."""
        before = calls[0]
        with monkeypatch.context() as patched:
            for name, value in settings.items():
                patched.setattr(runner.args, name, value)
            runner.predict(dev) if call == "predict" else runner.evaluate()
        return calls[0] - before

    plain = Trainer(
        model=trainer.model, eval_dataset=dev, compute_metrics=scored,
        args=TrainingArguments(str(tmp_path / "plain"), per_device_eval_batch_size=16, use_cpu=True, report_to="none"),
    )  # fmt: skip
    expected = forwards(plain)
    assert expected == forwards(plain, "predict") == forwards(plain, prediction_loss_only=True)
    counts = {"evaluate, loss only": forwards(trainer)}  # no compute_metrics: the Trainer's loss-only loop
    trainer.compute_metrics = scored
    counts["evaluate"] = forwards(trainer)
    counts["evaluate, prediction_loss_only"] = forwards(trainer, prediction_loss_only=True)
    counts["predict"] = forwards(trainer, "predict")
    assert counts == dict.fromkeys(counts, expected)
    assert len(warned) == 1 and f"logits (16, {outputs}) and labels {shown}" in warned[0], warned
    assert f"problem_type '{expected_problem}' has no softmax" in warned[0]


@pytest.mark.parametrize("labelled", [True, False])
def test_posterior_metrics_refuses_batches_it_cannot_score_before_any_forward(tmp_path, labelled):
    """posterior_metrics() of extractive QA batches (two label tensors) or of unlabelled ones
    returned {} and said nothing, where evaluate(bma=True) refuses them. Asked for by name, it
    raises the same ValueError, naming the call and the label names, before any forward."""
    trainer = _trained(tmp_path, _tiny_qa, _qa_data(32, 0), _qa_data(16, 1), max_steps=1, eval_strategy="no")
    dev = _qa_data(16, 1)
    if not labelled:
        dev = dev.remove_columns(["start_positions", "end_positions"])
    why = "several label tensors" if labelled else "no labels"
    calls = count_forwards(trainer.model)
    names = r"\['start_positions', 'end_positions'\]"
    with pytest.raises(ValueError, match=rf"^posterior_metrics\(\): .*{why}.*{names}"):
        trainer.posterior_metrics(trainer.get_eval_dataloader(dev))
    assert calls[0] == 0


class _SetPredictor(torch.nn.Module):
    """A stand-in for Mask2Former: its one label name, ``class_labels``, holds a list of tensors, one per
    example and each of its own length (the classes of its objects)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(100, 8), torch.nn.Linear(8, 3)

    def forward(self, input_ids, class_labels=None):  # noqa: ANN001, ANN201
        logits = self.head(self.embed(input_ids))
        losses = [torch.nn.functional.cross_entropy(x[: len(c)], c) for x, c in zip(logits, class_labels or [])]
        return {"loss": torch.stack(losses).mean() if losses else None, "logits": logits}


def test_a_list_of_label_tensors_under_one_label_name_is_named_as_such(tmp_path):
    """One label name holding a list of tensors (Mask2Former's ``class_labels``) was refused as "several
    label tensors (['class_labels']), not one": it names what the batch holds, a list of 16 tensors under
    that one name."""
    from datasets import Dataset

    def data(n: int, seed: int) -> Dataset:
        ids = torch.randint(3, 100, (n, 8), generator=torch.Generator().manual_seed(seed))
        return Dataset.from_dict({"input_ids": ids.tolist(), "class_labels": [[i % 3] * (1 + i % 4) for i in range(n)]})

    def collate(rows: list[dict]) -> dict:
        return {
            "input_ids": torch.tensor([r["input_ids"] for r in rows]),
            "class_labels": [torch.tensor(r["class_labels"]) for r in rows],
        }

    args = config(tmp_path, max_steps=1, evon_ess=60.0, bma_num_samples=2, label_names=["class_labels"])
    trainer = EVONTrainer(model=_SetPredictor(), args=args, train_dataset=data(16, 0), data_collator=collate)
    trainer.train()
    calls = count_forwards(trainer.model)
    with pytest.raises(ValueError, match=r"a list of 16 tensors under one label name \(\['class_labels'\]\)") as err:
        trainer.evaluate(data(16, 1), bma=True)
    assert "several" not in str(err.value) and calls[0] == 0


class _OneTrial:
    """A search backend running one trial as optuna's does when training evaluates nothing: train,
    evaluate, score the metrics with the search's ``compute_objective``."""

    name = "one_trial"

    def ensure_available(self) -> None:
        pass

    def default_hp_space(self, trial):  # noqa: ANN001, ANN201
        return {}

    def run(self, trainer, n_trials, direction, **kwargs):  # noqa: ANN001, ANN003, ANN201
        trainer.train()
        metrics = trainer.evaluate()
        return metrics, trainer.compute_objective(metrics)


def _user_metrics(prediction) -> dict[str, float]:  # noqa: ANN001
    predicted = np.argmax(prediction.predictions, -1)
    return {"first_class": float((predicted == 0).mean()), "agreement": float((predicted == prediction.label_ids).mean())}


@pytest.mark.parametrize("compute_metrics", [None, _user_metrics])
def test_hyperparameter_searchs_default_objective_is_the_one_a_plain_trainer_searches_on(
    tmp_path, monkeypatch, compute_metrics
):
    """The default objective (transformers' default_compute_objective: eval_loss, or the sum of the
    compute_metrics values) also summed EVON's eval_mean_*/eval_bma_* metrics, accuracies among
    NLLs, so a search minimised a mixture; it scores the subclass's metrics alone."""
    import transformers.trainer
    from transformers.trainer_utils import HPSearchBackend

    monkeypatch.setitem(transformers.trainer.ALL_HYPERPARAMETER_SEARCH_BACKENDS, HPSearchBackend.OPTUNA, _OneTrial)
    trainer = EVONTrainer(
        model_init=lambda: tiny_bert(), args=config(tmp_path, max_steps=2, bma_num_samples=2, evon_ess=60.0),
        train_dataset=classification_data(), eval_dataset=classification_data(16, seed=1), compute_metrics=compute_metrics,
    )  # fmt: skip
    metrics, objective = trainer.hyperparameter_search(backend="optuna", n_trials=1)
    assert "eval_bma_nll" in metrics and "eval_mean_accuracy" in metrics
    if compute_metrics is None:
        assert objective == metrics["eval_loss"]
    else:
        assert objective == metrics["eval_first_class"] + metrics["eval_agreement"]


@pytest.mark.parametrize("problem", ["multi_label_classification", "regression"])
def test_a_multi_label_or_regression_models_refused_bma_metrics_and_uncertainty_name_its_problem_type(tmp_path, problem):
    """evaluate(bma=True) refused a multi-label model for want of "class logits", naming its logits
    (16, 3), which are a 3-label classifier's; predict_uncertainty named a "kind 'sigmoid'" of its
    own. Both now name the config's problem_type, what the user set or transformers inferred; a
    regression's predict_uncertainty is its outputs' mean and spread."""
    outputs = 3 if problem == "multi_label_classification" else 1

    def data(n: int, seed: int):
        from datasets import Dataset

        ids = torch.randint(3, 100, (n, 8), generator=torch.Generator().manual_seed(seed))
        labels = ids[:, 1:4] % 2 if outputs == 3 else ids[:, 1] / 100
        return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.float().tolist()})

    trainer = _trained(tmp_path, lambda: tiny_bert(num_labels=outputs), data(16, 0), data(16, 1), eval_strategy="no")
    assert trainer.model.config.problem_type == problem  # inferred by transformers from the labels
    named = rf"problem_type '{problem}'"
    with pytest.raises(ValueError, match=rf"^evaluate\(bma=True\): .*{named}"):
        trainer.evaluate(bma=True)
    if problem == "regression":
        from hf_evon.predictive.uncertainty import PredictiveSpread

        assert isinstance(trainer.predict_uncertainty(data(8, 2)).predictions, PredictiveSpread)
        return
    with pytest.raises(ValueError, match=rf"^predict_uncertainty .*{named}"):
        trainer.predict_uncertainty(data(8, 2))


@pytest.fixture(scope="module")
def token_bma_runs(tmp_path_factory):
    """What each rank of token_bma_worker.py saved, by world size: the worker is launched once per
    world size for the token classifier's test and the question answerer's (a launch's start, not its
    two trainings, is most of its time)."""
    from launcher import rank_results

    runs: dict[int, list[dict]] = {}

    def saved(world: int) -> list[dict]:
        if world not in runs:
            out = str(tmp_path_factory.mktemp(f"token_bma{world}"))
            runs[world] = rank_results(world, os.path.join(os.path.dirname(__file__), "token_bma_worker.py"), out)
        return runs[world]

    return saved


@pytest.mark.parametrize("world", [1, 2])
def test_predict_bma_of_a_token_classifier_over_processes_pads_what_preprocess_logits_for_metrics_returns(
    token_bma_runs, world
):
    """A token classifier's preprocess_logits_for_metrics keeps the argmax, (B, T): predict(bma=True)
    padded only three-dimensional outputs across processes, so two processes whose batches were
    padded to other lengths gathered tensors of other widths, and gloo aborted rank 0
    ("terminate called after throwing an instance of 'gloo::EnforceNotMet'"), where Trainer.predict
    pads them. Each process's output is padded to the longest now: every sentence's labelled tokens
    get the argmax of their BMA probabilities, the rest -100 or a class."""
    for saved in token_bma_runs(world):
        probabilities, argmax = saved["probabilities"], saved["argmax"]
        labels = probabilities.label_ids
        assert labels.shape == (10, 13) and argmax.predictions.shape == labels.shape
        np.testing.assert_array_equal(argmax.label_ids, labels)
        scored = labels != -100
        np.testing.assert_array_equal(argmax.predictions[scored], probabilities.predictions.argmax(-1)[scored])


@pytest.mark.parametrize("world", [1, 2])
def test_predict_bma_of_a_question_answerer_over_processes_pads_its_start_and_end_probabilities(token_bma_runs, world):
    """A question answerer's BMA start and end probabilities are (B, T) each: predict(bma=True) padded
    only three-dimensional outputs across processes, so two processes whose batches were padded to
    other lengths gathered tensors of other widths, and gloo aborted rank 0 ("terminate called after
    throwing an instance of 'gloo::EnforceNotMet'"), where Trainer.predict pads them. Each row is now
    padded with -100 to the longest: the rest of it is its batch's distribution over positions."""
    from token_bma_worker import answers as worker_answers

    for saved in token_bma_runs(world):
        answers = saved["answers"]
        for probabilities in answers.predictions:
            assert probabilities.shape == (10, 13)
            kept = probabilities != -100
            np.testing.assert_allclose(np.where(kept, probabilities, 0.0).sum(-1), np.ones(10), rtol=1e-5)
            assert kept.all(-1).sum() >= 2  # the longest sentence's batch: no padding
        np.testing.assert_array_equal(answers.label_ids[1], [a["end_positions"] for a in worker_answers(10, 1)])


def test_predict_bma_refuses_a_segmentation_model_whose_classes_are_not_its_logits_last_dimension(tmp_path):
    """A semantic segmentation model's logits are (B, classes, H, W): predict(bma=True) and
    predict_uncertainty averaged a softmax over the last dimension, the image's width, and returned
    rows that sum to 1 across pixels, not across classes, without a word. Both refuse it now, naming
    the model class, before any pass."""
    from datasets import Dataset
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    from hf_evon import EVONPosterior, build_optimizer

    torch.manual_seed(0)
    model = SegformerForSemanticSegmentation(SegformerConfig(
        num_encoder_blocks=1, depths=[1], sr_ratios=[1], hidden_sizes=[16], patch_sizes=[3], strides=[2],
        num_attention_heads=[1], mlp_ratios=[2], decoder_hidden_size=16, num_labels=3,
    ))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    pixels, labels = torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 3, (4, 8, 8), generator=gen)
    data = Dataset.from_dict({"pixel_values": pixels.tolist(), "labels": labels.tolist()})
    posterior = EVONPosterior.from_optimizer(build_optimizer(model), model)
    trainer = EVONTrainer(model=model, args=config(tmp_path, bma_num_samples=2), posterior=posterior)
    forwards = count_forwards(model)
    with pytest.raises(ValueError, match=r"^predict\(bma=True\): SegformerForSemanticSegmentation's logits"):
        trainer.predict(data, bma=True)
    with pytest.raises(ValueError, match=r"^predict_uncertainty\(\): SegformerForSemanticSegmentation's logits"):
        trainer.predict_uncertainty(data)
    assert forwards[0] == 0


def test_predict_bma_refuses_a_mask_query_segmentation_model_and_keeps_detr_segmentation(tmp_path):
    """Mask2Former (as MaskFormer, OneFormer, EoMT) outputs ``class_queries_logits`` (B, queries, classes + 1)
    and ``masks_queries_logits`` (B, queries, H, W), no ``logits``: predict(bma=True) averaged both through
    a softmax over the last dimension, the mask's width, and returned the masks' rows summing to 1 across
    pixels without a word. Both BMA calls refuse it now, naming the model class, before any pass; a
    DetrForSegmentation, whose ``logits`` are its class logits, still predicts."""
    from datasets import Dataset
    from transformers import (
        DetrConfig,
        DetrForSegmentation,
        Mask2FormerConfig,
        Mask2FormerForUniversalSegmentation,
        ResNetConfig,
        SwinConfig,
    )

    from hf_evon import EVONPosterior, build_optimizer

    torch.manual_seed(0)
    backbone = SwinConfig(
        image_size=32, patch_size=4, embed_dim=32, depths=[1] * 4, num_heads=[1] * 4, window_size=2,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )  # fmt: skip
    model = Mask2FormerForUniversalSegmentation(Mask2FormerConfig(
        backbone_config=backbone, num_labels=3, hidden_dim=32, feature_size=32, mask_feature_size=32,
        encoder_feedforward_dim=32, dim_feedforward=32, decoder_layers=2, encoder_layers=1, num_queries=4,
        num_attention_heads=2, common_stride=4,
    ))  # fmt: skip
    data = Dataset.from_dict({"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))})
    posterior = EVONPosterior.from_optimizer(build_optimizer(model), model)
    trainer = EVONTrainer(model=model, args=config(tmp_path, bma_num_samples=2), posterior=posterior)
    forwards = count_forwards(model)
    with pytest.raises(ValueError, match=r"^predict\(bma=True\): Mask2FormerForUniversalSegmentation's output"):
        trainer.predict(data, bma=True)
    with pytest.raises(ValueError, match=r"^predict_uncertainty\(\): Mask2FormerForUniversalSegmentation's output"):
        trainer.predict_uncertainty(data)
    assert forwards[0] == 0

    detr = DetrForSegmentation(DetrConfig(
        use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=ResNetConfig(
            embedding_size=8, hidden_sizes=[8, 8, 8, 8], depths=[1, 1, 1, 1], out_features=["stage1", "stage2",
            "stage3", "stage4"]), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_ffn_dim=16, decoder_ffn_dim=16, num_queries=3, num_labels=2,
    )).eval()  # fmt: skip
    posterior = EVONPosterior.from_optimizer(build_optimizer(detr), detr)
    trainer = EVONTrainer(model=detr, args=config(tmp_path, bma_num_samples=2), posterior=posterior)
    probabilities = trainer.predict(data, bma=True).predictions
    with torch.no_grad():  # the class logits: (B, queries, classes + 1), each row a distribution
        assert probabilities.shape == detr(pixel_values=torch.tensor(data["pixel_values"])).logits.shape
    np.testing.assert_allclose(probabilities.sum(-1), 1.0, rtol=1e-6)


class _LossThenLogits(torch.nn.Module):
    """A user's model without ``return_dict``: ``(loss, logits)``, its loss None without labels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.hidden, self.out = torch.nn.Embedding(100, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)

    def forward(self, input_ids, attention_mask=None, labels=None):  # noqa: ANN001, ANN201
        logits = self.out(torch.tanh(self.hidden(self.emb(input_ids).mean(1))))
        return (None if labels is None else torch.nn.functional.cross_entropy(logits, labels)), logits


def test_a_tuple_output_whose_loss_is_none_without_labels_is_scored_by_its_logits(tmp_path):
    """The BMA passes call the model without its labels, and ``(None, logits)`` was read as an output
    without logits: evaluate() and predict(bma=True) raised "its output has none (a tuple of 2)". Its
    logits are scored: at the mean, the NLL is the Trainer's own eval_loss."""
    data = classification_data(16)
    trainer = EVONTrainer(model=_LossThenLogits(), args=config(tmp_path, max_steps=2, bma_num_samples=2), train_dataset=data)
    trainer.train()
    metrics = trainer.evaluate(data)
    assert metrics["eval_mean_nll"] == pytest.approx(metrics["eval_loss"], rel=1e-6)
    assert math.isfinite(metrics["eval_bma_nll"])
    probs = trainer.predict(data, bma=True).predictions
    assert probs.shape == (16, 3) and np.allclose(probs.sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("stop", [False, True], ids=["trains-on", "stops-there"])
def test_a_predict_inside_evaluate_is_a_predict_and_adds_nothing_to_the_evaluation(tmp_path, stop: bool) -> None:
    """``trainer.predict(test)`` from an ``on_evaluate`` callback (a common way to log test metrics)
    ran inside ``evaluate()``'s state: it gained ``test_mean_*`` (and ``test_bma_*`` with extra
    sampled passes), and where the callback stopped training there, the evaluation's returned
    metrics gained the predict's ``test_bma_*``. It returns what a predict outside training returns."""
    test = classification_data(8, 5)
    inside = []

    class TestSet(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            inside.append(set(trainer.predict(test).metrics))
            control.should_training_stop = stop

    trainer = EVONTrainer(
        model=tiny_bert(),
        args=config(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, bma_eval_every=2, logging_steps=2),
        train_dataset=classification_data(32),
        eval_dataset=classification_data(16, 1),
        callbacks=[TestSet()],
    )
    trainer.train()
    outside = set(trainer.predict(test).metrics)
    assert inside and all(keys == outside for keys in inside), (inside, outside)
    assert not any(k.startswith(("test_mean", "test_bma")) for k in outside)
    logged = [k for h in trainer.state.log_history for k in h]
    assert not any(k.startswith("test_") for k in logged), logged
    assert any(k.startswith("eval_bma_") for k in logged)  # the evaluation's own BMA ran
