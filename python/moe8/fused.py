"""moe8.fused — the experts' GEMMs fused with their neighbours, as torch.library custom ops whose GEMM precision
is a parameter (moe8.precision: BF16, or Fp8Gemms with an FP8 recipe):

    expert_linear             the grouped GEMM of rows in expert order (a . op(w[e]) + bias[e])
    gathered_linear           the same GEMM on the tokens' rows gathered into expert order, keeping the tokens
                              instead of the rows (gathered again in the backward)
    activation_linear         activation then grouped GEMM (the down projection), keeping h instead of the
                              activations (recomputed in the backward)
    activation_down_combine   activation, grouped GEMM and combine, keeping only h; the routing weights are
                              applied after the dgrad (activation_backward_routed, routed_down_backward)

Each op carries the precision as an int and the weight's FP8 copy (if any) as tensors, so one op serves
every precision: the same kernels and bits as the separate ops.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _checks as _c
from ._core import C as _C
from ._core import make_direct, sm90_workspace
from ._core import stream as _stream
from .ops import activation, activation_grad, combine_rows, gather_rows
from .precision import BF16, HANDED_CODES, Precision, add_bias, from_code, has_data


def _out_cols(w_q: Optional[Tensor], w: Tensor, layout: int) -> int:
    if w_q is not None:  # FP8 copies are [E, N, K] whatever the layout
        return w_q.shape[1]
    return w.shape[1] if layout == 0 else w.shape[2]


def _gathered(src, row_to_slot, k, slot_to_row):
    return (src, row_to_slot, k, slot_to_row) if src is not None else None


def _weight_and_bias(prec: Precision, w: Tensor, layout: int, bias: Optional[Tensor]):
    """(quantised weight tensors, the bias the op adds): biases go into the bf16 kernel, else after the op."""
    return prec.quantized(w, layout), (bias.contiguous() if bias is not None else None)


# --------------------------------------------------------------------------------------- expert_linear
@torch.library.custom_op("moe8::expert_linear", mutates_args=())
def _expert_linear(
    a: Tensor,
    w: Tensor,
    w_q: Optional[Tensor],
    w_scale: Optional[Tensor],
    w_row_scale: Optional[Tensor],
    offsets: Tensor,
    layout: int,
    bias: Optional[Tensor],
    precision: int,
    src: Optional[Tensor],
    row_to_slot: Optional[Tensor],
    k: int,
    slot_to_row: Optional[Tensor],
) -> Tensor:
    gathered = _gathered(src, row_to_slot, k, slot_to_row)
    return from_code(precision).forward(a, w, (w_q, w_scale, w_row_scale), offsets, layout, bias, gathered)


@_expert_linear.register_fake
def _(a, w, w_q, w_scale, w_row_scale, offsets, layout, bias, precision, src, row_to_slot, k, slot_to_row):
    rows = row_to_slot.shape[0] if src is not None else a.shape[0]
    return a.new_empty(rows, _out_cols(w_q, w, layout))


def _el_setup(ctx, inputs, output):
    a, w, _, _, _, offsets, layout, bias, precision, *_ = inputs
    ctx.layout, ctx.precision = layout, precision
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(a, w, offsets)


def _el_bwd(ctx, g):
    a, w, offsets = ctx.saved_tensors
    prec, g = from_code(ctx.precision), g.contiguous()
    da = prec.dgrad(g, w, offsets, ctx.layout) if ctx.needs_input_grad[0] else None
    HANDED_CODES.clear()  # codes handed to this op's dgrad are taken or stale now
    dw = dbias = None
    if ctx.needs_input_grad[1] or (ctx.bias_dtype is not None and ctx.needs_input_grad[7]):
        dw, dbias = prec.wgrad(a, g, w, offsets, ctx.layout, ctx.bias_dtype)
    return (da, dw, None, None, None, None, None, dbias) + (None,) * 5


_expert_linear.register_autograd(_el_bwd, setup_context=_el_setup)


def expert_linear(
    a: Tensor,
    w: Tensor,
    offsets: Tensor,
    layout: int = 0,
    bias: Optional[Tensor] = None,
    precision: Precision = BF16,
    gathered_from: Optional[tuple] = None,
) -> Tensor:
    """c[r] = a[r] . op(w[e]) + bias[e] for the rows r of expert e, in `precision`: a [R, K], w [E, N, K]
    (layout 0) or [E, K, N] (layout 1), bias [E, N] -> [R, N] in a's dtype; gradients to a, w and bias.
    gathered_from (src, row_to_slot, k[, slot_to_row]): a is ops.permute(src, row_to_slot, slot_to_row, k);
    the FP8 blockwise recipe then quantises a's rows from src directly (the same bits, without reading a)."""
    wq, b = _weight_and_bias(precision, w, layout, bias)
    src, row_to_slot, k, slot_to_row = (*gathered_from, None)[:4] if gathered_from else (None, None, 1, None)
    in_kernel = b if precision.bias_in_kernel else None
    c = _expert_linear(
        a.contiguous(),
        w,
        *wq,
        offsets,
        layout,
        in_kernel,
        precision.code,
        src,
        row_to_slot,
        int(k),
        slot_to_row,
    )
    return c if precision.bias_in_kernel else add_bias(c, b, offsets)


