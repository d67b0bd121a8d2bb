"""What the calibration's temperature scoring costs on a language model's vocabulary.

``calibrate_posterior`` scores every held-out target's log-probability at each temperature of its
grid, in every pass: 25 temperatures at the mean, 13 softening ones per sample where the mean is
overconfident. Each temperature costs one log-sum-exp over the classes per target, which for an
LM is its vocabulary (GPT-2's 50,257 tokens, Llama 3's 128,256), while the forward that produced
the logits may cost less (a small model with a large vocabulary: the README's snippet).

Two measurements, one thread:

1. ``tempered_log_probs`` on [targets, vocabulary] float32 logits at ``TEMPERATURE_GRID``, against
   the direct form it computes (a float64 copy of the rows, one ``logsumexp`` of the rows / T per
   temperature): seconds per call, and the largest difference of the two (its float32 exps'
   error). The logits are standard normal times ``--logit-scales``: 3 spreads a row over about
   ±13, 20 over about ±86, where a low temperature's exps of the far-off tokens underflow (as a
   trained LM's do).
2. The README's ``EVONTrainer`` snippet (a 2-layer, 64-wide GPT-2 with GPT-2's vocabulary, 48
   training rows of 32 random tokens, one epoch, 8 rows for the calibration): seconds of
   ``train()`` without its closing ``calibrate()``, and of that ``calibrate()``.

    python benchmarks/calibration_vocabulary.py
    python benchmarks/calibration_vocabulary.py --vocabularies 1024 50257 --targets 256 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_wall_time import timed  # noqa: E402  (the calibrate() call's wall time)

from hf_evon.predictive.calibration import TEMPERATURE_GRID  # noqa: E402
from hf_evon.predictive.held_out import tempered_log_probs  # noqa: E402


def direct(logits: torch.Tensor, labels: torch.Tensor, temperatures: tuple[float, ...]) -> torch.Tensor:
    """log softmax(logits / T)(label) per temperature, the direct way: [T, targets], float64."""
    rows = logits.double()
    at_label = rows.gather(1, labels[:, None]).squeeze(1)
    return torch.stack([at_label / t - torch.logsumexp(rows / t, dim=-1) for t in temperatures])


def seconds(call: Callable[..., Any], args: tuple, repeats: int) -> float:
    call(*args)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_rows(
    vocabularies: list[int], targets: int, repeats: int, scales: list[float]
) -> list[dict[str, float]]:
    rows = []
    for scale, vocabulary in [(s, v) for s in scales for v in vocabularies]:
        generator = torch.Generator().manual_seed(vocabulary)
        logits = torch.randn(targets, vocabulary, generator=generator) * scale
        labels = torch.randint(0, vocabulary, (targets,), generator=generator)
        ours = tempered_log_probs(logits, labels, False, TEMPERATURE_GRID)
        difference = float((ours - direct(logits, labels, TEMPERATURE_GRID)).abs().max())
        rows.append({
            "logit_scale": scale,
            "vocabulary": vocabulary,
            "direct_s": seconds(direct, (logits, labels, TEMPERATURE_GRID), repeats),
            "ours_s": seconds(tempered_log_probs, (logits, labels, False, TEMPERATURE_GRID), repeats),
            "max_difference": difference,
        })  # fmt: skip
    return rows


def readme_trainer() -> dict[str, float]:
    """The README's EVONTrainer snippet, its train() split into training and calibrate()."""
    from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback

    from hf_evon import EVONConfig, EVONTrainer

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2)
    ids = torch.randint(0, config.vocab_size, (64, 32))
    rows = [{"input_ids": x, "labels": x} for x in ids]
    with tempfile.TemporaryDirectory() as out:
        args = EVONConfig(
            output_dir=out, num_train_epochs=1, eval_strategy="no", bma_num_samples=8, report_to="none",
            save_strategy="no",
        )  # fmt: skip
        trainer = EVONTrainer(
            model=GPT2LMHeadModel(config), args=args, train_dataset=rows[:48], calibration_dataset=rows[56:]
        )
        trainer.remove_callback(PrinterCallback)
        spent: list[float] = []
        timed(trainer, "calibrate", spent)
        start = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - start
    return {"train_s": total - sum(spent), "calibration_s": sum(spent)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocabularies", type=int, nargs="+", default=[1024, 32000, 50257, 128256])
    ap.add_argument("--targets", type=int, default=248, help="scored targets (the snippet's: 8 rows of 31)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--logit-scales", type=float, nargs="+", default=[3.0, 20.0])
    ap.add_argument("--no-trainer", action="store_true", help="only the kernel's table")
    args = ap.parse_args(argv)
    if args.targets < 1 or args.repeats < 1 or min(args.vocabularies) < 2 or min(args.logit_scales) <= 0:
        ap.error("--targets and --repeats must be >= 1, every vocabulary >= 2 and every logit scale > 0")
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = kernel_rows(args.vocabularies, args.targets, args.repeats, args.logit_scales)
    print(f"tempered_log_probs, {args.targets} targets x {len(TEMPERATURE_GRID)} temperatures, one thread")
    print("| logit scale | vocabulary | direct s | tempered_log_probs s | speed-up | max difference |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['logit_scale']:g} | {r['vocabulary']} | {r['direct_s']:.3f} | {r['ours_s']:.3f} | {r['direct_s'] / r['ours_s']:.1f}x "
            f"| {r['max_difference']:.1e} |"
        )
    result: dict[str, Any] = {"kernel": rows}
    if not args.no_trainer:
        result["trainer"] = run = readme_trainer()
        print(
            f"README snippet: training {run['train_s']:.2f} s, calibration {run['calibration_s']:.2f} s "
            f"({run['calibration_s'] / run['train_s']:.2f}x the training)"
        )
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
