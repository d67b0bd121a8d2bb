"""Do the defaults transfer? EVON's default clip vs the element-wise one vs AdamW on tasks that
``benchmarks/payoff.py`` (where the step ratios were measured) does not contain.

Tasks: scikit-learn's wine (ReLU MLP 256-256, batch 32, 40 epochs) and iris (tanh MLP 64-64,
batch 16, 60 epochs), digits with a deeper GELU MLP (128-128-128, batch 32, 20 epochs), and a tiny
Llama (2 layers, width 128, untied head) on payoff.py's stdlib corpus for 300 steps; 70/30
train/test splits per seed. Every method at its defaults with AdamW's rate 1e-3 (AdamW: weight
decay 0.01), payoff.py's loop and linear decay; test NLL and accuracy at the posterior mean.

    python benchmarks/default_transfer.py                 # all tasks, 2 seeds (~4 min, 1 core)
    python benchmarks/default_transfer.py --tasks wine --seeds 1

Measured (2 seeds, OMP_NUM_THREADS=1; NLL, the mean of the seeds; accuracy %) — AdamW /
EVON default ("whiten_rms") / EVON ``clip="element"``: wine 0.031 (99.1) / 0.031 (100) / 0.087
(97.2); iris 0.104 (94.4) / 0.143 (93.3) / 0.251 (90.0); digits deep GELU 0.146 (97.7) / 0.115
(98.3) / 0.143 (97.4); tiny Llama 4.506 (16.3) / 4.432 (17.2) / 4.656 (14.3).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import payoff  # noqa: E402  (the benchmark's loop, metrics and LM data)
from payoff import Task, build_optimizer, log_probs, scores, train  # noqa: E402

METHODS = ("AdamW", "EVON default", "EVON element")


def tabular(
    name: str, hidden: list[int], act: type[nn.Module], batch: int, epochs: int
) -> Callable[[int], Task]:
    from sklearn import datasets
    from sklearn.preprocessing import StandardScaler

    X, y = getattr(datasets, f"load_{name.split('_')[0]}")(return_X_y=True)

    def make(seed: int) -> Task:
        idx = np.random.RandomState(seed).permutation(len(y))
        tr, te = idx[: int(0.7 * len(y))], idx[int(0.7 * len(y)) :]
        scaler = StandardScaler().fit(X[tr])

        def batches(i: np.ndarray, size: int) -> list:
            xs, ys = torch.tensor(scaler.transform(X[i]), dtype=torch.float32), torch.tensor(y[i])
            return [(xs[k : k + size], ys[k : k + size]) for k in range(0, len(ys), size)]

        def model(s: int) -> nn.Module:
            torch.manual_seed(s)
            layers, width = [], X.shape[1]
            for h in hidden:
                layers += [nn.Linear(width, h), act()]
                width = h
            return nn.Sequential(*layers, nn.Linear(width, int(y.max() + 1)))

        return Task(name, model, batches(tr, batch), [], batches(te, 512), epochs, 1e-3, False, True)

    return make


def tiny_llama(seed: int) -> Task:
    from transformers import LlamaConfig, LlamaForCausalLM

    task = payoff.lm_task(seed, fast=False)

    def model(s: int) -> nn.Module:
        torch.manual_seed(s)
        cfg = LlamaConfig(
            vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return LlamaForCausalLM(cfg)

    task.name, task.make_model, task.train = "tiny_llama", model, task.train[:300]
    return task


TASKS: dict[str, Callable[[int], Task]] = {
    "wine": tabular("wine", [256, 256], nn.ReLU, 32, 40),
    "iris": tabular("iris", [64, 64], nn.Tanh, 16, 60),
    "digits_deep_gelu": tabular("digits_deep_gelu", [128, 128, 128], nn.GELU, 32, 20),
    "tiny_llama": tiny_llama,
}


def run(task: Task, seed: int, method: str) -> dict[str, float]:
    model = task.make_model(seed)
    if method == "AdamW":
        train(task, model, torch.optim.AdamW(model.parameters(), lr=task.adamw_lr, weight_decay=0.01), seed)
    else:
        extra = {"clip": "element"} if method == "EVON element" else {}
        opt = build_optimizer(model, learning_rate=task.adamw_lr, seed=seed, **extra)
        train(task, model, opt, seed, sampled=lambda: opt.sampled_params(train=True))
    return scores(*log_probs(model, task.test, task.shift))


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[dict[str, float]]]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    print("| task | " + " | ".join(f"{m} NLL (acc %)" for m in METHODS) + " |")
    print("|---|" + "---|" * len(METHODS))
    for name in args.tasks:
        rows = results.setdefault(name, {m: [] for m in METHODS})
        for seed in range(args.seeds):
            task = TASKS[name](seed)
            for method in METHODS:
                rows[method].append(run(task, seed, method))
        cells = [
            f"{np.mean([r['nll'] for r in rows[m]]):.3f} ({100 * np.mean([r['accuracy'] for r in rows[m]]):.1f})"
            for m in METHODS
        ]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return results


if __name__ == "__main__":
    main()
