"""moe8.parallel — expert parallelism: experts sharded over the expert-parallel dim of a torch DeviceMesh,
token rows moved by a transport ("nccl": torch.distributed all_to_all; "ipc": CUDA IPC within a node).
See docs/parallel.md."""

from . import aux, checkpoint, fsdp
from .experts import ep_experts_forward, make_transport
from .hf import experts_modules, gather_experts, is_parallel, parallelize, unparallelize
from .load import from_pretrained
from .mesh import make_mesh
from .transport import Meta, Transport, TransportError, weighted_sum

__all__ = [
    "Meta",
    "aux",
    "checkpoint",
    "fsdp",
    "Transport",
    "TransportError",
    "ep_experts_forward",
    "experts_modules",
    "from_pretrained",
    "gather_experts",
    "is_parallel",
    "make_mesh",
    "make_transport",
    "parallelize",
    "unparallelize",
    "weighted_sum",
]
