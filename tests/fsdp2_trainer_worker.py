"""Worker for tests/test_fsdp2.py: ``EVONTrainer`` with the Trainer's FSDP2 arguments on CPUs.

accelerate (1.15) enables its FSDP plugin only for GPUs and other accelerators, not for
``MULTI_CPU``: the Trainer would silently train plain DDP. EVONTrainer refuses before any
step; each rank writes the error it got to ``OUT_DIR/trainer_rank{r}.txt``.
Usage: ``torch.distributed.run --nproc_per_node 2 fsdp2_trainer_worker.py OUT_DIR``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from torch import nn

from hf_evon import EVONConfig, EVONTrainer


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.lin(x.float())
        return {"loss": nn.functional.mse_loss(out, labels.float()), "logits": out}


def main(out: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    data = Dataset.from_dict({"x": torch.randn(16, 4).tolist(), "labels": torch.randn(16, 4).tolist()})
    args = EVONConfig(
        output_dir=os.path.join(out, "run"),
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        max_steps=2,
        per_device_train_batch_size=4,
        fsdp=True,
        fsdp_config={"fsdp_version": 2},
        disable_tqdm=True,
        bma_num_samples=0,
        save_strategy="no",
    )
    trainer = EVONTrainer(model=Regressor(), args=args, train_dataset=data)
    try:
        trainer.train()
        msg = f"trained {trainer.state.global_step} steps"
    except Exception as err:  # noqa: BLE001 - the test checks the type and message
        msg = f"{type(err).__name__}: {err}"
    with open(os.path.join(out, f"trainer_rank{rank}.txt"), "w") as f:
        f.write(msg)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
