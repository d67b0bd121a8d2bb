"""The paper scripts (examples/paper) in their --fast mode, plus the Gaussian algebra they use.

Each script must write its PNG, markdown table and JSON, and its numbers must have the
properties the experiment is about (a Gaussian's KL to itself is 0, nothing beats the optimal
full Gaussian's objective, EVON's fit beats IVON's where the posterior is correlated, ...).
The committed results (examples/paper/results) must carry the hash of the settings each script
runs with now, the library's defaults included, so a changed default cannot leave them stale.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

PAPER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "paper")
sys.path.insert(0, PAPER_DIR)

pytest.importorskip("matplotlib")
pytest.importorskip("scipy")
pytest.importorskip("sklearn")

import _common  # noqa: E402

F64 = torch.float64


def run_fast(module_name: str, out_dir: str, *extra: str) -> dict:
    """Run a script's fast mode; check the three files exist and agree; return the JSON."""
    module = __import__(module_name)
    record = module.run(["--fast", "--out-dir", out_dir, "--seed", "0", *extra])
    for ext in ("png", "md", "json"):
        path = os.path.join(out_dir, f"{module.NAME}.{ext}")
        assert os.path.getsize(path) > 0, path
    with open(os.path.join(out_dir, f"{module.NAME}.png"), "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(out_dir, f"{module.NAME}.json")) as fh:
        saved = json.load(fh)
    assert saved["experiment"] == module.NAME and saved["fast"] is True and saved["seed"] == 0
    assert set(saved) >= {"settings", "results", "wall_s", "torch", "script"}
    with open(os.path.join(out_dir, f"{module.NAME}.md")) as fh:
        md = fh.read()
    assert f"examples/paper/{module.NAME}.py --fast" in md  # the numbers carry their source
    assert record["results"].keys() == saved["results"].keys()
    return saved


# ----------------------------------------------------------------------------- Gaussian algebra
def random_spd(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=F64)
    return a @ a.T + 0.5 * torch.eye(d, dtype=F64)


def test_gaussian_kl_matches_torch_distributions() -> None:
    mu0, mu1 = torch.tensor([0.3, -1.0, 2.0], dtype=F64), torch.tensor([1.0, 0.5, -0.2], dtype=F64)
    c0, c1 = random_spd(3, 0), random_spd(3, 1)
    expected = torch.distributions.kl_divergence(
        torch.distributions.MultivariateNormal(mu0, c0), torch.distributions.MultivariateNormal(mu1, c1)
    )
    assert _common.gaussian_kl(mu0, c0, mu1, c1) == pytest.approx(float(expected), rel=1e-10)
    assert _common.gaussian_kl(mu0, c0, mu0, c0) == pytest.approx(0.0, abs=1e-12)


def test_w2_to_gaussian_of_exact_quantiles_and_shift() -> None:
    n = 400
    u = (torch.arange(n, dtype=F64) + 0.5) / n
    quantiles = 1.5 + 0.7 * math.sqrt(2) * torch.erfinv(2 * u - 1)
    assert _common.w2_to_gaussian(quantiles, 1.5, 0.7) == pytest.approx(0.0, abs=1e-12)
    # a shift by c moves every quantile by c: W2 = c exactly
    assert _common.w2_to_gaussian(quantiles + 0.25, 1.5, 0.7) == pytest.approx(0.25, rel=1e-12)


def test_logistic_objective_expected_loss_matches_monte_carlo() -> None:
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(30, 3, generator=g, dtype=F64), torch.sign(torch.randn(30, generator=g, dtype=F64))
    obj = _common.LogisticObjective(X, y, ess=30.0, delta=0.1)
    mu, cov = torch.tensor([0.5, -0.2, 1.0], dtype=F64), random_spd(3, 2) * 0.1
    kl = torch.distributions.kl_divergence(
        torch.distributions.MultivariateNormal(mu, cov),
        torch.distributions.MultivariateNormal(torch.zeros(3, dtype=F64), torch.eye(3, dtype=F64) / 3.0),
    )
    W = torch.distributions.MultivariateNormal(mu, cov).sample((200_000,))
    expected_loss = torch.nn.functional.softplus(-(W @ X.T) * y).mean()
    assert float(obj(mu, cov)) == pytest.approx(float(30.0 * expected_loss + kl), rel=2e-3)


# ----------------------------------------------------------------------------- the scripts
def test_fig1_left_fast(tmp_path) -> None:
    res = run_fast("fig1_left", str(tmp_path))["results"]
    assert res["optimal full Gaussian"]["kl_to_optimum"] == pytest.approx(0.0, abs=1e-12)
    full = res["optimal full Gaussian"]["objective"]
    for name in ("optimal diagonal Gaussian", "EVON", "IVON"):
        assert res[name]["objective"] >= full - 1e-9  # the optimum is the floor
    # a diagonal Gaussian cannot beat the optimal diagonal one
    assert res["IVON"]["objective"] >= res["optimal diagonal Gaussian"]["objective"] - 1e-9
    assert res["EVON"]["kl_to_optimum"] < res["IVON"]["kl_to_optimum"]
    ivon_cov = torch.tensor(res["IVON"]["cov"])
    assert ivon_cov[0, 1] == 0.0  # IVON mode is diagonal
    assert float(torch.tensor(res["EVON"]["cov"])[0, 1]) < 0.0  # EVON found the (negative) correlation


def test_fig2_logreg_fast(tmp_path) -> None:
    res = run_fast("fig2_logreg", str(tmp_path))["results"]
    assert res["optimal_diagonal"] > res["optimal_full"]
    for method in ("EVON", "IVON"):
        curve = res["curves"][method]
        assert curve["steps"][-1] == 1500 and len(curve["steps"]) == len(curve["objective"]) == 15
        assert min(curve["objective"]) >= res["optimal_full"] - 1e-6
    assert min(res["curves"]["IVON"]["objective"]) >= res["optimal_diagonal"] - 1e-6


def test_fig3a_mlp_fast(tmp_path) -> None:
    res = run_fast("fig3a_mlp", str(tmp_path))["results"]
    assert set(res) == {"small EVON", "small IVON", "large EVON", "large IVON"}
    for r in res.values():
        assert r["finite"] and r["std_away"] > 0 and r["std_near"] > 0
        # the element clip bounds every entry's move by α·r, so no measured move exceeds it
        assert 0 <= 0.99 * r["share_at_bound"] <= r["mean_move_over_bound"] <= 1 + 1e-5
        assert 0 <= r["saturated_at_data"] <= 1


def test_fig3b_iris_fast(tmp_path) -> None:
    pytest.importorskip("pyro")
    saved = run_fast("fig3b_iris", str(tmp_path))
    res = saved["results"]
    assert len(res["per_weight"]["EVON"]["w2"]) == len(res["per_weight"]["IVON"]["std_ratio"]) == 15
    assert all(r > 0 for m in ("EVON", "IVON") for r in res["per_weight"][m]["std_ratio"])
    # the paper's point, already visible after a short run: the diagonal posterior is narrower
    assert res["summary"]["IVON"]["median_std_ratio"] < res["summary"]["EVON"]["median_std_ratio"]


def test_fig4_gpt_fast(tmp_path) -> None:
    pytest.importorskip("tokenizers")
    saved = run_fast("fig4_gpt", str(tmp_path))
    res, vocab = saved["results"], saved["settings"]["vocab_size"]
    learned = {"EVON defaults", "IVON defaults", "EVON defaults, lr 3e-3", "IVON defaults, lr 3e-3"}
    assert set(res["final_loss"]) == {"AdamW", "SOAP", "IVON", "EVON"} | learned
    for loss in res["final_loss"].values():
        assert loss < math.log(vocab)  # every run learned something: below the uniform predictor
    assert set(res["bma_gain_pct"]) == {"EVON", "IVON"} | learned and len(res["claims"]) == 4
    for m, curve in res["bma_loss"].items():
        mean = res["final_loss"][m]
        for k, v in curve.items():
            assert res["bma_gain_pct"][m][k] == pytest.approx(100 * (mean - v) / mean)
    # the learned runs are the library's defaults; the paper's runs its algorithm
    groups = {m: saved["settings"]["optimizers"][m]["groups"][0] for m in ("EVON", "EVON defaults")}
    assert groups["EVON defaults"]["hess_estimator"] == "fisher" and groups["EVON defaults"]["ess"] == "auto"
    assert groups["EVON"]["hess_estimator"] == "price" and groups["EVON"]["snr_scaling"] is False
    assert saved["settings"]["optimizers"]["IVON defaults"]["groups"][0]["identity_basis"] is True
    rates = {m: saved["settings"]["optimizers"][m]["groups"][0]["lr"] for m in learned}
    assert rates["EVON defaults, lr 3e-3"] == pytest.approx(3 * rates["EVON defaults"])  # α follows the rate
    assert set(res["learned"]) == learned
    for r in res["learned"].values():
        assert set(r["health"]) >= {"hess_below_prior", "hess_init_share"}
        for cal in r["calibrations"].values():
            assert float(cal["ess_factor"]) > 0 and len(cal["bma_gain_pct"]) == 3


def test_table3_ablation_fast(tmp_path) -> None:
    pytest.importorskip("tokenizers")
    res = run_fast("table3_ablation", str(tmp_path))["results"]
    assert set(res["variants"]) == {"Plain", "Clip", "Whiten"}
    for r in res["variants"].values():
        assert r["bma_change_pct"] == pytest.approx(
            100 * (r["loss_bma"] - r["loss_at_mean"]) / r["loss_at_mean"]
        )


def test_table2_finetune_fast(tmp_path) -> None:
    """The search keeps the candidate of least calibration NLL, and its rows are that run's rows."""
    import table2_finetune as t2

    saved = run_fast("table2_finetune", str(tmp_path), "--methods", "adamw", "evon")
    settings, res = saved["settings"], saved["results"]
    assert settings["lr_multipliers"] == t2.lr_draws(1) and 0.1 <= settings["lr_multipliers"][0] <= 10
    with open(tmp_path / "table2_finetune.partial.json") as fh:
        done = {tuple(j): rows for j, rows in t2.restore_floats(json.load(fh))["done"]}
    task, draw = "docstring_topic/lora", settings["lr_multipliers"][0]
    assert set(done) == {(task, 0, m, x) for m in ("adamw", "evon") for x in (1.0, draw)}
    for method, row in (("adamw", "AdamW"), ("evon", "EVON mean")):
        nll = {x: done[(task, 0, method, x)][t2.SELECTION_ROW[method]]["cal_nll"] for x in (1.0, draw)}
        best = min(nll, key=nll.get)
        assert res["chosen"][f"{task} {method}"] == best
        chosen_run = done[(task, 0, method, best)]
        for key in ("nll", "ece", "accuracy"):  # one seed: the mean is the run's value, the sd 0
            assert res["summary"][task][f"{row} [tuned]"][key] == [chosen_run[row][key], 0.0]
            assert res["summary"][task][row][key] == [done[(task, 0, method, 1.0)][row][key], 0.0]
    assert "EVON calibrated BMA@4" in res["summary"][task]


def test_table2_text_data_is_balanced_disjoint_and_deterministic() -> None:
    import table2_finetune as t2

    data = t2.text_data(t2.TEXT_TASKS, (5, 4))
    assert data["reference_topic"] == t2.text_data(["reference_topic"], (5, 4))["reference_topic"]
    for task, d in data.items():
        k = len(d["classes"])
        assert [y for _, y in d["train"]].count(0) == 5 and len(d["train"]) == 5 * k, task
        assert sorted(y for _, y in d["held"]) == sorted(list(range(k)) * 4), task
        texts = [t for t, _ in d["train"] + d["held"]]
        assert len(set(texts)) == len(texts), task  # no text twice: not in two classes, not in both splits


def test_table2_search_choice_and_json_round_trip() -> None:
    import table2_finetune as t2

    def rows(nll: float) -> dict:
        return {t2.SELECTION_ROW["adamw"]: {"cal_nll": nll}}

    done = {
        ("a", 0, "adamw", 1.0): rows(0.9),
        ("a", 0, "adamw", 0.5): rows(0.7),
        ("a", 0, "adamw", 2.0): rows(math.nan),
    }
    assert t2.chosen_multiplier(done, "a", "adamw", 0, [0.5, 2.0]) == 0.5
    # the draws: one in each quarter of [1/10, 10]'s log range
    assert sorted(math.floor(2 * (math.log10(x) + 1)) for x in t2.lr_draws(4)) == [0, 1, 2, 3]
    assert t2.chosen_multiplier(done, "a", "adamw", 0, [0.5, 2.0, 3.0]) is None  # a candidate did not run
    done[("a", 0, "adamw", 0.5)] = rows(0.9)  # a tie: the default stays
    assert t2.chosen_multiplier(done, "a", "adamw", 0, [0.5, 2.0]) == 1.0
    x = {"a": [math.inf, -math.inf, 1.5, "text"], "b": {"c": math.nan}}
    back = t2.restore_floats(json.loads(json.dumps(_common.jsonable(x))))
    assert (
        back["a"][:3] == [math.inf, -math.inf, 1.5] and back["a"][3] == "text" and math.isnan(back["b"]["c"])
    )


def test_table2_a_method_whose_package_is_missing_has_no_search_choice() -> None:
    """A peer whose package is not installed (ivon-opt, pytorch-optimizer: the ``benchmarks``
    extra, not the ``paper`` one the README installs) returns its reason instead of rows, as in
    benchmarks/payoff.py. The default ``--fast`` run trained every method and then stopped on
    ``KeyError: '_selection IVON (ivon-opt)'``; the method gets no tuned rows and keeps its reason."""
    import table2_finetune as t2

    missing = {"IVON (ivon-opt) mean": "ivon-opt not installed"}
    done = {("a", 0, "ivon", x): dict(missing, _seconds={"ivon": 0.0}) for x in (1.0, 0.5)}
    assert t2.chosen_multiplier(done, "a", "ivon", 0, [0.5]) is None
    cfg = {"seeds": [0], "tasks": ["a"], "methods": ["ivon"], "lr_multipliers": [0.5]}
    assert t2.best_reruns(done, {**cfg, "seeds": [0, 1]}) == []
    assert t2.tables(done, cfg) == {"runs": {"a": [missing]}, "chosen": {"a ivon": None}}


def test_table2_rows_missing_on_a_seed_come_in_the_same_order_in_every_process() -> None:
    """The tuned rows a seed lacks ("not run") follow the order they were first seen in, whatever
    the string hash's seed: the report of the same runs is the same file (it was a set's order)."""
    import subprocess

    code = f"""
import json, sys
sys.path.insert(0, {PAPER_DIR!r})
import table2_finetune as t2
sel = t2.SELECTION_ROW["adamw"]
rows = lambda nll: {{sel: {{"cal_nll": nll}}, **{{f"row {{k}}": {{"nll": k}} for k in range(8)}}}}
done = {{("a", 0, "adamw", 1.0): rows(0.9), ("a", 0, "adamw", 0.5): rows(0.7), ("a", 1, "adamw", 1.0): rows(0.8)}}
cfg = {{"seeds": [0, 1], "tasks": ["a"], "methods": ["adamw"], "lr_multipliers": [0.5]}}
print(json.dumps(t2.tables(done, cfg)["runs"]["a"][1]))
"""
    seed_one = []
    for seed in (1, 2, 3):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        seed_one.append(list(json.loads(out).items()))
    assert seed_one[0] == seed_one[1] == seed_one[2]
    # seed 1 has no tuned run (its rerun did not happen): every tuned row "not run", in seed 0's order
    assert [k for k, _ in seed_one[0] if k.endswith("[tuned]")] == [f"row {k} [tuned]" for k in range(8)]
    assert {v for k, v in seed_one[0] if k.endswith("[tuned]")} == {"not run (time limit)"}


def test_variant_names_map_to_evon_arguments() -> None:
    import _gpt

    assert _gpt.variant_kwargs("Plain") == {"clip": "spectral", "clip_radius": 1.0}
    assert _gpt.variant_kwargs("Whiten+PG+clip") == {
        "clip": "whiten",
        "clip_radius": 1.0,
        "phased_gradients": True,
        "hess_clip_ratio": 1.5,
    }
    assert _gpt.variant_kwargs("Clip") == {"clip": "spectral", "clip_radius": 1.0, "hess_clip_ratio": 1.5}
    assert _gpt.evon_kwargs("SOAP", 100)["ess"] == math.inf
    assert _gpt.evon_kwargs("IVON", 100)["identity_basis"] is True


# ----------------------------------------------------------------------------- settings hashes
PAPER_ALGORITHM = ("fig1_left", "fig2_logreg", "fig3a_mlp", "fig3b_iris", "fig4_gpt", "table3_ablation")
SCRIPTS = (*PAPER_ALGORITHM, "table2_finetune")  # Table 2 runs every method at its defaults


def committed(name: str) -> dict:
    with open(os.path.join(PAPER_DIR, "results", f"{name}.json")) as fh:
        return json.load(fh)


def recomputed_hash(name: str) -> str:
    """The hash of the settings the script would run with now, for its committed run (no training)."""
    module = __import__(name)
    saved = committed(name)
    data = {k: saved["settings"][k] for k in module.DATA_KEYS}
    return _common.settings_hash(module.settings(saved["fast"], saved["seed"], **data))


@pytest.mark.parametrize("name", SCRIPTS)
def test_committed_results_match_the_scripts_settings(name: str) -> None:
    """The committed PNG/MD/JSON were made with the settings the script has now, the library's
    defaults for everything it does not pass included: regenerate them when this fails."""
    pytest.importorskip("tokenizers")
    saved = committed(name)
    assert saved["fast"] is False
    assert saved["settings_hash"] == _common.settings_hash(saved["settings"])  # the JSON's own settings
    assert recomputed_hash(name) == saved["settings_hash"], f"regenerate examples/paper/results/{name}.*"


def test_every_paper_run_spells_out_the_papers_algorithm() -> None:
    """Each option whose library default differs from the paper's is passed by every paper run."""
    for name in PAPER_ALGORITHM:
        for run, opt in committed(name)["settings"]["optimizers"].items():
            if name == "fig4_gpt" and (run == "AdamW" or "defaults" in run):
                continue  # torch's AdamW; the library's defaults, on purpose
            kwargs = opt["kwargs"]
            assert set(kwargs) >= set(_common.PAPER_EVON), (name, run)
            for key, value in _common.PAPER_EVON.items():  # Table 3's PG variants switch PG on
                assert kwargs[key] == _common.jsonable(value) or key == "phased_gradients", (name, run, key)
            for key in ("ess", "weight_decay", "hess_init", "lr", "betas", "clip", "hess_clip_ratio"):
                assert key in opt["kwargs"] or key in _common.PAPER_EVON, (name, run, key)


def set_evon_default(monkeypatch: pytest.MonkeyPatch, **changes: object) -> None:
    """Change EVON's constructor defaults, as a later version of the library might."""
    import inspect

    from hf_evon import EVON

    init = EVON.__init__
    params = [
        p for p in inspect.signature(init).parameters.values() if p.default is not inspect.Parameter.empty
    ]
    assert set(changes) <= {p.name for p in params}
    monkeypatch.setattr(init, "__defaults__", tuple(changes.get(p.name, p.default) for p in params))


def test_a_changed_library_default_fails_the_settings_check(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tokenizers")
    before = {name: recomputed_hash(name) for name in SCRIPTS}
    # ε of the adaptive Hessian clip: no script passes it, every one runs with the default
    set_evon_default(monkeypatch, eps=1e-9)
    assert all(recomputed_hash(name) != before[name] for name in SCRIPTS)
    monkeypatch.undo()
    assert {name: recomputed_hash(name) for name in SCRIPTS} == before
    # the default Hessian estimate: the paper's runs pass theirs; Fig. 4's learned runs use the default
    set_evon_default(monkeypatch, hess_estimator="price")
    assert {name for name in SCRIPTS if recomputed_hash(name) != before[name]} == {
        "fig4_gpt",
        "table2_finetune",
    }


def test_a_fast_run_never_writes_over_the_committed_results(tmp_path, monkeypatch) -> None:
    """``--fast`` without ``--out-dir`` wrote its shrunken figure, table and numbers over
    ``examples/paper/results/``, the README's; it writes to the temporary directory. A full run keeps
    ``results/``, and an ``--out-dir`` that is a file is refused by name (a FileExistsError from makedirs)."""
    import tempfile

    monkeypatch.delenv("HF_EVON_PAPER_FAST", raising=False)  # --fast's default
    fast = _common.parse_args(None, ["--fast"])
    assert fast.out_dir == os.path.join(tempfile.gettempdir(), "hf_evon_paper_fast") != _common.DEFAULT_OUT
    assert _common.parse_args(None, []).out_dir == _common.DEFAULT_OUT
    assert _common.parse_args(None, ["--fast", "--out-dir", str(tmp_path)]).out_dir == str(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit):
        _common.parse_args(None, ["--out-dir", str(afile)])


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--jobs", "-3"], "--jobs -3: give 1 or more processes"),
        (["--search", "-2"], "--search -2: give 0 or more draws"),
        (["--run-tasks", "bogus"], "--run-tasks bogus: not tasks of this mode; choose from docstring_topic/lora"),
        (["--data", "/nonexistent/texts.json"], "--data '/nonexistent/texts.json': no such file"),
        (["--resume", "/nonexistent/run.partial.json"], "--resume '/nonexistent/run.partial.json': no such file"),
    ],
)
def test_table2s_bad_arguments_are_named_before_anything_runs(tmp_path, capsys, extra: list[str], said: str) -> None:
    """--search -2 failed in torch ("negative dimension"), --run-tasks with an unknown name ran nothing and
    then raised an IndexError, a missing --data or --resume file a FileNotFoundError after the output
    directory was made, and --jobs -3 was taken. Each exits as argparse does (status 2) naming the flag,
    the output directory untouched."""
    module = __import__("table2_finetune")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        module.run(["--fast", "--methods", "adamw", "--out-dir", str(out), *extra])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"table2_finetune.py: error: {said}\n"
    assert not out.exists()


def test_table2_refuses_a_partial_made_with_other_settings(tmp_path, capsys) -> None:
    """--from-partial and --resume took any .partial.json: a fast run's runs were reported as a full run's
    (its settings, epochs and samples in the record). The partial records its settings; another run's
    are refused naming what differs, and the fast record names the texts per class it built."""
    module = __import__("table2_finetune")
    partial = tmp_path / "run.partial.json"
    settings = module.settings(True, 0, "0" * 64, per_class=(8, 8))
    assert settings["per_class"] == [8, 8]
    partial.write_text(json.dumps({"settings": module.jsonable(settings), "done": []}))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        module.run(["--methods", "adamw", "--from-partial", str(partial), "--out-dir", str(out)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"table2_finetune.py: error: {partial} was made with other settings (seeds, tasks, per_class,"), err
    assert not out.exists()
