"""EVON under data parallelism (``accelerate launch``, ``torchrun``; DDP on CPUs or GPUs).

Why this is needed: each rank samples its *own* posterior noise ``E_r``, and EVON's Hessian
estimate needs ``G°_r ⊙ E_r`` formed from the rank's *own* gradient ``G_r``. DDP averages the
gradients during ``backward()``, before EVON can form that product, so the correct aggregate
(the mean over ranks of ``G_r``, ``G°_r`` and ``G°_r ⊙ E_r / V``) cannot be recovered from
DDP's result. The fix is one call after ``accelerator.prepare``::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    optimizer = hf_evon.prepare_distributed(model, optimizer)  # the same handle, now also EVON's API
    for batch in loader:
        for _ in range(optimizer.mc_samples):
            with optimizer.sampled_params(train=True):
                accelerator.backward(model(**batch).loss)
        optimizer.step()            # averages gradients + Hessian numerators, once
        optimizer.zero_grad()

What it does:

* stops DDP's own gradient averaging by registering a communication hook that hands back
  each rank's local gradient bucket unchanged (no communication in ``backward``; so
  ``no_sync``/``accelerator.accumulate`` change nothing either);
* sets ``optimizer.gradient_reducer``: ``EVON.synchronize()`` (run by ``step()``, once per
  step) passes it every gradient (EVON- *and* AdamW-owned: the AdamW parameters end up
  averaged exactly like plain DDP) and each bucket's Hessian numerator ``Σ_s G°_s ⊙ z_s``;
  it averages them across ranks in a few flat all-reduces (one per dtype/device and
  ``bucket_cap_mb`` chunk);
* makes the handle you pass (accelerate's ``AcceleratedOptimizer``) answer EVON's own API
  (``sampled_params``, ``mc_samples``, ``posterior_std``, ...; see :class:`EVONHandle`),
  so one object does accelerate's ``step``/``zero_grad`` and EVON's sampling;
* gives every rank rank 0's noise seed, so a job is reproducible from one seed while each
  rank still draws its own stream: the generator of a ``sampled_params`` block labelled ``k``
  (``EVON.noise_label``: the training blocks' count, or ``"eval N"``) on rank ``r`` is seeded with
  ``derived_seed(seed, r, k, device)`` (a hash of those labels,
  :func:`hf_evon.optim.noise.derived_seed`), so the streams are independent and any rank
  resumes its own from a checkpoint another rank saved (the block counts are in the state dict).

All ranks then apply the same update to the same weights and hold identical optimizer state.

Mistakes are reported, not silently trained through: forgetting this call makes the first
``step()`` raise in a multi-process job; preparing a model that is not the DDP-wrapped one
while DDP still averages is detected at the first noisy steps; ranks that disagree on which
gradients exist raise instead of hanging.

To shard EVON's own state and work over the ranks (per-rank state and optimizer FLOPs
~1/world), pass ``shard=True`` (:mod:`hf_evon.distributed.sharding`; the Trainer's
``EVONConfig(evon_shard=True)``).

FSDP2 (``torch.distributed.fsdp.fully_shard``) is supported in sharded mode: after
``fully_shard`` (each layer and the root, one 1-D mesh) and building EVON on the sharded model,
``prepare_distributed(model, optimizer)`` shards EVON over the mesh (``shard=None``, the default,
means sharded under FSDP2): matrix owners gather their rows and gradients and send back the rows
of each sample and new mean (:mod:`hf_evon.distributed.fsdp2`). Supported layout: every parameter a
DTensor ``Shard(0)`` (uneven rows allowed) on one 1-D mesh. Refused with
:class:`UnsupportedParallelismError` naming the parameter: FSDP1 ``FullyShardedDataParallel``
and DeepSpeed (flat parameters mixing matrices: EVON's eigenbasis is per whole matrix),
``Shard(1)``, 2-D (HSDP) or several meshes, parameters outside ``fully_shard``, DTensors without
FSDP2 (tensor parallelism), and FSDP2 with ``shard=False``.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_evon.distributed.averaging import RankAverager, world_size
from hf_evon.distributed.fsdp2 import FSDP2Sharding, shard_rows
from hf_evon.distributed.sharding import EVONSharding
from hf_evon.modeling import fsdp2_modules
from hf_evon.optim.checks import check_flag
from hf_evon.optim.evon import EVON, unwrap_optimizer
from hf_evon.optim.gradients import accelerate_gradient_state
from hf_evon.optim.handle import EVONHandle

Tensor = torch.Tensor

__all__ = [
    "EVONAcceleratedOptimizer",
    "RankAverager",
    "UnsupportedParallelismError",
    "check_ranks_in_sync",
    "check_supported_parallelism",
    "as_evon_handle",
    "prepare_distributed",
]

_PREPARED_ATTR = "_hf_evon_local_gradients"


class UnsupportedParallelismError(RuntimeError):
    """A parallel set-up EVON cannot train correctly (FSDP1, DeepSpeed, FSDP2 other than ``Shard(0)``
    on one 1-D mesh, DTensors without FSDP2); the message names the parameter and what is supported."""


try:
    from accelerate.optimizer import AcceleratedOptimizer
except ImportError:  # pragma: no cover - accelerate is a dependency
    AcceleratedOptimizer = None  # type: ignore[assignment,misc]
    EVONAcceleratedOptimizer = None  # type: ignore[assignment,misc]
else:

    class EVONAcceleratedOptimizer(EVONHandle, AcceleratedOptimizer):
        """accelerate's ``AcceleratedOptimizer`` around an EVON, with EVON's API (importable: it pickles),
        whose ``step_was_skipped`` also says when EVON skipped a non-finite step (:func:`_watch_skips`): the
        Trainer and accelerate's prepared scheduler read it (only a GradScaler's skip set it)."""

        @property
        def step_was_skipped(self) -> bool:
            return bool(super().step_was_skipped or self.__dict__.get("_evon_skipped", False))

        def __setstate__(self, state: dict[str, Any]) -> None:  # a copy: torch copies no step hook of its EVON
            super().__setstate__(state)
            _watch_skips(self)

    def _watch_skips(handle: Any) -> Any:
        """Record on ``handle`` whether each step of its EVON skipped, by torch's step hooks on the EVON:
        an LRScheduler built on the wrapper before its class swap keeps a ``step`` calling the old class's."""
        evon, ref = unwrap_optimizer(handle), weakref.ref(handle)

        def before(opt: Any, args: Any, kwargs: Any) -> None:
            if (h := ref()) is not None:
                h.__dict__["_evon_skips_before"] = opt.skipped_steps

        def after(opt: Any, args: Any, kwargs: Any) -> None:
            if (h := ref()) is not None:
                h.__dict__["_evon_skipped"] = opt.skipped_steps != h.__dict__.get("_evon_skips_before")

        evon.register_step_pre_hook(before)
        evon.register_step_post_hook(after)
        return handle


