"""Pins the ``transformers.Trainer`` behaviour the EVON trainers rely on (hf_evon.trainer.internals).

Each test fails if transformers stops calling a private method the way the EVON trainer overrides
it, or stops honouring a documented switch it sets; see the mixin's docstring for the list.
"""

from __future__ import annotations

import inspect
import math
import os

import pytest
import torch
import transformers
from accelerate.optimizer import AcceleratedOptimizer
from test_trainer import classification_data, config, tiny_bert, tiny_gpt2
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_evon import EVONTrainer


class _Recording(EVONTrainer):
    """Records the calls of the overridden private methods, in order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple] = []

    def _save_optimizer_and_scheduler(self, output_dir):
        self.calls.append(("save_optimizer", output_dir))
        super()._save_optimizer_and_scheduler(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        self.calls.append(("load_optimizer", checkpoint))
        super()._load_optimizer_and_scheduler(checkpoint)

    def _clip_grad_norm(self, model):
        self.calls.append(("clip", model is self.model_wrapped))
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        self.calls.append(("grad_norm", grad_norm is not None))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def save_model(self, output_dir=None, _internal_call=False):
        self.calls.append(("save_model", output_dir, _internal_call))
        super().save_model(output_dir, _internal_call)


class _SeesSetUp(TrainerCallback):
    def __init__(self, trainer: _Recording) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        # after the Trainer's own set-up: the optimizer is accelerate's, resumed if asked
        self.trainer.calls.append(("train_begin", isinstance(self.trainer.optimizer, AcceleratedOptimizer)))


def test_the_overridden_private_methods_exist_on_trainer():
    for name in (
        "_save_optimizer_and_scheduler",
        "_load_optimizer_and_scheduler",
        "_push_from_checkpoint",
        "_clip_grad_norm",
        "_get_grad_norm",
        "_save",
        "_load_from_checkpoint",
        "_load_best_model",
    ):
        assert callable(getattr(Trainer, name, None)), name
    assert list(inspect.signature(Trainer._save).parameters) == ["self", "output_dir", "state_dict"]
    assert list(inspect.signature(Trainer._load_from_checkpoint).parameters) == ["self", "resume_from_checkpoint", "model"]
    assert list(inspect.signature(Trainer._load_best_model).parameters) == ["self"]
    assert "else self.model" in inspect.getsource(Trainer._load_best_model)  # it loads into self.model
    # a PeftModel's active adapter from best_model_checkpoint itself, which the override points at its subfolder
    assert "model.load_adapter(self.state.best_model_checkpoint, active_adapter)" in inspect.getsource(
        Trainer._load_best_model
    )
    assert list(inspect.signature(Trainer._save_optimizer_and_scheduler).parameters) == ["self", "output_dir"]
    assert list(inspect.signature(Trainer._load_optimizer_and_scheduler).parameters) == ["self", "checkpoint"]
    assert list(inspect.signature(Trainer._push_from_checkpoint).parameters) == ["self", "checkpoint_folder"]
    assert list(inspect.signature(Trainer._get_grad_norm).parameters) == ["self", "model", "grad_norm"]
    # posterior_deleting_uploads wraps the factory both pushes upload through
    import transformers.trainer as trainer_module

    assert callable(trainer_module.hf_api)
    for push in (Trainer.push_to_hub, Trainer._push_from_checkpoint):
        assert "hf_api().upload_folder(" in inspect.getsource(push), push.__name__


def test_checkpoint_saves_the_model_then_the_optimizer_into_the_checkpoint_dir(tmp_path):
    """``_save_checkpoint`` calls ``save_model(dir, _internal_call=True)`` (posterior, gathering) and
    then ``_save_optimizer_and_scheduler(dir)`` with the same checkpoint directory; clipping and the
    grad norm go through ``_clip_grad_norm(model)`` and ``_get_grad_norm(model, grad_norm=...)``."""
    args = config(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, max_grad_norm=1.0)
    trainer = _Recording(model=tiny_bert(), args=args, train_dataset=classification_data(16))
    trainer.train()
    ckpt = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-2")
    saves = [c for c in trainer.calls if c[0] in ("save_model", "save_optimizer")]
    assert saves == [("save_model", ckpt, True), ("save_optimizer", ckpt)]
    assert [c for c in trainer.calls if c[0] in ("clip", "grad_norm")] == [
        ("clip", True),
        ("grad_norm", True),
    ] * 2
    assert os.path.isfile(os.path.join(ckpt, "evon_posterior.safetensors"))


def test_evon_config_leaves_the_gradients_unclipped_by_default_and_still_logs_their_norm(tmp_path):
    """EVONConfig's ``max_grad_norm`` defaults to 0 (docs/defaults.md#max-grad-norm), where
    TrainingArguments' is 1.0: the Trainer skips ``_clip_grad_norm`` and still logs the mean
    gradient's norm through ``_get_grad_norm(model, grad_norm=None)``."""
    args = config(tmp_path, max_steps=2, logging_steps=1)
    assert transformers.TrainingArguments(str(tmp_path / "plain"), use_cpu=True).max_grad_norm == 1.0
    assert args.max_grad_norm == 0
    trainer = _Recording(model=tiny_bert(), args=args, train_dataset=classification_data(16))
    trainer.train()
    assert [c for c in trainer.calls if c[0] in ("clip", "grad_norm")] == [("grad_norm", False)] * 2
    norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
    assert len(norms) == 2 and all(math.isfinite(n) and n > 0 for n in norms)


