"""Taking a posterior out of a live ``EVON`` optimizer: its factors, keyed by the model's names.

EVON knows parameters, not names; the model knows names. Parameters are matched by identity,
so a posterior's names are exactly ``model.named_parameters()``'s (for a ``PeftModel`` e.g.
``base_model.model....lora_A.default.weight``), and checkable against a model later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_evon.modeling import (
    adapter_name_of,
    adapter_of_names,
    base_model_name,
    model_class,
    peft_base_model,
    pruned_ranks,
    unwrap_model,
)
from hf_evon.optim.buckets import matrix_shape
from hf_evon.optim.evon import unwrap_optimizer
from hf_evon.optim.health import is_point_estimate
from hf_evon.optim.rates import configured_rate
from hf_evon.optim.validation import GROUP_KEYS
from hf_evon.posterior.fingerprint import mean_fingerprint
from hf_evon.posterior.gaussian import MatrixFactors
from hf_evon.posterior.json_rules import PosteriorMismatchError, recordable_base_model

__all__ = ["HYPERPARAMETER_KEYS", "Snapshot", "has_posterior_to_take", "snapshot"]

# EVON group entries recorded as hyperparameters (those present in the optimizer's group), in the
# file's order: what the posterior is defined by first; init_std_ratio shapes only the start of training
_DEFINING_KEYS = ("lr", "ess", "weight_decay")
HYPERPARAMETER_KEYS = _DEFINING_KEYS + tuple(
    k for k in GROUP_KEYS if k not in _DEFINING_KEYS and k != "init_std_ratio"
)


@dataclass
class Snapshot:
    """The factors of every EVON-owned parameter (views of the optimizer's live state), the
    hyperparameters and model facts a posterior records, and what stays a point estimate."""

    factors: dict[str, MatrixFactors]
    settings: dict[str, Any]
    num_point_estimates: int
    num_point_estimate_tensors: int


def _recorded_class(model: nn.Module) -> str:
    """The class name a posterior records for ``model``: its own, or for a plain ``PeftModel``
    (built without ``task_type``, a name that says no task) its base model's, which the model
    card reloads the base with (``GPT2LMHeadModel``: ``AutoModelForCausalLM``)."""
    name = model_class(model).__name__
    return model_class(peft_base_model(model)).__name__ if name == "PeftModel" else name


def _missing_hint(label: str, model: nn.Module) -> str:
    """What to do about EVON-owned parameter ``label`` that ``model`` lacks."""
    if adapter_of_names([label]) is not None and adapter_name_of(model, label) is None:
        # a PEFT adapter's tensor whose tuner layer is gone: merge_and_unload()/unload() replace the
        # layers in place, so the trainer's own model loses them too
        return (
            "it is a PEFT adapter's tensor and the model has no such adapter layer, as after "
            "merge_and_unload(), which folds the adapter's mean into the base weights in place and leaves "
            "no adapter tensors to sample or save a posterior for; take the posterior (and save) before "
            "merging, merge a copy for deployment and save it with its own save_pretrained()"
        )
    return "pass the model the optimizer was built for"


def _updates(optimizer: Any, p: torch.Tensor, factors: dict[str, Any]) -> int:
    """The updates EVON took of ``p`` (its ``step``; a sharded EVON's gathered ``factors`` hold it
    for a matrix another rank owns), 0 where it has none yet; ``UNINITIALIZED`` (-1) for a member
    that had no gradient at its bucket's first step: never updated either."""
    step = optimizer.state.get(p, {}).get("step", factors.get("step"))
    return 0 if step is None else int(step.item() if torch.is_tensor(step) else step)


def _point_estimate(optimizer: Any, p: torch.Tensor, factors: dict[str, Any]) -> bool:
    """Whether EVON member ``p`` is a point estimate of the posterior: frozen and never updated, its H
    still h0, not a curvature, and EVON's own samples leave it alone (its posterior is the mean)."""
    return is_point_estimate(p.requires_grad, _updates(optimizer, p, factors))


def has_posterior_to_take(optimizer: Any) -> bool:
    """Whether :func:`snapshot` finds a parameter to cover: an EVON member with entries that is trainable
    or that EVON updated. Where every member is frozen, sharded EVON gathers the factors (a collective,
    as :func:`snapshot`'s), so every rank calls it then."""
    optimizer = unwrap_optimizer(optimizer)
    members = [p for g in optimizer.param_groups if g.get("algorithm", "evon") == "evon" for p in g["params"]]
    members = [p for p in members if p.numel()]
    if not members or any(p.requires_grad for p in members):
        return bool(members)
    sharding = getattr(optimizer, "sharding", None)
    if sharding is not None:
        sharding.gather_factors()
    return not all(_point_estimate(optimizer, p, optimizer.posterior_factors(p)) for p in members)


def snapshot(optimizer: Any, model: nn.Module) -> Snapshot:
    """Read the posterior factors of ``optimizer`` (unwrapped from accelerate) for ``model``
    (unwrapped from DDP). With sharded EVON this gathers the factors: a collective, so every
    rank calls it."""
    optimizer = unwrap_optimizer(optimizer)
    if optimizer.in_sample:  # its fingerprint would record the sample as the mean
        raise RuntimeError("take the posterior outside sampled_params(): the weights hold a sample there, not the mean")
    model = unwrap_model(model)
    sharding = getattr(optimizer, "sharding", None)
    if sharding is not None:
        sharding.gather_factors()
    named = list(model.named_parameters())
    names_by_id = {id(p): name for name, p in named}
    evon_groups = [g for g in optimizer.param_groups if g.get("algorithm", "evon") == "evon"]
    entries: list[tuple[str, torch.Tensor, dict[str, Any]]] = []
    seen: set[int] = set()
    for gi, group in enumerate(evon_groups):
        labels = group.get("param_names")
        for i, p in enumerate(group["params"]):
            if id(p) in seen or p.numel() == 0:  # nothing to be uncertain about: no entry
                continue
            seen.add(id(p))
            if id(p) not in names_by_id:
                label = labels[i] if labels else f"EVON group {gi}, parameter {i}"
                raise PosteriorMismatchError(
                    f"{label} (shape {tuple(p.shape)}) is trained by EVON but is not a parameter of "
                    f"the given {type(model).__name__}: {_missing_hint(label, model)}"
                )
            f = optimizer.posterior_factors(p)
            if _point_estimate(optimizer, p, f):
                continue
            entries.append((names_by_id[id(p)], p, f))
    if not entries:
        raise ValueError(
            "the optimizer has no EVON-owned parameters that are trainable or were updated (a frozen one never "
            "updated is a point estimate): there is no posterior to take"
        )
    factors = {
        name: MatrixFactors(
            Q_L=None if f["Q_L"] is None else f["Q_L"].detach(),
            Q_R=None if f["Q_R"] is None else f["Q_R"].detach(),
            hess=f["hess"].detach(),
            shape=tuple(int(s) for s in p.shape),
            matrix_shape=tuple(int(s) for s in f.get("matrix_shape", matrix_shape(p.shape))),
            ess=float(f["ess"]),
            weight_decay=float(f["weight_decay"]),
        )
        for name, p, f in entries
    }
    first = evon_groups[0]
    settings = {k: first[k] for k in HYPERPARAMETER_KEYS if k in first}
    # the rate as configured (a scheduler's peak), not today's, with today's as final_lr: under a
    # scheduler that set initial_lr always, else (none, or ReduceLROnPlateau) where the rate moved
    configured = configured_rate(first)
    if configured is not None and ("initial_lr" in first or float(configured) != float(first["lr"])):
        settings["lr"], settings["final_lr"] = configured, first["lr"]
    # a rate held in a 0-dim tensor (torch.optim's option; schedulers set it in place): its number
    settings = {k: v.item() if torch.is_tensor(v) else v for k, v in settings.items()}
    if "betas" in settings:
        settings["betas"] = tuple(settings["betas"])
    # each matrix counts its own updates (one that joined late, fewer): the optimizer's are the most
    settings["optimizer_step"] = max((_updates(optimizer, p, f) for _, p, f in entries), default=0)
    settings["base_model"] = recordable_base_model(base_model_name(model))
    settings["model_class"] = _recorded_class(model)
    settings["mean_fingerprint"] = mean_fingerprint({name: p for name, p, _ in entries}, factors)
    # AdaLoRA's pruned ranks (the mean's zeros): off, not uncertain; std() and draw() hold 0 there, as samples do
    pruned = {n: m.flatten().nonzero().flatten().tolist() for n, m in pruned_ranks(model).items() if n in factors}
    if pruned:
        settings["pruned_ranks"] = pruned
    covered = {id(p) for _, p, _ in entries}
    # a covered tensor the model ties under further names (an MLP's mid2.weight is mid1.weight): each
    # resolves to the name it is covered under, and a model where they are separate is refused
    tied = {n: names_by_id[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in covered}
    if tied := {alias: name for alias, name in tied.items() if alias != name}:
        settings["tied_parameters"] = tied
    points = [p for _, p in named if id(p) not in covered]
    return Snapshot(factors, settings, sum(p.numel() for p in points), len(points))
