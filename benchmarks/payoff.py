"""Does switching to EVON pay off with its defaults? Calibration and accuracy on seven tasks.

Offline on CPU: each task is trained by each method with that method's defaults (no per-task
tuning), over several seeds, and scored on each task's test partition: the same rows for every
seed, which no script that chooses a setting builds (``payoff_tasks.make_task(...,
development=True)``); the calibration split is used only for the post-hoc steps (temperature,
Laplace prior precision, the sampling ζ of EVON and IVON). How EVON's defaults were chosen, and
re-checked on validation data: docs/defaults.md#what-saw-the-test-splits.

Tasks: ``payoff_tasks`` (the seven of the table: digits, breast_cancer, wine, noisy_digits,
tiny_gpt2, minilm_full, minilm_lora; more by name). The loop and scores every method shares:
``payoff_training``; the Laplace peer: ``payoff_laplace``; the report: ``payoff_report``.

Rows: AdamW (a per-kind standard rate: 1e-3 from scratch and for LoRA, 1e-4 for full
fine-tuning); AdamW + temperature scaling; laplace-torch's last-layer KFAC Laplace on the
AdamW model (prior precision by its own grid search on the calibration split; probit
predictive; classification only), and on LoRA its KFAC Laplace over the adapters and the head
as well (Laplace-LoRA; the same grid search and predictive); IVON (ivon-opt with its own conventions,
its rate in its rescaled convention and ζ per kind of task as the others get a rate per kind,
``IVON_SETTINGS``: lr 0.1 and ess = N from scratch, lr 0.1 and ess 1e9 for full fine-tuning, lr 1
and ess 1e7 for LoRA; its other defaults) at the mean and at BMA@8/@32 after the same
calibration of ζ as EVON's (``calibrate_posterior``); EVON (``build_optimizer`` defaults; the
AdamW part at the task's AdamW rate, as ``EVONTrainer`` takes ``learning_rate`` for it) at the
mean, the mean with temperature scaling (what a temperature alone does, beside the samples), and
with the calibrated posterior at BMA@8 and @32; the same EVON with
``identity_basis=True`` (the diagonal posterior of IVON inside EVON: the rotation is the only
difference). Same linear-decay schedule and data order for every method.

    python benchmarks/payoff.py                      # all tasks, 3 seeds (about 45 min on 2 cores)
    python benchmarks/payoff.py --tasks digits --seeds 1 --fast
    python benchmarks/payoff.py --out benchmarks/results/payoff   # writes .json, .md, .png

Install the peers with the CPU torch pinned (laplace-torch would otherwise pull a newer,
CUDA torch): ``pip install torch==2.13.0 -e ".[benchmarks]"``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from payoff_laplace import adapter_laplace_rows, is_peft, laplace_rows
from payoff_report import collect, markdown, merge_runs, plot, summarize
from payoff_tasks import TASKS, Task, as_calibration_batches, make_task
from payoff_training import bma, fit_temperature, log_probs, scores, train, train_adamw, train_evon
from torch import nn

from hf_evon.posterior.posterior import EVONPosterior
from hf_evon.predictive.calibration import calibrate_posterior, mean_temperature
from hf_evon.predictive.logprobs import count_label_items


# ---------------------------------------------------------------------------------- methods
def run_adamw(task: Task, seed: int) -> dict[str, Any]:
    model = task.make_model(seed)
    train_adamw(task, model, seed)
    rows, temp = point_estimate_rows("AdamW", task, model)
    return {
        "_adamw": {"temperature": temp},
        **rows,
        "Laplace (last layer, laplace-torch)": laplace_rows(task, model),
        **({"Laplace (LoRA adapters, laplace-torch)": adapter_laplace_rows(task, model)} if is_peft(model) else {}),
    }


def point_estimate_rows(name: str, task: Task, model: nn.Module) -> tuple[dict[str, Any], float]:
    """``name``'s test scores, and with temperature scaling fitted on the calibration split (the
    rows and the temperature): by L-BFGS on log T, temperature scaling's own convention (Guo et al.
    2017), and by the rule EVON's calibration applies to its mean (``mean_temperature``: a grid,
    softening only past ``DEFAULT_STANDARD_ERRORS`` standard errors, sharpening only where the split's errors and a
    cross-validation support it), which a tiny or error-free calibration split does not mislead."""
    cal = log_probs(model, task.cal, task.shift)
    rows, temp = tempered_rows(name, log_probs(model, task.test, task.shift), cal)
    return {**rows, **selection_row(name, cal)}, temp


def tempered_rows(
    name: str, test: tuple[torch.Tensor, torch.Tensor], cal: tuple[torch.Tensor, torch.Tensor]
) -> tuple[dict[str, Any], float]:
    """``name``'s test scores from its log-probabilities ``test`` = (log p, labels), and at the
    temperatures fitted on the calibration split's ``cal``: by ``fit_temperature`` (returned) and by
    ``mean_temperature``, the rule EVON's calibration applies to its mean."""
    (test_lp, test_y), temp, rule = test, fit_temperature(*cal), mean_temperature(*cal)
    return {
        name: scores(test_lp, test_y),
        f"{name} + temperature": scores(torch.log_softmax(test_lp / temp, -1), test_y),
        f"{name} + temperature (calibration's rule)": scores(torch.log_softmax(test_lp / rule, -1), test_y),
    }, temp