def test_resume_loads_the_optimizer_before_on_train_begin(tmp_path):
    """``_load_optimizer_and_scheduler(checkpoint)`` runs inside the Trainer's set-up, before the
    callbacks' ``on_train_begin``, where the EVON trainer calls ``prepare_distributed``."""
    args = config(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    trainer = _Recording(model=tiny_bert(), args=args, train_dataset=classification_data(16))
    trainer.train()
    again = _Recording(model=tiny_bert(), args=args, train_dataset=classification_data(16))
    again.add_callback(_SeesSetUp(again))
    ckpt = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-1")
    again.train(resume_from_checkpoint=ckpt)
    order = [c for c in again.calls if c[0] in ("load_optimizer", "train_begin")]
    assert order == [("load_optimizer", ckpt), ("train_begin", True)]


def test_checkpoint_push_goes_through_push_from_checkpoint():
    """``_save_checkpoint`` hands the checkpoint directory to ``_push_from_checkpoint`` when pushing."""
    source = inspect.getsource(Trainer._save_checkpoint)
    assert "self._push_from_checkpoint(output_dir)" in source
    assert source.index("self.save_model(output_dir, _internal_call=True)") < source.index(
        "self._save_optimizer_and_scheduler(output_dir)"
    )


def test_a_checkpoint_push_runs_on_the_conditions_the_evon_trainer_mirrors():
    """``_push_from_checkpoint`` returns without copying or uploading on the conditions
    ``TrainerInternals._checkpoint_push_runs`` mirrors (it copies the posterior on the others)."""
    source = inspect.getsource(Trainer._push_from_checkpoint)
    assert "if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:" in source
    assert (
        "if not self.args.hub_always_push and self.push_in_progress is not None and not "
        "self.push_in_progress.is_done():"
    ) in source
    assert source.index("is_done():") < source.index("shutil.copy(")


def test_training_step_takes_a_loss_scaled_for_ga_as_is(tmp_path):
    """``loss_is_scaled_for_ga = True`` (the Trainer's documented switch): ``training_step``
    back-propagates ``compute_loss``'s value without dividing it by the accumulation steps."""
    args = config(tmp_path, max_steps=1)
    trainer = Trainer(model=tiny_bert(), args=args, train_dataset=classification_data(8))
    batch = next(iter(trainer.get_train_dataloader()))
    grads = []
    for scaled in (True, False):
        trainer.model.zero_grad()
        trainer.loss_is_scaled_for_ga = scaled
        trainer.current_gradient_accumulation_steps = 4
        trainer.training_step(trainer.model, dict(batch), None)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1] * 4, grads[0], rtol=1e-5, atol=1e-8)


def test_a_trainer_without_the_switch_is_refused_by_version(tmp_path, monkeypatch):
    """A Trainer from before transformers 5.19 lacks ``loss_is_scaled_for_ga``: the EVON trainer
    refuses it when built, naming the version it needs, instead of failing in its first step."""
    monkeypatch.delattr(Trainer, "loss_is_scaled_for_ga")
    with pytest.raises(ImportError, match=rf"EVONTrainer needs transformers >= 5\.19; found {transformers.__version__}"):
        EVONTrainer(model=tiny_bert(), args=config(tmp_path), train_dataset=classification_data(8))


