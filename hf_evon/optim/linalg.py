"""Batched linear algebra shared by the optimizer and the posterior.

Every function takes stacks of equal-shape matrices ``(B, m, n)``. A basis given as ``None``
means the identity on that side (a side above ``max_precond_dim``, a 1-D parameter, or
IVON mode), so callers never materialise identity matrices.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import warnings
from collections.abc import Iterator

import torch
from torch.nn.utils import parametrize

from hf_evon.optim.checks import outside_stacklevel

Tensor = torch.Tensor

# Muon's quintic Newton–Schulz coefficients (5 iterations drive singular values to ~1).
_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b``; for two stacks of one batch size, ``torch.bmm`` itself: the same kernel on the
    same operands (bitwise the same result), without the expand and view ops that ``@`` adds
    around it, which are most of a small model's step."""
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0]:
        return torch.bmm(a, b)
    return a @ b


def rotate(x: Tensor, q_left: Tensor | None, q_right: Tensor | None) -> Tensor:
    """Parameter space -> eigenbasis: ``Q_Lᵀ X Q_R``."""
    if q_left is not None:
        x = matmul(q_left.mT, x)
    if q_right is not None:
        x = matmul(x, q_right)
    return x


def unrotate(x: Tensor, q_left: Tensor | None, q_right: Tensor | None) -> Tensor:
    """Eigenbasis -> parameter space: ``Q_L X Q_Rᵀ``."""
    if q_left is not None:
        x = matmul(q_left, x)
    if q_right is not None:
        x = matmul(x, q_right.mT)
    return x


def unrotate_scaled(
    x: Tensor, q_left: Tensor | None, q_right: Tensor | None, alpha: float, add: Tensor | None, beta: float
) -> Tensor:
    """``α·Q_L X Q_Rᵀ + β·C`` (``add`` C; None: 0) for stacks of one batch size: a new tensor, X
    unchanged, the scalars and C folded into the last product (``baddbmm``)."""
    if q_left is None and q_right is None:
        out = x.mul(alpha)
        return out if add is None else out.add_(add, alpha=beta)
    a, b = (q_left, x) if q_right is None else (x if q_left is None else torch.bmm(q_left, x), q_right.mT)
    if add is None:
        out = torch.bmm(a, b)
        return out if alpha == 1.0 else out.mul_(alpha)
    return torch.baddbmm(add, a, b, beta=beta, alpha=alpha)


# gram() halves the rows while both halves keep at least this many: smaller blocks save little
# arithmetic and cost launches
GRAM_MIN_BLOCK = 128
# On CPU the blocked product is slower than one matmul although it multiplies less: its strided and
# transposed block copies cost more there than the multiply-adds saved (docs/defaults.md#gram-blocked).
# Accelerators use it; set True to count it.
GRAM_BLOCKED_ON_CPU = False


def gram_is_blocked(x: Tensor) -> bool:
    """Whether :func:`gram` takes the blocked product for ``x`` by default (see ``GRAM_BLOCKED_ON_CPU``)."""
    return GRAM_BLOCKED_ON_CPU or x.device.type != "cpu"


