"""EVONTrainer / EVONConfig on tiny models (BERT classifier, GPT-2 LM, LoRA-wrapped BERT), CPU."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from conftest import directory_state, load_where_never_built, refuse_lookups
from launcher import scenario_results
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from hf_evon import EVON, EVONConfig, EVONTrainer, build_optimizer
from hf_evon.posterior.config import PosteriorMismatchError
from hf_evon.posterior.fingerprint import PosteriorMeanWarning
from hf_evon.posterior.posterior import POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME, EVONPosterior
from hf_evon.predictive.metrics import calibration_metrics
from hf_evon.trainer import EVONSeq2SeqConfig, evon_config_class

try:  # tests/test_cuda.py borrows the fixtures below on machines without datasets
    from datasets import Dataset
except ImportError:
    Dataset = None

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- fixtures
def tiny_bert(seed: int = 0, dropout: float = 0.0, num_labels: int = 3) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=32,
        num_labels=num_labels,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return BertForSequenceClassification(config)


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, bos_token_id=1, eos_token_id=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def classification_rows(n: int = 48, seed: int = 0) -> list[dict[str, list[int] | int]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (n, 8), generator=g)
    labels = ids[:, 1] % 3  # learnable from the second token
    return [{"input_ids": i, "labels": y} for i, y in zip(ids.tolist(), labels.tolist(), strict=True)]


def classification_data(n: int = 48, seed: int = 0) -> Dataset:
    return Dataset.from_list(classification_rows(n, seed))


def lm_data(n: int = 24, seed: int = 0, length: int = 12) -> Dataset:
    """Sequences of different lengths, right-padded; padding labels are -100."""
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(n):
        used = 4 + int(torch.randint(0, length - 3, (1,), generator=g))
        start = int(torch.randint(3, 90, (1,), generator=g))
        ids = [(start + 3 * j) % 97 + 3 for j in range(used)] + [0] * (length - used)
        rows["input_ids"].append(ids)
        rows["attention_mask"].append([1] * used + [0] * (length - used))
        rows["labels"].append(ids[:used] + [-100] * (length - used))
    return Dataset.from_dict(rows)


def config(tmp_path: Path, **overrides) -> EVONConfig:
    values = dict(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=16,
        max_steps=4,
        evon_learning_rate=2e-2,
        evon_adamw_learning_rate=1e-3,
        evon_ess=1e4,
        evon_hess_init=1.0,
        evon_precondition_frequency=2,
        lr_scheduler_type="constant",
        save_strategy="no",
        logging_steps=2,
        disable_tqdm=True,
        bma_num_samples=3,
        seed=0,
    )
    values.update(overrides)
    return EVONConfig(**values)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------- config
EVON_FIELDS_CLI = {
    "evon_ess": ("123.5", 123.5),
    "evon_init_std_ratio": ("0.1", 0.1),
    "posterior_max_basis_ratio": ("0", None),
    "evon_recipe": ("nanogpt", "nanogpt"),
    "evon_hess_init": ("0.25", 0.25),
    "evon_beta1": ("0.8", 0.8),
    "evon_beta2": ("0.99", 0.99),
    "evon_shampoo_beta": ("0.97", 0.97),
    "evon_weight_decay": ("0.003", 0.003),
    "evon_mc_samples": ("3", 3),
    "evon_precondition_frequency": ("7", 7),
    "evon_max_precond_dim": ("512", 512),
    "evon_max_precond_ratio": ("inf", float("inf")),
    "evon_hess_clip_ratio": ("1.5", 1.5),
    "evon_hess_estimator": ("price", "price"),
    "evon_curvature_refit": ("7", 7),
    "evon_step_curvature": ("entry", "entry"),
    "evon_mean_weight_decay": ("0.002", 0.002),
    "evon_clip": ("spectral", "spectral"),
    "evon_clip_radius": ("0.5", 0.5),
    "evon_snr_scaling": ("false", False),
    "evon_phased_gradients": ("true", True),
    "evon_identity_basis": ("true", True),
    "evon_stagger_refresh": ("false", False),
    "evon_shard": ("true", True),
    "evon_seed": ("17", 17),
    "evon_nonfinite": ("raise", "raise"),
    "evon_adamw_learning_rate": ("0.0004", 0.0004),
    "evon_patterns": (["classifier", "pooler"], ["classifier", "pooler"]),
    "adamw_patterns": (["^bert\\.embeddings"], ["^bert\\.embeddings"]),
    "bma_num_samples": ("11", 11),
    "bma_seed": ("5", 5),
    "bma_ece_bins": ("20", 20),
    "bma_eval_every": ("3", 3),
    "learning_rate": ("0.07", 0.07),
    "evon_learning_rate": ("0.03", 0.03),
}


def test_hfargumentparser_parses_every_evon_field(tmp_path):
    own = {f.name for f in dataclasses.fields(EVONConfig)} - {
        f.name for f in dataclasses.fields(TrainingArguments)
    }
    assert own <= set(EVON_FIELDS_CLI), (
        f"new EVONConfig fields need a command-line check: {own - set(EVON_FIELDS_CLI)}"
    )
    argv = ["--output_dir", str(tmp_path), "--report_to", "none"]
    for name, (text, _) in EVON_FIELDS_CLI.items():
        argv += [f"--{name}", *(text if isinstance(text, list) else [text])]
    (args,) = HfArgumentParser(EVONConfig).parse_args_into_dataclasses(args=argv)
    for name, (_, expected) in EVON_FIELDS_CLI.items():
        assert getattr(args, name) == expected, name
    defaults = EVONConfig(output_dir=str(tmp_path), report_to="none")
    assert all(getattr(defaults, n) != v for n, (_, v) in EVON_FIELDS_CLI.items()), (
        "values must differ from defaults"
    )
    # 'inf' and 0 (= off) from the command line
    (inf_args,) = HfArgumentParser(EVONConfig).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), "--evon_ess", "inf", "--evon_hess_clip_ratio", "0"]
    )
    assert math.isinf(inf_args.evon_ess) and inf_args.evon_hess_clip_ratio is None


def test_the_command_line_help_shows_every_evon_field() -> None:
    """argparse %-formats each help text: a bare "%" in one ("30% quantile") made --help raise
    ValueError (unsupported format character), in any script parsing an EVON config."""
    for config_class in (EVONConfig, EVONSeq2SeqConfig):
        text = " ".join(HfArgumentParser(config_class).format_help().split())
        own = {f.name for f in dataclasses.fields(EVONConfig)}
        own -= {f.name for f in dataclasses.fields(TrainingArguments)}
        assert all(f"--{name} " in text for name in own), config_class
        assert "H's 30% quantile" in text and "is 25% of the weights' RMS" in text


def test_the_command_line_takes_none_where_the_help_offers_it(tmp_path) -> None:
    """--evon_clip and --evon_snr_scaling list None among their choices (the default: chosen from
    the model); "None" on the command line was refused as an invalid choice."""
    parser = HfArgumentParser(EVONConfig)
    choices = {a.dest: a.choices for a in parser._actions if a.dest in ("evon_clip", "evon_snr_scaling")}
    assert all("None" in c for c in choices.values()), choices
    argv = ["--output_dir", str(tmp_path), "--evon_clip", "None", "--evon_snr_scaling", "None"]
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    assert args.evon_clip is None and args.evon_snr_scaling is None
    kwargs = args.evon_optimizer_kwargs()
    assert kwargs["clip"] is None and kwargs["snr_scaling"] is None


OWN_ARGUMENTS = """
import dataclasses
from transformers import TrainingArguments

@dataclasses.dataclass
class OwnArguments(TrainingArguments):
    remove_unused_columns: bool = False  # as TRL's GRPOConfig: the trainer needs its raw columns
    logging_steps: float = 10
    learning_rate: float = 1e-6
    extra: int = 3
"""


def test_a_combined_arguments_class_keeps_its_bases_defaults_and_unpickles_elsewhere(tmp_path, monkeypatch):
    """evon_config_class(base) took TrainingArguments' defaults where base has its own (EVONConfig,
    first in the MRO, re-applies every inherited field): TRL's GRPOConfig lost remove_unused_columns
    False. And its instances, pickled by the built class's name, did not unpickle in a process that
    had not built it (training_args.bin, spawned workers)."""
    (tmp_path / "own_arguments.py").write_text(OWN_ARGUMENTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    from own_arguments import OwnArguments

    combined = evon_config_class(OwnArguments)
    defaults = {f.name: f.default for f in dataclasses.fields(combined)}
    assert (defaults["remove_unused_columns"], defaults["logging_steps"], defaults["extra"]) == (False, 10, 3)
    assert defaults["learning_rate"] == 1e-6  # base's own rate: the one you would give AdamW with it
    args = combined(output_dir=str(tmp_path / "out"), report_to="none", evon_ess=500.0, extra=5)
    assert args.remove_unused_columns is False and args.logging_steps == 10
    torch.save(args, tmp_path / "training_args.bin")
    loaded = load_where_never_built(monkeypatch, tmp_path / "training_args.bin", "own_arguments")
    assert (type(loaded).__name__, type(loaded).__mro__[2].__name__) == ("EVONOwnArguments", "OwnArguments")
    assert type(loaded) is not combined and type(loaded).__mro__[2] is not OwnArguments  # both built anew
    assert (loaded.evon_ess, loaded.extra, loaded.remove_unused_columns) == (500.0, 5, False)


@pytest.mark.parametrize(
    "field,value",
    [
        ("evon_ess", 0.0),
        ("evon_hess_init", 0.0),
        ("evon_beta1", 1.0),
        ("evon_beta2", -0.1),
        ("evon_shampoo_beta", 1.5),
        ("evon_weight_decay", -1.0),
        ("evon_mc_samples", 0),
        ("evon_precondition_frequency", 0),
        ("evon_max_precond_dim", 0),
        ("evon_max_precond_ratio", 0.5),
        ("evon_hess_clip_ratio", -2.0),
        ("evon_clip", "bogus"),
        ("evon_identity_basis", "false"),  # a truthy string: IVON mode, had it not been refused
        ("evon_phased_gradients", 1),
        ("evon_stagger_refresh", "true"),
        ("evon_clip_radius", 0.0),
        ("evon_nonfinite", "ignore"),
        ("evon_adamw_learning_rate", -1e-3),
        ("evon_patterns", ["(unclosed"]),
        ("bma_num_samples", -1),
        ("bma_ece_bins", 0),
        ("fp16", True),  # loss scaling would corrupt the Hessian estimate
        ("evon_shard", "false"),  # a truthy string: DDP sharding on, had it not been refused
        ("evon_shard", 1),
        ("bma_seed", 1.5),  # refused only by the first BMA evaluation, after training
        ("bma_seed", "3"),
        ("posterior_max_basis_ratio", True),  # a bool is no ratio (True would be 1: drop every non-square basis)
        # None where None means nothing (only fields whose default is None choose from the model): taken,
        # then refused by EVON at train(), the message naming no field
        ("evon_hess_estimator", None),
        ("evon_step_curvature", None),
        ("evon_nonfinite", None),
        ("evon_phased_gradients", None),
        ("evon_identity_basis", None),
        ("evon_stagger_refresh", None),
    ],
)
def test_config_rejects_invalid_values(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        EVONConfig(output_dir=str(tmp_path), report_to="none", **{field: value})


@pytest.mark.parametrize("ess", ["auto", 1e4])
def test_config_refuses_a_zero_prior_precision_with_a_finite_ess(tmp_path, ess):
    """evon_weight_decay=0 was checked alone: the config took it with a finite or 'auto' evon_ess,
    and EVON refused it only at train(), its message naming no config field."""
    with pytest.raises(ValueError, match=r"EVONConfig\.evon_weight_decay = 0\.0 is invalid: .*0 only with ess=inf"):
        EVONConfig(output_dir=str(tmp_path), report_to="none", evon_ess=ess, evon_weight_decay=0.0)
    args = EVONConfig(output_dir=str(tmp_path), report_to="none", evon_ess="inf", evon_weight_decay=0.0)
    assert (args.evon_ess, args.evon_weight_decay) == (float("inf"), 0.0)


@pytest.mark.parametrize("unfitted", [{"evon_ess": "1e4"}, {"evon_hess_estimator": "price"}, {"evon_curvature_refit": 0}])
def test_config_bounds_init_std_ratio_where_ess_is_fitted_and_only_there(tmp_path, unfitted):
    """With evon_weight_decay given, EVON refuses init_std_ratio >= DEFAULT_PRIOR_STD_RATIO only where
    ζ is fitted to the curvature. The config checked the ratio with EVON's defaults for the fields that
    decide it ('auto', Fisher, a refit period): it refused a run where ζ is not fitted."""
    kwargs = dict(output_dir=str(tmp_path), report_to="none", evon_weight_decay=1e-3, evon_init_std_ratio=0.3)
    assert EVONConfig(**kwargs, **unfitted).evon_init_std_ratio == 0.3
    with pytest.raises(ValueError, match=r"EVONConfig\.evon_init_std_ratio = 0\.3 is invalid: .*where ess is fitted"):
        EVONConfig(**kwargs)


def test_evon_fields_take_numpy_numbers_and_hold_pythons(tmp_path):
    """The BMA counts refused NumPy integers ("must be an integer >= 0" for np.int64(4)) that
    evon_mc_samples takes; NumPy numbers kept in the config made to_json_string() (the Trainer's
    log and integrations) raise."""
    import numpy as np

    counts = {"evon_mc_samples": 2, "bma_num_samples": 4, "bma_ece_bins": 10, "bma_eval_every": 2}
    numpy_counts = {name: np.int64(n) for name, n in counts.items()}
    args = EVONConfig(
        output_dir=str(tmp_path), report_to="none", evon_ess=np.float32(1024.0), evon_beta1=np.float32(0.5),
        **numpy_counts,
    )  # fmt: skip
    values = {name: getattr(args, name) for name in counts}
    assert values == counts
    assert all(type(v) is int for v in values.values()) and type(args.evon_ess) is float
    saved = json.loads(args.to_json_string())
    assert (saved["bma_num_samples"], saved["evon_ess"], saved["evon_beta1"]) == (4, 1024.0, 0.5)
    with pytest.raises(ValueError, match="bma_num_samples"):
        EVONConfig(output_dir=str(tmp_path), report_to="none", bma_num_samples=np.float64(4.0))


def test_a_field_set_as_text_after_the_config_is_made_is_parsed_for_the_optimizer(tmp_path):
    """A hyperparameter search sets each trial's value cast to the field's current type (transformers'
    _hp_search_setup): evon_ess 1000.0 became "1000.0", which EVON refused at train()."""
    trainer = EVONTrainer(model=tiny_bert(), args=config(tmp_path, max_steps=1), train_dataset=classification_data())
    trainer.args.evon_ess, trainer.args.evon_snr_scaling = "1000.0", "false"  # as the search sets them
    trainer.train()
    evon = [g for g in trainer.evon_optimizer.param_groups if g["algorithm"] == "evon"]
    assert {g["ess"] for g in evon} == {1000.0} and {g["snr_scaling"] for g in evon} == {False}


def test_optimizer_from_config_and_ess_default(tmp_path):
    data = classification_data(40)
    args = config(tmp_path, evon_ess=None, weight_decay=0.05, adam_beta1=0.8, evon_weight_decay=1e-3)
    trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=data)
    opt = trainer.create_optimizer()
    assert isinstance(opt, EVON) and trainer.evon_optimizer is opt
    evon = [g for g in opt.param_groups if g["algorithm"] == "evon"]
    adamw = [g for g in opt.param_groups if g["algorithm"] == "adamw"]
    assert len(evon) == 1 and evon[0]["ess"] == "auto"  # None (the former default) -> "auto"
    assert opt.buckets  # the first sample or step resolves it: initial std = 5% of the weights' RMS
    weights = [p for p in evon[0]["params"]]
    rms_sq = sum(float(p.detach().double().square().sum()) for p in weights) / sum(p.numel() for p in weights)
    ratio, prior = args.evon_init_std_ratio, args.evon_weight_decay
    assert evon[0]["ess"] == pytest.approx(
        1.0 / (ratio**2 * rms_sq * (evon[0]["hess_init"] + prior)), rel=1e-6
    )
    assert evon[0]["lr"] == 2e-2 and evon[0]["weight_decay"] == 1e-3 and evon[0]["betas"] == (0.95, 0.995)
    assert all(g["lr"] == 1e-3 and g["betas"] == (0.8, 0.999) for g in adamw)
    assert {g["weight_decay"] for g in adamw} == {0.05, 0.0}
    evon_names = set(evon[0]["param_names"])
    assert "bert.encoder.layer.0.attention.self.query.weight" in evon_names
    adamw_names = {n for g in adamw for n in g["param_names"]}
    assert "bert.embeddings.word_embeddings.weight" in adamw_names and "classifier.bias" in adamw_names
    # name patterns override the split
    args2 = config(tmp_path, adamw_patterns=["attention"], evon_patterns=["word_embeddings"])
    opt2 = EVONTrainer(model=tiny_bert(), args=args2, train_dataset=data).create_optimizer()
    names2 = set(next(g for g in opt2.param_groups if g["algorithm"] == "evon")["param_names"])
    assert "bert.embeddings.word_embeddings.weight" in names2
    assert not any("attention" in n for n in names2)


# ---------------------------------------------------------------------------- training
def test_training_moves_the_posterior_and_logs_statistics(tmp_path):
    model = tiny_bert()
    before = params(model)
    trainer = EVONTrainer(
        model=model, args=config(tmp_path, max_steps=6), train_dataset=classification_data()
    )
    trainer.train()
    opt = trainer.evon_optimizer
    evon_names = next(g for g in opt.param_groups if g["algorithm"] == "evon")["param_names"]
    named = dict(model.named_parameters())
    for name in evon_names:
        hess = opt.posterior_factors(named[name])["hess"]
        assert not torch.allclose(hess, torch.ones_like(hess)), f"H of {name} did not move"
        assert not torch.equal(named[name].detach(), before[name]), f"mean of {name} did not move"
    assert not torch.equal(
        named["bert.embeddings.word_embeddings.weight"].detach(),
        before["bert.embeddings.word_embeddings.weight"],
    )
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    for entry in logs:
        assert 0 < entry["evon/hess_min"] <= entry["evon/hess_mean"] <= entry["evon/hess_max"]
        assert entry["evon/posterior_std_mean"] > 0 and math.isfinite(entry["loss"])
    # the logged std is the mean marginal std of the posterior
    post = trainer.current_posterior()
    std = torch.cat([post.std(n).flatten() for n in post.names]).double().mean()
    assert trainer.posterior_statistics()["evon/posterior_std_mean"] == pytest.approx(float(std), rel=1e-5)


def test_logged_hessian_range_is_posterior_healths_beside_a_deterministic_group() -> None:
    """With an ess=inf group beside a sampled one, evon/hess_min|max|mean ranged over the
    deterministic group's H too (its squared gradients), overwriting posterior_health()'s values
    of the same names, which describe the posterior's entries alone, as evon/hess_below_prior and
    evon/hess_init_share in the same log do."""
    from hf_evon.trainer.statistics import posterior_statistics

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    sampled, deterministic = model[0].weight, model[2].weight
    groups = [{"params": [sampled], "ess": 300.0}, {"params": [deterministic], "ess": math.inf}]
    opt = EVON(groups, weight_decay=1e-2)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    for _ in range(3):
        with opt.sampled_params(train=True):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    hess = opt.state[sampled]["hess"].double()
    every = torch.cat([hess.flatten(), opt.state[deterministic]["hess"].double().flatten()])
    assert abs(float(every.mean()) - float(hess.mean())) > 1e-3 * float(hess.mean())  # the two differ
    logged, health = posterior_statistics(opt), opt.posterior_health(warn=False)
    assert {k: logged[f"evon/{k}"] for k in health} == health
    assert (logged["evon/hess_min"], logged["evon/hess_max"]) == (float(hess.min()), float(hess.max()))
    assert logged["evon/hess_mean"] == pytest.approx(float(hess.mean()), rel=1e-12)
    # the mean std still covers every EVON weight: the deterministic ones have none
    std_sum = float(opt.posterior_std(sampled).double().sum())
    expected = std_sum / (sampled.numel() + deterministic.numel())
    assert logged["evon/posterior_std_mean"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("ess", [1e4, math.inf])
def test_logged_statistics_leave_out_frozen_matrices_that_never_had_a_gradient(ess) -> None:
    """Frozen matrices (``requires_grad=False``) a user gave EVON, one sharing the trained matrix's bucket
    and one in a bucket of its own, are never sampled and their H stays h0: evon/posterior_std_mean
    averaged their h0 std in (and, with no sampled group, evon/hess_min|max|mean ranged over their h0),
    where posterior_health() leaves them out. The statistics are the trained matrix's alone."""
    from hf_evon.trainer.statistics import posterior_statistics

    torch.manual_seed(0)
    trained, twin = torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(8, 6, bias=False)
    other = torch.nn.Linear(8, 5, bias=False)
    twin.weight.requires_grad_(False)
    other.weight.requires_grad_(False)
    opt = EVON([trained.weight, twin.weight, other.weight], ess=ess, weight_decay=3e-2)
    x = torch.randn(16, 8)
    for _ in range(4):
        with opt.sampled_params(train=True):
            (trained(x).square().sum() + (twin(x) + other(x).sum()).sum()).backward()
        opt.step()
        opt.zero_grad()
    hess = opt.state[trained.weight]["hess"].double()
    frozen_hess = opt.state[twin.weight]["hess"]
    assert not bool(frozen_hess.eq(hess.min()).all()) and float(frozen_hess.max()) < float(hess.max())
    logged = posterior_statistics(opt)
    std = opt.posterior_std(trained.weight).double() if math.isfinite(ess) else torch.zeros(1, dtype=torch.float64)
    assert logged["evon/posterior_std_mean"] == pytest.approx(float(std.mean()), rel=1e-6)  # float32 std
    assert (logged["evon/hess_min"], logged["evon/hess_max"]) == (float(hess.min()), float(hess.max()))
    assert logged["evon/hess_mean"] == pytest.approx(float(hess.mean()), rel=1e-12)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_gradient_accumulation_equals_larger_batch_deterministic(tmp_path, kind):
    """ess=inf: no noise, so K micro-batches must give exactly the update of one K× batch.

    GPT-2 micro-batches hold different numbers of label tokens: only the token-weighted
    scaling gets this right. Both EVON and AdamW parameters are compared.
    """
    make, data = (tiny_bert, classification_data(48)) if kind == "bert" else (tiny_gpt2, lm_data(24))
    # clip="none": whitening (Newton–Schulz) amplifies float round-off in the near-null directions
    # of rank-deficient updates (e.g. the 3×32 classifier, whose gradient has rank <= 2) by ~3.4^5
    common = dict(
        evon_ess=float("inf"), max_steps=3, evon_precondition_frequency=1, evon_mc_samples=2, evon_clip="none"
    )
    big = EVONTrainer(
        model=make(), args=config(tmp_path / "a", per_device_train_batch_size=8, **common), train_dataset=data
    )
    big.train()
    acc = EVONTrainer(
        model=make(),
        args=config(tmp_path / "b", per_device_train_batch_size=2, gradient_accumulation_steps=4, **common),
        train_dataset=data,
    )
    acc.train()
    pa, pb = params(big.model), params(acc.model)
    moved = 0
    for name in pa:
        a, b = pa[name], pb[name]
        if name.endswith("attn.c_attn.bias"):
            # GPT-2's key bias: attention is invariant to a shift of every key, so its gradient is
            # zero in exact arithmetic and what moves it is rounding, which Adam's normalisation
            # scales up: kept small either way, compared no further
            width = big.model.config.n_embd
            assert float(a[width : 2 * width].abs().max()) < 1e-4 and float(b[width : 2 * width].abs().max()) < 1e-4
            keep = torch.ones_like(a, dtype=torch.bool)
            keep[width : 2 * width] = False
            a, b = a[keep], b[keep]
        torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-6, msg=name)
        moved += not torch.equal(pa[name], params(make())[name])
    assert moved > 10
    la = [h["loss"] for h in big.state.log_history if "loss" in h]
    lb = [h["loss"] for h in acc.state.log_history if "loss" in h]
    assert la == pytest.approx(lb, rel=1e-5)  # the logged loss is the batch mean either way


