"""Bayesian model averaging (BMA) for language models with an EVON posterior: causal LMs and
encoder-decoder models (T5, BART: each sample runs its own encoder too).

``generate_bma`` decodes with the BMA predictive: at every step the next-token
*probabilities* of S weight samples are averaged (log-mean-exp of log-softmax, never a mean
of logits). ``model.generate`` itself decodes (greedy, sampling, beam search; its config,
processors, stopping criteria and outputs), on a forward that returns the predictive's logits
``log p̄ + c`` for every row: ``c``, the samples' mean log-normaliser, puts them on the model's
scale (the mean's own, to rounding, at zero variance), which processors that are not shift-invariant read as
they read the model's. ``bma_log_likelihood`` scores given sequences under the same predictive
(evaluation loss / perplexity).

Speed: the S samples are not S models. They run as one forward of batch ``S·B``
(sample-major) in which only the posterior's matrices have S versions, applied by batched
matmuls (see ``hf_evon.predictive.batched_samples``); each sample has its own rows of one shared KV
cache, reused across steps and reordered with beam search's beams. The weights are drawn once per
call from ``seed`` and kept for the whole sequence. The model's parameters are never written, except
for a model the batched samples refuse: both functions write the same samples into its weights one
at a time (``hf_evon.predictive.sequential_samples``) and put the mean back after every forward.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_evon.modeling import (
    decoder_inputs_from_labels,
    is_causal_lm,
    is_encoder_decoder,
    is_peft_model,
    unwrap_model,
)
from hf_evon.optim.checks import is_int
from hf_evon.optim.noise import derived_seed, resolve_seed
from hf_evon.predictive.batched_refusals import check_sample_count
from hf_evon.predictive.batched_samples import BatchedSamples, BatchedSamplesRefused, refusal
from hf_evon.predictive.bma_forward import averaged, on_the_predictive
from hf_evon.predictive.encoder_inputs import (
    TOKENS,
    check_inputs,
    check_scored_model,
    encoder_input,
    encoder_keywords,
    length,
    probe_inputs,
    repeated,
    sampled_encoder_outputs,
    warn_given_embeddings,
)
from hf_evon.predictive.generate_call import (
    cache_keyword,
    most_new_tokens,
    refuse_a_second_run,
    seeded_tokens,
    without_cache_setting,
)
from hf_evon.predictive.logprobs import (
    IGNORE_INDEX,
    log_mean_prob,
    require_class_labels,
    sample_target_log_probs,
)
from hf_evon.predictive.sample_strategy import SampleStrategy, checked_strategy, expected_rows
from hf_evon.predictive.sequential_samples import SequentialSamples, held_prompt, one_draw_at_a_time

Tensor = torch.Tensor

__all__ = ["BMALogLikelihood", "bma_log_likelihood", "generate_bma"]

# adapter_names: PEFT's batches mixing adapters run sub-batches of rows through each adapter's layers,
# which the samples' batched forward cannot split by sample
_UNSUPPORTED_KWARGS = ("assistant_model", "past_key_values", "cache", "encoder_outputs", "adapter_names")


def _generation_model(model: nn.Module) -> nn.Module:
    """The transformers model whose ``generate``/``forward`` to run: the module behind DDP and
    ``torch.compile`` (which have no ``generate``, and whose names carry a prefix), for PEFT the
    LoRA-injected base."""
    model = unwrap_model(model)
    if is_peft_model(model):
        config = model.active_peft_config if hasattr(model, "active_peft_config") else None
        if config is not None and getattr(config, "is_prompt_learning", False):
            raise refusal("BMA decoding supports LoRA-style PEFT models, not prompt learning")
        return model.get_base_model()
    return model


def _check_sample_axis(
    sampler: BatchedSamples, gen_model: nn.Module, value: Tensor, name: str = TOKENS, keywords: dict | None = None
) -> None:
    """``sampler.check_sample_axis`` on forwards of ``gen_model`` (an encoder-decoder's encoder and
    decoder) on the first row's first token (:func:`probe_inputs`, ``value`` its input ``name``), once
    and twice per sample; position ids given where the forward takes them, as a model's own ``(1, T)``
    ids would reach a covered position embedding as one row; ``keywords``: the call's for the encoder."""
    parameters = inspect.signature(gen_model.forward).parameters
    encoder_decoder = is_encoder_decoder(gen_model)
    for rows in (1, 2):
        inputs = probe_inputs(name, value, sampler.num_samples * rows, encoder_decoder, keywords)
        inputs["use_cache"] = False
        if name == TOKENS and "attention_mask" in parameters:  # a left pad unmasked: transformers warns
            inputs["attention_mask"] = torch.ones_like(inputs[TOKENS])
        if not encoder_decoder and "position_ids" in parameters:
            inputs["position_ids"] = torch.zeros_like(inputs[TOKENS])
        sampler.check_sample_axis(lambda inputs=inputs: gen_model(**inputs, return_dict=True), rows)


