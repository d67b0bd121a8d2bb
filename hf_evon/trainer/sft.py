"""EVON for TRL's ``SFTTrainer`` (needs ``pip install hf-evon[trl]``).

``EVONSFTTrainer`` trains with EVON and keeps everything of ``SFTTrainer``: dataset preparation
and packing, its loss (the fused LM head), its logged metrics (``mean_token_accuracy``,
``entropy``, ``num_tokens``), ``peft_config``. ``EVONSFTConfig`` is ``SFTConfig`` plus the EVON
fields (``learning_rate`` is EVON's α).
"""

from dataclasses import dataclass

from trl import SFTConfig, SFTTrainer

from hf_evon.trainer.config import EVONConfig, register_evon_config
from hf_evon.trainer.mixin import EVONTrainerMixin

__all__ = ["EVONSFTConfig", "EVONSFTTrainer"]


@dataclass
class EVONSFTConfig(EVONConfig, SFTConfig):
    """``SFTConfig`` plus every EVON field of :class:`~hf_evon.EVONConfig` (``learning_rate`` is EVON's α)."""


register_evon_config(SFTConfig, EVONSFTConfig)


class EVONSFTTrainer(EVONTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` with EVON (``args``: an :class:`EVONSFTConfig`).

    The mean metrics of ``evaluate()`` are read from ``SFTTrainer``'s own evaluation pass (its
    per-token log-probabilities), so an evaluation costs ``1 + bma_num_samples`` passes.
    """

    config_class = EVONSFTConfig
