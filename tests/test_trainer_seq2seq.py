"""EVONSeq2SeqTrainer (EVONTrainerMixin + Seq2SeqTrainer) on a tiny T5 built from a config, CPU."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import entered_strategies, load_where_never_built, tiny_whisper_config
from datasets import Dataset
from transformers import T5Config, T5ForConditionalGeneration, TrainerCallback

from hf_evon import EVON
from hf_evon.trainer import EVONSeq2SeqConfig, EVONSeq2SeqTrainer
from hf_evon.trainer.evaluation import PosteriorEvaluation


def tiny_t5() -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return T5ForConditionalGeneration(config)


def reversal_data(n: int, seed: int) -> Dataset:
    """Targets are the reversed inputs; some targets are shorter (label padding is -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 64, (n, 6), generator=g)
    labels = ids.flip(-1).clone()
    labels[::3, 4:] = -100
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def _direct_token_nll(model, data: Dataset) -> float:
    batch = {k: torch.tensor(v) for k, v in data[:].items()}
    model.eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(**batch).logits.double(), -1)
    labels = batch["labels"]
    keep = labels.ne(-100)
    return float(-logp[keep].gather(-1, labels[keep][:, None]).mean())


@pytest.mark.parametrize("generate", [False, True])
def test_seq2seq_trainer_trains_with_evon_and_reports_posterior_metrics(tmp_path, generate, monkeypatch):
    evaluation = reversal_data(12, seed=1)
    args = EVONSeq2SeqConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=3, per_device_train_batch_size=8,
        per_device_eval_batch_size=16, evon_learning_rate=2e-2, evon_adamw_learning_rate=1e-3, evon_ess=300.0,
        evon_hess_init=1.0, lr_scheduler_type="constant", save_strategy="no", disable_tqdm=True,
        bma_num_samples=2, predict_with_generate=generate, generation_max_length=7, seed=0,
    )  # fmt: skip
    trainer = EVONSeq2SeqTrainer(
        model=tiny_t5(), args=args, train_dataset=reversal_data(32, seed=0), eval_dataset=evaluation,
        compute_metrics=(lambda p: {"rows": float(len(p.predictions))}) if generate else None,
    )  # fmt: skip
    trainer.train()
    assert isinstance(trainer.evon_optimizer, EVON) and trainer.evon_optimizer.skipped_steps == 0

    def no_second_mean_pass(self, dataloader):
        raise AssertionError("the Trainer's own pass should have been reused")

    monkeypatch.setattr(PosteriorEvaluation, "_own_mean_pass", no_second_mean_pass)
    metrics = trainer.evaluate()
    # the mean metrics come from the loss forward of the Trainer's own pass (not from generate()'s)
    assert metrics["eval_mean_nll"] == pytest.approx(_direct_token_nll(trainer.model, evaluation), rel=1e-5)
    assert metrics["eval_loss"] == pytest.approx(
        metrics["eval_mean_nll"], rel=1e-5
    )  # one batch: T5's own mean
    assert 0.0 <= metrics["eval_mean_accuracy"] <= 1.0 and math.isfinite(metrics["eval_bma_nll"])
    assert abs(metrics["eval_bma_nll"] - metrics["eval_mean_nll"]) > 1e-5
    if generate:
        assert metrics["eval_rows"] == 12.0  # the user's compute_metrics on generated tokens


def test_the_calibration_runs_an_encoder_decoder_whose_batches_have_no_decoder_inputs(tmp_path):
    """The default collator leaves ``decoder_input_ids`` out (the model derives them from the
    labels in its forward); the calibration's forward drops the labels, so a tiny T5 trained to
    the end failed there with "You must specify exactly one of input_ids or inputs_embeds". Its
    mean NLL is the model's own token NLL on the calibration split."""
    held_out = reversal_data(12, seed=2)
    args = EVONSeq2SeqConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=3, per_device_train_batch_size=8,
        per_device_eval_batch_size=16, save_strategy="no", disable_tqdm=True, bma_num_samples=2, seed=0,
    )  # fmt: skip
    trainer = EVONSeq2SeqTrainer(
        model=tiny_t5(), args=args, train_dataset=reversal_data(32, seed=0), calibration_dataset=held_out
    )
    trainer.train()
    assert trainer.state.global_step == 3 and trainer.calibration is not None
    assert trainer.calibration.mean_nll == pytest.approx(_direct_token_nll(trainer.model, held_out), rel=1e-6)
    assert trainer.calibration.num_targets == sum(v != -100 for row in held_out["labels"] for v in row)


def _generating_trainer(tmp_path, settings: dict | None = None, **fields) -> EVONSeq2SeqTrainer:
    """A tiny T5 trained 3 steps with a wide posterior (samples decode differently from the mean);
    ``settings``: more ``EVONSeq2SeqConfig`` fields."""
    args = EVONSeq2SeqConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=3, per_device_train_batch_size=8,
        per_device_eval_batch_size=4, evon_learning_rate=2e-2, evon_adamw_learning_rate=1e-3, evon_ess=30.0,
        evon_hess_init=1.0, lr_scheduler_type="constant", save_strategy="no", disable_tqdm=True,
        bma_num_samples=3, bma_seed=5, predict_with_generate=True, generation_max_length=7, seed=0,
        **(settings or {}),
    )  # fmt: skip
    trainer = EVONSeq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=reversal_data(32, seed=0), **fields)
    trainer.train()
    return trainer


