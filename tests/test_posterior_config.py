"""PosteriorConfig: the typed schema of ``evon_posterior_config.json`` (file format v1).

The configs below were written by ``save_pretrained`` before the config was a dataclass
(hf-evon 0.1.0): they must read and write back unchanged, key for key and byte for byte.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_evon.posterior import PosteriorConfig, PosteriorMismatchError
from hf_evon.posterior.config import ParameterEntry
from hf_evon.posterior.gaussian import MatrixFactors

# the hyperparameters and calibration record both v1 saves from an optimizer wrote
_TRAINED = (
    '"mc_samples": 1, "precondition_frequency": 2, "max_precond_dim": 4096, "shampoo_beta": null, '
    '"hess_clip_ratio": null, "clip": "none", "clip_radius": 1.0, "snr_scaling": true, '
    '"phased_gradients": false, "identity_basis": false, "stagger_refresh": true, "eps": 1e-12, '
    '"final_lr": 0.010000000000000002, "optimizer_step": 3, "base_model": null, "model_class": '
    '"Sequential", "eigenbasis_dtype": "float32", "max_basis_ratio": 3.0, "trained_ess": 256.0, '
    '"calibration": {"ess": "inf", "trained_ess": 256.0, "grid": [64.0, "inf"], "nll": [1.5], '
    '"mean_nll": 1.25, "num_samples": 4, "num_targets": 10, "seed": 0, "standard_errors": 1.0, '
    '"min_gain": 0.01, "mean_temperature": null, "chosen_nll": 1.25, "method": "gridsearch (BMA '
    'NLL on held-out data)"}, '
)

# a fresh save from an optimizer (an LR scheduler, two EVON groups of different ess, a
# calibration record), the same after a load, with_ess and a save, and a from_factors save
WRITTEN_BY_V1 = {
    "fresh": (
        '{"lr": 0.05, "ess": 100.0, "weight_decay": 0.0001, "hess_init": 0.05, "betas": [0.9, 0.95], '
        + _TRAINED
        + '"format_version": 1, "library": "hf-evon", "library_version": "0.1.0", "checkpoint_id": '
        '"047b85b53cb442e885486cffbe8abdd8", "weights_file": "evon_posterior.safetensors", '
        '"hess_dtype": "float32", "num_point_estimates": 7, "num_point_estimate_tensors": 2, '
        '"parameters": {"0.weight": {"shape": [4, 5], "matrix_shape": [4, 5], "left_basis": true, '
        '"right_basis": true}, "2.weight": {"shape": [3, 4], "matrix_shape": [3, 4], "left_basis": '
        'true, "right_basis": true, "ess": 256.0}}}'
    ),
    "resaved": (
        '{"lr": 0.05, "ess": 512.0, "weight_decay": 0.0001, "hess_init": 0.05, "betas": [0.9, 0.95], '
        + _TRAINED
        + '"library": "hf-evon", "library_version": "0.1.0", "checkpoint_id": '
        '"faa43bf94faf491fb680b2241ea8a51c", "weights_file": "evon_posterior.safetensors", '
        '"hess_dtype": "float32", "num_point_estimates": 7, "num_point_estimate_tensors": 2, '
        '"format_version": 1, "parameters": {"0.weight": {"shape": [4, 5], "matrix_shape": [4, 5], '
        '"left_basis": true, "right_basis": true}, "2.weight": {"shape": [3, 4], "matrix_shape": [3, '
        '4], "left_basis": true, "right_basis": true}}}'
    ),
    "factors": (
        '{"eigenbasis_dtype": "float32", "ess": 100.0, "weight_decay": 0.0001, "format_version": 1, '
        '"library": "hf-evon", "library_version": "0.1.0", '
        '"checkpoint_id": "c6777f050ee94a67a265b6fcd8b7201c", '
        '"weights_file": "evon_posterior.safetensors", "hess_dtype": "float32", '
        '"num_point_estimates": null, "num_point_estimate_tensors": null, '
        '"parameters": {"0.weight": {"shape": [4, 5], "matrix_shape": [4, 5], "left_basis": true, '
        '"right_basis": true}, "2.weight": {"shape": [3, 4], "matrix_shape": [3, 4], "left_basis": true, '
        '"right_basis": true, "ess": 256.0}}}'
    ),
}


def _raw(case: str) -> dict:
    return json.loads(WRITTEN_BY_V1[case])


@pytest.mark.parametrize("case", sorted(WRITTEN_BY_V1))
def test_a_v1_config_reads_and_writes_back_unchanged(case):
    raw = _raw(case)
    config = PosteriorConfig.from_dict(raw, "v1.json")
    assert config.to_dict() == raw and list(config.to_dict()) == list(raw)
    assert (
        config.to_json() == json.dumps(raw, indent=2) + "\n"
    )  # the file's bytes, as save_pretrained wrote them
    assert PosteriorConfig.from_dict(config.to_dict()) == config


def test_a_v1_config_without_weights_file_belongs_to_the_canonical_file():
    raw = _raw("fresh")
    raw.pop("weights_file")
    config = PosteriorConfig.from_dict(raw)
    assert config.weights_file is None and config.weights_name == "evon_posterior.safetensors"
    assert config.to_dict() == raw and list(config.to_dict()) == list(raw)


def test_fields_are_typed():
    config = PosteriorConfig.from_dict(_raw("fresh"))
    assert config.betas == (0.9, 0.95) and config.optimizer_step == 3 and config.snr_scaling is True
    assert config.shampoo_beta is None and "shampoo_beta" in config.keys()  # a null stays a null
    assert config.trained_ess == 256.0 and config.calibration["ess"] == "inf"  # the record as written
    entry = config.parameters["2.weight"]
    assert entry.shape == (3, 4) and entry.matrix_shape == (3, 4) and entry.left_basis and entry.right_basis
    assert config.noise_scale("2.weight") == (256.0, 1e-4) and config.noise_scale("0.weight") == (100.0, 1e-4)
    settings = config.settings()  # what EVONPosterior.config holds after a load
    assert "parameters" not in settings and settings["betas"] == (0.9, 0.95)
    assert settings["format_version"] == 1 and settings["calibration"] == _raw("fresh")["calibration"]


def test_unknown_keys_are_kept_where_they_were():
    raw = {"note": {"by": "hand"}, **_raw("factors"), "ess": "inf"}
    config = PosteriorConfig.from_dict(raw)
    assert config.extra == {"note": {"by": "hand"}} and config.ess == math.inf
    assert config.to_dict() == raw and list(config.to_dict()) == list(raw)


def test_updated_sets_values_in_place_and_appends_new_keys():
    raw = _raw("factors")
    staged = "evon_posterior." + "a" * 32 + ".safetensors"
    out = PosteriorConfig.from_dict(raw).updated(weights_file=staged, lr=0.5).to_dict()
    assert list(out) == [*raw, "lr"] and out["weights_file"] == staged and out["lr"] == 0.5


def test_a_config_built_directly_writes_the_declared_order():
    config = PosteriorConfig(
        ess=math.inf,
        weight_decay=0.0,
        lr=0.1,
        parameters={
            "w": ParameterEntry(shape=(2, 3), matrix_shape=(2, 3), left_basis=True, right_basis=False)
        },
        extra={"note": 1},
    )
    assert config.to_dict() == {
        "lr": 0.1,
        "ess": "inf",
        "weight_decay": 0.0,
        "format_version": 1,
        "note": 1,
        "parameters": {
            "w": {"shape": [2, 3], "matrix_shape": [2, 3], "left_basis": True, "right_basis": False}
        },
    }
    assert list(config.to_dict())[-1] == "parameters"
    assert PosteriorConfig.from_dict(config.to_dict()) == config


def _set(key, value):
    def edit(raw):
        raw[key] = value

    return edit


def _set_entry(key, value):
    def edit(raw):
        raw["parameters"]["0.weight"][key] = value

    return edit


CONFIG_ERRORS = {
    "string number": (_set("lr", "0.1"), r"v1\.json: field 'lr' must be a number \(or \"inf\"\); got '0\.1'"),
    "zero mc_samples": (
        _set("mc_samples", 0),
        r"v1\.json: field 'mc_samples' must be an integer >= 1; got 0",
    ),
    "null clip": (_set("clip", None), r"v1\.json: field 'clip' must be a string; got None"),
    "betas of three": (_set("betas", [0.9, 0.9, 0.9]), r"field 'betas' must be a list of two numbers"),
    "calibration not an object": (
        _set("calibration", [1]),
        r"field 'calibration' must be an object; got \[1\]",
    ),
    "calibration scanned not a bool": (
        lambda raw: raw["calibration"].update(scanned="no"),
        r"field 'calibration\.scanned' must be true or false; got 'no'",
    ),
    "entry without shape": (
        lambda raw: raw["parameters"]["0.weight"].pop("shape"),
        r"v1\.json: field 'parameters\.0\.weight' lacks \['shape'\]",
    ),
    "entry ess": (_set_entry("ess", 0), r"'0\.weight': ess must be > 0"),
    "zero temperature": (_set("temperature", 0), r"field 'temperature' must be a finite number > 0; got 0"),
    "infinite temperature": (_set("temperature", "inf"), r"field 'temperature' must be a finite number > 0"),
    "boolean temperature": (_set("temperature", True), r"field 'temperature' must be a finite number > 0"),
    "no parameters": (_set("parameters", {}), r"v1\.json: 'parameters' must list the covered parameters"),
    # JSON integers past a float's range (a file from elsewhere): named, shown shortened
    "huge ess": (_set("ess", 10**400), r"field 'ess' must be a number \(or \"inf\"\); got 1000+\.\.\. \(401 characters\)$"),
    "huge temperature": (_set("temperature", 10**400), r"field 'temperature' must be a finite number > 0"),
    "huge entry weight_decay": (_set_entry("weight_decay", -(10**400)), r"field 'parameters\.0\.weight\.weight_decay'"),
    "huge calibration number": (
        lambda raw: raw["calibration"].update(mean_nll=10**400),
        r"field 'calibration\.mean_nll' must be a number",
    ),
    "huge fingerprint value": (
        lambda raw: raw.update(mean_fingerprint={"dtype": "float32", "values": {"0.weight": [10**400]}}),
        r"field 'mean_fingerprint\.values\.0\.weight\[0\]' must be a number",
    ),
    # an object without the key: said missing (it read "format_version None is not a known ... format")
    "no format_version": (lambda raw: raw.pop("format_version"), r"^v1\.json: 'format_version' is missing"),
    "empty object": (lambda raw: raw.clear(), r"^v1\.json: 'format_version' is missing"),
    "format_version 0": (_set("format_version", 0), r"^v1\.json: format_version 0 is not a known"),
    # a dtype name that is no float dtype the format stores tensors in (these read as any string)
    "unknown eigenbasis_dtype": (
        _set("eigenbasis_dtype", "x"),
        r"^v1\.json: field 'eigenbasis_dtype' must be one of \['bfloat16', 'float16', 'float32', 'float64'\]; got 'x'$",
    ),
    "integer hess_dtype": (
        _set("hess_dtype", "int8"),
        r"^v1\.json: field 'hess_dtype' must be one of \['float32', 'float64'\]; got 'int8'$",
    ),
    # H is saved in float32 or float64 only (the tensors' table in docs/posterior-format.md)
    "half hess_dtype": (_set("hess_dtype", "float16"), r"field 'hess_dtype' must be one of \['float32', 'float64'\]; got 'float16'$"),
    "float8 eigenbasis_dtype": (_set("eigenbasis_dtype", "float8_e4m3fn"), r"field 'eigenbasis_dtype' must be one of"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_ERRORS))
def test_errors_name_the_file_and_the_field(case):
    edit, message = CONFIG_ERRORS[case]
    raw = _raw("fresh")
    edit(raw)
    with pytest.raises(PosteriorMismatchError, match=message):
        PosteriorConfig.from_dict(raw, "v1.json")


# EVON's mode and fit hyperparameters a save writes, each given what the optimizer refuses
# (hf_evon.optim.validation): checked on load, named with the file and the key
HYPERPARAMETER_ERRORS = {
    "string curvature_refit": ("curvature_refit", "50", r"an integer >= 0; got '50'"),
    "fractional curvature_refit": ("curvature_refit", 2.5, r"an integer >= 0; got 2\.5"),
    "negative curvature_refit": ("curvature_refit", -1, r"an integer >= 0; got -1"),
    "null curvature_refit": ("curvature_refit", None, r"an integer >= 0; got None"),
    "unknown hess_estimator": ("hess_estimator", "Fisher", r"one of \['fisher', 'price'\]; got 'Fisher'"),
    "null hess_estimator": ("hess_estimator", None, r"one of \['fisher', 'price'\]; got None"),
    "unknown step_curvature": ("step_curvature", "diag", r"one of \['entry', 'matrix'\]; got 'diag'"),
    "boolean step_curvature": ("step_curvature", True, r"one of \['entry', 'matrix'\]; got True"),
    "string mean_weight_decay": ("mean_weight_decay", "0.1", r"a finite number >= 0; got '0\.1'"),
    "negative mean_weight_decay": ("mean_weight_decay", -0.5, r"a finite number >= 0; got -0\.5"),
    "infinite mean_weight_decay": ("mean_weight_decay", "inf", r"a finite number >= 0; got 'inf'"),
    "max_precond_ratio below 1": ("max_precond_ratio", 0.5, r'a number >= 1 \(or "inf"\); got 0\.5'),
    "string max_precond_ratio": ("max_precond_ratio", "128", r'a number >= 1 \(or "inf"\); got \'128\''),
}


@pytest.mark.parametrize("case", sorted(HYPERPARAMETER_ERRORS))
def test_the_optimizers_modes_and_fit_settings_are_checked_on_load(case):
    """``hess_estimator``, ``step_curvature``, ``curvature_refit`` and ``mean_weight_decay`` were no
    config fields: any value loaded (``"curvature_refit": "50"`` too), and ``max_precond_ratio``
    took any number, where docs/posterior-format.md says a field of the wrong type is refused."""
    key, value, message = HYPERPARAMETER_ERRORS[case]
    raw = _raw("fresh")
    raw[key] = value
    with pytest.raises(PosteriorMismatchError, match=rf"^v1\.json: field '{key}' must be {message}$"):
        PosteriorConfig.from_dict(raw, "v1.json")


def test_a_fresh_saves_modes_and_fit_settings_read_and_write_back(tmp_path):
    """A posterior saved from an optimizer records its modes and fit settings as the optimizer's
    group holds them; they load as typed fields and write back byte for byte."""
    from hf_evon import EVONPosterior, build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    opt = build_optimizer(model, hess_estimator="price", step_curvature="entry", curvature_refit=7)
    opt.param_groups[0]["mean_weight_decay"] = 0.25  # hf_evon.optim.curvature adds it to the mean's pull
    EVONPosterior.from_optimizer(opt, model).save_pretrained(tmp_path)
    text = (tmp_path / "evon_posterior_config.json").read_text()
    config = PosteriorConfig.from_dict(json.loads(text), "saved.json")
    group = opt.param_groups[0]
    assert (config.hess_estimator, config.step_curvature, config.curvature_refit) == ("price", "entry", 7)
    assert (config.mean_weight_decay, config.max_precond_ratio) == (0.25, group["max_precond_ratio"])
    assert config.to_json() == text and "hess_estimator" not in config.extra
    loaded = EVONPosterior.from_pretrained(tmp_path).config
    assert {k: loaded[k] for k in ("hess_estimator", "curvature_refit", "mean_weight_decay")} == {
        "hess_estimator": "price", "curvature_refit": 7, "mean_weight_decay": 0.25,
    }  # fmt: skip


def test_a_config_without_the_modes_and_fit_settings_still_loads():
    """Files written before these options lack the keys (and a null mean_weight_decay, which the
    optimizer takes for its default, reads back as null)."""
    raw = _raw("fresh")
    config = PosteriorConfig.from_dict(raw)
    assert (config.hess_estimator, config.step_curvature, config.curvature_refit, config.mean_weight_decay) == (
        None, None, None, None,
    )  # fmt: skip
    assert config.to_dict() == raw
    nulled = {**raw, "mean_weight_decay": None, "max_precond_ratio": "inf"}
    config = PosteriorConfig.from_dict(nulled)
    assert config.max_precond_ratio == math.inf and config.to_dict() == nulled


def _factors(dtype=torch.float32) -> dict[str, MatrixFactors]:
    """Two covered matrices, (4, 5) at the config's ess 100 and (3, 4) at its own ess 256."""

    def matrix(m: int, n: int, ess: float) -> MatrixFactors:
        return MatrixFactors(
            torch.eye(m, dtype=dtype), torch.eye(n, dtype=dtype), torch.ones(m, n), (m, n), (m, n), ess, 1e-4
        )

    return {"0.weight": matrix(4, 5, 100.0), "2.weight": matrix(3, 4, 256.0)}


