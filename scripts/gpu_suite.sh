#!/usr/bin/env bash
# The GPU half of the test suite plus the benchmarks, for a machine with an NVIDIA GPU: builds libmoe8
# with CUDA (kernels, GoogleTest suite, Python extension) in build/gpu, runs ctest and pytest (CUDA tests
# included), then bench/bench_layer.py. Logs and JSON go to $OUT (default bench/results/gpu_run).
#   JOBS=16 OUT=/tmp/out bash scripts/gpu_suite.sh [bench args]
# GoogleTest is taken from CMAKE_PREFIX_PATH (e.g. an unpacked libgtest-dev in .carry/gtest/usr).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_run}
JOBS=${JOBS:-16}
PY=$(command -v python3)
mkdir -p "$OUT"
[ -d .carry/gtest/usr ] && export CMAKE_PREFIX_PATH=$PWD/.carry/gtest/usr
# The pinned nanobind (and CUTLASS headers) may travel as wheels when the machine has no registry.
NBPATH=
for whl in .carry/wheels/nanobind-*.whl .carry/wheels/nvidia_cutlass-*.whl; do
  [ -f "$whl" ] && $PY -m pip install -q --no-deps --no-index --target /tmp/moe8-site "$whl" && NBPATH=/tmp/moe8-site
done
export PYTHONUNBUFFERED=1
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
t0=$(date +%s)
echo "== build" | tee "$OUT/build.log"
PYTHONPATH=$NBPATH cmake -S . -B build/gpu -G Ninja -DMOE8_BUILD_TESTS=ON -DMOE8_BUILD_PYTHON=ON -DPython_EXECUTABLE="$PY" \
  >>"$OUT/build.log" 2>&1 && cmake --build build/gpu -j "$JOBS" --target _C >>"$OUT/build.log" 2>&1 || {
  grep -B2 -A12 -E "error|FAILED" "$OUT/build.log" | head -80
  exit 1
}
cmake --build build/gpu -j "$JOBS" >>"$OUT/build.log" 2>&1 || grep -A12 -E "error|FAILED" "$OUT/build.log" | head -60
echo "build took $(($(date +%s) - t0)) s"
ln -sf "$PWD"/build/gpu/_C*.so python/moe8/
echo "== ctest"
ctest --test-dir build/gpu -j 8 --output-on-failure --timeout 300 >"$OUT/ctest.log" 2>&1
tail -5 "$OUT/ctest.log"
echo "== pytest"
PYTHONPATH=python timeout 60 $PY -X faulthandler -m pytest -q tests/python/test_errors.py >"$OUT/pytest_errors.log" 2>&1 ||
  { tail -30 "$OUT/pytest_errors.log"; command -v cuda-gdb >/dev/null && PYTHONPATH=python timeout 120 cuda-gdb -batch \
    -ex run -ex bt --args $PY -m pytest -q -x tests/python/test_errors.py >"$OUT/gdb.log" 2>&1; grep -A25 "SIGSEGV" "$OUT/gdb.log" | head -40; }
PYTHONPATH=python timeout 330 $PY -m pytest -q -rs --durations=8 tests/python >"$OUT/pytest.log" 2>&1
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
echo "== bench"
PYTHONPATH=python timeout 300 $PY bench/bench_layer.py --json "$OUT/layer.json" "$@" >"$OUT/bench.log" 2>&1
tail -12 "$OUT/bench.log"
echo "total $(($(date +%s) - t0)) s"
