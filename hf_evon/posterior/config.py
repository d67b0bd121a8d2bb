"""The JSON config of a saved posterior (``evon_posterior_config.json``), as a typed dataclass.

:class:`PosteriorConfig` is the config's schema: each field declares its JSON rule, and
:meth:`PosteriorConfig.from_dict` validates a parsed file against it (errors name the file and
the field; nothing is coerced), :meth:`PosteriorConfig.to_dict` writes it back key for key.
The contract (keys, tensors, versioning): ``docs/posterior-format.md``.
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any

import torch

import hf_evon.posterior.json_rules as rules
from hf_evon import __version__
from hf_evon.optim.buckets import matrix_shape
from hf_evon.optim.checks import is_real, python_number
from hf_evon.posterior.gaussian import MatrixFactors, basis_dtype
from hf_evon.posterior.json_rules import PosteriorMismatchError

__all__ = [
    "FORMAT_VERSION",
    "POSTERIOR_CONFIG_NAME",
    "POSTERIOR_WEIGHTS_NAME",
    "STAGED_WEIGHTS_GLOB",
    "ParameterEntry",
    "PosteriorConfig",
    "PosteriorMismatchError",
    "TensorDtype",
]

FORMAT_VERSION = 1
POSTERIOR_WEIGHTS_NAME = "evon_posterior.safetensors"
POSTERIOR_CONFIG_NAME = "evon_posterior_config.json"
CHECKPOINT_ID_PATTERN = "[0-9a-f]{32}"  # a save's checkpoint_id (uuid4().hex)


def staged_weights_name(checkpoint_id: str) -> str:
    """The weights file a save with ``checkpoint_id`` stages (docs/posterior-format.md#the-save-protocol):
    the canonical name with the id before its extension. The one spelling of it: the patterns below, the
    save's clean-up and the Hub's deletions derive from it."""
    stem, extension = os.path.splitext(POSTERIOR_WEIGHTS_NAME)
    return f"{stem}.{checkpoint_id}{extension}"


# every staged weights file, as a glob (fnmatch: huggingface_hub's delete_patterns) and as a regex
STAGED_WEIGHTS_GLOB = staged_weights_name("*")
_ID = "<checkpoint_id>"
STAGED_WEIGHTS_RE = re.compile(CHECKPOINT_ID_PATTERN.join(map(re.escape, staged_weights_name(_ID).split(_ID))))
# the weights file a config may name: the canonical one, or one staged by an interrupted save
WEIGHTS_FILE_RE = re.compile(f"{re.escape(POSTERIOR_WEIGHTS_NAME)}|{STAGED_WEIGHTS_RE.pattern}")


class TensorDtype(str, Enum):
    """The dtypes a posterior's tensors are held and stored in, by their names in the config."""

    FLOAT32 = "float32"
    FLOAT64 = "float64"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.value)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_dtype(value: torch.dtype | str | None, argument: str = "dtype") -> torch.dtype | None:
    """``torch.float16``, ``"float16"`` or ``"torch.float16"`` as a torch dtype (None stays None);
    anything but a ``TensorDtype`` is refused by ``argument``: an integer cast of Gaussian noise
    or of a basis would silently round it to zeros."""
    if value is None:
        return value
    name = dtype_name(value) if isinstance(value, torch.dtype) else str(value).removeprefix("torch.")
    try:
        return TensorDtype(name).dtype
    except ValueError:
        raise ValueError(
            f"{argument} must be one of {sorted(d.value for d in TensorDtype)}; got {value!r}"
        ) from None


