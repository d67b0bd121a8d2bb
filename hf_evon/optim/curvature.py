"""ζ and δ fitted to the curvature EVON has measured (``ess="auto"``, ``weight_decay=None``
under the Fisher estimate).

H is the data's curvature in the eigenbasis, on a scale no default can know in advance (it
follows the loss, the batch and the layer) and falling as the model fits. So the prior and the
noise level are refit from it every ``curvature_refit`` steps:

- δ = the ``PRIOR_QUANTILE`` (30%) quantile of the group's H: the data, not the prior, sets the
  variance of the other 70% of the entries; the directions the data constrains least (H near 0)
  keep the prior's variance 1/(ζδ), which stays within a few times the pooled variance (at
  least 30% of the entries have H ≤ δ, so the prior's share of the mean below is ≥ 0.15);
- ζ such that the pooled posterior variance, mean 1/(ζ(H+δ)), is r² × the weights' mean square,
  r = ``noise_std_ratio(t)``: the noise level is set, its shape across entries and matrices is H's.

Both come from sums over every entry (the quantile from a histogram of log10 H in bins of
``HIST_STEP`` decades), so they pool over ranks like the health statistics (one gather each,
every ``curvature_refit`` steps) and a sharded run fits the numbers a single process does.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hf_evon.optim.buckets import Bucket
from hf_evon.optim.defaults import (
    AUTO_ESS,
    DEFAULT_INIT_STD_RATIO,
    PRIOR_QUANTILE,
    noise_std_ratio,
)
from hf_evon.optim.hooks import ShardingHooks
from hf_evon.optim.linalg import norms_of

__all__ = [
    "curvature_fitted",
    "fit_from_curvature",
    "fitted_ess",
    "fitted_prior",
    "fitted_values",
    "keep_user_numbers",
    "log_histogram",
    "mean_pull",
    "note_fitted",
    "refit_due",
    "refits_due",
]

Tensor = torch.Tensor

# the histogram of log10 H: bins of HIST_STEP decades from HIST_LOW to HIST_LOW + HIST_BINS·HIST_STEP
# = 1e39, past float32's largest; H = 0 (and anything below float32's normal range) counts in the first
HIST_LOW, HIST_STEP, HIST_BINS = -45.0, 0.1, 840
_F32_MAX, _F32_TINY = torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny


def curvature_fitted(group: dict[str, Any]) -> tuple[str, ...]:
    """The hyperparameters of a new group that are fitted to its curvature, under the Fisher
    estimate with a refit period: ``ess`` if "auto", and then ``weight_decay`` too if None. A
    given ζ keeps the default δ: a δ on H's scale, which the given ζ knows nothing of, would make
    the prior's variance 1/(ζδ) arbitrary."""
    if group.get("algorithm", "evon") != "evon" or group.get("hess_estimator") != "fisher":
        return ()
    if not group.get("curvature_refit") or group.get("ess") != AUTO_ESS:
        return ()
    return ("ess", "weight_decay") if group.get("weight_decay", 0.0) is None else ("ess",)


def fitted_values(group: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The (key, value) pairs of the keys ``group``'s ``fit_to_curvature`` names, as it holds them."""
    return tuple((key, group.get(key)) for key in group.get("fit_to_curvature") or ())


def note_fitted(groups: list[dict[str, Any]], records: dict[int, dict[str, Any]]) -> None:
    """Keep in each group's fit record (``records``, by id of group) its ``fitted_values`` as the
    optimizer has just set them (built, resolved from "auto", refit): a number found there later that
    differs is the user's own, which ``validation.validate_groups`` keeps, as torch keeps an edited lr."""
    for group in groups:
        if id(group) in records:
            records[id(group)]["set_by_fit"] = fitted_values(group)


def keep_user_numbers(group: dict[str, Any], record: dict[str, Any], numbers: list[str]) -> None:
    """Drop from ``group``'s ``fit_to_curvature`` each of ``numbers`` (its fitted keys that held a
    number, not "auto"/None, before the group was settled) whose number is not the one the optimizer
    last set (``record``'s ``set_by_fit``): the user's, kept from then on as a given ζ or δ is."""
    last = dict(record.get("set_by_fit") or fitted_values(group))
    edited = [key for key in numbers if key in last and group.get(key) != last[key]]
    if edited:
        group["fit_to_curvature"] = tuple(k for k in group["fit_to_curvature"] if k not in edited)
    record["set_by_fit"] = fitted_values(group)


def mean_pull(group: dict[str, Any]) -> float:
    """λ: the L2 pull on the mean, the prior's δ plus the group's ``mean_weight_decay``."""
    return group["weight_decay"] + (group.get("mean_weight_decay") or 0.0)


def log_histogram(hess: Tensor) -> Tensor:
    """Per matrix of ``hess`` (B, m, n), the counts of log10 H in the ``HIST_BINS`` bins, (B, bins).
    An entry below eps²·max (eps: float32's resolution; max: its matrix's largest H) counts as no
    curvature: a direction the gradients never move (a dead unit's row) holds exactly 0 in the identity
    basis and, in an eigenbasis, the square of a rotation's rounding of zeros (about eps·|G| each),
    which must not set δ (the quantile) by itself. Curvature that spans more decades than eps alone
    allows (a table's features of unlike scales) is measured."""
    hess = hess.float()
    log_h = hess.clamp_min(_F32_TINY).log10()
    idx = ((log_h - HIST_LOW) / HIST_STEP).floor().clamp_(0, HIST_BINS - 1).long()
    floor = hess.flatten(1).amax(1).mul_(torch.finfo(torch.float32).eps ** 2).clamp_min_(_F32_TINY)[:, None, None]
    idx = torch.where(hess >= floor, idx, 0).flatten(1)  # no curvature (or below float32's normals): the first bin
    counts = torch.zeros(hess.shape[0], HIST_BINS, dtype=torch.float64, device=hess.device)
    return counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float64))


