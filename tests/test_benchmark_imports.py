"""Every script in benchmarks/ imports against the package as it is: a name the package moved or
renamed fails here, not the next time someone reruns a measurement. A missing optional peer
(laplace-torch, ivon-opt, pyro-ppl, ...) skips its script."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_benchmark_script_imports(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(os.fspath(BENCHMARKS))
    loaded = set(sys.modules)
    try:
        importlib.import_module(name)
    except ImportError as err:
        missing = err.name or ""
        if missing.split(".")[0] in ("hf_evon", *SCRIPTS) or "hf_evon" in str(err):
            raise
        pytest.skip(f"{name}: optional dependency {missing!r} is not installed")
    finally:  # what this test loaded goes (scripts other tests imported stay the objects they hold)
        for module in [m for m in sys.modules if m in SCRIPTS and m not in loaded]:
            del sys.modules[module]
