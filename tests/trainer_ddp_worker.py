"""Worker for tests/test_distributed.py: ``EVONTrainer`` as users launch it (torchrun, 2 CPU ranks).

One launch runs every flow (process start-up dominates the cost): gradient accumulation with
``evon_mc_samples=2``, plain and ``evon_shard=True``; resumes of one-process checkpoints on 2 ranks;
the posterior saved at the end (who writes it); ``evaluate`` with BMA on every rank. The test runs
the one-process references and compares. Usage: ``torchrun --nproc_per_node 2 trainer_ddp_worker.py
TESTS_DIR OUT_DIR``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[1] if __name__ == "__main__" else os.path.dirname(os.path.abspath(__file__)))
from test_trainer import config, lm_data, tiny_gpt2  # noqa: E402

from hf_evon import EVONTrainer  # noqa: E402

GLOBAL_BATCH, GA, STEPS = 8, 2, 4


def run_config(out: Path, world: int, shard: bool, **changes):
    """EVON with 2 samples per step over GA accumulated micro-batches; the global batch is
    GLOBAL_BATCH on every world size. Noisy runs are sharded, whose noise is the same on every world
    size, and keep identity bases (a tiny GPT-2's rank-deficient statistics make eigenbases that
    rounding may rotate)."""
    settings = dict(
        max_steps=STEPS,
        per_device_train_batch_size=GLOBAL_BATCH // (GA * world),
        gradient_accumulation_steps=GA,
        evon_mc_samples=2,
        evon_shard=shard,
        evon_clip="none",
        evon_precondition_frequency=1,
        evon_identity_basis=shard,
        evon_ess=1e4 if shard else float("inf"),
        save_strategy="steps",
        save_steps=2,
        bma_num_samples=2,
        ddp_backend="gloo" if world > 1 else None,
    )
    return config(out, **{**settings, **changes})


def train(out: Path, world: int, shard: bool, resume: str | None = None, **changes) -> EVONTrainer:
    model = tiny_gpt2().double()
    data = lm_data(GLOBAL_BATCH * STEPS)
    calibration = lm_data(12, seed=1) if shard else None  # noise to calibrate in the sharded runs only
    trainer = EVONTrainer(model=model, args=run_config(out, world, shard, **changes), train_dataset=data,
                          eval_dataset=data.select(range(10)), calibration_dataset=calibration)  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def weights(trainer: EVONTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def training_logs(trainer: EVONTrainer) -> list[dict]:
    """What the Trainer logged at each logging step (not the timings)."""
    return [{k: v for k, v in h.items() if k != "epoch"} for h in trainer.state.log_history if "loss" in h]


COLLECTIVES = ("all_gather_object", "all_gather", "all_reduce", "all_to_all_single", "broadcast",
               "broadcast_object_list", "barrier", "gather_object")  # fmt: skip


def alone(action) -> str | None:  # noqa: ANN001
    """Run ``action`` with torch.distributed's collectives raising (the other rank does not join):
    the error, or None."""
    import torch.distributed as dist

    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def refuse(name: str):  # noqa: ANN202
        def collective(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise RuntimeError(f"torch.distributed.{name} called by one rank alone")

        return collective

    for name in COLLECTIVES:
        setattr(dist, name, refuse(name))
    try:
        action()
    except RuntimeError as err:
        return str(err)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return None


def main(out: Path) -> None:
    import torch.distributed as dist

    from hf_evon.posterior.posterior import EVONPosterior

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    saves: list[str] = []
    save = EVONPosterior.save_pretrained

    def recorded(self, directory, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        saves.append(str(directory))
        return save(self, directory, *args, **kwargs)

    EVONPosterior.save_pretrained = recorded
    result: dict = {}
    for shard in (False, True):
        name = "shard" if shard else "plain"
        trainer = train(out / f"two_{name}", 2, shard)
        result[f"{name}_weights"] = weights(trainer)
        result[f"{name}_logs"] = training_logs(trainer)
        result[f"{name}_eval"] = trainer.evaluate(bma=True)
        result[f"{name}_calibration"] = None if trainer.calibration is None else vars(trainer.calibration)
        trainer.save_model()
        dist.barrier()
        result[f"{name}_files"] = sorted(os.listdir(trainer.args.output_dir))
        # one-process checkpoints (written by the test before the launch), resumed on 2 ranks
        resumed = train(out / f"resume_{name}", 2, shard, resume=str(out / f"one_{name}" / "out" / "checkpoint-2"))
        result[f"{name}_resumed"] = weights(resumed)
    result["saves"] = saves
    # `if trainer.is_world_process_zero(): trainer.save_model()` after a sharded run (fine with plain
    # Trainer under DDP): rank 0 alone must need no collective, which would wait for rank 1 for ever
    trainer = train(out / "rank0_save", 2, True, save_strategy="no")
    if rank == 0:
        result["rank0_save"] = alone(lambda: trainer.save_model(str(out / "rank0_save" / "final")))
    dist.barrier()
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()
    from launcher import finish  # ends the worker before gloo's destructors can abort or hang it

    finish()


if __name__ == "__main__":
    main(Path(sys.argv[2]))
