"""The README's "Four ways to use it" snippets run as written, in order, after the set-up: its
Python blocks, joined in the README's order, run in a fresh interpreter in an empty directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hf_evon import EVONPosterior

REPO_ROOT = Path(__file__).resolve().parents[1]
# what the test appends: the decoded sequence's shape and the posterior's matrices, printed
CHECK = """
print("SEQUENCES", tuple(out.shape))
print("POSTERIOR", len(posterior.names))
"""


def readme_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)


def test_readme_snippets_run_in_order(tmp_path) -> None:
    snippets = readme_snippets()
    assert len(snippets) == 5  # the model and data, then the four ways
    script = tmp_path / "readme.py"
    script.write_text("\n".join(snippets) + CHECK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    shape = re.search(r"^SEQUENCES \((\d+), (\d+)\)$", run.stdout, re.M)
    assert shape is not None, run.stdout[-2000:]
    prompt, new = 3, 16  # the snippet's prompt and max_new_tokens
    assert int(shape[1]) == 1 and prompt < int(shape[2]) <= prompt + new
    # the posterior the snippets saved reloads here, with the matrices the loop trained
    saved = EVONPosterior.from_pretrained(str(tmp_path / "out" / "lm"))
    assert f"POSTERIOR {len(saved.names)}" in run.stdout and len(saved.names) > 0
    assert (tmp_path / "out" / "trainer" / "evon_posterior.safetensors").is_file()


def heading_anchors(path: Path) -> set[str]:
    """The #anchors a Markdown file defines: GitHub's slug of each heading outside code blocks
    (lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``, ``-1``, ``-2`` on repeats)
    and each ``<a id="...">``."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors | set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))


def doc_links(path: Path) -> list[str]:
    """The relative targets of the Markdown links and images in ``path``, outside code."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    links = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M)
    return [link for link in links if not re.match(r"[a-z][a-z0-9+.-]*:", link)]


def test_doc_links_and_anchors_resolve() -> None:
    """Every relative link of README.md, docs/*.md and the examples' READMEs names a file that
    exists, and its #anchor a heading (or ``<a id>``) of that file; so does every
    ``docs/NAME.md#anchor`` the library, examples and benchmarks cite."""
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    pages += sorted((REPO_ROOT / "examples").rglob("README.md"))
    broken = []
    for page in pages:
        for link in doc_links(page):
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.relative_to(REPO_ROOT)}: {link} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
                broken.append(f"{page.relative_to(REPO_ROOT)}: {link} (no such anchor)")
    sources = [p for d in ("hf_evon", "examples", "benchmarks") for p in sorted((REPO_ROOT / d).rglob("*.py"))]
    for source in sources + pages:  # cited in text: docs/NAME.md#anchor, or NAME.md#anchor within docs/
        for docs, name, anchor in re.findall(r"(?<![\w/.-])(docs/)?([\w-]+\.md)#([\w-]+)", source.read_text()):
            path = REPO_ROOT / "docs" / name
            if (docs or source.parent.name == "docs") and (not path.exists() or anchor not in heading_anchors(path)):
                broken.append(f"{source.relative_to(REPO_ROOT)}: {docs}{name}#{anchor}")
    assert not broken, "\n".join(broken)
    assert len(pages) >= 10  # the pages above were all found
