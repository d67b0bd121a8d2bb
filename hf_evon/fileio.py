"""Crash-safe file writes: the one place a file is written next to its final name and switched in.

A reader sees the old file or the new one, never a mix: the data goes to a temporary file in the
same directory (same file system), is flushed and fsynced, then ``os.replace`` switches it in, and
the directory is fsynced so the switch itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import stat
import struct
import threading
import uuid
from collections.abc import Callable, Iterator
from enum import Enum
from stat import S_ISDIR, S_ISLNK, S_ISREG

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "ANSI_ESCAPE",
    "UNREADABLE_STATE_ERRORS",
    "atomic_write",
    "directory_lock",
    "file_on_the_way",
    "looks_like_local_path",
    "refused_load_text",
    "fsync_dir",
    "fsync_file",
    "give_created_mode",
    "leads_to_directory",
    "Listed",
    "listed_directory",
    "listed_kind",
    "local_directory",
    "no_file_text",
    "raised_by_torch_load",
    "reachable_kind",
    "refuse_no_repo_id",
    "replaced_atomically",
    "temporary_name",
    "temporary_name_pattern",
    "unreadable_state",
]


def temporary_name(path: str) -> str:
    """A hidden, unique sibling of ``path``: ``.<name>.<32 hex>.tmp``."""
    folder, name = os.path.split(os.fspath(path))
    return os.path.join(folder, f".{name}.{uuid.uuid4().hex}.tmp")


def temporary_name_pattern(name: str) -> str:
    """The regular expression of every ``temporary_name`` of a file called ``name``."""
    return re.escape(f".{name}.") + r"[0-9a-f]{32}\.tmp"


def fsync_file(path: str) -> None:
    """Flush ``path``'s data to disk."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(directory: str) -> None:
    """Flush a directory's entries (a rename in it); a no-op where the platform cannot."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


@contextlib.contextmanager
def replaced_atomically(path: str) -> Iterator[str]:
    """Yield a temporary path to write; on a clean exit it is fsynced and switched onto ``path``,
    with the permissions of the file it replaces where there is one (as ``open(path, "w")`` keeps them).

    On an exception the temporary file is removed and ``path`` is left as it was::

        with replaced_atomically(target) as tmp:
            torch.save(state, tmp)
    """
    tmp = temporary_name(path)
    try:
        yield tmp
        fsync_file(tmp)
        with contextlib.suppress(FileNotFoundError):  # a 0600 file stays private, a 0444 one read-only
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # gone already after the replace
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def give_created_mode(path: str) -> None:
    """Give ``path`` the permissions ``open(path, "w")`` would have given it: 0666 less the umask.

    Writers that go through a temporary file of their own (safetensors' ``save_file``, Rust's
    ``tempfile``) create it 0600 and rename it, so their file is unreadable to the group and
    others whatever the umask. The mode is read off a file created beside ``path`` (a sibling
    ``temporary_name``, removed at once): reading the umask itself would change it for every thread.
    """
    probe = temporary_name(path)
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        mode = os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        os.remove(probe)
    os.chmod(path, mode)


def atomic_write(path: str, data: bytes | str) -> None:
    """Write ``data`` (text is UTF-8, newlines kept as given) to ``path`` atomically."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with replaced_atomically(path) as tmp, open(tmp, "wb") as fh:
        fh.write(payload)


class _Held(threading.local):
    """The (st_dev, st_ino) of the directories this thread holds the lock of."""

    def __init__(self) -> None:
        self.directories: set[tuple[int, int]] = set()


_held = _Held()


