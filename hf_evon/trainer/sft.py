"""EVON for TRL's ``SFTTrainer`` (needs ``pip install hf-evon[trl]``).

``EVONSFTTrainer`` trains with EVON and keeps everything of ``SFTTrainer``: dataset preparation
and packing, its loss (the fused LM head), its logged metrics (``mean_token_accuracy``,
``entropy``, ``num_tokens``), ``peft_config``. ``EVONSFTConfig`` is ``SFTConfig``, its defaults
included, plus the EVON fields; ``learning_rate`` is, as everywhere in hf-evon, the rate you
would give AdamW (TRL's default), from which EVON derives its own step size.
"""

from typing import Any

from trl import SFTConfig, SFTTrainer

from hf_evon.trainer.combined import evon_config_class
from hf_evon.trainer.mixin import EVONTrainerMixin

__all__ = ["EVONSFTConfig", "EVONSFTTrainer"]

# SFTConfig's fields and defaults (its rate included) plus every EVON field of EVONConfig
EVONSFTConfig = evon_config_class(SFTConfig)


class EVONSFTTrainer(EVONTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` with EVON (``args``: an :class:`EVONSFTConfig`).

    The mean metrics of ``evaluate()`` are read from ``SFTTrainer``'s own evaluation pass (its
    per-token log-probabilities), so an evaluation costs ``1 + bma_num_samples`` passes.
    ``calibration_dataset`` (and a dataset passed to ``calibrate``) is prepared as TRL prepares
    an eval set, raw text included, as its own ``evaluate`` does for a dataset passed to it (through
    TRL's private members: :mod:`hf_evon.trainer.internals`).
    """

    config_class = EVONSFTConfig
    # what SFTTrainer.compute_loss sets on every batch; the BMA and calibration passes set it too, so that
    # they read a packed row's sequences apart, as the loss does, whatever config.use_cache says
    _evon_loss_forward_kwargs = {"use_cache": False}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calibration_dataset = self._prepared_for_calibration(self.calibration_dataset)

    def calibrate(self, dataset: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._refuse_eval_set(dataset)  # before preparing: the prepared dataset is another object
        return super().calibrate(self._prepared_for_calibration(dataset), *args, **kwargs)

    def _prepared_for_calibration(self, dataset: Any) -> Any:
        return self._trl_prepared_eval_dataset(dataset, "calibration")  # TRL's private preparation
