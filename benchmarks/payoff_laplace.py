"""laplace-torch's KFAC Laplace as a peer: over the last layer, and over a PEFT model's adapters
(Laplace-LoRA), its prior precision chosen on the calibration split."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from payoff_tasks import Batch, Task, forward
from payoff_training import scores
from torch import nn

# laplace-torch's grid for the prior precision: its own default, 100 points 10^-4 … 10^4
LAPLACE_GRID = 100
# examples per laplace-torch batch: the GLM predictive's Jacobians take
# (examples × classes × trainable weights) floats, about 5 MB per example and class on MiniLM's LoRA
LAPLACE_CHUNK = 8


def last_layer_features(model: nn.Module, batches: list[Batch]) -> tuple[nn.Linear, list[Batch]]:
    """The linear layer that produces the logits and its inputs for ``batches``.

    Last-layer Laplace only ever sees these features (the model is in eval mode: no dropout),
    so fitting laplace-torch on (features, head) is the same Laplace approximation as
    ``subset_of_weights="last_layer"`` on the whole model, without a forward pass through it
    for every prior precision of the grid search. The head is the last linear layer *called*
    with the logits' width (under PEFT, the active copy of a ``modules_to_save`` head)."""
    calls: list[tuple[nn.Linear, torch.Tensor]] = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: calls.append((mod, args[0].detach())))
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]
    feats = []
    try:
        with torch.no_grad():
            for x, y in batches:
                calls.clear()
                logits = forward(model, x)
                head, inputs = calls[-1]
                if head.out_features != logits.shape[-1] or not torch.equal(head(inputs), logits):
                    raise RuntimeError("payoff: the last linear layer called does not produce the logits")
                feats.append((inputs, y))
    finally:
        for h in hooks:
            h.remove()
    return head, feats


def laplace_unavailable(task: Task) -> str | None:
    """Why no Laplace row can be fitted on ``task`` (None: it can)."""
    try:
        import laplace  # noqa: F401
    except ImportError:
        return "laplace-torch not installed"
    if not task.classification:
        return "n/a: laplace-torch's classification likelihood needs one label per input"
    return None


def laplace_rows(task: Task, model: nn.Module) -> dict[str, float] | str:
    """laplace-torch's last-layer KFAC Laplace (``kron_laplace`` on the logits layer and its inputs)."""
    if (reason := laplace_unavailable(task)) is not None:
        return reason
    import copy

    model.eval()
    head, train_feats = last_layer_features(model, task.train)
    head = copy.deepcopy(head)
    cal_feats, test_feats = last_layer_features(model, task.cal)[1], last_layer_features(model, task.test)[1]
    return kron_laplace_scores(kron_laplace(head, train_feats, cal_feats), test_feats)


