"""How fast can the eigenbasis refresh (one power iteration + QR) be on this device?

Times, for the GPT-2-small EVON matrices (60 of 768², 12 of 2304², 24 of 3072² statistics),
the QR variants we considered. Used to choose the refresh implementation in linalg.py:
``cholesky_qr`` with its members factored together (cuSOLVER's batched Cholesky) or one call per
member, and on one or two members of each shape (the cost of a call: buckets.assign_refresh_phases).
"""

from __future__ import annotations

import argparse
import time

import torch


def timeit(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def spd(b: int, n: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.randn(b, n, 512, device="cuda", dtype=dtype)
    return g @ g.mT / 512 + 1e-6 * torch.eye(n, device="cuda", dtype=dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--library", default=None, choices=[None, "cusolver", "magma"])
    args = ap.parse_args()
    if args.library:
        torch.backends.cuda.preferred_linalg_library(args.library)
    sizes = [(60, 768), (12, 2304), (24, 3072)]
    stats = {n: spd(b, n) for b, n in sizes}
    qs = {n: torch.linalg.qr(torch.randn(b, n, n, device="cuda")).Q for b, n in sizes}
    from hf_evon.optim.linalg import cholesky_qr

    def cholqr(n: int, dtype: torch.dtype) -> torch.Tensor:
        a = (stats[n] @ qs[n]).to(dtype)
        for _ in range(3):
            r = torch.linalg.cholesky_ex(a.mT @ a, upper=True)[0]
            a = torch.linalg.solve_triangular(r, a, upper=True, left=False)
        return a

    def piece(n: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        a = (stats[n] @ qs[n]).to(dtype)
        if what == "gram":
            return a.mT @ a
        g = a.mT @ a + torch.eye(n, device="cuda", dtype=dtype) * 1e3
        r = torch.linalg.cholesky_ex(g, upper=True)[0]
        return r if what == "cholesky" else torch.linalg.solve_triangular(r, a, upper=True, left=False)

    torch.backends.cuda.matmul.allow_tf32 = False
    variants = {
        "householder qr fp32": lambda n: torch.linalg.qr(stats[n] @ qs[n]).Q,
        "cholesky_qr": lambda n: cholesky_qr(stats[n] @ qs[n]),
        "cholesky_qr 1-by-1": lambda n: [cholesky_qr(stats[n][i : i + 1] @ qs[n][i : i + 1]) for i in range(len(qs[n]))],
        "cholesky_qr 1 member": lambda n: cholesky_qr(stats[n][:1] @ qs[n][:1]),
        "cholesky_qr 2 members": lambda n: cholesky_qr(stats[n][:2] @ qs[n][:2]),
        "cholqr3 fp32 no shift": lambda n: cholqr(n, torch.float32),
        "cholqr3 fp64 no shift": lambda n: cholqr(n, torch.float64),
        "gram fp64": lambda n: piece(n, torch.float64, "gram"),
        "gram+chol fp64": lambda n: piece(n, torch.float64, "cholesky"),
        "gram+chol+trsm fp64": lambda n: piece(n, torch.float64, "trsm"),
        "gram fp32": lambda n: piece(n, torch.float32, "gram"),
        "gram+chol fp32": lambda n: piece(n, torch.float32, "cholesky"),
        "gram+chol+trsm fp32": lambda n: piece(n, torch.float32, "trsm"),
        "eigh fp32": lambda n: torch.linalg.eigh(stats[n]).eigenvectors,
    }
    print(
        torch.cuda.get_device_name(),
        torch.__version__,
        "library:",
        torch.backends.cuda.preferred_linalg_library(),
    )
    for name, fn in variants.items():
        times = {n: timeit(lambda fn=fn, n=n: fn(n)) for _, n in sizes}
        print(
            f"{name:22s} "
            + "  ".join(f"n={n}: {t:7.1f} ms" for n, t in times.items())
            + f"  total {sum(times.values()):7.1f} ms"
        )


if __name__ == "__main__":
    main()
