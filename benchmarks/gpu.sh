#!/usr/bin/env bash
# The GPU benchmarks in one go (about 7 minutes on an H100), logs and JSON under $OUT
# (default ./gpu-results). Works from a source checkout without installing: the repository root
# goes on PYTHONPATH. On a machine without network, carry in .whl/ the SOAP baseline's wheel and, where
# the machine's transformers is older than pyproject.toml's floor (5.19; the lent GPU image had 5.17),
# a newer transformers (its other requirements, huggingface_hub, tokenizers, safetensors, were met there):
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl pytorch-optimizer transformers==5.24.0
# (torch >= 2.5 and accelerate must be there; datasets need not be).
# BASE=DIR also measures another version's package, DIR/hf_evon, on the same machine (EVON's step and
# its profile; timings from different GPUs do not compare). From a checkout, in an ignored folder
# that the device call carries:  mkdir -p .base && git archive REV hf_evon | tar -x -C .base
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hf_evon_site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/hf_evon_site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# the tests only a CUDA device runs (skipped in the CPU suite): a few seconds
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_optim_flops.py -k "cuda" 2>&1 | tee "$OUT/test_cuda.log"
python3 benchmarks/optimizer_step.py --device cuda --json "$OUT/optimizer_step.json" 2>&1 | tee "$OUT/optimizer_step.log"
python3 benchmarks/generate_bma.py --device cuda --dtype bfloat16 2>&1 | tee "$OUT/generate_bma.log"
python3 benchmarks/generate_bma.py --device cuda --dtype bfloat16 --arch t5 --samples 8 --batch-sizes 1 \
    2>&1 | tee "$OUT/generate_bma_t5.log"
python3 benchmarks/generate_bma.py --device cuda --dtype bfloat16 --arch t5 --samples 8 --batch-sizes 1 \
    --num-beams 4 2>&1 | tee "$OUT/generate_bma_t5_beams.log"
python3 benchmarks/step_profile.py --device cuda 2>&1 | tee "$OUT/step_profile.log"
# the refresh's QR variants on the refresh batch and patched into the step, and the step without a refresh
python3 benchmarks/eigenbasis_refresh.py 2>&1 | tee "$OUT/eigenbasis_refresh.log"
# EVON's step alone vs the naive per-matrix EVON, 48 GPT-2-small block matrices on the GPU (the op and
# FLOP counts are device-independent: measured on CPU, see the module docstring)
python3 benchmarks/optimizer_flops.py --device cuda --skip ops flops --time-width 768 --time-blocks 12 \
    --repeats 4 --time-names hf-evon naive hf-evon-noclip naive-noclip --json "$OUT/optimizer_flops.json" \
    2>&1 | tee "$OUT/optimizer_flops.log"
if [ -n "${BASE:-}" ]; then
    PYTHONPATH="$(cd "$BASE" && pwd):$PYTHONPATH" python3 benchmarks/optimizer_step.py --device cuda \
        --optimizers adamw evon-staggered --json "$OUT/optimizer_step_base.json" 2>&1 | tee "$OUT/optimizer_step_base.log"
    PYTHONPATH="$(cd "$BASE" && pwd):$PYTHONPATH" python3 benchmarks/step_profile.py --device cuda \
        2>&1 | tee "$OUT/step_profile_base.log"
fi
