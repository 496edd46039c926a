"""moe8.hf.patching — switching transformers models to moe8 and back: "moe8" in ALL_EXPERTS_FUNCTIONS, the
hooks that pick it for models built after enable(), the per-model moe8.Config, the fused router / norm /
RoPE / loss forwards, and disable(), which undoes all of it."""

from __future__ import annotations

import importlib
import warnings
import weakref

from moe8.build_info import warn_once
from moe8.config import DEFAULT, Config

from .families import (
    FAMILIES,
    MLPS,
    NORMS,
    ROPE_FAMILIES,
    ROUTERS,
    SINK_FAMILIES,
    config_supported,
    experts_spec,
    is_experts_module,
)
from .forward import NAME, _noticed, experts_forward, mlp_forward, norm_forward, router_forward
from .registry import registry


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


def _config(base: Config, config, changes: dict) -> Config:
    if config is not None and not isinstance(config, Config):
        raise ValueError(f"config: expected a moe8.Config, got {type(config).__name__}")
    return (config or base).replace(**changes)


# ------------------------------------------------------------------------------------ fusing, per model
def _fuse(model, classes: dict, forward) -> None:
    """Give every module of model whose class is classes[model_type] moe8's forward (patched on the class,
    switched on per module by `_moe8_config`, the model's HF config)."""
    config = model.config
    name = classes.get(getattr(config, "model_type", None))
    for m in model.modules():
        cls = type(m)
        if cls.__name__ != name:
            continue
        if cls not in registry.patched_classes:
            cls._moe8_forward, cls.forward = cls.forward, forward
            registry.patched_classes.add(cls)
        m._moe8_config = config  # a plain attribute: not in state_dict; deepcopy and pickle keep it right
        registry.fused.add(m)


def _patch_modules(families, name: str, replacement) -> None:
    """Point the modeling modules of these families at `replacement` in place of their function `name`
    (process-wide: the modules' code looks the function up by name); disable() puts their own back."""
    for family in families:
        mod = _modeling(family)
        if (mod, name) not in registry.module_patches:
            registry.module_patches[mod, name] = getattr(mod, name)
            setattr(mod, name, replacement)


def _sync_free_aux_loss(families) -> None:
    """load_balancing_loss_func of these families as moe8.hf.forward's, which counts without a host
    synchronisation (the same loss)."""
    from .forward import load_balancing_loss_func

    _patch_modules(
        [f for f in families if f in FAMILIES and hasattr(_modeling(f), "load_balancing_loss_func")],
        "load_balancing_loss_func",
        load_balancing_loss_func,
    )


def _modeling(family):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _fuse_rope(families) -> None:
    """apply_rotary_pos_emb of these families as moe8.ops.apply_rotary_pos_emb (one fused kernel per tensor,
    forward and backward)."""
    from moe8 import ops

    _patch_modules(set(families) & set(ROPE_FAMILIES), "apply_rotary_pos_emb", ops.apply_rotary_pos_emb)


def _fuse_attention(families) -> None:
    """eager_attention_forward of these families (those with attention sinks) as
    moe8.attention.attention_forward."""
    from moe8.attention import attention_forward

    _patch_modules(set(families) & set(SINK_FAMILIES), "eager_attention_forward", attention_forward)


def _trainer_adamw() -> None:
    """transformers' Trainer handlers of optim "adamw_torch" and "adamw_torch_fused" give moe8.optim.AdamW where
    they give torch.optim.AdamW (not where expert parallelism mixes DTensors in, which they step per tensor)."""
    import torch
    from transformers import trainer_optimizer as to

    from moe8.optim import AdamW

    for name in (to.OptimizerNames.ADAMW_TORCH, to.OptimizerNames.ADAMW_TORCH_FUSED):
        own = to._OPTIMIZER_HANDLERS.get(name)
        if own is None or name in registry.trainer_adamw:
            continue

        def handler(ctx, own=own):
            cls, kwargs = own(ctx)
            if cls is torch.optim.AdamW and kwargs.get("foreach") is not False:
                cls = AdamW
            return cls, kwargs

        registry.trainer_adamw[name] = own
        to._OPTIMIZER_HANDLERS[name] = handler


def _packed_attention() -> None:
    """transformers' "sdpa" attention function as moe8.attention.packed_attention_forward (varlen flash over
    packed documents when a forward is given their offsets; sdpa itself otherwise), for every model."""
    from transformers.modeling_utils import AttentionInterface

    from moe8.attention import packed_attention_forward

    if registry.sdpa is None:
        registry.sdpa = AttentionInterface._global_mapping["sdpa"]
        AttentionInterface._global_mapping["sdpa"] = packed_attention_forward


