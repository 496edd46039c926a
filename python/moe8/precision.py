"""moe8.precision — the GEMM precision of the experts pipeline, as a strategy object that supplies the
forward, dgrad and wgrad grouped GEMMs (moe8.fused and moe8.experts take it as a parameter; there is one
pipeline, not one per precision):

    BF16                 the GEMMs in the inputs' dtype (bf16 / fp16 / fp32), biases fused into the kernel
    Fp8Gemms(recipe)     the forward GEMMs in FP8 e4m3 with a moe8.fp8 recipe (blockwise, rowwise, tensorwise),
                         the dgrad / wgrad GEMMs too when the recipe says dgrad / wgrad "fp8"; weights
                         quantised through an Fp8WeightCache (refreshed once per optimizer step)

Inside a torch.library op the strategy travels as an int (`code`; `from_code` rebuilds it).
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
from torch import Tensor

from . import ops
from ._core import shared_arange
from .fp8 import (
    RECIPES,
    Float8Recipe,
    Fp8Weight,
    Fp8WeightCache,
    _recipe,
    cache_named,
    check_not_frozen,
    default_cache,
    dequantized,
    frozen_fp8,
    frozen_only_cache,
    grouped_gemm_fp8,
    grouped_gemm_fp8_wgrad,
    hand_off_cache,
    one_layout_cache,
    quantize_activation,
    quantize_cols_1x128,
    quantize_grouped_gemm_fp8,
    quantize_weight,
    swiglu_quant,
)
from .fp8_rules import fp8_pays

NO_WEIGHT = (None, None, None)  # the quantised-weight arguments of the fused ops when nothing is quantised


class Bf16Gemms:
    """The grouped GEMMs in the inputs' own dtype (moe8.ops.grouped_gemm and its gradients)."""

    name = "bf16"
    code = -1
    pad_multiple = 1  # row groups need no alignment
    bias_in_kernel = True  # the GEMM adds the bias (and its wgrad gives d bias)

    def quantized(self, w: Tensor, layout: int) -> tuple:
        check_not_frozen("w", w)
        return NO_WEIGHT

    def forward(self, a, w, wq, offsets, layout: int, bias=None, gathered=None) -> Tensor:
        """a [R, K] . op(w[e]) (+ bias[e]) per expert group -> [R, N]."""
        check_not_frozen("w", w)
        return ops.grouped_gemm(a, w.contiguous(), offsets, layout, bias)

    def gathered_forward(
        self, x, rows, w, wq, offsets, layout: int, bias=None, in_gemm=True, swiglu_next=False
    ) -> Tensor:
        """forward(permute(x, ...)) for rows = (row_to_slot, k, slot_to_row): with in_gemm and no bias the GEMM
        reads x's rows itself where a kernel does that (moe8.ops.gathered_grouped_gemm), else they are gathered
        into an [R, K] buffer first (freed on return). swiglu_next (layout 0, no bias, not in_gemm): the output's
        SwiGLU made in the GEMM's epilogue (moe8.ops.grouped_gemm_swiglu) and handed to act_forward (HANDED_ACT)."""
        check_not_frozen("w", w)
        row_to_slot, k, slot_to_row = rows
        if in_gemm and bias is None:
            return ops.gathered_grouped_gemm(x, row_to_slot, k, slot_to_row, w.contiguous(), offsets, layout)
        a = ops.gather_rows(x, row_to_slot, k, None, slot_to_row.view(-1))
        if swiglu_next and layout == 0 and bias is None:
            h, act = ops.grouped_gemm_swiglu(a, w.contiguous(), offsets)
            HANDED_ACT.put(h, act)
            return h
        return self.forward(a, w, wq, offsets, layout, bias)

    def act_forward(self, h, w, wq, offsets, layout: int, act, bias=None) -> Tensor:
        """forward(activation(h, *act)), the activations freed on return; a SwiGLU handed over with h
        (gathered_forward's swiglu_next) is taken instead of computed again."""
        handed = HANDED_ACT.take(h) if tuple(act[:2]) == SWIGLU else None
        return self.forward(
            ops.activation(h, *act) if handed is None else handed[0], w, wq, offsets, layout, bias
        )

    def dgrad(self, g, w, offsets, layout: int, gathered=None) -> Tensor:
        """d a of c = a . op(w) from g = d c (`gathered`: g's rows are a gather, unused here)."""
        check_not_frozen("w", w)
        return ops._input_grad(g, w, offsets, layout)

    def wgrad(self, a, g, w, offsets, layout: int, bias_dtype=None):
        """(d w, d bias in bias_dtype or None)."""
        return ops._weight_grads(a, g, w, offsets, layout, bias_dtype)


