"""``hf-evon generate``: a saved model + tokenizer + posterior decode as ``generate_bma`` does."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import directory_state, plain_evon, refuse_lookups
from launcher import free_port
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


def trained_posterior(model, vocab: int, targets) -> EVONPosterior:
    """Three EVON steps on random token ids (labels ``targets(ids)``), then a wide posterior (ζ 30)."""
    opt = hf_evon.build_optimizer(model, **plain_evon(lr=1e-2, ess=1e4, precondition_frequency=2, seed=0))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randint(2, vocab, (4, 12), generator=gen)
        with opt.sampled_params(train=True):
            model(input_ids=x, labels=targets(x)).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    posterior = EVONPosterior.from_optimizer(opt, model).with_ess(30.0)
    del posterior.config["trained_ess"]  # as if trained at ζ 30: the scale a calibration multiplies
    return posterior


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Directory with model, tokenizer and posterior, plus the in-memory originals. The model has
    no end-of-sequence token: its nearly untrained logits are close to uniform, so whether greedy
    decoding picks one early is a matter of rounding, which differs between CPU instruction sets
    (AVX-512 against AVX2); without one every completion has its ``--max-new-tokens``."""
    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    vocab = len(tokenizer)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=None
        )
    )
    posterior = trained_posterior(model, vocab, lambda x: x)
    path = tmp_path_factory.mktemp("cli_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    posterior.save_pretrained(path)
    return path, model, tokenizer, posterior


def _hub_at(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike, endpoint: str) -> None:
    """huggingface_hub pointed at ``endpoint``, online, with an empty cache under ``tmp_path``, which is
    the working directory (a repo id there names no local directory). Its file URLs are formatted from
    a template it builds from ``HF_ENDPOINT`` once, at import: the template follows."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)


def _unreachable_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike) -> int:
    """:func:`_hub_at` a local port nothing listens on (connections are refused); returns the port."""
    port = free_port()
    _hub_at(monkeypatch, tmp_path, f"http://127.0.0.1:{port}")
    return port


@pytest.mark.parametrize("beams", [None, 3])
def test_generate_matches_generate_bma(saved, capsys, beams):
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
        + ([] if beams is None else ["--num-beams", str(beams)])
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
        **({} if beams is None else {"num_beams": beams}),
    )
    if beams is not None:  # the beams change the decoding here, so the option is seen
        greedy = generate_bma(
            model, posterior, enc["input_ids"], attention_mask=enc["attention_mask"], num_samples=3, seed=4,
            max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        assert not torch.equal(greedy, expected)
    for row, record in enumerate(records):
        new = expected[row, enc["input_ids"].shape[1] :].tolist()
        assert record["completion_ids"] == new
        assert record["completion"] == tokenizer.decode(new, skip_special_tokens=True)
        assert len(record["completion_ids"]) == 6


def test_generate_strategy_reaches_the_batched_samples_and_a_bad_one_is_an_argparse_error(saved, capsys, monkeypatch):
    """hf-evon generate had no --strategy: generate_bma's strategy (per-sample weights for a per-sample
    loop's tokens in bfloat16) was out of its reach. Each of SampleStrategy's values now reaches the
    batched samples; another is refused as argparse refuses a bad choice, naming --strategy."""
    import hf_evon.predictive.batched_samples as batched
    from hf_evon.predictive.sample_strategy import STRATEGIES

    path, *_ = saved
    entered: list[str] = []
    enter = batched.BatchedSamples.__enter__

    def recording(self: batched.BatchedSamples) -> batched.BatchedSamples:
        out = enter(self)
        entered.append(self.strategy)
        return out

    monkeypatch.setattr(batched.BatchedSamples, "__enter__", recording)
    argv = ["generate", "--model", str(path), "--prompt-ids", "5 9", "--samples", "2", "--max-new-tokens", "2"]
    for strategy in STRATEGIES:
        entered.clear()
        assert main([*argv, "--device", "cpu", "--strategy", strategy]) == 0
        assert entered == [strategy]
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        main([*argv, "--device", "cpu", "--strategy", "materialise"])
    assert refused.value.code == 2 and entered == [STRATEGIES[-1]]
    assert "argument --strategy: invalid choice: 'materialise'" in capsys.readouterr().err


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


@pytest.fixture(scope="module")
def saved_seq2seq(tmp_path_factory):
    """A tiny BART (an encoder-decoder, as EVONSeq2SeqTrainer trains) with tokenizer and posterior."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    vocab = len(tokenizer)
    model = BartForConditionalGeneration(
        BartConfig(
            vocab_size=vocab, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
            pad_token_id=1, bos_token_id=0, eos_token_id=1, decoder_start_token_id=1, forced_eos_token_id=None,
            init_std=0.5,  # outputs that depend on the input
        )
    )  # fmt: skip
    posterior = trained_posterior(model, vocab, lambda x: x.flip(-1))  # learn to reverse
    path = tmp_path_factory.mktemp("cli_seq2seq")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    posterior.save_pretrained(path)
    return path, model, tokenizer, posterior


def test_generate_with_an_encoder_decoder_model(saved_seq2seq, capsys):
    """An encoder-decoder directory loads as one (AutoModelForSeq2SeqLM); its prompts are the
    encoder's input, padded on the right, and the output is the decoder's text alone."""
    path, model, tokenizer, posterior = saved_seq2seq
    prompts = ["def f(x):", "a = b"]
    argv = ["generate", "--model", str(path), "--samples", "3", "--max-new-tokens", "6", "--seed", "4"]
    assert main([*argv, "--json", "--device", "cpu", *[a for p in prompts for a in ("--prompt", p)]]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tokenizer.padding_side = "right"
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    expected = generate_bma(
        model, posterior, enc["input_ids"], attention_mask=enc["attention_mask"], num_samples=3, seed=4,
        max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    assert expected.shape == (2, 7) and len(set(expected[:, 1:].flatten().tolist())) > 2
    assert [r["completion_ids"] for r in records] == expected[:, 1:].tolist()
    assert [r["completion"] for r in records] == tokenizer.batch_decode(expected[:, 1:], skip_special_tokens=True)
    # token ids: right-padded for the encoder; text output is the completion alone
    assert main([*argv, "--prompt-ids", "5 9 17", "--prompt-ids", "4 4", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out.splitlines()
    ids = torch.tensor([[5, 9, 17], [4, 4, 1]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    expected = generate_bma(
        model, posterior, ids, attention_mask=mask, num_samples=3, seed=4, max_new_tokens=6, do_sample=False,
        pad_token_id=1,
    )  # fmt: skip
    assert printed == tokenizer.batch_decode(expected[:, 1:], skip_special_tokens=True)


def test_prompt_ids_of_two_lengths_pad_with_an_id_in_the_vocabulary(tmp_path, capsys):
    """A model without a tokenizer whose config's eos id lies outside its vocabulary (GPT-2's 50256 on
    64 ids): the shorter prompt was left-padded with 50256 and the command refused its own padding
    ("input_ids holds ids from 1 to 50256, outside the model's vocabulary"). Masked padding takes id 0."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    assert model.config.eos_token_id == 50256 and model.config.pad_token_id is None
    posterior = trained_posterior(model, 64, lambda x: x)
    model.save_pretrained(tmp_path)
    posterior.save_pretrained(tmp_path)
    argv = ["generate", "--model", str(tmp_path), "--samples", "3", "--max-new-tokens", "4", "--seed", "2", "--json"]
    assert main([*argv, "--prompt-ids", "5 9 17", "--prompt-ids", "4 4", "--device", "cpu"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ids, mask = torch.tensor([[5, 9, 17], [0, 4, 4]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    expected = generate_bma(
        model, posterior, ids, attention_mask=mask, num_samples=3, seed=2, max_new_tokens=4, do_sample=False,
        pad_token_id=0,
    )  # fmt: skip
    assert [r["completion_ids"] for r in records] == expected[:, 3:].tolist()
    assert [r["prompt"] for r in records] == [[5, 9, 17], [4, 4]]


def test_prompts_of_two_lengths_pad_with_an_id_in_the_vocabulary_when_the_tokenizers_pad_is_not(saved, tmp_path, capsys):
    """A tokenizer whose added pad token (id = the vocabulary's size) the model has no embedding for:
    one prompt decoded, two of different lengths failed on the padding ("input_ids holds ids from 2 to
    36, outside the model's vocabulary 0..36", an off-by-one bound too). Masked padding takes an id
    in the vocabulary, and the completions are generate_bma's."""
    path, model, tokenizer, posterior = saved
    shutil.copytree(path, tmp_path / "m")
    added = char_tokenizer()
    added.add_special_tokens({"pad_token": "[PAD]"})
    added.save_pretrained(tmp_path / "m")
    vocab = model.get_input_embeddings().num_embeddings
    assert added.pad_token_id == vocab  # outside the embedding
    argv = ["generate", "--model", str(tmp_path / "m"), "--samples", "2", "--max-new-tokens", "3", "--seed", "1"]
    assert main([*argv, "--prompt", "abc", "--prompt", "abcdef", "--json", "--device", "cpu"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    short, long = (added("abc")["input_ids"], added("abcdef")["input_ids"])
    ids = torch.tensor([[0] * (len(long) - len(short)) + short, long])
    mask = torch.tensor([[0] * (len(long) - len(short)) + [1] * len(short), [1] * len(long)])
    expected = generate_bma(model, posterior, ids, attention_mask=mask, num_samples=2, seed=1, max_new_tokens=3,
                            do_sample=False, pad_token_id=0)  # fmt: skip
    assert [r["completion_ids"] for r in records] == expected[:, len(long):].tolist()
    with pytest.raises(ValueError, match=rf"from 2 to {vocab}, outside the model's vocabulary 0\.\.{vocab - 1}$"):
        generate_bma(model, posterior, torch.tensor([[2, vocab]]), num_samples=1, max_new_tokens=1)


def test_an_encoder_decoder_context_counts_the_decoder_from_its_start_token(saved_seq2seq, capsys):
    path, *_ = saved_seq2seq
    argv = ["generate", "--model", str(path), "--samples", "1", "--prompt-ids", " ".join(["5"] * 30)]
    assert main([*argv, "--max-new-tokens", "31", "--device", "cpu"]) == 0  # 1 + 31 = the context of 32
    capsys.readouterr()
    assert main([*argv, "--max-new-tokens", "32", "--device", "cpu"]) == 2
    assert (
        "--max-new-tokens 32 after the decoder's start token exceeds the model's context of 32 tokens "
        "(config.max_position_embeddings): use --max-new-tokens 31 or less"
    ) in capsys.readouterr().err


def test_generate_with_a_lora_adapter_of_an_encoder_decoder_model(saved_seq2seq, tmp_path, capsys):
    """An adapter directory whose base model is an encoder-decoder loads as
    ``AutoPeftModelForSeq2SeqLM`` (the base read from the adapter's config)."""
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import BartForConditionalGeneration

    path, *_ = saved_seq2seq
    model = get_peft_model(
        BartForConditionalGeneration.from_pretrained(path),
        LoraConfig(task_type=TaskType.SEQ_2_SEQ_LM, r=2, target_modules=["q_proj", "v_proj"]),
    )
    posterior = trained_posterior(model, 30, lambda x: x.flip(-1))
    assert posterior.names and all("lora_" in n for n in posterior.names)
    model.save_pretrained(tmp_path)
    posterior.save_pretrained(tmp_path)
    argv = ["generate", "--model", str(tmp_path), "--samples", "3", "--max-new-tokens", "5", "--seed", "2"]
    assert main([*argv, "--prompt-ids", "5 9 17", "--device", "cpu", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    expected = generate_bma(
        model, posterior, torch.tensor([[5, 9, 17]]), attention_mask=torch.ones(1, 3, dtype=torch.long),
        num_samples=3, seed=2, max_new_tokens=5, do_sample=False, pad_token_id=1,
    )  # fmt: skip
    assert record["completion_ids"] == expected[0, 1:].tolist()


def _assert_generates_as_generate_bma(path, model, posterior, capsys, posterior_dir=None) -> None:  # noqa: ANN001
    """``hf-evon generate`` on the model saved at ``path`` and its posterior (at ``posterior_dir``, or
    beside the model) (3 samples, 4 greedy new tokens after ids 5 9, seed 2) writes the completion
    ``generate_bma`` makes of them."""
    argv = ["generate", "--model", str(path), "--samples", "3", "--max-new-tokens", "4", "--seed", "2"]
    argv += [] if posterior_dir is None else ["--posterior", str(posterior_dir)]
    assert main([*argv, "--prompt-ids", "5 9", "--device", "cpu", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    expected = generate_bma(
        model, posterior, torch.tensor([[5, 9]]), attention_mask=torch.ones(1, 2, dtype=torch.long),
        num_samples=3, seed=2, max_new_tokens=4, do_sample=False,
    )  # fmt: skip
    assert record["completion_ids"] == expected[0, 2:].tolist()
    assert len(record["completion_ids"]) == 4


@pytest.mark.parametrize("model_dir", ["the adapter's folder", "where the adapter was saved"])
def test_generate_with_a_lora_adapter_not_named_default(saved, tmp_path, capsys, model_dir):
    """PEFT saves an adapter named "mine" in ``dir/mine`` and loads any adapter as "default", while
    the posterior names its tensors ``lora_A.mine.weight``: the CLI loads the adapter under the
    posterior's name, also given the directory PEFT saved into. Before, ``--model dir/mine`` loaded
    it as "default" (the posterior did not fit) and ``--model dir`` had "no config.json"."""
    from peft import LoraConfig, get_peft_model

    path, _, _, _ = saved
    model = get_peft_model(
        GPT2LMHeadModel.from_pretrained(path),
        LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True),
        adapter_name="mine",
    )
    posterior = trained_posterior(model, model.config.vocab_size, lambda x: x)
    assert posterior.names and all(".mine." in n for n in posterior.names)
    model.save_pretrained(tmp_path)
    posterior.save_pretrained(tmp_path)
    assert (tmp_path / "mine" / "adapter_config.json").is_file()
    where = tmp_path / "mine" if model_dir == "the adapter's folder" else tmp_path
    _assert_generates_as_generate_bma(where, model, posterior, capsys, posterior_dir=tmp_path)


def test_generate_loads_a_named_adapter_from_its_folder_beside_the_default_one_at_the_root(saved, tmp_path, capsys):
    """A PeftModel with the adapters "default" and "mine", "mine" trained: PEFT saves "default" at the
    directory's root and "mine" in ``dir/mine``. Given ``--model dir`` and the posterior of "mine", the
    CLI loaded the root's adapter ("default"'s weights) under the name "mine": the posterior fitted by
    name and was sampled around other weights (a PosteriorMeanWarning, other completions). It loads
    ``dir/mine``, and decodes as generate_bma on the trained model."""
    from peft import LoraConfig, get_peft_model

    from hf_evon.posterior.fingerprint import PosteriorMeanWarning

    path, _, _, _ = saved
    lora = LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    model = get_peft_model(GPT2LMHeadModel.from_pretrained(path), lora)
    model.add_adapter("mine", lora)
    model.set_adapter("mine")
    posterior = trained_posterior(model, model.config.vocab_size, lambda x: x)
    assert posterior.names and all(".mine." in n for n in posterior.names)
    model.save_pretrained(tmp_path)
    posterior.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_config.json").is_file() and (tmp_path / "mine" / "adapter_config.json").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PosteriorMeanWarning)
        _assert_generates_as_generate_bma(tmp_path, model, posterior, capsys)


def _assert_generate_refuses_the_broken_file(model: Path, file: Path, kind: str, capsys) -> None:  # noqa: ANN001
    """``file`` of ``--model model`` replaced by a directory or a link to nothing (``kind``): hf-evon
    generate exits 2 with a usage error naming the file and what it is."""
    moved = file.parent / "moved-away"
    file.unlink()
    file.mkdir() if kind == "directory" else file.symlink_to(moved)
    assert main(["generate", "--model", str(model), "--prompt-ids", "5 9", "--device", "cpu"]) == 2
    why = "a link to " + repr(str(moved)) + ", which does not exist" if kind == "dangling link" else (
        "not a regular file (a directory, named pipe or device)"
    )
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == f"hf-evon generate: error: --model {str(model)!r}: {str(file)!r} is {why}", err


@pytest.mark.parametrize("kind", ["directory", "dangling link"])
def test_a_named_adapters_config_that_is_no_file_is_refused_naming_it(saved, tmp_path, capsys, kind):
    """The adapters "default" (at the root) and "mine" (in ``dir/mine``), whose adapter_config.json is a
    directory or a link to nothing: "mine"'s folder was taken for none (os.path.isfile), and the root's
    adapter ("default"'s weights) was loaded under the name "mine", beside the posterior of "mine"."""
    from peft import LoraConfig, get_peft_model

    path, _, _, _ = saved
    lora = LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    model = get_peft_model(GPT2LMHeadModel.from_pretrained(path), lora)
    model.add_adapter("mine", lora)
    model.set_adapter("mine")
    posterior = trained_posterior(model, model.config.vocab_size, lambda x: x)
    model.save_pretrained(tmp_path)
    posterior.save_pretrained(tmp_path)
    _assert_generate_refuses_the_broken_file(tmp_path, tmp_path / "mine" / "adapter_config.json", kind, capsys)


def _two_adapters_mine_trained(saved, directory: Path) -> tuple[object, EVONPosterior]:  # noqa: ANN001
    """The adapters "default" (saved at ``directory``'s root) and "mine" (in ``directory/mine``), "mine"
    trained and its posterior saved beside them; returns the model and the posterior."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    model = get_peft_model(GPT2LMHeadModel.from_pretrained(saved[0]), lora)
    model.add_adapter("mine", lora)
    model.set_adapter("mine")
    posterior = trained_posterior(model, model.config.vocab_size, lambda x: x)
    model.save_pretrained(directory)
    posterior.save_pretrained(directory)
    return model, posterior


def test_a_named_adapters_folder_that_cannot_be_looked_up_is_not_taken_for_none(saved, tmp_path, capsys, monkeypatch):
    """The adapters "default" (at the root) and "mine" (in ``dir/mine``), where "mine"'s folder may not be
    searched (EACCES; simulated by os.lstat and os.stat, the tests run as root): the scan for named adapters'
    folders (os.path.lexists) took it for none, and the root's adapter ("default"'s weights) was loaded under
    the name "mine", beside the posterior of "mine". The PermissionError naming its adapter_config.json is
    reported."""
    _two_adapters_mine_trained(saved, tmp_path)
    _refuse_lookups_under(monkeypatch, str(tmp_path / "mine"))
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "5 9", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    config = str(tmp_path / "mine" / "adapter_config.json")
    assert err == f"hf-evon generate: error: [Errno 13] Permission denied: {config!r}", err


def test_entries_beside_a_named_adapter_that_cannot_be_looked_up_do_not_stop_its_load(
    saved, tmp_path, capsys, monkeypatch
):
    """An adapters' directory that also holds a loop of links (``logs``) and a folder this user may not
    search (``runs``: EACCES, simulated): DirEntry.is_dir() raised ELOOP in the scan for named adapters'
    folders, and the load failed on an entry it has no use for. "mine" loads from its folder, and decodes as
    generate_bma on the trained model."""
    model, posterior = _two_adapters_mine_trained(saved, tmp_path)
    (tmp_path / "logs").symlink_to("logs")
    (tmp_path / "runs").mkdir()
    _refuse_lookups_under(monkeypatch, str(tmp_path / "runs"))
    _assert_generates_as_generate_bma(tmp_path, model, posterior, capsys)


def _config_edited(config: dict, key: str, value):  # noqa: ANN001, ANN202
    return value if key == "" else {**config, key: value}


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("vocab_size", 10, r"its files do not load \(RuntimeError: .*ignore_mismatched_sizes"),
        ("n_positions", 8, r"its files do not load \(RuntimeError: .*ignore_mismatched_sizes"),
        ("n_embd", "x", r"its files do not load \(StrictDataclassFieldValidationError: .*'n_embd'"),
        ("", [1, 2], r"its config\.json is not a JSON object"),
        ("n_layer", 3, r"its weights lack 12 of the model's tensors \(transformer\.h\.2\.attn\.c_attn\.bias, .*random"),
    ],
    ids=["vocab-size", "positions", "field-type", "json-list", "missing-layer"],
)
def test_a_model_whose_config_disagrees_with_its_files_is_one_error_line_naming_it(saved, tmp_path, capsys, key, value, message):
    """transformers' own refusals of a model's files (a config.json whose sizes disagree with the weights,
    a field of the wrong type, a JSON list) escaped as tracebacks of RuntimeError, TypeError or
    AttributeError; a config with a layer the weights lack loaded that layer as random values and
    decoded with exit status 0. Each is one error line naming --model, exit status 1."""
    model_dir = tmp_path / "model"
    shutil.copytree(saved[0], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(_config_edited(config, key, value)))
    capsys.readouterr()
    argv = ["generate", "--model", str(model_dir), "--prompt", "ab", "--samples", "2", "--device", "cpu"]
    assert main(argv) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(rf"^hf-evon generate: error: --model {re.escape(repr(str(model_dir)))}: {message}", line), line


@pytest.mark.parametrize("kind", ["directory", "dangling link"])
def test_a_model_directory_whose_config_is_no_file_is_refused_naming_it(saved, tmp_path, capsys, kind):
    """A model's directory (with its posterior) whose config.json is a directory or a link to nothing (a
    copied Hub cache snapshot whose blobs are gone): it was 'holds no config.json ...: it holds an EVON
    posterior; pass it as --posterior', advice that does not apply. The error names the file."""
    model_dir = tmp_path / "model"
    shutil.copytree(saved[0], model_dir)  # the model, its tokenizer and its posterior
    _assert_generate_refuses_the_broken_file(model_dir, model_dir / "config.json", kind, capsys)


def test_a_model_directory_whose_config_cannot_be_looked_up_is_not_taken_for_one_without_it(
    saved, tmp_path, capsys, monkeypatch
):
    """A model's directory whose config.json this user cannot look up (EACCES; simulated by os.lstat,
    the tests run as root): os.path.lexists took it for no config.json, and the directory was told
    it 'holds no config.json ...: it holds an EVON posterior; pass it as --posterior'. The
    PermissionError naming the file is reported."""
    model_dir = tmp_path / "model"
    shutil.copytree(saved[0], model_dir)
    config = str(model_dir / "config.json")
    refuse_lookups(monkeypatch, lambda path: path == config, ("lstat",))
    assert main(["generate", "--model", str(model_dir), "--prompt-ids", "5 9", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == f"hf-evon generate: error: [Errno 13] Permission denied: {config!r}", err


def test_a_model_directory_whose_config_is_a_loop_of_links_is_refused_naming_it(saved, tmp_path, capsys):
    """A config.json that is a link leading back to itself (ELOOP) was reported as 'a link to ..., which
    does not exist': its target is there, the links go round."""
    model_dir = tmp_path / "model"
    shutil.copytree(saved[0], model_dir)
    config = model_dir / "config.json"
    config.unlink()
    config.symlink_to(model_dir / "back")
    (model_dir / "back").symlink_to(config)
    assert main(["generate", "--model", str(model_dir), "--prompt-ids", "5 9", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    why = f"a link to {str(model_dir / 'back')!r}, which leads into a loop of links (ELOOP)"
    assert err == f"hf-evon generate: error: --model {str(model_dir)!r}: {str(config)!r} is {why}", err


@pytest.mark.parametrize("kind", ["EACCES", "directory", "dangling link", "loop"])
def test_an_adapter_config_beside_a_models_config_that_is_no_file_to_read_is_not_taken_for_none(
    saved, tmp_path, capsys, monkeypatch, kind
):
    """A model's directory that also holds a PEFT adapter of it (config.json, the base weights,
    adapter_config.json and its weights, the adapter's posterior): generate loads the adapter on its base.
    Where its adapter_config.json cannot be looked up (EACCES, simulated: the tests run as root), or is a
    directory, a link to nothing or a loop of links, os.path.isfile took it for none and the base model was
    loaded without the adapter. The PermissionError naming it is reported, and the others are a usage error
    naming the file and what it is."""
    from peft import LoraConfig, get_peft_model

    model_dir = tmp_path / "model"
    shutil.copytree(saved[0], model_dir)
    model = get_peft_model(
        GPT2LMHeadModel.from_pretrained(saved[0]), LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    )  # its base_model_name_or_path: saved[0], whose copy model_dir is
    posterior = trained_posterior(model, model.config.vocab_size, lambda x: x)
    model.save_pretrained(model_dir)
    posterior.save_pretrained(model_dir)
    assert (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()
    _assert_generates_as_generate_bma(model_dir, model, posterior, capsys)
    config = model_dir / "adapter_config.json"
    config.unlink()
    why = _refused_or_linked(monkeypatch, config, kind)
    if kind == "directory":
        why = "not a regular file (a directory, named pipe or device)"
    code = main(["generate", "--model", str(model_dir), "--prompt-ids", "5 9", "--device", "cpu"])
    err = capsys.readouterr().err.splitlines()[-1]
    if kind == "EACCES":
        assert (code, err) == (1, f"hf-evon generate: error: [Errno 13] Permission denied: {str(config)!r}"), err
    else:
        assert (code, err) == (2, f"hf-evon generate: error: --model {str(model_dir)!r}: {str(config)!r} is {why}"), err


@pytest.mark.parametrize("adapter", ["ia3", "adalora"])
def test_generate_decodes_an_ia3_or_adalora_adapter(saved, tmp_path, capsys, adapter):
    """IA3's and AdaLoRA's covered tensors live in ParameterDicts, which generate_bma's batched
    samples cannot run: ``hf-evon generate`` failed with NotImplementedError for such an adapter.
    It now decodes it as generate_bma does (the samples written into the weights one at a time)."""
    from peft import AdaLoraConfig, IA3Config, get_peft_model

    path, _, _, _ = saved
    config = (
        IA3Config(target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"])
        if adapter == "ia3"
        else AdaLoraConfig(init_r=4, target_r=2, target_modules=["c_attn"], total_step=10, fan_in_fan_out=True)
    )
    model = get_peft_model(GPT2LMHeadModel.from_pretrained(path), config)
    posterior = trained_posterior(model, model.config.vocab_size, lambda x: x)
    model.save_pretrained(tmp_path)
    posterior.save_pretrained(tmp_path)
    _assert_generates_as_generate_bma(tmp_path, model, posterior, capsys)


# ----------------------------------------------------------------------------- errors (issue 9.15, 11.7)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", ""], "--prompt number 1 ('') has no tokens"),
        (["--prompt", "ab", "--prompt", ""], "--prompt number 2 ('') has no tokens"),
        (
            ["--prompt-ids", "5 999"],
            "--prompt-ids: token id 999 is outside the model's vocabulary (ids 0 to 35)",
        ),
        (
            ["--prompt-ids", " ".join(["5"] * 65)],
            "--prompt-ids: a prompt of 65 tokens is longer than the model's context of 64",
        ),
        (
            ["--prompt-ids", " ".join(["5"] * 60), "--max-new-tokens", "5"],
            "--max-new-tokens 5 after a prompt of 60 tokens exceeds the model's context of 64 tokens",
        ),
        (["--prompt", "ab", "--device", "bogus"], "--device 'bogus' is not a torch device"),
        (["--prompt", "ab", "--device", "cuda"], "--device 'cuda': CUDA is not available"),
        (["--prompt", "ab", "--device", "cuda:1"], "--device 'cuda:1': CUDA is not available"),
        # these raised from inside torch, with a traceback
        (["--prompt", "ab", "--device", "meta"], "--device 'meta': the meta device holds no data"),
        (["--prompt", "ab", "--device", "xpu"], "--device 'xpu': torch.xpu is not available here"),
        (["--prompt", "ab", "--device", "hpu"], "--device 'hpu': torch.hpu is not available here"),
    ],
)
def test_bad_generate_input_is_an_argparse_style_error(saved, capsys, args, message):
    """What a user can get wrong on the command line is reported as argparse reports a bad
    option (usage, ``hf-evon generate: error: ...``, exit code 2), never as a traceback."""
    if any(a.startswith("cuda") for a in args) and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    if "xpu" in args and torch.xpu.is_available():
        pytest.skip("an XPU is available here")
    path, *_ = saved
    code = main(["generate", "--model", str(path), "--samples", "1", "--max-new-tokens", "2", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert "\nusage: hf-evon generate " in "\n" + err.replace("\r", "\n")
    assert f"hf-evon generate: error: {message}" in err


def test_bad_input_in_a_subprocess_prints_no_traceback(saved):
    path, *_ = saved
    exe = shutil.which("hf-evon")
    cmd = [exe] if exe else [sys.executable, "-m", "hf_evon.cli"]
    done = subprocess.run(
        [*cmd, "generate", "--model", str(path), "--prompt", "", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "hf-evon generate: error: --prompt number 1 ('') has no tokens" in done.stderr


def test_a_reader_that_leaves_early_gets_no_error_line(saved):
    """`hf-evon inspect DIR | head`: the reader closes the pipe before the command writes."""
    path, *_ = saved
    exe = shutil.which("hf-evon")
    cmd = [exe] if exe else [sys.executable, "-m", "hf_evon.cli"]
    proc = subprocess.Popen([*cmd, "inspect", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the command has loaded anything, so its first write meets a closed pipe
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=300) == 141 and err == ""


def test_a_closed_standard_output_is_an_error_not_a_silent_success(saved):
    """`hf-evon inspect DIR >&-`: Python starts with sys.stdout None, print() writes nowhere, and the
    command exited 0 having shown nothing. It exits 2 saying so, before loading anything."""
    path, *_ = saved
    exe = shutil.which("hf-evon")
    cmd = [exe] if exe else [sys.executable, "-m", "hf_evon.cli"]
    done = subprocess.run(
        [*cmd, "inspect", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300,
        preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == "hf-evon inspect: error: standard output is closed: there is nowhere to write the result\n"


def test_a_broken_pipe_that_is_not_stdouts_is_an_error(saved, capsys, monkeypatch):
    """A pipe or socket other than the output breaking (here: inside generate_bma) is reported."""
    import hf_evon.predictive.generation as generation

    def broken(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(generation, "generate_bma", broken)
    argv = ["generate", "--model", str(saved[0]), "--prompt", "def ", "--samples", "2", "--device", "cpu"]
    assert main(argv) == 1
    assert capsys.readouterr().err.endswith("\nhf-evon generate: error: [Errno 32] Broken pipe\n")


@pytest.mark.parametrize("location", ["./no-such-dir", "{tmp}/missing", "a/b/c"])
def test_missing_local_directory_is_not_reported_as_a_repo_id(tmp_path, capsys, location):
    location = location.format(tmp=tmp_path)
    code = main(["generate", "--model", location, "--prompt", "x", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"hf-evon generate: error: --model {location!r}: no such local directory" in err
    assert "Repo id" not in err
    code = main(["inspect", location])
    assert code == 2
    assert (
        f"hf-evon inspect: error: location {location!r}: no such local directory" in capsys.readouterr().err
    )


def test_a_missing_run_beside_an_existing_output_folder_is_local(tmp_path, capsys, monkeypatch):
    """Issue 33 §3: ``--model out/nonexistent`` (one ``/``, a valid repo-id form) was taken for a
    Hub id and retried for ~46 s offline. Where ``out/`` is a folder here it is a local path."""
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    code = main(["generate", "--model", "out/nonexistent", "--prompt", "x", "--device", "cpu"])
    assert code == 2
    assert "--model 'out/nonexistent': no such local directory" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="no such directory"):
        EVONPosterior.from_pretrained("out/nonexistent")


def test_a_missing_run_beside_a_link_to_nothing_is_local(tmp_path, capsys, monkeypatch):
    """``--model out/run`` where ``out`` is a link to nothing (a disk not mounted): os.path.isdir('out')
    answers False, so ``out/run`` was taken for a Hub repo id and looked up on the Hub."""
    _unreachable_hub(monkeypatch, tmp_path)  # the working directory; a Hub lookup fails at once
    (tmp_path / "out").symlink_to("unmounted")
    assert main(["generate", "--model", "out/run", "--prompt", "x", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "hf-evon generate: error: --model 'out/run': no such local directory", err
    with pytest.raises(FileNotFoundError, match="no such directory"):
        EVONPosterior.from_pretrained("out/run", local_files_only=True)


def _refuse_lookups_under(monkeypatch: pytest.MonkeyPatch, directory: str) -> None:
    """``os.lstat`` and ``os.stat`` of an entry in ``directory`` (a path as the code under test spells it)
    answer EACCES, as in a directory this user may not search (simulated: the tests run as root)."""
    refuse_lookups(monkeypatch, lambda path: path.startswith(directory + os.sep))


@pytest.mark.parametrize(
    ("location", "kind"), [("a/b", "EACCES"), ("loop", "loop"), ("./loop", "loop"), ("gone", "dangling link")]
)
def test_a_location_listed_here_that_is_no_directory_to_read_is_refused_naming_it(
    tmp_path, monkeypatch, capsys, location, kind
):
    """A location that is there but cannot be looked up (``a/b`` where ``a`` may not be searched: EACCES),
    a loop of links or a link to nothing: os.path.isdir and os.path.exists swallow why, so ``a/b`` was
    'no such local directory', ``loop`` and ``gone`` were taken for Hub repo ids (and looked up on the Hub)
    and ``./loop`` was 'no such local directory'. The error names the location and why."""
    _unreachable_hub(monkeypatch, tmp_path)  # the working directory; a Hub lookup fails at once
    if kind == "EACCES":
        (tmp_path / "a" / "b").mkdir(parents=True)
        _refuse_lookups_under(monkeypatch, "a")
    else:
        (tmp_path / location).symlink_to("loop" if kind == "loop" else "moved-away")
    target = "'loop', which leads into a loop of links (ELOOP)" if kind == "loop" else "'moved-away', which does not exist"
    for argv, option in (
        (["generate", "--model", location, "--prompt-ids", "5 9", "--device", "cpu"], f"--model {location!r}"),
        (["inspect", location], f"location {location!r}"),
    ):
        code = main(argv)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        prog = f"hf-evon {argv[0]}: error: "
        if kind == "EACCES":
            assert (code, err) == (1, f"{prog}[Errno 13] Permission denied: {location!r}"), err
        else:
            assert (code, err) == (2, f"{prog}{option} is a link to {target}"), err


def test_an_unreachable_hub_is_reported_before_any_retry_unless_the_repo_is_cached(tmp_path, monkeypatch, capsys):
    """A repo-id-shaped location with no such folder here, offline: the Hub libraries retry every
    file five times with backoff (~50 s for ``hf-evon generate``). One request to the endpoint
    tells first, so the loader never starts; a repo in the local cache, or HF_HUB_OFFLINE, still
    goes to the loader (which may load it from the cache)."""

    from huggingface_hub import constants

    from hf_evon.cli.loading import from_location

    port = _unreachable_hub(monkeypatch, tmp_path)
    calls = []

    def load():
        calls.append(1)
        raise OSError("the loader ran")

    with pytest.raises(OSError, match=f"http://127.0.0.1:{port} cannot be reached") as err:
        from_location("alice/absent", "--model", load)
    assert calls == [] and "nothing of it is in the local cache" in str(err.value)
    assert main(["generate", "--model", "alice/absent", "--prompt", "x", "--device", "cpu"]) == 1
    assert f"--model 'alice/absent' is not a local directory, so it was looked up on the Hugging Face Hub, which failed: http://127.0.0.1:{port} cannot be reached" in capsys.readouterr().err
    (tmp_path / "hub" / "models--alice--absent").mkdir(parents=True)
    with pytest.raises(OSError, match="the loader ran"):
        from_location("alice/absent", "--model", load)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="the loader ran"):
        from_location("alice/other", "--model", load)
    assert calls == [1, 1]


@pytest.mark.parametrize("kind", ["EACCES", "dangling link", "loop"])
def test_a_repos_hub_cache_folder_listed_but_no_directory_is_not_taken_for_nothing_cached(
    tmp_path, monkeypatch, capsys, kind
):
    """A repo-id location whose folder in the Hub cache this user cannot look up (EACCES; simulated by
    os.lstat and os.stat, the tests run as root), or is a link to nothing (a cache on a disk not mounted)
    or a loop of links: os.path.isdir took it for nothing cached, and the Hub's failure was reported with
    'nothing of it is in the local cache' (online, the download fails on that folder). The PermissionError
    naming it is reported, and a link is named with its target, before any request; the loader never runs."""
    from hf_evon.cli.loading import from_location

    _unreachable_hub(monkeypatch, tmp_path)
    cached = tmp_path / "hub" / "models--alice--absent"
    cached.parent.mkdir()
    if kind == "EACCES":
        cached.mkdir()
        refuse_lookups(monkeypatch, lambda path: path == str(cached))
        error, message = PermissionError, f"[Errno 13] Permission denied: {str(cached)!r}"
    else:
        why = _refused_or_linked(monkeypatch, cached, kind)
        error, message = FileNotFoundError, f"the Hub cache's folder of 'alice/absent' ({str(cached)!r}) is {why}"
    with pytest.raises(error) as err:
        from_location("alice/absent", "--model", lambda: pytest.fail("the loader ran"))
    assert str(err.value) == message
    assert main(["generate", "--model", "alice/absent", "--prompt-ids", "5 9", "--device", "cpu"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == f"hf-evon generate: error: {message}"


def test_a_file_or_an_invalid_name_is_neither_directory_nor_repo_id(saved, capsys):
    path, *_ = saved
    weights = str(path / "model.safetensors")
    assert main(["inspect", weights]) == 2
    assert f"location {weights!r} is a file; pass the directory that holds it" in capsys.readouterr().err
    assert main(["inspect", "bad name!"]) == 2
    assert "'bad name!' is neither a local directory nor a Hub repo id" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"hf-evon {hf_evon.__version__} (torch {torch.__version__}, transformers ")


@pytest.mark.parametrize("module", ["hf_evon", "hf_evon.cli"])
def test_python_dash_m_runs_the_command(module):
    """``python -m hf_evon`` ran nothing ("'hf_evon' is a package and cannot be directly executed")."""
    done = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith(f"hf-evon {hf_evon.__version__} (torch "), done.stderr


def test_every_option_has_help():
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if a.choices and isinstance(a.choices, dict)]
    assert set(subparsers.choices) >= {"generate", "inspect"}
    for name, sub in [("hf-evon", parser), *subparsers.choices.items()]:
        for action in sub._actions:
            assert action.help and action.help.strip(), f"{name}: {action.option_strings or action.dest}"


# ----------------------------------------------------------------------------- inspect (issue 11.7)
def test_inspect_json_reports_tensors_std_files_and_calibration(saved, tmp_path, capsys):
    path, model, _, posterior = saved
    directory = tmp_path / "checkpoint"
    shutil.copytree(path, directory)
    assert main(["inspect", str(directory), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert list(summary["tensors"]) == list(posterior.names)
    assert summary["num_covered_tensors"] == len(posterior.names)
    assert summary["num_covered_params"] == sum(posterior.std(n).numel() for n in posterior.names)
    for name, row in summary["tensors"].items():
        std = posterior.std(name).double()
        assert row["shape"] == list(dict(model.named_parameters())[name].shape)
        assert row["std_min"] == float(std.min()) and row["std_max"] == float(std.max())
        assert row["std_mean"] == float(std.mean()) and row["std_median"] == float(std.flatten().median())
        f = posterior[name]  # lean posteriors drop a basis wider than 3x the other side
        assert row["bases"] == (
            ("L" if f.Q_L is not None else "") + ("R" if f.Q_R is not None else "") or "none"
        )
    assert summary["ess"] == 30.0 and summary["calibration"] is None and summary["temperature"] == 1.0
    assert summary["files"] == {
        f: (directory / f).stat().st_size
        for f in ("evon_posterior.safetensors", "evon_posterior_config.json", "model.safetensors")
    }

    config_path = directory / "evon_posterior_config.json"
    config = json.loads(config_path.read_text())
    # a record needs ess, trained_ess and mean_nll (validated on load); other keys are kept as written
    config["calibration"] = {"ess": "inf", "trained_ess": 30.0, "mean_nll": 2.25, "nll_before": 2.5}
    config["temperature"] = 1.75
    config_path.write_text(json.dumps(config))
    assert main(["inspect", str(directory), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["calibration"] == config["calibration"] and summary["temperature"] == 1.75
    config["ess"] = "inf"  # the mean alone, as a calibration that keeps the mean writes it
    config_path.write_text(json.dumps(config))
    assert main(["inspect", str(directory), "--json"]) == 0

    def refuse(constant: str) -> None:  # JSON has no Infinity or NaN (JavaScript's JSON.parse refuses them)
        raise AssertionError(f"inspect --json printed {constant}")

    assert json.loads(capsys.readouterr().out, parse_constant=refuse)["ess"] == "inf"
    config["ess"] = 30.0
    config_path.write_text(json.dumps(config))
    assert main(["inspect", str(directory)]) == 0
    text = capsys.readouterr().out
    assert "BMA temperature 1.75" in text
    assert (
        "calibration: ess inf, trained_ess 30, mean_nll 2.25, nll_before 2.5 "
        "(from evon_posterior_config.json, 'calibration')"
        in text
    )


def test_inspect_reports_a_scale_set_by_hand_as_the_card_does(saved, tmp_path, capsys):
    """A posterior saved after ``with_ess`` (no calibration record, ``trained_ess`` kept) was inspected as
    "calibration: none recorded", without a word that its ``ess`` was set by hand, nor of the trained one."""
    path, *_, posterior = saved
    for hand, words in [
        (posterior.with_ess(5.0), "`ess` = 5; the trained 30"),
        (posterior.with_ess({n: 2.0 + i for i, n in enumerate(posterior.names)}),
         f"`ess` = 2 to {len(posterior.names) + 1} by tensor; the trained 30"),
    ]:  # fmt: skip
        directory = tmp_path / str(len(words))
        hand.save_pretrained(directory)
        expected = f"the sampling scale was set by hand ({words}), not chosen on held-out data"
        assert expected in (directory / "README.md").read_text()
        assert main(["inspect", str(directory)]) == 0
        assert f"calibration: none recorded; {expected}\n" in capsys.readouterr().out
        assert main(["inspect", str(directory), "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["calibration"] is None and summary["trained_ess"] == 30.0
        assert summary["scale_set_by_hand"] is True
    assert main(["inspect", str(path), "--json"]) == 0  # at the scale it was trained with
    assert json.loads(capsys.readouterr().out)["scale_set_by_hand"] is False


def test_inspect_leaves_out_a_model_file_that_is_a_dangling_link(saved, tmp_path, capsys):
    """A model weights file beside the posterior that is a dangling link (or removed by a save
    meanwhile) made inspect fail with a bare errno message and nothing on stdout."""
    path, *_ = saved
    directory = tmp_path / "checkpoint"
    shutil.copytree(path, directory)
    for f in directory.iterdir():
        if f.name.startswith("model") and f.name.endswith(".safetensors"):
            f.unlink()
    (directory / "model.safetensors").symlink_to(tmp_path / "no-such-blob")
    assert main(["inspect", str(directory), "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert "model.safetensors" not in files and "evon_posterior_config.json" in files


def test_inspect_subfolder_lists_the_model_weights_beside_the_posterior(saved, tmp_path, capsys):
    """With --subfolder X, inspect listed the model weights at the location's root as the ones beside
    the posterior (and not X's): the sizes it printed were of another model's files."""
    path, *_ = saved
    config = GPT2Config(vocab_size=8, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=1, eos_token_id=1)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)  # another model at the root
    (tmp_path / "pytorch_model.bin").write_bytes(b"0" * 7)
    shutil.copytree(path, tmp_path / "run")
    sub = tmp_path / "run"
    assert main(["inspect", str(tmp_path), "--subfolder", "run", "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert files == {
        f: (sub / f).stat().st_size
        for f in ("evon_posterior.safetensors", "evon_posterior_config.json", "model.safetensors")
    }


def test_inspect_text(saved, capsys):
    path, _, _, posterior = saved
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert f"EVON posterior at {path}" in text
    assert "calibration: none recorded" in text
    assert f"covered: {len(posterior.names)} tensors" in text
    size = (path / "evon_posterior.safetensors").stat().st_size
    assert f"evon_posterior.safetensors {size / 1024:.1f} KiB" in text
    for name in posterior.names:
        (row,) = [line for line in text.splitlines() if line.strip().startswith(name + " ")]
        assert row.split()[-1] == f"{float(posterior.std(name).max()):.3g}"


def test_inspect_missing_posterior_is_a_clear_error(saved, tmp_path, capsys):
    path, model, *_ = saved
    model.save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 1
    assert "hf-evon inspect: error:" in capsys.readouterr().err


def test_hub_locations_inspect_and_report_hub_failures_as_such(saved, tmp_path, monkeypatch, capsys):
    """A repo id is looked up on the Hub (here a local stand-in); when that fails, the error
    says it was a Hub lookup because no such local directory exists."""
    try:
        from hub_stub import HubStub
    except ImportError:  # tests/ imported as a package
        from tests.hub_stub import HubStub
    _, _, _, posterior = saved
    with HubStub() as hub:
        posterior.push_to_hub("alice/cli-posterior", token="hf_dummy", endpoint=hub.endpoint)
        _hub_at(monkeypatch, tmp_path, hub.endpoint)
        assert main(["inspect", "alice/cli-posterior", "--json"]) == 0, capsys.readouterr().err[-3000:]
        summary = json.loads(capsys.readouterr().out)
        assert main(["inspect", "alice/no-such-repo"]) == 1
        err = capsys.readouterr().err
        files = hub.files("alice/cli-posterior")
    assert list(summary["tensors"]) == list(posterior.names)
    assert summary["files"] == {
        f: len(files[f]) for f in ("evon_posterior.safetensors", "evon_posterior_config.json")
    }
    assert (
        "hf-evon inspect: error: location 'alice/no-such-repo' is not a local directory, so it was looked up "
        "on the Hugging Face Hub, which failed:" in err
    )


@pytest.mark.parametrize("then_cached", [False, True])
@pytest.mark.parametrize("revision, subfolder", [(None, None), ("v2", "post")])
def test_inspect_sizes_the_hub_files_it_loaded_not_those_of_a_later_push(
    saved, tmp_path, monkeypatch, capsys, revision, subfolder, then_cached
):
    """inspect sized a Hub posterior's files by downloading them again at --revision: a push landing
    after the load (here: the same posterior again, its bases in bfloat16) had it print the new
    files' sizes beside the loaded posterior's tensors. The sizes are those of the files it loaded.
    Looked up again in the Hub cache at --revision, they were those of the push where another
    process downloaded it meanwhile (then_cached: the cache's ref for --revision moved on)."""
    from huggingface_hub import hf_hub_download

    try:
        from hub_stub import HubStub
    except ImportError:  # tests/ imported as a package
        from tests.hub_stub import HubStub
    _, _, _, posterior = saved
    where = {"revision": revision, "path_in_repo": subfolder}
    options = ["--revision", revision, "--subfolder", subfolder] if revision else []
    names = ("evon_posterior.safetensors", "evon_posterior_config.json")
    in_repo = {f: f"{subfolder}/{f}" if subfolder else f for f in names}
    load = EVONPosterior.from_pretrained.__func__

    def loaded_then_pushed(cls, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        loaded = load(cls, *args, **kwargs)
        loaded.push_to_hub("alice/moving", token="hf_dummy", eigenbasis_dtype=torch.bfloat16, **where)
        if then_cached:  # another process downloads the push into the cache
            for name in names:
                hf_hub_download("alice/moving", name, subfolder=subfolder, revision=revision)
        return loaded

    with HubStub() as hub:
        posterior.push_to_hub("alice/moving", token="hf_dummy", endpoint=hub.endpoint, **where)
        loaded = hub.files("alice/moving", revision or "main")
        _hub_at(monkeypatch, tmp_path, hub.endpoint)
        monkeypatch.setattr(EVONPosterior, "from_pretrained", classmethod(loaded_then_pushed))
        code = main(["inspect", "alice/moving", "--json", *options])
        pushed = hub.files("alice/moving", revision or "main")
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    weights = in_repo[names[0]]
    assert len(pushed[weights]) < len(loaded[weights])  # the later push's files differ in size
    assert json.loads(out)["files"] == {f: len(loaded[in_repo[f]]) for f in names}


@pytest.mark.parametrize("flag, value, rule", [
    ("--temperature", "0", "a finite number > 0"), ("--temperature", "nan", "a finite number > 0"),
    ("--top-k", "-3", "an integer >= 0"), ("--top-p", "2", "a number in (0, 1]"), ("--top-p", "0", "a number in (0, 1]"),
    ("--repetition-penalty", "0", "a finite number > 0"),
])  # fmt: skip
def test_a_sampling_option_out_of_range_is_a_usage_error(saved, flag, value, rule, capsys):
    """generate's sampling options were plain float/int: --temperature 0 failed in transformers
    (exit 1) and --top-p 2 was accepted, where a wrong argument is a usage error (exit 2)."""
    path, *_ = saved
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(path), "--prompt", "def", "--do-sample", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: wants {rule}; got '{value}'" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--temperature", "0.7"), ("--top-k", "5"), ("--top-p", "0.9")])
def test_a_sampling_option_without_do_sample_is_a_usage_error(saved, flag, value, capsys):
    """--temperature, --top-k or --top-p without --do-sample decoded greedily with exit status 0, the
    option dropped (transformers only warns that it "may be ignored"). A usage error naming it."""
    path, *_ = saved
    assert main(["generate", "--model", str(path), "--prompt", "def", flag, value]) == 2
    assert f"{flag} applies to sampling only: add --do-sample" in capsys.readouterr().err


def test_a_block_too_short_to_score_is_a_usage_error(saved, tmp_path, capsys):
    """--block-size 1 leaves a causal LM no target: it failed after the model loaded, exit code 1."""
    path, *_ = saved
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return x\n" * 6)
    argv = ["calibrate", "--model", str(path), "--text", str(text), "--output", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--block-size", "1"])
    assert exit_.value.code == 2
    assert "argument --block-size: wants an integer >= 2; got '1'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _calibrate_and_reference(argv, capsys, model, tokenizer, posterior, text):
    """Runs ``hf-evon calibrate`` (``argv``) with 16-token blocks and 2 samples; returns what it printed,
    the text's 16-token blocks in batches of 8, and calibrate_posterior's result on them."""
    from hf_evon.predictive.calibration import calibrate_posterior

    assert main([*argv, "--block-size", "16", "--samples", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    ids = tokenizer(text.read_text(), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    n = len(ids) // 16
    rows = ids[: n * 16].view(n, 16)
    batches = [{"input_ids": rows[i : i + 8], "labels": rows[i : i + 8]} for i in range(0, n, 8)]
    _, expected = calibrate_posterior(model, posterior, batches, num_samples=2, seed=0, shift_labels=True)
    return printed, batches, expected


def test_calibrate_saves_the_scale_that_calibrate_posterior_chooses(saved, tmp_path, capsys):
    """``hf-evon calibrate`` = calibrate_posterior on the text's blocks; generate then uses it."""
    from hf_evon.predictive.calibration import calibrate_posterior

    path, model, tokenizer, posterior = saved
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return [y * 2 for y in x if y]\n" * 6)
    out = tmp_path / "calibrated"
    argv = ["calibrate", "--model", str(path), "--text", str(text), "--output", str(out)]
    printed, batches, expected = _calibrate_and_reference(argv, capsys, model, tokenizer, posterior, text)
    assert printed["nll"] == pytest.approx(expected.nll, rel=1e-9)
    assert printed["mean_nll"] == pytest.approx(expected.mean_nll, rel=1e-9)
    loaded = EVONPosterior.from_pretrained(out)
    assert loaded.ess == expected.ess and loaded.config["calibration"]["nll"] == pytest.approx(expected.nll)
    assert printed["standard_errors"] == 0.5 and printed["min_gain"] == 0.01
    assert printed["chosen_nll"] == pytest.approx(expected.chosen_nll)
    assert printed["mean_temperature"] == expected.mean_temperature  # the mean's held-out temperature
    # --min-gain and --standard-errors reach the rule (0 and 0: the lowest NLL)
    extra = ["--standard-errors", "0", "--min-gain", "0"]
    assert main([*argv, "--block-size", "16", "--samples", "2", "--json", *extra]) == 0
    printed = json.loads(capsys.readouterr().out)
    _, argmin = calibrate_posterior(
        model, posterior, batches, num_samples=2, seed=0, shift_labels=True, standard_errors=0, min_gain=0
    )
    assert printed["min_gain"] == 0.0 and printed["chosen_nll"] == pytest.approx(argmin.chosen_nll)
    mean = argmin.mean_nll if argmin.tempered_mean_nll is None else argmin.tempered_mean_nll
    # the candidates: the mean, each scanned scale and the trained posterior (scored apart: trained_nll)
    trained = [] if argmin.trained_nll is None else [argmin.trained_nll]
    assert printed["chosen_nll"] == pytest.approx(min([mean, *argmin.nll, *trained]))
    assert printed["temperature"] == argmin.temperature  # each scale at its own temperature
    # --no-temperature scores every scale at T = 1
    assert main([*argv, "--block-size", "16", "--samples", "2", "--json", *extra, "--no-temperature"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["temperature"] == 1.0 and printed["temperatures"] == []
    assert printed["chosen_nll"] == pytest.approx(min([argmin.mean_nll, *printed["nll"]]))
    assert EVONPosterior.from_pretrained(out).temperature == 1.0
    assert main([*argv, "--block-size", "16", "--samples", "2", "--json", "--standard-errors", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["standard_errors"] == 3.0
    # --no-keep-trained reaches the rule: the trained posterior is not scored against the mean
    assert main([*argv, "--block-size", "16", "--samples", "2", "--json", "--no-keep-trained"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["keep_trained"] is False and printed["trained_nll"] is None
    assert main([*argv, "--block-size", "16", "--samples", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["keep_trained"] is True
    # --screen-factor reaches the rule: 1e6 screens out every scale, 0 none
    scan = ["--block-size", "16", "--samples", "2", "--json", "--always-scan", "--screen-factor"]
    assert main([*argv, *scan, "1e6"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["screen_factor"] == 1e6 and printed["grid"] == [] and len(printed["screened"]) == 9
    assert main([*argv, *scan, "0"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["screen_factor"] == 0.0 and printed["screened"] == [] and len(printed["grid"]) > 0
    with pytest.raises(SystemExit) as refused:
        main([*argv, "--screen-factor", "-1"])
    assert refused.value.code == 2 and "--screen-factor" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        main([*argv, "--standard-errors", "-1"])
    assert refused.value.code == 2 and "--standard-errors" in capsys.readouterr().err
    for bad in ("1", "-0.1", "nan"):
        with pytest.raises(SystemExit) as refused:
            main([*argv, "--min-gain", bad])
        assert refused.value.code == 2 and "--min-gain" in capsys.readouterr().err
    # a missing text file is a usage error, not a traceback
    assert main([*argv[:-4], "--text", str(tmp_path / "nope.txt"), "--output", str(out)]) == 2
    assert "is not a file" in capsys.readouterr().err


# ----------------------------------------------------------------------------- files that do not load
def _copy_of(saved, tmp_path):
    path = saved[0]
    target = tmp_path / "copy"
    shutil.copytree(path, target)
    return target


def _nested_json(path, depth: int = 100_000) -> None:
    text = path.read_text().rstrip()
    path.write_text(text[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}")


def _evil_pickle(directory) -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("UNPICKLED-CODE-RAN",))

    os.remove(directory / "model.safetensors")
    torch.save({"x": Evil()}, directory / "pytorch_model.bin")


def test_a_refused_pickle_is_named_without_torchs_advice(saved, tmp_path, capsys):
    """A model whose pytorch_model.bin holds a pickle that would run code was reported with torch's
    first line, "This file can still be loaded ... if you trust the source", naming no file. The
    error names the file and the global the unpickler met, and gives no advice to load it anyway."""
    directory = _copy_of(saved, tmp_path)
    _evil_pickle(directory)
    code = main(["generate", "--model", str(directory), "--prompt-ids", "5 6", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 1
    line = next(line for line in err.splitlines() if "error:" in line)
    assert str(directory / "pytorch_model.bin") in line and "Unsupported global: GLOBAL print" in line, line
    assert "can still be loaded" not in line and "weights_only=False" not in line, line


@pytest.mark.parametrize(
    "fault, message",
    [
        ("truncated", "a safetensors file could not be read"),
        ("deep_model_config", "nests too deeply"),
        ("pickle", "pytorch_model.bin: refusing to load it"),
        ("deep_posterior_config", "evon_posterior_config.json: the config nests"),
    ],
)
def test_a_file_that_does_not_load_is_one_error_line(saved, tmp_path, capsys, fault, message):
    """Issue 33 item 13: no traceback, one line naming what failed, exit code 1."""
    directory = _copy_of(saved, tmp_path)
    if fault == "truncated":
        weights = directory / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif fault == "deep_model_config":
        _nested_json(directory / "config.json")
    elif fault == "pickle":
        _evil_pickle(directory)
    else:
        _nested_json(directory / "evon_posterior_config.json")
    code = main(["generate", "--model", str(directory), "--prompt-ids", "5 6", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 1
    lines = [
        line for line in err.splitlines() if line.strip() and "Loading weights" not in line
    ]  # progress bars
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("hf-evon generate: error:") and message in lines[0], err
    assert str(directory) in lines[0] and "UNPICKLED-CODE-RAN" not in out + err


def test_a_full_disk_while_calibrating_is_one_error_line(saved, tmp_path, capsys, monkeypatch):
    import errno

    from safetensors import SafetensorError

    import hf_evon.posterior.format as format_module

    path = saved[0]
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return [y * 2 for y in x if y]\n" * 6)
    argv = ["calibrate", "--model", str(path), "--text", str(text), "--output", str(tmp_path / "out")]
    argv += ["--block-size", "16", "--samples", "2", "--max-blocks", "2"]
    for failure in (
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
        OSError(errno.ENOSPC, "No space left on device"),
    ):

        def full(*args, _failure=failure, **kwargs):
            raise _failure

        monkeypatch.setattr(format_module, "save_file", full)
        assert main(argv) == 1
        err = capsys.readouterr().err
        lines = [
            line for line in err.splitlines() if line.strip() and "Loading weights" not in line
        ]  # progress bars
        assert "Traceback" not in err and len(lines) == 1, err
        assert "--output" in lines[0] and "No space left on device" in lines[0], lines


def test_inspect_a_directory_whose_first_save_was_killed_after_the_switch(saved, tmp_path, capsys):
    """Item 4: the config names the staged weights (the canonical file was never written); it
    loads, so inspect reports it, with the file the config names."""
    posterior = saved[3]
    directory = tmp_path / "first"
    posterior.save_pretrained(directory)
    config = json.loads((directory / "evon_posterior_config.json").read_text())
    staged = f"evon_posterior.{config['checkpoint_id']}.safetensors"
    os.rename(directory / "evon_posterior.safetensors", directory / staged)
    config["weights_file"] = staged
    (directory / "evon_posterior_config.json").write_text(json.dumps(config))
    assert EVONPosterior.from_pretrained(directory).names == posterior.names
    assert main(["inspect", str(directory), "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert files[staged] == (directory / staged).stat().st_size and "evon_posterior.safetensors" not in files


@pytest.mark.parametrize("command", ["generate", "calibrate"])
def test_ctrl_c_is_one_line_and_exit_130(saved, tmp_path, capsys, monkeypatch, command):
    """Issue 33 item 12: Ctrl-C in ``hf-evon generate``/``calibrate`` printed a traceback."""
    import hf_evon.predictive.calibration as calibration
    import hf_evon.predictive.generation as generation

    path = saved[0]
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return [y * 2 for y in x if y]\n" * 6)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    if command == "generate":  # the commands import these when they run
        monkeypatch.setattr(generation, "generate_bma", interrupted)
    else:
        monkeypatch.setattr(calibration, "calibrate_posterior", interrupted)
    argv = ["generate", "--model", str(path), "--prompt", "def ", "--samples", "2", "--max-new-tokens", "2"]
    if command == "calibrate":
        argv = ["calibrate", "--model", str(path), "--text", str(text), "--output", str(tmp_path / "out")]
        argv += ["--block-size", "16", "--samples", "2", "--max-blocks", "2"]
    assert main(argv + ["--device", "cpu"] if command == "generate" else argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().endswith("hf-evon " + command + ": interrupted"), err
    assert not (tmp_path / "out").exists()


def test_calibrate_refuses_an_encoder_decoder_model(saved_seq2seq, tmp_path, capsys):
    """``calibrate --text`` scores a causal LM's continuations: an encoder-decoder would score the
    text as a copy of itself. A usage error, and nothing written."""
    path, *_ = saved_seq2seq
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return x\n" * 6)
    out = tmp_path / "calibrated"
    assert main(["calibrate", "--model", str(path), "--text", str(text), "--output", str(out)]) == 2
    assert "is an encoder-decoder model: calibrate scores --text as a causal LM's" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("context", ["absent", None])
def test_calibrate_takes_the_block_size_where_the_config_states_no_context(tmp_path, capsys, context):
    """A config without ``max_position_embeddings`` (Mamba's), or with it None, bounds no block:
    ``min(--block-size, None)`` raised TypeError ('<' not supported between 'NoneType' and 'int')."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    extra = {} if context == "absent" else {"max_position_embeddings": None}
    config = MambaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, state_size=4, **extra)
    model = MambaForCausalLM(config)
    assert getattr(model.config, "max_position_embeddings", "absent") == context
    posterior = trained_posterior(model, len(tokenizer), lambda x: x)
    path = tmp_path / "mamba"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    posterior.save_pretrained(path)
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return [y * 2 for y in x if y]\n" * 3)
    argv = ["calibrate", "--model", str(path), "--text", str(text), "--output", str(tmp_path / "out")]
    printed, _, expected = _calibrate_and_reference(argv, capsys, model, tokenizer, posterior, text)
    assert printed["mean_nll"] == pytest.approx(expected.mean_nll, rel=1e-9)
    assert printed["nll"] == pytest.approx(expected.nll, rel=1e-9)


def test_an_adapter_that_names_no_base_model_is_a_usage_error(saved, tmp_path, capsys):
    """PEFT writes ``base_model_name_or_path: null`` for a model built from a config: loading then
    looked up a Hub repo named 'None', retrying for half a minute before an OSError."""
    from peft import LoraConfig, get_peft_model

    path, model, *_ = saved
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    lora.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    argv = ["generate", "--model", str(tmp_path), "--posterior", str(path), "--prompt-ids", "5 9", "--device", "cpu"]
    assert main(argv) == 2
    assert "names no base model (base_model_name_or_path is empty)" in capsys.readouterr().err


def test_the_calibrate_help_and_the_uncalibrated_card_state_the_calibrations_defaults(capsys) -> None:
    """Both say the calibration's margin in words (they cannot import it: the help is built without
    the calibration module, the card sits below it), so they are held to the constants here."""
    from hf_evon.posterior.model_card import _calibration_text
    from hf_evon.predictive.calibration import DEFAULT_MIN_GAIN, DEFAULT_STANDARD_ERRORS

    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert f"DEFAULT_STANDARD_ERRORS, {DEFAULT_STANDARD_ERRORS:g};" in shown
    assert f"DEFAULT_MIN_GAIN, {DEFAULT_MIN_GAIN:g})" in shown
    words = {0.5: "half a standard error", 1.0: "a standard error"}[DEFAULT_STANDARD_ERRORS]
    assert f"by more than {words} or {100 * DEFAULT_MIN_GAIN:g}%" in _calibration_text({})


def test_inspect_prints_a_files_control_characters_escaped(saved, tmp_path, capsys):
    """A config from anyone holds strings ``inspect`` prints: a terminal's escape sequences and
    line breaks in them are shown escaped, not acted on (before: the screen cleared, a forged line)."""
    target = _copy_of(saved, tmp_path)
    config_path = target / "evon_posterior_config.json"
    config = json.loads(config_path.read_text())
    config["model_class"] = "\x1b[2J\x1b[31mFAKE\x1b[0m"
    config["library_version"] = "0.1\nInjected line"
    config_path.write_text(json.dumps(config))
    assert main(["inspect", str(target)]) == 0
    text = capsys.readouterr().out
    assert "\x1b" not in text and "\nInjected line" not in text
    assert "model \\x1b[2J\\x1b[31mFAKE\\x1b[0m (base" in text and "hf-evon 0.1\\nInjected line;" in text


def test_a_continuation_keeps_the_space_a_sentencepiece_tokenizer_puts_before_it(tmp_path, capsys):
    """Llama-style tokenizers (Metaspace) mark a word's leading space in its token, which decoding
    the new tokens alone drops: the completion is the full sequence's text after the prompt's
    (before: "Hello worldcat cat cat")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁cat": 3, "</s>": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=5, n_positions=32, eos_token_id=None))
    posterior = trained_posterior(model, 5, lambda x: x)
    with torch.no_grad():  # the final layer norm (a point estimate) makes every next token "▁cat"
        model.transformer.ln_f.weight.zero_()
        cat = model.transformer.wte.weight[3]
        model.transformer.ln_f.bias.copy_(50 * cat / cat.norm())
    model.save_pretrained(tmp_path)
    posterior.save_pretrained(tmp_path)
    argv = ["generate", "--model", str(tmp_path), "--prompt", "Hello world", "--max-new-tokens", "3", "--samples", "2"]
    assert main(argv) == 0
    assert capsys.readouterr().out == "Hello world cat cat cat\n"
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["completion"] == " cat cat cat"


def test_calibrate_checks_its_output_before_the_calibration(saved, tmp_path, capsys, monkeypatch):
    """An --output that cannot be a directory is a usage error before any pass (before: after the
    whole calibration)."""
    import hf_evon.predictive.calibration as calibration

    monkeypatch.setattr(calibration, "calibrate_posterior", lambda *a, **k: pytest.fail("calibrated first"))
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return x\n" * 6)
    taken = tmp_path / "README.md"
    taken.write_text("a file")
    for output in (taken, taken / "inside"):
        argv = ["calibrate", "--model", str(saved[0]), "--text", str(text), "--output", str(output)]
        assert main([*argv, "--block-size", "8"]) == 2
        assert "is a file, not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("base", ["./moved/away", "moved-away"])
def test_an_adapters_missing_base_model_is_named_as_the_adapters(saved, tmp_path, capsys, monkeypatch, base):
    """An adapter whose base model (``base_model_name_or_path``) is not here: a path-like one was
    reported as huggingface_hub's "Repo id must be in the form ...", a bare name was looked up on
    an unreachable Hub with five retries (~50 s), and neither message named the adapter's config."""

    from peft import LoraConfig, get_peft_model

    path, model, *_ = saved
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    lora.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}))
    port = _unreachable_hub(monkeypatch, tmp_path)
    argv = ["generate", "--model", str(tmp_path), "--posterior", str(path), "--prompt-ids", "5 9", "--device", "cpu"]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == (2 if base.startswith(".") else 1), err
    line = err.strip().splitlines()[-1]
    assert f"base_model_name_or_path in {str(tmp_path / 'adapter_config.json')!r}" in line, line
    assert repr(base) in line and "Repo id must be" not in line, line
    if code == 1:
        assert f"looked up on the Hugging Face Hub, which failed: http://127.0.0.1:{port} cannot be reached" in line


def test_a_text_file_that_is_not_utf8_is_a_usage_error_naming_it(saved, tmp_path, capsys, monkeypatch):
    """--text in another encoding: the model was loaded first, then the error was Python's bare
    "'utf-8' codec can't decode byte 0xff in position 3" with no file named, exit code 1."""
    import hf_evon.cli.commands as commands

    monkeypatch.setattr(commands, "load_model_posterior_tokenizer", lambda *a: pytest.fail("model loaded first"))
    text = tmp_path / "latin1.txt"
    text.write_bytes("déf x\n".encode("latin-1") * 20)
    argv = ["calibrate", "--model", str(saved[0]), "--text", str(text), "--output", str(tmp_path / "out")]
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"--text {str(text)!r} is not UTF-8 text (byte 0xe9 at offset 1)" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["generate", "calibrate"])
def test_tokenizer_files_that_do_not_load_are_not_reported_as_missing(saved, tmp_path, capsys, command):
    """An empty (or cut) tokenizer.json beside the model: the load error was swallowed and the
    command said "--model ... has no tokenizer files" (generate with --prompt-ids printed bare ids)."""
    directory = _copy_of(saved, tmp_path)
    (directory / "tokenizer.json").write_text("")
    if command == "generate":
        argv = ["generate", "--model", str(directory), "--prompt-ids", "5 9", "--max-new-tokens", "2"]
    else:
        text = tmp_path / "held_out.txt"
        text.write_text("def held_out(x):\n    return x\n" * 6)
        argv = ["calibrate", "--model", str(directory), "--text", str(text), "--output", str(tmp_path / "out")]
    assert main([*argv, "--device", "cpu"]) == 1
    out, err = capsys.readouterr()
    line = err.strip().splitlines()[-1]
    assert out == "" and "has no tokenizer files" not in err, err
    assert line.startswith(f"hf-evon {command}: error: --model {str(directory)!r}: its tokenizer files "), line
    assert "(tokenizer.json, tokenizer_config.json) do not load (JSONDecodeError: Expecting value" in line, line


@pytest.mark.parametrize("broken", [("tokenizer.json",), ("tokenizer.json", "tokenizer_config.json")])
def test_a_tokenizer_file_that_is_a_link_to_nothing_is_refused_naming_it(saved, tmp_path, capsys, broken):
    """Tokenizer files beside the model that are links to nothing (a copied Hub cache snapshot whose blobs
    are gone): os.path.isfile took them for none, so the command went on without a tokenizer (bare ids
    printed) or loaded the files left without the broken tokenizer.json. The error names the file."""
    directory = _copy_of(saved, tmp_path)
    for name in broken:
        (directory / name).unlink()
        (directory / name).symlink_to(tmp_path / "moved-away")
    argv = ["generate", "--model", str(directory), "--prompt-ids", "5 9", "--max-new-tokens", "2", "--device", "cpu"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    file = str(directory / "tokenizer.json")
    why = f"a link to {str(tmp_path / 'moved-away')!r}, which does not exist"
    assert out == "" and err.splitlines()[-1] == f"hf-evon generate: error: --model {str(directory)!r}: {file!r} is {why}", err


def test_calibrate_refuses_an_output_it_cannot_write_before_the_calibration(saved, tmp_path, capsys, monkeypatch):
    """An --output in a directory this user cannot write: the whole calibration ran and its result
    was lost at the save ("cannot save the calibrated posterior (Permission denied)"). The check
    asks ``os.access`` (root passes any mode bits, so the test stands in for the permission)."""
    import hf_evon.predictive.calibration as calibration

    monkeypatch.setattr(calibration, "calibrate_posterior", lambda *a, **k: pytest.fail("calibrated first"))
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: os.fspath(p) != str(read_only) and access(p, mode, **k))
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return x\n" * 6)
    for output in (read_only, read_only / "new" / "run"):
        argv = ["calibrate", "--model", str(saved[0]), "--text", str(text), "--output", str(output)]
        assert main([*argv, "--block-size", "8", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert f"--output {str(output)!r}: {str(read_only)!r} is a directory this user cannot write in" in err, err


@pytest.mark.parametrize("kind", ["dangling link", "loop"])
def test_calibrate_refuses_an_output_under_a_link_that_reaches_nothing_before_the_calibration(
    saved, tmp_path, capsys, monkeypatch, kind
):
    """An --output that is, or lies under, a link to nothing (a disk not mounted) or a loop of links:
    os.path.exists took the link for missing, so the check went up to the directory holding it, the whole
    calibration ran, and the save failed on the link (os.makedirs). It is a usage error naming the link
    and what it is, before any pass."""
    import hf_evon.predictive.calibration as calibration

    monkeypatch.setattr(calibration, "calibrate_posterior", lambda *a, **k: pytest.fail("calibrated first"))
    link = tmp_path / "out"
    target = link if kind == "loop" else tmp_path / "moved-away"
    link.symlink_to(target)
    why = "leads into a loop of links (ELOOP)" if kind == "loop" else "does not exist"
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return x\n" * 6)
    for output in (link, link / "run"):
        argv = ["calibrate", "--model", str(saved[0]), "--text", str(text), "--output", str(output)]
        assert main([*argv, "--block-size", "8", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert f"--output {str(output)!r}: {str(link)!r} is a link to {str(target)!r}, which {why}" in err, err


@pytest.mark.parametrize("kind", ["directory", "dangling link"])
def test_a_posterior_directory_whose_config_is_no_file_as_model_says_so(saved, tmp_path, capsys, kind):
    """--model given a posterior's directory whose config is a directory or a link to nothing: it was
    taken for a directory without a posterior (no hint), where loading the posterior names the file."""
    posterior_dir = tmp_path / "calibrated"
    saved[3].save_pretrained(posterior_dir)
    config = posterior_dir / "evon_posterior_config.json"
    config.unlink()
    config.mkdir() if kind == "directory" else config.symlink_to(tmp_path / "moved-away")
    assert main(["generate", "--model", str(posterior_dir), "--prompt-ids", "5 9", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        f"hf-evon generate: error: --model {str(posterior_dir)!r} holds no config.json (nor a PEFT adapter's "
        "adapter_config.json): it holds an EVON posterior; pass it as --posterior, and the model's directory or "
        "Hub repo id as --model"
    ), err


@pytest.mark.parametrize("command", ["generate", "calibrate"])
def test_a_posterior_only_directory_as_model_says_so(saved, tmp_path, capsys, command):
    """--model given calibrate's --output (a posterior, no model): the error was transformers'
    "Unrecognized model in ... Should have a `model_type` key in its config.json", a config.json
    the directory does not have."""
    posterior_dir = tmp_path / "calibrated"
    saved[3].save_pretrained(posterior_dir)
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return x\n" * 6)
    rest = ["--prompt-ids", "5 9"] if command == "generate" else ["--text", str(text), "--output", str(tmp_path / "o")]
    assert main([command, "--model", str(posterior_dir), *rest, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert (
        f"--model {str(posterior_dir)!r} holds no config.json (nor a PEFT adapter's adapter_config.json): "
        "it holds an EVON posterior; pass it as --posterior, and the model's directory or Hub repo id as --model"
    ) in err, err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([command, "--model", str(empty), *rest, "--device", "cpu"]) == 2
    assert f"--model {str(empty)!r} holds no config.json (nor a PEFT adapter's adapter_config.json)\n" in (
        capsys.readouterr().err
    )


def test_an_encoder_decoder_without_a_tokenizer_prints_the_decoders_ids_alone(saved_seq2seq, tmp_path, capsys):
    """Without a tokenizer the ids printed were the encoder's prompt followed by the decoder's
    output, one line that reads as a continuation; the output is the decoder's, as with text."""
    path, model, _, posterior = saved_seq2seq
    model.save_pretrained(tmp_path)  # no tokenizer here
    posterior.save_pretrained(tmp_path)
    argv = ["generate", "--model", str(tmp_path), "--samples", "2", "--max-new-tokens", "5", "--seed", "3"]
    assert main([*argv, "--prompt-ids", "5 9 17", "--device", "cpu"]) == 0
    printed = [int(t) for t in capsys.readouterr().out.split()]
    expected = generate_bma(
        model, posterior, torch.tensor([[5, 9, 17]]), attention_mask=torch.ones(1, 3, dtype=torch.long),
        num_samples=2, seed=3, max_new_tokens=5, do_sample=False, pad_token_id=1,
    )  # fmt: skip
    assert printed == expected[0, 1:].tolist()


def test_running_out_of_memory_is_one_error_line(saved, capsys, monkeypatch):
    """Too many --samples for the memory: a RuntimeError traceback (CPU allocator, or CUDA's
    torch.OutOfMemoryError) where the module promises an error line; other RuntimeErrors still
    raise (a bug keeps its traceback)."""
    import hf_evon.predictive.generation as generation

    argv = ["generate", "--model", str(saved[0]), "--prompt-ids", "5 9", "--max-new-tokens", "2", "--device", "cpu"]
    assert main([*argv, "--samples", str(10**9)]) == 1  # S x the covered weights: terabytes
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "Loading weights" not in line]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("hf-evon generate: error: out of memory (") and "can't allocate memory" in lines[0]
    assert "use fewer --samples" in lines[0], lines[0]

    def cuda_oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB.\nmore advice")

    monkeypatch.setattr(generation, "generate_bma", cuda_oom)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "hf-evon generate: error: out of memory (CUDA out of memory. Tried to allocate 20.00 GiB.): " in err
    from hf_evon.cli.loading import failure_text

    assert failure_text(RuntimeError("shape mismatch")) is None


@pytest.mark.parametrize("command", ["generate", "calibrate"])
def test_a_model_without_a_language_modelling_head_is_refused(tmp_path, capsys, command):
    """A masked LM (BertForMaskedLM) loaded as AutoModelForCausalLM becomes a BertLMHeadModel whose
    attention still sees the following tokens: generate printed text and calibrate saved a scale
    chosen on it (its "next-token" NLL scored a model that reads the token it predicts)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    model = BertForMaskedLM(config)
    posterior = trained_posterior(model, len(tokenizer), lambda x: x)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    posterior.save_pretrained(tmp_path)
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return x\n" * 6)
    rest = ["--prompt", "ab"] if command == "generate" else ["--text", str(text), "--output", str(tmp_path / "o")]
    assert main([command, "--model", str(tmp_path), *rest, "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not (tmp_path / "o").exists()
    assert (
        f"--model {str(tmp_path)!r} is a BertForMaskedLM (config.json's architectures), not a causal LM or an "
        "encoder-decoder LM"
    ) in err, err


def test_a_speech_to_text_model_or_its_adapter_is_refused_naming_what_is_supported(tmp_path, capsys):
    """generate and calibrate run models that read token ids. A WhisperForConditionalGeneration (and a
    LoRA adapter of one) was refused as "not a causal LM or an encoder-decoder LM" that lacked "a
    language-modelling head": Whisper is an encoder-decoder LM with one, reading audio features, not token ids.
    ``inspect``, which loads no model, summarises its posterior."""
    from peft import LoraConfig, get_peft_model
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=40, num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=16,
        max_target_positions=32, pad_token_id=1, bos_token_id=0, eos_token_id=1, decoder_start_token_id=2,
    )  # fmt: skip
    base, adapter = tmp_path / "whisper", tmp_path / "adapter"
    model = WhisperForConditionalGeneration(config)
    model.save_pretrained(base)
    EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, **plain_evon()), model).save_pretrained(base)
    lora = get_peft_model(WhisperForConditionalGeneration.from_pretrained(base), LoraConfig(r=2, target_modules=["q_proj"]))
    lora.save_pretrained(adapter)
    EVONPosterior.from_optimizer(hf_evon.build_optimizer(lora, **plain_evon()), lora).save_pretrained(adapter)
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return x\n" * 6)
    for path, option in ((base, "--model"), (adapter, "the base model")):
        assert main(["inspect", str(path), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["model_class"] == "WhisperForConditionalGeneration"
        for rest in (["generate", "--prompt-ids", "5 6"], ["calibrate", "--text", str(text), "--output", str(tmp_path / "o")]):
            assert main([rest[0], "--model", str(path), *rest[1:], "--device", "cpu"]) == 2
            out, err = capsys.readouterr()
            assert out == "" and not (tmp_path / "o").exists()
            assert f"{option} " in err and (
                f"{str(base)!r} is a WhisperForConditionalGeneration (config.json's architectures), a speech-to-text "
                "model (AutoModelForSpeechSeq2Seq), which reads audio features, not token ids alone: generate and "
                "calibrate run causal LMs (AutoModelForCausalLM), text encoder-decoders (AutoModelForSeq2SeqLM) and "
                "PEFT adapters of them; decode it from Python with hf_evon.generate_bma, passing its input by the "
                "model's name for it"
            ) in err, err


def test_calibrate_tokenizes_only_the_text_its_blocks_use(saved, tmp_path, monkeypatch, capsys):
    """calibrate read and tokenized the whole --text file though it scores at most --max-blocks
    blocks: on a large file that took minutes and the file's size in memory several times over.
    It tokenizes a prefix of the file, and the blocks are the first ones the whole file's tokens give."""
    import hf_evon.cli.commands as commands
    from hf_evon.predictive import calibration

    path, _, tokenizer, _ = saved
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return [y * 2 for y in x if y]\n" * 8000)
    tokenized: list[int] = []
    scored: list[list[torch.Tensor]] = []
    load, calibrate = commands.load_model_posterior_tokenizer, calibration.calibrate_posterior

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, value, *args, **kwargs):
            tokenized.append(len(value))
            return self.inner(value, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    def loaded(*args):
        model, posterior, tok = load(*args)
        return model, posterior, Recording(tok)

    def calibrated(model, posterior, batches, **kwargs):
        scored.append([b["input_ids"] for b in batches])
        return calibrate(model, posterior, batches, **kwargs)

    monkeypatch.setattr(commands, "load_model_posterior_tokenizer", loaded)
    monkeypatch.setattr(calibration, "calibrate_posterior", calibrated)
    argv = ["calibrate", "--model", str(path), "--text", str(text), "--output", str(tmp_path / "out")]
    assert main([*argv, "--block-size", "16", "--max-blocks", "3", "--batch-size", "2", "--samples", "2"]) == 0
    whole = tokenizer(text.read_text(), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    assert len(scored) == 1 and [b.shape[0] for b in scored[0]] == [2, 1]
    assert torch.equal(torch.cat(scored[0]).flatten(), whole[: 3 * 16])
    assert tokenized and max(tokenized) <= len(whole) // 4, (tokenized, len(whole))


def test_the_tokens_of_a_prefix_are_the_whole_texts_also_where_a_character_is_cut(saved, tmp_path, monkeypatch):
    """text_tokens reads growing prefixes: one that ends inside a two-byte character is read up to
    it, and one too short for the tokens wanted is read longer, so the ids are the whole file's."""
    import hf_evon.cli.loading as loading

    tokenizer = saved[2]
    text = tmp_path / "text.txt"
    text.write_text("déf x(é):\n" * 40, encoding="utf-8")
    whole = tokenizer(text.read_text(encoding="utf-8"), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    monkeypatch.setattr(loading, "TEXT_CHUNK_BYTES", 5)  # "déf x": 'é' is bytes 1-2, the cut at 5 is after 'x'
    monkeypatch.setattr(loading, "BYTES_PER_TOKEN", 1)
    monkeypatch.setattr(loading, "TOKEN_MARGIN", 3)
    assert loading.read_text(str(text), "--text", 2) == ("d", False)  # 'é' cut after its first byte: left out
    for count in (1, 7, 30, len(whole), len(whole) + 5):
        assert torch.equal(loading.text_tokens(str(text), "--text", tokenizer, count), whole[:count]), count


def test_calibrate_saves_a_posterior_calibrated_with_a_negative_seed(saved, tmp_path, capsys):
    """--seed takes any integer, as calibrate_posterior and sampling do, but the saved config's rule
    refused a negative calibration seed: --seed -5 ran the whole calibration, then failed at the save
    with "field 'calibration.seed' must be an integer >= 0", exit code 1, and nothing saved."""
    from hf_evon.predictive.calibration import calibrate_posterior

    path, model, tokenizer, posterior = saved
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return [y * 2 for y in x if y]\n" * 6)
    out = tmp_path / "calibrated"
    argv = ["calibrate", "--model", str(path), "--text", str(text), "--output", str(out)]
    code = main([*argv, "--block-size", "16", "--max-blocks", "2", "--samples", "2", "--seed", "-5", "--json"])
    assert code == 0, capsys.readouterr().err
    ids = tokenizer(text.read_text(), add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    batches = [{"input_ids": ids[:32].view(2, 16), "labels": ids[:32].view(2, 16)}]
    _, expected = calibrate_posterior(model, posterior, batches, num_samples=2, seed=-5, shift_labels=True)
    loaded = EVONPosterior.from_pretrained(out)
    assert loaded.config["calibration"]["seed"] == -5 and json.loads(capsys.readouterr().out)["seed"] == -5
    assert loaded.ess == expected.ess and loaded.config["calibration"]["mean_nll"] == expected.mean_nll


def refused_outputs(model, text, outputs, capsys, monkeypatch) -> dict:
    """``calibrate --model model --output DIR`` for each DIR of ``outputs``: a usage error (2) before any
    pass, DIR's files as they were; each DIR's (stdout, stderr)."""
    import hf_evon.predictive.calibration as calibration

    calibrate = calibration.calibrate_posterior
    monkeypatch.setattr(calibration, "calibrate_posterior", lambda *a, **k: pytest.fail("calibrated first"))
    said = {}
    for output in outputs:
        before = directory_state(output)
        argv = ["calibrate", "--model", str(model), "--text", str(text), "--output", str(output)]
        assert main([*argv, "--block-size", "16", "--max-blocks", "2", "--samples", "2"]) == 2, output
        said[output] = capsys.readouterr()
        assert directory_state(output) == before, output
    monkeypatch.setattr(calibration, "calibrate_posterior", calibrate)
    return said


def assert_calibrated_into(output, capsys, *argv: str) -> None:
    """``calibrate ARGV --output output --json`` saves there the posterior it reports."""
    argv = ["calibrate", *argv, "--output", str(output), "--json", "--block-size", "16", "--max-blocks", "2"]
    assert main([*argv, "--samples", "2"]) == 0, capsys.readouterr().err
    assert EVONPosterior.from_pretrained(output).ess == float(json.loads(capsys.readouterr().out)["ess"])


def test_calibrate_refuses_an_output_holding_the_posterior_of_other_weights(saved, tmp_path, capsys, monkeypatch):
    """An --output holding another run's model and posterior: calibrate replaced that posterior with
    one of --model's weights, silently, leaving the other model beside a posterior that does not fit
    it (its trained posterior lost). It is a usage error before any pass; the files stay as they were.
    An --output holding a posterior of --model's own weights (the model's directory, a rerun) is saved to."""

    path, model, tokenizer, _ = saved
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return [y * 2 for y in x if y]\n" * 6)
    wider = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=16, n_layer=1, n_head=2))
    retrained = copy.deepcopy(model)
    others = {"wider": (wider, trained_posterior(wider, len(tokenizer), lambda x: x))}
    others["retrained"] = (retrained, trained_posterior(retrained, len(tokenizer), lambda x: x.roll(1, 1)))
    for name, (other, posterior) in others.items():
        other.save_pretrained(tmp_path / name)
        posterior.save_pretrained(tmp_path / name)
    for output, (_, err) in refused_outputs(path, text, [tmp_path / n for n in others], capsys, monkeypatch).items():
        assert f"--output {str(output)!r} holds the EVON posterior of other weights" in err, err
    own = tmp_path / "own"
    shutil.copytree(path, own)
    # a --posterior of other weights into the model's own directory: that posterior is the mistake named
    argv = ["calibrate", "--model", str(own), "--posterior", str(tmp_path / "wider"), "--text", str(text)]
    assert main([*argv, "--output", str(own), "--block-size", "16", "--max-blocks", "2", "--samples", "2"]) == 1
    assert "this EVON posterior does not fit the given GPT2LMHeadModel" in capsys.readouterr().err
    for _ in range(2):  # the model's own directory, then a rerun into it
        assert_calibrated_into(own, capsys, "--model", str(own), "--text", str(text))


def test_calibrate_refuses_a_posterior_taken_at_other_weights_of_the_same_shapes(saved, tmp_path, capsys, monkeypatch):
    """calibrate --posterior DIR, DIR's posterior taken at other weights of --model's shapes (a
    retrained copy): it only warned, calibrated noise around weights the posterior was not taken at,
    and saved that record, into the model's own directory too, where it replaced the model's trained
    posterior. It is a usage error naming --posterior before any pass; every directory stays as it was."""
    import hf_evon.predictive.calibration as calibration

    path, model, tokenizer, _ = saved
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return [y * 2 for y in x if y]\n" * 6)
    retrained = copy.deepcopy(model)
    trained_posterior(retrained, len(tokenizer), lambda x: x.roll(1, 1)).save_pretrained(tmp_path / "retrained")
    own = tmp_path / "own"
    shutil.copytree(path, own)
    monkeypatch.setattr(calibration, "calibrate_posterior", lambda *a, **k: pytest.fail("calibrated first"))
    for output in (own, tmp_path / "fresh"):
        before = directory_state(own), directory_state(tmp_path / "retrained")
        argv = ["calibrate", "--model", str(own), "--posterior", str(tmp_path / "retrained"), "--text", str(text)]
        assert main([*argv, "--output", str(output), "--block-size", "16", "--max-blocks", "2"]) == 2
        err = capsys.readouterr().err
        assert f"--posterior {str(tmp_path / 'retrained')!r} holds the EVON posterior of other weights" in err, err
        assert (directory_state(own), directory_state(tmp_path / "retrained")) == before
        assert not (tmp_path / "fresh").exists() or not any((tmp_path / "fresh").iterdir())


def test_generate_refuses_a_posterior_taken_at_other_weights_of_the_same_shapes(saved, tmp_path, capsys):
    """generate --posterior DIR, DIR's posterior taken at other weights of --model's shapes: it warned
    and decoded with exit status 0, its samples drawn around weights the posterior was not taken at,
    where calibrate refuses the same pair. A usage error naming --posterior, before any decoding."""
    path, model, tokenizer, _ = saved
    retrained = copy.deepcopy(model)
    trained_posterior(retrained, len(tokenizer), lambda x: x.roll(1, 1)).save_pretrained(tmp_path / "retrained")
    argv = ["generate", "--model", str(path), "--posterior", str(tmp_path / "retrained"), "--prompt", "ab"]
    assert main([*argv, "--samples", "2", "--max-new-tokens", "2", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        f"--posterior {str(tmp_path / 'retrained')!r} holds the EVON posterior of other weights than --model's"
        in captured.err
    ), captured.err
    assert "its samples would be drawn around weights it was not taken at" in captured.err


def test_generate_reads_prompts_with_a_tokenizer_that_has_no_special_tokens(saved, tmp_path, capsys):
    """A tokenizer with no pad, end-of-sequence or unknown token (a tokenizers' model wrapped as it is):
    --prompt failed, also for one prompt, with transformers' "Asking to pad but the tokenizer does not
    have a padding token. Please select a token to use as `pad_token`", a fix in Python code.
    The prompts decode as their token ids do with --prompt-ids (the padding is masked)."""
    path, model, tokenizer, posterior = saved
    directory = tmp_path / "model"
    shutil.copytree(path, directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(directory / name)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer).save_pretrained(directory)
    prompts = ["def f(x):", "a = b"]
    common = ["generate", "--model", str(directory), "--samples", "2", "--max-new-tokens", "4", "--json"]
    assert main([*common, *(a for p in prompts for a in ("--prompt", p))]) == 0, capsys.readouterr().err
    by_text = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ids = [" ".join(map(str, tokenizer(p)["input_ids"])) for p in prompts]
    assert main([*common, *(a for i in ids for a in ("--prompt-ids", i))]) == 0
    by_ids = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in by_text] == prompts
    assert [r["completion_ids"] for r in by_text] == [r["completion_ids"] for r in by_ids]
    assert [r["completion"] for r in by_text] == [r["completion"] for r in by_ids]


def test_calibrate_refuses_an_output_holding_the_weights_of_another_model(saved, tmp_path, capsys, monkeypatch):
    """An --output holding another model's weights and no posterior: calibrate saved --model's
    calibrated posterior beside them, where it fits nothing. It is a usage error before any pass
    naming what differs (config.json's model_type or sizes, a tensor's shape or, the shapes all
    equal, its values in the safetensors file); the files stay as they were. A copy of --model's own
    weights is saved to. An empty --output was found only at the save, after every pass (exit 1)."""
    from transformers import BartConfig, BartForConditionalGeneration


    path, model, tokenizer, _ = saved
    vocab = len(tokenizer)
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return [y * 2 for y in x if y]\n" * 6)
    wider = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=64, n_embd=16, n_layer=2, n_head=2))
    bart = BartForConditionalGeneration(BartConfig(
        vocab_size=vocab, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
    ))  # fmt: skip
    wider.save_pretrained(tmp_path / "wider")
    bart.save_pretrained(tmp_path / "bart")
    wider.save_pretrained(tmp_path / "weights_only")
    os.remove(tmp_path / "weights_only" / "config.json")
    wider.config.save_pretrained(tmp_path / "config_only")
    # the same architecture and shapes, other weights: found by their values (it was saved to)
    torch.manual_seed(123)
    type(model)(model.config).save_pretrained(tmp_path / "same_shapes")
    expected = {
        "same_shapes": "tensor 'transformer.h.0.attn.c_attn.bias' holds other values in model.safetensors than in --model",
        "bart": "its config.json's model_type 'bart', --model's 'gpt2'",
        "wider": "its config.json's n_embd 16, --model's 32",
        "config_only": "its config.json's n_embd 16, --model's 32",
        "weights_only": "tensor 'transformer.h.0.attn.c_attn.bias' has shape (48,) in model.safetensors, "
        "(96,) in --model",
    }
    said = refused_outputs(path, text, [tmp_path / n for n in expected], capsys, monkeypatch)
    for name, what in expected.items():
        output, (_, err) = tmp_path / name, said[tmp_path / name]
        assert f"--output {str(output)!r} holds the weights of another model than --model's ({what})" in err, err
    copy_of_own = tmp_path / "copy"
    model.save_pretrained(copy_of_own)
    assert_calibrated_into(copy_of_own, capsys, "--model", str(path), "--text", str(text))
    argv = ["calibrate", "--model", str(path), "--text", str(text), "--output", "", "--samples", "2"]
    assert main(argv) == 2 and "--output '': give a directory" in capsys.readouterr().err


def test_calibrate_checks_an_outputs_pickled_and_sharded_weights_without_running_their_code(
    saved, tmp_path, capsys, monkeypatch
):
    """--output holding another model's pytorch_model.bin, or a sharded checkpoint's index of another
    model's tensors, and no config.json: calibrate saved the posterior beside them (only safetensors
    files were read). They are read without running code (the index as JSON, a .bin with
    torch.load(weights_only=True)): a usage error before any pass naming what differs, the files left
    as they were; a .bin that loads only by running code is refused, the code not run. A .bin copy of
    --model's own weights is saved to."""

    path, model, tokenizer, _ = saved
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return [y * 2 for y in x if y]\n" * 6)
    wider = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=16, n_layer=2, n_head=2))
    (tmp_path / "bin").mkdir()
    torch.save(wider.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "index").mkdir()
    weight_map = {"encoder.layers.0.fc1.weight": "model-00001-of-00002.safetensors", "shared.weight": "x"}
    (tmp_path / "index" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "pickle").mkdir()
    shutil.copy(path / "model.safetensors", tmp_path / "pickle" / "model.safetensors")
    _evil_pickle(tmp_path / "pickle")
    (tmp_path / "deep").mkdir()  # nested past the recursion limit: named, as any unreadable index
    (tmp_path / "deep" / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    expected = {
        "deep": "its model.safetensors.index.json does not read as a shard index (maximum recursion depth",
        "bin": "holds the weights of another model than --model's (tensor 'lm_head.weight' has shape "
        f"({len(tokenizer)}, 16) in pytorch_model.bin, ({len(tokenizer)}, 32) in --model)",
        "index": "holds the weights of another model than --model's (none of the tensors of its "
        "model.safetensors.index.json is --model's, e.g. 'encoder.layers.0.fc1.weight')",
        "pickle": "its pytorch_model.bin does not read as tensors without running code ("
        f"{tmp_path / 'pickle' / 'pytorch_model.bin'}: refusing to load it: torch.load(weights_only=True) loads "
        "tensors and plain data only, and this file holds more, which loading could run as code (Unsupported "
        "global: GLOBAL print was not an allowed global by default))",
    }
    said = refused_outputs(path, text, [tmp_path / n for n in expected], capsys, monkeypatch)
    for name, what in expected.items():
        output, (out, err) = tmp_path / name, said[tmp_path / name]
        assert f"--output {str(output)!r}" in err and what in err, err
        assert "UNPICKLED-CODE-RAN" not in out + err
    own = tmp_path / "own"
    own.mkdir()
    torch.save(model.state_dict(), own / "pytorch_model.bin")
    assert_calibrated_into(own, capsys, "--model", str(path), "--text", str(text))


def test_calibrate_refuses_an_output_holding_another_adapter(saved, tmp_path, capsys, monkeypatch):
    """calibrate of a LoRA model into an --output holding another adapter (another rank, other target
    modules): its adapter_model.safetensors and adapter_config.json were not read, and the posterior
    was saved beside an adapter it does not fit. A usage error before any pass naming the file and
    what differs (PEFT's saved names drop the adapter name); the files stay. The same adapter is saved to."""
    from peft import LoraConfig, get_peft_model


    path, model, tokenizer, _ = saved
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return [y * 2 for y in x if y]\n" * 6)

    def lora(r: int, modules: list[str]):
        return get_peft_model(copy.deepcopy(model), LoraConfig(r=r, target_modules=modules, fan_in_fan_out=True))

    ours = lora(2, ["c_attn"])
    posterior = trained_posterior(ours, len(tokenizer), lambda x: x)  # the adapter saved is the one trained
    adapter = tmp_path / "adapter"
    ours.save_pretrained(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(path)}))
    posterior.save_pretrained(adapter)
    name = "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"
    expected = {
        "rank": f"tensor {name!r} has shape (4, 32) in adapter_model.safetensors, (2, 32) in --model",
        "modules": f"its adapter_model.safetensors lacks --model's tensor {name!r}",
    }
    lora(4, ["c_attn"]).save_pretrained(tmp_path / "rank")
    lora(2, ["c_proj"]).save_pretrained(tmp_path / "modules")
    (tmp_path / "config_only").mkdir()
    shutil.copy(tmp_path / "rank" / "adapter_config.json", tmp_path / "config_only")
    expected["config_only"] = "its adapter_config.json's r 4, --model's 2"
    said = refused_outputs(adapter, text, [tmp_path / c for c in expected], capsys, monkeypatch)
    for case, what in expected.items():
        output, (_, err) = tmp_path / case, said[tmp_path / case]
        assert f"--output {str(output)!r} holds another adapter than --model's ({what})" in err, err
    same = tmp_path / "same"
    ours.save_pretrained(same)
    assert_calibrated_into(same, capsys, "--model", str(adapter), "--text", str(text))


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "ab", "--samples", str(2**63)], f"--samples: wants an integer from 1 to {2**63 - 1}; got '{2**63}'"),
    (["--prompt", "ab", "--num-beams", str(2**63)], f"--num-beams: wants an integer from 1 to {2**63 - 1}"),
    (["--prompt-ids", str(2**63)], f"--prompt-ids: token id {2**63} is no 64-bit integer"),
    (["--prompt-ids", f"5 {-(2**63) - 1}"], f"--prompt-ids: token id {-(2**63) - 1} is no 64-bit integer"),
])  # fmt: skip
def test_an_integer_beyond_64_bits_is_an_argparse_error_naming_its_option(saved, capsys, argv, message):
    """--samples or --num-beams of 2**63 raised torch's TypeError with a traceback, and --prompt-ids
    beyond 64 bits printed "Overflow when unpacking long long", naming no option, exit code 1."""
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(saved[0]), "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert f"hf-evon generate: error: argument {message}" in err, err


def test_calibrate_with_more_max_blocks_than_bytes_can_count_uses_the_whole_text(saved, tmp_path, capsys):
    """--max-blocks 2**62 (a valid 64-bit integer) made the text's first read ask for more bytes than
    an index holds: OverflowError with a traceback (smaller values allocated that many bytes). A read
    takes at most the file; the run scores the text's blocks as --max-blocks of exactly their number."""
    from hf_evon.cli.loading import read_text

    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return [y * 2 for y in x if y]\n" * 6)
    assert read_text(str(text), "--text", 2**62) == (text.read_text(), True)
    runs = {}
    for blocks in (str(2**62), str(len(text.read_text()) // 16)):  # a character a token
        argv = ["calibrate", "--model", str(saved[0]), "--text", str(text), "--output", str(tmp_path / blocks)]
        assert main([*argv, "--block-size", "16", "--samples", "2", "--max-blocks", blocks, "--json"]) == 0
        runs[blocks] = json.loads(capsys.readouterr().out)
    assert runs[str(2**62)] == runs[str(len(text.read_text()) // 16)]


@pytest.mark.parametrize("command", ["generate", "calibrate"])
def test_an_unknown_model_type_is_one_line_naming_the_option_and_file(saved, tmp_path, capsys, command):
    """A --model whose config.json has a model_type transformers does not know printed transformers'
    multi-line message with pip advice, naming neither --model nor the file."""
    import transformers

    path, *_ = saved
    model_dir = tmp_path / "m"
    shutil.copytree(path, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "zzz"}))
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return x\n" * 6)
    rest = ["--prompt-ids", "5 9"] if command == "generate" else ["--text", str(text), "--output", str(tmp_path / "o")]
    assert main([command, "--model", str(model_dir), *rest, "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not (tmp_path / "o").exists()
    assert "pip" not in err and err.splitlines()[-1] == (
        f"hf-evon {command}: error: --model {str(model_dir)!r}: {str(model_dir / 'config.json')!r} has model_type "
        f"'zzz', which transformers {transformers.__version__} does not know"
    ), err


def test_inspect_takes_a_subfolder_with_slashes_as_the_posterior_loads_it(saved, tmp_path, capsys):
    """The posterior loads from ``--subfolder /run/`` as from ``run``, but inspect looked the file sizes
    up in ``/run/`` (the join of an absolute path drops the location) and printed ``location//run/``."""
    path, *_ = saved
    shutil.copytree(path, tmp_path / "run")
    assert main(["inspect", str(tmp_path), "--subfolder", "run", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["inspect", str(tmp_path), "--subfolder", "/run/", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == plain
    assert main(["inspect", str(tmp_path), "--subfolder", "/run/"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"EVON posterior at {tmp_path}/run"


@pytest.mark.parametrize("command", ["inspect", "generate"])
def test_a_subfolder_missing_from_a_local_directory_is_a_usage_error(saved, capsys, command):
    """A missing local directory exits 2 (a usage error), but a missing subfolder of an existing one
    exited 1 ("no EVON posterior in '…/sub': evon_posterior_config.json is missing")."""
    path, *_ = saved
    if command == "inspect":
        argv, option = ["inspect", str(path), "--subfolder", "sub"], "--subfolder"
    else:
        argv = ["generate", "--model", str(path), "--prompt", "def", "--posterior-subfolder", "sub"]
        option = "--posterior-subfolder"
    assert main(argv) == 2
    assert f"{option} 'sub': no such directory in " in capsys.readouterr().err


def test_inspect_names_the_revision_it_read(saved, tmp_path, monkeypatch, capsys):
    """``inspect REPO --revision dev`` printed "EVON posterior at REPO", the revision nowhere."""
    try:
        from hub_stub import HubStub
    except ImportError:  # tests/ imported as a package
        from tests.hub_stub import HubStub
    _, _, _, posterior = saved
    with HubStub() as hub:
        posterior.push_to_hub("alice/dev", token="hf_dummy", endpoint=hub.endpoint, revision="dev")
        _hub_at(monkeypatch, tmp_path, hub.endpoint)
        assert main(["inspect", "alice/dev", "--revision", "dev"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "EVON posterior at alice/dev, revision dev"


@pytest.mark.parametrize("file", ["evon_posterior_config.json", "evon_posterior.safetensors"])
def test_a_posterior_file_that_is_a_dangling_link_is_named_as_such(saved, tmp_path, capsys, file):
    """A posterior config (or weights file) that is a link to nothing was reported as missing, where
    ``ls`` shows it there; the error names the link and where it points."""
    path, *_ = saved
    directory = tmp_path / "run"
    shutil.copytree(path, directory)
    (directory / file).unlink()
    (directory / file).symlink_to(tmp_path / "moved-away")
    named = " (named by evon_posterior_config.json)" if file.endswith(".safetensors") else ""
    for argv in (["inspect", str(directory)], ["generate", "--model", str(directory), "--prompt-ids", "5 9"]):
        assert main(argv) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.splitlines()[-1] == (  # (before it: transformers' progress bar of the model)
            f"hf-evon {argv[0]}: error: no EVON posterior in {str(directory)!r}: {file}{named} is a link to "
            f"{str(tmp_path / 'moved-away')!r}, which does not exist"
        ), err


def test_calibrate_refuses_an_output_whose_posterior_config_is_a_directory_before_the_calibration(
    saved, tmp_path, capsys, monkeypatch
):
    """An --output whose evon_posterior_config.json is a directory passed as holding no posterior: the
    whole calibration ran, then the save failed 'Is a directory', leaving its staged weights file there."""
    import hf_evon.predictive.calibration as calibration

    monkeypatch.setattr(calibration, "calibrate_posterior", lambda *a, **k: pytest.fail("calibrated first"))
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return x\n" * 6)
    output = tmp_path / "out"
    (output / "evon_posterior_config.json").mkdir(parents=True)
    argv = ["calibrate", "--model", str(saved[0]), "--text", str(text), "--output", str(output)]
    assert main([*argv, "--block-size", "8", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"hf-evon calibrate: error: --output {str(output)!r}: its evon_posterior_config.json is a directory, "
        "where the save writes the posterior's config: pass another --output, or remove that directory"
    )
    assert os.listdir(output) == ["evon_posterior_config.json"]


def _refused_or_linked(monkeypatch: pytest.MonkeyPatch, entry: Path, kind: str) -> str:
    """``entry`` made what ``kind`` names: a file this user cannot look up ("EACCES": os.lstat and os.stat
    of it answer so, simulated: the tests run as root), a "directory", a "dangling link" or a "loop" of
    links; returns what the CLI reports of a link ("a link to ..., which ...")."""
    if kind == "EACCES":
        entry.write_bytes(b"another run's file")
        refuse_lookups(monkeypatch, lambda path: path == str(entry))
    elif kind == "directory":
        entry.mkdir()
    else:
        entry.symlink_to(entry if kind == "loop" else entry.parent.parent / "moved-away")
    if kind == "loop":
        return f"a link to {str(entry)!r}, which leads into a loop of links (ELOOP)"
    return f"a link to {str(entry.parent.parent / 'moved-away')!r}, which does not exist"


@pytest.mark.parametrize("kind", ["EACCES", "dangling link", "loop"])
def test_calibrate_refuses_an_output_whose_posterior_config_is_listed_but_no_file_before_the_calibration(
    saved, tmp_path, capsys, monkeypatch, kind
):
    """An --output whose evon_posterior_config.json this user cannot look up, or is a link to nothing (a
    posterior on a disk not mounted) or a loop of links: os.path.isdir and os.path.isfile took it for no
    posterior, the whole calibration ran, and the save replaced the link. The PermissionError naming it is
    reported, and a link is a usage error naming it and its target, before any pass; the entry stays."""
    import hf_evon.predictive.calibration as calibration

    monkeypatch.setattr(calibration, "calibrate_posterior", lambda *a, **k: pytest.fail("calibrated first"))
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return x\n" * 6)
    output = tmp_path / "out"
    output.mkdir()
    config = output / "evon_posterior_config.json"
    why = _refused_or_linked(monkeypatch, config, kind)
    argv = ["calibrate", "--model", str(saved[0]), "--text", str(text), "--output", str(output)]
    code = main([*argv, "--block-size", "8", "--device", "cpu"])
    err = capsys.readouterr().err.splitlines()[-1]
    if kind == "EACCES":
        assert (code, err) == (1, f"hf-evon calibrate: error: [Errno 13] Permission denied: {str(config)!r}"), err
    else:
        assert (code, err) == (2, (
            f"hf-evon calibrate: error: --output {str(output)!r}: its evon_posterior_config.json is {why}: "
            "pass another --output, or remove its evon_posterior files to replace them"
        )), err
    assert os.listdir(output) == ["evon_posterior_config.json"]


@pytest.mark.parametrize("kind", ["EACCES", "directory", "dangling link", "loop"])
def test_calibrate_refuses_an_output_whose_adapter_weights_are_listed_but_no_file_before_the_calibration(
    saved, tmp_path, capsys, monkeypatch, kind
):
    """calibrate of a LoRA model into an --output holding --model's adapter_config.json beside an
    adapter_model.safetensors this user cannot look up, or that is a directory, a link to nothing (an adapter
    on a disk not mounted) or a loop of links: os.path.isfile took it for no adapter weights, the whole
    calibration ran, and the posterior was saved beside weights nobody read. The PermissionError naming it is
    reported, and the others are a usage error naming the file and what it is, before any pass."""
    from peft import LoraConfig, get_peft_model

    import hf_evon.predictive.calibration as calibration

    path, model, tokenizer, _ = saved
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return x\n" * 6)
    ours = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    adapter = tmp_path / "adapter"
    ours.save_pretrained(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(path)}))
    trained_posterior(ours, len(tokenizer), lambda x: x).save_pretrained(adapter)
    output = tmp_path / "out"
    ours.save_pretrained(output)
    weights = output / "adapter_model.safetensors"
    weights.unlink()
    monkeypatch.setattr(calibration, "calibrate_posterior", lambda *a, **k: pytest.fail("calibrated first"))
    why = _refused_or_linked(monkeypatch, weights, kind)
    if kind == "directory":
        why = "not a regular file (a directory, named pipe or device)"
    argv = ["calibrate", "--model", str(adapter), "--text", str(text), "--output", str(output)]
    code = main([*argv, "--block-size", "8", "--device", "cpu"])
    err = capsys.readouterr().err.splitlines()[-1]
    if kind == "EACCES":
        assert (code, err) == (1, f"hf-evon calibrate: error: [Errno 13] Permission denied: {str(weights)!r}"), err
    else:
        assert (code, err) == (2, (
            f"hf-evon calibrate: error: --output {str(output)!r}: its adapter_model.safetensors is {why}: saving "
            "the posterior there would put it beside weights it does not fit: pass another --output"
        )), err


@pytest.mark.parametrize("kind", ["EACCES", "dangling link", "loop"])
def test_calibrate_refuses_a_text_listed_but_no_file_to_read_naming_why(saved, tmp_path, capsys, monkeypatch, kind):
    """A --text this user cannot look up (EACCES, simulated: the tests run as root), a link to nothing (a file
    on a disk not mounted) or a loop of links: os.path.isfile swallowed why, and each was '--text ... is not a
    file', as for a path where nothing is. The PermissionError naming it is reported, and a link is a usage
    error naming its target, before the model loads."""
    import hf_evon.cli.commands as commands

    monkeypatch.setattr(commands, "load_model_posterior_tokenizer", lambda *a, **k: pytest.fail("loaded first"))
    (tmp_path / "data").mkdir()
    text = tmp_path / "data" / "held_out.txt"
    why = _refused_or_linked(monkeypatch, text, kind)
    argv = ["calibrate", "--model", str(saved[0]), "--text", str(text), "--output", str(tmp_path / "out")]
    code = main([*argv, "--block-size", "8", "--device", "cpu"])
    err = capsys.readouterr().err.splitlines()[-1]
    if kind == "EACCES":
        assert (code, err) == (1, f"hf-evon calibrate: error: [Errno 13] Permission denied: {str(text)!r}"), err
    else:
        assert (code, err) == (2, f"hf-evon calibrate: error: --text {str(text)!r} is {why}"), err



@contextlib.contextmanager
def _fifo_writer(fifo: Path, data: str):  # noqa: ANN202
    """A shell that writes ``data`` to the named pipe ``fifo`` for every reader that opens it: opening it for
    reading waits for a writer, so a reader reads ``data`` and an end of file at once instead of blocking
    for ever. Killed on leaving."""
    writer = subprocess.Popen(["sh", "-c", 'while :; do printf %s "$2" > "$1"; done', "sh", str(fifo), data])
    try:
        yield
    finally:
        writer.kill()
        writer.wait()


def test_calibrate_refuses_an_output_whose_weights_file_is_a_named_pipe_without_reading_it(saved, tmp_path, capsys, monkeypatch):
    """An --output holding a named pipe (or a link to nothing) under a model weights file's name: the check of
    the weights there opened every such file listed, and opening a named pipe for reading waits for a writer:
    calibrate blocked for ever before any pass (here a writer answers, so the pipe was read: 'does not read as
    safetensors'). Anything there that is no regular file is a usage error naming it, and nothing is opened."""
    import hf_evon.predictive.calibration as calibration

    monkeypatch.setattr(calibration, "calibrate_posterior", lambda *a, **k: pytest.fail("calibrated first"))
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return x\n" * 6)
    keep = "saving the posterior there would put it beside weights it does not fit: pass another --output"
    for name, kind in (("model.safetensors", "named pipe"), ("pytorch_model.bin", "dangling link")):
        output = tmp_path / name.split(".")[0]
        output.mkdir()
        weights = output / name
        if kind == "named pipe":
            os.mkfifo(weights)
            why = "not a regular file (a directory, named pipe or device)"
        else:
            why = _refused_or_linked(monkeypatch, weights, kind)
        argv = ["calibrate", "--model", str(saved[0]), "--text", str(text), "--output", str(output)]
        with _fifo_writer(weights, "not safetensors") if kind == "named pipe" else contextlib.nullcontext():
            code = main([*argv, "--block-size", "8", "--device", "cpu"])
        err = capsys.readouterr().err.splitlines()[-1]
        assert (code, err) == (2, f"hf-evon calibrate: error: --output {str(output)!r}: its {name} is {why}: {keep}"), err
        assert os.listdir(output) == [name]


@pytest.mark.parametrize("kind", ["named pipe", "EACCES"])
def test_an_outputs_config_json_is_not_read_unless_it_is_a_file_nor_taken_for_none_where_it_cannot_be_looked_up(
    saved, tmp_path, monkeypatch, kind
):
    """calibrate's check of the model weights in --output read its config.json: a named pipe there blocked it
    for ever (an open for reading waits for a writer; here one answers with another model's config, which was
    then refused), and one this user cannot look up (EACCES, simulated for os.stat, os.lstat and open: the
    tests run as root) was taken for none, another model's config unread. A config.json that is no regular file is not read (the weights files there still tell), and one
    that cannot be looked up raises the PermissionError naming it."""
    from hf_evon.cli.output import check_output_weights

    output = tmp_path / "out"
    output.mkdir()
    config = output / "config.json"
    other = json.dumps({"model_type": "gpt2", "n_embd": 16})  # another model's
    if kind == "named pipe":
        os.mkfifo(config)
        with _fifo_writer(config, other):
            assert check_output_weights(str(output), saved[1]) is None
        return
    config.write_text(other)
    refuse_lookups(monkeypatch, lambda path: path == str(config))
    real_open = open

    def refusing_open(file, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - as the lookups are refused
        if isinstance(file, str | os.PathLike) and os.fspath(file) == str(config):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refusing_open)
    with pytest.raises(PermissionError) as refused:
        check_output_weights(str(output), saved[1])
    assert (refused.value.errno, refused.value.filename) == (13, str(config))


def test_an_adapter_name_from_the_posterior_never_picks_a_folder_outside_the_model(tmp_path, monkeypatch):
    """The adapter's name is read from the posterior's parameter names (``lora_A.<name>.weight``: a
    file that may come from the Hub), and PEFT's folder of a named adapter is ``--model``'s
    ``<name>``: a name that is an absolute path (it needs no dots) made the CLI load another local
    adapter than ``--model``'s without a word. It is refused, naming the name and ``--model``, before
    any adapter is read."""
    import peft

    from hf_evon.cli import loading
    from hf_evon.cli.loading import UsageError
    from hf_evon.modeling import adapter_of_names

    model_dir, other = tmp_path / "mine", tmp_path / "someone_elses"
    for d in (model_dir, model_dir / "inner", other):
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "gpt2"}))
    named = str(other)
    assert adapter_of_names([f"base_model.model.h.0.attn.lora_A.{named}.weight"]) == named
    read: list[str] = []

    def recorded(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        read.append(str(path))
        raise RuntimeError("read")

    monkeypatch.setattr(peft.PeftConfig, "from_pretrained", recorded)
    with pytest.raises(UsageError) as err:
        loading._load_model(str(model_dir), None, None, lambda: named)
    assert read == []
    assert repr(named) in str(err.value) and f"--model {str(model_dir)!r}" in str(err.value), str(err.value)


def test_calibrate_says_a_block_size_above_the_context_is_cut_to_it(saved, tmp_path, capsys):
    """``--block-size 100`` on a model of 64 positions was cut to 64 without a word: the NLLs were of
    shorter blocks than asked for. It is said on stderr, and the calibration runs on blocks of 64."""
    path, _, _, _ = saved
    text = tmp_path / "held_out.txt"
    text.write_text("def held_out(x):\n    return [y * 2 for y in x if y]\n" * 6)
    argv = ["calibrate", "--model", str(path), "--text", str(text), "--output", str(tmp_path / "out"), "--json"]
    assert main([*argv, "--block-size", "100", "--max-blocks", "2", "--samples", "2"]) == 0
    out, err = capsys.readouterr()
    assert "--block-size 100 is above the model's context: blocks of 64" in err
    assert json.loads(out)["num_targets"] == 2 * 63
