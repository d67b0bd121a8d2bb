"""The counting benchmark (``benchmarks/optimizer_flops.py``) runs, and its aten-op count per
step does not grow with the number of equal blocks (a property, not a timing)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import ScalarReads

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
optimizer_flops = pytest.importorskip("optimizer_flops")

F64 = torch.float64
HP = dict(
    lr=0.1,
    ess=40.0,
    hess_init=0.5,
    betas=(0.8, 0.9),
    weight_decay=0.05,
    precondition_frequency=3,
    hess_clip_ratio=None,
    clip="none",
)


def test_op_count_does_not_grow_with_equal_blocks() -> None:
    """One block vs three (same four shapes): the same aten ops per step with the spec's refresh
    schedule, since equal shapes share a bucket; the naive per-matrix reference triples."""
    one = optimizer_flops.count("hf-evon-spec", optimizer_flops.block_shapes(8, 1))
    three = optimizer_flops.count("hf-evon-spec", optimizer_flops.block_shapes(8, 3))
    assert one["ops"] == three["ops"] > 0
    naive_one = optimizer_flops.count("naive", optimizer_flops.block_shapes(8, 1))
    naive_three = optimizer_flops.count("naive", optimizer_flops.block_shapes(8, 3))
    assert naive_three["ops"] == 3 * naive_one["ops"]
    assert naive_three["gflop"] == pytest.approx(3 * naive_one["gflop"])


def test_a_float16_models_step_does_not_grow_with_its_adamw_tensors() -> None:
    """A float16 model's AdamW tensors (its biases) were checked for a float16 second moment one by one:
    11 aten ops per tensor and step (644 ops at 50 layers, 2294 at 200). The check is multi-tensor:
    the same ops per steady step at 4 layers and at 40."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_evon import build_optimizer

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.count += 1
            return func(*args, **(kwargs or {}))

    def steady_step_ops(layers: int) -> int:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)]).half()
        opt = build_optimizer(model, precondition_frequency=1000)
        x = torch.randn(8, 4, dtype=torch.half)
        counts = []
        for _ in range(4):
            with opt.sampled_params(train=True):
                model(x).float().square().mean().backward()
            with Ops() as ops:
                opt.step()
            opt.zero_grad()
            counts.append(ops.count)
        return counts[-1]

    assert steady_step_ops(4) == steady_step_ops(40)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
def test_a_step_reads_no_scalar_back_from_a_tensor(device: str) -> None:
    """Issue 32: a step's only host sync is the finite check (one ``tolist``): between the curvature
    fits and health checks, no ``.item()`` (``aten._local_scalar_dense``) in ``step()`` or in the
    sampled block, for matrices of three shapes (three buckets) under the default estimator, with
    their biases in an AdamW group (torch's multi-tensor Adam reads each step count twice). On
    CUDA too (skipped without it; ``benchmarks/gpu.sh`` runs it there)."""
    from hf_evon import EVON

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(m, n).to(device) / n**0.5) for m, n in ((6, 4), (5, 6), (3, 5))]
    biases = [torch.nn.Parameter(torch.zeros(m, device=device)) for m in (6, 5, 3)]
    opt = EVON([{"params": weights}, {"params": biases, "algorithm": "adamw"}], seed=0)
    x = torch.randn(8, 4).to(device)

    def train_step() -> None:
        with opt.sampled_params(train=True):
            h = x
            for w, b in zip(weights, biases):
                h = torch.tanh(h @ w.mT + b)
            h.square().sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # the initialising step and the first curvature fit
        train_step()
    with ScalarReads() as reads:
        for _ in range(12):  # across a refresh (every 10 updates), before the next fit (50)
            train_step()
    assert reads.count == 0
    assert all(opt.state[b]["step"].item() == 15 for b in biases)  # AdamW trained them


@pytest.mark.parametrize("shape", [(5, 9), (9, 5), (300, 800)])
def test_the_naive_whitening_is_evons_whiten_rms_clip(shape: tuple[int, int]) -> None:
    """The timed peer's whitening computes EVON's ``clip="whiten_rms"`` (float64; the large shape
    takes EVON's eigh route on a CPU), so the two are timed doing the same maths."""
    from hf_evon.optim import linalg

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    naive = optimizer_flops.naive_whiten(x) * (0.01 * max(shape) ** 0.5)
    torch.testing.assert_close(naive, linalg.clip_update(x, "whiten_rms", 0.01), rtol=0, atol=1e-12)
    assert optimizer_flops.naive_peer("hf-evon-whiten") == "naive-whiten"
    assert optimizer_flops.clip_of("naive-whiten") == "whiten_rms"


