"""benchmarks/generate_bma.py: its naive baseline decodes as ``generate`` does."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from conftest import entered_strategies
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


def test_the_strategy_reaches_every_timed_call_and_leaves_the_library_default_as_it_is(monkeypatch, capsys) -> None:
    """``--strategy`` set the module global ``batched_samples.DEFAULT_STRATEGY`` for the process, the
    default of every later ``generate_bma`` call in it; it is passed to the calls the benchmark times
    (``generate_bma`` and the draw alone) instead: each block they enter has it, and the default stays."""
    import hf_evon.predictive.batched_samples as batched

    monkeypatch.setattr(batched, "DEFAULT_STRATEGY", "auto")  # restored after the test, whatever main() did
    entered = entered_strategies(monkeypatch)
    argv = ["generate_bma.py", "--device", "cpu", "--small", "--new-tokens", "1", "--prompt-len", "4", "--samples", "2",
            "--batch-sizes", "1", "--repeats", "1", "--no-naive", "--strategy", "materialize"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    assert "strategy=materialize" in capsys.readouterr().out
    # generate_bma's and draw_only's, each warmed up and timed once, and draw_only's count
    assert [strategy for strategy, _ in entered] == ["materialize"] * 5
    assert batched.DEFAULT_STRATEGY == "auto"
