"""EVON under every training loop and every fault (issue 9): each test reproduces a failure
that the optimizer once had, and checks the behaviour ``torch.optim`` users expect instead."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import operator
import re
import warnings
from collections.abc import Callable

import pytest
import torch
from test_optim_state import assert_identical, loss_fn, make_data, make_model, make_opt, snapshot, train_step
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_evon import EVON, EVONPosterior
from hf_evon.optim import held_samples
from hf_evon.optim.defaults import lr_from_adamw_lr


# ------------------------------------------------- item 3: the reference packages' loop
class Boom(Exception):
    pass


def failed_block(model: nn.Module, opt: EVON, data) -> None:
    """A sample whose block raises after its backward (caught): it must leave no trace."""
    with contextlib.suppress(Boom), opt.sampled_params(train=True):
        loss_fn(model, data).backward()
        raise Boom


def idle_block(model: nn.Module, opt: EVON, data) -> None:
    """Uses up the same training block of the noise stream as ``failed_block``, and nothing else:
    it raises before any backward."""
    with contextlib.suppress(Boom), opt.sampled_params(train=True):
        raise Boom


def accumulating_step(model: nn.Module, opt: EVON, batches: list, samples: int, between=None) -> None:
    """This package's loop: gradients accumulate over samples and micro-batches; zero_grad after the step.
    ``between(model, opt, data)`` runs after the first micro-batch's samples."""
    for k, data in enumerate(batches):
        for _ in range(samples):
            with opt.sampled_params(train=True):
                loss_fn(model, data).backward()
        if between is not None and k == 0:
            between(model, opt, data)
    opt.step()
    opt.zero_grad()


def zeroing_step(model: nn.Module, opt: EVON, batches: list, samples: int) -> None:
    """The IVON/EVON reference packages' loop: zero_grad inside every block, never after the step."""
    for data in batches:
        for _ in range(samples):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                loss_fn(model, data).backward()
    opt.step()


@pytest.mark.parametrize(("samples", "micro"), [(1, 1), (2, 1), (2, 2)], ids=["S1", "S2", "S2-accumulated"])
def test_both_training_loops_give_identical_weights(samples: int, micro: int) -> None:
    data = make_data(n=32)
    batches = [(data[0][k::micro], data[1][k::micro]) for k in range(micro)]  # gradient accumulation
    runs = {}
    for step_fn in (accumulating_step, zeroing_step):
        model = make_model()
        opt = make_opt(model, mc_samples=samples)
        for _ in range(6):
            step_fn(model, opt, batches, samples)
        runs[step_fn.__name__] = snapshot(model, opt)
    # the loops did train (not two idle copies)
    assert not torch.equal(runs["zeroing_step"]["param.0.weight"], make_model().state_dict()["0.weight"])
    assert_identical(runs["zeroing_step"], runs["accumulating_step"])


@pytest.mark.parametrize("bucket_view", [False, True])
def test_both_loops_agree_under_ddp(tmp_path, bucket_view: bool) -> None:
    """DDP (one gloo process): with ``gradient_as_bucket_view`` the gradients are views into
    DDP's buffers, which every backward overwrites; the earlier samples' sum must survive."""
    dist = torch.distributed
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    from hf_evon import prepare_distributed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        data = make_data(n=32)
        batches = [(data[0][k::2], data[1][k::2]) for k in range(2)]
        loops = {
            "accumulating": accumulating_step,
            "zeroing": zeroing_step,
            "failing": functools.partial(accumulating_step, between=failed_block),
        }
        runs = {}
        for name, step_fn in loops.items():
            model = make_model()
            ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
            opt = make_opt(model, mc_samples=2)
            prepare_distributed(ddp, opt)
            for _ in range(4):
                step_fn(ddp, opt, batches, 2)
            runs[name] = snapshot(model, opt)
    finally:
        dist.destroy_process_group()
    for name, between in (("plain", None), ("plain, idle block", idle_block)):
        model = make_model()
        opt = make_opt(model, mc_samples=2)
        for _ in range(4):
            accumulating_step(model, opt, batches, 2, between)
        runs[name] = snapshot(model, opt)
    assert_identical(runs["zeroing"], runs["accumulating"])
    assert_identical(runs["accumulating"], runs["plain"])
    assert_identical(runs["failing"], runs["plain, idle block"])


def test_inside_a_block_grad_holds_only_that_samples_gradient() -> None:
    model, data = make_model(), make_data()
    opt = make_opt(model)
    train_step(model, opt, data)
    w = model[0].weight
    own = []
    for _ in range(2):
        with opt.sampled_params(train=True):
            assert w.grad is None
            loss_fn(model, data).backward()
            own.append(w.grad.clone())
    torch.testing.assert_close(w.grad, own[0] + own[1], rtol=0, atol=0)


# ------------------------------------------------- item 7: a block that raises after backward
def test_a_failed_sample_leaves_no_trace() -> None:
    data = make_data()
    runs = []
    for fail in (False, True):
        model = make_model()
        opt = make_opt(model)
        for step in range(5):
            for s in range(opt.mc_samples):
                if step == 3 and s == 1 and fail:
                    before = {n: p.grad.clone() for n, p in model.named_parameters()}
                    with pytest.raises(Boom), opt.sampled_params(train=True):
                        loss_fn(model, data).backward()
                        raise Boom
                    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters())
                    assert opt.recorded_samples == 1
                elif step == 3 and s == 1:  # uses up the same training block of the noise stream
                    with contextlib.suppress(Boom), opt.sampled_params(train=True):
                        raise Boom
                with opt.sampled_params(train=True):
                    loss_fn(model, data).backward()
            opt.step()
            opt.zero_grad()
        runs.append(snapshot(model, opt))
    assert_identical(runs[1], runs[0])


def test_a_weight_resized_in_place_is_refused_by_name_and_the_run_goes_on_once_it_is_put_back() -> None:
    """``p.data = <another shape>`` after the state was stacked: refused, naming the weight, at the
    next block, with nothing changed; the old tensor put back, the run equals one never resized."""
    data = make_data()
    runs = []
    for resize in (False, True):
        model = make_model()
        opt = make_opt(model)
        for step in range(5):
            if step == 3 and resize:
                old = model[2].weight.data
                model[2].weight.data = torch.zeros(7, 5)
                before = snapshot(model, opt)
                with pytest.raises(ValueError, match=re.escape("['params'][1] (shape (7, 5)) changed shape from (5, 5) to (7, 5)")):
                    train_step(model, opt, data)
                assert_identical(snapshot(model, opt), before)
                model[2].weight.data = old
            train_step(model, opt, data)
        runs.append(snapshot(model, opt))
    assert_identical(runs[1], runs[0])


# ------------------------------------------------- item 5: a finite gradient spike
def spiked_run(spike: float, *, where: str, **options) -> tuple[nn.Module, EVON, list[str]]:
    """Eight steps of a named model; step 3's gradient of ``where`` multiplied by ``spike``."""
    model, data = make_model(), make_data()
    opt = EVON(model.named_parameters(), seed=0, **options)
    messages = []
    for step in range(8):
        with opt.sampled_params(train=True):
            loss_fn(model, data).backward()
            if step == 3:
                model.get_parameter(where).grad.mul_(spike)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        messages += [str(w.message) for w in caught]
        opt.zero_grad()
    return model, opt, messages


def assert_all_finite(model: nn.Module, opt: EVON) -> None:
    for name, value in snapshot(model, opt).items():
        assert torch.isfinite(value).all(), name


# the unclipped Price algorithm: a spike reaches H through the sampled estimate
PURE = {"hess_clip_ratio": None, "clip": "none", "hess_estimator": "price", "step_curvature": "entry"}


# ×1e8 at ess = inf overflowed the IVON correction term until it was dropped there (item 2)
@pytest.mark.parametrize(("ess", "spike"), [(200.0, 1e14), (float("inf"), 1e8)])
def test_a_finite_gradient_spike_is_absorbed(ess: float, spike: float) -> None:
    # no Hessian clipping (the default γ = 2 would clamp the spike before it reaches H)
    model, opt, messages = spiked_run(spike, where="2.weight", ess=ess, **PURE)
    assert messages == [] and opt.skipped_steps == 0
    assert_all_finite(model, opt)
    assert float(opt.state[model[2].weight]["hess"].max()) > 1e6  # the spike did reach H


@pytest.mark.parametrize("options", [PURE, {"ess": 200.0, **PURE}], ids=["auto-ess", "ess=200"])
def test_a_spike_that_would_overflow_H_skips_the_step_and_names_the_parameter(options: dict) -> None:
    model, opt, messages = spiked_run(1e30, where="4.weight", **options)
    assert opt.skipped_steps == 1 and len(messages) == 1
    assert messages[0].startswith("overflow in the Hessian estimate of 4.weight (shape (5, 5))"), messages[0]
    assert_all_finite(model, opt)
    # training went on after the skipped step: 8 steps, the initialising one and the skipped one not counted
    assert int(opt.state[model[4].weight]["step"]) == 6


def test_an_adamw_overflow_is_named_too() -> None:
    model, data = make_model(), make_data()
    opt = make_opt(model)  # biases in an AdamW group
    train_step(model, opt, data)
    before = snapshot(model, opt)
    for _ in range(opt.mc_samples):
        with opt.sampled_params(train=True):
            loss_fn(model, data).backward()
    model[2].bias.grad.mul_(1e30)  # finite, but its square (AdamW's second moment) is not
    with pytest.warns(
        RuntimeWarning, match=r"^overflow in AdamW's squared gradient of param_groups\[1\]\['params'\]\[1\]"
    ):
        opt.step()
    opt.zero_grad()
    assert_identical(snapshot(model, opt), before)


