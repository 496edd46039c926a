"""moe8.parallel.checkpoint — a Hugging Face checkpoint (safetensors shards + index, config) written from an
expert-parallel (and FSDP2-sharded) model by global rank 0, loadable by `from_pretrained` on one process.

Parameters are visited in state_dict order; a DTensor (FSDP2) is made full with full_tensor() (all of its
mesh's ranks take part), an expert-parallel module's shards are gathered to rank 0 over its ep group; rank 0
keeps one shard file's worth at a time. No rank ever holds the whole model. By default the keys are written
in the model's original format (transformers' revert_weight_conversion, applied per shard file as
save_pretrained does for offloaded models; a module's tensors never straddle two files)."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .hf import EXPERT_PARAMS, experts_modules


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)  # DTensor (FSDP2)
    return (full_tensor() if full_tensor is not None else t).detach()


def _gather_to_rank0(shard: torch.Tensor, group) -> Optional[torch.Tensor]:
    """cat of the group's shards along dim 0 on global rank 0; None elsewhere (ranks outside rank 0's group
    return None without communicating)."""
    ranks = dist.get_process_group_ranks(group)
    if 0 not in ranks:
        return None
    shard = shard.contiguous()
    mine = dist.get_rank() == 0
    parts = [torch.empty_like(shard) for _ in ranks] if mine else None
    dist.gather(shard, parts, group_dst=ranks.index(0), group=group)
    return torch.cat(parts) if mine else None


def save_pretrained(
    model: nn.Module, path: str, *, max_shard_bytes: int = 5 * 2**30, original_format: bool = True
) -> None:
    """Write `model` (after moe8.parallel.parallelize, optionally under fully_shard) to `path` as
    transformers' save_pretrained would from one process. Collective: every rank calls it."""
    writer = dist.get_rank() == 0
    ep = {name: m for name, m in experts_modules(model) if hasattr(m, "_moe8_ep")}
    if writer:
        os.makedirs(path, exist_ok=True)
    files, shard, size, seen = [], {}, 0, set()
    written_keys = {}

    def flush():
        nonlocal shard, size
        if not shard:
            return
        if original_format:
            from transformers.core_model_loading import revert_weight_conversion

            shard = revert_weight_conversion(model, shard)
        from safetensors.torch import save_file

        name = f"part-{len(files):05d}.safetensors"
        save_file(
            {k: v.contiguous() for k, v in shard.items()}, os.path.join(path, name), metadata={"format": "pt"}
        )
        files.append(name)
        written_keys[name] = list(shard)
        shard, size = {}, 0

    previous_module = None
    for key, t in model.state_dict().items():
        module, _, leaf = key.rpartition(".")
        local = getattr(t, "_local_tensor", t)
        if (local.data_ptr(), local.shape) in seen and local.numel():  # tied weights: the first key is kept
            continue
        seen.add((local.data_ptr(), local.shape))
        if writer and module != previous_module and size >= max_shard_bytes:
            flush()
        previous_module = module
        t = _full(t)
        if module in ep and leaf in EXPERT_PARAMS:
            t = _gather_to_rank0(t, ep[module]._moe8_ep["group"])
        if writer:
            shard[key] = t.cpu()
            size += t.numel() * t.element_size()
    if writer:
        flush()
        n = len(files)
        names = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        for old, new in zip(files, names):
            os.replace(os.path.join(path, old), os.path.join(path, new))
        if n > 1:
            total = sum(os.path.getsize(os.path.join(path, f)) for f in names)
            weight_map = {k: new for old, new in zip(files, names) for k in written_keys[old]}
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        config = getattr(model, "config", None)
        if config is not None:
            config.save_pretrained(path)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(path)
    dist.barrier()


# ---------------------------------------------------------------------------------- training state
def _ep_key(key: str, ep_modules: dict) -> Optional[str]:
    """The per-shard name of an expert parameter's key (None for other keys): the ep ranks hold different
    tensors under the same name, which torch.distributed.checkpoint would take for one replicated tensor."""
    module, _, leaf = key.rpartition(".")
    m = ep_modules.get(module)
    if m is None or leaf not in EXPERT_PARAMS:
        return None
    return f"{key}.ep{dist.get_rank(m._moe8_ep['group'])}of{dist.get_world_size(m._moe8_ep['group'])}"


def _renamed(state: dict, model: nn.Module) -> dict:
    """{"model": ..., "optim": ...} of get_state_dict with expert keys made per shard (see _ep_key)."""
    ep = {name: m for name, m in experts_modules(model) if hasattr(m, "_moe8_ep")}

    def name(k):
        return _ep_key(k, ep) or k

    out = {"model": {name(k): v for k, v in state["model"].items()}}
    if "optim" in state:
        optim = dict(state["optim"])
        optim["state"] = {name(k): v for k, v in optim["state"].items()}
        optim["param_groups"] = [
            dict(g, params=[name(k) for k in g["params"]]) for g in optim.get("param_groups", [])
        ]
        out["optim"] = optim
    return out


def _get(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_state(model: nn.Module, optimizer, path: str) -> None:
    """Model and optimizer state of every rank with torch.distributed.checkpoint (each rank writes its own
    shards; FSDP2 DTensors as DTensors, each expert shard under its own key). Collective."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_renamed(_get(model, optimizer), model), checkpoint_id=path)


def load_state(model: nn.Module, optimizer, path: str) -> None:
    """Load what save_state wrote into a model (and optimizer) built and parallelized the same way (the same
    mesh: expert shards are keyed by ep rank). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = _get(model, optimizer)
    renamed = _renamed(state, model)
    dcp.load(renamed, checkpoint_id=path)  # in place into the tensors, which state and renamed share
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