_HANDLE_CLASSES: dict[type, type] = {}
if EVONAcceleratedOptimizer is not None:
    _HANDLE_CLASSES[AcceleratedOptimizer] = EVONAcceleratedOptimizer


def as_evon_handle(optimizer: Any) -> Any:
    """``optimizer`` itself, answering EVON's API too (see :class:`EVONHandle`): a bare EVON as is, a
    wrapper (accelerate's ``AcceleratedOptimizer``, any object holding the EVON as ``.optimizer``) with
    :class:`EVONHandle` mixed into its class.

    Why the class of a live object is replaced (the one place this is done): the caller keeps using the
    object it passed (``prepare_distributed(model, opt) is opt``), and other code (accelerate's
    ``Accelerator``, the Trainer) holds references to that same object, so a new wrapper object would
    leave them with one that lacks EVON's API. The new class derives from the old one, so ``isinstance``
    checks and the wrapper's own methods are unchanged."""
    unwrap_optimizer(optimizer)  # raises TypeError for non-EVON optimizers
    cls = type(optimizer)
    if isinstance(optimizer, EVON | EVONHandle):
        return optimizer
    handle_cls = _HANDLE_CLASSES.get(cls)
    if handle_cls is None:
        handle_cls = type(f"EVON{cls.__name__}", (EVONHandle, cls), {"__module__": cls.__module__})
        _HANDLE_CLASSES[cls] = handle_cls
    optimizer.__class__ = handle_cls
    return _watch_skips(optimizer) if handle_cls is EVONAcceleratedOptimizer else optimizer


