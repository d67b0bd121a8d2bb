"""Fig. 3a: predictive samples of EVON vs IVON for a small and a large MLP on 10 points.

1-D regression, 10 points in two clusters (x in [−2, −1] and [1, 2], y = sin(2x) + noise 0.05),
loss ℓ = mean ½(y − f(x))², full batch, 10k steps. Small MLP 1-8-8-1 (tanh), large MLP
1-64-64-64-1 (ELU), as in the paper (after VIKING's Fig. 5). Hyperparameters: the paper's table
of illustrative settings, constant learning rate; EVON's ζ for the small MLP is annealed
2·10⁵ → 10⁴ (the table gives the two ends; we interpolate geometrically over the first half and
then hold 10⁴). IVON is EVON with ``identity_basis=True``. Biases (1-D) have a diagonal
posterior in both methods.

The paper's claim: both methods give diverse functions for the large MLP; for the small one
IVON's samples collapse away from the data while EVON's stay diverse. We quantify it by the
predictive standard deviation (over 200 posterior samples) averaged over inputs away from the
data (|x| ≤ 0.6, the gap, and 2.6 ≤ |x| ≤ 4, outside) and near the data.

    python examples/paper/fig3a_mlp.py [--fast] [--out-dir DIR]
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common, next to this file
from _common import (  # noqa: E402
    COLORS,
    PAPER_EVON,
    Outputs,
    evon_settings,
    ivon_lr,
    markdown_table,
    parse_args,
    setup_matplotlib,
    train_variational,
)

from hf_evon import EVON  # noqa: E402

NAME = "fig3a_mlp"
ARCHS = {
    "small MLP (1-8-8-1, tanh)": ([8, 8], nn.Tanh),
    "large MLP (1-64-64-64-1, ELU)": ([64, 64, 64], nn.ELU),
}
# the paper's table (ζ, α, h0, δ, β2, clip radius); β1 = 0.9 everywhere
SETTINGS = {
    ("small", "EVON"): dict(
        ess=(2e5, 1e4), lr=10.0, hess_init=5e-2, weight_decay=1e-4, beta2=0.999, clip_radius=1e-2
    ),
    ("small", "IVON"): dict(
        ess=1e4, lr=1.0, hess_init=1e-2, weight_decay=1e-5, beta2=0.9995, clip_radius=1e-1
    ),
    ("large", "EVON"): dict(
        ess=1e4, lr=10.0, hess_init=5e-2, weight_decay=1e-4, beta2=0.999, clip_radius=1e-2
    ),
    ("large", "IVON"): dict(
        ess=1e4, lr=1.0, hess_init=1e-2, weight_decay=1e-5, beta2=0.9995, clip_radius=1e-1
    ),
}
SAMPLES = 200
MOTION_STEPS = 200  # the last steps over which the mean's motion is measured
DATA_KEYS: tuple[str, ...] = ()  # settings that come from the data (none: the data are generated)


def evon_kwargs(size: str, method: str, seed: int) -> dict[str, Any]:
    """The paper's algorithm with the table's settings, ζ at its start value (``ess_schedule``);
    IVON's rate converted from ivon-opt's convention."""
    hp = dict(SETTINGS[(size, method)])
    ess_start, _ = ess_schedule(hp.pop("ess"))
    if method == "IVON":  # the table's rate is in ivon-opt's convention
        hp["lr"] = ivon_lr(hp["lr"], hp["hess_init"], hp["weight_decay"])
    return dict(
        ess=ess_start,
        betas=(0.9, hp.pop("beta2")),
        clip="element",
        hess_clip_ratio=None,  # the paper's small-scale runs use no Hessian clipping
        identity_basis=method == "IVON",
        seed=seed,
        **PAPER_EVON,
        **hp,
    )


def ess_schedule(ess: float | tuple[float, float]) -> tuple[float, float]:
    """ζ's (start, end): annealed geometrically over the first half where the table gives two."""
    return ess if isinstance(ess, tuple) else (ess, ess)


def settings(fast: bool, seed: int) -> dict[str, Any]:
    """Everything the results depend on, optimizers resolved (cheap: no training)."""
    return dict(
        steps=300 if fast else 10000,
        posterior_samples=SAMPLES,
        methods={f"{k[0]} {k[1]}": v for k, v in SETTINGS.items()},
        optimizers={f"{k[0]} {k[1]}": evon_settings(evon_kwargs(*k, seed)) for k in SETTINGS},
    )


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.rand(5, generator=g) - 2.0, torch.rand(5, generator=g) + 1.0]).unsqueeze(1)
    return x, torch.sin(2 * x) + 0.05 * torch.randn(x.shape, generator=g)


