"""The model card's usage snippet: runnable code that loads the model and the posterior and predicts with BMA.

The snippet loads a tokenizer only where one was saved with the model (``tokenizer_config.json``
beside it, :func:`has_tokenizer`); otherwise a text model gets a few token ids, and a model whose
inputs the card cannot know (``AutoModel``) a placeholder saying so; an image or audio classifier
is loaded with its task's Auto class and gets a placeholder naming its main input, as does a
speech-to-text or image-to-text model, which decodes with ``generate_bma``. A plain ``nn.Module`` (an MLP:
no transformers class, no ``config.json``) is built by the user as in training (its base, wrapped with
the saved adapters, where PEFT adapters are on it) and called on a tensor.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hf_evon.modeling import adapter_of_names, adapters_of_names, in_auto_mapping

__all__ = ["TOKENIZER_FILE", "has_tokenizer", "num_labels", "usage_snippet"]

TOKENIZER_FILE = "tokenizer_config.json"  # what every transformers tokenizer's save_pretrained writes
# the Auto classes of image and audio classifiers: their inputs come from an image processor or a
# feature extractor (never a tokenizer), under the model's ``main_input_name``
_NON_TEXT_AUTO_CLASSES = {
    "AutoModelForImageClassification": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image processor"),
    "AutoModelForAudioClassification": ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "feature extractor"),
}
_LABELLED_AUTO_CLASSES = ("AutoModelForSequenceClassification", "AutoModelForTokenClassification", *_NON_TEXT_AUTO_CLASSES)
_NO_TOKENIZER = "no tokenizer was saved with the model"
_TOKEN_IDS = f"input_ids = torch.tensor([[0, 1, 2, 3]])  # token ids: {_NO_TOKENIZER}"
_SPEECH_TO_TEXT = "AutoModelForSpeechSeq2Seq"  # decodes text from features (Whisper's input_features)
# decodes text from images (a VisionEncoderDecoder's pixel_values), with a prompt's tokens where it takes one
_IMAGE_TO_TEXT = "AutoModelForImageTextToText"
# the Auto classes that decode text from inputs other than token ids alone, and what makes those inputs
_NON_TEXT_DECODERS = {_SPEECH_TO_TEXT: "feature extractor", _IMAGE_TO_TEXT: "processor"}


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """Whether a tokenizer is saved in ``directory``."""
    return os.path.isfile(os.path.join(os.fspath(directory), TOKENIZER_FILE))


def _py(value: Any) -> str:
    """``value`` as a Python string literal that cannot end the snippet's code fence or the section
    (a card's values may come from a config downloaded from elsewhere)."""
    return json.dumps(str(value)).replace("`", "\\x60").replace("<", "\\x3c").replace(">", "\\x3e")


def _auto_class(model_class: str) -> str:
    """The transformers Auto class that reloads a model saved as ``model_class`` (a PEFT wrapper's
    name says its task: ``PeftModelForSeq2SeqLM``)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    )

    if model_class in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.values() or "Seq2SeqLM" in model_class:
        return "AutoModelForSeq2SeqLM"
    if model_class in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES.values():  # Whisper: AutoModel has no LM head
        return _SPEECH_TO_TEXT
    if "CausalLM" in model_class or "LMHead" in model_class:
        return "AutoModelForCausalLM"
    # by transformers' own task mappings first: an audio classifier may be named *ForSequenceClassification
    # (Wav2Vec2's), which AutoModelForSequenceClassification does not load
    # an image-to-text model (VisionEncoderDecoderModel): AutoModel does not load it, and it decodes
    if in_auto_mapping(model_class, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"):
        return _IMAGE_TO_TEXT
    for auto, (mapping, _) in _NON_TEXT_AUTO_CLASSES.items():
        if in_auto_mapping(model_class, mapping):
            return auto
    for task in ("ImageClassification", "AudioClassification", "SequenceClassification", "TokenClassification", "QuestionAnswering", "MultipleChoice", "MaskedLM"):
        if task in model_class:
            return f"AutoModelFor{task}"
    return "AutoModel"


def _is_transformers_model(model_class: str) -> bool:
    """Whether ``model_class`` names a transformers model class (one an Auto class can reload); a
    plain ``nn.Module`` (an MLP) has no ``config.json`` and returns a tensor, not ``.logits``."""
    import transformers

    try:
        cls = getattr(transformers, model_class, None) if model_class.isidentifier() else None
    except Exception:  # a lazy import of an optional backend's class: not loadable here either
        return False
    return isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)


def _posterior_lines(location: str, sub: str) -> list[str]:
    """The posterior loaded and checked against the model, then a blank line."""
    return [
        f"posterior = EVONPosterior.from_pretrained({_py(location)}{sub})",
        "posterior.check_model(model)  # raises if the shapes differ; warns if the weights are not its mean",
        "",
    ]


def _tempered(logits: str, posterior: Any) -> str:
    """``logits`` divided by the posterior's temperature where it has one other than 1: BMA
    (``predict(bma=True)``, the card's text) averages ``softmax(logits / T)``, or each label's
    ``sigmoid(logits / T)``."""
    temperature = getattr(posterior, "config", {}).get("temperature", 1.0)
    untempered = isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature == 1.0
    return logits if untempered else f"({logits} / posterior.temperature)"


def _averaged_probs_lines(
    logits: str,
    problem: str | None = None,
    unset_by_width: bool = False,
    posterior: Any = None,
    computed: tuple[str, ...] = (),
) -> list[str]:
    """BMA of class probabilities: ``logits`` (an expression of ``model`` and ``inputs``) softmaxed
    under 8 weight samples and averaged; a multi-label classifier's (``problem``, transformers'
    ``problem_type``) each label's sigmoid, a regression's outputs themselves (a softmax of one
    output is 1 whatever the input). ``unset_by_width``: without ``problem``, one output is averaged
    as a value and several as class probabilities, as ``predict(bma=True)`` reads such a model.
    ``posterior``: the probabilities are of the logits divided by its temperature (:func:`_tempered`).
    ``computed``: lines run under each sample before the average, which compute ``logits`` (a name then)."""
    if problem == "regression":
        name, averaged, what = "values", logits, "predictions"
    elif problem == "multi_label_classification":  # each label a yes/no of its own
        name, averaged, what = "probs", f"{_tempered(logits, posterior)}.sigmoid()", "per-label probabilities"
    else:
        name, averaged, what = "probs", f"{_tempered(logits, posterior)}.softmax(-1)", "probabilities"
    added = [f"            {name} = {name} + {averaged} / 8"]
    if problem is None and unset_by_width:
        what = "probabilities (of one output: the values)"
        out = logits if logits.isidentifier() else "out"  # an expression is computed once
        softmax = f"{_tempered(out, posterior)}.softmax(-1)"
        added = [
            *([] if out == logits else [f"            out = {logits}"]),
            f"            {name} = {name} + ({out} if {out}.shape[-1] == 1 else {softmax}) / 8",
        ]
    added = [*(f"            {line}" for line in computed), *added]
    return [
        "model.eval()",
        f"{name} = 0.0",
        "with torch.no_grad():",
        f"    for seed in range(8):  # BMA: average the {what} of 8 weight samples",
        "        with posterior.sampled(model, seed=seed):",
        *added,
        f"print({name})",
    ]


_PLAIN_LOGITS = (
    "outputs = model(inputs)",
    'logits = outputs["logits"] if isinstance(outputs, dict) else outputs  # a ModelOutput is a dict',
)


def _plain_module_snippet(
    model_class: str,
    location: str,
    sub: str,
    adapter_lines: list[str] | None = None,
    problem: str | None = None,
    posterior: Any = None,
) -> str:
    """A plain ``nn.Module``'s snippet: the user builds the model as in training, and its forward
    takes a tensor and returns logits, or a dict or ``ModelOutput`` holding them beside its loss (as
    a module the Trainer trains does). ``adapter_lines``: the lines that wrap ``base`` with the PEFT
    adapters the posterior covers (:func:`_peft_model_lines`; None: no adapter); the user then
    builds the base, and the snippet wraps it. ``problem``: the module's ``config.problem_type``, as
    a transformers classifier's (:func:`_averaged_probs_lines`)."""
    name = model_class if model_class.isidentifier() else "model"
    what = "with its weights before the adapter" if adapter_lines is not None else "with its trained weights"
    built = f"# your {name} as built in training, {what} (not a transformers model)"
    model_lines = [f"model = ...  {built}"] if adapter_lines is None else [f"base = ...  {built}", *adapter_lines]
    return "\n".join(
        [
            "import torch",
            *(["from peft import PeftModel"] if adapter_lines is not None else []),
            "from hf_evon import EVONPosterior",
            "",
            *model_lines,
            *_posterior_lines(location, sub),
            "inputs = ...  # a batch of the model's inputs (a tensor)",
            # a plain module has no problem_type as a rule: its outputs' number says what they are
            # a module the Trainer trains returns its loss too: a dict or ModelOutput holding the logits
            *_averaged_probs_lines(
                "logits", problem, unset_by_width=True, posterior=posterior, computed=_PLAIN_LOGITS
            ),
        ]
    )


def num_labels(model: Any) -> int | None:
    """The label count of a classifier (``model.config.num_labels``; PEFT models forward it)."""
    value = getattr(getattr(model, "config", None), "num_labels", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _decoding_lines(tokenizer: bool, auto: str = "", model_class: str = "") -> list[str]:
    """``generate_bma`` on a prompt (a speech-to-text or image-to-text model's: its features or
    pixels, a placeholder naming them), then the output printed (decoded where there is a tokenizer)."""
    if auto in _NON_TEXT_DECODERS:
        printed = "tokenizer.decode(output_ids[0], skip_special_tokens=True)" if tokenizer else "output_ids[0].tolist()"
        maker = _NON_TEXT_DECODERS[auto]
        return [
            f'inputs = ...  # the model\'s inputs: {{"{_main_input_name(model_class)}": ...}} as its {maker} makes them',
            "output_ids = generate_bma(  # averages next-token probabilities over 8 weight samples",
            "    model, posterior, **inputs, num_samples=8, seed=0, max_new_tokens=32,",
            ")",
            f"print({printed})",
        ]
    if not tokenizer:
        return [
            _TOKEN_IDS,
            "output_ids = generate_bma(  # averages next-token probabilities over 8 weight samples",
            "    model, posterior, input_ids, num_samples=8, seed=0, max_new_tokens=32,",
            ")",
            "print(output_ids[0].tolist())",
        ]
    return [
        'inputs = tokenizer("The meaning of life is", return_tensors="pt")',
        "output_ids = generate_bma(  # averages next-token probabilities over 8 weight samples",
        "    model, posterior, inputs.input_ids, attention_mask=inputs.attention_mask,",
        "    num_samples=8, seed=0, max_new_tokens=32,",
        ")",
        "print(tokenizer.decode(output_ids[0], skip_special_tokens=True))",
    ]


def _main_input_name(model_class: str) -> str:
    """The name of the model's main input (``pixel_values``, ``input_values``, ...), read from its
    transformers class; ``input_ids`` where there is none."""
    import transformers

    try:
        cls = getattr(transformers, model_class, None) if model_class.isidentifier() else None
    except Exception:  # a lazy import of an optional backend's class
        cls = None
    name = getattr(cls, "main_input_name", None)
    return name if isinstance(name, str) and name.isidentifier() else "input_ids"


def _input_lines(auto: str, tokenizer: bool, model_class: str = "") -> list[str]:
    """The ``inputs`` of one prediction: tokenized text, token ids, or a placeholder (an image or
    audio classifier's names its main input and what makes it)."""
    if auto in _NON_TEXT_AUTO_CLASSES:
        maker = _NON_TEXT_AUTO_CLASSES[auto][1]
        return [f'inputs = ...  # the model\'s inputs: {{"{_main_input_name(model_class)}": ...}} as its {maker} makes them']
    if auto == "AutoModelForQuestionAnswering" and tokenizer:
        return ['inputs = tokenizer("What is this?", "An example input.", return_tensors="pt")']
    if auto == "AutoModelForMultipleChoice":  # one question, two choices: a batch of (1, 2, tokens)
        if tokenizer:
            return [
                'pairs = tokenizer(["An example input."] * 2, ["A first choice.", "A second choice."],',
                '                  return_tensors="pt", padding=True)',
                "inputs = {key: value.unsqueeze(0) for key, value in pairs.items()}",
            ]
        return [
            "input_ids = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 4]]])"
            f"  # token ids of one question's two choices: {_NO_TOKENIZER}",
            'inputs = {"input_ids": input_ids}',
        ]
    if tokenizer:
        return ['inputs = tokenizer("An example input.", return_tensors="pt")']
    if auto == "AutoModel":  # no task the card knows the inputs of
        return [f"inputs = ...  # the model's inputs (a dict of tensors): {_NO_TOKENIZER}"]
    return [_TOKEN_IDS, 'inputs = {"input_ids": input_ids}']


def _peft_model_lines(names: Any, location: str, rev: str, folder: str | None = None) -> list[str]:
    """The lines that load the PEFT adapters the posterior's ``names`` belong to onto ``base``: one
    adapter with ``PeftModel.from_pretrained``; several (trained together, all active) the first
    ("default" where it is one) so, each other with ``load_adapter`` from where PEFT saved it, and all of
    them made active, as the posterior's samples need them in the forward. ``folder``: the folder of
    ``location`` the adapters are saved in (None: its root)."""
    adapters = sorted(adapters_of_names(names))

    def arguments(adapter: str | None) -> str:
        return _named_adapter_arguments(adapter, location, folder)

    if len(adapters) < 2:
        return [f"model = PeftModel.from_pretrained(base, {_py(location)}{rev}{arguments(adapter_of_names(names))})"]
    order = ["default", *(a for a in adapters if a != "default")] if "default" in adapters else adapters
    first, *others = order
    return [
        f"model = PeftModel.from_pretrained(base, {_py(location)}{rev}{arguments(first)})",
        *(f"model.load_adapter({_py(location)}{rev}{arguments(a)})" for a in others),
        f"model.base_model.set_adapter([{', '.join(map(_py, order))}])  # the posterior covers each of these adapters",
    ]


def _named_adapter_arguments(adapter: str | None, location: str, folder: str | None = None) -> str:
    """What ``PeftModel.from_pretrained(base, location…)`` needs to load the adapter named ``adapter``
    from ``location``'s ``folder`` (None: its root): nothing more for "default"; for any other, PEFT's
    ``save_pretrained`` puts it in a folder of its name (``subfolder``), and the posterior's names
    carry that name (``adapter_name``)."""
    if adapter in (None, "default"):
        return f", subfolder={_py(folder)}" if folder else ""
    # a posterior saved inside the adapter's own folder finds its adapter_config.json right there
    here = not folder and os.path.basename(os.path.normpath(location)) == adapter and os.path.isfile(
        os.path.join(location, "adapter_config.json")
    )
    path = f"{folder}/{adapter}" if folder else adapter
    return ("" if here else f", subfolder={_py(path)}") + f", adapter_name={_py(adapter)}"


def usage_snippet(
    posterior: Any,
    base_model: str | None,
    location: str,
    subfolder: str | None,
    model_id: str | None,
    labels_count: int | None,
    tokenizer: bool,
    revision: str | None = None,
    problem: str | None = None,
    model_subfolder: str | None = None,
) -> str:
    """Runnable code that loads the model and this posterior and predicts with BMA: decoding
    with ``generate_bma`` for causal LMs and encoder-decoders (their next token's averaged
    probabilities under PEFT's prompt learning, which it refuses), averaged start and end
    probabilities for extractive QA, averaged class probabilities otherwise. A PEFT
    classifier's base model is built with ``labels_count`` (its head is in the adapter), and with ``problem``
    where its outputs are no softmax's (a multi-label classifier's, a regression's).
    ``tokenizer``: whether one was saved with the model (the snippet loads it from there).
    ``revision``: the branch of ``location`` the card is on; what the snippet loads from
    ``location`` is loaded from it (without it, the default branch's files would be).
    ``problem``: the classifier's ``config.problem_type`` (:func:`hf_evon.modeling.problem_type`): a multi-label
    one averages sigmoids, a regression its outputs, as does a classifier of one output (``labels_count`` 1)
    without one (``predict(bma=True)`` reads it as a value).
    ``model_subfolder``: the folder of ``location`` the model (or adapter) and its tokenizer are saved in,
    as a Trainer checkpoint pushed to ``last-checkpoint/`` is (None: its root)."""
    rev = f", revision={_py(revision)}" if revision else ""
    model_sub = rev + (f", subfolder={_py(model_subfolder)}" if model_subfolder else "")
    sub = rev + (f", subfolder={_py(subfolder)}" if subfolder else "")
    model_class = str(posterior.config.get("model_class", ""))
    # a PEFT tuner's parameters live under its ``base_model.model.`` (a plain PeftModel records its base's class)
    is_peft = "Peft" in model_class or any(".lora_" in n or n.startswith("base_model.model.") for n in posterior.names)
    if model_class and not is_peft and not _is_transformers_model(model_class):  # an unrecorded class: an Auto class
        return _plain_module_snippet(model_class, location, sub, problem=problem, posterior=posterior)
    # a PEFT adapter on a plain nn.Module (a plain PeftModel records its base's class): no Auto class loads it
    if model_class and is_peft and not model_class.startswith("Peft") and not _is_transformers_model(model_class):
        adapter = _peft_model_lines(posterior.names, location, rev, model_subfolder)
        return _plain_module_snippet(model_class, location, sub, adapter, problem, posterior)
    # a PEFT snippet loads the tokenizer where it builds the base model from, whatever the adapter's
    # directory holds
    auto = _auto_class(model_class)
    tokenizer = (tokenizer or is_peft) and auto not in _NON_TEXT_AUTO_CLASSES
    # PEFT's prompt learning (its encoder under ``prompt_encoder.<adapter>``) has no BMA decoding
    # (generate_bma refuses it): its causal LM averages the next token's probabilities instead, its
    # encoder-decoder the first decoded token's
    prompting = auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM") and any(
        n.startswith("prompt_encoder.") for n in posterior.names
    )
    causal = auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", *_NON_TEXT_DECODERS) and not prompting
    hf_evon_names = "EVONPosterior, generate_bma" if causal else "EVONPosterior"
    lines = [] if causal and (tokenizer or auto in _NON_TEXT_DECODERS) else ["import torch"]  # token ids need torch
    auto_names = f"{auto}, AutoTokenizer" if tokenizer else auto
    labels = f", num_labels={labels_count}" if labels_count is not None and auto in _LABELLED_AUTO_CLASSES else ""
    if is_peft and labels and problem in ("multi_label_classification", "regression"):
        # an adapter's directory holds no config.json: a base built without its problem_type is a softmax
        # classifier to predict(bma=True) on unlabelled inputs, which would average a softmax over its outputs
        labels += f", problem_type={_py(problem)}"
    if is_peft:
        model_location = _py(model_id or base_model or "<base model id>")
        lines += [
            "from peft import PeftModel",
            f"from transformers import {auto_names}",
            f"from hf_evon import {hf_evon_names}",
            "",
            f"base = {auto}.from_pretrained({model_location}{labels})",
            *_peft_model_lines(posterior.names, location, rev, model_subfolder),
        ]
    else:
        model_location = _py(model_id) if model_id else _py(location) + model_sub
        lines += [
            f"from transformers import {auto_names}",
            f"from hf_evon import {hf_evon_names}",
            "",
            f"model = {auto}.from_pretrained({model_location})",
        ]
    if tokenizer:
        lines.append(f"tokenizer = AutoTokenizer.from_pretrained({model_location})")
    lines += _posterior_lines(location, sub)
    if causal:
        return "\n".join(lines + _decoding_lines(tokenizer, auto, model_class))
    if auto == "AutoModelForQuestionAnswering":
        lines += _input_lines(auto, tokenizer) + [
            "model.eval()",
            "start = end = 0.0",
            "with torch.no_grad():",
            "    for seed in range(8):  # BMA: average the probabilities of 8 weight samples",
            "        with posterior.sampled(model, seed=seed):",
            "            outputs = model(**inputs)",
            f"        start = start + {_tempered('outputs.start_logits', posterior)}.softmax(-1) / 8",
            f"        end = end + {_tempered('outputs.end_logits', posterior)}.softmax(-1) / 8",
            "print(start.argmax(-1), end.argmax(-1))  # the most probable answer span",
        ]
        return "\n".join(lines)
    logits = "model(**inputs).logits[:, -1]" if prompting else "model(**inputs).logits"
    problem = None if prompting else problem
    by_width = False
    if problem is None and auto in _LABELLED_AUTO_CLASSES:
        # predict(bma=True) averages one output without a problem_type as a value: a reward model's score
        # (TRL's RewardTrainer passes no labels to the forward, where transformers would set one)
        problem = "regression" if labels_count == 1 else None
        by_width = labels_count is None
    averaged = _averaged_probs_lines(logits, problem, unset_by_width=by_width, posterior=posterior)
    inputs = _input_lines(auto, tokenizer, model_class)
    if auto == "AutoModelForSeq2SeqLM":  # the decoder starts from its start token alone
        inputs += [
            'start = torch.full((inputs["input_ids"].shape[0], 1), model.config.decoder_start_token_id)',
            'inputs = {**inputs, "decoder_input_ids": start}  # probabilities of the first token it decodes',
        ]
    return "\n".join(lines + inputs + averaged)
