"""EVONTrainer/EVONConfig under bad input and faults: no silent overrides, clear errors, the right names."""

from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np
import pytest
import torch
from datasets import Dataset
from test_trainer import classification_data, config, lm_data, tiny_bert, tiny_gpt2
from transformers import TrainingArguments

from hf_evon import EVONConfig, EVONTrainer, bma_log_likelihood, build_optimizer
from hf_evon.posterior.posterior import EVONPosterior


# ---------------------------------------------------------------------------- issue 9.12
@pytest.mark.parametrize(
    "field,value",
    [
        ("adam_beta1", 1.0),
        ("adam_beta1", -0.1),
        ("adam_beta2", 1.5),
        ("adam_epsilon", -1e-8),
        ("adam_epsilon", float("nan")),
        ("weight_decay", -0.01),
    ],
)
def test_config_validates_the_adamw_fields_by_their_config_name(tmp_path, field, value):
    """The error comes from EVONConfig, naming its own field, not later from EVON's keyword."""
    with pytest.raises(ValueError, match=rf"EVONConfig\.{field} = "):
        EVONConfig(output_dir=str(tmp_path), report_to="none", **{field: value})


def test_metric_for_best_model_needs_bma_on_every_evaluation(tmp_path):
    with pytest.raises(ValueError, match="bma_eval_every"):
        EVONConfig(
            output_dir=str(tmp_path), report_to="none", metric_for_best_model="eval_bma_nll", bma_eval_every=2
        )
    # mean metrics are on every evaluation
    EVONConfig(
        output_dir=str(tmp_path), report_to="none", metric_for_best_model="eval_mean_nll", bma_eval_every=2
    )


@pytest.mark.parametrize(
    ("metric", "greater"),
    [("eval_bma_nll", False), ("bma_ece", False), ("eval_mean_brier", False), ("eval_bma_perplexity", False),
     ("eval_bma_accuracy", True), ("eval_loss", False)],
)  # fmt: skip
def test_the_best_model_by_an_nll_ece_brier_or_perplexity_is_the_lowest(tmp_path, metric, greater):
    # transformers turns greater_is_better off only for a name ending in "loss": by eval_bma_nll,
    # load_best_model_at_end restored the worst checkpoint
    args = EVONConfig(output_dir=str(tmp_path), report_to="none", metric_for_best_model=metric)
    assert args.greater_is_better is greater
    given = EVONConfig(output_dir=str(tmp_path), report_to="none", metric_for_best_model=metric, greater_is_better=True)
    assert given.greater_is_better is True  # the user's choice stands


def test_a_bma_metric_for_the_best_model_needs_bma_samples(tmp_path):
    with pytest.raises(ValueError, match=r"EVONConfig\.bma_num_samples = 0 is invalid: it must be > 0 for"):
        EVONConfig(output_dir=str(tmp_path), report_to="none", metric_for_best_model="eval_bma_nll", bma_num_samples=0)


# ---------------------------------------------------------------------------- issue 11.1
def test_plain_training_arguments_keep_their_learning_rates_meaning(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, learning_rate=5e-5)
    with pytest.warns(UserWarning, match=r"learning_rate = 5e-05 is used as for AdamW") as record:
        trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data(16))
    text = " ".join(str(w.message) for w in record)
    assert (
        "EVON's α = 0.008 (0.005 when all weights of a pretrained model" in text  # 1.6, 1.0 x 5e-5 / 0.01
        and "Pass an EVONConfig" in text
    )
    # TrainingArguments' clip of 1.0 is kept, and said so (EVONConfig's default 0 was not said to differ)
    assert "Its max_grad_norm = 1 is kept" in text and trainer.args.max_grad_norm == 1.0
    assert isinstance(trainer.args, EVONConfig) and trainer.args.learning_rate == 5e-5
    unclipped = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_grad_norm=0.0)
    with pytest.warns(UserWarning, match="converted to EVONConfig") as record:
        EVONTrainer(model=tiny_bert(), args=unclipped, train_dataset=classification_data(16))
    assert not any("max_grad_norm" in str(w.message) for w in record)
    opt = trainer.create_optimizer()
    rates = {g["algorithm"]: g["lr"] for g in opt.param_groups}
    # AdamW's rate as given; EVON's α from the step-RMS rule of the default clip ("whiten_rms", 1.6)
    # at the default radius 0.01
    assert rates == {"evon": pytest.approx(1.6 * 5e-5 / 0.01, rel=1e-12), "adamw": 5e-5}


