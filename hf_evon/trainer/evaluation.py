"""Posterior evaluation for the EVON trainers: metrics at the posterior mean, under BMA, and BMA predictions.

Metric keys (``prefix`` is ``eval`` for ``evaluate()``, ``test`` for ``predict()``), namespaced so
that nothing a user's ``compute_metrics`` returns is replaced (a clash keeps the user's value and
warns):

* ``{prefix}_mean_<m>``: at the posterior mean (the trained weights);
* ``{prefix}_bma_<m>``: under Bayesian model averaging over ``bma_num_samples`` posterior samples
  (sample ``s`` uses seed ``bma_seed + s``), averaging *probabilities*:
  ``log p̄ = logsumexp_s log_softmax(logits_s) − log S`` (:mod:`hf_evon.predictive.logprobs`);

with ``<m>`` = ``nll``, ``accuracy``, ``ece``, ``brier`` for (token) classification (definitions in
:mod:`hf_evon.predictive.metrics`) and ``nll``, ``perplexity`` (mean NLL per label token over the whole set,
and its exp) for causal LMs. The ``Trainer``'s ``eval_loss`` stays the ``Trainer``'s: the average
of per-batch mean losses of the model (label smoothing and custom losses included), each counted over
its shifted labels where the loss shifts them (a GPT-2 without ``loss_type``, whose plain Trainer
counts one token per sequence too many: :mod:`hf_evon.trainer.internals`); compare
``eval_mean_nll`` with ``eval_bma_nll`` (exact per-item means over the whole set) instead.

Cost: the mean metrics reuse the ``Trainer``'s own evaluation pass (its model outputs are read
through a forward hook), so an evaluation costs ``1 + S`` passes; only when that pass yields no
usable outputs (e.g. a custom ``prediction_step`` that skips the model's logits) one more pass at
the mean runs. The BMA passes (:mod:`hf_evon.trainer.sampled_passes`) have their own progress bar.
"""

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from hf_evon.modeling import problem_type
from hf_evon.predictive.logprobs import (
    IGNORE_INDEX,
    NOT_SOFTMAX_PROBLEMS,
    float64_log_softmax,
    label_log_probs,
    shifted,
    tempered,
    widened,
)
from hf_evon.predictive.metrics import (
    CALIBRATION_METRIC_KEYS,
    calibration_metrics,
    item_statistics,
    metrics_of_statistics,
)
from hf_evon.trainer.bma_schedule import bma_due
from hf_evon.trainer.calibration_data import (
    forked,
    forward_logits,
    length_sorted,
    output_field,
    replayed,
    scored_field,
)
from hf_evon.trainer.metric_merge import SearchObjectiveMixin, added_metric_keys, merge_metrics
from hf_evon.trainer.sampled_passes import batch_labels, class_labels, gathered_rows, sample_passes

logger = logging.get_logger(__name__)

Tensor = torch.Tensor

__all__ = [
    "EvaluationMixin",
    "MetricAccumulator",
    "PosteriorEvaluation",
    "batch_labels",
    "class_labels",
    "gathered_rows",
    "merge_metrics",
    "reduce_log_probs",
    "sample_passes",
    "task_of",
]


# ------------------------------------------------------------------------------------------ per batch
def task_of(logits: Tensor, labels: Tensor, causal_lm: bool) -> str | None:
    """``causal_lm``, ``classification``, ``token_classification`` or None (nothing to average). A
    causal LM's logits may be longer than its labels (PEFT's prompt tuning prepends virtual tokens)."""
    if causal_lm and logits.ndim == 3 and labels.ndim == 2:
        return "causal_lm" if logits.shape[1] >= labels.shape[1] else None
    if labels.is_floating_point() or logits.shape[-1] < 2:
        return None  # regression / multi-label: no class distribution to average
    if logits.ndim == 2 and labels.ndim == 1:
        return "classification"
    if logits.ndim == 3 and labels.ndim == 2 and logits.shape[:2] == labels.shape:
        return "token_classification"
    return None


