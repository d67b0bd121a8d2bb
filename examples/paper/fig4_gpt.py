"""Fig. 1 (middle/right) and Fig. 4: small-GPT pre-training, loss curves and BMA gains.

A 2-layer GPT-2 (width 64) on the standard library corpus (see ``_gpt.py`` for data, model,
optimizer settings and schedule), trained for the same number of steps on the same batches by
AdamW, SOAP mode (EVON, ζ = ∞), IVON mode (EVON, Q = I) and EVON (whitened updates, adaptive
Hessian clipping γ = 1.5: the paper's best configuration). Drawn: validation loss at the
(posterior) mean against steps, and the relative improvement of the validation loss by Bayesian
model averaging (next-token probabilities averaged over k posterior samples, k = 1 … 32) over
the loss at the posterior mean, for EVON and IVON.

The paper's claims checked: EVON < IVON in loss; EVON ≤ SOAP; EVON's BMA gain larger than
IVON's and growing with the number of samples.

    python examples/paper/fig4_gpt.py [--fast] [--out-dir DIR]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common, _gpt next to this file
import _gpt  # noqa: E402
from _common import COLORS, Outputs, markdown_table, parse_args, setup_matplotlib  # noqa: E402

NAME = "fig4_gpt"
METHODS = ("AdamW", "SOAP", "IVON", "EVON")
EVON_VARIANT = "Whiten+clip"


def run(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(__doc__, argv)
    setup = _gpt.Setup.fast() if args.fast else _gpt.Setup()
    sizes = [1, 2, 4] if args.fast else [1, 2, 4, 8, 16, 32]
    data = _gpt.load_data(setup)
    variant = _gpt.variant_kwargs(EVON_VARIANT)
    settings = dict(
        setup=vars(setup),
        train_tokens=len(data.train),
        vocab_size=data.vocab_size,
        adamw=_gpt.ADAMW,
        evon=_gpt.evon_kwargs("EVON", len(data.train), variant),
        soap=_gpt.evon_kwargs("SOAP", len(data.train), variant),
        ivon=_gpt.evon_kwargs("IVON", len(data.train)),
        bma_sizes=sizes,
    )
    out = Outputs(NAME, args, settings)
    runs = {
        m: _gpt.train(m, data, setup, args.seed, variant if m in ("EVON", "SOAP") else None) for m in METHODS
    }
    final = {m: r.curve_loss[-1] for m, r in runs.items()}
    bma = {m: _gpt.bma_curve(runs[m], data.val, sizes, args.seed) for m in ("EVON", "IVON")}
    gain = {m: {k: 100 * (final[m] - v) / final[m] for k, v in curve.items()} for m, curve in bma.items()}

    plt = setup_matplotlib()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m, r in runs.items():
        ax0.plot(r.curve_steps, r.curve_loss, color=COLORS[m], label=f"{m} ({final[m]:.3f})")
    ax0.set(xlabel="step", ylabel="validation loss at the mean", title="small GPT on the stdlib corpus")
    lo = min(min(r.curve_loss) for r in runs.values())
    ax0.set_ylim(lo - 0.1, lo + 1.5)
    ax0.legend()
    for m, g in gain.items():
        ax1.plot(list(g), list(g.values()), "o-", color=COLORS[m], label=m)
    ax1.axhline(0, color="black", lw=0.8)
    ax1.set_xscale("log", base=2)
    ax1.set(
        xlabel="posterior samples averaged (BMA)",
        ylabel="loss improvement over the mean (%)",
        title="BMA gain (higher is better)",
    )
    ax1.legend()
    fig.tight_layout()

    rows = [
        [m, final[m]] + ([bma[m][sizes[-1]], gain[m][sizes[-1]]] if m in bma else ["–", "–"]) for m in METHODS
    ]
    table = markdown_table(["method", "final val loss at mean", f"BMA@{sizes[-1]} loss", "BMA gain %"], rows)
    table += "\nBMA gain (%) by number of samples:\n\n" + markdown_table(
        ["method"] + [str(k) for k in sizes], [[m] + [gain[m][k] for k in sizes] for m in gain]
    )
    claims = {
        "EVON < IVON (loss at mean)": final["EVON"] < final["IVON"],
        "EVON <= SOAP (loss at mean)": final["EVON"] <= final["SOAP"],
        f"EVON's BMA@{sizes[-1]} gain > IVON's": gain["EVON"][sizes[-1]] > gain["IVON"][sizes[-1]],
        "EVON's BMA gain grows with samples": all(
            gain["EVON"][b] >= gain["EVON"][a] for a, b in zip(sizes, sizes[1:])
        ),
    }
    table += "\nThe paper's claims at this scale:\n\n" + markdown_table(
        ["claim", "holds here"], [[c, "yes" if ok else "**no**"] for c, ok in claims.items()]
    )
    results = dict(
        final_loss=final,
        curves={m: dict(steps=r.curve_steps, loss=r.curve_loss) for m, r in runs.items()},
        bma_loss=bma,
        bma_gain_pct=gain,
        claims=claims,
    )
    return out.write(fig, "Fig. 1 (middle/right), Fig. 4: small-GPT pre-training", table, results)


if __name__ == "__main__":
    run()