def test_weights_an_unclipped_step_overflowed_are_named_as_the_cause_not_their_gradient() -> None:
    """A step of finite gradients at lr=1e30 without clipping writes inf into the weights; the next
    step's gradients through them are NaN, and its warning named them a "non-finite gradient"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = EVON(model.parameters(), lr=1e30, clip="none", ess=1e4)
    data = (torch.randn(16, 4), torch.randint(0, 3, (16,)))
    messages = []
    for _ in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_step(model, opt, data)
        messages += [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    bad = next(i for i, p in enumerate(model.parameters()) if not torch.isfinite(p).all())
    assert messages and all(
        m.startswith(f"non-finite weights in param_groups[0]['params'][{bad}]") for m in messages
    ), messages


def test_a_spike_that_would_overflow_the_shampoo_statistics_skips_the_step() -> None:
    """With the defaults (γ = 2 clamps the Hessian estimate) a ×1e30 spike still overflowed
    L = β3 L + (1-β3) G Gᵀ (1e60): inf/NaN in L, then in the eigenbasis and every weight."""
    model, opt, messages = spiked_run(1e30, where="4.weight")
    assert opt.skipped_steps == 1 and len(messages) == 1
    assert messages[0].startswith("overflow in the Shampoo statistics (G Gᵀ) of 4.weight"), messages[0]
    assert_all_finite(model, opt)


def test_the_overflow_check_leaves_the_state_unchanged() -> None:
    model, data = make_model(), make_data()
    opt = EVON(model.named_parameters(), ess=200.0, seed=0, **PURE)
    for _ in range(3):
        train_step(model, opt, data)
    before = snapshot(model, opt)
    with opt.sampled_params(train=True):
        loss_fn(model, data).backward()
        model[4].weight.grad.mul_(1e30)
    with pytest.warns(RuntimeWarning, match=r"overflow in the Hessian estimate of 4\.weight"):
        opt.step()
    opt.zero_grad()
    assert_identical(snapshot(model, opt), before)


# one thread (the tests' OMP_NUM_THREADS=1): MKL's float32 eigh raises on seed 13's L, returns NaN on 25's
@pytest.mark.parametrize("seed", [13, 25])
def test_a_first_statistic_float32_eigh_cannot_diagonalise_trains_on(seed: int) -> None:
    """``examples/finetune_classification.py --evon-ess 10`` crashed on its first step with
    "linalg.eigh: failed to converge": huge noise left most units dead, and MKL's float32 eigh fails
    on such a finite L = G Gᵀ with many zero rows (raises, or returns a NaN basis: NaN weights).
    The step goes on with L's exact eigenbasis."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(384, 20, generator=gen) * torch.rand(20, generator=gen) ** 4
    g[:200] = 0  # dead units: zero rows of the gradient, scattered
    g = g[torch.randperm(384, generator=gen)]
    layer = nn.Linear(20, 384, bias=False)
    opt = EVON(layer.parameters(), ess=10.0, seed=0)
    for _ in range(3):
        for _ in range(opt.mc_samples):
            with opt.sampled_params(train=True):
                (layer.weight * g).sum().backward()  # the gradient is g whatever the sample
        opt.step()
        opt.zero_grad()
    st = opt.state[layer.weight]
    assert int(st["step"]) == 2  # the initialising step does not count
    assert torch.isfinite(layer.weight).all()
    q, stat = st["Q_L"].double(), st["L"].double()
    torch.testing.assert_close(q.mT @ q, torch.eye(384, dtype=torch.float64), atol=1e-5, rtol=0)
    evals = torch.linalg.eigvalsh(stat).flip(-1)  # descending, and a fixed L keeps its eigenbasis
    torch.testing.assert_close(q.mT @ stat @ q, torch.diag(evals), atol=1e-5 * float(evals[0]), rtol=0)


# ------------------------------------------------- item 6: frozen and gradient-less parameters
def test_frozen_and_unused_parameters_stay_bit_identical() -> None:
    model, data = make_model(), make_data()
    unused = nn.Linear(5, 5)  # in the optimizer, never in the forward
    frozen = model[2].weight  # shares the 5×5 bucket with model[4].weight
    frozen.requires_grad_(False)
    kept = {"frozen": frozen.detach().clone(), "unused": unused.weight.detach().clone()}
    opt = EVON([*model.parameters(), *unused.parameters()], ess=50.0, weight_decay=0.1, seed=0)
    for _ in range(5):
        with opt.sampled_params(train=True):
            assert torch.equal(frozen, kept["frozen"])  # no noise in a frozen weight
            loss_fn(model, data).backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(frozen, kept["frozen"]) and torch.equal(unused.weight, kept["unused"])
    for p in (frozen, unused.weight):
        assert torch.equal(opt.state[p]["exp_avg_unrotated"], torch.zeros(5, 5))  # no momentum
        assert torch.equal(opt.state[p]["hess"], torch.full((5, 5), opt.defaults["hess_init"]))  # no update
    # the bucket's trained member did train
    assert int(opt.state[model[4].weight]["step"]) == 4
    assert float(opt.state[model[4].weight]["exp_avg_unrotated"].abs().max()) > 0


def _late_member_run(shared: bool, steps: int = 25, save_at: int | None = None, **options) -> tuple:
    """A and B of one shape; A's first gradient comes at step 9 (a branch, an expert, a layer
    unfrozen later). ``shared``: one group (one bucket), else a group each."""
    torch.manual_seed(0)
    a, b = nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False)
    x, y_a, y_b = torch.randn(32, 6), torch.randn(32, 6), torch.randn(32, 6)
    groups = [{"params": [a.weight, b.weight]}] if shared else [{"params": [a.weight]}, {"params": [b.weight]}]
    opt = EVON(groups, seed=0, stagger_refresh=False, **options)
    for t in range(steps):
        if t == save_at:  # a resume: a new optimizer loads the state saved here
            saved = copy.deepcopy(opt.state_dict())
            opt = EVON(groups, seed=0, stagger_refresh=False, **options)
            opt.load_state_dict(saved)
        with opt.sampled_params(train=True):
            loss = ((b(x) - y_b) ** 2).mean()
            if t >= 8:
                loss = loss + ((a(x) - y_a) ** 2).mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
    return a.weight.detach().clone(), {k: v.clone() for k, v in opt.state[a.weight].items()}


@pytest.mark.parametrize(
    "options", [{}, {"hess_estimator": "price"}, {"step_curvature": "entry"}], ids=["fisher", "price", "entry"]
)
def test_a_member_whose_first_gradient_comes_late_steps_as_in_a_group_of_its_own(options: dict) -> None:
    # it counts its own updates (the bias corrections, H's first average replacing h0) and has
    # its own initialising step, whatever shares its bucket; ess = inf: no noise, so bit for bit
    shared, alone = _late_member_run(True, ess=math.inf, **options), _late_member_run(False, ess=math.inf, **options)
    assert torch.equal(shared[0], alone[0])
    assert shared[1].keys() == alone[1].keys()
    for key in alone[1]:
        assert torch.equal(shared[1][key], alone[1][key]), key
    assert int(shared[1]["step"]) == 25 - 8 - 1  # its 17 steps with a gradient, less its initialising one


@pytest.mark.parametrize("missed", [0, 4], ids=["initialising", "mid-run"])
def test_under_phased_gradients_a_member_that_misses_a_step_keeps_its_own_phase(missed: int) -> None:
    """A member a count behind its bucket was sampled on the bucket's noisy steps but stepped as
    clean, and stepped as noisy on the clean ones without a sample: its Price H never moved again."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    opt = EVON([a, b], seed=0, phased_gradients=True, hess_estimator="price", step_curvature="entry",
               clip="none", hess_init=0.01, ess=1000.0)  # fmt: skip
    x = torch.randn(16, 4)
    moved, perturbed = [], []
    for t in range(12):
        count, mean = int(opt.state[b]["step"]) if "step" in opt.state[b] else None, b.detach().clone()
        with opt.sampled_params(train=True):
            perturbed.append(not torch.equal(b, mean))
            loss = (x @ a).square().mean() + (0 if t == missed else (x @ b).square().mean())
            loss.backward()
        before = opt.state[b]["hess"].clone()
        opt.step()
        opt.zero_grad()
        # B's own step count before this step: even -> a noisy step, sampled, H updated from it
        noisy = count is not None and count % 2 == 0 and t != missed and t > 0
        moved.append(not torch.equal(before, opt.state[b]["hess"]))
        assert moved[-1] == noisy, (t, count)
        assert perturbed[-1] == (count is not None and count % 2 == 0), (t, count)
    assert sum(moved) >= 4


@pytest.mark.parametrize("estimator", ["fisher", "price"])
def test_a_clean_phased_step_leaves_h_as_it_was(estimator: str) -> None:
    """Phased gradients: a clean step (the gradient at the mean) updates L and R, not H. Under the
    Fisher estimate (the default) the clean steps updated H from the gradient at the mean."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    a, b = torch.randn(10, 4, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
    opt = EVON([w], lr=0.1, ess=40.0, hess_init=0.5, weight_decay=0.01, hess_estimator=estimator,
               phased_gradients=True, seed=0)  # fmt: skip
    moved = []
    for _ in range(7):
        count = int(opt.state[w]["step"]) if "step" in opt.state[w] else None
        with opt.sampled_params(train=True):
            (0.5 * (a @ w.T - b).square().sum() / 10).backward()
        before = opt.state[w]["hess"].clone() if count is not None else None
        opt.step()
        opt.zero_grad()
        if count is not None:
            moved.append((count % 2 == 0, not torch.equal(before, opt.state[w]["hess"])))
    assert [m for _, m in moved] == [noisy for noisy, _ in moved] and any(n for n, _ in moved)


