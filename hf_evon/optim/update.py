"""One step of one bucket: the kernels of :mod:`hf_evon.optim.functional` applied to its stacked
state, in the order ``EVON.step`` runs them (plan, check, update), and the AdamW groups' step."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from itertools import chain, compress, repeat
from typing import Any

import torch

import hf_evon.optim.linalg as linalg
from hf_evon.optim.buckets import (
    ADAMW_ONLY_KEY,
    ROTATED_MOMENTUM,
    UNINITIALIZED,
    Bucket,
    Plan,
    momentum_key,
    point_state_views,
    state_dtype,
)
from hf_evon.optim.checks import uses_fisher
from hf_evon.optim.curvature import mean_pull
from hf_evon.optim.functional import (
    adamw,
    adamw_step_device,
    all_fused_adamw,
    clipped_update,
    fisher_update,
    half_adamw_second_moments,
    hessian_update,
    matrix_curvature,
    momentum_update,
    newton_step,
    price_estimate,
    snr_scale,
)
from hf_evon.optim.functional import refresh_bases as refreshed_bases
from hf_evon.optim.hooks import ShardingHooks
from hf_evon.optim.linalg import eigenbasis, norms_of, rotate

__all__ = [
    "AdamWInputs",
    "adamw_inputs",
    "adamw_update",
    "count_updates",
    "evon_update",
    "evon_updates",
    "finite_flags",
    "hessian_candidate",
    "plan_update",
    "moved_refusal",
    "refresh_buckets",
    "refresh_runs",
    "refuse_step",
    "step_plans",
    "step_weights",
]

Tensor = torch.Tensor
# the per-parameter reads of every step run in ``map``s over these, not in Python's loop
_GRAD, _DEVICE, _DTYPE = operator.attrgetter("grad"), operator.attrgetter("device"), operator.attrgetter("dtype")
_PLACE = operator.attrgetter("dtype", "device")
_EXP_AVG, _EXP_AVG_SQ, _STEP = operator.itemgetter("exp_avg"), operator.itemgetter("exp_avg_sq"), operator.itemgetter("step")
_GRADS = operator.itemgetter(1)  # of an AdamW group's inputs
# group index -> (params, their gradients / num_samples, their state dicts)
AdamWInputs = dict[int, tuple[list[Tensor], list[Tensor], list[dict]]]
# a bucket's step for its weights: (params, Δ in each one's shape, each one's scale or None)
WeightStep = tuple[list[Tensor], list[Tensor], list[Tensor] | None]


def plan_update(b: Bucket, num_samples: int) -> list[Plan]:
    """The bucket's mean gradient and the members it updates, without changing any state: one
    plan per update count among them (the step's bias corrections and H's average are per count).

    Members without a gradient (frozen, unused) are left out, as ``torch.optim`` does: their
    weights and state stay bit-identical (no plan: no member has a gradient). A member whose
    first gradient comes after the others' counts its own updates from there.
    """
    has_grad = list(map(operator.is_not, map(_GRAD, b.params), repeat(None)))
    if not any(has_grad):
        return []
    if not b.initialized:  # the initialising step only records statistics: for the whole bucket
        return [_plan(b, None, num_samples)]
    counts = b.counts
    if all(has_grad) and len(set(counts)) == 1:
        return [_plan(b, None, num_samples)]
    by_count: dict[int, list[int]] = {}
    for i in compress(range(len(b.params)), has_grad):
        by_count.setdefault(counts[i], []).append(i)
    return [_plan(b, members, num_samples) for members in by_count.values()]


def step_plans(b: Bucket, num_samples: int, member_state: Callable[[Tensor], dict[str, Any]]) -> list[Plan]:
    """What the bucket's update needs that can fail (the candidate H too), no state changed but the
    momentum's space, which follows a ``step_curvature`` changed since the last step.
    ``member_state``: a member's ``optimizer.state`` entry."""
    b.settle_momentum(member_state)
    plans = plan_update(b, num_samples)
    for plan in (plan for plan in plans if not plan.initializing):
        hessian_candidate(plan, num_samples)
    return plans


def _plan(b: Bucket, members: list[int] | None, num_samples: int) -> Plan:
    work = b if members is None else b.subset(members)
    grad = work.grads()
    # clipped, reduced or accumulated since the last sample's exit?
    unchanged = None if work.rotated_grads is None else torch.eq(grad, work.exit_grads).all()
    return Plan(b, work, members, grad.div_(num_samples) if num_samples > 1 else grad, unchanged=unchanged)


