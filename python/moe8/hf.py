"""Hugging Face transformers (>= 5) integration: run the experts of MoE models on moe8.

    import moe8
    moe8.enable()            # supported MoE models built from now on run their experts on moe8
    moe8.accelerate(model)   # or switch one model that already exists
    moe8.disable()           # back to transformers' own experts implementation

transformers v5 fuses each MoE layer's experts into one module with 3D parameters (`gate_up_proj`,
`down_proj`, GPT-OSS also biases) and looks its forward up by name in `ALL_EXPERTS_FUNCTIONS`, from
`config._experts_implementation`. moe8 registers itself there as "moe8": the router, the parameters,
their names and the state_dict stay HF's, so hooks (router logits for the aux loss), save_pretrained /
from_pretrained, gradient checkpointing and PEFT `target_parameters` LoRA keep working.

transformers is imported lazily: importing this module does not need it.
"""

from __future__ import annotations

import inspect
import warnings
import weakref

import torch
import torch.nn.functional as F

NAME = "moe8"
# config.model_type of the families checked against transformers' own implementation (tests/python/test_hf.py)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")

_state = {
    "families": frozenset(),
    "default": False,
    "deterministic": True,
    "fuse_router": False,
    "fuse_norm": False,
    "fuse_loss": False,
    "fp8": None,  # FP8 recipe for the expert GEMMs (moe8.fp8), None: bf16
    "kwargs": {},
    "check": None,
    "post_init": None,
}
_switched = {}  # id(config) -> (weakref to the config, experts implementation to restore on disable())
_fused = weakref.WeakSet()  # routers and norms running moe8's forward (they carry `_moe8_config`)
_loss_fused = weakref.WeakSet()  # causal LMs whose training loss moe8.loss computes (fuse_loss)
_patched_classes = set()  # router / norm classes whose forward is moe8's (their own kept as `_moe8_forward`)
# the router class of each family (the MoE block's `gate`, GPT-OSS: `router`)
ROUTERS = {
    "mixtral": "MixtralTopKRouter",
    "qwen2_moe": "Qwen2MoeTopKRouter",
    "qwen3_moe": "Qwen3MoeTopKRouter",
    "olmoe": "OlmoeTopKRouter",
    "deepseek_v3": "DeepseekV3TopkRouter",
    "gpt_oss": "GptOssTopKRouter",
}
# the RMSNorm class of each family: weight * x / rms(x), statistics in fp32 (GPT-OSS applies the weight in
# fp32 before rounding, the others round x / rms(x) to the input dtype first)
NORMS = {
    "mixtral": "MixtralRMSNorm",
    "qwen2_moe": "Qwen2MoeRMSNorm",
    "qwen3_moe": "Qwen3MoeRMSNorm",
    "olmoe": "OlmoeRMSNorm",
    "deepseek_v3": "DeepseekV3RMSNorm",
    "gpt_oss": "GptOssRMSNorm",
}
# families whose attention calls their modeling module's apply_rotary_pos_emb (rotate_half RoPE); DeepSeek-V3
# (MLA, interleaved) and GPT-OSS have their own
ROPE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_rope_patched = {}  # modeling module -> its own apply_rotary_pos_emb, while moe8's replaces it
_noticed = set()


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "moe8's Hugging Face integration needs transformers>=5: pip install 'transformers>=5'"
        ) from e
    if int(transformers.__version__.split(".")[0]) < 5:
        raise ImportError(
            f"moe8's Hugging Face integration needs transformers>=5 (fused 3D experts and ALL_EXPERTS_FUNCTIONS); "
            f"found transformers {transformers.__version__}"
        )
    return transformers


def _families(families) -> frozenset:
    if families is None:
        return frozenset(FAMILIES)
    families = [families] if isinstance(families, str) else list(families)
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"moe8: unknown families {unknown}; supported: {list(FAMILIES)}")
    return frozenset(families)


