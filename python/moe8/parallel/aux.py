"""moe8.parallel.aux — the load-balancing loss over the global batch of an expert-parallel (or data-parallel)
group: each rank's routing statistics are summed over the group before the loss is formed, so every rank
gets the loss of the concatenated batch. The sums of router probabilities go through an autograd all_reduce
(torch.distributed.nn.functional.all_reduce), so each router gets the gradient of its own tokens' share.

Under a data-parallel gradient average (mean over the group's ranks, as FSDP / DDP do) the router gradient
is then that of the global loss: every rank backpropagates the same loss, the all_reduce's backward sums the
ranks' d loss, and the average divides by the group size again."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor


def _sum(t: Tensor, group, grad: bool) -> Tensor:
    if grad:
        return dist_fn.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def global_load_balancing_loss(
    router_logits: Sequence[Tensor],
    num_experts: int,
    top_k: int,
    group=None,
    attention_mask: Optional[Tensor] = None,
) -> Tensor:
    """transformers' load_balancing_loss_func (Switch aux loss: E * sum_e f_e * P_e over all layers' rows)
    on the group's concatenated batch. router_logits: each layer's [T, E] logits of this rank's tokens (the
    model output's router_logits); attention_mask [B, S] (T = B * S) excludes padding, as transformers' does.
    Collective: every rank of the group calls it, in the same order."""
    dev = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=dev)
    rows = torch.zeros((), dtype=torch.float32, device=dev)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(dev, torch.float32)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)  # [T, E]
        chosen = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        m = torch.ones(p.shape[0], dtype=torch.float32, device=dev) if mask is None else mask
        counts = counts.scatter_add(0, chosen, m.repeat_interleave(top_k))
        probs = probs + (p * m[:, None]).sum(0)
        rows = rows + m.sum()
    stats = _sum(torch.cat([counts, rows[None]]), group, grad=False)
    probs = _sum(probs, group, grad=True)
    return num_experts * ((stats[:num_experts] / stats[-1]) * (probs / stats[-1])).sum()


def global_route_loss(route_out, group=None) -> Tensor:
    """moe8.load_balancing_loss (E * sum_e f_e * P_e, f: share of (token, slot) pairs, P: mean probability)
    of a moe8.route output over the group's concatenated batch."""
    T = route_out.lse.shape[0]
    k_rows = route_out.token_frac.detach() * T  # (token, slot) pairs per expert / K
    stats = _sum(torch.cat([k_rows.float(), k_rows.new_full((1,), T)]), group, grad=False)
    probs = _sum(route_out.prob_mean * T, group, grad=True)
    E = route_out.prob_mean.numel()
    return E * ((stats[:E] / stats[-1]) * (probs / stats[-1])).sum()
