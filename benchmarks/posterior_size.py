"""File size of a GPT-2-small EVON posterior, with float32 and half-precision eigenbases.

GPT-2 small (``GPT2Config()`` defaults, 124M parameters): ``build_param_groups`` gives EVON
the 48 block matrices (per block ``attn.c_attn`` 768×2304, ``attn.c_proj`` 768×768,
``mlp.c_fc`` 768×3072, ``mlp.c_proj`` 3072×768); everything else is AdamW (point
estimates). The posterior stores per matrix ``Q_L`` (m×m), ``Q_R`` (n×n) and ``H`` (m×n),
so its size depends only on these shapes and the dtypes, not on the values.

Factors (default ``--factors direct``): orthonormal bases built as Kronecker products of
small random orthogonal matrices (exactly orthonormal, dense, cheap) and a positive random
``H``, assembled with ``EVONPosterior.from_factors``. ``--factors optimizer`` instead runs
one initialising EVON step on random tokens (a real eigendecomposition of every L and R;
minutes on a GPU, far longer on a CPU: a 3072×3072 ``eigh`` alone takes ~1 min here).

Prints the sizes of ``model.safetensors``, of the posterior with float32, bfloat16 and
float16 bases, save/load times and the orthonormality of the reloaded half-precision bases.

    python benchmarks/posterior_size.py [--factors direct|optimizer] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hf_evon
from hf_evon import EVONPosterior
from hf_evon.optim import build_param_groups
from hf_evon.optim.evon import matrix_shape, preconditioned_sides
from hf_evon.posterior import POSTERIOR_WEIGHTS_NAME, MatrixFactors
from hf_evon.posterior_math import orthonormality_error


def _orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    """A dense n×n orthonormal matrix: kron of two small random orthogonal factors."""
    a = next(d for d in range(int(math.isqrt(n)), 0, -1) if n % d == 0)
    qa = torch.linalg.qr(torch.randn(a, a, generator=gen, dtype=torch.float64)).Q
    qb = torch.linalg.qr(torch.randn(n // a, n // a, generator=gen, dtype=torch.float64)).Q
    return torch.kron(qa, qb).float()


def direct_posterior(model: torch.nn.Module) -> EVONPosterior:
    groups = build_param_groups(model)
    evon = next(g for g in groups if g["algorithm"] == "evon")
    gen = torch.Generator().manual_seed(0)
    factors = {}
    for name, p in zip(evon["param_names"], evon["params"]):
        m, n = matrix_shape(p.shape)
        left, right = preconditioned_sides(tuple(p.shape), 4096, False)
        factors[name] = MatrixFactors(
            Q_L=_orthogonal(m, gen) if left else None,
            Q_R=_orthogonal(n, gen) if right else None,
            hess=0.1 * torch.exp(torch.randn(m, n, generator=gen)),
            shape=tuple(p.shape),
            matrix_shape=(m, n),
            ess=1e6,
            weight_decay=1e-4,
        )
    covered = {id(p) for p in evon["params"]}
    points = [p for p in model.parameters() if id(p) not in covered]
    config = {
        "ess": 1e6,
        "weight_decay": 1e-4,
        "hess_init": 0.1,
        "betas": (0.9, 0.999),
        "precondition_frequency": 10,
    }
    return EVONPosterior.from_factors(factors, config, sum(p.numel() for p in points), len(points))


def optimizer_posterior(model: torch.nn.Module) -> EVONPosterior:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    opt = hf_evon.build_optimizer(model, lr=1e-3, ess=1e6, precondition_frequency=10, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 128), device=device)
    with opt.sampled_params(train=True):
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # the initialising step: L, R and Q = eigh(L), eigh(R)
    return EVONPosterior.from_optimizer(opt, model).to("cpu")


def mib(n: int) -> str:
    return f"{n / 2**20:8.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--factors", choices=("direct", "optimizer"), default="direct")
    parser.add_argument("--out", default=None, help="directory to write into (default: a temporary one)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    n_params = sum(p.numel() for p in model.parameters())
    out = args.out or tempfile.mkdtemp(prefix="evon_posterior_size_")
    model.save_pretrained(os.path.join(out, "model"))
    model_size = os.path.getsize(os.path.join(out, "model", "model.safetensors"))

    t0 = time.perf_counter()
    posterior = direct_posterior(model) if args.factors == "direct" else optimizer_posterior(model)
    build_s = time.perf_counter() - t0
    basis = sum(q.numel() for f in posterior.factors.values() for q in (f.Q_L, f.Q_R) if q is not None)
    hess = sum(f.hess.numel() for f in posterior.factors.values())
    print(f"GPT-2 small: {n_params:,} parameters; {posterior!r}")
    print(
        f"factors ({args.factors}) built in {build_s:.1f} s: {basis:,} basis entries, {hess:,} Hessian entries"
    )
    print(f"{'file':44s} {'size':>12s} {'vs model':>9s} {'save':>7s} {'load':>7s}  max ‖QᵀQx−x‖/‖x‖")
    print(f"{'model.safetensors (float32)':44s} {mib(model_size)} {1.0:9.2f}")
    for label, dtype in (("float32", None), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        directory = os.path.join(out, f"posterior_{label}")
        t0 = time.perf_counter()
        posterior.save_pretrained(directory, eigenbasis_dtype=dtype, model_card=False)
        save_s = time.perf_counter() - t0
        size = os.path.getsize(os.path.join(directory, POSTERIOR_WEIGHTS_NAME))
        t0 = time.perf_counter()
        loaded = EVONPosterior.from_pretrained(directory)
        load_s = time.perf_counter() - t0
        worst = max(
            orthonormality_error(q) for f in loaded.factors.values() for q in (f.Q_L, f.Q_R) if q is not None
        )
        name = f"{POSTERIOR_WEIGHTS_NAME} ({label} bases)"
        print(f"{name:44s} {mib(size)} {size / model_size:9.2f} {save_s:6.1f}s {load_s:6.1f}s  {worst:.2e}")
        del loaded
    print(f"files in {out}")


if __name__ == "__main__":
    main()
