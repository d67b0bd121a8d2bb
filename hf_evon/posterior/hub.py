"""EVON posteriors on the Hugging Face Hub: find the two files locally or download them; push a folder.

Only ``huggingface_hub`` calls live here. This module knows directories, repo ids and the
files' names; what the files hold is ``format``'s business, and the card's ``model_card``'s.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from huggingface_hub import CommitInfo, CommitOperationAdd, CommitOperationDelete, HfApi, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoSibling

import hf_evon.posterior.format as posterior_format
from hf_evon.fileio import Listed, listed_kind, local_directory, no_file_text, refuse_no_repo_id
from hf_evon.posterior.config import (
    POSTERIOR_CONFIG_NAME,
    POSTERIOR_WEIGHTS_NAME,
    WEIGHTS_FILE_RE,
    PosteriorConfig,
    PosteriorMismatchError,
)
from hf_evon.posterior.format import read_config
from hf_evon.posterior.snippet import TOKENIZER_FILE

T = TypeVar("T")

# keyword arguments of save_pretrained(push_to_hub=True) that go to push_to_hub
PUSH_KWARGS = (
    "repo_id",
    "commit_message",
    "private",
    "token",
    "revision",
    "create_pr",
    "path_in_repo",
    "endpoint",
)
# keyword arguments of from_pretrained that go to hf_hub_download
HUB_DOWNLOAD_KWARGS = ("force_download", "endpoint", "etag_timeout", "headers", "user_agent")


def subfolder_in_repo(subfolder: str | None) -> str | None:
    """``subfolder`` without leading or trailing slashes, as ``push_to_hub``'s ``path_in_repo`` is
    taken; None for the root."""
    return (subfolder or "").strip("/") or None


@dataclass(frozen=True)
class PosteriorSource:
    """Where :func:`read_posterior` reads a posterior: a local directory ``path`` (its ``subfolder``),
    or a Hub repo id and how to download from it (``hub_kwargs``: :data:`HUB_DOWNLOAD_KWARGS`).
    ``subfolder`` is kept as :func:`subfolder_in_repo` takes it."""

    path: str
    revision: str | None
    subfolder: str | None
    token: str | bool | None
    cache_dir: str | os.PathLike | None
    local_files_only: bool
    hub_kwargs: dict[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "subfolder", subfolder_in_repo(self.subfolder))

    @property
    def directory(self) -> str:
        """The local directory that holds the files, where ``path`` is one."""
        return os.path.join(self.path, self.subfolder) if self.subfolder else self.path


def resolve_files(source: PosteriorSource) -> tuple[PosteriorConfig, str, str]:
    """The validated config, its local path and the local path of the weights file it names.

    From a directory, or downloaded from the Hub. The config comes first: it names the
    weights file, which is how a reader sees one consistent pair while a save runs.
    """
    path, revision, subfolder = source.path, source.revision, source.subfolder
    token, cache_dir, local_files_only = source.token, source.cache_dir, source.local_files_only
    if _is_local(path):
        directory = source.directory
        config_path = os.path.join(directory, POSTERIOR_CONFIG_NAME)
        # not listed, or a link that reaches no file: missing. One that is no regular file: read_config says so
        kind = listed_kind(config_path)
        if kind in (None, Listed.LINK_TO_NOTHING, Listed.LINK_LOOP):
            raise FileNotFoundError(_missing_text(directory, POSTERIOR_CONFIG_NAME, POSTERIOR_CONFIG_NAME, kind))
        config = read_config(config_path)
        weights_path = os.path.join(directory, config.weights_name)
        kind = listed_kind(weights_path)
        if kind is Listed.NOT_REGULAR:
            raise PosteriorMismatchError(
                f"{weights_path}: not a regular file (a named pipe, device or directory); refusing to read it "
                f"as the weights {POSTERIOR_CONFIG_NAME} names"
            )
        if kind is not Listed.FILE:
            named = f"{config.weights_name} (named by {POSTERIOR_CONFIG_NAME})"
            raise FileNotFoundError(_missing_text(directory, config.weights_name, named, kind))
        return config, config_path, weights_path
    _check_repo_id(path)

    where = _hub_location(source)

    def download(fname: str, at: str | None, max_bytes: int | None = None) -> str:
        kwargs = dict(
            subfolder=subfolder,
            revision=at,
            token=token,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            **source.hub_kwargs,
        )
        try:
            if max_bytes is not None:
                # the size the Hub reports (the HEAD request a download makes), before any byte lands
                # on disk: read_config's limit applies only once the whole file is downloaded. A push
                # landing between this request and the download is not covered (huggingface_hub has
                # no download with a size cap); read_config still reads no more than the limit
                info = hf_hub_download(path, fname, dry_run=True, **kwargs)
                if info.will_download and info.file_size is not None and info.file_size > max_bytes:
                    raise PosteriorMismatchError(
                        f"EVON posterior at {where}: {fname} is {info.file_size} bytes on the Hub, larger than "
                        f"{max_bytes} bytes (a posterior config takes about 200 bytes per covered parameter); "
                        "refusing to download it"
                    )
            return hf_hub_download(path, fname, **kwargs)
        except EntryNotFoundError as err:
            if isinstance(err, LocalEntryNotFoundError):  # offline / not cached: not "missing"
                # huggingface_hub's message names neither the repo nor the file
                raise LocalEntryNotFoundError(
                    f"EVON posterior at {where}: {fname} is not in the Hub cache and cannot be "
                    f"downloaded (local_files_only={local_files_only}): {err}"
                ) from err
            raise FileNotFoundError(f"no EVON posterior at {where}: {fname} is missing ({err})") from err

    config_file = download(POSTERIOR_CONFIG_NAME, revision, posterior_format.MAX_CONFIG_BYTES)
    with _named_by(where):
        config = read_config(config_file)
    # the weights of the config's own commit: a push between the two downloads would pair the
    # config with the next commit's weights (its checkpoint_id refuses such a pair)
    return config, config_file, download(config.weights_name, _snapshot_commit(config_file) or revision)


def _hub_location(source: PosteriorSource) -> str:
    """The repo, subfolder and revision a posterior is read from, as errors name them."""
    subfolder, revision = source.subfolder, source.revision
    return f"{source.path}" + (f"/{subfolder}" if subfolder else "") + (f" (revision {revision})" if revision else "")


@contextlib.contextmanager
def _named_by(where: str) -> Iterator[None]:
    """A refusal of a downloaded file named by the repo too (its own message names the Hub cache's copy)."""
    try:
        yield
    except PosteriorMismatchError as err:
        raise PosteriorMismatchError(f"EVON posterior at {where}: {err}") from err


def _is_local(path: str) -> bool:
    """Whether ``path`` is a local directory; False where nothing is listed under it (a Hub repo id, or a
    mistyped path :func:`_check_repo_id` refuses). Anything else listed there is refused naming it
    (:func:`~hf_evon.fileio.local_directory`): a file, a link that reaches nothing, and an entry this user
    cannot look up, which taken for no entry sends a local path to the Hub."""
    return local_directory(
        path,
        lambda why: FileNotFoundError(f"no EVON posterior at {path!r}: it is {why}"),
        lambda: ValueError(f"{path!r} is a file; pass the directory that holds {POSTERIOR_CONFIG_NAME}"),
    )


def _missing_text(directory: str, name: str, shown: str, kind: Listed | None) -> str:
    """Why the file ``name`` (``shown`` so) of a local posterior is not there: missing (``kind`` None), or
    a link that reaches no file (its :func:`~hf_evon.fileio.listed_kind`), which ``ls`` still lists: its
    target is named."""
    if kind is None:
        return f"no EVON posterior in {directory!r}: {shown} is missing"
    return f"no EVON posterior in {directory!r}: {shown} is {no_file_text(os.path.join(directory, name), kind)}"


def holds_posterior_config(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` lists a posterior config: also one that is a named pipe, a directory or a
    link that reaches no file, which loading refuses naming it (:func:`resolve_files`), not a directory
    without a posterior. The rule :func:`resolve_files` finds a config missing by
    (:func:`~hf_evon.fileio.listed_kind`). A directory whose entries this user cannot look up raises
    the PermissionError naming the config: no answer there is "no posterior"."""
    return listed_kind(os.path.join(directory, POSTERIOR_CONFIG_NAME)) is not None


def _snapshot_commit(cached: str) -> str | None:
    """The commit a file of the Hub cache was downloaded at (``.../snapshots/<sha>/...``), or None."""
    parts = Path(cached).parts
    if "snapshots" in parts[:-1]:
        sha = parts[parts.index("snapshots") + 1]
        if re.fullmatch(r"[0-9a-f]{40}", sha):
            return sha
    return None


def _check_repo_id(path: str) -> None:
    """Refuse a location that is no directory here and cannot be a Hub repo id: huggingface_hub
    would answer "Repo id must be in the form ...", hiding that the directory does not exist."""
    refuse_no_repo_id(
        path,
        lambda: FileNotFoundError(f"no EVON posterior at {path!r}: no such directory"),
        lambda: FileNotFoundError(
            f"no EVON posterior at {path!r}: no such directory, and not a Hub repo id ('name' or 'namespace/name')"
        ),
    )


def _local_switch_state(source: PosteriorSource) -> tuple[str | None, str] | None:
    """(checkpoint_id, weights file) of the config in a local directory, None where none is readable."""
    try:
        config = read_config(os.path.join(source.directory, POSTERIOR_CONFIG_NAME))
    except (PosteriorMismatchError, OSError):
        return None
    return config.checkpoint_id, config.weights_name


# A reader retries only after a save has switched the directory (a whole new posterior was
# written), so this bounds how many saves in a row a reader may lose to; two writers saving
# back to back on a busy machine won three races in a row
_READ_ATTEMPTS = 16


def read_posterior(
    source: PosteriorSource, read: Callable[[PosteriorConfig, str], T]
) -> tuple[PosteriorConfig, dict[str, str], T]:
    """:func:`resolve_files`, then ``read(config, weights_path)``; also the local paths of the two files
    read, by file name (in the Hub cache: the snapshot of the commit they were downloaded at).

    In a local directory a save may switch the config between this reader's reading the
    config and its reading the weights (the weights it named are gone or replaced): where the
    config has changed since, the pair is read again, so a reader sees the old posterior or a
    new one, never an error caused by a concurrent save.
    """
    local = _is_local(source.path)
    attempts = 0
    while True:
        before = _local_switch_state(source) if local else None
        try:
            config, config_path, weights_path = resolve_files(source)
            files = {POSTERIOR_CONFIG_NAME: config_path, config.weights_name: weights_path}
            with contextlib.nullcontext() if local else _named_by(_hub_location(source)):
                return config, files, read(config, weights_path)
        except (PosteriorMismatchError, FileNotFoundError):
            attempts += 1
            if not local or attempts == _READ_ATTEMPTS or _local_switch_state(source) == before:
                raise


def push_folder(
    repo_id: str,
    write: Callable[[str, str, dict[str, Any]], None],
    file_names: Sequence[str],
    *,
    commit_message: str,
    private: bool | None,
    token: str | bool | None,
    revision: str | None,
    create_pr: bool,
    path_in_repo: str | None,
    endpoint: str | None,
) -> CommitInfo:
    """Upload ``file_names`` (to ``path_in_repo``) and the repo's ``README.md`` (where ``write`` leaves one) in one commit.

    The repo (and the branch ``revision``) is created if needed; its other files are kept, but for
    staged weights files (``evon_posterior.<checkpoint_id>.safetensors``) in ``path_in_repo``, removed.
    ``write(files_dir, card_dir, location)`` writes ``file_names`` into
    ``files_dir`` and ``README.md`` into ``card_dir``, where what the card reads of the repo's
    root has been put: its current card, to be updated, and its tokenizer's
    ``tokenizer_config.json`` (the card's snippet loads a tokenizer only where one is saved),
    each where the repo has it. ``location`` is where the files land, as the card's snippet
    loads them: ``repo_id`` (as the Hub resolved it, namespace included), ``subfolder`` and
    ``revision`` (None for the default branch; a pull request's target branch with ``create_pr``).
    Returns the ``huggingface_hub.CommitInfo``.
    """
    api = HfApi(endpoint=endpoint, token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    if revision is not None and revision != "main" and not revision.startswith("refs/pr/"):
        # a pull request needs its target branch too (transformers' push_to_hub creates it alike);
        # a PR ref (``refs/pr/N``) is pushed to as it is, never created as a branch
        try:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        except HfHubHTTPError as err:
            # no write access: a PR can still be opened where the branch exists (else the commit says so)
            if not (create_pr and err.response is not None and err.response.status_code == 403):
                raise
    folder = subfolder_in_repo(path_in_repo) or ""  # the rule from_pretrained reads a subfolder by
    with tempfile.TemporaryDirectory(prefix="evon_posterior_push_") as tmp:
        card_dir = os.path.join(tmp, "card")
        files_dir = os.path.join(tmp, "files")
        os.makedirs(card_dir)
        # the branch's commit, read once: the card, tokenizer and staged weights are read there and the
        # push commits onto it (parent_commit), so an edit landing between the read and the commit (a
        # card added to a repo that had none too) is refused rather than overwritten by the pushed card
        info = api.model_info(repo_id, revision=revision)
        read_at = info.sha
        for name in ("README.md", TOKENIZER_FILE):
            try:
                existing = hf_hub_download(
                    repo_id,
                    name,
                    revision=read_at or revision,
                    token=token,
                    endpoint=api.endpoint,
                    cache_dir=os.path.join(tmp, "cache"),
                )
                shutil.copyfile(existing, os.path.join(card_dir, name))
            except (EntryNotFoundError, RevisionNotFoundError) as err:
                if isinstance(err, LocalEntryNotFoundError):  # offline: never replace a card unseen
                    raise
        branch = None if revision in (None, "main") else revision
        write(files_dir, card_dir, {"repo_id": repo_id, "subfolder": folder or None, "revision": branch})
        operations = [
            CommitOperationAdd(
                path_in_repo=f"{folder}/{fname}" if folder else fname,
                path_or_fileobj=os.path.join(files_dir, fname),
            )
            for fname in file_names
        ]
        if os.path.isfile(os.path.join(card_dir, "README.md")):  # none where no card is pushed to a repo without one
            operations.append(
                CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=os.path.join(card_dir, "README.md"))
            )
        staged = _staged_weights(info.siblings or [], folder)
        operations += [CommitOperationDelete(path_in_repo=p) for p in staged]
        try:
            return api.create_commit(
                repo_id,
                operations,
                commit_message=commit_message,
                revision=revision,
                create_pr=create_pr,
                parent_commit=read_at,
            )
        except HfHubHTTPError as err:  # the Hub answers a moved parent with 412 (or 409)
            status = None if err.response is None else err.response.status_code
            if read_at is None or status not in (409, 412):
                raise
            raise RuntimeError(
                f"{repo_id} changed during the push: {revision or 'main'} moved on from commit {read_at}, "
                "where the push read its card (or found none), before the commit (another push or edit); "
                "nothing was pushed, so no change was overwritten: push again to update the card as it is now"
            ) from err


def _staged_weights(siblings: Sequence[RepoSibling], folder: str) -> list[str]:
    """The staged weights files (``evon_posterior.<checkpoint_id>.safetensors``) in ``folder``, of
    ``siblings`` (the repo's files at the commit the push reads).

    A folder uploaded just after an interrupted save holds one, named by its config; the pushed
    config names the canonical file, so the staged one is nobody's weights any more. A reader
    that has the old config downloads its weights at that config's commit, where they stay.
    """
    prefix = f"{folder}/" if folder else ""
    return [
        s.rfilename
        for s in siblings
        if s.rfilename.startswith(prefix)
        and WEIGHTS_FILE_RE.fullmatch(name := s.rfilename[len(prefix) :])
        and name != POSTERIOR_WEIGHTS_NAME
    ]
