"""Worker for tests/test_sharding.py: a step one rank refuses from its own share (one EVON matrix,
two ranks), which every rank must refuse alike instead of leaving the others in the step's
collective for ever. The scenarios (argv[2:]) run in one launch, each result saved by
``launcher.run_scenarios``: "no_samples", a step without
``sampled_params`` while some rank owns no noisy matrix; "moved", a step after an AdamW bias (rank 1's)
was recast, which only its owner, holding its state, can see; "block_raised", a step after a
``sampled_params`` block that raised on rank 1 only (and was caught); "overflow", a step whose
AdamW bias (rank 1's) has a gradient too large to square, under ``nonfinite="raise"``; "ddp_moved",
non-sharded DDP, a step after rank 1 alone recast that bias; "param_edit", a step after rank 1 alone
doubled the learning rate of that bias's group; "no_grads" and "ddp_no_grads", a step whose block ran
no backward on rank 1 (sharded and not); "plain_zero_grads", data parallelism by hand (the plain module
given to prepare_distributed), rank 1's loss times 0; "add_group", add_param_group after the sharding;
"steady", a correct step, counting the all-reduces it
runs and the calls of the step's agreed flag. :func:`fsdp2_block_raised`, "block_raised" under FSDP2
(tests/fsdp2_worker.py's model) next to a run of the first block alone, is a scenario of
tests/fsdp2_edge_worker.py."""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist
from torch import nn

from hf_evon import build_optimizer, prepare_distributed


def fsdp2_blocks(rank: int, blocks: int) -> dict:
    """``blocks`` sampled_params blocks (rank 1's second raises after its backward, and is caught),
    then a step, on tests/fsdp2_worker.py's model under FSDP2."""
    import fsdp2_worker as fw
    from torch.distributed.device_mesh import init_device_mesh

    model, opt = fw.make(init_device_mesh("cpu", (dist.get_world_size(),)))
    rows = fw.GLOBAL_BATCH // dist.get_world_size()
    ids, x, y = (t[rank * rows : (rank + 1) * rows] for t in fw.batch(0))
    block_error = ""
    for i in range(blocks):
        try:
            with opt.sampled_params(train=True):
                nn.functional.mse_loss(model(ids, x), y).backward()
                if rank == 1 and i == 1:
                    raise ValueError("a failed logging callback")
        except (ValueError, RuntimeError) as err:
            block_error = str(err)
    samples = opt.recorded_samples
    try:
        opt.step()
        message = ""
    except RuntimeError as err:
        message = str(err)
    return {"message": message, "block_error": block_error, "samples": samples, "weights": fw.full_weights(model)}


