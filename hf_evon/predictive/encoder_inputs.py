"""The inputs BMA decoding and scoring (:mod:`hf_evon.predictive.generation`) hand a model, and their checks.

A causal LM and a text encoder-decoder (T5, BART) read token ids, ``input_ids``. An encoder-decoder
whose encoder reads something else names it in ``main_input_name``: Whisper's ``input_features``
(log-mel frames), a ``VisionEncoderDecoderModel``'s (TrOCR, Donut) ``pixel_values``; ``generate`` takes
it by that name, and so do ``generate_bma`` and ``bma_log_likelihood``. Every sample of the posterior
runs its own encoder on that input (:func:`sampled_encoder_outputs`).
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any

import torch
from torch import nn

from hf_evon.modeling import in_auto_mapping, is_encoder_decoder, model_class, peft_base_model, unwrap_model
from hf_evon.posterior.names import resident_parameters

Tensor = torch.Tensor

TOKENS = "input_ids"


def encoder_input(
    where: str, gen_model: nn.Module, input_ids: Any, given: dict[str, Any], generate: bool = False
) -> tuple[str, Any]:
    """``(name, value)`` of the input ``gen_model`` reads: ``input_ids``, or an encoder-decoder's
    ``main_input_name`` (taken out of ``given``, the call's keywords). ValueError naming the input
    where it is missing or both it and ``input_ids`` are given, and naming ``inputs_embeds`` given
    without token ids. ``generate``: ``given`` are ``generate``'s keywords, whose ``inputs`` (its
    first parameter) is that input too, taken out of ``given``."""
    name = getattr(gen_model, "main_input_name", TOKENS) if is_encoder_decoder(gen_model) else TOKENS
    if generate and given.get("inputs") is not None:
        if input_ids is not None or given.get(name) is not None:
            both = name if given.get(name) is not None else TOKENS
            raise ValueError(f"{where}: inputs and {both} both given; give the model's input once")
        if name == TOKENS:
            input_ids = given.pop("inputs")
        else:
            given[name] = given.pop("inputs")
    if name == TOKENS and input_ids is None and given.get("inputs_embeds") is not None:
        # given embeddings would bypass a covered embedding's samples, and the checks read the ids
        raise ValueError(
            f"{where}: inputs_embeds without input_ids: the samples are run from token ids (a covered "
            "embedding is each sample's own); give input_ids"
        )
    if name == TOKENS:
        return TOKENS, input_ids
    value = given.pop(name, None)
    model = type(gen_model).__name__
    if value is not None and input_ids is not None:
        raise ValueError(f"{where}: {name} and input_ids both given; {model}'s encoder reads {name} alone")
    if value is None:
        got = "input_ids" if input_ids is not None else "neither"
        raise ValueError(f"{where}: {model}'s encoder reads {name}, not token ids: give {name}=...; got {got}")
    return name, value


def warn_given_embeddings(where: str, model: nn.Module, posterior: Any, given: dict[str, Any]) -> None:
    """A warning naming the covered weight of ``model``'s input embedding where ``given`` (the call's
    keywords) holds ``inputs_embeds`` beside the token ids: a decoder-only model's ``generate`` embeds the
    prompt from them, so that weight's samples reach the generated tokens alone."""
    if given.get("inputs_embeds") is None:
        return
    inner = unwrap_model(model)
    try:
        embedding = inner.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # no input embedding to name
        return
    if not isinstance(embedding, nn.Module):
        return
    own = {id(p) for p in embedding.parameters()}
    names = set(getattr(posterior, "names", ()))
    covered = [n for n, p in inner.named_parameters(remove_duplicate=False) if n in names and id(p) in own]
    if covered:
        warnings.warn(
            f"{where}: inputs_embeds given beside input_ids: the prompt is embedded by the caller, so the "
            f"posterior's samples of the input embedding {covered[0]!r} reach the generated tokens, not the "
            "prompt's; give input_ids alone for each sample to embed the prompt with its own embedding",
            UserWarning,
            stacklevel=3,
        )


def _head_of(name: str, suffix: str, mapping: str) -> bool:
    """Whether model class ``name`` is a transformers head of one kind: named ``*{suffix}`` or listed in
    transformers' auto ``mapping`` (read only where transformers is imported: it costs seconds)."""
    if name.endswith(suffix):
        return True
    return "transformers" in sys.modules and in_auto_mapping(name, mapping)


