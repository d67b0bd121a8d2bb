"""Launching multi-process CPU (gloo) workers from the tests: one helper for every such test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import torch

TESTS = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict[str, str]:
    """CPU only, one thread per process, the repository importable."""
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(TESTS))


def torchrun(world: int, script: str, *args: str, timeout: float = 300) -> None:
    """Run ``script args`` in ``world`` processes (``torch.distributed.run``); fail with its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world)]
    cmd += ["--master_port", str(free_port()), script, *args]
    # on a timeout (a hung collective) the workers must go too: SIGTERM to torchrun, which stops them,
    # then SIGKILL to its process group (a session of its own) for whatever is left
    with subprocess.Popen(
        cmd,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun passes SIGTERM on to its workers (their own process groups)
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate(timeout=30)
            raise AssertionError(
                f"world {world}: {os.path.basename(script)} still running after {timeout:g} s (killed):\n"
                f"{stdout[-3000:]}\n{stderr[-6000:]}"
            ) from None
    assert proc.returncode == 0, f"world {world} failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"


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
