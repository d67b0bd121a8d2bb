"""The posterior beside a model: the object, its Gaussian maths, the file format, the Hub, the card."""

from hf_evon.posterior.config import (
    FORMAT_VERSION,
    POSTERIOR_CONFIG_NAME,
    POSTERIOR_WEIGHTS_NAME,
    PosteriorConfig,
    PosteriorMismatchError,
)
from hf_evon.posterior.fingerprint import PosteriorMeanWarning
from hf_evon.posterior.gaussian import MatrixFactors
from hf_evon.posterior.posterior import EVONPosterior

__all__ = [
    "FORMAT_VERSION",
    "POSTERIOR_CONFIG_NAME",
    "POSTERIOR_WEIGHTS_NAME",
    "EVONPosterior",
    "MatrixFactors",
    "PosteriorConfig",
    "PosteriorMeanWarning",
    "PosteriorMismatchError",
]