@pytest.mark.parametrize(
    ("metric", "given", "greater"),
    [("eval_mean_nll", None, False), ("bma_ece", None, False), ("eval_mean_nll", False, False),
     ("eval_bma_accuracy", None, True), ("eval_loss", None, False), ("eval_loss", True, True)],
)  # fmt: skip
def test_plain_training_arguments_keep_a_lower_is_better_metric_lower_is_better(tmp_path, metric, given, greater):
    """TrainingArguments sets greater_is_better=True for any metric not ending in "loss"; the
    converted config's best model by an NLL (ECE, ...) is the lowest, as EVONConfig's is."""
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=3, eval_strategy="steps",
        eval_steps=1, save_strategy="steps", save_steps=1, load_best_model_at_end=True,
        metric_for_best_model=metric, greater_is_better=given, per_device_train_batch_size=8, disable_tqdm=True,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="converted to EVONConfig"):
        trainer = EVONTrainer(
            model=tiny_bert(), args=args, train_dataset=classification_data(24), eval_dataset=classification_data(8, 1)
        )
    assert trainer.args.greater_is_better is greater
    if metric != "eval_mean_nll" or given is not None:
        return
    trainer.train()
    nll = [h["eval_mean_nll"] for h in trainer.state.log_history if "eval_mean_nll" in h]
    assert len(nll) == 3 and len(set(nll)) == 3
    assert trainer.state.best_metric == min(nll)


def test_optim_is_ignored_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match=r"EVONConfig\.optim = 'adafactor' .* is ignored"):
        EVONConfig(output_dir=str(tmp_path), report_to="none", optim="adafactor")
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, optim="sgd")
    with pytest.warns(UserWarning) as record:
        EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data(16))
    messages = [str(w.message) for w in record]
    assert any("EVONConfig.optim = 'sgd'" in m and "ignored" in m for m in messages), messages
    # the defaults warn about nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EVONConfig(output_dir=str(tmp_path), report_to="none")


def test_ignored_optim_args_are_said_once(tmp_path):
    """``optim_args`` at the default ``optim`` was warned about where the config was built and again where
    the trainer built its optimizer: the warning resets ``optim`` but kept ``optim_args``. Both are reset."""
    with pytest.warns(UserWarning, match=r"optim_args = 'foo=1'\) is ignored"):
        args = config(tmp_path, max_steps=1, optim_args="foo=1")
    assert args.optim_args is None
    trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data(16))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.create_optimizer()
    assert not [w for w in record if "is ignored" in str(w.message)], [str(w.message) for w in record]


@pytest.mark.parametrize("when", ["built", "set_later"])
@pytest.mark.parametrize("optim", ["lomo", "adalomo"])
def test_an_ignored_lomo_optim_is_ignored_while_training_too(tmp_path, optim, when):
    """optim="lomo" was said to be ignored, but the Trainer also reads it in training_step, passing
    backward(learning_rate=...), and train() raised a TypeError from Tensor.backward. The field is
    set back to its default after the warning: the run equals one at the default. Set after the
    config was built (``args.set_optimizer``) it was not seen at all: train() raised the same error."""
    ignored = rf"EVONConfig\.optim = '{optim}' .* is ignored"
    if when == "built":
        with pytest.warns(UserWarning, match=ignored):
            args = config(tmp_path / optim, max_steps=2, evon_ess=300.0, optim=optim)
        assert args.optim == EVONConfig.__dataclass_fields__["optim"].default
    else:
        args = config(tmp_path / optim, max_steps=2, evon_ess=300.0).set_optimizer(name=optim)
    trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data(16))
    with pytest.warns(UserWarning, match=ignored) if when == "set_later" else contextlib.nullcontext():
        trainer.train()
    assert trainer.args.optim == EVONConfig.__dataclass_fields__["optim"].default
    plain = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "plain", max_steps=2, evon_ess=300.0), train_dataset=classification_data(16))
    plain.train()
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), plain.model.parameters()))


