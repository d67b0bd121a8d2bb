"""Worker for tests/test_fsdp2.py: ``EVONTrainer`` with the Trainer's FSDP2 arguments on CPUs.

The modes (``fsdp2``, ``held`` and ``reference`` are argv[2:], run in turn in one launch, each result
saved by ``launcher.run_scenarios``):

* ``refused``: accelerate (1.15) enables its FSDP plugin only for GPUs and other accelerators,
  not for ``MULTI_CPU`` (``accelerate/state.py``, ``AcceleratorState.__init__``: the branch
  listing ``MULTI_GPU``, ``MULTI_NPU``, ...): the Trainer would silently train plain DDP.
  EVONTrainer refuses before any step; each rank saves the error (:func:`refused`, a scenario of
  ``tests/fsdp2_edge_worker.py``).
* ``fsdp2``: the same arguments, with accelerate's decision patched *in this worker only*
  (:func:`enable_fsdp_on_cpu`) to what it does on GPUs: ``DistributedType.FSDP`` with the
  plugin. The Trainer and accelerate then take their own FSDP2 path unchanged
  (``fully_shard`` of each ``Linear`` and the root, the optimizer's parameters switched to the
  DTensors, ``prepare_distributed`` shards EVON over the mesh). Trains the float64 regressor
  of ``sharded_trainer_worker`` and calls ``save_model``.
* ``held``: the ``fsdp2`` arguments, a ``posterior=`` and AdamW (:func:`held`), under ``OUT_DIR/held``.
* ``reference``: one process, no FSDP, ``evon_shard=True`` (the noise semantics of sharded
  runs), the same global batch.

Each rank of ``fsdp2``/``reference`` saves the full weights, the set-up seen and the logs; the run
saves ``run/checkpoint-2`` (and ``checkpoint-3``) and ``save_model`` writes ``OUT_DIR/saved``;
``fsdp2`` then resumes a fresh trainer from ``checkpoint-2`` (into ``OUT_DIR/resumed``) to the end
and records its weights (or the error).
Usage: ``torch.distributed.run --nproc_per_node W fsdp2_trainer_worker.py OUT_DIR MODE...``.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sharded_trainer_worker as base  # noqa: E402
from fsdp2_worker import full_weights  # noqa: E402

from hf_evon import EVONConfig, EVONTrainer  # noqa: E402

STEPS, MAX_NORM = 3, 0.3  # the clipping binds at some steps


def enable_fsdp_on_cpu() -> None:
    """Make accelerate treat ``MULTI_CPU`` with an FSDP plugin as FSDP, as it does ``MULTI_GPU``.

    Mirrors the GPU branch of ``AcceleratorState.__init__`` (accelerate 1.15): set
    ``distributed_type = FSDP`` and ``fsdp_plugin``, and record the type in ``PartialState``'s
    shared state (every later ``AcceleratorState()`` copies it back from there).
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs) -> None:  # noqa: ANN001
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = self.distributed_type

    AcceleratorState.__init__ = patched


def config(out: str, world: int, mode: str, run: str = "run") -> EVONConfig:
    if mode == "reference":
        parallel = dict(evon_shard=True)
    else:  # the Trainer's own FSDP2 arguments (transformers 5.23 spelling; "fsdp_" prefixes are dropped)
        parallel = dict(
            fsdp="full_shard",
            fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["Linear"]},
            ddp_backend="gloo",
        )
    return base.trainer_config(
        os.path.join(out, run),
        world,
        max_steps=STEPS,
        save_strategy="no" if mode == "refused" else "steps",  # checkpoint-2 mid-run
        logging_steps=1,
        max_grad_norm=MAX_NORM,
        **parallel,
    )


def refused(out: str) -> dict:
    args = config(out, 2, "refused")
    trainer = EVONTrainer(model=base.Regressor(), args=args, train_dataset=base.data(STEPS))
    try:
        trainer.train()
        msg = f"trained {trainer.state.global_step} steps"
    except Exception as err:  # noqa: BLE001 - the test checks the type and message
        msg = f"{type(err).__name__}: {err}"
    return {"message": msg}


