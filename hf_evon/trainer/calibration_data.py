"""Held-out data as the EVON trainers read it repeatedly: checked before training, batched by length.

The calibration scores every example at the mean and under several noise scales, each scale
with several samples, and ``evaluate()``'s BMA metrics take S sampled passes, so a pass over the
split runs up to dozens of times: its batches should pad little. Those NLLs and metrics are sums
over the examples and every pass visits the same batches in the same order, so the order of the
examples is free: sorting them by token count leaves each example's log-probabilities (and the
results) as they are and makes the collator's per-batch padding short (where the collator pads on
the right and no batch is dropped: :func:`length_sorted`). The calibration also cuts
the sorted batches where their lengths spread (:func:`cut_by_length`): the batches of the longest
examples, a split's long tail, otherwise pad most of their rows. ``evaluate()``'s pass at the mean
(the Trainer's own, whose predictions ``compute_metrics`` reads) and ``predict()`` keep the
dataset's order.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from contextlib import contextmanager
from typing import Any

import torch
from accelerate.data_loader import DataLoaderDispatcher

from hf_evon.modeling import (
    decoder_inputs_from_labels,
    is_encoder_decoder,
    model_class,
    peft_base_model,
    unwrap_model,
)
from hf_evon.predictive.held_out import output_logits
from hf_evon.predictive.logprobs import count_label_items, require_class_labels, require_scorable_labels

# What a whole-split loader over an ``IterableDataset`` keeps of accelerate's prepared loader (what
# torch's ``DataLoader`` takes): the batching, the collator (which drops unused columns), the workers.
LOADER_SETTINGS = (
    "batch_size", "drop_last", "collate_fn", "num_workers", "pin_memory", "pin_memory_device", "timeout",
    "worker_init_fn", "multiprocessing_context", "generator", "prefetch_factor", "in_order",
)  # fmt: skip


def whole_split(loader: Any, dataset: Any) -> Any:
    """``loader`` (an uncached one of the Trainer's for ``dataset``, prepared by accelerate) reading the
    whole split on every process: the calibration chooses one scale and temperature from the NLL
    summed over the split, which each rank computes by itself, so under DDP a rank reading only its
    shard (and the padding rows that even out the shards) would choose on its own data, unlike the
    others. accelerate's batch sampler shard becomes a pass-through (one process, as transformers
    makes it for a rank-aware sampler) that does not complete the last batch with the first rows.
    Where accelerate dispatches the batches (rank 0 reads, each rank gets a slice of every batch:
    its default for an ``IterableDataset``), the loader it reads from; where it shards an
    ``IterableDataset`` (``IterableDatasetShard``, or a ``datasets`` stream's own shards), a loader
    with the same settings over ``dataset`` itself. The check before training reads it so too: one
    verdict on every rank, and no batch concatenated across ranks (dispatched batches must have one
    width; a padding collator's need not)."""
    if isinstance(loader, DataLoaderDispatcher):
        return loader.base_dataloader  # the dataset's own batches, none sliced or completed
    sharded = getattr(loader, "dataset", dataset) is not dataset
    if isinstance(dataset, torch.utils.data.IterableDataset) and sharded:
        base = getattr(loader, "base_dataloader", loader)
        taken = inspect.signature(torch.utils.data.DataLoader).parameters
        settings = {k: getattr(base, k) for k in LOADER_SETTINGS if k in taken and hasattr(base, k)}
        return torch.utils.data.DataLoader(dataset, **settings)
    shard = getattr(loader, "batch_sampler", None)
    if getattr(shard, "num_processes", 1) > 1 and hasattr(shard, "process_index"):
        shard.num_processes, shard.process_index, shard.even_batches = 1, 0, False
    return loader


def named_batches(make_loader: Callable[[], Iterable[Any]], name: str) -> Iterator[Any]:
    """The batches of the loader ``make_loader()`` builds; a ValueError, KeyError or TypeError raised
    while it is built or read (the Trainer's column removal, the collator) is raised again naming
    ``name``: a calibration split in another format than the train set the trainer prepared (TRL's
    preference pairs, raw text) fails there with a message that names no dataset."""
    try:
        batches = iter(make_loader())
    except (ValueError, KeyError, TypeError) as err:
        raise _not_batched(name, err) from err
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (ValueError, KeyError, TypeError) as err:
            raise _not_batched(name, err) from err
        yield batch


def _not_batched(name: str, err: Exception) -> ValueError:
    return ValueError(
        f"EVONTrainer: {name} could not be batched by the trainer's data collator ({type(err).__name__}: "
        f"{err}); pass examples as the trainer's train_dataset is once prepared"
    )


def check_calibration_batches(
    batches: Iterable[Any],
    vocab_size: int | None,
    causal_lm: bool,
    classes_of: Callable[[Any, str], int] | None = None,
) -> None:
    """Raise, naming ``calibration_dataset``, where the calibration would fail after training:
    no batches, no ``labels``, floating-point labels (a regression's), no labelled target, token
    ids beyond ``vocab_size`` (another tokenizer's), or, with ``classes_of`` (the first batch
    scored as the calibration will: :func:`~hf_evon.predictive.held_out.held_out_classes`),
    labels that do not align with the logits or lie outside their classes (-1 for "no label")."""
    targets, classes = 0, None
    # reading the batches draws from torch's generator (workers' seeds, a masking collator): kept as it was
    with torch.random.fork_rng(devices=[]):
        for i, batch in enumerate(batches):
            where = f"EVONTrainer: calibration_dataset batch {i}"
            if not isinstance(batch, Mapping) or "labels" not in batch:
                raise ValueError(f"{where} has no 'labels'")
            labels = batch["labels"]
            require_class_labels(labels, where)
            ids = batch.get("input_ids")
            if vocab_size is not None and isinstance(ids, torch.Tensor) and ids.numel() and int(ids.max()) >= vocab_size:
                raise ValueError(
                    f"EVONTrainer: calibration_dataset batch {i} has token id {int(ids.max())}, beyond the model's "
                    f"vocabulary ({vocab_size}): tokenized by another tokenizer?"
                )
            if classes_of is not None and classes is None:
                classes = classes_of(batch, where)
            if classes is not None and isinstance(labels, torch.Tensor):
                scored = labels[..., 1:] if causal_lm else labels  # a causal LM never scores position 0
                require_scorable_labels(scored, classes, f"{where} has")
            targets += int(count_label_items(batch["labels"], causal_lm) or 0)
    if targets == 0:
        raise ValueError(
            "EVONTrainer: calibration_dataset has no labelled target (empty, or every label -100): "
            "calibrate() would fail after training; pass held-out examples with labels"
        )


# transformers' classifier heads whose loss (``ForSequenceClassificationLoss``) sets an unset
# config.problem_type in their first labelled forward: one output, regression; labels neither long nor
# int32 (floats, bools), multi-label
_PROBLEM_SETTING_HEADS = (
    "ForSequenceClassification", "ForImageClassification", "ForAudioClassification", "ForVideoClassification"
)  # fmt: skip


def _first_training_labels(trainer: Any) -> Any:
    """The labels of the train set's first example as the model gets them: from the trainer's data collator's
    batch of it alone (``default_data_collator`` turns a bool ``label`` into a long one), or where the collator
    cannot batch it (columns the Trainer removes first), the example's own. The collator runs with the random
    states restored after it (it may draw, for augmentation or masking)."""
    import random

    import numpy as np

    example = trainer.train_dataset[0]
    keys = (*(trainer.label_names or ["labels"]), "labels", "label", "label_ids")
    states = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            batch = trainer.data_collator([example])
        return next(batch[k] for k in keys if k in batch)
    except Exception:  # the example as the Trainer would not give it to the collator, or no labels there
        return next(example[k] for k in keys if k in example)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])


