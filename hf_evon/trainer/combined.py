"""``EVONConfig`` combined with another trainer's arguments class (e.g. TRL's ``GRPOConfig``).

:func:`evon_config_class` gives the class with the fields of both, so the EVON fields compose with
any ``Trainer`` subclass; :func:`converted_config` turns plain arguments into it.
"""

import copy
import copyreg
import inspect
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any, get_type_hints

from transformers import Trainer, TrainingArguments

from hf_evon.trainer.config import LOWER_IS_BETTER, EVONConfig

__all__ = [
    "TrainerCall", "converted_config", "evon_config_class", "rebuilt_config", "refuse_buffered_generations",
    "register_evon_config",
]

_COMBINED: dict[type, type] = {}  # what evon_config_class returns for each base, declared or built
_DECLARED: dict[type, type] = {}  # register_evon_config's: what a subclass of each base is built from


def register_evon_config(base: type[TrainingArguments], combined: type[EVONConfig]) -> None:
    """Make ``combined`` (a declared ``EVONConfig`` + ``base`` dataclass) what
    :func:`evon_config_class` returns for ``base``, and what it combines a subclass of ``base`` with."""
    if not (issubclass(combined, EVONConfig) and issubclass(combined, base)):
        raise TypeError(f"{combined.__name__} must subclass both EVONConfig and {base.__name__}")
    _COMBINED[base] = _DECLARED[base] = combined


def evon_config_class(base: type[TrainingArguments]) -> type[EVONConfig]:
    """``EVONConfig`` combined with ``base`` (e.g. TRL's ``GRPOConfig``): every field of both.

    Every field keeps ``base``'s default (``remove_unused_columns=False`` of ``GRPOConfig``);
    ``learning_rate`` is chosen from the model unless set, or unless ``base`` declares its own
    (TRL's configs: the rate you would give AdamW for that trainer).
    ``TrainingArguments`` (or an ``EVONConfig`` subclass) maps to itself, a base with a declared
    combination (``EVONSeq2SeqConfig``) to that; any other is built once (``EVONSFTConfig``), as
    ``hf_evon.trainer.combined.EVON<Base>``, whose instances pickle by ``base``: a process that has
    not built the class (one loading ``training_args.bin``, a spawned worker) builds it to unpickle.
    A subclass of a base with a declared combination (your own ``Seq2SeqTrainingArguments``) is built
    from that combination and itself, ``(EVONSeq2SeqConfig, Base)``: it has the combination's fields
    and checks (``bma_sample_strategy``); one of no such base, from ``(EVONConfig, Base)``.
    """
    if not (isinstance(base, type) and issubclass(base, TrainingArguments)):
        raise TypeError(f"base must be a TrainingArguments subclass; got {base!r}")
    if issubclass(base, EVONConfig):
        return base
    if base is TrainingArguments:
        return EVONConfig
    if base not in _COMBINED:
        name = f"EVON{base.__name__}"
        while name in globals():
            name += "_"
        namespace = {"__module__": __name__, "__qualname__": name, "__reduce__": _reduce_by_base}
        declared = next((_DECLARED[c] for c in base.__mro__ if c in _DECLARED), EVONConfig)
        namespace.update(_fields_base_declares(base, declared))
        combined = type(name, (declared, base), namespace)
        combined.__doc__ = f"``{base.__name__}`` plus the EVON fields of :class:`~hf_evon.EVONConfig`."
        globals()[name] = _COMBINED[base] = dataclass(combined)
    return _COMBINED[base]


