"""Hugging Face transformers (>= 5) integration: run the experts of MoE models on moe8.

    import moe8
    moe8.enable()            # supported MoE models built from now on run their experts on moe8
    moe8.accelerate(model)   # or switch one model that already exists
    moe8.disable()           # back to transformers' own experts implementation

Routers, RMSNorms, RoPE and the training loss are fused too by default (moe8.Config's fuse_* fields, each an
opt-out: `moe8.enable(fuse_loss=False)`).

transformers v5 fuses each MoE layer's experts into one module with 3D parameters (`gate_up_proj`,
`down_proj`, GPT-OSS also biases) and looks its forward up by name in `ALL_EXPERTS_FUNCTIONS`, from
`config._experts_implementation`. moe8 registers itself there as "moe8": the router, the parameters,
their names and the state_dict stay HF's, so hooks (router logits for the aux loss), save_pretrained /
from_pretrained, gradient checkpointing and PEFT `target_parameters` LoRA keep working. Each switched model
carries its moe8.Config.

    families.py   what moe8 knows of each family (router, norm, RoPE, experts layout): a new family goes here
    forward.py    the forwards moe8 installs (experts, router, RMSNorm, gated dense MLP)
    patching.py   enable / accelerate / disable and the hooks on PreTrainedModel

transformers is imported lazily: importing this package does not need it.
"""

from .families import FAMILIES, MLPS, NORMS, ROPE_FAMILIES, ROUTERS, TABLE
from .forward import NAME, experts_forward, mlp_forward, norm_forward, router_forward
from .patching import accelerate, config_of, disable, enable, is_accelerated, register, unsupported

__all__ = [
    "FAMILIES",
    "MLPS",
    "NAME",
    "NORMS",
    "ROPE_FAMILIES",
    "ROUTERS",
    "TABLE",
    "accelerate",
    "config_of",
    "disable",
    "enable",
    "experts_forward",
    "is_accelerated",
    "mlp_forward",
    "norm_forward",
    "register",
    "router_forward",
    "unsupported",
]
