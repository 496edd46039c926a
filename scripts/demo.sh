#!/usr/bin/env bash
# The main job: installs moe8 (and its pinned build tools) on a fresh machine, then trains a tiny MoE
# language model through moe8 for a few hundred steps on the GPU when present, else the CPU.
#   bash scripts/demo.sh [moe8 demo options]     (see: moe8 demo --help)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check -r requirements-dev.txt
# CUTLASS headers for the sm_90a kernels (header-only; --no-deps skips its Python generator's dependencies)
$PY -m pip install -q --disable-pip-version-check --no-deps nvidia-cutlass==4.2.0.0
CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2} $PY -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps .
exec moe8 demo "$@"
