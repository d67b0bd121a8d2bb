"""What ``hf-evon calibrate``'s ``--output`` may already hold: a directory this user writes in, and no
posterior, model weights or adapter other than those of ``--model`` (the save would replace or sit
beside them).

torch, transformers, peft and the rest of hf_evon are imported inside the functions, as in
:mod:`hf_evon.cli.loading`.
"""

from __future__ import annotations

import errno
import os
import re
from typing import Any

from hf_evon.cli.loading import UsageError
from hf_evon.fileio import (
    ANSI_ESCAPE,
    Listed,
    leads_to_directory,
    listed_kind,
    no_file_text,
    reachable_kind,
    refused_load_text,
)


def check_output(output: str) -> None:
    """A usage error where ``output`` cannot become a directory this user writes in. It is checked at the
    nearest entry listed on its path (:func:`~hf_evon.fileio.listed_kind`): a link there that reaches
    nothing is named as such (the save's os.makedirs would fail on it after the whole calibration)."""
    if not output:  # abspath("") is the current directory, and the save's os.makedirs("") fails
        raise UsageError("--output '': give a directory")
    existing = os.path.abspath(output)
    while _listed_on_path(existing, output) is None:
        existing = os.path.dirname(existing)
    if not (os.path.isdir(existing) and os.access(existing, os.W_OK | os.X_OK)):
        why = "is a directory this user cannot write in" if os.path.isdir(existing) else "is a file, not a directory"
        raise UsageError(f"--output {output!r}: {existing!r} {why}")


def _listed_on_path(path: str, output: str) -> Listed | None:
    """:func:`~hf_evon.fileio.reachable_kind` of ``path``, on the way to ``output``: a link that reaches
    nothing is a usage error naming both. None also where the way to it cannot be taken (a directory on it
    this user may not search: EACCES; a loop of links on it: ELOOP): the walk up reaches that entry, which
    :func:`check_output` refuses naming it."""
    try:
        return reachable_kind(path, lambda why: UsageError(f"--output {output!r}: {path!r} is {why}"))
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.ELOOP):
            raise
        return None


def check_output_posterior(output: str, model: Any) -> None:
    """A usage error where ``output`` holds a posterior that is not of ``model``'s weights (tensors
    the model lacks or shapes otherwise, or another mean by its recorded ``mean_fingerprint``), or
    one that does not load, or another model's weights (:func:`check_output_weights`).

    Why: the save replaces the posterior there, and another run's trained posterior would be
    lost, its model left beside a posterior of other weights. A posterior of the same weights
    (the model's own directory, a rerun) is what a calibration replaces."""
    from hf_evon.modeling import unwrap_model
    from hf_evon.posterior.config import POSTERIOR_CONFIG_NAME, PosteriorMismatchError
    from hf_evon.posterior.fingerprint import mean_mismatches
    from hf_evon.posterior.format import read_config

    path = os.path.join(output, POSTERIOR_CONFIG_NAME)
    keep = "pass another --output, or remove its evon_posterior files to replace them"
    # one this user cannot look up raises the OSError naming it; a link that reaches nothing is a posterior
    # on a disk not mounted, which the save would replace
    kind = reachable_kind(
        path, lambda why: UsageError(f"--output {output!r}: its {POSTERIOR_CONFIG_NAME} is {why}: {keep}")
    )
    if leads_to_directory(path, kind):  # the save's os.replace of the config onto it fails, after the passes
        raise UsageError(
            f"--output {output!r}: its {POSTERIOR_CONFIG_NAME} is a directory, where the save writes the "
            "posterior's config: pass another --output, or remove that directory"
        )
    if kind is not Listed.FILE:
        check_output_weights(output, model)
        return
    try:
        config = read_config(path)
    except PosteriorMismatchError as err:
        raise UsageError(f"--output {output!r} holds an EVON posterior that does not load ({err}): {keep}") from None
    # compared with the model, not with --posterior: one that does not fit the model is reported as such later
    params = dict(unwrap_model(model).named_parameters(remove_duplicate=False))
    other = sorted(n for n, e in config.parameters.items() if n not in params or tuple(params[n].shape) != e.shape)
    if not other and config.mean_fingerprint:
        other = mean_mismatches(config.mean_fingerprint, params, config.parameters)
    if other:
        raise UsageError(
            f"--output {output!r} holds the EVON posterior of other weights than --model's (e.g. tensor "
            f"{other[0]!r}); saving would replace it: {keep}"
        )
    check_output_weights(output, model)


