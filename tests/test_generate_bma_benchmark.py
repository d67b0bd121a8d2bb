"""benchmarks/generate_bma.py: its naive baseline decodes as ``generate`` does."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
bench = pytest.importorskip("generate_bma")


@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_the_naive_loop_of_one_model_is_greedy_generate_and_passes_the_cache_as_the_model_names_it(
    arch: str,
) -> None:
    """With one model the per-sample loop's average is that model's distribution, so its tokens
    are greedy ``generate``'s. Its steps passed the cache as ``past_key_values``, which
    transformers 5.24's forwards take with a FutureWarning (to be removed) beside their ``cache``."""
    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=32))
    else:
        config = T5Config(
            vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0
        )
        model = T5ForConditionalGeneration(config)
    model.eval()
    ids = torch.randint(1, 32, (2, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = bench.naive_generate([model], ids, 4)
    expected = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False, num_beams=1
    )
    assert torch.equal(out, expected)