def _spec(experts) -> dict | str:
    """How moe8 runs this experts module: keyword arguments of layer.experts_forward, or why it can't."""
    from torch import nn
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    family = getattr(getattr(experts, "config", None), "model_type", None)
    if family not in FAMILIES:
        return f"model type {family!r} is not one of {list(FAMILIES)}"
    if not getattr(experts, "has_gate", False):
        return "experts without a gate projection"
    layout = (experts.is_transposed, experts.has_bias, experts.is_concatenated)
    apply_gate = type(experts)._apply_gate
    if family == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        # h = x @ gate_up + b: gate = h[..., ::2], up = h[..., 1::2], clamped, (up + 1) * gate * sigmoid(alpha gate)
        if layout != (True, True, False) or apply_gate is not GptOssExperts._apply_gate:
            return f"unexpected GPT-OSS experts {type(experts).__name__}"
        return dict(
            layout="kn",
            activation="swiglu_clamped",
            interleaved=True,
            alpha=float(experts.alpha),
            limit=float(experts.limit),
        )
    # h = x @ gate_up^T: gate = first I columns, up = last I; act(gate) * up
    if layout != (False, False, True) or apply_gate is not _default_apply_gate:
        return f"unexpected experts {type(experts).__name__}"
    if not isinstance(experts.act_fn, (SiLUActivation, nn.SiLU)):
        return f"activation {type(experts.act_fn).__name__} (moe8 runs SiLU-gated experts)"
    return dict(layout="nk", activation="swiglu")


def _layer_kwargs() -> dict:
    from moe8 import layer

    params = inspect.signature(layer.experts_forward).parameters
    return {"deterministic": _state["deterministic"]} if "deterministic" in params else {}


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The "moe8" entry of ALL_EXPERTS_FUNCTIONS, called as the experts module's forward.

    hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K] -> [T, H] in hidden_states' dtype.
    """
    spec = _spec(self)
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
    from moe8 import layer

    extra = {}
    if self.has_bias:
        extra = dict(gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias)
    if hasattr(self, "gate_up_lora_A"):  # expert LoRA attached by moe8.lora.apply_lora
        extra["lora"] = layer.ExpertLoRA(
            self.gate_up_lora_A,
            self.gate_up_lora_B,
            self.down_lora_A,
            self.down_lora_B,
            self.lora_scaling,
            self.lora_dropout if self.training else 0.0,
        )
    if _state["fp8"] is not None and "lora" not in extra:  # FP8 experts with LoRA are not supported yet
        extra["fp8"] = _state["fp8"]
    return layer.experts_forward(
        hidden_states,
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        **spec,
        **extra,
        **_state["kwargs"],
        check_ids=False,  # the model's router picked them with a top-k over the experts: no device sync
    ).to(hidden_states.dtype)


def _set_fp8(fp8) -> None:
    if fp8 == "none":  # the spelling of "off" in configs and flags
        fp8 = None
    if fp8 is not None:
        from moe8.fp8 import Float8Recipe, _recipe

        fp8 = fp8 if isinstance(fp8, Float8Recipe) else _recipe(fp8).name  # raises on an unknown recipe
    _state["fp8"] = fp8


def router_forward(self, hidden_states):
    """The forward of a family's router class while routing is fused (fuse_router=True). Routers of fused
    models route with moe8.layer.route, the others run their own forward. The router module is still called,
    so hooks on it (router logits recorded for the aux loss) keep working, and its outputs keep their meaning:
    (router_logits [T, E], top_k_weights [T, K], top_k_index [T, K] int32)."""
    config = getattr(self, "_moe8_config", None)
    if config is None or config._experts_implementation != NAME:
        return type(self)._moe8_forward(self, hidden_states)
    from moe8 import layer

    family = config.model_type
    if family == "deepseek_v3":  # fp32 logits; sigmoid + bias, group-limited top-k, renormalise, x scaling
        logits = F.linear(hidden_states.view(-1, self.hidden_dim).float(), self.weight.float())  # [T, E]
        r = layer.route(
            logits,
            self.top_k,
            "sigmoid_group",
            renormalize=self.norm_topk_prob,
            bias=self.e_score_correction_bias,
            n_group=self.num_group,
            topk_group=self.topk_group,
            scaling=self.routed_scaling_factor,
        )
        return logits, r.weights, r.ids
    if family == "gpt_oss":  # top-k on the logits, softmax over the k
        logits = F.linear(hidden_states, self.weight, self.bias)  # [T, E]
        r = layer.route(logits, self.top_k, "topk_softmax")
        return logits, r.weights.to(logits.dtype), r.ids
    # Mixtral always renormalises the top-k and keeps fp32 weights; Qwen / OLMoE per norm_topk_prob, in logits' dtype
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)  # [T, E]
    mixtral = family == "mixtral"
    r = layer.route(logits, self.top_k, "softmax", renormalize=mixtral or self.norm_topk_prob)
    return logits, r.weights if mixtral else r.weights.to(logits.dtype), r.ids


def norm_forward(self, hidden_states):
    """The forward of a family's RMSNorm class while norms are fused (fuse_norm=True): one fused kernel
    (torch.nn.functional.rms_norm: fp32 statistics, the weight applied in fp32, one rounding) instead of
    transformers' chain of elementwise passes, forward and backward. Norms of other models, and inputs whose
    dtype is not the weight's, run their own forward."""
    config = getattr(self, "_moe8_config", None)
    if config is None or config._experts_implementation != NAME or hidden_states.dtype != self.weight.dtype:
        return type(self)._moe8_forward(self, hidden_states)
    return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def _fuse(model, classes: dict, forward) -> None:
    """Give every module of model whose class is classes[model_type] moe8's forward (patched on the class,
    switched on per module by `_moe8_config`)."""
    config = model.config
    name = classes.get(getattr(config, "model_type", None))
    for m in model.modules():
        cls = type(m)
        if cls.__name__ != name:
            continue
        if cls not in _patched_classes:
            cls._moe8_forward, cls.forward = cls.forward, forward
            _patched_classes.add(cls)
        m._moe8_config = config  # a plain attribute: not in state_dict; deepcopy and pickle keep it right
        _fused.add(m)


