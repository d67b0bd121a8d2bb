"""Labelled texts from the running interpreter's standard library (offline, deterministic): the
docstrings of five topics' modules (``stdlib_docstring_dataset``), and the readers other tasks
build on (``source_files``, ``parse_source``, ``docstrings``)."""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import sysconfig
import warnings
from collections.abc import Iterator
from typing import Any

TOPICS: dict[str, list[str]] = {
    "files and operating system": [
        "os.py", "shutil.py", "pathlib.py", "glob.py", "fnmatch.py", "tempfile.py", "stat.py", "fileinput.py",
        "filecmp.py", "zipfile.py", "tarfile.py", "gzip.py", "bz2.py", "lzma.py", "posixpath.py", "ntpath.py",
        "genericpath.py", "_pyio.py", "mailbox.py", "shelve.py", "dbm", "sqlite3",
    ],
    "text processing": [
        "re", "string.py", "textwrap.py", "difflib.py", "html", "csv.py", "codecs.py", "gettext.py", "locale.py",
        "shlex.py", "tokenize.py", "pprint.py", "reprlib.py", "xml",
    ],
    "numbers and math": [
        "statistics.py", "_pydecimal.py", "fractions.py", "numbers.py", "random.py", "colorsys.py", "heapq.py",
        "bisect.py", "calendar.py", "datetime.py", "_strptime.py",
    ],
    "networking and internet": [
        "socket.py", "ssl.py", "http", "urllib", "email", "smtplib.py", "ftplib.py", "imaplib.py", "poplib.py",
        "ipaddress.py", "socketserver.py", "nntplib.py", "xmlrpc", "wsgiref", "mimetypes.py", "selectors.py",
    ],
    "concurrency and processes": [
        "threading.py", "multiprocessing", "asyncio", "concurrent", "queue.py", "sched.py", "subprocess.py",
        "signal.py",
    ],
}  # fmt: skip


def source_files(stdlib: str, entry: str) -> Iterator[str]:
    path = os.path.join(stdlib, entry)
    if os.path.isfile(path):
        yield path
        return
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        if {"test", "tests"} & set(root.split(os.sep)):
            continue
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(root, name)


def parse_source(path: str) -> ast.Module | None:
    """The syntax tree of a Python source file, or None where it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as fh:
            return ast.parse(fh.read())
    except (SyntaxError, UnicodeDecodeError, OSError):
        return None


@functools.cache  # parsing a topic's sources takes seconds; the tasks built from them read each file again
def docstrings(path: str) -> tuple[str, ...]:
    """The first paragraph (whitespace collapsed, 25 characters or more) of each function's and class's
    docstring in the source file ``path``, in the syntax tree's order."""
    tree = parse_source(path)
    if tree is None:
        return ()
    paragraphs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            doc = ast.get_docstring(node)
            if doc:
                paragraph = " ".join(doc.strip().split("\n\n")[0].split())
                if len(paragraph) >= 25:
                    paragraphs.append(paragraph)
    return tuple(paragraphs)


def stdlib_docstring_dataset(train_per_class: int, eval_per_class: int) -> tuple[Any, Any, list[str]]:
    """(train, test, label names): stdlib docstrings labelled by the topic of their module."""
    from datasets import Dataset

    stdlib = sysconfig.get_paths()["stdlib"]
    seen: set[str] = set()
    splits: dict[str, dict[str, list]] = {
        "train": {"text": [], "label": []},
        "test": {"text": [], "label": []},
    }
    for label, entries in enumerate(TOPICS.values()):
        texts = []
        for entry in entries:
            for path in source_files(stdlib, entry):
                for doc in docstrings(path):
                    if doc not in seen:
                        seen.add(doc)
                        texts.append(doc)
        # deterministic split and order: by a hash of the text (1 in 4 to the test split)
        keyed = sorted(texts, key=lambda t: hashlib.sha256(t.encode()).hexdigest())
        test = [t for t in keyed if int(hashlib.sha256(t.encode()).hexdigest()[:8], 16) % 4 == 0]
        train = [t for t in keyed if int(hashlib.sha256(t.encode()).hexdigest()[:8], 16) % 4 != 0]
        for split, chosen in (("train", train[:train_per_class]), ("test", test[:eval_per_class])):
            splits[split]["text"] += chosen
            splits[split]["label"] += [label] * len(chosen)
    if min(splits["test"]["label"].count(i) for i in range(len(TOPICS))) == 0:
        raise RuntimeError(f"no docstrings found under {stdlib}: is the Python source installed?")
    for split, asked in (("train", train_per_class), ("test", eval_per_class)):
        counts = [splits[split]["label"].count(i) for i in range(len(TOPICS))]
        if min(counts) < asked:  # the classes are then not balanced: say so, with what there is
            warnings.warn(
                f"{split}: {asked} texts per class asked, but the standard library here holds "
                f"{dict(zip(TOPICS, counts))}: the classes are not balanced",
                stacklevel=2,
            )
    train = Dataset.from_dict(splits["train"]).shuffle(seed=0)
    test = Dataset.from_dict(splits["test"])
    return train, test, list(TOPICS)