def test_an_epoch_shorter_than_gradient_accumulation_steps_steps_as_one_without_accumulation(tmp_path):
    """One batch per epoch with gradient_accumulation_steps=4: the Trainer steps at each epoch's end
    on that one batch (as plain Trainer with AdamW does), every sample block closed and used, so
    the run is exactly the one with gradient_accumulation_steps=1, noise included."""
    common = dict(max_steps=-1, num_train_epochs=3, evon_mc_samples=2, per_device_train_batch_size=8)
    runs = {}
    for ga in (4, 1):
        trainer = EVONTrainer(
            model=tiny_bert(), args=config(tmp_path / str(ga), gradient_accumulation_steps=ga, **common),
            train_dataset=classification_data(8),
        )  # fmt: skip
        trainer.train()
        assert trainer.evon_optimizer.recorded_samples == 0 and trainer.evon_optimizer.skipped_steps == 0
        runs[ga] = (trainer.state.global_step, params(trainer.model))
    plain = Trainer(
        model=tiny_bert(), train_dataset=classification_data(8),
        args=TrainingArguments(
            output_dir=str(tmp_path / "plain"), report_to="none", use_cpu=True, per_device_train_batch_size=8,
            gradient_accumulation_steps=4, num_train_epochs=3, save_strategy="no", disable_tqdm=True,
        ),
    )  # fmt: skip
    plain.train()
    assert runs[4][0] == runs[1][0] == plain.state.global_step == 3
    for name, value in runs[1][1].items():
        assert torch.equal(runs[4][1][name], value), name


def test_a_compute_loss_override_is_scaled_like_the_trainers_own(tmp_path):
    """A subclass that overrides ``compute_loss`` without calling ``super()`` (the usual
    Trainer pattern) trains exactly as the default loss does: EVON's scaling wraps whatever
    ``compute_loss`` the instance has, with gradient accumulation and several samples."""

    class OwnLoss(EVONTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    common = dict(
        evon_ess=float("inf"), max_steps=2, evon_mc_samples=2, per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )  # fmt: skip
    runs = {}
    for name, cls in (("default", EVONTrainer), ("own", OwnLoss)):
        trainer = cls(model=tiny_bert(), args=config(tmp_path / name, **common), train_dataset=classification_data(32))
        trainer.train()
        runs[name] = (params(trainer.model), [h["loss"] for h in trainer.state.log_history if "loss" in h])
        assert "compute_loss" not in vars(trainer)  # the wrapper is gone after the step
    for key, value in runs["default"][0].items():
        assert torch.equal(runs["own"][0][key], value), key
    assert runs["own"][1] == runs["default"][1] and len(runs["own"][1]) == 1


def _run_micro_batches(trainer: EVONTrainer, batches: list[dict]) -> None:
    """What the Trainer's loop does for one optimizer step, up to (not including) the step."""
    samples, n_items = trainer.get_batch_samples(iter(batches), len(batches), trainer.args.device)
    trainer.current_gradient_accumulation_steps = len(samples)
    for inputs in samples:
        trainer.training_step(trainer.model, inputs, n_items)


def _step_inputs(trainer: EVONTrainer, batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the trainer's micro-batches and return (mean gradient, Hessian estimate) EVON would use.

    Reads EVON internals (the recorded sample count and the Price-estimator accumulator),
    exactly as ``update.evon_update`` combines them, then discards the step.
    """
    opt = trainer.evon_optimizer
    _run_micro_batches(trainer, batches)
    bucket = next(b for b in opt.buckets if b.acc is not None and b.m == 3)  # the classifier (3×32)
    k = opt._samples
    grad = bucket.grads() / k
    g = bucket.group
    h_hat = bucket.acc * torch.sqrt(g["ess"] * (bucket.state["hess"] + g["weight_decay"])) / k
    out = grad.clone(), h_hat.clone()
    opt.zero_grad()
    opt.discard_samples()
    return out


def _estimates(tmp_path: Path, ess: float, draws: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(gradient, Hessian estimate) of the classifier for ``draws`` noise seeds, for one batch
    of 8 and for 2 accumulated micro-batches of 4, from the same optimizer state."""
    data = classification_data(8)
    trainer = EVONTrainer(
        model=tiny_bert(),
        # the Price estimate: its per-sample numerator is what the test compares
        args=config(tmp_path, evon_ess=ess, evon_hess_init=1.0, evon_hess_estimator="price"),
        train_dataset=data,
    )
    opt = trainer.create_optimizer()
    rows = [{k: torch.tensor(v) for k, v in data[i : i + 4].items()} for i in (0, 4)]
    whole = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
    _run_micro_batches(trainer, [whole])
    opt.step()  # the initialising step (eigenbases); then estimate at a fixed state
    opt.zero_grad()
    snapshot = {k: v for k, v in opt.state_dict().items() if k != "evon"}
    model_state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    results = {}
    for label, batches in (("big", [whole]), ("accumulated", rows)):
        grads, hess = [], []
        for i in range(draws):
            trainer.model.load_state_dict(model_state)
            opt.load_state_dict(snapshot)
            opt.seed = 10_000 * (label == "big") + i
            g, h = _step_inputs(trainer, batches)
            grads.append(g)
            hess.append(h)
        results[label] = torch.stack(grads).double(), torch.stack(hess).double()
    return results


def test_gradient_accumulation_is_statistically_the_same_evon_update(tmp_path):
    """With noise, each accumulated micro-batch draws its own sample: the gradient and the
    Hessian estimate EVON receives must have the same expectation as for one batch twice as
    large. Each check also shows it would see a factor-2 error in the loss scaling."""
    # gradient, elementwise (little noise: ess large)
    res = _estimates(tmp_path / "g", ess=2000.0, draws=100)
    a, b = res["big"][0], res["accumulated"][0]
    se = torch.sqrt(a.var(0) / len(a) + b.var(0) / len(b))
    assert float(((a.mean(0) - b.mean(0)) / se).square().mean()) < 2.0  # chi²/dof ≈ 1 if equal
    assert float(((a.mean(0) - 2 * b.mean(0)) / se).square().mean()) > 8.0
    # Hessian estimate (Price's estimator is noisy: compare its trace, where a small ess helps)
    res = _estimates(tmp_path / "h", ess=20.0, draws=150)
    ta, tb = res["big"][1].flatten(1).sum(1), res["accumulated"][1].flatten(1).sum(1)
    se = float(torch.sqrt(ta.var() / len(ta) + tb.var() / len(tb)))
    assert float(ta.mean()) > 5 * se  # a clearly positive curvature estimate
    assert abs(float(ta.mean() - tb.mean())) < 4 * se
    assert abs(float(ta.mean() - 2 * tb.mean())) > 6 * se


def test_clipping_and_grad_norm_refer_to_the_mean_gradient(tmp_path):
    """grad_norm is the norm of the mean gradient over A·K recorded samples, and max_grad_norm
    clips that mean: the step equals a manual EVON step with the clipped mean gradient."""
    data = classification_data(8)  # one step sees all 8 examples, whatever the shuffling
    common = dict(
        evon_ess=float("inf"), evon_identity_basis=True, max_steps=1, logging_steps=1,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, evon_mc_samples=3, evon_clip="none",
    )  # fmt: skip
    # the mean gradient at the initial weights, computed directly
    ref_model = tiny_bert()
    start = params(ref_model)
    trainer0 = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path / "x", max_grad_norm=0.0, **common), train_dataset=data
    )
    batch = {k: torch.tensor(v) for k, v in data[:].items()}
    ref_model.train()
    loss = ref_model(**batch).loss
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().square().sum() for p in ref_model.parameters()))
    trainer0.train()
    logged = next(h["grad_norm"] for h in trainer0.state.log_history if "grad_norm" in h)
    assert logged == pytest.approx(float(norm), rel=1e-4)
    # clipping to half the norm == a manual step with the gradient scaled by 1/2
    clipped = EVONTrainer(
        model=tiny_bert(),
        args=config(tmp_path / "y", max_grad_norm=float(norm) / 2, **common),
        train_dataset=data,
    )
    clipped.train()
    logged_clipped = next(h["grad_norm"] for h in clipped.state.log_history if "grad_norm" in h)
    assert logged_clipped == pytest.approx(float(norm), rel=1e-4)  # the norm before clipping
    manual_model = tiny_bert()
    manual = build_optimizer(manual_model, **clipped.args.evon_optimizer_kwargs())
    for p, q in zip(manual_model.parameters(), ref_model.parameters()):
        p.grad = q.grad * 0.5
    manual.step()
    for (name, p), q in zip(manual_model.named_parameters(), clipped.model.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(params(manual_model)["classifier.weight"], start["classifier.weight"])


@pytest.mark.parametrize("nan_filter", [True, False])
def test_a_micro_batch_without_label_items_adds_nothing_to_the_logged_loss(tmp_path, nan_filter):
    """A one-token document (no next-token label) in an accumulated step: its mean loss over zero items
    is NaN, and NaN × its share 0 stayed NaN, so the logged loss was NaN (logging_nan_inf_filter=False)
    or, the Trainer's filter replacing it by the running mean, about twice the step's (9.24 vs 4.62).
    The step's loss is the item-weighted mean: the one document's loss, as with it alone."""
    from torch.utils.data import SequentialSampler

    class InOrder(EVONTrainer):
        def _get_train_sampler(self, *args, **kwargs):  # the documents in their order: [doc, one token]
            return SequentialSampler(self.train_dataset)

    docs = [[5, 8, 11, 14, 17, 20, 23, 26], [40]]
    losses, weights = [], []
    for accumulate, rows in ((2, docs), (1, docs[:1])):
        trainer = InOrder(
            model=tiny_gpt2(),
            args=config(tmp_path / str(accumulate), max_steps=1, logging_steps=1, per_device_train_batch_size=1,
                        gradient_accumulation_steps=accumulate, evon_ess=float("inf"), logging_nan_inf_filter=nan_filter),
            train_dataset=Dataset.from_dict({"input_ids": rows, "labels": rows}),
        )  # fmt: skip
        trainer.train()
        losses.append(next(h["loss"] for h in trainer.state.log_history if "loss" in h))
        weights.append(params(trainer.model))
    assert math.isfinite(losses[0]) and losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])  # the same step


def test_the_trainers_step_reads_no_scalar_back_from_a_tensor(tmp_path):
    """Issue 32: on a GPU every scalar read back (``aten._local_scalar_dense``) waits for all
    queued kernels. The trainer's own per-step code reads none: each micro-batch's share of the
    step's label items and the grad-norm clip's guard against a non-finite norm are decided on
    the device (gradient accumulation, a causal LM with padded labels, clipping on)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    trainer_dir = os.path.join("hf_evon", "trainer")
    reads = []

    class ScalarReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket == torch.ops.aten._local_scalar_dense:
                frame = sys._getframe(1)  # the first caller outside torch made the read
                while frame is not None and os.path.join("site-packages", "torch") in frame.f_code.co_filename:
                    frame = frame.f_back
                if frame is not None and trainer_dir in frame.f_code.co_filename:
                    reads.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
            return func(*args, **(kwargs or {}))

    trainer = EVONTrainer(
        model=tiny_gpt2(),
        args=config(
            tmp_path, max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_grad_norm=1.0, logging_steps=100,
        ),
        train_dataset=lm_data(),
    )  # fmt: skip
    with ScalarReads():
        trainer.train()
    assert trainer.state.global_step == 6
    assert reads == []


def test_a_micro_batchs_loss_share_is_its_part_of_the_steps_label_items(tmp_path):
    """``w_i = n_i / N`` of the step's label items (times the processes where N counts all of
    them); an even share 1/A where the step has no label item at all or counts none."""
    trainer = EVONTrainer(model=tiny_gpt2(), args=config(tmp_path), train_dataset=lm_data())
    trainer.current_gradient_accumulation_steps = 4
    labels = torch.tensor([[5, 6, -100, 7], [8, 9, -100, -100]])  # 3 items after the causal shift
    trainer._evon_items_global = False
    for total, want in ((12, 3 / 12), (3, 1.0), (0, 1 / 4)):
        trainer._evon_step_items = torch.tensor(total)
        share = trainer._loss_share(labels)
        assert share.dtype == torch.float32 and float(share) == pytest.approx(want, rel=1e-7)
    trainer._evon_step_items = None
    assert float(trainer._loss_share(labels)) == 0.25
    assert float(trainer._loss_share(None)) == 0.25
    trainer._evon_items_global = True  # N over 2 processes: each rank's mean is later averaged
    trainer._evon_step_items = torch.tensor(12)
    assert float(trainer._loss_share(labels)) == pytest.approx(3 / 12 * trainer.accelerator.num_processes)
    trainer._evon_step_items = torch.tensor(0)
    assert float(trainer._loss_share(labels)) == 0.25


def test_gradient_checkpointing_backward_runs_at_the_sample(tmp_path):
    """Checkpointing recomputes the forward during backward: inside the sampled block that is
    the same sampled weight, so results equal the run without checkpointing."""
    data = classification_data(32)
    plain = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "a", max_steps=3), train_dataset=data)
    plain.train()
    # transformers 5.24 renamed gradient_checkpointing (5.19, the oldest we support) activation_checkpointing
    fields = {f.name for f in dataclasses.fields(EVONConfig)}
    switch = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    ckpt = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "b", max_steps=3, **{switch: True}), train_dataset=data)
    ckpt.train()
    assert getattr(ckpt.model, f"is_{switch}") and not getattr(plain.model, f"is_{switch}")
    pa, pb = params(plain.model), params(ckpt.model)
    for name in pa:
        torch.testing.assert_close(pb[name], pa[name], rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_autocast_trains(tmp_path):
    model = tiny_bert()
    before = params(model)
    trainer = EVONTrainer(
        model=model, args=config(tmp_path, bf16=True, max_steps=3), train_dataset=classification_data()
    )
    out = trainer.train()
    assert math.isfinite(out.training_loss)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not torch.equal(
        before["bert.encoder.layer.0.output.dense.weight"],
        params(model)["bert.encoder.layer.0.output.dense.weight"],
    )
    assert trainer.evon_optimizer.skipped_steps == 0


# ---------------------------------------------------------------------------- checkpoints
def test_resume_from_checkpoint_is_exact(tmp_path):
    data = classification_data(48)
    common = dict(max_steps=6, save_strategy="steps", save_steps=3, evon_ess=300.0)
    full = EVONTrainer(
        model=tiny_bert(dropout=0.1), args=config(tmp_path / "full", **common), train_dataset=data
    )
    full.train()
    checkpoint = tmp_path / "full" / "out" / "checkpoint-3"
    assert (checkpoint / POSTERIOR_WEIGHTS_NAME).is_file() and (checkpoint / POSTERIOR_CONFIG_NAME).is_file()
    assert (checkpoint / "README.md").read_text().count("hf-evon:start") == 1
    resumed = EVONTrainer(
        model=tiny_bert(seed=7, dropout=0.1), args=config(tmp_path / "res", **common), train_dataset=data
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="resumed from")  # nothing was changed
        resumed.train(resume_from_checkpoint=str(checkpoint))
    pa, pb = params(full.model), params(resumed.model)
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    # settings changed for the resume: the checkpoint's are used, exactly as before, and named
    changed = EVONTrainer(
        model=tiny_bert(seed=7, dropout=0.1),
        args=config(tmp_path / "changed", **{**common, "evon_clip": "element", "evon_mc_samples": 2}),
        train_dataset=data,
    )
    with pytest.warns(UserWarning, match=r"resumed from .*mc_samples: 2 -> 1; group 0 clip: 'element' -> 'whiten_rms'"):
        changed.train(resume_from_checkpoint=str(checkpoint))
    assert all(torch.equal(pa[name], b) for name, b in params(changed.model).items())
    fa, fb = full.current_posterior().to_tensors(), resumed.current_posterior().to_tensors()
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    # a resumed run from a *different* checkpoint step would not match: the test can fail
    assert not torch.equal(
        params(full.model)["classifier.weight"], params(tiny_bert(seed=7))["classifier.weight"]
    )


def test_a_resume_from_a_checkpoint_without_its_rng_state_says_the_run_is_not_continued_exactly(tmp_path):
    """Without ``rng_state.pth`` (deleted) the Trainer logs at info level only and resumes with fresh
    random states: with dropout the weights came out other than the uninterrupted run's, silently.
    Both ways of resuming warn; a complete checkpoint's resume does not (and is exact)."""
    data = classification_data(32)
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, evon_ess=300.0)
    full = EVONTrainer(model=tiny_bert(dropout=0.1), args=config(tmp_path / "full", **common), train_dataset=data)
    full.train()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="resuming from .* which has no")
        exact = EVONTrainer(model=tiny_bert(seed=7, dropout=0.1), args=config(tmp_path / "exact", **common), train_dataset=data)
        exact.train(resume_from_checkpoint=str(tmp_path / "full" / "out" / "checkpoint-2"))
    assert all(torch.equal(a, params(exact.model)[n]) for n, a in params(full.model).items())
    for run in ("path", "true"):  # each its own output_dir: the first resume's checkpoint-4 is complete
        shutil.copytree(tmp_path / "full" / "out" / "checkpoint-2", tmp_path / run / "out" / "checkpoint-2")
        os.remove(tmp_path / run / "out" / "checkpoint-2" / "rng_state.pth")
    for run, resume in (("path", str(tmp_path / "path" / "out" / "checkpoint-2")), ("true", True)):
        inexact = EVONTrainer(model=tiny_bert(seed=7, dropout=0.1), args=config(tmp_path / run, **common), train_dataset=data)
        with pytest.warns(UserWarning, match=r"checkpoint-2, which has no rng_state\.pth: the random states \(data order, dropout\) start afresh"):
            inexact.train(resume_from_checkpoint=resume)
        assert not all(torch.equal(a, params(inexact.model)[n]) for n, a in params(full.model).items())


def test_a_resume_on_the_trainer_that_trained_continues_exactly(tmp_path):
    """``trainer.train(resume_from_checkpoint=...)`` on the trainer that wrote the checkpoint loads
    its state into the same EVON, whose noise generator had drawn the last step's sample: the
    resumed step's label is that step's, so the generator was not reseeded and the step drew
    other noise than the run that saved the checkpoint (weights and posterior differed)."""
    data = classification_data(32)
    trainer = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path, max_steps=3, save_strategy="steps", save_steps=1, evon_ess=300.0),
        train_dataset=data,
    )  # fmt: skip
    trainer.train()
    weights, posterior = params(trainer.model), trainer.current_posterior().to_tensors()
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert trainer.state.global_step == 3
    assert all(torch.equal(weights[name], p) for name, p in params(trainer.model).items())
    again = trainer.current_posterior().to_tensors()
    assert again.keys() == posterior.keys() and all(torch.equal(again[k], posterior[k]) for k in again)


def test_resume_from_a_checkpoint_without_optimizer_state_says_the_posterior_starts_afresh(tmp_path):
    """``save_only_model=True`` checkpoints hold the weights and the posterior but no optimizer
    state; transformers resumes from them silently with a fresh optimizer. EVON's posterior then
    restarts (H at hess_init), which the resume must say; a full checkpoint's resume does not."""
    data = classification_data(32)
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, evon_ess=300.0)
    lean = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "lean", save_only_model=True, **common), train_dataset=data)
    lean.train()
    checkpoint = tmp_path / "lean" / "out" / "checkpoint-2"
    assert (checkpoint / POSTERIOR_CONFIG_NAME).is_file() and not (checkpoint / "optimizer.pt").exists()
    resumed = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "res", **common), train_dataset=data)
    with pytest.warns(UserWarning, match=r"resumed from .*checkpoint-2, whose optimizer state the Trainer did not load .*starts afresh"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    # it trained on from step 2 with a fresh optimizer: two updates, where a full resume's counts four
    assert resumed.state.global_step == 4 and resumed.evon_optimizer.state_dict()["evon"]["updates"] == 2
    full = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "full", **common), train_dataset=data)
    full.train()
    again = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "again", **common), train_dataset=data)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="resumed from")
        again.train(resume_from_checkpoint=str(tmp_path / "full" / "out" / "checkpoint-2"))
    assert again.state.global_step == 4 and again.evon_optimizer.state_dict()["evon"]["updates"] == 4


