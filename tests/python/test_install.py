"""Installing moe8: the `moe8` / `python -m moe8` command (--version, --help, info), the build facts the
extension reports and the warning for a GPU the build can't run at full speed (moe8.build_info), and the
build parallelism scripts/demo.sh and scripts/test.sh pick (scripts/lib/build.sh)."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import moe8
from moe8 import build_info
from moe8.build_info import BuildInfo, mismatch

ROOT = Path(__file__).resolve().parents[2]
H200 = ("NVIDIA H200", (9, 0))
DEFAULT_BUILD = BuildInfo(
    "cuda+cutlass", sass=("90a",), ptx=("80",), cuda_version="13.0.88", cutlass_version="4.2.0"
)


def run_moe8(*args):
    """`python -m moe8 ARGS` with the moe8 these tests import (installed or from the source tree)."""
    where = str(Path(moe8.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=where)
    return subprocess.run(
        [sys.executable, "-m", "moe8", *args], env=env, capture_output=True, text=True, timeout=180
    )


# --- the command ---------------------------------------------------------------------------------------------


def test_version():
    out = run_moe8("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"moe8 {moe8.__version__}"


def test_help_lists_the_commands():
    out = run_moe8("--help")
    assert out.returncode == 0, out.stderr
    for word in ("demo", "finetune", "info", "--version", "python -m moe8"):
        assert word in out.stdout
    assert run_moe8().returncode == 2  # no command: usage, and a usage error
    bad = run_moe8("instal")
    assert bad.returncode == 2 and "unknown command 'instal'" in bad.stderr


def test_info_prints_the_build_torch_and_gpu():
    out = run_moe8("info")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"moe8     {moe8.__version__} (")
    assert f"build    {build_info.read().describe()}" in lines
    assert any(line.startswith(f"torch    {torch.__version__}") for line in lines)
    if not torch.cuda.is_available():
        assert "GPU      none visible" in lines
        assert not any(line.startswith("warning:") for line in lines)
    else:
        name = torch.cuda.get_device_name(torch.cuda.current_device())
        assert any(line.startswith(f"GPU      {name} (compute capability") for line in lines)


# --- the build facts -----------------------------------------------------------------------------------------


def test_the_extension_reports_a_consistent_build():
    info = build_info.read()
    facts = moe8._core.EXT.build_info()
    assert info.backend in ("cpu", "cuda", "cuda+cutlass")
    if info.backend == "cpu":  # the CUDA-less build (csrc/cuda_stub): nothing compiled for a GPU
        assert facts["gencode"] == facts["cuda_version"] == facts["cutlass_version"] == ""
        assert info.describe().startswith("CPU only")
    else:
        assert info.sass or info.ptx, facts["gencode"]
        assert info.cuda_version.split(".")[0].isdigit()
        assert (info.backend == "cuda+cutlass") == bool(info.cutlass_version)
    if not torch.cuda.is_available():
        assert not moe8.cuda_available()


def test_parse_gencode():
    flags = "-gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_100f,code=sm_100f -gencode=arch=compute_80,code=compute_80"
    assert build_info.parse_gencode(flags) == (("90a", "100f"), ("80",))
    assert build_info.parse_gencode("") == ((), ())
    info = build_info.from_facts(
        {"backend": "cuda", "gencode": flags, "cuda_version": "13.0", "cutlass_version": ""}
    )
    assert info.describe() == "CUDA 13.0; SASS sm_90a sm_100f, PTX compute_80"


@pytest.mark.parametrize(
    "arch, cc, sass, ptx",
    [
        ("90a", (9, 0), True, True),
        ("90a", (10, 0), False, False),  # architecture-specific code runs only on its own GPU
        ("80", (8, 6), True, True),  # same major, newer minor
        ("86", (8, 0), False, False),
        ("80", (9, 0), False, True),  # PTX JIT-compiles forward
        ("100f", (10, 3), True, True),
        ("100f", (12, 0), False, False),
        ("120", (10, 0), False, False),
    ],
)
def test_which_code_runs_on_which_gpu(arch, cc, sass, ptx):
    assert build_info.runs_sass(arch, cc) is sass
    assert build_info.runs_ptx(arch, cc) is ptx


def test_bad_arch_names_the_argument():
    with pytest.raises(ValueError, match="arch: expected .* got 'sm90'"):
        build_info.runs_sass("sm90", (9, 0))


# --- the warning ---------------------------------------------------------------------------------------------


def test_no_gpu_no_warning():
    assert mismatch(DEFAULT_BUILD, None) is None
    assert mismatch(BuildInfo("cpu"), None) is None


def test_matching_gpu_no_warning():
    assert mismatch(DEFAULT_BUILD, H200) is None
    assert mismatch(BuildInfo("cuda", sass=("80",), cuda_version="13.0"), ("NVIDIA A10", (8, 6))) is None


def test_gpu_visible_but_no_cuda_build_names_the_rebuild_command():
    msg = mismatch(BuildInfo("cpu"), H200)
    assert "NVIDIA H200 (compute capability 9.0)" in msg
    assert "no CUDA kernels" in msg and "nvcc" in msg
    assert (
        "MOE8_CUDA_ARCHS='90a-real;80-virtual' pip install --no-build-isolation --no-deps --force-reinstall ."
        in msg
    )
    assert "nvidia-cutlass==4.2.0.0" in msg and "docs/install.md" in msg
    assert "\n" not in msg  # one line


def test_gpu_outside_the_compiled_architectures_warns():
    msg = mismatch(DEFAULT_BUILD, ("NVIDIA B200", (10, 0)))
    assert "NVIDIA B200 (compute capability 10.0) is not among" in msg
    assert "SASS sm_90a, PTX compute_80" in msg
    assert "JIT-compile from compute_80 PTX" in msg and "CUTLASS kernels don't run" in msg
    assert (
        "MOE8_CUDA_ARCHS='90a-real;100a-real;80-virtual'" in msg
    )  # this build's architectures plus the GPU's
    old = mismatch(DEFAULT_BUILD, ("Tesla T4", (7, 5)))
    assert "can't run on it" in old and "MOE8_CUDA_ARCHS='90a-real;75-real;80-virtual'" in old
    ampere = mismatch(BuildInfo("cuda", ptx=("80",), cuda_version="13.0"), ("NVIDIA A100", (8, 0)))
    assert "PTX at first use" in ampere and "CUTLASS" not in ampere


def test_enable_warns_once_per_process(monkeypatch):
    """moe8.enable() gives the mismatch warning, once, however often it is called."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(build_info, "read", lambda: BuildInfo("cpu"))
    monkeypatch.setattr(build_info, "visible_device", lambda: H200)
    build_info.warn_once.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            moe8.enable()
            moe8.enable()
        ours = [w for w in caught if "this moe8 build has no CUDA kernels" in str(w.message)]
        assert len(ours) == 1
        assert ours[0].filename == __file__  # points at the caller of enable()
    finally:
        moe8.disable()
        build_info.warn_once.cache_clear()


