"""EVON's default hyperparameters and the rules that derive the others from them.

Each default carries one line of why; the measurements behind it are in ``docs/defaults.md``
(the section named next to it).
"""

from __future__ import annotations

import math
from typing import Any

from hf_evon.optim.checks import finite, is_real, require

__all__ = [
    "ADAPTER_STEP_RATIO",
    "AUTO_ESS",
    "COLLAPSE_PRIOR_TO_SIGNAL",
    "DEFAULT_CURVATURE_REFIT",
    "DEFAULT_HESS_ESTIMATOR",
    "PRIOR_QUANTILE",
    "DEFAULT_ADAMW_LR",
    "DEFAULT_BETAS",
    "DEFAULT_CLIP",
    "DEFAULT_CLIP_RADIUS",
    "DEFAULT_FINETUNING_HESS_INIT",
    "DEFAULT_FINETUNING_LR",
    "DEFAULT_MAX_PRECOND_RATIO",
    "DEFAULT_HESS_CLIP_RATIO",
    "DEFAULT_HESS_INIT",
    "DEFAULT_INIT_STD_RATIO",
    "DEFAULT_LR",
    "DEFAULT_PRIOR_STD_RATIO",
    "DEFAULT_SNR_SCALING",
    "DEFAULT_STEP_CURVATURE",
    "DEFAULT_WEIGHT_DECAY",
    "SNR_AVERAGE_BETA",
    "STEP_RATIOS",
    "default_adapter_lr_scale",
    "default_clip",
    "default_hess_init",
    "default_weight_decay",
    "noise_std_ratio",
    "is_snr_scaling",
    "lr_from_adamw_lr",
    "ratio_clip",
    "snr_floor",
]

# ζ chosen from the weights' scale when the optimizer first sees them (docs/defaults.md#ess-auto)
AUTO_ESS = "auto"
# the initial posterior std, 5% of the weights' RMS: large enough to explore, small enough to train
# (docs/defaults.md#ess-auto)
DEFAULT_INIT_STD_RATIO = 0.05
# the prior's std, 25% of the weights' RMS: where the noise ends once H has decayed
# (docs/defaults.md#prior)
DEFAULT_PRIOR_STD_RATIO = 0.25
# H from squared rotated gradients: the Price estimate's noise is ~100x its signal at the noise
# a small model trains under, so it measures nothing there (docs/defaults.md#hess-estimator)
DEFAULT_HESS_ESTIMATOR = "fisher"
# under the Fisher estimate, ess="auto" and weight_decay=None are refit from the measured H every
# this many steps: the curvature falls as the model fits, and the prior must stay below it
# (docs/defaults.md#curvature-fit)
DEFAULT_CURVATURE_REFIT = 50
# δ = this quantile of H: the data, not the prior, sets the variance of the other entries, and the
# prior's variance stays within a few times the pooled one (docs/defaults.md#curvature-fit)
PRIOR_QUANTILE = 0.3
# the step divides by each matrix's mean curvature: per-entry division by a learned H steps hard
# along the directions the data barely constrains (docs/defaults.md#step-curvature)
DEFAULT_STEP_CURVATURE = "matrix"
# h0: the paper's CLIP fine-tuning range (docs/defaults.md#hess-init)
DEFAULT_HESS_INIT = 0.01
# h0 of full fine-tuning: ζ, the noise schedule and the pull on the mean at a pretrained model's
# scale (docs/defaults.md#finetuning-hess-init)
DEFAULT_FINETUNING_HESS_INIT = 1e-3
# β1 the paper's; β2 slower than its 0.95, because the Price estimate is noisy at small noise
# (docs/defaults.md#betas)
DEFAULT_BETAS = (0.95, 0.995)
# γ of the adaptive Hessian clip: the paper's (docs/defaults.md#betas)
DEFAULT_HESS_CLIP_RATIO = 2.0
# the update's entry bound ("element") or entry RMS ("whiten_rms") per unit α (docs/defaults.md#clip)
DEFAULT_CLIP_RADIUS = 0.01
# a matrix side more than this many times its other side keeps the identity basis: its basis holds
# that many entries per weight, and its rotations and refresh cost that many times the matrix's own
# step (a CNN's 10×2048 head: its run 17–20× longer with that basis; docs/defaults.md#max-precond-ratio)
DEFAULT_MAX_PRECOND_RATIO = 128.0
# torch.optim.AdamW's default, for the parameters EVON does not own
DEFAULT_ADAMW_LR = 1e-3
# TrainingArguments' default: full fine-tuning of a pretrained model
DEFAULT_FINETUNING_LR = 5e-5
# each matrix's clipped step times min(1, ρ), Adam's own pooled step size: large while the
# gradients carry signal, small once they are noise, so noisy labels are not memorised
# (docs/defaults.md#snr-adam)
DEFAULT_SNR_SCALING = "adam"
# what starts from scratch in a pretrained model (LoRA A/B, modules_to_save, a new task head)
# steps at most this multiple of the AdamW rate per entry before min(1, ρ), whatever the clip mode:
# AdamW's own step, so a rate tuned for AdamW means the same; larger steps memorise the noisy
# labels of small data (docs/defaults.md#adapter-lr-scale)
ADAPTER_STEP_RATIO = 1.0
# EVON's step bound (entry RMS under "whiten_rms") per unit AdamW rate before min(1, ρ), by (clip
# mode, full fine-tuning); a fully fine-tuned model steps at the adapters' bound, AdamW's own
# (docs/defaults.md#step-ratios)
STEP_RATIOS = {("element", False): 0.4, ("element", True): ADAPTER_STEP_RATIO, ("whiten_rms", False): 1.6}
# Adam's default β2: the gradient history a step's size is measured against (docs/defaults.md#snr-scaling)
SNR_AVERAGE_BETA = 0.999
# posterior_health warns of a collapse to the prior only where that prior's std is at least this
# fraction of the weights' RMS: below it a collapsed H is the intended ceiling on the noise
# (docs/defaults.md#prior)
COLLAPSE_PRIOR_TO_SIGNAL = 0.5


