"""The Gaussian maths of an EVON posterior: its factors, samples, and basis checks.

For each covered matrix ``W`` (shape ``m×n`` after EVON's reshape) the posterior is::

    vec W ~ N(vec M, (Q_L ⊗ Q_R) diag(vec V) (Q_L ⊗ Q_R)ᵀ),   V = 1 / (ζ (H + δ))

(row-major ``vec``), ``M`` being the model's current weight (the mean), ``Q_L``/``Q_R`` the
eigenbases (identity where absent), ``H`` the rotated-space Hessian, ``ζ`` the effective
sample size ``ess`` and ``δ`` the weight decay. Nothing here knows about files or the Hub
(``format``, ``hub``) or about models (``posterior``).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from hf_evon.modeling import fsdp2_modules
from hf_evon.optim.buckets import is_dtensor, matrix_shape, wide_sides
from hf_evon.optim.buckets import state_dtype as compute_dtype  # float32 math; float64 stays float64
from hf_evon.optim.linalg import (
    ORTHONORMAL_TOL,
    dense_covariance,
    exact_float32_matmul,
    marginal_variance,
    orthonormality_error,
    rotated_std,
    rotated_variance,
    unrotate,
)
from hf_evon.optim.noise import derived_seed, resolve_seed
from hf_evon.posterior.json_rules import PosteriorMismatchError

Tensor = torch.Tensor


def add_perturbation(mean: Tensor, delta: Tensor) -> Tensor:
    """``M + ΔW`` formed in float32 or wider (the wider of the two dtypes) and cast once to ``mean``'s
    dtype: a sample written into a float32 model keeps its float32 mean whatever dtype ``delta`` has.
    A DTensor ``mean`` (an FSDP2 shard) takes its own part of the whole ``delta``."""
    if is_dtensor(mean) and not is_dtensor(delta):
        delta = placed_like(delta, mean)
    wide = torch.promote_types(torch.promote_types(mean.dtype, delta.dtype), torch.float32)
    return (mean.to(wide) + delta.to(wide)).to(mean.dtype)


def zero_entries(values: Tensor, indices: list[int] | None, leading: int = 0) -> Tensor:
    """``values`` (``leading`` batch dims, then one parameter's shape) with the listed entries of the
    parameter's row-major flatten set to 0 (AdaLoRA's pruned ranks: off, not uncertain)."""
    if not indices:
        return values
    flat = values.reshape(*values.shape[:leading], -1)
    return flat.index_fill(leading, torch.tensor(indices, device=values.device), 0).reshape(values.shape)


def sample_seed(seed: int | None, params: Iterable[Tensor], model: torch.nn.Module | None = None) -> int:
    """``seed`` for writing one sample into ``params`` of ``model`` (``resolve_seed``). ``seed=None`` is
    refused where one is a DTensor or ``model`` is ``fully_shard``-ed (FSDP2): each rank would take a
    seed from its own RNG and write its rows of a different sample, a model torn between samples that no
    rank could see. FSDP2 leaves the weights gathered (plain tensors) after a forward without backward
    under ``reshard_after_forward=False``: each rank would run its own sample then."""
    if seed is None and (any(is_dtensor(p) for p in params) or (model is not None and fsdp2_modules(model))):
        raise ValueError(
            "sampled(model, seed=None): the model's parameters are sharded (DTensors, FSDP2; gathered or "
            "not), and each rank would draw its own seed and write its rows of a different sample; pass "
            "seed=<int>, the same on every rank"
        )
    return resolve_seed(seed)


def draw_batches(
    params: Mapping[str, Tensor], groups: Iterable[Iterable[str]]
) -> list[tuple[torch.device, list[str]]]:
    """The names of ``groups`` (each factor group's covered names) in the batches ``sampled`` draws
    them in, each with its device: one factor group's plain tensors of one device together (one
    batched draw), so a draw's float32 transient is the largest group's, not the whole covered
    model's; a DTensor (an FSDP2 shard) alone, as each rank draws its whole perturbation to keep
    only its own rows of it."""
    batches: list[tuple[torch.device, list[str]]] = []
    for names in groups:
        by_device: dict[torch.device, list[str]] = {}
        for name in names:
            p = params[name]
            if is_dtensor(p):
                batches.append((p.device, [name]))
            else:
                by_device.setdefault(p.device, []).append(name)
        batches.extend(by_device.items())
    return batches


def placed_like(whole: Tensor, like: Tensor) -> Tensor:
    """``whole`` as a DTensor placed as the DTensor ``like``, each rank keeping its part (``Shard(d)``:
    ``torch.chunk``'s share of dim ``d``; ``Replicate``: all of it), no communication: every rank
    holds the same ``whole``."""
    from torch.distributed.tensor import DTensor

    from hf_evon.distributed.fsdp2 import shard_rows

    local, coordinate = whole, like.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(like.placements):
        if placement.is_shard() and coordinate is not None:
            parts, size = like.device_mesh.size(mesh_dim), local.shape[placement.dim]
            local = local.narrow(placement.dim, *shard_rows(size, parts, coordinate[mesh_dim]))
        elif not placement.is_replicate():
            raise ValueError(f"cannot write a posterior sample into a DTensor placed as {like.placements}")
    return DTensor.from_local(
        local.contiguous(), like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


@dataclass(frozen=True)
class MatrixFactors:
    """The posterior of one covered parameter, in EVON's matrix view of it.

    ``Q_L``/``Q_R`` are ``None`` where the basis is the identity; ``hess`` is ``H`` (m×n);
    ``shape`` is the parameter's own shape and ``matrix_shape`` the ``(m, n)`` it is
    reshaped to (row-major).
    """

    Q_L: Tensor | None
    Q_R: Tensor | None
    hess: Tensor
    shape: tuple[int, ...]
    matrix_shape: tuple[int, int]
    ess: float
    weight_decay: float

    @property
    def variance(self) -> Tensor:
        """``V = 1 / (ζ (H + δ))``, the rotated-space variance (m×n)."""
        return rotated_variance(self.hess.to(compute_dtype(self.hess)), self.ess, self.weight_decay)

    def _wide(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``H``, ``Q_L``, ``Q_R`` in the compute dtype, contiguous (``torch.kron`` needs it)."""
        dt = compute_dtype(self.hess)
        held = (self.hess, self.Q_L, self.Q_R)
        return tuple(None if t is None else t.to(dt).contiguous() for t in held)  # type: ignore[return-value]

    def marginal_variance(self) -> Tensor:
        """Diagonal of the covariance, shaped ``matrix_shape``."""
        return marginal_variance(*self._wide(), self.ess, self.weight_decay)

    def std(self, pruned: list[int] | None = None) -> Tensor:
        """Marginal standard deviations shaped like the parameter; 0 at ``pruned`` (:func:`zero_entries`)."""
        return zero_entries(self.marginal_variance().sqrt().reshape(self.shape), pruned)

    def covariance(self, pruned: list[int] | None = None) -> Tensor:
        """Dense covariance of the row-major flatten of the matrix; 0 in the rows and columns of ``pruned``."""
        cov = dense_covariance(*self._wide(), self.ess, self.weight_decay)
        return zero_entries(zero_entries(cov, pruned, 1).mT, pruned, 1).mT


@dataclass
class FactorGroup:
    """Covered matrices of equal shape, bases and noise scale, stacked for batched math."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    m: int
    n: int
    q_left: Tensor | None  # (B, m, m)
    q_right: Tensor | None  # (B, n, n)
    hess: Tensor  # (B, m, n)
    ess: float
    weight_decay: float

    def factors(self, i: int) -> MatrixFactors:
        return MatrixFactors(
            Q_L=None if self.q_left is None else self.q_left[i],
            Q_R=None if self.q_right is None else self.q_right[i],
            hess=self.hess[i],
            shape=self.shapes[i],
            matrix_shape=(self.m, self.n),
            ess=self.ess,
            weight_decay=self.weight_decay,
        )

    def cast(
        self, device: torch.device | str | None, dtype: torch.dtype | None, held: torch.dtype | None = None
    ) -> FactorGroup:
        """Tensors on ``device``; bases in ``dtype``, ``H`` in ``dtype`` but never narrower than float32
        (the file format's ``hess``): float16 ends at 65504, where a larger H would give a zero std.
        ``held``: the precision the bases hold (their dtype where None or finer): ``with_basis_dtype``."""
        hess_dtype = None if dtype is None else torch.promote_types(dtype, torch.float32)
        group = self if dtype is None else self.with_basis_dtype(dtype, held, hess_dtype)
        cast = lambda t: None if t is None else t.to(device=device)  # noqa: E731
        hess = self.hess.to(device=device, dtype=hess_dtype)
        return replace(group, q_left=cast(group.q_left), q_right=cast(group.q_right), hess=hess)

    def with_basis_dtype(
        self, dtype: torch.dtype, held: torch.dtype | None = None, hess: torch.dtype | None = None
    ) -> FactorGroup:
        """Bases in ``dtype`` (``upcast_bases``), beside an ``H`` of dtype ``hess`` (its own where None).
        Bases that hold only ``held``'s precision (``EVONPosterior.config["eigenbasis_dtype"]``, coarser
        than their dtype where read from half-precision files) are re-orthonormalised where ``dtype``'s
        load check would refuse them: a save writes them as ``dtype``, and must load."""
        hess = hess or self.hess.dtype

        def cast(q: Tensor | None) -> Tensor | None:
            return None if q is None else upcast_bases(q, dtype, coarser(held, q.dtype), hess)

        return replace(self, q_left=cast(self.q_left), q_right=cast(self.q_right))

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> FactorGroup:
        return replace(
            self,
            q_left=None if self.q_left is None else fn(self.q_left),
            q_right=None if self.q_right is None else fn(self.q_right),
            hess=fn(self.hess),
        )


def basis_dtype(factors: Mapping[str, MatrixFactors]) -> torch.dtype:
    """The dtype the eigenbases are held in: the first basis's (H's where no matrix has one)."""
    for f in factors.values():
        for q in (f.Q_L, f.Q_R):
            if q is not None:
                return q.dtype
    return next(iter(factors.values())).hess.dtype


def check_factor_shapes(name: str, f: MatrixFactors) -> None:
    """``f``'s matrix view and tensors agree with its parameter's shape, or an error naming them."""
    m, n = f.matrix_shape
    if tuple(f.matrix_shape) != matrix_shape(f.shape):
        raise PosteriorMismatchError(f"{name!r}: matrix_shape {f.matrix_shape} does not match shape {f.shape}")
    for label, t, want in (("hess", f.hess, (m, n)), ("Q_L", f.Q_L, (m, m)), ("Q_R", f.Q_R, (n, n))):
        if t is not None and tuple(t.shape) != want:
            raise PosteriorMismatchError(f"'{name}.{label}' has shape {tuple(t.shape)}; expected {want}")


def _with_tuple_shapes(name: str, f: MatrixFactors) -> MatrixFactors:
    """``f`` with ``shape`` and ``matrix_shape`` as tuples of ints, or an error naming ``name``."""
    shapes = {}
    for field in ("shape", "matrix_shape"):
        value = getattr(f, field)
        try:
            shapes[field] = tuple(operator.index(s) for s in value)
        except TypeError:
            raise PosteriorMismatchError(f"{name!r}: {field} must be a sequence of integers; got {value!r}") from None
    return replace(f, **shapes)


def stack_factors(factors: Mapping[str, MatrixFactors]) -> list[FactorGroup]:
    """Stack factors into groups of equal matrix shape, stored bases, noise scale, dtypes and
    device (names sorted within a group), so that sampling runs one batched matmul per group."""
    buckets: dict[tuple, list[str]] = {}
    factors = {name: _with_tuple_shapes(name, f) for name, f in factors.items()}  # lists from JSON too
    for name in sorted(factors):
        f = factors[name]
        check_factor_shapes(name, f)
        key = (
            f.matrix_shape,
            f.Q_L is not None,
            f.Q_R is not None,
            f.ess,
            f.weight_decay,
            f.hess.dtype,
            None if f.Q_L is None else f.Q_L.dtype,
            None if f.Q_R is None else f.Q_R.dtype,
            f.hess.device,
        )
        buckets.setdefault(key, []).append(name)
    groups = []
    for key, names in buckets.items():
        (m, n), left, right, ess, wd = key[:5]
        fs = [factors[nm] for nm in names]
        groups.append(
            FactorGroup(
                names=names,
                shapes=[f.shape for f in fs],
                m=m,
                n=n,
                q_left=torch.stack([f.Q_L for f in fs]) if left else None,
                q_right=torch.stack([f.Q_R for f in fs]) if right else None,
                hess=torch.stack([f.hess for f in fs]),
                ess=ess,
                weight_decay=wd,
            )
        )
    return groups


def sample_group(
    group: FactorGroup,
    members: list[int],
    num_samples: int,
    seed: int,
    device: Any,
    rotated: bool = False,
    pruned: Mapping[str, list[int]] | None = None,
) -> Tensor:
    """``num_samples`` perturbations of the group's matrices ``members``: ``(len(members), S, m, n)``.

    Sample ``s`` of each matrix draws from a generator seeded by ``(seed + s, name)``, so its values
    depend neither on which other matrices are drawn with it nor on how many samples are.
    ``rotated``: the draws before the bases
    are applied (``z ⊙ √V``). Math in ``compute_dtype`` on ``device`` (None: where the group is).
    ``pruned`` (``{name: entries}``, AdaLoRA's pruned ranks) are 0 in the perturbations, not in ``rotated``'s.
    """
    dev = torch.device(device) if device is not None else group.hess.device
    if dev.type == "meta":
        raise ValueError(
            "cannot draw posterior samples on the meta device, which holds no values: load the model's "
            "weights first (a model made under torch.device('meta') or with empty weights has none)"
        )
    dt = compute_dtype(group.hess)

    def take(t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        if len(members) != t.shape[0]:
            t = t[torch.tensor(members, device=t.device)]
        return t.to(device=dev, dtype=dt)

    hess, q_left, q_right = take(group.hess), take(group.q_left), take(group.q_right)
    z = torch.empty(len(members), num_samples, group.m, group.n, device=dev, dtype=dt)
    gen = torch.Generator(device=dev)
    for j, i in enumerate(members):
        for s in range(num_samples):  # sample s is seed + s's one sample: the BMA passes' convention
            gen.manual_seed(derived_seed(seed + s, group.names[i]))
            z[j, s].normal_(generator=gen)
    if rotated:
        return perturbations(z, hess, None, None, group.ess, group.weight_decay)
    out = perturbations(z, hess, q_left, q_right, group.ess, group.weight_decay)
    for j, i in enumerate(members):
        if pruned and group.names[i] in pruned:
            out[j] = zero_entries(out[j], pruned[group.names[i]], 1)
    return out


def perturbations(
    z: Tensor, hess: Tensor, q_left: Tensor | None, q_right: Tensor | None, ess: float, weight_decay: float
) -> Tensor:
    """``Q_L (z_s ⊙ √V) Q_Rᵀ`` for ``z`` of shape ``(B, S, m, n)``: S samples of B matrices.

    The math of ``linalg.sample_perturbation``, without broadcasting Q over S, which would copy
    every basis S times (7 GB for 8 samples of GPT-2 small's 3072×3072 bases): each basis multiplies
    each sample in turn, a product the size of one sample's, so that each rounds as ``sampled()``'s
    one sample does (BLAS rounds a product S times as wide or as tall otherwise).
    """
    b, s, m, n = z.shape
    with exact_float32_matmul():
        x = z * rotated_std(hess, ess, weight_decay).unsqueeze(1)
        if q_left is not None or q_right is not None:  # Q_L @ X_k @ Q_Rᵀ, sample by sample
            x = torch.stack([unrotate(x[:, k], q_left, q_right) for k in range(s)], dim=1)
    return x


def polar_step(q: Tensor) -> Tensor:
    """One Newton–Schulz step towards the nearest orthonormal matrix: ``Q (3I − QᵀQ) / 2``."""
    with exact_float32_matmul():
        gram = q.mT @ q
        eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
        return q @ (1.5 * eye - 0.5 * gram)


def orthonormal_tolerance(stored: torch.dtype, hess: torch.dtype) -> float:
    """The ``orthonormality_error`` a load allows a basis stored in ``stored`` beside a ``hess`` of dtype
    ``hess``: the basis is read into buffers of float64 (a float64 ``hess``) or float32 and measured
    there, so the looser of the two dtypes' bounds applies."""
    held = torch.float64 if hess == torch.float64 else torch.float32
    return max(ORTHONORMAL_TOL.get(stored, 1e-3), ORTHONORMAL_TOL.get(held, 1e-3))


def coarser(a: torch.dtype | None, b: torch.dtype) -> torch.dtype:
    """The less precise of two float dtypes (``b`` where ``a`` is None)."""
    return b if a is None or torch.finfo(b).eps >= torch.finfo(a).eps else a


def upcast_bases(q: Tensor, dtype: torch.dtype, held: torch.dtype, hess: torch.dtype) -> Tensor:
    """``q`` (a basis or a stack of them) cast to ``dtype``, each basis orthonormal within what a load
    of it beside a ``hess`` of that dtype allows (``orthonormal_tolerance``).

    Bases that hold only ``held``'s precision (bfloat16 bases read into float32) carry its rounding,
    which a finer ``dtype``'s check refuses: where a basis exceeds that check it becomes its polar
    factor (Newton–Schulz steps in float64), then cast. Any other basis is what ``q.to(dtype)`` gives,
    bit for bit, and a cast to a ``dtype`` no finer than ``held`` measures nothing.
    """
    if torch.finfo(dtype).eps >= torch.finfo(held).eps:
        return q.to(dtype)
    out = q.to(dtype, copy=True)  # never ``q`` itself, which other posteriors may share
    tol = orthonormal_tolerance(dtype, hess)
    for index in itertools.product(*map(range, q.shape[:-2])):
        if orthonormality_error(out[index]) > tol:
            out[index] = _polar_factor(q[index].to(torch.float64)).to(dtype)
    return out


def _polar_factor(q: Tensor, max_steps: int = 8) -> Tensor:
    """Newton–Schulz steps towards the orthonormal matrix nearest ``q`` while they bring it closer (each
    squares the error of a near-orthonormal ``q``: bfloat16's 3e-3 reaches float64's rounding in 3 steps)."""
    err = orthonormality_error(q)
    for _ in range(max_steps):
        if err < 1e-13:
            break
        step = polar_step(q)
        step_err = orthonormality_error(step)
        if not step_err < err:
            break
        q, err = step, step_err
    return q


# A basis is kept when its side is at most this many times the other side: its k×k entries
# then cost at most this many times the weight's own m×n. Wider sides (the d×d input side of
# an r×d LoRA matrix, 48× for MiniLM; GPT-2's 4d×4d MLP side, 4×) hold most of a full
# posterior's bytes; dropping them keeps every marginal variance (see ``drop_wide_bases``).
# EVON's steps keep bases up to its ``max_precond_ratio`` (128), with the same rule.
DEFAULT_MAX_BASIS_RATIO = 3.0


def drop_wide_bases(group: FactorGroup, max_basis_ratio: float) -> FactorGroup:
    """The identity instead of a basis whose side is over ``max_basis_ratio`` × the other side.

    ``H`` is re-expressed on that side so that every marginal variance stays exactly what it
    was (only correlations along the dropped side are lost). For the right side, with
    ``V = 1/(ζ(H + δ))``, the new variance is ``V' = V (Q_R ⊙ Q_R)ᵀ``, i.e.
    ``H' + δ = 1 / ((H + δ)⁻¹ (Q_R ⊙ Q_R)ᵀ)``: a Q_R²-weighted harmonic mean of ``H + δ`` (rows
    of ``Q_R ⊙ Q_R`` sum to 1), independent of ζ, so ``with_ess`` stays exact. The left side
    is the transpose. Marginals ``Var(W) = Q_L² V Q_R²ᵀ`` are then unchanged.
    """
    wide_left, wide_right = wide_sides(group.m, group.n, max_basis_ratio)
    left, right = group.q_left is not None and wide_left, group.q_right is not None and wide_right
    if not (left or right):
        return group
    members = range(group.hess.shape[0])  # one member's float64 temporaries at a time, not the stack's
    hess = torch.stack([
        _marginal_hess(group.hess[b], group.q_left[b] if left else None, group.q_right[b] if right else None, group.weight_decay)
        for b in members
    ])  # fmt: skip
    return replace(group, hess=hess, q_left=None if left else group.q_left, q_right=None if right else group.q_right)


def drop_wide_basis(factors: MatrixFactors, max_basis_ratio: float) -> MatrixFactors:
    """:func:`drop_wide_bases` of one parameter's factors, before they are stacked: the dropped basis is
    never copied (``EVONPosterior.from_optimizer`` reads the optimizer's live views)."""
    wide_left, wide_right = wide_sides(*factors.matrix_shape, max_basis_ratio)
    left, right = factors.Q_L is not None and wide_left, factors.Q_R is not None and wide_right
    if not (left or right):
        return factors
    hess = _marginal_hess(factors.hess, factors.Q_L if left else None, factors.Q_R if right else None, factors.weight_decay)
    return replace(factors, hess=hess, Q_L=None if left else factors.Q_L, Q_R=None if right else factors.Q_R)


def _marginal_hess(hess: Tensor, q_left: Tensor | None, q_right: Tensor | None, weight_decay: float) -> Tensor:
    """One matrix's ``H`` re-expressed without ``q_left`` and/or ``q_right`` (:func:`drop_wide_bases`)."""
    wide = torch.float64  # the harmonic mean in float64: H spans many decades
    inv = 1.0 / (hess.to(wide) + weight_decay)
    with exact_float32_matmul():
        if q_right is not None:
            inv = inv @ q_right.to(wide).square().mT
        if q_left is not None:
            inv = q_left.to(wide).square() @ inv
    return (1.0 / inv - weight_decay).to(hess.dtype)
