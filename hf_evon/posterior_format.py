"""The EVON posterior file format (version 1): the one contract for reading and writing it.

A posterior checkpoint is two files in one directory (or Hub repo folder); nothing else in
the directory is read, written or deleted, except ``README.md`` (the model card, written by
``hf_evon.model_card``), which is created or *updated* (metadata merged, an EVON section
replaced or appended), never replaced wholesale.

``evon_posterior.safetensors`` (safetensors only: loading never unpickles anything)
    For each covered parameter ``<name>`` (exactly as in ``model.named_parameters()``):

    * ``<name>.hess``: ``H``, shape ``(m, n)``, float32 (float64 for float64 parameters);
    * ``<name>.Q_L``: ``(m, m)`` orthonormal, absent where the left basis is the identity;
    * ``<name>.Q_R``: ``(n, n)`` orthonormal, absent where the right basis is the identity.

    ``Q_L``/``Q_R`` are stored in float32, or in bfloat16/float16 with
    ``save_pretrained(..., eigenbasis_dtype=torch.bfloat16)`` (about half the file). The
    header metadata holds ``format_version`` and a ``checkpoint_id`` shared with the JSON.

``evon_posterior_config.json``
    ``format_version`` (1), ``library``/``library_version``, ``checkpoint_id``, ``ess``
    and ``weight_decay`` (``"inf"`` encodes an infinite ess), the other EVON
    hyperparameters (``hess_init``, ``betas``, ``precondition_frequency``, ``mc_samples``,
    ``max_precond_dim``, ``shampoo_beta``, ``hess_clip_ratio``, ``clip``, ``clip_radius``,
    ``phased_gradients``, ``identity_basis``, ``lr`` — the scheduler's ``initial_lr`` when
    there is one, with the rate at save time as ``final_lr`` — ... as present), ``optimizer_step``,
    ``eigenbasis_dtype``, ``hess_dtype``, ``base_model``, ``model_class``,
    ``num_point_estimates`` / ``num_point_estimate_tensors`` (model parameters and tensors
    without a posterior) and ``parameters``: for each covered name, in sorted order,
    ``{"shape": [...], "matrix_shape": [m, n], "left_basis": bool, "right_basis": bool}``,
    plus ``ess``/``weight_decay`` where a parameter's group differs from the top level.
    The parameter is reshaped row-major: ``W.reshape(m, n)`` (1-D as ``1×d``, N-D as
    ``(d0, rest)``, as ``hf_evon.optim.evon.matrix_shape``).

Loading checks everything and raises :class:`PosteriorMismatchError` naming the offending
tensor: unknown or newer ``format_version``, a weights file from another save, missing or
unexpected tensors, shapes that do not match the declared ones, non-float or non-finite
values, ``hess`` negative (or zero where ``weight_decay`` is 0: infinite variance), an
eigenbasis that is not orthonormal (``‖QᵀQx − x‖ ≤ tol·‖x‖`` on random probes, ``tol``
set by the stored dtype). Half-precision eigenbases are upcast to float32 *as stored*
(GPT-2 small: ‖QᵀQx − x‖/‖x‖ ≤ 3e-3 for bfloat16, 3e-4 for float16, 1.5e-6 for float32):
no re-orthonormalisation by default, because
``Q diag(V) Qᵀ`` is still a valid covariance close to the saved one, and a QR of every
basis would cost seconds per GPT-2-sized model; ``from_pretrained(...,
reorthonormalize=True)`` applies one Newton–Schulz polar step ``Q ← Q (3I − QᵀQ) / 2``.

Writes are atomic: both files are written to temporary files in the target directory and
moved into place with ``os.replace``; an error on the way (including while moving the
second file) restores the previous checkpoint, and a reader that meets a mixed pair
(e.g. after a power loss) is stopped by the ``checkpoint_id`` check.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .optim.evon import matrix_shape
from .posterior_math import FactorGroup, orthonormality_error, polar_step

if TYPE_CHECKING:
    from .posterior import EVONPosterior

Tensor = torch.Tensor

FORMAT_VERSION = 1
POSTERIOR_WEIGHTS_NAME = "evon_posterior.safetensors"
POSTERIOR_CONFIG_NAME = "evon_posterior_config.json"

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


def _number(value: Any, field: str) -> float:
    """A float from the JSON config ("inf" allowed), or a mismatch error naming the field."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise PosteriorMismatchError(f"config field {field!r} must be a number; got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise PosteriorMismatchError(f"config field {field!r} must be a number; got {value!r}") from None


