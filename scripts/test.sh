#!/usr/bin/env bash
# Runs every moe8 test on a fresh machine: installs the pinned dependencies, checks formatting (ruff,
# clang-format), builds libmoe8, its GoogleTest suite and the Python extension in one build (build/test) that
# serves ctest and the installed package, then runs pytest on the installed package (pytest-xdist, one worker
# per build job). With a GPU that build has the CUDA kernels. Without one it is CPU-only and, when nvcc is
# present, the CUDA kernels and a CUDA moe8._C compile meanwhile in build/cuda (the extension must load); a
# compile error there fails the run. CUDA tests skip, saying why, without a GPU.
#   bash scripts/test.sh            (JOBS=N to set build parallelism and pytest workers; default: the cores the memory allows)
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

CMAKE="$PY -m cmake"
command -v cmake >/dev/null && CMAKE=cmake
PYEXE=$($PY -c 'import sys; print(sys.executable)')
mkdir -p build
GPU=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then GPU=1; fi

# The CUDA build of a machine without a GPU: every kernel (CUTLASS ones included) compiled and linked into
# moe8._C, which must load and report its CUDA build. It shares the cores with the tests below.
cuda_compile() {
  $CMAKE -S . -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE8_CUDA=ON -DMOE8_CUTLASS=ON \
    -DMOE8_BUILD_TESTS=OFF -DMOE8_BUILD_PYTHON=ON -DPython_EXECUTABLE="$PYEXE"
  $CMAKE --build build/cuda -j "$JOBS"
  $PY - build/cuda <<'EOF'
import importlib.util, pathlib, sys

so = next(pathlib.Path(sys.argv[1]).glob("_C.*"))
spec = importlib.util.spec_from_file_location("moe8._C", so)
ext = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ext)
facts = ext.build_info()
assert facts["backend"] == "cuda+cutlass", facts
print(f"{so} loads: CUDA {facts['cuda_version']}, CUTLASS {facts['cutlass_version']}, {facts['gencode']}")
EOF
}
CUDA_PID=
if [ "$GPU" = 0 ] && moe8_nvcc; then
  echo "== CUDA kernels: building in build/cuda beside the tests (log: build/cuda.log)"
  (set -e; cuda_compile) >build/cuda.log 2>&1 &
  CUDA_PID=$!
fi
kill_tree() { # $1 and every process below it
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
trap '[ -z "$CUDA_PID" ] || kill_tree "$CUDA_PID"' EXIT
cuda_result() { # waits for the CUDA build, when one runs; fails when it failed
  [ -n "$CUDA_PID" ] || return 0
  echo "== CUDA kernels: build/cuda"
  local pid=$CUDA_PID
  CUDA_PID=
  if wait "$pid"; then
    tail -n 1 build/cuda.log
    return 0
  fi
  echo "moe8: the CUDA build failed; the last lines of build/cuda.log:" >&2
  tail -n 40 build/cuda.log >&2
  return 1
}

echo "== format and lint"
$PY -m ruff check python tests bench
$PY -m ruff format --check python tests bench
if command -v clang-format >/dev/null; then
  find csrc tests/cpp -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' | xargs clang-format --dry-run --Werror
fi

echo "== C++ core and Python package: one build (build/test), ctest"
CUDA_OPT=OFF
[ "$GPU" = 1 ] && CUDA_OPT=AUTO
CMAKE_BUILD_PARALLEL_LEVEL=$JOBS moe8_pip_build build/test.log $PY -m pip install --disable-pip-version-check \
  --no-build-isolation --no-deps -C build-dir=build/test -C cmake.define.MOE8_CUDA=$CUDA_OPT \
  -C cmake.define.MOE8_BUILD_TESTS=ON -C cmake.define.MOE8_BUILD_PYTHON=ON .
ctest --test-dir build/test --output-on-failure -j "$JOBS"

echo "== pytest (installed package)"
# The installed package does not look beside the checkout for the shared corpus and tokenizer: point it there.
if [ -z "${MOE8_SHARED_DATA:-}" ] && [ -d ../shared/data ]; then
  export MOE8_SHARED_DATA="$(cd ../shared/data && pwd)"
  echo "shared data: $MOE8_SHARED_DATA"
fi
rc=0
# A worker per build job, each with one intra-op thread of torch (moe8's own CPU ops still use every core);
# run from tests/ so that the tests import the installed package, not the source tree.
(cd tests && OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} $PY -m pytest -q -rs -n "$JOBS" --dist loadscope ../tests/python) || rc=$?
if [ "$rc" = 5 ]; then echo "moe8: pytest collected no tests" >&2; fi
if ! cuda_result && [ "$rc" = 0 ]; then rc=1; fi
exit "$rc"
