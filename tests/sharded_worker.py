"""Worker for tests/test_sharding.py: sharded EVON under DDP (gloo, CPU), any world size.

Run by ``torch.distributed.run --nproc_per_node W sharded_worker.py OUT_DIR`` (W = 1 is the
single-process reference). Every rank trains the same tiny float64 model on its rows of each
step's global batch and saves what the test compares: the weights after every step, its
state bytes, the full (gathered) state dict, a resumed run's weights and the posterior. W = 2 runs
as the ``sharded`` scenario of ``tests/sharded_trainer_worker.py`` (:func:`results`), after its
Trainer runs.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from hf_evon import EVONPosterior, build_optimizer, check_ranks_in_sync, prepare_distributed
from hf_evon.distributed.sharding import optimizer_state_bytes

STEPS, RESUME_AT, GLOBAL_BATCH = 6, 3, 12
HP = dict(seed=7, mc_samples=2, precondition_frequency=2, adamw_lr=1e-2)


def tiny_model(seed: int = 0) -> nn.Module:
    """Eight 8x8 matrices (balanced ownership; the 8th, "14.", trained by AdamW) and biases.

    Square matrices and 12 rows per step keep every G Gᵀ full rank: a degenerate eigenspace
    has no unique eigenbasis, and rounding alone would pick different ones in different runs.
    """
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=gen, dtype=torch.float64)
    return x, torch.randn(GLOBAL_BATCH, 8, generator=gen, dtype=torch.float64)


def make(world: int, frozen: str | None = None):
    model = tiny_model()
    opt = build_optimizer(model, adamw_patterns=[r"^14\."], **HP)  # the last Linear: AdamW
    if frozen is not None:  # frozen after the optimizer took it: a bucket member without gradient
        model.get_parameter(frozen).requires_grad_(False)
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    handle = prepare_distributed(ddp, opt, shard=True)
    return model, ddp, handle


def train(
    model,
    ddp,
    opt,
    start: int,
    stop: int,
    rank: int,
    world: int,
    trace: list | None = None,
    samples: list | None = None,
) -> None:
    rows = GLOBAL_BATCH // world
    for step in range(start, stop):
        x, y = batch(step)
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        for _ in range(opt.mc_samples):
            with opt.sampled_params(train=True):
                if samples is not None:
                    samples.append({k: v.detach().clone() for k, v in model.state_dict().items()})
                nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        if trace is not None:
            trace.append({k: v.detach().clone() for k, v in model.state_dict().items()})


RD_DIM, RD_ROWS, RD_STEPS = 16, 6, 3  # 16x16 matrices, 6 rows per step: rank-deficient statistics


def rank_deficient(rank: int, world: int, identity_basis: bool = False) -> dict:
    """Two 16x16 EVON matrices trained on 6 rows per step (divided over the ranks), one
    training sample per step: each step's L = G Gᵀ and R = Gᵀ G have rank ≤ 6, so the
    eigenvectors of their zero eigenvalue are any basis of a null space. Saves, by name, the
    means after each step, each step's sample, its draw in the eigenbasis (``current_noise``,
    each rank its own matrices) and the gathered state after each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(RD_DIM, RD_DIM), nn.Tanh(), nn.Linear(RD_DIM, RD_DIM)).double()
    opt = build_optimizer(
        model, seed=7, mc_samples=1, precondition_frequency=1, ess=1e4, identity_basis=identity_basis
    )
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = prepare_distributed(ddp, opt, shard=True)
    name_of = {id(p): n for n, p in model.named_parameters()}
    order = [name_of[id(p)] for g in opt.param_groups for p in g["params"]]
    evon = [p for g in opt.param_groups if g["algorithm"] == "evon" for p in g["params"]]
    rows = RD_ROWS // world
    out: dict = {"means": [], "samples": [], "noise": [], "state": [], "groups": None}
    for step in range(RD_STEPS):
        gen = torch.Generator().manual_seed(200 + step)
        x = torch.randn(RD_ROWS, RD_DIM, generator=gen, dtype=torch.float64)
        y = torch.randn(RD_ROWS, RD_DIM, generator=gen, dtype=torch.float64)
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        with opt.sampled_params(train=True):
            out["samples"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
            if step > 0:  # the first sample has no eigenbasis (and no draw kept)
                mine = [p for p in evon if opt.sharding.owns(p)]
                out["noise"].append({name_of[id(p)]: opt.current_noise(p).clone() for p in mine})
            nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        out["means"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
        sd = opt.state_dict()  # every rank: it gathers
        out["state"].append({order[i]: st for i, st in sd["state"].items()})
        out["groups"] = sd["param_groups"]
    return out


def results(out: str, world: int, rank: int) -> dict:
    """What this rank saves (see the module's docstring), its files written under ``out``."""
    model, ddp, opt = make(world)
    trace: list = []
    samples: list = []
    train(model, ddp, opt, 0, RESUME_AT, rank, world, trace, samples)
    checkpoint = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": opt.state_dict()}
    if rank == 0:
        torch.save(checkpoint, os.path.join(out, "checkpoint.pt"))
    train(model, ddp, opt, RESUME_AT, STEPS, rank, world, trace)
    final_state = opt.state_dict()
    result = {
        "world": world,
        "trace": trace,
        "samples": samples,
        "state_bytes": optimizer_state_bytes(opt),
        "state_bytes_expected": opt.sharding.state_bytes_expected(),
        "owned": [opt.sharding.owns(p) for g in opt.param_groups for p in g["params"]],
        "full_state": final_state,
        "health": opt.posterior_health(warn=False),  # every rank: it pools the ranks' shares
    }
    posterior = EVONPosterior.from_optimizer(opt, model)  # every rank: it gathers
    if rank == 0:
        posterior.save_pretrained(os.path.join(out, "posterior"), model_card=False)

    # resume: fresh objects, the checkpoint, the same steps again
    model2, ddp2, opt2 = make(world)
    model2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["optim"])
    train(model2, ddp2, opt2, RESUME_AT, STEPS, rank, world)
    result["resumed"] = {k: v.detach().clone() for k, v in model2.state_dict().items()}
    result["resumed_state"] = opt2.state_dict()
    check_ranks_in_sync(ddp2, opt2)

    # a frozen EVON matrix in the optimizer: never perturbed, never updated
    model3, ddp3, opt3 = make(world, frozen="6.weight")
    frozen: list = []
    train(model3, ddp3, opt3, 0, 3, rank, world, frozen)
    result["frozen"] = frozen
    result["rank_deficient"] = rank_deficient(rank, world)
    result["rank_deficient_identity"] = rank_deficient(rank, world, identity_basis=True)
    return result


def main(out: str) -> None:
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.set_num_threads(1)
    torch.save(results(out, world, rank), os.path.join(out, f"rank{rank}.pt"))
    if dist.is_initialized():
        finish()  # exits here: no DDP or process-group destructor runs (launcher.finish)


from launcher import finish  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1])
    finish()
