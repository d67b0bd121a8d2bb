"""Run S posterior samples of a model as one forward pass of batch ``S·B``.

Only the matrices the posterior covers get S versions. For the duration of a
``with BatchedSamples(...)`` block, the ``forward`` of every module that owns a covered
parameter is replaced (an instance attribute, removed again on exit; under an accelerate hook, the
forward the hook runs: :mod:`hf_evon.predictive.module_forward`) by one that views its
input as ``(S, B·…, in)`` — the batch is *sample-major*: rows ``s·B … s·B+B-1`` belong to
sample ``s`` — and multiplies it with the stacked per-sample weights ``(S, in, out)`` in one
batched matmul. Everything else (embeddings, norms, attention, the KV cache) is shared code
run on the larger batch. The model's parameters are never written (while the block is active
their modules hold guards in their place, below), so the mean is untouched bit-for-bit, also
when the block raises.

So each covered weight must be used only through its owner's forward: the samples live there.
For the block, the owners hold a guard in place of each covered parameter that answers its
metadata (dtype, device, shape) and raises ``NotImplementedError`` naming it on any computation
elsewhere: ``nn.MultiheadAttention`` reading ``out_proj.weight`` in its functional forward, a
decoder tied as ``F.linear(h, enc.weight.t())`` would otherwise run every sample at the mean.
Such a model is sampled one draw at a time (``with posterior.sampled(model, seed=...)``), the way
out every refusal of the batched path names (:func:`refusal`).
Likewise each covered module's input must lead with the S·B rows: ``check_sample_axis`` (which
``generate_bma`` and ``bma_log_likelihood`` run first) refuses a time-first layer (FSMT's, LED's
encoder self-attention) or an input that is no batch (T5's relative position buckets) among the
modules its one-token forward reaches. A covered module in a mixture of experts (fed the rows its
router selects) is refused on entry, an input no multiple of S·B rows mid-forward (:mod:`.batched_refusals`).

Two ways to apply sample ``s`` of a covered weight, chosen per matrix (``strategy``, a ``SampleStrategy``):

- ``"materialize"``: store ``W_s = M + Q_L E_s Q_Rᵀ`` and run one batched matmul ``x_s @ W_s``.
  Forming ``W_s`` costs ``m·n·(m+n)`` multiply-adds per sample (GPT-2 small, S = 8: 2.3
  TFLOP), once per call; each step then costs what S plain forwards cost.
- ``"factored"``: keep only ``E_s = z_s ⊙ √V`` (drawn without any matmul) and run
  ``x_s @ M + ((x_s @ Q_in) @ E_s) @ Q_outᵀ``: the bases multiply the activations, shared by all
  samples, so nothing is formed per weight; each input row costs ``m² + n² + m·n`` more.
- ``"auto"`` (default): on CPU, per matrix, whichever of the two costs fewer FLOPs for the
  number of rows the call will run (``rows``: batch × tokens per sample; short generations
  favour ``factored``); on accelerators ``materialize`` (one kernel per layer and step keeps
  decoding latency at that of the plain model; the one-off draw is fast there).

Both give the same samples (the same ``E_s``), to rounding in the parameter dtype: ``materialize`` rounds
each ``W_s`` as ``posterior.sampled`` writes it, ``factored`` its three products (log-probabilities ~1e-5
apart in float32, a few bfloat16 steps of the logits in bfloat16: a near-tie may pick another token).
Memory: S ``(m, n)`` tensors per covered matrix either way (``W_s`` or ``E_s``), in the
parameter dtype (GPT-2 small: 85M covered values, so S = 8 holds 0.68G values: 2.7 GB
float32, 1.4 GB bfloat16), plus transiently the posterior's float32 draw of one chunk of
names (``DRAW_CHUNK_ELEMENTS``). Embeddings, head, norms and biases stay single.

Supported owners of covered parameters: ``nn.Linear`` (including PEFT's LoRA ``lora_A`` /
``lora_B`` layers, which are plain ``nn.Linear``), transformers' ``Conv1D`` (GPT-2) and
``nn.Embedding``, covering their ``weight`` and ``bias``. A covered parameter owned by anything
else, by a DoRA adapter (which runs its layers on an identity matrix for the weight norm), or
that is another tensor of a supported module (``weight_norm``'s ``weight_g`` / ``weight_v``,
``spectral_norm``'s ``weight_orig``) raises ``NotImplementedError`` naming it, rather than
silently decoding at the mean or mixing the samples.

FSDP2 (``fully_shard``: DTensor parameters, each rank a share of the rows): a forward runs on the
whole weights FSDP2 gathers, so each rank keeps the whole draw (the same on every rank for a
given seed; ``seed=None``: each rank its own samples; no communication) and the first covered
forward adds it to the gathered mean, as ``posterior.sampled`` would have written it, keeping the
sums (in place of the draw) for every later forward: the unsharded model's samples, exactly, formed
once per block (S·m·n additions per materialized matrix), as the unsharded path forms them on entry.
So the block holds each whole covered matrix's S samples on every rank until it exits. FSDP2 puts the
gathered parameters on the modules for every forward, replacing what they hold, so a DTensor holds
no guard: a read of it outside its owner's forward is not refused there (it reads the mean).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hf_evon.modeling import unwrap_model
from hf_evon.optim.buckets import is_dtensor
from hf_evon.optim.checks import sample_count
from hf_evon.optim.held_samples import claim_sample
from hf_evon.optim.noise import resolve_seed
from hf_evon.posterior.gaussian import add_perturbation
from hf_evon.predictive.batched_refusals import (  # noqa: F401 - ONE_DRAW_AT_A_TIME: part of this module's API
    ONE_DRAW_AT_A_TIME,
    BatchedSamplesRefused,
    check_sequences,
    refusal,
    require_sample_major,
    routed_expert,
    sample_major,
)
from hf_evon.predictive.module_forward import own_forward, replace_forward, restore_forward
from hf_evon.predictive.sample_strategy import (  # noqa: F401 - STRATEGIES, expected_rows: part of this module's API
    MIN_FACTORED_ROWS,
    STRATEGIES,
    SampleStrategy,
    checked_strategy,
    expected_rows,
)

Tensor = torch.Tensor

DEFAULT_STRATEGY = "auto"  # a block's strategy where none is given (generate_bma's strategy=None)
DRAW_CHUNK_ELEMENTS = 2**27  # float32 values drawn at once (512 MiB)


def chunked_draws(
    posterior: Any, params: dict[str, Tensor], num_samples: int, seed: int | None, rotated: bool = False
) -> Iterator[tuple[str, Tensor]]:
    """Every given parameter's ``num_samples`` draws (``posterior.draw``), a chunk of names at a time.

    ``EVONPosterior.draw`` seeds each name on its own, so the values do not depend on how names are
    chunked; chunks of at most ``DRAW_CHUNK_ELEMENTS`` float32 values keep the float32 peak bounded
    while the matrices of one chunk are still drawn batched.
    """
    chunk: list[str] = []
    size = 0
    names = list(params)
    for i, name in enumerate(names):
        chunk.append(name)
        size += num_samples * params[name].numel()
        last = i == len(names) - 1
        if last or size + num_samples * params[names[i + 1]].numel() > DRAW_CHUNK_ELEMENTS:
            devices = {params[n].device for n in chunk}
            device = next(iter(devices)) if len(devices) == 1 else None
            kwargs = {"rotated": True} if rotated else {}
            draws = posterior.draw(num_samples, seed=seed, names=chunk, device=device, **kwargs)
            for n in chunk:
                yield n, draws.pop(n)
            chunk, size = [], 0


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return Conv1D


_BATCHED = "_evon_batched_samples"  # marks a forward a BatchedSamples block installed
# what a covered tensor answers while its owners hold a guard: metadata, never its values
_METADATA_PROPERTIES = frozenset(
    getattr(torch.Tensor, a)
    for a in (
        "dtype", "device", "shape", "ndim", "requires_grad", "is_cuda", "is_meta", "layout", "is_leaf",
        "is_sparse", "is_cpu", "is_mps", "is_xpu", "is_quantized", "itemsize", "nbytes", "grad",
    )
)  # fmt: skip
_METADATA_METHODS = frozenset(
    [
        *(getattr(torch.Tensor, a) for a in (
            "dim", "size", "numel", "nelement", "ndimension", "element_size", "is_floating_point", "is_complex",
            "stride", "is_contiguous", "get_device", "__hash__", "__repr__", "__len__", "data_ptr",
            "storage_offset", "is_pinned", "new_zeros", "new_ones", "new_empty", "new_full",
        )),
        # a new tensor of its dtype, device and shape: no value read
        torch.numel, torch.is_floating_point, torch.is_complex, torch.zeros_like, torch.ones_like,
        torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
    ]
)  # fmt: skip


class _CoveredOutsideItsForward(nn.Parameter):
    """What the owners of a covered parameter hold while a block is active (the mean's storage):
    its metadata (dtype, device, shape) as the parameter's, any computation refused. The samples
    live in the owners' patched forwards only, so a read elsewhere (``nn.MultiheadAttention``'s
    functional use of ``out_proj.weight``, a decoder tied as ``F.linear(h, enc.weight.t())``)
    would run every sample at the mean; it raises instead, naming the parameter."""

    evon_name: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _METADATA_METHODS or getattr(func, "__self__", None) in _METADATA_PROPERTIES:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        name, stack = "?", [*args, *(kwargs or {}).values()]
        while stack:  # the guard among the arguments, nested lists included
            x = stack.pop()
            if isinstance(x, _CoveredOutsideItsForward):
                name = x.evon_name
                break
            if isinstance(x, list | tuple):
                stack.extend(x)
        what = getattr(func, "__name__", str(func))
        if what == "__get__":  # a property: name it
            what = "." + getattr(func.__self__, "__name__", "?")
        raise refusal(
            f"posterior parameter {name!r} is read outside its module's forward "
            f"(by {what}): batched BMA applies a covered weight's samples "
            "in its owner's forward only, so this use would run every sample at the mean"
        )


def _guard(name: str, param: Tensor) -> Tensor:
    guard = torch.Tensor._make_subclass(_CoveredOutsideItsForward, param.detach(), param.requires_grad)
    guard.evon_name = name
    return guard


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` subclass whose own forward is ``x @ Wᵀ + b`` all the same (transformers'
    ``FalconLinear``, written as a matmul for speed), which the batched forward may replace."""
    return isinstance(module, nn.Linear) and type(module).__name__ == "FalconLinear" and (
        type(module).__module__.startswith("transformers.")
    )


