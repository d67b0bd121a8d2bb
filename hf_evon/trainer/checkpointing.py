"""What the EVON trainers write and read back: posteriors with the model, EVON's state under FSDP2.

* ``save_model()`` (which the Trainer's checkpoints call too) writes ``evon_posterior.safetensors``
  and ``evon_posterior_config.json`` next to the model (or the PEFT adapter) and the model card;
  with ``evon_shard`` the sharded state is gathered first, on every process, so the rank-0-only
  writing needs no collective. An AdaLoRA adapter is saved with every rank, the pruned ones as
  AdaLoRA's zeros (:func:`~hf_evon.trainer.adalora.every_rank_saved`): the posterior covers every rank.
* ``load_best_model_at_end``: once the Trainer restored the best checkpoint's weights, that
  checkpoint's posterior comes back with them (:meth:`CheckpointingMixin._load_best_posterior`).
* FSDP2: the Trainer's ``optimizer.bin`` (torch's distributed checkpoint, per-parameter state
  gathered by name) has no room for EVON's per-matrix state and noise streams, so EVON's full
  state goes to ``evon_optimizer.pt`` and a resume loads it after EVON is sharded over the mesh.
* ``train(resume_from_checkpoint=True)`` resumes from the newest *complete* checkpoint
  (:func:`resume_arguments`): the Trainer writes ``trainer_state.json`` last, in place, so a save
  killed mid-way leaves a directory without it (or with it cut short), which transformers would
  take as the newest (and fail on it, or resume EVON afresh where only the optimizer state is missing).
* A checkpoint pushed to the Hub carries its posterior (switched into the output directory first,
  with the save protocol of ``docs/posterior-format.md``).

The private ``Trainer`` methods that call into this module are overridden in
:mod:`hf_evon.trainer.internals`.
"""

import json
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.trainer import OPTIMIZER_NAME, OPTIMIZER_NAME_BIN, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings, safe_globals
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils.import_utils import check_torch_load_is_safe

from hf_evon.distributed.ddp import UnsupportedParallelismError
from hf_evon.fileio import (
    UNREADABLE_STATE_ERRORS,
    Listed,
    directory_lock,
    leads_to_directory,
    listed_kind,
    reachable_kind,
    replaced_atomically,
    unreadable_state,
)
from hf_evon.modeling import adapters_of_names, unwrap_model
from hf_evon.optim.checks import outside_stacklevel
from hf_evon.optim.validation import GROUP_KEYS
from hf_evon.posterior.fingerprint import mean_mismatches
from hf_evon.posterior.format import (
    POSTERIOR_CONFIG_NAME,
    POSTERIOR_WEIGHTS_NAME,
    STAGED_WEIGHTS_GLOB,
    PosteriorMismatchError,
    check_destination,
    copy_posterior,
    read_config,
    remove_posterior,
)
from hf_evon.posterior.hub import holds_posterior_config
from hf_evon.trainer.adalora import every_rank_saved
from hf_evon.trainer.card import save_trainer_model_card

__all__ = [
    "EVON_OPTIMIZER_NAME",
    "CheckpointingMixin",
    "other_weights",
    "posterior_deleting_uploads",
    "resume_arguments",
    "settings_replaced",
]

EVON_OPTIMIZER_NAME = "evon_optimizer.pt"  # FSDP2 checkpoints: EVON's full optimizer state


def _copy_named_adapters(checkpoint: str, output_dir: str, names: list[str]) -> None:
    """The folders of the PEFT adapters other than "default" that ``names`` (a posterior's) cover, from
    ``checkpoint`` into ``output_dir``, each replacing the one there: PEFT saves such an adapter in a
    folder of its name, which the Trainer's checkpoint push (the checkpoint's root files alone) leaves
    behind, so the repo would pair the posterior with no adapter, or with an older run's.

    The copy is staged beside the folder and swapped in by two renames, the old folder moved aside
    first and deleted last: a kill leaves the old folder or the new one in place, but between the
    two renames, where the old one waits aside and the next push puts it back before its own swap."""
    import shutil

    for name in sorted(adapters_of_names(names) - {"default"}):
        source = os.path.join(checkpoint, name)
        if os.path.isabs(name) or not os.path.isfile(os.path.join(source, "adapter_config.json")):
            continue
        target = os.path.join(output_dir, name)
        staged, aside = target + ".hf-evon-staging", target + ".hf-evon-replaced"
        if os.path.isdir(aside) and not os.path.lexists(target):  # a swap killed between its renames
            os.replace(aside, target)
        for leftover in (staged, aside):
            shutil.rmtree(leftover, ignore_errors=True)
        shutil.copytree(source, staged)
        if os.path.lexists(target):
            os.replace(target, aside)
        os.replace(staged, target)
        shutil.rmtree(aside, ignore_errors=True)