BF16 = Bf16Gemms()


_CACHES = (default_cache, one_layout_cache, None, frozen_only_cache, hand_off_cache)  # by code
_CACHE_CODES = {id(c): i for i, c in enumerate(_CACHES)}


def code_of(recipe: Float8Recipe, cache: Optional[Fp8WeightCache] = default_cache) -> int:
    """The int a fused op's `precision` argument carries for an FP8 recipe and one of moe8.fp8's named
    caches (from_code's inverse); any other cache is carried as default_cache (its backward's copies)."""
    c = _CACHE_CODES.get(id(cache), 0)
    return recipe.id | (recipe.dgrad == "fp8") << 2 | (recipe.wgrad == "fp8") << 3 | c << 4


class Handed:
    """A tensor's companions made by the kernel that wrote it, for the next op that reads that tensor: one entry,
    taken once. HANDED_CODES: d h's 1x128 FP8 codes and scales from the routed activation backward
    (fused.activation_down_combine with dh_codes), for the up projection's blockwise FP8 dgrad; HANDED_ACT: the
    SwiGLU of h from the up projection's GEMM epilogue (Bf16Gemms.gathered_forward with swiglu_next), for the down
    projection's forward (act_forward). The entry holds the tensor itself, so its memory is not reused while the
    entry lives, and matches a tensor with its storage, shape, strides and version: one changed or replaced since
    then misses it and the reader makes the companions again (the same bits). Eager only: in a traced graph
    (torch.compile) nothing is handed over."""

    def __init__(self):
        self._entry = None

    def put(self, t: Tensor, *companions: Tensor) -> None:
        if has_data(t):
            self._entry = (t, t._version, companions)

    def take(self, t: Tensor) -> Optional[tuple]:
        """t's companions and the entry dropped, or None (the entry kept) when it is not t's."""
        if self._entry is None or not has_data(t):
            return None
        held, version, companions = self._entry
        same = (
            held.data_ptr() == t.data_ptr()
            and held.device == t.device
            and held.dtype == t.dtype
            and held.shape == t.shape
            and held.stride() == t.stride()
            and version == t._version
        )
        if not same:
            return None
        self._entry = None
        return companions

    def clear(self) -> None:
        self._entry = None


def has_data(t: Tensor) -> bool:
    """Whether t has memory of its own: False for the fake and functional tensors of a traced graph."""
    try:
        t.data_ptr()
    except RuntimeError:
        return False
    return True


HANDED_CODES = Handed()  # d h -> (q, scale)
HANDED_ACT = Handed()  # h -> (act,)
SWIGLU = (ops.ACTIVATIONS["swiglu"], False)  # (kind, interleaved) of the activation the GEMM's epilogue makes