def _dora_owners(model: nn.Module) -> set[nn.Module]:
    """The ``lora_A`` / ``lora_B`` modules of PEFT's DoRA adapters (``use_dora[adapter]``)."""
    owners = set()
    for module in model.modules():
        use_dora = getattr(module, "use_dora", None)
        if not isinstance(use_dora, dict):
            continue
        for adapter in (a for a, on in use_dora.items() if on):
            for attr in ("lora_A", "lora_B"):
                layers = getattr(module, attr, None)
                if isinstance(layers, nn.ModuleDict) and adapter in layers:
                    owners.add(layers[adapter])
    return owners


class BatchedSamples:
    """Context manager giving ``model`` S per-sample versions of the posterior's matrices.

    Args:
        model: the model whose ``named_parameters()`` names the posterior uses (behind DDP and
            ``torch.compile``, whose names carry a prefix: the module they wrap).
        posterior: an ``EVONPosterior`` (anything with ``names`` and ``draw``).
        num_samples: S.
        seed: seed of the weight draws (``posterior.draw(S, seed=seed, ...)``).
        strategy: a ``SampleStrategy`` or its string, ``"auto"``, ``"materialize"`` or ``"factored"``
            (see the module docstring); ``None``: ``DEFAULT_STRATEGY`` (``"auto"``).
        rows: how many input rows per sample the block will run (``expected_rows``), for
            ``"auto"``; ``None`` (unknown) materializes.
        batch_size: B, the rows per sample of one forward step (``"auto"`` materializes when
            S·B < ``MIN_FACTORED_ROWS``); ``None``: not limiting.
        sequences: the sequences per sample the call's input holds (its B before beams): a covered
            module's input whose leading size is no multiple of S·sequences is refused mid-forward
            (``None``: 1, S alone checked).
    """

    def __init__(
        self,
        model: nn.Module,
        posterior: Any,
        num_samples: int,
        seed: int | None = None,
        strategy: SampleStrategy | str | None = None,
        rows: int | None = None,
        batch_size: int | None = None,
        sequences: int | None = None,
    ) -> None:
        strategy = checked_strategy(DEFAULT_STRATEGY if strategy is None else strategy, "BatchedSamples")
        num_samples = sample_count(num_samples)
        self.model = unwrap_model(model)
        self.posterior = posterior
        self.num_samples = num_samples
        self.seed = seed
        self.strategy = strategy
        self.rows = rows
        self.batch_size = batch_size
        # B of the rows check (sample_major); check_sample_axis's probe sets its own while it runs
        self._sequences = [check_sequences(sequences)]
        self.factored: set[str] = set()  # names applied factored (set on entry)
        # (module, its forward before the block (replace_forward's), its covered parameters by attribute)
        self._patched: list[tuple[nn.Module, tuple[str, Any], dict[str, Tensor]]] = []
        self._labels: dict[nn.Module, str] = {}  # each patched module: a covered name it owns
        # each name's per-sample values; a DTensor's (S, …) ΔW_s until the first forward adds them to
        # the mean FSDP2 gathers, once for all forwards (``_sampler``): the names still in ``_pending``
        self._samples: dict[str, Tensor] = {}
        self._pending: set[str] = set()
        self.extra_bytes = 0  # memory held by the per-sample weights while active

    # ----------------------------------------------------------------- set-up
    def _owners(self, covered: dict[int, str]) -> dict[nn.Module, dict[str, str]]:
        """Every module that holds a covered parameter directly (tied weights: all of them)."""
        owners: dict[nn.Module, dict[str, str]] = {}
        seen: set[int] = set()
        for module in self.model.modules():
            for attr, p in module._parameters.items():
                if p is not None and id(p) in covered:
                    owners.setdefault(module, {})[attr] = covered[id(p)]
                    seen.add(id(p))
        missing = [name for pid, name in covered.items() if pid not in seen]
        if missing:
            raise RuntimeError(f"covered parameters not found in any module: {missing}")
        return owners

    def _factored(self, params: dict[str, Tensor], owners: dict[nn.Module, dict[str, str]]) -> dict[str, Any]:
        """The covered weights applied as ``x @ M + ((x @ Q_in) @ E_s) @ Q_outᵀ``, with their factors."""
        if self.strategy == "materialize" or not hasattr(self.posterior, "__getitem__"):
            return {}
        linear_types = tuple(t for t in (nn.Linear, _conv1d_type()) if t is not None)
        # a weight tied into an embedding, or whose module also has a covered bias, is materialized
        # for every owner: all owners of a name must share one representation of its samples
        excluded = {
            name
            for module, attrs in owners.items()
            if not isinstance(module, linear_types) or set(attrs) != {"weight"}
            for name in attrs.values()
        }
        chosen = {}
        for attrs in owners.values():
            name = attrs.get("weight")
            if name is None or name in excluded:
                continue
            f = self.posterior[name]
            if params[name].dim() != 2 or (f.Q_L is None and f.Q_R is None):
                continue  # no basis: the draw needs no matmul, materializing is cheaper
            if self.strategy == "factored":
                chosen[name] = f
                continue
            if params[name].device.type != "cpu" or self.rows is None:
                continue
            if self.batch_size is not None and self.num_samples * self.batch_size < MIN_FACTORED_ROWS:
                continue
            m, n = f.matrix_shape
            draw_cost = (m * m * n if f.Q_L is not None else 0) + (m * n * n if f.Q_R is not None else 0)
            per_row = m * n + (m * m if f.Q_L is not None else 0) + (n * n if f.Q_R is not None else 0)
            if self.rows * per_row < draw_cost:
                chosen[name] = f
        return chosen

    def __enter__(self) -> BatchedSamples:
        # a second block would batch on top of the first's forwards, and the first's exit (in any
        # order) would leave the other's in place or take them away from under it
        if self._patched or any(getattr(own_forward(m), _BATCHED, False) for m in self.model.modules()):
            raise RuntimeError(
                "a BatchedSamples block is already active on this model (nested, or another thread's)"
            )
        self.extra_bytes = 0
        named = dict(self.model.named_parameters())
        names = list(self.posterior.names)
        unknown = [n for n in names if n not in named]
        if unknown:
            raise KeyError(f"posterior covers parameters the model does not have: {unknown[:5]}")
        params = {n: named[n] for n in names}
        claim_sample(params, hold=False)  # the weights are the mean its samples are drawn around
        owners = self._owners({id(p): n for n, p in params.items()})
        conv1d = _conv1d_type()
        dora = _dora_owners(self.model)
        for module, attrs in owners.items():
            if module in dora:
                raise refusal(
                    f"posterior parameter {next(iter(attrs.values()))!r} belongs to a DoRA adapter "
                    "(use_dora=True), whose weight norm runs the adapter on an identity matrix that "
                    "batched BMA cannot tell from batch rows"
                )
            # the supported kinds' own forward: a subclass's (a scaled word embedding, a learned
            # position embedding taking position_ids) would be replaced by the plain product, silently
            base = next((k for k in (nn.Linear, nn.Embedding, conv1d) if k and isinstance(module, k)), None)
            if base is None or (type(module).forward is not base.forward and not _plain_linear(module)):
                raise refusal(
                    f"posterior parameter {next(iter(attrs.values()))!r} belongs to a "
                    f"{type(module).__name__}; batched BMA supports nn.Linear, Conv1D and nn.Embedding "
                    "(and subclasses that keep their forward)"
                )
            # the batched forwards apply samples of the weight and bias; any other covered tensor
            # (weight_norm's weight_g / weight_v, spectral_norm's weight_orig, from which a hook
            # makes the weight) would stay at the mean in every sample
            others = sorted(set(attrs) - {"weight", "bias"})
            if others:
                raise refusal(
                    f"posterior parameter {attrs[others[0]]!r} is the {others[0]!r} of a "
                    f"{type(module).__name__}; "
                    "batched BMA applies samples of a module's weight and bias only (a weight_norm or "
                    "spectral_norm hook makes the weight from other tensors)"
                )
            if isinstance(module, nn.Embedding) and module.max_norm is not None:
                raise refusal(f"{attrs['weight']!r}: nn.Embedding with max_norm is not supported")
        routed_expert(self.model, owners)
        # one seed for all names, as a single draw(seed=None) would do
        self.seed = resolve_seed(self.seed)
        factored = self._factored(params, owners)
        per_sample, self._pending = self._samples, set()
        with torch.no_grad():
            for rotated, group in (
                (False, [n for n in params if n not in factored]),
                (True, sorted(factored)),
            ):
                for name, draw in chunked_draws(self.posterior, {n: params[n] for n in group}, self.num_samples, self.seed, rotated):
                    mean = params[name].detach()
                    draw = draw.to(mean.device)
                    expected = (self.num_samples, *(factored[name].matrix_shape if rotated else mean.shape))
                    if tuple(draw.shape) != expected:
                        raise ValueError(
                            f"posterior draw for {name!r} has shape {tuple(draw.shape)}, expected {expected}"
                        )
                    if is_dtensor(mean):  # E_s or ΔW_s whole, for the mean FSDP2 gathers (its dtype)
                        value = draw
                        self._pending.add(name)
                    elif rotated:
                        value = draw.to(mean.dtype)  # E_s, applied between the bases
                    else:  # the rounding of writing a sample into the weights (posterior.sampled)
                        value = add_perturbation(mean, draw)
                    per_sample[name] = value.contiguous()
                    # a DTensor's ΔW_s gives way to M + ΔW_s in the parameter's dtype
                    self.extra_bytes += value.numel() * max(value.element_size(), mean.element_size())
        self.factored = set(factored)
        # one per tensor: ties stay ties; FSDP2 would replace a DTensor's guard by the gathered weight
        guards = {name: _guard(name, p) for name, p in params.items() if not is_dtensor(p)}
        try:
            for module, attrs in owners.items():
                label = next(iter(attrs.values()))
                if label in factored:
                    forward = self._factored_forward(module, params[label], factored[label], label)
                else:
                    forward = self._make_forward(module, attrs, label)
                self._patch(module, forward, {attr: guards[name] for attr, name in attrs.items() if name in guards})
                self._labels[module] = label
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def check_sample_axis(self, run: Callable[[], Any], rows: int = 1) -> None:
        """Run ``run``, a forward of the model on one token of ``rows`` sequences per sample (S·rows
        rows), and raise ``NotImplementedError`` naming the first covered module whose input does
        not lead with those S·rows rows.

        The batched forwards take the first axis of every covered module's input as the S·B rows,
        sample-major. A time-first layer (FSMT's, LED's encoder self-attention: ``(T, S·B, d)``) or
        an input that is no batch (T5's relative position buckets, ``(q_len, k_len)``) would have
        its rows split among the samples, silently wherever S divides that axis. One token per
        sequence tells them apart: such an axis does not grow with the sequences, the samples' does;
        run it for two values of ``rows`` (an axis a model pads, as LED pads its encoder's input to
        its attention window, may equal S·rows for one of them).
        """
        if not self._patched:
            raise RuntimeError("check_sample_axis runs inside an active BatchedSamples block")
        if self.num_samples == 1:  # one sample: nothing to mix
            return
        s_count = self.num_samples * rows
        sequences = self._sequences[0]

        def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = args[0] if args else next(iter(kwargs.values()), None)
            if isinstance(x, Tensor) and (x.dim() == 0 or x.shape[0] != s_count):
                raise refusal(
                    f"posterior parameter {self._labels[module]!r} ({type(module).__name__}) gets an "
                    f"input that does not lead with the samples' rows: one token of {rows} sequence(s) per "
                    f"sample ({s_count} rows) reaches it as shape {tuple(x.shape)} (a time-first layer, "
                    "or an input that is no batch, like relative position buckets), so batched BMA would "
                    "mix the samples"
                )

        handles = [m.register_forward_pre_hook(check, with_kwargs=True) for m in self._labels]
        self._sequences[0] = rows
        try:
            run()
        finally:
            self._sequences[0] = sequences
            for handle in handles:
                handle.remove()

    def _patch(self, module: nn.Module, forward: Callable[..., Tensor], guards: dict[str, Tensor]) -> None:
        """``module`` runs ``forward`` and holds ``guards`` in place of its covered parameters, which
        ``forward`` reads from its closure only."""
        setattr(forward, _BATCHED, True)
        params = {attr: module._parameters[attr] for attr in guards}
        # under an accelerate hook, the forward the hook runs: it still moves the input to the device
        self._patched.append((module, replace_forward(module, forward), params))
        module._parameters.update(guards)

    def _restore(self) -> None:
        self._labels = {}
        self._samples.clear()  # the forwards' closures hold this dict: release the samples now
        self._pending.clear()
        while self._patched:
            module, previous, params = self._patched.pop()
            module._parameters.update(params)
            restore_forward(module, *previous)

    # ------------------------------------------------------------- forwards
    def _make_forward(self, module: nn.Module, attrs: dict[str, str], label: str) -> Callable[..., Tensor]:
        """``x_s @ W_s (+ b_s)``: per-sample materialized weights (and biases), one batched matmul
        (``attrs``: the module's covered attributes and their names)."""
        if isinstance(module, nn.Embedding):
            return self._embedding_forward(module, attrs, label)
        conv1d = _conv1d_type()
        # batched weights laid out (S, in, out) for bmm: Linear stores (out, in), Conv1D (in, out)
        transpose = not (conv1d is not None and isinstance(module, conv1d))
        s_count, sequences = self.num_samples, self._sequences
        sample = _sampler(module, attrs, self._samples, self._pending, label)

        def forward(self_: nn.Module, x: Tensor) -> Tensor:
            xs = sample_major(x, s_count, sequences[0], label)
            w_s, b_s = sample(self_, "weight"), sample(self_, "bias")
            if w_s is not None:
                w = w_s.mT if transpose else w_s
            else:  # the weight is not covered: the module's own
                weight = self_.weight.mT if transpose else self_.weight
                w = weight.expand(s_count, *weight.shape)
            b = b_s.unsqueeze(1) if b_s is not None else self_.bias  # (S, 1, out)
            y = torch.bmm(xs, w) if b is None else torch.baddbmm(b.expand(s_count, 1, -1), xs, w)
            return y.reshape(*x.shape[:-1], y.shape[-1])

        return forward

    def _factored_forward(self, module: nn.Module, mean: Tensor, factors: Any, label: str) -> Callable[..., Tensor]:
        """``x_s @ M + ((x_s @ Q_in) @ E_s) @ Q_outᵀ``: the mean ``M`` (the parameter, as the module
        holds a guard in its place) applied as the module does, plus the sample's deviation applied
        through the bases (shared by all samples) and ``E_s`` (S, m, n), ``self._samples[label]``."""
        is_conv1d = isinstance(module, _conv1d_type() or ())
        samples, pending = self._samples, self._pending

        def operands(dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None, Tensor]:  # Q_in, Q_out, E_s
            e_s = samples[label]
            q_l, q_r = (None if q is None else q.to(device=e_s.device, dtype=dtype) for q in (factors.Q_L, factors.Q_R))
            if is_conv1d:  # weight (in, out) = (m, n)
                return q_l, q_r, e_s
            return q_r, q_l, e_s.mT  # nn.Linear: weight (out, in) = (m, n), x @ ΔWᵀ = x Q_R E_sᵀ Q_Lᵀ

        s_count, sequences = self.num_samples, self._sequences
        sharded = is_dtensor(mean)
        held = [] if sharded else [operands(mean.dtype)]

        def forward(self_: nn.Module, x: Tensor) -> Tensor:
            m = _gathered(self_, "weight", label) if sharded else mean
            if label in pending:  # E_s in the dtype FSDP2 gathers the mean in (its mixed precision's), once
                samples[label] = samples[label].to(m.dtype)
                pending.discard(label)
                held.append(operands(m.dtype))
            q_in, q_out, e_io = held[0]
            y = F.linear(x, m.mT if is_conv1d else m, self_.bias)  # Conv1D: F.linear's (out, in) view
            xs = sample_major(x, s_count, sequences[0], label)
            t = xs if q_in is None else xs @ q_in
            t = torch.bmm(t, e_io)
            if q_out is not None:
                t = t @ q_out.mT
            return y + t.reshape(y.shape)

        return forward

    def _embedding_forward(self, module: nn.Module, attrs: dict[str, str], label: str) -> Callable[..., Tensor]:
        s_count, sequences = self.num_samples, self._sequences
        sample = _sampler(module, attrs, self._samples, self._pending, label)
        vocab = self._samples[attrs["weight"]].shape[1]  # (S, V, d), materialized

        def forward(self_: nn.Module, ids: Tensor) -> Tensor:
            require_sample_major(ids, s_count, sequences[0], label)
            flat = sample(self_, "weight").reshape(s_count * vocab, -1)
            offsets = torch.arange(s_count, device=ids.device).mul_(vocab).view(s_count, *[1] * ids.ndim)
            shifted = (ids.reshape(s_count, -1, *ids.shape[1:]) + offsets).reshape(ids.shape)
            return F.embedding(shifted, flat)

        return forward