def test_a_resume_says_what_became_of_evons_state_whatever_the_checkpoints_files(tmp_path):
    """The warning read the checkpoint's file names: with optimizer.pt but no scheduler.pt the
    Trainer loads neither (EVON started afresh, silently); a trainer that had trained before keeps
    its optimizer (EVON went on from that state, while the warning said it started afresh). And a
    seed changed since the save is named among the settings the checkpoint's state replaces."""
    data = classification_data(32)
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, evon_ess=300.0)
    full = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "full", **common), train_dataset=data)
    full.train()
    checkpoint = tmp_path / "full" / "out" / "checkpoint-2"
    partial = tmp_path / "partial"
    shutil.copytree(checkpoint, partial)
    os.remove(partial / "scheduler.pt")
    resumed = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "r1", **common), train_dataset=data)
    with pytest.warns(UserWarning, match=r"resumed from .*partial, whose optimizer state the Trainer did not load .*starts afresh"):
        resumed.train(resume_from_checkpoint=str(partial))
    assert resumed.evon_optimizer.state_dict()["evon"]["updates"] == 2
    lean = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "lean", save_only_model=True, **common), train_dataset=data)
    lean.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lean.train(resume_from_checkpoint=str(tmp_path / "lean" / "out" / "checkpoint-2"))
    said = [str(w.message) for w in caught if "resumed from" in str(w.message)]
    assert len(said) == 1 and "goes on from the state this trainer already had" in said[0], said
    assert lean.evon_optimizer.state_dict()["evon"]["updates"] == 6  # 4, then 2 more on the same state
    other_seed = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "r2", evon_seed=123, **common), train_dataset=data)
    with pytest.warns(UserWarning, match=r"replace this run's where they differ \(seed: 123 -> 0\)"):
        other_seed.train(resume_from_checkpoint=str(checkpoint))
    assert other_seed.evon_optimizer.seed == 0


def test_a_resume_names_a_changed_adamw_eps_as_the_adamw_groups_eps():
    """An AdamW group's ε is its ``eps`` (torch AdamW's key): a checkpoint's that differs from the
    run's ``adam_epsilon`` is named as that group's eps; a checkpoint that kept it under
    ``adamw_eps`` (beside EVON's 1e-12 as ``eps``) with the run's value changes nothing."""
    from hf_evon.trainer.checkpointing import settings_replaced

    def optimizer(adamw_eps: float) -> EVON:
        torch.manual_seed(0)
        layer = torch.nn.Linear(3, 2)
        return EVON([{"params": [layer.weight]}, {"params": [layer.bias], "algorithm": "adamw"}], adamw_eps=adamw_eps)

    saved = optimizer(1e-3).state_dict()
    run = optimizer(1e-8)
    fresh = [dict(g) for g in run.param_groups]
    run.load_state_dict(saved)
    assert settings_replaced(fresh, run.param_groups) == ["group 1 eps: 1e-08 -> 0.001"]
    old = optimizer(1e-3).state_dict()
    for group in old["param_groups"]:
        group["eps"] = 1e-12 if group["algorithm"] == "adamw" else group["eps"]
        group["adamw_eps"] = 1e-3
    run = optimizer(1e-3)
    fresh = [dict(g) for g in run.param_groups]
    run.load_state_dict(old)
    assert settings_replaced(fresh, run.param_groups) == []


def test_a_resume_with_another_rate_names_the_checkpoints_configured_rate_which_the_posterior_records(tmp_path):
    """A checkpoint's EVON groups hold both records of the rate as configured (torch's ``initial_lr``,
    EVON's ``configured_lr``): a resume configured with another α is named by its ``initial_lr`` (the
    base the resumed schedule scales), trains on at the checkpoint's, and its posterior records that."""
    data = classification_data(32)
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, evon_ess=300.0, lr_scheduler_type="linear")
    full = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "full", evon_learning_rate=2e-2, **common), train_dataset=data)
    full.train()
    checkpoint = tmp_path / "full" / "out" / "checkpoint-2"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=False)["param_groups"][0]
    assert saved["algorithm"] == "evon" and saved["initial_lr"] == saved["configured_lr"] == 2e-2
    other = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "other", evon_learning_rate=3e-2, **common), train_dataset=data)
    with pytest.warns(UserWarning, match=r"where they differ \(group 0 initial_lr: 0\.03 -> 0\.02[;)]"):
        other.train(resume_from_checkpoint=str(checkpoint))
    first = other.evon_optimizer.param_groups[0]
    assert (first["initial_lr"], first["configured_lr"]) == (2e-2, 2e-2)
    assert other.current_posterior().config["lr"] == full.current_posterior().config["lr"] == 2e-2


def _killed_saves(tmp_path: Path, **settings) -> tuple[EVONTrainer, Path]:
    """An uninterrupted run saving every 2 steps, and a copy of its output directory as saves killed
    at different points would leave it: checkpoint-4 without trainer_state.json (the Trainer writes
    it last), checkpoint-6 with it cut short, checkpoint-8 without optimizer.pt."""
    common = dict(max_steps=8, save_strategy="steps", save_steps=2, evon_ess=300.0, **settings)
    full = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "full", **common), train_dataset=classification_data(32))
    full.train()
    killed = tmp_path / "killed" / "out"
    shutil.copytree(tmp_path / "full" / "out", killed)
    os.remove(killed / "checkpoint-4" / "trainer_state.json")
    state = killed / "checkpoint-6" / "trainer_state.json"
    state.write_text(state.read_text()[:40])
    if (killed / "checkpoint-8" / "optimizer.pt").exists():
        os.remove(killed / "checkpoint-8" / "optimizer.pt")
    else:
        os.remove(killed / "checkpoint-8" / "trainer_state.json")
    return full, killed


def test_resume_true_goes_on_from_the_newest_complete_checkpoint(tmp_path):
    """``resume_from_checkpoint=True`` took the highest-numbered checkpoint directory, whatever a
    killed save left in it: without trainer_state.json the run restarted at step 0 with the partial
    checkpoint's weights and a fresh optimizer (EVON's posterior lost). It resumes from the newest
    complete checkpoint, says once which directories it skipped and what each lacks, and ends
    exactly as the uninterrupted run."""
    full, killed = _killed_saves(tmp_path)
    common = dict(max_steps=8, save_strategy="steps", save_steps=2, evon_ess=300.0)
    resumed = EVONTrainer(model=tiny_bert(seed=7), args=config(killed.parent, **common), train_dataset=classification_data(32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.train(resume_from_checkpoint=True)
    said = [str(w.message) for w in caught if "incomplete" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    for step, missing in ((8, "optimizer.pt"), (6, "trainer_state.json"), (4, "trainer_state.json")):
        assert f"{killed / f'checkpoint-{step}'} (" in said[0] and missing in said[0].split(f"checkpoint-{step} (")[1]
    assert str(killed / "checkpoint-2") in said[0].split("resuming from")[1]
    assert resumed.state.global_step == 8 and resumed.evon_optimizer.state_dict()["evon"]["updates"] == 8
    pa, pb = params(full.model), params(resumed.model)
    assert [n for n in pa if not torch.equal(pa[n], pb[n])] == []
    fa, fb = full.current_posterior().to_tensors(), resumed.current_posterior().to_tensors()
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def test_a_resume_refuses_a_checkpoint_a_killed_save_left_incomplete(tmp_path):
    """An explicit path to a checkpoint without trainer_state.json started the run at step 0 (or
    failed reading the file, without saying the save was cut short); it is a ValueError naming the
    directory and the file, the trainer unchanged. With no complete checkpoint at all,
    ``resume_from_checkpoint=True`` names each directory. A ``save_only_model`` run writes no
    optimizer.pt, so its checkpoints are complete without one."""
    _, killed = _killed_saves(tmp_path)
    common = dict(max_steps=8, save_strategy="steps", save_steps=2, evon_ess=300.0)
    trainer = EVONTrainer(model=tiny_bert(seed=7), args=config(killed.parent, **common), train_dataset=classification_data(32))
    before = params(trainer.model)
    for step, missing in ((4, "no trainer_state.json"), (6, "trainer_state.json cut short")):
        with pytest.raises(ValueError, match=rf"{killed / f'checkpoint-{step}'}.*{missing}"):
            trainer.train(resume_from_checkpoint=str(killed / f"checkpoint-{step}"))
        assert trainer.state.global_step == 0 and trainer.evon_optimizer is None
        assert all(torch.equal(before[n], p) for n, p in params(trainer.model).items())
    shutil.rmtree(killed / "checkpoint-2")
    with pytest.raises(ValueError, match=r"no complete checkpoint .*checkpoint-8 \(no optimizer\.pt.*checkpoint-4 \("):
        trainer.train(resume_from_checkpoint=True)
    lean_full, lean = _killed_saves(tmp_path / "lean", save_only_model=True)
    assert not (lean / "checkpoint-2" / "optimizer.pt").exists()
    lean_args = config(lean.parent, **common, save_only_model=True)
    again = EVONTrainer(model=tiny_bert(seed=7), args=lean_args, train_dataset=classification_data(32))
    with pytest.warns(UserWarning, match=r"resuming from .*checkpoint-2\b"):
        again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 8


def test_a_resume_names_an_optimizer_or_scheduler_file_torch_cannot_read(tmp_path):
    """A checkpoint whose optimizer.pt is cut short, or holds a pickle torch.load(weights_only=True)
    refuses, raised torch's own error naming no file (the refusal with torch's advice to load it with
    weights_only=False, which would run its code); it is a ValueError naming the file. So is a
    scheduler.pt cut short, read after EVON's state loaded. An rng_state.pth of either kind raised torch's
    errors too, after the weights and EVON's state had loaded: it is refused, naming it, before anything loads."""
    import io
    import pickle

    common = dict(max_steps=4, save_strategy="steps", save_steps=2, evon_ess=300.0)
    EVONTrainer(model=tiny_bert(), args=config(tmp_path / "full", **common), train_dataset=classification_data(32)).train()
    source = tmp_path / "full" / "out" / "checkpoint-2"
    payload = io.BytesIO()
    torch.save({"x": pickle.loads(pickle.dumps(print))}, payload)
    cases = {
        "optimizer.pt": ((source / "optimizer.pt").read_bytes()[:4000], "cannot read EVON's state (PytorchStreamReader"),
        "optimizer.pt ": (payload.getvalue(), "refusing to load it: torch.load(weights_only=True) loads tensors"),
        "scheduler.pt": ((source / "scheduler.pt").read_bytes()[:100], "cannot read the scheduler's state ("),
        "rng_state.pth": ((source / "rng_state.pth").read_bytes()[:300], "cannot read the random number generators' state ("),
        "rng_state.pth ": (payload.getvalue(), "refusing to load it: torch.load(weights_only=True) loads tensors"),
        "rng_state.pth  ": (b"junk", "cannot read the random number generators' state ("),  # struct's error
    }
    for k, (name, (data, said)) in enumerate(cases.items()):
        checkpoint = tmp_path / f"bad{k}" / "checkpoint-2"
        shutil.copytree(source, checkpoint)
        (checkpoint / name.strip()).write_bytes(data)
        trainer = EVONTrainer(model=tiny_bert(), args=config(tmp_path / f"run{k}", **common), train_dataset=classification_data(32))
        with pytest.raises(ValueError) as refused:
            trainer.train(resume_from_checkpoint=str(checkpoint))
        assert str(refused.value).startswith(f"{checkpoint / name.strip()}: {said}"), str(refused.value)
        assert "weights_only=False" not in str(refused.value)
        if name.startswith("rng"):  # refused first: nothing of the checkpoint loaded
            fresh = tiny_bert()
            assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), fresh.parameters()))
            assert trainer.optimizer is None or not trainer.optimizer.state


def test_a_trainer_state_nested_past_the_recursion_limit_is_an_unreadable_checkpoint(tmp_path):
    """A trainer_state.json of nested arrays raised json's bare RecursionError from the resume check,
    naming no file; such a checkpoint is incomplete, as one cut short is."""
    from hf_evon.trainer.checkpointing import _incomplete

    (tmp_path / "trainer_state.json").write_text("[" * 100_000 + "]" * 100_000)
    reason = _incomplete(str(tmp_path))
    assert reason is not None and reason.startswith("trainer_state.json cut short or unreadable: maximum recursion depth")


def test_resume_true_says_a_checkpoint_without_optimizer_state_was_saved_so_and_how_to_resume_it(tmp_path):
    """A ``save_only_model=True`` run's checkpoints resumed with ``save_only_model`` off: each finished
    save (its trainer_state.json, written last, complete) was refused as "incomplete", the error naming
    neither ``save_only_model`` nor the way to resume its weights; it names both."""
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, evon_ess=300.0)
    EVONTrainer(
        model=tiny_bert(), args=config(tmp_path, save_only_model=True, **common), train_dataset=classification_data(32)
    ).train()
    trainer = EVONTrainer(model=tiny_bert(), args=config(tmp_path, **common), train_dataset=classification_data(32))
    checkpoint = tmp_path / "out" / "checkpoint-4"
    with pytest.raises(ValueError, match=r"checkpoint-4 \(no optimizer\.pt and no scheduler\.pt: saved without") as err:
        trainer.train(resume_from_checkpoint=True)
    assert "save_only_model=True" in str(err.value) and "resume_from_checkpoint=<its path>" in str(err.value)
    assert trainer.state.global_step == 0 and trainer.evon_optimizer is None
    with pytest.warns(UserWarning, match=r"resumed from .*checkpoint-4, whose optimizer state .*starts afresh"):
        trainer.train(resume_from_checkpoint=str(checkpoint))  # the way the error names
    assert trainer.state.global_step == 4


def test_the_skipped_checkpoints_warning_names_the_users_train_call(tmp_path, monkeypatch):
    """The warning that ``resume_from_checkpoint=True`` skips an incomplete checkpoint named a line of
    hf_evon/trainer/mixin.py (a fixed ``stacklevel`` counted from the helper): a filter by module or
    the report's location pointed into the library. It names the caller's ``trainer.train()`` line."""
    from transformers import Trainer

    trainer = EVONTrainer(model=tiny_bert(), args=config(tmp_path), train_dataset=classification_data(8))
    complete, cut = Path(trainer.args.output_dir) / "checkpoint-2", Path(trainer.args.output_dir) / "checkpoint-4"
    for name in ("trainer_state.json", "optimizer.pt", "scheduler.pt"):
        complete.mkdir(parents=True, exist_ok=True)
        (complete / name).write_text("{}")
    cut.mkdir()

    def stop(self, *args, **kwargs):
        raise KeyboardInterrupt(kwargs["resume_from_checkpoint"])  # the resolved checkpoint: no training

    monkeypatch.setattr(Trainer, "train", stop)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(KeyboardInterrupt, match="checkpoint-2"):
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=True)
    said = [w for w in caught if "incomplete checkpoints" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__, [(w.filename, str(w.message)) for w in caught]


@pytest.mark.parametrize("name", ["trainer_state.json", "optimizer.pt"])
def test_a_checkpoints_file_that_cannot_be_looked_up_is_not_taken_for_a_save_cut_short(tmp_path, monkeypatch, name):
    """A checkpoint file this user cannot look up (EACCES; simulated, the tests run as root): os.path.isfile
    took it for missing, so ``resume_from_checkpoint=True`` skipped the newest checkpoint as incomplete and
    resumed from an older one, and an explicit path to it was refused as "an incomplete checkpoint (no
    trainer_state.json): its save was cut short". The PermissionError naming the file is raised, before
    the Trainer's train()."""
    from transformers import Trainer

    trainer = EVONTrainer(model=tiny_bert(), args=config(tmp_path), train_dataset=classification_data(8))
    older, newest = Path(trainer.args.output_dir) / "checkpoint-2", Path(trainer.args.output_dir) / "checkpoint-4"
    for checkpoint in (older, newest):
        checkpoint.mkdir(parents=True)
        for file in ("trainer_state.json", "optimizer.pt", "scheduler.pt"):
            (checkpoint / file).write_text("{}")
    refused_path = str(newest / name)

    def stop(self, *args, **kwargs):
        raise KeyboardInterrupt(kwargs["resume_from_checkpoint"])  # the resolved checkpoint: no training

    monkeypatch.setattr(Trainer, "train", stop)
    refuse_lookups(monkeypatch, lambda path: path == refused_path)
    resumes = [str(newest), True] if name == "trainer_state.json" else [True]
    for resume in resumes:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no checkpoint is skipped
            with pytest.raises(PermissionError) as err:
                trainer.train(resume_from_checkpoint=resume)
        assert err.value.filename == refused_path


def _two_checkpoints(trainer) -> tuple[Path, Path]:
    """checkpoint-2 and checkpoint-4 of ``trainer``'s output_dir, each with the files a resume reads."""
    older, newest = Path(trainer.args.output_dir) / "checkpoint-2", Path(trainer.args.output_dir) / "checkpoint-4"
    for checkpoint in (older, newest):
        checkpoint.mkdir(parents=True)
        for file in ("trainer_state.json", "optimizer.pt", "scheduler.pt"):
            (checkpoint / file).write_text("{}")
    return older, newest


class _Resolved(Exception):
    """The checkpoint ``Trainer.train`` was to resume from: raised in its place, so that no training runs."""


def _stop_at_resolved_checkpoint(self, *args, **kwargs):
    raise _Resolved(kwargs["resume_from_checkpoint"])


@pytest.mark.parametrize("listed", ["link to nothing", "loop of links", "cannot be looked up"])
def test_a_checkpoint_directory_listed_there_is_not_taken_for_none(tmp_path, monkeypatch, listed):
    """The checkpoint directory a resume goes on from was looked up with os.path.isdir, which swallows why:
    a newest checkpoint-4 this user cannot look up (EACCES; simulated, the tests run as root), or that is a
    link to nothing (a disk not mounted) or a loop of links, was passed over without a word and the run
    resumed from checkpoint-2; an explicit resume_from_checkpoint so listed, and an output_dir that is a
    link to nothing, met the Trainer's "Can't find a valid checkpoint" / "No such file or directory". The
    PermissionError naming the path is raised, and a link that reaches nothing is a FileNotFoundError naming
    it and what it is, before the Trainer's train()."""
    from transformers import Trainer

    trainer = EVONTrainer(model=tiny_bert(), args=config(tmp_path), train_dataset=classification_data(8))
    _, newest = _two_checkpoints(trainer)
    if listed == "cannot be looked up":
        refuse_lookups(monkeypatch, lambda path: path == str(newest) or path.startswith(f"{newest}{os.sep}"))
    else:
        shutil.rmtree(newest)
        newest.symlink_to("moved-away" if listed == "link to nothing" else newest)
    monkeypatch.setattr(Trainer, "train", _stop_at_resolved_checkpoint)
    for resume in (True, str(newest)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no checkpoint is skipped
            if listed == "cannot be looked up":
                with pytest.raises(PermissionError) as err:
                    trainer.train(resume_from_checkpoint=resume)
                assert err.value.filename == str(newest)
            else:
                why = "does not exist" if listed == "link to nothing" else r"leads into a loop of links \(ELOOP\)"
                with pytest.raises(FileNotFoundError, match=rf"'{newest}' is a link to '.*', which {why}"):
                    trainer.train(resume_from_checkpoint=resume)
    if listed == "link to nothing":
        output_dir = Path(trainer.args.output_dir)
        output_dir.rename(tmp_path / "moved-out")
        output_dir.symlink_to("moved-away")
        with pytest.raises(FileNotFoundError, match=rf"output_dir '{output_dir}' is a link to 'moved-away', which does"):
            trainer.train(resume_from_checkpoint=True)


@pytest.mark.parametrize("listed", ["link to nothing", "loop of links", "cannot be looked up"])
def test_an_optimizer_state_file_listed_there_is_not_said_to_be_saved_without(tmp_path, monkeypatch, listed):
    """A checkpoint that lacks the optimizer state this run resumes from was said to be "saved without its
    optimizer state, as save_only_model=True saves", with the advice to set save_only_model=True (which
    resumes its weights alone), unless os.path.exists found one of the files a save writes of that state:
    an optimizer.pt that is a link to nothing (a disk not mounted) or a loop of links, or an
    evon_optimizer.pt this user cannot look up (EACCES; simulated, the tests run as root), was taken for
    none. Such a checkpoint is skipped naming what it lacks, without that claim; the one that cannot be
    looked up raises the PermissionError naming it."""
    from transformers import Trainer

    trainer = EVONTrainer(model=tiny_bert(), args=config(tmp_path), train_dataset=classification_data(8))
    older, newest = _two_checkpoints(trainer)
    os.remove(newest / "scheduler.pt")
    os.remove(newest / "optimizer.pt")
    refused_path = str(newest / "evon_optimizer.pt")
    if listed == "cannot be looked up":
        refuse_lookups(monkeypatch, lambda path: path == refused_path)
    else:
        (newest / "optimizer.pt").symlink_to("moved-away" if listed == "link to nothing" else newest / "optimizer.pt")

    monkeypatch.setattr(Trainer, "train", _stop_at_resolved_checkpoint)
    if listed == "cannot be looked up":
        with pytest.raises(PermissionError) as err:
            trainer.train(resume_from_checkpoint=True)
        assert err.value.filename == refused_path
        return
    with warnings.catch_warnings(record=True) as caught, pytest.raises(_Resolved, match="checkpoint-2"):
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=True)
    said = [str(w.message) for w in caught if "incomplete checkpoints" in str(w.message)]
    assert said == [
        f"resume_from_checkpoint=True: skipping the incomplete checkpoints ({newest} (no optimizer.pt and no "
        f"scheduler.pt)); resuming from {older}"
    ]


# ---------------------------------------------------------------------------- evaluation
def _direct_bma(model, posterior, data, seeds, causal=False):
    model.eval()
    batch = {k: torch.tensor(v) for k, v in data[:].items()}
    labels = batch["labels"]
    logps = []
    contexts = [None] + list(seeds)
    for seed in contexts:
        with torch.no_grad():
            if seed is None:
                logits = model(**batch).logits
            else:
                with posterior.sampled(model, seed=seed):
                    logits = model(**batch).logits
        logps.append(torch.log_softmax(logits.double(), -1))
    mean, samples = logps[0], torch.stack(logps[1:])
    bma = torch.logsumexp(samples, 0) - math.log(len(seeds))
    logit_average = torch.log_softmax(torch.stack(logps[1:]).mean(0), -1)  # the wrong way
    if causal:

        def nll(lp):
            t = labels[:, 1:]
            mask = t.ne(-100)
            picked = lp[:, :-1].gather(-1, t.clamp_min(0)[..., None])[..., 0]
            return float(-(picked * mask).sum() / mask.sum())

        return nll(mean), nll(bma), nll(logit_average)
    return (
        calibration_metrics(mean, labels, "log_probs"),
        calibration_metrics(bma, labels, "log_probs"),
        calibration_metrics(logit_average, labels, "log_probs"),
    )


def test_bma_metrics_equal_a_direct_computation_classification(tmp_path):
    train, evaluation = classification_data(48), classification_data(48, seed=1)  # 3 full eval batches
    trainer = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path, max_steps=4, evon_ess=60.0, bma_num_samples=4, bma_seed=3),
        train_dataset=train, eval_dataset=evaluation,
    )  # fmt: skip
    trainer.train()
    metrics = trainer.evaluate()
    before = params(trainer.model)
    mean, bma, logit_avg = _direct_bma(
        trainer.model, trainer.current_posterior(), evaluation, seeds=[3, 4, 5, 6]
    )
    assert params(trainer.model).keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in params(trainer.model).items()), (
        "evaluation changed the mean"
    )
    for key in ("nll", "accuracy", "ece", "brier"):
        assert metrics[f"eval_mean_{key}"] == pytest.approx(mean[key], rel=1e-5, abs=1e-7), key
        assert metrics[f"eval_bma_{key}"] == pytest.approx(bma[key], rel=1e-5, abs=1e-7), key
    # equal batches: the Trainer's per-batch average eval_loss equals the overall mean NLL
    assert metrics["eval_mean_nll"] == pytest.approx(metrics["eval_loss"], rel=1e-5)
    assert abs(metrics["eval_bma_nll"] - metrics["eval_mean_nll"]) > 1e-4  # the samples differ from the mean
    assert abs(bma["nll"] - logit_avg["nll"]) > 1e-4  # averaging logits would be detected


