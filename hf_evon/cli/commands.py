"""The ``hf-evon`` command line: ``generate`` (BMA decoding), ``inspect`` (a saved posterior),
``calibrate`` (the posterior's sampling scale on held-out text); ``hf-evon COMMAND -h`` tells more.

Subcommands are registered in ``SUBCOMMANDS``: each entry is *one* function that adds its subparser
(:func:`_subcommand`: the name and the function run with the parsed args, which returns an exit
code and whose docstring is the command's help) and declares its options, each with help.

Errors never show a traceback. A command line that asks for something impossible (an empty prompt,
an unknown device, a missing local directory, ...) raises :class:`UsageError`, reported as argparse
reports a bad option (usage line, ``hf-evon COMMAND: error: ...``, exit code 2); other failures (a
file that does not load, the Hub unreachable) print ``hf-evon COMMAND: error: ...``, exit code 1.

A location (``--model``, ``--posterior``, ``inspect``'s argument) is a local directory when it
exists or looks like a path (``./x``, ``/x``, ``~/x``, ``a/b/c``); otherwise a Hub repo id
(``name`` or ``namespace/name``), looked up on the Hub. torch, transformers and the rest of hf_evon
are imported inside the commands, so that ``hf-evon -h`` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import select
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from inspect import cleandoc
from typing import Any

from hf_evon.cli.loading import (
    UsageError,
    check_prompts,
    failure_text,
    file_error_text,
    file_errors,
    from_location,
    load_model_posterior_tokenizer,
    read_text,
    resolve_device,
    text_tokens,
    torch_dtype,
)
from hf_evon.cli.output import check_output, check_output_posterior, check_posterior_weights
from hf_evon.cli.text import (
    CALIBRATION_KEY,
    calibration_text,
    completion_text,
    number_text,
    printable,
    size_text,
)
from hf_evon.fileio import Listed, listed_kind, no_file_text

DTYPES = ("auto", "float32", "bfloat16", "float16")
# Weight files of a model or adapter saved beside a posterior (sizes shown by `inspect`).
MODEL_WEIGHT_FILE = re.compile(r"(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)")


def _int_at_least(low: int, high: int = 2**63 - 1) -> Callable[[str], int]:
    def parse(text: str) -> int:
        with contextlib.suppress(ValueError):
            if low <= (value := int(text)) <= high:
                return value
            if value > high:  # torch takes sizes as 64-bit integers: a larger one fails deep inside it
                raise argparse.ArgumentTypeError(f"wants an integer from {low} to {high}; got {text!r}")
        raise argparse.ArgumentTypeError(f"wants an integer >= {low}; got {text!r}")

    return parse


_positive_int = _int_at_least(1)


def _number(rule: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        with contextlib.suppress(ValueError):
            if math.isfinite(value := float(text)) and ok(value):
                return value
        raise argparse.ArgumentTypeError(f"wants {rule}; got {text!r}")

    return parse


_non_negative_float = _number("a finite number >= 0", lambda x: x >= 0.0)
_fraction = _number("a fraction in [0, 1)", lambda x: 0.0 <= x < 1.0)
_positive_float = _number("a finite number > 0", lambda x: x > 0.0)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(tok) for tok in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids wants integers separated by spaces or commas; got {text!r}"
        ) from None
    if not ids or abs(big := max(ids, key=abs)) >= 2**63:  # torch's token ids are 64-bit integers
        raise argparse.ArgumentTypeError("--prompt-ids is empty" if not ids else f"token id {big} is no 64-bit integer")
    return ids


def _subcommand(
    subparsers: Any, name: str, run: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """The subparser of ``name``: ``run``'s docstring is its help (the first paragraph) and description
    (the rest); ``run(args)`` carries it out (``main`` reports its errors with this parser's usage)."""
    help, _, description = cleandoc(run.__doc__ or "").partition("\n\n")
    p = subparsers.add_parser(name, help=help, description=description)
    p.set_defaults(func=run, parser=p)
    return p


def _add_location_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit) of Hub locations")


def _add_model_posterior_options(p: argparse.ArgumentParser, model_help: str) -> None:
    """``--model``, ``--posterior``, ``--posterior-subfolder`` and ``--revision``."""
    p.add_argument("--model", required=True, help=model_help)
    p.add_argument("--posterior", help="posterior directory or Hub repo id (default: --model)")
    p.add_argument("--posterior-subfolder", default=None, help="subfolder of --posterior holding the files")
    _add_location_options(p)


