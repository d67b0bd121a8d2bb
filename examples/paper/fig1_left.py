"""Fig. 1 (left): 2-D Bayesian logistic regression, exact posterior vs Gaussian fits.

Linearly separable 2-D data (a stand-in for the dataset of Murphy's Bayesian logistic
regression chapter, which is not on this machine), no bias, prior N(0, 100 I). Drawn: the
exact posterior density on a grid, the optimal full Gaussian (L-BFGS on the exact variational
objective), the optimal diagonal Gaussian, and the 1-σ/2-σ ellipses of EVON and IVON (EVON with
``identity_basis=True``) after many small steps. Reported: KL(q ‖ optimal full Gaussian).

    python examples/paper/fig1_left.py [--fast] [--out-dir DIR]
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common, next to this file
from _common import (  # noqa: E402
    COLORS,
    F64,
    PAPER_EVON,
    LogisticObjective,
    Outputs,
    ellipse_xy,
    evon_settings,
    gaussian_kl,
    markdown_table,
    parse_args,
    setup_matplotlib,
    train_variational,
)

from hf_evon import EVON  # noqa: E402

NAME = "fig1_left"
PRIOR_VARIANCE = 100.0  # Murphy's choice for this example
LR = 0.2  # small steps (element-wise clip 0.1), many of them: the paper's recipe for convergence
N = 20  # data points
MC_SAMPLES = 4
DATA_KEYS: tuple[str, ...] = ()  # settings that come from the data (none: the data are generated)


def separable_data(n: int = 20, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points in 2-D with correlated features, labels ±1 by the sign of ``x · (1, −1)``:
    the posterior is strongly correlated (ρ ≈ −0.96), so a diagonal Gaussian fits it badly."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 2, generator=g, dtype=F64) @ torch.tensor([[1.0, 0.8], [0.0, 0.5]], dtype=F64)
    y = torch.where(X @ torch.tensor([1.0, -1.0], dtype=F64) > 0, 1.0, -1.0).to(F64)
    return X, y


def evon_kwargs(n: int, identity_basis: bool, seed: int) -> dict[str, Any]:
    """EVON (or IVON mode) with ζ = n and the prior N(0, 100 I): the paper's algorithm."""
    return dict(
        lr=LR,
        ess=float(n),
        hess_init=0.1,
        weight_decay=1.0 / (PRIOR_VARIANCE * n),
        betas=(0.9, 0.999),
        mc_samples=MC_SAMPLES,
        clip="element",
        hess_clip_ratio=None,  # the paper's small-scale runs use no Hessian clipping
        clip_radius=0.1,
        identity_basis=identity_basis,
        precondition_frequency=10,
        seed=seed,
        **PAPER_EVON,
    )


def settings(fast: bool, seed: int) -> dict[str, Any]:
    """Everything the results depend on, optimizers resolved (cheap: no training)."""
    return dict(
        n=N,
        prior_variance=PRIOR_VARIANCE,
        steps=1500 if fast else 20000,
        lr=LR,
        mc_samples=MC_SAMPLES,
        optimizers={m: evon_settings(evon_kwargs(N, m == "IVON", seed)) for m in ("EVON", "IVON")},
    )


