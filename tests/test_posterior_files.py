"""Posterior files from elsewhere and posterior directories under faults (issue 33 §2).

A posterior config may come from anyone (a downloaded repo): nothing in it may run code, inject
text into a model card, exhaust memory or escape as a traceback. A directory saved into by two
processes, or by a save that was killed, must load as one consistent posterior.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import directory_locked, directory_state, outcome_beside_a_pipe, refuse_lookups

from hf_evon import EVONPosterior, PosteriorMismatchError
from hf_evon.posterior.config import POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME
from hf_evon.posterior.gaussian import MatrixFactors
from hf_evon.posterior.model_card import SECTION_END, SECTION_START, render_model_card, save_model_card

REPO_ROOT = Path(__file__).resolve().parents[1]
LORA = "base_model.model.h.0.attn.lora_A.default.weight"


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _orthonormal(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, n, generator=g))[0]


def _posterior(
    scale: float = 1.0, names: tuple[str, ...] = (LORA, "h.1.mlp.weight"), **config
) -> EVONPosterior:
    """A small posterior with rotated bases (``scale`` multiplies its Hessian)."""
    factors = {
        name: MatrixFactors(
            _orthonormal(4, i),
            _orthonormal(6, i + 10),
            scale * (1.0 + torch.rand(4, 6, generator=torch.Generator().manual_seed(i))),
            (4, 6),
            (4, 6),
            100.0,
            1e-3,
        )
        for i, name in enumerate(names)
    }
    return EVONPosterior.from_factors(factors, {"ess": 100.0, "weight_decay": 1e-3, **config})


def _edit_config(directory: Path, **values) -> None:
    path = directory / POSTERIOR_CONFIG_NAME
    raw = json.loads(path.read_text())
    raw.update(values)
    path.write_text(json.dumps(raw))


def _snippet(card: str) -> str:
    return card.split("```python\n", 1)[1].split("\n```", 1)[0]


# ----------------------------------------------------------------------------- item 5: card injection
INJECTIONS = [
    'gpt2"); import os; os.system("echo pwned"); ("',
    "gpt2\n# injected heading\n<script>alert(1)</script>",
    f"gpt2 {SECTION_END} trailing",
    "gpt2`) | cell | `x",
]


@pytest.mark.parametrize("base_model", INJECTIONS)
def test_a_foreign_base_model_cannot_inject_into_a_resaved_card(tmp_path, base_model):
    """A downloaded config's base_model is refused on load, and is inert if it reaches a card."""
    _posterior().save_pretrained(tmp_path)
    _edit_config(tmp_path, base_model=base_model)
    with pytest.raises(PosteriorMismatchError, match="base_model"):
        EVONPosterior.from_pretrained(tmp_path)


@pytest.mark.parametrize("base_model", INJECTIONS)
def test_everything_a_card_interpolates_is_escaped(tmp_path, base_model):
    """Even a value that never went through a config (passed by code) stays data in the card."""
    post = _posterior(model_class="PeftModelForCausalLM")
    post.config["base_model"] = base_model  # as a hand-built or older posterior may hold
    card = str(render_model_card(post, repo_id=str(tmp_path / 'a"b')))
    snippet = _snippet(card)
    tree = ast.parse(snippet)  # still valid Python, and only the calls the snippet makes
    called = {
        node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
    }
    assert "system" not in called and not any(
        isinstance(n, ast.Import) and n.names[0].name == "os" for n in tree.body
    )
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert base_model in strings  # passed as one string literal
    assert card.count(SECTION_START) == 1 and card.count(SECTION_END) == 1
    assert "<script>" not in card and "\n# injected heading" not in card
    body = card.split(SECTION_START, 1)[1]
    assert all(row.count("|") in (0, 3, 4) for row in body.splitlines() if row.startswith("|"))
    save_model_card(tmp_path, post)  # and a card is written: the section is replaced exactly once
    save_model_card(tmp_path, post)
    text = (tmp_path / "README.md").read_text()
    assert text.count(SECTION_START) == 1 and text.count(SECTION_END) == 1


def test_a_hub_id_or_a_local_path_is_a_valid_base_model(tmp_path):
    for base_model in ("gpt2", "openai-community/gpt2", str(tmp_path / "my model (v2)"), "./runs/model-1"):
        post = _posterior(base_model=base_model)
        post.save_pretrained(tmp_path / "p")
        assert EVONPosterior.from_pretrained(tmp_path / "p").config["base_model"] == base_model


# ----------------------------------------------------------------------------- item 6: config bounds
def test_an_oversized_config_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    import hf_evon.posterior.format as format_module

    _posterior().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / POSTERIOR_CONFIG_NAME).read_text())
    raw["padding"] = "x" * 4096
    (tmp_path / POSTERIOR_CONFIG_NAME).write_text(json.dumps(raw))
    monkeypatch.setattr(format_module, "MAX_CONFIG_BYTES", 1024, raising=False)
    with pytest.raises(PosteriorMismatchError, match=rf"{POSTERIOR_CONFIG_NAME}.*larger than 1024 bytes"):
        EVONPosterior.from_pretrained(tmp_path)


def test_a_large_config_of_empty_lists_is_refused_before_parsing(tmp_path):
    """Python's JSON parser makes an object of some 50 bytes from each 3-byte "[]," a file holds:
    a config within the byte limit could take 50x its size in memory before its fields were
    checked. A config over 1 MiB with more than one list or object per 16 bytes is refused unread
    (a posterior's config holds about one per 100-160 bytes)."""
    _posterior().save_pretrained(tmp_path)
    path = tmp_path / POSTERIOR_CONFIG_NAME
    raw = json.loads(path.read_text())
    raw["padding"] = [[] for _ in range(2**19)]  # 1.5 MiB of "[], "
    path.write_text(json.dumps(raw))
    with pytest.raises(PosteriorMismatchError, match=rf"{POSTERIOR_CONFIG_NAME}.*lists/objects in .* bytes"):
        EVONPosterior.from_pretrained(tmp_path)
    raw["padding"] = ["x" * 120 for _ in range(2**14)]  # 2 MiB of plain strings: read as before
    path.write_text(json.dumps(raw))
    assert EVONPosterior.from_pretrained(tmp_path).config["padding"][0] == "x" * 120


@pytest.mark.parametrize("depth", [100, 100_000])
def test_a_deeply_nested_config_is_a_clear_error(tmp_path, depth):
    _posterior().save_pretrained(tmp_path)
    text = (tmp_path / POSTERIOR_CONFIG_NAME).read_text().rstrip()
    nested = "[" * depth + "]" * depth
    (tmp_path / POSTERIOR_CONFIG_NAME).write_text(text[:-1] + f', "deep": {nested}}}')
    with pytest.raises(PosteriorMismatchError, match=rf"{POSTERIOR_CONFIG_NAME}.*nest"):
        EVONPosterior.from_pretrained(tmp_path)


@pytest.mark.parametrize("where", ["top", "entry"])
def test_a_config_with_a_key_twice_is_refused(tmp_path, where):
    """JSON leaves a key given twice in one object undefined: Python's parser keeps the last value,
    other readers (and a person reading the file) the first, so an ess of 1e-30 before the ess
    used stayed hidden. The config is refused, naming the file and the key."""
    post = _posterior()
    post.save_pretrained(tmp_path)
    path = tmp_path / POSTERIOR_CONFIG_NAME
    text = path.read_text()
    if where == "top":
        text = text.replace('"ess": 100.0,', '"ess": 1e-30, "ess": 100.0,', 1)
        key = "ess"
    else:
        text = text.replace('"left_basis": true,', '"left_basis": false, "left_basis": true,', 1)
        key = "left_basis"
    path.write_text(text)
    with pytest.raises(PosteriorMismatchError) as err:
        EVONPosterior.from_pretrained(tmp_path)
    assert str(err.value) == (
        f"{path}: cannot read the config (key {key!r} appears twice in one object; "
        "JSON readers disagree on which value it has)"
    )


@pytest.mark.parametrize("literal", ["NaN", "-Infinity"])
def test_a_number_that_could_not_be_written_back_is_refused_on_load(tmp_path, literal):
    """Python's json reads NaN and -Infinity: such a config loaded, and the posterior could then never
    be saved again (its writer refuses them)."""
    _posterior().save_pretrained(tmp_path)
    path = tmp_path / POSTERIOR_CONFIG_NAME
    raw = json.loads(path.read_text())
    raw["lr"] = 0.125
    path.write_text(json.dumps(raw).replace('"lr": 0.125', f'"lr": {literal}'))
    with pytest.raises(PosteriorMismatchError, match=r"field 'lr' must be a number"):
        EVONPosterior.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "calibration, field",
    [
        ("best", "calibration"),
        ({"ess": 10.0}, "calibration.trained_ess"),
        ({"ess": "ten", "trained_ess": 100.0, "mean_nll": 1.0}, "calibration.ess"),
        ({"ess": 10.0, "trained_ess": 100.0, "mean_nll": [1.0]}, "calibration.mean_nll"),
        ({"ess": 10.0, "trained_ess": 100.0, "mean_nll": 1.0, "nll": ["a"]}, "calibration.nll"),
        ({"ess": 10.0, "trained_ess": 100.0, "mean_nll": 1.0, "grid": 3}, "calibration.grid"),
    ],
)
def test_a_bad_calibration_entry_is_refused_on_load(tmp_path, calibration, field):
    _posterior().save_pretrained(tmp_path)
    _edit_config(tmp_path, calibration=calibration)
    with pytest.raises(PosteriorMismatchError, match=rf"{POSTERIOR_CONFIG_NAME}.*{field}"):
        EVONPosterior.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "value, message",
    [
        ({"not.covered": 3.0}, r"trained_ess_by_parameter names uncovered \['not.covered'\]"),
        ({"NAME": -1.0}, r"trained_ess_by_parameter.NAME.*> 0"),
        ([3.0], r"trained_ess_by_parameter.*an object"),
    ],
)
def test_a_bad_trained_ess_by_parameter_is_refused_on_load(tmp_path, value, message):
    post = _posterior()
    post.save_pretrained(tmp_path)
    name = post.names[0]
    _edit_config(tmp_path, trained_ess=10.0, trained_ess_by_parameter=json.loads(json.dumps(value).replace("NAME", name)))
    with pytest.raises(PosteriorMismatchError, match=message.replace("NAME", re.escape(name))):
        EVONPosterior.from_pretrained(tmp_path)


@pytest.mark.parametrize("by_parameter", [False, True], ids=["trained_ess", "trained_ess_by_parameter"])
def test_a_trained_scale_whose_std_is_not_finite_is_refused_on_load_naming_the_file_and_field(tmp_path, by_parameter):
    """``trained_ess`` was checked only to be > 0: 1e-300 loaded, and calibration (which puts the trained
    ζ back first) failed later in ``with_ess``, naming neither file nor field. Refused at load, naming
    both and the matrix; a finite one beside it loads."""
    post = _posterior()
    post.save_pretrained(tmp_path)
    name = post.names[1] if by_parameter else post.names[0]  # the matrix named: the first at that scale
    values = {"trained_ess": 10.0, "trained_ess_by_parameter": {name: 1e-300}} if by_parameter else {"trained_ess": 1e-300}
    _edit_config(tmp_path, **values)
    where = re.escape(str(tmp_path / POSTERIOR_CONFIG_NAME))
    with pytest.raises(PosteriorMismatchError, match=rf"^{where}: trained_ess = 1e-300 .* of '{re.escape(name)}' non-finite"):
        EVONPosterior.from_pretrained(tmp_path)
    _edit_config(tmp_path, **{k: (10.0 if k == "trained_ess" else {name: 20.0}) for k in values})
    assert EVONPosterior.from_pretrained(tmp_path).config["trained_ess"] == 10.0