def _module_chain(model: nn.Module) -> list[nn.Module]:
    """``model`` and the modules it wraps (``torch.compile``'s ``_orig_mod``, DDP's ``module``)."""
    out: list[nn.Module] = []
    m: Any = model
    while isinstance(m, nn.Module) and all(m is not x for x in out):
        out.append(m)
        m = getattr(m, "_orig_mod", None) or getattr(m, "module", None)
    return out


def check_supported_parallelism(model: nn.Module, optimizer: Any = None) -> Any:
    """Raise :class:`UnsupportedParallelismError` for set-ups EVON cannot train; return the
    FSDP2 device mesh if ``model`` is ``fully_shard``-ed in the supported way (else None).

    EVON's posterior (and its eigenbasis) is defined per whole weight matrix; a flattened
    parameter (FSDP1, DeepSpeed ZeRO) would be trained as a different matrix, i.e. wrongly, so
    those are refused. FSDP2 is supported when every parameter (of the model, and of
    ``optimizer`` if given) is a DTensor sharded on dim 0 (``Shard(0)``, uneven allowed) over
    one 1-D device mesh: the owners of the matrices gather their rows
    (:mod:`hf_evon.distributed.fsdp2`). Other DTensor layouts (``Shard(1)``, HSDP's 2-D mesh,
    ``Replicate``/``Partial``, several meshes, tensor parallelism without FSDP2) are refused,
    naming the parameter.
    """
    hint = (
        "EVON needs whole weight matrices or FSDP2 rows: use plain DDP (`accelerate launch` without an "
        "FSDP/DeepSpeed config) with hf_evon.prepare_distributed(model, optimizer, shard=True) "
        "(EVONConfig(evon_shard=True)) to shard EVON's state and work over the ranks, or FSDP2 "
        "(torch.distributed.fsdp.fully_shard on one 1-D device mesh, parameters Shard(0); accelerate's "
        "fsdp_version=2), which prepare_distributed shards EVON for"
    )
    chain = _module_chain(model)
    if any(type(m).__name__ == "DeepSpeedEngine" for m in chain):
        raise UnsupportedParallelismError(
            f"EVON cannot run under DeepSpeed (ZeRO partitions the weights): {hint}"
        )
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        FullyShardedDataParallel = ()  # type: ignore[assignment,misc]  # noqa: N806
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        FSDPModule = ()  # type: ignore[assignment,misc]  # noqa: N806
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - older torch
        DTensor = Shard = ()  # type: ignore[assignment,misc]  # noqa: N806
    fsdp2 = False
    for root in chain:
        for name, mod in root.named_modules():
            if isinstance(mod, FullyShardedDataParallel):
                raise UnsupportedParallelismError(
                    f"EVON cannot run under FSDP1 (module {name or type(mod).__name__!r} is "
                    f"FullyShardedDataParallel, whose flat parameters mix matrices): {hint}"
                )
            fsdp2 = fsdp2 or isinstance(mod, FSDPModule)
    named: list[tuple[str, Tensor]] = list(chain[-1].named_parameters())
    names = {id(p): n for n, p in named}
    if optimizer is not None:
        evon = unwrap_optimizer(optimizer)
        for gi, g in enumerate(evon.param_groups):
            labels = g.get("param_names")
            for i, p in enumerate(g["params"]):
                if id(p) not in names:
                    names[id(p)] = labels[i] if labels else f"param_groups[{gi}]['params'][{i}]"
                    named.append((names[id(p)], p))
    dtensors = [(n, p) for n, p in named if isinstance(p, DTensor)]
    if not fsdp2:
        if dtensors:
            n, p = dtensors[0]
            raise UnsupportedParallelismError(
                f"EVON cannot train DTensor-sharded parameters outside FSDP2 (e.g. {n!r}, placements "
                f"{tuple(p.placements)}: tensor parallelism?): {hint}"
            )
        return None
    mesh = None
    for n, p in named:
        if not isinstance(p, DTensor):
            raise UnsupportedParallelismError(
                f"EVON under FSDP2 needs every trained parameter sharded by fully_shard, but {n!r} is a plain "
                f"tensor (shape {tuple(p.shape)}): call fully_shard on the root module too. {hint}"
            )
        if p.device_mesh.ndim != 1:
            raise UnsupportedParallelismError(
                f"EVON under FSDP2 supports a 1-D device mesh only, but {n!r} lives on a "
                f"{p.device_mesh.ndim}-D mesh {tuple(p.device_mesh.shape)} with placements {tuple(p.placements)} "
                f"(HSDP?): {hint}"
            )
        if tuple(p.placements) != (Shard(0),):
            raise UnsupportedParallelismError(
                f"EVON under FSDP2 supports parameters sharded on dim 0 (Shard(0)) only, but {n!r} has "
                f"placements {tuple(p.placements)} (shape {tuple(p.shape)}): drop fully_shard's "
                f"shard_placement_fn. {hint}"
            )
        if p.dim() == 0:
            raise UnsupportedParallelismError(f"EVON under FSDP2 cannot train the 0-d DTensor {n!r}: {hint}")
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise UnsupportedParallelismError(
                f"EVON under FSDP2 needs one device mesh for all parameters, but {n!r} is on {p.device_mesh} "
                f"and earlier ones on {mesh}: {hint}"
            )
    if mesh is not None:  # the rows each rank holds must be torch.chunk's (FSDP2's layout)
        rank, world = mesh.get_local_rank(), mesh.size()
        for n, p in named:
            want = shard_rows(p.shape[0], world, rank)[1]
            if tuple(p._local_tensor.shape) != (want, *p.shape[1:]):
                raise UnsupportedParallelismError(
                    f"EVON under FSDP2: {n!r} (shape {tuple(p.shape)}) holds local rows "
                    f"{tuple(p._local_tensor.shape)} on rank {rank}, not torch.chunk's {want}: {hint}"
                )
    return mesh


