"""moe8.lora — LoRA fine-tuning of Hugging Face MoE models, experts included, saved as PEFT adapters.

    model = moe8.lora.apply_lora(model, r=16, alpha=32)  # freeze the model, add LoRA, run the experts on moe8
    ...                                                  # train the parameters that require grad
    moe8.lora.save_adapter(model, "adapter")             # adapter_config.json + adapter_model.safetensors
    peft.PeftModel.from_pretrained(base, "adapter")      # PEFT loads it: same outputs
    moe8.lora.load_adapter(fresh_model, "adapter")       # so does moe8 (also adapters PEFT saved)

Linear layers become LoraLinear: y = x·W^T + b + s·(dropout(x)·A^T)·B^T, A [r, in], B [out, r],
s = alpha / r (PEFT's lora.Linear). Each HF experts module gets gate_up_lora_A/B and down_lora_A/B in the
layout of its weights (moe8.layer.ExpertLoRA), which moe8.layer.experts_forward applies as two thin grouped
GEMMs, never forming B·A. In adapter files they are PEFT `target_parameters` LoRA (lora.ParamWrapper),
converted by _to_peft / _from_peft.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _checks as _c
from . import hf
from .fp8 import FROZEN, fp8_nbytes, freeze_fp8, frozen_fp8
from .fp8_linear import Float8Linear, fp8_linear

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "experts")
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # where PEFT puts the transformers model in its keys


def _lora_dtype(w: Tensor, dtype: torch.dtype | None = None) -> torch.dtype:
    """The adapters' dtype: `dtype` when given, else fp32 under a 16-bit model (as PEFT keeps them by default)
    and the weight's own otherwise. Adapters in another dtype than the model's are cast per use."""
    if dtype is not None:
        return dtype
    return torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype


def _check_dtype(dtype) -> None:
    if dtype is not None and dtype not in _c.FLOATS:
        names = ", ".join(str(d) for d in _c.FLOATS)
        got = dtype if isinstance(dtype, torch.dtype) else f"{type(dtype).__name__} {dtype!r}"
        raise TypeError(f"dtype: expected None or one of {names}, got {got}")


class LoraLinear(nn.Linear):
    """An nn.Linear with a low-rank update. It shares the base layer's weight and bias, so their state_dict
    keys stay the same; adds lora_A [r, in] (kaiming-uniform) and lora_B [out, r] (zeros: no change yet).
    The base GEMM runs in FP8 when the base layer was a moe8 Float8Linear (its recipe) or its weight is stored
    in FP8 only (freeze_base_fp8); the adapters stay in their own dtype (dtype: see _lora_dtype)."""

    def __init__(
        self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, dtype: torch.dtype | None = None
    ):
        super().__init__(base.in_features, base.out_features, bias=False, device="meta")
        self.weight, self.bias = base.weight, base.bias
        self.fp8_recipe = getattr(base, "fp8_recipe", None)
        f = dict(dtype=_lora_dtype(base.weight, dtype), device=base.weight.device)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, **f))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, **f))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / r
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def _base_forward(self, x: Tensor) -> Tensor:
        if self.fp8_recipe is None and frozen_fp8(self.weight) is None:
            return F.linear(x, self.weight, self.bias)
        return fp8_linear(x, self.weight, self.bias, self.fp8_recipe or "blockwise")

    def forward(self, x: Tensor) -> Tensor:
        y = self._base_forward(x)
        if self.lora_A.dtype != y.dtype:  # e.g. fp32 adapters on a bf16 model: the update is cast, then added
            d = F.linear(F.linear(self.lora_dropout(x.to(self.lora_A.dtype)), self.lora_A), self.lora_B)
            return y + (self.scaling * d).to(y.dtype)
        # y + s * t·B^T in one GEMM whose epilogue adds y (no [.., out] passes for the scaling and the sum,
        # forward or backward)
        t = F.linear(self.lora_dropout(x), self.lora_A)  # [.., r]
        out = torch.addmm(
            y.reshape(-1, y.shape[-1]), t.reshape(-1, t.shape[-1]), self.lora_B.t(), alpha=self.scaling
        )
        return out.view(y.shape)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.lora_A.shape[0]}, scaling={self.scaling}"


def _plain_linear(m: nn.Module) -> bool:
    """An nn.Linear LoRA may wrap: a plain one, or moe8's Float8Linear (its FP8 recipe kept)."""
    return type(m) in (nn.Linear, Float8Linear)


