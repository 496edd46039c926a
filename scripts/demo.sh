#!/usr/bin/env bash
# The main job: installs moe8 (with torch, transformers and its build tools, pinned: requirements-build.txt) on a
# fresh machine, then fine-tunes a tiny MoE
# model (built-in tiny Qwen3-MoE) through moe8 on the GPU when present, else the CPU, printing loss and tokens/s,
# and writes the checkpoint, metrics.jsonl and report.html under runs/.
#   bash scripts/demo.sh [moe8 finetune options]     (see: moe8 finetune --help)
# The build uses every core the memory allows (scripts/lib/build.sh; JOBS=N to set it) and compiles the CUDA
# kernels when nvcc is found (MOE8_CUDA_ARCHS to choose their GPU architectures; docs/install.md).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/build.sh
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --disable-pip-version-check)

echo "== installing torch, transformers and the build tools (requirements-build.txt, nvidia-cutlass==4.2.0.0)"
"${PIP[@]}" -q -r requirements-build.txt
# CUTLASS headers for the sm_90a kernels (header-only; --no-deps skips its Python generator's dependencies)
"${PIP[@]}" -q --no-deps nvidia-cutlass==4.2.0.0

JOBS=$(moe8_jobs)
if moe8_nvcc; then
  what="CUDA ${MOE8_CUDA_ARCHS:-sm_90a} + CUTLASS 4.2.0"
  minutes=$(moe8_build_minutes cuda "$JOBS")
else
  what="CPU only: no nvcc found, see docs/install.md for the CUDA kernels"
  minutes=$(moe8_build_minutes cpu "$JOBS")
fi
echo "== building moe8 ($what, $JOBS jobs; first build takes ~$minutes min, log: build/install.log)"
CMAKE_BUILD_PARALLEL_LEVEL=$JOBS moe8_pip_build build/install.log "${PIP[@]}" --no-build-isolation --no-deps .

echo "== fine-tuning: moe8 finetune $* (the built-in tiny Qwen3-MoE unless told otherwise)"
exec "$PY" -m moe8 finetune "$@"
