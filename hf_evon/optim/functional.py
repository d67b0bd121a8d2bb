"""EVON's update maths as functions on stacked ``(B, m, n)`` tensors (one row per matrix).

``EVON.step`` calls these in order, per bucket:

1. ``price_estimate`` and ``hessian_update``: the candidate H after this step (the Price
   estimate of the sampled gradients, adaptively clipped, EMA with IVON's correction);
2. ``momentum_update``, ``snr_scale``, ``newton_step``, ``clipped_update``: the step itself
   (its per-matrix ``snr_scale`` is applied by the weights' multi-tensor add);
3. ``shampoo_statistics`` and ``refresh_bases``: the eigenbasis (L, R and a power step + QR);
4. ``adamw``: the groups trained by AdamW (``torch.optim``'s functional Adam).

They take tensors and numbers only, so each can be called and tested alone. Where a function
updates state, it does so in place (named in its docstring), as ``torch.optim``'s functional
kernels do; op order and in-place ops are part of the contract (resumes are bit-for-bit).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch.optim.adam import adam as _functional_adam

from hf_evon.optim.defaults import SNR_AVERAGE_BETA, snr_floor
from hf_evon.optim.linalg import (
    clip_update,
    gram,
    gram_is_blocked,
    power_qr_many,
    rotate,
    unrotate,
    unrotate_scaled,
)

__all__ = [
    "adamw",
    "adamw_step_device",
    "all_fused_adamw",
    "clipped_update",
    "fisher_update",
    "fused_adamw",
    "hessian_update",
    "matrix_curvature",
    "momentum_update",
    "newton_step",
    "price_estimate",
    "refresh_bases",
    "shampoo_statistics",
    "snr_scale",
]

Tensor = torch.Tensor


def price_estimate(acc: Tensor, hess: Tensor, ess: float, delta: float, num_samples: int) -> Tensor:
    """Ĥ = (Σ_s G°_s ⊙ z_s) · sqrt(ζ(H+δ)) / S: the Price (Stein) estimate of the rotated Hessian
    from S samples whose noise was ``z_s / sqrt(ζ(H+δ))``. In place on ``acc`` (returned)."""
    return acc.mul_(torch.sqrt(ess * (hess + delta))).div_(num_samples)


def hessian_update(
    hess: Tensor,
    h_hat: Tensor,
    beta2: float,
    delta: float,
    ess: float,
    clip_ratio: float | None,
    eps: float,
) -> Tensor:
    """H after one step (a new tensor): β2·H + (1−β2)·clip(Ĥ) (+ IVON's correction).

    ``clip_ratio`` γ bounds Ĥ to ±γ(H+ε) (None: no clip). For sampled weights (finite ``ess``)
    IVON's correction ½(1−β2)²(H−Ĥ)²/(H+δ) keeps H + δ > 0 for the sampled estimator, which can
    be negative (squared gradients, at ess = inf, cannot: neither the paper's algorithm nor SOAP has it there).
    H is then floored at 0: it is a curvature, the running average of a positive quantity (the
    paper's reading), and a negative H would make the prior, not the data, loosen the posterior.
    """
    if clip_ratio is not None:
        bound = clip_ratio * (hess + eps)
        h_hat = torch.minimum(torch.maximum(h_hat, -bound), bound)
    new = hess.mul(beta2).add_(h_hat, alpha=1 - beta2)
    if not math.isinf(ess):
        # scaled before squaring: a finite spike in Ĥ must not overflow (H−Ĥ)² on its way
        scaled = (hess - h_hat).mul_((1 - beta2) / math.sqrt(2.0)).div_(torch.sqrt(hess + delta))
        new.add_(scaled.square_()).clamp_min_(0.0)
    return new


def fisher_update(hess: Tensor, g_rot: Tensor, beta2: float, t: int) -> Tensor:
    """H after one step under the Fisher estimate, in place: β·H + (1−β)·G_rot², with
    β = min(β2, 1 − 1/t) (t: this update's number, from 1), so the first update replaces h0 and
    H is the plain average of the squares until the EMA's window is filled. Never negative."""
    beta = min(beta2, 1.0 - 1.0 / t)
    return hess.mul_(beta).addcmul_(g_rot, g_rot, value=1.0 - beta)


def momentum_update(exp_avg: Tensor, grad: Tensor, beta1: float) -> Tensor:
    """The momentum m ← β1·m + (1−β1)·G, in place on ``exp_avg`` (returned), in the space ``grad``
    is given in (the eigenbasis: G_rot; the weights' space: G). The step uses m̂ = m / (1 − β1ᵗ);
    each consumer folds that scalar into an operation it does anyway."""
    return exp_avg.lerp_(grad, 1 - beta1)


def snr_scale(
    exp_avg_sq_norm: Tensor, momentum: Tensor, grad: Tensor, t: int, beta1: float, adam: bool
) -> Tensor:
    """The step's scale per matrix, ``(B,)``: min(1, ρ/ρ₀) (``adam``: min(1, ρ)), ρ = ‖m̂‖_F /
    sqrt(EMA‖G‖²_F) for the ``momentum`` m (m̂ = m / (1 − β1ᵗ)). Updates the EMA (in place on
    ``exp_avg_sq_norm``, decay ``SNR_AVERAGE_BETA``); the norms are the same in the eigenbasis
    and in the weights' space (Q is orthonormal), so ``momentum`` and ``grad`` may be in either."""
    avg, g_norm = exp_avg_sq_norm, torch.linalg.vector_norm(grad, dim=(1, 2))
    avg.mul_(SNR_AVERAGE_BETA).addcmul_(g_norm, g_norm, value=1 - SNR_AVERAGE_BETA)
    # ‖m̂‖ / sqrt(EMA / (1 − βᵗ)) = ‖m‖ / sqrt(EMA · (1 − β1ᵗ)² / (1 − βᵗ)): both bias corrections in one scalar
    corrections = (1 - beta1**t) ** 2 / (1 - SNR_AVERAGE_BETA**t)
    rms = avg.mul(corrections).sqrt_().clamp_min_(torch.finfo(avg.dtype).tiny)
    rho = torch.linalg.vector_norm(momentum, dim=(1, 2)).div_(rms)
    if not adam:
        rho.div_(snr_floor(beta1))
    return rho.clamp_(max=1.0)


def newton_step(
    momentum: Tensor,
    hess: Tensor,
    delta: float,
    mean_rot: Tensor | None,
    pull: float | None = None,
) -> Tensor:
    """U = (m̂ + λ·Q_Lᵀ M Q_R) / (H + δ), the step in the eigenbasis (in place on ``momentum``).

    λ (``pull``, default δ) is the L2 pull on the mean; ``mean_rot=None`` leaves it out, as for
    λ = 0. (``step_curvature="matrix"`` divides by :func:`matrix_curvature` instead.)"""
    if mean_rot is not None:
        momentum.add_(mean_rot, alpha=delta if pull is None else pull)
    return momentum.div_(hess + delta)


def matrix_curvature(hess: Tensor, delta: float) -> Tensor:
    """Each matrix's mean of H + δ, ``(B, 1, 1)``: the step's curvature under ``step_curvature=
    "matrix"`` (mean(H) + δ: the same number, without an m×n temporary)."""
    return hess.mean(dim=(-2, -1), keepdim=True).add_(delta)


def clipped_update(
    step_rot: Tensor,
    q_left: Tensor | None,
    q_right: Tensor | None,
    clip: str,
    radius: float,
    step_alpha: float = 1.0,
    pull: Tensor | None = None,
    pull_alpha: float = 1.0,
    curvature: Tensor | None = None,
) -> Tensor:
    """Δ = clip((a·Q_L U Q_Rᵀ + b·P) / c): the update in the weights' space, a new tensor (``U`` is
    not changed). ``step_alpha`` a, ``pull`` P (a part of the step given in the weights' space;
    None: none) times ``pull_alpha`` b, ``curvature`` c: a divisor of both, ``(B, 1, 1)`` (None: 1)."""
    update = unrotate_scaled(step_rot, q_left, q_right, step_alpha, pull, pull_alpha)
    if curvature is not None:
        update.div_(curvature)
    return clip_update(update, clip, radius)


def shampoo_statistics(stat: Tensor | None, grad: Tensor, beta3: float, right: bool = False) -> Tensor:
    """The EMA of ``grad @ grad.mT`` (L; ``right``: of ``grad.mT @ grad``, R): in place on ``stat``
    when it exists, else the first term (1 − β3)·G Gᵀ."""
    if stat is not None and not gram_is_blocked(grad):
        # a plain product: one multiply-add in place, β3·L + (1 − β3)·G Gᵀ
        a, b = (grad.mT, grad) if right else (grad, grad.mT)
        return stat.baddbmm_(a, b, beta=beta3, alpha=1 - beta3)
    gg = gram(grad.mT if right else grad)
    return gg.mul_(1 - beta3) if stat is None else stat.mul_(beta3).add_(gg, alpha=1 - beta3)


def refresh_bases(
    stacks: list[tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None]],
) -> list[tuple[Tensor | None, Tensor | None, Tensor | None]]:
    """One power iteration + QR per side with a basis, for each bucket's
    ``(L, R, Q_L, Q_R, momentum)`` stacks (a statistic None: no basis on that side); the QRs of
    all of them by :func:`power_qr_many` (on accelerators, sides of one size in one call).

    Returns each bucket's ``(momentum moved to the new bases, new Q_L, new Q_R)``: m ← Q_L,newᵀ
    Q_L,old m Q_R,oldᵀ Q_R,new (None for a momentum None: one kept in the weights' space stays).
    H is deliberately not rotated."""
    sides = [side for left, right, q_left, q_right, _ in stacks for side in ((left, q_left), (right, q_right))]
    new = iter(power_qr_many([(stat, q) for stat, q in sides if stat is not None]))
    out = []
    for left, right, q_left, q_right, exp_avg in stacks:
        new_left = next(new) if left is not None else None
        new_right = next(new) if right is not None else None
        moved = None if exp_avg is None else rotate(unrotate(exp_avg, q_left, q_right), new_left, new_right)
        out.append((moved, new_left, new_right))
    return out


def adamw(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
) -> None:
    """One AdamW step (decoupled weight decay) of ``params``, in place: torch's functional Adam.

    Fused (one kernel per device and dtype, the step counts read on the device) where every
    tensor is a real float on a CPU or CUDA device, as ``transformers.Trainer``'s default
    ``adamw_torch_fused`` is; else multi-tensor, whose bias corrections read each step count
    back to the host. ``lr`` may be a 0-dim tensor (torch AdamW's), on a device read there."""
    fused = all_fused_adamw(params)
    if torch.is_tensor(lr) and (not fused or lr.device.type == "cpu"):
        # torch's multi-tensor kernel refuses a tensor rate (but capturable); a CPU one is read as a number
        lr = lr.item()
    # complex entries as (real, imaginary) pairs, as torch.optim.AdamW steps them
    has_complex = not fused and any(map(torch.is_complex, params))
    _functional_adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
        decoupled_weight_decay=True,
        fused=fused,
        foreach=not fused,
        has_complex=has_complex,
    )


def fused_adamw(p: Tensor) -> bool:
    """Whether :func:`adamw` steps ``p`` with torch's fused kernel."""
    return p.device.type in ("cpu", "cuda") and p.is_floating_point()


def all_fused_adamw(params: list[Tensor]) -> bool:
    """Whether :func:`adamw` steps all of ``params`` with torch's fused kernel (``fused_adamw`` of
    each, read in ``map``s: it runs at every step)."""
    return {"cpu", "cuda"}.issuperset(map(_DEVICE_TYPE, params)) and all(map(Tensor.is_floating_point, params))


_DEVICE_TYPE = operator.attrgetter("device.type")


def adamw_step_device(p: Tensor) -> torch.device:
    """Where ``p``'s AdamW step count lives: on ``p``'s device for the fused kernel, else on the
    CPU, where the multi-tensor kernel reads it cheaply."""
    return p.device if fused_adamw(p) else torch.device("cpu")


def half_adamw_second_moments(grads: list[Tensor], states: list[dict[str, Any]], beta2: float) -> Tensor:
    """The largest entry of each parameter's next AdamW second moment β2·v + (1−β2)·g², in float32 (a
    float16 parameter keeps its moments in float16, where they can overflow while ``g`` is finite):
    multi-tensor norms, a few ops for all of them (on the first gradient's device)."""
    dev = grads[0].device
    top = torch.stack([n.to(dev) for n in torch._foreach_norm(grads, math.inf)]).float().square() * (1.0 - beta2)
    moments = [st.get("exp_avg_sq") for st in states]
    if any(v is None for v in moments):  # a first step (or a late member): that moment is 0
        return top + beta2 * torch.stack([top.new_zeros(()) if v is None else v.float().amax().to(dev) for v in moments])
    return top + beta2 * torch.stack([n.to(dev) for n in torch._foreach_norm(moments, math.inf)]).float()
