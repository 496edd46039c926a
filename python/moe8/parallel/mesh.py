"""moe8.parallel.mesh — the device mesh expert parallelism runs on: dims ("dp", "ep"), ep innermost, so
the ranks of one expert-parallel group are consecutive (one node's GPUs when ep <= GPUs per node).

Every rank holds its own tokens. Dense parameters are data-parallel over all dp * ep ranks; the experts of a
layer are split over the `ep` ranks of a group and data-parallel over `dp` (the groups' replicas)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIMS = ("dp", "ep")


def make_mesh(ep: int, dp: Optional[int] = None, device_type: Optional[str] = None) -> DeviceMesh:
    """A ("dp", "ep") DeviceMesh over the default process group (torch.distributed must be initialised).

    ep: ranks per expert-parallel group; dp: number of groups (default world / ep); device_type: "cuda" or
    "cpu" (default "cuda" when the default group's backend is NCCL, else "cpu")."""
    world = dist.get_world_size()
    if ep < 1 or world % ep:
        raise ValueError(f"ep: expected a divisor of the world size {world}, got {ep}")
    dp = world // ep if dp is None else dp
    if dp * ep != world:
        raise ValueError(f"dp * ep: expected the world size {world}, got dp {dp} x ep {ep} = {dp * ep}")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" and torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dp, ep), mesh_dim_names=DIMS)