def fitted_prior(counts: Tensor) -> float | None:
    """δ: the upper edge of the bin where the ``PRIOR_QUANTILE`` of the histogram ``counts`` is
    reached (None: that is the first bin: no curvature measured there)."""
    total = float(counts.sum())
    if total == 0:
        return None
    k = int(torch.searchsorted(counts.cumsum(0), torch.tensor(PRIOR_QUANTILE * total, dtype=counts.dtype)))
    # the top bins' edges pass float32's largest number, which the state (and a group's δ) must not
    return min(10.0 ** (HIST_LOW + (k + 1) * HIST_STEP), _F32_MAX) if k > 0 else None


def fitted_ess(inv_sum: float, numel: int, w_sq_sum: float, ratio: float) -> float | None:
    """ζ with mean 1/(ζ(H+δ)) = ``ratio``²·mean W² from Σ 1/(H+δ) and Σ W² over ``numel``
    entries (None: the weights are all zero, their scale says nothing)."""
    if numel == 0 or not 0.0 < w_sq_sum < math.inf or not math.isfinite(inv_sum):
        return None
    ess = (inv_sum / numel) / (ratio**2 * w_sq_sum / numel)
    return ess if 0.0 < ess < math.inf else None  # a ζ that under- or overflows: the last one stays


def group_clock(group: dict[str, Any], t: int) -> int:
    """The optimizer's ``t``-th update counted on the group's own clock: from its first update
    (``fit_from``: stored for a group added mid-run, and moved on by ``fit_from_curvature`` while
    none of the group's weights has had a gradient; 0 otherwise)."""
    return t - group.get("fit_from", 0)


def refit_due(group: dict[str, Any], t: int) -> bool:
    """Whether the group's fitted ζ/δ are refit after the optimizer's ``t``-th update, counted from
    the group's first (``fit_from``: a group added mid-run): after its second, the first to estimate
    H (the first only sets up the eigenbases; left alone, the noise would then be the prior's until
    the next fit), and every ``curvature_refit`` updates. While the group has measured no H (its
    weights have had no gradient yet), each fit restarts its clock, so that it is due again at the
    next update (``refits_due`` restarts it without a fit where nothing of it has moved)."""
    every, t = group.get("curvature_refit", 0), group_clock(group, t)
    return bool(group.get("fit_to_curvature")) and every > 0 and (t == 2 or (t > 0 and t % every == 0))


def refits_due(groups: list[dict[str, Any]], t: int) -> list[dict[str, Any]]:
    """The ``groups`` to refit after the optimizer's ``t``-th update (``refit_due``), but those whose
    fit would only restart their clock: the last fit found no H measured on any rank
    (``fit_waiting``) and none of their weights has a gradient now, so none of their matrices has
    moved since. Their clock restarts here, as that fit would restart it, without its pass over H
    and its pooled reductions: a group whose weights never get a gradient (an unused branch, a layer
    unfrozen later) costs nothing per update. Whether a weight has a gradient is the same on every
    rank (the gradients are averaged), so every rank skips the same fits and the pooled reductions
    stay matched."""
    due = []
    for group in groups:
        if group.get("fit_waiting") and not any(p.grad is not None for p in group["params"]):
            group["fit_from"] = t - 1
        elif refit_due(group, t):
            due.append(group)
    return due


