"""EVON's state beyond torch's: what ``state_dict`` adds, how ``load_state_dict`` checks and
restores it around torch's own load, and what a copy or a pickle keeps.

The load's checks and restores run as torch's load-state-dict hooks, registered for the one load:
the checks after the user's pre-hooks (which may repair or upgrade a state dict), the restores
before the user's post-hooks (which then see the state as loaded)."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hf_evon.optim.buckets import (
    ADAMW_ONLY_KEY,
    ROTATED_MOMENTUM,
    UNINITIALIZED,
    WEIGHT_SPACE_MOMENTUM,
    group_buckets,
    matrix_shape,
    state_dtype,
)
from hf_evon.optim.checks import ALGORITHMS
from hf_evon.optim.functional import adamw_step_device
from hf_evon.optim.gradients import consumed_grads, consumed_places
from hf_evon.optim.linalg import ORTHONORMAL_TOL, orthonormality_error
from hf_evon.optim.validation import (
    fit_records,
    param_names_ok,
    python_numbers,
    resolve_prior,
    validate_group,
)

__all__ = ["COPIED_ATTRIBUTES", "copied_attributes", "loading", "restore_copied", "saving"]

Tensor = torch.Tensor

EXTRA_KEY = "evon"  # the state dict's entry of EVON's counters
# what a copy or a pickle keeps besides torch's defaults, state and groups; the rest (buckets,
# noise generators, recorded samples, a distributed set-up) is rebuilt or refused
COPIED_ATTRIBUTES = (
    "seed",
    "nonfinite",
    "skipped_steps",
    "health_check_every",
    "_updates",
    "_health_warned",
    "_sample_blocks",
    "_stepped_blocks",
    "_eval_blocks",
    "_adamw_defaults",
)


# the counters saved beside the noise's seed (state-dict key -> the optimizer's attribute): the
# blocks' counts, the block count at the end of the last step() call (where a rewind sets the noise
# back: a state dict saved between the blocks of a step restarts that step's noise), the skipped steps
# and the updates (the curvature fits' and health checks' clock); a state dict without one restores
# 0, without the step mark the block count (it was saved between steps, where the two agree)
_SAVED_COUNTERS = {
    "sample_blocks": "_sample_blocks",
    "stepped_blocks": "_stepped_blocks",
    "eval_blocks": "_eval_blocks",
    "skipped_steps": "skipped_steps",
    "updates": "_updates",
}


def saved_extras(optimizer: Any) -> dict[str, int]:
    """What ``state_dict`` saves under ``EXTRA_KEY``: the noise's seed and ``_SAVED_COUNTERS``."""
    return {"seed": optimizer.seed, **{key: getattr(optimizer, attr) for key, attr in _SAVED_COUNTERS.items()}}


def checked_extras(extra: Any) -> Any:
    """``extra`` (a state dict's ``EXTRA_KEY`` entry, or None) if :func:`loading`'s restore can read it:
    a dict with an integer ``seed`` and integer counters. Checked before the load changes anything,
    since the restore runs after the state is replaced."""
    if extra is None:
        return extra
    if not isinstance(extra, dict) or "seed" not in extra:
        raise ValueError(
            f"EVON.load_state_dict: {EXTRA_KEY!r} must be a dict holding 'seed' and {sorted(_SAVED_COUNTERS)}; "
            f"got {extra!r:.100}"
        )
    for key in ("seed", *_SAVED_COUNTERS):
        value = extra.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"EVON.load_state_dict: {EXTRA_KEY!r}[{key!r}] must be an integer; got {value!r:.100}")
    return extra



