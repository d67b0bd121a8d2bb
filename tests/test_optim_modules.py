"""The pieces EVON is built from, used alone: validation, modes, the functional kernels, the hooks."""

from __future__ import annotations

import math

import pytest
import torch

from hf_evon import EVON
from hf_evon.optim import functional as F
from hf_evon.optim.checks import CLIP_MODES, Clip, NonFinite
from hf_evon.optim.hooks import LOCAL, ShardingHooks
from hf_evon.optim.validation import validate_group, validate_hyperparameters

INVALID = [
    {"lr": -0.1},
    {"ess": 0.0},
    {"betas": (0.9, 1.0)},
    {"clip": "norm"},
    {"snr_scaling": "yes"},
    {"nonfinite": "ignore"},
    {"adamw_eps": 0.0},
    {"hess_init": 0.0, "weight_decay": None},
    {"init_std_ratio": 0.3},
]


@pytest.mark.parametrize("kwargs", INVALID, ids=[next(iter(k)) for k in INVALID])
def test_validate_hyperparameters_raises_evons_own_message(kwargs: dict) -> None:
    with pytest.raises(ValueError) as from_evon:
        EVON([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs)
    with pytest.raises(ValueError) as alone:
        validate_hyperparameters(**kwargs)
    assert str(alone.value) == str(from_evon.value)


def test_validate_hyperparameters_resolves_the_default_rate() -> None:
    opt = EVON([torch.nn.Parameter(torch.zeros(2, 2))], clip="element")
    assert validate_hyperparameters(lr=None, clip="element")["lr"] == opt.defaults["lr"]
    with pytest.raises(TypeError, match="lrr"):
        validate_hyperparameters(lrr=0.1)


def test_validate_group_names_the_field() -> None:
    with pytest.raises(ValueError, match="algorithm"):
        validate_group({"algorithm": "sgd", "params": []})
    validate_group({"algorithm": "evon", "params": [], "clip": Clip.ELEMENT})


def test_modes_are_str_enums_stored_as_plain_strings() -> None:
    assert CLIP_MODES == ("none", "element", "spectral", "whiten", "whiten_rms")
    assert Clip.WHITEN_RMS == "whiten_rms" and NonFinite.RAISE == "raise"
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = EVON([p], clip=Clip.ELEMENT, nonfinite=NonFinite.RAISE, ess=10.0)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, 3))], "clip": Clip.NONE})
    assert [type(g["clip"]) for g in opt.param_groups] == [str, str] and opt.nonfinite == "raise"
    assert [g["clip"] for g in opt.param_groups] == ["element", "none"]


def test_hessian_update_is_the_clipped_ema_with_ivons_correction() -> None:
    gen = torch.Generator().manual_seed(0)
    hess = torch.rand(2, 3, 4, generator=gen, dtype=torch.float64) + 0.1
    h_hat = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
    beta2, delta, gamma, eps = 0.9, 1e-3, 2.0, 1e-12
    clipped = h_hat.clamp(-gamma * (hess + eps), gamma * (hess + eps))
    expected = (
        beta2 * hess
        + (1 - beta2) * clipped
        + ((1 - beta2) * (hess - clipped)).square() / (2 * (hess + delta))
    )
    got = F.hessian_update(hess, h_hat, beta2, delta, 1e4, gamma, eps)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    # ess = inf: squared gradients, no correction
    no_noise = F.hessian_update(hess, h_hat.square(), beta2, delta, math.inf, None, eps)
    torch.testing.assert_close(no_noise, beta2 * hess + (1 - beta2) * h_hat.square())


def test_momentum_newton_step_and_snr_scale() -> None:
    gen = torch.Generator().manual_seed(1)
    exp_avg = torch.randn(2, 3, 3, generator=gen, dtype=torch.float64)
    g_rot = torch.randn(2, 3, 3, generator=gen, dtype=torch.float64)
    hess = torch.rand(2, 3, 3, generator=gen, dtype=torch.float64) + 0.5
    before = exp_avg.clone()
    momentum = F.momentum_update(exp_avg, g_rot, 0.9)
    assert momentum is exp_avg
    torch.testing.assert_close(exp_avg, 0.9 * before + 0.1 * g_rot)
    numer = exp_avg / (1 - 0.9**3)
    step = F.newton_step(numer.clone(), hess, 0.01, None)
    torch.testing.assert_close(step, numer / (hess + 0.01))
    # first step: the EMA of ‖G‖² is ‖G‖² after its bias correction, and m̂ = m / (1 - 0.9)
    scale = F.snr_scale(torch.zeros(2, dtype=torch.float64), exp_avg, g_rot, 1, 0.9, adam=True)
    rho = exp_avg.flatten(1).norm(dim=1) / (1 - 0.9) / g_rot.flatten(1).norm(dim=1)
    torch.testing.assert_close(scale, rho.clamp(max=1.0))


