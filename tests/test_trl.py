"""EVON inside TRL's SFTTrainer (EVONTrainerMixin + SFTTrainer): packing, TRL's metrics, evon/* logs, BMA.

A tiny GPT-2 built from a config, a byte-level BPE tokenizer trained here on standard-library
docstrings, a few steps on CPU. Skipped without ``trl`` (``pip install hf-evon[trl]``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import json
import math
import string
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from hf_evon import EVON
from hf_evon.posterior.posterior import POSTERIOR_WEIGHTS_NAME

trl = pytest.importorskip("trl")

from hf_evon.trainer import EVONSFTConfig, EVONSFTTrainer  # noqa: E402
from hf_evon.trainer.combined import evon_config_class  # noqa: E402


def _paragraphs() -> list[str]:
    texts = []
    for module in (json, textwrap, string, collections, functools, inspect):
        for obj in [module, *vars(module).values()]:
            doc = inspect.getdoc(obj) if callable(obj) or obj is module else None
            if doc:
                texts += [p.strip() for p in doc.split("\n\n") if len(p.strip()) > 40]
    return sorted(set(texts))


@pytest.fixture(scope="module")
def corpus() -> tuple[PreTrainedTokenizerFast, Dataset, Dataset]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = _paragraphs()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=384,
            special_tokens=["<|endoftext|>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>")
    return tokenizer, Dataset.from_dict({"text": texts[:48]}), Dataset.from_dict({"text": texts[48:60]})


def tiny_gpt2(tokenizer: PreTrainedTokenizerFast) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=len(tokenizer), n_positions=128,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def sft_config(tmp_path, **overrides) -> EVONSFTConfig:
    values = dict(
        output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, bf16=False, seed=0,
        max_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=64, logging_steps=1,
        packing=True, max_length=64, gradient_checkpointing=False, disable_tqdm=True, save_strategy="no",
        lr_scheduler_type="constant", evon_learning_rate=2e-2, evon_adamw_learning_rate=1e-3, evon_ess=1e3,
        evon_hess_init=1.0, evon_precondition_frequency=2, bma_num_samples=2,
    )  # fmt: skip
    values.update(overrides)
    return EVONSFTConfig(**values)


def test_sft_trainer_with_evon_packing_trl_metrics_evon_logs_and_bma(tmp_path, corpus):
    tokenizer, train, evaluation = corpus
    model = tiny_gpt2(tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = EVONSFTTrainer(
        model=model, args=sft_config(tmp_path), train_dataset=train, eval_dataset=evaluation,
        processing_class=tokenizer,
    )  # fmt: skip
    assert trainer.args.packing and "position_ids" in next(
        iter(trainer.get_train_dataloader())
    )  # packed rows
    trainer.train()
    opt = trainer.evon_optimizer
    assert isinstance(opt, EVON)
    evon_names = next(g for g in opt.param_groups if g["algorithm"] == "evon")["param_names"]
    assert "transformer.h.0.attn.c_attn.weight" in evon_names
    named = dict(trainer.model.named_parameters())
    assert all(not torch.equal(named[n].detach(), before[n]) for n in evon_names)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    for entry in logs:  # TRL's training metrics and ours, side by side
        assert {"mean_token_accuracy", "entropy", "num_tokens"} <= set(entry), entry
        assert (
            entry["evon/posterior_std_mean"] > 0
            and entry["evon/hess_min"] > 0
            and math.isfinite(entry["loss"])
        )

    calls = [0]
    trainer.model.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    metrics = trainer.evaluate()
    batches = len(trainer.get_eval_dataloader())
    assert batches == 1
    assert calls[0] == 1 + 2  # TRL's pass is reused for the mean metrics, then S = 2 samples
    assert {"eval_loss", "eval_mean_token_accuracy", "eval_entropy"} <= set(metrics)  # TRL's
    # ours: read from TRL's fused per-token log-probabilities, so one batch gives exactly its loss
    assert metrics["eval_mean_nll"] == pytest.approx(metrics["eval_loss"], rel=1e-5)
    assert metrics["eval_mean_perplexity"] == pytest.approx(math.exp(metrics["eval_mean_nll"]), rel=1e-6)
    assert (
        math.isfinite(metrics["eval_bma_nll"])
        and abs(metrics["eval_bma_nll"] - metrics["eval_mean_nll"]) > 1e-5
    )
    trainer.save_model()
    assert (tmp_path / "out" / POSTERIOR_WEIGHTS_NAME).is_file()


def test_trls_num_tokens_counts_each_token_once_whatever_evon_mc_samples(tmp_path, corpus):
    """TRL adds a micro-batch's tokens at each compute_loss (its private _total_train_tokens), and
    EVON runs each micro-batch once per posterior sample: num_tokens was K times plain SFT's."""
    from trl import SFTConfig, SFTTrainer

    tokenizer, train, _ = corpus
    common = dict(report_to="none", use_cpu=True, bf16=False, seed=0, max_steps=2, per_device_train_batch_size=4,
                  logging_steps=1, packing=True, max_length=64, gradient_checkpointing=False, disable_tqdm=True,
                  save_strategy="no")  # fmt: skip
    plain = SFTTrainer(model=tiny_gpt2(tokenizer), args=SFTConfig(output_dir=str(tmp_path / "plain"), **common),
                       train_dataset=train, processing_class=tokenizer)  # fmt: skip
    plain.train()
    expected = [h["num_tokens"] for h in plain.state.log_history if "loss" in h]
    assert len(expected) == 2 and expected[0] > 0
    trainer = EVONSFTTrainer(model=tiny_gpt2(tokenizer), args=sft_config(tmp_path, max_steps=2, evon_mc_samples=3),
                             train_dataset=train, processing_class=tokenizer)  # fmt: skip
    trainer.train()
    assert [h["num_tokens"] for h in trainer.state.log_history if "loss" in h] == expected