def check_noise_scale(ess: float, weight_decay: float, where: str) -> None:
    """``ess > 0`` (``inf``: no noise) and a finite ``weight_decay >= 0``, or an error naming ``where``."""
    if not ess > 0.0:
        raise PosteriorMismatchError(f"{where}: ess must be > 0 (inf for no noise); got {ess!r}")
    if not (weight_decay >= 0.0 and math.isfinite(weight_decay)):
        raise PosteriorMismatchError(f"{where}: weight_decay must be finite and >= 0; got {weight_decay!r}")


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


def _parse_entry(name: str, entry: Any, ess: float, weight_decay: float) -> _Entry:
    if not isinstance(entry, dict):
        raise PosteriorMismatchError(f"{POSTERIOR_CONFIG_NAME}: entry for {name!r} must be an object")
    try:
        shape = tuple(int(s) for s in entry["shape"])
        declared = tuple(int(s) for s in entry["matrix_shape"])
        left, right = bool(entry["left_basis"]), bool(entry["right_basis"])
    except (KeyError, TypeError, ValueError) as err:
        raise PosteriorMismatchError(
            f"{POSTERIOR_CONFIG_NAME}: entry for {name!r} needs shape, matrix_shape, left_basis, "
            f"right_basis ({err!r})"
        ) from None
    if len(declared) != 2 or declared != matrix_shape(shape):
        raise PosteriorMismatchError(
            f"{name!r}: matrix_shape {list(declared)} does not match shape {list(shape)} "
            f"(EVON views it as {list(matrix_shape(shape))})"
        )
    p_ess = _number(entry.get("ess", ess), f"parameters.{name}.ess")
    p_wd = _number(entry.get("weight_decay", weight_decay), f"parameters.{name}.weight_decay")
    check_noise_scale(p_ess, p_wd, repr(name))
    return _Entry(name, shape, declared[0], declared[1], left, right, p_ess, p_wd)