def test_the_local_hooks_are_one_process() -> None:
    p = torch.nn.Parameter(torch.ones(2, 3))
    p.grad = torch.full((2, 3), 2.0)
    assert isinstance(LOCAL, ShardingHooks) and LOCAL.owns(p) and LOCAL.all_ranks(False) is False
    assert LOCAL.bucket_param(p) is p and LOCAL.model_param(p) is p
    assert LOCAL.square_sums([p]).tolist() == [6.0]
    params, grads = LOCAL.adamw_tensors([p])
    assert params == [p] and grads[0] is p.grad
    opt = EVON([p], ess=10.0)
    assert opt.sharding is None and opt.sample_blocks == 0
    with opt.sampled_params(train=False):
        assert opt.noise_label == "eval 1"
    with opt.sampled_params(train=True):
        assert opt.noise_label == 1
    assert opt.sample_blocks == 1


def test_name_patterns_are_whole_regexes_and_a_bad_one_is_named() -> None:
    # a string was read letter by letter: "mlp" meant "m", "l" and "p", and every matrix went to AdamW
    from hf_evon import build_optimizer

    nn = torch.nn
    model = nn.Sequential()
    model.add_module("attn", nn.Linear(4, 4))
    model.add_module("mlp", nn.Linear(4, 4))
    model.add_module("out", nn.Linear(4, 2))
    evon = lambda opt: [n for g in opt.param_groups if g["algorithm"] == "evon" for n in g["param_names"]]  # noqa: E731
    assert evon(build_optimizer(model, adamw_patterns="mlp")) == evon(build_optimizer(model, adamw_patterns=["mlp"]))
    assert evon(build_optimizer(model, adamw_patterns="mlp")) == ["attn.weight", "out.weight"]
    with pytest.raises(ValueError, match=r"evon_patterns: '\[' is not a valid regex"):
        build_optimizer(model, evon_patterns="[")
    with pytest.raises(TypeError, match=r"adamw_patterns: each pattern must be a regex string; got 5"):
        build_optimizer(model, adamw_patterns=[5])
    # not a string or an iterable of strings: named, with the type given (a compiled regex, a number and
    # bytes raised "'re.Pattern' object is not iterable", "'int' object ..." and "... got 48")
    import re

    for bad in (re.compile("mlp"), 5, b"mlp"):
        with pytest.raises(TypeError, match=rf"evon_patterns: expected a regex string or a list of them; got {type(bad).__name__}"):
            build_optimizer(model, evon_patterns=bad)
    assert evon(build_optimizer(model, adamw_patterns=(p for p in ["mlp"]))) == ["attn.weight", "out.weight"]


