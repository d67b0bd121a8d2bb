"""The EVON posterior file format (version 1): the one contract for reading and writing it.

A posterior checkpoint is two files in one directory (or Hub repo folder); nothing else in
the directory is read, written or deleted (save for the staged weights and temporaries of
a save, see the end), except ``README.md`` (the model card, written by
``hf_evon.posterior.model_card``), which is created or *updated* (metadata merged, an EVON section
replaced or appended), never replaced wholesale.

``evon_posterior.safetensors`` (safetensors only: loading never unpickles anything)
    For each covered parameter ``<name>`` (exactly as in ``model.named_parameters()``):

    * ``<name>.hess``: ``H``, shape ``(m, n)``, float32 (float64 for float64 parameters);
    * ``<name>.Q_L``: ``(m, m)`` orthonormal, absent where the left basis is the identity;
    * ``<name>.Q_R``: ``(n, n)`` orthonormal, absent where the right basis is the identity.

    ``Q_L``/``Q_R`` are stored in the dtype the posterior holds them in (float32 from the
    optimizer), or in bfloat16/float16 with ``from_optimizer(..., eigenbasis_dtype=...)`` or
    ``save_pretrained(..., eigenbasis_dtype=torch.float16)`` (about half the bases' bytes).
    A lean posterior (``EVONPosterior.lean``, the default of ``from_optimizer``) stores no
    basis for a side more than ``max_basis_ratio`` times the other (its ``H`` re-expressed):
    the file is the same format, that side simply has the identity basis. The header
    metadata holds ``format_version`` and a ``checkpoint_id`` shared with the JSON.

``evon_posterior_config.json``
    ``format_version`` (1), ``library``/``library_version``, ``checkpoint_id``,
    ``weights_file`` (the weights file this config belongs to: ``evon_posterior.safetensors``,
    or ``evon_posterior.<checkpoint_id>.safetensors`` after a save killed midway; absent in
    files written before it existed, which means the canonical name), ``ess``
    and ``weight_decay`` (``"inf"`` encodes an infinite ess), the other EVON
    hyperparameters (``hess_init``, ``betas``, ``precondition_frequency``, ``mc_samples``,
    ``max_precond_dim``, ``shampoo_beta``, ``hess_clip_ratio``, ``clip``, ``clip_radius``,
    ``snr_scaling``, ``phased_gradients``, ``identity_basis``, ``lr`` — the scheduler's ``initial_lr`` when
    there is one, with the rate at save time as ``final_lr`` — ... as present), ``optimizer_step``,
    ``eigenbasis_dtype``, ``hess_dtype``, ``max_basis_ratio`` (lean posteriors; null or
    absent: every basis kept), ``base_model``, ``model_class``,
    ``num_point_estimates`` / ``num_point_estimate_tensors`` (model parameters and tensors
    without a posterior) and ``parameters``: for each covered name, in sorted order,
    ``{"shape": [...], "matrix_shape": [m, n], "left_basis": bool, "right_basis": bool}``,
    plus ``ess``/``weight_decay`` where a parameter's group differs from the top level.
    The parameter is reshaped row-major: ``W.reshape(m, n)`` (1-D as ``1×d``, N-D as
    ``(d0, rest)``, as ``hf_evon.optim.evon.matrix_shape``).

Loading checks everything and raises :class:`PosteriorMismatchError` naming the offending
tensor or config field (and the file): unknown or newer ``format_version``, a field of the
wrong JSON type (``"false"`` for a boolean, ``64.7`` for a shape, a string for a number:
refused, never coerced or truncated), an ``ess``/``weight_decay``/``hess`` whose posterior
std ``1/√(ess·(hess + weight_decay))`` is not finite in float32 (e.g. ``ess = 1e-46``
underflows), a weights file from another save, missing or
unexpected tensors, shapes that do not match the declared ones, non-float or non-finite
values, ``hess`` negative (or zero where ``weight_decay`` is 0: infinite variance), an
eigenbasis that is not orthonormal (``‖QᵀQx − x‖ ≤ tol·‖x‖`` on random probes, ``tol``
set by the stored dtype). Half-precision eigenbases are upcast to float32 *as stored*
(GPT-2 small: ‖QᵀQx − x‖/‖x‖ ≤ 3e-3 for bfloat16, 3e-4 for float16, 1.5e-6 for float32):
no re-orthonormalisation by default, because
``Q diag(V) Qᵀ`` is still a valid covariance close to the saved one, and a QR of every
basis would cost seconds per GPT-2-sized model; ``from_pretrained(...,
reorthonormalize=True)`` applies one Newton–Schulz polar step ``Q ← Q (3I − QᵀQ) / 2``.

Writes are atomic, and survive a kill after any file-system call: the weights are written
(and fsynced) as ``evon_posterior.<checkpoint_id>.safetensors``; the config naming them is
written to a temporary file and moved onto ``evon_posterior_config.json`` with one
``os.replace``, the single switch from the old posterior to the new one; then
``evon_posterior.safetensors`` is replaced by a hard link to (or copy of) the new weights and
the config is rewritten to name it; files left by killed saves are removed at the end of the
next save. A reader follows ``weights_file`` and so always sees one consistent pair; a mixed
pair (e.g. files copied by hand) is stopped by the ``checkpoint_id`` check.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_evon.optim.evon import is_snr_scaling, matrix_shape
from hf_evon.optim.linalg import rotated_std
from hf_evon.posterior.gaussian import FactorGroup, compute_dtype, orthonormality_error, polar_step

if TYPE_CHECKING:
    from hf_evon.posterior.posterior import EVONPosterior

Tensor = torch.Tensor

FORMAT_VERSION = 1
POSTERIOR_WEIGHTS_NAME = "evon_posterior.safetensors"
POSTERIOR_CONFIG_NAME = "evon_posterior_config.json"
# the weights file a config may name: the canonical one, or one staged by an interrupted save
_WEIGHTS_FILE_RE = re.compile(r"evon_posterior(\.[0-9a-f]{32})?\.safetensors")
# files a save leaves only when it is killed; the next save removes them
_STALE_FILE_RE = re.compile(
    r"evon_posterior\.[0-9a-f]{32}\.safetensors|\.evon_posterior(_config\.json|\.safetensors)(\.bak)?\.[0-9a-f]{32}\.tmp"
)

# EVON group entries recorded as hyperparameters (those present in the optimizer's group)
HYPERPARAMETER_KEYS = (
    "lr",
    "ess",
    "weight_decay",
    "hess_init",
    "betas",
    "mc_samples",
    "precondition_frequency",
    "max_precond_dim",
    "shampoo_beta",
    "hess_clip_ratio",
    "clip",
    "clip_radius",
    "snr_scaling",
    "phased_gradients",
    "identity_basis",
    "stagger_refresh",
    "eps",
)
_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# ‖QᵀQx − x‖ / ‖x‖ allowed on load, by the dtype the basis was stored in. Rounding a basis
# to a format with unit roundoff u moves it by ~u/√3 per direction (see the benchmark):
# these bounds are ~10x that, and far below what a wrong or corrupted basis gives.
_ORTHONORMAL_TOL = {
    torch.float64: 1e-6,
    torch.float32: 1e-3,
    torch.float16: 1e-2,
    torch.bfloat16: 6e-2,
}


class PosteriorMismatchError(ValueError):
    """A posterior does not fit a model, or a posterior file is invalid.

    The message always names the offending tensor (or config field), so a mismatch is
    never silently skipped.
    """


# ----------------------------------------------------------------------------- values
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def json_value(value: Any) -> Any:
    """JSON-safe copy: tuples become lists, infinities the strings "inf"/"-inf"."""
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


def _rule_error(where: str, field: str, rule: str, value: Any) -> PosteriorMismatchError:
    return PosteriorMismatchError(f"{where}: field {field!r} must be {rule}; got {value!r}")


def _number(value: Any, field: str, where: str = POSTERIOR_CONFIG_NAME) -> float:
    """A JSON number (``"inf"`` allowed, as written for an infinite ess), or an error naming the field."""
    if value == "inf":
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _rule_error(where, field, 'a number (or "inf")', value)
    return float(value)


def _integer(value: Any, field: str, where: str, minimum: int = 0) -> int:
    """A JSON integer ``>= minimum``: ``64.7`` or ``"64"`` is refused, never truncated."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _rule_error(where, field, f"an integer >= {minimum}", value)
    return value


