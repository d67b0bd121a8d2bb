"""``benchmarks/validation_sweep.py`` refuses a setting it cannot pass to ``train_evon``."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
validation_sweep = pytest.importorskip("validation_sweep")


@pytest.mark.parametrize(
    "setting",
    ["[1, 2]", "0.9", '"element"', "{clip: element}", "ivon", "ivon:", "ivon:fast", "ivon:0", "ivon:-0.1", "ivon:NaN",
     'ivon:{"ess": 1e7}', 'ivon:{"lr": 0.1, "beta2": 0.9}', 'ivon:{"lr": 0.1, "ess": 0}', 'ivon:{"lr": true}'],
)  # fmt: skip
def test_a_setting_that_is_not_a_json_object_is_refused(setting: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        validation_sweep.main(["--tasks", "minilm_lora", "--settings", "{}", setting])
    assert exit_info.value.code == 2
    message = f"--settings: {setting!r} is neither a JSON object, 'adamw' nor an ivon setting (ivon:<lr>)"
    assert message in capsys.readouterr().err


def test_an_ivon_setting_trains_ivon_opt_at_that_rate_and_scores_its_mean(monkeypatch) -> None:
    """``ivon:<lr>``: payoff's ivon-opt (ess = N) at that rate, the run's row scores the weights it
    leaves (its mean) on the calibration split, as it scores AdamW's."""
    pytest.importorskip("ivon")
    import payoff
    import payoff_tasks

    made = []

    def ivon_optimizer(ivon, model, n_train, **kwargs):
        made.append((n_train, kwargs))
        return ivon.IVON([p for p in model.parameters() if p.requires_grad], **{"ess": n_train, **kwargs})

    monkeypatch.setattr(payoff, "ivon_optimizer", ivon_optimizer)
    monkeypatch.setattr(validation_sweep, "make_task", lambda name, seed: payoff_tasks.make_task("iris", seed, True, True))
    task = payoff_tasks.make_task("iris", 0, True, True)
    row = validation_sweep.run(("iris", 0, "ivon:0.05"))
    other = validation_sweep.run(("iris", 0, 'ivon:{"lr": 0.05, "ess": 1e7, "hess_init": 0.01}'))
    n = payoff.training_targets(task)
    assert made == [(n, {"lr": 0.05}), (n, {"lr": 0.05, "ess": 1e7, "hess_init": 0.01})]
    assert row["setting"] == "ivon:0.05" and 0.0 <= row["accuracy"] <= 1.0 and row["nll"] > 0
    assert other["nll"] != row["nll"]  # the settings reach the optimizer
    assert "hess_below_prior" not in row  # ivon-opt reports no EVON health


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