def _fields_base_declares(base: type[TrainingArguments], declared: type[EVONConfig]) -> dict[str, Any]:
    """Class-body entries re-declaring the fields ``base`` declares anew (its own defaults): the
    dataclass of ``(declared, base)`` (``declared``: ``EVONConfig`` or a declared combination
    ``base`` derives from) would otherwise take each from ``declared``, first in its MRO, whose
    inherited fields carry the defaults of the class both derive from (``TrainingArguments``,
    ``Seq2SeqTrainingArguments``). A field an ``EVONConfig`` class declares itself (``learning_rate``,
    ``bma_sample_strategy``) keeps that class's type and help, and takes ``base``'s default where
    ``base`` declares one: a trainer's own rate (TRL's SFT 2e-5, GRPO 1e-6) is the rate you would
    give AdamW there, from which EVON derives its own."""
    own = {f.name: f for f in fields(declared)}
    shared = next(c for c in base.__mro__ if issubclass(declared, c))  # TrainingArguments at the least
    inherited = {f.name: f for f in fields(shared)}
    evon_classes = [c for c in declared.__mro__ if issubclass(c, EVONConfig)]
    evon_declared = {name for c in evon_classes for name in vars(c).get("__annotations__", {})}
    evon_types = get_type_hints(declared)
    types = get_type_hints(base)  # resolved: a string annotation would be read in this module
    namespace: dict[str, Any] = {"__annotations__": {}}
    for f in fields(base):
        if f.name not in own or f is own[f.name] or f is inherited.get(f.name):
            continue
        if f.name in evon_declared:
            entry = copy.copy(own[f.name])
            entry.default, entry.default_factory = f.default, f.default_factory
            namespace["__annotations__"][f.name] = evon_types[f.name]
        else:
            entry = copy.copy(f)  # a dataclass takes over the Field objects in its body
            namespace["__annotations__"][f.name] = types[f.name]
        namespace[f.name] = entry
    return namespace


def _reduce_by_base(config: EVONConfig) -> tuple[Any, ...]:
    """A built combination's instance pickled by its base and its state (see :func:`evon_config_class`);
    that of a subclass declared elsewhere, by the subclass's name, as ``pickle`` does by default."""
    if type(config).__module__ != __name__:
        return copyreg.__newobj__, (type(config),), dict(vars(config))
    return _unpickled, (type(config).__bases__[1], dict(vars(config)))


def _unpickled(base: type[TrainingArguments], state: dict[str, Any]) -> EVONConfig:
    combined = evon_config_class(base)
    config = combined.__new__(combined)
    vars(config).update(state)
    return config


def converted_config(args: TrainingArguments, target: type[EVONConfig]) -> EVONConfig:
    """Plain ``args`` as ``target`` (:func:`evon_config_class`), the EVON fields at their defaults.

    Every field of ``args`` keeps its value as ``args``' own ``__post_init__`` left it, not built
    again from those values: a post-init may derive fields and refuse them given together (TRL's
    ``GRPOConfig``: ``generation_batch_size`` from ``steps_per_generation``). ``EVONConfig``'s own
    checks and choices then apply, as when it is built.

    A lower-is-better metric (``*_nll``, ``*_ece``, ...) whose ``greater_is_better`` is the one
    ``TrainingArguments`` set by itself (True for any name not ending in "loss") is given
    ``EVONConfig``'s choice (False): kept, it would load the worst checkpoint as the best. A user
    who set True by hand cannot be told apart from the default, and gets ``EVONConfig``'s choice.
    """
    config = target.__new__(target)
    # its own lists and dicts (report_to, fsdp_config, ...), as a config built from the values has
    vars(config).update({k: copy.deepcopy(v) if isinstance(v, list | dict) else v for k, v in vars(args).items()})
    for f in fields(target):
        if f.name not in vars(args):  # an EVON field
            setattr(config, f.name, f.default if f.default_factory is MISSING else f.default_factory())
    metric = args.metric_for_best_model or ""
    if metric.endswith(LOWER_IS_BETTER) and args.greater_is_better == (not metric.endswith("loss")):
        config.greater_is_better = False
    config._refuse_fp16()
    config._finish_evon_fields()
    return config


