"""EVONTrainer with EVONConfig's defaults trains, and its BMA is calibrated on held-out data."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hf_evon import EVONConfig, EVONPosterior, EVONTrainer


class TabularClassifier(nn.Module):
    """An MLP with the Hugging Face calling convention (keyword inputs, dict output)."""

    def __init__(self, d: int, classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, classes)
        )

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class Rows(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


def breast_cancer() -> tuple[Rows, Rows, Rows]:
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    x = (x - x[:340].mean(0)) / x[:340].std(0)
    return Rows(x[:340], y[:340]), Rows(x[340:455], y[340:455]), Rows(x[455:], y[455:])


def trainer(tmp_path, **kwargs) -> tuple[EVONTrainer, Rows]:
    train, cal, test = breast_cancer()
    torch.manual_seed(0)
    args = EVONConfig(
        output_dir=str(tmp_path), report_to="none", num_train_epochs=30, per_device_train_batch_size=32,
        per_device_eval_batch_size=128, save_strategy="no", logging_steps=20, seed=0, bma_num_samples=4,
        disable_tqdm=True,
    )  # fmt: skip
    return EVONTrainer(
        model=TabularClassifier(30, 2), args=args, train_dataset=train, eval_dataset=test, **kwargs
    ), cal


def test_defaults_train_a_small_mlp_from_scratch(tmp_path) -> None:
    """The issue's reproduction: with no evon_* argument, MLPs on tabular data ended below chance
    (ζ = N: the initial noise was 3-25x the weights). Now: as good as a plain Adam run gets here."""
    from transformers import Trainer, TrainingArguments

    tr, _ = trainer(tmp_path)
    tr.train()
    metrics = tr.evaluate()
    train, _, test = breast_cancer()
    torch.manual_seed(0)
    adamw = Trainer(
        model=TabularClassifier(30, 2),
        args=TrainingArguments(
            output_dir=str(tmp_path / "adamw"),
            report_to="none",
            num_train_epochs=30,
            learning_rate=1e-3,
            per_device_train_batch_size=32,
            save_strategy="no",
            seed=0,
            disable_tqdm=True,
        ),  # fmt: skip
        train_dataset=train,
    )
    adamw.train()
    with torch.no_grad():
        adamw_accuracy = float((adamw.model(test.x)["logits"].argmax(-1) == test.y).float().mean())
    assert adamw_accuracy > 0.9  # the baseline trained
    # majority class: 0.63; before, the defaults ended at or below it
    assert metrics["eval_mean_accuracy"] >= adamw_accuracy - 0.02, (metrics, adamw_accuracy)
    assert metrics["eval_bma_accuracy"] >= adamw_accuracy - 0.02, (metrics, adamw_accuracy)
    health = tr.evon_optimizer.posterior_health(warn=False)
    assert health["noise_to_signal_max"] < 1.0 and health["hess_below_prior"] < 0.5
    logged = [h for h in tr.state.log_history if "evon/noise_to_signal" in h]
    assert logged and all(0 < h["evon/noise_to_signal"] < 1 for h in logged)


def test_calibration_dataset_sets_the_sampling_scale_used_everywhere(tmp_path) -> None:
    tr, cal = trainer(tmp_path, calibration_dataset=breast_cancer()[1])
    tr.train()
    result = tr.calibration
    # not above the mean's NLL, but where the trained posterior is kept: within min_gain of it
    assert result is not None
    assert result.chosen_nll <= result.mean_nll * (1 + result.min_gain if result.kept_trained else 1)
    posterior = tr.current_posterior()
    assert posterior.ess == result.ess
    assert posterior.config["calibration"]["nll"] == pytest.approx(result.nll)
    logged = [h for h in tr.state.log_history if "calibration/ess_multiplier" in h]
    assert logged and logged[-1]["calibration/mean_temperature"] == result.mean_temperature
    assert logged[-1]["calibration/temperature"] == result.temperature == posterior.temperature
    assert logged[-1]["calibration/seconds"] > 0  # the calibration's own cost, beside the training's
    assert logged[-1]["calibration/scanned"] == float(result.scanned)
    assert posterior.config["calibration"]["scanned"] is result.scanned
    tr.save_model(str(tmp_path / "saved"))
    loaded = EVONPosterior.from_pretrained(str(tmp_path / "saved"))
    assert loaded.ess == result.ess and loaded.config["trained_ess"] == pytest.approx(result.trained_ess)
    # calibrate() again with no minimum gain or error margin: the lowest NLL, recorded as such;
    # its outcome is shown at the default verbosity (issue 33 §3: it was only in log_history)
    from transformers.testing_utils import CaptureLogger

    import hf_evon.trainer.calibration as calibration

    with CaptureLogger(calibration.logger) as shown:
        again = tr.calibrate(min_gain=0.0, standard_errors=0.0)
    assert again.summary() in shown.out and f"{again.chosen_nll:.4f} vs {again.mean_nll:.4f}" in shown.out
    trained_nll = [] if again.trained_nll is None else [again.trained_nll]
    assert again.min_gain == 0.0 and again.chosen_nll == min([again.mean_nll, *again.nll, *trained_nll])
    assert (result.min_gain, result.standard_errors) == (0.01, 0.5) and again.nll == pytest.approx(result.nll)
    assert tr.calibrate(standard_errors=2.0).standard_errors == 2.0
    # keep_trained reaches the rule: False never scores the trained posterior against the mean
    dropped = tr.calibrate(keep_trained=False)
    assert dropped.keep_trained is False and dropped.trained_nll is None and not dropped.kept_trained
    assert result.keep_trained is True and result.trained_nll is not None  # the default scored it
    # screen_factor reaches the rule: 1e6 screens out every scale, 0 none
    assert result.screen_factor == 2.5
    everything = tr.calibrate(always_scan=True, screen_factor=1e6)
    assert everything.screen_factor == 1e6 and everything.grid == [] and len(everything.screened) == 9
    nothing = tr.calibrate(always_scan=True, screen_factor=0.0)
    assert nothing.screened == [] and len(nothing.grid) > 0
    # a further optimizer step makes the calibration stale: the trained scale is back
    tr.state.global_step += 1
    assert tr.current_posterior().ess == result.trained_ess
    assert math.isfinite(result.trained_ess)


def test_a_second_train_drops_the_first_calibration(tmp_path) -> None:
    """A calibration holds for the weights it scored: after another train() (which restarts the
    step count, here ending at the same global step) the posterior is the optimizer's as trained."""
    tr, cal = trainer(tmp_path)
    tr.args.num_train_epochs = 3
    tr.train()
    first = tr.calibrate(cal)
    assert tr.current_posterior().config["calibration"]["ess"] == first.to_json()["ess"]
    steps = tr.state.global_step
    tr.train()
    assert tr.state.global_step == steps  # what the calibration's validity check compared
    posterior = tr.current_posterior()
    trained = next(g["ess"] for g in tr.optimizer.param_groups if g["algorithm"] == "evon")
    assert "calibration" not in posterior.config and "trained_ess" not in posterior.config
    assert posterior.ess == trained != first.ess and posterior.temperature == 1.0
    assert tr.calibration is None


