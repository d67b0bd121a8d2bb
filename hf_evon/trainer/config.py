"""``EVONConfig``: ``TrainingArguments`` plus every EVON hyperparameter and the BMA settings.

One place for what a run is configured with; the Trainer plumbing that reads it lives in
:mod:`hf_evon.trainer.mixin`, the evaluation in :mod:`hf_evon.trainer.evaluation`.
:func:`hf_evon.trainer.combined.evon_config_class` combines ``EVONConfig`` with another trainer's
arguments class (e.g. TRL's ``SFTConfig``), so the EVON fields compose with any ``Trainer`` subclass.
"""

import math
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from transformers import TrainingArguments

from hf_evon.optim.checks import CLIP_MODES, HESS_ESTIMATORS, NONFINITE_MODES, STEP_CURVATURES, python_number
from hf_evon.optim.defaults import (
    AUTO_ESS,
    DEFAULT_ADAMW_LR,
    DEFAULT_BETAS,
    DEFAULT_CLIP_RADIUS,
    DEFAULT_CURVATURE_REFIT,
    DEFAULT_FINETUNING_LR,
    DEFAULT_HESS_CLIP_RATIO,
    DEFAULT_HESS_ESTIMATOR,
    DEFAULT_INIT_STD_RATIO,
    DEFAULT_MAX_PRECOND_RATIO,
    DEFAULT_PRIOR_STD_RATIO,
    DEFAULT_STEP_CURVATURE,
    STEP_RATIOS,
    default_hess_init,
    default_weight_decay,
    lr_from_adamw_lr,
)
from hf_evon.optim.grouping import compiled_patterns
from hf_evon.optim.recipes import RECIPES
from hf_evon.optim.validation import validate_hyperparameters

__all__ = ["EVONConfig", "LOWER_IS_BETTER"]

# learning_rate=None: EVONTrainer picks one of these from the model (the rate AdamW would get)
SCRATCH_LEARNING_RATE = DEFAULT_ADAMW_LR  # torch's AdamW default; from scratch and PEFT adapters
# TrainingArguments' default; full fine-tuning of a pretrained model
FINETUNING_LEARNING_RATE = DEFAULT_FINETUNING_LR

# numbers the help texts quote, from the constants that define them
_RATIO_WHITEN = STEP_RATIOS[("whiten_rms", False)]
_RATIO_ELEMENT = STEP_RATIOS[("element", False)]
_RATIO_FINETUNING = STEP_RATIOS[("element", True)]
_H0, _H0_FINETUNING = default_hess_init(False), default_hess_init(True)
_PRIOR, _PRIOR_FINETUNING = (default_weight_decay(h, DEFAULT_INIT_STD_RATIO) for h in (_H0, _H0_FINETUNING))
_PRIOR_REACHED_AFTER = math.log(_PRIOR / _H0) / math.log(DEFAULT_BETAS[1])  # steps until h0·β2ᵗ = δ
# the metrics EVONTrainer reports that fall as predictions improve (mean_* and bma_*)
LOWER_IS_BETTER = ("_nll", "_ece", "_brier", "_perplexity")
# command line text -> EVON's snr_scaling ("None": the default, chosen from the model)
_SNR_CHOICES = {"true": True, "false": False, "adam": "adam", "None": None}


