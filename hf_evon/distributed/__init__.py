"""EVON across processes: DDP (``prepare_distributed``), sharded state, FSDP2.

Each module implements :class:`hf_evon.optim.hooks.ShardingHooks` or prepares a wrapped model;
nothing in :mod:`hf_evon.optim` imports from here.
"""

import warnings
from typing import Any

from hf_evon.distributed.ddp import (
    RankAverager,
    UnsupportedParallelismError,
    check_ranks_in_sync,
    check_supported_parallelism,
    prepare_distributed,
)

__all__ = [
    "RankAverager",
    "UnsupportedParallelismError",
    "check_ranks_in_sync",
    "check_supported_parallelism",
    "prepare_distributed",
]


def __getattr__(name: str) -> Any:
    if name == "unwrap_optimizer":  # its home is hf_evon.optim
        warnings.warn(
            "hf_evon.distributed.unwrap_optimizer is hf_evon.optim.unwrap_optimizer: import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        from hf_evon.optim import unwrap_optimizer

        return unwrap_optimizer
    raise AttributeError(f"module 'hf_evon.distributed' has no attribute {name!r}")
