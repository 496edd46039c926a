"""What a result file states about its run: date, commit, device, driver, CUDA and the library versions.

    from run_info import run_info  # this folder is on sys.path
    meta = {**run_info(device), "tokens": 16384}

A fact that cannot be read here (no git checkout, no nvidia-smi, a library not installed) is written as
"not recorded", never guessed. MOE8_COMMIT, when set, is the commit recorded (see commit())."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

import moe8

NOT_RECORDED = "not recorded"
ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd: str) -> str | None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 and p.stdout.strip() else None


def commit() -> str:
    """The checkout's commit, with "+changes" when tracked files differ from it; $MOE8_COMMIT instead when set
    (a tree copied to a GPU machine without its history, or with a stale one: the commit it was copied from)."""
    if os.environ.get("MOE8_COMMIT"):
        return os.environ["MOE8_COMMIT"]
    head = _run("git", "rev-parse", "--short", "HEAD")
    if head is None:
        return NOT_RECORDED
    dirty = _run("git", "status", "--porcelain", "--untracked-files=no")
    return head + ("+changes" if dirty else "")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or NOT_RECORDED


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return NOT_RECORDED


def run_info(device: torch.device | str | None = None) -> dict:
    """{date, commit, gpu, driver, cuda, torch, transformers, peft, cutlass, python, moe8} of this run; on a
    CPU device, gpu is the processor and driver / cuda are "none"."""
    dev = torch.device(device) if device is not None else None
    on_gpu = dev.type == "cuda" if dev is not None else torch.cuda.is_available()
    if on_gpu:
        gpu = torch.cuda.get_device_name(dev if dev is not None and dev.index is not None else 0)
        driver = _run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        driver = driver.splitlines()[0] if driver else NOT_RECORDED
        cuda = torch.version.cuda or NOT_RECORDED
    else:
        gpu = f"cpu: {_cpu_name()}, {os.cpu_count()} cores"
        driver = cuda = "none"
    return {
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "gpu": gpu,
        "driver": driver,
        "cuda": cuda,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "cutlass": _version("nvidia-cutlass"),
        "python": platform.python_version(),
        "moe8": moe8.__version__,
    }