def selection_row(
    name: str, cal: tuple[torch.Tensor, torch.Tensor] | None = None, **cal_of: Any
) -> dict[str, Any]:
    """``{"_selection <name>": {"cal_nll": …}}``: the point estimate's NLL on the calibration
    split (log-probs ``cal``, or computed by ``log_probs(model, task.cal, task.shift)`` from
    ``cal_of``), which a random search compares (examples/paper/table2_finetune.py)."""
    if cal is None:
        cal = log_probs(cal_of["model"], cal_of["task"].cal, cal_of["task"].shift)
    return {f"_selection {name}": {"cal_nll": scores(*cal)["nll"]}}


def run_soap(task: Task, seed: int) -> dict[str, Any]:
    """SOAP (pytorch-optimizer): the deterministic optimizer EVON's mean step builds on, at its
    own defaults (betas 0.95, weight decay 0.01, refresh every 10 steps) but the task's AdamW rate
    (its rates are Adam's); a point estimate, with temperature scaling on the calibration split."""
    try:
        from pytorch_optimizer import SOAP
    except ImportError:
        return {"SOAP (pytorch-optimizer)": "pytorch-optimizer not installed"}
    model = task.make_model(seed)
    opt = SOAP([p for p in model.parameters() if p.requires_grad], lr=task.adamw_lr * task.lr_scale)
    train(task, model, opt, seed)
    rows, _ = point_estimate_rows("SOAP", task, model)
    return {"SOAP (pytorch-optimizer)": rows.pop("SOAP"), **rows}


# ivon-opt per kind of task, as AdamW, SOAP and EVON get a rate per kind: its rate in its own
# convention (the step scaled by h0 + δ), ζ (None: N, the IVON paper's choice) and h0, each kind's the
# setting of a grid with the lowest temperature-scaled NLL of the mean on the development tasks'
# calibration splits (docs/results.md#ivons-settings-per-kind-of-task)
IVON_SETTINGS: dict[str, dict[str, Any]] = {
    "scratch": dict(lr=0.1, ess=None, hess_init=1.0),
    "full": dict(lr=0.1, ess=1e9, hess_init=1.0),
    "lora": dict(lr=1.0, ess=1e7, hess_init=1.0),
}


def task_kind(name: str) -> str:
    """"lora" (LoRA adapters fine-tuned), "full" (every weight fine-tuned) or "scratch", by the name
    of a payoff task (``minilm_lora``, ``minilm_noisy_full``) or a Table 2 one (``<text task>/lora``)."""
    if name.endswith("lora"):
        return "lora"
    return "full" if name.endswith("full") else "scratch"


