"""moe8.routing — the router's top-k as one fused kernel (torch.library custom ops on moe8._C): softmax,
sigmoid with expert groups, or top-k then softmax; the routing weights, the load-balancing statistics and the
log-sum-exp for the z-loss, and their backward. Part of moe8.ops too (moe8.ops.route)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _checks as _c
from ._core import C as _C
from ._core import make_direct as _make_direct
from ._core import stream as _stream


@torch.library.custom_op("moe8::route", mutates_args=())
def route(
    logits: Tensor,
    bias: Optional[Tensor],
    scheme: int,
    k: int,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    scaling: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """logits [T, E] -> ids [T, k] int32, weights [T, k] f32, prob_mean [E], token_frac [E], lse [T]."""
    _c.tensor("logits", logits, 2, "[T, E]")
    _c.integer("k", k, 1, logits.shape[1])
    T, E = logits.shape
    dev = logits.device
    ids = torch.empty(T, k, dtype=torch.int32, device=dev)
    weights = torch.empty(T, k, dtype=torch.float32, device=dev)
    prob_mean = torch.empty(E, dtype=torch.float32, device=dev)
    token_frac = torch.empty(E, dtype=torch.float32, device=dev)
    lse = torch.empty(T, dtype=torch.float32, device=dev)
    _C.route_forward(
        logits,
        bias,
        scheme,
        k,
        renormalize,
        n_group,
        topk_group,
        scaling,
        ids,
        weights,
        prob_mean,
        token_frac,
        lse,
        _stream(logits),
    )
    return ids, weights, prob_mean, token_frac, lse


@route.register_fake
def _(logits, bias, scheme, k, renormalize, n_group, topk_group, scaling):
    T, E = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    return (
        logits.new_empty(T, k, dtype=torch.int32),
        logits.new_empty(T, k, **f32),
        logits.new_empty(E, **f32),
        logits.new_empty(E, **f32),
        logits.new_empty(T, **f32),
    )


@torch.library.custom_op("moe8::route_backward", mutates_args=())
def route_backward(
    logits: Tensor,
    bias: Optional[Tensor],
    ids: Tensor,
    grad_weights: Tensor,
    grad_prob_mean: Optional[Tensor],
    grad_lse: Optional[Tensor],
    scheme: int,
    k: int,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    scaling: float,
) -> Tensor:
    grad_logits = torch.empty_like(logits)
    _C.route_backward(
        logits,
        bias,
        scheme,
        k,
        renormalize,
        n_group,
        topk_group,
        scaling,
        ids,
        grad_weights,
        grad_prob_mean,
        grad_lse,
        grad_logits,
        _stream(logits),
        False,
    )
    return grad_logits


@route_backward.register_fake
def _(
    logits,
    bias,
    ids,
    grad_weights,
    grad_prob_mean,
    grad_lse,
    scheme,
    k,
    renormalize,
    n_group,
    topk_group,
    scaling,
):
    return torch.empty_like(logits)


def _route_setup(ctx, inputs, output):
    logits, bias, *params = inputs
    ctx.params = params
    ctx.save_for_backward(logits, bias, output[0])


def _route_bwd(ctx, g_ids, g_weights, g_prob_mean, g_token_frac, g_lse):
    logits, bias, ids = ctx.saved_tensors
    if g_weights is None:
        g_weights = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)

    def as_f32(g):
        return None if g is None else g.float().contiguous()

    grad = route_backward(
        logits, bias, ids, g_weights.float().contiguous(), as_f32(g_prob_mean), as_f32(g_lse), *ctx.params
    )
    return grad, None, None, None, None, None, None, None


route.register_autograd(_route_bwd, setup_context=_route_setup)


_make_direct(globals())  # last: after every op's registrations