def _fuse_routers(model) -> None:
    _fuse(model, ROUTERS, router_forward)


def _fuse_norms(model) -> None:
    _fuse(model, NORMS, norm_forward)


def _fuse_rope(families) -> None:
    """Point the modeling modules of these families at moe8.ops.apply_rotary_pos_emb (one fused kernel per
    tensor, forward and backward; process-wide: the attention code looks the function up by name)."""
    import importlib

    from moe8 import ops

    for family in set(families) & set(ROPE_FAMILIES):
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        if mod not in _rope_patched:
            _rope_patched[mod] = mod.apply_rotary_pos_emb
            mod.apply_rotary_pos_emb = ops.apply_rotary_pos_emb


def _post_init(model, original) -> None:
    original(model)
    if _state["fuse_router"] and is_accelerated(model):
        _fuse_routers(model)
    if _state["fuse_norm"] and is_accelerated(model):
        _fuse_norms(model)
    if _state["fuse_loss"] and is_accelerated(model):
        _fuse_loss(model)


def _fuse_loss(model) -> None:
    """The causal LM's training loss without its logits (moe8.loss.fuse_causal_lm_loss); the inner base model
    of a CausalLM has no LM head and is left alone."""
    from .loss import fuse_causal_lm_loss

    if fuse_causal_lm_loss(model):
        _loss_fused.add(model)
    elif hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        head = type(model.get_output_embeddings()).__name__
        warnings.warn(
            f"moe8: fuse_loss left {type(model).__name__}'s loss as it is: its LM head is a {head}, "
            "not an nn.Linear without bias",
            stacklevel=3,
        )


def _config_supported(config) -> str | None:
    """None when moe8 can run this config's experts, else why not (checked before the model is built)."""
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return f"model type {family!r} is not one of {list(FAMILIES)}"
    if family != "gpt_oss" and getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return f"hidden_act {config.hidden_act!r} (moe8 runs SiLU-gated experts)"
    return None


