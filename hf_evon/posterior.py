"""EVON posteriors ("SOAP-Bubbles") as standalone objects: sample, inspect, save, load, share.

An :class:`EVONPosterior` is a snapshot of the Gaussian weight posterior an ``EVON``
optimizer has learned, keyed by the model's own parameter names, so it can be used without
the optimizer: sampled into a model (``with posterior.sampled(model): ...``), drawn as a
batch of perturbations (``posterior.draw(S)``), inspected (``std``, ``covariance``),
saved next to the model (``save_pretrained``), loaded (``from_pretrained``) and shared on
the Hub (``push_to_hub``).

For each covered matrix ``W`` (shape ``m×n`` after EVON's reshape) the posterior is::

    vec W ~ N(vec M, (Q_L ⊗ Q_R) diag(vec V) (Q_L ⊗ Q_R)ᵀ),   V = 1 / (ζ (H + δ))

(row-major ``vec``), ``M`` being the model's current weight (the mean), ``Q_L``/``Q_R`` the
eigenbases (identity where absent), ``H`` the rotated-space Hessian, ``ζ`` the effective
sample size ``ess`` and ``δ`` the weight decay. Parameters EVON does not own (embeddings,
heads, 1-D tensors when grouped with ``build_param_groups``) are point estimates.

File format (version 1)
-----------------------
A posterior checkpoint is two files in one directory (or Hub repo folder); nothing else in
the directory is read, written or deleted, except ``README.md`` (the model card), which is
created or *updated* (metadata merged, an EVON section replaced or appended), never
replaced wholesale.

``evon_posterior.safetensors`` (safetensors only: loading never unpickles anything)
    For each covered parameter ``<name>`` (exactly as in ``model.named_parameters()``):

    * ``<name>.hess``: ``H``, shape ``(m, n)``, float32 (float64 for float64 parameters);
    * ``<name>.Q_L``: ``(m, m)`` orthonormal, absent where the left basis is the identity;
    * ``<name>.Q_R``: ``(n, n)`` orthonormal, absent where the right basis is the identity.

    ``Q_L``/``Q_R`` are stored in float32, or in bfloat16/float16 with
    ``save_pretrained(..., eigenbasis_dtype=torch.bfloat16)`` (about half the file). The
    header metadata holds ``format_version`` and a ``checkpoint_id`` shared with the JSON.

``evon_posterior_config.json``
    ``format_version`` (1), ``library``/``library_version``, ``checkpoint_id``, ``ess``
    and ``weight_decay`` (``"inf"`` encodes an infinite ess), the other EVON
    hyperparameters (``hess_init``, ``betas``, ``precondition_frequency``, ``mc_samples``,
    ``max_precond_dim``, ``shampoo_beta``, ``hess_clip_ratio``, ``clip``, ``clip_radius``,
    ``phased_gradients``, ``identity_basis``, ``lr`` — the scheduler's ``initial_lr`` when
    there is one, with the rate at save time as ``final_lr`` — ... as present), ``optimizer_step``,
    ``eigenbasis_dtype``, ``hess_dtype``, ``base_model``, ``model_class``,
    ``num_point_estimates`` / ``num_point_estimate_tensors`` (model parameters and tensors
    without a posterior) and ``parameters``: for each covered name, in sorted order,
    ``{"shape": [...], "matrix_shape": [m, n], "left_basis": bool, "right_basis": bool}``,
    plus ``ess``/``weight_decay`` where a parameter's group differs from the top level.
    The parameter is reshaped row-major: ``W.reshape(m, n)`` (1-D as ``1×d``, N-D as
    ``(d0, rest)``, as ``hf_evon.optim.evon.matrix_shape``).

Loading checks everything and raises :class:`PosteriorMismatchError` naming the offending
tensor: unknown or newer ``format_version``, a weights file from another save, missing or
unexpected tensors, shapes that do not match the declared ones, non-float or non-finite
values, ``hess`` negative (or zero where ``weight_decay`` is 0: infinite variance), an
eigenbasis that is not orthonormal (``‖QᵀQx − x‖ ≤ tol·‖x‖`` on random probes, ``tol``
set by the stored dtype). Half-precision eigenbases are upcast to float32 *as stored*
(GPT-2 small: ‖QᵀQx − x‖/‖x‖ ≤ 3e-3 for bfloat16, 3e-4 for float16, 1.5e-6 for float32):
no re-orthonormalisation by default, because
``Q diag(V) Qᵀ`` is still a valid covariance close to the saved one, and a QR of every
basis would cost seconds per GPT-2-sized model; ``from_pretrained(...,
reorthonormalize=True)`` applies one Newton–Schulz polar step ``Q ← Q (3I − QᵀQ) / 2``.

Writes are atomic: both files are written to temporary files in the target directory and
moved into place with ``os.replace``; an error on the way (including while moving the
second file) restores the previous checkpoint, and a reader that meets a mixed pair
(e.g. after a power loss) is stopped by the ``checkpoint_id`` check.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .optim.evon import derived_seed, matrix_shape
from .optim.linalg import dense_covariance, exact_float32_matmul, marginal_variance, unrotate

Tensor = torch.Tensor

__all__ = [
    "FORMAT_VERSION",
    "POSTERIOR_CONFIG_NAME",
    "POSTERIOR_WEIGHTS_NAME",
    "EVONPosterior",
    "MatrixFactors",
    "PosteriorMismatchError",
]

FORMAT_VERSION = 1
POSTERIOR_WEIGHTS_NAME = "evon_posterior.safetensors"
POSTERIOR_CONFIG_NAME = "evon_posterior_config.json"
MAX_DENSE_COVARIANCE_ELEMENTS = 4096

# EVON group entries recorded as hyperparameters (those present in the optimizer's group)
_HYPERPARAMETER_KEYS = (
    "lr",
    "ess",
    "weight_decay",
    "hess_init",
    "betas",
    "mc_samples",
    "precondition_frequency",
    "max_precond_dim",
    "shampoo_beta",
    "hess_clip_ratio",
    "clip",
    "clip_radius",
    "phased_gradients",
    "identity_basis",
    "stagger_refresh",
    "eps",
)
_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# ‖QᵀQx − x‖ / ‖x‖ allowed on load, by the dtype the basis was stored in. Rounding a basis
# to a format with unit roundoff u moves it by ~u/√3 per direction (see the benchmark):
# these bounds are ~10x that, and far below what a wrong or corrupted basis gives.
_ORTHONORMAL_TOL = {
    torch.float64: 1e-6,
    torch.float32: 1e-3,
    torch.float16: 1e-2,
    torch.bfloat16: 6e-2,
}
_HUB_DOWNLOAD_KWARGS = ("force_download", "endpoint", "etag_timeout", "headers", "user_agent")


class PosteriorMismatchError(ValueError):
    """A posterior does not fit a model, or a posterior file is invalid.

    The message always names the offending tensor (or config field), so a mismatch is
    never silently skipped.
    """


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
        return 1.0 / (self.ess * (self.hess.to(_compute_dtype(self.hess)) + self.weight_decay))


@dataclass
class _Group:
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

    def map_tensors(self, fn: Any) -> _Group:
        return replace(
            self,
            q_left=None if self.q_left is None else fn(self.q_left),
            q_right=None if self.q_right is None else fn(self.q_right),
            hess=fn(self.hess),
        )


def _compute_dtype(t: Tensor) -> torch.dtype:
    """The eigenbasis math runs in float32 (float64 stays float64)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _resolve_seed(seed: int | None) -> int:
    """``None`` takes a seed from torch's global RNG, so ``torch.manual_seed`` reproduces it."""
    if seed is None:
        return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
    return int(seed)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _json_value(value: Any) -> Any:
    """JSON-safe copy: tuples become lists, infinities the strings "inf"/"-inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, tuple | list):
        return [_json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return _dtype_name(value)
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return str(value)


def _number(value: Any, field: str) -> float:
    """A float from the JSON config ("inf" allowed), or a mismatch error naming the field."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise PosteriorMismatchError(f"config field {field!r} must be a number; got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise PosteriorMismatchError(f"config field {field!r} must be a number; got {value!r}") from None


