"""EVON: Eigenbasis Variational Online Newton, as a ``torch.optim.Optimizer``.

Each parameter group is trained either by EVON (``algorithm="evon"``, the default) or by
AdamW (``algorithm="adamw"``). EVON parameters of equal (2-D) shape inside a group share a
*bucket*: their state lives in stacked ``(B, m, n)`` tensors so every step is a handful of
batched matmuls, and the per-parameter entries of ``optimizer.state`` are views into them.

The algorithm is the one in ``EVON_SPEC.md`` (and the paper's appendix derivation). Usage::

    opt = EVON(model.parameters())          # ess="auto": noise scaled to the weights
    for batch in loader:
        for _ in range(opt.mc_samples):
            with opt.sampled_params(train=True):   # weights = one posterior sample
                model(**batch).loss.backward()      # micro-batches may be accumulated here
        opt.step()
        opt.zero_grad()

The loop of the IVON/EVON reference packages, ``with opt.sampled_params(train=True):
opt.zero_grad(); loss.backward()`` per sample, gives the same update: each block records its
own gradient, whatever the code inside does with ``zero_grad`` (see ``sampled_params``).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import numbers
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer
from torch.optim.adam import adam as _functional_adam

from hf_evon.optim.linalg import (
    clip_update,
    eigenbasis,
    gram,
    power_qr,
    rotate,
    rotated_std,
    sample_perturbation,
    unrotate,
)

if TYPE_CHECKING:
    from hf_evon.distributed.sharding import EVONSharding

Tensor = torch.Tensor

CLIP_MODES = ("none", "element", "spectral", "whiten", "whiten_rms")
AUTO_ESS = "auto"
# The defaults below, and why (measured in benchmarks/payoff.py; the paper's tables for the rest):
# * ess="auto", init_std_ratio=0.05: ζ is chosen once, when the optimizer first sees the weights,
#   so that the initial posterior std is 5% of the group's weight RMS. ζ = N (the Bayesian choice)
#   makes the initial noise 3-25x the weights' own scale on every model we tried, and training
#   fails; the paper's tuned runs all use ζ >> N (1e7-1e10 for CLIP; ζ "auto" gives ~2e7-4e7 for
#   MiniLM, inside that range). The scale-free rule transfers across widths and inits.
# * weight_decay=None: δ = h0 · ρ0² / (ρp² − ρ0²) (``default_weight_decay``; 4.2e-4 at h0 0.01,
#   4.2e-5 at fine-tuning's 1e-3), so the prior's std 1/sqrt(ζδ) is ρp/ρ0 = 5 times the initial
#   posterior std: 25% of the weights' RMS under ess="auto" (``DEFAULT_PRIOR_STD_RATIO``). That std
#   is where the noise ends once H has decayed, and it does decay: the data's curvature is below h0
#   and, on average, below δ, so H follows h0·β2ᵗ towards it. Not the estimator's noise:
#   antithetic pairs (z, −z), which cancel its G(M)·z term, cut the mean |Ĥ| 2-3x and leave H, the
#   health statistics and the test NLL as they were (benchmarks/hessian_signal.py: digits MLP, mean
#   Price estimate 4e-5-2.5e-4 per entry after the first quarter of training, δ 4.2e-4). (The paper
#   notes that tight clipping gives smaller H, "which may overestimate the posterior variance".) With the earlier δ = ρ0²·h0 = 2.5e-5 (prior std = the weights' RMS) the
#   default runs past ~1200 steps grew their noise towards that std and warned: digits MLP, 2040
#   steps (120 epochs of benchmarks/payoff.py's task, seed 0), noise-to-signal 0.83 (max 1.17) and
#   test NLL 0.101; with
#   δ = 4e-4: 0.36 (max 0.55) and 0.065 (AdamW 0.107). δ is also the prior's pull on the mean
#   (an L2 penalty δ/2·‖θ‖² per unit of mean loss). Test NLL, mean of 3 seeds, δ = 2.5e-5 -> the
#   default (benchmarks/payoff.py, AdamW in brackets): digits 0.102 -> 0.083 (0.117), breast cancer
#   0.0776 -> 0.0773 (0.090), tiny GPT-2 4.399 -> 4.420 (4.573), MiniLM full fine-tuning (h0 1e-3,
#   δ 2.5e-5 -> 4.2e-5) 0.646 -> 0.648 (0.701), MiniLM LoRA 0.717 -> 0.724 (1.016). At δ = 4e-4,
#   benchmarks/default_transfer.py's tasks (4 seeds; tiny Llama 2): the deeper GELU digits MLP
#   0.099 -> 0.081 (0.142), the small CNN 0.112 -> 0.106 (0.096), wine 0.054 -> 0.057 (0.043), iris
#   0.162 -> 0.163 (0.109), tiny Llama 4.434 -> 4.438 (4.506); the tiny GPT-2 at 2400 steps
#   (seed 0) 3.733 -> 3.764 (3.724). δ = 1e-4 (prior std 50% of the RMS): digits 0.093.
# * hess_init=0.01, betas=(0.95, 0.995), hess_clip_ratio=2: the paper's CLIP fine-tuning
#   (Table "Best hyperparameters for CLIP finetuning": h0 1e-3-1e-2, β1 0.95, γ 2) with a slower
#   Hessian average than its 1-β2 = 0.05, because at small noise the Price estimator is noisy;
#   at 0.995 H decays from h0 over ~200 steps (h0·β2ᵗ: the data's curvature is far below h0, see
#   weight_decay above).
# * clip="whiten_rms" (full fine-tuning: "element"), clip_radius=0.01: while the clip binds (early on
#   H << |momentum|, and H stays near h0·β2ᵗ in runs of a few hundred steps: posterior_health's
#   hess_init_share), every step has entry RMS α·radius: "element" moves each weight by ±α·radius
#   (sign descent, as the IVON recipe's element-wise clipping), "whiten_rms" orthogonalises the
#   step (Newton–Schulz, the paper's best NanoGPT ablation; Muon) and scales it to that RMS
#   (Moonlight's shape scaling: Liu et al. 2025, "Muon is scalable for LLM training"). An AdamW
#   rate maps to α = ratio · rate / radius (``lr_from_adamw_lr``), the ratio per clip mode
#   (``STEP_RATIOS``), measured in benchmarks/payoff.py where AdamW runs at 1e-3 (from scratch,
#   LoRA) and 1e-4 (MiniLM full fine-tuning):
#   - "whiten_rms" from scratch, ratio 0.8 (α = 0.08 at 1e-3): test NLL, mean of 3 seeds, digits
#     0.089 / 0.098 / 0.096 / 0.111 at ratio 0.4 / 0.6 / 0.8 / 1.0 (AdamW 0.117, "element" 0.136),
#     breast cancer 0.136 / 0.091 / 0.078 / 0.082 (AdamW 0.090, "element" 0.070); tiny GPT-2 (seed 0)
#     4.437 / 4.424 / 4.421 at 0.4 / 0.6 / 0.8 (AdamW 4.579, "element" 4.666; 3 seeds at 0.6: 4.405
#     vs AdamW's 4.573); at 0.2 it underfits (digits 0.189). MiniLM LoRA (seed 0, adapters at 5x):
#     NLL 0.682 at ratio 0.2 vs "element" 0.814 and AdamW 1.001.
#   - "element" from scratch, ratio 0.2: Adam's steps on noisy gradients are ~0.2·rate in RMS (the
#     ratio Moonlight matches Muon to AdamW with); every other ratio tried was worse (digits 0.208 at
#     0.1, 0.169 at 0.3 vs 0.136; GPT-2 4.69 and 5.09 vs 4.67).
#   - full fine-tuning of a pretrained model keeps "element", ratio 0.6: there the gradients are
#     small and consistent, so AdamW's steps are nearer its full rate (its update RMS per unit rate,
#     measured on the benchmark's tasks with AdamW: digits 0.13, breast cancer 0.26, tiny GPT-2
#     0.27, MiniLM full fine-tuning 0.38, 0.46 in its first quarter). MiniLM, seed 0, test NLL at
#     ratio 0.35 / 0.5 / 0.6 / 0.7 / 0.85 / 1.0: 0.99 / 0.73 / 0.643 / 0.615 / 0.77 / 0.87 in the
#     benchmark's 3 epochs (AdamW 0.701); at 4 epochs 0.5 / 0.6 / 0.7: 0.607 (an earlier version of
#     the code) / 0.631 / 0.725 (AdamW 0.637). Sign-like steps do not shrink near the optimum as
#     Adam's do, so a ratio past the budget's best overshoots: 0.6 is the one at or below AdamW at
#     both budgets. Orthogonalised steps move every singular direction of a pretrained matrix by the
#     same amount: "whiten_rms" ended at NLL 1.38 (accuracy 76%) at ratio 0.5 and 1.55 (67%) at 0.2
#     (seed 0), as Muon fine-tuning of AdamW-pretrained weights underperforms (Moonlight, ibid.), so
#     it has no fine-tuning ratio here.
#   - full fine-tuning of a pretrained model: "element" with snr_scaling="adam", ratio 1.5 (see
#     ``default_snr_scaling``: the ratios above were measured for it; the older fixed ratio 0.6 follows).
STEP_RATIOS = {("element", False): 0.2, ("element", True): 1.5, ("whiten_rms", False): 0.8}
DEFAULT_CLIP_RADIUS = 0.01
DEFAULT_ADAMW_LR = 1e-3  # torch.optim.AdamW's default, for the parameters EVON does not own
DEFAULT_FINETUNING_LR = 5e-5  # TrainingArguments' default: full fine-tuning of a pretrained model


def default_clip(finetuning: bool = False) -> str:
    """The default ``clip``: "whiten_rms", and "element" for full fine-tuning of a pretrained model."""
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
    through LoRA -> 0.08 ("whiten_rms"), 0.02 ("element"); full fine-tuning at 5e-5 -> 0.0075
    ("element", whose step is then also scaled by min(1, ρ): ``default_snr_scaling``). Only those
    have a measured ratio ("spectral" bounds singular values, "whiten" ignores the radius,
    "whiten_rms" fine-tunes poorly): for the others set α (``lr``) yourself.
    """
    _require(
        "adamw_lr",
        adamw_lr,
        _is_real(adamw_lr) and _finite(adamw_lr) and adamw_lr >= 0,
        "a finite number >= 0",
    )
    _require("clip_radius", clip_radius, _is_real(clip_radius) and clip_radius > 0, "a number > 0")
    clip = default_clip(finetuning) if clip is None else clip
    if step_ratio is None:
        known = sorted(c for c, ft in STEP_RATIOS if ft == bool(finetuning))
        setting = "full fine-tuning" if finetuning else "training from scratch"
        _require(
            "clip",
            clip,
            clip in known,
            f"one of {known}, the modes with a measured ratio for {setting}; else set lr",
        )
        step_ratio = STEP_RATIOS[(clip, bool(finetuning))]
    _require("step_ratio", step_ratio, _finite(step_ratio) and step_ratio > 0, "a finite number > 0")
    return step_ratio * adamw_lr / clip_radius


