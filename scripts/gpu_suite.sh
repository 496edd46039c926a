#!/usr/bin/env bash
# The GPU half of the test suite plus the benchmarks, for a machine with an NVIDIA GPU: builds libmoe8
# with CUDA (kernels, CUTLASS sm_90a kernels when the headers are found, GoogleTest suite, Python extension)
# in build/gpu, runs ctest and pytest (CUDA tests included), then the benchmarks. Logs and JSON go to $OUT
# (default bench/results/gpu_run). STAGE=test (build, ctest, pytest), pytest (build _C, pytest), build (_C
# only), bench (build _C, benchmarks), lora (build _C, bench_lowrank.py, the 30B LoRA step: moe8 with the
# fusions FUSE (default router,norm,rope,consume) vs PEFT, then moe8 with FUSE plus lora_add),
# tiles (the Sm90Test gtests when PREBUILT holds moe8_tests, then bench_gemm.py --tiles TILES and
# bench_layer.py on LAYER_SHAPES once per forced tile, MOE8_SM90_TILE), direct (ops.set_eager_direct, on by default: its
# tests (also with it off), bench_host.py, bench_layer.py on LAYER_SHAPES three times each way, alternating) or all.
#   JOBS=16 OUT=/tmp/out STAGE=test bash scripts/gpu_suite.sh
#   JOBS=16 OUT=/tmp/out STAGE=bench bash scripts/gpu_suite.sh --shapes qwen3,mixtral --gemm
# STAGE=bench runs bench_layer.py (with these arguments) and bench_gemm.py; HF_TRAIN=1 adds
# bench_hf_train.py, LORA30B=1 bench_lora_30b.py (moe8 bf16 adapters vs PEFT fp32, profiled).
# PREBUILT=dir: link dir/_C*.so, built elsewhere for this Python, instead of building (a build runs when it
# does not import with CUDA); with STAGE=test dir must also hold the GoogleTest binary moe8_tests (built with
# MOE8_BUILD_TESTS=ON and CUDA), run in 8 parallel gtest shards instead of ctest. PYTEST_ARGS also runs pytest
# in the other stages. WHEELS=dir (default .carry/wheels) holds the wheels to install.
# GoogleTest is taken from CMAKE_PREFIX_PATH (e.g. an unpacked libgtest-dev in .carry/gtest/usr); the pinned
# wheels in .carry/wheels (nanobind, CUTLASS, peft, pytest-xdist, ...) are installed into /tmp/moe8-site and
# put on PYTHONPATH when present (see docs/gpu.md). PYTEST_TIMEOUT (default 400 s), PYTEST_WORKERS (default
# 6, when pytest-xdist is importable) and PYTEST_ARGS (default tests/python) shape the pytest step.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_run}
JOBS=${JOBS:-16}
STAGE=${STAGE:-all}
PY=$(command -v python3)
mkdir -p "$OUT"
[ -d .carry/gtest/usr ] && export CMAKE_PREFIX_PATH=$PWD/.carry/gtest/usr
SITE=
WHEELS=${WHEELS:-.carry/wheels}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-deps --no-index --target /tmp/moe8-site "$WHEELS"/*.whl && SITE=/tmp/moe8-site
fi
export PYTHONPATH=python${SITE:+:$SITE}
export PYTHONUNBUFFERED=1
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
t0=$(date +%s)
if [ -n "${PREBUILT:-}" ] && [ ! -d "$PREBUILT" ] && [ -f "$PREBUILT.tgz" ]; then  # carried packed (64 MiB limit)
  mkdir -p "$(dirname "$PREBUILT")" && tar xzf "$PREBUILT.tgz" -C "$(dirname "$PREBUILT")"
fi
if [ -n "${PREBUILT:-}" ] && { [ "$STAGE" != test ] || [ -x "$PREBUILT/moe8_tests" ]; }; then  # docs/gpu.md
  ln -sf "$PWD/$PREBUILT"/_C*.so python/moe8/
  if $PY -c "import moe8, sys; sys.exit(0 if moe8.cuda_available() else 1)"; then
    echo "prebuilt $PREBUILT: moe8 with CUDA"
    [ "$STAGE" = build ] && exit 0
    SKIP_BUILD=1
  else
    echo "prebuilt $PREBUILT unusable here: building"
    rm -f python/moe8/_C*.so
  fi
fi
if [ -z "${SKIP_BUILD:-}" ]; then
echo "== build" | tee "$OUT/build.log"
cmake -S . -B build/gpu -G Ninja -DMOE8_BUILD_TESTS=ON -DMOE8_BUILD_PYTHON=ON -DPython_EXECUTABLE="$PY" \
  >>"$OUT/build.log" 2>&1 && cmake --build build/gpu -j "$JOBS" --target _C >>"$OUT/build.log" 2>&1 || {
  grep -B2 -A12 -E "error|FAILED" "$OUT/build.log" | head -80
  exit 1
}
grep -E "moe8: (CUDA|CUTLASS)" "$OUT/build.log"
ln -sf "$PWD"/build/gpu/_C*.so python/moe8/
echo "build took $(($(date +%s) - t0)) s"
[ "$STAGE" = build ] && exit 0
fi

if [ "$STAGE" = test ] && [ -n "${SKIP_BUILD:-}" ]; then
  echo "== gtest ($PREBUILT/moe8_tests, 8 shards)"
  for i in 0 1 2 3 4 5 6 7; do
    GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i timeout 300 "$PREBUILT/moe8_tests" --gtest_filter='-*Speed*' \
      >"$OUT/gtest_shard$i.log" 2>&1 &
  done
  wait
  cat "$OUT"/gtest_shard*.log >"$OUT/ctest.log"
  grep -h -E "^\[  (PASSED|FAILED)  \]|tests? ran" "$OUT"/gtest_shard*.log
elif [ "$STAGE" = test ] || [ "$STAGE" = all ]; then
  cmake --build build/gpu -j "$JOBS" >>"$OUT/build.log" 2>&1 || grep -A12 -E "error|FAILED" "$OUT/build.log" | head -60
  echo "== ctest"
  # the *.Speed tests only print TFLOP/s tables: STAGE=bench runs them
  ctest --test-dir build/gpu -j 8 -E 'Speed' --output-on-failure --timeout 300 >"$OUT/ctest.log" 2>&1
  grep -E "tests passed|tests failed|\*\*\*Failed|\(Failed\)" "$OUT/ctest.log" | tail -12
fi
if [ "$STAGE" = test ] || [ "$STAGE" = pytest ] || [ "$STAGE" = all ] || [ -n "${PYTEST_ARGS:-}" ]; then
  echo "== pytest"
  XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n ${PYTEST_WORKERS:-6}")
  # shellcheck disable=SC2086
  timeout "${PYTEST_TIMEOUT:-400}" $PY -X faulthandler -m pytest -q -rs $XDIST --durations=8 ${PYTEST_ARGS:-tests/python} \
    >"$OUT/pytest.log" 2>&1
  grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
  echo "t $(($(date +%s) - t0)) s"
fi
if [ "$STAGE" = bench ] || [ "$STAGE" = all ]; then
  echo "== bench"
  if [ -z "${SKIP_BUILD:-}" ] && cmake --build build/gpu -j "$JOBS" --target moe8_tests >>"$OUT/build.log" 2>&1; then
    build/gpu/moe8_tests --gtest_filter='*Speed*' >"$OUT/speed.log" 2>&1
    grep -E "TFLOP|^[a-z].*[0-9]$" "$OUT/speed.log" | head -30
  fi
  timeout 200 $PY bench/bench_layer.py --json "$OUT/layer.json" "$@" >"$OUT/bench.log" 2>&1
  tail -14 "$OUT/bench.log"
  timeout 150 $PY bench/bench_gemm.py --json "$OUT/gemm.json" >"$OUT/gemm.log" 2>&1
  grep -E "moe8 / torch|Error" "$OUT/gemm.log" | tail -4
  if [ -n "${HF_TRAIN:-}" ]; then
    timeout 200 $PY bench/bench_hf_train.py --models qwen3,mixtral --steps 3 --warmup 1 \
      --json "$OUT/hf_train.json" >"$OUT/hf_train.log" 2>&1
    tail -4 "$OUT/hf_train.log"
  fi
  if [ -n "${LORA30B:-}" ]; then  # issue 5: moe8 (bf16 adapters) vs PEFT as users run it (fp32 adapters)
    timeout 300 $PY bench/bench_lora_30b.py --adapter-dtype bfloat16 --peft-adapter-dtype float32 --profile 25 \
      --timeout 140 --json "$OUT/lora_30b.json" >"$OUT/lora_30b.log" 2>&1
    tail -6 "$OUT/lora_30b.log"
  fi
fi
if [ "$STAGE" = lora ]; then  # the 30B LoRA step alone: moe8 (fusions FUSE) vs PEFT, then moe8 with lora_add too
  FUSE=${FUSE:-router,norm,rope,consume}
  timeout 60 $PY bench/bench_lowrank.py --ranks 16,32 --json "$OUT/lowrank.json" >"$OUT/lowrank.log" 2>&1
  cat "$OUT/lowrank.log"
  timeout 220 $PY bench/bench_lora_30b.py --adapter-dtype bfloat16 --peft-adapter-dtype float32 --profile 30 \
    --steps 5 --moe8-fuse "$FUSE" --timeout 170 --json "$OUT/lora_30b.json" >"$OUT/lora_30b.log" 2>&1
  tail -7 "$OUT/lora_30b.log"
  timeout 80 $PY bench/bench_lora_30b.py --adapter-dtype bfloat16 --variants moe8 --steps 5 \
    --moe8-fuse "$FUSE,lora_add" --timeout 70 --json "$OUT/lora_30b_lora_add.json" >"$OUT/lora_30b_lora_add.log" 2>&1
  grep -E "^moe8 " "$OUT/lora_30b_lora_add.log"
fi
if [ "$STAGE" = tiles ]; then  # the per-shape tile sweep: each forced sm_90a tile, per GEMM and per layer
  TILES=${TILES:-large,m2,pong128,tall}
  if [ -x "${PREBUILT:-}/moe8_tests" ]; then
    for i in 0 1 2 3; do
      GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i timeout 200 "$PREBUILT/moe8_tests" \
        --gtest_filter='Sm90Test.*-*Speed*' >"$OUT/gtest_sm90_$i.log" 2>&1 &
    done
    wait
    grep -h -E "^\[  (PASSED|FAILED)  \]" "$OUT"/gtest_sm90_*.log
  fi
  timeout 240 $PY bench/bench_gemm.py --kinds fwd,dgrad,wgrad --iters 5 --warmup 2 --tiles "$TILES" \
    --json "$OUT/gemm_tiles.json" >"$OUT/gemm_tiles.log" 2>&1
  tail -2 "$OUT/gemm_tiles.log"
  for t in default ${TILES//,/ }; do
    [ "$t" = default ] && unset MOE8_SM90_TILE || export MOE8_SM90_TILE=$t
    timeout 90 $PY bench/bench_layer.py --shapes "${LAYER_SHAPES:-qwen3,mixtral}" --no-check \
      --json "$OUT/layer_tile_$t.json" >"$OUT/layer_tile_$t.log" 2>&1
    echo "layer, tile $t:"; grep -A3 "^shape" "$OUT/layer_tile_$t.log"
  done
  unset MOE8_SM90_TILE
fi
if [ "$STAGE" = direct ]; then  # ops.set_eager_direct on the GPU: its tests, host time, the layer both ways
  timeout 200 $PY -m pytest -q tests/python/test_direct.py tests/python/test_layer.py >"$OUT/pytest_direct.log" 2>&1
  MOE8_EAGER_DIRECT=0 timeout 200 $PY -m pytest -q tests/python/test_layer.py tests/python/test_cuda_ops.py \
    >>"$OUT/pytest_direct.log" 2>&1
  grep -E "passed|failed" "$OUT/pytest_direct.log" | tail -2
  timeout 60 $PY bench/bench_host.py --json "$OUT/host.json" >"$OUT/host.log" 2>&1
  tail -3 "$OUT/host.log"
  for i in 1 2 3; do
    for d in 0 1; do
      MOE8_EAGER_DIRECT=$d timeout 90 $PY bench/bench_layer.py --shapes "${LAYER_SHAPES:-qwen3}" --no-check \
        --json "$OUT/layer_direct${d}_$i.json" >"$OUT/layer_direct${d}_$i.log" 2>&1
      echo "MOE8_EAGER_DIRECT=$d run $i: $(grep -A1 '^shape' "$OUT/layer_direct${d}_$i.log" | tail -1)"
    done
  done
fi
echo "total $(($(date +%s) - t0)) s"