def test_calibrating_on_the_evaluation_data_is_refused(tmp_path) -> None:
    train, _, test = breast_cancer()
    args = EVONConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="calibration_dataset is the eval_dataset"):
        EVONTrainer(
            model=TabularClassifier(30, 2),
            args=args,
            train_dataset=train,
            eval_dataset=test,
            calibration_dataset=test,
        )
    tr = EVONTrainer(model=TabularClassifier(30, 2), args=args, train_dataset=train, eval_dataset=test)
    with pytest.raises(ValueError, match="eval_dataset"):
        tr.calibrate(test)


def test_a_recipe_fills_the_fields_left_at_their_defaults(tmp_path) -> None:
    from hf_evon import RECIPES

    args = EVONConfig(
        output_dir=str(tmp_path), report_to="none", evon_recipe="clip-finetuning", evon_hess_init=0.5
    )
    kwargs = args.evon_optimizer_kwargs()
    recipe = RECIPES["clip-finetuning"]
    assert kwargs["hess_init"] == 0.5  # set by the user: wins
    assert kwargs["lr"] == recipe["lr"] and kwargs["ess"] == recipe["ess"] and kwargs["clip"] == "whiten"
    assert kwargs["betas"] == recipe["betas"] and kwargs["weight_decay"] == recipe["weight_decay"]
    assert kwargs["snr_scaling"] is False and EVONConfig(output_dir=str(tmp_path)).evon_snr_scaling is None
    off = EVONConfig(output_dir=str(tmp_path), report_to="none", evon_snr_scaling=False)  # no recipe: as set
    assert off.evon_optimizer_kwargs()["snr_scaling"] is False
    with pytest.raises(ValueError, match="evon_recipe"):
        EVONConfig(output_dir=str(tmp_path), report_to="none", evon_recipe="gpt5")


