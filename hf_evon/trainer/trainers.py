"""The EVON trainers: :class:`EVONTrainerMixin` on ``transformers.Trainer`` and ``Seq2SeqTrainer``."""

from dataclasses import dataclass

from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer

from hf_evon.trainer.config import EVONConfig, register_evon_config
from hf_evon.trainer.mixin import EVONTrainerMixin

__all__ = ["EVONSeq2SeqConfig", "EVONSeq2SeqTrainer", "EVONTrainer"]


class EVONTrainer(EVONTrainerMixin, Trainer):
    """``transformers.Trainer`` that trains with EVON and evaluates/saves the weight posterior.

    Use it as ``Trainer``, with an :class:`EVONConfig` as ``args``; see
    :class:`EVONTrainerMixin` for the extra arguments (``peft_config``, ``posterior``).
    """

    config_class = EVONConfig


@dataclass
class EVONSeq2SeqConfig(EVONConfig, Seq2SeqTrainingArguments):
    """``Seq2SeqTrainingArguments`` (``predict_with_generate``, generation settings) plus the EVON fields."""


register_evon_config(Seq2SeqTrainingArguments, EVONSeq2SeqConfig)


class EVONSeq2SeqTrainer(EVONTrainerMixin, Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with EVON: the posterior metrics of an encoder-decoder are
    token-level (``eval_mean_*``/``eval_bma_*`` over the decoder's label tokens)."""

    config_class = EVONSeq2SeqConfig
