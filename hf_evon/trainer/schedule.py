"""The learning-rate schedule of the EVON trainers, in the units of ``learning_rate`` (AdamW's rate).

EVON holds its α as the first parameter group's rate and as ``optimizer.defaults["lr"]``, where
``Trainer`` looks for "the" learning rate. Two places read it there:

* ``create_scheduler``: transformers reads a schedule's absolute rates (``lr_scheduler_kwargs``'
  ``min_lr`` of the ``cosine_*_with_min_lr`` schedules, ``polynomial``'s ``lr_end``) against
  ``optimizer.defaults["lr"]``. While the schedule is built that is the user's rate
  (:func:`user_rate`), so such a rate means what it means under ``Trainer``: AdamW's rate reaches
  it, and every group (α too) keeps its ratio to AdamW's. The bounds of the plateau schedules
  (``reduce_lr_on_plateau``'s ``min_lr``, ``greedy``'s ``min_lr``/``max_lr``), one number for every
  group, become each group's at that ratio (:data:`GROUP_BOUNDS`), their defaults (greedy's 1e-3 and
  1.0) where none is given.
* the logged ``learning_rate``: ``Trainer`` logs the first group's rate as the step used it (read
  before its scheduler steps). The EVON trainers log the user's rate as the step used it, and α as
  ``evon/learning_rate`` (:meth:`ScheduleMixin._rate_logs`), both recorded at ``on_optimizer_step``.
"""

import inspect
from numbers import Real
from typing import Any

import torch
from transformers import TrainerCallback, optimization

from hf_evon.optim.rates import configured_rate, rate_copy, scheduler_base

__all__ = ["GROUP_BOUNDS", "ScheduleMixin", "UsedRates", "default_bounds", "user_rate"]

# schedules whose kwargs bound each group's rate (a number: the same bound for every group)
GROUP_BOUNDS = {"reduce_lr_on_plateau": ("min_lr",), "greedy": ("min_lr", "max_lr")}


def default_bounds(kind: str) -> dict[str, float]:
    """The bounds of :data:`GROUP_BOUNDS` that schedule ``kind`` applies where its kwargs give none:
    its constructor's defaults (one number for every group, in the units of ``learning_rate``)."""
    scheduler = {"reduce_lr_on_plateau": torch.optim.lr_scheduler.ReduceLROnPlateau}.get(
        kind, getattr(optimization, "GreedyLR", None) if kind == "greedy" else None
    )
    if scheduler is None:
        return {}
    parameters = inspect.signature(scheduler).parameters
    found = {key: parameters[key].default for key in GROUP_BOUNDS[kind] if key in parameters}
    return {key: value for key, value in found.items() if type(value) in (int, float)}


def user_rate(groups: list[dict[str, Any]], learning_rate: float) -> float:
    """The rate the user gave for AdamW: the AdamW group's as configured (``initial_lr`` once a schedule
    set it; ``evon_adamw_learning_rate`` or ``learning_rate``), ``learning_rate`` without an AdamW group."""
    adamw = next((g for g in groups if g["algorithm"] == "adamw"), None)
    return learning_rate if adamw is None else scheduler_base(adamw)