def _check_noise_scale(ess: float, weight_decay: float, where: str) -> None:
    if not ess > 0.0:
        raise PosteriorMismatchError(f"{where}: ess must be > 0 (inf for no noise); got {ess!r}")
    if not (weight_decay >= 0.0 and math.isfinite(weight_decay)):
        raise PosteriorMismatchError(f"{where}: weight_decay must be finite and >= 0; got {weight_decay!r}")


def _orthonormality_error(q: Tensor, probes: int = 2) -> float:
    """``max ‖QᵀQx − x‖ / ‖x‖`` over fixed random probes: O(k n²) instead of O(n³)."""
    q32 = q.to(_compute_dtype(q))
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(q.shape[-1], probes, generator=gen, dtype=q32.dtype).to(q32.device)
    with exact_float32_matmul():
        residual = ((q32 @ x).mT @ q32).mT - x  # QᵀQx without transposing Q
    return float((residual.norm(dim=0) / x.norm(dim=0)).max())


def _perturbations(
    z: Tensor, hess: Tensor, q_left: Tensor | None, q_right: Tensor | None, ess: float, weight_decay: float
) -> Tensor:
    """``Q_L (z_s ⊙ √V) Q_Rᵀ`` for ``z`` of shape ``(B, S, m, n)``: S samples of B matrices.

    The math of ``linalg.sample_perturbation``, arranged so that all S samples of a matrix
    share one batched matmul per side: samples are folded into the columns (left basis) or
    rows (right basis) instead of broadcasting Q over S, which would copy every basis S
    times (7 GB for 8 samples of GPT-2 small's 3072×3072 bases).
    """
    b, s, m, n = z.shape
    x = z * torch.rsqrt(ess * (hess + weight_decay)).unsqueeze(1)
    with exact_float32_matmul():
        if q_left is not None:  # Q_L @ [X_1 … X_S] as one (m, S·n) block per matrix
            x = unrotate(x.transpose(1, 2).reshape(b, m, s * n), q_left, None)
            x = x.reshape(b, m, s, n).transpose(1, 2)
        if q_right is not None:  # [X_1; …; X_S] @ Q_Rᵀ as one (S·m, n) block per matrix
            x = unrotate(x.reshape(b, s * m, n), None, q_right)
    return x.reshape(b, s, m, n)


def _polar_step(q: Tensor) -> Tensor:
    """One Newton–Schulz step towards the nearest orthonormal matrix: ``Q (3I − QᵀQ) / 2``."""
    with exact_float32_matmul():
        gram = q.mT @ q
        eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
        return q @ (1.5 * eye - 0.5 * gram)