def require_softmax_training(trainer: Any) -> None:
    """Raise, naming ``calibration_dataset``, where ``trainer.model.config.problem_type`` is None and training
    will set one with no softmax (:data:`_PROBLEM_SETTING_HEADS`), by transformers' rule: ``num_labels`` 1
    (regression), else labels of another dtype than long or int32 (multi-label: floats, bools), as the first
    example of ``train_dataset`` (read where the set is indexable; an iterable set is not read, and its
    calibration is refused after training) is batched. The calibration after training would refuse it."""
    base = peft_base_model(unwrap_model(trainer.model))
    config = getattr(base, "config", None)
    if getattr(config, "problem_type", "") is not None or not model_class(base).__name__.endswith(_PROBLEM_SETTING_HEADS):
        return
    try:  # transformers sets it only where the forward gets labels: not under a loss of its own (TRL's reward)
        dtype = torch.as_tensor(_first_training_labels(trainer)).dtype
    except Exception:  # an iterable or empty set, another example type, no labels, labels torch cannot read
        return
    num_labels = getattr(config, "num_labels", None)
    if num_labels == 1:
        problem, why = "regression", "num_labels is 1"
    elif not (isinstance(num_labels, int) and num_labels > 1 and dtype in (torch.long, torch.int)):
        problem, why = "multi_label_classification", f"train_dataset's labels are {dtype}, not torch.long or torch.int"
    else:
        return
    raise ValueError(
        f"EVONTrainer: calibration_dataset: the model's problem_type {problem!r}, which transformers sets in the "
        f"first training step (config.problem_type is None and {why}), has no class distribution: the calibration "
        "after training scores class labels under the model's softmax; pass no calibration_dataset, or set "
        "config.problem_type='single_label_classification' and train on class indices"
    )


