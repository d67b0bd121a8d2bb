"""EVON as a ``torch.optim.Optimizer`` among torch's tools: copies and pickles, torch's state-dict
hooks, autocast, GradScaler, half-precision gradients, sparse and complex parameters, and group
settings edited between steps. Each behaviour is compared with ``torch.optim.AdamW`` in the same
situation or with what EVON's own documentation promises."""

from __future__ import annotations

import contextlib
import copy
import pickle
import re
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from hf_evon import EVON

X, Y = torch.randn(32, 6, generator=torch.Generator().manual_seed(1)), torch.arange(32) % 3


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _optimizer(model: nn.Sequential, **kwargs: object) -> EVON:
    weights, biases = [model[0].weight, model[2].weight], [model[0].bias, model[2].bias]
    return EVON([{"params": weights}, {"params": biases, "algorithm": "adamw"}], seed=0, **kwargs)


def _step(opt: EVON, model: nn.Module) -> None:
    with opt.sampled_params(train=True):
        nn.functional.cross_entropy(model(X.to(model[0].weight.dtype)).float(), Y).backward()
    opt.step()
    opt.zero_grad()


# ----------------------------------------------------------------------------- copies
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_continues_as_the_original_does(how: str) -> None:
    """torch's Optimizer.__getstate__ keeps only defaults, state and groups: a copied EVON lacked
    its seed, block counter and flags and raised AttributeError at its first sampled_params()."""
    model = _model()
    opt = _optimizer(model, precondition_frequency=2)
    for _ in range(3):
        _step(opt, model)
    clone = {"deepcopy": copy.deepcopy, "pickle": lambda o: pickle.loads(pickle.dumps(o))}[how]
    pair = clone({"model": model, "opt": opt})
    model2, opt2 = pair["model"], pair["opt"]
    for _ in range(4):
        _step(opt, model)
        _step(opt2, model2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt2.sample_blocks == opt.sample_blocks and opt2.seed == opt.seed


def test_an_optimizer_with_pending_samples_is_not_copied() -> None:
    model = _model()
    opt = _optimizer(model)
    with opt.sampled_params(train=True):
        nn.functional.cross_entropy(model(X), Y).backward()
    with pytest.raises(RuntimeError, match="recorded sample"):
        copy.deepcopy(opt)
    opt.step()  # still usable
    assert copy.deepcopy(opt).recorded_samples == 0


# ----------------------------------------------------------------------------- AdamW groups
def test_an_adamw_group_steps_complex_parameters_as_torch_adamw_does() -> None:
    """EVON's refusal of a complex parameter sends it to an AdamW group, whose update treated it
    as one complex number (exp_avg_sq = g·g, negative real parts) instead of torch's real pairs."""
    c0 = torch.randn(3, 3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))

    def run(make) -> tuple[torch.Tensor, dict]:  # noqa: ANN001
        c = nn.Parameter(c0.clone())
        opt = make([c])
        for _ in range(5):
            ((c - 1j).abs() ** 2).sum().backward()
            opt.step()
            opt.zero_grad()
        return c.detach(), opt.state[c]

    ref, ref_state = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0))
    got, got_state = run(lambda ps: EVON([{"params": ps, "algorithm": "adamw", "lr": 1e-2, "weight_decay": 0.0}]))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_state["exp_avg_sq"], ref_state["exp_avg_sq"], rtol=1e-6, atol=1e-9)


def test_a_complex_adamw_weights_state_round_trips_and_trains_on_as_one_never_saved() -> None:
    """load_state_dict compared the complex second moment with 0 ("ge_cpu" not implemented for
    'ComplexFloat'): an optimizer holding a complex weight could not load its own state dict."""
    c0 = torch.randn(3, 3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    runs = []
    for reload in (False, True):
        c = nn.Parameter(c0.clone())
        opt = EVON([{"params": [c], "algorithm": "adamw", "lr": 1e-2, "weight_decay": 0.0}])
        for step in range(6):
            if reload and step == 3:
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            ((c - 1j).abs() ** 2).sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append(c.detach().clone())
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], c0)


def _adamw_run(make, eps_schedule: list[float] | None = None, steps: int = 5) -> list[torch.Tensor]:  # noqa: ANN001
    """The weights after ``steps`` full-batch steps of the optimizer ``make`` builds on a fresh model,
    its first group's ``eps`` set before each step from ``eps_schedule`` where given."""
    model = _model()
    opt = make(list(model.parameters()))
    for eps in eps_schedule or [None] * steps:
        if eps is not None:
            opt.param_groups[0]["eps"] = eps
        nn.functional.cross_entropy(model(X), Y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def test_an_adamw_groups_eps_is_adamws_and_unsupported_adamw_options_are_refused() -> None:
    """torch AdamW's own group keys are an AdamW group's: its ``eps`` is AdamW's ε, and ``amsgrad``
    and ``maximize``, which EVON's AdamW does not implement, are refused rather than ignored."""
    group = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1, "eps": 1e-3}
    ref = _adamw_run(lambda ps: torch.optim.AdamW([{"params": ps, **group}], fused=True))
    got = _adamw_run(lambda ps: EVON([{"params": ps, "algorithm": "adamw", **group}]))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for option in ("amsgrad", "maximize"):
        with pytest.raises(ValueError, match=option):
            EVON([{"params": list(_model().parameters()), "algorithm": "adamw", option: True}])


def test_an_adamw_groups_eps_is_the_one_it_shows_and_an_edit_between_steps_is_used() -> None:
    """An AdamW group showed EVON's Hessian ε (``eps``: 1e-12) and stepped with AdamW's, kept under
    ``adamw_eps``: a scheduler or callback written for torch.optim.AdamW that set ``group["eps"]``
    changed nothing. Its ``eps`` is AdamW's ε (the constructor's ``adamw_eps``), an edit between
    steps is used by the next step as torch AdamW uses it, and an EVON group's ``eps`` is EVON's."""
    opt = _optimizer(_model(), adamw_eps=1e-6)
    assert [g["eps"] for g in opt.param_groups] == [1e-12, 1e-6]
    assert not any("adamw_eps" in g for g in opt.param_groups)
    # a group given EVON's keyword for it keeps it under torch's; given both, it is refused
    given = {"algorithm": "adamw", "adamw_eps": 1e-4}
    assert [g["eps"] for g in EVON([{"params": list(_model().parameters()), **given}]).param_groups] == [1e-4]
    with pytest.raises(ValueError, match="'eps' or as 'adamw_eps', not both"):
        EVON([{"params": list(_model().parameters()), **given, "eps": 1e-4}])

    group = {"lr": 1e-2, "betas": (0.9, 0.99), "weight_decay": 0.1}
    schedule = [1e-8, 1e-8, 0.1, 0.1, 1e-3]
    ref = _adamw_run(lambda ps: torch.optim.AdamW([{"params": ps, **group}], fused=True), schedule)
    got = _adamw_run(lambda ps: EVON([{"params": ps, "algorithm": "adamw", **group}]), schedule)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the edits change the weights (the test can fail)
    unedited = _adamw_run(lambda ps: EVON([{"params": ps, "algorithm": "adamw", **group}]), [1e-8] * len(schedule))
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(got, unedited, strict=True))


_ABSENT = "absent: an AdamW group's ε is its 'eps', as in torch.optim.AdamW"


@pytest.mark.parametrize(
    ("key", "bad", "rule"),
    [
        *(("eps", bad, "a finite number > 0") for bad in (0.0, -1e-8, float("inf"), float("nan"))),
        ("adamw_eps", 1e-3, _ABSENT),
    ],
    ids=["0", "negative", "inf", "nan", "adamw_eps"],
)
def test_an_invalid_eps_set_on_an_adamw_group_is_refused_by_name_and_the_step_goes_on(
    key: str, bad: float, rule: str
) -> None:
    """An AdamW group's ``eps`` set between the samples and the step to a value torch AdamW would
    divide by (0, negative, inf, NaN), or its ε set as ``adamw_eps`` (which the step would ignore),
    is refused by name before anything changes; set right, the same step goes ahead exactly as one
    never refused."""

    def sample(opt: EVON, model: nn.Module) -> None:
        with opt.sampled_params(train=True):
            nn.functional.cross_entropy(model(X), Y).backward()

    model, twin = _model(), _model()
    opt, twin_opt = _optimizer(model), _optimizer(twin)
    for _ in range(2):
        _step(opt, model)
        _step(twin_opt, twin)
    sample(opt, model)
    saved = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[1][key] = bad
    with pytest.raises(ValueError) as refused:
        opt.step()
    assert str(refused.value) == f"param_groups[1]: Invalid {key}: {bad!r} (must be {rule})"
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))
    assert opt.recorded_samples == 1
    del opt.param_groups[1][key]
    opt.param_groups[1]["eps"] = 1e-8
    opt.step()
    opt.zero_grad()
    _step(twin_opt, twin)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


