"""``model.generate`` on the BMA predictive: the forward that runs a call's ``N`` rows as ``S·N``
sample-major rows (the samples of the enclosing ``BatchedSamples``) and returns the averaged
predictive's logits, and the sample-major KV cache that beam search reorders per sample."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hf_evon.modeling import is_encoder_decoder
from hf_evon.predictive.generate_call import seeded_tokens, without_cache_setting
from hf_evon.predictive.logprobs import log_mean_prob, tempered, widened
from hf_evon.predictive.module_forward import instance_forward

Tensor = torch.Tensor


def averaged(logits: Tensor, num_samples: int, posterior: Any) -> tuple[Tensor, Tensor]:
    """``(log p̄, c)`` of sample-major logits ``(S·N, …, V)``: the log of the S samples' averaged
    softmax (of the tempered logits) and their mean log-normaliser ``c``; ``log p̄ + c`` are logits
    on the model's own scale, the mean's to rounding at zero variance."""
    logits = tempered(widened(logits), posterior)
    normalizers = torch.logsumexp(logits, dim=-1, keepdim=True)
    rows = logits.shape[0] // num_samples
    log_mean = log_mean_prob((logits - normalizers).view(num_samples, rows, *logits.shape[1:]))
    return log_mean, normalizers.view(num_samples, rows, *normalizers.shape[1:]).mean(0)


def sample_major_cache(num_samples: int, config: Any) -> Any:
    """A dynamic KV cache of ``S·N`` rows, sample-major, that beam search reorders with its ``N``
    beam indices: row ``s·N + i`` follows row ``i``'s choice in every sample."""
    from transformers import DynamicCache

    class SampleMajorCache(DynamicCache):
        def reorder_cache(self, beam_idx: Tensor) -> None:
            offsets = torch.arange(num_samples, device=beam_idx.device)[:, None] * beam_idx.shape[0]
            super().reorder_cache((beam_idx[None, :] + offsets).reshape(-1))

    return SampleMajorCache(config=config)


@contextlib.contextmanager
def averaging_forward(
    model: nn.Module, num_samples: int, posterior: Any, returned: list[int] | None = None
) -> Iterator[None]:
    """``model``'s forward, for the block, as the BMA predictive's: each call's ``N`` rows run as
    ``S·N`` (sample-major, the samples of the enclosing ``BatchedSamples``) and the logits it returns
    are ``log p̄ + c`` (:func:`averaged`). ``model.generate``'s own decoding (greedy, sampling, beam
    search) then runs on the BMA predictive: ``log_softmax`` of these logits is ``log p̄``. Inputs of
    ``S·N`` rows (the samples' encoder outputs) pass as they are. ``returned``: gets each call's ``N``
    once its forward has returned."""
    forward = model.forward
    signature = inspect.signature(forward)

    @functools.wraps(forward)  # generate reads the forward's signature
    def bma_forward(*args: Any, **kwargs: Any) -> Any:
        if args:  # guidance_scale's processor calls the model with the ids first, by position
            kwargs = {**signature.bind_partial(*args).arguments, **kwargs}
        keys = ("decoder_input_ids", "decoder_inputs_embeds", "input_ids", "inputs_embeds")
        rows = next(kwargs[k].shape[0] for k in keys if kwargs.get(k) is not None)

        def expand(value: Any) -> Any:
            if isinstance(value, Tensor) and value.ndim >= 2 and value.shape[0] == rows:
                return value.repeat(num_samples, *([1] * (value.ndim - 1)))
            return value

        outputs = forward(**{k: expand(v) for k, v in kwargs.items()})
        log_mean, normalizer = averaged(outputs.logits, num_samples, posterior)
        outputs.logits = log_mean + normalizer
        if returned is not None:
            returned.append(rows)
        return outputs

    with instance_forward(model, bma_forward):
        yield


@contextlib.contextmanager
def on_the_predictive(
    gen_model: nn.Module,
    posterior: Any,
    num_samples: int,
    device: torch.device,
    token_seed: int | None,
    returned: list[int] | None = None,
) -> Iterator[Any]:
    """For the block, ``model.generate``'s own decoding (greedy, sampling, beam search) runs on the
    BMA predictive (:func:`averaging_forward`); yields the KV cache to hand it, ``S·B·max(num_beams, num_return_sequences)``
    rows reordered per sample (:func:`sample_major_cache`). ``token_seed``: sampling draws from
    torch's global generator, seeded with it for the block and restored after
    (``torch.random.fork_rng``); unseeded, it draws from (and advances) that generator. ``returned``:
    as :func:`averaging_forward`'s."""
    from transformers import EncoderDecoderCache

    config = gen_model.config.get_text_config(decoder=True)
    cache = sample_major_cache(num_samples, config)
    if is_encoder_decoder(gen_model):
        cache = EncoderDecoderCache(cache, sample_major_cache(num_samples, config))
    with contextlib.ExitStack() as stack:
        stack.enter_context(averaging_forward(gen_model, num_samples, posterior, returned))
        stack.enter_context(without_cache_setting(gen_model))
        stack.enter_context(seeded_tokens(device, token_seed))
        yield cache
