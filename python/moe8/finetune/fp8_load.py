"""LoRA over FP8 base weights, quantised while the model is built or loaded: the weights LoRA adapts
(moe8.lora.base_layout) reach the device in bf16 a decoder layer (random weights) or a weight (from_pretrained)
at a time and are replaced by their blockwise FP8 copies (moe8.lora.freeze_base_weights) before the next
arrives, so the whole bf16 model never is on the device. apply_lora then adapts them as they are and
freeze_base_fp8 finds them done.

    random_model(config, dtype, device, targets)     random weights, built on the meta device, a layer at a time
    to_device(model, device, targets)                 a model on the CPU moved over a layer at a time
    with frozen_as_loaded(targets, device) as done:   around from_pretrained onto the CPU: each adapted weight
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)    moved and quantised as it is set
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from ..fp8 import freeze_fp8
from ..lora import base_layout, freeze_base_weights


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every decoder layer (transformers' GradientCheckpointingLayer), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]


def _init_order(module: nn.Module, owner, prefix: str = ""):
    """(name, module, the PreTrainedModel whose _initialize_weights sets it) for every module, children before
    their parent, each sub-model initialising its own modules: PreTrainedModel.initialize_weights' order."""
    from transformers.modeling_utils import PreTrainedModel

    for name, child in module.named_children():
        inner = child if isinstance(child, PreTrainedModel) else owner
        yield from _init_order(child, inner, f"{prefix}{name}.")
    yield prefix.removesuffix("."), module, owner


def _materialise(module: nn.Module, device, made: dict) -> None:
    """module's own parameters and buffers off the meta device, uninitialised (as from_pretrained makes its
    missing keys); a tensor shared by several modules (tied embeddings) made once. made: id -> (meta, weak
    reference to the real one: a weight quantised and freed is not kept alive by this table)."""
    for table, wrap in ((module._parameters, True), (module._buffers, False)):
        for key, t in table.items():
            if t is None or not t.is_meta:
                continue
            real = made[id(t)][1]() if id(t) in made else None
            if real is None:
                real = torch.empty_like(t, device=device)
                real = nn.Parameter(real, t.requires_grad) if wrap else real
                made[id(t)] = (t, weakref.ref(real))
            if wrap:
                module.register_parameter(key, real)
            else:
                table[key] = real


def random_model(config, dtype: torch.dtype, device, targets=()) -> tuple[nn.Module, int]:
    """(AutoModelForCausalLM.from_config(config, dtype=dtype) on `device`, weights quantised): built on the meta
    device, then each module made real on `device` and initialised by its model's _initialize_weights (the
    distributions from_config gives, from the global generator: the same seed, the same weights), in
    initialize_weights' order; after each decoder layer, the weights apply_lora(targets) adapts are replaced by
    their FP8 copies. At most one decoder layer is held in bf16 beyond the FP8 model.

    The values are not from_config's bit for bit: from_config first runs torch's default initialisation of each
    nn.Linear (drawing from the generator) and then overwrites it; here only transformers' initialisation draws.
    Non-persistent buffers (RoPE's inv_freq) are computed by the same _init_weights from_pretrained relies on."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import guard_torch_init_functions
    from transformers.modeling_layers import GradientCheckpointingLayer

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    made, n = {}, 0
    with torch.no_grad(), guard_torch_init_functions():
        for name, module, owner in _init_order(model, model):
            _materialise(module, device, made)
            owner._initialize_weights(module, owner.is_custom_code())
            if targets and isinstance(module, GradientCheckpointingLayer):
                n += freeze_base_weights(module, targets, prefix=name)
    return model, n


def to_device(model: nn.Module, device, targets) -> int:
    """Move a model (on the CPU) onto `device` a decoder layer at a time, each layer's weights that
    apply_lora(targets) adapts quantised there as it arrives, then the rest; returns how many were quantised.
    The device holds one layer in bf16 beyond the FP8 model; the host the model until each layer has left."""
    n = 0
    for name, layer in decoder_layers(model):
        layer.to(device)
        n += freeze_base_weights(layer, targets, prefix=name)
    model.to(device)
    return n


class _Names:
    """Module -> its name in the model being built, from the registrations of submodules (a module is
    registered in its parent after its own submodules are in it: the name is only whole once it is loaded)."""

    def __init__(self):
        self.parent = weakref.WeakKeyDictionary()  # module -> (parent, name in it)

    def registered(self, parent: nn.Module, name: str, child) -> None:
        if child is not None:
            self.parent[child] = (parent, name)

    def __call__(self, module: nn.Module) -> str:
        parts = []
        while module in self.parent:
            module, name = self.parent[module]
            parts.append(name)
        return ".".join(reversed(parts))


class Loaded:
    """What frozen_as_loaded quantised: `count` weights."""

    count: int = 0


@contextlib.contextmanager
def frozen_as_loaded(targets, device, recipe="blockwise"):
    """Around AutoModelForCausalLM.from_pretrained(path, dtype=...) with no device_map (the weights loaded
    onto the CPU, safetensors memory-mapped): each weight apply_lora(targets) adapts is moved to `device` and
    replaced by its FP8 copy as transformers sets it in the model (after v5's conversions, e.g. the
    per-expert checkpoint tensors fused into the 3-D experts weight), through torch's global
    parameter-registration hook; the other weights stay on the CPU for the caller's model.to(device).

    Memory: the device holds the FP8 copies plus the weight being quantised (bf16 and its codes); the host the
    model's other weights (memory-mapped pages where the checkpoint's dtype is the model's) plus the tensors
    transformers' conversions build, one target weight at a time (an MoE layer's fused experts tensor is the
    largest). A weight transformers sets another way, or not flagged loaded (`_is_hf_initialized`, e.g. one
    missing from the checkpoint), is left for freeze_base_fp8 after the load. No targets: no hooks. Yields a
    Loaded."""
    from torch.nn.modules.module import (
        register_module_module_registration_hook,
        register_module_parameter_registration_hook,
    )

    names, done = _Names(), Loaded()
    if not targets:  # nothing to quantise: the load as it is
        yield done
        return

    def loaded(module: nn.Module, name: str, p):
        if p is None or p.is_meta or not getattr(p, "_is_hf_initialized", False):
            return None  # built on the meta device, or not from the checkpoint
        layout = base_layout(names(module), module, name, targets)
        if layout is None:
            return None
        frozen = freeze_fp8(p.detach().to(device), layout, recipe)
        frozen._is_hf_initialized = True  # transformers' initialisation of missing keys leaves it alone
        done.count += 1
        return frozen

    hooks = [
        register_module_module_registration_hook(names.registered),
        register_module_parameter_registration_hook(loaded),
    ]
    try:
        yield done
    finally:
        for h in hooks:
            h.remove()
