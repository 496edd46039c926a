"""moe8.build_info — what this moe8 build holds, read from the extension (moe8._C.build_info(), defined by
CMakeLists.txt): CPU only, CUDA, or CUDA with the CUTLASS sm90a kernels; the GPU architectures the kernels
were compiled for (SASS, and PTX that the driver JIT-compiles for newer GPUs); the CUDA and CUTLASS versions.

`mismatch(info, device)` is the one-line warning for a visible GPU this build can't run at full speed (no
CUDA kernels at all, or a compute capability outside the compiled architectures), with the command that
rebuilds moe8 for it; `moe8 info` prints it and `moe8.enable()` warns with it once per process."""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from typing import Optional, Tuple

from ._core import EXT

Capability = Tuple[int, int]

REBUILD = (
    "pip install --no-deps nvidia-cutlass==4.2.0.0 && MOE8_CUDA_ARCHS='{archs}' "
    "pip install --no-build-isolation --no-deps --force-reinstall ."
)
WHERE = "in the moe8 source tree, with the CUDA toolkit's nvcc on PATH (docs/install.md)"


@dataclasses.dataclass(frozen=True)
class BuildInfo:
    backend: str  # "cpu" (built without nvcc), "cuda", or "cuda+cutlass" (the sm90a CUTLASS kernels too)
    sass: Tuple[str, ...] = ()  # architectures with compiled machine code, e.g. ("90a",)
    ptx: Tuple[str, ...] = ()  # architectures with PTX, e.g. ("80",)
    cuda_version: str = ""  # the CUDA toolkit built against, e.g. "13.0.88"
    cutlass_version: str = ""  # e.g. "4.2.0"

    @property
    def has_cuda(self) -> bool:
        return self.backend != "cpu"

    def describe(self) -> str:
        """One line: 'CUDA 13.0.88 + CUTLASS 4.2.0 sm90a kernels; SASS sm_90a, PTX compute_80' or 'CPU only ...'."""
        if not self.has_cuda:
            return "CPU only (built without nvcc: no CUDA kernels)"
        kernels = f" + CUTLASS {self.cutlass_version} sm90a kernels" if self.cutlass_version else ""
        archs = ", ".join(
            part
            for part in (
                "SASS " + " ".join(f"sm_{a}" for a in self.sass) if self.sass else "",
                "PTX " + " ".join(f"compute_{a}" for a in self.ptx) if self.ptx else "",
            )
            if part
        )
        return f"CUDA {self.cuda_version}{kernels}; {archs or 'no architectures'}"


def parse_gencode(flags: str) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(sass, ptx) architectures of nvcc flags like '-gencode=arch=compute_90a,code=sm_90a ...'."""
    sass, ptx = [], []
    for kind, arch in re.findall(r"code=(sm|compute)_([0-9]+[af]?)", flags):
        out = sass if kind == "sm" else ptx
        if arch not in out:
            out.append(arch)
    return tuple(sass), tuple(ptx)


def from_facts(facts: dict) -> BuildInfo:
    """A BuildInfo from the dict moe8._C.build_info() returns."""
    sass, ptx = parse_gencode(facts.get("gencode", ""))
    return BuildInfo(
        backend=facts["backend"],
        sass=sass,
        ptx=ptx,
        cuda_version=facts.get("cuda_version", ""),
        cutlass_version=facts.get("cutlass_version", ""),
    )


@functools.cache
def read() -> BuildInfo:
    """This build's facts."""
    return from_facts(EXT.build_info())


def _split(arch: str) -> Tuple[int, int, str]:
    """'90a' -> (9, 0, 'a'); '100' -> (10, 0, ''); '86' -> (8, 6, '')."""
    m = re.fullmatch(r"([0-9]+)([0-9])([af]?)", arch)
    if m is None:
        raise ValueError(f"arch: expected digits with an optional a/f suffix like '90a', got {arch!r}")
    return int(m.group(1)), int(m.group(2)), m.group(3)


def runs_sass(arch: str, cc: Capability) -> bool:
    """Machine code for `arch` runs on a GPU of compute capability cc: same major and minor >= arch's; the
    architecture-specific 'a' variants (sm_90a) only on exactly their own."""
    major, minor, suffix = _split(arch)
    if suffix == "a":
        return tuple(cc) == (major, minor)
    return cc[0] == major and cc[1] >= minor


def runs_ptx(arch: str, cc: Capability) -> bool:
    """PTX for `arch` JIT-compiles for any GPU at least as new ('a' variants: only their own; 'f': their family)."""
    major, minor, suffix = _split(arch)
    if suffix == "a":
        return tuple(cc) == (major, minor)
    if suffix == "f":
        return cc[0] == major and cc[1] >= minor
    return tuple(cc) >= (major, minor)


def arch_for(cc: Capability) -> str:
    """The MOE8_CUDA_ARCHS entry that builds machine code for cc: '90a-real' for 9.0 (Hopper's features)."""
    return f"{cc[0]}{cc[1]}{'a' if cc[0] >= 9 else ''}-real"


def mismatch(info: BuildInfo, device: Optional[Tuple[str, Capability]]) -> Optional[str]:
    """The warning for a GPU this build runs slowly or not at all, or None. device: (name, (major, minor)) of
    the visible GPU, None when none is visible."""
    if device is None:
        return None
    name, cc = device
    gpu = f"{name} (compute capability {cc[0]}.{cc[1]})"
    real = [f"{a}-real" for a in info.sass] if info.has_cuda else ["90a-real"]
    virtual = [f"{a}-virtual" for a in info.ptx] if info.has_cuda else ["80-virtual"]
    archs = ";".join(dict.fromkeys(real + [arch_for(cc)] + virtual))  # this build's, plus the GPU's
    if not info.has_cuda:
        return (
            f"moe8: a GPU is visible, {gpu}, but this moe8 build has no CUDA kernels (it was built where no nvcc "
            f"was found), so moe8's ops can't run on it; rebuild {WHERE}: {REBUILD.format(archs=archs)}"
        )
    if any(runs_sass(a, cc) for a in info.sass):
        return None
    compiled = info.describe().split("; ", 1)[-1]
    jit = [a for a in info.ptx if runs_ptx(a, cc)]
    if jit:
        how = (
            f"its kernels JIT-compile from compute_{jit[0]} PTX at first use"
            + (" and the sm90a CUTLASS kernels don't run" if info.cutlass_version else "")
            + ", so moe8 runs slower than it could"
        )
    else:
        how = "moe8's CUDA kernels can't run on it"
    return (
        f"moe8: the GPU {gpu} is not among the architectures this moe8 build was compiled for ({compiled}): "
        f"{how}; rebuild {WHERE}: {REBUILD.format(archs=archs)}"
    )


def visible_device() -> Optional[Tuple[str, Capability]]:
    """(name, compute capability) of the current CUDA device as torch sees it, None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    return torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index))


@functools.cache
def warn_once() -> Optional[str]:
    """Warn (once per process) when the visible GPU doesn't match this build; returns the warning or None."""
    message = mismatch(read(), visible_device())
    if message:
        warnings.warn(message, stacklevel=3)
    return message