def _decoded(predictions, width: int, pad: int) -> torch.Tensor:
    """The first ``width`` columns of generated ids, the rest checked to be the trainer's padding."""
    tokens = torch.as_tensor(predictions)
    assert bool((tokens[:, width:] == pad).all())
    return tokens[:, :width]


def test_predict_passes_generation_settings_to_seq2seq_trainer(tmp_path):
    """``Seq2SeqTrainer.predict(test, **gen_kwargs)``: the mixin's predict took no generation
    settings ("unexpected keyword argument 'max_new_tokens'")."""
    trainer = _generating_trainer(tmp_path)
    test = reversal_data(6, seed=3)
    out = trainer.predict(test, max_new_tokens=3)
    model = trainer.model.eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor(test["input_ids"]), max_new_tokens=3)
    assert expected.shape[1] == 4
    assert torch.equal(_decoded(out.predictions, 4, model.config.pad_token_id), expected)


def test_predict_bma_with_generate_decodes_with_generate_bma(tmp_path):
    """``predict(test, bma=True)`` under ``predict_with_generate``: the ids are generate_bma's
    (bma_num_samples samples, seed bma_seed, one draw for every batch of 4), the user's
    compute_metrics scores them, the model is left as it was (weights, no patched generate)."""
    from hf_evon import generate_bma

    seen = []
    trainer = _generating_trainer(tmp_path, compute_metrics=lambda p: seen.append(p.predictions) or {"rows": 6.0})
    test = reversal_data(6, seed=3)
    model = trainer.model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = trainer.predict(test, bma=True)
    posterior = trainer.current_posterior()
    ids = torch.tensor(test["input_ids"])
    expected = generate_bma(model, posterior, ids, num_samples=3, seed=5, max_length=7)
    pad = model.config.pad_token_id
    assert torch.equal(_decoded(out.predictions, expected.shape[1], pad), expected)
    assert out.metrics["test_rows"] == 6.0 and len(seen) == 1 and seen[0] is out.predictions
    # the labels' token metrics, as evaluate() reports them: the mean's and BMA's
    expected_metrics = trainer.posterior_metrics(trainer.get_test_dataloader(test), "test")
    assert expected_metrics["test_bma_nll"] != expected_metrics["test_mean_nll"]
    assert {k: out.metrics[k] for k in expected_metrics} == expected_metrics
    # the samples change the decoding: not the mean's generations
    mean_ids = model.generate(ids, max_length=7)
    assert not torch.equal(expected, mean_ids)
    assert "generate" not in model.__dict__
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("strategy", ["materialize", "factored"])
def test_bma_sample_strategy_reaches_the_decoding_of_predict_and_evaluate(tmp_path, monkeypatch, strategy):
    """The trainer's BMA decoding took no strategy: it always ran generate_bma's "auto", so the tokens
    of a loop over the samples in bfloat16 ("materialize") were out of reach through the trainer.
    ``bma_sample_strategy`` reaches every block that predict(bma=True) and evaluate(bma=True) decode
    with ("materialize": no matrix factored; "factored": every matrix with a basis), and the ids are
    generate_bma's with that strategy."""
    from hf_evon import generate_bma

    rows = lambda p: {"rows": float(len(p.predictions))}  # noqa: E731 - evaluate() decodes for compute_metrics only
    trainer = _generating_trainer(tmp_path, {"bma_sample_strategy": strategy}, compute_metrics=rows)
    test = reversal_data(6, seed=3)
    model, ids = trainer.model.eval(), torch.tensor(test["input_ids"])
    posterior = trainer.current_posterior()
    with_basis = {n for n in posterior.names if posterior[n].Q_L is not None or posterior[n].Q_R is not None}
    assert with_basis
    factored = with_basis if strategy == "factored" else set()
    entered = entered_strategies(monkeypatch)
    out = trainer.predict(test, bma=True)
    assert entered == [(strategy, factored)] * 2  # two batches of at most 4
    entered.clear()
    trainer.evaluate(test, bma=True)
    assert entered == [(strategy, factored)] * 2
    expected = generate_bma(model, posterior, ids, num_samples=3, seed=5, max_length=7, strategy=strategy)
    assert torch.equal(_decoded(out.predictions, expected.shape[1], model.config.pad_token_id), expected)


