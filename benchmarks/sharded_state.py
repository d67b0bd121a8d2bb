"""Per-rank EVON state and optimizer time, sharded (``prepare_distributed(shard=True)``), world 1, 2, 4.

Model: a GPT-2-block-shaped stack (``--layers`` x [d×d attention projections ×4, d×4d and
4d×d MLP], d = ``--dim``) in float32, all matrices EVON, biases AdamW. Each world size runs
in its own CPU process group (gloo, ``torch.distributed.run``), 1 thread per process; the
global batch is fixed, so world W does 1/W of the forward/backward per rank. Reported per
rank: optimizer state bytes (every storage once), and the optimizer's own time per step:
``step()`` plus entering/leaving ``sampled_params`` (the perturbation and its exchange, the
gradient averaging), the forward/backward excluded. "ratio" is max per-rank bytes over
(total / world); the target is ≤ 1.2.

Usage: ``python benchmarks/sharded_state.py [--dim 128 --layers 4 --steps 6] [--fsdp2]``.
``--fsdp2``: the same model with every Linear and the root ``fully_shard``-ed (FSDP2, a 1-D
CPU mesh), EVON sharded over it (:mod:`hf_evon.distributed.fsdp2`); it also reports the owners'
full copies of their matrices (outside ``optimizer.state``) and the forward/backward time.

Measured on the 2-core CPU dev machine (shared: load average 4-6 from other jobs, so the
times are rough), ``python benchmarks/sharded_state.py --steps 8`` (4 layers of d = 128:
0.79M EVON-covered weights, float32, ~36 state bytes each; optimizer ms = max over ranks, mean of 6 timed steps):

| world | sharded state / rank (MB) | sum over ranks (MB) | ratio to total/world | sharded optimizer ms / step | unsharded state / rank (MB) | unsharded optimizer ms / step |
|---|---|---|---|---|---|---|
| 1 | 28.35 | 28.35 | 1.00 | 198.8 | 28.35 | 211.3 |
| 2 | 14.17 | 28.35 | 1.00 | 162.6 | 28.35 | 500.5 |
| 4 | 7.09 | 28.35 | 1.00 | 189.4 | 28.35 | 512.7 |

Per-rank state is exactly total/world here (every layer has the same shapes). With more
processes than cores the ranks share the 2 cores, so neither column falls as 1/world in wall
time; what the table does show is the work: unsharded, every rank repeats all the maths and
W ranks on 2 cores take ~2.5x longer; sharded, the same total work is split and the time
stays at the one-process level. With one core (or GPU) per rank the sharded maths falls ~1/W.
No GPU was lent for this measurement.

FSDP2, ``python benchmarks/sharded_state.py --fsdp2 --steps 8`` (same model and machine, load
average ~4; optimizer ms: ``sampled_params`` entry/exit with the row exchanges, plus ``step()``
with the gradient gather and the rows of the new means sent back):

| world | FSDP2 EVON state / rank (MB) | ratio to total/world | owners' full copies / rank (MB) | optimizer ms / step | forward+backward ms / step |
|---|---|---|---|---|---|
| 1 | 28.35 | 1.00 | 3.15 | 150.9 | 21.9 |
| 2 | 14.17 | 1.00 | 1.57 | 124.2 | 138.4 |
| 4 | 7.09 | 1.00 | 0.79 | 159.8 | 359.7 |

The state is the DDP-sharded one (the biases' AdamW state is split by rows too); the owners'
copies add 4 bytes per owned float32 weight (~1/9 of the state). The forward/backward time
grows with the world here because FSDP2's all-gathers and reduce-scatters run over gloo on 2
shared cores; that is FSDP2's cost, not EVON's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))


def build_model(dim: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(dim, dim) for _ in range(4)]
        blocks += [nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)]
    return nn.Sequential(*blocks)


def worker(args: argparse.Namespace) -> None:
    from hf_evon import build_optimizer, prepare_distributed
    from hf_evon.distributed.sharding import optimizer_state_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build_model(args.dim, args.layers)
    if args.shard == 2:  # FSDP2: every Linear and the root fully_shard-ed on a 1-D CPU mesh
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for mod in model:
            if isinstance(mod, nn.Linear):
                fully_shard(mod, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ddp = model
    else:
        ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = build_optimizer(model, seed=0, precondition_frequency=2)
    prepare_distributed(ddp, opt, shard=True if args.shard else None)
    rows = args.batch // world
    opt_seconds = fb_seconds = 0.0
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(args.batch, args.dim, generator=gen)[rank * rows : (rank + 1) * rows]
        t0 = time.perf_counter()
        ctx = opt.sampled_params(train=True)
        ctx.__enter__()
        t1 = time.perf_counter()
        ddp(x).square().mean().backward()
        t2 = time.perf_counter()
        ctx.__exit__(None, None, None)
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        if step >= 2:  # the first steps initialise the bases
            opt_seconds += (t1 - t0) + (t3 - t2)
            fb_seconds += t2 - t1
    timed = max(args.steps - 2, 1)
    ms = torch.tensor([opt_seconds / timed * 1e3, fb_seconds / timed * 1e3])
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    out = {
        "world": world,
        "rank": rank,
        "state_bytes": optimizer_state_bytes(opt),
        "opt_ms": float(ms[0]),
        "fwd_bwd_ms": float(ms[1]),
        # FSDP2: the owners' full copies of their matrices (outside optimizer.state)
        "copy_bytes": opt.sharding.proxy_bytes() if hasattr(opt.sharding, "proxy_bytes") else 0,
    }
    with open(os.path.join(args.out, f"s{args.shard}w{world}r{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def run_world(args: argparse.Namespace, out: str, world: int, shard: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world)]
    cmd += ["--master_port", str(29600 + world), os.path.abspath(__file__), "--worker", "--out", out]
    cmd += ["--dim", str(args.dim), "--layers", str(args.layers), "--steps", str(args.steps)]
    cmd += ["--batch", str(args.batch), "--shard", str(shard)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(HERE))
    subprocess.run(cmd, env=env, check=True)
    ranks = []
    for r in range(world):
        with open(os.path.join(out, f"s{shard}w{world}r{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--fsdp2", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shard", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.fsdp2:
        fsdp2_table(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for world in (int(w) for w in args.worlds.split(",")):
            rows.append((run_world(args, out, world, 1), run_world(args, out, world, 0)))
    total = sum(r["state_bytes"] for r in rows[0][0])
    print(
        "| world | sharded state / rank (MB) | sum over ranks (MB) | ratio to total/world | "
        "sharded optimizer ms / step | unsharded state / rank (MB) | unsharded optimizer ms / step |"
    )
    print("|---|---|---|---|---|---|---|")
    for sharded, unsharded in rows:
        world = len(sharded)
        per = max(r["state_bytes"] for r in sharded)
        summed = sum(r["state_bytes"] for r in sharded)
        print(
            f"| {world} | {per / 1e6:.2f} | {summed / 1e6:.2f} | {per / (total / world):.2f} | "
            f"{sharded[0]['opt_ms']:.1f} | {max(r['state_bytes'] for r in unsharded) / 1e6:.2f} | "
            f"{unsharded[0]['opt_ms']:.1f} |"
        )


def fsdp2_table(args: argparse.Namespace) -> None:
    """Per-rank EVON state, owners' full copies and times under FSDP2 (``--fsdp2``)."""
    with tempfile.TemporaryDirectory() as out:
        rows = [run_world(args, out, int(w), 2) for w in args.worlds.split(",")]
    total = sum(r["state_bytes"] for r in rows[0])
    print(
        "| world | FSDP2 EVON state / rank (MB) | ratio to total/world | owners' full copies / rank (MB) | "
        "optimizer ms / step | forward+backward ms / step |"
    )
    print("|---|---|---|---|---|---|")
    for ranks in rows:
        world = len(ranks)
        per = max(r["state_bytes"] for r in ranks)
        print(
            f"| {world} | {per / 1e6:.2f} | {per / (total / world):.2f} | "
            f"{max(r['copy_bytes'] for r in ranks) / 1e6:.2f} | {ranks[0]['opt_ms']:.1f} | "
            f"{ranks[0]['fwd_bwd_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
