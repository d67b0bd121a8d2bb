"""Predictions under the posterior: BMA decoding and likelihoods, calibration, metrics, the
epistemic/aleatoric split of the predictive's entropy, and the log-probability helpers they share
(:mod:`hf_evon.predictive.logprobs`)."""

from hf_evon.predictive.calibration import CalibrationResult, calibrate_posterior, trained_posterior
from hf_evon.predictive.generation import BMALogLikelihood, bma_log_likelihood, generate_bma
from hf_evon.predictive.metrics import (
    accuracy,
    brier_score,
    calibration_metrics,
    expected_calibration_error,
    negative_log_likelihood,
)
from hf_evon.predictive.sample_strategy import SampleStrategy
from hf_evon.predictive.uncertainty import PredictiveSpread, PredictiveUncertainty, predictive_uncertainty

__all__ = [
    "BMALogLikelihood",
    "CalibrationResult",
    "PredictiveSpread",
    "PredictiveUncertainty",
    "SampleStrategy",
    "accuracy",
    "bma_log_likelihood",
    "brier_score",
    "calibrate_posterior",
    "calibration_metrics",
    "expected_calibration_error",
    "generate_bma",
    "negative_log_likelihood",
    "predictive_uncertainty",
    "trained_posterior",
]