def _gathered(module: nn.Module, attr: str, label: str) -> Tensor:
    """The whole mean of the DTensor parameter ``module.<attr>``, which FSDP2 puts on the module
    for its forward (``label``: a covered name the module owns)."""
    mean = module._parameters[attr]
    if mean is None or is_dtensor(mean):
        raise refusal(
            f"posterior parameter {attr!r} of the module owning {label!r} is a DTensor whose module runs "
            "without FSDP2 gathering it "
            "(tensor parallelism, or a module outside fully_shard): batched BMA needs the whole weight"
        )
    return mean.detach()


def _sampler(
    module: nn.Module, attrs: dict[str, str], samples: dict[str, Tensor], pending: set[str], label: str
) -> Callable[[nn.Module, str], Tensor | None]:
    """``sample(module, attr)``: the (S, …) per-sample values ``samples[name]`` of the covered ``attr``
    (``attrs``: attribute to name; ``None`` where it is not covered). A DTensor's, held as ``ΔW_s``
    while its name is ``pending``, the first forward adds to the mean FSDP2 gathered for it, with the
    rounding of ``posterior.sampled``, and keeps in its place (one entry for all owners of a tied
    weight): every later forward (a decoding step) reuses it, as the unsharded path reuses what it
    formed at entry, and checks only that FSDP2 gathered the parameter."""
    sharded = {attr for attr in attrs if is_dtensor(module._parameters[attr])}

    def sample(module_: nn.Module, attr: str) -> Tensor | None:
        name = attrs.get(attr)
        if name is None:
            return None
        if attr in sharded:
            mean = _gathered(module_, attr, label)
            if name in pending:
                samples[name] = add_perturbation(mean, samples[name]).contiguous()
                pending.discard(name)
        return samples[name]

    return sample
