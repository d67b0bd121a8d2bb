"""Pre-train a small GPT-2 or Llama with EVON (or AdamW/SOAP/IVON) under ``accelerate launch``.

Default (no network): a config-built GPT-2 (4 layers, width 128) on the Python standard
library's sources and pydoc texts, tokenised by a 4096-token byte-level BPE trained on them
(cached in the output directory). Validation loss is reported at the posterior mean and under
Bayesian model averaging (next-token probabilities averaged over posterior samples). The
model, tokenizer, posterior and model card are saved (and pushed with ``--push-to-hub``).

    python examples/pretrain_lm.py                                   # one process, ~2 min on 2 CPUs
    python examples/pretrain_lm.py --optimizer adamw                 # the paper's baselines:
    python examples/pretrain_lm.py --optimizer soap                  #   EVON with ess=inf
    python examples/pretrain_lm.py --optimizer ivon                  #   EVON with Q = I
    accelerate launch --num_processes 2 --multi_gpu examples/pretrain_lm.py   # DDP, 2 processes
    python examples/pretrain_lm.py --model llama --n-layer 8 --n-embd 256 --dataset wikitext \\
        --dataset-config wikitext-103-raw-v1                          # downloads it: needs the network

On a machine without GPUs, ``accelerate launch --multi_gpu --num_processes N`` starts N CPU
processes (DDP over gloo); accelerate's ``--cpu --num_processes N`` only does so through MPI
(``--mpirun_hostfile``) and otherwise starts one process. ``--batch-size`` is per process.

With the paper's fixed ζ (``EVON_DEFAULTS``) the posterior noise of the short default run is tiny, so
BMA changes the validation loss only slightly. Measured figures: docs/results.md#lm-pre-training.

Distributed: EVON needs ``hf_evon.prepare_distributed(model, optimizer)`` after
``accelerator.prepare`` (each rank keeps its own gradient for its own Hessian estimate;
everything is averaged once per step); ``--shard`` also splits EVON's state across the ranks
(``prepare_distributed(shard=True)``: each keeps the eigenbases and H of its share of the
matrices). The library trains under FSDP2 too (``prepare_distributed`` on a ``fully_shard``-ed
model, ``docs/usage.md``); this script launches plain DDP and refuses FSDP and DeepSpeed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
import time

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, GradientAccumulationPlugin, set_seed
from huggingface_hub import CommitOperationDelete, HfApi
from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
from tqdm.auto import tqdm

from hf_evon import EVON, EVONPosterior, build_param_groups, prepare_distributed
from hf_evon.data import (
    dataset_corpus,
    encode_documents,
    load_or_train_tokenizer,
    split_documents,
    stdlib_corpus,
)
from hf_evon.fileio import file_on_the_way
from hf_evon.optim.checks import CLIP_MODES
from hf_evon.optim.recipes import PAPER_ALGORITHM, recipe_kwargs
from hf_evon.optim.validation import validate_hyperparameters
from hf_evon.posterior.format import POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME
from hf_evon.posterior.model_card import SECTION_START

# EVON's defaults: the paper's NanoGPT table (lr, h0, ζ, β1, 1-β2, δ, β3), adaptive Hessian
# clipping γ = 1.5 and whitened updates (the best variant of the paper's ablation), run with the
# paper's algorithm (PAPER_ALGORITHM: the Price estimate, the per-entry step, no snr_scaling): the
# table's fixed ζ and δ were tuned for it, and under the library's Fisher estimate H falls far below
# δ and the noise grows to many times the weights.
EVON_DEFAULTS = dict(
    lr=1.72e-2,
    ess=5.27e6,
    hess_init=0.582,
    beta1=0.943,
    beta2=1 - 9.12e-4,
    weight_decay=1e-6,
    shampoo_beta=0.995,
    hess_clip=1.5,
    clip="whiten",
)
DEFAULT_LR = {
    "adamw": 1e-3,
    "soap": EVON_DEFAULTS["lr"],
    "ivon": EVON_DEFAULTS["lr"],
    "evon": EVON_DEFAULTS["lr"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument_group("model")
    a.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    a.add_argument("--n-layer", type=int, default=4)
    a.add_argument("--n-embd", type=int, default=128)
    a.add_argument("--n-head", type=int, default=4)
    a.add_argument("--seq-len", type=int, default=128)
    a.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary trained on the corpus")
    d = ap.add_argument_group("data")
    d.add_argument("--dataset", default=None, help="a `datasets` text dataset instead of the stdlib corpus (downloaded: needs the network)")
    d.add_argument("--dataset-config", default=None)
    d.add_argument("--text-column", default="text")
    d.add_argument("--corpus-mb", type=float, default=None, help="cap on the corpus size (MB of text)")
    d.add_argument(
        "--val-fraction", type=float, default=0.02, help="share of the documents held out for validation, in (0, 1)"
    )
    o = ap.add_argument_group("optimisation")
    o.add_argument("--optimizer", choices=["adamw", "soap", "ivon", "evon"], default="evon")
    o.add_argument("--max-steps", type=int, default=300)
    o.add_argument("--batch-size", type=int, default=8, help="sequences per process per optimizer step")
    o.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches per step (accelerator.accumulate)"
    )
    o.add_argument("--lr", type=float, default=None, help=f"matrices' learning rate (default {DEFAULT_LR})")
    o.add_argument("--adamw-lr", type=float, default=3e-3, help="embeddings, head and 1-D tensors")
    o.add_argument("--adamw-weight-decay", type=float, default=0.1, help="AdamW decay of 2-D tensors")
    o.add_argument("--warmup-steps", type=int, default=30)
    o.add_argument("--schedule", choices=["cosine", "linear"], default="cosine")
    o.add_argument("--min-lr-ratio", type=float, default=0.1)
    o.add_argument("--grad-clip", type=float, default=0.0, help="clip the mean gradient's norm (0: off)")
    o.add_argument(
        "--shard", action="store_true", help="split EVON's state across processes (prepare_distributed(shard=True))"
    )
    e = ap.add_argument_group("EVON (soap: ess=inf; ivon: identity basis)")
    e.add_argument(
        "--recipe",
        choices=["nanogpt", "llama"],
        default=None,
        help="the paper's tuned EVON settings (hf_evon.RECIPES, from its NanoGPT/Llama table) instead of the "
        "--ess ... --clip-radius values below (GPU-scale runs: batch 512, thousands of steps)",
    )
    e.add_argument("--ess", type=float, default=EVON_DEFAULTS["ess"])
    e.add_argument("--hess-init", type=float, default=EVON_DEFAULTS["hess_init"])
    e.add_argument("--beta1", type=float, default=EVON_DEFAULTS["beta1"])
    e.add_argument("--beta2", type=float, default=EVON_DEFAULTS["beta2"])
    e.add_argument("--shampoo-beta", type=float, default=EVON_DEFAULTS["shampoo_beta"])
    e.add_argument("--weight-decay", type=float, default=EVON_DEFAULTS["weight_decay"], help="δ (prior)")
    e.add_argument("--hess-clip", type=float, default=EVON_DEFAULTS["hess_clip"], help="γ (0: off)")
    e.add_argument("--clip", default=EVON_DEFAULTS["clip"], choices=list(CLIP_MODES))
    e.add_argument("--clip-radius", type=float, default=1.0)
    e.add_argument("--precondition-frequency", type=int, default=10)
    e.add_argument("--mc-samples", type=int, default=1)
    v = ap.add_argument_group("evaluation and output")
    v.add_argument("--eval-every", type=int, default=100)
    v.add_argument("--val-batches", type=int, default=4, help="validation batches of --batch-size sequences")
    v.add_argument("--bma-samples", type=int, default=8)
    v.add_argument("--output-dir", default="outputs/pretrain_lm")
    v.add_argument("--cache-dir", default=None, help="tokenizer + token cache (default: the output dir)")
    v.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="push model + posterior + card")
    v.add_argument("--seed", type=int, default=0, help="data split, initialisation and noise (default 0)")
    v.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    # counts a run divides by or reads the last of: refused here, not after the training
    # and the model's sizes (no layer leaves EVON no matrix: its posterior is refused after the training)
    counts = ("max_steps", "batch_size", "seq_len", "grad_accum", "mc_samples", "val_batches", "bma_samples")
    for name in (*counts, "n_layer", "n_embd", "n_head", "vocab_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be an integer >= 1; got {getattr(args, name)}")
    if args.n_embd % args.n_head:  # each attention head takes an equal slice of the width
        ap.error(f"--n-embd must be a multiple of --n-head; got {args.n_embd} and {args.n_head}")
    if args.batch_size % args.grad_accum:
        ap.error(f"--batch-size must be a multiple of --grad-accum; got {args.batch_size} and {args.grad_accum}")
    if args.corpus_mb is not None and not args.corpus_mb > 0:  # an empty corpus: nothing to train on
        ap.error(f"--corpus-mb must be a number > 0 (MB of text); got {args.corpus_mb:g}")
    # the run evaluates on the held-out documents and trains on the others, so it needs both: a
    # fraction that leaves either side empty is this argument's fault, whatever the corpus
    if not 0 < args.val_fraction < 1:
        ap.error(
            "--val-fraction must be above 0 and below 1 (the run reports its validation loss, and trains on "
            f"the rest); got {args.val_fraction:g}"
        )
    for flag, path in (("--output-dir", args.output_dir), ("--cache-dir", args.cache_dir)):
        if path and (blocking := file_on_the_way(path)) is not None:
            ap.error(f"{flag} {blocking!r} is a file, not a directory")
    if not 0 <= args.seed < 2**32:  # torch's and numpy's seeds: out of range, they fail only after the data is read
        ap.error(f"--seed must be an integer from 0 to 2**32 - 1; got {args.seed}")
    # the schedule multiplies every group's rate by a factor that ends at --min-lr-ratio: below 0 the
    # rate turns negative (EVON refuses that step mid-run, AdamW ascends), NaN makes it NaN
    if not 0 <= args.min_lr_ratio <= 1:
        ap.error(f"--min-lr-ratio must be a number in [0, 1]; got {args.min_lr_ratio:g}")
    if not 0 <= args.grad_clip < math.inf:  # NaN or a negative norm would turn the clipping off unseen
        ap.error(f"--grad-clip must be a finite number >= 0 (0: off); got {args.grad_clip:g}")
    if args.eval_every < 0:  # only the final evaluation, unseen
        ap.error(f"--eval-every must be an integer >= 0 (0: only at the end); got {args.eval_every}")
    if args.warmup_steps < 0:  # no warmup, unseen
        ap.error(f"--warmup-steps must be an integer >= 0; got {args.warmup_steps}")
    # the rates every variant uses, checked as EVON checks them: torch's AdamW checks only its
    # default rate, not the matrices' group (--lr), and would train them by gradient ascent
    rates = {
        "--lr": {"lr": args.lr},
        "--adamw-lr": {"adamw_lr": args.adamw_lr},
        "--adamw-weight-decay": {"adamw_weight_decay": args.adamw_weight_decay},
    }
    for flag, kwargs in rates.items():
        try:
            validate_hyperparameters(**kwargs)
        except ValueError as err:
            ap.error(f"{flag}: {err}")
    # EVON's settings, checked as EVON checks them, before the data and the model are built
    settings = {
        "--ess": {"ess": args.ess},
        "--hess-init": {"hess_init": args.hess_init},
        "--beta1/--beta2": {"betas": (args.beta1, args.beta2)},
        "--shampoo-beta": {"shampoo_beta": args.shampoo_beta},
        "--weight-decay": {"weight_decay": args.weight_decay},
        "--hess-clip": {"hess_clip_ratio": args.hess_clip or None},
        "--clip-radius": {"clip_radius": args.clip_radius},
        "--precondition-frequency": {"precondition_frequency": args.precondition_frequency},
    }
    if args.optimizer != "adamw":
        for flag, kwargs in settings.items():
            try:
                validate_hyperparameters(**kwargs)
            except ValueError as err:
                ap.error(f"{flag}: {err}")
    if args.push_to_hub:  # the push comes after the training: what stops it is found before
        from huggingface_hub import constants, get_token

        if constants.HF_HUB_OFFLINE:
            ap.error(f"--push-to-hub {args.push_to_hub}: HF_HUB_OFFLINE is set, so nothing can be pushed")
        if get_token() is None:
            ap.error(f"--push-to-hub {args.push_to_hub}: no Hub token (set HF_TOKEN, or log in with `hf auth login`)")
    return args


# ----------------------------------------------------------------------------- data
def load_tokens(
    args: argparse.Namespace, accelerator: Accelerator
) -> tuple[object, torch.Tensor, torch.Tensor]:
    """Tokenizer + train/validation token streams; built once by the main process, then cached."""
    cache_root = args.cache_dir or args.output_dir
    source = args.dataset or "stdlib"
    # everything that decides the tokens: a dataset's text column too (another column is other data)
    column = f"-{args.text_column}" if args.dataset else ""
    key = f"{source}-{args.dataset_config}{column}-{args.corpus_mb}-{args.val_fraction}-{args.vocab_size}"
    key = key.replace("/", "_")
    tok_dir = os.path.join(cache_root, f"tokenizer-{key}")  # trained on this corpus's training split
    cache = os.path.join(cache_root, "data_cache", f"{key}.pt")
    with accelerator.main_process_first():
        if not os.path.isfile(cache) or not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
            max_bytes = None if args.corpus_mb is None else int(args.corpus_mb * 1e6)
            if args.dataset:
                docs = dataset_corpus(
                    args.dataset, args.dataset_config, text_column=args.text_column, max_bytes=max_bytes
                )
            else:
                docs = stdlib_corpus(max_bytes=max_bytes)
            train_docs, val_docs = split_documents(docs, args.val_fraction)
            tokenizer = load_or_train_tokenizer(tok_dir, (t for _, t in train_docs), args.vocab_size)
            train = encode_documents(tokenizer, [t for _, t in train_docs])
            val = encode_documents(tokenizer, [t for _, t in val_docs])
            if accelerator.is_main_process:
                os.makedirs(os.path.dirname(cache), exist_ok=True)
                tmp = f"{cache}.{os.getpid()}.tmp"
                torch.save({"train": train, "val": val}, tmp)
                os.replace(tmp, cache)  # atomic: a concurrent job never reads a partial file
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
        data = torch.load(cache, weights_only=True)
    return tokenizer, data["train"], data["val"]


def train_batch(
    tokens: torch.Tensor, step: int, args: argparse.Namespace, accelerator: Accelerator
) -> list[torch.Tensor]:
    """This rank's micro-batches: its slice of a global batch drawn from (seed, step) alone.

    So N processes × batch b see exactly the data of 1 process × batch N·b.
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - args.seq_len, (world * args.batch_size,), generator=gen)
    mine = starts[rank * args.batch_size : (rank + 1) * args.batch_size]
    rows = torch.stack([tokens[s : s + args.seq_len] for s in mine.tolist()]).long().to(accelerator.device)
    return list(rows.chunk(args.grad_accum))


