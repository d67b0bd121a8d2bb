"""The JSON rules of a posterior config: each takes (JSON value, field name, where) and returns
the Python value or raises :class:`PosteriorMismatchError` naming the file and the field. Wrong
JSON types are refused, never coerced or truncated. The schema that uses them:
:mod:`hf_evon.posterior.config`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from hf_evon.optim.checks import HESS_ESTIMATORS, STEP_CURVATURES
from hf_evon.optim.defaults import is_snr_scaling


class PosteriorMismatchError(ValueError):
    """A posterior does not fit a model, or a posterior file is invalid. The message always names
    the offending tensor (or config field), so a mismatch is never silently skipped."""


# Each rule takes (JSON value, field name, where) and returns the Python value or raises an
# error naming the field: wrong JSON types are refused, never coerced or truncated.
Rule = Callable[[Any, str, str], Any]


def shown(value: Any) -> str:
    """``repr(value)``, cut short: a file from elsewhere may hold a 400-digit number or a 1 MB string."""
    text = repr(value)
    return f"{text[:60]}... ({len(text)} characters)" if len(text) > 80 else text


def rule_error(where: str, field: str, rule: str, value: Any) -> PosteriorMismatchError:
    return PosteriorMismatchError(f"{where}: field {field!r} must be {rule}; got {shown(value)}")


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A parsed JSON object (``json.loads``' ``object_pairs_hook``) whose keys are all different.

    JSON leaves a repeated key's value undefined: Python keeps the last, other readers the first,
    so a config could show one ``ess`` and load another.
    """
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(
                    f"key {shown(key)} appears twice in one object; JSON readers disagree on which value it has"
                )
            seen.add(key)
    return out


