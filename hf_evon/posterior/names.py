"""Why a posterior's tensor name is not a parameter of a model: the hint its mismatch error gives
(``EVONPosterior.check_model``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from hf_evon.modeling import adapter_name_of

__all__ = ["name_hint"]


def name_hint(name: str, model: nn.Module, params: Mapping[str, Any]) -> str:
    """The likely cause where ``name`` matches a parameter of ``model`` (``params``, by name) but for
    a wrapper prefix (PEFT's ``base_model.model.``) or the PEFT adapter's name; else ""."""
    for other in params:
        if other.endswith("." + name):
            return f" (the model has {other!r}: was the posterior built from an unwrapped model?)"
        if name.endswith("." + other):
            return f" (the model has {other!r}: pass the wrapped model, e.g. the PeftModel, the posterior was built from)"
    parts = name.split(".")
    for other in params:
        segments = other.split(".")
        if len(segments) != len(parts):
            continue
        differ = [i for i, (a, b) in enumerate(zip(parts, segments, strict=True)) if a != b]
        if len(differ) == 1 and adapter_name_of(model, other) == segments[differ[0]]:
            ours, theirs = parts[differ[0]], segments[differ[0]]
            return (
                f" (the model's adapter is named {theirs!r}, the posterior's {ours!r}: load the adapter "
                f"under the posterior's name, e.g. PeftModel.from_pretrained(..., adapter_name={ours!r}))"
            )
    return ""
