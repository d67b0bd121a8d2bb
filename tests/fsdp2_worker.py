"""Worker for tests/test_fsdp2.py: sharded EVON under FSDP2 (``fully_shard``, gloo, CPU).

Run by ``torch.distributed.run --nproc_per_node W fsdp2_worker.py OUT_DIR``. With W = 1 it
also trains the reference: the same model without FSDP2 in one process with
``prepare_distributed(model, opt, shard=True)`` (the same noise semantics: one shared sample,
one stream per matrix) on the whole batch. Every rank of an FSDP2 run trains on its rows of
each step's global batch (FSDP2 averages the gradients) and saves the full weights after
every step, one posterior sample per step, the gathered state dict, a resumed run's weights,
its state bytes and the posterior; W = 2 also records the errors of refused set-ups. W = 2 runs as
the ``trained`` scenario of ``tests/fsdp2_edge_worker.py`` (:func:`results`), beside the others.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

from hf_evon import EVONPosterior, build_optimizer, check_ranks_in_sync, prepare_distributed
from hf_evon.distributed.sharding import optimizer_state_bytes
from hf_evon.posterior.gaussian import MatrixFactors

STEPS, RESUME_AT, GLOBAL_BATCH, VOCAB, DIM, DEPTH = 5, 3, 12, 11, 7, 5
HP = dict(seed=11, mc_samples=2, precondition_frequency=2, adamw_lr=1e-2)
MAX_NORM = 0.3  # gradient clipping between the samples and the step (binds at some steps)


class Net(nn.Module):
    """An embedding (11 rows, AdamW), five 7x7 EVON matrices with AdamW biases, and a head.

    7 and 11 rows split unevenly over 2 and 3 ranks (4+3, 3+3+1, 6+5, 4+4+3); square
    matrices and 12 rows per step keep every G Gᵀ full rank (a unique eigenbasis).
    """

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(DEPTH))

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + x
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i < DEPTH - 1:
                h = torch.tanh(h)
        return h


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().double()


def shard(model: Net, mesh, **kw) -> Net:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.emb, mesh=mesh, **kw)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def batch(step: int):
    gen = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=gen)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=gen, dtype=torch.float64)
    return ids, x, torch.randn(GLOBAL_BATCH, DIM, generator=gen, dtype=torch.float64)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a whole tensor (a collective for DTensors)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def random_posterior(shapes: dict[str, tuple[int, int]], ess: float) -> EVONPosterior:
    """Factors for the ``(m, n)`` matrices ``shapes`` names: random orthonormal bases and a
    curvature in [0.5, 1.5), float64, reproducible (one generator, seed 0, drawn in ``shapes``'
    order), weight decay 1e-3: a posterior given without training."""
    gen = torch.Generator().manual_seed(0)

    def basis(k: int) -> torch.Tensor:
        return torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64))[0]

    factors = {}
    for name, (m, n) in shapes.items():
        q_l, q_r, hess = basis(m), basis(n), torch.rand(m, n, generator=gen, dtype=torch.float64) + 0.5
        factors[name] = MatrixFactors(q_l, q_r, hess, (m, n), (m, n), ess, 1e-3)
    return EVONPosterior.from_factors(factors)


def make(mesh=None, **hp):
    model = net()
    if mesh is not None:
        shard(model, mesh)
    opt = build_optimizer(model, adamw_patterns=[r"^emb\."], **{**HP, **hp})
    return model, prepare_distributed(model, opt, shard=True)


def train(model, opt, start, stop, rank, world, trace=None, samples=None, norms=None, clip_every=1) -> None:
    rows = GLOBAL_BATCH // world
    for step in range(start, stop):
        ids, x, y = (t[rank * rows : (rank + 1) * rows] for t in batch(step))
        for s in range(opt.mc_samples):
            with opt.sampled_params(train=True):
                if samples is not None and s == 0:
                    samples.append(full_weights(model))  # what the forward pass sees
                nn.functional.mse_loss(model(ids, x), y).backward()
        if step % clip_every:
            opt.step()
            opt.zero_grad()
            if trace is not None:
                trace.append(full_weights(model))
            continue
        # the sum of the samples' gradients (DTensors under FSDP2: clip_grad_norm_ handles them)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM * opt.mc_samples)
        if norms is not None:
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm) / opt.mc_samples)
        opt.step()
        opt.zero_grad()
        if trace is not None:
            trace.append(full_weights(model))


def run(mesh, rank: int, world: int, out: str, tag: str) -> dict:
    model, opt = make(mesh)
    trace: list = []
    samples: list = []
    norms: list = []
    train(model, opt, 0, RESUME_AT, rank, world, trace, samples, norms)
    checkpoint = {"model": full_weights(model), "optim": opt.state_dict()}
    train(model, opt, RESUME_AT, STEPS, rank, world, trace, samples, norms)
    result = {
        "norms": norms,
        "world": world,
        "trace": trace,
        "samples": samples,
        "full_state": opt.state_dict(),
        "state_bytes": optimizer_state_bytes(opt),
        "state_bytes_expected": opt.sharding.state_bytes_expected(),
        "owned": [opt.sharding.owns(p) for g in opt.param_groups for p in g["params"]],
        "health": opt.posterior_health(warn=False),
    }
    posterior = EVONPosterior.from_optimizer(opt, model)  # every rank: it gathers
    # gathered, so every rank answers for every matrix
    result["std"] = {
        n: opt.posterior_std(p).clone() for n, p in model.named_parameters() if n.endswith("layers.0.weight")
    }
    if rank == 0:
        posterior.save_pretrained(os.path.join(out, f"posterior_{tag}"), model_card=False)
        torch.save(checkpoint, os.path.join(out, f"checkpoint_{tag}.pt"))

    # resume: fresh objects, the checkpoint (model weights written from full tensors), same steps
    model2, opt2 = make(mesh)
    if mesh is None:
        model2.load_state_dict(checkpoint["model"])
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model2, checkpoint["model"], options=StateDictOptions(full_state_dict=True))
    opt2.load_state_dict(checkpoint["optim"])
    train(model2, opt2, RESUME_AT, STEPS, rank, world)
    result["resumed"] = full_weights(model2)
    check_ranks_in_sync(model2, opt2)  # DTensor rows differ by design: checks the rest, no crash
    result["resumed_state"] = opt2.state_dict()

    # one sample per step (the owners reuse the gradients gathered at its exit unless they
    # changed), clipped at every other step only
    model3, opt3 = make(mesh, mc_samples=1)
    single: list = []
    train(model3, opt3, 0, STEPS, rank, world, single, clip_every=2)
    result["single"] = single
    return result


def nonfinite(mesh, rank: int, world: int) -> dict:
    """A NaN in one rank's rows of one matrix's gradient: every rank skips the step together,
    weights and state unchanged, and the warning names the matrix on the rank that holds it."""
    import warnings

    model, opt = make(mesh)
    train(model, opt, 0, 2, rank, world)
    before = full_weights(model)
    state = opt.state_dict()
    ids, x, y = batch(9)
    with opt.sampled_params(train=True):
        nn.functional.mse_loss(model(ids, x), y).backward()
    with opt.sampled_params(train=True):
        nn.functional.mse_loss(model(ids, x), y).backward()
    if rank == world - 1:
        model.layers[3].weight.grad._local_tensor[0, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    opt.zero_grad()
    after = opt.state_dict()
    same_state = all(
        torch.equal(v, after["state"][i][k]) for i, st in state["state"].items() for k, v in st.items()
    )
    weights = full_weights(model)
    return {
        "skipped": opt.skipped_steps,
        "unchanged": all(torch.equal(before[k], weights[k]) for k in before) and same_state,
        "messages": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    }


def expect_error(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test checks the type and message
        return f"{type(err).__name__}: {err}"
    return None


def refusals(mesh, world: int) -> dict[str, str | None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor import Shard

    def prepare(model, **kw):
        return prepare_distributed(model, build_optimizer(model, adamw_patterns=[r"^emb\."], **HP), **kw)

    def dim1():  # matrices sharded on their second dimension (even columns: FSDP2 needs that)
        model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 4)).double()
        fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else Shard(0))
        prepare_distributed(model, build_optimizer(model, **HP))

    def hsdp():
        prepare(shard(net(), init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))))

    def mixed():  # one layer on a mesh of its own
        model = net()
        other = init_device_mesh("cpu", (world,), mesh_dim_names=("other",))
        fully_shard(model.layers[2], mesh=other)
        for mod in (model.emb, *model.layers[:2], *model.layers[3:], model):
            fully_shard(mod, mesh=mesh)
        prepare(model)

    def partly():
        model = net()
        fully_shard(model.layers[0], mesh=mesh)  # the root's own parameters stay plain
        prepare(model)

    def unsharded_mode():
        prepare(shard(net(), mesh), shard=False)

    def not_prepared():
        model = shard(net(), mesh)
        opt = build_optimizer(model, adamw_patterns=[r"^emb\."], **HP)
        with opt.sampled_params(train=True):
            pass

    def fsdp1():
        model = FullyShardedDataParallel(net(), device_id=torch.device("cpu"))
        prepare(model)

    return {
        "dim1": expect_error(dim1),
        "hsdp": expect_error(hsdp),
        "mixed": expect_error(mixed),
        "partly": expect_error(partly),
        "unsharded_mode": expect_error(unsharded_mode),
        "not_prepared": expect_error(not_prepared),
        "fsdp1": expect_error(fsdp1),
    }


def results(mesh, rank: int, world: int, out: str) -> dict:
    """What this rank saves (see the module's docstring), its files written under ``out``."""
    result = {"fsdp2": run(mesh, rank, world, out, "fsdp2")}
    if world == 1:
        result["reference"] = run(None, rank, world, out, "reference")
    if world > 1:
        result["nonfinite"] = nonfinite(mesh, rank, world)
    if world == 2:
        try:
            result["refusals"] = refusals(mesh, world)
        except Exception:  # noqa: BLE001 - reported to the test
            result["refusals_crash"] = traceback.format_exc()
    return result


def main(out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    result = results(mesh, rank, world, out)
    save_and_finish(result, out, rank)  # exits here: no DDP or process-group destructor runs


from launcher import finish, save_and_finish  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1])
    finish()
