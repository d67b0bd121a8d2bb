"""Why a posterior's tensor name is not a parameter of a model: the hint its mismatch error gives
(``EVONPosterior.check_model``), and the names a PEFT adapter's own save drops or saves at another
shape, of which the posterior's save warns (``EVONPosterior.save_pretrained``); and whether the
parameters a posterior names hold their values, which accelerate's offload keeps elsewhere
(:func:`resident_parameters`)."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from safetensors import SafetensorError, safe_open
from torch import nn

from hf_evon.modeling import (
    adapter_name_of,
    adapter_of_names,
    adapter_parameter_ids,
    has_accelerate_hook,
    is_peft_model,
    release_gathered,
    unwrap_model,
)
from hf_evon.optim.checks import outside_stacklevel
from hf_evon.optim.held_samples import claim_sample, release_sample

__all__ = ["model_problems", "name_hint", "peft_unsaved_module", "resident_parameters", "shape_hint"]
__all__ += ["holding_sample", "warn_peft_unsaved"]

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
# what a model that merge_and_unload() returned, or the PeftModel it emptied, is told to sample instead
_SAMPLE_THE_ADAPTER = (
    "sample a PeftModel that holds the adapter, e.g. PeftModel.from_pretrained(base_model, adapter_dir), "
    "and merge a copy for deployment"
)


def peft_unsaved_module(name: str) -> str | None:
    """The PEFT module parameter ``name`` belongs to where PEFT's ``save_pretrained`` does not save it
    (``prompt_encoder.<adapter>.transform.…``: a prompt encoder's projection), else None."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "prompt_encoder":
        return _PEFT_TRAINING_ONLY_MODULES.get(parts[2])
    return None


# AdaLoRA's rank allocation records the ranks it keeps (``rank_pattern``) and PEFT's save keeps only
# those rows of lora_A / lora_E and columns of lora_B; a posterior over the pruned rows has no form
# in the file's Kronecker eigenbases, so the adapter is to keep every rank (the pruned ones are zeros)
_ADALORA_WAY_OUT = (
    "AdaLoRA: PEFT's save_pretrained keeps only the ranks its rank allocation kept (the config's "
    "rank_pattern); to save every rank, the pruned ones as zeros, which this posterior fits, set "
    "model.peft_config[adapter_name].rank_pattern = None before model.save_pretrained"
)


def _saved_adapter(directory: str) -> tuple[str | None, dict[str, tuple[int, ...]]]:
    """The PEFT type and tensor shapes of the adapter PEFT saved in ``directory`` (none: ``(None, {})``)."""
    weights, config = (os.path.join(directory, f) for f in ("adapter_model.safetensors", "adapter_config.json"))
    if not os.path.isfile(weights):
        return None, {}
    try:
        with safe_open(weights, "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        with open(config, encoding="utf-8") as fh:
            peft_type = json.load(fh).get("peft_type")
    except (OSError, ValueError, AttributeError, SafetensorError):  # not PEFT's files: nothing to compare
        return None, {}
    return (peft_type if isinstance(peft_type, str) else None), shapes


def _warn_peft_reshaped(shapes: Mapping[str, tuple[int, ...]], directory: str) -> None:
    """Warn where the adapter PEFT saved in ``directory`` holds a tensor the posterior covers (PEFT's
    key: the parameter's name without the adapter's name) at another shape than ``shapes`` gives."""
    peft_type, saved = _saved_adapter(directory)
    # PEFT saves adapter "default" in the directory it is given, any other in a folder of its name
    here = {"default", os.path.basename(os.path.normpath(directory))}
    reshaped = []
    for name, shape in shapes.items():
        parts = name.split(".")
        keys = (".".join(parts[:i] + parts[i + 1 :]) for i in range(1, len(parts)) if parts[i] in here)
        key = next((k for k in keys if k in saved), None)
        if key is not None and saved[key] != tuple(shape):
            reshaped.append((name, tuple(shape), saved[key]))
    if not reshaped:
        return
    name, shape, stored = reshaped[0]
    more = f" (and {len(reshaped) - 1} more)" if len(reshaped) > 1 else ""
    why = f". {_ADALORA_WAY_OUT}" if peft_type == "ADALORA" else ""
    warnings.warn(
        f"this posterior covers {name!r} at shape {shape}, but the PEFT adapter saved in {directory!r} holds "
        f"it at {stored}{more}: a model loaded with PeftModel.from_pretrained has the saved shapes, which "
        f"this posterior does not fit{why}",
        UserWarning,
        stacklevel=outside_stacklevel(),
    )


def shape_hint(name: str, model: nn.Module) -> str:
    """The likely cause where ``name``'s shape in ``model`` is not the posterior's: AdaLoRA's save."""
    configs = getattr(model, "peft_config", None)
    config = configs.get(adapter_name_of(model, name)) if isinstance(configs, Mapping) else None
    kind = getattr(getattr(config, "peft_type", None), "value", None)
    return f" ({_ADALORA_WAY_OUT})" if kind == "ADALORA" else ""


def warn_peft_unsaved(directory: str, shapes: Mapping[str, Any]) -> None:
    """Warn, at the user's line, where a posterior being saved to ``directory`` (its names and their
    ``shapes``) covers a module PEFT's ``save_pretrained`` drops, or where the adapter PEFT saved in
    ``directory`` holds one at another shape: the posterior will not fit ``PeftModel.from_pretrained``'s
    model."""
    _warn_peft_reshaped(shapes, directory)
    unsaved = [(n, module) for n in shapes if (module := peft_unsaved_module(n)) is not None]
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


def _emptied_tuner_tensor(name: str, model: nn.Module) -> bool:
    """Whether ``name`` is a PEFT tuner layer's tensor and ``model`` a PeftModel of tuner layers (no prompt
    learning) that holds none: merge_and_unload() and unload() replace the tuner layers inside the
    PeftModel itself, so the wrapper the user still holds keeps its names but no adapter tensor."""
    if not is_peft_model(model) or name.startswith("prompt_encoder.") or adapter_of_names([name]) is None:
        return False
    prompting = getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False)
    return not prompting and not adapter_parameter_ids(model)


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
    if name.startswith("base_model.model.") and not is_peft_model(model):
        # a PEFT tuner's tensor, and a model without PEFT's wrapper: most often merge_and_unload's result
        return (
            " (a PEFT adapter's tensor, and the model is no PeftModel: merge_and_unload() folds the adapter's "
            f"mean into the base weights and leaves no adapter tensors to sample; {_SAMPLE_THE_ADAPTER})"
        )
    if _emptied_tuner_tensor(name, model):
        return (
            " (a PEFT adapter's tensor, and this PeftModel holds no adapter tensors, as after merge_and_unload() "
            "or unload(), which replace its tuner layers in place (the merge folds the adapter's mean into the "
            f"base weights); {_SAMPLE_THE_ADAPTER})"
        )
    parts = name.split(".")
    for other in params:
        segments = other.split(".")
        if len(segments) != len(parts):
            continue
        differ = [i for i, (a, b) in enumerate(zip(parts, segments, strict=True)) if a != b]
        if len(differ) == 1 and adapter_name_of(model, other) == segments[differ[0]]:
            ours, theirs = parts[differ[0]], segments[differ[0]]
            if ours == "default":
                return (
                    f" (the model's adapter is named {theirs!r}, the posterior's {ours!r}: load the adapter "
                    f"under the posterior's name, e.g. PeftModel.from_pretrained(..., adapter_name={ours!r}))"
                )
            # PEFT saves any other adapter in a subfolder of its name: loaded from the directory's root
            # under the posterior's name, the model would hold the root's adapter ("default"'s weights)
            return (
                f" (the model's adapter is named {theirs!r}, the posterior's {ours!r}: load the adapter under the "
                "posterior's name from where PEFT saved it, e.g. PeftModel.from_pretrained(base, saved_dir, "
                f"subfolder={ours!r}, adapter_name={ours!r}); PEFT's save_pretrained puts an adapter not named "
                "'default' in a subfolder of its name)"
            )
    return ""


def model_problems(
    shapes: Mapping[str, tuple[int, ...]], aliases: Mapping[str, str], model: nn.Module, params: Mapping[str, Any]
) -> list[str]:
    """Why ``model`` (its parameters ``params`` under every name) does not fit a posterior covering
    ``shapes`` (name: shape), a sentence each: a covered name it lacks, shapes otherwise or holds as no
    float; two covered names it ties to one tensor; a name the posterior ties to a covered one
    (``aliases``, ``tied_parameters``) that is a separate parameter in it."""
    problems = []
    first_name: dict[int, str] = {}  # a tensor covered under two names would take two perturbations
    for name, shape in shapes.items():
        p = params.get(name)
        if p is not None and first_name.setdefault(id(p), name) != name:
            problems.append(
                f"{first_name[id(p)]!r} and {name!r} are one tensor in the model (tied weights), "
                "each with its own posterior: a sample would perturb it twice"
            )
        elif p is None:
            problems.append(f"{name!r} is not a parameter of the model{name_hint(name, model, params)}")
        elif tuple(p.shape) != shape:
            problems.append(
                f"{name!r} has shape {tuple(p.shape)} in the model but {shape} in the posterior"
                + shape_hint(name, model)
            )
        elif not p.is_floating_point():
            problems.append(f"{name!r} has dtype {p.dtype} in the model; a posterior needs a float parameter")
    for alias, name in aliases.items():
        # where the posterior was taken they were one tensor, covered as `name`: a sample would move only it
        if alias in params and name in params and params[alias] is not params[name]:
            problems.append(
                f"{alias!r} is tied to {name!r} in this posterior (one tensor in the model it was taken from) "
                f"but is a separate parameter in the model: a sample would move {name!r} and leave {alias!r} "
                "at its mean; tie them as in training (e.g. model.tie_weights() with tie_word_embeddings=True)"
            )
    return problems


def resident_parameters(model: nn.Module, names: Any) -> dict[str, nn.Parameter]:
    """``model``'s parameters by name (behind DDP and ``torch.compile``; a tied one under each of its
    names), each of ``names`` it has checked to hold its values: posterior samples are drawn around a
    weight and written into it. Raises ``ValueError`` naming the first on the meta device, which
    accelerate's offload (``cpu_offload``, ``disk_offload``, a ``device_map`` with ``"cpu"`` or ``"disk"``)
    leaves there, loading the weight into its module for each forward only."""
    inner = unwrap_model(model)
    params = dict(inner.named_parameters(remove_duplicate=False))
    empty = [n for n in names if n in params and params[n].is_meta]
    if not empty:
        return params
    name, more = empty[0], f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
    path = name.split(".")[:-1]
    # accelerate's hook sits on the owner or, for a block offloaded as one, on a module above it
    hooked = any(has_accelerate_hook(inner.get_submodule(".".join(path[:i]))) for i in range(len(path) + 1))
    if not hooked:
        raise ValueError(
            f"posterior parameter {name!r}{more} is on the meta device, which holds no values: load the "
            "model's weights first (a model made under torch.device('meta') or with empty weights has none)"
        )
    raise ValueError(
        f"posterior parameter {name!r}{more} is offloaded by accelerate (cpu_offload, disk_offload, or a "
        f"device_map putting {'.'.join(path)!r} or a module above it on 'cpu' or 'disk'): it stays on the "
        "meta device and is loaded into its module for each forward only, so there is no weight to draw "
        "posterior samples around or write them into; load the model without offloading the posterior's "
        "modules (a device_map or max_memory that keeps them on the execution device)"
    )


@contextlib.contextmanager
def holding_sample(model: nn.Module, names: Iterable[str]) -> Iterator[None]:
    """``model``'s parameters ``names`` (those it has) claimed for one ``sampled()`` block
    (:func:`claim_sample`): blocks over different weights of a model nest. FSDP2's gathered weights are
    released at both ends (:func:`~hf_evon.modeling.release_gathered`): the block writes its sample into
    the shards, and the next forward gathers the mean back, not the sample a forward left gathered."""
    inner = unwrap_model(model)  # first: refuses anything but a module by name
    release_gathered(model)
    params = dict(inner.named_parameters(remove_duplicate=False))
    claimed = claim_sample({n: params[n] for n in names if n in params})
    try:
        yield
    finally:
        release_sample(claimed)
        release_gathered(model)
