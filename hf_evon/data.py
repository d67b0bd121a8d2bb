"""Offline text data for language-model runs: a corpus, a split, a BPE tokenizer, a token stream.

Why it is in the package: the examples, the benchmarks and the paper's reproduction scripts
all pre-train small language models on machines without network access, and they need the
same corpus, split and tokenizer to be comparable. This module is that one shared helper
(documented in the README, "Offline data"); it is not needed to use EVON.

The default corpus is the Python standard library found on this machine: its ``.py``
sources (test suites left out) and the ``pydoc`` topic texts. It is real, varied text (code,
docstrings, English prose) of ~13 MB, present wherever Python is. Any ``datasets`` text
dataset can be used instead (:func:`dataset_corpus`). Typical use::

    docs = stdlib_corpus(max_bytes=2_000_000)
    train_docs, val_docs = split_documents(docs, val_fraction=0.02)
    tokenizer = load_or_train_tokenizer("out/tokenizer", (t for _, t in train_docs), vocab_size=4096)
    train_ids = encode_documents(tokenizer, [t for _, t in train_docs])  # 1-D int32 stream

Everything is deterministic: the same Python installation gives the same documents, split
and tokens.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from hf_evon.fileio import Listed, listed_kind, local_directory, no_file_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "EOS",
    "Document",
    "dataset_corpus",
    "encode_documents",
    "load_or_train_tokenizer",
    "split_documents",
    "stdlib_corpus",
    "train_bpe_tokenizer",
]

Document = tuple[str, str]  # (name, text): the name keys the split and the subset order
EOS = "<|endoftext|>"  # the tokenizers' end-of-text (also bos/unk) token, appended to every document
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def _stable_hash(name: str) -> int:
    return zlib.crc32(name.encode())


def stdlib_corpus(max_bytes: int | None = None, include_docs: bool = True) -> list[Document]:
    """The standard library's ``.py`` files (no tests, no site-packages) and pydoc topics.

    With ``max_bytes`` a deterministic pseudo-random subset of whole documents is kept (the
    order is a hash of the file name), so a smaller corpus is still a mix of all modules.
    """
    root = os.path.dirname(os.__file__)
    docs: list[Document] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for fname in sorted(filenames):
            if not fname.endswith(".py") or fname.startswith("test_"):
                continue
            path = os.path.join(dirpath, fname)
            try:
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                docs.append((os.path.relpath(path, root), text))
    if include_docs:
        try:
            from pydoc_data.topics import topics
        except ImportError:  # pragma: no cover - stripped-down Pythons
            topics = {}
        docs += [(f"pydoc:{key}", text) for key, text in sorted(topics.items())]
    docs.sort(key=lambda d: (_stable_hash(d[0]), d[0]))
    if max_bytes is not None:
        kept, size = [], 0
        for doc in docs:
            if size >= max_bytes:
                break
            kept.append(doc)
            size += len(doc[1].encode())
        docs = kept
    return docs


def dataset_corpus(
    name: str,
    config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    max_bytes: int | None = None,
) -> list[Document]:
    """Documents from a ``datasets`` text dataset (a Hub name, or a local directory of text
    files), named ``"<name>:<row>"`` (a local directory by its own name: the split hashes the
    names, and must not depend on how its path is spelled); empty rows are skipped; with
    ``max_bytes`` reading stops once that many bytes were collected (the last document is kept
    whole).

    Only a name listed nowhere here goes to ``datasets`` as a Hub dataset
    (:func:`~hf_evon.fileio.local_directory`): a local path this user cannot look up raises the
    OSError naming it, and a file or a link that reaches nothing is refused naming it, which
    ``datasets`` would look up on the Hub."""
    from datasets import load_dataset

    local = local_directory(
        name,
        lambda why: FileNotFoundError(f"dataset_corpus: {name!r} is {why}"),
        lambda: ValueError(f"dataset_corpus: {name!r} is a file; pass the directory that holds it"),
    )
    ds = load_dataset(name, config, split=split)
    label = os.path.basename(os.path.abspath(name)) if local else name
    docs, size = [], 0
    for i, row in enumerate(ds):
        text = row[text_column]
        if not text or not text.strip():
            continue
        docs.append((f"{label}:{i}", text))
        size += len(text.encode())
        if max_bytes is not None and size >= max_bytes:
            break
    return docs


def split_documents(
    docs: list[Document], val_fraction: float = 0.02
) -> tuple[list[Document], list[Document]]:
    """``(train, validation)``: a document goes to validation when a hash of its name falls in
    the first ``val_fraction`` of the hash range, so whole files stay on one side (no leakage
    inside a file) and the split does not depend on the corpus order or size. A corpus too
    small to get a validation document gives its last one (for a ``val_fraction`` above 0)."""
    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"split_documents: val_fraction must be in [0, 1]; got {val_fraction!r}")
    bound = int(val_fraction * 10_000)
    train = [d for d in docs if (_stable_hash(d[0]) >> 7) % 10_000 >= bound]
    val = [d for d in docs if (_stable_hash(d[0]) >> 7) % 10_000 < bound]
    if not val and len(train) > 1 and val_fraction > 0:  # tiny corpora: keep one validation document
        val, train = train[-1:], train[:-1]
    return train, val


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style) trained on ``texts``, as a transformers fast tokenizer.

    Byte-level, so any text encodes and decodes back unchanged; :data:`EOS` is its only
    special token (eos, bos and unk). Needs the ``tokenizers`` package (the examples extra).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS)


def load_or_train_tokenizer(
    directory: str, texts: Iterable[str], vocab_size: int = 4096
) -> PreTrainedTokenizerFast:
    """Load the tokenizer saved in ``directory`` if it was trained for this ``vocab_size``, else train
    and save it (training on the standard library takes tens of seconds; later runs reuse the file).
    The size asked for is saved with it: a corpus too small to fill it gives fewer tokens."""
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(directory, "tokenizer.json")
    kind = listed_kind(path)  # one this user cannot look up raises the OSError naming it
    if kind not in (None, Listed.FILE):  # training would end in a save through the link, or onto the entry
        error = ValueError if kind is Listed.NOT_REGULAR else FileNotFoundError
        raise error(f"load_or_train_tokenizer: {path!r} is {no_file_text(path, kind)}: remove it, or pass another directory")
    if kind is Listed.FILE:
        tok = PreTrainedTokenizerFast.from_pretrained(directory)
        if tok.init_kwargs.get(_REQUESTED_VOCAB_SIZE, len(tok)) == vocab_size:
            return tok
    tok = train_bpe_tokenizer(texts, vocab_size)
    tok.init_kwargs[_REQUESTED_VOCAB_SIZE] = vocab_size  # saved in tokenizer_config.json
    tok.save_pretrained(directory)
    return tok


_REQUESTED_VOCAB_SIZE = "requested_vocab_size"


def _batched(items: list[str], size: int) -> Iterator[list[str]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """One 1-D token stream (int32): every document followed by the end-of-text token, in order
    (language-model blocks are then slices of it)."""
    eos = tokenizer.eos_token_id
    chunks: list[torch.Tensor] = []
    for batch in _batched(texts, 256):
        # a document's own "<|endoftext|>" is text: the one end-of-text token is the one appended
        for ids in tokenizer(batch, add_special_tokens=False, split_special_tokens=True)["input_ids"]:
            chunks.append(torch.tensor(ids + [eos], dtype=torch.int32))
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int32)
