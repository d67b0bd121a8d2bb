"""How fast can the eigenbasis refresh (one power iteration + QR) be on this device?

Two parts, on the GPT-2-small EVON matrices:

* ``--part batch``: the whole refresh batch (60 statistics of 768², 12 of 2304², 24 of 3072²)
  through each QR considered: cuSOLVER's Householder QR (and ``eigh``, for scale),
  ``linalg.cholesky_qr`` (shifted CholeskyQR3 in float64, members factored together; or one call
  per member, or on one or two members, what a call costs: ``buckets.assign_refresh_phases``), an
  unshifted CholeskyQR3 in float32, the library's replayed from a CUDA graph (what
  launches cost), and CholeskyQR3 with each pass done another way (``PASSES``: its triangular
  solve, or its Gram by ``linalg.gram``'s blocked product).
  Each row also gives its largest distance from the library's Q and from orthonormality.
* ``--part step``: EVON's whole step on the 48 block matrices (``step_profile.gpt2_block_step``:
  default settings, staggered refresh, random gradients), median of 30 synced steps (3 refresh
  cycles), with ``linalg._cholesky_qr_pass`` replaced by each of ``PASSES`` in turn; with the
  refresh factored in the other ways of ``REFRESH_VARIANTS`` (one QR call per bucket and side
  instead of one per side size, ``linalg.power_qr_many``; cuSOLVER's batched Cholesky for large
  sides too, ``linalg.cholesky_factors``); and the step with no refresh at all (a refresh period
  longer than the run), the floor the refresh adds to.
* ``--part phases``: the refresh of each step of a staggered cycle alone, under each of
  ``REFRESH_VARIANTS``.

``--library magma`` runs it all with torch's MAGMA backend instead of cuSOLVER. Used to choose the
refresh implementation in ``hf_evon/optim/linalg.py`` (docs/defaults.md#cholesky-qr).
``--device cpu --small`` checks the script in seconds (a 1-layer 128-wide GPT-2, small batches).

On an H200 (2026-11-28, benchmarks/results/gpu_h200/eigenbasis_refresh_2026-11-28.log): the batch
356 ms through the library's CholeskyQR3 (Householder 797), 334 to 456 ms through the other passes,
355 ms replayed from a CUDA graph; the step 94.9 ms with the library's pass, 90.8 to 113.1 ms with
the others, and 20.6 ms without a refresh. On an H200 (2026-11-30, gpu_h200/*_2026-11-30b.*): the
step 79.3 ms with the library's refresh, 86.4 ms with one call per bucket and side, 21.1 ms without
a refresh; a staggered cycle's refresh (``--part phases``' code) 551 ms, 595 ungrouped, 789 with
the batched Cholesky for large sides, 724 ungrouped and batched.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from hf_evon.optim import functional, linalg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_profile import gpt2_block_step  # noqa: E402

Tensor = torch.Tensor
QrPass = Callable[..., tuple[Tensor, Tensor]]  # (A, shift=None) -> (Q, Cholesky info), as linalg's pass
# below this side a block's triangular inverse is one solve against the identity
INVERSE_BLOCK = 128


def solve_left(a: Tensor, low: Tensor) -> Tensor:
    """``A L⁻ᵀ = (L⁻¹ Aᵀ)ᵀ``: a left-sided solve on the transpose (no copy; the result is a view)."""
    return torch.linalg.solve_triangular(low, a.mT, upper=False).mT


def identity_like(low: Tensor) -> Tensor:
    return torch.eye(low.shape[-1], dtype=low.dtype, device=low.device).expand_as(low)


def inverse_then_product(a: Tensor, low: Tensor) -> Tensor:
    """``A (L⁻¹)ᵀ`` with ``L⁻¹`` from one solve against the identity: the solve on n² columns
    once, then a plain product."""
    return a @ torch.linalg.solve_triangular(low, identity_like(low), upper=False).mT


def lower_inverse(low: Tensor) -> Tensor:
    """``L⁻¹`` of a stack of lower-triangular matrices, mostly as products: for
    ``L = [[A, 0], [C, D]]``, ``L⁻¹ = [[A⁻¹, 0], [-D⁻¹ C A⁻¹, D⁻¹]]``, where the diagonal blocks of
    all members are inverted as one stack of twice the size, down to ``INVERSE_BLOCK``."""
    b, n, _ = low.shape
    if n <= INVERSE_BLOCK or n % 2:
        return torch.linalg.solve_triangular(low, identity_like(low), upper=False)
    h = n // 2
    inv = lower_inverse(torch.cat([low[:, :h, :h], low[:, h:, h:]]))
    out = low.new_zeros(b, n, n)
    out[:, :h, :h] = inv[:b]
    out[:, h:, h:] = inv[b:]
    out[:, h:, :h] = -(inv[b:] @ low[:, h:, :h] @ inv[:b])
    return out


def recursive_inverse_then_product(a: Tensor, low: Tensor) -> Tensor:
    """``A (L⁻¹)ᵀ`` with ``L⁻¹`` from :func:`lower_inverse` (few large products, few launches)."""
    return a @ lower_inverse(low).mT


def qr_pass_blocked_gram(a: Tensor, shift: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A CholeskyQR pass on ``Aᵀ`` kept row-major: its Gram by ``linalg.gram`` (the blocked,
    syrk-like product, about half the multiply-adds of ``Aᵀ A``) and a left-sided solve."""
    y = a.mT.contiguous()
    gram = linalg.gram(y, blocked=True)
    if shift is not None:
        gram.diagonal(dim1=-2, dim2=-1).add_(shift)
    low, info = torch.linalg.cholesky_ex(gram)
    return torch.linalg.solve_triangular(low, y, upper=False).mT, info