def _check_and_adjust(model, requested, original):
    """Wraps PreTrainedModel._check_and_adjust_experts_implementation, which every model's __init__ and
    set_experts_implementation call: picks "moe8" by default after enable(), and remembers each config set to
    "moe8" so that disable() can switch it back."""
    config = model.config
    previous = config._experts_implementation
    if requested is None and _state["default"] and getattr(config, "model_type", None) in _state["families"]:
        why = _config_supported(config)
        if why is None:
            requested = NAME
        else:
            warnings.warn(f"moe8: {type(model).__name__} left on transformers' experts: {why}", stacklevel=4)
    chosen = original(model, requested)
    entry = _switched.get(id(config))
    if chosen == NAME and (entry is None or entry[0]() is not config):
        if previous in (None, NAME):
            previous = original(model, None)
        _switched[id(config)] = (weakref.ref(config), previous)
    return chosen


def register():
    """Register "moe8" in transformers' ALL_EXPERTS_FUNCTIONS, so that `experts_implementation="moe8"` and
    `model.set_experts_implementation("moe8")` work; changes no default."""
    _transformers()
    from transformers.integrations.moe import ExpertsInterface
    from transformers.modeling_utils import PreTrainedModel

    ExpertsInterface.register(NAME, experts_forward)
    if _state["check"] is None:
        original = PreTrainedModel._check_and_adjust_experts_implementation

        def _check_and_adjust_experts_implementation(self, experts_implementation):
            return _check_and_adjust(self, experts_implementation, original)

        PreTrainedModel._check_and_adjust_experts_implementation = _check_and_adjust_experts_implementation
        _state["check"] = (original, _check_and_adjust_experts_implementation)
    if _state["post_init"] is None:
        original_post_init = PreTrainedModel.post_init

        def post_init(self):
            _post_init(self, original_post_init)

        PreTrainedModel.post_init = post_init
        _state["post_init"] = (original_post_init, post_init)
    _state["kwargs"] = _layer_kwargs()


def enable(
    families=None,
    deterministic: bool = True,
    fuse_router: bool = False,
    fp8=None,
    fuse_norm: bool = False,
    fuse_rope: bool = False,
    fuse_loss: bool = False,
):
    """Make every supported MoE model built from now on (from_pretrained, from_config, the class) run its
    experts on moe8, unless it asks for another `experts_implementation` explicitly.

    families: config.model_type names to accelerate (default: all of FAMILIES).
    deterministic: same inputs give bitwise the same outputs and gradients (passed on to moe8.layer when it
        takes the option; moe8 is deterministic by default).
    fuse_router: also compute the routing (softmax/sigmoid, top-k, weights) with moe8.layer.route; the router
        module is still called and still returns its logits.
    fp8: None (bf16 experts) or an FP8 recipe for the expert GEMMs: "blockwise" (1x128 / 128x128 scales, the
        DeepSeek-V3 recipe), "rowwise" or "tensorwise" (see moe8.fp8). Experts with moe8 LoRA stay in bf16.
    fuse_norm: run the model's RMSNorms as one fused kernel each (torch.nn.functional.rms_norm), forward and
        backward. In 16-bit the output is rounded once, where transformers' Llama-style norm rounds twice.
    fuse_rope: apply rotary position embeddings with one fused kernel per tensor (moe8.ops.rope), for the
        families of ROPE_FAMILIES; process-wide, until disable(). Rounded once in 16-bit, like fuse_norm.
    fuse_loss: compute a causal LM's training loss from its final hidden states a chunk of rows at a time
        (moe8.loss.fuse_causal_lm_loss): in a forward with labels and grad on, no [tokens, vocab] logits (nor
        their float32 copy, log-softmax and gradients) exist, and outputs.logits is None; forwards without
        labels or without grad (generation, evaluation) are transformers' own.
    """
    _set_fp8(fp8)
    families = _families(families)
    _state.update(
        families=families,
        default=True,
        deterministic=deterministic,
        fuse_router=fuse_router,
        fuse_norm=fuse_norm,
        fuse_loss=fuse_loss,
    )
    register()
    if fuse_rope:
        _fuse_rope(families)


