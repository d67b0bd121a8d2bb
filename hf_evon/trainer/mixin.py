"""``EVONTrainerMixin``: the EVON training plumbing for any ``transformers.Trainer`` subclass.

``class MyTrainer(EVONTrainerMixin, SomeTrainer)`` (the mixin first) keeps ``SomeTrainer``'s data
handling, ``training_step``, ``compute_loss``, metrics and logs; the mixin wraps them.

What the trainer does differently from ``transformers.Trainer``:

* **Optimizer.** ``create_optimizer`` builds ``EVON`` through :func:`hf_evon.build_optimizer`
  (EVON for weight matrices, AdamW for embeddings, the LM head and 1-D tensors; see the
  ``evon_*`` fields of :class:`EVONConfig`). ``args.optim`` is not used (setting it warns; so
  does passing plain ``TrainingArguments``, whose ``learning_rate`` is taken as AdamW's, EVON's
  α derived from it); ``optimizer_cls_and_kwargs`` is refused.
* **Sampled training step.** Every micro-batch runs the subclass's ``training_step``
  ``evon_mc_samples`` times, each inside ``optimizer.sampled_params(train=True)`` (the backward
  pass too, so gradient checkpointing recomputes at the sampled weights). Each micro-batch draws
  its own samples, so a step with A accumulated micro-batches averages A·K samples.
* **Loss scaling.** ``EVON.step`` divides the accumulated gradients (of EVON *and* AdamW
  parameters) by the number of recorded samples, A·K. The trainer therefore back-propagates
  ``A · w_i · loss_i`` for micro-batch ``i``, where ``loss_i`` is the model's mean loss over
  the micro-batch's items (examples, or label tokens for token-level losses) and
  ``w_i = n_i / N`` its share of the items of the whole accumulated batch. After EVON's
  division the gradient is exactly the item-weighted mean gradient of the accumulated batch,
  i.e. the gradient of one batch A times larger. (The trainer counts items itself, shifting
  the labels of causal LMs, and does not pass ``num_items_in_batch`` to the model: the
  plain ``Trainer`` relies on each model honouring it, which sequence classifiers don't.)
  A custom ``compute_loss_func`` (or ``loss_is_scaled_for_ga=True``) keeps the ``Trainer``
  convention: it receives ``num_items_in_batch`` and must return the share of the loss of
  the accumulated batch; the trainer then back-propagates ``A · loss``.
* **Gradient clipping and grad-norm logging** refer to the *mean* gradient over the step's
  samples (what EVON uses), not to the sum that ``p.grad`` holds: the norm is divided by A·K,
  and ``max_grad_norm`` clips the mean. Clipping rescales the gradients of every parameter by
  c = max_grad_norm / norm; under ``hess_estimator="fisher"`` (the default) H takes the clipped
  rotated gradient, so that step adds c²·G_rot², lowered by the clip factor squared (the Price
  estimate reads each sample's gradient before the clip); ``max_grad_norm=0`` (docs/defaults.md#max-grad-norm)
  disables it. ``optimizer.synchronize()`` runs first; a non-finite norm is returned unclipped (EVON names it).
* **Logs.** At logging steps: ``evon/posterior_std_mean`` (mean marginal posterior standard
  deviation over all EVON-owned weights), ``evon/hess_min``/``hess_max``/``hess_mean`` (range
  of the rotated-space Hessian H), ``evon/skipped_steps`` and every ``posterior_health()``
  statistic (``evon/noise_to_signal``, ``evon/hess_below_prior``, ``evon/hess_init_share``, ...);
  ``learning_rate`` is the user's (AdamW's) rate as scheduled, EVON's α ``evon/learning_rate``.
* **Evaluation.** ``evaluate()`` runs the subclass's evaluation (``eval_loss`` and your
  ``compute_metrics``, at the posterior mean), reads the model's outputs of that pass for the
  ``eval_mean_*`` metrics, then runs ``bma_num_samples`` passes at posterior samples
  ``seed = bma_seed + s`` for ``eval_bma_*`` (each sample drawn once for every batch from an
  :class:`~hf_evon.EVONPosterior` snapshot, so training's noise stream is untouched), on every
  ``bma_eval_every``-th evaluation during training. Keys and definitions:
  :mod:`hf_evon.trainer.evaluation`. ``predict()`` is the subclass's (at the posterior mean);
  ``predict(..., bma=True)`` BMA-averaged probabilities (Seq2Seq, ``predict_with_generate``:
  ``generate_bma``'s ids). Without EVON training (e.g. reloaded) pass ``posterior=EVONPosterior.from_pretrained(dir)``.
* **Saving** (:mod:`hf_evon.trainer.checkpointing`). Every checkpoint and ``save_model()``
  write ``evon_posterior.safetensors`` and ``evon_posterior_config.json`` next to the model (or
  the PEFT adapter) and create/update the model card (``README.md``). ``push_to_hub()`` uploads
  the output directory, posterior and card included. The optimizer state (``optimizer.pt``,
  ``torch.load(weights_only=True)``-safe, including EVON's noise generator) makes
  ``resume_from_checkpoint`` continue exactly. With ``load_best_model_at_end`` the best
  checkpoint's posterior comes back with its weights.
* **Data parallelism.** After the Trainer wraps the model, ``hf_evon.prepare_distributed`` makes
  EVON correct under DDP (per-rank noise, gradients and Hessian numerators averaged once per
  step by ``EVON.synchronize``); FSDP1 and DeepSpeed are not supported. ``evon_shard=True``
  shards EVON's state and work over the ranks (:mod:`hf_evon.distributed.sharding`); checkpoints
  and posteriors are gathered to the unsharded format first. Under FSDP2 (``fsdp`` with
  ``fsdp_config={"fsdp_version": 2}``, which accelerate enables on GPUs/accelerators only)
  accelerate ``fully_shard``-s the model and switches the optimizer's parameters to the
  DTensors, then EVON is sharded over the FSDP2 mesh (:mod:`hf_evon.distributed.fsdp2`); its
  checkpoints also hold EVON's full state (``evon_optimizer.pt``), from which
  ``resume_from_checkpoint`` continues bit-for-bit. On CPU processes the ``fsdp`` arguments
  raise instead of silently running DDP. (How this is tested: ``docs/trainer.md``.)
* **PEFT.** ``peft_config=`` wraps the model with ``peft.get_peft_model`` (as TRL does); EVON
  then owns the LoRA matrices and the posterior covers the adapter.

Hooks used: the public ``Trainer`` methods ``create_optimizer``, ``create_scheduler``, ``training_step`` (wrapping
``super()``; while it runs, ``self.compute_loss``, whichever class defines it, is wrapped to scale
the loss), ``get_batch_samples``, ``log``, ``evaluate``, ``evaluation_loop``, ``prediction_step``,
``predict``, ``train``, ``save_model``, ``create_model_card``, the documented ``loss_is_scaled_for_ga`` switch and a ``TrainerCallback``
(``on_train_begin``: :func:`hf_evon.prepare_distributed` once the model is wrapped).

Private transformers (and TRL) internals: overridden, called or set in
:mod:`hf_evon.trainer.internals` (``_memory_tracker``'s calls stay in ``predict``, whose name names its
stage), whose docstring lists each and why, each pinned by ``tests/test_trainer_internals.py`` or
``tests/test_trl.py``.
"""

