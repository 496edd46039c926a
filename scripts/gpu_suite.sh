#!/usr/bin/env bash
# Builds moe8 with CUDA, runs its tests and its benchmarks on a machine with an NVIDIA GPU; logs and JSON
# go to --out, named <benchmark>_<gpu>.json as in bench/results/. See docs/gpu.md.
#
# usage: bash scripts/gpu_suite.sh [--build] [--test] [--bench] [options] [-- bench_layer.py arguments]
#        (no step flag: --build --test --bench)
# steps:
#   --build              configure and build libmoe8 with CUDA in build/gpu: the Python extension (CUTLASS
#                        sm_90a kernels when the headers are found) and the GoogleTest suite
#   --test               GoogleTest (ctest without the *Speed* tests) and pytest, CUDA tests included
#   --bench              the benchmarks in --benchmarks
# options:
#   --out DIR            where logs and results go (default /tmp/moe8-gpu)
#   --jobs N             build parallelism (default 16)
#   --pytest ARGS        what pytest runs (default tests/python), e.g. "tests/python/test_fp8.py -k cache"
#   --pytest-workers N   pytest-xdist workers when it is installed (default 6)
#   --timeout S          time limit of each test or benchmark command (default: none)
#   --benchmarks LIST    comma-separated, from speed (the *Speed* gtests' TFLOP/s tables), layer, gemm,
#                        hf_train, fp8_refresh, lora_30b, lowrank, rmsnorm, optim, host, clocks, and (each writing into
#                        OUT/<name>/) step_profile, loss_parity, recipes, recipes_full, fp8_step, fp8_dense,
#                        fp8_convergence, variants (default speed,layer,gemm)
#   --prebuilt DIR       use DIR/_C*.so and DIR/moe8_tests, built elsewhere for this Python, instead of
#                        building (DIR.tgz is unpacked when DIR is missing; docs/developing.md)
#   --wheels DIR         pinned wheels to install into /tmp/moe8-site and put on PYTHONPATH
#                        (default .carry/wheels when it holds wheels; docs/developing.md)
#   -h, --help           this text
# Arguments after -- go to bench/bench_layer.py (default: --shapes qwen3,mixtral,deepseek --no-check
# --fp8 blockwise+dgrad). Examples:
#   bash scripts/gpu_suite.sh --build --test
#   bash scripts/gpu_suite.sh --bench --benchmarks layer,hf_train -- --shapes qwen3 --fp8 blockwise
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

usage() { sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "gpu_suite.sh: $*" >&2; exit 2; }
need() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (see --help)"; }

BUILD='' TEST='' BENCH=''
OUT=/tmp/moe8-gpu
JOBS=16
PYTEST_ARGS=tests/python
PYTEST_WORKERS=6
TIMEOUT=0
BENCHMARKS=speed,layer,gemm
PREBUILT=
WHEELS=.carry/wheels
LAYER_ARGS=(--shapes 'qwen3,mixtral,deepseek' --no-check --fp8 blockwise+dgrad)
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=1 ;;
    --test) TEST=1 ;;
    --bench) BENCH=1 ;;
    --out) need "$@"; OUT=$2; shift ;;
    --jobs) need "$@"; JOBS=$2; shift ;;
    --pytest) need "$@"; PYTEST_ARGS=$2; shift ;;
    --pytest-workers) need "$@"; PYTEST_WORKERS=$2; shift ;;
    --timeout) need "$@"; TIMEOUT=$2; shift ;;
    --benchmarks) need "$@"; BENCHMARKS=$2; shift ;;
    --prebuilt) need "$@"; PREBUILT=$2; shift ;;
    --wheels) need "$@"; WHEELS=$2; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; LAYER_ARGS=("$@"); break ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done