@pytest.mark.parametrize("key", ["maximize", "amsgrad", "differentiable", "capturable"])
@pytest.mark.parametrize("group", [0, 1])
def test_torch_adamw_options_evon_lacks_are_refused_by_name_wherever_a_group_gets_them(group: int, key: str) -> None:
    """torch.optim.AdamW's ``maximize``/``amsgrad`` were refused only in a group given to the
    constructor or ``add_param_group`` as AdamW: on an EVON group or set between steps (as torch
    honours them) the step silently descended without AMSGrad. ``differentiable=True`` (the step in
    the autograd graph) and ``capturable=True`` (a step free of host syncs, for CUDA graphs) were
    accepted on either algorithm's group and did nothing: the step runs under no_grad and reads
    values back to the host. Each is refused by name before anything changes: by the constructor,
    add_param_group, load_state_dict and the step after an edit; removed, the same step goes ahead."""
    rule = "False or absent: EVON does not implement it (torch.optim's option)"
    message = f"Invalid {key}: True (must be {rule})"
    model, twin = _model(), _model()
    opt, twin_opt = _optimizer(model), _optimizer(twin)
    weights, biases = [model[0].weight, model[2].weight], [model[0].bias, model[2].bias]
    given = [{"params": weights}, {"params": biases, "algorithm": "adamw"}]
    given[group][key] = True
    with pytest.raises(ValueError, match=re.escape(message)):
        EVON(given)
    algorithm = {0: "evon", 1: "adamw"}[group]
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2, 2))], "algorithm": algorithm, key: True})
    assert len(opt.param_groups) == 2
    _step(opt, model)
    _step(twin_opt, twin)
    state = opt.state_dict()
    state["param_groups"][group][key] = True
    with pytest.raises(ValueError) as refused:
        opt.load_state_dict(state)
    assert str(refused.value) == f"EVON.load_state_dict: param_groups[{group}]: {message}"
    with opt.sampled_params(train=True):
        nn.functional.cross_entropy(model(X), Y).backward()
    saved = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[group][key] = True
    with pytest.raises(ValueError) as refused:
        opt.step()
    assert str(refused.value) == f"param_groups[{group}]: {message}"
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))
    assert opt.recorded_samples == 1
    opt.param_groups[group][key] = False  # torch's default: what the step does
    opt.step()
    opt.zero_grad()
    _step(twin_opt, twin)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def _refused_then_set_back(
    model: nn.Module, opt, twin: nn.Module, twin_opt, key: str, built: object, edited: object, *, more: int,
    inert: tuple[int, ...] = (),
) -> None:  # fmt: skip
    """Sets group 0's ``key`` from ``built`` to ``edited`` (and the ``inert`` groups' to ``edited``,
    accepted) between a backward and the step: the step refuses it, naming the group and the key,
    before the weights, group 0's other settings or the recorded samples change. Set back, the step
    goes ahead as one never refused: ``more`` steps on, the model and its groups' ess are the twin's
    (stepped as often as the model so far), stepped ``more + 1`` times with no edit."""
    with opt.sampled_params(train=True):
        nn.functional.cross_entropy(model(X), Y).backward()
    saved = [p.detach().clone() for p in model.parameters()]
    settings = {k: v for k, v in opt.param_groups[0].items() if k != key}
    opt.param_groups[0][key] = edited
    for i in inert:
        opt.param_groups[i][key] = edited
    with pytest.raises(ValueError) as refused:
        opt.step()
    assert str(refused.value).startswith(
        f"param_groups[0]: {key!r} changed from {built!r} to {edited!r} after the group was built"
    )
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))
    assert {k: v for k, v in opt.param_groups[0].items() if k != key} == settings
    assert opt.recorded_samples == 1
    opt.param_groups[0][key] = built
    opt.step()
    opt.zero_grad()
    for _ in range(more):
        _step(opt, model)
    for _ in range(more + 1):
        _step(twin_opt, twin)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    assert [g["ess"] for g in opt.param_groups] == [g["ess"] for g in twin_opt.param_groups]


@pytest.mark.parametrize(("built", "switched"), [("fisher", "price"), ("price", "fisher")])
@pytest.mark.parametrize("stepped", [0, 2])
def test_a_changed_hess_estimator_is_refused_by_name_before_anything_changes(
    built: str, switched: str, stepped: int
) -> None:
    """Whether ess and the prior are fitted to the curvature (``fit_to_curvature``) is decided when
    a group is built, from its estimate of H: a group switched from "fisher" to "price" kept refitting
    ζ and δ from the Price H, one switched the other way never fitted them, and H's history is the
    other estimate's. The step refuses the edit, naming the group and the key, before anything
    changes; set back, the step goes ahead as one never refused. An AdamW group carries the key inert."""
    model, twin = _model(), _model()
    opt = _optimizer(model, hess_estimator=built, precondition_frequency=2)
    twin_opt = _optimizer(twin, hess_estimator=built, precondition_frequency=2)
    assert bool(opt.param_groups[0]["fit_to_curvature"]) == (built == "fisher")
    for _ in range(stepped):
        _step(opt, model)
        _step(twin_opt, twin)
    _refused_then_set_back(model, opt, twin, twin_opt, "hess_estimator", built, switched, more=2, inert=(1,))


def test_a_group_added_or_loaded_with_another_hess_estimator_is_built_with_it() -> None:
    """The estimate a group is built with is its own: a group added with another one, and the
    groups a state dict brings (torch's load replaces their settings), are not edits to refuse."""
    model, twin = _model(), _model()
    opt = _optimizer(model, hess_estimator="fisher")
    source = _optimizer(twin, hess_estimator="price")
    for _ in range(2):
        _step(opt, model)
        _step(source, twin)
    opt.load_state_dict(copy.deepcopy(source.state_dict()))  # as a checkpoint holds it
    with torch.no_grad():
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            a.copy_(b)
    assert opt.param_groups[0]["hess_estimator"] == "price" and opt.param_groups[0]["fit_to_curvature"] == ()
    for _ in range(2):
        _step(opt, model)
        _step(source, twin)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    extra = nn.Parameter(torch.ones(3, 2))
    opt.add_param_group({"params": [extra], "hess_estimator": "fisher", "ess": 1e4})
    for _ in range(2):  # its first update sets up its eigenbases
        with opt.sampled_params(train=True):
            (nn.functional.cross_entropy(model(X), Y) + extra.square().sum()).backward()
        opt.step()
        opt.zero_grad()
    assert opt.param_groups[2]["hess_estimator"] == "fisher" and not torch.equal(extra, torch.ones(3, 2))


# what each edit below would change in what is fitted to the curvature: (built with, edited key, set to)
_FIT_EDITS = [
    ({"curvature_refit": 0}, "curvature_refit", 3),  # () -> ("ess", "weight_decay"): ess stayed fixed
    ({"curvature_refit": 3}, "curvature_refit", 0),  # ("ess", "weight_decay") -> ()
    ({"ess": 1e4, "curvature_refit": 3}, "ess", "auto"),  # () -> ("ess", "weight_decay"): resolved once
    ({"weight_decay": 1e-3, "curvature_refit": 3}, "weight_decay", None),  # ("ess",) -> both
]


@pytest.mark.parametrize(("built", "key", "edited"), _FIT_EDITS)
@pytest.mark.parametrize("stepped", [0, 3])
def test_an_edit_that_would_change_what_is_fitted_is_refused_by_name(
    built: dict, key: str, edited: object, stepped: int
) -> None:
    """Like hess_estimator, curvature_refit (0 or not), ess ("auto" or a number) and weight_decay
    (None or a number) decide when a group is built what is fitted to its curvature: set between
    steps so as to change that, they were silently ignored (ess stayed as resolved at build under a
    curvature_refit set from 0 to N; an ess="auto" set on a group built with a number was resolved
    once and never refitted). The step refuses the edit, naming the group and the key, before
    anything changes; set back, the step goes ahead as one never refused."""
    model, twin = _model(), _model()
    opt = _optimizer(model, precondition_frequency=2, **built)
    twin_opt = _optimizer(twin, precondition_frequency=2, **built)
    for _ in range(stepped):
        _step(opt, model)
        _step(twin_opt, twin)
    _refused_then_set_back(model, opt, twin, twin_opt, key, opt.param_groups[0][key], edited, more=3)


@pytest.mark.parametrize(
    ("built", "key", "edited"),
    [
        ({"curvature_refit": 3}, "curvature_refit", 5),  # still fitted, on the new period
        ({"ess": 1e4, "curvature_refit": 0}, "curvature_refit", 3),  # a given ζ is never fitted
        ({"hess_estimator": "price"}, "ess", "auto"),  # nor is one under the Price estimate
        ({"ess": 1e4, "weight_decay": 1e-3}, "weight_decay", None),  # a given ζ keeps the default δ
    ],
)
def test_an_edit_that_leaves_what_is_fitted_takes_effect_as_if_built_with_it(
    built: dict, key: str, edited: object
) -> None:
    """An edit of those keys that does not change what is fitted to the curvature is not refused:
    set before the first step, the run is the one of a group built with it."""
    model, twin = _model(), _model()
    opt = _optimizer(model, precondition_frequency=2, **built)
    twin_opt = _optimizer(twin, precondition_frequency=2, **{**built, key: edited})
    opt.param_groups[0][key] = edited
    for _ in range(6):
        _step(opt, model)
        _step(twin_opt, twin)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    assert [g["ess"] for g in opt.param_groups] == [g["ess"] for g in twin_opt.param_groups]


