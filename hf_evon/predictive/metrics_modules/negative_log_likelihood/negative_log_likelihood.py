"""Negative Log-Likelihood as an `evaluate` module, packaged with hf-evon (loads without network).

Load it with ``hf_evon.predictive.metrics.load_metric("negative_log_likelihood")`` or ``evaluate.load(<path of this folder>)``.
The computation is ``hf_evon.predictive.metrics.negative_log_likelihood`` (one implementation for the trainer and this module).
"""

import evaluate

from hf_evon.predictive import metrics as _metrics

_CITATION = """\

"""

_DESCRIPTION = """\
Mean negative log-likelihood -log p(reference) (natural log) of the predicted class distributions. Lower is better.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `list` of `float`): one row per item, shape (N, C): class probabilities
        (default), logits or log-probabilities, as given by `input_type`.
    references (`list` of `int`): the true class of each item; items equal to `ignore_index` are skipped.
    input_type (`str`, defaults to "probs"): "probs", "logits" or "log_probs".
    ignore_index (`int`, defaults to -100): references with this value are left out.
Returns:
    negative_log_likelihood (`float`)
Examples:
    >>> metric = hf_evon.predictive.metrics.load_metric("negative_log_likelihood")
    >>> metric.compute(predictions=[[0.9, 0.1], [0.2, 0.8]], references=[0, 0])
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class NegativeLogLikelihood(evaluate.Metric):
    def _info(self):
        return _metrics.evaluate_metric_info(_DESCRIPTION, _CITATION, _KWARGS_DESCRIPTION)

    def _compute(self, predictions, references, input_type: str = "probs", ignore_index: int = -100):
        value = _metrics.negative_log_likelihood(
            predictions, references, input_type=input_type, ignore_index=ignore_index
        )
        return {"negative_log_likelihood": value}