def test_a_save_writes_the_v1_bytes():
    """``for_save`` of what a fresh optimizer posterior holds writes the v1 file, byte for byte
    (but its new checkpoint id)."""
    raw = _raw("fresh")
    settings = {k: raw[k] for k in list(raw)[: list(raw).index("format_version")]}
    config = PosteriorConfig.for_save(settings, _factors(), None, 7, 2)
    assert config.checkpoint_id != raw["checkpoint_id"] and len(config.checkpoint_id) == 32
    raw["checkpoint_id"] = config.checkpoint_id
    assert config.to_json() == json.dumps(raw, indent=2) + "\n"


def test_integers_are_written_back_as_integers():
    """A hyperparameter given as an integer (``lr=1``) is written as ``1``, as v1 saves wrote it;
    the config's own ess and weight decay are written as floats."""
    settings = {"lr": 1, "ess": 100, "weight_decay": 0, "hess_init": 1, "clip_radius": 1}
    text = PosteriorConfig.for_save(settings, _factors(), None, None, None).to_json()
    for key in ("lr", "hess_init", "clip_radius"):
        assert f'"{key}": 1,' in text
    assert '"ess": 100.0,' in text and '"weight_decay": 0.0,' in text
    assert PosteriorConfig.from_dict(json.loads(text)).to_json() == text