def check_posterior_weights(
    posterior: Any, model: Any, source: str, why: str = "its calibration would describe weights it was not taken at"
) -> None:
    """A usage error where ``posterior`` (loaded from ``source``, e.g. ``--posterior 'dir'``) was taken
    at other weights than ``model``'s, by its recorded ``mean_fingerprint``: a calibration of it would
    score noise around weights it was not fitted at, and save that record beside them; ``generate``'s
    samples would be drawn around them (``why`` says which)."""
    from hf_evon.modeling import unwrap_model
    from hf_evon.posterior.fingerprint import mean_mismatches

    fingerprint = posterior.config.get("mean_fingerprint")
    if not fingerprint:
        return
    params = dict(unwrap_model(model).named_parameters(remove_duplicate=False))
    if any(n not in params or params[n].shape != posterior[n].shape for n in posterior.names):
        return  # it does not fit the model at all: the calibration's own check says so, naming each
    other = mean_mismatches(fingerprint, params, posterior.names)
    if other:
        raise UsageError(
            f"{source} holds the EVON posterior of other weights than --model's (tensor {other[0]!r} "
            f"differs{f', and {len(other) - 1} more' if len(other) > 1 else ''}): {why}; pass the "
            "posterior saved with --model's weights"
        )


# config.json sizes that set parameter shapes, compared where both configs hold them
SIZE_KEYS = (
    "vocab_size", "hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner", "num_hidden_layers",
    "n_layer", "num_attention_heads", "n_head", "num_key_value_heads",
)  # fmt: skip
# the weights files (and shard indexes) from_pretrained reads from a directory
WEIGHT_FILES = re.compile(
    r"model(-\d+-of-\d+)?\.safetensors|pytorch_model(-\d+-of-\d+)?\.bin|(model\.safetensors|pytorch_model\.bin)\.index\.json"
)


def safetensors_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in the safetensors file at ``path``, from its header (no tensor is read);
    ValueError where it does not read as safetensors."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except SafetensorError as err:
        raise ValueError(str(err)) from None


