"""moe8.experts — the experts of an MoE layer, one pipeline for every GEMM precision:

    plan -> permute -> gate_up GEMM (+ LoRA) -> activation + down GEMM (+ LoRA) -> combine

in expert order, deterministic (no atomics). The GEMM precision is a strategy (moe8.precision: bf16, or an
FP8 recipe with its weight cache) that the fused ops (moe8.fused) take as a parameter; what else varies
(routed down projection, consumed gate_up output, fused LoRA add, id checks) comes from the moe8.Config.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import _checks as _c
from . import fused, ops
from ._core import ACTIVATIONS, LAYOUTS, choice
from .config import DEFAULT, Config
from .fp8 import frozen_fp8
from .precision import BF16, Precision, for_shape, precision


class ExpertLoRA(NamedTuple):
    """Low-rank updates of the expert weights, stored in the layout of the base weights:
    "nk": W[e] + scaling * B[e]·A[e]; "kn": W[e] + scaling * A[e]·B[e]. Either way A maps the GEMM's input
    to r and B maps r to its output, so the update runs as two thin grouped GEMMs, (x·A)·B, no B·A made."""

    gate_up_A: Tensor  # nk [E, r, H]   kn [E, H, r]
    gate_up_B: Tensor  # nk [E, 2I, r]  kn [E, r, 2I]
    down_A: Tensor  # nk [E, r, I]   kn [E, I, r]
    down_B: Tensor  # nk [E, H, r]   kn [E, r, H]
    scaling: float
    dropout: float = 0.0  # on the LoRA branch's input only; pass 0 in eval


def _check_lora(name: str, w: Tensor, A: Tensor, B: Tensor, kn: bool) -> None:
    for part, t in (("A", A), ("B", B)):
        _c.tensor(f"lora.{name}_{part}", t, 3, "of expert factors")
        _c.floating(f"lora.{name}_{part}", t)  # cast to the weights' dtype, as documented on ExpertLoRA
        _c.same_device(f"lora.{name}_{part}", t, name, w)
    E, n, kd = (w.shape[0], w.shape[2], w.shape[1]) if kn else tuple(w.shape)
    r = A.shape[2 if kn else 1] if A.dim() == 3 else -1
    want = ((E, kd, r), (E, r, n)) if kn else ((E, r, kd), (E, n, r))
    if (tuple(A.shape), tuple(B.shape)) != want:
        raise ValueError(
            f"lora.{name}_A, lora.{name}_B: expected shapes {want[0]}, {want[1]} for {name} "
            f"{tuple(w.shape)}, got {tuple(A.shape)}, {tuple(B.shape)}"
        )


def _plus_low_rank(
    c: Tensor, x: Tensor, A: Tensor, B: Tensor, offsets: Tensor, lay: int, lora: ExpertLoRA, fused_add: bool
) -> Tensor:
    """c + scaling * (dropout(x)·A[e])·B[e] per expert: x [R, K] -> [R, r] -> [R, N], added to c [R, N]."""
    if lora.dropout:
        x = torch.nn.functional.dropout(x, lora.dropout)
    t = ops.grouped_gemm(x, A.to(x.dtype).contiguous(), offsets, lay, None)  # [R, r]
    t = lora.scaling * t  # scaling on the thin tensor
    B = B.to(x.dtype).contiguous()
    if fused_add:
        return ops.grouped_lowrank_add(c, t, B, offsets, lay)
    return c + ops.grouped_gemm(t, B, offsets, lay, None)


_MAX_EXPERTS = 512  # csrc/api/ops.cpp's kMaxExperts: the plan's per-block histograms


def check_experts_args(
    x,
    ids,
    weights,
    gate_up,
    down,
    layout: str,
    activation: str,
    gate_up_bias=None,
    down_bias=None,
    names: tuple = ("x", "ids", "weights"),
) -> tuple[int, int]:
    """The checks every experts_forward makes (TypeError / ValueError naming the argument, expected vs
    actual; see moe8._checks); returns the layout and activation codes. No values are read here. names: what
    the caller calls x, ids and weights."""
    nx, nids, nw = names
    lay = choice("layout", layout, LAYOUTS)
    act = choice("activation", activation, ACTIVATIONS)
    _c.tensor(nx, x, 2, "[T, H]")
    _c.floating(nx, x)
    _c.tensor(nids, ids, 2, "[T, K]")
    _c.index_dtype(nids, ids)
    if ids.shape[0] != x.shape[0] or (ids.shape[1] < 1 and ids.shape[0] > 0):
        raise ValueError(
            f"{nids}: expected shape [{x.shape[0]}, K] ({nx}'s T, K >= 1), got {list(ids.shape)}"
        )
    _c.tensor(nw, weights)
    _c.any_floating(nw, weights)  # cast to float32 by design: the sum is accumulated in fp32
    if weights.shape != ids.shape:
        raise ValueError(
            f"{nw}: expected shape {list(ids.shape)} (same as {nids}), got {list(weights.shape)}"
        )
    _c.tensor("gate_up", gate_up, 3, "of expert weights")
    _c.tensor("down", down, 3, "of expert weights")
    if gate_up.dtype == down.dtype:  # weights of one dtype: a wrong one is theirs, not x's
        _c.floating("gate_up", gate_up)
    _c.one_dtype((nx, x), ("gate_up", gate_up), ("down", down))
    E, H = gate_up.shape[0], x.shape[1]
    if not 1 <= E <= _MAX_EXPERTS:
        raise ValueError(
            f"gate_up: expected 1..{_MAX_EXPERTS} experts (dim 0), got shape {list(gate_up.shape)}"
        )
    _c.dim_is("down", down, 0, E, "gate_up's number of experts")
    n_up = gate_up.shape[1] if lay == 0 else gate_up.shape[2]  # 2I (gated) or I
    _c.dim_is("gate_up", gate_up, 2 if lay == 0 else 1, H, f"{nx}'s hidden size H")
    gated = act in (0, 1)
    if gated and n_up % 2:
        raise ValueError(f"gate_up: a gated activation expects an even 2I, got shape {list(gate_up.shape)}")
    inter = n_up // 2 if gated else n_up
    _c.dim_is("down", down, 1 if lay == 0 else 2, H, f"{nx}'s hidden size H")
    _c.dim_is("down", down, 2 if lay == 0 else 1, inter, "gate_up's intermediate size I")
    for name, t, n in (("gate_up_bias", gate_up_bias, n_up), ("down_bias", down_bias, H)):
        if t is not None:
            _c.tensor(name, t, 2, f"[E, {n}]")
            _c.any_floating(name, t)
            if list(t.shape) != [E, n]:
                raise ValueError(f"{name}: expected shape [{E}, {n}], got {list(t.shape)}")
    for name, t in ((nids, ids), (nw, weights), ("gate_up", gate_up), ("down", down)):
        _c.same_device(name, t, nx, x)
    for name, t in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if t is not None:
            _c.same_device(name, t, nx, x)
    return lay, act


def _dense(w: Tensor) -> Tensor:
    """w with any strides (a transposed or sliced view) as the kernels read it: contiguous, through autograd,
    so its gradient reaches the caller's tensor in the caller's shape. A weight stored in FP8 only
    (moe8.fp8.freeze_fp8: a zero-stride placeholder) stays as it is: its GEMMs read the FP8 copy."""
    return w if w.is_contiguous() or frozen_fp8(w) is not None else w.contiguous()


def dispatch_plan(
    x: Tensor,
    ids: Tensor,
    gate_up: Tensor,
    pad_multiple: int = 1,
    check_ids: bool = True,
    ids_name: str = "ids",
):
    """x (contiguous), top-k, and the plan of rows in expert order: (x, k, offsets, row_to_slot, slot_to_row).
    The ids' values are checked as moe8._checks.ids says (on the host always, on a GPU when check_ids)."""
    ids = _c.ids(ids_name, ids, gate_up.shape[0], check_ids)
    traced_check = check_ids and torch.compiler.is_compiling()  # then the plan's own check (see _checks.ids)
    _, offsets, row_to_slot, slot_to_row = ops.plan(ids, gate_up.shape[0], pad_multiple, traced_check)
    return x.contiguous(), ids.shape[1], offsets, row_to_slot, slot_to_row