def mlp(hidden: list[int], act: type[nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = 1
    for h in hidden:
        layers += [nn.Linear(width, h), act()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, 1))


def away_mask(grid: torch.Tensor) -> torch.Tensor:
    """Inputs away from the data: the gap between the clusters and outside them."""
    a = grid.abs()
    return (a <= 0.6) | (a >= 2.6)


def near_mask(grid: torch.Tensor) -> torch.Tensor:
    a = grid.abs()
    return (a >= 1.0) & (a <= 2.0)


def saturated_share(net: nn.Sequential, act: type[nn.Module], x: torch.Tensor) -> float:
    """Share of the last hidden layer's units that are flat at the data (tanh |z| > 3, ELU z < −3):
    where all are, the network is a constant across the data whatever its output weights."""
    z = net[:-2](x)  # the last hidden layer's pre-activations
    flat = z.abs() > 3 if act is nn.Tanh else z < -3
    return float(flat.float().mean())


def train_and_sample(
    size: str, method: str, hidden: list[int], act: type[nn.Module], steps: int, seed: int, grid: torch.Tensor
) -> tuple[torch.Tensor, float, dict[str, float]]:
    """Train; return predictive samples on ``grid`` (SAMPLES × len(grid)), the final loss at the
    mean, and how the mean moves between the weights before each of the last ``MOTION_STEPS`` steps:
    its mean move per entry and step as a share of the element clip's bound α·r, and the share of
    moves at that bound (a mean that still walks at the bound has not settled: its final loss is
    where the walk stands)."""
    torch.manual_seed(seed)
    net = mlp(hidden, act)
    x, y = data(seed)
    kwargs = evon_kwargs(size, method, seed)
    ess_start, ess_end = ess_schedule(SETTINGS[(size, method)]["ess"])
    opt = EVON(net.parameters(), **kwargs)

    snapshots: list[torch.Tensor] = []  # the weights before each of the last MOTION_STEPS steps

    def before_step(k: int) -> None:
        frac = min(1.0, k / max(1, steps // 2))  # geometric ζ schedule over the first half, then constant
        opt.param_groups[0]["ess"] = ess_start * (ess_end / ess_start) ** frac
        if k >= steps - MOTION_STEPS:
            snapshots.append(torch.cat([p.detach().flatten() for p in net.parameters()]))

    train_variational(
        opt,
        lambda: 0.5 * (net(x) - y).square().mean(),
        steps,
        kwargs["lr"],
        decay_frac=0.0,
        before_step=before_step,
    )
    bound = kwargs["lr"] * kwargs["clip_radius"]  # the element clip's largest move per entry
    move = torch.stack(snapshots).diff(dim=0).abs()
    motion = dict(
        mean_move_over_bound=float(move.mean() / bound),
        share_at_bound=float((move >= 0.99 * bound).float().mean()),
    )
    preds = []
    with torch.no_grad():
        loss = float(0.5 * (net(x) - y).square().mean())
        motion["saturated_at_data"] = saturated_share(net, act, x)
        for _ in range(SAMPLES):
            with opt.sampled_params(train=False):
                preds.append(net(grid.unsqueeze(1)).squeeze(1))
    return torch.stack(preds), loss, motion


def run(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(__doc__, argv)
    config = settings(args.fast, args.seed)
    steps = config["steps"]
    out = Outputs(NAME, args, config)
    grid = torch.linspace(-4, 4, 321)
    x, y = data(args.seed)
    plt = setup_matplotlib()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True, sharey=True)
    results: dict[str, dict] = {}
    rows = []
    for r, (arch, (hidden, act)) in enumerate(ARCHS.items()):
        size = arch.split()[0]
        for c, method in enumerate(("EVON", "IVON")):
            preds, loss, motion = train_and_sample(size, method, hidden, act, steps, args.seed, grid)
            std = preds.std(0)
            away, near = float(std[away_mask(grid)].mean()), float(std[near_mask(grid)].mean())
            ok = bool(torch.isfinite(preds).all())
            results[f"{size} {method}"] = dict(
                std_away=away, std_near=near, train_loss_at_mean=loss, finite=ok, **motion
            )
            rows.append(
                [arch, method, away, near, away / near if near > 0 else math.inf, loss]
                + [motion[k] for k in ("share_at_bound", "mean_move_over_bound", "saturated_at_data")]
            )
            ax = axes[r, c]
            for s in range(min(30, SAMPLES)):
                ax.plot(grid, preds[s], color=COLORS[method], alpha=0.25, lw=0.8)
            ax.plot(grid, preds.mean(0), color="black", lw=1.2, label="predictive mean")
            ax.scatter(x.squeeze(1), y.squeeze(1), color="black", s=14, zorder=3, label="data")
            ax.set(title=f"{method}, {arch}\npredictive std away from data {away:.3f}", ylim=(-3, 3))
            if r == 1:
                ax.set_xlabel("x")
            if c == 0:
                ax.set_ylabel("f(x), 30 posterior samples")
    axes[0, 0].legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    table = markdown_table(
        [
            "network",
            "method",
            "predictive std away from data",
            "near data",
            "ratio away/near",
            "train loss at mean",
            f"moves at the clip's bound, last {MOTION_STEPS} steps",
            "mean move / bound",
            "last hidden layer flat at the data",
        ],
        rows,
    )
    return out.write(fig, "Fig. 3a: MLP regression, posterior predictive samples", table, results)


if __name__ == "__main__":
    run()
