"""BMA decoding and scoring (issue 5): exactness against slow references, padding, sampling,
eos, streamer, Llama and PEFT-LoRA models, weights untouched, and that BMA helps."""

from __future__ import annotations

import copy
import functools
import math
import os
import re
import warnings

import pytest
import torch
from conftest import count_forwards, entered_strategies
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

import hf_evon
import hf_evon.predictive.batched_samples as batched
from hf_evon import EVONPosterior, bma_log_likelihood, generate_bma
from hf_evon.predictive import generation
from hf_evon.predictive.generation import bma_loss_curve

VOCAB = 48
NOISY_ESS = 30.0  # ~0.5 std per weight in the eigenbasis: samples disagree clearly


# ----------------------------------------------------------------------------- helpers
def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2
    )
    return GPT2LMHeadModel(cfg).eval()


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval()


def train_posterior(model: torch.nn.Module, steps: int = 3, **kwargs) -> EVONPosterior:
    """A real EVON posterior: the initialising step plus a few updates on random tokens."""
    opt = hf_evon.build_optimizer(model, lr=1e-2, ess=1e4, precondition_frequency=2, seed=0, **kwargs)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps + 1):
        x = torch.randint(3, VOCAB, (4, 12), generator=gen)
        with opt.sampled_params(train=True):
            model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return EVONPosterior.from_optimizer(opt, model)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} changed"
    assert not any("forward" in m.__dict__ for m in model.modules()), "a patched forward was left behind"


def sampled_copies(model: torch.nn.Module, posterior: EVONPosterior, num_samples: int, seed: int) -> list:
    """S deep copies holding ``M + ΔW_s`` for the draws of ``posterior.draw(S, seed)``."""
    draws = posterior.draw(num_samples, seed=seed)
    assert set(draws) == set(posterior.names)
    copies = []
    for s in range(num_samples):
        m = copy.deepcopy(model)
        params = dict(m.named_parameters())
        with torch.no_grad():
            for name, delta in draws.items():
                p = params[name]
                p.copy_((p.to(delta.dtype) + delta[s]).to(p.dtype))
        copies.append(m)
    return copies


def _forward_model(m: torch.nn.Module) -> torch.nn.Module:
    return m.get_base_model() if hasattr(m, "get_base_model") else m


@torch.no_grad()
def reference_greedy(copies: list, input_ids, attention_mask, new_tokens: int, forced=None):
    """Slow BMA: every sample its own model and cache, mean of softmax, greedy; log p̄ per step.
    ``forced`` (B × new_tokens): feed these tokens instead of the argmax (the reference's log p̄
    along another decode's path)."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = [DynamicCache(config=m.config) for m in copies]
    ids, step_ids, step_pos = input_ids, input_ids, positions
    scores = []
    for _ in range(new_tokens):
        probs = []
        for m, cache in zip(copies, caches):
            out = _forward_model(m)(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_pos,
                past_key_values=cache,
                use_cache=True,
            )
            probs.append(torch.softmax(out.logits[:, -1].float(), dim=-1))
        log_mean = torch.stack(probs).mean(0).log()
        scores.append(log_mean)
        step_ids = log_mean.argmax(-1, keepdim=True) if forced is None else forced[:, len(scores) - 1 : len(scores)]
        ids = torch.cat([ids, step_ids], dim=-1)
        mask = torch.cat([mask, torch.ones_like(step_ids)], dim=-1)
        step_pos = step_pos[:, -1:] + 1
    return ids, scores


# How far a float32 computation of the predictive may be off the float64 reference, as a multiple
# of the float32 reference's own error: the same forward passes summed in other orders (the kernels
# of the host's instruction set, the cache, the factored samples' extra products ((x Q_R) Eᵀ) Q_Lᵀ).
# The speech and vision models' test uses it (0.09–7.3x measured on AVX2 and AVX-512 hosts). The tiny
# BART's factored samples reach ~50x at some seeds, so the text encoder-decoder and beam-search
# tests run in float64 and hold the rounding bound of assert_rounded_predictive instead.
FLOAT32_SPREAD = 16


def assert_reference_argmax(new_ids: torch.Tensor, scores: list[torch.Tensor], tol: float = 1e-5) -> None:
    """Every token a greedy decode picked (``new_ids``, B × steps) is the reference's argmax at
    that prefix (``scores``: its log p̄ along the same path), up to ``tol``. The tiny models here
    are nearly untrained, and their top two tokens can be closer than float32 rounding (8e-7
    apart, seen), so which one wins depends on the kernels' summation order: comparing whole
    sequences would fail on one CPU and pass on another. 1e-5 is ~20 ulps of log p̄ near -4; a
    wrong sample or mask moves log p̄ by more than 1e-3."""
    assert new_ids.shape[1] == len(scores)
    for t, s in enumerate(scores):
        gap = s.max(-1).values - s.gather(-1, new_ids[:, t : t + 1]).squeeze(-1)
        assert float(gap.max()) <= tol, f"step {t}: the reference prefers another token by {float(gap.max()):.3g}"


def log_mean_probs(out) -> list[torch.Tensor]:
    """``log p̄`` per step from generate_bma's output ``logits`` (the predictive's ``log p̄ + c``)."""
    return [torch.log_softmax(step, -1) for step in out.logits]


def left_pad(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.fixture(scope="module")
def gpt2():
    model = tiny_gpt2()
    return model, train_posterior(model)


PROMPTS = torch.tensor([[5, 9, 17, 3, 22, 8], [40, 41, 7, 7, 30, 12]])
# the way out every refusal of batched BMA names: the samples written into the weights, one at a time
ONE_DRAW_AT_A_TIME = re.escape(
    "sample the model one draw at a time instead: run it inside `with posterior.sampled(model, seed=s)` "
    "for each of S seeds and average the S predicted probabilities"
)


def refused(match: str):
    """``pytest.raises`` for batched BMA's refusal matching ``match``, ending with the way out."""
    return pytest.raises(NotImplementedError, match=rf"{match}.*; {ONE_DRAW_AT_A_TIME}$")


def batched_refusal(
    model: torch.nn.Module, posterior: EVONPosterior, input_ids: torch.Tensor, num_samples: int = 2, seed: int = 0
):
    """Raise the refusal the batched path meets before it runs (the samples entered, their sample axis
    checked), where generate_bma and bma_log_likelihood then run the model one draw at a time."""
    gen_model = generation._generation_model(model)
    sampler = batched.BatchedSamples(model, posterior, num_samples, seed=seed)
    sampler = generation._entered_batched_samples(sampler, gen_model, input_ids)
    if isinstance(sampler, NotImplementedError):
        raise sampler
    sampler.__exit__(None, None, None)


def reference_log_probs(model: torch.nn.Module, posterior: EVONPosterior, ids: torch.Tensor, num_samples: int, seed: int):
    """Slow per-sample ``log p(x_{t+1} | x_{≤t})``, ``(S, B, T-1)``: each sample written into a deep copy."""
    with torch.no_grad():
        logits = [m(input_ids=ids).logits[:, :-1] for m in sampled_copies(model, posterior, num_samples, seed)]
    return torch.stack([torch.log_softmax(x.float(), -1).gather(-1, ids[:, 1:, None])[..., 0] for x in logits])


@pytest.fixture(params=["materialize", "factored"])
def strategy(request, monkeypatch):
    """Both ways of applying the samples (per-sample weights, or bases on the activations)."""
    monkeypatch.setattr(batched, "DEFAULT_STRATEGY", request.param)
    return request.param


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("num_samples", [1, 3])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_zero_variance_equals_generate(strategy, gpt2, arch, num_samples):
    model, posterior = gpt2 if arch == "gpt2" else (tiny_llama(), None)
    if posterior is None:
        posterior = train_posterior(model)
    zero = posterior.with_ess(float("inf"))
    assert all(bool((d == 0).all()) for d in zero.draw(2, seed=0).values())
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = model.generate(PROMPTS, **kwargs)
    got = generate_bma(model, zero, PROMPTS, num_samples=num_samples, seed=0, **kwargs)
    assert torch.equal(got, expected)



@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5", "bart"])
@pytest.mark.parametrize(
    "processing",
    [dict(repetition_penalty=2.0), dict(exponential_decay_length_penalty=(1, 2.0), eos_token_id=2)],
    ids=["repetition_penalty", "length_penalty"],
)
def test_zero_variance_equals_generate_under_processors_that_read_the_logits_scale(gpt2, arch, processing):
    """Processors that are not shift-invariant (a repetition penalty divides a positive logit and
    multiplies a negative one; the length penalty adds a multiple of |logit|) act on logits as
    generate's do: at zero variance generate_bma decodes as model.generate. On log p̄ itself (all
    entries negative) they decoded differently."""
    makers = {"llama": tiny_llama, "t5": tiny_t5, "bart": tiny_bart}
    model, posterior = gpt2 if arch == "gpt2" else (makers[arch](), None)
    if posterior is None:
        posterior = train_posterior(model)
    kwargs = {**dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None), **processing}
    expected = model.generate(PROMPTS, **kwargs)
    plain = model.generate(PROMPTS, **{k: v for k, v in kwargs.items() if k not in processing})
    assert not torch.equal(expected, plain)  # the processor changes the decoding here
    got = generate_bma(model, posterior.with_ess(float("inf")), PROMPTS, num_samples=2, seed=0, **kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    ("arch", "guidance"),
    [("gpt2", {}), ("gpt2", dict(negative_prompt_ids=torch.tensor([[7, 30], [11, 12]]))), ("bart", {})],
    ids=["gpt2", "gpt2-negative-prompt", "bart"],
)
def test_classifier_free_guidance_decodes_as_generate_at_zero_variance(gpt2, arch, guidance):
    """``guidance_scale`` makes generate's guidance processor run the model on the unconditional
    prompt itself, passing the ids positionally; generate_bma's forward raised TypeError ("takes
    the model's inputs by keyword"). At zero variance it decodes as model.generate."""
    model, posterior = gpt2 if arch == "gpt2" else (tiny_bart(), None)
    if posterior is None:
        posterior = train_posterior(model)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = model.generate(PROMPTS, guidance_scale=3.0, **guidance, **kwargs)
    assert not torch.equal(expected, model.generate(PROMPTS, **kwargs))  # the guidance changes the decoding
    zero = posterior.with_ess(float("inf"))
    got = generate_bma(model, zero, PROMPTS, num_samples=2, seed=0, guidance_scale=3.0, **guidance, **kwargs)
    assert torch.equal(got, expected)
    assert not any("forward" in m.__dict__ for m in model.modules())

