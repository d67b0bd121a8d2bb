"""``EVONPosterior.sampled`` on an FSDP2-sharded model (``fully_shard``: DTensor parameters, rows
split unevenly over the ranks): each rank saves the full weights inside a sample and after it,
the most elements any tensor the sample's set-up made held, and what ``sampled(model)`` without a
seed raised.

The posterior is given by its factors (random orthonormal bases, float64), so no training is
needed: ``tests/test_fsdp2.py`` compares with the same posterior sampled into the unsharded model.
"""

from __future__ import annotations

import sys

import fsdp2_worker as worker
import torch
import torch.distributed as dist

from hf_evon import EVONPosterior

SEED = 3


def posterior() -> EVONPosterior:
    """Factors for every EVON-shaped matrix of ``worker.Net`` (7×7), float64, reproducible."""
    dim = worker.DIM
    return worker.random_posterior({f"layers.{i}.weight": (dim, dim) for i in range(worker.DEPTH)}, 50.0)


def largest_tensor(fn) -> int:
    """The most elements of any tensor an operator returns while ``fn`` runs (a DTensor counts
    whole: its global shape)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.numel = max([self.numel, *sizes])
            return out

    with Largest() as mode:
        fn()
    return mode.numel


def main(out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)
    model = worker.shard(worker.net(), init_device_mesh("cpu", (world,)))
    result = {}
    try:
        with posterior().sampled(model, seed=SEED):
            result["sample"] = worker.full_weights(model)
    except Exception as err:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(err).__name__}: {err}"
    result["after"] = worker.full_weights(model)
    post = posterior()

    def enter_and_leave() -> None:
        with post.sampled(model, seed=SEED):
            pass

    try:
        result["largest"] = largest_tensor(enter_and_leave)
    except Exception as err:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(err).__name__}: {err}"
    result["seed_none"] = worker.expect_error(lambda: posterior().sampled(model).__enter__())
    result["after_seed_none"] = worker.full_weights(model)
    save_and_finish(result, out, rank)  # exits here: no process-group destructor runs (launcher.finish)


from launcher import finish, save_and_finish  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1])
    finish()
