"""moe8.reference — plain PyTorch versions of the MoE layer and router, used as the oracle in tests and
benchmarks (float64/float32 friendly; no moe8 kernels involved)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def route(
    logits: Tensor,
    k: int,
    scheme: str = "softmax",
    renormalize: bool = False,
    bias: Optional[Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
):
    """Returns (ids [T,k] int64, weights [T,k]) computed like the HF routers, in logits' dtype."""
    if scheme == "softmax":
        p = F.softmax(logits, dim=-1)
        w, ids = torch.topk(p, k, dim=-1)
        if renormalize:
            w = w / w.sum(-1, keepdim=True)
        return ids, w
    if scheme == "topk_softmax":
        top, ids = torch.topk(logits, k, dim=-1)
        return ids, F.softmax(top, dim=-1)
    if scheme == "sigmoid_group":
        s = logits.sigmoid()
        c = s + (0 if bias is None else bias)
        T, E = c.shape
        gs = c.view(T, n_group, E // n_group).topk(min(2, E // n_group), dim=-1)[0].sum(-1)
        gidx = gs.topk(topk_group, dim=-1)[1]
        gmask = torch.zeros_like(gs).scatter_(1, gidx, 1).bool()
        emask = gmask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        ids = c.masked_fill(~emask, float("-inf")).topk(k, dim=-1)[1]
        w = s.gather(1, ids)
        if renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * scaling
    raise ValueError(f"scheme: unknown {scheme!r}")


def route_weights(
    logits: Tensor, ids: Tensor, scheme: str = "softmax", renormalize: bool = False, scaling: float = 1.0
) -> Tensor:
    """The routing weights of given expert ids (the differentiable part of `route`)."""
    ids = ids.long()
    if scheme == "topk_softmax":
        return F.softmax(logits.gather(1, ids), dim=-1)
    score = F.softmax(logits, dim=-1) if scheme == "softmax" else logits.sigmoid()
    w = score.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + (1e-20 if scheme == "sigmoid_group" else 0.0))
    return w * scaling if scheme == "sigmoid_group" else w


def act(
    h: Tensor, activation: str = "swiglu", interleaved: bool = False, alpha: float = 1.702, limit: float = 7.0
) -> Tensor:
    if activation in ("silu", "gelu"):
        return F.silu(h) if activation == "silu" else F.gelu(h)
    if interleaved:
        g, u = h[..., ::2], h[..., 1::2]
    else:
        g, u = h.chunk(2, dim=-1)
    if activation == "swiglu":
        return F.silu(g) * u
    g = g.clamp(max=limit)
    u = u.clamp(-limit, limit)
    return (u + 1) * g * torch.sigmoid(alpha * g)


def experts_forward(
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    gate_up: Tensor,
    down: Tensor,
    *,
    layout: str = "nk",
    activation: str = "swiglu",
    interleaved: bool = False,
    gate_up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> Tensor:
    """Loop over experts: y[t] = sum_k w[t,k] * expert_{ids[t,k]}(x[t]); same contract as moe8.layer."""
    y = torch.zeros_like(x)
    ids = ids.long()
    for e in range(gate_up.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        wg, wd = (gate_up[e], down[e]) if layout == "kn" else (gate_up[e].t(), down[e].t())
        h = x[tok] @ wg
        if gate_up_bias is not None:
            h = h + gate_up_bias[e]
        o = act(h, activation, interleaved, alpha, limit) @ wd
        if down_bias is not None:
            o = o + down_bias[e]
        y = y.index_add(0, tok, o * weights[tok, slot, None].to(o.dtype))
    return y
