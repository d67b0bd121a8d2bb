"""``benchmarks/validation_sweep.py`` refuses a setting it cannot pass to ``train_evon``."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
validation_sweep = pytest.importorskip("validation_sweep")


@pytest.mark.parametrize("setting", ["[1, 2]", "0.9", '"element"', "{clip: element}"])
def test_a_setting_that_is_not_a_json_object_is_refused(setting: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        validation_sweep.main(["--tasks", "minilm_lora", "--settings", "{}", setting])
    assert exit_info.value.code == 2
    assert f"--settings: {setting!r} is neither a JSON object nor 'adamw'" in capsys.readouterr().err


def test_a_settings_prior_std_ratio_sets_the_default_prior_for_the_run_only() -> None:
    """``{"prior_std_ratio": r}``: δ₀ = h0·ρ0²/(r² − ρ0²) inside the run (so the noise level's
    ceiling r(∞) = r), the library's default again after it, also when the run fails."""
    from hf_evon.optim import defaults

    before = defaults.default_weight_decay()
    with validation_sweep.prior_std_ratio(0.5):
        assert defaults.default_weight_decay(0.01, 0.05) == 0.01 * 0.05**2 / (0.5**2 - 0.05**2)
        assert abs(defaults.noise_std_ratio(10**6) - 0.5) < 1e-12
    with pytest.raises(RuntimeError), validation_sweep.prior_std_ratio(0.125):
        raise RuntimeError
    with validation_sweep.prior_std_ratio(None):
        assert defaults.default_weight_decay() == before
    assert defaults.default_weight_decay() == before == 0.01 * 0.05**2 / (0.25**2 - 0.05**2)


def test_a_run_passes_prior_std_ratio_to_the_defaults_not_to_the_optimizer(monkeypatch) -> None:
    import payoff_tasks
    import payoff_training

    from hf_evon.optim import defaults

    seen = {}

    class Trained:
        def posterior_health(self, warn: bool) -> dict:
            return {"hess_below_prior": 0.25, "hess_init_share": 0.0}

    def train_evon(task, model, seed, **kwargs):
        seen.update(kwargs=kwargs, prior=defaults.default_weight_decay(0.01, 0.05))
        return Trained()

    monkeypatch.setattr(payoff_training, "train_evon", train_evon)
    monkeypatch.setattr(validation_sweep, "make_task", lambda name, seed: payoff_tasks.make_task("iris", seed, True, True))
    row = validation_sweep.run(("iris", 0, {"prior_std_ratio": 0.5, "lr": 0.1}))
    assert seen == {"kwargs": {"lr": 0.1}, "prior": 0.01 * 0.05**2 / (0.5**2 - 0.05**2)}
    assert row["setting"] == {"prior_std_ratio": 0.5, "lr": 0.1} and row["hess_below_prior"] == 0.25
    assert defaults.default_weight_decay(0.01, 0.05) == 0.01 * 0.05**2 / (0.25**2 - 0.05**2)
