"""Adding EVON's posterior metrics to a ``Trainer``'s without replacing the user's."""

import warnings

__all__ = ["merge_metrics"]


def merge_metrics(metrics: dict[str, float], ours: dict[str, float]) -> dict[str, float]:
    """Add ``ours`` to ``metrics`` without replacing a key that is already there (the user's)."""
    for key, value in ours.items():
        if key in metrics:
            warnings.warn(
                f"metric {key!r} from compute_metrics clashes with EVON's posterior metric of that name: "
                "the compute_metrics value is kept, EVON's is dropped (rename the key in compute_metrics)",
                UserWarning,
                stacklevel=3,
            )
            continue
        metrics[key] = value
    return metrics
