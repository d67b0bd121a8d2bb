"""Held-out batches as :func:`~hf_evon.predictive.calibration.calibrate_posterior` reads them: each
split into a forward and its labels, the labels checked against the logits, and every labelled
target's log-probability scored at each softmax temperature in one pass over the batches."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import takewhile
from typing import Any

import torch
from torch import nn

from hf_evon.modeling import decoder_inputs_from_labels, is_encoder_decoder
from hf_evon.predictive.logprobs import (
    labelled_row_index,
    require_class_labels,
    require_scorable_labels,
    require_softmax_model,
    shifted,
    unscorable_labels,
)

__all__ = ["held_out_classes", "require_aligned", "scored_pass", "split_batch"]

Tensor = torch.Tensor

# entries of logits scored at a time: a chunk and its scaled copy (at most 2 MiB each) stay in
# cache across the temperatures, where an LM's whole [targets, vocabulary] rows would stream from
# memory once per temperature (docs/results.md#calibration-speed)
_CHUNK_ENTRIES = 1 << 18
# every row's sum holds its maximum's exp(0) = 1, and exp(-80) < 2e-35: V such terms are below
# float64's resolution of it, while an exp that underflows to a subnormal or 0 takes a CPU's slow
# path (an LM's far-off tokens at a low temperature; docs/results.md#calibration-speed)
_EXP_FLOOR = -80.0


def split_batch(batch: Any) -> tuple[Callable[[nn.Module], Any], Tensor]:
    """(call, labels) for a mapping batch with ``labels`` (a dict, or the ``BatchEncoding`` that
    transformers' collators return) or an ``(inputs, labels)`` pair. The labels stay out of the
    forward (no loss to compute), but an encoder-decoder model whose batch has no decoder inputs
    gets them from the labels, as its forward would (``DataCollatorForSeq2Seq`` without ``model=``
    leaves them out)."""
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise ValueError("calibrate_posterior: a dict batch needs a 'labels' entry")
        labels = batch["labels"]
        return _forward((), {k: v for k, v in batch.items() if k != "labels"}, labels), labels
    if isinstance(batch, list | tuple) and len(batch) == 2:
        return _forward((batch[0],), {}, batch[1]), batch[1]
    raise TypeError(
        f"calibrate_posterior: batches must be dicts with 'labels' or (inputs, labels) pairs; got {type(batch).__name__}"
    )


def _forward(args: tuple, inputs: dict[str, Any], labels: Any) -> Callable[[nn.Module], Any]:
    """The model's forward on a batch's inputs (``args`` positional, ``inputs`` by name): with the
    decoder inputs an encoder-decoder model derives from ``labels`` where the batch holds none."""

    def call(m: nn.Module) -> Any:
        if "decoder_input_ids" in inputs or "decoder_inputs_embeds" in inputs or not is_encoder_decoder(m):
            return m(*args, **inputs)
        return m(*args, **inputs, **decoder_inputs_from_labels(m, labels))

    return call


def held_out_classes(model: nn.Module, batch: Any, shift: bool, where: str) -> int:
    """Score ``batch`` at the model's current weights as the calibration will (its forward, the
    alignment of its labels with the logits) and return the logits' number of classes (tokens for
    an LM); raise ValueError naming ``where`` where the calibration would fail: before training,
    not after it (CTC's labels, for one, do not align with its frames)."""
    call, labels = split_batch(batch)
    require_softmax_model(model, where)
    require_class_labels(labels, where)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = _logits(call(model))
    finally:
        model.train(training)
    require_aligned(logits, labels, shift, where)
    return int(logits.shape[-1])


def require_aligned(logits: Tensor, labels: Any, shift: bool, where: str) -> None:
    """Raise, naming ``where``, where ``labels`` do not give one class label per row of ``logits``, or
    where the logits have one class (a sigmoid's single logit, a regression's value)."""
    # a shift needs a sequence axis: (batch,) labels have none to shift along
    shiftable = isinstance(labels, Tensor) and (not shift or (labels.dim() >= 2 and logits.dim() >= 3))
    rows, targets = shifted(logits, labels, shift) if shiftable else (logits, None)
    if targets is None or rows.shape[:-1] != targets.shape:
        raise ValueError(
            f"{where}: labels shaped {tuple(getattr(labels, 'shape', ()))} do not align with the model's logits "
            f"{tuple(logits.shape)}{' (a causal LM: shifted by one)' if shift else ''}: the calibration scores one "
            "class label per row of logits (classification: (batch,); token classification, LMs: (batch, length))"
        )
    if logits.shape[-1] < 2:  # the softmax of one logit is 1: every held-out NLL 0, whatever the scale
        raise ValueError(
            f"{where}: the model's logits {tuple(logits.shape)} have one class: its softmax is 1 whatever the "
            "input. A single logit (a binary classifier's sigmoid, trained with BCEWithLogits) or a regression's "
            "value has no class distribution to calibrate; a binary classifier with two logits (cross-entropy "
            "over classes 0 and 1) has"
        )


def output_logits(output: Any, labels_given: bool = False) -> Tensor | tuple[Tensor, ...] | None:
    """A model output's logits, as ``Trainer.prediction_step`` reads them: ``logits``, else every
    ``*_logits`` field in order (extractive QA's start and end: one distribution each); a tuple
    (``return_dict=False``) after its loss (there where ``labels_given``, or a leading 0-d tensor or
    None: a loss the model computes only from labels),
    its leading tensors shaped as the first (not the hidden states or cache that follow). None:
    the output has none."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, tuple | list):
        if output and (labels_given or output[0] is None or (isinstance(output[0], Tensor) and output[0].ndim == 0)):
            output = output[1:]
        fields = tuple(takewhile(lambda v: isinstance(v, Tensor) and v.shape == output[0].shape, output or ()))
    elif (logits := output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)) is not None:
        return logits
    else:
        items = output.items() if isinstance(output, Mapping) else vars(output).items()
        fields = tuple(v for k, v in items if k.endswith("_logits") and isinstance(v, Tensor))
    return None if not fields else fields[0] if len(fields) == 1 else fields


def _logits(output: Any) -> Tensor:
    logits = output_logits(output)
    if logits is None:
        raise TypeError("calibrate_posterior: the model output has no logits")
    if isinstance(logits, tuple):
        raise TypeError("calibrate_posterior: the model output has several distributions (*_logits); it scores one")
    return logits


def tempered_log_probs(logits: Tensor, labels: Tensor, shift: bool, temperatures: Sequence[float]) -> Tensor:
    """log softmax(logits / T)(label) of every labelled target, per temperature: ``[T, targets]``
    (float64). The scored rows are read by index (never copied out of the logits whole) in chunks of
    about ``_CHUNK_ENTRIES`` entries, each less its rows' maxima (no exp overflows, at any T > 0) and
    scored at every temperature while it is in cache: an LM's [targets, vocabulary] rows cost one
    exp per entry and temperature, and two chunks of memory. The exps run in the logits' precision, float32 at least (float64 logits: float64):
    float32's are the faster (docs/results.md#calibration-speed) and add an error below 1e-6 to each
    log-sum-exp, the size of the float32 logits' own rounding; the label's logit less its row's maximum is taken exactly, in
    float64. A label outside the logits' classes is gathered as class 0 (:func:`scored_pass`
    refuses it): an index out of range would fail here, on a GPU with a device-side assert."""
    row_index, target = labelled_row_index(logits, labels, shift)
    classes = logits.shape[-1]
    flat = logits.reshape(-1, classes)  # a view of contiguous logits: the scored rows are read by index
    count, device = len(row_index), logits.device
    step = max(1, _CHUNK_ENTRIES // max(classes, 1))
    dtype = torch.promote_types(logits.dtype, torch.float32)
    shifted = torch.empty(min(step, count), classes, dtype=dtype, device=device)
    scaled = torch.empty_like(shifted)
    index = target.clamp(0, classes - 1)[:, None]
    # a product by 1/T: division costs more than the exp
    inverse = [1.0 / t for t in temperatures]
    sums = torch.empty(len(temperatures), count, dtype=torch.float64, device=device)
    at_target = torch.empty(count, dtype=torch.float64, device=device)
    for start in range(0, count, step):
        stop = min(start + step, count)
        if flat.dtype == dtype:
            rows = chunk = torch.index_select(flat, 0, row_index[start:stop], out=shifted[: stop - start])
        else:  # bfloat16 would round the differences below: copied to float32 first
            rows = flat.index_select(0, row_index[start:stop])
            chunk = shifted[: stop - start].copy_(rows)
        maxima = rows.amax(-1, keepdim=True)
        at_target[start:stop] = (rows.gather(1, index[start:stop]).double() - maxima.double()).squeeze(1)
        chunk -= maxima.to(dtype)
        for i, scale in enumerate(inverse):
            scaled_chunk = torch.mul(chunk, scale, out=scaled[: len(chunk)]).clamp_min_(_EXP_FLOOR)
            sums[i, start:stop] = scaled_chunk.exp_().sum(-1)
    return at_target * torch.tensor(inverse, dtype=torch.float64, device=device)[:, None] - sums.log()


@torch.no_grad()
def scored_pass(
    model: nn.Module,
    batches: Iterable[Any],
    shift: bool,
    temperatures: Sequence[float],
    check: bool = False,
    first_labels: list[Any] | None = None,
) -> Tensor:
    """log p(label) of every target at each temperature, ``[T, targets]``.

    ``first_labels``: the first pass given it (empty) records each batch's labels there, and every
    later pass must read the same labels in the same batches, or raises ValueError naming the
    first batch that differs: BMA averages each target's log-probabilities over passes, and batches
    in another order (a DataLoader with ``shuffle=True``) would pair one example's with another's.
    One device read per pass.

    ``check`` (the pass at the posterior mean) raises, naming the first such batch, on a label
    outside the logits' classes (-1 for "no label") and on a non-finite log-likelihood: a NaN
    in the held-out data would otherwise make every NLL NaN and the search "choose" the mean and
    the temperature grid's end. The later passes read the same batches. The labels' range is one
    device flag per batch, read with the others after the pass; only where one is raised are that
    batch's labels read, to name the first such label as :func:`~hf_evon.predictive.logprobs.
    require_scorable_labels` does."""
    out: list[Tensor] = []
    labels_ok: list[Tensor] = []
    scored: list[tuple[Tensor, int]] = []  # each batch's scored labels and classes
    record = first_labels is not None and not first_labels
    same: list[Tensor] = []  # per batch: its labels are the first pass's (a device flag)
    for i, (call, labels) in enumerate(map(split_batch, batches)):
        where = f"calibrate_posterior: batch {i} (counting from 0)"
        require_class_labels(labels, where)
        if record:
            first_labels.append(labels)
        elif first_labels is not None:
            same.append(_same_labels(first_labels[i] if i < len(first_labels) else None, labels))
        logits = _logits(call(model))
        if check:  # the trainer checks before training (held_out_classes); a direct caller here
            require_aligned(logits, labels, shift, where)
        out.append(tempered_log_probs(logits, labels, shift, temperatures))
        if check:
            targets = shifted(logits, labels, shift)[1]  # a view of the batch's labels, not a copy
            scored.append((targets, logits.shape[-1]))
            labels_ok.append(~unscorable_labels(targets.to(logits.device), logits.shape[-1]).any())
    if check and out:
        flags = torch.stack([torch.stack(labels_ok), torch.stack([torch.isfinite(x).all() for x in out])])
        labelled, finite = flags.tolist()  # one sync
        if not all(labelled):  # raises: its flag is the same check of the same labels
            first = labelled.index(False)
            require_scorable_labels(*scored[first], f"calibrate_posterior: batch {first} (counting from 0) has")
        if not all(finite):
            raise ValueError(
                f"calibrate_posterior: batch {finite.index(False)} (counting from 0) has a non-finite "
                "log-likelihood at the posterior mean: NaN or inf in its inputs, or a model output that "
                "overflows. Calibration needs finite held-out NLLs; clean or drop that batch"
            )
    if first_labels is not None and not record:
        if len(same) != len(first_labels):
            raise ValueError(
                f"calibrate_posterior: a later pass over the batches gave {len(same)} batches where the first "
                f"gave {len(first_labels)}: every pass must read the same batches"
            )
        flags = torch.stack([flag.to(same[0].device) for flag in same]).tolist() if same else []
        if not all(flags):
            raise ValueError(
                f"calibrate_posterior: batch {flags.index(False)} (counting from 0) holds other labels on a later pass than "
                "on the first: BMA averages each target over passes that read the batches again, which must "
                "come in the same order (a DataLoader with shuffle=True does not: pass shuffle=False or a list)"
            )
    return torch.cat(out, dim=1) if out else torch.zeros(len(temperatures), 0, dtype=torch.float64)


def _same_labels(first: Any, labels: Any) -> Tensor:
    """Whether ``labels`` are ``first`` (a 0-d bool tensor on their device; no sync)."""
    if first is labels:  # a list of batches: the same tensors on every pass
        return torch.tensor(True)
    if first is None or not isinstance(labels, Tensor) or not isinstance(first, Tensor):
        equal = first is not None and torch.equal(torch.as_tensor(first), torch.as_tensor(labels))
        return torch.tensor(equal)
    if first.shape != labels.shape:
        return torch.tensor(False, device=labels.device)
    return (first.to(labels.device) == labels).all()
