"""moe8.parallel.hf — expert parallelism for Hugging Face transformers (>= 5) MoE models.

    mesh = moe8.parallel.make_mesh(ep=4)
    moe8.parallel.parallelize(model, mesh)       # each experts module keeps E / ep experts per rank

transformers v5 keeps a layer's experts in one module with 3D parameters (gate_up_proj, down_proj, GPT-OSS
also biases) called as experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K]) after the router.
parallelize() slices those parameters, and the expert LoRA factors moe8.lora.apply_lora adds ([E, ...] too),
to this rank's experts (same names, so state_dict keys stay HF's) and gives each such module an
instance-level forward that runs moe8.parallel.ep_experts_forward; the router is untouched, so hooks on it
(router logits for the aux loss) keep working. unparallelize() undoes it.
"""

from __future__ import annotations

import contextlib
import types
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..experts import ExpertLoRA
from ..hf.families import FAMILIES, experts_spec  # noqa: F401 (FAMILIES: part of this module's API)
from ..hf.forward import module_config
from ..hf.patching import config_of
from ..hf.registry import registry
from .experts import ep_experts_forward, make_transport
from .transport import DEFAULT_TIMEOUT_S, Transport, on_device, wait_bounded

LORA_PARAMS = ("gate_up_lora_A", "gate_up_lora_B", "down_lora_A", "down_lora_B")  # moe8.lora.apply_lora's
EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias", *LORA_PARAMS)


def experts_modules(model: nn.Module) -> list:
    """(qualified name, module) of every fused experts module: a 3D gate_up_proj and transformers' layout
    attributes (has_gate, is_transposed)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
        and m.gate_up_proj.dim() == 3
        and hasattr(m, "has_gate")
        and hasattr(m, "is_transposed")
    ]


def experts_kwargs(module: nn.Module) -> dict:
    """moe8.experts_forward's layout keywords for a transformers experts module (moe8.hf.families, the table
    the single-GPU integration uses too); ValueError when moe8 can't run it."""
    spec = experts_spec(module)
    if isinstance(spec, str):
        raise ValueError(f"{type(module).__name__}: moe8.parallel can't run these experts: {spec}")
    return spec


def _ep_forward(self, hidden_states, top_k_index, top_k_weights):
    st = self._moe8_ep
    extra = {}
    if self.has_bias:
        extra = dict(gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias)
    if hasattr(self, "gate_up_lora_A"):  # expert LoRA (moe8.lora.apply_lora): the local experts' factors
        extra["lora"] = ExpertLoRA(
            *(getattr(self, p) for p in LORA_PARAMS),
            self.lora_scaling,
            self.lora_dropout if self.training else 0.0,
        )
    y = ep_experts_forward(
        hidden_states,
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        transport=st["transport"],
        check_ids=st["check_ids"],
        grad_scale=st["grad_scale"],
        layer=st["name"],
        config=module_config(self),  # the model's moe8.Config (routed_down, fp8, ...), as on one GPU
        **st["kwargs"],
        **extra,
    )
    return y.to(hidden_states.dtype)


def _check_same(info: dict, group) -> None:
    """ValueError on every rank when the ranks' configurations differ (naming the field and the ranks)."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, info, group=group)
    for key in info:
        values = [i[key] for i in everyone]
        if any(v != values[0] for v in values):
            differ = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values) if v != values[0])
            raise ValueError(
                f"parallelize: the ranks disagree on {key} (rank 0: {values[0]}; {differ}); every rank must "
                "build the same model and call parallelize with the same mesh and transport"
            )


def _tokens_of(args: tuple, kwargs: dict) -> int:
    """The tokens of a causal LM's forward (input_ids [B, S], or inputs_embeds [B, S, H]); -1 when unknown."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
        return embeds.shape[:-1].numel()
    return -1


