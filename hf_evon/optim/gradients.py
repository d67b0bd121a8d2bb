"""Each ``sampled_params(train=True)`` block's own gradient: set aside at entry, added back at exit.

Inside a block ``.grad`` holds only that block's gradient, so ``zero_grad()`` inside the block
(the IVON/EVON reference packages' loop) and accumulating without it give the same update.
Gradients the previous step consumed and nobody cleared are dropped, not counted again.
A gradient that reaches an EVON weight after its block exited, before the next block or step, is
refused (:func:`guard_late_gradients`).
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from itertools import chain, compress, repeat
from typing import Any

import torch

from hf_evon.optim.checks import outside_stacklevel
from hf_evon.optim.health import param_label

__all__ = [
    "accelerate_gradient_state",
    "backward_ran",
    "closure_loss",
    "consumed_grads",
    "consumed_places",
    "guard_late_gradients",
    "mid_accumulation_refusal",
    "restore_grads",
    "set_aside_grads",
]

Tensor = torch.Tensor
# id(param) -> (weak reference to the gradient a step consumed, its version then)
Consumed = dict[int, tuple[weakref.ref, int]]
# id(param) -> a weak reference to the parameter, which carries the late-gradient hook: registered once,
# as a hook costs one Python call per backward and registering and removing one per block cost several
_HOOKED: dict[int, weakref.ref] = {}
# id(param) -> a weak reference to its optimizer, from a recorded block's exit until the next block or the
# step's end: the hook refuses a gradient only while its parameter is here and that optimizer lives. Weak, as
# a run may end between a block and its step: a strong one would keep the optimizer, its state and every
# parameter alive for the rest of the process, and refuse gradients for an optimizer the user dropped
_ARMED: dict[int, weakref.ref] = {}
# the per-parameter reads of every block and step run in ``map``s over these, not in Python's loop
_GRAD = operator.attrgetter("grad")
_PARAMS = operator.itemgetter("params")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_VERSION = operator.attrgetter("_version")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _all_params(param_groups: list[dict[str, Any]]) -> list[Tensor]:
    return list(chain.from_iterable(map(_PARAMS, param_groups)))


def _with_grad(params: list[Tensor]) -> list[Tensor]:
    return list(compress(params, map(operator.is_not, map(_GRAD, params), repeat(None))))


def _identities(params: list[Tensor]) -> Consumed:
    """The gradients of ``params`` (those that have one) by identity and version."""
    params = _with_grad(params)
    grads = list(map(_GRAD, params))
    return dict(zip(map(id, params), zip(map(weakref.ref, grads), map(_VERSION, grads))))


def _refuse_late(p: torch.Tensor) -> None:
    armed = _ARMED.get(id(p))
    if armed is None:
        return
    optimizer = armed()
    if optimizer is None:  # dropped: the weight is trained on without it
        _ARMED.pop(id(p), None)
        return
    optimizer.discard_samples()
    raise RuntimeError(
        f"a gradient reached {param_label(optimizer.param_groups, p)} after its sampled_params(train=True) block "
        "had exited: call backward inside the block. Outside it the weights hold the mean again, and a backward "
        "through activation checkpointing would recompute the forward at the mean, not at the sample the "
        "loss was taken at. This step's samples are dropped"
    )


def _forget(pid: int) -> Callable[[weakref.ref], None]:
    def forget(ref: weakref.ref) -> None:  # the parameter is gone: its id may name another tensor next
        if _HOOKED.get(pid) is ref:
            del _HOOKED[pid]
            _ARMED.pop(pid, None)

    return forget


def guard_late_gradients(optimizer: Any) -> None:
    """Refuse, from a recorded block's exit until the next ``sampled_params(train=True)`` block or the
    step's end (:func:`consumed_grads`), a gradient that reaches a sampled EVON weight: a backward of
    the exited block's graph (the documented loop calls backward inside the block). Outside
    the block the weights hold the mean again; autograd notices that for the weights a graph saved (their
    version moved), but activation checkpointing saves none and recomputes the forward during backward,
    at the mean, so that gradient is at neither the sample nor the mean. The refusal drops the step's
    samples (``optimizer.discard_samples``), whose gradients the backward has partly added to. Each weight
    gets its hook once; the hook does nothing while its weight is not armed here, or once ``optimizer``
    is garbage."""
    owner = weakref.ref(optimizer)
    for group in optimizer.param_groups:
        if group["algorithm"] != "evon" or math.isinf(group["ess"]):  # no noise: the same weights
            continue
        params = list(compress(group["params"], map(_REQUIRES_GRAD, group["params"])))
        ids = list(map(id, params))
        if not _HOOKED.keys() >= set(ids):
            for p, pid in zip(params, ids):
                if pid not in _HOOKED:
                    p.register_post_accumulate_grad_hook(_refuse_late)
                    _HOOKED[pid] = weakref.ref(p, _forget(pid))
        _ARMED.update(zip(ids, repeat(owner)))


def _unguard(param_groups: list[dict[str, Any]]) -> None:
    if _ARMED:  # (a deque of length 0 runs the pops without keeping their results)
        deque(map(_ARMED.pop, map(id, _all_params(param_groups)), repeat(None)), maxlen=0)


def consumed_grads(param_groups: list[dict[str, Any]], places: list[tuple[int, int]] | None = None) -> Consumed:
    """The gradients a step has just used (``places``: only those at these (group, position)),
    recognisable later by identity and version."""
    _unguard(param_groups)  # the step is over: a later gradient is the next step's
    if places is None:
        return _identities(_all_params(param_groups))
    chosen = set(places)
    return _identities([p for gi, group in enumerate(param_groups) for j, p in enumerate(group["params"]) if (gi, j) in chosen])


def _is_consumed(p: Tensor, consumed: Consumed) -> bool:
    ref, version = consumed.get(id(p), (None, None))
    return ref is not None and ref() is p.grad and p.grad._version == version


class _Gone:
    pass


_NOT_RECORDED = (weakref.ref(_Gone()), None)  # a (reference, version) entry whose referent is gone


def _consumed_mask(params: list[Tensor], grads: list[Tensor | None], consumed: Consumed) -> list[bool]:
    """``_is_consumed`` of each of ``params`` (whose gradients are ``grads``): the gradient is
    there, is the tensor recorded and has the version recorded, each read in ``map``s."""
    if not params:
        return []
    refs, versions = zip(*map(consumed.get, map(id, params), repeat(_NOT_RECORDED)))
    same = map(operator.is_, map(weakref.ref.__call__, refs), grads)
    unchanged = map(operator.eq, map(getattr, grads, repeat("_version"), repeat(None)), versions)
    there = map(operator.is_not, grads, repeat(None))
    return list(map(all, zip(there, same, unchanged)))


def consumed_places(param_groups: list[dict[str, Any]], consumed: Consumed) -> list[tuple[int, int]]:
    """(group, position) of every parameter whose gradient is one the last step consumed: what a
    copy of the optimizer marks consumed among its own parameters (``consumed_grads(..., places)``)."""
    return [
        (gi, j)
        for gi, group in enumerate(param_groups)
        for j, p in enumerate(group["params"])
        if p.grad is not None and _is_consumed(p, consumed)
    ]


def _local(grad: Tensor) -> Tensor:
    """This rank's part of a DTensor gradient (FSDP2); any other gradient as it is."""
    return grad.to_local() if callable(getattr(grad, "to_local", None)) else grad