@pytest.mark.parametrize("optimizer_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_optimizer_cls_and_kwargs_is_refused_naming_the_argument(tmp_path, optimizer_cls):
    """``Trainer(optimizer_cls_and_kwargs=(cls, kwargs))`` was ignored without a word: EVONTrainer built
    EVON, and the user's optimizer and rate never ran. It is refused where the trainer is made,
    naming the argument and the ways to choose the optimizer."""
    with pytest.raises(ValueError, match=r"optimizer_cls_and_kwargs = \((SGD|AdamW), .*build_optimizer"):
        EVONTrainer(
            model=tiny_bert(), args=config(tmp_path), train_dataset=classification_data(16),
            optimizer_cls_and_kwargs=(optimizer_cls, {"lr": 0.1}),
        )  # fmt: skip


@pytest.mark.parametrize("given_optimizer", [False, True])
def test_a_scheduler_of_another_optimizer_is_refused_naming_it(tmp_path, given_optimizer):
    """``optimizers=(None, scheduler)`` (the scheduler built on an optimizer of the user's, as EVON does not
    exist yet), or ``optimizers=(evon, scheduler)`` with the scheduler on another optimizer: the
    scheduler stepped that optimizer, and EVON's rates stayed at their start without a word. It is
    refused before the first step, naming the scheduler and both optimizers; the weights are untouched."""
    model = tiny_bert()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(other, lambda step: 0.5**step)
    evon = build_optimizer(model, lr=2e-2, adamw_lr=1e-3, ess=1e4, hess_init=1.0) if given_optimizer else None
    trainer = EVONTrainer(
        model=model, args=config(tmp_path), train_dataset=classification_data(16), optimizers=(evon, scheduler)
    )
    match = r"optimizers=\(\.\.\., LambdaLR\): the scheduler steps another optimizer \(SGD\), not the trainer's EVON"
    with pytest.raises(ValueError, match=match):
        trainer.train()
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


def test_compute_metrics_keys_are_never_replaced(tmp_path):
    """The user's `accuracy`/`nll` are theirs; ours are eval_mean_*/eval_bma_*; a clash keeps theirs."""
    returned: dict[str, float] = {}

    def compute_metrics(prediction):
        logits, labels = prediction.predictions, prediction.label_ids
        ours = {
            "accuracy": float((logits.argmax(-1) == labels).mean()) + 10.0,  # deliberately not our accuracy
            "nll": float(np.abs(logits).mean()),
            "mean_ece": -1.0,  # clashes with eval_mean_ece
        }
        returned.clear()
        returned.update(ours)
        return ours

    trainer = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path, max_steps=2, bma_num_samples=2),
        train_dataset=classification_data(), eval_dataset=classification_data(32, seed=1),
        compute_metrics=compute_metrics,
    )  # fmt: skip
    trainer.train()
    with pytest.warns(UserWarning, match="'eval_mean_ece' from compute_metrics clashes") as caught:
        metrics = trainer.evaluate()
    # the warning names the user's evaluate() call (this file), not a line of transformers' Trainer
    assert [w.filename for w in caught if "clashes" in str(w.message)] == [__file__]
    assert metrics["eval_accuracy"] == pytest.approx(returned["accuracy"])
    assert metrics["eval_nll"] == pytest.approx(returned["nll"])
    assert metrics["eval_mean_ece"] == -1.0
    for key in ("nll", "accuracy", "brier"):
        assert 0.0 <= metrics[f"eval_mean_{key}"] < 10.0 and 0.0 <= metrics[f"eval_bma_{key}"] < 10.0
    assert "eval_bma_loss" not in metrics  # no BMA twin of eval_loss: compare eval_mean_nll, eval_bma_nll


