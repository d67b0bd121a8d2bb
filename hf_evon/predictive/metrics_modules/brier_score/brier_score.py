"""Brier Score as an `evaluate` module, packaged with hf-evon (loads without network).

Load it with ``hf_evon.predictive.metrics.load_metric("brier_score")`` or ``evaluate.load(<path of this folder>)``.
The computation is ``hf_evon.predictive.metrics.brier_score`` (one implementation for the trainer and this module).
"""

import evaluate

from hf_evon.predictive import metrics as _metrics

_CITATION = """\
@article{brier1950verification,
  title={Verification of forecasts expressed in terms of probability},
  author={Brier, Glenn W.},
  journal={Monthly Weather Review},
  volume={78},
  number={1},
  pages={1--3},
  year={1950}
}
"""

_DESCRIPTION = """\
Multi-class Brier score: the mean over items of sum_c (p_c - onehot_c)^2, in [0, 2]. Lower is better.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `list` of `float`): one row per item, shape (N, C): class probabilities
        (default), logits or log-probabilities, as given by `input_type`.
    references (`list` of `int`): the true class of each item; items equal to `ignore_index` are skipped.
    input_type (`str`, defaults to "probs"): "probs", "logits" or "log_probs".
    ignore_index (`int`, defaults to -100): references with this value are left out.
Returns:
    brier_score (`float`)
Examples:
    >>> metric = hf_evon.predictive.metrics.load_metric("brier_score")
    >>> metric.compute(predictions=[[0.9, 0.1], [0.2, 0.8]], references=[0, 0])
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class BrierScore(evaluate.Metric):
    def _info(self):
        return _metrics.evaluate_metric_info(_DESCRIPTION, _CITATION, _KWARGS_DESCRIPTION)

    def _compute(self, predictions, references, input_type: str = "probs", ignore_index: int = -100):
        value = _metrics.brier_score(
            predictions, references, input_type=input_type, ignore_index=ignore_index
        )
        return {"brier_score": value}
