"""``calibrate()`` for the EVON trainers: the posterior's scale and temperature chosen on held-out data.

:class:`CalibrationMixin` runs :func:`hf_evon.calibrate_posterior` on the trainer's
``calibration_dataset`` (by itself at the end of ``train()``) or a dataset passed in, and checks that
dataset before training: it must not be an eval set, its batches must hold labels the model scores
(:mod:`hf_evon.trainer.calibration_data`).
"""

import time
import warnings
from typing import Any

from transformers.utils import logging

import hf_evon.trainer.calibration_data as calibration_data
import hf_evon.trainer.combined as combined

logger = logging.get_logger(__name__)

__all__ = ["CalibrationMixin"]


class CalibrationMixin:
    """The calibration of :class:`~hf_evon.trainer.EVONTrainerMixin`: :meth:`calibrate` and the checks of its
    data (``calibration_dataset``, before the first step)."""

    _evon_calibrated_on: Any = None  # the dataset the last calibrate() chose its scale on

    def _warn_calibration_split(self, dataset: Any, call: str) -> None:
        """Warn where ``dataset`` is the split the calibration in effect was chosen on: BMA metrics
        there are not held-out figures (they favour the scale chosen on them)."""
        in_effect = self.calibration is not None and self._calibrated_step == self.state.global_step
        if in_effect and dataset is not None and dataset is self._evon_calibrated_on:
            warnings.warn(
                f"{call}: this dataset is the split the posterior's noise scale and temperature were calibrated "
                "on, so its BMA metrics are not held-out figures; report them on another split",
                UserWarning,
                stacklevel=3,
            )

    def _whole_split(self, split: Any) -> Any:
        """The loader of :func:`~hf_evon.trainer.calibration_data.whole_split` over ``split``, with
        ``dataloader_drop_last`` off: the calibration scores every example of the split (the Trainer's
        evaluation drops the last batch under it; here that left a split smaller than a batch empty)."""
        drop_last, self.args.dataloader_drop_last = self.args.dataloader_drop_last, False
        try:
            return calibration_data.whole_split(self._uncached_eval_dataloader(split), split)
        finally:
            self.args.dataloader_drop_last = drop_last

    def _check_calibration_data(self) -> None:
        """:func:`~hf_evon.trainer.calibration_data.check_calibration_batches` on the
        ``calibration_dataset``'s batches, its first scored by the model (where its weights are
        loaded: FSDP's memory-efficient loading leaves them on the meta device until ``prepare``),
        before the first step."""
        from hf_evon.predictive.held_out import held_out_classes

        calibration_data.require_softmax_training(self)
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        loaded = not any(p.is_meta for p in self.model.parameters())
        d = self.calibration_dataset
        loader = calibration_data.named_batches(
            lambda: self._whole_split(d), "calibration_dataset"
        )
        with calibration_data.collator_draws_kept(self.data_collator):  # training's masks as without the check
            calibration_data.check_calibration_batches(
                (calibration_data.under_labels(b, self.label_names, self.model) for b in loader), vocab, self._causal_lm,
                (lambda b, where: held_out_classes(self.model, self._evon_prepared(b), self._causal_lm, where)) if loaded else None,
            )  # fmt: skip

    def _refuse_eval_set(self, dataset: Any, name: str = "calibrate(): dataset") -> None:
        """Refuse ``dataset`` for calibration where it is the eval set as kept or, while the trainer keeps
        the one it was made with, that set as it was given (``bind_partial`` of the parent's signature);
        the training set likewise; any dataset for a trainer that generates its batches (TRL's GRPO:
        combined.py's refusal)."""
        combined.refuse_generated_calibration(self, dataset, name)  # batches of prompts: no labels to score
        given, kept = self._evon_eval_given
        sets = (self.eval_dataset, given) if self.eval_dataset is kept else (self.eval_dataset,)
        calibration_data.refuse_eval_set(dataset, name, *sets)
        given, kept = self._evon_train_given
        if dataset is not None and any(dataset is s for s in (self.train_dataset, given if self.train_dataset is kept else None)):
            raise ValueError(
                f"{name} is the train_dataset: the sampling scale would be chosen on the examples the model was "
                "trained on, which it fits better than new ones. Hold out separate examples for calibration"
            )

    def calibrate(
        self,
        dataset: Any = None,
        grid: Any = None,
        num_samples: int | None = None,
        standard_errors: float | None = None,
        min_gain: float | None = None,
        temperature: bool = True,
        always_scan: bool = False,
        screen_factor: float | None = None,
        keep_trained: bool = True,
    ) -> Any:
        """Choose the posterior's sampling scale and temperature by BMA NLL on held-out ``dataset``.

        :func:`hf_evon.calibrate_posterior` on ``dataset`` (default: the trainer's
        ``calibration_dataset``), with ``bma_num_samples`` samples (8 if 0) and seeds from
        ``bma_seed``; ``standard_errors``, ``min_gain``, ``temperature``, ``always_scan``, ``screen_factor``
        and ``keep_trained`` as there. Until the next optimizer step,
        ``current_posterior()`` — so evaluation, saving and the model card — uses the calibrated
        scale. Runs by itself at the end of
        ``train()`` when a ``calibration_dataset`` was given. Returns the ``CalibrationResult``.
        The split is read in order of token count (:func:`~hf_evon.trainer.calibration_data.
        length_sorted`), its longest batches cut into shorter runs (:func:`~hf_evon.trainer.
        calibration_data.cut_by_length`): every pass over it pads little, and the result is the
        dataset order's.
        """
        from hf_evon.predictive.calibration import DEFAULT_NUM_SAMPLES, calibrate_posterior

        given, dataset = dataset, self.calibration_dataset if dataset is None else dataset
        if dataset is None:
            raise ValueError(combined.no_calibration_data(self))
        self._refuse_eval_set(dataset)
        posterior = self._trained_posterior()  # the calibration in place stays until this one succeeds
        if posterior is None:
            raise ValueError("calibrate(): no posterior yet (train first, or pass posterior= to the trainer)")
        model = self._evon_eval_model()
        start = time.perf_counter()
        # sorted by length, the long tail cut (each pass pads little; the dataset order's result), labels as "labels"
        split = calibration_data.length_sorted(dataset, self.data_collator)  # read whole: no batch dropped
        loader = calibration_data.named_batches(  # every rank reads the whole split: one choice
            lambda: self._whole_split(split),
            "calibration_dataset" if given is None else "calibrate(): dataset",
        )
        batches = calibration_data.cut_by_length([calibration_data.under_labels(self._evon_prepared(b), self.label_names, self.model) for b in loader])
        batches = [calibration_data.as_loss_forward(self, b) for b in batches]  # after the cut: a flag is no row
        _, result = calibrate_posterior(
            model,
            posterior,
            batches,
            grid=grid,
            num_samples=num_samples or self.args.bma_num_samples or DEFAULT_NUM_SAMPLES,
            seed=self.args.bma_seed,
            shift_labels=self._causal_lm,
            standard_errors=standard_errors,
            min_gain=min_gain,
            temperature=temperature,
            always_scan=always_scan,
            screen_factor=screen_factor,
            keep_trained=keep_trained,
        )
        self.calibration, self._calibrated_step, self._evon_calibrated_on = result, self.state.global_step, dataset
        if self.is_world_process_zero():  # the run's outcome: shown at the default verbosity
            logger.warning(f"EVONTrainer: {result.summary()}")
        self.log(
            {
                "calibration/ess": result.ess,
                "calibration/ess_multiplier": result.multiplier,
                "calibration/bma_nll": result.chosen_nll,
                "calibration/mean_nll": result.mean_nll,
                "calibration/mean_temperature": result.mean_temperature,
                "calibration/temperature": result.temperature,
                "calibration/scanned": float(result.scanned),  # 0: the mean was not overconfident
                "calibration/seconds": time.perf_counter() - start,  # its cost beside the training's
            }
        )
        return result
