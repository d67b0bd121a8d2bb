"""Expected Calibration Error as an `evaluate` module, packaged with hf-evon (loads without network).

Load it with ``hf_evon.predictive.metrics.load_metric("expected_calibration_error")`` or ``evaluate.load(<path of this folder>)``.
The computation is ``hf_evon.predictive.metrics.expected_calibration_error`` (one implementation for the trainer and this module).
"""

import evaluate

from hf_evon.predictive import metrics as _metrics

_CITATION = """\
@inproceedings{guo2017calibration,
  title={On Calibration of Modern Neural Networks},
  author={Guo, Chuan and Pleiss, Geoff and Sun, Yu and Weinberger, Kilian Q.},
  booktitle={ICML},
  year={2017}
}
"""

_DESCRIPTION = """\
Top-label expected calibration error (Guo et al., 2017) with `n_bins` equal-width confidence bins:
ECE = sum_b (|B_b|/N) |acc(B_b) - conf(B_b)|, bins ((b-1)/n_bins, b/n_bins]. Lower is better; 0 is perfectly calibrated.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `list` of `float`): one row per item, shape (N, C): class probabilities
        (default), logits or log-probabilities, as given by `input_type`.
    references (`list` of `int`): the true class of each item; items equal to `ignore_index` are skipped.
    n_bins (`int`, defaults to 15): number of equal-width confidence bins.
    input_type (`str`, defaults to "probs"): "probs", "logits" or "log_probs".
    ignore_index (`int`, defaults to -100): references with this value are left out.
Returns:
    expected_calibration_error (`float`)
Examples:
    >>> metric = hf_evon.predictive.metrics.load_metric("expected_calibration_error")
    >>> metric.compute(predictions=[[0.9, 0.1], [0.2, 0.8]], references=[0, 0])
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class ExpectedCalibrationError(evaluate.Metric):
    def _info(self):
        return _metrics.evaluate_metric_info(_DESCRIPTION, _CITATION, _KWARGS_DESCRIPTION)

    def _compute(
        self, predictions, references, n_bins: int = 15, input_type: str = "probs", ignore_index: int = -100
    ):
        value = _metrics.expected_calibration_error(
            predictions, references, n_bins=n_bins, input_type=input_type, ignore_index=ignore_index
        )
        return {"expected_calibration_error": value}