# ------------------------------------------------------------------------------------- gathered_linear
@torch.library.custom_op("moe8::gathered_linear", mutates_args=())
def _gathered_linear(
    x: Tensor,
    w: Tensor,
    w_q: Optional[Tensor],
    w_scale: Optional[Tensor],
    w_row_scale: Optional[Tensor],
    offsets: Tensor,
    layout: int,
    bias: Optional[Tensor],
    precision: int,
    row_to_slot: Tensor,
    k: int,
    slot_to_row: Tensor,
    in_gemm: bool,
    swiglu_next: bool,
) -> Tensor:
    wq, rows = (w_q, w_scale, w_row_scale), (row_to_slot, k, slot_to_row)
    return from_code(precision).gathered_forward(x, rows, w, wq, offsets, layout, bias, in_gemm, swiglu_next)


@_gathered_linear.register_fake
def _(
    x,
    w,
    w_q,
    w_scale,
    w_row_scale,
    offsets,
    layout,
    bias,
    precision,
    row_to_slot,
    k,
    slot_to_row,
    in_gemm,
    swiglu_next,
):
    return x.new_empty(row_to_slot.shape[0], _out_cols(w_q, w, layout))


def _gl_setup(ctx, inputs, output):
    x, w, _, _, _, offsets, layout, bias, precision, row_to_slot, k, slot_to_row, _, _ = inputs
    ctx.layout, ctx.precision, ctx.k = layout, precision, k
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(x, w, offsets, row_to_slot, slot_to_row)  # x, not its [R, H] rows


def _gl_bwd(ctx, g):
    x, w, offsets, row_to_slot, slot_to_row = ctx.saved_tensors
    prec, g, k = from_code(ctx.precision), g.contiguous(), ctx.k
    dw = dbias = dx = None
    if ctx.needs_input_grad[1] or (ctx.bias_dtype is not None and ctx.needs_input_grad[7]):
        # gathered again, freed before d a (ops.gathered_grouped_gemm_wgrad, which reads them inside the GEMM,
        # is slower than the gather and the GEMM: docs/kernels.md)
        a = gather_rows(x, row_to_slot, k, None, slot_to_row.view(-1))
        dw, dbias = prec.wgrad(a, g, w, offsets, ctx.layout, ctx.bias_dtype)
        del a
    if ctx.needs_input_grad[0]:
        da = prec.dgrad(g, w, offsets, ctx.layout)  # [R, H]
        dx = combine_rows(da, slot_to_row.view(-1, k), None)  # the gather's backward: a token's k rows summed
    HANDED_CODES.clear()  # codes handed to this op's dgrad are taken or stale now
    return (dx, dw, None, None, None, None, None, dbias) + (None,) * 6


_gathered_linear.register_autograd(_gl_bwd, setup_context=_gl_setup)


