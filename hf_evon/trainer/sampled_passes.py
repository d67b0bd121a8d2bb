"""The sampled passes of the EVON trainers' BMA: S posterior samples over an evaluation loader, in chunks.

:func:`sample_passes` runs one pass per seed over a loader's batches and yields, per batch, the
average of what each pass's logits gave (``evaluate()``'s ``eval_bma_*`` metrics,
:mod:`hf_evon.trainer.evaluation`; ``predict(bma=True)``, :mod:`hf_evon.trainer.prediction`). It reads
the loader once, in chunks of batches of at most ``SAMPLE_PASS_CHUNK_BYTES`` (docs/trainer.md#bma-pass-chunks),
and keeps each batch's rows to gather over processes (:func:`gathered_rows`). The batch's labels are
read as ``Trainer.prediction_step`` reads them (:func:`batch_labels`).
"""

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from tqdm.auto import tqdm

from hf_evon.predictive.logprobs import LogMeanExp
from hf_evon.trainer.calibration_data import forward_logits

Tensor = torch.Tensor

__all__ = ["SAMPLE_PASS_CHUNK_BYTES", "batch_labels", "class_labels", "gathered_rows", "sample_passes"]


# ------------------------------------------------------------------------------------------ labels
def batch_labels(trainer: Any, inputs: dict[str, Any]) -> Tensor | tuple[Tensor, ...] | None:
    """The batch's labels as ``Trainer.prediction_step`` finds them: its ``trainer.label_names``
    entries (a tuple where there are several: extractive QA's start and end positions), or its
    ``labels`` where those are none (a forward taking ``**batch``, whose signature names no label:
    the BMA metrics read ``labels`` as ``evaluate()`` does); None where one is missing."""
    names = trainer.label_names or ["labels"]
    if not isinstance(inputs, Mapping) or any(inputs.get(name) is None for name in names):
        return None  # not a Mapping: no labels (TRL's GRPO evaluates lists of prompts)
    return inputs[names[0]] if len(names) == 1 else tuple(inputs[name] for name in names)


def class_labels(trainer: Any, inputs: dict[str, Any]) -> Tensor | None:
    """:func:`batch_labels` where they are one tensor, the labels the posterior metrics score;
    None otherwise (none, or several: extractive QA's start and end positions)."""
    labels = batch_labels(trainer, inputs)
    return labels if isinstance(labels, Tensor) else None


# ------------------------------------------------------------------------------------------ passes
def _progress(trainer: Any, total: int | None, description: str) -> Any:
    disable = bool(trainer.args.disable_tqdm) or not trainer.is_local_process_zero()
    return tqdm(total=total, desc=description, disable=disable, leave=False, dynamic_ncols=True)


# A chunk of batches whose inputs and accumulated averages take at most this many bytes (about:
# sized on its first batch) gets all S passes before the next chunk is read, so a causal LM's
# full-vocabulary averages are never held for a whole set (docs/trainer.md#bma-pass-chunks).
SAMPLE_PASS_CHUNK_BYTES = 1 << 30


def _nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or a dict, tuple or list of them)."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


def gathered_rows(accelerator: Any, values: Tensor, rows: int | None) -> Tensor:
    """A batch's ``values`` gathered over processes, on their device: the first ``rows`` (:func:`_kept_rows`,
    for a batch read earlier), or None: what ``gather_for_metrics`` keeps of the batch the loader stands at."""
    if rows is None:
        return accelerator.gather_for_metrics(values.contiguous())
    return accelerator.gather(values.contiguous())[:rows]


def _kept_rows(trainer: Any, values: Tensor | tuple[Tensor, ...]) -> int:
    """How many rows of this batch, gathered over processes, ``gather_for_metrics`` keeps (it drops
    the last batch's duplicates). Asked while the loader stands at the batch: the answer depends on
    the loader's position, and the batch's values are gathered after later batches are read."""
    first = values[0] if isinstance(values, tuple) else values
    return int(trainer.accelerator.gather_for_metrics(torch.arange(first.shape[0], device=first.device)).shape[0])


