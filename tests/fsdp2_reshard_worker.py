"""``sampled_params(train=False)`` blocks between the steps of an FSDP2 model whose forward leaves
the weights gathered (``reshard_after_forward=False``; the root of a lone ``fully_shard(model)``
by default). Each rank saves, per variant, the full weights after every step of a run with such
blocks and of one without, and per block its inputs, output and the sample its shards hold
(:func:`variants`, a scenario of ``tests/fsdp2_edge_worker.py``).
"""

from __future__ import annotations

import fsdp2_worker as worker
import torch
from torch import nn

from hf_evon import build_optimizer, prepare_distributed

STEPS = 2


def shard(mesh, variant: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = worker.net()
    if variant == "no_reshard":
        return worker.shard(model, mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)  # "root": one group, kept gathered after a forward
    return model


def run(mesh, rank: int, world: int, variant: str, evals: bool) -> dict:
    model = shard(mesh, variant)
    dtensors = dict(model.named_parameters())  # the shards (a gathered module holds other tensors)
    opt = prepare_distributed(model, build_optimizer(model, adamw_patterns=[r"^emb\."], **worker.HP))
    rows = worker.GLOBAL_BATCH // world
    trace, blocks = [], []
    for step in range(STEPS):
        ids, x, y = (t[rank * rows : (rank + 1) * rows] for t in worker.batch(step))
        for _ in range(opt.mc_samples):
            with opt.sampled_params(train=True):
                nn.functional.mse_loss(model(ids, x), y).backward()
        opt.step()
        opt.zero_grad()
        for _ in range(2 if evals else 0):
            with opt.sampled_params(train=False), torch.no_grad():
                held = {n: p.detach().full_tensor() for n, p in dtensors.items()}
                blocks.append({"ids": ids, "x": x, "out": model(ids, x), "sample": held})
        trace.append({n: p.detach().full_tensor() for n, p in dtensors.items()})
    return {"trace": trace, "blocks": blocks}


def variants(mesh, rank: int, world: int) -> dict:
    """Each variant's runs with and without evaluation blocks (or the error it raised)."""
    result = {}
    for variant in ("no_reshard", "root"):
        try:
            result[variant] = {evals: run(mesh, rank, world, variant, evals) for evals in (True, False)}
        except Exception as err:  # noqa: BLE001 - reported to the test
            result[variant] = f"{type(err).__name__}: {err}"
    return result
