"""PEFT's AdaLoRA in the ``Trainer`` loop: its rank allocation, which PEFT leaves to the training loop.

AdaLoRA allocates its rank budget in ``update_and_allocate(global_step)`` (PEFT's ``AdaLoraModel``),
to be called after each optimizer step, before the gradients are zeroed; ``transformers.Trainer``
never calls it, so an adapter trained without it keeps every rank: ``target_r``, ``tinit``,
``tfinal`` and ``deltaT`` do nothing. :class:`AdaLoraRankAllocation` calls it from
``on_optimizer_step`` (after ``optimizer.step()``, before ``zero_grad``, once per optimizer step
also under gradient accumulation) with ``state.global_step``, the step's index from 0, as PEFT's
loop does. Every ``EVONTrainerMixin`` trainer adds one (:func:`add_rank_allocation`); with any other
``Trainer`` pass ``callbacks=[AdaLoraRankAllocation()]``. It does nothing for other models.
Do not call ``update_and_allocate`` yourself as well: a second call in a step updates AdaLoRA's
importance averages twice.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn
from transformers import TrainerCallback

from hf_evon.modeling import is_peft_model, unwrap_model

__all__ = ["AdaLoraRankAllocation", "add_rank_allocation"]


def adalora_model(model: Any) -> Any:
    """The ``AdaLoraModel`` of ``model`` (a ``PeftModel`` with an AdaLoRA adapter, or one itself, behind
    DDP or ``torch.compile``), else None."""
    if "peft" not in sys.modules or not isinstance(model, nn.Module):  # no AdaLoRA without PEFT
        return None
    from peft.tuners.adalora import AdaLoraModel

    model = unwrap_model(model)
    model = model.base_model if is_peft_model(model) else model
    return model if isinstance(model, AdaLoraModel) else None


class AdaLoraRankAllocation(TrainerCallback):
    """Runs AdaLoRA's rank allocation (``update_and_allocate(state.global_step)``) after every optimizer
    step of a ``Trainer`` whose model has an AdaLoRA adapter; see :mod:`hf_evon.trainer.adalora`."""

    def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        adalora = adalora_model(model)
        if adalora is not None:
            adalora.update_and_allocate(state.global_step)


def add_rank_allocation(trainer: Any) -> None:
    """Add an :class:`AdaLoraRankAllocation` to ``trainer``'s callbacks unless it has one (the user's):
    two would allocate twice a step."""
    if not any(isinstance(c, AdaLoraRankAllocation) for c in trainer.callback_handler.callbacks):
        trainer.add_callback(AdaLoraRankAllocation())