def ivon_optimizer(
    ivon: Any, model: nn.Module, n_train: int, lr: float = 0.1, ess: float | None = None, hess_init: float = 1.0
) -> torch.optim.Optimizer:
    """ivon-opt with its own conventions: ``lr`` in its convention (the step is scaled by h0 + δ,
    ``rescale_lr=True``; its recommended 0.1 by default), ess = N unless given (the IVON paper's
    choice for ζ), h0 ``hess_init`` (its default 1), its other defaults; on the trainable
    parameters only: it perturbs and decays every parameter it is given, frozen ones included (a
    LoRA model's base weights would drift)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return ivon.IVON(params, lr=lr, ess=n_train if ess is None else ess, hess_init=hess_init)


class IVONPosterior:
    """ivon-opt's posterior as ``calibrate_posterior`` and ``calibrated_bma`` use one (``ess``,
    ``config``, ``with_ess``, ``scale_ess``, ``with_temperature``, ``temperature``, ``sampled``), so IVON gets the
    same calibration of its ζ and BMA as EVON."""

    def __init__(self, opt: torch.optim.Optimizer, ess: float, config: dict[str, Any] | None = None) -> None:
        self.opt, self.ess, self.config = opt, ess, dict(config or {})

    def with_ess(self, ess: float) -> IVONPosterior:
        return IVONPosterior(self.opt, ess, self.config)

    def scale_ess(self, factor: float) -> IVONPosterior:
        return IVONPosterior(self.opt, self.ess * factor, self.config)

    def with_temperature(self, temperature: float) -> IVONPosterior:
        return IVONPosterior(self.opt, self.ess, {**self.config, "temperature": temperature})

    @property
    def temperature(self) -> float:
        """The softmax temperature BMA divides the log-probabilities by (1 until calibrated)."""
        return float(self.config.get("temperature", 1.0))

    @contextlib.contextmanager
    def sampled(self, model: nn.Module, seed: int) -> Any:
        """The weights hold one draw at this ζ (ivon-opt draws from torch's global stream)."""
        saved = [g["ess"] for g in self.opt.param_groups]
        for g in self.opt.param_groups:
            g["ess"] = self.ess
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            with self.opt.sampled_params(train=False):
                yield
        finally:
            torch.random.set_rng_state(state)
            for g, ess in zip(self.opt.param_groups, saved):
                g["ess"] = ess


def training_targets(task: Task) -> int:
    """N for ivon-opt's ess = N: the targets the mean training loss averages over in one pass
    (a causal LM's tokens from position 1, not its sequences: the loss is per token)."""
    return sum(int(count_label_items(y, task.shift)) for _, y in task.train)


def train_ivon(ivon: Any, task: Task, model: nn.Module, seed: int, setting: dict[str, Any]) -> IVONPosterior:
    """ivon-opt at ``setting`` (``ivon_optimizer``'s keywords; its rate times the task's ``lr_scale``)
    trained by the shared loop; the weights are left at its mean, whose posterior this returns."""
    opt = ivon_optimizer(ivon, model, training_targets(task), **{**setting, "lr": setting["lr"] * task.lr_scale})
    train(task, model, opt, seed, sampled=lambda: opt.sampled_params(train=True))
    return IVONPosterior(opt, float(opt.param_groups[0]["ess"]))


def run_ivon(task: Task, seed: int, sizes: list[int]) -> dict[str, Any]:
    try:
        import ivon
    except ImportError:
        return {"IVON (ivon-opt) mean": "ivon-opt not installed"}
    model = task.make_model(seed)
    posterior = train_ivon(ivon, task, model, seed, IVON_SETTINGS[task_kind(task.name)])
    mean = log_probs(model, task.test, task.shift)
    return {
        "IVON (ivon-opt) mean": scores(*mean),
        **selection_row("IVON (ivon-opt)", model=model, task=task),
        **calibrated_bma_rows("IVON (ivon-opt)", task, model, posterior, mean, seed, sizes),
    }


def calibrated_bma(
    task: Task, model: nn.Module, calibrated: Any, mean: tuple[torch.Tensor, torch.Tensor], sizes: list[int]
) -> dict[int, torch.Tensor]:
    """BMA log-probabilities on the test split at the calibrated posterior's ζ and softmax
    temperature T (``log_softmax(log p / T)`` = ``log_softmax(logits / T)``), per number of samples;
    ``mean``: the test split's log-probabilities at the mean."""
    t = calibrated.temperature

    def sample(s: int) -> torch.Tensor:
        with calibrated.sampled(model, seed=s):
            return torch.log_softmax(log_probs(model, task.test, task.shift)[0] / t, -1)

    # at ζ = ∞ every sample is the mean, bit for bit (tests/test_calibration.py): no need to draw them
    tempered_mean = torch.log_softmax(mean[0] / t, -1)
    return {k: tempered_mean for k in sizes} if math.isinf(calibrated.ess) else bma(sample, sizes)


def calibrated_bma_rows(
    name: str,
    task: Task,
    model: nn.Module,
    posterior: Any,
    mean: tuple[torch.Tensor, torch.Tensor],
    seed: int,
    sizes: list[int],
) -> dict[str, Any]:
    """``calibrate_posterior``'s defaults on the calibration split, then BMA on the test split at
    the chosen ζ and softmax temperature T (``log_softmax(log p / T)`` = ``log_softmax(logits / T)``)."""
    calibrated, result = calibrate_posterior(
        model, posterior, as_calibration_batches(task.cal), shift_labels=task.shift, seed=1000 + seed
    )
    bmas = calibrated_bma(task, model, calibrated, mean, sizes)
    rows: dict[str, Any] = {f"{name} calibrated BMA@{k}": scores(logp, mean[1]) for k, logp in bmas.items()}
    rows[f"_{name} calibration"] = {
        "trained_ess": result.trained_ess,
        "calibrated_multiplier": result.multiplier,
        "calibrated_temperature": result.temperature,
        # on the calibration split, at T = 1 for the mean and the chosen T for the choice
        "calibration_mean_nll": result.mean_nll,
        "calibration_chosen_nll": result.chosen_nll,
    }
    return rows


def run_evon(task: Task, seed: int, sizes: list[int], diagonal: bool = False) -> dict[str, Any]:
    """EVON at ``build_optimizer``'s defaults; ``diagonal``: the same with ``identity_basis=True``
    (IVON's diagonal posterior inside EVON: the rotation is the only difference)."""
    model = task.make_model(seed)
    start = time.perf_counter()
    opt = train_evon(task, model, seed, identity_basis=diagonal)
    train_seconds = time.perf_counter() - start
    mean, cal = log_probs(model, task.test, task.shift), log_probs(model, task.cal, task.shift)
    posterior = EVONPosterior.from_optimizer(opt, model)
    name = "EVON diagonal (identity_basis)" if diagonal else "EVON"
    # "mean + temperature" beside the calibrated BMA: what the samples add beyond a temperature
    rows = {
        **tempered_rows(f"{name} mean", mean, cal)[0],
        **selection_row(name, cal),
        **calibrated_bma_rows(name, task, model, posterior, mean, seed, sizes),
    }
    if not diagonal:
        health = opt.posterior_health(warn=False)
        rows["_evon"] = {
            **rows.pop("_EVON calibration"),
            "noise_to_signal": health.get("noise_to_signal"),
            "hess_below_prior": health.get("hess_below_prior"),
            "hess_init_share": health.get("hess_init_share"),
            "train_seconds": train_seconds,
        }
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--fast", action="store_true", help="few epochs/steps: a smoke test, not a measurement"
    )
    parser.add_argument("--samples", type=int, nargs="+", default=[8, 32], help="BMA sizes for EVON")
    parser.add_argument("--methods", nargs="+", default=["adamw", "soap", "ivon", "evon", "evon_diag"])
    parser.add_argument("--out", default=None, help="prefix of the .json/.md/.png outputs")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1,
        help="runs (task, seed) in this many processes of one thread each (default: one per core; 1: in this process, one thread)",
    )  # fmt: skip
    parser.add_argument(
        "--combine", nargs="+", default=None, metavar="JSON",
        help="no training: one report from the .json files of earlier runs (tasks run apart, or a rerun of "
        "some methods: a later file's rows replace the earlier ones of the same seed and name)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.combine:
        runs, minutes = {}, 0.0
        for path in args.combine:
            with open(path) as fh:
                saved = json.load(fh)
            merge_runs(runs, saved["runs"])
            minutes = max(minutes, saved["meta"]["minutes"])
            args.samples = saved["meta"].get("samples", args.samples)
        # the seeds the combined rows average over (the files may hold different numbers)
        counts = sorted({len(seeds) for seeds in runs.values()})
        args.seeds = f"{counts[0]}–{counts[-1]}" if len(counts) > 1 else sum(counts)
        return report(runs, args, minutes)
    start = time.perf_counter()
    # one job per (task, seed, method), the slowest first, so parallel workers finish together
    jobs = sorted(
        ((n, s, m) for n in args.tasks for s in range(args.seeds) for m in args.methods),
        key=lambda j: -JOB_SECONDS.get((j[0], j[2]), 0.0),
    )
    done: dict[tuple[str, int, str], dict[str, Any]] = {}

    def record(job: tuple[str, int, str], rows: dict[str, Any]) -> None:
        done[job] = rows
        if args.out:  # after every run: a crash later loses nothing measured so far
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out + ".partial.json", "w") as fh:
                minutes = (time.perf_counter() - start) / 60
                json.dump(
                    {"meta": {"seeds": args.seeds, "minutes": minutes}, "runs": collect(done, args.methods)},
                    fh,
                )
        print(f"{job[0]} seed {job[1]} ({rows['_seconds'][job[2]]:.0f} s): " + ", ".join(
            f"{r} nll {v['nll']:.4f} acc {v['accuracy']:.3f}" for r, v in rows.items() if isinstance(v, dict) and "nll" in v
        ), flush=True)  # fmt: skip

    if args.jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        ctx = multiprocessing.get_context("spawn")  # fork after torch's thread pools start can hang
        with ProcessPoolExecutor(args.jobs, mp_context=ctx, initializer=init_worker) as pool:
            futures = {pool.submit(run_job, *job, args.fast, args.samples): job for job in jobs}
            for future in as_completed(futures):
                record(futures[future], future.result())
    else:  # in this process, with one thread as each worker has (the report's seconds say "one thread")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for job in jobs:
                record(job, run_job(*job, args.fast, args.samples))
        finally:
            torch.set_num_threads(threads)
    result = report(collect(done, args.methods), args, (time.perf_counter() - start) / 60)
    if args.out:  # the report holds every run: the crash record goes (it stayed beside the results)
        with contextlib.suppress(FileNotFoundError):
            os.remove(args.out + ".partial.json")
    return result