def test_a_group_added_or_loaded_with_other_fitted_keys_is_built_with_them() -> None:
    """What a group added with ess="auto", weight_decay=None or curvature_refit, or a group a state
    dict brings, fits to its curvature is its own, not an edit to refuse; a loaded group fitted to
    its curvature is held to it as one built so (its ess and weight_decay are numbers by then)."""
    model, twin = _model(), _model()
    opt = _optimizer(model, ess=1e4, weight_decay=1e-3, curvature_refit=0)
    source = _optimizer(twin, curvature_refit=3)
    for _ in range(2):
        _step(opt, model)
        _step(source, twin)
    opt.load_state_dict(copy.deepcopy(source.state_dict()))  # as a checkpoint holds it
    with torch.no_grad():
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            a.copy_(b)
    assert opt.param_groups[0]["fit_to_curvature"] == ("ess", "weight_decay")
    for _ in range(4):
        _step(opt, model)
        _step(source, twin)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
    assert opt.param_groups[0]["ess"] == source.param_groups[0]["ess"]
    opt.param_groups[0]["curvature_refit"] = 0
    with pytest.raises(ValueError, match=r"^param_groups\[0\]: 'curvature_refit' changed from 3 to 0 after"):
        _step(opt, model)
    opt.param_groups[0]["curvature_refit"] = 3
    extra = nn.Parameter(torch.ones(3, 2))
    opt.add_param_group({"params": [extra], "ess": "auto", "weight_decay": None, "curvature_refit": 2})
    assert opt.param_groups[2]["fit_to_curvature"] == ("ess", "weight_decay")
    for _ in range(3):  # its first update sets up its eigenbases, its second fits ζ and δ
        with opt.sampled_params(train=True):
            (nn.functional.cross_entropy(model(X), Y) + extra.square().sum()).backward()
        opt.step()
        opt.zero_grad()
    assert isinstance(opt.param_groups[2]["ess"], float) and not torch.equal(extra, torch.ones(3, 2))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_holds_its_groups_to_what_the_original_was_built_with(how: str) -> None:
    """A copy's groups hold resolved numbers: ess="auto" built under curvature_refit=0 reads as a
    given ζ there, yet is the original's "auto", and the copy refuses the same edits it does."""
    model = _model()
    opt = _optimizer(model, curvature_refit=0)
    _step(opt, model)
    clone = {"deepcopy": copy.deepcopy, "pickle": lambda o: pickle.loads(pickle.dumps(o))}[how]
    pair = clone({"model": model, "opt": opt})
    for optimizer, net in ((opt, model), (pair["opt"], pair["model"])):
        optimizer.param_groups[0]["curvature_refit"] = 3
        with pytest.raises(ValueError, match=r"^param_groups\[0\]: 'curvature_refit' changed from 0 to 3 after"):
            _step(optimizer, net)


# ----------------------------------------------------------------------------- edits between steps
@pytest.mark.parametrize(
    ("group", "edit"),
    [
        (1, {"algorithm": "evon", "weight_decay": 1e-3}),
        (0, {"algorithm": "adamw"}),
        (0, {"identity_basis": True}),
        (0, {"max_precond_dim": 1}),
        (0, {"max_precond_ratio": 1.0}),
        (0, {"stagger_refresh": False}),
    ],
)
def test_a_setting_that_shapes_the_state_is_refused_once_stepped(group: int, edit: dict) -> None:
    """The algorithm and the eigenbases' layout are fixed when the state is built: an AdamW group
    switched to EVON was never trained again, EVON to AdamW raised a bare KeyError halfway through
    the step, and the basis settings took effect only after a state-dict round trip (a resumed run
    diverged). The step refuses them, naming the key, and leaves everything as it was."""
    model = _model()
    opt = _optimizer(model, precondition_frequency=2)
    for _ in range(2):
        _step(opt, model)
    saved = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[group].update(edit)
    with pytest.raises(ValueError, match=rf"param_groups\[{group}\].*{next(iter(edit))}"):
        _step(opt, model)
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))
    assert opt.recorded_samples == 0


@pytest.mark.parametrize("key", ["ess", "weight_decay"])
def test_auto_values_set_between_steps_are_resolved_as_the_constructor_resolves_them(key: str) -> None:
    """``ess="auto"`` and ``weight_decay=None`` are valid constructor values; set between steps
    they raised a bare TypeError inside the next block."""
    from hf_evon.optim.defaults import DEFAULT_INIT_STD_RATIO, default_weight_decay

    model = _model()
    # nothing fitted, as with "auto" built in (curvature_refit=0): the edit takes effect as built with it
    opt = EVON([model[0].weight, model[2].weight], seed=0, ess=1e4, weight_decay=1e-3, curvature_refit=0)
    _step(opt, model)
    opt.param_groups[0][key] = {"ess": "auto", "weight_decay": None}[key]
    group, (h0, ratio) = opt.param_groups[0], (opt.param_groups[0]["hess_init"], DEFAULT_INIT_STD_RATIO)
    weights = [model[0].weight.detach().double(), model[2].weight.detach().double()]
    mean_square = float(sum(w.square().sum() for w in weights) / sum(w.numel() for w in weights))
    _step(opt, model)
    if key == "weight_decay":
        assert group["weight_decay"] == default_weight_decay(h0, ratio)
    else:  # the ζ whose std is init_std_ratio of the weights' RMS: 1 / (ρ² rms² (h0 + δ))
        assert group["ess"] == pytest.approx(1 / (ratio**2 * mean_square * (h0 + 1e-3)), rel=1e-6)


def test_an_init_std_ratio_the_curvature_fit_cannot_use_is_refused_before_anything_changes() -> None:
    """ζ fitted to the curvature (``ess="auto"``, the Fisher estimate) aims at a noise rising from
    ``init_std_ratio`` to ``DEFAULT_PRIOR_STD_RATIO``. With ``weight_decay`` given, a ratio at or above
    it passed the constructor (as it did set between steps), and the step of the first fit raised
    default_weight_decay's ValueError after the weights had moved. It is refused by name: by the
    constructor, and by the step before anything changes; where ζ is not fitted it is accepted."""
    from hf_evon.optim.defaults import DEFAULT_PRIOR_STD_RATIO as ratio

    rule = f"a number below {ratio}, the fitted noise's final ratio, where ess is fitted to the curvature"
    with pytest.raises(ValueError, match=re.escape(f"Invalid init_std_ratio: {ratio} (must be {rule}")):
        EVON([nn.Parameter(torch.ones(2, 2))], weight_decay=1e-3, init_std_ratio=ratio)
    for unfitted in ({"ess": 1e4}, {"hess_estimator": "price"}, {"curvature_refit": 0}):
        EVON([nn.Parameter(torch.ones(2, 2))], weight_decay=1e-3, init_std_ratio=ratio, **unfitted)

    model, twin = _model(), _model()
    opt, twin_opt = _optimizer(model, weight_decay=1e-3), _optimizer(twin, weight_decay=1e-3)
    for _ in range(2):
        _step(opt, model)
        _step(twin_opt, twin)
    with opt.sampled_params(train=True):
        nn.functional.cross_entropy(model(X), Y).backward()
    saved = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["init_std_ratio"] = ratio
    with pytest.raises(ValueError) as refused:
        opt.step()
    assert str(refused.value).startswith(f"param_groups[0]: Invalid init_std_ratio: {ratio} (must be {rule}")
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))
    opt.param_groups[0]["init_std_ratio"] = twin_opt.param_groups[0]["init_std_ratio"]
    opt.step()
    opt.zero_grad()
    _step(twin_opt, twin)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


# ----------------------------------------------------------------------------- state dicts
def test_torchs_load_state_dict_hooks_see_the_state_as_loaded() -> None:
    """A post-hook ran before EVON had restored its counters and the state's dtypes (what it set
    was then overwritten); a pre-hook ran after EVON had already refused the state dict."""
    model = _model(dtype=torch.bfloat16)
    src = EVON(model.parameters(), seed=123)
    for _ in range(3):
        _step(src, model)
    w = model[0].weight
    dst = EVON(model.parameters(), seed=7)
    seen = {}

    def post_hook(opt: EVON) -> None:
        seen["seed"], seen["hess"] = opt.seed, opt.state[w]["hess"].dtype
        opt.state[w]["exp_avg_unrotated"].zero_()

    dst.register_load_state_dict_post_hook(post_hook)
    dst.load_state_dict(src.state_dict())
    assert seen == {"seed": 123, "hess": torch.float32}
    assert not dst.state[w]["exp_avg_unrotated"].any()

    legacy = src.state_dict()
    legacy["param_groups"] = [{k: v for k, v in g.items() if k != "algorithm"} for g in legacy["param_groups"]]
    repaired = EVON(model.parameters(), seed=7)

    def pre_hook(opt: EVON, state_dict: dict) -> dict:
        for g in state_dict["param_groups"]:
            g.setdefault("algorithm", "evon")
        return state_dict

    repaired.register_load_state_dict_pre_hook(pre_hook)
    repaired.load_state_dict(legacy)
    assert repaired.seed == 123


