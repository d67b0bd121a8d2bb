"""The EVON posterior file format (version 1): the two files on disk, read and written in one place.

``evon_posterior.safetensors`` holds, per covered parameter ``<name>``, ``<name>.hess`` and
``<name>.Q_L`` / ``<name>.Q_R`` where a basis is stored; ``evon_posterior_config.json`` is a
:class:`~hf_evon.posterior.config.PosteriorConfig`. Reading checks every tensor against the
config; writing is crash-safe (staged weights, then one ``os.replace`` of the config). The
contract — files, keys, tensors, versioning, the save protocol: ``docs/posterior-format.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import hf_evon.posterior.json_rules as json_rules
from hf_evon.fileio import (
    Listed,
    atomic_write,
    directory_lock,
    fsync_dir,
    fsync_file,
    give_created_mode,
    listed_directory,
    listed_kind,
    no_file_text,
    replaced_atomically,
    temporary_name_pattern,
)
from hf_evon.optim.linalg import rotated_std, rotated_variance
from hf_evon.posterior.config import (
    CHECKPOINT_ID_PATTERN,
    FORMAT_VERSION,
    MAX_CONFIG_DEPTH,
    POSTERIOR_CONFIG_NAME,
    POSTERIOR_WEIGHTS_NAME,
    STAGED_WEIGHTS_GLOB,
    STAGED_WEIGHTS_RE,
    PosteriorConfig,
    PosteriorMismatchError,
    as_dtype,
    dtype_name,
    staged_weights_name,
)
from hf_evon.posterior.gaussian import (
    FactorGroup,
    MatrixFactors,
    coarser,
    compute_dtype,
    orthonormal_tolerance,
    orthonormality_error,
    polar_step,
    upcast_bases,
)
from hf_evon.posterior.model_card import retract_card_section

__all__ = [
    "FORMAT_VERSION",
    "POSTERIOR_CONFIG_NAME",
    "POSTERIOR_WEIGHTS_NAME",
    "STAGED_WEIGHTS_GLOB",
    "PosteriorMismatchError",
    "check_destination",
    "check_finite_std",
    "copy_posterior",
    "file_tensors",
    "read_config",
    "read_factor_groups",
    "remove_posterior",
    "write_posterior",
]

Tensor = torch.Tensor

# files a save leaves only when it is killed; the next save removes them
_STALE_FILE_RE = re.compile(
    "|".join(
        [STAGED_WEIGHTS_RE.pattern]  # staged weights
        + [
            temporary_name_pattern(name + bak)
            for name in (POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME)
            for bak in ("", ".bak")
        ]
    )
)
# a config takes about 200 bytes per covered tensor: 64 MiB is some 300,000 tensors, beyond any model's
MAX_CONFIG_BYTES = 64 * 2**20
# Python's JSON parser makes an object of ~50 bytes from each "[]," (3 bytes): a config over
# CONTAINER_CHECK_BYTES must hold at least this many bytes per list or object (a posterior's
# holds 100-160), which bounds what its parse takes to about 10x the file
MIN_BYTES_PER_CONTAINER, CONTAINER_CHECK_BYTES = 16, 2**20
_STAGED_NAME_RE = re.compile(CHECKPOINT_ID_PATTERN)


def _staging_dir_name(checkpoint_id: str) -> str:
    """The folder a save with ``checkpoint_id`` writes its weights in (docs/posterior-format.md#the-save-protocol);
    :data:`_STAGING_DIR_RE`, by which a later save removes one a killed save left, derives from it."""
    return f".evon_posterior.{checkpoint_id}.staging"


_STAGING_DIR_RE = re.compile(
    CHECKPOINT_ID_PATTERN.join(map(re.escape, _staging_dir_name("<checkpoint_id>").split("<checkpoint_id>")))
)
# what safetensors' save_file writes before renaming it onto the file (Rust's tempfile names)
_SAFETENSORS_TMP_RE = re.compile(r"\.tmp[A-Za-z0-9]{6}")
STALE_TEMPORARY_SECONDS = 600  # a live save writes to its temporary all along
_STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_STORED_NAMES = {dtype: name for name, dtype in _STORED_DTYPES.items()}


# ----------------------------------------------------------------------------- checks
def _all_finite(t: Tensor) -> bool:
    """A finite sum implies finite entries (NaN/inf propagate); only a non-finite sum needs the slow check."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def check_finite_std(groups: list[FactorGroup], where: str, field: str = "ess") -> None:
    """Refuse a noise scale whose std ``1/√(ess·(hess + weight_decay))`` or variance (its square)
    is not finite where sampling and ``std()`` compute them.

    ``ess > 0`` is not enough: ``ess = 1e-46`` (or a tiny ``hess + weight_decay``) underflows
    to 0 in float32 and every draw would write inf/NaN into the weights; ``ess = 1e-40`` keeps
    the std finite (1e20) but its variance overflows float32, so ``std()`` is inf. A marginal
    variance is a weighted mean of these variances (the squared bases' rows sum to 1), so it
    is finite where they are.
    """
    for g in groups:
        hess = g.hess.to(compute_dtype(g.hess))
        scale = rotated_std(hess, g.ess, g.weight_decay)
        scale = torch.maximum(scale, rotated_variance(hess, g.ess, g.weight_decay))
        if _all_finite(scale):
            continue
        i = next(i for i in range(len(g.names)) if not bool(torch.isfinite(scale[i]).all()))
        low = float((g.ess * (g.hess[i].to(scale.dtype) + g.weight_decay)).min())
        raise PosteriorMismatchError(
            f"{where}: {field} = {g.ess:g} (weight_decay {g.weight_decay:g}) makes the posterior std "
            f"1/sqrt(ess·(hess + weight_decay)) or its variance of {g.names[i]!r} non-finite: ess·(hess + weight_decay) "
            f"reaches {low:g} in {dtype_name(scale.dtype)}"
        )


# ----------------------------------------------------------------------------- tensors
def file_tensors(
    factors: Mapping[str, MatrixFactors],
    eigenbasis_dtype: torch.dtype | str | None = None,
    held: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """The weights file's tensors: ``<name>.Q_L``, ``<name>.Q_R``, ``<name>.hess`` (CPU, contiguous).

    ``held``: the precision the bases hold (``EVONPosterior.config["eigenbasis_dtype"]``; their dtype
    where None or finer), and the dtype they are written in where ``eigenbasis_dtype`` is None. Bases
    written finer than that are re-orthonormalised where the written dtype's load check would refuse
    them (``upcast_bases``); bases written at most as fine are copied as they are.
    """
    eig = as_dtype(eigenbasis_dtype, "eigenbasis_dtype") or held
    tensors: dict[str, Tensor] = {}
    for name, f in factors.items():
        for key, q in (("Q_L", f.Q_L), ("Q_R", f.Q_R)):
            if q is not None:
                basis = q.detach().to("cpu", dtype=eig or q.dtype, copy=True).contiguous()
                held_q = coarser(held, q.dtype)
                tensors[f"{name}.{key}"] = upcast_bases(basis, basis.dtype, held_q, f.hess.dtype)
        # copies: the factors are views into stacked buffers, which safetensors refuses to save
        tensors[f"{name}.hess"] = f.hess.detach().to("cpu", copy=True).contiguous()
    return tensors


def _check_tensor_headers(fh: Any, config: PosteriorConfig, where: str) -> dict[str, torch.dtype]:
    """Presence, dtype and shape of every tensor, from the header alone (nothing read yet);
    errors name ``where`` (the weights file) and the tensor."""
    keys = set(fh.keys())
    stored: dict[str, torch.dtype] = {}
    for name, entry in config.parameters.items():
        for key, kind, want in entry.tensors(name):
            if key not in keys:
                raise PosteriorMismatchError(f"{where}: tensor {key!r} is missing")
            header = fh.get_slice(key)
            dtype = _STORED_DTYPES.get(header.get_dtype())
            # H is float32 or float64: in half precision a large H is inf (a zero std), a small one 0
            allowed = ["F32", "F64"] if kind == "hess" else sorted(_STORED_DTYPES)
            if dtype is None or header.get_dtype() not in allowed:
                raise PosteriorMismatchError(f"{where}: tensor {key!r} has dtype {header.get_dtype()}; expected one of {allowed}")
            if tuple(header.get_shape()) != want:
                raise PosteriorMismatchError(
                    f"{where}: tensor {key!r} has shape {list(header.get_shape())}; expected {list(want)}"
                )
            stored[key] = dtype
    _check_basis_precision(config, stored, where)
    extra = sorted(keys - set(stored))
    if extra:
        raise PosteriorMismatchError(
            f"{where} holds tensors the config does not declare: {extra[:5]} "
            "(refusing to skip them silently)"
        )
    return stored


def _buffer_dtype(stored_hess: torch.dtype) -> torch.dtype:
    """The dtype a parameter's tensors are read into, from its stored ``hess``'s: float64 or float32."""
    return torch.float64 if stored_hess == torch.float64 else torch.float32


def _coarser_than_read(config: PosteriorConfig, stored: dict[str, torch.dtype]) -> list[tuple[str, torch.dtype]]:
    """The bases stored coarser than the buffer they are read into (bfloat16 into float32), with their
    stored dtype: the loaded posterior holds them at that precision only."""
    coarse = []
    for name, entry in config.parameters.items():
        buffer = _buffer_dtype(stored[f"{name}.hess"])
        for key, kind, _ in entry.tensors(name):
            if kind != "hess" and torch.finfo(stored[key]).eps > torch.finfo(buffer).eps:
                coarse.append((key, stored[key]))
    return coarse


def _check_basis_precision(config: PosteriorConfig, stored: dict[str, torch.dtype], where: str) -> None:
    """Refuse a basis stored coarser than both the config's ``eigenbasis_dtype`` and the buffer it is read
    into: the loaded posterior would declare the finer precision, and its save would write the coarse
    rounding as that dtype, which the load's orthonormality check refuses. (A basis read into a buffer
    of its own dtype is held as it is: a mixed-dtype posterior declares its first basis's dtype.)"""
    declared = as_dtype(config.eigenbasis_dtype)
    if declared is None:
        return
    for key, dtype in _coarser_than_read(config, stored):
        if torch.finfo(dtype).eps > torch.finfo(declared).eps:
            raise PosteriorMismatchError(
                f"{where}: tensor {key!r} is stored in {_STORED_NAMES[dtype]}, coarser than the config's "
                f"eigenbasis_dtype {config.eigenbasis_dtype!r}"
            )


def _check_values(
    key: str, kind: str, slot: Tensor, weight_decay: float, stored: torch.dtype, where: str
) -> None:
    """Finite values; ``hess + weight_decay > 0``; an orthonormal basis (within its dtype's rounding).
    Errors name ``where`` (the weights file) and the tensor."""
    if not _all_finite(slot):
        raise PosteriorMismatchError(f"{where}: tensor {key!r} has non-finite values (NaN or inf)")
    if kind == "hess":
        # IVON's update keeps H + δ > 0 (H itself may dip below 0 by less than δ)
        low = float(slot.min()) + weight_decay
        if low <= 0:
            raise PosteriorMismatchError(
                f"{where}: tensor {key!r} has non-positive hess + weight_decay (min {low:g}); EVON "
                "keeps it positive, else the variance 1/(ess·(hess + weight_decay)) would be "
                "negative or infinite"
            )
        return
    # measured in the buffer's dtype: a float32 basis stored as float64 is read back as float32
    tol = orthonormal_tolerance(stored, slot.dtype)
    err = orthonormality_error(slot, fresh=True)
    if err > tol:
        raise PosteriorMismatchError(
            f"{where}: tensor {key!r} is not orthonormal "
            f"(‖QᵀQx − x‖/‖x‖ = {err:.3g} > {tol:g} for {dtype_name(stored)})"
        )


def _read_groups(
    fh: Any,
    config: PosteriorConfig,
    stored: dict[str, torch.dtype],
    device: Any,
    reorthonormalize: bool,
    where: str,
) -> list[FactorGroup]:
    """Read every tensor once, straight into its group's stacked buffer, validating its values
    (errors name ``where``, the weights file)."""
    buckets: dict[tuple, list[str]] = {}
    for name, entry in config.parameters.items():
        dt = _buffer_dtype(stored[f"{name}.hess"])
        key = (*entry.matrix_shape, entry.left_basis, entry.right_basis, *config.noise_scale(name), dt)
        buckets.setdefault(key, []).append(name)
    groups = []
    for (m, n, left, right, ess, weight_decay, dt), names in buckets.items():
        size = len(names)
        buffers = {
            "hess": torch.empty(size, m, n, dtype=dt, device=device),
            "Q_L": torch.empty(size, m, m, dtype=dt, device=device) if left else None,
            "Q_R": torch.empty(size, n, n, dtype=dt, device=device) if right else None,
        }
        for i, name in enumerate(names):
            for key, kind, _ in config.parameters[name].tensors(name):
                slot = buffers[kind][i]
                slot.copy_(fh.get_tensor(key))  # upcasts half-precision bases to float32
                _check_values(key, kind, slot, weight_decay, stored[key], where)
        if reorthonormalize:
            for kind in ("Q_L", "Q_R"):
                if buffers[kind] is not None:
                    buffers[kind] = polar_step(buffers[kind])
        groups.append(
            FactorGroup(
                names=names,
                shapes=[config.parameters[name].shape for name in names],
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
def read_config(config_path: str | os.PathLike) -> PosteriorConfig:
    """The validated config file (errors name the field and the file).

    At most ``MAX_CONFIG_BYTES`` are read, and a large one dense with lists or objects is refused
    unparsed (``MIN_BYTES_PER_CONTAINER``): a config from elsewhere cannot exhaust memory. One that
    is not a regular file (a named pipe) is refused unread: a config from elsewhere cannot block.
    """
    where = os.fspath(config_path)
    try:
        # O_NONBLOCK: opening a named pipe (a folder from elsewhere may hold one, or a link to /dev/stdin)
        # would otherwise wait for a writer for ever; a regular file is then read blocking. O_NOCTTY: a
        # session leader without a controlling terminal (a daemon) opening a link to a terminal would
        # otherwise take it as its own, and be sent its hang-up
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
        fd = os.open(where, flags)
        try:  # checked on the descriptor: open(fd) refuses a directory's, which it then leaves open
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise PosteriorMismatchError(
                    f"{where}: not a regular file (a named pipe, device or directory); refusing to read it as the config"
                )
            if hasattr(os, "O_NONBLOCK"):  # POSIX leaves O_NONBLOCK on a regular file unspecified: a FUSE or
                os.set_blocking(fd, True)  # network filesystem may answer a read with EAGAIN or a short read
            with open(fd, "rb", closefd=False) as fh:
                data = fh.read(MAX_CONFIG_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as err:
        raise PosteriorMismatchError(f"{where}: cannot read the config ({err})") from err
    if len(data) > MAX_CONFIG_BYTES:
        raise PosteriorMismatchError(
            f"{where}: the config is larger than {MAX_CONFIG_BYTES} bytes (a posterior config takes "
            "about 200 bytes per covered parameter); refusing to read it"
        )
    containers = data.count(b"[") + data.count(b"{")  # an upper bound: brackets in strings count too
    if len(data) > CONTAINER_CHECK_BYTES and containers * MIN_BYTES_PER_CONTAINER > len(data):
        raise PosteriorMismatchError(
            f"{where}: the config holds up to {containers} lists/objects in {len(data)} bytes, more than one "
            f"per {MIN_BYTES_PER_CONTAINER} bytes (a posterior's config holds about one per 100); refusing to parse it"
        )
    try:
        raw = json.loads(data.decode("utf-8"), object_pairs_hook=json_rules.unique_keys)
    except RecursionError:
        raise PosteriorMismatchError(
            f"{where}: the config nests lists/objects too deeply to parse (at most {MAX_CONFIG_DEPTH} levels)"
        ) from None
    except ValueError as err:  # also UnicodeDecodeError
        raise PosteriorMismatchError(f"{where}: cannot read the config ({err})") from err
    return PosteriorConfig.from_dict(raw, where)


def _check_same_save(weights_path: str, weights_id: str | None, config: PosteriorConfig) -> None:
    """Refuse a weights file and a config of different saves: their ``checkpoint_id`` differ, or
    one of them carries none (every save writes it to both; only files written without it on
    both sides, by hand or by another tool, pair without it)."""
    if weights_id != config.checkpoint_id:

        def shown(i: str | None) -> str:
            if i is None:
                return "no checkpoint_id"
            # a save's id as it is; any other string is a file's from elsewhere and may be megabytes long
            return f"checkpoint {i if re.fullmatch(CHECKPOINT_ID_PATTERN, i) else json_rules.shown(i)}"

        raise PosteriorMismatchError(
            f"{weights_path} ({shown(weights_id)}) and {config.source} ({shown(config.checkpoint_id)}) "
            "come from different saves; save the posterior again"
        )


def _read_precision(config: PosteriorConfig, stored: dict[str, torch.dtype]) -> torch.dtype | None:
    """The precision a config without ``eigenbasis_dtype`` holds its bases at where some are stored
    coarser than the buffers they are read into (bfloat16 into float32): the coarsest such dtype, which
    the loaded posterior declares so that its save does not write their rounding as float32. None
    where the config declares one (``_check_basis_precision``) or every basis is held as stored."""
    if config.eigenbasis_dtype is not None:
        return None
    coarsest = None
    for _, dtype in _coarser_than_read(config, stored):
        coarsest = coarser(coarsest, dtype)
    return coarsest


def read_factor_groups(
    config: PosteriorConfig, weights_path: str, device: Any, reorthonormalize: bool
) -> tuple[list[FactorGroup], torch.dtype | None]:
    """Read and validate the weights file ``config`` belongs to, into stacked factor groups; and the
    precision of the bases read where the config declares none and it is coarser than they are held in
    (``eigenbasis_dtype`` for the loaded posterior's config), else None."""
    try:
        handle = safe_open(weights_path, framework="pt", device="cpu")
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise PosteriorMismatchError(f"{weights_path}: not a readable safetensors file ({err})") from err
    with handle as fh:
        _check_same_save(weights_path, (fh.metadata() or {}).get("checkpoint_id"), config)
        stored = _check_tensor_headers(fh, config, weights_path)
        groups = _read_groups(fh, config, stored, device, reorthonormalize, weights_path)
    check_finite_std(groups, config.source)
    return groups, _read_precision(config, stored)


# ----------------------------------------------------------------------------- write
def _is_stale_safetensors_temporary(path: str) -> bool:
    """A safetensors temporary (``.tmpXXXXXX``, what ``save_file`` writes before its rename) left
    by a killed save: one that starts like a safetensors file and was not written to for
    ``STALE_TEMPORARY_SECONDS`` (a live save writes to it all along)."""
    try:
        if time.time() - os.path.getmtime(path) <= STALE_TEMPORARY_SECONDS:
            return False
        with open(path, "rb") as fh:
            head = fh.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < 2**40


def _remove_stale_files(directory: str) -> None:
    """Remove what killed saves left behind (staged weights, staging folders, temporaries).

    Called with the directory lock held, after this save's switch: no other posterior save is
    running, and the config names the canonical weights file, so no staged file is in use.
    """
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if _STAGING_DIR_RE.fullmatch(name):
            shutil.rmtree(path, ignore_errors=True)
        elif _STALE_FILE_RE.fullmatch(name) or (
            _SAFETENSORS_TMP_RE.fullmatch(name) and _is_stale_safetensors_temporary(path)
        ):
            with contextlib.suppress(OSError):
                os.remove(path)


def _config_names(config_path: str, weights_name: str) -> bool:
    """Whether the config on disk names ``weights_name`` (True where it cannot be read: keep the file)."""
    try:
        return read_config(config_path).weights_name == weights_name
    except (OSError, PosteriorMismatchError):
        return True


def check_destination(directory: str) -> None:
    """Refuse a posterior save into ``directory`` before it writes: a directory under its card's, config's or
    weights' name, where it fails after staging the weights (card, config) or switching them in (weights)."""
    names = {POSTERIOR_CONFIG_NAME: "config", POSTERIOR_WEIGHTS_NAME: "weights", "README.md": "model card"}
    for name, what in names.items():
        if listed_directory(path := os.path.join(directory, name)):
            advice = "refusing to save over it (remove it, or save elsewhere)"
            raise IsADirectoryError(f"{path}: a directory, where a posterior save writes its {what}; {advice}")


def _switch_in(directory: str, config: PosteriorConfig, write_weights: Callable[[str], None]) -> None:
    """The save protocol (``docs/posterior-format.md#the-save-protocol``) for weights that
    ``write_weights(path)`` writes, under the directory lock."""
    checkpoint_id = config.checkpoint_id or ""
    if not _STAGED_NAME_RE.fullmatch(checkpoint_id):
        raise ValueError(
            f"a posterior save needs a config with a 32-hex-digit checkpoint_id; got {checkpoint_id!r}"
        )
    staged_name = staged_weights_name(checkpoint_id)
    staged = os.path.join(directory, staged_name)
    staging = os.path.join(directory, _staging_dir_name(checkpoint_id))
    config_path = os.path.join(directory, POSTERIOR_CONFIG_NAME)
    with directory_lock(directory):
        check_destination(directory)
        switched, card = False, None
        # a retry of a save that failed after its switch: the config may name the staged file
        staged_before = os.path.exists(staged)
        try:
            # safetensors writes a temporary of its own next to the file: inside this folder,
            # a kill leaves it where the next save finds and removes it (or a retry, here)
            if os.path.isdir(staging):
                shutil.rmtree(staging)
            os.mkdir(staging)
            inner = os.path.join(staging, POSTERIOR_WEIGHTS_NAME)
            write_weights(inner)
            give_created_mode(inner)  # safetensors' own temporary is 0600: readable as the model's files are
            fsync_file(inner)
            os.rename(inner, staged)
            # the card describes the posterior about to be replaced; its new section follows the switch
            card = retract_card_section(directory)
            atomic_write(config_path, config.updated(weights_file=staged_name).to_json())
            switched = True  # from here on the directory holds the new posterior
            with replaced_atomically(os.path.join(directory, POSTERIOR_WEIGHTS_NAME)) as tmp:
                try:
                    os.link(staged, tmp)
                except OSError:  # no hard links on this file system
                    shutil.copyfile(staged, tmp)
            atomic_write(config_path, config.updated(weights_file=POSTERIOR_WEIGHTS_NAME).to_json())
            _remove_stale_files(directory)
        finally:
            # an interrupt right after the config's switch (in its fsync, before ``switched`` is set)
            # leaves a config naming the staged file: that is the posterior now, and it stays
            if not switched and not _config_names(config_path, staged_name):
                if not staged_before:
                    with contextlib.suppress(OSError):
                        os.remove(staged)
                if card is not None:  # the card describes the posterior that stays
                    with contextlib.suppress(OSError):
                        atomic_write(os.path.join(directory, "README.md"), card)
            if not switched:
                shutil.rmtree(staging, ignore_errors=True)


def write_posterior(directory: str, tensors: Mapping[str, Tensor], config: PosteriorConfig) -> None:
    """Write the weights file and the config into ``directory`` (which must exist), crash-safe.

    ``config`` comes from :meth:`PosteriorConfig.for_save` (its ``checkpoint_id`` names this
    save). The config is the switch: the weights are written under a staged name first, then
    the config naming them replaces the old config in one ``os.replace``; only then is the
    canonical weights file replaced (a hard link of the staged one, or a copy) and the config
    rewritten to name it. A kill after any step leaves a config whose weights file exists and
    matches it: the old posterior before the switch, the new one after. Saves into one
    directory from several processes run one after the other (``directory_lock``).
    """
    checkpoint_id = config.checkpoint_id
    if checkpoint_id is None or not _STAGED_NAME_RE.fullmatch(checkpoint_id):
        raise ValueError(
            f"write_posterior needs a config from PosteriorConfig.for_save; got {checkpoint_id!r}"
        )
    metadata = {"format": "pt", "format_version": str(FORMAT_VERSION), "checkpoint_id": checkpoint_id}
    _switch_in(directory, config, lambda path: save_file(dict(tensors), path, metadata=metadata))


def copy_posterior(source: str, directory: str) -> None:
    """Copy the posterior saved in ``source`` into ``directory`` with the save protocol.

    The files are copied as they are (their ``checkpoint_id`` kept); the config is read and
    validated first, and the weights file it names is the one copied. Weights that carry a
    ``checkpoint_id`` are copied unread: a caller loads the source first where a broken one must
    not replace ``directory``'s posterior (the Trainer's push does).
    """
    config = read_config(os.path.join(source, POSTERIOR_CONFIG_NAME))
    weights = os.path.join(source, config.weights_name)
    kind = listed_kind(weights)  # one this user cannot look up raises the OSError naming it
    if kind is not Listed.FILE:
        named = f"{source}: {config.weights_name} (named by {POSTERIOR_CONFIG_NAME}) is"
        error = PosteriorMismatchError if kind is Listed.NOT_REGULAR else FileNotFoundError
        raise error(f"{named} missing" if kind is None else f"{named} {no_file_text(weights, kind)}")
    if config.checkpoint_id is not None:
        _switch_in(directory, config, lambda path: shutil.copyfile(weights, path))
        return
    # files without a checkpoint_id: this copy names the pair with one id, in both files
    try:
        with safe_open(weights, framework="pt", device="cpu") as fh:
            metadata = dict(fh.metadata() or {})
            _check_same_save(weights, metadata.get("checkpoint_id"), config)
            tensors = {key: fh.get_tensor(key) for key in fh.keys()}
    except PosteriorMismatchError:
        raise
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise PosteriorMismatchError(f"{weights}: not a readable safetensors file ({err})") from err
    config = config.updated(checkpoint_id=uuid.uuid4().hex)
    metadata.update(format="pt", checkpoint_id=config.checkpoint_id)
    _switch_in(directory, config, lambda path: save_file(tensors, path, metadata=metadata))


def remove_posterior(directory: str) -> list[str]:
    """Remove the posterior saved in ``directory``: its config, its weights, the files killed saves
    left, and the card's EVON section, which describes it. Returns the names of the posterior's files
    removed (none where the directory holds none); every other file stays, and so does a directory
    under a posterior file's name: no save wrote it, and what it holds is not the posterior's.

    Under the directory lock, the config first: it is what a reader follows, so a kill after it
    leaves weights that no reader takes for a posterior, never a config without its weights.
    """
    removed = []
    if not os.path.isdir(directory):
        return removed
    with directory_lock(directory):
        for name in (POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME):
            path = os.path.join(directory, name)
            if listed_directory(path):
                continue
            try:
                os.remove(path)
            except FileNotFoundError:
                continue
            removed.append(name)
        _remove_stale_files(directory)
        if removed:
            fsync_dir(directory)
            retract_card_section(directory, replacement="")
    return removed
