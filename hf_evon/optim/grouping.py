"""Which parameters EVON owns: the paper's split, overridable by name patterns."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .evon import DEFAULT_LR, EVON, _require
from .recipes import recipe_kwargs

# LoRA adapters (PEFT's ``lora_A``/``lora_B``) get this multiple of EVON's rate: ``B`` starts at
# zero and only a few matrices carry the whole update, so they need larger steps than full
# fine-tuning, as with AdamW (1e-3 for LoRA vs 5e-5-2e-4 for full fine-tuning; measured in
# benchmarks/payoff.py: MiniLM LoRA at α 0.02 ended at NLL 1.54 vs AdamW's 0.84).
ADAPTER_LR_SCALE = 5.0
_ADAPTER = re.compile(r"(^|\.)lora_[AB](\.|$)")


def _output_head_ids(model: nn.Module) -> set[int]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()


def _embedding_ids(model: nn.Module) -> set[int]:
    return {
        id(p)
        for mod in model.modules()
        if isinstance(mod, nn.Embedding | nn.EmbeddingBag)
        for p in mod.parameters()
    }


def _matches(name: str, patterns: Iterable[str] | None) -> bool:
    return any(re.search(pat, name) for pat in patterns or ())


def build_param_groups(
    model: nn.Module,
    evon_patterns: Iterable[str] | None = None,
    adamw_patterns: Iterable[str] | None = None,
    adamw_lr: float | None = None,
    adamw_weight_decay: float = 0.0,
) -> list[dict[str, Any]]:
    """Split trainable parameters into an EVON group and AdamW groups.

    EVON gets the matrices (2-D and conv kernels, LoRA ``A``/``B`` included); AdamW gets
    embeddings, the output head (``model.get_output_embeddings()``) and 1-D tensors, as in
    the paper. Frozen parameters are left out; tied weights appear once. Name regexes
    override the split: ``adamw_patterns`` first, then ``evon_patterns``. Each group carries
    ``param_names`` so the split can be inspected (``describe_param_groups``).
    """
    head, embeddings = _output_head_ids(model), _embedding_ids(model)
    evon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():  # deduplicates tied weights
        if not p.requires_grad:
            continue
        if _matches(name, adamw_patterns):
            (decay if p.ndim >= 2 else no_decay).append((name, p))
        elif _matches(name, evon_patterns):
            evon.append((name, p))
        elif p.ndim < 2:
            no_decay.append((name, p))
        elif id(p) in head or id(p) in embeddings:
            decay.append((name, p))
        else:
            evon.append((name, p))

    def group(items: list[tuple[str, torch.Tensor]], **extra: Any) -> dict[str, Any]:
        return {"params": [p for _, p in items], "param_names": [n for n, _ in items], **extra}

    adamw_extra = {} if adamw_lr is None else {"lr": adamw_lr}
    groups = [group(evon, algorithm="evon")] if evon else []
    if decay:
        groups.append(group(decay, algorithm="adamw", weight_decay=adamw_weight_decay, **adamw_extra))
    if no_decay:
        groups.append(group(no_decay, algorithm="adamw", weight_decay=0.0, **adamw_extra))
    if not groups:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    return groups


def build_optimizer(
    model: nn.Module,
    *,
    evon_patterns: Iterable[str] | None = None,
    adamw_patterns: Iterable[str] | None = None,
    adamw_lr: float | None = None,
    adamw_weight_decay: float = 0.0,
    recipe: str | None = None,
    adapter_lr_scale: float = ADAPTER_LR_SCALE,
    **evon_kwargs: Any,
) -> EVON:
    """``EVON`` over ``build_param_groups(model, ...)``; ``evon_kwargs`` go to ``EVON``.

    ``recipe`` names one of the paper's tuned settings (:data:`hf_evon.optim.recipes.RECIPES`:
    "nanogpt", "llama", "clip-finetuning"); ``evon_kwargs`` given next to it win. LoRA
    matrices (PEFT's ``lora_A``/``lora_B``) form their own EVON group at ``adapter_lr_scale``
    times EVON's rate (1: the same rate).
    """
    _require(
        "adapter_lr_scale",
        adapter_lr_scale,
        isinstance(adapter_lr_scale, int | float) and adapter_lr_scale > 0,
        "a number > 0",
    )
    kwargs = recipe_kwargs(recipe, evon_kwargs)
    groups = build_param_groups(model, evon_patterns, adamw_patterns, adamw_lr, adamw_weight_decay)
    split = []
    for g in groups:
        is_adapter = [bool(_ADAPTER.search(n)) for n in g["param_names"]]
        if g["algorithm"] != "evon" or not any(is_adapter) or adapter_lr_scale == 1:
            split.append(g)
            continue
        for adapter in (False, True):
            members = [(p, n) for p, n, a in zip(g["params"], g["param_names"], is_adapter) if a == adapter]
            if members:
                extra = {"lr": kwargs.get("lr", DEFAULT_LR) * adapter_lr_scale} if adapter else {}
                split.append(
                    {**g, "params": [p for p, _ in members], "param_names": [n for _, n in members], **extra}
                )
    return EVON(split, **kwargs)


def describe_param_groups(groups: list[dict[str, Any]]) -> str:
    """One line per group: algorithm, parameter count, names (for logs and checks)."""
    lines = []
    for g in groups:
        count = sum(p.numel() for p in g["params"])
        names = g.get("param_names") or [f"<{len(g['params'])} unnamed>"]
        lines.append(
            f"{g.get('algorithm', 'evon'):5s} {count:>12,d} params  {len(g['params'])} tensors: {', '.join(names)}"
        )
    return "\n".join(lines)