@torch.no_grad()
def fit_from_curvature(
    groups: list[dict[str, Any]],
    buckets: list[Bucket],
    hooks: ShardingHooks,
    t: int,
    records: dict[int, dict[str, Any]] | None = None,
) -> None:
    """Refit δ and then ζ of each of ``groups`` (those named in its ``fit_to_curvature``) from the
    H of its ``buckets`` on every rank (two pooled reductions), after the ``t``-th update; the
    values set noted in ``records`` (the optimizer's fit records: ``note_fitted``).

    Sums are taken per matrix and added in the matrices' order in their group, so a sharded run
    (each rank holding some matrices) fits the very numbers a single process does."""
    index = {id(g): i for i, g in enumerate(groups)}
    # a bucket none of whose matrices has been updated adds only zero rows (below): left out, a group
    # waiting for its first gradient costs no pass over its H at each update it is due
    mine = [b for b in buckets if id(b.group) in index and any(c > 0 for c in b.counts)]
    # each member's place: (group, position in the group's params), the order sums are added in
    places = []
    for b in mine:
        where = {id(p): k for k, p in enumerate(b.group["params"])}
        places.append(
            torch.tensor(
                [(index[id(b.group)], where[id(hooks.model_param(p))]) for p in b.params], dtype=torch.float64
            )
        )

    # a matrix not yet updated holds h0, not a measured curvature: its rows count for nothing
    # (counters on the CPU, where the rows are pooled: no copy to the device)
    measured = [b.state["step"].gt(0).double()[:, None] for b in mine]

    def pooled(columns: list[Tensor], width: int) -> Tensor:
        """Per group, the ``width`` columns of every rank's matrices (a bucket's (B, width)
        rows) summed in a fixed order: the matrices' places."""
        rows = [torch.cat([place, c.double().cpu() * w], dim=1) for place, c, w in zip(places, columns, measured)]
        local = torch.cat(rows) if rows else torch.zeros(0, 2 + width, dtype=torch.float64)
        everything, _ = hooks.pool_rows(local, 0)  # one sync; sharded: every rank's rows
        # by (group, position): a stable sort on the position, then one on the group
        everything = everything[torch.argsort(everything[:, 1], stable=True)]
        everything = everything[torch.argsort(everything[:, 0], stable=True)]
        out = torch.zeros(len(groups), width, dtype=torch.float64)
        for gi in range(len(groups)):
            part = everything[everything[:, 0] == gi, 2:]
            if len(part):
                out[gi] = part.cumsum(0)[-1]  # a sequential sum: the same order, the same bits
        return out

    first = []
    for b in mine:
        hess = b.state["hess"]
        numel = torch.full(
            (len(b.params), 1), float(hess[0].numel()), dtype=torch.float64, device=hess.device
        )
        # in float32 at least: a float16 matrix's norm overflows above 65504 while its entries are finite
        with torch.no_grad():  # one context, not a detach per matrix
            w_sq = torch.stack(norms_of(b.params)).double().square()
        first.append(torch.cat([w_sq[:, None], numel, log_histogram(hess)], dim=1))
    sums = pooled(first, 2 + HIST_BINS)  # [Σ W², numel, the histogram of log10 H]
    waiting = [group for gi, group in enumerate(groups) if sums[gi, 1] == 0]  # no H measured on any rank
    for group in groups:
        group.pop("fit_waiting", None)
    for group in waiting:  # its clock starts at its first gradient: the next update is its second again
        group["fit_from"], group["fit_waiting"] = t - 1, True
    if len(waiting) == len(groups):
        return
    for gi, group in enumerate(groups):
        if "weight_decay" in group["fit_to_curvature"]:
            delta = fitted_prior(sums[gi, 2:])
            if delta is not None:
                group["weight_decay"] = delta
    second = [
        torch.reciprocal(b.state["hess"].double() + b.group["weight_decay"]).sum(dim=(1, 2))[:, None]
        for b in mine
    ]
    inv = pooled(second, 1)
    for gi, group in enumerate(groups):
        if "ess" in group["fit_to_curvature"]:
            ratio = noise_std_ratio(
                group_clock(group, t),
                group["hess_init"],
                group["betas"][1],
                group.get("init_std_ratio", DEFAULT_INIT_STD_RATIO),
            )
            ess = fitted_ess(float(inv[gi, 0]), int(sums[gi, 1]), float(sums[gi, 0]), ratio)
            # the prior's variance 1/(ζδ) must stay a float32 (validation's bound): else the last ζ stays
            if ess is not None and ess * group["weight_decay"] >= _F32_TINY:
                group["ess"] = ess
    note_fitted(groups, records or {})
