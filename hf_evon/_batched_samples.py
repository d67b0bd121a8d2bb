"""Run S posterior samples of a model as one forward pass of batch ``S·B``.

Only the matrices the posterior covers get S versions. For the duration of a
``with BatchedSamples(...)`` block, the ``forward`` of every module that owns a covered
parameter is replaced (an instance attribute, removed again on exit) by one that views its
input as ``(S, B·…, in)`` — the batch is *sample-major*: rows ``s·B … s·B+B-1`` belong to
sample ``s`` — and multiplies it with the stacked per-sample weights ``(S, in, out)`` in one
batched matmul. Everything else (embeddings, norms, attention, the KV cache) is shared code
run on the larger batch. The model's parameters are never written, so the mean is untouched
bit-for-bit, also when the block raises.

Memory: while active, S copies of the *covered* matrices only, in the parameter dtype
(GPT-2 small: 85M covered values, so S = 8 holds 0.68G values: 2.7 GB float32, 1.4 GB
bfloat16), plus transiently the posterior's float32 draw of one chunk of names
(``DRAW_CHUNK_ELEMENTS``). Embeddings, head, norms and biases stay single.
Why materialise ``M + ΔW_s`` rather than ``x @ M + x @ ΔW_s``: one batched matmul instead of
two, and per decoding step S weight reads instead of S + 1 (measured on CPU, GPT-2 4×256,
S = 8: 12.0 vs 15.9 ms/token at batch 1). Both are available (``strategy``).

Supported owners of covered parameters: ``nn.Linear`` (including PEFT's LoRA ``lora_A`` /
``lora_B`` layers, which are plain ``nn.Linear``), transformers' ``Conv1D`` (GPT-2) and
``nn.Embedding``. A covered parameter owned by anything else raises ``NotImplementedError``
naming it, rather than silently decoding at the mean.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor

STRATEGIES = ("materialize", "delta")
DEFAULT_STRATEGY = "materialize"  # benchmarks/generate_bma.py --strategy switches it
DRAW_CHUNK_ELEMENTS = 2**27  # float32 values drawn at once (512 MiB)


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return Conv1D


def _sample_major(x: Tensor, num_samples: int, name: str) -> Tensor:
    if x.shape[0] % num_samples:
        raise RuntimeError(
            f"{name}: the batched-sample forward expects a leading batch of S·B rows (S={num_samples}), "
            f"got input of shape {tuple(x.shape)}"
        )
    return x.reshape(num_samples, -1, x.shape[-1])


class BatchedSamples:
    """Context manager giving ``model`` S per-sample versions of the posterior's matrices.

    Args:
        model: the model whose ``named_parameters()`` names the posterior uses.
        posterior: an ``EVONPosterior`` (anything with ``names`` and ``draw``).
        num_samples: S.
        seed: seed of the weight draws (``posterior.draw(S, seed=seed, ...)``).
        strategy: ``"materialize"`` stores ``W_s = M + ΔW_s`` and runs ``x @ W_s`` (one
            batched matmul, the default: fewer FLOPs and fewer bytes per step);
            ``"delta"`` runs ``x @ M`` once plus ``x @ ΔW_s`` batched (kept for comparison).
    """

    def __init__(
        self,
        model: nn.Module,
        posterior: Any,
        num_samples: int,
        seed: int | None = None,
        strategy: str | None = None,
    ) -> None:
        strategy = DEFAULT_STRATEGY if strategy is None else strategy
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an integer >= 1; got {num_samples!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}; got {strategy!r}")
        self.model = model
        self.posterior = posterior
        self.num_samples = num_samples
        self.seed = seed
        self.strategy = strategy
        self._patched: list[tuple[nn.Module, Any]] = []
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

    def _draws(self, params: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
        """Every covered parameter's S perturbations, drawn a chunk of names at a time.

        ``EVONPosterior.draw`` seeds each name on its own, so the values do not depend on how
        names are chunked; chunks of at most ``DRAW_CHUNK_ELEMENTS`` float32 values keep the
        float32 peak bounded while the matrices of one chunk are still drawn batched.
        """
        chunk: list[str] = []
        size = 0
        names = list(params)
        for i, name in enumerate(names):
            chunk.append(name)
            size += self.num_samples * params[name].numel()
            last = i == len(names) - 1
            if last or size + self.num_samples * params[names[i + 1]].numel() > DRAW_CHUNK_ELEMENTS:
                devices = {params[n].device for n in chunk}
                device = next(iter(devices)) if len(devices) == 1 else None
                draws = self.posterior.draw(self.num_samples, seed=self.seed, names=chunk, device=device)
                for n in chunk:
                    yield n, draws.pop(n)
                chunk, size = [], 0

    def __enter__(self) -> BatchedSamples:
        named = dict(self.model.named_parameters())
        names = list(self.posterior.names)
        unknown = [n for n in names if n not in named]
        if unknown:
            raise KeyError(f"posterior covers parameters the model does not have: {unknown[:5]}")
        params = {n: named[n] for n in names}
        owners = self._owners({id(p): n for n, p in params.items()})
        conv1d = _conv1d_type()
        for module, attrs in owners.items():
            if not (
                isinstance(module, nn.Linear | nn.Embedding)
                or (conv1d is not None and isinstance(module, conv1d))
            ):
                raise NotImplementedError(
                    f"posterior parameter {next(iter(attrs.values()))!r} belongs to a "
                    f"{type(module).__name__}; batched BMA supports nn.Linear, Conv1D and nn.Embedding"
                )
            if isinstance(module, nn.Embedding) and module.max_norm is not None:
                raise NotImplementedError(f"{attrs['weight']!r}: nn.Embedding with max_norm is not supported")
        if self.seed is None:  # one seed for all names, as a single draw(seed=None) would do
            self.seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
        per_sample: dict[str, Tensor] = {}
        with torch.no_grad():
            for name, delta in self._draws(params):
                mean = params[name].detach()
                delta = delta.to(mean.device)
                if delta.shape != (self.num_samples, *mean.shape):
                    raise ValueError(
                        f"posterior draw for {name!r} has shape {tuple(delta.shape)}, expected "
                        f"{(self.num_samples, *mean.shape)}"
                    )
                if self.strategy == "materialize":
                    # same rounding as writing a sample into the weights: (M + ΔW) in float, then cast
                    value = (mean.to(delta.dtype) + delta).to(mean.dtype)
                else:
                    value = delta.to(mean.dtype)
                per_sample[name] = value.contiguous()
                self.extra_bytes += value.numel() * value.element_size()
        try:
            for module, attrs in owners.items():
                weights = {attr: per_sample[name] for attr, name in attrs.items()}
                label = next(iter(attrs.values()))
                self._patch(module, self._make_forward(module, weights, label))
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def _patch(self, module: nn.Module, forward: Callable[..., Tensor]) -> None:
        previous = module.__dict__.get("forward")  # e.g. an accelerate hook's forward
        self._patched.append((module, previous))
        module.forward = types.MethodType(forward, module)

    def _restore(self) -> None:
        while self._patched:
            module, previous = self._patched.pop()
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous

    # ------------------------------------------------------------- forwards
    def _make_forward(
        self, module: nn.Module, weights: dict[str, Tensor], label: str
    ) -> Callable[..., Tensor]:
        if isinstance(module, nn.Embedding):
            return self._embedding_forward(module, weights, label)
        conv1d = _conv1d_type()
        # batched weights laid out (S, in, out) for bmm: Linear stores (out, in), Conv1D (in, out)
        transpose = not (conv1d is not None and isinstance(module, conv1d))
        s_count = self.num_samples
        delta_mode = self.strategy == "delta"
        w_s = weights.get("weight")
        b_s = weights.get("bias")
        w_bmm = None if w_s is None else (w_s.mT if transpose else w_s)
        bias_s = None if b_s is None else b_s.unsqueeze(1)  # (S, 1, out)

        def forward(self_: nn.Module, x: Tensor) -> Tensor:
            xs = _sample_major(x, s_count, label)
            weight = self_.weight.mT if transpose else self_.weight
            bias = self_.bias
            if delta_mode:
                shared = xs @ weight  # one matmul with the mean, as plain forward
                if bias is not None:
                    shared = shared + bias
                y = shared if w_bmm is None else torch.baddbmm(shared, xs, w_bmm)
                if bias_s is not None:
                    y = y + bias_s
            else:
                w = w_bmm if w_bmm is not None else weight.expand(s_count, *weight.shape)
                b = bias_s if bias_s is not None else bias
                y = torch.bmm(xs, w) if b is None else torch.baddbmm(b.expand(s_count, 1, -1), xs, w)
            return y.reshape(*x.shape[:-1], y.shape[-1])

        return forward

    def _embedding_forward(
        self, module: nn.Module, weights: dict[str, Tensor], label: str
    ) -> Callable[..., Tensor]:
        s_count = self.num_samples
        w_s = weights["weight"]  # (S, V, d) — materialized or delta
        vocab = w_s.shape[1]
        flat = w_s.reshape(s_count * vocab, -1)
        delta_mode = self.strategy == "delta"

        def forward(self_: nn.Module, ids: Tensor) -> Tensor:
            if ids.shape[0] % s_count:
                raise RuntimeError(f"{label}: expected a leading batch of S·B rows, got {tuple(ids.shape)}")
            offsets = torch.arange(s_count, device=ids.device).mul_(vocab).view(s_count, *[1] * ids.ndim)
            shifted = (ids.reshape(s_count, -1, *ids.shape[1:]) + offsets).reshape(ids.shape)
            out = F.embedding(shifted, flat)
            if delta_mode:
                out = out + F.embedding(ids, self_.weight)
            return out

        return forward


def log_mean_prob(log_probs: Tensor, dim: int = 0) -> Tensor:
    """``log (1/S Σ_s p_s)`` from per-sample log-probabilities: the BMA average, stably."""
    return torch.logsumexp(log_probs, dim=dim) - math.log(log_probs.shape[dim])