def default_clip(finetuning: bool = False) -> str:
    """The default ``clip``: "whiten_rms", and "element" for full fine-tuning of a pretrained
    model, where orthogonalised steps move every singular direction alike (docs/defaults.md#clip)."""
    return "element" if finetuning else "whiten_rms"


def ratio_clip(clip: Any, finetuning: bool = False) -> str:
    """The clip mode whose step ratio sizes α for ``clip``: itself if ``STEP_RATIOS`` has it, else
    "element" (a first guess for "none", "spectral", "whiten": their α is the user's to tune)."""
    return clip if isinstance(clip, str) and (clip, bool(finetuning)) in STEP_RATIOS else "element"


def lr_from_adamw_lr(
    adamw_lr: float,
    clip_radius: float = DEFAULT_CLIP_RADIUS,
    step_ratio: float | None = None,
    *,
    clip: str | None = None,
    finetuning: bool = False,
) -> float:
    """EVON's α whose clipped steps match AdamW's at ``adamw_lr`` (entry RMS ``step_ratio``·rate).

    So a learning rate tuned for AdamW carries over. ``step_ratio=None`` takes the measured ratio
    of ``clip`` (None: ``default_clip(finetuning)``) from ``STEP_RATIOS``: 1e-3 from scratch or
    through LoRA -> 0.16 ("whiten_rms"), 0.04 ("element"); full fine-tuning at 5e-5 -> 0.005
    ("element"); each then scaled by min(1, ρ) (``DEFAULT_SNR_SCALING``). Only those
    have a measured ratio ("spectral" bounds singular values, "whiten" ignores the radius,
    "whiten_rms" fine-tunes poorly): for the others set α (``lr``) yourself.
    """
    require(
        "adamw_lr",
        adamw_lr,
        is_real(adamw_lr) and finite(adamw_lr) and adamw_lr >= 0,
        "a finite number >= 0",
    )
    require("clip_radius", clip_radius, is_real(clip_radius) and finite(clip_radius) and clip_radius > 0, "a finite number > 0")
    clip = default_clip(finetuning) if clip is None else clip
    if step_ratio is None:
        known = sorted(c for c, ft in STEP_RATIOS if ft == bool(finetuning))
        setting = "full fine-tuning" if finetuning else "training from scratch"
        require(
            "clip",
            clip,
            clip in known,
            f"one of {known}, the modes with a measured ratio for {setting}; else set lr",
        )
        step_ratio = STEP_RATIOS[(clip, bool(finetuning))]
    require("step_ratio", step_ratio, finite(step_ratio) and step_ratio > 0, "a finite number > 0")
    return step_ratio * adamw_lr / clip_radius


