"""``EVONTrainer`` and ``EVONConfig``: a structured weight posterior from ``transformers.Trainer``.

Change two names in a ``Trainer`` script::

    args = EVONConfig(output_dir="out", learning_rate=..., bma_num_samples=16)
    trainer = EVONTrainer(model=model, args=args, train_dataset=..., eval_dataset=...)
    trainer.train()
    trainer.evaluate()      # eval_nll/accuracy/ece/brier at the mean, eval_bma_* under BMA
    trainer.save_model()    # model (or adapter) + evon_posterior.* + model card

What the trainer does differently from ``transformers.Trainer``:

* **Optimizer.** ``create_optimizer`` builds ``EVON`` through :func:`hf_evon.build_optimizer`
  (EVON for weight matrices, AdamW for embeddings, the LM head and 1-D tensors; see the
  ``evon_*`` fields of :class:`EVONConfig`). ``args.optim`` is not used.
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
  not the step). ``optimizer.synchronize()`` runs first (a no-op on one process).
* **Logs.** At logging steps: ``evon/posterior_std_mean`` (mean marginal posterior standard
  deviation over all EVON-owned weights), ``evon/hess_min``/``hess_max``/``hess_mean`` (range
  of the rotated-space Hessian H) and ``evon/skipped_steps``.
* **Evaluation.** ``evaluate()`` runs the usual ``Trainer`` evaluation (``eval_loss`` and your
  ``compute_metrics``, at the posterior mean), then one pass at the mean and
  ``bma_num_samples`` passes at posterior samples ``seed = bma_seed + s`` (the same samples
  for every batch, drawn from an :class:`~hf_evon.EVONPosterior` snapshot, so training's
  noise stream is untouched). The BMA predictive averages *probabilities*:
  ``log p̄ = logsumexp_s log_softmax(logits_s) − log S``. Keys (prefix ``eval``):

  - classification (sequence or token level): ``eval_nll``, ``eval_accuracy``, ``eval_ece``,
    ``eval_brier`` at the mean; ``eval_bma_nll``, ``eval_bma_accuracy``, ``eval_bma_ece``,
    ``eval_bma_brier`` under BMA (definitions in :mod:`hf_evon.metrics`);
  - causal LMs: ``eval_nll`` / ``eval_perplexity`` (mean NLL per label token over the whole
    set, and its exp) at the mean, ``eval_bma_nll`` / ``eval_bma_perplexity`` under BMA;
  - both: ``eval_bma_loss``, the BMA counterpart of the Trainer's ``eval_loss`` (the same
    average of per-batch mean losses), so the two can be compared directly.

  ``predict()`` is the ``Trainer``'s (at the posterior mean). For a model without EVON training
  (e.g. reloaded with ``from_pretrained``) pass ``posterior=EVONPosterior.from_pretrained(dir)``.

* **Saving.** Every checkpoint and ``save_model()`` write ``evon_posterior.safetensors`` and
  ``evon_posterior_config.json`` next to the model (or the PEFT adapter) and create/update the
  model card (``README.md``). ``push_to_hub()`` uploads the output directory, posterior and
  card included. The optimizer state (``optimizer.pt``, ``torch.load(weights_only=True)``-safe,
  including EVON's noise generator) makes ``resume_from_checkpoint`` continue exactly. With
  ``load_best_model_at_end`` the best checkpoint's posterior comes back with its weights.
* **Data parallelism.** After the Trainer wraps the model, ``hf_evon.prepare_distributed`` makes
  EVON correct under DDP (per-rank noise, gradients and Hessian numerators averaged once per
  step by ``EVON.synchronize``); FSDP and DeepSpeed are not supported.
* **PEFT.** ``peft_config=`` wraps the model with ``peft.get_peft_model`` (as TRL does); EVON
  then owns the LoRA matrices and the posterior covers the adapter.
"""

import contextlib
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.utils import logging

from .metrics import calibration_metrics
from .optim import EVON, build_optimizer
from .optim.evon import CLIP_MODES
from .optim.linalg import marginal_variance

logger = logging.get_logger(__name__)

Tensor = torch.Tensor

__all__ = ["EVONConfig", "EVONTrainer"]