DEFAULT_CLIP = default_clip()
DEFAULT_LR = (
    STEP_RATIOS[(DEFAULT_CLIP, False)] * DEFAULT_ADAMW_LR / DEFAULT_CLIP_RADIUS
)  # 0.08 (lr_from_adamw_lr)
DEFAULT_HESS_INIT = 0.01
# (Before snr_scaling="adam") full fine-tuning started from h0 = 3e-3: a pretrained model's
# gradients are small, so at h0 = 0.01 the Newton step m̂/(H+δ) stays under the element clip for
# most entries early on and EVON starts slowly (MiniLM, the benchmark's training, first quarter: 7%
# of the entries at the clip, update RMS 0.185·rate where AdamW's is 0.46·rate; last quarter 0.43 vs
# 0.30). Test NLL (accuracy), seed 0, at 1 / 3 / 4 epochs: h0 0.01 1.495 (68%) / 0.643 (79%) /
# 0.631; 3e-3 1.435 (71%) / 0.666 (76%) / 0.669 (78%; calibrated BMA 0.620); 1e-3 1.421 (72%) /
# 0.634 (77%) / 0.694 (76%: overshoots); AdamW 1.412 (71%) / 0.701 (77%) / 0.637 (78%). 3e-3 is the
# one within AdamW's accuracy at every budget there; seed 1 after one epoch: 1.394 (70%) vs AdamW
# 1.368 (74%), h0 0.01 1.462 (62%): narrowed, not closed.
# With snr_scaling="adam" (``default_snr_scaling``) the step's size comes from ρ, not from how many
# entries reach the clip, and h0 = 1e-3 puts the typical pretrained entry there from the first step
# (median |g| 2.2e-5 on MiniLM: |m̂|/h0 ≈ 0.02 > clip_radius).
DEFAULT_FINETUNING_HESS_INIT = 1e-3


def default_hess_init(finetuning: bool = False) -> float:
    """The default h0: 0.01, and 1e-3 for full fine-tuning of a pretrained model."""
    return DEFAULT_FINETUNING_HESS_INIT if finetuning else DEFAULT_HESS_INIT


DEFAULT_BETAS = (0.95, 0.995)
# snr_scaling=True (the default; the paper's recipes turn it off): a clipped step has a fixed size
# (α·radius) however small the gradient gets, where Adam's steps shrink as the gradient fades
# relative to its history (its update RMS per unit rate on the digits MLP: 0.32 in the first
# quarter of training, 0.05 in the last). So at a rate that stays high after the data are fitted,
# EVON's mean random-walks. The step is therefore scaled per matrix by min(1, ρ/ρ₀):
# ρ = ‖m̂‖_F / sqrt(EMA‖G‖²_F), the momentum against the gradients' RMS (Adam's own step size,
# pooled over the matrix), and ρ₀ = sqrt((1-β1)/(1+β1)) (0.16 at β1 = 0.95), the ρ of gradients
# that are pure noise of constant size. The step keeps its size (and the measured STEP_RATIOS)
# while the gradient carries signal or is merely noisy (payoff.py, seed 0, ρ by quarter of
# training: tiny GPT-2 0.20 / 0.14 / 0.16 / 0.18, MiniLM fine-tuning 0.45 -> 0.22, LoRA 0.47 ->
# 0.26) and shrinks once the gradients fade (digits MLP: 0.50, then 0.015). Test NLL without ->
# with it (AdamW), benchmarks/default_transfer.py, 4 seeds:
# - constant rate: wine 0.165 -> 0.065 (0.042), iris 0.134 -> 0.110 (0.103), deeper GELU MLP
#   0.226 -> 0.138 (0.152), tiny Llama 4.258 -> 4.267 (4.234);
# - rate held for half the run, then linear: 0.077 -> 0.058, 0.107 -> 0.108, 0.146 -> 0.146,
#   4.267 -> 4.272; the quickstart's MLP and loop on this schedule (6 seeds) 0.148 -> 0.108 (AdamW 0.096);
# - linear decay (transformers' default): 0.053 -> 0.054, 0.162 -> 0.162, 0.112 -> 0.099, 4.456 ->
#   4.457; payoff.py's digits (9 seeds) 0.113 -> 0.135 (calibrated BMA 0.103 -> 0.126), its
#   other tasks within 0.004.
# A net gain where the schedule does not anneal the rate, about neutral where it does.
SNR_AVERAGE_BETA = 0.999  # Adam's default β2: the gradient history a step's size is measured against


def snr_floor(beta1: float) -> float:
    """ρ₀ = sqrt((1−β1)/(1+β1)): ‖m‖/RMS‖G‖ of a β1-momentum of pure noise (the step scale's knee)."""
    return math.sqrt((1.0 - beta1) / (1.0 + beta1))


# snr_scaling="adam" (the default for full fine-tuning of a pretrained model): each matrix's clipped
# step is scaled by min(1, ρ), i.e. it follows Adam's own (pooled) step size: ≈ 1 on the first
# steps, falling as the gradients' signal-to-noise falls. With the fixed-size steps of
# snr_scaling=True ("element", ratio 0.6, h0 3e-3) EVON started slowly (Newton steps m̂/H under the
# clip while H ≈ h0; the update RMS per unit AdamW rate of MiniLM's encoder matrices on the 66-step
# license task, seed 0: step 1 0.0, first quarter 0.35, then 0.35 / 0.38 / 0.43, where AdamW's is
# 1.0 on step 1, 0.55 in its first quarter, then 0.39 / 0.42 / 0.43) and no fixed ratio served both
# short and long budgets (benchmarks/default_transfer.py's docstring). Front-loaded steps do: test
# NLL (accuracy) at the AdamW rate 5e-5 on that task / payoff.py's minilm_full at 1e-4 for 3 and 4
# epochs, seed 0 — AdamW 1.288 (54%) / 0.701 (77%) / 0.637 (78%); the fixed-ratio default 1.323
# (45%) / 0.666 (76%) / 0.668 (78%); "adam" at ratio 1.0, h0 1e-3: 1.346 (41%) / 0.721 (76%) /
# 0.591 (79%) (ρ pooled over a matrix is below Adam's per-entry step RMS: too small early); "adam"
# at ratio 1.5, h0 1e-3 (the default): 1.226 (59%) / 0.652 (78%) / 0.634 (80%); after one epoch of
# minilm_full 1.397 (71%) vs AdamW's 1.412 (71%) (seed 1: 1.290 (74%) vs 1.368 (74%), where the
# fixed-size steps reached 70%); over 3 seeds 1.182 (59.5%) vs AdamW's 1.273 (56.6%) on the license
# task and 0.646 vs 0.701 on minilm_full (benchmarks/results/payoff.md). Noise off (ess=inf)
# with the fixed ratio gave 1.309 (50%) on the license task: the steps, not the noise, were short.
# From scratch the fixed-size steps stay (snr_scaling=True): their ratios were measured with it.


def is_snr_scaling(value: Any) -> bool:
    """Whether ``value`` is an ``snr_scaling``: True, False or "adam" (not 1, not "true")."""
    return isinstance(value, bool) or (isinstance(value, str) and value == "adam")


def default_snr_scaling(finetuning: bool = False) -> bool | str:
    """The default ``snr_scaling``: True (min(1, ρ/ρ₀)), and "adam" (min(1, ρ)) for full fine-tuning."""
    return "adam" if finetuning else True


DEFAULT_INIT_STD_RATIO = 0.05
DEFAULT_PRIOR_STD_RATIO = 0.25  # the prior's std / the weights' RMS under ess="auto" (see the top)


def default_weight_decay(
    hess_init: float = DEFAULT_HESS_INIT,
    init_std_ratio: float = DEFAULT_INIT_STD_RATIO,
    prior_std_ratio: float = DEFAULT_PRIOR_STD_RATIO,
) -> float:
    """The default prior precision δ: the prior's std 1/sqrt(ζδ) is ``prior_std_ratio /
    init_std_ratio`` (5) times the initial posterior std 1/sqrt(ζ(h0+δ)), whatever ζ; under
    ``ess="auto"`` it is ``prior_std_ratio`` of the weights' RMS. It bounds the noise once the
    Hessian estimate has decayed: h0·β2ᵗ < δ after t = ln 25 / (1 − β2) ≈ 640 steps at the defaults
    (the tests' small MLP: ~800; see the notes at the top)."""
    if not 0 < init_std_ratio < prior_std_ratio:
        raise ValueError(
            f"default_weight_decay: need 0 < init_std_ratio < prior_std_ratio; got {init_std_ratio!r}, "
            f"{prior_std_ratio!r}"
        )
    return hess_init * init_std_ratio**2 / (prior_std_ratio**2 - init_std_ratio**2)


DEFAULT_WEIGHT_DECAY = default_weight_decay()
# posterior_health warns of a collapse to the prior only where that prior's std is at least this
# fraction of the weights' RMS: at the default prior (0.25, more as the weights shrink: 0.36 at
# the end of the 2040-step digits run above) a collapsed H is the intended ceiling on the noise
COLLAPSE_PRIOR_TO_SIGNAL = 0.5
DEFAULT_HESS_CLIP_RATIO = 2.0
ALGORITHMS = ("evon", "adamw")


class NonFiniteGradientError(FloatingPointError):
    """Raised by ``EVON.step`` for a NaN/inf gradient when ``nonfinite="raise"``."""


def _is_real(x: Any) -> bool:
    """A real number (Python or NumPy scalar); not a bool, a string or None."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    """An integer (Python or NumPy scalar); not a bool, a float or a string."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _finite(x: Any) -> bool:
    return _is_real(x) and math.isfinite(x)


