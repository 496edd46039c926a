"""moe8.layer — a whole MoE layer composed from the core ops: route -> plan -> permute -> grouped GEMM
-> activation -> grouped GEMM -> combine. Every step is a moe8 custom op with its own backward."""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from . import ops


class RouteOut(NamedTuple):
    ids: Tensor  # [T, K] int32
    weights: Tensor  # [T, K] float32
    prob_mean: Tensor  # [E] mean router probability per expert (differentiable)
    token_frac: Tensor  # [E] share of (token, slot) pairs per expert
    lse: Tensor  # [T] logsumexp of the logits (differentiable; z-loss = mean(lse^2))


def _choice(name: str, value: str, table: dict) -> int:
    if value not in table:
        raise ValueError(f"{name}: expected one of {sorted(table)}, got {value!r}")
    return table[value]


def route(
    logits: Tensor,
    k: int,
    scheme: str = "softmax",
    renormalize: bool = False,
    bias: Optional[Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
) -> RouteOut:
    """Fused router: logits [T, E] -> top-k ids and weights plus the aux-loss statistics.

    scheme "softmax": softmax -> top-k (-> renormalise) [Mixtral, Qwen, OLMoE]; "sigmoid_group": sigmoid
    + bias -> group-limited top-k -> renormalise x scaling [DeepSeek-V3]; "topk_softmax": top-k on the
    logits -> softmax over the k [GPT-OSS].
    """
    s = _choice("scheme", scheme, ops.SCHEMES)
    if bias is not None:
        bias = bias.detach().float().contiguous()
    out = ops.route(
        logits.contiguous(), bias, s, int(k), bool(renormalize), int(n_group), int(topk_group), float(scaling)
    )
    return RouteOut(*out)


def load_balancing_loss(r: RouteOut) -> Tensor:
    """Switch-style aux loss E * sum_e f_e * P_e (f: token fraction, P: mean probability)."""
    return r.prob_mean.numel() * (r.token_frac * r.prob_mean).sum()


def z_loss(r: RouteOut) -> Tensor:
    return (r.lse**2).mean()


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
    E, n, kd = (w.shape[0], w.shape[2], w.shape[1]) if kn else tuple(w.shape)
    r = A.shape[2 if kn else 1] if A.dim() == 3 else -1
    want = ((E, kd, r), (E, r, n)) if kn else ((E, r, kd), (E, n, r))
    if (tuple(A.shape), tuple(B.shape)) != want:
        raise ValueError(
            f"lora.{name}_A, lora.{name}_B: expected shapes {want[0]}, {want[1]} for {name} "
            f"{tuple(w.shape)}, got {tuple(A.shape)}, {tuple(B.shape)}"
        )


# Expert LoRA: add the B projection to the base GEMM's output in one pass (ops.grouped_lowrank_add) instead
# of a grouped GEMM and an add. Off by default: on the H200 its register kernel is 1.04-1.06x the unfused
# pair at rank 16 but 0.6x at rank 32 (bench/bench_lowrank.py, bench/results/lora_30b_h200.md);
# bench_lora_30b.py --moe8-fuse ...,lora_add measures the whole step with it.
FUSED_LORA_ADD = False

# The experts' backward writes d h over the gate_up output h (ops.activation_consuming): one [R, 2I] buffer
# less at the backward's peak, the same bits (H200, 16,384 tokens: Mixtral-8x7B layer peak 4.75 -> 4.13 GiB
# in bf16, 5.88 -> 4.13 GiB with FP8 blockwise; time unchanged; bench/results/layer_h200.md). The cost: the
# graph's saved h is used up, so a second backward through the same graph (retain_graph=True) raises
# instead of reading the overwritten h; set False for that.
CONSUME_GATE_UP = True

# The down projection, activation and combine as one op (ops.activation_down_combine) when the down
# projection has no bias and no LoRA: the rows of dy are gathered unweighted, the routing weights applied in
# the activation's backward, which also gives their gradient from d act (<act(h), dy W^T> = <o, dy>) and
# recomputes the activations in the same pass. The expert outputs o [R, H] are no longer kept for the
# backward, and one pass over h and the separate weights-gradient pass are saved. False (or
# MOE8_ROUTED_DOWN=0 in the environment): the separate ops (activation_grouped_gemm, then combine), as before.
ROUTED_DOWN = os.environ.get("MOE8_ROUTED_DOWN", "1") != "0"


def _plus_low_rank(
    c: Tensor, x: Tensor, A: Tensor, B: Tensor, offsets: Tensor, lay: int, lora: ExpertLoRA
) -> Tensor:
    """c + scaling * (dropout(x)·A[e])·B[e] per expert: x [R, K] -> [R, r] -> [R, N], added to c [R, N]."""
    if lora.dropout:
        x = torch.nn.functional.dropout(x, lora.dropout)
    t = ops.grouped_gemm(x, A.to(x.dtype).contiguous(), offsets, lay, None)  # [R, r]
    t = lora.scaling * t  # scaling on the thin tensor
    B = B.to(x.dtype).contiguous()
    if FUSED_LORA_ADD:
        return ops.grouped_lowrank_add(c, t, B, offsets, lay)
    return c + ops.grouped_gemm(t, B, offsets, lay, None)


def check_experts_args(x, ids, weights, gate_up, down, layout: str, activation: str) -> tuple[int, int]:
    """The checks every experts_forward makes (ValueError naming the argument); returns the layout and
    activation codes."""
    lay = _choice("layout", layout, ops.LAYOUTS)
    act = _choice("activation", activation, ops.ACTIVATIONS)
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-d tensor [T, H], got shape {tuple(x.shape)}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids: expected shape [{x.shape[0]}, K], got {tuple(ids.shape)}")
    if weights.shape != ids.shape:
        raise ValueError(
            f"weights: expected shape {tuple(ids.shape)} (same as ids), got {tuple(weights.shape)}"
        )
    if gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(
            f"gate_up, down: expected 3-d expert weights, got {tuple(gate_up.shape)}, {tuple(down.shape)}"
        )
    return lay, act


def dispatch_plan(x: Tensor, ids: Tensor, gate_up: Tensor, pad_multiple: int = 1, check_ids: bool = True):
    """x in the experts' dtype, top-k, and the plan of rows in expert order: (x, k, offsets, row_to_slot,
    slot_to_row)."""
    _, offsets, row_to_slot, slot_to_row = ops.plan(
        ids.to(torch.int32).contiguous(), gate_up.shape[0], pad_multiple, check_ids
    )
    return x.to(gate_up.dtype).contiguous(), ids.shape[1], offsets, row_to_slot, slot_to_row


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
    check_ids: bool = True,
) -> Tensor:
    """y[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), accumulated in fp32.

    x [T, H]; ids [T, K] int; weights [T, K]; layout "nk": gate_up [E, 2I, H], down [E, H, I] (HF);
    layout "kn": gate_up [E, H, 2I], down [E, I, H] (GPT-OSS). Ungated activations use gate_up [E, I, H].
    lora: low-rank updates of gate_up and down (ExpertLoRA), computed through the grouped GEMM.
    fp8: None (bf16) or an FP8 recipe ("blockwise", "rowwise", "tensorwise" or a moe8.fp8.Float8Recipe)
    for the forward expert GEMMs; see moe8.fp8_layer.experts_forward_fp8.
    check_ids: range-check ids on the device (a host sync on CUDA, which also keeps the call out of CUDA
    graphs); pass False for ids from a top-k over the experts' scores, as the HF integration does.
    """
    lay, act = check_experts_args(x, ids, weights, gate_up, down, layout, activation)
    if fp8 is not None:
        if lora is not None:
            raise ValueError("fp8: FP8 experts with LoRA are not supported yet; pass fp8=None with lora")
        from .fp8_layer import experts_forward_fp8

        return experts_forward_fp8(
            x,
            ids,
            weights,
            gate_up,
            down,
            recipe=fp8,
            layout=layout,
            activation=activation,
            interleaved=interleaved,
            gate_up_bias=gate_up_bias,
            down_bias=down_bias,
            alpha=alpha,
            limit=limit,
            check_ids=check_ids,
        )
    if lora is not None:
        _check_lora("gate_up", gate_up, lora.gate_up_A, lora.gate_up_B, lay == 1)
        _check_lora("down", down, lora.down_A, lora.down_B, lay == 1)
    x, k, offsets, row_to_slot, slot_to_row = dispatch_plan(x, ids, gate_up, check_ids=check_ids)
    xp = ops.permute(x, row_to_slot, slot_to_row, k)  # [R, H]
    h = ops.grouped_gemm(xp, gate_up.contiguous(), offsets, lay, _bias(gate_up_bias))  # [R, 2I]
    if lora is not None:
        h = _plus_low_rank(h, xp, lora.gate_up_A, lora.gate_up_B, offsets, lay, lora)
    act_args = (act, bool(interleaved), float(alpha), float(limit))
    w = weights.float().contiguous()
    if ROUTED_DOWN and lora is None and down_bias is None:  # neither activations nor expert outputs kept
        return ops.activation_down_combine(
            h, down.contiguous(), offsets, lay, w, slot_to_row, row_to_slot, *act_args, CONSUME_GATE_UP
        )
    if lora is None:  # the activations [R, I] are recomputed in the backward, not kept
        o = ops.activation_grouped_gemm(
            h, down.contiguous(), offsets, lay, _bias(down_bias), *act_args, consume_h=CONSUME_GATE_UP
        )
    else:  # the LoRA branch keeps them anyway
        a = (ops.activation_consuming if CONSUME_GATE_UP else ops.activation)(h, *act_args)  # [R, I]
        o = ops.grouped_gemm(a, down.contiguous(), offsets, lay, _bias(down_bias))  # [R, H]
        o = _plus_low_rank(o, a, lora.down_A, lora.down_B, offsets, lay, lora)
    return ops.combine(o, w, slot_to_row, row_to_slot)  # [T, H]


