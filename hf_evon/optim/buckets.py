"""EVON's stacked state: parameters of one shape in one ``(B, m, n)`` bucket, and how buckets are built.

A bucket holds the EVON parameters of one group with the same matrix shape, device, bases and
state dtype. Its persistent state (``hess``, ``exp_avg``, ``L``, ``R``, ``Q_L``, ``Q_R``, ...) is
stacked, and the per-parameter entries of ``optimizer.state`` are views into it, so a step is a
handful of batched matmuls whatever the number of parameters.

The momentum is kept where the step reads it (:func:`momentum_key`): in the eigenbasis
(``exp_avg``) for the per-entry Newton step, in the weights' space (``exp_avg_unrotated``) for
``step_curvature="matrix"``, whose step is the momentum itself up to one number per matrix. The
weights' space spares that step two products a step and the refresh two more per side.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import torch

from hf_evon.optim.checks import uses_fisher
from hf_evon.optim.defaults import AUTO_ESS, DEFAULT_INIT_STD_RATIO
from hf_evon.optim.functional import shampoo_statistics
from hf_evon.optim.linalg import eigenbasis, rotate, sample_perturbation, unrotate

__all__ = [
    "Bucket",
    "Plan",
    "UNINITIALIZED",
    "assign_refresh_phases",
    "auto_ess",
    "resolve_auto_ess",
    "refuse_unplaced",
    "restore_means",
    "group_buckets",
    "is_dtensor",
    "matrix_shape",
    "momentum_key",
    "preconditioned_sides",
    "wide_sides",
    "stack_state",
    "state_dtype",
]

Tensor = torch.Tensor


# the momentum's state key in the eigenbasis and in the weights' space (see the module docstring)
ROTATED_MOMENTUM, WEIGHT_SPACE_MOMENTUM = "exp_avg", "exp_avg_unrotated"
# a key of torch AdamW's state that EVON's never has: it tells the one state from the other
ADAMW_ONLY_KEY = "exp_avg_sq"


def momentum_key(group: dict[str, Any]) -> str:
    """The state key of the momentum a group's step reads: ``exp_avg_unrotated`` (the weights'
    space) under ``step_curvature="matrix"``, else ``exp_avg`` (the eigenbasis)."""
    matrix = group.get("step_curvature", "entry") == "matrix"
    return WEIGHT_SPACE_MOMENTUM if matrix else ROTATED_MOMENTUM


def _other_momentum(key: str) -> str:
    return ROTATED_MOMENTUM if key == WEIGHT_SPACE_MOMENTUM else WEIGHT_SPACE_MOMENTUM


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """How EVON views a parameter as a matrix: 1-D/0-D as ``1×d``, N-D as ``(d0, rest)``."""
    if len(shape) <= 1:
        return 1, int(math.prod(shape))
    return int(shape[0]), int(math.prod(shape[1:]))


def wide_sides(m: int, n: int, ratio: float) -> tuple[bool, bool]:
    """Whether the left and the right side of an m×n matrix are more than ``ratio`` times the
    other side: a basis there would hold more than ``ratio`` entries per weight."""
    return m > ratio * n, n > ratio * m


def preconditioned_sides(shape: tuple[int, ...], group: dict[str, Any]) -> tuple[bool, bool]:
    """Which sides of a parameter of ``shape`` get an eigenbasis under ``group``: none for 1-D
    tensors and in IVON mode (``Q = I``), else each side that is neither above ``max_precond_dim``
    nor wide by ``max_precond_ratio``. A group from a state dict saved without
    ``max_precond_ratio`` has no ratio limit, so its saved bases still fit."""
    if group["identity_basis"] or len(shape) <= 1:
        return False, False
    m, n = matrix_shape(shape)
    wide_left, wide_right = wide_sides(m, n, group.get("max_precond_ratio", math.inf))
    cap = group["max_precond_dim"]
    return 1 < m <= cap and not wide_left, 1 < n <= cap and not wide_right


def is_dtensor(p: Tensor) -> bool:
    """Whether ``p`` is a ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallelism)."""
    return type(p).__name__ == "DTensor" and hasattr(p, "placements")


def refuse_unplaced(param_groups: list[dict[str, Any]], label: Callable[[Tensor], str], sharded: bool) -> None:
    """Raise, before any state is made, for an EVON parameter on the meta device or a DTensor unsharded."""
    for g in param_groups:
        for p in g["params"] if g["algorithm"] == "evon" else ():
            if p.is_meta:
                raise RuntimeError(
                    f"EVON cannot train {label(p)}: it is on the meta device, which holds no values. "
                    "Materialise the model first (model.to_empty(device=...), then initialise or load its "
                    "weights: to_empty makes new parameters), then build the optimizer over them"
                )
            if is_dtensor(p) and not sharded:
                raise RuntimeError(
                    f"EVON cannot train the DTensor {label(p)} as a plain tensor: under FSDP2 "
                    "(fully_shard) call hf_evon.prepare_distributed(model, optimizer) before the "
                    "first sampled_params()/step() (it shards EVON over the mesh)"
                )


def restore_means(buckets: list[Bucket]) -> None:
    """Write back the mean of every bucket that holds a sample, and forget the sample."""
    for b in buckets:
        if b.mean is not None:
            b.write_params(b.mean, b.live)
        b.mean = b.z = b.live = None


def state_dtype(param: Tensor) -> torch.dtype:
    """Float32 for every parameter dtype, except float64 parameters keep float64."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_INDEX_CACHE_SIZE = 64  # member lists one bucket keeps as device indices
