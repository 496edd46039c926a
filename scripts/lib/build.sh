# scripts/lib/build.sh — shell functions shared by scripts/demo.sh and scripts/test.sh (source it):
#   moe8_jobs [MEMINFO]   build parallelism: $JOBS when set, else the core count (nproc) capped by memory:
#                         one job per 4 GiB of MemAvailable beyond the first 6 GiB, at least 1. (nvcc's cicc
#                         peaked at 8.6 GB on grouped_gemm_sm90.cu and 5.9 GB on grouped_gemm_fp8_sm90.cu,
#                         the two CUTLASS units; the 6 GiB held back is for them.)
#                         MEMINFO: the meminfo file to read (default /proc/meminfo).
#   moe8_nvcc             the nvcc the build will use ($CUDACXX, nvcc on PATH, then $CUDA_HOME/bin/nvcc,
#                         /usr/local/cuda/bin/nvcc), exported as CUDACXX; prints nothing, fails when none.
#   moe8_build_minutes cuda|cpu JOBS
#                         the minutes a first build takes with JOBS jobs, roughly (see the function).
#   moe8_pip_build LOG PIP_ARGS...
#                         runs `pip PIP_ARGS -v`, all of its output to LOG, printing only CMake's moe8 lines
#                         and ninja's [n/N] progress (one line per compiled file); on failure, LOG's tail.

MOE8_GIB_PER_JOB=4
MOE8_GIB_RESERVED=6

moe8_jobs() {
  if [ -n "${JOBS:-}" ]; then
    case "$JOBS" in
      '' | *[!0-9]* | 0)
        echo "JOBS: expected a positive whole number of build jobs, got '$JOBS'" >&2
        return 2
        ;;
    esac
    echo "$JOBS"
    return 0
  fi
  local meminfo=${1:-/proc/meminfo} cores mem_kb by_mem
  cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
  mem_kb=$(awk '$1 == "MemAvailable:" { print $2 }' "$meminfo" 2>/dev/null)
  by_mem=$cores
  if [ -n "$mem_kb" ]; then by_mem=$(((mem_kb - MOE8_GIB_RESERVED * 1024 * 1024) / (MOE8_GIB_PER_JOB * 1024 * 1024))); fi
  local jobs=$((cores < by_mem ? cores : by_mem))
  echo $((jobs < 1 ? 1 : jobs))
}

# A first build's wall time is about max(its longest unit, all units' time / jobs) plus a minute of configure
# and packaging. The figures are seconds of one CUDA 13.0 + CUTLASS 4.2.0 build on a 2-core AMD EPYC machine
# (ninja's log: 45 units, 795 s in all, grouped_gemm_sm90.cu 353 s alone) and of a CPU-only build.
moe8_build_minutes() {
  local total=150 longest=25
  if [ "$1" = cuda ]; then total=795 longest=353; fi
  local spread=$((total / $2))
  local seconds=$(((spread > longest ? spread : longest) + 60))
  echo $(((seconds + 59) / 60))
}

moe8_nvcc() {
  local c
  for c in "${CUDACXX:-}" "$(command -v nvcc 2>/dev/null)" "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" /usr/local/cuda/bin/nvcc; do
    if [ -n "$c" ] && [ -x "$c" ]; then
      export CUDACXX=$c
      return 0
    fi
  done
  return 1
}

moe8_pip_build() {
  local log=$1
  shift
  mkdir -p "$(dirname "$log")"
  # pipefail: the status is pip's, not grep's
  if (set -o pipefail && "$@" -v 2>&1 | tee "$log" |
    grep --line-buffered -E '^ *(-- moe8:|\[[1-9][0-9]*/[0-9]+\] )' |
    sed -u -E 's/^ *-- /   /; s/^ *(\[[0-9]+\/[0-9]+\]) [A-Za-z ]* object [^ ]*\.dir\/(.*)\.o$/   \1 \2/; s/^ *(\[[0-9]+\/[0-9]+\]) Linking [A-Za-z+ ]* (.*)$/   \1 linking \2/; s#(\] ).*/site-packages/#\1#'); then
    return 0
  fi
  echo "moe8: the build failed; the last lines of $log:" >&2
  tail -n 40 "$log" >&2
  return 1
}
