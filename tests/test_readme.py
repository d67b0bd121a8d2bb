"""The README's "Four ways to use it" snippets run as written, in order, after the set-up: its
Python blocks, joined in the README's order, run in a fresh interpreter in an empty directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hf_evon import EVONPosterior

REPO_ROOT = Path(__file__).resolve().parents[1]
# what the test appends: the decoded sequence's shape and the posterior's matrices, printed
CHECK = """
print("SEQUENCES", tuple(out.shape))
print("POSTERIOR", len(posterior.names))
"""


def readme_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)


def test_readme_snippets_run_in_order(tmp_path) -> None:
    snippets = readme_snippets()
    assert len(snippets) == 5  # the model and data, then the four ways
    script = tmp_path / "readme.py"
    script.write_text("\n".join(snippets) + CHECK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    shape = re.search(r"^SEQUENCES \((\d+), (\d+)\)$", run.stdout, re.M)
    assert shape is not None, run.stdout[-2000:]
    prompt, new = 3, 16  # the snippet's prompt and max_new_tokens
    assert int(shape[1]) == 1 and prompt < int(shape[2]) <= prompt + new
    # the posterior the snippets saved reloads here, with the matrices the loop trained
    saved = EVONPosterior.from_pretrained(str(tmp_path / "out" / "lm"))
    assert f"POSTERIOR {len(saved.names)}" in run.stdout and len(saved.names) > 0
    assert (tmp_path / "out" / "trainer" / "evon_posterior.safetensors").is_file()


def heading_anchors(path: Path) -> set[str]:
    """The #anchors a Markdown file defines: GitHub's slug of each heading outside code blocks
    (lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``, ``-1``, ``-2`` on repeats)
    and each ``<a id="...">``."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors | set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))


