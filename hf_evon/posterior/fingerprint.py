"""Which weights a posterior belongs to: a few values of its mean, recorded when it is taken.

The mean of a posterior is the model's weights and is not stored with it, so a posterior saved
beside a model can end up beside other weights: a ``trainer.save_model()`` killed between the
model's files and the posterior's leaves new weights beside the previous posterior, and both
load. A snapshot (``EVONPosterior.from_optimizer``) records ``mean_fingerprint`` in the config:
per covered parameter its first ``FINGERPRINT_POSITIONS`` values (exact, as float64): an EVON
update moves every entry, and of a sharded DTensor (FSDP2's rows, tensor parallelism's rows or
columns) the first entries are the first rank's (every mesh coordinate 0), read there without a
collective (fewer where that rank holds fewer: a matrix of fewer rows than ranks, the first row's
columns of a column shard). :func:`mean_mismatches` compares the leading values both hold with a
model's weights: exactly where the parameter has the dtype they were recorded in, within that dtype
change's rounding otherwise (a model saved in float32 and loaded in bfloat16 still matches). Where
this process cannot read a weight (another rank holds its first entries, or it is on the meta device)
it says so (None) rather than "a match": a caller deciding on it across ranks takes the first rank's
answer (``hf_evon.distributed.fsdp2.first_rows_value``).

A mismatch warns instead of refusing: sampling around other weights is still a well-defined
Gaussian, and deliberate uses (training on from a saved posterior, an adapter merged into its
base) must keep working; the warning names the tensors so an unintended pair is noticed.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hf_evon.optim.checks import outside_stacklevel

__all__ = [
    "FINGERPRINT_POSITIONS",
    "PosteriorMeanWarning",
    "mean_fingerprint",
    "mean_mismatches",
    "warn_if_other_mean",
]

Tensor = torch.Tensor

FINGERPRINT_POSITIONS = 8  # per parameter: an EVON update changes every entry of a matrix
_MIXED = "mixed"


class PosteriorMeanWarning(UserWarning):
    """The model's weights are not the ones the posterior was taken at (its mean)."""


def _leading_values(p: Tensor) -> Tensor | None:
    """The first ``FINGERPRINT_POSITIONS`` entries of ``p`` (flattened), fewer where this process
    holds fewer, None where it holds none: the meta device, an empty tensor, or a DTensor whose first
    entries another rank holds (only mesh coordinate 0 holds them) or that is not sharded (``Partial``).

    Coordinate 0 of a DTensor sharded on dims ``s1 < ... < sk`` holds offset 0 on each, so its local
    entries, flattened, start with the global ones for as long as they run along the last sharded
    dim and the full dims after it: ``prod(local.shape[sk:])`` entries (all of them for rows)."""
    if hasattr(p, "device_mesh"):
        coordinate = p.device_mesh.get_coordinate()
        if coordinate is None or any(coordinate):
            return None
        if not all(pl.is_replicate() or pl.is_shard() for pl in p.placements):
            return None
        sharded = [pl.dim % p.dim() for pl in p.placements if pl.is_shard()]
        local = p.to_local()
        p = local[(0,) * max(sharded)] if sharded else local  # index 0 on the dims before sk
    if p.device.type == "meta" or p.numel() == 0:
        return None
    return p.detach().reshape(-1)[:FINGERPRINT_POSITIONS]


def _values(params: Mapping[str, Tensor], names: list[str]) -> dict[str, list[float]]:
    """The leading values of each parameter this process holds, read in one transfer; a name it
    does not hold (see ``_leading_values``) is left out."""
    picked = {}
    for name in names:
        values = _leading_values(params[name])
        if values is not None:
            picked[name] = values.to(torch.float64)
    if not picked:
        return {}
    flat_values = torch.cat(list(picked.values())).cpu().tolist()
    out, start = {}, 0
    for name, values in picked.items():
        out[name] = flat_values[start : start + values.numel()]
        start += values.numel()
    return out


def _dtype_label(dtypes: Iterable[torch.dtype]) -> str:
    found = {str(d).removeprefix("torch.") for d in dtypes}
    return found.pop() if len(found) == 1 else _MIXED