@pytest.mark.parametrize(
    "value, message",
    [
        ({"not.covered": [0]}, r"pruned_ranks names 'not.covered', which is not covered"),
        ({"NAME": ["NUMEL"]}, r"pruned_ranks names 'NAME', which has NUMEL entries"),
        ({"NAME": [1, 0]}, r"pruned_ranks.NAME' must be .*increasing list"),
        ({"NAME": []}, r"pruned_ranks.NAME' must be .*non-empty"),
        ({"NAME": [-1]}, r"pruned_ranks.NAME' must be .*integers >= 0"),
        ([0], r"'pruned_ranks' must be an object"),
    ],
)
def test_a_bad_pruned_ranks_is_refused_on_load(tmp_path, value, message):
    """``pruned_ranks`` lists the entries ``draw()`` and ``std()`` hold at 0 (AdaLoRA's pruned ranks): one
    naming an uncovered parameter or an entry it lacks is refused, naming the field, not an IndexError
    at the first draw."""
    post = _posterior()
    post.save_pretrained(tmp_path)
    name, numel = post.names[0], post.std(post.names[0]).numel()
    edited = json.dumps(value).replace("NAME", name).replace('"NUMEL"', str(numel))
    _edit_config(tmp_path, pruned_ranks=json.loads(edited))
    with pytest.raises(PosteriorMismatchError, match=message.replace("NAME", re.escape(name)).replace("NUMEL", str(numel))):
        EVONPosterior.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "value, message",
    [
        ({"h.2.mlp.weight": "not.covered"}, r"tied_parameters.*'h\.2\.mlp\.weight'.*'not\.covered', which is not covered"),
        ({"NAME": "OTHER"}, r"tied_parameters.*'NAME'.*is covered itself"),
        ({"h.2.mlp.weight": 3}, r"'tied_parameters\.h\.2\.mlp\.weight' must be a string"),
        (["NAME"], r"'tied_parameters' must be an object"),
    ],
)
def test_a_bad_tied_parameters_is_refused_on_load(tmp_path, value, message):
    """``tied_parameters`` maps each other name of a tied weight to the covered one it resolves to: one
    naming an uncovered parameter, or an alias that has factors of its own, is refused naming the field
    (it was an unknown key, kept and ignored)."""
    post = _posterior()
    post.save_pretrained(tmp_path)
    name, other = post.names
    edited = json.dumps(value).replace("NAME", name).replace("OTHER", other)
    _edit_config(tmp_path, tied_parameters=json.loads(edited))
    with pytest.raises(PosteriorMismatchError, match=message.replace("NAME", re.escape(name))):
        EVONPosterior.from_pretrained(tmp_path)
    with pytest.raises(PosteriorMismatchError, match=message.replace("NAME", re.escape(name))):
        _posterior(tied_parameters=json.loads(edited))  # a hand-built config: refused as a file's is


def test_a_posterior_without_tied_parameters_loads_and_resaves_without_it(tmp_path):
    """A file written before ``tied_parameters`` existed (or of a model without tied weights) loads as
    before: its names alone are covered, and it saves back without the key."""
    post = _posterior()
    post.save_pretrained(tmp_path / "a")
    loaded = EVONPosterior.from_pretrained(tmp_path / "a")
    assert "tied_parameters" not in loaded.config and "h.2.mlp.weight" not in loaded
    with pytest.raises(KeyError, match="h.2.mlp.weight"):
        loaded.std("h.2.mlp.weight")
    loaded.save_pretrained(tmp_path / "b")
    assert "tied_parameters" not in json.loads((tmp_path / "b" / POSTERIOR_CONFIG_NAME).read_text())
    tied = _posterior(tied_parameters={"h.2.mlp.weight": "h.1.mlp.weight"})
    tied.save_pretrained(tmp_path / "c")
    again = EVONPosterior.from_pretrained(tmp_path / "c")
    assert again.config["tied_parameters"] == {"h.2.mlp.weight": "h.1.mlp.weight"}
    assert torch.equal(again.std("h.2.mlp.weight"), again.std("h.1.mlp.weight"))


@pytest.mark.parametrize("value", [0, -5.0, "-inf"])
def test_a_trained_ess_that_is_not_positive_is_refused_on_load(tmp_path, value):
    """``trained_ess`` is the ζ ``trained_posterior`` puts back: one <= 0 loaded and then failed
    there ("with_ess: ess must be > 0"), naming neither the file nor the field."""
    _posterior().save_pretrained(tmp_path)
    _edit_config(tmp_path, trained_ess=value)
    with pytest.raises(PosteriorMismatchError) as err:
        EVONPosterior.from_pretrained(tmp_path)
    assert str(err.value) == (
        f"{tmp_path / POSTERIOR_CONFIG_NAME}: field 'trained_ess' must be a number > 0 (or \"inf\"); "
        f"got {value!r}"
    )


def test_a_valid_calibration_entry_loads_and_resaves(tmp_path):
    record = {"ess": 10.0, "trained_ess": 100.0, "mean_nll": 2.0, "nll": [1.9, 1.8], "grid": [0.1, 1.0],
              "chosen_nll": 1.8, "num_targets": 50, "num_samples": 4, "min_gain": 0.01, "method": "gridsearch"}  # fmt: skip
    _posterior().save_pretrained(tmp_path)
    _edit_config(tmp_path, calibration=record)
    post = EVONPosterior.from_pretrained(tmp_path)
    post.save_pretrained(tmp_path / "again")
    assert "Calibrated on 50 held-out targets" in (tmp_path / "again" / "README.md").read_text()


def test_an_ess_whose_variance_overflows_float32_is_refused(tmp_path):
    _posterior().save_pretrained(tmp_path)
    _edit_config(tmp_path, ess=1e-40)
    with pytest.raises(PosteriorMismatchError, match=rf"{POSTERIOR_CONFIG_NAME}.*ess"):
        EVONPosterior.from_pretrained(tmp_path)
    with pytest.raises(PosteriorMismatchError, match="ess"):
        _posterior().with_ess(1e-40)


@pytest.mark.parametrize("where, field", [("top", "ess"), ("entry", "ess"), ("entry", "weight_decay")])
def test_a_noise_scale_written_as_an_integer_past_int64_loads_as_that_number(tmp_path, where, field):
    """JSON integers are kept as integers (a config is written back as it was given): an ``ess`` of
    ``10**30`` (a float's range, not int64's) loaded into the factor groups as a Python int, and the
    std check failed with "OverflowError: int too big to convert", naming neither file nor field."""
    post = _posterior()
    post.save_pretrained(tmp_path)
    path = tmp_path / POSTERIOR_CONFIG_NAME
    raw = json.loads(path.read_text())
    target = raw if where == "top" else raw["parameters"][LORA]
    target[field] = 10**30
    path.write_text(json.dumps(raw))
    loaded = EVONPosterior.from_pretrained(tmp_path)
    value = 1e30  # float(10**30): the same number
    name = LORA if where == "entry" else post.names[1]
    assert getattr(loaded[name], field) == value
    want = EVONPosterior.from_factors({name: replace(post[name], **{field: value})}).std(name)
    assert torch.equal(loaded.std(name), want)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("ess", 0, "ess must be > 0"),
        ("weight_decay", -1.0, "weight_decay must be finite and >= 0"),
        ("shape", [6, 4], "matrix_shape [4, 6] does not match shape [6, 4]"),
    ],
)
def test_a_bad_parameter_entry_is_named_with_its_file(tmp_path, field, value, message):
    """The format's contract: a load error names the field *and the file*. A parameter entry's own
    ess, weight decay or shape named the parameter alone ("'…lora_A.default.weight': ess must be > 0")."""
    _posterior().save_pretrained(tmp_path)
    path = tmp_path / POSTERIOR_CONFIG_NAME
    raw = json.loads(path.read_text())
    raw["parameters"][LORA][field] = value
    path.write_text(json.dumps(raw))
    with pytest.raises(PosteriorMismatchError) as err:
        EVONPosterior.from_pretrained(tmp_path)
    assert str(err.value).startswith(f"{path}: parameters entry '{LORA}': ") and message in str(err.value), str(
        err.value
    )