def gathered_linear(
    x: Tensor,
    w: Tensor,
    offsets: Tensor,
    layout: int,
    bias: Optional[Tensor],
    row_to_slot: Tensor,
    k: int,
    slot_to_row: Tensor,
    precision: Precision = BF16,
    in_gemm: bool = True,
    swiglu_next: bool = False,
) -> Tensor:
    """expert_linear(ops.permute(x, row_to_slot, slot_to_row, k), w, ...) (the experts' up projection from the
    tokens) whose backward keeps x and the plan instead of the [R, H] rows: they are gathered again for the
    weight gradient, and the input gradient is the dgrad's rows summed per token. x [T, H] -> [R, N].
    in_gemm: the forward GEMM reads x's rows itself where a kernel does that (bf16 without bias on sm_90a:
    moe8.ops.gathered_grouped_gemm), so the forward writes no [R, H] copy of them; the FP8 blockwise recipe quantises
    them straight from x. The same bits as the two calls either way. swiglu_next: the output's SwiGLU (as [gate |
    up]) comes next (activation_down_combine); in bf16 without a bias the GEMM computes it in its epilogue
    (ops.grouped_gemm_swiglu) and hands it over (precision.HANDED_ACT), the same bits."""
    wq, b = _weight_and_bias(precision, w, layout, bias)
    in_kernel = b if precision.bias_in_kernel else None
    c = _gathered_linear(
        x.contiguous(),
        w,
        *wq,
        offsets,
        layout,
        in_kernel,
        precision.code,
        row_to_slot,
        int(k),
        slot_to_row,
        bool(in_gemm),
        bool(swiglu_next),
    )
    return c if precision.bias_in_kernel else add_bias(c, b, offsets)


# ----------------------------------------------------------------------------------- activation_linear
@torch.library.custom_op("moe8::activation_linear", mutates_args=())
def _activation_linear(
    h: Tensor,
    w: Tensor,
    w_q: Optional[Tensor],
    w_scale: Optional[Tensor],
    w_row_scale: Optional[Tensor],
    offsets: Tensor,
    layout: int,
    bias: Optional[Tensor],
    precision: int,
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
    consume_h: bool,
) -> Tensor:
    act = (kind, interleaved, alpha, limit)
    return from_code(precision).act_forward(h, w, (w_q, w_scale, w_row_scale), offsets, layout, act, bias)


@_activation_linear.register_fake
def _(h, w, w_q, w_scale, w_row_scale, offsets, layout, bias, precision, *rest):
    return h.new_empty(h.shape[0], _out_cols(w_q, w, layout))


def _al_setup(ctx, inputs, output):
    h, w, _, _, _, offsets, layout, bias, precision, *act, consume_h = inputs
    ctx.layout, ctx.precision, ctx.act, ctx.consume_h = layout, precision, act, consume_h
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(h, w, offsets)  # not the activations: recomputed below


def _al_bwd(ctx, g):
    h, w, offsets = _c.saved(ctx, ctx.consume_h)
    prec, g = from_code(ctx.precision), g.contiguous()
    dh = dw = dbias = None
    if ctx.needs_input_grad[1] or (ctx.bias_dtype is not None and ctx.needs_input_grad[7]):
        a = activation(h, *ctx.act)  # recomputed; freed before d activations and d h exist
        dw, dbias = prec.wgrad(a, g, w, offsets, ctx.layout, ctx.bias_dtype)
        del a
    if ctx.needs_input_grad[0]:
        da = prec.dgrad(g, w, offsets, ctx.layout)
        dh = activation_grad(h, da, ctx.act, in_place=ctx.consume_h)  # see ops.activation_consuming
    return (dh, dw, None, None, None, None, None, dbias) + (None,) * 6


_activation_linear.register_autograd(_al_bwd, setup_context=_al_setup)


def activation_linear(
    h: Tensor,
    w: Tensor,
    offsets: Tensor,
    layout: int,
    bias: Optional[Tensor],
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
    consume_h: bool = False,
    precision: Precision = BF16,
) -> Tensor:
    """expert_linear(ops.activation(h, ...), w, ...) (the experts' down projection) whose backward keeps h and
    recomputes the activations for the weight gradient: the [R, I] activations are not held from the forward
    to the backward. Same kernels, so the same bits as the two calls (FP8 blockwise: the activation and the
    1x128 quantisation of its output in one pass). consume_h: h is an intermediate that nothing reads after
    the backward, which then writes d h over it (one [R, 2I] buffer less at its peak; h's contents are gone
    afterwards, and a second backward through the graph raises)."""
    wq, b = _weight_and_bias(precision, w, layout, bias)
    in_kernel = b if precision.bias_in_kernel else None
    act = (int(kind), bool(interleaved), float(alpha), float(limit), bool(consume_h))
    c = _activation_linear(h.contiguous(), w, *wq, offsets, layout, in_kernel, precision.code, *act)
    return c if precision.bias_in_kernel else add_bias(c, b, offsets)


