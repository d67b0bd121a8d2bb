"""BMA predictions for the EVON trainers: ``predict(test, bma=True)``, the averaged probabilities
of ``bma_num_samples`` posterior samples (the passes of :mod:`hf_evon.trainer.evaluation`), scored
by the user's ``compute_metrics`` and by the ``{prefix}_bma_*`` metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import time
import typing
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers.trainer_utils import EvalPrediction, PredictionOutput, denumpify_detensorize, speed_metrics

from hf_evon.modeling import (
    OutputKind,
    in_auto_mapping,
    model_class,
    output_kind,
    peft_base_model,
    problem_type,
    unwrap_model,
)
from hf_evon.predictive.calibration import trained_posterior
from hf_evon.predictive.logprobs import LogMeanExp, PerOutput, ValueMean, float64_log_softmax, tempered
from hf_evon.predictive.uncertainty import (
    PredictiveSpread,
    PredictiveUncertainty,
    SpreadAccumulator,
    UncertaintyAccumulator,
)
from hf_evon.trainer.combined import buffers_generations
from hf_evon.trainer.evaluation import (
    MetricAccumulator,
    batch_labels,
    gathered_rows,
    merge_metrics,
    reduce_log_probs,
    sample_passes,
    task_of,
)

Tensor = torch.Tensor

__all__ = ["PredictionMixin", "bma_predict"]


def _kind_of_unset(logits: Tensor, labels: Tensor | None, caller: str) -> OutputKind:
    """:func:`~hf_evon.modeling.output_kind` of a model without ``config.problem_type``: one output a value, several a
    class distribution; ValueError where several come with floating-point labels, which are multi-label
    targets, regression values or soft class targets alike, each averaged otherwise (sigmoids, values,
    softmaxes): only the model's problem_type says which."""
    if logits.shape[-1] == 1:
        return OutputKind.VALUE
    if isinstance(labels, Tensor) and labels.is_floating_point():
        raise ValueError(
            f"{caller}: the model has no config.problem_type and its labels are floating point "
            f"({labels.dtype}, shape {tuple(labels.shape)}) beside logits {tuple(logits.shape)}: multi-label "
            "targets (a sigmoid per label), regression values and soft class targets (a softmax) are averaged "
            "differently. Give the model a config naming its problem_type: 'multi_label_classification', "
            "'regression' or 'single_label_classification' (model.config = transformers.PretrainedConfig("
            "problem_type=...) for a plain module)"
        )
    return OutputKind.SOFTMAX


def _refuse_classes_not_last(model: nn.Module, caller: str) -> None:
    """ValueError naming ``caller`` and the model class where BMA's softmax over the logits' last dimension
    would not be over classes: transformers' semantic segmentation models, whose logits are per pixel,
    (B, classes, H, W), and its instance and universal segmentation models that declare no ``logits``
    (Mask2Former, MaskFormer, OneFormer: ``masks_queries_logits`` (B, queries, H, W) are per-pixel mask
    logits, a sigmoid each). A DETR's ``logits`` are its class logits, and it is kept."""
    cls = model_class(peft_base_model(unwrap_model(model)))
    name = cls.__name__
    if in_auto_mapping(name, "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES"):
        raise ValueError(
            f"{caller}: {name}'s logits are per pixel, (batch, classes, height, width), and BMA averages a "
            "softmax over the logits' last dimension: semantic segmentation models are not supported; average "
            "softmax(logits, dim=1) of the passes under `with posterior.sampled(model, seed=s)` instead"
        )
    mask_queries = in_auto_mapping(name, "MODEL_FOR_INSTANCE_SEGMENTATION_MAPPING_NAMES") or in_auto_mapping(
        name, "MODEL_FOR_UNIVERSAL_SEGMENTATION_MAPPING_NAMES"
    )
    if mask_queries and "masks_queries_logits" in _declared_output_fields(cls):
        raise ValueError(
            f"{caller}: {name}'s output is class_queries_logits and masks_queries_logits (per-pixel mask logits, "
            "(batch, queries, height, width)), no logits, and BMA averages a softmax over each one's last "
            "dimension: mask-query segmentation models are not supported; average the passes' post-processed "
            "outputs under `with posterior.sampled(model, seed=s)` instead"
        )


