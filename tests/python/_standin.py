"""Pure-PyTorch stand-in for moe8.layer (experts_forward, route), used by the tests only while
python/moe8/layer.py does not exist yet. Same signatures and semantics, written as plainly as possible."""

from __future__ import annotations

from collections import namedtuple

import torch
import torch.nn.functional as F

Routing = namedtuple("Routing", "ids weights prob_mean token_frac lse")


def _act(h, activation, interleaved, alpha, limit):
    gate, up = (h[..., ::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)
    if activation == "swiglu":
        return F.silu(gate) * up
    if activation == "swiglu_clamped":  # GPT-OSS
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return gate * torch.sigmoid(alpha * gate) * (up + 1)
    raise ValueError(f"stand-in: activation {activation!r} not supported")


def experts_forward(
    x,
    ids,
    weights,
    gate_up,
    down,
    *,
    layout="nk",
    activation="swiglu",
    interleaved=False,
    gate_up_bias=None,
    down_bias=None,
    alpha=1.702,
    limit=7.0,
):
    # x: [T, H]; ids, weights: [T, K]; nk: gate_up [E, 2I, H], down [E, H, I]; kn: [E, H, 2I], [E, I, H]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for e in range(gate_up.shape[0]):
        t, k = torch.where(ids == e)
        if t.numel() == 0:
            continue
        w_gu, w_d = gate_up[e].float(), down[e].float()
        h = x[t].float() @ (w_gu.t() if layout == "nk" else w_gu)  # [n, 2I]
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].float()
        o = _act(h, activation, interleaved, alpha, limit) @ (w_d.t() if layout == "nk" else w_d)  # [n, H]
        if down_bias is not None:
            o = o + down_bias[e].float()
        y = y.index_add(0, t, o * weights[t, k].float()[:, None])
    return y.to(x.dtype)


def route(logits, k, scheme="softmax", renormalize=False, bias=None, n_group=1, topk_group=1, scaling=1.0):
    logits = logits.float()  # [T, E]
    T, E = logits.shape
    probs = logits.softmax(-1)
    if scheme == "softmax":
        w, ids = probs.topk(k, dim=-1)
        if renormalize:
            w = w / w.sum(-1, keepdim=True)
    elif scheme == "topk_softmax":
        top, ids = logits.topk(k, dim=-1)
        w = top.softmax(-1)
    elif scheme == "sigmoid_group":
        s = logits.sigmoid()
        choice = s + bias if bias is not None else s
        g = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(-1)  # [T, G]
        keep = torch.zeros_like(g).scatter_(1, g.topk(topk_group, dim=-1)[1], 1.0)
        keep = keep[:, :, None].expand(T, n_group, E // n_group).reshape(T, E).bool()
        ids = choice.masked_fill(~keep, float("-inf")).topk(k, dim=-1)[1]
        w = s.gather(1, ids)
        if renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * scaling
    else:
        raise ValueError(f"stand-in: scheme {scheme!r}")
    frac = F.one_hot(ids, E).float().sum(1).mean(0) / k  # [E]
    return Routing(ids.int(), w.float(), probs.mean(0), frac, logits.logsumexp(-1))
