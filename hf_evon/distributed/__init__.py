"""EVON across processes: DDP (``prepare_distributed``), sharded state, FSDP2.

Each module implements :class:`hf_evon.optim.hooks.ShardingHooks` or prepares a wrapped model;
nothing in :mod:`hf_evon.optim` imports from here.
"""

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