def qr_pass_with(solve: Callable[[Tensor, Tensor], Tensor]) -> QrPass:
    """A stand-in for ``linalg._cholesky_qr_pass`` whose solve is ``solve``."""

    def qr_pass(a: Tensor, shift: Tensor | None = None) -> tuple[Tensor, Tensor]:
        gram = a.mT @ a
        if shift is not None:
            gram.diagonal(dim1=-2, dim2=-1).add_(shift)
        low, info = torch.linalg.cholesky_ex(gram)
        return solve(a, low), info

    return qr_pass


PASSES: dict[str, QrPass] = {
    "right solve (library)": linalg._cholesky_qr_pass,
    "left solve": qr_pass_with(solve_left),
    "inverse, product": qr_pass_with(inverse_then_product),
    "recursive inverse, product": qr_pass_with(recursive_inverse_then_product),
    "blocked Gram, left solve": qr_pass_blocked_gram,
}
OTHER_PASSES = {name: p for name, p in PASSES.items() if p is not linalg._cholesky_qr_pass}


@contextlib.contextmanager
def patched(module: object, name: str, value: object) -> Iterator[None]:
    """``module.name`` set to ``value`` inside the block (the library looks it up per call), and
    put back after it, also after an error."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def patched_pass(qr_pass: QrPass) -> contextlib.AbstractContextManager[None]:
    """``linalg._cholesky_qr_pass`` replaced inside the block."""
    return patched(linalg, "_cholesky_qr_pass", qr_pass)


def one_call_per_bucket() -> contextlib.AbstractContextManager[None]:
    """The step's refresh without grouping: one QR call per bucket and side, not one per side size."""
    many = functional.power_qr_many
    return patched(functional, "power_qr_many", lambda pairs: many(pairs, grouped=False))


def batched_cholesky() -> contextlib.AbstractContextManager[None]:
    """Every stack through cuSOLVER's batched Cholesky, large sides too (``CHOLESKY_ALONE_MIN_SIDE``)."""
    return patched(linalg, "CHOLESKY_ALONE_MIN_SIDE", 1 << 62)


@contextlib.contextmanager
def ungrouped_and_batched() -> Iterator[None]:
    with one_call_per_bucket(), batched_cholesky():
        yield