def file_config(
    posterior: EVONPosterior, eigenbasis_dtype: torch.dtype | None, checkpoint_id: str
) -> dict[str, Any]:
    """The JSON config of ``posterior`` as it will be written (JSON-safe values)."""
    from . import __version__

    config = {k: v for k, v in posterior.config.items() if k not in ("format_version", "parameters")}
    factors = [posterior[name] for name in posterior.names]
    bases = [q for f in factors for q in (f.Q_L, f.Q_R) if q is not None]
    config.update(
        format_version=FORMAT_VERSION,
        library="hf-evon",
        library_version=__version__,
        checkpoint_id=checkpoint_id,
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


def read_posterior(
    config_path: str, weights_path: str, device: Any, reorthonormalize: bool
) -> LoadedPosterior:
    """Read and validate a config/weights pair (see the module docstring for every check)."""
    try:
        with open(config_path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as err:
        raise PosteriorMismatchError(f"{POSTERIOR_CONFIG_NAME}: cannot read the config ({err})") from err
    if not isinstance(raw, dict):
        raise PosteriorMismatchError(f"{POSTERIOR_CONFIG_NAME}: the config must be a JSON object")
    version = raw.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise PosteriorMismatchError(
            f"{POSTERIOR_CONFIG_NAME}: format_version {version!r} is not a known EVON posterior format "
            f"(this hf-evon reads version {FORMAT_VERSION})"
        )
    if version > FORMAT_VERSION:
        raise PosteriorMismatchError(
            f"{POSTERIOR_CONFIG_NAME}: format_version {version} was written by a newer hf-evon; this one "
            f"reads version {FORMAT_VERSION}: upgrade hf-evon"
        )
    ess = _number(raw.get("ess"), "ess")
    weight_decay = _number(raw.get("weight_decay"), "weight_decay")
    check_noise_scale(ess, weight_decay, POSTERIOR_CONFIG_NAME)
    parameters = raw.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise PosteriorMismatchError(
            f"{POSTERIOR_CONFIG_NAME}: 'parameters' must list the covered parameters"
        )

    try:
        handle = safe_open(weights_path, framework="pt", device="cpu")
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise PosteriorMismatchError(
            f"{POSTERIOR_WEIGHTS_NAME}: not a readable safetensors file ({err})"
        ) from err
    with handle as fh:
        metadata = fh.metadata() or {}
        saved_id, config_id = metadata.get("checkpoint_id"), raw.get("checkpoint_id")
        if saved_id is not None and config_id is not None and saved_id != config_id:
            raise PosteriorMismatchError(
                f"{POSTERIOR_WEIGHTS_NAME} (checkpoint {saved_id}) and {POSTERIOR_CONFIG_NAME} (checkpoint "
                f"{config_id}) come from different saves; save the posterior again"
            )
        entries = [_parse_entry(name, parameters[name], ess, weight_decay) for name in sorted(parameters)]
        stored = _check_tensor_headers(fh, entries)
        groups = _read_groups(fh, entries, stored, device, reorthonormalize)
    config = {k: v for k, v in raw.items() if k != "parameters"}
    config["ess"], config["weight_decay"] = ess, weight_decay
    if isinstance(config.get("betas"), list):
        config["betas"] = tuple(config["betas"])
    config["format_version"] = FORMAT_VERSION
    return LoadedPosterior(
        groups, config, raw.get("num_point_estimates"), raw.get("num_point_estimate_tensors")
    )


# ----------------------------------------------------------------------------- write
def _fsync_write(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _temp_path(directory: str, final_name: str) -> str:
    return os.path.join(directory, f".{final_name}.{uuid.uuid4().hex}.tmp")


def _commit_files(pairs: list[tuple[str, str]]) -> None:
    """Move each temporary file onto its final path; on any error restore the previous files.

    Previous files are kept (hard link, or copy) until every move succeeded, so an error
    while moving the second file puts the first one back: the directory then holds the
    previous checkpoint, byte for byte. Temporary and backup files never remain.
    """
    backups: list[tuple[str, str | None]] = []  # (final, backup or None if it did not exist)
    moved: list[tuple[str, str | None]] = []
    try:
        for _, final in pairs:
            if os.path.exists(final):
                backup = _temp_path(os.path.dirname(final), os.path.basename(final) + ".bak")
                try:
                    os.link(final, backup)
                except OSError:
                    shutil.copy2(final, backup)
                backups.append((final, backup))
            else:
                backups.append((final, None))
        for (tmp, final), entry in zip(pairs, backups):
            os.replace(tmp, final)
            moved.append(entry)
    except BaseException:
        for final, backup in reversed(moved):
            with contextlib.suppress(OSError):
                if backup is None:
                    os.remove(final)
                else:
                    os.replace(backup, final)
        raise
    finally:
        for tmp, _ in pairs:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        for _, backup in backups:
            if backup is not None:
                with contextlib.suppress(OSError):
                    os.remove(backup)


def write_posterior(posterior: EVONPosterior, directory: str, eigenbasis_dtype: torch.dtype | None) -> None:
    """Write the two files of ``posterior`` into ``directory`` (which must exist), atomically."""
    tensors = posterior_tensors(posterior, eigenbasis_dtype)
    checkpoint_id = uuid.uuid4().hex
    metadata = {"format": "pt", "format_version": str(FORMAT_VERSION), "checkpoint_id": checkpoint_id}
    config_bytes = (
        json.dumps(file_config(posterior, eigenbasis_dtype, checkpoint_id), indent=2, allow_nan=False) + "\n"
    ).encode()
    weights_path = os.path.join(directory, POSTERIOR_WEIGHTS_NAME)
    config_path = os.path.join(directory, POSTERIOR_CONFIG_NAME)
    tmp_weights = _temp_path(directory, POSTERIOR_WEIGHTS_NAME)
    tmp_config = _temp_path(directory, POSTERIOR_CONFIG_NAME)
    try:
        save_file(tensors, tmp_weights, metadata=metadata)
        with open(tmp_weights, "rb+") as fh:
            os.fsync(fh.fileno())
        _fsync_write(tmp_config, config_bytes)
        _commit_files([(tmp_weights, weights_path), (tmp_config, config_path)])
    finally:
        for tmp in (tmp_weights, tmp_config):
            with contextlib.suppress(OSError):
                os.remove(tmp)
