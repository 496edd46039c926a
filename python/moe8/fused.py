"""moe8.fused — the experts' down projection fused with its neighbours, as torch.library custom ops built
on moe8.ops (re-exported there: moe8.ops.activation_grouped_gemm, moe8.ops.activation_down_combine, ...):

    activation_grouped_gemm   activation then grouped GEMM, keeping h instead of the activations
    activation_down_combine   activation, grouped GEMM and combine, keeping only h; the routing weights are
                              applied after the dgrad (activation_backward_routed, routed_down_backward)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .ops import (
    _C,
    _input_grad,
    _make_direct,
    _stream,
    _weight_grads,
    activation,
    activation_consuming,
    combine_rows,
    gather_rows,
    grouped_gemm,
)


# ------------------------------------------------------------------------ activation + grouped GEMM
def activation_grouped_gemm(
    h: Tensor,
    b: Tensor,
    offsets: Tensor,
    layout: int,
    bias: Optional[Tensor],
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
    consume_h: bool = False,
) -> Tensor:
    """grouped_gemm(activation(h), b, offsets, layout, bias) (the experts' down projection) whose backward
    keeps h and recomputes activation(h) for the weight gradient: the [R, I] activations are not held from
    the forward to the backward. Same kernels, so the same bits. Two autograd nodes as in the unfused ops
    (activation, then the GEMM, whose backward hands d activation to activation's), so the backward never
    holds the recomputed activations, d activations and d h at once. consume_h: h is an intermediate that
    nothing reads after the backward, which then writes d h over it (one [R, 2I] buffer less at its peak;
    h's contents are gone afterwards, and a second backward through the graph raises)."""
    act = activation_consuming if consume_h else activation
    a = act(h, kind, interleaved, alpha, limit)
    return _grouped_gemm_recompute(a, h, b, offsets, layout, bias, kind, interleaved, alpha, limit)


@torch.library.custom_op("moe8::grouped_gemm_recompute", mutates_args=())
def _grouped_gemm_recompute(
    a: Tensor,
    h: Tensor,
    b: Tensor,
    offsets: Tensor,
    layout: int,
    bias: Optional[Tensor],
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> Tensor:
    """grouped_gemm(a, b, ...) for a = activation(h, ...), saving h instead of a for the backward."""
    return grouped_gemm(a, b, offsets, layout, bias)


@_grouped_gemm_recompute.register_fake
def _(a, h, b, offsets, layout, bias, kind, interleaved, alpha, limit):
    return a.new_empty(a.shape[0], b.shape[1] if layout == 0 else b.shape[2])


def _ggr_setup(ctx, inputs, output):
    a, h, b, offsets, layout, bias, *act = inputs
    ctx.layout, ctx.act = layout, act
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(h, b, offsets)


def _ggr_bwd(ctx, g):
    h, b, offsets = ctx.saved_tensors
    g = g.contiguous()
    da = db = dbias = None
    if ctx.needs_input_grad[2] or (ctx.bias_dtype is not None and ctx.needs_input_grad[5]):
        a = activation(h, *ctx.act)  # recomputed: not kept from the forward; freed before da exists
        db, dbias = _weight_grads(a, g, b, offsets, ctx.layout, ctx.bias_dtype)
        del a
    if ctx.needs_input_grad[0]:
        da = _input_grad(g, b, offsets, ctx.layout)
    return da, None, db, None, None, dbias, None, None, None, None


_grouped_gemm_recompute.register_autograd(_ggr_bwd, setup_context=_ggr_setup)


# ------------------------------------------------------ activation + down projection + combine
@torch.library.custom_op("moe8::activation_backward_routed", mutates_args=("dout",))
def activation_backward_routed(
    h: Tensor,
    dout: Tensor,
    weights: Tensor,
    row_to_slot: Tensor,
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> tuple[Tensor, Tensor]:
    """The activation's backward with the routing weights applied here (csrc/cpu/ops.h): dout [R, I] is
    d act(h) of the unweighted expert outputs; weights [T, K] f32; row_to_slot [R]. Returns d h (new) and
    d weights [T, K] f32, and writes w * act(h) over dout (the down projection's weight gradient reads it)."""
    dh = torch.empty_like(h)
    return dh, _routed(h, dout, weights, row_to_slot, kind, interleaved, alpha, limit, dh)


@activation_backward_routed.register_fake
def _(h, dout, weights, row_to_slot, kind, interleaved, alpha, limit):
    return torch.empty_like(h), weights.new_empty(weights.shape)


@torch.library.custom_op("moe8::activation_backward_routed_", mutates_args=("h", "dout"))
def activation_backward_routed_(
    h: Tensor,
    dout: Tensor,
    weights: Tensor,
    row_to_slot: Tensor,
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> Tensor:
    """activation_backward_routed with d h written over h; returns d weights."""
    return _routed(h, dout, weights, row_to_slot, kind, interleaved, alpha, limit, h)


@activation_backward_routed_.register_fake
def _(h, dout, weights, row_to_slot, kind, interleaved, alpha, limit):
    return weights.new_empty(weights.shape)


def _routed(h, dout, weights, row_to_slot, kind, interleaved, alpha, limit, dh) -> Tensor:
    d_weights = torch.zeros_like(weights)  # slots no row maps to (ids of -1) keep their 0
    w = weights.reshape(-1)
    _C.activation_backward_routed(
        h,
        dout,
        w,
        row_to_slot,
        kind,
        interleaved,
        alpha,
        limit,
        dh,
        dout,
        d_weights.view(-1),
        _stream(h),
        False,
    )
    return d_weights


def routed_down_backward(
    h: Tensor,
    g: Tensor,
    weights: Tensor,
    row_to_slot: Tensor,
    slot_to_row: Tensor,
    act,
    consume_h: bool,
    dgrad,
    wgrad,
    need_w: bool,
) -> tuple[Tensor, Optional[Tensor], Tensor]:
    """Backward of y = combine(grouped_gemm(activation(h), W), weights) with the routing weights applied after
    the down projection's dgrad: the rows of dy are gathered unweighted, dgrad(rows) = rows · W^T gives d act
    of the unweighted outputs, and one pass (activation_backward_routed) recomputes act(h) and writes d h,
    w * act(h) over d act, and the weights' gradient <act(h), d act> (= <o, dy>: o is not kept from the forward).
    wgrad(a_w, rows) is then W's gradient. Returns (d h, d W or None, d weights [T, K] f32)."""
    rows = gather_rows(g, row_to_slot, weights.shape[1], None, slot_to_row.view(-1))  # [R, H] unweighted
    d_act = dgrad(rows)  # [R, I]
    if consume_h:
        d_weights = activation_backward_routed_(h, d_act, weights, row_to_slot, *act)
        dh = h
    else:
        dh, d_weights = activation_backward_routed(h, d_act, weights, row_to_slot, *act)
    dw = wgrad(d_act, rows) if need_w else None  # d_act now holds w * act(h)
    return dh, dw, d_weights


@torch.library.custom_op("moe8::activation_down_combine", mutates_args=())
def activation_down_combine(
    h: Tensor,
    b: Tensor,
    offsets: Tensor,
    layout: int,
    weights: Tensor,
    slot_to_row: Tensor,
    row_to_slot: Tensor,
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
    consume_h: bool,
) -> Tensor:
    """combine(grouped_gemm(activation(h), b, offsets, layout), weights, ...) (the experts' down projection
    without a bias, and the weighted sum back to tokens): h [R, 2I], weights [T, K] f32 -> y [T, H]. Keeps
    neither the activations nor the expert outputs for the backward (routed_down_backward): one [R, H] and
    one [R, I] tensor less held, and no separate pass for the weights' gradient. consume_h: as in
    activation_grouped_gemm (d h written over h)."""
    a = activation(h, kind, interleaved, alpha, limit)
    o = grouped_gemm(a, b, offsets, layout, None)
    del a
    return combine_rows(o, slot_to_row.view(weights.shape), weights)


@activation_down_combine.register_fake
def _(h, b, offsets, layout, weights, slot_to_row, row_to_slot, kind, interleaved, alpha, limit, consume_h):
    return h.new_empty(weights.shape[0], b.shape[1] if layout == 0 else b.shape[2])


def _adc_setup(ctx, inputs, output):
    h, b, offsets, layout, weights, slot_to_row, row_to_slot, *act, consume_h = inputs
    ctx.layout, ctx.act, ctx.consume_h = layout, act, consume_h
    ctx.save_for_backward(h, b, offsets, weights, row_to_slot, slot_to_row)


def _adc_bwd(ctx, g):
    h, b, offsets, weights, row_to_slot, slot_to_row = ctx.saved_tensors
    lay = ctx.layout
    dh, db, d_weights = routed_down_backward(
        h,
        g.contiguous(),
        weights,
        row_to_slot,
        slot_to_row,
        ctx.act,
        ctx.consume_h,
        lambda rows: _input_grad(rows, b, offsets, lay),
        lambda a_w, rows: _weight_grads(a_w, rows, b, offsets, lay, None)[0],
        ctx.needs_input_grad[1],
    )
    return (dh, db, None, None, d_weights) + (None,) * 7


activation_down_combine.register_autograd(_adc_bwd, setup_context=_adc_setup)


_make_direct(globals())  # last: after every op's registrations