def test_under_phased_gradients_the_fisher_h_is_the_plain_average_of_the_noisy_steps_squares() -> None:
    """Phased gradients under the Fisher estimate: H is the plain average of the noisy steps'
    squared gradients until the EMA's window fills, as without phasing. Its weight β = 1 − 1/t
    counted every update, clean ones too, so the k-th noisy update took 1 − 1/(2k − 1): after two,
    H was ⅔·G₁² + ⅓·G₃² and the first, early gradient kept about 28% of H after ten."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    a, b = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    # the identity basis: no initialising step, and the rotated gradient is the gradient; the
    # fitted ζ and δ stay as given
    opt = EVON([w], lr=0.01, ess=1e3, weight_decay=1e-3, phased_gradients=True, identity_basis=True,
               curvature_refit=0, seed=0)  # fmt: skip
    squares = []
    for _ in range(9):  # updates 1-9: noisy at 1, 3, 5, 7, 9 (from the counts 0, 2, 4, 6, 8)
        count = int(opt.state[w]["step"]) if "step" in opt.state[w] else 0
        with opt.sampled_params(train=True):
            (0.5 * (a @ w.T - b).square().sum() / 16).backward()
        grad = w.grad.clone()
        opt.step()
        opt.zero_grad()
        if count % 2 == 0:
            squares.append(grad.square())
            average = torch.stack(squares).mean(0)
            assert torch.allclose(opt.state[w]["hess"], average, rtol=1e-12, atol=0), len(squares)
    assert len(squares) == 5


def test_members_that_step_apart_under_a_float64_default_dtype() -> None:
    """The per-member counters were raised with torch.ones of the default dtype: under
    set_default_dtype(float64) a step without one member's gradient raised in index_add_."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
        opt = EVON([a, b], lr=0.1, seed=0)
        for t in range(3):
            with opt.sampled_params(train=True):
                (a.square().sum() + (b.square().sum() if t != 1 else 0)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_default_dtype(saved)
    assert [int(opt.state[p]["step"]) for p in (a, b)] == [2, 1]


def test_weights_of_one_shape_and_different_dtypes_step_in_their_own_dtype() -> None:
    """A bfloat16 matrix listed before a float32 one of its shape shared its bucket, and the
    float32 weight got bfloat16-rounded steps. Each now steps as it would alone, bit for bit."""

    def run(with_bf16: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        w16 = nn.Parameter(torch.randn(6, 6).bfloat16())
        w32 = nn.Parameter(torch.randn(6, 6))
        opt = EVON([w16, w32] if with_bf16 else [w32], seed=0, ess=math.inf, weight_decay=0.0, clip="none", lr=1.0)
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
        for _ in range(4):
            with opt.sampled_params(train=True):
                loss = (x @ w32).sin().sum() + ((x.bfloat16() @ w16).float().sin().sum() if with_bf16 else 0)
                loss.backward()
            opt.step()
            opt.zero_grad()
        return [w32.detach().clone(), *(v.clone() for v in opt.state[w32].values())]

    alone, mixed = run(False), run(True)
    assert not torch.equal(alone[0], alone[0].bfloat16().float())  # steps finer than bfloat16's
    assert len(alone) == len(mixed) and all(torch.equal(x, y) for x, y in zip(alone, mixed))


def test_a_late_member_resumes_bit_for_bit_before_and_after_its_first_gradient() -> None:
    straight = _late_member_run(True, ess=64.0)
    for save_at in (4, 9, 12):  # uninitialised, initialising, stepping
        resumed = _late_member_run(True, ess=64.0, save_at=save_at)
        assert torch.equal(resumed[0], straight[0]), save_at
        for key in straight[1]:
            assert torch.equal(resumed[1][key], straight[1][key]), (save_at, key)


def test_a_matrix_never_updated_takes_no_part_in_the_curvature_fit() -> None:
    # a frozen matrix (zero, so that the initial ess="auto" is B's alone) keeps h0: the group's
    # fitted ess and weight decay, and so B's training, are those of B alone
    runs = []
    for with_frozen in (True, False):
        torch.manual_seed(0)
        a, b = nn.Linear(6, 5, bias=False), nn.Linear(6, 6, bias=False)
        a.weight.requires_grad_(False)
        a.weight.data.zero_()
        x, y = torch.randn(32, 6), torch.randn(32, 6)
        opt = EVON([a.weight, b.weight] if with_frozen else [b.weight], seed=0, curvature_refit=5)
        for _ in range(12):
            with opt.sampled_params(train=True):
                ((b(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append((b.weight.detach().clone(), opt.param_groups[0]["ess"], opt.param_groups[0]["weight_decay"]))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1:] == runs[1][1:]


def test_an_unclipped_step_past_float16s_range_leaves_float16_weights_finite() -> None:
    # the pure algorithm's Newton step (no clip) in float32 exceeds 65504 at step 6; cast to
    # the weights' float16 it was inf, and every later step was skipped
    torch.manual_seed(0)
    first, second = nn.Linear(8, 4).half(), nn.Linear(4, 3).half()
    opt = EVON(
        [{"params": [first.weight, second.weight]}, {"params": [first.bias, second.bias], "algorithm": "adamw"}],
        seed=0, clip="none", step_curvature="entry",
    )  # fmt: skip
    x, y = torch.randn(16, 8, dtype=torch.half), torch.randint(0, 3, (16,))
    for _ in range(12):
        with opt.sampled_params(train=True):
            nn.functional.cross_entropy(second(torch.tanh(first(x))).float(), y).backward()
        opt.step()
        opt.zero_grad()
        assert all(bool(p.isfinite().all()) for p in (first.weight, second.weight))
    assert opt.skipped_steps == 0


@pytest.mark.parametrize("options", [{}, {"ess": math.inf}, {"hess_estimator": "price"}])
@pytest.mark.parametrize("shape, own_group", [((0, 3), False), ((0, 3), True), ((4, 0), True)])
def test_a_zero_size_parameter_is_left_out_and_the_rest_trains_as_without_it(
    options: dict, shape: tuple, own_group: bool
) -> None:
    # a zero-width layer (pruned, or a config with 0 heads): torch's optimizers accept it. Per-layer
    # groups (layer-wise rates) give a pruned Linear(0, d) a group of its own, whose ess="auto" had
    # divided by the fan-in 0 of its only tensor (a ZeroDivisionError at the first sample)
    runs = []
    for with_empty in (False, True):
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(4, 3))
        empty = nn.Parameter(torch.randn(*shape))
        groups = [{"params": [w]}, {"params": [empty]}] if own_group else [{"params": [w, empty]}]
        opt = EVON(groups if with_empty else [w], seed=0, **options)
        for _ in range(4):
            with opt.sampled_params(train=True):
                ((w**2).sum() + (empty**2).sum()).backward()
            opt.step()
            opt.zero_grad()
        runs.append(w.detach().clone())
        if with_empty:
            assert opt.state[empty] == {}  # no state, as torch.optim keeps none for it
            assert int(opt.state[w]["step"]) == 3  # every step of w ran
            holder = nn.Module()
            holder.w, holder.empty = w, empty
            posterior = EVONPosterior.from_optimizer(opt, holder)
            assert list(posterior.factors) == ["w"]  # a posterior of w; nothing to sample in empty
            if "ess" not in options:  # "auto", resolved to a number in every group
                assert all(math.isfinite(g["ess"]) for g in opt.param_groups)
    assert torch.equal(runs[0], runs[1])


# ------------------------------------------------- item 8: add_param_group with pending samples
def test_add_param_group_between_a_sample_and_step_is_refused() -> None:
    data = make_data()
    runs = []
    for attempt in (False, True):
        model = make_model()
        opt = make_opt(model)
        extra = nn.Parameter(torch.ones(4, 4))
        train_step(model, opt, data)
        for _ in range(opt.mc_samples):
            with opt.sampled_params(train=True):
                loss_fn(model, data).backward()
        if attempt:
            groups = list(opt.param_groups)
            with pytest.raises(RuntimeError, match=r"add_param_group.*step\(\)"):
                opt.add_param_group({"params": [extra]})
            assert len(opt.param_groups) == len(groups) and all(map(operator.is_, opt.param_groups, groups))
            assert opt.recorded_samples == opt.mc_samples
        opt.step()
        opt.zero_grad()
        opt.add_param_group({"params": [extra]})  # fine right after a step
        train_step(model, opt, data)
        runs.append(snapshot(model, opt))
    assert_identical(runs[1], runs[0])


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("estimator", ["fisher", "price"])
def test_zero_grad_between_a_steps_blocks_drops_the_earlier_samples_with_a_warning(
    estimator: str, set_to_none: bool
) -> None:
    """zero_grad() between a step's blocks (torch's zero_grad, forward, backward order; or a loop
    starting a step over after an abort) cleared the earlier samples' gradients, which .grad holds
    until the step, but not their count: the step divided the later samples' gradient by every
    sample's count, silently. The earlier samples are now dropped, with a warning naming the
    parameter: the step is the one of the later samples alone (the same noise: the blocks keep
    their place in the stream, as idle_block does). zero_grad(set_to_none=False), which zeroes
    .grad in place, was not noticed at all: the step halved the gradient, silently."""
    data = make_data()
    runs = []
    for clear in (False, True):
        model = make_model()
        opt = make_opt(model, hess_estimator=estimator)
        train_step(model, opt, data)
        if clear:
            with opt.sampled_params(train=True):
                loss_fn(model, data).backward()
            opt.zero_grad(set_to_none=set_to_none)
            named = r"param_groups\[0\]\['params'\]\[0\] \(shape \(5, 6\)\) lost the gradient .* zero_grad\(\)"
            with pytest.warns(UserWarning, match=named):
                with opt.sampled_params(train=True):
                    loss_fn(model, data).backward()
        else:
            idle_block(model, opt, data)
            with opt.sampled_params(train=True):
                loss_fn(model, data).backward()
        assert opt.recorded_samples == 1
        opt.step()
        opt.zero_grad()
        runs.append(snapshot(model, opt))
    assert_identical(runs[1], runs[0])


def test_load_state_dict_with_samples_pending_is_refused_and_the_step_goes_on() -> None:
    """Loaded inside a block or between a block and step(), the state rebuilt the buckets, which
    held (or were to hold) the block's Hessian numerator: the next step lost the sample silently."""
    data = make_data()
    runs = []
    for attempt in (False, True):
        model = make_model()
        opt = make_opt(model)
        train_step(model, opt, data)
        saved = copy.deepcopy(opt.state_dict())
        for _ in range(opt.mc_samples):
            with opt.sampled_params(train=True):
                loss_fn(model, data).backward()
                if attempt:
                    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) called inside a sampled_params"):
                        opt.load_state_dict(saved)
            if attempt:  # between the block and step(): the same samples would be lost
                with pytest.raises(RuntimeError, match=r"load_state_dict\(\) was called between .* step\(\)"):
                    opt.load_state_dict(saved)
                with pytest.raises(RuntimeError, match=r"invalidate_buckets\(\) was called between"):
                    opt.invalidate_buckets()
        opt.step()
        opt.zero_grad()
        runs.append(snapshot(model, opt))
    assert_identical(runs[1], runs[0])


def test_a_train_flag_that_is_not_a_bool_is_refused_at_entry() -> None:
    model, data = make_model(), make_data()
    opt = make_opt(model)
    train_step(model, opt, data)
    before = snapshot(model, opt)
    with pytest.raises(TypeError, match="train must be True or False; got 'yes'"):
        with opt.sampled_params(train="yes"):
            raise AssertionError("the block must not run")
    assert_identical(snapshot(model, opt), before)
    assert not opt.in_sample
    train_step(model, opt, data)  # still usable


def test_a_group_changed_to_an_invalid_value_is_refused_before_the_step_changes_anything() -> None:
    """A mode set to a typo mid-run raised in the second group's update, after the first group's
    momentum, statistics and H had moved; the samples stayed, so a retry moved them twice."""
    runs = []
    for typo in (False, True):
        torch.manual_seed(0)
        a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(3, 5))
        opt = EVON([{"params": [a]}, {"params": [b]}], seed=0)
        x, z = torch.randn(8, 4), torch.randn(8, 3)
        for t in range(4):
            with opt.sampled_params(train=True):
                ((x @ a).tanh().sum() + (z @ b).tanh().sum()).backward()
            if typo and t == 3:
                before = snapshot(nn.ParameterList([a, b]), opt)
                opt.param_groups[1]["clip"] = "Whiten"
                with pytest.raises(ValueError, match=r"param_groups\[1\]: Invalid clip: 'Whiten'"):
                    opt.step()
                assert_identical(snapshot(nn.ParameterList([a, b]), opt), before)
                opt.param_groups[1]["clip"] = "whiten_rms"
            opt.step()  # the retry steps as if nothing had happened
            opt.zero_grad()
        runs.append(snapshot(nn.ParameterList([a, b]), opt))
    assert_identical(runs[1], runs[0])


def test_a_refused_step_leaves_the_next_steps_gradients_to_be_averaged() -> None:
    """A step refused for want of a sample had already marked the gradients as averaged across
    ranks: the next, proper step skipped its all-reduce (each rank stepping on its own gradients)."""
    w = nn.Parameter(torch.randn(4, 4))
    opt = EVON([w], seed=0)
    calls: list[int] = []
    opt.gradient_reducer = lambda tensors: calls.append(len(tensors))
    x = torch.randn(8, 4)
    for _ in range(2):
        with opt.sampled_params(train=True):
            (x @ w).sum().backward()
        opt.step()
        opt.zero_grad()
    (x @ w).sum().backward()  # outside a block
    with pytest.raises(RuntimeError, match="needs the gradient at a posterior sample"):
        opt.step()
    opt.zero_grad()
    with opt.sampled_params(train=True):
        (x @ w).sum().backward()
    done = len(calls)
    opt.step()
    assert len(calls) == done + 1


def test_a_step_with_every_evon_matrix_frozen_needs_no_sample() -> None:
    """Training only biases and norms for a while (BitFit), with EVON's matrices frozen, a plain
    backward and step() was refused ("EVON needs the gradient at a posterior sample") although no
    matrix had a gradient to take at one. The AdamW step runs as torch.optim's would; a matrix
    with a gradient outside a block is still refused."""
    from hf_evon import build_optimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = build_optimizer(model, seed=0)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    for m in (model[0], model[2]):
        m.weight.requires_grad_(False)
    before = copy.deepcopy(model.state_dict())
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in ("0.weight", "2.weight"))
    assert not any(torch.equal(after[k], before[k]) for k in ("0.bias", "2.bias"))
    opt.zero_grad()
    model[2].weight.requires_grad_(True)
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="needs the gradient at a posterior sample"):
        opt.step()


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_backward_after_its_block_is_refused_also_through_activation_checkpointing(reentrant: bool) -> None:
    """Outside its block the weights hold the mean again. Without checkpointing autograd refuses
    the block's graph (the weights it saved changed in place); through torch.utils.checkpoint,
    which saves no weight and recomputes the forward during backward, the backward ran silently at
    the mean, under the sample's loss, and the step trained on that gradient. It is refused now,
    naming the parameter, and the step's samples are dropped; the backward inside the block gives
    exactly the gradient without checkpointing."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0), requires_grad=reentrant)

    def run(where: str) -> nn.Parameter:
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(3, 4))
        opt = EVON([{"params": [w], "param_names": ["w"]}], seed=0)

        def loss() -> torch.Tensor:
            if where == "plain":
                return torch.tanh(x @ w.T).square().mean()
            return checkpoint(lambda t: torch.tanh(t @ w.T), x, use_reentrant=reentrant).square().mean()

        for _ in range(2):
            with opt.sampled_params(train=True):
                value = loss()
                if where != "after":
                    value.backward()
            if where == "after":
                mean = w.detach().clone()
                with pytest.raises(RuntimeError, match=r"reached w \(shape \(3, 4\)\) after its sampled_params\(train=True\) "
                                   r"block had exited: call backward inside the block"):
                    value.backward()
                assert opt.recorded_samples == 0 and torch.equal(w, mean)
                with pytest.raises(RuntimeError, match="needs the gradient at a posterior sample"):
                    opt.step()
                opt.zero_grad()
                with opt.sampled_params(train=True):
                    loss().backward()
            opt.step()
            opt.zero_grad()
        return w

    assert torch.equal(run("checkpointed"), run("plain"))
    run("after")  # each refusal is followed by a block with its backward inside, which steps



def test_the_late_gradient_guard_hooks_each_weight_once_across_blocks_steps_and_optimizers() -> None:
    """The guard leaves one hook per sampled weight, however many blocks, steps and optimizers built in
    turn over the same model; it refuses for the optimizer whose block exited last, naming the weight
    by that optimizer's names, and lets every backward inside a block or after a step through."""
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.zeros(3))
    x = torch.randn(8, 4)

    def loss() -> torch.Tensor:
        return (x @ w.T + b).square().mean()

    for name in ("first", "second", "third"):
        opt = EVON([{"params": [w], "param_names": [name]}, {"params": [b], "param_names": ["b"], "algorithm": "adamw"}], seed=0)
        for _ in range(2):
            with opt.sampled_params(train=True):
                loss().backward()
            opt.step()
            loss().backward()  # after the step: the next step's
            opt.zero_grad()
        with opt.sampled_params(train=True):
            value = loss()
            value.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match=rf"reached {name} \(shape \(3, 4\)\) after its sampled_params"):
            value.backward()
        assert opt.recorded_samples == 0
        assert len(w._post_accumulate_grad_hooks) == 1 and not b._post_accumulate_grad_hooks

