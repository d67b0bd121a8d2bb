"""Worker for tests/test_trainer_evaluation.py: a token classifier's ``predict(bma=True)`` on W CPU processes.

Trains a tiny BERT token classifier for 2 steps, then predicts 10 sentences of 3 to 13 tokens in
batches of 2 per process, padded by ``DataCollatorForTokenClassification`` to each batch's longest (so
the processes' batches differ in width), with and without a ``preprocess_logits_for_metrics`` that
keeps the argmax (B, T); then a tiny BERT question answerer's start and end probabilities (B, T each)
of the same sentences, padded by ``DataCollatorWithPadding``. Each rank saves the three outputs: one
launch serves the token classifier's test and the question answerer's.
Usage: ``torch.distributed.run --nproc_per_node W token_bma_worker.py OUT_DIR``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from datasets import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launcher import save_and_finish  # noqa: E402
from test_trainer_evaluation import _word_tokenizer  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForQuestionAnswering,
    BertForTokenClassification,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
)

from hf_evon import EVONConfig, EVONTrainer  # noqa: E402


def rows(n: int, seed: int) -> list[dict[str, list[int]]]:
    gen, out = torch.Generator().manual_seed(seed), []
    for i in range(n):
        ids = torch.randint(3, 100, (3 + (i * 5) % 11,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": [t % 4 if t % 5 else -100 for t in ids]})  # -100: sub-words
    return out


def answers(n: int, seed: int) -> list[dict[str, Any]]:
    """``rows``' sentences, each answered by its tokens 1 to its last."""
    return [{"input_ids": r["input_ids"], "start_positions": 1, "end_positions": len(r["input_ids"]) - 1}
            for r in rows(n, seed)]  # fmt: skip


def main(out: str) -> None:
    torch.set_num_threads(1)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=4,
    )  # fmt: skip
    args = EVONConfig(
        output_dir=out, report_to="none", use_cpu=True, ddp_backend="gloo" if world > 1 else None,
        per_device_train_batch_size=4, per_device_eval_batch_size=2, max_steps=2, evon_ess=60.0,
        bma_num_samples=2, bma_seed=3, save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = EVONTrainer(
        model=BertForTokenClassification(config), args=args, train_dataset=Dataset.from_list(rows(16, 0)),
        data_collator=DataCollatorForTokenClassification(_word_tokenizer()),
    )  # fmt: skip
    trainer.train()
    test = Dataset.from_list(rows(10, 1))
    probabilities = trainer.predict(test, bma=True)
    trainer.preprocess_logits_for_metrics = lambda logits, labels: logits.argmax(-1)
    argmax = trainer.predict(test, bma=True)
    torch.manual_seed(0)
    config.num_labels = 2  # a start and an end logit per token
    answerer = EVONTrainer(
        model=BertForQuestionAnswering(config), args=args, train_dataset=Dataset.from_list(answers(16, 0)),
        data_collator=DataCollatorWithPadding(_word_tokenizer()),
    )  # fmt: skip
    answerer.train()
    answered = answerer.predict(Dataset.from_list(answers(10, 1)), bma=True)
    save_and_finish({"probabilities": probabilities, "argmax": argmax, "answers": answered}, out, rank)  # exits


if __name__ == "__main__":
    main(*sys.argv[1:])