def doc_links(path: Path) -> list[str]:
    """The relative targets of the Markdown links and images in ``path``, outside code."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    links = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M)
    return [link for link in links if not re.match(r"[a-z][a-z0-9+.-]*:", link)]


def test_doc_links_and_anchors_resolve() -> None:
    """Every relative link of README.md, docs/*.md and the examples' READMEs names a file that
    exists, and its #anchor a heading (or ``<a id>``) of that file; so does every
    ``docs/NAME.md#anchor`` the library, examples and benchmarks cite."""
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    pages += sorted((REPO_ROOT / "examples").rglob("README.md"))
    broken = []
    for page in pages:
        for link in doc_links(page):
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.relative_to(REPO_ROOT)}: {link} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
                broken.append(f"{page.relative_to(REPO_ROOT)}: {link} (no such anchor)")
    sources = [p for d in ("hf_evon", "examples", "benchmarks") for p in sorted((REPO_ROOT / d).rglob("*.py"))]
    for source in sources + pages:  # cited in text: docs/NAME.md#anchor, or NAME.md#anchor within docs/
        for docs, name, anchor in re.findall(r"(?<![\w/.-])(docs/)?([\w-]+\.md)#([\w-]+)", source.read_text()):
            path = REPO_ROOT / "docs" / name
            if (docs or source.parent.name == "docs") and (not path.exists() or anchor not in heading_anchors(path)):
                broken.append(f"{source.relative_to(REPO_ROOT)}: {docs}{name}#{anchor}")
    assert not broken, "\n".join(broken)
    assert len(pages) >= 10  # the pages above were all found


def config_table(config: str = "EVONConfig") -> dict[str, str]:
    """docs/trainer.md's table of ``config``'s fields: each field's name -> its default column."""
    text = (REPO_ROOT / "docs" / "trainer.md").read_text()
    _, found, rest = text.partition(f"## {config}'s fields\n")
    assert found, f"docs/trainer.md has no section '{config}'s fields'"
    section = rest.split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \| [^|\n]* \| `([^`\n]*)` \|", section, re.M))


def test_evon_config_fields_documented() -> None:
    """Every field ``EVONConfig`` adds to ``TrainingArguments`` (or whose default it changes) is a row
    of docs/trainer.md's table, its default column ``EVONConfig``'s default, and every field the
    table, docs/trainer.md and docs/usage.md name exists. (22 of the fields were in neither page.)"""
    import ast
    from dataclasses import MISSING, fields

    from transformers import TrainingArguments

    import hf_evon
    import hf_evon.trainer
    from hf_evon import EVONConfig

    base = {f.name: f.default for f in fields(TrainingArguments)}
    ours = {f.name: f.default for f in fields(EVONConfig) if f.name not in base or f.default != base[f.name]}
    assert MISSING not in ours.values()
    table = config_table()
    assert sorted(set(ours) - set(table)) == [], "EVONConfig fields without a row in docs/trainer.md"
    assert sorted(set(table) - set(ours)) == [], "rows of docs/trainer.md that are no EVONConfig field"
    wrong = {name: (table[name], default) for name, default in ours.items() if ast.literal_eval(table[name]) != default}
    assert wrong == {}, "docs/trainer.md's default (first) against EVONConfig's (second)"
    # the fields and keyword arguments the pages cite: `evon_*`/`bma_*` names and EVONConfig(name=...)
    every = {f.name for f in fields(EVONConfig)} | {f.name for f in fields(hf_evon.trainer.EVONSeq2SeqConfig)}
    api = set(dir(hf_evon)) | set(dir(hf_evon.trainer))
    unknown = []
    for page in ("trainer.md", "usage.md"):
        text = (REPO_ROOT / "docs" / page).read_text()
        cited = re.findall(r"`((?:evon|bma)_[a-z0-9_]+)(?:=[^`]*)?`", text)
        cited += [kw for call in re.findall(r"EVONConfig\(([^)]*)\)", text) for kw in re.findall(r"(\w+)=", call)]
        unknown += [f"{page}: {name}" for name in cited if name not in every and name not in api]
    assert unknown == []


def test_evon_seq2seq_config_fields_documented() -> None:
    """The fields ``EVONSeq2SeqConfig`` adds to ``EVONConfig`` and ``Seq2SeqTrainingArguments`` are the rows
    of docs/trainer.md's table of its fields, each default column its default."""
    import ast
    from dataclasses import fields

    from transformers import Seq2SeqTrainingArguments

    from hf_evon import EVONConfig
    from hf_evon.trainer import EVONSeq2SeqConfig

    inherited = {f.name for f in fields(EVONConfig)} | {f.name for f in fields(Seq2SeqTrainingArguments)}
    own = {f.name: f.default for f in fields(EVONSeq2SeqConfig) if f.name not in inherited}
    table = config_table("EVONSeq2SeqConfig")
    assert own and sorted(table) == sorted(own)
    assert {name: ast.literal_eval(default) for name, default in table.items()} == own


def posterior_config_rows() -> dict[str, str]:
    """docs/posterior-format.md's table of config keys: each key its first column names -> its row."""
    text = (REPO_ROOT / "docs" / "posterior-format.md").read_text()
    _, found, rest = text.partition("## The config\n")
    assert found, "docs/posterior-format.md has no section 'The config'"
    section = rest.split("\nEach `parameters` entry", 1)[0]
    rows = {}
    for first, row in re.findall(r"^\| ([^|\n]*) \|(.*)$", section, re.M):
        rows.update((key, row) for key in re.findall(r"`(\w+)`", first))
    return rows


def test_posterior_config_keys_documented() -> None:
    """Every key of a posterior config (a ``PosteriorConfig`` field, or a key a fresh save writes) is a
    row of docs/posterior-format.md's table and every row such a key, and the ``calibration`` row names
    every key of the record that loading checks. (The record's ``scanned`` and ``screened``, refused
    on load where not a boolean or a list of numbers, were missing: the page said other keys are kept
    as written.)"""
    import json
    from dataclasses import fields

    import torch

    from hf_evon import build_optimizer
    from hf_evon.posterior.config import POSTERIOR_CONFIG_NAME, PosteriorConfig
    from hf_evon.posterior.json_rules import _CALIBRATION_KEYS

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optimizer = build_optimizer(model)
    for _ in range(2):  # the first step only builds the eigenbases
        with optimizer.sampled_params(train=True):
            model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    with __import__("tempfile").TemporaryDirectory() as directory:
        EVONPosterior.from_optimizer(optimizer, model).save_pretrained(directory)
        written = set(json.loads((Path(directory) / POSTERIOR_CONFIG_NAME).read_text()))
    schema = {f.name for f in fields(PosteriorConfig)} - {"extra", "key_order", "source"}
    rows = posterior_config_rows()
    assert sorted((schema | written) - set(rows)) == [], "config keys without a row in docs/posterior-format.md"
    assert sorted(set(rows) - schema - written) == [], "rows of docs/posterior-format.md that no config holds"
    named = set(re.findall(r"`(\w+)`", rows["calibration"]))
    assert sorted({key for key, _, _ in _CALIBRATION_KEYS} - named) == [], "calibration keys checked on load"


def test_command_line_options_documented() -> None:
    """Every ``--option`` docs/usage.md's command-line section gives a subcommand is one of its options,
    and every ``(default X)`` of an option's help is the option's default."""
    import argparse

    from hf_evon.cli import build_parser

    parser = build_parser()
    (commands,) = [a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    text = (REPO_ROOT / "docs" / "usage.md").read_text()
    _, found, rest = text.partition("## Command line\n")
    assert found, "docs/usage.md has no section 'Command line'"
    items = re.findall(r"^- `hf-evon (\w+)(.*?)(?=^- |^\S|\Z)", rest.split("\n## ", 1)[0], re.M | re.S)
    assert sorted(name for name, _ in items) == sorted(commands)
    unknown, wrong = [], []
    for name, item in items:
        options = {o for a in commands[name]._actions for o in a.option_strings}
        unknown += [f"{name} {o}" for o in re.findall(r"(?<![\w-])--[a-z][a-z-]*", item) if o not in options]
        for action in commands[name]._actions:
            for stated in re.findall(r"\(default (-?[\d.e+-]+)[;)]", action.help or ""):
                if float(stated) != action.default:
                    wrong.append(f"{name} {action.option_strings}: help {stated}, default {action.default!r}")
    assert unknown == [], "options docs/usage.md names that the subcommand does not have"
    assert wrong == [], "help texts whose stated default is not the option's"


# docs/usage.md's Python blocks, each after the set-up of what it takes as given (a tiny model built
# from a config, a few batches), keyed by the code of the block's first line; (old, new) edits make a block fit
# this machine (no Hub, a CPU), each edit's old text checked to be in the block
_LM = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=128,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0))
ids = torch.randint(1, 64, (8, 12))
loader = [{"input_ids": ids[i : i + 4], "labels": ids[i : i + 4]} for i in (0, 4)]
"""
_LM_EVON = _LM + "import hf_evon\nfrom hf_evon import EVONPosterior, build_optimizer\noptimizer = build_optimizer(model)\n"
_CLASSIFIER = """
import torch
from transformers import BertConfig, BertForSequenceClassification
torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                 num_attention_heads=2, intermediate_size=32, num_labels=3))
def examples(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 50, (6,), generator=g), "labels": int(torch.randint(0, 3, (), generator=g))}
            for _ in range(n)]
train, dev, held_out, test = examples(32, 0), examples(16, 1), examples(16, 2), examples(8, 3)
"""
_SFT = """
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate("<eos> a b c d".split())}, unk_token="<eos>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
model = GPT2LMHeadModel(GPT2Config(vocab_size=5, n_embd=16, n_layer=1, n_head=2, eos_token_id=0, pad_token_id=0))
texts, dev = Dataset.from_dict({"text": ["a b c d"] * 8}), Dataset.from_dict({"text": ["d c b a"] * 2})
"""
_ACCELERATE = _LM_EVON + "from accelerate import Accelerator\naccelerator = Accelerator(cpu=True)\n"
USAGE_BLOCKS = {
    "from hf_evon import build_optimizer": (_LM, []),
    "from hf_evon import EVONConfig, EVONTrainer": (_CLASSIFIER, [('"out"', '"out", num_train_epochs=1')]),
    "from hf_evon.trainer import EVONSFTConfig, EVONSFTTrainer": (_SFT, []),  # as written: bf16 only on a GPU
    "from hf_evon import EVONPosterior, calibrate_posterior": (_LM_EVON + "val_batches = loader\n", []),
    "import torch": (
        "import torch\nfrom hf_evon import EVONPosterior, build_optimizer\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))\n"
        "posterior = EVONPosterior.from_optimizer(build_optimizer(model), model)\nx = torch.randn(5, 4)\n",
        [],
    ),
    "from hf_evon import EVONPosterior": (_LM_EVON, [('posterior.push_to_hub("me/my-model")', "")]),
    "from hf_evon import generate_bma": (
        _LM_EVON + "posterior = EVONPosterior.from_optimizer(optimizer, model)\n"
        "input_ids = ids[:2, :4]\nmask = torch.ones_like(input_ids)\n",
        [],
    ),
    "from hf_evon import prepare_distributed": (_ACCELERATE, []),
    "for micro_batches in steps:": (
        _ACCELERATE.replace("cpu=True", "cpu=True, gradient_accumulation_steps=2")
        + "model, optimizer = accelerator.prepare(model, optimizer)\n"
        "optimizer = hf_evon.prepare_distributed(model, optimizer)\nsteps, max_norm = [loader], 1.0\n",
        [],
    ),
    "from hf_evon.data import encode_documents, load_or_train_tokenizer, split_documents, stdlib_corpus": ("", []),
}


def test_usage_snippets_run(tmp_path) -> None:
    """Every Python block of docs/usage.md runs as written after the set-up of what it takes as given,
    each in a fresh namespace of one interpreter, in an empty directory. (No test ran them.)"""
    blocks = re.findall(r"```python\n(.*?)```", (REPO_ROOT / "docs" / "usage.md").read_text(), re.S)
    first_lines = [block.splitlines()[0].split("#")[0].strip() for block in blocks]  # its code, no comment
    assert first_lines == list(USAGE_BLOCKS), "a block of docs/usage.md without its set-up here (or one gone)"
    import importlib.util

    # the SFT block needs the trl extra, which tests/test_trl.py also skips without
    needs_trl = {i for i, line in enumerate(first_lines) if "EVONSFT" in line}
    skipped = needs_trl if importlib.util.find_spec("trl") is None else set()
    parts = []
    for i, block in enumerate(blocks):
        if i in skipped:
            continue
        setup, edits = USAGE_BLOCKS[first_lines[i]]
        for old, new in edits:
            assert old in block, (first_lines[i], old)
            block = block.replace(old, new)
        parts.append(f"exec({setup + block!r}, {{}})\nprint('BLOCK', {i}, flush=True)\n")
    script = tmp_path / "usage.py"
    script.write_text("".join(parts))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env
    )
    assert run.returncode == 0, run.stdout[-500:] + run.stderr[-3000:]
    assert re.findall(r"^BLOCK (\d+)$", run.stdout, re.M) == [str(i) for i in range(len(blocks)) if i not in skipped]
    # what the blocks' comments name: the posterior's two files, the tokenizer the data helper trained
    assert {"evon_posterior.safetensors", "evon_posterior_config.json"} <= set(os.listdir(tmp_path / "out"))
    assert (tmp_path / "out" / "tok" / "tokenizer.json").is_file()
