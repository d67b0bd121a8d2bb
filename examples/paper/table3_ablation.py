"""Table 3: the ablation of EVON's optional components on small-GPT pre-training.

Same data, model, schedule and batches as ``fig4_gpt.py`` (see ``_gpt.py``). The plain EVON
uses spectral update clipping (radius 1); the components switched on and off are whitened
updates (Whiten: Newton–Schulz orthogonalisation, replacing the spectral clip), phased
gradients (PG) and adaptive Hessian clipping with the paper's tight ratio γ = 1.5 (clip).
Reported: the validation loss at the posterior mean and under BMA with 20 samples, and the
relative change; the figure shows the validation curves and the BMA change.

    python examples/paper/table3_ablation.py [--fast] [--out-dir DIR]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common, _gpt next to this file
import _gpt  # noqa: E402
from _common import VARIANT_COLORS, Outputs, markdown_table, parse_args, setup_matplotlib  # noqa: E402

NAME = "table3_ablation"
VARIANTS = ("Plain", "Clip", "PG", "PG+clip", "Whiten", "Whiten+clip", "Whiten+PG", "Whiten+PG+clip")
# the paper's Table 3 (NanoGPT, FineWeb): loss at the mean, loss with BMA@20, its % change
PAPER = {
    "Whiten": (3.241, 3.240, -0.015),
    "Whiten+PG+clip": (3.242, 3.241, -0.015),
    "Whiten+clip": (3.243, 3.242, -0.021),
    "Whiten+PG": (3.262, 3.261, -0.016),
    "Plain": (3.299, 3.297, -0.047),
    "Clip": (3.320, 3.318, -0.047),
    "PG+clip": (3.410, 3.409, -0.020),
    "PG": (3.442, 3.442, -0.018),
}


DATA_KEYS = ("train_tokens", "vocab_size")  # settings that come from the data (the tokenizer)


def settings(fast: bool, seed: int, train_tokens: int, vocab_size: int) -> dict[str, Any]:
    """Everything the results depend on, every variant's optimizer resolved on the untrained
    model (cheap: no data, no training; ``train_tokens``, ``vocab_size`` are the data's)."""
    setup = _gpt.Setup.fast() if fast else _gpt.Setup()
    variants = VARIANTS[:2] + VARIANTS[4:5] if fast else VARIANTS
    return dict(
        setup=vars(setup),
        train_tokens=train_tokens,
        vocab_size=vocab_size,
        bma_samples=4 if fast else 20,
        variants={v: _gpt.evon_kwargs("EVON", train_tokens, _gpt.variant_kwargs(v)) for v in variants},
        optimizers={
            v: _gpt.optimizer_settings("EVON", setup, vocab_size, train_tokens, seed, _gpt.variant_kwargs(v))
            for v in variants
        },
    )


def run(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(__doc__, argv)
    setup = _gpt.Setup.fast() if args.fast else _gpt.Setup()
    data = _gpt.load_data(setup)
    config = settings(args.fast, args.seed, len(data.train), data.vocab_size)
    variants, samples = list(config["variants"]), config["bma_samples"]
    out = Outputs(NAME, args, config)
    results: dict[str, dict] = {}
    curves = {}
    for v in variants:
        run_ = _gpt.train("EVON", data, setup, args.seed, _gpt.variant_kwargs(v))
        mean = run_.curve_loss[-1]
        bma = _gpt.bma_curve(run_, data.val, [samples], args.seed)[samples]
        results[v] = dict(loss_at_mean=mean, loss_bma=bma, bma_change_pct=100 * (bma - mean) / mean)
        curves[v] = (run_.curve_steps, run_.curve_loss)

    order = sorted(results, key=lambda v: results[v]["loss_at_mean"])
    rows = [
        [
            v,
            results[v]["loss_at_mean"],
            f"{results[v]['loss_bma']:.4f} ({results[v]['bma_change_pct']:+.3f}%)",
            f"{PAPER[v][0]:.3f}",
            f"{PAPER[v][1]:.3f} ({PAPER[v][2]:+.3f}%)",
        ]
        for v in order
    ]
    table = markdown_table(
        ["config", "loss@mean (ours)", f"loss@{samples}MC (ours)", "loss@mean (paper)", "loss@20MC (paper)"],
        rows,
    )

    plt = setup_matplotlib()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
    for v, (xs, ys) in curves.items():
        whitened = v.startswith("Whiten")
        # markers on every point: variants that train alike stay visible on top of each other
        ax0.plot(xs, ys, "--" if whitened else "-", marker="os^vDPXh"[list(curves).index(v) % 8], ms=4,
                 color=VARIANT_COLORS[v], label=v)  # fmt: skip
    lo = min(min(ys) for _, ys in curves.values())
    ax0.set_ylim(lo - 0.05, lo + 1.0)
    ax0.set(xlabel="step", ylabel="validation loss at the mean", title="EVON variants, small GPT")
    ax0.legend(fontsize=8)
    ax1.bar(
        range(len(order)),
        [results[v]["bma_change_pct"] for v in order],
        color=[VARIANT_COLORS[v] for v in order],
        hatch=["//" if v.startswith("Whiten") else "" for v in order],
        edgecolor="black",
    )
    ax1.set_xticks(range(len(order)), order, rotation=35, ha="right")
    ax1.axhline(0, color="black", lw=0.8)
    ax1.set(ylabel=f"loss change with BMA@{samples} (%)", title="BMA vs posterior mean (negative = better)")
    fig.tight_layout()
    return out.write(
        fig,
        "Table 3: EVON ablation on small-GPT pre-training",
        table,
        dict(
            variants=results, curves={v: dict(steps=x, loss=y) for v, (x, y) in curves.items()}, paper=PAPER
        ),
    )


if __name__ == "__main__":
    run()
