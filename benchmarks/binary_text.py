"""Two-class noisy text classification: a held-out check of the defaults, never used to choose one.

Table 2's tasks (``examples/paper/table2_finetune.py``) have 4-6 classes; users' first fine-tuning
is often binary. Two of its text sources cut to two classes, the same recipe otherwise: 30
training texts per class, 100 held out (halved into calibration and test, the same halves for every seed), 30% of
every split's labels random, 20 epochs of batch 16 (80 steps), the pretrained MiniLM fine-tuned
fully (AdamW's rate 1e-4) or with LoRA (1e-3):

    exception2   the message of ``raise X("...")`` -> ValueError or TypeError
    docstring2   the first paragraph of a docstring -> text processing or numbers and math

Rows (``benchmarks/payoff.py``'s conventions): AdamW, AdamW + temperature scaling on the
calibration split, EVON's mean and its calibrated BMA@``--samples``. One JSON line per run, then a
table of test NLL / ECE / accuracy, mean over seeds.

    python benchmarks/binary_text.py --seeds 3              # 15-18 min per task on one thread
    python benchmarks/binary_text.py --tasks exception2 --variants lora --seeds 1

Measured (3 seeds, one thread, 2026-11-29; test NLL, AdamW / AdamW + T / EVON mean / EVON@32; more
in docs/results.md#two-class-text): exception full 1.769 / 0.678 / 1.699 / 0.692, exception LoRA
1.052 / 0.689 / 0.687 / 0.688, docstring full 1.163 / 0.564 / 1.025 / 0.569, docstring LoRA 0.750 /
0.572 / 0.589 / 0.589.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "paper"))
import payoff  # noqa: E402  (the rows' conventions)
import payoff_tasks  # noqa: E402
import payoff_training  # noqa: E402
import table2_finetune  # noqa: E402  (the texts)

TASKS = {"exception2": ("exception_type", (0, 1)), "docstring2": ("docstring_topic", (1, 2))}
PER_CLASS = (30, 100)  # training texts, held-out texts per class
METHODS = ("adamw", "evon")


def binary_rows(name: str, fast: bool = False) -> tuple[list[list[Any]], list[list[Any]]]:
    """(train, held): ``[text, label]`` rows of the task's two classes, labelled 0 and 1: each
    class's first texts of ``table2_finetune.unique_texts`` (train, then held-out), the training
    rows mixed in the order of their SHA-256, as Table 2's ``text_data`` builds its splits."""
    source, pair = TASKS[name]
    n_train, n_held = (8, 8) if fast else PER_CLASS
    texts = table2_finetune.unique_texts(source)[1]
    train = [[t, label] for label, k in enumerate(pair) for t in texts[k][:n_train]]
    held = [[t, label] for label, k in enumerate(pair) for t in texts[k][n_train : n_train + n_held]]
    return sorted(train, key=lambda r: table2_finetune.text_digest(r[0])), held


def make_task(name: str, variant: str, seed: int, fast: bool = False) -> payoff_tasks.Task:
    train, held = binary_rows(name, fast)
    split = lambda rows: ([t for t, _ in rows], [y for _, y in rows])  # noqa: E731
    return payoff_tasks.text_task(
        f"{name}/{variant}", split(train), split(held), 2, variant == "lora", seed,
        epochs=2 if fast else 20, noise=0.3,
    )  # fmt: skip


def run(name: str, variant: str, method: str, seed: int, samples: int, fast: bool) -> dict[str, Any]:
    task = make_task(name, variant, seed, fast)
    start = time.perf_counter()
    row: dict[str, Any] = {"task": name, "variant": variant, "method": method, "seed": seed}
    if method == "adamw":
        model = task.make_model(seed)
        payoff_training.train_adamw(task, model, seed)
        rows, temperature = payoff.point_estimate_rows("AdamW", task, model)
        row.update(temperature=temperature, rows={k: v for k, v in rows.items() if not k.startswith("_")})
    else:  # payoff.py's own EVON rows: its mean and calibrated BMA, the calibration and health beside
        rows = payoff.run_evon(task, seed, [samples])
        calibration = rows.pop("_evon")
        health = {k: calibration.pop(k) for k in ("hess_below_prior", "hess_init_share", "noise_to_signal")}
        calibration.pop("train_seconds")
        row.update(calibration=calibration, rows={k: v for k, v in rows.items() if not k.startswith("_")}, health=health)
    row["seconds"] = time.perf_counter() - start
    return row


def table(runs: list[dict[str, Any]]) -> str:
    """Test NLL / ECE / accuracy per task and row, mean over seeds."""
    cells: dict[tuple[str, str], dict[str, list[dict[str, float]]]] = {}
    for r in runs:
        for row, scores in r["rows"].items():
            cells.setdefault((r["task"], r["variant"]), {}).setdefault(row, []).append(scores)
    out = ["| task | row | NLL | ECE | accuracy | seeds |", "|---|---|---|---|---|---|"]
    for (task, variant), rows in cells.items():
        for row, scores in rows.items():
            mean = {k: statistics.fmean(s[k] for s in scores) for k in ("nll", "ece", "accuracy")}
            out.append(
                f"| {task} {variant} | {row} | {mean['nll']:.3f} | {mean['ece']:.3f} | "
                f"{mean['accuracy']:.3f} | {len(scores)} |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--variants", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=32, help="BMA samples on the test split")
    parser.add_argument("--fast", action="store_true", help="8 texts per class, 2 epochs: a smoke test")
    args = parser.parse_args(argv)
    payoff.init_worker()  # one thread, as payoff.py's runs
    runs = []
    for name in args.tasks:
        for seed in range(args.seeds):
            for variant in args.variants:
                for method in args.methods:
                    runs.append(run(name, variant, method, seed, args.samples, args.fast))
                    print(json.dumps(runs[-1], default=float), flush=True)
    print(table(runs))
    return runs


if __name__ == "__main__":
    main()
