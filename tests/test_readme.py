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
