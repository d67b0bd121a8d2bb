"""Which evaluations of ``train()`` run the BMA passes (``EVONConfig.bma_eval_every``)."""

from typing import Any

__all__ = ["bma_due"]


def bma_due(trainer: Any) -> bool:
    """Whether the evaluation in progress during ``train()`` runs the BMA passes: the k-th, 2k-th, ...
    evaluation of training (``bma_eval_every`` = k; 0: none), and the one at which training stops.

    The count is the run's logged evaluations (a resumed run's included; several eval datasets at one
    step are one evaluation). One before a ``train()``'s first step (``eval_on_start``) is extra: it
    counts toward no k-th and runs BMA where every evaluation does (k = 1). Its entries are those
    logged at that step from that evaluation on, and every evaluation at step 0, where none is of training.
    """
    every, step, logs = trainer.args.bma_eval_every, trainer.state.global_step, trainer.state.log_history
    start = getattr(trainer, "_evon_start_evaluation", None)  # (its step, the log entries before it)
    on_start = step == trainer._evon_initial_step  # no step of this train() yet
    if on_start and (start is None or start[0] != step):
        start = trainer._evon_start_evaluation = (step, len(logs))

    def extra(index: int, at: int) -> bool:
        return at == 0 or (start is not None and at == start[0] and index >= start[1])

    earlier = {
        h["step"]
        for i, h in enumerate(logs)
        if h.get("step", step) < step and not extra(i, h["step"]) and any(k.startswith("eval_") for k in h)
    }
    # the last step, or a stop decided before this evaluation (a callback's at the step's end)
    at_end = (trainer.state.max_steps > 0 and step >= trainer.state.max_steps) or trainer.control.should_training_stop
    if on_start or step == 0:
        return at_end or every == 1
    return at_end or (every > 0 and (len(earlier) + 1) % every == 0)
