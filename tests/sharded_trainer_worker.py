"""Worker for tests/test_sharding.py: ``EVONTrainer(evon_shard=True)`` on W CPU processes.

Trains the float64 regressor of ``sharded_worker`` for 4 steps (checkpoint at step 2), then
resumes a fresh trainer from that checkpoint; saves the weights of both runs per rank.
Usage: ``torch.distributed.run --nproc_per_node W sharded_trainer_worker.py OUT_DIR``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sharded_worker  # noqa: E402

from hf_evon import EVONConfig, EVONTrainer  # noqa: E402

GLOBAL_BATCH, STEPS = 12, 4


class Regressor(nn.Module):
    """The worker's 8-layer float64 MLP with a Trainer-style output (loss, logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = sharded_worker.tiny_model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.net(x.double())
        loss = nn.functional.mse_loss(out, labels.double()) if labels is not None else None
        return {"loss": loss, "logits": out}


def data(steps: int = STEPS) -> Dataset:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(GLOBAL_BATCH * steps, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH * steps, 8, generator=gen, dtype=torch.float64)
    return Dataset.from_dict({"x": x.tolist(), "labels": y.tolist()})


def trainer_config(out: str, world: int, **changes) -> EVONConfig:
    """The EVON settings every multi-process Trainer test shares (``changes`` override them)."""
    settings = dict(
        output_dir=out,
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        max_steps=STEPS,
        learning_rate=2e-2,
        evon_adamw_learning_rate=1e-2,
        evon_mc_samples=2,
        evon_precondition_frequency=2,
        evon_seed=7,
        lr_scheduler_type="constant",
        save_strategy="steps",
        save_steps=2,
        logging_steps=2,
        disable_tqdm=True,
        bma_num_samples=0,
        seed=0,
    )
    return EVONConfig(**{**settings, **changes})


def run(out: str, world: int, resume: str | None = None) -> EVONTrainer:
    args = trainer_config(
        out, world, evon_shard=True, ddp_backend="gloo" if world > 1 else None, max_grad_norm=1.0
    )
    trainer = EVONTrainer(model=Regressor(), args=args, train_dataset=data())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def main(out: str) -> None:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    first = run(os.path.join(out, "first"), world)
    evon = first.evon_optimizer
    assert evon.sharding is not None and evon.sharding.world == world
    weights = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    stats = first.posterior_statistics()  # every rank: it pools the ranks' shares
    resumed = run(os.path.join(out, "resumed"), world, resume=os.path.join(out, "first", "checkpoint-2"))
    again = {n: p.detach().clone() for n, p in resumed.model.named_parameters()}
    torch.save({"weights": weights, "resumed": again, "stats": stats}, os.path.join(out, f"rank{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()
        finish()  # exits here: no DDP or process-group destructor runs (launcher.finish)


from launcher import finish  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1])
    finish()
