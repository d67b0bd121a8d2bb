"""Sharded EVON under FSDP2 (``torch.distributed.fsdp.fully_shard``): whole matrices at their owners.

FSDP2 stores each parameter as a DTensor sharded on dim 0 over a 1-D device mesh (``Shard(0)``,
``torch.chunk`` rows: the last ranks may hold fewer rows, or none) and averages gradients by a
reduce-scatter, so after ``backward`` each rank holds its rows of the *averaged* gradient. EVON's
posterior and eigenbasis are defined per whole matrix, so :class:`FSDP2Sharding` extends the
DDP work sharding (:class:`~hf_evon.distributed.sharding.EVONSharding`, same ownership, noise streams
and checkpoint format) with row exchanges:

* the owner of a matrix keeps a full copy of it (its *proxy*; one ``m×n`` tensor in the
  parameter's dtype, plus its gradient while a step is prepared). EVON's buckets hold the
  proxies, so every rotation, refresh and update runs batched on whole matrices, exactly as in
  one process;
* gradients to owners: at each ``sampled_params(train=True)`` exit (the sample's Hessian
  numerator needs its gradient) and at ``step()`` (the step's accumulated, possibly clipped,
  gradient; skipped when every rank's rows are still those sent at the last exit, as with one
  unclipped sample per step), one ``all_to_all`` per dtype sends every rank's rows of each
  matrix to its owner. FSDP2's reduce-scatter averaged them already: EVON adds no reduction;
* weights from owners: each sample (at the block's entry) and each new mean (after ``step()``)
  go back by one ``all_to_all`` per dtype, every rank writing its own rows into the DTensor's
  local shard. Every rank keeps its own rows of the mean during a block and restores them at the
  exit (exact copies);
* the owners' copies are refreshed from the shards (a gather) whenever a shard was written by
  anyone but the optimizer (``load_state_dict`` of the model, user code): checked by the
  tensors' version counters, agreed on by one tiny all-reduce per block and step;
* AdamW parameters (embeddings, heads, biases) are elementwise: every rank updates its own rows
  of them with AdamW state of its rows only (like ZeRO); ``state_dict()`` gathers those rows.

Supported: every optimizer parameter a DTensor with placements ``(Shard(0),)`` on one 1-D mesh
(``fully_shard`` of the layers and of the root). Anything else (``Shard(1)``, HSDP's 2-D mesh,
``Replicate``/``Partial`` placements, several meshes, plain tensors next to DTensors) is refused
by :func:`hf_evon.distributed.ddp.prepare_distributed` with the parameter's name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hf_evon.distributed.sharding import EVONSharding, block_raised_on, cpu_copy, fresh_state
from hf_evon.optim.buckets import Bucket

if TYPE_CHECKING:
    from hf_evon.optim.evon import EVON

Tensor = torch.Tensor

__all__ = ["FSDP2Sharding", "first_rows_value", "shard_rows"]


def first_rows_value(value: Any, params: Any) -> Any:
    """``value`` as the rank holding the first rows of ``params`` computed it, on every rank of their
    mesh, where one of ``params`` is a DTensor of a mesh over more than one rank (``value`` itself
    elsewhere): what only that rank can read (a posterior's ``mean_fingerprint`` compared with the
    weights' leading entries) is decided there and sent to all, so that no two ranks decide apart.
    A collective where it sends: every rank of the mesh calls it."""
    mesh = next((p.device_mesh for p in params if hasattr(p, "device_mesh")), None)
    if mesh is None or mesh.ndim != 1 or mesh.size() < 2 or not dist.is_initialized():
        return value
    group = mesh.get_group()
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``(offset, length)`` of ``rank``'s rows of a dim-0 shard (``torch.chunk`` semantics)."""
    chunk = -(-rows // world) if rows else 0
    start = min(rank * chunk, rows)
    return start, max(min(chunk, rows - start), 0)


def _local(p: Tensor) -> Tensor:
    """The DTensor's local shard (fetched each time: FSDP2 may re-point it at lazy init)."""
    return p._local_tensor


class FSDP2Sharding(EVONSharding):
    """Work-sharded EVON on FSDP2-sharded (``Shard(0)``, 1-D mesh) parameters (module docstring).

    Args:
        optimizer: the EVON whose parameters are the FSDP2 DTensors.
        mesh: their 1-D device mesh (its process group is the data-parallel group).
        modules: the model's ``fully_shard``-ed modules, resharded before EVON writes the shards.
    """

    fsdp2 = True

    def __init__(self, optimizer: EVON, mesh: Any, modules: list[Any] | tuple[Any, ...] = ()) -> None:
        self.mesh = mesh
        self.modules = list(modules)
        super().__init__(optimizer, mesh.get_group(), model_collectives=True)  # FSDP2's gathers and scatters
        self.evon_params = [p for p in self.params if id(p) in self.index]
        self.proxy: dict[int, Tensor] = {}  # id(DTensor) -> the owner's full copy
        self._param_of: dict[int, Tensor] = {}  # id(copy) -> its DTensor
        for p in self.evon_params:
            if self.owns(p):
                q = torch.zeros(p.shape, dtype=p.dtype, device=_local(p).device)
                self.proxy[id(p)] = q
                self._param_of[id(q)] = p
                self.index[id(q)] = self.index[id(p)]  # its noise stream is the matrix's
                self.owner[id(q)] = self.rank
        self._stamps: list[tuple[int, int, int]] | None = None
        # each rank's rows of the gradients the owners got at the last sample's exit
        self._exit_rows: list[Tensor | None] | None = None
        self._pull()

    def _every_rank_owns(self, p: Tensor, group: dict[str, Any]) -> bool:
        return group["algorithm"] != "evon"

    # ------------------------------------------------------------- buckets
    def owned_bucket(self, b: Bucket) -> Bucket:
        sub = super().owned_bucket(b)
        sub.params = [self.proxy[id(p)] for p in sub.params]  # their state stays under the DTensor
        return sub

    def bucket_param(self, p: Tensor) -> Tensor:
        return self.proxy.get(id(p), p)

    def model_param(self, q: Tensor) -> Tensor:
        return self._param_of.get(id(q), q)

    def square_sums(self, params: list[Tensor]) -> Tensor:
        """Each owner's ``Σ p²`` of its full copy (as one process computes it), summed over ranks."""
        self._refresh()
        # on the parameters' device: NCCL (accelerate's backend on GPUs) refuses CPU tensors
        out = torch.zeros(len(params), dtype=torch.float64, device=self._device())
        for i, p in enumerate(params):
            q = self.proxy.get(id(p))
            if q is not None:
                out[i] = q.double().square().sum()
        if self.world > 1:
            dist.all_reduce(out, group=self.group)  # one non-zero term each: exact
        return out.cpu()

    def _device(self) -> torch.device:
        """Where this rank's shards live: the device of every collective's tensors."""
        return _local(self.params[0]).device if self.params else torch.device("cpu")

    def adamw_tensors(self, params: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        return [_local(p) for p in params], [_local(p.grad) for p in params]

    # ------------------------------------------------------------- exchanges
    def _kinds(self, params: list[Tensor]) -> dict[torch.dtype, list[Tensor]]:
        kinds: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            kinds.setdefault(p.dtype, []).append(p)
        return kinds

    def _rows(self, p: Tensor, rank: int) -> tuple[int, int]:
        return shard_rows(p.shape[0], self.world, rank)

    def _to_owners(
        self, params: list[Tensor], local: list[Tensor], flag: bool | None = None
    ) -> tuple[dict[int, Tensor], list[Tensor]]:
        """Each owner's full matrices from every rank's rows ``local[i]`` of ``params[i]``
        (one ``all_to_all`` per dtype); returns ``{id(param): full}`` for this rank's, and each
        rank's ``flag`` (a one-element tensor, rank order), sent to every rank with the first
        dtype's rows (alone where there are none): empty where ``flag`` is None."""
        out: dict[int, Tensor] = {}
        flags: list[Tensor] = []
        by_id = {id(p): t for p, t in zip(params, local)}
        kinds = list(self._kinds(params).values()) or ([[]] if flag is not None else [])
        for k, ps in enumerate(kinds):
            dtype = ps[0].dtype if ps else torch.float32
            device = local[0].device if local else self._device()
            extra = int(flag is not None and k == 0)  # 0 or 1: exact in any dtype
            send, send_sizes = [], [0] * self.world
            for r in range(self.world):
                for p in ps:
                    if self.owner[id(p)] == r:
                        t = by_id[id(p)].reshape(-1)
                        send.append(t)
                        send_sizes[r] += t.numel()
                if extra:
                    send.append(torch.full((1,), float(bool(flag)), dtype=dtype, device=device))
                    send_sizes[r] += 1
            mine = [p for p in ps if self.owner[id(p)] == self.rank]
            cols = {id(p): p.numel() // max(p.shape[0], 1) for p in mine}
            recv_sizes = [
                sum(self._rows(p, r)[1] * cols[id(p)] for p in mine) + extra for r in range(self.world)
            ]
            flat_out = self._all_to_all(send, send_sizes, recv_sizes, dtype, device)
            full = {id(p): torch.empty(p.shape, dtype=p.dtype, device=device) for p in mine}
            dst, src, pos = [], [], 0
            for r in range(self.world):
                for p in mine:
                    start, length = self._rows(p, r)
                    n = length * cols[id(p)]
                    if n:
                        dst.append(full[id(p)].narrow(0, start, length).reshape(-1))
                        src.append(flat_out[pos : pos + n])
                    pos += n
                if extra:
                    flags.append(flat_out[pos : pos + 1])
                    pos += 1
            if dst:
                torch._foreach_copy_(dst, src)
            out.update(full)
        return out, flags

    def _all_to_all(
        self,
        send: list[Tensor],
        send_sizes: list[int],
        recv_sizes: list[int],
        dtype: torch.dtype,
        device: Any,
    ) -> Tensor:
        """One ``all_to_all_single`` of the flattened pieces (``send_sizes[r]`` elements to rank r)."""
        flat_in = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
        flat_out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        if self.world > 1:
            dist.all_to_all_single(flat_out, flat_in, recv_sizes, send_sizes, group=self.group)
        else:
            flat_out.copy_(flat_in)
        return flat_out

    def _from_owners(self, params: list[Tensor]) -> None:
        """Every rank's local shard of ``params`` gets its rows of the owner's full copy."""
        for ps in self._kinds(params).values():
            device = _local(ps[0]).device
            send, send_sizes = [], [0] * self.world
            mine = [p for p in ps if self.owner[id(p)] == self.rank]
            for r in range(self.world):
                for p in mine:
                    start, length = self._rows(p, r)
                    if length:
                        t = self.proxy[id(p)].narrow(0, start, length).reshape(-1)
                        send.append(t)
                        send_sizes[r] += t.numel()
            recv_sizes = [0] * self.world
            order = []
            for r in range(self.world):
                for p in ps:
                    if self.owner[id(p)] == r:
                        recv_sizes[r] += _local(p).numel()
                        order.append(p)
            flat_out = self._all_to_all(send, send_sizes, recv_sizes, ps[0].dtype, device)
            targets = [_local(p) for p in order]
            pieces = flat_out.split([t.numel() for t in targets])
            pairs = [(t, v.view(t.shape)) for t, v in zip(targets, pieces) if t.numel()]
            if pairs:
                torch._foreach_copy_([t for t, _ in pairs], [v for _, v in pairs])

    def _release_gathered(self) -> None:
        """Free the weights a forward left gathered (``reshard_after_forward=False``, or the root's
        by default, after a forward without backward): FSDP2 gathers again only after a reshard, so
        the next forward would run on them, not on the sample or mean EVON writes into the shards."""
        for module in self.modules:
            module.reshard()

    def _stamp(self) -> None:
        self._stamps = [(p._version, _local(p)._version, _local(p).data_ptr()) for p in self.evon_params]

    def _pull(self) -> None:
        """The owners' copies from the shards (a collective)."""
        with torch.no_grad():
            full, _ = self._to_owners(self.evon_params, [_local(p).detach() for p in self.evon_params])
            for key, value in full.items():
                self.proxy[key].copy_(value)
        self._stamp()

    def _refresh(self, grads_changed: bool = False) -> bool:
        """Pull the owners' copies if any rank's shard was written by someone else since; also
        agrees (the same all-reduce) whether ``grads_changed`` on any rank, and returns that."""
        with torch.no_grad():
            for p in self.evon_params:  # frozen or not, as the DTensor is now
                q = self.proxy.get(id(p))
                if q is not None and q.requires_grad != p.requires_grad:
                    q.requires_grad_(p.requires_grad)
            now = [(p._version, _local(p)._version, _local(p).data_ptr()) for p in self.evon_params]
            stale = now != self._stamps
            if self.world > 1:
                flag = torch.tensor(
                    [int(stale), int(grads_changed)], dtype=torch.int32, device=self._device()
                )
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
                stale, grads_changed = (bool(x) for x in flag.tolist())
            if stale:
                self._pull()
        return grads_changed

    def _gather_grads(self, failed: bool | None = None) -> int | None:
        """Owners' copies get the full (FSDP2-averaged) gradient of their matrices; None where
        the DTensor has none. ``failed`` (a block's exit): whether this rank's block raised, sent
        with the rows, so every rank learns it from the exchange that runs anyway; returns the
        first rank whose block raised (the copies then get no gradient), or None."""
        with_grad = [p for p in self.evon_params if p.grad is not None]
        for p in self.evon_params:
            q = self.proxy.get(id(p))
            if q is not None:
                q.grad = None
        if not with_grad and failed is None:
            return None
        full, flags = self._to_owners(with_grad, [_local(p.grad) for p in with_grad], failed)
        if flags:
            raised = [r for r, f in enumerate(torch.cat(flags).tolist()) if f]
            if raised:
                return raised[0]
        for p in with_grad:
            if id(p) in full:
                self.proxy[id(p)].grad = full[id(p)]
        return None

    def before_sample(self) -> None:
        self._refresh()

    def share_sample(self) -> None:
        """The owners wrote a sample into their copies: every rank writes its rows of it,
        keeping its rows of the mean to restore at the exit."""
        params = self._sampled()
        self._release_gathered()
        with torch.no_grad():
            self._means = [(_local(p), _local(p).clone()) for p in params]
            self._from_owners(params)

    def end_sample(self, recorded: bool, failed: bool = False) -> str | None:
        self._release_gathered()
        with torch.no_grad():
            if self._means:
                torch._foreach_copy_([t for t, _ in self._means], [m for _, m in self._means])
            self._means = []
            self._stamp()
            if recorded or failed and self.world > 1:
                # a block that raised here still joins the exchange, so every rank learns it and
                # none records the block (none waits for this rank)
                rank = self._gather_grads(failed if self.world > 1 else None)
                if rank is not None:
                    self._exit_rows = None  # the step gathers its gradients afresh
                    return None if failed else block_raised_on(rank)
                grads = [p.grad for p in self.evon_params]
                self._exit_rows = [None if g is None else _local(g).clone() for g in grads]
        return None

    def reduce_gradients(self, tensors: list[Tensor]) -> None:
        """``EVON.gradient_reducer``: nothing to do, FSDP2's reduce-scatter averaged the gradients
        already (so ``synchronize()`` and clipping in between see them averaged)."""

    def before_step(self) -> None:
        """The owners get the step's full gradients as they are now (after any clipping of the
        DTensor gradients) and a fresh copy of the weights if someone wrote them. The gather is
        skipped when every rank's rows equal those gathered at the last sample's exit (one
        sample per step and nothing changed them since): the owners hold them already."""
        with torch.no_grad():
            rows = self._exit_rows
            same = rows is not None and all(
                (g is None) == (r is None) and (g is None or torch.equal(_local(g), r))
                for g, r in zip((p.grad for p in self.evon_params), rows)
            )
            if self._refresh(grads_changed=not same):
                self._gather_grads()

    def after_step(self) -> None:
        self._factors = self._state = None
        self._release_gathered()
        with torch.no_grad():
            self._from_owners(self.evon_params)
            for q in self.proxy.values():
                q.grad = None
        self._exit_rows = None
        self._stamp()

    # ------------------------------------------------------------- state
    def _param_ids(self, sd: dict[str, Any]) -> list[tuple[int, Tensor]]:
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return list(zip(ids, params))

    def _full_rows(self, p: Tensor, v: Any) -> Any:
        """A state tensor of ``p``'s local rows, gathered to the full shape (a collective)."""
        if not torch.is_tensor(v) or v.dim() == 0:
            return cpu_copy(v)
        from torch.distributed.tensor import DTensor

        whole = DTensor.from_local(
            v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
        return cpu_copy(whole.full_tensor())

    def full_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        if self._state is None:
            local: dict[int, Any] = {}
            rows: dict[int, Any] = {}
            for i, p in self._param_ids(sd):
                st = sd["state"].get(i)
                if st is None:
                    continue
                if id(p) in self.index:
                    local[i] = cpu_copy(st)
                else:  # every rank holds its rows of this AdamW state: gather them
                    rows[i] = {k: self._full_rows(p, v) for k, v in st.items()}
            merged: dict[int, Any] = {}
            for part in self._gather_objects(local):
                merged.update(part)
            merged.update(rows)
            self._state = dict(sorted(merged.items()))
        return {**sd, "state": fresh_state(self._state)}

    def local_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        out = super().local_state_dict(sd)
        state = dict(out["state"])
        for i, p in self._param_ids(sd):
            if id(p) in self.index or i not in state:
                continue
            start, length = self._rows(p, self.rank)
            state[i] = {
                k: v.narrow(0, start, length).clone() if torch.is_tensor(v) and v.dim() > 0 else v
                for k, v in state[i].items()
            }
        return {**out, "state": state}

    def state_bytes_expected(self) -> int:
        total = super().state_bytes_expected()
        for g in self.optimizer.param_groups:  # AdamW: this rank's rows only
            if g["algorithm"] != "evon":
                for p in g["params"]:
                    total -= 2 * (p.numel() - _local(p).numel()) * p.element_size()
        return total

    def proxy_bytes(self) -> int:
        """Bytes of the owners' full copies of their matrices (outside ``optimizer.state``)."""
        return sum(q.numel() * q.element_size() for q in self.proxy.values())
