#!/usr/bin/env bash
# Prepares .carry/ (git-ignored) for a GPU machine without network, on a machine with network and nvcc but no
# GPU (docs/developing.md): the pinned wheels (.carry/wheels, and .carry/wheels-lite without the CUTLASS wheel), the
# shared corpus and tokenizer (.carry/shared/data, when ../shared/data exists), an unpacked libgtest-dev
# (.carry/gtest), and the moe8._C extension for the GPU machine's Python plus the CUDA GoogleTest binary,
# stripped and packed as .carry/py312.tgz (for gpu_suite.sh --prebuilt .carry/py312).
#   PY312=/path/to/python3.12 JOBS=2 bash scripts/carry_prebuilt.sh
# PY312: a CPython of the GPU machine's minor version (default: pyenv's 3.12, else python3.12 on PATH); it gets
# the pinned nanobind and nvidia-cutlass wheels. The build goes to build/gpu312 (incremental on later runs).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-2}
PY=${PYTHON:-python3}
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
if [ $# -gt 0 ]; then
  echo "carry_prebuilt.sh: takes no arguments (got: $*); see --help" >&2
  exit 2
fi
PY312=${PY312:-}
if [ -z "$PY312" ] && command -v pyenv >/dev/null; then
  PY312=$(ls -d "$(pyenv root)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1 || true)
fi
PY312=${PY312:-$(command -v python3.12 || true)}
if [ -z "$PY312" ] || ! "$PY312" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then
  echo "carry_prebuilt.sh: PY312 must be a Python 3.12 interpreter (got '${PY312}')" >&2
  exit 2
fi
grep -qx "/.carry/" .gitignore || { echo "carry_prebuilt.sh: .gitignore must ignore /.carry/" >&2; exit 2; }

echo "== wheels"
mkdir -p .carry/wheels
$PY -m pip download -q --disable-pip-version-check --no-deps -d .carry/wheels nanobind==2.9.2 nvidia-cutlass==4.2.0.0 \
  peft==0.21.2 accelerate==1.11.0 pytest-xdist==3.8.0 execnet==2.1.1
$PY -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d .carry/wheels psutil==7.1.0
rm -rf .carry/wheels-lite && mkdir -p .carry/wheels-lite
find .carry/wheels -name '*.whl' ! -name 'nvidia_cutlass*' -exec cp {} .carry/wheels-lite/ \;
if [ -d ../shared/data ]; then
  echo "== shared data"
  mkdir -p .carry/shared && rm -rf .carry/shared/data && cp -r ../shared/data .carry/shared/
fi
if dpkg -L libgtest-dev >/dev/null 2>&1; then
  echo "== gtest"
  for f in $(dpkg -L libgtest-dev); do
    if [ -f "$f" ]; then mkdir -p ".carry/gtest$(dirname "$f")" && cp "$f" ".carry/gtest$f"; fi
  done
fi

echo "== build (_C for $("$PY312" --version), moe8_tests)"
"$PY312" -m pip install -q --disable-pip-version-check --no-deps .carry/wheels/nanobind-2.9.2-py3-none-any.whl \
  .carry/wheels/nvidia_cutlass-4.2.0.0-py3-none-any.whl
mkdir -p build
# -U: the optimised build type CMakeLists.txt sets when none is given, whatever an earlier configure cached
cmake -S . -B build/gpu312 -G Ninja -DMOE8_BUILD_TESTS=ON -DPython_EXECUTABLE="$PY312" -UCMAKE_BUILD_TYPE \
  >build/gpu312-configure.log 2>&1 || { tail -20 build/gpu312-configure.log; exit 1; }
if ! grep -q "moe8: CUTLASS sm90a kernels ON" build/gpu312-configure.log; then
  grep "moe8:" build/gpu312-configure.log >&2
  echo "carry_prebuilt.sh: the build has no CUDA or no CUTLASS sm90a kernels (needs nvcc and the CUTLASS wheel)" >&2
  exit 1
fi
cmake --build build/gpu312 -j "$JOBS" --target _C moe8_tests
rm -rf .carry/py312 && mkdir -p .carry/py312
cp build/gpu312/_C*.so build/gpu312/moe8_tests .carry/py312/
strip .carry/py312/*
tar czf .carry/py312.tgz -C .carry py312
du -sh .carry/py312.tgz .carry/wheels-lite
echo "carry: [\".carry/py312.tgz\", \".carry/wheels-lite\"] (and \".carry/shared\" for the corpus);" \
  "there: bash scripts/gpu_suite.sh --prebuilt .carry/py312 --wheels .carry/wheels-lite --test"
