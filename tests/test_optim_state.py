"""EVON's contract as a torch optimizer: state, checkpoints, validation, failure handling,
sampling and the posterior it reports."""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
from conftest import plain_evon
from torch import nn

from hf_evon import EVON, NonFiniteGradientError
from hf_evon.optim import evon as evon_module

F64 = torch.float64


# ---------------------------------------------------------------------------- helpers
def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An MLP whose weights go to EVON (two share a shape: a bucket) and biases to AdamW."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3)
    ).to(dtype)


def make_data(n: int = 32, seed: int = 1, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


def groups(model: nn.Module) -> list[dict]:
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    return [{"params": weights}, {"params": biases, "algorithm": "adamw"}]


def make_opt(model: nn.Module, **overrides) -> EVON:
    options = dict(
        lr=0.05,
        ess=64.0,
        hess_init=0.5,
        betas=(0.9, 0.99),
        weight_decay=1e-3,
        precondition_frequency=3,
        mc_samples=2,
        adamw_lr=0.01,
        adamw_weight_decay=0.01,
        hess_clip_ratio=None,
        clip="none",
        seed=123,
    )
    options.update(overrides)
    return EVON(groups(model), **options)


def loss_fn(model: nn.Module, data) -> torch.Tensor:
    X, y = data
    return nn.functional.cross_entropy(model(X), y)


def train_step(model: nn.Module, opt: EVON, data) -> None:
    for _ in range(opt.mc_samples):
        with opt.sampled_params(train=True):
            loss_fn(model, data).backward()
    opt.step()
    opt.zero_grad()


def snapshot(model: nn.Module, opt: EVON) -> dict[str, torch.Tensor]:
    """Deep copy of every weight and every optimizer state tensor."""
    out = {f"param.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            for key, value in opt.state[p].items():
                out[f"state.{gi}.{pi}.{key}"] = value.detach().clone()
    return out


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), f"{key} changed"


def roundtrip(obj) -> object:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ------------------------------------------------------------------------ checkpoints
def test_state_dict_loads_with_weights_only() -> None:
    model, data = make_model(), make_data()
    opt = make_opt(model)
    for _ in range(4):
        train_step(model, opt, data)
    sd = roundtrip(opt.state_dict())
    assert sd.keys() == opt.state_dict().keys()
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            saved = sd["state"][sd["param_groups"][gi]["params"][pi]]
            for key, value in opt.state[p].items():
                assert torch.equal(saved[key], value), key


def test_a_loaded_adamw_step_count_goes_where_its_kernel_reads_it(monkeypatch) -> None:
    """``load_state_dict`` keeps step counts on the device they were saved on; the AdamW groups'
    are moved to ``adamw_step_device`` (a checkpoint saved on a GPU, loaded with
    ``map_location="cpu"``, would otherwise leave CPU counts beside CUDA parameters for the fused
    kernel). Without a second device here, that device is stood in for by "meta"."""
    import hf_evon.optim.persistence as persistence

    model, data = make_model(), make_data()
    opt = make_opt(model)
    for _ in range(2):
        train_step(model, opt, data)
    saved = roundtrip(opt.state_dict())
    monkeypatch.setattr(persistence, "adamw_step_device", lambda p: torch.device("meta"))
    fresh = make_opt(model)
    fresh.load_state_dict(saved)
    biases, weights = fresh.param_groups[1]["params"], fresh.param_groups[0]["params"]
    assert all(fresh.state[b]["step"].device.type == "meta" for b in biases)
    assert all(t.device.type == "cpu" for w in weights for t in fresh.state[w].values() if torch.is_tensor(t))


@pytest.mark.parametrize(
    ("dtype", "clip", "weight_decay"),
    [
        (torch.float32, "none", 1e-3),
        (torch.bfloat16, "none", 1e-3),
        (torch.float32, "element", 1e-3),
        # a strong prior pull: a rotated mean carried between steps instead of rotated from the
        # weights (which a resumed run must do) showed in the weights here
        (torch.float32, "none", 0.3),
    ],
)
def test_resume_is_bit_for_bit(dtype: torch.dtype, clip: str, weight_decay: float) -> None:
    """Save mid-run, reload into fresh copies, continue: identical to never stopping ("element":
    the SNR step scale's EMA of ‖G‖² is part of the state)."""
    data = make_data(dtype=dtype)
    total, stop = 11, 5  # the stop is between refreshes (f = 3), mid phase
    # "element" at this rate fits the data within a few steps: the SNR scale shrinks steps after the stop
    options = {} if clip == "none" else {"clip": clip, "clip_radius": 0.1, "lr": 10.0}
    options["weight_decay"] = weight_decay

    model = make_model(dtype=dtype)
    opt = make_opt(model, **options)
    for _ in range(total):
        train_step(model, opt, data)
    uninterrupted = snapshot(model, opt)

    model = make_model(dtype=dtype)
    opt = make_opt(model, **options)
    for _ in range(stop):
        train_step(model, opt, data)
    checkpoint = roundtrip({"model": model.state_dict(), "optimizer": opt.state_dict()})
    del model, opt

    resumed_model = make_model(seed=42, dtype=dtype)  # other weights, other seed: all must load
    resumed_opt = make_opt(resumed_model, seed=7, **options)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    for _ in range(total - stop):
        train_step(resumed_model, resumed_opt, data)
    assert_identical(snapshot(resumed_model, resumed_opt), uninterrupted)
    # EVON state keeps its own precision in a bfloat16 model
    w = resumed_opt.param_groups[0]["params"][0]
    assert resumed_opt.state[w]["hess"].dtype == torch.float32


def test_checkpoint_from_before_snr_scaling_resumes_without_it() -> None:
    """A state saved before ``snr_scaling`` existed (no ``exp_avg_sq_norm``, groups without the
    key) loads into today's optimizer and continues as it was trained: unscaled steps."""
    data = make_data()
    options = {"clip": "element", "clip_radius": 0.1, "lr": 10.0}  # the scale shrinks steps 6-11

    def strip(state: dict) -> dict:
        return {k: v for k, v in state.items() if not k.endswith("exp_avg_sq_norm")}

    model = make_model()
    opt = make_opt(model, snr_scaling=False, **options)
    for _ in range(11):
        train_step(model, opt, data)
    uninterrupted = strip(snapshot(model, opt))

    model = make_model()
    opt = make_opt(model, snr_scaling=False, **options)
    for _ in range(5):
        train_step(model, opt, data)
    old = roundtrip({"model": model.state_dict(), "optimizer": opt.state_dict()})
    for st in old["optimizer"]["state"].values():
        if "hess" in st:  # EVON's (AdamW's state has no such entry)
            del st["exp_avg_sq_norm"]
    for group in old["optimizer"]["param_groups"]:
        del group["snr_scaling"]

    def resume(scaled: bool | str | None) -> dict:
        sd = copy.deepcopy(old)
        if scaled is not None:
            for group in sd["optimizer"]["param_groups"]:
                group["snr_scaling"] = scaled
        resumed_model = make_model(seed=42)
        resumed_opt = make_opt(resumed_model, **options)  # the default: snr_scaling="adam"
        resumed_model.load_state_dict(sd["model"])
        resumed_opt.load_state_dict(sd["optimizer"])
        for _ in range(6):
            train_step(resumed_model, resumed_opt, data)
        return strip(snapshot(resumed_model, resumed_opt))

    assert_identical(resume(None), uninterrupted)
    # the same checkpoint told to scale (by min(1, ρ): Adam's step size, below 1 from the first
    # resumed step on): other weights, so the test can fail
    scaled = resume("adam")
    assert not all(torch.equal(scaled[k], uninterrupted[k]) for k in uninterrupted if k.startswith("param."))


def test_a_state_dict_with_adamws_eps_under_adamw_eps_resumes_with_it_as_the_groups_eps() -> None:
    """State dicts saved while every group carried AdamW's ε as ``adamw_eps`` and an AdamW group
    showed EVON's Hessian ε (1e-12) as ``eps`` load with the saved ``adamw_eps`` as the AdamW
    group's ``eps`` (not EVON's 1e-12, nor this optimizer's own 1e-8) and train on exactly as the
    optimizer that saved them; the state dict given is left as it was."""
    model, data = make_model(), make_data()
    opt = make_opt(model, adamw_eps=1e-3)
    for _ in range(3):
        train_step(model, opt, data)
    old = roundtrip({"model": model.state_dict(), "optimizer": opt.state_dict()})
    for group in old["optimizer"]["param_groups"]:
        group["eps"] = 1e-12 if group["algorithm"] == "adamw" else group["eps"]
        group["adamw_eps"] = 1e-3
    for _ in range(3):
        train_step(model, opt, data)
    uninterrupted = snapshot(model, opt)

    resumed_model = make_model(seed=42)
    resumed_opt = make_opt(resumed_model)  # AdamW's ε: the default 1e-8
    resumed_model.load_state_dict(old["model"])
    resumed_opt.load_state_dict(old["optimizer"])
    assert [g["eps"] for g in resumed_opt.param_groups] == [1e-12, 1e-3]
    assert not any("adamw_eps" in g for g in resumed_opt.param_groups)
    assert [(g["eps"], g["adamw_eps"]) for g in old["optimizer"]["param_groups"]] == [(1e-12, 1e-3)] * 2
    for _ in range(3):
        train_step(resumed_model, resumed_opt, data)
    assert_identical(snapshot(resumed_model, resumed_opt), uninterrupted)
    # with EVON's 1e-12 as AdamW's ε the biases go elsewhere (the test can fail)
    again = make_model(seed=42)
    again_opt = make_opt(again)
    again.load_state_dict(old["model"])
    again_opt.load_state_dict(old["optimizer"])
    again_opt.param_groups[1]["eps"] = 1e-12
    for _ in range(3):
        train_step(again, again_opt, data)
    assert not torch.equal(again[0].bias, resumed_model[0].bias)


def _rotated(m: torch.Tensor, st: dict, back: bool = False) -> torch.Tensor:
    """Q_Lᵀ m Q_R (``back``: Q_L m Q_Rᵀ) with a member's saved bases."""
    q_left, q_right = st.get("Q_L"), st.get("Q_R")
    if q_left is not None:
        m = (q_left if back else q_left.mT) @ m
    if q_right is not None:
        m = m @ (q_right.mT if back else q_right)
    return m


def test_a_checkpoint_with_the_momentum_in_the_eigenbasis_resumes_the_per_matrix_step() -> None:
    """The per-matrix step keeps its momentum in the weights' space (``exp_avg_unrotated``); a
    state holding it in the eigenbasis (``exp_avg``: the per-entry step's, and what every
    ``step_curvature`` saved before) is moved with its bases on load and continues the run."""
    data = make_data(dtype=F64)
    options = {"step_curvature": "matrix", "clip": "element", "clip_radius": 0.1, "lr": 3.0}

    model = make_model(dtype=F64)
    opt = make_opt(model, **options)
    for _ in range(11):
        train_step(model, opt, data)
    uninterrupted = snapshot(model, opt)

    model = make_model(dtype=F64)
    opt = make_opt(model, **options)
    for _ in range(5):
        train_step(model, opt, data)
    saved = roundtrip({"model": model.state_dict(), "optimizer": opt.state_dict()})
    for st in saved["optimizer"]["state"].values():
        if "hess" in st:  # EVON's: its momentum as the eigenbasis holds it
            st["exp_avg"] = _rotated(st.pop("exp_avg_unrotated"), st)

    def resume(state_dict: dict) -> dict[str, torch.Tensor]:
        resumed_model, resumed_opt = make_model(seed=42, dtype=F64), None
        resumed_opt = make_opt(resumed_model, **options)
        resumed_model.load_state_dict(saved["model"])
        resumed_opt.load_state_dict(state_dict)
        for _ in range(6):
            train_step(resumed_model, resumed_opt, data)
        return snapshot(resumed_model, resumed_opt)

    resumed = resume(saved["optimizer"])
    assert resumed.keys() == uninterrupted.keys()  # no "exp_avg" left beside the moved momentum
    for key, value in uninterrupted.items():
        torch.testing.assert_close(resumed[key], value, rtol=1e-9, atol=1e-12, msg=key)
    # the same momentum taken as if it were in the weights' space continues another run
    unmoved = copy.deepcopy(saved["optimizer"])
    for st in unmoved["state"].values():
        if "hess" in st:
            st["exp_avg_unrotated"] = st.pop("exp_avg")
    wrong = resume(unmoved)
    assert max(float((wrong[k] - v).abs().max()) for k, v in uninterrupted.items() if k.startswith("param.")) > 1e-6


def test_a_changed_step_curvature_moves_the_momentum_into_its_space() -> None:
    """A group switched from the per-matrix to the per-entry step between two steps takes its
    momentum into the eigenbasis: the next step's momentum is β1·Q_Lᵀ M̂ Q_R + (1−β1)·Q_Lᵀ G Q_R
    with the bases it was taken with (no refresh in between: f = 1000)."""
    data = make_data(dtype=F64)
    model = make_model(dtype=F64)
    opt = make_opt(model, step_curvature="matrix", mc_samples=1, precondition_frequency=1000, stagger_refresh=False)
    for _ in range(4):
        train_step(model, opt, data)
    weights = opt.param_groups[0]["params"]
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in weights}
    opt.param_groups[0]["step_curvature"] = "entry"
    with opt.sampled_params(train=True):
        loss_fn(model, data).backward()
    grads = {p: p.grad.clone() for p in weights}
    opt.step()
    beta1 = opt.param_groups[0]["betas"][0]
    for p in weights:
        st = opt.state[p]
        assert "exp_avg" in st and "exp_avg_unrotated" not in st
        old = before[p]
        expected = beta1 * _rotated(old["exp_avg_unrotated"], old) + (1 - beta1) * _rotated(grads[p], old)
        torch.testing.assert_close(st["exp_avg"], expected, rtol=1e-10, atol=1e-14)
        assert torch.equal(st["Q_L"], old["Q_L"]) and torch.equal(st["Q_R"], old["Q_R"])
    # and back: the momentum returns to the weights' space
    opt.param_groups[0]["step_curvature"] = "matrix"
    train_step(model, opt, data)
    assert all("exp_avg_unrotated" in opt.state[p] and "exp_avg" not in opt.state[p] for p in weights)


