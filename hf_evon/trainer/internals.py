"""Every override of a private ``transformers.Trainer`` method, in one place, and why each is needed.

``transformers.Trainer`` offers no public hook for these; each override is thin and calls into
:mod:`hf_evon.trainer.checkpointing` or the mixin. ``tests/test_trainer_internals.py`` pins the
``Trainer`` behaviour each one relies on (who calls it, with what), so a transformers release that
changes it fails there rather than silently here.

* ``_save_optimizer_and_scheduler(output_dir)``: called by ``_save_checkpoint`` with the
  checkpoint directory; under FSDP2 EVON's full state is added as ``evon_optimizer.pt`` (the
  Trainer's distributed checkpoint cannot hold it).
* ``_load_optimizer_and_scheduler(checkpoint)``: called by ``train(resume_from_checkpoint=...)``
  before the optimizer is sharded; under FSDP2 only the scheduler is loaded here. Elsewhere a
  warning names each setting of this run's config that the checkpoint's optimizer state replaced,
  and another says when the Trainer did not load EVON's state (``save_only_model=True``, or no
  ``scheduler.pt`` beside ``optimizer.pt``): the weights resume alone, and EVON's posterior starts
  afresh (or, on a trainer that trained before, goes on from that state). The check is a
  ``load_state_dict`` post-hook on EVON, not the checkpoint's file names.
* ``_push_from_checkpoint(checkpoint_folder)``: copies a checkpoint's model files into the output
  directory and uploads it; the posterior files must be copied first, and only when it pushes
  (not with ``hub_strategy="end"``, nor while the previous push still uploads unless
  ``hub_always_push``): a skipped push leaves the output directory's model as it was, so its
  posterior stays too.
* ``_save(output_dir, state_dict)``, ``_load_from_checkpoint(checkpoint, model)`` and
  ``_load_best_model()``: for a model passed already wrapped by ``torch.compile``, the Trainer
  saves the wrapper's ``state_dict`` (every name under ``_orig_mod.``, which ``from_pretrained``
  does not load, beside a posterior and a card under the model's own names) and loads into the
  wrapper; the weights are saved and loaded under the model's own names instead. ``_load_best_model``
  also loads each of a PEFT model's active adapters from where PEFT saved it: the Trainer loads the
  checkpoint's root, which holds the adapter "default", into the first active one only, and PEFT saves
  any other adapter in a subfolder of its name, and then the checkpoint's posterior, before the
  Trainer calls ``on_train_end`` (its callbacks see the best weights beside their own posterior).
* ``_clip_grad_norm(model)`` / ``_get_grad_norm(model, grad_norm)``: the gradient norm the Trainer
  clips and logs; ``p.grad`` holds the *sum* over the step's recorded samples, which EVON divides by
  their number, so the norm and the clip refer to the mean gradient instead.

Private ``Trainer`` members called or set, each through one method here (pinned by
``tests/test_trainer_internals.py``):

* ``_wrap_model(model, training=False)`` and ``_prepare_inputs(batch)``
  (:meth:`TrainerInternals._evon_eval_model`, :meth:`TrainerInternals._evon_prepared`): EVON's own
  passes (BMA evaluation, ``predict(bma=True)``, the calibration) run the model and its batches as the
  Trainer's evaluation does (DDP where evaluation needs it, inputs on the device, TRL's input buffering
  refused where it applies).
* ``_loss_shifts_labels`` (:meth:`TrainerInternals._evon_set_loss_shift`): the Trainer decides it from
  ``model.loss_type``, which is None for e.g. GPT-2 although its loss shifts the labels; it then
  over-counts ``num_items_in_batch`` by one token per sequence, which makes its own ``eval_loss`` too
  small. The mixin reads it back as :attr:`TrainerInternals._evon_loss_shift`.
* ``_initial_global_step`` (:attr:`TrainerInternals._evon_initial_step`): an evaluation at that step
  is the one before this ``train()``'s first step (``eval_on_start``), which ``bma_eval_every``
  counts apart (pinned by ``tests/test_trainer_evaluation.py``'s ``eval_on_start`` runs).
* ``_memory_tracker``: ``predict(bma=True)`` reports the ``*_mem_*`` metrics as ``Trainer.predict``
  does. Its calls stay in that ``predict`` (:mod:`hf_evon.trainer.prediction`): the tracker names its
  stage by the function that calls it.

One private name of ``transformers.trainer`` is relied on: ``push_to_hub`` and
``_push_from_checkpoint`` upload through its ``hf_api()`` factory, which
:func:`~hf_evon.trainer.checkpointing.posterior_deleting_uploads` wraps for the length of the call so
that a folder without a posterior deletes the repo's older one in the same commit.

TRL's private members (pinned by ``tests/test_trl.py``):

* ``_total_train_tokens`` and ``_metrics["train"]["num_tokens"]``, corrected
  (:meth:`TrainerInternals._trl_tokens_counted_once`): ``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer``
  and ``RewardTrainer`` add a micro-batch's tokens at each ``compute_loss`` (and log them as
  ``num_tokens``); the mixin runs each micro-batch once per posterior sample, and its tokens count once.
* ``_buffered_inputs`` (:func:`~hf_evon.trainer.combined.buffers_generations`): the trainers that
  generate and buffer their own batches (GRPO, RLOO), whose refusals it decides (pinned by
  ``tests/test_trl.py``'s GRPO runs).
* ``SFTTrainer._prepare_dataset``, ``_skip_prepare_dataset`` and ``_formatting_func``
  (:meth:`TrainerInternals._trl_prepared_eval_dataset`): ``EVONSFTTrainer`` prepares a calibration
  dataset as TRL's own ``evaluate`` prepares a dataset passed to it, raw text included.
"""

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from transformers.trainer_utils import HubStrategy
from transformers.utils import ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME

