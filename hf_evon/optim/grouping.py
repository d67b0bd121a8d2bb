"""Which parameters EVON owns: the paper's split, overridable by name patterns."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hf_evon.modeling import (
    adapter_parameter_ids,
    is_peft_model,
    pretrained_name,
    unused_adapter_parameters,
    unwrap_model,
)
from hf_evon.optim.checks import finite, outside_stacklevel, require
from hf_evon.optim.defaults import (
    DEFAULT_ADAMW_LR,
    DEFAULT_CLIP,
    DEFAULT_CLIP_RADIUS,
    DEFAULT_FINETUNING_LR,
    DEFAULT_LR,
    DEFAULT_SNR_SCALING,
    default_adapter_lr_scale,
    default_clip,
    default_hess_init,
    lr_from_adamw_lr,
    ratio_clip,
)
from hf_evon.optim.evon import EVON
from hf_evon.optim.recipes import recipe_kwargs
from hf_evon.optim.validation import IN_RANGE, in_range, validate_hyperparameters

_ADAPTER = re.compile(r"(^|\.)(lora_[AB]|modules_to_save)(\.|$)")
# transformers' task heads (BERT/ViT/... ``classifier``, DistilBERT ``pre_classifier``, DeiT
# ``cls_classifier``/``distillation_classifier``, BART ``classification_head``, GPT-2/Llama ``score``,
# question answering ``qa_outputs``), by name: usually new in a model loaded with ``from_pretrained``
# for a task (a checkpoint that already holds a trained head gets the rate too)
_TASK_HEAD = re.compile(r"(^|\.)(\w*classifier|classification_head|score|qa_outputs)(\.|$)")
# bare parameters (no nn.Linear/nn.Embedding of their own) that are no linear map, by their own name:
# biases, learned tokens, scales and log-rates (XLNet's ``r_w_bias``, DINOv2's ``mask_token`` [1, D],
# SwinV2's ``logit_scale``, Mamba's ``A_log``) train as 1-D tensors; lookup tables (Swin's
# ``relative_position_bias_table``, XLNet's ``seg_embed``, Perceiver's ``latents``) as embeddings
_BARE_VECTOR = re.compile(r"(^|_)(bias|token|tokens|scale|log)$")
_BARE_TABLE = re.compile(r"(^|_)(embed|embeds|embedding|embeddings|table|latents)$")


def is_full_finetuning(model: nn.Module) -> bool:
    """Most of a pretrained model's weights are trained: loaded with ``from_pretrained``, no PEFT
    adapters, more than half of the entries outside its embedding tables trainable (a linear probe
    trains a new head from scratch). The tables do not count: a small encoder's vocabulary holds most
    of its entries (MiniLM's 52%), and freezing it leaves the encoder fine-tuned."""
    model = unwrap_model(model)  # DDP forwards neither config nor the output head
    if not pretrained_name(model) or is_peft_model(model):
        return False
    params = list(model.named_parameters())
    if any(_ADAPTER.search(n) for n, p in params if p.requires_grad):
        return False
    tables = _embedding_ids(model)
    body = [p for _, p in params if id(p) not in tables]
    return 2 * sum(p.numel() for p in body if p.requires_grad) > sum(p.numel() for p in body)


def _require_module(model: Any, function: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{function}: model must be a torch.nn.Module; got a {type(model).__name__}. The split reads the "
            "model's modules (its embeddings, its output head); parameters or parameter groups of your own "
            "go to EVON(params, ...), with algorithm='adamw' on the groups AdamW is to train"
        )


def _output_head_ids(model: nn.Module) -> set[int]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    # a PEFT tuner layer (LoRA, IA3, ...) on the head: the head is its base layer, and the factors
    # beside it are an adapter's, trained as on any other layer
    base_layer = getattr(head, "get_base_layer", None)
    head = base_layer() if isinstance(head, nn.Module) and callable(base_layer) else head
    if not isinstance(head, nn.Module):
        return set()
    # PEFT's trainable tokens on a head tied to the embedding (TrainableTokensWrapper, no base layer to
    # ask for): their delta rows are an adapter's tensors, trained as where the head is not tied
    tokens = getattr(head, "token_adapter", None)
    adapter = {id(p) for a in getattr(tokens, "adapter_layer_names", ()) for p in getattr(tokens, a).parameters()}
    return {id(p) for p in head.parameters()} - adapter


def _embedding_ids(model: nn.Module) -> set[int]:
    return {
        id(p)
        for mod in model.modules()
        if isinstance(mod, nn.Embedding | nn.EmbeddingBag)
        for p in mod.parameters()
    }


def _vector_and_table_ids(model: nn.Module) -> tuple[set[int], set[int]]:
    """The parameters of 2 or more dimensions that are no linear map, as (learned vectors, embedding
    tables): those of 3 or more dimensions whose leading dimension is 1 (conv kernels and expert stacks
    aside), added to the activations by broadcasting over the batch, by how many of their dimensions
    exceed 1 (ViT's ``cls_token`` [1, 1, D] is a vector, its ``position_embeddings`` [1, N, D] a table);
    and the others by their own names (``_BARE_VECTOR``, ``_BARE_TABLE``). A PEFT adapter's tensors are
    none of these: they act inside their layer (BOFT's rotations [1, blocks, b, b] are a stack of
    matrices that multiply the layer's weight)."""
    kernels = {id(mod.weight) for mod in model.modules() if isinstance(mod, nn.modules.conv._ConvNd)}
    # a fused expert stack [E, out, in] with one expert is a matrix too (Mixtral's ``mlp.experts``)
    experts = {
        id(p)
        for name, mod in model.named_modules()
        if name.rsplit(".", 1)[-1] == "experts" or type(mod).__name__.endswith("Experts")
        for p in mod.parameters(recurse=False)
    }
    kept = kernels | experts | adapter_parameter_ids(model)
    vectors, tables = set(), set()
    for name, p in model.named_parameters():
        if id(p) in kept or p.ndim < 2:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if p.ndim >= 3 and p.shape[0] == 1:
            (vectors if sum(d > 1 for d in p.shape) <= 1 else tables).add(id(p))
        elif _BARE_VECTOR.search(leaf):
            vectors.add(id(p))
        elif _BARE_TABLE.search(leaf):
            tables.add(id(p))
    return vectors, tables


def _matches(names: list[str], patterns: list[re.Pattern[str]]) -> bool:
    return any(pat.search(name) for pat in patterns for name in names)


def _aliased_parameters(model: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """Each parameter once, with every name it has (a tied weight: all of them, its first name
    first, the one ``named_parameters()`` gives it)."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    return [(names[key], params[key]) for key in params]


def _warn_unmatched(
    aliased: list[tuple[list[str], nn.Parameter]], patterns: list[re.Pattern[str]], argument: str
) -> None:
    for pat in patterns:
        if not _matches([n for names, _ in aliased for n in names], [pat]):
            warnings.warn(
                f"{argument}: {pat.pattern!r} matches no parameter name of the model; it moves nothing",
                UserWarning,
                stacklevel=outside_stacklevel(),
            )


def pattern_strings(patterns: Iterable[str] | str | None, argument: str) -> list[str]:
    """The regex strings of ``argument``, read once (a generator is used up by a reading); one string
    is one regex (not its letters)."""
    if patterns is None:
        return []
    if isinstance(patterns, str):
        return [patterns]
    if isinstance(patterns, bytes | bytearray | re.Pattern) or not isinstance(patterns, Iterable):
        raise TypeError(f"{argument}: expected a regex string or a list of them; got {type(patterns).__name__}")
    items = list(patterns)
    for pat in items:
        if not isinstance(pat, str):
            raise TypeError(f"{argument}: each pattern must be a regex string; got {pat!r}")
    return items


def compiled_patterns(patterns: Iterable[str] | str | None, argument: str) -> list[re.Pattern[str]]:
    """The regexes of ``argument`` (:func:`pattern_strings`)."""
    out = []
    for pat in pattern_strings(patterns, argument):
        try:
            out.append(re.compile(pat))
        except re.error as err:
            raise ValueError(f"{argument}: {pat!r} is not a valid regex ({err})") from None
    return out


def build_param_groups(
    model: nn.Module,
    evon_patterns: Iterable[str] | str | None = None,
    adamw_patterns: Iterable[str] | str | None = None,
    adamw_lr: float | None = None,
    adamw_weight_decay: float = 0.0,
) -> list[dict[str, Any]]:
    """Split trainable parameters into an EVON group and AdamW groups.

    EVON gets the matrices (2-D and conv kernels, LoRA ``A``/``B`` included); AdamW gets
    embeddings, the output head (``model.get_output_embeddings()``) and 1-D tensors, as in
    the paper. A bare parameter of 3 or more dimensions with a leading 1, which broadcasts over
    the batch, is AdamW's too: a learned token (ViT's ``cls_token`` [1, 1, D]) as a 1-D tensor, a
    learned table (ViT's ``position_embeddings`` [1, N, D]) as an embedding; so are bare parameters
    named as biases, tokens, scales or log-rates (as 1-D tensors: ``r_w_bias``, ``mask_token``,
    ``logit_scale``, ``A_log``) or as tables (as embeddings: ``relative_position_bias_table``,
    ``seg_embed``, ``latents``). DDP and ``torch.compile`` wrappers are stripped first: the names are
    the model's own. Frozen parameters are left out; tied weights appear once, under their first name
    (``named_parameters()``'s). Name regexes override the split: ``adamw_patterns`` first, then
    ``evon_patterns``; a tied weight matches where any of its names does (GPT-2's ``lm_head`` is
    ``transformer.wte``'s weight). A pattern that matches no name at all is warned about. Each group
    carries ``param_names`` so the split can be inspected (``describe_param_groups``). ``model`` is
    a module: parameters or groups of your own go to ``EVON(params)``.
    """
    _require_module(model, "build_param_groups")
    model = unwrap_model(model)  # the model's own names, head and config (DDP forwards neither)
    # by their own names: inside the AdamW groups EVON would name them "lr" and "weight_decay"
    validate_hyperparameters(adamw_lr=adamw_lr, adamw_weight_decay=adamw_weight_decay)
    adamw_patterns = compiled_patterns(adamw_patterns, "adamw_patterns")
    evon_patterns = compiled_patterns(evon_patterns, "evon_patterns")
    head, embeddings = _output_head_ids(model), _embedding_ids(model)
    vectors, tables = _vector_and_table_ids(model)
    aliased = _aliased_parameters(model)
    _warn_unmatched(aliased, adamw_patterns, "adamw_patterns")
    _warn_unmatched(aliased, evon_patterns, "evon_patterns")
    evon, decay, no_decay = [], [], []
    for names, p in aliased:
        if not p.requires_grad:
            continue
        name = names[0]
        if _matches(names, adamw_patterns):
            (decay if p.ndim >= 2 else no_decay).append((name, p))
        elif _matches(names, evon_patterns):
            evon.append((name, p))
        elif p.ndim < 2 or id(p) in vectors:
            no_decay.append((name, p))
        elif id(p) in head or id(p) in embeddings or id(p) in tables:
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
        if next(model.parameters(), None) is None:
            raise ValueError("the model has no parameters: there is nothing to train")
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    return groups


def build_optimizer(
    model: nn.Module,
    *,
    evon_patterns: Iterable[str] | str | None = None,
    adamw_patterns: Iterable[str] | str | None = None,
    adamw_lr: float | None = None,
    adamw_weight_decay: float = 0.0,
    recipe: str | None = None,
    adapter_lr_scale: float | None = None,
    learning_rate: float | None = None,
    **evon_kwargs: Any,
) -> EVON:
    """``EVON`` over ``build_param_groups(model, ...)``; ``evon_kwargs`` go to ``EVON``.

    ``recipe`` names one of the paper's tuned settings (:data:`hf_evon.optim.recipes.RECIPES`:
    "nanogpt", "llama", "clip-finetuning"); ``evon_kwargs`` given next to it win. What starts
    from scratch in a pretrained model (PEFT's ``lora_A``/``lora_B`` and ``modules_to_save``, but copies
    of the embeddings or the head, AdamW's as the model's own, which a warning names; the task head of
    a model loaded with ``from_pretrained``) forms its own EVON group at ``adapter_lr_scale`` times
    EVON's rate (1: the same rate; None: :func:`~hf_evon.optim.defaults.default_adapter_lr_scale`:
    steps of at most 1.0·rate per entry, AdamW's; under a ``recipe``, 1: its α as tabled).
    ``learning_rate`` is the rate you would give AdamW (None: 1e-3, or 5e-5 for full fine-tuning,
    as ``EVONTrainer``): EVON's α
    becomes :func:`~hf_evon.optim.defaults.lr_from_adamw_lr` of it (unless ``lr`` or ``recipe``
    sets α) and the AdamW part uses it (unless ``adamw_lr`` is given). Without a recipe, ``clip``
    defaults to :func:`~hf_evon.optim.defaults.default_clip`: "whiten_rms", or "element" when
    :func:`is_full_finetuning`, ``hess_init`` to :func:`~hf_evon.optim.defaults.default_hess_init`
    (0.01; 1e-3 for full fine-tuning) and ``snr_scaling`` to
    :data:`~hf_evon.optim.defaults.DEFAULT_SNR_SCALING` ("adam"). The
    reasons: :mod:`hf_evon.optim.defaults`; the measurements: ``docs/defaults.md``.
    """
    _require_module(model, "build_optimizer")
    model = unwrap_model(model)  # the model's own names, head and config (DDP forwards neither)
    evon_patterns = pattern_strings(evon_patterns, "evon_patterns")  # read once: below and in the groups
    adamw_patterns = pattern_strings(adamw_patterns, "adamw_patterns")
    require(
        "adapter_lr_scale",
        adapter_lr_scale,
        adapter_lr_scale is None or (finite(adapter_lr_scale) and adapter_lr_scale > 0),
        "None or a finite number > 0",
    )
    if learning_rate is not None:
        require("learning_rate", learning_rate, in_range(learning_rate) and learning_rate >= 0, f"a number >= 0 ({IN_RANGE})")
        learning_rate = float(learning_rate)
        adamw_lr = learning_rate if adamw_lr is None else adamw_lr
    for key in ("clip", "lr", "hess_init", "snr_scaling", "weight_decay"):
        if key in evon_kwargs and evon_kwargs[key] is None:
            del evon_kwargs[key]  # None: the default (below, or the recipe's)
    finetuning = is_full_finetuning(model)
    if learning_rate is None and adamw_lr is None and finetuning:
        adamw_lr = DEFAULT_FINETUNING_LR  # the rate α comes from, as for a learning_rate given
    if recipe is None:
        evon_kwargs.setdefault("clip", default_clip(finetuning))
        evon_kwargs.setdefault("hess_init", default_hess_init(finetuning))
        evon_kwargs.setdefault("snr_scaling", DEFAULT_SNR_SCALING)
        if "lr" not in evon_kwargs:
            radius = evon_kwargs.get("clip_radius") or DEFAULT_CLIP_RADIUS
            clip = ratio_clip(evon_kwargs["clip"], finetuning)
            if learning_rate is not None:
                rate = learning_rate
            else:
                rate = DEFAULT_FINETUNING_LR if finetuning else DEFAULT_ADAMW_LR
            evon_kwargs["lr"] = lr_from_adamw_lr(rate, radius, clip=clip, finetuning=finetuning)
            if not in_range(evon_kwargs["lr"]):  # a rate or a radius near float32's ends: named as given
                given = "" if learning_rate is None else f"learning_rate={learning_rate!r} and "
                raise ValueError(
                    f"build_optimizer: EVON's lr α = {evon_kwargs['lr']:g}, sized from {given}clip_radius={radius!r}, is "
                    f"not a rate ({IN_RANGE}): pass a smaller learning_rate, a larger clip_radius, or lr"
                )
    kwargs = recipe_kwargs(recipe, evon_kwargs)
    if adapter_lr_scale is None:  # a recipe's α is the paper's own number, not one sized from an AdamW rate
        adapter_lr_scale = 1.0 if recipe is not None else default_adapter_lr_scale(kwargs.get("clip", DEFAULT_CLIP), finetuning)
    groups = build_param_groups(model, evon_patterns, adamw_patterns, adamw_lr, adamw_weight_decay)
    _refuse_unused_adapters(model, groups)
    split = []
    new_heads = bool(pretrained_name(model))
    # through PEFT, what trains is what PEFT added: every name with an adapter's name as a segment
    # (LoRA on linears and embeddings, LoKr, LoHa, IA3, modules_to_save, ...)
    peft_config = getattr(model, "peft_config", None) if is_peft_model(model) else None
    adapter_names = set(peft_config) if isinstance(peft_config, dict) else set()
    for g in groups:
        is_adapter = [
            bool(
                _ADAPTER.search(n)
                or adapter_names.intersection(n.split("."))
                or (new_heads and _TASK_HEAD.search(n))
            )
            for n in g["param_names"]
        ]
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
    asked = compiled_patterns(adamw_patterns, "adamw_patterns")
    uncovered = _adapters_left_to_adamw(model, split, asked)
    trains = any(g["algorithm"] == "evon" and g["params"] for g in split)
    if not trains:
        warnings.warn(
            "build_optimizer: EVON trains none of this model's parameters (every trainable tensor went to "
            "AdamW: 1-D tensors and embeddings do by default, e.g. PEFT's prompt tuning), so the run is "
            "AdamW's and has no posterior; train matrices (LoRA) or name them in evon_patterns"
            + "".join(f"; for the {kind} adapter {name!r}: evon_patterns={patterns}" for kind, name, patterns in uncovered),
            UserWarning,
            stacklevel=outside_stacklevel(),
        )
    elif uncovered:  # EVON trains something else (a classifier head's copy): the posterior misses the adapter
        warnings.warn(
            "build_optimizer: "
            + "; ".join(
                f"the {kind} adapter {name!r} trains only tensors AdamW owns by the split (1-D tensors and "
                f"embeddings: {', '.join(patterns)}), so the posterior covers none of it; to cover it, "
                f"pass evon_patterns={patterns}"
                for kind, name, patterns in uncovered
            )
            + " (EVONConfig's evon_patterns for the trainer)",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )
    if trains and (copies := _head_copies_left_to_adamw(split, asked)):
        names, patterns = sorted(copies), sorted(set(copies.values()))
        warnings.warn(
            f"build_optimizer: PEFT's modules_to_save copies of the embeddings or the output head ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}) train with AdamW, as the model's own do, so the posterior covers "
            f"none of them; to cover them, pass evon_patterns={patterns} (EVONConfig's evon_patterns for the trainer)",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )
    return EVON(split, **kwargs)


def _head_copies_left_to_adamw(groups: list[dict[str, Any]], adamw_patterns: list[re.Pattern[str]]) -> dict[str, str]:
    """PEFT ``modules_to_save`` copies that AdamW trains as tables (the embeddings', the output head's),
    not by ``adamw_patterns``: each name, with the pattern that would give it to EVON instead."""
    copies = {}
    for g in groups:
        for name, p in zip(g["param_names"], g["params"]):
            parts = name.split(".")
            if g["algorithm"] == "adamw" and p.ndim >= 2 and "modules_to_save" in parts[1:] and not _matches([name], adamw_patterns):
                copies[name] = re.escape(parts[parts.index("modules_to_save") - 1]) + r"\.modules_to_save\."
    return copies


def _refuse_unused_adapters(model: nn.Module, groups: list[dict[str, Any]]) -> None:
    """Refuse EVON tensors of a PEFT adapter the forward does not use now (trainable but not active, as
    PEFT's ``load_adapter(..., is_trainable=True)`` leaves one beside the active adapter; merged;
    disabled): they get no gradient, and a posterior over them is refused by every sample and BMA, so
    the run's evaluation would fail only after training."""
    reasons = unused_adapter_parameters(model, [n for g in groups if g["algorithm"] == "evon" for n in g["param_names"]])
    if reasons:
        more = f"; and {len(reasons) - 3} more" if len(reasons) > 3 else ""
        raise ValueError(
            "build_optimizer: EVON would train tensors the model's forward does not use, whose posterior no "
            f"sample or BMA can use: {'; '.join(reasons[:3])}{more}. Freeze them (p.requires_grad_(False) for "
            "the adapter's parameters, as PEFT's set_adapter leaves an inactive adapter) or make their adapter "
            "active (model.set_adapter(name); model.base_model.set_adapter([...]) for several) before building "
            "the optimizer"
        )


def _adapters_left_to_adamw(
    model: nn.Module, groups: list[dict[str, Any]], adamw_patterns: list[re.Pattern[str]]
) -> list[tuple[str, str, list[str]]]:
    """``(kind, adapter name, evon_patterns that cover it)`` of each PEFT adapter of ``model`` whose own
    trainable tensors (not ``modules_to_save`` copies) all went to AdamW, though not by ``adamw_patterns``:
    VeRA's vectors, prompt tuning's embedding. The patterns are the names the tensors are kept under
    in their module (``vera_lambda_b``, ``prompt_encoder``: the segment before the adapter's name)."""
    peft_config = getattr(model, "peft_config", None) if is_peft_model(model) else None
    if not isinstance(peft_config, dict):
        return []
    evon_ids = {id(p) for g in groups if g["algorithm"] == "evon" for p in g["params"]}
    found = []
    for adapter, config in peft_config.items():
        owned = [
            (name, p)
            for name, p in model.named_parameters()
            if p.requires_grad and adapter in name.split(".")[1:] and "modules_to_save" not in name.split(".")
        ]
        if not owned or any(id(p) in evon_ids or _matches([n], adamw_patterns) for n, p in owned):
            continue
        segments = {(parts := n.split("."))[parts.index(adapter, 1) - 1] for n, _ in owned}
        kind = getattr(config, "peft_type", None)
        kind = str(getattr(kind, "value", kind) or type(config).__name__)
        found.append((kind, str(adapter), sorted(re.escape(s) for s in segments)))
    return found


def describe_param_groups(groups: list[dict[str, Any]]) -> str:
    """One line per group: algorithm, parameter count, names (for logs and checks)."""
    if not isinstance(groups, list | tuple) or not all(isinstance(g, dict) and "params" in g for g in groups):
        # the groups are what a model splits into, not the model (nor the optimizer) itself
        raise TypeError(
            "describe_param_groups: groups must be a list of parameter groups (dicts with 'params'); got a "
            f"{type(groups).__name__}: pass build_param_groups(model) or optimizer.param_groups"
        )
    lines = []
    for g in groups:
        count = sum(p.numel() for p in g["params"])
        names = g.get("param_names") or [f"<{len(g['params'])} unnamed>"]
        lines.append(
            f"{g.get('algorithm', 'evon'):5s} {count:>12,d} params  {len(g['params'])} tensors: {', '.join(names)}"
        )
    return "\n".join(lines)