def save_into_refused(trainer: EVONTrainer, out: str) -> tuple[str | None, list[str]]:
    """``save_model`` on every rank into a directory that holds a directory under the posterior config's name
    (each rank makes it: one filesystem): the error this rank raised (None where it saved), and what the
    directory holds once every rank is through."""
    import torch.distributed as dist

    from hf_evon.posterior.config import POSTERIOR_CONFIG_NAME

    directory = os.path.join(out, "refused")
    os.makedirs(os.path.join(directory, POSTERIOR_CONFIG_NAME), exist_ok=True)
    try:
        trainer.save_model(directory)
        error = None
    except IsADirectoryError as err:
        error = str(err)
    if dist.is_initialized():
        dist.barrier()
    return error, sorted(os.listdir(directory))


def train(out: str, world: int, rank: int, mode: str) -> dict:
    from torch.distributed.fsdp import FSDPModule

    from hf_evon.distributed.fsdp2 import FSDP2Sharding

    trainer = EVONTrainer(
        model=base.Regressor(), args=config(out, world, mode), train_dataset=base.data(STEPS)
    )
    trainer.train()
    evon = trainer.evon_optimizer
    result = {
        "distributed_type": str(trainer.accelerator.state.distributed_type),
        "is_fsdp2": bool(trainer.accelerator.is_fsdp2),
        "fsdp_modules": sorted(n for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)),
        "sharding": type(evon.sharding).__name__,
        "fsdp2_sharding": isinstance(evon.sharding, FSDP2Sharding),
        "dtensor_params": sum(hasattr(p, "placements") for p in trainer.model.parameters()),
        "weights": full_weights(trainer.model),
        "log": trainer.state.log_history,
        "steps": trainer.state.global_step,
        "skipped": evon.skipped_steps,
    }
    trainer.save_model(os.path.join(out, "saved"))  # every rank: the Trainer gathers the weights
    result["refused"] = save_into_refused(trainer, out)  # every rank refuses, before the weights are gathered
    if mode == "fsdp2":  # a fresh 2-process trainer resumes from the mid-run checkpoint to the end
        again = EVONTrainer(
            model=base.Regressor(),
            args=config(out, world, mode, run="resumed"),
            train_dataset=base.data(STEPS),
        )
        try:
            again.train(resume_from_checkpoint=os.path.join(out, "run", "checkpoint-2"))
            result["resume"] = f"resumed to step {again.state.global_step}"
            result["resumed_weights"] = full_weights(again.model)
            result["resumed_log"] = again.state.log_history
            result["resumed_skipped"] = again.evon_optimizer.skipped_steps
        except Exception as err:  # noqa: BLE001 - the test checks the type and message
            result["resume"] = f"{type(err).__name__}: {err}"
    return result


def held(out: str, world: int) -> dict:
    """``posterior=`` (taken at the initial weights, with its ``mean_fingerprint``) and AdamW under the
    Trainer's FSDP2: after training each rank records whether ``current_posterior()`` still gives it."""
    import warnings

    from hf_evon import EVONPosterior, build_optimizer

    class AdamWTrainer(EVONTrainer):  # the Trainer refuses optimizers= under FSDP
        def create_optimizer(self, model=None):  # noqa: ANN001, ANN202
            if self.optimizer is None:
                self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
            return self.optimizer

    model = base.Regressor()
    posterior = EVONPosterior.from_optimizer(build_optimizer(model), model)
    trainer = AdamWTrainer(
        model=model, args=config(out, world, "fsdp2"), train_dataset=base.data(STEPS), posterior=posterior
    )
    before = trainer.current_posterior() is posterior
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
        after = trainer.current_posterior()
        unrefused = save_into_refused(trainer, out)  # no posterior to save: no rank refuses
    return {
        "before": before,
        "after": None if after is None else after is posterior,
        "unrefused": unrefused,
        "dtensor_params": sum(hasattr(p, "placements") for p in trainer.model.parameters()),
    }


def main(out: str, modes: list[str]) -> None:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if {"fsdp2", "held"}.intersection(modes):
        enable_fsdp_on_cpu()
    scenarios = {
        "fsdp2": lambda: train(out, world, rank, "fsdp2"),
        "reference": lambda: train(out, world, rank, "reference"),
        "held": lambda: held(os.path.join(out, "held"), world),
    }
    run_scenarios(out, rank, scenarios, modes)
    finish()  # exits here: no DDP or process-group destructor runs (launcher.finish)


from launcher import finish, run_scenarios  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    finish()
