"""Work-saving paths of EVON's step: each is checked against the plain computation it replaces.

* the prior term's rotated mean ``Q_Lᵀ M Q_R``, carried from step to step when the update is
  unclipped, must equal rotating the weights afresh, also after something else wrote them;
* the counting benchmark (``benchmarks/optimizer_flops.py``) runs, and its aten-op count per
  step does not grow with the number of equal blocks (a property, not a timing).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hf_evon import EVON

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


def _train(track: bool, monkeypatch: pytest.MonkeyPatch, edits: bool) -> list[torch.Tensor]:
    """12 steps on three float64 matrices; with ``edits``, weights are changed between steps by
    an in-place write, a ``.data`` reassignment and a ``copy_``, and one matrix gets no gradient
    once (the bucket then steps a subset)."""
    if not track:
        monkeypatch.setattr(EVON, "_tracks_rotated_mean", staticmethod(lambda plan: False))
    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=gen, dtype=F64)) for _ in range(2)]
    params.append(torch.nn.Parameter(torch.randn(5, 2, generator=gen, dtype=F64)))
    targets = [torch.randn(p.shape, generator=gen, dtype=F64) for p in params]
    opt = EVON(params, seed=1, **HP)
    for step in range(12):
        with opt.sampled_params(train=True):
            used = params[1:] if edits and step == 6 else params
            sum(((p - t) ** 4).sum() for p, t in zip(params, targets) if any(p is q for q in used)).backward()
        opt.step()
        opt.zero_grad()
        if edits and step == 2:
            with torch.no_grad():
                params[0].mul_(0.9)
        if edits and step == 4:
            params[1].data = params[1].data * 1.1
        if edits and step == 8:
            with torch.no_grad():
                params[2].copy_(targets[2])
    return [p.detach().clone() for p in params] + [opt.state[p]["exp_avg"].clone() for p in params]


@pytest.mark.parametrize("edits", [False, True])
def test_tracked_rotated_mean_equals_rotating_the_weights(
    edits: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracked = _train(True, monkeypatch, edits)
    fresh = _train(False, monkeypatch, edits)
    for a, b in zip(tracked, fresh):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_tracked_rotated_mean_saves_the_prior_terms_two_matmuls() -> None:
    """A step with ``clip="none"`` multiplies exactly ``Q_Lᵀ M Q_R`` less than a clipped one
    whose clipping never bites (radius 1e9): ``2 m² n + 2 m n²`` per matrix."""
    m, n = 6, 4

    def step_flops(clip: str) -> int:
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(m, n, generator=gen, dtype=F64))
        opt = EVON([p], seed=0, **{**HP, "clip": clip, "clip_radius": 1e9, "precondition_frequency": 100})
        total = 0
        for step in range(3):
            with opt.sampled_params(train=True):
                (p**4).sum().backward()
            counter = FlopCounterMode(display=False)
            with counter:
                opt.step()
            total = counter.get_total_flops() if step == 2 else total  # steady: after two updates
            opt.zero_grad()
        return total

    assert step_flops("element") - step_flops("none") == 2 * m * m * n + 2 * m * n * n


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
