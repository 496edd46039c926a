"""moe8.fp8_linear — FP8 for the dense layers (attention projections, shared experts, dense MLPs), opt-in per
module kind, with the experts' recipes (blockwise, rowwise, tensorwise):

    y = fp8_linear(x, w, recipe)                  x [.., K] . w [N, K]^T in FP8, forward and backward
    convert_to_fp8(model, "blockwise", modules=("attention", "shared_expert", "mlp"), skip_first_last=False)
    Float8Linear                                  the nn.Linear whose forward runs fp8_linear (swapped in place)

Routers, embeddings, norms and the LM head stay in the model's dtype. The GEMMs run through moe8's FP8
grouped GEMM with one group (blockwise; the CPU) or torch._scaled_mm (rowwise / tensorwise on sm_89+):
moe8.fp8_rules.dense_backend chooses. The dgrad runs in FP8 when the recipe says dgrad="fp8" (a blockwise
weight's transposed copy is its copy transposed: the same 128x128 blocks), the wgrad when wgrad="fp8".
Weights come from the weight cache (moe8.fp8.default_cache) in eager mode: the forward's copy and, with FP8
dgrad, the backward's, both handed to the op, made once per weight version (not per call); under
torch.compile they are quantised inside the op (the cache reads version counters, which a graph can't). One
op, moe8::fp8_linear, with its backward as one op too, so torch.compile traces both without graph breaks;
eager calls run them direct (moe8._core), skipping the dispatcher.
"""

from __future__ import annotations

import functools
import re
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._core import make_direct, one_group_offsets
from .fp8 import (
    Float8Recipe,
    Fp8Weight,
    Fp8WeightCache,
    _recipe,
    cache_named,
    default_cache,
    dequantized,
    frozen_fp8,
    quantize_rowwise,
    quantize_tensorwise,
    quantize_weight,
    transposed,
)
from .fp8_rules import DENSE_KINDS, MOE8, SCALED_MM, dense_backend, dense_kinds, fp8_pays
from .precision import _fp8_forward, _fp8_wgrad, code_of, from_code

KINDS = DENSE_KINDS
BACKENDS = (MOE8, SCALED_MM)
E4M3 = torch.float8_e4m3fn
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
NO_COPY = (None, None, None)  # an FP8 weight copy's op arguments (q, scale, row_scale) when none is given