def forward_inputs(model: torch.nn.Module, batch: Any, keep: Iterable[str] = ()) -> Any:
    """``batch`` less the entries that ``model``'s ``forward`` (behind DDP, ``torch.compile`` and PEFT)
    has no parameter for, where it takes no ``**kwargs``; the ``keep`` entries stay (labels the caller
    takes out itself). A custom ``compute_loss`` takes such entries out before its forward (per-example
    weights; the labels of a forward without any), so the Trainer's pass runs, and the EVON trainers'
    own passes (BMA, calibration) must too. Any other batch (or forward) as it is."""
    if not isinstance(batch, Mapping):
        return batch
    names = _forward_names(peft_base_model(unwrap_model(model)))
    if names is None:
        return batch
    taken = names.union(keep)
    return batch if all(k in taken for k in batch) else {k: v for k, v in batch.items() if k in taken}


def scoring_inputs(
    model: torch.nn.Module, batch: Any, label_names: Sequence[str], keep_labels: bool = False
) -> tuple[Any, bool]:
    """The inputs of a forward that only scores ``batch`` (a BMA pass), and whether they hold its labels.

    :func:`forward_inputs`, less the labels (all of ``label_names``) where ``model``'s forward takes
    each as an optional parameter: a transformers model computes its loss from them, which such a
    pass throws away (an LM's: a float copy of its logits and a cross-entropy over every position).
    An encoder-decoder whose batch has no decoder inputs gets those its forward would derive from
    the labels (:func:`~hf_evon.modeling.decoder_inputs_from_labels`), and keeps its labels where
    they cannot be derived so. ``keep_labels``: the labels stay (a forward whose side effects are
    wanted: a classifier sets an unset ``config.problem_type`` from them)."""
    batch = forward_inputs(model, batch)
    if not isinstance(batch, Mapping) or any(batch.get(name) is None for name in label_names):
        return batch, False
    if keep_labels:
        return batch, True
    parameters = _forward_parameters(peft_base_model(unwrap_model(model)))
    if parameters is None:  # no signature to read: the batch as it is
        return batch, True
    optional = {name for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
    if not optional.issuperset(label_names):
        return batch, True
    inputs = {k: v for k, v in batch.items() if k not in label_names}
    if is_encoder_decoder(model) and "decoder_input_ids" not in batch and "decoder_inputs_embeds" not in batch:
        derived = decoder_inputs_from_labels(model, batch["labels"]) if list(label_names) == ["labels"] else {}
        if "decoder_input_ids" not in derived:
            return batch, True
        inputs.update(derived)
    return inputs, False


def forward_logits(
    trainer: Any, model: torch.nn.Module, inputs: dict[str, Any], keep_labels: bool = False
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The model's ``logits``; for an output without (extractive QA) its ``*_logits`` fields in
    order (``start_logits``, ``end_logits``), each a distribution of its own. A tuple output
    (``return_dict=False``): its logits after the loss, as ``Trainer.prediction_step`` reads them.
    The forward computes no loss where it can do without the labels
    (:func:`~hf_evon.trainer.calibration_data.scoring_inputs`, unless ``keep_labels``)."""
    inputs, labelled = scoring_inputs(trainer.model, inputs, trainer.label_names or ["labels"], keep_labels)
    inputs = as_loss_forward(trainer, inputs)
    with torch.no_grad(), trainer.compute_loss_context_manager():
        outputs = model(**inputs)
    fields = output_logits(outputs, labels_given=labelled)
    if fields is None:
        found = f"fields: {list(outputs)}" if isinstance(outputs, dict) else f"a tuple of {len(outputs)}"
        raise ValueError(f"EVONTrainer: BMA averages the model's logits, and its output has none ({found})")
    return fields


def as_loss_forward(trainer: Any, batch: Any) -> Any:
    """``batch`` with the keyword arguments the trainer's loss forward sets on every batch (its
    ``_evon_loss_forward_kwargs``; TRL's SFTTrainer: ``use_cache=False``, under which transformers reads
    a padding-free packed row's ``position_ids`` as one attention block per sequence, and with a cache
    as one sequence), so that EVON's own passes (BMA, calibration) score the contexts the loss scores.
    Any other batch, or a trainer that sets none, as it is."""
    extra = getattr(trainer, "_evon_loss_forward_kwargs", None)
    if not extra or not isinstance(batch, Mapping):
        return batch
    return {**batch, **extra}


def output_field(output: Any, name: str) -> Any:
    """Field ``name`` of a model output (a ``ModelOutput``, a dict or an object), or None."""
    if isinstance(output, dict):
        return output.get(name)
    return getattr(output, name, None)


def scored_field(output: Any, labels: torch.Tensor, causal: bool) -> str | None:
    """The field of a forward's ``output`` the mean metrics read for ``labels``: "logits" (one row per
    label, a classifier's, or one value per label: a multi-label classifier's or a regression's, which
    ``task_of`` then finds no class distribution in), "log_probs" (a causal LM's fused head: the
    shifted labels'), or None."""
    logits = output_field(output, "logits")
    if isinstance(logits, torch.Tensor) and (
        (logits.ndim == labels.ndim + 1 and logits.shape[:-1] == labels.shape)
        or (logits.ndim == 2 and labels.ndim == 1)
        or logits.shape == labels.shape
    ):
        return "logits"
    token_logp = output_field(output, "log_probs") if causal else None
    return "log_probs" if isinstance(token_logp, torch.Tensor) and token_logp.shape == labels[:, 1:].shape else None


# Per model (behind its wrappers): a weak reference to its forward's function and that forward's
# parameters. The BMA passes and the calibration ask for every batch of every pass: one read serves them all.
_FORWARD_PARAMETERS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, Mapping[str, Any] | None]] = (
    weakref.WeakKeyDictionary()
)


