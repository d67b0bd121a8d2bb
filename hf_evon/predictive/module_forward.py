"""A module's own forward replaced for a block, also under accelerate's hooks.

``add_hook_to_module`` (``dispatch_model``'s ``AlignDevicesHook`` of a ``device_map``, ``cpu_offload``,
a layerwise-casting hook) keeps the module's own forward as ``module._old_forward`` and sets
``module.forward`` to one that runs the hook's ``pre_forward`` (the input moved to the module's
execution device), then ``_old_forward``, then its ``post_forward`` (the output moved back). A
replacement of ``forward`` would skip the hook; one of ``_old_forward`` runs inside it.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from hf_evon.modeling import has_accelerate_hook

__all__ = ["instance_forward", "own_forward", "replace_forward", "restore_forward"]


def _attribute(module: nn.Module) -> str:
    """The instance attribute holding ``module``'s own forward: ``_old_forward`` under an accelerate hook."""
    return "_old_forward" if has_accelerate_hook(module) and "_old_forward" in module.__dict__ else "forward"


def own_forward(module: nn.Module) -> Any:
    """The forward an instance attribute gives ``module`` in place of its class's (``None``: the class's),
    under an accelerate hook the one the hook runs."""
    return module.__dict__.get(_attribute(module))


def replace_forward(module: nn.Module, forward: Callable[..., Any]) -> tuple[str, Any]:
    """``module`` runs ``forward(module, ...)`` as its own forward (inside its accelerate hook, if it has
    one); returns what :func:`restore_forward` takes to undo it."""
    attr = _attribute(module)
    previous = module.__dict__.get(attr)
    setattr(module, attr, types.MethodType(forward, module))
    return attr, previous


def restore_forward(module: nn.Module, attr: str, previous: Any) -> None:
    """Undo :func:`replace_forward` (``attr``, ``previous``: what it returned)."""
    if previous is None:
        module.__dict__.pop(attr, None)
    else:
        setattr(module, attr, previous)


@contextlib.contextmanager
def instance_forward(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``module.forward`` is ``forward`` (called without ``self``) for the block; what the instance had
    before (its class's forward, or its own) is back after, also when the block raises."""
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous
