"""benchmarks/binary_text.py: its two-class tasks are Table 2's texts of two classes, and its table
averages what the runs report."""

from __future__ import annotations

import hashlib
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import binary_text as bench  # noqa: E402
import table2_finetune  # noqa: E402  (on the path through binary_text)


@pytest.mark.parametrize("name", list(bench.TASKS))
def test_the_two_classes_are_table2s_texts_relabelled(name: str) -> None:
    source, pair = bench.TASKS[name]
    classes, texts = table2_finetune.unique_texts(source)
    train, held = bench.binary_rows(name)
    n_train, n_held = bench.PER_CLASS
    assert [sum(y == k for _, y in train) for k in (0, 1)] == [n_train, n_train]
    assert held == [[t, i] for i, k in enumerate(pair) for t in texts[k][n_train : n_train + n_held]]
    assert sorted(t for t, y in train if y == 1) == sorted(texts[pair[1]][:n_train])
    assert sorted(t for t, y in train if y == 0) == sorted(texts[pair[0]][:n_train])
    assert not {t for t, _ in train} & {t for t, _ in held}
    # the training rows mixed as Table 2 mixes its own: in the order of their SHA-256
    digests = [hashlib.sha256(t.encode()).hexdigest() for t, _ in train]
    assert digests == sorted(digests) and classes[pair[0]] != classes[pair[1]]


def test_the_table_is_the_mean_over_seeds() -> None:
    def run(seed: int, nll: float, acc: float) -> dict:
        scores = {"nll": nll, "ece": 0.1 * seed, "accuracy": acc}
        return {"task": "exception2", "variant": "lora", "seed": seed, "rows": {"AdamW": scores}}

    lines = bench.table([run(0, 0.5, 0.6), run(1, 0.7, 0.8)]).splitlines()
    assert lines[2] == "| exception2 lora | AdamW | 0.600 | 0.050 | 0.700 | 2 |"


def test_a_fast_run_reports_every_row() -> None:
    runs = bench.main(["--tasks", "exception2", "--variants", "lora", "--seeds", "1", "--samples", "2", "--fast"])
    adamw, evon = runs
    rows = {"AdamW", "AdamW + temperature", "AdamW + temperature (calibration's rule)"}
    assert set(adamw["rows"]) == rows and adamw["temperature"] > 0
    tempered = {"EVON mean + temperature", "EVON mean + temperature (calibration's rule)"}
    assert set(evon["rows"]) == {"EVON mean", "EVON calibrated BMA@2"} | tempered
    assert all(math.isfinite(s["nll"]) for r in runs for s in r["rows"].values())
    assert evon["calibration"]["trained_ess"] > 0 and 0 <= evon["health"]["hess_below_prior"] <= 1