def test_torchs_state_dict_post_hooks_see_the_state_dict_as_saved() -> None:
    """A post-hook ran before EVON added its noise seed and counters (``"evon"``): a hook that kept
    the state dict it was handed (a checkpointing callback) kept one without them, and a resume
    from it drew other noise. The hook sees what ``state_dict()`` returns; its copy resumes the run."""
    model = _model()
    opt = _optimizer(model)
    for _ in range(2):
        _step(opt, model)
    kept = []
    opt.register_state_dict_post_hook(lambda _, state_dict: kept.append(copy.deepcopy(state_dict)))
    returned = opt.state_dict()
    counters = {"sample_blocks": 2, "stepped_blocks": 2, "eval_blocks": 0, "skipped_steps": 0, "updates": 2}
    assert kept[0]["evon"] == returned["evon"] == {"seed": 0, **counters}

    twin = copy.deepcopy(model)
    weights, biases = [twin[0].weight, twin[2].weight], [twin[0].bias, twin[2].bias]
    resumed = EVON([{"params": weights}, {"params": biases, "algorithm": "adamw"}], seed=7)
    resumed.load_state_dict(kept[0])
    for _ in range(2):
        _step(opt, model)
        _step(resumed, twin)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_a_state_dict_of_other_groups_is_refused_with_torchs_reason() -> None:
    model = _model()
    src = _optimizer(model)
    _step(src, model)
    state = src.state_dict()
    one_group = EVON(list(model.parameters()), seed=0)
    with pytest.raises(ValueError, match="different number of parameter groups"):
        one_group.load_state_dict(state)
    # torch's own reasons, word for word (EVON raises them before its shape checks)
    adamw_state = {"state": {}, "param_groups": [{**g, "params": g["params"]} for g in state["param_groups"]]}
    with pytest.raises(ValueError, match="^loaded state dict has a different number of parameter groups$"):
        torch.optim.AdamW(list(model.parameters())).load_state_dict(adamw_state)
    with pytest.raises(ValueError, match="^loaded state dict contains a parameter group that doesn't match the size"):
        torch.optim.AdamW(
            [{"params": [model[0].weight, model[2].weight, model[0].bias]}, {"params": [model[2].bias]}]
        ).load_state_dict(adamw_state)
    other_sizes = EVON(
        [{"params": [model[0].weight, model[2].weight, model[0].bias]}, {"params": [model[2].bias], "algorithm": "adamw"}]
    )
    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
        other_sizes.load_state_dict(state)



def test_a_state_saved_before_add_param_group_is_refused_and_the_optimizer_steps_on_unchanged() -> None:
    """``load_state_dict`` of a state saved before ``add_param_group`` is refused with torch's reason, and the
    optimizer, whose new group has stepped, steps on bit for bit as a twin that never tried the load."""
    runs = []
    for load in (True, False):
        model, extra = _model(), nn.Parameter(torch.linspace(-1.0, 1.0, 9).reshape(3, 3))
        opt = _optimizer(model)
        _step(opt, model)
        saved = opt.state_dict()
        opt.add_param_group({"params": [extra]})
        for step in range(3):
            opt.zero_grad()
            with opt.sampled_params(train=True):
                (nn.functional.cross_entropy(model(X), Y) + (X[:, :3] @ extra).square().mean()).backward()
            opt.step()
            if load and step == 1:
                with pytest.raises(ValueError, match="different number of parameter groups"):
                    opt.load_state_dict(saved)
        runs.append([p.detach() for p in (*model.parameters(), extra)])
    assert all(torch.isfinite(p).all() for p in runs[0])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_a_state_dict_of_groups_listed_in_another_order_is_refused_naming_the_group() -> None:
    """A state saved by an optimizer listing its groups in another order (AdamW's first) was refused
    with torch's bare "doesn't match the size of optimizer's group", naming neither the group nor
    the sizes; the refusal keeps torch's words and adds both, and the optimizer is left as it was."""
    model = _model()
    src = _optimizer(model)
    _step(src, model)
    state = src.state_dict()
    twin = _model()
    reordered = EVON(
        [{"params": [twin[0].bias, twin[2].bias, twin[0].weight], "algorithm": "adamw"}, {"params": [twin[2].weight]}],
        seed=0,
    )
    before = copy.deepcopy(reordered.state_dict())
    with pytest.raises(ValueError) as refused:
        reordered.load_state_dict(state)
    assert str(refused.value) == (
        "loaded state dict contains a parameter group that doesn't match the size of optimizer's group: "
        "param_groups[0] holds 3 parameters here but 2 in the state dict (groups listed in another order?)"
    )
    after = reordered.state_dict()
    assert after["param_groups"] == before["param_groups"] and after["state"] == before["state"] == {}


def test_a_state_dict_whose_parameters_are_named_in_another_order_is_refused_naming_both() -> None:
    """Two same-shape layers registered in the other order: torch pairs the state by position, so
    each took the other's eigenbases and H with no error, and the saved names then labelled the
    wrong tensors. Refused where both sides name the parameters, the optimizer left as it was."""

    class Net(nn.Module):
        def __init__(self, swapped: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            a, b = nn.Linear(6, 6), nn.Linear(6, 6)
            if swapped:
                self.second, self.first = b, a
            else:
                self.first, self.second = a, b

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(torch.tanh(self.first(x)))

    source = Net(False)
    src = EVON(source.named_parameters(), lr=0.01, ess=100.0, seed=0)
    with src.sampled_params(train=True):
        nn.functional.cross_entropy(source(X), Y).backward()
    src.step()
    target = Net(True)
    target.load_state_dict(source.state_dict())
    opt = EVON(target.named_parameters(), lr=0.01, ess=100.0, seed=0)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError) as refused:
        opt.load_state_dict(src.state_dict())
    assert str(refused.value) == (
        "EVON.load_state_dict: param_groups[0]'s state for 'first.weight' would be loaded into "
        "'second.weight' (position 0): the state dict lists this group's parameters in another order. "
        "Build the optimizer from the parameters in the order they were saved in"
    )
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"] and after["state"] == before["state"] == {}
    # names that differ otherwise (a wrapper's prefix) still pair by position, as torch's do
    wrapped = nn.Sequential(source)
    prefixed = EVON(wrapped.named_parameters(), lr=0.01, ess=100.0, seed=0)
    prefixed.load_state_dict(src.state_dict())
    assert torch.equal(prefixed.state[source.first.weight]["hess"], src.state[source.first.weight]["hess"])


def test_a_parameter_on_the_meta_device_is_refused_by_name_before_any_state_is_made() -> None:
    """A model made under torch.device("meta") failed inside the first block with torch's "Cannot copy
    out of meta tensor" (ess="auto") or "META device type not an accelerator", naming no parameter,
    and left state entries behind."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
    for options in ({}, {"ess": 100.0}):
        opt = EVON(model.named_parameters(), lr=0.01, seed=0, **options)
        with pytest.raises(RuntimeError, match=re.escape("EVON cannot train 0.weight (shape (4, 6)): it is on the meta device")):
            with opt.sampled_params(train=True):
                pass
        assert len(opt.state) == 0
# ----------------------------------------------------------------------------- precision and kinds
def test_a_step_inside_autocast_keeps_evons_float32_state() -> None:
    """step() under torch.autocast stored the Shampoo statistics in bfloat16; every later step
    then raised a dtype error, inside autocast or not, each after changing H."""
    model, ref_model = _model(), _model()
    opt, ref = _optimizer(model), _optimizer(ref_model)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with opt.sampled_params(train=True):
                nn.functional.cross_entropy(model(X).float(), Y).backward()
            opt.step()
            opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with ref.sampled_params(train=True):
                nn.functional.cross_entropy(ref_model(X).float(), Y).backward()
        ref.step()  # the same gradients, the step outside autocast
        ref.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
    w = model[0].weight
    assert {k: v.dtype for k, v in opt.state[w].items() if k != "step"} == {
        k: v.dtype for k, v in ref.state[ref_model[0].weight].items() if k != "step"
    }
    assert opt.state[w]["L"].dtype == torch.float32


def test_gradscaler_is_refused_the_same_way_every_time() -> None:
    """The first refusal left ``found_inf = grad_scale = None`` on the optimizer, so the next
    GradScaler.step failed inside torch with a TypeError instead of EVON's message."""
    model = _model()
    opt = _optimizer(model)
    for _ in range(2):
        scaler = torch.amp.GradScaler("cpu")
        with opt.sampled_params(train=True):
            scaler.scale(nn.functional.cross_entropy(model(X), Y)).backward()
        with pytest.raises(NotImplementedError, match="GradScaler"):
            scaler.step(opt)
        assert opt.recorded_samples == 0
        opt.zero_grad()


