"""The ``evon/*`` statistics the EVON trainers log at every logging step."""

import math

import torch

from hf_evon.optim import EVON
from hf_evon.optim.health import covered_members
from hf_evon.optim.linalg import marginal_variance

__all__ = ["posterior_statistics"]


@torch.no_grad()
def posterior_statistics(optimizer: EVON, pruned: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> dict[str, float]:
    """``evon/posterior_std_mean`` (mean marginal posterior std over all EVON-owned weights, 0 at the
    ``pruned`` entries: AdaLoRA's pruned ranks, ``hf_evon.trainer.adalora.pruned_entries``, which samples keep 0;
    frozen matrices that never had a gradient, never sampled, left out as ``posterior_health()`` leaves them),
    ``evon/hess_min``/``max``/``mean`` (range of the rotated-space Hessian H), ``evon/skipped_steps``
    and every ``posterior_health()`` statistic as ``evon/<name>``; {} before the first step.
    ``posterior_health()``'s ``hess_*`` are those logged: they cover the sampled (finite ``ess``)
    groups, as the other health statistics do; only where no group samples do they cover the
    deterministic H (the squared gradients' average) of every EVON matrix.

    Under ``evon_shard`` every rank's matrices are pooled (a collective: call it on every rank).
    """
    buckets = optimizer.buckets
    if not buckets and optimizer.sharding is None:
        return {}
    masks = {id(p): mask for p, mask in pruned}
    rows = []  # per bucket: min H, max H, sum H, sum std (one host sync for all of them)
    count = 0
    for b in buckets:
        members = covered_members(b)  # as posterior_health(): a point estimate holds h0, not a curvature
        if not members:
            continue
        idx = None if len(members) == len(b.params) else b.member_index(members)  # None: every member
        hess, group = b.state["hess"], b.group
        q_left, q_right = b.bases() if b.initialized else (None, None)
        if math.isinf(group["ess"]):
            std_sum = hess.new_zeros((), dtype=torch.float64)
        else:
            std = marginal_variance(hess, q_left, q_right, group["ess"], group["weight_decay"]).clamp_min(0).sqrt()
            for i, p in enumerate(b.params) if masks else ():
                if id(p) in masks:
                    std[i] = std[i].masked_fill(masks[id(p)].reshape(std[i].shape), 0)
            std_sum = (std if idx is None else std[idx]).double().sum()
        hess = hess if idx is None else hess[idx]
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
        "evon/posterior_std_mean": sum(std_sum) / count,
        "evon/hess_min": h_min,
        "evon/hess_max": h_max,
        "evon/hess_mean": sum(h_sum) / count,
        "evon/skipped_steps": float(optimizer.skipped_steps),
        **health,  # last: a key in both is health's (its denominators are those of its other statistics)
    }