def _chunk_size(trainer: Any, batch_bytes: int) -> int:
    """Batches per chunk: as many as fit ``SAMPLE_PASS_CHUNK_BYTES`` at ``batch_bytes`` each, at least
    one; the smallest over processes, so that every process runs the same sample at each forward
    (FSDP gathers each forward's weights from all of them)."""
    size = max(1, SAMPLE_PASS_CHUNK_BYTES // max(batch_bytes, 1))
    accelerator = trainer.accelerator
    if accelerator.num_processes > 1:
        sizes = accelerator.gather(torch.tensor([size], device=accelerator.device))
        size = int(sizes.min())
    return size


def sample_passes(
    trainer: Any,
    dataloader: Any,
    posterior: Any,
    seeds: list[int | None],
    transform: Callable[[Tensor, Tensor | None], Tensor],
    description: str,
    average: Callable[[], Any] = LogMeanExp,
) -> Iterator[tuple[Any, dict[str, Any], int]]:
    """One pass per seed (None: the posterior mean) over ``dataloader``'s batches; yields, per batch,
    its accumulator of ``transform`` of each pass's logits (made by ``average``: ``add``/``value``;
    :class:`LogMeanExp`'s ``value()`` is ``log p̄``, :class:`ValueMean` averages the values
    themselves), the inputs and the batch's gathered rows to keep (:func:`_kept_rows`; gather with
    ``accelerator.gather`` and cut).

    The loader is read once, in chunks of batches (``SAMPLE_PASS_CHUNK_BYTES``); each chunk gets
    the passes of every seed before the next is read, each sample drawn (``posterior.sampled``)
    once per chunk. A seed draws the same weights every time, so the chunks change no number.
    """
    model = trainer._evon_eval_model()
    model.eval()
    try:
        batches = len(dataloader)
    except TypeError:
        batches = None
    loader = iter(dataloader)
    chunk_size: int | None = None

    # a transformers classifier sets an unset config.problem_type (float labels: multi-label) in its first
    # labelled forward, which predict(bma=True) reads: that forward keeps its labels, the others need none
    unset = [getattr(getattr(trainer.model, "config", None), "problem_type", "") is None]

    def forward(inputs: dict[str, Any]) -> Tensor:
        keep = unset[0] and batch_labels(trainer, inputs) is not None
        unset[0] = unset[0] and not keep
        return transform(forward_logits(trainer, model, inputs, keep), class_labels(trainer, inputs))

    with _progress(trainer, None if batches is None else batches * len(seeds), description) as bar:
        raw = next(loader, None)
        while raw is not None:
            chunk: list[dict[str, Any]] = []
            accumulated: list[Any] = []
            rows: list[int] = []
            for p_index, seed in enumerate(seeds):
                sample = contextlib.nullcontext() if seed is None else posterior.sampled(trainer.model, seed=seed)
                with sample:
                    if p_index == 0:  # the first pass reads the chunk
                        while raw is not None and (chunk_size is None or len(chunk) < chunk_size):
                            inputs = trainer._evon_prepared(raw)
                            logp = forward(inputs)
                            accumulated.append(average())
                            accumulated[-1].add(logp)
                            chunk.append(inputs)
                            rows.append(_kept_rows(trainer, logp))
                            bar.update(1)
                            if chunk_size is None:
                                chunk_size = _chunk_size(trainer, _nbytes(inputs) + _nbytes(logp))
                            del logp  # the accumulator's own from here on
                            raw = next(loader, None)
                    else:
                        for index, inputs in enumerate(chunk):
                            accumulated[index].add(forward(inputs))
                            bar.update(1)
            for index, inputs in enumerate(chunk):
                done = accumulated[index]
                accumulated[index] = chunk[index] = None  # type: ignore[call-overload]
                yield done, inputs, rows[index]
                del done  # the caller's alone: one chunk's accumulators alive at a time