def _lost_gradient(param_groups: list[dict[str, Any]], held: Consumed) -> Tensor | None:
    """The first parameter whose gradient of the step's earlier samples is gone: ``.grad`` None
    (``zero_grad()``), or, where every gradient changed in place since the last recorded exit is
    zero, the first of those (``zero_grad(set_to_none=False)``). Another change in place (an
    average over ranks, a clip) leaves a non-zero gradient; only those changed are read (a sync)."""
    everyone = _all_params(param_groups)
    params = list(compress(everyone, map(held.__contains__, map(id, everyone))))
    grads = list(map(_GRAD, params))
    lost = next(compress(params, map(operator.is_, grads, repeat(None))), None)
    if lost is not None or not params:
        return lost
    # not the tensor, or not the version, left there
    changed = list(compress(params, map(operator.not_, _consumed_mask(params, grads, held))))
    if changed and not any(bool(_local(p.grad).any()) for p in changed):
        return changed[0]
    return None


def mid_accumulation_refusal(num_steps: int, sync_gradients: bool) -> str | None:
    """Why a ``sampled_params(train=True)`` block cannot start while accelerate's gradient accumulation
    is mid-step (``sync_gradients`` False with ``gradient_accumulation_steps`` > 1), else None: inside
    ``accelerator.accumulate`` before the K-th micro-batch, each micro-batch's blocks would count as
    samples of one step, dividing the gradient (already divided by K by ``accelerator.backward``) by K
    once more, and a bare EVON, whose ``step()`` accelerate does not skip, would step at every
    micro-batch. The same state follows a step of fewer than K micro-batches, which a prepared
    optimizer skipped; the flag cannot tell the two apart, so the refusal names both. The Trainer runs
    accelerate with ``num_steps=1`` (it accumulates itself) and is never refused."""
    if num_steps <= 1 or sync_gradients:
        return None
    return (
        "sampled_params(train=True) entered inside accelerator.accumulate(model) before the last of its "
        f"gradient_accumulation_steps={num_steps} micro-batches, or after a step of fewer than {num_steps} "
        "micro-batches (a prepared optimizer's step() and zero_grad() are skipped there): put exactly "
        f"{num_steps} micro-batches (each in accelerator.accumulate) inside every sample's block, then step "
        "outside it (docs/usage.md)"
    )


