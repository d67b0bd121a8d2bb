"""EVON: Eigenbasis Variational Online Newton, as a ``torch.optim.Optimizer``.

Each parameter group is trained either by EVON (``algorithm="evon"``, the default) or by
AdamW (``algorithm="adamw"``). EVON parameters of equal (2-D) shape inside a group share a
*bucket* (:mod:`hf_evon.optim.buckets`): their state lives in stacked ``(B, m, n)`` tensors so
every step is a handful of batched matmuls, and the per-parameter entries of
``optimizer.state`` are views into them. The maths of a step are the functions of
:mod:`hf_evon.optim.functional`; the defaults and why: :mod:`hf_evon.optim.defaults`. Usage::

    opt = EVON(model.parameters())          # ess="auto": noise scaled to the weights
    for batch in loader:
        for _ in range(opt.mc_samples):
            with opt.sampled_params(train=True):   # weights = one posterior sample
                model(**batch).loss.backward()      # micro-batches may be accumulated here
        opt.step()
        opt.zero_grad()

The reference packages' loop (``zero_grad()`` inside each block) gives the same update.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim import Optimizer

import hf_evon.optim.checks as checks
import hf_evon.optim.gradients as gradients
import hf_evon.optim.health as health
import hf_evon.optim.linalg as linalg
from hf_evon.optim.buckets import (
    Bucket,
    Plan,
    assign_refresh_phases,
    group_buckets,
    refuse_unplaced,
    resolve_auto_ess,
    restore_means,
    stack_state,
)
from hf_evon.optim.checks import Clip, HessEstimator, NonFinite, StepCurvature, mode_value, refuse_grad_scaler
from hf_evon.optim.curvature import fit_from_curvature, note_fitted, refits_due
from hf_evon.optim.defaults import (
    AUTO_ESS,
    DEFAULT_ADAMW_LR,
    DEFAULT_BETAS,
    DEFAULT_CLIP,
    DEFAULT_CLIP_RADIUS,
    DEFAULT_CURVATURE_REFIT,
    DEFAULT_HESS_CLIP_RATIO,
    DEFAULT_HESS_ESTIMATOR,
    DEFAULT_HESS_INIT,
    DEFAULT_INIT_STD_RATIO,
    DEFAULT_MAX_PRECOND_RATIO,
    DEFAULT_SNR_SCALING,
    DEFAULT_STEP_CURVATURE,
)
from hf_evon.optim.gradients import Consumed, consumed_grads, restore_grads, set_aside_grads
from hf_evon.optim.held_samples import claim_samples, refuse_held, release_sample
from hf_evon.optim.hooks import LOCAL, ShardingHooks, refuse_unprepared_processes
from hf_evon.optim.noise import StreamGenerators, process_rank, resolve_seed
from hf_evon.optim.persistence import copied_attributes, loading, restore_copied, saving
from hf_evon.optim.update import (
    AdamWInputs,
    adamw_inputs,
    adamw_update,
    evon_updates,
    finite_flags,
    moved_refusal,
    refuse_step,
    step_plans,
)
from hf_evon.optim.validation import (
    BuiltLayout,
    build_group,
    prepare_group,
    samples_per_step,
    validate_groups,
    validate_hyperparameters,
)

Tensor = torch.Tensor

__all__ = ["EVON", "NonFiniteGradientError", "unwrap_optimizer"]


class NonFiniteGradientError(FloatingPointError):
    """Raised by ``EVON.step`` for a NaN/inf gradient when ``nonfinite="raise"``."""


class EVON(Optimizer):
    """Variational optimizer learning a SOAP-Bubble posterior ``N(M, P diag(V) Pᵀ)``.

    Args:
        params: parameters or parameter groups. A group may set ``algorithm="adamw"``
            (embeddings, heads, 1-D tensors: torch's fused AdamW, Trainer's default); the rest EVON.
        lr: learning rate α (EVON groups; AdamW groups default to ``adamw_lr``). None: AdamW's default
            rate 1e-3 through ``clip``'s step ratio (``lr_from_adamw_lr``): 0.16 for "whiten_rms", 0.04
            for "element" and, as a first guess, for the modes without a ratio; a group's own
            ``lr=None`` takes its own ``clip``'s (a group without ``lr`` takes this one, as in torch).
        ess: effective sample size ζ of the objective ``ζ·E[loss] + KL``. ``"auto"`` (default):
            per group, first the ζ whose initial std is ``init_std_ratio`` of the trained weights' RMS;
            under ``hess_estimator="fisher"``, refit from H every ``curvature_refit`` steps
            (:mod:`hf_evon.optim.curvature`). ``inf``: no noise, a SOAP-like method.
            A number set later in ``param_groups`` is kept, no longer refit (so is a set ``weight_decay``).
        hess_init: initial Hessian h0 > 0 everywhere.
        betas: (β1, β2) for the momentum and the Hessian.
        weight_decay: prior precision δ > 0 per datum (0 only at ess=inf): prior ``N(0, (ζ δ)^-1 I)``. None (the
            default): ``default_weight_decay(hess_init, init_std_ratio)`` (the prior's std 5x the
            initial one), refit to a fraction of H's scale under the Fisher estimate.
        hess_estimator: "fisher" (default: EMA of the squared rotated gradient) or "price" (the
            paper's Stein estimate; clipped by ``hess_clip_ratio``): :class:`HessEstimator`.
        curvature_refit: refit the "auto" ζ and the None δ every this many steps (0: never).
        step_curvature: "matrix" (default: the step divides by each matrix's mean H + δ) or
            "entry" (the paper's per-entry Newton step): :class:`StepCurvature`.
        mean_weight_decay: an L2 pull on the mean besides δ's. None: δ's default from h0 where
            δ is fitted to the curvature, else 0.
        mc_samples: posterior samples per step (the number of ``sampled_params`` blocks).
        precondition_frequency: refresh the eigenbases every f updates (one power step + QR).
        max_precond_dim: a side larger than this keeps the identity basis.
        max_precond_ratio: so does a side more than this many times the matrix's other side.
        shampoo_beta: β3 for the statistics L and R (default: β2).
        hess_clip_ratio: γ of the adaptive Hessian clipping (None: off).
        clip: update clipping: "none" (the pure algorithm), "element" (|Δ_ij| ≤ radius),
            "spectral" (singular values ≤ radius), "whiten" (Newton–Schulz, as Muon) or
            "whiten_rms" (the default: Newton–Schulz, scaled to entry RMS ``clip_radius``).
        clip_radius: the radius for "element" and "spectral"; for "whiten_rms" a full-rank step's entry RMS (a low-rank one's is less).
        snr_scaling: "adam" (default, ``DEFAULT_SNR_SCALING``): scale each matrix's clipped step by min(1, ρ),
            ρ = ‖m̂‖_F / sqrt(EMA‖G‖²_F) (Adam's own step size; EMA decay ``SNR_AVERAGE_BETA``). True: by
            min(1, ρ/ρ₀), ρ₀ = ``snr_floor(β1)``: full steps until the gradients fade. No effect with
            ``clip="none"`` (the Newton step has its own size). The paper's algorithm (and recipes): False.
        phased_gradients: alternate clean steps (gradient at the mean; L, R updated) and
            noisy steps (sampled weights; Hessian updated).
        identity_basis: keep Q = I everywhere, i.e. IVON (a diagonal posterior).
        stagger_refresh: give each matrix its own phase in the refresh cycle (still every f updates),
            balanced by cost, so no step pays for all QRs at once. False refreshes every matrix after
            the updates with t % f == 0. A group's costliest (or only) matrix has phase 0.
        init_std_ratio: the initial posterior std relative to the weights' RMS for ``ess="auto"``.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW groups' lr, betas, eps, weight_decay
            (torch AdamW's keys; ``adamw_lr=None``: use ``lr``, EVON's rate, which is rarely right for AdamW).
        nonfinite: "skip" (warn, leave everything untouched) or "raise" on a NaN/inf gradient.
        seed: seed of the posterior noise; each data-parallel rank derives its own stream.
        eps: the ε of adaptive Hessian clipping (EVON groups; an AdamW group's ``eps`` is AdamW's ε).
    """

    # torch.amp.GradScaler then hands step() its scale instead of stepping blindly: EVON refuses it
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]],
        lr: float | None = None,
        ess: float | str = AUTO_ESS,
        hess_init: float = DEFAULT_HESS_INIT,
        betas: tuple[float, float] = DEFAULT_BETAS,
        weight_decay: float | None = None,
        mc_samples: int = 1,
        precondition_frequency: int = 10,
        max_precond_dim: int = 4096,
        max_precond_ratio: float = DEFAULT_MAX_PRECOND_RATIO,
        shampoo_beta: float | None = None,
        hess_clip_ratio: float | None = DEFAULT_HESS_CLIP_RATIO,
        clip: str | Clip = DEFAULT_CLIP,
        clip_radius: float = DEFAULT_CLIP_RADIUS,
        snr_scaling: bool | str = DEFAULT_SNR_SCALING,
        phased_gradients: bool = False,
        identity_basis: bool = False,
        stagger_refresh: bool = True,
        init_std_ratio: float = DEFAULT_INIT_STD_RATIO,
        adamw_lr: float | None = DEFAULT_ADAMW_LR,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        nonfinite: str | NonFinite = "skip",
        seed: int | None = None,
        eps: float = 1e-12,
        hess_estimator: str | HessEstimator = DEFAULT_HESS_ESTIMATOR,
        curvature_refit: int = DEFAULT_CURVATURE_REFIT,
        step_curvature: str | StepCurvature = DEFAULT_STEP_CURVATURE,
        mean_weight_decay: float | None = None,
    ) -> None:
        clip, nonfinite = mode_value(clip), mode_value(nonfinite)
        hess_estimator, step_curvature = mode_value(hess_estimator), mode_value(step_curvature)
        # every keyword as given: the first invalid one raises, by name; lr=None becomes clip's α
        given = {k: v for k, v in locals().items() if k not in ("self", "params", "__class__")}
        defaults = validate_hyperparameters(**given)
        lr = defaults["lr"]
        defaults = {"algorithm": "evon", **defaults, "betas": tuple(defaults["betas"])}
        self._adamw_defaults = dict(lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps, weight_decay=adamw_weight_decay)  # torch AdamW's keys
        self.nonfinite, self.seed, self.skipped_steps = nonfinite, resolve_seed(seed), 0
        # posterior_health(warn=True) every this many steps (a host sync; 0: never); steps this object took
        self.health_check_every, self._updates = 100, 0
        self._health_warned: set[str] = set()  # each health warning is given once
        # train=True / train=False blocks entered so far: the blocks' noise labels (noise_label)
        self._sample_blocks = self._eval_blocks = 0
        self._stepped_blocks = 0  # _sample_blocks when the last step() ended: a trainer starting over rewinds to it
        self._reset_transient()
        super().__init__(params, defaults)

    def _reset_transient(self) -> None:
        """What is rebuilt rather than saved or copied (:mod:`hf_evon.optim.persistence`)."""
        self._checked_groups: dict[int, tuple[Any, ...]] = {}  # validate_groups' settings found valid
        self._fit_records: dict[int, dict[str, Any]] = {}  # the keys that decided each group's fits (build_group)
        self._streams = StreamGenerators()
        self._buckets: list[Bucket] | None = None
        self._bucket_index: dict[int, tuple[Bucket, int]] | None = None
        self._samples = 0  # samples recorded since the last step
        self._in_sample = self._training_block = False
        self._consumed: Consumed = {}  # what the last step consumed (consumed_grads): a block drops, not adds, it
        self._held: Consumed = {}  # the gradients that hold the step's samples (set_aside_grads)
        self.gradient_reducer: Callable[[list[Tensor]], None] | None = None  # prepare_distributed's: averages tensors in place
        self._synchronized = False
        # this rank's share of the parameters (prepare_distributed(shard=True), FSDP2); None: all (LOCAL)
        self.sharding: ShardingHooks | None = None

    @property
    def _hooks(self) -> ShardingHooks:
        return LOCAL if self.sharding is None else self.sharding

    # ------------------------------------------------------------------ set-up
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim``'s ``add_param_group``, validated; refused while samples are pending: a new
        group rebuilds the buckets, which hold the Hessian numerators recorded since the last step."""
        self._refuse_rebuild("add_param_group()")
        super().add_param_group(self._hooks.new_group(prepare_group(param_group, self._adamw_defaults)))
        try:
            build_group(self.param_groups[-1], self._updates, self._fit_records)
        except BaseException:
            self.param_groups.pop()  # a refused group leaves the optimizer as it was
            raise
        self._buckets = None

    @property
    def mc_samples(self) -> int:
        """The largest ``mc_samples`` over EVON groups (how many samples a step expects)."""
        return samples_per_step(self.param_groups)  # each checked: an edit is named, not met by range()

    @property
    def recorded_samples(self) -> int:
        """Training blocks since the last step: ``step()`` divides the summed gradients by it (at least 1)."""
        return self._samples

    @property
    def sample_blocks(self) -> int:
        """``sampled_params(train=True)`` blocks entered so far, a refused one not counted (in the state dict)."""
        return self._sample_blocks

    @property
    def noise_label(self) -> int | str:
        """The current block's noise label: the training blocks' count, or ``"eval N"`` in the N-th
        ``train=False`` block. A block's noise is fixed by (seed, rank, label, device): any rank resumes
        its stream from a checkpoint another rank saved, and an evaluation never changes training's."""
        return f"eval {self._eval_blocks}" if self._in_sample and not self._training_block else self._sample_blocks

    @property
    def in_sample(self) -> bool:
        """Whether a ``sampled_params()`` block is running: the weights hold a sample, not the mean."""
        return self._in_sample

    def _generator(self, device: torch.device) -> torch.Generator:
        """The noise generator of the current ``sampled_params`` block on ``device``."""
        return self._streams.get(device, self.seed, process_rank(), self.noise_label, str(device))

    @property
    def buckets(self) -> list[Bucket]:
        """This rank's EVON parameters, bucketed with their stacked state (built on first use)."""
        reset = any(b.stale(self.state, self._hooks.model_param) for b in self._buckets or ())  # torch's reset
        if reset or self._buckets is not None and self._layout.edited(self.param_groups, self._param_label):
            if self._samples:  # stacked again (optimizer.state or a group's params), unless samples await
                self._refuse_rebuild("clearing or replacing optimizer.state, or editing a group's params", False)
            self._buckets = None
        if self._buckets is None:
            self._bucket_index = None
            self._buckets = self._build_buckets()
        return self._buckets

    def invalidate_buckets(self) -> None:
        """Rebuild the buckets and re-stack the state at next use (ownership or ``self.state`` changed outside)."""
        self._refuse_rebuild("invalidate_buckets()")
        self._buckets = None

    def install_sharding(self, hooks: ShardingHooks) -> None:
        """Distribute by ``hooks`` (``prepare_distributed``): others' state dropped, buckets rebuilt."""
        self.sharding = hooks
        for p in [p for p in self.state if not hooks.owns(p)]:
            del self.state[p]
        self.invalidate_buckets()

    def _build_buckets(self) -> list[Bucket]:
        refuse_unplaced(self.param_groups, self._param_label, sharded=self.sharding is not None)
        built = group_buckets(self.param_groups)
        assign_refresh_phases(self.param_groups, built)  # over every member: the same sharded or not
        built = [b for b in (self._hooks.owned_bucket(b) for b in built) if b.params]
        for b in built:
            stack_state(b, self._member_state)
        resolve_auto_ess(self.param_groups, self._hooks.square_sums)
        note_fitted(self.param_groups, self._fit_records)
        self._layout = BuiltLayout(self.param_groups)
        return built

    def _settle_groups(self) -> None:
        """Every group valid (``validate_groups``), ``ess="auto"`` set mid-run resolved as the
        constructor's, and none changed in what its buckets were built from (``BuiltLayout.check``)."""
        validate_groups(self.param_groups, self._checked_groups, self._fit_records)
        if self._buckets is not None:
            self._layout.check(self.param_groups)
            resolve_auto_ess(self.param_groups, self._hooks.square_sums)
            note_fitted(self.param_groups, self._fit_records)

    def _refuse_in_sample(self, call: str) -> None:
        if self._in_sample:
            raise RuntimeError(f"{call} called inside a sampled_params() block: call it after the block")
        refuse_held((p for g in self.param_groups for p in g["params"]), call.partition(" (")[0], self._param_label)

    def _refuse_rebuild(self, call: str, called: bool = True) -> None:  # buckets: the samples' numerators
        if called:  # else found at the next use of the buckets, which may be inside a block
            self._refuse_in_sample(call)
        if self._samples:  # found (not called): step() itself refuses, so the ways out are named
            way = "Call step() first" if called else "Put it back before step() or call discard_samples()"
            msg = f"the {self._samples} recorded sample(s) would lose their Hessian estimate. {way}"
            raise RuntimeError(f"{call} was called between a sampled_params(train=True) block and step(): {msg}")

    def _member_state(self, p: Tensor) -> dict[str, Any]:
        """``self.state`` of a bucket member (FSDP2: the owner's full copy of a DTensor, state under the DTensor)."""
        return self.state[self._hooks.model_param(p)]

    # ----------------------------------------------------------- sampling
    @contextlib.contextmanager
    def sampled_params(self, train: bool = True) -> Iterator[None]:
        """Put one posterior sample into every EVON-owned weight for the enclosed code.

        With ``train=True`` the block records its own gradient for the next ``step()`` (the sum
        over the step's blocks divided by their number). Inside it ``.grad`` holds only this
        block's gradient (micro-batches accumulate there): earlier samples' gradients are set aside
        at entry and added back at exit, so ``zero_grad()`` inside the block (the reference
        packages' loop) and accumulating without it give the same update; gradients the previous
        ``step()`` consumed are dropped, not counted again. On exit, also on an exception, the
        mean is restored bit-for-bit; a block that raised is not recorded (``.grad`` as before it,
        less what the last step consumed); an interrupt (Ctrl-C) also drops the step's earlier
        samples. Frozen parameters are not perturbed. ``train=False`` only samples (BMA)."""
        self._refuse_in_sample("sampled_params() (blocks cannot be nested)")
        checks.check_flag(train, "sampled_params: train")  # a string would decide the recording only at the exit
        self._settle_groups()
        perturbed: list[Bucket] = []
        stash: list[tuple[Tensor, Tensor | None]] | None = [] if train else None
        ok, exited, refused, grad_mode, claimed = False, False, None, torch.is_grad_enabled(), set()
        try:
            try:  # from here on an interrupt anywhere is cleaned up below
                self._in_sample, self._training_block, self._streams = True, train, StreamGenerators()
                if stash is not None:  # filled as it goes: every gradient set aside is given back
                    set_aside_grads(self.param_groups, self._consumed, stash, self._held, self.discard_samples)
                with torch.no_grad(), linalg.writing_weights():
                    self._hooks.before_sample()  # FSDP2: the owners' copies of the weights up to date
                    buckets = self.buckets  # its refusals (and set_aside_grads') before the block counts
                    self._sample_blocks += train  # the block's noise label, a refused block's never
                    self._eval_blocks += not train
                    for b in buckets:
                        if not math.isinf(b.group["ess"]) and not (train and not b.noisy_phase()):
                            perturbed.append(b)  # before the draw: an error inside still restores it
                            if not b.perturb(self._standard_normal, train):  # all its members frozen
                                perturbed.pop()
                    # held_samples: no posterior block or BMA pass samples around this sample
                    claim_samples((b.model_params(self._hooks.model_param) for b in perturbed), claimed)
                    self._hooks.share_sample()
                yield
                ok = True
            finally:
                with torch.no_grad(), linalg.writing_weights():
                    failed = train and not ok and (not self._hooks.model_collectives or gradients.backward_ran(self.param_groups))
                    refused = self._hooks.end_sample(recorded=ok and train, failed=failed)
                    ok = ok and refused is None  # sharded: it raised on another rank, recorded on none
                    kept = set() if stash is None else gradients.kept_ids(stash)
                    for b in perturbed if ok else ():
                        if b.acc is not None and b.z is not None:
                            b.record_sample(alone=kept.isdisjoint(map(id, b.params)))
                    restore_means(perturbed)
                    release_sample(claimed)  # the means are back
                    if stash is not None:
                        self._held = restore_grads(stash, ok, self) or self._held  # None: not recorded
                self._samples += int(ok and train)
                self._synchronized &= not (ok and train)  # its own gradients are not averaged yet
                exited = True
                if refused is not None:
                    raise RuntimeError(refused)
        finally:
            if not exited:  # interrupted (Ctrl-C): the means back, the step's samples dropped
                with torch.no_grad(), linalg.writing_weights():
                    restore_means(perturbed)
                    release_sample(claimed)
                    if stash is not None:
                        restore_grads(stash, False)
                self.discard_samples()
            self._in_sample = False
            torch.set_grad_enabled(grad_mode)  # a no_grad block interrupted at its exit leaves it off

    def _standard_normal(self, b: Bucket) -> Tensor:
        """The bucket's draw ``z``: this rank's stream, or (sharded) one stream per matrix."""
        z = self._hooks.standard_normal(b)
        if z is not None:
            return z
        device = b.params[0].device
        return torch.randn(
            len(b.params), b.m, b.n, generator=self._generator(device), device=device, dtype=b.dtype
        )

    def current_noise(self, p: Tensor) -> Tensor:
        """The rotated-space draw ``E`` (shaped m×n) of the sample now in ``p`` (for tests)."""
        b, i = self._locate(p)
        if b.z is None:
            raise RuntimeError("no training sample is in progress for this parameter")
        return b.z[i] * linalg.rotated_std(b.state["hess"][i], b.group["ess"], b.group["weight_decay"])

    # --------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One EVON update of every EVON group and one AdamW update of every AdamW group.

        ``closure`` (optional, it calls ``backward()``) is called ``mc_samples`` times, each inside its own
        ``sampled_params(train=True)`` block; the step returns the mean of the losses it returns."""
        self._refuse_in_sample("step()")  # before the step mark below: a refused call changes nothing
        refuse_grad_scaler(self)
        loss = None if closure is None else gradients.closure_loss(self, closure)
        with linalg.writing_weights():  # no autocast: the state keeps its dtypes; a forward casts the new means
            try:
                self._update()
            finally:  # a skipped or refused step too: a rewind never draws its noise again
                self._stepped_blocks = self._sample_blocks
        return loss

    def _update(self) -> None:
        self._settle_groups()
        self._placement_checked = False  # set by a reducer that, within this call, finds none moved
        self.synchronize()
        self._hooks.before_step()  # FSDP2: the owners gather the step's (clipped) gradients
        num_samples = max(self._samples, 1)
        adamw = adamw_inputs(self.param_groups, self.state, self._hooks, num_samples)
        moved = None if self._placement_checked else moved_refusal(self.buckets, adamw, self._param_label)
        # (a bucket whose members are all frozen, none with a gradient, steps nothing: it needs no sample)
        needs_samples = self._samples == 0 and any(b.noisy_phase() and any(p.grad is not None for p in b.params) for b in self.buckets)
        refused = moved is not None or needs_samples  # then no plans: the step raises
        plans = [] if refused else [p for b in self.buckets for p in step_plans(b, num_samples, self._member_state)]
        if not self._step_agreed(plans, adamw, moved, needs_samples):
            self.discard_samples()
            return

        evon_updates(plans, num_samples, self._member_state)
        for gi, (params, g_list, states) in adamw.items():
            adamw_update(self.param_groups[gi], params, g_list, states)
        self._hooks.after_step()
        self.discard_samples()
        self._updates += 1
        due = refits_due(self.param_groups, self._updates)
        if due:
            fit_from_curvature(due, self.buckets, self._hooks, self._updates, self._fit_records)
        if self.health_check_every and self._updates % self.health_check_every == 0:
            self.posterior_health(warn=True)

    def synchronize(self) -> None:
        """Average, across data-parallel ranks, what the next step uses: the gradients and the
        Hessian numerators, once per step (each rank samples with its *own* gradients, which its
        Hessian estimate needs). ``step()`` calls it; call it earlier to clip or log averaged
        gradients. Without a ``gradient_reducer`` (single process) it does nothing."""
        if self._synchronized:
            return
        if self.gradient_reducer is None:
            refuse_unprepared_processes()
            return
        tensors = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        tensors += [b.acc for b in self.buckets if b.acc is not None]
        try:
            self.gradient_reducer(tensors)
        except BaseException:  # the step is refused (ranks disagree): its samples must not leak
            self.discard_samples()
            raise
        self._synchronized = True

    def discard_samples(self, rewind: bool = False) -> None:
        """Drop the samples recorded since the last step. ``rewind`` (a trainer starting over after an
        abort): also the noise counter back to the end of the last ``step()`` call, so the blocks of
        the step that never completed draw again the noise a run that never aborted draws."""
        if checks.check_flag(rewind, "discard_samples: rewind"):
            self._refuse_in_sample("discard_samples(rewind=True)")
            self._sample_blocks = self._stepped_blocks
        self._samples, self._synchronized = 0, False
        for b in self._buckets or ():  # (buckets not built yet hold none)
            b.acc = b.exit_grads = b.rotated_grads = None
        self._consumed, self._held = consumed_grads(self.param_groups), {}

    def _step_agreed(self, plans: list[Plan], adamw: AdamWInputs, moved: str | None, needs_samples: bool) -> bool:
        """Whether no rank refuses the step (a ``moved`` parameter, ``needs_samples``: raises on every rank)
        and all is finite on every rank (else warns, or raises: ``nonfinite``), in one agreed flag."""
        refused = moved is not None or needs_samples
        if self._hooks.all_ranks(not refused and finite_flags(plans, adamw, self.param_groups, self._param_label)):
            return True
        self._synchronized = False  # the next step's gradients are not averaged yet
        msg = None if refused else health.first_nonfinite(self.param_groups, plans, adamw, self._param_label)
        found = self._hooks.every_rank((moved, needs_samples, msg))  # sharded: the owner names it
        refuse_step(found, moved, self.discard_samples)
        msg = health.skipped_reason([m for _, _, m in found if m is not None])
        if self.nonfinite == "raise":
            self.discard_samples()
            raise NonFiniteGradientError(msg)
        self.skipped_steps += 1
        health.warn_skipped(msg)
        return False

    def _param_label(self, p: Tensor) -> str:
        return health.param_label(self.param_groups, self._hooks.model_param(p))  # FSDP2: p's DTensor

    # ---------------------------------------------------------- inspection
    def _locate(self, p: Tensor) -> tuple[Bucket, int]:
        if not isinstance(p, Tensor):  # a name, say: posterior_std(model.get_parameter(name)) takes it
            raise TypeError(f"expected one of this optimizer's parameters, a tensor; got {type(p).__name__} {p!r}")
        p = self._hooks.bucket_param(p)  # FSDP2: a DTensor's bucket member is its owner's full copy
        if not self.buckets or self._bucket_index is None:  # self.buckets first: a rebuild drops the index
            self._bucket_index = {id(q): (b, i) for b in self.buckets for i, q in enumerate(b.params)}
        if id(p) not in self._bucket_index:
            raise ValueError(f"a tensor of shape {tuple(p.shape)} is not trained by EVON in this optimizer")
        return self._bucket_index[id(p)]

    @torch.no_grad()
    def posterior_health(self, warn: bool = True) -> dict[str, float]:
        """Noise-to-signal and Hessian statistics of the current posterior (:func:`~hf_evon.optim.
        health.health_stats`; one host sync; sharded: a collective, on every rank). With ``warn``,
        the first runaway noise or collapse to a broad prior warns, naming the cause and the fix."""
        rows, numel = health.health_rows(self.buckets)
        rows, numel = self._hooks.pool_rows(rows, numel)  # sharded: every rank's matrices
        stats = health.health_stats(rows, numel)
        if warn and stats:
            health.warn_health(stats, self._health_warned, self.buckets, self._param_label)
        return stats

    def posterior_factors(self, p: Tensor) -> dict[str, Any]:
        """``Q_L``, ``Q_R`` (None where identity), ``hess`` and the group's ess/weight decay."""
        if not self._hooks.owns(p):
            return self._hooks.remote_factors(p)
        b, i = self._locate(p)
        q_left, q_right = b.bases() if b.initialized else (None, None)
        return {
            "Q_L": None if q_left is None else q_left[i],
            "Q_R": None if q_right is None else q_right[i],
            "hess": b.state["hess"][i],
            "ess": b.group["ess"],
            "weight_decay": b.group["weight_decay"],
            "matrix_shape": (b.m, b.n),
        }

    def posterior_covariance(self, p: Tensor, max_elements: int = linalg.MAX_DENSE_COVARIANCE_ELEMENTS) -> Tensor:
        """Dense covariance of ``p.flatten()`` (row-major), for parameters of at most ``max_elements`` entries."""
        f = self.posterior_factors(p)
        linalg.refuse_dense_covariance(self._param_label(p), p.numel(), max_elements, "posterior_covariance()")
        return linalg.dense_covariance(f["hess"], f["Q_L"], f["Q_R"], f["ess"], f["weight_decay"])

    def posterior_std(self, p: Tensor) -> Tensor:
        """Marginal posterior standard deviations, shaped like ``p``."""
        f = self.posterior_factors(p)
        return linalg.marginal_variance(f["hess"], f["Q_L"], f["Q_R"], f["ess"], f["weight_decay"]).sqrt().reshape(p.shape)

    # ---------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        self._refuse_in_sample("state_dict() (the weights hold a sample: a checkpoint now would resume from it)")
        with saving(self, self._hooks.full_state_dict):  # sharded: a collective, the full state on every rank
            return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._refuse_rebuild("load_state_dict()")
        with loading(self, state_dict, self._hooks.local_state_dict):  # sharded: this rank's part of a full one
            super().load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, ``pickle``) trains on as the original would."""
        self._refuse_rebuild("copying or pickling the optimizer")
        if self.sharding is not None or self.gradient_reducer is not None:
            raise RuntimeError("a distributed EVON cannot be copied or pickled: save its state_dict()")
        return {**super().__getstate__(), "_evon": copied_attributes(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        own = (state := dict(state)).pop("_evon", None)  # None: torch's load_state_dict setting state and groups
        super().__setstate__(state)
        if own is not None:
            restore_copied(self, own)


def unwrap_optimizer(optimizer: Any) -> EVON:
    """The ``EVON`` inside ``optimizer`` (e.g. accelerate's ``AcceleratedOptimizer``)."""
    seen = optimizer
    for _ in range(8):
        if isinstance(seen, EVON):
            return seen
        seen = getattr(seen, "optimizer", None)
        if seen is None:
            break
    raise TypeError(
        f"expected an hf_evon EVON optimizer; got {type(optimizer).__name__} (EVON is looked for inside "
        "wrappers such as accelerate's AcceleratedOptimizer, through their .optimizer)"
    )