def _forward_parameters(model: torch.nn.Module) -> Mapping[str, inspect.Parameter] | None:
    """The parameters of ``model.forward`` (None: no signature to read). Read again only for another
    forward (one set on the instance, say)."""
    forward = model.forward
    function = getattr(forward, "__func__", forward)  # a bound method is made anew at each access
    known = _FORWARD_PARAMETERS.get(model)
    if known is not None and known[0]() is function:
        return known[1]
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        parameters = None
    try:  # a weak reference: a forward that closes over its model must not keep the model alive
        _FORWARD_PARAMETERS[model] = (weakref.ref(function), parameters)
    except TypeError:  # a model or a forward without weak references: read each time
        pass
    return parameters


def _forward_names(model: torch.nn.Module) -> frozenset[str] | None:
    """The parameter names of ``model.forward``; None where it takes ``**kwargs`` or has no signature."""
    parameters = _forward_parameters(model)
    if parameters is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return frozenset(parameters)


def under_labels(batch: Any, label_names: Sequence[str] | None, model: torch.nn.Module | None = None) -> Any:
    """``batch`` with its labels under ``labels`` where the trainer's ``label_names`` name one other
    entry (a model whose ``forward`` calls its labels otherwise; several are refused): the calibration
    reads ``labels`` and passes the rest to the model, which then predicts without computing a loss.
    With ``model``, only the entries its ``forward`` takes, and the labels (:func:`forward_inputs`)."""
    if model is not None:
        batch = forward_inputs(model, batch, ["labels", *(label_names or ())])
    names = list(label_names or ())
    if len(names) > 1 and isinstance(batch, Mapping) and sum(n in batch for n in names) > 1:
        raise ValueError(f"EVONTrainer: the calibration scores one label tensor per batch, and label_names = {names} are several (extractive QA's start and end positions): no class distribution to calibrate")
    if len(names) != 1 or names[0] == "labels" or not isinstance(batch, Mapping) or names[0] not in batch:
        return batch
    return {**{k: v for k, v in batch.items() if k != names[0]}, "labels": batch[names[0]]}