def fit(
    X: torch.Tensor, y: torch.Tensor, *, identity_basis: bool, steps: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """EVON (or IVON mode); returns mean and covariance."""
    w = torch.nn.Parameter(torch.zeros(1, 2, dtype=F64))  # a 1×2 matrix: Q_R is 2×2
    opt = EVON([w], **evon_kwargs(len(y), identity_basis, seed))
    train_variational(opt, lambda: F.softplus(-y * (X @ w[0])).mean(), steps=steps, lr=LR, decay_frac=1 / 2)
    return w.detach()[0].clone(), opt.posterior_covariance(w)


def run(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(__doc__, argv)
    config = settings(args.fast, args.seed)
    steps = config["steps"]
    X, y = separable_data(n=N, seed=args.seed)
    n = len(y)
    objective = LogisticObjective(X, y, ess=float(n), delta=1.0 / (PRIOR_VARIANCE * n))
    out = Outputs(NAME, args, config)

    gaussians: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    mu, cov, _ = objective.optimum(full=True)
    gaussians["optimal full Gaussian"] = (mu, cov)
    mu, cov, _ = objective.optimum(full=False)
    gaussians["optimal diagonal Gaussian"] = (mu, cov)
    gaussians["EVON"] = fit(X, y, identity_basis=False, steps=steps, seed=args.seed)
    gaussians["IVON"] = fit(X, y, identity_basis=True, steps=steps, seed=args.seed)

    ref_mu, ref_cov = gaussians["optimal full Gaussian"]
    results = {}
    for name, (mu, cov) in gaussians.items():
        results[name] = dict(
            mean=mu,
            cov=cov,
            kl_to_optimum=gaussian_kl(mu, cov, ref_mu, ref_cov),
            objective=float(objective(mu, cov)),
        )

    plt = setup_matplotlib()
    fig, ax = plt.subplots(figsize=(5.6, 5))
    lo = torch.minimum(ref_mu - 3.5 * ref_cov.diagonal().sqrt(), torch.tensor(-1.0, dtype=F64))
    hi = ref_mu + 3.5 * ref_cov.diagonal().sqrt()
    g0 = torch.linspace(float(lo[0]), float(hi[0]), 240, dtype=F64)
    g1 = torch.linspace(float(lo[1]), float(hi[1]), 240, dtype=F64)
    W = torch.stack(torch.meshgrid(g0, g1, indexing="xy"), -1)
    logp = objective.log_posterior(W)
    ax.contourf(g0, g1, torch.exp(logp - logp.max()), levels=12, cmap="Greys", alpha=0.8)
    ax.plot([], [], color=COLORS["exact posterior"], lw=6, label="exact posterior")
    for name, (mu, cov) in gaussians.items():
        # the optima wide and pale underneath, the fits narrow on top: a fit that reaches its
        # optimum (EVON the full one, IVON the diagonal one) lies on it and both stay visible
        fitted = name in ("EVON", "IVON")
        for radius, style in ((1.0, "-"), (2.0, "--")):
            xy = ellipse_xy(mu, cov, radius)
            kl = max(results[name]["kl_to_optimum"], 0.0)  # rounding can make the optimum's -0.000
            ax.plot(
                xy[:, 0],
                xy[:, 1],
                style,
                color=COLORS[name],
                lw=1.6 if fitted else 5.0,
                alpha=1.0 if fitted else 0.45,
                zorder=3 if fitted else 2,
                label=f"{name} (KL {kl:.3f})" if radius == 1.0 else None,
            )
        ax.plot(*mu.tolist(), "o", color=COLORS[name], ms=4, zorder=4 if fitted else 2)
    ax.set(
        xlabel="$w_1$",
        ylabel="$w_2$",
        title="2-D logistic regression: posterior and Gaussian fits\n(1σ solid, 2σ dashed; KL(q ‖ optimal full))",
    )
    ax.legend(fontsize=8, loc="upper right")  # the posterior runs from upper left to lower right

    rows = [
        [name, r["kl_to_optimum"], r["objective"], f"({r['mean'][0]:.2f}, {r['mean'][1]:.2f})"]
        + [
            f"{math.sqrt(float(r['cov'][0, 0])):.2f}, {math.sqrt(float(r['cov'][1, 1])):.2f}",
            f"{float(r['cov'][0, 1] / (r['cov'][0, 0] * r['cov'][1, 1]).sqrt()):.3f}",
        ]
        for name, r in results.items()
    ]
    table = markdown_table(
        ["Gaussian", "KL(q ‖ optimal full)", "variational objective", "mean", "std w1, w2", "correlation"],
        rows,
    )
    return out.write(
        fig,
        "Fig. 1 (left): 2-D logistic regression, Gaussian fits to the exact posterior",
        table,
        results,
        notes="The variational objective ζ E_q[ℓ] + KL(q ‖ prior) is computed exactly (Gauss–Hermite "
        "quadrature of each margin); the optimal full Gaussian minimises it, so it is the floor.",
    )


if __name__ == "__main__":
    run()
