"""Held-out data as the EVON trainers read it repeatedly: checked before training, batched by length.

The calibration scores every example at the mean and under several noise scales, each scale
with several samples, and ``evaluate()``'s BMA metrics take S sampled passes, so a pass over the
split runs up to dozens of times: its batches should pad little. Those NLLs and metrics are sums
over the examples and every pass visits the same batches in the same order, so the order of the
examples is free: sorting them by token count leaves each example's log-probabilities (and the
results) as they are and makes the collator's per-batch padding short. ``evaluate()``'s pass at
the mean (the Trainer's own, whose predictions ``compute_metrics`` reads) and ``predict()`` keep
the dataset's order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sized
from typing import Any

import torch

from hf_evon.predictive.logprobs import count_label_items


def check_calibration_batches(batches: Iterable[Any], vocab_size: int | None, causal_lm: bool) -> None:
    """Raise, naming ``calibration_dataset``, where the calibration would fail after training:
    no batches, no ``labels``, no labelled target, or token ids beyond ``vocab_size`` (another
    tokenizer's)."""
    targets = 0
    for i, batch in enumerate(batches):
        if not isinstance(batch, Mapping) or "labels" not in batch:
            raise ValueError(f"EVONTrainer: calibration_dataset batch {i} has no 'labels'")
        ids = batch.get("input_ids")
        if vocab_size is not None and isinstance(ids, torch.Tensor) and ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(
                f"EVONTrainer: calibration_dataset batch {i} has token id {int(ids.max())}, beyond the model's "
                f"vocabulary ({vocab_size}): tokenized by another tokenizer?"
            )
        targets += int(count_label_items(batch["labels"], causal_lm) or 0)
    if targets == 0:
        raise ValueError(
            "EVONTrainer: calibration_dataset has no labelled target (empty, or every label -100): "
            "calibrate() would fail after training; pass held-out examples with labels"
        )


def _token_count(example: Any) -> int | None:
    ids = example.get("input_ids") if isinstance(example, Mapping) else None
    try:
        return len(ids)
    except TypeError:  # none, or a scalar (a 0-d tensor)
        return None


def length_sorted(dataset: Any) -> Any:
    """``dataset``'s examples ordered by their ``input_ids``' length (a stable sort): a
    ``datasets.Dataset`` through ``select``, another map-style dataset through
    ``torch.utils.data.Subset``. Returned as it is where the examples carry no ``input_ids``,
    where the dataset has no length (iterable) or where the order would not change."""
    if not isinstance(dataset, Sized) or not hasattr(dataset, "__getitem__"):
        return dataset
    column_names = getattr(dataset, "column_names", None)
    if column_names is not None:  # a datasets.Dataset: read the one column, not every example
        if "input_ids" not in column_names:
            return dataset
        lengths = [len(ids) for ids in dataset["input_ids"]]
    else:
        lengths = [_token_count(dataset[i]) for i in range(len(dataset))]
        if any(n is None for n in lengths):
            return dataset
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    if order == list(range(len(lengths))):
        return dataset
    if column_names is not None:
        return dataset.select(order)
    return torch.utils.data.Subset(dataset, order)
