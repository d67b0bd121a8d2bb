"""Scalar reads per training step of a whole ``EVONTrainer`` run against ``Trainer`` + AdamW.

On a GPU every read of a tensor's value back to the host (``aten._local_scalar_dense``: an
``.item()``, ``float(t)``, ``bool(t)``) waits for every queued kernel, so the step cannot run
ahead of the device. This counts them with a ``TorchDispatchMode`` over ``trainer.train()`` and
names where each comes from (the innermost frame of hf_evon, transformers or accelerate), for
a 1-layer GPT-2 with padded labels (the loss's label-item count is in play), clipping on
(``max_grad_norm=1.0``), with 1 and 2 micro-batches per step. EVON's own finite check (one
``tolist`` per step, a device-to-host copy) is not an ``_local_scalar_dense`` and is not counted.

    python benchmarks/trainer_scalar_reads.py
    python benchmarks/trainer_scalar_reads.py --steps 100 --accumulation 1 4

Figures: docs/results.md (the "scalar reads" entry of the CPU speed list).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from hf_evon import EVONConfig, EVONTrainer

SOURCES = ("hf_evon", "transformers", "accelerate")


class ScalarReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` calls by the innermost frame of ``SOURCES``."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.overloadpacket == torch.ops.aten._local_scalar_dense:
            frames = [f for f in traceback.extract_stack() if any(f"{os.sep}{s}{os.sep}" in f.filename for s in SOURCES)]
            site = "elsewhere"
            if frames:
                f = frames[-1]
                package = next(s for s in SOURCES if f"{os.sep}{s}{os.sep}" in f.filename)
                site = f"{package}{os.sep}{f.filename.rsplit(os.sep + package + os.sep, 1)[-1]}:{f.lineno}"
            self.sites[site] += 1
        return func(*args, **(kwargs or {}))


def rows(seed: int = 0, n: int = 64, length: int = 16) -> list[dict[str, torch.Tensor]]:
    """Token rows with a padded tail (labels -100 there), lengths varying."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 128, (length,), generator=g)
        used = int(torch.randint(4, length + 1, (1,), generator=g))
        labels = ids.clone()
        labels[used:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def run(kind: str, steps: int, accumulation: int, out_dir: str) -> tuple[float, Counter[str]]:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=32)
    common = dict(
        output_dir=os.path.join(out_dir, f"{kind}_{accumulation}"), max_steps=steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=accumulation, max_grad_norm=1.0, logging_steps=10**6, save_strategy="no",
        report_to=[], disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    if kind == "adamw":
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=rows())
    else:
        trainer = EVONTrainer(model=model, args=EVONConfig(**common), train_dataset=rows())
    mode = ScalarReads()
    with mode:
        trainer.train()
    return sum(mode.sites.values()) / steps, mode.sites


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--accumulation", type=int, nargs="+", default=[1, 2], help="micro-batches per step")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out_dir:
        for accumulation in args.accumulation:
            for kind in ("adamw", "evon"):
                per_step, sites = run(kind, args.steps, accumulation, out_dir)
                print(f"{kind:5s} micro-batches {accumulation}: {per_step:.3f} scalar reads per step")
                for site, count in sites.most_common():
                    print(f"    {count:5d}  {site}")


if __name__ == "__main__":
    main()