def test_a_steady_per_matrix_step_multiplies_only_what_the_maths_needs() -> None:
    """Between refreshes, a default step (Fisher H, the per-matrix step) of an m×n matrix with both
    bases makes three pairs of products and no more: the sample Q_L E Q_Rᵀ, the gradient's rotation
    Q_Lᵀ G Q_R (for H) and the statistics G Gᵀ, Gᵀ G, 3 · 2mn(m + n) FLOPs. The momentum lives in
    the weights' space, so nothing rotates it back (a fourth pair)."""
    from hf_evon import EVON

    m, n = 12, 20
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(m, n) / n**0.5)
    opt = EVON([w], seed=0, clip="element", precondition_frequency=1000, stagger_refresh=False)
    x = torch.randn(16, n)

    def train_step() -> None:
        with opt.sampled_params(train=True):
            torch.tanh(x @ w.mT).square().sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # the initialising step and the first curvature fit
        train_step()
    # count the sampled block's entry and exit and the step, not the model's forward and backward
    steps, total = 4, 0
    for _ in range(steps):
        with optimizer_flops.flop_counter() as fc:
            block = opt.sampled_params(train=True)
            block.__enter__()
        total += fc.get_total_flops()
        torch.tanh(x @ w.mT).square().sum().backward()
        with optimizer_flops.flop_counter() as fc:
            block.__exit__(None, None, None)
            opt.step()
            opt.zero_grad()
        total += fc.get_total_flops()
    assert total == steps * 3 * 2 * m * n * (m + n)


def _three_buckets_trained() -> dict[str, torch.Tensor]:
    """Every state tensor of EVON over three buckets (6×5, 5×6, 6×6), refreshed all at once every 3
    updates, after the initialising step and two refresh cycles."""
    from hf_evon import EVON

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(*shape) / 6**0.5) for shape in ((6, 5), (5, 6), (6, 6))]
    opt = EVON(weights, seed=0, precondition_frequency=3, stagger_refresh=False)
    x = torch.randn(8, 6)
    for _ in range(7):
        with opt.sampled_params(train=True):
            loss = torch.tanh(x[:, :5] @ weights[0].mT).square().sum()
            loss = loss + torch.tanh(x @ weights[1].mT).square().sum() + torch.tanh(x @ weights[2]).sum()
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {f"{i}.{k}": v.clone() for i, w in enumerate(weights) for k, v in opt.state[w].items()}


def test_a_steps_refreshes_share_one_qr_call_per_side_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """On accelerators one QR call on a few members costs less than one per member (its batched
    products and solves), so a step hands the due sides of all buckets with one side size to one
    call. Three buckets (6×5, 5×6, 6×6) refreshed at once make two calls (sizes 6 and 5), not six,
    and every state tensor equals that of one call per side, bit for bit (on this CPU, with the
    accelerators' CholeskyQR path forced)."""
    from hf_evon.optim import functional, linalg

    calls = []
    real_power_qr, real_many = linalg.power_qr, linalg.power_qr_many

    def counting_power_qr(stat, q, householder=None):  # noqa: ANN001, ANN202
        calls.append(stat.shape[-1])
        return real_power_qr(stat, q, householder=householder)

    def run(grouped: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
        monkeypatch.setattr(
            functional, "power_qr_many", lambda pairs: real_many(pairs, grouped=grouped, householder=False)
        )
        calls.clear()
        state = _three_buckets_trained()
        return state, list(calls)

    monkeypatch.setattr(linalg, "power_qr", counting_power_qr)
    grouped, grouped_calls = run(True)
    alone, alone_calls = run(False)
    assert sorted(grouped_calls) == [5, 5, 6, 6]  # two refresh steps, one call per side size each
    assert sorted(alone_calls) == [5] * 4 + [6] * 8  # one per bucket and side
    assert grouped.keys() == alone.keys()
    for key in grouped:
        assert torch.equal(grouped[key], alone[key]), key


def test_a_steps_refreshes_hold_the_state_of_a_bounded_run_of_buckets_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's due refreshes are gathered, refreshed and written back in runs of at most
    ``REFRESH_CALL_ENTRIES`` statistics' entries (a bucket over it alone), as a grouped QR call
    takes. Before, a step gathered every due bucket's stacks and held every new basis and moved
    momentum until the last was made: on a refresh step without stagger, a new Q_L, Q_R and momentum
    of every matrix at once (here one run of all three buckets, 61 + 61 + 72 entries over a bound of
    122). The state equals that of one run of all of them, bit for bit."""
    from hf_evon.optim import linalg, update

    runs = []
    real_refresh = update.refresh_buckets

    def recording(due):  # noqa: ANN001, ANN202
        runs.append([(b.m, b.n, members) for b, members in due])
        return real_refresh(due)

    def run(bound: int) -> dict[str, torch.Tensor]:
        monkeypatch.setattr(linalg, "REFRESH_CALL_ENTRIES", bound)
        runs.clear()
        return _three_buckets_trained()

    monkeypatch.setattr(update, "refresh_buckets", recording)
    bounded = run(36 + 25 + 25 + 36)  # the 6×5 and 5×6 matrices' statistics
    assert runs == [[(6, 5, None), (5, 6, None)], [(6, 6, None)]] * 2  # two refresh steps
    whole = run(1 << 27)
    assert runs == [[(6, 5, None), (5, 6, None), (6, 6, None)]] * 2
    assert bounded.keys() == whole.keys()
    for key in bounded:
        assert torch.equal(bounded[key], whole[key]), key


def test_a_staggered_refresh_builds_each_phases_index_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32: the members a staggered refresh takes are indexed by a tensor on the state's device,
    built once per member list: building it from a Python list is a host-to-device copy, which
    on a GPU waits for every queued kernel (a sync per bucket and step). Over the refresh cycles
    after the first, no index tensor is built, and each refresh still gives the members their
    own phases (the bases of members due at different steps change at different steps)."""
    from hf_evon import EVON
    from hf_evon.optim import buckets

    built = []
    real_tensor = torch.tensor

    def counting_tensor(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if sys._getframe(1).f_globals.get("__name__") == buckets.__name__:
            built.append(args[0])
        return real_tensor(*args, **kwargs)

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(6, 5) / 5**0.5) for _ in range(4)]  # one bucket of 4
    opt = EVON(weights, seed=0, precondition_frequency=3, stagger_refresh=True)
    x = torch.randn(8, 5)

    def train_step() -> None:
        with opt.sampled_params(train=True):
            sum(torch.tanh(x @ w.mT).square().sum() for w in weights).backward()
        opt.step()
        opt.zero_grad()

    monkeypatch.setattr(torch, "tensor", counting_tensor)
    for _ in range(4):  # the initialising step and a first cycle of 3 updates
        train_step()
    first_cycle = list(built)
    (bucket,) = opt._buckets
    assert len(set(bucket.refresh_phase)) == 3  # four members over three phases
    assert first_cycle  # partial refreshes did index their members
    changed = []
    for _ in range(6):  # two more cycles
        before = bucket.state["Q_L"].clone()
        train_step()
        changed.append(tuple((bucket.state["Q_L"] != before).flatten(1).any(1).tolist()))
    assert built == first_cycle
    assert len(set(changed[:3])) == 3 and changed[3:] == changed[:3]


