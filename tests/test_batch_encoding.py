"""Batches as transformers' collators make them: ``BatchEncoding`` (a ``UserDict``, not a
``dict``), as ``DataCollatorWithPadding`` and the language-modelling collators return. Every
path must treat them as the plain dict they wrap."""

from __future__ import annotations

import torch
from test_trainer import classification_data, config, lm_data, params, tiny_bert, tiny_gpt2
from transformers import BatchEncoding

from hf_evon import EVONPosterior, EVONTrainer, build_optimizer, calibrate_posterior


def as_dict(features: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor([f[k] for f in features]) for k in features[0]}


def as_batch_encoding(features: list[dict]) -> BatchEncoding:
    return BatchEncoding(as_dict(features))


def test_calibrate_posterior_takes_batch_encodings():
    model = tiny_bert()
    data = classification_data(16)
    opt = build_optimizer(model, lr=0.02, ess=1e4, hess_init=1.0, seed=0)
    batch = as_dict([data[i] for i in range(16)])
    with opt.sampled_params(train=True):
        model(**batch).loss.backward()
    opt.step()
    model.eval()
    posterior = EVONPosterior.from_optimizer(opt, model)
    rows = [data[i] for i in range(16)]
    plain = [as_dict(rows[:8]), as_dict(rows[8:])]
    encoded = [as_batch_encoding(rows[:8]), as_batch_encoding(rows[8:])]
    _, a = calibrate_posterior(model, posterior, plain, grid=(1.0, 0.1), num_samples=2, seed=3)
    _, b = calibrate_posterior(model, posterior, encoded, grid=(1.0, 0.1), num_samples=2, seed=3)
    assert a.nll == b.nll and a.mean_nll == b.mean_nll and a.ess == b.ess


def test_trainer_counts_labels_and_calibrates_with_batch_encodings(tmp_path):
    """Gradient accumulation over micro-batches with different numbers of labelled tokens weights
    each by its share of the step's tokens: the same weights whichever collator type; and the
    trainer calibrates on BatchEncoding batches."""
    runs = {}
    for name, collator in (("dict", as_dict), ("encoding", as_batch_encoding)):
        trainer = EVONTrainer(
            model=tiny_gpt2(),
            args=config(tmp_path / name, max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2),
            train_dataset=lm_data(24),
            data_collator=collator,
        )
        trainer.train()
        result = trainer.calibrate(lm_data(8, seed=1), grid=(1.0, 0.1))
        runs[name] = (params(trainer.model), result)
    (wa, ca), (wb, cb) = runs["dict"], runs["encoding"]
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    assert ca.nll == cb.nll and ca.mean_nll == cb.mean_nll
