"""How the ``hf-evon`` commands write text: sizes, numbers, a completion's text, and strings from
files shown as a terminal would not act on them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# Posterior config entry written by post-hoc calibration: {"ess": float | "inf", ...}
CALIBRATION_KEY = "calibration"


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


def calibration_text(config: Mapping[str, Any], scales: Mapping[str, float]) -> str:
    """The posterior ``config``'s ``calibration`` entry, with its source; without one, where ``with_ess`` or
    ``scale_ess`` set the scale (``scales``: each covered name's ζ), what the model card says of it."""
    from hf_evon.posterior.config import POSTERIOR_CONFIG_NAME
    from hf_evon.posterior.model_card import hand_set_scale_text

    calibration = config.get(CALIBRATION_KEY)
    if calibration is None:
        hand = hand_set_scale_text(config, scales)
        return "none recorded" + (f"; {hand}" if hand else "")
    source = f"(from {POSTERIOR_CONFIG_NAME}, '{CALIBRATION_KEY}')"
    if isinstance(calibration, dict):
        return ", ".join(f"{k} {number_text(v)}" for k, v in calibration.items()) + " " + source
    return f"{calibration!r} {source}"
