"""Work- and state-sharded EVON under data parallelism (DDP): each rank owns some matrices.

Why: without sharding every rank holds all of EVON's state (~39 bytes per covered parameter)
and repeats every rotation and eigenbasis refresh. With ``prepare_distributed(model, opt,
shard=True)`` each rank *owns* a share of the optimizer's parameters, balanced by cost and
identical on every rank (:func:`assign_owners`); it allocates state only for them, and does
only their maths (perturbation, Hessian estimate, update, refresh). AdamW-trained
parameters are owned the same way. Per-rank state and optimizer FLOPs fall about 1/world.

Exchanges (all exact: values are copied, never re-computed elsewhere):

* a ``sampled_params`` block: each owner writes its matrices' posterior sample and
  broadcasts the sampled weights; the other ranks keep their mean and receive the sample;
* its exit (``train=True``): the block's gradients are averaged across ranks (the owner needs
  the *averaged* gradient of each sample to form its Hessian numerator ``G°_s ⊙ z_s``);
* ``step()``: owners update their parameters and broadcast the new weights, so every rank's
  weights stay bit-identical; a non-finite step is skipped by all ranks together.

Noise semantics (what makes world sizes comparable): in sharded mode the posterior sample is
*one* sample shared by all ranks, and matrix ``k`` (its position among the optimizer's EVON
parameters) draws its standard normal ``z`` from its own stream seeded by ``(seed, k,
sampled_params block)``, independent of the world size and of who owns it. With equal
per-rank batches and a mean loss, the rank average of the gradients is the gradient of the
concatenated batch, so a run on W ranks with batch b per rank equals (to rounding) a one-process
sharded run (``shard=True`` in a single process: world 1, the reference) with batch W·b and the
same seed, while each Shampoo statistic has a unique eigenbasis. A rank-deficient one leaves the
basis of its null space to rounding, which the ranks' summation order changes: the sample then
differs there (same draw ``z``, same covariance, another basis), and the runs part from that step
on; ``ess=inf`` and ``identity_basis=True`` runs stay equal. Non-sharded DDP instead gives each
rank its own noise (W samples per step).

Under FSDP2 (``fully_shard``), :class:`hf_evon.distributed.fsdp2.FSDP2Sharding` extends this class:
the same ownership, noise streams and checkpoint format, with the matrices' rows exchanged.

Checkpoints: ``state_dict()`` is a collective that returns the *full* state on every rank
(the same format as a non-sharded optimizer's); ``load_state_dict`` keeps only this rank's
part. Every rank must call ``state_dict()`` (the Trainer integration does); posteriors
(``EVONPosterior.from_optimizer``) gather the factors the same way.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from hf_evon.distributed.averaging import RankAverager, settings_differ, settings_key
from hf_evon.optim.buckets import Bucket, matrix_shape, preconditioned_sides, state_dtype
from hf_evon.optim.hooks import ShardingHooks
from hf_evon.optim.noise import derived_seed

if TYPE_CHECKING:
    from hf_evon.optim.evon import EVON

Tensor = torch.Tensor

__all__ = [
    "EVONSharding",
    "assign_owners",
    "block_raised_on",
    "cpu_copy",
    "fresh_state",
    "optimizer_state_bytes",
    "parameter_cost",
]


def block_raised_on(rank: int) -> str:
    """Why a ``sampled_params(train=True)`` block that completed here is recorded on no rank."""
    return (
        f"EVON: the sampled_params(train=True) block raised on rank {rank}, so this block is "
        "recorded on no rank (the gradients are as before it): run the same blocks on every "
        "rank, or let the error stop every rank"
    )


def parameter_cost(p: Tensor, group: dict[str, Any]) -> float:
    """Optimizer FLOPs per step (up to a constant) that owning ``p`` costs.

    EVON: eigenbasis work ``m³ + n³`` (sides with a basis) plus rotations ``m·n·(m+n)``;
    AdamW: elementwise, ``numel``.
    """
    if group.get("algorithm", "evon") != "evon":
        return float(p.numel())
    m, n = matrix_shape(p.shape)
    left, right = preconditioned_sides(tuple(p.shape), group)
    return float(m**3 * left + n**3 * right + m * n * ((m if left else 0) + (n if right else 0)) + m * n)


def assign_owners(costs: list[float], world: int) -> list[int]:
    """Owner rank of each item: largest cost first to the least-loaded rank (ties: lowest
    rank, then the earlier item). Deterministic, so every rank computes the same answer."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, r) for r in range(world)]
    owners = [0] * len(costs)
    for i in order:
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    return owners


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state``, each storage counted once (EVON's
    per-parameter entries are views into stacked storage)."""
    seen: dict[int, int] = {}
    for st in optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                s = v.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class EVONSharding(ShardingHooks):
    """Ownership and the exchanges of a sharded EVON (see the module docstring): EVON's
    :class:`~hf_evon.optim.hooks.ShardingHooks` under DDP.

    Args:
        optimizer: the EVON to shard (its parameter groups are final: ownership is fixed here).
        group: the data-parallel process group (default: the world; none: one process).
        model_collectives: whether the model runs collectives of its own (a DDP model's buffers and
            buckets): see :attr:`~hf_evon.optim.hooks.ShardingHooks.model_collectives`.
    """

    def __init__(self, optimizer: EVON, group: Any = None, bucket_cap_mb: float = 64.0, model_collectives: bool = False) -> None:
        self.optimizer, self.model_collectives = optimizer, model_collectives  # the latter: a DDP model
        self.group = group
        self.bucket_cap_mb = bucket_cap_mb  # of the averager's flat buffers (prepare_distributed's)
        initialized = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        self.params: list[Tensor] = []
        ranked: list[Tensor] = []  # the parameters ownership is assigned for
        costs: list[float] = []
        self.index: dict[int, int] = {}  # id(param) -> position among EVON params (noise stream)
        seen: set[int] = set()
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if g["algorithm"] == "evon":
                    self.index[id(p)] = len(self.index)
                self.params.append(p)
                if not self._every_rank_owns(p, g):
                    ranked.append(p)
                    costs.append(parameter_cost(p, g))
        owners = assign_owners(costs, self.world)
        # a parameter missing here is owned by every rank (its own part of it: FSDP2's AdamW shards)
        self.owner: dict[int, int] = {id(p): r for p, r in zip(ranked, owners)}
        self._means: list[tuple[Tensor, Tensor]] = []  # non-owned sampled params' means
        self._generators: dict[torch.device, torch.Generator] = {}  # reseeded per matrix
        self._averager: RankAverager | None = None
        self._factors: dict[int, dict[str, Any]] | None = None  # gathered posterior factors
        self._state: dict[int, Any] | None = None  # gathered state_dict()["state"]
        # both caches hold until the state changes (step, load): see prefetch()

    # ------------------------------------------------------------- ownership
    def new_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """Refused: each parameter's owner, and its noise stream's index, are assigned once, when the
        state is sharded; a parameter added later would be updated by every rank from its own
        gradient, unaveraged, and the ranks' weights would part."""
        raise RuntimeError(
            "EVON.add_param_group() after prepare_distributed(shard=True): the parameters' owners are "
            "assigned when the state is sharded. Give the optimizer every group before that call (a "
            "layer to unfreeze later can sit in its group, frozen, from the start)"
        )

    def _every_rank_owns(self, p: Tensor, group: dict[str, Any]) -> bool:
        """Whether ``p`` is left out of the assignment, each rank owning its own part of it."""
        return False

    def owns(self, p: Tensor) -> bool:
        return self.owner.get(id(p), self.rank) == self.rank

    def owned_members(self, b: Bucket) -> list[int]:
        return [i for i, p in enumerate(b.params) if self.owns(p)]

    def owned_bucket(self, b: Bucket) -> Bucket:
        """The bucket of this rank's members (before any state is stacked)."""
        return b.subset_params(self.owned_members(b))

    def bucket_param(self, p: Tensor) -> Tensor:
        """The tensor that stands for ``p`` in this rank's buckets (``p`` itself under DDP)."""
        return p

    def model_param(self, q: Tensor) -> Tensor:
        """The optimizer's parameter a bucket member stands for (inverse of ``bucket_param``)."""
        return q

    def _src(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    # ------------------------------------------------------------- noise
    def standard_normal(self, b: Bucket) -> Tensor:
        """``z`` for the bucket's members, each from its own matrix's stream (world-independent)."""
        device = b.params[0].device
        opt = self.optimizer
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        out = torch.empty(len(b.params), b.m, b.n, device=device, dtype=b.dtype)
        label = opt.noise_label
        for i, p in enumerate(b.params):
            gen.manual_seed(derived_seed(opt.seed, "matrix", self.index[id(p)], label))
            torch.randn(b.m, b.n, generator=gen, device=device, dtype=b.dtype, out=out[i])
        return out

    # ------------------------------------------------------------- exchanges
    def _broadcast_from_owners(self, params: list[Tensor]) -> None:
        """Every rank's ``params`` take their owner's values (bit-exact copies)."""
        if self.world == 1 or not params:
            return
        works = []
        for r in range(self.world):
            mine = [p for p in params if self.owner[id(p)] == r]
            kinds: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
            for p in mine:
                kinds.setdefault((p.device, p.dtype), []).append(p)
            for (device, dtype), ps in kinds.items():
                if r == self.rank:
                    flat = _flatten_dense_tensors([p.detach() for p in ps])
                else:
                    flat = torch.empty(sum(p.numel() for p in ps), device=device, dtype=dtype)
                work = dist.broadcast(flat, src=self._src(r), group=self.group, async_op=True)
                works.append((r, ps, flat, work))
        for r, ps, flat, work in works:
            work.wait()
            if r != self.rank:
                targets = [p.detach() for p in ps]
                torch._foreach_copy_(targets, list(_unflatten_dense_tensors(flat, targets)))

    def _sampled(self) -> list[Tensor]:
        return [
            p
            for g in self.optimizer.param_groups
            if g["algorithm"] == "evon" and g["ess"] != float("inf")
            for p in g["params"]
            if p.requires_grad
        ]

    def share_sample(self) -> None:
        """After the owners wrote their matrices' samples: every rank gets the sampled weights."""
        if self.world == 1:
            return
        params = self._sampled()
        with torch.no_grad():
            self._means = [(p, p.detach().clone()) for p in params if not self.owns(p)]
            self._broadcast_from_owners(params)

    def end_sample(self, recorded: bool, failed: bool = False) -> str | None:
        """At a block's exit: restore the means of non-owned matrices; average the block's
        gradients (``recorded``: a ``train=True`` block that completed). A ``train=True`` block
        that raised here (``failed``) still joins the averaging's structure check, so every rank
        learns it there and none averages or records the block (none waits for this rank)."""
        with torch.no_grad():
            if self._means:
                torch._foreach_copy_([p.detach() for p, _ in self._means], [m for _, m in self._means])
            self._means = []
            if (recorded or failed) and self.world > 1:
                grads = [p.grad for p in self.params if p.grad is not None]
                device = self.params[0].device if self.params else torch.device("cpu")
                rank = self.averager(grads, failed=failed, device=device)
                if rank is not None and not failed:
                    return block_raised_on(rank)
        return None

    @property
    def averager(self) -> RankAverager:
        if self._averager is None:
            self._averager = RankAverager(group=self.group, bucket_cap_mb=self.bucket_cap_mb)
        return self._averager

    def reduce_gradients(self, tensors: list[Tensor]) -> None:
        """``EVON.gradient_reducer`` in sharded mode: a step without ``sampled_params(train=True)``
        blocks (ess = inf) averages its gradients here; sampled gradients were averaged at exit."""
        if self.optimizer.recorded_samples == 0:
            self.averager([t for t in tensors if t is not None])

    def after_step(self) -> None:
        """Owners' new weights to every rank; gathered factors and state are stale now."""
        self._factors = self._state = None
        with torch.no_grad():
            self._broadcast_from_owners(self.params)

    def all_ranks(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (a step is skipped by all or none). The same all-reduce
        compares the ranks' group hyperparameters (each owner applies its own: a ``param_groups``
        edit on one rank shows nowhere else), and every rank refuses the step where they differ."""
        if self.world == 1:
            return ok
        device = self.params[0].device if self.params else torch.device("cpu")
        settings, key = settings_key(self.optimizer)
        flag = torch.tensor([0 if ok else 1, key, -key], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        bad, hi_key, lo_key = flag.tolist()
        if hi_key != -lo_key:  # name them (rare: one more collective)
            self.optimizer.discard_samples()
            raise RuntimeError(settings_differ(self._gather_objects(settings), settings))
        return bad == 0

    def pool_rows(self, rows: Tensor, count: int) -> tuple[Tensor, int]:
        """Every rank's per-bucket statistics rows (CPU) and element counts, pooled (a
        collective): health checks and logs describe the whole posterior, not one share."""
        parts = self._gather_objects((rows.double(), int(count)))
        return torch.cat([r for r, _ in parts]), sum(c for _, c in parts)

    # ------------------------------------------------------------- state
    def every_rank(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (a collective)."""
        return self._gather_objects(obj)

    def _gather_objects(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def full_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        """The local ``state_dict`` with every rank's entries (a collective unless
        :meth:`prefetch` gathered them since the last step; CPU copies)."""
        if self._state is None:
            local = {k: cpu_copy(v) for k, v in sd["state"].items()}
            merged: dict[int, Any] = {}
            for part in self._gather_objects(local):
                merged.update(part)
            self._state = dict(sorted(merged.items()))
        return {**sd, "state": fresh_state(self._state)}

    def prefetch(self) -> None:
        """Gather the full state and every posterior factor now, on every rank (a collective).

        Why: the Trainer saves the optimizer and the posterior from rank 0 only; after this,
        ``state_dict()`` and ``EVONPosterior.from_optimizer`` need no collective until the next
        step, so rank-0-only code cannot hang waiting for the other ranks.
        """
        self.optimizer.state_dict()
        self.gather_factors()

    def local_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        """A full ``state_dict`` cut to the entries of the parameters this rank owns."""
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        keep = {i for i, p in zip(ids, params) if self.owns(p)}
        self._factors = self._state = None
        return {**sd, "state": {k: v for k, v in sd["state"].items() if k in keep}}

    def gather_factors(self) -> None:
        """Fetch every matrix's posterior factors to every rank (a collective): after this,
        ``posterior_factors`` answers for matrices other ranks own, until the next step."""
        if self._factors is not None:
            return
        opt = self.optimizer
        local = {}
        for p in self.params:
            if id(p) in self.index and self.owns(p):
                f = {**opt.posterior_factors(p), "step": opt.state[p].get("step")}
                local[self.index[id(p)]] = {k: cpu_copy(v) for k, v in f.items()}
        merged: dict[int, dict[str, Any]] = {}
        for part in self._gather_objects(local):
            merged.update(part)
        by_index = {k: p for p in self.params if (k := self.index.get(id(p))) is not None}
        self._factors = {
            id(by_index[k]): {
                key: v.to(by_index[k].device) if torch.is_tensor(v) else v for key, v in f.items()
            }
            for k, f in merged.items()
        }

    def remote_factors(self, p: Tensor) -> dict[str, Any]:
        if self._factors is None or id(p) not in self._factors:
            raise RuntimeError(
                "this EVON is sharded and another rank owns this parameter's posterior: call "
                "optimizer.sharding.gather_factors() on every rank first (EVONPosterior.from_optimizer "
                "does, so call it on every rank)"
            )
        return self._factors[id(p)]

    def state_bytes_expected(self) -> int:
        """Bytes this rank's state should take, computed from shapes alone (for tests/benchmarks)."""
        total = 0
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if not self.owns(p):
                    continue
                size = torch.empty((), dtype=state_dtype(p)).element_size()
                if g["algorithm"] != "evon":
                    total += 2 * p.numel() * p.element_size() + 4
                    continue
                m, n = matrix_shape(p.shape)
                left, right = preconditioned_sides(tuple(p.shape), g)
                # +2: exp_avg_sq_norm and noise_watched; + 4: its float32 update count
                total += size * (2 * m * n + 2 * (m * m * left + n * n * right) + 2) + 4
        return total


def cpu_copy(v: Any) -> Any:
    if torch.is_tensor(v):
        return v.detach().to("cpu", copy=True).contiguous()
    if isinstance(v, dict):
        return {k: cpu_copy(x) for k, x in v.items()}
    return v


def fresh_state(state: dict[Any, Any]) -> dict[Any, Any]:
    """The cached full state in new dicts (its tensors shared): callers may rekey or edit what
    ``state_dict()`` returns (torch's distributed checkpoint renames its keys in place; the cache
    keeps its parameter indices)."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in state.items()}
