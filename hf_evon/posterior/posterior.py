"""EVON posteriors ("SOAP-Bubbles") as standalone objects: sample, inspect, save, load, share.

An :class:`EVONPosterior` is a snapshot of the Gaussian weight posterior an ``EVON`` optimizer
has learned, keyed by the model's own parameter names, so it can be used without the optimizer:
sampled into a model (``with posterior.sampled(model): ...``), drawn as a batch of perturbations
(``posterior.draw(S)``), inspected (``std``, ``covariance``), saved next to the model
(``save_pretrained``), loaded (``from_pretrained``) and shared on the Hub (``push_to_hub``).
Parameters EVON does not own (embeddings, heads, 1-D tensors) are point estimates.

This module ties the layers below it to models and optimizers; none of them knows the object:
``gaussian`` (``vec W ~ N(vec M, (Q_L ⊗ Q_R) diag(V) (Q_L ⊗ Q_R)ᵀ)``, ``V = 1/(ζ(H + δ))``, and
batched sampling), ``config`` and ``format`` (the file format, ``docs/posterior-format.md``),
``snapshot`` (factors read from a live ``EVON``); saving, loading and pushing (``save_pretrained``,
``from_pretrained``, ``push_to_hub``) are :mod:`hf_evon.posterior.persistence`'s, over ``hub`` and ``model_card``.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from hf_evon.modeling import pruned_ranks, unused_adapter_parameters, unwrap_model
from hf_evon.optim.checks import check_flag, is_real, sample_count
from hf_evon.optim.linalg import MAX_DENSE_COVARIANCE_ELEMENTS, refuse_dense_covariance, writing_weights
from hf_evon.optim.noise import resolve_seed
from hf_evon.posterior.config import (
    FORMAT_VERSION,
    POSTERIOR_CONFIG_NAME,
    POSTERIOR_WEIGHTS_NAME,
    PosteriorConfig,
    PosteriorMismatchError,
    as_dtype,
    check_noise_scale,
    check_tied_parameters,
    declared_basis_dtype,
    dtype_name,
    ess_number,
    hand_set_scale,
)
from hf_evon.posterior.fingerprint import warn_if_other_mean
from hf_evon.posterior.format import check_finite_std
from hf_evon.posterior.gaussian import (
    DEFAULT_MAX_BASIS_RATIO,
    FactorGroup,
    MatrixFactors,
    add_perturbation,
    basis_dtype,
    draw_batches,
    drop_wide_bases,
    drop_wide_basis,
    sample_group,
    sample_seed,
    stack_factors,
)
from hf_evon.posterior.names import holding_sample, model_problems, resident_parameters
from hf_evon.posterior.persistence import PosteriorFilesMixin
from hf_evon.posterior.snapshot import snapshot

Tensor = torch.Tensor

# EVONPosterior, and the names that come with it (their homes are config and gaussian)
__all__ = ["FORMAT_VERSION", "MAX_DENSE_COVARIANCE_ELEMENTS", "POSTERIOR_CONFIG_NAME", "POSTERIOR_WEIGHTS_NAME"]
__all__ += ["EVONPosterior", "MatrixFactors", "PosteriorMismatchError"]


def checked_basis_ratio(max_basis_ratio: Any) -> float | None:
    """``max_basis_ratio`` as a float (None: keep every basis), or the error naming it."""
    if max_basis_ratio is None:
        return None
    if not is_real(max_basis_ratio):  # NumPy numbers too, not a bool
        raise TypeError(f"max_basis_ratio must be a number >= 1 or None; got {max_basis_ratio!r}")
    if not max_basis_ratio >= 1.0:
        raise ValueError(f"max_basis_ratio must be >= 1 (or None: keep every basis); got {max_basis_ratio!r}")
    return float(max_basis_ratio)


class EVONPosterior(PosteriorFilesMixin):
    """The SOAP-Bubble posterior of an EVON-trained model, usable without the optimizer.

    Build it with :meth:`from_optimizer` (a snapshot: later training does not change it) or
    :meth:`from_pretrained`. It covers exactly the EVON-owned parameters, keyed by the
    model's parameter names; every other model parameter is a point estimate. A weight the model
    ties under several names is covered once, under its first; ``in``, ``[]``, ``std``, ``covariance``
    and ``draw(names=...)`` take its other names too (``config["tied_parameters"]``). The mean is
    not stored: it is the model's weights, so a posterior is used together with its model.

    Attributes:
        names: covered parameter names, sorted.
        ess: effective sample size ζ (``inf``: no noise).
        weight_decay: prior precision per datum δ.
        config: hyperparameters and bookkeeping (``format_version``, ``eigenbasis_dtype``...).
        num_point_estimates: number of model parameters (scalars) without a posterior.
        num_point_estimate_tensors: number of model tensors without a posterior.
    """

    def __init__(
        self,
        groups: list[FactorGroup],
        config: dict[str, Any],
        num_point_estimates: int | None = None,
        num_point_estimate_tensors: int | None = None,
    ) -> None:
        if not groups:
            raise ValueError("an EVONPosterior needs at least one covered parameter")
        self._groups = groups
        self._index: dict[str, tuple[int, int]] = {
            name: (gi, i) for gi, g in enumerate(groups) for i, name in enumerate(g.names)
        }
        self.names: list[str] = sorted(self._index)
        self.config: dict[str, Any] = dict(config)
        # a tied weight's other names (config["tied_parameters"]), each resolving to the name it is covered under
        self._aliases = check_tied_parameters(self.config.get("tied_parameters"), self._index, "EVONPosterior.config")
        self.num_point_estimates = num_point_estimates
        self.num_point_estimate_tensors = num_point_estimate_tensors

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_optimizer(
        cls,
        optimizer: Any,
        model: nn.Module,
        *,
        max_basis_ratio: float | None = DEFAULT_MAX_BASIS_RATIO,
        eigenbasis_dtype: torch.dtype | str | None = None,
    ) -> EVONPosterior:
        """Snapshot the posterior of every EVON-owned parameter of ``optimizer``.

        Parameters are matched to ``model.named_parameters()`` by identity, so names are the
        model's own (for a ``PeftModel`` e.g. ``base_model.model....lora_A.default.weight``).
        Factors are copied: the posterior does not change when training continues. Wrappers
        (accelerate's ``AcceleratedOptimizer``, ``(Distributed)DataParallel``) are unwrapped.
        With sharded EVON this is a collective: every rank calls it.

        By default the posterior is *lean* (:meth:`lean`): a basis whose side is more than
        ``max_basis_ratio`` times the other side (the d×d side of a LoRA matrix) is dropped,
        every marginal variance kept; ``max_basis_ratio=None`` keeps every basis (an exact
        copy of the optimizer's factors). ``eigenbasis_dtype`` (e.g. ``torch.float16``) holds
        the bases in half precision (half their bytes).
        """
        taken, ratio = snapshot(optimizer, model), checked_basis_ratio(max_basis_ratio)
        factors = taken.factors if ratio is None else {n: drop_wide_basis(f, ratio) for n, f in taken.factors.items()}
        posterior = cls.from_factors(  # stacks the live views into copies (not the bases dropped first)
            factors, taken.settings, taken.num_point_estimates, taken.num_point_estimate_tensors
        )
        if max_basis_ratio is None and eigenbasis_dtype is None:
            return posterior
        return posterior.lean(max_basis_ratio, eigenbasis_dtype)

    @classmethod
    def from_factors(
        cls,
        factors: Mapping[str, MatrixFactors],
        config: Mapping[str, Any] | None = None,
        num_point_estimates: int | None = None,
        num_point_estimate_tensors: int | None = None,
    ) -> EVONPosterior:
        """A posterior from explicit per-parameter factors (tests, benchmarks, conversions).

        Shapes and ``config`` are checked here (its fields as a save checks them; its top-level ``ess``
        and ``weight_decay``, by default the first factor's, must be some factor's: the factors' own are
        what the posterior samples with); orthonormality and positivity are the caller's business
        (they are checked when the posterior is loaded from files).
        """
        if not factors:
            raise ValueError("an EVONPosterior needs at least one covered parameter")
        groups = stack_factors(factors)  # shapes checked there
        config = dict(config or {})
        config["format_version"] = FORMAT_VERSION
        some = factors[next(iter(factors))]
        config["eigenbasis_dtype"] = dtype_name(basis_dtype(factors))
        for key in ("ess", "weight_decay"):
            held = sorted({getattr(f, key) for f in factors.values()})
            if config.setdefault(key, getattr(some, key)) not in held:
                raise ValueError(
                    f"from_factors: config[{key!r}] = {config[key]!r} is no covered parameter's {key} "
                    f"(the factors hold {held[:5]}), which the posterior samples with"
                )
        # every field checked as a save checks it: the error names the field, here and not at save_pretrained
        PosteriorConfig.for_save(config, factors, None, num_point_estimates, num_point_estimate_tensors)
        return cls(groups, config, num_point_estimates, num_point_estimate_tensors)

    # ------------------------------------------------------------------ inspection
    @property
    def ess(self) -> float:
        """Effective sample size ζ (the top-level one; see ``factors`` for per-parameter values)."""
        return float(self.config["ess"])

    @property
    def weight_decay(self) -> float:
        """Prior precision per datum δ (the prior is ``N(0, (ζ δ)⁻¹ I)``)."""
        return float(self.config["weight_decay"])

    @property
    def factors(self) -> dict[str, MatrixFactors]:
        """Per covered name: ``Q_L``, ``Q_R`` (None = identity), ``hess``, shapes, ess, weight decay."""
        return {name: self[name] for name in self.names}

    @property
    def num_covered(self) -> int:
        """Number of scalar parameters with a posterior."""
        return sum(math.prod(s) for g in self._groups for s in g.shapes)

    def __getitem__(self, name: str) -> MatrixFactors:
        if name not in self:
            raise KeyError(f"{name!r} is not covered by this posterior")
        gi, i = self._index[self._aliases.get(name, name)]
        return self._groups[gi].factors(i)

    def __contains__(self, name: object) -> bool:
        return name in self._index or name in self._aliases

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __repr__(self) -> str:
        if self.num_point_estimates is None:
            points = "point estimates unknown"
        else:
            points = (
                f"{self.num_point_estimate_tensors} tensors / {self.num_point_estimates:,} parameters "
                "are point estimates"
            )
        return (
            f"EVONPosterior(covers {len(self.names)} tensors / {self.num_covered:,} parameters; {points}; "
            f"ess={self._span('ess')}, weight_decay={self._span('weight_decay')}, "
            f"eigenbasis_dtype={self.config.get('eigenbasis_dtype')})"
        )

    def _span(self, field: str) -> str:
        """A noise setting as the groups hold it: one value, or its range where tensors differ (several
        EVON groups, ``with_ess({...})``; the top-level value is one tensor's)."""
        low, *_, high = sorted(getattr(g, field) for g in self._groups) * 2  # * 2: one group is low and high
        return f"{low:g}" if low == high else f"{low:g} to {high:g} (by tensor)"

    def std(self, name: str) -> Tensor:
        """Marginal posterior standard deviations of ``name``, shaped like the parameter (0 at pruned ranks: draw)."""
        return self[name].std((self.config.get("pruned_ranks") or {}).get(self._aliases.get(name, name)))

    def covariance(self, name: str, max_elements: int = MAX_DENSE_COVARIANCE_ELEMENTS) -> Tensor:
        """Dense covariance of the row-major flatten of ``name`` (small parameters only; 0 in the rows
        and columns of pruned ranks, as ``std`` and ``draw``)."""
        f = self[name]
        refuse_dense_covariance(repr(name), math.prod(f.shape), max_elements, "covariance()")
        return f.covariance((self.config.get("pruned_ranks") or {}).get(self._aliases.get(name, name)))

    # ------------------------------------------------------------------ sampling
    def draw(
        self,
        num_samples: int,
        seed: int | None = None,
        names: Iterable[str] | str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        rotated: bool = False,
    ) -> dict[str, Tensor]:
        """Draw perturbations ``W_s − M`` without touching any model.

        Returns ``{name: (S, *param_shape)}``, each covered tensor once, or each of ``names`` (a tied weight's
        other name: its covered name's draws). Sample ``s`` is ``sampled(model, seed=seed + s)``'s, as the BMA
        passes take for ``bma_seed = seed`` (seeds ``S`` apart give disjoint sets), its noise from a generator
        seeded by ``(seed + s, name)``: a parameter's values do not depend on which others are drawn. Math in float32; ``dtype`` casts the result. ``seed=None`` takes a seed from
        torch's global RNG. AdaLoRA's pruned ranks (``config["pruned_ranks"]``) are 0, as in ``sampled``.
        ``rotated=True``: the draws before the bases are applied (none zeroed), ``E_s = z_s ⊙ √V`` shaped
        ``(S, m, n)`` (``W_s − M = Q_L E_s Q_Rᵀ``): no matmuls, for code that applies the bases to activations
        instead of to the weights.
        """
        num_samples = sample_count(num_samples)
        check_flag(rotated, "draw: rotated")
        seed, dtype = resolve_seed(seed), as_dtype(dtype, "draw: dtype")
        wanted = self._select(names)
        covered = set(wanted.values())
        out: dict[str, Tensor] = {}
        for group in self._groups:
            idx = [i for i, name in enumerate(group.names) if name in covered]
            if not idx:
                continue
            noise = sample_group(group, idx, num_samples, seed, device, rotated, self.config.get("pruned_ranks"))
            for j, i in enumerate(idx):
                value = noise[j] if rotated else noise[j].reshape(num_samples, *group.shapes[i])
                out[group.names[i]] = value if dtype is None else value.to(dtype)
        return {name: out[wanted[name]] for name in sorted(wanted)}

    def _select(self, names: Iterable[str] | str | None) -> dict[str, str]:
        """Each name asked for (default: the covered ones) and the covered name it resolves to."""
        names = self.names if names is None else [names] if isinstance(names, str) else list(names)
        unknown = [n for n in names if n not in self]
        if unknown:
            raise KeyError(f"not covered by this posterior: {unknown[:5]}")
        return {name: self._aliases.get(name, name) for name in names}

    @contextlib.contextmanager
    def sampled(self, model: nn.Module, seed: int | None = None) -> Iterator[nn.Module]:
        """Put one posterior sample into ``model`` for the enclosed code.

        The model is checked first (:meth:`check_model`). On exit, also on an exception,
        every covered weight gets its exact previous value back (bit for bit). Point
        estimates are untouched. ``(M + ΔW)`` is formed in float32 (float64 for float64 weights or
        factors), also inside ``torch.autocast``, and cast once to the parameter's dtype. A weight holds one
        sample at a time: a block over weights another open block holds (nested, or another thread's) is refused.
        """
        with holding_sample(model, self.names):  # the mean is back before another block may take the weights
            self.check_model(model)
            params = resident_parameters(model, self.names)
            seed = sample_seed(seed, (params[name] for name in self.names), model)
            pruned = pruned_ranks(model)  # AdaLoRA's pruned ranks are off, not uncertain: every sample keeps them 0
            saved: list[tuple[Tensor, Tensor]] = []
            try:
                with torch.no_grad(), writing_weights():  # forwards inside see the sample, not a cast from before
                    for dev, names in draw_batches(params, (group.names for group in self._groups)):
                        draws = self.draw(1, seed=seed, names=names, device=dev)
                        for name in names:
                            p = params[name]
                            mean = p.detach().clone()
                            saved.append((p, mean))
                            delta = draws.pop(name)[0]
                            p.copy_(add_perturbation(mean, delta.masked_fill(pruned[name], 0) if name in pruned else delta))
                yield model
            finally:
                with torch.no_grad(), writing_weights():
                    for p, mean in reversed(saved):
                        p.copy_(mean)

    # ------------------------------------------------------------------ checks
    def check_model(self, model: nn.Module) -> None:
        """Raise :class:`PosteriorMismatchError` naming each covered tensor the model lacks or mis-shapes;
        warn (``PosteriorMeanWarning``) where its weights are not the ones the posterior was taken at."""
        inner = unwrap_model(model)  # the names the posterior uses: no DDP / torch.compile prefix
        params = dict(inner.named_parameters(remove_duplicate=False))
        problems = model_problems({name: self[name].shape for name in self.names}, self._aliases, inner, params)
        problems += unused_adapter_parameters(inner, [n for n in self.names if n in params])
        if problems:
            more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
            raise PosteriorMismatchError(
                f"this EVON posterior does not fit the given {type(model).__name__}: "
                + "; ".join(problems[:5])
                + more
            )
        warn_if_other_mean(self.config.get("mean_fingerprint"), params, self.names)

    # ------------------------------------------------------------------ variants
    def lean(
        self,
        max_basis_ratio: float | None = DEFAULT_MAX_BASIS_RATIO,
        eigenbasis_dtype: torch.dtype | str | None = None,
    ) -> EVONPosterior:
        """A cheaper copy: wide bases dropped (marginal variances kept), bases optionally in half precision.

        A basis whose side is more than ``max_basis_ratio`` times the other side becomes the
        identity, with ``H`` re-expressed so that ``std()`` is unchanged (only correlations
        along that side are lost; ``hf_evon.posterior.gaussian.drop_wide_bases``). For an r×d
        LoRA matrix this removes the d×d basis, which is most of a full posterior's bytes.
        ``None`` keeps every basis. ``eigenbasis_dtype`` casts the kept bases (``H`` keeps
        its dtype). The ratio used is recorded as ``config["max_basis_ratio"]``.
        """
        groups = self._groups
        config = dict(self.config)
        if (max_basis_ratio := checked_basis_ratio(max_basis_ratio)) is not None:
            groups = [drop_wide_bases(g, max_basis_ratio) for g in groups]
            previous = config.get("max_basis_ratio")
            config["max_basis_ratio"] = float(
                max_basis_ratio if previous is None else min(previous, max_basis_ratio)
            )
        eig = as_dtype(eigenbasis_dtype, "eigenbasis_dtype")
        if eig is not None:
            groups = [g.with_basis_dtype(eig, declared_basis_dtype(config)) for g in groups]
            config["eigenbasis_dtype"] = dtype_name(eig)
        return EVONPosterior(groups, config, self.num_point_estimates, self.num_point_estimate_tensors)

    @property
    def is_point_mass(self) -> bool:
        """Whether every sample is the mean (ζ = inf everywhere: zero variance, e.g. after a
        calibration that kept the mean), so BMA over any number of samples predicts as the mean."""
        return all(math.isinf(g.ess) for g in self._groups)

    def with_ess(self, ess: float | Mapping[str, float]) -> EVONPosterior:
        """A copy with effective sample size ``ess`` everywhere, or ``{name: ess}`` for every covered
        name (``inf``: zero variance). Variances scale as ``1/ess``: a larger ζ narrows the posterior. The
        config keeps the trained ζ (``trained_ess``, recorded where absent) and drops a calibration's record."""
        if isinstance(ess, Mapping):
            missing, unknown = [n for n in self.names if n not in ess], [n for n in ess if n not in self._index]
            if missing or unknown:
                where = f"with_ess: a mapping needs exactly the covered names; missing {missing[:5]}"
                tied = [n for n in unknown if n in self._aliases]  # one tensor: keyed once, by its covered name
                hint = f" (tied names: key {tied[0]!r} as {self._aliases[tied[0]]!r})" if tied else ""
                raise KeyError(f"{where}, not covered {unknown[:5]}{hint}")
            named = self.factors.items()
            # each entry checked by its name: the group check after the regrouping could not say which
            factors = {n: replace(f, ess=ess_number(ess[n], f"with_ess: ess[{n!r}]", True)) for n, f in named}
            return self._with_groups(stack_factors(factors), factors[self.names[0]].ess, "with_ess")
        ess = ess_number(ess, "with_ess: ess")
        return self._with_groups([replace(g, ess=ess) for g in self._groups], ess, "with_ess")

    def scale_ess(self, factor: float) -> EVONPosterior:
        """A copy with every covered parameter's ζ times ``factor`` > 0 (``inf``: zero variance): the
        same shape of uncertainty, each variance ``1/factor`` as large; groups trained at different ζ
        keep their ratios (``with_ess`` sets one ζ everywhere). The config changes as ``with_ess``'s."""
        factor = ess_number(factor, "scale_ess: factor", positive=True)  # the products would name another ess
        groups = [replace(g, ess=g.ess * factor) for g in self._groups]
        return self._with_groups(groups, self.ess * factor, "scale_ess")

    def _with_groups(self, groups: list[FactorGroup], ess: float, where: str) -> EVONPosterior:
        """A copy with ``groups`` (new noise scales, each checked to give a finite, non-zero std)."""
        for g in groups:
            check_noise_scale(g.ess, g.weight_decay, where)
        check_finite_std(groups, where)
        config = hand_set_scale(self.config, ess, {n: g.ess for g in self._groups for n in g.names})
        return EVONPosterior(groups, config, self.num_point_estimates, self.num_point_estimate_tensors)

    @property
    def temperature(self) -> float:
        """T of the BMA predictive ``1/S Σ_s softmax(logits_s / T)`` (1 unless calibrated)."""
        return float(self.config.get("temperature", 1.0))

    def with_temperature(self, temperature: float) -> EVONPosterior:
        """A copy whose BMA predictions (evaluation, ``generate_bma``) use ``temperature`` (> 0)."""
        if not (is_real(temperature) and 0 < temperature < math.inf):  # NumPy numbers too, not a bool
            raise ValueError(f"with_temperature: temperature must be a finite number > 0; got {temperature!r}")
        # a calibration's record stays: the card tells this T from the one the calibration chose
        config = dict(self.config, temperature=float(temperature))
        return EVONPosterior(self._groups, config, self.num_point_estimates, self.num_point_estimate_tensors)

    def to(
        self, device: torch.device | str | torch.dtype | None = None, dtype: torch.dtype | None = None
    ) -> EVONPosterior:
        """A copy with factors on ``device`` and/or stored in ``dtype`` (the math runs in float32, in
        float64 for float64 factors: a float64 copy draws other noise than the float32 one). A half
        ``dtype`` casts the bases only: ``H`` stays float32, as the file format holds it. Bases of a coarser
        precision (read from half-precision files; float32 under float64) are re-orthonormalised where
        ``dtype``'s load check would refuse them. A dtype alone may come first, as in ``module.to(dtype)``."""
        if isinstance(device, torch.dtype):
            if dtype is not None:
                raise TypeError(f"to: dtype given twice ({device} and {dtype}); pass to(device, dtype)")
            device, dtype = None, device
        dtype = as_dtype(dtype, "to: dtype")
        if device is not None and torch.device(device).type == "meta":  # no values to sample or save
            raise ValueError("to: a posterior cannot move to the meta device, which holds no values")
        groups = [g.cast(device, dtype, declared_basis_dtype(self.config)) for g in self._groups]
        config = dict(self.config)
        if dtype is not None:
            config["eigenbasis_dtype"] = dtype_name(dtype)
        return EVONPosterior(groups, config, self.num_point_estimates, self.num_point_estimate_tensors)

    def __copy__(self) -> EVONPosterior:
        return EVONPosterior(
            list(self._groups), dict(self.config), self.num_point_estimates, self.num_point_estimate_tensors
        )

    def __deepcopy__(self, memo: dict) -> EVONPosterior:
        groups, config = [g.map_tensors(lambda t: t.clone()) for g in self._groups], copy.deepcopy(self.config, memo)
        return EVONPosterior(groups, config, self.num_point_estimates, self.num_point_estimate_tensors)