def check_scored_model(where: str, model: nn.Module, labels: Any) -> None:
    """ValueError naming the model class where a score of token sequences does not apply as called: a
    multiple-choice model (ids ``(batch, choices, length)``, one logit per choice), or a token classifier
    without ``labels`` (the default labels are the input ids, and its logits are classes, not ids)."""
    name = model_class(peft_base_model(unwrap_model(model))).__name__
    if _head_of(name, "ForMultipleChoice", "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES"):
        raise ValueError(
            f"{where}: {name} is a multiple-choice model (input_ids (batch, choices, length), one logit per "
            f"choice): not supported; {where} scores (batch, length) sequences of a causal or masked LM, of "
            "an encoder-decoder (labels=) or of a token classifier (labels=)"
        )
    if labels is None and _head_of(name, "ForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"):
        raise ValueError(
            f"{where}: {name} is a token classifier, its logits are classes, not token ids: give labels= "
            "(batch, length) class ids, -100 where a token is not scored; labels is None"
        )


def check_inputs(
    where: str, model: nn.Module, posterior: Any, name: str, value: Any, attention_mask: Any
) -> None:
    """The checks every BMA function runs first, each naming its argument: ``posterior`` an EVON
    posterior of ``model``; ``input_ids`` a non-empty ``(B, T)`` integer tensor of ids in the model's
    vocabulary and ``attention_mask`` None or of its shape; another encoder input (``name``) a
    non-empty floating tensor of at least two dimensions and ``attention_mask`` None or of its ``B``
    rows."""
    if not hasattr(posterior, "check_model"):
        raise TypeError(f"{where}: posterior must be an EVONPosterior; got {type(posterior).__name__}")
    inner = unwrap_model(model)
    taken = inspect.signature(inner.forward).parameters
    if name not in taken and not any(p.kind is p.VAR_KEYWORD for p in taken.values()):
        # a plain module (forward(x) -> logits) would fail inside the sample probe, on torch's message
        raise TypeError(
            f"{where}: {type(inner).__name__}.forward takes no {name}: {where} runs transformers models, "
            f"model({name}=..., return_dict=True).logits; for a plain module average the probabilities of "
            "its passes under `with posterior.sampled(model, seed=s)` for S seeds"
        )
    # accelerate's offload keeps a covered weight out of the model but in its module's forward
    resident_parameters(model, getattr(posterior, "names", ()))
    if name != TOKENS:
        _check_features(where, name, value, attention_mask)
        posterior.check_model(model)
        return
    if not isinstance(value, Tensor) or value.dim() != 2 or value.is_floating_point():
        what = f"{value.dtype} shaped {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{where}: input_ids must be a (batch, length) integer tensor of token ids; got {what}")
    if 0 in value.shape:
        raise ValueError(f"{where}: input_ids is empty (shape {tuple(value.shape)})")
    vocab = getattr(getattr(unwrap_model(model), "config", None), "vocab_size", None)
    low, high = value.aminmax()
    if int(low) < 0 or (isinstance(vocab, int) and int(high) >= vocab):
        raise ValueError(f"{where}: input_ids holds ids from {int(low)} to {int(high)}, outside the model's vocabulary 0..{vocab - 1}")
    if attention_mask is not None and (not isinstance(attention_mask, Tensor) or attention_mask.shape != value.shape):
        what = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"{where}: attention_mask must have input_ids' shape {tuple(value.shape)}; got {what}")
    posterior.check_model(model)


def _check_features(where: str, name: str, value: Any, attention_mask: Any) -> None:
    if not isinstance(value, Tensor) or value.dim() < 2 or not value.is_floating_point():
        what = f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{where}: {name} must be a floating (batch, ...) tensor; got {what}")
    if 0 in value.shape:
        raise ValueError(f"{where}: {name} is empty (shape {tuple(value.shape)})")
    if attention_mask is not None and (
        not isinstance(attention_mask, Tensor) or attention_mask.dim() < 1 or len(attention_mask) != len(value)
    ):
        what = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"{where}: attention_mask must have {name}'s {len(value)} rows; got {what}")