# the update counter of a member without a gradient at its bucket's initialising step: its own first
# gradient initialises its empty statistics (then it counts from 0)
UNINITIALIZED = -1


@dataclass
class Bucket:
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
    # ((id, version) of state["step"], its values): the members' counters as last read or set
    _counts: tuple[tuple[int, int], list[int]] | None = field(default=None, repr=False)
    # member lists as index tensors on the state's device, built once (a list's copy waits on a GPU)
    _indices: dict[tuple[tuple[int, ...], torch.device], Tensor] = field(default_factory=dict, repr=False)
    # the members' ``optimizer.state`` entries, which ``stack_state`` pointed at the stacked state
    member_states: list[dict[str, Any]] | None = field(default=None, repr=False)
    # the keys of ``member_states`` in ``optimizer.state`` (the hooks' ``model_param`` of each member)
    member_keys: list[Tensor] | None = field(default=None, repr=False)
    _matrix_shaped: bool | None = field(default=None, repr=False)
    # ((frequency, phases), members by phase % frequency): read by ``refresh_due``
    _phases: tuple[tuple[int, tuple[int, ...]], dict[int, list[int]]] | None = field(default=None, repr=False)

    @property
    def matrix_shaped(self) -> bool:
        """Whether every member is an ``m×n`` matrix: its tensors stack without a reshape each (read
        once the members are in; a member resized later is refused before it is stepped)."""
        if self._matrix_shaped is None:
            self._matrix_shaped = all(p.shape == (self.m, self.n) for p in self.params)
        return self._matrix_shaped

    def stale(self, state: dict[Tensor, Any], model_param: Callable[[Tensor], Tensor]) -> bool:
        """Whether the optimizer's ``state`` no longer holds the entries this bucket's state was
        stacked into (``optimizer.state`` cleared or replaced: torch's way to reset an optimizer; or
        one member's entry deleted, replaced or cleared: its reset), so that the buckets are to be
        stacked again from what it holds now (a reset member restarts as a late one)."""
        if self.member_states is None:
            return False
        # read at every step and sample: ``map`` keeps the per-member work out of Python's loop
        held = map(state.get, self.model_params(model_param))
        return not all(map(operator.is_, held, self.member_states)) or not all(
            map(operator.contains, self.member_states, repeat("step"))
        )

    def model_params(self, model_param: Callable[[Tensor], Tensor]) -> list[Tensor]:
        """The optimizer's parameters the members stand for (the hooks' ``model_param`` of each), read once."""
        if self.member_keys is None:
            self.member_keys = list(map(model_param, self.params))
        return self.member_keys

    @property
    def preconditioned(self) -> bool:
        return self.left or self.right

    @property
    def initialized(self) -> bool:
        return not self.preconditioned or "L" in self.state or "R" in self.state

    @property
    def counts(self) -> list[int]:
        """Each member's updates taken (``state["step"]``, one entry per member, on the CPU): a
        member that gets its first gradient late counts its own, as ``torch.optim`` does. Read
        from the tensor only when its version moved since this bucket last read or set it: the
        step loop sets it (``count_updates``), so a step reads no scalar back from a tensor."""
        step = self.state["step"]
        key = (id(step), step._version)
        if self._counts is None or self._counts[0] != key:
            self._counts = (key, [int(c) for c in step.tolist()])
        return self._counts[1]

    @property
    def t(self) -> int:
        """The bucket's updates: its members' largest count (a step's work bucket has one count)."""
        return max(self.counts)

    def set_counts(self, members: list[int], value: int) -> None:
        """Set the listed members' update counters to ``value`` (and what ``counts`` reads)."""
        step = self.state["step"]
        counts = list(self.counts)
        step[members] = float(value)
        for i in members:
            counts[i] = value
        self._counts = ((id(step), step._version), counts)

    def refresh_due(self, t: int, frequency: int) -> list[int]:
        """The members whose eigenbasis refresh is due at update ``t``: ``(t + phase) % frequency == 0``
        (the members of each phase are listed once per frequency and phases)."""
        key = (frequency, tuple(self.refresh_phase))
        if self._phases is None or self._phases[0] != key:
            by_phase: dict[int, list[int]] = {}
            for i, phase in enumerate(self.refresh_phase):
                by_phase.setdefault(phase % frequency, []).append(i)
            self._phases = (key, by_phase)
        return list(self._phases[1].get(-t % frequency, ()))

    def bases(self) -> tuple[Tensor | None, Tensor | None]:
        return self.state.get("Q_L"), self.state.get("Q_R")

    def member_index(self, members: list[int]) -> Tensor:
        """``members`` as an index tensor on the state's device, cached: a bucket sees a few fixed
        lists (its refresh phases' members, a sharded or partly frozen bucket's active ones)."""
        key = (tuple(members), self.state["hess"].device)
        idx = self._indices.get(key)
        if idx is None:
            if len(self._indices) >= _INDEX_CACHE_SIZE:
                self._indices.clear()
            idx = self._indices[key] = torch.tensor(members, device=key[1])
        return idx

    def stacked(self, tensors: list[Tensor]) -> Tensor:
        """Stack per-parameter tensors as ``(B, m, n)``, their dtype kept (one copy).

        Called under ``no_grad``: no ``detach``, and no ``reshape`` of a tensor that is already
        ``m×n``, so the aten ops of a step do not grow with the number of parameters."""
        if self.matrix_shaped:  # the members' own tensors (their gradients, the weights)
            return torch.stack(tensors)
        mn = (self.m, self.n)
        return torch.stack([x if x.shape == mn else x.reshape(mn) for x in tensors])

    def matrices(self, tensors: list[Tensor | None]) -> Tensor:
        """Stack per-parameter tensors as ``(B, m, n)`` in the state dtype (None -> zeros)."""
        if not all(map(operator.is_not, tensors, repeat(None))):
            zeros = torch.zeros(self.m, self.n, device=self.params[0].device, dtype=self.dtype)
            tensors = [zeros if x is None else x for x in tensors]
        out = self.stacked(tensors)
        return out if out.dtype == self.dtype else out.to(self.dtype)

    def unstacked(self, values: Tensor, members: list[int] | None = None) -> tuple[list[Tensor], list[Tensor]]:
        """``(params, values in each parameter's own shape)`` for the listed members (None: all;
        one unbind)."""
        rows = values.unbind(0)
        if members is None and self.matrix_shaped:
            return list(self.params), list(rows)
        idx = range(len(self.params)) if members is None else members
        pairs = [(self.params[i], rows[i]) for i in idx]
        return [p for p, _ in pairs], [v if v.shape == p.shape else v.reshape(p.shape) for p, v in pairs]

    def grads(self) -> Tensor:
        return self.matrices(list(map(_GRAD, self.params)))

    def rotated_mean_grad(self, grad: Tensor, num_samples: int) -> Tensor:
        """``Q_Lᵀ grad Q_R`` for ``grad`` = gradient sum / num_samples; the rotation made at the
        last sample's exit is reused when ``step()`` found the gradients unchanged since."""
        if self.rotated_grads is not None:
            return self.rotated_grads.div_(num_samples) if num_samples > 1 else self.rotated_grads
        return rotate(grad, *self.bases())

    def write_params(self, values: Tensor, members: list[int] | None = None) -> None:
        """Copy ``values[i]`` into member ``i`` (all members, or those listed)."""
        # in place into the parameters themselves (callers hold no_grad): the version counter
        # moves, so autograd notices a graph used across a swap; copy_ into the parameter's
        # own shape works for any memory layout (channels_last)
        torch._foreach_copy_(*self.unstacked(values, members))

    def perturb(self, draw: Callable[[Bucket], Tensor], train: bool) -> bool:
        """Write a posterior sample into the unfrozen members (``draw(self)``: the standard
        normal ``z``); with ``train``, keep ``z`` and, under the Price estimate, start the
        Hessian numerator ``record_sample`` adds to (the Fisher estimate takes H from the step's
        gradient: no per-sample work). False (nothing drawn or written) when every member is frozen."""
        # phased gradients: a member that missed a step is a count behind the others, in its own
        # phase; a training sample perturbs only the members whose step is a noisy one
        phased = train and self.group["phased_gradients"]
        if not phased and all(map(_REQUIRES_GRAD, self.params)):
            self.live = None  # all of them
        else:
            counts = self.counts if phased else []
            live = [i for i, p in enumerate(self.params) if p.requires_grad and (not phased or counts[i] % 2 == 0)]
            if not live:
                return False
            self.live = None if len(live) == len(self.params) else live
        g = self.group
        self.mean = self.stacked(self.params)  # exact copy, in the parameters' dtype
        z = draw(self)
        q_left, q_right = self.bases() if self.initialized else (None, None)
        noise = sample_perturbation(z, self.state["hess"], q_left, q_right, g["ess"], g["weight_decay"])
        # the noise added into the weights in place, computed as mean + noise in the state's
        # dtype and rounded to the weights' (an in-place add promotes): no stacked sum to copy back
        torch._foreach_add_(*self.unstacked(noise, self.live))
        if train and self.initialized:
            self.z = z
            if self.acc is None and not uses_fisher(g):
                self.acc = torch.zeros_like(z)
        return True

    def record_sample(self, alone: bool) -> None:
        """Add this sample's ``G°_s ⊙ z_s`` to the Hessian numerator. ``alone``: no earlier
        gradient is added to it, so its rotation is the step's too if nothing changes it."""
        grads = self.grads()
        rotated = rotate(grads, *self.bases())
        self.acc.addcmul_(rotated, self.z)
        self.exit_grads, self.rotated_grads = (grads, rotated) if alone else (None, None)

    def update_statistics(self, grad: Tensor, beta3: float) -> None:
        """The Shampoo statistics L (and R) of the sides with a basis, from the mean gradient."""
        st = self.state
        if self.left:
            st["L"] = shampoo_statistics(st.get("L"), grad, beta3)
        if self.right:
            st["R"] = shampoo_statistics(st.get("R"), grad, beta3, right=True)

    def settle_momentum(self, member_state: Callable[[Tensor], dict[str, Any]]) -> None:
        """Keep the momentum under the key the group's step reads (:func:`momentum_key`), moving
        it from the other space where the group's ``step_curvature`` changed since it was stacked."""
        want = momentum_key(self.group)
        if want in self.state:
            return
        for p in self.params:
            settle_member_momentum(member_state(p), want)
        del self.state[_other_momentum(want)]
        self.state[want] = self.matrices([member_state(p)[want] for p in self.params])
        point_state_views(self, member_state, (want,))

    def rotated_mean(self) -> Tensor:
        """``Q_Lᵀ M Q_R``: the weights in the eigenbasis (the prior's pull on the step)."""
        return rotate(self.matrices(self.params), *self.bases())

    def subset_params(self, members: list[int]) -> Bucket:
        """A bucket of the listed members, before any state is stacked (sharding's filter)."""
        return Bucket(
            self.group,
            [self.params[i] for i in members],
            self.m,
            self.n,
            self.left,
            self.right,
            self.dtype,
            refresh_phase=[self.refresh_phase[i] for i in members],
        )

    def subset(self, members: list[int]) -> Bucket:
        """A bucket of the listed members with copies of their state (``scatter`` writes it back)."""
        idx = self.member_index(members)

        def pick(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.index_select(0, idx)

        sub = self.subset_params(members)
        sub.state = {k: pick(v) for k, v in self.state.items() if k != "step"}
        counts = self.counts
        # the counters are counted on this bucket (``count_updates``), not on the copy
        sub.state["step"] = self.state["step"][members]
        sub._counts = ((id(sub.state["step"]), sub.state["step"]._version), [counts[i] for i in members])
        sub.acc, sub.exit_grads, sub.rotated_grads = (
            pick(self.acc),
            pick(self.exit_grads),
            pick(self.rotated_grads),
        )
        return sub

    def scatter(self, sub: Bucket, members: list[int]) -> None:
        idx = self.member_index(members)
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
        # phased gradients: the initialising step and even updates are clean, each member by its
        # own count (the bucket's step is noisy if any member's is)
        return self.initialized and any(c % 2 == 0 for c in self.counts)


@dataclass
class Plan:
    """One bucket's step, prepared by ``EVON`` before anything is changed."""

    bucket: Bucket
    work: Bucket  # the bucket itself, or the subset of members that have a gradient
    members: list[int] | None  # that subset's indices (None: all members)
    grad: Tensor  # the mean gradient over the step's samples, (B, m, n)
    unchanged: Tensor | None = None  # device flag: gradients as at the last sample's exit
    g_rot: Tensor | None = None  # rotated gradient, when formed already (ess = inf)
    hess: Tensor | None = None  # candidate H (None: H is not updated this step)

    @property
    def initializing(self) -> bool:
        """An initialising step: statistics and eigenbases only, no update. The bucket's first
        step, or a member's first gradient where it had none at the bucket's (its counter is
        ``UNINITIALIZED`` until then)."""
        return not self.work.initialized or self.work.t == UNINITIALIZED

    @property
    def clean(self) -> bool:
        """A clean (gradient-at-the-mean) step of phased gradients: no Hessian update."""
        g = self.work.group
        return g["phased_gradients"] and not self.work.noisy_phase() and not math.isinf(g["ess"])


def group_buckets(param_groups: list[dict[str, Any]]) -> list[Bucket]:
    """The EVON groups' parameters, bucketed by (group, device, matrix shape, bases, state and weight dtypes).

    A parameter with no entries (a zero-width layer) is in no bucket: it has nothing to step or
    sample, and it keeps no state, as in ``torch.optim``'s optimizers."""
    buckets: dict[tuple, Bucket] = {}
    for gi, group in enumerate(param_groups):
        if group["algorithm"] != "evon":
            continue
        for p in group["params"]:
            if p.numel() == 0:
                continue
            m, n = matrix_shape(p.shape)
            left, right = preconditioned_sides(tuple(p.shape), group)
            # the weights' own dtype too: a bucket's update is cast to one dtype, its mean stacked in it
            key = (gi, p.device, m, n, left, right, state_dtype(p), p.dtype)
            if key not in buckets:
                buckets[key] = Bucket(group, [], m, n, left, right, state_dtype(p))
            buckets[key].params.append(p)
    return list(buckets.values())


def assign_refresh_phases(param_groups: list[dict[str, Any]], buckets: list[Bucket]) -> None:
    """Spread each group's QR work evenly over the f steps of a refresh cycle."""
    for group in param_groups:
        members = [(b, i) for b in buckets if b.group is group for i in range(len(b.params))]
        for b in buckets:
            if b.group is group:
                b.refresh_phase = [0] * len(b.params)
        if not group.get("stagger_refresh", False):
            continue
        # phases past the members' count stay empty: the same choice, without a list of f entries
        load = [0.0] * min(group["precondition_frequency"], len(members))

        def cost(member: tuple[Bucket, int]) -> float:
            b = member[0]
            return float(b.m**3 * b.left + b.n**3 * b.right)

        for b, i in sorted(members, key=cost, reverse=True):  # stable: ties keep order
            phase = load.index(min(load))
            b.refresh_phase[i] = phase
            load[phase] += cost((b, i))


@torch.inference_mode(False)  # a first use inside inference_mode: steps update this state in place
@torch.no_grad()  # inside it: inference_mode(False) turns gradients on
def stack_state(b: Bucket, member_state: Callable[[Tensor], dict[str, Any]]) -> None:
    """Move per-parameter state into stacked storage; per-parameter entries become views.

    ``member_state(p)`` is the ``optimizer.state`` entry of bucket member ``p``."""
    device, dt = b.params[0].device, b.dtype
    b.member_states = [member_state(p) for p in b.params]
    for st in b.member_states:
        if ADAMW_ONLY_KEY in st:  # AdamW's state (moved here from an AdamW group) means nothing to EVON
            st.clear()  # so it starts as a parameter appended to the group does
    # each member's counter (a state with one counter for the bucket gives it to every member)
    zero = torch.zeros((), dtype=torch.float32)
    step = torch.stack([member_state(p).get("step", zero).detach().cpu().float().reshape(()) for p in b.params])
    momentum = momentum_key(b.group)
    fresh = {
        "hess": lambda: torch.full((b.m, b.n), b.group["hess_init"], device=device, dtype=dt),
        momentum: lambda: torch.zeros(b.m, b.n, device=device, dtype=dt),
        # EMA of ‖G‖²_F, one number per matrix (snr_scaling); zero in a state saved without it
        "exp_avg_sq_norm": lambda: torch.zeros((), device=device, dtype=dt),
    }
    for p in b.params:
        settle_member_momentum(member_state(p), momentum)
    bases = [k for k in ("L", "R", "Q_L", "Q_R") if any(k in member_state(p) for p in b.params)]
    # a member without the statistics the others have (appended to its group's params after their
    # first step) gets what a member without a gradient at that step has: zero statistics, their
    # eigenbasis, and the counter UNINITIALIZED, so that its own first gradient initialises them
    late = [i for i, p in enumerate(b.params) if any(k not in member_state(p) for k in bases)]
    if late:
        step[late] = float(UNINITIALIZED)

    def zeros(side: int) -> Tensor:
        return torch.zeros(side, side, device=device, dtype=dt)

    blank = {"L": lambda: zeros(b.m), "R": lambda: zeros(b.n)}
    blank |= {"Q_L": lambda: eigenbasis(zeros(b.m)[None])[0], "Q_R": lambda: eigenbasis(zeros(b.n)[None])[0]}
    keys = list(fresh) + bases
    for k in keys:
        per_param = [member_state(p).get(k) for p in b.params]
        make = fresh[k] if k in fresh else blank[k]
        b.state[k] = torch.stack([make() if x is None else x.to(device, dt) for x in per_param])
    # the health check's runaway watch (1: watched), saved with the state so that a resumed run
    # watches what the uninterrupted one does; a member without it is watched where its weights are
    # not all zero (a LoRA B starting at zero is watched once its noise falls below its RMS)
    saved = [member_state(p).get("noise_watched") for p in b.params]
    nonzero = torch.stack(torch._foreach_norm([p.detach() for p in b.params])).to(device, dt) > 0
    b.state["noise_watched"] = torch.stack(
        [nonzero[i].to(dt) if x is None else x.to(device, dt).reshape(()) for i, x in enumerate(saved)]
    )
    b.state["step"] = step
    point_state_views(b, member_state, (*keys, "noise_watched", "step"))


def settle_member_momentum(st: dict[str, Any], want: str) -> None:
    """One member's state with its momentum under ``want`` (:func:`momentum_key`): a momentum kept
    in the other space (saved or stacked under the other ``step_curvature``) is moved there with
    the member's bases, Q_L m Q_Rᵀ into the weights' space, Q_Lᵀ m Q_R into the eigenbasis."""
    other = _other_momentum(want)
    if want in st or other not in st:
        st.pop(other, None)  # never two momenta: the one the step reads is kept
        return
    x = st.pop(other)[None]
    q_left, q_right = (None if st.get(k) is None else st[k].to(x.dtype)[None] for k in ("Q_L", "Q_R"))
    moved = unrotate(x, q_left, q_right) if want == WEIGHT_SPACE_MOMENTUM else rotate(x, q_left, q_right)
    st[want] = moved[0]


def point_state_views(
    b: Bucket, member_state: Callable[[Tensor], dict[str, Any]], keys: Iterable[str]
) -> None:
    """Make each member's ``optimizer.state`` entries views of the bucket's stacked ``keys``."""
    keys = tuple(keys)
    for i, p in enumerate(b.params):
        st = member_state(p)
        for k in keys:
            if k in b.state:
                st[k] = b.state[k][i]


def auto_ess(group: dict[str, Any], square_sums: Tensor) -> float:
    """ζ = 1 / (ρ² · rms² · (h0 + δ)) for ``ess="auto"``: the initial std is ρ · rms.

    rms pools the group's non-zero trained weights (``square_sums``: Σ p² per parameter; a
    zero-initialised LoRA ``B`` says nothing about scale; a frozen one, as in torch's optimizers,
    nothing about the others); all-zero trained weights use 1/sqrt(their largest fan-in), nn.Linear's
    initial scale. A group with no trained weight pools them all. ρ is the group's ``init_std_ratio``.
    """
    sizes = [p.numel() for p in group["params"]]
    trained = [p.requires_grad for p in group["params"]]
    trained = trained if any(trained) else [True] * len(trained)
    nonzero = [(float(t), n) for t, n, k in zip(square_sums.tolist(), sizes, trained) if k and t > 0.0]
    if nonzero:
        rms_sq = sum(t for t, _ in nonzero) / sum(n for _, n in nonzero)
    else:
        # (a group of zero-size tensors only, such as a pruned Linear(0, d), has nothing to sample: fan-in 1)
        fan_in = max((matrix_shape(p.shape)[1] for p, k in zip(group["params"], trained) if k and p.numel()), default=1)
        rms_sq = 1.0 / fan_in
    ratio = group.get("init_std_ratio", DEFAULT_INIT_STD_RATIO)
    return 1.0 / (ratio**2 * rms_sq * (group["hess_init"] + group["weight_decay"]))


@torch.no_grad()
def resolve_auto_ess(groups: list[dict[str, Any]], square_sums: Callable[[list[Tensor]], Tensor]) -> None:
    """Replace each EVON group's ``ess="auto"`` by :func:`auto_ess` of its weights as they are
    (``square_sums``: Σ p² per parameter; FSDP2: a collective)."""
    for i, group in enumerate(groups):
        if group["algorithm"] == "evon" and group["ess"] == AUTO_ESS:
            ess = auto_ess(group, square_sums(group["params"]))
            if group["weight_decay"] > 0.0 and not ess * group["weight_decay"] >= torch.finfo(torch.float32).tiny:
                raise ValueError(
                    f"param_groups[{i}]: ess='auto' sets the initial std to {group.get('init_std_ratio', DEFAULT_INIT_STD_RATIO):g}× "
                    f"the weights' RMS, and at this group's scale its prior's variance 1/(ess·weight_decay) "
                    f"({1 / (ess * group['weight_decay']):.3g}) is beyond float32: rescale the weights, or set ess"
                )
            group["ess"] = ess