def test_a_bma_sample_strategy_that_is_no_sample_strategy_is_refused_when_the_config_is_built(tmp_path):
    """``bma_sample_strategy`` is checked by generate_bma's rule when the config is built, the error
    naming the field; a valid one (its string, from the command line too) is held as a SampleStrategy."""
    from transformers import HfArgumentParser

    from hf_evon import SampleStrategy

    common = dict(output_dir=str(tmp_path), report_to="none")
    for bad in ("materialise", 3, ["factored"], True):
        with pytest.raises(ValueError, match=r"^EVONSeq2SeqConfig\.bma_sample_strategy = .* is invalid: it must be None or one of \('auto', 'materialize', 'factored'\)"):
            EVONSeq2SeqConfig(**common, bma_sample_strategy=bad)
    assert EVONSeq2SeqConfig(**common).bma_sample_strategy is None
    for value in (*SampleStrategy, *(s.value for s in SampleStrategy)):
        args = EVONSeq2SeqConfig(**common, bma_sample_strategy=value)
        assert args.bma_sample_strategy is SampleStrategy(value) and args.to_dict()["bma_sample_strategy"] == SampleStrategy(value).value
    argv = ["--output_dir", str(tmp_path), "--report_to", "none", "--bma_sample_strategy", "materialize"]
    (parsed,) = HfArgumentParser(EVONSeq2SeqConfig).parse_args_into_dataclasses(argv)
    assert parsed.bma_sample_strategy is SampleStrategy.MATERIALIZE


def test_predict_bma_with_generate_decodes_with_beam_search(tmp_path):
    """``predict(test, bma=True, num_beams=3)`` (or ``generation_num_beams``): generate_bma refused
    beam search; the ids are now its beam search on the BMA predictive."""
    from hf_evon import generate_bma

    trainer = _generating_trainer(tmp_path)
    test = reversal_data(6, seed=3)
    out = trainer.predict(test, bma=True, num_beams=3)
    model, ids = trainer.model.eval(), torch.tensor(test["input_ids"])
    samples = trainer.current_posterior()
    expected = generate_bma(model, samples, ids, num_samples=3, seed=5, max_length=7, num_beams=3)
    greedy = generate_bma(model, samples, ids, num_samples=3, seed=5, max_length=7)
    assert not torch.equal(expected, greedy)  # the beams change the decoding here
    assert torch.equal(_decoded(out.predictions, expected.shape[1], model.config.pad_token_id), expected)
    assert "generate" not in model.__dict__ and "forward" not in model.__dict__


def test_predict_bma_with_generate_scores_the_batches_of_its_predictions(tmp_path):
    """``predict(test, bma=True)`` under ``predict_with_generate`` with a length-grouped loader
    (train_sampling_strategy="group_by_length", dataloader_drop_last): its test_mean_* and test_bma_*
    passes read the loader anew, each read drawing another order and so dropping other rows, so a
    posterior without noise reported test_bma_nll apart from test_mean_nll. Every pass reads the
    batches of the Trainer's pass."""
    trained = _generating_trainer(tmp_path)
    quiet = trained.current_posterior().with_ess(1e15)  # no noise to speak of: BMA is the mean
    args = EVONSeq2SeqConfig(
        output_dir=str(tmp_path / "p"), report_to="none", use_cpu=True, per_device_eval_batch_size=4,
        disable_tqdm=True, bma_num_samples=2, predict_with_generate=True, generation_max_length=7, seed=0,
        train_sampling_strategy="group_by_length", dataloader_drop_last=True,
    )  # fmt: skip
    trainer = EVONSeq2SeqTrainer(model=trained.model, args=args, posterior=quiet)
    test = reversal_data(10, seed=3)  # batches of 4: each read drops 2 rows of its own order
    for _ in range(2):  # each prediction's passes read one order
        out = trainer.predict(test, bma=True)
        assert len(out.predictions) == 8
        assert out.metrics["test_bma_nll"] == pytest.approx(out.metrics["test_mean_nll"], rel=1e-6)
        assert out.metrics["test_bma_accuracy"] == out.metrics["test_mean_accuracy"]


def test_evaluate_bma_with_generate_scores_generate_bma_ids(tmp_path):
    """``evaluate(bma=True)`` under ``predict_with_generate``: evaluate() always decoded at the mean,
    so a generation metric (BLEU, ROUGE) never saw BMA. With ``bma=True`` compute_metrics scores
    generate_bma's ids; without it, the mean's, as before; the posterior token metrics come with both."""
    from hf_evon import generate_bma

    seen = []
    trainer = _generating_trainer(tmp_path, compute_metrics=lambda p: seen.append(p.predictions) or {"rows": 6.0})
    test = reversal_data(6, seed=3)
    model, ids = trainer.model.eval(), torch.tensor(test["input_ids"])
    pad = model.config.pad_token_id
    bma_metrics = trainer.evaluate(test, bma=True)
    expected = generate_bma(model, trainer.current_posterior(), ids, num_samples=3, seed=5, max_length=7)
    assert torch.equal(_decoded(seen[-1], expected.shape[1], pad), expected)
    mean_metrics = trainer.evaluate(test)
    mean_ids = model.generate(ids, max_length=7)
    assert not torch.equal(expected, mean_ids)
    assert torch.equal(_decoded(seen[-1], mean_ids.shape[1], pad), mean_ids)
    for metrics in (bma_metrics, mean_metrics):
        assert metrics["eval_rows"] == 6.0 and "eval_bma_nll" in metrics and "eval_mean_nll" in metrics
    assert bma_metrics["eval_bma_nll"] == mean_metrics["eval_bma_nll"]  # the labels' token metrics
    assert "generate" not in model.__dict__


