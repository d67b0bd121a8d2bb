"""Which parameters hold a posterior sample now: the registry that ``EVONPosterior.sampled()`` blocks
and the predictive code claim weights in, and that ``EVON`` reads before it steps or samples, so that
no step is taken on a sample that the block's exit then overwrites with the mean. It lives with the
optimizer, the lowest layer that reads it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from itertools import chain
from typing import Any

import torch

__all__ = ["claim_sample", "claim_samples", "refuse_held", "release_sample"]

# the parameters (by id) that hold a sample of an open ``sampled()`` block, of any posterior or thread
_HELD: set[int] = set()
_HELD_LOCK = threading.Lock()


def claim_sample(params: Mapping[str, Any], hold: bool = True) -> set[int]:
    """Claim the parameters ``params`` (name: parameter) for one sample's writes (``hold=False``: check
    only, for code that reads them as the mean), or raise ``RuntimeError`` naming one an open
    ``sampled()`` block holds: a sample drawn there would be drawn around that block's sample, not the
    mean, and the block that ends last would restore the other's sample as the mean (threads end in any
    order). Returns the ids claimed, for :func:`release_sample`."""
    mine = {id(p): n for n, p in params.items()}
    with _HELD_LOCK:
        held = [n for key, n in mine.items() if key in _HELD]
        if held:
            more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
            raise RuntimeError(
                f"posterior parameter {held[0]!r}{more} already holds a posterior sample of an open sampled() "
                "or optimizer sampled_params() block (this thread's or another's): a model holds one sample at "
                "a time; nest no sampled() "
                "blocks, generate_bma or bma_log_likelihood over the same weights, and give each thread its "
                "own copy of the model"
            )
        if hold:
            _HELD.update(mine)
    return set(mine) if hold else set()


def claim_samples(params: Iterable[list[torch.Tensor]], claimed: set[int]) -> None:
    """:func:`claim_sample` of the lists ``params`` for an optimizer's sampled block, which has refused
    held ones by name at its entry (``refuse_held``): by id, in set operations, as it runs at every
    block (one that another thread's block claimed since is refused here). The ids go into the
    caller's ``claimed`` before the registry, and no lock is held, so an interrupt at any point leaves
    nothing claimed that the caller's :func:`release_sample` of ``claimed`` does not release."""
    ids = set(map(id, chain.from_iterable(params)))
    if not _HELD.isdisjoint(ids):
        raise RuntimeError("a parameter already holds a posterior sample of an open sampled() block of another thread")
    claimed |= ids
    _HELD.update(ids)


def release_sample(claimed: set[int]) -> None:
    """Release what :func:`claim_sample` claimed (the mean back in those parameters): one C call on the
    set, atomic under the GIL without the lock (an interrupt cannot leave the lock held)."""
    _HELD.difference_update(claimed)


def refuse_held(params: Iterable[torch.Tensor], call: str, label: Callable[[torch.Tensor], str]) -> None:
    """Raise ``RuntimeError`` for ``call`` where one of ``params`` holds a sample of an open block:
    the block's exit writes the mean back over any step taken in it, and samples drawn in it are
    drawn around its sample. O(1) while no block is open."""
    if not _HELD:
        return
    with _HELD_LOCK:
        held = next((p for p in params if id(p) in _HELD), None)
    if held is not None:
        raise RuntimeError(
            f"{call} called while {label(held)} holds a posterior sample of an open sampled() block "
            "(EVONPosterior.sampled or a BMA pass): its exit writes the mean back over any step taken in "
            "it; call it after the block"
        )