def experts_forward(
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    gate_up: Tensor,
    down: Tensor,
    *,
    layout: str = "nk",
    activation: str = "swiglu",
    interleaved: bool = False,
    gate_up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
    alpha: float = 1.702,
    limit: float = 7.0,
    lora: Optional[ExpertLoRA] = None,
    fp8=None,
    check_ids: Optional[bool] = None,
    config: Optional[Config] = None,
) -> Tensor:
    """y[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), accumulated in fp32.

    x [T, H] float32 / float16 / bfloat16, the dtype of gate_up and down (never cast: another dtype is a
    TypeError); ids [T, K] any integer dtype, values in [0, E); weights [T, K] any float dtype (cast to float32,
    where the sum is accumulated); layout "nk": gate_up [E, 2I, H], down [E, H, I] (HF);
    layout "kn": gate_up [E, H, 2I], down [E, I, H] (GPT-OSS). Ungated activations use gate_up [E, I, H].
    lora: low-rank updates of gate_up and down (ExpertLoRA), computed through the grouped GEMM.
    fp8: the expert GEMMs' precision when not the config's: None (config.fp8), "none", an FP8 recipe
    ("blockwise", "rowwise", "tensorwise", a moe8.fp8.Float8Recipe) or a moe8.precision strategy (e.g.
    Fp8Gemms("blockwise", cache=None) to quantise the weights at every call).
    check_ids: range-check ids on the GPU (a host sync on CUDA, which also keeps the call out of CUDA
    graphs); default True here, config.check_ids when a config is passed; pass False for ids from a top-k.
    Unsafe only in what it computes: unchecked ids out of range on a GPU join no expert (their slots add
    nothing), never a read or write outside a tensor. Ids on the CPU are always checked (no sync there).
    Every bad argument raises TypeError (dtype) or ValueError (shape, device, value) naming it.
    config: a moe8.Config (routed_down, consume_gate_up, keep_permuted, gather_in_gemm, fused_act_dgrad,
    fused_act_forward, fused_lora_add, fp8, check_ids); default moe8.config.DEFAULT.
    """
    if check_ids is None:
        check_ids = True if config is None else config.check_ids
    cfg = DEFAULT if config is None else config
    prec = precision(cfg.fp8 if fp8 is None else fp8, cfg.fp8_cache)
    lay, act = check_experts_args(x, ids, weights, gate_up, down, layout, activation, gate_up_bias, down_bias)
    gate_up, down = _dense(gate_up), _dense(down)
    if lora is not None:  # the adapters' GEMMs run in x's dtype, whatever the base GEMMs' precision
        _check_lora("gate_up", gate_up, lora.gate_up_A, lora.gate_up_B, lay == 1)
        _check_lora("down", down, lora.down_A, lora.down_B, lay == 1)
    prec, prec_down = _precisions(prec, x.shape[0] * ids.shape[1], gate_up, down, lay)
    pad = max(prec.pad_multiple, prec_down.pad_multiple)
    x, k, offsets, row_to_slot, slot_to_row = dispatch_plan(x, ids, gate_up, pad, check_ids)
    if lora is None and not cfg.keep_permuted:  # the backward keeps x, not its [R, H] rows in expert order
        # the activation in the up projection's epilogue, handed to activation_down_combine (routed_down, bf16)
        swiglu_next = (
            cfg.fused_act_forward
            and cfg.routed_down
            and down_bias is None
            and act == ops.ACTIVATIONS["swiglu"]
            and not interleaved
            and prec is BF16
            and prec_down is BF16
        )
        h = fused.gathered_linear(
            x,
            gate_up,
            offsets,
            lay,
            gate_up_bias,
            row_to_slot,
            k,
            slot_to_row,
            prec,
            cfg.gather_in_gemm,
            swiglu_next,
        )
    else:  # the LoRA branch reads the rows too
        x_rows = (x, row_to_slot, k, slot_to_row)  # xp's rows: x gathered (FP8 blockwise quantises from x)
        xp = _permuted(x, x_rows, prec, (weights, gate_up, down, gate_up_bias, down_bias, lora))  # [R, H]
        h = fused.expert_linear(xp, gate_up, offsets, lay, gate_up_bias, prec, x_rows)  # [R, 2I]
    if lora is not None:
        h = _plus_low_rank(h, xp, lora.gate_up_A, lora.gate_up_B, offsets, lay, lora, cfg.fused_lora_add)
    act_args = (act, bool(interleaved), float(alpha), float(limit))
    w = weights.float().contiguous()  # [T, K]
    consume = cfg.consume_gate_up
    if cfg.routed_down and lora is None and down_bias is None:  # neither activations nor expert outputs kept
        # the up projection's FP8 blockwise dgrad reads d h exactly as the down projection's backward writes it:
        # quantised on the way there (without a bias between them, whose backward would make a new tensor)
        r = getattr(prec, "recipe", None)
        dh_codes = (
            r is not None
            and r.name == "blockwise"
            and r.dgrad == "fp8"
            and gate_up_bias is None
            and x.requires_grad
            and torch.is_grad_enabled()
        )
        return fused.activation_down_combine(
            h,
            down,
            offsets,
            lay,
            w,
            slot_to_row,
            row_to_slot,
            *act_args,
            consume,
            prec_down,
            cfg.fused_act_dgrad,
            dh_codes,
        )
    if lora is None:  # the activations [R, I] are recomputed in the backward, not kept
        o = fused.activation_linear(h, down, offsets, lay, down_bias, *act_args, consume, prec_down)
    else:  # the LoRA branch keeps them anyway
        a = (ops.activation_consuming if consume else ops.activation)(h, *act_args)  # [R, I]
        o = fused.expert_linear(a, down, offsets, lay, down_bias, prec_down)  # [R, H]
        o = _plus_low_rank(o, a, lora.down_A, lora.down_B, offsets, lay, lora, cfg.fused_lora_add)
    return ops.combine(o, w, slot_to_row, row_to_slot)  # [T, H]


def _precisions(prec: Precision, slots: int, gate_up: Tensor, down: Tensor, lay: int) -> tuple:
    """(gate_up's, down's precision): prec for both, unless its recipe is auto (moe8.precision.for_shape, with
    the rows per expert of balanced routing, slots / E)."""
    rows = slots // max(gate_up.shape[0], 1)

    def nk(w):  # (N, K) of the GEMM c = a . op(w[e])
        return (w.shape[1], w.shape[2]) if lay == 0 else (w.shape[2], w.shape[1])

    return for_shape(prec, rows, *nk(gate_up), gate_up), for_shape(prec, rows, *nk(down), down)


def _permuted(x: Tensor, x_rows: tuple, prec: Precision, others: tuple) -> Tensor:
    """x's rows in expert order (ops.permute), unless nothing will read them: without autograd the FP8
    blockwise GEMM quantises its rows straight from x (x stands in for them, read only for its dtype). The
    LoRA branch reads them."""
    if getattr(prec, "name", None) == "blockwise" and others[5] is None:
        tensors = [x, *others[:5]]
        if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)):
            return x
    return ops.permute(*x_rows[:2], x_rows[3], x_rows[2])
