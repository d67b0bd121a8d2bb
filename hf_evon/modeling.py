"""What hf-evon needs to know about a model, in one place: its own module behind wrappers
(DDP, PEFT, FSDP2), its class and where it came from."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from enum import Enum
from typing import Any

from torch import nn

__all__ = [
    "adapter_name_of",
    "adapter_of_names",
    "adapters_of_names",
    "base_model_name",
    "decoder_inputs_from_labels",
    "fsdp2_modules",
    "has_accelerate_hook",
    "in_auto_mapping",
    "is_causal_lm",
    "is_encoder_decoder",
    "is_peft_model",
    "unused_adapter_parameters",
    "model_class",
    "output_kind",
    "OutputKind",
    "peft_base_model",
    "pretrained_name",
    "problem_type",
    "pruned_ranks",
    "release_gathered",
    "unwrap_model",
]


def has_accelerate_hook(module: nn.Module) -> bool:
    """Whether accelerate's ``add_hook_to_module`` hooked ``module`` (offloading, ``device_map``): the
    one place hf-evon reads accelerate's private ``_hf_hook``, whose hooked forward is then the
    instance's ``_old_forward`` (pinned by the offloaded models of tests/test_generation.py and
    tests/test_posterior.py)."""
    return hasattr(module, "_hf_hook")


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip (Distributed)DataParallel and ``torch.compile``, in any order (accelerate compiles the
    DDP module), so names are the model's own (no ``module.`` or ``_orig_mod.`` prefix). Anything
    but a module is refused by name (e.g. the optimizer passed where the model goes)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's wrapper
            model = model._orig_mod
        else:
            return model


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``PeftModel`` wrapper (it holds the base model behind ``get_base_model``)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def prepends_virtual_tokens(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model whose adapter prepends virtual tokens to the input (prompt
    tuning, p-tuning): its logits are longer than its labels, and its loss scores every label (the
    first from the last virtual token). Prefix tuning adds none: it extends the attention's keys."""
    config = getattr(model, "active_peft_config", None)
    kind = getattr(getattr(config, "peft_type", None), "value", None)
    return bool(getattr(config, "is_prompt_learning", False)) and kind != "PREFIX_TUNING"


