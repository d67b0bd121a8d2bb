"""Training-step time, optimizer time, peak memory and state size: AdamW vs SOAP vs EVON.

GPU (the issue's setting): GPT-2 small (124M), 16×1024 tokens, bf16 autocast::

    python benchmarks/optimizer_step.py --device cuda

CPU (always; a smaller model so it finishes in minutes)::

    python benchmarks/optimizer_step.py --device cpu

Each optimizer runs in its own subprocess (clean peak memory). EVON and SOAP own the
transformer-block matrices; embeddings, head and 1-D tensors use AdamW for all three,
as in the paper. Timed steps cover several eigenbasis refreshes (every 10th step).
``evon`` refreshes every matrix at ``t % 10 == 0`` (the spec's schedule); ``evon-staggered``
is EVON's default (``stagger_refresh=True``: each matrix has its own phase).

Figures: docs/results.md#speed (CPU), #on-a-gpu-h100-2026-11-26, #on-a-gpu-h200-2026-11-27 and
#on-a-gpu-h200-2026-11-30 (GPU).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hf_evon import EVON, build_param_groups

OPTIMIZERS = ("adamw", "soap", "evon", "evon-staggered", "evon-element")
# EVON's settings in this benchmark and step_profile.py: fixed, not build_optimizer's defaults
EVON_SETTINGS = {"lr": 1e-2, "ess": 1e7, "hess_init": 0.5, "weight_decay": 1e-6, "precondition_frequency": 10, "seed": 0}


def model_config(device: str, args: argparse.Namespace) -> GPT2Config:
    if device == "cuda" and not args.small:
        return GPT2Config(n_positions=1024)  # GPT-2 small defaults: 12 layers, 768 wide, 124M
    return GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=256, vocab_size=8192)


def unique_state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of optimizer state, counting shared storages (EVON's stacked views) once."""
    seen: dict[int, int] = {}
    for opt in optimizers:
        stack = [v for st in opt.state.values() for v in st.values()]
        while stack:  # some optimizers keep lists of tensors in their state
            v = stack.pop()
            if isinstance(v, list | tuple):
                stack.extend(v)
            elif torch.is_tensor(v):
                s = v.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def build(name: str, model: torch.nn.Module, device: str) -> list[torch.optim.Optimizer]:
    groups = build_param_groups(model)
    matrices = [g for g in groups if g["algorithm"] == "evon"]
    others = [
        {k: v for k, v in g.items() if k not in ("algorithm", "param_names")}
        for g in groups
        if g["algorithm"] == "adamw"
    ]
    fused = {"fused": True} if device == "cuda" else {"foreach": True}
    if name == "adamw":
        params = [{"params": g["params"]} for g in matrices] + others
        return [torch.optim.AdamW(params, lr=3e-4, weight_decay=0.0, **fused)]
    adamw = torch.optim.AdamW(others, lr=3e-4, **fused)
    if name == "soap":
        from pytorch_optimizer import SOAP

        return [SOAP([{"params": g["params"]} for g in matrices], lr=3e-3, precondition_frequency=10), adamw]
    evon = EVON(
        matrices,
        **EVON_SETTINGS,
        stagger_refresh=name != "evon",  # "evon": the spec's schedule, all at t % f == 0
        # "evon-element": the element-wise clip, to show what the default's Newton–Schulz
        # iterations cost
        **({"clip": "element"} if name == "evon-element" else {}),
    )
    return [evon, adamw]


def run_one(name: str, args: argparse.Namespace) -> dict:
    device = args.device
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")  # TF32 for matmuls on GPU, as in mixed-precision training
    cfg = model_config(device, args)
    model = GPT2LMHeadModel(cfg).to(device)
    model.config.use_cache = False
    batch, seq = (args.batch, args.seq) if device == "cuda" else (args.cpu_batch, args.cpu_seq)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    opts = build(name, model, device)
    evon = opts[0] if isinstance(opts[0], EVON) else None
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=(device == "cuda"))

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def train_step() -> tuple[float, float]:
        sample = evon.sampled_params(train=True) if evon is not None else None
        if sample is not None:
            sample.__enter__()
        with autocast:
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if sample is not None:
            sample.__exit__(None, None, None)
        sync()
        t0 = time.perf_counter()
        for opt in opts:
            opt.step()
        sync()
        t_opt = time.perf_counter() - t0
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        return t_opt, loss.item()

    for _ in range(args.warmup):
        train_step()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_times, opt_times = [], []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        t_opt, loss = train_step()
        step_times.append(time.perf_counter() - t0)
        opt_times.append(t_opt)
    n_params = sum(p.numel() for p in model.parameters())
    n_matrix = sum(
        p.numel() for g in build_param_groups(model) if g["algorithm"] == "evon" for p in g["params"]
    )
    state = unique_state_bytes(opts)
    peak = (
        torch.cuda.max_memory_allocated()
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "optimizer": name,
        "step_ms": 1e3 * statistics.mean(step_times),
        "median_ms": 1e3 * statistics.median(step_times),
        "max_ms": 1e3 * max(step_times),
        "opt_ms": 1e3 * statistics.mean(opt_times),
        "peak_gib": peak / 2**30,
        "state_bytes_per_param": state / n_params,
        "matrix_state_bytes_per_matrix_param": unique_state_bytes(opts[:1]) / n_matrix
        if name != "adamw"
        else None,
        "params_m": n_params / 1e6,
        "final_loss": loss,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--cpu-batch", type=int, default=4)
    ap.add_argument("--cpu-seq", type=int, default=128)
    ap.add_argument("--small", action="store_true", help="use the small model on GPU too")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="timed steps (30 = 3 eigenbasis refreshes)")
    ap.add_argument("--only", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.only:
        print(json.dumps(run_one(args.only, args)))
        return
    rows = []
    for name in args.optimizers:
        cmd = [sys.executable, __file__, "--only", name] + [
            a for a in sys.argv[1:] if a not in args.optimizers
        ]
        cmd = [c for c in cmd if c != "--optimizers"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{name}: failed\n{out.stderr[-3000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = next((r["step_ms"] for r in rows if r["optimizer"] == "adamw"), None)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"device: {dev}; model: {rows[0]['params_m']:.1f}M params; torch {torch.__version__}")
    print(
        f"{'optimizer':9s} {'step ms':>8s} {'x AdamW':>7s} {'median':>7s} {'max':>7s} {'max/med':>7s} "
        f"{'opt ms':>7s} {'peak GiB':>8s} {'B/param':>7s} {'B/matrix-param':>14s}"
    )
    for r in rows:
        ratio = r["step_ms"] / base if base else float("nan")
        mat = r["matrix_state_bytes_per_matrix_param"]
        print(
            f"{r['optimizer']:9s} {r['step_ms']:8.1f} {ratio:7.2f} {r['median_ms']:7.1f} {r['max_ms']:7.1f} "
            f"{r['max_ms'] / r['median_ms']:7.2f} {r['opt_ms']:7.1f} {r['peak_gib']:8.2f} "
            f"{r['state_bytes_per_param']:7.1f} {'-' if mat is None else f'{mat:.1f}':>14s}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
