#!/usr/bin/env bash
# The tests that reach into transformers (generate_bma's decoding, the Trainer's gradient
# accumulation and hooks), run against the oldest transformers that pyproject.toml accepts: that
# release alone is installed into .floor/ and put in front of .venv's, whose other packages meet
# its requirements. Arguments go to pytest. Run by .ci/run after the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(.venv/bin/python - <<'PY'
import tomllib

deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(d for d in deps if d.startswith("transformers>=")).split(">=")[1])
PY
)
target=".floor/transformers-$floor"
if [ ! -d "$target/transformers" ]; then
  .venv/bin/python -m pip install -q --no-deps --target "$target" "transformers==$floor"
fi
PYTHONPATH="$target" .venv/bin/python - "$floor" <<'PY'
import sys

import transformers
from packaging.version import Version

assert Version(transformers.__version__) == Version(sys.argv[1]), (transformers.__version__, transformers.__file__)
PY
PYTHONPATH="$target" .venv/bin/python -m pytest -q -p no:cacheprovider "$@" \
  tests/test_generation.py tests/test_trainer_internals.py \
  tests/test_trainer.py::test_a_compute_loss_override_is_scaled_like_the_trainers_own \
  "tests/test_trainer.py::test_gradient_accumulation_equals_larger_batch_deterministic"