def peft_base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel`` (LoRA layers injected), else ``model``."""
    return model.get_base_model() if is_peft_model(model) else model


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


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that FSDP2's ``fully_shard`` manages (behind any wrapper); none without."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def release_gathered(model: nn.Module) -> None:
    """Reshard ``model``'s ``fully_shard``-ed modules: a forward without backward leaves their weights
    gathered (``reshard_after_forward=False``, or a lone ``fully_shard(model)``'s root by default), and
    FSDP2 gathers again only after a reshard, so a forward would not see what is written into the shards."""
    for module in fsdp2_modules(model):
        module.reshard()


def _innermost(model: nn.Module) -> nn.Module:
    """The transformers model behind DDP, ``torch.compile`` and PEFT wrappers, in any order."""
    while (inner := peft_base_model(unwrap_model(model))) is not model:
        model = inner
    return model


def is_encoder_decoder(model: nn.Module) -> bool:
    """Whether ``model`` (behind DDP, ``torch.compile`` and PEFT wrappers) is an encoder-decoder
    (T5, BART: its config's ``is_encoder_decoder``)."""
    return bool(getattr(getattr(_innermost(model), "config", None), "is_encoder_decoder", False))


# transformers' causal-LM classes whose own loss scores position t against label t, unshifted
# (XLNet's permutation LM, XLM's LM head)
_UNSHIFTED_LM_HEADS = frozenset({"XLNetLMHeadModel", "XLMWithLMHeadModel"})


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` predicts token t+1 at position t, so its labels are shifted (as its loss does).

    The model behind DDP, ``torch.compile`` and PEFT wrappers decides: an encoder-decoder never
    (its decoder is fed the labels shifted right, the loss compares them unshifted); else a class
    transformers lists as a causal LM (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: ``*ForCausalLM``,
    ``GPT2LMHeadModel``, ...; not XLNet's and XLM's, whose loss does not shift) or whose name ends
    in ``ForCausalLM`` (custom models), or a model configured as a decoder (``config.is_decoder``).
    """
    if is_encoder_decoder(model):
        return False
    base = _innermost(model)
    config = getattr(base, "config", None)
    name = model_class(base).__name__
    if name in _UNSHIFTED_LM_HEADS:
        return False
    if name.endswith("ForCausalLM") or bool(getattr(config, "is_decoder", False)):
        return True
    if "transformers" not in sys.modules:  # no transformers class without it; importing it costs seconds
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def in_auto_mapping(name: str, mapping: str) -> bool:
    """Whether transformers' auto ``mapping`` (a ``modeling_auto`` name, ``MODEL_FOR_*_MAPPING_NAMES``) lists
    model class ``name``, whose values are one class name or a tuple of them; False for a mapping this
    transformers has not."""
    from transformers.models.auto import modeling_auto

    values = getattr(modeling_auto, mapping, {}).values()
    return any(name == value or (isinstance(value, tuple) and name in value) for value in values)


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
    name = getattr(getattr(model, "config", None), "name_or_path", None) or getattr(
        model, "name_or_path", None
    )
    return str(name) if name else None


def pretrained_name(model: nn.Module) -> str:
    """The checkpoint a (PEFT-wrapped) transformers model's weights were loaded from; "" if built
    from a config. ``from_config`` of a downloaded config keeps the checkpoint's name in
    ``config.name_or_path`` but starts from scratch: loaded weights are told apart by the
    ``_weight_conversions`` list that transformers' (>= 5) ``from_pretrained`` always leaves."""
    config = getattr(model, "config", None)  # PEFT models answer with their base model's config
    name = getattr(config, "name_or_path", "") if config is not None else ""
    if not isinstance(name, str) or not name:
        return ""
    return name if getattr(peft_base_model(model), "_weight_conversions", None) is not None else ""


# transformers' encoder-decoders without ``prepare_decoder_input_ids_from_labels`` whose forward builds
# its decoder's inputs from labels as ``shift_tokens_right(labels, config.pad_token_id,
# config.decoder_start_token_id)``, that function of the model's own module
_SHIFTS_LABELS_RIGHT = frozenset({
    "WhisperForConditionalGeneration", "Speech2TextForConditionalGeneration", "M2M100ForConditionalGeneration",
    "NllbMoeForConditionalGeneration", "BlenderbotForConditionalGeneration",
    "BlenderbotSmallForConditionalGeneration", "MoonshineForConditionalGeneration",
})  # fmt: skip


def problem_type(model: Any) -> str | None:
    """``model.config.problem_type`` (transformers' "regression", "single_label_classification",
    "multi_label_classification"; a PEFT model's is its base model's), None where unset. A data-parallel
    wrapper has no ``config`` of its own: its module's is read."""
    if isinstance(model, nn.Module):
        model = unwrap_model(model)
    value = getattr(getattr(model, "config", None), "problem_type", None)
    return value if isinstance(value, str) else None


class OutputKind(str, Enum):
    """What BMA averages of a model's outputs: VALUE (a regression's values, untempered), SIGMOID (a
    multi-label classifier's per-label probabilities), SOFTMAX (a class distribution)."""

    VALUE = "value"
    SIGMOID = "sigmoid"
    SOFTMAX = "softmax"


def output_kind(model: Any) -> OutputKind | None:
    """The :class:`OutputKind` transformers' ``config.problem_type`` gives (:func:`problem_type`); None
    where it is unset (the callers then read the outputs' number)."""
    problem = problem_type(model)
    if problem is None:
        return None
    kinds = {"regression": OutputKind.VALUE, "multi_label_classification": OutputKind.SIGMOID}
    return kinds.get(problem, OutputKind.SOFTMAX)


def decoder_inputs_from_labels(model: nn.Module, labels: Any) -> dict[str, Any]:
    """What an encoder-decoder model's forward needs to score ``labels`` without a loss: the
    decoder's inputs, the labels shifted right (``prepare_decoder_input_ids_from_labels``, as
    ``DataCollatorForSeq2Seq(model=...)`` builds them, or the shift the forward itself runs: Whisper's);
    any other model gets the labels themselves, from which its forward builds them (and a loss besides)."""
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return {"decoder_input_ids": prepare(labels=labels)}
    base = _innermost(model)
    cls = model_class(base)
    shift = getattr(sys.modules.get(cls.__module__), "shift_tokens_right", None)
    if cls.__name__ in _SHIFTS_LABELS_RIGHT and callable(shift) and getattr(labels, "ndim", 0) == 2:
        if labels.shape[1] > getattr(base, "max_target_positions", labels.shape[1]):
            return {"labels": labels}  # Whisper's forward refuses them, naming its limit
        config = base.config
        return {"decoder_input_ids": shift(labels, config.pad_token_id, config.decoder_start_token_id)}
    return {"labels": labels}


def _tuner_layers(model: nn.Module) -> dict[str, Any]:
    """PEFT's tuner layers of ``model`` by module name, its head copies (``modules_to_save``, whose
    wrapper keeps the layers' adapter attributes) included; none without PEFT."""
    if "peft" not in sys.modules:  # no module can be a tuner layer; importing peft costs seconds
        return {}
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:  # pragma: no cover - peft is optional
        return {}
    kinds = (BaseTunerLayer, ModulesToSaveWrapper)
    return {n: m for n, m in model.named_modules() if isinstance(m, kinds)}


def _adapter_of(layers: Mapping[str, Any], name: str) -> tuple[Any, str] | None:
    """The innermost tuner layer on parameter ``name``'s path and the adapter ``name`` belongs to
    (the segment after the layer's adapter attribute: ``lora_A.<adapter>.weight``), or None."""
    parts = name.split(".")
    for k in range(len(parts) - 2, 0, -1):
        layer = layers.get(".".join(parts[:k]))
        if layer is not None:
            return (layer, parts[k + 1]) if parts[k] in layer.adapter_layer_names else None
    return None


def adapter_name_of(model: nn.Module, name: str) -> str | None:
    """The name of the PEFT adapter parameter ``name`` of ``model`` belongs to, or None."""
    found = _adapter_of(_tuner_layers(model), name)
    return None if found is None else found[1]


def adapter_parameter_ids(model: nn.Module) -> set[int]:
    """The ids of the parameters PEFT's tuner layers hold for an adapter (``lora_A.<adapter>.weight``,
    ``boft_R.<adapter>``); none without PEFT."""
    layers = _tuner_layers(model)
    if not layers:
        return set()
    return {id(p) for name, p in model.named_parameters() if _adapter_of(layers, name) is not None}


def _adapter_attributes() -> set[str]:
    """The attributes under which PEFT's tuner layers keep each adapter's tensors, by the adapter's
    name (``lora_A.<adapter>.weight``, ``ia3_l.<adapter>``, ``modules_to_save.<adapter>.weight``)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - peft is optional
        return set()
    found, classes = {"modules_to_save"}, [BaseTunerLayer]
    while classes:
        cls = classes.pop()
        found.update(getattr(cls, "adapter_layer_names", ()))
        classes.extend(cls.__subclasses__())
    return found


def adapter_of_names(names: Any) -> str | None:
    """The one PEFT adapter parameter ``names`` belong to, read from the names alone (no model: a
    saved posterior's), or None (no adapter's names, or several adapters'): the segment after a tuner
    layer's adapter attribute (``lora_A.<adapter>.weight``) or ``prompt_encoder.<adapter>.…``."""
    adapters = adapters_of_names(names)
    return adapters.pop() if len(adapters) == 1 else None


def adapters_of_names(names: Any) -> set[str]:
    """Every PEFT adapter parameter ``names`` belong to, read from the names alone (as :func:`adapter_of_names`)."""
    attributes, adapters = _adapter_attributes(), set()
    for name in names:
        parts = name.split(".")
        if parts[0] == "prompt_encoder" and len(parts) > 2:
            adapters.add(parts[1])
            continue
        i = next((i for i, part in enumerate(parts[:-1]) if part in attributes), None)
        if i is not None:
            adapters.add(parts[i + 1])
    return adapters


def unused_adapter_parameters(model: nn.Module, names: list[str]) -> list[str]:
    """Why each of ``names`` (parameters of ``model``) that belongs to a PEFT adapter the forward
    does not use now (another adapter active, merged into its base layer, adapters disabled) does
    not take part: a sample of it changes nothing the model computes. Empty without PEFT."""
    layers = _tuner_layers(model)
    prompting = getattr(model, "active_adapter", None)  # a PeftModel's: prompt learning has one at a time
    reasons = []
    for name in names:
        parts = name.split(".")
        if parts[0] == "prompt_encoder" and len(parts) > 2 and isinstance(prompting, str):
            # PEFT's disable_adapter() runs a prompt-learning model's base model alone (its prompt encoder
            # unused), which its public has_active_enabled_adapter says: no tuner layers hold a flag
            if model.has_active_enabled_adapter is False:
                reasons.append(f"{name!r}: the model's adapters are disabled")
            elif parts[1] != prompting:  # prompt_encoder.<adapter>.…
                reasons.append(f"{name!r}: adapter {parts[1]!r} is not active (active: [{prompting!r}])")
            continue
        found = _adapter_of(layers, name)
        if found is None:
            continue
        layer, adapter = found
        if layer.disable_adapters:
            reasons.append(f"{name!r}: the model's adapters are disabled")
        elif adapter in layer.merged_adapters:
            reasons.append(f"{name!r}: adapter {adapter!r} is merged into its base layer")
        elif adapter not in layer.active_adapters:
            reasons.append(f"{name!r}: adapter {adapter!r} is not active (active: {list(layer.active_adapters)})")
    return reasons


def pruned_ranks(model: nn.Module) -> dict[str, Any]:
    """The entries of ``model``'s AdaLoRA singular values (``lora_E.<adapter>``) its rank allocation
    pruned, as a boolean mask per parameter name (``named_parameters``' names; only names with one).

    AdaLoRA prunes rank i by writing 0 into ``lora_E[i]`` (``update_and_allocate``; a save with every
    rank keeps the zeros): the rank is off, not uncertain, so a posterior sample keeps it 0 where a
    draw would turn it back on as noise. An exact 0 is the sign (a trained singular value is never
    exactly 0), so an untrained adapter, whose ``lora_E`` starts at 0, samples as its mean."""
    pruned = {}
    for name, value in adalora_singular_values(model):
        zero = value.detach() == 0
        zero = zero.full_tensor() if hasattr(zero, "full_tensor") else zero  # an FSDP2 shard: the whole
        if bool(zero.any()):
            pruned[name] = zero
    return pruned


def adalora_singular_values(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, lora_E.<adapter>)`` of every AdaLoRA layer of ``model`` (``named_parameters``' names)."""
    if "peft" not in sys.modules:  # no PEFT layers without PEFT: not imported here for every sample
        return []
    from peft.tuners.adalora import AdaLoraLayer

    return [
        (f"{module_name}.lora_E.{adapter}" if module_name else f"lora_E.{adapter}", value)
        for module_name, layer in unwrap_model(model).named_modules()
        if isinstance(layer, AdaLoraLayer)
        for adapter, value in layer.lora_E.items()
    ]
