"""Adding EVON's posterior metrics to a ``Trainer``'s without replacing the user's, and keeping them
out of ``hyperparameter_search``'s default objective."""

import warnings
from collections.abc import Callable
from typing import Any

from transformers.trainer_utils import default_compute_objective

from hf_evon.optim.checks import outside_stacklevel

__all__ = ["SearchObjectiveMixin", "added_metric_keys", "merge_metrics"]


def added_metric_keys(trainer: Any) -> set[str]:
    """The metric keys EVON's evaluations added to ``trainer``'s (a clashing user's key is not one)."""
    return trainer.__dict__.setdefault("_evon_added_metric_keys", set())


def merge_metrics(metrics: dict[str, float], ours: dict[str, float], added: set[str] | None = None) -> dict[str, float]:
    """Add ``ours`` to ``metrics`` without replacing a key that is already there (the user's); the
    keys added go into ``added``."""
    for key, value in ours.items():
        if key in metrics:
            warnings.warn(
                f"metric {key!r} from compute_metrics clashes with EVON's posterior metric of that name: "
                "the compute_metrics value is kept, EVON's is dropped (rename the key in compute_metrics)",
                UserWarning,
                stacklevel=outside_stacklevel(),  # the user's evaluate(), behind the Trainer's frames
            )
            continue
        metrics[key] = value
        if added is not None:
            added.add(key)
    return metrics


class SearchObjectiveMixin:
    """``hyperparameter_search`` without a ``compute_objective`` scores what the ``Trainer`` alone would:
    transformers' ``default_compute_objective`` (``eval_loss``, or the sum of the ``compute_metrics``
    values) of the metrics less EVON's ``eval_mean_*``/``eval_bma_*``, which it would otherwise sum
    in (accuracies among NLLs). Pass ``compute_objective`` to search on an EVON metric."""

    def hyperparameter_search(
        self,
        hp_space: Callable[..., dict[str, float]] | None = None,
        compute_objective: Callable[[dict[str, float]], float] | None = None,
        n_trials: int = 20,
        direction: str | list[str] = "minimize",
        backend: Any = None,
        hp_name: Callable[..., str] | None = None,
        **kwargs: Any,
    ) -> Any:
        if compute_objective is None:
            ours = added_metric_keys(self)

            def compute_objective(metrics: dict[str, float]) -> float:
                return default_compute_objective({k: v for k, v in metrics.items() if k not in ours})

        search = super().hyperparameter_search  # type: ignore[misc]
        return search(hp_space, compute_objective, n_trials, direction, backend, hp_name, **kwargs)