def test_predict_bma_with_generate_restores_generate_after_an_error(tmp_path):
    def failing_metrics(_):
        raise RuntimeError("metric failed")

    trainer = _generating_trainer(tmp_path, compute_metrics=failing_metrics)
    with pytest.raises(RuntimeError, match="metric failed"):
        trainer.predict(reversal_data(6, seed=3), bma=True)
    assert "generate" not in trainer.model.__dict__
    # an instance's own generate (what a Hub repo's custom_generate installs) comes back as it was
    own = trainer.model.generate = lambda **kwargs: None
    with pytest.raises(RuntimeError, match="metric failed"):
        trainer.predict(reversal_data(6, seed=3), bma=True)
    assert trainer.model.__dict__["generate"] is own
    trainer.args.bma_num_samples = 0
    with pytest.raises(ValueError, match="bma_num_samples"):
        trainer.predict(reversal_data(6, seed=3), bma=True)


@pytest.mark.parametrize("bma", [False, True])
def test_evaluate_with_generate_keeps_no_decoding_step_logits(tmp_path, monkeypatch, bma):
    """``evaluate()`` under ``predict_with_generate`` reads the mean metrics from the Trainer's pass
    through a forward hook, which kept every forward's output until the batch was done: each
    decoding step's logits (rows x vocabulary, rows: the batch times the beams), which
    ``generate`` itself drops step by step (T5-small's 32k vocabulary, 32 rows, 4 beams, 128 tokens:
    2 GiB a batch). Only the output the metrics read (the loss forward's) is kept; the mean metrics
    are the model's token NLL."""
    import weakref

    from hf_evon.trainer.evaluation import MetricAccumulator

    trainer = _generating_trainer(tmp_path, compute_metrics=lambda p: {"rows": float(len(p.predictions))})
    steps: list = []  # the decoding steps' logits of the batch so far, weakly
    trainer.model.register_forward_hook(
        lambda m, args, out: steps.append(weakref.ref(out.logits)) if out.logits.shape[1] == 1 else None
    )
    seen: list[tuple[int, int]] = []  # per batch: (decoding steps, their logits still alive)
    add = MetricAccumulator.add

    def counted(self, logp, labels, rows=None):  # noqa: ANN001, ANN202
        seen.append((len(steps), sum(ref() is not None for ref in steps)))
        steps.clear()
        return add(self, logp, labels, rows)

    monkeypatch.setattr(MetricAccumulator, "add", counted)
    test = reversal_data(6, seed=3)
    metrics = trainer.evaluate(test, bma=bma, num_beams=2)
    assert metrics["eval_rows"] == 6.0
    assert seen[0][0] >= 6 and seen[1][0] >= 6  # two batches of 4 and 2, 6 steps each at least
    assert [alive for _, alive in seen] == [0] * len(seen)
    assert metrics["eval_mean_nll"] == pytest.approx(_direct_token_nll(trainer.model, test), rel=1e-6)


def test_token_metrics_hold_a_few_numbers_per_token_not_the_vocabulary(tmp_path, monkeypatch):
    """An encoder-decoder's ``eval_mean_*``/``eval_bma_*`` are token metrics over the decoder's
    vocabulary: the accumulators kept every evaluated token's float64 log-probabilities over the
    whole vocabulary until the end (for T5's 32k tokens, 250 KiB a token: gigabytes for a modest
    evaluation set). They hold a few numbers per token, and the metrics are still
    ``calibration_metrics`` of the model's full log-probabilities."""
    from hf_evon.predictive.metrics import calibration_metrics
    from hf_evon.trainer.evaluation import MetricAccumulator
    from hf_evon.trainer.sampled_passes import _nbytes

    held = []
    summary = MetricAccumulator.summary

    def measured(self):
        held.append((_nbytes([t for pair in self.outputs for t in pair]), sum(p[1].numel() for p in self.outputs)))
        return summary(self)

    monkeypatch.setattr(MetricAccumulator, "summary", measured)
    evaluation = reversal_data(12, seed=1)
    args = EVONSeq2SeqConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=2, per_device_train_batch_size=8,
        per_device_eval_batch_size=5, save_strategy="no", disable_tqdm=True, bma_num_samples=2, seed=0,
    )  # fmt: skip
    trainer = EVONSeq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=reversal_data(32, seed=0))
    trainer.train()
    metrics = trainer.evaluate(evaluation)
    vocab = trainer.model.config.vocab_size
    assert len(held) == 2  # the mean's and the BMA's
    for nbytes, positions in held:  # at most 8 float64 a position (the vocabulary's would be 64)
        assert positions == 12 * 6 and nbytes <= positions * 8 * 8 < positions * vocab * 8
    batch = {k: torch.tensor(v) for k, v in evaluation[:].items()}
    with torch.no_grad():
        logp = torch.log_softmax(trainer.model.eval()(**batch).logits.double(), -1)
    reference = calibration_metrics(logp.reshape(-1, vocab), batch["labels"].reshape(-1), "log_probs")
    for key, value in reference.items():
        assert metrics[f"eval_mean_{key}"] == pytest.approx(value, rel=1e-9, abs=1e-12), key


