"""Worker for tests/test_sharding.py: ``EVONTrainer(evon_shard=True)`` on W CPU processes.

Its scenarios (argv[2:], run in turn in one launch, each result saved by ``launcher.run_scenarios``):
``runs`` trains the float64 regressor of ``sharded_worker`` for 4 steps (checkpoint at step 2), then
resumes a fresh trainer from that checkpoint, and saves the weights of both runs per rank; ``card``
(:func:`card`) writes a model card on every rank; ``sharded`` is ``sharded_worker``'s run (after the
Trainer's: they set up the process group, as in a script without one of its own).
Usage: ``torch.distributed.run --nproc_per_node W sharded_trainer_worker.py OUT_DIR SCENARIO...``.
"""

from __future__ import annotations

import os
import sys

import torch
from datasets import Dataset
from torch import nn
from transformers import PretrainedConfig

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


def runs(out: str, world: int) -> dict:
    """A run, then a fresh trainer resumed from its checkpoint-2: the weights of both, and the first's
    pooled statistics."""
    first = run(os.path.join(out, "first"), world)
    evon = first.evon_optimizer
    assert evon.sharding is not None and evon.sharding.world == world
    weights = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    stats = first.posterior_statistics()  # every rank: it pools the ranks' shares
    resumed = run(os.path.join(out, "resumed"), world, resume=os.path.join(out, "first", "checkpoint-2"))
    again = {n: p.detach().clone() for n, p in resumed.model.named_parameters()}
    return {"weights": weights, "resumed": again, "stats": stats}


def card(out: str, world: int, rank: int) -> dict:
    """``create_model_card()`` on every process after ``evon_shard=True`` training, as transformers'
    example scripts do when they do not push: the Trainer's own method returns on all but rank 0, so
    gathering the sharded posterior inside it would leave rank 0 waiting alone. No checkpoint is saved,
    so nothing was gathered before. The card is ``out/README.md``."""
    args = trainer_config(
        out, world, evon_shard=True, ddp_backend="gloo" if world > 1 else None, save_strategy="no"
    )
    model = Regressor()
    model.config = PretrainedConfig()  # the Trainer's card reads the model's config
    trainer = EVONTrainer(model=model, args=args, train_dataset=data())
    trainer.train()
    print(f"rank {rank}: trained", file=sys.stderr, flush=True)  # where a hang stopped, if one does
    trainer.create_model_card(model_name="sharded-card")  # every rank, as run_glue.py does
    print(f"rank {rank}: card done", file=sys.stderr, flush=True)
    return {}


def main(out: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    scenarios = {
        "runs": lambda: runs(out, world),
        "card": lambda: card(os.path.join(out, "card"), world, rank),
        "sharded": lambda: sharded_worker.results(out, world, rank),
    }
    run_scenarios(out, rank, scenarios, names)
    finish()  # exits here: no DDP or process-group destructor runs (launcher.finish)


from launcher import finish, run_scenarios  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    finish()