# ---------------------------------------------------------------------------- issue 9.14
def test_nonfinite_warning_names_the_parameter_at_fault_under_clipping(tmp_path):
    """The grad-norm pass must not spread one parameter's NaN to every gradient before EVON looks."""
    culprit = "bert.encoder.layer.1.output.dense.weight"
    trainer = EVONTrainer(
        model=tiny_bert(),
        args=config(tmp_path, max_steps=3, max_grad_norm=1.0),
        train_dataset=classification_data(),
    )
    parameter = dict(trainer.model.named_parameters())[culprit]
    parameter.register_hook(lambda g: g * math.nan if trainer.state.global_step == 0 else g)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    nonfinite = [str(w.message) for w in record if "non-finite gradient" in str(w.message)]
    assert len(nonfinite) == 1, nonfinite
    assert nonfinite[0].startswith(f"non-finite gradient in {culprit} "), nonfinite[0]
    assert trainer.evon_optimizer.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_bma_log_likelihood_with_no_scored_token_is_nan_like_the_model():
    model = tiny_gpt2().eval()
    opt = build_optimizer(model, lr=1e-2, ess=1e3, seed=0)
    x = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    with opt.sampled_params(train=True):
        model(input_ids=x, labels=x).loss.backward()
    opt.step()
    posterior = EVONPosterior.from_optimizer(opt, model)
    labels = torch.full_like(x, -100)
    with torch.no_grad():
        model_loss = model(input_ids=x, labels=labels).loss
    assert torch.isnan(model_loss)  # the model's own convention
    result = bma_log_likelihood(model, posterior, x, labels=labels, num_samples=2, seed=0)
    assert torch.isnan(result.loss) and torch.isnan(result.perplexity)
    assert torch.isnan(result.sample_losses).all() and torch.isnan(result.group_loss(1))
    # one scored token is an ordinary finite loss
    labels[0, 3] = x[0, 3]
    assert torch.isfinite(bma_log_likelihood(model, posterior, x, labels=labels, num_samples=2, seed=0).loss)


def test_evaluation_with_no_label_token_reports_nan_not_a_perfect_score(tmp_path):
    evaluation = lm_data(8, seed=1).to_dict()
    evaluation["labels"] = [[-100] * len(row) for row in evaluation["labels"]]
    trainer = EVONTrainer(
        model=tiny_gpt2(), args=config(tmp_path, max_steps=1, bma_num_samples=2),
        train_dataset=lm_data(8), eval_dataset=Dataset.from_dict(evaluation),
    )  # fmt: skip
    trainer.train()
    metrics = trainer.evaluate()
    for key in ("eval_mean_nll", "eval_mean_perplexity", "eval_bma_nll", "eval_bma_perplexity"):
        assert math.isnan(metrics[key]), (key, metrics[key])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: classification_data(8).map(lambda r: {"labels": -100}), "no labelled target"),
        (lambda: classification_data(8).remove_columns("labels"), "no 'labels'"),
        (lambda: classification_data(8).map(lambda r: {"input_ids": [5000] * 8}), "beyond the model's vocabulary"),
        (lambda: classification_data(8).map(lambda r: {"labels": 0.5}), "floating-point labels"),
        (lambda: classification_data(8).map(lambda r: {"labels": -1}), r"label -1, outside the model's 3 classes"),
        (
            lambda: classification_data(8).map(lambda r: {"labels": [r["labels"]] * 8}),
            r"labels shaped \(8, 8\) do not align with the model's logits \(8, 3\)",
        ),
    ],
    ids=[
        "every-label-ignored", "no-labels", "another-tokenizer", "regression-targets", "no-label-as-minus-one",
        "labels-per-token-for-a-sequence-classifier",
    ],  # fmt: skip
)
def test_unusable_calibration_data_is_refused_before_the_first_step(tmp_path, make, match) -> None:
    """Issue 33 item 8: an unusable calibration set raised only once training had finished, so
    `trainer.train(); trainer.save_model()` lost the run."""
    trainer = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path, max_steps=3), train_dataset=classification_data(),
        calibration_dataset=make(),
    )  # fmt: skip
    with pytest.raises(ValueError, match=match):
        trainer.train()
    assert trainer.state.global_step == 0  # refused before any step