DEFAULT_CLIP = default_clip()
DEFAULT_LR = (
    STEP_RATIOS[(DEFAULT_CLIP, False)] * DEFAULT_ADAMW_LR / DEFAULT_CLIP_RADIUS
)  # 0.16 (lr_from_adamw_lr)


def default_adapter_lr_scale(clip: Any = DEFAULT_CLIP, finetuning: bool = False) -> float:
    """The multiple of EVON's α that what starts from scratch in a pretrained model gets:
    ``ADAPTER_STEP_RATIO`` over the step ratio α is sized with (``ratio_clip``), so its steps are
    bounded by 1.0·rate per entry in every mode: 0.625 ("whiten_rms", LoRA), 2.5 ("element"), 1
    (full fine-tuning, whose α has that ratio already)."""
    finetuning = bool(finetuning)
    return ADAPTER_STEP_RATIO / STEP_RATIOS[(ratio_clip(clip, finetuning), finetuning)]


def default_hess_init(finetuning: bool = False) -> float:
    """The default h0: 0.01, and 1e-3 for full fine-tuning of a pretrained model."""
    return DEFAULT_FINETUNING_HESS_INIT if finetuning else DEFAULT_HESS_INIT


def snr_floor(beta1: float) -> float:
    """ρ₀ = sqrt((1−β1)/(1+β1)): ‖m‖/RMS‖G‖ of a β1-momentum of pure noise (the step scale's knee)."""
    return math.sqrt((1.0 - beta1) / (1.0 + beta1))


def is_snr_scaling(value: Any) -> bool:
    """Whether ``value`` is an ``snr_scaling``: True, False or "adam" (not 1, not "true")."""
    return isinstance(value, bool) or (isinstance(value, str) and value == "adam")


def default_weight_decay(
    hess_init: float = DEFAULT_HESS_INIT,
    init_std_ratio: float = DEFAULT_INIT_STD_RATIO,
    prior_std_ratio: float = DEFAULT_PRIOR_STD_RATIO,
) -> float:
    """The default prior precision δ: the prior's std 1/sqrt(ζδ) is ``prior_std_ratio /
    init_std_ratio`` (5) times the initial posterior std 1/sqrt(ζ(h0+δ)), whatever ζ; under
    ``ess="auto"`` it is ``prior_std_ratio`` of the weights' RMS. Under the Price estimate it
    bounds the noise once H has decayed: h0·β2ᵗ < δ after t = ln 25 / (1 − β2) ≈ 640 steps
    (docs/defaults.md#prior); under the default Fisher estimate it is δ until the first curvature
    fit and the mean's pull after it (docs/defaults.md#curvature-fit)."""
    if not 0 < init_std_ratio < prior_std_ratio:
        raise ValueError(
            f"default_weight_decay: need 0 < init_std_ratio < prior_std_ratio; got {init_std_ratio!r}, "
            f"{prior_std_ratio!r}"
        )
    return hess_init * init_std_ratio**2 / (prior_std_ratio**2 - init_std_ratio**2)


DEFAULT_WEIGHT_DECAY = default_weight_decay()


def noise_std_ratio(
    t: int,
    hess_init: float = DEFAULT_HESS_INIT,
    beta2: float = DEFAULT_BETAS[1],
    init_std_ratio: float = DEFAULT_INIT_STD_RATIO,
) -> float:
    """The pooled posterior std, as a fraction of the weights' RMS, that ζ is fitted to after ``t``
    steps: sqrt(1/(h0·β2ᵗ + δ₀)) / sqrt(1/(h0 + δ₀)) × ``init_std_ratio``, δ₀ =
    ``default_weight_decay``. It rises from ``init_std_ratio`` (5%) to ``DEFAULT_PRIOR_STD_RATIO``
    (25%) as the isotropic posterior of h0 decaying to δ₀ would: the noise level the mean trains
    well under (docs/defaults.md#curvature-fit); where that noise goes is H's."""
    delta0 = default_weight_decay(hess_init, init_std_ratio)
    return init_std_ratio * math.sqrt((hess_init + delta0) / (hess_init * beta2**t + delta0))
