"""Decoding speed of BMA: plain ``generate`` vs a naive per-sample loop vs ``generate_bma``.

GPU (the issue's setting): GPT-2 small config (124M, random init), greedy decoding::

    python benchmarks/generate_bma.py --device cuda --dtype bfloat16

CPU (a smaller model and fewer tokens so it finishes in minutes)::

    python benchmarks/generate_bma.py --device cpu --small --new-tokens 16

``--arch t5``: an encoder-decoder instead (T5-small's config, or with ``--small`` 4+4 layers,
256 wide, 8192 tokens), whose prompt is the encoder's input: every sample runs its own encoder once,
then the decoding steps are batched as for GPT-2.

Methods, all greedy, exactly ``--new-tokens`` tokens per prompt:

- ``plain``: ``model.generate`` at the posterior mean (one model, no BMA).
- ``naive``: S sampled deep copies of the model, each with its own KV cache, run one after
  another at every step; their probabilities are averaged per token (what BMA costs
  without batching). Its time includes making the S sampled copies (the same draw), as a
  user of this approach pays it on every call with fresh samples; ``copies ms`` shows it.
- ``bma``: ``hf_evon.generate_bma`` (one forward of batch S·B per step), including its
  draw of the S samples (``draw ms`` alone).

``--num-beams K``: beam search for ``plain`` and ``bma`` (``model.generate``'s own, S·B·K rows a
step for ``bma``); the naive loop decodes greedily and is skipped.

``--strategy`` picks how ``generate_bma`` applies the samples (``auto``: per matrix, by FLOPs
on CPU; ``materialize`` on GPU; see ``hf_evon/predictive/batched_samples.py``). ``factored`` in the
table counts the matrices applied through their bases. Timings: one warm-up call per
configuration, ``torch.cuda.synchronize()`` around every timed call, the median of
``--repeats`` runs; tokens/s counts new tokens of the whole batch. ``bma/naive`` is the
speed-up of ``generate_bma`` over the naive loop (both with their draw); ``bma/plain lat``
the per-token latency ratio to plain ``generate``.

Measured on CPU (2 cores, ``--small --new-tokens 16``): S = 8, B = 1: naive 17.6 tok/s,
generate_bma 41.4 (2.36×, factored); S = 16, B = 1: 3.68×; B = 8: 1.4–1.5× (materialized). On a
CPU every sample costs its own arithmetic and weight reads, so batching saves the draw and the
per-call overhead only. On an H100 (2026-11-26, bf16, GPT-2 small config, 64 new tokens): S = 8,
B = 1: plain 170.7 tok/s, naive 23.4, generate_bma 132.5 (5.67× the loop, per-token latency 1.29×
plain); B = 8: 6.52×, 1.25× (benchmarks/results/gpu_h100/generate_bma.log). ``--arch t5 --small``
on CPU (2 threads, 16 new tokens): S = 8, B = 1: naive 10.0 tok/s, generate_bma 23.6 (2.35×).
Beam search (``--arch t5 --small --num-beams 4``, CPU): see docs/results.md.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import time
from collections.abc import Callable

import torch
from transformers import (
    DynamicCache,
    EncoderDecoderCache,
    GPT2Config,
    GPT2LMHeadModel,
    T5Config,
    T5ForConditionalGeneration,
)

import hf_evon.predictive.batched_samples as batched
from hf_evon import EVON, EVONPosterior, build_param_groups, generate_bma

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    if args.arch == "t5":
        tokens = dict(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # T5's, as its checkpoints set
        if args.small:
            config = T5Config(vocab_size=8192, d_model=256, d_kv=32, d_ff=1024, num_layers=4, num_heads=8, **tokens)
        else:
            config = T5Config(**tokens)  # T5-small: 6+6 layers, 512 wide, 32128 tokens
        return T5ForConditionalGeneration(config)
    if args.small:
        return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=512, vocab_size=8192))
    return GPT2LMHeadModel(GPT2Config())  # GPT-2 small: 12 layers, 768 wide, 50257 tokens


def build_posterior(model: torch.nn.Module, device: torch.device, steps: int = 3) -> EVONPosterior:
    """An EVON posterior over the block matrices: the init step plus ``steps`` updates."""
    groups = [g for g in build_param_groups(model) if g["algorithm"] == "evon"]
    opt = EVON(groups, lr=1e-4, ess=1e5, precondition_frequency=2, seed=0)
    vocab = model.config.vocab_size
    for _ in range(steps + 1):
        x = torch.randint(0, vocab, (2, 32), device=device)
        with opt.sampled_params(train=True):
            model(input_ids=x, labels=x).loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)
    return EVONPosterior.from_optimizer(opt, model)


def sampled_copies(model: torch.nn.Module, posterior: EVONPosterior, num_samples: int, seed: int) -> list:
    """S deep copies with the weights ``M + ΔW_s`` of the same draw ``generate_bma`` uses."""
    draws = posterior.draw(num_samples, seed=seed, device=next(model.parameters()).device)
    copies = []
    for s in range(num_samples):
        m = copy.deepcopy(model)
        params = dict(m.named_parameters())
        with torch.no_grad():
            for name, delta in draws.items():
                p = params[name]
                p.copy_((p.to(delta.dtype) + delta[s]).to(p.dtype))
        copies.append(m)
    return copies


@torch.no_grad()
def naive_generate(models: list, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """S models one after another per token, each with its own cache; probabilities averaged.
    An encoder-decoder runs each model's encoder once and decodes from its start token."""
    config = models[0].config
    if config.is_encoder_decoder:
        encoded = [m.get_encoder()(input_ids=input_ids) for m in models]
        caches = [EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config)) for _ in models]
        step_ids = torch.full((len(input_ids), 1), config.decoder_start_token_id, device=input_ids.device)
    else:
        encoded = [None] * len(models)
        caches = [DynamicCache(config=config) for _ in models]
        step_ids = input_ids
    out = step_ids
    # transformers from 5.24 takes the cache as ``cache`` (``past_key_values`` is deprecated there)
    keyword = "cache" if "cache" in inspect.signature(models[0].forward).parameters else "past_key_values"
    for _ in range(new_tokens):
        log_probs = []
        for m, cache, enc in zip(models, caches, encoded):
            if enc is None:
                logits = m(input_ids=step_ids, **{keyword: cache}, use_cache=True, logits_to_keep=1).logits
            else:
                logits = m(encoder_outputs=enc, decoder_input_ids=step_ids, **{keyword: cache}, use_cache=True).logits
            log_probs.append(torch.log_softmax(logits[:, -1].float(), dim=-1))
        mean = torch.logsumexp(torch.stack(log_probs), dim=0)
        step_ids = mean.argmax(-1, keepdim=True)
        out = torch.cat([out, step_ids], dim=-1)
    return out