@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_matches_slow_reference(strategy, gpt2, arch):
    model, posterior = gpt2 if arch == "gpt2" else (tiny_llama(1), None)
    if posterior is None:
        posterior = train_posterior(model)
    noisy = posterior.with_ess(NOISY_ESS)
    before = snapshot(model)
    num_samples, new = 3, 10
    out = generate_bma(
        model,
        noisy,
        PROMPTS,
        num_samples=num_samples,
        seed=7,
        max_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    picked = out.sequences[:, PROMPTS.shape[1] :]
    _, ref_scores = reference_greedy(sampled_copies(model, noisy, num_samples, 7), PROMPTS, None, new, picked)
    assert_reference_argmax(picked, ref_scores)
    assert len(out.scores) == len(log_mean_probs(out)) == new
    for got, scores, want in zip(log_mean_probs(out), out.scores, ref_scores):
        # float32 log p̄ of size ~4 from differently ordered sums: a relative tolerance of ~100 ulps
        torch.testing.assert_close(got, want, atol=1e-5, rtol=2e-5)
        shift = scores - got  # no processor here: the scores are log p̄ shifted per row
        torch.testing.assert_close(shift, shift[:, :1].expand_as(shift), atol=1e-5, rtol=0)
    # the samples really differ: BMA is not the mean model here
    mean_scores = model.generate(
        PROMPTS,
        max_new_tokens=1,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    ).scores[0]
    assert (log_mean_probs(out)[0] - torch.log_softmax(mean_scores, -1)).abs().max() > 1e-2
    # scoring the generated sequence gives the same log p̄ of the chosen tokens
    scored = bma_log_likelihood(model, noisy, out.sequences, num_samples=num_samples, seed=7)
    start = PROMPTS.shape[1]
    for t in range(new):
        chosen = out.sequences[:, start + t]
        want = log_mean_probs(out)[t].gather(-1, chosen[:, None]).squeeze(-1)
        torch.testing.assert_close(scored.token_log_probs[:, start + t - 1], want, atol=1e-5, rtol=0)
    assert_unchanged(model, before)


def test_left_padded_batch_equals_each_prompt_alone(strategy, gpt2):
    model, posterior = gpt2
    noisy = posterior.with_ess(NOISY_ESS)
    prompts = [[5, 9, 17], [40, 41, 7, 7, 30, 12], [11, 12, 13, 14]]
    ids, mask = left_pad(prompts)
    kwargs = dict(num_samples=4, seed=3, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    batch = generate_bma(model, noisy, ids, attention_mask=mask, **kwargs)
    for row, prompt in enumerate(prompts):
        alone = generate_bma(model, noisy, torch.tensor([prompt]), **kwargs)
        assert batch[row, ids.shape[1] :].tolist() == alone[0, len(prompt) :].tolist()
    # and it is the slow reference on the padded batch too
    picked = batch[:, ids.shape[1] :]
    _, ref_scores = reference_greedy(sampled_copies(model, noisy, 4, 3), ids, mask, 8, picked)
    assert_reference_argmax(picked, ref_scores)


def test_a_left_padded_batch_with_its_mask_runs_no_forward_without_a_mask(gpt2, monkeypatch):
    """Each forward generate_bma runs on a left-padded batch given with its attention_mask gets a
    mask. The one-token probe of the sample axis ran the first prompt's first token (the pad) alone,
    without one, and transformers warned "We strongly recommend passing in an `attention_mask`"
    to a caller who had passed it."""
    from transformers import PreTrainedModel

    model, posterior = gpt2
    monkeypatch.setattr(model.config, "pad_token_id", 0)
    unmasked = []
    warn = PreTrainedModel.warn_if_padding_and_no_attention_mask

    def spy(self, input_ids, attention_mask):
        if attention_mask is None and input_ids is not None and bool((input_ids == 0).any()):
            unmasked.append(tuple(input_ids.shape))
        return warn(self, input_ids, attention_mask)

    monkeypatch.setattr(PreTrainedModel, "warn_if_padding_and_no_attention_mask", spy)
    ids, mask = left_pad([[5, 9, 17], [40, 41, 7, 7, 30, 12]])
    out = generate_bma(model, posterior, ids, attention_mask=mask, num_samples=2, max_new_tokens=2, pad_token_id=0)
    assert out.shape == (2, ids.shape[1] + 2) and unmasked == []


def test_seeded_sampling_is_reproducible(gpt2):
    model, posterior = gpt2
    noisy = posterior.with_ess(NOISY_ESS)
    kwargs = dict(
        num_samples=3,
        max_new_tokens=20,
        do_sample=True,
        temperature=0.9,
        top_k=20,
        top_p=0.95,
        pad_token_id=0,
    )
    kwargs["eos_token_id"] = None
    a = generate_bma(model, noisy, PROMPTS, seed=11, **kwargs)
    torch.manual_seed(123)  # the global RNG must not matter when a seed is given
    b = generate_bma(model, noisy, PROMPTS, seed=11, **kwargs)
    c = generate_bma(model, noisy, PROMPTS, seed=12, **kwargs)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.shape == (2, PROMPTS.shape[1] + 20)


def test_processors_apply_to_log_mean_probs(gpt2):
    model, posterior = gpt2
    noisy = posterior.with_ess(NOISY_ESS)
    out = generate_bma(
        model,
        noisy,
        PROMPTS,
        num_samples=2,
        seed=0,
        max_new_tokens=6,
        do_sample=False,
        repetition_penalty=1.5,
        pad_token_id=0,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    processor = RepetitionPenaltyLogitsProcessor(1.5)
    start = PROMPTS.shape[1]
    # the processors see log p̄ + c, c the samples' mean log-normaliser (logsumexp of their logits)
    with torch.no_grad():
        sample_logits = torch.stack([m(out.sequences).logits for m in sampled_copies(model, noisy, 2, 0)])
    for t, (score, log_mean) in enumerate(zip(out.scores, log_mean_probs(out))):
        torch.testing.assert_close(torch.logsumexp(log_mean, -1), torch.zeros(2), atol=1e-5, rtol=0)
        shift = torch.logsumexp(sample_logits[:, :, start + t - 1], -1).mean(0)[:, None]
        expected = processor(out.sequences[:, : start + t], log_mean + shift)
        torch.testing.assert_close(score, expected, atol=1e-5, rtol=1e-6)
        assert not torch.equal(score, log_mean + shift)  # the penalty did something
        assert torch.equal(out.sequences[:, start + t], score.argmax(-1))


def test_eos_finishes_rows_and_pads(gpt2):
    model, posterior = gpt2
    # zero variance: identical to model.generate, including eos/pad handling
    zero = posterior.with_ess(float("inf"))
    free = model.generate(PROMPTS, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    eos = int(free[0, PROMPTS.shape[1] + 2])
    pad = next(t for t in range(3, VOCAB) if t != eos)
    # an explicit mask: with none, prompt tokens equal to the pad id would be masked out
    mask = torch.ones_like(PROMPTS)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=pad, eos_token_id=eos, attention_mask=mask)
    expected = model.generate(PROMPTS, **kwargs)
    assert torch.equal(generate_bma(model, zero, PROMPTS, num_samples=2, seed=0, **kwargs), expected)
    # noisy: a row that emitted eos only gets padding afterwards
    noisy = posterior.with_ess(NOISY_ESS)
    free = generate_bma(model, noisy, PROMPTS, num_samples=3, seed=5, **dict(kwargs, eos_token_id=None))
    eos = int(free[0, PROMPTS.shape[1] + 2])
    pad = next(t for t in range(3, VOCAB) if t != eos and not bool((free[0] == t).any()))
    out = generate_bma(
        model, noisy, PROMPTS, num_samples=3, seed=5, **dict(kwargs, eos_token_id=eos, pad_token_id=pad)
    )
    generated = out[0, PROMPTS.shape[1] :].tolist()
    first = generated.index(eos)
    assert first <= 2
    assert generated[: first + 1] == free[0, PROMPTS.shape[1] : PROMPTS.shape[1] + first + 1].tolist()
    assert generated[first + 1 :] == [pad] * (len(generated) - first - 1)
    assert len(generated) - first - 1 > 0 or out.shape[1] < free.shape[1]


class _Collect(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ended += 1


def test_streamer_receives_tokens(gpt2):
    model, posterior = gpt2
    streamer = _Collect()
    prompt = PROMPTS[:1]
    out = generate_bma(
        model,
        posterior.with_ess(NOISY_ESS),
        prompt,
        num_samples=2,
        seed=0,
        max_new_tokens=7,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        streamer=streamer,
    )
    assert streamer.ended == 1
    assert torch.equal(streamer.puts[0].reshape(-1), prompt[0])
    assert (
        torch.cat([p.reshape(-1) for p in streamer.puts[1:]]).tolist() == out[0, prompt.shape[1] :].tolist()
    )
    assert len(streamer.puts) == 1 + 7


def test_peft_lora_posterior(strategy, gpt2):
    peft = pytest.importorskip("peft")
    base = tiny_gpt2(seed=2)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0, fan_in_fan_out=True
    )
    model = peft.get_peft_model(base, config)
    posterior = train_posterior(model)
    assert posterior.names and all("lora_" in n for n in posterior.names)
    # float64 model and posterior: the noise below is ~10x the adapters' weights, so float32
    # rounding of the large LoRA activations would dominate the comparison of the two decoders
    model.double()
    posterior = posterior.to(dtype=torch.float64)
    before = snapshot(model)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    zero = posterior.with_ess(float("inf"))
    assert torch.equal(
        generate_bma(model, zero, PROMPTS, num_samples=3, seed=0, **kwargs),
        model.generate(input_ids=PROMPTS, **kwargs),
    )
    noisy = posterior.with_ess(NOISY_ESS / 10)
    out = generate_bma(
        model,
        noisy,
        PROMPTS,
        num_samples=3,
        seed=4,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )
    picked = out.sequences[:, PROMPTS.shape[1] :]
    _, ref_scores = reference_greedy(sampled_copies(model, noisy, 3, 4), PROMPTS, None, 8, picked)
    assert_reference_argmax(picked, ref_scores)
    for got, want in zip(log_mean_probs(out), ref_scores):
        # float32 log p̄; |log p̄| < 8 so 4 float32 ulp = 2e-6
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
    assert (log_mean_probs(out)[0] - zero_scores(model, zero)).abs().max() > 1e-3  # adapters' noise matters
    assert_unchanged(model, before)


def zero_scores(model, zero):
    return generate_bma(
        model,
        zero,
        PROMPTS,
        num_samples=1,
        seed=0,
        max_new_tokens=1,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_logits=True,
    ).logits[0]


# ----------------------------------------------------------------------------- scoring
def test_default_labels_score_a_left_padded_row_as_it_scores_alone(gpt2):
    """Labels taken from the ids masked only the pads' own targets: a left-padded row also scored
    its first token, predicted from the pad before it (one more target than the row alone)."""
    model, posterior = gpt2
    noisy = posterior.with_ess(NOISY_ESS)
    rows = [[5, 9, 17, 3], [40, 41, 7, 7, 30, 12, 3]]
    ids, mask = left_pad(rows)
    right = torch.tensor([r + [0] * (len(rows[1]) - len(r)) for r in rows])
    batch = bma_log_likelihood(model, noisy, ids, attention_mask=mask, num_samples=3, seed=9)
    right_padded = bma_log_likelihood(model, noisy, right, attention_mask=(right != 0).long(), num_samples=3, seed=9)
    for i, row in enumerate(rows):
        alone = bma_log_likelihood(model, noisy, torch.tensor([row]), num_samples=3, seed=9)
        assert int(batch.mask[i].sum()) == int(alone.mask.sum()) == len(row) - 1
        for scored in (batch, right_padded):
            torch.testing.assert_close(
                scored.sequence_log_likelihood[i], alone.sequence_log_likelihood[0], atol=1e-4, rtol=0
            )


def test_bma_log_likelihood_equals_direct_computation(strategy, gpt2):
    model, posterior = gpt2
    noisy = posterior.with_ess(NOISY_ESS)
    ids, mask = left_pad([[5, 9, 17, 3], [40, 41, 7, 7, 30, 12, 3], [11, 12]])
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, -1] = -100  # an ignored position inside a sequence
    before = snapshot(model)
    result = bma_log_likelihood(model, noisy, ids, attention_mask=mask, labels=labels, num_samples=4, seed=9)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    per_sample = []
    for m in sampled_copies(model, noisy, 4, 9):
        with torch.no_grad():
            logits = m(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1)
        per_sample.append(lp.gather(-1, labels[:, 1:].clamp(min=0)[..., None]).squeeze(-1))
    per_sample = torch.stack(per_sample)
    valid = labels[:, 1:] != -100
    expected = (per_sample.exp().mean(0).log()) * valid
    assert torch.equal(result.mask, valid)
    # float32 log-probs of magnitude ~4: the factored strategy rounds in another order (1.2e-5 seen)
    torch.testing.assert_close(result.token_log_probs, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.sample_token_log_probs, per_sample * valid, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.sequence_log_likelihood, expected.sum(-1), atol=1e-4, rtol=0)
    loss = -expected.sum() / valid.sum()
    torch.testing.assert_close(result.loss, loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(result.perplexity, loss.exp(), atol=1e-4, rtol=1e-5)
    # each padded row scores as it does alone
    alone = bma_log_likelihood(model, noisy, torch.tensor([[11, 12]]), num_samples=4, seed=9)
    torch.testing.assert_close(alone.token_log_probs[0, -1], result.token_log_probs[2, -1], atol=1e-5, rtol=0)
    # S = 1 at zero variance is the model's own loss
    plain = bma_log_likelihood(model, posterior.with_ess(float("inf")), PROMPTS, num_samples=1)
    with torch.no_grad():
        torch.testing.assert_close(
            plain.loss, model(input_ids=PROMPTS, labels=PROMPTS).loss, atol=1e-5, rtol=0
        )
    assert_unchanged(model, before)


def test_the_sample_count_k_must_be_an_integer():
    """group_loss(k) and first(k) take k samples: a float k failed inside slicing ("slice indices
    must be integers"), naming no argument, and k=True ran as k = 1; both are refused naming k.
    A numpy integer is an integer: the closed form of k = 2's two groups holds for it."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    sample_lp = torch.log_softmax(torch.randn(4, 2, 3, 5, generator=g, dtype=torch.float64), -1)[..., 0]
    mask = torch.tensor([[True, True, False], [True, True, True]])
    result = generation.BMALogLikelihood(generation.log_mean_prob(sample_lp) * mask, mask, sample_lp)
    for bad in (2.0, 1.5, True, "2"):
        for call in (result.group_loss, result.first):
            with pytest.raises(TypeError, match=rf"k must be an integer .*; got {re.escape(repr(bad))}"):
                call(bad)
    pairs = [sample_lp[:2].exp().mean(0).log(), sample_lp[2:].exp().mean(0).log()]
    want = sum(-(lp * mask).sum() / mask.sum() for lp in pairs) / 2
    torch.testing.assert_close(result.group_loss(np.int64(2)), want, rtol=1e-12, atol=0)
    assert torch.equal(result.first(np.int64(2)).token_log_probs, result.first(2).token_log_probs)


def test_a_float64_models_bma_keeps_float64(strategy):
    """A float64 model's BMA is averaged in float64: at zero variance bma_log_likelihood gives the
    model's own float64 log-probabilities, and generate_bma's logits are exactly generate's (which
    rounds them to float32). Both were computed in float32: float32 log-likelihoods, and 91 of 96
    logits off generate's by up to 2e-7."""
    model = tiny_gpt2().double()
    zero = train_posterior(model).with_ess(float("inf"))
    with torch.no_grad():
        logits = model(input_ids=PROMPTS).logits
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, PROMPTS[:, 1:, None])[..., 0]
    result = bma_log_likelihood(model, zero, PROMPTS, num_samples=2, seed=0)
    assert result.token_log_probs.dtype == result.sample_token_log_probs.dtype == torch.float64
    torch.testing.assert_close(result.token_log_probs, expected, atol=1e-12, rtol=0)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    kwargs.update(output_logits=True, return_dict_in_generate=True)
    plain = model.generate(PROMPTS, **kwargs)
    got = generate_bma(model, zero, PROMPTS, num_samples=2, seed=0, **kwargs)
    assert torch.equal(got.sequences, plain.sequences)
    for ours, theirs in zip(got.logits, plain.logits, strict=True):  # generate rounds both to float32
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


# ----------------------------------------------------------------------------- safety
def test_model_restored_after_an_exception(gpt2):
    model, posterior = gpt2
    before = snapshot(model)

    class Boom(StoppingCriteria):
        calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            Boom.calls += 1
            if Boom.calls == 2:
                raise RuntimeError("boom")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with pytest.raises(RuntimeError, match="boom"):
        generate_bma(
            model,
            posterior.with_ess(NOISY_ESS),
            PROMPTS,
            num_samples=3,
            seed=0,
            max_new_tokens=5,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([Boom()]),
        )
    assert_unchanged(model, before)
    # the model is a plain model again: batch B, not S·B
    assert model.generate(PROMPTS, max_new_tokens=2, do_sample=False, pad_token_id=0).shape == (2, 8)


def _offloaded(model: torch.nn.Module, how: str, tmp_path) -> tuple[torch.nn.Module, str]:
    """A deep copy of ``model`` offloaded by accelerate as ``how`` says, and a covered weight it keeps
    on the meta device (loaded into its module for each forward only)."""
    from accelerate import cpu_offload, dispatch_model

    m = copy.deepcopy(model)
    if how == "cpu_offload":
        return cpu_offload(m, execution_device="cpu"), "transformer.h.0.attn.c_attn.weight"
    device_map = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.drop": "cpu"}
    device_map |= {"transformer.h.0": "cpu", "transformer.h.1": "disk", "transformer.ln_f": "cpu", "lm_head": "cpu"}
    return dispatch_model(m, device_map, main_device="cpu", offload_dir=str(tmp_path)), "transformer.h.1.attn.c_attn.weight"


@pytest.mark.parametrize("how", ["cpu_offload", "dispatch_to_disk"])
def test_an_offloaded_model_is_refused_naming_the_offloaded_weight(gpt2, how, tmp_path):
    """accelerate's offload keeps a weight on the meta device and loads it into its module for each
    forward only: there is no mean to draw samples around or write them into. generate_bma and
    bma_log_likelihood raised the meta device's "load the model's weights first" (which the offloaded
    model had done), or, where only some modules are offloaded, a device mismatch from inside the forward."""
    model, posterior = gpt2
    offloaded, name = _offloaded(model, how, tmp_path)
    forwards = {n: m.__dict__.get("forward") for n, m in offloaded.named_modules()}
    with torch.no_grad():
        expected = model(input_ids=PROMPTS).logits
    match = rf"{re.escape(repr(name))}.*offloaded by accelerate"
    with pytest.raises(ValueError, match=match):
        bma_log_likelihood(offloaded, posterior, PROMPTS, num_samples=2, seed=0)
    with pytest.raises(ValueError, match=match):
        generate_bma(offloaded, posterior, PROMPTS, num_samples=2, seed=0, max_new_tokens=2, pad_token_id=0)
    # the model as it was: its hooks' forwards in place, its weights the mean
    assert {n: m.__dict__.get("forward") for n, m in offloaded.named_modules()} == forwards
    with torch.no_grad():
        torch.testing.assert_close(offloaded(input_ids=PROMPTS).logits, expected, atol=0, rtol=0)


def test_an_accelerate_hook_on_a_covered_module_runs_around_its_samples(strategy, gpt2):
    """accelerate's hooks (``AlignDevicesHook`` of a ``device_map``, moving the input to its module's
    device) replace a module's ``forward``; batched BMA replaced that forward in turn, so the hook never
    ran. A hook that doubles the input stands for it here, where every device is the CPU."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Doubling(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            return tuple(2 * a for a in args), kwargs

    model, posterior = gpt2
    noisy = posterior.with_ess(NOISY_ESS)
    owner = "transformer.h.0.mlp.c_fc"
    assert f"{owner}.weight" in noisy.names

    def hooked(m: torch.nn.Module) -> torch.nn.Module:
        add_hook_to_module(m.get_submodule(owner), Doubling())
        return m

    target = hooked(copy.deepcopy(model))
    hook_forward = target.get_submodule(owner).forward
    copies = [hooked(m) for m in sampled_copies(model, noisy, 3, 5)]
    with torch.no_grad():
        logits = [m(input_ids=PROMPTS).logits[:, :-1].float() for m in copies]
    expected = torch.stack([torch.log_softmax(x, -1).gather(-1, PROMPTS[:, 1:, None])[..., 0] for x in logits])
    scored = bma_log_likelihood(target, noisy, PROMPTS, num_samples=3, seed=5)
    torch.testing.assert_close(scored.sample_token_log_probs, expected, atol=1e-5, rtol=1e-5)
    out = generate_bma(
        target, noisy, PROMPTS, num_samples=3, seed=5, max_new_tokens=4, do_sample=False, pad_token_id=0,
        eos_token_id=None, return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    picked = out.sequences[:, PROMPTS.shape[1] :]
    _, ref_scores = reference_greedy(copies, PROMPTS, None, 4, picked)
    assert_reference_argmax(picked, ref_scores)
    for got, want in zip(log_mean_probs(out), ref_scores):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=2e-5)
    assert target.get_submodule(owner).forward is hook_forward  # the hook's forward back in place


def test_unsupported_requests_raise(gpt2):
    model, posterior = gpt2
    with pytest.raises(ValueError, match="'cache'"):  # the samples keep a cache of S·B rows of their own
        generate_bma(model, posterior, PROMPTS, num_samples=2, max_new_tokens=2, pad_token_id=0, cache=DynamicCache())
    with pytest.raises(ValueError, match="contrastive"):
        generate_bma(model, posterior, PROMPTS, num_samples=2, max_new_tokens=2, penalty_alpha=0.5, top_k=4, pad_token_id=0)
    # a posterior on a LayerNorm weight cannot be batched: a clear error, nothing left patched
    other = tiny_gpt2(seed=3)
    covered_norm = train_posterior(other, steps=1, evon_patterns=[r"ln_f\.weight"])
    assert "transformer.ln_f.weight" in covered_norm.names
    with refused("transformer.ln_f.weight"):
        batched_refusal(other, covered_norm, PROMPTS)
    assert not any("forward" in m.__dict__ for m in other.modules())
    # generate_bma decodes it one draw at a time, bma_log_likelihood scores it so
    scored = bma_log_likelihood(other, covered_norm, PROMPTS, num_samples=2, seed=0)
    torch.testing.assert_close(
        scored.sample_token_log_probs, reference_log_probs(other, covered_norm, PROMPTS, 2, 0), atol=1e-5, rtol=1e-5
    )
    assert generate_bma(other, covered_norm, PROMPTS, num_samples=2, max_new_tokens=2, pad_token_id=0).shape == (2, 8)
    with pytest.raises(hf_evon.PosteriorMismatchError):
        generate_bma(tiny_llama(), posterior, PROMPTS, num_samples=2, max_new_tokens=2, pad_token_id=0)


# ----------------------------------------------------------------------------- BMA helps
def _stdlib_bytes(names: list[str]) -> torch.Tensor:
    root = os.path.dirname(os.__file__)
    data = b"".join(open(os.path.join(root, n), "rb").read() for n in names)
    return torch.tensor(list(data), dtype=torch.long)


def train_char_lm(steps: int, ess: float, seq: int = 64, batch: int = 16, seed: int = 0):
    """A byte-level GPT-2 trained with EVON on a small slice of the standard library's source.

    Small data and many epochs: the regime where the posterior's spread matters.
    """
    train = _stdlib_bytes(["argparse.py"])[:10000]
    valid = _stdlib_bytes(["functools.py"])[: 128 * seq]
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=256,
        n_positions=seq,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)
    opt = hf_evon.build_optimizer(
        model,
        lr=0.1,
        ess=ess,
        weight_decay=1e-4,
        precondition_frequency=10,
        adamw_lr=3e-3,
        seed=seed,
        hess_init=0.1,
        betas=(0.9, 0.999),
        hess_clip_ratio=None,
        clip="none",
        clip_radius=1.0,
    )
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(train) - seq, (batch,), generator=gen)
        x = torch.stack([train[s : s + seq] for s in starts])
        with opt.sampled_params(train=True):
            model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return model, EVONPosterior.from_optimizer(opt, model), valid.view(-1, seq)


def test_bma_lowers_validation_loss():
    # ess = the number of training tokens, as the paper sets it
    model, posterior, valid = train_char_lm(steps=400, ess=10000.0)
    with torch.no_grad():
        mean_loss = float(model(input_ids=valid, labels=valid).loss)
    result = bma_log_likelihood(model, posterior, valid, num_samples=16, seed=0)
    curve = bma_loss_curve(result, [1, 2, 4, 8, 16])  # averaged over disjoint groups of S samples
    print(
        f"\nvalidation loss: mean {mean_loss:.4f}, BMA by S { ({k: round(v, 4) for k, v in curve.items()}) }"
    )
    assert result.first(8).loss < mean_loss  # the issue's check: BMA with S = 8 beats the mean
    assert curve[8] < mean_loss
    assert curve[8] < curve[1]  # averaging beats its members


def test_auto_strategy_follows_the_flop_count(gpt2):
    """``auto`` factors a matrix exactly when rows·(mn + m² + n²) < m²n + mn² (bases present)."""
    model, posterior = gpt2
    for rows in (1, 40, 10**6):
        expected = set()
        for name in posterior.names:
            f = posterior[name]
            m, n = f.matrix_shape
            left, right = f.Q_L is not None, f.Q_R is not None
            if (left or right) and rows * (
                m * n + left * m * m + right * n * n
            ) < left * m * m * n + right * m * n * n:
                expected.add(name)
        with batched.BatchedSamples(model, posterior, 2, seed=0, rows=rows) as sampler:
            assert sampler.factored == expected, rows
    assert expected == set()  # many rows: every matrix materialized
    with batched.BatchedSamples(model, posterior, 2, seed=0, rows=1) as sampler:
        assert sampler.factored and sampler.factored == {
            n for n in posterior.names if posterior[n].Q_L is not None or posterior[n].Q_R is not None
        }


def test_the_strategy_argument_reaches_the_batched_samples(gpt2, monkeypatch):
    """generate_bma and bma_log_likelihood took no strategy: the way to per-sample weights (what the
    docs ask for to get a per-sample loop's tokens in bfloat16) was the module global
    batched_samples.DEFAULT_STRATEGY. ``strategy=`` (a SampleStrategy or its string) now reaches the
    block: "materialize" factors no matrix, "factored" every matrix with a basis, whatever "auto" picks."""
    from hf_evon.predictive import SampleStrategy

    model, posterior = gpt2
    with_basis = {n for n in posterior.names if posterior[n].Q_L is not None or posterior[n].Q_R is not None}
    assert with_basis
    entered = entered_strategies(monkeypatch)
    for strategy, factored in (
        ("materialize", set()), ("factored", with_basis),
        (SampleStrategy.MATERIALIZE, set()), (SampleStrategy.FACTORED, with_basis),
    ):  # fmt: skip
        plain = SampleStrategy(strategy).value
        entered.clear()
        generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, max_new_tokens=2, strategy=strategy)
        assert entered == [(plain, factored)]
        entered.clear()
        bma_log_likelihood(model, posterior, PROMPTS, num_samples=2, seed=0, strategy=strategy)
        assert entered == [(plain, factored)]
        assert type(plain) is str


def test_a_strategy_that_is_no_sample_strategy_is_refused_naming_the_argument(gpt2):
    """A misspelled strategy raises ValueError naming ``strategy`` and the accepted ones, before any
    block is entered: the model is left as it was."""
    model, posterior = gpt2
    before = snapshot(model)
    for bad in ("materialise", 3, ["factored"]):
        with pytest.raises(ValueError, match=r"generate_bma: strategy must be one of .*'materialize'.*got"):
            generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, max_new_tokens=2, strategy=bad)
        with pytest.raises(ValueError, match=r"bma_log_likelihood: strategy must be one of .*'factored'.*got"):
            bma_log_likelihood(model, posterior, PROMPTS, num_samples=2, seed=0, strategy=bad)
    with pytest.raises(ValueError, match=r"strategy must be one of .*got 'materialise'"):
        batched.BatchedSamples(model, posterior, 2, strategy="materialise")
    assert_unchanged(model, before)


def test_materialize_decodes_a_bfloat16_model_as_a_per_sample_loop(monkeypatch):
    """In bfloat16 the factored form rounds its products where a per-sample weight is rounded as
    written into the model, so identical tokens to a loop over the samples need per-sample weights:
    ``strategy="materialize"`` (reachable only through a module global before) decodes the tokens of
    each sample written into a copy of the model in turn (reference_greedy on sampled_copies)."""
    model = tiny_gpt2(seed=1)
    noisy = train_posterior(model).with_ess(NOISY_ESS)
    model = model.to(torch.bfloat16)
    entered = entered_strategies(monkeypatch)
    ids, mask = left_pad([[5, 9, 17, 3, 22, 8], [40, 41, 7]])
    for seed in (2, 3):  # seeds at which "auto" (factored on CPU here) decodes other tokens on an AVX-512 host
        got = generate_bma(
            model, noisy, ids, attention_mask=mask, num_samples=4, seed=seed, max_new_tokens=8, do_sample=False,
            pad_token_id=0, eos_token_id=None, strategy="materialize",
        )  # fmt: skip
        want, _ = reference_greedy(sampled_copies(model, noisy, 4, seed), ids, mask, 8)
        assert torch.equal(got, want), seed
    assert [strategy for strategy, _ in entered] == ["materialize", "materialize"]


def test_tied_embedding_and_head_share_one_representation(strategy):
    """A covered weight owned by both the embedding and the (tied) LM head is materialized for
    both, whatever the strategy: the embedding lookup needs whole per-sample weights."""
    model = tiny_gpt2(seed=4)
    assert model.lm_head.weight is model.transformer.wte.weight
    posterior = train_posterior(model, evon_patterns=[r"wte\.weight"])
    assert "transformer.wte.weight" in posterior.names
    noisy = posterior.with_ess(NOISY_ESS)
    with batched.BatchedSamples(model, noisy, 2, seed=0, rows=1) as sampler:
        assert "transformer.wte.weight" not in sampler.factored
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = generate_bma(model, noisy, PROMPTS, num_samples=3, seed=2, **kwargs)
    picked = out[:, PROMPTS.shape[1] :]
    _, ref_scores = reference_greedy(sampled_copies(model, noisy, 3, 2), PROMPTS, None, 6, picked)
    assert_reference_argmax(picked, ref_scores)


@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_output_logits_are_the_predictives_logits(gpt2, arch):
    """``model.generate`` itself decodes on a forward that returns ``log p̄ + c``: at zero variance
    its ``output_logits`` are the mean model's own (``c`` puts log p̄ on the model's scale)."""
    model, posterior = gpt2 if arch == "gpt2" else (tiny_t5(), None)
    if posterior is None:
        posterior = train_posterior(model)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None,
                  return_dict_in_generate=True, output_logits=True)  # fmt: skip
    expected = model.generate(PROMPTS, **kwargs)
    got = generate_bma(model, posterior.with_ess(float("inf")), PROMPTS, num_samples=3, seed=0, **kwargs)
    assert torch.equal(got.sequences, expected.sequences) and len(got.logits) == 5
    for mine, theirs in zip(got.logits, expected.logits, strict=True):
        # x − logsumexp(x) + logsumexp(x) in float32 for logits up to ~5: a few ulps (5e-7 each) per op
        torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=1e-5)


def test_the_posteriors_temperature_tempers_every_samples_softmax(gpt2):
    """A calibrated temperature T: generate_bma's log p̄ and bma_log_likelihood average
    softmax(logits / T) over the samples (at zero variance: the mean's tempered softmax)."""
    model, posterior = gpt2
    zero = posterior.with_ess(float("inf")).with_temperature(2.0)
    out = generate_bma(
        model, zero, PROMPTS, num_samples=2, seed=0, max_new_tokens=1, do_sample=False, pad_token_id=0,
        eos_token_id=None, return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    with torch.no_grad():
        mean_logits = model(input_ids=PROMPTS).logits
    torch.testing.assert_close(log_mean_probs(out)[0], torch.log_softmax(mean_logits[:, -1] / 2.0, -1), atol=1e-5, rtol=0)
    noisy = posterior.with_ess(NOISY_ESS)
    hot = bma_log_likelihood(model, noisy.with_temperature(2.0), PROMPTS, num_samples=3, seed=9)
    per_sample = []
    for m in sampled_copies(model, noisy, 3, 9):
        with torch.no_grad():
            lp = torch.log_softmax(m(input_ids=PROMPTS).logits[:, :-1].float() / 2.0, -1)
        per_sample.append(lp.gather(-1, PROMPTS[:, 1:, None]).squeeze(-1))
    expected = torch.logsumexp(torch.stack(per_sample), 0) - math.log(3)
    torch.testing.assert_close(hot.token_log_probs, expected, atol=1e-5, rtol=0)
    plain = bma_log_likelihood(model, noisy, PROMPTS, num_samples=3, seed=9)
    assert (plain.token_log_probs - hot.token_log_probs).abs().max() > 1e-2


# ----------------------------------------------------------------------------- encoder-decoder models
def tiny_t5(seed: int = 0):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation="eager",
        initializer_factor=2.0,  # outputs that depend on the input
    )  # fmt: skip
    return T5ForConditionalGeneration(cfg).eval()


def tiny_bart(seed: int = 0):
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    cfg = BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
        attn_implementation="eager", init_std=0.5,  # outputs that depend on the input
    )  # fmt: skip
    return BartForConditionalGeneration(cfg).eval()


@pytest.fixture(scope="module", params=["t5", "bart"])
def seq2seq(request):
    model = tiny_t5() if request.param == "t5" else tiny_bart()
    return model, train_posterior(model)


@torch.no_grad()
def reference_seq2seq_greedy(copies: list, input_ids, attention_mask, start: int, new_tokens: int, forced=None):
    """Slow BMA of an encoder-decoder model: every sample its own model (encoder included), the
    decoder rerun on the whole prefix each step, mean of softmax, greedy; log p̄ per step.
    ``forced``: as :func:`reference_greedy`'s."""
    ids = torch.full((input_ids.shape[0], 1), start)
    scores = []
    for _ in range(new_tokens):
        log_probs = [
            torch.log_softmax(m(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=ids).logits[:, -1], -1)
            for m in copies
        ]
        log_mean = torch.logsumexp(torch.stack(log_probs), 0) - math.log(len(copies))  # no underflow to log 0
        scores.append(log_mean)
        step_ids = log_mean.argmax(-1, keepdim=True) if forced is None else forced[:, len(scores) - 1 : len(scores)]
        ids = torch.cat([ids, step_ids], dim=-1)
    return ids, scores


def test_encoder_decoder_zero_variance_equals_generate(strategy, seq2seq):
    model, posterior = seq2seq
    zero = posterior.with_ess(float("inf"))
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
    expected = model.generate(PROMPTS, **kwargs)
    assert len(set(expected.flatten().tolist())) > 2  # a sequence worth comparing
    assert torch.equal(generate_bma(model, zero, PROMPTS, num_samples=3, seed=0, **kwargs), expected)


def assert_rounded_predictive(logits: tuple, want: list[torch.Tensor], slack: float = 1e-10) -> None:
    """``logits`` (generate's per step: a float64 predictive's ``L = log p̄ + c``, which generate rounds
    to float32) are the float64 reference's ``log p̄`` (``want``) up to that rounding. Rounding moves
    each logit by at most half a float32 ulp, 2⁻²⁴·|L|, and ``log_softmax`` by at most twice the largest
    move in its row; ``slack`` covers the float64 sums taken in other orders (1e-15 to 5e-12 measured
    through these ill-conditioned tiny models, where a wrong sample or mask is off by more than 1e-3)."""
    assert len(logits) == len(want)
    for t, (got, ref) in enumerate(zip(logits, want, strict=True)):
        assert got.dtype == torch.float32 and ref.dtype == torch.float64
        bound = 2 * 2.0**-24 * got.double().abs().amax(-1) + slack
        off = (torch.log_softmax(got.double(), -1) - ref).abs().amax(-1)
        assert bool((off <= bound).all()), f"step {t}: log p̄ off the reference by {off.tolist()}, bound {bound.tolist()}"


def test_encoder_decoder_matches_slow_reference(strategy, seq2seq):
    """Each sample runs its own encoder (and cross-attention) over a padded batch: sequences and
    log p̄ equal S separate models'; the generated text scores the same under bma_log_likelihood.
    In float64 (model and posterior): these tiny random models are ill-conditioned (log p̄ to about
    -16), so float32 rounding alone put the batched path up to 1e-1 off the float64 reference (T5,
    seed 7) and up to 50x the float32 reference's own error (BART's factored samples, seed 7); in
    float64 it is within 5e-12 at seeds 1-9, and generate's float32 logits within their rounding of it."""
    model, posterior = seq2seq
    model = copy.deepcopy(model).double()
    noisy = posterior.with_ess(NOISY_ESS).to(torch.float64)
    before = snapshot(model)
    pad = model.config.pad_token_id
    ids = torch.tensor([[5, 9, 17, 3, 22, 8], [40, 41, 7, pad, pad, pad]])  # right-padded, as T5/BART take it
    mask = (torch.arange(6) < torch.tensor([[6], [3]])).long()
    num_samples, new, seed = 3, 8, 7
    out = generate_bma(
        model, noisy, ids, attention_mask=mask, num_samples=num_samples, seed=seed, max_new_tokens=new,
        do_sample=False, eos_token_id=None, return_dict_in_generate=True, output_scores=True,
        output_logits=True, output_attentions=True,
    )  # fmt: skip
    start = model.config.decoder_start_token_id
    picked = out.sequences[:, 1:]
    copies = sampled_copies(model, noisy, num_samples, seed)
    _, ref_scores = reference_seq2seq_greedy(copies, ids, mask, start, new, picked)
    assert_rounded_predictive(out.logits, ref_scores)
    # each pick is the argmax of the rounded logits: the reference's, up to twice their rounding
    rounding = max(float(2 * 2.0**-24 * step.abs().max()) for step in out.logits)
    assert_reference_argmax(picked, ref_scores, tol=2 * (rounding + 1e-10))
    # what generate's own outputs carry: per-sample encoder and decoder attentions (S·B rows)
    assert type(out).__name__ == "GenerateEncoderDecoderOutput"
    assert out.encoder_attentions[0].shape[0] == num_samples * 2
    assert len(out.decoder_attentions) == len(out.cross_attentions) == new
    # the samples differ: not the mean model's prediction
    with torch.no_grad():
        mean_first = model(input_ids=ids, attention_mask=mask, decoder_input_ids=out.sequences[:, :1]).logits[:, -1]
    assert (log_mean_probs(out)[0] - torch.log_softmax(mean_first, -1)).abs().max() > 1e-2
    # the generated continuation scored as labels: the reference's log p̄ of each chosen token, in float64
    labels = out.sequences[:, 1:]
    scored = bma_log_likelihood(model, noisy, ids, attention_mask=mask, labels=labels, num_samples=num_samples, seed=seed)
    assert scored.token_log_probs.shape == labels.shape and bool(scored.mask.all())
    assert scored.token_log_probs.dtype == torch.float64
    for t in range(new):
        want = ref_scores[t].gather(-1, labels[:, t : t + 1]).squeeze(-1)
        torch.testing.assert_close(scored.token_log_probs[:, t], want, atol=1e-10, rtol=0)
    assert_unchanged(model, before)


def test_encoder_decoder_scoring_needs_labels_and_refuses_encoder_outputs(seq2seq):
    model, posterior = seq2seq
    with pytest.raises(ValueError, match="labels"):
        bma_log_likelihood(model, posterior, PROMPTS, num_samples=2)
    encoded = model.get_encoder()(input_ids=PROMPTS)
    with pytest.raises(ValueError, match="encoder_outputs"):
        generate_bma(model, posterior, PROMPTS, num_samples=2, max_new_tokens=2, encoder_outputs=encoded)
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("given", [False, True], ids=["model-config", "given-config"])
def test_encoder_outputs_the_models_generation_config_asks_for_are_returned(given):
    """``output_attentions`` / ``output_hidden_states`` set in the model's generation_config (also
    beside a given ``generation_config`` that leaves them unset, whose unset fields generate fills
    from the model's) reach the decoder's outputs but not the samples' encoder: the result held
    ``encoder_attentions=None`` and ``encoder_hidden_states=None`` where model.generate returns
    them. At zero variance every sample's encoder is the mean's: generate's, once per sample."""
    from transformers import GenerationConfig

    model = tiny_t5()
    zero = train_posterior(model).with_ess(float("inf"))
    model.generation_config.update(output_attentions=True, output_hidden_states=True, return_dict_in_generate=True)
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    call = dict(generation_config=GenerationConfig(**kwargs)) if given else kwargs
    want = model.generate(PROMPTS, **call)
    got = generate_bma(model, zero, PROMPTS, num_samples=2, seed=0, **call)
    assert torch.equal(got.sequences, want.sequences)
    for key in ("encoder_attentions", "encoder_hidden_states"):
        assert getattr(got, key) is not None, key
        assert len(getattr(got, key)) == len(getattr(want, key))
        for a, b in zip(getattr(got, key), getattr(want, key), strict=True):
            torch.testing.assert_close(a, b.repeat(2, *[1] * (b.dim() - 1)), atol=1e-6, rtol=1e-5)


def test_a_dynamic_cache_setting_given_or_configured_decodes_as_without_it(gpt2):
    """``cache_implementation="dynamic"`` passed the call's check and then made transformers refuse
    "both cache_implementation and cache"; a model whose generation_config sets a cache (a Hub
    config's "static") failed the same way, and ``generation_config=`` drew a deprecation warning
    for a ``use_cache`` the user never passed. BMA keeps its own dynamic cache in every case."""
    from transformers import GenerationConfig

    model, posterior = gpt2
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, **kw)
    assert torch.equal(generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, cache_implementation="dynamic", **kw), want)
    configured = copy.deepcopy(model)
    configured.generation_config.cache_implementation = "static"
    assert torch.equal(generate_bma(configured, posterior, PROMPTS, num_samples=2, seed=0, **kw), want)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*generation_config.*deprecated")
        got = generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, generation_config=GenerationConfig(**kw))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="cache_implementation must be unset"):
        generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, cache_implementation="static", **kw)