class _Recorder(TrainerCallback):
    """Copies of the metrics ``on_evaluate`` and ``on_predict`` are given, as a logger reads them then."""

    def __init__(self) -> None:
        self.seen: dict[str, dict] = {}

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
        self.seen["evaluate"] = dict(metrics)

    def on_predict(self, args, state, control, metrics=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
        self.seen["predict"] = dict(metrics)


def test_callbacks_see_the_posterior_metrics_of_predict_and_evaluate_bma_with_generate(tmp_path):
    """``predict(test, bma=True)`` under ``predict_with_generate`` added the labels' test_mean_* and
    test_bma_* after ``on_predict`` had run, so callbacks (report_to loggers) never saw them; the
    metrics ``on_predict`` and ``on_evaluate`` get are the ones returned."""
    trainer = _generating_trainer(tmp_path, compute_metrics=lambda p: {"rows": float(len(p.predictions))})
    recorder = _Recorder()
    trainer.add_callback(recorder)
    test = reversal_data(6, seed=3)
    out = trainer.predict(test, bma=True)
    assert "test_bma_nll" in out.metrics and "test_mean_nll" in out.metrics and out.metrics["test_rows"] == 6.0
    assert recorder.seen["predict"] == out.metrics
    metrics = trainer.evaluate(test, bma=True)
    assert "eval_bma_nll" in metrics and recorder.seen["evaluate"] == metrics
    assert {k: v for k, v in trainer.state.log_history[-1].items() if k != "step"} == metrics  # the logged


class _EvaluatesMidTraining(TrainerCallback):
    """At the end of step ``step``: ``trainer.evaluate(data, bma=True)`` and the stand-alone
    ``posterior_metrics`` of ``data``, on the weights of that step."""

    def __init__(self, trainer: EVONSeq2SeqTrainer, data: Dataset, step: int) -> None:
        self.trainer, self.data, self.step = trainer, data, step
        self.metrics: dict = {}
        self.alone: dict = {}

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if state.global_step == self.step:
            self.metrics = self.trainer.evaluate(self.data, bma=True)
            self.alone = self.trainer.posterior_metrics(self.trainer.get_eval_dataloader(self.data))


@pytest.mark.parametrize("generate", [False, True])
def test_evaluate_bma_true_reports_the_token_bma_metrics_during_training(tmp_path, generate):
    """``evaluate(dev, bma=True)`` without ``predict_with_generate`` dropped ``bma`` (and with it, the
    token BMA metrics followed ``bma_eval_every``): from a callback during ``train()`` with
    bma_eval_every=0 it reported no eval_bma_*. It runs the BMA passes, as ``EVONTrainer.evaluate(bma=True)``
    does; their metrics are the stand-alone ones."""
    dev = reversal_data(8, seed=1)
    args = EVONSeq2SeqConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=3, per_device_train_batch_size=8,
        per_device_eval_batch_size=4, evon_ess=30.0, save_strategy="no", disable_tqdm=True, bma_num_samples=2,
        bma_eval_every=0, predict_with_generate=generate, generation_max_length=7, seed=0,
    )  # fmt: skip
    trainer = EVONSeq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=reversal_data(32, seed=0))
    callback = _EvaluatesMidTraining(trainer, dev, step=1)
    trainer.add_callback(callback)
    trainer.train()
    assert {k for k in callback.alone if k.startswith("eval_bma_")} == {
        f"eval_bma_{m}" for m in ("nll", "accuracy", "ece", "brier")
    }
    for key, value in callback.alone.items():
        assert callback.metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("call", ["evaluate", "predict"])
def test_bma_with_generate_snapshots_the_posterior_once(tmp_path, monkeypatch, call):
    """``evaluate(bma=True)`` under ``predict_with_generate`` took three snapshots of the optimizer's
    posterior (a copy of every factor each), ``predict(bma=True)`` two: one for generate_bma, one
    per check and one for the token metrics' passes. One now, and the metrics are those of the one
    posterior's passes."""
    from hf_evon import EVONPosterior

    trainer = _generating_trainer(tmp_path)
    test = reversal_data(6, seed=3)
    prefix = "eval" if call == "evaluate" else "test"
    expected = trainer.posterior_metrics(trainer.get_test_dataloader(test), prefix)
    taken = []
    snapshot = EVONPosterior.from_optimizer.__func__

    def counted(cls, *args, **kwargs):
        taken.append(1)
        return snapshot(cls, *args, **kwargs)

    monkeypatch.setattr(EVONPosterior, "from_optimizer", classmethod(counted))
    metrics = trainer.evaluate(test, bma=True) if call == "evaluate" else trainer.predict(test, bma=True).metrics
    assert len(taken) == 1
    assert metrics[f"{prefix}_bma_nll"] == pytest.approx(expected[f"{prefix}_bma_nll"], rel=1e-12)