def weights_file_shapes(path: str) -> dict[str, tuple[int, ...] | None]:
    """Each tensor's shape in the weights file at ``path`` (None: a shard index's names, without shapes),
    read without running code: a safetensors header, a shard index's ``weight_map``, a pickled ``.bin``
    through ``torch.load(weights_only=True)``, memory-mapped; ValueError where the file does not read so."""
    import json
    import pickle

    if path.endswith(".safetensors"):
        return dict(safetensors_shapes(path))
    if path.endswith(".index.json"):
        with open(path, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError("it has no 'weight_map' object naming the tensors")
        return dict.fromkeys(map(str, weight_map))
    import torch

    try:
        state = _load_bin(path)
    except pickle.UnpicklingError as err:
        raise ValueError(refused_load_text(path, err)) from None
    except (RuntimeError, EOFError, AttributeError, TypeError) as err:
        first = next((ANSI_ESCAPE.sub("", line).strip() for line in str(err).splitlines() if line.strip()), "")
        raise ValueError(f"torch.load cannot read it: {first or type(err).__name__}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ValueError("it is not a dictionary of tensors")
    return {str(k): tuple(t.shape) for k, t in state.items()}


def _load_bin(path: str) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, memory-mapped where the file's format allows."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as err:  # a file of torch's legacy format cannot be memory-mapped
        if "mmap" not in str(err):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def _stored_shapes(output: str, file: str, keep: str) -> dict[str, tuple[int, ...] | None]:
    """:func:`weights_file_shapes` of ``file`` (relative to ``output``), a usage error naming it where
    it does not read so."""
    try:
        return weights_file_shapes(os.path.join(output, file))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        what = "as safetensors" if file.endswith(".safetensors") else (
            "as a shard index" if file.endswith(".json") else "as tensors without running code"
        )
        raise UsageError(f"--output {output!r}: its {file} does not read {what} ({err}): {keep}") from None


def _json_object(path: str) -> dict[str, Any]:
    """The JSON object in ``path``; {} where there is none or it is no object (not a config). Only a regular
    file is read (opening a named pipe waits for a writer); one this user cannot look up raises the OSError
    naming it (:func:`~hf_evon.fileio.listed_kind`)."""
    import json

    if listed_kind(path) is not Listed.FILE:
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def check_output_weights(output: str, model: Any) -> None:
    """A usage error where ``output`` holds another model's weights than ``model``'s: its config.json
    of another ``model_type`` or sizes (SIZE_KEYS), or a tensor of its weights files (safetensors, a
    pickled ``.bin``, a shard index: ``weights_file_shapes``) of a name the model has and another shape
    or other values (:func:`_other_values`), or none of the model's names; a ``.bin`` that loads only
    by running code is refused.

    Why: the posterior saved there would sit beside weights it does not fit, and ``from_pretrained``
    of the directory would load the one with the other. A copy of the model's weights is fine."""
    from hf_evon.modeling import is_peft_model, unwrap_model

    model = unwrap_model(model)
    base = model.get_base_model() if is_peft_model(model) else model
    other = f"--output {output!r} holds the weights of another model than --model's"
    keep = "saving the posterior there would put it beside weights it does not fit: pass another --output"
    mine = getattr(base, "config", None)
    mine = mine.to_dict() if hasattr(mine, "to_dict") else {}
    theirs = _json_object(os.path.join(output, "config.json"))  # {}: the weights files still tell
    for key in ("model_type", *SIZE_KEYS):
        if key in theirs and key in mine and theirs[key] != mine[key]:
            raise UsageError(f"{other} (its config.json's {key} {theirs[key]!r}, --model's {mine[key]!r}): {keep}")
    # the names a saved file gives the model's parameters: PEFT's wrapped layer as the plain one,
    # and a headless save's without the base model's prefix
    prefix = getattr(base, "base_model_prefix", "")
    shapes: dict[str, tuple[int, ...]] = {}
    params: dict[str, Any] = {}
    for name, param in base.named_parameters(remove_duplicate=False):
        name = name.replace(".base_layer.", ".")
        shapes[name] = shapes[name.removeprefix(f"{prefix}.") if prefix else name] = tuple(param.shape)
        params[name] = params[name.removeprefix(f"{prefix}.") if prefix else name] = param
    names = sorted(n for n in os.listdir(output) if WEIGHT_FILES.fullmatch(n)) if os.path.isdir(output) else []
    for file in names:
        path = os.path.join(output, file)
        kind = listed_kind(path)  # one this user cannot look up raises the OSError naming it
        if kind is None:  # removed since the listing
            continue
        if kind is not Listed.FILE:  # not opened: opening a named pipe waits for a writer
            raise UsageError(f"--output {output!r}: its {file} is {no_file_text(path, kind)}: {keep}")
        stored = _stored_shapes(output, file, keep)
        for tensor, shape in sorted(stored.items()):
            if tensor in shapes and shape is not None and shapes[tensor] != shape:
                raise UsageError(
                    f"{other} (tensor {tensor!r} has shape {shape} in {file}, {shapes[tensor]} in --model): {keep}"
                )
        if stored and not set(stored) & set(shapes):
            raise UsageError(f"{other} (none of the tensors of its {file} is --model's, e.g. {min(stored)!r}): {keep}")
        differing = _other_values(path, params) if not file.endswith(".json") else None
        if differing is not None:
            raise UsageError(f"{other} (tensor {differing!r} holds other values in {file} than in --model): {keep}")
    if is_peft_model(model):
        check_output_adapter(output, model, keep)


def _other_values(path: str, params: dict[str, Any]) -> str | None:
    """The first tensor of the weights file at ``path`` (its shapes already checked) whose values are not
    those of the model's parameter of its name, compared in the coarser of the two dtypes (a model loaded
    in bfloat16 from float32 weights holds their rounding); None where every one is. Read one tensor at a
    time (safetensors), or memory-mapped (a ``.bin``, without running code)."""
    import torch

    def other(name: str, stored: torch.Tensor) -> bool:
        mine = params[name].detach()
        if not (stored.is_floating_point() and mine.is_floating_point()):
            return not torch.equal(stored, mine.cpu().to(stored.dtype))
        coarse = max(stored.dtype, mine.dtype, key=lambda d: torch.finfo(d).eps)
        return not torch.equal(stored.to(coarse), mine.to("cpu", coarse))

    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            return next((k for k in sorted(f.keys()) if k in params and other(k, f.get_tensor(k))), None)
    state = _load_bin(path)
    return next((k for k in sorted(state) if k in params and other(k, state[k])), None)


def check_output_adapter(output: str, model: Any, keep: str) -> None:
    """A usage error where ``output`` (or its ``<adapter name>`` folder, where PEFT saves an adapter not
    named "default") holds another adapter than the PEFT ``model``'s active one: its adapter_config.json
    of another ``peft_type``, ``r`` or ``target_modules``, or its adapter weights (read as
    :func:`weights_file_shapes` reads them) lacking a tensor of the model's adapter, holding one it
    lacks, or one of another shape. Names are compared as PEFT saves them (without the adapter name:
    ``.lora_A.weight`` for ``.lora_A.default.weight``), with the embedding layers PEFT may save too."""
    import json

    from peft.utils import get_peft_model_state_dict

    name = model.active_adapter
    other = f"--output {output!r} holds another adapter than --model's"
    # as adapter_config.json holds it: an enum as its value, a set as a list
    mine = json.loads(json.dumps(model.peft_config[name].to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    required = {k: tuple(t.shape) for k, t in get_peft_model_state_dict(model, adapter_name=name).items()}
    allowed = get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=True)
    allowed = {k: tuple(t.shape) for k, t in allowed.items()}
    folders = [output] if name == "default" else [output, os.path.join(output, name)]
    for folder in folders:
        for file in ("adapter_model.safetensors", "adapter_model.bin"):
            path = os.path.join(folder, file)
            where = os.path.relpath(path, output)
            kind = listed_kind(path)  # one this user cannot look up raises the OSError naming it
            if kind is None:
                continue
            if kind is not Listed.FILE:  # PEFT's load of the folder fails on it; it may be another adapter's
                raise UsageError(f"--output {output!r}: its {where} is {no_file_text(path, kind)}: {keep}")
            stored = _stored_shapes(output, where, keep)
            for tensor, shape in sorted(stored.items()):
                if tensor in allowed and shape != allowed[tensor]:
                    raise UsageError(
                        f"{other} (tensor {tensor!r} has shape {shape} in {where}, {allowed[tensor]} in --model): {keep}"
                    )
            if missing := sorted(set(required) - set(stored)):
                raise UsageError(f"{other} (its {where} lacks --model's tensor {missing[0]!r}): {keep}")
            if extra := sorted(set(stored) - set(allowed)):
                raise UsageError(f"{other} (its {where} holds tensor {extra[0]!r}, which --model lacks): {keep}")
        theirs = _json_object(os.path.join(folder, "adapter_config.json"))
        for key in ("peft_type", "r", "target_modules"):
            ours, their = mine.get(key), theirs.get(key)
            if isinstance(ours, list) and isinstance(their, list):  # a set, written as a list in any order
                ours, their = sorted(map(str, ours)), sorted(map(str, their))
            if key in theirs and ours is not None and ours != their:
                where = os.path.relpath(os.path.join(folder, "adapter_config.json"), output)
                raise UsageError(f"{other} (its {where}'s {key} {theirs[key]!r}, --model's {mine[key]!r}): {keep}")