def test_bma_metrics_causal_lm(tmp_path):
    train, evaluation = lm_data(24), lm_data(16, seed=1)
    trainer = EVONTrainer(
        model=tiny_gpt2(), args=config(tmp_path, max_steps=3, evon_ess=50.0, bma_num_samples=3, bma_seed=0),
        train_dataset=train, eval_dataset=evaluation,
    )  # fmt: skip
    trainer.train()
    metrics = trainer.evaluate()
    mean, bma, logit_avg = _direct_bma(
        trainer.model, trainer.current_posterior(), evaluation, [0, 1, 2], causal=True
    )
    assert metrics["eval_mean_nll"] == pytest.approx(mean, rel=1e-5)
    assert metrics["eval_mean_perplexity"] == pytest.approx(math.exp(mean), rel=1e-5)
    assert metrics["eval_bma_nll"] == pytest.approx(bma, rel=1e-5)
    assert metrics["eval_bma_perplexity"] == pytest.approx(math.exp(bma), rel=1e-5)
    # one eval batch: the per-batch loss is the token mean, as the model's own loss
    assert metrics["eval_loss"] == pytest.approx(mean, rel=1e-5)
    assert abs(bma - mean) > 1e-4 and abs(bma - logit_avg) > 1e-5


def test_bma_disabled_and_no_posterior(tmp_path):
    evaluation = classification_data(16, seed=1)
    trainer = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path, bma_num_samples=0), eval_dataset=evaluation
    )
    metrics = trainer.evaluate()
    assert "eval_mean_accuracy" in metrics and not any("_bma_" in k for k in metrics)
    trainer2 = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path, bma_num_samples=2), eval_dataset=evaluation
    )
    metrics2 = trainer2.evaluate()  # no optimizer, no posterior: mean metrics only
    assert "eval_mean_nll" in metrics2 and not any("_bma_" in k for k in metrics2)


# ---------------------------------------------------------------------------- PEFT
def _lora_config():
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType.SEQ_CLS, r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0
    )


def test_peft_config_wraps_the_model_and_the_posterior_covers_the_adapter(tmp_path):
    from peft import PeftModel

    base = tiny_bert()
    frozen = params(base)
    trainer = EVONTrainer(
        model=base, args=config(tmp_path, max_steps=3), peft_config=_lora_config(),
        train_dataset=classification_data(), eval_dataset=classification_data(16, seed=1),
    )  # fmt: skip
    assert isinstance(trainer.model, PeftModel)
    trainer.train()
    posterior = trainer.current_posterior()
    assert posterior.names and all("lora_" in n or "classifier" in n for n in posterior.names)
    assert any("lora_A" in n for n in posterior.names) and any("lora_B" in n for n in posterior.names)
    for name, p in trainer.model.get_base_model().named_parameters():
        if "lora_" not in name and "classifier" not in name and not p.requires_grad:
            assert torch.equal(p.detach(), frozen[name.replace("base_layer.", "")]), name
    metrics = trainer.evaluate()
    assert "eval_bma_nll" in metrics
    trainer.save_model()
    out = Path(trainer.args.output_dir)
    assert (out / "adapter_model.safetensors").is_file() and (out / POSTERIOR_WEIGHTS_NAME).is_file()
    assert not (out / "model.safetensors").exists()
    with pytest.raises(ValueError, match="already a PeftModel"):
        EVONTrainer(model=trainer.model, args=config(tmp_path), peft_config=_lora_config())



def test_bma_after_an_evon_run_that_trained_no_matrix_names_why_there_is_no_posterior(tmp_path, caplog):
    """PEFT's prompt tuning trains one embedding, which AdamW owns: EVON owns nothing, so there is no
    posterior. ``predict(bma=True)`` said "train with EVON first" (the run did) and ``evaluate()`` logged
    "no EVON optimizer" (there is one); both now say that EVON trains none of the parameters."""
    from peft import PromptTuningConfig, TaskType

    prompt = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    with pytest.warns(UserWarning, match="EVON trains none"):
        trainer = EVONTrainer(
            model=tiny_gpt2(), args=config(tmp_path, max_steps=1), peft_config=prompt, train_dataset=lm_data(8),
        )
        trainer.train()
    assert trainer.evon_optimizer is not None and trainer.current_posterior() is None
    for call in (lambda: trainer.predict(lm_data(4), bma=True), lambda: trainer.evaluate(lm_data(4), bma=True)):
        with pytest.raises(ValueError, match=r"needs a posterior: EVON trains none of the model's parameters"):
            call()
    with caplog.at_level("WARNING", logger="hf_evon"):
        metrics = trainer.evaluate(lm_data(4))
    assert "eval_mean_nll" in metrics and not any(k.startswith("eval_bma_") for k in metrics)
    assert "EVONTrainer: EVON trains none of the model's parameters" in caplog.text


def test_a_run_whose_evon_matrices_are_all_frozen_and_never_updated_saves_without_a_posterior(tmp_path):
    """Every EVON matrix frozen after the optimizer was built (a phase that trains only AdamW's tensors):
    each is a point estimate, so ``EVONPosterior.from_optimizer`` has nothing to cover, and
    ``current_posterior()`` and ``save_model`` raised its ValueError ("no EVON-owned parameters that are
    trainable or were updated") where the trainer checked only that EVON has parameters. It saves the
    model without a posterior."""
    trainer = EVONTrainer(model=tiny_bert(), args=config(tmp_path, max_steps=2), train_dataset=classification_data())
    trainer.create_optimizer()
    evon = [p for g in trainer.evon_optimizer.param_groups if g["algorithm"] == "evon" for p in g["params"]]
    assert evon and all(p.requires_grad for p in evon)
    for p in evon:
        p.requires_grad_(False)
    trainer.train()
    assert trainer.current_posterior() is None
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "model.safetensors").is_file()
    assert not (tmp_path / "saved" / POSTERIOR_CONFIG_NAME).exists()
    assert not (tmp_path / "saved" / POSTERIOR_WEIGHTS_NAME).exists()
    # BMA asks for a posterior: the refusal says why there is none (not "train with EVON first")
    with pytest.raises(ValueError, match="every matrix EVON owns is frozen and EVON never updated one"):
        trainer.predict(classification_data(4), bma=True)


def test_save_model_after_merge_and_unload_refuses_before_writing_and_names_the_merge(tmp_path):
    """``trainer.model.merge_and_unload()`` removes the adapter's tensors the posterior covers. Saving
    then wrote PEFT's adapter of no tensors over the saved one and only then raised, beside the old
    posterior, with "pass the model the optimizer was built for" (the trainer's own model); the
    refusal now comes before anything is written and names the merge."""
    from hf_evon.posterior.json_rules import PosteriorMismatchError

    trainer = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path, max_steps=2), peft_config=_lora_config(),
        train_dataset=classification_data(16),
    )  # fmt: skip
    trainer.train()
    trainer.save_model()
    out = Path(trainer.args.output_dir)
    saved = directory_state(out)
    assert "adapter_model.safetensors" in saved and POSTERIOR_WEIGHTS_NAME in saved
    trainer.model.merge_and_unload()
    lora_a = "base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.default"
    for call in (trainer.save_model, trainer.current_posterior):
        with pytest.raises(PosteriorMismatchError, match=rf"{lora_a}.*merge_and_unload\(\)"):
            call()
    assert directory_state(out) == saved


def test_adaloras_rank_allocation_runs_at_every_optimizer_step(tmp_path):
    """AdaLoRA allocates its rank budget only where ``update_and_allocate(global_step)`` is called after
    each optimizer step (PEFT's docs: in the training loop); ``Trainer`` never calls it, so an AdaLoRA
    adapter trained by EVONTrainer kept every rank (no rank_pattern, no pruned singular value). It is
    now called once per optimizer step (gradient accumulation: not per micro-batch) with the step's
    index, and the final allocation leaves exactly the budget (target_r per layer) of ranks."""
    from peft import AdaLoraConfig

    adalora = AdaLoraConfig(
        init_r=4, target_r=1, target_modules=["c_attn"], fan_in_fan_out=True, total_step=4, tinit=0, tfinal=1, deltaT=1
    )
    args = config(tmp_path, max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    trainer = EVONTrainer(model=tiny_gpt2(), args=args, peft_config=adalora, train_dataset=lm_data())
    adalora_model, steps = trainer.model.base_model, []
    allocate = adalora_model.update_and_allocate

    def recorded(global_step: int) -> None:
        steps.append(global_step)
        allocate(global_step)

    adalora_model.update_and_allocate = recorded
    trainer.train()
    assert steps == [0, 1, 2, 3]
    pattern = trainer.model.peft_config["default"].rank_pattern
    assert pattern is not None and sum(sum(kept) for kept in pattern.values()) == 2  # target_r for 2 layers
    params = dict(trainer.model.get_base_model().named_parameters())
    for name, kept in pattern.items():
        assert torch.equal(params[name].detach().flatten() == 0, ~torch.tensor(kept)), name

    from hf_evon.trainer import AdaLoraRankAllocation

    own = AdaLoraRankAllocation()  # the user's own: not a second one, which would allocate twice a step
    trainer = EVONTrainer(model=trainer.model, args=args, train_dataset=lm_data(), callbacks=[own])
    assert [c for c in trainer.callback_handler.callbacks if isinstance(c, AdaLoraRankAllocation)] == [own]



def test_adaloras_pruned_ranks_stay_zero_in_every_training_sample(tmp_path):
    """AdaLoRA prunes a rank by writing 0 into its singular value (``lora_E``); the training samples
    (``sampled_params(train=True)`` in ``training_step``) put noise of the posterior's std there, so every
    training forward after a pruning ran with the pruned ranks back on. Every training forward past the
    final allocation now sees the pruned entries at exactly 0, as posterior samples keep them."""
    from peft import AdaLoraConfig
    from peft.tuners.adalora import AdaLoraLayer

    adalora = AdaLoraConfig(
        init_r=4, target_r=1, target_modules=["c_attn"], fan_in_fan_out=True, total_step=4, tinit=0, tfinal=1, deltaT=1
    )
    args = config(tmp_path, max_steps=6, per_device_train_batch_size=4)
    trainer = EVONTrainer(model=tiny_gpt2(), args=args, peft_config=adalora, train_dataset=lm_data())
    layers = {n: m for n, m in trainer.model.get_base_model().named_modules() if isinstance(m, AdaLoraLayer)}
    seen: list[tuple[int, str, torch.Tensor]] = []

    def record(module: torch.nn.Module, args: tuple) -> None:
        if trainer.evon_optimizer.in_sample and module.training:
            name = next(n for n, m in layers.items() if m is module)
            seen.append((trainer.state.global_step, name, module.lora_E["default"].detach().clone()))

    for layer in layers.values():
        layer.register_forward_pre_hook(record)
    trainer.train()
    pattern = trainer.model.peft_config["default"].rank_pattern
    pruned = {n: ~torch.tensor(pattern[f"{n}.lora_E.default"]) for n in layers}
    assert all(m.any() for m in pruned.values())
    late = [(name, value) for step, name, value in seen if step >= 4]  # past the final allocation (step 3)
    assert len(late) == 2 * len(layers)  # steps 4 and 5, one sample each
    assert all(value.flatten()[pruned[name]].eq(0).all() for name, value in late), late
    assert all(value.flatten()[~pruned[name]].ne(0).all() for name, value in late)



def test_the_logged_posterior_std_mean_counts_adaloras_pruned_ranks_as_no_spread(tmp_path):
    """``evon/posterior_std_mean`` averaged the posterior's std (about 1 at this ess) over AdaLoRA's pruned
    singular values too, which every sample keeps at 0; they now count as std 0, as ``std()`` reports
    them: the mean over every EVON-owned entry of the optimizer's ``posterior_std``, 0 where pruned."""
    from peft import AdaLoraConfig

    adalora = AdaLoraConfig(
        init_r=4, target_r=1, target_modules=["c_attn"], fan_in_fan_out=True, total_step=4, tinit=0, tfinal=1, deltaT=1
    )
    args = config(tmp_path, max_steps=4, per_device_train_batch_size=4)
    trainer = EVONTrainer(model=tiny_gpt2(), args=args, peft_config=adalora, train_dataset=lm_data())
    trainer.train()
    opt = trainer.evon_optimizer
    owned = [p for b in opt.buckets for p in b.params]
    lora_e = {id(p) for n, p in trainer.model.named_parameters() if ".lora_E." in n}
    assert any(bool((p == 0).any()) for p in owned if id(p) in lora_e)
    stds = [opt.posterior_std(p).masked_fill((p == 0) & (id(p) in lora_e), 0).double() for p in owned]
    expected = float(sum(s.sum() for s in stds)) / sum(s.numel() for s in stds)
    logged = trainer.posterior_statistics()["evon/posterior_std_mean"]
    assert logged == pytest.approx(expected, rel=1e-6)



def test_an_adalora_adapter_saved_by_the_trainer_reloads_with_its_posterior(tmp_path):
    """PEFT saves an AdaLoRA adapter with a rank_pattern at its kept ranks only, where the posterior covers
    every rank: ``save_model()`` wrote an adapter and a posterior that did not fit together (the posterior's
    save warned, and ``from_pretrained(dir, model=PeftModel.from_pretrained(...))`` raised). The trainer now
    saves every rank (the pruned ones as AdaLoRA's zeros), the reloaded pair samples as the trained model
    does, bit for bit, and the live model keeps its rank_pattern for the rest of training."""
    from peft import AdaLoraConfig, PeftModel

    adalora = AdaLoraConfig(
        init_r=4, target_r=1, target_modules=["c_attn"], fan_in_fan_out=True, total_step=4, tinit=0, tfinal=1, deltaT=1
    )
    args = config(tmp_path, max_steps=4, per_device_train_batch_size=4)
    trainer = EVONTrainer(model=tiny_gpt2(), args=args, peft_config=adalora, train_dataset=lm_data())
    trainer.train()
    pattern = dict(trainer.model.peft_config["default"].rank_pattern)
    assert sum(sum(kept) for kept in pattern.values()) == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.save_model()
    out = trainer.args.output_dir
    reloaded = PeftModel.from_pretrained(tiny_gpt2(), out)
    loaded = EVONPosterior.from_pretrained(out, model=reloaded)
    posterior = trainer.current_posterior()
    ours, theirs = dict(trainer.model.named_parameters()), dict(reloaded.named_parameters())
    with posterior.sampled(trainer.model, seed=3):
        expected = {n: ours[n].detach().clone() for n in posterior.names}
    with loaded.sampled(reloaded, seed=3):
        assert all(torch.equal(theirs[n].detach(), expected[n]) for n in posterior.names)
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []
    assert trainer.model.peft_config["default"].rank_pattern == pattern



def _peft_kind(kind: str):
    """A PEFT config of ``kind`` and its base: GPT-2 (Conv1D layers) where PEFT supports them, else BERT."""
    import peft

    if kind in ("rslora", "pissa"):
        extra = {"use_rslora": True} if kind == "rslora" else {"init_lora_weights": "pissa"}
        return tiny_gpt2, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, **extra)
    bert, modules = (lambda: tiny_bert(seed=1)), ["query", "value"]
    return bert, {
        "olora": peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=modules, init_lora_weights="olora"),
        "oft": peft.OFTConfig(task_type="SEQ_CLS", r=0, oft_block_size=4, target_modules=modules),
        "boft": peft.BOFTConfig(task_type="SEQ_CLS", boft_block_size=4, target_modules=modules),
        "vera": peft.VeraConfig(task_type="SEQ_CLS", r=4, target_modules=modules),
    }[kind]


@pytest.mark.filterwarnings("ignore:Failed to load the CUDA extension", "ignore:Setting boft_n_butterfly_factor")
@pytest.mark.parametrize("kind", ["rslora", "pissa", "olora", "oft", "boft", "vera"])
def test_each_peft_adapter_kind_saved_by_the_trainer_reloads_with_its_posterior_and_its_bma(tmp_path, kind):
    """VeRA, OFT, BOFT and LoRA with rsLoRA's scaling or PiSSA's/OLoRA's initialisation (which rewrite
    the base weights; PEFT's ``from_pretrained`` rewrites the reloaded base the same way): the posterior
    covers every matrix the adapter trains (the documented split: tensors of two or more dimensions to
    EVON; VeRA's vectors to AdamW), and the saved adapter and posterior, reloaded as the card's snippet
    does, sample and evaluate as the trained model. BOFT's rotations [1, blocks, b, b] were taken for a
    table broadcast over the batch and went to AdamW: its posterior covered only the scales."""
    from peft import PeftModel

    base, peft_config = _peft_kind(kind)
    lm = base is tiny_gpt2
    train, evaluation = (lm_data(), lm_data(8, seed=1)) if lm else (classification_data(), classification_data(24, 1))
    args = config(tmp_path, max_steps=2, bma_seed=2)
    trainer = EVONTrainer(model=base(), args=args, peft_config=peft_config, train_dataset=train, eval_dataset=evaluation)
    trainer.train()
    trained = trainer.evaluate()
    posterior = trainer.current_posterior()
    matrices = [n for n, p in trainer.model.named_parameters() if p.requires_grad and p.ndim >= 2]
    assert posterior.names == matrices
    health = trainer.optimizer.posterior_health(warn=False)
    assert health and all(math.isfinite(v) for v in health.values())
    trainer.save_model()
    out = trainer.args.output_dir
    reloaded = PeftModel.from_pretrained(base(), out)
    loaded = EVONPosterior.from_pretrained(out, model=reloaded)
    assert loaded.names == posterior.names
    ours, theirs = dict(trainer.model.named_parameters()), dict(reloaded.named_parameters())
    assert all(torch.equal(theirs[n].detach(), p.detach()) for n, p in ours.items()), "the reloaded model"
    with posterior.sampled(trainer.model, seed=3):
        expected = {n: ours[n].detach().clone() for n in posterior.names}
    with loaded.sampled(reloaded, seed=3):
        assert all(torch.equal(theirs[n].detach(), expected[n]) for n in posterior.names)
    again = EVONTrainer(model=reloaded, args=config(tmp_path / "again", bma_seed=2), posterior=loaded,
                        eval_dataset=evaluation).evaluate()  # fmt: skip
    bma = [k for k in trained if k.startswith("eval_bma_")]
    assert bma and torch.allclose(torch.tensor([again[k] for k in bma]), torch.tensor([trained[k] for k in bma]))
    assert again["eval_mean_nll"] == pytest.approx(trained["eval_mean_nll"], rel=1e-6)


