"""Worker for tests/test_sharding.py: ``create_model_card()`` after ``evon_shard=True`` training.

As transformers' example scripts do when they do not push (``trainer.create_model_card()`` on
every process): the Trainer's own method returns on all but rank 0, so gathering the sharded
posterior inside it would leave rank 0 waiting alone. No checkpoint is saved, so nothing was
gathered before. Usage: ``torch.distributed.run --nproc_per_node W sharded_card_worker.py OUT``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sharded_trainer_worker as worker  # noqa: E402

from hf_evon import EVONTrainer  # noqa: E402


def main(out: str) -> None:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = worker.trainer_config(
        out, world, evon_shard=True, ddp_backend="gloo" if world > 1 else None, save_strategy="no"
    )
    model = worker.Regressor()
    model.config = PretrainedConfig()  # the Trainer's card reads the model's config
    trainer = EVONTrainer(model=model, args=args, train_dataset=worker.data())
    rank = int(os.environ.get("RANK", "0"))
    trainer.train()
    print(f"rank {rank}: trained", file=sys.stderr, flush=True)  # where a hang stopped, if one does
    trainer.create_model_card(model_name="sharded-card")  # every rank, as run_glue.py does
    print(f"rank {rank}: card done", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.barrier()
        print(f"rank {rank}: finished", file=sys.stderr, flush=True)
        finish()  # exits here: no DDP or process-group destructor runs (launcher.finish)


from launcher import finish  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1])
    finish()