def accelerate_gradient_state() -> dict[str, Any]:
    """accelerate's gradient state as its ``GradientState`` shares it between instances (empty where
    accelerate was never imported or made none; reading it makes none): the one place hf-evon reads
    accelerate's private ``GradientState._shared_state``, pinned by tests/test_distributed.py's
    accumulation tests under a real ``Accelerator``."""
    state = getattr(sys.modules.get("accelerate.state"), "GradientState", None)
    return getattr(state, "_shared_state", None) or {}


def _refuse_mid_accumulation() -> None:
    """Raise :func:`mid_accumulation_refusal` for accelerate's gradient state, if any (no import: a
    process that never imported accelerate runs no accumulation). Dictionary reads, no host sync."""
    shared = accelerate_gradient_state()
    kwargs = shared.get("plugin_kwargs") or {}
    refusal = mid_accumulation_refusal(kwargs.get("num_steps", 1), shared.get("sync_gradients", True))
    if refusal is not None:
        raise RuntimeError(refusal)


def backward_ran(param_groups: list[dict[str, Any]]) -> bool:
    """Whether a ``sampled_params(train=True)`` block's backward produced a gradient: the block set
    every ``.grad`` aside at entry, so one now is its own. Read at the exit of a block that raised:
    one that raised before its backward may have left the other ranks inside the model's own
    collectives (DDP's buffers and buckets, FSDP2's gathers), which no exchange of EVON's pairs with."""
    return any(p.grad is not None for g in param_groups for p in g["params"])