def test_plain_sft_config_is_converted_keeping_its_fields(tmp_path, corpus):
    tokenizer, train, _ = corpus
    args = trl.SFTConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, packing=True, max_length=48,
        learning_rate=3e-4, gradient_checkpointing=False,
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"plain SFTConfig: converted to EVONSFTConfig"):
        trainer = EVONSFTTrainer(
            model=tiny_gpt2(tokenizer), args=args, train_dataset=train, processing_class=tokenizer
        )
    assert isinstance(trainer.args, EVONSFTConfig) and isinstance(trainer.args, trl.SFTConfig)
    assert trainer.args.packing and trainer.args.max_length == 48 and trainer.args.learning_rate == 3e-4


def test_sft_peft_config_is_wrapped_by_trl_and_the_posterior_covers_the_adapter(tmp_path, corpus):
    from peft import LoraConfig, PeftModel

    tokenizer, train, evaluation = corpus
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # peft: fan_in_fan_out for GPT-2's Conv1D
        trainer = EVONSFTTrainer(
            model=tiny_gpt2(tokenizer), args=sft_config(tmp_path, max_steps=2), train_dataset=train,
            eval_dataset=evaluation, processing_class=tokenizer, peft_config=lora,
        )  # fmt: skip
    assert isinstance(trainer.model, PeftModel)
    trainer.train()
    posterior = trainer.current_posterior()
    assert posterior.names and all("lora_" in n for n in posterior.names)
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_bma_nll"]) and "eval_mean_token_accuracy" in metrics


def test_evon_sft_config_keeps_every_default_trl_changes(tmp_path):
    """Issue 33 §3: EVONSFTConfig silently took TrainingArguments' defaults where SFTConfig has its
    own (gradient_checkpointing True -> False, bf16 auto -> False, logging_steps 10 -> 500, the
    learning rate): EVONConfig comes first in its MRO. Every default SFTConfig changes is kept."""
    from dataclasses import MISSING, fields

    from transformers import TrainingArguments

    def default(f):  # noqa: ANN001, ANN202
        return f.default if f.default_factory is MISSING else f.default_factory()

    base = {f.name: default(f) for f in fields(TrainingArguments)}
    changed = {f.name: default(f) for f in fields(trl.SFTConfig) if f.name in base and default(f) != base[f.name]}
    assert {"gradient_checkpointing", "logging_steps", "bf16"} <= set(changed)  # the test sees TRL's changes
    ours = {f.name: default(f) for f in fields(EVONSFTConfig)}
    assert {name: ours[name] for name in changed} == changed
    # and built: the same resolved values as SFTConfig's (bf16 'auto' resolves alike)
    kw = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    evon, sft = EVONSFTConfig(**kw), trl.SFTConfig(**kw)
    for name in changed:
        assert getattr(evon, name) == getattr(sft, name), name


def test_a_raw_text_calibration_dataset_is_prepared_as_trl_prepares_an_eval_set(tmp_path, corpus):
    """A ``calibration_dataset`` of raw text, as TRL users pass their eval sets, was handed to the
    collator unprepared ("No columns in the dataset match the model's forward method signature").
    It is prepared at construction and in ``calibrate(dataset)`` by TRL's ``_prepare_dataset``,
    which leaves a prepared dataset as it is (the private behaviour relied on, pinned here)."""
    tokenizer, train, evaluation = corpus
    held_out = Dataset.from_dict({"text": _paragraphs()[60:72]})
    trainer = EVONSFTTrainer(
        model=tiny_gpt2(tokenizer), args=sft_config(tmp_path, packing=False), train_dataset=train,
        eval_dataset=evaluation, processing_class=tokenizer, calibration_dataset=held_out,
    )  # fmt: skip
    prepared = trainer.calibration_dataset
    expected = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in held_out["text"]]
    assert prepared["input_ids"] == [ids[: trainer.args.max_length] for ids in expected]  # TRL's EOS, max_length
    assert trainer._prepared_for_calibration(prepared)["input_ids"] == prepared["input_ids"]
    trainer.train()
    first = trainer.calibration
    assert first.num_targets == sum(len(ids) - 1 for ids in prepared["input_ids"])  # every next token
    again = trainer.calibrate(held_out)  # raw text passed to calibrate: prepared the same way
    assert again.mean_nll == pytest.approx(first.mean_nll, rel=1e-9) and again.num_targets == first.num_targets


def _scored_log_probs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(next label) of ``batch`` as TRL's loss forward reads it (``use_cache=False``, under which
    transformers keeps packed sequences apart), 0 where not scored, and the scored mask."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        logp = torch.log_softmax(model(**inputs, use_cache=False).logits.double(), dim=-1)[:, :-1]
    targets = batch["labels"][:, 1:]
    kept = targets.ne(-100)
    return logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * kept, kept