def _checked_call_config(gen_model: nn.Module, generation_kwargs: dict[str, Any]) -> Any:
    """The call's effective ``GenerationConfig``, as ``model.generate`` forms it: the given one with
    its unset fields filled from the model's (or the model's), updated with the call's settings;
    ValueError for a decoding mode other than greedy, sampling and beam search (with or without
    sampling)."""
    from transformers.generation import GenerationMode

    given = generation_kwargs.get("generation_config")
    config = copy.deepcopy(given or gen_model.generation_config)
    if given is not None:  # a given config's unset fields: the model's settings
        config.update(**gen_model.generation_config.to_dict(), defaults_only=True)
    config.update(**{k: v for k, v in generation_kwargs.items() if k != "generation_config"})
    mode = config.get_generation_mode()
    modes = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE)
    if mode not in modes:
        raise ValueError(
            f"generate_bma supports greedy decoding, sampling and beam search, not {mode.value} "
            "(penalty_alpha, dola_layers, assistant settings must keep their defaults)"
        )
    return config


@torch.no_grad()
def generate_bma(
    model: nn.Module,
    posterior: Any,
    input_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    num_samples: int = 8,
    seed: int | None = None,
    token_seed: int | None = None,
    strategy: SampleStrategy | str | None = None,
    **generation_kwargs: Any,
) -> Any:
    """Generate with the BMA predictive: next-token probabilities averaged over S samples.

    Args:
        model: a transformers causal LM or encoder-decoder model (T5, BART; each sample runs
            its own encoder), or a PEFT LoRA model of one, holding the posterior mean.
        posterior: an ``EVONPosterior`` over (some of) ``model.named_parameters()``.
        input_ids: ``(B, T)`` prompts, left-padded for batches (as for ``model.generate``); an
            encoder-decoder model's encoder inputs (padded on either side, with ``attention_mask``).
            An encoder that reads no token ids takes its input by the model's name for it instead
            (Whisper's ``input_features=``, a VisionEncoderDecoder's ``pixel_values=``), as ``generate``.
            With ``inputs_embeds=`` too, a covered input embedding's samples miss the prompt (a warning).
        attention_mask: ``(B, T)``; derived from ``pad_token_id`` when omitted, as transformers does.
        num_samples: S, the number of weight samples (drawn once, kept for the whole call).
        seed: makes the call reproducible: seeds the weight draw (sample ``s`` is ``posterior.draw(1, seed + s)``'s,
            the one ``EVONTrainer``'s BMA passes take for ``bma_seed = seed``) and the token sampling of
            ``do_sample=True`` (``seed=None``: fresh weights, torch's global RNG for tokens).
        token_seed: seeds the token sampling alone, in place of ``seed``: the same weight samples with
            another token stream (a batch of prompts each with its own).
        strategy: how the batched samples apply a covered weight's samples, a ``SampleStrategy`` or its
            string: ``"materialize"`` (per-sample weights, rounded as ``posterior.sampled`` writes them:
            a per-sample loop's tokens, also in bfloat16), ``"factored"`` (no per-sample weight formed; its
            products round otherwise), ``"auto"`` (``None``, the default: per matrix by cost on CPU,
            ``"materialize"`` on accelerators).
        **generation_kwargs: anything ``model.generate`` takes for greedy decoding, sampling and
            beam search: ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
            ``repetition_penalty``, ``guidance_scale`` and the other processors, ``eos_token_id``,
            ``pad_token_id``, ``stopping_criteria``, ``logits_processor``, ``prefix_allowed_tokens_fn``,
            ``streamer``, ``generation_config``, ``return_dict_in_generate``, ``output_scores``,
            ``output_logits``, ``stop_strings`` (with ``tokenizer``), ``num_beams``, ``num_return_sequences``, ``length_penalty``,
            ``early_stopping``, ``synced_gpus`` (an FSDP2 model's ranks step together until every
            one is done; transformers sets it for a ``fully_shard``-ed model, and ``Seq2SeqTrainer``
            passes it). Assisted and contrastive decoding are not supported.

    Returns:
        What ``model.generate`` returns, decoded by ``model.generate`` itself on the BMA predictive:
        the ``(B, T + new)`` token ids (an encoder-decoder model's ``(B, 1 + new)`` decoder ids,
        from its decoder start token), or with ``return_dict_in_generate=True`` its output object.
        Its ``logits`` are the predictive's logits ``log p̄ + c`` (``log_softmax`` of them is
        ``log p̄``, the log of the averaged probabilities; ``c`` is the samples' mean log-normaliser,
        ``logsumexp`` of their logits): on the model's scale and the mean's own (to rounding) at zero variance,
        so processors that are not shift-invariant (``repetition_penalty``, length penalties) act
        as in ``model.generate``. ``scores`` are what the processors made of them; beam search's
        ``sequences_scores`` are sums of ``log p̄``. Attentions and hidden states, if requested,
        are per sample (batch ``S·B``, sample-major). Its ``cache`` (``past_key_values``) is the samples'
        own (``S·B`` rows; one draw at a time, sample 0's holding the others'), which continues no call.

    A model the batched samples refuse (covered parameters that are no ``nn.Linear``, ``Conv1D`` or
    ``nn.Embedding`` weight used through its forward: PEFT's AdaLoRA, IA3, LoHa, LoKr and DoRA
    adapters, ``weight_norm``, a scaled word embedding, a mixture's expert; or, during decoding, a layer
    fed a selection of rows: decoding starts again, unless a ``streamer`` got new tokens or a
    ``logits_processor``, ``stopping_criteria`` or ``prefix_allowed_tokens_fn`` of the call has been
    called, which would see the first tokens twice: then NotImplementedError naming them) is decoded with
    the same S samples written into its weights one at a time (``hf_evon.predictive.sequential_samples``),
    each with its own KV cache (and encoder): the tokens of per-sample weights (the factored form's to its
    rounding, ``hf_evon.predictive.batched_samples``), at S forwards per step; the decoder's attentions
    and hidden states are every sample's too, an encoder-decoder's encoder's sample 0's (B rows).
    """
    strategy = checked_strategy(strategy, "generate_bma")
    for key in _UNSUPPORTED_KWARGS:
        if generation_kwargs.get(key) is not None:
            raise ValueError(f"generate_bma does not support {key!r}")
    given_config = generation_kwargs.get("generation_config")
    asked = generation_kwargs.get("cache_implementation", getattr(given_config, "cache_implementation", None))
    # the model's own setting (a Hub config's "static") is overridden; generate takes "hybrid" (Gemma 2's
    # Hub config) as unset, decoding with its dynamic cache
    if asked not in (None, "dynamic", "hybrid"):
        raise ValueError(
            "generate_bma keeps a dynamic KV cache of S·B rows; cache_implementation must be unset"
        )
    gen_model = _generation_model(model)
    name, source = encoder_input("generate_bma", gen_model, input_ids, generation_kwargs, generate=True)
    check_inputs("generate_bma", model, posterior, name, source, attention_mask)
    if not is_encoder_decoder(gen_model):  # an encoder-decoder's generate refuses inputs_embeds beside ids
        warn_given_embeddings("generate_bma", model, posterior, generation_kwargs)
    if not callable(getattr(type(gen_model), "generate", None)):
        raise TypeError(
            f"generate_bma: model ({type(gen_model).__name__}) cannot generate: it has no generate(); "
            "generate_bma decodes causal LMs and encoder-decoder models"
        )
    # do_sample may also come from the model's generation_config; a stream of its own, hashed from the
    # seed as the weight draws' are: torch's CPU generator keeps a seed's low 32 bits, so an affine map
    # of the seed would give seeds 2**32 apart the same tokens
    if token_seed is not None and not is_int(token_seed):  # resolve_seed's refusal would name seed
        raise TypeError(f"generate_bma: token_seed must be an integer (or None); got {token_seed!r}")
    token_seed = seed if token_seed is None else token_seed
    token_seed = None if token_seed is None else derived_seed(resolve_seed(token_seed), "tokens")
    config = _checked_call_config(gen_model, generation_kwargs)
    keywords = encoder_keywords(gen_model, config, generation_kwargs)  # generate hands its encoder
    # the rows per sample generate runs: it expands each prompt to its beams, or when sampling to its
    # num_return_sequences
    per_prompt = max(int(config.num_beams or 1), int(config.num_return_sequences or 1))
    # the most tokens the call can add, for the cost model of the batched samples
    new_tokens = most_new_tokens(gen_model, config, name, source, generation_kwargs)
    rows = expected_rows(len(source) * per_prompt, length(name, source), new_tokens)
    sampler = _entered_batched_samples(
        BatchedSamples(
            model, posterior, num_samples, seed=seed, strategy=strategy, rows=rows,
            batch_size=len(source) * per_prompt, sequences=len(source),
        ),
        gen_model,
        source,
        name,
        keywords,
    )
    if not isinstance(sampler, BatchedSamplesRefused):
        # a refusal during its forwards (a layer fed another selection of rows than the probe's)
        # is answered as one before: the samples one at a time, from scratch, on the call's own kwargs,
        # unless the call's own objects have seen tokens (refuse_a_second_run)
        streamer = held_prompt(generation_kwargs.get("streamer"))
        attempt = {**generation_kwargs, **({"streamer": streamer} if streamer is not None else {})}
        returned: list[int] = []  # the forwards of the attempt that returned
        try:
            if is_encoder_decoder(gen_model):
                attempt["encoder_outputs"] = sampled_encoder_outputs(
                    gen_model, name, source, attention_mask, num_samples, config, keywords
                )
            predictive = on_the_predictive(gen_model, posterior, num_samples, source.device, token_seed, returned)
            with predictive as cache:
                return _generate_cached(gen_model, cache, given_config, {name: source}, attention_mask, attempt)
        except BatchedSamplesRefused as error:
            refuse_a_second_run(error, generation_kwargs, streamer is not None and streamer.streamed, bool(returned))
        finally:
            sampler.__exit__(None, None, None)
    # the S samples the batched path would draw, written into the weights one at a time: its tokens
    combine = lambda logits: torch.add(*averaged(torch.cat(logits), num_samples, posterior))  # noqa: E731
    encoder = None
    if is_encoder_decoder(gen_model):  # each sample's own encoder, on the B rows
        encoder = functools.partial(
            sampled_encoder_outputs, gen_model, name, source, attention_mask, 1, config, keywords
        )
    with (
        one_draw_at_a_time(model, gen_model, posterior, num_samples, seed, combine, encoder) as (cache, encoded),
        without_cache_setting(gen_model),
        seeded_tokens(source.device, token_seed),
    ):
        if encoded is not None:
            generation_kwargs["encoder_outputs"] = encoded
        return _generate_cached(gen_model, cache, given_config, {name: source}, attention_mask, generation_kwargs)


