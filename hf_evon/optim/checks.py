"""What a valid hyperparameter value is: the type tests, the modes, and the one place errors are raised."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import numbers
import os
import sys
from enum import Enum
from typing import Any

__all__ = [
    "ALGORITHMS",
    "CLIP_MODES",
    "HESS_ESTIMATORS",
    "MODE_KEYS",
    "NONFINITE_MODES",
    "STEP_CURVATURES",
    "Algorithm",
    "Clip",
    "HessEstimator",
    "NonFinite",
    "StepCurvature",
    "betas_ok",
    "finite",
    "is_int",
    "is_real",
    "mode_value",
    "outside_stacklevel",
    "python_number",
    "refuse_grad_scaler",
    "refuse_listed_twice",
    "require",
    "uses_fisher",
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


class HessEstimator(str, Enum):
    """How H, the posterior precision's data part, is estimated in the eigenbasis.

    ``FISHER``: the EMA of the squared rotated gradient (the empirical Fisher, a Gauss-Newton
    approximation), non-negative by construction and low-variance at any noise level. ``PRICE``:
    the paper's Stein/Price estimate from the sampled weights' noise, unbiased for the Hessian but
    with a variance that grows as the noise shrinks.
    """

    FISHER = "fisher"
    PRICE = "price"


class StepCurvature(str, Enum):
    """The curvature the step divides by in the eigenbasis.

    ``ENTRY``: each entry's H + δ, the paper's Newton step. ``MATRIX``: the mean of H + δ over the
    matrix, one number per matrix: the step keeps the momentum's direction, and the entries where
    H is near zero (directions the data barely constrains, whose gradient is mostly noise) are not
    amplified; the posterior keeps every entry's H.
    """

    ENTRY = "entry"
    MATRIX = "matrix"


class NonFinite(str, Enum):
    """What ``EVON.step`` does on a NaN/inf gradient."""

    SKIP = "skip"  # warn and leave everything untouched
    RAISE = "raise"  # raise NonFiniteGradientError


# the modes as plain strings: what param groups and state dicts hold
ALGORITHMS = tuple(m.value for m in Algorithm)
CLIP_MODES = tuple(m.value for m in Clip)
NONFINITE_MODES = tuple(m.value for m in NonFinite)
HESS_ESTIMATORS = tuple(m.value for m in HessEstimator)
STEP_CURVATURES = tuple(m.value for m in StepCurvature)
# the group keys whose value is a mode (an Enum's string)
MODE_KEYS = ("algorithm", "clip", "hess_estimator", "step_curvature")


def mode_value(value: Any) -> Any:
    """A mode as the plain string groups store (an Enum member becomes its value; anything
    else is returned as is, for validation to name)."""
    return value.value if isinstance(value, Enum) else value


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)  # found, not imported
    return None if spec is None or spec.origin is None else os.path.dirname(os.path.abspath(spec.origin)) + os.sep


# where a warning's caller is not: hf_evon's files, torch's (its optimizer hooks and no_grad wrap
# step()) and the Hugging Face stack's that call step() for the user (Trainer, accelerate, TRL, PEFT);
# and contextlib's, whose __enter__ runs a context manager (posterior.sampled) for the user's `with`
_LIBRARY_DIRS = tuple(
    d for d in map(_package_dir, ("hf_evon", "torch", "transformers", "accelerate", "trl", "peft")) if d is not None
) + (contextlib.__file__,)


def outside_stacklevel() -> int:
    """The ``stacklevel`` that makes the calling function's warning name the first frame outside
    ``_LIBRARY_DIRS``: the user's line (``opt.step()``, ``trainer.train()``), however many wrappers
    lie between."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def python_number(x: Any) -> Any:
    """``x`` as Python's number where it is NumPy's (the checks accept both; a state dict or a JSON
    file of NumPy numbers needs NumPy to read, and ``torch.load(weights_only=True)`` refuses them);
    anything else as it is. By type: ``np.float64`` is a ``float`` subclass."""
    numpy_number = isinstance(x, numbers.Number) and type(x) not in (bool, int, float, complex)
    return x.item() if numpy_number and hasattr(x, "item") else x


def is_real(x: Any) -> bool:
    """A real number (Python or NumPy scalar); not a bool, a string or None."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_int(x: Any) -> bool:
    """An integer (Python or NumPy scalar); not a bool, a float or a string."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def sample_count(num_samples: Any, where: str = "") -> int:
    """``num_samples`` as an ``int``: an integer >= 1 (NumPy integers too, as ``posterior.draw`` takes;
    not a bool), else a ValueError naming it, after ``where`` (``"calibrate_posterior: "``)."""
    if not is_int(num_samples) or num_samples < 1:
        raise ValueError(f"{where}num_samples must be an integer >= 1; got {num_samples!r}")
    return int(num_samples)


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


def check_flag(value: Any, name: str) -> bool:
    """``value`` where it is True or False, else a TypeError naming ``name``: a string such as "no" would
    read as True."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return value


def require(name: str, value: Any, ok: bool, rule: str) -> None:
    """The one place argument errors are raised: the message names the argument and its rule."""
    if not ok:
        raise ValueError(f"Invalid {name}: {value!r} (must be {rule})")


def refuse_listed_twice(groups: list[dict[str, Any]], placed: bool = True) -> None:
    """Raise, naming the parameter, where one is listed twice, in one group's list or in two: every step
    would update it twice. torch only warns of the first, refuses the second in ``add_param_group``, and
    checks neither in a list edited in place between steps. ``placed``: ``groups`` are the optimizer's, and
    an unnamed parameter is named by its place in them; else (a group being added) by its place in its group."""
    first: dict[int, tuple[int, int]] = {}  # id of a parameter -> where it is first listed (group, index)
    for gi, group in enumerate(groups):
        names = group.get("param_names")
        for i, p in enumerate(group.get("params", ())):
            was = first.setdefault(id(p), (gi, i))[0]
            if first[id(p)] == (gi, i):
                continue
            place = f"param_groups[{gi}]['params'][{i}]" if placed else f"#{i} of its group"
            label = repr(names[i]) if names else place
            where = "twice in its group" if was == gi else f"in param_groups[{was}] and again in param_groups[{gi}]"
            raise ValueError(
                f"EVON: parameter {label} (shape {tuple(p.shape)}) is listed {where}: each step would update it "
                "twice. List it once (to move it to another group, remove it from the list it is in)"
            )


def uses_fisher(group: dict[str, Any]) -> bool:
    """Whether a group's H is the Fisher estimate (a group without the key: the Price one)."""
    ess = group.get("ess")
    return group.get("hess_estimator", "price") == "fisher" and not (
        isinstance(ess, float) and math.isinf(ess)
    )


def refuse_grad_scaler(optimizer: Any) -> None:
    """Raise where ``torch.amp.GradScaler.step`` hands ``optimizer`` its scale (``found_inf``,
    ``grad_scale``: EVON declares ``_step_supports_amp_scaling``), after dropping the step's samples.
    The attributes are removed, not set to None: GradScaler multiplies by a ``grad_scale`` it finds."""
    if getattr(optimizer, "found_inf", None) is None:
        return
    for key in ("found_inf", "grad_scale"):
        vars(optimizer).pop(key, None)
    optimizer.discard_samples()  # the scaled samples must not leak into a later step
    raise NotImplementedError(
        "EVON cannot be stepped by a torch.amp.GradScaler (fp16 loss scaling): its Hessian "
        "estimate G°⊙E is recorded from the scaled gradients at each sample's exit. Train in "
        "bfloat16 autocast (no loss scaling needed) or float32. The state is unchanged; the samples are dropped"
    )