def test_a_vera_classifier_run_says_its_posterior_misses_the_adapter_and_the_patterns_that_cover_it(tmp_path):
    """VeRA's vectors go to AdamW by the split, so a VeRA classifier's posterior covered only its head's
    copy and the run said nothing. The trainer warns once, naming VERA and the evon_patterns to use;
    trained with those, the posterior covers the vectors and nothing is warned."""
    base, peft_config = _peft_kind("vera")
    with pytest.warns(UserWarning, match="VERA adapter 'default'") as record:
        trainer = EVONTrainer(model=base(), args=config(tmp_path / "a", max_steps=1), peft_config=peft_config,
                              train_dataset=classification_data())  # fmt: skip
        trainer.train()
    assert len([w for w in record if "evon_patterns=['vera_lambda_b', 'vera_lambda_d']" in str(w.message)]) == 1
    assert trainer.current_posterior().names == ["base_model.model.classifier.modules_to_save.default.weight"]
    args = config(tmp_path / "b", max_steps=1, evon_patterns=["vera_lambda_b", "vera_lambda_d"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*adapter 'default'")
        trainer = EVONTrainer(model=base(), args=args, peft_config=_peft_kind("vera")[1],
                              train_dataset=classification_data())  # fmt: skip
        trainer.train()
    vectors = [n for n, p in trainer.model.named_parameters() if p.requires_grad and ".vera_lambda_" in n]
    assert len(vectors) == 4 * trainer.model.config.num_hidden_layers  # two vectors in query and in value
    assert set(vectors) < set(trainer.current_posterior().names)


def _adalora_config():  # noqa: ANN202
    from peft import AdaLoraConfig

    return AdaLoraConfig(
        init_r=4, target_r=1, target_modules=["c_attn"], fan_in_fan_out=True, total_step=6, tinit=0, tfinal=2, deltaT=1,
    )  # fmt: skip


def _adalora_resumed(tmp_path: Path, step: int) -> tuple[EVONTrainer, EVONTrainer]:
    """A whole 6-step AdaLoRA run saving at ``step``, and a run resumed from that checkpoint."""
    common = dict(max_steps=6, per_device_train_batch_size=4, save_strategy="steps", save_steps=step, evon_ess=300.0)
    runs = []
    for name in ("full", "res"):
        runs.append(EVONTrainer(model=tiny_gpt2(), args=config(tmp_path / name, **common), peft_config=_adalora_config(),
                                train_dataset=lm_data()))  # fmt: skip
    runs[0].train()
    runs[1].train(resume_from_checkpoint=str(tmp_path / "full" / "out" / f"checkpoint-{step}"))
    return runs[0], runs[1]


def _assert_rank_pattern_is_the_zeros(model: torch.nn.Module) -> None:
    """The adapter's rank_pattern keeps exactly the ranks whose singular value (lora_E) is not 0."""
    pattern = model.peft_config["default"].rank_pattern
    singular = {n.removeprefix("base_model.model."): p for n, p in model.named_parameters() if "lora_E" in n}
    assert pattern.keys() == singular.keys()
    for key, p in singular.items():
        assert torch.equal(p.detach().view(-1) != 0, torch.tensor(pattern[key])), key


def test_an_adalora_run_resumed_after_its_final_allocation_ends_as_the_whole_run(tmp_path):
    """Past AdaLoRA's final allocation, ``update_and_allocate`` masks with the config's rank_pattern, which
    a checkpoint's adapter (saved with every rank, the pruned ones as zeros) does not carry: a run resumed
    there crashed at its first step (``mask_using_rank_pattern(model, None)``: AttributeError). The
    pattern is now read back from the zeros, and the resumed run ends exactly as the whole run does."""
    full, resumed = _adalora_resumed(tmp_path, 5)
    pattern = full.model.peft_config["default"].rank_pattern
    assert resumed.model.peft_config["default"].rank_pattern == pattern
    pa, pb = params(full.model), params(resumed.model)
    assert [n for n in pa if not torch.equal(pa[n], pb[n])] == []


def test_an_adalora_run_resumed_at_its_final_allocation_allocates_its_budget(tmp_path):
    """Resumed from the checkpoint of step total_step − tfinal (4 here), the first step is AdaLoRA's final
    allocation, which reads the importance averages no file keeps: PEFT raised a KeyError there. They start
    afresh from that step's gradients, as a run resumed earlier has them: the run ends with the full run's
    budget of ranks (target_r per adapted matrix), the pruned ones 0."""
    full, resumed = _adalora_resumed(tmp_path, 4)
    kept = [run.model.peft_config["default"].rank_pattern for run in (resumed, full)]
    budget = _adalora_config().target_r * len(kept[1])
    assert kept[0].keys() == kept[1].keys() and [sum(sum(v) for v in k.values()) for k in kept] == [budget, budget]
    _assert_rank_pattern_is_the_zeros(resumed.model)


def test_load_best_model_at_end_loads_an_adalora_checkpoint(tmp_path):
    """An AdaLoRA checkpoint holds every rank (the pruned ones as zeros), and PEFT's load shrank the modules
    to the config's rank_pattern first: load_best_model_at_end raised a size mismatch at the end of
    train(). The best checkpoint's adapter is loaded, and the pattern is its kept ranks."""
    from safetensors.torch import load_file

    common = dict(max_steps=6, per_device_train_batch_size=4, save_strategy="steps", save_steps=3, eval_strategy="steps",
                  eval_steps=3, load_best_model_at_end=True, metric_for_best_model="loss", evon_ess=300.0, bma_num_samples=0)
    trainer = EVONTrainer(model=tiny_gpt2(), args=config(tmp_path, **common), peft_config=_adalora_config(),
                          train_dataset=lm_data(), eval_dataset=lm_data(8, seed=1))  # fmt: skip
    trainer.train()
    best = load_file(os.path.join(trainer.state.best_model_checkpoint, "adapter_model.safetensors"))
    loaded = {n.replace(".default", ""): p for n, p in params(trainer.model).items()}  # the file's names
    assert best and all(torch.equal(loaded[k], v) for k, v in best.items())
    _assert_rank_pattern_is_the_zeros(trainer.model)


# ---------------------------------------------------------------------------- fresh process
RELOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForSequenceClassification
    from peft import PeftModel
    from hf_evon import EVONConfig, EVONTrainer, EVONPosterior

    torch.set_num_threads(1)
    full_dir, lora_dir, base_dir, data_dir, work, samples, seed = sys.argv[1:8]
    data = load_from_disk(data_dir)
    out = {}
    for name, directory in (("full", full_dir), ("lora", lora_dir)):
        if name == "full":
            model = AutoModelForSequenceClassification.from_pretrained(directory)
        else:
            base = AutoModelForSequenceClassification.from_pretrained(base_dir)
            model = PeftModel.from_pretrained(base, directory)
        posterior = EVONPosterior.from_pretrained(directory, model=model)
        args = EVONConfig(output_dir=work + "/" + name, report_to="none", use_cpu=True, per_device_eval_batch_size=16,
                          bma_num_samples=int(samples), bma_seed=int(seed), disable_tqdm=True)
        trainer = EVONTrainer(model=model, args=args, posterior=posterior, eval_dataset=data)
        out[name] = trainer.evaluate()
    print("RESULT" + json.dumps(out))
    """
)


def test_saved_output_reloads_in_a_fresh_process_and_reproduces_bma(tmp_path):
    evaluation = classification_data(24, seed=1)
    evaluation.save_to_disk(str(tmp_path / "data"))
    results = {}
    # full fine-tuning
    full = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path / "full", max_steps=3, evon_ess=80.0, bma_num_samples=3, bma_seed=2),
        train_dataset=classification_data(), eval_dataset=evaluation,
    )  # fmt: skip
    full.train()
    results["full"] = full.evaluate()
    full.save_model()
    # LoRA
    base = tiny_bert(seed=1)
    base.save_pretrained(str(tmp_path / "base"))
    lora = EVONTrainer(
        model=base, args=config(tmp_path / "lora", max_steps=3, evon_ess=80.0, bma_num_samples=3, bma_seed=2),
        peft_config=_lora_config(), train_dataset=classification_data(), eval_dataset=evaluation,
    )  # fmt: skip
    lora.train()
    results["lora"] = lora.evaluate()
    lora.save_model()
    card = (Path(full.args.output_dir) / "README.md").read_text()
    assert "hf-evon:start" in card
    assert "### Evaluation" in card  # the last evaluation's mean/BMA table
    proc = subprocess.run(
        [sys.executable, "-c", RELOAD_SCRIPT, full.args.output_dir, lora.args.output_dir, str(tmp_path / "base"),
         str(tmp_path / "data"), str(tmp_path / "work"), "3", "2"],
        capture_output=True, text=True, timeout=300, cwd=str(REPO_ROOT),
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = json.loads(proc.stdout.split("RESULT", 1)[1])
    for name in ("full", "lora"):
        for key in ("nll", "accuracy", "ece", "brier"):
            mine, theirs = results[name][f"eval_bma_{key}"], fresh[name][f"eval_bma_{key}"]
            assert theirs == pytest.approx(mine, rel=1e-5, abs=1e-7), (name, key)
        assert fresh[name]["eval_mean_nll"] == pytest.approx(results[name]["eval_mean_nll"], rel=1e-5)


# ---------------------------------------------------------------------------- hub
@pytest.fixture
def hub_api(monkeypatch):
    """The local Hub stand-in and a client of it, through which the Trainer's uploads go."""
    from huggingface_hub import HfApi

    try:
        from hub_stub import HubStub
    except ImportError:
        from tests.hub_stub import HubStub
    import transformers.trainer as trainer_module

    with HubStub() as hub:
        api = HfApi(endpoint=hub.endpoint, token="hf_dummy")
        monkeypatch.setattr(trainer_module, "hf_api", lambda: api)
        yield hub, api


def test_push_to_hub_uploads_model_posterior_and_card(tmp_path, hub_api):
    hub, api = hub_api
    args = config(
        tmp_path, max_steps=2, hub_model_id="user/evon-tiny", hub_token="hf_dummy", save_strategy="steps",
        save_steps=1, push_to_hub=True, hub_strategy="every_save",
    )  # fmt: skip
    trainer = EVONTrainer(
        model=tiny_bert(),
        args=args,
        train_dataset=classification_data(16),
        eval_dataset=classification_data(16, 1),
    )
    trainer.train()
    # the checkpoint pushes copy the posterior into the output dir before uploading it
    trainer._finish_current_push()
    files = hub.files("user/evon-tiny")
    assert {POSTERIOR_WEIGHTS_NAME, POSTERIOR_CONFIG_NAME, "model.safetensors"} <= set(files)
    trainer.evaluate()
    trainer.push_to_hub()
    files = hub.files("user/evon-tiny")
    assert {POSTERIOR_WEIGHTS_NAME, POSTERIOR_CONFIG_NAME, "model.safetensors", "README.md"} <= set(files)
    readme = files["README.md"].decode()
    assert "hf-evon:start" in readme and "### Evaluation" in readme
    loaded = EVONPosterior.from_pretrained(
        "user/evon-tiny", endpoint=hub.endpoint, token="hf_dummy", cache_dir=tmp_path / "cache"
    )
    local = EVONPosterior.from_pretrained(trainer.args.output_dir)
    ta, tb = loaded.to_tensors(), local.to_tensors()
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    final = trainer.current_posterior().to_tensors()
    assert ta.keys() == final.keys() and all(torch.equal(ta[k], final[k]) for k in ta)



def test_a_checkpoint_push_of_a_named_peft_adapter_carries_the_adapter_its_posterior_covers(tmp_path, hub_api):
    """PEFT saves an adapter not named "default" in ``checkpoint-N/<name>/``, and the Trainer's checkpoint
    push copies the checkpoint's root files alone: the repo got the posterior (of ``lora_A.sst2``) and
    no adapter, so the card's snippet failed (and a repo that held an older run's adapter paired it with
    the new posterior). The adapter's folder travels with its posterior, and the pushed adapter is the
    checkpoint's, bit for bit."""
    from peft import LoraConfig, get_peft_model

    hub, _ = hub_api
    model = get_peft_model(
        tiny_bert(), LoraConfig(r=2, target_modules=["query", "value"], task_type="SEQ_CLS"), adapter_name="sst2"
    )
    args = config(
        tmp_path, max_steps=2, hub_model_id="user/lora-named", hub_token="hf_dummy", save_strategy="steps",
        save_steps=1, push_to_hub=True, hub_strategy="every_save",
    )  # fmt: skip
    trainer = EVONTrainer(model=model, args=args, train_dataset=classification_data(16))
    trainer.train()
    trainer._finish_current_push()
    files = hub.files("user/lora-named")
    assert {POSTERIOR_WEIGHTS_NAME, POSTERIOR_CONFIG_NAME, "sst2/adapter_config.json"} <= set(files), sorted(files)
    pushed = next(f for f in files if f.startswith("sst2/adapter_model"))
    # the checkpoint whose posterior was pushed (a push still uploading skips the next checkpoint's)
    out = Path(trainer.args.output_dir)
    source = [c for c in ("checkpoint-1", "checkpoint-2") if (out / c / POSTERIOR_WEIGHTS_NAME).read_bytes() == files[POSTERIOR_WEIGHTS_NAME]]
    assert len(source) == 1 and files[pushed] == (out / source[0] / pushed).read_bytes()


class _FirstPosteriorDropped(TrainerCallback):
    """Removes checkpoint-1's posterior once it is saved (and pushed): the best checkpoint holds none."""

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if state.global_step == 1:
            for f in (Path(args.output_dir) / "checkpoint-1").glob("evon_posterior*"):
                f.unlink()


def test_push_to_hub_of_a_model_without_a_posterior_deletes_the_repos_older_posterior(tmp_path, hub_api):
    """``load_best_model_at_end`` with ``hub_strategy="every_save"`` and a best checkpoint without a
    posterior: ``push_to_hub()`` uploaded the best model beside step 2's posterior (left in the output
    directory by step 2's push, and on the Hub since then). The push deletes the repo's posterior files
    in the commit that uploads the model."""
    from safetensors.torch import load, load_file

    hub, api = hub_api
    args = config(
        tmp_path, max_steps=2, hub_model_id="user/evon-best", hub_token="hf_dummy", save_strategy="steps",
        save_steps=1, eval_strategy="steps", eval_steps=1, load_best_model_at_end=True, push_to_hub=True,
        metric_for_best_model="eval_step", greater_is_better=False, hub_strategy="every_save",
        hub_always_push=True, bma_num_samples=2,
    )  # fmt: skip
    trainer = EVONTrainer(
        model=tiny_bert(), args=args, train_dataset=classification_data(16),
        eval_dataset=classification_data(16, 1), callbacks=[_FirstPosteriorDropped()],
        compute_metrics=lambda _: {"step": trainer.state.global_step},
    )  # fmt: skip
    with pytest.warns(UserWarning, match="holds no posterior"):
        trainer.train()
    trainer._finish_current_push()
    out = Path(trainer.args.output_dir)
    assert trainer.state.best_global_step == 1
    files = hub.files("user/evon-best")
    assert files[POSTERIOR_WEIGHTS_NAME] == (out / "checkpoint-2" / POSTERIOR_WEIGHTS_NAME).read_bytes()
    commits = len(hub.commits("user/evon-best"))
    with pytest.warns(UserWarning, match=rf"{POSTERIOR_CONFIG_NAME}, {POSTERIOR_WEIGHTS_NAME}\)"):
        trainer.push_to_hub()
    files = hub.files("user/evon-best")
    assert len(hub.commits("user/evon-best")) == commits + 1  # one commit: the model and the deletion
    assert not [name for name in files if name.startswith("evon_posterior")]
    model, best = load(files["model.safetensors"]), load_file(out / "checkpoint-1" / "model.safetensors")
    assert model.keys() == best.keys() and all(torch.equal(model[k], best[k]) for k in best)
    assert "hf-evon:start" not in files["README.md"].decode()


@pytest.mark.parametrize("how", ["hub_revision", "push_to_hub(revision=)", "push_to_hub=False"])
def test_a_push_to_a_branch_writes_a_card_that_loads_from_the_branch(tmp_path, hub_api, how):
    """``push_to_hub`` to a branch (``hub_revision``, or its ``revision=`` argument) put a card on
    the branch whose snippet loaded the posterior from the default branch (none there, or another).
    ``trainer.push_to_hub()`` without ``args.push_to_hub`` pushed a card whose snippet loaded the
    model and the posterior from the output directory's local path."""
    import ast

    from huggingface_hub import ModelCard

    hub, api = hub_api
    api.create_repo("user/evon-branch")
    api.create_branch("user/evon-branch", branch="v2")  # the Trainer pushes to an existing branch
    revision = {"hub_revision": "v2"} if how == "hub_revision" else {}
    args = config(
        tmp_path, max_steps=1, hub_model_id="user/evon-branch", hub_token="hf_dummy",
        push_to_hub=how != "push_to_hub=False", save_strategy="no", **revision,
    )  # fmt: skip
    trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data(8))
    trainer.train()
    trainer.push_to_hub(**({} if revision else {"revision": "v2"}))
    assert POSTERIOR_CONFIG_NAME not in hub.files("user/evon-branch")
    card = ModelCard(hub.files("user/evon-branch", "v2")["README.md"].decode()).text
    code = card.split("```python\n", 1)[1].split("```")[0]
    line = next(line for line in code.splitlines() if line.startswith("posterior = EVONPosterior.from_pretrained("))
    call = ast.parse(line).body[0].value
    assert [ast.literal_eval(a) for a in call.args] == ["user/evon-branch"]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert kwargs == {"revision": "v2"}
    loaded = EVONPosterior.from_pretrained(
        "user/evon-branch", **kwargs, endpoint=hub.endpoint, token="hf_dummy", cache_dir=tmp_path / "cache"
    )
    assert _tensors_equal(loaded.to_tensors(), trainer.current_posterior().to_tensors())


@pytest.mark.parametrize("strategy", ["checkpoint", "all_checkpoints"])
def test_a_checkpoint_folder_pushed_to_a_subfolder_has_a_card_that_loads_that_checkpoint(tmp_path, monkeypatch, hub_api, strategy):
    """``hub_strategy="checkpoint"`` / ``"all_checkpoints"`` push each checkpoint folder, card included,
    to ``last-checkpoint/`` / ``checkpoint-N/``. That card's snippet loaded the model and the posterior
    from the repo's root (``from_pretrained("user/evon-ckpt")``): the newest pushed step's, not the
    checkpoint's the card describes (its steps and evaluation)."""
    import ast

    from huggingface_hub import ModelCard
    from safetensors.torch import load_file

    hub, api = hub_api
    args = config(
        tmp_path, max_steps=2, hub_model_id="user/evon-ckpt", hub_token="hf_dummy", save_strategy="steps",
        save_steps=1, push_to_hub=True, hub_strategy=strategy,
    )  # fmt: skip
    trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data(16))
    push = trainer._push_from_checkpoint

    def push_and_wait(checkpoint_folder):  # noqa: ANN001, ANN202
        push(checkpoint_folder)  # every checkpoint is pushed: none is skipped for a push in flight
        trainer._finish_current_push()

    monkeypatch.setattr(trainer, "_push_from_checkpoint", push_and_wait)
    trainer.train()
    folder = "last-checkpoint" if strategy == "checkpoint" else "checkpoint-1"
    step = 2 if strategy == "checkpoint" else 1
    card = ModelCard(hub.files("user/evon-ckpt")[f"{folder}/README.md"].decode()).text
    code = card.split("```python\n", 1)[1].split("```")[0]
    calls = {}
    for prefix in ("model = AutoModelForSequenceClassification.from_pretrained(", "posterior = EVONPosterior.from_pretrained("):
        line = next(line for line in code.splitlines() if line.startswith(prefix))
        call = ast.parse(line).body[0].value
        calls[prefix.split(" ")[0]] = (
            [ast.literal_eval(a) for a in call.args], {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        )
    assert calls["model"] == (["user/evon-ckpt"], {"subfolder": folder})
    assert calls["posterior"] == (["user/evon-ckpt"], {"subfolder": folder})
    loaded = EVONPosterior.from_pretrained(
        *calls["posterior"][0], **calls["posterior"][1], endpoint=hub.endpoint, token="hf_dummy",
        cache_dir=tmp_path / "cache",
    )  # fmt: skip
    saved = load_file(tmp_path / "out" / f"checkpoint-{step}" / POSTERIOR_WEIGHTS_NAME)
    assert _tensors_equal(loaded.to_tensors(), saved)
    # the root's card, pushed beside the root's model, loads from the root
    root = ModelCard(hub.files("user/evon-ckpt")["README.md"].decode()).text
    assert 'EVONPosterior.from_pretrained("user/evon-ckpt")\n' in root


@pytest.mark.parametrize("private", [True, False])
def test_push_to_hub_takes_private_as_the_trainers_fifth_positional_argument(tmp_path, hub_api, private):
    """``Trainer.push_to_hub(commit_message, blocking, token, revision, private)``: the EVON override
    left ``private`` out, so a positional call raised TypeError (takes 5 positional arguments but 6
    were given)."""

    hub, api = hub_api
    # no args.push_to_hub: push_to_hub creates the repo, private as its argument says
    args = config(tmp_path, hub_model_id="user/evon-private", hub_token="hf_dummy", hub_private_repo=not private)
    trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data(8))
    trainer.push_to_hub("positional", True, None, None, private)
    assert hub.repos["user/evon-private"]["private"] is private
    assert "model.safetensors" in hub.files("user/evon-private")