@pytest.mark.parametrize("recipe", ["nanogpt", "clip-finetuning"])
def test_a_recipe_trains_peft_adapters_at_its_alpha_as_build_optimizer_does(tmp_path, recipe: str) -> None:
    """``EVONConfig(evon_recipe=...)`` through PEFT split the adapters off at 2.5x the recipe's α (the
    default adapter scale of its 'whiten'/'spectral' clip), where ``build_optimizer(recipe=...)`` and
    the docs give them the recipe's α as tabled: the config merged the recipe's values itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_evon import RECIPES, build_optimizer

    def model() -> nn.Module:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))

    lora = dict(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    args = EVONConfig(output_dir=str(tmp_path), report_to="none", evon_recipe=recipe)
    trainer = EVONTrainer(model=model(), args=args, peft_config=LoraConfig(**lora))
    trainer.create_optimizer()
    own = build_optimizer(get_peft_model(model(), LoraConfig(**lora)), recipe=recipe)
    rates = [g["lr"] for g in trainer.evon_optimizer.param_groups if g["algorithm"] == "evon"]
    assert rates == [g["lr"] for g in own.param_groups if g["algorithm"] == "evon"] == [RECIPES[recipe]["lr"]]


def test_the_recipe_help_says_a_field_set_to_its_default_takes_the_recipes_value(tmp_path) -> None:
    """evon_recipe's help promised "fields you set yourself win", but a field set to its default value
    cannot be told from one left unset: --evon_hess_estimator fisher (the default) with the
    clip-finetuning recipe trained with the recipe's 'price'."""
    from transformers import HfArgumentParser

    argv = ["--output_dir", str(tmp_path), "--evon_recipe", "clip-finetuning", "--evon_hess_estimator", "fisher"]
    (args,) = HfArgumentParser(EVONConfig).parse_args_into_dataclasses(args=argv)
    assert args.evon_optimizer_kwargs()["hess_estimator"] == "price"
    help_text = " ".join(EVONConfig.__dataclass_fields__["evon_recipe"].metadata["help"].split())
    assert "fields you set yourself win" not in help_text
    assert "a field set to its default value takes the recipe's" in help_text


def test_the_basis_ratio_help_says_it_shapes_the_evaluations_posterior_too(tmp_path) -> None:
    """posterior_max_basis_ratio's help said it applies to saved posteriors, but the posterior the
    trainer builds from its optimizer is lean for every use: evaluate()'s and predict()'s BMA samples
    and calibrate() draw from the posterior with the wide bases dropped."""
    help_text = " ".join(EVONConfig.__dataclass_fields__["posterior_max_basis_ratio"].metadata["help"].split())
    assert not help_text.startswith("Saved posteriors drop")
    assert "evaluate()'s and predict(bma=True)'s BMA samples" in help_text and "current_posterior()" in help_text
    t, _ = trainer(tmp_path)
    t.args.max_steps = 2
    t.train()
    assert t.current_posterior().config["max_basis_ratio"] == t.args.posterior_max_basis_ratio == 3.0
    assert t._evaluated_posterior().config["max_basis_ratio"] == 3.0  # what evaluate()'s BMA samples


def _rates(trainer: EVONTrainer) -> dict[str, set[float]]:
    rates: dict[str, set[float]] = {}
    for g in trainer.create_optimizer().param_groups:
        rates.setdefault(g["algorithm"], set()).add(round(g["lr"], 12))
    return rates