def gram(x: Tensor, blocked: bool | None = None) -> Tensor:
    """``X Xᵀ`` of every member of a stack ``(B, m, k)``, with about half the multiply-adds.

    ``blocked=None``: blocked except on CPU (see ``GRAM_BLOCKED_ON_CPU``); False: ``X @ X.mT``.

    The product is symmetric, so (as BLAS's ``syrk``) only one off-diagonal block needs a
    multiplication: the rows are halved, the upper block ``X_top X_botᵀ`` is multiplied and
    mirrored, and the two diagonal blocks of all members recurse as one batch of ``2B``. Each
    level costs 3/4 of the level above, so ``j`` levels cost ``1/2 + 2^-(j+1)`` of
    ``X @ X.mT`` (17/32 for ``m = 3072``). Every entry is the same dot product as in
    ``X @ X.mT`` (only the rounding of the sum may differ), and the result is exactly symmetric.
    """
    if blocked is None:
        blocked = gram_is_blocked(x)
    b, m, k = x.shape
    h = m // 2
    if not blocked:
        return matmul(x, x.mT)
    if m % 2 or h < GRAM_MIN_BLOCK:
        # BLAS need not round x_i·x_j and x_j·x_i alike: one triangle, mirrored, is symmetric by
        # construction (the adds are of exact zeros)
        full = matmul(x, x.mT)
        return full.triu() + full.triu(1).mT
    halves = x.reshape(2 * b, h, k)  # members 2i, 2i+1: the top and bottom rows of member i
    diag = gram(halves, blocked=True).view(b, 2, h, h)
    off = matmul(halves[0::2], halves[1::2].mT)
    out = x.new_empty(b, m, m)
    out[:, :h, :h] = diag[:, 0]
    out[:, h:, h:] = diag[:, 1]
    out[:, :h, h:] = off
    out[:, h:, :h] = off.mT
    return out


def rotated_variance(hess: Tensor, ess: float, weight_decay: float) -> Tensor:
    """``V = 1 / (ζ (H + δ))``, the diagonal variance in the eigenbasis."""
    return 1.0 / (ess * (hess + weight_decay))


def rotated_std(hess: Tensor, ess: float, weight_decay: float) -> Tensor:
    """``√V = 1/√(ζ(H + δ))``, the posterior std in the eigenbasis: the one formula every sample,
    noise readout and file check uses, so they all see the same numbers. One new tensor, its
    product and root taken in place (ζ·x and x·ζ round alike): a sample's pass over H allocates once."""
    return (hess + weight_decay).mul_(ess).rsqrt_()


def sample_perturbation(
    z: Tensor, hess: Tensor, q_left: Tensor | None, q_right: Tensor | None, ess: float, weight_decay: float
) -> Tensor:
    """``Q_L (z ⊙ √V) Q_Rᵀ`` for standard-normal ``z``: a zero-mean posterior draw."""
    return unrotate(z * rotated_std(hess, ess, weight_decay), q_left, q_right)


def eigenbasis(stat: Tensor) -> Tensor:
    """Full eigendecomposition used once, at initialisation, columns in DESCENDING eigenvalue order.

    The refresh ``QR(L·Q)`` is orthogonal iteration, whose stable fixed point has the columns in
    descending order; started from ``eigh``'s ascending order the columns drift off L's
    eigenvectors within a few refreshes even for a fixed L (SOAP and the paper sort descending).
    Each column's largest-magnitude entry is made positive: ``eigh`` fixes signs arbitrarily, and
    a rounding-level change of L (gradients averaged over ranks in another order) can flip
    them, and with them every later noise draw (as ``power_qr`` fixes its signs too).
    """
    q = eigenvectors(stat).flip(-1)
    signs = torch.gather(q, -2, q.abs().argmax(dim=-2, keepdim=True)).sign()
    return (q * signs).contiguous()  # row-major, like reloaded state


def converged_eigenvectors(stat: Tensor) -> Tensor | None:
    """``torch.linalg.eigh(stat).eigenvectors``, or None where LAPACK failed: it raised, or (MKL's
    float32 ``syevd`` does both) returned NaN without raising. One host sync (the check)."""
    try:
        q = torch.linalg.eigh(stat).eigenvectors
    except torch.linalg.LinAlgError:
        return None
    return q if bool(torch.isfinite(q).all()) else None