def _fsync_write(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _temp_path(directory: str, final_name: str) -> str:
    return os.path.join(directory, f".{final_name}.{uuid.uuid4().hex}.tmp")


def _commit_files(pairs: list[tuple[str, str]]) -> None:
    """Move each temporary file onto its final path; on any error restore the previous files.

    Previous files are kept (hard link, or copy) until every move succeeded, so an error
    while moving the second file puts the first one back: the directory then holds the
    previous checkpoint, byte for byte. Temporary and backup files never remain.
    """
    backups: list[tuple[str, str | None]] = []  # (final, backup or None if it did not exist)
    moved: list[tuple[str, str | None]] = []
    try:
        for _, final in pairs:
            if os.path.exists(final):
                backup = _temp_path(os.path.dirname(final), os.path.basename(final) + ".bak")
                try:
                    os.link(final, backup)
                except OSError:
                    shutil.copy2(final, backup)
                backups.append((final, backup))
            else:
                backups.append((final, None))
        for (tmp, final), entry in zip(pairs, backups):
            os.replace(tmp, final)
            moved.append(entry)
    except BaseException:
        for final, backup in reversed(moved):
            with contextlib.suppress(OSError):
                if backup is None:
                    os.remove(final)
                else:
                    os.replace(backup, final)
        raise
    finally:
        for tmp, _ in pairs:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        for _, backup in backups:
            if backup is not None:
                with contextlib.suppress(OSError):
                    os.remove(backup)


class EVONPosterior:
    """The SOAP-Bubble posterior of an EVON-trained model, usable without the optimizer.

    Build it with :meth:`from_optimizer` (a snapshot: later training does not change it) or
    :meth:`from_pretrained`. It covers exactly the EVON-owned parameters, keyed by the
    model's parameter names; every other model parameter is a point estimate. The mean is
    not stored: it is the model's weights, so a posterior is used together with its model.

    Attributes:
        names: covered parameter names, sorted.
        ess: effective sample size ζ (``inf``: no noise).
        weight_decay: prior precision per datum δ.
        config: hyperparameters and bookkeeping (``format_version``, ``eigenbasis_dtype``...).
        num_point_estimates: number of model parameters (scalars) without a posterior.
        num_point_estimate_tensors: number of model tensors without a posterior.
    """

    def __init__(
        self,
        groups: list[_Group],
        config: dict[str, Any],
        num_point_estimates: int | None = None,
        num_point_estimate_tensors: int | None = None,
    ) -> None:
        if not groups:
            raise ValueError("an EVONPosterior needs at least one covered parameter")
        self._groups = groups
        self._index: dict[str, tuple[int, int]] = {
            name: (gi, i) for gi, g in enumerate(groups) for i, name in enumerate(g.names)
        }
        self.names: list[str] = sorted(self._index)
        self.config: dict[str, Any] = dict(config)
        self.num_point_estimates = num_point_estimates
        self.num_point_estimate_tensors = num_point_estimate_tensors

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_optimizer(cls, optimizer: Any, model: nn.Module) -> EVONPosterior:
        """Snapshot the posterior of every EVON-owned parameter of ``optimizer``.

        Parameters are matched to ``model.named_parameters()`` by identity, so names are the
        model's own (for a ``PeftModel`` e.g. ``base_model.model....lora_A.default.weight``).
        Factors are copied: the posterior does not change when training continues. Wrappers
        (accelerate's ``AcceleratedOptimizer``, ``(Distributed)DataParallel``) are unwrapped.
        """
        optimizer = _unwrap_optimizer(optimizer)
        model = _unwrap_model(model)
        named = list(model.named_parameters())
        names_by_id = {id(p): name for name, p in named}
        evon_groups = [g for g in optimizer.param_groups if g.get("algorithm", "evon") == "evon"]
        entries: list[tuple[str, Tensor, dict[str, Any]]] = []
        seen: set[int] = set()
        for gi, group in enumerate(evon_groups):
            labels = group.get("param_names")
            for i, p in enumerate(group["params"]):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if id(p) not in names_by_id:
                    label = labels[i] if labels else f"EVON group {gi}, parameter {i}"
                    raise PosteriorMismatchError(
                        f"{label} (shape {tuple(p.shape)}) is trained by EVON but is not a parameter of "
                        f"the given {type(model).__name__}: pass the model the optimizer was built for"
                    )
                entries.append((names_by_id[id(p)], p, optimizer.posterior_factors(p)))
        if not entries:
            raise ValueError("the optimizer has no EVON-owned parameters: there is no posterior to take")
        factors: dict[str, MatrixFactors] = {}
        for name, p, f in entries:  # views of the live state: from_factors stacks them into copies
            factors[name] = MatrixFactors(
                Q_L=None if f["Q_L"] is None else f["Q_L"].detach(),
                Q_R=None if f["Q_R"] is None else f["Q_R"].detach(),
                hess=f["hess"].detach(),
                shape=tuple(int(s) for s in p.shape),
                matrix_shape=tuple(int(s) for s in f.get("matrix_shape", matrix_shape(p.shape))),
                ess=float(f["ess"]),
                weight_decay=float(f["weight_decay"]),
            )
        first = evon_groups[0]
        config = {k: first[k] for k in _HYPERPARAMETER_KEYS if k in first}
        if "initial_lr" in first:  # under an LR scheduler: the configured (peak) rate, not today's
            config["lr"], config["final_lr"] = first["initial_lr"], first["lr"]
        if "betas" in config:
            config["betas"] = tuple(config["betas"])
        steps = [optimizer.state.get(p, {}).get("step") for _, p, _ in entries]
        step = next((s for s in steps if s is not None), None)
        config["optimizer_step"] = (
            int(step.item() if torch.is_tensor(step) else step) if step is not None else 0
        )
        config["base_model"] = _base_model_name(model)
        config["model_class"] = type(model).__name__
        covered = {id(p) for _, p, _ in entries}
        points = [p for _, p in named if id(p) not in covered]
        return cls.from_factors(
            factors,
            config,
            num_point_estimates=sum(p.numel() for p in points),
            num_point_estimate_tensors=len(points),
        )

    @classmethod
    def from_factors(
        cls,
        factors: Mapping[str, MatrixFactors],
        config: Mapping[str, Any] | None = None,
        num_point_estimates: int | None = None,
        num_point_estimate_tensors: int | None = None,
    ) -> EVONPosterior:
        """A posterior from explicit per-parameter factors (tests, benchmarks, conversions).

        Shapes are checked here; orthonormality and positivity are the caller's business
        (they are checked when the posterior is loaded from files).
        """
        if not factors:
            raise ValueError("an EVONPosterior needs at least one covered parameter")
        for name, f in factors.items():
            m, n = f.matrix_shape
            if tuple(f.matrix_shape) != matrix_shape(f.shape):
                raise PosteriorMismatchError(
                    f"{name!r}: matrix_shape {f.matrix_shape} does not match shape {f.shape}"
                )
            for label, t, want in (("hess", f.hess, (m, n)), ("Q_L", f.Q_L, (m, m)), ("Q_R", f.Q_R, (n, n))):
                if t is not None and tuple(t.shape) != want:
                    raise PosteriorMismatchError(
                        f"'{name}.{label}' has shape {tuple(t.shape)}; expected {want}"
                    )
        buckets: dict[tuple, list[str]] = {}
        for name in sorted(factors):
            f = factors[name]
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
                _Group(
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
        config = dict(config or {})
        config["format_version"] = FORMAT_VERSION
        some = factors[next(iter(factors))]
        basis = next(
            (
                f.Q_L if f.Q_L is not None else f.Q_R
                for f in factors.values()
                if f.Q_L is not None or f.Q_R is not None
            ),
            None,
        )
        config["eigenbasis_dtype"] = _dtype_name(basis.dtype if basis is not None else some.hess.dtype)
        config.setdefault("ess", some.ess)
        config.setdefault("weight_decay", some.weight_decay)
        return cls(groups, config, num_point_estimates, num_point_estimate_tensors)

    # ------------------------------------------------------------------ inspection
    @property
    def ess(self) -> float:
        """Effective sample size ζ (the top-level one; see ``factors`` for per-parameter values)."""
        return float(self.config["ess"])

    @property
    def weight_decay(self) -> float:
        """Prior precision per datum δ (the prior is ``N(0, (ζ δ)⁻¹ I)``)."""
        return float(self.config["weight_decay"])

    @property
    def factors(self) -> dict[str, MatrixFactors]:
        """Per covered name: ``Q_L``, ``Q_R`` (None = identity), ``hess``, shapes, ess, weight decay."""
        return {name: self[name] for name in self.names}

    @property
    def num_covered(self) -> int:
        """Number of scalar parameters with a posterior."""
        return sum(math.prod(s) for g in self._groups for s in g.shapes)

    def __getitem__(self, name: str) -> MatrixFactors:
        if name not in self._index:
            raise KeyError(f"{name!r} is not covered by this posterior")
        gi, i = self._index[name]
        return self._groups[gi].factors(i)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __repr__(self) -> str:
        if self.num_point_estimates is None:
            points = "point estimates unknown"
        else:
            points = (
                f"{self.num_point_estimate_tensors} tensors / {self.num_point_estimates:,} parameters "
                "are point estimates"
            )
        return (
            f"EVONPosterior(covers {len(self.names)} tensors / {self.num_covered:,} parameters; {points}; "
            f"ess={self.ess:g}, weight_decay={self.weight_decay:g}, "
            f"eigenbasis_dtype={self.config.get('eigenbasis_dtype')})"
        )

    def std(self, name: str) -> Tensor:
        """Marginal posterior standard deviations of ``name``, shaped like the parameter."""
        f = self[name]
        return self._marginal_variance(f).sqrt().reshape(f.shape)

    def covariance(self, name: str, max_elements: int = MAX_DENSE_COVARIANCE_ELEMENTS) -> Tensor:
        """Dense covariance of the row-major flatten of ``name`` (small parameters only)."""
        f = self[name]
        numel = math.prod(f.shape)
        if numel > max_elements:
            raise ValueError(
                f"{name!r} has {numel} elements: its dense covariance would be {numel}×{numel}; "
                f"covariance() is for parameters with at most {max_elements} elements "
                "(pass max_elements to override, or use std() / draw())"
            )
        dt = _compute_dtype(f.hess)
        return dense_covariance(f.hess.to(dt), *self._bases(f, dt, f.hess.device), f.ess, f.weight_decay)

    def _marginal_variance(self, f: MatrixFactors) -> Tensor:
        dt = _compute_dtype(f.hess)
        return marginal_variance(f.hess.to(dt), *self._bases(f, dt, f.hess.device), f.ess, f.weight_decay)

    @staticmethod
    def _bases(f: MatrixFactors, dtype: torch.dtype, device: Any) -> tuple[Tensor | None, Tensor | None]:
        # contiguous: torch.kron (in dense_covariance) fails on strided views
        return tuple(
            None if q is None else q.to(device=device, dtype=dtype).contiguous() for q in (f.Q_L, f.Q_R)
        )  # type: ignore[return-value]

    # ------------------------------------------------------------------ sampling
    def draw(
        self,
        num_samples: int,
        seed: int | None = None,
        names: Iterable[str] | str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        rotated: bool = False,
    ) -> dict[str, Tensor]:
        """Draw perturbations ``W_s − M`` without touching any model.

        Returns ``{name: (S, *param_shape)}``. Each parameter's noise comes from its own
        generator seeded by ``(seed, name)``, so the same seed gives the same values for a
        parameter whatever subset is drawn (on the same device type). Math in float32;
        ``dtype`` casts the result. ``seed=None`` takes a seed from torch's global RNG.
        ``rotated=True`` returns the same draws before the bases are applied,
        ``E_s = z_s ⊙ √V`` shaped ``(S, m, n)`` (``W_s − M = Q_L E_s Q_Rᵀ``): no matmuls, for code
        that applies the bases to activations instead of to the weights.
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an integer >= 1; got {num_samples!r}")
        seed = _resolve_seed(seed)
        wanted = self._select(names)
        out: dict[str, Tensor] = {}
        for group in self._groups:
            idx = [i for i, name in enumerate(group.names) if name in wanted]
            if not idx:
                continue
            dev = torch.device(device) if device is not None else group.hess.device
            dt = _compute_dtype(group.hess)

            def take(
                t: Tensor | None, idx: list[int] = idx, dev: torch.device = dev, dt: torch.dtype = dt
            ) -> Tensor | None:
                if t is None:
                    return None
                if len(idx) != t.shape[0]:
                    t = t[torch.tensor(idx, device=t.device)]
                return t.to(device=dev, dtype=dt)

            hess, q_left, q_right = take(group.hess), take(group.q_left), take(group.q_right)
            z = torch.empty(len(idx), num_samples, group.m, group.n, device=dev, dtype=dt)
            for j, i in enumerate(idx):
                gen = torch.Generator(device=dev)
                gen.manual_seed(derived_seed(seed, group.names[i]))  # independent of the names drawn with it
                z[j].normal_(generator=gen)
            if rotated:  # E_s: the same draws, bases left for the caller to apply
                q_left = q_right = None
            noise = _perturbations(z, hess, q_left, q_right, group.ess, group.weight_decay)
            for j, i in enumerate(idx):
                value = noise[j] if rotated else noise[j].reshape(num_samples, *group.shapes[i])
                out[group.names[i]] = value if dtype is None else value.to(dtype)
        return {name: out[name] for name in self.names if name in out}

    def _select(self, names: Iterable[str] | str | None) -> set[str]:
        if names is None:
            return set(self.names)
        names = [names] if isinstance(names, str) else list(names)
        unknown = [n for n in names if n not in self._index]
        if unknown:
            raise KeyError(f"not covered by this posterior: {unknown[:5]}")
        return set(names)

    @contextlib.contextmanager
    def sampled(self, model: nn.Module, seed: int | None = None) -> Iterator[nn.Module]:
        """Put one posterior sample into ``model`` for the enclosed code.

        The model is checked first (:meth:`check_model`). On exit, also on an exception,
        every covered weight gets its exact previous value back (bit for bit). Point
        estimates are untouched. ``(M + ΔW)`` is formed in float32 and cast to the
        parameter's dtype.
        """
        self.check_model(model)
        params = dict(_unwrap_model(model).named_parameters(remove_duplicate=False))
        seed = _resolve_seed(seed)
        by_device: dict[torch.device, list[str]] = {}
        for name in self.names:
            by_device.setdefault(params[name].device, []).append(name)
        saved: list[tuple[Tensor, Tensor]] = []
        try:
            with torch.no_grad():
                for dev, names in by_device.items():
                    draws = self.draw(1, seed=seed, names=names, device=dev)
                    for name in names:
                        p = params[name]
                        mean = p.detach().clone()
                        saved.append((p, mean))
                        delta = draws.pop(name)[0]
                        p.copy_((mean.to(delta.dtype) + delta).to(p.dtype))
            yield model
        finally:
            with torch.no_grad():
                for p, mean in reversed(saved):
                    p.copy_(mean)

    # ------------------------------------------------------------------ checks
    def check_model(self, model: nn.Module) -> None:
        """Raise :class:`PosteriorMismatchError` naming each covered tensor the model lacks or mis-shapes."""
        params = dict(_unwrap_model(model).named_parameters(remove_duplicate=False))
        problems = []
        for name in self.names:
            f = self[name]
            p = params.get(name)
            if p is None:
                problems.append(f"{name!r} is not a parameter of the model{_name_hint(name, params)}")
            elif tuple(p.shape) != f.shape:
                problems.append(
                    f"{name!r} has shape {tuple(p.shape)} in the model but {f.shape} in the posterior"
                )
            elif not p.is_floating_point():
                problems.append(
                    f"{name!r} has dtype {p.dtype} in the model; a posterior needs a float parameter"
                )
        if problems:
            more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
            raise PosteriorMismatchError(
                f"this EVON posterior does not fit the given {type(model).__name__}: "
                + "; ".join(problems[:5])
                + more
            )

    # ------------------------------------------------------------------ variants
    def with_ess(self, ess: float) -> EVONPosterior:
        """A copy with effective sample size ``ess`` everywhere (``inf``: zero variance).

        Variances scale as ``1/ess``: a larger ζ narrows the posterior (tempering).
        """
        ess = float(ess)
        _check_noise_scale(ess, self.weight_decay, "with_ess")
        groups = [replace(g, ess=ess) for g in self._groups]
        config = dict(self.config, ess=ess)
        return EVONPosterior(groups, config, self.num_point_estimates, self.num_point_estimate_tensors)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> EVONPosterior:
        """A copy with factors on ``device`` and/or stored in ``dtype`` (math stays float32)."""
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype; got {dtype}")
        groups = [g.map_tensors(lambda t: t.to(device=device, dtype=dtype)) for g in self._groups]
        config = dict(self.config)
        if dtype is not None:
            config["eigenbasis_dtype"] = _dtype_name(dtype)
        return EVONPosterior(groups, config, self.num_point_estimates, self.num_point_estimate_tensors)

    def __copy__(self) -> EVONPosterior:
        return EVONPosterior(
            list(self._groups), dict(self.config), self.num_point_estimates, self.num_point_estimate_tensors
        )

    def __deepcopy__(self, memo: dict) -> EVONPosterior:
        groups = [g.map_tensors(lambda t: t.clone()) for g in self._groups]
        return EVONPosterior(
            groups,
            copy.deepcopy(self.config, memo),
            self.num_point_estimates,
            self.num_point_estimate_tensors,
        )

    # ------------------------------------------------------------------ files
    def to_tensors(self, eigenbasis_dtype: torch.dtype | str | None = None) -> dict[str, Tensor]:
        """The file's tensors: ``<name>.Q_L``, ``<name>.Q_R``, ``<name>.hess`` (CPU, contiguous)."""
        eig = _as_dtype(eigenbasis_dtype)
        if eig is not None and eig not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise ValueError(f"eigenbasis_dtype must be float32, bfloat16 or float16; got {eig}")
        tensors: dict[str, Tensor] = {}
        for name in self.names:
            f = self[name]
            for key, q in (("Q_L", f.Q_L), ("Q_R", f.Q_R)):
                if q is not None:
                    tensors[f"{name}.{key}"] = (
                        q.detach().to("cpu", dtype=eig or q.dtype, copy=True).contiguous()
                    )
            # copies: the factors are views into stacked buffers, which safetensors refuses to save
            tensors[f"{name}.hess"] = f.hess.detach().to("cpu", copy=True).contiguous()
        return tensors

    def _basis_dtype(self) -> torch.dtype:
        """The dtype the bases are held in now (the Hessian's where every basis is the identity)."""
        for g in self._groups:
            for q in (g.q_left, g.q_right):
                if q is not None:
                    return q.dtype
        return self._groups[0].hess.dtype

    def _file_config(self, eigenbasis_dtype: torch.dtype | None, checkpoint_id: str) -> dict[str, Any]:
        from . import __version__

        config = {k: v for k, v in self.config.items() if k not in ("format_version", "parameters")}
        hess_dtype = self._groups[0].hess.dtype
        config.update(
            format_version=FORMAT_VERSION,
            library="hf-evon",
            library_version=__version__,
            checkpoint_id=checkpoint_id,
            ess=self.ess,
            weight_decay=self.weight_decay,
            eigenbasis_dtype=_dtype_name(eigenbasis_dtype or self._basis_dtype()),
            hess_dtype=_dtype_name(hess_dtype),
            num_point_estimates=self.num_point_estimates,
            num_point_estimate_tensors=self.num_point_estimate_tensors,
        )
        parameters = {}
        for name in self.names:
            f = self[name]
            entry: dict[str, Any] = {
                "shape": list(f.shape),
                "matrix_shape": list(f.matrix_shape),
                "left_basis": f.Q_L is not None,
                "right_basis": f.Q_R is not None,
            }
            if f.ess != self.ess:
                entry["ess"] = f.ess
            if f.weight_decay != self.weight_decay:
                entry["weight_decay"] = f.weight_decay
            parameters[name] = entry
        config["parameters"] = parameters
        return _json_value(config)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        eigenbasis_dtype: torch.dtype | None = None,
        push_to_hub: bool = False,
        **kwargs: Any,
    ) -> None:
        """Write ``evon_posterior.safetensors`` + ``evon_posterior_config.json`` (+ model card).

        Safe beside a model: only these two files and ``README.md`` (updated, not replaced)
        are touched. Atomic: a failed save leaves the previous checkpoint intact.

        Args:
            save_directory: the directory (created if needed), e.g. the model's or adapter's.
            eigenbasis_dtype: ``torch.bfloat16``/``torch.float16`` stores ``Q_L``/``Q_R`` in
                half precision (about half the file); ``H`` always stays float32.
            push_to_hub: afterwards also :meth:`push_to_hub` (``repo_id`` defaults to the
                directory's name; other keyword arguments are passed on).
            model_card (kwarg, default True): create/update ``README.md``.
            model_card_kwargs (kwarg): passed to ``hf_evon.model_card.save_model_card``
                (``base_model``, ``metrics``, ...).
        """
        write_card = kwargs.pop("model_card", True)
        card_kwargs = dict(kwargs.pop("model_card_kwargs", None) or {})
        push_kwargs = {}
        if push_to_hub:
            push_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _PUSH_KWARGS}
        if kwargs:
            raise TypeError(f"save_pretrained() got unexpected keyword arguments: {sorted(kwargs)}")
        directory = os.fspath(save_directory)
        if os.path.isfile(directory):
            raise ValueError(f"save_directory {directory!r} is a file, not a directory")
        os.makedirs(directory, exist_ok=True)
        eig = _as_dtype(eigenbasis_dtype)
        tensors = self.to_tensors(eig)
        checkpoint_id = uuid.uuid4().hex
        metadata = {"format": "pt", "format_version": str(FORMAT_VERSION), "checkpoint_id": checkpoint_id}
        config_bytes = (
            json.dumps(self._file_config(eig, checkpoint_id), indent=2, sort_keys=False, allow_nan=False)
            + "\n"
        ).encode()
        weights_path = os.path.join(directory, POSTERIOR_WEIGHTS_NAME)
        config_path = os.path.join(directory, POSTERIOR_CONFIG_NAME)
        tmp_weights = _temp_path(directory, POSTERIOR_WEIGHTS_NAME)
        tmp_config = _temp_path(directory, POSTERIOR_CONFIG_NAME)
        try:
            save_file(tensors, tmp_weights, metadata=metadata)
            with open(tmp_weights, "rb+") as fh:
                os.fsync(fh.fileno())
            _fsync_write(tmp_config, config_bytes)
            _commit_files([(tmp_weights, weights_path), (tmp_config, config_path)])
        finally:
            for tmp in (tmp_weights, tmp_config):
                with contextlib.suppress(OSError):
                    os.remove(tmp)
        if write_card:
            from .model_card import save_model_card

            save_model_card(directory, self, **card_kwargs)
        if push_to_hub:
            repo_id = push_kwargs.pop("repo_id", None) or os.path.basename(os.path.abspath(directory))
            push_kwargs.setdefault("model_card_kwargs", card_kwargs)
            self.push_to_hub(repo_id, eigenbasis_dtype=eig, **push_kwargs)

    @classmethod
    def from_pretrained(
        cls,
        dir_or_repo_id: str | os.PathLike,
        revision: str | None = None,
        subfolder: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        **kwargs: Any,
    ) -> EVONPosterior:
        """Load a posterior from a local directory or a Hub repo (``revision``, ``subfolder``).

        Every file is validated (see the module docstring); a problem raises
        :class:`PosteriorMismatchError` naming the tensor. Only safetensors and JSON are read.

        Keyword arguments:
            device: where to put the factors (default ``"cpu"``).
            model: if given, :meth:`check_model` is run against it.
            reorthonormalize: one Newton–Schulz polar step on every basis after loading
                (useful for half-precision bases; default False).
            force_download, endpoint, etag_timeout, headers, user_agent: passed to
                ``huggingface_hub.hf_hub_download``.
        """
        device = kwargs.pop("device", "cpu")
        model = kwargs.pop("model", None)
        reorthonormalize = bool(kwargs.pop("reorthonormalize", False))
        hub_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _HUB_DOWNLOAD_KWARGS}
        if kwargs:
            raise TypeError(f"from_pretrained() got unexpected keyword arguments: {sorted(kwargs)}")
        config_path, weights_path = _resolve_files(
            os.fspath(dir_or_repo_id), revision, subfolder, token, cache_dir, local_files_only, hub_kwargs
        )
        posterior = cls._load_files(config_path, weights_path, device, reorthonormalize)
        if model is not None:
            posterior.check_model(model)
        return posterior

    @classmethod
    def _load_files(
        cls, config_path: str, weights_path: str, device: Any, reorthonormalize: bool
    ) -> EVONPosterior:
        try:
            with open(config_path, encoding="utf-8") as fh:
                raw = json.load(fh)
        except (OSError, ValueError) as err:
            raise PosteriorMismatchError(f"{POSTERIOR_CONFIG_NAME}: cannot read the config ({err})") from err
        if not isinstance(raw, dict):
            raise PosteriorMismatchError(f"{POSTERIOR_CONFIG_NAME}: the config must be a JSON object")
        version = raw.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise PosteriorMismatchError(
                f"{POSTERIOR_CONFIG_NAME}: format_version {version!r} is not a known EVON posterior format "
                f"(this hf-evon reads version {FORMAT_VERSION})"
            )
        if version > FORMAT_VERSION:
            raise PosteriorMismatchError(
                f"{POSTERIOR_CONFIG_NAME}: format_version {version} was written by a newer hf-evon; this one "
                f"reads version {FORMAT_VERSION}: upgrade hf-evon"
            )
        ess = _number(raw.get("ess"), "ess")
        weight_decay = _number(raw.get("weight_decay"), "weight_decay")
        _check_noise_scale(ess, weight_decay, POSTERIOR_CONFIG_NAME)
        parameters = raw.get("parameters")
        if not isinstance(parameters, dict) or not parameters:
            raise PosteriorMismatchError(
                f"{POSTERIOR_CONFIG_NAME}: 'parameters' must list the covered parameters"
            )

        try:
            handle = safe_open(weights_path, framework="pt", device="cpu")
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise PosteriorMismatchError(
                f"{POSTERIOR_WEIGHTS_NAME}: not a readable safetensors file ({err})"
            ) from err
        with handle as fh:
            metadata = fh.metadata() or {}
            saved_id, config_id = metadata.get("checkpoint_id"), raw.get("checkpoint_id")
            if saved_id is not None and config_id is not None and saved_id != config_id:
                raise PosteriorMismatchError(
                    f"{POSTERIOR_WEIGHTS_NAME} (checkpoint {saved_id}) and {POSTERIOR_CONFIG_NAME} (checkpoint "
                    f"{config_id}) come from different saves; save the posterior again"
                )
            entries = [_parse_entry(name, parameters[name], ess, weight_decay) for name in sorted(parameters)]
            stored = _check_tensor_headers(fh, entries)
            groups = _read_groups(fh, entries, stored, device, reorthonormalize)
        config = {k: v for k, v in raw.items() if k != "parameters"}
        config["ess"], config["weight_decay"] = ess, weight_decay
        if isinstance(config.get("betas"), list):
            config["betas"] = tuple(config["betas"])
        config["format_version"] = FORMAT_VERSION
        return cls(groups, config, raw.get("num_point_estimates"), raw.get("num_point_estimate_tensors"))

    # ------------------------------------------------------------------ hub
    def push_to_hub(
        self,
        repo_id: str,
        commit_message: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        eigenbasis_dtype: torch.dtype | None = None,
        model_card_kwargs: dict[str, Any] | None = None,
        *,
        path_in_repo: str | None = None,
        endpoint: str | None = None,
    ) -> Any:
        """Upload the posterior (+ updated model card) to a Hub repo in one commit.

        The repo is created if needed; files already in it (the model's, an adapter's) are
        kept, and an existing ``README.md`` is updated, not replaced. ``path_in_repo`` puts
        the two posterior files in a subfolder (load with ``subfolder=``); the card stays at
        the repo root. ``revision`` commits to that branch (created if missing).
        Returns the ``huggingface_hub.CommitInfo``.
        """
        from huggingface_hub import CommitOperationAdd, HfApi, hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RevisionNotFoundError

        from .model_card import save_model_card

        api = HfApi(endpoint=endpoint, token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        if revision is not None and revision != "main" and not create_pr:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        folder = (path_in_repo or "").strip("/")
        with tempfile.TemporaryDirectory(prefix="evon_posterior_push_") as tmp:
            card_dir = os.path.join(tmp, "card")
            files_dir = os.path.join(tmp, "files")
            os.makedirs(card_dir)
            try:
                existing = hf_hub_download(
                    repo_id,
                    "README.md",
                    revision=revision,
                    token=token,
                    endpoint=api.endpoint,
                    cache_dir=os.path.join(tmp, "cache"),
                )
                shutil.copyfile(existing, os.path.join(card_dir, "README.md"))
            except (EntryNotFoundError, RevisionNotFoundError) as err:
                if isinstance(err, LocalEntryNotFoundError):  # offline: never replace a card unseen
                    raise
            self.save_pretrained(files_dir, eigenbasis_dtype=eigenbasis_dtype, model_card=False)
            card_kwargs = dict(model_card_kwargs or {})
            card_kwargs.setdefault("repo_id", repo_id)
            card_kwargs.setdefault("subfolder", folder or None)
            save_model_card(card_dir, self, **card_kwargs)
            operations = [
                CommitOperationAdd(
                    path_in_repo=f"{folder}/{fname}" if folder else fname,
                    path_or_fileobj=os.path.join(files_dir, fname),
                )
                for fname in (POSTERIOR_WEIGHTS_NAME, POSTERIOR_CONFIG_NAME)
            ]
            operations.append(
                CommitOperationAdd(
                    path_in_repo="README.md", path_or_fileobj=os.path.join(card_dir, "README.md")
                )
            )
            return api.create_commit(
                repo_id,
                operations,
                commit_message=commit_message or "Upload EVON posterior",
                revision=revision,
                create_pr=create_pr,
            )


_PUSH_KWARGS = (
    "repo_id",
    "commit_message",
    "private",
    "token",
    "revision",
    "create_pr",
    "path_in_repo",
    "endpoint",
)


def _unwrap_optimizer(optimizer: Any) -> Any:
    """The EVON inside wrappers such as accelerate's ``AcceleratedOptimizer``."""
    while not hasattr(optimizer, "posterior_factors") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if not hasattr(optimizer, "posterior_factors"):
        raise TypeError(f"expected an hf_evon EVON optimizer; got {type(optimizer).__name__}")
    return optimizer


def _unwrap_model(model: nn.Module) -> nn.Module:
    """Strip (Distributed)DataParallel, so names are the model's own (no ``module.`` prefix)."""
    while isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        model = model.module
    return model


def _base_model_name(model: nn.Module) -> str | None:
    """The Hub id / path the model came from, if it knows (PEFT: the base model's)."""
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, Mapping) and peft_config:
        active = getattr(model, "active_adapter", None)
        cfg = peft_config.get(active) if isinstance(active, str) else None
        cfg = cfg or next(iter(peft_config.values()))
        name = getattr(cfg, "base_model_name_or_path", None)
        if name:
            return str(name)
    name = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(
        model, "name_or_path", None
    )
    return str(name) if name else None