def _edit_weights(directory: Path, edit) -> Path:
    """Rewrite the weights file with ``edit(tensors, metadata)`` applied; its path."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = directory / POSTERIOR_WEIGHTS_NAME
    with safe_open(path, framework="pt") as fh:
        tensors, metadata = {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()
    edit(tensors, metadata)
    save_file(tensors, path, metadata=metadata)
    return path


def test_a_file_whose_basis_was_made_to_pass_fixed_probes_is_refused(tmp_path):
    """The load checked QᵀQx = x on two probes of seed 0: ``Q_L = I + 1e4·uuᵀ`` with ``u`` orthogonal
    to them loaded, and its samples were ~8000× the honest posterior's. A load draws its probes afresh."""
    factors = MatrixFactors(_orthonormal(4, 0).double(), _orthonormal(6, 1).double(), torch.ones(4, 6, dtype=torch.float64),
                            (4, 6), (4, 6), 100.0, 1e-3)  # fmt: skip
    EVONPosterior.from_factors({"weight": factors}, {"ess": 100.0, "weight_decay": 1e-3}).save_pretrained(tmp_path)
    probes = torch.randn(4, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u = torch.linalg.qr(torch.cat([probes, torch.eye(4, dtype=torch.float64)[:, :2]], 1))[0][:, 2]
    _edit_weights(tmp_path, lambda t, _: t.update({"weight.Q_L": torch.eye(4, dtype=torch.float64) + 1e4 * torch.outer(u, u)}))
    for _ in range(5):
        with pytest.raises(PosteriorMismatchError, match=r"tensor 'weight\.Q_L' is not orthonormal"):
            EVONPosterior.from_pretrained(tmp_path)


# errors in the weights file, none of them also in test_posterior.py's LOAD_ERRORS: the message
# names the file (asserted below), the tensor and what is wrong with it
WEIGHTS_ERRORS = {
    "missing": (lambda t, m: t.pop(f"{LORA}.Q_L"), f"tensor '{LORA}.Q_L' is missing"),
    "dtype": (
        lambda t, m: t.update({f"{LORA}.hess": t[f"{LORA}.hess"].int()}),
        f"tensor '{LORA}.hess' has dtype I32",
    ),
    # H in half precision: a large H is inf there (a zero std), a small one 0 (the prior's std)
    "half hess": (
        lambda t, m: t.update({f"{LORA}.hess": t[f"{LORA}.hess"].half()}),
        f"tensor '{LORA}.hess' has dtype F16; expected one of ['F32', 'F64']",
    ),
    "bfloat16 hess": (
        lambda t, m: t.update({f"{LORA}.hess": t[f"{LORA}.hess"].bfloat16()}),
        f"tensor '{LORA}.hess' has dtype BF16; expected one of ['F32', 'F64']",
    ),
    "shape": (
        lambda t, m: t.update({f"{LORA}.hess": t[f"{LORA}.hess"][:, :3].contiguous()}),
        f"tensor '{LORA}.hess' has shape [4, 3]; expected [4, 6]",
    ),
    "undeclared": (
        lambda t, m: t.update({"x.hess": torch.ones(1)}),
        "holds tensors the config does not declare: ['x.hess']",
    ),
    "non-finite": (
        lambda t, m: t[f"{LORA}.hess"].view(-1)[0].fill_(float("nan")),
        f"tensor '{LORA}.hess' has non-finite values",
    ),
    "non-positive": (
        lambda t, m: t[f"{LORA}.hess"].view(-1)[0].fill_(-1.0),
        f"tensor '{LORA}.hess' has non-positive hess",
    ),
    "not orthonormal": (lambda t, m: t[f"{LORA}.Q_R"].mul_(1.1), f"tensor '{LORA}.Q_R' is not orthonormal"),
    "other save": (
        lambda t, m: m.update(checkpoint_id="0" * 32),
        f"(checkpoint {'0' * 32}) and",
    ),
}


@pytest.mark.parametrize("case", sorted(WEIGHTS_ERRORS))
def test_a_bad_weights_file_is_named_in_the_error(tmp_path, case):
    """The format's contract: a load error names the tensor or field *and the file*. Errors about
    the weights file's tensors named the tensor alone ("tensor 'x.hess' has non-finite values"),
    so a user loading a model directory, a subfolder or a Hub cache could not tell which file."""
    edit, message = WEIGHTS_ERRORS[case]
    _posterior().save_pretrained(tmp_path)
    path = _edit_weights(tmp_path, edit)
    with pytest.raises(PosteriorMismatchError) as err:
        EVONPosterior.from_pretrained(tmp_path)
    assert str(err.value).startswith(str(path)) and message in str(err.value), str(err.value)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_bases_stored_coarser_than_the_configs_eigenbasis_dtype_are_refused(tmp_path, stored):
    """A config declaring ``eigenbasis_dtype: float32`` beside half-precision bases loaded (the file's
    own tolerance passed them), and the posterior's save then wrote their rounding as float32, which
    its load refused ("'….Q_L' is not orthonormal (0.0026 > 0.001 for float32)")."""
    _posterior().save_pretrained(tmp_path, model_card=False)
    assert json.loads((tmp_path / POSTERIOR_CONFIG_NAME).read_text())["eigenbasis_dtype"] == "float32"
    path = _edit_weights(tmp_path, lambda t, m: t.update({k: v.to(stored) for k, v in t.items() if ".Q_" in k}))
    name = {torch.bfloat16: "BF16", torch.float16: "F16"}[stored]
    with pytest.raises(PosteriorMismatchError) as err:
        EVONPosterior.from_pretrained(tmp_path)
    assert str(err.value).startswith(f"{path}: tensor '{LORA}.Q_L' is stored in {name}, "), str(err.value)
    assert "eigenbasis_dtype 'float32'" in str(err.value)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_half_precision_bases_under_a_config_without_eigenbasis_dtype_save_as_they_were_read(tmp_path, stored):
    """A config without ``eigenbasis_dtype`` (the key is optional) beside half-precision bases loaded,
    and the posterior's save wrote their rounding as float32, which its load refused ("'….Q_L' is not
    orthonormal (0.0026 > 0.001 for float32)"). The loaded posterior declares the precision it read."""
    from safetensors.torch import load_file

    _posterior().save_pretrained(tmp_path / "half", eigenbasis_dtype=stored, model_card=False)
    raw = json.loads((tmp_path / "half" / POSTERIOR_CONFIG_NAME).read_text())
    del raw["eigenbasis_dtype"]
    (tmp_path / "half" / POSTERIOR_CONFIG_NAME).write_text(json.dumps(raw))
    loaded = EVONPosterior.from_pretrained(tmp_path / "half")
    loaded.save_pretrained(tmp_path / "again", model_card=False)
    again = EVONPosterior.from_pretrained(tmp_path / "again")
    first = load_file(tmp_path / "half" / POSTERIOR_WEIGHTS_NAME)
    second = load_file(tmp_path / "again" / POSTERIOR_WEIGHTS_NAME)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert all(torch.equal(again.std(n), loaded.std(n)) for n in loaded.names)
    assert again.config["eigenbasis_dtype"] == loaded.config["eigenbasis_dtype"] == str(stored).removeprefix("torch.")


def test_a_float32_basis_saved_as_float64_loads(tmp_path):
    # EVON's float32 basis, off by 1e-5 (well within float32's tolerance), saved with
    # eigenbasis_dtype=float64: it is read into the float32 buffers of its float32 hess, so the
    # float32 tolerance applies, not float64's 1e-6
    q = _orthonormal(16, 0)
    q = torch.linalg.qr(q + 1e-5 * torch.randn(16, 16, generator=torch.Generator().manual_seed(1)))[0]
    q = (q + 3e-6 * torch.randn(16, 16, generator=torch.Generator().manual_seed(2))).float()
    factors = MatrixFactors(q, None, torch.ones(16, 3), (16, 3), (16, 3), 100.0, 1e-3)
    posterior = EVONPosterior.from_factors({"w": factors})
    posterior.save_pretrained(tmp_path, eigenbasis_dtype=torch.float64)
    loaded = EVONPosterior.from_pretrained(tmp_path)
    assert loaded.std("w").dtype == torch.float32
    assert torch.equal(loaded.std("w"), posterior.std("w"))  # the float32 basis, bit for bit
    # a basis stored as float64 with float64 hess is held to float64's tolerance still
    far = MatrixFactors(q.double(), None, torch.ones(16, 3, dtype=torch.float64), (16, 3), (16, 3), 100.0, 1e-3)
    EVONPosterior.from_factors({"w": far}).save_pretrained(tmp_path / "f64")
    with pytest.raises(PosteriorMismatchError, match=r"'w\.Q_L' is not orthonormal .* for float64"):
        EVONPosterior.from_pretrained(tmp_path / "f64")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_posterior_read_from_half_precision_files_saves_as_it_was_read(tmp_path, dtype):
    """A posterior loaded from half-precision bases (held upcast to float32) and saved again (a copy, a
    push to another repo) wrote them as float32: bfloat16's rounding then failed float32's
    orthonormality check ("'….Q_L' is not orthonormal … for float32"), so the copy did not load."""
    from safetensors.torch import load_file

    _posterior().save_pretrained(tmp_path / "half", eigenbasis_dtype=dtype)
    loaded = EVONPosterior.from_pretrained(tmp_path / "half")
    loaded.save_pretrained(tmp_path / "again")
    again = EVONPosterior.from_pretrained(tmp_path / "again")
    first, second = load_file(tmp_path / "half" / POSTERIOR_WEIGHTS_NAME), load_file(tmp_path / "again" / POSTERIOR_WEIGHTS_NAME)
    assert first.keys() == second.keys()
    assert all(first[k].dtype == second[k].dtype and torch.equal(first[k], second[k]) for k in first)
    assert again.config["eigenbasis_dtype"] == loaded.config["eigenbasis_dtype"] == str(dtype).removeprefix("torch.")
    assert all(torch.equal(again.std(n), loaded.std(n)) for n in loaded.names)


def _polar(q: torch.Tensor) -> torch.Tensor:
    """The orthonormal matrix nearest ``q`` (its polar factor ``U Vᵀ``), in float64."""
    u, _, vh = torch.linalg.svd(q.double())
    return u @ vh


def _bases(posterior: EVONPosterior) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": getattr(posterior[n], k) for n in posterior.names for k in ("Q_L", "Q_R")}


@pytest.mark.parametrize(
    "stored, upcast",
    [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.float64), (torch.float16, torch.float64)],
)
def test_a_posterior_read_at_a_lower_precision_and_upcast_saves_a_posterior_that_loads(
    tmp_path, stored, upcast
):
    """``from_pretrained(<half-precision files>).to(<wider dtype>)`` declared the half-precision bases
    (their rounding, 3e-3 for bfloat16, 3e-4 for float16) as the wider dtype: its save wrote a posterior
    whose load refused it ("'….Q_L' is not orthonormal (… > 0.001 for float32)"). The upcast holds the
    nearest orthonormal bases (their polar factors) in the wider dtype; the file read leaves them alone."""
    from safetensors.torch import load_file

    _posterior().save_pretrained(tmp_path / "half", eigenbasis_dtype=stored, model_card=False)
    loaded = EVONPosterior.from_pretrained(tmp_path / "half")
    held = {k: q.clone() for k, q in _bases(loaded).items()}
    up = loaded.to(upcast)
    up.save_pretrained(tmp_path / "up", model_card=False)
    again = EVONPosterior.from_pretrained(tmp_path / "up")
    assert again.config["eigenbasis_dtype"] == str(upcast).removeprefix("torch.")
    written = load_file(tmp_path / "up" / POSTERIOR_WEIGHTS_NAME)
    for key, q in _bases(up).items():
        assert q.dtype == upcast and torch.equal(written[key], q)  # the save writes the upcast bases as held
        torch.testing.assert_close(q, _polar(held[key]).to(upcast), atol=1e-6, rtol=0)
        assert torch.equal(_bases(loaded)[key], held[key])  # the posterior it came from is unchanged


@pytest.mark.parametrize("written", [torch.float32, torch.float64])
def test_a_posterior_read_at_a_lower_precision_saves_at_a_wider_one_that_loads(tmp_path, written):
    """``save_pretrained(eigenbasis_dtype=<wider>)`` (and ``lean(eigenbasis_dtype=<wider>)``) of a posterior
    read from bfloat16 bases wrote their rounding as the wider dtype, refused on load ("… is not
    orthonormal")."""
    from safetensors.torch import load_file

    _posterior().save_pretrained(tmp_path / "half", eigenbasis_dtype=torch.bfloat16, model_card=False)
    loaded = EVONPosterior.from_pretrained(tmp_path / "half")
    loaded.save_pretrained(tmp_path / "wide", eigenbasis_dtype=written, model_card=False)
    loaded.lean(None, eigenbasis_dtype=written).save_pretrained(tmp_path / "lean", model_card=False)
    for directory in ("wide", "lean"):
        EVONPosterior.from_pretrained(tmp_path / directory)
        for key, q in load_file(tmp_path / directory / POSTERIOR_WEIGHTS_NAME).items():
            if not key.endswith(".hess"):
                assert q.dtype == written
                torch.testing.assert_close(q, _polar(_bases(loaded)[key]).to(written), atol=1e-6, rtol=0)


@pytest.mark.parametrize("written", [None, torch.bfloat16, torch.float32, torch.float64])
def test_to_tensors_gives_the_tensors_save_pretrained_writes(tmp_path, written):
    """``to_tensors(eigenbasis_dtype=<wider>)`` of a posterior read from bfloat16 bases cast their
    rounding to the wider dtype (which a load of them refuses), where ``save_pretrained`` writes their
    polar factors; ``to_tensors()`` gave the float32 bases held in memory, where the file holds them in
    the recorded bfloat16. The file's tensors are what ``save_pretrained`` writes, bit for bit."""
    from safetensors.torch import load_file

    _posterior().save_pretrained(tmp_path / "half", eigenbasis_dtype=torch.bfloat16, model_card=False)
    loaded = EVONPosterior.from_pretrained(tmp_path / "half")
    loaded.save_pretrained(tmp_path / "again", eigenbasis_dtype=written, model_card=False)
    on_file = load_file(tmp_path / "again" / POSTERIOR_WEIGHTS_NAME)
    tensors = loaded.to_tensors(written)
    assert tensors.keys() == on_file.keys()
    for key, value in on_file.items():
        assert tensors[key].dtype == value.dtype and torch.equal(tensors[key], value), key