def test_bma_and_calibration_read_packed_sequences_apart_as_trls_loss_does_whatever_use_cache(tmp_path, corpus):
    """TRL's loss forward sets use_cache=False, under which transformers reads the position_ids of a
    padding-free packed row as one attention block per sequence; with ``use_cache=True`` in the config,
    the BMA samples and the calibration ran the model with a cache, under which every token of the row
    attends to the sequences packed before it: eval_bma_nll and the calibration's NLLs scored other
    contexts than eval_mean_nll and the training loss."""
    tokenizer, train, evaluation = corpus
    held_out = Dataset.from_dict({"text": _paragraphs()[60:72]})
    trainer = EVONSFTTrainer(
        model=tiny_gpt2(tokenizer), args=sft_config(tmp_path, max_steps=2, use_cache=True), train_dataset=train,
        eval_dataset=evaluation, processing_class=tokenizer,
    )  # fmt: skip
    assert trainer.model.config.use_cache
    trainer.train()  # calibrated below, after the BMA passes of the posterior as trained
    model, posterior, seeds = trainer.model.eval(), trainer._evaluated_posterior(), (0, 1)
    assert trainer.args.bma_num_samples == len(seeds) and trainer.args.bma_seed == 0 and posterior.temperature == 1
    metrics = trainer.evaluate()
    mean_nll = bma_nll = tokens = 0.0
    for batch in trainer.get_eval_dataloader():
        batch = trainer._prepare_inputs(batch)
        starts = batch["position_ids"].eq(0)
        assert int(starts.sum()) > 1 and not bool(batch["labels"][starts].ne(-100).any())  # packed, apart
        logp, kept = _scored_log_probs(model, batch)
        samples = []
        for seed in seeds:
            with posterior.sampled(model, seed=seed):
                samples.append(_scored_log_probs(model, batch)[0])
        mean_nll -= float(logp.sum())
        bma_nll -= float(((torch.logsumexp(torch.stack(samples), 0) - math.log(len(seeds))) * kept).sum())
        tokens += float(kept.sum())
    assert metrics["eval_mean_nll"] == pytest.approx(mean_nll / tokens, rel=1e-6)
    assert metrics["eval_bma_nll"] == pytest.approx(bma_nll / tokens, rel=1e-6)

    result = trainer.calibrate(held_out)
    nll = targets = 0.0
    for batch in trainer._uncached_eval_dataloader(trainer._prepared_for_calibration(held_out)):
        logp, kept = _scored_log_probs(model, trainer._prepare_inputs(batch))
        nll, targets = nll - float(logp.sum()), targets + float(kept.sum())
    assert result.num_targets == targets
    assert result.mean_nll == pytest.approx(nll / targets, rel=1e-6)


def test_a_calibration_dataset_that_is_the_raw_eval_set_is_refused(tmp_path, corpus):
    """TRL prepares the eval set into a new dataset before the Trainer keeps it: the eval set as
    given is refused as the calibration split too, by keyword or inside a dict of eval sets."""
    tokenizer, train, evaluation = corpus
    for given in (evaluation, {"dev": evaluation}):
        with pytest.raises(ValueError, match="calibration_dataset is the eval_dataset"):
            EVONSFTTrainer(
                model=tiny_gpt2(tokenizer), args=sft_config(tmp_path, packing=False), train_dataset=train,
                eval_dataset=given, processing_class=tokenizer, calibration_dataset=evaluation,
            )  # fmt: skip


def test_calibrate_refuses_the_eval_set_as_given_and_as_trl_prepared_it(tmp_path, corpus):
    """TRL keeps the eval set prepared anew (``trainer.eval_dataset`` is another object), and
    ``calibrate(dataset)`` prepares its dataset anew too: the raw eval set, the prepared one, alone
    or in a dict of eval sets, are each refused before any pass; a reassigned eval set leaves the
    one first given free to calibrate on."""
    tokenizer, train, evaluation = corpus
    for given in (evaluation, {"dev": evaluation}):
        trainer = EVONSFTTrainer(
            model=tiny_gpt2(tokenizer), args=sft_config(tmp_path, packing=False), train_dataset=train,
            eval_dataset=given, processing_class=tokenizer,
        )  # fmt: skip
        kept = trainer.eval_dataset["dev"] if isinstance(given, dict) else trainer.eval_dataset
        assert kept is not evaluation  # TRL's preparation: what the identity check alone missed
        for dataset in (evaluation, kept):
            with pytest.raises(ValueError, match=r"^calibrate\(\): dataset is the eval_dataset"):
                trainer.calibrate(dataset)
    trainer.eval_dataset = Dataset.from_dict({"text": _paragraphs()[60:72]})
    with pytest.raises(ValueError, match="no posterior yet"):  # past the eval-set check: not refused
        trainer.calibrate(evaluation)


