"""The payoff benchmark's training loop and scores, the same for every method: one loop, order
and schedule, AdamW and EVON at their defaults, test log-probabilities, BMA and the metrics."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from payoff_tasks import Batch, Task, forward, loss_of
from torch import nn

from hf_evon import EVON, build_optimizer
from hf_evon.predictive.metrics import calibration_metrics

SCHEDULES: dict[str, Callable[[float], float]] = {  # the rate's factor at the fraction done
    "linear": lambda x: 1.0 - x,  # transformers' default
    "hold": lambda x: min(1.0, 2.0 * (1.0 - x)),  # held for half the run, then linear (as WSD)
    "constant": lambda x: 1.0,
}


def train(
    task: Task,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    seed: int,
    sampled: Any = None,
    schedule: str = "linear",
    max_grad_norm: float = 0.0,
) -> None:
    """The same loop, order and schedule (``SCHEDULES``) for every method; ``sampled`` wraps
    the forward/backward of the variational optimizers (EVON's and ivon-opt's context).
    ``max_grad_norm`` > 0 clips the mean gradient's norm before each step as ``EVONTrainer`` and
    ``Trainer`` do (0: no clip, as every table here trains)."""
    total = task.epochs * len(task.train)
    factor = SCHEDULES[schedule]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: factor(t / total))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(task.epochs):
        for i in torch.randperm(len(task.train), generator=gen).tolist():
            batch = task.train[i]
            if sampled is None:
                loss_of(model, batch, task.shift).backward()
            else:
                with sampled():
                    loss_of(model, batch, task.shift).backward()
            if max_grad_norm > 0:
                clip_mean_gradient(model, opt, max_grad_norm)
            opt.step()
            opt.zero_grad()
            sched.step()
    model.eval()


def clip_mean_gradient(model: nn.Module, opt: torch.optim.Optimizer, max_norm: float) -> None:
    """The Trainer's clip: ``p.grad`` holds the sum over EVON's recorded samples (one for the other
    optimizers), so the norm of their mean is clipped to ``max_norm``."""
    samples = max(getattr(opt, "recorded_samples", 1), 1)
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm * samples, total, foreach=True)


@torch.no_grad()
def log_probs(model: nn.Module, batches: list[Batch], shift: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-softmax rows, labels) of every labelled target, float64, in eval mode (no dropout: a
    model fresh from ``Task.make_model`` is in training mode); the model's mode is restored."""
    rows, labels = [], []
    was_training = model.training
    model.eval()
    try:
        for x, y in batches:
            logits = forward(model, x)
            if shift:
                logits, y = logits[:, :-1], y[:, 1:]
            logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
            keep = y.ne(-100)
            rows.append(torch.log_softmax(logits[keep].double(), -1))
            labels.append(y[keep])
    finally:
        model.train(was_training)
    return torch.cat(rows).cpu(), torch.cat(labels).cpu()  # scored on the host, whatever the device


def bma(predict: Callable[[int], torch.Tensor], sizes: list[int]) -> dict[int, torch.Tensor]:
    """BMA log-probabilities over the first k samples for each k in ``sizes`` (one set of draws:
    BMA@8 is the first 8 of BMA@32's samples, as two separate runs with the same seeds would be)."""
    out, acc = {}, None
    for s in range(max(sizes)):
        lp = predict(s)
        acc = lp if acc is None else torch.logaddexp(acc, lp)
        if s + 1 in sizes:
            out[s + 1] = acc - math.log(s + 1)
    return out


def scores(logp: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    m = calibration_metrics(logp, labels, "log_probs", n_bins=15)
    return {k: float(m[k]) for k in ("accuracy", "nll", "ece", "brier")}


def fit_temperature(logp: torch.Tensor, labels: torch.Tensor) -> float:
    """Temperature scaling's T (Guo et al. 2017): the held-out NLL of ``logp / T`` minimised by
    L-BFGS on log T. Where every row's label holds the largest logit (a split without errors, as
    small calibration splits often are) the NLL falls toward its floor as T → 0 and has no
    minimum: the split gives no measure of how far to sharpen, and any small T the optimizer
    stops at scores the first test mistake at a huge NLL, so the fit is 1 (no temperature)."""
    if bool((logp.gather(-1, labels[:, None]) >= logp.max(-1, keepdim=True).values).all()):
        return 1.0
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=0.5, max_iter=100, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(logp / log_t.exp(), labels)
        loss.backward()
        return loss

    opt.step(closure)
    return float(log_t.detach().exp())


def train_adamw(
    task: Task, model: nn.Module, seed: int, schedule: str = "linear", max_grad_norm: float = 0.0
) -> torch.optim.Optimizer:
    """AdamW with its conventions (the task's rate, weight decay 0.01), trained by ``train``."""
    opt = torch.optim.AdamW(model.parameters(), lr=task.adamw_lr * task.lr_scale, weight_decay=0.01)
    train(task, model, opt, seed, schedule=schedule, max_grad_norm=max_grad_norm)
    return opt


def train_evon(
    task: Task,
    model: nn.Module,
    seed: int,
    *,
    schedule: str = "linear",
    max_grad_norm: float = 0.0,
    **evon_kwargs: Any,
) -> EVON:
    """EVON at ``build_optimizer``'s defaults (``learning_rate``: the task's AdamW rate) but for
    ``evon_kwargs``, trained by ``train`` on sampled weights."""
    opt = build_optimizer(model, learning_rate=task.adamw_lr * task.lr_scale, seed=seed, **evon_kwargs)
    sampled = lambda: opt.sampled_params(train=True)  # noqa: E731
    train(task, model, opt, seed, sampled=sampled, schedule=schedule, max_grad_norm=max_grad_norm)
    return opt