def test_finite_half_precision_gradients_are_not_taken_for_overflow() -> None:
    """float16 gradient norms overflowed (above 65504, their squares above 256): finite gradients
    of an AdamW group were reported non-finite and every step was skipped."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4, dtype=torch.float16))
    b = nn.Parameter(torch.zeros(10, dtype=torch.float16))
    opt = EVON([{"params": [w]}, {"params": [b], "algorithm": "adamw", "lr": 1e-3}], seed=0)
    ref_b = nn.Parameter(torch.zeros(10, dtype=torch.float16))
    ref = torch.optim.AdamW([ref_b], lr=1e-3, weight_decay=0.0, fused=True)
    opt.param_groups[1]["weight_decay"] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with opt.sampled_params(train=True):  # a step where only the AdamW group has a gradient
                b.grad = torch.full((10,), 100.0, dtype=torch.float16)
            opt.step()
            opt.zero_grad()
            ref_b.grad = torch.full((10,), 100.0, dtype=torch.float16)
            ref.step()
    assert opt.skipped_steps == 0
    assert torch.equal(b, ref_b)


@pytest.mark.parametrize("algorithm", ["evon", "adamw"])
def test_a_sparse_gradient_is_refused_by_name_before_anything_changes(algorithm: str) -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    opt = EVON([{"params": [emb.weight], "algorithm": algorithm, "param_names": ["emb.weight"]}], seed=0)
    before = emb.weight.detach().clone()
    with opt.sampled_params(train=True):
        emb(torch.tensor([1, 2, 3])).pow(2).sum().backward()
    with pytest.raises(ValueError, match=r"emb.weight \(shape \(10, 4\)\) has a sparse gradient"):
        opt.step()
    assert torch.equal(emb.weight, before)


def test_a_block_entered_inside_autocast_draws_the_float32_sample() -> None:
    """The block's perturbation ran its rotations in bfloat16 under the caller's autocast (a 3.7e-3
    relative error in the sample); the model's forward inside the block keeps the autocast."""
    samples = []
    for autocast in (True, False):
        model = _model()
        opt = _optimizer(model, precondition_frequency=2)
        for _ in range(3):
            _step(opt, model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with opt.sampled_params(train=False):
                samples.append(model[0].weight.detach().clone())
                assert model(X).dtype == (torch.bfloat16 if autocast else torch.float32)
    assert torch.equal(samples[0], samples[1])


def _bf16_forward(model: nn.Module, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """``model`` at ``weights`` in an autocast region of its own (nothing cast before it)."""
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        return torch.func.functional_call(model, weights, (X,))


@pytest.mark.parametrize("train", [True, False])
def test_forwards_in_one_autocast_region_see_each_sample_and_the_mean_after_it(train: bool) -> None:
    """autocast keeps its bfloat16 cast of each parameter for the rest of its outermost region and
    does not see in-place writes: in a loop inside one ``torch.autocast`` every forward ran at the
    weights cast first (the mean here; the first sample where no forward came before it), so the
    samples changed no output and trained on no sample. Each forward is the one a fresh region
    gives at the weights the model holds."""
    model = _model()
    opt = _optimizer(model, ess=50.0)
    for _ in range(2):
        _step(opt, model)
    mean = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [model(X)]
        samples = []
        for _ in range(2):
            with opt.sampled_params(train=train):
                samples.append({n: p.detach().clone() for n, p in model.named_parameters()})
                out = model(X)
                outs.append(out.detach())
                if train:
                    nn.functional.cross_entropy(out.float(), Y).backward()
        outs.append(model(X))
    assert not torch.equal(samples[0]["0.weight"], samples[1]["0.weight"])
    expected = [_bf16_forward(model, w) for w in (mean, *samples, mean)]
    for got, want in zip(outs, expected, strict=True):
        assert torch.equal(got.detach(), want)


# ----------------------------------------------------------------------------- torch's step(closure)
@pytest.mark.parametrize("returns", ["loss", "none", "outputs"])
def test_step_with_a_closure_takes_mc_samples_samples_as_the_loop_does(returns: str) -> None:
    """``step(closure)`` called the closure once, in one ``sampled_params(train=True)`` block: with
    ``mc_samples=2`` each step averaged one sample, not the two the loop of the documentation takes.
    It calls it ``mc_samples`` times, each in its own block, updates as that loop does, and returns the
    mean of the closure's losses; a closure that returns something else (None, or the loss with the
    logits, which no mean is taken of and which raised TypeError after the samples were recorded) gets
    what its last call returned, as torch's optimizers return what the closure returns."""
    model, twin = _model(), _model()
    opt, twin_opt = _optimizer(model, mc_samples=2), _optimizer(twin, mc_samples=2)
    calls = []

    def closure() -> object:
        opt.zero_grad()
        calls.append(opt.noise_label)
        logits = model(X)
        loss = nn.functional.cross_entropy(logits, Y)
        loss.backward()
        return {"loss": loss, "none": None, "outputs": (loss, logits)}[returns]

    for _ in range(3):
        losses = []
        for _ in range(twin_opt.mc_samples):
            with twin_opt.sampled_params(train=True):
                twin_opt.zero_grad()
                losses.append(nn.functional.cross_entropy(twin(X), Y))
                losses[-1].backward()
        twin_opt.step()
        got = opt.step(closure)
        if returns == "loss":
            assert torch.equal(got, (losses[0] + losses[1]) / 2)
        elif returns == "outputs":
            assert isinstance(got, tuple) and torch.equal(got[0], losses[-1])
        else:
            assert got is None
    assert calls == [1, 2, 3, 4, 5, 6]
    assert opt.recorded_samples == 0 and opt.sample_blocks == twin_opt.sample_blocks == 6
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))

def _step_with_closure_returning(convert: Callable[[torch.Tensor], object]) -> tuple[object, list[object]]:
    """``step(closure)`` of a 2-sample EVON whose closure returns ``convert(loss)``: what the step
    returned, and what each of its two calls returned."""
    model = _model()
    opt, returned = _optimizer(model, mc_samples=2), []

    def closure() -> object:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(X), Y)
        loss.backward()
        returned.append(convert(loss))
        return returned[-1]

    return opt.step(closure), returned


@pytest.mark.parametrize("kind", ["float", "np.float32", "np.float64", "np.int64"])
def test_step_with_a_closure_returns_the_mean_of_numeric_losses_of_any_number_type(kind: str) -> None:
    """A closure returning ``loss.item()`` as a numpy scalar other than float64 (``np.float32``,
    ``np.int64``), which is no Python ``float``/``int``, got its last call's loss back from
    ``step(closure)``, not the mean over the ``mc_samples`` calls that a tensor or Python float gets.
    Every real number (``numbers.Real``) is averaged, in its own type's arithmetic."""
    import numpy as np

    cast = {"float": float, "np.float32": np.float32, "np.float64": np.float64, "np.int64": np.int64}[kind]
    # np.int64: distinct integers per sample
    got, returned = _step_with_closure_returning(lambda loss: cast(loss.item() * 1000))
    assert returned[0] != returned[1]
    assert type(got) is type((returned[0] + returned[1]) / 2) and got == (returned[0] + returned[1]) / 2


@pytest.mark.parametrize("shape", [(), (3,)])
def test_step_with_a_closure_returning_numpy_arrays_returns_their_mean(shape: tuple) -> None:
    """A closure returning its loss as a numpy array (``loss.detach().numpy()``, a 0-d array, or per-example
    losses) got its last call's array back from ``step(closure)``, where a tensor, a Python float or a numpy
    scalar gets the mean over the ``mc_samples`` calls. Numeric arrays are averaged as those are."""
    import numpy as np

    scale = 1.0 + np.arange(shape[0] if shape else 1).reshape(shape)
    # 0-d: an array, no numpy scalar
    got, returned = _step_with_closure_returning(lambda loss: np.asarray(loss.detach().double().numpy() * scale))
    assert all(type(r) is np.ndarray for r in returned) and not np.array_equal(returned[0], returned[1])
    assert np.shape(got) == shape and np.array_equal(got, (returned[0] + returned[1]) / 2)


@pytest.mark.parametrize("tensor_first", [True, False], ids=["tensor-first", "numpy-first"])
@pytest.mark.parametrize("numpy_shape", [None, (), (1,)], ids=["np.float64", "0-d", "(1,)"])
def test_step_with_a_closure_returning_a_tensor_and_a_numpy_loss_returns_their_mean_in_either_order(
    numpy_shape: tuple | None, tensor_first: bool
) -> None:
    """A closure returning a tensor on one call and a numpy array on the other had its mean taken in call
    order: ``ndarray + Tensor`` raised numpy's TypeError ("Concatenation operation is not implemented")
    after both samples were recorded (they were dropped), and a 0-d array first was read as a float, a
    tensor first read it as a float64 tensor, the mean's dtype depending on the order. Either order gives
    the mean as ``Tensor + ndarray`` computes it (the array read as a tensor); a numpy scalar counts as a
    number."""
    import numpy as np

    def convert(loss: torch.Tensor) -> object:
        convert.calls += 1
        if (convert.calls == 1) == tensor_first:
            return loss.detach()
        value = loss.detach().double().numpy()
        return np.float64(value) if numpy_shape is None else value.reshape(numpy_shape)

    convert.calls = 0
    got, returned = _step_with_closure_returning(convert)
    tensor, other = returned if tensor_first else returned[::-1]
    expected = (tensor + other) / 2
    assert type(got) is torch.Tensor and (got.dtype, got.shape) == (expected.dtype, expected.shape)
    assert torch.equal(got, expected)