def as_float(value: Any) -> float | None:
    """``value`` as a float: None for what is not a JSON number (a bool, a string) and for an
    integer past a float's range (JSON allows ``1`` followed by 400 zeros)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def number(value: Any, field: str, where: str) -> float:
    """A JSON number, or ``"inf"`` (as an infinite ess is written); an integer stays one, so a
    config is written back as it was given."""
    if value == "inf":
        return math.inf
    number = as_float(value)
    # NaN and -inf (Python's json reads the literals NaN, -Infinity) cannot be written back
    if number is None or math.isnan(number) or number == -math.inf:
        raise rule_error(where, field, 'a number (or "inf")', value)
    return value


def positive_number(value: Any, field: str, where: str) -> float:
    """A JSON number > 0, or ``"inf"`` (a ζ: ``1/ζ`` scales every variance); an integer stays one."""
    json_float(value, field, where, positive=True)
    return math.inf if value == "inf" else value


def at_least(minimum: float, *, finite: bool = False) -> Rule:
    """A JSON number ``>= minimum``, or (unless ``finite``) ``"inf"``; an integer stays one."""
    shown_rule = f"a finite number >= {minimum:g}" if finite else f'a number >= {minimum:g} (or "inf")'

    def rule(value: Any, field: str, where: str) -> float:
        number = math.inf if value == "inf" and not finite else as_float(value)
        if number is None or not number >= minimum or (finite and number == math.inf):  # NaN too
            raise rule_error(where, field, shown_rule, value)
        return math.inf if value == "inf" else value

    return rule


def one_of(names: tuple[str, ...]) -> Rule:
    """One of ``names`` (a mode as the optimizer's Enum gives it): another string, even in other case, is refused."""

    def rule(value: Any, field: str, where: str) -> str:
        if not isinstance(value, str) or value not in names:
            raise rule_error(where, field, f"one of {sorted(names)}", value)
        return value

    return rule


# the optimizer's modes as its Enums give them (hf_evon.optim.checks)
hess_estimator = one_of(HESS_ESTIMATORS)
step_curvature = one_of(STEP_CURVATURES)


def integer(minimum: int) -> Rule:
    """A JSON integer ``>= minimum``: ``64.7`` or ``"64"`` is refused, never truncated."""

    def rule(value: Any, field: str, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise rule_error(where, field, f"an integer >= {minimum}", value)
        return value

    return rule


def boolean(value: Any, field: str, where: str) -> bool:
    """A JSON ``true``/``false``: the string ``"false"`` would be truthy, so it is refused."""
    if not isinstance(value, bool):
        raise rule_error(where, field, "true or false", value)
    return value


def string(value: Any, field: str, where: str) -> str:
    if not isinstance(value, str):
        raise rule_error(where, field, "a string", value)
    return value


def snr_scaling(value: Any, field: str, where: str) -> bool | str:
    """``true``/``false`` or ``"adam"`` (``EVON``'s ``snr_scaling``)."""
    if not is_snr_scaling(value):
        raise rule_error(where, field, 'true, false or "adam"', value)
    return value


def betas(value: Any, field: str, where: str) -> tuple[float, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise rule_error(where, field, "a list of two numbers", value)
    return (number(value[0], f"{field}[0]", where), number(value[1], f"{field}[1]", where))


def shape(value: Any, field: str, where: str, empty: bool = False) -> tuple[int, ...]:
    """A list of integers >= 1; ``empty``: the empty list too (a 0-d tensor's shape)."""
    rule = "a list of integers >= 1" if empty else "a non-empty list of integers >= 1"
    if not isinstance(value, list) or not (value or empty):
        raise rule_error(where, field, rule, value)
    for d in value:
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise rule_error(where, field, rule, value)
    return tuple(value)


# characters a path may hold here besides letters, digits and spaces are refused where they would
# end a string, a code span or a table cell of the model card, or start markup
_BASE_MODEL_REFUSED = re.compile(r"[\"'`<>|\\\x00-\x1f\x7f-\x9f\u2028\u2029]")
MAX_BASE_MODEL_CHARS = 1024


def base_model(value: Any, field: str, where: str) -> str:
    """A Hub id or a path: it is shown in model cards and pasted into their code, so a config
    from elsewhere must not carry quotes, backquotes, markup or control characters."""
    if (
        not isinstance(value, str)
        or not value.strip()
        or len(value) > MAX_BASE_MODEL_CHARS
        or _BASE_MODEL_REFUSED.search(value)
    ):
        raise rule_error(
            where,
            field,
            f"a Hub id or a path of at most {MAX_BASE_MODEL_CHARS} characters, without quotes, "
            "backquotes, backslashes, '<', '>', '|' or control characters",
            value,
        )
    return value


def recordable_base_model(value: str | None) -> str | None:
    """``value`` where a config may record it as ``base_model`` (see ``base_model``), else None:
    a model loaded from an unusual path is saved without naming it rather than not saved."""
    if value is None:
        return None
    try:
        return base_model(value, "base_model", "")
    except PosteriorMismatchError:
        return None


def json_float(value: Any, field: str, where: str, *, positive: bool = False) -> float:
    """A number, or ``"inf"``/``"-inf"``/``"nan"`` as ``json_value`` writes them; ``positive``: > 0."""
    number = float(value) if isinstance(value, str) and value in ("inf", "-inf", "nan") else as_float(value)
    if number is None or (positive and not number > 0):  # NaN too
        raise rule_error(where, field, 'a number > 0 (or "inf")' if positive else 'a number (or "inf")', value)
    return number


def is_temperature(value: Any) -> bool:
    """Whether ``value`` is a BMA softmax temperature: a finite number > 0 (not a bool)."""
    number = as_float(value)
    return number is not None and 0 < number < math.inf


def temperature(value: Any, field: str, where: str) -> float:
    if not is_temperature(value):
        raise rule_error(where, field, "a finite number > 0", value)
    return value


def mean_fingerprint(value: Any, field: str, where: str) -> dict[str, Any]:
    """``{"dtype": str, "values": {name: [numbers]}}`` (``hf_evon.posterior.fingerprint``)."""
    rule = 'an object {"dtype": a string, "values": {parameter name: a list of at most 64 numbers}}'
    if not isinstance(value, dict) or not isinstance(value.get("dtype"), str):
        raise rule_error(where, field, rule, value)
    values = value.get("values")
    if not isinstance(values, dict):
        raise rule_error(where, f"{field}.values", rule, values)
    for name, entry in values.items():
        key = f"{field}.values.{name}"
        if not isinstance(entry, list) or len(entry) > 64:
            raise rule_error(where, key, "a list of at most 64 numbers", entry)
        for i, number in enumerate(entry):
            json_float(number, f"{key}[{i}]", where)
    dtypes = value.get("dtypes", {})  # where the covered tensors' dtypes differ: each one's
    if not isinstance(dtypes, dict) or not all(isinstance(d, str) for d in dtypes.values()):
        raise rule_error(where, f"{field}.dtypes", "an object {parameter name: a dtype's name}", dtypes)
    return value


def pruned_ranks(value: Any, field: str, where: str) -> dict[str, list[int]]:
    """``{parameter name: [indices]}``: the entries (of the row-major flatten) AdaLoRA's rank allocation
    pruned, increasing integers >= 0, each list non-empty."""
    rule = "an object {parameter name: a non-empty increasing list of integers >= 0}"
    if not isinstance(value, dict):
        raise rule_error(where, field, rule, value)
    for name, indices in value.items():
        if not isinstance(indices, list) or not indices:
            raise rule_error(where, f"{field}.{name}", rule, indices)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in indices) or indices != sorted(
            set(indices)
        ):
            raise rule_error(where, f"{field}.{name}", rule, indices)
    return value


def tied_parameters(value: Any, field: str, where: str) -> dict[str, str]:
    """``{other name: covered name}``: each further name of a weight the model ties under several names,
    and the name it is covered under (its first in ``named_parameters()``)."""
    if not isinstance(value, dict):
        raise rule_error(where, field, "an object {other name of a tied weight: its covered name}", value)
    for alias, name in value.items():
        if not isinstance(name, str):
            raise rule_error(where, f"{field}.{alias}", "a string (the covered name)", name)
    return value


def ess_by_name(value: Any, field: str, where: str) -> dict[str, float]:
    """``{parameter name: ess > 0 or "inf"}`` (the trained ζ of parameters whose group's differs)."""
    if not isinstance(value, dict):
        raise rule_error(where, field, 'an object {parameter name: a number > 0 or "inf"}', value)
    return {name: json_float(v, f"{field}.{name}", where, positive=True) for name, v in value.items()}


# the calibration record's keys a card or a reader uses: (key, required, kind)
_CALIBRATION_KEYS = (
    ("ess", True, "positive"),
    ("trained_ess", True, "positive"),
    ("mean_nll", True, "number"),
    ("chosen_nll", False, "number"),
    ("min_gain", False, "number"),
    ("standard_errors", False, "nullable"),
    ("mean_temperature", False, "nullable"),
    ("temperature", False, "positive"),
    ("tempered_mean_nll", False, "nullable"),
    ("temperatures", False, "list"),
    ("num_samples", False, "integer"),
    ("num_targets", False, "integer"),
    ("seed", False, "seed"),
    ("grid", False, "list"),
    ("nll", False, "list"),
    ("scanned", False, "bool"),
    ("screened", False, "list"),
)


def calibration(value: Any, field: str, where: str) -> dict[str, Any]:
    """The record of ``hf_evon.predictive.calibration`` (``CalibrationResult.to_json``): the keys
    a card renders are checked, others kept as written."""
    if not isinstance(value, dict):
        raise rule_error(where, field, "an object", value)
    for key, required, kind in _CALIBRATION_KEYS:
        name = f"{field}.{key}"
        if key not in value and required:
            raise PosteriorMismatchError(f"{where}: field {name!r} is missing from the calibration record")
        item = value.get(key)
        if key not in value or (kind == "nullable" and item is None):
            continue
        if kind == "integer":
            integer(0)(item, name, where)
        elif kind == "seed":  # any integer: seeds may be negative (hf_evon.optim.noise.resolve_seed)
            if isinstance(item, bool) or not isinstance(item, int):
                raise rule_error(where, name, "an integer", item)
        elif kind == "bool" and not isinstance(item, bool):
            raise rule_error(where, name, "true or false", item)
        elif kind == "list":
            if not isinstance(item, list):
                raise rule_error(where, name, "a list of numbers", item)
            for i, entry in enumerate(item):
                json_float(entry, f"{name}[{i}]", where)
        elif kind != "bool":
            json_float(item, name, where, positive=kind == "positive")
    return value
