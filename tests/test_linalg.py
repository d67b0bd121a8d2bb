"""The eigenbasis maths: the initial basis's column order, and the QR used on accelerators.

CI has no GPU; the accelerator branch of ``power_qr`` (``householder=False``) and its QR,
``cholesky_qr``, are device-agnostic and are tested here on CPU against the defining properties
of a QR factorisation and against LAPACK's Householder QR.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_evon.optim.linalg import GRAM_MIN_BLOCK, cholesky_qr, eigenbasis, gram, power_qr

F64 = torch.float64


def with_condition_number(batch: int, n: int, kappa: float, seed: int) -> torch.Tensor:
    """``U diag(σ) Vᵀ`` with singular values log-spaced from 1 down to 1/κ."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(batch, n, n, generator=gen, dtype=F64)).Q
    v = torch.linalg.qr(torch.randn(batch, n, n, generator=gen, dtype=F64)).Q
    sigma = torch.logspace(0, -torch.log10(torch.tensor(kappa)).item(), n, dtype=F64)
    return (u * sigma) @ v.mT


def assert_is_q_of(q: torch.Tensor, a: torch.Tensor, tol: float) -> None:
    """Q orthonormal and QᵀA upper triangular (A = QR), relative to the size of A."""
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    assert float((q.mT @ q - eye).abs().max()) < tol
    r = q.mT @ a
    scale = torch.linalg.matrix_norm(a, keepdim=True)
    assert float((torch.tril(r, -1) / scale).abs().max()) < tol