def is_eval_set(dataset: Any, eval_dataset: Any) -> bool:
    """Whether ``dataset`` is the trainer's ``eval_dataset``, or one of a dict of them."""
    sets = eval_dataset.values() if isinstance(eval_dataset, Mapping) else (eval_dataset,)
    return dataset is not None and any(dataset is s for s in sets)


def refuse_eval_set(dataset: Any, name: str, *eval_sets: Any) -> None:
    """Raise, naming ``name``, where ``dataset`` is one of ``eval_sets`` (:func:`is_eval_set`)."""
    if any(is_eval_set(dataset, eval_set) for eval_set in eval_sets):
        raise ValueError(
            f"{name} is the eval_dataset: the sampling scale would be chosen on the examples the BMA metrics "
            "are reported on. Hold out separate examples for calibration"
        )


def _token_count(example: Any) -> int | None:
    ids = example.get("input_ids") if isinstance(example, Mapping) else None
    try:
        return len(ids)
    except TypeError:  # none, or a scalar (a 0-d tensor)
        return None


# Batch values cut along the padded sequence with the attention mask: the token ids and what is
# aligned with them; integer ``labels`` of the same shape too, where they ignore (-100) every padded
# position. Any other value is a per-row tensor, cut by rows only.
SEQUENCE_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "position_ids", "special_tokens_mask"})


def _row_lengths(batch: Any) -> list[int] | None:
    """Each row's token count where ``batch`` can be cut into runs of rows trimmed of their padding:
    a mapping of tensors with a right-padded 2-D ``attention_mask`` (each row's ones before its
    zeros) whose every value has the mask's rows first, a value as long as the mask being one of
    ``SEQUENCE_KEYS`` or token ``labels`` that ignore the padding. None otherwise."""
    if not isinstance(batch, Mapping):
        return None
    mask = batch.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.shape[0] == 0:
        return None
    rows, length = mask.shape
    pad = mask == 0
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.ndim == 0 or value.shape[0] != rows:
            return None
        if value.ndim >= 2 and value.shape[1] == length and key not in SEQUENCE_KEYS:
            token_labels = key == "labels" and value.ndim == 2 and not value.is_floating_point()
            if not (token_labels and bool((value[pad] == -100).all())):
                return None
    lengths = (~pad).sum(1)
    if not bool((~pad == (torch.arange(length, device=mask.device) < lengths[:, None])).all()):
        return None  # left padding (or holes): trimming would move the tokens' positions
    return lengths.tolist()


def _rows(batch: Mapping[str, Any], start: int, end: int, length: int) -> dict[str, Any]:
    """Rows ``start:end`` of ``batch``, its sequence values trimmed to ``length`` columns (views)."""
    full = batch["attention_mask"].shape[1]
    return {
        k: v[start:end, :length] if v.ndim >= 2 and v.shape[1] == full else v[start:end] for k, v in batch.items()
    }


