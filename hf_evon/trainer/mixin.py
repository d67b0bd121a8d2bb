"""``EVONTrainerMixin``: the EVON training plumbing for any ``transformers.Trainer`` subclass.

``class MyTrainer(EVONTrainerMixin, SomeTrainer)`` (the mixin first) keeps ``SomeTrainer``'s data
handling, ``compute_loss``, metrics and logs; its own ``training_step`` is not called while EVON
trains (the sampled step below replaces it), its ``compute_loss`` is.

What the trainer does differently from ``transformers.Trainer``:

* **Optimizer.** ``create_optimizer`` builds ``EVON`` through :func:`hf_evon.build_optimizer`
  (EVON for weight matrices, AdamW for embeddings, the LM head and 1-D tensors; see the
  ``evon_*`` fields of :class:`EVONConfig`). ``args.optim`` is not used (setting it warns; so
  does passing plain ``TrainingArguments``, whose ``learning_rate`` becomes EVON's α).
* **Sampled training step.** Every micro-batch runs ``evon_mc_samples`` forward/backward
  passes, each inside ``optimizer.sampled_params(train=True)`` (the backward pass too, so
  gradient checkpointing recomputes at the sampled weights). Each micro-batch draws its own
  samples, so a step with A accumulated micro-batches averages A·K samples.
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
  and ``max_grad_norm`` clips the mean. Clipping rescales the gradients of every parameter
  (EVON and AdamW); the Hessian estimate of EVON is not rescaled (it estimates curvature,
  not the step). ``optimizer.synchronize()`` runs first (a no-op on one process). A
  non-finite norm is returned unclipped, so EVON's warning names the parameter at fault.
* **Logs.** At logging steps: ``evon/posterior_std_mean`` (mean marginal posterior standard
  deviation over all EVON-owned weights), ``evon/hess_min``/``hess_max``/``hess_mean`` (range
  of the rotated-space Hessian H), ``evon/skipped_steps`` and every ``posterior_health()``
  statistic (``evon/noise_to_signal``, ``evon/hess_below_prior``, ``evon/hess_init_share``, ...).
* **Evaluation.** ``evaluate()`` runs the subclass's evaluation (``eval_loss`` and your
  ``compute_metrics``, at the posterior mean), reads the model's outputs of that pass for the
  ``eval_mean_*`` metrics, then runs ``bma_num_samples`` passes at posterior samples
  ``seed = bma_seed + s`` for ``eval_bma_*`` (each sample drawn once for every batch from an
  :class:`~hf_evon.EVONPosterior` snapshot, so training's noise stream is untouched), on every
  ``bma_eval_every``-th evaluation during training. Keys and definitions:
  :mod:`hf_evon.trainer.evaluation`. ``predict()`` is the subclass's (at the posterior mean);
  ``predict(..., bma=True)`` returns BMA-averaged probabilities. For a model without EVON
  training (e.g. reloaded) pass ``posterior=EVONPosterior.from_pretrained(dir)``.
* **Saving.** Every checkpoint and ``save_model()`` write ``evon_posterior.safetensors`` and
  ``evon_posterior_config.json`` next to the model (or the PEFT adapter) and create/update the
  model card (``README.md``). ``push_to_hub()`` uploads the output directory, posterior and
  card included. The optimizer state (``optimizer.pt``, ``torch.load(weights_only=True)``-safe,
  including EVON's noise generator) makes ``resume_from_checkpoint`` continue exactly. With
  ``load_best_model_at_end`` the best checkpoint's posterior comes back with its weights.
* **Data parallelism.** After the Trainer wraps the model, ``hf_evon.prepare_distributed`` makes
  EVON correct under DDP (per-rank noise, gradients and Hessian numerators averaged once per
  step by ``EVON.synchronize``); FSDP1 and DeepSpeed are not supported. ``evon_shard=True``
  shards EVON's state and work over the ranks (:mod:`hf_evon.distributed.sharding`); checkpoints
  and posteriors are gathered to the unsharded format first. Under FSDP2 (``fsdp`` with
  ``fsdp_config={"fsdp_version": 2}``, which accelerate 1.15 enables on GPUs/accelerators only)
  accelerate ``fully_shard``-s the model and switches the optimizer's parameters to the
  DTensors, then EVON is sharded over the FSDP2 mesh (:mod:`hf_evon.distributed.fsdp2`). Tested on
  CPU only, 2 gloo processes with accelerate's GPU-only FSDP switch turned on in the test
  worker (``tests/fsdp2_trainer_worker.py``): weights, checkpoint and ``save_model`` posteriors
  equal the one-process ``evon_shard=True`` run. FSDP2 checkpoints also hold EVON's full state
  (``evon_optimizer.pt``; torch's distributed checkpoint, the Trainer's ``optimizer.bin``, does
  not fit EVON's per-matrix state), from which ``resume_from_checkpoint`` continues bit-for-bit
  (tested on the same path). On CPU processes the ``fsdp`` arguments raise instead of silently
  running DDP.
* **PEFT.** ``peft_config=`` wraps the model with ``peft.get_peft_model`` (as TRL does); EVON
  then owns the LoRA matrices and the posterior covers the adapter.
"""

