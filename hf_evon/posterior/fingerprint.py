"""Which weights a posterior belongs to: a few values of its mean, recorded when it is taken.

The mean of a posterior is the model's weights and is not stored with it, so a posterior saved
beside a model can end up beside other weights: a ``trainer.save_model()`` killed between the
model's files and the posterior's leaves new weights beside the previous posterior, and both
load. A snapshot (``EVONPosterior.from_optimizer``) records ``mean_fingerprint`` in the config:
per covered parameter its first ``FINGERPRINT_POSITIONS`` values (exact, as float64): an EVON
update moves every entry, and under FSDP2 (rows sharded) the first entries are the first rank's,
read there without a collective (fewer where that rank holds fewer: a matrix of fewer rows than
ranks). :func:`mean_mismatches` compares the leading values both hold with a model's weights: exactly where the
parameter has the dtype they were recorded in, within that dtype change's rounding otherwise
(a model saved in float32 and loaded in bfloat16 still matches).

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
    holds fewer (a row-sharded DTensor's first rank, whose rows are the first), None where it holds
    none: the meta device, or a DTensor sharded elsewhere than on rows, or whose first rows another
    rank holds."""
    if hasattr(p, "device_mesh"):
        coordinate = p.device_mesh.get_coordinate()
        rows_only = all(pl.is_replicate() or pl.is_shard(dim=0) for pl in p.placements)
        if not rows_only or coordinate is None or any(coordinate):
            return None
        p = p.to_local()
    if p.device.type == "meta" or p.numel() == 0:
        return None
    return p.detach().reshape(-1)[:FINGERPRINT_POSITIONS]


def _values(params: Mapping[str, Tensor], names: list[str]) -> dict[str, list[float]] | None:
    """The leading values of each parameter, read in one transfer; None where one is not held
    by this process (see ``_leading_values``): there is nothing to compare then."""
    picked = []
    for name in names:
        values = _leading_values(params[name])
        if values is None or params[name].numel() == 0:
            return None
        picked.append(values.to(torch.float64))
    if not picked:
        return {}
    flat_values = torch.cat(picked).cpu().tolist()
    out, start = {}, 0
    for name, values in zip(names, picked, strict=True):
        out[name] = flat_values[start : start + values.numel()]
        start += values.numel()
    return out


def _dtype_label(dtypes: Iterable[torch.dtype]) -> str:
    found = {str(d).removeprefix("torch.") for d in dtypes}
    return found.pop() if len(found) == 1 else _MIXED


def mean_fingerprint(params: Mapping[str, Tensor], names: Iterable[str]) -> dict[str, Any] | None:
    """``{"dtype": ..., "values": {name: [...]}}`` of the covered ``names`` (None: not recordable)."""
    names = sorted(names)
    values = _values(params, names)
    if values is None:
        return None
    return {"dtype": _dtype_label(params[n].dtype for n in names), "values": values}


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
) -> list[str]:
    """The covered ``names`` whose weights in ``params`` differ from the recorded ones."""
    recorded = fingerprint.get("values") or {}
    names = [n for n in sorted(names) if n in recorded and n in params]
    current = _values(params, names)
    if current is None:
        return []
    recorded_dtype = str(fingerprint.get("dtype"))
    different = []
    for name in names:
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
    return different


def warn_if_other_mean(
    fingerprint: Mapping[str, Any] | None, params: Mapping[str, Tensor], names: Iterable[str]
) -> None:
    """Warn (:class:`PosteriorMeanWarning`) where the weights in ``params`` are not the recorded mean."""
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