def reduce_log_probs(logp: Tensor, labels: Tensor, task: str) -> Tensor:
    """What the metrics need of full log-probabilities ``logp``: causal LMs keep ``log p(label token)``
    ``(B, T-1)`` (``(B, T)`` after virtual tokens; 0 where not scored); classification keeps ``(B, C)``
    / ``(B, T, C)``. Commutes with the BMA's log-mean-exp."""
    if task == "causal_lm":  # PEFT's prompt tuning: (B, T) after its virtual tokens (``shifted``)
        return label_log_probs(*shifted(logp, labels.to(logp.device), shift=True))
    return logp


def _metric_log_probs(logits: Tensor, labels: Tensor, task: str) -> Tensor:
    """``reduce_log_probs(log_softmax(logits))`` without a float64 copy of an LM's full (float32) logits."""
    if task == "causal_lm":
        picked = reduce_log_probs(torch.log_softmax(widened(logits), dim=-1), labels, task)
        return picked.double()
    return float64_log_softmax(logits)


class MetricAccumulator:
    """Per-batch log-probabilities, gathered across processes on their device (no host sync a batch), summarised."""

    def __init__(self, trainer: Any, task: str) -> None:
        self.task = task
        self.accelerator = trainer.accelerator
        self.pad = trainer.accelerator.pad_across_processes
        self.ece_bins = trainer.args.bma_ece_bins
        self.outputs: list[tuple[Tensor, Tensor]] = []

    def add(self, logp: Tensor, labels: Tensor, rows: int | None = None) -> None:
        """Add one batch. ``rows``: the gathered rows to keep (:func:`~hf_evon.trainer.sampled_passes.
        _kept_rows`, for a batch read earlier); None: ``gather_for_metrics``'s, for the batch the loader stands at."""
        labels = labels.to(logp.device)

        def gather(x: Tensor) -> Tensor:
            return gathered_rows(self.accelerator, x, rows)

        if self.task == "causal_lm":  # the labels each position of ``logp`` scores (from 0 or 1)
            mask = labels[:, labels.shape[1] - logp.shape[1] :].ne(IGNORE_INDEX)
            nll = -(logp * mask).sum(-1)  # per sequence
            stats = torch.stack([nll, mask.sum(-1).double()], dim=-1)  # (B, 2)
            self.outputs.append((gather(stats), torch.empty(0)))
            return
        if self.task == "token_classification":  # a few numbers a token, not its vocabulary's (a decoder's)
            logp, labels = self.pad(item_statistics(logp, labels), dim=1), self.pad(labels, dim=1, pad_index=-100)
        self.outputs.append((gather(logp), gather(labels)))

    def summary(self) -> dict[str, float]:
        # joined on the host once, and kept so: an evaluation whose BMA waits for training's end holds no GPU memory
        flat = self.task == "token_classification"
        values = torch.cat([o.reshape(-1, o.shape[-1]) if flat else o for o, _ in self.outputs]).cpu()
        labels = torch.cat([lab.reshape(-1) if flat else lab for _, lab in self.outputs]).cpu()
        self.outputs = [(values, labels)]
        if self.task == "causal_lm":
            tokens = float(values[:, 1].sum())
            # no label token at all: NaN, as the model's own mean loss (not 0 / perplexity 1)
            nll = float(values[:, 0].sum()) / tokens if tokens > 0 else math.nan
            # exp overflows a float past log(max) ~ 709.78: the perplexity is inf there (as the NLL may be)
            perplexity = math.nan if nll != nll else math.exp(nll) if nll < 709.78 else math.inf
            return {"nll": nll, "perplexity": perplexity}
        if flat:
            kept = labels.ne(IGNORE_INDEX)
            if bool(kept.any()):
                return metrics_of_statistics(values[kept], self.ece_bins)
            return dict.fromkeys(CALIBRATION_METRIC_KEYS, math.nan)  # no label kept, as below
        if not bool(labels.ne(IGNORE_INDEX).any()):  # no label kept: NaN, as an LM's and the model's own loss
            return dict.fromkeys(CALIBRATION_METRIC_KEYS, math.nan)
        return calibration_metrics(values, labels, "log_probs", n_bins=self.ece_bins)