def _betas_ok(betas: Any) -> bool:
    """A pair (tuple or list) of numbers in [0, 1)."""
    return (
        isinstance(betas, tuple | list)
        and len(betas) == 2
        and all(_is_real(b) and 0.0 <= b < 1.0 for b in betas)
    )


def _require(name: str, value: Any, ok: bool, rule: str) -> None:
    """The one place argument errors are raised: the message names the argument and its rule."""
    if not ok:
        raise ValueError(f"Invalid {name}: {value!r} (must be {rule})")


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """How EVON views a parameter as a matrix: 1-D/0-D as ``1×d``, N-D as ``(d0, rest)``."""
    if len(shape) <= 1:
        return 1, int(math.prod(shape))
    return int(shape[0]), int(math.prod(shape[1:]))


def preconditioned_sides(
    shape: tuple[int, ...], max_precond_dim: int, identity_basis: bool
) -> tuple[bool, bool]:
    """Which sides get an eigenbasis. 1-D tensors and IVON mode get none (``Q = I``)."""
    if identity_basis or len(shape) <= 1:
        return False, False
    m, n = matrix_shape(shape)
    return 1 < m <= max_precond_dim, 1 < n <= max_precond_dim


def derived_seed(seed: int, *labels: object) -> int:
    """A 63-bit seed for the stream named by ``labels`` (rank, block, parameter name, ...):
    streams are independent of each other and of how many other streams were drawn."""
    text = "\x00".join(str(x) for x in (int(seed), *labels))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def _is_dtensor(p: Tensor) -> bool:
    """Whether ``p`` is a ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallelism)."""
    return type(p).__name__ == "DTensor" and hasattr(p, "placements")


