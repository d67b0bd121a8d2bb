"""EVON's step with its per-bucket pure functions under ``torch.compile``, on the small MLP.

Issue 32's lever "one fused element-wise chain per bucket": on small_model_step.py's model (a
64-128-128-10 MLP, batch 32, ``build_optimizer(model)``: EVON for the three weight matrices,
AdamW for the biases; ``--model gpt2``: trainer_wall_time.py's tiny GPT-2, 16 blocks of 64
tokens; one thread) it times ``step()``

- ``eager``: as it is;
- ``whiten``: with ``linalg.newton_schulz`` (the default clip's whitening, ``whiten_rms``)
  compiled;
- ``chain``: with the steady step's functions ``update.py`` calls per bucket compiled
  (``fisher_update``, ``hessian_update``, ``price_estimate``, ``momentum_update``,
  ``snr_scale``, ``newton_step``, ``matrix_curvature``, ``clipped_update`` with the whitening it
  calls traced into its graph); any one of these names compiles that function alone;
- ``step``: the whole of ``EVON.step`` compiled (graph breaks at its host reads and all);
- ``eager-ulp``: eager with every initial weight one float32 spacing up: how far rounding alone
  moves the trajectory;
- ``adamw``: ``torch.optim.AdamW(foreach=True)``, the issue's baseline.

The compiled functions are patched into the modules that call them by name, in this process
only, and swapped in around each variant's step, so all variants run in one process, interleaved
step by step (a load change hits each alike). Each starts from the same seed and sees the same
batch. Two checks that the numbers stay: one step from two copies of the eager variant's model and
optimizer (the same noise and gradients), one with the variant's functions (``eager-ulp``: with
each momentum entry one float32 spacing up instead), the weights' max abs difference over the
step's largest change and H's over its largest entry; and the same differences after 100 steps
of each variant's own trajectory. The warm-up (the first ``WARMUP`` steps, where the compiles
happen) is timed apart, in wall seconds, into a new, empty inductor cache unless ``--cache-dir``
names one (a second run's compile time); variants sharing a function share its compiled code
(the first to run pays). Recompiles: each compiled function's dynamo cache entries (one per shape
and specialised value), after the warm-up and at the end; past ``--recompile-limit`` (dynamo's 8)
a function runs eager, or fails under ``--fullgraph``.

    python benchmarks/compiled_step.py
    python benchmarks/compiled_step.py --dynamic none --fullgraph --recompile-limit 64
    python benchmarks/compiled_step.py --variants eager step adamw
    python benchmarks/compiled_step.py --model gpt2 --steps 100 --dynamic none --recompile-limit 64
    python benchmarks/compiled_step.py --mode reduce-overhead  # CUDA graphs: skipped on a CPU

Figures (torch 2.13 CPU, one thread of a 2-core machine shared with other work; all in the
commit adding this script): on the MLP, eager 1.7-1.9 ms per step, 6.1-6.4x AdamW(foreach)'s
0.27-0.31 ms; every compiled variant is slower: ``whiten`` 1.84-2.12 ms, ``chain`` 2.32-2.58 ms,
``step`` 2.71 ms. A compiled call's own cost (guards and wrapper: 15 us against 5 us eager for an
in-place pair on 128x128) exceeds the few element-wise ops it fuses, and the whitening's 15
products stay library matmuls: 0.83 ms of the step at ~100 GFLOP/s, compute, not dispatch (on
the tiny GPT-2, eager 25.4 ms, ``whiten`` 26.3, ``chain`` 27.1). First-run compiles: ``whiten``
10-13 s, ``chain`` 19-25 s, ``step`` 49 s (72 graphs); 2.3-2.7 s from a warm cache. At
``--dynamic false`` the update count and the refit δ are specialised: ``chain``'s functions reach
the recompile limit within the warm-up and run eager; at ``--dynamic none`` ``clipped_update``
still recompiles at each δ refit (7 -> 19 entries in 300 steps). The numbers: one step differs
from eager's as a one-spacing change of the momentum does (9e-4 of the step, the whitening
amplifying rounding); 100 steps of a compiled trajectory differ by 6e-3, a one-spacing change of
the initial weights by 0.15.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
import torch._inductor.config
from payoff_tasks import tiny_gpt2_model
from small_model_step import small_mlp

import hf_evon.optim.linalg as linalg
import hf_evon.optim.update as update
from hf_evon import EVON, build_optimizer
from hf_evon.optim.buckets import WEIGHT_SPACE_MOMENTUM

WARMUP = 60  # past the initialising step and the first curvature fits (as small_model_step.py)
COMPARED_AT = 100  # the step after which the weights are compared first

# the steady step's per-bucket functions, by the module that calls them by name
CHAIN = (
    "fisher_update",
    "hessian_update",
    "price_estimate",
    "momentum_update",
    "snr_scale",
    "newton_step",
    "matrix_curvature",
    "clipped_update",
)

if missing := [name for name in CHAIN if not hasattr(update, name)]:  # renamed: fail at import
    raise ImportError(f"hf_evon.optim.update has no {', '.join(missing)}")


def hot_path(variant: str) -> list[tuple[ModuleType, str]]:
    """The (module, name) pairs a variant compiles."""
    if variant == "whiten":
        return [(linalg, "newton_schulz")]  # clip_update looks it up in linalg's namespace
    if variant == "chain":
        return [(update, name) for name in CHAIN]
    if variant in CHAIN:  # one of them alone
        return [(update, variant)]
    return []


def build(variant: str, model_name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer, from seed 0 (``eager-ulp``: each initial weight one float32
    spacing up, the reference for how far rounding alone moves the trajectory). ``mlp``:
    small_model_step.py's; ``gpt2``: trainer_wall_time.py's tiny GPT-2 (2 layers, width 128,
    context 64, 1024 tokens)."""
    torch.manual_seed(0)
    model = tiny_gpt2_model(1024, 64) if model_name == "gpt2" else small_mlp()
    if variant == "eager-ulp":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.nextafter(p, torch.tensor(math.inf)))
    if variant == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return model, build_optimizer(model, seed=0)


