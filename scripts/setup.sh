#!/usr/bin/env bash
# Installs hf-evon with everything the tests and examples need, into ./.venv.
# torch is pinned to the CPU build that this machine serves from local disk (seconds);
# an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# the pin again: an extra that depends on torch (trl, pyro-ppl) must not upgrade it
.venv/bin/python -m pip install -q -e ".[test,examples,trl]" "torch==2.13.0"
