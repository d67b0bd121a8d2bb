"""The ``hf-evon`` command line.

Subcommands are registered in ``SUBCOMMANDS``: each entry is a function that adds its own
subparser (``add_parser(subparsers)``) and sets ``func`` (called with the parsed args,
returns an exit code). Add a subcommand by appending such a function.

``hf-evon generate --model DIR --prompt "def f(" --samples 8 --max-new-tokens 32``
    decodes with Bayesian model averaging (``hf_evon.generate_bma``) from a saved model
    (a transformers causal LM or a PEFT adapter directory) and its EVON posterior
    (``evon_posterior.safetensors`` + config, by default in the same directory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(tok) for tok in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids wants integers separated by spaces or commas; got {text!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _add_generate(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate",
        help="decode with Bayesian model averaging over posterior samples",
        description="Generate text with the BMA predictive of a saved model + EVON posterior: at every step "
        "the next-token probabilities of S weight samples are averaged.",
    )
    p.add_argument(
        "--model", required=True, help="model directory (or Hub id); a PEFT adapter directory works too"
    )
    p.add_argument("--posterior", help="posterior directory or Hub id (default: --model)")
    p.add_argument("--posterior-subfolder", default=None, help="subfolder of --posterior holding the files")
    p.add_argument("--revision", default=None, help="Hub revision for --model/--posterior")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    prompts.add_argument(
        "--prompt-ids", action="append", type=_parse_ids, help='token ids, e.g. "5 9 17" (repeat for a batch)'
    )
    p.add_argument("--samples", type=int, default=8, help="S, posterior samples averaged (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="seeds the weight draw and token sampling (default 0)")
    p.add_argument("--do-sample", action="store_true", help="sample tokens instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=_run_generate)


SUBCOMMANDS: list[Callable[[Any], None]] = [_add_generate]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-evon", description="EVON posteriors for Hugging Face models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hf-evon``; returns the exit code (also when called from Python)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, ValueError, NotImplementedError, OSError) as err:
        print(f"hf-evon {args.command}: error: {err}", file=sys.stderr)
        return 1


# --------------------------------------------------------------------- generate
def _torch_dtype(name: str) -> Any:
    import torch

    return None if name == "auto" else getattr(torch, name)


def _load_model(path: str, revision: str | None, dtype: Any) -> Any:
    kwargs: dict[str, Any] = {"revision": revision}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        from peft import AutoPeftModelForCausalLM

        return AutoPeftModelForCausalLM.from_pretrained(path, **kwargs)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
)


def _load_tokenizer(path: str, revision: str | None, model: Any) -> Any:
    """The model's tokenizer, or None. A local directory needs tokenizer files: transformers
    would otherwise build an empty tokenizer from the model config alone."""
    from transformers import AutoTokenizer

    candidates = [path]
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        base = getattr(next(iter(peft_config.values())), "base_model_name_or_path", None)
        if base:
            candidates.append(base)
    for candidate in candidates:
        if os.path.isdir(candidate) and not any(
            os.path.isfile(os.path.join(candidate, f)) for f in _TOKENIZER_FILES
        ):
            continue
        try:
            tokenizer = AutoTokenizer.from_pretrained(candidate, revision=revision)
        except (OSError, ValueError):
            continue
        if len(tokenizer) > 1:
            return tokenizer
    return None


def _run_generate(args: argparse.Namespace) -> int:
    import torch

    from .generation import generate_bma
    from .posterior import EVONPosterior

    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1; got {args.samples}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = _load_model(args.model, args.revision, _torch_dtype(args.dtype)).to(device).eval()
    posterior = EVONPosterior.from_pretrained(
        args.posterior or args.model,
        revision=args.revision,
        subfolder=args.posterior_subfolder,
        device=device,
    )
    tokenizer = _load_tokenizer(args.model, args.revision, model)

    pad_id = None
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"no tokenizer found for {args.model!r}: pass token ids with --prompt-ids")
        tokenizer.padding_side = "left"  # decoder-only batches are left-padded
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        enc = tokenizer(args.prompt, return_tensors="pt", padding=True)
        input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]
        pad_id = tokenizer.pad_token_id
    else:
        width = max(map(len, args.prompt_ids))
        pad_id = getattr(model.config, "pad_token_id", None)
        if pad_id is None:
            pad_id = getattr(model.config, "eos_token_id", None)
        if isinstance(pad_id, list):
            pad_id = pad_id[0]
        pad_id = 0 if pad_id is None else int(pad_id)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in args.prompt_ids])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in args.prompt_ids])

    gen_kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    for key in ("temperature", "top_k", "top_p", "repetition_penalty"):
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
        **gen_kwargs,
    )
    start = input_ids.shape[1]
    for row in range(sequences.shape[0]):
        new_ids = sequences[row, start:].tolist()
        prompt_ids = input_ids[row][attention_mask[row].bool()].tolist()
        completion = None if tokenizer is None else tokenizer.decode(new_ids, skip_special_tokens=True)
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
            print(args.prompt[row] + completion if args.prompt is not None else completion)
        else:
            print(" ".join(map(str, prompt_ids + new_ids)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
