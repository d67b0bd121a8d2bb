"""Why a posterior's tensor name is not a parameter of a model: the hint its mismatch error gives
(``EVONPosterior.check_model``), and the names a PEFT adapter's own save drops, of which the
posterior's save warns (``EVONPosterior.save_pretrained``)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from hf_evon.modeling import adapter_name_of
from hf_evon.optim.checks import outside_stacklevel

__all__ = ["name_hint", "peft_unsaved_module", "warn_peft_unsaved"]

# PEFT saves a prompt-learning adapter as its prompt encoder's output (``prompt_embeddings``, loaded
# back as ``embedding.weight``), never the modules that compute that output from the embedding: it
# builds them for training only (``inference_mode=False``), so a reloaded adapter has none of them
_PEFT_TRAINING_ONLY_MODULES = {
    "transform": "prefix tuning's projection (prefix_projection=True)",
    "mlp_head": "P-tuning's MLP head",
    "lstm_head": "P-tuning's LSTM head",
}

# the one way to use such a posterior after a reload (the save's warning and the load's hint)
_REBUILT_MODEL = (
    "the prompt encoder's own weights (model.prompt_encoder.state_dict(), saved beside the adapter) loaded "
    "into a model built as the trained one was (get_peft_model(base_model, the same config))"
)


def peft_unsaved_module(name: str) -> str | None:
    """The PEFT module parameter ``name`` belongs to where PEFT's ``save_pretrained`` does not save it
    (``prompt_encoder.<adapter>.transform.…``: a prompt encoder's projection), else None."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "prompt_encoder":
        return _PEFT_TRAINING_ONLY_MODULES.get(parts[2])
    return None


def warn_peft_unsaved(names: Iterable[str]) -> None:
    """Warn, at the user's line, where ``names`` (a posterior's, being saved) cover a module PEFT's
    ``save_pretrained`` drops: the posterior will not fit ``PeftModel.from_pretrained``'s model."""
    unsaved = [(n, module) for n in names if (module := peft_unsaved_module(n)) is not None]
    if not unsaved:
        return
    name, module = unsaved[0]
    more = f" and {len(unsaved) - 1} more" if len(unsaved) > 1 else ""
    warnings.warn(
        f"this posterior covers {name!r}{more}, {module}: PEFT's save_pretrained keeps only its output "
        "(the adapter's prompt_embeddings), so a model loaded with PeftModel.from_pretrained has none of "
        f"these parameters and this posterior does not fit it. After a reload the posterior needs {_REBUILT_MODEL}",
        UserWarning,
        stacklevel=outside_stacklevel(),
    )


def name_hint(name: str, model: nn.Module, params: Mapping[str, Any]) -> str:
    """The likely cause where ``name`` matches a parameter of ``model`` (``params``, by name) but for
    a wrapper prefix (PEFT's ``base_model.model.``) or the PEFT adapter's name, or where PEFT's save
    drops it (a prompt encoder's projection); else ""."""
    unsaved = peft_unsaved_module(name)
    if unsaved is not None:
        return (
            f" ({unsaved}: PEFT saves only its output, so PeftModel.from_pretrained's model lacks it; the "
            f"posterior needs {_REBUILT_MODEL})"
        )
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
