"""moe8.layer — a whole MoE layer: the router's top-k (route), its auxiliary losses, and the experts
(moe8.experts: plan -> permute -> grouped GEMM -> activation -> grouped GEMM -> combine). Every step is a moe8
custom op with its own backward."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from . import _checks as _c
from . import ops
from ._core import choice
from .experts import ExpertLoRA, check_experts_args, dispatch_plan, experts_forward  # noqa: F401


class RouteOut(NamedTuple):
    ids: Tensor  # [T, K] int32
    weights: Tensor  # [T, K] float32
    prob_mean: Tensor  # [E] mean router probability per expert (differentiable)
    token_frac: Tensor  # [E] share of (token, slot) pairs per expert
    lse: Tensor  # [T] logsumexp of the logits (differentiable; z-loss = mean(lse^2))


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
    s = choice("scheme", scheme, ops.SCHEMES)
    _c.tensor("logits", logits, 2, "[T, E]")
    _c.floating("logits", logits)
    k = _c.integer("k", k, 1, logits.shape[1])
    if bias is not None:
        _c.tensor("bias", bias, 1, f"[E] = [{logits.shape[1]}]")
        _c.any_floating("bias", bias)  # cast to float32 by design (the router adds it in fp32)
        _c.same_device("bias", bias, "logits", logits)
        bias = bias.detach().float().contiguous()
    out = ops.route(
        logits.contiguous(), bias, s, int(k), bool(renormalize), int(n_group), int(topk_group), float(scaling)
    )
    return RouteOut(*out)


def _route_out(name: str, r) -> None:
    if not isinstance(r, RouteOut):
        raise TypeError(f"{name}: expected a moe8.RouteOut (what moe8.route returns), got {type(r).__name__}")


def load_balancing_loss(r: RouteOut) -> Tensor:
    """Switch-style aux loss E * sum_e f_e * P_e (f: token fraction, P: mean probability). 0 for 0 tokens
    (both statistics are 0 then)."""
    _route_out("r", r)
    return r.prob_mean.numel() * (r.token_frac * r.prob_mean).sum()


def z_loss(r: RouteOut) -> Tensor:
    """Router z-loss mean_t(logsumexp(logits_t)^2); 0 (not NaN) for 0 tokens, so that an empty micro-batch
    adds nothing."""
    _route_out("r", r)
    return (r.lse**2).sum() / max(r.lse.numel(), 1)


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
    """A whole MoE layer: x [T, H], router_weight [E, H] (x's dtype and device; E = gate_up's experts) ->
    (y [T, H], RouteOut). The ids come from the router's top-k, so they are not range-checked again on a GPU
    (no host sync) unless check_ids=True is passed. Bad arguments: TypeError / ValueError naming them."""
    _c.tensor("x", x, 2, "[T, H]")
    _c.floating("x", x)
    _c.tensor("router_weight", router_weight, 2, "[E, H]")
    _c.same_dtype("router_weight", router_weight, "x", x)
    _c.same_device("router_weight", router_weight, "x", x)
    _c.dim_is("router_weight", router_weight, 1, x.shape[1], "x's hidden size H")
    _c.tensor("gate_up", gate_up, 3, "of expert weights")
    _c.dim_is("router_weight", router_weight, 0, gate_up.shape[0], "gate_up's number of experts E")
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