def test_a_float32_basis_upcast_to_float64_loads_and_an_orthonormal_one_is_not_changed(tmp_path):
    """A float32 basis off by 1e-5 (within float32's tolerance, as GPT-2's are: 1.5e-6) upcast by
    ``.to(torch.float64)`` (float64 hess too) was saved as is, and its load refused it (float64's tolerance
    is 1e-6). One already within its tolerance stays bit for bit what the cast gives, as does a float32
    posterior saved as float32."""
    from safetensors.torch import load_file

    q = _orthonormal(16, 0)
    noisy = (q + 3e-6 * torch.randn(16, 16, generator=torch.Generator().manual_seed(2))).float()
    posterior = EVONPosterior.from_factors(
        {
            "noisy": MatrixFactors(noisy, None, torch.ones(16, 3), (16, 3), (16, 3), 100.0, 1e-3),
            "clean": MatrixFactors(q, _orthonormal(3, 1), torch.ones(16, 3), (16, 3), (16, 3), 100.0, 1e-3),
        }
    )
    up = posterior.to(torch.float64)
    up.save_pretrained(tmp_path / "f64", model_card=False)
    EVONPosterior.from_pretrained(tmp_path / "f64")
    torch.testing.assert_close(up["noisy"].Q_L, _polar(noisy), atol=1e-12, rtol=0)
    assert torch.equal(up["clean"].Q_L, q.double())
    assert torch.equal(up["clean"].Q_R, _orthonormal(3, 1).double())
    assert torch.equal(posterior.to(torch.float32)["noisy"].Q_L, noisy)
    posterior.save_pretrained(tmp_path / "f32", model_card=False)
    written = load_file(tmp_path / "f32" / POSTERIOR_WEIGHTS_NAME)
    assert torch.equal(written["noisy.Q_L"], noisy) and torch.equal(written["clean.Q_L"], q)
    assert torch.equal(written["clean.Q_R"], _orthonormal(3, 1))


def test_a_readme_that_is_not_utf8_is_left_as_it_is_and_the_posterior_saves(tmp_path):
    readme = "# Modèle\n\nNotes in Latin-1.\n".encode("latin-1")
    (tmp_path / "README.md").write_bytes(readme)
    factors = MatrixFactors(_orthonormal(4, 0), None, torch.ones(4, 3), (4, 3), (4, 3), 100.0, 1e-3)
    posterior = EVONPosterior.from_factors({"w": factors})
    with pytest.warns(UserWarning, match=r"README\.md is not UTF-8 text .*byte 5\): left as it is"):
        posterior.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_bytes() == readme  # not a byte changed
    assert torch.equal(EVONPosterior.from_pretrained(tmp_path).std("w"), posterior.std("w"))


def test_a_config_read_and_saved_again_keeps_its_keys_order(tmp_path):
    factors = MatrixFactors(_orthonormal(4, 0), None, torch.ones(4, 3), (4, 3), (4, 3), 100.0, 1e-3)
    EVONPosterior.from_factors({"w": factors}, {"lr": 0.1}).save_pretrained(tmp_path / "a", model_card=False)
    path = tmp_path / "a" / "evon_posterior_config.json"
    items = list(json.loads(path.read_text()).items())
    items = items[-2::-1] + items[-1:]  # any order a writer chose (parameters last), a key of its own
    items.insert(3, ("note", {"by": "hand"}))
    items[-1][1]["w"]["note"] = "by hand"  # an entry of parameters is written anew from its tensors
    path.write_text(json.dumps(dict(items)))
    EVONPosterior.from_pretrained(tmp_path / "a").save_pretrained(tmp_path / "b", model_card=False)
    again = json.loads((tmp_path / "b" / "evon_posterior_config.json").read_text())
    assert list(again) == [k for k, _ in items]  # format_version too stays where it was
    assert again["note"] == {"by": "hand"} and list(again["parameters"]["w"]) == ["shape", "matrix_shape", "left_basis", "right_basis"]


def test_a_copy_retried_after_it_failed_past_its_switch_keeps_a_posterior_that_loads(tmp_path, monkeypatch):
    # the first copy switched the config to its staged file and failed placing the canonical one
    # (a full disk); a retry of the same checkpoint (the same checkpoint_id) failed to create its
    # staging folder, and its clean-up removed the staged file the config named: nothing loaded
    from hf_evon.posterior import format as fmt

    factors = MatrixFactors(_orthonormal(4, 0), None, torch.ones(4, 3), (4, 3), (4, 3), 100.0, 1e-3)
    posterior = EVONPosterior.from_factors({"w": factors})
    posterior.save_pretrained(tmp_path / "checkpoint", model_card=False)
    out = tmp_path / "out"
    out.mkdir()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    copy = fmt.shutil.copyfile

    def copy_but_the_canonical_file(source, destination, *args, **kwargs):  # the staged copy goes through
        if os.path.basename(destination).startswith(".evon_posterior.safetensors"):
            full_disk()
        return copy(source, destination, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(os, "link", full_disk)
        patch.setattr(fmt.shutil, "copyfile", copy_but_the_canonical_file)
        with pytest.raises(OSError, match="No space left"):
            fmt.copy_posterior(str(tmp_path / "checkpoint"), str(out))
    assert torch.equal(EVONPosterior.from_pretrained(out).std("w"), posterior.std("w"))  # the staged one
    fmt.copy_posterior(str(tmp_path / "checkpoint"), str(out))  # the retry
    assert sorted(p.name for p in out.iterdir()) == ["evon_posterior.safetensors", "evon_posterior_config.json"]
    assert torch.equal(EVONPosterior.from_pretrained(out).std("w"), posterior.std("w"))


def test_a_model_from_a_path_a_config_cannot_record_still_saves(tmp_path):
    """The posterior of a model loaded from an unusual path is saved, without naming the path."""
    from torch import nn

    import hf_evon

    model = nn.Sequential(nn.Linear(4, 3))
    model.name_or_path = str(tmp_path / 'run "7"')
    opt = hf_evon.build_optimizer(model, seed=0)
    with opt.sampled_params(train=True):
        model(torch.randn(8, 4)).square().mean().backward()
    opt.step()
    post = EVONPosterior.from_optimizer(opt, model)
    assert post.config["base_model"] is None
    post.save_pretrained(tmp_path / "p")
    assert EVONPosterior.from_pretrained(tmp_path / "p").config["base_model"] is None


# ----------------------------------------------------------------------------- faults of saves
class _Killed(BaseException):
    """The process died: no handler may catch it, and nothing after it touches the disk."""


def _kill_after(monkeypatch, k: int | None, interrupt: bool = False) -> list[str]:
    """Every file-system call counts; after call ``k`` each later one raises :class:`_Killed`
    without running (as after a SIGKILL). ``k=None`` only counts. ``interrupt``: right after call
    ``k`` a ``KeyboardInterrupt`` (Ctrl-C) is raised once instead, and later calls run (the
    ``finally`` blocks with them). Returns the calls made."""
    import builtins

    import hf_evon.posterior.format as format_module

    calls: list[str] = []

    def wrap(fn, label):
        def call(*args, **kwargs):
            if k is not None and len(calls) >= k and not interrupt:
                raise _Killed(f"{label} after the kill")
            out = fn(*args, **kwargs)
            calls.append(label)
            if len(calls) == k:
                raise (KeyboardInterrupt if interrupt else _Killed)(f"right after call {k} ({label})")
            return out

        return call

    for name in ("open", "fsync", "replace", "rename", "link", "remove", "unlink", "mkdir", "rmdir"):
        monkeypatch.setattr(os, name, wrap(getattr(os, name), f"os.{name}"))
    monkeypatch.setattr(builtins, "open", wrap(builtins.open, "open"))
    for name in ("copy", "copyfile", "copy2"):
        monkeypatch.setattr(shutil, name, wrap(getattr(shutil, name), f"shutil.{name}"))
    monkeypatch.setattr(format_module, "save_file", wrap(format_module.save_file, "save_file"))
    return calls


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return EVONPosterior.from_pretrained(directory).to_tensors()


def _which(directory: Path, old: dict, new: dict) -> str:
    loaded = _tensors(directory)
    which = [
        label
        for label, t in (("old", old), ("new", new))
        if t.keys() == loaded.keys() and all(torch.equal(loaded[key], t[key]) for key in loaded)
    ]
    assert len(which) == 1
    return which[0]


def _at_every_kill_point(
    monkeypatch, tmp_path: Path, pristine: Path, save, check, interrupt: bool = False
) -> list:
    """``save`` run on copies of ``pristine``: once whole (into ``tmp_path / "count"``) to count its
    file-system calls, then once per call k on a fresh copy, killed (``interrupt``: Ctrl-C) right
    after call k. Returns what ``check(copy, call)`` gives per k, ``call`` naming call k."""
    with monkeypatch.context() as patch:
        calls = _kill_after(patch, None)
        shutil.copytree(pristine, tmp_path / "count")
        calls.clear()
        save(tmp_path / "count")
    seen = []
    for k in range(1, len(calls) + 1):
        target = tmp_path / f"kill{k}"
        shutil.copytree(pristine, target)
        with monkeypatch.context() as patch:
            _kill_after(patch, k, interrupt=interrupt)
            with pytest.raises(KeyboardInterrupt if interrupt else _Killed):
                save(target)
        seen.append(check(target, f"call {k} ({calls[k - 1]})"))
    return seen


class _FakeTrainer:
    """What ``CheckpointingMixin._copy_posterior_for_push`` uses of a trainer."""

    def __init__(self, output_dir: Path) -> None:
        from types import SimpleNamespace

        self.args = SimpleNamespace(output_dir=str(output_dir))
        self.cards = 0

    def is_world_process_zero(self) -> bool:
        return True

    def _write_model_card(self, directory: str, posterior) -> None:
        save_model_card(directory, posterior)
        self.cards += 1


def test_a_push_from_a_checkpoint_killed_midway_leaves_a_posterior_that_loads(tmp_path, monkeypatch):
    """Item 3: the checkpoint's posterior is switched into output_dir as a save switches its own."""
    from hf_evon.trainer.checkpointing import CheckpointingMixin

    old_post, new_post = _posterior(), _posterior(scale=3.0)
    old, new = old_post.to_tensors(), new_post.to_tensors()
    checkpoint = tmp_path / "checkpoint-2"
    new_post.save_pretrained(checkpoint)
    pristine = tmp_path / "pristine"
    old_post.save_pretrained(pristine)

    def push(directory: Path) -> None:
        CheckpointingMixin._copy_posterior_for_push(_FakeTrainer(directory), str(checkpoint))

    seen = _at_every_kill_point(monkeypatch, tmp_path, pristine, push, lambda d, call: _which(d, old, new))
    assert _which(tmp_path / "count", old, new) == "new"
    assert seen[0] == "old" and seen[-1] == "new", seen
    assert seen == sorted(seen, key=lambda w: w == "new"), seen


def test_a_push_from_a_checkpoint_with_broken_weights_keeps_the_output_dirs_posterior(tmp_path):
    """The checkpoint's weights were copied unchecked (they carry a checkpoint_id) and read only from
    output_dir after the switch: a checkpoint whose weights file is broken (a tensor of another shape,
    its checkpoint_id kept) replaced output_dir's posterior with one that does not load, and the error
    named output_dir's copy. The checkpoint is read in full first: the error names its file, and
    output_dir keeps its posterior and its card."""
    from hf_evon.trainer.checkpointing import CheckpointingMixin

    old_post = _posterior()
    out = tmp_path / "out"
    old_post.save_pretrained(out)
    card = (out / "README.md").read_text()
    checkpoint = tmp_path / "checkpoint-2"
    _posterior(scale=3.0).save_pretrained(checkpoint)
    hess = f"{LORA}.hess"
    weights = _edit_weights(checkpoint, lambda t, m: t.update({hess: t[hess][:, :3].contiguous()}))
    trainer = _FakeTrainer(out)
    with pytest.raises(PosteriorMismatchError) as err:
        CheckpointingMixin._copy_posterior_for_push(trainer, str(checkpoint))
    assert str(weights) in str(err.value) and f"tensor '{hess}' has shape [4, 3]" in str(err.value), err.value
    assert trainer.cards == 0 and (out / "README.md").read_text() == card
    assert _which(out, old_post.to_tensors(), _posterior(scale=3.0).to_tensors()) == "old"


def test_a_save_interrupted_anywhere_leaves_the_old_posterior_or_the_new(tmp_path, monkeypatch):
    """A Ctrl-C in the directory's fsync right after the config's switch (before the save marked it
    switched) let the cleanup remove the staged weights the new config named: neither loaded."""
    old_post, new_post = _posterior(), _posterior(scale=3.0)
    old, new = old_post.to_tensors(), new_post.to_tensors()
    pristine = tmp_path / "pristine"
    old_post.save_pretrained(pristine, model_card=False)
    seen = _at_every_kill_point(
        monkeypatch,
        tmp_path,
        pristine,
        lambda d: new_post.save_pretrained(d, model_card=False),
        lambda d, call: _which(d, old, new),
        interrupt=True,
    )
    assert seen[0] == "old" and seen[-1] == "new", seen
    assert seen == sorted(seen, key=lambda w: w == "new"), seen


def test_a_killed_safetensors_write_leaves_nothing_the_next_save_keeps(tmp_path, monkeypatch):
    """Item 13: ``save_file`` writes a full-size ``.tmpXXXXXX`` before its rename; a kill leaves it."""
    from safetensors.torch import save

    import hf_evon.posterior.format as format_module

    post = _posterior()
    post.save_pretrained(tmp_path)

    def killed_save_file(tensors, path, metadata=None):
        (Path(path).parent / ".tmpAb3dE9").write_bytes(save(tensors, metadata=metadata))
        raise _Killed("killed inside save_file")

    def dead(*args, **kwargs):  # nothing runs after the kill
        raise _Killed("after the kill")

    with monkeypatch.context() as patch:
        patch.setattr(format_module, "save_file", killed_save_file)
        patch.setattr(shutil, "rmtree", dead)
        patch.setattr(os, "remove", dead)
        with pytest.raises(_Killed):
            _posterior(scale=2.0).save_pretrained(tmp_path)
    left = [p for p in tmp_path.rglob(".tmp*")]
    assert left  # what the kill left somewhere under the directory
    # and a temporary of a killed safetensors write made before (e.g. the model's own save)
    stale = tmp_path / ".tmpQq8Zr1"
    stale.write_bytes(save({"w": torch.ones(3)}))
    old = time.time() - 3600
    os.utime(stale, (old, old))
    fresh = tmp_path / ".tmpFr35h1"  # a save that is running now: kept
    fresh.write_bytes(save({"w": torch.ones(3)}))
    other = tmp_path / ".tmpNotSt"  # not a safetensors temporary: kept
    other.write_bytes(b"notes")
    os.utime(other, (old, old))
    post.save_pretrained(tmp_path)
    assert not list(tmp_path.rglob(".tmpAb3dE9")) and not stale.exists()
    assert fresh.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if "evon_posterior" in p.name) == sorted(
        [POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME]
    )