def test_a_refresh_cycle_longer_than_any_run_spreads_its_members_as_a_short_one():
    """``precondition_frequency=10**12`` (a natural "never refresh") made the first step build a list of
    10**12 phase loads: MemoryError, no argument named. Past the members' count, more phases change
    nothing: the phases are those of any cycle at least that long."""
    from hf_evon import EVON

    def phases(frequency: int) -> list[list[int]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Linear(6, 7), torch.nn.Linear(7, 3))
        opt = EVON(model.parameters(), seed=0, precondition_frequency=frequency, stagger_refresh=True)
        with opt.sampled_params(train=True):
            model(torch.randn(4, 5)).square().sum().backward()
        opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        return [b.refresh_phase for b in opt._buckets]

    cycle = phases(6)  # six members: the three matrices in phases of their own, the biases (no QR) in one
    assert sorted(p for bucket in cycle for p in bucket) == [0, 1, 2, 3, 3, 3]
    assert phases(10**12) == phases(7) == cycle


@pytest.mark.parametrize(("blocks", "zero_grad"), [(1, True), (2, True), (1, False)])
def test_evons_own_python_runs_nothing_per_parameter_on_a_steady_step(blocks: int, zero_grad: bool) -> None:
    """The lines of the package's Python that a training loop's steps run (each sampled block's entry
    and exit, ``step()``) over two refresh cycles are the same at 4 layers and at 16, with one or
    two blocks a step, with ``zero_grad()`` after each step or never (the step's gradients are then
    dropped at the next block): the per-parameter reads (gradients, states, dtypes and devices,
    counters) run in ``map``s, not in Python's loop (they ran 71 lines per parameter and step)."""
    import hf_evon

    package = os.path.dirname(hf_evon.__file__)

    def lines_run(layers: int) -> int:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
        opt = hf_evon.build_optimizer(model, precondition_frequency=10, stagger_refresh=False)
        x = torch.randn(8, 4)
        count = 0

        def line(frame, event, arg):  # noqa: ANN001, ANN202
            nonlocal count
            count += event == "line" and frame.f_code.co_filename.startswith(package)
            return line

        def traced(counting: bool, call, *args):  # noqa: ANN001, ANN002, ANN202
            if counting:
                sys.settrace(lambda *_: line)
            try:
                return call(*args)
            finally:
                sys.settrace(None)

        for counting in [False] * 12 + [True] * 20:
            for _ in range(blocks):
                block = opt.sampled_params(train=True)
                traced(counting, block.__enter__)
                model(x).square().mean().backward()
                traced(counting, block.__exit__, None, None, None)
            traced(counting, opt.step)
            if zero_grad:
                opt.zero_grad()
        return count

    assert lines_run(4) == lines_run(16) > 0
