"""benchmarks/wide_sides.py: what the default ``max_precond_ratio`` saves, measured on real state."""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
wide_sides = pytest.importorskip("wide_sides")


def test_the_cnn_heads_wide_basis_and_statistic_are_the_whole_difference(monkeypatch) -> None:
    """With every basis the 10×2048 head keeps a 2048×2048 basis Q_R and statistic R (float32):
    the state is larger by exactly those two matrices, and nothing else moves."""
    monkeypatch.setattr(wide_sides, "WARMUP", 2)
    monkeypatch.setattr(wide_sides, "TIMED", 1)
    rows = wide_sides.main(["--models", "cnn"])["cnn"]
    default, every = rows["EVON default"], rows["EVON every basis"]
    assert every["state_bytes"] - default["state_bytes"] == 2 * 2048 * 2048 * 4
    trainable = sum(p.numel() for p in wide_sides.cnn(0)[0].parameters())
    assert default["bytes_per_param"] == pytest.approx(default["state_bytes"] / trainable, rel=1e-12)
    assert math.isfinite(rows["AdamW"]["step_s"]) and rows["AdamW"]["state_bytes"] > 0


def test_a_lower_ratio_drops_a_narrower_heads_basis(monkeypatch) -> None:
    """``--cnn-channels 16``: a 10×1024 head (ratio 102.4) keeps its basis at the default 128 and
    loses exactly its 1024×1024 basis and statistic at ``--ratio 64``."""
    monkeypatch.setattr(wide_sides, "WARMUP", 2)
    monkeypatch.setattr(wide_sides, "TIMED", 1)
    rows = wide_sides.main(["--models", "cnn", "--cnn-channels", "16", "--ratio", "64"])["cnn"]
    assert rows["EVON default"]["state_bytes"] == rows["EVON every basis"]["state_bytes"]
    assert rows["EVON default"]["state_bytes"] - rows["EVON ratio 64"]["state_bytes"] == 2 * 1024 * 1024 * 4
    assert "EVON ratio 64" not in wide_sides.OPTIMIZERS  # a run's extra row stays in that run
