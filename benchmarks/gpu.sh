#!/usr/bin/env bash
# Both GPU benchmarks in one go (about 6 minutes on an H100), logs and JSON under $OUT
# (default ./gpu-results). Works from a source checkout without installing: the repository root
# goes on PYTHONPATH. On a machine without network, carry the SOAP baseline's wheel in .whl/:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl pytorch-optimizer
# (transformers >= 5.17 with huggingface_hub 1.x, torch >= 2.4, accelerate, safetensors must be there).
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
python3 benchmarks/optimizer_step.py --device cuda --json "$OUT/optimizer_step.json" 2>&1 | tee "$OUT/optimizer_step.log"
python3 benchmarks/generate_bma.py --device cuda --dtype bfloat16 2>&1 | tee "$OUT/generate_bma.log"