def _local_gradient_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook: no communication; every rank keeps its own (unscaled) gradient."""
    fut: torch.futures.Future[Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# DDP validates the hook's annotations by identity; `from __future__ import annotations` made them strings
_local_gradient_hook.__annotations__ = {
    "state": Any,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[Tensor],
}


def _ddp_modules(model: nn.Module) -> list[nn.parallel.DistributedDataParallel]:
    found = []
    for root in _module_chain(model):
        for mod in root.modules():
            if isinstance(mod, nn.parallel.DistributedDataParallel) and all(mod is not f for f in found):
                found.append(mod)
    return found


def _refuse_uneven_join(ddps: list[nn.parallel.DistributedDataParallel]) -> None:
    """Raise if DDP's join (``accelerator.join_uneven_inputs(..., even_batches=False)``,
    ``model.join()``) is enabled without ``throw_on_early_termination``: a rank that runs out of
    inputs shadows DDP's collectives only, so its join all-reduces pair with the other ranks' EVON
    step (gloo aborts on the size mismatch, or the ranks hang). Checked at every step before any
    collective: each rank has at least one batch, so the first step inside the join is still in
    lockstep and every rank raises there alike. It reads DDP's private ``_join_config`` (set by
    ``join``), the one place hf-evon does; ``test_ddp_join_with_uneven_inputs_is_refused_on_every_rank``
    pins it."""
    for ddp in ddps:
        config = getattr(ddp, "_join_config", None)
        if config is not None and config.enable and not config.throw_on_early_termination:
            raise RuntimeError(
                "EVON cannot train inside DDP's join context for uneven inputs (accelerator.join_uneven_inputs "
                "with even_batches=False, or DistributedDataParallel.join()): a rank that runs out of batches "
                "shadows DDP's communication but not EVON's step, so the ranks would hang. Give every rank the "
                "same number of batches (accelerate's default even_batches=True, or drop_last=True), or use "
                "join(throw_on_early_termination=True) to stop all ranks when the first runs out"
            )


class _UnevenBatchesCheck:
    """Refuse, at the first step of each accelerate data loader, ranks whose loaders hold different
    numbers of batches (``DataLoaderConfiguration(even_batches=False)`` with data that does not
    divide over the ranks): the rank that runs out first leaves the others' EVON step waiting in its
    collectives for ever (gloo: until its timeout). One tiny all-gather per loader, not per step; run
    on every rank alike, as each rank's loaders come in the same order while their lengths agree.
    The first step gathers on every rank whatever its loader: the Trainer takes a step's micro-batches
    before the step, so a rank with fewer batches than that has run out (no active loader) where
    another's loader is still active, and only a gather on both keeps their collectives paired.
    Each epoch of a loader (accelerate's ``iteration``) is compared again: its length can change between
    epochs (its sampler's does), and a rank's extra step would pair with another's next epoch's first."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group, self.device = group, device
        # the loaders themselves (a new one at a freed one's address is compared again), with their epochs
        self.checked: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self.first = True

    def __call__(self) -> None:
        try:
            from accelerate.state import GradientState
        except ImportError:  # pragma: no cover - accelerate is a dependency
            return
        loader = GradientState().active_dataloader if accelerate_gradient_state() else None  # no new state
        epoch = getattr(loader, "iteration", None)
        if not self.first and (loader is None or loader in self.checked and self.checked[loader] == epoch):
            return  # looked up first: a loader's length can cost what its sampler's does, every step
        try:
            count = len(loader) if loader is not None else None
        except TypeError:  # an iterable dataset: no length to compare, on any step
            count = None
            self.checked[loader] = epoch
        if not self.first and count is None:
            return
        self.first = False
        every = torch.zeros(world_size(self.group), dtype=torch.int64, device=self.device)
        local = torch.tensor([-1 if count is None else count], dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(every, local, group=self.group)
        counts = every.tolist()
        if len(set(counts)) > 1:
            raise RuntimeError(
                f"EVON: the ranks' data loaders hold different numbers of batches ({counts}, by rank; -1: no active "
                "data loader at this step, as a rank whose batches ran out before it; accelerate's "
                "even_batches=False with data that does not divide over the ranks): the rank that runs out first "
                "would leave the others waiting in EVON's step for ever. Give every rank the same number of "
                "batches (DataLoaderConfiguration(even_batches=True), accelerate's default, or drop_last=True). "
                "The step was refused on every rank"
            )
        if count is not None:
            self.checked[loader] = epoch


def _sync_seed(evon: EVON, group: Any, device: torch.device) -> None:
    """Give every rank rank 0's seed (each rank's noise stream is derived from it and its rank)."""
    seed = torch.tensor([evon.seed], dtype=torch.int64, device=device)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(seed, src=src, group=group)
    evon.seed = int(seed.item())


def prepare_distributed(
    model: nn.Module,
    optimizer: Any,
    *,
    process_group: Any = None,
    bucket_cap_mb: float = 64.0,
    check_consistency: bool = True,
    shard: bool | None = None,
) -> EVON | EVONHandle:
    """Make an EVON optimizer correct under data parallelism; call after ``accelerator.prepare``.

    Args:
        model: the model as prepared (the DDP wrapper from ``accelerator.prepare``/``DDP(...)``).
        optimizer: ``EVON`` or a wrapper of it (accelerate's ``AcceleratedOptimizer``).
        process_group: the data-parallel group (default: the world).
        bucket_cap_mb: size bound of one flat all-reduce buffer.
        check_consistency: check every step that all ranks reduce the same tensors. With False, a
            ``sampled_params(train=True)`` block that raised on one rank (and was caught) goes unnoticed:
            the ranks average gradients of different numbers of samples, and the step goes on. Sharded
            runs always check (the check is how their ranks agree on such a block): False is refused.
        shard: each rank owns a cost-balanced share of the parameters, keeps only their state
            and does only their maths; weights and posterior samples are exchanged (see
            :mod:`hf_evon.distributed.sharding`, also for its noise semantics: one posterior sample
            shared by all ranks, one noise stream per matrix). Also valid in one process,
            where it is the reference a sharded multi-process run equals. Call it before the
            first ``step()``; ``state_dict()`` then becomes a collective (call it on every rank).
            None (the default): sharded under FSDP2 (the only way EVON runs there), not under
            DDP. Under FSDP2 (``fully_shard``; parameters ``Shard(0)`` on one 1-D mesh, whose
            group is then the data-parallel group) each matrix's owner gathers its rows and
            gradient and sends the rows of each new mean and sample back
            (:mod:`hf_evon.distributed.fsdp2`); the AdamW part is updated row-wise on every rank.

    Returns:
        ``optimizer`` itself (the same object), which now also answers EVON's API
        (``sampled_params``, ``mc_samples``, ...) when it is a wrapper: one handle for the
        whole loop. ``hf_evon.distributed.ddp.unwrap_optimizer`` gives the bare EVON if needed.

    Raises:
        UnsupportedParallelismError: FSDP1 or DeepSpeed models; FSDP2 with ``shard=False`` or
            with another layout than ``Shard(0)`` on one 1-D mesh; DTensors without FSDP2.
        RuntimeError: DDP already has another communication hook.
        TypeError: ``optimizer`` is not EVON.
        ValueError: ``check_consistency=False`` with a sharded run (``shard=True``, or FSDP2).

    Safe to call in a single process (it then only checks the model) and more than once.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare_distributed: model must be an nn.Module (the prepared model); got {type(model).__name__}")
    if shard is not None and not isinstance(shard, bool):  # 'no' would be truthy, and sharding is for good
        raise TypeError(f"prepare_distributed: shard must be True, False or None; got {shard!r}")
    check_flag(check_consistency, "prepare_distributed: check_consistency")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, int | float) or not 0 < bucket_cap_mb < math.inf:
        raise ValueError(f"prepare_distributed: bucket_cap_mb must be a finite number > 0; got {bucket_cap_mb!r}")
    if any(type(m).__name__ == "DeepSpeedEngine" for m in _module_chain(model)):
        # named first: ZeRO puts its flat partitions into the optimizer's groups, which the check
        # below would report as another model's tensors
        check_supported_parallelism(model)
    evon = unwrap_optimizer(optimizer)
    own = {id(p) for p in model.parameters()}
    foreign = [p for g in evon.param_groups for p in g["params"] if id(p) not in own]
    if foreign:
        raise ValueError(
            f"prepare_distributed: the optimizer trains {len(foreign)} tensor(s) that are not parameters of the "
            f"given {type(model).__name__} (the first of shape {tuple(foreign[0].shape)}): pass the model it was built for"
        )
    handle = as_evon_handle(optimizer)
    mesh = check_supported_parallelism(model, evon)
    if not check_consistency and (shard or mesh is not None and shard is not False):
        raise ValueError(
            "prepare_distributed: check_consistency=False is for unsharded DDP; sharded EVON always checks "
            "(its ranks agree there on a sampled_params block that raised on one of them)"
        )
    if mesh is not None:
        return _prepare_fsdp2(model, evon, handle, mesh, shard)
    ddps = _ddp_modules(model)
    for ddp in ddps:
        if getattr(ddp, _PREPARED_ATTR, False):
            continue
        try:
            ddp.register_comm_hook(state=None, hook=_local_gradient_hook)
        except RuntimeError as err:
            raise RuntimeError(
                "could not stop DDP's gradient averaging: this DDP model already has a communication hook "
                "(e.g. accelerate's DistributedDataParallelKwargs(comm_hook=...)) or has run backward already. "
                "Remove the hook and call hf_evon.prepare_distributed right after accelerator.prepare()"
            ) from err
        setattr(ddp, _PREPARED_ATTR, True)
    world = world_size(process_group)
    params = [p for g in evon.param_groups for p in g["params"]]
    device = params[0].device if params else torch.device("cpu")
    if world > 1:
        _sync_seed(evon, process_group, device)
    if shard:
        if isinstance(evon.sharding, FSDP2Sharding):
            raise ValueError("this EVON was prepared for FSDP2, but the model given is not fully_shard-ed")
        if evon.sharding is None:
            evon.install_sharding(EVONSharding(evon, process_group, bucket_cap_mb, model_collectives=bool(ddps)))
        if world > 1:
            reduce = evon.sharding.reduce_gradients

            uneven = _UnevenBatchesCheck(process_group, device)

            def guarded_reduce(tensors: list[Tensor]) -> None:
                _refuse_uneven_join(ddps)
                uneven()
                reduce(tensors)

            evon.gradient_reducer = guarded_reduce
        return handle
    if evon.sharding is not None:
        raise ValueError("this EVON was prepared with shard=True already; it cannot be unsharded")
    if world == 1:
        return handle
    covered = {id(p) for d in ddps for p in d.parameters()}
    uneven = _UnevenBatchesCheck(process_group, device)
    evon.gradient_reducer = RankAverager(
        group=process_group,
        bucket_cap_mb=bucket_cap_mb,
        check_consistency=check_consistency,
        # a plain module in a multi-process job: fine for hand-made data parallelism, wrong if
        # a DDP wrapper we were not given still averages -> check the first noisy steps
        verify_local_gradients=not all(id(p) in covered for p in params),
        optimizer=evon,
        guard=lambda: (_refuse_uneven_join(ddps), uneven()),
    )
    return handle


def _prepare_fsdp2(model: nn.Module, evon: EVON, handle: Any, mesh: Any, shard: bool | None) -> Any:
    """``prepare_distributed`` for an FSDP2 model (checked by ``check_supported_parallelism``)."""
    if shard is False:
        name = next((n for n, _ in _module_chain(model)[-1].named_parameters()), None)
        what = f" (parameter {name!r} is a DTensor shard, {mesh.size()} ranks)" if name else ""
        raise UnsupportedParallelismError(
            f"EVON under FSDP2 needs its sharded mode{what}: call prepare_distributed with shard=True or "
            "shard=None (the default), which shards EVON over the FSDP2 mesh"
        )
    if evon.sharding is not None:
        if not isinstance(evon.sharding, FSDP2Sharding):
            raise ValueError("this EVON was prepared with shard=True under DDP; the model is FSDP2 now")
        return handle
    group = mesh.get_group()
    params = [p for g in evon.param_groups for p in g["params"]]
    if world_size(group) > 1:
        _sync_seed(evon, group, params[0]._local_tensor.device if params else torch.device("cpu"))
    evon.install_sharding(FSDP2Sharding(evon, mesh, fsdp2_modules(model)))
    evon.gradient_reducer = evon.sharding.reduce_gradients  # also in one process: it gathers rows
    return handle


def check_ranks_in_sync(model: nn.Module, optimizer: Any, group: Any = None) -> None:
    """Raise if any rank's weights or EVON/AdamW state differ bitwise from rank 0's.

    A debugging aid (it all-reduces a checksum per tensor); after every step of a prepared
    job all ranks must agree exactly.
    """
    if world_size(group) == 1:
        return
    evon = unwrap_optimizer(optimizer)
    # FSDP2 DTensors: each rank holds its own rows by design; the check covers plain tensors
    named: list[tuple[str, Tensor]] = [
        (f"param {n}", p) for n, p in model.named_parameters() if not hasattr(p, "placements")
    ]
    # sharded: each rank holds other state; the weights must still agree
    for gi, g in enumerate(evon.param_groups if evon.sharding is None else []):
        for pi, p in enumerate(g["params"]):
            for k, v in sorted(evon.state.get(p, {}).items()):
                if torch.is_tensor(v):
                    named.append((f"state[{gi}][{pi}][{k}]", v))
    if not named:
        return
    device = named[0][1].device

    def checksum(t: Tensor) -> Tensor:
        x = t.detach().reshape(-1).to(device=device, dtype=torch.float64)
        w = torch.arange(1, x.numel() + 1, device=device, dtype=torch.float64)
        return (x * w.remainder(97).add(1)).sum()

    local = torch.stack([checksum(t) for _, t in named])
    both = torch.cat([local, -local])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    diff = (both[: len(named)] != -both[len(named) :]).nonzero().flatten().tolist()
    if diff:
        names = ", ".join(named[i][0] for i in diff[:5])
        raise RuntimeError(f"ranks are out of sync in {len(diff)} tensors, e.g. {names}")