def _declared_output_fields(cls: type) -> set[str]:
    """The fields of the output dataclass(es) ``cls.forward`` declares it returns (empty where it declares
    none, a dict say)."""
    try:
        returned = inspect.signature(cls.forward).return_annotation
    except (TypeError, ValueError):
        return set()
    return {
        field.name
        for kind in typing.get_args(returned) or (returned,)
        if isinstance(kind, type) and dataclasses.is_dataclass(kind)
        for field in dataclasses.fields(kind)
    }


def bma_predict(
    trainer: Any,
    dataloader: Any,
    posterior: Any,
    metric_key_prefix: str = "test",
    uncertainty: bool = False,
    loss_only: bool = False,
) -> PredictionOutput:
    """BMA predictions: the averaged probabilities ``p̄ = 1/S Σ_s softmax(logits_s)`` for every input;
    for a regression (``problem_type`` "regression", or one output) the averaged outputs, for a
    multi-label classifier the averaged sigmoid probabilities (:func:`~hf_evon.modeling.output_kind`). A model without
    ``problem_type`` whose several outputs come with floating-point labels is refused
    (:func:`_kind_of_unset`).

    ``predictions`` has the shape of the model's logits (batches concatenated, padded with -100
    like ``Trainer.predict``; through ``preprocess_logits_for_metrics`` if the trainer has one),
    ``label_ids`` the labels (if any: those of the trainer's ``label_names``, a tuple where there are
    several, as ``Trainer.predict``'s), ``metrics`` your ``compute_metrics`` of them (prefixed as
    ``Trainer.predict`` prefixes them) and the ``{prefix}_bma_*`` metrics where the task has them.
    A model whose output has several distributions and no ``logits`` (extractive QA:
    ``start_logits``, ``end_logits``) gets a tuple of averaged probabilities in that order, as
    ``Trainer.predict`` returns its logits.

    ``uncertainty=True`` (a softmax's classes only): ``predictions`` is a
    :class:`~hf_evon.predictive.uncertainty.PredictiveUncertainty` of arrays instead, every input's
    (an LM's: every position's) total, aleatoric and epistemic entropy, shaped like the logits
    without their classes (padded with -100 as the probabilities are); your ``compute_metrics``,
    which reads probabilities, is not called. A regression's (kind "value") is a
    :class:`~hf_evon.predictive.uncertainty.PredictiveSpread` of arrays shaped like its outputs: the
    averaged outputs (``predictions`` without ``uncertainty``, before ``preprocess_logits_for_metrics``)
    and the samples' standard deviation; a multi-label classifier, or several distributions, are refused.

    ``loss_only`` (``args.prediction_loss_only``, as ``Trainer.predict`` reads it): no predictions and
    no labels are gathered or returned (None), and neither ``preprocess_logits_for_metrics`` nor
    ``compute_metrics`` is called; ``metrics`` holds the ``{prefix}_bma_*`` ones, the BMA's losses.
    """
    caller = "predict_uncertainty()" if uncertainty else "predict(bma=True)"
    _refuse_classes_not_last(trainer.model, caller)
    args = trainer.args
    wanted = set() if loss_only else set(getattr(args, "include_for_metrics", None) or ())
    if "loss" in wanted and trainer.compute_metrics is not None and not uncertainty:
        raise ValueError(
            "predict(bma=True) has no per-batch loss for include_for_metrics=['loss'] (the BMA predictions "
            "average probabilities, not losses): leave 'loss' out, or call predict() for the mean's"
        )
    # the model's main inputs for compute_metrics (include_for_metrics=["inputs"]), as Trainer.predict
    main_input = getattr(trainer.model, "main_input_name", "input_ids") if "inputs" in wanted else None
    input_ids: Any = None
    # a posterior without noise: every sample is the mean, and one pass is their average
    seeds: list[int | None] = (
        [None] if posterior.is_point_mass else [args.bma_seed + s for s in range(args.bma_num_samples)]
    )
    pad = trainer.accelerator.pad_across_processes
    predictions: Any = None
    label_ids: Any = None
    metrics_acc: MetricAccumulator | None = None
    checked = False
    description = f"BMA prediction ({len(seeds)} posterior samples)"
    kind: OutputKind | None = None  # decided after the first forward (transform_one)

    outputs = 1  # the model's distributions per input (2 for extractive QA's start and end)
    concat = args.eval_do_concat_batches

    def joined(total: Any, part: Any) -> Any:
        """The batches so far and ``part``, a list (:func:`_concatenated` joins them at the end, as
        ``Trainer.predict`` concatenates them, with ``eval_do_concat_batches``)."""
        total = [] if total is None else total
        total.append(part)
        return total

    def transform_one(logits: Tensor, labels: Tensor | None) -> Tensor:
        nonlocal kind
        if kind is None:
            # read after the forward: a transformers model whose problem_type is unset sets it from
            # its first labelled batch (float labels: multi-label); still unset (no labels), one output
            # is a value, several a class distribution
            kind = output_kind(trainer.model) or _kind_of_unset(logits, labels, caller)
        if kind is OutputKind.VALUE:
            return logits.double()
        if kind is OutputKind.SIGMOID:
            return torch.sigmoid(tempered(logits, posterior).double())
        return float64_log_softmax(tempered(logits, posterior))

    def transform(logits: Tensor | tuple[Tensor, ...], labels: Tensor | None) -> Tensor | tuple[Tensor, ...]:
        nonlocal outputs
        if isinstance(logits, Tensor):
            return transform_one(logits, labels)
        outputs = len(logits)
        return tuple(transform_one(part, None) for part in logits)

    def average() -> Any:
        if uncertainty:
            if kind is OutputKind.SIGMOID or outputs != 1:
                problem = problem_type(trainer.model)
                raise ValueError(
                    "predict_uncertainty needs a model with one softmax output (a classifier or an LM: "
                    "entropies) or a regression's values (their mean and spread); this model's output is "
                    f"{outputs} distribution(s) of kind {kind.value!r}"
                    + (f" (its problem_type {problem!r})" if kind is not OutputKind.SOFTMAX and problem else "")
                    + (
                        ": a label's sigmoid p is the two classes [1 - p, p], whose samples' entropies "
                        "hf_evon.predictive_uncertainty splits (docs/usage.md#epistemic-uncertainty)"
                        if kind is OutputKind.SIGMOID else ""
                    )
                )
            return SpreadAccumulator() if kind is OutputKind.VALUE else UncertaintyAccumulator()
        make = LogMeanExp if kind is OutputKind.SOFTMAX else ValueMean
        return make() if outputs == 1 else PerOutput([make() for _ in range(outputs)])

    def gathered(values: Tensor, rows: int) -> Tensor:
        # as Trainer.predict pads its logits: a sequence's (a token classifier's, a question answerer's start
        # and end) as long as the longest process's; a classifier's (B, classes) is as wide on every process
        if values.ndim >= 2:
            values = pad(values, dim=1, pad_index=-100)
        return gathered_rows(trainer.accelerator, values, rows).cpu()  # a batch at a time: the predictions are large

    def collected(logp: Tensor | tuple[Tensor, ...], labels: Any, rows: int) -> Any:
        """Probabilities (or values), through the user's ``preprocess_logits_for_metrics`` as
        ``Trainer.predict`` passes its logits, gathered over processes."""
        def convert(x: Tensor) -> Tensor:
            return (x.exp() if kind is OutputKind.SOFTMAX else x).float()

        probs = tuple(map(convert, logp)) if isinstance(logp, tuple) else convert(logp)
        if trainer.preprocess_logits_for_metrics is not None:
            probs = trainer.preprocess_logits_for_metrics(probs, labels)
        return tuple(gathered(p, rows) for p in probs) if isinstance(probs, tuple) else gathered(probs, rows)

    for done, inputs, rows in sample_passes(trainer, dataloader, posterior, seeds, transform, description, average):
        logp = done.value()
        entropies = (done.spread() if kind is OutputKind.VALUE else done.uncertainty()) if uncertainty else None
        del done  # one chunk's accumulators alive at a time
        labels = batch_labels(trainer, inputs)  # a tuple where there are several (QA's start and end)
        if not isinstance(logp, tuple):  # the class metrics: of one softmax's log p̄ only
            if isinstance(labels, Tensor) and not checked:
                task = task_of(logp, labels, trainer._causal_lm) if kind is OutputKind.SOFTMAX else None
                metrics_acc = None if task is None else MetricAccumulator(trainer, task)
            checked = True
            if metrics_acc is not None and isinstance(labels, Tensor):
                metrics_acc.add(reduce_log_probs(logp, labels, metrics_acc.task), labels, rows)
        if loss_only:  # the BMA metrics only, as Trainer.prediction_step returns the loss only
            continue
        if entropies is not None:
            parts = tuple(gathered(x.float(), rows) for x in entropies)
        else:
            parts = collected(logp, labels, rows)
        predictions = joined(predictions, parts)
        if labels is not None:
            if isinstance(labels, tuple):
                labels = tuple(gathered(y, rows) for y in labels)
            else:
                labels = gathered(labels, rows)
            label_ids = joined(label_ids, labels)
        if main_input is not None and isinstance(inputs.get(main_input), Tensor):
            part = gathered(inputs[main_input], rows)
            input_ids = joined(input_ids, part)
    if concat:
        predictions, label_ids, input_ids = map(_concatenated, (predictions, label_ids, input_ids))
    tensors = (predictions, label_ids, input_ids)
    if uncertainty and predictions is not None:  # per field: one tensor, or the batches' (a list)
        fields = list(predictions) if concat else [list(f) for f in zip(*predictions)]
        predictions = (PredictiveSpread if kind is OutputKind.VALUE else PredictiveUncertainty)(*map(_arrays, fields))
    else:
        predictions = _arrays(predictions)
    label_ids = _arrays(label_ids)
    metrics: dict[str, float] = {}
    if not uncertainty:  # compute_metrics reads the arrays returned (each copied to the host once)
        values = tensors if trainer.args.batch_eval_metrics else (predictions, label_ids, _arrays(input_ids))
        metrics = _user_metrics(trainer, *values, metric_key_prefix)
    if metrics_acc is not None:
        merge_metrics(metrics, {f"{metric_key_prefix}_bma_{k}": v for k, v in metrics_acc.summary().items()})
    return PredictionOutput(predictions=predictions, label_ids=label_ids, metrics=metrics)