@pytest.mark.skipif(not hasattr(os, "openpty") or not os.path.exists("/dev/tty"), reason="no terminals")
def test_a_config_that_is_a_terminal_is_refused_without_becoming_the_controlling_terminal(tmp_path):
    """A config that is a link to a terminal was opened without O_NOCTTY: a session leader without a
    controlling terminal (a daemon, a job started by setsid) loading it took that terminal as its own,
    and would be sent its hang-up (SIGHUP) and its Ctrl-C."""
    import subprocess
    import sys
    import textwrap

    code = """
        import os, sys
        from hf_evon.posterior.format import read_config
        master, terminal = os.openpty()
        os.symlink(os.ttyname(terminal), sys.argv[1])
        os.close(terminal)
        try:
            read_config(sys.argv[1])
        except Exception as err:
            print(type(err).__name__, err)
        try:  # /dev/tty opens only for a process that has a controlling terminal
            os.close(os.open("/dev/tty", os.O_RDONLY))
            print("controlling terminal")
        except OSError:
            print("no controlling terminal")
    """
    config = tmp_path / POSTERIOR_CONFIG_NAME
    done = subprocess.run(  # start_new_session: a session leader without a controlling terminal
        [sys.executable, "-c", textwrap.dedent(code), str(config)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, start_new_session=True,
    )  # fmt: skip
    assert done.stdout.splitlines() == [
        f"PosteriorMismatchError {config}: not a regular file (a named pipe, device or directory); refusing to "
        "read it as the config",
        "no controlling terminal",
    ], done.stderr[-3000:]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
@pytest.mark.parametrize("how", ["fifo", "symlink to a fifo"])
def test_a_config_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, how):
    """A folder from elsewhere whose config is a named pipe (or a link to one, to ``/dev/stdin``) made
    ``from_pretrained`` block for ever in ``open()``, waiting for a writer."""
    _posterior().save_pretrained(tmp_path, model_card=False)
    config = tmp_path / POSTERIOR_CONFIG_NAME
    config.unlink()
    fifo = tmp_path / "pipe" if how == "symlink to a fifo" else config
    os.mkfifo(fifo)
    if fifo != config:
        config.symlink_to(fifo)
    what = "from_pretrained blocked opening a config that is a named pipe"
    outcome = outcome_beside_a_pipe(lambda: EVONPosterior.from_pretrained(tmp_path), fifo, what, wait=10)
    assert isinstance(outcome, PosteriorMismatchError), outcome
    assert str(outcome).startswith(f"{config}: not a regular file"), str(outcome)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes")
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_weights_file_that_is_not_a_regular_file_is_named_as_such(tmp_path, kind):
    """A weights file that is a named pipe or a directory was reported as missing ("… is missing"),
    sending the user to look for a file that is there."""
    _posterior().save_pretrained(tmp_path, model_card=False)
    weights = tmp_path / POSTERIOR_WEIGHTS_NAME
    weights.unlink()
    os.mkfifo(weights) if kind == "fifo" else weights.mkdir()
    with pytest.raises(PosteriorMismatchError) as err:
        EVONPosterior.from_pretrained(tmp_path)
    assert str(err.value).startswith(f"{weights}: not a regular file"), str(err.value)


def test_a_directory_whose_entries_cannot_be_looked_up_is_no_directory_without_a_posterior(tmp_path, monkeypatch):
    """A directory this user may list but not search (its entries' stat answers EACCES; simulated: the
    tests run as root, whom no permission stops): os.path.exists took the config for missing, so
    from_pretrained said "evon_posterior_config.json is missing" and holds_posterior_config (the
    Trainer's, the CLI's rule) answered no posterior. Both raise the PermissionError naming the config."""
    from hf_evon.posterior.hub import holds_posterior_config

    shared = tmp_path / "shared"
    _posterior().save_pretrained(shared, model_card=False)
    refuse_lookups(monkeypatch, lambda path: path.startswith(str(shared) + os.sep), ("stat", "lstat", "open"))
    config = os.path.join(shared, POSTERIOR_CONFIG_NAME)
    with pytest.raises(PermissionError) as err:
        holds_posterior_config(shared)
    assert err.value.filename == config
    with pytest.raises(PermissionError) as err:
        EVONPosterior.from_pretrained(shared)
    assert err.value.filename == config


def test_a_config_that_is_a_loop_of_links_is_named_as_such(tmp_path):
    """A config that is a link leading back to itself (ELOOP) was reported as "a link to ..., which does
    not exist": its target is there, the links go round."""
    _posterior().save_pretrained(tmp_path, model_card=False)
    config = tmp_path / POSTERIOR_CONFIG_NAME
    config.unlink()
    config.symlink_to(tmp_path / "back")
    (tmp_path / "back").symlink_to(config)
    with pytest.raises(OSError) as err:
        EVONPosterior.from_pretrained(tmp_path)
    assert str(err.value) == (
        f"no EVON posterior in {str(tmp_path)!r}: {POSTERIOR_CONFIG_NAME} is a link to {str(tmp_path / 'back')!r}, "
        "which leads into a loop of links (ELOOP)"
    ), str(err.value)


def test_weights_that_cannot_be_looked_up_are_not_reported_missing(tmp_path, monkeypatch):
    """Weights whose entry this user cannot look up (EACCES; simulated, the tests run as root): the
    checks swallowing every error (os.path.exists, os.path.isfile) said "... is missing". The
    PermissionError naming the weights is raised."""
    _posterior().save_pretrained(tmp_path, model_card=False)
    weights = str(tmp_path / POSTERIOR_WEIGHTS_NAME)
    refuse_lookups(monkeypatch, lambda path: path == weights)
    with pytest.raises(PermissionError) as err:
        EVONPosterior.from_pretrained(tmp_path)
    assert err.value.filename == weights


@pytest.mark.parametrize("kind", ["EACCES", "loop", "directory"])
def test_copy_posterior_names_weights_listed_there_that_are_no_file_to_read(tmp_path, monkeypatch, kind):
    """copy_posterior's weights check (os.path.isfile) said "... (named by evon_posterior_config.json) is
    missing" for weights this user cannot look up (EACCES; simulated, the tests run as root), a loop of
    links and a directory: each is there. The PermissionError naming the weights is raised, and the others
    are named for what they are; the directory copied into is left as it was."""
    from hf_evon.posterior.format import copy_posterior

    source, target = tmp_path / "saved", tmp_path / "copied"
    _posterior().save_pretrained(source, model_card=False)
    target.mkdir()
    weights = source / POSTERIOR_WEIGHTS_NAME
    named = f"{source}: {POSTERIOR_WEIGHTS_NAME} (named by {POSTERIOR_CONFIG_NAME}) is "
    if kind == "EACCES":
        refuse_lookups(monkeypatch, lambda path: path == str(weights))
        with pytest.raises(PermissionError) as err:
            copy_posterior(str(source), str(target))
        assert err.value.filename == str(weights)
    else:
        weights.unlink()
        weights.mkdir() if kind == "directory" else weights.symlink_to(source / "back")
        if kind == "loop":
            (source / "back").symlink_to(weights)
        error = PosteriorMismatchError if kind == "directory" else FileNotFoundError
        with pytest.raises(error) as err:
            copy_posterior(str(source), str(target))
        why = (
            "not a regular file (a directory, named pipe or device)"
            if kind == "directory"
            else f"a link to {str(source / 'back')!r}, which leads into a loop of links (ELOOP)"
        )
        assert str(err.value) == named + why, str(err.value)
    assert os.listdir(target) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors in /proc/self/fd")
