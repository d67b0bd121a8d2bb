#!/usr/bin/env bash
# The tests that reach into transformers, accelerate and PEFT (generate_bma's decoding, the
# Trainer's gradient accumulation, hooks and DDP, LoRA models), run against the oldest releases
# of the three that pyproject.toml accepts: those alone are installed into .floor/ and put in
# front of .venv's, whose other packages meet their requirements. Arguments go to pytest. Run by
# .ci/run after the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=$(.venv/bin/python - <<'PY'
import tomllib

deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
floors = dict(d.split(">=") for d in deps if ">=" in d)
print(" ".join(f"{name}=={floors[name]}" for name in ("transformers", "accelerate", "peft")))
PY
)
target=".floor/$(echo "$pins" | sed 's/==/-/g; s/ /_/g')"
if [ ! -d "$target" ]; then
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install -q --no-deps --target "$target" $pins
fi
PYTHONPATH="$target" .venv/bin/python - $pins <<'PY'
import importlib
import sys

from packaging.version import Version

for pin in sys.argv[1:]:
    name, floor = pin.split("==")
    module = importlib.import_module(name)
    assert Version(module.__version__) == Version(floor), (name, module.__version__, module.__file__)
PY
PYTHONPATH="$target" .venv/bin/python -m pytest -q -p no:cacheprovider "$@" \
  tests/test_generation.py --deselect tests/test_generation.py::test_bma_lowers_validation_loss \
  tests/test_trainer_internals.py \
  tests/test_trainer.py::test_a_compute_loss_override_is_scaled_like_the_trainers_own \
  tests/test_trainer.py::test_gradient_accumulation_equals_larger_batch_deterministic \
  tests/test_trainer.py::test_peft_config_wraps_the_model_and_the_posterior_covers_the_adapter \
  tests/test_trainer.py::test_ddp_two_processes \
  tests/test_cli.py::test_generate_with_a_lora_adapter_of_an_encoder_decoder_model