def test_patterns_given_as_a_generator_are_read_once() -> None:
    """A generator of adamw_patterns sent the prompt-tuning adapter to AdamW, then was found empty where
    build_optimizer read it again: its check of adapters left to AdamW saw no pattern and warned that the
    adapter goes uncovered, as if the user had not named it (a list gave no warning)."""
    import warnings

    import peft
    from transformers import BertConfig, BertForSequenceClassification

    from hf_evon import build_optimizer

    torch.manual_seed(0)
    bert = BertForSequenceClassification(
        BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                   vocab_size=100, num_labels=3)
    )  # fmt: skip
    model = peft.get_peft_model(bert, peft.PromptTuningConfig(num_virtual_tokens=4, task_type="SEQ_CLS"))
    for patterns in (["prompt_encoder"], (p for p in ["prompt_encoder"])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer = build_optimizer(model, adamw_patterns=patterns)
        assert [str(w.message) for w in caught if "adapter" in str(w.message)] == [], type(patterns)
        adamw = [n for g in optimizer.param_groups if g["algorithm"] == "adamw" for n in g["param_names"]]
        assert "prompt_encoder.default.embedding.weight" in adamw


def test_a_model_without_parameters_is_named_as_such() -> None:
    from hf_evon import build_optimizer

    with pytest.raises(ValueError, match=r"the model has no parameters"):
        build_optimizer(torch.nn.Module())
    frozen = torch.nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(ValueError, match=r"requires_grad=False"):
        build_optimizer(frozen)


def test_a_pattern_matches_a_tied_weight_by_any_of_its_names_and_one_matching_nothing_warns() -> None:
    # GPT-2's lm_head.weight is transformer.wte.weight: patterns saw only the first name, so
    # evon_patterns=["lm_head"] matched nothing, silently
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_evon import build_optimizer

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    assert model.lm_head.weight is model.transformer.wte.weight
    def names(opt: EVON, algorithm: str) -> list[str]:
        return [n for g in opt.param_groups if g["algorithm"] == algorithm for n in g["param_names"]]

    matrices = [f"transformer.h.0.{m}.weight" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc")]
    matrices.append("transformer.h.0.mlp.c_proj.weight")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every pattern matches: no warning
        for pattern in ("lm_head", r"^lm_head\.weight$", "wte"):
            opt = build_optimizer(model, evon_patterns=[pattern])
            assert names(opt, "evon") == ["transformer.wte.weight", *matrices], pattern
            assert "transformer.wte.weight" not in names(opt, "adamw")
            assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
        assert names(build_optimizer(model, adamw_patterns="lm_head"), "evon") == matrices
    with pytest.warns(UserWarning, match=r"evon_patterns: 'lm_haed' matches no parameter name of the model"):
        opt = build_optimizer(model, evon_patterns=["lm_haed"])
    assert names(opt, "evon") == matrices


def test_parameters_instead_of_a_model_are_refused_by_name_and_a_generator_is_left_unread() -> None:
    # the split needs the modules (embeddings, the output head): parameters or groups raised
    # "AttributeError: 'generator' object has no attribute 'modules'"
    from hf_evon import build_optimizer, build_param_groups

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for build in (build_optimizer, build_param_groups):
        given = model.parameters()
        with pytest.raises(TypeError, match=rf"^{build.__name__}: model must be a torch\.nn\.Module; got a generator"):
            build(given)
        assert next(given) is model[0].weight  # not consumed: it can still go to EVON(params)
        for given in (list(model.parameters()), [{"params": list(model.parameters())}]):
            with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module; got a list.*EVON\(params"):
                build(given)


def test_describe_param_groups_given_a_model_names_what_it_takes() -> None:
    # a model (the usage guide's "build_param_groups / describe_param_groups show the split") raised
    # "TypeError: 'Linear' object is not subscriptable" from inside the loop
    from hf_evon import build_optimizer, build_param_groups, describe_param_groups

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(TypeError, match=r"^describe_param_groups: groups must be.*got a Sequential.*build_param_groups"):
        describe_param_groups(model)
    lines = describe_param_groups(build_param_groups(model)).splitlines()
    assert lines == describe_param_groups(build_optimizer(model).param_groups).splitlines()
    assert [line.split()[:3] for line in lines] == [["evon", "24", "params"], ["adamw", "6", "params"]]


def test_a_pattern_matching_nothing_is_warned_at_the_callers_line() -> None:
    # through build_optimizer the warning named grouping.py's call of build_param_groups
    from hf_evon import build_optimizer, build_param_groups

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for build in (build_optimizer, build_param_groups):
        with pytest.warns(UserWarning, match="evon_patterns: 'nothing' matches no parameter name") as record:
            build(model, evon_patterns="nothing")
        assert [w.filename for w in record] == [__file__], build.__name__
    with pytest.warns(UserWarning, match="EVON trains none of this model's parameters") as record:
        build_optimizer(model, adamw_patterns=".*")
    assert [w.filename for w in record] == [__file__]


def test_lora_on_the_output_head_trains_its_factors_with_evon_at_the_adapter_rate() -> None:
    # get_output_embeddings() returns PEFT's LoRA wrapper of the head: its lora_A/lora_B went to
    # AdamW as "the output head", while LoRA on an embedding goes to EVON
    import peft

    class Base(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)
            self.out = torch.nn.Linear(8, 5)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.out

    from hf_evon import build_optimizer

    plain = build_optimizer(Base(), learning_rate=1e-3)
    assert [g["param_names"] for g in plain.param_groups if g["algorithm"] == "adamw"][0] == ["out.weight"]
    model = peft.get_peft_model(Base(), peft.LoraConfig(r=2, target_modules=["proj", "out"]))
    opt = build_optimizer(model, learning_rate=1e-3)
    evon = {n: g["lr"] for g in opt.param_groups if g["algorithm"] == "evon" for n in g["param_names"]}
    lora = sorted(n for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)
    assert sorted(evon) == lora and any(".out." in n for n in lora)
    assert list(evon.values()) == pytest.approx([0.1] * len(lora), rel=1e-12)  # 1.6·1e-3/0.01·0.625
    assert [g["param_names"] for g in opt.param_groups if g["algorithm"] == "adamw"] == []


def test_a_vits_learned_tokens_and_position_embeddings_go_to_adamw_and_its_patch_conv_to_evon() -> None:
    """ViT's ``cls_token`` [1, 1, D] (a vector) and ``position_embeddings`` [1, N, D] (an embedding
    table) are bare parameters broadcast over the batch; they went to EVON as 3-D "matrices", where
    BERT's position embeddings (an ``nn.Embedding``) go to AdamW. A conv kernel with one output
    channel [1, C, k, k] stays EVON's, and ``evon_patterns`` moves a token back."""
    from transformers import ViTConfig, ViTForImageClassification

    from hf_evon import build_param_groups

    vit = ViTForImageClassification(
        ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                  image_size=8, patch_size=4, num_labels=3)
    )  # fmt: skip
    groups = build_param_groups(vit, adamw_weight_decay=0.1)
    named = dict(vit.named_parameters())
    matrices = sorted(n for n, p in named.items() if n.endswith(".weight") and p.ndim >= 2)
    assert [(g["algorithm"], g["weight_decay"] if g["algorithm"] == "adamw" else None) for g in groups] == [
        ("evon", None), ("adamw", 0.1), ("adamw", 0.0)
    ]
    evon, decay, no_decay = (g["param_names"] for g in groups)
    assert "vit.embeddings.patch_embeddings.projection.weight" in matrices
    assert sorted(evon) == matrices
    assert decay == ["vit.embeddings.position_embeddings"]
    assert sorted(no_decay) == sorted(["vit.embeddings.cls_token", *(n for n, p in named.items() if p.ndim == 1)])
    back = build_param_groups(vit, evon_patterns="cls_token")
    assert "vit.embeddings.cls_token" in back[0]["param_names"]
    one_channel = torch.nn.Sequential(torch.nn.Conv2d(3, 1, 3, bias=False))
    assert [g["algorithm"] for g in build_param_groups(one_channel)] == ["evon"]


@pytest.mark.filterwarnings("ignore:Failed to load the CUDA extension", "ignore:Setting boft_n_butterfly_factor")
def test_a_boft_adapters_rotations_go_to_evon_beside_a_vits_broadcast_tokens() -> None:
    """BOFT's rotations ``boft_R`` [1, blocks, b, b] have a leading 1 as ViT's tokens do, but are a stack
    of matrices that multiply their layer's weight, not a tensor broadcast over the batch: they went to
    AdamW as an embedding table, and the posterior covered only BOFT's scales. They are EVON's now,
    while the ViT's ``cls_token`` and ``position_embeddings`` stay AdamW's."""
    import peft
    from transformers import ViTConfig, ViTForImageClassification

    from hf_evon import build_param_groups

    vit = ViTForImageClassification(
        ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                  image_size=8, patch_size=4, num_labels=3)
    )  # fmt: skip
    model = peft.get_peft_model(vit, peft.BOFTConfig(boft_block_size=4, target_modules=["q_proj", "v_proj"]))
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rotations = sorted(n for n in named if ".boft_R." in n)
    assert len(rotations) == 2 and all(named[n].shape == (1, 2, 4, 4) for n in rotations)
    groups = build_param_groups(model)
    assert [g["algorithm"] for g in groups] == ["evon"]
    assert sorted(groups[0]["param_names"]) == sorted(named)  # the rotations and the scales [8, 1]
    model.base_model.model.vit.embeddings.cls_token.requires_grad_(True)
    model.base_model.model.vit.embeddings.position_embeddings.requires_grad_(True)
    by_algorithm = [(g["algorithm"], sorted(g["param_names"])) for g in build_param_groups(model)]
    assert by_algorithm == [
        ("evon", sorted(named)),
        ("adamw", ["base_model.model.vit.embeddings.position_embeddings"]),
        ("adamw", ["base_model.model.vit.embeddings.cls_token"]),
    ]


def test_an_adapter_whose_own_tensors_all_go_to_adamw_is_named_with_the_patterns_that_cover_it() -> None:
    """VeRA's trainable tensors are vectors (``vera_lambda_b``/``vera_lambda_d``), AdamW's by the split:
    on a classifier EVON trains only the head's copy, so the posterior covered none of the adapter and
    nothing said so. build_optimizer warns once, naming the kind and the evon_patterns that cover it;
    with those, the vectors are EVON's and nothing is warned. LoRA (EVON's) is not warned about."""
    import warnings

    import peft
    from transformers import BertConfig, BertForSequenceClassification

    from hf_evon import build_optimizer

    def vera(kind: str = "vera") -> torch.nn.Module:
        torch.manual_seed(0)
        bert = BertForSequenceClassification(
            BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=32, num_labels=3)
        )  # fmt: skip
        config = {
            "vera": peft.VeraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"]),
            "lora": peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query", "value"]),
        }[kind]
        return peft.get_peft_model(bert, config)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = build_optimizer(vera(), ess=100.0)
    named = [str(w.message) for w in caught if "evon_patterns" in str(w.message)]
    assert len(named) == 1 and [w.filename for w in caught if "evon_patterns" in str(w.message)] == [__file__]
    assert "VERA adapter 'default'" in named[0]
    assert "evon_patterns=['vera_lambda_b', 'vera_lambda_d']" in named[0]
    evon = [n for g in optimizer.param_groups if g["algorithm"] == "evon" for n in g["param_names"]]
    assert evon == ["base_model.model.classifier.modules_to_save.default.weight"]

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*evon_patterns")
        model = vera()
        optimizer = build_optimizer(model, ess=100.0, evon_patterns=["vera_lambda_b", "vera_lambda_d"])
        build_optimizer(vera("lora"), ess=100.0)
    vectors = [n for n, p in model.named_parameters() if p.requires_grad and ".vera_lambda_" in n]
    evon = [n for g in optimizer.param_groups if g["algorithm"] == "evon" for n in g["param_names"]]
    assert len(vectors) == 4 and set(vectors) < set(evon)

    from peft import PromptTuningConfig, TaskType
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    prompted = peft.get_peft_model(gpt2, PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4))
    with warnings.catch_warnings(record=True) as caught:  # EVON trains nothing: one warning says both
        warnings.simplefilter("always")
        build_optimizer(prompted)
    named = [str(w.message) for w in caught if "evon_patterns" in str(w.message)]
    assert len(named) == 1 and "EVON trains none" in named[0]
    assert named[0].endswith("for the PROMPT_TUNING adapter 'default': evon_patterns=['prompt_encoder']")


