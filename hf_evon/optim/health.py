"""Diagnostics of an EVON posterior: the health statistics, their warnings, and what made a step
non-finite. ``EVON.posterior_health`` and ``EVON.step`` call these."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from hf_evon.optim.buckets import Bucket, Plan, is_dtensor
from hf_evon.optim.checks import outside_stacklevel, uses_fisher
from hf_evon.optim.defaults import COLLAPSE_PRIOR_TO_SIGNAL
from hf_evon.optim.functional import half_adamw_second_moments
from hf_evon.optim.linalg import norms_of

__all__ = [
    "covered_members",
    "first_nonfinite",
    "health_rows",
    "health_stats",
    "is_point_estimate",
    "runaway_matrix",
    "skipped_reason",
    "warn_health",
]

Tensor = torch.Tensor

# columns of a health row, one row per bucket
_COLUMNS = 9


def is_point_estimate(trainable: bool, updates: int) -> bool:
    """Whether an EVON member is a point estimate of the posterior: frozen and never updated (its
    counter 0, or ``UNINITIALIZED`` where it had no gradient at its bucket's first step), its H still
    h0, not a curvature, and EVON's samples leave it alone."""
    return not trainable and updates <= 0


def covered_members(b: Bucket) -> list[int]:
    """The members of ``b`` that are no point estimate (:func:`is_point_estimate`)."""
    counts = b.counts
    return [i for i, p in enumerate(b.params) if not is_point_estimate(p.requires_grad, counts[i])]


@torch.no_grad()  # the weights' norms without a graph, and without a detach per matrix
def _noise_to_signal(b: Bucket, members: list[int], hess: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per listed member of ``b`` (``hess``: their H): Σ V, Σ W² and the noise-to-signal ratio
    sqrt(Σ V / Σ W²), in float64: a float32 sum of variances that are each finite overflows at the
    prior's widest (ζδ near float32's smallest). The one computation of the ratio: the runaway warning
    finds the matrix of the pooled maximum by equality with it."""
    var = torch.reciprocal(b.group["ess"] * (hess + b.group["weight_decay"]))
    # inside sampled_params the parameters hold a sample: the posterior's weights are its mean
    weights = b.params if b.mean is None else list(b.mean.unbind(0))
    w_sq = torch.stack(norms_of([weights[i] for i in members])).double().square()  # float32 at least
    var_sum = var.sum(dim=(1, 2), dtype=torch.float64)
    return var_sum, w_sq, (var_sum / w_sq.clamp_min(torch.finfo(torch.float64).tiny)).sqrt()


def _watched_ratios(watched: Tensor, w_sq: Tensor, ratio: Tensor) -> Tensor:
    """The ratios the runaway watch compares, 0 elsewhere: a matrix is watched from the first check at which
    its noise is below its RMS (LoRA's B starts at 0), and not while its weights are exactly 0 (AdaLoRA
    prunes every rank of a ``lora_E`` to 0: off, not uncertain), which give no scale to compare with."""
    return torch.where((watched > 0) & (w_sq > 0), ratio, 0.0)


def health_rows(buckets: list[Bucket]) -> tuple[Tensor, int]:
    """Per bucket, float64 on the CPU (one host sync), and the number of H entries:
    [Σ V, Σ W², min H, max H, Σ H, #H<δ, max per-matrix noise-to-signal, Σ h0·β2ᵗ, Σ 1/(ζδ)].

    A frozen member (``requires_grad=False``) never updated is left out: its H is h0 and it is never
    sampled. Also adds to each bucket's runaway watch the members whose noise is now below their RMS."""
    rows, numel = [], 0
    for b in buckets:
        g = b.group
        if math.isinf(g["ess"]):
            continue
        members = covered_members(b)  # a point estimate holds h0, not a curvature, and is never sampled
        if not members:
            continue
        idx = None if len(members) == len(b.params) else b.member_index(members)  # None: every member
        hess = b.state["hess"] if idx is None else b.state["hess"][idx]
        var_sum, w_sq, ratio = _noise_to_signal(b, members, hess)
        watched = b.state["noise_watched"] if idx is None else b.state["noise_watched"][idx]
        watched.masked_fill_(ratio < 1, 1.0)  # from then on: for good
        if idx is not None:
            b.state["noise_watched"].index_copy_(0, idx, watched)
        row = [
            var_sum.sum(),
            w_sq.sum(),
            hess.min(),
            hess.max(),
            hess.sum(dtype=torch.float64),  # a float32 sum of many entries drifts (its mean below its min)
            (hess < g["weight_decay"]).sum(),
        ]
        steps = b.state["step"][members].double().clamp_min(0)  # a member not yet initialised: still h0
        if g["phased_gradients"]:  # only the noisy updates (counts 0, 2, 4, ...) change H
            steps = torch.div(steps + 1, 2, rounding_mode="floor")
        # the Fisher estimate's first update replaces h0; the Price one decays it by β2 per update of H
        kept = steps.eq(0).double() if uses_fisher(g) else torch.pow(g["betas"][1], steps)
        init_part = g["hess_init"] * (kept * hess[0].numel()).sum()  # per member: its own count
        prior_var = torch.tensor(  # built where the row is stacked: no copy
            hess.numel() / (g["ess"] * g["weight_decay"]) if g["ess"] * g["weight_decay"] > 0 else math.inf,
            dtype=torch.float64,
            device=hess.device,
        )
        row += [_watched_ratios(watched, w_sq, ratio).max(), init_part, prior_var]
        rows.append(torch.stack([x.double().to(hess.device) for x in row]))
        numel += hess.numel()
    t = (
        torch.stack([r.to(rows[0].device) for r in rows]).cpu() if rows else torch.zeros(0, _COLUMNS)
    )  # one sync
    return t, numel


def health_stats(t: Tensor, numel: int) -> dict[str, float]:
    """The statistics of ``EVON.posterior_health`` from the (pooled) rows of ``health_rows``.

    ``noise_to_signal``: RMS posterior std / RMS weight, pooled over EVON matrices (the RMS std
    of a matrix is sqrt(mean V): the rotation preserves the trace), and its maximum over
    matrices (a matrix that was zero when the optimizer first saw it, as LoRA's B starts,
    counts from the first check at which its noise is below its RMS: until training has grown
    it, its ratio says nothing about ``ess``); ``hess_*``: H over every entry;
    ``hess_below_prior``: the fraction of entries with H < δ, whose variance is dominated by
    the prior 1/(ζδ) rather than by data; ``hess_init_share``: Σ h0·β2ᵗ / Σ H, the part of H
    that is still its initial value after t updates of H (phased gradients: every other step)
    — near 1, the posterior's shape is h0's rather than learned from the data, and sampling it
    is close to isotropic noise
    (docs/defaults.md#hess-init); ``prior_to_signal``: the prior's std 1/sqrt(ζδ) / RMS
    weight, pooled: where the noise goes once H has decayed. ``warn_health`` warns of runaway
    noise (max noise-to-signal ≥ 1: samples no longer resemble the mean) and of a collapse to
    a broad prior (most of H below δ, and ``prior_to_signal`` ≥ ``COLLAPSE_PRIOR_TO_SIGNAL``).
    """
    if not len(t):
        return {}
    return {
        "noise_to_signal": float((t[:, 0].sum() / t[:, 1].sum().clamp_min(1e-300)).sqrt()),
        "noise_to_signal_max": float(t[:, 6].max()),
        "hess_min": float(t[:, 2].min()),
        "hess_max": float(t[:, 3].max()),
        "hess_mean": float(t[:, 4].sum() / numel),
        "hess_below_prior": float(t[:, 5].sum() / numel),
        "hess_init_share": float(t[:, 7].sum() / t[:, 4].sum().clamp_min(1e-300)),
        "prior_to_signal": float((t[:, 8].sum() / t[:, 1].sum().clamp_min(1e-300)).sqrt()),
    }


def warn_skipped(message: str) -> None:
    """The ``RuntimeWarning`` of a step skipped for a non-finite gradient, at the caller's line
    outside hf_evon (``opt.step()``)."""
    warnings.warn(message, RuntimeWarning, stacklevel=outside_stacklevel())


def runaway_matrix(buckets: list[Bucket], label: Callable[[Tensor], str], ratio: float) -> tuple[str, bool] | None:
    """The label (``label`` of the optimizer's parameter) of this process's watched matrix whose
    noise-to-signal ratio is ``ratio``, the pooled maximum, and whether its group's ζ is fitted to the
    curvature; None where none is (sharded: the matrix is another rank's). Slow (a host sync per
    bucket); only when the runaway warning is issued."""
    for b in buckets:
        g = b.group
        members = covered_members(b)
        if math.isinf(g["ess"]) or not members:
            continue
        idx = None if len(members) == len(b.params) else b.member_index(members)  # as health_rows reads them
        hess = b.state["hess"] if idx is None else b.state["hess"][idx]
        watched = b.state["noise_watched"] if idx is None else b.state["noise_watched"][idx]
        _, w_sq, own = _noise_to_signal(b, members, hess)
        ratios = _watched_ratios(watched, w_sq, own)
        top = int(ratios.argmax())
        if float(ratios[top]) == ratio:
            return label(b.params[members[top]]), "ess" in (g.get("fit_to_curvature") or ())
    return None


def warn_health(
    stats: dict[str, float],
    warned: set[str],
    buckets: list[Bucket] | None = None,
    label: Callable[[Tensor], str] | None = None,
) -> None:
    """A ``RuntimeWarning`` naming cause and fix, the first time (per ``warned``) that the noise
    runs away or the posterior collapses to a broad prior; at the caller's line outside hf_evon.
    With ``buckets`` and ``label`` (of a bucket member: its parameter's name) the runaway warning
    names the matrix."""
    stacklevel = outside_stacklevel()
    if stats["noise_to_signal_max"] >= 1.0 and "runaway" not in warned:
        warned.add("runaway")
        found = None
        if buckets is not None and label is not None:
            found = runaway_matrix(buckets, label, stats["noise_to_signal_max"])
        what, fitted = found if found is not None else ("a weight matrix", False)
        if fitted:  # ζ follows the pooled curvature: the noise did not grow, the matrix's weights shrank
            why = (
                "Cause: its weights shrank below the noise its curvature gives it (a matrix the loss "
                "drives towards zero); ess='auto' fits ζ to its group's pooled curvature, not to this "
                "matrix's scale. Fix: if it persists, train it in a group of its own with a larger ess, "
                "or with AdamW (build_optimizer's adamw_patterns)."
            )
        else:
            why = (
                "Cause: ess too small for the weights' scale, or a Hessian estimate that fell to its floor "
                "(the std is then 1/sqrt(ess*weight_decay)). Fix: ess='auto' (the default: initial std 5% "
                "of the weights' RMS) or a larger ess; a larger weight_decay bounds the floor."
            )
        warnings.warn(
            f"EVON: runaway posterior noise: its std is {stats['noise_to_signal_max']:.3g}x the RMS of "
            f"{what}, so samples no longer resemble the mean and training suffers. {why}",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
    broad = stats["prior_to_signal"] >= COLLAPSE_PRIOR_TO_SIGNAL
    if stats["hess_below_prior"] > 0.5 and broad and "collapse" not in warned:
        warned.add("collapse")
        if buckets is not None and all(uses_fisher(b.group) for b in buckets):  # H is no decay of h0 there
            why = (
                "Cause: weight_decay above most of the data's curvature H (the Fisher estimate's scale follows "
                "the loss and the batch size), so the prior sets those entries' variance. Fix: ess='auto' with "
                "weight_decay=None (the defaults: both fitted to H, docs/defaults.md#curvature-fit), or a "
                "smaller weight_decay."
            )
        else:
            why = (
                "Cause: a noise-dominated Hessian estimate (the adaptive clip keeps ±hess_clip_ratio·H of it) "
                "decays as hess_init·betas[1]^t, and a prior this broad lets the noise grow with it. Fix: "
                "weight_decay=None (the default: the prior's std is 5x the initial std, 25% of the weights' "
                "RMS with ess='auto'), or a larger weight_decay or ess; a larger betas[1] (0.999) slows the decay."
            )
        share = math.floor(100 * stats["hess_below_prior"])  # floored: 99.8% is not all of them
        warnings.warn(
            f"EVON: the posterior collapsed to the prior: H < weight_decay in {share}% of the entries, so their "
            "std is ~1/sqrt(ess*weight_decay), the prior's, which is "
            f"{stats['prior_to_signal']:.3g}x the weights' RMS. {why}",
            RuntimeWarning,
            stacklevel=stacklevel,
        )


def non_finite_weights(param_groups: list[dict[str, Any]], label: Callable[[Tensor], str]) -> str | None:
    """Why the gradients are not finite where a weight is not (slow): that weight, the cause."""
    for group in param_groups:
        for p in group["params"]:
            if not bool(torch.isfinite(p._local_tensor if is_dtensor(p) else p).all()):
                return (
                    f"non-finite weights in {label(p)}, so gradients through them are not finite: an "
                    "earlier step's update overflowed them (a learning rate far too large, clip='none', or a weight_decay, "
                    "mean_weight_decay or hess_init so large that its pull on the weights overflows) "
                    "or code outside the optimizer wrote them"
                )
    return None


def first_nonfinite(
    param_groups: list[dict[str, Any]],
    plans: list[Plan],
    adamw: dict[int, tuple[list[Tensor], list[Tensor], list[dict]]],
    label: Callable[[Tensor], str],
) -> str:
    """What made a step non-finite, naming the parameter by ``label`` (slow; only after a failed check)."""
    for group in param_groups:
        for p in group["params"]:
            g = p.grad
            if g is not None and is_dtensor(g):  # FSDP2: this rank's rows (no collective)
                g = g._local_tensor
            if g is not None and not bool(torch.isfinite(g).all()):
                return non_finite_weights(param_groups, label) or f"non-finite gradient in {label(p)}"
    for plan in plans:
        if plan.hess is not None:
            bad = (~torch.isfinite(plan.hess)).flatten(1).any(1).nonzero().flatten().tolist()
            if bad:
                p = plan.work.params[bad[0]]
                return (
                    f"overflow in the Hessian estimate of {label(p)}: its gradient is finite "
                    "but so large (a spike) that H would not be"
                )
    for plan in plans:
        sq = torch.linalg.vector_norm(plan.grad, dim=(1, 2)).square()
        bad = (~torch.isfinite(sq)).nonzero().flatten().tolist()
        if bad:
            name = label(plan.work.params[bad[0]])
            if not bool(torch.isfinite(plan.grad[bad[0]]).all()):  # FSDP2: another rank's rows of it
                return f"non-finite gradient in {name}"
            return (
                f"overflow in the Shampoo statistics (G Gᵀ) of {name}: "
                "its gradient is finite but so large (a spike) that its square is not"
            )
    for params, g_list, _ in adamw.values():
        for p, norm in zip(params, norms_of(g_list)):
            if not bool(torch.isfinite(norm)):
                return (
                    f"overflow in AdamW's squared gradient of {label(p)}: its gradient is "
                    "finite but so large (a spike) that its square is not"
                )
    for gi, (params, g_list, states) in adamw.items():
        for p, g, st in zip(params, g_list, states):
            if g.dtype == torch.float16:
                top = float(half_adamw_second_moments([g], [st], param_groups[gi]["betas"][1])[0])
                if not top <= torch.finfo(torch.float16).max:
                    return (
                        f"overflow in AdamW's squared gradient of {label(p)}: its second moment, kept in "
                        f"float16 as the parameter is, would reach {top:.3g} (float16 ends at 65504)"
                    )
    return UNNAMED


UNNAMED = "a non-finite value"


def skipped_reason(found: list[str]) -> str:
    """Why a step is skipped, from every rank's :func:`first_nonfinite` (sharded: only the owner
    of a matrix or AdamW parameter sees its overflow): the first that names a parameter."""
    named = next((why for why in found if why != UNNAMED), UNNAMED)
    return f"{named}; the step was skipped and the optimizer state is unchanged"


def param_label(param_groups: list[dict[str, Any]], p: Tensor) -> str:
    """``p``'s name (its group's ``param_names``, else its place in the groups) and shape."""
    for gi, group in enumerate(param_groups):
        for i, q in enumerate(group["params"]):
            if q is p:
                names = group.get("param_names")
                name = names[i] if names else f"param_groups[{gi}]['params'][{i}]"
                return f"{name} (shape {tuple(p.shape)})"
    return f"a parameter of shape {tuple(p.shape)}"