def _name_hint(name: str, params: Mapping[str, Tensor]) -> str:
    """Suggest the likely cause when names differ only by a wrapper prefix (e.g. PEFT)."""
    for other in params:
        if other.endswith("." + name):
            return f" (the model has {other!r}: was the posterior built from an unwrapped model?)"
        if name.endswith("." + other):
            return f" (the model has {other!r}: pass the wrapped model, e.g. the PeftModel, the posterior was built from)"
    return ""


@dataclass(frozen=True)
class _Entry:
    """One covered parameter as declared in the config."""

    name: str
    shape: tuple[int, ...]
    m: int
    n: int
    left: bool
    right: bool
    ess: float
    weight_decay: float

    def tensors(self) -> list[tuple[str, tuple[int, int]]]:
        """(kind, expected shape) of the tensors the file must hold for this parameter."""
        out = [("hess", (self.m, self.n))]
        if self.left:
            out.append(("Q_L", (self.m, self.m)))
        if self.right:
            out.append(("Q_R", (self.n, self.n)))
        return out


_STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _parse_entry(name: str, entry: Any, ess: float, weight_decay: float) -> _Entry:
    if not isinstance(entry, dict):
        raise PosteriorMismatchError(f"{POSTERIOR_CONFIG_NAME}: entry for {name!r} must be an object")
    try:
        shape = tuple(int(s) for s in entry["shape"])
        declared = tuple(int(s) for s in entry["matrix_shape"])
        left, right = bool(entry["left_basis"]), bool(entry["right_basis"])
    except (KeyError, TypeError, ValueError) as err:
        raise PosteriorMismatchError(
            f"{POSTERIOR_CONFIG_NAME}: entry for {name!r} needs shape, matrix_shape, left_basis, "
            f"right_basis ({err!r})"
        ) from None
    if len(declared) != 2 or declared != matrix_shape(shape):
        raise PosteriorMismatchError(
            f"{name!r}: matrix_shape {list(declared)} does not match shape {list(shape)} "
            f"(EVON views it as {list(matrix_shape(shape))})"
        )
    p_ess = _number(entry.get("ess", ess), f"parameters.{name}.ess")
    p_wd = _number(entry.get("weight_decay", weight_decay), f"parameters.{name}.weight_decay")
    _check_noise_scale(p_ess, p_wd, repr(name))
    return _Entry(name, shape, declared[0], declared[1], left, right, p_ess, p_wd)


