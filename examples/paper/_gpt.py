"""The small-GPT set-up shared by Fig. 1 (middle/right) + Fig. 4 and Table 3.

Data: the Python standard library's sources and pydoc texts (``hf_evon.data.stdlib_corpus``,
a fixed pseudo-random subset of whole documents), split by document, tokenised by a small
byte-level BPE trained on the training part. Model: a config-built GPT-2 (no dropout).
Every run sees the same batches in the same order (one seeded generator per run).

Optimizers: the paper's NanoGPT table for EVON (lr 1.72e-2, h0 0.582, β1 0.943, 1−β2 9.12e-4,
δ 1e-6, β3 0.995) and IVON (lr 142, h0 1.8e-2, β1 0.89, 1−β2 1.23e-4, δ 1e-6, element clip
1e-4); ζ = the number of training tokens for both (the paper's ζ was tuned for 1B tokens of
FineWeb; ζ = n is the textbook choice for a mean per-token loss). SOAP mode is EVON with
ζ = ∞ (no noise, squared rotated gradients as Hessian), IVON mode EVON with Q = I. As in the
paper, embeddings, the output head and 1-D tensors are trained by AdamW in every run.
Schedule (NanoGPT's): linear warm-up over 10% of the steps, constant, linear cool-down to 0
over the last third.

Besides the paper's algorithm, ``LEARNED`` runs train the same model on the same batches with
the library's defaults (``build_optimizer(model)``: the Fisher estimate, ζ and δ fitted to the
measured curvature, the per-matrix step), EVON and IVON mode, for the posterior learned from data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from _common import PAPER_EVON, ivon_lr, param_group_settings

from hf_evon import EVON, EVONPosterior, build_optimizer, build_param_groups
from hf_evon.data import encode_documents, split_documents, stdlib_corpus, train_bpe_tokenizer
from hf_evon.predictive.calibration import CalibrationResult, calibrate_posterior
from hf_evon.predictive.generation import bma_log_likelihood, bma_loss_curve

ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
EVON_TABLE = dict(
    lr=1.72e-2,
    hess_init=0.582,
    betas=(0.943, 1 - 9.12e-4),
    weight_decay=1e-6,
    shampoo_beta=0.995,
    hess_clip_ratio=None,  # off in "Plain"; Table 3's "clip" component sets 1.5
)
IVON_TABLE = dict(
    lr=142.0,
    hess_init=1.8e-2,
    betas=(0.89, 1 - 1.23e-4),
    weight_decay=1e-6,
    clip="element",
    clip_radius=1e-4,
    hess_clip_ratio=None,
)
# Table 3's components on top of the plain EVON: whitening replaces the spectral clip
COMPONENTS = {
    "Whiten": dict(clip="whiten"),
    "PG": dict(phased_gradients=True),
    "clip": dict(hess_clip_ratio=1.5),
}
PLAIN = dict(clip="spectral", clip_radius=1.0)
# the library's defaults (build_optimizer(model, **these)): EVON, and IVON mode (Q = I, same update);
# then both at the AdamW baseline's rate, the one number the library asks a user for (learning_rate:
# the rate one would give AdamW; None is AdamW's default 1e-3)
LEARNED = {
    "EVON defaults": {},
    "IVON defaults": dict(identity_basis=True),
    "EVON defaults, lr 3e-3": dict(learning_rate=ADAMW["lr"]),
    "IVON defaults, lr 3e-3": dict(learning_rate=ADAMW["lr"], identity_basis=True),
}


@dataclass
class Setup:
    """Sizes of one run; ``fast`` shrinks everything to a few seconds."""

    steps: int = 300
    batch_size: int = 16
    seq_len: int = 64
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    vocab_size: int = 512
    corpus_bytes: int = 1_500_000
    val_sequences: int = 48
    eval_every: int = 25
    precondition_frequency: int = 10

    @classmethod
    def fast(cls) -> Setup:
        return cls(
            steps=12,
            batch_size=4,
            seq_len=32,
            n_layer=1,
            n_embd=32,
            vocab_size=300,
            corpus_bytes=120_000,
            val_sequences=8,
            eval_every=6,
        )


@dataclass
class Data:
    train: torch.Tensor  # 1-D token stream
    val: torch.Tensor  # (val_sequences, seq_len)
    vocab_size: int
    # (≤ val_sequences, seq_len): the held-out sequences after ``val``, for calibration only
    calib: torch.Tensor | None = None


def load_data(setup: Setup) -> Data:
    docs = stdlib_corpus(max_bytes=setup.corpus_bytes)
    train_docs, val_docs = split_documents(docs, val_fraction=0.05)
    tok = train_bpe_tokenizer((t for _, t in train_docs), vocab_size=setup.vocab_size)
    train = encode_documents(tok, [t for _, t in train_docs]).long()
    val = encode_documents(tok, [t for _, t in val_docs]).long()
    usable = (len(val) // setup.seq_len) * setup.seq_len
    held_out = val[:usable].reshape(-1, setup.seq_len)
    val, calib = held_out[: setup.val_sequences], held_out[setup.val_sequences : 2 * setup.val_sequences]
    if len(val) < setup.val_sequences:
        raise ValueError(f"validation split has {len(val)} sequences, fewer than {setup.val_sequences}")
    return Data(train, val, len(tok), calib if len(calib) else None)


def build_model(setup: Setup, vocab_size: int, seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab_size,
        n_positions=setup.seq_len,
        n_embd=setup.n_embd,
        n_layer=setup.n_layer,
        n_head=setup.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def evon_kwargs(method: str, train_tokens: int, variant: dict[str, Any] | None = None) -> dict[str, Any]:
    """EVON's arguments for a method: "EVON" (+ a Table-3 variant), "IVON" or "SOAP"."""
    if method == "IVON":
        lr = ivon_lr(IVON_TABLE["lr"], IVON_TABLE["hess_init"], IVON_TABLE["weight_decay"])
        return dict(IVON_TABLE, lr=lr, ess=float(train_tokens), identity_basis=True, **PAPER_EVON)
    kw = dict(EVON_TABLE, ess=float("inf") if method == "SOAP" else float(train_tokens), **PAPER_EVON)
    kw.update(PLAIN if variant is None else variant)
    return kw