def align_signs(q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Flip columns of ``q`` to point like those of ``target`` (QR fixes Q only up to signs)."""
    return q * torch.where((q * target).sum(-2, keepdim=True) < 0, -1.0, 1.0).to(q.dtype)


@pytest.mark.parametrize("kappa", [10.0, 1e6, 1e12])
def test_cholesky_qr_is_a_qr_of_ill_conditioned_matrices(kappa: float) -> None:
    a = with_condition_number(3, 24, kappa, seed=int(kappa) % 97)
    q, failed = cholesky_qr(a)
    assert q.dtype == F64 and torch.isfinite(q).all() and not bool(failed.any())
    assert_is_q_of(q, a, tol=1e-11)  # CholeskyQR3: O(n·eps) whatever κ (n = 24, eps = 1.1e-16)
    if kappa <= 1e6:  # Q of a QR is unique up to column signs; perturbations grow by κ: eps·κ ≈ 1e-10
        householder = torch.linalg.qr(a).Q
        assert float((align_signs(q, householder) - householder).abs().max()) < 1e-8


def test_cholesky_qr_of_float32_keeps_float32_and_orthonormality() -> None:
    a = with_condition_number(2, 32, 1e5, seed=3).float()
    q, failed = cholesky_qr(a)
    assert q.dtype == torch.float32 and not bool(failed.any())
    assert_is_q_of(q.double(), a.double(), tol=1e-5)


def test_cholesky_qr_flags_a_zero_member_and_factors_the_others() -> None:
    a = with_condition_number(3, 8, 100.0, seed=5)
    a[1] = 0.0  # Cholesky of a zero Gram matrix fails
    q, failed = cholesky_qr(a)
    assert failed.tolist() == [False, True, False]
    for i in (0, 2):
        assert_is_q_of(q[i], a[i], tol=1e-11)


def test_the_accelerator_refresh_moves_a_basis_that_holds_a_dead_units_direction() -> None:
    # a dead input unit: R has a zero row and column, its eigenbasis holds e_0, so R·Q has a zero
    # column; CholeskyQR could not factor it and the whole basis stayed as it was, every refresh
    gen = torch.Generator().manual_seed(0)
    g1, g2 = torch.randn(1, 16, 8, generator=gen), torch.randn(1, 16, 8, generator=gen)
    g1[..., 0] = g2[..., 0] = 0.0
    r1 = (g1.mT @ g1).double()
    r2 = 0.5 * r1 + 0.5 * (g2.mT @ g2).double()
    q0 = eigenbasis(r1)
    householder, cholesky = power_qr(r2, q0, householder=True), power_qr(r2, q0, householder=False)
    assert float((householder - q0).abs().max()) > 0.1  # the refresh moves it
    assert torch.allclose(cholesky, householder, atol=1e-9)  # and so does the accelerators' route


def test_cholesky_qr_asks_for_the_lower_factor() -> None:
    """Each CholeskyQR pass factors its Gram matrix as L Lᵀ: cuSOLVER's batched Cholesky, asked
    for the upper factor, transposes the stack in and out and took twice the device time on a
    GPU (docs/defaults.md#cholesky-qr). ``Q`` is still that of ``A = Q R``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    uppers = []

    class CholeskyCalls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func.overloadpacket == torch.ops.aten.linalg_cholesky_ex:
                uppers.append(bool((kwargs or {}).get("upper", args[1] if len(args) > 1 else False)))
            return func(*args, **(kwargs or {}))

    a = with_condition_number(2, 8, 1e6, seed=3)
    with CholeskyCalls():
        q, failed = cholesky_qr(a)
    assert uppers == [False, False, False]
    assert not failed.any()
    for i in range(2):
        assert_is_q_of(q[i], a[i], tol=1e-9)


def test_the_accelerator_refresh_keeps_the_basis_of_a_zero_statistic() -> None:
    """A failed CholeskyQR3 is settled on the device: that member keeps its basis, the others refresh."""
    stat = with_condition_number(3, 8, 100.0, seed=6)
    stat = stat @ stat.mT
    stat[1] = 0.0
    q_old = torch.linalg.qr(with_condition_number(3, 8, 10.0, seed=7)).Q
    new = power_qr(stat, q_old, householder=False)
    assert torch.equal(new[1], q_old[1])
    householder = power_qr(stat, q_old, householder=True)
    for i in (0, 2):
        assert float((new[i] - householder[i]).abs().max()) < 1e-10


@pytest.mark.parametrize(
    "dtype,decades,tol",
    [(F64, 10, 1e-5), (torch.float32, 3, 1e-3)],  # columns below eps·λ_max are not determined
)
def test_refresh_on_accelerators_equals_the_cpu_refresh(dtype: torch.dtype, decades: int, tol: float) -> None:
    """``power_qr``'s accelerator formula (float64 product, CholeskyQR3, the same sign rule)
    gives the CPU result (Householder) for a statistic whose eigenvalues span many decades, as
    EMAs of G Gᵀ do: their bases agree wherever the state's precision determines them."""
    gen = torch.Generator().manual_seed(11)
    n = 48
    eigvecs = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64)).Q
    stat = ((eigvecs * torch.logspace(0, -decades, n, dtype=F64)) @ eigvecs.mT).to(dtype).unsqueeze(0)
    q_old = torch.linalg.qr(eigvecs + 0.05 * torch.randn(n, n, generator=gen, dtype=F64)).Q.to(dtype)[None]
    cpu = power_qr(stat, q_old)
    accel = power_qr(stat, q_old, householder=False)
    assert cpu.dtype == dtype == accel.dtype
    assert float((cpu - accel).abs().max()) < tol
    assert bool(((q_old * cpu).sum(-2) >= 0).all())  # columns point like the old basis


def column_angles(q: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """Angle (radians) between each column of ``q`` and the same column of ``vectors`` (up to sign)."""
    cos = (q * vectors).sum(-2).abs() / (q.norm(dim=-2) * vectors.norm(dim=-2))
    return torch.arccos(cos.clamp(max=1.0))


def spread_statistic(n: int, seed: int, dtype: torch.dtype = F64) -> tuple[torch.Tensor, torch.Tensor]:
    """A PSD ``L`` with well-separated eigenvalues, and its eigenvectors in descending order."""
    gen = torch.Generator().manual_seed(seed)
    vectors = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64)).Q
    values = torch.logspace(0, -3, n, dtype=F64)  # descending, ratio ~2.2 between neighbours
    return ((vectors * values) @ vectors.T).to(dtype), vectors.to(dtype)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_refresh_keeps_the_initial_basis_on_a_fixed_statistics_eigenvectors(dtype: torch.dtype) -> None:
    """The refresh QR(L·Q) is orthogonal iteration: its stable fixed point is the eigenbasis in
    descending order. The initial basis must start there, so that with L held fixed the columns
    (and the Hessian H attached to them, which is not rotated) stay on L's eigenvectors."""
    stat, vectors = spread_statistic(8, seed=0, dtype=dtype)
    q = eigenbasis(stat)
    assert float(column_angles(q.double(), vectors.double()).max()) < 1e-3  # descending order
    for _ in range(50):
        q = power_qr(stat.unsqueeze(0), q.unsqueeze(0))[0]
        assert float(column_angles(q.double(), vectors.double()).max()) < 1e-3