def _entered_batched_samples(
    sampler: BatchedSamples, gen_model: nn.Module, source: Tensor, name: str = TOKENS, keywords: dict | None = None
) -> BatchedSamples | BatchedSamplesRefused:
    """``sampler`` entered, its sample axis checked (:func:`_check_sample_axis` on ``source``, the
    model's input ``name``); or, where the batched path refuses the model, that refusal, the block
    exited (the model as it was)."""
    try:
        sampler.__enter__()
    except BatchedSamplesRefused as error:
        return error
    try:
        _check_sample_axis(sampler, gen_model, source, name, keywords)
    except BaseException as error:
        sampler.__exit__(None, None, None)
        if isinstance(error, BatchedSamplesRefused):
            return error
        raise
    return sampler


def _generate_cached(
    gen_model: nn.Module,
    cache: Any,
    given_config: Any,
    inputs: dict[str, Tensor],
    attention_mask: Tensor | None,
    generation_kwargs: dict[str, Any],
) -> Any:
    """``generate`` of ``gen_model``'s class on ``inputs`` (the encoder input by its name) and
    ``cache``, always cached and by this cache alone."""
    # the class's generate: the instance's may be a wrapper that routes here
    # (EVONSeq2SeqTrainer.predict(bma=True))
    generation_kwargs[cache_keyword(gen_model)] = cache
    # always cached: with use_cache=False (given, or the model's config after gradient
    # checkpointing) generate re-feeds the whole sequence, which this cache would append again;
    # and by this cache alone: transformers refuses a cache beside a cache_implementation
    settings = {"use_cache": True, "cache_implementation": None}
    if given_config is not None:  # in the config: beside it, settings are a deprecated mix
        generation_kwargs["generation_config"] = copy.deepcopy(given_config)
        generation_kwargs["generation_config"].update(**settings)
        for key in settings:  # a keyword beside the config would override it in generate
            generation_kwargs.pop(key, None)
    else:
        generation_kwargs.update(settings)
    return type(gen_model).generate(gen_model, **inputs, attention_mask=attention_mask, **generation_kwargs)


