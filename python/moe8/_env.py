"""moe8._env — the MOE8_* environment variables, read once when moe8 is imported. They are defaults only:
moe8.Config takes its defaults from here, and nothing reads the environment again afterwards.

    MOE8_ROUTED_DOWN=0    Config.routed_down defaults to False
    MOE8_EAGER_DIRECT=0   every op call goes through the torch.library dispatcher (moe8._core)
    MOE8_SHARED_DATA=DIR  where `moe8 finetune` and the benchmarks look for the shared corpus and tokenizer
    MOE8_FINETUNE_DIST_TIMEOUT=S  seconds a `moe8 finetune` collective waits for a peer under torchrun (600)

and torchrun's WORLD_SIZE, RANK, LOCAL_RANK and LOCAL_WORLD_SIZE (unset: one process), which `moe8 finetune`
runs by and moe8.parallel's transport="auto" reads (ranks per node).

The sm_90a kernels' tuning overrides (MOE8_SM90_*) are read once by the C++ core (docs/kernels.md)."""

from __future__ import annotations

import os
from types import MappingProxyType


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name}: expected 0 or 1, got {value!r}")
    return value == "1"


def _int(name: str, default):
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {value!r}") from None


ENV = MappingProxyType(
    {
        "routed_down": _flag("MOE8_ROUTED_DOWN", True),
        "eager_direct": _flag("MOE8_EAGER_DIRECT", True),
        "shared_data": os.environ.get("MOE8_SHARED_DATA") or None,
        "finetune_dist_timeout": _int("MOE8_FINETUNE_DIST_TIMEOUT", 600),
        "world_size": max(1, _int("WORLD_SIZE", 1)),
        "rank": _int("RANK", 0),
        "local_rank": _int("LOCAL_RANK", None),
        "local_world_size": _int("LOCAL_WORLD_SIZE", None),
    }
)
