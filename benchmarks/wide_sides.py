"""What ``max_precond_ratio`` saves: EVON's state and step time where a matrix is lopsided.

A side more than ``max_precond_ratio`` (default 128) times its matrix's other side keeps the
identity basis (docs/defaults.md#max-precond-ratio). Two models where that happens, each trained
a few steps at the default and with every basis (``max_precond_ratio=inf``):

    cnn    default_transfer.py's digits CNN: two 3×3 convolutions, a 10×2048 head, batch 32
           (``--cnn-channels 16``: the second convolution 16 wide, a 10×1024 head)
    lora   LoRA (rank 8, on q_proj and v_proj) of a 2-layer Llama of width ``--width`` (2048 by
           default: the 8×2048 and 2048×8 adapters' wide side), 4 sequences of 64 tokens

For each: EVON's optimizer state in bytes (every tensor of ``optimizer.state``, summed once per
storage), per trained parameter, and the mean seconds of a whole step (sampled forward and
backward, ``step()``) over two whole refresh cycles (the refresh steps included), one thread. ``torch.optim.AdamW`` on the same
trainable parameters is the baseline.

    python benchmarks/wide_sides.py
    python benchmarks/wide_sides.py --models lora --width 4096
    python benchmarks/wide_sides.py --models cnn --cnn-channels 16 --ratio 64

Figures: docs/defaults.md#max-precond-ratio.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn

from hf_evon import build_optimizer
from hf_evon.distributed.sharding import optimizer_state_bytes

WARMUP, TIMED = 10, 20  # the initialising step and one refresh cycle, then two cycles timed


def cnn(seed: int, channels: int = 32) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, channels, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(channels * 64, 10),
    )  # fmt: skip
    return model, (torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,)))


def lora(seed: int, width: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=1024, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
        num_attention_heads=width // 128, num_key_value_heads=width // 128, max_position_embeddings=64,
    )  # fmt: skip
    model = peft.get_peft_model(
        LlamaForCausalLM(cfg), peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
    ids = torch.randint(0, 1024, (4, 64))
    return model, (ids, ids)


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    if x.dtype == torch.long:  # a causal LM: the labels are the inputs
        return model(input_ids=x, labels=y).loss
    return nn.functional.cross_entropy(model(x), y)


# optimizer -> EVON's keyword arguments besides the defaults (None: torch's AdamW)
OPTIMIZERS = {"AdamW": None, "EVON default": {}, "EVON every basis": {"max_precond_ratio": math.inf}}


def measure(build, extra: dict | None) -> dict[str, float]:  # noqa: ANN001
    """EVON with keyword arguments ``extra`` (None: torch's AdamW) on the model ``build()`` returns."""
    model, batch = build()
    params = [p for p in model.parameters() if p.requires_grad]
    if extra is None:
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-3)
        sampled = None
    else:
        opt = build_optimizer(model, learning_rate=1e-3, seed=0, **extra)
        sampled = opt.sampled_params
    times = []
    for step in range(WARMUP + TIMED):
        start = time.perf_counter()
        if sampled is None:
            loss(model, batch).backward()
        else:
            with sampled(train=True):
                loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    trainable = sum(p.numel() for p in params)
    nbytes = optimizer_state_bytes(opt)
    return {"state_bytes": nbytes, "bytes_per_param": nbytes / trainable, "step_s": statistics.fmean(times)}


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["cnn", "lora"], choices=["cnn", "lora"])
    ap.add_argument("--width", type=int, default=2048, help="the Llama's hidden size (a multiple of 128)")
    ap.add_argument("--cnn-channels", type=int, default=32, help="the CNN's second convolution's width")
    ap.add_argument("--ratio", type=float, help="also EVON at this max_precond_ratio")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    optimizers = dict(OPTIMIZERS)
    if args.ratio is not None:
        optimizers[f"EVON ratio {args.ratio:g}"] = {"max_precond_ratio": args.ratio}
    builds = {"cnn": lambda: cnn(0, args.cnn_channels), "lora": lambda: lora(0, args.width)}
    out: dict[str, dict[str, dict[str, float]]] = {}
    print("| model | optimizer | state MB | bytes per trained parameter | step ms |")
    print("|---|---|---|---|---|")
    for name in args.models:
        rows = out.setdefault(name, {})
        for label, extra in optimizers.items():
            r = rows[label] = measure(builds[name], extra)
            print(
                f"| {name} | {label} | {r['state_bytes'] / 2**20:.2f} | {r['bytes_per_param']:.1f} | "
                f"{1e3 * r['step_s']:.1f} |",
                flush=True,
            )
    return out


if __name__ == "__main__":
    main()
