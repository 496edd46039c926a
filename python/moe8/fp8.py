"""moe8.fp8 — FP8 (e4m3) training recipes for the expert GEMMs: the quantisation and GEMM ops, and the cache of
quantised weights.

Recipes (`Float8Recipe(name)`):
    "blockwise"   DeepSeek-V3: activations 1x128 along K, weights 128x128, fp32 scales, fp32 promotion
                  every 128 of K inside the GEMM (the default)
    "rowwise"     one scale per activation row and per weight output row
    "tensorwise"  one scale per tensor
Every scale is amax / 448 (1 for an all-zero block), q = e4m3(x * (1 / scale)), round-to-nearest-even,
saturating; quantised tensors are uint8 (view them as torch.float8_e4m3fn if you like: the core takes both).

Raw ops (torch.library custom ops with fake implementations; CPU reference or CUDA kernels):
    quantize_rows_1x128 (optionally fused with the permutation into expert order), quantize_weight_128x128
    (and _pair: both layouts in one pass; _t: the other layout only), quantize_cols_1x128 (the transposed quantisation of the weight gradient), swiglu_quant,
    quantize_rowwise, quantize_tensorwise, dequantize, grouped_gemm_fp8, grouped_gemm_fp8_wgrad, and
    quantize_grouped_gemm_fp8 (quantize_rows_1x128 and grouped_gemm_fp8 in one call: an FP8 layer's forward)
Weights: quantize_weight, and Fp8WeightCache: default_cache (copies refreshed when a weight changes or an
optimizer steps, not per micro-batch), frozen_only_cache (what Config's default fp8_cache="frozen" names:
trainable weights quantised at every use, nothing of them held; frozen ones cached) or hand_off_cache
(fp8_cache="handoff": as frozen, but one pass makes a trainable weight's forward and FP8-dgrad copies, the
latter held from the forward to its backward).
The experts pipeline runs on these through its FP8 precision strategy (moe8.precision.Fp8Gemms): pass
fp8="blockwise" (or a Float8Recipe) to moe8.experts_forward, or set moe8.Config(fp8=...).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _checks as _c
from ._core import C as _C
from ._core import make_direct, shared_ones, sm90_workspace
from ._core import stream as _stream

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
    multiples of 16, which the experts pipeline plans for, and falls back to bf16 without the kernel).
    auto: FP8 only for the GEMMs whose shape makes it pay (moe8.fp8_rules.fp8_pays), bf16 for the others;
    the recipe "auto" is blockwise with FP8 dgrad and auto on."""

    name: str = "blockwise"
    dgrad: str = "bf16"
    wgrad: str = "bf16"
    auto: bool = False

    def __post_init__(self):
        if self.name not in RECIPES:
            raise ValueError(f"recipe: expected one of {sorted(RECIPES)}, got {self.name!r}")
        if self.dgrad not in DGRAD:
            raise ValueError(f"dgrad: expected one of {list(DGRAD)}, got {self.dgrad!r}")
        if self.wgrad not in DGRAD:
            raise ValueError(f"wgrad: expected one of {list(DGRAD)}, got {self.wgrad!r}")
        if not isinstance(self.auto, bool):
            raise ValueError(f"auto: expected True or False, got {self.auto!r}")

    @property
    def id(self) -> int:
        return RECIPES[self.name]


AUTO = "auto"  # the recipe name of Float8Recipe("blockwise", dgrad="fp8", auto=True)


def _recipe(recipe) -> Float8Recipe:
    if isinstance(recipe, Float8Recipe):
        return recipe
    named = _NAMED.get(recipe) if isinstance(recipe, str) else None
    if named is not None:  # a layer passes its recipe's name at every call: one frozen object per name
        return named
    if recipe == AUTO:
        return Float8Recipe("blockwise", dgrad="fp8", auto=True)
    if str(recipe) not in RECIPES:
        raise ValueError(f"recipe: expected one of {sorted(RECIPES) + [AUTO]}, got {recipe!r}")
    return Float8Recipe(str(recipe))