def test_a_configured_cache_setting_beside_a_given_generation_config_decodes_as_without_it(gpt2):
    """generate fills a given ``generation_config``'s unset fields from the model's own: a model
    whose generation_config sets a cache ("static", as some Hub configs do), called with
    ``generation_config=``, had transformers refuse "both cache_implementation and cache". BMA keeps
    its own dynamic cache there too, and the model's setting is as it was after the call."""
    from transformers import GenerationConfig

    model, posterior = gpt2
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, **kw)
    configured = copy.deepcopy(model)
    configured.generation_config.cache_implementation = "static"
    got = generate_bma(configured, posterior, PROMPTS, num_samples=2, seed=0, generation_config=GenerationConfig(**kw))
    assert torch.equal(got, want)
    assert configured.generation_config.cache_implementation == "static"


@pytest.mark.parametrize(
    "setting", [dict(use_cache=False), dict(cache_implementation="dynamic")], ids=["use_cache", "cache_implementation"]
)
def test_a_cache_setting_beside_a_given_generation_config_decodes_as_without_it(gpt2, setting):
    """A keyword beside ``generation_config=`` overrides the config in generate: ``use_cache=False``
    there made generate re-feed the whole sequence to the samples' cache, which appended it again
    (other tokens, silently), and ``cache_implementation="dynamic"`` had transformers refuse "both
    cache_implementation and cache". Both decode as without them, as the keywords alone do."""
    from transformers import GenerationConfig

    model, posterior = gpt2
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, **kw)
    assert torch.equal(generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, **kw, **setting), want)
    config = GenerationConfig(**kw)  # its unset eos_token_id: the model's, as generate fills it
    want = generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, generation_config=config)
    got = generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, generation_config=config, **setting)
    assert torch.equal(got, want)


def test_a_hybrid_cache_setting_given_decodes_as_without_it(gpt2):
    """generate takes ``cache_implementation="hybrid"`` (what Gemma 2's Hub generation_config.json
    holds) as unset, and decodes with its dynamic cache; generate_bma refused it ("cache_implementation
    must be unset"), given as a keyword or in a given ``generation_config``."""
    from transformers import GenerationConfig

    model, posterior = gpt2
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, **kw)
    config = GenerationConfig(cache_implementation="hybrid", **kw)
    assert torch.equal(model.generate(PROMPTS, generation_config=config), model.generate(PROMPTS, **kw))
    assert torch.equal(generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, generation_config=config), want)
    assert config.cache_implementation == "hybrid"  # the caller's config is left as it was
    got = generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, cache_implementation="hybrid", **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(do_sample=True, top_k=10), dict(num_beams=3)])
def test_prefix_allowed_tokens_fn_constrains_as_in_generate(gpt2, mode):
    """``prefix_allowed_tokens_fn`` (generate's constrained decoding for greedy, sampling and beam
    search: a processor on the N rows' ids) was refused ("generate_bma does not support"). At zero
    variance it decodes as model.generate (sampling from the generator the seed sets); with noise
    every new token is one the function allows for its row's prefix."""
    from hf_evon.optim.noise import derived_seed

    model, posterior = gpt2

    def allowed(batch_id: int, prefix: torch.Tensor) -> list[int]:
        return [10 + batch_id, 20 + int(prefix[-1]) % 7, 30 + int(prefix[-1]) % 5]

    kwargs = dict(max_new_tokens=6, pad_token_id=0, eos_token_id=None, prefix_allowed_tokens_fn=allowed, **mode)
    torch.manual_seed(derived_seed(4, "tokens"))  # the token seed generate_bma sets for seed=4
    want = model.generate(PROMPTS, **kwargs)
    assert not torch.equal(want, model.generate(PROMPTS, **{k: v for k, v in kwargs.items() if k != "prefix_allowed_tokens_fn"}))
    assert torch.equal(generate_bma(model, posterior.with_ess(float("inf")), PROMPTS, num_samples=2, seed=4, **kwargs), want)
    out = generate_bma(model, posterior.with_ess(NOISY_ESS), PROMPTS, num_samples=3, seed=4, **kwargs)
    for row in range(out.shape[0]):
        for t in range(PROMPTS.shape[1], out.shape[1]):
            assert int(out[row, t]) in allowed(row, out[row, :t]), (row, t)


