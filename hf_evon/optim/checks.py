"""What a valid hyperparameter value is: the type tests, the modes, and the one place errors are raised."""

from __future__ import annotations

import math
import numbers
from enum import Enum
from typing import Any

__all__ = [
    "ALGORITHMS",
    "CLIP_MODES",
    "NONFINITE_MODES",
    "Algorithm",
    "Clip",
    "NonFinite",
    "betas_ok",
    "finite",
    "is_int",
    "is_real",
    "mode_value",
    "require",
]


class Algorithm(str, Enum):
    """What trains a parameter group."""

    EVON = "evon"
    ADAMW = "adamw"


class Clip(str, Enum):
    """EVON's update clipping (``EVON``'s ``clip``)."""

    NONE = "none"  # the pure algorithm: the Newton step as it is
    ELEMENT = "element"  # |Δ_ij| ≤ radius
    SPECTRAL = "spectral"  # singular values ≤ radius
    WHITEN = "whiten"  # Newton–Schulz orthogonalisation (Muon)
    WHITEN_RMS = "whiten_rms"  # Newton–Schulz, scaled to entry RMS radius


class NonFinite(str, Enum):
    """What ``EVON.step`` does on a NaN/inf gradient."""

    SKIP = "skip"  # warn and leave everything untouched
    RAISE = "raise"  # raise NonFiniteGradientError


# the modes as plain strings: what param groups and state dicts hold
ALGORITHMS = tuple(m.value for m in Algorithm)
CLIP_MODES = tuple(m.value for m in Clip)
NONFINITE_MODES = tuple(m.value for m in NonFinite)


def mode_value(value: Any) -> Any:
    """A mode as the plain string groups store (an Enum member becomes its value; anything
    else is returned as is, for validation to name)."""
    return value.value if isinstance(value, Enum) else value


def is_real(x: Any) -> bool:
    """A real number (Python or NumPy scalar); not a bool, a string or None."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_int(x: Any) -> bool:
    """An integer (Python or NumPy scalar); not a bool, a float or a string."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def finite(x: Any) -> bool:
    """A real number that is not NaN or infinite."""
    return is_real(x) and math.isfinite(x)


def betas_ok(betas: Any) -> bool:
    """A pair (tuple or list) of numbers in [0, 1)."""
    return (
        isinstance(betas, tuple | list)
        and len(betas) == 2
        and all(is_real(b) and 0.0 <= b < 1.0 for b in betas)
    )


def require(name: str, value: Any, ok: bool, rule: str) -> None:
    """The one place argument errors are raised: the message names the argument and its rule."""
    if not ok:
        raise ValueError(f"Invalid {name}: {value!r} (must be {rule})")