_NAMED = {name: Float8Recipe(name) for name in RECIPES} | {
    AUTO: Float8Recipe("blockwise", dgrad="fp8", auto=True)
}


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def _u8(shape, like: Tensor) -> Tensor:
    return torch.empty(shape, dtype=torch.uint8, device=like.device)


def _f32(shape, like: Tensor) -> Tensor:
    return torch.empty(shape, dtype=torch.float32, device=like.device)


def _codes(w: Tensor, rows: int, cols: int) -> tuple[Tensor, Tensor]:
    """Room for a 128x128-blockwise copy of w's experts as [E, rows, cols]: codes u8, scales [E, rows/128,
    cols/128] f32 (blocks rounded up); fake tensors under a fake mode, as the ops' fake implementations want."""
    E = w.shape[0]
    return _u8((E, rows, cols), w), _f32((E, _blocks(rows), _blocks(cols)), w)


# ----------------------------------------------------------------------------------- quantisation ops
@torch.library.custom_op("moe8::quantize_rows_1x128", mutates_args=())
def quantize_rows_1x128(
    x: Tensor, row_to_slot: Optional[Tensor], k: int, slot_to_row: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """x [R, K] -> q [R, K] uint8, scale [R, ceil(K/128)] f32. With row_to_slot [R'] (permute + quantise in
    one pass): x is the token matrix [T, K] and row r is x[row_to_slot[r] // k] (-1: zeros, scale 1).
    slot_to_row [T*k] (the plan's inverse of row_to_slot, optional): the same bits; on a GPU each token is
    then read and quantised once and its codes stored to its k rows (k <= 8) instead of once per row."""
    _c.tensor("x", x, 2, "[R, K]")
    if row_to_slot is not None:
        _c.tensor("row_to_slot", row_to_slot, 1, "[R']")
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
    _c.tensor("w", w, 3, "[E, N, K]")
    q, scale = _codes(w, *w.shape[1:])
    _C.quantize_weight_128x128(w, q, scale, _stream(w))
    return q, scale


@quantize_weight_128x128.register_fake
def _(w):
    return _codes(w, *w.shape[1:])


@torch.library.custom_op("moe8::quantize_weight_128x128_pair", mutates_args=())
def quantize_weight_128x128_pair(w: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """w [E, N, K] -> quantize_weight_128x128's q, scale and, from the same pass, the other layout's copy:
    q_t [E, K, N] and scale_t [E, ceil(K/128), ceil(N/128)], q and scale transposed (the same square blocks)."""
    _c.tensor("w", w, 3, "[E, N, K]")
    _, N, K = w.shape
    (q, scale), (q_t, scale_t) = _codes(w, N, K), _codes(w, K, N)
    _C.quantize_weight_128x128(w, q, scale, _stream(w), q_t, scale_t)
    return q, scale, q_t, scale_t


@quantize_weight_128x128_pair.register_fake
def _(w):
    _, N, K = w.shape
    return (*_codes(w, N, K), *_codes(w, K, N))


@torch.library.custom_op("moe8::quantize_weight_128x128_t", mutates_args=())
def quantize_weight_128x128_t(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [E, N, K] -> the other layout only: q_t [E, K, N] and scale_t [E, ceil(K/128), ceil(N/128)], the bits
    quantize_weight_128x128_pair gives (the same square blocks), in one pass over w and without a transposed
    bf16 copy of it: what a weight's transposed GEMM (the FP8 dgrad) reads when nothing is cached."""
    _c.tensor("w", w, 3, "[E, N, K]")
    _, N, K = w.shape
    q_t, scale_t = _codes(w, K, N)
    _C.quantize_weight_128x128(w, None, None, _stream(w), q_t, scale_t)
    return q_t, scale_t


@quantize_weight_128x128_t.register_fake
def _(w):
    _, N, K = w.shape
    return _codes(w, K, N)


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
    """Activation (kind as in moe8.ops.ACTIVATIONS) fused with 1x128 quantisation of its output:
    h [R, 2I] (gated) or [R, I] -> q [R, I] uint8, scale [R, ceil(I/128)]."""
    _c.tensor("h", h, 2, "[R, 2I] or [R, I]")
    _c.integer("kind", kind, 0, 3)
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
    return sm90_workspace(a, num_experts, "grouped_gemm_fp8_workspace_bytes")


@torch.library.custom_op("moe8::grouped_gemm_fp8", mutates_args=())
def grouped_gemm_fp8(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offsets: Tensor, dtype: torch.dtype
) -> Tensor:
    """Blockwise-scaled FP8 grouped GEMM, c[r] = a[r] . b[e]^T for the rows r of expert e:
    a [R, K] e4m3, a_scale [R, ceil(K/128)], b [E, N, K] e4m3, b_scale [E, ceil(N/128), ceil(K/128)],
    offsets [E+1] -> c [R, N] of `dtype` (bfloat16 takes the Hopper kernel on an H100/H200)."""
    _c.tensor("a", a, 2, "[R, K]")
    _c.tensor("b", b, 3, "[E, N, K]")
    if dtype not in _c.FLOATS:
        raise TypeError(f"dtype: expected torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
    c = torch.empty(a.shape[0], b.shape[1], dtype=dtype, device=a.device)
    _C.grouped_gemm_fp8(a, a_scale, b, b_scale, offsets, c, _stream(a), False, _fp8_workspace(a, b.shape[0]))
    return c


@grouped_gemm_fp8.register_fake
def _(a, a_scale, b, b_scale, offsets, dtype):
    return a.new_empty(a.shape[0], b.shape[1], dtype=dtype)


@functools.lru_cache(maxsize=256)
def _scratch_bytes(rows: int, cols: int) -> int:
    return _C.quantize_grouped_gemm_fp8_scratch_bytes(rows, cols)


@torch.library.custom_op("moe8::quantize_grouped_gemm_fp8", mutates_args=())
def quantize_grouped_gemm_fp8(
    x: Tensor,
    row_to_slot: Optional[Tensor],
    k: int,
    slot_to_row: Optional[Tensor],
    b: Tensor,
    b_scale: Tensor,
    offsets: Tensor,
    dtype: torch.dtype,
) -> Tensor:
    """grouped_gemm_fp8(*quantize_rows_1x128(x, row_to_slot, k, slot_to_row), b, b_scale, offsets, dtype) in one
    call into the core (the same kernels, the same bits), the quantised rows in a scratch freed on return:
    x [T, K] (or the rows of x that row_to_slot [R] gathers, as in quantize_rows_1x128) . b [E, N, K]^T
    -> c [R, N] of `dtype`. An FP8 linear layer's forward is this with offsets [0, T] (one group). Two
    allocations (c; the codes and scales of the rows, one scratch), one call into the core."""
    _c.tensor("x", x, 2, "[T, K]")
    _c.tensor("b", b, 3, "[E, N, K]")
    if row_to_slot is not None:
        _c.tensor("row_to_slot", row_to_slot, 1, "[R]")
    if dtype not in _c.FLOATS:
        raise TypeError(f"dtype: expected torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
    rows = x.shape[0] if row_to_slot is None else row_to_slot.shape[0]
    c = torch.empty(rows, b.shape[1], dtype=dtype, device=x.device)
    scratch = torch.empty(_scratch_bytes(rows, x.shape[1]), dtype=torch.uint8, device=x.device)
    ws = _fp8_workspace(x, b.shape[0])
    _C.quantize_grouped_gemm_fp8(
        x, row_to_slot, k, slot_to_row, b, b_scale, offsets, scratch, c, _stream(x), False, ws
    )
    return c


@quantize_grouped_gemm_fp8.register_fake
def _(x, row_to_slot, k, slot_to_row, b, b_scale, offsets, dtype):
    rows = x.shape[0] if row_to_slot is None else row_to_slot.shape[0]
    return x.new_empty(rows, b.shape[1], dtype=dtype)


@torch.library.custom_op("moe8::grouped_gemm_fp8_wgrad", mutates_args=())
def grouped_gemm_fp8_wgrad(
    dc_t: Tensor,
    dc_scale: Tensor,
    a_t: Tensor,
    a_scale: Tensor,
    offsets: Tensor,
    dtype: torch.dtype,
    check_offsets: bool = True,
) -> Tensor:
    """The FP8 weight gradient: db[e] = dc[rows of e]^T . a[rows of e] from the transposed 1x128 quantisations
    quantize_cols_1x128(dc, offsets) -> (dc_t [N, R], dc_scale) and quantize_cols_1x128(a, offsets) -> (a_t
    [K, R], a_scale) -> db [E, N, K] of `dtype`. On a GPU only the Hopper kernel exists (bfloat16 out, every
    offsets[e] a multiple of 16: plan with pad_multiple 16). check_offsets: validate offsets on the device
    (a host sync); False for offsets from moe8's own plan."""
    _c.tensor("dc_t", dc_t, 2, "[N, R]")
    _c.tensor("a_t", a_t, 2, "[K, R]")
    _c.tensor("offsets", offsets, 1, "[E + 1]")
    if dtype not in _c.FLOATS:
        raise TypeError(f"dtype: expected torch.float32, torch.float16 or torch.bfloat16, got {dtype}")
    E = offsets.shape[0] - 1
    db = torch.empty(E, dc_t.shape[0], a_t.shape[0], dtype=dtype, device=dc_t.device)
    ws = sm90_workspace(dc_t, E, "grouped_gemm_fp8_wgrad_workspace_bytes")
    _C.grouped_gemm_fp8_wgrad(dc_t, dc_scale, a_t, a_scale, offsets, db, _stream(dc_t), check_offsets, ws)
    return db


@grouped_gemm_fp8_wgrad.register_fake
def _(dc_t, dc_scale, a_t, a_scale, offsets, dtype, check_offsets=True):
    return dc_t.new_empty(offsets.shape[0] - 1, dc_t.shape[0], a_t.shape[0], dtype=dtype)


# -------------------------------------------------------------------------------- recipes in one place
class Fp8Weight(NamedTuple):
    """An expert weight quantised for the forward GEMM, always [E, N, K] ("nk") in e4m3."""

    q: Tensor  # [E, N, K] uint8
    scale: Tensor  # [E, ceil(N/128), ceil(K/128)] f32: what the GEMM reads
    row_scale: Optional[Tensor]  # rowwise only: [E, N] f32, applied to the GEMM's output columns


def _nk(w: Tensor, layout: int) -> Tensor:
    """w [E, N, K] (layout 0), [E, K, N] (layout 1) or a dense weight [N, K] ([K, N]) -> [E or 1, N, K]."""
    w = w if w.dim() == 3 else w.unsqueeze(0)
    return (w if layout == 0 else w.transpose(1, 2)).detach().contiguous()


def quantize_weight(w: Tensor, layout: int, recipe: Float8Recipe) -> Fp8Weight:
    """w [E, N, K] (layout 0) or [E, K, N] (layout 1) -> Fp8Weight; a dense weight [N, K] is one expert.
    Blockwise in layout 1: quantised as stored, the codes written transposed (no bf16 transpose of w)."""
    if recipe.name == "blockwise":
        if layout == 1:
            stored = (w if w.dim() == 3 else w.unsqueeze(0)).detach().contiguous()
            return Fp8Weight(*quantize_weight_128x128_t(stored), None)
        return Fp8Weight(*quantize_weight_128x128(_nk(w, 0)), None)
    w = _nk(w, layout)
    E, N, K = w.shape
    ones = shared_ones((E, _blocks(N), _blocks(K)), w)  # the GEMM's 128x128 scales, all 1 (read only)
    if recipe.name == "tensorwise":
        q, s = quantize_tensorwise(w)
        return Fp8Weight(q, ones * s, None)
    q, s = quantize_rowwise(w)  # [E, N]
    return Fp8Weight(q, ones, s)


def quantize_activation(a: Tensor, recipe: Float8Recipe) -> tuple[Tensor, Tensor]:
    """a [R, K] -> q [R, K], scale [R, ceil(K/128)] in the layout the GEMM reads, for any recipe."""
    if recipe.name == "blockwise":
        return quantize_rows_1x128(a, None, 1, None)  # every argument: a direct call (moe8._core)
    q, s = quantize_rowwise(a) if recipe.name == "rowwise" else quantize_tensorwise(a)  # [R] or [1]
    return q, s.reshape(-1, 1).expand(a.shape[0], _blocks(a.shape[1])).contiguous()


# Optimizer steps taken in this process (torch.optim's global step hook). A fused optimizer (AdamW(fused=True),
# what HF's Trainer picks on a GPU) updates the weights in place without moving their version counters, so
# the FP8 weight copies are also dropped after every step of any torch.optim optimizer.
_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def quantize_weight_pair(w: Tensor) -> tuple[Fp8Weight, Fp8Weight]:
    """Both layouts' blockwise copies of w as stored ([E, ., .] or a dense [., .]), from one pass over w:
    (quantize_weight(w, 0, blockwise), quantize_weight(w, 1, blockwise)), the same bits, no bf16 transpose."""
    stored = (w if w.dim() == 3 else w.unsqueeze(0)).detach().contiguous()
    q, scale, q_t, scale_t = quantize_weight_128x128_pair(stored)
    return Fp8Weight(q, scale, None), Fp8Weight(q_t, scale_t, None)


def transposed(wq: Fp8Weight) -> Fp8Weight:
    """A blockwise copy in the other layout: the same 128x128 blocks, so the same codes and scales, transposed."""
    return Fp8Weight(wq.q.transpose(1, 2).contiguous(), wq.scale.transpose(1, 2).contiguous(), None)


def dequantized(value: Fp8Weight, dtype: torch.dtype) -> Tensor:
    """A blockwise Fp8Weight's values [E, N, K] in `dtype` (each code times its block's scale): what a bf16
    GEMM reads of a weight stored in FP8 only, e.g. its input gradient when the recipe's dgrad is bf16."""
    return dequantize(value.q, value.scale, BLOCK, BLOCK, dtype)


def fp8_nbytes(value) -> int:
    """Bytes held by an Fp8Weight (or None)."""
    return 0 if value is None else sum(t.nbytes for t in value if t is not None)


class FrozenFp8(NamedTuple):
    """A frozen weight stored in FP8 only (freeze_fp8): its blockwise copy in one layout."""

    layout: int
    recipe: Float8Recipe
    value: Fp8Weight


FROZEN = "_moe8_fp8"  # the attribute of a placeholder weight that carries its FrozenFp8


def frozen_fp8(w: Tensor) -> Optional[FrozenFp8]:
    """The FP8 copy of a weight whose bf16 values were freed by freeze_fp8 (None for any other tensor)."""
    return getattr(w, FROZEN, None)


def freeze_fp8(w: Tensor, layout: int = 0, recipe="blockwise") -> Tensor:
    """A frozen weight stored in FP8 only (LoRA over FP8 base weights): returns a placeholder of w's shape,
    dtype and device that holds no values (a zero-stride view of one element) and carries w's blockwise copy
    in `layout` (0: the GEMM reads w as [E, N, K], 1: as its transpose); the caller drops w itself. The moe8
    FP8 GEMMs read the copy; so does the input gradient: through the same blocks transposed with an FP8
    dgrad (recipe dgrad="fp8"), dequantised for the bf16 GEMM (a transient copy) with the default bf16 dgrad.
    Anything else that reads the placeholder's values reads zeros, and moe8's bf16 paths refuse it (ValueError)."""
    recipe = _recipe(recipe)
    if recipe.name != "blockwise":
        raise ValueError(f"recipe: frozen FP8 weights are blockwise (layout-symmetric), got {recipe.name!r}")
    if w.dim() not in (2, 3):
        raise ValueError(f"w: expected a 2-d or 3-d weight, got shape {tuple(w.shape)}")
    value = quantize_weight(w, layout, recipe)
    placeholder = torch.zeros((), dtype=w.dtype, device=w.device).expand(w.shape)
    placeholder = torch.nn.Parameter(placeholder, requires_grad=False)
    setattr(placeholder, FROZEN, FrozenFp8(layout, recipe, value))
    return placeholder


def check_not_frozen(name: str, w: Tensor) -> None:
    """ValueError when a bf16 path is about to read a weight that only exists in FP8."""
    if frozen_fp8(w) is not None:
        raise ValueError(
            f"{name}: this weight is stored in FP8 only (moe8.fp8.freeze_fp8); run it with an FP8 recipe "
            f"(fp8='blockwise'), not in bf16"
        )


class Fp8WeightCache:
    """Quantised copies of weights, keyed by the weight, its layout and the recipe; a copy is recomputed
    when the weight's version counter moves (an in-place update) or a torch.optim optimizer has stepped
    since it was made (fused optimizers do not move version counters), so FP8 weights are refreshed once per
    step, not once per micro-batch, and dropped when their weight is freed. A blockwise copy in one layout is
    the other layout's copy transposed: when the recipe's FP8 dgrad will want the other layout (grad on), the
    first get makes both in one kernel pass; otherwise a later get transposes the cached copy. Weights changed in place some other way without moving their version counter (through
    .data, or by code outside torch.optim) need clear(). Eager only (reading the version counter breaks a
    graph).

    keep_transposed: keep the other layout's blockwise copy once made (default); False keeps one layout per
    weight and derives the other from it for each use (a transient copy: FP8 weights then cost at most half
    the bf16 weights' bytes). A weight that does not require grad is not refreshed by optimizer steps (no
    optimizer changes it; in-place changes still move its version counter).

    hold_trainable: keep copies of weights that require grad (default). False: those are quantised at every
    use and nothing of them is held between calls (an optimizer changes them every step anyway, so a copy
    would live from one step's forward to the next step's, on top of the step's peak); frozen weights (LoRA
    bases) are still cached, both layouts.

    hand_off (with hold_trainable False): a blockwise weight that trains, quantised for a forward under grad
    whose backward runs an FP8 dgrad, gets both layouts from that one pass; the other layout's copy is held
    until the next get of it with the weight unchanged (the backward's dgrad), which takes it (one use). One
    pass over the weight per forward and backward instead of two, for the dgrad's copy (half the bf16
    weight's bytes) held from the forward to the backward, as a saved activation is."""

    def __init__(self, keep_transposed: bool = True, hold_trainable: bool = True, hand_off: bool = False):
        if hand_off and hold_trainable:
            raise ValueError(
                "hand_off: hands copies of weights that train over only when hold_trainable is False"
            )
        self._entries: dict = {}
        self.keep_transposed = bool(keep_transposed)
        self.hold_trainable = bool(hold_trainable)
        self.hand_off = bool(hand_off)

    def _current(self, w: Tensor, layout: int, recipe: Float8Recipe, stamp) -> Optional[Fp8Weight]:
        hit = self._entries.get((id(w), layout, recipe.name))
        if hit is not None and hit[0]() is w and hit[1] == stamp:
            return hit[2]
        return None

    def get(self, w: Tensor, layout: int, recipe: Float8Recipe) -> Fp8Weight:
        frozen = frozen_fp8(w)
        if frozen is not None:  # stored in FP8 only: its own copy, or that copy's transpose
            return frozen.value if frozen.layout == layout else transposed(frozen.value)
        if w.requires_grad and not self.hold_trainable:
            return self._handed(w, layout, recipe) if self.hand_off else quantize_weight(w, layout, recipe)
        stamp = (w._version, w.data_ptr(), _optimizer_steps if w.requires_grad else -1)
        value = self._current(w, layout, recipe, stamp)
        if value is not None:
            return value
        blockwise = recipe.name == "blockwise"
        other = self._current(w, 1 - layout, recipe, stamp) if blockwise else None
        if other is not None:  # the same 128x128 blocks transposed: the same scales and codes, transposed
            value = transposed(other)
            if not self.keep_transposed:
                return value
        elif (
            blockwise
            and self.keep_transposed
            and recipe.dgrad == "fp8"
            and w.requires_grad
            and torch.is_grad_enabled()
        ):
            # the backward's FP8 dgrad will ask for the other layout: both copies from one pass over w
            copies = quantize_weight_pair(w)
            value = copies[layout]
            self._put(w, 1 - layout, recipe, stamp, copies[1 - layout])
        else:
            value = quantize_weight(w, layout, recipe)
        self._put(w, layout, recipe, stamp, value)
        return value

    def _handed(self, w: Tensor, layout: int, recipe: Float8Recipe) -> Fp8Weight:
        """hand_off's get of a weight that trains: the copy a forward left for this layout (taken: one use),
        else quantised now, both layouts in one pass where the backward's FP8 dgrad will want the other."""
        stamp = (w._version, w.data_ptr(), _optimizer_steps)
        value = self._current(w, layout, recipe, stamp)
        if value is not None:
            del self._entries[(id(w), layout, recipe.name)]
            return value
        if recipe.name == "blockwise" and recipe.dgrad == "fp8" and torch.is_grad_enabled():
            copies = quantize_weight_pair(w)
            self._put(w, 1 - layout, recipe, stamp, copies[1 - layout])
            return copies[layout]
        return quantize_weight(w, layout, recipe)

    def _put(self, w: Tensor, layout: int, recipe: Float8Recipe, stamp, value: Fp8Weight) -> None:
        key = (id(w), layout, recipe.name)
        self._entries[key] = (weakref.ref(w, self._dropper(key)), stamp, value)

    def _dropper(self, key):
        """A weakref callback: the copy goes when its weight does (not only when the cache is next cleared).
        It holds the cache weakly too: a strong reference would make a cycle (cache -> entry -> weakref ->
        callback -> cache), so a dropped cache's copies would stay allocated until the garbage collector ran."""
        cache = weakref.ref(self)

        def drop(ref):
            entries = getattr(cache(), "_entries", {})
            hit = entries.get(key)
            if hit is not None and hit[0] is ref:
                del entries[key]

        return drop

    def clear(self) -> None:
        self._entries.clear()

    def nbytes(self) -> int:
        """Bytes of the FP8 copies the cache holds (codes and scales; stale copies included until replaced)."""
        return sum(fp8_nbytes(hit[2]) for hit in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)


default_cache = Fp8WeightCache()
one_layout_cache = Fp8WeightCache(keep_transposed=False)  # Config(fp8_cache="one")
frozen_only_cache = Fp8WeightCache(hold_trainable=False)  # Config(fp8_cache="frozen"), the default
hand_off_cache = Fp8WeightCache(hold_trainable=False, hand_off=True)  # Config(fp8_cache="handoff")
# Config.fp8_cache: frozen_only_cache, default_cache, one_layout_cache, no cache, hand_off_cache
CACHES = ("frozen", "both", "one", "none", "handoff")


def cache_named(name: str) -> Optional[Fp8WeightCache]:
    """The weight cache a Config's fp8_cache names."""
    if name not in CACHES:
        raise ValueError(f"fp8_cache: expected one of {list(CACHES)}, got {name!r}")
    return {
        "frozen": frozen_only_cache,
        "both": default_cache,
        "one": one_layout_cache,
        "none": None,
        "handoff": hand_off_cache,
    }[name]


make_direct(globals())  # after every op's registrations (moe8._core: direct calls)
