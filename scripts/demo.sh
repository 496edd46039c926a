#!/usr/bin/env bash
# The main job: installs moe8 (and its pinned build tools) on a fresh machine, then fine-tunes a tiny MoE
# model (built-in tiny Qwen3-MoE) through moe8 on the GPU when present, else the CPU, printing loss and tokens/s,
# and writes the checkpoint, metrics.jsonl and report.html under runs/.
#   bash scripts/demo.sh [moe8 finetune options]     (see: moe8 finetune --help)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check -r requirements-dev.txt
# CUTLASS headers for the sm_90a kernels (header-only; --no-deps skips its Python generator's dependencies)
$PY -m pip install -q --disable-pip-version-check --no-deps nvidia-cutlass==4.2.0.0
CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2} $PY -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps .
exec moe8 finetune "$@"