from hf_evon.fileio import (
    UNREADABLE_STATE_ERRORS,
    Listed,
    listed_kind,
    no_file_text,
    raised_by_torch_load,
    unreadable_state,
)
from hf_evon.modeling import is_peft_model
from hf_evon.trainer.adalora import every_rank_loaded
from hf_evon.trainer.checkpointing import posterior_deleting_uploads, settings_replaced

__all__ = ["TrainerInternals"]


_COMPILED_PREFIX = "_orig_mod."


def _compiled_inner(model: Any) -> nn.Module | None:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) holds, or None for any other model."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def _active_adapter_folders(trainer: Any, model: nn.Module) -> list[tuple[str, str]]:
    """``(adapter, folder)`` of each of ``model``'s active PEFT adapters in the best checkpoint, in the
    order PEFT keeps them: PEFT saves "default" at the checkpoint's root and any other adapter in a
    subfolder of its name, while the Trainer loads the root's adapter into the first active one only.
    Empty without PEFT, where the first one is not saved, or where DeepSpeed or FSDP load the checkpoint
    their own way."""
    best = trainer.state.best_model_checkpoint
    if not best or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled or not is_peft_model(model):
        return []
    active = getattr(model, "active_adapters", None)
    found = []
    for adapter in active if isinstance(active, list | tuple) else ():
        folder = best if adapter == "default" else os.path.join(best, str(adapter))
        if any(_listed_weights(adapter, os.path.join(folder, f)) for f in (ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME)):
            found.append((str(adapter), folder))
        elif not found:  # the first one's folder is where the Trainer loads from: it is left to the Trainer
            return []
    return found


def _listed_weights(adapter: Any, path: str) -> bool:
    """Whether the best checkpoint lists the weights file ``path`` of ``adapter``; one that is a link to
    nothing, a directory or a named pipe is refused naming it: taken for none, the adapter would keep
    the last step's weights beside the best checkpoint's posterior (PEFT's own load calls it missing).
    One this user cannot look up raises the OSError naming it (:func:`~hf_evon.fileio.listed_kind`)."""
    kind = listed_kind(path)
    if kind in (None, Listed.FILE):
        return kind is Listed.FILE
    error = ValueError if kind is Listed.NOT_REGULAR else FileNotFoundError
    raise error(
        f"load_best_model_at_end: the weights of adapter {str(adapter)!r} in the best checkpoint, {path!r}, "
        f"are {no_file_text(path, kind)}"
    )


