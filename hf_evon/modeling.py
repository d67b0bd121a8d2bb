"""What hf-evon needs to know about a model, in one place: its own module behind wrappers
(DDP, PEFT, FSDP2), its class and where it came from."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

__all__ = ["base_model_name", "model_class", "peft_base_model", "unwrap_model"]


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip (Distributed)DataParallel, so names are the model's own (no ``module.`` prefix)."""
    while isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        model = model.module
    return model


def peft_base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel`` (LoRA layers injected), else ``model``."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def model_class(model: nn.Module) -> type:
    """The model's own class: FSDP2's ``fully_shard`` swaps in a subclass (``FSDP<Name>``)."""
    cls = type(model)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return cls
    if issubclass(cls, FSDPModule):
        return next((b for b in cls.__mro__[1:] if not issubclass(b, FSDPModule)), cls)
    return cls


def base_model_name(model: nn.Module) -> str | None:
    """The Hub id / path the model came from, if it knows (PEFT: the base model's)."""
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, Mapping) and peft_config:
        active = getattr(model, "active_adapter", None)
        cfg = peft_config.get(active) if isinstance(active, str) else None
        cfg = cfg or next(iter(peft_config.values()))
        name = getattr(cfg, "base_model_name_or_path", None)
        if name:
            return str(name)
    name = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(
        model, "name_or_path", None
    )
    return str(name) if name else None