class UsedRates(TrainerCallback):
    """``on_optimizer_step`` (after the step, before the scheduler's): each group's rate as the step
    used it."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._evon_used_rates = None  # another optimizer's (a model_init run), or the last train()'s

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = self.trainer.evon_optimizer
        # a tensor rate (torch's schedulers set it in place) is copied on its device: no host sync per step
        rates = None if optimizer is None else [rate_copy(g["lr"]) for g in optimizer.param_groups]
        self.trainer._evon_used_rates = rates


def _configured_rates_recorded(evon: Any, scheduler: Any) -> Any:
    """``scheduler``, each of ``evon``'s groups holding its configured rate as ``initial_lr``, as torch's
    schedulers record it but the plateau schedules do not: the key a resume's settings are compared by,
    and the mark of a scheduled rate (the posterior records a ``final_lr``). EVON's own record, the rate
    as built, is ``configured_lr`` (:mod:`hf_evon.optim.rates`: both records' roles)."""
    for group in evon.param_groups:
        if "initial_lr" not in group:  # a copy: a tensor rate is set in place as the schedule goes
            group["initial_lr"] = rate_copy(group["lr"])
    return scheduler


def _refuse_another_optimizers(scheduler: Any, evon: Any) -> None:
    """Refuse the user's ``scheduler`` where it steps another optimizer than ``evon``: EVON's rates would
    stay at their start (``optimizers=(None, scheduler)`` can only hold a scheduler of another optimizer)."""
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler
    stepped = getattr(inner, "optimizer", None)
    if stepped is None or stepped is evon or stepped.defaults is evon.defaults:
        return
    raise ValueError(
        f"optimizers=(..., {type(inner).__name__}): the scheduler steps another optimizer ({type(stepped).__name__}), "
        "not the trainer's EVON, whose rates would stay at their start. Build it on the EVON you pass beside it: "
        "evon = hf_evon.build_optimizer(model, ...); optimizers=(evon, scheduler_of(evon)); or pass "
        "optimizers=(None, None) and choose the schedule with lr_scheduler_type / lr_scheduler_kwargs"
    )


class ScheduleMixin:
    """``create_scheduler`` and the logged rates of :class:`~hf_evon.trainer.EVONTrainerMixin`
    (module docstring)."""

    _evon_used_rates: list[float] | None = None  # set by UsedRates

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """The subclass's scheduler, built while ``optimizer.defaults["lr"]`` is the user's rate and a
        plateau schedule's bounds are each group's (the config's kwargs as given again after)."""
        evon = self.evon_optimizer
        other = optimizer is not None and optimizer.defaults is not getattr(evon, "defaults", None)
        if evon is None or other:  # not EVON's
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is not None:  # the user's own (optimizers=(evon, scheduler))
            _refuse_another_optimizers(self.lr_scheduler, evon)
            return _configured_rates_recorded(evon, super().create_scheduler(num_training_steps, optimizer))
        alpha, given = evon.defaults["lr"], self.args.lr_scheduler_kwargs
        # AdamW's group held still (rate 0): the schedule is the user's learning_rate's, which it scales
        rate = user_rate(evon.param_groups, self.args.learning_rate) or self.args.learning_rate
        kind = getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type)
        # a bound not given is the schedule's default, one number too; a list is the user's per group
        stated = {**default_bounds(kind), **(given if isinstance(given, dict) else {})}
        # one number (a NumPy one from a search grid too, not a bool): the user's rate's bound, scaled per group
        numbers = {
            key: float(stated[key])
            for key in GROUP_BOUNDS.get(kind, ())
            if isinstance(stated.get(key), Real) and not isinstance(stated.get(key), bool)
        }
        # AdamW's rate 0 (held still, as Trainer allows) leaves no ratio to keep: each bound is every group's
        ratios = [scheduler_base(g) / rate if rate else 1.0 for g in evon.param_groups] if numbers else []
        bounds = {key: [value * ratio for ratio in ratios] for key, value in numbers.items()}
        evon.defaults["lr"] = rate
        if bounds:
            self.args.lr_scheduler_kwargs = {**(given if isinstance(given, dict) else {}), **bounds}
        try:
            scheduler = super().create_scheduler(num_training_steps, optimizer)
        finally:
            evon.defaults["lr"], self.args.lr_scheduler_kwargs = alpha, given
        return _configured_rates_recorded(evon, scheduler)

    def _rate_logs(self, groups: list[dict[str, Any]]) -> dict[str, float]:
        """``learning_rate`` (the user's: AdamW's group's, or ``learning_rate`` as scheduled without one)
        and ``evon/learning_rate`` (α, the first EVON group's, wherever the user listed it) as the last
        step used them."""
        used = self._evon_used_rates
        used = used if used is not None and len(used) == len(groups) else [g["lr"] for g in groups]
        used = [float(r) for r in used]  # a tensor rate logged as its number, as Trainer logs its own
        first = next(i for i, g in enumerate(groups) if g["algorithm"] == "evon")
        adamw = next((r for g, r in zip(groups, used) if g["algorithm"] == "adamw"), None)
        configured = float(configured_rate(groups[first]) or 0.0)  # OneCycleLR's peak, not its start
        schedule = used[first] / configured if configured else 1.0
        rate = self.args.learning_rate * schedule if adamw is None else adamw
        return {"learning_rate": rate, "evon/learning_rate": used[first]}