@dataclass
class BMALogLikelihood:
    """Per-token log-likelihoods of sequences under the BMA predictive (and per sample).

    Positions follow the causal-LM convention of transformers: entry ``t`` scores token
    ``t+1`` given tokens ``≤ t``, so tensors have length ``T - 1``; for an encoder-decoder
    model entry ``t`` scores ``labels[:, t]`` (length ``L``, the labels' own), and for a model
    that is neither (a masked LM, a token classifier: ``hf_evon.modeling.is_causal_lm``'s rule)
    ``labels[:, t]`` too (length ``T``), as its own loss scores them.

    Attributes:
        token_log_probs: ``(B, T-1)`` ``log p̄(x_{t+1} | x_{≤t})``, 0 where not scored.
        mask: ``(B, T-1)`` bool, the scored positions (labels ≠ -100).
        sample_token_log_probs: ``(S, B, T-1)`` the same under each sample alone.

    ``loss`` is the mean negative log-likelihood per scored token (what a causal LM's
    ``loss`` is), ``perplexity = exp(loss)``, ``sequence_log_likelihood`` the per-sequence sums.
    With no scored token at all (every label -100) the means are NaN, as the model's own loss
    (0/0), not a perfect loss of 0 and perplexity 1.
    """

    token_log_probs: Tensor
    mask: Tensor
    sample_token_log_probs: Tensor

    @property
    def num_samples(self) -> int:
        return self.sample_token_log_probs.shape[0]

    @property
    def num_tokens(self) -> Tensor:
        """``(B,)`` scored tokens per sequence."""
        return self.mask.sum(-1)

    @property
    def sequence_log_likelihood(self) -> Tensor:
        """``(B,)`` ``Σ_t log p̄``: the log-likelihood of each sequence under the BMA predictive."""
        return (self.token_log_probs * self.mask).sum(-1)

    @property
    def loss(self) -> Tensor:
        """Mean NLL per scored token over the whole batch (a scalar)."""
        return -self.sequence_log_likelihood.sum() / self.mask.sum()

    @property
    def perplexity(self) -> Tensor:
        return torch.exp(self.loss)

    @property
    def sample_losses(self) -> Tensor:
        """``(S,)`` the loss of each sample alone (no averaging)."""
        total = (self.sample_token_log_probs * self.mask).sum((-1, -2))
        return -total / self.mask.sum()

    def group_loss(self, k: int) -> Tensor:
        """Expected BMA loss with ``k`` samples: the mean over the ``S // k`` disjoint groups
        of ``k`` consecutive samples (a less noisy gain-vs-S curve than one group)."""
        k = check_sample_count(k, self.num_samples)
        groups = self.sample_token_log_probs[: (self.num_samples // k) * k]
        groups = groups.reshape(self.num_samples // k, k, *groups.shape[1:])
        nll = -(log_mean_prob(groups, dim=1) * self.mask).sum((-1, -2)) / self.mask.sum()
        return nll.mean()

    def first(self, k: int) -> BMALogLikelihood:
        """The BMA of the first ``k`` samples only (gain-vs-S curves from one call)."""
        k = check_sample_count(k, self.num_samples)
        sub = self.sample_token_log_probs[:k]
        return BMALogLikelihood((log_mean_prob(sub) * self.mask), self.mask, sub)


def _position_padding_idx(model: nn.Module) -> int | None:
    """The ``padding_idx`` of a position embedding that counts positions from it (RoBERTa's family:
    XLM-R, CamemBERT, Longformer, ESM: ``padding_idx + 1`` for the first token, ``padding_idx`` at a
    pad, read from the token ids), or None (positions from 0)."""
    for name, module in model.named_modules():
        if name.endswith("position_embeddings") and isinstance(module, nn.Embedding) and module.padding_idx is not None:
            return module.padding_idx
    return None


@torch.no_grad()
def bma_log_likelihood(
    model: nn.Module,
    posterior: Any,
    input_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    labels: Tensor | None = None,
    num_samples: int = 8,
    seed: int | None = None,
    strategy: SampleStrategy | str | None = None,
    **encoder_inputs: Tensor,
) -> BMALogLikelihood:
    """Log-likelihood of ``input_ids`` under the BMA predictive ``p̄ = 1/S Σ_s p(· | W_s)``.

    One forward of batch ``S·B`` (as in ``generate_bma``); a model the batched samples refuse (as
    ``generate_bma`` lists) runs the same S samples written into its weights, one forward of ``B``
    rows each (``hf_evon.predictive.sequential_samples``); ``strategy``: as ``generate_bma``'s.
    ``labels`` follow transformers' convention (same shape as ``input_ids``, ``-100`` = not scored,
    shifted inside for a causal LM; a masked LM's or token classifier's are not shifted, as its loss
    does not shift them); by default they are ``input_ids`` with padding (``attention_mask == 0``)
    ignored and, for a causal LM, no token scored from a pad (left padding's first token), so left-
    and right-padded rows score as they would alone; ``labels=`` given are scored as given, as the
    model's own loss scores them, a left-padded row's first token included (a token classifier, whose
    classes are not ids, needs ``labels=``; a multiple-choice model is refused). With an attention
    mask, position ids are counted from the first real token (a right pad's too) and a left pad's is 0 (RoBERTa's family counts
    them as it does itself: from ``padding_idx + 1``, by the token ids), so that first token, scored
    from the pad before it, differs from the model's own loss where the model gives pads another
    position (OPT's learned positions: -1). Loss and perplexity: ``result.loss``,
    ``result.perplexity``; see ``BMALogLikelihood``.

    An encoder-decoder model scores ``labels`` (required: the decoder's targets, ``(B, L)``) given
    ``input_ids`` (the encoder's input), each sample with its own encoder; its decoder is fed the
    labels shifted right, as in training, and entry ``t`` scores ``labels[:, t]`` (length ``L``).
    An encoder that reads no token ids takes its input by the model's name for it instead of
    ``input_ids`` (Whisper's ``input_features=``, a VisionEncoderDecoder's ``pixel_values=``).
    The model's mode is left as it is, as ``generate`` leaves it: call ``model.eval()`` first, or
    dropout makes the scores differ from call to call whatever the ``seed``.
    """
    strategy = checked_strategy(strategy, "bma_log_likelihood")
    gen_model = _generation_model(model)
    check_scored_model("bma_log_likelihood", gen_model, labels)
    name, source = encoder_input("bma_log_likelihood", gen_model, input_ids, encoder_inputs)
    if encoder_inputs:
        raise TypeError(
            f"bma_log_likelihood: got {', '.join(encoder_inputs)}; it runs the model on {name}, attention_mask "
            "and labels alone"
        )
    check_inputs("bma_log_likelihood", model, posterior, name, source, attention_mask)
    encoder_decoder = is_encoder_decoder(gen_model)
    if encoder_decoder and labels is None:
        raise ValueError(
            "bma_log_likelihood: an encoder-decoder model scores labels= (the decoder's target ids) "
            f"given {name} (its encoder's input); labels is None"
        )
    want = "(batch, length)" if encoder_decoder else f"input_ids' shape {tuple(source.shape)}"
    if labels is not None and (
        not isinstance(labels, Tensor)
        or (labels.shape != source.shape if not encoder_decoder else labels.dim() != 2 or len(labels) != len(source))
    ):
        what = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
        raise ValueError(f"bma_log_likelihood: labels must have {want}; got {what}")
    if labels is not None:
        require_class_labels(labels, "bma_log_likelihood: labels")
    padded = labels is None and attention_mask is not None  # labels taken from the unpadded ids
    if labels is None:
        labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    inputs: dict[str, Any] = {name: source, "use_cache": False}  # B rows: one sample's
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    if encoder_decoder:
        inputs.update(decoder_inputs_from_labels(gen_model, labels))
        targets, scored = labels, slice(None)  # position t predicts labels[t]
    else:
        if "position_ids" in inspect.signature(gen_model.forward).parameters:
            # also without a mask: a model's own (1, T) ids would reach a covered position embedding
            # as one row, not S·B
            pad = _position_padding_idx(gen_model)
            if pad is not None:  # RoBERTa's family: from padding_idx + 1, pads at padding_idx, as its own
                real = input_ids.ne(pad).long()
                inputs["position_ids"] = real.cumsum(-1) * real + pad
            else:
                mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
                # counted from the first real token, the pads after it too (as a model counts them itself)
                leading = (mask.long().cumsum(-1) == 0).sum(-1, keepdim=True)
                inputs["position_ids"] = (torch.arange(mask.shape[-1], device=mask.device) - leading).clamp(min=0)
        if not is_causal_lm(gen_model):  # a masked LM's labels are not next tokens: t scores labels[t]
            targets, scored = labels, slice(None)
        else:
            targets, scored = labels[:, 1:], slice(None, -1)  # position t predicts token t+1
            if padded:  # nor a token predicted from a pad (left padding's first token): as if alone
                targets = targets.masked_fill(attention_mask[:, :-1] == 0, IGNORE_INDEX)
    mask = targets != IGNORE_INDEX
    score = functools.partial(sample_target_log_probs, targets=targets, scored=scored, labels=labels, posterior=posterior)
    rows = expected_rows(len(source), length(name, source) + (labels.shape[1] if encoder_decoder else 0))
    sampler = _entered_batched_samples(
        BatchedSamples(model, posterior, num_samples, seed=seed, strategy=strategy, rows=rows, sequences=len(source)),
        gen_model,
        source,
        name,
    )
    logits = None
    if not isinstance(sampler, BatchedSamplesRefused):
        try:  # S·B rows, sample-major
            logits = gen_model(**{k: repeated(v, num_samples) for k, v in inputs.items()}, return_dict=True).logits
        except BatchedSamplesRefused:  # refused during the forward: as refused before it
            pass
        finally:
            sampler.__exit__(None, None, None)
    if logits is None:  # the batched path refuses the model: its S samples in turn
        with SequentialSamples(model, posterior, num_samples, seed=seed) as samples:
            per_sample = samples.each(lambda: score(gen_model(**inputs, return_dict=True).logits))
    else:  # one sample at a time keeps the widened (float32 at least) copy small
        per_sample = [score(chunk) for chunk in logits.split(len(source))]
        del logits
    sample_lp = torch.stack(per_sample)
    return BMALogLikelihood(log_mean_prob(sample_lp) * mask, mask, sample_lp)


def bma_loss_curve(result: BMALogLikelihood, sizes: list[int] | None = None) -> dict[int, float]:
    """Expected BMA loss for ``k`` samples (``group_loss``), for each ``k`` in ``sizes`` (default 1, 2, 4, …)."""
    if sizes is None:
        sizes = [2**i for i in range(int(math.log2(result.num_samples)) + 1)]
    return {k: float(result.group_loss(k)) for k in sizes}