@pytest.mark.parametrize("copied", ["lm_head", "embed_tokens"])
def test_modules_to_save_copies_of_the_head_or_embeddings_left_to_adamw_are_named(copied: str) -> None:
    """LoRA with ``modules_to_save=["lm_head"]`` (or the embeddings): the copy, a table like the model's
    own head, went to AdamW, and nothing said that the posterior covers none of it (86% of the trained
    entries of this model). build_optimizer warns naming the copy and the evon_patterns that give it to
    EVON; with those, the copy is EVON's and nothing is warned."""
    import warnings

    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_evon import build_optimizer

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        llama = LlamaForCausalLM(
            LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2)
        )  # fmt: skip
        config = peft.LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"], modules_to_save=[copied])
        return peft.get_peft_model(llama, config)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = build_optimizer(model())
    named = [str(w.message) for w in caught if "modules_to_save copies" in str(w.message)]
    assert len(named) == 1 and f"{copied}.modules_to_save.default.weight" in named[0]
    pattern = rf"{copied}\.modules_to_save\."
    assert named[0].endswith(f"evon_patterns={[pattern]} (EVONConfig's evon_patterns for the trainer)")
    adamw = [n for g in optimizer.param_groups if g["algorithm"] == "adamw" for n in g["param_names"]]
    assert [n for n in adamw if "modules_to_save" in n] == [n for n in adamw if copied in n] != []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*modules_to_save")
        optimizer = build_optimizer(model(), evon_patterns=[pattern])
    evon = [n for g in optimizer.param_groups if g["algorithm"] == "evon" for n in g["param_names"]]
    assert any(f"{copied}.modules_to_save" in n for n in evon)


