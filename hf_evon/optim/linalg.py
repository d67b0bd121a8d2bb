"""Batched linear algebra shared by the optimizer and the posterior.

Every function takes stacks of equal-shape matrices ``(B, m, n)``. A basis given as ``None``
means the identity on that side (a side above ``max_precond_dim``, a 1-D parameter, or
IVON mode), so callers never materialise identity matrices.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

# Muon's quintic Newton–Schulz coefficients (5 iterations drive singular values to ~1).
_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def rotate(x: Tensor, q_left: Tensor | None, q_right: Tensor | None) -> Tensor:
    """Parameter space -> eigenbasis: ``Q_Lᵀ X Q_R``."""
    if q_left is not None:
        x = q_left.mT @ x
    if q_right is not None:
        x = x @ q_right
    return x


def unrotate(x: Tensor, q_left: Tensor | None, q_right: Tensor | None) -> Tensor:
    """Eigenbasis -> parameter space: ``Q_L X Q_Rᵀ``."""
    if q_left is not None:
        x = q_left @ x
    if q_right is not None:
        x = x @ q_right.mT
    return x


def rotated_variance(hess: Tensor, ess: float, weight_decay: float) -> Tensor:
    """``V = 1 / (ζ (H + δ))``, the diagonal variance in the eigenbasis."""
    return 1.0 / (ess * (hess + weight_decay))


def sample_perturbation(
    z: Tensor, hess: Tensor, q_left: Tensor | None, q_right: Tensor | None, ess: float, weight_decay: float
) -> Tensor:
    """``Q_L (z ⊙ √V) Q_Rᵀ`` for standard-normal ``z``: a zero-mean posterior draw."""
    return unrotate(z * torch.rsqrt(ess * (hess + weight_decay)), q_left, q_right)


def eigenbasis(stat: Tensor) -> Tensor:
    """Full eigendecomposition used once, at initialisation (columns in ``eigh``'s order)."""
    return torch.linalg.eigh(stat).eigenvectors.contiguous()  # row-major, like reloaded state


def power_qr(stat: Tensor, q: Tensor) -> Tensor:
    """One power iteration followed by QR: the cheap eigenbasis refresh of SOAP.

    Column order is kept (no sorting), so the Hessian and momentum stay aligned with it.
    """
    return torch.linalg.qr(stat @ q).Q


def newton_schulz(x: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """Approximately orthogonalise each matrix (singular values -> ~1), as Muon does."""
    a, b, c = _NS_COEFFS
    transposed = x.shape[-2] > x.shape[-1]
    y = x.mT if transposed else x
    y = y / (torch.linalg.matrix_norm(y, keepdim=True) + eps)
    for _ in range(steps):
        gram = y @ y.mT
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y.mT if transposed else y


def spectral_clip(x: Tensor, radius: float) -> Tensor:
    """Clip every singular value to at most ``radius`` (exact, via a batched SVD)."""
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    return (u * s.clamp(max=radius).unsqueeze(-2)) @ vh


def clip_update(x: Tensor, mode: str, radius: float) -> Tensor:
    """Apply the update clipping selected by ``mode`` (see ``EVON``'s ``clip``)."""
    if mode == "none":
        return x
    if mode == "element":
        return x.clamp(-radius, radius)
    if mode == "spectral":
        return spectral_clip(x, radius)
    if mode == "whiten":
        return newton_schulz(x)
    raise ValueError(f"clip must be one of 'none', 'element', 'spectral', 'whiten'; got {mode!r}")


def marginal_variance(
    hess: Tensor, q_left: Tensor | None, q_right: Tensor | None, ess: float, weight_decay: float
) -> Tensor:
    """Diagonal of the covariance: ``Var W_ij = Σ_kl Q_L[i,k]² V_kl Q_R[j,l]²``."""
    var = rotated_variance(hess, ess, weight_decay)
    return unrotate(
        var, None if q_left is None else q_left.square(), None if q_right is None else q_right.square()
    )


def dense_covariance(
    hess: Tensor, q_left: Tensor | None, q_right: Tensor | None, ess: float, weight_decay: float
) -> Tensor:
    """Covariance of the row-major ``W.flatten()``: ``(Q_L ⊗ Q_R) diag(vec V) (Q_L ⊗ Q_R)ᵀ``."""
    m, n = hess.shape[-2:]
    eye = torch.eye
    left = eye(m, dtype=hess.dtype, device=hess.device) if q_left is None else q_left
    right = eye(n, dtype=hess.dtype, device=hess.device) if q_right is None else q_right
    basis = torch.kron(left, right)
    return (basis * rotated_variance(hess, ess, weight_decay).reshape(-1)) @ basis.mT