def test_generate_bma_seeds_that_differ_by_a_multiple_of_2_to_the_32_sample_distinct_tokens(gpt2):
    """The token seed was (seed * 2654435761 + 1) % 2**63, and torch's CPU generator keeps a seed's
    low 32 bits: seeds 0 and 2**32 (or -1 and 2**63 - 1) sampled identical tokens. The token seed is
    the seed's stream "tokens" (derived_seed, a hash of the seed), as every weight matrix's is."""
    from hf_evon.optim.noise import derived_seed

    model, posterior = gpt2
    mean = posterior.with_ess(float("inf"))  # the weights are the mean whatever the seed: tokens alone differ
    kwargs = dict(max_new_tokens=8, do_sample=True, pad_token_id=0, eos_token_id=None)
    for pair in ((0, 2**32), (-1, 2**63 - 1)):
        outs = [generate_bma(model, mean, PROMPTS, num_samples=2, seed=seed, **kwargs) for seed in pair]
        assert not torch.equal(*outs), pair
        for seed, out in zip(pair, outs):
            torch.manual_seed(derived_seed(seed, "tokens"))
            assert torch.equal(out, model.generate(PROMPTS, **kwargs)), seed


def test_bma_log_likelihood_names_a_plain_module_whose_forward_takes_no_token_ids():
    """A plain torch LM (``forward(x)``, logits out) got torch's "LM.forward() got an unexpected keyword
    argument 'input_ids'" from inside the sample probe; the refusal now names the function, the model
    and what it calls, with the way out, before any sample is written."""
    from hf_evon import EVON

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.out = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(x))

    model = LM()
    optimizer = EVON([model.out.weight], seed=0)
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    with optimizer.sampled_params(train=True):
        torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    optimizer.step()
    posterior = EVONPosterior.from_optimizer(optimizer, model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"^bma_log_likelihood: LM\.forward takes no input_ids.*posterior\.sampled"):
        bma_log_likelihood(model, posterior, ids, num_samples=2)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_bma_log_likelihood_names_labels_that_are_not_token_ids(gpt2):
    """Labels that index no token (-1 for "no label", an id past the vocabulary, a float) are
    refused by name, and the model is not left sampled (before: torch's index error after the
    whole S·B forward, a device-side assert on a GPU)."""
    model, posterior = gpt2
    before = [p.detach().clone() for p in model.parameters()]
    vocab = model.config.vocab_size
    for bad, match in ((-1, "label -1"), (vocab, f"label {vocab}")):
        labels = PROMPTS.clone()
        labels[1, 3] = bad
        with pytest.raises(ValueError, match=rf"bma_log_likelihood: labels have {match}, outside"):
            bma_log_likelihood(model, posterior, PROMPTS, labels=labels, num_samples=2)
    with pytest.raises(ValueError, match="bma_log_likelihood: labels has floating-point labels"):
        bma_log_likelihood(model, posterior, PROMPTS, labels=PROMPTS.float(), num_samples=2)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    labels = PROMPTS.clone()
    labels[:, :2] = -100  # ignored targets stay fine
    assert bma_log_likelihood(model, posterior, PROMPTS, labels=labels, num_samples=2).mask[:, :1].sum() == 0


# ----------------------------------------------------------------------------- beam search
MAKERS = {"llama": tiny_llama, "t5": tiny_t5, "bart": tiny_bart}
BEAMS = dict(max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=None)


def _model_and_posterior(arch: str, gpt2):
    if arch == "gpt2":
        return gpt2
    model = MAKERS[arch]()
    return model, train_posterior(model)


def slow_bma_model(model, copies: list, encoder_ids=None, num_beams: int = 1, recorded: list | None = None):
    """A copy of ``model`` whose forward is the BMA predictive computed slowly: every sample its own
    model (and own encoder, run on ``encoder_ids`` repeated per beam), the whole prefix each step (no
    cache), float64, logits ``log p̄``. ``generate(num_beams=...)`` on it is the reference.
    ``recorded`` gets each call's float64 ``log p̄`` of the last position (generate keeps float32)."""
    ref = copy.deepcopy(model)

    @functools.wraps(ref.forward)
    def forward(**kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "use_cache", "encoder_outputs")}
        if encoder_ids is not None:
            kwargs["input_ids"] = encoder_ids.repeat_interleave(num_beams, 0)
        outs = [_forward_model(m)(**kwargs, use_cache=False) for m in copies]
        log_probs = torch.stack([torch.log_softmax(o.logits.double(), -1) for o in outs])
        outs[0].logits = torch.logsumexp(log_probs, 0) - math.log(len(copies))
        if recorded is not None:
            recorded.append(outs[0].logits[:, -1].clone())
        return outs[0]

    ref.forward = forward
    return ref


@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5", "bart"])
def test_beam_search_zero_variance_equals_generate(gpt2, arch):
    """Beam search was refused. It now runs generate's own beam search on the BMA predictive: at
    zero variance the beams, their scores and the returned sequences are generate's."""
    model, posterior = _model_and_posterior(arch, gpt2)
    kwargs = dict(BEAMS, num_return_sequences=2, return_dict_in_generate=True, output_scores=True)
    expected = model.generate(PROMPTS, **kwargs)
    got = generate_bma(model, posterior.with_ess(float("inf")), PROMPTS, num_samples=2, seed=0, **kwargs)
    assert torch.equal(got.sequences, expected.sequences) and got.sequences.shape[0] == 4
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5", "bart"])
def test_beam_search_matches_slow_reference(strategy, gpt2, arch):
    """With a wide posterior the beams are those of generate's beam search on S separate models'
    averaged probabilities (each its own encoder), and the sequence scores theirs; the cache of
    S·B·beams rows follows every sample's beams (a reorder by the B·beams indices alone fails).
    In float64 (model and posterior), as test_encoder_decoder_matches_slow_reference: float32
    rounding through the tiny T5 and BART put log p̄ up to ~1e-2 off the float64 reference."""
    model, posterior = _model_and_posterior(arch, gpt2)
    model = copy.deepcopy(model).double()
    noisy = posterior.with_ess(NOISY_ESS).to(torch.float64)
    before = snapshot(model)
    seed = 7
    kwargs = dict(BEAMS, num_return_sequences=2, return_dict_in_generate=True, output_scores=True, length_penalty=0.5)
    out = generate_bma(model, noisy, PROMPTS, num_samples=3, seed=seed, output_logits=True, **kwargs)
    encoder_ids = PROMPTS if arch in ("t5", "bart") else None
    recorded = []
    ref = slow_bma_model(model, sampled_copies(model, noisy, 3, seed), encoder_ids, BEAMS["num_beams"], recorded)
    want = ref.generate(PROMPTS, use_cache=False, output_logits=True, **kwargs)
    assert torch.equal(out.sequences, want.sequences)
    assert len(out.logits) == BEAMS["max_new_tokens"]
    assert_rounded_predictive(out.logits, recorded)
    # generate scores the beams in float32 on both sides, from logits (ours log p̄ + c, the reference's
    # log p̄) of the same float64 log p̄ up to 1e-10: per side, each of the n steps adds the logits'
    # rounding and log_softmax's two (an ulp of M each, M the largest |logit| or |log p̄|) and the
    # running sum's (half an ulp of n·M): within n·(n + 2)·eps·M of the exact score, for each side
    n = BEAMS["max_new_tokens"]
    largest = max(
        float(x.abs().max()) for step in (*out.logits, *want.logits) for x in (step, torch.log_softmax(step, -1))
    )
    bound = 2 * n * (n + 2) * torch.finfo(torch.float32).eps * largest
    torch.testing.assert_close(out.sequences_scores, want.sequences_scores, atol=bound, rtol=0)
    # the samples change the beams' scores: not the mean model's
    mean = model.generate(PROMPTS, **kwargs)
    assert (out.sequences_scores - mean.sequences_scores).abs().max() > 1e-2
    assert_unchanged(model, before)
    assert "forward" not in model.__dict__


def test_token_seed_samples_other_tokens_from_the_same_weight_samples(gpt2):
    """``token_seed`` seeds the token sampling alone (``seed``'s when unset): another stream of tokens,
    reproducible, from the weight samples of ``seed``, which greedy decoding shows unchanged."""
    model, posterior = gpt2
    noisy = posterior.with_ess(NOISY_ESS)
    kwargs = dict(num_samples=2, seed=3, max_new_tokens=6, do_sample=True, pad_token_id=0)
    base = generate_bma(model, noisy, PROMPTS, **kwargs)
    assert torch.equal(base, generate_bma(model, noisy, PROMPTS, token_seed=3, **kwargs))
    other = generate_bma(model, noisy, PROMPTS, token_seed=4, **kwargs)
    assert not torch.equal(base, other)
    assert torch.equal(other, generate_bma(model, noisy, PROMPTS, token_seed=4, **kwargs))
    greedy = dict(kwargs, do_sample=False)
    assert torch.equal(generate_bma(model, noisy, PROMPTS, token_seed=4, **greedy), generate_bma(model, noisy, PROMPTS, **greedy))
    assert not torch.equal(generate_bma(model, noisy, PROMPTS, **dict(greedy, seed=9)), generate_bma(model, noisy, PROMPTS, **greedy))


@pytest.mark.parametrize("token_seed", [1.5, "3", True])
def test_a_token_seed_that_is_no_integer_is_refused_naming_token_seed(gpt2, token_seed):
    """A token_seed that is no integer, beside a valid seed, was refused as "seed must be an integer
    (or None); got 1.5": the argument named was the valid one."""
    model, posterior = gpt2
    before = snapshot(model)
    with pytest.raises(TypeError, match=rf"^generate_bma: token_seed must be an integer \(or None\); got {re.escape(repr(token_seed))}$"):
        generate_bma(model, posterior, PROMPTS, num_samples=2, seed=3, token_seed=token_seed, do_sample=True, max_new_tokens=2)
    assert_unchanged(model, before)


def test_beam_sampling_is_reproducible_with_a_seed_and_leaves_the_global_generator(gpt2):
    model, posterior = gpt2
    kwargs = dict(BEAMS, do_sample=True, top_k=10)
    state = torch.random.get_rng_state()
    first = generate_bma(model, posterior.with_ess(NOISY_ESS), PROMPTS, num_samples=2, seed=3, **kwargs)
    assert torch.equal(torch.random.get_rng_state(), state)
    again = generate_bma(model, posterior.with_ess(NOISY_ESS), PROMPTS, num_samples=2, seed=3, **kwargs)
    assert torch.equal(first, again)
    others = [generate_bma(model, posterior.with_ess(NOISY_ESS), PROMPTS, num_samples=2, seed=s, **kwargs) for s in (4, 5)]
    assert any(not torch.equal(first, o) for o in others)