@functools.cache
def _capability_of(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def _capability(x: Tensor) -> tuple:
    return _capability_of(x.device.index) if x.is_cuda else (0, 0)  # a tensor's device has its index


@functools.cache  # (dgrad, wgrad): four frozen recipes
def _blockwise(dgrad: str, wgrad: str) -> Float8Recipe:
    return Float8Recipe("blockwise", dgrad=dgrad, wgrad=wgrad)


def _weight(
    w: Tensor, given: tuple, layout: int, recipe: Float8Recipe, forward: tuple = NO_COPY
) -> Fp8Weight:
    """The FP8 copy of the dense weight w [N, K] as the GEMM reads it: layout 0 [1, N, K] (the forward),
    1 [1, K, N] (the dgrad). `given`: that layout's copy from the op's inputs (q, scale, row_scale; Nones when
    not given); `forward`: the forward's copy, whose blocks transposed are a blockwise dgrad's copy. Else
    quantised from w."""
    frozen = frozen_fp8(w)
    if frozen is not None:
        return frozen.value if layout == frozen.layout else transposed(frozen.value)
    if given[0] is not None:
        return Fp8Weight(*given)
    if forward[0] is not None and recipe.name == "blockwise":
        return transposed(Fp8Weight(*forward))
    return quantize_weight(w, layout, recipe)


def _gemm(a: Tensor, wq: Fp8Weight, recipe: Float8Recipe, backend: str) -> Tensor:
    """a [M, K] . wq [1, N, K] -> [M, N] in a's dtype."""
    if backend != SCALED_MM or recipe.name == "blockwise":
        c = _fp8_forward(a, Fp8Weight(wq.q, wq.scale, None), one_group_offsets(a.shape[0], a), recipe)
        if wq.row_scale is None:
            return c
        # one group: every row takes the weight's row scales [1, N] (what _fp8_forward's per-row gather of the
        # scales gives, without its index kernels)
        return (c.float() * wq.row_scale.view(1, -1)).to(a.dtype)
    if recipe.name == "rowwise":
        aq, a_s = quantize_rowwise(a)
        a_s, b_s = a_s.view(-1, 1), wq.row_scale.view(1, -1)  # [M, 1], [1, N]
    else:
        aq, a_s = quantize_tensorwise(a)
        a_s, b_s = a_s.view(()), wq.scale.reshape(-1)[0]  # one scale each
    b = wq.q[0].view(E4M3)  # [N, K] row-major: its transpose is the column-major [K, N] cuBLAS reads
    return torch._scaled_mm(
        aq.view(E4M3), b.t(), scale_a=a_s, scale_b=b_s, out_dtype=a.dtype, use_fast_accum=True
    )


@torch.library.custom_op("moe8::fp8_linear", mutates_args=())
def _fp8_linear(
    x: Tensor,
    w: Tensor,
    w_q: Optional[Tensor],
    w_scale: Optional[Tensor],
    w_row_scale: Optional[Tensor],
    wt_q: Optional[Tensor],
    wt_scale: Optional[Tensor],
    wt_row_scale: Optional[Tensor],
    precision: int,
    backend: str,
) -> Tensor:
    """x [M, K] . w [N, K]^T in FP8 (precision: moe8.precision code) -> [M, N] in x's dtype. w_*: the
    forward's copy of w (layout 0), wt_*: the FP8 dgrad's (layout 1, read by the backward only); Nones:
    quantised here."""
    recipe = from_code(precision).recipe
    return _gemm(x, _weight(w, (w_q, w_scale, w_row_scale), 0, recipe), recipe, backend)


@_fp8_linear.register_fake
def _(x, w, w_q, w_scale, w_row_scale, wt_q, wt_scale, wt_row_scale, precision, backend):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("moe8::fp8_linear_backward", mutates_args=())
def _fp8_linear_backward(
    g: Tensor,
    x: Tensor,
    w: Tensor,
    w_q: Optional[Tensor],
    w_scale: Optional[Tensor],
    w_row_scale: Optional[Tensor],
    wt_q: Optional[Tensor],
    wt_scale: Optional[Tensor],
    wt_row_scale: Optional[Tensor],
    precision: int,
    backend: str,
    need_dx: bool,
    need_dw: bool,
) -> tuple[Tensor, Tensor]:
    """(dx [M, K], dw [N, K]) of fp8_linear from g [M, N]; an unneeded one is returned empty."""
    recipe = from_code(precision).recipe
    dx = dw = g.new_empty(0)
    if need_dx:
        if recipe.dgrad == "fp8":
            wt = _weight(w, (wt_q, wt_scale, wt_row_scale), 1, recipe, (w_q, w_scale, w_row_scale))
            dx = _gemm(g, wt, recipe, backend)
        elif (frozen := frozen_fp8(w)) is not None:  # stored in FP8 only: dequantised for the bf16 GEMM
            dx = g @ dequantized(frozen.value, g.dtype)[0]  # [M, N] . [N, K]
        else:
            dx = g @ w.to(g.dtype)  # [M, N] . [N, K]
    if need_dw:
        wgrad = None
        if recipe.wgrad == "fp8" and (not g.is_cuda or g.shape[0] % 16 == 0):
            wgrad = _fp8_wgrad(x, g, one_group_offsets(g.shape[0], g), 0, 1)  # [1, N, K] or None
        dw = (g.t() @ x if wgrad is None else wgrad[0]).to(w.dtype)
    return dx, dw


@_fp8_linear_backward.register_fake
def _(g, x, w, w_q, w_scale, w_row_scale, wt_q, wt_scale, wt_row_scale, precision, backend, need_dx, need_dw):
    dx = torch.empty_like(x) if need_dx else g.new_empty(0)
    dw = torch.empty_like(w, memory_format=torch.contiguous_format) if need_dw else g.new_empty(0)
    return dx, dw


def _setup(ctx, inputs, output):
    x, w, *copies, precision, backend = inputs  # the forward's copy (3), the dgrad's copy (3)
    ctx.precision, ctx.backend = precision, backend
    cache = from_code(precision).cache
    if w.requires_grad and (cache is None or not cache.hold_trainable):
        # a weight that trains: nothing of it held to the backward, which quantises it again, but for the
        # dgrad's copy a hand_off cache made in the forward's pass
        handed = cache is not None and cache.hand_off
        copies = [None] * 3 + (list(copies[3:]) if handed else [None] * 3)
    ctx.save_for_backward(x, w, *copies)


def _backward(ctx, g):
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = _fp8_linear_backward(
        g.contiguous(), *ctx.saved_tensors, ctx.precision, ctx.backend, need_dx, need_dw
    )
    return (dx if need_dx else None, dw if need_dw else None) + (None,) * 8


_fp8_linear.register_autograd(_backward, setup_context=_setup)


def _dgrad_copy_cached(w: Tensor, recipe: Float8Recipe, cache: Fp8WeightCache) -> bool:
    """Whether the forward passes the FP8 dgrad's weight copy (layout 1) from the cache to the op: when the
    backward will run an FP8 dgrad, unless the cache keeps one layout of a blockwise weight (then the backward
    transposes the forward's copy, a transient copy, rather than holding it from the forward on)."""
    if recipe.dgrad != "fp8" or not (w.requires_grad and torch.is_grad_enabled()):
        return False
    if not cache.hold_trainable:  # the backward quantises it (Config.fp8_cache "frozen"), or takes the copy
        return cache.hand_off and recipe.name == "blockwise"  # the forward's pass made ("handoff")
    return cache.keep_transposed or recipe.name != "blockwise"


def fp8_linear(
    x: Tensor,
    w: Tensor,
    bias: Optional[Tensor] = None,
    recipe="blockwise",
    cache: Optional[Fp8WeightCache] = default_cache,
    backend: Optional[str] = None,
) -> Tensor:
    """F.linear(x, w, bias) with its GEMMs in FP8: x [.., K], w [N, K], bias [N] -> [.., N] in x's dtype.

    recipe: a moe8.fp8 recipe name or Float8Recipe (its dgrad / wgrad say which backward GEMMs run in FP8).
    cache: where w's FP8 copy comes from in eager mode (None: quantised at every call, holding no copy
        between calls; under torch.compile always quantised inside the op).
    backend: "moe8" or "scaled_mm" (default: moe8.fp8_rules.dense_backend for x's device).
    """
    recipe = _recipe(recipe)
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x, w: expected x [.., K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if backend is None:
        backend = dense_backend(recipe.name, x.device.type, _capability(x), w.shape[0], w.shape[1])
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
    wq = wt = NO_COPY
    frozen = frozen_fp8(w)
    if frozen is not None:  # stored in FP8 only: its copy (layout 0); the dgrad from its blocks transposed
        if frozen.layout != 0:  # (FP8 dgrad) or dequantised (bf16 dgrad)
            raise ValueError("w: a dense weight stored in FP8 is frozen in layout 0 (freeze_fp8(w, 0))")
        wq, recipe = frozen.value, _blockwise(recipe.dgrad, recipe.wgrad)
    elif cache is not None and not torch.compiler.is_compiling():
        wq = cache.get(w, 0, recipe)
        if _dgrad_copy_cached(w, recipe, cache):
            wt = cache.get(w, 1, recipe)  # the FP8 dgrad's copy, made once per weight version as wq is
    flat = x.dim() == 2  # no reshape (nor its autograd node) when x is [M, K] already
    x2 = (x if flat else x.reshape(-1, x.shape[-1])).to(w.dtype).contiguous()  # [M, K]
    y = _fp8_linear(x2, w, *wq, *wt, code_of(recipe, cache), backend)  # [M, N]; the code names the cache
    y = y if flat else y.view(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias


class Float8Linear(nn.Linear):
    """An nn.Linear whose GEMMs run in FP8 (fp8_linear). convert_to_fp8 swaps the class of existing layers
    in place (parameters, hooks and state_dict keys unchanged); Float8Linear.from_linear does it for one.
    With an `auto` recipe, shapes where FP8 does not pay (moe8.fp8_rules.fp8_pays, dense=True) run F.linear."""

    fp8_recipe: Float8Recipe
    fp8_cache: Optional[Fp8WeightCache]

    @classmethod
    def from_linear(
        cls, m: nn.Linear, recipe="blockwise", cache: Optional[Fp8WeightCache] = default_cache
    ) -> Float8Linear:
        if not isinstance(m, nn.Linear):
            raise TypeError(f"m: expected an nn.Linear, got {type(m).__name__}")
        m.__class__ = cls
        m.fp8_recipe, m.fp8_cache = _recipe(recipe), cache
        return m

    def forward(self, x: Tensor) -> Tensor:
        r = self.fp8_recipe
        rows = x.numel() // max(x.shape[-1], 1)
        frozen = frozen_fp8(self.weight) is not None
        pays = fp8_pays(rows, self.out_features, self.in_features, r.name, dense=True)
        if r.auto and not frozen and not pays:
            return F.linear(x, self.weight, self.bias)
        return fp8_linear(x, self.weight, self.bias, r, self.fp8_cache)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_recipe.name}{' auto' if self.fp8_recipe.auto else ''}"


def module_kind(name: str) -> Optional[str]:
    """The kind of the nn.Linear called `name` in a transformers model: "attention" (q/k/v/o projections),
    "shared_expert", "mlp" (a dense layer's MLP), or None (router, LM head, anything else)."""
    parts = name.split(".")
    leaf, parents = parts[-1], parts[:-1]
    if leaf == "lm_head" or "router" in leaf or leaf.endswith("gate"):  # routers: gate, shared_expert_gate
        return None
    if any("attn" in p or "attention" in p for p in parents):
        return "attention"
    if any(p.startswith("shared_expert") for p in parents):
        return "shared_expert"
    if any(p in ("mlp", "feed_forward", "ffn") for p in parents) and "experts" not in parents:
        return "mlp"
    return None


def layer_index(name: str) -> Optional[int]:
    """i of the first `layers.<i>.` in a module name (None outside the decoder layers)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def convert_to_fp8(
    model: nn.Module,
    recipe="blockwise",
    modules=KINDS,
    skip_first_last: bool = False,
    cache=default_cache,
) -> list:
    """Swap the nn.Linear layers of `model` whose module_kind is in `modules` for Float8Linear (in place);
    returns their names. skip_first_last: the first and the last decoder layer (`layers.<i>.`) stay in the
    model's dtype. cache: an Fp8WeightCache, None, or a Config.fp8_cache name ("frozen": nothing held of a
    weight that trains; "both"; "one" keeps one layout of a dense weight, its dgrad copy the same blocks
    transposed; "none"). Layers already converted are left as they are."""
    recipe = _recipe(recipe)
    if isinstance(cache, str):
        cache = cache_named(cache)
    if isinstance(modules, bool) or not modules:
        raise ValueError(f"modules: expected a non-empty subset of {list(KINDS)}, got {modules!r}")
    try:
        kinds = dense_kinds(modules)
    except ValueError:
        raise ValueError(f"modules: expected a non-empty subset of {list(KINDS)}, got {modules!r}") from None
    if not isinstance(skip_first_last, bool):
        raise ValueError(f"skip_first_last: expected True or False, got {skip_first_last!r}")
    named = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and module_kind(n) in kinds]
    layers = [i for i in (layer_index(n) for n, _ in model.named_modules()) if i is not None]
    ends = {min(layers), max(layers)} if skip_first_last and layers else set()
    done = []
    for name, m in named:
        if layer_index(name) in ends:
            continue
        Float8Linear.from_linear(m, recipe, cache)
        done.append(name)
    return done


def convert_from_fp8(model: nn.Module) -> int:
    """Turn every Float8Linear of `model` back into an nn.Linear; returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, Float8Linear):
            m.__class__ = nn.Linear
            del m.fp8_recipe, m.fp8_cache
            n += 1
    return n


make_direct(globals())  # after every op's registrations (moe8._core: direct calls)

__all__ = [
    "KINDS",
    "Float8Linear",
    "convert_from_fp8",
    "convert_to_fp8",
    "fp8_linear",
    "layer_index",
    "module_kind",
]
