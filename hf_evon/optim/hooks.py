"""What EVON asks of the code that distributes it, and the single-process answers.

``EVON`` calls these methods at fixed points of its loop (bucket building, each
``sampled_params`` block, each ``step``, inspection, checkpoints). :class:`ShardingHooks` gives
every one the single-process behaviour: this process owns every parameter, nothing is
exchanged. The distributed package subclasses it (work sharding under DDP, FSDP2) and installs
its object as ``optimizer.sharding``; ``hf_evon.optim`` imports nothing from there.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from hf_evon.optim.buckets import Bucket

__all__ = ["LOCAL", "ShardingHooks", "refuse_unprepared_processes"]

Tensor = torch.Tensor
_GRAD = operator.attrgetter("grad")


class ShardingHooks:
    """The distribution hooks of ``EVON``, with single-process defaults (override what differs).

    Ownership: ``owns``, ``owned_bucket``, ``bucket_param``/``model_param`` (the tensor that stands
    for a parameter in this rank's buckets, and back). The loop: ``before_sample``,
    ``share_sample``, ``end_sample``, ``before_step``, ``after_step``, ``all_ranks``. Values:
    ``square_sums`` (``ess="auto"``), ``standard_normal`` (the sample's draw; None: the optimizer's
    own per-rank stream), ``adamw_tensors``, ``pool_rows`` (health statistics), ``every_rank``,
    ``remote_factors``. Checkpoints: ``full_state_dict``, ``local_state_dict``.
    """

    # whether the model runs collectives of its own in forward/backward (DDP, FSDP2): a block that
    # raised there before its backward joins no exchange of EVON's, which those would not pair with,
    # and its error stops the job (caught, the ranks' collectives no longer pair)
    model_collectives = False

    # ------------------------------------------------------------- ownership
    def new_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """A group ``add_param_group`` adds, as it is added (sharded: refused, owners are fixed)."""
        return group

    def owns(self, p: Tensor) -> bool:
        """Whether this rank keeps the state of, and updates, parameter ``p``."""
        return True

    def owned(self, params: list[Tensor]) -> list[Tensor]:
        """The members of ``params`` this rank owns (``owns``), in order."""
        return params if type(self).owns is ShardingHooks.owns else list(filter(self.owns, params))

    def owned_bucket(self, b: Bucket) -> Bucket:
        """The bucket of this rank's members of ``b`` (before any state is stacked)."""
        return b

    def bucket_param(self, p: Tensor) -> Tensor:
        """The tensor that stands for the optimizer's parameter ``p`` in this rank's buckets."""
        return p

    def model_param(self, q: Tensor) -> Tensor:
        """The optimizer's parameter a bucket member stands for (inverse of ``bucket_param``)."""
        return q

    # ------------------------------------------------------------- values
    def square_sums(self, params: list[Tensor]) -> Tensor:
        """``Σ p²`` (float64, on the CPU) of each parameter, for ``ess="auto"``: float32's squares
        overflow above 1.8e19 and vanish below 1e-23."""
        sq = [p.detach().double().square().sum() for p in params]
        return torch.stack(sq).cpu() if sq else torch.zeros(0)

    def standard_normal(self, b: Bucket) -> Tensor | None:
        """The ``(B, m, n)`` draw of the sample now entered for bucket ``b``; None: the
        optimizer's own stream (seeded by seed, rank, block and device)."""
        return None

    def adamw_tensors(self, params: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """The tensors AdamW updates for ``params`` and their gradients."""
        return params, list(map(_GRAD, params))

    def pool_rows(self, rows: Tensor, count: int) -> tuple[Tensor, int]:
        """Per-bucket health statistics (CPU) and element counts of every rank, pooled."""
        return rows, count

    def every_rank(self, obj: Any) -> list[Any]:
        """``obj`` (picklable) of every rank, in rank order (a collective)."""
        return [obj]

    def remote_factors(self, p: Tensor) -> dict[str, Any]:
        """``posterior_factors`` of a parameter another rank owns."""
        raise KeyError("parameter is not trained by EVON in this optimizer")

    # ------------------------------------------------------------- the loop
    def before_sample(self) -> None:
        """At a ``sampled_params`` block's entry, before any draw."""

    def share_sample(self) -> None:
        """After this rank wrote the sample of the matrices it owns."""

    def end_sample(self, recorded: bool, failed: bool = False) -> str | None:
        """At a block's exit, before the means are restored (``recorded``: a ``train=True``
        block that completed; ``failed``: one that raised on this rank, which the other ranks learn
        in the exchange; under ``model_collectives`` only one that raised after its backward: one
        that raised before it is neither, and joins none). Returns why a block that completed here
        is not recorded after all (it raised on another rank), else None."""
        return None

    def before_step(self) -> None:
        """In ``step()``, after ``synchronize()``."""

    def after_step(self) -> None:
        """After the step's updates."""

    def all_ranks(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (a step is skipped by all or none)."""
        return ok

    # ------------------------------------------------------------- checkpoints
    def full_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        """The optimizer's ``state_dict`` with every rank's entries."""
        return sd

    def local_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        """A full ``state_dict`` cut to what this rank keeps."""
        return sd


LOCAL = ShardingHooks()  # one process: EVON's hooks while ``optimizer.sharding`` is None


def refuse_unprepared_processes() -> None:
    """Raise in a multi-process job whose EVON has no ``gradient_reducer``: DDP would average the
    gradients before EVON forms each rank's Hessian estimate from its own."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "EVON is running in a multi-process job but was not prepared for it: call "
            "`hf_evon.prepare_distributed(model, optimizer)` after accelerator.prepare(); "
            "otherwise DDP averages gradients before EVON can form each rank's Hessian estimate"
        )
