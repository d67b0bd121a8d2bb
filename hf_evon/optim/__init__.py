"""The EVON optimizer, its batched linear algebra and the parameter split."""

from .evon import EVON, NonFiniteGradientError
from .grouping import build_optimizer, build_param_groups, describe_param_groups
from .recipes import RECIPES

__all__ = [
    "EVON",
    "RECIPES",
    "NonFiniteGradientError",
    "build_optimizer",
    "build_param_groups",
    "describe_param_groups",
]