def batch(model_name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one batch every step sees: the MLP's 32 rows and labels, the LM's 16 blocks of 64 tokens
    (its labels: the blocks, shifted by the model)."""
    gen = torch.Generator().manual_seed(1)
    if model_name == "gpt2":
        return torch.randint(0, 1024, (16, 64), generator=gen), None
    return torch.randn(32, 64, generator=gen), torch.arange(32) % 10


def loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
    if y is None:
        return model(input_ids=x, labels=x).loss
    return torch.nn.functional.cross_entropy(model(x), y)


@contextlib.contextmanager
def patched(replacements: dict[tuple[ModuleType, str], Callable[..., Any]]) -> Iterator[None]:
    saved = {key: getattr(*key) for key in replacements}
    for (module, name), fn in replacements.items():
        setattr(module, name, fn)
    try:
        yield
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the weights, EVON's H per bucket)."""
    hess = [s["hess"].clone() for s in opt.state.values() if "hess" in s]
    return [p.detach().clone() for p in model.parameters()], hess


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def largest(tensors: list[torch.Tensor]) -> float:
    return max(float(x.abs().max()) for x in tensors)


class Variant:
    def __init__(self, name: str, compile_kwargs: dict[str, Any], model_name: str) -> None:
        self.name = name
        self.model, self.opt = build(name, model_name)
        self.originals = {key: getattr(*key) for key in hot_path(name)}
        self.compiled = {key: torch.compile(fn, **compile_kwargs) for key, fn in self.originals.items()}
        self.compile_kwargs = compile_kwargs
        if name == "step":  # the whole of EVON.step, graph breaks (its host reads) and all
            self.opt.step = torch.compile(self.opt.step, **compile_kwargs)
        self.x, self.y = batch(model_name)
        self.step_ms: list[float] = []
        self.steps = 0
        self.at_compared: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def train_step(self) -> float:
        """One step (sampled forward/backward, ``step()``, ``zero_grad``); the CPU ms of ``step()``."""
        step_ms = train_step(self.model, self.opt, self.x, self.y, self.compiled)
        self.steps += 1
        if self.steps == COMPARED_AT:
            self.at_compared = snapshot(self.model, self.opt)
        return step_ms

    def cache_entries(self) -> dict[str, int]:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return {name: len(_debug_get_cache_entry_list(fn)) for (_, name), fn in self.originals.items()}

    def one_step_difference(self, eager: Variant) -> str:
        """From two copies of ``eager``'s model and optimizer, one step each (the same noise and
        gradients), one with this variant's functions (``eager-ulp``: with each entry of the
        momentum, kept in the weights' space at the default ``step_curvature``, one float32
        spacing up): the weights' max abs difference over the step's largest change, and H's
        over its largest entry."""
        ours, theirs = copy.deepcopy((eager.model, eager.opt)), copy.deepcopy((eager.model, eager.opt))
        if self.name == "step":
            ours[1].step = torch.compile(ours[1].step, **self.compile_kwargs)
        if self.name == "eager-ulp":
            for state in ours[1].state.values():
                if (momentum := state.get(WEIGHT_SPACE_MOMENTUM)) is not None:
                    momentum.copy_(torch.nextafter(momentum, torch.tensor(math.inf)))
        before = [p.detach().clone() for p in eager.model.parameters()]
        train_step(*ours, eager.x, eager.y, self.compiled)
        train_step(*theirs, eager.x, eager.y, {})
        step = max(float((p.detach() - q).abs().max()) for p, q in zip(theirs[0].parameters(), before))
        (w1, h1), (w2, h2) = snapshot(*ours), snapshot(*theirs)
        return f"{max_difference(w1, w2) / step:.1e} / {max_difference(h1, h2) / largest(h2):.1e}"

    def trajectory_difference(self, eager: Variant) -> str:
        """After ``COMPARED_AT`` steps: the weights' max abs difference from ``eager``'s, and H's
        over its largest entry."""
        (w1, h1), (w2, h2) = self.at_compared, eager.at_compared
        return f"{max_difference(w1, w2):.1e} / {max_difference(h1, h2) / largest(h2):.1e}"


def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor | None,
    replacements: dict[tuple[ModuleType, str], Callable[..., Any]],
) -> float:
    """Sampled forward/backward, ``step()`` with ``replacements`` patched in, ``zero_grad``: the
    CPU ms of ``step()``."""
    if isinstance(opt, EVON):
        with opt.sampled_params(train=True):
            loss(model, x, y).backward()
    else:
        loss(model, x, y).backward()
    with patched(replacements):
        t0 = time.process_time()
        opt.step()
        step_ms = 1e3 * (time.process_time() - t0)
    opt.zero_grad()
    return step_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["mlp", "gpt2"], default="mlp")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per variant, interleaved")
    parser.add_argument("--variants", nargs="+", default=["eager", "eager-ulp", "whiten", "chain", "adamw"])
    parser.add_argument("--dynamic", choices=["false", "none", "true"], default="false")
    parser.add_argument("--fullgraph", action="store_true")
    parser.add_argument("--mode", default=None, help="torch.compile's mode (default: its default)")
    parser.add_argument("--recompile-limit", type=int, help="torch._dynamo.config.recompile_limit (default 8)")
    parser.add_argument("--cpp-wrapper", action="store_true", help="inductor's C++ wrapper (no Python per call)")
    parser.add_argument(
        "--cache-dir", help="inductor's cache (default: a new, empty one: compile times are a first run's)"
    )
    args = parser.parse_args()
    known = ("eager", "eager-ulp", "whiten", "chain", "step", "adamw", *CHAIN)
    if unknown := [name for name in args.variants if name not in known]:
        parser.error(f"unknown variants {unknown}; known: {', '.join(known)}")
    if WARMUP + args.steps < COMPARED_AT:
        parser.error(
            f"--steps must be at least {COMPARED_AT - WARMUP}: the {WARMUP} warm-up steps and the timed ones reach "
            f"step {COMPARED_AT}, where the compiled step is compared with eager's"
        )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="compiled_step_")
    torch._inductor.config.cpp_wrapper = args.cpp_wrapper
    if args.recompile_limit:
        torch._dynamo.config.recompile_limit = args.recompile_limit
    torch.set_num_threads(1)
    kwargs: dict[str, Any] = {
        "dynamic": {"false": False, "none": None, "true": True}[args.dynamic],
        "fullgraph": args.fullgraph,
    }
    if args.mode:
        kwargs["mode"] = args.mode
    print(
        f"{args.model}: torch {torch.__version__}, compile {kwargs}, cpp_wrapper {args.cpp_wrapper}, "
        f"cache {os.environ['TORCHINDUCTOR_CACHE_DIR']}, threads {torch.get_num_threads()}"
    )
    variants = [Variant(name, kwargs, args.model) for name in args.variants]
    warmup_s = {}
    for v in variants:  # one after another: each one's compiles timed alone
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        for _ in range(WARMUP):
            v.train_step()
        warmup_s[v.name] = (time.perf_counter() - t0, torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs)
    entries_warm = {v.name: v.cache_entries() for v in variants}
    for i in range(args.steps):  # interleaved, the order rotated
        for v in variants[i % len(variants) :] + variants[: i % len(variants)]:
            v.step_ms.append(v.train_step())
    eager = next((v for v in variants if v.name == "eager"), None)
    adamw_ms = next((statistics.median(v.step_ms) for v in variants if v.name == "adamw"), math.nan)
    print(
        "| variant | warm-up s | over eager's | graphs compiled | cache entries after warm-up -> end "
        "| step ms (median) | x AdamW (foreach) | one step: weights / H difference "
        f"| after {COMPARED_AT} steps: weights max abs / H difference |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for v in variants:
        ms = statistics.median(v.step_ms)
        seconds, graphs = warmup_s[v.name]
        over = seconds - warmup_s["eager"][0] if eager else math.nan
        entries = ", ".join(f"{name} {entries_warm[v.name][name]}->{n}" for name, n in v.cache_entries().items())
        compared = eager is not None and v is not eager and v.name != "adamw"
        one_step = v.one_step_difference(eager) if compared else "-"
        trajectory = v.trajectory_difference(eager) if compared else "-"
        print(
            f"| {v.name} | {seconds:.2f} | {over:.2f} | {graphs} | {entries or '-'} | {ms:.3f} "
            f"| {ms / adamw_ms:.1f} | {one_step} | {trajectory} |"
        )
    print(f"{WARMUP} warm-up + {args.steps} timed steps each, one thread")


if __name__ == "__main__":
    main()