def _check_tensor_headers(fh: Any, entries: list[_Entry]) -> dict[str, torch.dtype]:
    """Presence, dtype and shape of every tensor, from the header alone (nothing read yet)."""
    keys = set(fh.keys())
    stored: dict[str, torch.dtype] = {}
    for e in entries:
        for kind, want in e.tensors():
            key = f"{e.name}.{kind}"
            if key not in keys:
                raise PosteriorMismatchError(f"tensor {key!r} is missing from {POSTERIOR_WEIGHTS_NAME}")
            header = fh.get_slice(key)
            dtype = _STORED_DTYPES.get(header.get_dtype())
            if dtype is None:
                raise PosteriorMismatchError(
                    f"tensor {key!r} has dtype {header.get_dtype()}; expected one of {sorted(_STORED_DTYPES)}"
                )
            if tuple(header.get_shape()) != want:
                raise PosteriorMismatchError(
                    f"tensor {key!r} has shape {list(header.get_shape())}; expected {list(want)}"
                )
            stored[key] = dtype
    extra = sorted(keys - set(stored))
    if extra:
        raise PosteriorMismatchError(
            f"{POSTERIOR_WEIGHTS_NAME} holds tensors the config does not declare: {extra[:5]} "
            "(refusing to skip them silently)"
        )
    return stored