def _is_experts(m: nn.Module) -> bool:
    return hasattr(m, "has_gate") and hasattr(m, "is_transposed")


def _linear_target(name: str, linear) -> str | None:
    """The target a module named `name` matches: one equal to the name or to its end after a dot (PEFT's
    target_modules rule)."""
    return next((t for t in linear if name == t or name.endswith("." + t)), None)


def _base(model: nn.Module) -> nn.Module:
    from transformers.modeling_utils import PreTrainedModel

    base = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if base is None:
        raise TypeError(f"moe8.lora: expected a transformers model, got {type(model).__name__}")
    return base


def _needs_moe8(experts: nn.Module, args) -> None:
    """Forward pre-hook of experts that carry moe8 LoRA: any other experts implementation would ignore it."""
    impl = getattr(experts.config, "_experts_implementation", None)
    if impl != hf.NAME:
        raise RuntimeError(
            f"moe8.lora: {type(experts).__name__} carries moe8 expert LoRA, which only moe8 runs, but the "
            f"model's experts implementation is {impl!r}: call moe8.accelerate(model)"
        )


_needs_moe8.replay_safe = True  # a check without effects: moe8.graphs may replay the layer without it


def _attach_experts(experts: nn.Module, r: int, alpha: float, dropout: float, dtype=None) -> None:
    # GPT-OSS: gate_up [E, H, 2I], down [E, I, H] ("kn"); the others gate_up [E, 2I, H], down [E, H, I]
    kn = experts.is_transposed
    for name in ("gate_up", "down"):
        w = getattr(experts, f"{name}_proj")
        E, n, kd = (w.shape[0], w.shape[2], w.shape[1]) if kn else tuple(w.shape)
        f = dict(dtype=_lora_dtype(w, dtype), device=w.device)
        bound = kd**-0.5  # kaiming-uniform(a=sqrt(5)) of each expert's A, as nn.Linear / PEFT
        A = torch.empty((E, kd, r) if kn else (E, r, kd), **f).uniform_(-bound, bound)
        B = torch.zeros((E, r, n) if kn else (E, n, r), **f)
        experts.register_parameter(f"{name}_lora_A", nn.Parameter(A))
        experts.register_parameter(f"{name}_lora_B", nn.Parameter(B))
    experts.lora_scaling, experts.lora_dropout = alpha / r, float(dropout)
    experts.register_forward_pre_hook(_needs_moe8)