def test_seeded_sampling_on_cuda_device_0_seeds_that_devices_generator(gpt2, monkeypatch):
    """Tokens sampled for inputs on cuda:0 draw from cuda:0's generator: a seeded call seeds that
    one, whichever device is current. ``device.index or current_device()`` took index 0 for "no
    index" and seeded the current device's (cuda:1 here), leaving cuda:0's unseeded (a seeded call
    not reproducible) and cuda:1's reseeded for good (fork_rng restores only the device named).
    Two stand-in generators, no GPU needed: the block's own seeding is what is checked."""
    import contextlib

    from hf_evon.predictive import bma_forward

    model, posterior = gpt2
    generators = (torch.Generator().manual_seed(100), torch.Generator().manual_seed(101))
    monkeypatch.setattr(torch.cuda, "default_generators", generators)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.random, "fork_rng", lambda **kwargs: contextlib.nullcontext())
    with bma_forward.on_the_predictive(model, posterior, 2, torch.device("cuda", 0), token_seed=12345):
        seeds = [g.initial_seed() for g in generators]
    assert seeds == [12345, 101]
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_dora_adapters_are_refused_by_batched_bma():
    """DoRA builds each adapter's weight as lora_B(lora_A(I)) for its norm: the identity's rows
    went through the sample-major forward as if they were S·B batch rows, so every sample's norm
    mixed the other samples' rows (a 3e-3 error per sample's loss, silent wherever S divides the
    layer's width)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, use_dora=True)
    model = peft.get_peft_model(tiny_gpt2(seed=2), config)
    posterior = train_posterior(model)
    with refused("DoRA"):
        batched_refusal(model, posterior, PROMPTS)
    assert not any("forward" in m.__dict__ for m in model.modules())
    # bma_log_likelihood scores it one draw at a time: the slow reference's log-probabilities
    scored = bma_log_likelihood(model, posterior, PROMPTS, labels=PROMPTS, num_samples=2, seed=0)
    reference = reference_log_probs(model, posterior, PROMPTS, 2, 0)
    torch.testing.assert_close(scored.sample_token_log_probs, reference, atol=1e-5, rtol=1e-5)
    # generate_bma decodes it one draw at a time: the slow reference's tokens
    before = snapshot(model)
    out = generate_bma(
        model, posterior, PROMPTS, num_samples=2, seed=0, max_new_tokens=3, pad_token_id=0, eos_token_id=None,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert_unchanged(model, before)
    new_ids = out.sequences[:, PROMPTS.shape[1] :]
    assert_reference_argmax(new_ids, reference_greedy(sampled_copies(model, posterior, 2, 0), PROMPTS, None, 3, new_ids)[1])


def test_peft_adapter_names_are_refused_by_name():
    """PEFT's ``generate(adapter_names=[...])`` (a batch mixing adapters) runs sub-batches of rows
    through each adapter's layers, which the samples' batched forward cannot split by sample:
    generate_bma passed it on, and transformers answered that the model does not use
    ``adapter_names`` ("typos in the generate arguments"), though the PEFT model does."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    model = peft.get_peft_model(tiny_gpt2(seed=2), config)
    posterior = train_posterior(model)
    kwargs = dict(max_new_tokens=2, do_sample=False, pad_token_id=0, adapter_names=["default", "default"])
    assert model.generate(input_ids=PROMPTS, **kwargs).shape == (2, PROMPTS.shape[1] + 2)
    with pytest.raises(ValueError, match=r"generate_bma does not support 'adapter_names'"):
        generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, **kwargs)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_beam_search_of_a_peft_lora_posterior():
    """Beam search on a LoRA model: the forward that averages is the LoRA-injected base model's."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0, fan_in_fan_out=True)
    model = peft.get_peft_model(tiny_gpt2(seed=2), config)
    posterior = train_posterior(model)
    model.double()  # as test_peft_lora_posterior: the noise is ~10x the adapters' weights
    posterior = posterior.to(dtype=torch.float64)
    kwargs = dict(BEAMS, return_dict_in_generate=True, output_scores=True)
    zero = generate_bma(model, posterior.with_ess(float("inf")), PROMPTS, num_samples=2, seed=0, **kwargs)
    assert torch.equal(zero.sequences, model.generate(input_ids=PROMPTS, **kwargs).sequences)
    noisy = posterior.with_ess(NOISY_ESS / 10)
    out = generate_bma(model, noisy, PROMPTS, num_samples=3, seed=4, **kwargs)
    ref = slow_bma_model(model.get_base_model(), sampled_copies(model, noisy, 3, 4))
    want = ref.generate(PROMPTS, use_cache=False, **kwargs)
    assert torch.equal(out.sequences, want.sequences)
    torch.testing.assert_close(out.sequences_scores, want.sequences_scores.to(out.sequences_scores.dtype), atol=1e-6, rtol=0)
    assert (out.sequences_scores - zero.sequences_scores).abs().max() > 1e-3  # the adapters' noise matters


def test_beams_from_the_models_generation_config():
    """A checkpoint whose generation config asks for beams (BART's summarisation models ship
    num_beams=4) decoded nothing: generate_bma refused it. It now beam-searches as generate does."""
    model = tiny_bart()
    posterior = train_posterior(model).with_ess(NOISY_ESS)
    model.generation_config.num_beams = 3
    kwargs = dict(max_new_tokens=8, eos_token_id=None, num_samples=3, seed=1)
    from_config = generate_bma(model, posterior, PROMPTS, **kwargs)
    assert torch.equal(from_config, generate_bma(model, posterior, PROMPTS, num_beams=3, **kwargs))
    # beams were searched: generate's beam output (whether the beams' best equals the greedy
    # sequence depends on float32 near-ties, so the output type is what tells)
    searched = generate_bma(model, posterior, PROMPTS, return_dict_in_generate=True, **kwargs)
    assert type(searched).__name__ == "GenerateBeamEncoderDecoderOutput" and torch.equal(searched.sequences, from_config)
    greedy = generate_bma(model, posterior, PROMPTS, num_beams=1, return_dict_in_generate=True, **kwargs)
    assert type(greedy).__name__ == "GenerateEncoderDecoderOutput"


def tiny_bert_mlm(seed: int = 0):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    return BertForMaskedLM(cfg).eval()


def test_a_model_that_cannot_generate_is_refused_by_name():
    """generate_bma on a masked LM (no generate) failed with AttributeError "'BertForMaskedLM' object
    has no attribute 'generation_config'", deep in the call's config handling."""
    model = tiny_bert_mlm()
    posterior = train_posterior(model)
    with pytest.raises(TypeError, match=r"generate_bma: model \(BertForMaskedLM\) cannot generate"):
        generate_bma(model, posterior, PROMPTS, num_samples=2, max_new_tokens=2)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_model_without_token_logits_is_refused_by_name():
    """A sequence classifier's logits, one distribution per sequence, give none per label position:
    bma_log_likelihood failed inside torch's gather ("Index tensor must have the same number of
    dimensions as input tensor"). It names the logits' and the labels' shapes."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, num_labels=3)
    model = BertForSequenceClassification(cfg)
    opt = hf_evon.build_optimizer(model, lr=1e-2, ess=1e4, seed=0)
    with opt.sampled_params(train=True):
        model(input_ids=PROMPTS, labels=torch.tensor([0, 2])).loss.backward()
    opt.step()
    posterior = EVONPosterior.from_optimizer(opt, model)
    model.eval()
    before = snapshot(model)
    match = r"bma_log_likelihood: the model's logits \(2, 3\) hold no distribution per position of labels \(2, 6\)"
    with pytest.raises(ValueError, match=match):
        bma_log_likelihood(model, posterior, PROMPTS, labels=torch.zeros_like(PROMPTS), num_samples=2, seed=0)
    assert_unchanged(model, before)


def test_a_masked_lm_scores_its_labels_unshifted_as_its_own_loss():
    """A masked LM's labels are not next tokens: position t scores labels[:, t], as its loss does
    (and calibrate_posterior, by the one is_causal_lm rule). bma_log_likelihood shifted them as a
    causal LM's and scored each masked position's neighbour instead."""
    model = tiny_bert_mlm()
    posterior = train_posterior(model).with_ess(NOISY_ESS)
    labels = torch.full_like(PROMPTS, -100)
    labels[0, 2], labels[1, 0], labels[1, 5] = 17, 40, 12
    masked = PROMPTS.masked_fill(labels != -100, 4)
    result = bma_log_likelihood(model, posterior, masked, labels=labels, num_samples=3, seed=5)
    per_sample = []
    for m in sampled_copies(model, posterior, 3, 5):
        with torch.no_grad():
            log_probs = torch.log_softmax(m(input_ids=masked).logits.double(), -1)
        per_sample.append(log_probs.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1))
    expected = (torch.logsumexp(torch.stack(per_sample), 0) - math.log(3)) * (labels != -100)
    assert result.token_log_probs.shape == labels.shape and torch.equal(result.mask, labels != -100)
    torch.testing.assert_close(result.token_log_probs.double(), expected, atol=1e-5, rtol=0)
    with posterior.sampled(model, seed=5), torch.no_grad():  # one draw: the first of the seed's
        own_loss = model(input_ids=masked, labels=labels).loss
    one = bma_log_likelihood(model, posterior, masked, labels=labels, num_samples=1, seed=5)
    torch.testing.assert_close(one.loss, own_loss, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m, p: generate_bma(m, p, torch.tensor([5, 6, 7]), num_samples=2), r"input_ids must be a \(batch, length\) integer tensor of token ids; got torch.int64 shaped \(3,\)"),
        (lambda m, p: generate_bma(m, p, torch.ones(1, 3), num_samples=2), r"integer tensor of token ids; got torch.float32 shaped \(1, 3\)"),
        (lambda m, p: bma_log_likelihood(m, p, torch.ones(1, 3), num_samples=2), r"integer tensor of token ids; got torch.float32 shaped"),
        (lambda m, p: generate_bma(m, p, [[5, 6]], num_samples=2), r"got list"),
        (lambda m, p: generate_bma(m, p, torch.zeros(1, 0, dtype=torch.long), num_samples=2), r"input_ids is empty"),
        (lambda m, p: generate_bma(m, p, torch.tensor([[5, VOCAB]]), num_samples=2), r"outside the model's vocabulary"),
        (lambda m, p: generate_bma(m, p, torch.tensor([[5, 6]]), attention_mask=torch.ones(1, 3), num_samples=2), r"attention_mask must have input_ids' shape \(1, 2\); got \(1, 3\)"),
        (lambda m, p: generate_bma(m, None, torch.tensor([[5, 6]]), num_samples=2), r"posterior must be an EVONPosterior; got NoneType"),
        (lambda m, p: bma_log_likelihood(m, p, torch.tensor([[5, 6, 7], [8, 9, 10]]), labels=torch.tensor([[5, 6, 7]])), r"labels must have input_ids' shape \(2, 3\); got \(1, 3\)"),
    ],
)  # fmt: skip
def test_bad_token_inputs_are_refused_by_name(gpt2, call, match) -> None:
    # they failed deep inside torch (IndexError, a reshape error) or, for labels and a T5's mask of
    # another length, silently scored or decoded something else
    model, posterior = gpt2
    with pytest.raises((ValueError, TypeError), match=match):
        call(model, posterior)


@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_generates_inputs_keyword_is_the_prompt_as_in_generate(gpt2, arch):
    """``model.generate(inputs=ids)`` takes the prompt (an encoder-decoder's encoder input) by its
    own first parameter's name; generate_bma refused it as "input_ids must be a (batch, length)
    tensor of token ids; got NoneType", as if no prompt had been given. At zero variance it decodes
    as generate; beside input_ids it is refused naming both, as generate refuses them."""
    model, posterior = gpt2 if arch == "gpt2" else (tiny_t5(), None)
    if posterior is None:
        posterior = train_posterior(model)
    zero = posterior.with_ess(float("inf"))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = model.generate(inputs=PROMPTS, **kwargs)
    assert torch.equal(generate_bma(model, zero, inputs=PROMPTS, num_samples=2, seed=0, **kwargs), expected)
    with pytest.raises(ValueError, match="generate_bma: inputs and input_ids both given"):
        generate_bma(model, zero, PROMPTS, inputs=PROMPTS, num_samples=2, **kwargs)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_generates_inputs_keyword_is_a_feature_encoders_input(feature_seq2seq):
    """``inputs=`` is a Whisper's or VisionEncoderDecoder's encoder input too (its ``input_features``,
    ``pixel_values``): generate_bma said "reads {name}, not token ids: give {name}=...; got neither"."""
    model, name, features, posterior = feature_seq2seq
    zero = posterior.with_ess(float("inf"))
    kwargs = dict(max_new_tokens=4, do_sample=False, eos_token_id=None)
    expected = model.generate(**{name: features}, **kwargs)
    assert torch.equal(generate_bma(model, zero, inputs=features, num_samples=2, seed=0, **kwargs), expected)
    with pytest.raises(ValueError, match=f"generate_bma: inputs and {name} both given"):
        generate_bma(model, zero, inputs=features, **{name: features}, num_samples=2, **kwargs)


def test_inputs_beside_token_ids_for_a_feature_encoder_names_the_token_ids(feature_seq2seq):
    """A Whisper's (or VisionEncoderDecoder's) ``inputs=`` beside ``input_ids`` was refused as
    "inputs and input_features both given", naming an input the call never had; it names input_ids."""
    model, name, features, posterior = feature_seq2seq
    ids = torch.ones(len(features), 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^generate_bma: inputs and input_ids both given"):
        generate_bma(model, posterior, ids, inputs=features, num_samples=2, max_new_tokens=2)


@pytest.mark.parametrize("call", ["generate_bma", "bma_log_likelihood"])
def test_inputs_embeds_without_input_ids_is_refused_by_name(gpt2, call):
    """A prompt given as ``inputs_embeds`` alone (which ``model.generate`` and the model's forward
    take) was refused as "input_ids must be a (batch, length) tensor of token ids; got NoneType"
    (generate_bma) or "got inputs_embeds, which GPT2LMHeadModel does not read" (bma_log_likelihood,
    though the model reads it); the refusal names inputs_embeds and asks for the token ids, from
    which each sample embeds the prompt with its own covered embedding."""
    model, posterior = gpt2
    embeds = model.transformer.wte(PROMPTS).detach()
    with pytest.raises(ValueError, match=rf"{call}: inputs_embeds without input_ids"):
        if call == "generate_bma":
            generate_bma(model, posterior, inputs_embeds=embeds, num_samples=2, max_new_tokens=2, pad_token_id=0)
        else:
            bma_log_likelihood(model, posterior, inputs_embeds=embeds, num_samples=2)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_inputs_embeds_beside_input_ids_warns_where_the_input_embedding_is_covered(gpt2):
    """``inputs_embeds`` beside ``input_ids``: ``generate`` embeds the prompt from the caller's embeddings,
    so the samples of a covered input embedding reach only the generated tokens, and generate_bma said
    nothing. It warns, naming the embedding, where the posterior covers it; not where it leaves it out."""
    model = tiny_gpt2()
    covered = train_posterior(model, evon_patterns=["wte"])
    assert "transformer.wte.weight" in covered.names
    embeds = model.transformer.wte(PROMPTS).detach()
    kwargs = dict(num_samples=2, seed=0, max_new_tokens=2, pad_token_id=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate_bma(model, covered, PROMPTS, inputs_embeds=embeds, **kwargs)
    named = [w for w in caught if "inputs_embeds" in str(w.message)]
    assert len(named) == 1 and "'transformer.wte.weight'" in str(named[0].message), [str(w.message) for w in caught]

    model, left_out = gpt2
    assert not any("wte" in name or "lm_head" in name for name in left_out.names)
    embeds = model.transformer.wte(PROMPTS).detach()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate_bma(model, left_out, PROMPTS, inputs_embeds=embeds, **kwargs)
    assert not [w for w in caught if "inputs_embeds" in str(w.message)]


def test_an_input_bma_log_likelihood_does_not_pass_on_is_refused_without_claiming_the_model_ignores_it(gpt2):
    """``token_type_ids`` (which GPT-2's forward reads) was refused as "got token_type_ids, which
    GPT2LMHeadModel does not read; it reads input_ids", a false reason; the refusal says what
    bma_log_likelihood runs the model on."""
    model, posterior = gpt2
    with pytest.raises(TypeError) as refusal:
        bma_log_likelihood(model, posterior, PROMPTS, token_type_ids=torch.zeros_like(PROMPTS), num_samples=2)
    assert str(refusal.value) == (
        "bma_log_likelihood: got token_type_ids; it runs the model on input_ids, attention_mask and labels alone"
    )


def test_use_cache_false_generates_as_the_cached_call(gpt2):
    """generate_bma hands generate its own cache; with use_cache=False (given, or in the model's
    config, as after gradient-checkpointed training) generate re-fed the whole sequence each step
    and the cache appended it again: other tokens than the cached call's, silently."""
    model, posterior = gpt2
    noisy = posterior.with_ess(NOISY_ESS)
    kwargs = dict(num_samples=3, seed=5, max_new_tokens=6, do_sample=False)
    cached = generate_bma(model, noisy, PROMPTS, **kwargs)
    assert torch.equal(generate_bma(model, noisy, PROMPTS, use_cache=False, **kwargs), cached)
    saved = model.config.use_cache, model.generation_config.use_cache
    model.config.use_cache = model.generation_config.use_cache = False
    try:
        assert torch.equal(generate_bma(model, noisy, PROMPTS, **kwargs), cached)
    finally:
        model.config.use_cache, model.generation_config.use_cache = saved


def test_a_covered_position_embedding_scores_without_a_mask():
    """GPT-2 builds (1, T) position ids itself when none are given: a covered wpe then saw one row
    for S·B and bma_log_likelihood raised without an attention mask (with one it worked)."""
    model = tiny_gpt2()
    posterior = train_posterior(model, evon_patterns=["wpe"]).with_ess(NOISY_ESS)
    assert "transformer.wpe.weight" in posterior.names
    bare = bma_log_likelihood(model, posterior, PROMPTS, num_samples=3, seed=1)
    masked = bma_log_likelihood(model, posterior, PROMPTS, torch.ones_like(PROMPTS), num_samples=3, seed=1)
    torch.testing.assert_close(bare.token_log_probs, masked.token_log_probs, rtol=0, atol=0)


def test_an_embedding_subclass_with_a_forward_of_its_own_is_refused():
    """A scaled word embedding (Gemma's, BART's scale_embedding) multiplies nn.Embedding's output:
    batched BMA replaced its forward by the plain lookup, dropping the scale silently."""

    class Scaled(torch.nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * 8.0

    model = tiny_gpt2()
    scaled = Scaled(VOCAB, model.config.n_embd)
    scaled.weight = model.transformer.wte.weight  # still tied to the head
    model.transformer.wte = scaled
    posterior = train_posterior(model, evon_patterns=["wte"])
    assert "transformer.wte.weight" in posterior.names
    with refused(r"'transformer.wte.weight' belongs to a Scaled"):
        batched_refusal(model, posterior, PROMPTS)


def test_a_second_batched_block_on_one_model_is_refused():
    """Two blocks on one model (nested, re-entered, or two threads' generate_bma) stacked their
    forwards: an outer exit first left the inner's samples in the plain model for good, and a
    re-entered object's exit ran the rest of the outer block at the mean."""
    model = tiny_gpt2()
    posterior = train_posterior(model).with_ess(NOISY_ESS)
    with torch.no_grad():
        mean_logits = model(PROMPTS).logits
    outer = batched.BatchedSamples(model, posterior, 2, seed=1)
    with outer:
        with pytest.raises(RuntimeError, match="already active on this model"):
            with batched.BatchedSamples(model, posterior, 2, seed=2):
                pass
        with pytest.raises(RuntimeError, match="already active on this model"):
            with outer:
                pass
        with torch.no_grad():  # still the outer block's samples
            assert not torch.equal(model(PROMPTS.repeat(2, 1)).logits[:2], mean_logits)
    assert outer.extra_bytes > 0
    with torch.no_grad():
        assert torch.equal(model(PROMPTS).logits, mean_logits)  # every forward restored
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("wrap", ["compile", "data_parallel"])
def test_a_compiled_or_data_parallel_model_decodes_and_scores_as_the_model_it_wraps(gpt2, wrap):
    """torch.compile and (Distributed)DataParallel prefix the parameter names (``_orig_mod.``,
    ``module.``): the batched samples read the wrapper's names and refused every covered weight
    with 'posterior covers parameters the model does not have'."""
    model, posterior = gpt2
    noisy = posterior.with_ess(NOISY_ESS)
    wrapped = torch.compile(model, backend="eager") if wrap == "compile" else torch.nn.DataParallel(model)
    scored = bma_log_likelihood(wrapped, noisy, PROMPTS, num_samples=3, seed=9)
    per_sample = []
    for m in sampled_copies(model, noisy, 3, 9):
        with torch.no_grad():
            lp = torch.log_softmax(m(input_ids=PROMPTS).logits[:, :-1].float(), -1)
        per_sample.append(lp.gather(-1, PROMPTS[:, 1:, None]).squeeze(-1))
    torch.testing.assert_close(scored.sample_token_log_probs, torch.stack(per_sample), atol=1e-5, rtol=1e-5)
    kwargs = dict(num_samples=3, seed=2, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = generate_bma(model, noisy, PROMPTS, **kwargs)
    assert torch.equal(generate_bma(wrapped, noisy, PROMPTS, **kwargs), expected)


def test_a_weight_norm_or_spectral_norm_tensor_is_refused_by_batched_bma():
    """weight_norm (weight_g, weight_v) and spectral_norm (weight_orig) leave a Conv1D owning
    tensors its hook makes the weight from: the batched forward applied samples of ``weight`` and
    ``bias`` only, so every sample ran those layers at the mean, silently."""
    model = tiny_gpt2(seed=5)
    with warnings.catch_warnings():  # torch deprecates the legacy hook; models still use it
        warnings.simplefilter("ignore")
        torch.nn.utils.weight_norm(model.transformer.h[0].mlp.c_fc, dim=0)
    torch.nn.utils.spectral_norm(model.transformer.h[0].mlp.c_proj)
    posterior = train_posterior(model).with_ess(NOISY_ESS)
    for attr, layer in (("weight_g", "c_fc"), ("weight_v", "c_fc"), ("weight_orig", "c_proj")):
        name = f"transformer.h.0.mlp.{layer}.{attr}"
        assert name in posterior.names
        # the tensor alone: a posterior over it only, as one over the whole model reaches it too
        alone = EVONPosterior.from_factors({name: posterior[name]}, dict(posterior.config))
        with refused(rf"'{name}' is the '{attr}' of a Conv1D"):
            batched_refusal(model, alone, PROMPTS)
        assert not any("forward" in m.__dict__ for m in model.modules())
    # generate_bma decodes it one draw at a time, each sample's weight made from its own weight_g and weight_v
    new_ids = generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, max_new_tokens=3, eos_token_id=None)
    new_ids = new_ids[:, PROMPTS.shape[1] :]
    assert_reference_argmax(new_ids, reference_greedy(sampled_copies(model, posterior, 2, 0), PROMPTS, None, 3, new_ids)[1])


def _trained_posterior(model: torch.nn.Module, x: torch.Tensor, loss, **kwargs) -> EVONPosterior:
    opt = hf_evon.build_optimizer(model, lr=1e-2, ess=1e4, seed=0, **kwargs)
    for _ in range(3):
        with opt.sampled_params(train=True):
            loss(model(x)).backward()
        opt.step()
        opt.zero_grad()
    return EVONPosterior.from_optimizer(opt, model.eval()).with_ess(NOISY_ESS)


class _FirstRows(torch.nn.Module):
    """Feeds its one layer, named ``name``, only the first ``rows`` rows of its input: a layer fed a
    selection of the rows, as a mixture's expert is fed those routed to it."""

    def __init__(self, name: str, layer: torch.nn.Module, rows: int) -> None:
        super().__init__()
        self.add_module(name, layer)
        self.layer_name, self.rows = name, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.layer_name)(x[: self.rows])


def _refused_mid_forward(
    model: torch.nn.Module, posterior: EVONPosterior, x: torch.Tensor, match: str, **kwargs
) -> None:
    """The batched samples refuse ``model(x)`` with ``match`` during the forward, and leave no
    forward patched on its modules."""
    with torch.no_grad(), refused(match):
        with batched.BatchedSamples(model, posterior, 2, seed=0, **kwargs):
            model(x)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_covered_weight_read_outside_its_modules_forward_is_refused():
    """nn.MultiheadAttention reads out_proj.weight in F.multi_head_attention_forward, a decoder tied
    as F.linear(h, enc.weight.t()) reads the encoder's weight: the batched samples live in the
    owners' forwards only, so those reads ran every sample at the mean, silently."""
    nn = torch.nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.attn.in_proj_weight.requires_grad_(False)
            self.head = nn.Linear(16, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.attn(x, x, x, need_weights=False)[0])

    class TiedAutoencoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(12, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(torch.tanh(self.enc(x)), self.enc.weight.t())

    torch.manual_seed(0)
    x, y = torch.randn(3, 4, 16), torch.randint(0, 5, (3, 4))
    attention = Attention()
    loss = lambda out: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    posterior = _trained_posterior(attention, x, loss)
    assert posterior.names == ["attn.out_proj.weight", "head.weight"]
    xa = torch.randn(16, 12)
    autoencoder = TiedAutoencoder()
    tied = _trained_posterior(autoencoder, xa, lambda out: torch.nn.functional.mse_loss(out, xa))
    assert tied.names == ["enc.weight"]
    outside = r"is read outside its module's forward \(by "
    for model, post, inputs, match in (
        (attention, posterior, x, r"'attn.out_proj.weight' " + outside + r"multi_head_attention_forward\)"),
        (autoencoder, tied, xa, r"'enc.weight' " + outside + r"t\)"),
    ):
        params = dict(model.named_parameters())
        with torch.no_grad(), refused(match):
            with batched.BatchedSamples(model, post, 3, seed=0):
                model(inputs.repeat(3, *[1] * (inputs.ndim - 1)))
        assert dict(model.named_parameters()) == params  # the parameters themselves, back in place
        assert all(type(p) is nn.Parameter for p in params.values())
        assert not any("forward" in m.__dict__ for m in model.modules())
    # a weight used through its module's forward only is sampled: the head alone, as written into the weights
    head = EVONPosterior.from_factors({"head.weight": posterior["head.weight"]}, dict(posterior.config))
    with torch.no_grad():
        reference = torch.stack([m(x) for m in sampled_copies(attention, head, 3, 4)])
        for strategy in ("materialize", "factored"):
            with batched.BatchedSamples(attention, head, 3, seed=4, strategy=strategy):
                got = attention(x.repeat(3, 1, 1)).view(3, *x.shape[:2], 5)
            torch.testing.assert_close(got, reference, atol=1e-6, rtol=1e-5)
    assert (reference[0] - reference[1]).abs().max() > 1e-2  # the samples differ


def test_a_covered_weights_metadata_stays_readable_inside_a_batched_block():
    """What reads no value of a covered weight (its dtype, device and shape, a tensor made like it,
    its storage's address, isinstance checks) works inside the block as outside; only a computation
    with it is refused. The guard first refused zeros_like, data_ptr, torch.numel and new_zeros."""
    model = tiny_gpt2()
    posterior = train_posterior(model)
    name = next(n for n in posterior.names if n.endswith("c_fc.weight"))
    module = model.get_submodule(name.rsplit(".", 1)[0])
    mean = module.weight
    sampler = batched.BatchedSamples(model, posterior, 2, seed=0)
    with torch.no_grad(), sampler:
        w = module.weight
        assert w is not mean and isinstance(w, torch.nn.Parameter)
        assert (w.shape, w.dtype, w.device, w.requires_grad) == (mean.shape, mean.dtype, mean.device, True)
        assert torch.equal(torch.zeros_like(w), torch.zeros(mean.shape)) and type(torch.zeros_like(w)) is torch.Tensor
        assert w.new_zeros(3).shape == (3,) and torch.numel(w) == mean.numel() and len(w) == len(mean)
        assert w.data_ptr() == mean.data_ptr() and w.grad is None and not w.is_sparse
        with refused(rf"'{name}' is read outside its module's forward"):
            w.sum()
    assert module.weight is mean
    with pytest.raises(RuntimeError, match="inside an active BatchedSamples block"):
        sampler.check_sample_axis(lambda: model(PROMPTS))  # outside: no module would be checked


def test_a_covered_module_whose_input_does_not_lead_with_the_samples_is_refused():
    """FSMT runs its layers time-first, (T, S·B, d), and T5's relative_attention_bias embedding
    takes a (q_len, k_len) bucket matrix: batched BMA split those axes among the samples, silently
    wherever S divided them (here T = S·B, so every shape check passed)."""
    from transformers import FSMTConfig, FSMTForConditionalGeneration

    torch.manual_seed(0)
    fsmt = FSMTForConditionalGeneration(
        FSMTConfig(
            langs=["en", "de"], src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, d_model=32, encoder_layers=1,
            decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            decoder_start_token_id=2,
        )
    ).eval()  # fmt: skip
    t5 = tiny_t5()
    relative = train_posterior(t5, evon_patterns=["relative_attention_bias"]).with_ess(NOISY_ESS)
    buckets = [n for n in relative.names if "relative_attention_bias" in n]
    bias = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert buckets == [f"decoder.{bias}", f"encoder.{bias}"]
    ids = PROMPTS[:, :4]  # S·B = 4 = T
    gets = r"\) gets an input that does not lead with the samples' rows: .* as shape "
    fsmt_match = r"'model\.encoder\.layers\.0\.self_attn\.[qkv]_proj\.weight' \(Linear" + gets
    fsmt_match += r"\(1, 2, 32\)"  # (T, S·B, d)
    t5_match = "'encoder." + bias.replace(".", r"\.") + r"' \(Embedding" + gets + r"\(1, 1\)"
    buckets_only = EVONPosterior.from_factors({n: relative[n] for n in buckets}, dict(relative.config))
    for model, posterior, match in ((fsmt, train_posterior(fsmt), fsmt_match), (t5, buckets_only, t5_match)):
        with refused(match):
            batched_refusal(model, posterior, ids)
        assert not any("forward" in m.__dict__ or m._forward_pre_hooks for m in model.modules())
        # generate_bma decodes it one draw at a time: the slow reference's tokens
        greedy = dict(max_new_tokens=2, num_beams=1, do_sample=False, eos_token_id=None, forced_eos_token_id=None)
        new_ids = generate_bma(model, posterior, ids, num_samples=2, seed=0, **greedy)[:, 1:]  # FSMT's config: 5 beams
        start = model.generation_config.decoder_start_token_id
        copies = sampled_copies(model, posterior, 2, 0)
        assert_reference_argmax(new_ids, reference_seq2seq_greedy(copies, ids, None, start, 2, new_ids)[1])
    # T5's batch-first layers pass the check: their samples score as written into the weights
    rest = {n: relative[n] for n in relative.names if n not in buckets}
    rest = EVONPosterior.from_factors(rest, dict(relative.config))
    scored = bma_log_likelihood(t5, rest, ids, labels=ids, num_samples=2, seed=0)
    decoder_ids = t5.prepare_decoder_input_ids_from_labels(labels=ids)
    with torch.no_grad():
        copies = sampled_copies(t5, rest, 2, 0)
        logits = [m(input_ids=ids, decoder_input_ids=decoder_ids).logits for m in copies]
    reference = torch.stack([torch.log_softmax(x, -1).gather(-1, ids[..., None])[..., 0] for x in logits])
    # the batched pass and the copies compute the same draws and forwards in other float32 orders, and this
    # noisy T5 amplifies last-bit differences: a one-ulp jiggle of its weights moves a log-prob by ~2e-4, the
    # two paths differ by up to ~1e-3 on some CPUs (AMD EPYC); another draw's weights move it by O(1)
    torch.testing.assert_close(scored.sample_token_log_probs, reference, atol=1e-2, rtol=0)
    with torch.no_grad():
        others = [m(input_ids=ids, decoder_input_ids=decoder_ids).logits for m in sampled_copies(t5, rest, 2, 1)]
    other = torch.stack([torch.log_softmax(x, -1).gather(-1, ids[..., None])[..., 0] for x in others])
    assert (scored.sample_token_log_probs - other).abs().max() > 1.0  # the tolerance tells the draws apart
    assert (reference[0] - reference[1]).abs().max() > 1e-3  # the samples differ


def test_an_encoder_decoder_whose_start_token_is_in_its_generation_config_decodes() -> None:
    """The sample-axis check built its decoder input from the config's decoder_start_token_id;
    a model whose start token lives in its generation_config only (which generate reads) raised
    there, where model.generate decodes."""
    model = tiny_t5()
    posterior = train_posterior(model)
    model.config.decoder_start_token_id = None
    model.generation_config.decoder_start_token_id = 0
    kwargs = dict(max_new_tokens=3, do_sample=False)
    zero = posterior.with_ess(float("inf"))
    assert torch.equal(generate_bma(model, zero, PROMPTS, num_samples=2, seed=0, **kwargs), model.generate(PROMPTS, **kwargs))


def test_a_padded_time_first_layer_is_refused_when_its_padding_equals_the_samples() -> None:
    """LED pads its encoder's input to its attention window and runs the self-attention
    time-first: with S equal to the window, one probe token per sample reached those layers as
    (window, S, d), which passed the check, and batched BMA mixed the samples silently."""
    from transformers import LEDConfig, LEDForConditionalGeneration

    torch.manual_seed(0)
    led = LEDForConditionalGeneration(
        LEDConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, attention_window=[4],
            max_encoder_position_embeddings=64, max_decoder_position_embeddings=64, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
        )
    ).eval()  # fmt: skip
    posterior = train_posterior(led)
    match = r"self_attn\.longformer_self_attn\.(query|key|value)\.weight.*does not lead with the samples' rows"
    with refused(match):
        batched_refusal(led, posterior, PROMPTS, num_samples=4)


def test_falcons_linear_layers_are_batched_as_linear_layers() -> None:
    """transformers' FalconLinear computes x @ Wᵀ + b as a matmul; its own forward made batched BMA
    refuse every Falcon model, whose samples it scores as written into the weights."""
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    falcon = FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4))
    falcon.eval()
    posterior = train_posterior(falcon).scale_ess(1e-3)
    assert any("query_key_value" in n for n in posterior.names)
    scored = bma_log_likelihood(falcon, posterior, PROMPTS, labels=PROMPTS, num_samples=2, seed=0)
    with torch.no_grad():
        logits = [m(input_ids=PROMPTS).logits[:, :-1] for m in sampled_copies(falcon, posterior, 2, 0)]
    reference = torch.stack([torch.log_softmax(x, -1).gather(-1, PROMPTS[:, 1:, None])[..., 0] for x in logits])
    torch.testing.assert_close(scored.sample_token_log_probs, reference, atol=1e-5, rtol=1e-5)
    assert (reference[0] - reference[1]).abs().max() > 1e-3  # the samples differ