def test_the_adamw_rate_and_decay_given_to_the_split_are_named_when_invalid() -> None:
    # they reached EVON inside the AdamW groups and were refused as "Invalid lr" / "Invalid weight_decay"
    from hf_evon import build_optimizer, build_param_groups

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for build in (build_optimizer, build_param_groups):
        with pytest.raises(ValueError, match=r"^Invalid adamw_lr: -1\.0 \(must be"):
            build(model, adamw_lr=-1.0)
        with pytest.raises(ValueError, match=r"^Invalid adamw_weight_decay: nan \(must be"):
            build(model, adamw_weight_decay=float("nan"))


def test_a_recipe_given_as_its_settings_rather_than_its_name_is_refused_by_name() -> None:
    # RECIPES["llama"] itself as recipe= raised "TypeError: unhashable type: 'dict'"
    from hf_evon import RECIPES, build_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for given in (RECIPES["llama"], ["llama"]):
        with pytest.raises(TypeError, match=r"^recipe: one of \['clip-finetuning', 'llama', 'nanogpt'\] or None"):
            build_optimizer(model, recipe=given)
    with pytest.raises(ValueError, match=r"^unknown recipe 'Llama': choose one of \['clip-finetuning', 'llama'"):
        build_optimizer(model, recipe="Llama")