def tiny_whisper():
    from transformers import WhisperForConditionalGeneration

    torch.manual_seed(0)
    return WhisperForConditionalGeneration(tiny_whisper_config())


def tiny_vision_encoder_decoder():
    from transformers import GPT2Config, VisionEncoderDecoderConfig, VisionEncoderDecoderModel, ViTConfig

    torch.manual_seed(0)
    encoder = ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=8,
        patch_size=4, num_channels=3,
    )  # fmt: skip
    decoder = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2, initializer_range=0.5)
    model = VisionEncoderDecoderModel(VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder))
    for config in (model.config, model.generation_config):
        config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 0, 1, 2
    return model


def feature_data(name: str, shape: tuple[int, ...], n: int, seed: int) -> Dataset:
    """Random encoder inputs (log-mel frames, images) and 5 label tokens each."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(3, 64, (n, 5), generator=g)
    return Dataset.from_dict({name: torch.randn(n, *shape, generator=g).tolist(), "labels": labels.tolist()})


@pytest.mark.parametrize("arch", ["whisper", "vision"])
def test_predict_and_evaluate_bma_with_generate_decode_speech_and_vision_inputs(tmp_path, arch):
    """Whisper (``input_features``) and a VisionEncoderDecoder (``pixel_values``) trained 2 steps:
    ``predict(bma=True)`` and ``evaluate(bma=True)`` under ``predict_with_generate`` failed with
    "generate_bma: input_ids must be a (batch, length) tensor of token ids; got NoneType"; their ids
    are generate_bma's on the batch's encoder input."""
    from hf_evon import generate_bma

    model, name, shape = (
        (tiny_whisper(), "input_features", (8, 20)) if arch == "whisper" else
        (tiny_vision_encoder_decoder(), "pixel_values", (3, 8, 8))
    )  # fmt: skip
    args = EVONSeq2SeqConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=2, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, evon_ess=30.0, evon_hess_init=1.0, save_strategy="no", disable_tqdm=True,
        bma_num_samples=3, bma_seed=5, predict_with_generate=True, generation_max_length=6, seed=0,
    )  # fmt: skip
    seen = []
    trainer = EVONSeq2SeqTrainer(
        model=model, args=args, train_dataset=feature_data(name, shape, 8, seed=0),
        compute_metrics=lambda p: seen.append(p.predictions) or {"rows": float(len(p.predictions))},
    )  # fmt: skip
    trainer.train()
    test = feature_data(name, shape, 4, seed=1)
    out = trainer.predict(test, bma=True)
    model = trainer.model.eval()
    features = torch.tensor(test[name])
    samples = trainer.current_posterior()
    expected = generate_bma(model, samples, **{name: features}, num_samples=3, seed=5, max_length=6)
    assert not torch.equal(expected, model.generate(**{name: features}, max_length=6))  # not the mean's
    pad = model.generation_config.pad_token_id
    assert torch.equal(_decoded(out.predictions, expected.shape[1], pad), expected)
    assert out.metrics["test_rows"] == 4.0 and "test_bma_nll" in out.metrics
    metrics = trainer.evaluate(test, bma=True)
    assert torch.equal(_decoded(seen[-1], expected.shape[1], pad), expected)
    assert metrics["eval_rows"] == 4.0 and "eval_bma_nll" in metrics
    assert "generate" not in model.__dict__



def test_whisper_is_scored_without_its_labels_and_a_loss(monkeypatch):
    """Whisper has no ``prepare_decoder_input_ids_from_labels``: bma_log_likelihood (and the
    calibration) handed its forward the labels, from which it derives its decoder inputs, so each
    forward also computed a loss that was thrown away. The decoder inputs are derived as its forward
    derives them (-100 as its pad), the logits are bit for bit those of the labelled forward; labels
    longer than its decoder's positions still reach the forward, which refuses them by its limit."""
    import hf_evon
    from hf_evon import bma_log_likelihood
    from hf_evon.modeling import decoder_inputs_from_labels
    from hf_evon.posterior import EVONPosterior
    from hf_evon.predictive import generation

    model = tiny_whisper().eval()
    posterior = EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, lr=1e-2, ess=30.0, seed=0), model)
    g = torch.Generator().manual_seed(0)
    features, labels = torch.randn(3, 8, 20, generator=g), torch.randint(3, 64, (3, 6), generator=g)
    labels[1, 4:] = -100
    derived = decoder_inputs_from_labels(model, labels)
    assert list(derived) == ["decoder_input_ids"] and int(derived["decoder_input_ids"][1, 5]) == 1  # the pad
    with torch.no_grad():
        logits = model(input_features=features, **derived).logits
        assert torch.equal(logits, model(input_features=features, labels=labels).logits)
    long = torch.full((1, 33), 5)
    assert list(decoder_inputs_from_labels(model, long)) == ["labels"]
    with pytest.raises(ValueError, match="cannot exceed the maximum allowed length of 32"):
        model(input_features=features[:1], **decoder_inputs_from_labels(model, long))
    seen: list[bool] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append("labels" in kwargs), with_kwargs=True)
    scored = bma_log_likelihood(model, posterior, input_features=features, labels=labels, num_samples=3, seed=5)
    assert seen and not any(seen)
    monkeypatch.setattr(generation, "decoder_inputs_from_labels", lambda model, labels: {"labels": labels})
    labelled = bma_log_likelihood(model, posterior, input_features=features, labels=labels, num_samples=3, seed=5)
    assert seen[-1] and torch.equal(scored.token_log_probs, labelled.token_log_probs)
    assert torch.equal(scored.mask, labels.ne(-100))