def test_evon_config_class_of_trls_configs_keeps_their_rates_in_a_fresh_process(tmp_path):
    """Two defects of one rule. (1) evon_config_class(SFTConfig) in a process that had not imported
    hf_evon.trainer.sft built a second class instead of EVONSFTConfig. (2) The rate a TRL config
    declares (the one you would give AdamW for that trainer: SFT 2e-5, GRPO and DPO 1e-6) was kept by
    EVONSFTConfig but reset to None (chosen from the model: 50x GRPO's) by every built combination.
    A base's own rate is kept, with EVONConfig's help; TrainingArguments' generic one is EVON's
    choice (None)."""
    script = (
        "import trl\n"
        "from transformers import TrainingArguments, Seq2SeqTrainingArguments\n"
        "from hf_evon import EVONConfig\n"
        "from hf_evon.trainer.combined import evon_config_class\n"
        "sft = evon_config_class(trl.SFTConfig)\n"
        "import hf_evon.trainer.sft as module\n"
        "print(sft is module.EVONSFTConfig)\n"
        "own = EVONConfig.__dataclass_fields__['learning_rate'].metadata['help']\n"
        "for base in (trl.SFTConfig, trl.GRPOConfig, trl.DPOConfig, TrainingArguments, Seq2SeqTrainingArguments):\n"
        "    field = evon_config_class(base).__dataclass_fields__['learning_rate']\n"
        "    print(field.default, field.metadata['help'] == own)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    declared = [f"{_declared_rate(base)} True" for base in (trl.SFTConfig, trl.GRPOConfig, trl.DPOConfig)]
    assert proc.stdout.splitlines() == ["True", *declared, "None True", "None True"]
    args = evon_config_class(trl.GRPOConfig)(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert args.learning_rate == _declared_rate(trl.GRPOConfig) == 1e-6


def _declared_rate(base):  # noqa: ANN001, ANN202
    return {f.name: f.default for f in dataclasses.fields(base)}["learning_rate"]


def test_the_mixin_composes_with_trl_trainers_that_take_args_third(tmp_path, corpus):
    """TRL's DPOTrainer(model, ref_model, args), as GRPOTrainer(model, reward_funcs, args), takes its
    arguments third: the mixin passed ``args`` on second, so ``EVONDPOTrainer(model=..., ref_model=...,
    args=...)`` raised "multiple values for argument 'ref_model'" (and without ref_model, the config
    became the reference model). ``args`` and ``model`` are found by name in the subclass's order."""
    from trl import DPOConfig, DPOTrainer

    from hf_evon.trainer import EVONTrainerMixin

    class EVONDPOTrainer(EVONTrainerMixin, DPOTrainer):
        config_class = evon_config_class(DPOConfig)

    tokenizer, train, _ = corpus
    texts = train["text"][:8]
    pairs = Dataset.from_dict(
        {"prompt": [t[:30] for t in texts], "chosen": [t[30:80] for t in texts], "rejected": [t[80:130] for t in texts]}
    )
    args = EVONDPOTrainer.config_class(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, max_steps=2, per_device_train_batch_size=4,
        max_length=64, gradient_checkpointing=False, disable_tqdm=True, save_strategy="no", evon_ess=1e3,
        learning_rate=1e-3,  # DPO's own 1e-6 barely moves a float32 weight; EVON's first step moves none
    )  # fmt: skip
    model, reference = tiny_gpt2(tokenizer), tiny_gpt2(tokenizer)
    by_name = EVONDPOTrainer(model=model, ref_model=reference, args=args, train_dataset=pairs, processing_class=tokenizer)
    assert by_name.args is args and by_name.ref_model is reference and by_name.model is model
    by_place = EVONDPOTrainer(model, reference, args, train_dataset=pairs, processing_class=tokenizer)
    assert by_place.args is args and by_place.ref_model is reference and by_place.model is model
    before = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    by_place.train()
    assert isinstance(by_place.evon_optimizer, EVON)
    assert not torch.equal(model.transformer.h[0].attn.c_attn.weight.detach(), before)


def test_plain_trl_configs_whose_post_init_derives_fields_are_converted(tmp_path):
    """GRPOConfig's (and RLOOConfig's) __post_init__ derives generation_batch_size from
    steps_per_generation (or the other way round) and refuses both given: converting a plain one
    rebuilt it from all its values and raised "'generation_batch_size' and 'steps_per_generation'
    can not be both configured". Every field keeps the plain config's value, the EVON fields their
    defaults, and EVONConfig's checks and choices still apply."""
    from dataclasses import MISSING, fields

    from hf_evon.trainer.combined import converted_config

    kw = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False)
    for base in (trl.GRPOConfig, trl.RLOOConfig, trl.SFTConfig):
        plain = base(**kw, per_device_train_batch_size=4, steps_per_generation=2) if base is not trl.SFTConfig else base(**kw)
        target = evon_config_class(base)
        converted = converted_config(plain, target)
        assert type(converted) is target
        assert {f.name: getattr(converted, f.name) for f in fields(base)} == {
            f.name: getattr(plain, f.name) for f in fields(base)
        }, base.__name__
        evon_only = [f for f in fields(target) if f.name not in {g.name for g in fields(base)}]
        assert evon_only and all(
            getattr(converted, f.name) == (f.default if f.default_factory is MISSING else f.default_factory())
            for f in evon_only
        )
    ranked = converted_config(trl.SFTConfig(**kw, metric_for_best_model="eval_bma_nll"), EVONSFTConfig)
    assert ranked.greater_is_better is False  # EVONConfig's choice for a lower-is-better metric
    half = trl.SFTConfig(**kw)
    half.fp16 = True  # set after its checks (fp16 needs a GPU): EVONConfig's refusal still holds
    with pytest.raises(ValueError, match=r"EVONConfig\.fp16 = True is not supported"):
        converted_config(half, EVONSFTConfig)


def test_evon_mc_samples_above_one_is_refused_for_trl_trainers_that_buffer_generations(tmp_path, corpus):
    """GRPOTrainer (RLOO, Distillation) advances its generation buffer at each training_step call,
    and EVON runs training_step once per posterior sample: with evon_mc_samples=2 each sample of a
    micro-batch trained on other completions and generation ran twice as often, silently. Refused
    when the trainer is made; one sample per micro-batch trains as GRPO does."""
    with pytest.raises(ValueError, match=r"evon_mc_samples = 2 .*EVONGRPOTrainer"):
        _evon_grpo(tmp_path, corpus, evon_mc_samples=2)
    assert _evon_grpo(tmp_path, corpus, evon_mc_samples=1).args.evon_mc_samples == 1


def test_trl_reward_and_dpo_num_tokens_count_each_token_once_whatever_evon_mc_samples(tmp_path, corpus):
    """RewardTrainer and DPOTrainer (as KTO) add a micro-batch's tokens to their private
    _total_train_tokens at each compute_loss, as SFTTrainer does; EVONSFTTrainer alone counted them
    once, so a mixin subclass of either logged num_tokens evon_mc_samples times the plain trainer's."""
    from transformers import GPT2ForSequenceClassification
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

    from hf_evon.trainer import EVONTrainerMixin

    tokenizer, train, _ = corpus
    texts = train["text"][:8]
    pairs = Dataset.from_dict(
        {"prompt": [t[:30] for t in texts], "chosen": [t[30:80] for t in texts], "rejected": [t[80:130] for t in texts]}
    )

    def scorer() -> GPT2ForSequenceClassification:
        config = tiny_gpt2(tokenizer).config
        config.num_labels = 1
        torch.manual_seed(0)
        return GPT2ForSequenceClassification(config)

    common = dict(report_to="none", use_cpu=True, bf16=False, seed=0, max_steps=2, per_device_train_batch_size=4,
                  logging_steps=1, max_length=64, gradient_checkpointing=False, disable_tqdm=True, save_strategy="no",
                  learning_rate=1e-3)  # fmt: skip
    for base, config, extra in (
        (RewardTrainer, RewardConfig, lambda: {"model": scorer()}),
        (DPOTrainer, DPOConfig, lambda: {"model": tiny_gpt2(tokenizer), "ref_model": tiny_gpt2(tokenizer)}),
    ):
        plain = base(args=config(output_dir=str(tmp_path / "plain"), **common), train_dataset=pairs,
                     processing_class=tokenizer, **extra())  # fmt: skip
        plain.train()
        expected = [h["num_tokens"] for h in plain.state.log_history if "loss" in h]
        assert len(expected) == 2 and expected[0] > 0, base.__name__
        evon_class = type(f"EVON{base.__name__}", (EVONTrainerMixin, base), {"config_class": evon_config_class(config)})
        args = evon_class.config_class(output_dir=str(tmp_path / "evon"), evon_mc_samples=3, evon_ess=1e3, **common)
        trainer = evon_class(args=args, train_dataset=pairs, processing_class=tokenizer, **extra())
        trainer.train()
        assert [h["num_tokens"] for h in trainer.state.log_history if "loss" in h] == expected, base.__name__


def _preference_pairs(corpus) -> Dataset:
    """12 raw preference pairs (prompt, chosen, rejected) cut from the corpus's texts."""
    texts = corpus[1]["text"][:12]
    return Dataset.from_dict(
        {"prompt": [t[:30] for t in texts], "chosen": [t[30:80] for t in texts], "rejected": [t[80:130] for t in texts]}
    )


def _reward_trainer(tmp_path, corpus, settings: dict | None = None, **datasets):
    """A mixin subclass of TRL's RewardTrainer on a tiny GPT-2 scorer, one step over the first 8 pairs."""
    from transformers import GPT2ForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from hf_evon.trainer import EVONTrainerMixin

    class EVONRewardTrainer(EVONTrainerMixin, RewardTrainer):
        config_class = evon_config_class(RewardConfig)

    tokenizer = corpus[0]
    config = tiny_gpt2(tokenizer).config
    config.num_labels = 1
    args = EVONRewardTrainer.config_class(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, max_steps=1, per_device_train_batch_size=4,
        max_length=64, gradient_checkpointing=False, disable_tqdm=True, save_strategy="no", evon_ess=1e3, **(settings or {}),
    )  # fmt: skip
    return EVONRewardTrainer(model=GPT2ForSequenceClassification(config), args=args,
                             train_dataset=_preference_pairs(corpus).select(range(8)), processing_class=tokenizer, **datasets)  # fmt: skip


def test_a_calibration_dataset_the_trainer_cannot_batch_is_refused_naming_it(tmp_path, corpus):
    """A raw preference calibration_dataset beside a mixin subclass of RewardTrainer (as of DPOTrainer,
    which prepare only their train and eval sets) failed in train() with the Trainer's "No columns in
    the dataset match the model's forward method signature", naming no dataset, while the train set
    of that very format trains. It is refused naming calibration_dataset (or calibrate()'s dataset),
    the Trainer's message kept, before any step."""
    pairs = _preference_pairs(corpus)
    trainer = _reward_trainer(tmp_path, corpus, calibration_dataset=pairs.select(range(8, 12)))
    with pytest.raises(ValueError, match=r"^EVONTrainer: calibration_dataset .*No columns in the dataset match"):
        trainer.train()
    assert trainer.state.global_step == 0 and trainer.evon_optimizer is None
    trainer.calibration_dataset = None
    trainer.train()
    with pytest.raises(ValueError, match=r"^EVONTrainer: calibrate\(\): dataset .*No columns in the dataset match"):
        trainer.calibrate(pairs.select(range(8, 12)))


def test_plain_training_arguments_or_an_evon_config_given_to_evon_sft_trainer_become_its_config(tmp_path, corpus):
    """SFTTrainer takes plain TrainingArguments and rebuilds them as an SFTConfig; EVONSFTTrainer made an
    EVONConfig of them (as of an EVONConfig given as is), which TRL then rebuilt as SFTConfig(**to_dict())
    and raised "SFTConfig.__init__() got an unexpected keyword argument 'evon_learning_rate'". Either is
    rebuilt as an EVONSFTConfig: its values kept (the EVON fields an EVONConfig sets), SFTConfig's own
    fields as TRL's rebuild resolves them (pad_to_multiple_of "auto" -> None)."""
    from dataclasses import fields

    from transformers import TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from hf_evon import EVONConfig

    tokenizer, train, _ = corpus
    train = Dataset.from_dict({"text": [t[:100] for t in train["text"]]})  # within n_positions: SFT's max_length
    kw = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=1, per_device_train_batch_size=4)
    plain = SFTTrainer(model=tiny_gpt2(tokenizer), args=TrainingArguments(**kw, learning_rate=1e-3),
                       train_dataset=train, processing_class=tokenizer)  # fmt: skip
    sft_only = [f.name for f in fields(SFTConfig) if f.name not in {g.name for g in fields(TrainingArguments)}]
    with pytest.warns(UserWarning, match=r"plain TrainingArguments: converted to EVONSFTConfig"):
        trainer = EVONSFTTrainer(model=tiny_gpt2(tokenizer), args=TrainingArguments(**kw, learning_rate=1e-3),
                                 train_dataset=train, processing_class=tokenizer)  # fmt: skip
    assert type(trainer.args) is EVONSFTConfig and trainer.args.learning_rate == 1e-3
    assert {n: getattr(trainer.args, n) for n in sft_only} == {n: getattr(plain.args, n) for n in sft_only}
    assert trainer.args.pad_to_multiple_of is None  # resolved, as SFTConfig's post-init does
    with pytest.warns(UserWarning, match="plain TrainingArguments"):
        ranked = EVONSFTTrainer(model=tiny_gpt2(tokenizer), args=TrainingArguments(**kw, metric_for_best_model="eval_bma_nll"),
                                train_dataset=train, processing_class=tokenizer)  # fmt: skip
    assert ranked.args.greater_is_better is False  # EVONConfig's choice for a lower-is-better metric
    given = EVONConfig(**kw, evon_mc_samples=2, bma_num_samples=3, evon_ess=1e3)
    trainer = EVONSFTTrainer(model=tiny_gpt2(tokenizer), args=given, train_dataset=train, processing_class=tokenizer)
    assert type(trainer.args) is EVONSFTConfig
    assert (trainer.args.evon_mc_samples, trainer.args.bma_num_samples, trainer.args.evon_ess) == (2, 3, 1e3)
    assert {n: getattr(trainer.args, n) for n in sft_only} == {n: getattr(plain.args, n) for n in sft_only}
    trainer.train()
    assert trainer.evon_optimizer.mc_samples == 2 and trainer.state.global_step == 1