def variant_kwargs(name: str) -> dict[str, Any]:
    """Table 3's configuration names ("Plain", "Whiten+PG+clip", ...) as EVON arguments."""
    kw = dict(PLAIN)
    if name != "Plain":
        for part in name.split("+"):
            kw.update(COMPONENTS["clip" if part == "Clip" else part])
    return kw


def schedule(steps: int) -> Any:
    warmup, cooldown = max(1, steps // 10), int(steps * 2 / 3)

    def factor(k: int) -> float:
        if k < warmup:
            return (k + 1) / warmup
        if k < cooldown:
            return 1.0
        return max(0.0, 1 - (k - cooldown) / max(1, steps - cooldown))

    return factor


@dataclass
class Run:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    curve_steps: list[int] = field(default_factory=list)
    curve_loss: list[float] = field(default_factory=list)


@torch.no_grad()
def mean_loss(model: torch.nn.Module, val: torch.Tensor) -> float:
    """Validation loss at the posterior mean (mean NLL per predicted token)."""
    return float(model(input_ids=val, labels=val).loss)


def make_optimizer(
    method: str,
    model: torch.nn.Module,
    setup: Setup,
    train_tokens: int,
    seed: int,
    variant: dict[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer of ``method``: "AdamW" is torch's AdamW on everything, a ``LEARNED`` name
    ``build_optimizer`` at the library's defaults, the others EVON modes with the paper's algorithm."""
    if method in LEARNED:
        return build_optimizer(model, seed=seed, **LEARNED[method])
    groups = build_param_groups(model, adamw_lr=ADAMW["lr"], adamw_weight_decay=ADAMW["weight_decay"])
    if method == "AdamW":
        for g in groups:
            g.pop("algorithm"), g.pop("param_names")
        return torch.optim.AdamW(groups, **ADAMW)
    return EVON(
        groups,
        adamw_betas=ADAMW["betas"],
        precondition_frequency=setup.precondition_frequency,
        seed=seed,
        **evon_kwargs(method, train_tokens, variant),
    )


def optimizer_settings(
    method: str,
    setup: Setup,
    vocab_size: int,
    train_tokens: int,
    seed: int,
    variant: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a run's optimizer resolves to, every default included, built on the untrained model
    (cheap: the settings hash is recomputed from it without training). AdamW: its arguments
    (torch's own group keys vary with the torch version)."""
    if method == "AdamW":
        return dict(kwargs=ADAMW)
    opt = make_optimizer(method, build_model(setup, vocab_size, seed), setup, train_tokens, seed, variant)
    assert isinstance(opt, EVON)
    given = dict(LEARNED[method]) if method in LEARNED else evon_kwargs(method, train_tokens, variant)
    return dict(kwargs=given, groups=param_group_settings(opt), nonfinite=opt.nonfinite, seed=opt.seed)


def train(method: str, data: Data, setup: Setup, seed: int, variant: dict[str, Any] | None = None) -> Run:
    """Train one model (``make_optimizer``'s methods)."""
    model = build_model(setup, data.vocab_size, seed)
    opt = make_optimizer(method, model, setup, len(data.train), seed, variant)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(setup.steps))
    gen = torch.Generator().manual_seed(seed)
    run = Run(model, opt)
    span = setup.seq_len
    for k in range(setup.steps):
        starts = torch.randint(0, len(data.train) - span, (setup.batch_size,), generator=gen)
        batch = torch.stack([data.train[s : s + span] for s in starts.tolist()])
        if isinstance(opt, EVON):
            for _ in range(opt.mc_samples):
                with opt.sampled_params(train=True):
                    model(input_ids=batch, labels=batch).loss.backward()
        else:
            model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if (k + 1) % setup.eval_every == 0 or k + 1 == setup.steps:
            run.curve_steps.append(k + 1)
            run.curve_loss.append(mean_loss(model, data.val))
    if not math.isfinite(run.curve_loss[-1]):
        raise FloatingPointError(f"{method}: the validation loss is {run.curve_loss[-1]}")
    return run


def bma_curve(
    run: Run, val: torch.Tensor, sizes: list[int], seed: int, posterior: Any = None
) -> dict[int, float]:
    """Expected BMA validation loss with k samples, for each k in ``sizes`` (disjoint groups of
    the max(sizes) samples drawn, ``hf_evon.predictive.generation.bma_loss_curve``); ``posterior``
    None: the trained one."""
    if posterior is None:
        posterior = EVONPosterior.from_optimizer(run.optimizer, run.model)
    result = bma_log_likelihood(run.model, posterior, val, num_samples=max(sizes), seed=seed)
    return bma_loss_curve(result, sizes)


def calibrate(run: Run, calib: torch.Tensor, seed: int, **kwargs: Any) -> tuple[Any, CalibrationResult]:
    """The trained posterior with its sampling ζ chosen by ``calibrate_posterior`` (its defaults,
    but for ``kwargs``) on ``calib``, held-out sequences disjoint from the reported validation ones.
    The noise scale alone (``temperature=False``): the paper's BMA has no softmax temperature."""
    posterior = EVONPosterior.from_optimizer(run.optimizer, run.model)
    batches = [{"input_ids": calib, "labels": calib}]
    return calibrate_posterior(run.model, posterior, batches, seed=seed, **{"temperature": False, **kwargs})
