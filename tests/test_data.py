"""``hf_evon.data``: the offline corpus, split, tokenizer and token stream the examples share."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from conftest import refuse_lookups

from hf_evon import data

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def corpus() -> list[data.Document]:
    return data.stdlib_corpus()


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return data.train_bpe_tokenizer((t for _, t in corpus[:40]), vocab_size=600)


def test_stdlib_corpus_is_the_standard_library_without_tests(corpus):
    root = os.path.dirname(os.__file__)
    names = [n for n, _ in corpus]
    assert len(names) == len(set(names))
    sources = [n for n in names if not n.startswith("pydoc:")]
    assert "os.py" in sources and "json/__init__.py" in sources
    assert not any(os.path.basename(n).startswith("test_") for n in sources)
    assert not any({"site-packages", "tests", "test"} & set(n.split(os.sep)) for n in sources)
    name, text = next(d for d in corpus if d[0] == "os.py")
    with open(os.path.join(root, "os.py"), encoding="utf-8") as fh:
        assert text == fh.read()
    from pydoc_data.topics import topics

    assert {n for n in names if n.startswith("pydoc:")} == {f"pydoc:{k}" for k in topics}
    assert names == sorted(names, key=lambda n: (zlib.crc32(n.encode()), n))  # order: the documented hash
    assert not any(n.startswith("pydoc:") for n, _ in data.stdlib_corpus(include_docs=False))


def test_stdlib_corpus_max_bytes_keeps_a_prefix_of_whole_documents(corpus):
    small = data.stdlib_corpus(max_bytes=200_000)
    assert small == corpus[: len(small)]
    sizes = [len(t.encode()) for _, t in small]
    assert sum(sizes[:-1]) < 200_000 <= sum(sizes)


def test_split_documents_by_name_hash(corpus):
    train, val = data.split_documents(corpus, val_fraction=0.05)
    assert len(train) + len(val) == len(corpus) and not {n for n, _ in train} & {n for n, _ in val}
    for name, _ in val:
        assert (zlib.crc32(name.encode()) >> 7) % 10_000 < 500
    for name, _ in train:
        assert (zlib.crc32(name.encode()) >> 7) % 10_000 >= 500
    # the split of a document does not depend on the rest of the corpus
    train_small, val_small = data.split_documents(corpus[::3], val_fraction=0.05)
    assert set(val_small) == set(val) & set(corpus[::3])
    # a corpus too small for a hash-drawn validation document still gets one
    few = [d for d in train[:3]]
    assert data.split_documents(few, val_fraction=0.05) == (few[:2], few[2:])
    # no validation asked for: none (the fallback gave one); a fraction outside [0, 1]: refused
    assert data.split_documents(corpus, val_fraction=0.0) == (corpus, [])
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\]"):
            data.split_documents(corpus, val_fraction=bad)


def test_bpe_tokenizer_round_trips_any_text(tokenizer):
    assert len(tokenizer) == 600
    assert tokenizer.eos_token == data.EOS and tokenizer.convert_tokens_to_ids(data.EOS) == 0
    for text in ["def f(x):\n    return x ** 2  # squared\n", "naïve café — ∑ 文字 🙂", ""]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text


def test_load_or_train_tokenizer_reuses_the_saved_one(tmp_path, corpus):
    texts = [t for _, t in corpus[:30]]
    first = data.load_or_train_tokenizer(str(tmp_path), texts, vocab_size=500)
    assert (tmp_path / "tokenizer.json").is_file() and len(first) == 500
    # same size: loaded from the file (nothing to train on here)
    again = data.load_or_train_tokenizer(str(tmp_path), [], vocab_size=500)
    assert again.get_vocab() == first.get_vocab()
    # another size: trained again on the texts given, and saved over the old one
    other = data.load_or_train_tokenizer(str(tmp_path), texts, vocab_size=450)
    assert len(other) == 450 and len(data.load_or_train_tokenizer(str(tmp_path), [], vocab_size=450)) == 450


def test_a_tokenizer_its_corpus_could_not_fill_is_reused_too(tmp_path):
    # 2 short texts fill ~270 of the 1000 tokens asked for: the size check failed and every call retrained
    small = data.load_or_train_tokenizer(str(tmp_path), ["hello world " * 10, "abc def"], vocab_size=1000)
    assert len(small) < 1000
    written = (tmp_path / "tokenizer.json").stat().st_mtime_ns
    again = data.load_or_train_tokenizer(str(tmp_path), [], vocab_size=1000)  # nothing to train on: loaded
    assert again.get_vocab() == small.get_vocab() and (tmp_path / "tokenizer.json").stat().st_mtime_ns == written


def test_encode_documents_is_each_document_then_eos(tokenizer):
    texts = ["import os\n", "x = 1", "print('hi')\n"] * 100  # more than one encoding batch
    stream = data.encode_documents(tokenizer, texts)
    expected = []
    for text in texts:
        expected += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert stream.dtype == torch.int32 and stream.tolist() == expected
    assert data.encode_documents(tokenizer, []).shape == (0,)


def test_dataset_corpus_from_a_local_text_directory(tmp_path):
    (tmp_path / "a.txt").write_text("first line\n\nsecond line\nthird line\n")
    docs = data.dataset_corpus(str(tmp_path))
    assert docs == [
        (f"{tmp_path.name}:0", "first line"),
        (f"{tmp_path.name}:2", "second line"),
        (f"{tmp_path.name}:3", "third line"),
    ]
    assert data.dataset_corpus(str(tmp_path), max_bytes=11) == docs[:2]


def test_a_local_datasets_documents_are_named_whatever_its_path_spelling(tmp_path, monkeypatch):
    """The split hashes the documents' names, which held the path as given: the same directory
    spelled with a trailing slash, or relative, got another validation split."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("\n".join(f"line {i} of the text" for i in range(60)))
    monkeypatch.chdir(tmp_path)
    spellings = [str(folder), f"{folder}/", "corpus", "./corpus/"]
    corpora = [data.dataset_corpus(path) for path in spellings]
    assert all(c == corpora[0] for c in corpora) and corpora[0][0] == ("corpus:0", "line 0 of the text")
    assert len({tuple(data.split_documents(c, 0.2)[1]) for c in corpora}) == 1