def test_evaluate_of_unlabelled_preference_batches_warns_once_and_bma_true_is_refused(tmp_path, corpus, monkeypatch):
    """A mixin subclass of RewardTrainer (as of DPOTrainer, KTOTrainer) evaluates batches of preference
    data, no labels: evaluate() and evaluate(bma=True) returned no eval_mean_*/eval_bma_* metrics and
    said nothing. A plain evaluate() now warns once per trainer; evaluate(bma=True), which asks for the
    BMA metrics, raises a ValueError saying the batches hold no labels."""
    import hf_evon.trainer.evaluation as evaluation

    trainer = _reward_trainer(
        tmp_path, corpus, {"per_device_eval_batch_size": 4, "bma_num_samples": 2},
        eval_dataset=_preference_pairs(corpus).select(range(8, 12)),
    )  # fmt: skip
    trainer.train()
    warned: list[str] = []
    monkeypatch.setattr(evaluation.logger, "warning", lambda message, *a, **k: warned.append(message))
    for _ in range(2):
        metrics = trainer.evaluate()
        assert "eval_mean_reward" in metrics  # RewardTrainer's own metric; EVON's mean/BMA ones are absent
        assert not {"eval_mean_nll", "eval_mean_accuracy"} & set(metrics) and not any("_bma_" in k for k in metrics)
    assert len(warned) == 1 and "no labels" in warned[0] and "eval_mean_" in warned[0], warned
    with pytest.raises(ValueError, match=r"^evaluate\(bma=True\): .*no labels.*'labels'"):
        trainer.evaluate(bma=True)
    assert not trainer._evon_in_evaluate and not trainer._evon_bma_asked and trainer._evon_evaluation is None
    assert "eval_loss" in trainer.evaluate() and len(warned) == 1