activation_grouped_gemm = activation_linear  # the name of the bf16 op in moe8's first releases


# ---------------------------------------------------------------- the routed down projection's backward
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


@torch.library.custom_op("moe8::activation_backward_routed_codes", mutates_args=("dout",))
def activation_backward_routed_codes(
    h: Tensor,
    dout: Tensor,
    weights: Tensor,
    row_to_slot: Tensor,
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """activation_backward_routed that also quantises d h 1x128 (what the up projection's FP8 blockwise dgrad
    reads), on the GPU in the same pass: returns (d h, d weights, q [R, W] uint8, scale [R, ceil(W/128)] f32),
    q and scale the bits fp8.quantize_rows_1x128(d h) gives."""
    dh = torch.empty_like(h)
    q, scale = _codes_of(h)
    return dh, _routed(h, dout, weights, row_to_slot, kind, interleaved, alpha, limit, dh, q, scale), q, scale


@activation_backward_routed_codes.register_fake
def _(h, dout, weights, row_to_slot, kind, interleaved, alpha, limit):
    return (torch.empty_like(h), weights.new_empty(weights.shape), *_codes_of(h))


@torch.library.custom_op("moe8::activation_backward_routed_codes_", mutates_args=("h", "dout"))
def activation_backward_routed_codes_(
    h: Tensor,
    dout: Tensor,
    weights: Tensor,
    row_to_slot: Tensor,
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """activation_backward_routed_codes with d h written over h; returns (d weights, q, scale)."""
    q, scale = _codes_of(h)
    return _routed(h, dout, weights, row_to_slot, kind, interleaved, alpha, limit, h, q, scale), q, scale


@activation_backward_routed_codes_.register_fake
def _(h, dout, weights, row_to_slot, kind, interleaved, alpha, limit):
    return (weights.new_empty(weights.shape), *_codes_of(h))


def _codes_of(h: Tensor) -> tuple[Tensor, Tensor]:
    """Empty 1x128 codes and scales for a tensor of h's shape [R, W]: uint8 [R, W], f32 [R, ceil(W/128)]."""
    rows, width = h.shape
    blocks = -(-width // 128)
    return h.new_empty(rows, width, dtype=torch.uint8), h.new_empty(rows, blocks, dtype=torch.float32)


def _routed(h, dout, weights, row_to_slot, kind, interleaved, alpha, limit, dh, q=None, scale=None) -> Tensor:
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
        q,
        scale,
    )
    return d_weights


# ------------------------------------- the down projection's dgrad with the routed activation backward
@torch.library.custom_op("moe8::dgrad_activation_backward", mutates_args=())
def dgrad_activation_backward(
    rows: Tensor,
    w: Tensor,
    offsets: Tensor,
    layout: int,
    h: Tensor,
    weights: Tensor,
    row_to_slot: Tensor,
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """activation_backward_routed(h, ops.grouped_gemm(rows, w, offsets, layout), weights, row_to_slot, ...) in
    one call: on an sm_90a GPU (bf16, layout 1) the activation backward runs in the GEMM's epilogue, so d act
    [R, I] is never written and read back (the same bits for d h and w * act(h); the weights' gradient summed
    in another order). rows [R, H], w the down weight as the dgrad reads it. Returns (w * act(h) [R, I], d h,
    d weights [T, K] f32)."""
    dh = torch.empty_like(h)
    a_w, d_weights = _dgrad_routed(
        rows, w, offsets, layout, h, weights, row_to_slot, kind, interleaved, alpha, limit, dh
    )
    return a_w, dh, d_weights


@dgrad_activation_backward.register_fake
def _(rows, w, offsets, layout, h, weights, row_to_slot, kind, interleaved, alpha, limit):
    n = _out_cols(None, w, layout)
    return rows.new_empty(rows.shape[0], n), torch.empty_like(h), weights.new_empty(weights.shape)


@torch.library.custom_op("moe8::dgrad_activation_backward_", mutates_args=("h",))
def dgrad_activation_backward_(
    rows: Tensor,
    w: Tensor,
    offsets: Tensor,
    layout: int,
    h: Tensor,
    weights: Tensor,
    row_to_slot: Tensor,
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
) -> tuple[Tensor, Tensor]:
    """dgrad_activation_backward with d h written over h; returns (w * act(h), d weights)."""
    return _dgrad_routed(
        rows, w, offsets, layout, h, weights, row_to_slot, kind, interleaved, alpha, limit, h
    )


@dgrad_activation_backward_.register_fake
def _(rows, w, offsets, layout, h, weights, row_to_slot, kind, interleaved, alpha, limit):
    return rows.new_empty(rows.shape[0], _out_cols(None, w, layout)), weights.new_empty(weights.shape)


def _dgrad_routed(rows, w, offsets, layout, h, weights, row_to_slot, kind, interleaved, alpha, limit, dh):
    n = _out_cols(None, w, layout)
    a_w = rows.new_empty(rows.shape[0], n)
    partials = torch.empty(
        rows.shape[0], _C.grouped_gemm_act_backward_parts(n), dtype=torch.float32, device=rows.device
    )
    d_weights = torch.zeros_like(weights)  # slots no row maps to (ids of -1) keep their 0
    _C.grouped_gemm_act_backward(
        rows,
        w,
        offsets,
        layout,
        h,
        weights.reshape(-1),
        row_to_slot,
        kind,
        interleaved,
        alpha,
        limit,
        dh,
        a_w,
        partials,
        d_weights.view(-1),
        _stream(rows),
        False,
        sm90_workspace(rows, w.shape[0]),
    )
    return a_w, d_weights


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
    down: Optional[tuple] = None,
    dh_codes: bool = False,
) -> tuple[Tensor, Optional[Tensor], Tensor]:
    """Backward of y = combine(grouped_gemm(activation(h), W), weights) with the routing weights applied after
    the down projection's dgrad: the rows of dy are gathered unweighted, dgrad(rows) = rows · W^T gives d act
    of the unweighted outputs, and one pass (activation_backward_routed) recomputes act(h) and writes d h,
    w * act(h) over d act, and the weights' gradient <act(h), d act> (= <o, dy>: o is not kept from the forward).
    down (W, offsets, its dgrad's layout): the dgrad is the bf16 GEMM, and it runs with that pass in one call
    (dgrad_activation_backward). wgrad(a_w, rows) is then W's gradient. dh_codes (with down None): that pass
    also quantises d h 1x128 and hands the codes to the up projection's FP8 dgrad (precision.HANDED_CODES).
    Returns (d h, d W or None, d weights [T, K] f32)."""
    rows = gather_rows(g, row_to_slot, weights.shape[1], None, slot_to_row.view(-1))  # [R, H] unweighted
    if down is not None:
        if consume_h:
            a_w, d_weights = dgrad_activation_backward_(rows, *down, h, weights, row_to_slot, *act)
            dh = h
        else:
            a_w, dh, d_weights = dgrad_activation_backward(rows, *down, h, weights, row_to_slot, *act)
    elif dh_codes and has_data(h):  # the hand-over is eager only (precision.Handed)
        a_w = dgrad(rows)
        if consume_h:
            d_weights, q, scale = activation_backward_routed_codes_(h, a_w, weights, row_to_slot, *act)
            dh = h
        else:
            dh, d_weights, q, scale = activation_backward_routed_codes(h, a_w, weights, row_to_slot, *act)
        HANDED_CODES.put(dh, q, scale)
    else:
        a_w = dgrad(rows)  # [R, I] d act, then w * act(h) written over it
        if consume_h:
            d_weights = activation_backward_routed_(h, a_w, weights, row_to_slot, *act)
            dh = h
        else:
            dh, d_weights = activation_backward_routed(h, a_w, weights, row_to_slot, *act)
    dw = wgrad(a_w, rows) if need_w else None
    return dh, dw, d_weights


# ---------------------------------------------------------------------------- activation_down_combine
@torch.library.custom_op("moe8::activation_down_combine", mutates_args=())
def _activation_down_combine(
    h: Tensor,
    w: Tensor,
    w_q: Optional[Tensor],
    w_scale: Optional[Tensor],
    w_row_scale: Optional[Tensor],
    offsets: Tensor,
    layout: int,
    precision: int,
    weights: Tensor,
    slot_to_row: Tensor,
    row_to_slot: Tensor,
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
    consume_h: bool,
    fuse_dgrad: bool,
    dh_codes: bool,
) -> Tensor:
    act = (kind, interleaved, alpha, limit)
    o = from_code(precision).act_forward(h, w, (w_q, w_scale, w_row_scale), offsets, layout, act)
    return combine_rows(o, slot_to_row.view(weights.shape), weights)


@_activation_down_combine.register_fake
def _(h, w, w_q, w_scale, w_row_scale, offsets, layout, precision, weights, *rest):
    return h.new_empty(weights.shape[0], _out_cols(w_q, w, layout))


def _adc_setup(ctx, inputs, output):
    h, w, _, _, _, offsets, layout, precision, weights, slot_to_row, row_to_slot, *act = inputs
    *act, consume_h, fuse, dh_codes = act
    ctx.layout, ctx.precision, ctx.act, ctx.consume_h, ctx.fuse_dgrad, ctx.dh_codes = (
        layout,
        precision,
        act,
        consume_h,
        fuse,
        dh_codes,
    )
    ctx.save_for_backward(h, w, offsets, weights, row_to_slot, slot_to_row)


def _adc_bwd(ctx, g):
    h, w, offsets, weights, row_to_slot, slot_to_row = _c.saved(ctx, ctx.consume_h)
    lay, prec, g, k = ctx.layout, from_code(ctx.precision), g.contiguous(), weights.shape[1]
    g_rows = (g, row_to_slot, k, slot_to_row)  # the rows the down projection's dgrad reads: g gathered
    dh, dw, d_weights = routed_down_backward(
        h,
        g,
        weights,
        row_to_slot,
        slot_to_row,
        ctx.act,
        ctx.consume_h,
        # an FP8 dgrad quantises the unweighted rows straight from g (they are g gathered by row_to_slot)
        lambda rows: prec.dgrad(rows, w, offsets, lay, g_rows),
        lambda a_w, rows: prec.wgrad(a_w, rows, w, offsets, lay)[0],
        ctx.needs_input_grad[1],
        (w.contiguous(), offsets, 1 - lay) if ctx.fuse_dgrad and prec is BF16 else None,
        ctx.dh_codes,
    )
    return (dh, dw) + (None,) * 6 + (d_weights,) + (None,) * 9


_activation_down_combine.register_autograd(_adc_bwd, setup_context=_adc_setup)


def activation_down_combine(
    h: Tensor,
    w: Tensor,
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
    precision: Precision = BF16,
    fuse_dgrad: bool = False,
    dh_codes: bool = False,
) -> Tensor:
    """combine(grouped_gemm(activation(h), w, offsets, layout), weights, ...) (the experts' down projection
    without a bias, and the weighted sum back to tokens) in `precision`: h [R, 2I], weights [T, K] f32 ->
    y [T, H]. Keeps neither the activations nor the expert outputs for the backward (routed_down_backward):
    one [R, H] and one [R, I] tensor less held, and no separate pass for the weights' gradient. consume_h: as
    in activation_linear (d h written over h). fuse_dgrad: in bf16, the backward's dgrad and activation
    backward run as one call (dgrad_activation_backward). dh_codes: h's gradient goes to an FP8 blockwise dgrad
    next (the up projection's, in FP8 with an FP8 dgrad): the activation backward quantises it 1x128 on the way
    and hands the codes over (routed_down_backward), so that dgrad does not read it to quantise it."""
    wq = precision.quantized(w, layout)
    act = (int(kind), bool(interleaved), float(alpha), float(limit), bool(consume_h), bool(fuse_dgrad))
    act = (*act, bool(dh_codes))
    return _activation_down_combine(
        h.contiguous(), w, *wq, offsets, layout, precision.code, weights, slot_to_row, row_to_slot, *act
    )


make_direct(globals())  # last: after every op's registrations
