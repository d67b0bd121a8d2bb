"""PEFT's AdaLoRA in the ``Trainer`` loop: its rank allocation, which PEFT leaves to the training loop.

AdaLoRA allocates its rank budget in ``update_and_allocate(global_step)`` (PEFT's ``AdaLoraModel``),
to be called after each optimizer step, before the gradients are zeroed; ``transformers.Trainer``
never calls it, so an adapter trained without it keeps every rank: ``target_r``, ``tinit``,
``tfinal`` and ``deltaT`` do nothing. :class:`AdaLoraRankAllocation` calls it from
``on_optimizer_step`` (after ``optimizer.step()``, before ``zero_grad``, once per optimizer step
also under gradient accumulation) with ``state.global_step``, the step's index from 0, as PEFT's
loop does. Every ``EVONTrainerMixin`` trainer adds one (:func:`add_rank_allocation`); with any other
``Trainer`` pass ``callbacks=[AdaLoraRankAllocation()]``. It does nothing for other models. A run
resumed after the final allocation gets its ``rank_pattern`` back from the checkpoint's zeros
(:func:`kept_ranks`); one resumed before it, or at it, starts AdaLoRA's importance averages afresh (PEFT
keeps them in no file). A best checkpoint loaded at the end of training (``load_best_model_at_end``) is
loaded with every rank (:func:`every_rank_loaded`).
Do not call ``update_and_allocate`` yourself as well: a second call in a step updates AdaLoRA's
importance averages twice.

PEFT's ``save_pretrained`` keeps only the ranks a ``rank_pattern`` keeps, where an EVON posterior covers
every rank (a Kronecker-factored Gaussian has no exact form over a subset of rows): the EVON trainers
save an AdaLoRA adapter with every rank, the pruned ones as the zeros AdaLoRA wrote into ``lora_E``
(:func:`every_rank_saved`), so adapter and posterior reload together; a sample keeps those ranks at 0
(:func:`hf_evon.modeling.pruned_ranks`), and so does every training sample (:func:`pruned_entries`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from hf_evon.modeling import adalora_singular_values, is_peft_model, unwrap_model

__all__ = ["AdaLoraRankAllocation", "adalora_model", "add_rank_allocation", "every_rank_loaded", "every_rank_saved"]
__all__ += ["kept_ranks", "pruned_entries", "zero_pruned"]


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

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        adalora = adalora_model(model)
        if adalora is None:
            return
        adapter = adalora.trainable_adapter_name
        config = adalora.peft_config[adapter]
        if config.rank_pattern is None and state.global_step > config.total_step - config.tfinal:
            # resumed past the final allocation, which masks with the pattern from here on: a checkpoint
            # holds every rank (every_rank_saved), the pruned ones as zeros (until the next step), no pattern
            config.rank_pattern = kept_ranks(adalora, adapter)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        adalora = adalora_model(model)
        if adalora is None:
            return
        config = adalora.peft_config[adalora.trainable_adapter_name]
        if state.global_step == config.total_step - config.tfinal and not adalora.rankallocator.ipt:
            # resumed at the final allocation, which reads the importance averages: they start afresh
            # here, from this step's gradients (PEFT's allocation updates them only before this step)
            adalora.rankallocator.update_ipt(adalora.model)
        adalora.update_and_allocate(state.global_step)


def kept_ranks(adalora: Any, adapter: str) -> dict[str, list[bool]]:
    """AdaLoRA's ``rank_pattern`` of ``adapter`` read from its singular values (``lora_E``): a rank is
    kept where its value is not the 0 the allocation writes; keyed as the allocation keys it."""
    return {
        name: (p.detach() != 0).view(-1).tolist()
        for name, p in adalora.model.named_parameters()
        if f"lora_E.{adapter}" in name
    }


def pruned_entries(model: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each AdaLoRA singular-value tensor (``lora_E``) of ``model`` with the mask of the entries its rank
    allocation pruned (the exact zeros it wrote), read from the mean: [] for any other model. Taken before
    a ``sampled_params`` block, for :func:`zero_pruned` inside it."""
    adalora = adalora_model(model)
    if adalora is None:  # checked first: a cheap test for every other model, at every step
        return []
    return [(p, p.detach() == 0) for _, p in adalora_singular_values(model)]


@torch.no_grad()
def zero_pruned(entries: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put the pruned entries of a sample back to 0 (:func:`pruned_entries`): a pruned rank is off, not
    uncertain, so the forward of a training sample runs without it, as a posterior sample does; the
    block's exit writes back the mean, whose entries there are 0 already."""
    for p, pruned in entries:
        p.masked_fill_(pruned, 0)


def add_rank_allocation(trainer: Any) -> None:
    """Add an :class:`AdaLoraRankAllocation` to ``trainer``'s callbacks unless it has one (the user's):
    two would allocate twice a step."""
    if not any(isinstance(c, AdaLoraRankAllocation) for c in trainer.callback_handler.callbacks):
        trainer.add_callback(AdaLoraRankAllocation())


@contextlib.contextmanager
def every_rank_saved(model: Any) -> Iterator[None]:
    """For the enclosed save, ``model``'s AdaLoRA adapters without a ``rank_pattern``, so PEFT's save keeps
    every rank (the pruned ones as zeros; reloaded, they compute what the kept ranks alone do); each
    pattern is put back afterwards, also on an error, for the rest of training."""
    adalora = adalora_model(model)
    configs = [] if adalora is None else [c for c in adalora.peft_config.values() if c.rank_pattern is not None]
    patterns = [c.rank_pattern for c in configs]
    try:
        for c in configs:
            c.rank_pattern = None
        yield
    finally:
        for c, pattern in zip(configs, patterns, strict=True):
            c.rank_pattern = pattern


@contextlib.contextmanager
def every_rank_loaded(model: Any) -> Iterator[None]:
    """For the enclosed load of a checkpoint :func:`every_rank_saved` wrote, ``model``'s AdaLoRA adapters
    without a ``rank_pattern``: PEFT's load shrinks the modules to a pattern first, and then refuses the
    checkpoint's every rank (a size mismatch). Afterwards each pattern is the loaded ranks' (:func:`kept_ranks`);
    on an error, as before."""
    adalora = adalora_model(model)
    names = [] if adalora is None else [n for n, c in adalora.peft_config.items() if c.rank_pattern is not None]
    with every_rank_saved(model):
        yield
    for name in names:
        adalora.peft_config[name].rank_pattern = kept_ranks(adalora, name)