def test_a_config_that_is_a_directory_is_refused_as_such_and_leaves_no_descriptor_open(tmp_path):
    """A config that is a directory opened (O_RDONLY opens a directory) and then failed in ``open(fd)``:
    refused as "cannot read the config ([Errno 21] Is a directory: 3)", and each load left that
    descriptor open."""
    _posterior().save_pretrained(tmp_path, model_card=False)
    config = tmp_path / POSTERIOR_CONFIG_NAME
    config.unlink()
    config.mkdir()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(PosteriorMismatchError) as err:
            EVONPosterior.from_pretrained(tmp_path)
        assert str(err.value).startswith(f"{config}: not a regular file"), str(err.value)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_save_onto_a_config_that_is_a_directory_is_refused_before_anything_is_written(tmp_path):
    """A save into a directory whose config's name is a directory: the weights were staged, the card's EVON
    section retracted, and then the config's os.replace onto the directory failed ("[Errno 21] Is a
    directory"), leaving the staged weights and the card without its section. It is refused naming the
    config before anything is written; the directory keeps every file as it was."""
    _posterior().save_pretrained(tmp_path)
    config = tmp_path / POSTERIOR_CONFIG_NAME
    config.unlink()
    config.mkdir()
    (config / "notes.txt").write_text("kept")
    before = directory_state(tmp_path)
    with pytest.raises(IsADirectoryError) as err:
        _posterior(2.0).save_pretrained(tmp_path)
    assert str(err.value) == (
        f"{config}: a directory, where a posterior save writes its config; refusing to save over it "
        "(remove it, or save elsewhere)"
    ), str(err.value)
    assert directory_state(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["README.md", POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME])


@pytest.mark.parametrize("name,what", [(POSTERIOR_WEIGHTS_NAME, "weights"), ("README.md", "model card")])
def test_a_save_onto_weights_or_a_card_that_is_a_directory_is_refused_before_anything_is_written(tmp_path, name, what):
    """A save into a directory whose weights file's name is a directory: the new posterior was switched in
    (its config naming the staged weights), and then the weights' os.replace onto the directory failed
    ("[Errno 21] Is a directory"), leaving its staging folder; where README.md is a directory, reading the
    card failed so ("[Errno 21] Is a directory: '.../README.md'"), once the weights were staged. Each is
    refused naming it before anything is written, as a directory under the config's name is; the directory
    keeps every file as it was. So is a copy into it (a pushed checkpoint's posterior)."""
    from hf_evon.posterior.format import copy_posterior

    out, other = tmp_path / "out", tmp_path / "other"
    _posterior().save_pretrained(out)
    _posterior(2.0).save_pretrained(other, model_card=False)
    path = out / name
    path.unlink()
    path.mkdir()
    (path / "notes.txt").write_text("kept")
    before = directory_state(out)
    for save in (lambda: _posterior(2.0).save_pretrained(out), lambda: copy_posterior(str(other), str(out))):
        with pytest.raises(IsADirectoryError) as err:
            save()
        assert str(err.value) == (
            f"{path}: a directory, where a posterior save writes its {what}; refusing to save over it "
            "(remove it, or save elsewhere)"
        ), str(err.value)
        assert directory_state(out) == before
        assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME])


@pytest.mark.skipif(not hasattr(os, "O_NONBLOCK"), reason="no O_NONBLOCK")
def test_the_config_is_read_blocking_where_a_filesystem_honours_o_nonblock(tmp_path, monkeypatch):
    """The config is opened with O_NONBLOCK (a named pipe must not block the open), which POSIX leaves
    unspecified for a regular file: a filesystem that honours it (FUSE, network ones) may answer a read
    with EAGAIN. The read went through the non-blocking descriptor, and such a config was refused as
    "cannot read the config ([Errno 11] ...)"; a regular file is read blocking."""
    import builtins
    import errno

    import hf_evon.posterior.format as format_module

    saved = _posterior()
    saved.save_pretrained(tmp_path, model_card=False)

    class HonoursNonBlocking:  # a file on a filesystem that has no data at hand for a non-blocking read
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.fh.__exit__(*exc)

        def read(self, size=-1):
            if not os.get_blocking(self.fh.fileno()):
                raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
            return self.fh.read(size)

    monkeypatch.setattr(format_module, "open", lambda *a, **k: HonoursNonBlocking(builtins.open(*a, **k)), raising=False)
    loaded = EVONPosterior.from_pretrained(tmp_path)
    assert loaded.names == saved.names and all(torch.equal(loaded.std(n), saved.std(n)) for n in saved.names)


def test_loading_a_missing_local_path_says_the_path_does_not_exist(tmp_path):
    for missing in (str(tmp_path / "nope"), "./runs/nope", "runs/a/b"):
        with pytest.raises(FileNotFoundError, match="no such directory") as info:
            EVONPosterior.from_pretrained(missing)
        assert "Repo id" not in str(info.value) and missing in str(info.value)


@pytest.mark.parametrize(("location", "kind"), [("a/b", "EACCES"), ("loop", "loop"), ("gone", "dangling link")])
def test_loading_a_location_listed_here_that_is_no_directory_names_it(tmp_path, monkeypatch, location, kind):
    """A location that is there but cannot be looked up (``a/b`` where ``a`` may not be searched: EACCES;
    simulated, the tests run as root), a loop of links or a link to nothing: os.path.isdir and
    os.path.exists swallow why, so ``a/b`` was 'no such directory' and ``loop`` and ``gone`` were taken
    for Hub repo ids (downloaded from, or looked up in the Hub cache). The error names the location and why."""
    monkeypatch.chdir(tmp_path)
    if kind == "EACCES":
        (tmp_path / "a" / "b").mkdir(parents=True)
        refuse_lookups(monkeypatch, lambda path: path.startswith("a" + os.sep))
        with pytest.raises(PermissionError) as err:
            EVONPosterior.from_pretrained(location, local_files_only=True)
        assert err.value.filename == location
        return
    (tmp_path / location).symlink_to("loop" if kind == "loop" else "moved-away")
    why = "leads into a loop of links (ELOOP)" if kind == "loop" else "does not exist"
    target = "loop" if kind == "loop" else "moved-away"
    with pytest.raises(FileNotFoundError) as err:
        EVONPosterior.from_pretrained(location, local_files_only=True)
    assert str(err.value) == f"no EVON posterior at {location!r}: it is a link to {target!r}, which {why}", str(err.value)


# ----------------------------------------------------------------------------- item 2: two writers
def _two_writers(directory, monkeypatch, module, a, b, a_is_inside, **save_kwargs) -> None:
    """Writer A saves ``a`` and stops at its next ``module.atomic_write`` once ``a_is_inside()``
    (polled while A runs); writer B then saves ``b`` (given 2 s: without a lock it finishes in
    them); A goes on. Neither save may raise."""
    import threading

    go = threading.Event()
    real = module.atomic_write

    def paused(path, data):
        if threading.current_thread().name == "A":
            go.wait(timeout=20)
        return real(path, data)

    monkeypatch.setattr(module, "atomic_write", paused)
    errors: list[BaseException] = []

    def run(post):
        try:
            post.save_pretrained(directory, **save_kwargs)
        except BaseException as err:  # noqa: BLE001 - reported by the assert below
            errors.append(err)

    writer_a = threading.Thread(target=run, args=(a,), name="A")
    writer_a.start()
    while not a_is_inside():
        writer_a.join(0.01)
    writer_b = threading.Thread(target=run, args=(b,), name="B")
    writer_b.start()
    writer_b.join(2.0)
    go.set()
    writer_a.join()
    writer_b.join()
    assert not errors, errors


def test_the_staged_weights_glob_matches_the_staged_file_a_save_writes_and_nothing_else(tmp_path, monkeypatch):
    """The staged weights' name is defined once (``staged_weights_name``); the glob the Trainer's Hub uploads
    delete by (``delete_patterns``, fnmatch) and the patterns the config and the save's clean-up read derive
    from it. The glob matches the staged file a save writes, and none of the other files it writes."""
    from fnmatch import fnmatch

    import hf_evon.posterior.format as format_module
    from hf_evon.posterior.config import STAGED_WEIGHTS_GLOB, WEIGHTS_FILE_RE
    from hf_evon.trainer.checkpointing import _HUB_POSTERIOR_FILES

    renamed, rename = [], os.rename
    monkeypatch.setattr(format_module.os, "rename", lambda a, b: (renamed.append(os.path.basename(b)), rename(a, b)))
    _posterior().save_pretrained(tmp_path)
    checkpoint_id = json.loads((tmp_path / POSTERIOR_CONFIG_NAME).read_text())["checkpoint_id"]
    staged = f"evon_posterior.{checkpoint_id}.safetensors"  # docs/posterior-format.md's spelling
    assert staged in renamed and STAGED_WEIGHTS_GLOB in _HUB_POSTERIOR_FILES
    assert fnmatch(staged, STAGED_WEIGHTS_GLOB) and WEIGHTS_FILE_RE.fullmatch(staged)
    written = set(renamed) | set(os.listdir(tmp_path)) | {f".evon_posterior.{checkpoint_id}.staging"}
    assert written - {staged} >= {POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME, "README.md"}
    assert [name for name in written if fnmatch(name, STAGED_WEIGHTS_GLOB)] == [staged]


def test_the_staging_folder_a_save_makes_is_the_one_the_next_saves_clean_up_removes(tmp_path, monkeypatch):
    """The staging folder's name is defined once (``_staging_dir_name``) and the clean-up's pattern derives
    from it: the folder a save makes is the documented ``.evon_posterior.<checkpoint_id>.staging``, a copy a
    killed save left is removed by the next save, and nothing else a save writes matches the pattern."""
    import hf_evon.posterior.format as format_module

    made, mkdir = [], os.mkdir
    monkeypatch.setattr(format_module.os, "mkdir", lambda path, *a: (made.append(path), mkdir(path, *a)))
    _posterior().save_pretrained(tmp_path)
    made = [os.path.basename(path) for path in made if os.path.dirname(os.fspath(path)) == os.fspath(tmp_path)]
    checkpoint_id = json.loads((tmp_path / POSTERIOR_CONFIG_NAME).read_text())["checkpoint_id"]
    staging = f".evon_posterior.{checkpoint_id}.staging"  # docs/posterior-format.md's spelling
    assert made == [staging] and format_module._STAGING_DIR_RE.fullmatch(staging)
    assert not any(format_module._STAGING_DIR_RE.fullmatch(name) for name in os.listdir(tmp_path))
    left = tmp_path / f".evon_posterior.{'0' * 32}.staging"  # what a save killed mid-write leaves
    left.mkdir()
    (left / POSTERIOR_WEIGHTS_NAME).write_bytes(b"partial")
    _posterior().save_pretrained(tmp_path)
    assert not left.exists()
    assert sorted(os.listdir(tmp_path)) == sorted([POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME, "README.md"])


