"""How the ``hf-evon`` commands write text: sizes, numbers, a completion's text, and strings from
files shown as a terminal would not act on them."""

from __future__ import annotations

import math
from typing import Any


def size_text(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def number_text(x: Any) -> str:
    """A float to 4 significant digits ("inf" for infinity), anything else as ``str`` gives it."""
    return "inf" if isinstance(x, float) and math.isinf(x) else (f"{x:.4g}" if isinstance(x, float) else str(x))


def printable(text: str) -> str:
    """``text`` with every character a terminal acts on (escape sequences, line breaks, other
    controls) written as its Python escape: a posterior's config comes from anyone, and its
    strings are printed."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def completion_text(tokenizer: Any, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text ``new_ids`` add after ``prompt_ids``: the full sequence's less the prompt's, which
    keeps the space a SentencePiece tokenizer marks in a word's token and drops alone."""
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full = tokenizer.decode(prompt_ids + new_ids, skip_special_tokens=True)
    return full[len(prompt) :] if full.startswith(prompt) else tokenizer.decode(new_ids, skip_special_tokens=True)
