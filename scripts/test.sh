#!/usr/bin/env bash
# Runs every moe8 test on a fresh machine: installs the pinned dependencies, checks formatting (ruff,
# clang-format), builds libmoe8 with its GoogleTest suite (CUDA kernels too when nvcc is present) and runs
# ctest, installs the Python package and runs pytest. CUDA tests skip, saying why, without a GPU.
#   bash scripts/test.sh            (JOBS=N to set build parallelism; default: the cores the memory allows)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/build.sh
JOBS=$(moe8_jobs)
PY=${PYTHON:-python3}

echo "== dependencies"
if ! [ -f /usr/include/gtest/gtest.h ] || ! command -v clang-format >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq libgtest-dev clang-format) || echo "warning: could not apt-get install libgtest-dev clang-format"
fi
$PY -m pip install -q --disable-pip-version-check -r requirements-dev.txt -r requirements-test.txt
# CUTLASS headers for the sm_90a kernels (header-only; --no-deps skips its Python generator's dependencies)
$PY -m pip install -q --disable-pip-version-check --no-deps nvidia-cutlass==4.2.0.0

echo "== format and lint"
$PY -m ruff check python tests bench
$PY -m ruff format --check python tests bench
if command -v clang-format >/dev/null; then
  find csrc tests/cpp -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' | xargs clang-format --dry-run --Werror
fi

echo "== C++ core: build and ctest"
CMAKE="$PY -m cmake"
command -v cmake >/dev/null && CMAKE=cmake
# Without a GPU the C++ suite is built CPU-only (the CUDA kernels are still compiled by the pip build below).
CUDA_OPT=OFF
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then CUDA_OPT=AUTO; fi
# -U: the optimised build type CMakeLists.txt sets when none is given, whatever an earlier configure cached
$CMAKE -S . -B build/test -G Ninja -DMOE8_BUILD_PYTHON=OFF -DMOE8_BUILD_TESTS=ON -DMOE8_CUDA=$CUDA_OPT \
  -UCMAKE_BUILD_TYPE >/dev/null
$CMAKE --build build/test -j "$JOBS"
ctest --test-dir build/test --output-on-failure -j "$JOBS"

echo "== Python package: install and pytest"
CMAKE_BUILD_PARALLEL_LEVEL=$JOBS $PY -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps .
cd tests  # import the installed package, not the source tree
$PY -m pytest -q -rs ../tests/python
