"""Model cards (README.md) for EVON posterior checkpoints, rendered with ``huggingface_hub.ModelCard``.

The template is ``hf_evon/posterior/templates/evon_posterior.md`` (a copy of the repository's
``model_cards/evon_posterior.md``). A card states the base model, that the repo holds an
EVON posterior, its hyperparameters, which parameters are covered, metrics at the mean and
under BMA when given, and a snippet that loads model + posterior and decodes with BMA.

A posterior usually lives beside a model or an adapter that has its own card, so an
existing ``README.md`` is *updated*: the ``evon`` / ``variational-inference`` tags are
added to its metadata, ``library_name`` and ``base_model`` are filled in only where
missing (a ``transformers`` or ``peft`` repo keeps its own library, so the Hub still
loads it correctly), and the EVON section, delimited by ``<!-- hf-evon:start -->`` /
``<!-- hf-evon:end -->``, replaces the previous one or is appended. The rest of the text is
kept as it was.

A card pushed by ``EVONTrainer`` (:func:`hf_evon.trainer.card.save_trainer_model_card`) also names the repo id in
its snippet, counts the Trainer's optimizer steps, and corrects the ``- optimizer:`` line of
the Trainer's own card (which reports ``TrainingArguments.optim``, not EVON). Every snippet
is meant to run as written: it names the saved directory (or the repo id), for a PEFT
classifier the label count the base model must be built with, and loads a tokenizer only where
one was saved with the model (``hf_evon.posterior.snippet``).

Cards are rendered from plain data (:class:`CardSource`: the config, the covered names and
counts), so this module needs nothing of ``EVONPosterior`` but those attributes.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from typing import Any, Protocol

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from hf_evon.fileio import atomic_write, directory_lock, listed_kind, temporary_name_pattern
from hf_evon.modeling import OutputKind, output_kind, problem_type
from hf_evon.posterior.card_merge import CardMetadataError, merged_metadata, metadata_block, split_card
from hf_evon.posterior.json_rules import as_float
from hf_evon.posterior.snippet import has_tokenizer, num_labels, usage_snippet

__all__ = [
    "CardSource",
    "EVON_TAGS",
    "LIBRARY_NAME",
    "SECTION_END",
    "SECTION_START",
    "card_arguments",
    "format_value",
    "render_model_card",
    "retract_card_section",
    "save_model_card",
    "template_path",
    "update_model_card",
]

LIBRARY_NAME = "hf-evon"
EVON_TAGS = ("evon", "variational-inference", "bayesian-deep-learning")
SECTION_START = "<!-- hf-evon:start -->"
SECTION_END = "<!-- hf-evon:end -->"

# (config key, label) rows of the hyperparameter table, in this order, where present
_HYPERPARAMETER_ROWS = (
    ("ess", "effective sample size `ess` (ζ)"),
    ("weight_decay", "`weight_decay` (δ; prior N(0, 1/(ζδ)))"),
    ("hess_init", "`hess_init` (initial Hessian)"),
    ("betas", "`betas` (momentum, Hessian)"),
    ("precondition_frequency", "`precondition_frequency` (eigenbasis refresh, steps)"),
    ("mc_samples", "`mc_samples` (posterior samples per step)"),
    ("lr", "learning rate `lr`"),
    ("final_lr", "learning rate at save time (scheduled)"),
    ("clip", "update clipping `clip`"),
    ("clip_radius", "`clip_radius`"),
    ("snr_scaling", "`snr_scaling` (step scaled by the gradient's signal-to-noise ratio)"),
    ("hess_clip_ratio", "`hess_clip_ratio` (adaptive Hessian clipping γ)"),
    ("shampoo_beta", "`shampoo_beta` (β3 of the L/R statistics)"),
    ("max_precond_dim", "`max_precond_dim`"),
    ("max_precond_ratio", "`max_precond_ratio`"),
    ("phased_gradients", "`phased_gradients`"),
    ("identity_basis", "`identity_basis` (IVON mode)"),
    (
        "optimizer_step",
        "EVON updates of the mean (`optimizer_step`; the first step only builds the eigenbases)",
    ),
)
_SKIPPED_METRICS = ("runtime", "per_second", "epoch", "num_samples", "num_bma_samples")
_SKIPPED_METRIC_NAMES = ("step",)  # the log entry's step, not a metric
_OPTIMIZER_LINE = re.compile(r"^- optimizer: .*$", re.MULTILINE)  # the Trainer card's hyperparameter list


class CardSource(Protocol):
    """What a card is rendered from (an ``EVONPosterior`` has these attributes)."""

    config: Mapping[str, Any]
    names: Sequence[str]
    num_covered: int
    num_point_estimates: int | None
    num_point_estimate_tensors: int | None


def template_path() -> str:
    """Path of the packaged card template (``hf_evon/posterior/templates/evon_posterior.md``)."""
    return str(resources.files("hf_evon.posterior") / "templates" / "evon_posterior.md")


def format_value(value: Any) -> str:
    """A config value as a card shows it (``inf``, 6 significant digits, tuples in brackets)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.6g}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(format_value(v) for v in value) + ")"
    return str(value)