def _fuse_loss(model) -> None:
    """The causal LM's training loss without its logits (moe8.loss.fuse_causal_lm_loss); the inner base model
    of a CausalLM has no LM head and is left alone."""
    from moe8.loss import fuse_causal_lm_loss

    if fuse_causal_lm_loss(model):
        registry.loss_fused.add(model)
    elif hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        head = type(model.get_output_embeddings()).__name__
        warnings.warn(
            f"moe8: fuse_loss left {type(model).__name__}'s loss as it is: its LM head is a {head}, "
            "not an nn.Linear without bias",
            stacklevel=4,
        )


def _apply(model, cfg: Config) -> None:
    """Turn on the fusions cfg asks for and attach cfg to the model's experts and fused modules (whose forwards
    read it: module_config)."""
    if cfg.fuse_router:
        _fuse(model, ROUTERS, router_forward)
    if cfg.fuse_norm:
        _fuse(model, NORMS, norm_forward)
    if cfg.fuse_mlp:
        _fuse(model, MLPS, mlp_forward)
    for m in model.modules():
        if is_experts_module(m) or m in registry.fused:
            m._moe8 = cfg  # a plain attribute, as _moe8_config
            registry.configured.add(m)
    _sync_free_aux_loss([model.config.model_type])
    if cfg.fuse_rope:
        _fuse_rope([model.config.model_type])
    if cfg.fuse_attention:
        _fuse_attention([model.config.model_type])
    if cfg.packed_attention:
        _packed_attention()
    if cfg.fuse_loss:
        _fuse_loss(model)
    if cfg.fp8_dense:  # the dense layers' nn.Linear -> moe8.fp8_linear.Float8Linear (in place)
        from moe8.fp8_linear import convert_to_fp8

        convert_to_fp8(model, cfg.fp8, cfg.fp8_dense, cfg.fp8_dense_skip_first_last, cfg.fp8_cache)


def is_accelerated(model) -> bool:
    """True when the model's experts run on moe8."""
    config = getattr(model, "config", None)
    return getattr(config, "_experts_implementation", None) == NAME


def config_of(model) -> Config | None:
    """The moe8.Config a model's experts run with (None when none is attached)."""
    return next((m._moe8 for m in model.modules() if getattr(m, "_moe8", None) is not None), None)


# ------------------------------------------------------------------------------ hooks on PreTrainedModel
def _post_init(model, original) -> None:
    original(model)
    if registry.auto and is_accelerated(model):
        _apply(model, registry.default)


def _check_and_adjust(model, requested, original):
    """Wraps PreTrainedModel._check_and_adjust_experts_implementation, which every model's __init__ and
    set_experts_implementation call: picks "moe8" by default after enable(), and remembers each config set to
    "moe8" so that disable() can switch it back."""
    config = model.config
    previous = config._experts_implementation
    if requested is None and registry.auto and getattr(config, "model_type", None) in registry.families:
        why = config_supported(config)
        if why is None:
            requested = NAME
        else:
            warnings.warn(f"moe8: {type(model).__name__} left on transformers' experts: {why}", stacklevel=4)
    chosen = original(model, requested)
    entry = registry.switched.get(id(config))
    if chosen == NAME and (entry is None or entry[0]() is not config):
        if previous in (None, NAME):
            previous = original(model, None)
        registry.switched[id(config)] = (weakref.ref(config), previous)
    return chosen


def register():
    """Register "moe8" in transformers' ALL_EXPERTS_FUNCTIONS, so that `experts_implementation="moe8"` and
    `model.set_experts_implementation("moe8")` work; changes no default."""
    _transformers()
    from transformers.integrations.moe import ExpertsInterface
    from transformers.modeling_utils import PreTrainedModel

    ExpertsInterface.register(NAME, experts_forward)
    if registry.check is None:
        original = PreTrainedModel._check_and_adjust_experts_implementation

        def _check_and_adjust_experts_implementation(self, experts_implementation):
            return _check_and_adjust(self, experts_implementation, original)

        PreTrainedModel._check_and_adjust_experts_implementation = _check_and_adjust_experts_implementation
        registry.check = (original, _check_and_adjust_experts_implementation)
    if registry.post_init is None:
        original_post_init = PreTrainedModel.post_init

        def post_init(self):
            _post_init(self, original_post_init)

        PreTrainedModel.post_init = post_init
        registry.post_init = (original_post_init, post_init)


