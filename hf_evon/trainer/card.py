"""The model card ``EVONTrainer`` writes beside its model: :func:`hf_evon.posterior.model_card.save_model_card`
with what the trainer knows (its latest BMA evaluation, or the best checkpoint's, the repo it pushes to,
its steps, its optimizer)."""

from __future__ import annotations

import os
import re
from typing import Any

from huggingface_hub import ModelCard
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy

from hf_evon.optim.rates import configured_rate
from hf_evon.posterior.model_card import CardSource, format_value, save_model_card

__all__ = ["save_trainer_model_card"]


def _is_bma_evaluation(entry: dict[str, Any]) -> bool:
    return any(k.startswith("eval_") and "bma_" in k for k in entry)


def _evaluation_at(history: list[dict[str, Any]], step: int) -> dict[str, float]:
    """The evaluation logged at ``step``: its entries merged (several eval datasets, and BMA passes
    run once training stopped on the evaluation's metrics, each log an entry of their own)."""
    entries = [h for h in history if h.get("step") == step and any(k.startswith("eval_") for k in h)]
    return {k: v for h in entries for k, v in h.items() if isinstance(v, int | float)}


def _best_checkpoint_step(trainer: Any) -> int | None:
    """The step of the best checkpoint whose weights and posterior ``load_best_model_at_end``
    restored (the card then describes that checkpoint, not the last step), or None."""
    state = getattr(trainer, "state", None)
    if state is None or not getattr(trainer, "_posterior_from_checkpoint", False):
        return None
    if state.best_global_step:
        return int(state.best_global_step)
    found = re.search(r"checkpoint-(\d+)$", str(state.best_model_checkpoint or "").rstrip("/\\"))
    return int(found.group(1)) if found else None


def _posterior_metrics(trainer: Any, best_step: int | None, calibrated: bool) -> dict[str, float] | None:
    """The evaluation of the card's posterior that has BMA metrics (``eval_*_bma_*`` /
    ``eval_bma_*``): the one at ``best_step`` (None where it ran no BMA), else the last logged. Where the
    card's posterior is ``calibrated`` and the calibration was logged after that evaluation, its BMA
    columns are another posterior's (the one before the calibration) and are left out."""
    state = getattr(trainer, "state", None)
    history = state.log_history if state is not None else []
    evaluations = [i for i, h in enumerate(history) if _is_bma_evaluation(h) and (best_step is None or h.get("step") == best_step)]
    if not evaluations:
        return None
    last = history[evaluations[-1]]
    metrics = _evaluation_at(history, last["step"]) if "step" in last else dict(last)
    calibrations = [i for i, h in enumerate(history) if any(k.startswith("calibration/") for k in h)]
    if calibrated and calibrations and calibrations[-1] > evaluations[-1]:
        metrics = {k: v for k, v in metrics.items() if not (k.startswith("eval_") and "bma_" in k)}
    return metrics


def _configured(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with the rate it is configured with (:func:`~hf_evon.optim.rates.configured_rate`) as its
    ``lr``: a schedule's rate at save time (0 at the end of a linear decay) says nothing of the training."""
    rate = configured_rate(group)
    return group if rate is None else {**group, "lr": rate}


def _optimizer_text(trainer: Any, posterior: CardSource) -> str:
    """What trained the model, from the trainer's optimizer (the posterior config otherwise)."""
    groups = getattr(getattr(trainer, "optimizer", None), "param_groups", None) or []
    evon = [g for g in groups if g.get("algorithm", "evon") == "evon"]
    adamw = [g for g in groups if g.get("algorithm") == "adamw"]
    source = _configured(evon[0]) if evon else posterior.config
    keys = ("lr", "ess", "betas", "weight_decay")
    text = "EVON (hf-evon; " + ", ".join(f"{k} {format_value(source[k])}" for k in keys if k in source) + ")"
    text += " for the weight matrices of the EVON posterior below"
    if adamw:
        a = _configured(adamw[0])
        text += "; AdamW (" + ", ".join(
            f"{k} {format_value(a[k])}" for k in ("lr", "betas", "weight_decay") if k in a
        )
        text += ") for the other trainable tensors"
    return text


def _checkpoint_folder_in_repo(args: Any, directory: str | os.PathLike) -> str | None:
    """The repo folder the Trainer pushes ``directory`` to where it is one of ``output_dir``'s
    checkpoints that ``hub_strategy`` pushes whole (``"checkpoint"``: ``last-checkpoint``;
    ``"all_checkpoints"``: its own name), else None (the output directory goes to the repo's root)."""
    strategy = getattr(args, "hub_strategy", None)
    if strategy not in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
        return None
    path = os.path.abspath(os.fspath(directory))
    name = os.path.basename(path)
    if not re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-\d+", name):
        return None
    if os.path.dirname(path) != os.path.abspath(os.fspath(args.output_dir)):
        return None
    return "last-checkpoint" if strategy == HubStrategy.CHECKPOINT else name


def save_trainer_model_card(trainer: Any, directory: str | os.PathLike, posterior: CardSource) -> ModelCard:
    """The card ``EVONTrainer`` writes beside its model: the latest BMA evaluation, the repo id
    (``hub_model_id``) and branch it pushes to in the snippet, its ``global_step`` (the best checkpoint's
    evaluation and step after ``load_best_model_at_end``), its model (for a PEFT
    classifier's ``num_labels``), and EVON on the Trainer card's ``- optimizer:`` line. A checkpoint's card
    that ``hub_strategy`` pushes with its checkpoint to a folder of the repo loads both from that folder."""
    args = trainer.args
    state = getattr(trainer, "state", None)
    best_step = _best_checkpoint_step(trainer)
    kwargs: dict[str, Any] = {
        "base_model": posterior.config.get("base_model"),
        "metrics": _posterior_metrics(trainer, best_step, "calibration" in posterior.config),
        "model": trainer.model,
        "training_steps": best_step or getattr(state, "global_step", None) or None,
        "num_bma_samples": getattr(args, "bma_num_samples", None),
        "optimizer": _optimizer_text(trainer, posterior),
    }
    hub_id = getattr(trainer, "hub_model_id", None) or getattr(args, "hub_model_id", None)
    pushing = getattr(trainer, "_hub_push_revision", None)  # the branch a push_to_hub() call goes to
    if (pushing is not None or getattr(args, "push_to_hub", False)) and hub_id:
        kwargs["repo_id"] = hub_id
        revision = pushing or getattr(args, "hub_revision", None)  # the snippet loads from that branch
        kwargs["revision"] = None if revision == "main" else revision
        if pushing is None and (folder := _checkpoint_folder_in_repo(args, directory)) is not None:
            kwargs["subfolder"] = kwargs["model_subfolder"] = folder
    return save_model_card(directory, posterior, **kwargs)