def _version_text() -> str:
    from hf_evon import __version__

    deps = []
    for dist in ("torch", "transformers", "peft"):
        try:
            deps.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            deps.append(f"{dist} not installed")
    return f"hf-evon {__version__} ({', '.join(deps)})"


# --------------------------------------------------------------------- generate
def _add_generate(subparsers: Any) -> None:
    p = _subcommand(subparsers, "generate", _run_generate)
    _add_model_posterior_options(
        p,
        "local model directory or Hub repo id (a transformers causal LM or encoder-decoder model, or a PEFT "
        "adapter directory of one)",
    )
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    prompts.add_argument(
        "--prompt-ids", action="append", type=_parse_ids, help='token ids, e.g. "5 9 17" (repeat for a batch)'
    )
    p.add_argument(
        "--samples", type=_positive_int, default=8, help="S, posterior samples averaged (default 8)"
    )
    p.add_argument(
        "--max-new-tokens", type=_positive_int, default=32, help="tokens to generate per prompt (default 32)"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the weight draw and token sampling (default 0)")
    p.add_argument("--do-sample", action="store_true", help="sample tokens instead of greedy decoding")
    p.add_argument("--temperature", type=_positive_float, default=None, help="softmax temperature (with --do-sample)")
    p.add_argument(
        "--top-k", type=_int_at_least(0), default=None, help="keep the k most probable tokens (with --do-sample)"
    )
    p.add_argument(
        "--top-p", type=_number("a number in (0, 1]", lambda x: 0.0 < x <= 1.0), default=None,
        help="nucleus sampling: keep tokens of cumulative probability p (with --do-sample)",
    )  # fmt: skip
    p.add_argument(
        "--repetition-penalty", type=_positive_float, default=None, help="penalise repeated tokens (1.0: no penalty)"
    )
    p.add_argument(
        "--num-beams", type=_positive_int, default=None,
        help="beam search over the averaged probabilities (default: the model's generation config)",
    )  # fmt: skip
    p.add_argument(  # SampleStrategy's values: importing hf_evon.predictive here would load torch
        "--strategy", default="auto", choices=("auto", "materialize", "factored"),
        help="per-sample weights (materialize: a per-sample loop's tokens, also in bfloat16), the factored "
        "form, or auto: per matrix by cost on CPU, materialize on accelerators (default)",
    )  # fmt: skip
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps, ... (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="model weight dtype (default: as saved)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def _run_generate(args: argparse.Namespace) -> int:
    """decode with Bayesian model averaging over posterior samples

    Generate text with the BMA predictive of a saved model + EVON posterior: at every step the
    next-token probabilities of S weight samples are averaged.
    """
    import torch

    from hf_evon.modeling import is_encoder_decoder
    from hf_evon.predictive.generation import generate_bma

    # greedy decoding and beam search read none of these (transformers would only warn, and drop them)
    if not args.do_sample and (given := [f"--{k.replace('_', '-')}" for k in ("temperature", "top_k", "top_p")
                                         if getattr(args, k) is not None]):  # fmt: skip
        raise UsageError(f"{given[0]} applies to sampling only: add --do-sample, or leave it out")
    device = resolve_device(args.device)
    model, posterior, tokenizer = load_model_posterior_tokenizer(args, device, torch_dtype(args.dtype))
    source = f"--posterior {args.posterior!r}" if args.posterior else f"--model {args.model!r}"
    check_posterior_weights(posterior, model, source, "its samples would be drawn around weights it was not taken at")
    encoder_decoder = is_encoder_decoder(model)

    pad_candidates: list[Any] = []
    if args.prompt is not None:
        if tokenizer is None:
            raise UsageError(
                f"--model {args.model!r} has no tokenizer files: pass token ids with --prompt-ids"
            )
        # one prompt at a time, padded here: a tokenizer without a pad token cannot pad a batch
        prompt_ids = [tokenizer(p)["input_ids"] for p in args.prompt]
        pad_candidates = [tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id]
    else:
        prompt_ids = args.prompt_ids
    eos = getattr(model.config, "eos_token_id", None)
    pad_candidates += [getattr(model.config, "pad_token_id", None), *(eos if isinstance(eos, list) else [eos])]
    try:
        vocab = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        vocab = None
    # the padding is masked: any id in the embedding does, and an id outside it (a tokenizer's added
    # pad token, GPT-2's eos 50256 on a smaller vocabulary) would fail the forward
    in_vocab = (int(t) for t in pad_candidates if isinstance(t, int) and 0 <= t < (vocab or math.inf))
    pad_id = next(in_vocab, 0)
    width = max(map(len, prompt_ids))

    def padded(row: list[int], fill: int) -> list[int]:  # decoder-only batches are left-padded; encoders take either
        pad = [fill] * (width - len(row))
        return row + pad if encoder_decoder else pad + row

    input_ids = torch.tensor([padded(p, pad_id) for p in prompt_ids], dtype=torch.long)
    attention_mask = torch.tensor([padded([1] * len(p), 0) for p in prompt_ids], dtype=torch.long)
    check_prompts(input_ids, attention_mask, model, args, encoder_decoder)

    gen_kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    for key in ("temperature", "top_k", "top_p", "repetition_penalty", "num_beams"):
        if getattr(args, key) is not None:
            gen_kwargs[key] = getattr(args, key)
    if pad_id is not None:
        gen_kwargs["pad_token_id"] = pad_id
    sequences = generate_bma(
        model,
        posterior,
        input_ids.to(device),
        attention_mask=attention_mask.to(device),
        num_samples=args.samples,
        seed=args.seed,
        strategy=args.strategy,
        **gen_kwargs,
    )
    # a causal LM continues its prompt; an encoder-decoder's output starts at its decoder start token
    start = 1 if encoder_decoder else input_ids.shape[1]
    for row in range(sequences.shape[0]):
        new_ids = sequences[row, start:].tolist()
        prompt_ids = input_ids[row][attention_mask[row].bool()].tolist()
        completion = None if tokenizer is None else completion_text(tokenizer, [] if encoder_decoder else prompt_ids, new_ids)
        if args.json:
            record = {
                "prompt": args.prompt[row] if args.prompt is not None else prompt_ids,
                "completion": completion,
                "completion_ids": new_ids,
                "samples": args.samples,
                "seed": args.seed,
            }
            print(json.dumps(record))
        elif completion is not None:
            continued = args.prompt is not None and not encoder_decoder
            print(args.prompt[row] + completion if continued else completion)
        else:
            print(" ".join(map(str, new_ids if encoder_decoder else prompt_ids + new_ids)))
    return 0


# --------------------------------------------------------------------- inspect
def _add_inspect(subparsers: Any) -> None:
    p = _subcommand(subparsers, "inspect", _run_inspect)
    p.add_argument("location", help="posterior directory or Hub repo id")
    p.add_argument("--subfolder", default=None, help="subfolder of the location holding the posterior files")
    _add_location_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _file_sizes(args: argparse.Namespace, posterior: Any) -> dict[str, int]:
    """Bytes of the posterior files and, for a local directory, of the model weights beside them.

    The posterior files are those the load read (``loaded_files``; after a killed save, the staged
    weights file its config names); from the Hub, in the cache's snapshot of the commit read, which
    neither a later push nor another process downloading it changes. A file removed meanwhile (by a
    save, or evicted from the cache) is left out.
    """
    files = list((posterior.loaded_files or {}).values())
    if os.path.isdir(args.location):
        directory = os.path.join(args.location, args.subfolder) if args.subfolder else args.location
        files += [os.path.join(directory, f) for f in sorted(os.listdir(directory)) if MODEL_WEIGHT_FILE.fullmatch(f)]
    sizes = {}
    for path in files:  # (a dangling link, or a file a save removed meanwhile: left out)
        with contextlib.suppress(FileNotFoundError):
            sizes[os.path.basename(path)] = os.path.getsize(path)
    return sizes


def inspect_posterior(posterior: Any) -> dict[str, Any]:
    """Summary of ``posterior`` (what ``hf-evon inspect`` prints): hyperparameters, coverage,
    per-tensor std statistics, and the calibrated scale recorded in its config (or None)."""
    import torch

    from hf_evon.posterior.model_card import hand_set_scale_text

    config, scales = posterior.config, {n: f.ess for n, f in posterior.factors.items()}
    tensors = {}
    for name in posterior.names:
        std = posterior.std(name).double().flatten()
        f = posterior[name]
        tensors[name] = {
            "shape": list(f.shape),
            "bases": "".join(s for s, q in (("L", f.Q_L), ("R", f.Q_R)) if q is not None) or "none",
            "std_min": float(std.min()),
            "std_median": float(torch.median(std)),
            "std_mean": float(std.mean()),
            "std_max": float(std.max()),
        }
    return {
        "format_version": config.get("format_version"),
        "library_version": config.get("library_version"),
        "ess": posterior.ess,
        "temperature": posterior.temperature,
        "weight_decay": posterior.weight_decay,
        "optimizer_step": config.get("optimizer_step"),
        "base_model": config.get("base_model"),
        "model_class": config.get("model_class"),
        "eigenbasis_dtype": config.get("eigenbasis_dtype"),
        "calibration": config.get(CALIBRATION_KEY),
        "trained_ess": config.get("trained_ess"),  # kept by a calibration and by with_ess/scale_ess
        "scale_set_by_hand": bool(hand_set_scale_text(config, scales)),  # with_ess/scale_ess, as the card says
        "num_covered_tensors": len(posterior.names),
        "num_covered_params": posterior.num_covered,
        "num_point_estimate_tensors": posterior.num_point_estimate_tensors,
        "num_point_estimates": posterior.num_point_estimates,
        "tensors": tensors,
    }


def _run_inspect(args: argparse.Namespace) -> int:
    """summarise a saved EVON posterior (covered tensors, std statistics, file sizes)

    Print what a posterior checkpoint holds, without loading a model: the covered tensors,
    statistics of the marginal posterior standard deviations per tensor, the file sizes (and
    those of the model weights saved beside it), and the calibrated scale if the config records one.
    """
    from hf_evon.posterior.config import json_value
    from hf_evon.posterior.hub import subfolder_in_repo
    from hf_evon.posterior.posterior import EVONPosterior

    args.subfolder = subfolder_in_repo(args.subfolder)  # as from_pretrained takes it: header and sizes agree
    posterior = from_location(
        args.location,
        "location",
        lambda: EVONPosterior.from_pretrained(
            args.location, revision=args.revision, subfolder=args.subfolder
        ),
        ("--subfolder", args.subfolder),
    )
    summary = inspect_posterior(posterior)
    summary["files"] = _file_sizes(args, posterior)
    if args.json:
        print(json.dumps(json_value(summary), indent=2, allow_nan=False))  # inf as "inf", as in the config
        return 0
    points = (
        "not recorded"
        if summary["num_point_estimates"] is None
        else f"{summary['num_point_estimate_tensors']} tensors, {summary['num_point_estimates']:,} parameters"
    )
    lines = [
        f"EVON posterior at {args.location}" + (f"/{args.subfolder}" if args.subfolder else "")
        + (f", revision {args.revision}" if args.revision else ""),
        f"  format {summary['format_version']}, written by hf-evon {summary['library_version']}; "
        f"model {summary['model_class']} (base {summary['base_model']})",
        f"  ess {number_text(summary['ess'])}, BMA temperature {number_text(summary['temperature'])}, "
        f"weight_decay {number_text(summary['weight_decay'])}, "
        f"EVON updates {summary['optimizer_step']}, eigenbases stored in {summary['eigenbasis_dtype']}",
        f"  calibration: {calibration_text(posterior.config, {n: f.ess for n, f in posterior.factors.items()})}",
        f"  covered: {summary['num_covered_tensors']} tensors, {summary['num_covered_params']:,} parameters; "
        f"point estimates: {points}",
        "  files: " + ", ".join(f"{f} {size_text(n)}" for f, n in summary["files"].items()),
        "",
        "posterior std (marginal, per element)",
    ]
    width = max(len(n) for n in summary["tensors"])
    lines.append(
        f"  {'tensor':<{width}}  {'shape':<12} bases {'min':>10} {'median':>10} {'mean':>10} {'max':>10}"
    )
    for name, t in summary["tensors"].items():
        shape = "x".join(map(str, t["shape"]))
        stats = " ".join(f"{t[k]:>10.3g}" for k in ("std_min", "std_median", "std_mean", "std_max"))
        lines.append(f"  {name:<{width}}  {shape:<12} {t['bases']:<5} {stats}")
    print("\n".join(map(printable, lines)))  # the config's strings come from anyone
    return 0


# --------------------------------------------------------------------- calibrate
def _add_calibrate(subparsers: Any) -> None:
    p = _subcommand(subparsers, "calibrate", _run_calibrate)
    _add_model_posterior_options(p, "local model directory or Hub repo id (a transformers causal LM)")
    p.add_argument("--text", required=True, help="held-out text file (UTF-8)")
    p.add_argument(
        "--output", required=True, help="directory to save the calibrated posterior to (not another model's)"
    )
    p.add_argument(  # a block of one token has no target to score
        "--block-size", type=_int_at_least(2), default=128, help="tokens per block (default 128; at most the model's context)"
    )
    p.add_argument("--max-blocks", type=_positive_int, default=64, help="blocks used at most (default 64)")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="blocks per forward pass (default 8)")
    p.add_argument(
        "--samples", type=_positive_int, default=8, help="S, posterior samples per scale (default 8)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weight draws (default 0)")
    p.add_argument(
        "--standard-errors", type=_non_negative_float, default=None, metavar="K",
        help="walking from the mean towards more noise, a scale replaces the choice so far only if its NLL is "
        "lower by more than K standard errors of the difference, over tokens and draws (default: "
        "hf_evon.predictive.calibration.DEFAULT_STANDARD_ERRORS, 0.5; 0: the lowest NLL)",
    )  # fmt: skip
    p.add_argument(
        "--min-gain", type=_fraction, default=None, metavar="G",
        help="the chosen scale's NLL must be at least the fraction G below the mean's, else the posterior as "
        "trained or the mean (default: hf_evon.predictive.calibration.DEFAULT_MIN_GAIN, 0.01)",
    )  # fmt: skip
    p.add_argument(
        "--no-temperature", action="store_true",
        help="score every scale at softmax temperature 1 instead of at its own best temperature "
        "(each temperature costs a log-sum-exp over the vocabulary per token and pass)",
    )  # fmt: skip
    p.add_argument(
        "--always-scan", action="store_true",
        help="score the sampling scales even where the mean is not overconfident on the data "
        "(by default only the trained scale is then scored against the mean)",
    )  # fmt: skip
    p.add_argument(
        "--no-keep-trained", dest="keep_trained", action="store_false",
        help="where no scale beats the mean, keep the mean (by default the trained posterior is kept unless "
        "the mean predicts better by more than K standard errors or G)",
    )  # fmt: skip
    p.add_argument(
        "--screen-factor", type=_non_negative_float, default=None, metavar="F",
        help="score a scale with all its samples only from the first whose first sample moves the "
        "log-likelihoods by F x the minimum gain of the mean's NLL, found by bisection (a few one-sample "
        "passes); quieter scales are screened out (default: hf_evon.predictive.calibration.SCREEN_FACTOR, 2.5; "
        "0: score every scale)",
    )  # fmt: skip
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps, ... (default: cuda if available)")
    p.add_argument("--json", action="store_true", help="print the calibration as JSON")


def _run_calibrate(args: argparse.Namespace) -> int:
    """choose the posterior's sampling scale by BMA NLL on a held-out text file

    Post-hoc calibration of a causal LM's posterior (hf_evon.calibrate_posterior): the text is
    cut into blocks, the BMA NLL is measured on a grid of multiples of the trained ess (and at
    the mean), and the chosen scale (--standard-errors, --min-gain) is saved as the posterior's
    ess and temperature, with the search in its config. Use text the model was not trained on, and other text
    than you report on.
    """
    from hf_evon.modeling import is_encoder_decoder
    from hf_evon.posterior.config import json_value
    from hf_evon.predictive.calibration import calibrate_posterior

    # one this user cannot look up raises the OSError naming it, and a link that reaches nothing says so
    if (kind := listed_kind(args.text)) is None:
        raise UsageError(f"--text {args.text!r} is not a file")
    if kind is not Listed.FILE:  # a named pipe too: the text is read several times
        raise UsageError(f"--text {args.text!r} is {no_file_text(args.text, kind)}")
    read_text(args.text, "--text")  # its start before the model loads: a file in another encoding fails at once
    check_output(args.output)  # checked before the passes, not at the save after them
    device = resolve_device(args.device)
    model, posterior, tokenizer = load_model_posterior_tokenizer(args, device, None)
    check_output_posterior(args.output, model)
    check_posterior_weights(posterior, model, f"--posterior {args.posterior!r}" if args.posterior else f"--model {args.model!r}")
    if is_encoder_decoder(model):
        raise UsageError(
            f"--model {args.model!r} is an encoder-decoder model: calibrate scores --text as a causal LM's "
            "continuations; calibrate it on (input, target) pairs with hf_evon.calibrate_posterior"
        )
    if tokenizer is None:
        raise UsageError(f"--model {args.model!r} has no tokenizer files: calibrate needs one to read --text")
    context = getattr(model.config, "max_position_embeddings", None)  # None or absent: no bound (e.g. Mamba's)
    block = min(args.block_size, context) if isinstance(context, int) and context > 0 else args.block_size
    if block < args.block_size:  # said, not silent: the NLLs are of shorter blocks than asked for
        print(f"{args.parser.prog}: --block-size {args.block_size} is above the model's context: blocks of {block}", file=sys.stderr)
    ids = text_tokens(args.text, "--text", tokenizer, block * args.max_blocks)  # what the blocks use
    n = min(len(ids) // block, args.max_blocks)
    if n == 0:
        raise UsageError(f"--text {args.text!r} holds {len(ids)} tokens: fewer than one block of {block}")
    rows = ids[: n * block].view(n, block).to(device)
    batches = [
        {"input_ids": rows[i : i + args.batch_size], "labels": rows[i : i + args.batch_size]}
        for i in range(0, n, args.batch_size)
    ]
    calibrated, result = calibrate_posterior(
        model, posterior, batches, num_samples=args.samples, seed=args.seed, shift_labels=True,
        standard_errors=args.standard_errors, min_gain=args.min_gain, temperature=not args.no_temperature,
        always_scan=args.always_scan, screen_factor=args.screen_factor, keep_trained=args.keep_trained,
    )  # fmt: skip
    try:
        calibrated.save_pretrained(args.output)
    except (OSError, *file_errors()) as err:  # e.g. a full disk
        text = str(err) if isinstance(err, OSError) else file_error_text(err)
        raise ValueError(f"--output {args.output!r}: cannot save the calibrated posterior ({text})") from err
    if args.json:
        print(json.dumps(json_value(result.to_json()), allow_nan=False))
    else:
        print(
            f"calibrated ess {result.ess:.4g} = {result.multiplier:.3g} x the trained {result.trained_ess:.4g}, "
            f"temperature {result.temperature:.3g}: "
            f"BMA NLL {result.chosen_nll:.4f} vs {result.mean_nll:.4f} at the mean on {result.num_targets} tokens "
            f"(the mean's own temperature there: {result.mean_temperature:.3g}); saved to {args.output}"
        )
    return 0


# --------------------------------------------------------------------- entry point
SUBCOMMANDS: list[Callable[[Any], None]] = [_add_generate, _add_inspect, _add_calibrate]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-evon", description="EVON posteriors for Hugging Face models.")
    parser.add_argument(
        "--version", action="version", version=_version_text(), help="print versions and exit"
    )
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", help="run `hf-evon COMMAND -h` for its options"
    )
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def _stdout_reader_left() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports an error on it)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no poll(), no file descriptor
        (poller := select.poll()).register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hf-evon``; returns the exit code (also when called from Python)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    if sys.stdout is None:  # started with its standard output closed (`>&-`): print() writes nowhere, silently
        print(f"{args.parser.prog}: error: standard output is closed: there is nowhere to write the result", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        args.parser.print_usage(sys.stderr)
        print(f"{args.parser.prog}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError as err:
        if not _stdout_reader_left():  # another pipe or socket broke: an error like any other
            print(f"{args.parser.prog}: error: {err}", file=sys.stderr)
            return 1
        with contextlib.suppress(OSError, ValueError):  # Python's flush at exit would fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, silently: the reader (`| head`) left with what it wanted
    except (ValueError, NotImplementedError, OSError) as err:
        print(f"{args.parser.prog}: error: {err}", file=sys.stderr)
        return 1
    except (*file_errors(), MemoryError, RuntimeError) as err:  # (NotImplementedError: reported above)
        if (text := failure_text(err)) is None:
            raise  # a bug keeps its traceback
        print(f"{args.parser.prog}: error: {text}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the shell's convention, no traceback; nothing was half-written
        print(f"{args.parser.prog}: interrupted", file=sys.stderr)
        return 130

