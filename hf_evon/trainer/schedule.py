"""The learning-rate schedule of the EVON trainers, in the units of ``learning_rate`` (AdamW's rate).

EVON holds its α as ``optimizer.defaults["lr"]``, where ``Trainer`` looks for "the" learning rate:

* ``create_scheduler``: transformers reads a schedule's absolute rates (``lr_scheduler_kwargs``'
  ``min_lr`` of the ``cosine_*_with_min_lr`` schedules, ``polynomial``'s ``lr_end``) against
  ``optimizer.defaults["lr"]``. While the schedule is built that is the user's rate
  (:func:`user_rate`), so such a rate means what it means under ``Trainer``: AdamW's rate reaches
  it, and every group (α too) keeps its ratio to AdamW's.
"""

from typing import Any

import torch

__all__ = ["ScheduleMixin", "user_rate"]


def user_rate(groups: list[dict[str, Any]], learning_rate: float) -> float:
    """The rate the user gave for AdamW: the AdamW group's as configured (``initial_lr`` once a schedule
    set it; ``evon_adamw_learning_rate`` or ``learning_rate``), ``learning_rate`` without an AdamW group."""
    adamw = next((g for g in groups if g["algorithm"] == "adamw"), None)
    return learning_rate if adamw is None else adamw.get("initial_lr", adamw["lr"])


class ScheduleMixin:
    """``create_scheduler`` of :class:`~hf_evon.trainer.EVONTrainerMixin` (module docstring)."""

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The subclass's scheduler, built while ``optimizer.defaults["lr"]`` is the user's rate."""
        evon = self.evon_optimizer
        other = optimizer is not None and optimizer.defaults is not getattr(evon, "defaults", None)
        if self.lr_scheduler is not None or evon is None or other:  # built already, or not EVON's
            return super().create_scheduler(num_training_steps, optimizer)
        alpha = evon.defaults["lr"]
        evon.defaults["lr"] = user_rate(evon.param_groups, self.args.learning_rate)
        try:
            return super().create_scheduler(num_training_steps, optimizer)
        finally:
            evon.defaults["lr"] = alpha