def set_aside_grads(
    param_groups: list[dict[str, Any]],
    consumed: Consumed,
    out: list[tuple[Tensor, Tensor | None]],
    held: Consumed | None = None,
    discard: Callable[[], None] | None = None,
) -> None:
    """Append ``(param, its gradient kept for this step)`` to ``out`` for every parameter, each
    before its ``.grad`` becomes None (so the block's backward leaves exactly this sample's
    gradient there): interrupted, ``out`` still holds every gradient taken away.

    ``held``: the gradients (``restore_grads``) that held the step's earlier samples' gradients at
    the last recorded block's exit. Where one is gone now (``zero_grad()`` between the blocks, with
    ``set_to_none`` or without), those samples' gradients are gone, and the step, which divides by
    the count of samples, would divide what is left by theirs too: the earlier samples are dropped
    (``discard``, with a warning naming the parameter) and so is every gradient left of them, so
    that the step's gradient is the mean over the samples from here on."""
    _refuse_mid_accumulation()  # first: nothing is set aside yet, the block raises unrecorded
    _unguard(param_groups)  # a block is running: its own backward is awaited
    lost = _lost_gradient(param_groups, held) if held else None
    if lost is not None:
        warnings.warn(
            f"{param_label(param_groups, lost)} lost the gradient of this step's earlier "
            "sampled_params(train=True) blocks, which .grad holds until step() (zero_grad(), with set_to_none "
            "or without, or .grad = None between the blocks): those samples are dropped and the step averages "
            "the samples from this block on. Call zero_grad() inside the block or after step() to average "
            "every sample",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )
        if discard is not None:
            discard()
        consumed = consumed_grads(param_groups)  # what is left of the dropped samples' gradients
    params = _all_params(param_groups)
    grads = list(map(_GRAD, params))
    if all(map(operator.is_, grads, repeat(None))):  # zero_grad() since the step: nothing to set aside
        out.extend(zip(params, grads))
        return
    used = _consumed_mask(params, grads, consumed) if consumed else repeat(False)
    if not any(map(operator.is_not, map(getattr, grads, repeat("_base"), repeat(None)), repeat(None))):
        # no view among them: the loop below, in ``map``s
        out.extend(zip(params, map(operator.getitem, zip(grads, repeat(None)), used)))  # None: consumed
        deque(map(setattr, params, repeat("grad"), repeat(None)), maxlen=0)
        return
    for p, grad, consumed_grad in zip(params, grads, used):
        keep = grad
        if grad is not None:
            if consumed_grad:
                keep = None  # the last step used it already
            elif grad._base is not None:
                # a view into a shared buffer (DDP's gradient_as_bucket_view), which the
                # block's backward overwrites: keep a copy
                keep = grad.clone()
        out.append((p, keep))
        p.grad = None


def restore_grads(stash: list[tuple[Tensor, Tensor | None]], recorded: bool, optimizer: Any = None) -> Consumed | None:
    """``.grad`` = kept + this sample's gradient (``recorded``), or only the kept part (a
    failed block: as at entry, less what the last step consumed). Recorded: returns the
    gradients now in ``.grad``, the step's (``set_aside_grads``' ``held``), by identity and version,
    and the ``optimizer``'s sampled weights refuse a later gradient (:func:`guard_late_gradients`).
    Failed (refused at its entry or raised inside) while earlier samples await the step: the guard
    their recorded exit armed, which the block's entry disarmed, is armed again, as it was."""
    if optimizer is not None and (recorded or optimizer.recorded_samples):
        guard_late_gradients(optimizer)
    if not recorded:
        for p, keep in stash:
            p.grad = keep
        return None
    own, kept = [], []
    kept_pairs = _kept(stash)
    if kept_pairs and all(map(operator.is_not, map(_GRAD, map(_FIRST, kept_pairs)), repeat(None))):
        own, kept = list(map(_GRAD, map(_FIRST, kept_pairs))), list(map(_SECOND, kept_pairs))
        kept_pairs = []
    for p, keep in kept_pairs:
        if p.grad is None:
            p.grad = keep
        else:  # added into the block's own tensor, which may be a buffer view DDP relies on
            own.append(p.grad)
            kept.append(keep)
    if own:
        torch._foreach_add_(own, kept)
    return _identities(list(map(_FIRST, stash)))