import copy
import inspect
import math
import os
import shutil
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers import TrainingArguments
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings
from transformers.utils import logging
from transformers.utils.import_utils import check_torch_load_is_safe

from hf_evon.distributed.ddp import prepare_distributed, unwrap_optimizer
from hf_evon.optim import EVON, build_optimizer
from hf_evon.optim.evon import lr_from_adamw_lr
from hf_evon.optim.grouping import is_full_finetuning, pretrained_name
from hf_evon.optim.linalg import marginal_variance
from hf_evon.posterior.format import POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME
from hf_evon.trainer.config import (
    FINETUNING_LEARNING_RATE,
    SCRATCH_LEARNING_RATE,
    EVONConfig,
    evon_config_class,
)
from hf_evon.trainer.evaluation import PosteriorEvaluation, bma_predict, merge_metrics

logger = logging.get_logger(__name__)

Tensor = torch.Tensor

__all__ = ["EVONTrainerMixin"]

POSTERIOR_FILES = (POSTERIOR_WEIGHTS_NAME, POSTERIOR_CONFIG_NAME)
EVON_OPTIMIZER_NAME = "evon_optimizer.pt"  # FSDP2 checkpoints: EVON's full optimizer state


def _unwrap_evon(optimizer: Any) -> EVON | None:
    """The EVON instance behind accelerate's ``AcceleratedOptimizer`` (or similar wrappers), or None."""
    try:
        return unwrap_optimizer(optimizer)
    except TypeError:
        return None


def _is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def _base_model(model: nn.Module) -> nn.Module:
    return model.get_base_model() if _is_peft_model(model) else model


def _count_items(labels: Tensor | None, shift: bool) -> Tensor | None:
    """Label items a mean loss averages over: entries != -100 (causal LMs: from position 1)."""
    if not isinstance(labels, Tensor):
        return None
    if shift:
        labels = labels[..., 1:]
    return labels.ne(-100).sum()