def _clips(trainer: EVONTrainer) -> set[str]:
    return {g["clip"] for g in trainer.create_optimizer().param_groups if g["algorithm"] == "evon"}


def _hess_inits(trainer: EVONTrainer) -> set[float]:
    return {g["hess_init"] for g in trainer.create_optimizer().param_groups if g["algorithm"] == "evon"}


def _snr_scalings(trainer: EVONTrainer) -> set[bool | str]:
    return {g["snr_scaling"] for g in trainer.create_optimizer().param_groups if g["algorithm"] == "evon"}


def test_an_unset_learning_rate_is_chosen_from_how_the_model_is_trained(tmp_path) -> None:
    from peft import LoraConfig, TaskType
    from test_trainer import classification_data, tiny_bert

    data = classification_data(16)
    args = dict(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    scratch = EVONTrainer(model=tiny_bert(), args=EVONConfig(**args), train_dataset=data)
    assert scratch.args.learning_rate == 1e-3  # built from a config: from scratch
    # from scratch: whitened steps of entry RMS 1.6 · rate (STEP_RATIOS), α = 1.6 · 1e-3 / 0.01
    assert _rates(scratch) == {"evon": {0.16}, "adamw": {1e-3}} and _clips(scratch) == {"whiten_rms"}
    assert _hess_inits(scratch) == {0.01} and _snr_scalings(scratch) == {"adam"}

    tiny_bert().save_pretrained(tmp_path / "pretrained")
    from transformers import BertForSequenceClassification

    def pretrained() -> BertForSequenceClassification:
        return BertForSequenceClassification.from_pretrained(tmp_path / "pretrained")

    full = EVONTrainer(model=pretrained(), args=EVONConfig(**args), train_dataset=data)
    assert full.args.learning_rate == 5e-5  # full fine-tuning: the Trainer's default
    # full fine-tuning: "element", every matrix (the new task head too) bounded by AdamW's own step,
    # 1.0 · rate per entry: α = rate / radius, one EVON group
    from hf_evon.optim.defaults import ADAPTER_STEP_RATIO, DEFAULT_FINETUNING_HESS_INIT, STEP_RATIOS

    assert STEP_RATIOS[("element", True)] == ADAPTER_STEP_RATIO == 1.0
    assert _rates(full) == {"evon": {round(5e-5 / 0.01, 12)}, "adamw": {5e-5}} and _clips(full) == {"element"}
    evon_groups = [g["param_names"] for g in full.create_optimizer().param_groups if g["algorithm"] == "evon"]
    assert len(evon_groups) == 1 and "classifier.weight" in evon_groups[0]
    # full fine-tuning starts from a smaller h0 (default_hess_init)
    assert _hess_inits(full) == {DEFAULT_FINETUNING_HESS_INIT} and DEFAULT_FINETUNING_HESS_INIT < 0.01
    # and its clipped steps follow Adam's step size, min(1, ρ) (DEFAULT_SNR_SCALING)
    assert _snr_scalings(full) == {"adam"}
    for given, expected in (("false", False), ("true", True), (True, True), ("adam", "adam")):
        chosen = EVONTrainer(model=pretrained(), args=EVONConfig(**args, evon_snr_scaling=given), train_dataset=data)
        assert _snr_scalings(chosen) == {expected}  # set by the user: wins
    for bad in ("yes", 1, ["adam"]):
        with pytest.raises(ValueError, match="evon_snr_scaling"):
            EVONConfig(**args, evon_snr_scaling=bad)
    given_h0 = EVONTrainer(model=pretrained(), args=EVONConfig(**args, evon_hess_init=0.02), train_dataset=data)
    assert _hess_inits(given_h0) == {0.02}  # set by the user: wins

    # from_config of the checkpoint's config: its name is in the config, but the weights are new
    from transformers import AutoConfig, AutoModelForSequenceClassification

    built = AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(tmp_path / "pretrained")
    )
    assert built.config._name_or_path == str(tmp_path / "pretrained")
    fresh = EVONTrainer(model=built.eval(), args=EVONConfig(**args), train_dataset=data)  # eval mode too
    assert fresh.args.learning_rate == 1e-3 and _rates(fresh) == {"evon": {0.16}, "adamw": {1e-3}}
    assert _clips(fresh) == {"whiten_rms"} and _hess_inits(fresh) == {0.01}

    # a linear probe (backbone frozen) trains a new head from scratch, not a pretrained model
    probe = pretrained()
    for p in probe.bert.parameters():
        p.requires_grad_(False)
    assert EVONTrainer(model=probe, args=EVONConfig(**args), train_dataset=data).args.learning_rate == 1e-3

    # the word embeddings frozen (to save memory), the encoder trained: still full fine-tuning. The rule
    # counted every entry, and a small encoder's vocabulary table holds most of them (MiniLM: 52%): a
    # frozen table switched the run to the from-scratch defaults (α 32x, AdamW's rate 20x).
    from transformers import BertConfig

    torch.manual_seed(0)
    big_vocab = BertForSequenceClassification(BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=1000,
        max_position_embeddings=32, num_labels=3,
    ))  # fmt: skip
    big_vocab.save_pretrained(tmp_path / "big_vocab")
    table_frozen = BertForSequenceClassification.from_pretrained(tmp_path / "big_vocab")
    table = table_frozen.bert.embeddings.word_embeddings.weight
    assert 2 * table.numel() > sum(p.numel() for p in table_frozen.parameters())  # most of the entries
    table.requires_grad_(False)
    frozen = EVONTrainer(model=table_frozen, args=EVONConfig(**args), train_dataset=data)
    assert frozen.args.learning_rate == 5e-5 and _clips(frozen) == {"element"}

    # one unset config serves trainers of both kinds: each resolves its own rate, the config stays unset
    shared = EVONConfig(**args)
    assert EVONTrainer(model=pretrained(), args=shared, train_dataset=data).args.learning_rate == 5e-5
    assert shared.learning_rate is None
    assert EVONTrainer(model=tiny_bert(), args=shared, train_dataset=data).args.learning_rate == 1e-3

    lora = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, lora_alpha=8, target_modules=["query", "value"])
    adapter = EVONTrainer(model=pretrained(), args=EVONConfig(**args), train_dataset=data, peft_config=lora)
    assert adapter.args.learning_rate == 1e-3  # PEFT trains adapters (and the new head) from scratch
    assert _hess_inits(adapter) == {0.01}
    opt = adapter.create_optimizer()
    fast = [
        n
        for g in opt.param_groups
        if g["algorithm"] == "evon"
        for n in g["param_names"]
        if round(g["lr"], 12) == 0.1  # α 0.16, adapters at 0.625x with "whiten_rms"
    ]
    evon = [n for g in opt.param_groups if g["algorithm"] == "evon" for n in g["param_names"]]
    assert (
        fast == evon and "base_model.model.classifier.modules_to_save.default.weight" in fast
    )  # the new head too

    given = EVONTrainer(model=pretrained(), args=EVONConfig(**args, learning_rate=2e-4), train_dataset=data)
    assert given.args.learning_rate == 2e-4
    assert _rates(given) == {"evon": {round(2e-4 / 0.01, 12)}, "adamw": {2e-4}}
    alpha = EVONConfig(**args, learning_rate=2e-4, evon_learning_rate=0.05, evon_adamw_learning_rate=1e-5)
    assert _rates(EVONTrainer(model=pretrained(), args=alpha, train_dataset=data)) == {
        "evon": {0.05},  # the head's scale is 1: its bound is the body's
        "adamw": {1e-5},
    }