@pytest.mark.parametrize("block", ["refused", "raised"])
def test_a_block_refused_or_raising_leaves_the_late_gradient_guard_armed(block: str) -> None:
    """A training block disarms the guard at its entry (its own backward is awaited); one refused there
    (``optimizer.state`` cleared after a recorded block: its Hessian numerators would be lost) or raising
    inside left it disarmed, though the earlier sample is still the step's: a backward of that sample's
    graph after the block went through unrefused, added to the step's gradient, and the step trained
    on it. The guard is as before the block: that backward is refused, naming the weight."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 4))
    x = torch.randn(8, 4)
    opt = EVON([{"params": [w], "param_names": ["w"]}], seed=0)

    def loss() -> torch.Tensor:
        return torch.tanh(x @ w.T).square().mean()

    with opt.sampled_params(train=True):
        loss().backward()
    opt.step()
    opt.zero_grad()
    with opt.sampled_params(train=True):
        value = loss()
        value.backward(retain_graph=True)
    grad = w.grad.clone()
    if block == "refused":
        entries = dict(opt.state)
        opt.state.clear()
        with pytest.raises(RuntimeError, match=r"clearing or replacing optimizer\.state"):
            with opt.sampled_params(train=True):
                pass
        opt.state.update(entries)  # the state back: the step may use the recorded sample
    else:
        with contextlib.suppress(Boom), opt.sampled_params(train=True):
            loss().backward()
            raise Boom
    assert opt.recorded_samples == 1 and torch.equal(w.grad, grad)
    late = r"reached w \(shape \(3, 4\)\) after its sampled_params\(train=True\) block"
    with pytest.raises(RuntimeError, match=late):
        value.backward()
    assert opt.recorded_samples == 0


def test_no_prior_is_refused_with_noise_and_trains_without_it() -> None:
    # a dead input unit: H = 0 on its column after the Fisher estimate's first average; with
    # weight_decay = 0 its variance 1/(ess·(H + 0)) was inf, every sample inf, the loss NaN
    torch.manual_seed(0)
    x = torch.randn(32, 5)
    x[:, 0] = 0.0
    y = torch.randn(32, 3)
    w = nn.Parameter(torch.randn(3, 5) * 0.3)
    with pytest.raises(ValueError, match=r"Invalid weight_decay: 0\.0 \(must be > 0 where ess is finite"):
        EVON([w], weight_decay=0.0, seed=0)
    for options in ({"weight_decay": 1e-6}, {"weight_decay": 0.0, "ess": math.inf}):
        opt = EVON([w], seed=0, **options)
        for _ in range(6):
            with opt.sampled_params(train=True):
                ((x @ w.T - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert opt.skipped_steps == 0 and bool(w.isfinite().all())


def test_a_parameter_listed_twice_or_of_integers_is_refused_by_name() -> None:
    # torch only warns about a duplicate: each step updated it twice and ess="auto" counted it twice
    w = nn.Parameter(torch.randn(8, 6))
    with pytest.raises(ValueError, match=r"parameter 'again' \(shape \(8, 6\)\) is listed twice"):
        EVON([("w", w), ("again", w)])
    opt = EVON([w])
    with pytest.raises(ValueError, match=r"parameter #2 of its group .* is listed twice"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(2, 2)), *[nn.Parameter(torch.randn(3, 3))] * 2]})
    assert len(opt.param_groups) == 1
    counts = nn.Parameter(torch.zeros(3, 4, dtype=torch.int64), requires_grad=False)
    with pytest.raises(ValueError, match=r"cannot train the torch\.int64 parameter #0 of its group"):
        EVON([counts])


def test_a_parameter_listed_twice_in_an_adamw_group_is_refused_as_in_an_evon_group() -> None:
    # the check of a group's list came after an AdamW group's checks had returned: torch warned, and
    # each step updated the bias twice
    w, b = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=r"parameter 'again' \(shape \(3,\)\) is listed twice in its group"):
        EVON([{"params": [("w", w)]}, {"params": [("b", b), ("again", b)], "algorithm": "adamw"}])
    opt = EVON([w])
    with pytest.raises(ValueError, match=r"parameter #1 of its group \(shape \(3,\)\) is listed twice"):
        opt.add_param_group({"params": [b, b], "algorithm": "adamw"})
    assert len(opt.param_groups) == 1


# a parameter listed again (in its own group or another) while it is still listed, from each algorithm's group
APPENDED = {"its-own-group": (0, "0.weight"), "another-evon-group": (1, "0.weight"),
            "an-adamw-group": (2, "0.weight"), "adamws-bias-to-evon": (0, "0.bias")}  # fmt: skip


def _appended_run(into: int, name: str | None) -> dict[str, torch.Tensor]:
    """Four steps of two EVON groups and an AdamW group. With ``name``: appended to ``param_groups[into]``
    (in place, as torch.optim allows) before the third step's blocks, where the block must be refused,
    and after the fourth step's blocks, where the step must be; each time taken out again at once."""
    model, data = make_model(), make_data()
    named = dict(model.named_parameters())
    weights = [p for n, p in named.items() if n.endswith("weight")]
    biases = [p for n, p in named.items() if n.endswith("bias")]
    opt = EVON([{"params": weights[:2]}, {"params": weights[2:]}, {"params": biases, "algorithm": "adamw"}],
               lr=0.05, ess=64.0, mc_samples=2, adamw_lr=0.01, precondition_frequency=3, seed=123)  # fmt: skip
    twice = r"is listed (twice in its group|in param_groups\[\d\] and again in param_groups\[\d\])"

    def refused(call: Callable[[], object]) -> None:
        listed, kept, counts = opt.param_groups[into]["params"], snapshot(model, opt), opt.sample_blocks
        listed.append(named[name])
        with pytest.raises(ValueError, match=re.escape(f"(shape {tuple(named[name].shape)}) ") + twice):
            call()
        listed.pop()
        assert_identical(snapshot(model, opt), kept)
        assert opt.sample_blocks == counts

    def block() -> None:
        with opt.sampled_params(train=True):
            loss_fn(model, data).backward()

    for t in range(4):
        if name is not None and t == 2:
            refused(block)
        for _ in range(opt.mc_samples):
            block()
        if name is not None and t == 3:
            refused(opt.step)
        assert opt.recorded_samples == opt.mc_samples
        opt.step()
        opt.zero_grad()
    return snapshot(model, opt)


