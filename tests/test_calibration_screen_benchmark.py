"""benchmarks/calibration_screen.py's command line."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
screen = pytest.importorskip("calibration_screen")
import payoff  # noqa: E402


@pytest.mark.parametrize("name", ["digits", "docstring_topic", "docstring_topic/lroa"])
def test_an_unknown_task_is_refused_by_name_with_the_accepted_ones_before_any_run(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--tasks digits`` failed in the run with "unknown text task 'digits'" and the text tasks'
    names, not the tabular task it accepts (``noisy_digits``); ``docstring_topic`` (no variant)
    failed unpacking its name, and ``docstring_topic/lroa`` trained full fine-tuning."""

    def no_run(run, tasks, seeds, jobs):  # noqa: ANN001, ANN202
        raise AssertionError(f"ran {tasks}")

    monkeypatch.setattr(payoff, "print_rows", no_run)
    monkeypatch.setattr(sys, "argv", ["calibration_screen.py", "--tasks", "noisy_digits", name])
    with pytest.raises(SystemExit) as exit_info:
        screen.main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--tasks" in err and repr(name) in err
    for accepted in ("noisy_digits", "docstring_topic/lora", "reference_topic/full"):
        assert accepted in err
