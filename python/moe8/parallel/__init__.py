"""moe8.parallel — expert parallelism: experts sharded over an expert-parallel group of a torch DeviceMesh,
token rows moved by a transport ("nccl": torch.distributed all_to_all; "ipc": CUDA IPC within a node).
See docs/parallel.md."""

from .experts import ep_experts_forward, make_transport
from .transport import Meta, Transport, TransportError, weighted_sum

__all__ = ["Meta", "Transport", "TransportError", "ep_experts_forward", "make_transport", "weighted_sum"]