def test_an_adapter_that_is_trainable_but_not_active_is_refused_naming_it(tmp_path) -> None:
    """PEFT's ``load_adapter(path, "b", is_trainable=True)`` beside the active adapter leaves "b"
    trainable but out of the forward. EVON took its tensors, the posterior covered them, and after the
    whole run every BMA (the trainer's evaluation) was refused because adapter 'b' is not active.
    build_optimizer now refuses such a model before training, naming the adapter and the way out."""
    import peft
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_evon import build_optimizer

    def gpt2() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16))

    lora = peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    peft.get_peft_model(gpt2(), lora).save_pretrained(tmp_path)
    model = peft.get_peft_model(gpt2(), lora)
    model.load_adapter(str(tmp_path), adapter_name="b", is_trainable=True)
    frozen = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"lora_A\.b\.weight'?: adapter 'b' is not active .*requires_grad_\(False\)"):
        build_optimizer(model, ess=100.0)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == frozen  # nothing changed
    for name, p in model.named_parameters():
        if ".b." in name:
            p.requires_grad_(False)
    optimizer = build_optimizer(model, ess=100.0)  # the way out: the active adapter's alone
    assert {n for g in optimizer.param_groups for n in g["param_names"]} == {
        n for n, p in model.named_parameters() if ".default." in n and p.requires_grad
    }