def test_step_with_a_closure_whose_losses_have_no_mean_is_refused_and_drops_the_samples() -> None:
    """Per-example loss tensors of different shapes across the ``mc_samples`` calls (a closure that
    draws its own batch, the last one smaller) raised torch's broadcast error after the samples were
    recorded: the step never ran and the next one averaged four samples. The step is refused with a
    ValueError naming the closure and the shapes, drops the samples, and a retry steps as a run
    without the failure does."""
    model, twin = _model(), _model()
    opt, twin_opt = _optimizer(model, mc_samples=2), _optimizer(twin, mc_samples=2)
    sizes = [32, 8]

    def closure_of(m: nn.Module, calls: list) -> object:
        def closure() -> torch.Tensor:
            n = sizes[len(calls) % 2]
            calls.append(n)
            loss = nn.functional.cross_entropy(m(X[:n]), Y[:n], reduction="none")
            loss.mean().backward()
            return loss.detach()

        return closure

    calls, twin_calls = [], []
    closure, twin_closure = closure_of(model, calls), closure_of(twin, twin_calls)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"closure.*\(32,\).*\(8,\)"):
        opt.step(closure)
    assert opt.recorded_samples == 0 and opt.sample_blocks == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    sizes[1] = 32
    opt.step(closure)
    twin_opt.step(twin_closure)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_step_with_a_closure_whose_mean_runs_out_of_memory_raises_that_error_and_drops_the_samples() -> None:
    """Averaging the closure's losses that runs out of memory (per-token loss tensors on a full device)
    was reported as a ValueError saying the losses' shapes have no mean, which a caller's
    ``except torch.OutOfMemoryError`` retry does not catch. The out-of-memory error comes through as
    it is, the step's samples dropped, as for a closure that raises."""

    class FullDevice(torch.Tensor):  # a loss whose addition finds no memory
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("add", "__add__", "__radd__"):
                raise torch.OutOfMemoryError("out of memory averaging the losses")
            return super().__torch_function__(func, types, args, kwargs or {})

    model = _model()
    opt = _optimizer(model, mc_samples=2)
    before = [p.detach().clone() for p in model.parameters()]

    def closure() -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(X), Y, reduction="none")
        loss.mean().backward()
        return loss.detach().as_subclass(FullDevice)

    with pytest.raises(torch.OutOfMemoryError, match="averaging the losses"):
        opt.step(closure)
    assert opt.recorded_samples == 0 and opt.sample_blocks == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))



def test_a_step_whose_closure_raises_leaves_the_optimizer_as_the_last_step_did() -> None:
    """A closure that raised in its second of ``mc_samples=2`` blocks (an out-of-memory error caught
    and retried) left the first block's sample recorded: the retried ``step(closure)`` averaged three
    samples, one of them from the failed call, and drew other noise than a run without the failure.
    The failed call drops its samples and their noise; the retry steps as the run without it does."""
    model, twin = _model(), _model()
    opt, twin_opt = _optimizer(model, mc_samples=2), _optimizer(twin, mc_samples=2)
    fail_at = [4]

    def closure_of(o: EVON, m: nn.Module, calls: list) -> object:
        def closure() -> torch.Tensor:
            calls.append(o.noise_label)
            if len(calls) == fail_at[0]:
                raise RuntimeError("CUDA out of memory")
            loss = nn.functional.cross_entropy(m(X), Y)
            loss.backward()
            return loss

        return closure

    calls, twin_calls = [], []
    closure, twin_closure = closure_of(opt, model, calls), closure_of(twin_opt, twin, twin_calls)
    opt.step(closure)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        opt.step(closure)
    assert opt.recorded_samples == 0 and opt.sample_blocks == 2
    for _ in range(2):
        opt.step(closure)
    fail_at[0] = 0
    for _ in range(3):
        twin_opt.step(twin_closure)
    assert calls == [1, 2, 3, 4, 3, 4, 5, 6] and twin_calls == [1, 2, 3, 4, 5, 6]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))

def test_step_with_a_closure_inside_a_block_is_refused_naming_step_and_keeps_the_block() -> None:
    """``step(closure)`` inside a ``sampled_params()`` block said that ``sampled_params()`` blocks
    cannot be nested, which the caller did not call; it names ``step()``, as ``step()`` without a
    closure does, calls the closure not at all and leaves the running block's sample recorded."""
    model = _model()
    opt, calls = _optimizer(model, mc_samples=2), []
    with opt.sampled_params(train=True):
        nn.functional.cross_entropy(model(X), Y).backward()
        with pytest.raises(RuntimeError, match=r"^step\(\) called inside a sampled_params\(\) block"):
            opt.step(lambda: calls.append(opt.noise_label))
    assert calls == [] and opt.recorded_samples == 1 and opt.sample_blocks == 1


# ----------------------------------------------------------------------------- evaluation and ranks
@pytest.mark.parametrize("first_use", ["sampled_params", "posterior_std"])
def test_a_first_use_under_inference_mode_leaves_an_optimizer_that_trains(first_use: str) -> None:
    """An evaluation before training under ``torch.inference_mode()`` (a BMA baseline, or a look at
    the initial posterior) stacked EVON's state as inference tensors: the first step then raised
    "Inference tensors do not track version counter". Training after it equals training after
    the same evaluation under ``torch.no_grad()``."""
    runs = []
    for mode in (torch.no_grad, torch.inference_mode):
        model = _model()
        opt = _optimizer(model, precondition_frequency=2)
        with mode():
            if first_use == "sampled_params":
                with opt.sampled_params(train=False):
                    model(X)
            else:
                opt.posterior_std(model[0].weight)
        for _ in range(3):
            _step(opt, model)
        assert not any(v.is_inference() for v in opt.state[model[0].weight].values())
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_an_evaluation_block_leaves_the_training_noise_as_it_was() -> None:
    """A ``sampled_params(train=False)`` block (a BMA evaluation) advanced the training blocks'
    noise label: training then took other samples than without the evaluation (with AdamW an
    evaluation never changes training), and under DDP with a main-process-only evaluation the
    ranks' counters parted, so a resume was not bit-exact."""
    models = []
    for evaluate in (False, True):
        model = _model()
        opt = _optimizer(model)
        for i in range(4):
            _step(opt, model)
            if evaluate and i == 1:
                with opt.sampled_params(train=False):
                    model(X)
        models.append(model)
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        assert torch.equal(a, b)


def test_a_block_recorded_after_synchronize_is_averaged_too() -> None:
    """``synchronize()`` (to clip or log the averaged gradients, as its docstring invites) marked
    the step's gradients averaged, so a later block's own gradients reached the step un-averaged
    and DDP ranks parted silently. The reducer stands in for the ranks here: averaging with a
    second rank whose gradients are zero halves them."""
    model = _model()
    opt = _optimizer(model)
    _step(opt, model)
    reduced = []

    def reducer(tensors: list[torch.Tensor]) -> None:
        reduced.append(len(tensors))
        torch._foreach_mul_(tensors, 0.5)

    w, seen = model[0].weight, []

    def reducer_seeing(tensors: list[torch.Tensor]) -> None:
        seen.append(w.grad.clone())  # what each average starts from
        reducer(tensors)

    opt.gradient_reducer = reducer_seeing
    with opt.sampled_params(train=True):
        nn.functional.cross_entropy(model(X), Y).backward()
        own = [w.grad.clone()]  # inside a block .grad holds that block's own gradient
    opt.synchronize()
    with opt.sampled_params(train=True):
        nn.functional.cross_entropy(model(X), Y).backward()
        own.append(w.grad.clone())
    opt.step()
    assert len(reduced) == 2
    assert torch.equal(seen[0], own[0])
    assert torch.equal(seen[1], own[1] + own[0] * 0.5)  # the second block's own, un-averaged, added


def test_the_optimizers_posterior_std_and_covariance_are_float32_inside_autocast() -> None:
    model = _model()
    opt = _optimizer(model, precondition_frequency=2)
    for _ in range(3):
        _step(opt, model)
    w = model[0].weight
    std, cov = opt.posterior_std(w), opt.posterior_covariance(w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(opt.posterior_std(w), std) and torch.equal(opt.posterior_covariance(w), cov)


def test_a_complex_parameter_leaves_the_other_gradients_norms_widened() -> None:
    """With one complex parameter among them, every gradient norm was taken in its own dtype: a
    finite float16 gradient overflowed again and the step was skipped."""
    from hf_evon.optim.linalg import norms_of

    half = torch.full((10,), 100.0, dtype=torch.float16)  # ‖g‖ = 316: its square overflows float16
    z = torch.tensor([3.0 + 4.0j])
    norms = norms_of([half, z, half])
    assert [n.dtype for n in norms] == [torch.float32, torch.float32, torch.float32]
    assert [float(n) for n in norms] == pytest.approx([1000**0.5 * 10, 5.0, 1000**0.5 * 10], rel=1e-6)
    assert all(torch.isfinite(n.square()) for n in norms)


# ------------------------------------------------------------------- a learning rate as a tensor
def _rate(value: float, tensor: bool) -> float | torch.Tensor:
    return torch.tensor(value) if tensor else value


def _run_with_rates(tensor: bool, how: str) -> tuple[nn.Sequential, EVON]:
    """Four steps at rates that are powers of two (so a rate multiplied in any order is exact)."""
    model = _model()
    if how == "constructor":
        opt = _optimizer(model, lr=_rate(0.125, tensor), adamw_lr=_rate(0.0625, tensor))
    else:
        opt = _optimizer(model, lr=0.125, adamw_lr=0.0625)
        for group in opt.param_groups:
            group["lr"] = _rate(group["lr"], tensor)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5**t) if how == "scheduler" else None
    for _ in range(4):
        _step(opt, model)
        if scheduler is not None:
            scheduler.step()
    return model, opt


@pytest.mark.parametrize("how", ["constructor", "group", "scheduler"])
def test_a_tensor_learning_rate_trains_as_the_same_float_does(how: str) -> None:
    """torch.optim.AdamW takes ``lr`` as a 0-dim tensor (which schedulers then set in place, with
    ``fill_``), and so do EVON's groups of both algorithms: the run is the one at the same floats.
    Before, EVON(lr=torch.tensor(...)) and a group's tensor rate were refused ("Invalid lr")."""
    model, opt = _run_with_rates(True, how)
    ref_model, ref = _run_with_rates(False, how)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    assert all(torch.is_tensor(g["lr"]) for g in opt.param_groups)  # a scheduler fills it in place
    if how == "scheduler":
        assert [float(g["lr"]) for g in opt.param_groups] == [0.125 / 16, 0.0625 / 16]
    saved = pickle.loads(pickle.dumps(opt.state_dict()))
    fresh = _optimizer(_model(), lr=0.125, adamw_lr=0.0625)
    fresh.load_state_dict(saved)
    assert [float(g["lr"]) for g in fresh.param_groups] == [float(g["lr"]) for g in opt.param_groups]


