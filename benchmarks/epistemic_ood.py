"""Does the posterior know what it was not trained on? Epistemic uncertainty (the samples'
disagreement, ``hf_evon.predictive.uncertainty``) as a detector of inputs unlike the training data.

A temperature or any other rescaling of one model's logits cannot make its predictions disagree
with themselves; only weights that vary can. So this measures what the posterior adds that
calibration does not. Each task trains on in-distribution (ID) data and scores, for every ID test
input and as many out-of-distribution (OOD) inputs, how uncertain each method is; the number is
the AUROC of telling the two apart by that score (1: every OOD input scores higher, 0.5: chance).

Tasks:
    digits_classes  payoff.py's digits MLP (64-256-256, batch 64, 30 epochs; the intensities / 16,
                    or with ``--scaling standard`` payoff.py's per-pixel standardisation) trained on
                    the digits 0-4; OOD: test images of the digits 5-9 (new classes)
    digits_rotated  the same MLP trained on all ten digits; OOD: the test images turned by 90
                    degrees (the same pixels' statistics, a shifted input)
    noisy_table     payoff.py's held-out 7-class table (900 rows, 20 features) trained on its classes
                    0-4 with 30% of their labels random, 80 epochs (as ``noisy_synthetic7``); OOD:
                    rows of the classes 5 and 6. Noisy labels leave every ID prediction uncertain
    docstrings      payoff.py's ``minilm_lora`` (the pretrained MiniLM, LoRA r 8, stdlib docstrings
                    by topic, 3 epochs); OOD: sentences of Debian's license texts (another genre)
    noisy_docstrings  the same as payoff.py's ``minilm_noisy_lora`` (30 texts per class, 30% of the
                    labels random, 20 epochs: AdamW and EVON's mean end overconfident); the same OOD

Methods, each at its own defaults, trained by ``payoff_training``'s loop (linear decay):
    AdamW       the entropy of its softmax (and the maximum probability: the usual baseline)
    Laplace LL  laplace-torch's KFAC Laplace over the last layer of the AdamW model (prior precision
                by the NLL on the ID calibration split, ``payoff_laplace.kron_laplace``), S GLM
                samples of the last layer's logits
    IVON        ivon-opt at its conventions with payoff.py's settings for the kind of task
                (``payoff.IVON_SETTINGS``: lr 0.1, ζ = N from scratch; lr 1, ζ = 10⁷ for LoRA), S samples
    EVON diag.  ``build_optimizer(model, identity_basis=True)``: the same posterior without the
                rotation, S samples at its trained ζ
    EVON        ``build_optimizer(model)``, S samples at its trained ζ (as
                ``EVONTrainer.predict_uncertainty`` draws them)
    EVON, calibrated scale  the same run, its samples at the ζ and temperature that
                ``calibrate_posterior`` chooses on the ID calibration split (as payoff.py; ζ × inf,
                the mean, where no noise scale beats it: then every sample is the mean)

Scores: "entropy" is the predictive's (the mean's for AdamW, the BMA's for the others),
"epistemic" the mutual information H[p̄] − mean_s H[p_s]. Also the ID test NLL and accuracy of
each predictive (the mean's for AdamW, BMA@S otherwise) and, for the others, the NLL of their
mean (Laplace: the AdamW model's): what the samples cost or gain on ID data. Nothing here chooses
a default.

    python benchmarks/epistemic_ood.py                  # all tasks, 3 seeds (~80 min on one thread)
    python benchmarks/epistemic_ood.py --tasks digits_rotated --seeds 1 --methods adamw evon
    python benchmarks/epistemic_ood.py --fast --tasks digits_classes    # a smoke test
    python benchmarks/epistemic_ood.py --tasks digits_classes digits_rotated --scaling standard

Measured: docs/results.md#epistemic-uncertainty; every table and run in
benchmarks/results/epistemic_ood.md and .json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import payoff_tasks  # noqa: E402
import payoff_training  # noqa: E402
from payoff_tasks import Batch, Task  # noqa: E402

from hf_evon import EVONPosterior  # noqa: E402
from hf_evon.predictive.calibration import calibrate_posterior  # noqa: E402
from hf_evon.predictive.logprobs import log_mean_prob  # noqa: E402
from hf_evon.predictive.uncertainty import entropy, predictive_uncertainty  # noqa: E402

TASKS = ("digits_classes", "digits_rotated", "noisy_table", "docstrings", "noisy_docstrings")
METHODS = ("adamw", "laplace", "ivon", "evon_diag", "evon", "evon_calibrated")
LABELS = {
    "adamw": "AdamW", "laplace": "Laplace LL", "ivon": "IVON", "evon_diag": "EVON diag.", "evon": "EVON",
    "evon_calibrated": "EVON, calibrated scale",
}  # fmt: skip
SAMPLES = 32
SAMPLE_SEED = 1000  # posterior sample s is drawn with seed SAMPLE_SEED + s


def class_split(y: Any, seed: int, held_out: int | None) -> tuple[Any, Any, Any, Any, Any]:
    """payoff.py's split of a seeded permutation of the rows (60% train, 20% calibration, 20% test)
    after the rows of the classes ``>= held_out`` are set aside; (train, cal, test, ood, rng):
    ``ood`` as many held-out rows as the test split (None: no class held out, ``ood`` the test
    rows themselves), ``rng`` the stream, for any further draws."""
    import numpy as np

    rng = np.random.RandomState(seed)
    idx = rng.permutation(len(y))
    ood_pool = idx
    if held_out is not None:
        ood_pool, idx = idx[y[idx] >= held_out], idx[y[idx] < held_out]
    n_tr, n_cal = int(0.6 * len(idx)), int(0.2 * len(idx))
    train, cal, test = idx[:n_tr], idx[n_tr : n_tr + n_cal], idx[n_tr + n_cal :]
    return train, cal, test, (test if held_out is None else ood_pool[: len(test)]), rng


def digits_task(name: str, seed: int, fast: bool, scaling: str = "pixels") -> tuple[Task, list[Batch]]:
    """payoff.py's digits task (its split, MLP and schedule), restricted to the digits 0-4
    (``digits_classes``: OOD the held-out images of 5-9) or whole (``digits_rotated``: OOD its
    test images turned by 90 degrees); the OOD set has as many rows as the ID test split.
    ``scaling``: "pixels" divides the 0-16 intensities by 16; "standard" is payoff.py's per-pixel
    standardisation, under which a rotated image puts pixels the training images almost never
    use (a tiny std) tens of stds from their mean: inputs far outside the data's range."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.preprocessing import StandardScaler

    X, y = load_digits(return_X_y=True)
    train, cal, test, ood, _ = class_split(y, seed, 5 if name == "digits_classes" else None)
    X_ood = (
        X[ood]
        if name == "digits_classes"
        else np.rot90(X[ood].reshape(-1, 8, 8), 1, axes=(1, 2)).reshape(-1, 64)
    )
    scale = (lambda x: x / 16.0) if scaling == "pixels" else StandardScaler().fit(X[train]).transform
    classes = int(y[train].max() + 1)
    task = Task(
        name, payoff_tasks.tabular_mlp(64, classes), payoff_tasks.row_batches(scale(X[train]), y[train], 64),
        payoff_tasks.row_batches(scale(X[cal]), y[cal], 512), payoff_tasks.row_batches(scale(X[test]), y[test], 512),
        epochs=5 if fast else 30, adamw_lr=1e-3, shift=False, classification=True,
    )  # fmt: skip
    return task, payoff_tasks.row_batches(scale(X_ood), np.zeros(len(X_ood), dtype=np.int64), 512)