def _refuse_empty_ranks(model, args, kwargs) -> None:
    """A forward pre-hook of an expert-parallel model: the ranks exchange their token counts (one small
    all_gather, bounded), and a rank without tokens makes every rank raise the same ValueError before any
    layer runs (its attention would fail, and its peers would wait for it in their first MoE layer)."""
    st = model._moe8_ep_model
    group, timeout_s = st["group"], st["timeout_s"]
    mine = torch.tensor([_tokens_of(args, kwargs)], dtype=torch.int64, device=on_device(group))
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    wait_bounded(
        dist.all_gather(parts, mine, group=group, async_op=True), timeout_s, "token count all_gather", group
    )
    counts = torch.cat(parts).tolist()
    empty = [r for r, n in enumerate(counts) if n == 0]
    if empty:
        raise ValueError(
            f"input_ids: rank{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} of the expert-parallel "
            f"model {'have' if len(empty) > 1 else 'has'} no tokens (tokens by rank: {counts}); every rank must "
            "run at least one token in each forward (drop or pad the last, incomplete batch)"
        )


def auto_transport(ep: int, device) -> str:
    """What transport="auto" means for ep groups of consecutive ranks (make_mesh's inner dim): "ipc" when the
    experts run on CUDA, this moe8 build has the ipc transport and each group lies inside one node (torchrun's
    LOCAL_WORLD_SIZE, the ranks per node, is a multiple of ep); "nccl" otherwise (several nodes per group, no
    torchrun, CPU). A pure function of the launch, so every rank decides the same without a collective."""
    from .._core import EXT
    from .._env import ENV

    per_node = ENV["local_world_size"]
    cuda = torch.device(device).type == "cuda" and hasattr(EXT, "IpcBuffer")
    return "ipc" if cuda and per_node is not None and per_node % ep == 0 else "nccl"


def parallelize(
    model: nn.Module,
    mesh,
    transport: Union[str, Transport, None] = None,
    *,
    grad_scale: Optional[float] = None,
    check_ids: bool = False,
    device=None,
    max_tokens: Optional[int] = None,
    timeout_s: Optional[float] = None,
) -> nn.Module:
    """Shard the experts of a transformers MoE model over mesh["ep"] and run them expert-parallel; returns
    the model (changed in place).

    mesh: a DeviceMesh with an "ep" dim (make_mesh), or None for one group of all ranks.
    transport: "nccl" (torch.distributed all_to_all), "ipc", "auto", or a Transport built over mesh["ep"]'s
        group; None: the model's moe8.Config.transport (moe8.accelerate(model, transport=...)). "auto":
        "ipc" when the experts are on CUDA and each ep group inside one node, else "nccl" (auto_transport).
    device: where the experts will run, for "auto" (default: where the model's parameters are).
    grad_scale: factor on the expert gradients; default 1 / ep, so that after the dense gradients are
        averaged over all ranks every gradient is that of the mean of the ranks' losses.
    check_ids: range-check the router's ids (they come from a top-k over the experts: off by default).
    max_tokens: for "ipc", the most tokens a rank runs in one forward: buffers of that size, and a larger batch
        raises the same ValueError on every rank; None: buffers sized by the first batch and grown on every
        rank when a later one needs more.
    timeout_s: the longest a transport waits for its peers (a peer that stalled or exited) before raising
        TransportError naming the rank and the layer; default 300 s for "nccl", 10 s for ipc's GPU barriers.
    A forward where some rank has no tokens raises the same ValueError on every rank before any layer runs.

    Every rank must build the same model; a different number of experts, hidden size, ep, dp or transport on
    some rank raises the same ValueError on every rank, as does E % ep != 0.
    """
    if mesh is None:
        group, ep, dp = dist.group.WORLD, dist.get_world_size(), 1
    else:
        group, ep = mesh["ep"].get_group(), mesh["ep"].size()
        dp = mesh.size() // ep
    if transport is None:
        transport = (config_of(model) or registry.default).transport  # the model's Config, or enable()'s
    found = experts_modules(model)
    if not found:
        raise ValueError(
            f"parallelize: {type(model).__name__} has no fused experts modules (gate_up_proj [E, ...])"
        )
    if transport == "auto":
        transport = auto_transport(ep, device if device is not None else found[0][1].gate_up_proj.device)
    name = transport if isinstance(transport, str) else transport.name
    info = dict(
        ep=ep,
        dp=dp,
        transport=name,
        experts=[(n, tuple(m.gate_up_proj.shape), tuple(m.down_proj.shape)) for n, m in found],
        hidden_size=getattr(getattr(model, "config", None), "hidden_size", None),
        expert_lora=[[tuple(getattr(m, p).shape) for p in LORA_PARAMS if hasattr(m, p)] for _, m in found],
    )
    _check_same(info, None)
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ValueError(f"max_tokens: expected an int >= 1 or None, got {max_tokens!r}")
    for n, m in found:
        num = m.gate_up_proj.shape[0]
        if num % ep:
            raise ValueError(
                f"parallelize: {n} has {num} experts, not divisible by the expert-parallel size {ep}"
            )
        if hasattr(m, "_moe8_ep"):
            raise ValueError(f"parallelize: {n} is already expert-parallel")
    rank = dist.get_rank(group)
    transports = {}
    for n, m in found:
        num = m.gate_up_proj.shape[0]
        if num not in transports:
            transports[num] = make_transport(transport, group, num, timeout_s, max_tokens)
        local = num // ep
        kwargs = experts_kwargs(m)
        for p in EXPERT_PARAMS:
            w = getattr(m, p, None)
            if isinstance(w, nn.Parameter):
                shard = w.detach()[rank * local : (rank + 1) * local].clone()
                setattr(m, p, nn.Parameter(shard, requires_grad=w.requires_grad))
        m._moe8_ep = dict(
            transport=transports[num],
            kwargs=kwargs,
            num_experts=num,
            check_ids=check_ids,
            grad_scale=1.0 / ep if grad_scale is None else grad_scale,
            group=group,
            name=n,
        )
        m.forward = types.MethodType(_ep_forward, m)
    bound = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    model._moe8_ep_model = dict(group=dist.group.WORLD, timeout_s=bound)
    model._moe8_ep_model["hook"] = model.register_forward_pre_hook(_refuse_empty_ranks, with_kwargs=True)
    return model


