"""moe8.fp8 — FP8 (e4m3) training recipes for the expert GEMMs.

Recipes (`Float8Recipe(name)`):
    "blockwise"   DeepSeek-V3: activations 1x128 along K, weights 128x128, fp32 scales, fp32 promotion
                  every 128 of K inside the GEMM (the default)
    "rowwise"     one scale per activation row and per weight output row
    "tensorwise"  one scale per tensor
Every scale is amax / 448 (1 for an all-zero block), q = e4m3(x * (1 / scale)), round-to-nearest-even,
saturating; quantised tensors are uint8 (view them as torch.float8_e4m3fn if you like: the core takes both).

Raw ops (torch.library custom ops with fake implementations; CPU reference or CUDA kernels):
    quantize_rows_1x128 (optionally fused with the permutation into expert order), quantize_weight_128x128,
    quantize_cols_1x128 (the transposed quantisation of the weight gradient), swiglu_quant,
    quantize_rowwise, quantize_tensorwise, dequantize, grouped_gemm_fp8
Layers:
    grouped_linear(a, w, offsets, layout, bias, recipe)  drop-in for ops.grouped_gemm with an FP8 forward
        (backward in bf16; Float8Recipe(..., dgrad="fp8") runs the input-gradient GEMM in FP8 too, the FP8
        wgrad GEMM has not landed); quantised weights come from a cache that refreshes when the weight
        changes (once per optimizer step), not per micro-batch
    experts_forward_fp8(...)  the experts of an MoE layer with both GEMMs in FP8
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import ops
from .ops import _C, _stream

RECIPES = {"blockwise": 0, "rowwise": 1, "tensorwise": 2}
BLOCK = 128  # edge of the 1x128 / 128x128 blocks
E4M3_MAX = 448.0


DGRAD = ("bf16", "fp8")


@dataclass(frozen=True)
class Float8Recipe:
    """Which FP8 scaling the expert GEMMs use: "blockwise" (default), "rowwise" or "tensorwise"; and whether
    the backward's GEMMs run in bf16 (default) or FP8 too: dgrad="fp8" (the output gradient quantised like an
    activation, the weight like a weight, transposed), wgrad="fp8" (both operands quantised 1x128 along the
    rows, grouped_gemm_fp8_wgrad; on a GPU it needs the Hopper kernel and expert row offsets that are
    multiples of 16, which experts_forward_fp8 plans for, and falls back to bf16 without the kernel)."""

    name: str = "blockwise"
    dgrad: str = "bf16"
    wgrad: str = "bf16"

    def __post_init__(self):
        if self.name not in RECIPES:
            raise ValueError(f"recipe: expected one of {sorted(RECIPES)}, got {self.name!r}")
        if self.dgrad not in DGRAD:
            raise ValueError(f"dgrad: expected one of {list(DGRAD)}, got {self.dgrad!r}")
        if self.wgrad not in DGRAD:
            raise ValueError(f"wgrad: expected one of {list(DGRAD)}, got {self.wgrad!r}")

    @property
    def id(self) -> int:
        return RECIPES[self.name]


def _recipe(recipe) -> Float8Recipe:
    if isinstance(recipe, Float8Recipe):
        return recipe
    return Float8Recipe(str(recipe))


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def _u8(shape, like: Tensor) -> Tensor:
    return torch.empty(shape, dtype=torch.uint8, device=like.device)


def _f32(shape, like: Tensor) -> Tensor:
    return torch.empty(shape, dtype=torch.float32, device=like.device)


# ----------------------------------------------------------------------------------- quantisation ops
@torch.library.custom_op("moe8::quantize_rows_1x128", mutates_args=())
def quantize_rows_1x128(
    x: Tensor, row_to_slot: Optional[Tensor], k: int, slot_to_row: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """x [R, K] -> q [R, K] uint8, scale [R, ceil(K/128)] f32. With row_to_slot [R'] (permute + quantise in
    one pass): x is the token matrix [T, K] and row r is x[row_to_slot[r] // k] (-1: zeros, scale 1).
    slot_to_row [T*k] (the plan's inverse of row_to_slot, optional): the same bits; on a GPU each token is
    then read and quantised once and its codes stored to its k rows (k <= 8) instead of once per row."""
    rows = x.shape[0] if row_to_slot is None else row_to_slot.shape[0]
    q, scale = _u8((rows, x.shape[1]), x), _f32((rows, _blocks(x.shape[1])), x)
    _C.quantize_rows_1x128(x, row_to_slot, k, q, scale, _stream(x), False, slot_to_row)
    return q, scale


@quantize_rows_1x128.register_fake
def _(x, row_to_slot, k, slot_to_row=None):
    rows = x.shape[0] if row_to_slot is None else row_to_slot.shape[0]
    return x.new_empty(rows, x.shape[1], dtype=torch.uint8), x.new_empty(
        rows, _blocks(x.shape[1]), dtype=torch.float32
    )


@torch.library.custom_op("moe8::quantize_weight_128x128", mutates_args=())
def quantize_weight_128x128(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [E, N, K] -> q [E, N, K] uint8, scale [E, ceil(N/128), ceil(K/128)] f32."""
    E, N, K = w.shape
    q, scale = _u8((E, N, K), w), _f32((E, _blocks(N), _blocks(K)), w)
    _C.quantize_weight_128x128(w, q, scale, _stream(w))
    return q, scale


@quantize_weight_128x128.register_fake
def _(w):
    E, N, K = w.shape
    return w.new_empty(E, N, K, dtype=torch.uint8), w.new_empty(
        E, _blocks(N), _blocks(K), dtype=torch.float32
    )


def col_scale_blocks(rows: int, num_experts: int) -> int:
    """Rows of the scale tensor quantize_cols_1x128 writes: ceil(rows/128) + num_experts."""
    return _blocks(rows) + num_experts


@torch.library.custom_op("moe8::quantize_cols_1x128", mutates_args=())
def quantize_cols_1x128(x: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
    """For the weight gradient: x [R, K], offsets [E+1] -> q_t [K, R] uint8 (q_t[c, r] quantises x[r, c]),
    scale [ceil(R/128) + E, K]. Each expert's rows are cut into 128-row blocks from its first row (no block
    straddles two experts), numbered expert by expert; scale rows past the last block are 1."""
    R, K = x.shape
    q_t, scale = _u8((K, R), x), _f32((col_scale_blocks(R, offsets.shape[0] - 1), K), x)
    _C.quantize_cols_1x128(x, offsets, q_t, scale, _stream(x), False)
    return q_t, scale


@quantize_cols_1x128.register_fake
def _(x, offsets):
    R, K = x.shape
    return x.new_empty(K, R, dtype=torch.uint8), x.new_empty(
        col_scale_blocks(R, offsets.shape[0] - 1), K, dtype=torch.float32
    )


@torch.library.custom_op("moe8::swiglu_quant", mutates_args=())
def swiglu_quant(
    h: Tensor, kind: int, interleaved: bool, alpha: float, limit: float
) -> tuple[Tensor, Tensor]:
    """Activation (kind as in ops.ACTIVATIONS) fused with 1x128 quantisation of its output:
    h [R, 2I] (gated) or [R, I] -> q [R, I] uint8, scale [R, ceil(I/128)]."""
    width = h.shape[1] // 2 if kind in (0, 1) else h.shape[1]
    q, scale = _u8((h.shape[0], width), h), _f32((h.shape[0], _blocks(width)), h)
    _C.swiglu_quant(h, kind, interleaved, alpha, limit, q, scale, _stream(h))
    return q, scale


@swiglu_quant.register_fake
def _(h, kind, interleaved, alpha, limit):
    width = h.shape[1] // 2 if kind in (0, 1) else h.shape[1]
    return h.new_empty(h.shape[0], width, dtype=torch.uint8), h.new_empty(
        h.shape[0], _blocks(width), dtype=torch.float32
    )


@torch.library.custom_op("moe8::quantize_rowwise", mutates_args=())
def quantize_rowwise(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] (2-d or 3-d) -> q (shape of x) uint8, scale x.shape[:-1] f32: one scale per row."""
    q, scale = _u8(x.shape, x), _f32(x.shape[:-1], x)
    _C.quantize_rowwise(x, q, scale, _stream(x))
    return q, scale


@quantize_rowwise.register_fake
def _(x):
    return torch.empty_like(x, dtype=torch.uint8), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("moe8::quantize_tensorwise", mutates_args=())
def quantize_tensorwise(x: Tensor) -> tuple[Tensor, Tensor]:
    """x -> q (shape of x) uint8, scale [1] f32: one scale for the whole tensor."""
    q, scale = _u8(x.shape, x), _f32((1,), x)
    _C.quantize_tensorwise(x, q, scale, _stream(x))
    return q, scale


@quantize_tensorwise.register_fake
def _(x):
    return torch.empty_like(x, dtype=torch.uint8), x.new_empty(1, dtype=torch.float32)


@torch.library.custom_op("moe8::dequantize", mutates_args=())
def dequantize(q: Tensor, scale: Tensor, block_rows: int, block_cols: int, dtype: torch.dtype) -> Tensor:
    """out[..., m, k] = e4m3(q[..., m, k]) * scale[..., m // block_rows, k // block_cols]; q [M, K] or
    [B, M, K] (uint8 or float8_e4m3fn), scale [ceil(M/block_rows), ceil(K/block_cols)] (or [B, ...])."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    _C.dequantize(q, scale, block_rows, block_cols, out, _stream(q))
    return out


@dequantize.register_fake
def _(q, scale, block_rows, block_cols, dtype):
    return torch.empty_like(q, dtype=dtype)


def _fp8_workspace(a: Tensor, num_experts: int) -> Optional[Tensor]:
    """Scratch that lets grouped_gemm_fp8 take the Hopper (CUTLASS sm_90a) path; None where there is none."""
    return ops.sm90_workspace(a, num_experts, "grouped_gemm_fp8_workspace_bytes")


@torch.library.custom_op("moe8::grouped_gemm_fp8", mutates_args=())
def grouped_gemm_fp8(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offsets: Tensor, dtype: torch.dtype
) -> Tensor:
    """Blockwise-scaled FP8 grouped GEMM, c[r] = a[r] . b[e]^T for the rows r of expert e:
    a [R, K] e4m3, a_scale [R, ceil(K/128)], b [E, N, K] e4m3, b_scale [E, ceil(N/128), ceil(K/128)],
    offsets [E+1] -> c [R, N] of `dtype` (bfloat16 takes the Hopper kernel on an H100/H200)."""
    c = torch.empty(a.shape[0], b.shape[1], dtype=dtype, device=a.device)
    _C.grouped_gemm_fp8(a, a_scale, b, b_scale, offsets, c, _stream(a), False, _fp8_workspace(a, b.shape[0]))
    return c


@grouped_gemm_fp8.register_fake
def _(a, a_scale, b, b_scale, offsets, dtype):
    return a.new_empty(a.shape[0], b.shape[1], dtype=dtype)


@torch.library.custom_op("moe8::grouped_gemm_fp8_wgrad", mutates_args=())
def grouped_gemm_fp8_wgrad(
    dc_t: Tensor, dc_scale: Tensor, a_t: Tensor, a_scale: Tensor, offsets: Tensor, dtype: torch.dtype
) -> Tensor:
    """The FP8 weight gradient: db[e] = dc[rows of e]^T . a[rows of e] from the transposed 1x128 quantisations
    quantize_cols_1x128(dc, offsets) -> (dc_t [N, R], dc_scale) and quantize_cols_1x128(a, offsets) -> (a_t
    [K, R], a_scale) -> db [E, N, K] of `dtype`. On a GPU only the Hopper kernel exists (bfloat16 out, every
    offsets[e] a multiple of 16: plan with pad_multiple 16)."""
    E = offsets.shape[0] - 1
    db = torch.empty(E, dc_t.shape[0], a_t.shape[0], dtype=dtype, device=dc_t.device)
    ws = ops.sm90_workspace(dc_t, E, "grouped_gemm_fp8_wgrad_workspace_bytes")
    _C.grouped_gemm_fp8_wgrad(
        dc_t, dc_scale, a_t, a_scale, offsets, db, _stream(dc_t), ops._validate["indices"], ws
    )
    return db


@grouped_gemm_fp8_wgrad.register_fake
def _(dc_t, dc_scale, a_t, a_scale, offsets, dtype):
    return dc_t.new_empty(offsets.shape[0] - 1, dc_t.shape[0], a_t.shape[0], dtype=dtype)


# -------------------------------------------------------------------------------- recipes in one place
class Fp8Weight(NamedTuple):
    """An expert weight quantised for the forward GEMM, always [E, N, K] ("nk") in e4m3."""

    q: Tensor  # [E, N, K] uint8
    scale: Tensor  # [E, ceil(N/128), ceil(K/128)] f32: what the GEMM reads
    row_scale: Optional[Tensor]  # rowwise only: [E, N] f32, applied to the GEMM's output columns


def quantize_weight(w: Tensor, layout: int, recipe: Float8Recipe) -> Fp8Weight:
    """w [E, N, K] (layout 0) or [E, K, N] (layout 1) -> Fp8Weight."""
    w = (w if layout == 0 else w.transpose(1, 2)).detach().contiguous()
    E, N, K = w.shape
    if recipe.name == "blockwise":
        q, scale = quantize_weight_128x128(w)
        return Fp8Weight(q, scale, None)
    ones = torch.ones(E, _blocks(N), _blocks(K), dtype=torch.float32, device=w.device)
    if recipe.name == "tensorwise":
        q, s = quantize_tensorwise(w)
        return Fp8Weight(q, ones * s, None)
    q, s = quantize_rowwise(w)  # [E, N]
    return Fp8Weight(q, ones, s)


def quantize_activation(a: Tensor, recipe: Float8Recipe) -> tuple[Tensor, Tensor]:
    """a [R, K] -> q [R, K], scale [R, ceil(K/128)] in the layout the GEMM reads, for any recipe."""
    if recipe.name == "blockwise":
        return quantize_rows_1x128(a, None, 1)
    q, s = quantize_rowwise(a) if recipe.name == "rowwise" else quantize_tensorwise(a)  # [R] or [1]
    return q, s.reshape(-1, 1).expand(a.shape[0], _blocks(a.shape[1])).contiguous()


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


# Optimizer steps taken in this process (torch.optim's global step hook). A fused optimizer (AdamW(fused=True),
# what HF's Trainer picks on a GPU) updates the weights in place without moving their version counters, so
# the FP8 weight copies are also dropped after every step of any torch.optim optimizer.
_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


class Fp8WeightCache:
    """Quantised copies of weights, keyed by the weight, its layout and the recipe; a copy is recomputed
    when the weight's version counter moves (an in-place update) or a torch.optim optimizer has stepped
    since it was made (fused optimizers do not move version counters), so FP8 weights are refreshed once per
    step, not once per micro-batch, and dropped when their weight is freed. A blockwise copy in one layout is
    the other layout's copy transposed (one byte per weight moved, instead of a bf16 transpose and a second
    quantisation). Weights changed in place some other way without moving their version counter (through
    .data, or by code outside torch.optim) need clear(). Eager only (reading the version counter breaks a
    graph)."""

    def __init__(self):
        self._entries: dict = {}

    def _current(self, w: Tensor, layout: int, recipe: Float8Recipe, stamp) -> Optional[Fp8Weight]:
        hit = self._entries.get((id(w), layout, recipe.name))
        if hit is not None and hit[0]() is w and hit[1] == stamp:
            return hit[2]
        return None

    def get(self, w: Tensor, layout: int, recipe: Float8Recipe) -> Fp8Weight:
        stamp = (w._version, w.data_ptr(), _optimizer_steps)
        value = self._current(w, layout, recipe, stamp)
        if value is not None:
            return value
        other = self._current(w, 1 - layout, recipe, stamp) if recipe.name == "blockwise" else None
        if other is not None:  # the same 128x128 blocks transposed: the same scales and codes, transposed
            value = Fp8Weight(
                other.q.transpose(1, 2).contiguous(), other.scale.transpose(1, 2).contiguous(), None
            )
        else:
            value = quantize_weight(w, layout, recipe)
        key = (id(w), layout, recipe.name)
        self._entries[key] = (weakref.ref(w, self._dropper(key)), stamp, value)
        return value

    def _dropper(self, key):
        """A weakref callback: the copy goes when its weight does (not only when the cache is next cleared)."""

        def drop(ref):
            hit = self._entries.get(key)
            if hit is not None and hit[0] is ref:
                del self._entries[key]

        return drop

    def clear(self) -> None:
        self._entries.clear()


default_cache = Fp8WeightCache()


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
