"""Smoke runs of examples/pretrain_lm.py with tiny settings (1 process and 2 processes)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import types
from unittest import mock

import pytest
from conftest import argument_error, load_script
from launcher import free_port, worker_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_lm.py")
TINY = [
    "--max-steps", "4", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32",
    "--batch-size", "4", "--grad-accum", "2", "--vocab-size", "384", "--corpus-mb", "0.3",
    "--eval-every", "2", "--val-batches", "2", "--bma-samples", "3", "--warmup-steps", "1", "--no-progress",
]  # fmt: skip


def run(args: list[str], processes: int = 1, env: dict[str, str] | None = None) -> str:
    env = worker_env() if env is None else env
    if processes == 1:
        cmd = [sys.executable, SCRIPT, *args]
    else:
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), SCRIPT, *args,
        ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


@pytest.fixture(scope="module")
def example():
    """The script as a module (its functions, without running it)."""
    return load_script(SCRIPT)


def run_here(example: types.ModuleType, args: list[str]) -> str:
    """What ``main(args)`` prints, run in this process: a one-process run without the start of
    another Python (its imports are most of a tiny run's time), on the CPU as the launched runs
    are (``worker_env``), also where an accelerator is present. accelerate's process-wide state,
    which ``main``'s Accelerator sets up, is reset before and after, so that the run and the
    other tests in this process do not see each other's."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), mock.patch.object(example, "_has_accelerator", lambda: False):
            example.main(args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return printed.getvalue()


@pytest.fixture
def accelerator():
    """The two things load_tokens reads of an Accelerator, for one process."""
    return types.SimpleNamespace(main_process_first=contextlib.nullcontext, is_main_process=True)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("corpus_cache"))  # tokenizer + tokens, built once


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, cache: str, example) -> tuple[str, str]:
    out_dir = str(tmp_path_factory.mktemp("pretrain"))
    return out_dir, run_here(example, [*TINY, "--output-dir", out_dir, "--cache-dir", cache])


def test_single_process_reports_mean_and_bma_validation_loss(single: tuple[str, str]) -> None:
    out_dir, log = single
    lines = re.findall(
        r"step (\d+): train loss [\d.]+ \| val loss \(mean\) ([\d.]+) \| val loss \(BMA, S=3\) ([\d.]+)", log
    )
    assert [int(s) for s, _, _ in lines] == [2, 4]
    for _, mean, bma in lines:
        assert 1.0 < float(mean) < 8.0 and 1.0 < float(bma) < 8.0  # ln(384) ≈ 5.95 at the start
    assert "1 process(es)" in log
    final = json.load(open(os.path.join(out_dir, "metrics.json")))["final"]
    assert final["step"] == 4 and final["processes"] == 1
    assert final["val_loss_bma"] == pytest.approx(float(lines[-1][2]), abs=1e-4)