def test_a_changed_step_curvature_moves_the_momentum_of_a_member_without_gradient() -> None:
    """The switch reaches every member of a bucket, also one the step leaves out (no gradient):
    its momentum is moved, not updated; its bucket mate's is updated in the eigenbasis."""
    data = make_data(dtype=F64)
    model = make_model(dtype=F64)
    opt = make_opt(model, step_curvature="matrix", mc_samples=1, precondition_frequency=1000, stagger_refresh=False)
    for _ in range(3):
        train_step(model, opt, data)
    idle, busy = model[4].weight, model[2].weight  # one 5×5 bucket
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in (idle, busy)}
    opt.param_groups[0]["step_curvature"] = "entry"
    idle.requires_grad_(False)
    train_step(model, opt, data)
    moved = _rotated(before[idle]["exp_avg_unrotated"], before[idle])
    torch.testing.assert_close(opt.state[idle]["exp_avg"], moved, rtol=1e-10, atol=1e-14)
    assert "exp_avg_unrotated" not in opt.state[idle] and "exp_avg_unrotated" not in opt.state[busy]
    assert not torch.allclose(opt.state[busy]["exp_avg"], _rotated(before[busy]["exp_avg_unrotated"], before[busy]))


def standard_normal_draws(opt: EVON, model: nn.Module, data, steps: int) -> list[torch.Tensor]:
    """The standard-normal z of every training sample: E = z / √(ζ (H + δ)), so z = E √(ζ (H + δ))."""
    out = []
    for _ in range(steps):
        with opt.sampled_params(train=True):
            zs = []
            for group in opt.param_groups:
                if group["algorithm"] != "evon":
                    continue
                for p in group["params"]:
                    scale = (group["ess"] * (opt.state[p]["hess"] + group["weight_decay"])).sqrt()
                    zs.append((opt.current_noise(p) * scale).reshape(-1))
            out.append(torch.cat(zs))
            loss_fn(model, data).backward()
        opt.step()
        opt.zero_grad()
    return out


def test_every_rank_resumes_its_own_noise_from_a_checkpoint_saved_by_rank_0(monkeypatch) -> None:
    """Under DDP only rank 0 writes the checkpoint; rank 1 must still continue its own stream."""

    def on_rank(rank: int) -> None:  # what torch.distributed.get_rank() would say
        monkeypatch.setattr(evon_module, "process_rank", lambda: rank)

    data = make_data()
    total, stop = 7, 3
    model = make_model()
    on_rank(1)
    rank1 = make_opt(model)
    train_step(model, rank1, data)  # the initialising step
    uninterrupted = standard_normal_draws(rank1, model, data, total)

    model = make_model()
    on_rank(0)
    rank0 = make_opt(model)
    train_step(model, rank0, data)
    rank0_draws = standard_normal_draws(rank0, model, data, stop)
    checkpoint = roundtrip({"model": model.state_dict(), "optimizer": rank0.state_dict()})

    resumed_model = make_model(seed=42)
    on_rank(1)
    resumed = make_opt(resumed_model, seed=7)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["optimizer"])
    continued = standard_normal_draws(resumed, resumed_model, data, total - stop)
    # z is recovered through H, which differs between the histories: equal up to rounding
    for t, (a, b) in enumerate(zip(continued, uninterrupted[stop:])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"rank 1's draw {stop + t} after resuming")
    assert all((a - b).abs().max() > 0.1 for a, b in zip(rank0_draws, uninterrupted))  # ranks differ


def test_state_holds_no_copy_of_the_weights() -> None:
    model, data = make_model(), make_data()
    opt = make_opt(model)
    for _ in range(4):
        train_step(model, opt, data)
    expected_numel = 0
    for p in opt.param_groups[0]["params"]:  # EVON: both sides preconditioned
        m, n = p.shape
        shapes = {
            "hess": (m, n),
            "exp_avg_unrotated": (m, n),  # the per-matrix step's momentum, in the weights' space
            "exp_avg_sq_norm": (),
            "noise_watched": (),  # the health check's runaway watch, resumed with the state
            "step": (),
            "L": (m, m),
            "R": (n, n),
            "Q_L": (m, m),
            "Q_R": (n, n),
        }
        assert {k: tuple(v.shape) for k, v in opt.state[p].items()} == shapes
        expected_numel += sum(math.prod(s) for s in shapes.values())
    for p in opt.param_groups[1]["params"]:  # AdamW
        shapes = {"step": (), "exp_avg": tuple(p.shape), "exp_avg_sq": tuple(p.shape)}
        assert {k: tuple(v.shape) for k, v in opt.state[p].items()} == shapes
        expected_numel += sum(math.prod(s) for s in shapes.values())
    saved = roundtrip(opt.state_dict())
    numel = sum(v.numel() for st in saved["state"].values() for v in st.values() if torch.is_tensor(v))
    assert numel == expected_numel