import copy
import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from torch import nn
from transformers import TrainerCallback, TrainingArguments
from transformers.utils import logging

import hf_evon.trainer.combined as combined
from hf_evon.distributed.ddp import prepare_distributed
from hf_evon.distributed.fsdp2 import first_rows_value
from hf_evon.modeling import is_causal_lm, is_peft_model, prepends_virtual_tokens, pretrained_name
from hf_evon.optim import EVON, build_optimizer
from hf_evon.optim.checks import outside_stacklevel
from hf_evon.optim.defaults import lr_from_adamw_lr
from hf_evon.optim.evon import unwrap_optimizer
from hf_evon.optim.grouping import is_full_finetuning
from hf_evon.posterior.fingerprint import PosteriorMeanWarning
from hf_evon.posterior.posterior import EVONPosterior
from hf_evon.posterior.snapshot import has_posterior_to_take
from hf_evon.predictive.logprobs import count_label_items
from hf_evon.trainer.adalora import add_rank_allocation, pruned_entries, zero_pruned
from hf_evon.trainer.calibration import CalibrationMixin
from hf_evon.trainer.checkpointing import CheckpointingMixin, other_weights, resume_arguments
from hf_evon.trainer.combined import TrainerCall, converted_config, evon_config_class, rebuilt_config
from hf_evon.trainer.config import FINETUNING_LEARNING_RATE, SCRATCH_LEARNING_RATE, EVONConfig
from hf_evon.trainer.evaluation import EvaluationMixin, PosteriorEvaluation
from hf_evon.trainer.internals import TrainerInternals
from hf_evon.trainer.prediction import PredictionMixin
from hf_evon.trainer.schedule import ScheduleMixin, UsedRates
from hf_evon.trainer.statistics import posterior_statistics