class EVONTrainerMixin:
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
            becomes EVON's α.
        peft_config: a ``peft.PeftConfig``; the model is wrapped with ``peft.get_peft_model``
            (as TRL's trainers do; a subclass whose ``__init__`` takes ``peft_config`` wraps it
            itself) and EVON learns a posterior over the adapter.
        posterior: an :class:`~hf_evon.EVONPosterior` for evaluation and saving before (or
            without) training, e.g. loaded with ``EVONPosterior.from_pretrained``. Once the
            trainer has an EVON optimizer, the optimizer's current posterior is used.

    See :mod:`hf_evon.trainer.mixin` for the training step, loss scaling, clipping, logged
    statistics and saved files, :mod:`hf_evon.trainer.evaluation` for the metric keys.
    """

    #: the arguments class used when ``args`` is None
    config_class: type[EVONConfig] = EVONConfig

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        *trainer_args: Any,
        peft_config: Any = None,
        posterior: Any = None,
        calibration_dataset: Any = None,
        **kwargs: Any,
    ) -> None:
        args = self._evon_arguments(args)
        if calibration_dataset is not None and calibration_dataset is kwargs.get("eval_dataset"):
            raise ValueError(
                "calibration_dataset is the eval_dataset: the sampling scale would be chosen on the examples the "
                "BMA metrics are reported on. Hold out separate examples for calibration"
            )
        if peft_config is not None and "peft_config" in inspect.signature(super().__init__).parameters:
            kwargs["peft_config"] = peft_config  # the subclass (e.g. TRL's) wraps the model itself
        elif peft_config is not None:
            model = self._wrap_peft(model, args, peft_config)
        super().__init__(model, args, *trainer_args, **kwargs)
        self.posterior = posterior
        self.calibration_dataset = calibration_dataset
        self.calibration: Any = None  # the last CalibrationResult, valid at global step _calibrated_step
        self._calibrated_step = -1
        self._posterior_from_checkpoint = False
        self._evon_step_items: Tensor | None = None
        self._evon_items_global = False
        self._evon_evaluation: PosteriorEvaluation | None = None
        self._evon_in_training = False
        self._evon_evaluations = 0  # evaluation steps during the current train(), for bma_eval_every
        self._evon_evaluated_step = -1
        self._resolve_learning_rate()
        self._causal_lm = self._detect_causal_lm()
        if self._causal_lm:
            # transformers 5.23 decides this from ``model.loss_type``, which is None for e.g. GPT-2
            # although its loss shifts the labels: it then over-counts ``num_items_in_batch`` by one
            # token per sequence, which makes the Trainer's own ``eval_loss`` too small
            self._loss_shifts_labels = True

    def _resolve_learning_rate(self) -> None:
        """``learning_rate=None``: a rate for how the model is trained (see ``EVONConfig.learning_rate``)."""
        if self.args.learning_rate is not None:
            return
        full_finetuning = self.model is not None and is_full_finetuning(self.model)
        name = pretrained_name(self.model) if full_finetuning else ""
        self.args = copy.copy(self.args)  # the caller's config stays unset, for its next trainer
        self.args.learning_rate = FINETUNING_LEARNING_RATE if full_finetuning else SCRATCH_LEARNING_RATE
        logger.info(
            f"EVONConfig.learning_rate = {self.args.learning_rate} (unset: "
            + (
                f"full fine-tuning of the pretrained {name!r})"
                if full_finetuning
                else "training from scratch or through PEFT)"
            )
        )

    def _evon_arguments(self, args: TrainingArguments | None) -> EVONConfig:
        """``args`` as an EVON config; plain arguments are converted, with a warning."""
        if args is None:
            return self.config_class(output_dir="tmp_trainer")
        if isinstance(args, EVONConfig):
            return args
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"args must be an EVONConfig or TrainingArguments; got {type(args).__name__}")
        target = evon_config_class(type(args))
        warnings.warn(
            f"{type(self).__name__} got a plain {type(args).__name__}: converted to {target.__name__} with the "
            f"EVON fields at their defaults. Its learning_rate = {args.learning_rate!r} is used as for AdamW: by the "
            "AdamW part (embeddings, heads, 1-D tensors) and, through lr_from_adamw_lr, for EVON's α = "
            f"{lr_from_adamw_lr(args.learning_rate):g} ({lr_from_adamw_lr(args.learning_rate, finetuning=True):g} "
            f"when all weights of a pretrained model are fine-tuned). Pass an {target.__name__} to set the EVON fields (and to "
            "let EVONTrainer choose the learning rate from the model).",
            UserWarning,
            stacklevel=3,
        )
        values = {k: v for k, v in args.to_dict().items() if not k.startswith("_")}
        # to_dict() masks every *_token field (hub_token, and e.g. TRL's eos_token/pad_token)
        values.update({k: getattr(args, k) for k in values if k.endswith("_token")})
        return target(**{k: v for k, v in values.items() if k in target.__dataclass_fields__})

    @staticmethod
    def _wrap_peft(model: Any, args: TrainingArguments, peft_config: Any) -> nn.Module:
        if model is None or not isinstance(model, nn.Module):
            raise ValueError("peft_config= needs a model (an nn.Module) to wrap")
        if _is_peft_model(model):
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
        if getattr(self, "_loss_shifts_labels", False):
            return True
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model = _base_model(self.accelerator.unwrap_model(self.model))
        config = getattr(model, "config", None)
        if getattr(config, "is_encoder_decoder", False):
            return False
        return model._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()

    def current_posterior(self) -> Any:
        """The posterior that belongs to the model's current weights, or None.

        A snapshot of the EVON optimizer's posterior; the ``posterior`` given to the trainer
        before it has an optimizer; the best checkpoint's posterior after
        ``load_best_model_at_end`` restored that checkpoint's weights.
        """
        if self._posterior_from_checkpoint:
            return self.posterior
        opt = self.evon_optimizer
        if opt is not None and any(g["algorithm"] == "evon" and g["params"] for g in opt.param_groups):
            from hf_evon.posterior.posterior import EVONPosterior

            posterior = EVONPosterior.from_optimizer(
                opt, self.model, max_basis_ratio=self.args.posterior_max_basis_ratio
            )
            if self.calibration is not None and self._calibrated_step == self.state.global_step:
                posterior = posterior.with_ess(self.calibration.ess)
                posterior.config["trained_ess"] = self.calibration.trained_ess
                posterior.config["calibration"] = self.calibration.to_json()
            return posterior
        return self.posterior

    def calibrate(
        self,
        dataset: Any = None,
        grid: Any = None,
        num_samples: int | None = None,
        standard_errors: float | None = None,
        min_gain: float | None = None,
    ) -> Any:
        """Choose the posterior's sampling scale by BMA NLL on held-out ``dataset``.

        :func:`hf_evon.calibrate_posterior` on ``dataset`` (default: the trainer's
        ``calibration_dataset``), with ``bma_num_samples`` samples (8 if 0) and seeds from
        ``bma_seed``; ``standard_errors`` and ``min_gain`` as there. Until the next optimizer step,
        ``current_posterior()`` — so evaluation, saving and the model card — uses the calibrated
        scale. Runs by itself at the end of
        ``train()`` when a ``calibration_dataset`` was given. Returns the ``CalibrationResult``.
        """
        from hf_evon.predictive.calibration import DEFAULT_NUM_SAMPLES, calibrate_posterior

        dataset = self.calibration_dataset if dataset is None else dataset
        if dataset is None:
            raise ValueError(
                "calibrate() needs held-out data: pass dataset= or EVONTrainer(calibration_dataset=...)"
            )
        if dataset is self.eval_dataset:
            raise ValueError(
                "calibrate(): dataset is the eval_dataset; calibrate on other examples than you report on"
            )
        self.calibration = None
        posterior = self.current_posterior()
        if posterior is None:
            raise ValueError("calibrate(): no posterior yet (train first, or pass posterior= to the trainer)")
        model = self._wrap_model(self.model, training=False)
        batches = [self._prepare_inputs(b) for b in self.get_eval_dataloader(dataset)]
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
        )
        self.calibration, self._calibrated_step = result, self.state.global_step
        self.log(
            {
                "calibration/ess": result.ess,
                "calibration/ess_multiplier": result.multiplier,
                "calibration/bma_nll": result.chosen_nll,
                "calibration/mean_nll": result.mean_nll,
                "calibration/mean_temperature": result.mean_temperature,
            }
        )
        return result

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """EVON through :func:`hf_evon.build_optimizer`, configured by the ``evon_*`` fields."""
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            self.optimizer = build_optimizer(opt_model, **self.args.evon_optimizer_kwargs())
        return self.optimizer

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any
    ) -> Any:
        """The Trainer's set-up, then :func:`hf_evon.prepare_distributed` for multi-process runs.

        Under DDP each rank must keep its own gradients while sampling (its Hessian estimate needs
        them): ``prepare_distributed`` stops DDP's averaging and lets ``EVON.synchronize`` reduce
        gradients and Hessian numerators once per step. Under FSDP2 (``fsdp`` with
        ``fsdp_config={"fsdp_version": 2}``) the Trainer builds EVON on the plain model and
        accelerate then ``fully_shard``-s it and puts the DTensors into EVON's param groups
        (EVON builds its buckets lazily, at their first use, so nothing refers to the old
        tensors); ``prepare_distributed`` then shards EVON over the FSDP2 mesh and, when
        resuming, EVON's state is loaded from ``evon_optimizer.pt`` (see
        :meth:`_load_optimizer_and_scheduler`). In one process it only checks the model
        (FSDP1/DeepSpeed are refused with a clear error).
        """
        if self._fsdp_requested_without_plugin():
            from hf_evon.distributed.ddp import UnsupportedParallelismError

            raise UnsupportedParallelismError(
                "the Trainer's fsdp arguments are set, but accelerate did not enable FSDP (distributed "
                f"type {self.accelerator.state.distributed_type}): accelerate enables its FSDP plugin on "
                "GPUs and other accelerators only, not on CPU processes, so this run would silently be "
                "plain DDP. On CPUs drop fsdp/fsdp_config (DDP; evon_shard=True shards EVON's state and "
                "work), or shard the model yourself with torch.distributed.fsdp.fully_shard and a plain "
                "training loop (hf_evon.prepare_distributed supports FSDP2 on CPU/gloo)"
            )
        self._evon_fsdp2_resume = None  # set by _load_optimizer_and_scheduler under FSDP2
        model, train_dataloader = super()._prepare_for_training(
            max_steps, train_dataloader, resume_from_checkpoint
        )
        if self.evon_optimizer is not None:
            prepare_distributed(model, self.optimizer, shard=True if self.args.evon_shard else None)
            if self._evon_fsdp2_resume is not None:
                # EVON is sharded over the FSDP2 mesh only now: every rank loads the full state
                # saved by _save_optimizer_and_scheduler and keeps its own part
                check_torch_load_is_safe()
                state = torch.load(self._evon_fsdp2_resume, map_location="cpu", weights_only=True)
                self.evon_optimizer.load_state_dict(state)
                self._evon_fsdp2_resume = None
        return model, train_dataloader

    def _accelerate_fsdp2(self) -> bool:
        """Whether accelerate runs its FSDP2 plugin (the Trainer's ``fsdp`` arguments, version 2)."""
        return bool(getattr(self.accelerator, "is_fsdp2", False))

    def _fsdp_requested_without_plugin(self) -> bool:
        """Whether ``fsdp`` was asked for but accelerate runs without its FSDP plugin (CPUs)."""
        return bool(self.args.fsdp) and getattr(self.accelerator.state, "fsdp_plugin", None) is None

    def _gather_sharded_state(self) -> None:
        """With ``evon_shard``: gather the optimizer state and posterior on every rank, so the
        Trainer's rank-0-only saving (``optimizer.pt``, the posterior) needs no collective."""
        opt = self.evon_optimizer
        if opt is not None and opt.sharding is not None:
            opt.sharding.prefetch()

    def _evon_fsdp2(self) -> bool:
        """Whether EVON runs under FSDP2 (accelerate's plugin, or sharded over an FSDP2 mesh)."""
        opt = self.evon_optimizer
        return opt is not None and (getattr(opt.sharding, "fsdp2", False) or self._accelerate_fsdp2())

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's, plus, under FSDP2, EVON's full state in ``evon_optimizer.pt``.

        The Trainer's FSDP2 ``optimizer.bin`` (torch's distributed checkpoint, gathered by
        parameter name) lacks EVON's own entry (seed, noise streams) and cannot be loaded back
        into sharded EVON; ``optimizer.state_dict()`` (a collective: every rank calls it) is the
        full unsharded state, which the process that saves writes (atomically).
        """
        super()._save_optimizer_and_scheduler(output_dir)
        if self._evon_fsdp2():
            state = self.evon_optimizer.state_dict()
            if self.args.should_save:
                path = os.path.join(output_dir, EVON_OPTIMIZER_NAME)
                torch.save(state, path + ".tmp")
                os.replace(path + ".tmp", path)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The Trainer's, except under FSDP2, where EVON's state comes from ``evon_optimizer.pt``.

        The Trainer resumes FSDP2 optimizers through torch's distributed checkpoint
        (``set_optimizer_state_dict``), which expects per-parameter state shaped (or sharded)
        like the parameters and initialises an empty optimizer by a ``step()`` without samples;
        EVON's per-matrix state (``L``, ``R``, bases) held by one owner fits neither. So under
        FSDP2 only the scheduler is loaded here; the Trainer calls this before
        ``prepare_distributed`` shards EVON, so ``_prepare_for_training`` loads the full state
        saved by :meth:`_save_optimizer_and_scheduler` afterwards, on every rank (each keeps its
        own part). A checkpoint without that file (written before it existed) is refused.
        """
        if checkpoint is None or not self._evon_fsdp2():
            return super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, EVON_OPTIMIZER_NAME)
        if not os.path.isfile(path):
            from hf_evon.distributed.ddp import UnsupportedParallelismError

            raise UnsupportedParallelismError(
                f"EVONTrainer cannot resume this FSDP2 run: the checkpoint {checkpoint} has no "
                f"{EVON_OPTIMIZER_NAME} (EVON's full optimizer state, written by EVONTrainer's FSDP2 "
                "checkpoints); the Trainer's optimizer.bin (torch.distributed.checkpoint) does not fit "
                "EVON's per-matrix state and lacks its noise streams"
            )
        self._evon_fsdp2_resume = path
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            with warnings.catch_warnings(record=True) as caught:
                check_torch_load_is_safe()
                self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
            reissue_pt_warnings(caught)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        self._gather_sharded_state()
        super()._save_checkpoint(model, trial)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        self._gather_sharded_state()
        super().save_model(output_dir, _internal_call)

    # ------------------------------------------------------------------ training step
    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: int, device: torch.device
    ) -> tuple[list, Any]:
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        counts = [
            _count_items(b.get("labels") if isinstance(b, Mapping) else None, self._causal_lm)
            for b in batch_samples
        ]
        self._evon_step_items = None
        self._evon_items_global = False
        if counts and all(c is not None for c in counts):
            total = torch.stack([c.to(device) for c in counts]).sum()
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                total = self.accelerator.gather(total.reshape(1)).sum()
                self._evon_items_global = True
            self._evon_step_items = total
        return batch_samples, num_items_in_batch

    def _loss_is_scaled_for_ga(self) -> bool:
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return self.compute_loss_func is not None

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Tensor | Any],
        num_items_in_batch: Tensor | int | None = None,
    ) -> Tensor:
        """``evon_mc_samples`` sampled forward/backward passes on one micro-batch.

        Returns the loss to log (mean over the samples, this micro-batch's share of the
        accumulated batch's mean loss); see the module docstring for the scaling.
        """
        optimizer = self.evon_optimizer
        if optimizer is None:
            return super().training_step(model, inputs, num_items_in_batch)
        from transformers.utils import is_sagemaker_mp_enabled

        if is_sagemaker_mp_enabled() or self.is_deepspeed_enabled:
            raise NotImplementedError(
                "EVONTrainer supports neither SageMaker model parallelism nor DeepSpeed"
            )
        cp_context, inputs = self._prepare_context_parallel_inputs(model, inputs)
        accumulation = self.current_gradient_accumulation_steps
        with cp_context():
            model.train()
            inputs = self._prepare_inputs(inputs)
            if self._loss_is_scaled_for_ga():
                loss_kwargs = {"num_items_in_batch": num_items_in_batch}
                share = torch.ones((), device=self.args.device)
            else:
                loss_kwargs = {"num_items_in_batch": None}
                items = _count_items(inputs.get("labels"), self._causal_lm)
                total = self._evon_step_items
                if items is None or total is None or float(total) == 0.0:
                    share = torch.tensor(1.0 / accumulation, device=self.args.device)
                else:
                    share = items.to(self.args.device, torch.float32) / total.to(
                        self.args.device, torch.float32
                    )
                    if self._evon_items_global:
                        share = share * self.accelerator.num_processes
            reported = torch.zeros((), device=self.args.device)
            samples = optimizer.mc_samples
            for _ in range(samples):
                with optimizer.sampled_params(train=True):
                    with self.compute_loss_context_manager():
                        loss = self.compute_loss(model, inputs, **loss_kwargs)
                    if self.args.n_gpu > 1:
                        loss = loss.mean()
                    loss = loss * share.to(loss.dtype)
                    # EVON.step divides by the number of recorded samples (A·K): multiply by A
                    self.accelerator.backward(loss * accumulation)
                reported += loss.detach().float()
            del inputs
            if (
                self.args.torch_empty_cache_steps is not None
                and self.state.global_step % self.args.torch_empty_cache_steps == 0
            ):
                from accelerate.utils.memory import clear_device_cache

                clear_device_cache()
            return reported / samples

    # ------------------------------------------------------------------ clipping / grad norm
    def _recorded_samples(self, optimizer: EVON) -> int:
        # EVON divides every gradient by the number of sampled_params(train=True) blocks
        return max(optimizer.recorded_samples, 1)

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        """Clip the *mean* gradient over the step's samples to ``max_grad_norm``; return its norm."""
        if self.evon_optimizer is None:
            return super()._clip_grad_norm(model)
        return self._mean_grad_norm(model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if self.evon_optimizer is None or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        return self._mean_grad_norm(model, None)

    def _mean_grad_norm(self, model: nn.Module, max_norm: float | None) -> Tensor:
        """Norm of the mean gradient over the step's samples, clipped to ``max_norm`` if given.

        A non-finite norm leaves the gradients as they are: scaling them by ``max_norm / nan``
        would write NaN into every gradient, and EVON's non-finite warning would then name the
        first parameter instead of the one that went wrong.
        """
        optimizer = self.evon_optimizer
        optimizer.synchronize()
        n = self._recorded_samples(optimizer)
        params = [p for p in model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if max_norm is not None and bool(torch.isfinite(total)):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm * n, total, foreach=True)
        return total / n

    # ------------------------------------------------------------------ logging
    @torch.no_grad()
    def posterior_statistics(self) -> dict[str, float]:
        """``evon/posterior_std_mean``, ``evon/hess_min``/``max``/``mean``, ``evon/skipped_steps``."""
        optimizer = self.evon_optimizer
        if optimizer is None:
            return {}
        buckets = optimizer.buckets
        if not buckets and optimizer.sharding is None:
            return {}
        rows = []  # per bucket: min H, max H, sum H, sum std (one host sync for all of them)
        count = 0
        for b in buckets:
            hess, group = b.state["hess"], b.group
            q_left, q_right = b.bases() if b.initialized else (None, None)
            if math.isinf(group["ess"]):
                std_sum = hess.new_zeros((), dtype=torch.float64)
            else:
                std = marginal_variance(hess, q_left, q_right, group["ess"], group["weight_decay"])
                std_sum = std.clamp_min(0).sqrt().double().sum()
            rows.append(torch.stack([hess.min().double(), hess.max().double(), hess.double().sum(), std_sum]))
            count += hess.numel()
        t = torch.stack([r.to(rows[0].device) for r in rows]).cpu() if rows else torch.zeros(0, 4)
        if optimizer.sharding is not None:  # sharded: pool every rank's matrices (a collective)
            t, count = optimizer.sharding.pool_rows(t, count)
        if not len(t):
            return {}
        h_min, h_max = float(t[:, 0].min()), float(t[:, 1].max())
        h_sum, std_sum = t[:, 2].tolist(), t[:, 3].tolist()
        health = {f"evon/{k}": v for k, v in optimizer.posterior_health(warn=True).items()}
        return {
            **health,
            "evon/posterior_std_mean": sum(std_sum) / count,
            "evon/hess_min": h_min,
            "evon/hess_max": h_max,
            "evon/hess_mean": sum(h_sum) / count,
            "evon/skipped_steps": float(optimizer.skipped_steps),
        }

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and not any(k.startswith("eval_") for k in logs):
            logs = {**logs, **self.posterior_statistics()}
        super().log(logs, start_time)

    # ------------------------------------------------------------------ evaluation
    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> Any:
        """The subclass's loop (``eval_loss``, ``compute_metrics``), read for ``eval_mean_*``, then BMA."""
        if description != "Evaluation":
            return super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
        evaluation = PosteriorEvaluation(self, metric_key_prefix, with_bma=self._bma_due())
        self._evon_evaluation = evaluation
        try:
            with evaluation.watch(self.model):
                output = super().evaluation_loop(
                    dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
                )
        finally:
            self._evon_evaluation = None
        merge_metrics(output.metrics, evaluation.finish(dataloader))
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
        with evaluation.batch(inputs.get("labels")):  # labels first: a loss may pop them
            return super().prediction_step(
                model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs
            )

    def _bma_due(self) -> bool:
        """Whether this evaluation runs the BMA passes (``bma_eval_every``)."""
        if not self._evon_in_training:
            return True
        every = self.args.bma_eval_every
        if self.state.global_step != self._evon_evaluated_step:  # several eval datasets: one evaluation
            self._evon_evaluated_step = self.state.global_step
            self._evon_evaluations += 1
        at_end = self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps
        return at_end or (every > 0 and self._evon_evaluations % every == 0)

    def posterior_metrics(self, dataloader: Any, metric_key_prefix: str = "eval") -> dict[str, float]:
        """``{prefix}_mean_*`` and ``{prefix}_bma_*`` of ``dataloader`` on their own (one pass at the
        mean, ``bma_num_samples`` sampled passes); ``evaluate()`` reuses its own pass instead."""
        evaluation = PosteriorEvaluation(self, metric_key_prefix, with_bma=True)
        evaluation.reused = False
        return evaluation.finish(dataloader)

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        bma: bool = False,
    ) -> Any:
        """The subclass's ``predict`` (at the posterior mean), or with ``bma=True`` BMA predictions.

        ``bma=True``: ``predictions`` are the averaged probabilities ``1/S Σ_s softmax(logits_s)``
        over ``bma_num_samples`` posterior samples (seeds ``bma_seed + s``), shaped like the
        model's logits; ``metrics`` holds ``{prefix}_bma_*`` where the task has them.
        """
        if not bma:
            return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        posterior = self.current_posterior()
        if posterior is None:
            raise ValueError(
                "predict(bma=True) needs a posterior: train with EVON first, or pass "
                "posterior=EVONPosterior.from_pretrained(...) to the trainer"
            )
        if self.args.bma_num_samples < 1:
            raise ValueError(
                f"predict(bma=True) needs posterior samples, but EVONConfig.bma_num_samples = "
                f"{self.args.bma_num_samples}: set it to >= 1"
            )
        return bma_predict(self, self.get_test_dataloader(test_dataset), posterior, metric_key_prefix)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self._posterior_from_checkpoint = False
        self._evon_in_training, self._evon_evaluations, self._evon_evaluated_step = True, 0, -1
        try:
            output = super().train(*args, **kwargs)
        finally:
            self._evon_in_training = False
        if self.calibration_dataset is not None and self.current_posterior() is not None:
            self.calibrate()
        return output

    def _load_best_model(self) -> None:
        """Load the best checkpoint's weights *and* its posterior (the optimizer's is the last step's)."""
        super()._load_best_model()
        best = self.state.best_model_checkpoint
        if best and all(os.path.isfile(os.path.join(best, f)) for f in POSTERIOR_FILES):
            from hf_evon.posterior.posterior import EVONPosterior

            device = next(self.model.parameters()).device
            self.posterior = EVONPosterior.from_pretrained(best, device=device)
            self._posterior_from_checkpoint = True

    # ------------------------------------------------------------------ saving
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The model (or adapter) as usual, plus the posterior and the model card."""
        super()._save(output_dir, state_dict)
        if not self.args.should_save:
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        posterior = self.current_posterior()
        if posterior is None:
            return
        posterior.save_pretrained(output_dir, model_card=False)
        self._write_model_card(output_dir, posterior)

    def _write_model_card(self, directory: str, posterior: Any) -> None:
        from hf_evon.posterior.model_card import save_trainer_model_card

        save_trainer_model_card(self, directory, posterior)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's card, then the EVON section (the Trainer's card replaces README.md).

        Called on every process (as transformers' example scripts do), a sharded EVON gathers its
        posterior here first: the card is written by rank 0 alone, which must not wait on a
        collective the others never join. (``push_to_hub`` calls it on rank 0 only, right after
        ``save_model`` gathered on every rank, so nothing is left to gather then.)"""
        self._gather_sharded_state()
        super().create_model_card(*args, **kwargs)
        if not self.is_world_process_zero():
            return
        posterior = self.current_posterior()
        if posterior is None and all(
            os.path.isfile(os.path.join(self.args.output_dir, f)) for f in POSTERIOR_FILES
        ):
            from hf_evon.posterior.posterior import EVONPosterior

            posterior = EVONPosterior.from_pretrained(self.args.output_dir)
        if posterior is not None:
            self._write_model_card(self.args.output_dir, posterior)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Copy the checkpoint's posterior into the output directory before the Trainer uploads it."""
        if self.is_world_process_zero():
            output_dir = self.args.output_dir
            copied = False
            for name in POSTERIOR_FILES:
                src = os.path.join(checkpoint_folder, name)
                if os.path.isfile(src):
                    shutil.copy(src, os.path.join(output_dir, name))
                    copied = True
            if copied:
                from hf_evon.posterior.posterior import EVONPosterior

                self._write_model_card(output_dir, EVONPosterior.from_pretrained(output_dir))
        super()._push_from_checkpoint(checkpoint_folder)
