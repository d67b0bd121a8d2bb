"""2 ranks (tests/test_sharding.py): rank 1's sampled_params(train=True) block raises before its forward,
uncaught, on a DDP model with a buffer under sharded EVON. Rank 0 is then in DDP's forward (the buffer's
broadcast), which no exchange of EVON's pairs with: rank 1 must exit with its error, and the launch stop
rank 0, rather than rank 1 wait in an exchange at its block's exit until the process group times out."""

from __future__ import annotations

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


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = WithBuffer().double()
    opt = build_optimizer(model, seed=0)
    ddp = nn.parallel.DistributedDataParallel(model)
    prepare_distributed(ddp, opt, shard=True)
    x = torch.randn(6, 4, dtype=torch.float64)
    for step in range(2):
        with opt.sampled_params(train=True):
            if rank == 1 and step == 1:
                raise ValueError("rank 1 failed before its forward")
            ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