def apply_lora(
    model: nn.Module,
    r: int = 16,
    alpha: float = 32,
    targets=TARGETS,
    dropout: float = 0.0,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Freeze every parameter of a transformers model and add LoRA (rank r, scaling alpha / r); returns it.

    targets: nn.Linear layers whose name is a target or ends with "." + target get a LoraLinear (PEFT's
        target_modules rule); "experts" adds expert LoRA to every experts module, which only moe8 runs: the
        model is accelerated here, and a model moe8 can't run raises ValueError.
    dropout: on the LoRA branches' input, in training mode.
    dtype: of every adapter factor (torch.float32, bfloat16 or float16); None: fp32 under a bf16 / fp16 model
        (PEFT's default), else the model's dtype. Factors in the model's 16-bit dtype run their GEMMs at the
        base's speed and hold half the bytes (their gradients and optimizer states too).
    """
    r = _c.integer("r", r, 1)
    _check_dtype(dtype)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise TypeError(f"alpha: expected a number, got {type(alpha).__name__}")
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"dropout: expected 0 <= dropout < 1, got {dropout}")
    base = _base(model)
    if hasattr(base, "_moe8_lora"):
        raise ValueError("moe8.lora.apply_lora: the model already has moe8 LoRA")
    targets = [targets] if isinstance(targets, str) else list(targets)
    linear = [t for t in targets if t != "experts"]
    experts = []
    if "experts" in targets:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf.accelerate(base)
        if not hf.is_accelerated(base):
            why = "; ".join(str(w.message) for w in caught) or f"{type(base).__name__} is not accelerated"
            raise ValueError(
                f"moe8.lora.apply_lora: 'experts' is targeted but moe8 can't run this model's experts "
                f"({why}); leave 'experts' out of targets for LoRA on the other layers only"
            )
        experts = [(n, m) for n, m in base.named_modules() if _is_experts(m)]
    base.requires_grad_(False)
    matched = set()
    for name, m in list(base.named_modules()):
        hit = _linear_target(name, linear)
        if hit is not None and _plain_linear(m):
            parent, _, child = name.rpartition(".")
            setattr(base.get_submodule(parent), child, LoraLinear(m, r, alpha, dropout, dtype))
            matched.add(hit)
    for _, m in experts:
        _attach_experts(m, r, alpha, dropout, dtype)
    if not matched and not experts:
        raise ValueError(
            f"moe8.lora.apply_lora: no nn.Linear and no experts module matches targets {targets}"
        )
    if set(linear) - matched:
        warnings.warn(f"moe8.lora: no nn.Linear matches {sorted(set(linear) - matched)}", stacklevel=2)
    params = sorted(
        {".".join(n.split(".")[-2:]) + f".{p}" for n, _ in experts for p in ("gate_up_proj", "down_proj")}
    )
    base._moe8_lora = dict(
        r=r, alpha=alpha, dropout=dropout, target_modules=sorted(matched), target_parameters=params
    )
    return model


# ----------------------------------------------------------------------------------- FP8 base weights
def freeze_base_fp8(model: nn.Module, recipe="blockwise") -> int:
    """LoRA over FP8 base weights: the frozen weights of every LoraLinear and of every experts module with
    moe8 LoRA are quantised once (blockwise, moe8.fp8.freeze_fp8) and their bf16 values freed; the base
    GEMMs, forward and input gradient, then read the FP8 copies, the adapters stay as they are. Call it after
    apply_lora / load_adapter and after the model is on its device (the copies don't move with .to()); the
    experts must run with an FP8 recipe (moe8.accelerate(model, fp8="blockwise")). save_adapter writes the
    adapters as before (the base is not in them). Returns how many weights were quantised."""
    base = _base(model)
    _settings(base)
    n = 0
    for _, m in base.named_modules():
        if isinstance(m, LoraLinear):
            names, layout = ("weight",), 0
        elif _is_experts(m) and hasattr(m, "gate_up_lora_A"):
            names, layout = ("gate_up_proj", "down_proj"), 1 if m.is_transposed else 0
        else:
            continue
        for name in names:
            w = getattr(m, name)
            if frozen_fp8(w) is None:
                setattr(m, name, freeze_fp8(w.detach(), layout, recipe))
                n += 1
    return n


def base_layout(name: str, module: nn.Module, param: str, targets=TARGETS) -> int | None:
    """The layout freeze_base_fp8 quantises `module.param` in once apply_lora(targets) has adapted it (0: the
    GEMM reads it as stored, 1: transposed), or None for a weight LoRA leaves alone. name: the module's name
    in the model (what the targets match)."""
    targets = [targets] if isinstance(targets, str) else list(targets)
    if param == "weight" and _plain_linear(module):
        return 0 if _linear_target(name, [t for t in targets if t != "experts"]) else None
    if param in ("gate_up_proj", "down_proj") and "experts" in targets and _is_experts(module):
        return 1 if module.is_transposed else 0
    return None


def freeze_base_weights(module: nn.Module, targets=TARGETS, recipe="blockwise", prefix: str = "") -> int:
    """freeze_base_fp8 ahead of apply_lora: the weights under `module` (a decoder layer, or the whole model)
    that apply_lora(targets) adapts quantised now and their bf16 values freed, so that a model can be
    quantised a layer at a time as it is built. apply_lora takes them as they are and freeze_base_fp8 then
    skips them. prefix: the module's name in the model. Returns how many weights were quantised."""
    n = 0
    for name, m in module.named_modules(prefix=prefix):
        for param in ("weight", "gate_up_proj", "down_proj"):
            w = m._parameters.get(param)
            layout = None if w is None or frozen_fp8(w) is not None else base_layout(name, m, param, targets)
            if layout is not None:
                setattr(m, param, freeze_fp8(w.detach(), layout, recipe))
                n += 1
    return n


def base_nbytes(model: nn.Module) -> int:
    """Bytes the model's parameters hold (each storage once), the FP8 copies of frozen weights included."""
    seen, total = set(), 0
    for p in _base(model).parameters():
        storage = p.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        total += fp8_nbytes(getattr(p, FROZEN, None) and getattr(p, FROZEN).value)
    return total


# ------------------------------------------------------------------------------------------ PEFT adapters
# PEFT's ParamWrapper sees a 3-D parameter W [E, d1, d2] (as stored) as E experts; lora_A has expert-major
# rows [E*r, in], lora_B rank-major columns [out, r*E]. Up to peft 0.18 in = d1, out = d2 for every layout:
# W[e] + s * L[e]·R[e] with L[e] = lora_A.view(E, r, d1)[e]^T [d1, r], R[e] = lora_B.view(d2, r, E)[..., e]^T.
# From peft 0.19 on, a non-transposed W (transformers' [E, out, in], is_transposed False) has in = d2,
# out = d1: L[e] = lora_B.view(d1, r, E)[..., e], R[e] = lora_A.view(E, r, d2)[e]. Files record the layout
# in peft_version. moe8 stores the same factors in the GEMM's terms: "nk" W[e] + s * B[e]·A[e], "kn"
# W[e] + s * A[e]·B[e].
SWAPPED_SINCE = (0, 19)  # the first peft whose ParamWrapper swaps in and out for [E, out, in] weights
LAYOUT_VERSION = "0.19.0"  # written as peft_version when PEFT is not installed: the layout of peft >= 0.19


def _peft_version() -> str:
    """The installed PEFT's version, or LAYOUT_VERSION without PEFT (the layout current PEFT reads)."""
    try:
        from importlib.metadata import version

        return version("peft")
    except Exception:
        return LAYOUT_VERSION


def _swapped(experts: nn.Module, peft_version: str) -> bool:
    """Whether PEFT of this version stores the experts' LoRA with in and out swapped (see above)."""
    try:
        major_minor = tuple(int(x) for x in peft_version.split(".")[:2])
    except ValueError:  # not "major.minor...": take the current layout
        major_minor = SWAPPED_SINCE
    return major_minor >= SWAPPED_SINCE and not experts.is_transposed


def _factors(experts: nn.Module, param: str) -> tuple[Tensor, Tensor]:
    """(L [E, d1, r], R [E, r, d2]) with W[e] + s * L[e]·R[e], as moe8 parameters of the experts module."""
    name = param.removesuffix("_proj")
    A, B = getattr(experts, f"{name}_lora_A"), getattr(experts, f"{name}_lora_B")
    return (A, B) if experts.is_transposed else (B, A)


def _to_peft(L: Tensor, R: Tensor, swapped: bool) -> tuple[Tensor, Tensor]:
    """(lora_A, lora_B) of PEFT's ParamWrapper for the factors (L, R) of _factors."""
    if swapped:
        return R.reshape(-1, R.shape[2]), L.permute(1, 2, 0).reshape(L.shape[1], -1)
    return L.transpose(1, 2).reshape(-1, L.shape[1]), R.permute(2, 1, 0).reshape(R.shape[2], -1)


def _from_peft(lora_A: Tensor, lora_B: Tensor, E: int, swapped: bool) -> tuple[Tensor, Tensor]:
    """The factors (L, R) of _factors from PEFT's (lora_A, lora_B); inverse of _to_peft."""
    if swapped:
        d1, d2 = lora_B.shape[0], lora_A.shape[1]
        return lora_B.view(d1, -1, E).permute(2, 0, 1), lora_A.view(E, -1, d2)
    d1, d2 = lora_A.shape[1], lora_B.shape[0]
    return lora_A.view(E, -1, d1).transpose(1, 2), lora_B.view(d2, -1, E).permute(2, 1, 0)


def _entries(base: nn.Module):
    """(PEFT key prefix, module, expert parameter name or None) for every LoRA in the model. PEFT nests one
    ParamWrapper per targeted parameter of a module, the first registered innermost (under `base_layer`)."""
    for name, m in base.named_modules():
        if isinstance(m, LoraLinear):
            yield PREFIX + name, m, None
        elif _is_experts(m) and hasattr(m, "gate_up_lora_A"):
            order = [p for p, _ in m.named_parameters(recurse=False) if p in ("gate_up_proj", "down_proj")]
            for i, p in enumerate(order):
                yield PREFIX + name + ".base_layer" * (len(order) - 1 - i), m, p


def _settings(base: nn.Module) -> dict:
    spec = getattr(base, "_moe8_lora", None)
    if spec is None:
        raise ValueError("moe8.lora: the model has no moe8 LoRA (apply_lora or load_adapter first)")
    return spec


def save_adapter(model: nn.Module, out_dir) -> None:
    """Write the model's LoRA as a PEFT adapter (adapter_config.json + adapter_model.safetensors) that
    peft.PeftModel.from_pretrained(base_model, out_dir) and load_adapter load. PEFT's ParamWrapper refuses
    dropout, so with expert LoRA the file says lora_dropout 0 (load_adapter(..., dropout=) to train on)."""
    from safetensors.torch import save_file

    base = _base(model)
    spec = _settings(base)
    tensors = {}
    version = _peft_version()
    for prefix, m, param in _entries(base):
        A, B = (m.lora_A, m.lora_B) if param is None else _to_peft(*_factors(m, param), _swapped(m, version))
        tensors[f"{prefix}.lora_A.weight"] = A.detach().contiguous().cpu()
        tensors[f"{prefix}.lora_B.weight"] = B.detach().contiguous().cpu()
    config = dict(
        peft_type="LORA",
        task_type="CAUSAL_LM" if type(base).__name__.endswith("ForCausalLM") else None,
        base_model_name_or_path=getattr(base, "name_or_path", None),
        r=spec["r"],
        lora_alpha=spec["alpha"],
        lora_dropout=0.0 if spec["target_parameters"] else spec["dropout"],
        target_modules=spec["target_modules"],
        target_parameters=spec["target_parameters"] or None,
        bias="none",
        fan_in_fan_out=False,
        use_rslora=False,
        use_dora=False,
        init_lora_weights=True,
        inference_mode=True,
        peft_version=version,  # the expert layout depends on it (see _swapped)
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})


def load_adapter(
    model: nn.Module, path, dropout: float | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """Load a PEFT LoRA adapter (from save_adapter, or saved by PEFT with target_modules and, for the
    experts, target_parameters on both gate_up_proj and down_proj) into a transformers model; applies LoRA
    first when the model has none. dropout: overrides the file's lora_dropout; dtype: the factors' dtype when
    LoRA is applied here (apply_lora's; the file's values are cast to the factors' dtype). Returns the model."""
    from safetensors.torch import load_file

    base, path = _base(model), Path(path)
    config = json.loads((path / CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(
            f"moe8.lora.load_adapter: {path / CONFIG}: peft_type {config.get('peft_type')!r}, not 'LORA'"
        )
    unsupported = [
        k for k in ("use_rslora", "use_dora", "lora_bias", "rank_pattern", "alpha_pattern") if config.get(k)
    ]
    modules = config.get("target_modules") or []
    if isinstance(modules, str):
        unsupported.append("target_modules as a regex")
    if unsupported:
        raise ValueError(
            f"moe8.lora.load_adapter: {path / CONFIG} uses {unsupported}, which moe8 LoRA doesn't have"
        )
    r, alpha = config["r"], config["lora_alpha"]
    if not hasattr(base, "_moe8_lora"):
        targets = list(modules) + (["experts"] if config.get("target_parameters") else [])
        drop = config.get("lora_dropout", 0.0) if dropout is None else dropout
        apply_lora(base, r, alpha, targets, drop, dtype)
    elif (base._moe8_lora["r"], base._moe8_lora["alpha"]) != (r, alpha):
        raise ValueError(
            f"moe8.lora.load_adapter: the adapter has r={r}, alpha={alpha}; the model's LoRA has "
            f"r={base._moe8_lora['r']}, alpha={base._moe8_lora['alpha']}"
        )
    tensors = load_file(str(path / WEIGHTS))
    version = config.get("peft_version") or "0.18.0"  # files without one predate the swap (see _swapped)
    used = set()
    with torch.no_grad():
        for prefix, m, param in _entries(base):
            keys = [f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"]
            missing = [k for k in keys if k not in tensors]
            if missing:
                raise KeyError(f"moe8.lora.load_adapter: {path / WEIGHTS} lacks {missing}")
            A, B = (tensors[k] for k in keys)
            dst = (m.lora_A, m.lora_B) if param is None else _factors(m, param)
            swapped = param is not None and _swapped(m, version)
            want = [t.shape for t in (dst if param is None else _to_peft(*dst, swapped))]
            if [A.shape, B.shape] != want:
                raise ValueError(
                    f"moe8.lora.load_adapter: {keys}: shapes {[tuple(A.shape), tuple(B.shape)]}, "
                    f"expected {[tuple(w) for w in want]}"
                )
            for d, src in zip(dst, (A, B) if param is None else _from_peft(A, B, dst[0].shape[0], swapped)):
                d.copy_(src)
            used.update(keys)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(
            f"moe8.lora.load_adapter: {len(extra)} tensors of {path / WEIGHTS} fit no LoRA, e.g. {extra[:3]}"
        )
    return model


__all__ = [
    "TARGETS",
    "LoraLinear",
    "apply_lora",
    "base_layout",
    "base_nbytes",
    "freeze_base_fp8",
    "freeze_base_weights",
    "load_adapter",
    "save_adapter",
]
