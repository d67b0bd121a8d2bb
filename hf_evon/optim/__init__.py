"""The EVON optimizer, its batched linear algebra and the parameter split."""

from hf_evon.optim.evon import EVON, NonFiniteGradientError, unwrap_optimizer
from hf_evon.optim.grouping import build_optimizer, build_param_groups, describe_param_groups
from hf_evon.optim.handle import EVONHandle  # also gives accelerate's wrapper EVON's API
from hf_evon.optim.recipes import RECIPES

__all__ = [
    "EVON",
    "EVONHandle",
    "RECIPES",
    "NonFiniteGradientError",
    "build_optimizer",
    "build_param_groups",
    "describe_param_groups",
    "unwrap_optimizer",
]