@pytest.mark.parametrize(("into", "name"), APPENDED.values(), ids=APPENDED.keys())
def test_a_parameter_appended_to_a_second_list_mid_run_is_refused_by_name_and_changes_nothing(
    into: int, name: str
) -> None:
    """torch.optim lets a group's list be edited in place between steps, and EVON steps what the lists
    hold. A parameter appended while still listed (in its own group or in another) was stepped twice
    each step: by two buckets over one state entry, or by EVON and AdamW, AdamW's state replacing
    EVON's. The groups' check skipped a group whose settings had not changed, whatever its list held."""
    assert_identical(_appended_run(into, name), _appended_run(into, None))


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_a_parameter_evon_cannot_train_appended_mid_run_is_refused_as_the_constructor_refuses_it(
    dtype: torch.dtype,
) -> None:
    """An integer tensor appended to an EVON group's list between steps raised torch's
    "linalg.vector_norm: Expected a floating point" at the next block; a complex one was sampled
    (its imaginary part cast away) before the step refused it. Both are refused at the block's entry."""
    a, bad = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.zeros(3, 3, dtype=dtype), requires_grad=False)
    opt = EVON([a], seed=0)
    with opt.sampled_params(train=True):
        a.square().sum().backward()
    opt.step()
    opt.param_groups[0]["params"].append(bad)
    kept = a.detach().clone(), {k: v.clone() for k, v in opt.state[a].items()}, opt.sample_blocks
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (torch's warning that a cast discards the imaginary part)
        what = "complex" if dtype.is_complex else re.escape(str(dtype))
        with pytest.raises(ValueError, match=rf"param_groups\[0\]: EVON cannot train the {what} parameter #1 of"):
            with opt.sampled_params(train=True):
                pytest.fail("the block was entered")
    assert torch.equal(a, kept[0]) and opt.sample_blocks == kept[2] and torch.equal(bad, torch.zeros_like(bad))
    assert all(torch.equal(opt.state[a][k], v) for k, v in kept[1].items())


def test_asking_for_the_posterior_of_a_tensor_evon_does_not_train_names_it() -> None:
    # a bare KeyError('parameter is not trained by EVON in this optimizer') before
    w, b = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(4))
    opt = EVON([{"params": [w]}, {"params": [b], "algorithm": "adamw"}])
    for ask in (opt.posterior_std, opt.posterior_covariance, opt.posterior_factors):
        with pytest.raises(ValueError, match=r"a tensor of shape \(4,\) is not trained by EVON"):
            ask(b)
        # a parameter's name: "'str' object has no attribute 'shape'" before
        with pytest.raises(TypeError, match=r"expected one of this optimizer's parameters, a tensor; got str '0\.weight'"):
            ask("0.weight")
    assert opt.posterior_std(w).shape == w.shape


# ------------------------------------------------- item 9: complex parameters
def test_complex_parameters_are_refused_by_name() -> None:
    z = nn.Parameter(torch.randn(3, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"complex parameter 'rotor'.*view_as_real"):
        EVON([("w", nn.Parameter(torch.randn(3, 4))), ("rotor", z)])
    opt = EVON([nn.Parameter(torch.randn(3, 4))])
    with pytest.raises(ValueError, match=r"complex parameter #0"):
        opt.add_param_group({"params": [z]})
    assert len(opt.param_groups) == 1  # the refused group is not kept
    EVON([{"params": [z], "algorithm": "adamw"}])  # AdamW handles complex tensors


# ------------------------------------------------- items 10, 11: arguments
BAD_ARGUMENTS = [
    ({"weight_decay": float("inf")}, "weight_decay", "finite"),
    ({"clip_radius": float("inf")}, "clip_radius", "finite"),  # whiten_rms scaled every entry to inf
    ({"weight_decay": 0.0}, "weight_decay", "where ess is finite"),
    ({"weight_decay": 0.0, "ess": 10.0}, "weight_decay", "where ess is finite"),
    ({"identity_basis": "false"}, "identity_basis", "bool"),
    ({"phased_gradients": "false"}, "phased_gradients", "bool"),
    ({"stagger_refresh": "false"}, "stagger_refresh", "bool"),
    ({"identity_basis": 0}, "identity_basis", "bool"),
    ({"lr": "0.1"}, "lr", "number"),
    ({"lr": float("inf")}, "lr", "finite"),
    ({"ess": None}, "ess", "number"),
    ({"ess": "100"}, "ess", "number"),
    ({"betas": 0.9}, "betas", "two numbers"),
    ({"betas": "ab"}, "betas", "two numbers"),
    ({"betas": (0.9, "0.99")}, "betas", "two numbers"),
    ({"hess_init": "0.1"}, "hess_init", "number"),
    ({"mc_samples": True}, "mc_samples", "integer"),
    ({"shampoo_beta": "0.9"}, "shampoo_beta", "number"),
    ({"hess_clip_ratio": "1.5"}, "hess_clip_ratio", "number"),
    ({"clip_radius": None}, "clip_radius", "number"),
    ({"eps": float("inf")}, "eps", "finite"),
    ({"seed": "abc"}, "seed", "integer"),
    ({"seed": 1.5}, "seed", "integer"),
    ({"seed": True}, "seed", "integer"),
    ({"adamw_lr": "0.1"}, "adamw_lr", "number"),
    ({"adamw_betas": 0.9}, "adamw_betas", "two numbers"),
    ({"adamw_weight_decay": float("inf")}, "adamw_weight_decay", "finite"),
    ({"adamw_eps": None}, "adamw_eps", "number"),
]


@pytest.mark.parametrize(
    ("kwargs", "name", "rule"), BAD_ARGUMENTS, ids=[repr(k)[1:-1] for k, _, _ in BAD_ARGUMENTS]
)
def test_bad_arguments_are_refused_by_name(kwargs: dict, name: str, rule: str) -> None:
    with pytest.raises(ValueError) as info:
        EVON([nn.Parameter(torch.randn(3, 4))], **kwargs)
    message = str(info.value)
    assert message.startswith(f"Invalid {name}: ") and rule in message, message


@pytest.mark.parametrize(
    ("group", "name"),
    [
        ({"identity_basis": "false"}, "identity_basis"),
        ({"lr": "0.1"}, "lr"),
        ({"weight_decay": math.inf}, "weight_decay"),
    ],
)
def test_a_refused_param_group_leaves_the_optimizer_as_it_was(group: dict, name: str) -> None:
    model, data = make_model(), make_data()
    opt = make_opt(model)
    before = list(opt.param_groups)
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2, 2))], **group})
    assert len(opt.param_groups) == len(before) and all(map(operator.is_, opt.param_groups, before))
    train_step(model, opt, data)  # still usable