def test_an_ascending_basis_drifts_off_the_eigenvectors_under_the_refresh() -> None:
    """Why the order matters: started in eigh's ascending order, the same refresh moves columns
    off their eigenvectors (they slide towards the dominant directions) within a few steps, on
    towards orthogonal iteration's fixed point, the descending order: a column that started on
    one eigenvector ends on another, at right angles to where it started."""
    stat, vectors = spread_statistic(8, seed=0)
    q = torch.linalg.eigh(stat).eigenvectors  # ascending
    ascending = vectors.flip(-1)
    assert float(column_angles(q, ascending).max()) < 1e-6
    for _ in range(20):
        q = power_qr(stat.unsqueeze(0), q.unsqueeze(0))[0]
    assert float(column_angles(q, ascending).max()) == pytest.approx(math.pi / 2, abs=1e-6)


@pytest.mark.parametrize(
    ("shape", "levels"),
    [
        ((2, 8 * GRAM_MIN_BLOCK, 24), 3),  # halved three times
        ((3, 2 * GRAM_MIN_BLOCK + 2, 5), 1),  # one level, then odd halves stop it
        ((1, 2 * GRAM_MIN_BLOCK - 2, 9), 0),  # halves below the minimum block: a plain matmul
        ((2, 3, 5), 0),
    ],
)
@pytest.mark.parametrize("transposed", [False, True])
def test_gram_is_x_xt_with_the_symmetric_savings(
    shape: tuple[int, int, int], levels: int, transposed: bool
) -> None:
    """``gram(X) = X Xᵀ`` (float64, to rounding), exactly symmetric, with the multiply-adds of
    ``levels`` halvings: ``1/2 + 2^-(levels+1)`` of ``X @ X.mT`` (FlopCounterMode's count)."""
    from torch.utils.flop_counter import FlopCounterMode

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen, dtype=F64)
    if transposed:  # the R side passes Gᵀ, a non-contiguous view
        x = torch.randn(shape[0], shape[2], shape[1], generator=gen, dtype=F64).mT
    counter = FlopCounterMode(display=False)
    with counter:
        g = gram(x, blocked=True)  # the accelerators' path (CPU uses one matmul by default)
    expected = x @ x.mT
    torch.testing.assert_close(g, expected, rtol=1e-13, atol=1e-13 * float(expected.abs().max()))
    assert torch.equal(g, g.mT)
    b, m, k = x.shape
    assert counter.get_total_flops() == 2 * b * m * m * k * (0.5 + 2.0 ** -(levels + 1))
    torch.testing.assert_close(gram(x, blocked=False), expected, rtol=0, atol=0)


def test_eigenbasis_signs_do_not_depend_on_the_solver() -> None:
    """Each column's largest entry is positive, so a basis is a function of L alone: the same L
    (up to rounding, e.g. gradients averaged over ranks in another order) gives the same noise.
    ``eigh`` alone returns columns of either sign (about half negative here)."""
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(16, 8, 12, generator=gen, dtype=torch.float64)
    stat = g @ g.mT
    q = eigenbasis(stat)
    top = torch.gather(q, -2, q.abs().argmax(dim=-2, keepdim=True))
    assert bool((top > 0).all())
    evals = torch.linalg.eigvalsh(stat).flip(-1)
    torch.testing.assert_close(q.mT @ stat @ q, torch.diag_embed(evals), atol=1e-10, rtol=0)
    raw = torch.linalg.eigh(stat).eigenvectors.flip(-1)
    assert bool((torch.gather(raw, -2, raw.abs().argmax(dim=-2, keepdim=True)) < 0).any())


