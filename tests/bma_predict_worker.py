"""Worker for tests/test_trainer_evaluation.py: ``predict(bma=True)`` and ``evaluate()`` on W CPU processes.

Trains a small classifier for 2 steps, then predicts 20 rows in batches of 4 per process (with two
processes the last global batch holds 4 rows and 4 duplicates that must be dropped), once in one
chunk of batches and once in chunks of one batch (``SAMPLE_PASS_CHUNK_BYTES = 1``), and evaluates
the same rows both ways; then predicts with chunks each process would size differently. Rank 0
saves the outputs, the metrics, ``predict_uncertainty``'s entropies and the BMA probabilities and
entropies computed directly from the posterior's samples.
Usage: ``torch.distributed.run --nproc_per_node W bma_predict_worker.py OUT_DIR``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launcher import finish  # noqa: E402

from hf_evon import EVONConfig, EVONTrainer  # noqa: E402
from hf_evon.predictive.uncertainty import predictive_uncertainty  # noqa: E402
from hf_evon.trainer import sampled_passes  # noqa: E402

ROWS, SEEDS = 20, (3, 4)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
        logits = self.net(x)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


def data(n: int, seed: int) -> Dataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen)
    return Dataset.from_dict({"x": x.tolist(), "labels": (x[:, 0] > 0).long().add(x[:, 1] > 0).tolist()})


def main(out: str) -> None:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = EVONConfig(
        output_dir=out, report_to="none", use_cpu=True, ddp_backend="gloo" if world > 1 else None,
        per_device_train_batch_size=8, per_device_eval_batch_size=4, max_steps=2, evon_ess=60.0,
        bma_num_samples=len(SEEDS), bma_seed=SEEDS[0], save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = EVONTrainer(model=Classifier(), args=args, train_dataset=data(32, seed=1))
    trainer.train()
    test = data(ROWS, seed=2)
    whole, metrics = trainer.predict(test, bma=True), trainer.evaluate(test)
    uncertainty = trainer.predict_uncertainty(test)
    sampled_passes.SAMPLE_PASS_CHUNK_BYTES = 1
    chunked, chunked_metrics = trainer.predict(test, bma=True), trainer.evaluate(test)
    # processes that size their chunks differently (rank 0 one batch, the others three) must agree
    # on one size: their gathers are collectives that pair up in order
    rank = int(os.environ.get("RANK", "0"))
    sampled_passes.SAMPLE_PASS_CHUNK_BYTES = 3000
    sampled_passes._nbytes = lambda value: 1500 if rank == 0 else 500  # per call: inputs, then averages
    uneven = trainer.predict(test, bma=True)
    model, posterior = trainer.model, trainer.current_posterior()
    x, probs = torch.tensor(test["x"]), []
    with torch.no_grad():
        for seed in SEEDS:
            with posterior.sampled(model, seed=seed):
                probs.append(torch.softmax(model(x)["logits"].double(), -1))
    direct = torch.stack(probs).mean(0)
    direct_uncertainty = predictive_uncertainty(torch.stack(probs).log())
    if rank == 0:
        torch.save(
            {"whole": whole, "chunked": chunked, "uneven": uneven, "direct": direct, "labels": test["labels"],
             "evaluate": metrics, "evaluate_chunked": chunked_metrics, "uncertainty": uncertainty,
             "direct_uncertainty": direct_uncertainty},
            os.path.join(out, "rank0.pt"),
        )
    if dist.is_initialized():
        dist.barrier()
        finish()  # exits here: no DDP or process-group destructor runs (launcher.finish)


if __name__ == "__main__":
    main(sys.argv[1])
    finish()