def eigenvectors(stat: Tensor) -> Tensor:
    """``torch.linalg.eigh(stat).eigenvectors`` (ascending) for finite symmetric ``stat``, also where
    LAPACK fails to converge on it.

    MKL's float32 ``syevd`` fails (raises, or returns NaN) on some exactly rank-deficient
    statistics (a fine-tuning run's first gradients with many dead units: rows of zeros); float64
    converges on them, and a shift ``μI`` (the same eigenvectors) is the next retry. A member none
    diagonalises keeps the identity, with a warning: any orthonormal basis is a valid start for the
    refresh's power iteration, which turns it towards the eigenvectors. The retries run only after
    a failure; the check costs the bucket's initialising step one host sync, none later.
    """
    if (q := converged_eigenvectors(stat)) is not None:
        return q
    wide = stat.double()
    if (q := converged_eigenvectors(wide)) is not None:
        return q.to(stat.dtype)
    stack = wide.reshape(-1, *wide.shape[-2:])
    eye = torch.eye(stack.shape[-1], dtype=wide.dtype, device=wide.device)
    out, failed = [], 0
    for member in stack:
        shift = member.diagonal().abs().mean() * stack.shape[-1] * torch.finfo(wide.dtype).eps
        q = converged_eigenvectors(member + shift * eye)
        failed += q is None
        out.append(eye if q is None else q)
    if failed:
        warnings.warn(
            f"EVON: eigh failed to converge on {failed} of {len(out)} Shampoo statistics of shape "
            f"{tuple(stat.shape[-2:])} (in float32, float64 and with a shift); they start from the identity "
            "basis, which the eigenbasis refresh turns towards their eigenvectors",
            RuntimeWarning,
            stacklevel=outside_stacklevel(),
        )
    return torch.stack(out).reshape(stat.shape).to(stat.dtype)


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


@contextlib.contextmanager
def autocast_disabled() -> Iterator[None]:
    """No autocast inside, whatever the caller's (a model's bfloat16 autocast around the optimizer
    or the posterior): their maths and state keep their own dtypes."""
    with contextlib.ExitStack() as stack:
        for device in _AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def writing_weights() -> Iterator[None]:
    """:func:`autocast_disabled` around code that writes parameters in place, autocast's cached casts
    dropped after it: autocast keeps its lower-precision copy of each parameter (a leaf that requires
    grad) until its outermost region ends and does not see in-place writes, so a forward after a sample
    or the mean is written would otherwise run at the weights cast before it.

    ``torch.nn.utils.parametrize.cached()`` keeps a parametrized weight's value, computed from the
    parameters it is made of, until its block ends, blind to in-place writes too: its cache (the
    private module dict ``parametrize._cache``, the one private member read here; pinned by
    tests/test_posterior.py) is emptied with autocast's."""
    try:
        with autocast_disabled():
            yield
    finally:
        torch.clear_autocast_cache()
        parametrize._cache.clear()