def other_weights(model: Any, fingerprint: Any, names: Any) -> list[str] | None:
    """The covered ``names`` whose weights in ``model`` are not the ones a posterior's ``mean_fingerprint``
    recorded (``[]``: its mean is these weights); None where that cannot be told: no fingerprint, a
    covered tensor the model lacks, or weights this process cannot read (under FSDP2 another rank holds
    their leading entries: ``EVONTrainerMixin._held_mismatch`` takes that rank's answer)."""
    params = dict(unwrap_model(model).named_parameters(remove_duplicate=False))
    names = list(names)
    if not fingerprint or not names or any(name not in params for name in names):
        return None
    return mean_mismatches(fingerprint, params, names)


# the settings a group's config gives: EVON's group keys and AdamW's (the EVON keys an AdamW group carries
# are inert there), the rate as torch's initial_lr (lr is the scheduled one), which each of a trainer's
# groups holds: the base the resumed schedule scales. Not configured_rate(), OneCycleLR's max_lr, which
# would leave a changed div_factor (its initial_lr) unnamed; EVON's configured_lr decides nothing where
# initial_lr is held (hf_evon.optim.rates: both records)
_EVON_SETTINGS = ("initial_lr", *(k for k in GROUP_KEYS if k != "lr"))
_ADAMW_SETTINGS = ("initial_lr", "betas", "weight_decay", "eps")


def settings_replaced(fresh: list[dict[str, Any]], loaded: list[dict[str, Any]]) -> list[str]:
    """``"group i key: this run's -> the checkpoint's"`` for each optimizer group setting that loading
    a checkpoint's state replaced (``torch.optim``'s ``load_state_dict`` restores the groups'
    settings). Not what EVON resolves or fits while it trains where the config leaves it open: an
    "auto" ess, a fitted or None prior."""
    changed = []
    for gi, (new, old) in enumerate(zip(fresh, loaded)):
        fitted = set(new.get("fit_to_curvature") or ())
        keys = _EVON_SETTINGS if new.get("algorithm") == "evon" else _ADAMW_SETTINGS
        for key in keys:
            value = new.get(key)
            if key in fitted or value is None or value == "auto" or key not in old:
                continue
            if old[key] != value:
                changed.append(f"group {gi} {key}: {value!r} -> {old[key]!r}")
    return changed


_CHECKPOINT_DIR = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")  # transformers' get_last_checkpoint's


