"""``examples/quickstart.py`` (the README's first command) runs end to end on a short budget: the
table it prints is the mean of the per-seed metrics it saves, and the posterior it saves is the
first seed's whose calibrated BMA samples, reloaded to the same predictions."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import argument_error, load_script

from hf_evon import EVONPosterior

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs_saves_and_reproduces_its_bma(tmp_path) -> None:
    out = tmp_path / "quickstart"
    argv = ["--output-dir", str(out)]  # the defaults: 3 seeds, of which seed 2 chooses a noise scale
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "quickstart.py"), *argv],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "reloaded BMA identical: True" in run.stdout
    per_seed = json.loads((out / "metrics.json").read_text())["per_seed"]
    assert len(per_seed) == 3
    table = {
        line.split("  ")[0].strip(): line.split()[-4:] for line in run.stdout.splitlines() if "  0." in line
    }
    for name in ("AdamW", "EVON (mean)", "EVON (BMA@32)"):
        nll = statistics.fmean(r[name]["nll"] for r in per_seed)
        assert float(table[name][1]) == round(nll, 4)
    saved = EVONPosterior.from_pretrained(str(out))
    lines = [line for line in run.stdout.splitlines() if line.startswith("seed ")]
    finite = [i for i, line in enumerate(lines) if "ess = inf" not in line]
    want = finite[0] if finite else 0
    assert f"saved seed {want}'s model" in run.stdout
    # the file says which seed and shape the saved model is (it was only in the console's log)
    written = json.loads((out / "metrics.json").read_text())
    assert (written["saved_seed"], written["width"], written["epochs"]) == (want, 256, 60)
    assert math.isinf(saved.ess) == (not finite)


@pytest.fixture(scope="module")
def quickstart():
    return load_script(REPO_ROOT / "examples" / "quickstart.py")


def _argument_error(quickstart, capsys, tmp_path, argv: list[str]) -> str:
    """argparse's error line for ``quickstart.py argv`` (:func:`conftest.argument_error`), which
    must have created no output directory."""
    error = argument_error(quickstart.main, ["--output-dir", str(tmp_path / "q"), *argv], capsys)
    assert not (tmp_path / "q").exists()
    return error


@pytest.mark.parametrize("argv", [["--epochs", "-1"], ["--epochs", "0"], ["--batch-size", "0"], ["--bma-samples", "0"]])
def test_a_count_below_one_is_an_argument_error(quickstart, capsys, tmp_path, argv) -> None:
    """--epochs -1 exited 0 with an untrained model saved; --epochs 0 and --batch-size 0 raised
    ZeroDivisionError and --bma-samples 0 a ValueError, with tracebacks."""
    assert f"{argv[0]} must be >= 1; got {argv[1]}" in _argument_error(quickstart, capsys, tmp_path, argv)


def test_a_batch_larger_than_the_training_split_is_an_argument_error(quickstart, capsys, tmp_path) -> None:
    """--batch-size above the training split's images made zero steps and a ZeroDivisionError in
    the rate schedule, with a traceback. The split: digits less its 30% test share, less the
    fifth of the rest held out for calibration (1,006 images)."""
    from sklearn.datasets import load_digits

    rows = len(load_digits().target)
    fitted = rows - math.ceil(0.3 * rows)
    train = fitted - fitted // 5
    err = _argument_error(quickstart, capsys, tmp_path, ["--batch-size", "2000"])
    assert f"--batch-size must be at most the training split's {train} images; got 2000" in err


def test_an_output_directory_that_is_a_file_is_an_argument_error(quickstart, capsys, tmp_path) -> None:
    """A file at --output-dir raised FileExistsError from os.makedirs after every seed had trained
    (the default run's 40 s), losing the results; the file is left as it was."""
    (tmp_path / "q").write_text("notes")
    error = argument_error(quickstart.main, ["--output-dir", str(tmp_path / "q")], capsys)
    assert (tmp_path / "q").read_text() == "notes"
    assert f"--output-dir: {tmp_path / 'q'} is a file, not a directory" in error
    # a file above it: NotADirectoryError at the save, after the training, before
    error = argument_error(quickstart.main, ["--output-dir", str(tmp_path / "q" / "sub" / "dir")], capsys)
    assert f"--output-dir: {tmp_path / 'q'} is a file, not a directory" in error
