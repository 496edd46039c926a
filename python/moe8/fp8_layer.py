"""moe8.fp8_layer — the differentiable FP8 expert layers on moe8.fp8's ops: grouped_linear (a drop-in for
ops.grouped_gemm with the forward GEMM in FP8, and the input / weight gradient GEMMs too when the recipe says
dgrad / wgrad "fp8"), activation_linear (activation + down projection), the routed down projection with the
combine (_fp8_activation_down_combine), and experts_forward_fp8 (the experts of an MoE layer in FP8).
Re-exported from moe8.fp8."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import ops
from .fp8 import (
    RECIPES,
    Float8Recipe,
    Fp8Weight,
    Fp8WeightCache,
    _recipe,
    default_cache,
    grouped_gemm_fp8,
    grouped_gemm_fp8_wgrad,
    quantize_activation,
    quantize_cols_1x128,
    quantize_rows_1x128,
    quantize_weight,
    swiglu_quant,
)


def _row_experts(offsets: Tensor, rows: int) -> Tensor:
    """[rows] expert of each row (E for rows past offsets[E]), without a host sync."""
    r = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, r, right=True) - 1


def _per_row(t: Tensor, offsets: Tensor, rows: int) -> Tensor:
    """t [E, N] -> [rows, N]: row r gets t[expert of r]; rows past offsets[E] get zeros."""
    padded = torch.cat([t, t.new_zeros(1, t.shape[1])])
    return padded[_row_experts(offsets, rows)]


def _fp8_forward(
    a: Tensor, wq: Fp8Weight, offsets: Tensor, recipe: Float8Recipe, gathered_from=None
) -> Tensor:
    """a . wq per expert group in FP8. gathered_from (src, row_to_slot, k, slot_to_row): a's rows are src's
    gathered (ops.permute / gather_rows); the blockwise recipe then quantises them from src in that gather's
    pass (quantize_rows_1x128 with row_to_slot: the same bits, one [R, K] read fewer; slot_to_row: each token
    read and quantised once)."""
    if gathered_from is not None and recipe.name == "blockwise":
        aq, a_scale = quantize_rows_1x128(*gathered_from)
    else:
        aq, a_scale = quantize_activation(a, recipe)
    c = grouped_gemm_fp8(aq, a_scale, wq.q, wq.scale, offsets, a.dtype)
    if wq.row_scale is not None:
        c = (c.float() * _per_row(wq.row_scale, offsets, a.shape[0])).to(a.dtype)
    return c


# ------------------------------------------------------------------------------- differentiable layer
@torch.library.custom_op("moe8::fp8_grouped_linear", mutates_args=())
def _fp8_grouped_linear(
    a: Tensor,
    w: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    w_row_scale: Optional[Tensor],
    offsets: Tensor,
    layout: int,
    recipe: int,
    fp8_dgrad: bool,
    fp8_wgrad: bool,
    src: Optional[Tensor] = None,
    row_to_slot: Optional[Tensor] = None,
    k: int = 1,
    slot_to_row: Optional[Tensor] = None,
) -> Tensor:
    """src, row_to_slot, k, slot_to_row: a's rows are src's gathered (_fp8_forward's gathered_from)."""
    wq = Fp8Weight(w_q, w_scale, w_row_scale)
    gathered = (src, row_to_slot, k, slot_to_row) if src is not None else None
    return _fp8_forward(a, wq, offsets, _recipe_of(recipe, fp8_dgrad, fp8_wgrad), gathered)


@_fp8_grouped_linear.register_fake
def _(a, w, w_q, *rest):
    return a.new_empty(a.shape[0], w_q.shape[1])


def _recipe_of(recipe_id: int, fp8_dgrad: bool, fp8_wgrad: bool) -> Float8Recipe:
    name = next(n for n, i in RECIPES.items() if i == recipe_id)
    return Float8Recipe(name, "fp8" if fp8_dgrad else "bf16", "fp8" if fp8_wgrad else "bf16")


def _fp8_wgrad(a: Tensor, g: Tensor, offsets: Tensor, layout: int, num_experts: int) -> Optional[Tensor]:
    """The weight gradient of c = a . w[e] (layout 0: w [E, N, K]; 1: [E, K, N]) through the FP8 grouped GEMM,
    or None where that kernel is not available (a GPU without the Hopper kernel)."""
    if a.is_cuda and not ops.sm90_workspace_bytes(a, num_experts, "grouped_gemm_fp8_wgrad_workspace_bytes"):
        return None
    gq, gs = quantize_cols_1x128(g, offsets)
    aq, a_s = quantize_cols_1x128(a, offsets)
    out = torch.bfloat16 if a.is_cuda else torch.float32
    if layout == 0:  # dW[e] [N, K] = g_e^T . a_e
        return grouped_gemm_fp8_wgrad(gq, gs, aq, a_s, offsets, out)
    return grouped_gemm_fp8_wgrad(aq, a_s, gq, gs, offsets, out)  # [K, N] = a_e^T . g_e


def _gl_setup(ctx, inputs, output):
    a, w, _, _, _, offsets, layout, recipe, fp8_dgrad, fp8_wgrad, *_ = inputs
    ctx.layout, ctx.recipe = layout, _recipe_of(recipe, fp8_dgrad, fp8_wgrad)
    ctx.save_for_backward(a, w, offsets)


def _linear_grads(
    a, w, offsets, g, layout: int, recipe: Float8Recipe, need_a: bool, need_w: bool, g_gathered_from=None
):
    """(d a, d w) of c = a . w[e] (either None when not needed). dgrad: bf16 grouped GEMM, or FP8 (recipe.dgrad
    "fp8": g quantised like an activation, the weight in the transposed layout, cached like the forward's);
    wgrad: bf16, or FP8 (recipe.wgrad "fp8", where the kernel exists)."""
    da = dw = None
    if need_a and recipe.dgrad == "fp8":
        da = _fp8_forward(g, default_cache.get(w, 1 - layout, recipe), offsets, recipe, g_gathered_from)
    elif need_a:
        da = ops.grouped_gemm(g, w.contiguous(), offsets, 1 - layout, None)
    if need_w and recipe.wgrad == "fp8":
        dw = _fp8_wgrad(a, g, offsets, layout, w.shape[0])
    if need_w and dw is None:
        dw = ops.grouped_gemm_wgrad(a, g, offsets, layout, w.shape[0], False)[0]
    return da, (dw.to(w.dtype) if dw is not None else None)


def _gl_bwd(ctx, g):
    a, w, offsets = ctx.saved_tensors
    da, dw = _linear_grads(
        a,
        w,
        offsets,
        g.contiguous(),
        ctx.layout,
        ctx.recipe,
        ctx.needs_input_grad[0],
        ctx.needs_input_grad[1],
    )
    return (da, dw) + (None,) * 12


_fp8_grouped_linear.register_autograd(_gl_bwd, setup_context=_gl_setup)


@torch.library.custom_op("moe8::fp8_activation_linear", mutates_args=())
def _fp8_activation_linear(
    h: Tensor,
    w: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    w_row_scale: Optional[Tensor],
    offsets: Tensor,
    layout: int,
    recipe: int,
    fp8_dgrad: bool,
    fp8_wgrad: bool,
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
    consume_h: bool,
) -> Tensor:
    r = _recipe_of(recipe, fp8_dgrad, fp8_wgrad)
    return _act_fp8_forward(
        h, Fp8Weight(w_q, w_scale, w_row_scale), offsets, r, (kind, interleaved, alpha, limit)
    )


def _act_fp8_forward(h: Tensor, wq: Fp8Weight, offsets: Tensor, r: Float8Recipe, act) -> Tensor:
    """The FP8 down projection of activation(h, *act)."""
    if r.name == "blockwise":  # activation and 1x128 quantisation in one pass (the same bits as the two ops)
        aq, a_s = swiglu_quant(h, *act)
        return grouped_gemm_fp8(aq, a_s, wq.q, wq.scale, offsets, h.dtype)
    return _fp8_forward(ops.activation(h, *act), wq, offsets, r)


@_fp8_activation_linear.register_fake
def _(
    h,
    w,
    w_q,
    w_scale,
    w_row_scale,
    offsets,
    layout,
    recipe,
    fp8_dgrad,
    fp8_wgrad,
    kind,
    interleaved,
    alpha,
    limit,
    consume_h,
):
    return h.new_empty(h.shape[0], w_q.shape[1])


def _al_setup(ctx, inputs, output):
    h, w, _, _, _, offsets, layout, recipe, fp8_dgrad, fp8_wgrad, *act, consume_h = inputs
    ctx.layout, ctx.recipe, ctx.act = layout, _recipe_of(recipe, fp8_dgrad, fp8_wgrad), act
    ctx.consume_h = consume_h
    ctx.save_for_backward(h, w, offsets)  # not the activations: recomputed below


def _al_bwd(ctx, g):
    h, w, offsets = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    g, dw, dh = g.contiguous(), None, None
    if need_w:  # the recomputed activations are freed before d activations and d h exist
        a = ops.activation(h, *ctx.act)
        dw = _linear_grads(a, w, offsets, g, ctx.layout, ctx.recipe, False, True)[1]
        del a
    if need_h:
        da = _linear_grads(None, w, offsets, g, ctx.layout, ctx.recipe, True, False)[0]
        dh = ops.activation_grad(h, da, ctx.act, in_place=ctx.consume_h)  # see ops.activation_consuming
    return (dh, dw) + (None,) * 13


_fp8_activation_linear.register_autograd(_al_bwd, setup_context=_al_setup)


@torch.library.custom_op("moe8::fp8_activation_down_combine", mutates_args=())
def _fp8_activation_down_combine(
    h: Tensor,
    w: Tensor,
    w_q: Tensor,
    w_scale: Tensor,
    w_row_scale: Optional[Tensor],
    offsets: Tensor,
    layout: int,
    recipe: int,
    fp8_dgrad: bool,
    fp8_wgrad: bool,
    weights: Tensor,
    slot_to_row: Tensor,
    row_to_slot: Tensor,
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
    consume_h: bool,
) -> Tensor:
    """ops.activation_down_combine with the down projection in FP8 (its GEMMs as _fp8_activation_linear's)."""
    r = _recipe_of(recipe, fp8_dgrad, fp8_wgrad)
    o = _act_fp8_forward(
        h, Fp8Weight(w_q, w_scale, w_row_scale), offsets, r, (kind, interleaved, alpha, limit)
    )
    return ops.combine_rows(o, slot_to_row.view(weights.shape), weights)


@_fp8_activation_down_combine.register_fake
def _(h, w, w_q, w_scale, w_row_scale, offsets, layout, recipe, fp8_dgrad, fp8_wgrad, weights, *rest):
    return h.new_empty(weights.shape[0], w_q.shape[1])


def _adc_setup(ctx, inputs, output):
    h, w, _, _, _, offsets, layout, recipe, fp8_dgrad, fp8_wgrad, weights, s2r, r2s, *act, consume = inputs
    ctx.layout, ctx.recipe, ctx.act = layout, _recipe_of(recipe, fp8_dgrad, fp8_wgrad), act
    ctx.consume_h = consume
    ctx.save_for_backward(h, w, offsets, weights, r2s, s2r)


def _adc_bwd(ctx, g):
    h, w, offsets, weights, row_to_slot, slot_to_row = ctx.saved_tensors
    lay, r, g, k = ctx.layout, ctx.recipe, g.contiguous(), weights.shape[1]
    g_rows = (g, row_to_slot, k, slot_to_row)  # the rows the down projection's dgrad reads: g gathered
    dh, dw, d_weights = ops.routed_down_backward(
        h,
        g,
        weights,
        row_to_slot,
        slot_to_row,
        ctx.act,
        ctx.consume_h,
        # the FP8 dgrad quantises the unweighted rows straight from g (they are g gathered by row_to_slot)
        lambda rows: _linear_grads(None, w, offsets, rows, lay, r, True, False, g_rows)[0],
        lambda a_w, rows: _linear_grads(a_w, w, offsets, rows, lay, r, False, True)[1],
        ctx.needs_input_grad[1],
    )
    return (dh, dw) + (None,) * 8 + (d_weights,) + (None,) * 7


_fp8_activation_down_combine.register_autograd(_adc_bwd, setup_context=_adc_setup)


def _add_bias(c: Tensor, bias: Optional[Tensor], offsets: Tensor) -> Tensor:
    if bias is None:
        return c
    # added in fp32 (so its gradient, a sum over rows, is accumulated in fp32 too)
    return (c.float() + _per_row(bias.float(), offsets, c.shape[0])).to(c.dtype)


def activation_linear(
    h: Tensor,
    w: Tensor,
    offsets: Tensor,
    layout: int,
    bias: Optional[Tensor],
    recipe,
    cache: Optional[Fp8WeightCache],
    kind: int,
    interleaved: bool,
    alpha: float,
    limit: float,
    consume_h: bool = False,
) -> Tensor:
    """grouped_linear(ops.activation(h, ...), w, ...) (the experts' down projection in FP8) keeping h rather
    than the activations for the backward (they are recomputed there), with the blockwise recipe's
    activation and quantisation fused in one pass. Same results as the two calls. consume_h: as in
    ops.activation_grouped_gemm (d h written over h, an intermediate nothing else reads)."""
    r = _recipe(recipe)
    wq = cache.get(w, layout, r) if cache is not None else quantize_weight(w, layout, r)
    args = (
        r.id,
        r.dgrad == "fp8",
        r.wgrad == "fp8",
        int(kind),
        bool(interleaved),
        float(alpha),
        float(limit),
        bool(consume_h),
    )
    c = _fp8_activation_linear(h.contiguous(), w, wq.q, wq.scale, wq.row_scale, offsets, layout, *args)
    return _add_bias(c, bias, offsets)


def grouped_linear(
    a: Tensor,
    w: Tensor,
    offsets: Tensor,
    layout: int = 0,
    bias: Optional[Tensor] = None,
    recipe="blockwise",
    cache: Optional[Fp8WeightCache] = default_cache,
    gathered_from: Optional[tuple] = None,
) -> Tensor:
    """Drop-in for ops.grouped_gemm(a, w, offsets, layout, bias) with the forward GEMM in FP8:
    a [R, K] (rows in expert order), w [E, N, K] (layout 0) or [E, K, N] (layout 1), bias [E, N] -> [R, N]
    in a's dtype. Gradients flow to a, w and bias: in a's precision, a's in FP8 when recipe.dgrad is "fp8", w's
    when recipe.wgrad is "fp8" (on a GPU every offsets[e] and R must then be multiples of 16: plan with
    pad_multiple 16, as experts_forward_fp8 does; checked when index validation is on).
    gathered_from (src, row_to_slot, k[, slot_to_row]): a is ops.permute(src, row_to_slot, slot_to_row, k); the
    blockwise recipe then quantises a's rows from src directly (the same bits, without reading a; with
    slot_to_row each token once)."""
    r = _recipe(recipe)
    wq = cache.get(w, layout, r) if cache is not None else quantize_weight(w, layout, r)
    src, row_to_slot, k, slot_to_row = None, None, 1, None
    if gathered_from is not None:  # slot_to_row optional
        src, row_to_slot, k, slot_to_row = (*gathered_from, None)[:4]
    c = _fp8_grouped_linear(
        a.contiguous(),
        w,
        wq.q,
        wq.scale,
        wq.row_scale,
        offsets,
        layout,
        r.id,
        r.dgrad == "fp8",
        r.wgrad == "fp8",
        src,
        row_to_slot,
        int(k),
        slot_to_row,
    )
    return _add_bias(c, bias, offsets)


def experts_forward_fp8(
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    gate_up: Tensor,
    down: Tensor,
    *,
    recipe="blockwise",
    layout: str = "nk",
    activation: str = "swiglu",
    interleaved: bool = False,
    gate_up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    cache: Optional[Fp8WeightCache] = default_cache,
    check_ids: bool = True,
) -> Tensor:
    """moe8.experts_forward with both expert GEMMs in FP8 (same arguments, plus `recipe`).

    Without autograd (inference, or nothing requires grad) and with the blockwise recipe the tokens are
    gathered into expert order and quantised in one pass, and the activation is fused with the quantisation
    of its output; otherwise the bf16 permute / activation ops run between FP8 GEMMs (differentiable)."""
    from . import layer
    from .layer import check_experts_args, dispatch_plan

    r = _recipe(recipe)
    lay, act = check_experts_args(x, ids, weights, gate_up, down, layout, activation)
    dtype = gate_up.dtype
    # the FP8 weight gradient reads each expert's rows from a 16-byte aligned start: pad the groups to 16
    pad = 16 if r.wgrad == "fp8" else 1
    x, k, offsets, row_to_slot, slot_to_row = dispatch_plan(x, ids, gate_up, pad, check_ids)
    w = weights.float().contiguous()  # [T, K]
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weights, gate_up, down, gate_up_bias, down_bias)
    )
    if not needs_grad and r.name == "blockwise" and gate_up_bias is None and down_bias is None:
        w1 = cache.get(gate_up, lay, r) if cache is not None else quantize_weight(gate_up, lay, r)
        w2 = cache.get(down, lay, r) if cache is not None else quantize_weight(down, lay, r)
        xq, xs = quantize_rows_1x128(x, row_to_slot, k, slot_to_row)  # permute + quantise: [R, H]
        h = grouped_gemm_fp8(xq, xs, w1.q, w1.scale, offsets, dtype)  # [R, 2I]
        aq, a_s = swiglu_quant(h, act, bool(interleaved), float(alpha), float(limit))  # [R, I]
        o = grouped_gemm_fp8(aq, a_s, w2.q, w2.scale, offsets, dtype)  # [R, H]
    else:
        xp = ops.permute(x, row_to_slot, slot_to_row, k)  # [R, H]
        x_rows = (x, row_to_slot, k, slot_to_row)  # xp's rows: x gathered (quantised from x directly)
        h = grouped_linear(xp, gate_up, offsets, lay, gate_up_bias, r, cache, x_rows)  # [R, 2I]
        if layer.ROUTED_DOWN and down_bias is None:  # ops.activation_down_combine: no activations or o kept
            wq = cache.get(down, lay, r) if cache is not None else quantize_weight(down, lay, r)
            flags = (r.id, r.dgrad == "fp8", r.wgrad == "fp8")
            act_args = (act, bool(interleaved), float(alpha), float(limit), layer.CONSUME_GATE_UP)
            return _fp8_activation_down_combine(
                h,
                down,
                wq.q,
                wq.scale,
                wq.row_scale,
                offsets,
                lay,
                *flags,
                w,
                slot_to_row,
                row_to_slot,
                *act_args,
            )
        # the activations [R, I] are not kept for the backward: recomputed from h there
        o = activation_linear(
            h, down, offsets, lay, down_bias, r, cache, act, interleaved, alpha, limit, layer.CONSUME_GATE_UP
        )
    return ops.combine(o, w, slot_to_row, row_to_slot)  # [T, H]


ops._make_direct(globals())  # last: after every op's registrations (ops.set_eager_direct)
