"""Every script in benchmarks/ imports against the package as it is: a name the package moved or
renamed fails here, not the next time someone reruns a measurement. A missing optional peer
(laplace-torch, ivon-opt, pyro-ppl, ...) skips its script."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import runpy
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


def _package_names_reached(path: Path) -> list[tuple[int, str, str]]:
    """(line, module or name, attribute) for every package name the script imports, at its top or
    inside a function (imported only when that code runs), and every attribute it reads off a name
    bound by such an import (``EVON.some_method``, ``update.hessian_candidate``)."""
    tree = ast.parse(path.read_text())
    bound: dict[str, tuple[str, str | None]] = {}  # local name -> (module, attribute of it or None)
    reached: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("hf_evon"):
            for alias in node.names:
                reached.append((node.lineno, node.module, alias.name))
                bound[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hf_evon") and alias.asname:
                    bound[alias.asname] = (alias.name, None)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            if not isinstance(node.ctx, ast.Store):
                module, name = bound[node.value.id]
                reached.append((node.lineno, f"{module}.{name}" if name else module, node.attr))
    return reached


def _resolve(dotted: str) -> object:
    """The module or object ``dotted`` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_package_name_the_benchmark_reaches_exists(name: str) -> None:
    """Imports inside functions and attributes read off imported names run only when a measurement
    does: ``hessian_signal.run`` read ``EVON._hessian_candidate`` after the step's candidate moved
    to ``hf_evon.optim.update``, and the script failed only when rerun."""
    missing = []
    for line, owner, attr in _package_names_reached(BENCHMARKS / f"{name}.py"):
        obj = _resolve(owner)
        submodule = hasattr(obj, "__path__") and importlib.util.find_spec(f"{owner}.{attr}") is not None
        if not hasattr(obj, attr) and not submodule:
            missing.append(f"benchmarks/{name}.py:{line}: {owner} has no {attr!r}")
    assert not missing, "\n".join(missing)


COMMANDS = [name for name in SCRIPTS if "__main__" in (BENCHMARKS / f"{name}.py").read_text()]


@pytest.mark.parametrize("name", COMMANDS)
def test_the_benchmark_script_answers_help(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python benchmarks/<name>.py --help`` prints its usage and exits 0."""
    path = BENCHMARKS / f"{name}.py"
    monkeypatch.syspath_prepend(os.fspath(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [os.fspath(path), "--help"])
    loaded = set(sys.modules)
    try:
        with pytest.raises(SystemExit) as exit_:
            runpy.run_path(os.fspath(path), run_name="__main__")
    except ImportError as err:
        if (err.name or "").split(".")[0] in ("hf_evon", *SCRIPTS) or "hf_evon" in str(err):
            raise
        pytest.skip(f"{name}: optional dependency {err.name!r} is not installed")
    finally:
        for module in [m for m in sys.modules if m in SCRIPTS and m not in loaded]:
            del sys.modules[module]
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {path.name}")