def test_an_infinite_rate_set_mid_run_is_refused_before_the_step_changes_anything() -> None:
    """``lr = inf`` set between steps (a scheduler that blew up) was let through by the check that
    skips unchanged groups, and the step made every weight inf or NaN; the constructor refuses it."""
    model = make_model()
    opt = make_opt(model, mc_samples=1)
    data = make_data()
    for _ in range(4):
        train_step(model, opt, data)
    with opt.sampled_params(train=True):
        loss_fn(model, data).backward()
    before = snapshot(model, opt)
    for bad in (math.inf, math.nan, -1.0):
        opt.param_groups[0]["lr"] = bad
        with pytest.raises(ValueError, match=r"param_groups\[0\]: Invalid lr"):
            opt.step()
        assert_identical(snapshot(model, opt), before)
    opt.param_groups[0]["lr"] = 0.05
    opt.step()  # the retry steps
    assert all(torch.isfinite(p).all() for p in model.parameters()) and opt.skipped_steps == 0


def test_mean_weight_decay_none_set_mid_run_is_resolved_as_the_constructor_resolves_it() -> None:
    """``mean_weight_decay=None`` is the constructor's default, resolved there; set between steps it
    stayed None and pulled the mean by δ alone."""
    model = make_model()
    opt = EVON(model.parameters(), seed=0)  # the defaults: δ fitted to the curvature, the mean's pull apart
    resolved = opt.param_groups[0]["mean_weight_decay"]
    assert resolved is not None and resolved > 0
    data = make_data()
    train_step(model, opt, data)
    opt.param_groups[0]["mean_weight_decay"] = None
    train_step(model, opt, data)
    assert opt.param_groups[0]["mean_weight_decay"] == resolved


def test_numpy_hyperparameters_are_stored_as_python_numbers_for_a_weights_only_load() -> None:
    """The optimizer accepts NumPy numbers; stored as they came, its state dict needed NumPy's
    unpickler (``torch.load(weights_only=True)`` refused it), also for a rate set mid-run."""
    import io

    np = pytest.importorskip("numpy")
    model = make_model()
    opt = make_opt(model, lr=np.float64(0.05), betas=(np.float32(0.5), np.float64(0.99)), mc_samples=np.int64(1))
    data = make_data()
    train_step(model, opt, data)
    opt.param_groups[0]["lr"] = np.float64(0.025)
    opt.param_groups[1]["weight_decay"] = np.float32(0.5)
    train_step(model, opt, data)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    groups = torch.load(buffer, weights_only=True)["param_groups"]
    assert (groups[0]["lr"], groups[0]["betas"], groups[0]["mc_samples"]) == (0.025, (0.5, 0.99), 1)
    assert type(groups[0]["lr"]) is float and type(groups[0]["mc_samples"]) is int
    assert groups[1]["weight_decay"] == 0.5 and type(groups[1]["weight_decay"]) is float


def test_a_numpy_rate_a_scheduler_set_after_the_last_step_is_saved_as_a_python_number() -> None:
    """A LambdaLR of NumPy maths sets a NumPy rate after each step(); a checkpoint saved then (the usual
    place: step, scheduler step, save) needed NumPy's unpickler. The live group keeps what was set."""
    import io

    np = pytest.importorskip("numpy")
    model, data = make_model(), make_data()
    opt = make_opt(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 * (1 + np.cos(np.pi * e / 10)))
    train_step(model, opt, data)
    schedule.step()
    assert type(opt.param_groups[0]["lr"]) is np.float64
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    groups = torch.load(buffer, weights_only=True)["param_groups"]
    assert [type(g["lr"]) for g in groups] == [float, float]
    assert [g["lr"] for g in groups] == [float(g["lr"]) for g in opt.param_groups]
    assert type(opt.param_groups[0]["lr"]) is np.float64


def test_a_skipped_steps_warning_points_at_the_callers_line() -> None:
    """The warning that a non-finite gradient skipped the step names the line that called
    ``step()`` (before: a line inside evon.py, which warning filters by module then missed)."""
    model = make_model()
    opt = make_opt(model, mc_samples=1)
    with opt.sampled_params(train=True):
        (loss_fn(model, make_data()) * math.nan).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, caught[0].lineno)]
    assert "opt.step()" in open(__file__).read().splitlines()[caught[0].lineno - 1]


def test_a_groups_own_lr_none_takes_its_own_clips_default_rate() -> None:
    """``lr=None`` is the constructor's "clip's default α"; in a group it was refused ("Invalid lr:
    None"). A group's own None now takes its own clip's α; a group without ``lr`` takes the
    constructor's, as torch's optimizers fill a group's missing keys."""
    a, b, c = (nn.Parameter(torch.randn(4, 4)) for _ in range(3))
    opt = EVON([{"params": [a], "clip": "element", "lr": None}, {"params": [b], "clip": "element"}, {"params": [c]}])
    assert [g["lr"] for g in opt.param_groups] == [
        lr_from_adamw_lr(1e-3, 0.01, clip="element"), lr_from_adamw_lr(1e-3, 0.01, clip="whiten_rms"),
        lr_from_adamw_lr(1e-3, 0.01, clip="whiten_rms"),
    ]  # fmt: skip
    assert opt.param_groups[0]["lr"] == pytest.approx(0.04) and opt.param_groups[1]["lr"] == pytest.approx(0.16)
    with pytest.raises(ValueError, match="clip_radius"):
        EVON([{"params": [a], "lr": None, "clip_radius": -1.0}])


def test_numpy_numbers_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    w = nn.Parameter(torch.randn(3, 4))
    opt = EVON(
        [w], lr=np.float32(0.1), ess=np.float64(100.0), betas=(np.float64(0.9), 0.99), seed=np.int64(3)
    )
    assert opt.seed == 3
    for _ in range(3):
        with opt.sampled_params(train=True):
            w.square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(w).all() and int(opt.state[w]["step"]) == 2


# ------------------------------------------------- item 13: channels_last convolution kernels
def test_channels_last_conv_weights_train_like_contiguous_ones() -> None:
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(4, 3, 3, 3, generator=gen)
    target = torch.randn(4, 3, 3, 3, generator=gen)
    runs = []
    for layout in (torch.contiguous_format, torch.channels_last):
        w = nn.Parameter(init.clone().to(memory_format=layout))
        assert w.is_contiguous(memory_format=layout)
        opt = EVON([w], ess=100.0, seed=0, lr=0.05)
        for _ in range(4):
            with opt.sampled_params(train=True):
                assert not torch.equal(w, init)  # a sample is in the weight
                ((w - target).square() * (1 + w.square())).sum().backward()  # elementwise: layout-free
            opt.step()
            opt.zero_grad()
        assert w.is_contiguous(memory_format=layout)  # the layout is kept
        runs.append(w.detach().contiguous())
    assert torch.equal(runs[1], runs[0])
    assert not torch.equal(runs[0], init)


def test_channels_last_conv_model_runs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(8, 3, 6, 6).to(memory_format=torch.channels_last)
    y = torch.randint(0, 2, (8,))
    opt = EVON(model.parameters(), ess=100.0, seed=0)
    first = model[0].weight.detach().clone()
    for _ in range(3):
        with opt.sampled_params(train=True):
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(model[0].weight).all() and not torch.equal(model[0].weight, first)


# ------------------------------------------------- issue 33 item 12: interrupts anywhere
def test_an_interrupt_at_any_line_of_a_step_leaves_the_mean_and_a_usable_optimizer() -> None:
    """A KeyboardInterrupt raised at the start of every fourth line hf_evon runs in a training step
    (two sampled blocks, then ``step()``; a tracer stands in for Ctrl-C): the weights hold no
    sample and stay finite, grad mode is on again, the optimizer is not left "in a sample" and
    trains on. Interrupts at the outer clean-up's own two statements are not counted: that
    clean-up is what handles every other point (real signals arrive at calls and loops, not there)."""
    import sys
    import traceback

    uncounted = ("if not exited:", "self._in_sample = False")
    data = make_data()
    failures, fired = [], 0
    n = 1
    while True:
        model = make_model()
        opt = make_opt(model)
        for _ in range(3):
            train_step(model, opt, data)
        count = [0]

        def tracer(frame, event, arg, n=n, count=count):  # noqa: ANN001, ANN202
            if "hf_evon" in frame.f_code.co_filename and event == "line":
                count[0] += 1
                if count[0] == n:
                    raise KeyboardInterrupt
            return tracer

        sys.settrace(tracer)
        try:
            train_step(model, opt, data)
        except KeyboardInterrupt:
            where = traceback.extract_tb(sys.exc_info()[2])[-2].line or ""
        else:
            where = None
        finally:
            sys.settrace(None)
        if count[0] < n:  # the step ran fewer lines than n: every line has been tried
            break
        n += 4
        if where is None or where.strip().startswith(uncounted):
            continue
        fired += 1
        problems = [
            name
            for name, bad in (
                ("in a sample", opt._in_sample),
                ("a sample in the weights", any(b.mean is not None for b in opt.buckets)),
                ("non-finite weights", not all(torch.isfinite(p).all() for p in model.parameters())),
                ("grad mode off", not torch.is_grad_enabled()),
                ("weights still claimed as a sample's", bool(held_samples._HELD)),
            )
            if bad
        ]
        torch.set_grad_enabled(True)
        try:
            opt.zero_grad()
            train_step(model, opt, data)
        except Exception as err:  # noqa: BLE001 - recorded: the test names it
            problems.append(f"unusable: {err}")
        if problems:
            failures.append((n - 4, where.strip(), problems))
    assert fired > 100  # the tracer reached the step's lines
    assert not failures, failures[:5]


