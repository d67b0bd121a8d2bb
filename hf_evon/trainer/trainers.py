"""The EVON trainers: :class:`EVONTrainerMixin` on ``transformers.Trainer`` and ``Seq2SeqTrainer``."""

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer

from hf_evon.optim.noise import derived_seed, process_rank
from hf_evon.predictive.generation import generate_bma
from hf_evon.predictive.sample_strategy import STRATEGIES, SampleStrategy, checked_strategy
from hf_evon.trainer.combined import register_evon_config
from hf_evon.trainer.config import EVONConfig
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
    """``Seq2SeqTrainingArguments`` (``predict_with_generate``, generation settings) plus the EVON fields
    and ``bma_sample_strategy``, the setting of the one BMA pass that decodes (:func:`generate_bma`)."""

    # the Seq2Seq trainer's alone: evaluate()'s and predict(bma=True)'s sampled passes write each sample's
    # weights into the model (posterior.sampled), which is what "materialize" reproduces in a batch
    bma_sample_strategy: SampleStrategy | None = field(
        default=None,
        metadata={
            "help": "How BMA decoding (predict(bma=True) and evaluate(bma=True) under predict_with_generate) "
            "applies the samples, generate_bma's strategy: 'materialize' (per-sample weights, the tokens of a "
            "loop over the samples also in bfloat16), 'factored' or 'auto'. Default (None): generate_bma's "
            "default, 'auto'. The eval_bma_* token metrics write each sample into the model in turn, whatever this is."
        },
    )

    def _check_trainer_fields(self) -> None:
        super()._check_trainer_fields()
        try:  # generate_bma's own rule
            strategy = checked_strategy(self.bma_sample_strategy, "EVONSeq2SeqConfig")
        except ValueError:
            raise ValueError(
                f"EVONSeq2SeqConfig.bma_sample_strategy = {self.bma_sample_strategy!r} is invalid: it must be "
                f"None or one of {STRATEGIES} (or a SampleStrategy)"
            ) from None
        self.bma_sample_strategy = None if strategy is None else SampleStrategy(strategy)


register_evon_config(Seq2SeqTrainingArguments, EVONSeq2SeqConfig)


class EVONSeq2SeqTrainer(EVONTrainerMixin, Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with EVON: the posterior metrics of an encoder-decoder are
    token-level (``eval_mean_*``/``eval_bma_*`` over the decoder's label tokens)."""

    config_class = EVONSeq2SeqConfig

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        bma: bool = False,
        **gen_kwargs: Any,
    ) -> Any:
        """``Seq2SeqTrainer.predict`` (``gen_kwargs``: its generation settings). With ``bma=True``
        and ``predict_with_generate``, the ``predictions`` are decoded by :func:`generate_bma`
        (``bma_num_samples`` samples, those of seeds ``bma_seed + s`` that the token metrics average, the
        same for every batch; ``do_sample``'s tokens a stream of each batch's own) and your
        ``compute_metrics`` scores them; the loss is the mean's, as in ``Seq2SeqTrainer``, and the
        metrics add the labels' ``{prefix}_mean_*`` and ``{prefix}_bma_*`` token metrics. With
        ``bma=True`` and no generation: the averaged token probabilities (:mod:`hf_evon.trainer.prediction`)."""
        if not (bma and self.args.predict_with_generate):
            return super().predict(test_dataset, ignore_keys, metric_key_prefix, bma=bma, **gen_kwargs)
        with self._decoding_by_bma("predict(bma=True)"):
            self._evon_generated_prediction = True
            try:
                return super().predict(test_dataset, ignore_keys, metric_key_prefix, **gen_kwargs)
            finally:
                self._evon_generated_prediction = False

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        bma: bool = False,
        **gen_kwargs: Any,
    ) -> dict[str, float]:
        """``Seq2SeqTrainer.evaluate`` with the posterior metrics. ``bma=True`` under
        ``predict_with_generate``: your ``compute_metrics`` scores ids decoded by
        :func:`generate_bma`, as in ``predict(test, bma=True)``; the evaluations ``train()`` runs
        decode at the mean (BMA decoding costs S forwards a token). ``bma=True`` runs the BMA passes of
        the ``eval_bma_*`` token metrics also where ``bma_eval_every`` skips them, as
        ``EVONTrainer.evaluate(bma=True)`` does."""
        if not (bma and self.args.predict_with_generate):
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix, bma=bma, **gen_kwargs)
        with self._decoding_by_bma("evaluate(bma=True)"):
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix, bma=True, **gen_kwargs)

    @contextmanager
    def _decoding_by_bma(self, caller: str) -> Iterator[None]:
        """The block's ``generate`` decodes by :func:`generate_bma` (:func:`_generation_by_bma`) with the
        posterior of ``caller`` (:meth:`_bma_posterior`), held for the block: one posterior for decoding
        and the token metrics' passes."""
        posterior = self._bma_posterior(caller)
        args = self.args
        # a config of EVONConfig and Seq2SeqTrainingArguments declared outside EVONSeq2SeqConfig has no such field
        strategy = getattr(args, "bma_sample_strategy", None)
        with self._holding_posterior(posterior), _generation_by_bma(
            self.model, posterior, args.bma_num_samples, args.bma_seed, strategy
        ):
            yield


@contextmanager
def _generation_by_bma(
    model: nn.Module, posterior: Any, num_samples: int, seed: int, strategy: SampleStrategy | None = None
) -> Iterator[None]:
    """``model.generate`` routed to :func:`generate_bma` for the block: ``Seq2SeqTrainer``'s
    ``prediction_step`` (its generation settings, padding and loss) then runs unchanged. The
    batch's ``labels`` stay out of decoding, as ``generate`` ignores them. ``strategy``: generate_bma's.

    Every batch decodes with the same weight samples, those of seeds ``seed + s`` that the token metrics
    average; sampling (``do_sample``) draws its tokens from a stream of each batch's own (by its number in
    the block and the process's rank), so batches of the same prompts do not decode the same tokens."""
    batches = itertools.count()

    def generate(input_ids: Any = None, attention_mask: Any = None, **kwargs: Any) -> Any:
        kwargs.pop("labels", None)
        tokens = derived_seed(seed, "generation batch", process_rank(), next(batches))
        return generate_bma(
            model, posterior, input_ids, attention_mask=attention_mask, num_samples=num_samples, seed=seed,
            token_seed=tokens, strategy=strategy, **kwargs,
        )

    previous = model.__dict__.get("generate")  # an instance's own (a Hub repo's custom_generate)
    model.generate = generate
    try:
        yield
    finally:
        if previous is None:
            del model.generate
        else:
            model.generate = previous