class PosteriorEvaluation:
    """The posterior metrics of one ``evaluate()``: mean metrics read from the Trainer's own pass
    (:meth:`watch` + :meth:`batch`), then the BMA passes (:meth:`finish`)."""

    def __init__(self, trainer: Any, metric_key_prefix: str, with_bma: bool, asked: str | None = None) -> None:
        self.trainer = trainer
        self.asked = asked  # the call that asks for these metrics by name: what they cannot score is its error
        self.prefix = metric_key_prefix
        self.with_bma = with_bma
        self.task: str | None = None
        self.mean: MetricAccumulator | None = None
        self.reused = True  # False where a batch gave no usable model output, or its masks are not drawn again
        self.unsupported = False  # no labels, or no class distribution: no posterior metrics
        # the batch's last forward output of each field the metrics read (scored_field), and its labels
        self._outputs: dict[str, Any] | None = None
        self._labels: Tensor | None = None

    # ---- reading the Trainer's pass
    @contextlib.contextmanager
    def watch(self, model: nn.Module) -> Iterator[None]:
        """Record the model's outputs (forward hook) while the Trainer's evaluation loop runs."""

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            # only the last of each field is read: generate()'s decoding steps (a batch x vocabulary of
            # logits each) are not kept until the batch is done
            if self._outputs is not None and (field := scored_field(output, self._labels, self.trainer._causal_lm)):
                self._outputs[field] = output

        handle = model.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    @contextlib.contextmanager
    def batch(self, labels: Any) -> Iterator[None]:
        """Around one ``prediction_step``: add its batch at the mean to the mean metrics."""
        if not self.unsupported and self.reused and not isinstance(labels, Tensor):
            self._refuse_labels(labels)  # before the batch's forward: a refusal costs no pass
        self._outputs, self._labels = ({}, labels) if isinstance(labels, Tensor) else (None, None)
        try:
            yield
            outputs = self._outputs
        finally:
            self._outputs = self._labels = None
        if self.unsupported or not self.reused:
            return
        logp = self._mean_log_probs(outputs, labels)
        if logp is None:
            if not self.unsupported:
                self.reused = False
            return
        self.mean.add(logp, labels)  # type: ignore[union-attr]

    def _refuse_labels(self, labels: tuple[Tensor, ...] | None) -> None:
        """No labels (DPO, KTO, reward), several label tensors (extractive QA) or other: :meth:`_not_scored`."""
        names = self.trainer.label_names or ["labels"]
        held = f"no labels ({names}) to score" if labels is None else f"several label tensors ({names}), not one"
        if labels is not None and len(names) == 1:  # one name holding, say, a list (Mask2Former's class_labels)
            many = isinstance(labels, list | tuple) and all(isinstance(t, Tensor) for t in labels)
            kind = type(labels).__name__ + (f" of {len(labels)} tensors" if many else "")
            held = f"a {kind} under one label name ({names}), not one label tensor"
        warning = f"EVONTrainer: the evaluation batches hold {held}: no {self.prefix}_mean_*/_bma_* metrics"
        self._not_scored(f"the evaluation batches hold {held}", "_evon_warned_unlabelled", warning)

    def _not_scored(self, why: str, warned: str, warning: str) -> None:
        """No posterior metrics (``why``): a ValueError where they are asked for by name (``asked``, or
        ``evaluate(bma=True)``: as for no posterior), else ``warning`` once per trainer (its flag ``warned``:
        each evaluation would repeat it)."""
        self.unsupported, trainer = True, self.trainer
        asked = self.asked or ("evaluate(bma=True)" if trainer._evon_bma_asked else None)
        if asked:
            raise ValueError(f"{asked}: {why}, so no {self.prefix}_bma_* metrics")
        if not trainer.__dict__.get(warned):
            setattr(trainer, warned, True)
            logger.warning(warning)

    def _mean_log_probs(self, outputs: dict[str, Any] | None, labels: Tensor) -> Tensor | None:
        if outputs and "logits" in outputs:  # the last forward is the loss forward (after any generate())
            logits = output_field(outputs["logits"], "logits")
            if not self._set_task(task_of(logits, labels, self.trainer._causal_lm), logits, labels):
                return None
            return _metric_log_probs(logits, labels.to(logits.device), self.task)  # type: ignore[arg-type]
        if outputs and "log_probs" in outputs:  # TRL's fused LM head: log p(shifted label), 0 where ignored
            token_logp = output_field(outputs["log_probs"], "log_probs")
            self._set_task("causal_lm", token_logp, labels)
            return token_logp.double()
        return None

    def _set_task(self, task: str | None, logits: Tensor, labels: Tensor) -> bool:
        if self.task is None:
            if task is None:  # regression, multi-label
                problem = problem_type(self.trainer.model)
                why = (
                    "mean/BMA metrics need class logits (classification or causal LM); got "
                    f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)}"
                    + (f": its problem_type {problem!r} has no softmax" if problem in NOT_SOFTMAX_PROBLEMS else "")
                )
                self._not_scored(f"the {why}", "_evon_warned_no_classes", f"EVONTrainer: {why}: skipped")
                return False
            self.task = task
            self.mean = MetricAccumulator(self.trainer, task)
        return True

    # ---- after the Trainer's pass
    def finish(self, dataloader: Any, bma_dataloader: Callable[[], Any] | None = None) -> dict[str, float]:
        """Mean metrics (from the Trainer's pass, or one own pass), then the BMA passes if due,
        over the loader ``bma_dataloader()`` builds (default ``dataloader``: the same examples in
        any order, as the metrics are sums over examples)."""
        if self.unsupported:
            return {}
        if not self.reused or self.mean is None:
            if not self._own_mean_pass(dataloader if bma_dataloader is None else bma_dataloader()):
                return {}
        metrics = {f"{self.prefix}_mean_{k}": v for k, v in self.mean.summary().items()}  # type: ignore[union-attr]
        if self.with_bma:
            metrics.update(self.bma_metrics(dataloader, bma_dataloader))
        return metrics

    def bma_metrics(self, dataloader: Any, bma_dataloader: Callable[[], Any] | None = None) -> dict[str, float]:
        """The ``{prefix}_bma_*`` metrics of the examples :meth:`finish` read (none where it had none)."""
        if self.unsupported or self.mean is None:
            return {}
        trainer, args = self.trainer, self.trainer.args
        posterior = trainer._evaluated_posterior() if args.bma_num_samples > 0 else None
        if args.bma_num_samples > 0 and posterior is None:
            logger.warning(f"EVONTrainer: {trainer._no_posterior()}: BMA metrics skipped")
        if posterior is None:
            return {}
        if posterior.is_point_mass and posterior.temperature == 1.0:
            logger.info(
                "EVONTrainer: the posterior has no noise (ess = inf, e.g. calibrated to the mean): "
                "BMA equals the mean, its sampled passes are skipped"
            )
            return {f"{self.prefix}_bma_{k}": v for k, v in self.mean.summary().items()}
        # a posterior without noise: one pass at the mean, at the posterior's temperature
        seeds: list[int | None] = (
            [None] if posterior.is_point_mass else [args.bma_seed + s for s in range(args.bma_num_samples)]
        )
        bma = MetricAccumulator(trainer, self.task)  # type: ignore[arg-type]
        task = self.task

        def transform(logits: Tensor, labels: Tensor | None) -> Tensor:
            return _metric_log_probs(tempered(logits, posterior), labels, task)  # type: ignore[arg-type]

        description = f"BMA evaluation ({len(seeds)} posterior samples)"
        passes = dataloader if bma_dataloader is None else bma_dataloader()
        for done, inputs, rows in sample_passes(trainer, passes, posterior, seeds, transform, description):
            bma.add(done.value(), class_labels(trainer, inputs), rows)
        return {f"{self.prefix}_bma_{k}": v for k, v in bma.summary().items()}

    def _own_mean_pass(self, dataloader: Any) -> bool:
        """One pass at the mean, when the Trainer's pass gave nothing to reuse."""
        self.task, self.mean = None, None
        model = self.trainer._evon_eval_model()
        model.eval()
        for inputs in dataloader:
            inputs = self.trainer._evon_prepared(inputs)
            labels = batch_labels(self.trainer, inputs)
            if not isinstance(labels, Tensor):
                if self.asked:
                    self._refuse_labels(labels)
                return False
            logits = forward_logits(self.trainer, model, inputs)
            if isinstance(logits, tuple):  # several *_logits fields: which one the labels score is unknown
                why = f"the model's output holds {len(logits)} distributions (*_logits) against one label tensor"
                self._not_scored(why, "_evon_warned_no_classes", f"EVONTrainer: {why}: no {self.prefix}_mean_* metrics")
                return False
            if not self._set_task(task_of(logits, labels, self.trainer._causal_lm), logits, labels):
                return False
            self.mean.add(_metric_log_probs(logits, labels, self.task), labels)  # type: ignore[union-attr, arg-type]
        return self.mean is not None