@pytest.mark.parametrize("name", ["SFT", "DPO", "KTO", "GRPO", "RLOO", "Reward"])
def test_an_evon_trl_trainer_without_args_picks_the_output_dir_trls_trainer_picks(tmp_path, corpus, monkeypatch, name):
    """A mixin subclass of TRL's DPOTrainer, KTOTrainer, GRPOTrainer, RLOOTrainer or RewardTrainer
    given args=None wrote to Trainer's "tmp_trainer" where the TRL trainer writes to "<model name>-DPO"
    (and so on); EVONSFTTrainer alone had its own code for SFTTrainer's "<model name>-SFT". Each
    takes its TRL trainer's default, as its own config class."""
    import transformers.training_args
    from transformers import GPT2ForSequenceClassification

    from hf_evon.trainer import EVONTrainerMixin

    monkeypatch.chdir(tmp_path)
    # TRL configs' default bf16=True is refused on a machine without bf16 support: both are only built here
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda *a, **k: True)
    tokenizer, train, _ = corpus
    texts = train["text"][:8]
    pairs = {"prompt": [t[:30] for t in texts], "chosen": [t[30:80] for t in texts]}
    pairs["rejected"] = [t[80:130] for t in texts]
    prompts = {"prompt": [t[:20] for t in texts]}
    labelled = {"prompt": pairs["prompt"], "completion": pairs["chosen"], "label": [True, False] * 4}

    saved = tmp_path / "some-org" / "tiny-gpt2"
    tiny_gpt2(tokenizer).save_pretrained(saved)  # RLOOTrainer loads its reference model from the policy's path

    def lm() -> GPT2LMHeadModel:
        made = tiny_gpt2(tokenizer)
        made.config._name_or_path = str(saved)  # as from_pretrained(saved) sets it
        return made

    def scorer() -> GPT2ForSequenceClassification:
        config = lm().config
        config.num_labels = 1
        return GPT2ForSequenceClassification(config)

    def reward(completions, **kwargs):  # noqa: ANN001, ANN003, ANN202
        return [float(len(c)) for c in completions]

    kwargs = {
        "SFT": lambda: {"model": lm(), "train_dataset": Dataset.from_dict({"text": texts})},
        "DPO": lambda: {"model": lm(), "ref_model": lm(), "train_dataset": Dataset.from_dict(pairs)},
        "KTO": lambda: {"model": lm(), "ref_model": lm(), "train_dataset": Dataset.from_dict(labelled)},
        "GRPO": lambda: {"model": lm(), "reward_funcs": reward, "train_dataset": Dataset.from_dict(prompts)},
        "RLOO": lambda: {"model": lm(), "reward_funcs": reward, "train_dataset": Dataset.from_dict(prompts)},
        "Reward": lambda: {"model": scorer(), "train_dataset": Dataset.from_dict(pairs)},
    }[name]
    base = getattr(trl, f"{name}Trainer")
    if name == "SFT":
        evon_class = EVONSFTTrainer
    else:
        config_class = evon_config_class(getattr(trl, f"{name}Config"))
        evon_class = type(f"EVON{name}Trainer", (EVONTrainerMixin, base), {"config_class": config_class})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = base(processing_class=tokenizer, **kwargs()).args.output_dir
        trainer = evon_class(processing_class=tokenizer, **kwargs())
    assert trainer.args.output_dir == expected == f"tiny-gpt2-{name}"
    assert type(trainer.args) is evon_class.config_class


