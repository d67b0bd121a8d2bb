"""A sample block against accelerate's gradient accumulation, for the prepared optimizer handle
(:class:`hf_evon.distributed.ddp.EVONHandle`): ``accelerator.backward`` divides each loss by K, and
EVON's step divides the gradient by the number of blocks, so a block holds a step's K micro-batches."""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["accumulation_checked"]


def accumulation_checked(handle: Any, sampled_params: Any) -> Any:
    """``sampled_params`` refusing a training block while accelerate's accumulation is mid-step
    (``sync_gradients`` False): inside ``accelerator.accumulate`` before the K-th micro-batch, each
    micro-batch's blocks would count as samples of one step, dividing the gradient by K once more. The
    same state follows a step of fewer than K micro-batches, whose ``optimizer.step()`` and ``zero_grad()``
    accelerate skipped; the flag cannot tell the two apart, so the refusal names both."""
    state = handle.__dict__.get("gradient_state")  # accelerate's GradientState (AcceleratedOptimizer)
    if state is None:  # another wrapper: EVON's own method
        return sampled_params

    @functools.wraps(sampled_params)  # its signature and docstring, for help() on the handle
    def checked(train: bool = True) -> Any:
        if train is True and state.num_steps > 1 and not state.sync_gradients:
            k = state.num_steps
            raise RuntimeError(
                "sampled_params(train=True) entered inside accelerator.accumulate(model) before the last of its "
                f"gradient_accumulation_steps={k} micro-batches, or after a step of fewer than {k} micro-batches "
                "(accelerate skipped that step's optimizer.step() and zero_grad()): put exactly "
                f"{k} micro-batches (each in accelerator.accumulate) inside every sample's block, then step (docs/usage.md)"
            )
        return sampled_params(train)

    return checked