@pytest.mark.parametrize("kind", ["EACCES", "file", "dangling link", "loop"])
def test_a_local_dataset_path_listed_here_that_is_no_directory_to_read_is_not_sent_to_the_hub(
    tmp_path, monkeypatch, kind
):
    """dataset_corpus of a local path this user cannot look up (``data/wiki`` where ``data`` may not be
    searched: EACCES, simulated by os.lstat and os.stat, the tests run as root), a file, a link to nothing
    (a disk not mounted) or a loop of links: datasets takes any of them for no directory and looks the name
    up as a Hub dataset (online, a dataset of that name there is loaded in its place). The PermissionError
    naming it is raised, and the others an error naming it and what it is; datasets is not asked."""
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail(f"sent to datasets: {a}"))
    monkeypatch.chdir(tmp_path)
    if kind == "EACCES":
        (tmp_path / "data" / "wiki").mkdir(parents=True)
        refuse_lookups(monkeypatch, lambda path: path.startswith("data" + os.sep))
        name, error, message = "data/wiki", PermissionError, "[Errno 13] Permission denied: 'data/wiki'"
    elif kind == "file":
        (tmp_path / "wiki.txt").write_text("a line\n")
        name, error = "wiki.txt", ValueError
        message = "dataset_corpus: 'wiki.txt' is a file; pass the directory that holds it"
    else:
        name, error = "wiki", FileNotFoundError
        (tmp_path / name).symlink_to(name if kind == "loop" else "moved-away")
        why = "'wiki', which leads into a loop of links (ELOOP)" if kind == "loop" else "'moved-away', which does not exist"
        message = f"dataset_corpus: 'wiki' is a link to {why}"
    with pytest.raises(error) as err:
        data.dataset_corpus(name)
    assert str(err.value) == message


@pytest.mark.parametrize("kind", ["EACCES", "directory", "dangling link", "loop"])
def test_a_saved_tokenizer_file_listed_but_no_file_is_not_trained_over(tmp_path, monkeypatch, kind):
    """load_or_train_tokenizer where the directory's tokenizer.json cannot be looked up (EACCES, simulated by
    os.lstat and os.stat, the tests run as root), or is a directory, a link to nothing (a disk not mounted)
    or a loop of links: os.path.isfile took it for no saved tokenizer, one was trained (tens of seconds on
    the standard library), and its save wrote through the link or failed on the entry. The PermissionError
    naming it is raised, and the others an error naming the file and what it is, before any training."""
    monkeypatch.setattr(data, "train_bpe_tokenizer", lambda *a, **k: pytest.fail("trained"))
    file = tmp_path / "tokenizer.json"
    if kind == "EACCES":
        file.write_text("{}")
        refuse_lookups(monkeypatch, lambda path: path == str(file))
        error, message = PermissionError, f"[Errno 13] Permission denied: {str(file)!r}"
    else:
        if kind == "directory":
            file.mkdir()
            error, why = ValueError, "not a regular file (a directory, named pipe or device)"
        else:
            target = file if kind == "loop" else tmp_path / "moved-away"
            file.symlink_to(target)
            end = "leads into a loop of links (ELOOP)" if kind == "loop" else "does not exist"
            error, why = FileNotFoundError, f"a link to {str(target)!r}, which {end}"
        message = f"load_or_train_tokenizer: {str(file)!r} is {why}: remove it, or pass another directory"
    with pytest.raises(error) as err:
        data.load_or_train_tokenizer(str(tmp_path), ["some text"], vocab_size=300)
    assert str(err.value) == message


def test_a_documents_own_end_of_text_string_is_text_not_the_token(tokenizer):
    """A document holding the literal "<|endoftext|>" got an end-of-text token in its middle: a
    document boundary inside it. The string is encoded as text; the one token ends the document."""
    stream = data.encode_documents(tokenizer, [f"a {data.EOS} b"]).tolist()
    assert stream.count(tokenizer.eos_token_id) == 1 and stream[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(stream[:-1]) == f"a {data.EOS} b"