def test_a_wrapped_model_is_split_and_defaulted_as_the_model_itself() -> None:
    """``build_optimizer(DistributedDataParallel(model))`` (or a compiled model) split the model
    other than ``build_optimizer(model)``: DDP forwards neither ``get_output_embeddings`` nor
    ``config``, so an untied LM head went to EVON, a ``from_pretrained`` model was taken for one
    trained from scratch (AdamW at 1e-3 where full fine-tuning's is 5e-5), and every name carried
    the wrapper's ``module.`` / ``_orig_mod.`` prefix. The wrappers are stripped first."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_evon import build_optimizer, build_param_groups
    from hf_evon.optim.grouping import is_full_finetuning

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False))  # fmt: skip
    # as transformers' from_pretrained leaves a model it loaded: full fine-tuning
    llama.config._name_or_path, llama._weight_conversions = "a/checkpoint", []
    assert is_full_finetuning(llama)

    def split(groups: list[dict]) -> list[tuple[str, list[str], list[int]]]:
        return [(g["algorithm"], g["param_names"], [id(p) for p in g["params"]]) for g in groups]

    plain = split(build_param_groups(llama))
    assert "lm_head.weight" in plain[1][1]  # AdamW's, as the output head
    for wrapped in (torch.nn.DataParallel(llama), torch.compile(llama), torch.nn.DataParallel(torch.compile(llama))):
        assert split(build_param_groups(wrapped)) == plain
        assert is_full_finetuning(wrapped)
        opt = build_optimizer(wrapped)
        assert [(g["algorithm"], g["lr"], g.get("clip")) for g in opt.param_groups] == [
            (g["algorithm"], g["lr"], g.get("clip")) for g in build_optimizer(llama).param_groups
        ]


def test_bare_tables_tokens_biases_and_scales_go_to_adamw_and_bare_matrices_to_evon() -> None:
    """A bare 2-D parameter went to EVON as a weight matrix whatever it was: Swin's
    ``relative_position_bias_table``, DINOv2's ``mask_token`` [1, D], XLNet's ``r_w_bias`` and
    ``seg_embed``, Perceiver's ``latents``, SwinV2's ``logit_scale`` [heads, 1, 1], Mamba's ``A_log``.
    These roles are AdamW's where a model stores them as an ``nn.Embedding`` or a [1, 1, D] token;
    now by their names too. Bare linear maps (``in_proj_weight``, an LSTM's ``weight_hh_l0``, a fused
    expert stack, a token-mixing matrix) stay EVON's."""
    from hf_evon import build_param_groups

    class Bare(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            shapes = {
                "mask_token": (1, 8), "relative_position_bias_table": (9, 2), "r_w_bias": (2, 4),
                "seg_embed": (2, 2, 4), "latents": (5, 8), "logit_scale": (2, 1, 1), "A_log": (8, 4),
                "position_embeddings": (6, 8),
                "in_proj_weight": (24, 8), "weight_hh_l0": (32, 8), "gate_up_proj": (3, 16, 8), "token_mix": (6, 6),
            }  # fmt: skip
            for name, shape in shapes.items():
                self.register_parameter(name, torch.nn.Parameter(torch.randn(*shape)))

    groups = build_param_groups(Bare(), adamw_weight_decay=0.1)
    assert [(g["algorithm"], g.get("weight_decay")) for g in groups] == [("evon", None), ("adamw", 0.1), ("adamw", 0.0)]
    evon, tables, vectors = (sorted(g["param_names"]) for g in groups)
    assert evon == ["gate_up_proj", "in_proj_weight", "token_mix", "weight_hh_l0"]
    assert tables == ["latents", "position_embeddings", "relative_position_bias_table", "seg_embed"]
    assert vectors == ["A_log", "logit_scale", "mask_token", "r_w_bias"]


def test_a_mixture_with_one_expert_keeps_its_expert_stack_in_evon() -> None:
    """With one expert the fused stack [1, out, in] has a leading 1 and went to AdamW as a table
    broadcast over the batch (weight-decayed as an embedding); with two it is EVON's."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from hf_evon import build_param_groups

    for experts in (1, 2):
        model = MixtralForCausalLM(MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=2, num_local_experts=experts,
                                                 num_experts_per_tok=1))  # fmt: skip
        stacks = sorted(n for n, p in model.named_parameters() if ".experts." in n and p.ndim == 3)
        assert len(stacks) == 2, stacks
        evon = build_param_groups(model)[0]
        assert evon["algorithm"] == "evon" and set(stacks) <= set(evon["param_names"]), (experts, stacks)


@pytest.mark.parametrize("name", ["classifier", "pre_classifier", "cls_classifier", "distillation_classifier",
                                  "classification_head", "score", "qa_outputs"])  # fmt: skip
def test_a_new_task_head_is_known_by_the_names_transformers_gives_its_heads(name: str) -> None:
    """The new head's own rate went to heads named ``classifier``, ``pre_classifier``, ``score`` or
    ``qa_outputs`` only: BART's ``classification_head`` and DeiT's ``cls_classifier`` and
    ``distillation_classifier`` trained at EVON's full α in a linear probe."""
    from hf_evon.optim.grouping import _TASK_HEAD

    assert _TASK_HEAD.search(f"model.{name}.out_proj.weight") and _TASK_HEAD.search(f"{name}.weight")
    assert not _TASK_HEAD.search(f"model.{name}s_table.weight") and not _TASK_HEAD.search("encoder.scores.weight")