def _all_finite(t: Tensor) -> bool:
    """A finite sum implies finite entries (NaN/inf propagate); only a non-finite sum needs the slow check."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _read_groups(
    fh: Any, entries: list[_Entry], stored: dict[str, torch.dtype], device: Any, reorthonormalize: bool
) -> list[_Group]:
    """Read every tensor once, straight into its group's stacked buffer, validating its values."""
    buckets: dict[tuple, list[_Entry]] = {}
    for e in entries:
        dt = torch.float64 if stored[f"{e.name}.hess"] == torch.float64 else torch.float32
        buckets.setdefault((e.m, e.n, e.left, e.right, e.ess, e.weight_decay, dt), []).append(e)
    groups = []
    for (m, n, left, right, ess, weight_decay, dt), members in buckets.items():
        size = len(members)
        buffers = {
            "hess": torch.empty(size, m, n, dtype=dt, device=device),
            "Q_L": torch.empty(size, m, m, dtype=dt, device=device) if left else None,
            "Q_R": torch.empty(size, n, n, dtype=dt, device=device) if right else None,
        }
        for i, e in enumerate(members):
            for kind, _ in e.tensors():
                key = f"{e.name}.{kind}"
                slot = buffers[kind][i]
                slot.copy_(fh.get_tensor(key))  # upcasts half-precision bases to float32
                if not _all_finite(slot):
                    raise PosteriorMismatchError(f"tensor {key!r} has non-finite values (NaN or inf)")
                if kind == "hess":
                    # IVON's update keeps H + δ > 0 (H itself may dip below 0 by less than δ)
                    low = float(slot.min()) + weight_decay
                    if low <= 0:
                        raise PosteriorMismatchError(
                            f"tensor {key!r} has non-positive hess + weight_decay (min {low:g}); EVON "
                            "keeps it positive, else the variance 1/(ess·(hess + weight_decay)) would be "
                            "negative or infinite"
                        )
                    continue
                tol = _ORTHONORMAL_TOL.get(stored[key], 1e-3)
                err = _orthonormality_error(slot)
                if err > tol:
                    raise PosteriorMismatchError(
                        f"tensor {key!r} is not orthonormal (‖QᵀQx − x‖/‖x‖ = {err:.3g} > {tol:g} for "
                        f"{_dtype_name(stored[key])})"
                    )
        if reorthonormalize:
            for kind in ("Q_L", "Q_R"):
                if buffers[kind] is not None:
                    buffers[kind] = _polar_step(buffers[kind])
        groups.append(
            _Group(
                names=[e.name for e in members],
                shapes=[e.shape for e in members],
                m=m,
                n=n,
                q_left=buffers["Q_L"],
                q_right=buffers["Q_R"],
                hess=buffers["hess"],
                ess=ess,
                weight_decay=weight_decay,
            )
        )
    return groups


