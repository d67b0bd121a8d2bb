"""Validation of EVON's hyperparameters and parameter groups: the messages name the field and its rule.

``validate_hyperparameters`` checks ``EVON``'s keyword arguments (any subset of them) exactly as
``EVON(...)`` does; ``validate_group`` checks one parameter group as ``add_param_group`` does.
Both raise ``ValueError("Invalid <name>: <value> (must be <rule>)")`` at the first bad field.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

import torch

from hf_evon.optim.checks import (
    ALGORITHMS,
    CLIP_MODES,
    HESS_ESTIMATORS,
    MODE_KEYS,
    NONFINITE_MODES,
    STEP_CURVATURES,
    betas_ok,
    finite,
    is_int,
    is_real,
    mode_value,
    python_number,
    refuse_listed_twice,
    require,
)
from hf_evon.optim.curvature import curvature_fitted, fitted_values, keep_user_numbers
from hf_evon.optim.defaults import (
    AUTO_ESS,
    DEFAULT_ADAMW_LR,
    DEFAULT_CLIP,
    DEFAULT_CLIP_RADIUS,
    DEFAULT_CURVATURE_REFIT,
    DEFAULT_HESS_ESTIMATOR,
    DEFAULT_HESS_INIT,
    DEFAULT_INIT_STD_RATIO,
    DEFAULT_PRIOR_STD_RATIO,
    default_weight_decay,
    is_snr_scaling,
    lr_from_adamw_lr,
    ratio_clip,
)
from hf_evon.optim.rates import record_configured_rate

__all__ = [
    "LAYOUT_KEYS",
    "BuiltLayout",
    "FIT_KEYS",
    "build_group",
    "check_fit_record",
    "fit_record",
    "fit_records",
    "check_layout",
    "group_layout",
    "prepare_group",
    "python_numbers",
    "resolve_mean_weight_decay",
    "resolve_prior",
    "resolve_rate",
    "settle_group",
    "validate_group",
    "validate_groups",
    "validate_hyperparameters",
]

# EVON's keyword arguments that are the optimizer's own, not a group's
_OPTIMIZER_KEYS = ("adamw_lr", "adamw_betas", "adamw_eps", "adamw_weight_decay", "nonfinite", "seed")


def validate_hyperparameters(**kwargs: Any) -> dict[str, Any]:
    """Check ``EVON``'s keyword arguments as ``EVON(**kwargs)`` does (those given; the rest are
    EVON's defaults, which are valid) and return the EVON group's values among them, with
    ``lr=None`` replaced by the default α of their ``clip``/``clip_radius``.

    Raises:
        ValueError: the first invalid argument, named, with its rule (EVON's own message).
    """
    unknown = set(kwargs) - set(_OPTIMIZER_KEYS) - set(GROUP_KEYS)
    if unknown:
        raise TypeError(f"unknown EVON hyperparameter(s): {sorted(unknown)}")
    if "nonfinite" in kwargs:
        nonfinite = kwargs["nonfinite"]
        require("nonfinite", nonfinite, nonfinite in NONFINITE_MODES, "'skip' or 'raise'")
    if "seed" in kwargs:
        seed = kwargs["seed"]
        require("seed", seed, seed is None or is_int(seed), "None or an integer")
    # the AdamW defaults are checked here too: with no AdamW group they would go unchecked,
    # and a group's message would name "lr"/"betas" rather than the argument given
    if "adamw_lr" in kwargs:
        adamw_lr = kwargs["adamw_lr"]
        require(
            "adamw_lr",
            adamw_lr,
            adamw_lr is None or rate_ok(adamw_lr),
            f"None or {RATE_RULE}",
        )
    if "adamw_betas" in kwargs:
        require(
            "adamw_betas", kwargs["adamw_betas"], betas_ok(kwargs["adamw_betas"]), "two numbers in [0, 1)"
        )
    if "adamw_eps" in kwargs:
        eps = kwargs["adamw_eps"]
        require("adamw_eps", eps, finite(eps) and eps > 0.0, "a finite number > 0")
    if "adamw_weight_decay" in kwargs:
        wd = kwargs["adamw_weight_decay"]
        require("adamw_weight_decay", wd, finite(wd) and wd >= 0.0, "a finite number >= 0")
    group = resolve_rate({k: v for k, v in kwargs.items() if k in GROUP_KEYS})
    # the keywords themselves, before any group: the message names the keyword given
    # EVON's defaults for the fields the prior is derived from, where not given
    prior = {"hess_init": DEFAULT_HESS_INIT, "weight_decay": None}
    validate_group(resolve_prior({**prior, **group, "algorithm": "evon", "params": []}))
    return python_numbers(group)


# the state is float32 (float64 for float64 weights): a number above float32's largest overflows in the
# first step's arithmetic ("value cannot be converted to type float without overflow")
_F32 = torch.finfo(torch.float32)
IN_RANGE = f"at most float32's largest, {_F32.max:.3g}"


def in_range(x: Any) -> bool:
    """A finite number no larger than float32 holds (``IN_RANGE``)."""
    return finite(x) and abs(x) <= _F32.max


# a learning rate's rule: torch.optim takes one as a tensor too (its schedulers then set it in place)
RATE_RULE = f"a finite number >= 0 ({IN_RANGE}), or a 0-dim floating-point tensor holding one"


def rate_ok(lr: Any, read: bool = True) -> bool:
    """Whether ``lr`` is a learning rate (``RATE_RULE``). ``read=False``: a tensor's value is taken
    as valid (reading one on an accelerator waits for all its queued work)."""
    if torch.is_tensor(lr):
        return lr.ndim == 0 and lr.is_floating_point() and (not read or bool(torch.isfinite(lr) & (lr >= 0)))
    return in_range(lr) and lr >= 0.0


def python_numbers(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a group, or defaults) with their NumPy numbers made Python's (``python_number``),
    in place, pairs such as ``betas`` too: a state dict of them loads with
    ``torch.load(weights_only=True)``."""
    for key, value in values.items():
        if key != "params":
            is_pair = isinstance(value, tuple | list)
            values[key] = type(value)(map(python_number, value)) if is_pair else python_number(value)
    return values


def prepare_group(param_group: dict[str, Any], adamw_defaults: dict[str, Any]) -> dict[str, Any]:
    """A group as given to ``add_param_group``, before torch fills in EVON's defaults: modes given
    as Enums stored as their strings; an AdamW group's missing keys from ``adamw_defaults``, its ε
    under torch AdamW's key ``eps`` (given as ``adamw_eps``, EVON's keyword, it moves there)
    (``validate_group`` refuses torch.optim's ``amsgrad``, ``maximize``, ``differentiable`` and ``capturable``)."""
    for key in MODE_KEYS:
        if key in param_group:
            param_group[key] = mode_value(param_group[key])
    if param_group.get("algorithm", "evon") == "adamw":
        if "adamw_eps" in param_group:
            if "eps" in param_group:
                raise ValueError("an AdamW group takes its ε as 'eps' or as 'adamw_eps', not both")
            param_group["eps"] = param_group.pop("adamw_eps")
        for key, value in adamw_defaults.items():
            param_group.setdefault(key, value)
    return param_group  # its NumPy numbers made Python's by settle_group, once torch has filled it in


def resolve_rate(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with an EVON group's ``lr=None`` replaced (in place) by its clip's default α:
    AdamW's default rate through the clip's step ratio (``lr_from_adamw_lr``, which names a bad
    ``clip_radius``; an unknown clip takes "element"'s ratio, and ``validate_group`` names it)."""
    if group.get("lr", 0.0) is None and group.get("algorithm", "evon") == "evon":
        radius, clip = group.get("clip_radius", DEFAULT_CLIP_RADIUS), group.get("clip", DEFAULT_CLIP)
        group["lr"] = lr = lr_from_adamw_lr(DEFAULT_ADAMW_LR, radius, clip=ratio_clip(clip))
        if not in_range(lr):  # named by what it is made of: none was given
            raise ValueError(f"EVON: lr=None makes the default lr {lr:g} of clip_radius={radius!r}, not {IN_RANGE}: pass lr")
    return group


def resolve_prior(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with ``weight_decay=None`` replaced (in place) by ``default_weight_decay`` of its
    h0 and init_std_ratio (left None, for ``validate_group`` to name, where those are invalid)."""
    if group.get("weight_decay", 0.0) is None and group.get("algorithm", "evon") == "evon":
        h0, ratio = group.get("hess_init"), group.get("init_std_ratio", DEFAULT_INIT_STD_RATIO)
        if finite(h0) and h0 > 0 and finite(ratio) and ratio > 0:
            if ratio >= DEFAULT_PRIOR_STD_RATIO:
                raise ValueError(
                    f"EVON: weight_decay=None makes the prior's std {DEFAULT_PRIOR_STD_RATIO} of the weights' "
                    f"RMS, which needs init_std_ratio below it; got init_std_ratio={ratio!r}: pass weight_decay"
                )
            wd = default_weight_decay(h0, ratio)
            if not (in_range(wd) and wd >= _F32.tiny):  # named by what it is made of: none was given
                raise ValueError(
                    f"EVON: weight_decay=None makes the prior's weight_decay {wd:g} of hess_init={h0!r} and "
                    f"init_std_ratio={ratio!r}, outside float32's normal range ({_F32.tiny:.3g} to "
                    f"{_F32.max:.3g}): pass weight_decay, or hess_init and init_std_ratio that give one"
                )
            group["weight_decay"] = wd
    return group


def resolve_mean_weight_decay(group: dict[str, Any]) -> None:
    """Replace a group's ``mean_weight_decay=None`` (in place): where δ is fitted to the curvature
    (and so far below what regularises the mean), the δ the defaults would give from h0
    (``default_weight_decay``: the pull the mean trains well with, docs/defaults.md#step-curvature);
    elsewhere 0, as δ already pulls the mean."""
    if group.get("algorithm", "evon") != "evon" or group.get("mean_weight_decay", 0.0) is not None:
        return
    fitted = "weight_decay" in group.get("fit_to_curvature", ())
    ratio = group.get("init_std_ratio", DEFAULT_INIT_STD_RATIO)
    group["mean_weight_decay"] = default_weight_decay(group["hess_init"], ratio) if fitted else 0.0


def param_names_ok(names: Any, count: int) -> bool:
    """Whether ``names`` is a group's ``param_names`` for ``count`` parameters: a list of one str each."""
    return isinstance(names, list) and len(names) == count and all(isinstance(n, str) for n in names)


def check_fit_to_curvature(fit: Any) -> None:
    """A group's ``fit_to_curvature``: names among ``ess`` and ``weight_decay`` (none: nothing fitted)."""
    ok = isinstance(fit, tuple | list) and all(name in ("ess", "weight_decay") for name in fit)
    require("fit_to_curvature", fit, ok, "a tuple of names among 'ess' and 'weight_decay' (empty: nothing fitted)")


def validate_group(group: dict[str, Any]) -> None:
    """Check a group's hyperparameters (types and values) after ``resolve_prior``; the message
    names the field. Fields the group lacks are not checked (a group built by ``EVON`` has them all)."""

    def need(name: str, ok: Any, rule: str) -> None:
        require(name, group.get(name), bool(ok), rule)

    def has(name: str) -> bool:
        return name in group

    algorithm = group.get("algorithm", "evon")
    need("algorithm", algorithm in ALGORITHMS, "'evon' or 'adamw'")
    refuse_listed_twice([group], placed=False)
    # torch.optim's options that neither algorithm implements: a group given them (or a torch callback
    # setting them between steps) would otherwise descend, without AMSGrad, outside autograd (the step
    # runs under no_grad) and with host syncs (its finite check: no CUDA graph capture), silently
    for option in ("maximize", "amsgrad", "differentiable", "capturable"):
        need(option, not group.get(option), "False or absent: EVON does not implement it (torch.optim's option)")
    if has("clip_radius"):  # first: a default lr is derived from it
        need("clip_radius", in_range(group["clip_radius"]) and group["clip_radius"] > 0.0, f"a finite number > 0 ({IN_RANGE})")
    for name in ("lr", "configured_lr", "initial_lr"):  # the rate, and as configured (the posterior's lr)
        if has(name):
            need(name, rate_ok(group[name]), RATE_RULE)
    if has("params") and group.get("param_names") is not None:
        count = len(group["params"])
        need("param_names", param_names_ok(group["param_names"], count), f"a list of one str per parameter ({count})")
    if has("betas"):
        need("betas", betas_ok(group["betas"]), "two numbers in [0, 1)")
    if has("weight_decay"):
        wd = group["weight_decay"]
        # None survives resolve_prior only where h0 or init_std_ratio is invalid: those are named below
        unresolved = wd is None and algorithm == "evon"
        need("weight_decay", unresolved or (in_range(wd) and wd >= 0.0), f"a finite number >= 0 ({IN_RANGE})")
    if algorithm == "adamw":
        if has("eps"):  # AdamW's ε (torch AdamW's key); the step reads no other
            need("eps", finite(group["eps"]) and group["eps"] > 0.0, "a finite number > 0")
        # set between steps it would be ignored: the step reads "eps"
        rule = "absent: an AdamW group's ε is its 'eps', as in torch.optim.AdamW"
        need("adamw_eps", not has("adamw_eps"), rule)
        return
    if has("fit_to_curvature"):  # first: whether ess is fitted decides rules below
        check_fit_to_curvature(group["fit_to_curvature"])
    if has("ess"):
        ess = group["ess"]
        need(
            "ess",
            ess == AUTO_ESS if isinstance(ess, str) else (is_real(ess) and ess > 0.0),
            "'auto' or a number > 0 (float('inf') for no noise)",
        )
        if group.get("weight_decay") == 0.0 and ess != float("inf"):
            # H is 0 where the data does not curve (a dead unit): only the prior bounds the variance there
            rule = "> 0 where ess is finite: the prior N(0, 1/(ess·weight_decay)) bounds the variance (0 only with ess=inf)"
            need("weight_decay", False, rule)
        wd = group.get("weight_decay")
        if is_real(ess) and 0.0 < ess < float("inf") and finite(wd) and wd > 0.0:
            # the widest variance, the prior's 1/(ess·weight_decay), must be finite in float32
            rule = f"a number whose product with weight_decay ({wd:g}), the prior's precision, is at least {_F32.tiny:.3g}"
            need("ess", ess * wd >= _F32.tiny, rule)
    ratio = group.get("init_std_ratio", DEFAULT_INIT_STD_RATIO)
    need("init_std_ratio", finite(ratio) and ratio > 0.0, "a finite number > 0")
    if finite(ratio) and ratio > 0.0 and _ess_fitted(group):
        # noise_std_ratio raises the fitted noise from it to DEFAULT_PRIOR_STD_RATIO: at or above
        # that, the first fit (after the weights have moved) would raise
        rule = (
            f"a number below {DEFAULT_PRIOR_STD_RATIO}, the fitted noise's final ratio, where ess is fitted "
            "to the curvature (ess='auto' under hess_estimator='fisher' with curvature_refit > 0)"
        )
        need("init_std_ratio", ratio < DEFAULT_PRIOR_STD_RATIO, rule)
    if has("hess_init"):
        need("hess_init", in_range(group["hess_init"]) and group["hess_init"] > 0.0, f"a finite number > 0 ({IN_RANGE})")
    for name in ("mc_samples", "precondition_frequency", "max_precond_dim"):
        if has(name):
            need(name, is_int(group[name]) and group[name] >= 1, "an integer >= 1")
    if has("max_precond_ratio"):
        ratio = group["max_precond_ratio"]
        need("max_precond_ratio", is_real(ratio) and ratio >= 1.0, "a number >= 1 (float('inf'): no limit)")
    if has("shampoo_beta"):
        sb = group["shampoo_beta"]
        need("shampoo_beta", sb is None or (is_real(sb) and 0.0 <= sb < 1.0), "None or a number in [0, 1)")
    if has("hess_clip_ratio"):
        gamma = group["hess_clip_ratio"]
        need("hess_clip_ratio", gamma is None or (is_real(gamma) and gamma > 0.0), "None or a number > 0")
    if has("clip"):
        need("clip", isinstance(group["clip"], str) and group["clip"] in CLIP_MODES, f"one of {CLIP_MODES}")
    if has("hess_estimator"):
        need("hess_estimator", group["hess_estimator"] in HESS_ESTIMATORS, f"one of {HESS_ESTIMATORS}")
    if has("step_curvature"):
        need("step_curvature", group["step_curvature"] in STEP_CURVATURES, f"one of {STEP_CURVATURES}")
    if has("mean_weight_decay"):
        mwd = group["mean_weight_decay"]
        need("mean_weight_decay", mwd is None or (in_range(mwd) and mwd >= 0.0), f"None or a finite number >= 0 ({IN_RANGE})")
    if has("curvature_refit"):
        need("curvature_refit", is_int(group["curvature_refit"]) and group["curvature_refit"] >= 0, "an integer >= 0")
    if has("eps"):
        need("eps", finite(group["eps"]) and group["eps"] > 0.0, "a finite number > 0")
    for name in ("phased_gradients", "identity_basis", "stagger_refresh"):
        if has(name):
            need(name, isinstance(group[name], bool), "True or False (a bool, not a string or number)")
    if has("snr_scaling"):  # a group from a state dict without the option lacks it (off)
        need(
            "snr_scaling",
            is_snr_scaling(group["snr_scaling"]),
            "True, False or 'adam' (a bool or that string)",
        )
    names = group.get("param_names")
    for i, p in enumerate(group.get("params", ())):
        label = repr(names[i]) if names else f"#{i} of its group"
        if p.is_complex():
            raise ValueError(
                f"EVON cannot train the complex parameter {label} (shape {tuple(p.shape)}, {p.dtype}): "
                "its posterior and eigenbasis are real. Train it as a real tensor (torch.view_as_real) "
                "or in a group with algorithm='adamw'"
            )
        if not p.is_floating_point():
            raise ValueError(f"EVON cannot train the {p.dtype} parameter {label}: it needs floating-point weights")
        if p.layout != torch.strided:
            raise ValueError(f"EVON cannot train the {p.layout} parameter {label}: it needs dense weights")


# what a group not built yet fits to its curvature where it omits these keys (the constructor's defaults)
_FIT_DEFAULTS = {"ess": AUTO_ESS, "hess_estimator": DEFAULT_HESS_ESTIMATOR, "curvature_refit": DEFAULT_CURVATURE_REFIT}


def _ess_fitted(group: dict[str, Any]) -> bool:
    """Whether the group's ζ is refit to its curvature: named in its ``fit_to_curvature`` once built,
    else as ``curvature.curvature_fitted`` decides at build (missing keys: EVON's defaults)."""
    if "fit_to_curvature" in group:
        return "ess" in (group["fit_to_curvature"] or ())
    return "ess" in curvature_fitted({**_FIT_DEFAULTS, **group})


# what a scheduler sets each step: not part of a group's settings checked once
_SCHEDULED = ("params", "param_names", "lr", "initial_lr")


def settle_group(group: dict[str, Any]) -> None:
    """``group`` checked (``validate_group``), its NumPy numbers made Python's, and its None defaults
    resolved as the constructor resolves them: an EVON group's ``lr`` (its clip's default α),
    ``weight_decay`` (``resolve_prior``), then ``mean_weight_decay``."""
    validate_group(resolve_prior(resolve_rate(python_numbers(group))))
    resolve_mean_weight_decay(group)


def build_group(group: dict[str, Any], updates: int, built: dict[int, dict[str, Any]]) -> None:
    """A group ``add_param_group`` has just added, after ``updates`` updates: what is fitted to its
    curvature decided (``curvature_fitted``, fixed from here on), its fits' clock started where it is
    added mid-run (``fit_from``), settled (``settle_group``), and the keys that decided it kept in
    ``built`` (``fit_record``, by id of group), which ``validate_groups`` holds it to."""
    check_fit_to_curvature(group.setdefault("fit_to_curvature", curvature_fitted(group)))
    if group["fit_to_curvature"] and updates:  # added mid-run: its fits' clock starts here
        group.setdefault("fit_from", updates)
    record = fit_record(group)  # before settle_group resolves weight_decay=None
    settle_group(group)
    # EVON's record of the rate as configured; torch's initial_lr stays the schedulers' (rates.py: both)
    record_configured_rate(group)
    built[id(group)] = {**record, "set_by_fit": fitted_values(group)}  # the resolved weight_decay


# what decides, when a group is built, what is fitted to its curvature (curvature_fitted)
FIT_KEYS = ("hess_estimator", "curvature_refit", "ess", "weight_decay")


def fit_record(group: dict[str, Any]) -> dict[str, Any]:
    """``group``'s ``FIT_KEYS`` as it is built: ess "auto" and weight_decay None where its
    ``fit_to_curvature`` names them (a loaded or copied group holds the numbers fitted since), and
    under ``set_by_fit`` those numbers as it holds them (``curvature.note_fitted``)."""
    fitted, unset = group.get("fit_to_curvature") or (), {"ess": AUTO_ESS, "weight_decay": None}
    record = {key: unset[key] if key in fitted else group.get(key) for key in FIT_KEYS}
    return {**record, "set_by_fit": fitted_values(group)}


def fit_records(groups: list[dict[str, Any]], kept: list[Any] | None = None) -> dict[int, dict[str, Any]]:
    """Each group's ``fit_record`` (by id of group) for groups that arrive built (a state dict's, a
    copy's), which are built with what they hold; ``kept``: a copy's originals' records, in order."""
    kept = kept if kept and len(kept) == len(groups) else [None] * len(groups)
    return {id(g): dict(r) if r is not None else fit_record(g) for g, r in zip(groups, kept, strict=True)}


def _fit_edits(group: dict[str, Any], was: dict[str, Any]) -> dict[str, Any]:
    """``was`` (a ``fit_record``) with the group's valid edits (the invalid: ``validate_group`` names
    them); an "auto" ess and a None weight_decay stay, resolved to numbers since."""
    now = dict(was)
    if group.get("hess_estimator") in HESS_ESTIMATORS:
        now["hess_estimator"] = group["hess_estimator"]
    refit = group.get("curvature_refit")
    if is_int(refit) and refit >= 0:
        now["curvature_refit"] = refit
    if was["ess"] != AUTO_ESS:
        now["ess"] = group.get("ess")
    if was["weight_decay"] is not None:
        now["weight_decay"] = group.get("weight_decay")
    return now


def check_fit_record(group: dict[str, Any], built: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Raise, naming the key, where an EVON group's edits of ``FIT_KEYS`` would change what its
    build (``built``, by id of group; else: what it holds) fixed to be fitted to its curvature
    (``fit_to_curvature``), or its ``hess_estimator`` (H holds that estimate's history); else return
    its record with the edits, which take effect as if the group had been built with them."""
    was = built.get(id(group)) or fit_record(group)
    now = _fit_edits(group, was)
    if group.get("algorithm", "evon") != "evon":
        return now
    fitted = curvature_fitted(was)
    if now["hess_estimator"] != was["hess_estimator"]:
        key, why = "hess_estimator", ", and H holds its estimate's history"
    elif curvature_fitted(now) != fitted and tuple(group.get("fit_to_curvature") or ()) == fitted:
        # (a fit_to_curvature edited by hand, as docs/usage.md offers, says itself what is fitted)
        changed = [k for k in FIT_KEYS if now[k] != was[k]]
        flips = [k for k in changed if curvature_fitted({**was, k: now[k]}) != fitted]
        key, why = (flips or changed)[0], f": {list(fitted)} as built, {list(curvature_fitted(now))} with it"
    else:
        return now
    raise ValueError(
        f"{key!r} changed from {mode_value(was[key])!r} to {mode_value(now[key])!r} after the group was "
        f"built: it fixes whether ess and weight_decay are fitted to the curvature (fit_to_curvature){why}. "
        "Set it when building the optimizer (or add the parameters as a new group)"
    )


def samples_per_step(groups: list[dict[str, Any]]) -> int:
    """The largest ``mc_samples`` over EVON groups, each checked as ``validate_group`` checks it (an
    edit between steps, a float or a string, is named here, not by the loop's ``range``)."""
    counts = [(i, g["mc_samples"]) for i, g in enumerate(groups) if g["algorithm"] == "evon"]
    for i, n in counts:
        try:
            require("mc_samples", n, is_int(n) and n >= 1, "an integer >= 1")
        except ValueError as err:
            raise ValueError(f"param_groups[{i}]: {err}") from None
    return max((n for _, n in counts), default=1)


def validate_groups(
    groups: list[dict[str, Any]], checked: dict[int, tuple[Any, ...]], built: dict[int, dict[str, Any]]
) -> None:
    """Every group checked as by ``validate_group``, the error naming the group: ``step()`` runs it
    before it changes anything, since a field changed mid-run (a mode set to a typo) would otherwise
    raise halfway through the buckets, some of their state already updated. ``checked`` (the
    optimizer's, by id of group) holds the settings last found valid: such a group is not checked
    again but for its rate, which schedulers set every step. ``built``: each group's keys that
    decided what is fitted to its curvature (``check_fit_record``), updated with the edits it takes."""
    passed: dict[int, tuple[Any, ...]] = {}
    for i, group in enumerate(groups):
        lr = group.get("lr")
        on_host = not torch.is_tensor(lr) or lr.device.type == "cpu"  # a device's rate: read at set-up only
        with contextlib.suppress(Exception):  # a tensor setting compares elementwise: check it
            if checked.get(id(group)) == _settings(group) and rate_ok(lr, read=on_host):
                group["lr"] = python_number(lr)  # a NumPy rate: Python's
                continue
        try:
            check_fit_to_curvature(fitted := group.get("fit_to_curvature") or ())  # first: read below
            numbers = [k for k in fitted if group.get(k) is not None and not isinstance(group.get(k), str)]
            record = check_fit_record(group, built)  # before a None is resolved
            settle_group(group)  # weight_decay=None and mean_weight_decay=None set mid-run: resolved
        except (ValueError, TypeError) as err:
            raise type(err)(f"param_groups[{i}]: {err}") from None
        keep_user_numbers(group, record, numbers)
        built[id(group)] = record
        passed[id(group)] = _settings(group)
    if passed:  # a list edited in place (torch.optim allows it) may list a parameter again
        refuse_listed_twice(groups)
        checked.update(passed)


def _settings(group: dict[str, Any]) -> tuple[Any, ...]:
    """What ``validate_groups`` last found valid in ``group``: its values but the scheduled ones, and
    which parameters its list holds (by id: an edit in place changes the list, not the group's values)."""
    return (*(v for k, v in group.items() if k not in _SCHEDULED), tuple(map(id, group["params"])))


# what the buckets and their state are built from: fixed once they are (a change would silently
# apply only after the next rebuild, e.g. a state-dict round trip)
LAYOUT_KEYS = ("algorithm", "identity_basis", "max_precond_dim", "max_precond_ratio", "stagger_refresh")


def group_layout(group: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(group.get(k) for k in LAYOUT_KEYS)


def check_layout(groups: list[dict[str, Any]], built: dict[int, tuple[Any, ...]]) -> None:
    """Raise, naming the group and the key, where a group's layout (``LAYOUT_KEYS``) is no longer
    the one its buckets were ``built`` with (by id of group)."""
    for i, group in enumerate(groups):
        layout = built.get(id(group))
        if layout is not None and layout != group_layout(group):
            key, was = next((k, v) for k, v in zip(LAYOUT_KEYS, layout) if v != group.get(k))
            raise ValueError(
                f"param_groups[{i}]: {key!r} changed from {was!r} to {group.get(key)!r} after the optimizer "
                "built its state: it fixes the group's algorithm and eigenbases. Set it when building the "
                "optimizer (or add the parameters as a new group)"
            )


_SHAPE = operator.attrgetter("shape")


def _evon_members(groups: list[dict[str, Any]]) -> tuple[tuple[int, tuple[int, ...], tuple[torch.Size, ...]], ...]:
    """Each EVON group (by id) with its parameters' ids and shapes, in order: whom its buckets hold
    (read a few times a step: ``map`` keeps the per-parameter work out of Python's loop)."""
    evon = [g for g in groups if g.get("algorithm") == "evon"]
    return tuple((id(g), tuple(map(id, g["params"])), tuple(map(_SHAPE, g["params"]))) for g in evon)


def _refuse_resized(built: tuple, groups: list[dict[str, Any]], label: Callable[[torch.Tensor], str]) -> None:
    """Raise, naming the parameter, where one of the ``built`` members now has another shape (its
    ``.data`` replaced): the stacked state is shaped for the old one, and nothing is changed yet."""
    shapes = {pid: shape for _, ids, sizes in built for pid, shape in zip(ids, sizes)}
    for g in groups:
        for p in g["params"] if g.get("algorithm") == "evon" else ():
            was = shapes.get(id(p), p.shape)
            if was != p.shape:
                raise ValueError(
                    f"parameter {label(p)} changed shape from {tuple(was)} to {tuple(p.shape)} after the "
                    "optimizer built its state, which is shaped for the old one: put the old shape back, "
                    "or build a new optimizer for the resized model"
                )


class BuiltLayout:
    """What the buckets were built from: each group's layout (``LAYOUT_KEYS``), fixed once they are
    (``check``), and the EVON groups' parameters. torch.optim lets a user edit a group's list in place
    (``param_groups[i]["params"].append(p)``, ``del ...[j]``) and steps what it holds at each step:
    such an edit (``edited``) rebuilds the buckets, so that an appended parameter trains and a
    removed one no longer does."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.layouts = {id(g): group_layout(g) for g in groups}
        self.members = _evon_members(groups)

    def check(self, groups: list[dict[str, Any]]) -> None:
        check_layout(groups, self.layouts)

    def edited(self, groups: list[dict[str, Any]], label: Callable[[torch.Tensor], str]) -> bool:
        members = _evon_members(groups)
        if members == self.members:
            return False
        _refuse_resized(self.members, groups, label)
        return True


# an EVON group's hyperparameters (EVON's keyword arguments that become group defaults), in the
# order EVON takes them. An AdamW group carries them too, inert but ``eps``, which is AdamW's ε there
# (torch AdamW's key; EVON's ``adamw_eps`` sets its default)
GROUP_KEYS = (
    "lr",
    "ess",
    "hess_init",
    "betas",
    "weight_decay",
    "mc_samples",
    "precondition_frequency",
    "max_precond_dim",
    "max_precond_ratio",
    "shampoo_beta",
    "hess_clip_ratio",
    "clip",
    "clip_radius",
    "snr_scaling",
    "phased_gradients",
    "identity_basis",
    "stagger_refresh",
    "init_std_ratio",
    "eps",
    "hess_estimator",
    "curvature_refit",
    "step_curvature",
    "mean_weight_decay",
)
