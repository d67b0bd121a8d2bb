"""benchmarks/payoff.py runs end to end (fast mode), so the proof of the defaults cannot rot."""

from __future__ import annotations

import json
import os
import statistics
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
payoff = pytest.importorskip("payoff")


def test_fast_mode_writes_the_report_and_its_numbers_are_the_runs(tmp_path) -> None:
    out = str(tmp_path / "payoff")
    summary = payoff.main(
        [
            "--tasks",
            "digits",
            "--seeds",
            "2",
            "--fast",
            "--methods",
            "adamw",
            "evon",
            "--samples",
            "2",
            "--jobs",
            "2",
            "--out",
            out,
        ]
    )
    saved = json.load(open(out + ".json"))
    runs = saved["runs"]["digits"]
    assert len(runs) == 2
    for row in ("AdamW", "AdamW + temperature", "EVON mean", "EVON calibrated BMA@2"):
        values = [r[row]["nll"] for r in runs]
        assert summary["digits"][row]["nll"][0] == pytest.approx(statistics.fmean(values), rel=1e-12)
        assert summary["digits"][row]["nll"][1] == pytest.approx(statistics.pstdev(values), rel=1e-12)
        assert 0.0 <= summary["digits"][row]["accuracy"][0] <= 1.0
    report = open(out + ".md").read()
    assert "| digits |" in report and "EVON calibrated BMA@2" in report
    assert os.path.getsize(out + ".png") > 1000
    # a combined report from the saved run is the same report
    payoff.main(["--combine", out + ".json", "--out", out + "_again"])
    assert open(out + "_again.md").read() == report
