"""The package's shape, as DESIGN.md draws it: arrows point down, no circles, modules of one concern.

Every ``import`` counts, also those inside functions and under ``TYPE_CHECKING``: a deferred import
is still a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_evon"
# the layers, lowest first: a module may import its own layer's modules and any lower layer's
LAYERS = [
    {"hf_evon.fileio", "hf_evon.modeling", "hf_evon.data"},
    {"hf_evon.optim"},
    {"hf_evon.distributed", "hf_evon.posterior"},
    {"hf_evon.predictive"},
    {"hf_evon.trainer"},
    {"hf_evon.cli", "hf_evon.__main__"},  # python -m hf_evon: the command, as python -m hf_evon.cli
]
MAX_MODULE_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for p in PACKAGE.rglob("*.py") if "metrics_modules" not in p.parts}
    assert "hf_evon.optim.evon" in found  # the walk found the package
    return found


def imports(path: Path) -> set[str]:
    """Every ``hf_evon`` module ``path`` imports, wherever the import statement stands."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the package uses absolute imports)"
            if node.module and node.module.split(".")[0] == "hf_evon":
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "hf_evon")
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    # ``hf_evon`` itself is the lazy public facade (``__version__`` and names resolved on first use):
    # importing it loads nothing else, so it is no arrow between concerns
    return {
        name: {m for m in imports(path) if m in mods and m not in (name, "hf_evon")}
        for name, path in mods.items()
    }


def layer(name: str) -> int:
    best = None
    for i, members in enumerate(LAYERS):
        for prefix in members:
            if name == prefix or (prefix != "hf_evon" and name.startswith(prefix + ".")):
                if best is None or len(prefix) > len(best[1]):
                    best = (i, prefix)
    assert best is not None, f"{name} is in no layer of DESIGN.md's layout"
    return best[0]


def package(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_arrows_point_down_between_packages() -> None:
    upward = sorted(
        f"{src} -> {dst}"
        for src, targets in graph().items()
        for dst in targets
        if package(src) != package(dst) and layer(dst) > layer(src)
    )
    assert upward == []


def test_the_optimizer_imports_nothing_above_it() -> None:
    above = sorted(
        f"{src} -> {dst}"
        for src, targets in graph().items()
        if src.startswith("hf_evon.optim")
        for dst in targets
        if not (dst.startswith("hf_evon.optim") or dst in LAYERS[0])
    )
    assert above == []


def test_no_import_circles() -> None:
    edges = graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert cycles == []


@pytest.mark.parametrize("name", sorted(modules()))
def test_module_size(name: str) -> None:
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{name} has {lines} lines"
