"""``examples/plot_evon_logs.py``: the ``evon/*`` scalars an ``EVONTrainer`` writes with
``report_to="tensorboard"`` are read back exactly and drawn as a PNG (issue 11.8)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_script

pytest.importorskip("tensorboard")
pytest.importorskip("matplotlib")

from hf_evon import EVONConfig, EVONTrainer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


plot_evon_logs = load_script(REPO_ROOT / "examples" / "plot_evon_logs.py")


def test_tensorboard_is_in_the_examples_extra():
    import tomllib

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"tensorboard", "matplotlib"} <= set(extras["examples"])


def test_trainer_tensorboard_logs_are_read_back_and_plotted(tmp_path):
    from datasets import Dataset
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_labels=3
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (24, 8), generator=g)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": (ids[:, 1] % 3).tolist()})
    args = EVONConfig(
        output_dir=str(tmp_path / "out"), report_to="tensorboard",
        use_cpu=True, per_device_train_batch_size=8, max_steps=6, logging_steps=1, evon_learning_rate=2e-2,
        evon_ess=100.0, evon_precondition_frequency=2, save_strategy="no", disable_tqdm=True,
        bma_num_samples=2, seed=0,
    )  # fmt: skip
    trainer = EVONTrainer(
        model=BertForSequenceClassification(config), args=args, train_dataset=data, eval_dataset=data
    )
    trainer.train()
    trainer.evaluate()
    for cb in trainer.callback_handler.callbacks:  # flush the event files
        if getattr(cb, "tb_writer", None) is not None:
            cb.tb_writer.flush()

    scalars = plot_evon_logs.read_scalars(str(tmp_path / "out" / "runs"))
    logged = [e for e in trainer.state.log_history if "evon/hess_mean" in e]
    assert len(logged) == 6
    for key in ("evon/posterior_std_mean", "evon/hess_min", "evon/hess_mean", "evon/hess_max", "loss"):
        steps, values = scalars[f"train/{key}"]
        assert steps == [e["step"] for e in logged]
        np.testing.assert_array_equal(np.float32(values), np.float32([e[key] for e in logged]))
    final = trainer.state.log_history[-1]
    assert np.float32(scalars["eval/bma_nll"][1][-1]) == np.float32(final["eval_bma_nll"])

    png = tmp_path / "curves.png"
    drawn = plot_evon_logs.main([str(tmp_path / "out" / "runs"), "--output", str(png), "--title", "test"])
    assert drawn == [name for name, _, _ in plot_evon_logs.PANELS]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_or_empty_logdir_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="is not a directory"):
        plot_evon_logs.read_scalars(str(tmp_path / "nope"))
    with pytest.raises(SystemExit, match="no TensorBoard scalars"):
        plot_evon_logs.read_scalars(str(tmp_path))


def test_two_runs_in_one_log_directory_are_not_merged(tmp_path, capsys):
    """A second run into the same output directory writes a second run directory: the curve is the
    newest run's alone (merged, the two runs' steps interleave into one curve), and a run's own
    directory plots that run."""
    import os

    from torch.utils.tensorboard import SummaryWriter

    logdir = tmp_path / "runs"
    for run, values, mtime in (("first", (5.0, 4.0, 3.0), 1_000_000), ("second", (9.0, 8.0), 2_000_000)):
        writer = SummaryWriter(str(logdir / run))
        for step, value in enumerate(values, start=1):
            writer.add_scalar("train/loss", value, step)
        writer.close()
        for name in os.listdir(logdir / run):
            os.utime(logdir / run / name, (mtime, mtime))
    assert plot_evon_logs.read_scalars(str(logdir))["train/loss"] == ([1, 2], [9.0, 8.0])
    assert "2 runs under" in capsys.readouterr().err
    assert plot_evon_logs.read_scalars(str(logdir / "first"))["train/loss"] == ([1, 2, 3], [5.0, 4.0, 3.0])


def _one_run(logdir: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(logdir / "run"))
    for step, value in enumerate((3.0, 2.0), start=1):
        writer.add_scalar("train/loss", value, step)
    writer.close()


def test_the_figure_is_written_at_the_output_path_it_prints(tmp_path, capsys):
    """``--output curves`` (no extension) printed "wrote curves" while matplotlib wrote
    curves.png; an existing directory as --output did the same (``<dir>.png``), and an unknown
    extension raised matplotlib's ValueError with a traceback."""
    _one_run(tmp_path / "runs")
    out = tmp_path / "curves"
    plot_evon_logs.main([str(tmp_path / "runs"), "--output", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "curves.png").exists()
    assert f"wrote {out}: training loss" in capsys.readouterr().out
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")  # a file on the way: FileExistsError from makedirs, after the reading
    for output, message in ((tmp_path / "adir", "is a directory"), (tmp_path / "c.xyz", "'xyz' is not a format"),
                            (tmp_path / "afile" / "x.png", f"{tmp_path / 'afile'} is a file, not a directory")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            plot_evon_logs.main([str(tmp_path / "runs"), "--output", str(output)])
        assert exit_.value.code == 2 and f"--output {output}: " in (err := capsys.readouterr().err) and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile", "curves", "runs"]


def test_the_docstrings_commands_plot_the_run_the_first_one_logs():
    """The docstring's fine-tuning command (no --output-dir: its runs land under the temporary
    directory) was followed by a plot of outputs/finetune/evon/runs, which that command never
    writes: pasted as given, the plot stopped on "is not a directory of TensorBoard event files"."""
    import shlex

    finetune = load_script(REPO_ROOT / "examples" / "finetune_classification.py")
    commands = [line.split("#")[0].split() for line in plot_evon_logs.__doc__.splitlines() if "python examples/" in line]
    train = next(c for c in commands if c[1] == "examples/finetune_classification.py")
    plot = next(c for c in commands if c[1] == "examples/plot_evon_logs.py")
    args = finetune.parse_args(shlex.split(" ".join(train[2:])))
    assert "evon" in args.methods and args.report_to == "tensorboard"
    assert plot[2] == f"{args.output_dir}/evon/runs"
