"""Edge cases of FSDP2 (``fully_shard``, 2 CPU ranks, gloo) for ``tests/test_fsdp2.py``: the scenarios
(argv[2:], of ``SCENARIOS``) run in one launch, each result saved by ``launcher.run_scenarios``:
``trained`` (``tests/fsdp2_worker.py`` on 2 ranks), ``edge`` (below), ``posterior_sampled``
(``tests/fsdp2_posterior_worker.py``), ``reshard`` (``tests/fsdp2_reshard_worker.py``), ``bma``
(``tests/fsdp2_bma_worker.py``), ``block_raised`` (``tests/sharded_fault_worker.py``'s
``fsdp2_block_raised``) and ``trainer_refused`` (``tests/fsdp2_trainer_worker.py``'s ``refused``:
accelerate's FSDP switch is not patched here). The edge cases:

* ``tiny``: a model whose matrices have fewer rows than ranks (rank 1 holds none of ``c.weight``,
  rank 0 one row of ``b.weight``) trains one step; every rank takes the posterior, rank 0 saves it
  to ``OUT/tiny_posterior``, and every rank saves the full weights;
* ``verdicts``: what each rank's ``mean_mismatches`` says of row- and column-sharded weights;
* ``reshard_after_forward=False``: an evaluation forward that raises inside
  ``EVON.sampled_params(train=False)`` and inside ``posterior.sampled(model, seed=...)`` (a forward
  hook of ``layers.2``), then a forward outside any block and the next training step, against the
  same run without the failed pass; and ``posterior.sampled(model)`` without a seed while the weights
  are gathered (after a forward without backward); ``SequentialSamples``' forward per sample, and
  one after them.
"""

from __future__ import annotations

import os
import sys

import fsdp2_posterior_worker as pw
import fsdp2_worker as worker
import torch
import torch.distributed as dist
from torch import nn

from hf_evon import EVONPosterior, build_optimizer, prepare_distributed

SEED = 3


class Tiny(nn.Module):
    """Matrices of 3, 2 and 1 rows: on 2 ranks ``b.weight`` (2x3) gives rank 0 three values, fewer
    than a fingerprint's 6, and ``c.weight`` (1x2) and ``c.bias`` leave rank 1 an empty shard."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 2), nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def tiny() -> Tiny:
    torch.manual_seed(0)
    return Tiny().double()


def tiny_run(mesh, rank: int, world: int, out: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = tiny()
    for sub in (model.a, model.b, model.c, model):
        fully_shard(sub, mesh=mesh)
    opt = prepare_distributed(model, build_optimizer(model, seed=1, mc_samples=1), shard=True)
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(4, 3, generator=gen, dtype=torch.float64), torch.randn(4, 1, generator=gen, dtype=torch.float64)
    rows = 4 // world
    with opt.sampled_params(train=True):
        nn.functional.mse_loss(model(x[rank * rows : (rank + 1) * rows]), y[rank * rows : (rank + 1) * rows]).backward()
    opt.step()
    post = EVONPosterior.from_optimizer(opt, model)  # a collective: every rank
    if rank == 0:
        post.save_pretrained(f"{out}/tiny_posterior")
    return {"weights": worker.full_weights(model), "fingerprint": post.config.get("mean_fingerprint")}


def verdicts(mesh, rank: int) -> dict:
    """What ``mean_mismatches`` says on this rank of the ``tiny`` model's fingerprint, on rows sharded by
    ``fully_shard`` and on a matrix sharded by columns (``Shard(1)``), for the same weights and moved
    ones, and whether ``warn_if_other_mean`` warned for the moved ones."""
    import warnings

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from hf_evon.posterior.fingerprint import (
        PosteriorMeanWarning,
        mean_fingerprint,
        mean_mismatches,
        warn_if_other_mean,
    )

    def warned(fingerprint, params, names) -> bool:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_if_other_mean(fingerprint, params, names)
        return any(issubclass(w.category, PosteriorMeanWarning) for w in caught)

    names = ["a.weight", "b.weight", "c.weight"]
    fingerprint = mean_fingerprint(dict(tiny().named_parameters()), names)
    model = tiny()
    for sub in (model.a, model.b, model.c, model):
        fully_shard(sub, mesh=mesh)
    params = dict(model.named_parameters())
    out = {"rows_same": mean_mismatches(fingerprint, params, names)}
    with torch.no_grad():
        model.b.weight.add_(1.0)  # every rank's rows
    out["rows_moved"] = mean_mismatches(fingerprint, params, names)
    out["rows_warned"] = warned(fingerprint, params, names)
    w = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    moved = w.clone()
    moved[0, 1] += 1.0  # rank 0 holds columns 0 and 1
    cols = {"w": distribute_tensor(w, mesh, [Shard(1)])}
    cols_moved = {"w": distribute_tensor(moved, mesh, [Shard(1)])}
    out["cols_fingerprint"] = mean_fingerprint(cols, ["w"])
    out["cols_same"] = mean_mismatches(mean_fingerprint({"w": w}, ["w"]), cols, ["w"])
    out["cols_moved"] = mean_mismatches(mean_fingerprint({"w": w}, ["w"]), cols_moved, ["w"])
    out["cols_warned"] = warned(mean_fingerprint({"w": w}, ["w"]), cols_moved, ["w"])
    return out


class Raised(Exception):
    """The evaluation forward's failure."""