# ------------------------------------------------------------------------- validation
INVALID = [
    ({"lr": -0.1}, "lr", ">= 0"),
    ({"lr": float("nan")}, "lr", ">= 0"),
    ({"ess": 0.0}, "ess", "> 0"),
    ({"ess": -5.0}, "ess", "> 0"),
    ({"ess": float("nan")}, "ess", "> 0"),
    ({"hess_init": 0.0}, "hess_init", "> 0"),
    ({"hess_init": float("inf")}, "hess_init", "finite"),
    ({"betas": (1.0, 0.9)}, "betas", "[0, 1)"),
    ({"betas": (0.9, 1.0)}, "betas", "[0, 1)"),
    ({"betas": (-0.1, 0.9)}, "betas", "[0, 1)"),
    ({"betas": (0.9,)}, "betas", "[0, 1)"),
    ({"weight_decay": -1e-4}, "weight_decay", ">= 0"),
    ({"mc_samples": 0}, "mc_samples", ">= 1"),
    ({"mc_samples": 1.5}, "mc_samples", "integer"),
    ({"precondition_frequency": 0}, "precondition_frequency", ">= 1"),
    ({"max_precond_dim": 0}, "max_precond_dim", ">= 1"),
    ({"shampoo_beta": 1.0}, "shampoo_beta", "[0, 1)"),
    ({"shampoo_beta": -0.5}, "shampoo_beta", "[0, 1)"),
    ({"hess_clip_ratio": 0.0}, "hess_clip_ratio", "> 0"),
    ({"clip": "norm"}, "clip", "spectral"),
    ({"clip_radius": 0.0}, "clip_radius", "> 0"),
    ({"snr_scaling": "yes"}, "snr_scaling", "a bool"),
    ({"eps": 0.0}, "eps", "> 0"),
    ({"nonfinite": "ignore"}, "nonfinite", "'skip'"),
    ({"adamw_lr": -0.01}, "adamw_lr", ">= 0"),
    ({"adamw_betas": (0.9, 1.5)}, "adamw_betas", "[0, 1)"),
    ({"adamw_eps": 0.0}, "adamw_eps", "> 0"),
    ({"adamw_weight_decay": -0.1}, "adamw_weight_decay", ">= 0"),
    ({"hess_estimator": "ggn"}, "hess_estimator", "'fisher'"),
    ({"curvature_refit": -1}, "curvature_refit", ">= 0"),
    ({"curvature_refit": 2.5}, "curvature_refit", "integer"),
    ({"step_curvature": "row"}, "step_curvature", "'matrix'"),
    ({"mean_weight_decay": -1e-3}, "mean_weight_decay", ">= 0"),
    ({"mean_weight_decay": float("nan")}, "mean_weight_decay", "finite"),
]


@pytest.mark.parametrize("with_adamw_group", [False, True])
@pytest.mark.parametrize(
    ("kwargs", "name", "rule"), INVALID, ids=[f"{n}={list(k.values())[0]}" for k, n, _ in INVALID]
)
def test_invalid_hyperparameter_raises(kwargs: dict, name: str, rule: str, with_adamw_group: bool) -> None:
    model = make_model()
    params = groups(model) if with_adamw_group else [p for n, p in model.named_parameters() if "weight" in n]
    with pytest.raises(ValueError) as info:
        EVON(params, **{"ess": 10.0, **kwargs})
    message = str(info.value)
    assert name in message and rule in message, message


@pytest.mark.parametrize(
    ("group", "name"),
    [
        ({"algorithm": "sgd"}, "algorithm"),
        ({"lr": -1.0}, "lr"),
        ({"clip": "x"}, "clip"),
        ({"ess": 0.0}, "ess"),
    ],
)
def test_invalid_param_group_raises(group: dict, name: str) -> None:
    model = make_model()
    with pytest.raises(ValueError, match=name):
        EVON([{"params": list(model.parameters()), **group}], **plain_evon(ess=10.0))
    opt = EVON([next(model.parameters())], **plain_evon(ess=10.0))
    with pytest.raises(ValueError, match=name):
        opt.add_param_group({"params": [model[2].weight], **group})


def test_valid_edge_values_are_accepted() -> None:
    model = make_model()
    weights = [p for n, p in model.named_parameters() if "weight" in n]
    EVON(weights, **plain_evon(lr=0.0, betas=(0.0, 0.0), weight_decay=0.0, shampoo_beta=0.0))
    EVON(
        weights,
        **plain_evon(
            ess=1e-3, hess_init=1e-8, clip_radius=1e30, hess_clip_ratio=1e9, max_precond_dim=1
        ),
    )


# ----------------------------------------------------------------- non-finite gradients
@pytest.mark.parametrize("where", ["evon", "adamw", "inf"])
def test_nonfinite_gradient_skips_the_step(where: str) -> None:
    model, data = make_model(), make_data()
    opt = make_opt(model)
    for _ in range(3):
        train_step(model, opt, data)
    before = snapshot(model, opt)
    target = {"evon": model[2].weight, "adamw": model[0].bias, "inf": model[4].weight}[where]
    for s in range(opt.mc_samples):
        with opt.sampled_params(train=True):
            loss_fn(model, data).backward()
            if s == 1:
                target.grad.view(-1)[0] = float("inf") if where == "inf" else float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    opt.zero_grad()
    assert_identical(snapshot(model, opt), before)
    assert opt.skipped_steps == 1
    # usable afterwards: the next finite step is a normal update
    train_step(model, opt, data)
    after = snapshot(model, opt)
    w = model[2].weight
    assert int(opt.state[w]["step"]) == int(before["state.0.1.step"]) + 1
    assert not torch.equal(after["param.2.weight"], before["param.2.weight"])
    assert all(torch.isfinite(v).all() for v in after.values())


def test_nonfinite_gradient_can_raise() -> None:
    model, data = make_model(), make_data()
    opt = make_opt(model, nonfinite="raise")
    for _ in range(3):
        train_step(model, opt, data)
    before = snapshot(model, opt)
    for _ in range(opt.mc_samples):
        with opt.sampled_params(train=True):
            (loss_fn(model, data) * float("nan")).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # raising, not warning
        with pytest.raises(NonFiniteGradientError, match="non-finite"):
            opt.step()
    opt.zero_grad()
    assert_identical(snapshot(model, opt), before)
    train_step(model, opt, data)  # and it recovers
    assert not torch.equal(model[2].weight, before["param.2.weight"])


# --------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("train", [True, False])
def test_sampled_params_restores_weights_bit_for_bit(train: bool) -> None:
    model, data = make_model(), make_data()
    opt = make_opt(model)
    for _ in range(3):
        train_step(model, opt, data)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with opt.sampled_params(train=train):
        inside = {k: v.clone() for k, v in model.state_dict().items()}
        loss_fn(model, data).backward()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    # the weights inside were a sample (EVON weights moved, AdamW biases did not)
    for k in before:
        assert torch.equal(inside[k], before[k]) == k.endswith("bias"), k

    class Boom(Exception):
        pass

    with pytest.raises(Boom), opt.sampled_params(train=train):
        assert not torch.equal(model[0].weight, before["0.weight"])
        raise Boom
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    opt.zero_grad()
    train_step(model, opt, data)  # still usable: the failed sample left no trace


@pytest.mark.parametrize("estimator", ["price", "fisher"])
def test_an_interrupt_during_a_samples_exit_restores_every_mean(
    monkeypatch: pytest.MonkeyPatch, estimator: str
) -> None:
    """Issue 33 item 2.1: a KeyboardInterrupt while the block exits (the Price estimate: while it
    records its sample; the Fisher one records nothing: while it writes the first mean back)
    aborted the clean-up: the later buckets kept the sampled weights, the optimizer stayed "in a
    sample", a save stored noise as the mean and every later block said "cannot be nested"."""
    from hf_evon.optim.buckets import Bucket

    model, data = make_model(), make_data()
    opt = make_opt(model, hess_estimator=estimator)
    for _ in range(3):
        train_step(model, opt, data)
    assert len(opt.buckets) > 1  # the interrupt lands in the first bucket: the others must be restored
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads_before = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    name = "record_sample" if estimator == "price" else "write_params"
    original = getattr(Bucket, name)
    calls = []

    def interrupted(self: Bucket, *args, **kwargs) -> None:
        calls.append(name)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    with pytest.raises(KeyboardInterrupt), opt.sampled_params(train=True):
        loss_fn(model, data).backward()
        monkeypatch.setattr(Bucket, name, interrupted)  # from the block's exit on
    monkeypatch.setattr(Bucket, name, original)
    assert calls  # the interrupt was raised
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    for n, p in model.named_parameters():  # .grad as at the block's entry
        assert (p.grad is None) == (grads_before[n] is None) and (p.grad is None or torch.equal(p.grad, grads_before[n]))
    assert opt.recorded_samples == 0
    opt.zero_grad()
    train_step(model, opt, data)  # not "in a sample": the optimizer is usable
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_step_without_sampled_params_raises() -> None:
    model, data = make_model(), make_data()
    opt = make_opt(model)
    train_step(model, opt, data)  # the initialising step
    before = snapshot(model, opt)
    loss_fn(model, data).backward()
    with pytest.raises(RuntimeError, match="sampled_params"):
        opt.step()
    opt.zero_grad()
    assert_identical(snapshot(model, opt), before)
    # IVON mode / 1-D parameters have no initialising step: the very first step needs a sample
    w = nn.Parameter(torch.randn(5))
    ivon = EVON([w], **plain_evon(ess=10.0))
    w.square().sum().backward()
    with pytest.raises(RuntimeError, match="sampled_params"):
        ivon.step()
    # deterministic mode (ess = inf) needs none
    det = EVON([nn.Parameter(torch.randn(3, 4))], **plain_evon())
    for p in det.param_groups[0]["params"]:
        p.square().sum().backward()
    det.step()