class Fp8Gemms:
    """The grouped GEMMs in FP8 with `recipe` (a moe8.fp8 recipe name or Float8Recipe). cache: where the
    weights' FP8 copies come from (None: quantised at every call, forward and FP8 dgrad; the backward's copies
    come from the same named cache of moe8.fp8, default_cache for any other)."""

    bias_in_kernel = False  # the bias is added in fp32 after the GEMM (see add_bias)

    def __init__(self, recipe="blockwise", cache: Optional[Fp8WeightCache] = default_cache):
        self.recipe = _recipe(recipe)
        self.cache = cache
        r = self.recipe
        self.name = r.name
        self.code = code_of(r, cache)
        # the FP8 weight gradient reads each expert's rows from a 16-byte aligned start: groups padded to 16
        self.pad_multiple = 16 if r.wgrad == "fp8" else 1

    def __repr__(self) -> str:
        return f"Fp8Gemms({self.recipe!r})"

    def quantized(self, w: Tensor, layout: int) -> Fp8Weight:
        if self.cache is None:
            frozen = frozen_fp8(w)  # stored in FP8 only: the cache's rule for its copy
            if frozen is not None:
                return default_cache.get(w, layout, self.recipe)
            return quantize_weight(w, layout, self.recipe)
        return self.cache.get(w, layout, self.recipe)

    def forward(self, a, w, wq, offsets, layout: int, bias=None, gathered=None) -> Tensor:
        assert bias is None, "Fp8Gemms adds biases outside the GEMM (add_bias)"
        return _fp8_forward(a, Fp8Weight(*wq), offsets, self.recipe, gathered)

    def gathered_forward(
        self, x, rows, w, wq, offsets, layout: int, bias=None, in_gemm=True, swiglu_next=False
    ) -> Tensor:
        """forward(permute(x, ...)) (swiglu_next: no fused activation here): the blockwise recipe quantises the rows straight from x (no [R, K] copy in
        x's dtype), the others gather them first."""
        row_to_slot, k, slot_to_row = rows
        gathered = (x, row_to_slot, k, slot_to_row)
        a = (
            x
            if self.recipe.name == "blockwise"
            else ops.gather_rows(x, row_to_slot, k, None, slot_to_row.view(-1))
        )
        return self.forward(a, w, wq, offsets, layout, bias, gathered)

    def act_forward(self, h, w, wq, offsets, layout: int, act, bias=None) -> Tensor:
        assert bias is None, "Fp8Gemms adds biases outside the GEMM (add_bias)"
        wq = Fp8Weight(*wq)
        if self.recipe.name == "blockwise":  # activation and 1x128 quantisation in one pass (same bits)
            aq, a_s = swiglu_quant(h, *act)
            return grouped_gemm_fp8(aq, a_s, wq.q, wq.scale, offsets, h.dtype)
        return _fp8_forward(ops.activation(h, *act), wq, offsets, self.recipe)

    def dgrad(self, g, w, offsets, layout: int, gathered=None) -> Tensor:
        if self.recipe.dgrad == "fp8":  # g quantised like an activation, w like a weight, transposed
            wt = self.quantized(w, 1 - layout)
            codes = HANDED_CODES.take(g) if self.recipe.name == "blockwise" and gathered is None else None
            if (
                codes is not None
            ):  # g's codes from the kernel that wrote g: the same bits as quantising it here
                return grouped_gemm_fp8(*codes, wt.q, wt.scale, offsets, g.dtype)
            return _fp8_forward(g, wt, offsets, self.recipe, gathered)
        frozen = frozen_fp8(w)
        if frozen is not None:  # stored in FP8 only: the bf16 GEMM reads its values dequantised, [E, N, K]
            # of the GEMM in frozen.layout; in the other layout the same matrix is read transposed
            values = dequantized(frozen.value, g.dtype)
            return ops.grouped_gemm(g, values, offsets, 1 if layout == frozen.layout else 0, None)
        return ops.grouped_gemm(g, w.contiguous(), offsets, 1 - layout, None)

    def wgrad(self, a, g, w, offsets, layout: int, bias_dtype=None):
        dw = _fp8_wgrad(a, g, offsets, layout, w.shape[0]) if self.recipe.wgrad == "fp8" else None
        if dw is None:  # bf16, or no FP8 wgrad kernel here
            dw = ops.grouped_gemm_wgrad(a, g, offsets, layout, w.shape[0], False)[0]
        return dw.to(w.dtype), None


Precision = Union[Bf16Gemms, Fp8Gemms]


def precision(fp8=None, cache: Optional[Fp8WeightCache] = default_cache) -> Precision:
    """The strategy for `fp8`: None (or "none", "bf16") -> BF16; a recipe name or Float8Recipe -> Fp8Gemms
    with `cache` (or the cache a Config's fp8_cache names: "frozen", "both", "one", "none", "handoff"); a strategy object is
    returned as it is."""
    if isinstance(cache, str):
        cache = cache_named(cache)
    if fp8 is None or isinstance(fp8, str) and fp8 in ("none", "bf16"):
        return BF16
    if isinstance(fp8, (Bf16Gemms, Fp8Gemms)):
        return fp8
    return Fp8Gemms(fp8, cache)