POSTERIOR_FILES = ("evon_posterior.safetensors", "evon_posterior_config.json")


@dataclass
class EVONConfig(TrainingArguments):
    r"""``TrainingArguments`` plus every EVON hyperparameter and the BMA evaluation settings.

    ``learning_rate`` is EVON's learning rate α; ``weight_decay``, ``adam_beta1``,
    ``adam_beta2`` and ``adam_epsilon`` configure the AdamW part (parameters EVON does not
    own). EVON's own prior precision is ``evon_weight_decay``. ``optim`` is ignored.
    Every field can be set from the command line through ``HfArgumentParser``.
    """

    learning_rate: float = field(
        default=0.05,
        metadata={
            "help": "EVON learning rate α (EVON-owned weight matrices). EVON takes Newton-like steps "
            "(momentum / (H + δ)), so its scale is not AdamW's: with the default element-wise clipping at "
            "radius 0.01 a weight moves at most α·0.01 per step. The AdamW part has its own "
            "evon_adamw_learning_rate."
        },
    )
    evon_ess: float | None = field(
        default=None,
        metadata={
            "help": "Effective sample size ζ of the variational objective: the posterior variance is "
            "1/(ζ(H+δ)). Default (None): the training-set size, len(train_dataset) (an error for datasets "
            "without a length). Larger values temper the posterior (less noise); 'inf' disables the noise "
            "(a deterministic SOAP-like optimizer)."
        },
    )
    evon_hess_init: float = field(
        default=0.01,
        metadata={"help": "Initial Hessian estimate h0 > 0 (everywhere). Sets the initial noise."},
    )
    evon_beta1: float = field(
        default=0.95, metadata={"help": "β1: momentum of the rotated gradient, in [0, 1)."}
    )
    evon_beta2: float = field(
        default=0.95,
        metadata={"help": "β2: averaging of the Hessian estimate, in [0, 1) (the paper's CLIP runs: 0.95)."},
    )
    evon_shampoo_beta: float | None = field(
        default=None,
        metadata={
            "help": "β3: averaging of the Shampoo statistics L and R, in [0, 1). Default (None): evon_beta2."
        },
    )
    evon_weight_decay: float = field(
        default=1e-6,
        metadata={
            "help": "Prior precision per datum δ >= 0 of EVON-owned weights: the prior is N(0, 1/(ζδ) I). "
            "Separate from weight_decay, which is AdamW's decoupled weight decay for the other parameters."
        },
    )
    evon_mc_samples: int = field(
        default=1, metadata={"help": "Posterior samples (forward/backward passes) per micro-batch, >= 1."}
    )
    evon_precondition_frequency: int = field(
        default=10,
        metadata={"help": "Refresh the eigenbases every f optimizer steps (one power iteration + QR)."},
    )
    evon_max_precond_dim: int = field(
        default=4096,
        metadata={
            "help": "A matrix side larger than this keeps the identity basis (no eigenbasis on that side)."
        },
    )
    evon_hess_clip_ratio: float | None = field(
        default=2.0,
        metadata={
            "help": "γ of the adaptive Hessian clipping: each Hessian estimate is clamped to ±γ(H+ε). "
            "None (or 0 on the command line) disables it. The paper's CLIP runs use 2.0."
        },
    )
    evon_clip: str = field(
        default="element",
        metadata={
            "help": "Clipping of EVON's update: 'none' (the pure algorithm), 'element' (|Δ_ij| <= radius, as "
            "IVON), 'spectral' (singular values <= radius) or 'whiten' (Newton-Schulz orthogonalisation, as "
            "Muon; the paper's CLIP and NanoGPT runs, with a learning rate ~1e-2: it costs ~15 matmuls per "
            "matrix and step, noticeable on CPU).",
            "choices": list(CLIP_MODES),
        },
    )
    evon_clip_radius: float = field(
        default=0.01, metadata={"help": "Radius of 'element' and 'spectral' clipping, > 0."}
    )
    evon_phased_gradients: bool = field(
        default=False,
        metadata={"help": "Alternate clean steps (gradient at the mean) and noisy steps (Hessian update)."},
    )
    evon_identity_basis: bool = field(
        default=False,
        metadata={"help": "Keep Q = I everywhere: IVON, a diagonal posterior (for comparisons)."},
    )
    evon_stagger_refresh: bool = field(
        default=True,
        metadata={"help": "Spread the eigenbasis refreshes of different matrices over the f steps."},
    )
    evon_seed: int | None = field(
        default=None,
        metadata={"help": "Seed of EVON's posterior noise during training. Default (None): seed."},
    )
    evon_nonfinite: str = field(
        default="skip",
        metadata={
            "help": "On a NaN/inf gradient: 'skip' the step (warn, state unchanged) or 'raise'.",
            "choices": ["skip", "raise"],
        },
    )
    evon_adamw_learning_rate: float | None = field(
        default=1e-4,
        metadata={
            "help": "Learning rate of the AdamW part (embeddings, LM head, biases, norms); None: learning_rate "
            "(only sensible when EVON's and AdamW's rates happen to coincide). Its weight decay, betas and "
            "epsilon are weight_decay, adam_beta1/2 and adam_epsilon."
        },
    )
    evon_patterns: list[str] | None = field(
        default=None,
        metadata={"help": "Regexes (re.search on parameter names) of parameters to give to EVON anyway."},
    )
    adamw_patterns: list[str] | None = field(
        default=None,
        metadata={"help": "Regexes of parameters to give to AdamW (checked before evon_patterns)."},
    )
    bma_num_samples: int = field(
        default=8,
        metadata={
            "help": "Posterior samples S for the Bayesian-model-averaging metrics of evaluate() (eval_bma_*). "
            "0 disables BMA evaluation (metrics at the posterior mean are still reported)."
        },
    )
    bma_seed: int = field(
        default=0,
        metadata={
            "help": "BMA sample s uses seed bma_seed + s, so evaluations are reproducible and comparable."
        },
    )
    bma_ece_bins: int = field(
        default=15, metadata={"help": "Number of equal-width confidence bins of the ECE."}
    )

    def __post_init__(self) -> None:
        if self.fp16:  # before TrainingArguments' own checks, so this is the error users see
            raise ValueError(
                "EVONConfig.fp16 = True is not supported: fp16 needs loss scaling (GradScaler), and EVON "
                "records its Hessian estimate G°⊙E from the scaled gradients; use bf16=True (no scaling) "
                "or float32"
            )
        super().__post_init__()
        if self.evon_hess_clip_ratio is not None and self.evon_hess_clip_ratio == 0:
            self.evon_hess_clip_ratio = None  # "0" on the command line means off

        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"EVONConfig.{name} = {getattr(self, name)!r} is invalid: it must be {rule}")

        def unit(x: Any) -> bool:
            return isinstance(x, int | float) and 0.0 <= x < 1.0

        def positive_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= 1

        need(self.learning_rate >= 0, "learning_rate", ">= 0")
        need(
            self.evon_ess is None or self.evon_ess > 0,
            "evon_ess",
            "None (training-set size) or > 0 ('inf' allowed)",
        )
        need(
            math.isfinite(self.evon_hess_init) and self.evon_hess_init > 0,
            "evon_hess_init",
            "a finite number > 0",
        )
        need(unit(self.evon_beta1), "evon_beta1", "in [0, 1)")
        need(unit(self.evon_beta2), "evon_beta2", "in [0, 1)")
        need(
            self.evon_shampoo_beta is None or unit(self.evon_shampoo_beta),
            "evon_shampoo_beta",
            "None or in [0, 1)",
        )
        need(
            math.isfinite(self.evon_weight_decay) and self.evon_weight_decay >= 0,
            "evon_weight_decay",
            "finite and >= 0",
        )
        need(positive_int(self.evon_mc_samples), "evon_mc_samples", "an integer >= 1")
        need(positive_int(self.evon_precondition_frequency), "evon_precondition_frequency", "an integer >= 1")
        need(positive_int(self.evon_max_precond_dim), "evon_max_precond_dim", "an integer >= 1")
        need(
            self.evon_hess_clip_ratio is None or self.evon_hess_clip_ratio > 0,
            "evon_hess_clip_ratio",
            "None (off) or > 0",
        )
        need(self.evon_clip in CLIP_MODES, "evon_clip", f"one of {CLIP_MODES}")
        need(self.evon_clip_radius > 0, "evon_clip_radius", "> 0")
        need(self.evon_nonfinite in ("skip", "raise"), "evon_nonfinite", "'skip' or 'raise'")
        need(
            self.evon_adamw_learning_rate is None or self.evon_adamw_learning_rate >= 0,
            "evon_adamw_learning_rate",
            "None (learning_rate) or >= 0",
        )
        need(
            isinstance(self.bma_num_samples, int)
            and not isinstance(self.bma_num_samples, bool)
            and self.bma_num_samples >= 0,
            "bma_num_samples",
            "an integer >= 0",
        )
        need(positive_int(self.bma_ece_bins), "bma_ece_bins", "an integer >= 1")
        for name in ("evon_patterns", "adamw_patterns"):
            patterns = getattr(self, name)
            if isinstance(patterns, str):
                patterns = [patterns]
                setattr(self, name, patterns)
            for pat in patterns or ():
                try:
                    re.compile(pat)
                except re.error as err:
                    raise ValueError(f"EVONConfig.{name}: {pat!r} is not a valid regex ({err})") from None

    def evon_optimizer_kwargs(self, ess: float) -> dict[str, Any]:
        """Keyword arguments of :func:`hf_evon.build_optimizer` for these settings."""
        return {
            "evon_patterns": self.evon_patterns,
            "adamw_patterns": self.adamw_patterns,
            "adamw_lr": self.learning_rate
            if self.evon_adamw_learning_rate is None
            else self.evon_adamw_learning_rate,
            "adamw_weight_decay": self.weight_decay,
            "lr": self.learning_rate,
            "ess": float(ess),
            "hess_init": self.evon_hess_init,
            "betas": (self.evon_beta1, self.evon_beta2),
            "weight_decay": self.evon_weight_decay,
            "mc_samples": self.evon_mc_samples,
            "precondition_frequency": self.evon_precondition_frequency,
            "max_precond_dim": self.evon_max_precond_dim,
            "shampoo_beta": self.evon_shampoo_beta,
            "hess_clip_ratio": self.evon_hess_clip_ratio,
            "clip": self.evon_clip,
            "clip_radius": self.evon_clip_radius,
            "phased_gradients": self.evon_phased_gradients,
            "identity_basis": self.evon_identity_basis,
            "stagger_refresh": self.evon_stagger_refresh,
            "adamw_betas": (self.adam_beta1, self.adam_beta2),
            "adamw_eps": self.adam_epsilon,
            "nonfinite": self.evon_nonfinite,
            "seed": self.seed if self.evon_seed is None else self.evon_seed,
        }