def test_a_causal_lm_label_the_shift_never_scores_is_not_refused(tmp_path) -> None:
    """A causal LM scores labels from position 1 (token t+1 at position t), in training and in the
    calibration alike: the pre-training check refused a first label outside the vocabulary that
    neither ever reads. A later one is still refused."""
    held_out = lm_data(8, seed=2).to_dict()
    vocab = tiny_gpt2().config.vocab_size
    held_out["labels"] = [[vocab] + row[1:] for row in held_out["labels"]]
    trainer = EVONTrainer(
        model=tiny_gpt2(), args=config(tmp_path, max_steps=2, bma_num_samples=2), train_dataset=lm_data(8),
        calibration_dataset=Dataset.from_dict(held_out),
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.calibration is not None
    held_out["labels"] = [row[:1] + [vocab] + row[2:] for row in held_out["labels"]]
    trainer.calibration_dataset = Dataset.from_dict(held_out)
    with pytest.raises(ValueError, match=f"label {vocab}, outside the model's {vocab} classes"):
        trainer._check_calibration_data()


def test_the_calibration_check_scores_no_batch_while_the_weights_are_not_loaded(tmp_path) -> None:
    """FSDP's memory-efficient loading keeps the weights of ranks > 0 on the meta device until
    ``accelerator.prepare``: the pre-training check must not run the model then (the structural
    checks still apply)."""
    trainer = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path, max_steps=3), train_dataset=classification_data(),
        calibration_dataset=classification_data(8).map(lambda r: {"labels": -1}),
    )  # fmt: skip
    with pytest.raises(ValueError, match="label -1"):
        trainer._check_calibration_data()
    trainer.model.to("meta")
    trainer._check_calibration_data()  # -1 needs the logits' classes to be refused: not scored here
    trainer.calibration_dataset = classification_data(8).remove_columns("labels")
    with pytest.raises(ValueError, match="no 'labels'"):
        trainer._check_calibration_data()


def test_a_train_after_an_aborted_one_drops_its_pending_samples(tmp_path):
    """An error in the second micro-batch of a step (auto_find_batch_size's out-of-memory retry, or a
    train() called again) left EVON one recorded sample: the next run's first step divided its
    gradient by 3 samples instead of 2. The retried run now equals one started afresh."""
    common = dict(evon_ess=math.inf, max_steps=3, gradient_accumulation_steps=2, max_grad_norm=1e9,
                  per_device_train_batch_size=4, logging_steps=1)  # fmt: skip
    retried = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "retried", **common), train_dataset=classification_data())
    own, calls = retried.compute_loss, [0]

    def flaky(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("transient failure")
        return own(*args, **kwargs)

    retried.compute_loss = flaky
    with pytest.raises(RuntimeError, match="transient failure"):
        retried.train()
    assert retried.evon_optimizer.recorded_samples == 1
    retried.train()
    fresh = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "fresh", **common), train_dataset=classification_data())
    fresh.train()
    norms = [[h["grad_norm"] for h in t.state.log_history if "grad_norm" in h] for t in (retried, fresh)]
    assert norms[0] == norms[1] and len(norms[0]) == 3
    assert all(torch.equal(a, b) for a, b in zip(retried.model.parameters(), fresh.model.parameters()))


def test_a_resume_after_a_train_aborted_mid_step_goes_on_as_the_uninterrupted_run(tmp_path):
    """train() stopped between the micro-batches of a step (an interrupt, an error), then
    train(resume_from_checkpoint=...) on the same trainer: EVON refused the checkpoint's state ("called
    between a sampled_params(train=True) block and step()"), the Trainer loading it before
    on_train_begin dropped the aborted samples, at every later try too. It resumes, and ends as a run
    never interrupted does."""
    common = dict(max_steps=4, gradient_accumulation_steps=2, per_device_train_batch_size=4, logging_steps=1,
                  save_strategy="steps", save_steps=1, evon_ess=300.0)  # fmt: skip
    full = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "full", **common), train_dataset=classification_data())
    full.train()
    stopped = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "stopped", **common), train_dataset=classification_data())
    own, calls = stopped.compute_loss, [0]

    def flaky(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] == 4:  # step 2's second micro-batch
            raise KeyboardInterrupt
        return own(*args, **kwargs)

    stopped.compute_loss = flaky
    with pytest.raises(KeyboardInterrupt):
        stopped.train()
    assert stopped.state.global_step == 1 and stopped.evon_optimizer.recorded_samples == 1
    stopped.train(resume_from_checkpoint=str(tmp_path / "stopped" / "out" / "checkpoint-1"))
    assert stopped.state.global_step == 4
    assert all(torch.equal(a, b) for a, b in zip(stopped.model.parameters(), full.model.parameters()))