def noisy_table_task(seed: int, fast: bool) -> tuple[Task, list[Batch]]:
    """payoff.py's held-out 7-class table (``payoff_tasks.SYNTHETIC["synthetic7"]``: 900 rows, 20
    features) restricted to its classes 0-4, 30% of their labels random (among 0-4), trained as
    payoff.py's ``noisy_synthetic7`` (the payoff MLP, batch 32, 80 epochs, standardised features);
    OOD: rows of the classes 5 and 6, as many as the ID test split. Noisy labels make every ID
    input's prediction uncertain (aleatoric), so the entropy alone confuses hard rows with new ones."""
    import numpy as np
    from sklearn.preprocessing import StandardScaler

    X, y = payoff_tasks.load_table("synthetic7")
    train, cal, test, ood, rng = class_split(y, seed, 5)
    labels = np.where(rng.rand(len(y)) < 0.3, rng.randint(0, 5, len(y)), y)
    scale = StandardScaler().fit(X[train]).transform
    task = Task(
        "noisy_table", payoff_tasks.tabular_mlp(20, 5), payoff_tasks.row_batches(scale(X[train]), labels[train], 32),
        payoff_tasks.row_batches(scale(X[cal]), labels[cal], 512), payoff_tasks.row_batches(scale(X[test]), labels[test], 512),
        epochs=5 if fast else 80, adamw_lr=1e-3, shift=False, classification=True,
    )  # fmt: skip
    return task, payoff_tasks.row_batches(scale(X[ood]), np.zeros(len(ood), dtype=np.int64), 512)


