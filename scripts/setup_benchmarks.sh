#!/usr/bin/env bash
# Adds the peers of benchmarks/payoff.py to ./.venv (after scripts/setup.sh): laplace-torch,
# ivon-opt and pytorch-optimizer (SOAP; it needs only torch and numpy, so it goes without its deps).
# laplace-torch declares torchvision, whose wheels here need a newer torch than the pinned CPU
# build (an unpinned install replaces torch with a multi-GB CUDA build; torchvision 0.28 fails
# to load against torch 2.13.0+cpu and breaks every transformers import). laplace-torch's
# last-layer Laplace does not use torchvision, so it and the two packages that declare
# torchvision (backpack, via curvlinops) are installed without their dependencies, and those
# dependencies are named here instead (backpack 1.7 added einops and unfoldNd, curvlinops 3
# einconv and linear_operator; laplace-torch 0.3 pins asdfghjkl 0.1a4), torch pinned throughout.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install -q "torch==2.13.0" ivon-opt matplotlib opt-einsum torchmetrics \
  einops einconv unfoldNd linear_operator "asdfghjkl==0.1a4"
.venv/bin/python -m pip install -q --no-deps laplace-torch backpack-for-pytorch curvlinops-for-pytorch pytorch-optimizer
.venv/bin/python -c "import laplace, ivon, pytorch_optimizer"
