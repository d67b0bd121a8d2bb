"""Batched BMA (``bma_log_likelihood``, ``generate_bma``, ``BatchedSamples`` materialized and
factored) on an FSDP2-sharded GPT-2 (``fully_shard`` per block and at the root: DTensor
parameters, rows split unevenly over the ranks), each rank on its own prompts.

``tests/test_fsdp2.py`` runs the same calls on the unsharded model and compares (:func:`sharded`, a
scenario of ``tests/fsdp2_edge_worker.py``).
"""

from __future__ import annotations

import fsdp2_worker as worker
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hf_evon import EVONPosterior
from hf_evon.posterior.gaussian import MatrixFactors
from hf_evon.predictive.batched_samples import BatchedSamples
from hf_evon.predictive.generation import bma_log_likelihood, generate_bma

SEED, SAMPLES, NEW_TOKENS = 5, 3, 3
VOCAB = 45  # rows of the tied wte / lm_head: 23 + 22 over 2 ranks


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=10, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="eager", eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config).double().eval()


def posterior(net: torch.nn.Module) -> EVONPosterior:
    """Factors (random orthonormal bases, float64) for every matrix but the position embedding,
    the tied wte / lm_head included (an embedding and a linear owner of one parameter)."""
    shapes = {name: tuple(p.shape) for name, p in net.named_parameters() if p.dim() == 2}
    del shapes["transformer.wpe.weight"]
    return worker.random_posterior(shapes, 30.0)


def prompts(rank: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 4), generator=torch.Generator().manual_seed(100 + rank))


def results(
    net: torch.nn.Module, post: EVONPosterior, ids: torch.Tensor, rank: int, synced_gpus: bool | None
) -> dict:
    """What the test compares: each batched-BMA path's output on ``ids`` (rank ``rank``'s prompts);
    ``synced_gpus`` for the decoding of a rank-dependent number of tokens (True under FSDP2, as
    ``Seq2SeqTrainer`` passes it for an FSDP-managed model)."""
    out = {
        "log_likelihood": bma_log_likelihood(net, post, ids, num_samples=SAMPLES, seed=SEED).sample_token_log_probs,
        "generated": generate_bma(
            net, post, ids, num_samples=SAMPLES, seed=SEED, max_new_tokens=NEW_TOKENS, do_sample=False
        ),
    }
    out["full_adds"] = full_adds(net, post, ids)
    for strategy in ("materialize", "factored"):
        with torch.no_grad(), BatchedSamples(net, post, SAMPLES, seed=SEED, strategy=strategy) as sampler:
            out[strategy] = net(ids.repeat(SAMPLES, 1)).logits
            out[f"{strategy}_factored"] = sorted(sampler.factored)
    # the ranks decode different numbers of tokens: the one done first must go on gathering shards
    out["uneven"] = generate_bma(
        net, post, ids, num_samples=SAMPLES, seed=SEED, max_new_tokens=1 + 3 * rank, do_sample=False,
        synced_gpus=synced_gpus,
    )  # fmt: skip
    return out


def full_adds(net: torch.nn.Module, post: EVONPosterior, ids: torch.Tensor) -> dict[str, int]:
    """The additions of a whole (S, *shape) tensor of a covered parameter (a sample's ``M + ΔW``)
    in a materialized block: in all (its entry and two forwards), and in its second forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    shapes = {(SAMPLES, *post[name].shape) for name in post.names}

    class Adds(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_) and tuple(out.shape) in shapes:
                self.count += 1
            return out

    with torch.no_grad(), Adds() as adds:
        with BatchedSamples(net, post, SAMPLES, seed=SEED, strategy="materialize"):
            net(ids.repeat(SAMPLES, 1))
            before = adds.count
            net(ids.repeat(SAMPLES, 1))
    return {"in_all": adds.count, "second_forward": adds.count - before}


def logits(net: torch.nn.Module, post: EVONPosterior, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each ``BatchedSamples`` strategy's logits on ``ids``."""
    out = {}
    for strategy in ("materialize", "factored"):
        with torch.no_grad(), BatchedSamples(net, post, SAMPLES, seed=SEED, strategy=strategy):
            out[strategy] = net(ids.repeat(SAMPLES, 1)).logits
    return out


def mixed_precision(mesh, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``logits`` of the float64 model sharded with FSDP2's mixed precision, which gathers the
    weights for each forward in float32 (``MixedPrecisionPolicy(param_dtype=torch.float32)``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    net, policy = model(), MixedPrecisionPolicy(param_dtype=torch.float32)
    for block in net.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    return logits(net, posterior(model()), ids)


def not_gathered(mesh) -> str:
    """Batched BMA on a DTensor that no FSDP2 forward gathers (sharded as tensor parallelism does)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    lin = torch.nn.Linear(4, 4).double()
    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
    eye = torch.eye(4, dtype=torch.float64)
    post = EVONPosterior.from_factors({"weight": MatrixFactors(eye, eye, eye + 1, (4, 4), (4, 4), 30.0, 1e-3)})
    try:
        with torch.no_grad(), BatchedSamples(lin, post, 2, seed=SEED, strategy="materialize"):
            lin(torch.zeros(2, 4, dtype=torch.float64))
    except Exception as err:  # noqa: BLE001 - reported to the test
        return f"{type(err).__name__}: {err}"
    return "not refused"


def sharded(mesh, rank: int) -> dict:
    """What the test compares, on ``model()`` ``fully_shard``-ed per block and at the root over ``mesh``,
    on rank ``rank``'s prompts."""
    from torch.distributed.fsdp import fully_shard

    net = model()
    for block in net.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    result: dict = {}
    try:
        result.update(results(net, posterior(model()), prompts(rank), rank, True))
    except Exception as err:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(err).__name__}: {err}"
    result["not_gathered"] = not_gathered(mesh)
    try:
        result["mixed_precision"] = mixed_precision(mesh, prompts(rank))
    except Exception as err:  # noqa: BLE001 - reported to the test
        result["mixed_precision"] = f"{type(err).__name__}: {err}"
    result["after"] = worker.full_weights(net)  # the root's stay gathered after a forward (FSDP2's way)
    return result