def _boolean(value: Any, field: str, where: str) -> bool:
    """A JSON ``true``/``false``: the string ``"false"`` would be truthy, so it is refused."""
    if not isinstance(value, bool):
        raise _rule_error(where, field, "true or false", value)
    return value


def _snr_scaling(value: Any, field: str, where: str) -> bool | str:
    """``true``/``false`` or ``"adam"`` (``EVON``'s ``snr_scaling``)."""
    if not is_snr_scaling(value):
        raise _rule_error(where, field, 'true, false or "adam"', value)
    return value


def _string(value: Any, field: str, where: str) -> str:
    if not isinstance(value, str):
        raise _rule_error(where, field, "a string", value)
    return value


def _betas(value: Any, field: str, where: str) -> tuple[float, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise _rule_error(where, field, "a list of two numbers", value)
    return (_number(value[0], f"{field}[0]", where), _number(value[1], f"{field}[1]", where))


def _weights_file(value: Any, field: str, where: str) -> str:
    """A plain file name written by :func:`write_posterior`: never a path out of the directory."""
    if not isinstance(value, str) or not _WEIGHTS_FILE_RE.fullmatch(value):
        raise _rule_error(
            where, field, f"{POSTERIOR_WEIGHTS_NAME!r} or 'evon_posterior.<32 hex digits>.safetensors'", value
        )
    return value


# the optional top-level fields and their JSON types; unknown fields are kept as they are
_FIELD_PARSERS: dict[str, tuple[Callable[[Any, str, str], Any], bool]] = {  # (parser, null allowed)
    "lr": (_number, False),
    "final_lr": (_number, False),
    "hess_init": (_number, False),
    "clip_radius": (_number, False),
    "eps": (_number, False),
    "shampoo_beta": (_number, True),
    "hess_clip_ratio": (_number, True),
    "max_basis_ratio": (_number, True),
    "betas": (_betas, False),
    "mc_samples": (lambda v, f, w: _integer(v, f, w, 1), False),
    "precondition_frequency": (lambda v, f, w: _integer(v, f, w, 1), False),
    "max_precond_dim": (_integer, False),
    "optimizer_step": (_integer, False),
    "num_point_estimates": (_integer, True),
    "num_point_estimate_tensors": (_integer, True),
    "snr_scaling": (_snr_scaling, False),
    "phased_gradients": (_boolean, False),
    "identity_basis": (_boolean, False),
    "stagger_refresh": (_boolean, False),
    "clip": (_string, False),
    "checkpoint_id": (_string, False),
    "library": (_string, False),
    "library_version": (_string, False),
    "eigenbasis_dtype": (_string, False),
    "hess_dtype": (_string, False),
    "base_model": (_string, True),
    "model_class": (_string, True),
    "weights_file": (_weights_file, False),
}


def check_noise_scale(ess: float, weight_decay: float, where: str) -> None:
    """``ess > 0`` (``inf``: no noise) and a finite ``weight_decay >= 0``, or an error naming ``where``."""
    if not ess > 0.0:
        raise PosteriorMismatchError(f"{where}: ess must be > 0 (inf for no noise); got {ess!r}")
    if not (weight_decay >= 0.0 and math.isfinite(weight_decay)):
        raise PosteriorMismatchError(f"{where}: weight_decay must be finite and >= 0; got {weight_decay!r}")


def check_finite_std(groups: list[FactorGroup], where: str, field: str = "ess") -> None:
    """Refuse a noise scale whose ``1/√(ess·(hess + weight_decay))`` is not finite where sampling computes it.

    ``ess > 0`` is not enough: ``ess = 1e-46`` (or a tiny ``hess + weight_decay``) underflows
    to 0 in float32 and every draw would write inf/NaN into the weights.
    """
    for g in groups:
        scale = rotated_std(g.hess.to(compute_dtype(g.hess)), g.ess, g.weight_decay)
        if _all_finite(scale):
            continue
        i = next(i for i in range(len(g.names)) if not bool(torch.isfinite(scale[i]).all()))
        low = float((g.ess * (g.hess[i].to(scale.dtype) + g.weight_decay)).min())
        raise PosteriorMismatchError(
            f"{where}: {field} = {g.ess:g} (weight_decay {g.weight_decay:g}) makes the posterior std "
            f"1/sqrt(ess·(hess + weight_decay)) of {g.names[i]!r} non-finite: ess·(hess + weight_decay) "
            f"reaches {low:g} in {dtype_name(scale.dtype)}"
        )


# ----------------------------------------------------------------------------- config schema
@dataclass(frozen=True)
class _Entry:
    """One covered parameter as declared in the config."""

    name: str
    shape: tuple[int, ...]
    m: int
    n: int
    left: bool
    right: bool
    ess: float
    weight_decay: float

    def tensors(self) -> list[tuple[str, tuple[int, int]]]:
        """(kind, expected shape) of the tensors the file must hold for this parameter."""
        out = [("hess", (self.m, self.n))]
        if self.left:
            out.append(("Q_L", (self.m, self.m)))
        if self.right:
            out.append(("Q_R", (self.n, self.n)))
        return out


def _shape(value: Any, field: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise _rule_error(where, field, "a non-empty list of integers >= 1", value)
    for d in value:
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise _rule_error(where, field, "a non-empty list of integers >= 1", value)
    return tuple(value)


def _parse_entry(name: str, entry: Any, ess: float, weight_decay: float, where: str) -> _Entry:
    field = f"parameters.{name}"
    if not isinstance(entry, dict):
        raise _rule_error(where, field, "an object", entry)
    missing = [k for k in ("shape", "matrix_shape", "left_basis", "right_basis") if k not in entry]
    if missing:
        raise PosteriorMismatchError(f"{where}: field {field!r} lacks {missing}")
    shape = _shape(entry["shape"], f"{field}.shape", where)
    declared = _shape(entry["matrix_shape"], f"{field}.matrix_shape", where)
    left = _boolean(entry["left_basis"], f"{field}.left_basis", where)
    right = _boolean(entry["right_basis"], f"{field}.right_basis", where)
    if len(declared) != 2 or declared != matrix_shape(shape):
        raise PosteriorMismatchError(
            f"{name!r}: matrix_shape {list(declared)} does not match shape {list(shape)} "
            f"(EVON views it as {list(matrix_shape(shape))})"
        )
    p_ess = _number(entry.get("ess", ess), f"{field}.ess", where)
    p_wd = _number(entry.get("weight_decay", weight_decay), f"{field}.weight_decay", where)
    check_noise_scale(p_ess, p_wd, repr(name))
    return _Entry(name, shape, declared[0], declared[1], left, right, p_ess, p_wd)


def file_config(
    posterior: EVONPosterior,
    eigenbasis_dtype: torch.dtype | None,
    checkpoint_id: str,
    weights_file: str = POSTERIOR_WEIGHTS_NAME,
) -> dict[str, Any]:
    """The JSON config of ``posterior`` as it will be written (JSON-safe values)."""
    from hf_evon import __version__

    config = {k: v for k, v in posterior.config.items() if k not in ("format_version", "parameters")}
    factors = [posterior[name] for name in posterior.names]
    bases = [q for f in factors for q in (f.Q_L, f.Q_R) if q is not None]
    config.update(
        format_version=FORMAT_VERSION,
        library="hf-evon",
        library_version=__version__,
        checkpoint_id=checkpoint_id,
        weights_file=weights_file,
        ess=posterior.ess,
        weight_decay=posterior.weight_decay,
        eigenbasis_dtype=dtype_name(eigenbasis_dtype or (bases[0] if bases else factors[0].hess).dtype),
        hess_dtype=dtype_name(factors[0].hess.dtype),
        num_point_estimates=posterior.num_point_estimates,
        num_point_estimate_tensors=posterior.num_point_estimate_tensors,
    )
    parameters = {}
    for name, f in zip(posterior.names, factors):
        entry: dict[str, Any] = {
            "shape": list(f.shape),
            "matrix_shape": list(f.matrix_shape),
            "left_basis": f.Q_L is not None,
            "right_basis": f.Q_R is not None,
        }
        if f.ess != posterior.ess:
            entry["ess"] = f.ess
        if f.weight_decay != posterior.weight_decay:
            entry["weight_decay"] = f.weight_decay
        parameters[name] = entry
    config["parameters"] = parameters
    return json_value(config)


# ----------------------------------------------------------------------------- tensors
def posterior_tensors(
    posterior: EVONPosterior, eigenbasis_dtype: torch.dtype | str | None = None
) -> dict[str, Tensor]:
    """The file's tensors: ``<name>.Q_L``, ``<name>.Q_R``, ``<name>.hess`` (CPU, contiguous)."""
    eig = as_dtype(eigenbasis_dtype)
    if eig is not None and eig not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"eigenbasis_dtype must be float32, bfloat16 or float16; got {eig}")
    tensors: dict[str, Tensor] = {}
    for name in posterior.names:
        f = posterior[name]
        for key, q in (("Q_L", f.Q_L), ("Q_R", f.Q_R)):
            if q is not None:
                tensors[f"{name}.{key}"] = q.detach().to("cpu", dtype=eig or q.dtype, copy=True).contiguous()
        # copies: the factors are views into stacked buffers, which safetensors refuses to save
        tensors[f"{name}.hess"] = f.hess.detach().to("cpu", copy=True).contiguous()
    return tensors


def _check_tensor_headers(fh: Any, entries: list[_Entry]) -> dict[str, torch.dtype]:
    """Presence, dtype and shape of every tensor, from the header alone (nothing read yet)."""
    keys = set(fh.keys())
    stored: dict[str, torch.dtype] = {}
    for e in entries:
        for kind, want in e.tensors():
            key = f"{e.name}.{kind}"
            if key not in keys:
                raise PosteriorMismatchError(f"tensor {key!r} is missing from {POSTERIOR_WEIGHTS_NAME}")
            header = fh.get_slice(key)
            dtype = _STORED_DTYPES.get(header.get_dtype())
            if dtype is None:
                raise PosteriorMismatchError(
                    f"tensor {key!r} has dtype {header.get_dtype()}; expected one of {sorted(_STORED_DTYPES)}"
                )
            if tuple(header.get_shape()) != want:
                raise PosteriorMismatchError(
                    f"tensor {key!r} has shape {list(header.get_shape())}; expected {list(want)}"
                )
            stored[key] = dtype
    extra = sorted(keys - set(stored))
    if extra:
        raise PosteriorMismatchError(
            f"{POSTERIOR_WEIGHTS_NAME} holds tensors the config does not declare: {extra[:5]} "
            "(refusing to skip them silently)"
        )
    return stored


def _all_finite(t: Tensor) -> bool:
    """A finite sum implies finite entries (NaN/inf propagate); only a non-finite sum needs the slow check."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _read_groups(
    fh: Any, entries: list[_Entry], stored: dict[str, torch.dtype], device: Any, reorthonormalize: bool
) -> list[FactorGroup]:
    """Read every tensor once, straight into its group's stacked buffer, validating its values."""
    buckets: dict[tuple, list[_Entry]] = {}
    for e in entries:
        dt = torch.float64 if stored[f"{e.name}.hess"] == torch.float64 else torch.float32
        buckets.setdefault((e.m, e.n, e.left, e.right, e.ess, e.weight_decay, dt), []).append(e)
    groups = []
    for (m, n, left, right, ess, weight_decay, dt), members in buckets.items():
        size = len(members)
        buffers = {
            "hess": torch.empty(size, m, n, dtype=dt, device=device),
            "Q_L": torch.empty(size, m, m, dtype=dt, device=device) if left else None,
            "Q_R": torch.empty(size, n, n, dtype=dt, device=device) if right else None,
        }
        for i, e in enumerate(members):
            for kind, _ in e.tensors():
                key = f"{e.name}.{kind}"
                slot = buffers[kind][i]
                slot.copy_(fh.get_tensor(key))  # upcasts half-precision bases to float32
                if not _all_finite(slot):
                    raise PosteriorMismatchError(f"tensor {key!r} has non-finite values (NaN or inf)")
                if kind == "hess":
                    # IVON's update keeps H + δ > 0 (H itself may dip below 0 by less than δ)
                    low = float(slot.min()) + weight_decay
                    if low <= 0:
                        raise PosteriorMismatchError(
                            f"tensor {key!r} has non-positive hess + weight_decay (min {low:g}); EVON "
                            "keeps it positive, else the variance 1/(ess·(hess + weight_decay)) would be "
                            "negative or infinite"
                        )
                    continue
                tol = _ORTHONORMAL_TOL.get(stored[key], 1e-3)
                err = orthonormality_error(slot)
                if err > tol:
                    raise PosteriorMismatchError(
                        f"tensor {key!r} is not orthonormal (‖QᵀQx − x‖/‖x‖ = {err:.3g} > {tol:g} for "
                        f"{dtype_name(stored[key])})"
                    )
        if reorthonormalize:
            for kind in ("Q_L", "Q_R"):
                if buffers[kind] is not None:
                    buffers[kind] = polar_step(buffers[kind])
        groups.append(
            FactorGroup(
                names=[e.name for e in members],
                shapes=[e.shape for e in members],
                m=m,
                n=n,
                q_left=buffers["Q_L"],
                q_right=buffers["Q_R"],
                hess=buffers["hess"],
                ess=ess,
                weight_decay=weight_decay,
            )
        )
    return groups


# ----------------------------------------------------------------------------- read
@dataclass
class LoadedPosterior:
    """What :func:`read_posterior` found: the factor groups and the config (without ``parameters``)."""

    groups: list[FactorGroup]
    config: dict[str, Any]
    num_point_estimates: int | None
    num_point_estimate_tensors: int | None


def read_config(config_path: str | os.PathLike) -> dict[str, Any]:
    """The JSON config, every field of known meaning type-checked (errors name the field and the file)."""
    where = os.fspath(config_path)
    try:
        with open(where, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as err:
        raise PosteriorMismatchError(f"{where}: cannot read the config ({err})") from err
    if not isinstance(raw, dict):
        raise PosteriorMismatchError(f"{where}: the config must be a JSON object")
    version = raw.get("format_version")
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
    config = dict(raw)
    config["ess"] = _number(raw.get("ess"), "ess", where)
    config["weight_decay"] = _number(raw.get("weight_decay"), "weight_decay", where)
    check_noise_scale(config["ess"], config["weight_decay"], where)
    for field, (parse, nullable) in _FIELD_PARSERS.items():
        if field in raw and not (nullable and raw[field] is None):
            config[field] = parse(raw[field], field, where)
    parameters = raw.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise PosteriorMismatchError(f"{where}: 'parameters' must list the covered parameters")
    config["_path"] = where
    return config


def weights_file_name(config: Mapping[str, Any]) -> str:
    """The weights file a (validated) config belongs to: ``weights_file``, or the canonical name."""
    return config.get("weights_file", POSTERIOR_WEIGHTS_NAME)


def read_posterior(
    config: dict[str, Any], weights_path: str, device: Any, reorthonormalize: bool
) -> LoadedPosterior:
    """Read and validate the weights of a config from :func:`read_config` (see the module docstring)."""
    where = config["_path"]
    ess, weight_decay = config["ess"], config["weight_decay"]
    try:
        handle = safe_open(weights_path, framework="pt", device="cpu")
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise PosteriorMismatchError(f"{weights_path}: not a readable safetensors file ({err})") from err
    parameters = config["parameters"]
    with handle as fh:
        metadata = fh.metadata() or {}
        saved_id, config_id = metadata.get("checkpoint_id"), config.get("checkpoint_id")
        if saved_id is not None and config_id is not None and saved_id != config_id:
            raise PosteriorMismatchError(
                f"{weights_file_name(config)} (checkpoint {saved_id}) and {POSTERIOR_CONFIG_NAME} (checkpoint "
                f"{config_id}) come from different saves; save the posterior again"
            )
        entries = [
            _parse_entry(name, parameters[name], ess, weight_decay, where) for name in sorted(parameters)
        ]
        stored = _check_tensor_headers(fh, entries)
        groups = _read_groups(fh, entries, stored, device, reorthonormalize)
    check_finite_std(groups, where)
    out = {k: v for k, v in config.items() if k not in ("parameters", "_path")}
    out["format_version"] = FORMAT_VERSION
    return LoadedPosterior(
        groups, out, config.get("num_point_estimates"), config.get("num_point_estimate_tensors")
    )


# ----------------------------------------------------------------------------- write
def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: str) -> None:
    """Make renames in ``directory`` durable (POSIX; elsewhere opening a directory fails: skipped)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_config(directory: str, config: dict[str, Any]) -> None:
    """Write the config atomically: a temporary file, fsync, then one ``os.replace`` onto the name."""
    tmp = os.path.join(directory, f".{POSTERIOR_CONFIG_NAME}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write((json.dumps(config, indent=2, allow_nan=False) + "\n").encode())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(directory, POSTERIOR_CONFIG_NAME))
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # gone already after the replace
    _fsync_dir(directory)


def _remove_stale_files(directory: str) -> None:
    """Remove what killed saves left behind (staged weights, temporaries, old ``.bak`` files)."""
    for name in os.listdir(directory):
        if _STALE_FILE_RE.fullmatch(name):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))


def write_posterior(posterior: EVONPosterior, directory: str, eigenbasis_dtype: torch.dtype | None) -> None:
    """Write the two files of ``posterior`` into ``directory`` (which must exist), atomically.

    The config is the switch: the weights are written under a new name first, then the
    config naming them replaces the old config in one ``os.replace``; only then is the
    canonical weights file replaced (a hard link of the staged one, or a copy) and the config
    rewritten to name it. A kill after any step leaves a config whose weights file exists
    and matches it: the old posterior before the switch, the new one after.
    """
    tensors = posterior_tensors(posterior, eigenbasis_dtype)
    checkpoint_id = uuid.uuid4().hex
    metadata = {"format": "pt", "format_version": str(FORMAT_VERSION), "checkpoint_id": checkpoint_id}
    staged_name = f"evon_posterior.{checkpoint_id}.safetensors"
    staged = os.path.join(directory, staged_name)
    canonical = os.path.join(directory, POSTERIOR_WEIGHTS_NAME)
    tmp_canonical = os.path.join(directory, f".{POSTERIOR_WEIGHTS_NAME}.{checkpoint_id}.tmp")
    switched = False
    try:
        save_file(tensors, staged, metadata=metadata)
        _fsync_file(staged)
        _write_config(directory, file_config(posterior, eigenbasis_dtype, checkpoint_id, staged_name))
        switched = True  # from here on the directory holds the new posterior
        try:
            os.link(staged, tmp_canonical)
        except OSError:  # no hard links on this file system
            shutil.copyfile(staged, tmp_canonical)
            _fsync_file(tmp_canonical)
        os.replace(tmp_canonical, canonical)
        _fsync_dir(directory)
        _write_config(directory, file_config(posterior, eigenbasis_dtype, checkpoint_id))
        _remove_stale_files(directory)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp_canonical)
        if not switched:
            with contextlib.suppress(OSError):
                os.remove(staged)