def is_parallel(model: nn.Module) -> bool:
    return any(hasattr(m, "_moe8_ep") for _, m in experts_modules(model))


def gather_experts(m: nn.Module, param: str, dst: Optional[int] = None) -> Optional[torch.Tensor]:
    """The full [E, ...] tensor of an expert-parallel module's parameter: on every rank of its group
    (dst None, all_gather) or only on the group rank dst (gather; None elsewhere)."""
    st = m._moe8_ep
    group, shard = st["group"], getattr(m, param).detach().contiguous()
    size = dist.get_world_size(group)
    if dst is None:
        parts = [torch.empty_like(shard) for _ in range(size)]
        dist.all_gather(parts, shard, group=group)
        return torch.cat(parts)
    mine = dist.get_rank(group) == dst
    parts = [torch.empty_like(shard) for _ in range(size)] if mine else None
    dist.gather(shard, parts, group_dst=dst, group=group)
    return torch.cat(parts) if mine else None


@contextlib.contextmanager
def gathered(model: nn.Module, params=LORA_PARAMS):
    """Inside, every expert-parallel module holds the full [E, ...] tensors of `params` (default: the expert
    LoRA factors, small) on every rank, e.g. for moe8.lora.save_adapter; afterwards its own shards again.
    Collective: every rank must enter it."""
    saved = []
    for _, m in experts_modules(model):
        if not hasattr(m, "_moe8_ep"):
            continue
        for p in params:
            w = getattr(m, p, None)
            if isinstance(w, nn.Parameter):
                saved.append((m, p, w))
                setattr(m, p, nn.Parameter(gather_experts(m, p), requires_grad=w.requires_grad))
    try:
        yield model
    finally:
        for m, p, w in saved:
            setattr(m, p, w)


def unparallelize(model: nn.Module) -> nn.Module:
    """Undo parallelize(): every rank gets all the experts back (all_gather over each group) and the experts
    modules their class's forward. Collective: every rank must call it."""
    for _, m in experts_modules(model):
        if not hasattr(m, "_moe8_ep"):
            continue
        for p in EXPERT_PARAMS:
            w = getattr(m, p, None)
            if isinstance(w, nn.Parameter):
                setattr(m, p, nn.Parameter(gather_experts(m, p), requires_grad=w.requires_grad))
        del m._moe8_ep
        del m.forward
    st = model.__dict__.pop("_moe8_ep_model", None)
    if st is not None:
        st["hook"].remove()
    return model