@pytest.mark.parametrize("mc_samples", [1, 2])
def test_an_out_of_memory_retry_draws_the_noise_of_a_fresh_run(tmp_path, mc_samples):
    """auto_find_batch_size: the last of the first step's posterior samples runs out of memory at batch size 16,
    and the run starts over at int(16 * 0.9) = 14. The blocks of the step that never completed (the one that
    raised, and with two samples one recorded before it) advanced EVON's noise counter, so the retried run
    drew other noise than a fresh run at batch size 14. It now draws the same: equal losses and weights."""
    common = dict(max_steps=2, evon_mc_samples=mc_samples, logging_steps=1, auto_find_batch_size=True)
    retried = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path / "retried", per_device_train_batch_size=16, **common),
        train_dataset=classification_data(),
    )  # fmt: skip
    own, calls = retried.compute_loss, [0]

    def out_of_memory(model, inputs, *args, **kwargs):  # noqa: ANN002, ANN003, ANN001, ANN202
        calls[0] += 1
        if inputs["input_ids"].shape[0] == 16 and calls[0] == mc_samples:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return own(model, inputs, *args, **kwargs)

    retried.compute_loss = out_of_memory
    retried.train()
    assert calls[0] == mc_samples * 3 and retried._train_batch_size == 14  # the retry ran 2 steps at 14
    fresh = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path / "fresh", per_device_train_batch_size=14, **common),
        train_dataset=classification_data(),
    )  # fmt: skip
    fresh.train()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (retried, fresh)]
    assert losses[0] == losses[1] and len(losses[0]) == 2
    assert all(torch.equal(a, b) for a, b in zip(retried.model.parameters(), fresh.model.parameters()))
    assert [t.evon_optimizer.sample_blocks for t in (retried, fresh)] == [2 * mc_samples] * 2


@pytest.mark.parametrize("problem", ["multi_label_classification", "regression"])
def test_the_calibration_of_a_multi_label_or_regression_model_is_refused_naming_its_problem_type(tmp_path, problem):
    """Given class-index labels, the calibration of a model whose ``config.problem_type`` says its
    logits are per-label sigmoids or values scored them under a softmax: it ran, chose a scale and
    a softmax temperature from that NLL (0.125 for a 3-label model) and saved them with the
    posterior. Before training (calibration_dataset), in trainer.calibrate() and in
    calibrate_posterior it is refused naming problem_type, and the posterior is left as it is."""
    from hf_evon.predictive.calibration import calibrate_posterior

    outputs = 3 if problem == "multi_label_classification" else 1
    model = tiny_bert(num_labels=outputs)
    model.config.problem_type = problem
    ids = torch.randint(3, 100, (16, 8), generator=torch.Generator().manual_seed(0))
    float_labels = ids[:, 1:4] % 2 if outputs == 3 else ids[:, 1:2] / 100
    train = Dataset.from_dict({"input_ids": ids.tolist(), "labels": float_labels.float().squeeze(-1).tolist()})
    classes = classification_data(8).map(lambda r: {"labels": r["labels"] % outputs})  # class indices
    match = rf"problem_type '{problem}'"
    trainer = EVONTrainer(model=model, args=config(tmp_path, max_steps=2), train_dataset=train, calibration_dataset=classes)
    with pytest.raises(ValueError, match=rf"calibration_dataset batch 0: the model's {match}"):
        trainer.train()
    assert trainer.state.global_step == 0
    trainer.calibration_dataset = None
    trainer.train()
    before = trainer.current_posterior()
    with pytest.raises(ValueError, match=match):
        trainer.calibrate(classes)
    batch = {"input_ids": torch.tensor(classes["input_ids"]), "labels": torch.tensor(classes["labels"])}
    with pytest.raises(ValueError, match=rf"^calibrate_posterior: the model's {match}"):
        calibrate_posterior(trainer.model, before, [batch], grid=[1.0], num_samples=2)
    after = trainer.current_posterior()
    assert (after.ess, after.temperature) == (before.ess, before.temperature) == (before.ess, 1.0)


