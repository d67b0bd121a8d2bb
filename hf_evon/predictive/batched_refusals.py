"""What the batched samples (:mod:`hf_evon.predictive.batched_samples`) refuse, and how they say so.

A refusal is a :class:`BatchedSamplesRefused` (a ``NotImplementedError``) naming the reason and the way
out, the samples one draw at a time, which ``generate_bma`` and ``bma_log_likelihood`` then take.

The batched forwards take the leading axis of a covered module's input as the S·B rows, sample-major,
and split it in S equal blocks. A module fed a data-dependent selection of the rows (a mixture's expert,
fed the tokens its router picks) breaks that: the samples route differently, and wherever the selection
splits evenly into S blocks, rows of one sample would run another's weights. So a covered module inside
a mixture of experts is refused before any forward (:func:`routed_expert`), and during a forward an input
whose leading size is no multiple of S·B (the call's B sequences per sample) is refused
(:func:`sample_major`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from hf_evon.optim.checks import is_int

Tensor = torch.Tensor

# the way out of every refusal of the batched path: each sample written into the weights in turn, which
# any model runs (S forwards per step instead of one batched one)
ONE_DRAW_AT_A_TIME = (
    "sample the model one draw at a time instead: run it inside `with posterior.sampled(model, seed=s)` "
    "for each of S seeds and average the S predicted probabilities"
)


class BatchedSamplesRefused(NotImplementedError):
    """The batched samples cannot run this model exactly; one draw at a time can (:data:`ONE_DRAW_AT_A_TIME`)."""


def refusal(reason: str) -> BatchedSamplesRefused:
    """The error refusing batched BMA (``generate_bma``, ``bma_log_likelihood``) for ``reason``, ending
    with the way out every such refusal names (:data:`ONE_DRAW_AT_A_TIME`)."""
    return BatchedSamplesRefused(f"{reason}; {ONE_DRAW_AT_A_TIME}")


# transformers keeps a mixture's experts in an ``experts`` container (``mlp.experts.expert_0``,
# ``block_sparse_moe.experts.3``, a ``…Experts`` class); its shared experts, and their gates
# (Qwen2-MoE's ``shared_expert_gate``), are fed every row
_EXPERT = re.compile("expert", re.IGNORECASE)
_SHARED_EXPERT = re.compile(r"shared_experts?(_\w+)?", re.IGNORECASE)


def _expert_part(part: str, module: nn.Module) -> bool:
    if _SHARED_EXPERT.fullmatch(part):
        return False
    return bool(_EXPERT.search(part)) or "Expert" in type(module).__name__


def routed_expert(model: nn.Module, owners: dict[nn.Module, dict[str, str]]) -> None:
    """Refuse a covered module (``owners``: each owner's covered attributes and their names) that lies
    in a mixture of experts: itself or a module above it named or typed as an expert (not a shared one)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for path, module in modules.items():
        if module not in owners or not path:
            continue
        parts = path.split(".")
        for i, part in enumerate(parts):
            if _expert_part(part, modules[".".join(parts[: i + 1])]):
                label = next(iter(owners[module].values()))
                raise refusal(
                    f"posterior parameter {label!r} is in a mixture of experts ({path}): an expert is fed the "
                    "rows its router selects, which the samples route differently, so batched BMA would "
                    "run rows of one sample with another's weights"
                )


def require_sample_major(x: Tensor, num_samples: int, sequences: int, name: str) -> None:
    """Refuse ``x`` (a covered module's input, ``name``: its parameter) where its leading size cannot
    be S·B or S·B·tokens (``sequences``: B, the call's sequences per sample)."""
    if x.dim() == 0 or x.shape[0] % (num_samples * sequences):
        raise refusal(
            f"{name}: the batched-sample forward expects a leading batch of S·B rows or S·B·tokens "
            f"(S={num_samples}, B={sequences}), got input of shape {tuple(x.shape)} "
            "(a layer fed a selection of the rows, as a mixture's expert is)"
        )


def sample_major(x: Tensor, num_samples: int, sequences: int, name: str) -> Tensor:
    """``x`` viewed as ``(S, rows per sample, features)``, refused as :func:`require_sample_major` says."""
    require_sample_major(x, num_samples, sequences, name)
    return x.reshape(num_samples, -1, x.shape[-1])


def check_sequences(sequences: Any) -> int:
    """``sequences`` (B, ``None``: 1) checked: an integer >= 1."""
    if sequences is None:
        return 1
    if not is_int(sequences) or sequences < 1:
        raise ValueError(f"sequences must be an integer >= 1; got {sequences!r}")
    return int(sequences)


def check_sample_count(k: Any, num_samples: int) -> int:
    """``k`` of ``BMALogLikelihood.group_loss`` and ``first`` checked: an integer in [1, S] (a float
    would fail inside slicing naming no argument, and ``True`` would run as 1)."""
    if isinstance(k, bool) or not hasattr(k, "__index__"):
        raise TypeError(f"k must be an integer number of samples in [1, {num_samples}]; got {k!r}")
    if not 1 <= k <= num_samples:
        raise ValueError(f"k must be in [1, {num_samples}]; got {k}")
    return int(k)