def val_blocks(tokens: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    n = min(args.val_batches * args.batch_size, len(tokens) // args.seq_len)
    if n == 0:  # the losses would be NaN, and written to metrics.json and the card as numbers
        raise SystemExit(
            f"pretrain_lm: the validation split holds {len(tokens)} tokens, less than one --seq-len block "
            f"({args.seq_len}): use a shorter --seq-len or a larger corpus"
        )
    return tokens[: n * args.seq_len].view(n, args.seq_len).long()


# ----------------------------------------------------------------------------- model + optimizer
def build_model(args: argparse.Namespace, vocab_size: int) -> torch.nn.Module:
    if args.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=vocab_size,
            n_positions=args.seq_len,
            n_embd=args.n_embd,
            n_layer=args.n_layer,
            n_head=args.n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(cfg)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.n_embd,
        intermediate_size=int(8 * args.n_embd / 3 + 63) // 64 * 64,
        num_hidden_layers=args.n_layer,
        num_attention_heads=args.n_head,
        num_key_value_heads=args.n_head,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(cfg)


def build_optimizer_for(args: argparse.Namespace, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW for embeddings, head and 1-D tensors in every variant; the matrices get the choice."""
    lr = DEFAULT_LR[args.optimizer] if args.lr is None else args.lr
    groups = build_param_groups(model, adamw_lr=args.adamw_lr, adamw_weight_decay=args.adamw_weight_decay)
    if args.optimizer == "adamw":
        for g in groups:
            if g["algorithm"] == "evon":
                g.update(lr=lr, weight_decay=args.adamw_weight_decay)
            g.pop("algorithm")
            g.pop("param_names")
        return torch.optim.AdamW(groups, lr=args.adamw_lr, betas=(0.9, 0.95))
    if args.recipe is not None:
        fixed = dict(identity_basis=args.optimizer == "ivon", precondition_frequency=args.precondition_frequency,
                     mc_samples=args.mc_samples, adamw_betas=(0.9, 0.95), seed=args.seed)  # fmt: skip
        if args.optimizer == "soap":
            fixed["ess"] = float("inf")
        if args.lr is not None:
            fixed["lr"] = args.lr
        return EVON(groups, **recipe_kwargs(args.recipe, fixed))
    return EVON(
        groups,
        **PAPER_ALGORITHM,
        lr=lr,
        ess=float("inf") if args.optimizer == "soap" else args.ess,
        identity_basis=args.optimizer == "ivon",
        hess_init=args.hess_init,
        betas=(args.beta1, args.beta2),
        shampoo_beta=args.shampoo_beta,
        weight_decay=args.weight_decay,
        hess_clip_ratio=args.hess_clip or None,
        clip=args.clip,
        clip_radius=args.clip_radius,
        precondition_frequency=args.precondition_frequency,
        mc_samples=args.mc_samples,
        adamw_betas=(0.9, 0.95),
        seed=args.seed,
    )


def lr_lambda(args: argparse.Namespace):
    """Linear warmup, then cosine or linear decay to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        frac = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * frac)) if args.schedule == "cosine" else 1 - frac
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * decay

    return factor


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    blocks: torch.Tensor,
    args: argparse.Namespace,
    accelerator: Accelerator,
    posterior: EVONPosterior | None,
    step: int,
) -> dict[str, float]:
    """Mean next-token NLL at the posterior mean and under BMA (log-mean-exp of log-softmax).

    BMA uses ``posterior.sampled(model, seed)`` with the same seeds on every rank and for every
    batch, so training's noise stream is untouched and the result does not depend on N.
    """
    model.eval()
    mine = blocks[accelerator.process_index :: accelerator.num_processes]
    samples = args.bma_samples if posterior is not None else 0
    mean_nll = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    bma_nll = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    count = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    batches = [
        mine[i : i + args.batch_size].to(accelerator.device) for i in range(0, len(mine), args.batch_size)
    ]

    def token_logp(ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    for ids in batches:
        lp = token_logp(ids)
        mean_nll -= lp.double().sum()
        count += lp.numel()
    if samples:
        acc = [None] * len(batches)
        for s in range(samples):
            with posterior.sampled(model, seed=args.seed + 7919 * step + s):
                for i, ids in enumerate(batches):
                    lp = token_logp(ids).double()
                    acc[i] = lp if acc[i] is None else torch.logaddexp(acc[i], lp)
        for a in acc:
            bma_nll -= (a - math.log(samples)).sum()
    totals = accelerator.reduce(torch.stack([mean_nll, bma_nll, count]), reduction="sum")
    model.train()
    out = {"val_loss": float(totals[0] / totals[2])}
    if samples:
        out["val_loss_bma"] = float(totals[1] / totals[2])
    return out


# ----------------------------------------------------------------------------- main
def _has_accelerator() -> bool:
    xpu = getattr(torch, "xpu", None)
    mps = getattr(torch.backends, "mps", None)
    return (
        torch.cuda.is_available()
        or bool(xpu is not None and xpu.is_available())
        or bool(mps is not None and mps.is_available())
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    accelerator = Accelerator(
        # without an accelerator, processes started by torchrun/`accelerate launch --multi_gpu`
        # only form a (gloo) group when accelerate is told to use the CPU
        cpu=not _has_accelerator(),
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.grad_accum, sync_with_dataloader=False
        ),
    )
    if args.optimizer != "adamw" and accelerator.distributed_type in (
        DistributedType.FSDP,
        DistributedType.DEEPSPEED,
    ):
        raise SystemExit(
            f"EVON cannot run under {accelerator.distributed_type.value}: it needs whole weight matrices on every "
            "rank (its eigenbasis is per matrix). Launch with plain DDP, or use --optimizer adamw."
        )
    set_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    t0 = time.time()
    tokenizer, train_tokens, val_tokens = load_tokens(args, accelerator)
    accelerator.print(
        f"data: {len(train_tokens):,} train / {len(val_tokens):,} validation tokens, vocabulary {len(tokenizer)} "
        f"({time.time() - t0:.1f}s); {accelerator.num_processes} process(es), {accelerator.distributed_type.value}"
    )
    if len(train_tokens) <= args.seq_len:  # the training windows start below len - seq_len
        raise SystemExit(
            f"pretrain_lm: the training split holds {len(train_tokens)} tokens, not more than one --seq-len "
            f"block ({args.seq_len}): use a shorter --seq-len, a smaller --val-fraction or a larger corpus"
        )
    model = build_model(args, len(tokenizer))
    optimizer = build_optimizer_for(args, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))  # stepped once per step
    model, optimizer = accelerator.prepare(model, optimizer)
    evon = prepare_distributed(model, optimizer, shard=args.shard) if args.optimizer != "adamw" else None
    if evon is not None and args.shard:
        owned = sum(len(b.params) for b in evon.buckets)
        total = sum(len(g["params"]) for g in evon.param_groups if g["algorithm"] == "evon")
        accelerator.print(f"EVON state sharded: this rank keeps {owned} of {total} matrices")
    raw = accelerator.unwrap_model(model)
    n_params = sum(p.numel() for p in raw.parameters())
    accelerator.print(f"model: {args.model}, {n_params:,} parameters; optimizer: {args.optimizer}")
    blocks = val_blocks(val_tokens, args)
    # the ζ the optimizer trains with (a --recipe's, not --ess's); SOAP-mode's is inf
    has_posterior = evon is not None and all(
        math.isfinite(g["ess"]) for g in evon.param_groups if g["algorithm"] == "evon"
    )
    samples = evon.mc_samples if evon is not None else 1
    history: list[dict] = []
    bar = tqdm(range(args.max_steps), disable=args.no_progress or not accelerator.is_local_main_process)
    train_start, running = time.time(), None
    model.train()
    for step in bar:
        micro = train_batch(train_tokens, step, args, accelerator)
        loss_sum = torch.zeros((), device=accelerator.device)
        for _ in range(samples):
            with evon.sampled_params(train=True) if evon is not None else contextlib.nullcontext():
                for ids in micro:
                    with accelerator.accumulate(model):
                        loss = model(input_ids=ids, labels=ids).loss
                        accelerator.backward(loss)
                    loss_sum += loss.detach() / (len(micro) * samples)
        if not accelerator.sync_gradients:  # would make AcceleratedOptimizer.step() skip silently
            raise RuntimeError("gradient accumulation is out of step with the optimizer steps")
        if args.grad_clip > 0:
            if evon is not None:
                evon.synchronize()  # clip the averaged gradient; EVON divides by the sample count
            accelerator.clip_grad_norm_(model.parameters(), args.grad_clip * samples)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_val = float(loss_sum)
        running = loss_val if running is None else 0.9 * running + 0.1 * loss_val
        bar.set_postfix(loss=f"{running:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
        last = step + 1 == args.max_steps
        if last or (args.eval_every > 0 and (step + 1) % args.eval_every == 0):
            posterior = EVONPosterior.from_optimizer(evon, raw) if has_posterior else None
            metrics = evaluate(raw, blocks, args, accelerator, posterior, step + 1)
            metrics.update(step=step + 1, train_loss=running, elapsed_s=round(time.time() - train_start, 1))
            history.append(metrics)
            bma = (
                f" | val loss (BMA, S={args.bma_samples}) {metrics['val_loss_bma']:.4f}"
                if "val_loss_bma" in metrics
                else ""
            )
            accelerator.print(
                f"step {step + 1}: train loss {running:.4f} | val loss (mean) {metrics['val_loss']:.4f}{bma}"
            )
    bar.close()
    wall = time.time() - train_start
    final = dict(
        history[-1],
        optimizer=args.optimizer,
        train_wall_s=round(wall, 1),
        processes=accelerator.num_processes,
    )
    summary = f"final ({args.optimizer}, {args.max_steps} steps, {wall:.0f}s): val_loss_mean={final['val_loss']:.4f}"
    if "val_loss_bma" in final:
        summary += f" val_loss_bma={final['val_loss_bma']:.4f}"
    accelerator.print(summary)
    save(args, accelerator, raw, tokenizer, evon if has_posterior else None, final, history)
    # Every rank waits for the main process to finish writing before the process group is torn down:
    # a rank that destroys its gloo group while its peer is still busy aborts ("terminate called ...").
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final


def save(args, accelerator, raw, tokenizer, evon, final, history) -> None:
    """Model + tokenizer + metrics; with a posterior also evon_posterior.* and the model card."""
    # taken on every rank: with sharded state each rank contributes its matrices' factors
    posterior = None if evon is None else EVONPosterior.from_optimizer(evon, raw)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    out = os.path.join(args.output_dir, "model")
    if args.no_progress:  # transformers' own bar while it writes the weights
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    raw.save_pretrained(out)
    tokenizer.save_pretrained(out)
    with open(os.path.join(args.output_dir, "metrics.json"), "w") as fh:
        json.dump({"final": final, "history": history, "args": vars(args)}, fh, indent=2)
    card = None
    if evon is None:  # no posterior: do not leave a stale one (or its card) from an earlier run beside this model
        for name in (POSTERIOR_WEIGHTS_NAME, POSTERIOR_CONFIG_NAME):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out, name))
        card_path = os.path.join(out, "README.md")
        if os.path.isfile(card_path):
            with open(card_path, encoding="utf-8", errors="replace") as fh:
                stale = is_posterior_card(fh.read())
            if stale:
                os.remove(card_path)
    else:
        metrics = {"mean": {"loss": final["val_loss"]}, "bma": {"loss": final["val_loss_bma"]}}
        card = {"metrics": metrics, "num_bma_samples": args.bma_samples}
        posterior.save_pretrained(out, model_card_kwargs=card)
    accelerator.print(f"saved model{' + posterior + model card' if evon is not None else ''} to {out}")
    if args.push_to_hub:
        # first, so that no commit of the repo pairs this run's weights with an earlier run's posterior
        remove_posterior_from_hub(args.push_to_hub)
        raw.push_to_hub(args.push_to_hub)
        tokenizer.push_to_hub(args.push_to_hub)
        if evon is not None:
            posterior.push_to_hub(args.push_to_hub, model_card_kwargs=card)
        accelerator.print(f"pushed to {args.push_to_hub}")


