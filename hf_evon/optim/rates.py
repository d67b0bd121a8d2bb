"""A parameter group's rate as configured, beside ``lr``, the rate a schedule has moved it to.

Two records of a group hold it, each written where its writer knows it:

* ``initial_lr``, torch's: an ``LRScheduler`` sets it when built (the rate in use then; OneCycleLR's
  start, ``max_lr / div_factor``, its peak as ``max_lr``), scales it from then on and needs it to resume.
  EVON never pre-sets it (torch's ``setdefault`` would keep it over a rate changed before the scheduler
  is built); the EVON trainers set it for the schedules that set none (the plateau ones), so each of a
  trainer's groups holds it.
* ``configured_lr``, EVON's (:func:`record_configured_rate`): the rate as the group is built, for a group
  no scheduler recorded (a raw EVON without one, or under ``ReduceLROnPlateau``).

:func:`configured_rate` is what each reader of "the rate as configured" reads (the posterior's ``lr``,
the trainers' logged ``learning_rate``). A resumed checkpoint's settings are compared by ``initial_lr``
itself (``hf_evon.trainer.checkpointing``): the key the resumed schedule scales. A schedule about to be
built reads :func:`scheduler_base`: ``initial_lr`` else ``lr`` (not ``configured_lr``), the rate it will scale.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["configured_rate", "rate_copy", "record_configured_rate", "scheduler_base"]


def rate_copy(rate: Any) -> Any:
    """``rate`` as it is now: a tensor rate copied (torch's schedulers set it in place), on its device."""
    return rate.detach().clone() if torch.is_tensor(rate) else rate


def record_configured_rate(group: dict[str, Any]) -> None:
    """``group``'s ``configured_lr``: its ``lr`` as it is built (a copy), where it holds none (a loaded
    or copied group keeps its own)."""
    group.setdefault("configured_lr", rate_copy(group["lr"]))


def scheduler_base(group: dict[str, Any]) -> Any:
    """The rate a scheduler built now scales in ``group``: its ``initial_lr`` where one was recorded,
    else its ``lr`` (torch's ``setdefault``)."""
    return group.get("initial_lr", group["lr"])


def configured_rate(group: dict[str, Any]) -> Any:
    """The rate ``group`` is configured with: OneCycleLR's peak ``max_lr`` (where it set ``initial_lr``,
    its start), else a scheduler's ``initial_lr``, else ``configured_lr``; None where it holds none."""
    if "max_lr" in group and "initial_lr" in group:
        return group["max_lr"]
    return group.get("initial_lr", group.get("configured_lr"))
