"""Per-step work of EVON's optimizer step: dispatched aten ops, matmul FLOPs and CPU time.

Compared with a naive per-matrix float32 EVON (``NaiveEVON`` below, written from
``docs/algorithm.md``; the paper's own code is not used) and, if ``pytorch_optimizer`` is
importable, its SOAP. Every figure is per *steady* step averaged over one whole refresh cycle
(``precondition_frequency`` updates after the initialising step), with the loop users run::

    with opt.sampled_params(train=True):   # (SOAP: no sampling block)
        loss.backward()
    opt.step()
    opt.zero_grad()

Only the optimizer's work is counted and timed (block entry and exit, ``step``, ``zero_grad``),
not the forward/backward of the toy loss ``½‖W − T‖²``. Ops are counted with a
``TorchDispatchMode`` (every aten call, views included); FLOPs with
``torch.utils.flop_counter.FlopCounterMode`` (matmuls only: QR and eigh are not counted).

Sections:

* ops: one GPT-2-like block (d×3d, d×d, d×4d, 4d×d) vs twelve, at ``--count-width``
  (the op count does not depend on the width, so a small one keeps it quick);
* flops: one block at ``--width`` (768: GPT-2 small), EVON vs naive vs SOAP;
* time: ``--time-blocks`` blocks (6 = 24 matrices) at ``--time-width``, one thread; EVON and
  the naive reference alternate cycle by cycle in one process; median and spread (min-max)
  of the per-cycle mean step time.

Figures: docs/results.md#speed ("Matmul FLOPs" and "Whitening on a CPU").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from hf_evon import EVON
from hf_evon.optim import linalg

Tensor = torch.Tensor

# The hyperparameters both EVONs get (EVON's defaults, with a fixed ess so both draw alike noise).
SETTINGS = dict(
    lr=0.02,
    ess=1e6,
    hess_init=0.01,
    betas=(0.95, 0.995),
    weight_decay=2.5e-5,
    hess_clip_ratio=2.0,
    clip="element",
    clip_radius=0.01,
    precondition_frequency=10,
)


def _in_place_baddbmm_flop(c: Any, a: Any, b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``C.baddbmm_(A, B)``, ``A`` (B, m, k), ``B`` (B, k, n): 2·B·m·k·n, as for ``baddbmm``."""
    batch, m, k = a
    return 2 * batch * m * k * b[-1]


def flop_counter() -> FlopCounterMode:
    """torch's ``FlopCounterMode`` that also counts the in-place ``baddbmm_`` (EVON's Shampoo
    statistics on CPU, β3·L + (1 − β3)·G Gᵀ in one product), which torch's formulas leave out."""
    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.baddbmm_: _in_place_baddbmm_flop})