@pytest.mark.parametrize("arch", ["t5", "whisper"])
def test_bma_passes_of_an_encoder_decoder_derive_its_decoder_inputs_and_compute_no_loss(tmp_path, arch, monkeypatch):
    """The BMA passes handed every forward the labels, from which an encoder-decoder whose batch has
    no decoder inputs derives them, and computed a loss each that was thrown away; so did
    bma_log_likelihood (and the calibration) for a model without ``prepare_decoder_input_ids_from_labels``
    (Whisper). The decoder inputs are now derived as the forward derives them, and the metrics and
    log-likelihoods are bit for bit those of forwards given the labels."""
    from hf_evon import bma_log_likelihood
    from hf_evon.predictive import generation
    from hf_evon.trainer import calibration_data

    if arch == "t5":
        model, name, train, test = tiny_t5(), "input_ids", reversal_data(32, seed=0), reversal_data(12, seed=1)
    else:
        model, name = tiny_whisper(), "input_features"
        train, test = feature_data(name, (8, 20), 8, seed=0), feature_data(name, (8, 20), 12, seed=1)
    args = EVONSeq2SeqConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=2, per_device_train_batch_size=4,
        per_device_eval_batch_size=8, evon_ess=30.0, evon_hess_init=1.0, save_strategy="no", disable_tqdm=True,
        bma_num_samples=3, bma_seed=5, seed=0,
    )  # fmt: skip
    trainer = EVONSeq2SeqTrainer(model=model, args=args, train_dataset=train)
    trainer.train()
    model = trainer.model.eval()
    batch = {k: torch.tensor(v) for k, v in test[:4].items()}
    assert "decoder_input_ids" not in next(iter(trainer.get_eval_dataloader(test)))
    seen: list[bool] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append("labels" in kwargs), with_kwargs=True)

    def run():
        metrics = trainer.posterior_metrics(trainer.get_eval_dataloader(test))
        scored = bma_log_likelihood(
            model, trainer.current_posterior(), **{name: batch[name]}, labels=batch["labels"], num_samples=3, seed=5
        )
        return metrics, scored.token_log_probs

    metrics, token_log_probs = run()
    # 12 rows in batches of 8: the mean's pass, then S = 3 passes, the first forward of which keeps the
    # labels (the config's problem_type is unset: a classifier would set it there); then bma_log_likelihood's
    assert seen[:8] == [False, False, True, False, False, False, False, False] and len(seen) > 8
    assert not any(seen[8:])
    scoring = calibration_data.scoring_inputs
    monkeypatch.setattr(
        calibration_data, "scoring_inputs", lambda model, batch, names, keep=False: scoring(model, batch, names, True)
    )
    monkeypatch.setattr(generation, "decoder_inputs_from_labels", lambda model, labels: {"labels": labels})
    seen.clear()
    labelled_metrics, labelled_log_probs = run()
    assert all(seen[:8]) and seen[-1]  # bma_log_likelihood's scoring forward is its last (after probes)
    assert metrics == labelled_metrics and "eval_bma_nll" in metrics
    assert torch.equal(token_log_probs, labelled_log_probs)


def _sampled_greedy(model, posterior, ids: torch.Tensor, seeds: list[int], steps: int) -> torch.Tensor:
    """Greedy decoding of ``1/S Σ_s softmax(logits_s)`` with sample ``s`` written into the weights by
    ``posterior.sampled(model, seed=s)``, as the token metrics' passes write it; past EOS the pad id,
    as ``generate`` pads finished rows."""
    config = model.config
    decoded = torch.full((len(ids), 1), config.decoder_start_token_id)
    done = torch.zeros(len(ids), dtype=torch.bool)
    for _ in range(steps):
        probs = torch.zeros(len(ids), config.vocab_size, dtype=torch.float64)
        for seed in seeds:
            with torch.no_grad(), posterior.sampled(model, seed=seed):
                logits = model(input_ids=ids, decoder_input_ids=decoded).logits[:, -1]
            probs += torch.softmax(logits.double() / posterior.temperature, dim=-1)
        token = torch.where(done, config.pad_token_id, probs.argmax(-1))
        done |= token == config.eos_token_id
        decoded = torch.cat([decoded, token[:, None]], dim=1)
    return decoded