def cut_by_length(batches: list[Any]) -> list[Any]:
    """``batches`` (collated) cut into runs of consecutive rows, each trimmed of the padding none of
    its rows needs, so that a run pads to at most R × L̄ tokens (R the most rows in a batch, L̄ the
    split's mean token count; a run of one row may exceed it). Every example is kept, in order,
    with its tokens, mask and labels; on length-sorted batches (:func:`length_sorted`) only the
    long tail's batches are cut, and no run holds more tokens than the largest batch R rows of the
    mean length. A batch that cannot be cut safely (:func:`_row_lengths`: not a mapping of
    per-row tensors with a right-padded ``attention_mask``) is kept as it is, as is one that would
    neither be cut nor trimmed."""
    lengths = [_row_lengths(b) for b in batches]
    known = [n for rows in lengths if rows for n in rows]
    if not known:
        return list(batches)
    budget = max(len(rows) for rows in lengths if rows) * sum(known) / len(known)
    out: list[Any] = []
    for batch, rows in zip(batches, lengths):
        if not rows:
            out.append(batch)
            continue
        runs, start = [], 0
        while start < len(rows):
            end, longest = start + 1, rows[start]
            while end < len(rows) and (end + 1 - start) * max(longest, rows[end]) <= budget:
                longest, end = max(longest, rows[end]), end + 1
            runs.append((start, end, max(longest, 1)))
            start = end
        if len(runs) == 1 and runs[0][2] == batch["attention_mask"].shape[1]:
            out.append(batch)  # nothing to cut or trim: the batch itself
        else:
            out.extend(_rows(batch, *run) for run in runs)
    return out


def length_sorted(dataset: Any, collator: Any = None, drop_last: bool = False) -> Any:
    """``dataset``'s examples ordered by their ``input_ids``' length (a stable sort): a
    ``datasets.Dataset`` through ``select``, another map-style dataset through
    ``torch.utils.data.Subset``. Returned as it is where the examples carry no ``input_ids``,
    where the dataset is iterable (read in its order, whether or not it has a length: a ``datasets``
    stream, accelerate's ``IterableDatasetShard``) or where the order would not change; and where
    the order changes what is scored: ``drop_last`` (the loader drops the last batch: in the
    dataset's order, other examples), a ``collator`` that pads on the left (a row's padding
    moves its tokens' positions, and with them its log-probabilities) or one that masks at random
    (:func:`masks_at_random`: the BMA passes score the masks the Trainer's pass drew, in its order)."""
    sides = {getattr(collator, "padding_side", None), getattr(getattr(collator, "tokenizer", None), "padding_side", None)}
    if drop_last or "left" in sides or masks_at_random(collator):
        return dataset
    if not isinstance(dataset, Sized) or not hasattr(dataset, "__getitem__"):
        return dataset
    if isinstance(dataset, torch.utils.data.IterableDataset):  # read in its order, even with a length
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
    if pads_left(collator, [dataset[order[0]], dataset[order[-1]]]):  # a function's side, told by its batch
        return dataset
    if column_names is not None:
        return dataset.select(order)
    return torch.utils.data.Subset(dataset, order)


def pads_left(collator: Any, rows: list[Any]) -> bool:
    """Whether ``collator`` pads ``rows`` (examples of unequal length) on the left: its batch's
    ``attention_mask`` opens with a zero in some row. False where it cannot tell (no collator, it
    fails on the rows as given, or its batch has no 2-D mask); torch's generator as it was."""
    if collator is None:
        return False
    try:
        with torch.random.fork_rng(devices=[]):
            batch = collator(rows)
    except Exception:  # noqa: BLE001 - a collator of the Trainer's pruned columns, given the raw rows
        return False
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    return isinstance(mask, torch.Tensor) and mask.ndim == 2 and bool((mask[:, 0] == 0).any())


def masks_at_random(collator: Any) -> bool:
    """Whether ``collator`` draws its batches at random: transformers' masked (``mlm=True``, whole
    word masking) and permutation language modeling collators."""
    return getattr(collator, "mlm", False) is True or hasattr(collator, "plm_probability")