def rebuilt_config(args: TrainingArguments, target: type[EVONConfig]) -> EVONConfig:
    """``args``, of a class ``target`` derives from (``TrainingArguments``, ``EVONConfig``), built again as
    ``target`` from its values, the fields of ``target``'s other base at their defaults: as TRL's trainers
    rebuild plain ``TrainingArguments`` into their own config (``SFTConfig(**args.to_dict())``), whose
    post-init then resolves those fields (``SFTConfig``'s ``pad_to_multiple_of="auto"``)."""
    values = args.to_dict()
    for f in fields(args):
        if f.init and f.name.endswith("_token"):
            values[f.name] = getattr(args, f.name)  # to_dict() hides the tokens' values
    metric = args.metric_for_best_model or ""
    if not isinstance(args, EVONConfig) and metric.endswith(LOWER_IS_BETTER):
        if args.greater_is_better == (not metric.endswith("loss")):  # TrainingArguments' own choice
            values["greater_is_better"] = None  # EVONConfig's choice, as converted_config makes it
    return target(**values)


class TrainerCall:
    """A call's arguments to a ``Trainer`` subclass's ``__init__``, read and replaced by name wherever
    they stand: TRL's ``DPOTrainer(model, ref_model, args)`` and ``GRPOTrainer(model, reward_funcs,
    args)`` take ``args`` third. An ``__init__`` that names no ``args`` (``*args, **kwargs``) passes
    its arguments on to ``Trainer``, whose order then holds."""

    def __init__(self, init: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        params = inspect.signature(init).parameters.values()
        self.names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not any(p.name == "args" and p.kind is not p.VAR_POSITIONAL for p in params):
            self.names = list(inspect.signature(Trainer).parameters)
        self.args, self.kwargs = list(args), dict(kwargs)

    def _position(self, name: str) -> int | None:
        index = self.names.index(name) if name in self.names else len(self.args)
        return index if index < len(self.args) else None

    def default_output_dir(self, trainer_class: type[Trainer]) -> str:
        """The ``output_dir`` ``trainer_class`` given ``args=None`` writes to, as its base picks it: a
        TRL trainer ``<X>Trainer`` (the first of ``trainer_class``'s bases from TRL: ``DPOTrainer``,
        ``GRPOTrainer``, ...) ``"<model name>-<X>"``, the last part of the call's model's id or path
        (its config's ``name_or_path``, or the model given as a string); any other ``Trainer``
        ``"tmp_trainer"``."""
        model = self.get("model")
        trl_bases = (c for c in trainer_class.__mro__ if c.__module__.split(".")[0] == "trl")
        trl_base = next((c for c in trl_bases if c.__name__.endswith("Trainer")), None)
        if trl_base is None or model is None:  # TRL's trainers need a model to name the directory
            return "tmp_trainer"
        config = getattr(model, "config", None)
        name = model if isinstance(model, str) else getattr(config, "name_or_path", "")
        return f"{str(name).split('/')[-1]}-{trl_base.__name__.removesuffix('Trainer')}"

    def get(self, name: str) -> Any:
        index = self._position(name)
        return self.kwargs.get(name) if index is None else self.args[index]

    def set(self, name: str, value: Any) -> None:
        index = self._position(name)
        if index is None:
            self.kwargs[name] = value
        else:
            self.args[index] = value


def buffers_generations(trainer: Any) -> bool:
    """Whether ``trainer`` is one of TRL's that generate their own batches and buffer them (GRPO, RLOO,
    distillation), told by TRL's private ``_buffered_inputs``: the one place hf-evon reads it."""
    return hasattr(trainer, "_buffered_inputs")


def refuse_buffered_generations(trainer: Trainer) -> None:
    """Refuse what makes a trainer that buffers its generations (TRL's GRPO, RLOO, distillation:
    ``_buffered_inputs``) train a posterior sample on completions another sample generated, unweighted.

    Such a trainer generates inside the ``training_step`` that first needs a generation, so at that
    micro-batch's posterior sample (the mixin runs ``training_step`` inside ``sampled_params``), and
    hands out the next buffered slice at each call. With ``evon_mc_samples > 1`` each sample of a
    micro-batch would take other completions. GRPO trains its buffer for ``steps_per_generation *
    num_iterations`` calls, each at a sample of its own, and without an importance correction
    (``old_per_token_logps``) where that product divides ``gradient_accumulation_steps``: it takes the
    buffer as on-policy, which it is for the generating sample only."""
    args, name = trainer.args, type(trainer).__name__
    if not buffers_generations(trainer):
        return
    if args.evon_mc_samples > 1:
        raise ValueError(
            f"EVONConfig.evon_mc_samples = {args.evon_mc_samples} is not supported by {name}: "
            "it takes the next buffered generation at each training_step call, and EVON calls it once per "
            "posterior sample, so each sample would train on other completions; use evon_mc_samples=1"
        )
    if not any(c.__name__ == "GRPOTrainer" and c.__module__.startswith("trl.") for c in type(trainer).__mro__):
        return  # RLOO weighs every buffered completion by the generating weights' log-probabilities
    every = args.steps_per_generation * args.num_iterations
    corrected = args.use_vllm and args.vllm_importance_sampling_correction  # old_per_token_logps computed
    if every > 1 and args.gradient_accumulation_steps % every == 0 and not corrected:
        raise ValueError(
            f"steps_per_generation * num_iterations = {args.steps_per_generation} * {args.num_iterations} = {every} "
            f"is not supported by {name} with EVON: a generation is made at the posterior sample of the micro-batch "
            f"that needs it, and its completions are trained for {every} micro-batches, each at a sample of its own, "
            "as on-policy (no importance correction where this divides gradient_accumulation_steps = "
            f"{args.gradient_accumulation_steps}); use steps_per_generation=1 and num_iterations=1 (each micro-batch "
            "generates at the sample it trains at)"
        )


def refuse_generated_calibration(trainer: Trainer, dataset: Any, name: str) -> None:
    """Refuse calibration data (``name``: the argument it came by) for a trainer that buffers
    generations (TRL's GRPO, RLOO, distillation): its ``_prepare_inputs`` turns every batch, whatever
    its columns, into generated completions and rewards, and the calibration scores labels the
    model's forward is given, which those batches never hold. hf_evon's own function calibrates on
    labelled batches."""
    if dataset is None or not buffers_generations(trainer):
        return
    raise ValueError(
        f"{name}: {type(trainer).__name__} prepares each batch into completions it generates and "
        "their rewards, which hold no labels for the calibration to score (it would generate from "
        f"the data, then fail); pass no calibration data to this trainer and {_CALIBRATE_POSTERIOR}"
    )


# what calibrates a trainer that generates its batches (refuse_generated_calibration, no_calibration_data)
_CALIBRATE_POSTERIOR = (
    "calibrate with hf_evon.calibrate_posterior(trainer.model, trainer.current_posterior(), batches) after "
    "training, batches being held-out dicts of 'input_ids', 'attention_mask' and 'labels' (a prompt and its "
    "reference completion tokenized, the prompt's labels -100), then save the posterior it returns (save_pretrained)"
)


def no_calibration_data(trainer: Trainer) -> str:
    """The error of ``calibrate()`` given no dataset where the trainer has no ``calibration_dataset``: the
    ways to give it one, or, for a trainer that generates its batches (which refuses both:
    :func:`refuse_generated_calibration`), hf_evon's own function on labelled batches."""
    if not buffers_generations(trainer):
        return "calibrate() needs held-out data: pass dataset= or EVONTrainer(calibration_dataset=...)"
    return (
        f"calibrate() needs held-out labelled data, which {type(trainer).__name__} takes by neither dataset= "
        "nor calibration_dataset= (it generates completions from every batch, which hold no labels to score): "
        + _CALIBRATE_POSTERIOR
    )