@contextlib.contextmanager
def exact_float32_matmul() -> Iterator[None]:
    """Full float32 matmuls inside (no TF32, no autocast); the caller's settings are restored."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with autocast_disabled():
            yield
    finally:
        torch.set_float32_matmul_precision(saved)


# ‖QᵀQx − x‖ / ‖x‖ allowed on load, by the dtype the basis was stored in: ~10x what rounding a
# basis to that dtype gives, far below what a wrong basis gives (docs/posterior-format.md#orthonormality)
ORTHONORMAL_TOL = {
    torch.float64: 1e-6,
    torch.float32: 1e-3,
    torch.float16: 1e-2,
    torch.bfloat16: 6e-2,
}


def orthonormality_error(q: Tensor, probes: int = 2, fresh: bool = False) -> float:
    """``max ‖QᵀQx − x‖ / ‖x‖`` over random probes, for one basis or a stack of them: O(k n²)
    instead of O(n³). Measured in float32 (float64 bases: float64), as ``buckets.state_dtype``; inf
    where the products are not finite (a NaN, which no ``err > tol`` check would refuse). The probes
    are seed 0's, so a decision made on the error is the same at every call; ``fresh`` (a load's check
    of a file) draws them afresh, the global generator untouched: a basis made to pass known probes
    (``I + c·uuᵀ``, ``u`` orthogonal to them) does not pass."""
    q32 = q.detach().to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    gen = torch.Generator(device="cpu")
    if fresh:
        gen.seed()
    else:
        gen.manual_seed(0)
    x = torch.randn(q.shape[-1], probes, generator=gen, dtype=q32.dtype).to(q32.device)
    with exact_float32_matmul():
        residual = ((q32 @ x).mT @ q32).mT - x  # QᵀQx without transposing Q
    return float((residual.norm(dim=-2) / x.norm(dim=0)).nan_to_num(nan=math.inf, posinf=math.inf).max())


# the side from which an accelerator factors each member of a stack in a call of its own: cuSOLVER's
# batched Cholesky of large sides is slower than one call per member (docs/defaults.md#cholesky-qr)
CHOLESKY_ALONE_MIN_SIDE = 1536


def cholesky_factors(gram: Tensor, alone: bool | None = None) -> tuple[Tensor, Tensor]:
    """``torch.linalg.cholesky_ex`` of a stack: the lower factors and each member's ``info``.

    ``alone`` (None: off a CPU from ``CHOLESKY_ALONE_MIN_SIDE`` on) factors each member in a call
    of its own. The lower factor L = Rᵀ: asked for the upper one, cuSOLVER's batched Cholesky
    transposes the stack in and out and takes twice the device time."""
    if alone is None:
        alone = gram.device.type != "cpu" and gram.shape[-1] >= CHOLESKY_ALONE_MIN_SIDE
    if not alone or gram.dim() < 3 or gram.shape[0] == 1:
        return torch.linalg.cholesky_ex(gram)
    factors = [torch.linalg.cholesky_ex(member) for member in gram.unbind(0)]
    return torch.stack([low for low, _ in factors]), torch.stack([info for _, info in factors])


def _cholesky_qr_pass(a: Tensor, shift: Tensor | None = None) -> tuple[Tensor, Tensor]:
    gram = a.mT @ a
    if shift is not None:
        gram.diagonal(dim1=-2, dim2=-1).add_(shift)
    low, info = cholesky_factors(gram)
    return torch.linalg.solve_triangular(low.mT, a, upper=True, left=False), info


def cholesky_qr(a: Tensor) -> tuple[Tensor, Tensor]:
    """``(Q, failed)``: ``Q`` of ``A = Q R`` by shifted CholeskyQR3 (Fukaya et al., 2020) in float64,
    and a boolean per member whose Cholesky failed (e.g. an all-zero ``A``; its ``Q`` is not usable).

    Built from Gram matrices, Cholesky and triangular solves, it takes about half the time of
    cuSOLVER's Householder QR on a GPU refresh batch. Members are factored together: the Gram
    matrices and the triangular solves in one batched call each, which beats one call per member,
    and the Cholesky factors as :func:`cholesky_factors` says (docs/defaults.md#cholesky-qr). Columns are
    first scaled to unit norm (``Q`` is unchanged by that); float64 and the shift keep it stable up
    to condition numbers ~1e15. ``failed`` stays on the device: reading it is the caller's choice.
    """
    m, n = a.shape[-2:]
    a64 = a.double()  # the column norms too: in float32 they overflow past ~1.8e19
    col_norm = torch.linalg.vector_norm(a64, dim=-2, keepdim=True)
    x = a64 / torch.where(col_norm > 0, col_norm, torch.ones_like(col_norm))
    # (scaling columns by positive numbers leaves Q unchanged and improves the conditioning)
    shift = 11.0 * (m * n + n * (n + 1)) * torch.finfo(torch.float64).eps * x.square().sum((-2, -1))
    q, info1 = _cholesky_qr_pass(x, shift.unsqueeze(-1))
    q, info2 = _cholesky_qr_pass(q)
    q, info3 = _cholesky_qr_pass(q)
    q = q.to(a.dtype)
    failed = (info1 != 0) | (info2 != 0) | (info3 != 0) | ~torch.isfinite(q).all(-1).all(-1)
    return q, failed


def householder_q(a: Tensor) -> Tensor:
    """``torch.linalg.qr(a).Q``. On a CPU from the same two LAPACK calls (``geqrf``, then ``orgqr``)
    without R, which ``linalg.qr`` also extracts and copies (a sixth of its time at 128 to 512 wide)."""
    if a.device.type != "cpu":
        return torch.linalg.qr(a).Q
    return torch.linalg.householder_product(*torch.geqrf(a))


def power_qr(stat: Tensor, q: Tensor, householder: bool | None = None) -> Tensor:
    """One power iteration followed by QR: the cheap eigenbasis refresh of SOAP.

    Column order is kept (no sorting), so the Hessian and momentum stay aligned with it.
    Column signs are chosen so each new basis vector points like the old one
    (``diag(Q_oldᵀ Q_new) ≥ 0``): QR is unique only up to these signs, and fixing them makes
    the result independent of the QR algorithm and keeps noise draws continuous.
    ``householder`` (None: on CPU) uses LAPACK's QR; otherwise, as on accelerators, the product
    is formed in float64, which TF32 settings never touch, and orthonormalised by
    ``cholesky_qr`` (with S + μI, μ at float64's rounding, so that a null direction of S in Q
    leaves no zero column); a member whose CholeskyQR3 fails (a statistic of zeros) keeps its basis:
    deciding that on the device spares the step a host sync, and any orthonormal basis serves a
    statistic of zeros.
    """
    if householder is None:
        householder = stat.device.type == "cpu"
    if householder:
        new = householder_q(matmul(stat, q))
    else:
        stat64, q64 = stat.double(), q.double()
        # (S + μI)Q with μ at float64's rounding of S's mean eigenvalue: the same eigenvectors, and
        # no zero column where Q holds a null direction of S (a dead unit), which CholeskyQR cannot factor
        mu = torch.finfo(torch.float64).eps * stat64.diagonal(dim1=-2, dim2=-1).mean(-1)
        new, failed = cholesky_qr(torch.matmul(stat64, q64).add_(q64 * mu[..., None, None]))
        new = torch.where(failed.view(-1, 1, 1), q, new.to(q.dtype))
    signs = torch.where((q * new).sum(-2, keepdim=True) < 0, -1.0, 1.0).to(new.dtype)
    return new * signs


# the entries of the statistics one grouped refresh call takes at most (its float64 product and
# passes: 1 GiB each): a refresh of every matrix at once stays in calls of bounded memory
REFRESH_CALL_ENTRIES = 1 << 27


def power_qr_many(
    pairs: list[tuple[Tensor, Tensor]], grouped: bool | None = None, householder: bool | None = None
) -> list[Tensor]:
    """:func:`power_qr` of each ``(statistic, basis)`` stack, in order.

    ``grouped`` (None: off a CPU) hands the stacks of one side size, dtype and device to one call:
    on an accelerator one call on a few members costs less than one per member (its batched products
    and solves; docs/defaults.md#cholesky-qr), and a staggered refresh brings a few members of several
    buckets per step (calls of at most ``REFRESH_CALL_ENTRIES``). Every operation of the refresh is
    per member, so the bases are those of one call per stack. On a CPU, LAPACK's QR works member by
    member: stacking would only copy. ``householder``: as :func:`power_qr`'s."""
    if grouped is None:
        grouped = bool(pairs) and pairs[0][0].device.type != "cpu"
    together: dict[tuple, list[list[int]]] = {}
    for i, (stat, _) in enumerate(pairs):
        calls = together.setdefault((stat.shape[-1], stat.dtype, stat.device) if grouped else (i,), [[]])
        if calls[-1] and sum(pairs[j][0].numel() for j in calls[-1]) + stat.numel() > REFRESH_CALL_ENTRIES:
            calls.append([])
        calls[-1].append(i)
    out: dict[int, Tensor] = {}
    for members in (call for calls in together.values() for call in calls):
        if len(members) == 1:
            out[members[0]] = power_qr(*pairs[members[0]], householder=householder)
            continue
        stat = torch.cat([pairs[i][0] for i in members])
        new = power_qr(stat, torch.cat([pairs[i][1] for i in members]), householder=householder)
        for i, part in zip(members, new.split([pairs[i][0].shape[0] for i in members])):
            out[i] = part
    return [out[i] for i in range(len(pairs))]


def newton_schulz(x: Tensor, steps: int = 5, eps: float = 1e-7, scale: float = 1.0) -> Tensor:
    """Approximately orthogonalise each matrix of a stack (singular values -> ~1), as Muon does;
    the result times ``scale`` (folded into the last product). On a CPU, where one eigh of the
    smaller Gram costs less than the iterations' products (:func:`eigh_beats_iterations`), the same
    map is computed on that Gram's eigenvalues (:func:`_quintic_on_gram_spectrum`)."""
    a, b, c = _NS_COEFFS
    single = x.dim() == 2
    y = x.unsqueeze(0) if single else x
    transposed = y.shape[-2] > y.shape[-1]
    y = y.mT if transposed else y
    # squares summed in float64: in float32 they overflow once an entry passes ~1.8e19
    norm = torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True, dtype=torch.float64).to(y.dtype)
    y = y / (norm + eps)
    spectral = None
    if steps > 0 and y.device.type == "cpu" and y.dtype in _EIGH_DTYPES and eigh_beats_iterations(*y.shape[-2:]):
        spectral = _quintic_on_gram_spectrum(y, norm, steps, scale)
    if spectral is not None:
        y = spectral
    else:
        for i in range(steps):
            # a·Y + (b·YYᵀ + c·(YYᵀ)²)·Y, its scalings folded into the products (beta·C + alpha·A·B)
            gram = torch.bmm(y, y.mT)
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            s = scale if i == steps - 1 else 1.0
            y = torch.baddbmm(y, poly, y, beta=a * s, alpha=s)
        if steps < 1 and scale != 1.0:
            y = y * scale
    y = y.mT if transposed else y
    return y[0] if single else y


_EIGH_DTYPES = (torch.float32, torch.float64)


def eigh_beats_iterations(m: int, n: int) -> bool:
    """Whether, for an m×n matrix (m ≤ n) on a CPU, one Gram product, an eigh of the m×m Gram and
    two products cost at most 3/4 of the iterations' 5·(2m²n + m³) multiply-adds. The eigh counts
    as (5 + 1200/m)·m³, fitted to LAPACK's on one thread; the margin keeps the iterations where
    more threads speed the products more than the eigh (docs/results.md#speed, "Whitening on a CPU")."""
    return 3 * m * m * n + (5 + 1200 / m) * m**3 < 0.75 * 5 * (2 * m * m * n + m**3)


def _quintic_on_gram_spectrum(y: Tensor, norm: Tensor, steps: int, scale: float) -> Tensor | None:
    """The quintic iteration's result for normalised wide ``y`` (B, m, n), m ≤ n, from the
    eigendecomposition Y Yᵀ = V diag(λ) Vᵀ: each iteration maps Y = V diag(σ) Wᵀ to
    V diag(σ·p(σ²)) Wᵀ with p(s) = a + b·s + c·s², so ``steps`` of them give V diag(r) Vᵀ Y with
    r = Π_k p(s_k), s_0 = λ, s_{k+1} = s_k·p(s_k)²: the same map, without square roots. A
    non-finite ``norm`` (an inf or NaN entry) gives NaN everywhere, as the iterations do.

    None where LAPACK fails on the (finite) Gram: MKL's float32 ``syevd`` raises or returns NaN on
    some rank-deficient ones (an update with many zero rows); the caller then takes the iterations.
    The check reads CPU tensors: no device sync."""
    a, b, c = _NS_COEFFS
    gram = torch.bmm(y, y.mT).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    try:
        evals, evecs = torch.linalg.eigh(gram)
    except torch.linalg.LinAlgError:
        return None
    # one read: the largest magnitude of both is below inf (a NaN makes the maximum NaN, which is
    # not), in fewer and smaller ops than two isfinite masks
    if not bool(torch.maximum(evals.abs().amax(), evecs.abs().amax()) < math.inf):
        return None
    s = evals.clamp_(min=0.0)
    ratio = None
    for _ in range(steps):
        p = s.mul(c).add_(b).mul_(s).add_(a)
        ratio = p if ratio is None else ratio.mul_(p)
        s = s * p * p
    # times scale, and NaN where the input was not finite (norm·0 is 0 or NaN)
    ratio = ratio.unsqueeze(-2) * norm.mul(0.0).add_(scale)
    return torch.bmm(evecs * ratio, torch.bmm(evecs.mT, y))


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
    if mode == "whiten_rms":
        # min(m, n) singular values near 1 have entry RMS 1/sqrt(max(m, n)): scaled to ``radius``
        return newton_schulz(x, scale=radius * math.sqrt(max(x.shape[-2:])))
    raise ValueError(
        f"clip must be one of 'none', 'element', 'spectral', 'whiten', 'whiten_rms'; got {mode!r}"
    )


def marginal_variance(
    hess: Tensor, q_left: Tensor | None, q_right: Tensor | None, ess: float, weight_decay: float
) -> Tensor:
    """Diagonal of the covariance: ``Var W_ij = Σ_kl Q_L[i,k]² V_kl Q_R[j,l]²`` (full float32 at least,
    whatever the caller's autocast)."""
    with exact_float32_matmul():
        var = rotated_variance(hess, ess, weight_decay)
        return unrotate(
            var, None if q_left is None else q_left.square(), None if q_right is None else q_right.square()
        )


# a dense covariance of 4096 entries is 4096² float32 numbers (64 MiB): more is a mistake, not a query
MAX_DENSE_COVARIANCE_ELEMENTS = 4096


def refuse_dense_covariance(label: str, numel: int, max_elements: int, call: str) -> None:
    """Raise, naming the parameter (``label``) and the method (``call``), where its dense covariance
    would have more than ``max_elements`` rows: numel² entries, which an allocation fails on only
    once it has exhausted memory."""
    if isinstance(max_elements, bool) or not isinstance(max_elements, numbers.Real) or not max_elements >= 0:
        raise ValueError(f"{call}: max_elements must be a number >= 0 (inf: no limit); got {max_elements!r}")
    if numel > max_elements:
        raise ValueError(
            f"{label} has {numel} elements: its dense covariance would be {numel}×{numel}; {call} is for "
            f"parameters with at most {max_elements} elements (pass max_elements to override, or use the "
            "marginal stds or samples)"
        )


def dense_covariance(
    hess: Tensor, q_left: Tensor | None, q_right: Tensor | None, ess: float, weight_decay: float
) -> Tensor:
    """Covariance of the row-major ``W.flatten()``: ``(Q_L ⊗ Q_R) diag(vec V) (Q_L ⊗ Q_R)ᵀ`` (full
    float32 at least, whatever the caller's autocast)."""
    m, n = hess.shape[-2:]
    eye = torch.eye
    left = eye(m, dtype=hess.dtype, device=hess.device) if q_left is None else q_left
    right = eye(n, dtype=hess.dtype, device=hess.device) if q_right is None else q_right
    with exact_float32_matmul():
        basis = torch.kron(left.contiguous(), right.contiguous())
        return (basis * rotated_variance(hess, ess, weight_decay).reshape(-1)) @ basis.mT


_DTYPE = operator.attrgetter("dtype")


def norms_of(tensors: list[Tensor]) -> list[Tensor]:
    """Each tensor's 2-norm in float32 at least (float64 if any is): a float16 gradient's norm
    overflows above 65504 and its square above 256 while every entry is finite."""
    dtypes = set(map(_DTYPE, tensors))
    if any(d.is_complex for d in dtypes):  # an AdamW group's complex parameters: their own norms
        complex_ = [i for i, t in enumerate(tensors) if t.is_complex()]
        norms = norms_of([t for t in tensors if not t.is_complex()]) if len(complex_) < len(tensors) else []
        for i, norm in zip(complex_, torch._foreach_norm([tensors[i] for i in complex_])):
            norms.insert(i, norm)
        return norms
    wide = torch.float64 if torch.float64 in dtypes else torch.float32
    return list(torch._foreach_norm(tensors, dtype=wide))
