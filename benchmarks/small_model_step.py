"""EVON's per-step overhead on a small model: dispatched aten ops, scalar reads and time vs AdamW.

The model users start with: a 64-128-128-10 MLP, batch 32 (scikit-learn digits' shape), built
as ``build_optimizer(model)`` builds it (EVON for the three weight matrices, AdamW for the
biases). Per step of the loop users run::

    with opt.sampled_params(train=True):
        loss_fn(model(x), y).backward()
    opt.step()
    opt.zero_grad()

it counts, over whole refresh cycles, the aten ops dispatched by ``step()`` and by the sampled
block (a ``TorchDispatchMode``: every call, views included), the scalar reads back to the host
(``aten._local_scalar_dense``: one per ``.item()``; ``AdamW(foreach=True)`` makes two per
parameter, EVON's AdamW groups none: they run torch's fused kernel; EVON's matrices alone are
counted too), and the CPU time of the step
and of the sampled forward/backward; ``torch.optim.AdamW(foreach=True)`` on every parameter is
the issue's baseline, ``fused=True`` (transformers' default, what EVON's own AdamW groups run,
about half its step time here) the second. One thread; ``--base DIR`` also measures another checkout (e.g. a ``git worktree``
of an older commit), each variant in its own subprocess, alternating, ``--repeats`` times.

    python benchmarks/small_model_step.py --repeats 3
    python benchmarks/small_model_step.py --hidden-layers 64 --steps 100   # per-parameter costs
    git worktree add /tmp/base COMMIT && python benchmarks/small_model_step.py --base /tmp/base

Figures: ``docs/results.md#speed``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter

WARMUP = 60  # past the initialising step and the first curvature fits
COUNTED = 50  # five refresh cycles of 10 updates (the default precondition_frequency)


def small_mlp(hidden_layers: int = 2):  # noqa: ANN201 - torch is imported here: main runs other checkouts' measure in subprocesses
    """The 64-128-128-10 MLP (ReLU) this benchmark and ``compiled_step.py`` time, from the current seed;
    ``hidden_layers`` 128-wide layers (64-128-…-128-10; 2 is the issue's model)."""
    import torch

    layers = [torch.nn.Linear(64, 128), torch.nn.ReLU()]
    for _ in range(hidden_layers - 1):
        layers += [torch.nn.Linear(128, 128), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(128, 10))


def measure(kind: str, timed_steps: int, hidden_layers: int = 2) -> dict:
    """One variant's figures, in this process (called in a subprocess by ``main``)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.set_num_threads(1)
    torch.manual_seed(0)
    from hf_evon import EVON, build_optimizer

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    model = small_mlp(hidden_layers)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss_fn = torch.nn.CrossEntropyLoss()
    if kind == "adamw":  # the baseline
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    elif kind == "adamw-fused":  # transformers' default (adamw_torch_fused), and EVON's AdamW groups'
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    elif kind == "evon-matrices":  # EVON alone: the weight matrices, no AdamW group
        opt = EVON([m.weight for m in model if isinstance(m, torch.nn.Linear)], seed=0)
    else:
        opt = build_optimizer(model, seed=0)
    sampled = isinstance(opt, EVON)

    def forward_backward() -> None:
        if sampled:
            with opt.sampled_params(train=True):
                loss_fn(model(x), y).backward()
        else:
            loss_fn(model(x), y).backward()

    for _ in range(WARMUP):
        forward_backward()
        opt.step()
        opt.zero_grad()
    step_ops, block_ops = Counter(), Counter()
    for _ in range(COUNTED):
        with Count() as c:
            forward_backward()
        block_ops.update(c.ops)
        with Count() as c:
            opt.step()
        step_ops.update(c.ops)
        opt.zero_grad()
    step_ms, block_ms = [], []
    for _ in range(timed_steps):
        t0 = time.process_time()
        forward_backward()
        t1 = time.process_time()
        opt.step()
        t2 = time.process_time()
        opt.zero_grad()
        block_ms.append(1e3 * (t1 - t0))
        step_ms.append(1e3 * (t2 - t1))
    scalar = "aten._local_scalar_dense"
    return {
        "step_ops": sum(step_ops.values()) / COUNTED,
        "step_scalar_reads": step_ops[scalar] / COUNTED,
        "block_ops": sum(block_ops.values()) / COUNTED,
        "step_ms": statistics.median(step_ms),
        "forward_backward_ms": statistics.median(block_ms),
    }


def run(kind: str, source: str | None, timed_steps: int, hidden_layers: int = 2) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code = (
        "import json, sys\n"
        + (
            # the checkout at `source` instead of the installed (editable) hf_evon
            f"sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
            f"sys.path.insert(0, {source!r})\n"
            if source
            else ""
        )
        + f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        + "import small_model_step as s\n"
        + f"print(json.dumps(s.measure({kind!r}, {timed_steps}, {hidden_layers})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per run")
    parser.add_argument("--base", help="another checkout's root, measured beside this one")
    parser.add_argument(
        "--hidden-layers", type=int, default=2, help="128-wide hidden layers (more: one bucket of many matrices)"
    )
    args = parser.parse_args()
    variants = [("adamw", None), ("adamw-fused", None), ("evon", None), ("evon-matrices", None)]
    if args.base:
        variants += [("evon", args.base), ("evon-matrices", args.base)]
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):  # interleaved: a load change hits every variant alike
        for kind, source in variants:
            label = kind + (" (base)" if source else "")
            runs.setdefault(label, []).append(run(kind, source, args.steps, args.hidden_layers))
    adamw_ms = statistics.median(r["step_ms"] for r in runs["adamw"])
    fused_ms = statistics.median(r["step_ms"] for r in runs["adamw-fused"])
    print("| variant | step ops | scalar reads / step | block ops | step ms | × AdamW (foreach) | × AdamW (fused) | fwd+bwd ms |")
    print("|---|---|---|---|---|---|---|---|")
    for label, rs in runs.items():
        ms = statistics.median(r["step_ms"] for r in rs)
        fb = statistics.median(r["forward_backward_ms"] for r in rs)
        r0 = rs[0]
        print(
            f"| {label} | {r0['step_ops']:.1f} | {r0['step_scalar_reads']:.1f} | {r0['block_ops']:.1f} "
            f"| {ms:.3f} | {ms / adamw_ms:.1f} | {ms / fused_ms:.1f} | {fb:.3f} |"
        )


if __name__ == "__main__":
    main()