# Everything a card shows may come from a config downloaded from elsewhere: each value is escaped
# for where it lands, so it stays text (no markup, no new line, no end of a cell, a code span,
# the EVON section, or, in ``snippet``, a string literal of the snippet).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_MARKDOWN_SPECIAL = re.compile(r"([\\`|\[\]])")
_CODE_SPAN_UNSAFE = re.compile(r"[`|<>]")


def _md(value: Any) -> str:
    """``value`` as one line of literal Markdown text (also inside a table cell)."""
    text = _CONTROL.sub("\ufffd", str(value))
    text = text.replace("<", "&lt;").replace(">", "&gt;")
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text)


def _code(value: Any) -> str:
    """``value`` in a Markdown code span; characters a span cannot escape show as U+FFFD."""
    return "`" + _CODE_SPAN_UNSAFE.sub("\ufffd", _CONTROL.sub("\ufffd", str(value))) + "`"


def _is_hub_id(name: str | None) -> bool:
    """Whether ``name`` can go into the card's ``base_model`` metadata (a Hub id, not a path): a name
    listed here (:func:`~hf_evon.fileio.listed_kind`), a link that reaches nothing included, is a local
    path, and so is one this user cannot look up: the Hub would link the card to another repo."""
    if not name or name.startswith((".", "/", "~")):
        return False
    try:
        if listed_kind(name) is not None:
            return False
    except (OSError, ValueError):  # ValueError: a NUL in the name, which no repo id holds either
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _name_patterns(names: list[str]) -> list[tuple[str, int]]:
    """Collapse layer indices (``.h.3.`` -> ``.h.*.``) to summarise many covered names."""
    counts: dict[str, int] = {}
    for name in names:
        pattern = _code(re.sub(r"(?<=\.)\d+(?=\.)", "*", name))[1:-1]  # the template adds the backquotes
        counts[pattern] = counts.get(pattern, 0) + 1
    return list(counts.items())


