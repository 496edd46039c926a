"""moe8.hf.forward — the forwards moe8 gives transformers' modules: the "moe8" experts function, and the
router and RMSNorm forwards of fused models. Each reads the moe8.Config attached to its module."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from moe8 import _checks as _c
from moe8 import experts as _experts
from moe8 import ops
from moe8.config import Config
from moe8.experts import check_experts_args
from moe8.norm import moe8_norm_pays

from .families import TABLE, experts_spec
from .registry import registry

NAME = "moe8"
_noticed = set()  # experts classes already warned about (once each)


def module_config(module) -> Config:
    """The moe8.Config of the model this module belongs to (attached by enable() / accelerate()); the
    registry's default for a model switched to "moe8" through transformers alone."""
    cfg = getattr(module, "_moe8", None)
    return registry.default if cfg is None else cfg


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The "moe8" entry of ALL_EXPERTS_FUNCTIONS, called as the experts module's forward.

    hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K] -> [T, H] in hidden_states' dtype
    (hidden_states are cast to the experts' dtype and back, as transformers' own experts do). A bad argument
    raises TypeError / ValueError naming it (moe8.experts.check_experts_args).
    """
    spec = experts_spec(self)
    if isinstance(spec, str) and hasattr(self, "gate_up_lora_A"):
        raise RuntimeError(
            f"moe8: {type(self).__name__} carries moe8 expert LoRA but moe8 can't run it: {spec}"
        )
    if isinstance(spec, str):  # never break a model: run transformers' default instead
        if not torch.compiler.is_compiling() and type(self) not in _noticed:
            _noticed.add(type(self))
            warnings.warn(
                f"moe8: {type(self).__name__} runs on transformers' grouped_mm: {spec}", stacklevel=2
            )
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    cfg = module_config(self)
    names = ("hidden_states", "top_k_index", "top_k_weights")
    _c.tensor("hidden_states", hidden_states, 2, "[T, H]")
    _c.floating("hidden_states", hidden_states)  # cast to the experts' dtype below, and the result back
    check_experts_args(hidden_states.to(self.gate_up_proj.dtype), top_k_index, top_k_weights, self.gate_up_proj,
                       self.down_proj, spec.get("layout", "nk"), spec.get("activation", "swiglu"),
                       names=names)  # fmt: skip
    extra = {}
    if self.has_bias:
        extra = dict(gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias)
    if hasattr(self, "gate_up_lora_A"):  # expert LoRA attached by moe8.lora.apply_lora
        extra["lora"] = _experts.ExpertLoRA(
            self.gate_up_lora_A,
            self.gate_up_lora_B,
            self.down_lora_A,
            self.down_lora_B,
            self.lora_scaling,
            self.lora_dropout if self.training else 0.0,
        )
    return _experts.experts_forward(
        hidden_states.to(self.gate_up_proj.dtype),
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        **spec,
        **extra,
        check_ids=cfg.check_ids,  # the model's router picked them with a top-k over the experts: no sync
        config=cfg,
    ).to(hidden_states.dtype)


def _is_moe8(module) -> bool:
    config = getattr(module, "_moe8_config", None)
    return config is not None and config._experts_implementation == NAME


def router_forward(self, hidden_states):
    """The forward of a family's router class while routing is fused (Config.fuse_router). Routers of fused
    models route with moe8.layer.route (the family's `route` in moe8.hf.families), the others run their own
    forward. The router module is still called, so hooks on it (router logits recorded for the aux loss) keep
    working, and its outputs keep their meaning: (router_logits [T, E], top_k_weights [T, K], top_k_index [T, K]
    int32)."""
    if not _is_moe8(self):
        return type(self)._moe8_forward(self, hidden_states)
    return TABLE[self._moe8_config.model_type].route(self, hidden_states)


def norm_forward(self, hidden_states):
    """The forward of a family's RMSNorm class while norms are fused (Config.fuse_norm): one fused kernel
    (fp32 statistics, the weight applied in fp32, one rounding) instead of transformers' chain of elementwise
    passes, forward and backward: torch.nn.functional.rms_norm, or moe8.ops.rms_norm with the module's
    Config(norm_kernel="moe8"), or where it pays under "auto" (moe8.norm.moe8_norm_pays). Norms of other models,
    and inputs whose dtype is not the weight's, run their own forward."""
    if not _is_moe8(self) or hidden_states.dtype != self.weight.dtype:
        return type(self)._moe8_forward(self, hidden_states)
    kernel, cols = module_config(self).norm_kernel, hidden_states.shape[-1]
    rows = hidden_states.numel() // max(cols, 1)
    if kernel == "moe8" or kernel == "auto" and moe8_norm_pays(rows, cols, hidden_states.is_cuda):
        return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def _plain_linear(m) -> bool:
    return type(m) is torch.nn.Linear and m.bias is None


def mlp_forward(self, x):
    """The forward of a family's gated dense MLP class while MLPs are fused (Config.fuse_mlp):
    down(act(gate(x)) * up(x)) as one GEMM on [gate; up] (the weights concatenated per call: their gradients
    flow back through the concatenation) and moe8's SwiGLU kernel (moe8.ops.activation), forward and backward.
    MLPs of other models, with biases, LoRA-wrapped projections or an activation other than SiLU run their
    own forward."""
    from transformers.activations import SiLUActivation

    gate, up = self.gate_proj, self.up_proj
    if (
        not _is_moe8(self)
        or not (_plain_linear(gate) and _plain_linear(up))
        or not isinstance(self.act_fn, (SiLUActivation, torch.nn.SiLU))
        or x.dtype != gate.weight.dtype
    ):
        return type(self)._moe8_forward(self, x)
    h = F.linear(x.reshape(-1, x.shape[-1]), torch.cat([gate.weight, up.weight]))  # [T, 2I]: gate | up
    a = ops.activation(h, ops.ACTIVATIONS["swiglu"], False, 0.0, 0.0)  # [T, I]
    return self.down_proj(a.view(*x.shape[:-1], a.shape[-1]))


def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """transformers' load_balancing_loss_func (Switch Transformer's auxiliary loss, the same in every family moe8
    patches, transformers 5.17) with each layer's top-k counted by scatter_add_ of ones instead of
    torch.bincount, which reads the ids' maximum back to the host (a synchronisation per layer): the same
    float32 counts (whole numbers below 2^24, exact in any order), so the same loss."""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    device = gate_logits[0].device
    tokens_per_expert_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    router_prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    total_rows = 0.0
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer_gate in gate_logits:
        routing_weights = F.softmax(layer_gate.to(device), dim=-1)
        _, selected = torch.topk(routing_weights, top_k, dim=-1)
        picks = selected.reshape(-1)
        if attention_mask is None:
            ones = torch.ones(picks.shape, dtype=torch.float32, device=device)
            counts = torch.zeros(num_experts, dtype=torch.float32, device=device).scatter_add_(0, picks, ones)
            tokens_per_expert_sum = tokens_per_expert_sum + counts
            router_prob_sum = router_prob_sum + routing_weights.float().sum(dim=0)
            total_rows = total_rows + routing_weights.shape[0]
        else:  # as transformers: the counts and sums weighted by the mask (no bincount there)
            counts = torch.zeros(num_experts, dtype=torch.float32, device=device).scatter_add_(
                0, picks, flat_mask.repeat_interleave(top_k)
            )
            tokens_per_expert_sum = tokens_per_expert_sum + counts
            router_prob_sum = router_prob_sum + (routing_weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            total_rows = total_rows + flat_mask.sum()
    tokens_per_expert = tokens_per_expert_sum / total_rows
    router_prob_per_expert = router_prob_sum / total_rows
    overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
    return overall_loss * num_experts