def hessian_candidate(plan: Plan, num_samples: int) -> None:
    """``plan.hess``: H after this step (None: not updated), and at ess = inf the rotated gradient."""
    b, g = plan.work, plan.work.group
    delta, ess, hess = g["weight_decay"], g["ess"], b.state["hess"]
    if math.isinf(ess):  # the deterministic method: squared rotated gradients
        plan.g_rot = rotate(plan.grad, *b.bases())
        h_hat = plan.g_rot.square()
    elif uses_fisher(g):  # updated by evon_update from the step's rotated gradient
        return
    elif plan.clean or b.acc is None:
        return
    else:
        h_hat = price_estimate(b.acc, hess, ess, delta, num_samples)
    plan.hess = hessian_update(hess, h_hat, g["betas"][1], delta, ess, g["hess_clip_ratio"], g["eps"])


def refuse_sparse(param_groups: list[dict[str, Any]], label: Callable[[Tensor], str]) -> None:
    """Raise, naming the parameter (``label``), for a sparse gradient (an ``nn.Embedding(sparse=True)``):
    as torch's Adam, EVON's steps need dense ones. Called where a step's first gradient op failed,
    before anything changed: the hot path checks nothing per parameter."""
    for group in param_groups:
        for p in group["params"]:
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(
                    f"EVON: parameter {label(p)} has a sparse gradient; its steps need dense gradients "
                    "(use nn.Embedding(sparse=False), or torch.optim.SparseAdam for that parameter)"
                ) from None


def all_finite(x: Tensor, signed: bool = True) -> Tensor:
    """Whether every entry of the non-empty ``x`` is finite, as a device flag: its largest
    magnitude is below inf (a NaN makes the maximum NaN, which is not); ``signed=False``: ``x`` is
    known to be >= 0 where it is not NaN."""
    return (x.abs() if signed else x).amax() < math.inf


def half_adamw_flags(adamw: AdamWInputs, param_groups: list[dict[str, Any]]) -> list[Tensor]:
    """Per AdamW group with float16 parameters, whether their float16 second moments stay finite: a
    gradient of 1e4 is finite, its square too in the float32 check, but 1e5 is not a float16."""
    flags = []
    for gi, (_, g_list, states) in adamw.items():
        if torch.float16 not in set(map(_DTYPE, g_list)):
            continue
        half = [(g, st) for g, st in zip(g_list, states) if g.dtype == torch.float16]
        if half:
            top = half_adamw_second_moments(*map(list, zip(*half)), param_groups[gi]["betas"][1])
            flags.append(top.amax() <= torch.finfo(torch.float16).max)
    return flags


def finite_flags(
    plans: list[Plan], adamw: AdamWInputs, param_groups: list[dict[str, Any]], label: Callable[[Tensor], str]
) -> bool:
    """Whether every gradient and every candidate Hessian is finite; also settles, in the same
    single device sync, which buckets may reuse their exit rotation. A sparse gradient (which no
    norm takes) is refused by name (``refuse_sparse``; ``label`` names a parameter)."""
    grads = [plan.grad for plan in plans] + list(chain.from_iterable(map(_GRADS, adamw.values())))
    checks = []
    if grads:
        # every ‖G‖²_F finite, in one norm call: it bounds every entry of G Gᵀ and Gᵀ G (L and R
        # stay finite) and of AdamW's squared gradient
        try:
            norms = norms_of(grads)
        except (RuntimeError, NotImplementedError):
            refuse_sparse(param_groups, label)
            raise
        checks.append(all_finite(_stacked(norms).square(), signed=False))
    checks += [all_finite(plan.hess) for plan in plans if plan.hess is not None]
    checks += half_adamw_flags(adamw, param_groups)
    reusable = [plan for plan in plans if plan.unchanged is not None]
    flags = checks + [plan.unchanged for plan in reusable]
    values = _stacked(flags).tolist() if flags else []
    for plan, same in zip(reusable, values[len(checks) :]):
        plan.work.exit_grads = None  # compared; only the rotation may still be needed
        if not same:
            plan.work.rotated_grads = None
    return all(values[: len(checks)])


