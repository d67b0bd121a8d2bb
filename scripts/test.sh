#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite; exits non-zero on any failure,
# and also when no test ran (pytest's exit code 5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# tiny tensors and multi-process tests: one thread per process avoids oversubscribing 2 cores
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/python -m ruff check hf_evon tests examples benchmarks
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