def _tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("strategy", ["every_save", "end"])
def test_a_checkpoint_push_the_trainer_skips_leaves_the_posterior_beside_the_pushed_model(tmp_path, monkeypatch, strategy):
    """The Trainer skips checkpoint-2's push while checkpoint-1's still uploads (and every checkpoint
    push with ``hub_strategy="end"``): the output directory and the Hub keep checkpoint-1's model and
    its posterior (none at all with "end"), never checkpoint-2's posterior beside checkpoint-1's model."""
    import threading

    from huggingface_hub import HfApi
    from safetensors.torch import load, load_file

    try:
        from hub_stub import HubStub
    except ImportError:
        from tests.hub_stub import HubStub
    import transformers.trainer as trainer_module

    gate = threading.Event()  # checkpoint-1's upload runs once checkpoint-2 is saved (and its push decided)

    class GatedApi(HfApi):
        def upload_folder(self, *args, run_as_future=False, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if run_as_future:
                return self.run_as_future(lambda: gate.wait(60) and HfApi.upload_folder(self, *args, **kwargs))
            return super().upload_folder(*args, **kwargs)

    class OpenAtStep2(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            if state.global_step == 2:
                gate.set()

    with HubStub() as hub:
        api = GatedApi(endpoint=hub.endpoint, token="hf_dummy")
        monkeypatch.setattr(trainer_module, "hf_api", lambda: api)
        args = config(
            tmp_path, max_steps=2, hub_model_id="user/evon-tiny", hub_token="hf_dummy", save_strategy="steps",
            save_steps=1, push_to_hub=True, hub_strategy=strategy,
        )  # fmt: skip
        trainer = EVONTrainer(
            model=tiny_bert(), args=args, train_dataset=classification_data(16), callbacks=[OpenAtStep2()]
        )
        trainer.train()  # waits for the push in flight
        out = Path(trainer.args.output_dir)
        if strategy == "end":
            gate.set()
            assert sorted(p.name for p in out.iterdir() if not p.name.startswith("checkpoint-")) == []
            assert set(hub.files("user/evon-tiny")) == {".gitattributes"}
            return
        ckpt = [out / f"checkpoint-{step}" for step in (1, 2)]
        posteriors = [load_file(d / POSTERIOR_WEIGHTS_NAME) for d in ckpt]
        models = [load_file(d / "model.safetensors") for d in ckpt]
        assert not _tensors_equal(*posteriors) and not _tensors_equal(*models)
        assert _tensors_equal(load_file(out / "model.safetensors"), models[0])
        assert _tensors_equal(load_file(out / POSTERIOR_WEIGHTS_NAME), posteriors[0])
        files = hub.files("user/evon-tiny")
        assert _tensors_equal(load(files["model.safetensors"]), models[0])
        assert _tensors_equal(load(files[POSTERIOR_WEIGHTS_NAME]), posteriors[0])


class _FirstSaveKilledAfterTheSwitch(TrainerCallback):
    """Leaves every checkpoint's posterior as a first save killed after its config switch does:
    the config names the staged weights file, the canonical one was never written."""

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        config = json.loads((directory / "evon_posterior_config.json").read_text())
        staged = f"evon_posterior.{config['checkpoint_id']}.safetensors"
        os.rename(directory / "evon_posterior.safetensors", directory / staged)
        config["weights_file"] = staged
        (directory / "evon_posterior_config.json").write_text(json.dumps(config))


def test_a_compiled_models_checkpoints_hold_the_models_own_names_and_load_back(tmp_path):
    """A model passed already wrapped by ``torch.compile``: the Trainer wrote its weights under
    ``_orig_mod.`` names, which ``from_pretrained`` does not load, beside a posterior (and a card)
    under the model's own names; the best checkpoint's weights, and a resume's, must load back into
    the compiled model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    args = config(
        tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        load_best_model_at_end=True, metric_for_best_model="eval_mean_accuracy", remove_unused_columns=False,
        bma_num_samples=2, evon_ess=100.0,
    )  # fmt: skip
    compiled = torch.compile(tiny_bert(), backend="eager")
    trainer = EVONTrainer(
        model=compiled, args=args, train_dataset=classification_data(), eval_dataset=classification_data(16, 1)
    )
    trainer.train()
    plain_names = set(tiny_bert().state_dict())
    best = Path(trainer.state.best_model_checkpoint)
    assert best.name == "checkpoint-2"  # an accuracy tied at step 4: the weights must come back from step 2
    for directory in (tmp_path / "out" / "checkpoint-2", tmp_path / "out" / "checkpoint-4"):
        assert set(load_file(directory / "model.safetensors")) == plain_names, directory
    # the best checkpoint's weights are the model's after training
    saved = load_file(best / "model.safetensors")
    assert all(torch.equal(v, saved[k]) for k, v in compiled._orig_mod.state_dict().items())
    trainer.save_model(str(tmp_path / "final"))
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "final")
    assert _tensors_equal(reloaded.state_dict(), compiled._orig_mod.state_dict())
    EVONPosterior.from_pretrained(tmp_path / "final").check_model(reloaded)
    # a resume from step 2 into another compiled model ends at step 4's saved weights
    again = torch.compile(tiny_bert(seed=1), backend="eager")
    resumed = EVONTrainer(
        model=again, args=dataclasses.replace(args, load_best_model_at_end=False, eval_strategy="no", save_strategy="no"),
        train_dataset=classification_data(),
    )  # fmt: skip
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    last = load_file(tmp_path / "out" / "checkpoint-4" / "model.safetensors")
    assert all(torch.equal(v, last[k]) for k, v in again._orig_mod.state_dict().items())


@pytest.mark.parametrize("killed_first_save", [False, True])
def test_load_best_model_at_end_restores_the_best_checkpoints_posterior(tmp_path, killed_first_save):
    """With ``killed_first_save`` every checkpoint's posterior loads from the staged file its
    config names: the best one's must still be restored (it was skipped for want of the
    canonical file, leaving the last step's posterior beside the best weights)."""
    args = config(
        tmp_path, max_steps=4, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        load_best_model_at_end=True, metric_for_best_model="eval_bma_nll", greater_is_better=False,
        bma_num_samples=2, evon_ess=100.0,
    )  # fmt: skip
    trainer = EVONTrainer(
        model=tiny_bert(),
        args=args,
        train_dataset=classification_data(),
        eval_dataset=classification_data(16, 1),
        callbacks=[_FirstSaveKilledAfterTheSwitch()] if killed_first_save else None,
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None
    best_config = EVONPosterior.from_pretrained(best).config
    assert trainer.posterior is not None and trainer.posterior.config["checkpoint_id"] == best_config["checkpoint_id"]
    restored = trainer.current_posterior().to_tensors()
    on_disk = EVONPosterior.from_pretrained(best).to_tensors()
    assert restored.keys() == on_disk.keys() and all(torch.equal(restored[k], on_disk[k]) for k in restored)
    last = EVONPosterior.from_optimizer(trainer.evon_optimizer, trainer.model).to_tensors()
    if not best.endswith("checkpoint-4"):
        assert not all(torch.equal(last[k], on_disk[k]) for k in last)
    trainer.save_model()
    saved = EVONPosterior.from_pretrained(trainer.args.output_dir).to_tensors()
    assert all(torch.equal(saved[k], on_disk[k]) for k in saved)


def test_on_train_end_callbacks_see_the_best_checkpoints_posterior_beside_its_weights(tmp_path):
    """The Trainer loads the best weights and then calls ``on_train_end``; the best posterior was
    loaded only after ``train()`` returned, so a callback evaluating or saving there paired the last
    step's posterior with the best step's weights (and saved it under their fingerprint)."""
    from transformers import TrainerCallback

    seen = {}

    class AtEnd(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            seen["posterior"] = trainer.current_posterior().to_tensors()

    args = config(
        tmp_path, max_steps=4, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=False,
        bma_num_samples=0, evon_ess=100.0,
    )  # fmt: skip
    trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data(),
                          eval_dataset=classification_data(16, 1), callbacks=[AtEnd()])  # fmt: skip
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and not best.endswith("checkpoint-4")  # the last step's posterior differs
    on_disk = EVONPosterior.from_pretrained(best).to_tensors()
    last = EVONPosterior.from_optimizer(trainer.evon_optimizer, trainer.model).to_tensors()
    assert not all(torch.equal(last[k], on_disk[k]) for k in last)
    assert seen["posterior"].keys() == on_disk.keys()
    assert all(torch.equal(seen["posterior"][k], on_disk[k]) for k in on_disk)


def test_load_best_model_at_end_loads_a_non_default_adapter_from_its_own_subfolder(tmp_path):
    """PEFT saves the adapter "default" at a checkpoint's root and any other in a subfolder of its name.
    With "other" active, the Trainer's load_best_model_at_end loaded the root's adapter ("default"'s
    untrained weights) into "other": the trained adapter was lost and the best checkpoint's posterior sat
    beside weights it was not taken at. The active adapter is the best checkpoint's, and its posterior fits."""
    from peft import get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file

    model = get_peft_model(tiny_bert(), _lora_config())
    model.add_adapter("other", _lora_config())
    model.set_adapter("other")
    args = config(
        tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        load_best_model_at_end=True, metric_for_best_model="eval_loss", bma_num_samples=2, evon_ess=100.0,
    )  # fmt: skip
    trainer = EVONTrainer(
        model=model, args=args, train_dataset=classification_data(), eval_dataset=classification_data(16, 1)
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    saved = load_file(os.path.join(best, "other", "adapter_model.safetensors"))
    root = load_file(os.path.join(best, "adapter_model.safetensors"))
    held = get_peft_model_state_dict(model, adapter_name="other")  # what PEFT saves of it, by its keys
    assert held.keys() == saved.keys() == root.keys()
    assert all(torch.equal(held[k], saved[k]) for k in saved)
    assert not all(torch.equal(saved[k], root[k]) for k in saved)  # the root's is another adapter's
    trained = [p for n, p in model.named_parameters() if ".other." in n]
    assert model.active_adapters == ["other"] and all(p.requires_grad for p in trained)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PosteriorMeanWarning)
        trainer.posterior.check_model(model)


def _two_active_adapters() -> torch.nn.Module:
    """A tiny BERT with two LoRA adapters, "default" and "other", both active and trainable."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0)  # no head copy
    model = get_peft_model(tiny_bert(), lora)
    model.add_adapter("other", lora)
    model.base_model.set_adapter(["default", "other"])
    return model


def _best_is_first_checkpoint(tmp_path: Path, model: torch.nn.Module, callbacks: list | None = None) -> EVONTrainer:
    """An EVONTrainer saving and evaluating every 2 of 4 steps whose metric makes checkpoint-2 the best."""
    args = config(
        tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        load_best_model_at_end=True, metric_for_best_model="eval_early", bma_num_samples=2, evon_ess=100.0,
    )  # fmt: skip
    trainer = EVONTrainer(
        model=model, args=args, train_dataset=classification_data(), eval_dataset=classification_data(16, 1),
        compute_metrics=lambda _: {"early": -trainer.state.global_step}, callbacks=callbacks,
    )  # fmt: skip
    return trainer


def test_load_best_model_at_end_loads_every_active_adapter_of_the_best_checkpoint(tmp_path):
    """Two PEFT adapters trained together (both active): the Trainer's load_best_model_at_end loads only
    the first active one, so "other" kept the last step's weights beside the best checkpoint's posterior.
    Every active adapter is the best checkpoint's."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    model = _two_active_adapters()
    trainer = _best_is_first_checkpoint(tmp_path, model)
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best.endswith("checkpoint-2")
    for adapter, folder in (("default", best), ("other", os.path.join(best, "other"))):
        saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
        held = get_peft_model_state_dict(model, adapter_name=adapter)
        assert held.keys() == saved.keys() and all(torch.equal(held[k], saved[k]) for k in saved), adapter
    with warnings.catch_warnings():
        warnings.simplefilter("error", PosteriorMeanWarning)
        trainer.posterior.check_model(model)


class _AdapterWeightsBroken(TrainerCallback):
    """Replaces the first checkpoint's weights of adapter "other" by a link to nothing or a directory."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if state.global_step == 2:
            weights = Path(args.output_dir) / "checkpoint-2" / "other" / "adapter_model.safetensors"
            weights.unlink()
            weights.symlink_to(weights.parent / "moved-away") if self.kind == "dangling link" else weights.mkdir()


@pytest.mark.parametrize("kind", ["dangling link", "directory"])
def test_load_best_model_at_end_refuses_an_adapters_weights_that_are_no_file_naming_them(tmp_path, kind):
    """The best checkpoint's weights of a second active adapter were a link to nothing or a directory:
    taken for no weights (os.path.isfile), that adapter was silently left at the last step's weights
    beside the best checkpoint's posterior. The load is refused naming the file, before anything loads."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    model = _two_active_adapters()
    trainer = _best_is_first_checkpoint(tmp_path, model, callbacks=[_AdapterWeightsBroken(kind)])
    args = trainer.args
    weights = os.path.join(args.output_dir, "checkpoint-2", "other", "adapter_model.safetensors")
    where = f"load_best_model_at_end: the weights of adapter 'other' in the best checkpoint, {weights!r},"
    if kind == "dangling link":
        expected = FileNotFoundError, f"{where} are a link to {os.path.join(os.path.dirname(weights), 'moved-away')!r}"
    else:
        expected = ValueError, f"{where} are not a regular file"
    with pytest.raises(expected[0]) as err:
        trainer.train()
    assert expected[1] in str(err.value), str(err.value)
    last = os.path.join(args.output_dir, "checkpoint-4")  # refused before any load: both are the last step's
    for adapter, folder in (("default", last), ("other", os.path.join(last, "other"))):
        saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
        held = get_peft_model_state_dict(model, adapter_name=adapter)
        assert held.keys() == saved.keys() and all(torch.equal(held[k], saved[k]) for k in saved), adapter


@pytest.mark.parametrize("kind", ["EACCES", "loop"])
def test_load_best_model_at_end_refuses_adapter_weights_it_cannot_look_up(tmp_path, monkeypatch, kind):
    """The best checkpoint's weights of a second active adapter that this user cannot look up (EACCES;
    simulated by os.lstat, the tests run as root) were taken for none (os.path.lexists): that adapter
    was silently left at the last step's weights. Weights that are a loop of links (ELOOP) were called
    'a link to ..., which does not exist'. Either is refused naming the file."""
    from types import SimpleNamespace

    from hf_evon.trainer.internals import _active_adapter_folders

    model = _two_active_adapters()
    best = tmp_path / "checkpoint-2"
    (best / "other").mkdir(parents=True)
    (best / "adapter_model.safetensors").write_bytes(b"")
    weights = best / "other" / "adapter_model.safetensors"
    trainer = SimpleNamespace(
        state=SimpleNamespace(best_model_checkpoint=str(best)), is_deepspeed_enabled=False, is_fsdp_enabled=False
    )
    if kind == "loop":
        weights.symlink_to(best / "other" / "back")
        (best / "other" / "back").symlink_to(weights)
        with pytest.raises(OSError) as err:
            _active_adapter_folders(trainer, model)
        assert str(err.value) == (
            f"load_best_model_at_end: the weights of adapter 'other' in the best checkpoint, {str(weights)!r}, are a "
            f"link to {str(best / 'other' / 'back')!r}, which leads into a loop of links (ELOOP)"
        ), str(err.value)
        return
    weights.write_bytes(b"")
    refuse_lookups(monkeypatch, lambda path: path == str(weights), ("lstat",))
    with pytest.raises(PermissionError) as err:
        _active_adapter_folders(trainer, model)
    assert err.value.filename == str(weights)


def test_the_card_after_load_best_model_at_end_reports_the_best_checkpoints_evaluation_and_step(tmp_path):
    """save_model() after load_best_model_at_end writes the best checkpoint's weights and posterior:
    its card reports that checkpoint's evaluation and step, not the last evaluation's."""
    from hf_evon.posterior.model_card import format_value

    args = config(
        tmp_path, max_steps=4, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        load_best_model_at_end=True, metric_for_best_model="eval_bma_nll", bma_num_samples=2, evon_ess=100.0,
        evon_learning_rate=0.2,
    )  # fmt: skip
    trainer = EVONTrainer(
        model=tiny_bert(), args=args, train_dataset=classification_data(), eval_dataset=classification_data(16, 1)
    )
    trainer.train()
    evals = {h["step"]: h for h in trainer.state.log_history if "eval_bma_nll" in h}
    best = min(evals, key=lambda step: evals[step]["eval_bma_nll"])
    assert best != 4 and trainer.state.best_global_step == best  # the best is not the last evaluation
    trainer.save_model()
    lines = (Path(trainer.args.output_dir) / "README.md").read_text().splitlines()
    nll = f"| nll | {format_value(evals[best]['eval_mean_nll'])} | {format_value(evals[best]['eval_bma_nll'])} |"
    assert nll in lines
    assert f"| optimizer steps taken (Trainer `global_step`) | {best} |" in lines


class _PosteriorDropped(TrainerCallback):
    """Removes each checkpoint's posterior files once it is saved (a checkpoint from elsewhere)."""

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        for f in (Path(args.output_dir) / f"checkpoint-{state.global_step}").glob("evon_posterior*"):
            f.unlink()


def test_a_best_checkpoint_without_a_posterior_leaves_none_beside_its_weights(tmp_path):
    # the last step's posterior was kept beside the best step's weights, and saved with them
    args = config(
        tmp_path, max_steps=4, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        load_best_model_at_end=True, metric_for_best_model="eval_loss", bma_num_samples=2, evon_ess=100.0,
    )  # fmt: skip
    trainer = EVONTrainer(
        model=tiny_bert(), args=args, train_dataset=classification_data(), eval_dataset=classification_data(16, 1),
        callbacks=[_PosteriorDropped()],
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"the best checkpoint .*checkpoint-\d holds no posterior"):
        trainer.train()
    assert trainer.current_posterior() is None
    trainer.save_model()
    assert not (Path(trainer.args.output_dir) / "evon_posterior_config.json").exists()


class _ConfigBroken(TrainerCallback):
    """Replaces each checkpoint's posterior config, once it is saved, by a directory or a link to nothing."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        config = Path(args.output_dir) / f"checkpoint-{state.global_step}" / POSTERIOR_CONFIG_NAME
        config.unlink()
        config.mkdir() if self.kind == "directory" else config.symlink_to(config.parent / "moved-away")


@pytest.mark.parametrize("kind", ["directory", "dangling link"])
def test_a_best_checkpoint_whose_config_is_no_file_is_an_error_naming_it(tmp_path, kind):
    """A best checkpoint whose posterior config is a directory or a link to nothing was taken for one
    without a posterior (a warning, and training ended without one), where loading it names the file."""
    args = config(
        tmp_path, max_steps=1, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        load_best_model_at_end=True, metric_for_best_model="eval_loss", bma_num_samples=2, evon_ess=100.0,
    )  # fmt: skip
    trainer = EVONTrainer(
        model=tiny_bert(), args=args, train_dataset=classification_data(16), eval_dataset=classification_data(16, 1),
        callbacks=[_ConfigBroken(kind)],
    )  # fmt: skip
    path = Path(args.output_dir) / "checkpoint-1" / POSTERIOR_CONFIG_NAME
    expected = (
        f"{path}: not a regular file"
        if kind == "directory"
        else f"{POSTERIOR_CONFIG_NAME} is a link to {str(path.parent / 'moved-away')!r}, which does not exist"
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*holds no posterior")
        with pytest.raises((PosteriorMismatchError, FileNotFoundError)) as err:
            trainer.train()
    assert type(err.value) is (PosteriorMismatchError if kind == "directory" else FileNotFoundError)
    assert expected in str(err.value), str(err.value)


@pytest.mark.parametrize("kind", ["dangling link", "named pipe", "link to a directory"])
def test_a_save_without_a_posterior_removes_a_config_that_is_no_regular_file(tmp_path, kind):
    """A model saved without a posterior left a posterior config that is a link to nothing, a named pipe
    or a link to a directory beside it (only regular files were taken for a posterior to remove; then a
    config os.path.isdir answers True for, a link to a directory too, was kept): loading the directory, which
    takes any listed config for its posterior (holds_posterior_config), then failed on the stale one. The
    link goes, its target stays."""
    from hf_evon.posterior.hub import holds_posterior_config

    args = config(tmp_path)
    trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data(16))
    assert trainer.current_posterior() is None
    os.makedirs(args.output_dir, exist_ok=True)
    stale = Path(args.output_dir) / POSTERIOR_CONFIG_NAME
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "notes.txt").write_text("kept")
    if kind == "named pipe":
        os.mkfifo(stale)
    else:
        stale.symlink_to(target if kind == "link to a directory" else stale.parent / "moved-away")
    with pytest.warns(UserWarning, match=rf"has no posterior, and the one there \({POSTERIOR_CONFIG_NAME}\)"):
        trainer.save_model()
    assert not os.path.lexists(stale) and (target / "notes.txt").read_text() == "kept"
    assert not holds_posterior_config(args.output_dir)
    assert (Path(args.output_dir) / "config.json").is_file()


def test_a_save_without_a_posterior_removes_the_weights_beside_a_config_that_is_a_directory(tmp_path):
    """A model saved without a posterior into a directory holding posterior weights beside a directory of
    the config's name: remove_posterior's os.remove of that directory raised IsADirectoryError, after the
    model was saved. The weights go (no reader takes them for a posterior, and a save without a posterior
    leaves none); the directory, no file a save wrote, stays with what it holds."""
    args = config(tmp_path)
    trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data(16))
    assert trainer.current_posterior() is None
    output = Path(args.output_dir)
    kept = output / POSTERIOR_CONFIG_NAME / "notes.txt"
    kept.parent.mkdir(parents=True)
    kept.write_text("kept")
    (output / POSTERIOR_WEIGHTS_NAME).write_bytes(b"an earlier posterior's weights")
    with pytest.warns(UserWarning, match=rf"has no posterior, and the one there \({POSTERIOR_WEIGHTS_NAME}\)"):
        trainer.save_model()
    assert not os.path.lexists(output / POSTERIOR_WEIGHTS_NAME)
    assert kept.read_text() == "kept" and sorted(os.listdir(kept.parent)) == ["notes.txt"]
    assert (output / "config.json").is_file()


@pytest.mark.parametrize(
    "name,what", [(POSTERIOR_CONFIG_NAME, "config"), (POSTERIOR_WEIGHTS_NAME, "weights"), ("README.md", "model card")]
)
@pytest.mark.parametrize("how", ["save_model", "push_to_hub", "checkpoint", "checkpoint push"])
def test_a_refused_posterior_save_writes_nothing_over_the_earlier_save(tmp_path, hub_api, how, name, what):
    """A save into a directory that holds an earlier save (model and posterior) and a directory under a name
    the posterior's save writes: save_model() (which push_to_hub() and each checkpoint call) wrote the model
    over the earlier one first, then the posterior's save refused (the config's name), failed on reading the
    card (README.md) or failed after its switch (the weights'): the directory paired the new model with the
    earlier posterior (or the new posterior with the earlier model, where a pushed checkpoint's posterior is
    copied in). The save is refused before anything is written, naming the directory; every file stays."""
    args = config(
        tmp_path, max_steps=2, save_strategy="steps", save_steps=2, hub_model_id="user/evon-refused",
        hub_token="hf_dummy",
    )  # fmt: skip
    first = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data(16))
    first.train()  # checkpoint-2
    first.save_model()
    out = Path(args.output_dir)
    saved = out / "checkpoint-2" if how == "checkpoint" else out
    (saved / name).unlink()
    (saved / name).mkdir()
    (saved / name / "notes.txt").write_text("kept")
    before = directory_state(saved)
    if how == "checkpoint":  # a second run's checkpoint-2, where the first run's is
        call = EVONTrainer(model=tiny_bert(seed=1), args=args, train_dataset=classification_data(16)).train
    else:
        with torch.no_grad():  # weights other than the ones saved
            for p in first.model.parameters():
                p.add_(1.0)
        call = {
            "save_model": first.save_model,
            "push_to_hub": first.push_to_hub,
            "checkpoint push": lambda: first._push_from_checkpoint(str(out / "checkpoint-2")),
        }[how]
        first.init_hf_repo()
    with pytest.raises(IsADirectoryError) as err:
        call()
    assert str(err.value) == (
        f"{saved / name}: a directory, where a posterior save writes its {what}; refusing to save over it "
        "(remove it, or save elsewhere)"
    ), str(err.value)
    assert directory_state(saved) == before


class _PosteriorMovedOut(TrainerCallback):
    """Moves each checkpoint's posterior into the output directory once it is saved (as a pushed
    checkpoint's copy leaves it there): the checkpoints hold none, the output directory the last one's."""

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        for f in (Path(args.output_dir) / f"checkpoint-{state.global_step}").glob("evon_posterior*"):
            os.replace(f, Path(args.output_dir) / f.name)


def test_saving_without_a_posterior_removes_an_older_saves_posterior_and_says_so(tmp_path):
    """With a best checkpoint without a posterior (``load_best_model_at_end``), ``save_model()`` wrote
    none and left the posterior of a later step (an earlier save's) in ``output_dir`` beside the best
    step's weights; ``create_model_card`` then described that posterior. The save removes it, naming
    its files; a posterior taken at the saved weights stays."""
    args = config(
        tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        load_best_model_at_end=True, metric_for_best_model="eval_step", greater_is_better=False, bma_num_samples=2,
    )  # fmt: skip
    trainer = EVONTrainer(
        model=tiny_bert(), args=args, train_dataset=classification_data(16), eval_dataset=classification_data(16, 1),
        callbacks=[_PosteriorMovedOut()], compute_metrics=lambda _: {"step": trainer.state.global_step},
    )  # fmt: skip
    with pytest.warns(UserWarning, match="holds no posterior"):
        trainer.train()
    out = Path(trainer.args.output_dir)
    assert trainer.state.best_global_step == 1 and (out / POSTERIOR_CONFIG_NAME).exists()  # step 2's
    trainer.create_model_card()
    assert "hf-evon:start" in (out / "README.md").read_text()  # it describes step 2's posterior
    with pytest.warns(UserWarning, match=rf"{POSTERIOR_CONFIG_NAME}, {POSTERIOR_WEIGHTS_NAME}\)") as record:
        trainer.save_model()
    assert sum(str(out) in str(w.message) for w in record) == 1
    assert not list(out.glob("evon_posterior*")) and (out / "model.safetensors").exists()
    assert "hf-evon:start" not in (out / "README.md").read_text()
    trainer.create_model_card()
    assert "hf-evon:start" not in (out / "README.md").read_text()
    # the posterior of the saved weights themselves is theirs: it stays, without a word
    EVONPosterior.from_optimizer(trainer.evon_optimizer, trainer.model).save_pretrained(out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.save_model()
    assert (out / POSTERIOR_CONFIG_NAME).exists() and (out / POSTERIOR_WEIGHTS_NAME).exists()


def test_a_given_posterior_is_not_saved_beside_weights_another_optimizer_moved(tmp_path):
    """``posterior=`` with another optimizer (``optimizers=(AdamW, None)``): after ``train()``,
    ``current_posterior()`` returned the given posterior, whose mean is the weights before training,
    and ``save_model()`` wrote it beside the moved weights as theirs."""
    model = tiny_bert()
    first = EVONTrainer(model=model, args=config(tmp_path / "first", max_steps=2), train_dataset=classification_data(16))
    first.train()
    posterior = first.current_posterior()
    assert posterior.config.get("mean_fingerprint")
    trainer = EVONTrainer(
        model=model, args=config(tmp_path, max_steps=2), train_dataset=classification_data(16), posterior=posterior,
        optimizers=(torch.optim.AdamW(model.parameters(), lr=1e-2), None),
    )  # fmt: skip
    assert trainer.current_posterior() is posterior  # the weights it was taken at
    out = Path(trainer.args.output_dir)
    trainer.save_model()
    assert (out / POSTERIOR_CONFIG_NAME).exists()
    with pytest.warns(UserWarning, match="not EVON"):
        trainer.train()
    with pytest.warns(UserWarning, match=r"weights differ from the ones the posterior \(posterior="):
        assert trainer.current_posterior() is None
    # BMA is refused naming why the posterior given is not used (it said "pass posterior=", as given)
    refused = r"evaluate\(bma=True\) needs a posterior: the one held \(posterior=.*\) was taken at other weights"
    with pytest.warns(UserWarning, match="weights differ"), pytest.raises(ValueError, match=refused):
        trainer.evaluate(classification_data(8), bma=True)
    with pytest.warns(UserWarning, match=rf"{POSTERIOR_CONFIG_NAME}.*{POSTERIOR_WEIGHTS_NAME}"):
        trainer.save_model()
    assert not (out / POSTERIOR_CONFIG_NAME).exists() and not (out / POSTERIOR_WEIGHTS_NAME).exists()


def test_a_given_posterior_without_a_fingerprint_is_not_saved_after_another_optimizer_trained(tmp_path):
    """``posterior=`` read from a file without ``mean_fingerprint`` (a hand-built posterior's), then
    ``train()`` with another optimizer: ``current_posterior()`` still returned it, and ``save_model()``
    wrote it beside the moved weights, although the trainer itself had moved them."""
    model = tiny_bert()
    first = EVONTrainer(model=model, args=config(tmp_path / "first", max_steps=2), train_dataset=classification_data(16))
    first.train()
    first.current_posterior().save_pretrained(tmp_path / "given", model_card=False)
    path = tmp_path / "given" / POSTERIOR_CONFIG_NAME
    written = json.loads(path.read_text())
    del written["mean_fingerprint"]
    path.write_text(json.dumps(written))
    posterior = EVONPosterior.from_pretrained(tmp_path / "given")
    assert posterior.config.get("mean_fingerprint") is None
    trainer = EVONTrainer(
        model=model, args=config(tmp_path, max_steps=2), train_dataset=classification_data(16), posterior=posterior,
        optimizers=(torch.optim.AdamW(model.parameters(), lr=1e-2), None),
    )  # fmt: skip
    assert trainer.current_posterior() is posterior  # nothing moved the weights yet: it is taken as theirs
    out = Path(trainer.args.output_dir)
    with pytest.warns(UserWarning, match="not EVON"):
        trainer.train()
    with pytest.warns(PosteriorMeanWarning, match=r"no mean_fingerprint.*train\(\)"):
        assert trainer.current_posterior() is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PosteriorMeanWarning)
        trainer.save_model()
    assert not (out / POSTERIOR_CONFIG_NAME).exists() and not (out / POSTERIOR_WEIGHTS_NAME).exists()
    trainer.posterior = posterior  # set again after training: the user's word that it is these weights'
    assert trainer.current_posterior() is posterior


# ---------------------------------------------------------------------------- data parallel
DDP_WORKER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    from launcher import finish, run_scenarios
    from test_trainer import classification_data, config, lm_data, tiny_bert, tiny_gpt2
    from hf_evon import EVONTrainer

    ESS = {"det": float("inf"), "noisy": 300.0}


    def trained(out, kind, run):
        make, data = (tiny_bert, classification_data(48)) if kind == "bert" else (tiny_gpt2, lm_data(24))
        args = config(out / f"{kind}-{run}", max_steps=3, evon_ess=ESS[run], evon_clip="none",
                      per_device_train_batch_size=4, evon_precondition_frequency=1, ddp_backend="gloo",
                      bma_num_samples=2)
        trainer = EVONTrainer(model=make(), args=args, train_dataset=data, eval_dataset=data.select(range(8)))
        trainer.train()
        metrics = trainer.evaluate()
        assert trainer.evon_optimizer.gradient_reducer is not None
        state = {n: p.detach() for n, p in trainer.model.named_parameters()}
        state["eval_bma_nll"] = torch.tensor(metrics["eval_bma_nll"])
        return state


    out, names = Path(sys.argv[1]), sys.argv[2:]
    scenarios = {name: lambda name=name: trained(out, *name.split("-")) for name in names}  # "<kind>-<run>"
    run_scenarios(str(out), int(os.environ["RANK"]), scenarios, names)
    finish()  # ends the worker before gloo's destructors can abort or hang it
    """
)
DDP_KINDS = ("bert", "gpt2")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """``load("<kind>-<run>")`` (``launcher.scenario_results``): what each rank saved for a scenario of
    test_ddp_two_processes, each kind with ess=inf (``det``) and with noise (``noisy``), all trained in
    one two-process launch of DDP_WORKER (a launch's start, not its 3-step trainings, is most of its time)."""
    out = tmp_path_factory.mktemp("ddp")
    worker = out / "worker.py"
    worker.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n" + DDP_WORKER)
    return scenario_results(2, str(worker), str(out), [f"{kind}-{run}" for kind in DDP_KINDS for run in ("det", "noisy")])


@pytest.mark.parametrize("kind", DDP_KINDS)
def test_ddp_two_processes(tmp_path, ddp_runs, kind):
    """torchrun, 2 CPU ranks (gloo) × batch 4: with ess=inf exactly one process × batch 8 (GPT-2: the
    token weights use the global token count); with noise, both ranks stay identical."""
    det, _ = ddp_runs(f"{kind}-det")
    r0, r1 = ddp_runs(f"{kind}-noisy")
    make, data = (tiny_bert, classification_data(48)) if kind == "bert" else (tiny_gpt2, lm_data(24))
    args = config(
        tmp_path / "single",
        max_steps=3,
        evon_ess=float("inf"),
        evon_clip="none",
        evon_precondition_frequency=1,
    )
    single = EVONTrainer(model=make(), args=args, train_dataset=data)
    single.train()
    reference = params(single.model)
    for name, value in reference.items():
        torch.testing.assert_close(det[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert all(torch.equal(r0[k], r1[k]) for k in r0)
    assert not all(torch.equal(r0[k], det[k]) for k in reference)


@pytest.mark.parametrize("scheduler", ["constant", "linear"])
def test_the_logged_learning_rate_is_the_users_and_alpha_is_logged_beside_it(tmp_path, scheduler):
    """Issue 33 §3: the logged ``learning_rate`` was EVON's α (0.075 where the user set 1e-3): the
    Trainer reads the first parameter group's. It is the user's rate, as scheduled, and α is
    ``evon/learning_rate`` (the first EVON group's, as the step used it: before the scheduler steps)."""
    rates: list[tuple[float, float]] = []

    class Record(TrainerCallback):
        def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):  # noqa: ANN001, ANN201
            first = trainer.evon_optimizer.param_groups[0]
            rates.append((first["lr"], first["initial_lr"]))

    trainer = EVONTrainer(
        model=tiny_bert(),
        args=config(tmp_path, max_steps=4, learning_rate=1e-3, lr_scheduler_type=scheduler, logging_steps=1),
        train_dataset=classification_data(),
        callbacks=[Record()],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert trainer.evon_optimizer.param_groups[0]["algorithm"] == "evon"
    assert len(logs) == 4
    for entry, (alpha, initial) in zip(logs, rates):
        assert entry["evon/learning_rate"] == pytest.approx(alpha, rel=1e-9)
        assert entry["learning_rate"] == pytest.approx(1e-3 * alpha / initial, rel=1e-9)
    assert initial != pytest.approx(1e-3)  # α is not the user's rate: the test can tell them apart
    if scheduler == "constant":
        assert all(entry["learning_rate"] == pytest.approx(1e-3) for entry in logs)


def test_the_logged_learning_rate_is_adamws_in_use_under_a_scheduler_without_initial_lr(tmp_path):
    """reduce_lr_on_plateau sets no initial_lr: the logged rate stayed at args.learning_rate while
    AdamW's fell. It is the AdamW group's rate, as the optimizer held it at that step."""
    held: list[float] = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            held.append(next(g["lr"] for g in trainer.evon_optimizer.param_groups if g["algorithm"] == "adamw"))

    trainer = EVONTrainer(
        model=tiny_bert(),
        args=config(tmp_path, max_steps=4, learning_rate=1e-3, logging_steps=1, eval_strategy="steps", eval_steps=1,
                    lr_scheduler_type="reduce_lr_on_plateau", metric_for_best_model="eval_loss", bma_num_samples=0,
                    lr_scheduler_kwargs=_PLATEAU),  # fmt: skip
        train_dataset=classification_data(),
        eval_dataset=classification_data(8, seed=1),
        callbacks=[Record()],
    )
    trainer.train()
    logged = [h["learning_rate"] for h in trainer.state.log_history if "loss" in h and "learning_rate" in h]
    assert logged == held[: len(logged)] and len(logged) == 4
    assert logged[-1] < 1e-3  # the plateau schedule did lower it


_PLATEAU = {"patience": 0, "factor": 0.5, "mode": "max", "threshold": 1.0, "threshold_mode": "abs"}


def _plateau_args(tmp_path: Path, **overrides) -> EVONConfig:
    """reduce_lr_on_plateau halving every group's rate at each evaluation after the first (none rises by 1)."""
    return config(
        tmp_path, max_steps=4, learning_rate=1e-3, logging_steps=1, eval_strategy="steps", eval_steps=1,
        lr_scheduler_type="reduce_lr_on_plateau", metric_for_best_model="eval_loss", bma_num_samples=0,
        lr_scheduler_kwargs=_PLATEAU, **overrides,
    )  # fmt: skip


def test_without_an_adamw_group_the_logged_rate_follows_a_plateau_schedule(tmp_path):
    """Only EVON groups (the embeddings, head and 1-D tensors frozen): the logged ``learning_rate`` is
    ``learning_rate`` as scheduled, ``learning_rate · α_used / α``. reduce_lr_on_plateau sets no
    ``initial_lr``, and the logged rate stayed at 1e-3 while the schedule halved α."""
    model = tiny_bert()
    for name, p in model.named_parameters():
        p.requires_grad_(p.ndim == 2 and "encoder" in name)
    trainer = EVONTrainer(
        model=model, args=_plateau_args(tmp_path), train_dataset=classification_data(),
        eval_dataset=classification_data(8, seed=1),
    )  # fmt: skip
    trainer.train()
    assert {g["algorithm"] for g in trainer.evon_optimizer.param_groups} == {"evon"}
    logs = [h for h in trainer.state.log_history if "loss" in h]
    alphas = [h["evon/learning_rate"] for h in logs]
    assert len(logs) == 4 and alphas[0] == 2e-2 and alphas[-1] < 2e-2  # the schedule lowered α
    assert [h["learning_rate"] for h in logs] == pytest.approx([1e-3 * a / 2e-2 for a in alphas], rel=1e-12)


def test_without_an_adamw_group_the_logged_rate_under_one_cycle_peaks_at_learning_rate(tmp_path):
    """Only EVON groups, under the user's OneCycleLR: α as configured is its peak ``max_lr`` (the
    posterior's ``lr``), and the logged ``learning_rate`` is ``learning_rate · α_used / max_lr``. It was
    read against OneCycleLR's ``initial_lr``, its start ``max_lr / div_factor``: 25 times that, logging
    2.5e-2 at the peak of a run at learning_rate 1e-3."""
    model = tiny_bert()
    for name, p in model.named_parameters():
        p.requires_grad_(p.ndim == 2 and "encoder" in name)
    evon = build_optimizer(model, lr=2e-2, ess=1e4, hess_init=1.0, precondition_frequency=2)
    assert {g["algorithm"] for g in evon.param_groups} == {"evon"}
    peak = 4e-2
    cycle = torch.optim.lr_scheduler.OneCycleLR(evon, max_lr=peak, total_steps=4, pct_start=0.5, cycle_momentum=False)
    trainer = EVONTrainer(
        model=model, args=config(tmp_path, max_steps=4, learning_rate=1e-3, logging_steps=1),
        train_dataset=classification_data(), optimizers=(evon, cycle),
    )  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    alphas = [h["evon/learning_rate"] for h in logs]
    assert len(logs) == 4 and alphas[0] == pytest.approx(peak / 25) and max(alphas) == pytest.approx(peak)
    assert [h["learning_rate"] for h in logs] == pytest.approx([1e-3 * a / peak for a in alphas], rel=1e-12)
    assert trainer.current_posterior().config["lr"] == peak  # the rate the logs are read against


@pytest.mark.parametrize("users_scheduler", [False, True])
def test_a_plateau_schedules_saved_posterior_records_the_configured_rate_and_the_rate_at_save_time(
    tmp_path, users_scheduler
):
    """The posterior's ``lr`` is EVON's configured rate under an LR scheduler and ``final_lr`` the rate at
    save time (docs/posterior-format.md). Under reduce_lr_on_plateau, which sets no ``initial_lr``, the
    saved ``lr`` was the lowered rate and ``final_lr`` was missing; so under the user's own plateau
    schedule (``optimizers=(evon, scheduler)``)."""
    model, optimizers = tiny_bert(), (None, None)
    if users_scheduler:
        evon = build_optimizer(model, lr=2e-2, adamw_lr=1e-3, ess=1e4, hess_init=1.0, precondition_frequency=2)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(evon, **_PLATEAU)
        optimizers = (evon, plateau)
    trainer = EVONTrainer(
        model=model, args=_plateau_args(tmp_path), train_dataset=classification_data(),
        eval_dataset=classification_data(8, seed=1), optimizers=optimizers,
    )  # fmt: skip
    trainer.train()
    alpha = trainer.evon_optimizer.param_groups[0]["lr"]
    assert alpha < 2e-2  # the schedule lowered it
    trainer.save_model()
    saved = EVONPosterior.from_pretrained(trainer.args.output_dir).config
    assert (saved["lr"], saved["final_lr"]) == (2e-2, alpha)


@pytest.mark.parametrize("scheduler", ["linear", "cosine"])
def test_the_logged_learning_rate_is_the_one_the_step_used_as_the_trainer_logs_it(tmp_path, scheduler):
    """The logged ``learning_rate`` and ``evon/learning_rate`` were the rates after the scheduler stepped
    (the next step's; 0.0 at the last step of a linear schedule), one step ahead of what ``Trainer``
    logs: the rate the step used. Both runs here follow one schedule from the same rate."""
    common = dict(max_steps=4, learning_rate=1e-3, lr_scheduler_type=scheduler, warmup_steps=1, logging_steps=1)
    plain = dict(output_dir=str(tmp_path / "plain"), report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
    reference = Trainer(
        model=tiny_bert(), args=TrainingArguments(**plain, **common), train_dataset=classification_data()
    )
    reference.train()
    used: list[float] = []

    class Record(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            used.append(trainer.evon_optimizer.param_groups[0]["lr"])  # EVON's α as the step used it

    trainer = EVONTrainer(
        model=tiny_bert(), args=config(tmp_path, **common), train_dataset=classification_data(), callbacks=[Record()]
    )
    trainer.train()
    expected = [h["learning_rate"] for h in reference.state.log_history if "loss" in h]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert expected[0] == 0.0 and len(set(expected)) == 4  # the warm-up's first step, then a rate per step
    assert [h["learning_rate"] for h in logs] == pytest.approx(expected, rel=1e-12, abs=0.0)
    assert [h["evon/learning_rate"] for h in logs] == pytest.approx(used, rel=1e-12, abs=0.0)


def test_a_users_evon_with_a_tensor_rate_logs_the_rates_each_step_used_as_numbers(tmp_path):
    """With the user's own ``EVON(lr=torch.tensor(...))`` (torch's schedulers then set the tensor in
    place), the logged ``evon/learning_rate`` held the tensor itself: a reference the scheduler had
    moved on by the time it was logged, and a ``log_history`` that ``json`` cannot write."""
    model = tiny_bert()
    alpha = 0.125
    optimizer = build_optimizer(model, lr=torch.tensor(alpha))
    used: list[float] = []

    class Record(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            used.append(float(trainer.evon_optimizer.param_groups[0]["lr"]))  # the rate the step used

    common = dict(max_steps=4, learning_rate=1e-3, lr_scheduler_type="linear", logging_steps=1)
    trainer = EVONTrainer(
        model=model,
        args=config(tmp_path, **common),
        train_dataset=classification_data(),
        optimizers=(optimizer, None),
        callbacks=[Record()],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [type(h["evon/learning_rate"]) for h in logs] == [float] * 4
    assert [h["evon/learning_rate"] for h in logs] == used
    assert used[0] == alpha and len(set(used)) == 4  # the linear schedule's four rates from α
    trainer.state.save_to_json(str(tmp_path / "state.json"))
    assert json.loads((tmp_path / "state.json").read_text())["log_history"][0]["evon/learning_rate"] == used[0]


@pytest.mark.parametrize("adamw_rate", [1e-3, 5e-4])
@pytest.mark.parametrize(
    ("scheduler", "kwargs"),
    [("cosine_with_min_lr", {"min_lr": 1e-4}), ("cosine_warmup_with_min_lr", {"min_lr": 1e-4}), ("polynomial", {"lr_end": 1e-4})],
)
def test_a_schedules_end_rate_is_in_the_units_of_learning_rate(tmp_path, scheduler, kwargs, adamw_rate):
    """transformers reads ``lr_scheduler_kwargs``' ``min_lr``/``lr_end`` against ``optimizer.defaults["lr"]``,
    which is EVON's α (0.02 here): AdamW's rate fell to 1e-3 · 1e-4 / 0.02 = 5e-6 instead of 1e-4.
    They are rates in the units of ``learning_rate``, as under ``Trainer``: AdamW's rate follows the
    schedule a plain AdamW at its rate gets, and α keeps its ratio to it. An AdamW rate of its own
    (``evon_adamw_learning_rate`` 5e-4, ``learning_rate`` 1e-3) is the one the bound is read against."""
    from transformers import get_scheduler

    args = config(
        tmp_path, max_steps=4, learning_rate=1e-3, evon_adamw_learning_rate=adamw_rate, lr_scheduler_type=scheduler,
        lr_scheduler_kwargs=kwargs,
    )  # fmt: skip
    trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data())
    trainer.train()
    reference = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=adamw_rate)
    schedule = get_scheduler(scheduler, reference, num_warmup_steps=0, num_training_steps=4, scheduler_specific_kwargs=kwargs)
    for _ in range(4):
        reference.step()
        schedule.step()
    expected = reference.param_groups[0]["lr"]
    groups = trainer.evon_optimizer.param_groups
    evon, adamw = groups[0], next(g for g in groups if g["algorithm"] == "adamw")
    assert evon["algorithm"] == "evon" and evon["initial_lr"] == 2e-2 and adamw["initial_lr"] == adamw_rate
    assert adamw["lr"] == pytest.approx(expected, rel=1e-9)
    assert evon["lr"] == pytest.approx(2e-2 * expected / adamw_rate, rel=1e-9)
    assert trainer.evon_optimizer.defaults["lr"] == 2e-2  # read against the user's rate while the schedule was built


@pytest.mark.parametrize("adamw_rate", [1e-3, 5e-4])
@pytest.mark.parametrize(
    ("scheduler", "steps", "bound"),
    [("reduce_lr_on_plateau", 5, {"min_lr": 1e-4}), ("greedy", 1, {"max_lr": 2e-3, "min_lr": 1e-4})],
)
def test_a_plateau_schedules_bounds_are_in_the_units_of_learning_rate(tmp_path, scheduler, steps, bound, adamw_rate):
    """A plateau schedule's ``min_lr`` (greedy's ``max_lr`` too) bounds every group's rate by that one
    number: AdamW's (1e-3) stopped at the bound, and so did EVON's α (0.02, 20 times AdamW's): reduced
    to 1e-4, or "raised" to greedy's 2e-3, below its start. The bounds are in the units of
    ``learning_rate``, as under ``Trainer``: AdamW stops at the bound, α at its ratio (20, or 40 with
    ``evon_adamw_learning_rate`` 5e-4 beside ``learning_rate`` 1e-3: AdamW's own rate is the unit)."""
    kwargs = {**bound, "factor": 0.1, "patience": 0, "mode": "max", "cooldown": 0}
    if scheduler == "reduce_lr_on_plateau":  # no evaluation counts as a rise (none rises by 1): every one reduces
        kwargs.update(threshold=1.0, threshold_mode="abs")
    args = config(
        tmp_path, max_steps=steps, learning_rate=1e-3, evon_adamw_learning_rate=adamw_rate, logging_steps=1,
        eval_strategy="steps", eval_steps=1, lr_scheduler_type=scheduler, metric_for_best_model="eval_loss",
        bma_num_samples=0, lr_scheduler_kwargs=kwargs,
    )  # fmt: skip
    trainer = EVONTrainer(
        model=tiny_bert(), args=args, train_dataset=classification_data(), eval_dataset=classification_data(8, seed=1)
    )
    trainer.train()
    groups = trainer.evon_optimizer.param_groups
    evon, adamw = groups[0], next(g for g in groups if g["algorithm"] == "adamw")
    end = bound["max_lr" if scheduler == "greedy" else "min_lr"]  # greedy raised the rate, the plateau lowered it
    assert evon["algorithm"] == "evon" and adamw["lr"] == pytest.approx(end, rel=1e-9)
    assert evon["lr"] == pytest.approx(2e-2 * end / adamw_rate, rel=1e-9)
    assert args.lr_scheduler_kwargs == kwargs  # the config as given


def test_greedys_default_bounds_are_each_groups_in_the_units_of_learning_rate(tmp_path):
    """Without ``min_lr``/``max_lr`` greedy bounds every group by its defaults (1e-3, 1.0), numbers in
    the units of ``learning_rate`` as given ones are; they applied unscaled to EVON's α (20 times
    AdamW's rate here): raised by 1000x in one step, AdamW's rate stopped at the default ceiling and
    so did α, 20 times too low."""
    import inspect

    from transformers.optimization import GreedyLR

    defaults = {k: inspect.signature(GreedyLR).parameters[k].default for k in ("min_lr", "max_lr")}
    kwargs = {"factor": 1e-3, "patience": 0, "mode": "max", "cooldown": 0}
    args = config(
        tmp_path, max_steps=1, learning_rate=1e-3, logging_steps=1, eval_strategy="steps", eval_steps=1,
        lr_scheduler_type="greedy", metric_for_best_model="eval_loss", bma_num_samples=0, lr_scheduler_kwargs=kwargs,
    )  # fmt: skip
    trainer = EVONTrainer(
        model=tiny_bert(), args=args, train_dataset=classification_data(), eval_dataset=classification_data(8, seed=1)
    )
    trainer.train()
    groups = trainer.evon_optimizer.param_groups
    ratios = [20.0 if g["algorithm"] == "evon" else 1.0 for g in groups]  # α = 2e-2, AdamW's 1e-3
    assert sorted(set(ratios)) == [1.0, 20.0]
    assert [g["lr"] for g in groups] == pytest.approx([defaults["max_lr"] * r for r in ratios], rel=1e-9)
    assert trainer.lr_scheduler.min_lrs == pytest.approx([defaults["min_lr"] * r for r in ratios], rel=1e-12)
    assert trainer.lr_scheduler.max_lrs == pytest.approx([defaults["max_lr"] * r for r in ratios], rel=1e-12)
    assert args.lr_scheduler_kwargs == kwargs  # the config as given


@pytest.mark.parametrize("alpha", [None, 2e-2])
def test_learning_rate_zero_trains_as_trainer_does_and_logs_adamws_rate_zero(tmp_path, alpha):
    """``learning_rate=0`` (the AdamW part held still, as ``Trainer`` allows) failed in ``create_scheduler``
    with a bare ZeroDivisionError (every group's rate was divided by AdamW's). It trains: the AdamW
    group stays at rate 0 and its weights unchanged, EVON's α is 0 derived from it or, given, scheduled
    as under any rate; the logged ``learning_rate`` is AdamW's 0, not α, and α is ``evon/learning_rate``."""
    model = tiny_bert()
    before = params(model)
    args = config(
        tmp_path, learning_rate=0.0, evon_learning_rate=alpha, evon_adamw_learning_rate=None,
        lr_scheduler_type="linear", logging_steps=1,
    )  # fmt: skip
    trainer = EVONTrainer(model=model, args=args, train_dataset=classification_data())
    trainer.train()
    groups = trainer.evon_optimizer.param_groups
    adamw = {id(p) for g in groups if g["algorithm"] == "adamw" for p in g["params"]}
    assert groups[0]["algorithm"] == "evon" and adamw
    for name, p in model.named_parameters():
        if id(p) in adamw:
            assert torch.equal(p.detach(), before[name]), name
    logs = [h for h in trainer.state.log_history if "loss" in h]
    expected = [0.0] * 4 if alpha is None else [alpha * (4 - s) / 4 for s in range(4)]  # linear, no warm-up
    assert [h["learning_rate"] for h in logs] == [0.0] * 4
    assert [h["evon/learning_rate"] for h in logs] == pytest.approx(expected, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("how", ["optimizers", "create_optimizer"])
def test_an_optimizer_other_than_evon_is_named_at_train_and_no_posterior_is_claimed(tmp_path, how):
    """``optimizers=(torch.optim.AdamW(...), None)``, or a subclass whose ``create_optimizer`` builds
    AdamW, trained as ``Trainer`` does without a word: no posterior learned, none saved, and the
    run's EVON-specific outputs silently missing. ``train()`` says so, naming the optimizer; the
    run is the Trainer's own (its AdamW steps), and no posterior is claimed or written."""

    class OwnOptimizer(EVONTrainer):
        def create_optimizer(self, model=None):  # noqa: ANN001, ANN201
            if self.optimizer is None:
                self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
            return self.optimizer

    model = tiny_bert()
    kwargs = {"optimizers": (torch.optim.AdamW(model.parameters(), lr=1e-3), None)} if how == "optimizers" else {}
    cls = EVONTrainer if how == "optimizers" else OwnOptimizer
    trainer = cls(model=model, args=config(tmp_path, logging_steps=1), train_dataset=classification_data(), **kwargs)
    with pytest.warns(UserWarning, match=r"optimizer is AdamW, not EVON: .*no posterior") as record:
        trainer.train()
    assert sum("not EVON" in str(w.message) for w in record) == 1
    assert trainer.evon_optimizer is None and trainer.current_posterior() is None
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4 and not any(k.startswith("evon/") for h in logs for k in h)
    trainer.save_model()
    assert not (Path(trainer.args.output_dir) / POSTERIOR_CONFIG_NAME).exists()


def test_a_users_evon_listing_its_adamw_group_first_logs_alpha_as_evon_learning_rate(tmp_path):
    """The user's own ``EVON([{adamw group}, {evon group}])`` (groups in the order the user lists them):
    ``evon/learning_rate`` was missing from every log, being looked for in the first group only. α is the
    first EVON group's rate as the step used it, ``learning_rate`` the AdamW group's."""
    model = tiny_bert()
    named = list(model.named_parameters())
    mats = [(n, p) for n, p in named if p.ndim == 2 and "encoder" in n]
    rest = [(n, p) for n, p in named if (n, p) not in mats]
    optimizer = EVON(
        [
            {"params": [p for _, p in rest], "param_names": [n for n, _ in rest], "algorithm": "adamw", "lr": 1e-3},
            {"params": [p for _, p in mats], "param_names": [n for n, _ in mats], "lr": 2e-2},
        ],
        ess=1e4, hess_init=1.0,
    )  # fmt: skip
    args = config(tmp_path, max_steps=4, learning_rate=1e-3, lr_scheduler_type="linear", logging_steps=1)
    trainer = EVONTrainer(model=model, args=args, train_dataset=classification_data(), optimizers=(optimizer, None))
    trainer.train()
    assert [g["algorithm"] for g in trainer.evon_optimizer.param_groups] == ["adamw", "evon"]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    linear = [(4 - s) / 4 for s in range(4)]  # the rate each step used, no warm-up
    assert [h["learning_rate"] for h in logs] == pytest.approx([1e-3 * f for f in linear], rel=1e-12)
    assert [h.get("evon/learning_rate") for h in logs] == pytest.approx([2e-2 * f for f in linear], rel=1e-12)


def _recalibrated(trainer: EVONTrainer, seed: int = 2):
    """A calibration that cannot keep the trained scale: only ×0.5 or the mean are candidates."""
    result = trainer.calibrate(classification_data(24, seed), grid=(0.5,), keep_trained=False, always_scan=True)
    assert result.ess != result.trained_ess
    return result


def test_a_calibration_applies_to_a_posterior_given_to_the_trainer(tmp_path) -> None:
    trained = EVONTrainer(model=tiny_bert(), args=config(tmp_path / "a"), train_dataset=classification_data(32))
    trained.train()
    trained.save_model(tmp_path / "saved")
    model = BertForSequenceClassification.from_pretrained(tmp_path / "saved")
    given = EVONPosterior.from_pretrained(tmp_path / "saved")
    trainer = EVONTrainer(model=model, args=config(tmp_path / "b"), posterior=given)
    result = _recalibrated(trainer)
    assert trainer.current_posterior().ess == result.ess != given.ess  # it kept the given one's
    trainer.save_model(tmp_path / "calibrated")
    assert EVONPosterior.from_pretrained(tmp_path / "calibrated").ess == result.ess


def test_a_calibration_applies_to_the_best_checkpoints_posterior(tmp_path) -> None:
    args = config(
        tmp_path, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        load_best_model_at_end=True, metric_for_best_model="eval_loss",
    )  # fmt: skip
    trainer = EVONTrainer(
        model=tiny_bert(), args=args, train_dataset=classification_data(32), eval_dataset=classification_data(16, 1)
    )
    trainer.train()
    assert trainer._posterior_from_checkpoint  # the restored checkpoint's posterior is the one in use
    result = _recalibrated(trainer)
    assert trainer.current_posterior().ess == result.ess != trainer.posterior.ess


def test_a_posterior_set_after_training_is_the_trainers_until_it_trains_again(tmp_path) -> None:
    """``trainer.posterior = p`` after an EVON run was stored and ignored: ``current_posterior()``,
    evaluation and ``save_model`` kept taking EVON's (and its calibration), though the setter's docstring
    says setting it vouches for it. It is the trainer's posterior, uncalibrated, until ``train()`` runs."""
    trainer = EVONTrainer(model=tiny_bert(), args=config(tmp_path), train_dataset=classification_data(32))
    trainer.train()
    _recalibrated(trainer)
    trained = trainer._trained_posterior()
    hand = trained.with_ess(trained.ess * 1e-3)
    trainer.posterior = hand
    assert trainer.current_posterior() is hand
    trainer.save_model(tmp_path / "hand")
    assert EVONPosterior.from_pretrained(tmp_path / "hand").ess == hand.ess != trained.ess
    trainer.posterior = None  # EVON's again (its calibration was for the posterior in place before)
    assert trainer.current_posterior().ess == trained.ess
    trainer.posterior = hand
    trainer.args.max_steps = 6
    trainer.train(resume_from_checkpoint=False)
    assert trainer.current_posterior().ess == trainer._trained_posterior().ess == trained.ess


def test_a_failed_calibration_keeps_the_one_before(tmp_path) -> None:
    trainer = EVONTrainer(model=tiny_bert(), args=config(tmp_path), train_dataset=classification_data(32))
    trainer.train()
    first = _recalibrated(trainer)
    bad = Dataset.from_list([{"input_ids": r["input_ids"], "labels": 7} for r in classification_data(8, 3)])
    with pytest.raises(ValueError, match=r"batch 0 \(counting from 0\) has label 7, outside the model's 3 classes"):
        trainer.calibrate(bad)
    assert trainer.calibration is first and trainer.current_posterior().ess == first.ess


def test_a_posterior_of_another_model_is_refused_when_the_trainer_is_built(tmp_path) -> None:
    # it was taken, and save_model() wrote it beside the other model's weights: a pair that never loads
    from conftest import one_step_optimizer

    from hf_evon import PosteriorMismatchError

    gpt2 = tiny_gpt2()
    other = EVONPosterior.from_optimizer(one_step_optimizer(gpt2, 100), gpt2)
    with pytest.raises(PosteriorMismatchError, match="does not fit the given BertForSequenceClassification"):
        EVONTrainer(model=tiny_bert(), args=config(tmp_path), posterior=other)
    with pytest.raises(TypeError, match=r"posterior= takes an EVONPosterior .*got <class 'str'>"):
        EVONTrainer(model=tiny_bert(), args=config(tmp_path), posterior="out/checkpoint")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing written


# ---------------------------------------------------------------------------- signatures
_POS, _KW = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
_EMPTY = inspect.Parameter.empty
# The overrides whose parameters differ from the parent's on purpose: (class defining it, method) ->
# ("adds", parameters put before the parent's **kwargs, if any) or ("passes on", keyword-only parameters
# beside *args/**kwargs, which go to the parent unchanged), and why.
_DELIBERATE_SIGNATURES = {
    ("EVONTrainerMixin", "__init__"): (
        "passes on", (("peft_config", _KW, None), ("posterior", _KW, None), ("calibration_dataset", _KW, None)),
        "any Trainer subclass's parameters, matched by name in its own order (TRL's DPOTrainer takes args "
        "third); EVON's own are keyword-only",
    ),
    ("EVONSFTTrainer", "__init__"): ("passes on", (), "SFTTrainer's parameters, through EVONTrainerMixin's"),
    ("EVONTrainerMixin", "train"): (
        "passes on", (), "resume_from_checkpoint (first, or by name) resolved when True, the rest as given",
    ),
    ("CheckpointingMixin", "create_model_card"): (
        "passes on", (), "one override over Trainer's and TRL's cards, whose parameters differ",
    ),
    ("EvaluationMixin", "evaluate"): (
        "passes on", (("bma", _KW, False),), "bma=True asks for the BMA metrics; the rest is the subclass's",
    ),
    ("PredictionMixin", "predict"): (
        "adds", (("bma", _POS, False), ("**", inspect.Parameter.VAR_KEYWORD, _EMPTY)),
        "bma=True predicts by BMA; **kwargs are a subclass's own (Seq2SeqTrainer's generation settings)",
    ),
    ("EVONSeq2SeqTrainer", "predict"): ("adds", (("bma", _POS, False),), "bma=True decodes by BMA"),
    ("EVONSeq2SeqTrainer", "evaluate"): ("adds", (("bma", _POS, False),), "bma=True decodes by BMA"),
    ("EvaluationMixin", "prediction_step"): (
        "adds", (("**", inspect.Parameter.VAR_KEYWORD, _EMPTY),), "Seq2SeqTrainer's gen_kwargs, passed on",
    ),
}


def _parameters(function) -> list[tuple[str, object, object]]:
    """What a caller sees of ``function``'s parameters: names (``*``/``**`` for the variadic ones,
    whose names no call spells), kinds, defaults, in order; annotations aside."""
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [
        (stars.get(p.kind, p.name), p.kind, p.default) for p in inspect.signature(function).parameters.values()
    ]


def _passes_everything_on(parameters: list) -> bool:
    return [kind for _, kind, _ in parameters[1:]] == [
        inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD
    ]


@pytest.mark.parametrize(
    "ours, parent",
    [
        ("hf_evon.trainer:EVONTrainer", "transformers:Trainer"),
        ("hf_evon.trainer:EVONSeq2SeqTrainer", "transformers:Seq2SeqTrainer"),
        ("hf_evon.trainer.sft:EVONSFTTrainer", "trl:SFTTrainer"),
    ],
)
def test_every_override_takes_the_parents_parameters(ours, parent):
    """Each public method (and ``__init__``) the EVON trainers override takes the parameters of the
    method it overrides, in order, of the same kinds and defaults, or differs as
    ``_DELIBERATE_SIGNATURES`` says and why. ``push_to_hub`` left out ``private``, the Trainer's fifth
    positional parameter."""
    import importlib

    def resolve(spec: str) -> type:
        module, name = spec.split(":")
        return getattr(pytest.importorskip(module) if module == "trl" else importlib.import_module(module), name)

    ours, parent = resolve(ours), resolve(parent)
    checked = []
    for name in sorted(n for n in dir(parent) if n == "__init__" or not n.startswith("_")):
        if not inspect.isfunction(getattr(parent, name)):
            continue
        definer = next(k for k in ours.__mro__ if name in vars(k))
        if definer in parent.__mro__:
            continue  # not overridden
        # a parent method that passes everything on (SFTTrainer.training_step) takes what it calls
        bases = [k for k in parent.__mro__ if name in vars(k)]
        theirs = next(p for k in bases if not _passes_everything_on(p := _parameters(vars(k)[name])))
        mine = _parameters(getattr(ours, name))
        deliberate = _DELIBERATE_SIGNATURES.get((definer.__name__, name))
        if deliberate is None:
            expected = theirs
        elif deliberate[0] == "passes on":
            expected = [
                theirs[0], ("*", inspect.Parameter.VAR_POSITIONAL, _EMPTY), *deliberate[1],
                ("**", inspect.Parameter.VAR_KEYWORD, _EMPTY),
            ]  # fmt: skip
        else:
            added = [p for p in deliberate[1] if p[0] != "**"]
            var_keyword = [p for p in (*theirs, *deliberate[1]) if p[0] == "**"][:1]
            expected = [p for p in theirs if p[0] != "**"] + added + var_keyword
        assert mine == expected, f"{ours.__name__}.{name} (from {definer.__name__}) vs {parent.__name__}.{name}"
        checked.append(name)
    assert {"push_to_hub", "evaluate", "predict", "train", "create_model_card"} <= set(checked)


def test_a_numpy_plateau_bound_is_scaled_per_group_as_a_python_number_is(tmp_path):
    """reduce_lr_on_plateau's ``min_lr`` is the user's rate's bound, scaled to each group's rate: one given
    as a NumPy number (a search grid's) was taken as every group's, so EVON's α (20x AdamW's rate here)
    could decay 20x further than the schedule says."""
    import numpy as np

    floors = {}
    for bound in (2.5e-4, np.float64(2.5e-4), np.float32(2.5e-4)):
        args = config(
            tmp_path, max_steps=4, learning_rate=1e-3, lr_scheduler_type="reduce_lr_on_plateau",
            lr_scheduler_kwargs={"min_lr": bound}, eval_strategy="steps", eval_steps=1,
        )  # fmt: skip
        trainer = EVONTrainer(
            model=tiny_bert(), args=args, train_dataset=classification_data(), eval_dataset=classification_data(8, 1)
        )
        trainer.create_optimizer_and_scheduler(num_training_steps=4)
        floors[type(bound).__name__] = [float(x) for x in trainer.lr_scheduler.min_lrs]
    rates = [g["lr"] for g in trainer.evon_optimizer.param_groups]
    assert floors["float"] == pytest.approx([2.5e-4 * r / 1e-3 for r in rates], rel=1e-9)
    for kind in ("float64", "float32"):
        assert floors[kind] == pytest.approx(floors["float"], rel=1e-6), kind


@pytest.mark.parametrize("kind", ["polynomial", "cosine_with_min_lr"])
def test_an_adamw_group_held_still_leaves_the_schedule_the_users_rate(tmp_path, kind):
    """``evon_adamw_learning_rate=0`` (AdamW's groups held still) built the scheduler on a rate of 0:
    polynomial refused it ("lr_end must be smaller than initial lr (0.0)") and cosine_with_min_lr divided
    by it, though the user's learning_rate was 1e-3. EVON's α follows the schedule of learning_rate, as
    plain Trainer's rate does, and the AdamW groups stay at 0."""
    from transformers import get_scheduler

    extra = {"min_lr": 1e-5} if kind == "cosine_with_min_lr" else {}
    args = config(tmp_path, max_steps=6, learning_rate=1e-3, evon_adamw_learning_rate=0.0, lr_scheduler_type=kind,
                  lr_scheduler_kwargs=extra)  # fmt: skip
    trainer = EVONTrainer(model=tiny_bert(), args=args, train_dataset=classification_data())
    trainer.create_optimizer_and_scheduler(num_training_steps=6)
    evon = trainer.evon_optimizer
    alpha = next(g["lr"] for g in evon.param_groups if g["algorithm"] == "evon")
    reference = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    plain = get_scheduler(kind, reference, num_warmup_steps=0, num_training_steps=6, scheduler_specific_kwargs=extra)
    for _ in range(4):
        trainer.lr_scheduler.step()
        plain.step()
        rates = {g["algorithm"]: g["lr"] for g in evon.param_groups}
        assert rates["adamw"] == 0.0
        assert rates["evon"] / alpha == pytest.approx(reference.param_groups[0]["lr"] / 1e-3, rel=1e-9)


@pytest.mark.parametrize("mc_samples", [1, 3])
def test_total_flos_counts_every_sampled_forward_and_backward(tmp_path, mc_samples: int) -> None:
    """The Trainer adds ``floating_point_ops(inputs)`` once per micro-batch; EVON runs
    ``evon_mc_samples`` forward and backward passes on it, and ``total_flos`` (the model card's,
    the trainer state's) was the same at 1, 2 or 4 samples. It is K times plain Trainer's."""
    common = dict(max_steps=3, per_device_train_batch_size=8, gradient_accumulation_steps=2, save_strategy="no")
    plain = dict(output_dir=str(tmp_path / "plain"), report_to="none", use_cpu=True, disable_tqdm=True)
    reference = Trainer(model=tiny_bert(), args=TrainingArguments(**plain, **common), train_dataset=classification_data())
    reference.train()
    trainer = EVONTrainer(model=tiny_bert(), args=config(tmp_path, evon_mc_samples=mc_samples, **common),
                          train_dataset=classification_data())  # fmt: skip
    trainer.train()
    assert reference.state.total_flos > 0
    assert trainer.state.total_flos == mc_samples * reference.state.total_flos