def test_every_refusal_of_batched_bma_names_sampling_one_draw_at_a_time() -> None:
    """A scaled word embedding (Gemma's, MBart's scale_embedding), Mixtral's router, a prompt-learning
    adapter, an nn.Embedding with max_norm and a covered layer fed a selection of the rows were refused
    without the way out some other refusals named (the samples written into the weights one at a
    time, ``posterior.sampled``); every refusal now ends with that one hint."""
    from peft import PrefixTuningConfig, TaskType, get_peft_model
    from transformers import (
        GemmaConfig,
        GemmaForCausalLM,
        MBartConfig,
        MBartForConditionalGeneration,
        MixtralConfig,
        MixtralForCausalLM,
    )

    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    gemma = GemmaForCausalLM(GemmaConfig(**small, head_dim=16)).eval()
    mbart = MBartForConditionalGeneration(
        MBartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            scale_embedding=True, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        )
    ).eval()  # fmt: skip
    mixtral = MixtralForCausalLM(MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2)).eval()
    prefix = get_peft_model(
        tiny_gpt2(), PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=2, prefix_projection=True,
                                        encoder_hidden_size=16)  # fmt: skip
    )
    max_norm = tiny_gpt2()
    max_norm.transformer.wte.max_norm = 10.0
    embeddings = ["embed_tokens"]
    cases = [
        (gemma, train_posterior(gemma, evon_patterns=embeddings), r"'model\.embed_tokens\.weight' belongs to a GemmaTextScaled"),
        (mbart, train_posterior(mbart, evon_patterns=embeddings), r"'model\.shared\.weight' belongs to a MBartScaledWordEmbedding"),
        (mixtral, train_posterior(mixtral), r"'model\.layers\.0\.mlp\.gate\.weight' belongs to a MixtralTopKRouter"),
        (prefix, train_posterior(prefix), "supports LoRA-style PEFT models, not prompt learning"),
        (max_norm, train_posterior(max_norm, evon_patterns=["wte"]), r"'transformer\.wte\.weight': nn\.Embedding with max_norm"),
    ]  # fmt: skip
    for model, posterior, match in cases:
        if model is prefix:  # generate_bma and bma_log_likelihood run the others one draw at a time
            with refused(match):
                generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, max_new_tokens=2, pad_token_id=0)
            with refused(match):
                bma_log_likelihood(model, posterior, PROMPTS, labels=PROMPTS, num_samples=2, seed=0)
        with refused(match):
            batched_refusal(model, posterior, PROMPTS)
        assert not any("forward" in m.__dict__ for m in model.modules())

    routed = _FirstRows("expert", torch.nn.Linear(4, 4), 1)  # fed a selection, as a mixture's expert is
    posterior = _trained_posterior(routed, torch.randn(3, 4), lambda out: out.square().mean())
    match = r"'expert\.weight' is in a mixture of experts \(expert\)"
    _refused_mid_forward(routed, posterior, torch.randn(4, 4), match)


# ----------------------------------------------------------------------------- one draw at a time
def _refuse_batched(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched path refuses every model, as it refuses an AdaLoRA or IA3 one."""

    def refuse(self: batched.BatchedSamples) -> None:
        raise batched.refusal("refused for the test")

    monkeypatch.setattr(batched.BatchedSamples, "__enter__", refuse)


ONE_AT_A_TIME_MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=10),
    "beams": dict(do_sample=False, num_beams=3),
    "guidance": dict(do_sample=False, guidance_scale=3.0),
}


@pytest.mark.parametrize("mode", list(ONE_AT_A_TIME_MODES))
def test_a_model_the_batched_path_refuses_decodes_one_draw_at_a_time_as_the_batched_path(gpt2, monkeypatch, mode):
    """A model whose covered parameters the batched samples cannot run (PEFT's AdaLoRA, IA3, LoHa,
    LoKr, DoRA, weight_norm) was refused by generate_bma with NotImplementedError, so the model
    card's snippet and ``hf-evon generate`` could not decode it. Refused, generate_bma now writes
    the same S samples into the weights one at a time, each with its own KV cache: on a model the
    batched path runs, its tokens and the predictive's logits are the batched path's."""
    model, posterior = gpt2
    noisy = posterior.with_ess(NOISY_ESS)
    ids, mask = left_pad([[5, 9, 17, 3, 22, 8], [40, 41, 7]])
    kwargs = dict(
        attention_mask=mask, num_samples=3, seed=4, max_new_tokens=6, pad_token_id=0, eos_token_id=None,
        return_dict_in_generate=True, output_logits=True, **ONE_AT_A_TIME_MODES[mode],
    )  # fmt: skip
    expected = generate_bma(model, noisy, ids, **kwargs)
    other_seed = generate_bma(model, noisy, ids, **{**kwargs, "seed": 5})
    assert not torch.equal(expected.sequences, other_seed.sequences)  # the samples decide the tokens
    before = snapshot(model)
    _refuse_batched(monkeypatch)
    got = generate_bma(model, noisy, ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for step, want in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(step, want, atol=1e-4, rtol=1e-5)
    assert_unchanged(model, before)


@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_one_draw_at_a_time_raises_no_deprecation_of_a_cache_keyword_the_caller_never_passed(monkeypatch, arch):
    """One draw at a time, generate_bma read each forward's output by both cache names, and reading
    ``past_key_values`` of a transformers 5.24 output logs "`past_key_values`/`cache_params` are
    deprecated. Use `cache` instead.": a warning about a keyword the caller never passed."""
    from transformers.utils import generic

    model = tiny_gpt2() if arch == "gpt2" else tiny_t5()
    posterior = train_posterior(model)
    messages: list[str] = []
    record = lambda message, *args, **kwargs: messages.append(str(message))  # noqa: E731
    monkeypatch.setattr(generic.logger, "warning_once", record)
    monkeypatch.setattr(generic.logger, "warning", record)
    _refuse_batched(monkeypatch)
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, return_dict_in_generate=True, **kwargs)
    assert out.sequences.shape[1] == (PROMPTS.shape[1] if arch == "gpt2" else 1) + 3
    assert [m for m in messages if "past_key_values" in m] == []