def test_two_writers_in_one_directory_leave_a_posterior_that_loads(tmp_path, monkeypatch):
    """A's staged weights are not B's "left by a killed save": whoever switches last wins, whole.
    A stops right before its config switch, its weights staged; without a lock B would finish
    then, cleaning up what A staged."""
    import hf_evon.posterior.format as format_module

    a, b = _posterior(scale=2.0), _posterior(scale=5.0)
    _posterior().save_pretrained(tmp_path)

    def a_is_writing_its_weights() -> bool:
        staged = list(tmp_path.glob(".evon_posterior.*")) + list(tmp_path.glob("evon_posterior.*.safetensors"))
        return bool(staged)

    _two_writers(tmp_path, monkeypatch, format_module, a, b, a_is_writing_its_weights, model_card=False)
    assert _which(tmp_path, a.to_tensors(), b.to_tensors()) in ("old", "new")


def test_two_writers_leave_the_card_of_the_posterior_beside_it(tmp_path, monkeypatch):
    """The card was written after the posterior's lock was let go: writer B saved its posterior
    and card while A was about to write its card, and A's card then described a posterior the
    directory no longer held. Each writer's posterior and card are one turn under the lock. A
    stops right before its card's write, its posterior switched in; outside the lock B saves both
    files then."""
    import hf_evon.posterior.model_card as card_module

    a, b = _posterior().with_ess(200.0), _posterior(scale=3.0).with_ess(500.0)
    config = tmp_path / POSTERIOR_CONFIG_NAME

    def a_switched_its_posterior_in() -> bool:
        return config.exists() and EVONPosterior.from_pretrained(tmp_path).ess == 200.0

    _two_writers(tmp_path, monkeypatch, card_module, a, b, a_switched_its_posterior_in)
    saved = EVONPosterior.from_pretrained(tmp_path).ess
    card = (tmp_path / "README.md").read_text()
    assert saved == 500.0  # B saved last
    assert f"| effective sample size `ess` (ζ) | {saved:g} |" in card and card.count("(ζ) |") == 1


def test_a_card_is_written_under_the_directory_lock(tmp_path, monkeypatch):
    """A card written on its own (the Trainer's, after the posterior) takes the posterior's lock:
    no posterior save switches files between its reading the card there and its writing it."""
    pytest.importorskip("fcntl")
    import hf_evon.posterior.model_card as card_module

    held: list[bool] = []
    real = card_module.atomic_write

    def probed(path, data):
        held.append(directory_locked(os.path.dirname(path)))
        return real(path, data)

    monkeypatch.setattr(card_module, "atomic_write", probed)
    save_model_card(tmp_path, _posterior())
    _posterior().save_pretrained(tmp_path)  # retracts the card's EVON section, then writes the new card
    assert held == [True, True, True]


@pytest.mark.parametrize("saves_in_a_row", [1, 3])
def test_a_reader_during_a_save_sees_the_old_or_the_new_posterior(tmp_path, monkeypatch, saves_in_a_row):
    """The config is read, then a save switches both files, then the reader opens the weights;
    the reader reads the pair again, also when saves win the race several times in a row (three
    did in a CI run of the two-writer test below, where three attempts were allowed)."""
    import hf_evon.posterior.format as format_module

    old, new = _posterior(), _posterior(scale=4.0)
    old.save_pretrained(tmp_path)
    real = format_module.safe_open
    saves = []

    def open_after_a_save(*args, **kwargs):
        if len(saves) < saves_in_a_row:
            saves.append(1)
            new.save_pretrained(tmp_path, model_card=False)
        return real(*args, **kwargs)

    monkeypatch.setattr(format_module, "safe_open", open_after_a_save)
    assert _which(tmp_path, old.to_tensors(), new.to_tensors()) == "new"


def test_a_reader_of_a_subfolder_given_with_slashes_during_a_save_sees_the_new_posterior(tmp_path, monkeypatch):
    """``subfolder="/sub/"`` reads ``sub`` (taken without slashes, as ``path_in_repo`` is); a save
    switching the files between the reader's config and weights raised PosteriorMismatchError: the check
    for a switch looked at ``os.path.join(path, "/sub/")``, the root ``/sub/``, saw no config before
    and none after, and so no switch to read again for."""
    import hf_evon.posterior.format as format_module

    old, new = _posterior(), _posterior(scale=4.0)
    old.save_pretrained(tmp_path / "sub")
    real = format_module.safe_open
    saves = []

    def open_after_a_save(*args, **kwargs):
        if not saves:
            saves.append(1)
            new.save_pretrained(tmp_path / "sub", model_card=False)
        return real(*args, **kwargs)

    monkeypatch.setattr(format_module, "safe_open", open_after_a_save)
    loaded = EVONPosterior.from_pretrained(tmp_path, subfolder="/sub/").to_tensors()
    expected = new.to_tensors()
    assert saves == [1] and loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[key], expected[key]) for key in expected)