class _Logits(nn.Module):
    """``model``'s logits for laplace-torch, which calls a model on the whole batch mapping (its
    ``labels`` included) and reads the targets from ``batch["labels"]``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return forward(self.model, {k: v for k, v in batch.items() if k != "labels"})


def _laplace_loader(batches: list[Batch], chunk: int | None = None) -> Any:
    """``batches`` as laplace-torch reads them: a sized list (its ``dataset`` length scales the
    likelihood) of (inputs, labels), or of mappings holding ``labels`` where inputs are mappings;
    ``chunk``: at most that many examples per batch."""

    class Loader(list):
        pass

    if chunk is not None:
        cut = lambda x, i: {k: v[i : i + chunk] for k, v in x.items()} if isinstance(x, Mapping) else x[i : i + chunk]  # noqa: E731
        batches = [(cut(x, i), y[i : i + chunk]) for x, y in batches for i in range(0, len(y), chunk)]
    out = Loader([{**x, "labels": y} if isinstance(x, Mapping) else (x, y) for x, y in batches])
    out.dataset = range(sum(len(y) for _, y in batches))
    return out


def is_peft(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (False where PEFT is not installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def probit_scale(variance: torch.Tensor) -> torch.Tensor:
    """The probit approximation's factor on each logit, 1 / sqrt(1 + π/8 · its variance)
    (MacKay 1992; laplace-torch's ``link_approx="probit"``)."""
    return torch.rsqrt(1.0 + math.pi / 8 * variance)


def glm_probit(la: Any, f_mu: torch.Tensor, Js: torch.Tensor) -> torch.Tensor:
    """laplace-torch's GLM predictive with its probit link (``la(x, pred_type="glm",
    link_approx="probit")``), from the outputs ``f_mu`` and Jacobians ``Js`` of a batch."""
    return torch.softmax(probit_scale(la.functional_variance(Js).diagonal(dim1=1, dim2=2)) * f_mu, dim=-1)


def kron_variances(la: Any, Js: torch.Tensor, precisions: torch.Tensor) -> torch.Tensor:
    """The diagonal of laplace-torch's ``la.functional_variance(Js)`` (a KFAC Laplace without
    damping) at each prior precision of ``precisions`` at once: (batch, outputs, len(precisions)).

    In the eigenbases of the Kronecker factors the posterior precision is diagonal, its entries
    the products of the factors' eigenvalues plus the prior precision, so each output's variance
    is Σ (rotated Jacobian)² / (eigenvalue + precision): the rotation, which is the cost, is done
    once for every precision (laplace-torch's ``KronDecomposed`` holds the factors'
    ``eigenvectors`` and ``eigenvalues``; a test holds this equal to its ``functional_variance``)."""
    P = la.posterior_precision
    if P.damping:
        raise ValueError("kron_variances: a damped KFAC Laplace is not a sum of eigenvalues and prior")
    B, K, _ = Js.shape
    W = Js.reshape(B * K, -1)
    start, squares, eigenvalues = 0, [], []
    for Qs, ls in zip(P.eigenvectors, P.eigenvalues):
        if len(ls) == 1:
            (Q,), (eig,) = Qs, ls
            block = W[:, start : start + len(eig)] @ Q
        else:
            (Q1, Q2), (l1, l2) = Qs, ls
            eig = torch.outer(l1, l2).flatten()
            block = (Q1.T @ W[:, start : start + len(eig)].reshape(-1, len(l1), len(l2)) @ Q2).flatten(1)
        squares.append(block.square())
        eigenvalues.append(eig)
        start += len(eig)
    inverse = 1.0 / (torch.cat(eigenvalues)[:, None] + precisions.to(W)[None, :])
    return (torch.cat(squares, dim=1) @ inverse).reshape(B, K, len(precisions))


def kron_laplace(
    model: nn.Module, train_batches: list[Batch], cal_batches: list[Batch], grid_size: int = LAPLACE_GRID
) -> Any:
    """laplace-torch's KFAC Laplace over ``model``'s trainable weights, fitted on ``train_batches``;
    its prior precision the grid point (laplace-torch's grid) of lowest NLL of its GLM probit
    predictive on ``cal_batches``, with each example's Jacobians and their rotation computed once
    instead of once per grid point (``kron_variances``). laplace-torch 0.3's own
    ``optimize_prior_precision(method="gridsearch")`` does not reset its NLL metric between grid
    points, so it compares running means over the grid; a test holds this choice to its per-point
    validation NLL. Returns the fitted Laplace."""
    from laplace import Laplace

    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron")
    la.fit(_laplace_loader(train_batches, LAPLACE_CHUNK), progress_bar=False)
    grid = torch.logspace(-4, 4, grid_size)
    nll = torch.zeros(len(grid), dtype=torch.float64)
    for batch in _laplace_loader(cal_batches, LAPLACE_CHUNK):
        x, y = (batch, batch["labels"]) if isinstance(batch, Mapping) else batch
        Js, f_mu = la.backend.jacobians(x)
        kappa = probit_scale(kron_variances(la, Js.detach(), grid))  # (B, K, G)
        logp = torch.log_softmax(kappa * f_mu.detach()[..., None], dim=1)
        nll -= logp.gather(1, y[:, None, None].expand(-1, 1, len(grid))).sum((0, 1)).double().cpu()
    la.prior_precision = grid[int(torch.argmin(nll))]
    return la


def kron_laplace_scores(la: Any, batches: list[Batch]) -> dict[str, float]:
    """``la``'s GLM probit predictive's scores on ``batches``."""
    probs, labels = [], []
    for batch in _laplace_loader(batches, LAPLACE_CHUNK):
        x, y = (batch, batch["labels"]) if isinstance(batch, Mapping) else batch
        Js, f_mu = la.backend.jacobians(x)
        probs.append(glm_probit(la, f_mu.detach(), Js.detach()).double().cpu())
        labels.append(y.cpu())
    return scores(torch.cat(probs).clamp_min(1e-300).log(), torch.cat(labels))


def adapter_laplace(task: Task, model: nn.Module) -> Any:
    """``kron_laplace`` over the weights a PEFT model trains (its LoRA adapters and its
    ``modules_to_save`` head; the frozen pretrained weights are not in it), as Laplace-LoRA
    (Yang et al., 2024) does: fitted on the training split, its prior precision chosen on the
    calibration split."""
    model.eval()
    return kron_laplace(_Logits(model), task.train, task.cal)


def adapter_laplace_rows(task: Task, model: nn.Module) -> dict[str, float] | str:
    """``adapter_laplace``'s test scores (its GLM probit predictive)."""
    if (reason := laplace_unavailable(task)) is not None:
        return reason
    return kron_laplace_scores(adapter_laplace(task, model), task.test)