def test_predict_bma_with_generate_decodes_the_samples_its_token_metrics_average(tmp_path):
    """``predict(test, bma=True)`` under ``predict_with_generate`` decoded with the samples of
    ``posterior.draw(S, seed=bma_seed)`` while its ``test_bma_*`` token metrics averaged those of
    ``posterior.sampled(model, seed=bma_seed + s)``: other weights than the predictions'. The ids are
    greedy decoding of the BMA predictive of the metrics' samples (seeds 5, 6, 7)."""
    trainer = _generating_trainer(tmp_path)
    test = reversal_data(6, seed=3)
    out = trainer.predict(test, bma=True, max_new_tokens=4)
    model, ids = trainer.model.eval(), torch.tensor(test["input_ids"])
    expected = _sampled_greedy(model, trainer.current_posterior(), ids, [5, 6, 7], steps=4)
    assert torch.equal(_decoded(out.predictions, expected.shape[1], model.config.pad_token_id), expected)


def test_predict_bma_with_generate_samples_other_tokens_in_each_batch(tmp_path):
    """``do_sample=True`` under ``predict(test, bma=True)``: every batch sampled its tokens from one
    stream (the same seed each batch), so two batches of the same prompts decoded the same ids. Each
    batch has its own stream now, the call as a whole reproducible."""
    trainer = _generating_trainer(tmp_path)
    half = reversal_data(4, seed=3)  # one batch of 4 (per_device_eval_batch_size), twice
    test = Dataset.from_dict({k: list(half[k]) * 2 for k in half.column_names})
    first = torch.as_tensor(trainer.predict(test, bma=True, do_sample=True, max_new_tokens=5).predictions)
    assert not torch.equal(first[:4], first[4:])
    again = torch.as_tensor(trainer.predict(test, bma=True, do_sample=True, max_new_tokens=5).predictions)
    assert torch.equal(first, again)



OWN_SEQ2SEQ_ARGUMENTS = """
import dataclasses
from transformers import Seq2SeqTrainingArguments

@dataclasses.dataclass
class OwnSeq2SeqArguments(Seq2SeqTrainingArguments):
    predict_with_generate: bool = True
    logging_steps: float = 10
    learning_rate: float = 3e-4
    extra: int = 1
"""


def test_a_subclass_of_seq2seq_training_arguments_combines_with_evon_seq2seq_config(tmp_path, monkeypatch):
    """evon_config_class(OwnSeq2SeqArguments), a subclass of Seq2SeqTrainingArguments, was built from
    (EVONConfig, OwnSeq2SeqArguments): no bma_sample_strategy and no check of it, so EVONSeq2SeqTrainer
    decoded with generate_bma's default whatever the user meant. It combines with the combination its
    base declares, EVONSeq2SeqConfig: the field, its check, the subclass's own defaults, and instances
    that unpickle in a process that has not built the class."""
    import dataclasses

    from hf_evon import SampleStrategy
    from hf_evon.trainer import evon_config_class

    (tmp_path / "own_seq2seq_arguments.py").write_text(OWN_SEQ2SEQ_ARGUMENTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    from own_seq2seq_arguments import OwnSeq2SeqArguments

    combined = evon_config_class(OwnSeq2SeqArguments)
    assert combined.__bases__ == (EVONSeq2SeqConfig, OwnSeq2SeqArguments)
    defaults = {f.name: f.default for f in dataclasses.fields(combined)}
    assert defaults["bma_sample_strategy"] is None
    own = ("predict_with_generate", "logging_steps", "learning_rate", "extra")
    assert tuple(defaults[name] for name in own) == (True, 10, 3e-4, 1)
    common = dict(output_dir=str(tmp_path / "out"), report_to="none")
    with pytest.raises(ValueError, match=r"^EVONSeq2SeqConfig\.bma_sample_strategy = 'materialise' is invalid"):
        combined(**common, bma_sample_strategy="materialise")
    args = combined(**common, bma_sample_strategy="factored", evon_ess=500.0, extra=5)
    assert args.bma_sample_strategy is SampleStrategy.FACTORED
    assert (args.predict_with_generate, args.logging_steps, args.learning_rate) == (True, 10, 3e-4)
    torch.save(args, tmp_path / "training_args.bin")
    loaded = load_where_never_built(monkeypatch, tmp_path / "training_args.bin", "own_seq2seq_arguments")
    assert type(loaded).__name__ == "EVONOwnSeq2SeqArguments"
    assert [c.__name__ for c in type(loaded).__bases__] == ["EVONSeq2SeqConfig", "OwnSeq2SeqArguments"]
    assert type(loaded) is not combined and type(loaded).__bases__[1] is not OwnSeq2SeqArguments  # both built anew
    assert loaded.bma_sample_strategy is SampleStrategy.FACTORED
    assert (loaded.evon_ess, loaded.extra, loaded.predict_with_generate) == (500.0, 5, True)