@pytest.mark.parametrize("scaled", [False, True])
def test_a_tensor_rate_on_the_device_steps_the_weights_as_its_float_does(scaled: bool) -> None:
    """A rate held as a tensor on an accelerator is multiplied there (no host sync per step), by the
    same kernel as a CPU tensor here: the weights get the float rate's step exactly (powers of two)."""
    from hf_evon.optim.update import step_weights

    torch.manual_seed(0)
    params = [torch.randn(3, 4), torch.randn(5)]
    deltas = [torch.randn(3, 4), torch.randn(5)]
    scales = [torch.tensor(0.5), torch.tensor(0.25)] if scaled else None
    by_float, by_tensor = [p.clone() for p in params], [p.clone() for p in params]
    step_weights(by_float, deltas, scales, 0.125)
    step_weights(by_tensor, deltas, scales, torch.tensor(0.125))
    expected = [p - 0.125 * d * (1.0 if s is None else s) for p, d, s in zip(params, deltas, scales or [None] * 2)]
    for got, other, want in zip(by_tensor, by_float, expected):
        assert torch.equal(got, other) and torch.equal(got, want)


@pytest.mark.parametrize(
    "rate, rule",
    [
        (torch.tensor([0.1]), "0-dim"),
        (torch.tensor(1), "floating-point"),
        (torch.tensor(-0.1), ">= 0"),
        (torch.tensor(float("nan")), "finite"),
    ],
)
@pytest.mark.parametrize("key", ["lr", "adamw_lr"])
def test_a_tensor_rate_that_is_not_a_finite_0_dim_float_is_refused_by_name(rate, rule: str, key: str) -> None:
    with pytest.raises(ValueError, match=rf"Invalid {key}: .*{rule}"):
        _optimizer(_model(), **{key: rate})
    opt = _optimizer(_model())
    opt.param_groups[1 if key == "adamw_lr" else 0]["lr"] = rate
    with pytest.raises(ValueError, match=rf"param_groups\[\d\]: Invalid lr: .*{rule}"):
        _step(opt, _model())


# ----------------------------------------------------------------------------- accelerate's accumulation
@pytest.mark.parametrize("distributed", [False, True])
def test_a_sample_block_inside_accelerates_accumulation_is_refused_before_anything_changes(distributed: bool) -> None:
    """accelerate's own layout, ``with accelerator.accumulate(model):`` around the sample blocks and
    ``optimizer.step()`` (accelerate skips the step until the K-th micro-batch): every micro-batch's blocks
    were recorded as samples of one step, so EVON divided the gradient (already divided by K by
    ``accelerator.backward``) by K more, silently. The prepared handle's block now refuses to start there,
    naming the layout; the docs' layout (the K micro-batches inside each block) trains as before."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from hf_evon import prepare_distributed

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        model = _model()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        model, optimizer = accelerator.prepare(model, _optimizer(model))
        if distributed:
            optimizer = prepare_distributed(model, optimizer)
        evon = optimizer.optimizer
        start = [p.detach().clone() for p in model.parameters()]
        with accelerator.accumulate(model):  # the first of K = 2 micro-batches: accelerate accumulates
            with pytest.raises(RuntimeError, match=r"sampled_params\(train=True\).*accelerator\.accumulate.*gradient_accumulation_steps=2"):
                with optimizer.sampled_params(train=True):
                    pass
            with optimizer.sampled_params(train=False):  # sampling for evaluation is no sample of a step
                pass
        assert evon.recorded_samples == 0 and evon.sample_blocks == 0 and not evon.in_sample
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
        assert all(p.grad is None for p in model.parameters())
        with accelerator.accumulate(model):  # the second: the docs' layout resumes
            pass
        with optimizer.sampled_params(train=True):
            for _ in range(2):
                with accelerator.accumulate(model):
                    accelerator.backward(nn.functional.cross_entropy(model(X), Y))
        optimizer.step()
        assert evon.recorded_samples == 0 and evon.sample_blocks == 1
        assert not all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()



@pytest.mark.parametrize("closure", [False, True])
def test_a_bare_evons_sample_block_inside_accelerates_accumulation_is_refused(closure: bool) -> None:
    """An EVON not passed to ``accelerator.prepare`` stepped in accelerate's layout (blocks and ``step()``
    inside ``accelerator.accumulate(model)``): accelerate skips no step of a bare optimizer, so EVON
    stepped at every micro-batch, each with the gradient of a loss ``accelerator.backward`` divided by K,
    silently (4 updates for 4 micro-batches at K = 2). Its block (or ``step(closure)``'s) is now refused
    there as the prepared optimizer's is, before any gradient or weight changes; the docs' layout trains,
    one update per K micro-batches, the mean gradient's."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        model = _model()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        evon = _optimizer(model)
        model = accelerator.prepare(model)
        start = [p.detach().clone() for p in model.parameters()]

        def loss() -> torch.Tensor:
            out = nn.functional.cross_entropy(model(X), Y)
            accelerator.backward(out)
            return out

        with accelerator.accumulate(model):  # the first of K = 2 micro-batches
            with pytest.raises(RuntimeError, match=r"sampled_params\(train=True\).*gradient_accumulation_steps=2"):
                if closure:
                    evon.step(loss)
                else:
                    with evon.sampled_params(train=True):
                        loss()
            with evon.sampled_params(train=False):  # sampling for evaluation is no sample of a step
                pass
        assert evon.recorded_samples == 0 and not evon.in_sample
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
        assert all(p.grad is None for p in model.parameters())
        with accelerator.accumulate(model):  # the second: the docs' layout resumes
            pass
        with evon.sampled_params(train=True):
            for _ in range(2):
                with accelerator.accumulate(model):
                    loss()
        evon.step()
        ref_model = _model()
        ref = _optimizer(ref_model)
        with ref.sampled_params(train=True):  # the same step without accelerate: each loss divided by K
            for _ in range(2):
                (nn.functional.cross_entropy(ref_model(X), Y) / 2).backward()
        ref.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
        assert not all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_accelerates_clip_inside_a_block_clips_that_sample_and_after_the_blocks_their_sum() -> None:
    """What docs/usage.md says ``accelerator.clip_grad_norm_`` clips in the accumulation layout: at a block's
    K-th micro-batch, that sample's gradient alone (the earlier samples' are set aside), each clipped to
    ``max_norm`` on its own; after the blocks, the sum over the samples, whose norm it returns."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        model = _model()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        model, optimizer = accelerator.prepare(model, _optimizer(model))
        params = list(model.parameters())
        seen, returned = [], []
        for _ in range(2):  # two samples of one step
            with optimizer.sampled_params(train=True):
                for i in range(2):
                    with accelerator.accumulate(model):
                        accelerator.backward(nn.functional.cross_entropy(model(X[16 * i : 16 * i + 16]), Y[16 * i : 16 * i + 16]))
                        if accelerator.sync_gradients:
                            seen.append(torch.cat([p.grad.flatten() for p in params]))
                            returned.append(accelerator.clip_grad_norm_(params, 0.125))
        for g, n in zip(seen, returned):
            assert torch.allclose(n, g.norm()) and g.norm() > 0.125  # each sample's own norm, then clipped
        total = torch.cat([p.grad.flatten() for p in params])
        clipped = [g * (0.125 / (n + 1e-6)) for g, n in zip(seen, returned)]  # torch's clip_grad_norm_ factor
        assert torch.allclose(total, clipped[0] + clipped[1])
        assert torch.allclose(accelerator.clip_grad_norm_(params, float("inf")), total.norm())
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

def _first_difference(a: object, b: object, path: str = "state_dict") -> str | None:
    """Where two state dicts differ (tensors: dtype and every value), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        return None if same and torch.equal(a, b) else f"{path}: {a!r} != {b!r}"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        return next((d for k in a if (d := _first_difference(a[k], b[k], f"{path}[{k!r}]"))), None)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and type(a) is type(b) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _first_difference(x, y, f"{path}[{i}]"))), None)
    return None if a == b else f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("refused", ["accumulate", "nested", "state_dict", "step"])