def declared_basis_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype ``config["eigenbasis_dtype"]`` holds the bases in (None where it names no float dtype).

    A posterior read from half-precision bases holds them upcast to float32 but no more precise than
    they were read: a save writes them as read, not as float32 that float32's orthonormality check
    (``docs/posterior-format.md#orthonormality``) refuses on load."""
    try:
        return as_dtype(config.get("eigenbasis_dtype"))
    except ValueError:
        return None

def json_value(value: Any) -> Any:
    """JSON-safe copy: tuples become lists, infinities the strings "inf"/"-inf", NumPy numbers (which
    the optimizer takes for its hyperparameters) Python's."""
    value = python_number(value)  # np.float32(0.1) -> 0.1, np.int64(2) -> 2
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, tuple | list):
        return [json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return str(value)


def ess_number(value: Any, argument: str, positive: bool = False) -> float:
    """An ess (or a factor on one) given as a number (Python or NumPy, as the optimizer takes its
    arguments), as a float; anything else refused by ``argument``, and with ``positive`` one not > 0."""
    if not is_real(value):
        raise TypeError(f"{argument} must be a number (math.inf for no noise); got {value!r}")
    if positive and not value > 0:
        raise PosteriorMismatchError(f"{argument} must be > 0 (inf for no noise); got {value!r}")
    return float(value)


def check_noise_scale(ess: float, weight_decay: float, where: str) -> None:
    """``ess > 0`` (``inf``: no noise) and a finite ``weight_decay >= 0``, or an error naming ``where``."""
    if not ess > 0.0:
        raise PosteriorMismatchError(f"{where}: ess must be > 0 (inf for no noise); got {ess!r}")
    if not (weight_decay >= 0.0 and math.isfinite(weight_decay)):
        raise PosteriorMismatchError(f"{where}: weight_decay must be finite and >= 0; got {weight_decay!r}")


def hand_set_scale(config: Mapping[str, Any], ess: float, scales: Mapping[str, float]) -> dict[str, Any]:
    """``config`` of a posterior whose noise scale is set by hand to top-level ``ess`` (``with_ess``,
    ``scale_ess``), ``scales`` being each covered name's ζ before. A calibration's record no longer
    describes the scale and goes; the trained ζ stays (``trained_ess``, and ``trained_ess_by_parameter``
    for names at another ζ, as a calibration records them), recorded from ``scales`` where absent, so the
    trained posterior can still be restored and a calibration still searches multiples of it."""
    out = {key: value for key, value in config.items() if key != "calibration"}
    if out.get("trained_ess") is None:
        trained = float(config["ess"])
        others = {name: value for name, value in scales.items() if value != trained}
        out.pop("trained_ess_by_parameter", None)
        out.update(trained_ess=trained, **({"trained_ess_by_parameter": others} if others else {}))
    out["ess"] = ess
    return out


def check_tied_parameters(aliases: Any, covered: Any, where: str) -> dict[str, str]:
    """``aliases`` (``tied_parameters``; None: none), each name of which resolves to a covered name and has
    no factors of its own."""
    aliases = {} if aliases is None else rules.tied_parameters(aliases, "tied_parameters", where)
    for alias, name in aliases.items():
        if alias in covered:
            raise PosteriorMismatchError(f"{where}: tied_parameters maps {alias!r}, which is covered itself, to {name!r}")
        if name not in covered:
            raise PosteriorMismatchError(f"{where}: tied_parameters maps {alias!r} to {name!r}, which is not covered")
    return dict(aliases)


# a saved config nests 4 levels (parameters.<name>.shape); writing it back recurses per level
MAX_CONFIG_DEPTH = 64


def check_depth(raw: Any, where: str) -> None:
    """Refuse JSON nested deeper than ``MAX_CONFIG_DEPTH`` (walked without recursion), so that
    no later step (validation, ``to_json``) can hit Python's recursion limit on it."""
    stack = [(raw, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_CONFIG_DEPTH:
            raise PosteriorMismatchError(
                f"{where}: the config nests lists/objects deeper than {MAX_CONFIG_DEPTH} levels"
            )
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _weights_file(value: Any, field: str, where: str) -> str:
    """A plain file name written by a save: never a path out of the directory."""
    if not isinstance(value, str) or not WEIGHTS_FILE_RE.fullmatch(value):
        raise rules.rule_error(
            where, field, f"{POSTERIOR_WEIGHTS_NAME!r} or {staged_weights_name('<32 hex digits>')!r}", value
        )
    return value


def _tensor_dtype(value: Any, field: str, where: str) -> str:
    """The name of a ``TensorDtype`` (``"float32"``), as a save writes the dtypes it stores tensors in."""
    names = sorted(d.value for d in TensorDtype)
    if value not in names:
        raise rules.rule_error(where, field, f"one of {names}", value)
    return value


def _optional(rule: rules.Rule, *, nullable: bool = False) -> Any:
    """A config field that may be absent (None), checked by ``rule`` where present.

    ``nullable``: a JSON ``null`` is allowed (and written back as ``null``).
    """
    return field(default=None, metadata={"rule": rule, "nullable": nullable})


# ----------------------------------------------------------------------------- the schema
@dataclass(frozen=True)
class ParameterEntry:
    """One covered parameter: its shape, EVON's ``(m, n)`` view of it, and which bases are stored.

    ``ess``/``weight_decay`` are set only where the parameter's group differs from the
    config's top level (None: the top-level value).
    """

    shape: tuple[int, ...]
    matrix_shape: tuple[int, int]
    left_basis: bool
    right_basis: bool
    ess: float | None = None
    weight_decay: float | None = None

    @classmethod
    def from_dict(
        cls, name: str, value: Any, config_ess: float, config_weight_decay: float, where: str
    ) -> ParameterEntry:
        """The entry ``parameters[name]``, validated; a noise scale it lacks is the top-level one."""
        key = f"parameters.{name}"
        if not isinstance(value, dict):
            raise rules.rule_error(where, key, "an object", value)
        missing = [k for k in ("shape", "matrix_shape", "left_basis", "right_basis") if k not in value]
        if missing:
            raise PosteriorMismatchError(f"{where}: field {key!r} lacks {missing}")
        shape = rules.shape(value["shape"], f"{key}.shape", where, empty=True)  # [] : a 0-d tensor
        declared = rules.shape(value["matrix_shape"], f"{key}.matrix_shape", where)
        left = rules.boolean(value["left_basis"], f"{key}.left_basis", where)
        right = rules.boolean(value["right_basis"], f"{key}.right_basis", where)
        entry = f"{where}: parameters entry {name!r}"  # the file too: a model directory, subfolder or Hub cache
        if len(declared) != 2 or declared != matrix_shape(shape):
            raise PosteriorMismatchError(
                f"{entry}: matrix_shape {list(declared)} does not match shape {list(shape)} "
                f"(EVON views it as {list(matrix_shape(shape))})"
            )
        ess = rules.number(value["ess"], f"{key}.ess", where) if "ess" in value else None
        wd = rules.number(value["weight_decay"], f"{key}.weight_decay", where) if "weight_decay" in value else None
        check_noise_scale(config_ess if ess is None else ess, config_weight_decay if wd is None else wd, entry)
        return cls(shape, (declared[0], declared[1]), left, right, ess, wd)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "shape": list(self.shape),
            "matrix_shape": list(self.matrix_shape),
            "left_basis": self.left_basis,
            "right_basis": self.right_basis,
        }
        if self.ess is not None:
            out["ess"] = json_value(self.ess)
        if self.weight_decay is not None:
            out["weight_decay"] = json_value(self.weight_decay)
        return out

    def tensors(self, name: str) -> list[tuple[str, str, tuple[int, int]]]:
        """(key, kind, shape) of the tensors the weights file holds for this parameter."""
        m, n = self.matrix_shape
        out = [(f"{name}.hess", "hess", (m, n))]
        if self.left_basis:
            out.append((f"{name}.Q_L", "Q_L", (m, m)))
        if self.right_basis:
            out.append((f"{name}.Q_R", "Q_R", (n, n)))
        return out


@dataclass(frozen=True, kw_only=True)
class PosteriorConfig:
    """``evon_posterior_config.json``: the posterior's hyperparameters, bookkeeping and covered parameters.

    Fields are declared in the order a fresh save writes them. Optional fields are None where
    absent; keys this version does not know are kept in ``extra``, as written. ``key_order``
    holds the keys as they were given to :meth:`from_dict` (their presence and order), so
    :meth:`to_dict` writes back exactly what was read; fields set later go after them.
    """

    # EVON's hyperparameters (the first EVON group's, where it has them)
    lr: float | None = _optional(rules.number)
    ess: float
    weight_decay: float
    hess_init: float | None = _optional(rules.number)
    betas: tuple[float, float] | None = _optional(rules.betas)
    mc_samples: int | None = _optional(rules.integer(1))
    precondition_frequency: int | None = _optional(rules.integer(1))
    max_precond_dim: int | None = _optional(rules.integer(0))
    max_precond_ratio: float | None = _optional(rules.at_least(1))
    shampoo_beta: float | None = _optional(rules.number, nullable=True)
    hess_clip_ratio: float | None = _optional(rules.number, nullable=True)
    clip: str | None = _optional(rules.string)
    clip_radius: float | None = _optional(rules.number)
    snr_scaling: bool | str | None = _optional(rules.snr_scaling)
    phased_gradients: bool | None = _optional(rules.boolean)
    identity_basis: bool | None = _optional(rules.boolean)
    stagger_refresh: bool | None = _optional(rules.boolean)
    eps: float | None = _optional(rules.number)
    hess_estimator: str | None = _optional(rules.hess_estimator)
    curvature_refit: int | None = _optional(rules.integer(0))
    step_curvature: str | None = _optional(rules.step_curvature)
    # None: the optimizer's default (hf_evon.optim.validation.resolve_mean_weight_decay)
    mean_weight_decay: float | None = _optional(rules.at_least(0, finite=True), nullable=True)
    final_lr: float | None = _optional(rules.number)  # the rate at save time, under an LR scheduler
    optimizer_step: int | None = _optional(rules.integer(0))
    # the model it belongs to
    base_model: str | None = _optional(rules.base_model, nullable=True)
    model_class: str | None = _optional(rules.string, nullable=True)
    mean_fingerprint: dict[str, Any] | None = _optional(rules.mean_fingerprint, nullable=True)
    pruned_ranks: dict[str, list[int]] | None = _optional(rules.pruned_ranks)  # AdaLoRA's: no spread there
    tied_parameters: dict[str, str] | None = _optional(rules.tied_parameters)  # a tied weight's other names
    # how the tensors are stored
    eigenbasis_dtype: str | None = _optional(_tensor_dtype)
    max_basis_ratio: float | None = _optional(rules.number, nullable=True)  # lean posteriors
    # post-hoc calibration: the ess EVON trained with, and the search's record
    # (hf_evon.predictive.calibration.CalibrationResult.to_json)
    trained_ess: float | None = _optional(rules.positive_number)
    # the trained ζ of parameters whose group's differs from trained_ess (several EVON groups)
    trained_ess_by_parameter: dict[str, float] | None = _optional(rules.ess_by_name)
    temperature: float | None = _optional(rules.temperature)  # BMA predicts softmax(logits / T); absent: 1
    calibration: dict[str, Any] | None = _optional(rules.calibration, nullable=True)
    # bookkeeping of the save
    format_version: int = FORMAT_VERSION
    library: str | None = _optional(rules.string)
    library_version: str | None = _optional(rules.string)
    checkpoint_id: str | None = _optional(rules.string)
    weights_file: str | None = _optional(_weights_file)
    hess_dtype: str | None = _optional(rules.one_of(("float32", "float64")))  # H is never saved narrower
    num_point_estimates: int | None = _optional(rules.integer(0), nullable=True)
    num_point_estimate_tensors: int | None = _optional(rules.integer(0), nullable=True)
    parameters: dict[str, ParameterEntry]
    extra: dict[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = field(default=(), compare=False, repr=False)
    source: str = field(default=POSTERIOR_CONFIG_NAME, compare=False, repr=False)

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, raw: Any, where: str = POSTERIOR_CONFIG_NAME) -> PosteriorConfig:
        """Validate a parsed config; errors are :class:`PosteriorMismatchError` naming ``where`` and the field."""
        if not isinstance(raw, dict):
            raise PosteriorMismatchError(f"{where}: the config must be a JSON object")
        check_depth(raw, where)
        if "format_version" not in raw:  # not an EVON posterior config (or one cut short)
            raise PosteriorMismatchError(
                f"{where}: 'format_version' is missing: not an EVON posterior config "
                f"(this hf-evon reads version {FORMAT_VERSION})"
            )
        version = raw["format_version"]
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise PosteriorMismatchError(
                f"{where}: format_version {version!r} is not a known EVON posterior format "
                f"(this hf-evon reads version {FORMAT_VERSION})"
            )
        if version > FORMAT_VERSION:
            raise PosteriorMismatchError(
                f"{where}: format_version {version} was written by a newer hf-evon; this one "
                f"reads version {FORMAT_VERSION}: upgrade hf-evon"
            )
        ess = rules.number(raw.get("ess"), "ess", where)
        weight_decay = rules.number(raw.get("weight_decay"), "weight_decay", where)
        check_noise_scale(ess, weight_decay, where)
        values: dict[str, Any] = {}
        for f in _OPTIONAL_FIELDS:
            if f.name in raw and not (f.metadata["nullable"] and raw[f.name] is None):
                values[f.name] = f.metadata["rule"](raw[f.name], f.name, where)
        parameters = raw.get("parameters")
        if not isinstance(parameters, dict) or not parameters:
            raise PosteriorMismatchError(f"{where}: 'parameters' must list the covered parameters")
        entries = {
            name: ParameterEntry.from_dict(name, parameters[name], ess, weight_decay, where)
            for name in sorted(parameters)
        }
        if unknown := sorted(set(values.get("trained_ess_by_parameter") or {}) - set(entries)):
            raise PosteriorMismatchError(f"{where}: trained_ess_by_parameter names uncovered {unknown[:5]}")
        for name, indices in (values.get("pruned_ranks") or {}).items():
            if name not in entries or indices[-1] >= math.prod(entries[name].shape):
                what = "is not covered" if name not in entries else f"has {math.prod(entries[name].shape)} entries"
                raise PosteriorMismatchError(f"{where}: pruned_ranks names {name!r}, which {what}")
        check_tied_parameters(values.get("tied_parameters"), entries, where)
        return cls(
            ess=ess,
            weight_decay=weight_decay,
            format_version=version,
            parameters=entries,
            extra={k: v for k, v in raw.items() if k not in _FIELD_NAMES},
            key_order=tuple(raw),
            source=where,
            **values,
        )

    @classmethod
    def for_save(
        cls,
        settings: Mapping[str, Any],
        factors: Mapping[str, MatrixFactors],
        eigenbasis_dtype: torch.dtype | None,
        num_point_estimates: int | None,
        num_point_estimate_tensors: int | None,
    ) -> PosteriorConfig:
        """The config a new save writes: ``settings`` (``EVONPosterior.config``) and, per covered
        name, its factors' entry; a fresh ``checkpoint_id`` (one per save), the canonical
        ``weights_file``.

        ``settings`` keeps its keys' order; the save's own fields follow it (as ``dict.update``).
        """
        ess, weight_decay = float(settings["ess"]), float(settings["weight_decay"])
        first = next(iter(factors.values()))
        config = {k: v for k, v in settings.items() if k != "parameters"}  # format_version: set in place
        config.update(
            format_version=FORMAT_VERSION,
            library="hf-evon",
            library_version=__version__,
            checkpoint_id=uuid.uuid4().hex,
            weights_file=POSTERIOR_WEIGHTS_NAME,
            ess=ess,
            weight_decay=weight_decay,
            eigenbasis_dtype=dtype_name(eigenbasis_dtype or basis_dtype(factors)),
            hess_dtype=dtype_name(first.hess.dtype),
            num_point_estimates=num_point_estimates,
            num_point_estimate_tensors=num_point_estimate_tensors,
        )
        config["parameters"] = {
            name: ParameterEntry(
                shape=tuple(f.shape),
                matrix_shape=tuple(f.matrix_shape),
                left_basis=f.Q_L is not None,
                right_basis=f.Q_R is not None,
                ess=f.ess if f.ess != ess else None,
                weight_decay=f.weight_decay if f.weight_decay != weight_decay else None,
            ).to_dict()
            for name, f in factors.items()
        }
        return cls.from_dict(json_value(config), "EVONPosterior.config")

    # ------------------------------------------------------------------ writing
    def updated(self, **values: Any) -> PosteriorConfig:
        """A copy with ``values`` set; a field not yet present is added after the others."""
        order = self.key_order + tuple(k for k in values if k not in self.key_order) if self.key_order else ()
        return replace(self, key_order=order, **values)

    def keys(self) -> list[str]:
        """The JSON keys, in the order :meth:`to_dict` writes them."""
        present = [f.name for f in _SCHEMA_FIELDS if f.name in _REQUIRED or getattr(self, f.name) is not None]
        if not self.key_order:
            return [k for k in present if k != "parameters"] + list(self.extra) + ["parameters"]
        return list(self.key_order) + [k for k in present if k not in self.key_order]

    def value(self, key: str) -> Any:
        """The Python value of ``key`` (``inf`` as a float, ``betas`` as a tuple); extra keys as written."""
        return getattr(self, key) if key in _FIELD_NAMES else self.extra[key]

    def to_dict(self) -> dict[str, Any]:
        """The JSON object to write (``"inf"`` for an infinite number), keys in :meth:`keys` order."""
        out: dict[str, Any] = {}
        for key in self.keys():
            if key == "parameters":
                out[key] = {name: entry.to_dict() for name, entry in self.parameters.items()}
            else:
                out[key] = json_value(self.value(key))
        return out

    def to_json(self) -> str:
        """The file's text: strict JSON (no NaN), indented, one final newline."""
        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"

    def settings(self) -> dict[str, Any]:
        """``EVONPosterior.config`` of a loaded posterior: every key but ``parameters``, as Python values."""
        out = {key: self.value(key) for key in self.keys() if key != "parameters"}
        out["format_version"] = FORMAT_VERSION
        return out

    # ------------------------------------------------------------------ what the reader needs
    @property
    def weights_name(self) -> str:
        """The weights file this config belongs to: ``weights_file``, or the canonical name."""
        return self.weights_file or POSTERIOR_WEIGHTS_NAME

    def noise_scale(self, name: str) -> tuple[float, float]:
        """``(ess, weight_decay)`` of covered parameter ``name`` (its own, or the top-level one), as
        floats: the config keeps a JSON integer as one, and torch cannot scale by one past int64."""
        entry = self.parameters[name]
        return (
            float(self.ess if entry.ess is None else entry.ess),
            float(self.weight_decay if entry.weight_decay is None else entry.weight_decay),
        )


_SCHEMA_FIELDS = tuple(f for f in fields(PosteriorConfig) if f.name not in ("extra", "key_order", "source"))
_FIELD_NAMES = frozenset(f.name for f in _SCHEMA_FIELDS)
_OPTIONAL_FIELDS = tuple(f for f in _SCHEMA_FIELDS if "rule" in f.metadata)
_REQUIRED = frozenset(("ess", "weight_decay", "format_version", "parameters"))