@pytest.mark.parametrize("adapter", ["ia3", "adalora"])
def test_an_ia3_or_adalora_lm_decodes_one_draw_at_a_time_as_the_slow_reference(adapter):
    """IA3's scaling vectors and AdaLoRA's lora_A/lora_E/lora_B live in ParameterDicts, which the
    batched samples cannot run: generate_bma raised NotImplementedError. It now decodes them with
    the BMA predictive of the samples written into the weights (the slow reference's)."""
    peft = pytest.importorskip("peft")
    config = (
        peft.IA3Config(target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"])
        if adapter == "ia3"
        else peft.AdaLoraConfig(init_r=4, target_r=2, target_modules=["c_attn"], total_step=10, fan_in_fan_out=True)
    )
    model = peft.get_peft_model(tiny_gpt2(seed=2), config)
    posterior = train_posterior(model).with_ess(NOISY_ESS)
    before = snapshot(model)
    out = generate_bma(
        model, posterior, PROMPTS, num_samples=3, seed=4, max_new_tokens=5, do_sample=False, pad_token_id=0,
        eos_token_id=None, return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    assert_unchanged(model, before)
    copies = sampled_copies(model, posterior, 3, 4)
    new_ids = out.sequences[:, PROMPTS.shape[1] :]
    _, scores = reference_greedy(copies, PROMPTS, None, 5, forced=new_ids)
    assert_reference_argmax(new_ids, scores)
    for got, want in zip(log_mean_probs(out), scores, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    _, mean_scores = reference_greedy([model], PROMPTS, None, 5, forced=new_ids)
    assert (scores[0] - mean_scores[0]).abs().max() > 1e-3  # the adapter's samples differ from its mean


@pytest.mark.parametrize("call", ["generate_bma", "bma_log_likelihood"])
def test_one_draw_at_a_time_puts_the_mean_back_when_a_forward_raises(gpt2, monkeypatch, call):
    """A forward that raises while a sample is written into the weights (here sample 1's), in decoding
    or in scoring, leaves the model at its mean, bit for bit, with its own forward."""
    model, posterior = gpt2
    before = snapshot(model)
    _refuse_batched(monkeypatch)
    calls = []

    def boom(module, args, output):
        calls.append(module.h[0].mlp.c_fc.weight.detach().clone())
        if len(calls) == 2:
            raise RuntimeError("boom")

    noisy = posterior.with_ess(NOISY_ESS)
    handle = model.transformer.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            if call == "generate_bma":
                generate_bma(model, noisy, PROMPTS, num_samples=3, seed=0, max_new_tokens=3, pad_token_id=0)
            else:
                bma_log_likelihood(model, noisy, PROMPTS, num_samples=3, seed=0)
    finally:
        handle.remove()
    assert not torch.equal(calls[0], calls[1])  # the two forwards ran two samples
    assert not torch.equal(calls[1], before["transformer.h.0.mlp.c_fc.weight"])
    assert_unchanged(model, before)


def tiny_switch(covered: str = ".experts.") -> tuple:
    """A tiny SwitchTransformers (a mixture of ``nn.Linear`` experts) whose posterior covers the parameters
    named with ``covered`` alone."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    torch.manual_seed(1)
    config = SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, expert_capacity=64, num_layers=2, num_sparse_encoder_layers=0,
        num_decoder_layers=2, num_sparse_decoder_layers=2, num_heads=4, num_experts=4, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = SwitchTransformersForConditionalGeneration(config).eval()
    for name, param in model.named_parameters():
        param.requires_grad_(covered in name)
    posterior = train_posterior(model)
    assert posterior.names and all(covered in n for n in posterior.names)
    return model, posterior


# a posterior whose S = 2 samples route one token alike (the sample-axis probe passes) and this text's
# tokens differently, each expert getting an even number of the samples' rows
SWITCH_ESS = 300.0
SWITCH_TEXT = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))


def tiny_switch_with_covered_experts(monkeypatch: pytest.MonkeyPatch) -> tuple:
    """A tiny SwitchTransformers whose posterior covers the experts alone, with the batched samples' refusal
    of a mixture's experts on entry turned off, and the first seed whose two samples route the sample-axis
    probe's one token alike (each expert takes all of the rows or none) and the prompts' tokens not: the
    batched samples then refuse it during the forward, as they refuse a layer fed a selection of rows they
    cannot tell from its name. Which seed does that rests on float32 rounding in the router, which differs
    between CPUs, so the seed is searched for, each candidate checked for both."""
    model, posterior = tiny_switch()
    monkeypatch.setattr(batched, "routed_expert", lambda model, owners: None)
    forward_refusal = r"experts\.expert_\d\.wi\.weight: the batched-sample forward expects a leading"
    for seed in range(64):
        try:
            batched_refusal(model, posterior, PROMPTS, seed=seed)
        except NotImplementedError:
            continue  # the probe refuses: the case of the tests before entry, not this one
        try:
            with torch.no_grad(), batched.BatchedSamples(model, posterior, 2, seed=seed):
                model(input_ids=PROMPTS.repeat(2, 1), labels=PROMPTS.repeat(2, 1))
        except NotImplementedError as refusal:
            assert re.search(forward_refusal, str(refusal)), str(refusal)
            return model, posterior, seed
    raise AssertionError("no seed of 64 routes the probe alike and the prompts apart")


def test_a_numpy_sample_count_decodes_as_its_int_on_both_paths(monkeypatch, gpt2):
    """``num_samples=np.int64(2)``, which ``posterior.draw`` takes, was refused by the batched samples and by
    the one-draw-at-a-time ones ("must be an integer"), and the latter took ``True``."""
    import numpy as np

    from hf_evon.predictive.sequential_samples import SequentialSamples

    model, posterior = gpt2
    noisy = posterior.with_ess(NOISY_ESS)
    kwargs = dict(seed=0, max_new_tokens=3, do_sample=False, pad_token_id=0)
    want = generate_bma(model, noisy, PROMPTS, num_samples=2, **kwargs)
    assert torch.equal(generate_bma(model, noisy, PROMPTS, num_samples=np.int64(2), **kwargs), want)
    _refuse_batched(monkeypatch)
    assert torch.equal(generate_bma(model, noisy, PROMPTS, num_samples=np.int64(2), **kwargs), want)
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1; got True"):
        SequentialSamples(model, noisy, True)


@pytest.mark.parametrize("call", ["generate_bma", "bma_log_likelihood"])
def test_a_refusal_during_the_batched_forward_runs_one_draw_at_a_time(monkeypatch, call):
    """A refusal of the batched samples raised during the forward (a mixture's expert fed a selection of
    the rows, which the probe's one token did not show) reached the user as NotImplementedError. The
    call now runs from scratch one draw at a time, as for a refusal before the forward: the tokens,
    logits, streamed tokens and scores of that path forced, the model at its mean."""
    model, posterior, seed = tiny_switch_with_covered_experts(monkeypatch)
    before = snapshot(model)

    def run() -> tuple:
        if call == "bma_log_likelihood":
            scored = bma_log_likelihood(model, posterior, PROMPTS, labels=PROMPTS, num_samples=2, seed=seed)
            return (scored.sample_token_log_probs, scored.token_log_probs)
        streamer = _Collect()
        out = generate_bma(
            model, posterior, PROMPTS[:1], num_samples=2, seed=seed, max_new_tokens=4, do_sample=False,
            eos_token_id=None, return_dict_in_generate=True, output_logits=True, streamer=streamer,
        )  # fmt: skip
        assert streamer.ended == 1
        return (out.sequences, *out.logits, *streamer.puts)

    got = run()
    assert_unchanged(model, before)
    _refuse_batched(monkeypatch)
    expected = run()
    assert len(got) == len(expected)
    for have, want in zip(got, expected):
        assert torch.equal(have, want)


@pytest.mark.parametrize("call", ["generate_bma", "bma_log_likelihood"])
def test_covered_mixture_experts_run_one_draw_at_a_time_from_the_start(monkeypatch, call):
    """SwitchTransformers' experts are nn.Linear layers fed the rows their router selects. Where each
    expert got a multiple of S rows, the batched samples ran them without a word, splitting the selection
    in S equal blocks: rows of one sample ran another's weights (sample log-likelihoods off by 1.3
    nats). A covered expert is refused before any forward, so both calls give the one-draw-at-a-time
    path's results exactly."""
    model, posterior = tiny_switch()
    noisy = posterior.with_ess(SWITCH_ESS)
    with refused(r"'encoder\.block\.1\.layer\.1\.mlp\.experts\.expert_0\.wi\.weight' is in a mixture of experts"):
        batched_refusal(model, noisy, SWITCH_TEXT)

    def run() -> tuple:
        if call == "bma_log_likelihood":
            scored = bma_log_likelihood(model, noisy, SWITCH_TEXT, labels=SWITCH_TEXT, num_samples=2, seed=0)
            return (scored.sample_token_log_probs, scored.token_log_probs)
        out = generate_bma(
            model, noisy, SWITCH_TEXT, num_samples=2, seed=0, max_new_tokens=4, do_sample=False,
            eos_token_id=None, return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
        return (out.sequences, *out.logits)

    got = run()
    _refuse_batched(monkeypatch)
    expected = run()
    assert len(got) == len(expected)
    for have, want in zip(got, expected):
        torch.testing.assert_close(have, want, rtol=0, atol=0)


def test_a_hand_written_routed_expert_is_refused_before_any_forward():
    """An nn.Linear expert fed ``x[mask]`` (the rows a covered layer's output routes to it) got, for an
    even selection, the rows of both samples split in halves without a word: the batched path refuses a
    covered module in an ``experts`` container before any forward, the model left as it was."""

    class Routed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            mask = h[:, 0] > 0
            out = torch.zeros_like(h)
            out[mask] = self.experts[0](h[mask])
            out[~mask] = self.experts[1](h[~mask])
            return out

    routed = Routed()
    posterior = _trained_posterior(routed, torch.randn(3, 4), lambda out: out.square().mean())
    with refused(r"'experts\.0\.weight' is in a mixture of experts \(experts\.0\)"):
        with batched.BatchedSamples(routed, posterior, 2, seed=0):
            pass
    assert not any("forward" in m.__dict__ for m in routed.modules())
    assert all(type(p) is torch.nn.Parameter for p in routed.parameters())


def test_a_shared_experts_gate_fed_every_row_is_batched():
    """Qwen2-MoE's ``shared_expert_gate``, a Linear fed every row as its ``shared_expert`` is, was
    refused as a routed expert ("shared_experts?" had to be the whole name): BMA fell back to S
    forwards. It is batched, and its rows are each sample's own."""

    class Shared(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared_expert = torch.nn.Linear(4, 4)
            self.shared_expert_gate = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    torch.manual_seed(0)
    shared, x = Shared(), torch.randn(3, 4)
    posterior = _trained_posterior(shared, x, lambda out: out.square().mean())
    with torch.no_grad():
        with batched.BatchedSamples(shared, posterior, 2, seed=0, strategy="materialize"):
            both = shared(x.repeat(2, 1))
        for s in range(2):  # the one-draw-at-a-time path: the same draws
            with posterior.sampled(shared, seed=s):
                torch.testing.assert_close(both[3 * s : 3 * (s + 1)], shared(x), rtol=1e-6, atol=1e-6)


def test_a_layer_fed_a_selection_of_rows_that_is_no_multiple_of_the_batch_is_refused():
    """A covered layer fed a selection of the S·B rows whose size is a multiple of S but not of S·B (the
    call's B sequences per sample) cannot hold the samples' rows in S equal blocks: refused mid-forward,
    naming the parameter and the shape, where it ran the first rows as sample 0's and the next as
    sample 1's."""
    picked = _FirstRows("head", torch.nn.Linear(4, 4), 2)
    posterior = _trained_posterior(picked, torch.randn(3, 4), lambda out: out.square().mean())
    match = r"head\.weight: .* a leading batch of S·B rows or S·B·tokens \(S=2, B=2\), got input of shape \(2, 4\)"
    _refused_mid_forward(picked, posterior, torch.randn(4, 4), match, sequences=2)
    with pytest.raises(ValueError, match="sequences must be an integer >= 1; got 0"):
        batched.BatchedSamples(picked, posterior, 2, sequences=0)
    # a covered nn.Embedding is held to the same rule
    picked = _FirstRows("embed", torch.nn.Embedding(10, 4), 2)
    posterior = _trained_posterior(
        picked, torch.arange(3)[:, None], lambda out: out.square().mean(), evon_patterns=[r"embed\.weight"]
    )
    match = r"embed\.weight: .* a leading batch of S·B rows or S·B·tokens \(S=2, B=2\), got input of shape \(2, 3\)"
    with torch.no_grad(), refused(match):
        with batched.BatchedSamples(picked, posterior, 2, seed=0, strategy="materialize", sequences=2):
            picked(torch.zeros(4, 3, dtype=torch.long))


def test_a_refusal_is_its_own_exception_class():
    """Refusals were told apart by their message's text; they are BatchedSamplesRefused, a
    NotImplementedError (callers catching that still catch them)."""
    error = batched.refusal("a reason")
    assert type(error) is batched.BatchedSamplesRefused
    assert isinstance(error, NotImplementedError)
    assert str(error).startswith("a reason; sample the model one draw at a time")


def test_a_refusal_during_batched_decoding_after_streamed_tokens_names_the_streamer(gpt2):
    """Tokens given to a streamer cannot be taken back: a refusal of the batched samples after the
    first new tokens were streamed is raised, naming the streamer, and the model is left at its mean."""
    model, posterior = gpt2
    before = snapshot(model)
    streamer = _Collect()

    def refuse_once_streaming(module, args, output):
        if len(streamer.puts) == 2:  # the prompt and the first new token
            raise batched.refusal("refused for the test")

    handle = model.transformer.register_forward_hook(refuse_once_streaming)
    try:
        with pytest.raises(NotImplementedError, match=r"refused for the test.*without streamer=$"):
            generate_bma(
                model, posterior.with_ess(NOISY_ESS), PROMPTS[:1], num_samples=2, seed=0, max_new_tokens=4,
                pad_token_id=0, eos_token_id=None, streamer=streamer,
            )  # fmt: skip
    finally:
        handle.remove()
    assert len(streamer.puts) == 2
    assert_unchanged(model, before)


@pytest.mark.parametrize("arch", ["gpt2", "bart"])
def test_one_draw_at_a_time_returns_every_samples_attentions_and_hidden_states(monkeypatch, arch):
    """One draw at a time, the attentions and hidden states generate_bma returned (output_attentions,
    output_hidden_states) were the last sample's decoder's, B rows, where the batched path returns
    every sample's, S·B rows sample-major; a model refused during the batched forwards switches path
    unseen. Both paths return the same: each step's, per layer, of every sample."""
    model = tiny_gpt2() if arch == "gpt2" else tiny_bart()
    model.set_attn_implementation("eager")  # attentions to return
    posterior = train_posterior(model).with_ess(NOISY_ESS)
    kwargs = dict(
        num_samples=3, seed=4, max_new_tokens=3, do_sample=False, pad_token_id=model.config.pad_token_id or 0,
        eos_token_id=None, return_dict_in_generate=True, output_attentions=True, output_hidden_states=True,
    )  # fmt: skip
    keys = ("attentions", "hidden_states") if arch == "gpt2" else (
        "decoder_attentions", "cross_attentions", "decoder_hidden_states"
    )  # fmt: skip
    expected = generate_bma(model, posterior, PROMPTS, **kwargs)
    _refuse_batched(monkeypatch)
    got = generate_bma(model, posterior, PROMPTS, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for key in keys:
        assert len(got[key]) == len(expected[key]) == 3  # one per step
        for got_step, want_step in zip(got[key], expected[key], strict=True):
            assert len(got_step) == len(want_step) > 0  # one per layer
            for have, want in zip(got_step, want_step, strict=True):
                assert have.shape[0] == 3 * len(PROMPTS), key
                torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["greedy", "sampling", "beams"])
def test_an_encoder_decoder_the_batched_path_refuses_decodes_one_draw_at_a_time_as_the_batched_path(
    seq2seq, monkeypatch, mode
):
    """An encoder-decoder model the batched samples refuse (an IA3 or AdaLoRA adapter of T5, FSMT's
    time-first layers) was refused by generate_bma. It now runs each sample's encoder and decoder
    with the sample written into the weights: on a model the batched path runs, its tokens and the
    predictive's logits are the batched path's, for greedy decoding, sampling and beam search."""
    model, posterior = seq2seq
    noisy = posterior.with_ess(NOISY_ESS)
    pad = model.config.pad_token_id
    ids = torch.tensor([[5, 9, 17, 3, 22, 8], [40, 41, 7, pad, pad, pad]])  # right-padded, as T5/BART take it
    mask = (torch.arange(6) < torch.tensor([[6], [3]])).long()
    kwargs = dict(
        attention_mask=mask, num_samples=3, seed=7, max_new_tokens=6, eos_token_id=None,
        return_dict_in_generate=True, output_logits=True, **ONE_AT_A_TIME_MODES[mode],
    )  # fmt: skip
    expected = generate_bma(model, noisy, ids, **kwargs)
    assert not torch.equal(expected.sequences, generate_bma(model, noisy, ids, **{**kwargs, "seed": 8}).sequences)
    before = snapshot(model)
    _refuse_batched(monkeypatch)
    got = generate_bma(model, noisy, ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for step, want in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(step, want, atol=1e-4, rtol=1e-5)
    assert_unchanged(model, before)


def test_a_model_the_batched_path_refuses_scores_one_draw_at_a_time_as_the_batched_path(gpt2, monkeypatch):
    """bma_log_likelihood refused a model the batched samples cannot run (PEFT's AdaLoRA, IA3,
    DoRA, weight_norm) with NotImplementedError, where generate_bma decodes it. It now scores the
    same S samples written into the weights one at a time: on a model the batched path runs, its
    per-sample and BMA log-likelihoods are the batched path's."""
    model, posterior = gpt2
    noisy = posterior.with_ess(NOISY_ESS)
    ids, mask = left_pad([[5, 9, 17, 3, 22, 8], [40, 41, 7]])
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 3] = -100  # an ignored position inside a sequence
    kwargs = dict(attention_mask=mask, labels=labels, num_samples=3, seed=4)
    expected = bma_log_likelihood(model, noisy, ids, **kwargs)
    other_seed = bma_log_likelihood(model, noisy, ids, **{**kwargs, "seed": 5})
    assert (expected.sample_token_log_probs - other_seed.sample_token_log_probs).abs().max() > 1e-3
    before = snapshot(model)
    _refuse_batched(monkeypatch)
    got = bma_log_likelihood(model, noisy, ids, **kwargs)
    assert torch.equal(got.mask, expected.mask)
    torch.testing.assert_close(got.sample_token_log_probs, expected.sample_token_log_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.token_log_probs, expected.token_log_probs, atol=1e-5, rtol=1e-5)
    assert_unchanged(model, before)


def test_an_encoder_decoder_the_batched_path_refuses_scores_one_draw_at_a_time_as_the_batched_path(
    seq2seq, monkeypatch
):
    """As for a causal LM: each sample's encoder and decoder run with the sample in the weights, and
    the scores are the batched path's."""
    model, posterior = seq2seq
    noisy = posterior.with_ess(NOISY_ESS)
    pad = model.config.pad_token_id
    ids = torch.tensor([[5, 9, 17, 3, 22, 8], [40, 41, 7, pad, pad, pad]])
    mask = (torch.arange(6) < torch.tensor([[6], [3]])).long()
    labels = torch.tensor([[7, 8, 9, 10], [11, 12, -100, -100]])
    kwargs = dict(attention_mask=mask, labels=labels, num_samples=3, seed=7)
    # per-sample weights M + ΔW_s, as written into the weights: the factored samples round in another
    # order, and these ill-conditioned tiny models turn that into ~2e-3 of log p (float32 itself is
    # ~1e-3 off, see test_encoder_decoder_matches_slow_reference)
    expected = bma_log_likelihood(model, noisy, ids, strategy="materialize", **kwargs)
    before = snapshot(model)
    _refuse_batched(monkeypatch)
    got = bma_log_likelihood(model, noisy, ids, **kwargs)
    assert torch.equal(got.mask, expected.mask)
    torch.testing.assert_close(got.sample_token_log_probs, expected.sample_token_log_probs, atol=1e-5, rtol=1e-5)
    assert_unchanged(model, before)


@pytest.mark.parametrize("adapter", ["ia3", "adalora"])
def test_an_ia3_or_adalora_lm_scores_one_draw_at_a_time_as_the_slow_reference(adapter):
    """IA3's scaling vectors and AdaLoRA's lora_A/lora_E/lora_B live in ParameterDicts, which the
    batched samples cannot run: bma_log_likelihood raised NotImplementedError. It now scores them
    under each sample written into the weights (the slow reference's deep copies)."""
    peft = pytest.importorskip("peft")
    config = (
        peft.IA3Config(target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"])
        if adapter == "ia3"
        else peft.AdaLoraConfig(init_r=4, target_r=2, target_modules=["c_attn"], total_step=10, fan_in_fan_out=True)
    )
    model = peft.get_peft_model(tiny_gpt2(seed=2), config)
    posterior = train_posterior(model).with_ess(NOISY_ESS)
    ids, mask = left_pad([[5, 9, 17, 3, 22, 8], [40, 41, 7]])
    before = snapshot(model)
    result = bma_log_likelihood(model, posterior, ids, attention_mask=mask, num_samples=3, seed=4)
    assert_unchanged(model, before)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    valid = (mask[:, 1:] == 1) & (mask[:, :-1] == 1)  # a token predicted from a pad is not scored
    targets = ids[:, 1:, None]
    with torch.no_grad():
        per_sample = torch.stack([
            torch.log_softmax(m(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1], -1)
            .gather(-1, targets)[..., 0]
            for m in sampled_copies(model, posterior, 3, 4)
        ]) * valid  # fmt: skip
        mean = torch.log_softmax(model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1], -1)
    assert torch.equal(result.mask, valid)
    torch.testing.assert_close(result.sample_token_log_probs, per_sample, atol=1e-5, rtol=1e-5)
    expected = (torch.logsumexp(per_sample, 0) - math.log(3)) * valid
    torch.testing.assert_close(result.token_log_probs, expected, atol=1e-5, rtol=1e-5)
    assert (per_sample[0] - mean.gather(-1, targets)[..., 0] * valid).abs().max() > 1e-3  # samples differ from the mean


# ----------------------------------------------------------------------------- speech and vision encoders
def tiny_whisper(seed: int = 0):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    cfg = WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, d_model=16, max_source_positions=10,
        max_target_positions=32, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=3,
        begin_suppress_tokens=None, suppress_tokens=None, init_std=0.5,
    )  # fmt: skip
    return WhisperForConditionalGeneration(cfg).eval()


def tiny_vision_encoder_decoder(seed: int = 0):
    """A TrOCR/Donut-shaped model: a ViT encoder of 8×8 images, a GPT-2 decoder with cross-attention."""
    from transformers import VisionEncoderDecoderConfig, VisionEncoderDecoderModel, ViTConfig

    torch.manual_seed(seed)
    encoder = ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=8,
        patch_size=4, num_channels=3,
    )  # fmt: skip
    decoder = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2, initializer_range=0.5)
    model = VisionEncoderDecoderModel(VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder))
    for config in (model.config, model.generation_config):
        config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 0, 1, 2
    return model.eval()


# the encoder's input of each: a batch of 2 (log-mel frames; images)
ENCODER_INPUTS = {"whisper": ("input_features", (2, 8, 20)), "vision": ("pixel_values", (2, 3, 8, 8))}


@pytest.fixture(scope="module", params=["whisper", "vision"])
def feature_seq2seq(request):
    """A model whose encoder reads no token ids, its encoder input's name, a batch of it, and a posterior."""
    model = tiny_whisper() if request.param == "whisper" else tiny_vision_encoder_decoder()
    name, shape = ENCODER_INPUTS[request.param]
    features = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    opt = hf_evon.build_optimizer(model, lr=1e-2, ess=1e4, precondition_frequency=2, seed=0)
    labels = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    model.train()
    for _ in range(3):
        with opt.sampled_params(train=True):
            model(**{name: features}, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return model, name, features, EVONPosterior.from_optimizer(opt, model)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_speech_and_vision_encoder_decoders_decode_at_zero_variance_as_generate(strategy, feature_seq2seq, num_beams):
    """Whisper (``input_features``) and a VisionEncoderDecoder (``pixel_values``): generate_bma took
    only ``input_ids`` ("missing 1 required positional argument: 'input_ids'")."""
    model, name, features, posterior = feature_seq2seq
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, num_beams=num_beams)
    expected = model.generate(**{name: features}, **kwargs)
    assert len(set(expected[:, 1:].flatten().tolist())) > 2  # a sequence worth comparing
    zero = posterior.with_ess(float("inf"))
    assert torch.equal(generate_bma(model, zero, **{name: features}, num_samples=3, seed=0, **kwargs), expected)


@pytest.mark.parametrize("path", ["materialize", "factored", "one-draw-at-a-time"])
def test_speech_and_vision_encoder_decoders_match_the_slow_reference(feature_seq2seq, path, monkeypatch):
    """Each sample runs its own encoder on the features: log p̄ of every step equals S separate
    models', and bma_log_likelihood (which took no ``input_features``/``pixel_values``) scores the
    generated tokens with the same log p̄; batched or with the samples written into the weights."""
    strategy = None if path == "one-draw-at-a-time" else path
    if strategy is None:
        _refuse_batched(monkeypatch)
    model, name, features, posterior = feature_seq2seq
    noisy = posterior.with_ess(NOISY_ESS)
    before = snapshot(model)
    num_samples, new = 3, 5
    out = generate_bma(
        model, noisy, **{name: features}, num_samples=num_samples, seed=4, max_new_tokens=new, do_sample=False,
        eos_token_id=None, return_dict_in_generate=True, output_logits=True, strategy=strategy,
    )  # fmt: skip
    copies = sampled_copies(model, noisy, num_samples, 4)
    picked = out.sequences[:, 1:]

    def reference(dtype: torch.dtype) -> torch.Tensor:  # log p̄ of S separate models, (B, new, V)
        inputs = {name: features.to(dtype), "decoder_input_ids": out.sequences[:, :-1]}
        with torch.no_grad():
            per_sample = torch.stack([torch.log_softmax(m.to(dtype)(**inputs).logits, -1) for m in copies])
        return (torch.logsumexp(per_sample, 0) - math.log(num_samples)).double()

    float32 = reference(torch.float32)
    float64 = reference(torch.float64)
    # these noisy tiny models are ill-conditioned: float32 itself is off the float64 reference, so the
    # bound is the float32 reference's own error times FLOAT32_SPREAD; a wrong sample is off by O(1)
    bound = FLOAT32_SPREAD * float((float32 - float64).abs().max()) + 1e-6
    got = torch.stack(log_mean_probs(out), 1)
    assert float((got.double() - float64).abs().max()) <= bound
    mean_first = torch.log_softmax(model(**{name: features}, decoder_input_ids=out.sequences[:, :1]).logits[:, -1], -1)
    assert (got[:, 0] - mean_first).abs().max() > 1e-2  # the samples differ from the mean
    scored = bma_log_likelihood(
        model, noisy, **{name: features}, labels=picked, num_samples=num_samples, seed=4, strategy=strategy
    )
    want = float64.gather(-1, picked[..., None])[..., 0]
    assert scored.token_log_probs.shape == picked.shape and bool(scored.mask.all())
    assert float((scored.token_log_probs.double() - want).abs().max()) <= bound
    assert_unchanged(model, before)


@pytest.mark.parametrize("path", ["batched", "one draw at a time"])
def test_an_encoder_keyword_of_the_call_reaches_every_samples_encoder_as_in_generate(path, monkeypatch):
    """generate hands its encoder the call's model keywords the encoder takes (a ViT's
    interpolate_pos_encoding, for images of another size than the config's); generate_bma ran the
    samples' encoders on their input and mask alone, so 16×16 images failed with "Input image size
    (16*16) doesn't match model (8*8)". At zero variance it decodes them as generate."""
    model = tiny_vision_encoder_decoder()
    # the patch convolution left to AdamW: the batched path runs the model (it refuses a covered Conv2d)
    opt = hf_evon.build_optimizer(model, lr=1e-2, ess=1e4, precondition_frequency=2, seed=0, adamw_patterns=[r"patch_embeddings"])
    images = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with opt.sampled_params(train=True):
        model(pixel_values=images, labels=torch.tensor([[5, 6], [7, 8]])).loss.backward()
    opt.step()
    posterior = EVONPosterior.from_optimizer(opt, model).with_ess(float("inf"))
    if path == "one draw at a time":
        _refuse_batched(monkeypatch)
    large = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=4, do_sample=False, interpolate_pos_encoding=True)
    expected = model.generate(pixel_values=large, **kwargs)
    got = generate_bma(model, posterior, pixel_values=large, num_samples=2, seed=0, **kwargs)
    assert torch.equal(got, expected)


