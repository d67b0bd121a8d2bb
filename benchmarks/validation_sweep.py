"""Settings scored on validation data only: EVON's mean (and AdamW's) on each task's calibration split.

Defaults are chosen on validation splits, never on the test split a table reports. This trains
EVON (``payoff_training.train_evon``, i.e. ``build_optimizer``'s defaults plus the keyword
arguments given) or AdamW (``train_adamw``, its own conventions) on each task and scores the
posterior mean on the task's calibration split: NLL, accuracy, ECE, the temperature fitted on
that split and the NLL after it, and EVON's ``posterior_health`` shares. Tasks: ``payoff.py``'s
(``minilm_lora``, ``noisy_digits``, ...) and Table 2's (``docstring_topic/lora``,
``comment_topic/full``, ...; ``examples/paper/table2_finetune.py``). One JSON line per run, in
the order they finish; one thread per process. A setting's ``"prior_std_ratio"`` is not an
optimizer argument: it sets ``hf_evon.optim.defaults``' prior std ratio (``DEFAULT_PRIOR_STD_RATIO``,
the noise level's ceiling and the mean's pull ``mean_weight_decay=None`` resolves to) for that run.

    python benchmarks/validation_sweep.py --tasks minilm_lora docstring_topic/lora \\
        --settings '{}' '{"clip": "element"}' adamw --seeds 0 --processes 2
    python benchmarks/validation_sweep.py --tasks digits wine --settings '{}' '{"prior_std_ratio": 0.5}'
    python benchmarks/validation_sweep.py --tasks tiny_gpt2 --settings '{}' '{"max_grad_norm": 1.0}' adamw adamw:1
    python benchmarks/validation_sweep.py --tasks minilm_full --settings ivon:0.1 'ivon:{"lr": 0.1, "ess": 1e7}'

Figures: docs/defaults.md (each default's section says which settings it compared).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from multiprocessing import get_context
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PAPER = os.path.join(HERE, "..", "examples", "paper")
_TEXT_DATA: dict[str, Any] | None = None


def make_task(name: str, seed: int) -> Any:
    """A payoff task (``minilm_lora``, ...) or a Table 2 task (``<text task>/<full|lora>``), without
    its test partition."""
    global _TEXT_DATA
    import payoff_tasks
    import table2_finetune

    if "/" not in name:
        return payoff_tasks.make_task(name, seed, False, development=True)
    if _TEXT_DATA is None:
        _TEXT_DATA = table2_finetune.text_data(table2_finetune.TEXT_TASKS)
    return table2_finetune.make_task(name, seed, False, _TEXT_DATA, "cpu", development=True)


@contextlib.contextmanager
def prior_std_ratio(ratio: float | None) -> Any:
    """``default_weight_decay``'s prior std ratio set to ``ratio`` (None: left) while the block runs:
    its default argument, which ``noise_std_ratio`` and ``mean_weight_decay=None`` resolve through."""
    import inspect

    from hf_evon.optim import defaults

    function = defaults.default_weight_decay
    kept = function.__defaults__
    if ratio is not None:  # the defaults tuple covers the trailing parameters: find prior_std_ratio by name
        names = list(inspect.signature(function).parameters)[-len(kept) :]
        if "prior_std_ratio" not in names:
            raise RuntimeError("default_weight_decay has no defaulted prior_std_ratio to set")
        function.__defaults__ = tuple(float(ratio) if n == "prior_std_ratio" else v for n, v in zip(names, kept))
    try:
        yield
    finally:
        defaults.default_weight_decay.__defaults__ = kept


def run(job: tuple[str, int, Any]) -> dict[str, Any]:
    """Train one setting on one task and seed; score the mean on the calibration split."""
    import torch

    torch.set_num_threads(1)
    from payoff_training import fit_temperature, log_probs, scores, train_adamw, train_evon

    name, seed, setting = job
    task = make_task(name, seed)
    torch.manual_seed(seed)
    model = task.make_model(seed)
    start = time.time()
    health: dict[str, float] = {}
    if isinstance(setting, str) and setting.split(":")[0] == "adamw":  # "adamw" or "adamw:<max_grad_norm>"
        train_adamw(task, model, seed, max_grad_norm=float(setting.partition(":")[2] or 0))
    elif isinstance(setting, str):  # "ivon:<lr>" or "ivon:{...}": ivon-opt at its conventions but these
        import ivon
        import payoff

        payoff.train_ivon(ivon, task, model, seed, ivon_kwargs(setting))
    else:
        kwargs = {k: v for k, v in setting.items() if k != "prior_std_ratio"}
        with prior_std_ratio(setting.get("prior_std_ratio")):
            optimizer = train_evon(task, model, seed, **kwargs)
        report = optimizer.posterior_health(warn=False)
        health = {k: report[k] for k in ("hess_below_prior", "hess_init_share") if k in report}
    seconds = time.time() - start
    lp, y = log_probs(model, task.cal, task.shift)
    mean = scores(lp, y)
    temperature = fit_temperature(lp, y)
    tempered = scores(torch.log_softmax(lp / temperature, -1), y)
    return dict(
        task=name, seed=seed, setting=setting, nll=mean["nll"], accuracy=mean["accuracy"], ece=mean["ece"],
        temperature=temperature, nll_tempered=tempered["nll"], seconds=seconds, **health,
    )  # fmt: skip


IVON_KEYS = ("lr", "ess", "hess_init")  # what an ivon setting may set (payoff.ivon_optimizer's)


def ivon_kwargs(text: str) -> dict[str, Any] | None:
    """``payoff.ivon_optimizer``'s keyword arguments from 'ivon:<lr>' or 'ivon:{"lr": ..., "ess": ...,
    "hess_init": ...}' (each a number > 0; lr required); None where what follows 'ivon:' is neither."""
    try:
        value = json.loads(text[len("ivon:") :])
    except json.JSONDecodeError:
        return None
    kwargs = value if isinstance(value, dict) else {"lr": value}
    positive = all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in kwargs.values()
    )
    return kwargs if "lr" in kwargs and set(kwargs) <= set(IVON_KEYS) and positive else None


