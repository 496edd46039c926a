"""moe8.parallel.load — a Hugging Face checkpoint loaded straight into an expert-parallel model: every rank
reads only its own experts' tensors (and the dense ones), never the whole checkpoint.

    model = moe8.parallel.from_pretrained(path, mesh, dtype=torch.bfloat16, device="cuda")

1. the model is built from its config with every parameter on the meta device (buffers, e.g. the rotary
   tables, are real: they are computed, not loaded), then parallelize() gives each experts module its
   [E_local, ...] shards, still on meta;
2. the checkpoint's safetensors files are opened lazily (memory-mapped); per-expert tensors
   (`...experts.<j>.<name>`, the hub's format for Qwen, Mixtral, OLMoE, DeepSeek) are kept only for this
   rank's experts j and renumbered j - first local expert; fused expert tensors (`...experts.gate_up_proj`
   [E, ...], GPT-OSS's format and transformers' own) are read only for this rank's rows;
3. transformers' own key conversions (its conversion mapping: renames, merging the experts' module lists,
   concatenating gate and up) turn that subset into the model's tensors, so the local experts arrive as
   [E_local, ...] and the dense tensors whole. Anything the checkpoint lacks, or has in another shape, is a
   ValueError naming the keys.

Host memory per rank: the dense tensors plus 1/ep of the experts (the files are mapped, not read whole).
Dense tensors are whole on every rank until moe8.parallel.fsdp.apply_fsdp shards them (for an MoE model they
are a few percent of the weights: ~1.3B of Qwen3-30B-A3B's 30.5B).
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import torch
import torch.distributed as dist
from torch import nn

from .hf import EXPERT_PARAMS, experts_modules, parallelize

_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # ...mlp.experts.7.gate_proj.weight
_FUSED = re.compile(r"\.experts\.(" + "|".join(EXPERT_PARAMS) + r")$")  # ...mlp.experts.gate_up_proj


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory); buffers stay real."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def checkpoint_files(path: str) -> list:
    """The safetensors files of a checkpoint directory (its index's, or the single model.safetensors)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise ValueError(
        f"path: expected a Hugging Face checkpoint directory with model.safetensors or "
        f"model.safetensors.index.json, found neither in {path!r}"
    )


def local_state_dict(files: list, first: int, count: int, opened: list) -> dict:
    """The checkpoint tensors this rank needs, lazily: dense tensors whole, per-expert tensors of experts
    [first, first + count) renumbered from 0, fused expert tensors' rows [first, first + count)."""
    from safetensors import safe_open

    out = {}
    for file in files:
        f = safe_open(file, framework="pt", device="cpu")
        opened.append(f)
        for key in f.keys():
            per_expert = _PER_EXPERT.search(key)
            if per_expert:
                j = int(per_expert.group(1))
                if first <= j < first + count:
                    out[f"{key[: per_expert.start()]}.experts.{j - first}.{key[per_expert.end() :]}"] = (
                        f.get_slice(key)
                    )
            elif _FUSED.search(key):
                out[key] = f.get_slice(key)[first : first + count]
            else:
                out[key] = f.get_slice(key)
    return out


def from_pretrained(
    path: str,
    mesh=None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device=None,
    model_class=None,
    config=None,
    transport=None,
    **parallelize_kwargs,
) -> nn.Module:
    """A transformers MoE causal LM from checkpoint directory `path`, expert-parallel over mesh["ep"] (None:
    all ranks), each rank reading only its own experts. Collective: every rank of the mesh calls it.

    dtype: the parameters' dtype; device: where they go (default: the current CUDA device when CUDA is
    available, else the CPU); model_class: default transformers.AutoModelForCausalLM; config: a
    transformers config to use instead of the checkpoint's; transport and parallelize_kwargs: as
    moe8.parallel.parallelize."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
    except ImportError as e:  # transformers' loader moved: this module follows its 5.x layout
        raise ImportError(f"moe8.parallel.from_pretrained needs transformers 5's weight loader: {e}") from e

    files = checkpoint_files(path)
    config = config if config is not None else AutoConfig.from_pretrained(path)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    with parameters_on_meta():
        model = (model_class or AutoModelForCausalLM).from_config(config, dtype=dtype)
    parallelize(model, mesh, transport, device=device, **parallelize_kwargs)
    local = {
        m._moe8_ep["num_experts"] // dist.get_world_size(m._moe8_ep["group"])
        for _, m in experts_modules(model)
    }
    if len(local) != 1:
        raise ValueError(
            f"from_pretrained: the experts modules hold different numbers of experts: {sorted(local)}"
        )
    count = local.pop()
    group = next(m._moe8_ep["group"] for _, m in experts_modules(model))
    first = dist.get_rank(group) * count

    opened: list = []
    state = local_state_dict(files, first, count, opened)
    load = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(model), dtype=dtype)
    info, _ = convert_and_load_state_dict_in_model(model, state, load)
    del state, opened
    problems = {
        "missing": sorted(info.missing_keys),
        "unexpected": sorted(info.unexpected_keys),
        "mismatched shapes": sorted(str(k) for k in info.mismatched_keys),
        "conversion errors": sorted(str(k) for k in getattr(info, "conversion_errors", {}) or {}),
    }
    model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    problems["missing"] = sorted(set(problems["missing"]) | set(still_meta))
    bad = {k: v for k, v in problems.items() if v}
    if bad:
        said = "; ".join(f"{k}: {v[:5]}{' ...' if len(v) > 5 else ''} ({len(v)})" for k, v in bad.items())
        raise ValueError(f"from_pretrained: the checkpoint in {path!r} does not fit the model: {said}")
    return model.to(device).eval()  # as transformers' from_pretrained


__all__ = ["from_pretrained", "parameters_on_meta", "checkpoint_files"]