LIBRARY = "library"
# how a step's due refreshes are factored: the library's (sides of one size in one call, members
# of large sides' Cholesky one by one) and the variants it was chosen over (docs/defaults.md#cholesky-qr)
REFRESH_VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    LIBRARY: contextlib.nullcontext,
    "one QR call per bucket, side": one_call_per_bucket,
    "batched Cholesky": batched_cholesky,
    "ungrouped, batched Cholesky": ungrouped_and_batched,
}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timeit(fn: Callable[[], object], device: str, reps: int = 3) -> float:
    fn()
    synchronize(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize(device)
    return (time.perf_counter() - t) / reps * 1e3


def spd(b: int, n: int, device: str) -> Tensor:
    """Statistics of rank 512 (< n for the wide sides): the ill-conditioned case the shift is for."""
    g = torch.randn(b, n, 512, device=device)
    return g @ g.mT / 512 + 1e-6 * torch.eye(n, device=device)


def unshifted_cholqr3(a: Tensor) -> Tensor:
    """CholeskyQR3 in ``a``'s precision, without the shift or the column scaling."""
    for _ in range(3):
        low = torch.linalg.cholesky_ex(a.mT @ a)[0]
        a = torch.linalg.solve_triangular(low.mT, a, upper=True, left=False)
    return a


def graph_replay(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured once in a CUDA graph; the returned function replays it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture (workspaces, handles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def batch_part(device: str, small: bool) -> None:
    sizes = [(6, 48), (2, 96), (2, 160)] if small else [(60, 768), (12, 2304), (24, 3072)]
    torch.manual_seed(0)
    # float64, as power_qr hands the product to cholesky_qr
    stats = {n: spd(b, n, device) for b, n in sizes}
    products = {n: stats[n].double() @ torch.linalg.qr(torch.randn_like(stats[n])).Q.double() for n in stats}
    reference = {n: linalg.cholesky_qr(a)[0] for n, a in products.items()}

    def one_by_one(n: int) -> Tensor:
        return torch.cat([linalg.cholesky_qr(a.unsqueeze(0))[0] for a in products[n]])

    variants: dict[str, Callable[[int], Tensor]] = {
        "householder qr fp32": lambda n: torch.linalg.qr(products[n].float()).Q,
        "eigh fp32 (of the statistic)": lambda n: torch.linalg.eigh(stats[n]).eigenvectors,
        "cholesky_qr (library)": lambda n: linalg.cholesky_qr(products[n])[0],
        "cholesky_qr, one call per member": one_by_one,
        "cholesky_qr, 1 member": lambda n: linalg.cholesky_qr(products[n][:1])[0],
        "cholesky_qr, 2 members": lambda n: linalg.cholesky_qr(products[n][:2])[0],
        "cholqr3 fp32, no shift": lambda n: unshifted_cholqr3(products[n].float()),
    }
    for name, qr_pass in OTHER_PASSES.items():
        variants[f"cholesky_qr, {name}"] = lambda n, qr_pass=qr_pass: qr_with(qr_pass, products[n])
    for name, fn in variants.items():
        cells, total = [], 0.0
        for _, n in sizes:
            ms = timeit(lambda fn=fn, n=n: fn(n), device)
            q = fn(n)
            eye = torch.eye(n, dtype=q.dtype, device=device)
            comparable = not any(k in name for k in ("householder", "eigh"))
            off = float((q - reference[n][: len(q)]).abs().max()) if comparable else float("nan")
            ortho = float((q.mT @ q - eye).abs().max())
            cells.append(f"n={n}: {ms:7.1f} ms (|ΔQ| {off:.0e}, |QᵀQ-I| {ortho:.0e})")
            total += ms
        print(f"{name:42s} " + "  ".join(cells) + f"  total {total:7.1f} ms", flush=True)
    if device == "cuda":
        cells, total = [], 0.0
        for _, n in sizes:
            out: list[Tensor] = []  # holds the captured output, which each replay rewrites
            replay = graph_replay(lambda n=n, out=out: out.append(linalg.cholesky_qr(products[n])[0]))
            ms = timeit(replay, device)
            cells.append(f"n={n}: {ms:7.1f} ms")
            total += ms
        print(f"{'cholesky_qr (library), CUDA graph replay':42s} " + "  ".join(cells) + f"  total {total:7.1f} ms")


def qr_with(qr_pass: QrPass, a: Tensor) -> Tensor:
    with patched_pass(qr_pass):
        return linalg.cholesky_qr(a)[0]


def step_part(device: str, steps: int, all_passes: bool = True) -> None:
    def median_step(**settings: object) -> tuple[float, float]:
        opt, sample_and_grad = gpt2_block_step(device, **settings)
        times = []
        for i in range(12 + steps):
            sample_and_grad()
            synchronize(device)
            t0 = time.perf_counter()
            opt.step()
            synchronize(device)
            if i >= 12:
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times), statistics.mean(times)

    for name, qr_pass in PASSES.items() if all_passes else list(PASSES.items())[:1]:
        with patched_pass(qr_pass):
            median, mean = median_step()
        print(f"step, {name:28s} median {median:7.2f} ms  mean {mean:7.2f} ms", flush=True)
    for name, variant in REFRESH_VARIANTS.items():
        if name != LIBRARY:
            with variant():
                median, mean = median_step()
            print(f"step, {name:28s} median {median:7.2f} ms  mean {mean:7.2f} ms", flush=True)
    median, mean = median_step(precondition_frequency=10**6)
    print(f"step, {'no refresh':28s} median {median:7.2f} ms  mean {mean:7.2f} ms", flush=True)


def phases_part(device: str, repeats: int = 5) -> None:
    """The refresh of each step of a staggered cycle alone (the due members of every bucket, as
    ``refresh_buckets`` gathers them), under each of ``REFRESH_VARIANTS``: median ms per phase
    and their sum over the cycle."""
    opt, sample_and_grad = gpt2_block_step(device)
    for _ in range(12):
        sample_and_grad()
        opt.step()
    f = opt.param_groups[0]["precondition_frequency"]
    totals = dict.fromkeys(REFRESH_VARIANTS, 0.0)
    for phase in range(f):
        pairs = []
        for b in opt.buckets:
            due = [i for i, ph in enumerate(b.refresh_phase) if (phase + ph) % f == 0]
            if due:
                idx = b.member_index(due)
                sides = (("L", "Q_L", b.left), ("R", "Q_R", b.right))
                pairs += [(b.state[stat][idx], b.state[basis][idx]) for stat, basis, on in sides if on]
        cells = []
        for name, variant in REFRESH_VARIANTS.items():
            with variant():
                ms = median_ms(lambda: functional.power_qr_many(pairs), device, repeats)  # noqa: B023
            totals[name] += ms
            cells.append(f"{name} {ms:6.2f}")
        sizes = sorted({p[0].shape[-1] for p in pairs})
        print(f"phase {phase} (sides {sizes}, {sum(p[0].shape[0] for p in pairs)} stacked): " + ", ".join(cells))
    print("per cycle: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in totals.items()), flush=True)


def median_ms(fn: Callable[[], object], device: str, repeats: int) -> float:
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--library", default=None, choices=[None, "cusolver", "magma"])
    ap.add_argument("--part", nargs="+", default=["batch", "step", "phases"], choices=["batch", "step", "phases"])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant (30 = 3 refresh cycles)")
    ap.add_argument("--small", action="store_true", help="small batches (a check of the script)")
    ap.add_argument("--library-pass-only", action="store_true", help="the step part without the other PASSES")
    args = ap.parse_args()
    if args.library:
        torch.backends.cuda.preferred_linalg_library(args.library)
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    library = torch.backends.cuda.preferred_linalg_library() if args.device == "cuda" else "LAPACK"
    print(name, torch.__version__, "library:", library, flush=True)
    if "batch" in args.part:
        batch_part(args.device, args.small)
    if "step" in args.part:
        step_part(args.device, args.steps, all_passes=not args.library_pass_only)
    if "phases" in args.part:
        phases_part(args.device)


if __name__ == "__main__":
    main()
