"""What every paper script shares: command line, colours, output files, Gaussian algebra.

Each script writes ``<name>.png``, ``<name>.md`` and ``<name>.json`` into ``--out-dir``
(default: ``examples/paper/results``). ``--fast`` (or ``HF_EVON_PAPER_FAST=1``) runs a
shrunken version in seconds: the test suite runs that, so no script can rot.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hf_evon import EVON
from hf_evon.optim.recipes import PAPER_ALGORITHM

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results")
F64 = torch.float64

# The paper's algorithm, every option whose library default differs from it spelled out, so a
# default added or changed later cannot change what these scripts compute: PAPER_ALGORITHM (the
# Price estimate, the per-entry Newton step, no SNR step-size rule, every eigenbasis refreshed on
# the same steps) and no L2 pull on the mean besides δ's. The scripts also pass ess, weight_decay, hess_init, lr, betas, clip,
# clip_radius and hess_clip_ratio themselves, as the paper's tables give them.
PAPER_EVON: dict[str, Any] = dict(PAPER_ALGORITHM, mean_weight_decay=0.0, phased_gradients=False)

# One colour per method, the same in every figure (Paul Tol's "bright"/"muted" palettes).
COLORS = {
    "exact posterior": "#BBBBBB",
    "NUTS": "#888888",
    "optimal full Gaussian": "#000000",
    "optimal diagonal Gaussian": "#AA3377",
    "EVON": "#CC3311",
    "IVON": "#0077BB",
    "SOAP": "#009988",
    "AdamW": "#EE7733",
}
# the ablation's EVON variants (Table 3), none in a method's colour: the colour says which of
# PG and clip a variant has (Paul Tol's "muted" palette), a dashed line that it whitens
VARIANT_COLORS = {
    "Plain": "#332288",
    "Clip": "#DDCC77",
    "PG": "#88CCEE",
    "PG+clip": "#117733",
    "Whiten": "#332288",
    "Whiten+clip": "#DDCC77",
    "Whiten+PG": "#88CCEE",
    "Whiten+PG+clip": "#117733",
}


def parse_args(
    doc: str | None, argv: Sequence[str] | None, add: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """``--fast``, ``--out-dir``, ``--seed`` plus the script's own options."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--fast",
        action="store_true",
        default=os.environ.get("HF_EVON_PAPER_FAST", "") not in ("", "0"),
        help="a shrunken run (what the test suite runs: seconds; table2_finetune.py up to two minutes on 2 busy CPU cores); also HF_EVON_PAPER_FAST=1",
    )
    ap.add_argument(
        "--out-dir",
        default=None,
        help="where the PNG, markdown table and JSON go (default: results/ beside the scripts, whose files the "
        "README shows; with --fast, hf_evon_paper_fast/ in the temporary directory, so a shrunken run never "
        "replaces them)",
    )
    ap.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    if add is not None:
        add(ap)
    args = ap.parse_args(list(argv) if argv is not None else None)
    args.command_line = list(argv) if argv is not None else sys.argv[1:]  # what the record names as its source
    if args.out_dir is None:
        args.out_dir = os.path.join(tempfile.gettempdir(), "hf_evon_paper_fast") if args.fast else DEFAULT_OUT
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        ap.error(f"--out-dir {args.out_dir!r} is a file, not a directory")
    return args


def setup_matplotlib() -> Any:
    """The non-interactive backend (no display needed); returns ``pyplot``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "font.size": 10})
    return plt


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.4g}" if math.isfinite(x) else str(x)
        return str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def jsonable(x: Any) -> Any:
    """Tensors and arrays as lists, non-finite floats as strings (JSON has no inf/nan)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if torch.is_tensor(x) or isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # JSON has no inf/nan: written as "inf"
    return x


# ----------------------------------------------------------------------------- settings hash
def param_group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's hyperparameters as the optimizer resolved them (names, not tensors);
    ``configured_lr`` is the group's lr as built, a record for the posterior file, not a setting."""
    return [{k: v for k, v in g.items() if k not in ("params", "configured_lr")} for g in optimizer.param_groups]


def evon_settings(kwargs: dict[str, Any], params: Any = None) -> dict[str, Any]:
    """What ``EVON(params, **kwargs)`` runs with: the arguments given and the constructor's
    resolved groups, i.e. the library's defaults for everything not given (``params`` None: one
    2×2 matrix, enough for groups whose values do not depend on the weights)."""
    params = [torch.nn.Parameter(torch.zeros(2, 2))] if params is None else params
    opt = EVON(params, **kwargs)
    return dict(kwargs=kwargs, groups=param_group_settings(opt), nonfinite=opt.nonfinite)


