"""EVON in the ``transformers.Trainer`` family: one module per concern.

* :mod:`~hf_evon.trainer.config`: :class:`EVONConfig` (``TrainingArguments`` + EVON fields);
* :mod:`~hf_evon.trainer.combined`: :func:`evon_config_class` (the EVON fields on any other
  arguments class);
* :mod:`~hf_evon.trainer.mixin`: :class:`EVONTrainerMixin`, the training plumbing (optimizer,
  sampled training step, loss scaling, clipping, logs) for any ``Trainer`` subclass;
* :mod:`~hf_evon.trainer.checkpointing`: the posterior saved with the model, the best model's
  posterior, FSDP2 optimizer save/resume, pushed checkpoints;
* :mod:`~hf_evon.trainer.internals`: the only overrides of private ``Trainer`` methods, and why;
* :mod:`~hf_evon.trainer.statistics`: the ``evon/*`` statistics logged while training;
* :mod:`~hf_evon.trainer.schedule`: the learning-rate schedule and the logged rates, in ``learning_rate``'s
  units (AdamW's rate);
* :mod:`~hf_evon.trainer.evaluation`: metrics at the posterior mean and under BMA;
* :mod:`~hf_evon.trainer.calibration`: ``calibrate()``, the posterior's scale and temperature chosen on
  held-out data (``calibration_dataset``);
* :mod:`~hf_evon.trainer.prediction`: ``predict(test, bma=True)``, BMA predictions;
* :mod:`~hf_evon.trainer.trainers`: :class:`EVONTrainer`, :class:`EVONSeq2SeqTrainer`;
* :mod:`~hf_evon.trainer.adalora`: :class:`AdaLoraRankAllocation`, PEFT AdaLoRA's rank allocation after
  every optimizer step (every EVON trainer adds it; ``Trainer`` leaves it to the user);
* :mod:`~hf_evon.trainer.sft`: ``EVONSFTTrainer``/``EVONSFTConfig`` for TRL (imported on first use,
  needs ``trl``).

Change two names in a ``Trainer`` script::

    args = EVONConfig(output_dir="out", learning_rate=..., bma_num_samples=16)
    trainer = EVONTrainer(model=model, args=args, train_dataset=..., eval_dataset=...)
    trainer.train()
    trainer.evaluate()      # eval_mean_* at the posterior mean, eval_bma_* under BMA
    trainer.predict(test, bma=True)   # BMA-averaged probabilities
    trainer.save_model()    # model (or adapter) + evon_posterior.* + model card

Any other ``Trainer`` subclass: ``class MyTrainer(EVONTrainerMixin, SomeTrainer)``, with
``evon_config_class(SomeArguments)`` as its arguments.
"""

from typing import Any

from hf_evon.trainer.adalora import AdaLoraRankAllocation
from hf_evon.trainer.combined import evon_config_class, register_evon_config
from hf_evon.trainer.config import EVONConfig
from hf_evon.trainer.mixin import EVONTrainerMixin
from hf_evon.trainer.trainers import EVONSeq2SeqConfig, EVONSeq2SeqTrainer, EVONTrainer

__all__ = [
    "AdaLoraRankAllocation",
    "EVONConfig",
    "EVONSFTConfig",
    "EVONSFTTrainer",
    "EVONSeq2SeqConfig",
    "EVONSeq2SeqTrainer",
    "EVONTrainer",
    "EVONTrainerMixin",
    "evon_config_class",
    "register_evon_config",
]


def __getattr__(name: str) -> Any:
    if name in ("EVONSFTTrainer", "EVONSFTConfig"):
        try:
            from hf_evon.trainer import sft
        except ImportError as err:
            raise ImportError(
                f"hf_evon.trainer.{name} needs TRL: pip install 'hf-evon[trl]' ({err})"
            ) from err
        return getattr(sft, name)
    raise AttributeError(f"module 'hf_evon.trainer' has no attribute {name!r}")