def counted(owner: object, name: str, counts: dict[str, int]) -> None:
    """``owner.name`` replaced by a wrapper counting its calls in ``counts[name]``."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


SCENARIOS = (
    "no_samples", "moved", "ddp_moved", "param_edit", "overflow", "block_raised", "no_grads", "ddp_no_grads",
    "plain_zero_grads", "add_group", "steady",
)  # fmt: skip
KEEP: list = []  # every scenario's DDP model, alive to the end (launcher.finish: no DDP destructor runs)


def fsdp2_block_raised(rank: int) -> dict:
    """:func:`fsdp2_blocks`: two blocks (rank 1's second raised), and the first alone."""
    return {"raised": fsdp2_blocks(rank, 2), "alone": fsdp2_blocks(rank, 1)}


def refused_step(rank: int, scenario: str) -> dict:
    """One of ``SCENARIOS``: a correct step, then the scenario's step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    raising = {"nonfinite": "raise"} if scenario == "overflow" else {}
    opt = build_optimizer(model, adamw_patterns=[r"^2\."], seed=0, **raising)  # one EVON matrix: "0.weight"
    # "plain_": data parallelism by hand, the plain module given to prepare_distributed
    ddp = model if scenario.startswith("plain_") else nn.parallel.DistributedDataParallel(model)
    KEEP.append(ddp)
    prepare_distributed(ddp, opt, shard=not scenario.startswith(("ddp_", "plain_")))
    x = torch.randn(6, 4, dtype=torch.float64)
    with opt.sampled_params(train=True):  # a correct first step
        ddp(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    owner = opt.sharding is not None and opt.sharding.owns(model[0].bias)
    block_error = ""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    group = None  # "param_edit": the group edited
    if scenario == "moved" or scenario == "ddp_moved" and rank == 1:
        # "moved": on every rank, only the owner holds the bias's AdamW state; "ddp_moved": every rank
        # holds it, but only rank 1 recast it
        model[0].bias.data = model[0].bias.data.float()
    if scenario in ("moved", "ddp_moved"):
        with opt.sampled_params(train=True):  # the layer run in float32
            bias = model[0].bias
            hidden = torch.tanh(nn.functional.linear(x.to(bias.dtype), model[0].weight.to(bias.dtype), bias))
            model[2](hidden.double()).square().mean().backward()
    elif scenario == "param_edit":  # valid, but on rank 1 only: the owners would apply different rates
        group = next(i for i, g in enumerate(opt.param_groups) if any(p is model[0].bias for p in g["params"]))
        if rank == 1:
            opt.param_groups[group]["lr"] *= 2
        with opt.sampled_params(train=True):
            ddp(x).square().mean().backward()
    elif scenario == "overflow":  # finite, but its square is not: seen by its owner (rank 1) only
        with opt.sampled_params(train=True):
            ddp(x).square().mean().backward()
        model[0].bias.grad.fill_(1e200)
    elif scenario == "block_raised":  # rank 1's second block raises and is caught: one sample fewer there
        for i in range(2):
            try:
                with opt.sampled_params(train=True):
                    ddp(x).square().mean().backward()
                    if rank == 1 and i == 1:
                        raise ValueError("a failed logging callback")
            except (ValueError, RuntimeError) as err:
                block_error = str(err)
    elif scenario in ("no_grads", "ddp_no_grads"):  # rank 1 skips its backward (a loss guard): no gradient
        try:  # sharded: the block's exit averages its gradients, and refuses there
            with opt.sampled_params(train=True):
                loss = ddp(x).square().mean()
                if rank == 0:
                    loss.backward()
        except RuntimeError as err:
            block_error = str(err)
    elif scenario == "plain_zero_grads":  # rank 1's loss times 0 (a batch skipped in step): zero gradients
        with opt.sampled_params(train=True):
            (ddp(x).square().mean() * (0.0 if rank == 1 else 1.0)).backward()
    elif scenario == "add_group":  # a layer unfrozen into a group of its own, after the sharding
        try:
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, 3, dtype=torch.float64))]})
        except RuntimeError as err:
            block_error = str(err)
        with opt.sampled_params(train=True):
            ddp(x).square().mean().backward()
    elif scenario == "steady":
        with opt.sampled_params(train=True):
            ddp(x).square().mean().backward()
    else:
        ddp(x).square().mean().backward()  # the loop forgot sampled_params
    samples = opt.recorded_samples
    counts = {"all_reduce": 0, "all_ranks": 0}
    all_reduce = dist.all_reduce
    if scenario == "steady":  # counted in the step alone
        counted(dist, "all_reduce", counts)
        counted(opt.sharding, "all_ranks", counts)
    try:
        opt.step()
        message = ""
    except (RuntimeError, FloatingPointError) as err:  # FloatingPointError: NonFiniteGradientError
        message = str(err)
    finally:
        dist.all_reduce = all_reduce  # the next scenarios' and the barriers' own
    result = {"message": message, "owner": owner, "block_error": block_error, "samples": samples, "counts": counts}
    result["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
    result["before"], result["group"] = before, group
    return result


def main(out: str, names: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    run_scenarios(out, rank, {name: functools.partial(refused_step, rank, name) for name in SCENARIOS}, names)
    finish()  # exits here: no DDP or process-group destructor runs (launcher.finish)


from launcher import finish, run_scenarios  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    finish()
