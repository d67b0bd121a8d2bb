"""What ``generate_bma`` settles about one ``model.generate`` call beside the samples: how many tokens it can
add, whether decoding can start again one draw at a time after the batched samples refuse the model partway,
the generator its sampling draws from, and the model's cache setting it sets aside."""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hf_evon.modeling import is_encoder_decoder
from hf_evon.predictive.encoder_inputs import TOKENS

Tensor = torch.Tensor

# the call's own objects that generate calls after each forward: they keep what they see, so decoding again
# from the start would show them the first tokens twice
USER_CALLBACKS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn")


def most_new_tokens(
    gen_model: nn.Module, config: Any, name: str, source: Tensor, generation_kwargs: dict
) -> int:
    """The most tokens a ``generate`` call on ``source`` (the input ``name``) can add (at least 1), under
    its effective ``config``: ``max_new_tokens``, else ``max_length`` less the length decoding starts from,
    a causal LM's prompt, an encoder-decoder's decoder ids (given ``decoder_input_ids``, else its start
    token): ``max_length`` bounds the decoder's ids, never the encoder's input."""
    if config.max_new_tokens is not None:
        return max(int(config.max_new_tokens), 1)
    if is_encoder_decoder(gen_model) or name != TOKENS:
        given = generation_kwargs.get("decoder_input_ids")
        start = given.shape[1] if isinstance(given, Tensor) and given.dim() == 2 else 1
    else:
        start = source.shape[1]
    return max(int(config.max_length or 20) - start, 1)


def refuse_a_second_run(error: Exception, generation_kwargs: dict, streamed: bool, stepped: bool) -> None:
    """NotImplementedError, from ``error`` (the batched samples' refusal during decoding), where decoding
    again one draw at a time would show the call's own objects tokens twice: a ``streamer`` given new
    tokens (``streamed``), the :data:`USER_CALLBACKS` given once a forward has returned (``stepped``: generate
    calls them on its logits before the next forward)."""
    seen = [key for key in USER_CALLBACKS if stepped and generation_kwargs.get(key)]
    seen += ["streamer"] if streamed else []
    if seen:
        names = " and ".join(f"{key}=" for key in seen)
        raise NotImplementedError(
            f"generate_bma: {error}. The batched samples met this after {names} had been called on the first "
            f"tokens, which decoding one draw at a time from the start would call again: call it without {names}"
        ) from error


def cache_keyword(model: nn.Module) -> str:
    """The keyword under which ``model``'s forward takes its KV cache: ``cache`` where the forward
    has one (transformers from 5.24), else ``past_key_values`` (before 5.24, whose ``generate``
    rejects ``cache`` as an unused model argument; 5.24's takes ``past_key_values`` with a warning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@contextlib.contextmanager
def seeded_tokens(device: torch.device, token_seed: int | None) -> Iterator[None]:
    """Torch's generator of ``device``, which sampling draws from, seeded with ``token_seed`` for the
    block and restored after (``torch.random.fork_rng``); ``None``: left as it is."""
    if token_seed is None:
        yield
        return
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        # only the generator the decoding draws from: torch.manual_seed would also reseed every
        # GPU's generator for a call on the CPU, and fork_rng restores only the devices named
        if cuda:  # index 0 is a device too: only a device without an index means the current one
            index = torch.cuda.current_device() if device.index is None else device.index
            torch.cuda.default_generators[index].manual_seed(token_seed)
        else:
            torch.default_generator.manual_seed(token_seed)
        yield


@contextlib.contextmanager
def without_cache_setting(model: nn.Module) -> Iterator[None]:
    """``model.generation_config`` without its ``cache_implementation`` for the block (a copy; the
    model's own is put back after): generate fills a given ``generation_config``'s unset fields from
    the model's, and refuses a cache setting beside the cache handed to it."""
    config = getattr(model, "generation_config", None)
    if getattr(config, "cache_implementation", None) is None:
        yield
        return
    model.generation_config = copy.deepcopy(config)
    model.generation_config.cache_implementation = None
    try:
        yield
    finally:
        model.generation_config = config