def _kept(stash: list[tuple[Tensor, Tensor | None]]) -> list[tuple[Tensor, Tensor]]:
    """The entries of ``stash`` (``set_aside_grads``) whose gradient from before the block was kept."""
    return list(compress(stash, map(operator.is_not, map(_SECOND, stash), repeat(None))))


def kept_ids(stash: list[tuple[Tensor, Tensor | None]]) -> set[int]:
    """ids of the parameters whose gradient from before the block is kept (added back at its exit)."""
    return set(map(id, map(_FIRST, _kept(stash))))


def _is_numeric_loss(loss: Any) -> bool:
    """A loss :func:`closure_loss` averages: a tensor, a real number (Python's, numpy's scalars such as
    ``np.float32``, which ``loss.item()`` style closures return) or a numpy array of real numbers
    (``loss.detach().numpy()``, a 0-d array, or per-example losses)."""
    if isinstance(loss, torch.Tensor | numbers.Real):
        return True
    numpy = sys.modules.get("numpy")  # a closure that returns a numpy array has imported numpy
    return numpy is not None and isinstance(loss, numpy.ndarray) and loss.dtype.kind in "iuf"


def _as_tensors_with_tensors(losses: list[Any]) -> list[Any]:
    """``losses`` with every numpy array read as a tensor on the device of the first tensor among them, if
    any: ``ndarray + Tensor`` raises (numpy's own sum, which refuses a tensor) where ``Tensor + ndarray``
    reads the array as a tensor, and a 0-d array summed first becomes a numpy scalar, a number to torch,
    so the mean's type would depend on the calls' order. Numpy scalars stay numbers, as torch reads them."""
    device = next((loss.device for loss in losses if isinstance(loss, torch.Tensor)), None)
    if device is None:
        return losses
    numeric = torch.Tensor | numbers.Real
    return [loss if isinstance(loss, numeric) else torch.as_tensor(loss, device=device) for loss in losses]


def closure_loss(optimizer: Any, closure: Callable[[], Any]) -> Any:
    """``closure`` called in each of ``optimizer.mc_samples`` blocks ``sampled_params(train=True)``, with
    gradients enabled (``step()`` runs under no_grad), as the loop of ``mc_samples`` blocks records them:
    the mean of the losses it returns (:func:`_is_numeric_loss`: tensors, real numbers, numpy arrays),
    else (None, the loss with other outputs) what its last call returned, as torch's optimizers return what
    the closure returns. Losses of shapes that have no mean are refused (ValueError) before the update, the
    samples dropped. A call that raises (an out-of-memory error a caller retries) drops the step's samples
    and their noise: the optimizer is as the last step left it, and a retry steps as a run without the
    failure does."""
    optimizer._refuse_in_sample("step()")  # here, not in its first block, whose refusal names sampled_params()
    losses = []
    try:
        for _ in range(optimizer.mc_samples):
            with torch.enable_grad(), optimizer.sampled_params(train=True):
                losses.append(closure())
    except BaseException:
        optimizer.discard_samples(rewind=True)
        raise
    if len(losses) > 1 and all(_is_numeric_loss(loss) for loss in losses):
        shapes = [tuple(getattr(loss, "shape", ())) for loss in losses]
        try:
            torch.broadcast_shapes(*shapes)
        except RuntimeError as error:  # shapes that do not broadcast: refused before the update
            optimizer.discard_samples(rewind=True)
            raise ValueError(
                f"step(closure): the closure's {len(losses)} losses (shapes {', '.join(map(str, shapes))}) have "
                "no mean: return losses of one shape (a scalar, e.g. loss.mean()) from every call. This step's "
                f"samples are dropped ({error})"
            ) from error
        try:
            return sum(_as_tensors_with_tensors(losses)) / len(losses)
        except BaseException:  # out of memory, other devices: as it is, the samples dropped as for a raise
            optimizer.discard_samples(rewind=True)
            raise
    return losses[-1]