@contextlib.contextmanager
def saving(optimizer: Any, full_state_dict: Callable[[dict[str, Any]], dict[str, Any]]) -> Iterator[None]:
    """EVON's additions to the state dict ``Optimizer.state_dict`` builds inside the block (its extras;
    every number a Python one, so that it loads with ``torch.load(weights_only=True)``), as that
    call's first post-hook: the user's post-hooks then see (and may keep) the state dict as saved,
    with ``EXTRA_KEY``. ``full_state_dict``: every rank's state (sharded runs; a collective)."""

    def add(_: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict[EXTRA_KEY] = saved_extras(optimizer)
        for group in state_dict["param_groups"]:  # the state dict's copies: a NumPy rate set by a
            python_numbers(group)  # scheduler since the last step() is saved as Python's number
        return full_state_dict(state_dict)

    handle = optimizer.register_state_dict_post_hook(add, prepend=True)  # before the user's
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def loading(
    optimizer: Any, given: Any, local_state_dict: Callable[[dict[str, Any]], dict[str, Any]]
) -> Iterator[None]:
    """EVON's checks and restores around ``Optimizer.load_state_dict(given)`` inside the block, as that
    load's hooks (``given``'s layout checked first: torch's load reads it before any hook runs).
    ``local_state_dict``: this rank's part of a full state dict (sharded runs)."""
    check_state_dict_layout(given)
    loaded: dict[str, Any] = {}

    def check(_: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict = upgraded_groups(state_dict)
        validate_state_dict(state_dict)  # before anything changes: a refused state leaves this one
        state_dict = dict(state_dict)
        loaded["extra"] = checked_extras(state_dict.pop(EXTRA_KEY, None))
        # on the full state dict: its entries are shaped as the whole parameters (FSDP2's cut
        # keeps a rank's rows of an AdamW state)
        check_group_structure(optimizer.param_groups, state_dict)
        check_state_shapes(optimizer.param_groups, state_dict)
        check_stacked_bases(optimizer.param_groups, state_dict)
        state_dict = local_state_dict(state_dict)
        loaded["state_dict"] = state_dict
        return state_dict

    def restore(_: Any) -> None:
        restore_state_dtypes(optimizer.state, optimizer.param_groups, loaded["state_dict"])
        optimizer._buckets = None
        optimizer._fit_records = fit_records(optimizer.param_groups)  # the groups as loaded
        extra = loaded["extra"] or {}
        if extra:
            optimizer.seed = int(extra["seed"])
            for key, attr in _SAVED_COUNTERS.items():
                setattr(optimizer, attr, int(extra.get(key, 0)))
        optimizer._stepped_blocks = int(extra.get("stepped_blocks", optimizer._sample_blocks))

    pre = optimizer.register_load_state_dict_pre_hook(check)  # after the user's
    post = optimizer.register_load_state_dict_post_hook(restore, prepend=True)  # before the user's
    try:
        yield
    finally:
        pre.remove()
        post.remove()


def copied_attributes(optimizer: Any) -> dict[str, Any]:
    """What ``__getstate__`` keeps beside torch's state (:func:`restore_copied` sets it back): the
    ``COPIED_ATTRIBUTES``, the consumed gradients' places and each group's fit record."""
    own = {k: getattr(optimizer, k) for k in COPIED_ATTRIBUTES}
    own["consumed"] = consumed_places(optimizer.param_groups, optimizer._consumed)
    own["fit_records"] = [optimizer._fit_records.get(id(g)) for g in optimizer.param_groups]
    return own


def restore_copied(optimizer: Any, own: dict[str, Any]) -> None:
    """Set what ``__getstate__`` kept (``COPIED_ATTRIBUTES``, the consumed gradients' places) on an
    unpickled or copied ``optimizer``, and rebuild the rest. A pickle without the step mark rewinds
    to its block count, as a state dict without one loads."""
    optimizer._reset_transient()
    optimizer._fit_records = fit_records(optimizer.param_groups, own.pop("fit_records", None))  # the originals'
    optimizer._consumed = consumed_grads(optimizer.param_groups, own.pop("consumed"))
    own.setdefault("_stepped_blocks", own.get("_sample_blocks", 0))
    optimizer.__dict__.update(own)


def upgraded_groups(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with its groups keyed as this version keys them: an AdamW group's ε is its
    ``eps`` (torch AdamW's key), which the step reads. A group that carries ``adamw_eps`` is of the
    format that keeps AdamW's ε there, on every group, and EVON's inert Hessian ε (1e-12) as an
    AdamW group's ``eps``: that ``adamw_eps`` becomes an AdamW group's ``eps`` and leaves an EVON
    group. New dicts where a group changes: the state dict given is left as it is."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(groups, list) or not any(isinstance(g, dict) and "adamw_eps" in g for g in groups):
        return state_dict  # nothing to upgrade (what is not a list of dicts, validate_state_dict names)
    upgraded = []
    for group in groups:
        if isinstance(group, dict) and "adamw_eps" in group:
            group = dict(group)
            eps = group.pop("adamw_eps")
            if group.get("algorithm") == "adamw":
                group["eps"] = eps
        upgraded.append(group)
    return {**state_dict, "param_groups": upgraded}


# what every stepped EVON entry holds (a momentum under either space's key): the step fills in a
# missing one afresh, so an entry with some of them but not all would restart that piece silently
_REQUIRED_KEYS = ("hess", "step", (ROTATED_MOMENTUM, WEIGHT_SPACE_MOMENTUM))


# the hyperparameters every saved group has had, by algorithm: a group without one is corrupt (the
# step reads it). Those added since (``snr_scaling``, ``max_precond_ratio``, …) read as off when absent
REQUIRED_GROUP_KEYS = {
    "evon": ("lr", "ess", "hess_init", "betas", "weight_decay", "precondition_frequency", "max_precond_dim",
             "shampoo_beta", "clip", "clip_radius", "phased_gradients", "identity_basis"),
    "adamw": ("lr", "betas", "eps", "weight_decay", "precondition_frequency"),
}  # fmt: skip


def check_entry_complete(idx: Any, entries: dict[str, Any], name: str | None) -> None:
    """Raise, naming the parameter and the key, where an EVON state entry holds some of
    ``_REQUIRED_KEYS`` but not all. No keys (a parameter not stepped yet) and AdamW's state (a
    parameter moved from an AdamW group, which the step drops) pass."""
    if not entries or ADAMW_ONLY_KEY in entries:
        return
    for key in _REQUIRED_KEYS:
        keys = key if isinstance(key, tuple) else (key,)
        if not any(k in entries for k in keys):
            label = f"state[{idx!r}]" + (f" (parameter {name!r})" if name else "")
            raise ValueError(
                f"EVON.load_state_dict: {label} has no {' or '.join(map(repr, keys))} but holds "
                f"{sorted(entries)}: a corrupt or partial EVON state"
            )


def check_state_dict_layout(state_dict: Any) -> None:
    """Raise, naming what is wrong, where ``state_dict`` is not laid out as an optimizer's: a dict
    whose ``param_groups`` is a list of dicts, each with a list of ``params``, and whose ``state``
    maps each parameter's index to a dict of its entries."""
    if not isinstance(state_dict, dict):
        raise ValueError(
            f"EVON.load_state_dict: expected an optimizer state dict (a dict with 'state' and 'param_groups'); "
            f"got {type(state_dict).__name__}"
        )
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError("EVON.load_state_dict: 'param_groups' must be a list of dicts (an optimizer state dict)")
    for gi, group in enumerate(groups):
        if not isinstance(group.get("params"), list):
            raise ValueError(f"EVON.load_state_dict: param_groups[{gi}] has no list of 'params' (their indices)")
    indices = [i for group in groups for i in group["params"]]
    try:  # each index names one parameter's state: listed twice, two parameters would share one entry
        twice = len(set(indices)) != len(indices)
    except TypeError:
        twice = True  # an unhashable index names no entry of 'state'
    if twice:
        raise ValueError(
            "EVON.load_state_dict: the groups' 'params' must list distinct parameter indices (ints); "
            f"got {[g['params'] for g in groups]}"
        )
    state = state_dict.get("state")
    if not isinstance(state, dict):
        raise ValueError(
            f"EVON.load_state_dict: 'state' must be a dict of each parameter's entries; got {type(state).__name__}"
        )
    for idx, entries in state.items():
        if not isinstance(entries, dict):
            raise ValueError(
                f"EVON.load_state_dict: state[{idx!r}] must be a dict of tensors; got {type(entries).__name__}"
            )


def validate_state_dict(state_dict: dict[str, Any]) -> None:
    """Check a state dict before ``EVON.load_state_dict`` changes anything: its layout
    (:func:`check_state_dict_layout`), every group's hyperparameters as the constructor checks them,
    each EVON parameter's state complete (:func:`check_entry_complete`), every entry of every group
    a finite floating-point tensor (complex only for AdamW's), a step count at least 0 (EVON's at least ``UNINITIALIZED``), ``exp_avg_sq_norm``
    and AdamW's ``exp_avg_sq`` at least 0, the eigenbases orthonormal within ``ORTHONORMAL_TOL`` (at
    least float32's) and H + δ > 0 (a positive, finite posterior variance). The message names the
    group or the parameter's index and entry."""
    check_state_dict_layout(state_dict)
    groups = state_dict["param_groups"]
    prior: dict[Any, float] = {}  # parameter index -> its group's δ, for EVON groups
    names: dict[Any, str] = {}  # parameter index -> its name, where its EVON group has names
    for gi, group in enumerate(groups):
        if group.get("algorithm") not in ALGORITHMS:  # every group an EVON saves names its algorithm
            raise ValueError(
                f"EVON.load_state_dict: param_groups[{gi}] has no 'algorithm' ({' or '.join(map(repr, ALGORITHMS))}): "
                "not the state dict of an EVON optimizer (another optimizer's state cannot be loaded)"
            )
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        # torch's load replaces the groups with the saved ones: a key they lack would be gone, and every step fail
        if missing := [k for k in REQUIRED_GROUP_KEYS[hyper["algorithm"]] if k not in hyper]:
            raise ValueError(f"EVON.load_state_dict: param_groups[{gi}] lacks {missing}: a corrupt or partial EVON state")
        if group.get("param_names") is not None and not param_names_ok(group["param_names"], len(group["params"])):
            raise ValueError(f"EVON.load_state_dict: param_groups[{gi}]['param_names'] must be a list of one str per parameter")
        try:
            validate_group(resolve_prior(hyper))
        except ValueError as err:
            raise ValueError(f"EVON.load_state_dict: param_groups[{gi}]: {err}") from None
        if hyper.get("algorithm", "evon") == "evon":
            prior.update(dict.fromkeys(group["params"], float(hyper.get("weight_decay") or 0.0)))
            names.update(zip(group["params"], group.get("param_names") or ()))
    for idx, entries in state_dict["state"].items():
        if idx in prior:
            check_entry_complete(idx, entries, names.get(idx))
        # AdamW's entries (its group's, or a parameter's moved to an EVON group since, which the step
        # drops) feed torch's fused kernel, which takes a non-finite or negative moment or step as it is
        adamw = ADAMW_ONLY_KEY in entries
        for key, value in entries.items():
            if not torch.is_tensor(value):  # the step reads every entry as a tensor
                raise ValueError(
                    f"EVON.load_state_dict: state[{idx!r}][{key!r}] must be a tensor; got {type(value).__name__}"
                )
            if not (value.is_floating_point() or (value.is_complex() and idx not in prior)):  # AdamW's of a complex weight
                raise ValueError(
                    f"EVON.load_state_dict: state[{idx!r}][{key!r}] must be a floating-point tensor; got {value.dtype}"
                )
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"EVON.load_state_dict: state[{idx!r}][{key!r}] has NaN or inf entries")
            # a step count (EVON's UNINITIALIZED: a member awaiting its first gradient) and a squared
            # norm or second moment: below these the bias correction and the square root are NaN
            low = (0 if adamw else UNINITIALIZED) if key == "step" else 0
            parts = torch.view_as_real(value) if value.is_complex() else value  # torch's complex moments: per part
            if key in ("step", "exp_avg_sq_norm", ADAMW_ONLY_KEY) and not bool((parts >= low).all()):
                raise ValueError(f"EVON.load_state_dict: state[{idx!r}][{key!r}] is below {low}")
            if key in ("Q_L", "Q_R") and value.numel() and value.ndim >= 2:  # else the shape check names it
                # a saved posterior's bound, at least float32's, which the bases are computed in
                err = orthonormality_error(value, fresh=True)
                tol = max(ORTHONORMAL_TOL.get(value.dtype, 6e-2), ORTHONORMAL_TOL[torch.float32])
                if err > tol:
                    raise ValueError(
                        f"EVON.load_state_dict: state[{idx!r}][{key!r}] is not orthonormal "
                        f"(‖QᵀQx − x‖/‖x‖ = {err:.3g} > {tol:g} for {value.dtype}): a posterior saved from it "
                        "would not load"
                    )
            if key == "hess" and idx in prior and not bool((value + prior[idx] > 0).all()):
                raise ValueError(
                    f"EVON.load_state_dict: state[{idx!r}]['hess'] has entries with H + weight_decay <= 0 "
                    "(the posterior variance 1/(ess·(H + weight_decay)) must be positive)"
                )


def check_group_structure(param_groups: list[dict[str, Any]], loaded: dict[str, Any]) -> None:
    """torch's own checks of the groups' number and sizes (run before EVON's, which pair the
    parameters in order; a size refused names the group), and each group's algorithm: the state of
    one is not the other's."""
    saved = loaded["param_groups"]
    if len(saved) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    for i, (group, saved_group) in enumerate(zip(param_groups, saved)):
        if len(group["params"]) != len(saved_group["params"]):
            # torch's words, and which group and sizes: groups listed in another order differ here first
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of optimizer's group: "
                f"param_groups[{i}] holds {len(group['params'])} parameters here but {len(saved_group['params'])} "
                "in the state dict (groups listed in another order?)"
            )
        if group["algorithm"] != saved_group["algorithm"]:
            raise ValueError(
                f"EVON.load_state_dict: param_groups[{i}] is an {group['algorithm']!r} group here but an "
                f"{saved_group['algorithm']!r} group in the state dict"
            )
        _refuse_reordered(i, group.get("param_names"), saved_group.get("param_names"))


def _refuse_reordered(index: int, names: Any, saved: Any) -> None:
    """Raise where a group's parameters are named on both sides and a name the state dict holds at
    one position is this group's name at another: the state, paired by position, would go to
    another tensor of the same shape (modules registered in another order). Names that differ
    otherwise (a wrapper's prefix) pair by position, as torch's do."""
    if not isinstance(names, list) or not isinstance(saved, list):
        return
    here = set(names)
    for position, (name, was) in enumerate(zip(names, saved)):
        if name != was and was in here:
            raise ValueError(
                f"EVON.load_state_dict: param_groups[{index}]'s state for {was!r} would be loaded into "
                f"{name!r} (position {position}): the state dict lists this group's parameters in another "
                "order. Build the optimizer from the parameters in the order they were saved in"
            )


# the shape of each EVON state entry for an m×n matrix ("step" and the EMA of ‖G‖²: one number)
_STATE_SHAPES: dict[str, Callable[[int, int], tuple[int, ...]]] = {
    "hess": lambda m, n: (m, n),
    ROTATED_MOMENTUM: lambda m, n: (m, n),
    WEIGHT_SPACE_MOMENTUM: lambda m, n: (m, n),
    "L": lambda m, n: (m, m),
    "Q_L": lambda m, n: (m, m),
    "R": lambda m, n: (n, n),
    "Q_R": lambda m, n: (n, n),
    "exp_avg_sq_norm": lambda m, n: (),
    "noise_watched": lambda m, n: (),
    "step": lambda m, n: (),
}


# an AdamW state entry's shape for a parameter of shape s (torch AdamW's keys)
_ADAMW_SHAPES: dict[str, Callable[[tuple[int, ...]], tuple[int, ...]]] = {
    "exp_avg": lambda s: s,
    "exp_avg_sq": lambda s: s,
    "step": lambda s: (),
}


def _wanted_shapes(group: dict[str, Any], p: Tensor) -> dict[str, tuple[int, ...]]:
    if group["algorithm"] == "evon":
        m, n = matrix_shape(p.shape)
        return {key: shape(m, n) for key, shape in _STATE_SHAPES.items()}
    return {key: shape(tuple(p.shape)) for key, shape in _ADAMW_SHAPES.items()}


def _foreign(group: dict[str, Any], entries: dict[str, Any]) -> bool:
    """Whether ``entries`` are the other algorithm's state (its parameter moved between groups since
    the last step), which the next step drops (``stack_state``, ``adamw_update``): shaped for the other."""
    return ADAMW_ONLY_KEY in entries if group["algorithm"] == "evon" else "hess" in entries


def check_state_shapes(param_groups: list[dict[str, Any]], loaded: dict[str, Any]) -> None:
    """Raise, naming the parameter, where a loaded state entry (EVON's or AdamW's) does not fit its
    parameter (a state dict of another model with as many parameters per group), before anything
    is loaded: an AdamW kernel does not check the shapes it is given."""
    saved_ids = [i for g in loaded["param_groups"] for i in g["params"]]
    owners = [(g, j, p) for g in param_groups for j, p in enumerate(g["params"])]
    for idx, (group, j, p) in zip(saved_ids, owners):
        if idx not in loaded["state"] or _foreign(group, loaded["state"][idx]):
            continue
        wanted = _wanted_shapes(group, p)
        for key, value in loaded["state"][idx].items():
            want = wanted.get(key)
            if want is not None and torch.is_tensor(value) and tuple(value.shape) != want:
                names = group.get("param_names")
                label = repr(names[j]) if names else f"#{j} of its group"
                raise ValueError(
                    f"EVON.load_state_dict: state[{idx!r}][{key!r}] has shape {tuple(value.shape)}, but "
                    f"parameter {label} (shape {tuple(p.shape)}) needs {want}: the state dict of "
                    "another model, or of this one grouped otherwise (other evon_patterns or param groups)"
                )


def check_stacked_bases(param_groups: list[dict[str, Any]], loaded: dict[str, Any]) -> None:
    """Raise, naming two parameters, where the matrices this optimizer stacks into one bucket (one
    group, matrix shape, device and dtype; the groups' settings as loaded) would load the
    eigenbasis statistics for some and not for others, before anything is loaded: a bucket's state
    is stacked for all its members or none. Where the state was saved they were stacked apart
    (another dtype or device), and one of them never updated. A member without EVON's state (saved
    between an edit of its group's params or a reset of its state and the next step) is not stacked
    yet: it joins its bucket late, as in the optimizer that saved it."""
    saved_groups = loaded["param_groups"]
    index = {id(p): i for g, sg in zip(param_groups, saved_groups) for p, i in zip(g["params"], sg["params"])}
    label = {
        id(p): repr(names[j]) if names else f"#{j} of its group"
        for g in param_groups
        for names in [g.get("param_names")]
        for j, p in enumerate(g["params"])
    }
    merged = [{**sg, "params": g["params"]} for g, sg in zip(param_groups, saved_groups)]
    for b in group_buckets(merged):
        stacked = [p for p in b.params if "hess" in loaded["state"].get(index[id(p)], {})]
        for key in ("L", "R", "Q_L", "Q_R"):
            has = {id(p): key in loaded["state"][index[id(p)]] for p in stacked}
            if any(has.values()) and not all(has.values()):
                with_it = next(p for p in stacked if has[id(p)])
                without = next(p for p in stacked if not has[id(p)])
                raise ValueError(
                    f"EVON.load_state_dict: state[{index[id(without)]!r}] has no {key!r} but "
                    f"state[{index[id(with_it)]!r}] has one, and their parameters {label[id(without)]} and "
                    f"{label[id(with_it)]} (shape {tuple(without.shape)}, {without.dtype}) share one stacked "
                    "state here, which holds it for all or none: the state dict was saved where they were "
                    "stacked apart (another dtype or device); load it into the dtypes and devices it was saved with"
                )


def restore_state_dtypes(
    state: dict[Tensor, dict[str, Any]], param_groups: list[dict[str, Any]], loaded: dict[str, Any]
) -> None:
    """Undo ``Optimizer.load_state_dict``'s cast of floating state to each parameter's dtype:
    EVON's state is float32 (float64 for float64 parameters), whatever the weights' dtype; and
    put each AdamW parameter's step count where its kernel reads it (``adamw_step_device``: a
    checkpoint saved on another device keeps its counts where they were saved)."""
    saved_ids = [i for g in loaded["param_groups"] for i in g["params"]]
    params = [p for g in param_groups for p in g["params"]]
    evon_params = {id(p) for g in param_groups if g["algorithm"] == "evon" for p in g["params"]}
    for idx, p in zip(saved_ids, params):
        if id(p) not in evon_params:
            if torch.is_tensor(state.get(p, {}).get("step")):
                state[p]["step"] = state[p]["step"].to(adamw_step_device(p))
        elif idx in loaded["state"]:
            for k, v in loaded["state"][idx].items():
                if k != "step" and torch.is_tensor(v):
                    state[p][k] = v.to(device=p.device, dtype=state_dtype(p))
