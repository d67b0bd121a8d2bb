"""``EVONPosterior.sampled`` on an FSDP2-sharded model (``fully_shard``: DTensor parameters, rows
split unevenly over the ranks): each rank saves the full weights inside a sample and after it,
the most elements any tensor the sample's set-up made held, and what ``sampled(model)`` without a
seed raised (:func:`sampled`, a scenario of ``tests/fsdp2_edge_worker.py``).

The posterior is given by its factors (random orthonormal bases, float64), so no training is
needed: ``tests/test_fsdp2.py`` compares with the same posterior sampled into the unsharded model.
"""

from __future__ import annotations

import fsdp2_worker as worker
import torch

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


def sampled(mesh) -> dict:
    """On ``worker.net`` sharded over ``mesh``: the full weights inside a sample and after it, the most
    elements a tensor of the sample's set-up held, and what ``sampled(model)`` without a seed raised."""
    model = worker.shard(worker.net(), mesh)
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
    return result