def test_a_null_calibration_reads_and_writes_back():
    raw = {**_raw("factors"), "calibration": None}
    config = PosteriorConfig.from_dict(raw)
    assert config.calibration is None and config.to_dict() == raw and list(config.to_dict()) == list(raw)


def test_a_config_that_is_not_an_object_is_named():
    with pytest.raises(PosteriorMismatchError, match=r"v1\.json: the config must be a JSON object"):
        PosteriorConfig.from_dict([], "v1.json")


def test_a_temperature_reads_writes_back_and_is_the_posteriors(tmp_path):
    """The BMA temperature a calibration chose: a typed field, kept through save and load;
    ``with_temperature`` refuses what the file would refuse."""
    from hf_evon import EVONPosterior

    raw = _raw("fresh")
    raw["temperature"] = 2.5
    config = PosteriorConfig.from_dict(raw, "v1.json")
    assert config.temperature == 2.5 and config.to_dict()["temperature"] == 2.5
    posterior = EVONPosterior.from_factors(_factors())
    assert posterior.temperature == 1.0 and "temperature" not in posterior.config
    warm = posterior.with_temperature(2.5).with_ess(50.0)  # a later with_ess keeps it
    assert warm.temperature == 2.5 and posterior.temperature == 1.0
    warm.save_pretrained(tmp_path)
    assert EVONPosterior.from_pretrained(tmp_path).temperature == 2.5
    for bad in (0.0, -1.0, math.inf, math.nan, True, "2"):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            posterior.with_temperature(bad)