class TrainerInternals:
    """The private ``Trainer`` (and TRL) members :class:`~hf_evon.trainer.EVONTrainerMixin` overrides,
    calls or sets: the module docstring says which and why."""

    def _evon_eval_model(self) -> nn.Module:
        """The model as the Trainer's evaluation runs it: ``Trainer._wrap_model(model, training=False)``."""
        return self._wrap_model(self.model, training=False)

    def _evon_prepared(self, inputs: Any) -> Any:
        """A batch as the Trainer's passes take it (on the device): ``Trainer._prepare_inputs``."""
        return self._prepare_inputs(inputs)

    def _evon_set_loss_shift(self, shifts: bool) -> None:
        """Tell the Trainer whether the loss shifts the labels (``Trainer._loss_shifts_labels``)."""
        self._loss_shifts_labels = shifts

    @property
    def _evon_loss_shift(self) -> bool:
        """The Trainer's verdict: whether its loss shifts the labels (``Trainer._loss_shifts_labels``)."""
        return bool(getattr(self, "_loss_shifts_labels", False))

    @property
    def _evon_initial_step(self) -> int | None:
        """The step this ``train()`` started at (``Trainer._initial_global_step``; None before one)."""
        return getattr(self, "_initial_global_step", None)

    def _trl_prepared_eval_dataset(self, dataset: Any, name: str) -> Any:
        """``dataset`` prepared as TRL's ``SFTTrainer`` prepares an eval set (tokenized, packed as
        ``eval_packing`` says; idempotent on tokenized data), under the name ``name``."""
        if dataset is None or self._skip_prepare_dataset:
            return dataset
        packing = self.args.packing if self.args.eval_packing is None else self.args.eval_packing
        return self._prepare_dataset(dataset, self.processing_class, self.args, packing, self._formatting_func, name)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        inner = _compiled_inner(self.model)
        if inner is not None:  # the model's own names: what from_pretrained and the posterior use
            state_dict = inner.state_dict() if state_dict is None else {
                k.removeprefix(_COMPILED_PREFIX): v for k, v in state_dict.items()
            }  # fmt: skip
        super()._save(output_dir, state_dict=state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        inner = _compiled_inner(self.model if model is None else model)
        super()._load_from_checkpoint(resume_from_checkpoint, model if inner is None else inner)

    def _load_best_model(self) -> None:
        compiled, inner = self.model, _compiled_inner(self.model)
        best, adapters = self.state.best_model_checkpoint, _active_adapter_folders(self, compiled if inner is None else inner)
        if inner is not None:
            self.model = inner  # it loads into self.model; the compiled wrapper shares these parameters
        if adapters:  # the Trainer loads the checkpoint's root, which holds "default"'s adapter, into the first
            self.state.best_model_checkpoint = adapters[0][1]
        try:
            with every_rank_loaded(self.model):  # an AdaLoRA checkpoint holds every rank
                super()._load_best_model()
            for adapter, folder in adapters[1:]:  # the Trainer loads the first active adapter only
                self.model.load_adapter(folder, adapter)
        finally:
            self.model, self.state.best_model_checkpoint = compiled, best
        self._load_best_posterior()  # with the weights: on_train_end's callbacks see the pair

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        self._save_evon_fsdp2_state(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._load_fsdp2_scheduler(checkpoint):
            return
        optimizer = self.evon_optimizer
        if optimizer is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        # an aborted train()'s samples (stopped between micro-batches), dropped as on_train_begin drops
        # them, but first: EVON refuses to load a state over samples that await their step
        optimizer.discard_samples(rewind=True)
        fresh, seed, had_state = [dict(g) for g in optimizer.param_groups], optimizer.seed, bool(optimizer.state)
        # whether the Trainer loaded EVON's state: its own rules (which files, which together) decide
        loads: list[bool] = []
        hook = optimizer.register_load_state_dict_post_hook(lambda _: loads.append(True))
        try:
            super()._load_optimizer_and_scheduler(checkpoint)
        except UNREADABLE_STATE_ERRORS as err:
            if checkpoint is None or not raised_by_torch_load(err):  # EVON's refusals name what they refuse
                raise
            file, what = (SCHEDULER_NAME, "the scheduler's state") if loads else (OPTIMIZER_NAME, "EVON's state")
            raise unreadable_state(os.path.join(checkpoint, file), what, err) from err
        finally:
            hook.remove()
        if checkpoint is not None and not loads:
            what = (
                "goes on from the state this trainer already had (its last train()'s, not the checkpoint's)"
                if had_state
                else "starts afresh (its Hessian at hess_init, identity eigenbases, no momentum), so the "
                "posterior it ends with is learned from the steps after the resume only"
            )
            warnings.warn(
                f"resumed from {checkpoint}, whose optimizer state the Trainer did not load (save_only_model=True "
                f"saves none; it loads optimizer.pt only beside scheduler.pt): the weights resume, but EVON {what}",
                UserWarning,
                stacklevel=2,
            )
        changed = settings_replaced(fresh, optimizer.param_groups)
        if loads and optimizer.seed != seed:  # the checkpoint's noise stream goes on: exact resumes
            changed.append(f"seed: {seed} -> {optimizer.seed}")
        if changed:
            warnings.warn(
                f"resumed from {checkpoint}: its optimizer settings replace this run's where they differ "
                f"({'; '.join(changed)}); EVON trains on with the checkpoint's",
                UserWarning,
                stacklevel=2,
            )

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self._checkpoint_push_runs():
            self._copy_posterior_for_push(checkpoint_folder)
        with posterior_deleting_uploads():  # a checkpoint without a posterior: the repo's goes (root and folder)
            super()._push_from_checkpoint(checkpoint_folder)

    def _checkpoint_push_runs(self) -> bool:
        """Whether ``Trainer._push_from_checkpoint`` copies and uploads this checkpoint, by its own
        conditions: the posterior must move into the output directory exactly when the model does."""
        if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:
            return False
        running = self.push_in_progress
        return self.args.hub_always_push or running is None or running.is_done()

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        if self.evon_optimizer is None:
            return super()._clip_grad_norm(model)
        return self._mean_grad_norm(model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if self.evon_optimizer is None or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        return self._mean_grad_norm(model, None)

    def _mean_grad_norm(self, model: nn.Module, max_norm: float | None) -> torch.Tensor:
        """Norm of the mean gradient over the step's samples, clipped to ``max_norm`` if given.

        ``p.grad`` holds the sum over the step's ``sampled_params(train=True)`` blocks, which
        ``EVON.step`` divides by their number: the norm and the clip refer to the mean. A
        non-finite norm leaves the gradients as they are: scaling them by ``max_norm / nan``
        would write NaN into every gradient, and EVON's non-finite warning would then name the
        first parameter instead of the one that went wrong.
        """
        optimizer = self.evon_optimizer
        optimizer.synchronize()
        n = max(optimizer.recorded_samples, 1)
        params = [p for p in model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if max_norm is not None:
            # a non-finite norm counts as 0 here, whose clip factor is 1: the gradients keep their
            # values, decided on the device (a host check would wait for every queued kernel)
            finite = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
            torch.nn.utils.clip_grads_with_norm_(params, max_norm * n, finite, foreach=True)
        return total / n

    @contextmanager
    def _trl_tokens_counted_once(self, samples: int) -> Iterator[None]:
        """Around a micro-batch's ``samples`` runs of ``training_step``: TRL's ``_total_train_tokens``
        (and its logged ``num_tokens``) grow by the micro-batch's tokens once, not once per sample."""
        before = getattr(self, "_total_train_tokens", None)
        yield
        after = getattr(self, "_total_train_tokens", None)
        if samples > 1 and isinstance(before, int) and isinstance(after, int) and after != before:
            self._total_train_tokens = before + (after - before) // samples
            metrics = getattr(self, "_metrics", None)
            if isinstance(metrics, dict) and "num_tokens" in metrics.get("train", {}):
                metrics["train"]["num_tokens"] = [self._total_train_tokens]