def print_rows(run: Callable[[str, int], dict[str, Any]], tasks: list[str], seeds: list[int], jobs: int) -> list[dict[str, Any]]:
    """``run(task, seed)`` for every task and seed on ``jobs`` one-threaded worker processes (spawned),
    each row printed as one JSON line as it comes, in the jobs' order; the rows."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pairs = [(t, s) for t in tasks for s in seeds]
    rows = []
    ctx = multiprocessing.get_context("spawn")  # fork after torch's thread pools start can hang
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=init_worker) as pool:
        for row in pool.map(run, *zip(*pairs)):
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def init_worker() -> None:
    """One thread per worker; on Linux the worker is also ended when the parent dies (killed or
    interrupted), instead of finishing its job in hand orphaned, for up to ~12 minutes."""
    torch.set_num_threads(1)
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: orphans finish their job


# seconds per (task, method) and seed, one thread, from this benchmark's "_seconds" (payoff.json)
# on the 2-core machine, rounded: only the order matters (the slowest jobs start first)
JOB_SECONDS = {
    ("minilm_full", "evon"): 342.0, ("minilm_full", "ivon"): 204.0, ("minilm_lora", "evon"): 135.0,
    ("tiny_gpt2", "evon"): 76.0, ("minilm_full", "adamw"): 70.0, ("tiny_gpt2", "ivon"): 49.0,
    ("minilm_lora", "adamw"): 47.0, ("minilm_lora", "ivon"): 47.0, ("digits", "adamw"): 45.0,
    ("tiny_gpt2", "adamw"): 41.0,
}  # fmt: skip
METHODS: dict[str, Callable[[Task, int, list[int]], dict[str, Any]]] = {
    "adamw": lambda task, seed, samples: run_adamw(task, seed),
    "soap": lambda task, seed, samples: run_soap(task, seed),
    "ivon": lambda task, seed, samples: run_ivon(task, seed, samples),
    "evon": lambda task, seed, samples: run_evon(task, seed, samples),
    "evon_diag": lambda task, seed, samples: run_evon(task, seed, samples, diagonal=True),
}


def run_job(name: str, seed: int, method: str, fast: bool, samples: list[int]) -> dict[str, Any]:
    task = make_task(name, seed, fast)
    start = time.perf_counter()
    rows = METHODS[method](task, seed, samples)
    rows["_seconds"] = {method: time.perf_counter() - start}
    return rows


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, minutes: float) -> dict[str, Any]:
    order = {name: i for i, name in enumerate(TASKS)}  # the tasks in their listed order, not finishing order
    runs = {name: runs[name] for name in sorted(runs, key=lambda n: order.get(n, len(order)))}
    summary = summarize(runs)
    meta = {"seeds": args.seeds, "minutes": minutes, "fast": args.fast, "samples": args.samples}
    bma_row = f"EVON calibrated BMA@{max(args.samples)}"
    report = (
        markdown(summary, bma_row, meta) if {"adamw", "evon"} <= set(args.methods) else json.dumps(summary)
    )
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as fh:
            json.dump({"meta": meta, "summary": summary, "runs": runs}, fh, indent=1)
        with open(args.out + ".md", "w") as fh:
            fh.write(report)
        plot(summary, args.out + ".png")
    return summary


if __name__ == "__main__":
    main()