def evon_update(
    plan: Plan,
    num_samples: int,
    member_state: Callable[[Tensor], dict[str, Any]],
    refreshes: list[tuple[Bucket, list[int] | None]],
) -> WeightStep | None:
    """Apply the planned step to the state: H, momentum and the statistics; the members whose
    eigenbasis refresh is due are appended to ``refreshes`` (bucket, members or None for all), which
    :func:`evon_updates` refreshes together. Returns the step for the weights, ``(params, Δ in each
    one's shape, each one's scale s or None)``, applied as ``p -= lr·s·Δ`` by :func:`evon_updates`
    (one multi-tensor op for all buckets of a group); None on the initialising step.
    ``member_state``: ``optimizer.state`` of a member."""
    b, grad = plan.work, plan.grad
    g, st = b.group, b.state
    beta1, beta2 = g["betas"]
    beta3 = beta2 if g["shampoo_beta"] is None else g["shampoo_beta"]
    delta, ess = g["weight_decay"], g["ess"]

    if plan.initializing:  # the first step: statistics and their eigenbases only
        fresh = not b.initialized
        b.update_statistics(grad, beta3)
        if b.left:
            st["Q_L"] = eigenbasis(st["L"])
        if b.right:
            st["Q_R"] = eigenbasis(st["R"])
        if plan.members is not None:
            plan.bucket.scatter(b, plan.members)
        else:
            point_state_views(b, member_state, ("L", "R", "Q_L", "Q_R"))
        if fresh and (absent := [i for i, p in enumerate(b.params) if p.grad is None]):
            b.set_counts(absent, UNINITIALIZED)  # initialised at their own first gradient
        return None

    t = b.t + 1
    matrix_step = g.get("step_curvature", "entry") == "matrix"
    fisher = plan.hess is None and uses_fisher(g) and not plan.clean  # a clean step estimates no H
    g_rot = plan.g_rot
    if g_rot is None and (fisher or not matrix_step):  # the matrix step itself needs no rotation
        g_rot = b.rotated_mean_grad(grad, num_samples)
    hess = st["hess"]
    if plan.hess is not None:
        hess.copy_(plan.hess)
    elif fisher:
        # finite: every entry of G_rot² is at most ‖G‖²_F, which finite_flags checked; phased, the
        # noisy updates (t = 1, 3, 5, …) are H's only ones: its average counts them alone
        fisher_update(hess, g_rot, beta2, (t + 1) // 2 if g["phased_gradients"] else t)
    momentum = momentum_update(st[momentum_key(g)], grad if matrix_step else g_rot, beta1)
    correction = 1 - beta1**t  # m̂ = m / correction
    scale = None
    if g.get("snr_scaling", False) is not False and g["clip"] != "none":
        scale = snr_scale(st["exp_avg_sq_norm"], momentum, grad, t, beta1, adam=g["snr_scaling"] == "adam")
    pull = mean_pull(g)
    if matrix_step:
        # one curvature c per matrix: the step is Q_L ((m̂ + λ Q_Lᵀ M Q_R) / c) Q_Rᵀ = (M̂ + λ M) / c
        # for the momentum M̂ = Q_L m̂ Q_Rᵀ kept in the weights' space (the bases are orthogonal):
        # neither it nor the weights need a rotation
        curvature = matrix_curvature(hess, delta)
        weights = b.matrices(b.params) if pull != 0.0 else None
        update = clipped_update(
            momentum, None, None, g["clip"], g["clip_radius"], 1 / correction, weights, pull, curvature
        )
    else:
        mean_rot = b.rotated_mean() if pull != 0.0 else None
        step_rot = newton_step(momentum / correction, hess, delta, mean_rot, pull)
        update = clipped_update(step_rot, *b.bases(), g["clip"], g["clip_radius"])
    if update.dtype != b.params[0].dtype:
        if b.params[0].dtype == torch.float16:  # the nearest step float16 holds (max 65504): never inf
            update = update.clamp_(-65504.0, 65504.0)
        update = update.to(b.params[0].dtype)
    # in each parameter's own shape: works for any memory layout (channels_last)
    params, deltas = b.unstacked(update)
    step = (params, deltas, None if scale is None else list(scale.unbind(0)))

    if b.preconditioned and not (g["phased_gradients"] and not plan.clean and not math.isinf(ess)):
        b.update_statistics(grad, beta3)
    if b.preconditioned:
        f = g["precondition_frequency"]
        due = b.refresh_due(t, f)
        if plan.members is not None:  # refreshed in the bucket, after the scatter below
            due = [plan.members[i] for i in due]
        if due:
            refreshes.append((plan.bucket, None if len(due) == len(plan.bucket.params) else due))
    if plan.members is not None:
        plan.bucket.scatter(b, plan.members)
    return step


def evon_updates(
    plans: list[Plan], num_samples: int, member_state: Callable[[Tensor], dict[str, Any]]
) -> None:
    """:func:`evon_update` of every plan, then the due eigenbasis refreshes of all buckets together
    (in runs of bounded memory, :func:`refresh_runs`), the weights' steps and the update counters,
    each in one multi-tensor op for all buckets (the steps per group: rates and scaling are per group)."""
    steps: dict[int, tuple[float, WeightStep]] = {}
    stepped = []
    refreshes: list[tuple[Bucket, list[int] | None]] = []
    for plan in plans:
        counted = plan.work.initialized  # a bucket's first step does not count, a late member's does
        if (step := evon_update(plan, num_samples, member_state, refreshes)) is not None:
            group = plan.work.group
            empty: WeightStep = ([], [], None if step[2] is None else [])
            _, (params, deltas, scales) = steps.setdefault(id(group), (group["lr"], empty))
            params += step[0]
            deltas += step[1]
            if scales is not None:
                scales += step[2]
        if counted:
            stepped.append((plan.bucket, plan.members))
    for run in refresh_runs(refreshes):  # each written before the next is gathered
        refresh_buckets(run)
    for lr, (params, deltas, scales) in steps.values():
        # a CPU tensor's rate is read without a device sync: the number's step exactly
        step_weights(params, deltas, scales, lr.item() if torch.is_tensor(lr) and lr.device.type == "cpu" else lr)
    count_updates(stepped)


def refresh_runs(due: list[tuple[Bucket, list[int] | None]]) -> list[list[tuple[Bucket, list[int] | None]]]:
    """The due refreshes (bucket, members or None for all) in runs of at most
    ``linalg.REFRESH_CALL_ENTRIES`` statistics' entries (a bucket over it alone), the bound of one
    grouped QR call: a run's gathered stacks, new bases and moved momenta are held until it is
    written, so a step that refreshes every matrix holds the state of one run at a time, not of all."""
    runs: list[list[tuple[Bucket, list[int] | None]]] = []
    entries = 0
    for b, members in due:
        size = (len(b.params) if members is None else len(members)) * (b.left * b.m**2 + b.right * b.n**2)
        if not runs or entries + size > linalg.REFRESH_CALL_ENTRIES:
            runs.append([])
            entries = 0
        runs[-1].append((b, members))
        entries += size
    return runs


def step_weights(params: list[Tensor], deltas: list[Tensor], scales: list[Tensor] | None, lr: float | Tensor) -> None:
    """``p -= lr·s·Δ`` for every parameter (s = 1 where ``scales`` is None) in one multi-tensor op.
    A rate held in a 0-dim tensor is multiplied on the device, as torch's capturable optimizers do:
    reading it to the host would wait, every step, for all the work queued there."""
    if not torch.is_tensor(lr):
        if scales is None:
            torch._foreach_add_(params, deltas, alpha=-lr)
        else:
            torch._foreach_addcmul_(params, deltas, scales, value=-lr)
        return
    deltas = torch._foreach_mul(deltas, lr.neg().to(params[0].device))
    if scales is None:
        torch._foreach_add_(params, deltas)
    else:
        torch._foreach_addcmul_(params, deltas, scales)


def adamw_update(group: dict, params: list[Tensor], grads: list[Tensor], states: list[dict]) -> None:
    """One AdamW step of an AdamW group's ``params`` (their state created on the first)."""
    for p, st in [] if all(map(operator.contains, states, repeat(ADAMW_ONLY_KEY))) else zip(params, states):
        if ADAMW_ONLY_KEY not in st:  # none yet, or EVON's (moved here from an EVON group): AdamW's starts fresh
            st.clear()
            st["step"] = torch.zeros((), dtype=torch.float32, device=adamw_step_device(p))
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    beta1, beta2 = group["betas"]
    adamw(
        params,
        grads,
        list(map(_EXP_AVG, states)),
        list(map(_EXP_AVG_SQ, states)),
        list(map(_STEP, states)),
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
    )


def _stacked(flags: list[Tensor]) -> Tensor:
    """0-dim ``flags`` stacked on the first one's device."""
    one_device = len(set(map(_DEVICE, flags))) == 1
    return torch.stack(flags if one_device else [f.to(flags[0].device) for f in flags])


def _placed_as_made(b: Bucket) -> bool:
    """Whether every member is on the device and of a dtype its stacked state was made for (a
    float32/float64 cast changes the state's dtype: ``buckets.state_dtype``), read in ``map``s."""
    hess = b.state["hess"]
    dtypes = set(map(_DTYPE, b.params))
    if set(map(_DEVICE, b.params)) != {hess.device}:
        return False
    if hess.dtype == torch.float64:
        return dtypes == {torch.float64}
    return hess.dtype == torch.float32 and torch.float64 not in dtypes


def _adamw_placed_as_made(params: list[Tensor], states: list[dict]) -> bool:
    """Whether every one of an AdamW group's ``params`` has its state, made for its dtype and device
    (its step count where :func:`adamw` reads it, the fused kernel's: on its device), read in
    ``map``s; False sends :func:`_moved_param` through them one by one."""
    if not all(map(operator.contains, states, repeat(ADAMW_ONLY_KEY))):
        return False
    places = list(map(_PLACE, params))
    if not places == list(map(_PLACE, map(_EXP_AVG, states))) == list(map(_PLACE, map(_EXP_AVG_SQ, states))):
        return False
    steps = list(map(dict.get, states, repeat("step")))
    return (
        all(map(isinstance, steps, repeat(Tensor)))
        and list(map(_DEVICE, steps)) == list(map(_DEVICE, params))
        and all_fused_adamw(params)
    )


def _moved_param(buckets: list[Bucket], adamw: AdamWInputs) -> tuple[Tensor, str, Tensor] | None:
    """The first parameter, with its state entry, no longer of the dtype or on the device that entry was
    made for; None if there is none."""
    for b in buckets:
        if _placed_as_made(b):
            continue
        hess = b.state["hess"]
        device = hess.device  # read once: the members' states are rows of this one tensor
        for p in b.params:
            if p.device != device or state_dtype(p) != hess.dtype:
                return p, "hess", hess
    step_devices: dict[tuple[torch.dtype, torch.device], torch.device] = {}  # adamw_step_device per place
    for params, _, states in adamw.values():
        for p, st in [] if _adamw_placed_as_made(params, states) else zip(params, states):
            avg_sq = st.get(ADAMW_ONLY_KEY)
            if avg_sq is None:  # no AdamW state yet: the step makes it, as p is now
                continue
            dtype, device = p.dtype, p.device
            avg = st["exp_avg"]
            if avg.dtype != dtype or avg.device != device:
                return p, "exp_avg", avg
            if avg_sq.dtype != dtype or avg_sq.device != device:
                return p, "exp_avg_sq", avg_sq
            step = st.get("step")
            if isinstance(step, Tensor):
                wanted = step_devices.get((dtype, device))
                if wanted is None:
                    wanted = step_devices[dtype, device] = adamw_step_device(p)
                if step.device != wanted:
                    return p, "step", step
    return None


def moved_refusal(buckets: list[Bucket], adamw: AdamWInputs, label: Callable[[Tensor], str]) -> str | None:
    """Why the step is refused, naming the parameter (``label``), where a parameter is no longer of the
    dtype or on the device its state was made for (``model.to(torch.bfloat16)`` after a step); None if
    none is. Checked before any group steps: torch's kernels raise at the first group they meet, the
    others stepped. EVON's state follows the weights' dtype (its update is cast to it), not their device."""
    moved = _moved_param(buckets, adamw)
    if moved is None:
        return None
    p, key, v = moved
    return (
        f"EVON.step: parameter {label(p)} is {p.dtype} on {p.device}, but its state {key!r} is {v.dtype} "
        f"on {v.device}: the model was cast or moved after the optimizer's state was made. The step was "
        "not taken and its samples are dropped: cast or move the model back, or reload the optimizer's "
        "state into the model as it is now (optimizer.load_state_dict(optimizer.state_dict()))"
    )


NEEDS_SAMPLES = (
    "EVON needs the gradient at a posterior sample: run forward/backward inside "
    "`with optimizer.sampled_params(train=True):` before step()"
)


def refuse_step(
    found: list[tuple[str | None, bool, str | None]], reason: str | None, refused: Callable[[], None]
) -> None:
    """Raise on every rank alike where some rank refuses the step, from every rank's (moved
    parameter's reason or None, whether it lacks samples for its noisy matrices, non-finite finding),
    in rank order (sharded: a recast parameter shows only in its owner's state): this rank's
    ``reason`` or else the first refusing rank's, after calling ``refused``; without a moved
    parameter, the missing samples. Return where no rank refuses (a value was not finite)."""
    first = next(((r, why) for r, (why, _, _) in enumerate(found) if why is not None), None)
    if first is None:
        if any(needs for _, needs, _ in found):
            raise RuntimeError(NEEDS_SAMPLES)
        return
    refused()
    rank, why = first
    raise RuntimeError(reason if reason is not None else f"rank {rank} refused the step, so every rank does: {why}")


def adamw_inputs(
    param_groups: list[dict[str, Any]],
    state: dict[Tensor, dict[str, Any]],
    hooks: ShardingHooks,
    num_samples: int,
) -> AdamWInputs:
    """Per AdamW group (by index): this rank's parameters with a gradient, their mean gradients
    over the step's samples and their states (FSDP2: each rank's own rows)."""
    out = {}
    for gi, group in enumerate(param_groups):
        if group["algorithm"] != "adamw":
            continue
        params = hooks.owned(list(compress(group["params"], map(operator.is_not, map(_GRAD, group["params"]), repeat(None)))))
        if not params:
            continue
        states = list(map(state.__getitem__, params))  # (torch's defaultdict: a new one gets its entry)
        params, g_list = hooks.adamw_tensors(params)
        if num_samples > 1:
            g_list = torch._foreach_div(g_list, num_samples)
        out[gi] = (params, g_list, states)
    return out


def refresh_buckets(due: list[tuple[Bucket, list[int] | None]]) -> None:
    """One power iteration + QR for the listed members of each bucket (None: all of them), the
    momentum moved to the new bases; the QRs of all buckets together (``refresh_bases``). A
    bucket may be listed once per set of its members (the sets are disjoint)."""
    stacks, where = [], []
    for b, members in due:
        st = b.state
        # all or consecutive members (a staggered refresh's one) by a slice: views read, copies written
        rows = slice(None) if members is None else slice(members[0], members[0] + len(members))
        idx = rows if members is None or members == list(range(len(b.params))[rows]) else b.member_index(members)
        rotated = ROTATED_MOMENTUM in st  # a momentum in the weights' space needs no move
        stacks.append(
            (
                st["L"][idx] if b.left else None,
                st["R"][idx] if b.right else None,
                st["Q_L"][idx] if b.left else None,
                st["Q_R"][idx] if b.right else None,
                st[ROTATED_MOMENTUM][idx] if rotated else None,
            )
        )
        where.append((st, idx))
    for (st, idx), values in zip(where, refreshed_bases(stacks)):
        for key, value in zip((ROTATED_MOMENTUM, "Q_L", "Q_R"), values):
            if value is not None:
                st[key][idx] = value


def count_updates(stepped: list[tuple[Bucket, list[int] | None]]) -> None:
    """Add one to the update counters of the listed members of each bucket (None: all of them;
    whole buckets in one multi-tensor op; in place: members' ``optimizer.state`` are views of
    them), and to what ``Bucket.counts`` reads, so that it reads no scalar back from them. A
    bucket may be listed once per set of its members (members of different counts step as
    separate plans; the sets are disjoint)."""
    counts: dict[int, tuple[Bucket, list[int]]] = {}
    for b, members in stepped:  # before the counters move: the cached counts are still current
        new = counts.setdefault(id(b), (b, list(b.counts)))[1]
        if members is None:
            new[:] = map(operator.add, new, repeat(1))
        for i in members or ():
            new[i] += 1
    whole = [b.state["step"] for b, members in stepped if members is None]
    if whole:
        torch._foreach_add_(whole, 1)
    for b, members in stepped:
        if members is not None:
            step = b.state["step"]  # (its dtype: a float64 default dtype would make ones float64)
            step.index_add_(0, torch.tensor(members), torch.ones(len(members), dtype=step.dtype))
    for b, new in counts.values():
        step = b.state["step"]
        b._counts = ((id(step), step._version), new)