# ------------------------------------------------- a model cast or moved after the optimizer stepped
def _mlp_step(model: nn.Module, opt: EVON, x: torch.Tensor) -> None:
    for _ in range(opt.mc_samples):
        with opt.sampled_params(train=True):
            hidden = model[1](model[0](x.to(model[0].weight.dtype)))  # each layer in its own dtype
            model[2](hidden.to(model[2].weight.dtype)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("cast", ["all", "first_layer"])
def test_a_model_cast_after_a_step_is_refused_by_name_before_any_weight_moves(cast: str) -> None:
    """``model.to(torch.bfloat16)`` after a step (build_optimizer: the matrices EVON's, the biases
    AdamW's): the EVON group stepped, then torch's fused AdamW kernel raised "expected scalar type
    BFloat16 but found Float" (its state float32), the step half applied. The step is refused before
    any group steps, naming the parameter; no weight moves and the optimizer trains on once cast back."""
    from hf_evon import build_optimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = build_optimizer(model)
    x = torch.randn(5, 4)
    _mlp_step(model, opt, x)
    (model if cast == "all" else model[0]).to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"0\.bias .*torch\.bfloat16.*'exp_avg' is torch\.float32"):
        _mlp_step(model, opt, x)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert opt.recorded_samples == 0
    model.float()
    opt.zero_grad()
    _mlp_step(model, opt, x)
    assert not any(torch.equal(p.float(), before[n].float()) for n, p in model.named_parameters())


@pytest.mark.parametrize(
    ("name", "key"), [("2.weight", "hess"), ("2.bias", "exp_avg"), ("2.bias", "exp_avg_sq"), ("2.bias", "step")]
)
def test_every_state_entry_out_of_place_is_named_by_the_moved_params_check(name: str, key: str) -> None:
    """Each entry the check compares (an EVON weight's device against its bucket's state, an AdamW
    parameter's dtype and device against exp_avg and exp_avg_sq, its step count's device against
    where its kernel reads it) is named when only it is out of place; in place, nothing is refused."""
    from hf_evon import build_optimizer
    from hf_evon.optim.update import adamw_inputs, moved_refusal

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = build_optimizer(model)
    x = torch.randn(5, 4)
    _mlp_step(model, opt, x)
    model(x).square().mean().backward()

    def check() -> str | None:
        return moved_refusal(opt.buckets, adamw_inputs(opt.param_groups, opt.state, opt._hooks, 1), opt._param_label)

    assert check() is None
    p = dict(model.named_parameters())[name]
    if key == "hess":  # the weight's device against its bucket's: a meta state stands in for a moved weight
        (bucket,) = (b for b in opt.buckets if any(q is p for q in b.params))
        bucket.state["hess"] = bucket.state["hess"].to("meta")
    elif key == "step":
        opt.state[p]["step"] = opt.state[p]["step"].to("meta")
    else:
        opt.state[p][key] = opt.state[p][key].double()
    assert re.match(rf"EVON.step: parameter {name} .*is torch\.float32 on cpu, but its state '{key}' is ", check())


@pytest.mark.parametrize(("start", "cast"), [(torch.float32, torch.float64), (torch.float64, torch.float32)])
def test_an_all_evon_model_cast_between_float32_and_float64_is_refused_until_its_state_is_reloaded(start, cast) -> None:
    """A bias-free MLP, every weight EVON's (no AdamW state to notice the cast), cast after three steps:
    the step went on with state of the old dtype (float32 state for float64 weights, 2.4e-3 from the
    run the documented reload gives after 17 steps). It is refused, naming the weight and the state, and
    after ``load_state_dict(state_dict())`` the state is the new dtype's and the step runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Tanh(), nn.Linear(8, 3, bias=False)).to(start)
    opt = EVON(model.parameters(), seed=1)
    x = torch.randn(6, 4)
    for _ in range(3):
        _mlp_step(model, opt, x.to(start))
    model.to(cast)
    kept = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=rf"parameter .* \(shape \(8, 4\)\) is {cast} on cpu, but its state 'hess' is {start} on cpu"):
        _mlp_step(model, opt, x.to(cast))
    assert all(torch.equal(p, k) for p, k in zip(model.parameters(), kept, strict=True))
    opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    _mlp_step(model, opt, x.to(cast))
    assert opt.state[model[0].weight]["hess"].dtype == cast
    assert not torch.equal(model[0].weight, kept[0])


def test_an_optimizer_dropped_after_a_block_without_its_step_is_collected_and_guards_nothing() -> None:
    """A run that ends between a block's exit and the step (interrupted, or ending mid-accumulation)
    left the late-gradient guard holding the optimizer's param_groups and bound discard_samples in a
    module-level registry: after ``del opt, w; gc.collect()`` both stayed alive for the rest of the
    process (each run of a sweep or notebook kept its weights), and a plain backward through a weight
    still in use, once its optimizer was dropped, was refused in the dropped optimizer's name."""
    import gc
    import weakref

    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))

    def ended_after_a_block(w: nn.Parameter) -> EVON:
        opt = EVON([{"params": [w], "param_names": ["w"]}], seed=0)
        with opt.sampled_params(train=True):
            (x @ w.T).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with opt.sampled_params(train=True):  # the run ends here, before its step
            (x @ w.T).square().mean().backward()
        return opt

    w = nn.Parameter(torch.randn(3, 4))
    opt = ended_after_a_block(w)
    dead_opt, dead_w = weakref.ref(opt), weakref.ref(w)
    del opt, w
    gc.collect()
    assert dead_opt() is None and dead_w() is None

    w = nn.Parameter(torch.randn(3, 4))
    dead_opt = weakref.ref(ended_after_a_block(w))
    gc.collect()
    assert dead_opt() is None
    w.grad = None
    (x @ w.T).square().mean().backward()  # the weight is trained on without EVON: nothing to refuse
    (expected,) = torch.autograd.grad((x @ w.T).square().mean(), w)
    assert torch.equal(w.grad, expected)
    assert len(w._post_accumulate_grad_hooks) == 1


