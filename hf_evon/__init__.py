"""hf-evon: EVON's structured Gaussian weight posteriors for the Hugging Face stack."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> submodule; imported lazily so `import hf_evon` stays light
_PUBLIC = {
    "EVON": "optim",
    "NonFiniteGradientError": "optim",
    "build_optimizer": "optim",
    "RECIPES": "optim",
    "calibrate_posterior": "predictive",
    "build_param_groups": "optim",
    "describe_param_groups": "optim",
    "EVONPosterior": "posterior",
    "PosteriorMismatchError": "posterior",
    "EVONConfig": "trainer",
    "EVONTrainer": "trainer",
    "EVONTrainerMixin": "trainer",
    "EVONSeq2SeqTrainer": "trainer",
    "generate_bma": "predictive",
    "bma_log_likelihood": "predictive",
    "prepare_distributed": "distributed",
    "check_ranks_in_sync": "distributed",
    "UnsupportedParallelismError": "distributed",
    "accuracy": "predictive",
    "brier_score": "predictive",
    "expected_calibration_error": "predictive",
    "negative_log_likelihood": "predictive",
    "predictive_uncertainty": "predictive",
    "PredictiveUncertainty": "predictive",
    "PredictiveSpread": "predictive",
    "SampleStrategy": "predictive",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    raise AttributeError(f"module 'hf_evon' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
