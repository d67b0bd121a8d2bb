"""How a batched block applies each covered weight's samples (``BatchedSamples``' ``strategy``, which
``generate_bma`` and ``bma_log_likelihood`` take), and the rows per sample its ``"auto"`` choice weighs."""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = [
    "DECODE_ROW_COST",
    "MIN_FACTORED_ROWS",
    "STRATEGIES",
    "SampleStrategy",
    "checked_strategy",
    "expected_rows",
]


class SampleStrategy(str, Enum):
    """How sample ``s`` of a covered weight ``M`` is applied (:mod:`hf_evon.predictive.batched_samples`).

    ``MATERIALIZE``: per-sample weights ``M + Q_L E_s Q_Rᵀ``, rounded to the weights' dtype as
    ``posterior.sampled`` writes them (the tokens of a loop over the samples, also in bfloat16).
    ``FACTORED``: ``x M + ((x Q_in) E_s) Q_outᵀ``, no per-sample weight formed; its products round
    otherwise (a few bfloat16 steps of the logits in bfloat16). ``AUTO``: on CPU whichever costs fewer
    FLOPs per matrix, on accelerators ``MATERIALIZE``.
    """

    AUTO = "auto"
    MATERIALIZE = "materialize"
    FACTORED = "factored"


STRATEGIES = tuple(m.value for m in SampleStrategy)
# "auto": a decoding step runs the factored matmuls on one row per sample, less efficiently per
# FLOP than the draw's large GEMMs, so it counts as DECODE_ROW_COST rows; below MIN_FACTORED_ROWS
# rows per step (S·B) the extra small matmuls cost more than the draw they save.
# measured: docs/trainer.md#batched-samples-auto
DECODE_ROW_COST = 4
MIN_FACTORED_ROWS = 8


def checked_strategy(strategy: Any, caller: str) -> str | None:
    """``strategy`` (a ``SampleStrategy`` or its string) as its plain string, ``None`` as it is (the
    default); ValueError naming ``caller``'s ``strategy`` argument for anything else."""
    if strategy is None:
        return None
    try:
        return SampleStrategy(strategy).value
    except (ValueError, TypeError):
        raise ValueError(
            f"{caller}: strategy must be one of {STRATEGIES} (or a SampleStrategy); got {strategy!r}"
        ) from None


def expected_rows(batch_size: int, prompt_tokens: int, new_tokens: int = 0) -> int:
    """``rows`` for a call over ``batch_size`` prompts that adds up to ``new_tokens`` tokens."""
    return batch_size * (prompt_tokens + DECODE_ROW_COST * new_tokens)