# --- build parallelism (scripts/lib/build.sh) ----------------------------------------------------------------


def jobs(tmp_path, cores, mem_kb, env_jobs=None):
    """moe8_jobs with `nproc` answering `cores` and a meminfo file with MemAvailable `mem_kb` (None: absent)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nproc").write_text(f"#!/bin/sh\necho {cores}\n")
    (bin_dir / "nproc").chmod(0o755)
    meminfo = tmp_path / "meminfo"
    lines = ["MemTotal:       263842184 kB"] + (
        [f"MemAvailable:   {mem_kb} kB"] if mem_kb is not None else []
    )
    meminfo.write_text("\n".join(lines) + "\n")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    if env_jobs is not None:
        env["JOBS"] = env_jobs
    script = f'source "{ROOT}/scripts/lib/build.sh"; moe8_jobs "{meminfo}"'
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)


GIB = 1024 * 1024  # kB


@pytest.mark.parametrize(
    "cores, mem_kb, expected",
    [
        (16, 128 * GIB, 16),  # the cores, when memory allows
        (16, 20 * GIB, 3),  # capped by memory: 4 GiB a job beyond 6 GiB
        (16, 40 * GIB, 8),
        (2, 24165236, 2),
        (64, 3 * GIB, 1),  # at least one
        (64, 9 * GIB, 1),
        (8, None, 8),  # no MemAvailable line: the cores
    ],
)
def test_jobs_from_cores_and_memory(tmp_path, cores, mem_kb, expected):
    out = jobs(tmp_path, cores, mem_kb)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(expected)


def test_jobs_env_overrides(tmp_path):
    out = jobs(tmp_path, 16, 128 * GIB, env_jobs="3")
    assert out.returncode == 0 and out.stdout.strip() == "3"
    bad = jobs(tmp_path, 16, 128 * GIB, env_jobs="many")
    assert bad.returncode == 2
    assert "JOBS: expected a positive whole number of build jobs, got 'many'" in bad.stderr
