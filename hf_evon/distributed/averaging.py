"""Averaging tensors across data-parallel ranks in a few flat all-reduces (``EVON.gradient_reducer``)."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from hf_evon.optim.update import adamw_inputs, moved_refusal
from hf_evon.optim.validation import GROUP_KEYS

if TYPE_CHECKING:
    from hf_evon.optim.evon import EVON

Tensor = torch.Tensor

__all__ = ["RankAverager", "settings_differ", "settings_key", "world_size"]


def _settings(optimizer: EVON | None) -> list[dict[str, Any]]:
    """Each parameter group's hyperparameters (what every rank must agree on; empty without an
    optimizer): their repr's checksum is compared across ranks at every step."""
    if optimizer is None:
        return []
    keys = ("algorithm", *GROUP_KEYS)
    return [{k: _comparable(g[k]) for k in keys if k in g} for g in optimizer.param_groups]


def _comparable(value: Any) -> Any:
    """``value`` as the ranks compare it: a tensor (a rate torch's schedulers set in place) by its dtype
    and shape alone, since its repr names each rank's own device (cuda:0, cuda:1) and reading a
    device's value every step is a host sync (a rate on the device is read at set-up only)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.dtype}, shape={tuple(value.shape)})"
    if isinstance(value, (tuple, list)):
        return type(value)(map(_comparable, value))
    return value


def _moved(optimizer: EVON) -> str | None:
    """Why ``optimizer``'s step is refused where a parameter was recast or moved since its state was made."""
    adamw = adamw_inputs(optimizer.param_groups, optimizer.state, optimizer._hooks, 1)  # lists, no arithmetic
    return moved_refusal(optimizer.buckets, adamw, optimizer._param_label)  # as the step names it


def settings_key(optimizer: EVON | None) -> tuple[list[dict[str, Any]], int]:
    """``optimizer``'s group settings and their checksum (compared across ranks)."""
    settings = _settings(optimizer)
    return settings, zlib.crc32(repr(settings).encode())


def settings_differ(every: list[Any], mine: list[dict[str, Any]]) -> str:
    """Why a step is refused where the ranks' group settings (``every``, rank order) differ."""
    differ = _differences(every, mine)
    odd = [str(r) for r, theirs in enumerate(every) if theirs != every[0]]
    ranks = f"rank {odd[0]} differs" if len(odd) == 1 else f"ranks {', '.join(odd)} differ"
    return (
        f"EVON: the ranks' hyperparameters differ ({', '.join(differ) or 'the parameter groups'}; {ranks} "
        f"from rank 0; per rank: {every}): each would apply a different update. Build the optimizer, and "
        "edit its param_groups, alike on every rank"
    )