def raise_in_forward(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    raise Raised("an evaluation forward failed")


def run(mesh, rank: int, world: int, failing: str | None) -> dict:
    """Two steps; after the first a failing evaluation pass (``failing``: "evon", "posterior" or
    None), then a forward outside any block."""
    model = worker.shard(worker.net(), mesh, reshard_after_forward=False)
    dtensors = dict(model.named_parameters())  # the shards (a gathered module holds other tensors)
    opt = prepare_distributed(model, build_optimizer(model, adamw_patterns=[r"^emb\."], **worker.HP))
    rows = worker.GLOBAL_BATCH // world
    out: dict = {"trace": []}
    for step in range(2):
        ids, x, y = (t[rank * rows : (rank + 1) * rows] for t in worker.batch(step))
        for _ in range(opt.mc_samples):
            with opt.sampled_params(train=True):
                nn.functional.mse_loss(model(ids, x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 0 and failing is not None:
            hook = model.layers[2].register_forward_hook(raise_in_forward)
            block = opt.sampled_params(train=False) if failing == "evon" else pw.posterior().sampled(model, seed=SEED)
            try:
                with block, torch.no_grad():
                    model(ids, x)
            except Raised:
                out["raised"] = True
            finally:
                hook.remove()
            out["mean"] = {n: p.detach().full_tensor() for n, p in dtensors.items()}
            with torch.no_grad():
                out["ids"], out["x"], out["out"] = ids, x, model(ids, x)
        out["trace"].append({n: p.detach().full_tensor() for n, p in dtensors.items()})
    return out


def seed_none_gathered(mesh) -> dict:
    model = worker.shard(worker.net(), mesh, reshard_after_forward=False)
    ids, x, _ = worker.batch(0)
    with torch.no_grad():
        model(ids, x)  # no backward: the weights stay gathered
    gathered = sorted({type(p).__name__ for p in model.parameters()})
    error = worker.expect_error(lambda: pw.posterior().sampled(model).__enter__())
    return {"gathered": gathered, "error": error, "after": worker.full_weights(model)}


def sequential(mesh) -> dict:
    """``SequentialSamples``' forwards, one per sample, under ``reshard_after_forward=False``."""
    from hf_evon.predictive.sequential_samples import SequentialSamples

    model = worker.shard(worker.net(), mesh, reshard_after_forward=False)
    ids, x, _ = worker.batch(0)
    with torch.no_grad(), SequentialSamples(model, pw.posterior(), 3, seed=SEED) as samples:
        outs = samples.each(lambda: model(ids, x))
        after = model(ids, x)
    return {"outs": outs, "after": after, "weights": worker.full_weights(model)}


SCENARIOS = ("trained", "edge", "posterior_sampled", "reshard", "bma", "block_raised", "trainer_refused")


def edge_cases(mesh, rank: int, world: int, out: str) -> dict:
    """The edge cases above, each its result or the error it raised."""
    result: dict = {}
    for key, fn in (
        ("tiny", lambda: tiny_run(mesh, rank, world, out)),
        ("verdicts", lambda: verdicts(mesh, rank)),
        ("plain", lambda: run(mesh, rank, world, None)),
        ("evon", lambda: run(mesh, rank, world, "evon")),
        ("posterior", lambda: run(mesh, rank, world, "posterior")),
        ("seed_none", lambda: seed_none_gathered(mesh)),
        ("sequential", lambda: sequential(mesh)),
    ):
        try:
            result[key] = fn()
        except Exception as err:  # noqa: BLE001 - reported to the test
            result[key] = f"{type(err).__name__}: {err}"
    return result


def main(out: str, names: list[str]) -> None:
    import fsdp2_bma_worker as bw
    import fsdp2_reshard_worker as rw
    import fsdp2_trainer_worker as tw
    import sharded_fault_worker as fw
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    scenarios = {
        "trained": lambda: worker.results(mesh, rank, world, out),
        "edge": lambda: edge_cases(mesh, rank, world, out),
        "posterior_sampled": lambda: pw.sampled(mesh),
        "reshard": lambda: rw.variants(mesh, rank, world),
        "bma": lambda: bw.sharded(mesh, rank),
        "block_raised": lambda: fw.fsdp2_block_raised(rank),
        "trainer_refused": lambda: tw.refused(os.path.join(out, "trainer_refused")),
    }
    run_scenarios(out, rank, scenarios, names)
    finish()  # exits here: no process-group destructor runs (launcher.finish)

from launcher import finish, run_scenarios  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    finish()
