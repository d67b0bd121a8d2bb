"""The Gaussian maths of an EVON posterior: its factors, samples, and basis checks.

For each covered matrix ``W`` (shape ``m×n`` after EVON's reshape) the posterior is::

    vec W ~ N(vec M, (Q_L ⊗ Q_R) diag(vec V) (Q_L ⊗ Q_R)ᵀ),   V = 1 / (ζ (H + δ))

(row-major ``vec``), ``M`` being the model's current weight (the mean), ``Q_L``/``Q_R`` the
eigenbases (identity where absent), ``H`` the rotated-space Hessian, ``ζ`` the effective
sample size ``ess`` and ``δ`` the weight decay. Nothing here knows about files or the Hub
(``posterior_format`` and ``posterior_hub``) or about models (``posterior``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .optim.linalg import exact_float32_matmul, unrotate

Tensor = torch.Tensor


def compute_dtype(t: Tensor) -> torch.dtype:
    """The eigenbasis math runs in float32 (float64 stays float64)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def resolve_seed(seed: int | None) -> int:
    """``None`` takes a seed from torch's global RNG, so ``torch.manual_seed`` reproduces it."""
    if seed is None:
        return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
    return int(seed)


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
        return 1.0 / (self.ess * (self.hess.to(compute_dtype(self.hess)) + self.weight_decay))


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

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> FactorGroup:
        return replace(
            self,
            q_left=None if self.q_left is None else fn(self.q_left),
            q_right=None if self.q_right is None else fn(self.q_right),
            hess=fn(self.hess),
        )


def std_scale(hess: Tensor, ess: float, weight_decay: float) -> Tensor:
    """``√V = 1/√(ζ(H + δ))`` exactly as sampling computes it (so validation checks the same numbers)."""
    return torch.rsqrt(ess * (hess + weight_decay))


def perturbations(
    z: Tensor, hess: Tensor, q_left: Tensor | None, q_right: Tensor | None, ess: float, weight_decay: float
) -> Tensor:
    """``Q_L (z_s ⊙ √V) Q_Rᵀ`` for ``z`` of shape ``(B, S, m, n)``: S samples of B matrices.

    The math of ``linalg.sample_perturbation``, arranged so that all S samples of a matrix
    share one batched matmul per side: samples are folded into the columns (left basis) or
    rows (right basis) instead of broadcasting Q over S, which would copy every basis S
    times (7 GB for 8 samples of GPT-2 small's 3072×3072 bases).
    """
    b, s, m, n = z.shape
    x = z * std_scale(hess, ess, weight_decay).unsqueeze(1)
    with exact_float32_matmul():
        if q_left is not None:  # Q_L @ [X_1 … X_S] as one (m, S·n) block per matrix
            x = unrotate(x.transpose(1, 2).reshape(b, m, s * n), q_left, None)
            x = x.reshape(b, m, s, n).transpose(1, 2)
        if q_right is not None:  # [X_1; …; X_S] @ Q_Rᵀ as one (S·m, n) block per matrix
            x = unrotate(x.reshape(b, s * m, n), None, q_right)
    return x.reshape(b, s, m, n)


def orthonormality_error(q: Tensor, probes: int = 2) -> float:
    """``max ‖QᵀQx − x‖ / ‖x‖`` over fixed random probes: O(k n²) instead of O(n³)."""
    q32 = q.to(compute_dtype(q))
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(q.shape[-1], probes, generator=gen, dtype=q32.dtype).to(q32.device)
    with exact_float32_matmul():
        residual = ((q32 @ x).mT @ q32).mT - x  # QᵀQx without transposing Q
    return float((residual.norm(dim=0) / x.norm(dim=0)).max())


def polar_step(q: Tensor) -> Tensor:
    """One Newton–Schulz step towards the nearest orthonormal matrix: ``Q (3I − QᵀQ) / 2``."""
    with exact_float32_matmul():
        gram = q.mT @ q
        eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
        return q @ (1.5 * eye - 0.5 * gram)