def _metric_rows(metrics: Mapping[str, Any] | None) -> list[tuple[str, str, str]]:
    """Rows (metric, at the mean, under BMA).

    Accepts ``{"mean": {...}, "bma": {...}}`` or a flat dict such as
    ``trainer.evaluate()`` returns, where ``eval_bma_<metric>`` (or ``<metric>_bma``) is the
    BMA value and every other ``eval_<metric>`` the value at the mean. Timing keys are dropped.
    """
    if not metrics:
        return []
    mean: dict[str, Any] = {}
    bma: dict[str, Any] = {}
    if set(metrics) <= {"mean", "bma"} and all(isinstance(v, Mapping) for v in metrics.values()):
        mean = dict(metrics.get("mean", {}))
        bma = dict(metrics.get("bma", {}))
    else:
        for key, value in metrics.items():
            name = re.sub(r"^(eval|test|validation)_", "", str(key))
            # "<dataset>_bma_<metric>" with several eval datasets: the dataset's row of <metric>
            kind = re.match(r"^(?:(?P<dataset>.+?)_)?(?P<kind>bma|mean)_(?P<metric>.+)$", name)
            if kind:
                row = f"{kind['dataset']}_{kind['metric']}" if kind["dataset"] else kind["metric"]
                (bma if kind["kind"] == "bma" else mean)[row] = value
            elif name.endswith("_bma"):
                bma[name[:-4]] = value
            else:
                mean[name] = value
    order = list(dict.fromkeys([*mean, *bma]))
    rows = []
    for name in order:
        if name in _SKIPPED_METRIC_NAMES or any(s in name for s in _SKIPPED_METRICS):
            continue
        values = [mean.get(name), bma.get(name)]
        if not any(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            continue
        rows.append((_md(name), *("–" if v is None else _md(format_value(v)) for v in values)))
    return rows


# a calibration scores scales by held-out NLL and may keep the mean, whose samples never disagree
TRAINED_SCALE_NOTE = (
    " The scale EVON trained stays in the config (`trained_ess`): `EVONTrainer.predict_uncertainty` samples"
    " at it, where the samples' disagreement (the epistemic uncertainty) flags inputs unlike the training data."
)


def _bma_kind(model: Any) -> OutputKind:
    """What the model's BMA averages, as ``predict(bma=True)`` and the card's snippet read it
    (:func:`~hf_evon.modeling.output_kind`); without a problem_type one output a value, else a softmax."""
    return output_kind(model) or (OutputKind.VALUE if num_labels(model) == 1 else OutputKind.SOFTMAX)


def _tempered_text(temperature: Any, where: str, kind: OutputKind) -> str:
    """The card's words for the BMA temperature (none where it is 1) of a model whose BMA averages ``kind``
    (:func:`_bma_kind`); ``where``: what the parenthesis after T says."""
    if not _is_number(temperature) or float(temperature) == 1.0:
        return ""
    t = f"T = {_md(format_value(temperature))} ({where})"
    if kind is OutputKind.VALUE:  # predict(bma=True) averages a regression's outputs untempered
        return (
            " BMA predicts the outputs themselves averaged over samples (values, no logits): the temperature "
            f"{t} does not apply to them."
        )
    what = "each label's sigmoid(logits / T)" if kind is OutputKind.SIGMOID else "softmax(logits / T)"
    return f" BMA predicts {what} averaged over samples, {t}."


def _calibration_text(
    config: Mapping[str, Any], scales: Mapping[str, float] | None = None, kind: OutputKind = OutputKind.SOFTMAX
) -> str:
    """What the card says about the posterior's sampling scale (hf_evon.predictive.calibration);
    ``scales``: each covered name's ζ, where tensors may differ from the top-level one; ``kind``: what
    the model's BMA averages (:func:`_bma_kind`)."""
    cal = config.get("calibration")
    hand = _hand_set_text(config, scales or {}, kind)
    if hand:
        return hand
    if not isinstance(cal, Mapping):
        return (
            "Not calibrated: samples use the scale EVON trained with. Choose it on held-out data with "
            "`hf_evon.calibrate_posterior` (or `hf-evon calibrate`) before relying on BMA: on that data the "
            "calibrated BMA is never worse than the mean by more than half a standard error or 1% (its "
            "defaults)." + _tempered_text(config.get("temperature"), "`posterior.temperature`", kind)
        )
    chose = cal.get("temperature", 1.0)  # with_temperature after a calibration: T set by hand, the scale not
    how = "chosen with the scale" if chose == config.get("temperature", 1.0) else f"set by hand; the calibration chose {_md(format_value(chose))}"
    tempered = _tempered_text(config.get("temperature"), f"{how}; `posterior.temperature`", kind)
    # numbers as json_value writes them ("inf", "nan" for floats); the config validated them on load
    ess, trained = float(cal["ess"]), float(cal["trained_ess"])
    kept = _is_number(cal.get("trained_nll")) and ess == trained
    errors = f"{_md(format_value(cal['standard_errors']))} standard error(s) or " if cal.get("standard_errors") else ""
    margin = f" by more than {errors}{_md(format_value(100 * float(cal.get('min_gain', 0.0))))}%"
    trained_nll = _md(format_value(cal.get("trained_nll")))
    trained_text = (
        f" The mean did not predict better than the posterior as trained (held-out NLL {trained_nll}){margin}, so "
        "the posterior as trained is kept: its samples disagree where inputs are unlike the training data."
        if kept
        else f" The mean predicted better than the posterior as trained (held-out NLL {trained_nll}){margin}."
        if _is_number(cal.get("trained_nll")) and ess == float("inf")
        else ""
    )
    if cal.get("scanned") is False:
        # the NLL at T = 1, and the calibrated one where a temperature (below) changed it
        as_chosen = cal.get("chosen_nll") if _is_number(cal.get("chosen_nll")) and cal.get("chosen_nll") != cal.get("mean_nll") else None
        nll, tempered_nll = _md(format_value(cal.get("mean_nll"))), f", {_md(format_value(as_chosen))} at the temperature below" if as_chosen is not None else ""
        return (
            f"Calibrated on {_md(format_value(cal.get('num_targets')))} held-out targets: the posterior mean is not "
            "overconfident there (no softmax temperature above 1 lowers its held-out NLL), and averaging "
            f"weight samples only softens them, so no {'other ' if kept else ''}sampling scale was scored"
            + (f" (`ess` = {_md(format_value(ess))}; held-out NLL {nll} at the mean{tempered_nll})." if kept else f": BMA is the mean (`ess` = ∞; held-out NLL {nll}{tempered_nll}).")
            + trained_text  # kept, or (BMA the mean) beaten by the mean
            + _temperature_text(cal.get("mean_temperature"))
            + tempered
            + ("" if kept else TRAINED_SCALE_NOTE)
        )
    mult = "∞" if ess == float("inf") else format_value(ess / trained)
    # a calibration that records no chosen_nll chose the lowest NLL
    chosen = cal.get("chosen_nll", min(float(v) for v in [cal["mean_nll"], *cal.get("nll", [])]))
    show = lambda v: _md(format_value(v))  # noqa: E731
    scored, screened = len(cal.get("grid", [])), len(cal.get("screened") or ())
    return (
        f"Calibrated on {show(cal.get('num_targets'))} held-out targets by BMA negative log-likelihood "
        + (
            f"({show(cal.get('num_samples'))} samples per scale, {scored} scales and the mean"
            if scored or not screened
            else "(the mean alone"  # every scale screened out: none was scored with all its samples
        )
        + (f"; {screened} scale(s) with less noise screened out: their samples barely moved the predictions" if screened else "")
        + "): "
        f"`ess` = {show(cal.get('ess'))} ({mult} × the trained {show(cal.get('trained_ess'))}; ∞ means no "
        f"scale predicted at least {show(100 * float(cal.get('min_gain', 0.0)))}% better than the mean"
        + (
            f" and, stepping from the mean towards more noise, by more than {show(cal['standard_errors'])}"
            " standard error(s) at each step"
            if cal.get("standard_errors")
            else ""
        )
        + f"). Held-out NLL {show(chosen)} vs {show(cal.get('mean_nll'))} at the mean"
        + (  # what the noise adds to a temperature on the mean, or (BMA the mean) what the temperature gives
            "." if not _is_number(tempered_nll := cal.get("tempered_mean_nll")) or chosen == cal.get("mean_nll")
            else f", {show(tempered_nll)} at its own temperature." if tempered_nll != chosen
            else " at temperature 1: the gain is the temperature's."
        )
        + trained_text
        + _temperature_text(cal.get("mean_temperature"))
        + tempered
        + " Sampling from this posterior (`posterior.sampled`, `generate_bma`, `hf-evon generate`) uses this scale."
        + ("" if ess == trained else TRAINED_SCALE_NOTE)
    )


def _scales(posterior: CardSource) -> dict[str, float]:
    """Each covered name's ζ, where the source holds factors (an ``EVONPosterior``), else none."""
    return {n: f.ess for n, f in getattr(posterior, "factors", {}).items()}


def hand_set_scale_text(
    config: Mapping[str, Any], scales: Mapping[str, float], show: Callable[[Any], str] = format_value
) -> str:
    """"the sampling scale was set by hand (`ess` = X; the trained Y), not chosen on held-out data" for a
    posterior whose scale ``with_ess``/``scale_ess`` set (no calibration record; ``scales``: each covered
    name's ζ), or "" where every tensor is at the scale EVON trained (``trained_ess``,
    ``trained_ess_by_parameter``) or none is recorded; ``show`` writes a number. The card and
    ``hf-evon inspect`` both say it so."""
    if isinstance(config.get("calibration"), Mapping) or not _is_number(config.get("trained_ess")):
        return ""
    trained, by_name = float(config["trained_ess"]), config.get("trained_ess_by_parameter") or {}
    ess = {**{n: float(v) for n, v in scales.items()}, "": float(config["ess"])}  # "": the top level
    if all(v == float(by_name.get(n, trained)) for n, v in ess.items()):
        return ""
    low, high = min(ess.values()), max(ess.values())
    shown = show(low) + ("" if low == high else f" to {show(high)} by tensor")
    where = f"`ess` = {shown}; the trained {show(trained)}"
    return f"the sampling scale was set by hand ({where}), not chosen on held-out data"


def _hand_set_text(config: Mapping[str, Any], scales: Mapping[str, float], kind: OutputKind = OutputKind.SOFTMAX) -> str:
    """The card's words for a sampling scale set by hand (``with_ess``, ``scale_ess``), or "" (as
    :func:`hand_set_scale_text`); ``kind``: what the model's BMA averages (:func:`_bma_kind`)."""
    hand = hand_set_scale_text(config, scales, lambda v: _md(format_value(v)))
    if not hand:
        return ""
    tempered = _tempered_text(config.get("temperature"), "`posterior.temperature`", kind)
    return (
        f"Not calibrated: {hand}. Choose it there with "
        "`hf_evon.calibrate_posterior` (or `hf-evon calibrate`), which searches multiples of the trained scale "
        "(`trained_ess` in the config), before relying on BMA." + tempered
    )


def _is_number(value: Any) -> bool:
    return as_float(value) is not None


def _temperature_text(temperature: Any) -> str:
    """The mean's held-out temperature, and what it allows BMA (nothing where none is recorded)."""
    if not _is_number(temperature):
        return ""
    verdict = (
        "overconfident there, which averaging samples can soften"
        if temperature > 1
        else "not overconfident there, so averaging samples, which only softens predictions, has little to fix"
    )
    return f" The mean's own temperature on those targets is {temperature:.3g}: {verdict}."


def render_model_card(
    posterior: CardSource,
    base_model: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    *,
    repo_id: str | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    model_subfolder: str | None = None,
    model_id: str | None = None,
    num_bma_samples: int | None = None,
    model: Any = None,
    training_steps: int | None = None,
    tokenizer_saved: bool = True,
    model_name: str | None = None,
    tags: list[str] | None = None,
    license: str | None = None,
    datasets: list[str] | str | None = None,
    language: list[str] | str | None = None,
) -> ModelCard:
    """A fresh model card for ``posterior`` (see :func:`save_model_card` for the arguments)."""
    base_model = base_model or posterior.config.get("base_model") or None
    location = repo_id or "path/to/this/directory"  # save_model_card passes the directory
    card_data = ModelCardData(
        library_name=LIBRARY_NAME,
        tags=list(dict.fromkeys([*EVON_TAGS, *(tags or [])])),
        base_model=base_model if _is_hub_id(base_model) else None,
        license=license,
        datasets=datasets,
        language=language,
    )
    config = posterior.config
    hyperparameters = [
        (label, _md(format_value(config[key]))) for key, label in _HYPERPARAMETER_ROWS if key in config
    ]
    if training_steps is not None:
        hyperparameters.append(("optimizer steps taken (Trainer `global_step`)", format_value(training_steps)))
    if posterior.num_point_estimates is None:
        points = "the number of point-estimate parameters was not recorded."
    else:
        points = (
            f"the model's other {posterior.num_point_estimate_tensors} tensors ({posterior.num_point_estimates:,} "
            "parameters, e.g. embeddings, output head, biases, norms and frozen weights) are point estimates."
        )
    return ModelCard.from_template(
        card_data,
        template_path=template_path(),
        model_name=_md(
            model_name or (f"EVON posterior for {base_model}" if base_model else "EVON posterior")
        ),
        base_model_text=_code(base_model) if base_model else "this model",
        hyperparameters=hyperparameters,
        num_covered_tensors=len(posterior.names),
        num_covered_params=f"{posterior.num_covered:,}",
        point_estimates_text=points,
        name_patterns=_name_patterns(list(posterior.names)),
        metrics_rows=_metric_rows(metrics),
        num_bma_samples=num_bma_samples,
        usage_snippet=usage_snippet(
            posterior, base_model, location, subfolder, model_id, num_labels(model), tokenizer_saved, revision,
            problem_type(model), model_subfolder,
        ),
        calibration_text=_calibration_text(config, _scales(posterior), _bma_kind(model)),
        eigenbasis_dtype=_md(config.get("eigenbasis_dtype", "float32")),
        format_version=_md(config.get("format_version", 1)),
    )


def _section(text: str) -> str:
    if (span := section_span(text)) is None:
        raise RuntimeError("the EVON card template lost its section markers")
    return text[span[0] : span[1]]


def section_span(text: str) -> tuple[int, int] | None:
    """``(start, end)`` of the EVON section: the last start marker the next end marker closes (None: none
    does). A start marker whose end the user edited away opens no section: the user's text follows it."""
    end = text.rfind(SECTION_END)
    while end >= 0:
        start = text.rfind(SECTION_START, 0, end)
        if start >= 0 and text.find(SECTION_END, start, end) < 0:
            return start, end + len(SECTION_END)
        end = text.rfind(SECTION_END, 0, end) if start >= 0 else -1
    return None


def update_model_card(existing: str, fresh: ModelCard, optimizer: str | None = None) -> str:
    """The README text ``existing`` with ``fresh`` (a rendered EVON card) merged in, losing nothing of it
    (:mod:`~hf_evon.posterior.card_merge`), except the ``- optimizer: ...`` line of a Trainer card,
    which becomes ``optimizer`` if given. Raises ``CardMetadataError`` for metadata it cannot keep."""
    data, text = split_card(existing)
    data = merged_metadata(data, fresh.data)
    if optimizer is not None:
        text = _OPTIMIZER_LINE.sub(lambda _: f"- optimizer: {optimizer}", text)
    section = _section(fresh.text)
    span = section_span(text)
    if span is not None:
        text = text[: span[0]] + section + text[span[1] :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    return f"---\n{metadata_block(data)}\n---\n{text}"


# what a save puts in place of the EVON section before it switches its posterior in: a kill before
# the new card then leaves a card that describes no posterior rather than the one replaced
RETRACTED_SECTION = (
    f"{SECTION_START}\n## EVON posterior\n\nThis section describes the EVON posterior saved here and is "
    "rewritten by each save of it; the latest save did not rewrite it (it was interrupted, or wrote no card). "
    "The posterior's settings are in `evon_posterior_config.json`; load it with "
    f"`hf_evon.EVONPosterior.from_pretrained`.\n{SECTION_END}"
)


def retract_card_section(directory: str | os.PathLike, replacement: str = RETRACTED_SECTION) -> str | None:
    """Replace the EVON section of ``directory/README.md`` by ``replacement`` (:data:`RETRACTED_SECTION`;
    "" drops it: no posterior is left to name), keeping every other byte; a no-op where there is no card
    (nor a regular file under its name), no section, or no UTF-8 text.

    A posterior save calls it before its switch: the section describes the posterior the save
    replaces, and the new card is written only after the switch. Returns the card's text as it
    was where it was changed (a save that fails before its switch writes it back), else None.
    """
    folder = os.fspath(directory)
    path = os.path.join(folder, "README.md")
    with directory_lock(folder):
        if not os.path.isfile(path):  # a named pipe or device holds no card, and opening one waits for a writer
            return None
        try:
            with open(path, encoding="utf-8", newline="") as fh:  # newline="": line ends kept as they are
                text = fh.read()
        except (FileNotFoundError, UnicodeDecodeError):  # no card; a card save_model_card leaves as it is
            return None
        span = section_span(text)
        if span is None or text[span[0] : span[1]] == replacement:
            return None
        try:
            atomic_write(path, text[: span[0]] + replacement + text[span[1] :])
        except BaseException:  # also after its os.replace (an interrupt in its fsync): the card as it was
            with contextlib.suppress(OSError):
                atomic_write(path, text)
            raise
        return text


_CARD_TMP = re.compile(temporary_name_pattern("README.md"))
_CARD_TMP_STALE_SECONDS = 600  # a card is written in well under a second


def card_arguments(given: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``model_card_kwargs`` for :func:`save_model_card`, refused before anything is
    written where it holds a keyword the card does not take (it failed after the files were)."""
    known = {*inspect.signature(render_model_card).parameters, "optimizer"} - {"posterior"}
    unknown = sorted(set(given or {}) - known)
    if unknown:
        raise TypeError(f"model_card_kwargs: unknown keyword(s) {unknown}; the card takes {sorted(known)}")
    metrics = (given or {}).get("metrics")
    if metrics is not None and not isinstance(metrics, Mapping):
        raise TypeError(
            "model_card_kwargs['metrics'] must be a mapping ({'mean': {...}, 'bma': {...}} or a "
            f"trainer.evaluate() dict); got {type(metrics).__name__}"
        )
    return dict(given or {})


def save_model_card(
    directory: str | os.PathLike,
    posterior: CardSource,
    base_model: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> ModelCard:
    """Create ``directory/README.md`` for ``posterior``, or update the one that is there.

    Args:
        directory: where the posterior (and usually the model or adapter) is saved.
        posterior: an ``EVONPosterior`` (or any :class:`CardSource`).
        base_model: Hub id of the base model (default: what the posterior recorded). Only a
            valid Hub id goes into the metadata; a local path is mentioned in the text only.
        metrics: ``{"mean": {...}, "bma": {...}}`` or a flat ``trainer.evaluate()`` dict
            (``eval_bma_*`` keys are the BMA column).
        **kwargs: ``repo_id`` (where model + posterior live, for the snippet; default: the
            absolute path of ``directory``, so the snippet runs where it was saved),
            ``subfolder`` (the posterior's folder in ``repo_id``), ``model_subfolder`` (the model's,
            where it is not the root: a Trainer checkpoint pushed as ``last-checkpoint/``), ``revision``
            (the branch the card is pushed to: the snippet loads from it), ``model_id`` (override
            the model id in the snippet), ``model`` (the trained model: a PEFT classifier's snippet
            needs its ``num_labels``),
            ``training_steps``, ``tokenizer_saved`` (whether the snippet loads a tokenizer;
            default: whether ``directory`` holds one), ``num_bma_samples``, ``model_name``,
            ``tags``, ``license``, ``datasets``, ``language``; ``optimizer``: text for the
            ``- optimizer:`` line of an existing Trainer card.

    Returns the card that was written. The write is atomic (``hf_evon.fileio.atomic_write``) and
    under the posterior's ``directory_lock`` (in the same turn as the posterior's files where
    ``EVONPosterior.save_pretrained`` writes both). An existing README.md that is not UTF-8 text
    is left as it is, with a warning (the card it would have become is returned): rewriting it
    would lose what it holds.
    """
    optimizer = kwargs.pop("optimizer", None)
    kwargs.setdefault("repo_id", os.path.abspath(os.fspath(directory)))
    kwargs.setdefault("tokenizer_saved", has_tokenizer(directory))
    fresh = render_model_card(posterior, base_model, metrics, **kwargs)
    folder = os.fspath(directory)
    path = os.path.join(folder, "README.md")
    # the posterior's lock: no save switches its files between this card's reading and writing
    with directory_lock(folder):
        card, content = fresh, str(fresh)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as fh:
                    content = update_model_card(fh.read(), fresh, optimizer)
            except (UnicodeDecodeError, CardMetadataError) as err:  # the merge would lose what the README holds
                why = (f" is not UTF-8 text ({err.reason}, byte {err.start})" if isinstance(err, UnicodeDecodeError)
                       else f": its metadata {err}")  # fmt: skip
                warnings.warn(f"{path}{why}: left as it is, without EVON's card", UserWarning, stacklevel=2)
                return fresh
            card = ModelCard(content, ignore_metadata_errors=True)
        for name in os.listdir(folder):  # left by a write that was killed before its os.replace
            stale = os.path.join(folder, name)
            with contextlib.suppress(OSError):  # not one another process is writing now
                if _CARD_TMP.fullmatch(name) and time.time() - os.path.getmtime(stale) > _CARD_TMP_STALE_SECONDS:
                    os.remove(stale)
        atomic_write(path, content)
    return card
