"""2 ranks (tests/test_sharding.py): rank 1's sampled_params(train=True) block raises before its forward,
uncaught, on a DDP model with a buffer under sharded EVON (argv "ddp"), or on tests/fsdp2_worker.py's
FSDP2 model ("fsdp2"). Rank 0 is then in the model's own forward collectives (DDP's buffer broadcast,
FSDP2's all-gather), which no exchange of EVON's pairs with: rank 1 must exit with its error, and the
launch stop rank 0, rather than rank 1 wait in an exchange at its block's exit until the process group
times out."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from hf_evon import build_optimizer, prepare_distributed


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(4))  # DDP broadcasts it at every forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x * self.scale)


def main(kind: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if kind == "fsdp2":
        import fsdp2_worker as fw
        from torch.distributed.device_mesh import init_device_mesh

        model, opt = fw.make(init_device_mesh("cpu", (dist.get_world_size(),)))
        rows = fw.GLOBAL_BATCH // dist.get_world_size()
        ids, x, y = (t[rank * rows : (rank + 1) * rows] for t in fw.batch(0))
        loss = lambda: nn.functional.mse_loss(model(ids, x), y)  # noqa: E731
    else:
        inner = WithBuffer().double()
        opt = build_optimizer(inner, seed=0)
        model = nn.parallel.DistributedDataParallel(inner)
        prepare_distributed(model, opt, shard=True)
        x = torch.randn(6, 4, dtype=torch.float64)
        loss = lambda: model(x).square().mean()  # noqa: E731
    for step in range(2):
        with opt.sampled_params(train=True):
            if rank == 1 and step == 1:
                raise ValueError("rank 1 failed before its forward")
            loss().backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main(sys.argv[1])
