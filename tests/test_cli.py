"""``hf-evon generate``: a saved model + tokenizer + posterior decode as ``generate_bma`` does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

import hf_evon
from hf_evon import EVONPosterior, generate_bma
from hf_evon.cli import SUBCOMMANDS, build_parser, main

CHARS = "abcdefghijklmnopqrstuvwxyz ().:=_\n"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer built offline (no Hub, no training)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>"
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Directory with model, tokenizer and posterior, plus the in-memory originals."""
    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    vocab = len(tokenizer)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=1
        )
    )
    opt = hf_evon.build_optimizer(
        model,
        lr=1e-2,
        ess=1e4,
        precondition_frequency=2,
        seed=0,
        hess_init=0.1,
        betas=(0.9, 0.999),
        weight_decay=1e-4,
        hess_clip_ratio=None,
        clip="none",
        clip_radius=1.0,
        adamw_lr=None,
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randint(2, vocab, (4, 12), generator=gen)
        with opt.sampled_params(train=True):
            model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    posterior = EVONPosterior.from_optimizer(opt, model).with_ess(30.0)
    path = tmp_path_factory.mktemp("cli_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    posterior.save_pretrained(path)
    return path, model, tokenizer, posterior


def test_generate_matches_generate_bma(saved, capsys):
    path, model, tokenizer, posterior = saved
    prompts = ["def f(x):", "a = b"]
    code = main(
        [
            "generate",
            "--model",
            str(path),
            "--samples",
            "3",
            "--max-new-tokens",
            "6",
            "--seed",
            "4",
            "--json",
            "--device",
            "cpu",
        ]
        + [arg for p in prompts for arg in ("--prompt", p)]
    )
    assert code == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == prompts
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    expected = generate_bma(
        model,
        posterior,
        enc["input_ids"],
        attention_mask=enc["attention_mask"],
        num_samples=3,
        seed=4,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    for row, record in enumerate(records):
        new = expected[row, enc["input_ids"].shape[1] :].tolist()
        assert record["completion_ids"] == new
        assert record["completion"] == tokenizer.decode(new, skip_special_tokens=True)
        assert len(record["completion_ids"]) == 6


def test_generate_with_token_ids_and_separate_posterior_dir(saved, tmp_path, capsys):
    path, model, _, posterior = saved
    post_dir = tmp_path / "posterior"
    posterior.save_pretrained(post_dir)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)  # no tokenizer here
    code = main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--posterior",
            str(post_dir),
            "--prompt-ids",
            "5 9 17",
            "--samples",
            "2",
        ]
        + ["--max-new-tokens", "4", "--seed", "1", "--device", "cpu"]
    )
    assert code == 0
    printed = [int(t) for t in capsys.readouterr().out.split()]
    expected = generate_bma(
        model, posterior, torch.tensor([[5, 9, 17]]), num_samples=2, seed=1, max_new_tokens=4, pad_token_id=1
    )
    assert printed == expected[0].tolist()


def test_missing_posterior_is_a_clear_error(saved, tmp_path, capsys):
    path, model, _, _ = saved
    model_dir = tmp_path / "bare"
    model.save_pretrained(model_dir)
    code = main(["generate", "--model", str(model_dir), "--prompt-ids", "5 6", "--device", "cpu"])
    assert code == 1
    assert "evon_posterior" in capsys.readouterr().err


def test_parser_has_subcommands_and_help():
    assert SUBCOMMANDS
    parser = build_parser()
    args = parser.parse_args(["generate", "--model", "m", "--prompt", "x"])
    assert args.command == "generate" and args.samples == 8 and args.max_new_tokens == 32
    assert main([]) == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--model", "m"])  # a prompt is required


def test_console_script(saved):
    path, *_ = saved
    exe = shutil.which("hf-evon")
    cmd = [exe] if exe else [sys.executable, "-m", "hf_evon.cli"]
    done = subprocess.run(
        cmd
        + [
            "generate",
            "--model",
            str(path),
            "--prompt",
            "ab",
            "--samples",
            "2",
            "--max-new-tokens",
            "3",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout.strip()
    assert out.startswith("ab") and len(out) >= 2


def test_stop_strings_with_tokenizer(saved):
    _, model, tokenizer, posterior = saved
    ids = tokenizer(["def f(x):"], return_tensors="pt")["input_ids"]
    kwargs = dict(
        num_samples=2, seed=3, max_new_tokens=10, do_sample=False, pad_token_id=1, eos_token_id=None
    )
    free = generate_bma(model, posterior, ids, **kwargs)
    new = free[0, ids.shape[1] :].tolist()
    stop = tokenizer.decode(new[2:4])
    first = next(i for i in range(1, len(new)) if stop in tokenizer.decode(new[: i + 1]))
    out = generate_bma(model, posterior, ids, tokenizer=tokenizer, stop_strings=[stop], **kwargs)
    assert out[0, ids.shape[1] :].tolist() == new[: first + 1]
    assert first + 1 < len(new)  # it did stop early