def dead_unit_gradient(seed: int) -> torch.Tensor:
    """A float32 384×20 gradient of rank 20 whose 200 rows (dead units) are zero, scattered."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(384, 20, generator=gen) * torch.rand(20, generator=gen) ** 4
    g[:200] = 0
    return g[torch.randperm(384, generator=gen)]


def dead_unit_statistic(seed: int = 2) -> torch.Tensor:
    """L = G Gᵀ (384×384) of a :func:`dead_unit_gradient`: MKL's float32 ``syevd`` fails to converge
    on it (as on a MiniLM fine-tuning run's first statistics at ``ess=10``), float64 does not."""
    g = dead_unit_gradient(seed)
    return g @ g.T


def assert_descending_eigenbasis(q: torch.Tensor, stat: torch.Tensor) -> None:
    """``q`` is orthonormal and diagonalises ``stat`` with its eigenvalues in descending order."""
    eye = torch.eye(q.shape[-1], dtype=F64).expand(q.shape)
    torch.testing.assert_close(q.double().mT @ q.double(), eye, atol=1e-5, rtol=0)
    evals = torch.linalg.eigvalsh(stat.double()).flip(-1)
    scale = float(evals.abs().max())
    rotated = q.double().mT @ stat.double() @ q.double()
    torch.testing.assert_close(rotated, torch.diag_embed(evals), atol=1e-5 * scale, rtol=0)


# MKL's float32 eigh raises on some of these and returns NaN without raising on others (which,
# depends on its thread count): seeds 2, 11 raise, 13, 25 (one thread) and 20, 23 (more) return NaN
@pytest.mark.parametrize("seed", [2, 11, 13, 20, 23, 25])
def test_eigenbasis_of_a_statistic_float32_eigh_cannot_diagonalise(seed: int) -> None:
    """Fine-tuning at ``ess=10`` crashed on its first step: ``linalg.eigh`` raised "failed to
    converge" on a finite statistic with many zero rows (or, silently, gave a NaN basis and NaN
    weights). The basis comes from float64 instead."""
    stat = dead_unit_statistic(seed).unsqueeze(0)
    q = eigenbasis(stat)
    assert q.dtype == torch.float32 and q.shape == stat.shape
    assert_descending_eigenbasis(q, stat)


def raising(x: torch.Tensor):
    raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")


def giving_nan(x: torch.Tensor):
    nan = torch.full_like(x, math.nan)
    return torch.return_types.linalg_eigh((nan[..., 0], nan))


@pytest.mark.parametrize("failure", [raising, giving_nan], ids=["raises", "nan"])
def test_eigenbasis_retries_in_float64_where_float32_eigh_fails(
    failure, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the LAPACK: a float32 eigh that raises or returns NaN gives float64's basis,
    rounded to float32, with the same descending order and column signs."""
    eigh = torch.linalg.eigh

    def float32_fails(x: torch.Tensor):
        return failure(x) if x.dtype == torch.float32 else eigh(x)

    stat, _ = spread_statistic(8, seed=0, dtype=torch.float32)
    stat = torch.stack([stat, stat.flip(0, 1)])
    expected = eigenbasis(stat.double()).float()
    monkeypatch.setattr(torch.linalg, "eigh", float32_fails)
    q = eigenbasis(stat)
    assert q.dtype == torch.float32
    torch.testing.assert_close(q, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("failure", [raising, giving_nan], ids=["raises", "nan"])
def test_a_member_no_eigh_diagonalises_starts_from_the_identity_with_a_warning(
    failure, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One member on which every eigh fails (float32, float64, shifted) keeps the identity (in the
    descending convention: its columns reversed), named in a warning; the others are diagonalised."""
    eigh = torch.linalg.eigh
    stat, _ = spread_statistic(6, seed=0, dtype=torch.float32)
    bad = torch.diag(torch.arange(6.0))

    def fails_on_bad(x: torch.Tensor):
        members = x.reshape(-1, 6, 6).double()
        return failure(x) if any(torch.allclose(m, bad.double(), atol=1e-6) for m in members) else eigh(x)

    monkeypatch.setattr(torch.linalg, "eigh", fails_on_bad)
    with pytest.warns(
        RuntimeWarning, match=r"eigh failed to converge on 1 of 2 Shampoo statistics of shape \(6, 6\)"
    ):
        q = eigenbasis(torch.stack([stat, bad]))
    assert torch.equal(q[1], torch.eye(6).flip(-1))
    assert_descending_eigenbasis(q[0], stat)


@pytest.mark.parametrize("shape", [(3, 5, 8), (2, 8, 5), (6, 6)])
@pytest.mark.parametrize("steps", [5, 0])
@pytest.mark.parametrize("route", ["eigh", "iterations"])
def test_newton_schulz_scale_multiplies_the_result(
    shape: tuple[int, ...], steps: int, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``scale`` rides on the last product (or multiplies the normalised input when no step runs):
    the result is ``scale`` times the unscaled one, for wide, tall and single matrices."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    plain = newton_schulz_by(route, monkeypatch, x, steps=steps)
    scaled = newton_schulz_by(route, monkeypatch, x, steps=steps, scale=2.75)
    torch.testing.assert_close(scaled, 2.75 * plain, rtol=1e-12, atol=1e-14)
    assert plain.shape == x.shape


def newton_schulz_by(route: str, monkeypatch: pytest.MonkeyPatch, x: torch.Tensor, **kwargs) -> torch.Tensor:
    """``newton_schulz`` with its CPU route forced: "eigh" (the Gram's spectrum) or "iterations"."""
    from hf_evon.optim import linalg

    monkeypatch.setattr(linalg, "eigh_beats_iterations", lambda m, n: route == "eigh")
    return linalg.newton_schulz(x, **kwargs)


# one thread (the tests' OMP_NUM_THREADS=1): MKL's float32 eigh of the Gram raises for seed 9 and
# returns NaN for 13 (with more threads: 13 raises, 8 returns NaN)
@pytest.mark.parametrize("seed", [8, 9, 13])
def test_whitening_an_update_whose_gram_float32_eigh_cannot_diagonalise(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU route of ``newton_schulz`` (the "whiten" clips) raised "linalg.eigh: failed to
    converge", or returned NaN, on an update with many zero rows (dead units): MKL's float32 eigh
    fails on its Gram. The result is the iterations' (the same map)."""
    from hf_evon.optim.linalg import eigh_beats_iterations, newton_schulz

    x = torch.cat([dead_unit_gradient(seed), torch.zeros(384, 364)], dim=1).unsqueeze(0)
    assert eigh_beats_iterations(384, 384)  # the eigh route is the default here
    out = newton_schulz(x)
    # where eigh succeeds the two routes differ by float32 rounding, which the iterations amplify up
    # to a⁵ ≈ 490 times on the smallest singular values
    torch.testing.assert_close(out, newton_schulz_by("iterations", monkeypatch, x), atol=1e-3, rtol=0)


@pytest.mark.parametrize("shape", [(2, 5, 8), (2, 8, 5)])
@pytest.mark.parametrize("failure", [raising, giving_nan], ids=["raises", "nan"])
def test_newton_schulz_takes_the_iterations_where_the_grams_eigh_fails(
    shape: tuple[int, ...], failure, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the LAPACK: an eigh that raises or returns NaN on the Gram leaves the iterations'
    result, bit for bit."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    by_products = newton_schulz_by("iterations", monkeypatch, x, scale=0.5)
    monkeypatch.setattr(torch.linalg, "eigh", failure)
    assert torch.equal(newton_schulz_by("eigh", monkeypatch, x, scale=0.5), by_products)


def low_rank(*shape: int, rank: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    left = torch.randn(*shape[:-1], rank, generator=gen, dtype=torch.float64)
    return left @ torch.randn(*shape[:-2], rank, shape[-1], generator=gen, dtype=torch.float64)


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64),
        torch.randn(2, 40, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64),
        torch.randn(6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64),
        low_rank(2, 12, 40, rank=3, seed=4),  # zero singular values
        torch.zeros(2, 4, 7, dtype=torch.float64),
    ],
    ids=["wide", "tall", "square", "rank-3", "zero"],
)
@pytest.mark.parametrize("steps", [5, 2])
@pytest.mark.parametrize("scale", [1.0, 2.75])
def test_newton_schulz_on_the_gram_spectrum_equals_the_iterations(
    x: torch.Tensor, steps: int, scale: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eigh route applies the iterations' polynomial map to the Gram's eigenvalues: the same
    result as the iterations' products, in float64 to rounding, rank-deficient and zero included."""
    by_eigh = newton_schulz_by("eigh", monkeypatch, x, steps=steps, scale=scale)
    by_products = newton_schulz_by("iterations", monkeypatch, x, steps=steps, scale=scale)
    assert by_eigh.shape == x.shape
    torch.testing.assert_close(by_eigh, by_products, rtol=0, atol=1e-12)


@pytest.mark.parametrize("route", ["eigh", "iterations"])
def test_newton_schulz_of_a_huge_finite_float32_matrix_is_that_of_the_matrix_scaled_down(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whitening ignores scale: entries of 1e20, all finite, whose float32 Frobenius norm overflows
    (it gave zeros by the iterations and NaN by the eigh route) whiten as the same matrix at 1."""
    x = torch.randn(2, 8, 24, generator=torch.Generator().manual_seed(3))
    plain = newton_schulz_by(route, monkeypatch, x)
    huge = newton_schulz_by(route, monkeypatch, x * 1e20)
    torch.testing.assert_close(huge, plain, rtol=1e-4, atol=1e-6)


def test_cholesky_qr_of_a_float32_matrix_past_float32s_squares_factors_it() -> None:
    a = with_condition_number(1, 6, 10.0, seed=2)
    q, failed = cholesky_qr((a * 1e20).float())  # column norms past 1.8e19 overflowed float32
    assert not bool(failed.any()) and q.dtype == torch.float32
    assert_is_q_of(q.double(), a, tol=1e-5)


@pytest.mark.parametrize("route", ["eigh", "iterations"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_newton_schulz_of_a_non_finite_matrix_is_nan_and_spares_the_others(
    route: str, bad: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN or inf entry makes its own matrix NaN everywhere on both routes (the optimizer's
    finiteness check sees it), and the eigh route neither raises nor touches the stack's others."""
    x = torch.randn(3, 6, 9, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    clean = newton_schulz_by("iterations", monkeypatch, x)
    x[1, 2, 3] = bad
    out = newton_schulz_by(route, monkeypatch, x)
    assert bool(out[1].isnan().all())
    torch.testing.assert_close(out[[0, 2]], clean[[0, 2]], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("shape", "dtype", "eighs"),
    [
        ((2, 256, 1024), torch.float32, 1),  # wide: the Gram's eigh costs a fraction of the products
        ((1024, 256), torch.float32, 1),  # tall: the same after the transpose
        ((2, 64, 128), torch.float32, 0),  # small: the eigh's overhead outweighs the products
        ((64, 256), torch.float32, 0),  # narrow but small: the same
        ((256, 256), torch.float32, 0),  # square: the products win on two threads
        ((2, 384, 384), torch.float32, 1),  # square from ~370: the eigh wins on one and two threads
        ((256, 384), torch.float32, 1),  # a little wider than square
        ((256, 1024), torch.bfloat16, 0),  # no eigh in bfloat16
    ],
)
def test_newton_schulz_takes_the_eigh_route_where_its_cost_model_says(
    shape: tuple[int, ...], dtype: torch.dtype, eighs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_evon.optim import linalg

    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda g: calls.append(g.shape) or eigh(g))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(8)).to(dtype)
    out = linalg.newton_schulz(x)
    m, n = sorted(shape[-2:])
    assert linalg.eigh_beats_iterations(m, n) == (eighs > 0 or dtype == torch.bfloat16)
    assert len(calls) == eighs and all(c[-1] == m for c in calls)
    assert out.shape == x.shape and out.dtype == dtype


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("right", [True, False])
@pytest.mark.parametrize("add", [True, False])
def test_unrotate_scaled_is_alpha_q_x_qt_plus_beta_c_in_a_new_tensor(left: bool, right: bool, add: bool) -> None:
    from hf_evon.optim.linalg import unrotate_scaled

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64)
    q_l = torch.linalg.qr(torch.randn(2, 4, 4, generator=gen, dtype=torch.float64)).Q if left else None
    q_r = torch.linalg.qr(torch.randn(2, 3, 3, generator=gen, dtype=torch.float64)).Q if right else None
    c = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64) if add else None
    before = x.clone()
    out = unrotate_scaled(x, q_l, q_r, 0.5, c, -3.0)
    expected = 0.5 * (q_l if left else torch.eye(4, dtype=torch.float64)) @ x @ (
        q_r.mT if right else torch.eye(3, dtype=torch.float64)
    )
    if add:
        expected = expected - 3.0 * c
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(x, before) and out.data_ptr() != x.data_ptr()


def test_power_qr_many_splits_a_group_at_its_entry_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A grouped refresh call takes statistics of at most ``REFRESH_CALL_ENTRIES`` entries (a
    stack over the bound goes alone), so refreshing every matrix at once stays in calls of bounded
    memory; the bases are those of one call per stack, bit for bit, on either QR path."""
    from hf_evon.optim import linalg

    gen = torch.Generator().manual_seed(3)

    def stack(batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.randn(batch, n, 2 * n, generator=gen)
        stat = g @ g.mT
        return stat, eigenbasis(stat + torch.randn(batch, n, n, generator=gen).mul(0.1).add(torch.randn(n, n).mT))

    pairs = [stack(1, 12), stack(3, 12), stack(2, 7), stack(2, 12), stack(5, 12)]
    sizes = []
    real = linalg.power_qr

    def counting(stat: torch.Tensor, q: torch.Tensor, householder: bool | None = None) -> torch.Tensor:
        sizes.append(tuple(stat.shape))
        return real(stat, q, householder=householder)

    monkeypatch.setattr(linalg, "power_qr", counting)
    monkeypatch.setattr(linalg, "REFRESH_CALL_ENTRIES", 4 * 12 * 12)  # four 12×12 members a call
    for householder in (True, False):
        sizes.clear()
        grouped = linalg.power_qr_many(pairs, grouped=True, householder=householder)
        assert sizes == [(4, 12, 12), (2, 12, 12), (5, 12, 12), (2, 7, 7)]
        alone = linalg.power_qr_many(pairs, grouped=False, householder=householder)
        assert len(grouped) == len(alone) == len(pairs)
        for new, one, (stat, _) in zip(grouped, alone, pairs):
            assert new.shape == stat.shape
            assert torch.equal(new, one)


def test_cholesky_factors_one_member_at_a_time_equal_the_batched_call() -> None:
    """Where an accelerator factors each member of a large stack alone (cuSOLVER's batched Cholesky
    is several times slower there), the factors and the per-member ``info`` equal the batched
    call's, a member that is not positive definite flagged at its own place."""
    from hf_evon.optim.linalg import cholesky_factors

    x = with_condition_number(4, 24, 100.0, seed=13)
    gram = x.mT @ x
    gram[2] = -gram[2]  # not positive definite
    low, info = cholesky_factors(gram, alone=False)
    low_alone, info_alone = cholesky_factors(gram, alone=True)
    assert info.tolist()[0] == info.tolist()[1] == info.tolist()[3] == 0 and info.tolist()[2] != 0
    assert torch.equal(info_alone, info)
    assert torch.equal(low_alone[[0, 1, 3]], low[[0, 1, 3]])
    torch.testing.assert_close(low_alone[0] @ low_alone[0].mT, gram[0], rtol=1e-12, atol=0)
    assert torch.equal(cholesky_factors(gram[:1], alone=True)[0], low[:1])  # one member: one call


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 6, 6), (3, 12, 12), (2, 9, 5)])
def test_householder_q_is_linalg_qrs_q_bit_for_bit(dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    """The CPU refresh's Q, from ``geqrf`` and ``householder_product`` without R, is
    ``torch.linalg.qr``'s Q exactly (the same LAPACK calls), also for a zero member (Q = I)."""
    from hf_evon.optim.linalg import householder_q

    a = torch.randn(*shape, generator=torch.Generator().manual_seed(5), dtype=dtype)
    a[0] = 0.0
    q = householder_q(a)
    assert q.dtype == dtype and q.shape == shape
    assert torch.equal(q, torch.linalg.qr(a).Q)
    assert torch.equal(q[0], torch.eye(*shape[1:], dtype=dtype))


def test_a_basis_made_to_pass_the_seed_0_probes_is_not_orthonormal_to_a_fresh_check() -> None:
    """The check's two probes were drawn from seed 0 every time: ``Q = I + 1e4·uuᵀ`` with ``u``
    orthogonal to them gave ``QᵀQx = x`` on both, and a file carrying it loaded (its std ~8000× the
    honest one). Probes drawn afresh see that QᵀQ is far from I; an orthonormal Q still passes."""
    from hf_evon.optim.linalg import orthonormality_error

    probes = torch.randn(4, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u = torch.linalg.qr(torch.cat([probes, torch.eye(4, dtype=torch.float64)[:, :2]], 1))[0][:, 2]
    crafted = torch.eye(4, dtype=torch.float64) + 1e4 * torch.outer(u, u)
    assert orthonormality_error(crafted) < 1e-6  # seed 0's probes see I: decisions on them repeat exactly
    assert all(orthonormality_error(crafted, fresh=True) > 1.0 for _ in range(20))
    honest = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64))[0]
    assert all(orthonormality_error(honest, fresh=True) < 1e-12 for _ in range(20))
