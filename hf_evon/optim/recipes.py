"""The paper's tuned EVON settings, by name (``build_optimizer(model, recipe="nanogpt")``).

Each recipe is the hyperparameter table of ``soap-bubbles.tex`` it cites, for the setting it
was tuned in; anything passed explicitly next to ``recipe=`` wins. Our defaults (no recipe)
are the scale-free ones of :mod:`hf_evon.optim.defaults` (``docs/defaults.md``): the paper's numbers were
tuned for GPU-scale runs (batch 512, thousands of steps; CLIP ViT fine-tuning) and are a
starting point there, not a rule for small models. Every recipe runs the paper's algorithm
(``PAPER_ALGORITHM``): no ``snr_scaling`` (our step-size rule, which the paper does not have),
and every eigenbasis refreshed on the same steps, t % f == 0, as the paper's code does.
"""

from __future__ import annotations

import math
from typing import Any

# the paper's algorithm: the Price (Stein) Hessian estimate, the per-entry Newton step, no SNR
# step-size rule, no staggered refresh and an eigenbasis on every side up to max_precond_dim
# (hf-evon's additions)
PAPER_ALGORITHM: dict[str, Any] = dict(
    hess_estimator="price",
    step_curvature="entry",
    snr_scaling=False,
    stagger_refresh=False,
    max_precond_ratio=math.inf,
)

RECIPES: dict[str, dict[str, Any]] = {
    # Table "Hyperparameters for NanoGPT and Llama", row "EVON (NanoGPT)": spectral clipping
    # (the table does not give a radius: we use 1, singular values ≤ 1), γ = 1.5, β3 = 0.995.
    "nanogpt": dict(
        ess=5.27e6,
        hess_init=0.582,
        lr=1.72e-2,
        betas=(0.943, 1.0 - 9.12e-4),
        weight_decay=1e-6,
        shampoo_beta=0.995,
        hess_clip_ratio=1.5,
        clip="spectral",
        clip_radius=1.0,
        **PAPER_ALGORITHM,
    ),
    # The same table, row "EVON (Llama)".
    "llama": dict(
        ess=7.61e7,
        hess_init=0.931,
        lr=1.52e-2,
        betas=(0.881, 1.0 - 3.46e-4),
        weight_decay=8.83e-7,
        shampoo_beta=0.995,
        hess_clip_ratio=1.5,
        clip="spectral",
        clip_radius=1.0,
        **PAPER_ALGORITHM,
    ),
    # Table "Best hyperparameters for CLIP finetuning" (8 datasets), EVON rows: the medians of
    # α (0.055) and δ (2.2e-6), ζ 5e7 (the table's values are 1e7-1e10, median 5e7-1e8),
    # h0 0.01 (5 of 8), β1 0.95 and 1-β2 0.05 (all 8); its caption: whitening + γ = 2.
    "clip-finetuning": dict(
        ess=5e7,
        hess_init=0.01,
        lr=0.055,
        betas=(0.95, 0.95),
        weight_decay=2.2e-6,
        hess_clip_ratio=2.0,
        clip="whiten",
        **PAPER_ALGORITHM,
    ),
}


def recipe_kwargs(name: str | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The recipe's EVON keyword arguments updated by ``overrides`` (``None``: no recipe)."""
    if name is None:
        return dict(overrides or {})
    if not isinstance(name, str):
        raise TypeError(
            f"recipe: one of {sorted(RECIPES)} or None, a recipe's name; got a {type(name).__name__} "
            "(settings of your own go as keyword arguments)"
        )
    if name not in RECIPES:
        raise ValueError(
            f"unknown recipe {name!r}: choose one of {sorted(RECIPES)} (or None for the defaults)"
        )
    return {**RECIPES[name], **(overrides or {})}