def _unwrap_evon(optimizer: Any) -> EVON | None:
    """The EVON instance behind accelerate's ``AcceleratedOptimizer`` (or similar wrappers)."""
    seen = 0
    while optimizer is not None and not isinstance(optimizer, EVON) and seen < 8:
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return optimizer if isinstance(optimizer, EVON) else None


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


class EVONTrainer(Trainer):
    """``transformers.Trainer`` that trains with EVON and evaluates/saves the weight posterior.

    Args (beyond ``Trainer``'s):
        args: an :class:`EVONConfig` (a plain ``TrainingArguments`` is converted, EVON fields
            at their defaults).
        peft_config: a ``peft.PeftConfig``; the model is wrapped with ``peft.get_peft_model``
            (as TRL's trainers do) and EVON learns a posterior over the adapter.
        posterior: an :class:`~hf_evon.EVONPosterior` for evaluation and saving before (or
            without) training, e.g. loaded with ``EVONPosterior.from_pretrained``. Once the
            trainer has an EVON optimizer, the optimizer's current posterior is used.

    See the module docstring for the training step, loss scaling, clipping, logged statistics,
    evaluation keys and saved files.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        *trainer_args: Any,
        peft_config: Any = None,
        posterior: Any = None,
        **kwargs: Any,
    ) -> None:
        if args is None:
            args = EVONConfig(output_dir="tmp_trainer")
        elif not isinstance(args, EVONConfig):
            values = {k: v for k, v in args.to_dict().items() if not k.startswith("_")}
            values["hub_token"] = args.hub_token
            args = EVONConfig(**{k: v for k, v in values.items() if k in EVONConfig.__dataclass_fields__})
        if peft_config is not None:
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
            model = get_peft_model(model, peft_config)
        super().__init__(model, args, *trainer_args, **kwargs)
        self.posterior = posterior
        self._posterior_from_checkpoint = False
        self._evon_step_items: Tensor | None = None
        self._evon_items_global = False
        self._causal_lm = self._detect_causal_lm()
        if self._causal_lm:
            # transformers 5.23 decides this from ``model.loss_type``, which is None for e.g. GPT-2
            # although its loss shifts the labels: it then over-counts ``num_items_in_batch`` by one
            # token per sequence, which makes the Trainer's own ``eval_loss`` too small
            self._loss_shifts_labels = True

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
            from .posterior import EVONPosterior

            return EVONPosterior.from_optimizer(opt, self.model)
        return self.posterior

    def _training_set_size(self) -> int:
        dataset = self.train_dataset
        try:
            return len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(
                "EVONConfig.evon_ess is None, which means the training-set size, but the training dataset has "
                "no length (an IterableDataset?): set evon_ess explicitly"
            ) from None

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """EVON through :func:`hf_evon.build_optimizer`, configured by the ``evon_*`` fields."""
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            ess = self.args.evon_ess
            if ess is None:
                ess = float(self._training_set_size())
            self.optimizer = build_optimizer(opt_model, **self.args.evon_optimizer_kwargs(ess))
        return self.optimizer

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any
    ) -> Any:
        """The Trainer's set-up, then :func:`hf_evon.prepare_distributed` for multi-process runs.

        Under DDP each rank must keep its own gradients while sampling (its Hessian estimate needs
        them): ``prepare_distributed`` stops DDP's averaging and lets ``EVON.synchronize`` reduce
        gradients and Hessian numerators once per step. In one process it only checks the model
        (FSDP/DeepSpeed are refused with a clear error).
        """
        model, train_dataloader = super()._prepare_for_training(
            max_steps, train_dataloader, resume_from_checkpoint
        )
        if self.evon_optimizer is not None:
            from .distributed import prepare_distributed

            prepare_distributed(model, self.optimizer)
        return model, train_dataloader

    # ------------------------------------------------------------------ training step
    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: int, device: torch.device
    ) -> tuple[list, Any]:
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        counts = [
            _count_items(b.get("labels") if isinstance(b, dict) else None, self._causal_lm)
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
        optimizer = self.evon_optimizer
        if optimizer is None:
            return super()._clip_grad_norm(model)
        optimizer.synchronize()
        n = self._recorded_samples(optimizer)
        total = self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm * n)
        return total / n

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        optimizer = self.evon_optimizer
        if optimizer is None or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        optimizer.synchronize()
        n = self._recorded_samples(optimizer)
        return self.accelerator.clip_grad_norm_(model.parameters(), float("inf")) / n

    # ------------------------------------------------------------------ logging
    @torch.no_grad()
    def posterior_statistics(self) -> dict[str, float]:
        """``evon/posterior_std_mean``, ``evon/hess_min``/``max``/``mean``, ``evon/skipped_steps``."""
        optimizer = self.evon_optimizer
        if optimizer is None:
            return {}
        buckets = optimizer.buckets
        if not buckets:
            return {}
        h_min, h_max, h_sum, std_sum, count = math.inf, -math.inf, 0.0, 0.0, 0
        for b in buckets:
            hess, group = b.state["hess"], b.group
            q_left, q_right = b.bases() if b.initialized else (None, None)
            h_min = min(h_min, float(hess.min()))
            h_max = max(h_max, float(hess.max()))
            h_sum += float(hess.double().sum())
            if math.isinf(group["ess"]):
                std = torch.zeros(())
            else:
                std = (
                    marginal_variance(hess, q_left, q_right, group["ess"], group["weight_decay"])
                    .clamp_min(0)
                    .sqrt()
                )
            std_sum += float(std.double().sum())
            count += hess.numel()
        return {
            "evon/posterior_std_mean": std_sum / count,
            "evon/hess_min": h_min,
            "evon/hess_max": h_max,
            "evon/hess_mean": h_sum / count,
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
        """The Trainer's loop (``eval_loss``, ``compute_metrics``), then mean and BMA metrics."""
        output = super().evaluation_loop(
            dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
        )
        if description == "Evaluation":
            output.metrics.update(self.posterior_metrics(dataloader, metric_key_prefix))
        return output

    def _forward_logits(self, model: nn.Module, inputs: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
        with torch.no_grad(), self.compute_loss_context_manager():
            outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[1 if "labels" in inputs else 0]
        loss = outputs.get("loss") if isinstance(outputs, dict) else None
        return logits, loss

    def _batch_log_probs(self, logits: Tensor, labels: Tensor, task: str) -> Tensor:
        """Per-batch quantity whose logsumexp over samples gives the BMA: see posterior_metrics."""
        if task == "causal_lm":
            logits = logits[:, :-1].float()
            target = labels[:, 1:]
            logp = torch.log_softmax(logits, dim=-1)
            picked = logp.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            return picked.double()  # (B, T-1): log p(label token)
        return torch.log_softmax(logits.double(), dim=-1)  # (B, C) or (B, T, C)

    def _task(self, logits: Tensor, labels: Tensor) -> str | None:
        if self._causal_lm and logits.ndim == 3 and labels.ndim == 2:
            return "causal_lm"
        if labels.is_floating_point() or logits.shape[-1] < 2:
            return None  # regression / multi-label: no class distribution to average
        if logits.ndim == 2 and labels.ndim == 1:
            return "classification"
        if logits.ndim == 3 and labels.ndim == 2 and logits.shape[:2] == labels.shape:
            return "token_classification"
        return None

    def posterior_metrics(self, dataloader: Any, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Metrics at the posterior mean and under BMA over ``bma_num_samples`` samples.

        One pass over ``dataloader`` at the mean, then one pass per sample ``s`` with the
        weights ``posterior.sampled(model, seed=bma_seed + s)`` (the same sample for every
        batch). Per batch, ``acc ← logaddexp(acc, log_softmax(logits_s))``; after the last
        pass ``log p̄ = acc − log S``. Returns ``{}`` if the batches carry no ``labels`` or
        the task is neither (token) classification nor causal language modelling.
        """
        args = self.args
        model = self._wrap_model(self.model, training=False)
        model.eval()
        posterior = self.current_posterior() if args.bma_num_samples > 0 else None
        num_samples = args.bma_num_samples if posterior is not None else 0
        if args.bma_num_samples > 0 and posterior is None:
            logger.warning(
                "EVONTrainer: no posterior yet (no EVON optimizer, no posterior=): BMA metrics skipped"
            )
        gather = self.accelerator.gather_for_metrics
        pad = self.accelerator.pad_across_processes
        task: str | None = None
        accumulated: list[Tensor] = []
        mean_out: list[tuple[Tensor, Tensor]] = []
        bma_out: list[tuple[Tensor, Tensor]] = []
        bma_batch_losses: list[Tensor] = []
        passes: list[int | None] = [None] + [args.bma_seed + s for s in range(num_samples)]
        for p_index, seed in enumerate(passes):
            context = contextlib.nullcontext() if seed is None else posterior.sampled(self.model, seed=seed)
            last = p_index == len(passes) - 1
            with context:
                for b_index, inputs in enumerate(dataloader):
                    inputs = self._prepare_inputs(inputs)
                    labels = inputs.get("labels")
                    if not isinstance(labels, Tensor):
                        return {}
                    logits, _ = self._forward_logits(model, inputs)
                    if task is None:
                        task = self._task(logits, labels)
                        if task is None:
                            logger.warning(
                                "EVONTrainer: mean/BMA metrics need class logits (classification or causal LM); "
                                f"got logits {tuple(logits.shape)} and labels {tuple(labels.shape)}: skipped"
                            )
                            return {}
                    logp = self._batch_log_probs(logits, labels, task)
                    if seed is None:
                        mean_out.append(self._gathered(logp, labels, task, gather, pad))
                        continue
                    if p_index == 1:
                        accumulated.append(logp)
                    else:
                        accumulated[b_index] = torch.logaddexp(accumulated[b_index], logp)
                    if last:
                        bma = accumulated[b_index] - math.log(num_samples)
                        bma_batch_losses.append(self._batch_loss(bma, labels, task, gather))
                        bma_out.append(self._gathered(bma, labels, task, gather, pad))
        if task is None:
            return {}
        prefix = metric_key_prefix
        metrics = {f"{prefix}_{k}": v for k, v in self._summarize(mean_out, task).items()}
        if bma_out:
            metrics.update({f"{prefix}_bma_{k}": v for k, v in self._summarize(bma_out, task).items()})
            losses = torch.cat(bma_batch_losses)
            finite = torch.isfinite(losses)
            if args.logging_nan_inf_filter and bool(finite.any()):
                losses = losses[finite]
            metrics[f"{prefix}_bma_loss"] = float(losses.mean())
        return metrics

    def _gathered(
        self, logp: Tensor, labels: Tensor, task: str, gather: Any, pad: Any
    ) -> tuple[Tensor, Tensor]:
        if task == "causal_lm":
            mask = labels[:, 1:].ne(-100)
            nll = -(logp * mask).sum(-1)  # per sequence
            stats = torch.stack([nll, mask.sum(-1).double()], dim=-1)  # (B, 2)
            return gather(stats).cpu(), torch.empty(0)
        if task == "token_classification":
            logp, labels = pad(logp, dim=1, pad_index=0.0), pad(labels, dim=1, pad_index=-100)
        return gather(logp.contiguous()).cpu(), gather(labels.contiguous()).cpu()

    def _batch_loss(self, logp: Tensor, labels: Tensor, task: str, gather: Any) -> Tensor:
        """Mean NLL of one batch, repeated like the Trainer's ``eval_loss`` bookkeeping."""
        if task == "causal_lm":
            mask = labels[:, 1:].ne(-100)
            loss = -(logp * mask).sum() / mask.sum().clamp_min(1)
        else:
            flat, target = logp.reshape(-1, logp.shape[-1]), labels.reshape(-1)
            keep = target.ne(-100)
            loss = (
                -flat[keep].gather(1, target[keep, None]).mean()
                if bool(keep.any())
                else flat.new_tensor(math.nan)
            )
        batch_size = self.args.eval_batch_size
        return gather(loss.float().reshape(1).repeat(batch_size)).cpu()

    def _summarize(self, outputs: list[tuple[Tensor, Tensor]], task: str) -> dict[str, float]:
        if task == "causal_lm":
            stats = torch.cat([o for o, _ in outputs])
            nll = float(stats[:, 0].sum() / stats[:, 1].sum().clamp_min(1))
            return {"nll": nll, "perplexity": math.exp(min(nll, 700.0))}
        if task == "token_classification":
            logp = torch.cat([o.reshape(-1, o.shape[-1]) for o, _ in outputs])
            labels = torch.cat([lab.reshape(-1) for _, lab in outputs])
        else:
            logp = torch.cat([o for o, _ in outputs])
            labels = torch.cat([lab for _, lab in outputs])
        return calibration_metrics(logp, labels, "log_probs", n_bins=self.args.bma_ece_bins)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self._posterior_from_checkpoint = False
        return super().train(*args, **kwargs)

    def _load_best_model(self) -> None:
        """Load the best checkpoint's weights *and* its posterior (the optimizer's is the last step's)."""
        super()._load_best_model()
        best = self.state.best_model_checkpoint
        if best and all(os.path.isfile(os.path.join(best, f)) for f in POSTERIOR_FILES):
            from .posterior import EVONPosterior

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
        from .model_card import save_trainer_model_card

        save_trainer_model_card(self, directory, posterior)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's card, then the EVON section (the Trainer's card replaces README.md)."""
        super().create_model_card(*args, **kwargs)
        if not self.is_world_process_zero():
            return
        posterior = self.current_posterior()
        if posterior is None and all(
            os.path.isfile(os.path.join(self.args.output_dir, f)) for f in POSTERIOR_FILES
        ):
            from .posterior import EVONPosterior

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
                from .posterior import EVONPosterior

                self._write_model_card(output_dir, EVONPosterior.from_pretrained(output_dir))
        super()._push_from_checkpoint(checkpoint_folder)