def _differences(every: list[Any], mine: list[dict[str, Any]]) -> list[str]:
    """What differs between this rank's group settings and any rank's, as "group i key"."""
    out = set()
    for theirs in every:
        if len(theirs) != len(mine):
            out.add("the number of parameter groups")
        for gi, (a, b) in enumerate(zip(theirs, mine)):
            out.update(f"group {gi} {k}" for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return sorted(out)


def world_size(group: Any = None) -> int:
    """Processes in ``group`` (1 without an initialised process group)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class RankAverager:
    """``EVON.gradient_reducer``: averages a list of tensors across ranks, in place.

    Tensors are packed per (device, dtype) into flat buffers of at most ``bucket_cap_mb``,
    each all-reduced once (asynchronously, all in flight together), divided by the world size
    and unpacked. All ranks end with bitwise identical values.

    Args:
        group: the data-parallel process group (default: the whole world).
        bucket_cap_mb: upper bound of one flat buffer (bounds the extra memory).
        check_consistency: before reducing, check (one tiny all-reduce) that every rank passes
            the same number of tensors and elements, recorded the same number of samples and has
            the same hyperparameters (``optimizer``'s), and raise on every rank instead of hanging
            or drifting apart if not.
        verify_local_gradients: at the first noisy steps, check that the ranks' gradients
            differ, i.e. that nothing (an unprepared DDP wrapper) averaged them already.
        optimizer: the EVON this reducer serves (needed by ``verify_local_gradients``). Its structure
            check looks for a parameter recast or moved on a rank whose averaged tensors changed dtype
            or device since the last step that found none (where a recast shows before the step);
            finding none on any rank, it tells ``optimizer`` (``_placement_checked``), whose ``step()``
            then skips the same check if that step ran it. A step that synchronized earlier (the
            Trainer's, to clip) checks itself: a recast between the two leaves the tensors as they were.
        guard: called first at every step, before any collective (raises to refuse the step on
            every rank alike).
    """

    def __init__(
        self,
        group: Any = None,
        bucket_cap_mb: float = 64.0,
        check_consistency: bool = True,
        verify_local_gradients: bool = False,
        optimizer: EVON | None = None,
        guard: Callable[[], None] | None = None,
    ) -> None:
        self.group = group
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.check_consistency = check_consistency
        self.verify_local_gradients = verify_local_gradients
        self.optimizer = optimizer
        self.guard = guard
        self.calls = 0  # how many times it averaged (once per optimizer step)
        self._layout: list[tuple[torch.dtype, torch.device]] | None = None  # as at the last step with none moved
        self._verifications_left = 3

    def __call__(self, tensors: list[Tensor], failed: bool = False, device: torch.device | None = None) -> int | None:
        """Average ``tensors``; ``failed``: this rank's ``sampled_params`` block raised, so it only joins
        the structure check (needs ``check_consistency``; ``device`` for its flag where it holds no
        tensor), in which every rank learns it, and none averages. Returns the highest such rank, or None."""
        if self.guard is not None:
            self.guard()
        self.calls += 1
        world = world_size(self.group)
        if world == 1 or not tensors and not failed and not self.check_consistency:
            return None
        if self.check_consistency:
            # also on a rank without gradients (its backward skipped): every rank joins the check, which
            # refuses the step on all of them where another rank has some, instead of mispairing collectives
            failed_rank = self._check_same_structure(tensors, failed, device or self._flag_device())
            if failed_rank is not None:
                return failed_rank
        if not tensors:  # none on any rank (the check found the same count everywhere)
            return None
        if self.verify_local_gradients and self._verifications_left > 0:
            self._verify_local(tensors)
        works = []
        buckets = self._buckets(tensors)
        flats = []
        for bucket in buckets:
            flat = _flatten_dense_tensors(bucket)
            flats.append(flat)
            works.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        for bucket, flat, work in zip(buckets, flats, works):
            work.wait()
            flat.div_(world)
            torch._foreach_copy_(bucket, list(_unflatten_dense_tensors(flat, bucket)))
        return None

    def _flag_device(self) -> torch.device:
        """Where the structure check's flags go on a rank that holds no tensor: the optimizer's
        parameters' device (NCCL reduces no CPU tensor)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]] if self.optimizer is not None else []
        return params[0].device if params else torch.device("cpu")

    def _buckets(self, tensors: list[Tensor]) -> list[list[Tensor]]:
        by_kind: dict[tuple[torch.device, torch.dtype], list[list[Tensor]]] = {}
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        for t in tensors:
            if t.is_sparse:
                raise TypeError("EVON's gradient reducer does not support sparse gradients")
            key = (t.device, t.dtype)
            nbytes = t.numel() * t.element_size()
            chunks = by_kind.setdefault(key, [[]])
            if chunks[-1] and sizes.get(key, 0) + nbytes > self.bucket_cap_bytes:
                chunks.append([])
                sizes[key] = 0
            chunks[-1].append(t)
            sizes[key] = sizes.get(key, 0) + nbytes
        return [chunk for chunks in by_kind.values() for chunk in chunks]

    def _check_same_structure(
        self, tensors: list[Tensor], failed: bool = False, device: torch.device | None = None
    ) -> int | None:
        """Raise on every rank alike where the ranks' tensors, samples or hyperparameters differ;
        return the highest rank that ``failed`` (its block raised), or None."""
        count, numel = len(tensors), sum(t.numel() for t in tensors)
        # each rank divides the averaged sum of its samples' gradients by its own count of them
        samples = 0 if self.optimizer is None else self.optimizer.recorded_samples
        settings, key = settings_key(self.optimizer)
        failed_rank = dist.get_rank(self.group) + 1 if failed else 0  # 0: none failed
        # a parameter recast or moved on this rank alone: its gradient would go into a flat buffer of
        # its own here, and the ranks' all-reduces would not pair; so every rank refuses the step
        layout = [(t.dtype, t.device) for t in tensors]  # a recast's or move's gradients show it
        checked = self.optimizer is not None and layout != self._layout
        moved = _moved(self.optimizer) if checked else None
        values = [count, numel, samples, key, failed_rank, int(moved is not None)]
        device = tensors[0].device if tensors else device
        sig = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
        dist.all_reduce(sig, op=dist.ReduceOp.MAX, group=self.group)
        hi_count, hi_numel, hi_samples, hi_key, hi_failed, hi_moved, lo_count, lo_numel, lo_samples, lo_key = (
            sig.tolist()[:10]
        )
        if hi_failed:  # every rank sees it: none averages, none waits
            return hi_failed - 1
        if hi_moved:  # every rank learns the reason (rare: one more collective)
            every_reason: list[Any] = [None] * world_size(self.group)
            dist.all_gather_object(every_reason, moved, group=self.group)
            first = next(r for r, why in enumerate(every_reason) if why is not None)
            raise RuntimeError(moved or f"rank {first} refused the step, so every rank does: {every_reason[first]}")
        if checked:  # none moved on any rank: a step() running this check skips its own
            self.optimizer._placement_checked = True
            self._layout = layout
        if hi_key != -lo_key:  # the ranks' hyperparameters differ: name them (rare: one more collective)
            every: list[Any] = [None] * world_size(self.group)
            dist.all_gather_object(every, settings, group=self.group)
            raise RuntimeError(settings_differ(every, settings))
        if hi_samples != -lo_samples:  # every rank sees the same maxima: all raise, none hangs
            raise RuntimeError(
                "EVON: the ranks recorded different numbers of sampled_params(train=True) blocks for "
                f"this step (between {-lo_samples} and {hi_samples}; this rank: {samples}), so their "
                "updates would differ. A block that raised on one rank (and was caught) is not "
                "recorded: run the same blocks on every rank. The step was refused on every rank and "
                "its samples dropped; the optimizer is usable"
            )
        if (hi_count, hi_numel) != (-lo_count, -lo_numel):
            raise RuntimeError(
                "EVON: the ranks disagree on which gradients to average (tensors per rank between "
                f"{-lo_count} and {hi_count}, elements between {-lo_numel} and {hi_numel}; this rank: "
                f"{count}, {numel}). Every rank must run the same sampled_params() blocks and produce "
                "gradients for the same parameters (with DDP, find_unused_parameters=True gives "
                "unused parameters zero gradients)"
            )
        return None

    def _verify_local(self, tensors: list[Tensor]) -> None:
        opt = self.optimizer
        if opt is None:
            return
        num_acc = sum(b.acc is not None for b in opt.buckets)  # the Price numerators, after the gradients
        if not any(b.initialized and b.noisy_phase() for b in opt.buckets):
            return  # no noise in this step (ess=inf, a clean phase, the first step): ranks may agree
        self._verifications_left -= 1
        grads = tensors[: len(tensors) - num_acc]
        if not grads:
            return
        fingerprint = torch.stack(
            [g.detach().double().square().sum() + g.detach().double().sum() for g in grads]
        ).sum()
        # every rank joins the all-reduce (a rank whose gradients are all zero, e.g. a loss times 0,
        # too): only the same nonzero fingerprint everywhere says the gradients were averaged before
        both = torch.stack([fingerprint, -fingerprint])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        if both[0].item() == -both[1].item() != 0.0:
            raise RuntimeError(
                "EVON: every rank has bitwise the same gradients at its own posterior sample, so something "
                "averaged them before EVON could form each rank's Hessian estimate. The model that runs "
                "forward/backward is probably DDP-wrapped but was not the one passed to "
                "hf_evon.prepare_distributed(model, optimizer): pass the model returned by "
                "accelerator.prepare() (the DDP wrapper), not an unwrapped module"
            )