@dataclass
class EVONConfig(TrainingArguments):
    r"""``TrainingArguments`` plus every EVON hyperparameter and the BMA evaluation settings.

    ``learning_rate`` means what it means for ``Trainer``: the rate you would give AdamW. The
    AdamW part (embeddings, heads, 1-D tensors) uses it as is, and EVON's α is derived from it so
    that EVON's clipped steps match AdamW's (:func:`hf_evon.optim.defaults.lr_from_adamw_lr`): a rate
    tuned for AdamW carries over. Left unset, it is chosen from the model (see the field).
    ``weight_decay``, ``adam_beta1``, ``adam_beta2`` and ``adam_epsilon`` configure the AdamW
    part. EVON's own prior precision is ``evon_weight_decay``. ``optim`` and ``optim_args``
    are not used (EVON builds its own optimizer): setting them warns.
    Every field can be set from the command line through ``HfArgumentParser``.
    """

    learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "The learning rate you would give AdamW (the Trainer's meaning). The AdamW part uses it; EVON's "
            "α = ratio · learning_rate / evon_clip_radius, so EVON's clipped steps have entry RMS ratio · rate "
            f"(hf_evon.optim.defaults.STEP_RATIOS, per clip mode: {_RATIO_WHITEN:g} for 'whiten_rms', {_RATIO_ELEMENT:g} "
            f"for 'element', {_RATIO_FINETUNING:g} for 'element' when all weights of a pretrained model are "
            "fine-tuned: AdamW's own step bound) — unless evon_learning_rate sets α. Default (None): "
            f"{SCRATCH_LEARNING_RATE:g} for a model trained from scratch or through PEFT adapters (torch's AdamW "
            f"default), {FINETUNING_LEARNING_RATE:g} for full fine-tuning of a pretrained model (one loaded with "
            "from_pretrained; the Trainer's default), set on the trainer's own copy (trainer.args; the config "
            "passed stays unset for the next model): edit trainer.args after building the trainer."
        },
    )
    # EVON bounds its own steps (evon_clip); the Trainer's clip would only reweight the gradients its
    # momentum and H average: measured, docs/defaults.md#max-grad-norm
    max_grad_norm: float = field(
        default=0.0,
        metadata={
            "help": "Clip the norm of the mean gradient over the step's samples to this (both EVON's and the AdamW "
            "part's gradients). Default 0: no clip, as EVON's steps are bounded by evon_clip; TrainingArguments' "
            "1.0 lowered EVON's held-out NLL on most tasks where it bit (docs/defaults.md#max-grad-norm)."
        },
    )
    evon_learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "EVON's learning rate α itself (the paper's scale: its tables use 0.004-0.095). Default "
            f"(None): derived from learning_rate ({lr_from_adamw_lr(SCRATCH_LEARNING_RATE):g} at {SCRATCH_LEARNING_RATE:g} "
            "with 'whiten_rms'). Set by evon_recipe."
        },
    )
    evon_recipe: str | None = field(
        default=None,
        metadata={
            "help": "One of the paper's tuned settings (hf_evon.RECIPES: 'nanogpt', 'llama', 'clip-finetuning', "
            "each citing its table). It sets evon_learning_rate and the evon_* fields that are still at their "
            "default values; a field set to another value wins, and a field set to its default value takes the "
            "recipe's (it cannot be told from one left unset). Default: our scale-free defaults.",
        },
    )
    # typed str for the command line (HfArgumentParser turns float | str into float, which refuses
    # 'auto'); __post_init__ parses it: after that it holds 'auto' or a float
    evon_ess: str = field(
        default=AUTO_ESS,
        metadata={
            "help": "Effective sample size ζ of the variational objective, 'auto' or a number (held as 'auto' or a "
            "float): the posterior variance is "
            "1/(ζ(H+δ)). 'auto' (default): the ζ whose initial posterior std is evon_init_std_ratio times the "
            "RMS of the weights (ζ = N, the textbook choice, makes the noise larger than the weights of "
            "every model we tried). A number tempers the posterior by hand; 'inf' disables the noise "
            "(a deterministic SOAP-like optimizer). After training, calibrate the sampling scale on held-out "
            "data (EVONTrainer(calibration_dataset=...) or trainer.calibrate())."
        },
    )
    evon_init_std_ratio: float = field(
        default=DEFAULT_INIT_STD_RATIO,
        metadata={"help": "For evon_ess='auto': the initial posterior std relative to the weights' RMS."},
    )
    evon_hess_init: float | None = field(
        default=None,
        metadata={
            "help": f"Initial Hessian estimate h0 > 0 (everywhere). Default (None): {_H0:g}, or {_H0_FINETUNING:g} for full "
            "fine-tuning of a pretrained model: it sets the initial noise, the noise schedule and the pull on the mean "
            "(hf_evon.optim.defaults.default_hess_init)."
        },
    )
    evon_beta1: float = field(
        default=DEFAULT_BETAS[0], metadata={"help": "β1: momentum of the rotated gradient, in [0, 1)."}
    )
    evon_beta2: float = field(
        default=DEFAULT_BETAS[1],
        metadata={
            "help": f"β2: averaging of the Hessian estimate, in [0, 1). {DEFAULT_BETAS[1]:g} averages "
            f"~{1 / (1 - DEFAULT_BETAS[1]):.0f} steps: at the small noise of evon_ess='auto' each estimate is noisy (the paper's CLIP runs: 0.95)."
        },
    )
    evon_shampoo_beta: float | None = field(
        default=None,
        metadata={
            "help": "β3: averaging of the Shampoo statistics L and R, in [0, 1). Default (None): evon_beta2."
        },
    )
    # a help text's "%" is written "%%": argparse %-formats each one for --help
    evon_weight_decay: float | None = field(
        default=None,
        metadata={
            "help": "Prior precision per datum δ > 0 of EVON-owned weights (0 only with evon_ess inf): the "
            "prior is N(0, 1/(ζδ) I). "
            "Separate from weight_decay, which is AdamW's decoupled weight decay for the other parameters. "
            "Default (None): under the Fisher estimate with evon_ess 'auto' (the defaults), H's 30%% quantile, "
            "fitted after the first weight update (the second step()) and every evon_curvature_refit steps "
            "(docs/defaults.md#curvature-fit); "
            "until then, and under the Price estimate for good, h0 · ρ0² / (ρ² − ρ0²), ρ0 = evon_init_std_ratio, "
            f"ρ = {DEFAULT_PRIOR_STD_RATIO:g} ({_PRIOR:.2g} at h0 {_H0:g}, {_PRIOR_FINETUNING:.2g} for full "
            "fine-tuning): the prior's std, where the Price estimate's noise goes once H has decayed (after "
            f"~{_PRIOR_REACHED_AFTER:.0f} steps: h0·β2ᵗ = δ), is {DEFAULT_PRIOR_STD_RATIO:.0%}% of the weights' RMS "
            "(hf_evon.optim.defaults.default_weight_decay)."
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
    evon_max_precond_ratio: float = field(
        default=DEFAULT_MAX_PRECOND_RATIO,
        metadata={
            "help": "A matrix side more than this many times the other side keeps the identity basis too "
            "(its basis would hold that many entries per weight); inf: no limit."
        },
    )
    evon_hess_clip_ratio: float | None = field(
        default=DEFAULT_HESS_CLIP_RATIO,
        metadata={
            "help": "γ of the adaptive Hessian clipping: each Price estimate (evon_hess_estimator='price'), and "
            "at evon_ess inf each squared rotated gradient, is clamped to ±γ(H+ε); the Fisher estimate at a "
            "finite evon_ess has none to clip. None (or 0 on the command line) disables it. The paper's CLIP "
            "runs use 2.0."
        },
    )
    evon_hess_estimator: str = field(
        default=DEFAULT_HESS_ESTIMATOR,
        metadata={
            "help": "How H is estimated: 'fisher' (EMA of the squared rotated gradient; ess='auto' and "
            "evon_weight_decay=None are then refit from it) or 'price' (the paper's Stein estimate).",
            "choices": list(HESS_ESTIMATORS),
        },
    )
    evon_curvature_refit: int = field(
        default=DEFAULT_CURVATURE_REFIT,
        metadata={"help": "Refit the 'auto' ess and the None weight decay from H every this many steps (0: never)."},
    )
    evon_step_curvature: str = field(
        default=DEFAULT_STEP_CURVATURE,
        metadata={
            "help": "What the step divides by: 'matrix' (each matrix's mean H + δ) or 'entry' (the paper's "
            "per-entry Newton step).",
            "choices": list(STEP_CURVATURES),
        },
    )
    evon_mean_weight_decay: float | None = field(
        default=None,
        metadata={
            "help": "An L2 pull on the mean besides the prior's. None: the prior's default from h0 where "
            "evon_weight_decay is fitted to the curvature, else 0."
        },
    )
    evon_clip: str | None = field(
        default=None,
        metadata={
            "help": "Clipping of EVON's update: 'none' (the pure algorithm), 'element' (|Δ_ij| <= radius, as "
            "IVON), 'spectral' (singular values <= radius), 'whiten' (Newton-Schulz orthogonalisation, as "
            "Muon; the paper's CLIP runs, with a learning rate ~1e-2) or 'whiten_rms' (the same, "
            "scaled to entry RMS evon_clip_radius). Whitening costs ~15 matmuls per matrix and step, noticeable "
            "on CPU. Default (None): 'whiten_rms', and 'element' for full fine-tuning of a pretrained model "
            "(hf_evon.optim.defaults.default_clip; measurements: docs/trainer.md).",
            "choices": [*CLIP_MODES, "None"],
        },
    )
    evon_clip_radius: float = field(
        default=DEFAULT_CLIP_RADIUS,
        metadata={"help": "Radius of 'element' and 'spectral' clipping, the entry RMS of a full-rank 'whiten_rms' step, > 0."},
    )
    # typed str for the command line ('true'/'false'/'adam'); __post_init__ parses it into EVON's
    # snr_scaling: True, False or 'adam' (None: chosen from the model)
    evon_snr_scaling: str | None = field(
        default=None,
        metadata={
            "help": "'adam': scale each matrix's clipped step by min(1, ρ): ρ = |momentum| / RMS of its "
            "gradients (Adam's own step size, hf_evon.optim.defaults.SNR_AVERAGE_BETA), so the step is large while "
            "the gradients carry signal and small once they are noise. 'true': by min(1, ρ/ρ₀), ρ₀ = "
            "sqrt((1-β1)/(1+β1)): full steps until the gradients fade. 'false': off. Default (None): 'adam' "
            "(hf_evon.optim.defaults.DEFAULT_SNR_SCALING). No effect with evon_clip='none'; off in the paper's recipes.",
            "choices": list(_SNR_CHOICES),
        },
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
            "choices": list(NONFINITE_MODES),
        },
    )
    evon_shard: bool = field(
        default=False,
        metadata={
            "help": "Under DDP, each rank owns a cost-balanced share of the matrices: it keeps only their "
            "state and does only their maths (per-rank state and optimizer FLOPs ~1/world). All ranks then "
            "share one posterior sample per step (one noise stream per matrix), so the result equals one "
            "process with the whole batch and evon_shard=True (whose noise streams are the same). Off (the default): "
            "each rank draws its own sample. "
            "Under FSDP2 EVON is always sharded (over the FSDP2 mesh)."
        },
    )
    evon_adamw_learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "Learning rate of the AdamW part (embeddings, heads, biases, norms). Default (None): "
            "learning_rate. Its weight decay, betas and epsilon are weight_decay, adam_beta1/2 and adam_epsilon."
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
    posterior_max_basis_ratio: float | None = field(
        default=3.0,
        metadata={
            "help": "The posterior the trainer builds from its EVON optimizer (current_posterior(): the one it "
            "saves, and the one evaluate()'s and predict(bma=True)'s BMA samples and calibrate() score) drops "
            "an eigenbasis whose side is more than this many times the other side (a LoRA matrix's d x d "
            "side): every marginal std is kept, the correlations along that side are not, and the posterior "
            "stays within ~2x the model or adapter bytes (measurements: docs/trainer.md). A posterior= given "
            "to the trainer is used as it is. None (or 0 on the command line) keeps every basis: the full posterior."
        },
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
    bma_eval_every: int = field(
        default=1,
        metadata={
            "help": "BMA passes cost bma_num_samples forward passes per evaluation: run them on every k-th "
            "evaluation during training (1: every one) and at the evaluation at which training stops, whatever k "
            "(at the last step, or where a callback such as EarlyStoppingCallback stops it); 0: only there. An "
            "evaluation before the first step (eval_on_start) counts toward no k-th and runs them with k = 1 only. "
            "evaluate() outside train() always runs them. Evaluations without BMA still report the eval_mean_* "
            "metrics."
        },
    )

    # config field -> the EVON keyword that checks its value (betas: the pair's position)
    _EVON_CHECKED: ClassVar[dict[str, str | tuple[str, int]]] = {
        "learning_rate": "adamw_lr",  # the rate AdamW would get: EVON's rule for adamw_lr
        "evon_learning_rate": "lr",
        "evon_ess": "ess",
        "evon_init_std_ratio": "init_std_ratio",
        "evon_hess_init": "hess_init",
        "evon_beta1": ("betas", 0),
        "evon_beta2": ("betas", 1),
        "evon_shampoo_beta": "shampoo_beta",
        "evon_weight_decay": "weight_decay",
        "evon_mc_samples": "mc_samples",
        "evon_precondition_frequency": "precondition_frequency",
        "evon_max_precond_dim": "max_precond_dim",
        "evon_max_precond_ratio": "max_precond_ratio",
        "evon_hess_clip_ratio": "hess_clip_ratio",
        "evon_hess_estimator": "hess_estimator",
        "evon_curvature_refit": "curvature_refit",
        "evon_step_curvature": "step_curvature",
        "evon_mean_weight_decay": "mean_weight_decay",
        "evon_clip": "clip",
        "evon_clip_radius": "clip_radius",
        "evon_snr_scaling": "snr_scaling",
        "evon_phased_gradients": "phased_gradients",
        "evon_identity_basis": "identity_basis",
        "evon_stagger_refresh": "stagger_refresh",
        "evon_nonfinite": "nonfinite",
        "evon_seed": "seed",
        "evon_adamw_learning_rate": "adamw_lr",
        # the AdamW part: TrainingArguments accepts anything here, torch.optim.AdamW fails much later
        "adam_beta1": ("adamw_betas", 0),
        "adam_beta2": ("adamw_betas", 1),
        "adam_epsilon": "adamw_eps",
        "weight_decay": "adamw_weight_decay",
    }

    def __post_init__(self) -> None:
        self._refuse_fp16()  # before TrainingArguments' own checks, so this is the error users see
        if self.greater_is_better is None and (self.metric_for_best_model or "").endswith(LOWER_IS_BETTER):
            self.greater_is_better = False  # transformers' default knows only that a "...loss" falls
        super().__post_init__()
        self._finish_evon_fields()

    def _refuse_fp16(self) -> None:
        if self.fp16:
            raise ValueError(
                "EVONConfig.fp16 = True is not supported: fp16 needs loss scaling (GradScaler), and EVON "
                "records its Hessian estimate G°⊙E from the scaled gradients; use bf16=True (no scaling) "
                "or float32"
            )

    def _finish_evon_fields(self) -> None:
        """What ``__post_init__`` does after ``TrainingArguments``': the EVON fields' values and checks."""
        self._parse_command_line_values()
        self._check_with_evon()
        self._check_trainer_fields()
        self._warn_unused_optimizer_settings()

    def _parse_command_line_values(self) -> None:
        """The typed values of fields the command line gives as text ("0" = off, "inf", "true"), and
        Python's numbers for NumPy's (a search's grid): the counts' checks take ``int``, and
        ``to_json_string()`` (the Trainer's logs, the integrations) takes no NumPy number."""
        for f in fields(self):
            value = getattr(self, f.name)
            if (converted := python_number(value)) is not value:
                setattr(self, f.name, converted)
        if self.posterior_max_basis_ratio is not None and self.posterior_max_basis_ratio == 0:
            self.posterior_max_basis_ratio = None  # "0" on the command line means keep every basis
        if self.evon_hess_clip_ratio is not None and self.evon_hess_clip_ratio == 0:
            self.evon_hess_clip_ratio = None  # "0" on the command line means off
        if self.evon_clip == "None":  # the command line's text for the default
            self.evon_clip = None
        if isinstance(self.evon_snr_scaling, str):
            self.evon_snr_scaling = _SNR_CHOICES.get(self.evon_snr_scaling, self.evon_snr_scaling)
        if self.evon_ess is None:  # None means the default, "auto"
            self.evon_ess = AUTO_ESS
        if isinstance(self.evon_ess, str) and self.evon_ess != AUTO_ESS:
            try:  # "1e6", "inf"
                self.evon_ess = float(self.evon_ess)
            except ValueError:
                pass  # left as given, for EVON's check to name
        for name in ("evon_patterns", "adamw_patterns"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, [getattr(self, name)])

    def _check_with_evon(self) -> None:
        """Each EVON hyperparameter checked by EVON itself, the error naming the config's field.

        ``validate_hyperparameters`` (the checks ``EVON(...)`` runs) gets the field's value, EVON's
        defaults standing for the rest (plus the fields ``weight_decay=None`` is resolved from); None,
        where a field's None means "chosen from the model", is not passed. ``evon_init_std_ratio`` beside
        a given ``evon_weight_decay`` is checked once more with the config's own ``evon_ess``,
        ``evon_hess_estimator`` and ``evon_curvature_refit``: they decide whether its bound applies.
        """
        none_chooses = {f.name for f in fields(self) if f.default is None}  # None: chosen from the model
        for name, keyword in self._EVON_CHECKED.items():
            value = getattr(self, name)
            if value is None and name in none_chooses:
                continue
            kwargs: dict[str, Any] = {}
            if isinstance(keyword, tuple):
                keyword, index = keyword
                pair = list(DEFAULT_BETAS if keyword == "betas" else (0.9, 0.999))
                pair[index] = value
                value = tuple(pair)
            if (
                keyword == "init_std_ratio"
            ):  # weight_decay=None derives the prior from it (a set one is checked below)
                kwargs["weight_decay"] = None if self.evon_weight_decay is None else 0.0
                # the bound a curvature fit of ζ sets: checked below, with the fields that decide the fit
                kwargs["curvature_refit"] = 0
            if keyword == "weight_decay":  # 0 is a valid prior only with ess inf (checked above)
                kwargs["ess"] = self.evon_ess
            kwargs[keyword] = value
            try:
                validate_hyperparameters(**kwargs)
            except (ValueError, TypeError) as err:
                raise ValueError(f"EVONConfig.{name} = {getattr(self, name)!r} is invalid: {err}") from None
        if self.evon_weight_decay is not None:  # (None: refused above, by weight_decay=None's own rule)
            fit = dict(ess=self.evon_ess, hess_estimator=self.evon_hess_estimator, curvature_refit=self.evon_curvature_refit)
            try:
                validate_hyperparameters(init_std_ratio=self.evon_init_std_ratio, weight_decay=self.evon_weight_decay, **fit)
            except (ValueError, TypeError) as err:
                raise ValueError(f"EVONConfig.evon_init_std_ratio = {self.evon_init_std_ratio!r} is invalid: {err}") from None

    def _check_trainer_fields(self) -> None:
        """The fields only the trainer uses (posterior saving, BMA evaluation, recipes, patterns)."""

        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"EVONConfig.{name} = {getattr(self, name)!r} is invalid: it must be {rule}")

        def count(x: Any, low: int) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= low

        need(
            self.posterior_max_basis_ratio is None
            or (
                isinstance(self.posterior_max_basis_ratio, int | float)
                and not isinstance(self.posterior_max_basis_ratio, bool)
                and self.posterior_max_basis_ratio >= 1
            ),
            "posterior_max_basis_ratio",
            "None (keep every basis) or a number >= 1",
        )
        need(
            self.evon_recipe is None or self.evon_recipe in RECIPES,
            "evon_recipe",
            f"None or one of {sorted(RECIPES)}",
        )
        # a dict or JSON file gives values untyped: the string "false" would turn sharding on
        need(isinstance(self.evon_shard, bool), "evon_shard", "True or False (a bool, not a string or number)")
        need(count(self.bma_num_samples, 0), "bma_num_samples", "an integer >= 0")
        # any integer: sample s is seeded bma_seed + s (hf_evon.optim.noise.resolve_seed)
        need(isinstance(self.bma_seed, int) and not isinstance(self.bma_seed, bool), "bma_seed", "an integer")
        need(count(self.bma_ece_bins, 1), "bma_ece_bins", "an integer >= 1")
        need(
            count(self.bma_eval_every, 0),
            "bma_eval_every",
            "an integer >= 0 (0: only at the end of training)",
        )
        best = self.metric_for_best_model or ""
        bma_best = "bma_" in best
        need(not (bma_best and self.bma_num_samples == 0), "bma_num_samples", f"> 0 for metric_for_best_model {best!r}")
        if self.bma_eval_every != 1 and bma_best:
            raise ValueError(
                f"EVONConfig.metric_for_best_model = {best!r} is a BMA metric, which only evaluations with BMA "
                f"report, but EVONConfig.bma_eval_every = {self.bma_eval_every}: set bma_eval_every=1 or choose "
                "an eval_mean_* metric"
            )
        for name in ("evon_patterns", "adamw_patterns"):
            compiled_patterns(getattr(self, name), f"EVONConfig.{name}")

    def _warn_unused_optimizer_settings(self) -> None:
        """``optim``/``optim_args`` select the Trainer's optimizer, which EVON replaces: say so once, and set
        both back to their defaults (the Trainer also reads ``optim`` while training: LOMO's
        ``backward(learning_rate=...)``)."""
        default = type(self).__dataclass_fields__["optim"].default
        optim = getattr(self.optim, "value", self.optim)
        if optim != getattr(default, "value", default) or self.optim_args:
            warnings.warn(
                f"EVONConfig.optim = {optim!r} (optim_args = {self.optim_args!r}) is ignored: EVONTrainer always "
                "builds EVON (EVON for weight matrices, AdamW for embeddings, the LM head and 1-D tensors). "
                "Configure it with learning_rate (as for AdamW), the evon_* fields (evon_learning_rate is EVON's α) "
                "and adam_beta1/2, adam_epsilon, weight_decay (the AdamW part), and leave optim at its default.",
                UserWarning,
                stacklevel=3,
            )
            self.optim, self.optim_args = type(self.optim)(getattr(default, "value", default)), None

    # recipe key -> the config field that holds it (betas: two fields, handled apart)
    _RECIPE_FIELDS: ClassVar[dict[str, str]] = {
        keyword: name for name, keyword in _EVON_CHECKED.items() if name.startswith("evon_") and isinstance(keyword, str)
    }

    def evon_optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`hf_evon.build_optimizer` for these settings (with
        ``evon_recipe``, the recipe's values for every field still at its default).
        ``learning_rate=None`` (which ``EVONTrainer`` resolves from the model first) gives the
        optimizer's own defaults, those for training from scratch."""
        # again: a field set after __post_init__ may be text (a hyperparameter search casts a trial's
        # value to the type of the field's current one: 1000.0 to "1000.0" for evon_ess's "auto")
        self._parse_command_line_values()
        kwargs = self._evon_field_kwargs()
        if self.evon_learning_rate is not None:
            kwargs["lr"] = self.evon_learning_rate
        if self.evon_recipe is None:
            return kwargs
        kwargs["adapter_lr_scale"] = 1.0  # as build_optimizer(recipe=...): adapters at the recipe's α, as tabled
        fields = type(self).__dataclass_fields__
        at_default = {name for name, f in fields.items() if getattr(self, name, None) == f.default}
        for key, value in RECIPES[self.evon_recipe].items():
            if key == "betas":
                beta1, beta2 = kwargs["betas"]
                kwargs["betas"] = (
                    value[0] if "evon_beta1" in at_default else beta1,
                    value[1] if "evon_beta2" in at_default else beta2,
                )
            elif self._RECIPE_FIELDS[key] in at_default:
                kwargs[key] = value
        return kwargs

    def _evon_field_kwargs(self) -> dict[str, Any]:
        return {
            "evon_patterns": self.evon_patterns,
            "adamw_patterns": self.adamw_patterns,
            "learning_rate": self.learning_rate,
            "adamw_lr": self.evon_adamw_learning_rate,
            "adamw_weight_decay": self.weight_decay,
            "ess": self.evon_ess,
            "init_std_ratio": self.evon_init_std_ratio,
            "hess_init": self.evon_hess_init,
            "betas": (self.evon_beta1, self.evon_beta2),
            "weight_decay": self.evon_weight_decay,
            "mc_samples": self.evon_mc_samples,
            "precondition_frequency": self.evon_precondition_frequency,
            "max_precond_dim": self.evon_max_precond_dim,
            "max_precond_ratio": self.evon_max_precond_ratio,
            "shampoo_beta": self.evon_shampoo_beta,
            "hess_clip_ratio": self.evon_hess_clip_ratio,
            "hess_estimator": self.evon_hess_estimator,
            "curvature_refit": self.evon_curvature_refit,
            "step_curvature": self.evon_step_curvature,
            "mean_weight_decay": self.evon_mean_weight_decay,
            "clip": self.evon_clip,
            "clip_radius": self.evon_clip_radius,
            "snr_scaling": self.evon_snr_scaling,
            "phased_gradients": self.evon_phased_gradients,
            "identity_basis": self.evon_identity_basis,
            "stagger_refresh": self.evon_stagger_refresh,
            "adamw_betas": (self.adam_beta1, self.adam_beta2),
            "adamw_eps": self.adam_epsilon,
            "nonfinite": self.evon_nonfinite,
            "seed": self.seed if self.evon_seed is None else self.evon_seed,
        }