def accelerate(
    model,
    families=None,
    fuse_router: bool = False,
    fp8=None,
    fuse_norm: bool = False,
    fuse_rope: bool = False,
    fuse_loss: bool = False,
):
    """Run the experts of an existing model on moe8 and return the model (switched in place).

    model: a transformers PreTrainedModel, or anything that holds one (a PeftModel). A model of an unsupported
    family, or whose experts moe8 can't run, is returned untouched with a one-line warning.
    fuse_router: also route with moe8.layer.route (see enable).
    fuse_norm: also run the RMSNorms as fused kernels (see enable).
    fuse_rope: also apply rotary embeddings with a fused kernel (see enable; process-wide).
    fuse_loss: also compute the causal LM's training loss without its logits (see enable).
    fp8: an FP8 recipe for the expert GEMMs (see enable; process-wide, as enable's); "none" switches FP8 off;
        None leaves the current setting.
    """
    _transformers()
    if fp8 is not None:
        _set_fp8(fp8)
    from transformers.modeling_utils import PreTrainedModel

    families = _families(families)
    base = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    family = getattr(getattr(base, "config", None), "model_type", None)
    experts = [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]
    why = None
    if base is None:
        why = "not a transformers model"
    elif not experts:
        why = "no MoE experts"
    elif family not in families:
        why = f"model type {family!r} is not one of {sorted(families)}"
    else:
        why = next((s for s in map(_spec, experts) if isinstance(s, str)), None)
    if why is not None:
        warnings.warn(f"moe8: {type(model).__name__} left untouched: {why}", stacklevel=2)
        return model
    register()
    base.set_experts_implementation(NAME)
    if fuse_router:
        _fuse_routers(base)
    if fuse_norm:
        _fuse_norms(base)
    if fuse_rope:
        _fuse_rope([family])
    if fuse_loss:
        _fuse_loss(base)
    return model


def disable():
    """Undo enable() and accelerate(): models switched to moe8 go back to the experts implementation (and
    routers) they had, new models get transformers' default, and "moe8" leaves ALL_EXPERTS_FUNCTIONS."""
    if _state["check"] is None:  # never registered: nothing to undo (and transformers may be absent)
        return
    from transformers.integrations.moe import ExpertsInterface
    from transformers.modeling_utils import PreTrainedModel

    for key, attr in (("check", "_check_and_adjust_experts_implementation"), ("post_init", "post_init")):
        if _state[key] is not None and PreTrainedModel.__dict__.get(attr) is _state[key][1]:
            setattr(PreTrainedModel, attr, _state[key][0])
    for ref, previous in _switched.values():
        config = ref()
        if config is not None and config._experts_implementation == NAME:
            config._experts_implementation_internal = previous
    _switched.clear()
    for m in list(_fused):
        del m._moe8_config
    _fused.clear()
    for cls in _patched_classes:
        cls.forward = cls._moe8_forward
        del cls._moe8_forward
    _patched_classes.clear()
    for mod, own in _rope_patched.items():
        mod.apply_rotary_pos_emb = own
    _rope_patched.clear()
    from .loss import unfuse_causal_lm_loss

    for m in list(_loss_fused):
        unfuse_causal_lm_loss(m)
    _loss_fused.clear()
    ExpertsInterface._global_mapping.pop(NAME, None)
    _state.update(
        families=frozenset(),
        default=False,
        fuse_router=False,
        fuse_norm=False,
        fuse_loss=False,
        fp8=None,
        kwargs={},
        check=None,
        post_init=None,
    )
    _noticed.clear()


def is_accelerated(model) -> bool:
    """True when the model's experts run on moe8."""
    config = getattr(model, "config", None)
    return getattr(config, "_experts_implementation", None) == NAME


__all__ = [
    "FAMILIES",
    "NORMS",
    "ROPE_FAMILIES",
    "accelerate",
    "disable",
    "enable",
    "experts_forward",
    "is_accelerated",
    "norm_forward",
    "register",
    "router_forward",
]
