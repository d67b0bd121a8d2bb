"""Worker for tests/test_sharding.py: a step without ``sampled_params`` when some rank owns no
noisy matrix (one EVON matrix, two ranks). Every rank must raise the same error; before the fix
the rank that owned nothing went on into the step's collective and waited forever."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from hf_evon import build_optimizer, prepare_distributed


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    opt = build_optimizer(model, adamw_patterns=[r"^2\."], seed=0)  # one EVON matrix: "0.weight"
    ddp = nn.parallel.DistributedDataParallel(model)
    prepare_distributed(ddp, opt, shard=True)
    x = torch.randn(6, 4, dtype=torch.float64)
    with opt.sampled_params(train=True):  # a correct first step
        ddp(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    ddp(x).square().mean().backward()  # the loop forgot sampled_params
    try:
        opt.step()
        message = ""
    except RuntimeError as err:
        message = str(err)
    torch.save({"message": message}, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    finish()  # exits here: no DDP or process-group destructor runs (launcher.finish)


from launcher import finish  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1])
    finish()
