"""moe8.parallel.experts — the experts of one MoE layer sharded over an expert-parallel group: dispatch the
tokens' rows to their experts' ranks, run moe8.experts_forward there, combine the results back, and sum each
token's K slots at its source."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

import moe8

from ..config import DEFAULT
from ..precision import precision
from .transport import Transport, weighted_sum


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, scale):
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def _fp8_dispatch(experts_kwargs: dict) -> bool:
    """Whether the rows travel in FP8: the experts' GEMMs are FP8 and the config allows it."""
    config = experts_kwargs.get("config") or DEFAULT
    return config.fp8_dispatch and precision(experts_kwargs.get("fp8") or config.fp8).code >= 0


def make_transport(
    transport: Union[str, Transport],
    group,
    num_experts: int,
    timeout_s: Optional[float] = None,
    max_tokens: Optional[int] = None,
) -> Transport:
    """A Transport by name ("nccl", "ipc") over `group`, or `transport` itself when it already is one.
    timeout_s: the bound on each wait for the peers (default: the transport's, DEFAULT_TIMEOUT_S for nccl, 10 s
    for ipc's GPU barriers); max_tokens: the ipc buffers' fixed capacity (None: grown as batches need)."""
    if isinstance(transport, Transport):
        return transport
    timeout = {} if timeout_s is None else dict(timeout_s=timeout_s)
    if transport == "nccl":
        from .nccl import NcclTransport

        return NcclTransport(group, num_experts, **timeout)
    if transport == "ipc":
        try:
            from .ipc import IpcTransport
        except ImportError as e:
            raise ValueError(f"transport 'ipc' is not available here: {e}") from e
        return IpcTransport(group, num_experts, max_tokens=max_tokens, **timeout)
    raise ValueError(f"transport: expected 'nccl', 'ipc' or a Transport, got {transport!r}")


def ep_experts_forward(
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    gate_up_local: Tensor,
    down_local: Tensor,
    *,
    transport: Union[str, Transport] = "nccl",
    group=None,
    num_experts: Optional[int] = None,
    check_ids: bool = True,
    grad_scale: float = 1.0,
    gate_up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
    layer: str = "",
    **experts_kwargs,
) -> Tensor:
    """y[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) with the experts spread over an expert-parallel
    group: this rank holds experts [rank * E_local, (rank + 1) * E_local) as gate_up_local [E_local, ...],
    down_local [E_local, ...] (and their biases), in moe8.experts_forward's layouts.

    x [T, H] (T may be 0), ids [T, K] global expert ids, weights [T, K] -> y [T, H] in the experts' dtype.
    transport: a Transport, or its name built over `group` (default: the world) for num_experts experts
        (default: E_local * group size). experts_kwargs go to moe8.experts_forward (layout, activation,
        interleaved, alpha, limit, fp8, config, lora: a moe8.experts.ExpertLoRA of the local experts'
        factors, [E_local, ...]).
    check_ids: range-check the ids; an id outside [0, num_experts) on any rank raises the same ValueError on
        every rank of the group. On a GPU the check costs no extra host sync: its count travels with the
        row counts (two elementwise passes over ids).
    FP8 dispatch: when the experts' GEMMs are FP8 (experts_kwargs fp8, else config.fp8) and the config's
        fp8_dispatch is on, the rows travel as e4m3 codes + 1x128 scales (Transport.dispatch(fp8=True)).
    Overlap: with config.ep_chunks > 1 and a transport that pipelines (nccl; not with FP8 dispatch), the
        tokens go in that many parts, each part's expert GEMMs running while the next part's rows move.
    layer: the layer's name, which a TransportError names (a peer that exited, or stalled past the
        transport's timeout_s).
    grad_scale: multiplies the gradients of the expert weights, biases and LoRA factors. Each expert's
        gradient sums the contributions of every rank's loss; 1 / group size turns that sum into the mean a
        data-parallel gradient average would give.

    Every rank of the group must call this for the layer, with its own tokens (0 tokens included). The
    expert outputs (and, with Config.routed_down off, every gradient) are bitwise those of
    moe8.experts_forward on the ranks' concatenated batch with all the experts; see docs/parallel.md.
    """
    if transport is None or isinstance(transport, str):
        import torch.distributed as dist

        size = dist.get_world_size(group)
        transport = make_transport(transport or "nccl", group, num_experts or gate_up_local.shape[0] * size)
    if num_experts is not None and num_experts != transport.num_experts:
        raise ValueError(
            f"num_experts: {num_experts} given, the transport was built for {transport.num_experts}"
        )
    for name, w in (("gate_up_local", gate_up_local), ("down_local", down_local)):
        if w.dim() != 3 or w.shape[0] != transport.num_local:
            raise ValueError(
                f"{name}: expected [{transport.num_local}, ...] (num_experts {transport.num_experts} / "
                f"group size {transport.size}), got {tuple(w.shape)}"
            )
    params = [gate_up_local, down_local, gate_up_bias, down_bias]
    if grad_scale != 1.0:
        params = [None if p is None else _ScaleGrad.apply(p, grad_scale) for p in params]
    gate_up_local, down_local, gate_up_bias, down_bias = params
    lora = experts_kwargs.get("lora")
    if lora is not None and grad_scale != 1.0:  # the LoRA factors are expert parameters too
        factors = [_ScaleGrad.apply(t, grad_scale) for t in lora[:4]]
        experts_kwargs["lora"] = lora._replace(
            gate_up_A=factors[0], gate_up_B=factors[1], down_A=factors[2], down_B=factors[3]
        )
    x = x.to(gate_up_local.dtype)  # rows travel in the experts' dtype, as the single-process plan casts

    def experts(rows, local_ids):  # [R_recv, H] on the owner
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)  # w * o == o exactly
        return moe8.experts_forward(
            rows,
            local_ids.view(-1, 1),
            ones,
            gate_up_local,
            down_local,
            gate_up_bias=gate_up_bias,
            down_bias=down_bias,
            check_ids=False,
            **experts_kwargs,
        )

    fp8 = _fp8_dispatch(experts_kwargs)
    named = dict(layer=layer) if layer else {}  # a Transport of one's own may not take it
    chunks = (experts_kwargs.get("config") or DEFAULT).ep_chunks
    if chunks > 1 and not fp8 and hasattr(transport, "dispatch_pipelined"):
        from .nccl import wait

        parts = transport.dispatch_pipelined(x, ids, weights, chunks, check_ids=check_ids, **named)
        backs = []
        for rows, local_ids, meta, pending in parts:  # part c computes while part c + 1's rows move
            backs.append((*transport.combine_async(experts(wait(rows, pending), local_ids), meta), meta))
        return torch.cat([weighted_sum(wait(back, pending), meta) for back, pending, meta in backs])
    rows, local_ids, meta = transport.dispatch(x, ids, weights, check_ids=check_ids, fp8=fp8, **named)
    return weighted_sum(transport.combine(experts(rows, local_ids), meta), meta)
