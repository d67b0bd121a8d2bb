"""Shared pytest set-up: deterministic, single-threaded CPU runs."""

from __future__ import annotations

import importlib.util
import os
import stat
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The tests use tiny matrices: more threads only add overhead (and oversubscribe CI runners).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fixed_seed() -> None:
    """Every test starts from the same global RNG state (tests may still seed their own)."""
    torch.manual_seed(0)


# The unclipped algorithm with the settings most tests here were written for (EVON's own defaults
# before ess="auto" and the clipping defaults): a test names only the values it changes.
PLAIN_EVON = dict(
    lr=1e-3,
    ess=float("inf"),
    hess_init=0.1,
    betas=(0.9, 0.999),
    weight_decay=1e-4,
    hess_clip_ratio=None,
    clip="none",
    clip_radius=1.0,
    adamw_lr=None,
    hess_estimator="price",  # the paper's algorithm (PAPER_ALGORITHM)
    step_curvature="entry",
)


def load_script(path: str | Path, name: str | None = None) -> types.ModuleType:
    """The script at ``path`` as a module (its functions, without running its ``__main__`` part)."""
    spec = importlib.util.spec_from_file_location(name or Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def argument_error(call, argv: list[str], capsys) -> str:
    """argparse's error line (``prog: error: message``, below the usage, which lists every flag)
    that ``call(argv)`` prints when it exits with argparse's status 2; another status or an
    exception fails the test."""
    with pytest.raises(SystemExit) as exit_:
        call(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    error = err.strip().splitlines()[-1]
    assert ": error: " in error, err
    return error


def plain_evon(**overrides):
    """``PLAIN_EVON`` updated by ``overrides`` (keyword arguments of ``EVON``/``build_optimizer``)."""
    return {**PLAIN_EVON, **overrides}


class ScalarReads(TorchDispatchMode):
    """Counts (``count``) the reads of a tensor's value back to Python (``aten._local_scalar_dense``:
    one per ``.item()``, ``bool()`` or ``tolist()`` element): on a GPU each waits for queued work."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def approx_tree(value, rel: float = 1e-6):
    """``value`` with every float replaced by ``pytest.approx(rel=rel)``, in nested dicts, lists
    and tuples: ``actual == approx_tree(expected)`` compares numbers fitted from state that a
    sharded run reproduces to rounding (EVON's curvature-fitted ess and weight_decay)."""
    if isinstance(value, float):
        return pytest.approx(value, rel=rel)
    if isinstance(value, dict):
        return {k: approx_tree(v, rel) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(approx_tree(v, rel) for v in value)
    return value


def count_forwards(module: torch.nn.Module) -> list[int]:
    """A one-item list that counts the forward calls of ``module`` from now on (a pre-hook adds 1)."""
    calls = [0]

    def hook(module, args):
        calls[0] += 1

    module.register_forward_pre_hook(hook)
    return calls


def one_step_optimizer(lm: torch.nn.Module, vocab_size: int):
    """``build_optimizer(lm)`` after one step on a random batch of 2×8 token ids (a causal LM)."""
    from hf_evon import build_optimizer

    opt = build_optimizer(lm)
    ids = torch.randint(0, vocab_size, (2, 8))
    with opt.sampled_params(train=True):
        lm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return opt


def entered_strategies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, set[str]]]:
    """Each ``BatchedSamples`` block entered from now on, as (its strategy, the names it applies factored)."""
    import hf_evon.predictive.batched_samples as batched

    entered: list[tuple[str, set[str]]] = []
    enter = batched.BatchedSamples.__enter__

    def recording(self: batched.BatchedSamples) -> batched.BatchedSamples:
        out = enter(self)
        entered.append((self.strategy, set(self.factored)))
        return out

    monkeypatch.setattr(batched.BatchedSamples, "__enter__", recording)
    return entered


def tiny_whisper_config(**overrides):
    """A one-layer Whisper config (64 tokens, 8 mel bins, width 16, no suppressed tokens) for
    speech-to-text tests; ``overrides`` are ``WhisperConfig`` keyword arguments."""
    from transformers import WhisperConfig

    config = dict(
        vocab_size=64, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, d_model=16, max_source_positions=10,
        max_target_positions=32, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=3,
        begin_suppress_tokens=None, suppress_tokens=None, init_std=0.5,
    )  # fmt: skip
    return WhisperConfig(**{**config, **overrides})


def directory_locked(directory: str) -> bool:
    """Whether another holder has the directory's ``flock`` (``hf_evon.fileio.directory_lock``): a
    second, non-blocking lock on it fails exactly then."""
    import fcntl
    import os

    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases a lock this probe took
    return False


class Entry(NamedTuple):
    """One entry of a :func:`directory_state`."""

    data: bytes | None  # a regular file's bytes; None for a folder, a link or anything else
    mtime_ns: int | None  # its own mtime (a link's, not its target's); None where the state leaves them out


# More than one tick of the coarse clock that stamps mtimes (Linux: 1 to 10 ms, by CONFIG_HZ).
_MTIME_TICK_NS = 20_000_000


def directory_state(directory: Path, *, mtimes: bool = True) -> dict[str, Entry]:
    """Every entry under ``directory`` by its path relative to it (``"sub/name"``; links not followed): two
    equal states mean nothing under it was created, removed or changed in between. With ``mtimes`` a file
    rewritten with the same bytes counts as changed, and so does a folder under it (not ``directory``
    itself) in which an entry was created and removed again; without, only what each file holds counts (for
    a test where a file may be rewritten as it was).

    It returns once the clock is more than a coarse tick past every mtime it read: without multigrain
    timestamps (Linux before 6.13) a file written within the tick of the one recorded would get the same
    mtime, and a rewrite right after this state was taken would pass unseen."""
    state = {}
    for path in sorted(directory.rglob("*")):
        listed = path.lstat()
        data = path.read_bytes() if stat.S_ISREG(listed.st_mode) else None
        state[path.relative_to(directory).as_posix()] = Entry(data, listed.st_mtime_ns if mtimes else None)
    newest = max((entry.mtime_ns for entry in state.values() if entry.mtime_ns is not None), default=None)
    if newest is not None:
        time.sleep(max(0, newest + _MTIME_TICK_NS - time.time_ns()) / 1e9)
    return state


def refuse_lookups(
    monkeypatch: pytest.MonkeyPatch, refused: Callable[[str], bool], calls: tuple[str, ...] = ("stat", "lstat")
) -> None:
    """``os.<call>`` of every path ``refused`` names answers EACCES, as for an entry in a directory this user
    may not search (simulated: the tests run as root); any other path is looked up as usual."""

    def wrapped(real):  # noqa: ANN001, ANN202
        def call(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if isinstance(path, str | os.PathLike) and refused(os.fspath(path)):
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return real(path, *args, **kwargs)

        return call

    for name in calls:
        monkeypatch.setattr(os, name, wrapped(getattr(os, name)))


def stop_persistent_workers(trainer: Any) -> None:
    """Stop the worker processes of ``trainer``'s persistent loaders (its training loader and its
    cached eval loaders) now. Left to the garbage collector (a Trainer sits in reference cycles),
    torch's shutdown of each waits out its 5 s join timeout, charged to whichever later test
    collects them."""
    loaders = [trainer.callback_handler.train_dataloader, *getattr(trainer, "_eval_dataloaders", {}).values()]
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)  # a persistent loader's live iterator
        if iterator is not None:
            iterator._shutdown_workers()


def load_where_never_built(monkeypatch: pytest.MonkeyPatch, path: str | Path, base_module: str) -> Any:
    """``torch.load(path)`` as a process that has not built any ``evon_config_class`` combination (one
    loading ``training_args.bin``, a spawned worker) loads it: pickle finds a class by its module and
    name, so each built class's name in ``hf_evon.trainer.combined`` and its record there go, and so does
    ``base_module`` (the module declaring the base, imported again from ``sys.path``); ``monkeypatch``
    puts them back after the test."""
    import sys

    import hf_evon.trainer.combined as combined

    declared = {base: built for base, built in combined._COMBINED.items() if combined._DECLARED.get(base) is built}
    for built in set(combined._COMBINED.values()) - set(declared.values()):  # built by evon_config_class
        monkeypatch.delattr(combined, built.__name__, raising=False)  # an earlier test's rebuild shares its name
    # a record of its own for the load, which builds the class again: the test's record comes back untouched
    monkeypatch.setattr(combined, "_COMBINED", declared)
    monkeypatch.delitem(sys.modules, base_module)
    return torch.load(path, weights_only=False)


def outcome_beside_a_pipe(call: Callable[[], Any], fifo: Path, what: str, wait: float = 30.0) -> BaseException | None:
    """What ``call()`` raised (None: it returned), run in a thread beside the named pipe ``fifo``; where it
    still runs after ``wait`` s (it opened the pipe and waits for a writer) the test fails with ``what``,
    after the pipe is written to (an empty file for the reader), so the thread ends."""
    import threading

    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - handed to the test's thread
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(wait)
    if thread.is_alive():
        with open(fifo, "w") as fh:  # the writer the reader waits for
            fh.write("")
        thread.join(wait)
        pytest.fail(what)
    return outcome[0]
