"""benchmarks/posterior_size.py: its trained MiniLM LoRA run starts from the example's settings."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sizes = pytest.importorskip("posterior_size")
example = pytest.importorskip("finetune_classification")


class _Stop(Exception):
    pass


def test_the_lora_run_parses_the_examples_arguments(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """``--what trained`` built the LoRA run's settings with the example's parser and
    ``--bma-samples 0``, which that parser refuses (``--bma-samples must be an integer >= 1``,
    SystemExit 2) before any training; the run's own ``bma_num_samples=0`` turns the BMA passes off."""
    seen: list[argparse.Namespace] = []

    def prepare_data(args: argparse.Namespace) -> None:
        seen.append(args)
        raise _Stop

    monkeypatch.setattr(example, "prepare_data", prepare_data)
    with pytest.raises(_Stop):
        sizes.minilm_lora(argparse.Namespace(steps=3, samples=2), os.fspath(tmp_path))
    assert len(seen) == 1 and seen[0].lora and seen[0].max_steps == 3
