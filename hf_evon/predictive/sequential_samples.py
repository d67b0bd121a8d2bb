"""S posterior samples of a model written into its weights one at a time: BMA decoding for the models
the batched samples (:mod:`hf_evon.predictive.batched_samples`) refuse.

The batched path needs every covered parameter owned by an ``nn.Linear``, ``Conv1D`` or ``nn.Embedding``
and used only through its forward. Other models (PEFT's AdaLoRA, IA3, LoHa, LoKr and DoRA adapters,
``weight_norm``, a scaled word embedding, a mixture's router) run each sample as ``posterior.sampled``
runs it: its weights written into the model's parameters. :class:`SequentialSamples` draws the S samples
the batched path would draw (``posterior.draw(S, seed=seed)``, each written as ``M + ΔW_s`` with the
rounding of ``posterior.sampled``; AdaLoRA's pruned ranks kept 0, as ``sampled`` keeps them) and holds
them for the whole call; :func:`forward_per_sample` makes a model's forward run once per sample, each
sample on its own KV cache (:func:`per_sample_cache`) and, in an encoder-decoder model, its own encoder
outputs, and combine the S logits. Each step costs S
forwards of ``B`` rows and S writes of the covered weights; the mean is written back after every
forward, and on exit (also when the block raises), bit for bit. ``bma_log_likelihood`` scores such a
model with :meth:`SequentialSamples.each`: one forward of ``B`` rows per sample.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from hf_evon.modeling import pruned_ranks, release_gathered, unwrap_model
from hf_evon.optim.checks import sample_count
from hf_evon.optim.held_samples import claim_sample, release_sample
from hf_evon.optim.linalg import writing_weights
from hf_evon.posterior.gaussian import add_perturbation, sample_seed
from hf_evon.predictive.batched_samples import chunked_draws
from hf_evon.predictive.module_forward import instance_forward

Tensor = torch.Tensor
T = TypeVar("T")

# the keywords under which a forward takes its KV cache: transformers from 5.24, and before
CACHE_KEYWORDS = ("cache", "past_key_values")
# a decoder's outputs per layer that generate returns when asked (output_attentions, output_hidden_states)
PER_SAMPLE_OUTPUTS = ("attentions", "hidden_states", "decoder_attentions", "cross_attentions", "decoder_hidden_states")


class SequentialSamples:
    """Context manager holding S posterior samples of ``model``'s covered weights, each written into
    the parameters on :meth:`write` and the mean put back on :meth:`restore` (and on exit).

    Args:
        model: the model whose ``named_parameters()`` names the posterior uses (behind DDP and
            ``torch.compile``: the module they wrap).
        posterior: an ``EVONPosterior``.
        num_samples: S.
        seed: seed of the weight draw, ``posterior.draw(S, seed=seed)``: the samples ``BatchedSamples``
            draws for the same seed.
    """

    def __init__(self, model: nn.Module, posterior: Any, num_samples: int, seed: int | None = None) -> None:
        num_samples = sample_count(num_samples)
        self.model = unwrap_model(model)
        self.posterior = posterior
        self.num_samples = num_samples
        self.seed = seed
        self._params: dict[str, Tensor] = {}
        self._means: dict[str, Tensor] = {}
        self._samples: dict[str, list[Tensor]] = {}
        self._written = False
        self._claimed: set[int] = set()

    def __enter__(self) -> SequentialSamples:
        release_gathered(self.model)  # the samples go into FSDP2's shards, not weights a forward left gathered
        named = dict(self.model.named_parameters(remove_duplicate=False))
        unknown = [n for n in self.posterior.names if n not in named]
        if unknown:
            raise KeyError(f"posterior covers parameters the model does not have: {unknown[:5]}")
        params = {n: named[n] for n in self.posterior.names}
        self.seed = sample_seed(self.seed, params.values(), self.model)
        pruned = pruned_ranks(self.model)
        self._claimed = claim_sample(params)  # held until exit: no other block samples around its samples
        try:
            with torch.no_grad():
                for name, draw in chunked_draws(self.posterior, params, self.num_samples, self.seed):
                    mean = params[name].detach()
                    delta = draw.to(mean.device)
                    if name in pruned:  # a pruned rank is off, not uncertain: 0 in every sample
                        delta = delta.masked_fill(pruned[name].to(delta.device), 0)
                    self._samples[name] = [add_perturbation(mean, d) for d in delta]
                    self._means[name] = mean.clone()
        except BaseException:
            release_sample(self._claimed)
            raise
        self._params = params
        return self

    def write(self, s: int) -> None:
        """Sample ``s``'s weights into the model's covered parameters."""
        release_gathered(self.model)  # FSDP2's next forward gathers this sample, not the last one
        with torch.no_grad(), writing_weights():  # the forward casts the sample, not a cast from before
            for name, p in self._params.items():
                p.copy_(self._samples[name][s])
        self._written = True

    def each(self, run: Callable[[], T]) -> list[T]:
        """``run()`` once per sample, that sample written into the weights; the mean back after the
        last, and when one raises (an encoder-decoder's encoder passes, ``bma_log_likelihood``'s
        forwards)."""
        results = []
        try:
            for s in range(self.num_samples):
                self.write(s)
                results.append(run())
        finally:
            self.restore()
        return results

    def restore(self) -> None:
        """The mean back into the covered parameters, bit for bit."""
        if not self._written:
            return
        release_gathered(self.model)  # FSDP2's next forward gathers the mean, not the last sample
        with torch.no_grad(), writing_weights():
            for name, p in self._params.items():
                p.copy_(self._means[name])
        self._written = False

    def __exit__(self, *exc: Any) -> None:
        try:
            self.restore()
        finally:
            release_sample(self._claimed)
            self._claimed = set()
            self._samples.clear()
            self._means.clear()
        self._params = {}


def per_sample_cache(num_samples: int, config: Any, encoder_decoder: bool = False) -> Any:
    """A ``PerSampleCache`` of ``num_samples`` dynamic caches (``config``: the decoder's; an
    encoder-decoder model's: each an ``EncoderDecoderCache`` of two)."""
    from transformers import DynamicCache, EncoderDecoderCache

    def fresh() -> Any:
        if encoder_decoder:  # self-attention and cross-attention
            return EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
        return DynamicCache(config=config)

    class PerSampleCache(EncoderDecoderCache if encoder_decoder else DynamicCache):  # type: ignore[misc]
        """Sample 0's KV cache, holding the other samples' (``per_sample``): what ``generate`` reads of
        it (its length) is every sample's, and beam search's reordering reorders every sample's."""

        def __init__(self) -> None:
            if encoder_decoder:
                super().__init__(DynamicCache(config=config), DynamicCache(config=config))
            else:
                super().__init__(config=config)
            self.per_sample = [self, *(fresh() for _ in range(num_samples - 1))]

        def reorder_cache(self, beam_idx: Tensor) -> None:
            super().reorder_cache(beam_idx)
            for cache in self.per_sample[1:]:
                cache.reorder_cache(beam_idx)

    return PerSampleCache()


@contextlib.contextmanager
def forward_per_sample(
    model: nn.Module,
    samples: SequentialSamples,
    new_cache: Callable[[], Any],
    combine: Callable[[list[Tensor]], Tensor],
    encoder_outputs: list[Any] | None = None,
) -> Iterator[None]:
    """``model``'s forward, for the block, run once per sample of ``samples`` (each written into the
    weights in turn, the mean written back after), each on its own cache of the
    :func:`per_sample_cache` handed to it, and returning the outputs of the last with ``logits``
    ``combine(the S samples' logits)``, that same cache, and the decoder's attentions and hidden states
    (where requested) of all S samples, ``S·B`` rows sample-major as the batched path returns them. A call without a cache that caches (the
    unconditional pass of ``guidance_scale``'s processor) gets a fresh one from ``new_cache``, so its
    next call finds each sample's states apart again. ``encoder_outputs``: an encoder-decoder model's,
    one per sample (``B`` rows), each sample's decoder given its own, repeated as ``generate`` repeats
    the ones handed to it for beams and returned sequences."""
    expanded: dict[int, list[Any]] = {}

    def own_encoder_outputs(s: int, given: Any) -> Any:
        rows = given[0].shape[0]
        if rows not in expanded:
            expanded[rows] = [_repeated(outputs, rows // outputs[0].shape[0]) for outputs in encoder_outputs]
        return expanded[rows][s]

    forward = model.forward
    signature = inspect.signature(forward)
    key = next((k for k in CACHE_KEYWORDS if k in signature.parameters), CACHE_KEYWORDS[-1])

    @functools.wraps(forward)  # generate reads the forward's signature
    def each_sample(*args: Any, **kwargs: Any) -> Any:
        if args:  # guidance_scale's processor calls the model with the ids first, by position
            kwargs = {**signature.bind_partial(*args).arguments, **kwargs}
        cache = kwargs.get(key)
        if cache is None and kwargs.get("use_cache", getattr(model.config, "use_cache", False)):
            cache = new_cache()
        if cache is not None and not hasattr(cache, "per_sample"):
            raise ValueError(
                f"generate_bma one draw at a time: the model was called with a cache ({type(cache).__name__}) "
                "that does not hold one cache per sample"
            )
        outputs, logits, per_layer = None, [], {}
        try:
            for s in range(samples.num_samples):
                samples.write(s)
                if cache is not None:
                    kwargs[key] = cache.per_sample[s]
                if encoder_outputs is not None and kwargs.get("encoder_outputs") is not None:
                    kwargs["encoder_outputs"] = own_encoder_outputs(s, kwargs["encoder_outputs"])
                outputs = forward(**kwargs)
                logits.append(outputs.logits)
                for name in PER_SAMPLE_OUTPUTS:  # requested: every sample's, as the batched path's
                    if isinstance(outputs.get(name), tuple):
                        per_layer.setdefault(name, []).append(outputs[name])
        finally:
            samples.restore()
        outputs.logits = combine(logits)
        for name, layers in per_layer.items():  # (S·B, …) per layer, sample-major
            outputs[name] = tuple(torch.cat(samples_of_layer) for samples_of_layer in zip(*layers))
        # the output's own name for its cache, from its keys: reading the other name through the output
        # (transformers 5.24's past_key_values) logs a deprecation of a keyword the caller never passed
        for name in [k for k in CACHE_KEYWORDS if k in outputs.keys()]:
            if outputs[name] is not None:
                outputs[name] = cache
        return outputs

    with instance_forward(model, each_sample):
        yield


def _repeated(outputs: Any, times: int) -> Any:
    """``outputs`` (a ``ModelOutput``) with each tensor's rows repeated ``times`` times, as ``generate``
    repeats the encoder outputs handed to it."""
    if times == 1:
        return outputs
    return type(outputs)(
        **{k: v.repeat_interleave(times, dim=0) if isinstance(v, Tensor) else v for k, v in outputs.items()}
    )


class _HeldPrompt:
    """``streamer`` for a batched attempt that a refusal in its first forward re-runs one draw at a time:
    the first ``put`` (the prompt, which ``generate`` puts before any forward) reaches ``streamer`` with
    the second (the first new tokens), so that re-run's own prompt is the one it gets; ``streamed``: new
    tokens have reached it, which a re-run would give it again."""

    def __init__(self, streamer: Any) -> None:
        self.streamer, self.prompt, self.streamed = streamer, None, False

    def put(self, value: Tensor) -> None:
        if self.prompt is None and not self.streamed:
            self.prompt = value
            return
        if not self.streamed:
            self.streamer.put(self.prompt)
            self.streamed = True
        self.streamer.put(value)

    def end(self) -> None:
        if not self.streamed and self.prompt is not None:  # no new token: the prompt alone
            self.streamer.put(self.prompt)
        self.streamed = True
        self.streamer.end()


def held_prompt(streamer: Any) -> _HeldPrompt | None:
    """``streamer`` (``None``: none) with its prompt held back (:class:`_HeldPrompt`)."""
    return None if streamer is None else _HeldPrompt(streamer)


@contextlib.contextmanager
def one_draw_at_a_time(
    model: nn.Module,
    gen_model: nn.Module,
    posterior: Any,
    num_samples: int,
    seed: int | None,
    combine: Callable[[list[Tensor]], Tensor],
    encoder: Callable[[], Any] | None = None,
) -> Iterator[tuple[Any, Any]]:
    """For the block, ``gen_model``'s forward (the transformers model of ``model``, which the posterior's
    names address) runs S samples one at a time (:class:`SequentialSamples`, :func:`forward_per_sample`).
    ``encoder``: an encoder-decoder model's encoder pass, run once per sample. Yields the
    :func:`per_sample_cache` to hand ``generate`` and the encoder outputs to hand it (sample 0's; each
    sample's decoder gets its own), ``None`` without ``encoder``."""
    config = gen_model.config.get_text_config(decoder=True)
    new_cache = functools.partial(per_sample_cache, num_samples, config, encoder is not None)
    with SequentialSamples(model, posterior, num_samples, seed=seed) as samples:
        per_sample = None if encoder is None else samples.each(encoder)
        with forward_per_sample(gen_model, samples, new_cache, combine, per_sample):
            # a copy: generate repeats the tensors of the outputs handed to it in place
            yield new_cache(), None if per_sample is None else type(per_sample[0])(**per_sample[0])