# ----------------------------------------------------------------------------- item 11: model + posterior
def test_a_save_model_killed_between_model_and_posterior_is_not_a_silent_pair(tmp_path, monkeypatch):
    """New weights beside the previous posterior both load: the posterior's recorded mean tells."""
    import warnings

    from test_posterior import one_step_lm_trainer
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_evon.posterior.fingerprint import PosteriorMeanWarning

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100, n_positions=16)
    trainer = one_step_lm_trainer(tmp_path, config)
    trainer.train()
    saved = tmp_path / "model"
    trainer.save_model(str(saved))
    for dtype in (torch.float32, torch.bfloat16):  # a whole save: no warning, also cast to bfloat16
        model = GPT2LMHeadModel.from_pretrained(saved, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error", PosteriorMeanWarning)
            EVONPosterior.from_pretrained(saved, model=model)

    trainer.args.max_steps = 2
    trainer.train()

    def killed(*args, **kwargs):
        raise _Killed("killed after the model's files, before the posterior's")

    with monkeypatch.context() as patch:
        patch.setattr(EVONPosterior, "save_pretrained", killed)
        with pytest.raises(_Killed):
            trainer.save_model(str(saved))
    model = GPT2LMHeadModel.from_pretrained(saved)  # the new weights
    new_weight = trainer.model.transformer.h[0].attn.c_attn.weight.detach().cpu()
    assert torch.equal(model.transformer.h[0].attn.c_attn.weight, new_weight)
    with pytest.warns(PosteriorMeanWarning, match=r"transformer\.h\.0\..*different saves"):
        EVONPosterior.from_pretrained(saved, model=model)
    with pytest.warns(PosteriorMeanWarning):
        with EVONPosterior.from_pretrained(saved).sampled(model, seed=0):
            pass


_WRITER = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_posterior_files import _posterior
post = _posterior(scale=float(sys.argv[1]))
for _ in range({saves}):
    post.save_pretrained(sys.argv[2], model_card=False)
"""


def test_two_writer_processes_and_a_reader_always_see_a_whole_posterior(tmp_path):
    """Two processes save into one directory again and again while this one loads it."""
    import subprocess
    import sys

    scales = (2.0, 5.0)
    expected = {s: _posterior(scale=s).to_tensors() for s in scales}
    _posterior(scale=2.0).save_pretrained(tmp_path, model_card=False)
    code = _WRITER.format(tests=str(Path(__file__).parent), saves=15)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    writers = [
        subprocess.Popen([sys.executable, "-c", code, str(s), str(tmp_path)], env=env, stderr=subprocess.PIPE)
        for s in scales
    ]
    loads = 0
    while any(w.poll() is None for w in writers) or loads == 0:
        _which(tmp_path, *expected.values())  # raises on anything but one whole posterior
        loads += 1
    for w in writers:
        assert w.wait() == 0, w.stderr.read().decode()
    _which(tmp_path, *expected.values())
    left = sorted(p.name for p in tmp_path.iterdir() if "evon_posterior" in p.name)
    assert left == sorted([POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME])


def test_a_card_keyword_the_card_does_not_take_is_refused_before_anything_is_written(tmp_path):
    # the posterior's files were replaced first, then the card raised: a half-done save
    factors = MatrixFactors(_orthonormal(4, 0), None, torch.ones(4, 3), (4, 3), (4, 3), 100.0, 1e-3)
    first = EVONPosterior.from_factors({"w": factors})
    first.save_pretrained(tmp_path)
    before = directory_state(tmp_path)
    with pytest.raises(TypeError, match=r"model_card_kwargs: unknown keyword\(s\) \['bogus'\]"):
        first.with_temperature(3.0).save_pretrained(tmp_path, model_card_kwargs={"bogus": 1})
    assert directory_state(tmp_path) == before


def test_a_posterior_over_a_0d_parameter_saves_loads_and_samples_alike(tmp_path) -> None:
    """EVON trains a 0-d parameter in an EVON group (``EVON(model.parameters())`` on a model with a
    learnable scalar, CLIP's ``logit_scale``; or one named in ``evon_patterns``), and its posterior
    covers it, but ``save_pretrained`` failed on its shape ``[]`` ("must be a non-empty list of
    integers >= 1"): an EVONTrainer run crashed at its first checkpoint. It saves, and the loaded
    posterior gives the same std and the same samples."""
    from torch import nn

    from hf_evon import EVON

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)
            self.scale = nn.Parameter(torch.tensor(1.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) * self.scale

    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(8, 4)
    opt = EVON(model.parameters(), ess=1e4)
    for _ in range(3):
        with opt.sampled_params(train=True):
            model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    posterior = EVONPosterior.from_optimizer(opt, model)
    assert "scale" in posterior.names and posterior.std("scale").shape == ()
    posterior.save_pretrained(tmp_path, model_card=False)
    config = json.loads((tmp_path / POSTERIOR_CONFIG_NAME).read_text())
    assert config["parameters"]["scale"]["shape"] == [] and config["parameters"]["scale"]["matrix_shape"] == [1, 1]
    loaded = EVONPosterior.from_pretrained(tmp_path, model=model)
    assert torch.equal(loaded.std("scale"), posterior.std("scale"))
    with posterior.sampled(model, seed=5):
        expected = [p.detach().clone() for p in model.parameters()]
    with loaded.sampled(model, seed=5):
        assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected, strict=True))
    assert not torch.equal(expected[-1], model.scale.detach())  # the sample moves the scalar too


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_the_posterior_files_get_the_mode_a_plain_open_gives(tmp_path, umask):
    """safetensors writes its file through a 0600 temporary and renames it, so the weights file
    (and the canonical hard link to it) was 0600 under any umask: a posterior saved on a shared
    machine was unreadable to the colleagues who can read the model's files (0644 under umask 022).
    Every file of a save, a copy included, gets ``0666 & ~umask``, as ``open(path, "w")`` gives."""
    from hf_evon.posterior.format import copy_posterior

    previous = os.umask(umask)
    try:
        _posterior().save_pretrained(tmp_path / "saved")
        (tmp_path / "copied").mkdir()
        copy_posterior(str(tmp_path / "saved"), str(tmp_path / "copied"))
    finally:
        os.umask(previous)
    modes = {
        f"{folder}/{path.name}": path.stat().st_mode & 0o777
        for folder in ("saved", "copied")
        for path in (tmp_path / folder).iterdir()
    }
    assert set(modes) == {
        "saved/README.md",
        f"saved/{POSTERIOR_WEIGHTS_NAME}",
        f"saved/{POSTERIOR_CONFIG_NAME}",
        f"copied/{POSTERIOR_WEIGHTS_NAME}",
        f"copied/{POSTERIOR_CONFIG_NAME}",
    }
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)


def test_a_resave_keeps_the_modes_the_user_gave_the_files(tmp_path):
    """A posterior's files made private (0600) by their owner became 0644 at the next save, readable by
    everyone: the writes go through temporaries made under the umask. Each file the save replaces keeps
    its mode, as ``open(path, "w")`` keeps it; a file the save creates gets the umask's."""
    previous = os.umask(0o022)
    try:
        _posterior().save_pretrained(tmp_path)
        for path in tmp_path.iterdir():
            path.chmod(0o600)
        _posterior().save_pretrained(tmp_path)
    finally:
        os.umask(previous)
    names = {"README.md", POSTERIOR_WEIGHTS_NAME, POSTERIOR_CONFIG_NAME}
    assert {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == dict.fromkeys(names, 0o600)


@pytest.mark.parametrize("missing", ["weights", "config"])
def test_a_checkpoint_id_on_one_side_only_is_a_mismatch(tmp_path, missing):
    """The format promises the weights file's metadata and the config share one checkpoint_id, and
    refuses a weights file from another save; a weights file without the id (or a config without
    it beside weights that carry one) was not compared, so a pair from two saves loaded silently.
    The error names both files."""
    _posterior().save_pretrained(tmp_path, model_card=False)
    saved_id = json.loads((tmp_path / POSTERIOR_CONFIG_NAME).read_text())["checkpoint_id"]
    if missing == "weights":
        weights = _edit_weights(tmp_path, lambda t, m: m.pop("checkpoint_id"))
        shown = (f"{weights} (no checkpoint_id)", f"{POSTERIOR_CONFIG_NAME} (checkpoint {saved_id})")
    else:
        weights = tmp_path / POSTERIOR_WEIGHTS_NAME
        raw = json.loads((tmp_path / POSTERIOR_CONFIG_NAME).read_text())
        del raw["checkpoint_id"]
        (tmp_path / POSTERIOR_CONFIG_NAME).write_text(json.dumps(raw))
        shown = (f"{weights} (checkpoint {saved_id})", f"{POSTERIOR_CONFIG_NAME} (no checkpoint_id)")
    with pytest.raises(PosteriorMismatchError) as err:
        EVONPosterior.from_pretrained(tmp_path)
    message = str(err.value)
    assert message.startswith(shown[0]) and shown[1] in message and "different saves" in message, message


@pytest.mark.parametrize("side", ["weights", "config"])
def test_a_huge_checkpoint_id_is_shown_cut_short(tmp_path, side):
    """A crafted file's checkpoint_id is any string (the config checks no more; a safetensors header
    may hold 100 MB): the different-saves error printed both ids whole, so a 1 MiB id made a 1 MiB
    message. An id that is no save's (32 hex digits) is shown cut short, as other untrusted values."""
    from hf_evon.posterior.json_rules import shown

    _posterior().save_pretrained(tmp_path, model_card=False)
    saved_id = json.loads((tmp_path / POSTERIOR_CONFIG_NAME).read_text())["checkpoint_id"]
    huge = "f" * 2**20
    weights = tmp_path / POSTERIOR_WEIGHTS_NAME
    if side == "weights":
        _edit_weights(tmp_path, lambda t, m: m.update(checkpoint_id=huge))
        expected = (f"{weights} (checkpoint {shown(huge)})", f"{POSTERIOR_CONFIG_NAME} (checkpoint {saved_id})")
    else:
        _edit_config(tmp_path, checkpoint_id=huge)
        expected = (f"{weights} (checkpoint {saved_id})", f"{POSTERIOR_CONFIG_NAME} (checkpoint {shown(huge)})")
    with pytest.raises(PosteriorMismatchError) as err:
        EVONPosterior.from_pretrained(tmp_path)
    message = str(err.value)
    assert len(message) < len(str(tmp_path)) * 2 + 400, len(message)
    assert message.startswith(expected[0]) and expected[1] in message and "different saves" in message


def test_a_posterior_without_checkpoint_ids_loads_and_copies_into_a_pair_that_loads(tmp_path):
    """Files that carry no checkpoint_id on either side (written by hand or by another tool) are no
    mismatch; their copy (the Trainer's push) names the pair with one id on both sides."""
    from safetensors import safe_open

    from hf_evon.posterior.format import copy_posterior

    posterior = _posterior()
    posterior.save_pretrained(tmp_path / "a", model_card=False)
    _edit_weights(tmp_path / "a", lambda t, m: m.pop("checkpoint_id"))
    raw = json.loads((tmp_path / "a" / POSTERIOR_CONFIG_NAME).read_text())
    del raw["checkpoint_id"]
    (tmp_path / "a" / POSTERIOR_CONFIG_NAME).write_text(json.dumps(raw))
    assert torch.equal(EVONPosterior.from_pretrained(tmp_path / "a").std(LORA), posterior.std(LORA))
    (tmp_path / "b").mkdir()
    copy_posterior(str(tmp_path / "a"), str(tmp_path / "b"))
    copied_id = json.loads((tmp_path / "b" / POSTERIOR_CONFIG_NAME).read_text())["checkpoint_id"]
    with safe_open(tmp_path / "b" / POSTERIOR_WEIGHTS_NAME, framework="pt") as fh:
        assert fh.metadata()["checkpoint_id"] == copied_id
    assert torch.equal(EVONPosterior.from_pretrained(tmp_path / "b").std(LORA), posterior.std(LORA))


_ESS_ROW = re.compile(r"\| effective sample size `ess` \(ζ\) \| (\S+) \|")


@pytest.mark.parametrize("how", ["save_pretrained", "push copy"])
def test_a_save_killed_anywhere_leaves_no_card_of_another_posterior(tmp_path, monkeypatch, how):
    """The card is written after the posterior's switch: a kill between the two left the new
    posterior beside the previous card, whose EVON section (its ess, its calibration) described a
    posterior the directory no longer held. At every kill point the card's section describes the
    posterior that loads, or none; the user's own text is kept."""
    from hf_evon.trainer.checkpointing import CheckpointingMixin

    old, new = _posterior().with_ess(200.0), _posterior(scale=3.0).with_ess(500.0)
    checkpoint = tmp_path / "checkpoint-2"
    new.save_pretrained(checkpoint)
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    (pristine / "README.md").write_text("# My model\n\nThe user's notes.\n")
    old.save_pretrained(pristine)
    assert _ESS_ROW.findall((pristine / "README.md").read_text()) == ["200"]

    def save(directory: Path) -> None:
        if how == "save_pretrained":
            new.save_pretrained(directory)
        else:
            CheckpointingMixin._copy_posterior_for_push(_FakeTrainer(directory), str(checkpoint))

    def card_of(directory: Path, call: str) -> tuple[float, list[str]]:
        ess = EVONPosterior.from_pretrained(directory).ess
        card = (directory / "README.md").read_text()
        assert "The user's notes." in card and card.count(SECTION_START) == 1, call
        rows = _ESS_ROW.findall(card)
        assert rows in ([], [f"{ess:g}"]), (call, ess, rows)
        return ess, rows

    seen = _at_every_kill_point(monkeypatch, tmp_path, pristine, save, card_of)
    assert seen[0] == (200.0, ["200"]) and seen[-1] == (500.0, ["500"]), seen
    assert (500.0, []) in seen  # the section is retracted before the switch, rewritten after it
    assert _ESS_ROW.findall((tmp_path / "count" / "README.md").read_text()) == ["500"]


def test_a_save_interrupted_before_its_switch_writes_the_card_back_as_it_was(tmp_path, monkeypatch):
    """A Ctrl-C in the fsync right after the card's retraction was replaced in (inside
    ``retract_card_section``, before it returned the card's text) left the old posterior beside the
    retracted card: the save's rollback had no text to write back. At every interrupt point where the
    old posterior loads, the card is byte for byte the one before the save."""
    old, new = _posterior().with_ess(200.0), _posterior(scale=3.0).with_ess(500.0)
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    (pristine / "README.md").write_text("# My model\n\nThe user's notes.\n")
    old.save_pretrained(pristine)
    before = (pristine / "README.md").read_bytes()

    def card_of(directory: Path, call: str) -> tuple[float, bool]:
        ess = EVONPosterior.from_pretrained(directory).ess
        same = (directory / "README.md").read_bytes() == before
        assert same or ess == 500.0, call  # the old posterior keeps its card as it was
        return ess, same

    seen = _at_every_kill_point(monkeypatch, tmp_path, pristine, new.save_pretrained, card_of, interrupt=True)
    assert seen[0] == (200.0, True) and seen[-1] == (500.0, False), seen
    assert sum(ess == 200.0 for ess, _ in seen) >= 3, seen  # the card's replace and its fsync among them


def test_a_push_killed_anywhere_leaves_the_named_adapter_old_or_new_or_aside_for_the_next_push(tmp_path, monkeypatch):
    """A posterior over the adapter "other" (PEFT saves it in a folder of its name): the push copied the
    checkpoint's folder beside output_dir's, deleted output_dir's and renamed the copy in. A kill during
    that delete left output_dir with part of an adapter folder or none, which no load reads and no later
    push repaired. At every kill point the folder is the old adapter or the new one, or (between the two
    renames of the swap) the old one waits aside, and the next push ends with the new one and no leftover."""
    from hf_evon.trainer.checkpointing import CheckpointingMixin

    other = ("base_model.model.h.0.attn.lora_A.other.weight", "h.1.mlp.weight")

    def adapter(directory: Path, label: str) -> Path:
        folder = directory / "other"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps({"label": label}))
        (folder / "adapter_model.safetensors").write_bytes(label.encode() * 1000)
        return folder

    def state(folder: Path) -> str:
        files = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        if files != ["adapter_config.json", "adapter_model.safetensors"]:
            return "missing" if not files else f"broken {files}"
        label = json.loads((folder / "adapter_config.json").read_text())["label"]
        assert (folder / "adapter_model.safetensors").read_bytes() == label.encode() * 1000
        return label

    checkpoint = tmp_path / "checkpoint-2"
    _posterior(scale=3.0, names=other).save_pretrained(checkpoint)
    adapter(checkpoint, "new")
    pristine = tmp_path / "pristine"
    _posterior(names=other).save_pretrained(pristine)
    adapter(pristine, "old")

    def push(directory: Path) -> None:
        CheckpointingMixin._copy_posterior_for_push(_FakeTrainer(directory), str(checkpoint))

    def check(directory: Path, call: str) -> str:
        now = state(directory / "other")
        if now == "missing" and state(directory / "other.hf-evon-replaced") == "old":
            now = "aside"
        assert now in ("old", "new", "aside"), (call, now)
        push(directory)  # the next push
        assert state(directory / "other") == "new", call
        assert sorted(p.name for p in directory.iterdir() if p.name.startswith("other")) == ["other"], call
        return now

    seen = _at_every_kill_point(monkeypatch, tmp_path, pristine, push, check)
    assert seen[0] == "old" and seen[-1] == "new" and seen.count("aside") == 1, seen