def test_trainer_decides_whether_the_loss_shifts_labels(tmp_path):
    """The Trainer counts ``num_items_in_batch`` from ``labels[..., 1:]`` when its
    ``_loss_shifts_labels`` is set; the EVON trainer sets it for causal LMs whose ``loss_type``
    does not say so (GPT-2), so the count matches the shifted loss."""
    plain = Trainer(model=tiny_gpt2(), args=config(tmp_path / "a"))
    labels = torch.tensor([[5, 6, -100, 7], [-100, 8, 9, -100]])
    batch = {"input_ids": labels.clamp_min(0), "labels": labels}
    plain._loss_shifts_labels = True
    assert int(plain._get_num_items_in_batch([batch], torch.device("cpu"))) == 4  # labels[:, 1:] != -100
    plain._loss_shifts_labels = False
    assert int(plain._get_num_items_in_batch([batch], torch.device("cpu"))) == 5
    evon = EVONTrainer(model=tiny_gpt2(), args=config(tmp_path / "b"))
    assert evon._loss_shifts_labels is True and evon._causal_lm


def test_the_trainers_evaluation_runs_the_model_as_evons_own_passes_do(tmp_path):
    """EVON's own passes (BMA evaluation, ``predict(bma=True)``, the calibration) take the model from
    ``Trainer._wrap_model(model, training=False)`` and each batch through ``Trainer._prepare_inputs``
    (``TrainerInternals._evon_eval_model``, ``_evon_prepared``), as the Trainer's evaluation does:
    ``evaluate()`` calls both so, the batches prepared once each."""
    calls: list[tuple] = []

    class Recording(Trainer):
        def _wrap_model(self, model, training=True, dataloader=None):  # noqa: ANN001, ANN202
            calls.append(("wrap", training))
            return super()._wrap_model(model, training=training, dataloader=dataloader)

        def _prepare_inputs(self, inputs):  # noqa: ANN001, ANN202
            calls.append(("prepare", inputs["input_ids"].shape[0]))
            return super()._prepare_inputs(inputs)

    trainer = Recording(
        model=tiny_bert(), args=config(tmp_path / "a", per_device_eval_batch_size=4), eval_dataset=classification_data(12)
    )
    trainer.evaluate()
    assert calls[0] == ("wrap", False)
    assert [c for c in calls if c[0] == "prepare"] == [("prepare", 4)] * 3  # 12 rows, batches of 4
    evon = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "b"), eval_dataset=classification_data(12))
    assert evon._evon_eval_model() is evon._wrap_model(evon.model, training=False)
    batch = next(iter(evon.get_eval_dataloader()))
    prepared, expected = evon._evon_prepared(dict(batch)), evon._prepare_inputs(dict(batch))
    assert prepared.keys() == expected.keys() and all(torch.equal(prepared[k], expected[k]) for k in expected)


def test_a_step_evon_skips_does_not_advance_the_trainers_schedule(tmp_path):
    """The Trainer builds its scheduler after accelerate wraps the optimizer, and torch's LRScheduler keeps
    on that wrapper its own ``step`` around the wrapper class's: the class swap of prepare_distributed
    (at on_train_begin) then never reached EVON's ``step_was_skipped`` bookkeeping, and a step EVON
    skipped (a NaN loss) advanced the linear schedule as if it had happened. The schedule holds still at
    the skipped step: the rates used are those of a run one step shorter, from there on."""
    import warnings

    class NaNAtStep2(EVONTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
            loss = super().compute_loss(model, inputs, False, num_items_in_batch)
            return loss * float("nan") if self.state.global_step == 2 else loss

    args = config(tmp_path, max_steps=6, lr_scheduler_type="linear", logging_steps=1, bma_num_samples=0)
    trainer = NaNAtStep2(model=tiny_bert(), args=args, train_dataset=classification_data())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert trainer.evon_optimizer.skipped_steps == 1
    rates = [log["evon/learning_rate"] for log in trainer.state.log_history if "loss" in log]
    base = rates[0]
    expected = [base * f for f in (6 / 6, 5 / 6, 4 / 6, 4 / 6, 3 / 6, 2 / 6)]  # held at the skipped 3rd step
    assert rates == pytest.approx(expected, rel=1e-6)