def _concatenated(parts: list[Any] | None) -> Any:
    """The batches' ``parts`` (tensors, or tuples of them) concatenated along the first dimension,
    each padded with -100 along the second to the longest, as ``nested_concat`` folds them batch
    after batch, in one copy: folded, every earlier batch is copied again at each batch."""
    if parts is None:
        return None
    first = parts[0]
    if isinstance(first, tuple):
        return tuple(_concatenated([part[i] for part in parts]) for i in range(len(first)))
    parts = [torch.atleast_1d(part) for part in parts]
    if first.ndim <= 1 or all(part.shape[1] == parts[0].shape[1] for part in parts):
        return torch.cat(parts)
    width = max(part.shape[1] for part in parts)
    out = parts[0].new_full((sum(len(part) for part in parts), width, *parts[0].shape[2:]), -100)
    row = 0
    for part in parts:
        out[row : row + len(part), : part.shape[1]] = part
        row += len(part)
    return out


def _arrays(values: Tensor | tuple[Tensor, ...] | list[Any] | None) -> Any:
    """``values`` as numpy arrays (a tuple of them for a tuple, a list for a list of batches), as
    ``Trainer.predict`` returns them."""
    if isinstance(values, list):
        return [_arrays(v) for v in values]
    if isinstance(values, tuple):
        return tuple(v.cpu().numpy() for v in values)
    return None if values is None else values.cpu().numpy()


