"""moe8.hf.families — what moe8 knows of each transformers MoE family, in one table: the router and RMSNorm
classes it fuses, whether its attention takes moe8's RoPE, how its router routes, and how its experts module
is laid out. A new family is one more entry here (and its tests in tests/python/test_hf.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch.nn.functional as F


def _route_deepseek(router, hidden_states):
    """fp32 logits; sigmoid + bias, group-limited top-k, renormalise, x scaling."""
    from moe8 import layer

    logits = F.linear(hidden_states.view(-1, router.hidden_dim).float(), router.weight.float())  # [T, E]
    r = layer.route(
        logits,
        router.top_k,
        "sigmoid_group",
        renormalize=router.norm_topk_prob,
        bias=router.e_score_correction_bias,
        n_group=router.num_group,
        topk_group=router.topk_group,
        scaling=router.routed_scaling_factor,
    )
    return logits, r.weights, r.ids


def _route_gpt_oss(router, hidden_states):
    """top-k on the logits, softmax over the k."""
    from moe8 import layer

    logits = F.linear(hidden_states, router.weight, router.bias)  # [T, E]
    r = layer.route(logits, router.top_k, "topk_softmax")
    return logits, r.weights.to(logits.dtype), r.ids


def _route_softmax(router, hidden_states, always_renormalize: bool = False, fp32_weights: bool = False):
    """softmax -> top-k (-> renormalise per norm_topk_prob), weights in the logits' dtype."""
    from moe8 import layer

    logits = F.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight)  # [T, E]
    renormalize = always_renormalize or router.norm_topk_prob
    r = layer.route(logits, router.top_k, "softmax", renormalize=renormalize)
    return logits, r.weights if fp32_weights else r.weights.to(logits.dtype), r.ids


def _route_mixtral(router, hidden_states):
    """Mixtral always renormalises the top-k and keeps fp32 weights."""
    return _route_softmax(router, hidden_states, always_renormalize=True, fp32_weights=True)


def _experts_gpt_oss(experts) -> dict | str:
    """h = x @ gate_up + b: gate = h[..., ::2], up = h[..., 1::2], clamped, (up + 1) * gate * sigmoid(alpha gate)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    layout = (experts.is_transposed, experts.has_bias, experts.is_concatenated)
    if layout != (True, True, False) or type(experts)._apply_gate is not GptOssExperts._apply_gate:
        return f"unexpected GPT-OSS experts {type(experts).__name__}"
    return dict(
        layout="kn",
        activation="swiglu_clamped",
        interleaved=True,
        alpha=float(experts.alpha),
        limit=float(experts.limit),
    )


def _experts_silu_gated(experts) -> dict | str:
    """h = x @ gate_up^T: gate = first I columns, up = last I; act(gate) * up."""
    from torch import nn
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    layout = (experts.is_transposed, experts.has_bias, experts.is_concatenated)
    if layout != (False, False, True) or type(experts)._apply_gate is not _default_apply_gate:
        return f"unexpected experts {type(experts).__name__}"
    if not isinstance(experts.act_fn, (SiLUActivation, nn.SiLU)):
        return f"activation {type(experts.act_fn).__name__} (moe8 runs SiLU-gated experts)"
    return dict(layout="nk", activation="swiglu")


def _config_silu(config) -> Optional[str]:
    if getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return f"hidden_act {config.hidden_act!r} (moe8 runs SiLU-gated experts)"
    return None


@dataclass(frozen=True)
class Family:
    router: str  # the router class (the MoE block's `gate`, GPT-OSS: `router`)
    norm: str  # the RMSNorm class: weight * x / rms(x), statistics in fp32
    rope: bool  # attention calls its modeling module's apply_rotary_pos_emb (rotate-half RoPE)
    route: Callable  # (router module, hidden_states) -> (logits [T, E], top_k_weights [T, K], top_k_index)
    experts: Callable  # experts module -> experts_forward keyword arguments, or why moe8 can't run it
    config_check: Optional[Callable] = _config_silu  # HF config -> None, or why moe8 can't run it
    mlp: Optional[str] = (
        None  # the gated dense MLP class (shared experts, dense layers), if the family has one
    )


# GPT-OSS applies the norm's weight in fp32 before rounding, the others round x / rms(x) to the input dtype
# first; DeepSeek-V3 (MLA, interleaved) and GPT-OSS have their own RoPE.
TABLE = {
    "mixtral": Family("MixtralTopKRouter", "MixtralRMSNorm", True, _route_mixtral, _experts_silu_gated),
    "qwen2_moe": Family(
        "Qwen2MoeTopKRouter", "Qwen2MoeRMSNorm", True, _route_softmax, _experts_silu_gated, mlp="Qwen2MoeMLP"
    ),
    "qwen3_moe": Family(
        "Qwen3MoeTopKRouter", "Qwen3MoeRMSNorm", True, _route_softmax, _experts_silu_gated, mlp="Qwen3MoeMLP"
    ),
    "olmoe": Family(
        "OlmoeTopKRouter", "OlmoeRMSNorm", True, _route_softmax, _experts_silu_gated, mlp="OlmoeMLP"
    ),
    "deepseek_v3": Family(
        "DeepseekV3TopkRouter",
        "DeepseekV3RMSNorm",
        False,
        _route_deepseek,
        _experts_silu_gated,
        mlp="DeepseekV3MLP",
    ),
    "gpt_oss": Family("GptOssTopKRouter", "GptOssRMSNorm", False, _route_gpt_oss, _experts_gpt_oss, None),
}

# config.model_type of the families checked against transformers' own implementation (tests/python/test_hf.py)
FAMILIES = tuple(TABLE)
ROUTERS = {name: f.router for name, f in TABLE.items()}
NORMS = {name: f.norm for name, f in TABLE.items()}
MLPS = {name: f.mlp for name, f in TABLE.items() if f.mlp is not None}
ROPE_FAMILIES = tuple(name for name, f in TABLE.items() if f.rope)
SINK_FAMILIES = ("gpt_oss",)  # attention with per-head sinks, eager in transformers (Config.fuse_attention)


def family_of(module) -> Optional[str]:
    return getattr(getattr(module, "config", None), "model_type", None)


def experts_spec(experts) -> dict | str:
    """How moe8 runs this experts module: keyword arguments of moe8.experts.experts_forward, or why it can't."""
    family = family_of(experts)
    if family not in TABLE:
        return f"model type {family!r} is not one of {list(FAMILIES)}"
    if not getattr(experts, "has_gate", False):
        return "experts without a gate projection"
    return TABLE[family].experts(experts)


def config_supported(config) -> Optional[str]:
    """None when moe8 can run this config's experts, else why not (checked before the model is built)."""
    family = getattr(config, "model_type", None)
    if family not in TABLE:
        return f"model type {family!r} is not one of {list(FAMILIES)}"
    check = TABLE[family].config_check
    return check(config) if check is not None else None


def is_experts_module(m) -> bool:
    """transformers v5's fused experts modules (3D gate_up_proj / down_proj) carry these attributes."""
    return hasattr(m, "has_gate") and hasattr(m, "is_transposed")