def state_dtype(param: Tensor) -> torch.dtype:
    """Float32 for every parameter dtype, except float64 parameters keep float64."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


@dataclass
class _Bucket:
    """EVON parameters of one group with the same matrix shape, device and bases."""

    group: dict[str, Any]
    params: list[Tensor]
    m: int
    n: int
    left: bool
    right: bool
    dtype: torch.dtype
    state: dict[str, Tensor] = field(default_factory=dict)  # stacked persistent state
    refresh_phase: list[int] = field(default_factory=list)  # refresh when (t + phase) % f == 0
    # transient, only between the first sample of a step and ``step()``
    acc: Tensor | None = None  # Σ_s G°_s ⊙ z_s
    z: Tensor | None = None  # standard-normal draw of the sample in progress
    mean: Tensor | None = None  # the posterior mean while a sample is in the weights
    live: list[int] | None = None  # members a sample perturbs (None: all; frozen ones are left alone)
    exit_grads: Tensor | None = None  # Σ_s G_s as stacked at the last sample's exit, and its
    rotated_grads: Tensor | None = None  # rotation, reused by step() if the gradients are unchanged
    # Q_Lᵀ M Q_R of the current weights, kept up to date by step() where that is exact (see
    # ``EVON._rotated_mean``), with each weight's (version, data_ptr) when it was last valid
    rotated_mean: Tensor | None = None
    mean_stamps: list[tuple[int, int]] | None = None
    # posterior_health's per-matrix runaway watch: members that were non-zero when the optimizer first
    # saw them or whose noise has since been below their RMS (a zero-initialised LoRA B joins once it
    # has outgrown its noise)
    watched: Tensor | None = None  # (B,) bool, on the bucket's device

    @property
    def preconditioned(self) -> bool:
        return self.left or self.right

    @property
    def initialized(self) -> bool:
        return not self.preconditioned or "L" in self.state or "R" in self.state

    @property
    def t(self) -> int:
        return int(self.state["step"].item())

    def bases(self) -> tuple[Tensor | None, Tensor | None]:
        return self.state.get("Q_L"), self.state.get("Q_R")

    def stacked(self, tensors: list[Tensor]) -> Tensor:
        """Stack per-parameter tensors as ``(B, m, n)``, their dtype kept (one copy).

        Called under ``no_grad``: no ``detach``, and no ``reshape`` of a tensor that is already
        ``m×n``, so the aten ops of a step do not grow with the number of parameters."""
        mn = (self.m, self.n)
        return torch.stack([x if x.shape == mn else x.reshape(mn) for x in tensors])

    def matrices(self, tensors: list[Tensor | None]) -> Tensor:
        """Stack per-parameter tensors as ``(B, m, n)`` in the state dtype (None -> zeros)."""
        shaped = [
            torch.zeros(self.m, self.n, device=self.params[0].device, dtype=self.dtype) if x is None else x
            for x in tensors
        ]
        out = self.stacked(shaped)
        return out if out.dtype == self.dtype else out.to(self.dtype)

    def unstacked(self, values: Tensor, idx: Iterable[int]) -> tuple[list[Tensor], list[Tensor]]:
        """``(params, values in each parameter's own shape)`` for the listed members (one unbind)."""
        rows = values.unbind(0)
        pairs = [(self.params[i], rows[i]) for i in idx]
        return [p for p, _ in pairs], [v if v.shape == p.shape else v.reshape(p.shape) for p, v in pairs]

    def grads(self) -> Tensor:
        return self.matrices([p.grad for p in self.params])

    def rotated_mean_grad(self, grad: Tensor, num_samples: int) -> Tensor:
        """``Q_Lᵀ grad Q_R`` for ``grad`` = gradient sum / num_samples; the rotation made at the
        last sample's exit is reused when ``step()`` found the gradients unchanged since."""
        if self.rotated_grads is not None:
            return self.rotated_grads.div_(num_samples)
        return rotate(grad, *self.bases())

    def write_params(self, values: Tensor, members: list[int] | None = None) -> None:
        """Copy ``values[i]`` into member ``i`` (all members, or those listed)."""
        idx = range(len(self.params)) if members is None else members
        # in place into the parameters themselves (callers hold no_grad): the version counter
        # moves, so autograd notices a graph used across a swap; copy_ into the parameter's
        # own shape works for any memory layout (channels_last)
        fresh = self.rotated_mean_valid()
        torch._foreach_copy_(*self.unstacked(values, idx))
        if fresh:  # our own write (a sample in, the mean back out): the rotated mean stays valid
            self.stamp_mean()

    def stamp_mean(self) -> None:
        """Record the weights' versions: ``rotated_mean`` is the rotation of the weights as now."""
        self.mean_stamps = [(p._version, p.data_ptr()) for p in self.params]

    def rotated_mean_valid(self) -> bool:
        """Whether ``rotated_mean`` is the rotation of the weights as they are now: nothing but
        this optimizer wrote them since (in-place writes bump a tensor's version; assigning
        ``.data`` moves its storage; only in-place writes through ``.data`` go unseen)."""
        stamps = self.mean_stamps
        return (
            self.rotated_mean is not None
            and stamps is not None
            and all(s == (p._version, p.data_ptr()) for s, p in zip(stamps, self.params))
        )

    def subset_params(self, members: list[int]) -> _Bucket:
        """A bucket of the listed members, before any state is stacked (sharding's filter)."""
        return _Bucket(
            self.group,
            [self.params[i] for i in members],
            self.m,
            self.n,
            self.left,
            self.right,
            self.dtype,
            refresh_phase=[self.refresh_phase[i] for i in members],
        )

    def subset(self, members: list[int]) -> _Bucket:
        """A bucket of the listed members with copies of their state (``scatter`` writes it back)."""
        idx = torch.tensor(members, device=self.state["hess"].device)

        def pick(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.index_select(0, idx)

        sub = self.subset_params(members)
        sub.state = {k: v if k == "step" else pick(v) for k, v in self.state.items()}  # one shared counter
        sub.acc, sub.exit_grads, sub.rotated_grads = (
            pick(self.acc),
            pick(self.exit_grads),
            pick(self.rotated_grads),
        )
        return sub

    def scatter(self, sub: _Bucket, members: list[int]) -> None:
        idx = torch.tensor(members, device=self.state["hess"].device)
        for k, v in sub.state.items():
            if k != "step":
                self.state[k].index_copy_(0, idx, v)

    def noisy_phase(self) -> bool:
        """Whether the coming step estimates the Hessian from sampled weights."""
        g = self.group
        if math.isinf(g["ess"]):
            return False
        if not g["phased_gradients"]:
            return True
        # phased gradients: the initialising step and even updates are clean
        return self.initialized and (self.t + 1) % 2 == 1


@dataclass
class _Plan:
    """One bucket's step, prepared by ``EVON._plan`` before anything is changed."""

    bucket: _Bucket
    work: _Bucket  # the bucket itself, or the subset of members that have a gradient
    members: list[int] | None  # that subset's indices (None: all members)
    grad: Tensor  # the mean gradient over the step's samples, (B, m, n)
    unchanged: Tensor | None = None  # device flag: gradients as at the last sample's exit
    g_rot: Tensor | None = None  # rotated gradient, when formed already (ess = inf)
    hess: Tensor | None = None  # candidate H (None: H is not updated this step)

    @property
    def clean(self) -> bool:
        """A clean (gradient-at-the-mean) step of phased gradients: no Hessian update."""
        g = self.work.group
        return g["phased_gradients"] and not self.work.noisy_phase() and not math.isinf(g["ess"])


class EVON(Optimizer):
    """Variational optimizer learning a SOAP-Bubble posterior ``N(M, P diag(V) Pᵀ)``.

    Args:
        params: parameters or parameter groups. A group may set ``algorithm="adamw"``
            (embeddings, heads, 1-D tensors in the paper's LM runs); every other group is EVON.
        lr: learning rate α (EVON groups; AdamW groups default to ``adamw_lr``). None: AdamW's
            default rate 1e-3 through ``clip``'s step ratio (``lr_from_adamw_lr``): 0.08 for
            "whiten_rms", 0.02 for "element" and, as a first guess, for the modes without a ratio.
        ess: effective sample size ζ of the objective ``ζ·E[loss] + KL``. ``"auto"`` (default)
            picks, per group, the ζ whose initial posterior std is ``init_std_ratio`` times the
            RMS of the group's weights, when the optimizer first sees them (first
            ``sampled_params`` or ``step``); the chosen number is then stored in the group.
            ``inf`` disables the noise: a deterministic SOAP-like method with squared rotated
            gradients as Hessian. The training-set size (ζ = N) is the textbook choice, but its
            noise is far larger than the weights of any network we tried.
        hess_init: initial Hessian h0 > 0 everywhere.
        betas: (β1, β2) for the rotated momentum and the Hessian.
        weight_decay: prior precision per datum δ: the prior is ``N(0, (ζ δ)^-1 I)``. None (the
            default): ``default_weight_decay(hess_init, init_std_ratio)``, per group: the prior's
            std is 5x the initial posterior std (25% of the weights' RMS under ``ess="auto"``).
        mc_samples: posterior samples per step (the number of ``sampled_params`` blocks).
        precondition_frequency: refresh the eigenbases every f updates (one power step + QR).
        max_precond_dim: a side larger than this keeps the identity basis.
        shampoo_beta: β3 for the statistics L and R (default: β2).
        hess_clip_ratio: γ of the adaptive Hessian clipping (None: off).
        clip: update clipping: "none" (the pure algorithm; it also keeps the prior term's rotated
            mean between steps: one more m×n float per matrix, two fewer matmuls per step),
            "element" (|Δ_ij| ≤ radius),
            "spectral" (singular values ≤ radius), "whiten" (Newton–Schulz, as Muon) or
            "whiten_rms" (the default: Newton–Schulz, scaled to entry RMS ``clip_radius``).
        clip_radius: the radius for "element" and "spectral"; the entry RMS for "whiten_rms".
        snr_scaling: True: scale each matrix's clipped step by min(1, ρ/ρ₀), ρ = ‖m̂‖_F /
            sqrt(EMA‖G‖²_F) (Adam's step size; EMA decay ``SNR_AVERAGE_BETA``) and ρ₀ =
            ``snr_floor(β1)``, so the step shrinks once the gradients fade, as Adam's does (see
            ``SNR_AVERAGE_BETA``). "adam": by min(1, ρ), so the step follows Adam's size all along
            (``default_snr_scaling``: full fine-tuning). No effect with ``clip="none"`` (the Newton
            step has its own size). Keeps one number per matrix. The paper's algorithm (and its
            recipes): False.
        phased_gradients: alternate clean steps (gradient at the mean; L, R updated) and
            noisy steps (sampled weights; Hessian updated).
        identity_basis: keep Q = I everywhere, i.e. IVON (a diagonal posterior).
        stagger_refresh: give each matrix its own phase in the refresh cycle (still every f
            updates), balanced by cost, so no step pays for all QRs at once. False refreshes
            every matrix after the updates with t % f == 0. A group's first (or only) matrix
            always has phase 0.
        init_std_ratio: the initial posterior std relative to the weights' RMS for ``ess="auto"``.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: defaults for AdamW groups
            (``adamw_lr=None``: use ``lr``, EVON's rate, which is rarely right for AdamW).
        nonfinite: "skip" (warn, leave everything untouched) or "raise" on a NaN/inf gradient.
        seed: seed of the posterior noise; each data-parallel rank derives its own stream.
        eps: the ε of adaptive Hessian clipping.
    """

    # torch.amp.GradScaler then hands step() its scale instead of stepping blindly: EVON refuses it
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]],
        lr: float | None = None,
        ess: float | str = AUTO_ESS,
        hess_init: float = DEFAULT_HESS_INIT,
        betas: tuple[float, float] = DEFAULT_BETAS,
        weight_decay: float | None = None,
        mc_samples: int = 1,
        precondition_frequency: int = 10,
        max_precond_dim: int = 4096,
        shampoo_beta: float | None = None,
        hess_clip_ratio: float | None = DEFAULT_HESS_CLIP_RATIO,
        clip: str = DEFAULT_CLIP,
        clip_radius: float = DEFAULT_CLIP_RADIUS,
        snr_scaling: bool | str = True,
        phased_gradients: bool = False,
        identity_basis: bool = False,
        stagger_refresh: bool = True,
        init_std_ratio: float = DEFAULT_INIT_STD_RATIO,
        adamw_lr: float | None = DEFAULT_ADAMW_LR,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        nonfinite: str = "skip",
        seed: int | None = None,
        eps: float = 1e-12,
    ) -> None:
        _require("nonfinite", nonfinite, nonfinite in ("skip", "raise"), "'skip' or 'raise'")
        _require("seed", seed, seed is None or _is_int(seed), "None or an integer")
        # the AdamW defaults are checked here too: with no AdamW group they would go unchecked,
        # and a group's message would name "lr"/"betas" rather than the argument given
        _require(
            "adamw_lr",
            adamw_lr,
            adamw_lr is None or (_finite(adamw_lr) and adamw_lr >= 0.0),
            "None or a finite number >= 0",
        )
        _require("adamw_betas", adamw_betas, _betas_ok(adamw_betas), "two numbers in [0, 1)")
        _require("adamw_eps", adamw_eps, _finite(adamw_eps) and adamw_eps > 0.0, "a finite number > 0")
        _require(
            "adamw_weight_decay",
            adamw_weight_decay,
            _finite(adamw_weight_decay) and adamw_weight_decay >= 0.0,
            "a finite number >= 0",
        )
        if lr is None:
            lr = lr_from_adamw_lr(DEFAULT_ADAMW_LR, clip_radius, clip=ratio_clip(clip))
        defaults = dict(
            algorithm="evon",
            lr=lr,
            ess=ess,
            hess_init=hess_init,
            betas=betas,
            weight_decay=weight_decay,
            mc_samples=mc_samples,
            precondition_frequency=precondition_frequency,
            max_precond_dim=max_precond_dim,
            shampoo_beta=shampoo_beta,
            hess_clip_ratio=hess_clip_ratio,
            clip=clip,
            clip_radius=clip_radius,
            snr_scaling=snr_scaling,
            phased_gradients=phased_gradients,
            identity_basis=identity_basis,
            stagger_refresh=stagger_refresh,
            init_std_ratio=init_std_ratio,
            eps=eps,
            adamw_eps=adamw_eps,
        )
        # the keywords themselves, before any group: the message names the keyword given
        self._validate(self._with_prior({**defaults, "params": []}))
        defaults["betas"] = tuple(betas)
        self._adamw_defaults = dict(
            lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas), weight_decay=adamw_weight_decay
        )
        self.nonfinite = nonfinite
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
        self.seed = int(seed)
        self.skipped_steps = 0
        # posterior_health(warn=True) every this many steps (one host sync each; 0: never)
        self.health_check_every = 100
        self._updates = 0  # steps taken by this object (for the health check's period)
        self._health_warned: set[str] = set()  # each health warning is given once
        self._generators: dict[torch.device, tuple[tuple, torch.Generator]] = {}  # (stream, generator)
        # sampled_params blocks entered so far; a block's noise is fixed by (seed, rank, block, device),
        # so any rank resumes its own stream from a checkpoint saved by another rank
        self._sample_blocks = 0
        self._buckets: list[_Bucket] | None = None
        self._bucket_index: dict[int, tuple[_Bucket, int]] | None = None
        self._samples = 0  # samples recorded since the last step
        self._in_sample = False
        # the gradients the last step consumed, as (weak reference, version) by id(param): a
        # sampled_params block drops them instead of adding them to the new step's samples
        self._consumed: dict[int, tuple[weakref.ref, int]] = {}
        # set by hf_evon.distributed.ddp: all-reduces (averages) a list of tensors in place
        self.gradient_reducer: Callable[[list[Tensor]], None] | None = None
        self._synchronized = False
        # set by hf_evon.prepare_distributed(shard=True): this rank owns (keeps state for, updates) a
        # share of the parameters; see hf_evon.distributed.sharding
        self.sharding: EVONSharding | None = None
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ set-up
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim``'s ``add_param_group``, validated; refused while samples are pending.

        A new group rebuilds the buckets, which would drop the Hessian numerators recorded by
        ``sampled_params`` blocks since the last ``step()``: add groups right after a step.
        """
        if self._in_sample or self._samples:
            raise RuntimeError(
                "add_param_group() was called between a sampled_params(train=True) block and step(): "
                f"the {self._samples} recorded sample(s) would lose their Hessian estimate. Call step() "
                "first, then add the group before the next sample"
            )
        if param_group.get("algorithm", "evon") == "adamw":
            for key, value in self._adamw_defaults.items():
                param_group.setdefault(key, value)
        super().add_param_group(param_group)
        try:
            self._validate(self._with_prior(self.param_groups[-1]))
        except ValueError:
            self.param_groups.pop()  # a refused group leaves the optimizer as it was
            raise
        self._buckets = None

    @staticmethod
    def _with_prior(group: dict[str, Any]) -> dict[str, Any]:
        """``group`` with ``weight_decay=None`` replaced by ``default_weight_decay`` of its h0 and
        init_std_ratio (left None, for ``_validate`` to name, where those are invalid)."""
        if group.get("weight_decay", 0.0) is None and group.get("algorithm", "evon") == "evon":
            h0, ratio = group.get("hess_init"), group.get("init_std_ratio", DEFAULT_INIT_STD_RATIO)
            if _finite(h0) and h0 > 0 and _finite(ratio) and ratio > 0:
                if ratio >= DEFAULT_PRIOR_STD_RATIO:
                    raise ValueError(
                        f"EVON: weight_decay=None makes the prior's std {DEFAULT_PRIOR_STD_RATIO} of the weights' "
                        f"RMS, which needs init_std_ratio below it; got init_std_ratio={ratio!r}: pass weight_decay"
                    )
                group["weight_decay"] = default_weight_decay(h0, ratio)
        return group

    @staticmethod
    def _validate(group: dict[str, Any]) -> None:
        """Check a group's hyperparameters (types and values); the message names the field."""

        def need(name: str, ok: bool, rule: str) -> None:
            _require(name, group.get(name), ok, rule)

        def positive_int(name: str) -> None:
            need(name, _is_int(group[name]) and group[name] >= 1, "an integer >= 1")

        def flag(name: str) -> None:
            need(name, isinstance(group[name], bool), "True or False (a bool, not a string or number)")

        need("algorithm", group["algorithm"] in ALGORITHMS, "'evon' or 'adamw'")
        need("lr", _finite(group["lr"]) and group["lr"] >= 0.0, "a finite number >= 0")
        need("betas", _betas_ok(group["betas"]), "two numbers in [0, 1)")
        wd = group["weight_decay"]
        # None survives _with_prior only where h0 or init_std_ratio is invalid: those are named below
        unresolved = wd is None and group["algorithm"] == "evon"
        need("weight_decay", unresolved or (_finite(wd) and wd >= 0.0), "a finite number >= 0")
        if group["algorithm"] == "adamw":
            need("adamw_eps", _finite(group["adamw_eps"]) and group["adamw_eps"] > 0.0, "a finite number > 0")
            return
        ess = group["ess"]
        need(
            "ess",
            ess == AUTO_ESS if isinstance(ess, str) else (_is_real(ess) and ess > 0.0),
            "'auto' or a number > 0 (float('inf') for no noise)",
        )
        ratio = group.get("init_std_ratio", DEFAULT_INIT_STD_RATIO)
        need("init_std_ratio", _finite(ratio) and ratio > 0.0, "a finite number > 0")
        need("hess_init", _finite(group["hess_init"]) and group["hess_init"] > 0.0, "a finite number > 0")
        for name in ("mc_samples", "precondition_frequency", "max_precond_dim"):
            positive_int(name)
        sb = group["shampoo_beta"]
        need("shampoo_beta", sb is None or (_is_real(sb) and 0.0 <= sb < 1.0), "None or a number in [0, 1)")
        gamma = group["hess_clip_ratio"]
        need("hess_clip_ratio", gamma is None or (_is_real(gamma) and gamma > 0.0), "None or a number > 0")
        need("clip", isinstance(group["clip"], str) and group["clip"] in CLIP_MODES, f"one of {CLIP_MODES}")
        need("clip_radius", _is_real(group["clip_radius"]) and group["clip_radius"] > 0.0, "a number > 0")
        need("eps", _finite(group["eps"]) and group["eps"] > 0.0, "a finite number > 0")
        for name in ("phased_gradients", "identity_basis", "stagger_refresh"):
            flag(name)
        if "snr_scaling" in group:  # groups saved before the option existed lack it (off)
            need("snr_scaling", is_snr_scaling(group["snr_scaling"]), "True, False or 'adam' (a bool or that string)")
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            if p.is_complex():
                label = repr(names[i]) if names else f"#{i} of its group"
                raise ValueError(
                    f"EVON cannot train the complex parameter {label} (shape {tuple(p.shape)}, {p.dtype}): "
                    "its posterior and eigenbasis are real. Train it as a real tensor (torch.view_as_real) "
                    "or in a group with algorithm='adamw'"
                )

    @property
    def mc_samples(self) -> int:
        """The largest ``mc_samples`` over EVON groups (how many samples a step expects)."""
        return max((g["mc_samples"] for g in self.param_groups if g["algorithm"] == "evon"), default=1)

    @property
    def recorded_samples(self) -> int:
        """``sampled_params(train=True)`` blocks recorded since the last step: ``step()`` divides
        the accumulated gradients by this (at least 1), so code that clips or logs the summed
        gradient before the step divides by it too."""
        return self._samples

    def _rank(self) -> int:
        dist = torch.distributed
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _generator(self, device: torch.device) -> torch.Generator:
        """The noise generator of the current ``sampled_params`` block on ``device``."""
        stream = (self.seed, self._rank(), self._sample_blocks, str(device))
        seeded, gen = self._generators.get(device, (None, None))
        if gen is None:
            gen = torch.Generator(device=device)
        if seeded != stream:
            gen.manual_seed(derived_seed(*stream))
            self._generators[device] = (stream, gen)
        return gen

    def _build_buckets(self) -> list[_Bucket]:
        buckets: dict[tuple, _Bucket] = {}
        for gi, group in enumerate(self.param_groups):
            if group["algorithm"] != "evon":
                continue
            for p in group["params"]:
                if self.sharding is None and _is_dtensor(p):
                    raise RuntimeError(
                        f"EVON cannot train the DTensor {self._param_label(p)} as a plain tensor: under "
                        "FSDP2 (fully_shard) call hf_evon.prepare_distributed(model, optimizer) before the "
                        "first sampled_params()/step() (it shards EVON over the mesh)"
                    )
                m, n = matrix_shape(p.shape)
                left, right = preconditioned_sides(
                    tuple(p.shape), group["max_precond_dim"], group["identity_basis"]
                )
                key = (gi, p.device, m, n, left, right, state_dtype(p))
                if key not in buckets:
                    buckets[key] = _Bucket(group, [], m, n, left, right, state_dtype(p))
                buckets[key].params.append(p)
        built = list(buckets.values())
        self._assign_refresh_phases(built)  # over every member: the schedule is the same sharded or not
        if self.sharding is not None:  # keep (and allocate state for) only this rank's members
            built = [self.sharding.owned_bucket(b) for b in built]
            built = [b for b in built if b.params]
        for b in built:
            self._stack_state(b)
            b.watched = torch.stack(torch._foreach_norm([p.detach() for p in b.params])) > 0
        self._resolve_auto_ess()
        return built

    @torch.no_grad()
    def _resolve_auto_ess(self) -> None:
        """Replace ``ess="auto"`` by ζ = 1 / (ρ² · rms² · (h0 + δ)): initial std = ρ · rms.

        rms pools the group's non-zero weights (a zero-initialised LoRA ``B`` says nothing
        about scale); an all-zero group uses 1/sqrt(fan-in), nn.Linear's initial scale.
        """
        for group in self.param_groups:
            if group["algorithm"] != "evon" or group["ess"] != AUTO_ESS:
                continue
            if self.sharding is not None:  # FSDP2: the owners' full matrices (a collective)
                total = self.sharding.square_sums(group["params"])
            else:
                sq = [p.detach().float().square().sum() for p in group["params"]]
                total = torch.stack(sq).cpu() if sq else torch.zeros(0)
            sizes = [p.numel() for p in group["params"]]
            nonzero = [(float(t), n) for t, n in zip(total.tolist(), sizes) if t > 0.0]
            if nonzero:
                rms_sq = sum(t for t, _ in nonzero) / sum(n for _, n in nonzero)
            else:
                fan_in = max((matrix_shape(p.shape)[1] for p in group["params"]), default=1)
                rms_sq = 1.0 / fan_in
            ratio = group.get("init_std_ratio", DEFAULT_INIT_STD_RATIO)
            group["ess"] = 1.0 / (ratio**2 * rms_sq * (group["hess_init"] + group["weight_decay"]))

    def _assign_refresh_phases(self, buckets: list[_Bucket]) -> None:
        """Spread each group's QR work evenly over the f steps of a refresh cycle."""
        for group in self.param_groups:
            members = [(b, i) for b in buckets if b.group is group for i in range(len(b.params))]
            for b in buckets:
                if b.group is group:
                    b.refresh_phase = [0] * len(b.params)
            if not group.get("stagger_refresh", False):
                continue
            f = group["precondition_frequency"]
            load = [0.0] * f

            def cost(member: tuple[_Bucket, int]) -> float:
                b = member[0]
                return float(b.m**3 * b.left + b.n**3 * b.right)

            for b, i in sorted(members, key=cost, reverse=True):  # stable: ties keep order
                phase = load.index(min(load))
                b.refresh_phase[i] = phase
                load[phase] += cost((b, i))

    def _stack_state(self, b: _Bucket) -> None:
        """Move per-parameter state into stacked storage; per-parameter entries become views."""
        device, dt = b.params[0].device, b.dtype
        first = self._member_state(b.params[0])
        step = first.get("step", torch.zeros((), dtype=torch.float32)).detach().clone().cpu()
        fresh = {
            "hess": lambda: torch.full((b.m, b.n), b.group["hess_init"], device=device, dtype=dt),
            "exp_avg": lambda: torch.zeros(b.m, b.n, device=device, dtype=dt),
            # EMA of ‖G‖²_F, one number per matrix (snr_scaling); zero in a state saved without it
            "exp_avg_sq_norm": lambda: torch.zeros((), device=device, dtype=dt),
        }
        keys = list(fresh) + [k for k in ("L", "R", "Q_L", "Q_R") if k in first]
        for k in keys:
            per_param = [self._member_state(p).get(k) for p in b.params]
            if any(x is None for x in per_param) and k not in fresh:
                raise ValueError(f"EVON state {k!r} is missing for some parameters of shape {(b.m, b.n)}")
            b.state[k] = torch.stack([fresh[k]() if x is None else x.to(device, dt) for x in per_param])
        b.state["step"] = step
        for i, p in enumerate(b.params):
            st = self._member_state(p)
            for k in keys:
                st[k] = b.state[k][i]
            st["step"] = step

    def _member_state(self, p: Tensor) -> dict[str, Any]:
        """``self.state`` of a bucket member (under FSDP2 the member is the owner's full copy
        of a DTensor parameter, whose state is kept under the DTensor)."""
        return self.state[p if self.sharding is None else self.sharding.model_param(p)]

    @property
    def buckets(self) -> list[_Bucket]:
        if self._buckets is None:
            self._bucket_index = None
            self._buckets = self._build_buckets()
        return self._buckets

    # ----------------------------------------------------------- sampling
    @contextlib.contextmanager
    def sampled_params(self, train: bool = True) -> Iterator[None]:
        """Put one posterior sample into every EVON-owned weight for the enclosed code.

        With ``train=True`` the block records its own gradient for the next ``step()``, which
        uses the sum over the step's blocks divided by their number. Inside the block ``.grad``
        holds only this block's gradient (micro-batches accumulate there as usual): the
        gradients of earlier samples are set aside at entry and added back at exit, so
        ``opt.zero_grad()`` inside the block (the IVON/EVON reference packages' loop) and
        accumulating without it give the same update. Gradients the previous ``step()``
        consumed and nobody cleared are dropped, not counted again.
        On exit, also on an exception, the mean is restored bit-for-bit; a sample whose block
        raised is not recorded and its gradient is discarded (``.grad`` is as before the
        block, less gradients the last step consumed). Frozen parameters
        (``requires_grad=False``) are not perturbed.
        ``train=False`` only samples (evaluation, BMA).
        """
        if self._in_sample:
            raise RuntimeError("sampled_params() blocks cannot be nested")
        self._in_sample = True
        self._sample_blocks += 1
        perturbed: list[_Bucket] = []
        stash = self._set_aside_grads() if train else None
        ok = False
        try:
            with torch.no_grad():
                if self.sharding is not None:  # FSDP2: the owners' copies of the weights up to date
                    self.sharding.before_sample()
                for b in self.buckets:
                    if not math.isinf(b.group["ess"]) and not (train and not b.noisy_phase()):
                        perturbed.append(b)  # before the draw: an error inside still restores it
                        if not self._perturb(b, train):
                            perturbed.pop()
                if self.sharding is not None:
                    self.sharding.share_sample()
            yield
            ok = True
        finally:
            with torch.no_grad():
                if self.sharding is not None:
                    self.sharding.end_sample(recorded=ok and train)
                kept = set() if stash is None else {id(p) for p, keep in stash if keep is not None}
                for b in perturbed:
                    if b.mean is not None:
                        b.write_params(b.mean, b.live)
                    if ok and b.z is not None:
                        self._record_sample(b, alone=not any(id(p) in kept for p in b.params))
                    b.mean = b.z = b.live = None
                if stash is not None:
                    self._restore_grads(stash, ok)
            if ok and train:
                self._samples += 1
            self._in_sample = False

    def _set_aside_grads(self) -> list[tuple[Tensor, Tensor | None]]:
        """``(param, its gradient kept for this step)`` for every parameter; every ``.grad`` is
        then None, so the block's backward leaves exactly this sample's gradient there."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                grad = keep = p.grad
                if grad is not None:
                    ref, version = self._consumed.get(id(p), (None, None))
                    if ref is not None and ref() is grad and grad._version == version:
                        keep = None  # the last step used it already
                    elif grad._base is not None:
                        # a view into a shared buffer (DDP's gradient_as_bucket_view), which the
                        # block's backward overwrites: keep a copy
                        keep = grad.clone()
                    p.grad = None
                out.append((p, keep))
        return out

    @staticmethod
    def _restore_grads(stash: list[tuple[Tensor, Tensor | None]], recorded: bool) -> None:
        """``.grad`` = kept + this sample's gradient (``recorded``), or only the kept part (a
        failed block: as at entry, less what the last step consumed)."""
        if not recorded:
            for p, keep in stash:
                p.grad = keep
            return
        own, kept = [], []
        for p, keep in stash:
            if keep is None:
                continue
            if p.grad is None:
                p.grad = keep
            else:  # added into the block's own tensor, which may be a buffer view DDP relies on
                own.append(p.grad)
                kept.append(keep)
        if own:
            torch._foreach_add_(own, kept)

    def _record_sample(self, b: _Bucket, alone: bool) -> None:
        """Add this sample's ``G°_s ⊙ z_s`` to the Hessian numerator. ``alone``: no earlier
        gradient is added to it, so its rotation is the step's too if nothing changes it."""
        grads = b.grads()
        rotated = rotate(grads, *b.bases())
        b.acc.addcmul_(rotated, b.z)
        b.exit_grads, b.rotated_grads = (grads, rotated) if alone else (None, None)

    def _perturb(self, b: _Bucket, train: bool) -> bool:
        """Write a posterior draw into the bucket's unfrozen members; False if all are frozen."""
        live = [i for i, p in enumerate(b.params) if p.requires_grad]
        if not live:
            return False
        b.live = None if len(live) == len(b.params) else live
        g = b.group
        b.mean = b.stacked(b.params)  # exact copy, in the parameters' dtype
        z = self._standard_normal(b)
        q_left, q_right = b.bases() if b.initialized else (None, None)
        noise = sample_perturbation(z, b.state["hess"], q_left, q_right, g["ess"], g["weight_decay"])
        b.write_params(b.mean.to(b.dtype) + noise, b.live)
        if train and b.initialized:
            b.z = z
            if b.acc is None:
                b.acc = torch.zeros_like(z)
        return True

    def _standard_normal(self, b: _Bucket) -> Tensor:
        """The bucket's draw ``z``: this rank's stream, or (sharded) one stream per matrix."""
        if self.sharding is not None:
            return self.sharding.standard_normal(b)
        device = b.params[0].device
        return torch.randn(
            len(b.params), b.m, b.n, generator=self._generator(device), device=device, dtype=b.dtype
        )

    def current_noise(self, p: Tensor) -> Tensor:
        """The rotated-space draw ``E`` (shaped m×n) of the sample now in ``p`` (for tests)."""
        b, i = self._locate(p)
        if b.z is None:
            raise RuntimeError("no training sample is in progress for this parameter")
        g = b.group
        return b.z[i] * rotated_std(b.state["hess"][i], g["ess"], g["weight_decay"])

    # --------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: C901
        """One EVON update of every EVON group and one AdamW update of every AdamW group.

        ``closure`` (optional) is called once inside ``sampled_params(train=True)``.
        """
        if getattr(self, "found_inf", None) is not None:  # set by torch.amp.GradScaler.step
            self.found_inf = self.grad_scale = None
            self._discard_samples()  # the scaled samples must not leak into a later step
            raise NotImplementedError(
                "EVON cannot be stepped by a torch.amp.GradScaler (fp16 loss scaling): its Hessian "
                "estimate G°⊙E is recorded from the scaled gradients at each sample's exit. Train in "
                "bfloat16 autocast (no loss scaling needed) or float32. The state is unchanged; the samples are dropped"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad(), self.sampled_params(train=True):
                loss = closure()
        if self._in_sample:
            raise RuntimeError("step() called inside a sampled_params() block")
        self.synchronize()
        if self.sharding is not None:  # FSDP2: the owners gather the step's (clipped) gradients
            self.sharding.before_step()
        if self._samples == 0:
            needs_samples = any(b.noisy_phase() for b in self.buckets)
            if self.sharding is not None:  # a rank that owns no noisy matrix must raise too
                needs_samples = not self.sharding.all_ranks(not needs_samples)
        if self._samples == 0 and needs_samples:
            raise RuntimeError(
                "EVON needs the gradient at a posterior sample: run forward/backward inside "
                "`with optimizer.sampled_params(train=True):` before step()"
            )
        num_samples = max(self._samples, 1)
        plans = [plan for b in self.buckets if (plan := self._plan(b, num_samples)) is not None]
        adamw = self._adamw_inputs(num_samples)
        if not self._all_finite(plans, adamw):
            self._discard_samples()
            return loss

        for plan in plans:
            self._evon_update(plan, num_samples)
        for gi, (params, g_list, states) in adamw.items():
            self._adamw_update(self.param_groups[gi], params, g_list, states)
        if self.sharding is not None:
            self.sharding.after_step()
        self._discard_samples()
        self._updates += 1
        if self.health_check_every and self._updates % self.health_check_every == 0:
            self.posterior_health(warn=True)
        return loss

    def synchronize(self) -> None:
        """Average, across data-parallel ranks, what the next step uses.

        Each rank keeps its *own* gradients while sampling (its Hessian estimate needs them);
        this averages the gradients and the Hessian numerators once per step. ``step()``
        calls it; call it earlier to clip or log gradients that are already averaged.
        Without a ``gradient_reducer`` (single process) it does nothing.
        """
        if self._synchronized:
            return
        if self.gradient_reducer is None:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise RuntimeError(
                    "EVON is running in a multi-process job but was not prepared for it: call "
                    "`hf_evon.prepare_distributed(model, optimizer)` after accelerator.prepare(); "
                    "otherwise DDP averages gradients before EVON can form each rank's Hessian estimate"
                )
            return
        tensors = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        tensors += [b.acc for b in self.buckets if b.acc is not None]
        self.gradient_reducer(tensors)
        self._synchronized = True

    def _discard_samples(self) -> None:
        self._samples = 0
        self._synchronized = False
        for b in self.buckets:
            b.acc = b.exit_grads = b.rotated_grads = None
        self._consumed = {
            id(p): (weakref.ref(p.grad), p.grad._version)
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
        }

    def _adamw_inputs(self, num_samples: int) -> dict[int, tuple[list[Tensor], list[Tensor], list[dict]]]:
        out = {}
        for gi, group in enumerate(self.param_groups):
            if group["algorithm"] != "adamw":
                continue
            params = [p for p in group["params"] if p.grad is not None]
            if self.sharding is not None:
                params = [p for p in params if self.sharding.owns(p)]
            if not params:
                continue
            states = [self.state[p] for p in params]
            if self.sharding is not None:  # FSDP2: each rank's own rows (local shards)
                params, g_list = self.sharding.adamw_tensors(params)
            else:
                g_list = [p.grad for p in params]
            if num_samples > 1:
                g_list = torch._foreach_div(g_list, num_samples)
            out[gi] = (params, g_list, states)
        return out

    def _plan(self, b: _Bucket, num_samples: int) -> _Plan | None:
        """Everything the bucket's update needs that can fail, computed without changing any state.

        Members without a gradient (frozen, unused) are left out, as ``torch.optim`` does: their
        weights and state stay bit-identical. The candidate Hessian is formed here so that one
        device sync (``_all_finite``) can check it together with the gradients.
        """
        active = [i for i, p in enumerate(b.params) if p.grad is not None]
        if not active:
            return None
        # the initialising step only records statistics: done for the whole bucket
        members = None if len(active) == len(b.params) or not b.initialized else active
        work = b if members is None else b.subset(members)
        grad = work.grads()
        # clipped, reduced or accumulated since the last sample's exit?
        unchanged = None if work.rotated_grads is None else torch.eq(grad, work.exit_grads).all()
        plan = _Plan(b, work, members, grad.div_(num_samples), unchanged=unchanged)
        if work.initialized:
            self._hessian_candidate(plan, num_samples)
        return plan

    @staticmethod
    def _hessian_candidate(plan: _Plan, num_samples: int) -> None:
        """``plan.hess``: H after this step (None: not updated), and at ess = inf the rotated gradient."""
        b, g = plan.work, plan.work.group
        beta2 = g["betas"][1]
        delta, ess = g["weight_decay"], g["ess"]
        hess = b.state["hess"]
        if math.isinf(ess):
            plan.g_rot = rotate(plan.grad, *b.bases())
            h_hat = plan.g_rot.square()
        elif plan.clean or b.acc is None:
            return
        else:
            h_hat = b.acc.mul_(torch.sqrt(ess * (hess + delta))).div_(num_samples)
        gamma = g["hess_clip_ratio"]
        if gamma is not None:
            bound = gamma * (hess + g["eps"])
            h_hat = torch.minimum(torch.maximum(h_hat, -bound), bound)
        new = hess.mul(beta2).add_(h_hat, alpha=1 - beta2)
        if not math.isinf(ess):
            # IVON's correction ½(1−β2)²(H−Ĥ)²/(H+δ) keeps H + δ > 0 for the sampled estimator, which
            # can be negative (squared gradients cannot: neither the spec nor SOAP has it at ess = inf).
            # Scaled before squaring: a finite spike in Ĥ must not overflow (H−Ĥ)² on its way
            scaled = (hess - h_hat).mul_((1 - beta2) / math.sqrt(2.0)).div_(torch.sqrt(hess + delta))
            new.add_(scaled.square_())
        plan.hess = new

    def _all_finite(self, plans: list[_Plan], adamw: dict) -> bool:
        """Whether every gradient and every candidate Hessian is finite; also settles, in the same
        single device sync, which buckets may reuse their exit rotation."""
        checks = []
        for plan in plans:
            # ‖G‖²_F bounds every entry of G Gᵀ and Gᵀ G: finite means L and R stay finite
            ok = torch.isfinite(torch.linalg.vector_norm(plan.grad, dim=(1, 2)).square()).all()
            checks.append(ok if plan.hess is None else ok & torch.isfinite(plan.hess).all())
        for _, g_list, _ in adamw.values():
            # the norm also overflows where AdamW's squared gradient would
            checks += [torch.isfinite(torch.stack(torch._foreach_norm(g_list)).sum())]
        reusable = [plan for plan in plans if plan.unchanged is not None]
        flags = checks + [plan.unchanged for plan in reusable]
        values = torch.stack([f.to(flags[0].device) for f in flags]).tolist() if flags else []
        for plan, same in zip(reusable, values[len(checks) :]):
            plan.work.exit_grads = None  # compared; only the rotation may still be needed
            if not same:
                plan.work.rotated_grads = None
        finite = all(values[: len(checks)])
        if self.sharding is not None:  # sharded: skip on every rank or on none
            finite = self.sharding.all_ranks(finite)
        if finite:
            return True
        msg = f"{self._first_nonfinite(plans, adamw)}; the step was skipped and the optimizer state is unchanged"
        if self.nonfinite == "raise":
            self._discard_samples()
            raise NonFiniteGradientError(msg)
        self.skipped_steps += 1
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return False

    def _param_label(self, p: Tensor) -> str:
        if self.sharding is not None:  # FSDP2: a bucket member stands for its DTensor
            p = self.sharding.model_param(p)
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    name = names[i] if names else f"param_groups[{gi}]['params'][{i}]"
                    return f"{name} (shape {tuple(p.shape)})"
        return f"a parameter of shape {tuple(p.shape)}"

    def _first_nonfinite(self, plans: list[_Plan], adamw: dict) -> str:
        """What made the step non-finite, naming the parameter (slow; only after a failed check)."""
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is not None and _is_dtensor(g):  # FSDP2: this rank's rows (no collective)
                    g = g._local_tensor
                if g is not None and not bool(torch.isfinite(g).all()):
                    return f"non-finite gradient in {self._param_label(p)}"
        for plan in plans:
            if plan.hess is not None:
                bad = (~torch.isfinite(plan.hess)).flatten(1).any(1).nonzero().flatten().tolist()
                if bad:
                    p = plan.work.params[bad[0]]
                    return (
                        f"overflow in the Hessian estimate of {self._param_label(p)}: its gradient is finite "
                        "but so large (a spike) that H would not be"
                    )
        for plan in plans:
            sq = torch.linalg.vector_norm(plan.grad, dim=(1, 2)).square()
            bad = (~torch.isfinite(sq)).nonzero().flatten().tolist()
            if bad:
                return (
                    f"overflow in the Shampoo statistics (G Gᵀ) of {self._param_label(plan.work.params[bad[0]])}: "
                    "its gradient is finite but so large (a spike) that its square is not"
                )
        for params, g_list, _ in adamw.values():
            for p, norm in zip(params, torch._foreach_norm(g_list)):
                if not bool(torch.isfinite(norm)):
                    return (
                        f"overflow in AdamW's squared gradient of {self._param_label(p)}: its gradient is "
                        "finite but so large (a spike) that its square is not"
                    )
        return "a non-finite value"

    def _evon_update(self, plan: _Plan, num_samples: int) -> None:
        b, grad = plan.work, plan.grad
        g, st = b.group, b.state
        beta1, beta2 = g["betas"]
        beta3 = beta2 if g["shampoo_beta"] is None else g["shampoo_beta"]
        delta, ess = g["weight_decay"], g["ess"]

        if not b.initialized:
            self._update_statistics(b, grad, beta3)
            if b.left:
                st["Q_L"] = eigenbasis(st["L"])
            if b.right:
                st["Q_R"] = eigenbasis(st["R"])
            self._point_state_views(b, ("L", "R", "Q_L", "Q_R"))
            return

        t = b.t + 1
        q_left, q_right = b.bases()
        g_rot = plan.g_rot if plan.g_rot is not None else b.rotated_mean_grad(grad, num_samples)
        hess = st["hess"]
        if plan.hess is not None:
            hess.copy_(plan.hess)

        exp_avg = st["exp_avg"]
        exp_avg.mul_(beta1).add_(g_rot, alpha=1 - beta1)
        numer = exp_avg / (1 - beta1**t)
        scaled = g.get("snr_scaling", False) is not False and g["clip"] != "none"
        scale = self._snr_scale(b, numer, g_rot, t) if scaled else None
        track = self._tracks_rotated_mean(plan)
        mean_rot = self._rotated_mean(b, track) if delta != 0.0 else None
        if mean_rot is not None:
            numer.add_(mean_rot, alpha=delta)
        step_rot = numer.div_(hess + delta)  # U, in the eigenbasis
        update = clip_update(unrotate(step_rot, q_left, q_right), g["clip"], g["clip_radius"])
        if scale is not None:
            update.mul_(scale.view(-1, 1, 1))
        if update.dtype != b.params[0].dtype:
            update = update.to(b.params[0].dtype)
        # added in each parameter's own shape: works for any memory layout (channels_last)
        torch._foreach_add_(*b.unstacked(update, range(len(b.params))), alpha=-g["lr"])
        if track and mean_rot is not None:
            # unclipped: M - αΔ rotates to Q_Lᵀ M Q_R - αU exactly (Q orthonormal), no matmul
            b.rotated_mean = mean_rot.sub_(step_rot, alpha=g["lr"])
            b.stamp_mean()
        else:
            plan.bucket.rotated_mean = b.rotated_mean = None

        if b.preconditioned and not (g["phased_gradients"] and not plan.clean and not math.isinf(ess)):
            self._update_statistics(b, grad, beta3)
        st["step"].add_(1)
        if b.preconditioned:
            f = g["precondition_frequency"]
            due = [i for i, phase in enumerate(b.refresh_phase) if (t + phase) % f == 0]
            if due:
                self._refresh_bases(b, None if len(due) == len(b.params) else due)
        if plan.members is not None:
            plan.bucket.scatter(b, plan.members)

    @staticmethod
    def _snr_scale(b: _Bucket, momentum: Tensor, g_rot: Tensor, t: int) -> Tensor:
        """min(1, ρ/ρ₀) per matrix (``snr_scaling=True``; "adam": min(1, ρ)); updates the EMA of
        ‖G‖²_F (norms are the same in the eigenbasis: Q is orthonormal)."""
        avg = b.state["exp_avg_sq_norm"]
        avg.mul_(SNR_AVERAGE_BETA).add_(
            torch.linalg.vector_norm(g_rot, dim=(1, 2)).square_(), alpha=1 - SNR_AVERAGE_BETA
        )
        rms = avg.div(1 - SNR_AVERAGE_BETA**t).sqrt_().clamp_min_(torch.finfo(avg.dtype).tiny)
        rho = torch.linalg.vector_norm(momentum, dim=(1, 2)).div_(rms)
        if b.group["snr_scaling"] != "adam":
            rho.div_(snr_floor(b.group["betas"][0]))
        return rho.clamp_(max=1.0)

    @staticmethod
    def _tracks_rotated_mean(plan: _Plan) -> bool:
        """Whether this step can carry ``Q_Lᵀ M Q_R`` over to the next one without a rotation.

        Exact when the update is not clipped (``clip="none"``: ``M - αΔ`` rotates to
        ``Q_Lᵀ M Q_R - αU``) and the weights hold exactly what the optimizer computes (their
        dtype is the state's: a bfloat16 model rounds M each step). Costs one ``m×n`` float
        tensor per matrix; saves the prior term's two matmuls per step. The whole bucket must
        step (members without a gradient would need their own bookkeeping).
        """
        b = plan.work
        return (
            plan.members is None
            and b.preconditioned
            and b.group["clip"] == "none"
            and b.group["weight_decay"] != 0.0
            and b.params[0].dtype == b.dtype
        )

    @staticmethod
    def _rotated_mean(b: _Bucket, track: bool) -> Tensor:
        """``Q_Lᵀ M Q_R``: the tracked one when it is still the weights' rotation, else rotated now."""
        if track and b.rotated_mean_valid():
            return b.rotated_mean
        return rotate(b.matrices(b.params), *b.bases())

    @staticmethod
    def _update_statistics(b: _Bucket, grad: Tensor, beta3: float) -> None:
        st = b.state
        if b.left:
            gg = gram(grad)
            st["L"] = st["L"].mul_(beta3).add_(gg, alpha=1 - beta3) if "L" in st else gg.mul_(1 - beta3)
        if b.right:
            gg = gram(grad.mT)
            st["R"] = st["R"].mul_(beta3).add_(gg, alpha=1 - beta3) if "R" in st else gg.mul_(1 - beta3)

    def _refresh_bases(self, b: _Bucket, members: list[int] | None) -> None:
        """One power iteration + QR for the given bucket members (None: all of them)."""
        st = b.state
        idx = slice(None) if members is None else torch.tensor(members, device=st["hess"].device)
        old_left = st["Q_L"][idx] if b.left else None
        old_right = st["Q_R"][idx] if b.right else None
        new_left = power_qr(st["L"][idx], old_left) if b.left else None
        new_right = power_qr(st["R"][idx], old_right) if b.right else None
        # Ḡ <- Q_L,newᵀ Q_L,old Ḡ Q_R,oldᵀ Q_R,new ; H is deliberately not rotated
        moved = rotate(unrotate(st["exp_avg"][idx], old_left, old_right), new_left, new_right)
        for key, value in (("exp_avg", moved), ("Q_L", new_left), ("Q_R", new_right)):
            if value is not None:
                st[key][idx] = value
        if b.rotated_mean is not None:  # the refreshed members' weights, in their new bases
            listed = range(len(b.params)) if members is None else members
            b.rotated_mean[idx] = rotate(b.matrices([b.params[i] for i in listed]), new_left, new_right)

    def _point_state_views(self, b: _Bucket, keys: tuple[str, ...]) -> None:
        for i, p in enumerate(b.params):
            for k in keys:
                if k in b.state:
                    self._member_state(p)[k] = b.state[k][i]

    @staticmethod
    def _adamw_update(group: dict, params: list[Tensor], grads: list[Tensor], states: list[dict]) -> None:
        for p, st in zip(params, states):
            if "step" not in st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        _functional_adam(
            params,
            grads,
            [st["exp_avg"] for st in states],
            [st["exp_avg_sq"] for st in states],
            [],
            [st["step"] for st in states],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["adamw_eps"],
            maximize=False,
            decoupled_weight_decay=True,
        )

    # ---------------------------------------------------------- inspection
    def _locate(self, p: Tensor) -> tuple[_Bucket, int]:
        if self.sharding is not None:  # FSDP2: a DTensor's bucket member is its owner's full copy
            p = self.sharding.bucket_param(p)
        if self._buckets is None or self._bucket_index is None:
            self._bucket_index = {id(q): (b, i) for b in self.buckets for i, q in enumerate(b.params)}
        if id(p) not in self._bucket_index:
            raise KeyError("parameter is not trained by EVON in this optimizer")
        return self._bucket_index[id(p)]

    @torch.no_grad()
    def posterior_health(self, warn: bool = True) -> dict[str, float]:
        """Noise-to-signal and Hessian statistics of the current posterior (one host sync).

        ``noise_to_signal``: RMS posterior std / RMS weight, pooled over EVON matrices (the RMS
        std of a matrix is sqrt(mean V): the rotation preserves the trace), and its maximum
        over matrices (a matrix that was zero when the optimizer first saw it, as LoRA's B
        starts, counts from the first check at which its noise is below its RMS: until training
        has grown it, its ratio says nothing about ``ess``); ``hess_*``: H over every entry;
        ``hess_below_prior``: the fraction of entries with H < δ, whose variance is dominated by
        the prior 1/(ζδ) rather than by data; ``hess_init_share``: Σ h0·β2ᵗ / Σ H, the part of H that is still its initial value
        after t updates — near 1, the posterior's shape is h0's rather than learned from the
        data, and sampling it is close to isotropic noise (about 0.97 at the end of
        ``benchmarks/payoff.py``'s digits and tiny GPT-2 runs); ``prior_to_signal``: the prior's
        std 1/sqrt(ζδ) / RMS weight, pooled: where the noise goes once H has decayed. With
        ``warn``, the first time either failure shows, a ``RuntimeWarning`` names the cause and
        the fix: runaway noise (max noise-to-signal ≥ 1: samples no longer resemble the mean) or
        collapse to a broad prior (most of H below δ, and ``prior_to_signal`` ≥
        ``COLLAPSE_PRIOR_TO_SIGNAL``).
        """
        # per bucket, on its device:
        # [sum V, sum W², min H, max H, sum H, #H<δ, max per-matrix ratio, sum h0·β2^t, sum 1/(ζδ)]
        rows, numel = [], 0
        for b in self.buckets:
            g = b.group
            if math.isinf(g["ess"]):
                continue
            hess = b.state["hess"]
            var = torch.reciprocal(g["ess"] * (hess + g["weight_decay"]))
            w_sq = torch.stack(torch._foreach_norm([p.detach() for p in b.params])).to(b.dtype).square()
            var_sum = var.sum(dim=(1, 2))
            ratio = (var_sum / w_sq.clamp_min(torch.finfo(b.dtype).tiny)).sqrt()
            b.watched |= ratio < 1  # set where the bucket is built
            row = [
                var_sum.sum(),
                w_sq.sum(),
                hess.min(),
                hess.max(),
                hess.sum(),
                (hess < g["weight_decay"]).sum(),
            ]
            init_part = g["hess_init"] * torch.pow(g["betas"][1], b.state["step"].double()) * hess.numel()
            prior_var = torch.tensor(  # built where the row is stacked: no copy
                hess.numel() / (g["ess"] * g["weight_decay"]) if g["weight_decay"] else math.inf,
                dtype=torch.float64,
                device=hess.device,
            )
            row += [torch.where(b.watched, ratio, 0.0).max(), init_part, prior_var]
            rows.append(torch.stack([x.double().to(hess.device) for x in row]))
            numel += hess.numel()
        t = torch.stack([r.to(rows[0].device) for r in rows]).cpu() if rows else torch.zeros(0, 9)  # one sync
        if self.sharding is not None:  # every rank's matrices, not only this rank's share
            t, numel = self.sharding.pool_rows(t, numel)
        if not len(t):
            return {}
        stats = {
            "noise_to_signal": float((t[:, 0].sum() / t[:, 1].sum().clamp_min(1e-300)).sqrt()),
            "noise_to_signal_max": float(t[:, 6].max()),
            "hess_min": float(t[:, 2].min()),
            "hess_max": float(t[:, 3].max()),
            "hess_mean": float(t[:, 4].sum() / numel),
            "hess_below_prior": float(t[:, 5].sum() / numel),
            "hess_init_share": float(t[:, 7].sum() / t[:, 4].sum().clamp_min(1e-300)),
            "prior_to_signal": float((t[:, 8].sum() / t[:, 1].sum().clamp_min(1e-300)).sqrt()),
        }
        if warn:
            self._warn_health(stats)
        return stats

    def _warn_health(self, stats: dict[str, float]) -> None:
        warned = self._health_warned
        if stats["noise_to_signal_max"] >= 1.0 and "runaway" not in warned:
            warned.add("runaway")
            warnings.warn(
                f"EVON: runaway posterior noise: its std is {stats['noise_to_signal_max']:.3g}x the RMS of "
                "a weight matrix, so samples no longer resemble the mean and training suffers. Cause: ess too "
                "small for the weights' scale, or a Hessian estimate that fell to its floor (the std is then "
                "1/sqrt(ess*weight_decay)). Fix: ess='auto' (the default: initial std 5% of the weights' RMS) "
                "or a larger ess; a larger weight_decay bounds the floor.",
                RuntimeWarning,
                stacklevel=3,
            )
        broad = stats["prior_to_signal"] >= COLLAPSE_PRIOR_TO_SIGNAL
        if stats["hess_below_prior"] > 0.5 and broad and "collapse" not in warned:
            warned.add("collapse")
            warnings.warn(
                f"EVON: the posterior collapsed to the prior: H < weight_decay in {stats['hess_below_prior']:.0%} "
                "of the entries, so their std is ~1/sqrt(ess*weight_decay), the prior's, which is "
                f"{stats['prior_to_signal']:.3g}x the weights' RMS. Cause: a noise-dominated Hessian estimate "
                "(the adaptive clip keeps ±hess_clip_ratio·H of it) decays as hess_init·betas[1]^t, and a "
                "prior this broad lets the noise grow with it. Fix: weight_decay=None (the default: the "
                "prior's std is 5x the initial std, 25% of the weights' RMS with ess='auto'), or a larger "
                "weight_decay or ess; a larger betas[1] (0.999) slows the decay.",
                RuntimeWarning,
                stacklevel=3,
            )

    def posterior_factors(self, p: Tensor) -> dict[str, Any]:
        """``Q_L``, ``Q_R`` (None where identity), ``hess`` and the group's ess/weight decay."""
        if self.sharding is not None and not self.sharding.owns(p):
            return self.sharding.remote_factors(p)
        b, i = self._locate(p)
        q_left, q_right = b.bases() if b.initialized else (None, None)
        return {
            "Q_L": None if q_left is None else q_left[i],
            "Q_R": None if q_right is None else q_right[i],
            "hess": b.state["hess"][i],
            "ess": b.group["ess"],
            "weight_decay": b.group["weight_decay"],
            "matrix_shape": (b.m, b.n),
        }

    def posterior_covariance(self, p: Tensor) -> Tensor:
        """Dense covariance of ``p.flatten()`` (row-major), for small parameters."""
        from hf_evon.optim.linalg import dense_covariance

        f = self.posterior_factors(p)
        return dense_covariance(f["hess"], f["Q_L"], f["Q_R"], f["ess"], f["weight_decay"])

    def posterior_std(self, p: Tensor) -> Tensor:
        """Marginal posterior standard deviations, shaped like ``p``."""
        from hf_evon.optim.linalg import marginal_variance

        f = self.posterior_factors(p)
        return (
            marginal_variance(f["hess"], f["Q_L"], f["Q_R"], f["ess"], f["weight_decay"])
            .sqrt()
            .reshape(p.shape)
        )

    # ---------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["evon"] = {
            "seed": self.seed,
            "sample_blocks": self._sample_blocks,
            "skipped_steps": self.skipped_steps,
        }
        if self.sharding is not None:  # a collective: every rank gets the full, unsharded state
            sd = self.sharding.full_state_dict(sd)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("evon", None)
        if self.sharding is not None:  # a full state dict: keep this rank's part only
            state_dict = self.sharding.local_state_dict(state_dict)
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter dtype; EVON state stays float32/64
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        evon_params = {id(p) for g in self.param_groups if g["algorithm"] == "evon" for p in g["params"]}
        for idx, p in zip(saved_ids, params):
            if id(p) in evon_params and idx in state_dict["state"]:
                for k, v in state_dict["state"][idx].items():
                    if k != "step" and torch.is_tensor(v):
                        self.state[p][k] = v.to(device=p.device, dtype=state_dtype(p))
        self._buckets = None
        if extra is not None:
            self.seed = int(extra["seed"])
            self.skipped_steps = int(extra.get("skipped_steps", 0))
            self._sample_blocks = int(extra.get("sample_blocks", 0))


def unwrap_optimizer(optimizer: Any) -> EVON:
    """The ``EVON`` inside ``optimizer`` (e.g. accelerate's ``AcceleratedOptimizer``)."""
    seen = optimizer
    for _ in range(8):
        if isinstance(seen, EVON):
            return seen
        seen = getattr(seen, "optimizer", None)
        if seen is None:
            break
    raise TypeError(
        f"expected an hf_evon EVON optimizer; got {type(optimizer).__name__} (EVON is looked for inside "
        "wrappers such as accelerate's AcceleratedOptimizer, through their .optimizer)"
    )
