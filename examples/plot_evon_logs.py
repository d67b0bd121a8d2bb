"""Plot the ``evon/*`` curves an ``EVONTrainer`` run logged to TensorBoard, as one PNG.

``EVONTrainer`` logs, next to the Trainer's ``loss``/``learning_rate``, the posterior's health
at every logging step: ``evon/posterior_std_mean`` (mean marginal posterior std),
``evon/hess_min|mean|max`` (the rotated-space Hessian H), ``evon/skipped_steps`` and every
``posterior_health()`` statistic (``evon/noise_to_signal``, ``evon/hess_below_prior``, ...). With
``report_to="tensorboard"`` they land in ``<output_dir>/runs``; ``tensorboard --logdir`` shows
them all live, and this script draws four panels of them as a PNG (for a README or a report,
:data:`PANELS`): the training loss, the mean posterior std, H's range and the evaluation NLL of the
mean and of BMA::

    python examples/finetune_classification.py --methods evon --report-to tensorboard --output-dir outputs/finetune
    python examples/plot_evon_logs.py outputs/finetune/evon/runs --output docs/evon_tensorboard.png

Needs ``tensorboard`` and ``matplotlib`` (both in the ``examples`` extra).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from hf_evon.fileio import file_on_the_way

# (panel title, tags drawn in it, log-scale y axis); tags missing from a run are left out
PANELS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("training loss", ("train/loss",), False),
    ("mean posterior std", ("train/evon/posterior_std_mean",), True),
    (
        "Hessian H (rotated space)",
        ("train/evon/hess_max", "train/evon/hess_mean", "train/evon/hess_min"),
        True,
    ),
    (
        "evaluation NLL: mean vs. BMA",
        ("eval/nll", "eval/mean_nll", "eval/bma_nll"),
        False,
    ),
)

Series = tuple[list[int], list[float]]


def run_directories(logdir: str) -> list[str]:
    """The directories under ``logdir`` (itself included) that hold TensorBoard event files, oldest
    first by their newest event file: the Trainer writes each run into a sub-directory of its own."""
    runs = []
    for dirpath, _, filenames in os.walk(logdir):
        events = [os.path.join(dirpath, f) for f in filenames if f.startswith("events.out.tfevents")]
        if events:
            runs.append((max(os.path.getmtime(e) for e in events), dirpath))
    return [path for _, path in sorted(runs)]


def read_scalars(logdir: str) -> dict[str, Series]:
    """Every scalar of the newest run under ``logdir``: tag -> (steps, values), in step order (a
    later event at a step wins). Runs are not merged: two runs into one output directory would
    otherwise draw one curve of both; another run is plotted by passing its directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not os.path.isdir(logdir):
        raise SystemExit(f"plot_evon_logs: {logdir!r} is not a directory of TensorBoard event files")
    runs = run_directories(logdir)
    if not runs:
        raise SystemExit(f"plot_evon_logs: no TensorBoard scalars under {logdir!r} (no event files)")
    if len(runs) > 1:
        print(f"plot_evon_logs: {len(runs)} runs under {logdir}; plotting the newest, {runs[-1]} (the others: "
              f"{', '.join(runs[:-1])})", file=sys.stderr)  # fmt: skip
    acc = EventAccumulator(runs[-1], size_guidance={"scalars": 0})
    acc.Reload()
    by_tag: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            by_tag.setdefault(tag, {})[event.step] = event.value
    if not by_tag:
        raise SystemExit(f"plot_evon_logs: no TensorBoard scalars in {runs[-1]!r}")
    return {tag: (sorted(points), [points[s] for s in sorted(points)]) for tag, points in by_tag.items()}


def image_format(path: str) -> str:
    """The format ``path``'s extension names (PNG without one); ValueError for one matplotlib cannot
    write."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    ext = os.path.splitext(path)[1][1:].lower() or "png"
    if ext not in FigureCanvasBase.get_supported_filetypes():
        formats = ", ".join(sorted(FigureCanvasBase.get_supported_filetypes()))
        raise ValueError(f"{ext!r} is not a format matplotlib writes ({formats})")
    return ext


def plot(scalars: dict[str, Series], path: str, title: str | None = None) -> list[str]:
    """Draw the :data:`PANELS` that have data into the file ``path`` (PNG unless its extension
    names another format); returns the panel titles drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, [t for t in tags if t in scalars], log) for name, tags, log in PANELS]
    panels = [p for p in panels if p[1]]
    if not panels:
        raise SystemExit(
            f"plot_evon_logs: none of the tags {[t for _, ts, _ in PANELS for t in ts]} was logged"
        )
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False)
    for ax, (name, tags, log) in zip(axes.flat, panels):
        for tag in tags:
            steps, values = scalars[tag]
            ax.plot(steps, values, marker="o" if len(steps) < 20 else None, ms=3, label=tag.split("/", 1)[1])
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # the format given: without it matplotlib appends ".png" to a name without an extension
    fig.savefig(path, dpi=110, format=image_format(path))
    plt.close(fig)
    return [name for name, _, _ in panels]


def main(argv: Sequence[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logdir", help="TensorBoard log directory (the Trainer's <output_dir>/runs: its newest run) or one run's")
    p.add_argument(
        "--output", default="evon_tensorboard.png", help="PNG to write (another extension: that format)"
    )
    p.add_argument("--title", default=None, help="figure title")
    args = p.parse_args(argv)
    if os.path.isdir(args.output):
        p.error(f"--output {args.output}: is a directory (name the image file to write)")
    # the folder it goes in, made if missing
    if (above := file_on_the_way(os.path.dirname(os.path.abspath(args.output)))) is not None:
        p.error(f"--output {args.output}: {above} is a file, not a directory")
    try:
        image_format(args.output)
    except ValueError as err:
        p.error(f"--output {args.output}: {err}")
    drawn = plot(read_scalars(args.logdir), args.output, args.title)
    print(f"wrote {args.output}: {', '.join(drawn)}")
    return drawn


if __name__ == "__main__":
    main()