# ---------------------------------------------------------------------------------------------- the API
def enable(families=None, config: Config | None = None, **fields):
    """Make every supported MoE model built from now on (from_pretrained, from_config, the class) run its
    experts on moe8, unless it asks for another `experts_implementation` explicitly.

    families: config.model_type names to accelerate (default: all of moe8.hf.FAMILIES).
    config, **fields: the moe8.Config these models get (fields override config's; see moe8.Config: fp8,
        fuse_router, fuse_norm, fuse_rope, fuse_attention, packed_attention, fuse_loss, routed_down,
        consume_gate_up, ...). The six fusions are on by default (fuse_loss=False etc. opts out): in a training
        forward with labels outputs.logits is None. fuse_rope and fuse_attention patch the families' modeling
        modules right away, packed_attention transformers' "sdpa" attention function (process-wide, until
        disable()).
    """
    cfg = _config(DEFAULT, config, fields)
    families = _families(families)
    warn_once()  # a visible GPU this build can't run at full speed: one warning a process
    register()
    registry.families, registry.auto, registry.default = families, True, cfg
    if cfg.fuse_rope:
        _fuse_rope(families)
    if cfg.fuse_attention:
        _fuse_attention(families)
    if cfg.packed_attention:
        _packed_attention()
    if cfg.fused_adamw:
        _trainer_adamw()


def _base_model(model):
    from transformers.modeling_utils import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def unsupported(model, families=None) -> str | None:
    """None when accelerate(model, families) runs the model's experts on moe8, else why it leaves the model
    untouched; reads only the modules' structure (a model on the meta device will do)."""
    _transformers()
    families = _families(families)
    base = _base_model(model)
    family = getattr(getattr(base, "config", None), "model_type", None)
    experts = [m for m in model.modules() if is_experts_module(m)]
    if base is None:
        return "not a transformers model"
    if not experts:
        return "no MoE experts"
    if family not in families:
        return f"model type {family!r} is not one of {sorted(families)}"
    return next((s for s in map(experts_spec, experts) if isinstance(s, str)), None)


def accelerate(model, families=None, config: Config | None = None, **fields):
    """Run the experts of an existing model on moe8 and return the model (switched in place).

    model: a transformers PreTrainedModel, or anything that holds one (a PeftModel). A model of an unsupported
    family, or whose experts moe8 can't run, is returned untouched with a one-line warning.
    config, **fields: the model's moe8.Config (see moe8.Config); fields change the model's current Config
    (the one enable() gave it, or the default: every fusion on) when no config is given. fp8="none" switches
    FP8 off; fuse_loss=False keeps outputs.logits in training forwards; fuse_rope patches the family's
    modeling module (process-wide, until disable()).
    """
    why = unsupported(model, families)
    if why is not None:
        warnings.warn(f"moe8: {type(model).__name__} left untouched: {why}", stacklevel=2)
        return model
    base = _base_model(model)
    cfg = _config(config_of(base) or registry.default, config, fields)
    register()
    base.set_experts_implementation(NAME)
    _apply(base, cfg)
    return model


def disable():
    """Undo enable() and accelerate(): models switched to moe8 go back to the experts implementation (and
    routers) they had, new models get transformers' default, and "moe8" leaves ALL_EXPERTS_FUNCTIONS."""
    if registry.check is None:  # never registered: nothing to undo (and transformers may be absent)
        return
    from transformers.integrations.moe import ExpertsInterface
    from transformers.modeling_utils import PreTrainedModel

    from moe8.loss import unfuse_causal_lm_loss

    for hooks, attr in (
        (registry.check, "_check_and_adjust_experts_implementation"),
        (registry.post_init, "post_init"),
    ):
        if hooks is not None and PreTrainedModel.__dict__.get(attr) is hooks[1]:
            setattr(PreTrainedModel, attr, hooks[0])
    for ref, previous in registry.switched.values():
        config = ref()
        if config is not None and config._experts_implementation == NAME:
            config._experts_implementation_internal = previous
    for m in list(registry.fused):
        del m._moe8_config
    for m in list(registry.configured):
        del m._moe8
    for cls in registry.patched_classes:
        cls.forward = cls._moe8_forward
        del cls._moe8_forward
    for (mod, name), own in registry.module_patches.items():
        setattr(mod, name, own)
    if registry.sdpa is not None:
        from transformers.modeling_utils import AttentionInterface

        AttentionInterface._global_mapping["sdpa"] = registry.sdpa
    if registry.trainer_adamw:
        from transformers import trainer_optimizer as to

        to._OPTIMIZER_HANDLERS.update(registry.trainer_adamw)
    for m in list(registry.loss_fused):
        unfuse_causal_lm_loss(m)
    ExpertsInterface._global_mapping.pop(NAME, None)
    registry.reset()
    _noticed.clear()
