"""Each ``sampled_params(train=True)`` block's own gradient: set aside at entry, added back at exit.

Inside a block ``.grad`` holds only that block's gradient, so ``zero_grad()`` inside the block
(the IVON/EVON reference packages' loop) and accumulating without it give the same update.
Gradients the previous step consumed and nobody cleared are dropped, not counted again.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hf_evon.optim.checks import outside_stacklevel
from hf_evon.optim.health import param_label

__all__ = ["consumed_grads", "consumed_places", "restore_grads", "set_aside_grads"]

Tensor = torch.Tensor
# id(param) -> (weak reference to the gradient a step consumed, its version then)
Consumed = dict[int, tuple[weakref.ref, int]]


def consumed_grads(param_groups: list[dict[str, Any]], places: list[tuple[int, int]] | None = None) -> Consumed:
    """The gradients a step has just used (``places``: only those at these (group, position)),
    recognisable later by identity and version."""
    chosen = None if places is None else set(places)
    return {
        id(p): (weakref.ref(p.grad), p.grad._version)
        for gi, group in enumerate(param_groups)
        for j, p in enumerate(group["params"])
        if p.grad is not None and (chosen is None or (gi, j) in chosen)
    }


def _is_consumed(p: Tensor, consumed: Consumed) -> bool:
    ref, version = consumed.get(id(p), (None, None))
    return ref is not None and ref() is p.grad and p.grad._version == version


def consumed_places(param_groups: list[dict[str, Any]], consumed: Consumed) -> list[tuple[int, int]]:
    """(group, position) of every parameter whose gradient is one the last step consumed: what a
    copy of the optimizer marks consumed among its own parameters (``consumed_grads(..., places)``)."""
    return [
        (gi, j)
        for gi, group in enumerate(param_groups)
        for j, p in enumerate(group["params"])
        if p.grad is not None and _is_consumed(p, consumed)
    ]


def set_aside_grads(
    param_groups: list[dict[str, Any]],
    consumed: Consumed,
    out: list[tuple[Tensor, Tensor | None]],
    held: set[int] | frozenset[int] = frozenset(),
    discard: Callable[[], None] | None = None,
) -> None:
    """Append ``(param, its gradient kept for this step)`` to ``out`` for every parameter, each
    before its ``.grad`` becomes None (so the block's backward leaves exactly this sample's
    gradient there): interrupted, ``out`` still holds every gradient taken away.

    ``held``: the parameters (by id) whose ``.grad`` held the step's earlier samples' gradients at
    the last recorded block's exit. Where one has none now (``zero_grad()`` between the blocks),
    those samples' gradients are gone, and the step, which divides by the count of samples, would
    divide what is left by theirs too: the earlier samples are dropped (``discard``, with a
    warning naming the parameter) and so is every gradient left of them, so that the step's
    gradient is the mean over the samples from here on."""
    lost = next((p for group in param_groups for p in group["params"] if p.grad is None and id(p) in held), None)
    if lost is not None:
        warnings.warn(
            f"{param_label(param_groups, lost)} lost the gradient of this step's earlier "
            "sampled_params(train=True) blocks, which .grad holds until step() (zero_grad() or .grad = None "
            "between the blocks): those samples are dropped and the step averages the samples from this "
            "block on. Call zero_grad() inside the block or after step() to average every sample",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )
        if discard is not None:
            discard()
        consumed = consumed_grads(param_groups)  # what is left of the dropped samples' gradients
    for group in param_groups:
        for p in group["params"]:
            grad = keep = p.grad
            if grad is not None:
                if _is_consumed(p, consumed):
                    keep = None  # the last step used it already
                elif grad._base is not None:
                    # a view into a shared buffer (DDP's gradient_as_bucket_view), which the
                    # block's backward overwrites: keep a copy
                    keep = grad.clone()
            out.append((p, keep))
            p.grad = None


def restore_grads(stash: list[tuple[Tensor, Tensor | None]], recorded: bool) -> set[int] | None:
    """``.grad`` = kept + this sample's gradient (``recorded``), or only the kept part (a
    failed block: as at entry, less what the last step consumed). Recorded: returns the
    parameters (by id) holding a gradient now, the step's gradients (``set_aside_grads``' ``held``)."""
    if not recorded:
        for p, keep in stash:
            p.grad = keep
        return None
    own, kept = [], []
    for p, keep in stash:
        if keep is None:
            continue
        if p.grad is None:
            p.grad = keep
        else:  # added into the block's own tensor, which may be a buffer view DDP relies on
            own.append(p.grad)
            kept.append(keep)
    if own:
        torch._foreach_add_(own, kept)
    return {id(p) for p, _ in stash if p.grad is not None}
