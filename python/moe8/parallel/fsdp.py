"""moe8.parallel.fsdp — FSDP2 (fully_shard) for an expert-parallel model.

Every rank holds its own tokens, so dense parameters are data-parallel over all dp * ep ranks: they are
sharded over the whole mesh (flattened). Each expert shard is replicated over "dp" (the same experts on the
dp groups' corresponding ranks), so when dp > 1 each experts module is sharded over mesh["dp"]; with dp == 1
the expert shards stay plain tensors (FSDP ignores them). Gradients: FSDP averages each parameter over its
mesh; parallelize's grad_scale 1 / ep turns the experts' sum over the ep sources into a mean, so every
gradient is that of the mean of the ranks' losses."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .hf import experts_modules


def _blocks(model: nn.Module) -> list:
    """The decoder layers (transformers' ModuleList at model.layers), the unit FSDP gathers at a time."""
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return list(layers)
    return []


def apply_fsdp(
    model: nn.Module,
    mesh,
    *,
    param_dtype: Optional[torch.dtype] = torch.bfloat16,
    reduce_dtype: Optional[torch.dtype] = torch.float32,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """fully_shard the model of a ("dp", "ep") mesh after moe8.parallel.parallelize: experts modules over
    mesh["dp"] when dp > 1, each decoder layer and the root over all ranks, with
    MixedPrecisionPolicy(param_dtype, reduce_dtype) (bf16 compute copies, fp32 gradient reduction by default).
    Returns the model (changed in place)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    dp = mesh["dp"].size()
    world_mesh = mesh._flatten("dp_ep") if mesh.ndim > 1 else mesh
    experts = [m for _, m in experts_modules(model)]
    ignored = set()
    for m in experts:
        if dp > 1:
            fully_shard(m, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard_after_forward)
        else:
            ignored |= set(m.parameters(recurse=False))
    kw = dict(mesh=world_mesh, mp_policy=mp, ignored_params=ignored or None)
    for block in _blocks(model):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, **kw)
    return model


def average_grads(model: nn.Module, mesh=None) -> None:
    """Without FSDP: the data-parallel gradient average. Dense parameters are averaged over all ranks (every
    rank saw its own tokens); expert shards, whose gradients already sum their ep group's tokens, over
    mesh["dp"] (their replicas) when dp > 1. One all_reduce per parameter."""
    import torch.distributed as dist

    experts = {id(p) for _, m in experts_modules(model) if hasattr(m, "_moe8_ep") for p in m.parameters()}
    dp_group = mesh["dp"].get_group() if mesh is not None and mesh["dp"].size() > 1 else None
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) not in experts:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        elif dp_group is not None:
            dist.all_reduce(p.grad, group=dp_group)
            p.grad.div_(mesh["dp"].size())