logger = logging.get_logger(__name__)

Tensor = torch.Tensor

__all__ = ["EVONTrainerMixin"]


def _unwrap_evon(optimizer: Any) -> EVON | None:
    """The EVON instance behind accelerate's ``AcceleratedOptimizer`` (or similar wrappers), or None."""
    try:
        return unwrap_optimizer(optimizer)
    except TypeError:
        return None


def _kept_clip(args: TrainingArguments) -> str:
    """A plain config's ``max_grad_norm``, kept where it clips (TrainingArguments' default 1.0 does)."""
    if not args.max_grad_norm:
        return ""
    return (
        f" Its max_grad_norm = {args.max_grad_norm:g} is kept: it clips the gradients EVON averages into its "
        "momentum and H, where EVONConfig's default is 0 (docs/defaults.md#max-grad-norm)."
    )


class _EVONSetUp(TrainerCallback):
    """``on_train_begin``: the model is wrapped and the optimizer prepared and resumed; set EVON up."""

    def __init__(self, trainer: "EVONTrainerMixin") -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._prepare_evon_for_training()


class EVONTrainerMixin(
    PredictionMixin, EvaluationMixin, CalibrationMixin, CheckpointingMixin, ScheduleMixin, TrainerInternals
):
    """EVON training, posterior evaluation and saving for any ``transformers.Trainer`` subclass.

    Put it first among the bases: ``class MyTrainer(EVONTrainerMixin, SomeTrainer)`` (see
    :class:`~hf_evon.EVONTrainer`, :class:`~hf_evon.trainer.EVONSeq2SeqTrainer` and, with TRL,
    :class:`~hf_evon.trainer.EVONSFTTrainer`). It overrides the optimizer, the training step,
    clipping, logging, evaluation, prediction and saving hooks of ``Trainer``; the subclass keeps
    its data handling, loss (``compute_loss``), metrics and logs.

    Args (beyond the ``Trainer`` subclass's):
        args: an :class:`EVONConfig`, or the subclass's own arguments combined with the EVON fields
            (:func:`~hf_evon.trainer.evon_config_class`, e.g. ``EVONSFTConfig``). Plain arguments
            are converted, EVON fields at their defaults, with a warning: their ``learning_rate``
            is taken as AdamW's, and EVON's α is derived from it.
        peft_config: a ``peft.PeftConfig``; the model is wrapped with ``peft.get_peft_model``
            (as TRL's trainers do; a subclass whose ``__init__`` takes ``peft_config`` wraps it
            itself) and EVON learns a posterior over the adapter.
        posterior: an :class:`~hf_evon.EVONPosterior` of ``model`` (``EVONPosterior.from_pretrained``) for
            evaluation and saving before or without training; then the optimizer's is used.

    See :mod:`hf_evon.trainer.mixin` for the training step, loss scaling, clipping, logged
    statistics and saved files, :mod:`hf_evon.trainer.evaluation` for the metric keys,
    :mod:`hf_evon.trainer.calibration` for :meth:`calibrate`.
    """

    #: the arguments class used when ``args`` is None
    config_class: type[EVONConfig] = EVONConfig

    def __init__(
        self, *trainer_args: Any, peft_config: Any = None, posterior: Any = None, calibration_dataset: Any = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        if not hasattr(self, "loss_is_scaled_for_ga"):  # the Trainer's switch, from transformers 5.19 on
            raise ImportError(f"{type(self).__name__} needs transformers >= 5.19; found {transformers.__version__}")
        # by name, in the subclass's order: TRL's DPOTrainer(model, ref_model, args) takes args third
        call = TrainerCall(super().__init__, trainer_args, kwargs)
        call.set("args", args := self._evon_arguments(call.get("args"), call.default_output_dir(type(self))))
        if (chosen := call.get("optimizer_cls_and_kwargs")) is not None:  # Trainer's create_optimizer reads it, not EVON's
            cls = getattr(chosen[0], "__name__", chosen[0]) if isinstance(chosen, tuple | list) and chosen else chosen
            raise ValueError(
                f"optimizer_cls_and_kwargs = ({cls}, ...) is not used by {type(self).__name__}, which always trains "
                "with EVON: configure it with the EVONConfig fields, or pass your own "
                "optimizers=(hf_evon.build_optimizer(model, ...), None); for another optimizer use the Trainer itself"
            )
        given_eval = call.get("eval_dataset")
        if peft_config is not None and "peft_config" in inspect.signature(super().__init__).parameters:
            call.kwargs["peft_config"] = peft_config  # the subclass (e.g. TRL's) wraps the model itself
        elif peft_config is not None:
            call.set("model", self._wrap_peft(call.get("model"), args, peft_config))
        super().__init__(*call.args, **call.kwargs)
        if (self.args.log_level if self.args.should_log else self.args.log_level_replica) != "passive":
            logging.get_logger("hf_evon").setLevel(self.args.get_process_log_level())  # as Trainer sets its own
        combined.refuse_buffered_generations(self)  # TRL's GRPO, RLOO, Distillation: generations trained at other samples
        # the eval set as given beside the one kept: TRL's trainers keep it prepared anew, another object
        self._evon_eval_given = (given_eval, self.eval_dataset)
        self._evon_train_given = (call.get("train_dataset"), self.train_dataset)  # the same for the training set
        self._refuse_eval_set(calibration_dataset, "calibration_dataset")
        if posterior is not None and not isinstance(posterior, EVONPosterior):
            raise TypeError(f"posterior= takes an EVONPosterior (EVONPosterior.from_pretrained); got {type(posterior)}")
        if posterior is not None and self.model is not None:  # another model's: refused here, not when saving
            posterior.check_model(self.model)
        self.posterior, self.calibration_dataset = posterior, calibration_dataset
        self.calibration: Any = None  # the last CalibrationResult: this train()'s, at step _calibrated_step
        self._calibrated_step = -1
        self._posterior_from_checkpoint = False
        self._evon_step_items: Tensor | None = None
        self._evon_items_global = False
        self._evon_evaluation: PosteriorEvaluation | None = None
        self._evon_in_training = self._evon_in_evaluate = False
        self._evon_sampled_loss: dict[str, Any] | None = None  # set while training_step samples
        self._evon_fsdp2_resume: str | None = None
        self._resolve_learning_rate()
        self._causal_lm = self._detect_causal_lm()
        # see the module docstring (private internals); PEFT's prompt tuning prepends virtual tokens,
        # and its loss scores every label, the first from the prompt
        self._evon_set_loss_shift(self._causal_lm and not prepends_virtual_tokens(self.model))
        self.add_callback(_EVONSetUp(self))
        self.add_callback(UsedRates(self))
        add_rank_allocation(self)  # AdaLoRA's rank allocation, which Trainer leaves to the user

    def _resolve_learning_rate(self) -> None:
        """``learning_rate=None``: a rate for how the model is trained (see ``EVONConfig.learning_rate``)."""
        if self.args.learning_rate is not None:
            return
        full_finetuning = self.model is not None and is_full_finetuning(self.model)
        name = pretrained_name(self.model) if full_finetuning else ""
        self.args = copy.copy(self.args)  # the caller's config stays unset, for its next trainer
        self.args.learning_rate = FINETUNING_LEARNING_RATE if full_finetuning else SCRATCH_LEARNING_RATE
        how = f"full fine-tuning of the pretrained {name!r}" if full_finetuning else "training from scratch or through PEFT"
        logger.info(f"EVONConfig.learning_rate = {self.args.learning_rate} (unset: {how})")

    def _evon_arguments(self, args: TrainingArguments | None, output_dir: str) -> EVONConfig:
        """``args`` as an EVON config (None: one writing to ``output_dir``), plain ones converted, warned."""
        if args is None:
            return self.config_class(output_dir=output_dir)
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"args must be an EVONConfig or TrainingArguments; got {type(args).__name__}")
        # a class the trainer's derives from (TrainingArguments or EVONConfig to EVONSFTTrainer): rebuilt as
        # the trainer's, as TRL rebuilds plain TrainingArguments; an EVONConfig kept would reach it unrebuildable
        rebuild = issubclass(self.config_class, type(args)) and evon_config_class(type(args)) is not self.config_class
        if isinstance(args, EVONConfig):
            return rebuilt_config(args, self.config_class) if rebuild else args
        target = self.config_class if rebuild else evon_config_class(type(args))
        warnings.warn(
            f"{type(self).__name__} got a plain {type(args).__name__}: converted to {target.__name__} with the "
            f"EVON fields at their defaults. Its learning_rate = {args.learning_rate!r} is used as for AdamW: by the "
            "AdamW part (embeddings, heads, 1-D tensors) and, through lr_from_adamw_lr, for EVON's α = "
            f"{lr_from_adamw_lr(args.learning_rate):g} ({lr_from_adamw_lr(args.learning_rate, finetuning=True):g} "
            f"when all weights of a pretrained model are fine-tuned).{_kept_clip(args)} Pass an {target.__name__} to set the "
            "EVON fields (and to let EVONTrainer choose the learning rate from the model).",
            UserWarning,
            stacklevel=3,
        )
        return rebuilt_config(args, target) if rebuild else converted_config(args, target)

    @staticmethod
    def _wrap_peft(model: Any, args: TrainingArguments, peft_config: Any) -> nn.Module:
        if model is None or not isinstance(model, nn.Module):
            raise ValueError("peft_config= needs a model (an nn.Module) to wrap")
        if is_peft_model(model):
            raise ValueError("the model is already a PeftModel: pass peft_config=None")
        from peft import get_peft_model

        checkpointing = getattr(args, "activation_checkpointing", None) or getattr(
            args, "gradient_checkpointing", None
        )
        if checkpointing and hasattr(model, "enable_input_require_grads"):
            # reentrant checkpointing needs an input that requires grad when the base is frozen
            model.enable_input_require_grads()
        return get_peft_model(model, peft_config)

    # ------------------------------------------------------------------ helpers
    @property
    def evon_optimizer(self) -> EVON | None:
        """The ``EVON`` instance (unwrapped from accelerate's ``AcceleratedOptimizer``), if any."""
        return _unwrap_evon(self.optimizer)

    def _detect_causal_lm(self) -> bool:
        """Whether the labels are shifted: the Trainer's own verdict, else :func:`hf_evon.modeling.is_causal_lm`."""
        if self._evon_loss_shift:
            return True
        return self.model is not None and is_causal_lm(self.model)  # it unwraps DDP, compile, PEFT

    def current_posterior(self) -> EVONPosterior | None:
        """The posterior that belongs to the model's current weights, or None: a snapshot of the
        EVON optimizer's posterior; the ``posterior`` given to the trainer before it has an optimizer,
        or set after ``train()``; the best checkpoint's after ``load_best_model_at_end`` restored its
        weights. A ``calibrate()`` made at the current step applies to it (setting one drops it)."""
        posterior = self._trained_posterior()
        if posterior is not None and self.calibration is not None and self._calibrated_step == self.state.global_step:
            posterior = self.calibration.apply(posterior)
        return posterior

    def _trained_posterior(self) -> EVONPosterior | None:
        """:meth:`current_posterior` before its calibration."""
        if not self._takes_evon_posterior():
            return self._held_posterior()
        opt = self.evon_optimizer
        return EVONPosterior.from_optimizer(opt, self.model, max_basis_ratio=self.args.posterior_max_basis_ratio)

    def _takes_evon_posterior(self) -> bool:
        """Whether :meth:`current_posterior` is taken from EVON, else it is the held one: also where EVON covers
        no matrix (all with AdamW, or every one frozen and never updated)."""
        opt = self.evon_optimizer
        held = self._posterior_from_checkpoint or self.__dict__.get("_posterior_set_by_hand", False)
        return not held and opt is not None and has_posterior_to_take(opt)

    @property
    def posterior(self) -> EVONPosterior | None:
        """The posterior held for the model's weights (``posterior=``, the best checkpoint's, or one set
        here): see :meth:`current_posterior`. Setting it vouches for it as the current weights': it is the
        trainer's posterior, uncalibrated, in place of EVON's until ``train()`` runs again (None: EVON's,
        or none beside the best checkpoint's weights)."""
        return self.__dict__.get("_evon_posterior")

    @posterior.setter
    def posterior(self, value: EVONPosterior | None) -> None:
        self._evon_posterior, self._posterior_trained_past = value, None
        self._posterior_set_by_hand, self._calibrated_step = value is not None, -1

    def _held_posterior(self) -> Any:
        """``self.posterior`` (``posterior=``, or the best checkpoint's) while its mean is the model's
        weights, by its ``mean_fingerprint``; None once they moved (another optimizer than EVON trained
        them): a posterior around other weights is not these weights' posterior, for evaluation or saving."""
        posterior = self.posterior
        if posterior is None or self.model is None:
            return posterior
        different = self._held_mismatch(posterior)
        if different is None and posterior is self.__dict__.get("_posterior_trained_past"):
            # nothing to check the weights by (no fingerprint, or weights not readable even on the first-rows
            # rank), and this trainer's train() has moved them (its steps, or the checkpoint it resumed): a
            # posterior taken before cannot be vouched for as theirs
            warnings.warn(
                f"{type(self).__name__}: the posterior (posterior=) has no mean_fingerprint to check the model's "
                "weights by (or they cannot be read: the meta device), and train() has changed them since it was "
                "given (another optimizer than EVON trained "
                "them, or a checkpoint was resumed): it is not taken as these weights' posterior, so evaluation "
                "and saving go without one (set trainer.posterior again if it is theirs)",
                PosteriorMeanWarning,
                stacklevel=outside_stacklevel(),
            )
            return None
        if not different:
            return posterior
        warnings.warn(
            f"{type(self).__name__}: the model's weights differ from the ones the posterior (posterior=, or the "
            f"best checkpoint's) was taken at, in {len(different)} of {len(posterior.names)} covered tensors, e.g. "
            f"{different[:3]} (trained by an optimizer other than EVON, or changed otherwise): it is not these "
            "weights' posterior, so evaluation and saving go without one",
            PosteriorMeanWarning,
            stacklevel=outside_stacklevel(),
        )
        return None

    def _held_mismatch(self, posterior: Any) -> list[str] | None:
        """:func:`other_weights` for the held ``posterior``, the same on every rank: under FSDP2 only the rank
        of the first rows holds the leading values compared, so its verdict is sent to all (a collective,
        on every rank) and kept for this step, where rank-0-only saving finds it (``save_model`` agrees
        on it on every rank first)."""
        kept = self.__dict__.get("_held_verdict")
        if kept is not None and kept[0] is posterior and kept[1] == self.state.global_step:
            return kept[2]
        different = other_weights(self.model, posterior.config.get("mean_fingerprint"), posterior.names)
        params = [p for _, p in self.model.named_parameters()]
        if any(hasattr(p, "device_mesh") for p in params):
            different = first_rows_value(different, params)
            self._held_verdict = (posterior, self.state.global_step, different)
        return different

    def _uncached_eval_dataloader(self, dataset: Any) -> Any:
        """``get_eval_dataloader(dataset)`` (the eval batch size, collator and column removal), kept
        out of its cache: with ``dataloader_persistent_workers`` the Trainer keeps one loader under
        the key "eval" for every dataset passed in, so the calibration split's loader (or the BMA
        passes' length-sorted one) would replace the eval set's (``evaluate()`` would then report on
        the calibration split) or be replaced by it. The workers of this loader do not persist."""
        persistent = self.args.dataloader_persistent_workers
        self.args.dataloader_persistent_workers = False
        try:
            return self.get_eval_dataloader(dataset)
        finally:
            self.args.dataloader_persistent_workers = persistent

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """EVON through :func:`hf_evon.build_optimizer`, configured by the ``evon_*`` fields."""
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            self.args._warn_unused_optimizer_settings()  # optim set after the config was built, too
            self.optimizer = build_optimizer(opt_model, **self.args.evon_optimizer_kwargs())
        return self.optimizer

    def _prepare_evon_for_training(self) -> None:
        """:func:`hf_evon.prepare_distributed` on the wrapped model, then an FSDP2 resume's state.

        Runs at ``on_train_begin`` (:class:`_EVONSetUp`), after the Trainer wrapped the model,
        ran ``accelerator.prepare`` and loaded a checkpoint's optimizer state, before the first
        step. Under DDP each rank must keep its own gradients while sampling (its Hessian
        estimate needs them): ``prepare_distributed`` stops DDP's averaging and lets
        ``EVON.synchronize`` reduce gradients and Hessian numerators once per step. Under FSDP2
        (``fsdp`` with ``fsdp_config={"fsdp_version": 2}``) the Trainer builds EVON on the plain
        model and accelerate then ``fully_shard``-s it and puts the DTensors into EVON's param
        groups (EVON builds its buckets lazily, so nothing refers to the old tensors);
        ``prepare_distributed`` then shards EVON over the FSDP2 mesh, and a resume loads EVON's
        full state from ``evon_optimizer.pt``. In one process it only checks the model
        (FSDP1/DeepSpeed are refused with a clear error).
        """
        if self.evon_optimizer is None:  # the user's (optimizers=, create_optimizer): the run is the Trainer's
            inner = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's AcceleratedOptimizer
            warnings.warn(
                f"{type(self).__name__}: the optimizer is {type(inner).__name__}, not EVON: it trains as the Trainer "
                "does, and no posterior is learned (no evon/* logs, no eval_bma_* metrics, none saved). For a posterior "
                "let the trainer build EVON, or pass optimizers=(hf_evon.build_optimizer(model, ...), None).",
                UserWarning,
                stacklevel=2,
            )
            return
        # an aborted run's samples (auto_find_batch_size, a retry after an error), and the noise of its
        # unfinished step: the retry draws what a fresh run draws, as plain Trainer's equals a fresh one
        self.evon_optimizer.discard_samples(rewind=True)
        prepare_distributed(self.model_wrapped, self.optimizer, shard=True if self.args.evon_shard else None)
        self._load_fsdp2_optimizer()

    # ------------------------------------------------------------------ training step
    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: int, device: torch.device
    ) -> tuple[list, Any]:
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        counts = [
            count_label_items(b.get("labels") if isinstance(b, Mapping) else None, self._evon_loss_shift)
            for b in batch_samples
        ]
        self._evon_step_items = None
        self._evon_items_global = False
        if counts and all(c is not None for c in counts):
            # summed where the labels are, then one copy that does not wait for the device's queue
            total = torch.stack([c.to(counts[0].device) for c in counts]).sum().to(device, non_blocking=True)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                total = self.accelerator.gather(total.reshape(1)).sum()
                self._evon_items_global = True
            self._evon_step_items = total
        return batch_samples, num_items_in_batch

    def _loss_is_scaled_for_ga(self) -> bool:
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return self.compute_loss_func is not None

    def _loss_share(self, labels: Any) -> Tensor:
        """This micro-batch's share ``w_i = n_i / N`` of the accumulated batch's label items."""
        items = count_label_items(labels, self._evon_loss_shift)
        total = self._evon_step_items
        even = 1.0 / self.current_gradient_accumulation_steps
        if items is None or total is None:
            return torch.full((), even, device=self.args.device)
        # decided on the device: reading the count back would wait for every queued kernel
        items = items.to(self.args.device, torch.float32, non_blocking=True)
        total = total.to(self.args.device, torch.float32)
        share = items / total.clamp(min=1.0)
        if self._evon_items_global:
            share = share * self.accelerator.num_processes
        return torch.where(total > 0, share, even)

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Tensor | Any],
        num_items_in_batch: Tensor | int | None = None,
    ) -> Tensor:
        """The subclass's ``training_step`` once per posterior sample, inside ``sampled_params``.

        ``evon_mc_samples`` times: ``super().training_step`` (forward, ``compute_loss``, backward)
        at a fresh sample of the weights, as TRL's trainers wrap it in their own contexts. EVON's
        step divides the gradients by the number of recorded samples, A·K, so the loss
        back-propagated for micro-batch ``i`` is ``A · w_i · loss_i`` (``A · loss`` for a loss
        already scaled for gradient accumulation): whatever ``self.compute_loss`` is (a
        subclass's override too) is wrapped for these steps, and the Trainer is told the loss
        is already scaled (``loss_is_scaled_for_ga``, its documented switch). Returns the loss to
        log: the mean over the samples of the unscaled ``w_i · loss_i``.
        """
        optimizer = self.evon_optimizer
        if optimizer is None:
            return super().training_step(model, inputs, num_items_in_batch)
        from transformers.utils import is_sagemaker_mp_enabled

        if is_sagemaker_mp_enabled() or self.is_deepspeed_enabled:
            raise NotImplementedError(
                "EVONTrainer supports neither SageMaker model parallelism nor DeepSpeed"
            )
        scaled_for_ga = self._loss_is_scaled_for_ga()
        # once per micro-batch, before any loss (which may pop the labels); TRL's RLOO trains lists of rows, no labels
        labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
        share = torch.ones((), device=self.args.device) if scaled_for_ga else self._loss_share(labels)
        logged: list[Tensor] = []
        unscaled = self.compute_loss

        def compute_loss(
            model: nn.Module,
            inputs: dict[str, Tensor | Any],
            return_outputs: bool = False,
            num_items_in_batch: Tensor | int | None = None,
        ) -> Tensor | tuple[Tensor, Any]:
            result = unscaled(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            loss, outputs = result if return_outputs else (result, None)
            if self.args.n_gpu > 1:
                loss = loss.mean()
            # share 0 (no label items): the model's mean over zero items is NaN, which × 0 stays
            loss = torch.where(share > 0, loss * share.to(loss.dtype), 0.0)
            logged.append(loss.detach().float())
            loss = loss * self.current_gradient_accumulation_steps
            return (loss, outputs) if return_outputs else loss

        given = self.loss_is_scaled_for_ga
        own = self.__dict__.get("compute_loss")  # an instance's own compute_loss, if one was set
        self.loss_is_scaled_for_ga, self.compute_loss = True, compute_loss
        try:
            pruned = pruned_entries(model)  # AdaLoRA's pruned ranks (the mean's zeros): 0 in every sample
            with self._trl_tokens_counted_once(optimizer.mc_samples):
                for _ in range(optimizer.mc_samples):
                    with optimizer.sampled_params(train=True):
                        zero_pruned(pruned)
                        super().training_step(model, inputs, num_items_in_batch if scaled_for_ga else None)
        finally:
            self.loss_is_scaled_for_ga = given
            if own is None:
                del self.compute_loss
            else:
                self.compute_loss = own
        if not logged:
            raise RuntimeError("the Trainer's training_step did not call compute_loss: EVON has no loss to scale")
        return torch.stack(logged).sum() / optimizer.mc_samples

    def floating_point_ops(self, inputs: dict[str, Tensor | Any]) -> int:
        """The subclass's count for a training micro-batch (the Trainer's ``total_flos``) times
        ``evon_mc_samples``: :meth:`training_step` runs that many forward and backward passes."""
        optimizer = self.evon_optimizer
        flos = super().floating_point_ops(inputs)
        return flos if optimizer is None else flos * optimizer.mc_samples

    # ------------------------------------------------------------------ logging
    def posterior_statistics(self) -> dict[str, float]:
        """``evon/posterior_std_mean``, ``evon/hess_min``/``max``/``mean``, ``evon/skipped_steps`` and
        ``posterior_health()``'s statistics (:func:`hf_evon.trainer.statistics.posterior_statistics`)."""
        optimizer = self.evon_optimizer
        return {} if optimizer is None else posterior_statistics(optimizer, pruned_entries(self.model))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer.log`` plus the posterior's statistics at training logs; ``learning_rate`` is the
        user's rate in use (AdamW's group's; without one ``args.learning_rate`` as scheduled), not
        EVON's α, which ``Trainer`` reads from the first parameter group: ``evon/learning_rate``."""
        if "loss" in logs and not any(k.startswith("eval_") for k in logs):
            logs = {**logs, **self.posterior_statistics()}
        groups = [] if self.evon_optimizer is None else self.evon_optimizer.param_groups
        if "learning_rate" in logs and any(g["algorithm"] == "evon" for g in groups):
            logs = {**logs, **self._rate_logs(groups)}  # as the step used them (hf_evon.trainer.schedule)
        super().log(logs, start_time)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The subclass's ``train()``; then, with ``evon_shard``, the gathered state and posterior (so
        saving from rank 0 alone needs no collective), the best checkpoint's posterior
        (``load_best_model_at_end``) and, with a ``calibration_dataset``, :meth:`calibrate`."""
        self._check_fsdp_plugin()
        args, kwargs = resume_arguments(self, args, kwargs)  # the newest complete checkpoint for True
        if self.calibration_dataset is not None:
            self._check_calibration_data()  # before the first step: not after the whole run
        self._posterior_from_checkpoint = self._posterior_set_by_hand = False
        self.calibration = None  # it held for the weights it scored
        self._posterior_trained_past = self.posterior  # the weights it may have been taken at change from here
        self._held_verdict = None  # a resume loads other weights at the same step
        self._evon_fsdp2_resume, self._evon_in_training = None, True
        try:
            output = super().train(*args, **kwargs)
        finally:
            self._evon_in_training = False
        # every rank is here: a sharded state gathered now lets rank-0-only code (`save_model()` under
        # `is_world_process_zero()`, as with plain DDP) run without a collective the others never join
        # (not in one process, which needs none, nor under FSDP2, whose model saving is a collective)
        if self.args.world_size > 1 and not self._evon_fsdp2():
            self._gather_sharded_state()
        self._held_verdict = None  # the best checkpoint's weights, at the last step
        if self.posterior is not None:  # every rank is here: rank-0-only saving finds the verdict
            self._held_mismatch(self.posterior)
        if self.calibration_dataset is not None and (posterior := self.current_posterior()) is not None:
            if not posterior.is_point_mass:  # ess = inf (SOAP mode): no noise to calibrate
                self.calibrate()
        return output
