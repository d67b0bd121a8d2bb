"""Shared pytest set-up: deterministic, single-threaded CPU runs."""

from __future__ import annotations

import pytest
import torch

# The tests use tiny matrices: more threads only add overhead (and oversubscribe CI runners).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fixed_seed() -> None:
    """Every test starts from the same global RNG state (tests may still seed their own)."""
    torch.manual_seed(0)