def _evon_grpo(tmp_path, corpus, calibration_dataset=None, **settings):
    """A mixin subclass of TRL's GRPOTrainer on a tiny GPT-2, 8 prompts, a length reward."""
    from trl import GRPOConfig, GRPOTrainer

    from hf_evon.trainer import EVONTrainerMixin

    class EVONGRPOTrainer(EVONTrainerMixin, GRPOTrainer):
        config_class = evon_config_class(GRPOConfig)

    tokenizer, train, _ = corpus
    values = dict(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=4, gradient_checkpointing=False, max_steps=2, logging_steps=1,
        learning_rate=1e-3, evon_ess=1e3, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    args = EVONGRPOTrainer.config_class(**{**values, **settings})
    return EVONGRPOTrainer(
        model=tiny_gpt2(tokenizer), reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=args, train_dataset=Dataset.from_dict({"prompt": [t[:20] for t in train["text"][:8]]}),
        processing_class=tokenizer, calibration_dataset=calibration_dataset,
    )  # fmt: skip


def test_grpo_generates_at_the_sample_each_micro_batch_trains_at_and_refuses_a_buffer_spanning_samples(
    tmp_path, corpus
):
    """GRPO generates inside the training_step that first needs a generation, so inside that
    micro-batch's posterior sample. With steps_per_generation (TRL's default: gradient_accumulation_steps)
    or num_iterations above 1 and no importance correction (TRL then assumes the buffered completions
    on-policy), the later micro-batches trained, at other samples, on completions of the first one's,
    silently. Refused when the trainer is made; one generation per micro-batch generates and trains
    at the same sample."""
    for settings in ({"gradient_accumulation_steps": 2}, {"gradient_accumulation_steps": 2, "steps_per_generation": 1,
                                                          "num_iterations": 2}):  # fmt: skip
        with pytest.raises(ValueError, match=r"steps_per_generation \* num_iterations = \d \* \d = 2 is not supported by EVONGRPO"):
            _evon_grpo(tmp_path, corpus, **settings)
    # a buffer GRPO weighs by the generating sample's log-probabilities (old_per_token_logps): kept
    assert _evon_grpo(tmp_path, corpus, num_iterations=2).args.num_iterations == 2
    trainer = _evon_grpo(tmp_path, corpus, gradient_accumulation_steps=2, steps_per_generation=1)
    generated, trained = [], []
    generate, compute_loss = trainer._generate_and_score_completions, type(trainer).compute_loss

    def recording_generate(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        opt = trainer.evon_optimizer
        generated.append((opt.in_sample, opt.noise_label))
        return generate(*args, **kwargs)

    def recording_loss(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        trained.append((self.evon_optimizer.in_sample, self.evon_optimizer.noise_label))
        return compute_loss(self, *args, **kwargs)

    trainer._generate_and_score_completions = recording_generate
    type(trainer).compute_loss = recording_loss
    trainer.train()
    assert trainer.state.global_step == 2
    assert generated == trained == [(True, block) for block in (1, 2, 3, 4)]  # one sample per micro-batch


def test_grpo_evaluate_reports_trls_metrics_and_refuses_bma_naming_the_missing_labels(tmp_path, corpus):
    """GRPO's evaluation batches are lists of prompt rows, not dicts: evaluate() of a mixin subclass
    of GRPOTrainer raised "AttributeError: 'list' object has no attribute 'get'" where it looked for
    the labels. It reports GRPO's own metrics (eval_reward), without eval_mean_*/eval_bma_*, and
    evaluate(bma=True) raises the ValueError saying the batches hold no labels."""
    trainer = _evon_grpo(tmp_path, corpus, max_steps=1, per_device_eval_batch_size=4)
    trainer.eval_dataset = Dataset.from_dict({"prompt": [t[:20] for t in corpus[1]["text"][:4]]})
    trainer.train()
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics and "eval_loss" in metrics
    assert not any(k.startswith(("eval_mean_", "eval_bma_")) for k in metrics), metrics
    with pytest.raises(ValueError, match=r"^evaluate\(bma=True\): the evaluation batches hold no labels"):
        trainer.evaluate(bma=True)


def test_grpo_calibration_on_prompts_is_refused_naming_the_argument_and_what_to_pass_instead(tmp_path, corpus):
    """GRPO's batches are prompts, which its _prepare_inputs turns into generated completions and rewards:
    calibrate(prompts) generated completions and then failed with "calibrate_posterior: a dict batch
    needs a 'labels' entry", naming neither the argument nor what to pass, and calibration_dataset=prompts
    failed only at train() ("calibration_dataset batch 0 has no 'labels'"). Both are refused before any
    generation, naming the argument and hf_evon.calibrate_posterior on labelled batches, which then works."""
    import hf_evon

    prompts = Dataset.from_dict({"prompt": [t[:20] for t in corpus[1]["text"][:4]]})
    advice = r"hf_evon\.calibrate_posterior\(trainer\.model, trainer\.current_posterior\(\), batches\)"
    with pytest.raises(ValueError, match=rf"^calibration_dataset: .*EVONGRPOTrainer.*{advice}.*'labels'"):
        _evon_grpo(tmp_path, corpus, calibration_dataset=prompts)
    trainer = _evon_grpo(tmp_path, corpus, max_steps=1)
    trainer.train()
    generated = []
    trainer._generate_and_score_completions = lambda *a, **k: generated.append(a)  # noqa: ARG005
    with pytest.raises(ValueError, match=rf"^calibrate\(\): dataset: .*EVONGRPOTrainer.*{advice}.*'labels'"):
        trainer.calibrate(prompts)
    assert generated == [] and trainer.calibration is None
    tokenizer = corpus[0]
    ids = tokenizer([t[:40] for t in corpus[1]["text"][:4]], return_tensors="pt", padding=True)
    labels = ids["input_ids"].masked_fill(ids["attention_mask"] == 0, -100)
    batches = [{**ids, "labels": labels}]
    calibrated, result = hf_evon.calibrate_posterior(
        trainer.model, trainer.current_posterior(), batches, grid=[1.0], num_samples=2
    )
    assert result.num_targets == int((labels[:, 1:] != -100).sum()) and calibrated is not None


def test_grpo_calibrate_without_data_names_what_calibrates_it(tmp_path, corpus):
    """calibrate() with no dataset and no calibration_dataset on GRPO said "pass dataset= or
    EVONTrainer(calibration_dataset=...)", both of which this trainer refuses (its batches are prompts
    it generates from); the error names the trainer and hf_evon.calibrate_posterior on labelled batches."""
    trainer = _evon_grpo(tmp_path, corpus, max_steps=1)
    with pytest.raises(ValueError, match=r"^calibrate\(\) needs held-out labelled data.*EVONGRPOTrainer") as err:
        trainer.calibrate()
    message = str(err.value)
    assert "hf_evon.calibrate_posterior(trainer.model, trainer.current_posterior(), batches)" in message
    assert "pass dataset=" not in message and "EVONTrainer(calibration_dataset=...)" not in message
    assert trainer.calibration is None


def test_rloo_trains_with_evon(tmp_path, corpus):
    """RLOOTrainer's loss is not scaled for gradient accumulation and its training batches are lists
    of prompt rows: the mixin read the micro-batch's labels by ``inputs.get`` and train() raised
    "AttributeError: 'list' object has no attribute 'get'" at the first step. A batch that is not a
    Mapping holds no labels: each micro-batch weighs 1/A, as RLOO's own loss is averaged."""
    from trl import RLOOConfig, RLOOTrainer

    from hf_evon.trainer import EVONTrainerMixin

    class EVONRLOOTrainer(EVONTrainerMixin, RLOOTrainer):
        config_class = evon_config_class(RLOOConfig)

    tokenizer, train, _ = corpus
    saved = tmp_path / "tiny-gpt2"
    tiny_gpt2(tokenizer).save_pretrained(saved)  # RLOOTrainer loads its reference model from the policy's path
    model = tiny_gpt2(tokenizer)
    model.config._name_or_path = str(saved)
    args = EVONRLOOTrainer.config_class(
        output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, bf16=False, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=4, gradient_checkpointing=False, max_steps=2, logging_steps=1,
        learning_rate=1e-3, evon_ess=1e3, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = EVONRLOOTrainer(
        model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions], args=args,
        train_dataset=Dataset.from_dict({"prompt": [t[:20] for t in train["text"][:8]]}), processing_class=tokenizer,
    )  # fmt: skip
    before = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.evon_optimizer.recorded_samples == 0
    assert not torch.equal(model.transformer.h[0].attn.c_attn.weight.detach(), before)
    assert [math.isfinite(h["loss"]) and "reward" in h for h in trainer.state.log_history if "loss" in h] == [True] * 2


def test_grpo_bma_predictions_are_refused_naming_the_prompt_batches(tmp_path, corpus):
    """predict(bma=True) and predict_uncertainty() of a mixin subclass of GRPOTrainer ran the sampled
    forwards on what GRPO prepares from a batch of prompts (generated completions, rewards) and failed
    in GPT-2 with "You have to specify either input_ids or inputs_embeds". Both are refused, naming
    the trainer and its prompt batches, before any pass; predict() without bma stays GRPO's."""
    trainer = _evon_grpo(tmp_path, corpus, max_steps=1, per_device_eval_batch_size=4)
    trainer.train()
    prompts = Dataset.from_dict({"prompt": [t[:20] for t in corpus[1]["text"][:4]]})
    calls = [0]
    trainer.model.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    with pytest.raises(ValueError, match=r"^predict\(bma=True\): the batches of EVONGRPOTrainer are prompts"):
        trainer.predict(prompts, bma=True)
    with pytest.raises(ValueError, match=r"^predict_uncertainty\(\): the batches of EVONGRPOTrainer are prompts"):
        trainer.predict_uncertainty(prompts)
    assert calls[0] == 0
    assert "test_loss" in trainer.predict(prompts).metrics