# ------------------------------------------------------------------------------------------ the hooks
class EvaluationMixin(SearchObjectiveMixin):
    """The evaluation hooks of :class:`~hf_evon.trainer.EVONTrainerMixin`: ``evaluate()`` adds the
    posterior metrics to the subclass's (``predict(bma=True)``: :mod:`hf_evon.trainer.prediction`)."""

    # the evaluations (step, evaluation, the maker of its BMA passes' loader) at the current step that
    # skipped BMA: one per eval dataset, which the Trainer evaluates one after the other
    _evon_bma_skipped: list[tuple[int, PosteriorEvaluation, Any]] | None = None
    _evon_bma_asked = False  # evaluate(bma=True): the BMA passes run whatever bma_eval_every says
    # inside EVONSeq2SeqTrainer.predict(bma=True) under predict_with_generate: the loop's predictions are
    # decoded ids, and its metrics gain the labels' token metrics
    _evon_generated_prediction = False

    def evaluate(self, *args: Any, bma: bool = False, **kwargs: Any) -> dict[str, float]:
        """The subclass's ``evaluate()``, with ``eval_mean_*`` and (when due, or ``bma=True``) ``eval_bma_*``."""
        self._warn_calibration_split(kwargs.get("eval_dataset", args[0] if args else None), "evaluate()")
        # asked for: no posterior or no samples is an error, as for predict(bma=True); one serves every pass
        held = self._holding_posterior(self._bma_posterior("evaluate(bma=True)") if bma else None)
        outer, asked, step = self._evon_in_evaluate, self._evon_bma_asked, self.state.global_step
        # the Trainer evaluates each of several eval datasets by a call of its own, without bma
        self._evon_in_evaluate, self._evon_bma_asked = True, asked or bma
        self._evon_bma_skipped = [e for e in self._evon_bma_skipped or () if e[0] == step]
        ours = len(self._evon_bma_skipped)  # what this call's evaluation adds comes after
        try:
            with held:
                return self._bma_where_training_stops(super().evaluate(*args, **kwargs), ours)
        finally:
            self._evon_in_evaluate, self._evon_bma_asked = outer, asked

    def _bma_where_training_stops(self, metrics: dict[str, float], ours: int) -> dict[str, float]:
        """The evaluation at which training stops carries BMA, as the one at ``max_steps`` does.

        A callback may stop training on this evaluation's metrics (``EarlyStoppingCallback``, in
        ``on_evaluate``, after the passes that :meth:`_bma_due` could not foresee): the skipped BMA
        passes of this step's evaluations (every eval dataset's so far) then run here, on the same
        weights, each logged beside its evaluation (an entry at the same step); this call's (from
        index ``ours`` of the skipped) are returned with its metrics.
        """
        skipped = self._evon_bma_skipped or []
        if not skipped or not self.control.should_training_stop:
            return metrics
        self._evon_bma_skipped = []
        for i, (_, evaluation, passes) in enumerate(skipped):
            bma = evaluation.bma_metrics(None, passes)
            if bma:
                self.log(dict(bma))  # Trainer.log adds "epoch" to the dict it is given
                if i >= ours:
                    metrics = merge_metrics(dict(metrics), bma, added_metric_keys(self))
        return metrics

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> Any:
        """The subclass's loop (``eval_loss``, ``compute_metrics``), read for ``eval_mean_*``, then BMA.

        Only inside ``evaluate()``: ``predict()`` runs the same loop and stays the subclass's, but for
        ``EVONSeq2SeqTrainer.predict(bma=True)`` under generation, whose metrics gain the labels' token
        metrics here, before ``Trainer.predict`` hands them to the callbacks' ``on_predict``.
        """
        if not self._evon_in_evaluate or self._evon_evaluation is not None:
            # before the Trainer's pass draws its order (a shuffled sampler) and masks: the token metrics'
            # passes read its batches, not other rows than the predictions'
            replay = replayed(dataloader, self) if self._evon_generated_prediction else None
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
            if replay is not None:
                # the labels' token metrics (none without labels: not asked for by name, no refusal): 1 + S
                # passes, as evaluate() runs them
                evaluation = PosteriorEvaluation(self, metric_key_prefix, with_bma=True)
                metrics = evaluation.finish(dataloader, lambda: self._length_sorted_loader(dataloader, replay))
                merge_metrics(output.metrics, metrics)
            return output
        evaluation = PosteriorEvaluation(self, metric_key_prefix, with_bma=self._bma_due())
        self._evon_evaluation, replay = evaluation, replayed(dataloader, self)  # before the Trainer's pass draws its order
        try:
            with evaluation.watch(self.model):
                output = super().evaluation_loop(
                    dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
                )
        finally:
            self._evon_evaluation = None
        evaluation.reused &= not replay.stale  # type: ignore[attr-defined]  # its masks not drawn again: a mean pass
        def passes() -> Any:  # the batches of the Trainer's pass again, or the set sorted by length
            return self._length_sorted_loader(dataloader, replay)

        merge_metrics(output.metrics, evaluation.finish(dataloader, passes), added_metric_keys(self))
        if not evaluation.with_bma:
            self._evon_bma_skipped = [*(self._evon_bma_skipped or ()), (self.state.global_step, evaluation, passes)]
        return output

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        evaluation = self._evon_evaluation
        if evaluation is None:
            return super().prediction_step(
                model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs
            )
        with evaluation.batch(batch_labels(self, inputs)):  # labels first: a loss may pop them
            return super().prediction_step(
                model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs
            )

    def _length_sorted_loader(self, dataloader: Any, replay: Callable[[], Any] | None = None) -> Any:
        """The evaluation loader's dataset in order of token count
        (:func:`~hf_evon.trainer.calibration_data.length_sorted`), for the BMA passes: each of the
        S passes then pads little. ``dataloader`` itself where the order would not change or must not,
        through ``replay`` (:func:`~hf_evon.trainer.calibration_data.replayed`) where given."""
        dataset = getattr(dataloader, "dataset", None)
        ordered = None if dataset is None else length_sorted(dataset, self.data_collator, self.args.dataloader_drop_last)
        if ordered is None or ordered is dataset:
            return dataloader if replay is None else replay()
        return forked(self._uncached_eval_dataloader(ordered))  # leaves torch's generator as it is

    def _bma_due(self) -> bool:
        """Whether this evaluation runs the BMA passes (``bma_eval_every``: :func:`bma_due`)."""
        return not self._evon_in_training or self._evon_bma_asked or bma_due(self)

    def posterior_metrics(self, dataloader: Any, metric_key_prefix: str = "eval") -> dict[str, float]:
        """``{prefix}_mean_*`` and ``{prefix}_bma_*`` of ``dataloader`` on their own (one pass at the
        mean, ``bma_num_samples`` sampled passes); ``evaluate()`` reuses its own pass instead. Batches of no
        labels, several label tensors (extractive QA) or no class logits (regression) raise a ValueError."""
        evaluation = PosteriorEvaluation(self, metric_key_prefix, with_bma=True, asked="posterior_metrics()")
        replay = replayed(dataloader, self)  # each pass the batches (order, masks) the first reads; stale: as given
        return evaluation.finish(dataloader, None if replay.stale else replay)  # type: ignore[attr-defined]