def test_the_posteriors_number_arguments_take_numpy_numbers_as_the_optimizer_does():
    """``EVON(lr=np.float32(...))`` is accepted (``optim.checks.is_real``), so the posterior's
    ``with_temperature``/``with_ess``/``scale_ess`` take NumPy numbers too (a calibration computed
    with NumPy hands them over), and still refuse a bool, a string and a tensor."""
    import numpy as np

    from hf_evon import EVONPosterior

    posterior = EVONPosterior.from_factors(_factors())
    assert posterior.with_temperature(np.float32(1.5)).temperature == 1.5
    assert posterior.with_ess(np.float32(50.0)).ess == 50.0
    assert posterior.with_ess(np.int64(50)).ess == 50.0
    assert posterior.with_ess(50.0).scale_ess(np.float16(2.0)).ess == 100.0
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        posterior.with_temperature(np.float32("nan"))
    for bad in (np.bool_(True), True, "50", torch.tensor(50.0)):
        with pytest.raises(TypeError, match="with_ess: ess must be a number"):
            posterior.with_ess(bad)


def test_a_posterior_of_an_optimizer_built_with_numpy_numbers_saves_them_as_json_numbers(tmp_path):
    """The optimizer takes NumPy numbers for its hyperparameters; the config wrote them as strings
    (``str(np.float32(0.1))``), which the save then refused as "must be a number"."""
    import numpy as np

    from hf_evon import EVONPosterior, build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    opt = build_optimizer(
        model, lr=np.float32(0.25), betas=(np.float32(0.5), np.float64(0.75)), hess_init=np.float32(0.125),
        clip_radius=np.float16(0.5), mc_samples=np.int64(2),
    )  # fmt: skip
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    for _ in range(2):
        with opt.sampled_params(train=True):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    EVONPosterior.from_optimizer(opt, model).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "evon_posterior_config.json").read_text())
    assert (saved["lr"], saved["betas"], saved["hess_init"], saved["clip_radius"]) == (0.25, [0.5, 0.75], 0.125, 0.5)
    assert saved["mc_samples"] == 2 and isinstance(saved["mc_samples"], int)
    assert EVONPosterior.from_pretrained(tmp_path).config["lr"] == 0.25


def test_a_posterior_of_an_optimizer_with_a_tensor_rate_saves_its_numbers(tmp_path):
    """The optimizer takes ``lr`` as a 0-dim tensor, as torch.optim does (a scheduler then sets it in
    place); the config records the rates as JSON numbers, the peak and the final one."""
    from hf_evon import EVON, EVONPosterior

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    opt = EVON([model[0].weight, model[2].weight], lr=torch.tensor(0.25), seed=0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5**t)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    for _ in range(2):
        with opt.sampled_params(train=True):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    EVONPosterior.from_optimizer(opt, model).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "evon_posterior_config.json").read_text())
    assert (saved["lr"], saved["final_lr"]) == (0.25, 0.0625)