def length(name: str, value: Tensor) -> int:
    """The positions per row the encoder reads, for the cost model of the batched samples: the
    tokens, or a feature input's last dimension (frames, an image's width)."""
    return value.shape[-1] if name != TOKENS else value.shape[1]


def repeated(value: Any, times: int) -> Any:
    """A tensor's rows repeated ``times`` times, whole (sample-major), whatever its dimensions."""
    if not isinstance(value, Tensor) or value.dim() == 0:
        return value
    return value.repeat(times, *([1] * (value.dim() - 1)))


def encoder_keywords(model: nn.Module, config: Any, given: dict[str, Any]) -> dict[str, Any]:
    """The call's keywords (``given``, ``generate``'s) that ``generate`` hands an encoder-decoder's
    encoder beside its input (a ViT's ``interpolate_pos_encoding``): those no generation setting
    (``config``'s fields) and no parameter of ``generate`` claims, the decoder's and the cache's aside,
    that the encoder's forward takes (every one, where it takes ``**kwargs``)."""
    if not is_encoder_decoder(model):
        return {}
    claimed = set(inspect.signature(type(model).generate).parameters) | {"attention_mask", "encoder_outputs"}
    claimed |= {"tokenizer", "assistant_tokenizer", "trust_remote_code"}  # generate takes them out of its kwargs
    taken = set(inspect.signature(model.get_encoder().forward).parameters)
    everything = "kwargs" in taken or "model_kwargs" in taken
    return {
        key: value
        for key, value in given.items()
        if key not in claimed
        and not hasattr(config, key)
        and not key.startswith(("decoder_", "cross_attn", "use_cache", "cache"))
        and (everything or key in taken)
    }


def _rows(value: Any, rows: int, times: int, first: bool = False) -> Any:
    """An encoder keyword's value for ``times`` copies of the call's ``rows`` sequences (sample-major): a
    tensor of ``rows`` rows repeated whole (``first``: its first row alone, repeated); others as given."""
    if not isinstance(value, Tensor) or value.dim() == 0 or len(value) != rows:
        return value
    return repeated(value[:1] if first else value, times)


def sampled_encoder_outputs(
    model: nn.Module,
    name: str,
    value: Tensor,
    attention_mask: Tensor | None,
    num_samples: int,
    config: Any,
    keywords: dict[str, Any] | None = None,
) -> Any:
    """An encoder-decoder model's encoder run on the S samples' weights (``S·B`` rows, sample-major,
    inside ``BatchedSamples``; or ``num_samples=1`` on the sample written into the weights).
    ``model.generate`` would run the encoder once, at the mean; handed these ``encoder_outputs`` it
    skips its own pass, and each sample's decoder attends to its own encoder's states. No mask given:
    none used, as ``generate`` runs an encoder-decoder's encoder. ``config``: the call's effective
    ``GenerationConfig``, whose ``output_attentions`` / ``output_hidden_states`` generate hands its
    encoder as they are. ``keywords``: the call's for the encoder (:func:`encoder_keywords`), each sample's."""
    inputs = {k: _rows(v, len(value), num_samples) for k, v in (keywords or {}).items()}
    inputs.update({name: repeated(value, num_samples), "return_dict": True})
    for key in ("output_attentions", "output_hidden_states"):
        inputs[key] = getattr(config, key, None)
    if attention_mask is not None:
        inputs["attention_mask"] = repeated(attention_mask, num_samples)
    return model.get_encoder()(**inputs)


def probe_inputs(
    name: str, value: Tensor, rows: int, encoder_decoder: bool, keywords: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Inputs of ``rows`` rows, the first row's first position (a feature input's first row whole),
    for a forward that checks the sample axis; only the shapes matter. An encoder-decoder's decoder
    starts from the token (token 0 beside features). ``keywords``: the call's for its encoder
    (:func:`encoder_keywords`), their first row's."""
    extra = {k: _rows(v, len(value), rows, first=True) for k, v in (keywords or {}).items()}
    if name != TOKENS:
        zeros = value.new_zeros((rows, 1), dtype=torch.long)
        return {**extra, name: repeated(value[:1], rows), "decoder_input_ids": zeros}
    tokens = value[:1, :1].repeat(rows, 1)
    return {**extra, TOKENS: tokens, **({"decoder_input_ids": tokens} if encoder_decoder else {})}
