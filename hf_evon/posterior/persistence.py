"""An :class:`~hf_evon.EVONPosterior`'s files: saved beside a model, loaded from a directory or the Hub, pushed.

:class:`PosteriorFilesMixin` gives the posterior ``to_tensors``, ``save_pretrained``,
``from_pretrained`` and ``push_to_hub`` over the layers below: the file format (``config``,
``format``, ``docs/posterior-format.md``), the Hub (``hub``) and the model card (``model_card``).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, TypeVar

import torch

from hf_evon.fileio import directory_lock
from hf_evon.optim.checks import require
from hf_evon.posterior.config import (
    POSTERIOR_CONFIG_NAME,
    POSTERIOR_WEIGHTS_NAME,
    PosteriorConfig,
    as_dtype,
    declared_basis_dtype,
    dtype_name,
)
from hf_evon.posterior.format import check_finite_std, file_tensors, read_factor_groups, write_posterior
from hf_evon.posterior.hub import (
    HUB_DOWNLOAD_KWARGS,
    PUSH_KWARGS,
    PosteriorSource,
    push_folder,
    read_posterior,
)
from hf_evon.posterior.model_card import card_arguments, retract_card_section, save_model_card
from hf_evon.posterior.names import warn_peft_unsaved

Tensor = torch.Tensor

__all__ = ["PosteriorFilesMixin"]

P = TypeVar("P", bound="PosteriorFilesMixin")


def _trained_scale_checked(config: Any, read: tuple[list[Any], Any]) -> tuple[list[Any], Any]:
    """``read`` (the factor groups and their read precision), once the trained ζ the config records
    (``trained_ess``, ``trained_ess_by_parameter``; what calibration and ``predict_uncertainty`` put
    back) is known to give every matrix a finite std, as its own ``ess`` is (``check_finite_std``)."""
    trained = config.trained_ess
    if trained is not None:
        by_name = config.trained_ess_by_parameter or {}
        for g in read[0]:
            scales = [float(by_name.get(n, trained)) for n in g.names]
            for ess in set(scales):
                idx = [i for i, s in enumerate(scales) if s == ess]
                whole = len(idx) == len(scales)  # the group at one scale: its hess as it is, not a copy
                part = replace(g, ess=ess) if whole else replace(g, names=[g.names[i] for i in idx], hess=g.hess[idx], ess=ess)
                check_finite_std([part], config.source, field="trained_ess")
    return read


class PosteriorFilesMixin:
    """Saving, loading and pushing of :class:`~hf_evon.EVONPosterior` (its ``factors``, ``config``, ``names``
    and point-estimate counts; ``check_model`` for a loaded posterior's ``model=``)."""

    # set by from_pretrained on the posterior it returns: the local paths of the files it read, by
    # file name (from the Hub: in the cache's snapshot of the commit it read). None otherwise
    loaded_files: dict[str, str] | None = None

    # ------------------------------------------------------------------ files
    def to_tensors(self, eigenbasis_dtype: torch.dtype | str | None = None) -> dict[str, Tensor]:
        """The file's tensors (``<name>.Q_L``, ``.Q_R``, ``.hess``; CPU) as ``save_pretrained`` writes them."""
        return file_tensors(self.factors, eigenbasis_dtype, declared_basis_dtype(self.config))

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        eigenbasis_dtype: torch.dtype | None = None,
        push_to_hub: bool = False,
        **kwargs: Any,
    ) -> None:
        """Write ``evon_posterior.safetensors`` + ``evon_posterior_config.json`` (+ model card).

        Safe beside a model: only these two files and ``README.md`` (updated, not replaced)
        are touched. Atomic: a failed save leaves the previous checkpoint intact. The format
        is specified in ``docs/posterior-format.md``. A posterior over a module PEFT's own save drops (a
        prompt encoder's projection: ``prefix_projection=True``, P-tuning's head) warns, naming what to keep;
        so does one the adapter PEFT saved in ``save_directory`` holds at another shape (AdaLoRA's pruned ranks).

        Args:
            save_directory: the directory (created if needed), e.g. the model's or adapter's.
            eigenbasis_dtype: ``torch.bfloat16``/``torch.float16`` stores ``Q_L``/``Q_R`` in
                half precision (about half the file); ``H`` keeps its dtype (float32, float64 for float64 weights).
                Default: ``config["eigenbasis_dtype"]`` (a posterior read from half-precision files: as read).
            push_to_hub: afterwards also :meth:`push_to_hub` (``repo_id`` defaults to the
                directory's name; other keyword arguments are passed on).
            model_card (kwarg, default True): create/update ``README.md``. With False, an EVON section
                already there (it described the posterior replaced) becomes a note naming the config.
            model_card_kwargs (kwarg): passed to ``hf_evon.posterior.model_card.save_model_card``
                (``base_model``, ``metrics``, ...).
        """
        write_card = kwargs.pop("model_card", True)
        card_kwargs = card_arguments(kwargs.pop("model_card_kwargs", None))
        push_kwargs = {}
        if push_to_hub:
            push_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in PUSH_KWARGS}
        if kwargs:
            raise TypeError(f"save_pretrained() got unexpected keyword arguments: {sorted(kwargs)}")
        directory = os.fspath(save_directory)
        if os.path.isfile(directory):
            raise ValueError(f"save_directory {directory!r} is a file, not a directory")
        eig = as_dtype(eigenbasis_dtype, "eigenbasis_dtype") or declared_basis_dtype(self.config)
        warn_peft_unsaved(directory, {n: self[n].shape for n in self.names})  # before any file is written
        os.makedirs(directory, exist_ok=True)
        factors = self.factors
        config = PosteriorConfig.for_save(
            self.config, factors, eig, self.num_point_estimates, self.num_point_estimate_tensors
        )
        tensors = file_tensors(factors, eig, declared_basis_dtype(self.config))  # pre-lock: others wait less
        with directory_lock(directory):  # one turn: no other save comes between the posterior and its card
            write_posterior(directory, tensors, config)
            if write_card:  # the card describes the files: their eigenbasis dtype
                save_model_card(directory, _as_saved(self, eig), **card_kwargs)
        if push_to_hub:
            repo_id = push_kwargs.pop("repo_id", None) or os.path.basename(os.path.abspath(directory))
            push_kwargs.update(model_card_kwargs=card_kwargs, model_card=write_card)
            self.push_to_hub(repo_id, eigenbasis_dtype=eig, **push_kwargs)

    @classmethod
    def from_pretrained(
        cls: type[P],
        dir_or_repo_id: str | os.PathLike,
        revision: str | None = None,
        subfolder: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        **kwargs: Any,
    ) -> P:
        """Load a posterior from a local directory or a Hub repo (``revision``, ``subfolder``).

        Every file is validated (``docs/posterior-format.md``); a problem raises
        :class:`PosteriorMismatchError` naming the tensor. Only safetensors and JSON are read.

        Keyword arguments:
            device: where to put the factors (default ``"cpu"``).
            model: if given, :meth:`check_model` is run against it.
            reorthonormalize: one Newton–Schulz polar step on every basis after loading
                (useful for half-precision bases; default False).
            force_download, endpoint, etag_timeout, headers, user_agent: passed to
                ``huggingface_hub.hf_hub_download``.

        The returned posterior's ``loaded_files`` maps the two file names to the local paths read: from
        the Hub, the cache's snapshot of the commit read, which a later push or download does not change.
        """
        device = kwargs.pop("device", "cpu")
        # the load checks every tensor's values (finite, orthonormal), which a meta tensor does not hold
        require("from_pretrained: device", device, not isinstance(device, (str, torch.device)) or torch.device(device).type != "meta",
                "a device that holds values (cpu, cuda, ...), not 'meta'")  # fmt: skip
        model = kwargs.pop("model", None)
        reorthonormalize = kwargs.pop("reorthonormalize", False)  # a string like "no" is no flag
        require("from_pretrained: reorthonormalize", reorthonormalize, isinstance(reorthonormalize, bool), "True or False")
        hub_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in HUB_DOWNLOAD_KWARGS}
        if kwargs:
            raise TypeError(f"from_pretrained() got unexpected keyword arguments: {sorted(kwargs)}")
        source = PosteriorSource(
            os.fspath(dir_or_repo_id), revision, subfolder, token, cache_dir, local_files_only, hub_kwargs
        )
        config, files, (groups, read_dtype) = read_posterior(
            source, lambda config, weights: _trained_scale_checked(config, read_factor_groups(config, weights, device, reorthonormalize))
        )
        settings = config.settings()
        if read_dtype is not None:  # half-precision bases under a config that declares no dtype
            settings["eigenbasis_dtype"] = dtype_name(read_dtype)
        posterior = cls(groups, settings, config.num_point_estimates, config.num_point_estimate_tensors)
        posterior.loaded_files = files
        if model is not None:
            posterior.check_model(model)
        return posterior

    # ------------------------------------------------------------------ hub
    def push_to_hub(
        self,
        repo_id: str,
        commit_message: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        eigenbasis_dtype: torch.dtype | None = None,
        model_card_kwargs: dict[str, Any] | None = None,
        *,
        path_in_repo: str | None = None,
        endpoint: str | None = None,
        model_card: bool = True,
    ) -> Any:
        """Upload the posterior (+ updated model card) to a Hub repo in one commit.

        The repo is created if needed; files already in it (the model's, an adapter's) are
        kept, and an existing ``README.md`` is updated, not replaced. ``path_in_repo`` puts
        the two posterior files in a subfolder (load with ``subfolder=``); the card stays at
        the repo root. ``revision`` commits to that branch (created if missing). ``model_card=False``
        pushes no card; an EVON section already in the repo's card becomes a note, as in a local save.
        Returns the ``huggingface_hub.CommitInfo``.
        """
        card_kwargs = card_arguments(model_card_kwargs)
        as_dtype(eigenbasis_dtype, "eigenbasis_dtype")  # refused before the repo is created

        def write(files_dir: str, card_dir: str, location: dict[str, Any]) -> None:
            self.save_pretrained(files_dir, eigenbasis_dtype=eigenbasis_dtype, model_card=False)
            if model_card:  # the snippet loads from `location`; the card describes the files pushed
                save_model_card(card_dir, _as_saved(self, as_dtype(eigenbasis_dtype, "eigenbasis_dtype")), **{**location, **card_kwargs})
            else:  # the section there describes the posterior this push replaces
                retract_card_section(card_dir)

        return push_folder(
            repo_id,
            write,
            (POSTERIOR_WEIGHTS_NAME, POSTERIOR_CONFIG_NAME),
            commit_message=commit_message or "Upload EVON posterior",
            private=private,
            token=token,
            revision=revision,
            create_pr=create_pr,
            path_in_repo=path_in_repo,
            endpoint=endpoint,
        )


class _AsSaved:
    """A posterior as its files describe it (``config``: the one saved), for the card rendered beside them."""

    def __init__(self, posterior: Any, config: dict[str, Any]) -> None:
        self._posterior, self.config = posterior, config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._posterior, name)


def _as_saved(posterior: Any, eigenbasis_dtype: torch.dtype | None) -> Any:
    """``posterior`` as files saved with ``eigenbasis_dtype`` (None: its own) describe it, for their card."""
    if eigenbasis_dtype is None:
        return posterior
    return _AsSaved(posterior, {**posterior.config, "eigenbasis_dtype": dtype_name(eigenbasis_dtype)})