@contextlib.contextmanager
def directory_lock(directory: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``directory`` itself (no lock file is left behind).

    Writers that take it run one after the other, so one writer's clean-up never removes what
    another is still writing. The kernel drops the lock when its holder dies, so a killed
    writer never blocks the next one. Where the platform has no ``flock`` (Windows) this
    does not lock, nor where the file system refuses locks.

    A thread that holds it already takes it again at no cost, so several writes (a posterior's
    files, then its card) are one turn: no other writer comes between them.
    """
    if fcntl is None:
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        stat = os.fstat(fd)
        key = (stat.st_dev, stat.st_ino)
        held = _held.directories
        if key in held:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks (ENOLCK, EOPNOTSUPP): as where there is no flock
            pass
        held.add(key)
        try:
            yield
        finally:
            held.discard(key)
    finally:
        os.close(fd)  # releases the lock (a nested turn's descriptor holds none)


def file_on_the_way(path: str) -> str | None:
    """The nearest entry on the way to ``path`` that exists (``path``, else the folder above it, ...) where it
    is not a directory: what makes ``os.makedirs(path)`` fail, found before a run rather than at its first
    save; None where there is none."""
    existing = path
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing.rstrip(os.sep))
    return existing if existing and not os.path.isdir(existing) else None


def looks_like_local_path(value: str) -> bool:
    """Whether ``value`` is meant as a local path rather than a Hub repo id: it starts like a path,
    has more than one ``/`` (a repo id has at most one), uses the platform's other separator, or
    its first component is listed here as no regular file (``out/run`` beside an ``out/`` folder, or
    beside an ``out`` link to a disk not mounted). Hub clients answer a mistyped local path with
    "Repo id must be in the form ..." or, offline, with retries. A first component this user cannot
    look up raises the OSError naming it (:func:`listed_kind`)."""
    first = value.split("/", 1)[0]
    return (
        value.startswith((".", "/", "~", os.sep))
        or value.count("/") > 1
        or (os.altsep is not None and os.altsep in value)
        or (os.sep != "/" and os.sep in value)
        or ("/" in value and listed_kind(first) not in (None, Listed.FILE))
    )


class Listed(str, Enum):
    """What a directory lists under a file's name (:func:`listed_kind`), where something is listed."""

    FILE = "file"  # a regular file or a link to one
    LINK_TO_NOTHING = "link to nothing"
    LINK_LOOP = "loop of links"  # ELOOP
    NOT_REGULAR = "not a regular file"  # a directory, named pipe or device, or a link to one


def _listed_entry(path: str) -> os.stat_result | None:
    """``os.lstat(path)``; None only where no entry is listed under its name (ENOENT, ENOTDIR), any other
    error raises the OSError naming ``path``."""
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def listed_directory(path: str) -> bool:
    """Whether the directory of ``path`` lists a directory under its name: the entry itself, not a link
    to one. By the rule of :func:`listed_kind`: only a missing entry is none; one this user cannot look up
    raises the OSError naming ``path``."""
    entry = _listed_entry(path)
    return entry is not None and S_ISDIR(entry.st_mode)


def listed_kind(path: str) -> Listed | None:
    """What the directory of ``path`` lists under its name: the one rule for "is this file there".

    None only where ``os.lstat`` finds no entry (ENOENT, ENOTDIR); else its :class:`Listed`. Any other
    error (EACCES, ...) raises the OSError naming ``path``: a file this user cannot look up is no file
    that is missing, and taking it for one reads the directory as something else."""
    entry = _listed_entry(path)
    if entry is None:
        return None
    if S_ISLNK(entry.st_mode):
        try:
            entry = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return Listed.LINK_TO_NOTHING
        except OSError as err:
            if err.errno == errno.ELOOP:
                return Listed.LINK_LOOP
            raise
    return Listed.FILE if S_ISREG(entry.st_mode) else Listed.NOT_REGULAR


def reachable_kind(path: str, unreachable: Callable[[str], BaseException]) -> Listed | None:
    """:func:`listed_kind` of ``path``, refusing a link that reaches nothing: the one rule for it. A link
    to nothing or a loop of links raises ``unreachable(why)``, ``why`` naming its target
    (:func:`no_file_text`): taken for no entry, a file on a disk not mounted would read as missing. One
    this user cannot look up raises the OSError naming it."""
    kind = listed_kind(path)
    if kind in (Listed.LINK_TO_NOTHING, Listed.LINK_LOOP):
        raise unreachable(no_file_text(path, kind))
    return kind


def leads_to_directory(path: str, kind: Listed | None) -> bool:
    """Whether ``path``, listed as ``kind`` (:func:`listed_kind`), is a directory or a link to one; unlike
    :func:`listed_directory`, a link to a directory counts. ``kind`` is looked up already, so
    ``os.path.isdir`` (which takes any error for False) answers for what this entry reaches."""
    return kind is Listed.NOT_REGULAR and os.path.isdir(path)


def refuse_no_repo_id(
    value: str, no_directory: Callable[[], BaseException], no_repo_id: Callable[[], BaseException]
) -> None:
    """For a location no local directory holds (:func:`local_directory` False): raise ``no_directory()``
    where it is meant as a local path (:func:`looks_like_local_path`), ``no_repo_id()`` where it is no
    valid Hub repo id either. Hub clients answer both with "Repo id must be in the form ...", which hides
    that the directory does not exist."""
    if looks_like_local_path(value):
        raise no_directory()
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        raise no_repo_id() from None


def local_directory(
    path: str, unreachable: Callable[[str], BaseException], no_directory: Callable[[], BaseException]
) -> bool:
    """Whether ``path``, given as a location (a local directory, else a Hub repo id), is a local directory:
    the one rule for it. False only where nothing is listed under it (:func:`listed_kind` None), which
    the caller goes on to check as a repo id. A link that reaches nothing or a loop of links raises
    ``unreachable(why)`` (:func:`reachable_kind`); anything else listed that is no directory (a file, a
    named pipe, a link to one) raises ``no_directory()``. One this user cannot look up raises the OSError
    naming it: taken for no entry, it would send a local path to the Hub."""
    kind = reachable_kind(path, unreachable)
    if kind is not None and not leads_to_directory(path, kind):
        raise no_directory()
    return kind is not None


def no_file_text(path: str, kind: Listed) -> str:
    """Why ``path``, listed as ``kind`` (not :attr:`Listed.FILE`), is no file to read: "not a regular
    file (...)", or "a link to <target>, which ..." for a link that reaches none."""
    if kind is Listed.NOT_REGULAR:
        return "not a regular file (a directory, named pipe or device)"
    why = "leads into a loop of links (ELOOP)" if kind is Listed.LINK_LOOP else "does not exist"
    return f"a link to {os.readlink(path)!r}, which {why}"


# terminal colour codes, which some libraries put in their error messages
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
# the lines of torch's refusal that say how to load the file anyway, not why it was refused
_TORCH_ADVICE = ("Weights only load failed", "(1)", "(2)", "Please file an issue", "Check the documentation")


def refused_load_text(path: str, err: BaseException) -> str:
    """The one message for a file ``torch.load(weights_only=True)`` refuses (a pickle.UnpicklingError):
    it names ``path`` and gives the unpickler's reason (the global or opcode it met). torch's own
    message advises ``weights_only=False`` or allowing the global, which would run whatever code the
    file holds: the file is not trusted here, so the advice is left out."""
    reasons = []
    for line in ANSI_ESCAPE.sub("", str(err)).splitlines():
        line = line.strip()
        if "WeightsUnpickler error:" in line:
            line = line.split("WeightsUnpickler error:", 1)[1].strip()
        elif line.startswith(_TORCH_ADVICE):
            continue
        if line:
            reasons.append(line.split(". Please use", 1)[0].rstrip("."))
    why = "; ".join(reasons)[:300] or type(err).__name__
    return (
        f"{path}: refusing to load it: torch.load(weights_only=True) loads tensors and plain data only, "
        f"and this file holds more, which loading could run as code ({why})"
    )


# what torch.load raises for a file it cannot read (cut short, not a torch file) or refuses (a pickle)
UNREADABLE_STATE_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, OSError, struct.error)


def unreadable_state(path: str, what: str, err: BaseException) -> ValueError:
    """The error for a file ``torch.load(weights_only=True)`` raised ``err`` on (torch's names no file):
    it names ``path`` and ``what`` it holds; a refused pickle's without torch's advice to run its code."""
    if isinstance(err, pickle.UnpicklingError):
        return ValueError(refused_load_text(path, err))
    first = (str(err).splitlines() or [repr(err)])[0][:300]
    return ValueError(f"{path}: cannot read {what} ({first})")


def raised_by_torch_load(err: BaseException) -> bool:
    """Whether ``err`` was raised inside ``torch.load`` (reading a file), not by what its result was given to."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == "torch.serialization":
            return True
        tb = tb.tb_next
    return False
