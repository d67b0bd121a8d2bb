"""Launching multi-process CPU (gloo) workers from the tests: one helper for every such test."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

TESTS = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict[str, str]:
    """CPU only, one thread per process, the repository importable."""
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(TESTS))


def rank_env(world: int, rank: int, port: int) -> dict[str, str]:
    """:func:`worker_env` plus what ``torch.distributed.run`` gives worker ``rank`` of a one-node run
    (``env://`` rendezvous at ``port``, rank 0 holding its store)."""
    return dict(
        worker_env(),
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID="none", TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
    )  # fmt: skip


def torchrun(world: int, script: str, *args: str, timeout: float = 300) -> None:
    """Run ``script args`` in ``world`` processes, each with the environment ``torch.distributed.run``
    gives its workers (:func:`rank_env`), and fail with their output where one fails. They are started
    directly, not under torchrun's agent, whose own start (a Python importing torch, then its
    rendezvous) adds seconds to every launch: dozens of launches in the suite. As the agent does, a
    worker's failure stops the others (a rank left in a collective would wait for the timeout), after
    ``GRACE`` seconds in which they may finish or report their own error."""
    port = free_port()
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, script, *args],
            env=rank_env(world, rank, port),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,  # its own process group: stopped with whatever it started
        )
        for rank, (out, err) in enumerate(logs)
    ]
    deadline, failed_at, timed_out = time.monotonic() + timeout, None, False
    ended: dict[int, float] = {}  # rank: when it was seen to have exited
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            ended.update((r, now) for r, p in enumerate(procs) if p.returncode is not None and r not in ended)
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + GRACE):
                timed_out = now > deadline
                break
            time.sleep(0.02)
    finally:
        _stop(procs)
    text = []
    for rank, (out, err) in enumerate(logs):
        out.seek(0), err.seek(0)
        text.append((rank, out.read(), err.read()))
        out.close(), err.close()
    # the ranks that failed last, the first to fail at the very end: the message keeps the end of it,
    # and the first failure is the cause of the others (a peer's closed connection)
    text.sort(key=lambda t: (procs[t[0]].returncode != 0, -ended.get(t[0], math.inf), t[0]))
    stdout = "".join(f"[rank {r}]\n{o}" for r, o, _ in text)
    stderr = "".join(f"[rank {r}, exit {procs[r].returncode}]\n{e}" for r, _, e in text)
    if timed_out:
        raise AssertionError(
            f"world {world}: {os.path.basename(script)} still running after {timeout:g} s (killed):\n"
            f"{stdout[-3000:]}\n{stderr[-6000:]}"
        )
    assert all(p.returncode == 0 for p in procs), f"world {world} failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"


GRACE = 10.0  # seconds the other ranks get once one has failed


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each process group still running, then SIGKILL to what is left after 10 s."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in running:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def rank_results(world: int, script: str, out: str, timeout: float = 300) -> list[dict]:
    """Run a worker that saves ``rank{r}.pt`` under ``out``, and load what each rank saved."""
    torchrun(world, script, out, timeout=timeout)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def runs_per_world(
    tmp_path_factory, script: str, prefix: str, worlds=(1, 2, 3)
) -> dict[int, tuple[str, list[dict]]]:
    """``{world: (its output directory, what each rank saved)}``: ``script`` run once per world size."""
    out = {}
    for world in worlds:
        d = str(tmp_path_factory.mktemp(f"{prefix}{world}"))
        out[world] = (d, rank_results(world, script, d))
    return out


def scenario_results(
    world: int, script: str, out: str, scenarios: list[str], timeout: float = 300
) -> Callable[[str], list[dict]]:
    """Run ``script out *scenarios`` once in ``world`` processes, a worker that calls
    :func:`run_scenarios`: one launch (its start, the imports and the process group, is most of a small
    scenario's cost) for several tests. Returns ``load(scenario)``: what each rank saved for it. ``load``
    fails the calling test, naming the scenario, where a rank saved its traceback instead, or nothing
    (the launch ended before it: a hang, a crash), with the launch's own failure."""
    try:
        torchrun(world, script, out, *scenarios, timeout=timeout)
        failure = ""
    except AssertionError as err:  # each test whose scenario is missing says so: the fixture does not fail
        failure = str(err)

    def load(scenario: str) -> list[dict]:
        import pytest  # here: the workers import this module too

        assert scenario in scenarios, scenario
        ranks = []
        for rank in range(world):
            path = os.path.join(out, f"{scenario}_rank{rank}.pt")
            if not os.path.exists(path):
                pytest.fail(f"scenario {scenario!r}: rank {rank} saved no result; the launch:\n{failure}")
            result = torch.load(path, weights_only=False)
            if isinstance(result, dict) and "scenario_crash" in result:
                pytest.fail(f"scenario {scenario!r} raised on rank {rank}:\n{result['scenario_crash']}")
            ranks.append(result)
        return ranks

    return load


def run_scenarios(out: str, rank: int, scenarios: dict[str, Callable[[], dict]], names: list[str]) -> None:
    """A worker's loop over the scenarios ``names`` (keys of ``scenarios``), each run by its function,
    its result saved as ``out/{name}_rank{rank}.pt`` (what :func:`scenario_results` loads), the ranks
    waiting for each other between two. A scenario that raises is saved as its traceback and ends the
    run (raising): the ranks' collectives may no longer pair, and a later scenario would hang in them."""
    import torch.distributed as dist

    for name in names:
        print(f"rank {rank}: scenario {name}", file=sys.stderr, flush=True)  # where a hang stopped
        path = os.path.join(out, f"{name}_rank{rank}.pt")
        try:
            result = scenarios[name]()
        except BaseException:
            torch.save({"scenario_crash": traceback.format_exc()}, path)
            raise
        torch.save(result, path)
        if dist.is_initialized():
            dist.barrier()


def finish() -> None:
    """End a worker whose results are saved, before any DDP or process-group destructor runs:
    flush, then ``os._exit(0)`` (workers call it right after their final barrier). Destroying a
    gloo process group from Python can deadlock: gdb on a hung worker showed the main thread, holding
    the GIL, in ~Reducer -> ~ProcessGroupGloo joining gloo's runloop thread, which waited for the GIL
    to destroy an AsyncAllgatherWork; other runs aborted there ("terminate called without an active
    exception"). Both failed clean-clone CI runs of finished, passing tests. So a worker calls it
    inside ``main`` after its barrier, while ``main``'s frame still holds the DDP models: returning
    from ``main`` first would release them, and their destructors are the ones that hang."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def save_and_finish(result: dict | None, out: str, rank: int) -> None:
    """A worker's closing tail: save ``result`` (unless None) as ``out/rank{rank}.pt``, the file
    :func:`rank_results` loads, wait for every rank (where a process group is up: no rank may exit
    while another still needs it), then :func:`finish`."""
    import torch.distributed as dist

    if result is not None:
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()
    finish()