STEPS = 400


class Blocks(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _lm_eval_loss(tmp_path, name: str, evon: bool, **evon_fields) -> float:
    """A tiny GPT-2 from scratch on stdlib text, trained by the Trainer with its defaults
    (learning rate unset: 1e-3 for EVON, the rate we give AdamW too); held-out eval loss."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from hf_evon.data import encode_documents, split_documents, stdlib_corpus, train_bpe_tokenizer

    train_docs, held_docs = split_documents(stdlib_corpus(max_bytes=300_000, include_docs=False), 0.1)
    tok = train_bpe_tokenizer((t for _, t in train_docs), vocab_size=512)
    ctx = 32

    def blocks(docs: list) -> Blocks:
        ids = encode_documents(tok, [t for _, t in docs]).long()
        return Blocks(ids[: len(ids) // ctx * ctx].view(-1, ctx))

    train, held = blocks(train_docs), blocks(held_docs)
    held.ids = held.ids[:64]
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=len(tok), n_positions=ctx, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    common = dict(
        output_dir=str(tmp_path / name), report_to="none", max_steps=STEPS, per_device_train_batch_size=16,
        save_strategy="no", seed=0, disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    if evon:
        args = EVONConfig(**common, bma_num_samples=0, **evon_fields)
        tr = EVONTrainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=train, eval_dataset=held)
        tr.train()
        return tr.evaluate()["eval_loss"]  # at the posterior mean
    args = TrainingArguments(**common, learning_rate=1e-3)
    tr = Trainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=train, eval_dataset=held)
    tr.train()
    return tr.evaluate()["eval_loss"]


def test_defaults_train_a_tiny_gpt2_from_scratch_as_well_as_adamw(tmp_path) -> None:
    """The issue's reproduction: a tiny GPT-2 stayed at ln V with the first defaults (eval 6.83 vs
    AdamW 6.00). Measured here (eval loss at 400 steps): AdamW 4.172, the defaults 4.238 (+1.6%:
    at this width, 64, EVON trails a little; at 128 in benchmarks/payoff.py it leads by 3%);
    steps not scaled by Adam's min(1, ρ) (``snr_scaling=True``) 4.197, at the cost of memorising
    noisy labels (docs/defaults.md#snr-adam)."""
    adamw = _lm_eval_loss(tmp_path, "adamw", evon=False)
    evon = _lm_eval_loss(tmp_path, "evon", evon=True)
    assert adamw < math.log(512) - 1.0  # the baseline learned
    assert evon <= adamw * 1.02, (evon, adamw)


def test_a_run_without_noise_skips_the_end_of_training_calibration(tmp_path) -> None:
    """evon_ess=inf (SOAP mode) with a calibration_dataset trained, then raised in the automatic
    calibration ("nothing to calibrate") and saved nothing; it now keeps the point-mass posterior."""
    train, cal, test = breast_cancer()
    args = EVONConfig(output_dir=str(tmp_path), report_to="none", max_steps=3, per_device_train_batch_size=32,
                      save_strategy="no", seed=0, bma_num_samples=2, disable_tqdm=True, evon_ess=math.inf)  # fmt: skip
    tr = EVONTrainer(model=TabularClassifier(30, 2), args=args, train_dataset=train, calibration_dataset=cal)
    tr.train()
    assert tr.calibration is None and tr.current_posterior().is_point_mass
    with pytest.raises(ValueError, match="nothing to calibrate"):  # asked for by hand: still said
        tr.calibrate()


def test_the_weight_decay_help_says_the_prior_is_fitted_after_the_first_weight_update() -> None:
    """evon_weight_decay's help said the fitted prior comes "after the second update", but the first
    step() only sets up the eigenbases (the weights stay): δ is fitted after the first weight update,
    the second step(), as docs/algorithm.md says."""
    from hf_evon import build_optimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    kwargs = EVONConfig(output_dir="unused", report_to="none").evon_optimizer_kwargs()
    opt = build_optimizer(model, **kwargs)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    seen = []
    for _ in range(2):
        weight = model[0].weight.detach().clone()
        with opt.sampled_params(train=True):
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        seen.append((torch.equal(weight, model[0].weight), opt.param_groups[0]["weight_decay"]))
    (first_kept, prior_after_first), (second_kept, prior_after_second) = seen
    assert first_kept and not second_kept and prior_after_second != prior_after_first
    help_text = " ".join(EVONConfig.__dataclass_fields__["evon_weight_decay"].metadata["help"].split())
    assert "after the second update" not in help_text
    assert "fitted after the first weight update (the second step())" in help_text