def test_a_refused_call_at_a_block_leaves_the_optimizer_and_its_noise_as_they_were(refused: str) -> None:
    """A training block refused at its entry (a bare EVON's, inside ``accelerator.accumulate`` before the
    K-th micro-batch) still counted as a block: the noise counter moved on, and every later sample
    drew other noise than a run that never hit the refusal. Each refusal at a block (that one, a nested
    block, ``state_dict()`` or ``step()`` inside a block) now leaves the state dict, the gradients,
    the weights and every later sample as an identical optimizer's that was never refused. A ``step()``
    refused inside a block set the step mark (where a rewind sets the noise back) to the middle of a step."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        model, ref_model = _model(), _model()
        opt, ref = _optimizer(model), _optimizer(ref_model)
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = accelerator.prepare(model)
        _step(opt, model)  # state worth comparing: a step's statistics, one block counted
        _step(ref, ref_model)
        calls = {
            "nested": (opt.sampled_params, "sampled_params"),
            "state_dict": (opt.state_dict, r"state_dict\(\)"),
            "step": (opt.step, r"step\(\)"),
        }
        if refused == "accumulate":
            with accelerator.accumulate(model):  # the first of K = 2 micro-batches
                with pytest.raises(RuntimeError, match=r"gradient_accumulation_steps=2"):
                    with opt.sampled_params(train=True):
                        pass
            with accelerator.accumulate(model):  # the second: blocks may start again
                pass
        for _ in range(2):  # two steps of two samples, the refused call inside the first block
            for sample in range(2):
                with opt.sampled_params(train=True):
                    if refused in calls and sample == 0:
                        call, name = calls[refused]
                        with pytest.raises(RuntimeError, match=name + r".*inside a sampled_params\(\) block"):
                            with contextlib.ExitStack() as stack:
                                result = call()
                                if refused == "nested":
                                    stack.enter_context(result)
                    nn.functional.cross_entropy(model(X), Y).backward()
                with ref.sampled_params(train=True):
                    nn.functional.cross_entropy(ref_model(X), Y).backward()
                for p, q in zip(model.parameters(), ref_model.parameters()):
                    assert torch.equal(p.grad, q.grad)
            assert _first_difference(opt.state_dict(), ref.state_dict()) is None
            opt.step()
            ref.step()
            assert _first_difference(opt.state_dict(), ref.state_dict()) is None
        assert opt.sample_blocks == ref.sample_blocks == 5
        with opt.sampled_params(train=True), ref.sampled_params(train=True):  # the next sample's weights
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_a_block_refused_for_a_cleared_optimizer_state_counts_no_block() -> None:
    """``optimizer.state`` cleared between a recorded block and ``step()`` refuses the next block at its
    entry (the recorded sample's Hessian numerators would be lost); that refused block still counted
    as a block, and moved the noise stream on. Now the counter, the gradients and the weights are
    as before the refused block. Its message said the clearing was done inside a block (call it after
    the block), where it was done after one, before ``step()``."""
    model = _model()
    opt = _optimizer(model)
    with opt.sampled_params(train=True):
        nn.functional.cross_entropy(model(X), Y).backward()
    weights = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    opt.state.clear()
    with pytest.raises(RuntimeError) as refused:
        with opt.sampled_params(train=True):
            pass
    assert str(refused.value) == (
        "clearing or replacing optimizer.state, or editing a group's params was called between a "
        "sampled_params(train=True) block and step(): the 1 recorded sample(s) would lose their Hessian "
        "estimate. Put it back before step() or call discard_samples()"
    )
    assert (opt.sample_blocks, opt.recorded_samples, opt.in_sample) == (1, 1, False)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_a_step_refused_for_a_cleared_optimizer_state_names_the_ways_out() -> None:
    """``step()`` after ``optimizer.state`` was cleared between a recorded block and the step is refused
    (the recorded sample's Hessian numerators would be lost) with the block's message, which ended "Call
    step() first": the call refused was step() itself, and calling it again was refused again. The message
    names the two ways out, putting the state back and ``discard_samples()`` (tests/test_optim_state.py
    steps after the latter); with the entries put back the step is a never-cleared twin's, bit for bit."""
    model, twin = _model(), _model()
    opt, twin_opt = _optimizer(model), _optimizer(twin)
    for o, m in ((opt, model), (twin_opt, twin)):
        _step(o, m)
        o.zero_grad()
        with o.sampled_params(train=True):
            nn.functional.cross_entropy(m(X), Y).backward()
    entries = dict(opt.state)
    opt.state.clear()
    with pytest.raises(RuntimeError) as refused:
        opt.step()
    assert str(refused.value) == (
        "clearing or replacing optimizer.state, or editing a group's params was called between a "
        "sampled_params(train=True) block and step(): the 1 recorded sample(s) would lose their Hessian "
        "estimate. Put it back before step() or call discard_samples()"
    )
    opt.state.update(entries)
    opt.step()
    twin_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_a_checkpoint_inside_a_sample_block_is_refused_naming_state_dict(tmp_path) -> None:
    """``accelerator.save_state`` (or ``torch.save`` of the model's and the optimizer's state) inside a
    ``sampled_params`` block wrote the sample as the model's weights beside EVON's state, and a run resumed
    from it trained on from the sample, not the mean. ``state_dict()`` there is refused, as a posterior
    snapshot is; after the block the checkpoint holds the mean."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        model = _model()
        accelerator = Accelerator(cpu=True)
        model, optimizer = accelerator.prepare(model, _optimizer(model))
        for _ in range(2):
            _step(optimizer.optimizer, model)
        mean = [p.detach().clone() for p in model.parameters()]
        with optimizer.sampled_params(train=True):
            with pytest.raises(RuntimeError, match=r"^state_dict\(\) .*inside a sampled_params\(\) block"):
                accelerator.save_state(str(tmp_path / "inside"))
            with pytest.raises(RuntimeError, match=r"^state_dict\(\) .*inside a sampled_params\(\) block"):
                optimizer.state_dict()
            nn.functional.cross_entropy(model(X), Y).backward()
        assert optimizer.recorded_samples == 1  # the block is recorded as any other
        accelerator.save_state(str(tmp_path / "after"))
        saved = torch.load(tmp_path / "after" / "optimizer.bin", weights_only=True)
        assert saved["evon"]["sample_blocks"] == 3
        from safetensors.torch import load_file

        weights = load_file(tmp_path / "after" / "model.safetensors")
        assert all(torch.equal(weights[k], m) for k, m in zip(dict(model.named_parameters()), mean))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


# ----------------------------------------------------------------------------- frozen parameters
def test_a_frozen_parameter_in_an_evon_group_leaves_the_others_training_as_without_it() -> None:
    """A ``requires_grad=False`` parameter in a torch.optim.AdamW group changes nothing for the
    others (``EVON(model.parameters())`` with a frozen layer, as one passes AdamW). ``ess="auto"``
    pooled the frozen weights' RMS with the trained ones: a frozen matrix 10x their scale set ζ
    ~100x too small, the trained matrix's noise 10x too broad, and its whole run differed."""
    torch.manual_seed(0)
    trained0, frozen0, target = torch.randn(8, 6) * 0.3, torch.randn(5, 7) * 3.0, torch.randn(8, 6)
    runs = []
    for with_frozen in (False, True):
        w, frozen = nn.Parameter(trained0.clone()), nn.Parameter(frozen0.clone(), requires_grad=False)
        opt = EVON([{"params": [w, frozen] if with_frozen else [w]}], seed=0, curvature_refit=2)
        ess = []
        for _ in range(5):
            with opt.sampled_params(train=True):
                ((w.tanh() - target) ** 2).sum().backward()
            opt.step()
            opt.zero_grad()
            ess.append(opt.param_groups[0]["ess"])
        assert torch.equal(frozen, frozen0)
        runs.append((w.detach().clone(), ess, opt.posterior_std(w)))
    (w_alone, ess_alone, std_alone), (w_with, ess_with, std_with) = runs
    assert ess_with == ess_alone
    assert torch.equal(w_with, w_alone) and torch.equal(std_with, std_alone)


def test_ess_auto_of_a_group_with_a_frozen_parameter_is_that_of_its_trained_weights() -> None:
    """ζ = 1 / (ρ² · rms² · (h0 + δ)), rms over the trained weights only (docs of ``ess``)."""
    torch.manual_seed(0)
    w, frozen = nn.Parameter(torch.randn(8, 6) * 0.3), nn.Parameter(torch.randn(5, 7) * 3.0, requires_grad=False)
    opt = EVON([{"params": [w, frozen]}], seed=0)
    opt.posterior_std(w)  # builds the buckets, which resolves ess="auto"
    g = opt.param_groups[0]
    rms_sq = float(w.detach().double().square().mean())
    expected = 1.0 / (g["init_std_ratio"] ** 2 * rms_sq * (g["hess_init"] + g["weight_decay"]))
    assert g["ess"] == pytest.approx(expected, rel=1e-6)


def test_ess_auto_of_an_all_zero_trained_group_takes_the_fan_in_of_its_trained_weights_only() -> None:
    """An all-zero trained matrix (a zero-initialised head) takes rms² = 1/fan-in (``ess`` docs). The
    fan-in was the largest over the group's parameters, a frozen one's too: a frozen matrix wider than the
    trained one set its noise, where without it the group takes the trained matrix's own fan-in."""
    head, frozen = nn.Parameter(torch.zeros(8, 6)), nn.Parameter(torch.randn(5, 40), requires_grad=False)
    alone = EVON([{"params": [nn.Parameter(torch.zeros(8, 6))]}], seed=0)
    opt = EVON([{"params": [head, frozen]}], seed=0)
    for o in (alone, opt):
        o.posterior_std(o.param_groups[0]["params"][0])  # builds the buckets, which resolves ess="auto"
    g = opt.param_groups[0]
    expected = 1.0 / (g["init_std_ratio"] ** 2 * (1.0 / 6) * (g["hess_init"] + g["weight_decay"]))
    assert g["ess"] == pytest.approx(expected, rel=1e-12)
    assert g["ess"] == alone.param_groups[0]["ess"]