def test_single_process_saves_model_posterior_and_card(single: tuple[str, str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_evon import EVONPosterior

    out_dir, _ = single
    model_dir = os.path.join(out_dir, "model")
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "evon_posterior.safetensors",
        "README.md",
    ):
        assert os.path.isfile(os.path.join(model_dir, name)), name
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == 384 and model.config.vocab_size == 384
    posterior = EVONPosterior.from_pretrained(model_dir)
    posterior.check_model(model)
    assert len(posterior.names) == 4  # c_attn, attn c_proj, c_fc, mlp c_proj of the one layer
    assert all("wte" not in n and "ln" not in n for n in posterior.names)  # AdamW-owned: no posterior
    ids = torch.tensor([tok("def f(x):\n    return x")["input_ids"]])
    with posterior.sampled(model, seed=0):
        sampled = model(input_ids=ids).logits
    assert not torch.equal(sampled, model(input_ids=ids).logits)
    card = open(os.path.join(model_dir, "README.md")).read()
    assert "BMA" in card or "bma" in card


@pytest.mark.parametrize("optimizer", ["adamw", "soap", "ivon"])
def test_baselines_run(optimizer: str, cache: str, tmp_path, example) -> None:
    from hf_evon.posterior.model_card import SECTION_START

    args = [*TINY, "--max-steps", "2", "--eval-every", "0", "--optimizer", optimizer]
    # an earlier EVON run's card in the same directory: kept only where this run has a posterior
    os.makedirs(os.path.join(tmp_path, "model"))
    with open(os.path.join(tmp_path, "model", "README.md"), "w") as fh:
        fh.write(f"---\ntags: [evon]\n---\n{SECTION_START}\nan EVON posterior\n<!-- hf-evon:end -->\n")
    log = run_here(example, [*args, "--output-dir", str(tmp_path), "--cache-dir", cache])
    final = re.search(rf"final \({optimizer}, 2 steps.*", log)
    assert final, log[-3000:]
    assert ("val_loss_bma=" in final.group(0)) == (optimizer == "ivon")  # AdamW, SOAP-mode: no posterior
    posterior = os.path.join(tmp_path, "model", "evon_posterior.safetensors")
    assert os.path.isfile(posterior) == (optimizer == "ivon")
    card = os.path.join(tmp_path, "model", "README.md")
    assert os.path.isfile(card) == (optimizer == "ivon")
    if optimizer == "ivon":
        assert "an EVON posterior" not in open(card).read()  # the section is this run's


def test_a_recipe_run_saves_its_posterior_whatever_ess_says(cache: str, tmp_path, example) -> None:
    """--recipe trains at the recipe's ζ, not --ess's; with --ess inf beside it the run trained a
    posterior at the recipe's ζ = 5.27e6, then reported no BMA and saved none (read from --ess)."""
    from hf_evon import RECIPES, EVONPosterior

    args = [*TINY, "--max-steps", "2", "--eval-every", "0", "--recipe", "nanogpt", "--ess", "inf"]
    log = run_here(example, [*args, "--output-dir", str(tmp_path), "--cache-dir", cache])
    final = re.search(r"final \(evon, 2 steps.*", log)
    assert final and "val_loss_bma=" in final.group(0), log[-3000:]
    assert EVONPosterior.from_pretrained(os.path.join(tmp_path, "model")).ess == RECIPES["nanogpt"]["ess"]


@pytest.mark.parametrize("shard", [False, True])
def test_two_processes(cache: str, tmp_path, shard: bool) -> None:
    out_dir = str(tmp_path)
    args = [*TINY, "--max-steps", "2", "--eval-every", "0", "--output-dir", out_dir, "--cache-dir", cache]
    log = run(args + ["--shard"] * shard, 2)
    kept = re.search(r"EVON state sharded: this rank keeps (\d+) of (\d+) matrices", log)
    assert (kept is not None) == shard
    if shard:
        assert 0 < int(kept.group(1)) < int(kept.group(2))
    assert "2 process(es), MULTI_CPU" in log
    assert re.search(r"final \(evon, 2 steps.*val_loss_mean=[\d.]+ val_loss_bma=[\d.]+", log)
    final = json.load(open(os.path.join(out_dir, "metrics.json")))["final"]
    assert final["processes"] == 2
    assert os.path.isfile(os.path.join(out_dir, "model", "evon_posterior.safetensors"))


@pytest.mark.parametrize("recipe", ["nanogpt", "llama"])
def test_recipe_option_builds_the_papers_table(recipe: str, example) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_evon import RECIPES

    args = example.parse_args(["--recipe", recipe, "--output-dir", "unused"])
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    opt = example.build_optimizer_for(args, model)
    group = next(g for g in opt.param_groups if g["algorithm"] == "evon")
    for key, value in RECIPES[recipe].items():
        assert group[key] == (tuple(value) if isinstance(value, tuple) else value), key


@pytest.mark.parametrize("optimizer", ["evon", "ivon"])
def test_the_default_settings_run_the_papers_algorithm(optimizer: str, example) -> None:
    """The default EVON settings are the paper's NanoGPT table (fixed ζ = 5.27e6, δ = 1e-6, h0 = 0.582),
    which the paper tuned for its own algorithm: the Price estimate, the per-entry step, no
    ``snr_scaling``. They ran under the library's defaults (the Fisher estimate), where H falls far
    below δ, the posterior std grew to 39x the weights' RMS (both health warnings) and the 300-step
    validation loss was 8.3 instead of the 5.18 in docs/results.md#lm-pre-training."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_evon.optim.recipes import PAPER_ALGORITHM

    args = example.parse_args(["--optimizer", optimizer, "--output-dir", "unused"])
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    opt = example.build_optimizer_for(args, model)
    group = next(g for g in opt.param_groups if g["algorithm"] == "evon")
    for key, value in PAPER_ALGORITHM.items():
        assert group[key] == value, key
    assert (group["ess"], group["weight_decay"], group["hess_init"]) == (5.27e6, 1e-6, 0.582)


@pytest.mark.parametrize("val_fraction, seq_len, message", [
    # 0.05 MB of corpus, 0.1% of it held out: ~2.6k validation tokens, less than one 4096-token
    # block; the run reported NaN losses as numbers in metrics.json and the card
    ("0.001", "4096", r"the validation split holds \d+ tokens, less than one --seq-len block \(4096\)"),
    # a training split shorter than a block: the training windows had nowhere to start, and the
    # first step raised torch's "random_ expects 'from' to be less than 'to'"
    ("0.02", "100000", r"the training split holds \d+ tokens, not more than one --seq-len block \(100000\)"),
])  # fmt: skip
def test_a_split_shorter_than_one_block_is_refused(
    cache: str, tmp_path, val_fraction, seq_len, message, example
) -> None:
    args = [
        "--max-steps", "1", "--corpus-mb", "0.05", "--val-fraction", val_fraction, "--vocab-size", "300",
        "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", seq_len, "--batch-size", "1",
        "--no-progress", "--output-dir", str(tmp_path), "--cache-dir", cache,
    ]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        run_here(example, args)
    # a message, not a status: Python prints it to stderr and exits 1, without a traceback
    assert isinstance(stopped.value.code, str) and re.search(message, stopped.value.code)
    assert not os.path.exists(os.path.join(tmp_path, "metrics.json"))


@pytest.mark.parametrize(
    "flag",
    ["--bma-samples", "--max-steps", "--grad-accum", "--seq-len", "--mc-samples", "--n-layer", "--n-embd", "--n-head",
     "--vocab-size"],
)  # fmt: skip
def test_a_count_below_one_is_an_argument_error(flag: str, capsys, example) -> None:
    """--bma-samples 0 trained, then crashed halfway through saving (the new model beside the old
    posterior); --max-steps 0, --grad-accum 0, --seq-len 0 and --mc-samples 0 raised from inside;
    --n-layer 0 left EVON no matrix and trained every step before its posterior was refused
    ("the optimizer has no EVON-owned parameters"); --n-embd 0 and --n-head 0 raised
    ZeroDivisionError from the model's construction; --vocab-size -5 an OverflowError from the
    tokenizer's training."""
    error = argument_error(example.parse_args, [flag, "0", "--output-dir", "unused"], capsys)
    assert f"{flag} must be an integer >= 1; got 0" in error


def test_a_width_its_heads_do_not_divide_is_an_argument_error(capsys, example) -> None:
    """--n-embd 33 --n-head 2 ended in transformers' "embed_dim must be divisible by num_heads" traceback."""
    error = argument_error(example.parse_args, ["--n-embd", "33", "--n-head", "2", "--output-dir", "unused"], capsys)
    assert "--n-embd must be a multiple of --n-head; got 33 and 2" in error


def test_a_batch_the_accumulation_does_not_divide_is_an_argument_error(capsys, example) -> None:
    """--batch-size 3 --grad-accum 2 exited with status 1 after the Accelerator was built; it is an
    argument error (status 2), named with both values."""
    error = argument_error(example.parse_args, ["--batch-size", "3", "--grad-accum", "2", "--output-dir", "unused"], capsys)
    assert "--batch-size must be a multiple of --grad-accum; got 3 and 2" in error


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_corpus_cap_that_is_not_positive_is_an_argument_error(value: str, capsys, example) -> None:
    """--corpus-mb 0 or -1 tokenised an empty corpus, cached its tokenizer in the output directory
    and stopped on "the training split holds 0 tokens ... use a shorter --seq-len"."""
    error = argument_error(example.parse_args, ["--corpus-mb", value, "--output-dir", "unused"], capsys)
    assert f"--corpus-mb must be a number > 0 (MB of text); got {value}" in error


@pytest.mark.parametrize("value", ["0", "-0.1", "1", "1.5", "nan"])
def test_a_val_fraction_outside_0_1_is_an_argument_error(value: str, capsys, example) -> None:
    """--val-fraction 0 held nothing out: the corpus was tokenised and the model built, then the run
    stopped on "the validation split holds 0 tokens ...: use a shorter --seq-len or a larger corpus",
    blaming the corpus; a negative one or one above 1 raised split_documents' ValueError (a
    traceback), and 1 held out every document, leaving nothing to train on."""
    error = argument_error(example.parse_args, ["--val-fraction", value, "--output-dir", "unused"], capsys)
    message = (
        f"--val-fraction must be above 0 and below 1 (the run reports its validation loss, and trains on "
        f"the rest); got {value}"
    )
    assert message in error


def test_the_tokenizer_cache_follows_the_corpus(tmp_path, example, accelerator) -> None:
    """A second corpus in the same cache directory gets a tokenizer trained on it, not the first
    corpus's tokenizer of the same vocabulary size."""

    def vocab(corpus_mb: str, cache_dir: str) -> dict[str, int]:
        args = example.parse_args(["--vocab-size", "384", "--corpus-mb", corpus_mb, "--cache-dir", cache_dir])
        return example.load_tokens(args, accelerator)[0].get_vocab()

    shared = str(tmp_path / "shared")
    vocab("0.05", shared)
    assert vocab("0.1", shared) == vocab("0.1", str(tmp_path / "fresh"))


def test_the_token_cache_follows_the_text_column(tmp_path, example, accelerator) -> None:
    """The data cache's key left out --text-column: a second run on another column of the same
    dataset trained on the first column's tokens, and its metrics named the second."""
    data = tmp_path / "table"
    data.mkdir()
    rows = [f"row {i} says {'alpha ' * (i % 7)}" for i in range(40)]
    alt = [f"other {i} reads {'beta gamma ' * (i % 5)}" for i in range(40)]
    (data / "train.csv").write_text("text,alt\n" + "".join(f"{a},{b}\n" for a, b in zip(rows, alt)))

    def tokens(column: str, cache_dir: str) -> list[int]:
        argv = ["--dataset", str(data), "--text-column", column, "--vocab-size", "300", "--val-fraction", "0.2",
                "--cache-dir", cache_dir]  # fmt: skip
        return example.load_tokens(example.parse_args(argv), accelerator)[1].tolist()

    shared = str(tmp_path / "shared")
    first = tokens("text", shared)
    assert tokens("alt", shared) == tokens("alt", str(tmp_path / "fresh")) != first


def test_a_push_without_a_posterior_leaves_none_of_an_earlier_push_in_the_repo(cache: str, tmp_path) -> None:
    """An EVON run pushed its posterior and card; an AdamW run then pushed its model to the same
    repo, which kept the EVON run's posterior files and card: a download paired the new weights
    with the old posterior (check_model only warns that the weights are not its mean)."""
    from hub_stub import HubStub

    from hf_evon import EVONPosterior
    from hf_evon.posterior.format import POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME
    from hf_evon.posterior.model_card import SECTION_START

    repo, token = "alice/tiny-lm", "hf_dummy_token"
    base = [*TINY, "--max-steps", "2", "--eval-every", "0", "--cache-dir", cache, "--push-to-hub", repo]
    with HubStub() as hub:
        env = dict(worker_env(), HF_ENDPOINT=hub.endpoint, HF_TOKEN=token, HF_HOME=str(tmp_path / "home"))
        env.pop("HF_HUB_OFFLINE", None)
        run([*base, "--output-dir", str(tmp_path / "evon")], env=env)
        files = hub.files(repo)
        assert {POSTERIOR_WEIGHTS_NAME, POSTERIOR_CONFIG_NAME, "model.safetensors"} <= set(files)
        assert SECTION_START in files["README.md"].decode()
        run([*base, "--optimizer", "adamw", "--output-dir", str(tmp_path / "adamw")], env=env)
        files = hub.files(repo)
        assert POSTERIOR_WEIGHTS_NAME not in files and POSTERIOR_CONFIG_NAME not in files
        assert SECTION_START not in files.get("README.md", b"").decode()
        local = open(os.path.join(tmp_path, "adamw", "model", "model.safetensors"), "rb").read()
        assert files["model.safetensors"] == local  # the AdamW run's weights
        missing = rf"no EVON posterior at {repo}: {POSTERIOR_CONFIG_NAME} is missing"
        with pytest.raises(FileNotFoundError, match=missing):
            EVONPosterior.from_pretrained(repo, token=token, endpoint=hub.endpoint, cache_dir=tmp_path / "dl")


@pytest.mark.parametrize(
    "flag, value",
    [("--ess", "0"), ("--hess-init", "-1"), ("--beta2", "1.5"), ("--weight-decay", "-1"), ("--clip-radius", "0"),
     ("--precondition-frequency", "0"), ("--lr", "nan")],
)  # fmt: skip
def test_an_invalid_evon_setting_is_an_argument_error_naming_the_flag(flag: str, value: str, capsys, example) -> None:
    """--ess 0 (and the other EVON settings EVON refuses) raised EVON's ValueError as a traceback,
    after the corpus had been tokenised and the model built."""
    error = argument_error(example.parse_args, [flag, value, "--output-dir", "unused"], capsys)
    assert f": error: {flag}" in error.replace("--beta1/", ""), error
    assert ": Invalid " in error, error  # EVON's own message (--beta2: "--beta1/--beta2: Invalid betas")
    if flag != "--lr":  # --lr is AdamW's rate of the matrices there
        example.parse_args([flag, value, "--optimizer", "adamw", "--output-dir", "unused"])  # AdamW has no EVON


@pytest.mark.parametrize("argv, message", [
    (["--optimizer", "adamw", "--lr", "-1"], "--lr: Invalid lr: -1.0"),
    (["--optimizer", "adamw", "--lr", "nan"], "--lr: Invalid lr: nan"),
    (["--adamw-lr", "-1"], "--adamw-lr: Invalid adamw_lr: -1.0"),
    (["--optimizer", "adamw", "--adamw-lr", "inf"], "--adamw-lr: Invalid adamw_lr: inf"),
    (["--optimizer", "adamw", "--adamw-weight-decay", "-1"], "--adamw-weight-decay: Invalid adamw_weight_decay: -1.0"),
    (["--min-lr-ratio", "-1"], "--min-lr-ratio must be a number in [0, 1]; got -1"),
    (["--optimizer", "adamw", "--min-lr-ratio", "nan"], "--min-lr-ratio must be a number in [0, 1]; got nan"),
    (["--min-lr-ratio", "1.5"], "--min-lr-ratio must be a number in [0, 1]; got 1.5"),
    (["--grad-clip", "-1"], "--grad-clip must be a finite number >= 0 (0: off); got -1"),
    (["--grad-clip", "nan"], "--grad-clip must be a finite number >= 0 (0: off); got nan"),
    (["--eval-every", "-1"], "--eval-every must be an integer >= 0 (0: only at the end); got -1"),
    (["--warmup-steps", "-5"], "--warmup-steps must be an integer >= 0; got -5"),
])  # fmt: skip
def test_a_bad_rate_or_schedule_setting_is_an_argument_error_for_every_optimizer(argv, message, capsys, example) -> None:
    """--optimizer adamw --lr -1 trained the matrices by gradient ascent (torch's AdamW checks only
    its default rate, not a group's) and saved the model, exit 0; --min-lr-ratio -1 drove the
    cosine schedule's rate below 0 halfway through: EVON refused that step with a traceback
    (the first half's training lost), AdamW ascended silently; --min-lr-ratio nan made every rate
    after the warmup NaN; --grad-clip nan or -1 turned the clipping off silently, --eval-every -1
    the intermediate evaluations, and --warmup-steps -5 the warmup."""
    assert message in argument_error(example.parse_args, [*argv, "--output-dir", "unused"], capsys)


def test_an_output_directory_that_is_a_file_is_an_argument_error(tmp_path, capsys, example) -> None:
    """A file at --output-dir raised FileExistsError from os.makedirs, with a traceback."""
    path = tmp_path / "out"
    path.write_text("keep me")
    error = argument_error(example.parse_args, ["--output-dir", str(path)], capsys)
    assert error.endswith(f"--output-dir {str(path)!r} is a file, not a directory")
    assert path.read_text() == "keep me"
    error = argument_error(example.parse_args, ["--output-dir", str(path / "sub")], capsys)  # a file above it
    assert error.endswith(f"--output-dir {str(path)!r} is a file, not a directory")


def test_a_cache_directory_that_is_a_file_and_a_seed_out_of_range_are_argument_errors(tmp_path, capsys, example) -> None:
    """--cache-dir at a file (or under one) raised NotADirectoryError, and --seed -1 torch's "Seed must
    be between 0 and 2**32 - 1", both after the corpus was read: each is refused naming its flag."""
    path = tmp_path / "cache"
    path.write_text("keep me")
    for given in (path, path / "sub"):
        error = argument_error(example.parse_args, ["--output-dir", str(tmp_path / "o"), "--cache-dir", str(given)], capsys)
        assert error.endswith(f"--cache-dir {str(path)!r} is a file, not a directory")
    error = argument_error(example.parse_args, ["--output-dir", str(tmp_path / "o"), "--seed", "-1"], capsys)
    assert error.endswith("--seed must be an integer from 0 to 2**32 - 1; got -1")


def test_a_push_that_cannot_happen_is_refused_before_training(tmp_path, capsys, example, monkeypatch) -> None:
    """--push-to-hub offline (HF_HUB_OFFLINE) or without a token trained and saved, then failed at the
    push (OfflineModeIsEnabled); both are refused before the corpus is read, naming the flag."""
    from huggingface_hub import constants

    argv = ["--output-dir", str(tmp_path / "o"), "--push-to-hub", "me/x"]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    error = argument_error(example.parse_args, argv, capsys)
    assert error.endswith("--push-to-hub me/x: HF_HUB_OFFLINE is set, so nothing can be pushed")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    error = argument_error(example.parse_args, argv, capsys)
    assert error.endswith("--push-to-hub me/x: no Hub token (set HF_TOKEN, or log in with `hf auth login`)")
    monkeypatch.setenv("HF_TOKEN", "hf_dummy")
    assert example.parse_args(argv).push_to_hub == "me/x"