def settings_hash(settings: dict[str, Any]) -> str:
    """SHA-256 of the settings as canonical JSON: the committed results carry it, and the test
    recomputes it from the script's ``settings`` without training."""
    text = json.dumps(jsonable(settings), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class Outputs:
    """Collects one experiment's figure, table and numbers and writes them with their source."""

    def __init__(self, name: str, args: argparse.Namespace, settings: dict[str, Any]) -> None:
        self.name, self.args, self.settings = name, args, settings
        self.start = time.time()
        os.makedirs(args.out_dir, exist_ok=True)

    def path(self, ext: str) -> str:
        return os.path.join(self.args.out_dir, f"{self.name}.{ext}")

    def write(self, fig: Any, title: str, table: str, results: dict[str, Any], notes: str = "") -> dict:
        """PNG + markdown + JSON; the markdown and JSON say which script and settings made them."""
        wall = time.time() - self.start
        fig.savefig(self.path("png"), bbox_inches="tight")
        source = (
            f"`{shlex.join(['python', f'examples/paper/{self.name}.py', *self.args.command_line])}` "
            f"(seed {self.args.seed}; {wall:.0f} s on {os.cpu_count()} CPU threads available, "
            f"torch {torch.__version__})"
        )
        with open(self.path("md"), "w") as fh:
            fh.write(f"## {title}\n\n{table}\n")
            if notes:
                fh.write(f"{notes}\n\n")
            fh.write(f"Source: {source}\n")
        record = {
            "experiment": self.name,
            "title": title,
            "script": f"examples/paper/{self.name}.py",
            "fast": bool(self.args.fast),
            "seed": self.args.seed,
            "settings": self.settings,
            "settings_hash": settings_hash(self.settings),
            "results": results,
            "wall_s": round(wall, 1),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "argv": self.args.command_line,
        }
        with open(self.path("json"), "w") as fh:
            json.dump(jsonable(record), fh, indent=2)
        print(f"{self.name}: wrote {self.path('png')}, .md, .json ({wall:.1f} s)")
        return record


# ----------------------------------------------------------------------------- Gaussians
def gaussian_kl(mu0: torch.Tensor, cov0: torch.Tensor, mu1: torch.Tensor, cov1: torch.Tensor) -> float:
    """KL( N(mu0, cov0) ‖ N(mu1, cov1) ), in float64, by Cholesky factors."""
    mu0, cov0, mu1, cov1 = (t.to(F64) for t in (mu0, cov0, mu1, cov1))
    k = mu0.numel()
    l1 = torch.linalg.cholesky(cov1)
    l0 = torch.linalg.cholesky(cov0)
    a = torch.linalg.solve_triangular(l1, l0, upper=False)  # L1⁻¹ L0: tr(Σ1⁻¹Σ0) = ‖A‖²
    d = torch.linalg.solve_triangular(l1, (mu1 - mu0).reshape(-1, 1), upper=False)
    logdet = 2 * (torch.log(torch.diagonal(l1)).sum() - torch.log(torch.diagonal(l0)).sum())
    return float(0.5 * ((a**2).sum() + (d**2).sum() - k + logdet))


def w2_to_gaussian(samples: torch.Tensor, mean: float, std: float) -> float:
    """1-D Wasserstein-2 distance between an empirical distribution and N(mean, std²):
    the L2 distance of their quantile functions, at the samples' plotting positions."""
    x = torch.sort(samples.to(F64).flatten()).values
    n = x.numel()
    u = (torch.arange(n, dtype=F64) + 0.5) / n
    q = mean + std * math.sqrt(2.0) * torch.erfinv(2 * u - 1)
    return float(torch.sqrt(((x - q) ** 2).mean()))


def ellipse_xy(mu: torch.Tensor, cov: torch.Tensor, radius: float, points: int = 200) -> np.ndarray:
    """Points of the ``radius``-σ contour of a 2-D Gaussian, shape (points, 2)."""
    evals, evecs = torch.linalg.eigh(cov.to(F64))
    t = torch.linspace(0, 2 * math.pi, points, dtype=F64)
    circle = torch.stack([torch.cos(t), torch.sin(t)], 1) * radius
    return (circle * evals.clamp_min(0).sqrt()) @ evecs.T + mu.to(F64)


def digits_3_vs_5() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8×8 digits, 3 (+1) vs 5 (−1); non-constant pixels / 16, plus a bias."""
    from sklearn.datasets import load_digits

    data = load_digits()
    keep = (data.target == 3) | (data.target == 5)
    X = data.data[keep] / 16.0
    X = X[:, X.std(0) > 0]
    X = np.hstack([X, np.ones((len(X), 1))])
    y = np.where(data.target[keep] == 3, 1.0, -1.0)
    return torch.tensor(X, dtype=F64), torch.tensor(y, dtype=F64)


def relative_frobenius(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


class LogisticObjective:
    """ζ E_q[ℓ] + KL(q ‖ N(0, (ζδ)⁻¹ I)) for q = N(μ, Σ), ℓ the mean logistic loss (labels ±1).

    E_q[ℓ] is exact up to quadrature: each margin wᵀx_i is N(μᵀx_i, x_iᵀΣx_i) under q, and
    its expected softplus is a 1-D Gauss–Hermite integral (64 nodes). This is the
    variational objective EVON and IVON minimise, so lower is better and the optimal full
    Gaussian is the floor for every Gaussian.
    """

    def __init__(self, X: torch.Tensor, y: torch.Tensor, ess: float, delta: float) -> None:
        self.X, self.y = X.to(F64), y.to(F64)
        self.ess, self.prior_precision = ess, ess * delta
        nodes, weights = np.polynomial.hermite_e.hermegauss(64)  # ∫ f(x) e^{-x²/2} dx
        self.nodes = torch.tensor(nodes, dtype=F64)
        self.weights = torch.tensor(weights / weights.sum(), dtype=F64)

    def __call__(self, mu: torch.Tensor, cov: torch.Tensor, chol: torch.Tensor | None = None) -> torch.Tensor:
        X, s0, D = self.X, self.prior_precision, self.X.shape[1]
        mu, cov = mu.to(F64), cov.to(F64)
        m = X @ mu
        v = ((X @ cov) * X).sum(1).clamp_min(0.0)
        margins = m[:, None] + v.sqrt()[:, None] * self.nodes[None, :]
        expected_loss = (F.softplus(-self.y[:, None] * margins) * self.weights).sum(1).mean()
        logdet = (
            2 * torch.log(torch.diagonal(chol)).sum() if chol is not None else torch.linalg.slogdet(cov)[1]
        )
        kl = 0.5 * (s0 * torch.trace(cov) + s0 * mu @ mu - D - D * math.log(s0) - logdet)
        return self.ess * expected_loss + kl

    def log_posterior(self, W: torch.Tensor) -> torch.Tensor:
        """Unnormalised log density of the exact posterior at the rows of ``W`` (…, D)."""
        margins = (W.to(F64) @ self.X.T) * self.y
        return -F.softplus(-margins).sum(-1) * (self.ess / len(self.y)) - 0.5 * self.prior_precision * (
            W.to(F64) ** 2
        ).sum(-1)

    def optimum(self, full: bool, maxiter: int = 10000) -> tuple[torch.Tensor, torch.Tensor, float]:
        """min over N(μ, LLᵀ) (full) or N(μ, diag σ²) of the objective, by L-BFGS in float64."""
        from scipy.optimize import minimize

        D = self.X.shape[1]
        if full:
            rows, cols = torch.tril_indices(D, D)
            on_diag = rows == cols

            def unpack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                entries = torch.where(on_diag, torch.exp(x[D:]), x[D:])  # positive diagonal
                chol = torch.zeros(D, D, dtype=F64).index_put((rows, cols), entries)
                return x[:D], chol @ chol.T, chol

            x0 = np.zeros(D + len(rows))
            x0[D:][on_diag.numpy()] = math.log(0.1)
        else:

            def unpack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                std = torch.exp(x[D:])
                return x[:D], torch.diag(std**2), torch.diag(std)

            x0 = np.concatenate([np.zeros(D), np.full(D, math.log(0.1))])

        def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
            xt = torch.tensor(x, dtype=F64, requires_grad=True)
            value = self(*unpack(xt))
            value.backward()
            return float(value.detach()), xt.grad.numpy()

        result = minimize(
            fun, x0, jac=True, method="L-BFGS-B", options=dict(maxiter=maxiter, ftol=1e-15, gtol=1e-9)
        )
        mu, cov, _ = unpack(torch.tensor(result.x, dtype=F64))
        return mu.detach(), cov.detach(), float(result.fun)


# ----------------------------------------------------------------------------- training loops
def linear_decay(
    optimizer: torch.optim.Optimizer, lr: float, k: int, steps: int, frac: float = 1 / 3
) -> None:
    """Constant learning rate, then linear decay to 0 over the last ``frac`` of training."""
    start = int((1 - frac) * steps)
    for group in optimizer.param_groups:
        group["lr"] = lr if k < start else lr * (1 - (k - start) / max(1, steps - start))


def ivon_lr(paper_lr: float, hess_init: float, weight_decay: float) -> float:
    """EVON's α (``identity_basis=True``) for an IVON rate from the paper's tables, which are in
    ivon-opt's convention (``rescale_lr=True``: the step is α·(h0 + δ)·(m̂ + δM)/(H + δ)); ours
    has no such factor, so the table's rate is multiplied by h0 + δ."""
    return paper_lr * (hess_init + weight_decay)


def train_variational(
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[], torch.Tensor],
    steps: int,
    lr: float,
    decay_frac: float = 1 / 3,
    every: int = 0,
    on_record: Callable[[int], None] | None = None,
    before_step: Callable[[int], None] | None = None,
) -> None:
    """Full-batch variational training with ``hf_evon.EVON`` (EVON, IVON mode or SOAP mode).

    ``mc_samples`` sampled gradients per step (EVON averages them); ``before_step(k)`` runs
    before step ``k`` (e.g. to anneal ζ); ``on_record(k)`` after every ``every``-th step and
    after the last one.
    """
    for k in range(steps):
        linear_decay(optimizer, lr, k, steps, decay_frac)
        if before_step is not None:
            before_step(k)
        for _ in range(optimizer.mc_samples):
            with optimizer.sampled_params(train=True):
                loss_fn().backward()
        optimizer.step()
        optimizer.zero_grad()
        if on_record is not None and ((every and (k + 1) % every == 0) or k + 1 == steps):
            on_record(k + 1)
