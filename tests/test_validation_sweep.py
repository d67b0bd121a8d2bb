"""``benchmarks/validation_sweep.py`` refuses a setting it cannot pass to ``train_evon``."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
validation_sweep = pytest.importorskip("validation_sweep")


@pytest.mark.parametrize("setting", ["[1, 2]", "0.9", '"element"', "{clip: element}"])
def test_a_setting_that_is_not_a_json_object_is_refused(setting: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        validation_sweep.main(["--tasks", "minilm_lora", "--settings", "{}", setting])
    assert exit_info.value.code == 2
    assert f"--settings: {setting!r} is neither a JSON object nor 'adamw'" in capsys.readouterr().err