def draw_only(
    model: torch.nn.Module, posterior: EVONPosterior, num_samples: int, ids: torch.Tensor, new: int, strategy: str
) -> int:
    """What ``generate_bma(..., strategy=strategy)`` does before decoding; returns how many matrices it factors."""
    rows = batched.expected_rows(*ids.shape, new)
    with batched.BatchedSamples(
        model, posterior, num_samples, seed=0, strategy=strategy, rows=rows, batch_size=len(ids)
    ) as sampler:
        return len(sampler.factored)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    fn()  # warm-up (allocator, kernels, lazy init)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arch", default="gpt2", choices=["gpt2", "t5"], help="a causal LM or an encoder-decoder")
    parser.add_argument("--small", action="store_true", help="4 layers (t5: 4+4), 256 wide, 8192 tokens")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-naive", action="store_true", help="skip the naive loop (it is slow)")
    parser.add_argument(
        "--num-beams", type=int, default=1, help="beam search with K beams for plain and bma (no naive loop)"
    )
    parser.add_argument(
        "--strategy",
        default="auto",
        choices=batched.STRATEGIES,
        help="per-sample weights x@(M+ΔW_s) (materialize), x@M + ((x@Q_in)@E_s)@Q_outᵀ (factored), or auto",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = build_model(args).to(device)
    posterior = build_posterior(model, device)
    model = model.to(dtype).eval()
    vocab = model.config.vocab_size
    gen_kwargs = dict(
        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
        num_beams=args.num_beams,
    )  # fmt: skip
    n_params = sum(p.numel() for p in model.parameters())
    covered = sum(dict(model.named_parameters())[n].numel() for n in posterior.names)
    print(
        f"arch={args.arch} device={device} dtype={args.dtype} params={n_params / 1e6:.1f}M covered={covered / 1e6:.1f}M "
        f"prompt={args.prompt_len} new_tokens={args.new_tokens} strategy={args.strategy} "
        f"threads={torch.get_num_threads()} beams={args.num_beams}"
    )
    header = (
        f"{'S':>3} {'B':>3} | {'plain tok/s':>11} {'naive tok/s':>11} {'bma tok/s':>10} | "
        f"{'bma/naive':>9} {'bma ms/tok':>10} {'plain ms/tok':>12} {'bma/plain lat':>13} | {'draw ms':>8} "
        f"{'copies ms':>9} {'factored':>8}"
    )
    print(header)
    print("-" * len(header))
    for batch in args.batch_sizes:
        ids = torch.randint(0, vocab, (batch, args.prompt_len), device=device)
        t_plain = timed(lambda ids=ids: model.generate(ids, **gen_kwargs), device, args.repeats)
        for s in args.samples:
            t_bma = timed(
                lambda ids=ids, s=s: generate_bma(
                    model, posterior, ids, num_samples=s, seed=0, strategy=args.strategy, **gen_kwargs
                ),
                device,
                args.repeats,
            )
            t_draw = timed(
                lambda s=s, ids=ids: draw_only(model, posterior, s, ids, args.new_tokens, args.strategy),
                device,
                args.repeats,
            )
            factored = draw_only(model, posterior, s, ids, args.new_tokens, args.strategy)
            t_naive = t_copies = float("nan")
            if not args.no_naive and args.num_beams == 1:  # the loop decodes greedily
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()  # built once: the copies the loop then runs on
                copies = sampled_copies(model, posterior, s, seed=0)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t_copies = time.perf_counter() - start
                t_naive = t_copies + timed(
                    lambda ids=ids, c=copies: naive_generate(c, ids, args.new_tokens), device, args.repeats
                )
                del copies
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            tokens = batch * args.new_tokens
            print(
                f"{s:>3} {batch:>3} | {tokens / t_plain:>11.1f} {tokens / t_naive:>11.1f} {tokens / t_bma:>10.1f} | "
                f"{t_naive / t_bma:>9.2f} {1e3 * t_bma / args.new_tokens:>10.2f} "
                f"{1e3 * t_plain / args.new_tokens:>12.2f} {t_bma / t_plain:>13.2f} | {1e3 * t_draw:>8.1f} "
                f"{1e3 * t_copies:>9.1f} {factored:>4}/{len(posterior.names):<3}",
                flush=True,
            )


if __name__ == "__main__":
    main()