def docstrings_task(seed: int, fast: bool, noisy: bool = False) -> tuple[Task, list[Batch]]:
    """payoff.py's ``minilm_lora`` task (``noisy``: ``minilm_noisy_lora``); OOD: as many license
    sentences as its test split has texts, evenly spaced through
    ``default_transfer.license_sentences()``."""
    import default_transfer
    from transformers import AutoTokenizer

    task = payoff_tasks.make_task("minilm_noisy_lora" if noisy else "minilm_lora", seed, fast)
    count = sum(len(y) for _, y in task.test)
    texts, _ = default_transfer.license_sentences()
    picked = texts[:: max(1, len(texts) // count)][:count]
    import finetune_classification as fc

    tok = AutoTokenizer.from_pretrained(fc.minilm_path())
    return task, payoff_tasks.text_batches(tok, picked, [0] * len(picked), 64)


def make(name: str, seed: int, fast: bool, scaling: str = "pixels") -> tuple[Task, list[Batch]]:
    if name in ("docstrings", "noisy_docstrings"):
        return docstrings_task(seed, fast, noisy=name == "noisy_docstrings")
    if name == "noisy_table":
        return noisy_table_task(seed, fast)
    if name in ("digits_classes", "digits_rotated"):
        return digits_task(name, seed, fast, scaling)
    raise ValueError(f"unknown task {name!r}; choose from {TASKS}")


def auroc(in_scores: torch.Tensor, out_scores: torch.Tensor) -> float:
    """P(an OOD score > an ID score) + ½ P(equal): the area under the ROC curve of telling OOD
    inputs by a higher score (the Mann–Whitney statistic, ties counted half)."""
    a, b = in_scores.double().reshape(-1, 1), out_scores.double().reshape(1, -1)
    return float((b > a).double().mean() + 0.5 * (b == a).double().mean())


def log_probs(model: nn.Module, batches: list[Batch]) -> torch.Tensor:
    """log-softmax rows of every input of ``batches`` (float64, eval mode)."""
    return payoff_training.log_probs(model, batches, shift=False)[0]


def sampled_log_probs(
    model: nn.Module, sampled: Callable[[int], Any], batches: list[Batch], samples: int
) -> torch.Tensor:
    """(S, N, C): each posterior sample's log-probabilities; ``sampled(seed)`` puts a sample in."""
    out = []
    for s in range(samples):
        with sampled(SAMPLE_SEED + s):
            out.append(log_probs(model, batches))
    return torch.stack(out)


def rows(
    id_samples: torch.Tensor, ood_samples: torch.Tensor, labels: torch.Tensor, sampled: bool
) -> dict[str, float]:
    """AUROCs of the entropy (and the maximum probability, or the epistemic part where there are
    samples), and the ID NLL and accuracy of the predictive."""
    if sampled:
        u_in, u_out = predictive_uncertainty(id_samples), predictive_uncertainty(ood_samples)
        predictive = log_mean_prob(id_samples.double())
        extra = {"epistemic AUROC": auroc(u_in.epistemic, u_out.epistemic)}
        h_in, h_out = u_in.total, u_out.total
    else:
        predictive = id_samples[0].double()
        h_in, h_out = entropy(id_samples[0]), entropy(ood_samples[0])
        extra = {"max-prob AUROC": auroc(-id_samples[0].max(-1).values, -ood_samples[0].max(-1).values)}
    return {
        "entropy AUROC": auroc(h_in, h_out),
        **extra,
        "ID NLL": float(F.nll_loss(predictive, labels)),
        "ID accuracy": float((predictive.argmax(-1) == labels).double().mean()),
    }


def laplace_samples(model: nn.Module, task: Task, ood: list[Batch], samples: int, seed: int) -> tuple:
    """(ID, OOD) log-probabilities of laplace-torch's GLM samples of the last layer's logits."""
    import payoff_laplace

    model.eval()
    head, train_feats = payoff_laplace.last_layer_features(model, task.train)
    la = payoff_laplace.kron_laplace(
        copy.deepcopy(head), train_feats, payoff_laplace.last_layer_features(model, task.cal)[1]
    )

    def draw(batches: list[Batch]) -> torch.Tensor:
        feats = payoff_laplace.last_layer_features(model, batches)[1]
        gen = torch.Generator().manual_seed(SAMPLE_SEED + seed)
        probs = [
            la.predictive_samples(x, pred_type="glm", n_samples=samples, generator=gen) for x, _ in feats
        ]
        return torch.cat(probs, dim=1).double().clamp_min(1e-300).log()

    return draw(task.test), draw(ood)


def run(
    name: str, method: str, seed: int, fast: bool, samples: int, scaling: str = "pixels"
) -> dict[str, float] | str:
    task, ood = make(name, seed, fast, scaling)
    labels = torch.cat([y for _, y in task.test])
    model = task.make_model(seed)
    chosen: dict[str, float] = {}  # the calibration's choice, where there is one
    if method in ("adamw", "laplace"):
        payoff_training.train_adamw(task, model, seed)
        if method == "adamw":
            return rows(log_probs(model, task.test)[None], log_probs(model, ood)[None], labels, sampled=False)
        try:
            import laplace  # noqa: F401
        except ImportError:
            return "laplace-torch not installed"
        mean = {"mean ID NLL": float(F.nll_loss(log_probs(model, task.test), labels))}
        return {**rows(*laplace_samples(model, task, ood, samples, seed), labels, sampled=True), **mean}
    if method == "ivon":
        try:
            import ivon
        except ImportError:
            return "ivon-opt not installed"
        import payoff

        posterior: Any = payoff.train_ivon(ivon, task, model, seed, payoff.IVON_SETTINGS[payoff.task_kind(task.name)])
    else:
        opt = payoff_training.train_evon(task, model, seed, identity_basis=method == "evon_diag")
        posterior = EVONPosterior.from_optimizer(opt, model)
        if method == "evon_calibrated":
            posterior, result = calibrate_posterior(
                model, posterior, payoff_tasks.as_calibration_batches(task.cal), seed=SAMPLE_SEED + seed
            )
            chosen = {"multiplier": result.multiplier, "temperature": result.temperature}
    sampled = lambda s: posterior.sampled(model, seed=s)  # noqa: E731
    temperature = float(getattr(posterior, "temperature", 1.0))
    draws = 1 if getattr(posterior, "is_point_mass", False) else samples  # every sample is the mean
    id_samples, ood_samples = (
        (sampled_log_probs(model, sampled, b, draws) / temperature).log_softmax(-1) for b in (task.test, ood)
    )
    mean = (log_probs(model, task.test) / temperature).log_softmax(-1)
    return {
        **rows(id_samples, ood_samples, labels, sampled=True),
        "mean ID NLL": float(F.nll_loss(mean, labels)),
        **chosen,
    }


COLUMNS = ("entropy AUROC", "epistemic AUROC", "max-prob AUROC", "ID NLL", "mean ID NLL", "ID accuracy")


def cell(runs: list[dict[str, float]], key: str) -> str:
    """mean ± sd over the seeds' runs, or "–" where the method has no such score."""
    if key not in runs[0]:
        return "–"
    values = [r[key] for r in runs]
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument(
        "--scaling", choices=("pixels", "standard"), default="pixels", help="the digits' inputs"
    )
    parser.add_argument("--fast", action="store_true", help="a few epochs: a smoke test, not a measurement")
    parser.add_argument("--json", help="write every run's numbers here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name in args.tasks:
        print(f"\n## {name}\n\n| method | " + " | ".join(COLUMNS) + " | s/run |")
        print("|---" * (len(COLUMNS) + 2) + "|")
        notes = []  # printed below the table: a line between its rows would end it
        for method in args.methods:
            runs, seconds = [], []
            for seed in range(args.seeds):
                start = time.perf_counter()
                runs.append(run(name, method, seed, args.fast, args.samples, args.scaling))
                seconds.append(time.perf_counter() - start)
            results.setdefault(name, {})[method] = runs
            if isinstance(runs[0], str):
                print(f"| {LABELS[method]} | {runs[0]} |||||")
                continue
            cells = " | ".join(cell(runs, key) for key in COLUMNS)
            print(f"| {LABELS[method]} | {cells} | {statistics.mean(seconds):.0f} |", flush=True)
            if "multiplier" in runs[0]:
                choices = ", ".join(f"{r['multiplier']:.3g} / {r['temperature']:.3g}" for r in runs)
                notes.append(f"{LABELS[method]}: calibrated ζ × / T per seed: {choices}")
        if notes:
            print("\n" + "\n".join(notes), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