class CollatorDraws:
    """A collator's own random generator (a transformers masking collator's ``seed=``: its ``generator``,
    made at its first batch) as it is now; :meth:`restore` sets it back, to "not made yet" too."""

    def __init__(self, collate: Any) -> None:
        self.owner = getattr(collate, "data_collator", collate)  # the Trainer's column-removing wrapper holds it
        self.held = hasattr(self.owner, "generator")
        self.generator = getattr(self.owner, "generator", None)
        bit = getattr(self.generator, "bit_generator", None)  # NumPy's, for return_tensors="np"
        held_by_torch = isinstance(self.generator, torch.Generator)
        self.state = self.generator.get_state() if held_by_torch else None if bit is None else copy.deepcopy(bit.state)

    def restore(self) -> None:
        if not self.held:
            return
        self.owner.generator = self.generator
        if isinstance(self.generator, torch.Generator):
            self.generator.set_state(self.state)
        elif self.state is not None:
            self.generator.bit_generator.state = copy.deepcopy(self.state)


@contextmanager
def collator_draws_kept(collate: Any) -> Iterator[None]:
    """``collate``'s own draws (:class:`CollatorDraws`) as they were before the block, after it."""
    draws = CollatorDraws(collate)
    try:
        yield
    finally:
        draws.restore()


class _Replay:
    """``loader`` read with torch's CPU generator at ``state`` (None: as it is; where a collator masks
    at random, its workers' seeds too), that generator's state restored after the read: a read of
    the BMA passes leaves the training's draws as they would be without it."""

    def __init__(self, loader: Any, state: torch.Tensor | None = None, draws: CollatorDraws | None = None) -> None:
        self.loader, self.state, self.draws = loader, state, draws

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # the loader's dataset, batch size, ...
        if name == "loader":  # not set yet (a copy being made): no loader to read from
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        after = None if self.draws is None else CollatorDraws(self.draws.owner)  # as the Trainer's read left it
        try:
            with torch.random.fork_rng(devices=[]):
                if self.state is not None:
                    torch.set_rng_state(self.state)
                if self.draws is not None:
                    self.draws.restore()
                yield from self.loader
        finally:
            if after is not None:
                after.restore()


def forked(loader: Any) -> Any:
    """``loader`` read on a fork of torch's CPU generator (its read draws its workers' seed from it)."""
    return _Replay(loader)


def replayed(loader: Any, trainer: Any) -> Callable[[], Any]:
    """A function returning ``loader`` set to read again the batches it reads next (called before that
    read). A shuffled sampler of an eval loader (transformers' ``LengthGroupedSampler``, under
    ``train_sampling_strategy="group_by_length"``) draws its order from its own generator on every
    read, a masked LM's collator its masks from torch's: the BMA passes over the loader would read
    other batches than the Trainer's pass did, which changes what is scored where the batching does
    (left padding moves a row's positions, the last batch dropped is another, other tokens are
    masked). The generators of the loader's samplers and torch's CPU generator are as they are now
    for each read (torch's restored after it). A persistent worker's generator lives in the worker, so
    a masking collator's masks there are not drawn again: the function's ``stale`` is then True and
    it returns a loader of the same split without persistent workers (``trainer``'s), whose every
    read draws the same masks, for the mean pass too."""
    found: dict[int, torch.Generator] = {}
    for owner in (loader, getattr(loader, "base_dataloader", None)):
        batch_sampler = getattr(owner, "batch_sampler", None)
        shard = getattr(batch_sampler, "batch_sampler", None)  # accelerate's BatchSamplerShard over several processes
        for sampler in (getattr(owner, "sampler", None), batch_sampler, *(getattr(b, "sampler", None) for b in (batch_sampler, shard))):
            generator = getattr(sampler, "generator", None)
            if isinstance(generator, torch.Generator):
                found[id(generator)] = generator
    states = [(generator, generator.get_state()) for generator in found.values()]
    torch_state = torch.get_rng_state()
    collate = getattr(loader, "collate_fn", None)  # the Trainer's column-removing wrapper holds the collator
    draws = CollatorDraws(collate)  # a collator's own generator (a masking collator's seed=)
    masking = masks_at_random(getattr(collate, "data_collator", collate))
    stale = masking and getattr(loader, "persistent_workers", False) and getattr(loader, "num_workers", 0) > 0

    def again() -> Any:
        for generator, state in states:
            generator.set_state(state)
        return _Replay(trainer._uncached_eval_dataloader(loader.dataset) if stale else loader, torch_state, draws)

    again.stale = stale  # type: ignore[attr-defined]
    return again