def _bias(b: Optional[Tensor]) -> Optional[Tensor]:
    return None if b is None else b.contiguous()


def moe_forward(
    x: Tensor,
    router_weight: Tensor,
    gate_up: Tensor,
    down: Tensor,
    k: int,
    scheme: str = "softmax",
    renormalize: bool = False,
    router_bias: Optional[Tensor] = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling: float = 1.0,
    **expert_kwargs,
) -> tuple[Tensor, RouteOut]:
    """A whole MoE layer: x [T, H], router_weight [E, H] -> (y [T, H], RouteOut). The ids come from the
    router's top-k, so they are not range-checked again (no host sync) unless check_ids=True is passed."""
    logits = x @ router_weight.t()  # [T, E]
    r = route(logits, k, scheme, renormalize, router_bias, n_group, topk_group, scaling)
    expert_kwargs.setdefault("check_ids", False)
    return experts_forward(x, r.ids, r.weights, gate_up, down, **expert_kwargs), r


class MoELayer(nn.Module):
    """A standalone MoE block with HF-layout parameters: router [E, H], gate_up [E, 2I, H], down [E, H, I]."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        k: int,
        scheme: str = "softmax",
        renormalize: bool = True,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        f = dict(dtype=dtype, device=device)
        self.k, self.scheme, self.renormalize = k, scheme, renormalize
        self.router = nn.Parameter(torch.randn(num_experts, hidden, **f) * hidden**-0.5)
        self.gate_up = nn.Parameter(torch.randn(num_experts, 2 * intermediate, hidden, **f) * hidden**-0.5)
        self.down = nn.Parameter(torch.randn(num_experts, hidden, intermediate, **f) * intermediate**-0.5)

    def forward(self, x: Tensor) -> tuple[Tensor, RouteOut]:
        shape = x.shape
        y, r = moe_forward(
            x.reshape(-1, shape[-1]),
            self.router,
            self.gate_up,
            self.down,
            self.k,
            self.scheme,
            self.renormalize,
        )
        return y.view(shape), r