def _user_metrics(trainer: Any, predictions: Any, label_ids: Any, inputs: Any, prefix: str) -> dict[str, float]:
    """The user's ``compute_metrics`` of the BMA predictions (and ``inputs``, the model's main inputs
    where ``include_for_metrics`` asks for them), keys prefixed as ``Trainer.predict`` prefixes them;
    with ``batch_eval_metrics`` one call over the whole set (``compute_result``). The values as
    ``compute_metrics`` takes them: the Trainer hands it numpy arrays of the whole set, and with
    ``batch_eval_metrics`` torch tensors of each batch (a compute_metrics written for that mode uses
    torch operations), here the set's."""
    if trainer.compute_metrics is None or predictions is None or label_ids is None:
        return {}
    prediction = EvalPrediction(predictions=predictions, label_ids=label_ids, inputs=inputs)
    if trainer.args.batch_eval_metrics:
        metrics = trainer.compute_metrics(prediction, compute_result=True)
    else:
        metrics = trainer.compute_metrics(prediction)
    # Python numbers, as Trainer.predict reports them: a numpy scalar or tensor does not serialise (save_metrics)
    metrics = denumpify_detensorize(dict(metrics))
    return {k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in metrics.items()}


def _refuse_unknown_keywords(method: Any, kwargs: dict[str, Any]) -> None:
    """TypeError naming the ``kwargs`` that ``method`` (the subclass's ``predict``) does not take: the
    BMA predictions do not call it, and a keyword it would refuse must not pass unnoticed."""
    parameters = inspect.signature(method).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    unknown = sorted(set(kwargs) - {p.name for p in parameters})
    if unknown:
        raise TypeError(
            f"predict(bma=True) got unexpected keyword argument(s) {', '.join(map(repr, unknown))}: "
            f"{getattr(method, '__qualname__', 'predict')} takes no such keyword"
        )