def _resolve_files(
    path: str,
    revision: str | None,
    subfolder: str | None,
    token: str | bool | None,
    cache_dir: str | os.PathLike | None,
    local_files_only: bool,
    hub_kwargs: dict[str, Any],
) -> tuple[str, str]:
    """Local paths of the config and weights: from a directory, or downloaded from the Hub."""
    if os.path.isdir(path):
        directory = os.path.join(path, subfolder) if subfolder else path
        files = tuple(os.path.join(directory, f) for f in (POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME))
        for f in files:
            if not os.path.isfile(f):
                raise FileNotFoundError(
                    f"no EVON posterior in {directory!r}: {os.path.basename(f)} is missing"
                )
        return files  # type: ignore[return-value]
    if os.path.exists(path):
        raise ValueError(f"{path!r} is a file; pass the directory that holds {POSTERIOR_CONFIG_NAME}")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    out = []
    for fname in (POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME):
        try:
            out.append(
                hf_hub_download(
                    path,
                    fname,
                    subfolder=subfolder,
                    revision=revision,
                    token=token,
                    cache_dir=cache_dir,
                    local_files_only=local_files_only,
                    **hub_kwargs,
                )
            )
        except EntryNotFoundError as err:
            if isinstance(err, LocalEntryNotFoundError):  # offline / not cached: not "missing"
                raise
            where = (
                f"{path}"
                + (f"/{subfolder}" if subfolder else "")
                + (f" (revision {revision})" if revision else "")
            )
            raise FileNotFoundError(f"no EVON posterior at {where}: {fname} is missing ({err})") from err
    return out[0], out[1]