def parse_setting(text: str) -> Any:
    """A ``--settings`` entry: 'adamw', an ivon one (``ivon_kwargs``), or a JSON object; None where it
    is none of them."""
    if text == "adamw":
        return text
    if text.startswith("adamw:"):
        try:
            return text if float(text[6:]) >= 0 else None
        except ValueError:
            return None
    if text.startswith("ivon:"):
        return text if ivon_kwargs(text) is not None else None
    try:
        setting = json.loads(text)
    except json.JSONDecodeError:
        return None
    return setting if isinstance(setting, dict) else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", required=True)
    ap.add_argument(
        "--settings", nargs="+", default=["{}"],
        help="each a JSON object of train_evon keyword arguments and/or \"prior_std_ratio\" ('{}': the "
        "defaults; \"max_grad_norm\": the Trainer's clip), 'adamw' ('adamw:<max_grad_norm>': clipped), or 'ivon:<lr>' / 'ivon:{\"lr\": ..., \"ess\": ..., \"hess_init\": ...}' (ivon-opt at "
        "that rate in its convention, ζ = N unless given)",
    )  # fmt: skip
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--processes", type=int, default=2)
    args = ap.parse_args(argv)
    settings = []
    for text in args.settings:
        setting = parse_setting(text)
        if setting is None:
            ap.error(f"--settings: {text!r} is neither a JSON object, 'adamw' nor an ivon setting (ivon:<lr>)")
        settings.append(setting)
    jobs = [(t, s, k) for s in args.seeds for k in settings for t in args.tasks]
    with get_context("spawn").Pool(args.processes) as pool:
        for result in pool.imap_unordered(run, jobs):
            print(json.dumps(result), flush=True)


sys.path.extend([HERE, PAPER])  # payoff's and Table 2's modules, here and in spawned workers

if __name__ == "__main__":
    main()
