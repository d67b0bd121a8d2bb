"""A sample block against accelerate's gradient accumulation, for the prepared optimizer handle
(:class:`hf_evon.distributed.ddp.EVONHandle`): ``accelerator.backward`` divides each loss by K, and
EVON's step divides the gradient by the number of blocks, so a block holds a step's K micro-batches."""

from __future__ import annotations

import functools
from typing import Any

from hf_evon.optim.gradients import mid_accumulation_refusal

__all__ = ["accumulation_checked"]


def accumulation_checked(handle: Any, sampled_params: Any) -> Any:
    """``sampled_params`` refusing a training block while accelerate's accumulation is mid-step
    (:func:`hf_evon.optim.gradients.mid_accumulation_refusal`, which EVON's own block also raises): here
    before the block counts, so its noise stream does not advance."""
    state = handle.__dict__.get("gradient_state")  # accelerate's GradientState (AcceleratedOptimizer)
    if state is None:  # another wrapper: EVON's own method
        return sampled_params

    @functools.wraps(sampled_params)  # its signature and docstring, for help() on the handle
    def checked(train: bool = True) -> Any:
        refusal = mid_accumulation_refusal(state.num_steps, state.sync_gradients) if train is True else None
        if refusal is not None:
            raise RuntimeError(refusal)
        return sampled_params(train)

    return checked
