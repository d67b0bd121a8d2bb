"""Optimizer wrappers that answer EVON's API: :class:`EVONHandle`, and accelerate's
``AcceleratedOptimizer`` given its lookup when this package is imported (whatever the import path:
``hf_evon``, ``hf_evon.optim`` or ``hf_evon.optim.evon`` all run this package's ``__init__``)."""

from __future__ import annotations

from typing import Any

from hf_evon.optim.evon import unwrap_optimizer

__all__ = ["EVONHandle"]


class EVONHandle:
    """Mixin for optimizer wrappers: attributes the wrapper lacks are the wrapped EVON's.

    Why: accelerate's ``AcceleratedOptimizer`` forwards ``step``/``zero_grad``/``state_dict``
    but not ``sampled_params`` or ``mc_samples``, so users kept two handles.
    :func:`hf_evon.distributed.prepare_distributed` gives the wrapper this mixin (it stays the same
    object, an instance of its own class too); the wrapper's own methods (``step``, which honours
    accelerate's gradient accumulation, ``zero_grad``, ...) are unchanged. A training block inside
    accelerate's accumulation is refused by EVON's own ``sampled_params``, which reads accelerate's
    gradient state (:mod:`hf_evon.optim.gradients`).
    """

    def __getattr__(self, name: str) -> Any:  # only called when normal lookup fails
        missing = AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if name.startswith("__") or name == "optimizer":  # unset during unpickling: no recursion
            raise missing
        try:
            evon = unwrap_optimizer(self)
        except TypeError:
            raise missing from None
        return getattr(evon, name)


def _answer_evons_api_in_accelerate() -> None:
    """The one change hf_evon makes to another library's class: accelerate's AcceleratedOptimizer
    defines no ``__getattr__`` and no hook when ``accelerator.prepare`` wraps an optimizer, so a loop
    written the usual way (``accelerator.prepare(build_optimizer(model))``, then
    ``optimizer.sampled_params``) would meet an AttributeError. With EVONHandle's lookup what the wrapper
    lacks is the EVON's (around another optimizer it stays one); tests/test_distributed.py pins that
    accelerate defines none of its own."""
    try:
        from accelerate.optimizer import AcceleratedOptimizer
    except ImportError:  # pragma: no cover - accelerate is a dependency
        return
    if "__getattr__" not in vars(AcceleratedOptimizer):
        AcceleratedOptimizer.__getattr__ = EVONHandle.__getattr__  # type: ignore[attr-defined]


_answer_evons_api_in_accelerate()