def test_a_float16_adamw_parameters_squared_gradient_overflow_skips_the_step() -> None:
    """A float16 parameter in an AdamW group keeps its moments in float16: a gradient of 1e4 (finite in
    float16, its square too in the float32 check) made β2·v + (1−β2)·g² = 1e5 > 65504, so exp_avg_sq
    went inf without a skip or a warning, and the parameter never moved again. The step is skipped,
    named, with everything as it was, and the next steps move the parameter."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 8).half())
    b = nn.Parameter(torch.zeros(4).half())
    opt = EVON([{"params": [w]}, {"params": [b], "algorithm": "adamw"}], seed=0)
    x = torch.randn(16, 8).half()

    def step(spike: float | None = None) -> None:
        with opt.sampled_params(train=True):
            (x @ w.T + b).float().square().mean().backward()
            if spike is not None:
                b.grad.fill_(spike)
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    before = {k: v.clone() for k, v in opt.state[b].items()}
    with pytest.warns(RuntimeWarning, match=r"overflow in AdamW's squared gradient of .*kept in float16"):
        step(spike=1e4)
    assert opt.skipped_steps == 1
    assert all(torch.equal(opt.state[b][k], v) for k, v in before.items())
    moved = b.detach().clone()
    for _ in range(5):
        step()
    assert torch.isfinite(opt.state[b]["exp_avg_sq"]).all() and not torch.equal(b.detach(), moved)


def test_float16_weights_whose_norm_overflows_float16_keep_a_positive_fitted_ess() -> None:
    """The curvature fit took the weights' norms in their own dtype: float16 weights of norm 7.7e4
    (every entry finite) gave Σ W² = inf and ζ = 0, and every later step was refused ("Invalid ess:
    0.0"), posterior_health raising ZeroDivisionError. The norms are taken in float32: ζ stays finite
    and positive, the steps go on, and posterior_health reports a finite noise-to-signal."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 256, bias=False).half()
    with torch.no_grad():
        lin.weight.normal_(0, 300.0)
    assert torch.isinf(lin.weight.norm()) and torch.isfinite(lin.weight.float().norm())
    opt = EVON(lin.parameters(), seed=0)
    x = torch.randn(8, 256).half()
    for _ in range(5):
        with opt.sampled_params(train=True):
            (lin(x).float().square().mean() * 1e-6).backward()
        opt.step()
        opt.zero_grad()
        ess = opt.param_groups[0]["ess"]
        assert math.isfinite(ess) and ess > 0
    stats = opt.posterior_health(warn=False)
    assert math.isfinite(stats["noise_to_signal_max"]) and stats["noise_to_signal_max"] > 0


def test_the_health_check_sums_the_widest_priors_variances_without_overflow() -> None:
    """ζδ at the validation's bound (just above float32's smallest): each variance 1/(ζ(H + δ)) is a
    float32, but their float32 sum overflowed, and posterior_health reported a noise-to-signal of inf
    (its warning: "std is infx")."""
    tiny = torch.finfo(torch.float32).tiny
    lin = nn.Linear(64, 64, bias=False)
    opt = EVON([lin.weight], ess=tiny / 1e-8 * 1.0001, weight_decay=1e-8, hess_init=1e-30)
    var = 1.0 / (opt.param_groups[0]["ess"] * (1e-30 + 1e-8))
    assert var < torch.finfo(torch.float32).max < 64 * 64 * var  # finite entries, a sum float32 cannot hold
    stats = opt.posterior_health(warn=False)
    expected = math.sqrt(64 * 64 * var / float(lin.weight.double().square().sum()))
    assert stats["noise_to_signal"] == pytest.approx(expected, rel=1e-5)


def test_hyperparameters_float32_cannot_hold_are_refused_by_name() -> None:
    """ess = weight_decay = 1e-200 made ζ·δ underflow to 0 (posterior_health divided by it:
    ZeroDivisionError); ess = 1e-300 drew infinite noise, and every step was skipped as a "non-finite
    gradient"; lr = 1e300 or hess_init = 1e300 raised "value cannot be converted to type float without
    overflow" inside the first step, naming nothing. Each is refused at construction, by name."""
    w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    largest = r"at most float32's largest, 3\.4e\+38"
    normal = r"outside float32's normal range \(1\.18e-38 to 3\.4e\+38\)"
    for kwargs, message in (
        ({"ess": 1e-200, "weight_decay": 1e-200}, r"Invalid ess: 1e-200 \(must be a number whose product with weight_decay \(1e-200\), the prior's precision, is at least 1\.18e-38\)"),
        ({"ess": 1e-300}, r"Invalid ess: 1e-300 \(must be a number whose product with weight_decay \(0\.000416667\)"),
        ({"lr": 1e300}, rf"Invalid lr: 1e\+300 \(must be a finite number >= 0 \({largest}\)"),
        ({"weight_decay": 1e300}, rf"Invalid weight_decay: 1e\+300 \(must be a finite number >= 0 \({largest}\)\)"),
        ({"hess_init": 1e300}, rf"weight_decay=None makes the prior's weight_decay 4\.16667e\+298 of hess_init=1e\+300 and init_std_ratio=0\.05, {normal}"),
        ({"init_std_ratio": 1e-300}, rf"weight_decay=None makes the prior's weight_decay 0 of hess_init=0\.01 and init_std_ratio=1e-300, {normal}"),
        ({"mean_weight_decay": 1e300}, rf"Invalid mean_weight_decay: 1e\+300 \(must be None or a finite number >= 0 \({largest}\)"),
        ({"clip_radius": 1e-300}, rf"lr=None makes the default lr \S+e\+29\d of clip_radius=1e-300, not {largest}: pass lr"),
        ({"clip_radius": 1e300}, rf"Invalid clip_radius: 1e\+300 \(must be a finite number > 0 \({largest}\)"),
    ):
        with pytest.raises(ValueError, match=message):
            EVON([w], seed=0, **kwargs)
    opt = EVON([w], ess=1e-20, weight_decay=2e-18, seed=0)  # ζ·δ = 2e-38: float32 holds it, and 1/(ζ·δ)
    with opt.sampled_params(train=True):
        w.square().sum().backward()
    opt.step()
    assert isinstance(opt.posterior_health(warn=False), dict) and torch.isfinite(w).all()


@pytest.mark.parametrize("value", [2.0, "2", 0])
def test_an_invalid_mc_samples_edit_is_named_where_the_loop_reads_it(value) -> None:
    """``param_groups[0]["mc_samples"] = 2.0`` between steps: ``step(closure)`` and the documented loop
    ``range(optimizer.mc_samples)`` raised Python's "'float' object cannot be interpreted as an
    integer", naming nothing. Reading it names the group and the field; the optimizer is unchanged."""
    w = nn.Parameter(torch.randn(3, 3))
    opt = EVON([w], seed=0)
    opt.param_groups[0]["mc_samples"] = value
    with pytest.raises(ValueError, match=r"param_groups\[0\]: Invalid mc_samples: .* \(must be an integer >= 1\)"):
        opt.mc_samples  # noqa: B018
    with pytest.raises(ValueError, match=r"Invalid mc_samples"):
        opt.step(lambda: w.square().sum().backward())
    assert opt.state[w] == {} and opt.sample_blocks == 0


@pytest.mark.parametrize(
    "extra, said",
    [
        ({"params": [nn.Parameter(torch.zeros(5, 5)), torch.zeros(5, 5, dtype=torch.long)], "param_names": ["a"]}, "param_names"),
        ({"params": [nn.Parameter(torch.zeros(5, 5))], "param_names": 5}, "param_names"),
        ({"params": [nn.Parameter(torch.zeros(5, 5))], "param_names": ["a", "b"]}, "param_names"),
        ({"params": [nn.Parameter(torch.zeros(5, 5))], "param_names": ["w"], "fit_to_curvature": 5}, "fit_to_curvature"),
        ({"params": [nn.Parameter(torch.zeros(5, 5))], "param_names": ["w"], "fit_to_curvature": ("bogus",)}, "fit_to_curvature"),
    ],
)
def test_a_refused_added_group_leaves_the_optimizer_as_it_was(extra, said) -> None:
    """``add_param_group`` undid a refused group on a ValueError only: a short ``param_names`` (IndexError)
    or a ``fit_to_curvature`` of 5 (TypeError) left the group in place, and every later block and step
    raised. Names that do not fit the parameters were taken, and the optimizer's own state dict then did
    not load. Each is a ValueError naming the key, the optimizer unchanged and training on as a fresh one."""
    from hf_evon import build_optimizer

    data = make_data()
    model, reference = make_model(), make_model()
    opt, ref_opt = build_optimizer(model, seed=0), build_optimizer(reference, seed=0)  # groups with names
    with pytest.raises(ValueError, match=rf"Invalid {said}: "):
        opt.add_param_group(extra)
    assert len(opt.param_groups) == len(ref_opt.param_groups)
    for _ in range(2):
        train_step(model, opt, data)
        train_step(reference, ref_opt, data)
    assert_identical(snapshot(model, opt), snapshot(reference, ref_opt))
    opt.load_state_dict(opt.state_dict())


def test_a_fit_to_curvature_edited_between_steps_is_named_before_the_step_changes_anything() -> None:
    """``param_groups[0]["fit_to_curvature"] = 5`` set between steps raised Python's "'int' object is not
    iterable" from the step's check, naming neither the group nor the key."""
    model = make_model()
    opt = make_opt(model)
    train_step(model, opt, make_data())
    before = snapshot(model, opt)
    opt.param_groups[0]["fit_to_curvature"] = 5
    with pytest.raises(ValueError, match=r"^param_groups\[0\]: Invalid fit_to_curvature: 5 "):
        train_step(model, opt, make_data())
    opt.zero_grad()
    assert_identical(snapshot(model, opt), before)


@pytest.mark.parametrize("value", ["abc", float("nan"), [1, 2], -3.0])
def test_a_state_dicts_configured_rate_is_checked_as_the_rate_is(value) -> None:
    """``configured_lr`` (the rate the posterior records as its ``lr``) was loaded as it came: "abc" or a
    list failed at the posterior's save, naming nothing; -3.0 was saved as the posterior's rate."""
    data = make_data()
    model = make_model()
    opt = make_opt(model)
    train_step(model, opt, data)
    saved = opt.state_dict()
    state = copy.deepcopy(saved)
    state["param_groups"][0]["configured_lr"] = value
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: Invalid configured_lr: "):
        opt.load_state_dict(state)
    assert_identical(snapshot(model, opt), before)
    assert opt.param_groups[0]["configured_lr"] == saved["param_groups"][0]["configured_lr"]


def test_a_state_dicts_basis_of_another_rank_is_named_by_its_shape() -> None:
    """A flattened ``Q_L`` met the orthonormality check first: torch's "tensor.mT is only supported on
    matrices", naming no key. The shape check names it."""
    model = make_model()
    opt = make_opt(model, precondition_frequency=1)
    train_step(model, opt, make_data())
    state = copy.deepcopy(opt.state_dict())
    index = next(i for i, entry in state["state"].items() if "Q_L" in entry and entry["Q_L"].numel())
    state["state"][index]["Q_L"] = state["state"][index]["Q_L"].flatten()
    with pytest.raises(ValueError, match=rf"state\[{index}\]\['Q_L'\] has shape \(\d+,\)"):
        opt.load_state_dict(state)


def test_flags_and_sizes_given_as_other_types_are_refused_by_name() -> None:
    """``discard_samples(rewind="no")`` rewound, a posterior's ``draw(rotated="no")`` drew rotated (a string
    reads as True); ``max_elements="x"`` raised Python's comparison error; a sparse parameter was taken and
    failed in torch's norm at its first block."""
    model = make_model()
    opt = make_opt(model)
    with pytest.raises(TypeError, match="discard_samples: rewind must be True or False; got 'no'"):
        opt.discard_samples(rewind="no")
    weight = model[0].weight
    for bad in ("x", -1, float("nan")):
        with pytest.raises(ValueError, match=rf"posterior_covariance\(\): max_elements must be a number >= 0 \(inf: no limit\); got {re.escape(repr(bad))}"):
            opt.posterior_covariance(weight, max_elements=bad)
    for bound in (1e6, math.inf):  # a float bound, and no bound
        assert opt.posterior_covariance(weight, max_elements=bound).shape == (weight.numel(), weight.numel())
    train_step(model, opt, make_data())
    posterior = EVONPosterior.from_optimizer(opt, model)
    with pytest.raises(TypeError, match="draw: rotated must be True or False; got 'no'"):
        posterior.draw(1, seed=0, rotated="no")
    with pytest.raises(ValueError, match=r"covariance\(\): max_elements must be a number >= 0 \(inf: no limit\); got 'x'"):
        posterior.covariance(posterior.names[0], max_elements="x")
    with pytest.raises(ValueError, match="to: a posterior cannot move to the meta device"):
        posterior.to("meta")
    with pytest.raises(ValueError, match=r"EVON cannot train the torch.sparse_coo parameter #0 of its group: it needs dense weights"):
        EVON([nn.Parameter(torch.eye(3).to_sparse())])