@pytest.mark.parametrize("outputs,dtype", [(3, torch.float), (1, torch.float), (3, torch.bool)])
def test_a_calibration_split_is_refused_before_training_where_transformers_will_set_a_problem_type_without_softmax(
    tmp_path, outputs, dtype
):
    """A classifier whose config.problem_type is None takes it from its first labelled forward (transformers'
    rule: one output, regression; labels of another dtype than long or int32, multi-label). With float training
    labels, or one output, and a calibration_dataset of class indices, the check before training passed; the
    run trained, and its calibration was refused at the end. Bool labels (multi-label to transformers too) were
    taken for class indices, and the first step failed inside BCEWithLogitsLoss. Each is refused before the
    first step now, naming the problem type."""
    model = tiny_bert(num_labels=outputs)
    assert model.config.problem_type is None
    ids = torch.randint(3, 100, (16, 8), generator=torch.Generator().manual_seed(0))
    labels = ids[:, 1:4] % 2 if outputs == 3 else ids[:, 1:2] / 100
    train = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.to(dtype).squeeze(-1).tolist()})
    classes = classification_data(8).map(lambda r: {"labels": r["labels"] % outputs})  # class indices
    problem = "multi_label_classification" if outputs == 3 else "regression"
    trainer = EVONTrainer(model=model, args=config(tmp_path, max_steps=2), train_dataset=train, calibration_dataset=classes)
    with pytest.raises(ValueError, match=rf"^EVONTrainer: calibration_dataset: the model's problem_type '{problem}'"):
        trainer.train()
    assert trainer.state.global_step == 0 and model.config.problem_type is None


def test_labels_the_data_collator_makes_class_indices_are_not_refused_before_training(tmp_path):
    """transformers' rule reads the labels the model gets: default_data_collator batches a bool ``label``
    as torch.long, so the first forward sets single_label_classification and the calibration split stands;
    the same bools under ``labels`` stay bool (multi-label) and are refused, naming their dtype."""
    from hf_evon.trainer.calibration_data import require_softmax_training

    ids = torch.randint(3, 100, (16, 8), generator=torch.Generator().manual_seed(0))
    flags = (ids[:, 1] % 2).bool().tolist()
    for key, refused in (("label", False), ("labels", True)):
        model = tiny_bert(num_labels=2)
        train = Dataset.from_dict({"input_ids": ids.tolist(), key: flags})
        args = config(tmp_path, max_steps=1)
        classes = classification_data(8).map(lambda r: {"labels": r["labels"] % 2})
        trainer = EVONTrainer(model=model, args=args, train_dataset=train, calibration_dataset=classes)
        if refused:
            with pytest.raises(ValueError, match=r"problem_type 'multi_label_classification'.*labels are torch\.bool"):
                require_softmax_training(trainer)
        else:
            require_softmax_training(trainer)
            trainer.train()
            assert model.config.problem_type == "single_label_classification"


def test_log_level_governs_hf_evons_messages_as_it_does_transformers_own(tmp_path, caplog):
    """``log_level="error"`` quieted transformers' messages but not hf-evon's (the calibration's summary
    still printed at WARNING): its loggers are not under transformers'. The passive default leaves them
    as the user set them."""
    import logging

    import transformers

    evon_logger, verbosity = logging.getLogger("hf_evon"), transformers.logging.get_verbosity()

    def run(name: str, **fields) -> str:
        caplog.clear()
        trainer = EVONTrainer(
            model=tiny_bert(), args=config(tmp_path / name, max_steps=2, **fields), train_dataset=classification_data(16),
            calibration_dataset=classification_data(8, 1),
        )  # fmt: skip
        with caplog.at_level("INFO"):  # the root's: hf_evon's own level decides
            trainer.train()
        return caplog.text

    try:
        assert "EVONTrainer: calibrated" in run("passive") and evon_logger.level == logging.NOTSET
        assert "EVONTrainer: calibrated" not in run("error", log_level="error")
        assert evon_logger.level == logging.ERROR
    finally:
        evon_logger.setLevel(logging.NOTSET)
        transformers.logging.set_verbosity(verbosity)