def _refuse_generated_batches(trainer: Any, call: str) -> None:
    """ValueError for a trainer that buffers generations (TRL's GRPO, RLOO): its ``_prepare_inputs``
    turns a batch of prompts into the completions it generates and their rewards, not the model's
    inputs, so the sampled forwards would fail on a missing ``input_ids``."""
    if buffers_generations(trainer):
        raise ValueError(
            f"{call}: the batches of {type(trainer).__name__} are prompts, which it prepares into generated "
            "completions and rewards, not the model's inputs: there are no predictions to average; decode "
            "with the posterior by hf_evon.generate_bma, or use predict() without bma"
        )


class PredictionMixin:
    """``predict(bma=True)`` and ``predict_uncertainty`` of :class:`~hf_evon.trainer.EVONTrainerMixin`."""

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        bma: bool = False,
        **kwargs: Any,
    ) -> Any:
        """The subclass's ``predict`` (at the posterior mean), or with ``bma=True`` BMA predictions.

        ``bma=True``: ``predictions`` are the averaged probabilities ``1/S Σ_s softmax(logits_s)``
        over ``bma_num_samples`` posterior samples (seeds ``bma_seed + s``), shaped like the
        model's logits (the logits alone: an encoder-decoder's encoder states, which ``Trainer.predict``
        returns beside them without generation, are not averaged); ``metrics`` holds your ``compute_metrics`` of them and ``{prefix}_bma_*``
        where the task has them (:func:`bma_predict`). As from ``Trainer.predict``: the runtime
        metrics (and ``{prefix}_mem_*`` with ``skip_memory_metrics=False``), the callbacks'
        ``on_predict``, per-batch lists with ``eval_do_concat_batches=False``, no predictions or
        labels (None) with ``prediction_loss_only``.
        ``kwargs``: the subclass's own (``Seq2SeqTrainer``'s generation settings).
        A ``predict()`` inside ``evaluate()`` (an ``on_evaluate`` callback's) is a predict's: no
        ``evaluate()`` metrics are added to it, nor its to the evaluation's.
        """
        with self._evon_outside_evaluate():
            if not bma:
                return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, **kwargs)
            _refuse_unknown_keywords(super().predict, kwargs)  # as the subclass's predict would
            self._warn_calibration_split(test_dataset, "predict(bma=True)")
            _refuse_generated_batches(self, "predict(bma=True)")
            posterior = self._bma_posterior("predict(bma=True)")
            # the tracker names its stage by the function that calls it: both calls stay in this predict
            self._memory_tracker.start()
            try:
                start, dataloader = time.time(), self.get_test_dataloader(test_dataset)
                output = bma_predict(
                    self, dataloader, posterior, metric_key_prefix, loss_only=bool(self.args.prediction_loss_only)
                )
            except BaseException:
                self._memory_tracker.stop_and_update_metrics()  # free for the next call's stage
                raise
            self._memory_tracker.stop_and_update_metrics(output.metrics)
            return self._reported(output, start, dataloader, metric_key_prefix)

    @contextlib.contextmanager
    def _evon_outside_evaluate(self) -> Iterator[None]:
        outer, self._evon_in_evaluate = self._evon_in_evaluate, False
        try:
            yield
        finally:
            self._evon_in_evaluate = outer

    def predict_uncertainty(
        self, test_dataset: Any, metric_key_prefix: str = "test", calibrated_scale: bool = False
    ) -> PredictionOutput:
        """Each input's uncertainty under ``bma_num_samples`` posterior samples: ``predictions`` is a
        :class:`~hf_evon.predictive.uncertainty.PredictiveUncertainty` of arrays (``total``,
        ``aleatoric``, ``epistemic``: entropies in nats, one per input, an LM's one per position),
        ``label_ids`` the labels, ``metrics`` the ``{prefix}_bma_*`` metrics (:func:`bma_predict`).
        A regression's (``config.problem_type`` "regression", or one output and none set) is a
        :class:`~hf_evon.predictive.uncertainty.PredictiveSpread` of arrays shaped like its outputs:
        ``mean``, ``predict(bma=True)``'s predictions from the same seeds ``bma_seed + s``, and ``std``,
        the samples' standard deviation; a multi-label classifier's sigmoids are refused.

        ``epistemic`` (the samples' disagreement) is what flags inputs unlike the training data.
        The samples are drawn at the noise scale EVON trained, at the calibrated temperature: a
        calibration chooses its scale by the NLL on data like the training data and often keeps
        the mean, whose samples never disagree (docs/usage.md#epistemic-uncertainty).
        ``calibrated_scale=True`` draws at the calibrated scale, as ``predict(bma=True)`` does.

        ``args.prediction_loss_only`` does not apply: the arrays are what this is called for, so they and
        the labels are returned under it too (``predict``, as ``Trainer.predict``, returns None for both).
        """
        _refuse_generated_batches(self, "predict_uncertainty()")
        posterior = self._bma_posterior("predict_uncertainty()")
        if not calibrated_scale:
            posterior = trained_posterior(posterior)
        start, dataloader = time.time(), self.get_test_dataloader(test_dataset)
        output = bma_predict(self, dataloader, posterior, metric_key_prefix, uncertainty=True)
        return self._reported(output, start, dataloader, metric_key_prefix)

    def _reported(self, output: PredictionOutput, start: float, dataloader: Any, prefix: str) -> PredictionOutput:
        """``output`` with what ``Trainer.predict`` adds to its own: the runtime metrics (from
        ``start``, per example and batch where the set has a length) and the callbacks'
        ``on_predict`` event with the metrics."""
        try:
            rows = self.num_examples(dataloader)
        except (TypeError, AttributeError):  # an iterable dataset: the rows predicted, as Trainer.predict counts them
            seen = output.predictions if output.predictions is not None else output.label_ids
            batches = seen if isinstance(seen, list) else [] if seen is None else [seen]  # per batch, or one array
            rows = sum(map(len, batches)) if batches else None
        steps = None if rows is None else math.ceil(rows / (self.args.eval_batch_size * self.args.world_size))
        output.metrics.update(speed_metrics(prefix, start, num_samples=rows, num_steps=steps))
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, output.metrics)
        return output

    # inside _holding_posterior: the posterior every pass of the enclosed call samples
    _evon_held_posterior: Any = None

    @contextlib.contextmanager
    def _holding_posterior(self, posterior: Any) -> Iterator[None]:
        """``posterior`` for every pass of the enclosed call (:meth:`_evaluated_posterior`; None: the
        one held already, if any): a snapshot of the optimizer's posterior copies all its factors, and
        nothing changes them while one evaluation or prediction runs, so one serves its checks and passes."""
        held = self._evon_held_posterior
        if posterior is not None:
            self._evon_held_posterior = posterior
        try:
            yield
        finally:
            self._evon_held_posterior = held

    def _evaluated_posterior(self) -> Any:
        """The posterior held for the running call (:meth:`_holding_posterior`), else ``current_posterior()``."""
        held = self._evon_held_posterior
        return self.current_posterior() if held is None else held

    def _no_posterior(self) -> str:
        """Why :meth:`_evaluated_posterior` is None, and the way to one."""
        given = "pass posterior=EVONPosterior.from_pretrained(...) to the trainer"
        if self.posterior is not None:  # held, but its mean is not the model's weights (_held_posterior)
            return (
                "the one held (posterior=, or the best checkpoint's) was taken at other weights than the model's "
                "(the PosteriorMeanWarning above names them): load the weights it was taken at, or set "
                "trainer.posterior to these weights' posterior"
            )
        opt = self.evon_optimizer
        if opt is not None and not any(g["algorithm"] == "evon" and g["params"] for g in opt.param_groups):
            # e.g. PEFT's prompt or prefix tuning: one embedding, which AdamW owns by default
            return (
                "EVON trains none of the model's parameters (every trainable tensor went to AdamW), so the "
                f"run has no posterior: train matrices (LoRA) or name them in evon_patterns, or {given}"
            )
        if opt is not None and not any(p.requires_grad for g in opt.param_groups if g["algorithm"] == "evon" for p in g["params"]):
            # a frozen matrix EVON never updated is a point estimate (EVONPosterior covers none of them)
            return (
                "every matrix EVON owns is frozen and EVON never updated one, so each is a point estimate and "
                f"the run has no posterior: unfreeze them and train, or {given}"
            )
        return f"train with EVON first, or {given}"

    def _bma_posterior(self, caller: str) -> Any:
        """The posterior BMA samples (:meth:`_evaluated_posterior`); ValueError naming ``caller`` where
        there is none or ``bma_num_samples`` asks for no samples."""
        posterior = self._evaluated_posterior()
        if posterior is None:
            raise ValueError(f"{caller} needs a posterior: {self._no_posterior()}")
        if self.args.bma_num_samples < 1:
            raise ValueError(
                f"{caller} needs posterior samples, but EVONConfig.bma_num_samples = "
                f"{self.args.bma_num_samples}: set it to >= 1"
            )
        return posterior
