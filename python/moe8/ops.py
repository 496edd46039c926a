"""moe8.ops — the core ops as torch.library custom ops (fake/meta implementation, autograd where they have a
gradient), so eager code and torch.compile(fullgraph=True) both call the C++/CUDA core (through moe8._core).

Raw ops (allocate their outputs, call moe8._C):
    plan, gather_rows, combine_rows, combine_weights_grad, grouped_gemm, grouped_gemm_wgrad,
    grouped_lowrank_add, activation, activation_backward, activation_consuming
Differentiable ops (autograd registered): permute, combine, grouped_gemm, grouped_lowrank_add, activation.
The router's top-k (route, route_backward, from moe8.routing), RoPE (rope, apply_rotary_pos_emb, from
moe8.rotary) and RMSNorm (rms_norm, rms_norm_forward, rms_norm_backward, from moe8.norm) are part of this
namespace too. The experts' fused down projections, in bf16 or FP8, are in
moe8.fused.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import _checks as _c
from ._core import ACTIVATIONS, LAYOUTS, SCHEMES, sm90_workspace, sm90_workspace_bytes  # noqa: F401
from ._core import C as _C
from ._core import gated as _gated
from ._core import make_direct as _make_direct
from ._core import scratch as _scratch
from ._core import stream as _stream
from .norm import rms_norm, rms_norm_backward, rms_norm_forward  # noqa: F401
from .rotary import apply_rotary_pos_emb, rope, rope_backward  # noqa: F401
from .routing import route, route_backward  # noqa: F401


# ----------------------------------------------------------------------------------------------- plan
@functools.lru_cache(maxsize=256)
def _plan_sizes(slots: int, num_experts: int, pad_multiple: int, on_cuda: bool) -> tuple[int, int]:
    """(rows of the plan, int32 elements of its GPU workspace): functions of the shapes only."""
    return (
        _C.plan_max_rows(slots, num_experts, pad_multiple),
        _C.plan_workspace_elems(slots, num_experts, on_cuda),
    )


@torch.library.custom_op("moe8::plan", mutates_args=())
def plan(
    ids: Tensor, num_experts: int, pad_multiple: int, check_ids: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """ids [T, K] int32 -> counts [E], offsets [E+1], row_to_slot [R], slot_to_row [T*K] (all int32).
    check_ids: range-check the ids (one device sync on CUDA); pass False for ids from a top-k over
    num_experts scores."""
    _c.tensor("ids", ids, 2, "[T, K]")
    _c.integer("num_experts", num_experts, 1)
    _c.integer("pad_multiple", pad_multiple, 1)
    slots = ids.numel()
    dev = ids.device
    i32 = dict(dtype=torch.int32, device=dev)
    rows, ws_elems = _plan_sizes(slots, num_experts, pad_multiple, ids.is_cuda)
    counts = torch.empty(num_experts, **i32)
    offsets = torch.empty(num_experts + 1, **i32)
    row_to_slot = torch.empty(rows, **i32)
    slot_to_row = torch.empty(slots, **i32)
    workspace = _scratch(ids, ws_elems, torch.int32) if ids.is_cuda else None
    _C.build_dispatch_plan(
        ids,
        num_experts,
        pad_multiple,
        counts,
        offsets,
        row_to_slot,
        slot_to_row,
        workspace,
        _stream(ids),
        check_ids,
    )
    return counts, offsets, row_to_slot, slot_to_row


@plan.register_fake
def _(ids, num_experts, pad_multiple, check_ids=True):
    slots = ids.numel()
    rows = slots + num_experts * (pad_multiple - 1)
    if pad_multiple > 1:  # as _C.plan_max_rows: R rounded up to the padding too
        rows = (rows + pad_multiple - 1) // pad_multiple * pad_multiple
    i32 = dict(dtype=torch.int32)
    return (
        ids.new_empty(num_experts, **i32),
        ids.new_empty(num_experts + 1, **i32),
        ids.new_empty(rows, **i32),
        ids.new_empty(slots, **i32),
    )


# ------------------------------------------------------------------------------------- row movement
@torch.library.custom_op("moe8::gather_rows", mutates_args=())
def gather_rows(
    src: Tensor, row_to_slot: Tensor, k: int, scale: Optional[Tensor], slot_to_row: Optional[Tensor] = None
) -> Tensor:
    """dst[r] = scale[slot] * src[slot // k] (0 where slot < 0); src [T, H] -> dst [R, H]. slot_to_row [T*k]
    (the plan's inverse of row_to_slot, optional): the same result; on a GPU each token is then read once and
    stored to its k rows (k <= 8) instead of read once per row."""
    _c.tensor("src", src, 2, "[T, H]")
    _c.tensor("row_to_slot", row_to_slot, 1, "[R]")
    _c.integer("k", k, 1)
    dst = src.new_empty(row_to_slot.shape[0], src.shape[1])
    _C.gather_rows(src, row_to_slot, k, scale, dst, _stream(src), False, slot_to_row)
    return dst


@gather_rows.register_fake
def _(src, row_to_slot, k, scale, slot_to_row=None):
    _c.one_device(("src", src), ("row_to_slot", row_to_slot), ("scale", scale), ("slot_to_row", slot_to_row))
    return src.new_empty(row_to_slot.shape[0], src.shape[1])


@torch.library.custom_op("moe8::combine_rows", mutates_args=())
def combine_rows(rows: Tensor, slot_to_row: Tensor, weights: Optional[Tensor]) -> Tensor:
    """out[t] = sum_k weights[t, k] * rows[slot_to_row[t, k]]; slot_to_row [T, K] -> out [T, H]."""
    _c.tensor("rows", rows, 2, "[R, H]")
    _c.tensor("slot_to_row", slot_to_row, 2, "[T, K]")
    out = rows.new_empty(slot_to_row.shape[0], rows.shape[1])
    _C.combine_rows(rows, slot_to_row, weights, out, _stream(rows), False)
    return out


@combine_rows.register_fake
def _(rows, slot_to_row, weights):
    _c.one_device(("rows", rows), ("slot_to_row", slot_to_row), ("weights", weights))
    return rows.new_empty(slot_to_row.shape[0], rows.shape[1])


@torch.library.custom_op("moe8::combine_weights_grad", mutates_args=())
def combine_weights_grad(dy: Tensor, rows: Tensor, slot_to_row: Tensor) -> Tensor:
    _c.tensor("dy", dy, 2, "[T, H]")
    _c.tensor("slot_to_row", slot_to_row, 2, "[T, K]")
    d_weights = torch.empty(slot_to_row.shape, dtype=torch.float32, device=dy.device)
    _C.combine_weights_grad(dy, rows, slot_to_row, d_weights, _stream(dy), False)
    return d_weights


@combine_weights_grad.register_fake
def _(dy, rows, slot_to_row):
    _c.one_device(("dy", dy), ("rows", rows), ("slot_to_row", slot_to_row))
    return dy.new_empty(slot_to_row.shape, dtype=torch.float32)


@torch.library.custom_op("moe8::permute", mutates_args=())
def permute(x: Tensor, row_to_slot: Tensor, slot_to_row: Tensor, k: int) -> Tensor:
    """Tokens into expert order: x [T, H] -> rows [R, H]. Backward is a gather-sum (no atomics)."""
    _c.tensor("x", x, 2, "[T, H]")
    _c.tensor("slot_to_row", slot_to_row)
    _c.integer("k", k, 1)
    if slot_to_row.numel() != x.shape[0] * k:
        raise ValueError(
            f"slot_to_row: expected {x.shape[0] * k} slots (x's T x k), got {list(slot_to_row.shape)}"
        )
    return gather_rows(x, row_to_slot, k, None, slot_to_row.view(-1))


@permute.register_fake
def _(x, row_to_slot, slot_to_row, k):
    _c.one_device(("x", x), ("row_to_slot", row_to_slot), ("slot_to_row", slot_to_row))
    return x.new_empty(row_to_slot.shape[0], x.shape[1])


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])
    ctx.k = inputs[3]


def _permute_bwd(ctx, g):
    (slot_to_row,) = ctx.saved_tensors
    return combine_rows(g.contiguous(), slot_to_row.view(-1, ctx.k), None), None, None, None


permute.register_autograd(_permute_bwd, setup_context=_permute_setup)


@torch.library.custom_op("moe8::combine", mutates_args=())
def combine(rows: Tensor, weights: Tensor, slot_to_row: Tensor, row_to_slot: Tensor) -> Tensor:
    """Expert rows back to tokens, weighted: rows [R, H], weights [T, K] f32 -> y [T, H]."""
    _c.tensor("weights", weights, 2, "[T, K]")
    _c.tensor("slot_to_row", slot_to_row)
    if slot_to_row.numel() != weights.numel():
        raise ValueError(
            f"slot_to_row: expected {weights.numel()} slots (weights' T x K), got shape {list(slot_to_row.shape)}"
        )
    return combine_rows(rows, slot_to_row.view(weights.shape), weights)


@combine.register_fake
def _(rows, weights, slot_to_row, row_to_slot):
    return rows.new_empty(weights.shape[0], rows.shape[1])


def _combine_setup(ctx, inputs, output):
    rows, weights, slot_to_row, row_to_slot = inputs
    ctx.save_for_backward(rows, weights, slot_to_row, row_to_slot)


def _combine_bwd(ctx, g):
    rows, weights, slot_to_row, row_to_slot = ctx.saved_tensors
    g = g.contiguous()
    k = weights.shape[1]
    d_rows = (
        gather_rows(g, row_to_slot, k, weights.reshape(-1), slot_to_row.view(-1))
        if ctx.needs_input_grad[0]
        else None
    )
    d_weights = (
        combine_weights_grad(g, rows, slot_to_row.view(weights.shape)) if ctx.needs_input_grad[1] else None
    )
    return d_rows, d_weights, None, None


combine.register_autograd(_combine_bwd, setup_context=_combine_setup)


# --------------------------------------------------------------------------------------- grouped GEMM
def _layout(layout: int) -> None:
    if layout not in (0, 1):
        raise ValueError(f"layout: expected 0 (b [E, N, K]) or 1 (b [E, K, N]), got {layout!r}")


@torch.library.custom_op("moe8::grouped_gemm", mutates_args=())
def grouped_gemm(a: Tensor, b: Tensor, offsets: Tensor, layout: int, bias: Optional[Tensor]) -> Tensor:
    """c[r] = a[r] . op(b[e]) + bias[e] for rows r of expert e. layout 0: b [E, N, K]; 1: b [E, K, N]."""
    _c.tensor("a", a, 2, "[R, K]")
    _c.tensor("b", b, 3, "[E, N, K] or [E, K, N]")
    _layout(layout)
    _c.one_device(("a", a), ("b", b), ("offsets", offsets), ("bias", bias))
    n = b.shape[1] if layout == 0 else b.shape[2]
    c = a.new_empty(a.shape[0], n)
    _C.grouped_gemm(a, b, offsets, layout, bias, c, _stream(a), False, sm90_workspace(a, b.shape[0]))
    return c


@grouped_gemm.register_fake
def _(a, b, offsets, layout, bias):
    _c.one_device(("a", a), ("b", b), ("offsets", offsets), ("bias", bias))
    return a.new_empty(a.shape[0], b.shape[1] if layout == 0 else b.shape[2])


@torch.library.custom_op("moe8::gathered_grouped_gemm", mutates_args=())
def gathered_grouped_gemm(
    x: Tensor, row_to_slot: Tensor, k: int, slot_to_row: Tensor, b: Tensor, offsets: Tensor, layout: int
) -> Tensor:
    """grouped_gemm(permute(x, row_to_slot, slot_to_row, k), b, offsets, layout, None) with the rows read from x
    inside the GEMM where a kernel does that (the sm_90a bf16 forward layout; the CPU reference), else gathered
    into an [R, K] buffer first: x [T, K] -> [R, N]. No autograd of its own (moe8.fused.gathered_linear's)."""
    _c.tensor("x", x, 2, "[T, K]")
    _c.tensor("b", b, 3, "[E, N, K] or [E, K, N]")
    _layout(layout)
    _c.one_device(("x", x), ("b", b), ("offsets", offsets), ("row_to_slot", row_to_slot))
    n = b.shape[1] if layout == 0 else b.shape[2]
    c = x.new_empty(row_to_slot.shape[0], n)
    ws = sm90_workspace(x, b.shape[0])
    if _C.gathered_grouped_gemm(x, row_to_slot, k, b, offsets, layout, c, _stream(x), False, ws):
        return c
    rows = gather_rows(x, row_to_slot, k, None, slot_to_row.view(-1))
    _C.grouped_gemm(rows, b, offsets, layout, None, c, _stream(x), False, ws)
    return c


@gathered_grouped_gemm.register_fake
def _(x, row_to_slot, k, slot_to_row, b, offsets, layout):
    return x.new_empty(row_to_slot.shape[0], b.shape[1] if layout == 0 else b.shape[2])


@torch.library.custom_op("moe8::grouped_gemm_swiglu", mutates_args=())
def grouped_gemm_swiglu(a: Tensor, b: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
    """(h, act) = (grouped_gemm(a, b, offsets, 0, None), activation(h, swiglu)): the up projection's forward, b
    [E, 2I, K] with h as [gate | up], and its SwiGLU, in one kernel where one does that (the sm_90a bf16 forward with
    SwiGLU in the GEMM's epilogue, I a multiple of 128), else as the two calls (the same bits either way): a [R, K]
    -> h [R, 2I], act [R, I]. No autograd of its own."""
    _c.tensor("a", a, 2, "[R, K]")
    _c.tensor("b", b, 3, "[E, 2I, K]")
    _c.one_device(("a", a), ("b", b), ("offsets", offsets))
    if b.shape[1] % 2:
        raise ValueError(f"b: SwiGLU expects an even 2I, got shape {list(b.shape)}")
    h = a.new_empty(a.shape[0], b.shape[1])
    act = a.new_empty(a.shape[0], b.shape[1] // 2)
    ws = sm90_workspace(a, b.shape[0])
    if _C.grouped_gemm_swiglu(a, b, offsets, h, act, _stream(a), False, ws):
        return h, act
    _C.grouped_gemm(a, b, offsets, 0, None, h, _stream(a), False, ws)
    _C.activation_forward(h, ACTIVATIONS["swiglu"], False, 1.702, 7.0, act, _stream(a))
    return h, act


@grouped_gemm_swiglu.register_fake
def _(a, b, offsets):
    return a.new_empty(a.shape[0], b.shape[1]), a.new_empty(a.shape[0], b.shape[1] // 2)


@torch.library.custom_op("moe8::gathered_grouped_gemm_wgrad", mutates_args=())
def gathered_grouped_gemm_wgrad(
    x: Tensor,
    row_to_slot: Tensor,
    k: int,
    slot_to_row: Tensor,
    dc: Tensor,
    offsets: Tensor,
    layout: int,
    num_experts: int,
) -> Tensor:
    """grouped_gemm_wgrad(permute(x, row_to_slot, slot_to_row, k), dc, offsets, layout, num_experts, False)[0] with
    the rows read from x inside the GEMM where a kernel does that (sm_90a, bf16, layout 0), else gathered into an
    [R, K] buffer first (the CPU among them): x [T, K], dc [R, N] -> d b. The same bits either way."""
    _c.tensor("x", x, 2, "[T, K]")
    _c.tensor("dc", dc, 2, "[R, N]")
    _layout(layout)
    _c.integer("num_experts", num_experts, 1)
    _c.one_device(("x", x), ("dc", dc), ("offsets", offsets), ("row_to_slot", row_to_slot))
    kd, n = x.shape[1], dc.shape[1]
    db = x.new_empty((num_experts, n, kd) if layout == 0 else (num_experts, kd, n))
    ws = sm90_workspace(x, num_experts)
    if _C.gathered_grouped_gemm_wgrad(x, row_to_slot, k, dc, offsets, layout, db, _stream(x), False, ws):
        return db
    rows = gather_rows(x, row_to_slot, k, None, slot_to_row.view(-1))
    _C.grouped_gemm_wgrad(rows, dc, offsets, layout, db, None, _stream(x), False, ws)
    return db


@gathered_grouped_gemm_wgrad.register_fake
def _(x, row_to_slot, k, slot_to_row, dc, offsets, layout, num_experts):
    kd, n = x.shape[1], dc.shape[1]
    return x.new_empty((num_experts, n, kd) if layout == 0 else (num_experts, kd, n))


@torch.library.custom_op("moe8::grouped_gemm_wgrad", mutates_args=())
def grouped_gemm_wgrad(
    a: Tensor, dc: Tensor, offsets: Tensor, layout: int, num_experts: int, with_bias: bool
) -> tuple[Tensor, Tensor]:
    """d b (shape of b for `layout`) and d bias [E, N] (empty when with_bias is False)."""
    _c.tensor("a", a, 2, "[R, K]")
    _c.tensor("dc", dc, 2, "[R, N]")
    _layout(layout)
    _c.integer("num_experts", num_experts, 1)
    kd, n = a.shape[1], dc.shape[1]
    db = a.new_empty((num_experts, n, kd) if layout == 0 else (num_experts, kd, n))
    dbias = a.new_empty(num_experts, n) if with_bias else a.new_empty(0)
    _C.grouped_gemm_wgrad(
        a,
        dc,
        offsets,
        layout,
        db,
        dbias if with_bias else None,
        _stream(a),
        False,
        sm90_workspace(a, num_experts),
    )
    return db, dbias


@grouped_gemm_wgrad.register_fake
def _(a, dc, offsets, layout, num_experts, with_bias):
    kd, n = a.shape[1], dc.shape[1]
    db = a.new_empty((num_experts, n, kd) if layout == 0 else (num_experts, kd, n))
    return db, (a.new_empty(num_experts, n) if with_bias else a.new_empty(0))


def _gg_setup(ctx, inputs, output):
    a, b, offsets, layout, bias = inputs
    ctx.layout = layout
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(a, b, offsets)


# The gradients of c = a · op(b[e]) + bias[e] (grouped_gemm), shared by the ops built on it.
def _input_grad(g: Tensor, b: Tensor, offsets: Tensor, layout: int) -> Tensor:
    return grouped_gemm(g, b, offsets, 1 - layout, None)


_THIN = 32  # csrc/cuda/grouped_gemm_sm90.cu's kThinN


def _weight_grads(a: Tensor, g: Tensor, b: Tensor, offsets: Tensor, layout: int, bias_dtype):
    """(d b, d bias in bias_dtype, or None without a bias)."""
    if bias_dtype is None and g.shape[1] <= _THIN < a.shape[1]:
        # d b = g^T a per group is also (a^T g) in the other layout: that GEMM's N is g's rank-sized width
        # (the expert LoRA's A), which the sm90 kernel tiles thinly (its M would be, padded to 128)
        return grouped_gemm_wgrad(g, a, offsets, 1 - layout, b.shape[0], False)[0], None
    db, dbias = grouped_gemm_wgrad(a, g, offsets, layout, b.shape[0], bias_dtype is not None)
    return db, (dbias.to(bias_dtype) if bias_dtype is not None else None)


def _gg_bwd(ctx, g):
    a, b, offsets = ctx.saved_tensors
    g = g.contiguous()
    da = _input_grad(g, b, offsets, ctx.layout) if ctx.needs_input_grad[0] else None
    db = dbias = None
    if ctx.needs_input_grad[1] or (ctx.bias_dtype is not None and ctx.needs_input_grad[4]):
        db, dbias = _weight_grads(a, g, b, offsets, ctx.layout, ctx.bias_dtype)
    return da, db, None, None, dbias


grouped_gemm.register_autograd(_gg_bwd, setup_context=_gg_setup)


@torch.library.custom_op("moe8::grouped_lowrank_add", mutates_args=())
def grouped_lowrank_add(h: Tensor, t: Tensor, b: Tensor, offsets: Tensor, layout: int) -> Tensor:
    """h + grouped_gemm(t, b, offsets, layout, None) in one pass over h: the expert LoRA's B projection
    (t [R, r], b [E, N, r] or [E, r, N]) added to the base GEMM's output h [R, N]; the rank sum is added in
    fp32 and rounded once. Rows in no group get h."""
    _layout(layout)
    _c.one_device(("h", h), ("t", t), ("b", b), ("offsets", offsets))
    out = torch.empty_like(h)
    _C.grouped_lowrank_add(h, t, b, offsets, layout, out, _stream(h), False)
    return out


@grouped_lowrank_add.register_fake
def _(h, t, b, offsets, layout):
    _c.one_device(("h", h), ("t", t), ("b", b), ("offsets", offsets))
    return torch.empty_like(h)


def _gla_setup(ctx, inputs, output):
    h, t, b, offsets, layout = inputs
    ctx.layout = layout
    ctx.save_for_backward(t, b, offsets)


def _gla_bwd(ctx, g):
    t, b, offsets = ctx.saved_tensors
    g = g.contiguous()
    dt = _input_grad(g, b, offsets, ctx.layout) if ctx.needs_input_grad[1] else None
    db = _weight_grads(t, g, b, offsets, ctx.layout, None)[0] if ctx.needs_input_grad[2] else None
    return g if ctx.needs_input_grad[0] else None, dt, db, None, None


grouped_lowrank_add.register_autograd(_gla_bwd, setup_context=_gla_setup)


# ---------------------------------------------------------------------------------------- activation
@torch.library.custom_op("moe8::activation", mutates_args=())
def activation(h: Tensor, kind: int, interleaved: bool, alpha: float, limit: float) -> Tensor:
    """Gated (kind 0 swiglu, 1 swiglu_clamped): h [R, 2I] -> [R, I]; ungated (2 silu, 3 gelu): same shape."""
    return _activation_forward(h, kind, interleaved, alpha, limit)


def _activation_forward(h: Tensor, kind: int, interleaved: bool, alpha: float, limit: float) -> Tensor:
    _c.tensor("h", h, 2, "[R, 2I] or [R, I]")
    _c.integer("kind", kind, 0, 3)
    out = _activation_out(h, kind, interleaved, alpha, limit)
    _C.activation_forward(h, kind, interleaved, alpha, limit, out, _stream(h))
    return out


@activation.register_fake
def _activation_out(h, kind, interleaved, alpha, limit):
    return h.new_empty(h.shape[0], h.shape[1] // 2 if _gated(kind) else h.shape[1])


@torch.library.custom_op("moe8::activation_backward", mutates_args=())
def activation_backward(
    h: Tensor, dout: Tensor, kind: int, interleaved: bool, alpha: float, limit: float
) -> Tensor:
    dh = torch.empty_like(h)
    _C.activation_backward(h, dout, kind, interleaved, alpha, limit, dh, _stream(h))
    return dh


@activation_backward.register_fake
def _(h, dout, kind, interleaved, alpha, limit):
    return torch.empty_like(h)


@torch.library.custom_op("moe8::activation_backward_", mutates_args=("h",))
def activation_backward_(
    h: Tensor, dout: Tensor, kind: int, interleaved: bool, alpha: float, limit: float
) -> None:
    """activation_backward written over h: d h replaces h (each element pair is read before it is written)."""
    _C.activation_backward(h, dout, kind, interleaved, alpha, limit, h, _stream(h))


@torch.library.custom_op("moe8::activation_consuming", mutates_args=())
def activation_consuming(h: Tensor, kind: int, interleaved: bool, alpha: float, limit: float) -> Tensor:
    """activation(h) for an h that nothing reads after this op's backward, which writes d h over h: one
    [R, 2I] buffer less at the backward's peak (the experts' gate_up output)."""
    return _activation_forward(h, kind, interleaved, alpha, limit)


activation_consuming.register_fake(_activation_out)


def _act_setup(ctx, inputs, output):
    ctx.params = inputs[1:]
    ctx.save_for_backward(inputs[0])


def activation_grad(h: Tensor, dout: Tensor, params, in_place: bool) -> Tensor:
    """d h of activation(h, *params): a new tensor, or (in_place) written over h, whose version is bumped so
    that anything saved to read h later raises."""
    if not in_place:
        return activation_backward(h, dout, *params)
    activation_backward_(h, dout, *params)
    return h


def _act_bwd(ctx, g):
    (h,) = ctx.saved_tensors
    return activation_grad(h, g.contiguous(), ctx.params, in_place=False), None, None, None, None


activation.register_autograd(_act_bwd, setup_context=_act_setup)


def _act_consuming_bwd(ctx, g):
    (h,) = _c.saved(ctx, consumed=True)
    return activation_grad(h, g.contiguous(), ctx.params, in_place=True), None, None, None, None


activation_consuming.register_autograd(_act_consuming_bwd, setup_context=_act_setup)


_make_direct(globals())  # last: after every op's registrations
