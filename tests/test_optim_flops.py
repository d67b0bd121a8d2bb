"""The counting benchmark (``benchmarks/optimizer_flops.py``) runs, and its aten-op count per
step does not grow with the number of equal blocks (a property, not a timing)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

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