def for_shape(prec: Precision, rows: int, n: int, k: int, w: Optional[Tensor] = None) -> Precision:
    """prec, or BF16 where prec's recipe is `auto` and FP8 does not pay for a GEMM of rows x n x k
    (moe8.fp8_rules.fp8_pays); a weight w stored in FP8 only keeps FP8."""
    if not isinstance(prec, Fp8Gemms) or not prec.recipe.auto:
        return prec
    if w is not None and frozen_fp8(w) is not None:
        return prec
    return prec if fp8_pays(rows, n, k, prec.name) else BF16


@functools.cache  # a few dozen codes; the strategies hold no state of a call
def from_code(code: int) -> Precision:
    """The strategy a fused op's `precision` argument names (Precision.code); FP8 weights from default_cache.
    One object per code (built once: each op call and its backward ask for it)."""
    if code < 0:
        return BF16
    name = next(n for n, i in RECIPES.items() if i == code & 3)
    fp8 = ("bf16", "fp8")
    cache = _CACHES[code >> 4 & 7]
    return Fp8Gemms(Float8Recipe(name, fp8[code >> 2 & 1], fp8[code >> 3 & 1]), cache)


# ------------------------------------------------------------------------------------ FP8 internals
def _row_experts(offsets: Tensor, rows: int) -> Tensor:
    """[rows] expert of each row (E for rows past offsets[E]), without a host sync."""
    r = shared_arange(rows, offsets)  # [rows] of offsets' dtype, shared (read only)
    return torch.searchsorted(offsets, r, right=True) - 1


def _per_row(t: Tensor, offsets: Tensor, rows: int) -> Tensor:
    """t [E, N] -> [rows, N]: row r gets t[expert of r]; rows past offsets[E] get zeros."""
    padded = torch.cat([t, t.new_zeros(1, t.shape[1])])
    return padded[_row_experts(offsets, rows)]


def add_bias(c: Tensor, bias: Optional[Tensor], offsets: Tensor) -> Tensor:
    """c + bias[expert of each row], added in fp32 (so its gradient, a sum over rows, is accumulated in fp32)."""
    if bias is None:
        return c
    return (c.float() + _per_row(bias.float(), offsets, c.shape[0])).to(c.dtype)


def _fp8_forward(a: Tensor, wq: Fp8Weight, offsets: Tensor, recipe: Float8Recipe, gathered=None) -> Tensor:
    """a . wq per expert group in FP8. gathered (src, row_to_slot, k, slot_to_row): a's rows are src's
    gathered (ops.permute / gather_rows); the blockwise recipe then quantises them from src in that gather's
    pass (quantize_rows_1x128 with row_to_slot: the same bits, one [R, K] read fewer; slot_to_row: each token
    read and quantised once), and a is only read for its dtype."""
    if recipe.name == "blockwise":  # quantisation and GEMM in one call into the core (the same kernels)
        src, row_to_slot, k, slot_to_row = gathered if gathered is not None else (a, None, 1, None)
        c = quantize_grouped_gemm_fp8(src, row_to_slot, k, slot_to_row, wq.q, wq.scale, offsets, a.dtype)
    else:
        aq, a_scale = quantize_activation(a, recipe)
        c = grouped_gemm_fp8(aq, a_scale, wq.q, wq.scale, offsets, a.dtype)
    if wq.row_scale is not None:
        c = (c.float() * _per_row(wq.row_scale, offsets, c.shape[0])).to(a.dtype)
    return c


def _fp8_wgrad(a: Tensor, g: Tensor, offsets: Tensor, layout: int, num_experts: int) -> Optional[Tensor]:
    """The weight gradient of c = a . w[e] (layout 0: w [E, N, K]; 1: [E, K, N]) through the FP8 grouped GEMM,
    or None where that kernel is not available (a GPU without the Hopper kernel)."""
    if a.is_cuda and not ops.sm90_workspace_bytes(a, num_experts, "grouped_gemm_fp8_wgrad_workspace_bytes"):
        return None
    gq, gs = quantize_cols_1x128(g, offsets)
    aq, a_s = quantize_cols_1x128(a, offsets)
    out = torch.bfloat16 if a.is_cuda else torch.float32
    if layout == 0:  # dW[e] [N, K] = g_e^T . a_e
        return grouped_gemm_fp8_wgrad(gq, gs, aq, a_s, offsets, out, False)
    return grouped_gemm_fp8_wgrad(aq, a_s, gq, gs, offsets, out, False)  # [K, N] = a_e^T . g_e