def mean_fingerprint(params: Mapping[str, Tensor], names: Iterable[str]) -> dict[str, Any] | None:
    """``{"dtype": ..., "values": {name: [...]}}`` of the covered ``names`` (None: not recordable);
    where their dtypes differ ("mixed"), also ``"dtypes": {name: dtype}``: each is compared at its own."""
    names = sorted(names)
    values = _values(params, names)
    if len(values) < len(names):
        return None
    fingerprint: dict[str, Any] = {"dtype": _dtype_label(params[n].dtype for n in names), "values": values}
    if fingerprint["dtype"] == _MIXED:
        fingerprint["dtypes"] = {n: str(params[n].dtype).removeprefix("torch.") for n in names}
    return fingerprint


def _rounding(*dtype_names: str) -> tuple[float, float]:
    """(relative, absolute) tolerance of a cast between these dtypes (bfloat16 for "mixed" or an
    unknown name): the largest eps, and the largest subnormal spacing (``tiny · eps``), which bounds
    the rounding of a value below a dtype's normal range. The two maxima may come from different
    dtypes: bfloat16 has the larger eps, float16 the narrower range (a bfloat16 weight of 3e-6 moves
    by 0.9% as float16)."""
    infos = []
    for name in dtype_names:
        dtype = getattr(torch, name, None)
        floating = isinstance(dtype, torch.dtype) and dtype.is_floating_point
        infos.append(torch.finfo(dtype if floating else torch.bfloat16))
    return max(info.eps for info in infos), max(info.tiny * info.eps for info in infos)


def mean_mismatches(
    fingerprint: Mapping[str, Any], params: Mapping[str, Tensor], names: Iterable[str]
) -> list[str] | None:
    """The covered ``names`` whose weights in ``params`` differ from the recorded ones: ``[]`` where
    this process read every one the fingerprint records and each matches, None where it cannot tell:
    none of those it read differs, but it could not read them all (see ``_leading_values``), or the
    fingerprint records none of ``names``."""
    recorded = fingerprint.get("values") or {}
    names = [n for n in sorted(names) if n in recorded and n in params]
    current = _values(params, names)
    unread = len(current) < len(names)
    names = [n for n in names if n in current]
    each = fingerprint.get("dtypes") or {}  # per tensor where they were mixed (absent in older files)
    different = []
    for name in names:
        recorded_dtype = str(each.get(name, fingerprint.get("dtype")))
        want, got = [float(v) for v in recorded[name]], current[name]  # "nan"/"inf" as json_value writes them
        # the leading values both hold: a record or a model sharded by FSDP2 may hold fewer
        want, got = want[: len(got)], got[: len(want)]
        dtype = str(params[name].dtype).removeprefix("torch.")
        if not want:
            different.append(name)
        elif dtype == recorded_dtype:
            if any(a != b and not (a != a and b != b) for a, b in zip(want, got, strict=True)):  # NaN == NaN
                different.append(name)
        else:
            rel, spacing = _rounding(dtype, recorded_dtype)
            if any(abs(a - b) > rel * max(abs(a), abs(b)) + spacing for a, b in zip(want, got, strict=True)):
                different.append(name)
    if not different and (unread or not names):
        return None
    return different


def warn_if_other_mean(
    fingerprint: Mapping[str, Any] | None, params: Mapping[str, Tensor], names: Iterable[str]
) -> None:
    """Warn (:class:`PosteriorMeanWarning`) where the weights in ``params`` are not the recorded mean.

    Silent where this process cannot tell: under FSDP2 or tensor parallelism the rank holding the
    first entries (mesh coordinate 0) compares and warns, and weights on the meta device have no
    values (sampling refuses them, naming them)."""
    if not fingerprint:
        return
    names = list(names)
    different = mean_mismatches(fingerprint, params, names)
    if different:
        warnings.warn(
            f"the model's weights differ from the ones this EVON posterior was taken at (its mean) in "
            f"{len(different)} of {len(names)} covered tensors, e.g. {different[:3]}: model and posterior "
            "come from different saves (e.g. a save killed between the model's files and the posterior's, "
            "or files of two runs); save the posterior again with these weights before sampling",
            PosteriorMeanWarning,
            stacklevel=outside_stacklevel(),  # the user's line, also through sampled()
        )