def draw_samples(opt: EVON, model: nn.Module, count: int) -> list[torch.Tensor]:
    out = []
    for _ in range(count):
        with opt.sampled_params(train=False):
            out.append(torch.cat([p.detach().reshape(-1).clone() for p in opt.param_groups[0]["params"]]))
    return out


def test_noise_is_reproducible_from_the_seed() -> None:
    data = make_data()
    runs = {}
    for label, seed in (("a", 5), ("b", 5), ("c", 6)):
        model = make_model()
        opt = make_opt(model, seed=seed)
        for _ in range(4):
            train_step(model, opt, data)
        runs[label] = (snapshot(model, opt), draw_samples(opt, model, 3))
    assert_identical(runs["a"][0], runs["b"][0])
    assert all(torch.equal(x, y) for x, y in zip(runs["a"][1], runs["b"][1]))
    assert not torch.equal(runs["a"][0]["param.2.weight"], runs["c"][0]["param.2.weight"])
    assert not any(torch.equal(x, y) for x, y in zip(runs["a"][1], runs["c"][1]))


def wide_step(opt: EVON, body: nn.Linear, skip: nn.Linear, data: tuple) -> None:
    """One step of ``wide_head``'s model: two maps of the 300 features summed into 2 logits."""
    X, y = data
    with opt.sampled_params(train=True):
        nn.functional.cross_entropy(skip(X) + body(X)[:, :2], y).backward()
    opt.step()
    opt.zero_grad()


def wide_head(ratio: float | None = None) -> tuple[EVON, nn.Linear, nn.Linear, tuple]:
    """Two linear maps of 300 features, 3×300 (``body``, 100×) and 2×300 (``skip``, 150×), summed
    into 2 logits and trained 4 steps; ``ratio``: EVON's ``max_precond_ratio`` (None: the default)."""
    torch.manual_seed(0)
    body, skip = nn.Linear(300, 3, bias=False), nn.Linear(300, 2, bias=False)
    extra = {} if ratio is None else {"max_precond_ratio": ratio}
    opt = EVON([body.weight, skip.weight], lr=0.05, ess=64.0, precondition_frequency=2, seed=0, **extra)
    data = (torch.randn(16, 300), torch.randint(0, 2, (16,)))
    for _ in range(4):
        wide_step(opt, body, skip, data)
    return opt, body, skip, data


def test_a_side_over_128_times_the_other_keeps_the_identity_basis() -> None:
    """2×300: the 300 side is 150× the 2 side (over the default 128: no basis there); 3×300
    (100×) keeps both; an infinite ratio keeps every basis."""
    opt, body, skip, _ = wide_head()
    sides = lambda o, p: ("Q_L" in o.state[p], "Q_R" in o.state[p])  # noqa: E731
    assert opt.param_groups[0]["max_precond_ratio"] == 128.0
    assert sides(opt, body.weight) == (True, True) and sides(opt, skip.weight) == (True, False)
    unlimited, _, skip, _ = wide_head(math.inf)
    assert sides(unlimited, skip.weight) == (True, True)


def test_a_state_saved_without_max_precond_ratio_keeps_its_bases() -> None:
    """A checkpoint from before the option has a 300×300 basis on the 2×300 matrix: loaded into
    an optimizer with the default ratio, that matrix keeps it (no limit for such a group) and
    goes on refreshing it."""
    saved_opt = wide_head(math.inf)[0]
    state = roundtrip(saved_opt.state_dict())
    for group in state["param_groups"]:
        del group["max_precond_ratio"]
    opt, body, skip, data = wide_head()
    opt.load_state_dict(state)
    before = opt.state[skip.weight]["Q_R"].clone()
    for _ in range(2):
        wide_step(opt, body, skip, data)
    assert opt.state[skip.weight]["Q_R"].shape == (300, 300)
    assert not torch.equal(opt.state[skip.weight]["Q_R"], before)  # refreshed (every 2 steps)