[ -z "$BUILD$TEST$BENCH" ] && BUILD=1 TEST=1 BENCH=1
for b in ${BENCHMARKS//,/ }; do
  case "$b" in
    speed | layer | gemm | hf_train | fp8_refresh | lora_30b | lowrank | rmsnorm | optim | host | clocks) ;;
    step_profile | loss_parity | recipes | recipes_full | fp8_step | fp8_dense | fp8_convergence | variants) ;;
    *) die "--benchmarks: unknown '$b' (see --help)" ;;
  esac
done
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || die "no NVIDIA GPU found (nvidia-smi -L)"

PY=$(command -v python3)
mkdir -p "$OUT"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
# the GPU's short name for result files: "NVIDIA H200" -> h200
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed 's/^NVIDIA //' | tr ' ' '\n' | grep -m1 '[0-9]' |
  cut -d- -f1 | tr 'A-Z' 'a-z' | tr -cd 'a-z0-9')
GPU=${GPU:-gpu}
[ -d .carry/gtest/usr ] && export CMAKE_PREFIX_PATH=$PWD/.carry/gtest/usr
SITE=
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-deps --no-index --target /tmp/moe8-site "$WHEELS"/*.whl && SITE=/tmp/moe8-site
fi
export PYTHONPATH=python${SITE:+:$SITE}
export PYTHONUNBUFFERED=1
limit() { if [ "$TIMEOUT" != 0 ]; then timeout "$TIMEOUT" "$@"; else "$@"; fi; }
# The opt-in kernel variants against their defaults, each where it would be used (OUT/variants/): the FP8
# GEMMs' promotion and the column quantisation alone (bench_gemm), the gathered forward's one or two loading
# warps in the block (gather_in_gemm=1 beside the default), the FP8 block with each promotion, and the bf16
# 128x256 tiles' 128x64 epilogue subtiles (the default) against CUTLASS's 128x32 alone (beside cuBLAS's bound) and
# in the block (MOE8_SM90_EPILOGUE, twice each way, alternated).
variants() {
  local dir=$1 w p
  mkdir -p "$dir"
  limit $PY bench/bench_gemm.py --shapes mixtral,qwen3 --kinds fp8_fwd,fp8_wgrad --fp8-promotions serial,overlap \
    --quant-cols packed,staged --json "$dir/gemm_fp8_variants.json" || return
  for w in 1 2; do
    MOE8_SM90_GATHER_WARPS=$w limit $PY bench/bench_block_peers.py --shapes qwen3,olmoe --peers none \
      --moe8 default,gather_in_gemm=1 --back-to-back 5 --profile 12 --json "$dir/block_gather_warps_$w.json" || return
  done
  for p in serial overlap; do
    MOE8_SM90_FP8_PROMOTION=$p limit $PY bench/bench_block_peers.py --shapes mixtral,qwen3 --routing balanced \
      --peers none --fp8 blockwise+dgrad@handoff,blockwise+dgrad+wgrad@handoff --back-to-back 5 --profile 16 \
      --json "$dir/block_fp8_promotion_$p.json" || return
  done
  limit $PY bench/bench_gemm.py --shapes qwen3,olmoe --routing balanced,uniform,zipf --kinds fwd,dgrad,wgrad \
    --tiles large,solo,epi64,epi64solo --bounds --json "$dir/gemm_epilogue_tiles.json" || return
  block_ab "$dir/block_epilogue" MOE8_SM90_EPILOGUE 32 64 || return
}
# The Qwen3-30B-A3B and OLMoE blocks under each value of environment variable $2 (the values after it), twice each
# way, alternated: $1_<value>_<run>.json.
block_ab() {
  local prefix=$1 var=$2 run v
  shift 2
  for run in 1 2; do
    for v in "$@"; do
      limit env "$var=$v" $PY bench/bench_block_peers.py --shapes qwen3,olmoe --peers none --back-to-back 5 \
        --profile 12 --json "${prefix}_${v}_$run.json" || return
    done
  done
}
has_cuda() { $PY -c "import moe8, sys; sys.exit(0 if moe8.cuda_available() else 1)" 2>/dev/null; }
FAILED=0
t0=$(date +%s)

TESTS=build/gpu/moe8_tests
USE_PREBUILT=
if [ -n "$PREBUILT" ]; then
  if [ ! -d "$PREBUILT" ] && [ -f "$PREBUILT.tgz" ]; then
    mkdir -p "$(dirname "$PREBUILT")" && tar xzf "$PREBUILT.tgz" -C "$(dirname "$PREBUILT")"
  fi
  [ -d "$PREBUILT" ] || die "--prebuilt: no folder $PREBUILT (nor $PREBUILT.tgz)"
  PREBUILT=$(cd "$PREBUILT" && pwd)
  ln -sf "$PREBUILT"/_C*.so python/moe8/
  if has_cuda && [ -x "$PREBUILT/moe8_tests" ]; then
    echo "prebuilt $PREBUILT: moe8 with CUDA"
    USE_PREBUILT=1 TESTS=$PREBUILT/moe8_tests BUILD=
  else
    echo "prebuilt $PREBUILT unusable here (no extension with CUDA, or no moe8_tests): building"
    rm -f python/moe8/_C*.so
    BUILD=1
  fi
fi

if [ -n "$BUILD" ]; then
  echo "== build"
  if cmake -S . -B build/gpu -G Ninja -DMOE8_BUILD_TESTS=ON -DMOE8_BUILD_PYTHON=ON -DPython_EXECUTABLE="$PY" \
    >"$OUT/build.log" 2>&1 && cmake --build build/gpu -j "$JOBS" >>"$OUT/build.log" 2>&1; then
    grep -E "moe8: (CUDA|CUTLASS)" "$OUT/build.log"
    echo "build took $(($(date +%s) - t0)) s"
  else
    grep -B2 -A12 -E "error|FAILED" "$OUT/build.log" | head -80
    exit 1
  fi
fi
if [ -z "$USE_PREBUILT" ]; then
  ls build/gpu/_C*.so >/dev/null 2>&1 || die "no build in build/gpu: run with --build (or --prebuilt DIR)"
  ln -sf "$PWD"/build/gpu/_C*.so python/moe8/
fi
has_cuda || { echo "gpu_suite.sh: moe8 does not import with CUDA" >&2; exit 1; }

if [ -n "$TEST" ]; then
  echo "== GoogleTest"
  if [ -z "$USE_PREBUILT" ]; then
    # the *Speed* tests only print TFLOP/s tables: --bench runs them
    limit ctest --test-dir build/gpu -j 8 -E 'Speed' --output-on-failure >"$OUT/gtest.log" 2>&1 || FAILED=1
    grep -E "tests passed|tests failed|\*\*\*Failed|\(Failed\)" "$OUT/gtest.log" | tail -12
  else
    for i in 0 1 2 3 4 5 6 7; do
      GTEST_TOTAL_SHARDS=8 GTEST_SHARD_INDEX=$i limit "$TESTS" --gtest_filter='-*Speed*' \
        >"$OUT/gtest_shard$i.log" 2>&1 &
    done
    for job in $(jobs -p); do wait "$job" || FAILED=1; done
    cat "$OUT"/gtest_shard*.log >"$OUT/gtest.log" && rm -f "$OUT"/gtest_shard*.log
    grep -h -E "^\[  (PASSED|FAILED)  \]|tests? ran" "$OUT/gtest.log"
  fi
  echo "== pytest"
  XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n $PYTEST_WORKERS")
  IPC=tests/python/test_parallel_ipc.py
  if [ -n "$XDIST" ] && [ "$PYTEST_ARGS" = tests/python ]; then
    # the ipc tests' processes share the GPU and spin-wait on each other: run alone, after the rest
    # shellcheck disable=SC2086
    limit $PY -X faulthandler -m pytest -q -rs $XDIST --durations=8 --ignore $IPC $PYTEST_ARGS >"$OUT/pytest.log" 2>&1 || FAILED=1
    grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
    limit $PY -X faulthandler -m pytest -q -rs --durations=8 $IPC >"$OUT/pytest_ipc.log" 2>&1 || FAILED=1
    grep -E "passed|failed|error" "$OUT/pytest_ipc.log" | tail -3
  else
    # shellcheck disable=SC2086
    limit $PY -X faulthandler -m pytest -q -rs $XDIST --durations=8 $PYTEST_ARGS >"$OUT/pytest.log" 2>&1 || FAILED=1
    grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
  fi
fi

if [ -n "$BENCH" ]; then
  for b in ${BENCHMARKS//,/ }; do
    echo "== $b"
    name=$b
    [ "$b" = host ] && name=eager_direct  # bench_host.py's results: eager_direct_<gpu> in bench/results
    log=$OUT/${name}_$GPU.log json=$OUT/${name}_$GPU.json
    case "$b" in
      speed) limit "$TESTS" --gtest_filter='*Speed*' >"$log" 2>&1 ;;
      layer) limit $PY bench/bench_layer.py "${LAYER_ARGS[@]}" --json "$json" >"$log" 2>&1 ;;
      gemm) limit $PY bench/bench_gemm.py --json "$json" >"$log" 2>&1 ;;
      hf_train) limit $PY bench/bench_hf_train.py --models qwen3,mixtral --steps 5 --warmup 1 --fp8 blockwise+dgrad \
        --json "$json" >"$log" 2>&1 ;;
      fp8_refresh) limit $PY bench/bench_fp8_refresh.py --shapes qwen3,mixtral,deepseek --json "$json" >"$log" 2>&1 ;;
      lora_30b) limit $PY bench/bench_lora_30b.py --adapter-dtype bfloat16 --peft-adapter-dtype float32 \
        --json "$json" >"$log" 2>&1 ;;
      lowrank) limit $PY bench/bench_lowrank.py --ranks 16,32 --json "$json" >"$log" 2>&1 ;;
      rmsnorm) limit $PY bench/bench_rmsnorm.py --json "$json" >"$log" 2>&1 ;;
      optim) limit $PY bench/bench_optim.py --json "$json" >"$log" 2>&1 ;;
      host) limit $PY bench/bench_host.py --json "$json" >"$log" 2>&1 ;;
      clocks) limit $PY bench/bench_clocks.py --json "$json" >"$log" 2>&1 ;;
      step_profile) limit $PY bench/bench_step_profile.py --out "$OUT/$b" >"$log" 2>&1 ;;
      loss_parity) limit $PY bench/bench_loss_parity.py --out "$OUT/$b" >"$log" 2>&1 ;;
      recipes) limit $PY bench/bench_recipes.py --out "$OUT/$b" >"$log" 2>&1 ;;
      recipes_full) limit $PY bench/bench_recipes.py --full --out "$OUT/$b" >"$log" 2>&1 ;;
      fp8_step) limit $PY bench/bench_fp8_step.py --out "$OUT/$b" >"$log" 2>&1 ;;
      fp8_dense) limit $PY bench/bench_fp8_dense.py --memory --out "$OUT/$b" >"$log" 2>&1 ;;
      fp8_convergence) limit $PY bench/bench_fp8_convergence.py --out "$OUT/$b" >"$log" 2>&1 ;;
      variants) variants "$OUT/$b" >"$log" 2>&1 ;;
    esac
    rc=$?
    [ $rc = 0 ] || { FAILED=1; echo "$b: failed (rc $rc), see $log"; }
    if [ "$b" = speed ]; then grep -E "TFLOP|^[a-z].*[0-9]$" "$log" | head -30; else tail -8 "$log"; fi
  done
fi
echo "total $(($(date +%s) - t0)) s; logs and results in $OUT"
exit $FAILED