def block_shapes(width: int, blocks: int = 1) -> list[tuple[int, int]]:
    """The four matrices of a GPT-2 block (attention in/out, MLP in/out), ``blocks`` times."""
    d = width
    return [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * blocks


class OpCounter(TorchDispatchMode):
    """Counts every aten call that reaches the dispatcher (views and in-place ops included)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.count += 1
        self.by_op[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class NaiveEVON:
    """EVON as ``docs/algorithm.md`` states it, one matrix at a time (a Python loop), float32.

    Per matrix and step (S samples; ``m×n`` matrix, both sides preconditioned), the matmuls are:
    the sample ``M + Q_L E_s Q_Rᵀ`` (2 per sample), ``G°_s = Q_Lᵀ G_s Q_R`` (2 per sample; the
    mean ``G°`` is the mean of these, and ``Ĥ`` the mean of ``G°_s ⊙ E_s / V``), the prior term
    ``δ Q_Lᵀ M Q_R`` (2), ``Δ = Q_L U Q_Rᵀ`` (2), ``G Gᵀ`` and ``Gᵀ G`` (2); every ``f`` updates
    (all matrices at ``t % f == 0``) ``qr(L Q_L)``, ``qr(R Q_R)`` (1 each + QR) and ``Ḡ``
    unrotated with the old bases and rotated with the new ones (4). The first step only forms
    ``L``, ``R`` and their ``eigh`` bases (descending order). Element-wise ops as written;
    the update is clipped element-wise (``clip="element"``), not at all (``"none"``) or
    whitened (``"whiten_rms"``: Muon's five quintic Newton–Schulz iterations, 3 products each,
    scaled to entry RMS ``clip_radius``; the paper's code whitens by default)."""

    def __init__(self, params: list[Tensor], *, seed: int = 0, **hp: float) -> None:
        self.params = params
        self.hp = hp
        device = params[0].device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.state: list[dict[str, Tensor]] = []
        for p in params:
            m, n = p.shape
            self.state.append(
                {
                    "H": torch.full((m, n), hp["hess_init"], device=device),
                    "Gbar": torch.zeros(m, n, device=device),
                    "L": torch.zeros(m, m, device=device),
                    "R": torch.zeros(n, n, device=device),
                }
            )
        self.t = 0
        self.initialised = False
        self.samples: list[list[tuple[Tensor, Tensor, Tensor]]] = [[] for _ in params]

    def V(self, st: dict[str, Tensor]) -> Tensor:
        return 1.0 / (self.hp["ess"] * (st["H"] + self.hp["weight_decay"]))

    @contextlib.contextmanager
    @torch.no_grad()
    def sampled_params(self, train: bool = True) -> Iterator[None]:
        means, noises = [], []
        for p, st in zip(self.params, self.state):
            E = torch.randn(p.shape, generator=self.gen, device=p.device) * self.V(st).sqrt()
            means.append(p.detach().clone())
            if self.initialised:
                p.copy_(p + st["Q_L"] @ E @ st["Q_R"].T)
            else:
                p.copy_(p + E)
            noises.append(E)
        yield
        for i, (p, st) in enumerate(zip(self.params, self.state)):
            p.copy_(means[i])
            if train:
                G = p.grad.detach().clone()
                if self.initialised:
                    G_rot = st["Q_L"].T @ G @ st["Q_R"]
                    h = G_rot * noises[i] / self.V(st)
                else:
                    G_rot = h = None
                self.samples[i].append((G, G_rot, h))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        hp = self.hp
        beta1, beta2 = hp["betas"]
        delta, gamma, f = hp["weight_decay"], hp["hess_clip_ratio"], hp["precondition_frequency"]
        if self.initialised:
            self.t += 1
        for p, st, samples in zip(self.params, self.state, self.samples):
            S = len(samples)
            G = sum(s[0] for s in samples) / S
            if self.initialised:
                G_rot = sum(s[1] for s in samples) / S
                H_hat = sum(s[2] for s in samples) / S
                H = st["H"]
                bound = gamma * (H + 1e-12)
                H_hat = torch.clamp(H_hat, -bound, bound)
                st["H"] = (
                    beta2 * H + (1 - beta2) * H_hat + 0.5 * (1 - beta2) ** 2 * (H - H_hat) ** 2 / (H + delta)
                )
                st["Gbar"] = beta1 * st["Gbar"] + (1 - beta1) * G_rot
                Q_L, Q_R = st["Q_L"], st["Q_R"]
                U = (st["Gbar"] / (1 - beta1**self.t) + delta * (Q_L.T @ p @ Q_R)) / (st["H"] + delta)
                update = Q_L @ U @ Q_R.T
                if hp["clip"] == "element":
                    update = update.clamp(-hp["clip_radius"], hp["clip_radius"])
                elif hp["clip"] == "whiten_rms":
                    update = naive_whiten(update) * (hp["clip_radius"] * max(update.shape) ** 0.5)
                p.sub_(hp["lr"] * update)
            st["L"] = beta2 * st["L"] + (1 - beta2) * G @ G.T
            st["R"] = beta2 * st["R"] + (1 - beta2) * G.T @ G
            if not self.initialised:
                st["Q_L"] = torch.linalg.eigh(st["L"]).eigenvectors.flip(-1)
                st["Q_R"] = torch.linalg.eigh(st["R"]).eigenvectors.flip(-1)
            elif self.t % f == 0:
                new_L = torch.linalg.qr(st["L"] @ st["Q_L"]).Q
                new_R = torch.linalg.qr(st["R"] @ st["Q_R"]).Q
                st["Gbar"] = new_L.T @ (st["Q_L"] @ st["Gbar"] @ st["Q_R"].T) @ new_R
                st["Q_L"], st["Q_R"] = new_L, new_R
        self.initialised = True
        self.samples = [[] for _ in self.params]


def naive_whiten(x: Tensor, steps: int = 5) -> Tensor:
    """Muon's quintic Newton–Schulz iterations on one matrix, as ``docs/algorithm.md`` names them."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = x.shape[0] > x.shape[1]
    y = x.T if tall else x
    y = y / (torch.linalg.norm(y) + 1e-7)
    for _ in range(steps):
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y.T if tall else y


def clip_of(name: str) -> str:
    """The update clip a variant's name asks for, the same for both EVONs: "-noclip" none,
    "-whiten" "whiten_rms" (EVON's default from scratch), otherwise ``SETTINGS``' "element"."""
    if "-noclip" in name:
        return "none"
    return "whiten_rms" if "-whiten" in name else SETTINGS["clip"]


def naive_peer(name: str) -> str:
    """The naive EVON with the same clip as ``name``."""
    return {"none": "naive-noclip", "whiten_rms": "naive-whiten"}.get(clip_of(name), "naive")


class Run:
    """One optimizer on its own copy of the matrices, driven by the users' loop."""

    def __init__(self, name: str, shapes: list[tuple[int, int]], seed: int = 0, device: str = "cpu") -> None:
        gen = torch.Generator().manual_seed(seed)
        self.params = [torch.nn.Parameter(0.02 * torch.randn(s, generator=gen).to(device)) for s in shapes]
        self.targets = [0.02 * torch.randn(s, generator=gen).to(device) for s in shapes]
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        self.name = name
        settings = {**SETTINGS, "clip": clip_of(name)}
        if name.startswith("hf-evon"):
            # "hf-evon-spec": every matrix refreshes at t % f == 0 (the spec's schedule), no staggering
            self.opt = EVON(self.params, seed=seed, stagger_refresh=name != "hf-evon-spec", **settings)
        elif name.startswith("naive"):
            self.opt = NaiveEVON(self.params, seed=seed, **settings)
        elif name == "soap":
            from pytorch_optimizer import SOAP

            self.opt = SOAP(self.params, lr=3e-3, precondition_frequency=SETTINGS["precondition_frequency"])
        else:
            raise ValueError(name)

    def backward(self) -> None:
        loss = sum(0.5 * (p - t).square().sum() for p, t in zip(self.params, self.targets))
        loss.backward()

    def step(self, around: Callable[[], contextlib.AbstractContextManager]) -> float:
        """One training step; ``around()`` wraps the optimizer's parts. Returns their seconds."""
        block = None if self.name == "soap" else self.opt.sampled_params(train=True)
        self.sync()
        t0 = time.perf_counter()
        with around():
            if block is not None:
                block.__enter__()
        self.sync()
        elapsed = time.perf_counter() - t0
        self.backward()
        self.sync()
        t0 = time.perf_counter()
        with around():
            if block is not None:
                block.__exit__(None, None, None)
            self.opt.step()
            self.opt.zero_grad()
        self.sync()
        return elapsed + time.perf_counter() - t0


def _cycle() -> int:
    return SETTINGS["precondition_frequency"]


def count(name: str, shapes: list[tuple[int, int]]) -> dict[str, float]:
    """Aten ops and matmul FLOPs per steady step, averaged over one refresh cycle.

    A name ending in ``-accel`` counts the path EVON takes on accelerators (the blocked
    symmetric product for ``G Gᵀ``, ``Gᵀ G``; CPU uses one matmul, faster there; and the
    Newton-Schulz iterations, where a CPU may take an eigh, which no FLOP counter counts)."""
    if name.endswith("-accel"):
        saved = linalg.GRAM_BLOCKED_ON_CPU, linalg.eigh_beats_iterations
        # accelerators: the blocked Gram and the Newton-Schulz iterations (no eigh route)
        linalg.GRAM_BLOCKED_ON_CPU, linalg.eigh_beats_iterations = True, lambda m, n: False
        try:
            return count(name.removesuffix("-accel"), shapes)
        finally:
            linalg.GRAM_BLOCKED_ON_CPU, linalg.eigh_beats_iterations = saved
    run = Run(name, shapes)
    run.step(contextlib.nullcontext)  # initialises L, R and the bases
    run.step(contextlib.nullcontext)  # the first update (EVON forms the carried rotated mean there)
    ops, flops = OpCounter(), 0

    @contextlib.contextmanager
    def counted() -> Iterator[None]:
        nonlocal flops
        fc = flop_counter()
        with fc, ops:
            yield
        flops += fc.get_total_flops()

    for _ in range(_cycle()):
        run.step(counted)
    return {
        "ops": ops.count / _cycle(),
        "gflop": flops / _cycle() / 1e9,
        "top_ops": dict(ops.by_op.most_common(8)),
    }


def interleaved_times(
    names: list[str], shapes: list[tuple[int, int]], repeats: int, device: str = "cpu"
) -> dict[str, list[float]]:
    """Per-cycle mean step seconds, the optimizers alternating cycle by cycle (order flipped)."""
    runs = {n: Run(n, shapes, device=device) for n in names}
    for run in runs.values():
        for _ in range(_cycle() + 1):  # initialise, then one cycle of warm-up
            run.step(contextlib.nullcontext)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names if r % 2 == 0 else names[::-1]:
            secs = [runs[n].step(contextlib.nullcontext) for _ in range(_cycle())]
            out[n].append(sum(secs) / len(secs))
    return out


def soap_available() -> bool:
    try:
        import pytorch_optimizer  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--width", type=int, default=768, help="block width for the FLOP count (768: GPT-2 small)"
    )
    ap.add_argument("--count-width", type=int, default=64, help="block width for the 1-vs-12-block op count")
    ap.add_argument("--time-width", type=int, default=256)
    ap.add_argument("--time-blocks", type=int, default=6, help="6 blocks = 24 matrices")
    ap.add_argument("--repeats", type=int, default=6, help="timed refresh cycles per optimizer")
    ap.add_argument("--skip", nargs="*", default=[], choices=["ops", "flops", "time"])
    ap.add_argument("--device", default="cpu", help="where the timed section runs (counts: always CPU)")
    ap.add_argument("--time-names", nargs="+", default=["hf-evon", "naive"], help="optimizers to time")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = ["hf-evon", "hf-evon-spec", "naive"] + (["soap"] if soap_available() else [])
    noclip = ["hf-evon-noclip", "naive-noclip", "hf-evon-whiten", "naive-whiten"]
    accel = ["hf-evon-accel", "hf-evon-noclip-accel", "hf-evon-whiten-accel"]
    result: dict[str, dict] = {"torch": torch.__version__, "settings": {**SETTINGS}}
    if not soap_available():
        print("pytorch_optimizer is not installed: no SOAP row")

    if "ops" not in args.skip:
        rows = {n: {b: count(n, block_shapes(args.count_width, b)) for b in (1, 12)} for n in names}
        result["ops"] = rows
        print(f"\n### aten ops per steady step (width {args.count_width}; ops do not depend on it)\n")
        print("| optimizer | 1 block | 12 blocks | 12 / 1 |\n|---|---:|---:|---:|")
        for n, r in rows.items():
            print(f"| {n} | {r[1]['ops']:.1f} | {r[12]['ops']:.1f} | {r[12]['ops'] / r[1]['ops']:.2f} |")

    if "flops" not in args.skip:
        rows = {n: count(n, block_shapes(args.width)) for n in names + noclip + accel}
        result["flops"] = rows
        print(f"\n### matmul GFLOP per steady step, one block at width {args.width}\n")
        print("| optimizer | clip | GFLOP | × naive EVON (same clip) |\n|---|---|---:|---:|")
        for n, r in rows.items():
            ref = rows[naive_peer(n)]["gflop"]
            print(f"| {n} | {clip_of(n)} | {r['gflop']:.1f} | {r['gflop'] / ref:.3f} |")

    if "time" not in args.skip:
        shapes = block_shapes(args.time_width, args.time_blocks)
        times = interleaved_times(args.time_names, shapes, args.repeats, args.device)
        result["time"] = {"shapes": shapes, "seconds_per_step": times}
        med = {n: statistics.median(v) for n, v in times.items()}
        where = "CPU, one thread" if args.device == "cpu" else args.device
        print(
            f"\n### ms per steady step ({where}), {len(shapes)} matrices (width {args.time_width}), "
            f"{args.repeats} interleaved cycles of {_cycle()} steps\n"
        )
        print("| optimizer | median ms | min–max ms | × naive EVON (same clip) |\n|---|---:|---:|---:|")
        for n, v in times.items():
            ratio = f"{med[n] / med[naive_peer(n)]:.3f}" if naive_peer(n) in med else "-"
            print(f"| {n} | {1e3 * med[n]:.1f} | {1e3 * min(v):.1f}–{1e3 * max(v):.1f} | {ratio} |")
        result["time"]["ratio_per_cycle"] = {}
        for n in times:
            base = naive_peer(n)
            if n.startswith("hf-evon") and base in times:
                ratios = [a / b for a, b in zip(times[n], times[base])]
                result["time"]["ratio_per_cycle"][n] = ratios
                print(
                    f"\nper-cycle ratio {n} / {base}: median {statistics.median(ratios):.3f}, "
                    f"min {min(ratios):.3f}, max {max(ratios):.3f}"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