def _incomplete(directory: str, needs: tuple[str, ...] = ()) -> str | None:
    """What ``directory`` lacks to resume from, or None. The Trainer writes the weights, the
    optimizer state and then ``trainer_state.json``, each in place: a save killed mid-way leaves no
    ``trainer_state.json``, or one cut short; ``needs`` are the further files the run resumes from.
    A file this user cannot look up raises the OSError naming it (:func:`~hf_evon.fileio.listed_kind`):
    taken for none, the checkpoint would be called cut short and an older one resumed."""
    state = os.path.join(directory, TRAINER_STATE_NAME)
    if listed_kind(state) is not Listed.FILE:
        return f"no {TRAINER_STATE_NAME}"
    try:
        with open(state, encoding="utf-8") as f:
            json.load(f)
    except (ValueError, OSError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"{TRAINER_STATE_NAME} cut short or unreadable: {str(err)[:120]}"
    missing = [name for name in needs if listed_kind(os.path.join(directory, name)) is not Listed.FILE]
    if not missing:
        return None
    lacks = f"no {' and no '.join(missing)}"
    if any(listed_kind(os.path.join(directory, name)) is not None for name in _OPTIMIZER_STATE_FILES):
        return lacks
    # trainer_state.json is written after the optimizer state: a save with the one and none of the other finished
    # without it. One of those files listed, a link that reaches nothing too, is no such save, and one this user
    # cannot look up raises naming it: taken for none, the error would advise save_only_model=True (weights alone)
    return f"{lacks}: {_SAVED_WITHOUT_OPTIMIZER}"


# what any of the Trainer's saves (the FSDP ones too) and EVON's under FSDP2 write of the optimizer state
_OPTIMIZER_STATE_FILES = (OPTIMIZER_NAME, SCHEDULER_NAME, OPTIMIZER_NAME_BIN, "optimizer_0", EVON_OPTIMIZER_NAME)
_SAVED_WITHOUT_OPTIMIZER = "saved without its optimizer state, as save_only_model=True saves"


def _listed_fsdp2_state(path: str) -> bool:
    """Whether an FSDP2 checkpoint lists its state file ``path`` (``evon_optimizer.pt``, ``scheduler.pt``)
    as a file to read. One listed that is a link to nothing or a loop of links is refused naming it: taken
    for none, EVON's state would be called missing, or the run would resume with a fresh learning-rate
    schedule. One this user cannot look up raises the OSError naming it
    (:func:`~hf_evon.fileio.reachable_kind`)."""
    kind = reachable_kind(
        path, lambda why: FileNotFoundError(f"EVONTrainer cannot resume this FSDP2 run: {path!r} is {why}")
    )
    return kind is Listed.FILE


def _listed_checkpoint_directory(path: str, what: str) -> bool:
    """Whether ``path`` (``what`` names it in the error) is a directory, or a link to one, to resume from. A
    link there that reaches nothing or a loop of links is refused naming it, and one this user cannot look up
    raises the OSError naming it (:func:`~hf_evon.fileio.reachable_kind`): taken for none, a newer checkpoint
    would be passed over for an older one, or the Trainer would answer that it finds no checkpoint there."""
    kind = reachable_kind(path, lambda why: FileNotFoundError(f"{what} {path!r} is {why}"))
    return leads_to_directory(path, kind)


def _how_to_resume(skipped: list[str]) -> str:
    """The ways to resume checkpoints saved without optimizer state, where ``skipped`` has one."""
    if not any(_SAVED_WITHOUT_OPTIMIZER in entry for entry in skipped):
        return ""
    return (
        ". Set save_only_model=True to resume such checkpoints, or pass resume_from_checkpoint=<its path> "
        "to resume its weights with EVON's state afresh"
    )


def _optimizer_files(trainer: Any) -> tuple[str, ...]:
    """The optimizer state files this run's checkpoints hold and its resume loads: none with
    ``save_only_model``; EVON's ``evon_optimizer.pt`` under FSDP2; DeepSpeed's and FSDP1's own
    layouts are theirs to check; else ``optimizer.pt`` beside ``scheduler.pt``."""
    if trainer.args.save_only_model:
        return ()
    if trainer._accelerate_fsdp2() or trainer._evon_fsdp2():
        return (EVON_OPTIMIZER_NAME,)
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        return ()
    return (OPTIMIZER_NAME, SCHEDULER_NAME)


def _checkpoint_to_resume(trainer: Any, resume: Any) -> Any:
    """``resume_from_checkpoint`` as ``Trainer.train`` is to get it: True becomes the newest complete
    checkpoint in ``output_dir`` (a warning names each newer one skipped and what it lacks); an
    explicit path to an incomplete checkpoint is a ValueError naming it and the file."""
    if resume is None or resume is False:
        return resume
    if not isinstance(resume, bool):
        directory = os.fspath(resume)
        listed = _listed_checkpoint_directory(directory, "resume_from_checkpoint")
        if listed and (lacks := _incomplete(directory)) is not None:
            raise ValueError(
                f"resume_from_checkpoint={directory!r} is an incomplete checkpoint ({lacks}): its save was "
                "cut short (the Trainer writes trainer_state.json last); resume from an earlier checkpoint"
            )
        if listed:
            _check_rng_state(trainer, directory)
        return resume
    output_dir = trainer.args.output_dir
    if not _listed_checkpoint_directory(output_dir, "resume_from_checkpoint=True: output_dir"):
        return resume  # the Trainer's own error
    steps = {int(m.group(1)): name for name in os.listdir(output_dir) if (m := _CHECKPOINT_DIR.match(name))}
    needs, skipped = _optimizer_files(trainer), []
    for step in sorted(steps, reverse=True):
        directory = os.path.join(output_dir, steps[step])
        if not _listed_checkpoint_directory(directory, "resume_from_checkpoint=True: checkpoint"):
            continue
        lacks = _incomplete(directory, needs)
        if lacks is None:
            _check_rng_state(trainer, directory)
            if skipped:
                warnings.warn(
                    f"resume_from_checkpoint=True: skipping the incomplete checkpoints "
                    f"({'; '.join(skipped)}); resuming from {directory}{_how_to_resume(skipped)}",
                    UserWarning,
                    stacklevel=outside_stacklevel(),  # the user's train() call, behind any subclass's
                )
            return directory
        skipped.append(f"{directory} ({lacks})")
    if skipped:
        raise ValueError(
            f"resume_from_checkpoint=True: no complete checkpoint in {output_dir} to resume from; each is "
            f"incomplete: {'; '.join(skipped)}{_how_to_resume(skipped)}"
        )
    return resume  # no checkpoint at all: the Trainer's own error


def _check_rng_state(trainer: Any, directory: str) -> None:
    """Warn where a checkpoint with its optimizer state lacks this process's RNG file (deleted; another number
    of processes): the Trainer only logs it, and the data order and dropout draw afresh (EVON's noise is in its
    state). One ``torch.load`` refuses is refused here, naming it, before the Trainer loads the weights."""
    args = trainer.args
    name = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
    if not os.path.isfile(path := os.path.join(directory, name)):
        if not args.save_only_model:
            message = f"resuming from {directory}, which has no {name}: the random states (data order, dropout) start afresh"
            warnings.warn(message + ", so the run does not continue as an uninterrupted one", UserWarning, stacklevel=outside_stacklevel())
        return
    try:
        with safe_globals():  # as the Trainer reads it: numpy's random state
            torch.load(path, weights_only=True)
    except UNREADABLE_STATE_ERRORS as err:
        raise unreadable_state(path, "the random number generators' state", err) from err


def resume_arguments(trainer: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``train(*args, **kwargs)``'s arguments with ``resume_from_checkpoint`` (its first) resolved by
    :func:`_checkpoint_to_resume`."""
    if args:
        return (_checkpoint_to_resume(trainer, args[0]), *args[1:]), kwargs
    if "resume_from_checkpoint" in kwargs:
        resume = _checkpoint_to_resume(trainer, kwargs["resume_from_checkpoint"])
        return args, {**kwargs, "resume_from_checkpoint": resume}
    return args, kwargs


# a posterior's files in a folder of a repo, relative to the folder (docs/posterior-format.md): the pair, and
# the staged weights a folder upload of a killed save's directory takes along
_HUB_POSTERIOR_FILES = (POSTERIOR_CONFIG_NAME, POSTERIOR_WEIGHTS_NAME, STAGED_WEIGHTS_GLOB)


class _PosteriorDeletingApi:
    """The Trainer's ``HfApi``, whose ``upload_folder`` of a folder without a posterior also deletes the
    repo's posterior files at that folder's place (``delete_patterns``, in the same commit): the model
    uploaded replaces the one they belong to. A folder with a posterior uploads its own over them."""

    def __init__(self, api: Any) -> None:
        self._api = api

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)

    def upload_folder(self, *args: Any, **kwargs: Any) -> Any:
        folder = kwargs.get("folder_path", args[1] if len(args) > 1 else None)
        if folder is not None and not holds_posterior_config(os.fspath(folder)):
            patterns = kwargs.get("delete_patterns") or []
            patterns = [patterns] if isinstance(patterns, str) else list(patterns)
            kwargs["delete_patterns"] = patterns + [p for p in _HUB_POSTERIOR_FILES if p not in patterns]
        return self._api.upload_folder(*args, **kwargs)


@contextmanager
def posterior_deleting_uploads() -> Iterator[None]:
    """While it lasts, the Trainer's uploads (``transformers.trainer.hf_api()``, which ``push_to_hub`` and
    ``_push_from_checkpoint`` call for each upload and offer no other hook to) go through
    :class:`_PosteriorDeletingApi`."""
    import transformers.trainer as trainer_module

    factory = trainer_module.hf_api
    trainer_module.hf_api = lambda: _PosteriorDeletingApi(factory())
    try:
        yield
    finally:
        trainer_module.hf_api = factory


class CheckpointingMixin:
    """Saving and resuming for :class:`~hf_evon.trainer.EVONTrainerMixin` (see the module docstring)."""

    # ------------------------------------------------------------------ the posterior with the model
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model (or adapter) as usual, plus the posterior and the model card."""
        self._gather_sharded_state()
        if self.posterior is not None and self.model is not None:  # every rank: under FSDP2 a collective
            self._held_mismatch(self.posterior)
        # taken first: a posterior that does not fit the model (merged away) refuses before anything is written
        posterior = self.current_posterior() if self.args.should_save else None
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self._check_posterior_destination(output_dir, posterior)
        with every_rank_saved(self.model):
            super().save_model(output_dir, _internal_call)
        if posterior is None:
            if self.args.should_save:
                self._remove_other_posterior(output_dir)
            return
        with directory_lock(output_dir):  # one turn: no other save comes between the posterior and its card
            posterior.save_pretrained(output_dir, model_card=False)
            self._write_model_card(output_dir, posterior)

    def _check_posterior_destination(self, directory: str, posterior: Any) -> None:
        """Refuse a save whose posterior ``directory`` refuses (:func:`~hf_evon.posterior.format.check_destination`)
        before the model is written: else the model replaces the one the directory's posterior belongs to, and
        then the posterior's save fails. Every rank refuses alike (under FSDP2 the model's save gathers on every
        rank): each looks at the directory itself, and one that does not save asks whether a posterior is saved
        without taking it (:meth:`current_posterior`'s choice, whose held verdict every rank shares)."""
        try:
            check_destination(directory)
        except IsADirectoryError:
            if self.args.should_save:
                saved = posterior is not None
            else:
                saved = self._takes_evon_posterior() or self._held_posterior() is not None
            if saved:
                raise

    def _remove_other_posterior(self, directory: str) -> None:
        """Where the model is saved without a posterior: remove the one ``directory`` holds (an earlier
        save's, or a pushed checkpoint's copy) unless it was taken at the model's weights (its
        ``mean_fingerprint``), so that no directory pairs a model with a posterior of other weights."""
        config_path = os.path.join(directory, POSTERIOR_CONFIG_NAME)
        # a config that is a link (to nothing, to a directory) or a named pipe counts too: loading the
        # directory takes it for its posterior and fails on it. A directory of that name is no file a
        # save wrote: remove_posterior leaves it
        if not holds_posterior_config(directory) and not os.path.lexists(os.path.join(directory, POSTERIOR_WEIGHTS_NAME)):
            return
        try:
            config = read_config(config_path)
            if other_weights(self.model, config.mean_fingerprint, config.parameters) == []:
                return  # the posterior of these very weights
        except (OSError, PosteriorMismatchError):  # none, or unreadable: nothing ties it to these weights
            pass
        removed = remove_posterior(directory)
        if removed:
            warnings.warn(
                f"{type(self).__name__}: the model saved in {directory} has no posterior, and the one there "
                f"({', '.join(removed)}) was taken at other weights (or cannot be told to be these weights' "
                "own): it is removed, not left beside this model as its posterior",
                UserWarning,
                stacklevel=outside_stacklevel(),
            )

    def _write_model_card(self, directory: str, posterior: Any) -> None:
        save_trainer_model_card(self, directory, posterior)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """The Trainer's push; the card it writes first loads the model and the posterior from the repo and
        branch pushed to (``revision``, else ``hub_revision``), which only this call knows (also without
        ``args.push_to_hub``). A model saved without a posterior is uploaded in a commit that deletes the
        repo's posterior files (:func:`posterior_deleting_uploads`)."""
        self._hub_push_revision = revision or self.args.hub_revision or "main"
        try:
            with posterior_deleting_uploads():  # a model saved without a posterior: the repo's goes too
                return super().push_to_hub(commit_message, blocking, token, revision, private, **kwargs)
        finally:
            self._hub_push_revision = None

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's card, then the EVON section (the Trainer's card replaces README.md).

        Called on every process (as transformers' example scripts do), a sharded EVON gathers its
        posterior here first: the card is written by rank 0 alone, which must not wait on a
        collective the others never join. (``push_to_hub`` calls it on rank 0 only, right after
        ``save_model`` gathered on every rank, so nothing is left to gather then.)"""
        self._gather_sharded_state()
        super().create_model_card(*args, **kwargs)
        if not self.is_world_process_zero():
            return
        posterior = self.current_posterior()
        if posterior is None and holds_posterior_config(self.args.output_dir):
            from hf_evon.posterior.posterior import EVONPosterior

            posterior = EVONPosterior.from_pretrained(self.args.output_dir)
        if posterior is not None:
            self._write_model_card(self.args.output_dir, posterior)

    def _load_best_posterior(self) -> None:
        """After the Trainer loaded the best checkpoint's weights: its posterior too (the
        optimizer's is the last step's)."""
        best = self.state.best_model_checkpoint
        if not best:
            return
        self._posterior_from_checkpoint, self.posterior = True, None
        if not holds_posterior_config(best):  # never the last step's posterior beside the best step's weights
            warnings.warn(
                f"load_best_model_at_end: the best checkpoint {best} holds no posterior, so the trainer has "
                "none for its weights (BMA evaluation and saving skip it)",
                UserWarning,
                stacklevel=2,
            )
            return
        from hf_evon.posterior.posterior import EVONPosterior

        self.posterior = EVONPosterior.from_pretrained(best, device=next(self.model.parameters()).device)

    def _copy_posterior_for_push(self, checkpoint_folder: str) -> None:
        """Copy the checkpoint's posterior (and card) into the output directory the Trainer uploads; for a
        checkpoint without one, remove the output directory's (:meth:`_remove_other_posterior`)."""
        if not self.is_world_process_zero():
            return
        if not holds_posterior_config(checkpoint_folder):
            # the checkpoint's model replaces the output directory's: an earlier push's posterior goes
            self._remove_other_posterior(self.args.output_dir)
            return
        from hf_evon.posterior.posterior import EVONPosterior

        output_dir = self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        # the save protocol, not two copies in place: a kill between them would pair the
        # checkpoint's weights with the previous config; the card in the same turn of the lock
        with directory_lock(output_dir):
            # read in full first (copy_posterior copies weights that carry a checkpoint_id as they are):
            # a checkpoint that does not load never replaces the output directory's posterior
            posterior = EVONPosterior.from_pretrained(checkpoint_folder)
            _copy_named_adapters(checkpoint_folder, output_dir, posterior.names)  # before the posterior
            copy_posterior(checkpoint_folder, output_dir)
            self._write_model_card(output_dir, posterior)

    # ------------------------------------------------------------------ sharded and FSDP2 state
    def _gather_sharded_state(self) -> None:
        """With ``evon_shard``: gather the optimizer state and posterior on every rank, so the
        Trainer's rank-0-only saving (``optimizer.pt``, the posterior) needs no collective."""
        opt = self.evon_optimizer
        if opt is not None and opt.sharding is not None:
            opt.sharding.prefetch()

    def _accelerate_fsdp2(self) -> bool:
        """Whether accelerate runs its FSDP2 plugin (the Trainer's ``fsdp`` arguments, version 2)."""
        return bool(getattr(self.accelerator, "is_fsdp2", False))

    def _fsdp_requested_without_plugin(self) -> bool:
        """Whether ``fsdp`` was asked for but accelerate runs without its FSDP plugin (CPUs)."""
        return bool(self.args.fsdp) and getattr(self.accelerator.state, "fsdp_plugin", None) is None

    def _check_fsdp_plugin(self) -> None:
        """Refuse, before anything is built, ``fsdp`` arguments that accelerate would silently turn
        into plain DDP, and the set-ups EVON cannot train: DeepSpeed (its engine flattens the weights
        and steps its own optimizer, or one from its config instead of EVON) and FSDP1 (flat
        parameters mixing matrices; the Trainer builds the optimizer on them, after wrapping)."""
        if getattr(self, "is_deepspeed_enabled", False):
            raise UnsupportedParallelismError(
                "EVONTrainer cannot train under DeepSpeed (TrainingArguments.deepspeed, or accelerate's "
                "DeepSpeed config: distributed type "
                f"{self.accelerator.state.distributed_type}): ZeRO flattens and partitions the weights, "
                "and EVON's posterior is per whole matrix. Drop the deepspeed setting: plain DDP with "
                "evon_shard=True shards EVON's state and work over the ranks, or use FSDP2 "
                '(fsdp_config={"fsdp_version": 2})'
            )
        if getattr(self, "is_fsdp_enabled", False) and not self._accelerate_fsdp2():
            raise UnsupportedParallelismError(
                "EVONTrainer cannot train under FSDP1 (the Trainer's fsdp arguments without "
                'fsdp_config={"fsdp_version": 2}, or accelerate\'s fsdp_version 1): its flat parameters '
                'mix matrices, and EVON\'s posterior is per whole matrix. Set fsdp_config={"fsdp_version": 2} '
                "(FSDP2, supported), or drop fsdp for plain DDP (evon_shard=True shards EVON's state)"
            )
        if self._fsdp_requested_without_plugin():
            raise UnsupportedParallelismError(
                "the Trainer's fsdp arguments are set, but accelerate did not enable FSDP (distributed "
                f"type {self.accelerator.state.distributed_type}): accelerate enables its FSDP plugin on "
                "GPUs and other accelerators only, not on CPU processes, so this run would silently be "
                "plain DDP. On CPUs drop fsdp/fsdp_config (DDP; evon_shard=True shards EVON's state and "
                "work), or shard the model yourself with torch.distributed.fsdp.fully_shard and a plain "
                "training loop (hf_evon.prepare_distributed supports FSDP2 on CPU/gloo)"
            )

    def _evon_fsdp2(self) -> bool:
        """Whether EVON runs under FSDP2 (accelerate's plugin, or sharded over an FSDP2 mesh)."""
        opt = self.evon_optimizer
        return opt is not None and (getattr(opt.sharding, "fsdp2", False) or self._accelerate_fsdp2())

    def _save_evon_fsdp2_state(self, output_dir: str) -> None:
        """Under FSDP2: EVON's full, unsharded state in ``evon_optimizer.pt`` (written atomically).

        ``optimizer.state_dict()`` is a collective (every rank calls it); the process that saves
        writes it.
        """
        if not self._evon_fsdp2():
            return
        state = self.evon_optimizer.state_dict()
        if self.args.should_save:
            with replaced_atomically(os.path.join(output_dir, EVON_OPTIMIZER_NAME)) as tmp:
                torch.save(state, tmp)

    def _load_fsdp2_scheduler(self, checkpoint: str | None) -> bool:
        """Under FSDP2, resume the scheduler here and EVON later; return whether it did.

        The Trainer resumes FSDP2 optimizers through torch's distributed checkpoint
        (``set_optimizer_state_dict``), which expects per-parameter state shaped (or sharded) like
        the parameters; EVON's per-matrix state (``L``, ``R``, bases) held by one owner fits
        neither. The Trainer loads optimizer states before ``prepare_distributed`` shards EVON,
        so the state file is only remembered here and loaded by :meth:`_load_fsdp2_optimizer`
        once EVON is sharded (every rank loads it and keeps its own part).
        """
        if checkpoint is None or not self._evon_fsdp2():
            return False
        path = os.path.join(checkpoint, EVON_OPTIMIZER_NAME)
        if not _listed_fsdp2_state(path):
            raise UnsupportedParallelismError(
                f"EVONTrainer cannot resume this FSDP2 run: the checkpoint {checkpoint} has no "
                f"{EVON_OPTIMIZER_NAME} (EVON's full optimizer state, written by EVONTrainer's FSDP2 "
                "checkpoints); the Trainer's optimizer.bin (torch.distributed.checkpoint) does not fit "
                "EVON's per-matrix state and lacks its noise streams"
            )
        self._evon_fsdp2_resume = path
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if _listed_fsdp2_state(scheduler):
            with warnings.catch_warnings(record=True) as caught:
                self.lr_scheduler.load_state_dict(_read_state(scheduler, "the learning-rate scheduler's state"))
            reissue_pt_warnings(caught)
        return True

    def _load_fsdp2_optimizer(self) -> None:
        """EVON's state remembered by :meth:`_load_fsdp2_scheduler`, now that EVON is sharded."""
        path = getattr(self, "_evon_fsdp2_resume", None)
        if path is None:
            return
        state = _read_state(path, "EVON's optimizer state", map_location="cpu")
        try:  # EVON's errors name neither the file nor the checkpoint
            self.evon_optimizer.load_state_dict(state)
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: {err}") from err
        self._evon_fsdp2_resume = None


def _read_state(path: str, what: str, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)``, its errors as :func:`unreadable_state`'s."""
    check_torch_load_is_safe()
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except UNREADABLE_STATE_ERRORS as err:
        raise unreadable_state(path, what, err) from err
