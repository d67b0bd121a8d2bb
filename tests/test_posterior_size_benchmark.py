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


def test_the_lora_run_trains_with_the_examples_evon_settings(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """``--what trained`` built the LoRA run's settings with the example's parser and
    ``--bma-samples 0``, which that parser refuses (SystemExit 2 before any training), and then
    multiplied ``--evon-lr``, None unless given, by the LoRA factor (TypeError). The run takes the
    example's EVON configuration: the Trainer's rate is AdamW's (``--learning-rate``, 1e-4) times
    the LoRA factor, ``max_steps`` the benchmark's, and no BMA passes during training."""
    import hf_evon

    seen: dict = {}

    def prepare_data(args: argparse.Namespace) -> tuple[dict, int, None]:
        seen["example"] = args
        return {"tokenizer": object(), "train": []}, 5, None

    def trainer(**kwargs: object) -> None:
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(example, "prepare_data", prepare_data)
    monkeypatch.setattr(example, "load_model", lambda num_labels, seed: None)
    monkeypatch.setattr(hf_evon, "EVONTrainer", trainer)
    with pytest.raises(_Stop):
        sizes.minilm_lora(argparse.Namespace(steps=3, samples=2), os.fspath(tmp_path))
    ex, config = seen["example"], seen["args"]
    assert ex.lora and ex.lora_lr_factor > 1
    assert config.learning_rate == 1e-4 * ex.lora_lr_factor
    assert (config.max_steps, config.bma_num_samples) == (3, 0)
    assert config.output_dir.startswith(os.fspath(tmp_path)) and seen["peft_config"] is not None


@pytest.mark.parametrize("given", [False, True])
def test_the_default_output_directory_is_removed_at_exit(monkeypatch: pytest.MonkeyPatch, tmp_path, given: bool) -> None:
    """Without ``--out`` the files (about 5 GB for GPT-2 small) went to a ``mkdtemp`` folder that was never
    removed; it is now a temporary directory removed at exit, and ``--out DIR`` keeps them."""
    seen: list[tuple[str, bool]] = []

    def run(args: argparse.Namespace) -> None:
        with open(os.path.join(args.out, "f"), "w") as fh:
            fh.write("x")
        seen.append((args.out, args.temporary))

    monkeypatch.setattr(sizes, "run", run)
    monkeypatch.setattr(sys, "argv", ["posterior_size.py", *(["--out", str(tmp_path)] if given else [])])
    sizes.main()
    (out, temporary), = seen
    assert temporary is not given and os.path.exists(out) is given