def is_posterior_card(text: str) -> bool:
    """Whether a README is an earlier run's posterior card: this script's README is the posterior's."""
    return SECTION_START in text


def remove_posterior_from_hub(repo_id: str) -> None:
    """Delete an earlier push's posterior files and card from ``repo_id``, in one commit (nothing
    where the repo or the files do not exist): the posterior of this run, if it has one, is
    pushed after the model; without one, the repo must not offer the old posterior beside the
    new weights. The card is read before it is deleted: offline, this raises rather than delete
    a card unseen."""
    api = HfApi()
    names = (POSTERIOR_WEIGHTS_NAME, POSTERIOR_CONFIG_NAME)
    stale = [name for name in names if api.file_exists(repo_id, name)]
    with tempfile.TemporaryDirectory(prefix="pretrain_lm_card_") as tmp:
        try:
            card = api.hf_hub_download(repo_id, "README.md", cache_dir=tmp)
            with open(card, encoding="utf-8", errors="replace") as fh:
                if is_posterior_card(fh.read()):
                    stale.append("README.md")
        except (RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
            pass
    if stale:
        api.create_commit(
            repo_id,
            [CommitOperationDelete(path_in_repo=name) for name in stale],
            commit_message="Remove the EVON posterior and card of an earlier push",
        )


if __name__ == "__main__":
    main()