# -------------------------------------------------------------------------- posterior
def trained_float64(steps: int = 12) -> tuple[nn.Module, EVON]:
    """A float64 model with a non-trivial posterior (refreshed bases, uneven Hessian),
    including a 1-D EVON parameter (Q = I) and a one-sided one (max_precond_dim)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 7)).double()
    extra = nn.Parameter(torch.randn(5, dtype=F64))
    params = [model[0].weight, model[2].weight, extra]
    opt = EVON(
        [{"params": params}, {"params": [model[0].bias, model[2].bias], "algorithm": "adamw"}],
        **plain_evon(
            lr=0.1,
            ess=50.0,
            hess_init=1.0,
            betas=(0.9, 0.6),
            weight_decay=0.01,
            precondition_frequency=2,
            max_precond_dim=6,
            seed=0,
        ),
    )
    X, y = torch.randn(40, 4, dtype=F64), torch.randint(0, 7, (40,))
    for _ in range(steps):
        with opt.sampled_params(train=True):
            (nn.functional.cross_entropy(model(X), y) + 0.1 * extra.pow(4).sum()).backward()
        opt.step()
        opt.zero_grad()
    model.extra = extra
    return model, opt


def covariance_from_state(opt: EVON, p: torch.Tensor) -> torch.Tensor:
    """Cov(vec W) of W = M + Q_L E Q_Rᵀ, E_kl ~ N(0, V_kl), entry by entry (row-major vec)."""
    st, group = opt.state[p], opt.param_groups[0]
    H = st["hess"].to(F64)
    m, n = H.shape
    Q_L = st["Q_L"].to(F64) if "Q_L" in st else torch.eye(m, dtype=F64)
    Q_R = st["Q_R"].to(F64) if "Q_R" in st else torch.eye(n, dtype=F64)
    V = 1.0 / (group["ess"] * (H + group["weight_decay"]))
    # W_ij - M_ij = Σ_kl Q_L[i,k] E_kl Q_R[j,l]  =>  Cov[(i,j),(a,b)] = Σ_kl Q_L[i,k] Q_R[j,l] V_kl Q_L[a,k] Q_R[b,l]
    cov = torch.einsum("ik,jl,kl,ak,bl->ijab", Q_L, Q_R, V, Q_L, Q_R)
    return cov.reshape(m * n, m * n)


def test_posterior_covariance_and_std_match_the_state() -> None:
    model, opt = trained_float64()
    params = opt.param_groups[0]["params"]
    sides = [(("Q_L" in opt.state[p]), ("Q_R" in opt.state[p])) for p in params]
    assert sides == [(True, True), (False, True), (False, False)]  # (3,4); (7,3): 7 > 6; 1-D
    for p in params:
        cov = opt.posterior_covariance(p)
        assert cov.shape == (p.numel(), p.numel())
        torch.testing.assert_close(cov, covariance_from_state(opt, p), rtol=1e-12, atol=1e-15)
        std = opt.posterior_std(p)
        assert std.shape == p.shape
        torch.testing.assert_close(std.reshape(-1) ** 2, torch.diagonal(cov), rtol=1e-12, atol=0)
    w = params[0]
    cov = opt.posterior_covariance(w)
    assert (cov - torch.diag(torch.diagonal(cov))).abs().max() > 0.05 * torch.diagonal(
        cov
    ).max()  # not diagonal


def max_z(empirical: torch.Tensor, cov: torch.Tensor, N: int) -> float:
    """Largest |z| of a sample covariance of N Gaussian draws against a candidate covariance."""
    d = torch.diagonal(cov)
    se = ((d[:, None] * d[None, :] + cov**2) / (N - 1)).sqrt()
    return float(((empirical - cov) / se).abs().max())


def test_samples_follow_the_posterior_covariance() -> None:
    """The empirical covariance of many sampled weights matches posterior_covariance.

    Under the null, the sample covariance entry S_ij of N Gaussian draws has standard error
    sqrt((Σ_ii Σ_jj + Σ_ij²) / (N − 1)); with 10000 draws a |z| above 5.5 anywhere among the
    entries has probability < 1e-5. The same check rejects plausible mistakes (a swapped
    Kronecker order, a diagonal covariance), so it has the power to fail.
    """
    model, opt = trained_float64()
    params = opt.param_groups[0]["params"]
    means = [p.detach().clone() for p in params]
    N = 10000
    draws = torch.stack(draw_samples(opt, model, N))
    assert all(torch.equal(p, m) for p, m in zip(params, means))  # train=False left the means
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    for i, p in enumerate(params):
        x = draws[:, offsets[i] : offsets[i + 1]]
        cov = opt.posterior_covariance(p)
        var = torch.diagonal(cov)
        mean_z = (x.mean(0) - p.detach().reshape(-1)) / (var / N).sqrt()
        assert float(mean_z.abs().max()) < 5.5
        emp = torch.cov(x.T)

        assert max_z(emp, cov, N) < 5.5, f"param {i}"
        if i == 0:  # power: the wrong structures are rejected by the same statistic
            m, n = p.shape
            st = opt.state[p]
            V = 1.0 / (50.0 * (st["hess"] + 0.01))
            swapped = torch.kron(st["Q_R"], st["Q_L"]) * V.T.reshape(-1) @ torch.kron(st["Q_R"], st["Q_L"]).T
            assert max_z(emp, swapped, N) > 20
            assert max_z(emp, torch.diag(var), N) > 20
    # the joint draws of different matrices are independent (block-diagonal posterior)
    cross = torch.cov(draws.T)[offsets[0] : offsets[1], offsets[1] : offsets[2]]
    sd0 = torch.diagonal(opt.posterior_covariance(params[0])).sqrt()
    sd1 = torch.diagonal(opt.posterior_covariance(params[1])).sqrt()
    assert float((cross / (sd0[:, None] * sd1[None, :]) * math.sqrt(N - 1)).abs().max()) < 5.5


def test_reloaded_optimizer_reports_the_same_posterior() -> None:
    model, opt = trained_float64()
    w = opt.param_groups[0]["params"][0]
    cov = opt.posterior_covariance(w)
    clone_model = copy.deepcopy(model)
    clone_params = [clone_model[0].weight, clone_model[2].weight, clone_model.extra]
    clone = EVON(
        [
            {"params": clone_params},
            {"params": [clone_model[0].bias, clone_model[2].bias], "algorithm": "adamw"},
        ],
        **plain_evon(ess=50.0, weight_decay=0.01, max_precond_dim=6),
    )
    clone.load_state_dict(roundtrip(opt.state_dict()))
    torch.testing.assert_close(clone.posterior_covariance(clone_params[0]), cov, rtol=0, atol=0)


def test_recorded_samples_counts_completed_training_samples() -> None:
    model, data = make_model(), make_data()
    opt = make_opt(model)
    train_step(model, opt, data)
    assert opt.recorded_samples == 0
    for expected in (1, 2):
        with opt.sampled_params(train=True):
            loss_fn(model, data).backward()
        assert opt.recorded_samples == expected
    with opt.sampled_params(train=False):
        pass
    with pytest.raises(ZeroDivisionError), opt.sampled_params(train=True):
        raise ZeroDivisionError  # a failed sample is not recorded
    assert opt.recorded_samples == 2
    opt.step()
    assert opt.recorded_samples == 0


def test_fp16_grad_scaler_is_refused_and_leaves_the_optimizer_usable() -> None:
    model, data = make_model(), make_data()
    opt = make_opt(model)
    train_step(model, opt, data)
    before = snapshot(model, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with opt.sampled_params(train=True):
        scaler.scale(loss_fn(model, data)).backward()
    with pytest.raises(NotImplementedError, match="GradScaler.*bfloat16"):
        scaler.step(opt)
    assert_identical(snapshot(model, opt), before)
    assert opt.recorded_samples == 0  # the scaled sample is dropped, not carried into the next step
    opt.zero_grad()
    train_step(model, opt, data)  # still usable without the scaler
    assert not torch.equal(snapshot(model, opt)["param.0.weight"], before["param.0.weight"])


def _refused_and_unchanged(opt: EVON, model: nn.Module, data, bad: dict, named: str) -> None:
    before = snapshot(model, opt)
    groups = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match="load_state_dict") as err:
        opt.load_state_dict(bad)
    assert named in str(err.value)
    assert_identical(snapshot(model, opt), before)
    assert [dict(g) for g in opt.param_groups] == groups  # the groups' hyperparameters too
    train_step(model, opt, data)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _corrupted_state_refused(corrupt, named: str) -> None:  # noqa: ANN001
    """After three steps, the optimizer's own state dict edited by ``corrupt`` is refused at load naming
    ``named`` (the optimizer unchanged, training on: :func:`_refused_and_unchanged`); its own still loads."""
    model, data = make_model(), make_data()
    opt = make_opt(model)
    for _ in range(3):
        train_step(model, opt, data)
    bad = copy.deepcopy(opt.state_dict())
    corrupt(bad)
    _refused_and_unchanged(opt, model, data, bad, named)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # a valid one still loads


@pytest.mark.parametrize(
    "corrupt,named",
    [
        (lambda sd: sd["param_groups"][0].update(ess=-5.0), "ess"),
        (lambda sd: sd["param_groups"][0].update(weight_decay=float("inf")), "weight_decay"),
        (lambda sd: sd["param_groups"][0].update(identity_basis="false"), "identity_basis"),
        (lambda sd: sd["param_groups"][0].update(mc_samples=0), "mc_samples"),
        (lambda sd: next(st for st in sd["state"].values() if "hess" in st)["hess"].view(-1)[0].fill_(float("nan")), "'hess'"),
        (lambda sd: next(st for st in sd["state"].values() if "hess" in st)["hess"].fill_(-1.0), "H + weight_decay <= 0"),
        (lambda sd: next(st for st in sd["state"].values() if "hess" in st)["exp_avg_unrotated"].fill_(float("inf")), "'exp_avg_unrotated'"),
    ],
)
def test_load_state_dict_validates_as_the_constructor_does(corrupt, named: str) -> None:
    """Issue 33 item 13: load_state_dict accepted ess=-5, weight_decay=inf, identity_basis='false'
    and NaN H, which then failed (or sampled nonsense) steps later. Each is refused at load,
    naming the field, and the optimizer keeps its own state and trains on."""
    _corrupted_state_refused(corrupt, named)


def _evon_entry(sd: dict) -> dict:
    return next(st for st in sd["state"].values() if "hess" in st)


@pytest.mark.parametrize(
    "corrupt,named",
    [
        (lambda sd: _evon_entry(sd)["step"].fill_(-5.0), "'step'"),
        (lambda sd: _evon_entry(sd)["step"].fill_(float("nan")), "'step'"),
        (lambda sd: _evon_entry(sd).update(step="3"), "'step'"),
        (lambda sd: _evon_entry(sd)["exp_avg_sq_norm"].fill_(-1.0), "'exp_avg_sq_norm'"),
        (lambda sd: _evon_entry(sd).update(hess="x"), "'hess'"),
        (lambda sd: sd.update(evon="junk"), "'evon'"),
        (lambda sd: sd["evon"].update(seed="x"), "'seed'"),
        (lambda sd: _evon_entry(sd).update(hess=_evon_entry(sd)["hess"].to(torch.int32)), "'hess'] must be a floating"),
        (lambda sd: _evon_entry(sd).update(hess=_evon_entry(sd)["hess"] > 0), "'hess'] must be a floating"),
        (lambda sd: _evon_entry(sd).update(hess=_evon_entry(sd)["hess"].to(torch.complex64)), "'hess'] must be a floating"),
    ],
    ids=["step<0", "step-nan", "step-str", "exp_avg_sq_norm<0", "hess-str", "extras-str", "seed-str", "hess-int",
         "hess-bool", "hess-complex"],
)  # fmt: skip
def test_load_state_dict_refuses_state_the_next_step_cannot_use(corrupt, named: str) -> None:
    """A state dict with a negative or NaN step count, a negative EMA of ‖G‖² (whose square root
    the step takes), a non-tensor entry or bad counters under 'evon' loaded (an integer or boolean H
    too, the learned curvature truncated to 0 or 1; a complex one raised torch's "not implemented
    for 'ComplexFloat'"): the next steps then
    made every weight NaN (reported as a 'non-finite gradient'), or raised an AttributeError or
    TypeError, the last after the state was already replaced. Each is refused at load, naming the
    entry, and the optimizer keeps its own state and trains on."""
    _corrupted_state_refused(corrupt, named)


def _adamw_entry(sd: dict) -> dict:
    return next(st for st in sd["state"].values() if "exp_avg_sq" in st)


@pytest.mark.parametrize(
    "corrupt,named",
    [
        (lambda sd: _adamw_entry(sd)["exp_avg"].fill_(float("nan")), "'exp_avg'"),
        (lambda sd: _adamw_entry(sd)["exp_avg_sq"].fill_(-1.0), "'exp_avg_sq'"),
        (lambda sd: _adamw_entry(sd)["exp_avg_sq"].fill_(float("inf")), "'exp_avg_sq'"),
        (lambda sd: _adamw_entry(sd)["step"].fill_(-3.0), "'step'"),
        (lambda sd: _adamw_entry(sd)["step"].fill_(float("nan")), "'step'"),
        (lambda sd: _adamw_entry(sd).update(step=3), "'step'"),
        (lambda sd: _evon_entry(sd).update(step=torch.tensor([3.0, 3.0, 3.0])), "'step'"),
        (lambda sd: sd["state"].update({0: 7}), "state[0]"),
        (lambda sd: sd.update(state=[]), "'state'"),
        (lambda sd: sd["param_groups"][1].pop("params"), "'params'"),
    ],
    ids=["adamw-exp_avg-nan", "adamw-exp_avg_sq<0", "adamw-exp_avg_sq-inf", "adamw-step<0", "adamw-step-nan",
         "adamw-step-int", "evon-step-vector", "entry-int", "state-list", "group-no-params"],
)  # fmt: skip
def test_load_state_dict_refuses_adamw_state_and_layouts_the_next_step_cannot_use(corrupt, named: str) -> None:
    """Only EVON groups' entries were checked: a NaN or negative AdamW moment or step count loaded and
    the next step wrote NaN into the weights (no error, no warning, under nonfinite="raise" too), an
    AdamW step count as a Python number or an EVON one of shape (3,) loaded and every later step
    raised, and a state dict whose 'state' is not a dict of dicts, or a group without 'params', raised
    an AttributeError or KeyError naming nothing. Each is refused at load, naming the entry, and the
    optimizer keeps its own state and trains on."""
    _corrupted_state_refused(corrupt, named)


# the keys whose absence made a step raise KeyError (measured by dropping each key of a saved group in turn)
_STEP_READS = {
    "evon": ("lr", "ess", "hess_init", "betas", "weight_decay", "precondition_frequency", "max_precond_dim",
             "shampoo_beta", "clip", "clip_radius", "phased_gradients", "identity_basis"),
    "adamw": ("lr", "betas", "eps", "weight_decay", "precondition_frequency"),
}  # fmt: skip


@pytest.mark.parametrize("group,key", [(g, k) for g, algorithm in enumerate(["evon", "adamw"]) for k in _STEP_READS[algorithm]])
def test_load_state_dict_refuses_a_group_that_lacks_a_hyperparameter(group: int, key: str) -> None:
    """A saved group without one of the hyperparameters its step reads loaded (torch's load replaces
    the groups with the saved ones, so the optimizer's own value was gone too) and the next step
    raised a bare ``KeyError`` naming neither the group nor the file. Refused at load, naming both."""
    _corrupted_state_refused(lambda sd: sd["param_groups"][group].pop(key), f"param_groups[{group}] lacks [{key!r}]")


@pytest.mark.parametrize(
    "corrupt,named",
    [
        (lambda sd: sd["param_groups"][0].update(params=[0, 0]), "distinct parameter indices"),
        (lambda sd: sd["param_groups"][1]["params"].__setitem__(0, 0), "distinct parameter indices"),
        (lambda sd: sd["param_groups"][0]["params"].__setitem__(0, [0]), "distinct parameter indices"),
        (lambda sd: sd["param_groups"][0].update(param_names=5), "'param_names'"),
        (lambda sd: sd["param_groups"][0].update(param_names={0: "a"}), "'param_names'"),
        (lambda sd: sd["param_groups"][0].update(param_names=["a"]), "'param_names'"),
    ],
    ids=["twice-in-a-group", "twice-across-groups", "unhashable", "names-int", "names-dict", "names-short"],
)  # fmt: skip
def test_load_state_dict_refuses_indices_listed_twice_and_malformed_names(corrupt, named: str) -> None:
    """A parameter index listed twice loaded: the second parameter took the first one's state and its
    own was lost; ``param_names`` of 5 raised a ``TypeError`` during the load, a dict a ``KeyError``
    at the next step. Each is refused at load, naming what is wrong."""
    _corrupted_state_refused(corrupt, named)


def test_load_state_dict_refuses_what_is_not_an_optimizer_state_dict() -> None:
    model = make_model()
    opt = make_opt(model)
    for bad in ([], "state", None):
        with pytest.raises(ValueError, match="load_state_dict: expected an optimizer state dict"):
            opt.load_state_dict(bad)


@pytest.mark.parametrize("missing", ["hess", "step", "exp_avg_unrotated"])
def test_load_state_dict_refuses_an_evon_entry_missing_some_of_its_keys(missing: str) -> None:
    """An EVON entry holding some of its state but not H, its step count or its momentum loaded
    without a word, and the next step silently restarted that piece (H from hess_init, the bias
    correction from 0, the momentum from zero). It is refused at load, naming the parameter and the
    missing key, the optimizer unchanged; an entry with no keys (a parameter not stepped yet) and an
    AdamW entry (a parameter moved from an AdamW group) still load."""
    model, data = make_model(), make_data()
    weights = [(n, p) for n, p in model.named_parameters() if n.endswith("weight")]
    opt = make_opt(model)
    opt.param_groups[0]["param_names"] = [n for n, _ in weights]  # as build_param_groups names them
    for _ in range(3):
        train_step(model, opt, data)
    good = copy.deepcopy(opt.state_dict())
    assert missing in good["state"][1]
    bad = copy.deepcopy(good)
    del bad["state"][1][missing]
    _refused_and_unchanged(opt, model, data, bad, f"{missing!r}")
    with pytest.raises(ValueError, match="load_state_dict") as err:
        opt.load_state_dict(bad)
    assert "'2.weight'" in str(err.value) and "state[1]" in str(err.value)
    not_stepped = copy.deepcopy(opt.state_dict())
    not_stepped["state"][1] = {}
    opt.load_state_dict(not_stepped)
    moved = copy.deepcopy(opt.state_dict())
    # AdamW's entry for this weight (saved while it was in an AdamW group): no 'hess', and dropped
    moved["state"][1] = {"exp_avg": torch.zeros(5, 5), "exp_avg_sq": torch.zeros(5, 5), "step": torch.tensor(3.0)}
    opt.load_state_dict(moved)


def test_load_state_dict_refuses_an_eigenbasis_that_is_not_orthonormal() -> None:
    """A state dict whose Q_L was scaled by 1.5 loaded, and the posterior built from the optimizer
    then saved bases that EVONPosterior.from_pretrained refuses ("is not orthonormal"): a saved
    posterior that no load reads. The load refuses it, naming the entry."""
    model, data = make_model(), make_data()
    opt = make_opt(model)
    for _ in range(3):
        train_step(model, opt, data)
    bad = copy.deepcopy(opt.state_dict())
    _evon_entry(bad)["Q_L"].mul_(1.5)
    _refused_and_unchanged(opt, model, data, bad, "['Q_L'] is not orthonormal")
    # finite entries whose QᵀQx overflows (3e38² with a zero beside it: NaN, which `err > tol` let pass)
    q = _evon_entry(bad)["Q_L"]
    q.copy_(torch.eye(len(q))).view(-1)[0].fill_(3e38)
    _refused_and_unchanged(opt, model, data, bad, "['Q_L'] is not orthonormal")


def test_another_optimizers_state_dict_is_refused_before_anything_changes() -> None:
    # torch's AdamW over the same parameters: as many groups and parameters, none of EVON's keys
    model, data = make_model(), make_data()
    opt = make_opt(model)
    train_step(model, opt, data)
    adamw = torch.optim.AdamW(model.parameters())
    loss_fn(model, data).backward()
    adamw.step()
    opt.zero_grad()
    _refused_and_unchanged(opt, model, data, adamw.state_dict(), "param_groups[0] has no 'algorithm'")


def test_another_models_state_dict_is_refused_naming_the_parameter_and_both_shapes() -> None:
    # as many parameters per group, in other shapes: 6-5-5-5-3 against 6-4-4-4-3
    model, data = make_model(), make_data()
    opt = make_opt(model)
    train_step(model, opt, data)
    torch.manual_seed(1)
    other = nn.Sequential(
        nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)
    )
    other_opt = make_opt(other)
    train_step(other, other_opt, data)
    named = "has shape (4, 6), but parameter #0 of its group (shape (5, 6)) needs (5, 6)"
    _refused_and_unchanged(opt, model, data, other_opt.state_dict(), named)
    # the same model grouped otherwise (the first two matrices swapped between groups): named as such
    swapped = [model[2].weight, model[0].weight, model[4].weight, model[6].weight]
    regrouped = EVON([{"params": swapped}, groups(model)[1]], lr=0.05, ess=64.0)
    with pytest.raises(ValueError, match=r"needs \(5, 5\): the state dict of another model, or of this one grouped otherwise"):
        regrouped.load_state_dict(opt.state_dict())


def test_an_adamw_state_of_another_shape_is_refused_naming_the_parameter_and_both_shapes() -> None:
    """An AdamW group's state was loaded whatever its shape: the biases listed in another order put
    a (5,) exp_avg on a (3,) bias, and the next step's fused AdamW kernel wrote past the tensors'
    ends (glibc aborted the process: "free(): invalid next size")."""
    model, data = make_model(), make_data()
    opt = make_opt(model)
    train_step(model, opt, data)
    weights, biases = groups(model)[0]["params"], groups(model)[1]["params"]
    reordered = EVON([{"params": weights}, {"params": biases[::-1], "algorithm": "adamw"}], lr=0.05, ess=64.0)
    train_step(model, reordered, data)
    named = "state[4]['exp_avg'] has shape (5,), but parameter #0 of its group (shape (3,)) needs (3,)"
    _refused_and_unchanged(reordered, model, data, opt.state_dict(), named)


@pytest.mark.parametrize("reset", ["clear", "replace"])
def test_a_reset_optimizer_state_restarts_evons_state_as_torchs_optimizers_do(reset: str) -> None:
    """``optimizer.state.clear()`` (or a new ``defaultdict(dict)``), torch's way to reset an
    optimizer, restarted the AdamW groups only: the EVON groups stepped on with the state stacked
    in their buckets, which ``state_dict()`` no longer held, so a checkpoint lost every EVON
    state entry, and posterior_std reported the old posterior. The EVON groups now restart as well:
    as an optimizer that loads the same state dict with no state (same groups, counters and noise
    stream)."""
    import collections

    data = make_data()
    model, twin = make_model(), make_model()
    opt = make_opt(model)
    for _ in range(3):
        train_step(model, opt, data)
    twin.load_state_dict(model.state_dict())
    fresh = make_opt(twin)
    fresh.load_state_dict({**copy.deepcopy(opt.state_dict()), "state": {}})
    if reset == "clear":
        opt.state.clear()
    else:
        opt.state = collections.defaultdict(dict)
    assert torch.equal(opt.posterior_std(model[0].weight), fresh.posterior_std(twin[0].weight))
    for _ in range(3):
        train_step(model, opt, data)
        train_step(twin, fresh, data)
    assert_identical(snapshot(model, opt), snapshot(twin, fresh))
    saved = opt.state_dict()["state"]
    evon_ids = opt.state_dict()["param_groups"][0]["params"]
    assert all("hess" in saved[i] for i in evon_ids)


def test_a_reset_between_a_recorded_block_and_the_step_is_refused_as_any_rebuild() -> None:
    """Clearing ``optimizer.state`` re-stacks EVON's state, which drops the Hessian numerators of the
    samples recorded since the last step: like ``invalidate_buckets()`` and ``load_state_dict`` there,
    it is refused (at the step), the recorded samples kept; after ``discard_samples()`` the step runs
    as an optimizer reset before the block."""
    data = make_data()
    model = make_model()
    opt = make_opt(model)
    train_step(model, opt, data)
    with opt.sampled_params(train=True):
        loss_fn(model, data).backward()
    opt.state.clear()
    with pytest.raises(RuntimeError, match=r"1 recorded sample\(s\) would lose their Hessian estimate"):
        opt.step()
    opt.discard_samples()
    opt.zero_grad()
    train_step(model, opt, data)
    assert all("hess" in opt.state[p] for p in opt.param_groups[0]["params"])


def test_a_rewind_sets_the_noise_back_to_the_end_of_the_last_step_call_never_past_it() -> None:
    """``discard_samples(rewind=True)`` (a trainer starting over) sets the noise counter back to where
    the last ``step()`` call left it: the blocks of the unfinished step (recorded, or raised) draw
    their noise again; a skipped non-finite step is a step call, its noise never drawn again. The
    optimizer's own ``discard_samples()`` keeps the counter; a copy and a loaded state rewind alike."""
    data = make_data()
    model = make_model()
    opt = make_opt(model)  # mc_samples=2: two blocks a step
    weight = opt.param_groups[0]["params"][0]
    train_step(model, opt, data)
    with opt.sampled_params(train=True):
        (loss_fn(model, data) * math.nan).backward()
    with pytest.warns(RuntimeWarning, match="the step was skipped"):
        opt.step()
    opt.zero_grad()
    assert opt.sample_blocks == 3 and opt.skipped_steps == 1
    with opt.sampled_params(train=True):  # recorded: the 4th block's noise
        loss_fn(model, data).backward()
        drawn = opt.current_noise(weight).clone()
    with pytest.raises(RuntimeError, match="out of memory"), opt.sampled_params(train=True):
        raise RuntimeError("CUDA out of memory.")
    opt.discard_samples()
    assert opt.sample_blocks == 5 and opt.recorded_samples == 0
    copied, loaded = copy.deepcopy(opt), make_opt(make_model())
    loaded.load_state_dict(opt.state_dict())
    for o in (opt, copied, loaded):
        o.discard_samples(rewind=True)
        assert o.sample_blocks == 3
    opt.zero_grad()
    with opt.sampled_params(train=True):
        assert torch.equal(opt.current_noise(weight), drawn)
    with pytest.raises(RuntimeError, match=r"discard_samples\(rewind=True\) called inside a sampled_params"):
        with opt.sampled_params(train=True):
            opt.discard_samples(rewind=True)
    assert opt.sample_blocks == 5


def test_a_state_dict_saved_mid_step_and_an_older_pickle_rewind_to_the_step_mark() -> None:
    """A state dict saved between the blocks of one step kept no step mark: loaded into a fresh EVON,
    ``discard_samples(rewind=True)`` rewound to the saved block count, so the restarted step drew
    other noise than the original's rewind does; an EVON unpickled from a state without the mark
    raised AttributeError at the rewind. Both rewind to the end of the last ``step()`` call (a pickle
    without the mark: to its block count, as a state dict without one loads)."""
    data = make_data()
    model = make_model()
    opt = make_opt(model)  # mc_samples=2
    weight = opt.param_groups[0]["params"][0]
    train_step(model, opt, data)
    with opt.sampled_params(train=True):  # the 3rd block; the step is not finished
        loss_fn(model, data).backward()
    saved = opt.state_dict()
    loaded = make_opt(make_model())
    loaded.load_state_dict(saved)
    drawn = []
    for o in (opt, loaded):
        o.discard_samples(rewind=True)
        o.zero_grad()
        with o.sampled_params(train=True):
            drawn.append(o.current_noise(weight if o is opt else o.param_groups[0]["params"][0]).clone())
    assert opt.sample_blocks == loaded.sample_blocks == 3
    assert torch.equal(drawn[0], drawn[1])
    opt.discard_samples()
    state = opt.__getstate__()
    del state["_evon"]["_stepped_blocks"]
    older = EVON.__new__(EVON)
    older.__setstate__(state)
    older.discard_samples(rewind=True)
    assert older.sample_blocks == 3


def test_a_state_dict_whose_bases_one_stacked_state_cannot_hold_is_refused_naming_both() -> None:
    """Two matrices of one shape and group, stacked apart where the state was saved (float64 and
    float32: one was updated and has its bases, the other never had a gradient) share one stacked
    state in a float32 model: the state dict loaded, and every block after it raised "EVON state
    'L' is missing for some parameters", the optimizer stuck with a state it could not stack. It is
    refused at load, naming both entries, and the optimizer trains on as it was."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4, dtype=F64))
    saved_opt = EVON([a, b], seed=0)
    for _ in range(2):
        with saved_opt.sampled_params(train=True):
            (a.sum() ** 2).backward()  # b never gets a gradient: its bucket is never initialised
        saved_opt.step()
        saved_opt.zero_grad()
    saved = copy.deepcopy(saved_opt.state_dict())
    assert "L" in saved["state"][0] and "L" not in saved["state"][1]
    a2, b2 = nn.Parameter(a.detach().clone()), nn.Parameter(b.detach().float())
    opt = EVON([a2, b2], seed=0)
    with pytest.raises(ValueError, match=r"state\[1\] has no 'L' but state\[0\] has one") as err:
        opt.load_state_dict(saved)
    assert "parameters #1 of its group and #0 of its group (shape (4, 4), torch.float32)" in str(err.value)
    assert not opt.state and opt.sample_blocks == 0
    with opt.sampled_params(train=True):
        (a2.sum() ** 2 + b2.sum()).backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in (a2, b2))


# ------------------------------------------------------ a group's parameter list edited in place
def _two_matrix_steps(opt: EVON, a: nn.Parameter, b: nn.Parameter, uses_b: list[bool]) -> None:
    x = torch.linspace(-1.0, 1.0, 12).reshape(4, 3)
    for use in uses_b:
        with opt.sampled_params(train=True):
            h = x @ a.T
            ((h @ b.T if use else h).tanh().square().sum()).backward()
        opt.step()
        opt.zero_grad()


def test_a_parameter_appended_to_an_evon_groups_list_is_trained() -> None:
    """As torch.optim does, a parameter appended to ``param_groups[i]["params"]`` trains from its first
    gradient, exactly as a member of the group that had no gradient until then. Before, the buckets
    built at the first step never saw it: it got gradients and stayed unchanged."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3, 3))
    ref_a, ref_b = nn.Parameter(a.detach().clone()), nn.Parameter(b.detach().clone())
    b0 = b.detach().clone()
    settings = plain_evon(ess=math.inf, weight_decay=0.0, lr=0.1)
    opt, ref = EVON([a], **settings), EVON([ref_a, ref_b], **settings)
    _two_matrix_steps(opt, a, b, [False, False])
    _two_matrix_steps(ref, ref_a, ref_b, [False, False])
    opt.param_groups[0]["params"].append(b)
    _two_matrix_steps(opt, a, b, [True] * 4)
    _two_matrix_steps(ref, ref_a, ref_b, [True] * 4)
    assert not torch.equal(ref_b, b0)  # the reference trained b
    assert torch.equal(b, ref_b) and torch.equal(a, ref_a)


def test_a_parameter_removed_from_an_evon_groups_list_is_no_longer_updated() -> None:
    """As in torch.optim, a parameter taken out of every group keeps its weights, though it still
    gets gradients. Before, the buckets built at the first step kept stepping (and sampling) it."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3, 3))
    opt = EVON([a, b], **plain_evon(ess=10.0, lr=0.1))
    _two_matrix_steps(opt, a, b, [True] * 2)
    del opt.param_groups[0]["params"][1]  # b
    kept_b, kept_a = b.detach().clone(), a.detach().clone()
    _two_matrix_steps(opt, a, b, [True] * 2)
    assert b.grad is not None and torch.equal(b, kept_b)
    assert not torch.equal(a, kept_a)
    with opt.sampled_params(train=True):
        a.sum().backward()
    opt.param_groups[0]["params"].append(b)  # the recorded sample's Hessian numerator is stacked
    with pytest.raises(RuntimeError, match="editing a group's params was called between"):
        opt.step()
    del opt.param_groups[0]["params"][1]
    opt.step()
    assert torch.equal(b, kept_b)


@pytest.mark.parametrize("reset", ["del", "assign", "clear"])
def test_one_parameters_state_reset_restarts_it_as_a_fresh_optimizer_would(reset: str) -> None:
    """Resetting one parameter's ``optimizer.state`` entry (as torch.optim users reset a re-initialised
    layer's) restarts its state, as a fresh optimizer over it would. Before, only the first member
    of a bucket was watched: the other's entry stayed empty (state_dict() saved nothing for it)
    while the buckets stepped it with its old state."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3, 3))
    settings = plain_evon(ess=math.inf, weight_decay=0.0, lr=0.1, precondition_frequency=2, stagger_refresh=False)
    opt = EVON([a, b], **settings)
    _two_matrix_steps(opt, a, b, [True] * 3)
    if reset == "del":
        del opt.state[b]
    elif reset == "assign":
        opt.state[b] = {}
    else:
        opt.state[b].clear()
    fresh_b = nn.Parameter(b.detach().clone())
    fresh = EVON([fresh_b], **settings)
    for _ in range(4):
        with opt.sampled_params(train=True):
            (torch.linspace(-1.0, 1.0, 9).reshape(3, 3) @ b).tanh().square().sum().backward()
        opt.step()
        opt.zero_grad()
        with fresh.sampled_params(train=True):
            (torch.linspace(-1.0, 1.0, 9).reshape(3, 3) @ fresh_b).tanh().square().sum().backward()
        fresh.step()
        fresh.zero_grad()
    assert torch.equal(b, fresh_b)
    saved, fresh_saved = opt.state_dict()["state"][1], fresh.state_dict()["state"][0]
    assert sorted(saved) == sorted(fresh_saved)
    assert all(torch.equal(saved[k], fresh_saved[k]) for k in saved)


def _moved_run(source: str, step_curvature: str, reset: bool) -> dict[str, torch.Tensor]:
    """Three steps with ``model[4].weight`` in the ``source`` algorithm's group, then three with it
    moved in place to the other group (after ``del optimizer.state[p]``, torch's reset, if ``reset``)."""
    data = make_data()
    model = make_model()
    moved = model[4].weight
    weights = [p for name, p in model.named_parameters() if name.endswith("weight") and p is not moved]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    evon = {"params": weights + [moved] * (source == "evon")}
    adamw = {"params": biases + [moved] * (source == "adamw"), "algorithm": "adamw"}
    settings = dict(lr=0.05, ess=64.0, hess_init=0.5, weight_decay=1e-3, precondition_frequency=3)
    opt = EVON([evon, adamw], **settings, mc_samples=2, adamw_lr=0.01, clip="none", seed=123, step_curvature=step_curvature)
    for _ in range(3):
        train_step(model, opt, data)
    if reset:
        del opt.state[moved]
    src, dst = opt.param_groups if source == "evon" else opt.param_groups[::-1]
    del src["params"][next(i for i, p in enumerate(src["params"]) if p is moved)]
    dst["params"].append(moved)
    for _ in range(3):
        train_step(model, opt, data)
    return snapshot(model, opt)


@pytest.mark.parametrize("step_curvature", ["matrix", "entry"])
@pytest.mark.parametrize("source", ["adamw", "evon"])
def test_a_parameter_moved_to_a_group_of_the_other_algorithm_starts_that_ones_state_fresh(
    source: str, step_curvature: str
) -> None:
    """A parameter moved in place from an AdamW group to an EVON group (or back) trains exactly as
    one whose state was reset (``del optimizer.state[p]``) before the move: the other algorithm's
    state means nothing here. Before, AdamW's ``exp_avg`` became EVON's momentum (and its
    ``exp_avg_sq`` stayed in the state dict), and EVON's state in an AdamW group raised KeyError
    'exp_avg_sq' (or, under step_curvature="entry", stepped with EVON's rotated momentum)."""
    assert_identical(_moved_run(source, step_curvature, False), _moved_run(source, step_curvature, True))


@pytest.mark.parametrize("edit", ["append", "reset", "move"])
def test_a_checkpoint_saved_right_after_a_params_edit_resumes_as_the_run_goes_on(edit: str) -> None:
    """A state dict saved between an edit of a group's parameters and the next step (a parameter
    appended to an EVON group, one whose state was reset with ``del optimizer.state[p]``, one moved in
    from an AdamW group) holds no EVON state for it, which the live optimizer stacks as a member
    joining late. Before, loading it was refused ("state[1] has no 'L' but state[0] has one ... saved
    where they were stacked apart"); it now resumes exactly as the run that saved it goes on."""
    data = make_data()
    settings = dict(lr=0.05, ess=64.0, hess_init=0.5, weight_decay=1e-3, precondition_frequency=3, seed=123)

    def build(model: nn.Module, before_edit: bool) -> EVON:
        a, b = model[2].weight, model[4].weight  # 5x5 both: one bucket
        biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
        evon = [a] if before_edit and edit != "reset" else [a, b]
        adamw = biases + ([b] if before_edit and edit == "move" else [])
        return EVON([{"params": evon}, {"params": adamw, "algorithm": "adamw"}], **settings)

    model = make_model()
    opt = build(model, True)
    for _ in range(2):
        train_step(model, opt, data)
    b = model[4].weight
    b.grad = None  # outside the optimizer, its gradients were never zeroed
    if edit == "move":
        del opt.param_groups[1]["params"][-1]
    if edit == "reset":
        del opt.state[b]
    else:
        opt.param_groups[0]["params"].append(b)
    saved = roundtrip(opt.state_dict())
    twin = make_model()
    twin.load_state_dict(model.state_dict())
    resumed = build(twin, False)
    resumed.load_state_dict(saved)
    for _ in range(3):
        train_step(model, opt, data)
        train_step(twin, resumed, data)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


@pytest.mark.parametrize("step_curvature", ["matrix", "entry"])
@pytest.mark.parametrize("source", ["adamw", "evon"])
def test_a_checkpoint_saved_right_after_a_move_between_algorithms_resumes(source: str, step_curvature: str) -> None:
    """A 3-D kernel moved between an EVON and an AdamW group, the state saved before the next step:
    its entry still holds the other algorithm's state (which the next step drops), whose shapes
    are not the new algorithm's (EVON's m×n, AdamW's the kernel's). Before, the load refused it
    as "the state dict of another model, or of this one grouped otherwise"; it now resumes exactly."""

    def run(kernel: nn.Parameter, w: nn.Parameter, opt: EVON, steps: int) -> None:
        for _ in range(steps):
            with opt.sampled_params(train=True):
                ((w @ kernel.reshape(4, 3)).tanh().square().sum() + kernel.pow(3).sum()).backward()
            opt.step()
            opt.zero_grad()

    def build(kernel: nn.Parameter, w: nn.Parameter, in_evon: bool) -> EVON:
        groups = [{"params": [w] + [kernel] * in_evon}, {"params": [kernel] * (not in_evon), "algorithm": "adamw"}]
        return EVON(groups, **plain_evon(ess=64.0, lr=0.1, step_curvature=step_curvature))

    torch.manual_seed(0)
    kernel, w = nn.Parameter(torch.randn(3, 2, 2)), nn.Parameter(torch.randn(3, 4))  # both 3x4 to EVON
    opt = build(kernel, w, source == "evon")
    run(kernel, w, opt, 2)
    src, dst = opt.param_groups if source == "evon" else opt.param_groups[::-1]
    del src["params"][-1]
    dst["params"].append(kernel)
    saved = roundtrip(opt.state_dict())
    kernel2, w2 = nn.Parameter(kernel.detach().clone()), nn.Parameter(w.detach().clone())
    resumed = build(kernel2, w2, source != "evon")
    resumed.load_state_dict(saved)
    run(kernel, w, opt, 3)
    run(kernel2, w2, resumed, 3)
    assert torch.equal(kernel, kernel2) and torch.equal(w, w2)


@pytest.mark.parametrize("members", [[1, 2], [0, 2], [2], None])
def test_a_refresh_of_some_members_is_their_rows_of_the_whole_buckets_refresh(members: list[int] | None) -> None:
    """Consecutive members are refreshed through a slice of the stacked state (views, no gather),
    others through their index: either way the refreshed rows are bit for bit those of a whole refresh
    of a bucket of just those members, within float32 rounding of the whole bucket's refresh (a
    batched LAPACK or BLAS call may round a row differently with the batch's size on some CPUs), and
    the other members' state is left as it was."""
    from hf_evon.optim.buckets import Bucket
    from hf_evon.optim.linalg import eigenbasis
    from hf_evon.optim.update import refresh_buckets

    gen = torch.Generator().manual_seed(4)
    g = torch.randn(3, 5, 7, generator=gen)
    state = {
        "L": g @ g.mT,
        "R": g.mT @ g,
        "Q_L": eigenbasis(g @ g.mT + 0.1),
        "Q_R": eigenbasis(g.mT @ g + 0.1),
        "exp_avg": torch.randn(3, 5, 7, generator=gen),
        "hess": torch.ones(3, 5, 7),
    }

    def bucket(rows: list[int] = [0, 1, 2]) -> Bucket:  # noqa: B006 - read only
        params = [torch.zeros(5, 7) for _ in rows]
        return Bucket({}, params, 5, 7, True, True, torch.float32, state={k: v[rows].clone() for k, v in state.items()})

    rows = [0, 1, 2] if members is None else members
    whole, some, alone = bucket(), bucket(), bucket(rows)
    refresh_buckets([(whole, None)])
    refresh_buckets([(some, members)])
    refresh_buckets([(alone, None)])
    for k in ("Q_L", "Q_R", "exp_avg", "L", "R"):
        for i in range(3):
            expected = alone.state[k][rows.index(i)] if i in rows else bucket().state[k][i]
            assert torch.equal(some.state[k][i], expected), (k, i)
            torch.testing.assert_close(some.state[k][i], whole.state[k][i] if i in rows else state[k][i])
    assert not torch.equal(whole.state["Q_L"], state["Q_L"])