def test_an_encoder_input_the_model_does_not_read_is_named(feature_seq2seq, gpt2):
    """An encoder input that is missing, of the wrong kind, or not the model's is refused by name."""
    model, name, features, posterior = feature_seq2seq
    with pytest.raises(ValueError, match=rf"generate_bma: .*{name}"):
        generate_bma(model, posterior, num_samples=2, max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"bma_log_likelihood: {name} must be a floating"):
        bma_log_likelihood(model, posterior, **{name: features.long()}, labels=PROMPTS, num_samples=2)
    with pytest.raises(ValueError, match=rf"generate_bma: {name} is empty"):
        generate_bma(model, posterior, **{name: features[:0]}, num_samples=2, max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"generate_bma: {name} and input_ids"):
        generate_bma(model, posterior, PROMPTS, **{name: features}, num_samples=2, max_new_tokens=2)
    lm, lm_posterior = gpt2
    with pytest.raises(TypeError, match=rf"bma_log_likelihood: .*\b{name}\b.*input_ids"):
        bma_log_likelihood(lm, lm_posterior, **{name: features}, num_samples=2)
    with pytest.raises(ValueError, match="generate_bma: input_ids must be"):
        generate_bma(lm, lm_posterior, num_samples=2, max_new_tokens=2)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_samples_written_one_at_a_time_in_one_autocast_region_each_reach_the_forward() -> None:
    """autocast keeps its bfloat16 cast of each parameter until its outermost region ends and does not
    see in-place writes: inside one ``torch.autocast`` (``bma_log_likelihood`` or ``generate_bma`` of a
    model the batched path refuses, called in a bfloat16 region) every sample's forward ran at the mean
    cast before the first write. Each forward is the one a fresh region gives at the weights written."""
    from hf_evon.predictive.sequential_samples import SequentialSamples

    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)), torch.randn(6, 5)
    opt = hf_evon.build_optimizer(model, ess=50.0, seed=0)
    with opt.sampled_params(train=True):
        model(x).square().sum().backward()
    opt.step()
    posterior = EVONPosterior.from_optimizer(opt, model)

    def weights() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def fresh(at: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            return torch.func.functional_call(model, at, (x,))

    mean = weights()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        first = model(x)
        with SequentialSamples(model, posterior, 2, seed=1) as samples:
            ran = samples.each(lambda: (model(x), weights()))
        last = model(x)
    assert not torch.equal(ran[0][1]["0.weight"], mean["0.weight"])
    for got, at in [(first, mean), *ran, (last, mean)]:
        assert torch.equal(got, fresh(at))


class _SeenLengths:
    """A stateful user callback of ``generate`` (a logits processor, a stopping criterion, a
    ``prefix_allowed_tokens_fn``): records the length of the ids of every call."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def processor(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.lengths.append(input_ids.shape[1])
        return scores

    def criterion(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.lengths.append(input_ids.shape[1])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def allowed(self, batch_id: int, input_ids: torch.Tensor) -> list[int]:
        self.lengths.append(input_ids.shape[0])
        return list(range(VOCAB))


def _user_callback(kind: str, seen: _SeenLengths) -> dict:
    from transformers import LogitsProcessorList, StoppingCriteriaList
    from transformers.generation.logits_process import LogitsProcessor
    from transformers.generation.stopping_criteria import StoppingCriteria

    if kind == "logits_processor":
        processor = type("Recorded", (LogitsProcessor,), {"__call__": lambda self, i, s: seen.processor(i, s)})
        return {kind: LogitsProcessorList([processor()])}
    if kind == "stopping_criteria":
        criterion = type("Recorded", (StoppingCriteria,), {"__call__": lambda self, i, s, **k: seen.criterion(i, s)})
        return {kind: StoppingCriteriaList([criterion()])}
    return {kind: seen.allowed}


@pytest.mark.parametrize("kind", ["logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn"])
def test_a_refusal_during_batched_decoding_never_shows_a_user_callback_the_same_tokens_twice(gpt2, kind):
    """A refusal of the batched samples after the first decoding step restarted decoding one draw at a
    time, which called the user's stateful logits_processor, stopping_criteria or prefix_allowed_tokens_fn
    again over the first tokens (a logits processor saw the lengths [6, 6, 7, 8, 9]). A refusal in the first forward, before any
    callback runs, still restarts (each length seen once, the tokens of that path); one after it is raised,
    naming the callback, the callback called once and the model at its mean."""
    model, posterior = gpt2
    noisy, before = posterior.with_ess(NOISY_ESS), snapshot(model)
    kwargs = dict(num_samples=2, seed=0, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    prompt, prefill_rows = PROMPTS[:1], 2  # the prefill of the batched samples: S·B rows of the whole prompt
    refused_once = []

    def refuse_prefill(module, args, output):
        if not refused_once and output.last_hidden_state.shape[:2] == (prefill_rows, prompt.shape[1]):
            refused_once.append(True)
            raise batched.refusal("refused for the test")

    seen = _SeenLengths()
    handle = model.transformer.register_forward_hook(refuse_prefill)
    try:
        out = generate_bma(model, noisy, prompt, **kwargs, **_user_callback(kind, seen))
    finally:
        handle.remove()
    first = prompt.shape[1] + (kind == "stopping_criteria")  # a criterion sees the step's token too
    assert refused_once and seen.lengths == [first, first + 1, first + 2, first + 3]
    alone = _SeenLengths()
    with pytest.MonkeyPatch.context() as monkeypatch:
        _refuse_batched(monkeypatch)
        assert torch.equal(out, generate_bma(model, noisy, prompt, **kwargs, **_user_callback(kind, alone)))
    assert alone.lengths == seen.lengths

    seen, refused_once = _SeenLengths(), []

    def refuse_after_a_step(module, args, output):
        if seen.lengths and not refused_once:  # the callback has seen the first step
            refused_once.append(True)
            raise batched.refusal("refused for the test")

    handle = model.transformer.register_forward_hook(refuse_after_a_step)
    error = None
    try:
        generate_bma(model, noisy, prompt, **kwargs, **_user_callback(kind, seen))
    except NotImplementedError as raised:
        error = raised
    finally:
        handle.remove()
    assert seen.lengths == [first]
    assert re.search(rf"refused for the test.*after {kind}= had been called", str(error))
    assert_unchanged(model, before)


@pytest.mark.parametrize("decoder_ids", [None, 3])
def test_the_new_token_count_of_an_encoder_decoder_counts_from_its_decoders_start(seq2seq, monkeypatch, decoder_ids):
    """``max_length`` bounds an encoder-decoder's decoder ids, not its encoder input: with a 30-token
    encoder input and max_length=10 the cost model of the batched samples was told 1 new token
    (10 - 30, clamped), where decoding adds 9 (10 less the start token; 7 past 3 decoder ids given)."""
    model, posterior = seq2seq
    source = torch.randint(3, VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))
    told = []
    monkeypatch.setattr(generation, "expected_rows", lambda *args: told.append(args) or batched.expected_rows(*args))
    given = {}
    if decoder_ids is not None:  # led by the start token, which generate would otherwise put before them
        given["decoder_input_ids"] = torch.full((2, decoder_ids), 5)
        given["decoder_input_ids"][:, 0] = model.config.decoder_start_token_id
    generate_bma(model, posterior, source, num_samples=2, seed=0, max_length=10, min_length=0, do_sample=False, **given)
    assert told == [(2, 30, 10 - (decoder_ids or 1))]


@pytest.mark.parametrize(
    "decoding",
    [
        dict(do_sample=True, num_return_sequences=3),
        dict(do_sample=False, num_beams=2, num_return_sequences=2),
        dict(do_sample=True, num_beams=3, num_return_sequences=2),
        dict(do_sample=False),
    ],
    ids=["sampling", "beams", "beam-sampling", "greedy"],
)
def test_the_cost_model_of_the_batched_samples_is_told_the_rows_generate_runs(gpt2, monkeypatch, decoding):
    """The batched samples choose how to apply each matrix from the rows per sample a step runs and
    the rows the call runs: generate runs B·max(num_beams, num_return_sequences) rows per sample.
    Sampling with num_return_sequences=3 told them B rows (B·num_beams), a third of those it ran."""
    model, posterior = gpt2
    told = []

    class Recorded(batched.BatchedSamples):
        def __init__(self, *args, **kwargs):
            told.append((kwargs["batch_size"], kwargs["rows"]))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(generation, "BatchedSamples", Recorded)
    ran = []  # rows of each forward of the head, the probes' S and 2S among them
    handle = model.lm_head.register_forward_pre_hook(lambda module, args: ran.append(args[0].shape[0]))
    try:
        kwargs = dict(max_new_tokens=4, pad_token_id=0, eos_token_id=None, **decoding)
        out = generate_bma(model, posterior, PROMPTS, num_samples=2, seed=0, **kwargs)
    finally:
        handle.remove()
    per_call = max(decoding.get("num_beams", 1), decoding.get("num_return_sequences", 1))
    assert out.shape[0] == len(PROMPTS) * decoding.get("num_return_sequences", 1)
    assert max(ran) == 2 * len(PROMPTS) * per_call  # S·B·max(num_beams, num_return_sequences)
    assert told == [(len(PROMPTS) * per_call, batched.expected_rows(len(PROMPTS) * per_call, PROMPTS.shape[1], 4))]


def test_a_token_classifier_without_labels_and_a_multiple_choice_model_are_refused_by_name():
    """A token classifier's logits are classes, not token ids: bma_log_likelihood without labels= took the
    input ids as its labels, as a causal LM's, and failed with "labels have label 5, outside the model's 4
    classes", though no labels were passed. A multiple-choice model (ids (batch, choices, length)) was refused
    with "input_ids must be a (batch, length) tensor ...; got (2, 3, 6)", its class unnamed. Both name the
    model class now, before any forward; a token classifier's labels= still score as its own loss."""
    from transformers import BertConfig, BertForMultipleChoice, BertForTokenClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, num_labels=4)
    model = BertForTokenClassification(cfg)
    opt = hf_evon.build_optimizer(model, lr=1e-2, ess=NOISY_ESS, seed=0)
    labels = torch.tensor([[0, 1, 2, 3, -100, 1], [3, 3, 2, 0, 1, -100]])
    with opt.sampled_params(train=True):
        model(input_ids=PROMPTS, labels=labels).loss.backward()
    opt.step()
    posterior = EVONPosterior.from_optimizer(opt, model)
    model.eval()
    before, forwards = snapshot(model), count_forwards(model)
    with pytest.raises(ValueError, match=r"^bma_log_likelihood: BertForTokenClassification is a token classifier.*labels="):
        bma_log_likelihood(model, posterior, PROMPTS, num_samples=2, seed=0)
    assert forwards[0] == 0
    assert_unchanged(model, before)
    with posterior.sampled(model, seed=5), torch.no_grad():  # one draw: the first of the seed's
        own_loss = model(input_ids=PROMPTS, labels=labels).loss
    one = bma_log_likelihood(model, posterior, PROMPTS, labels=labels, num_samples=1, seed=5)
    torch.testing.assert_close(one.loss, own_loss, atol=1e-5, rtol=0)

    torch.manual_seed(0)
    choices = BertForMultipleChoice(cfg).eval()
    posterior = EVONPosterior.from_optimizer(hf_evon.build_optimizer(choices, seed=0), choices)
    forwards = count_forwards(choices)
    with pytest.raises(ValueError, match=r"^bma_log_likelihood: BertForMultipleChoice is a multiple-choice model"):
        bma_log_likelihood(choices, posterior, PROMPTS[:, None].expand(2, 3, 6), num_samples=2, seed=0)
    assert forwards[0] == 0


@pytest.mark.parametrize("causal", [False, True])
def test_bma_log_likelihood_of_a_roberta_model_counts_positions_as_the_model_does(causal: bool) -> None:
    """RoBERTa-family embeddings count positions from ``padding_idx + 1`` and pad positions at
    ``padding_idx`` (``create_position_ids_from_input_ids``), and take given ``position_ids`` as they
    are: bma_log_likelihood gave them 0-based ids, and every position was off by two (log p 0.16 and
    0.10 off the model's own at zero variance, masked and causal). At zero variance it is the model's
    own log-softmax and loss, padding in the rows included."""
    from transformers import RobertaConfig, RobertaForCausalLM, RobertaForMaskedLM

    from hf_evon import bma_log_likelihood

    torch.manual_seed(0)
    config = RobertaConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=40, pad_token_id=1, is_decoder=causal)  # fmt: skip
    model = (RobertaForCausalLM if causal else RobertaForMaskedLM)(config).eval()
    point = EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, ess=1e4), model).with_ess(float("inf"))
    ids = torch.tensor([[0, 5, 6, 7, 8, 9, 2], [0, 10, 11, 12, 2, 1, 1]])  # the second row right-padded
    mask = (ids != 1).long()
    labels = ids.masked_fill(mask == 0, -100)
    result = bma_log_likelihood(model, point, ids, attention_mask=mask, num_samples=1, seed=0)
    assert not result.sample_token_log_probs.requires_grad  # no autograd graph kept (it runs without grad)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    log_probs = out.logits.log_softmax(-1)
    if causal:
        log_probs, targets = log_probs[:, :-1], ids[:, 1:]
    else:
        targets = ids
    own = log_probs.gather(-1, targets[..., None]).squeeze(-1)
    scored = (labels[:, 1:] if causal else labels) != -100
    assert torch.allclose(result.token_log_probs[scored], own[scored], atol=1e-5)
    assert float(result.loss) == pytest.approx(float(out.loss), abs=1e-5)


def test_bma_log_likelihood_scores_labels_at_right_pads_at_the_models_own_positions() -> None:
    """A right pad got the last real token's position id (the mask's cumulative count), where the model
    itself counts on: labels given at a pad scored 0.07 off the model's own log-probability at zero
    variance. Positions count from the first real token, right pads included; a left pad's stays 0."""
    from transformers import BertConfig, BertForMaskedLM

    from hf_evon import bma_log_likelihood

    torch.manual_seed(0)
    config = BertConfig(vocab_size=48, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)  # fmt: skip
    model = BertForMaskedLM(config).eval()
    point = EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, ess=1e4), model).with_ess(float("inf"))
    ids = torch.randint(3, 48, (3, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, 5:] = 0  # the last row right-padded
    labels = ids.clone()
    labels[:, ::2] = -100  # scored at odd positions: the pads at 5 and 7 among them
    result = bma_log_likelihood(model, point, ids, attention_mask=mask, labels=labels, num_samples=1, seed=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    own = out.logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    scored = labels != -100
    assert torch.allclose(result.token_log_probs[scored], own[scored], atol=1e-5)
    assert float(result.loss) == pytest.approx(float(out.loss), abs=1e-5)
    # a left-padded row still scores as it does alone
    left = torch.cat([torch.zeros(1, 2, dtype=ids.dtype), ids[:1, :6]], 1)
    left_mask = torch.cat([torch.zeros(1, 2, dtype=mask.dtype), torch.ones(1, 6, dtype=mask.dtype)], 1)
    alone = bma_log_likelihood(model, point, ids[:1, :6], num_samples=1, seed=0)
    padded = bma_log_likelihood(model, point, left, attention_mask=left_mask, num_samples=1, seed=0)
    assert torch.allclose(padded.token_log_probs[:, 2:], alone.token_log_probs, atol=1e-5)
