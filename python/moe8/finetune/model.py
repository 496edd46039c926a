"""Models for `moe8 finetune`: a local Hugging Face directory or a built-in tiny config, checked before any
weight is loaded (family, sequence length), then moved onto moe8, LoRA and activation checkpointing."""

from __future__ import annotations

import contextlib
import copy
import json
import struct
import warnings
from pathlib import Path

import torch

from .. import hf
from . import fp8_load, hub
from .config import Config, FinetuneError
from .routing import experts_modules

CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"  # the recipes' model configs
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
# random-weight models for trying things out: hidden 64, 8 experts, top-2
TINY = {
    "tiny-qwen3-moe": (
        "qwen3_moe",
        dict(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_hidden_layers=2,
            num_experts=8,
        ),
    ),
    "tiny-mixtral": (
        "mixtral",
        dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_local_experts=8),
    ),
    "tiny-olmoe": ("olmoe", dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_experts=8)),
}
_TINY_COMMON = dict(**_ATTN, num_experts_per_tok=2, router_aux_loss_coef=0.02)
# every built-in model: (family, config overrides); the ~1B one has Qwen3-30B-A3B's proportions at 1/2 width
# (64 experts, top-8, 12 layers: 1.05B parameters with the Qwen3 vocabulary, ~0.2B active per token)
BUILTIN = {name: (family, {**_TINY_COMMON, **kw}) for name, (family, kw) in TINY.items()}
BUILTIN["qwen3-moe-1b"] = (
    "qwen3_moe",
    dict(
        hidden_size=1024,
        intermediate_size=3072,
        moe_intermediate_size=384,
        num_hidden_layers=12,
        num_experts=64,
        num_experts_per_tok=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
    ),
)


def model_config(cfg: Config, tok=None):
    """(transformers config, model directory or None for a built-in model). Raises FinetuneError for a missing
    directory, a model that is not a supported MoE family, or seq_len over max_position_embeddings."""
    from transformers import AutoConfig

    if cfg.model_config:
        config, path = config_from(cfg.model_config, cfg.num_layers), None
        family = config.model_type
    elif cfg.model in BUILTIN:
        family, kw = BUILTIN[cfg.model]
        # tiny models use a stronger balance loss than Qwen3's 0.001: otherwise they collapse onto few experts
        config, path = AutoConfig.for_model(family, **kw), None
        config.tie_word_embeddings = True
    else:
        path = Path(cfg.model)
        if not path.is_dir() and hub.is_hub_id(cfg.model):  # ORG/NAME: its config and tokenizer, cache first
            path = hub.model_dir(cfg.model)
        if not path.is_dir():
            raise FinetuneError(
                f"model: {cfg.model} is neither a directory nor a built-in model ({', '.join(BUILTIN)}), nor a "
                "Hugging Face model id (ORG/NAME)"
            )
        if not (path / "config.json").is_file():
            raise FinetuneError(f"model: {path} has no config.json: not a Hugging Face model directory")
        try:
            family = json.loads((path / "config.json").read_text()).get("model_type")
            config = AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError, KeyError) as e:
            raise FinetuneError(f"model: cannot read {path / 'config.json'}: {e}") from None
    if family not in hf.FAMILIES:
        raise FinetuneError(
            f"model: {cfg.model} is a {family!r} model, not an MoE family moe8 supports "
            f"({', '.join(hf.FAMILIES)})"
        )
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and cfg.seq_len > limit:
        raise FinetuneError(f"seq_len = {cfg.seq_len} is over the model's max_position_embeddings ({limit})")
    return config, path


def config_from(spec: str, num_layers: int = 0):
    """A transformers config from a model type (its config class's defaults), a config.json path or inline
    JSON, with num_layers decoder layers when > 0 (per-layer lists such as gpt-oss' layer_types cut to fit)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if spec.lstrip().startswith("{"):
        try:
            kw = json.loads(spec)
        except json.JSONDecodeError as e:
            raise FinetuneError(f"model_config: not valid JSON: {e}") from None
    elif spec in CONFIG_MAPPING:
        kw = {"model_type": spec}
    elif (CONFIGS / f"{spec}.json").is_file():  # a recipe's model config by name (moe8/recipes/configs)
        kw = json.loads((CONFIGS / f"{spec}.json").read_text())
    elif Path(spec).is_file():
        try:
            kw = json.loads(Path(spec).read_text())
        except (OSError, ValueError) as e:
            raise FinetuneError(f"model_config: cannot read {spec}: {e}") from None
    else:
        raise FinetuneError(
            f"model_config = {spec!r}: expected a transformers model type ({', '.join(hf.FAMILIES)}), a "
            f"recipe's config ({', '.join(sorted(p.stem for p in CONFIGS.glob('*.json')))}), a config.json file "
            "or inline JSON"
        )
    if not isinstance(kw, dict) or not isinstance(kw.get("model_type"), str):
        raise FinetuneError(f"model_config: {spec[:80]!r} has no model_type")
    kw = dict(kw)
    model_type = kw.pop("model_type")
    for k in ("architectures", "transformers_version", "torch_dtype", "dtype", "quantization_config"):
        kw.pop(k, None)
    try:
        config = AutoConfig.for_model(model_type, **kw)
    except (ValueError, TypeError, KeyError) as e:
        raise FinetuneError(f"model_config: {model_type}: {e}") from None
    if num_layers:
        config.num_hidden_layers = num_layers
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:num_layers]
        if hasattr(config, "first_k_dense_replace"):
            config.first_k_dense_replace = min(config.first_k_dense_replace, num_layers - 1)
        if isinstance(getattr(config, "mlp_only_layers", None), list):
            config.mlp_only_layers = [i for i in config.mlp_only_layers if i < num_layers]
    return config


def build_model(cfg: Config, config, path, tok, dtype, device, log):
    """The model on `device` in `dtype`, experts on moe8 when supported, LoRA / checkpointing as configured.
    LoRA over FP8 bases: the adapted weights quantised while the model is built or loaded (fp8_load), so the
    device never holds the whole bf16 model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    quantised = fp8_base_targets(cfg, config, device)  # LoRA over FP8 bases: quantised as the model is made
    frozen = 0
    if path is None:  # random weights: a built-in model (vocabulary: the tokenizer's) or model_config
        vocab = max(len(tok), config.vocab_size) if cfg.model_config else len(tok)
        config.vocab_size, config.pad_token_id, config.eos_token_id = (
            vocab,
            tok.pad_token_id,
            tok.eos_token_id,
        )
        config.bos_token_id = None
        if quantised and cfg.model_config:  # a layer at a time on the device (not from_config's values)
            model, frozen = fp8_load.random_model(config, dtype, device, quantised)
        else:
            # a built-in model is initialised on the CPU (its LoRA export rebuilds the base from the seed
            # there); a model_config one where it will train: a random 30B model initialised on the CPU takes
            # minutes
            with torch.device(device if cfg.model_config else "cpu"):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            if quantised:
                frozen = fp8_load.to_device(model, device, quantised)
    else:
        from safetensors import SafetensorError

        if hub.is_hub_id(cfg.model):  # the weights of a Hub model: from the cache, else downloaded now
            path = hub.model_weights(cfg.model, path)
        check_weights(path)
        # LoRA over FP8 bases: loaded onto the CPU, each adapted weight quantised on the device as it is set;
        # otherwise straight onto the device
        placed = {} if quantised else dict(device_map=str(device))
        try:
            bars = contextlib.nullcontext() if cfg.progress else quiet_bars()  # no "Loading weights" bar
            with bars, fp8_load.frozen_as_loaded(quantised, device) as loaded:
                model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **placed)
            frozen = loaded.count
        except (OSError, ValueError, RuntimeError, EOFError, SafetensorError) as e:
            files = ", ".join(p.name for p in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")))
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise FinetuneError(
                f"model: cannot load the weights in {path} ({files or 'no weight files'}): {first}"
            ) from None
        if len(tok) > model.get_input_embeddings().weight.shape[0]:
            raise FinetuneError(f"tokenizer: {len(tok)} tokens, more than the model's vocabulary")
    model.to(device)
    model.config.use_cache = False
    coef = cfg.aux_loss_coef
    if coef is None:
        coef = getattr(config, "router_aux_loss_coef", 0.0)
    # the model returns aux_loss (and router_logits, for the z-loss) only with output_router_logits; its own
    # loss would add router_aux_loss_coef x aux_loss given labels: the trainer adds it, with the same coefficient
    if hasattr(model.config, "output_router_logits"):
        model.config.output_router_logits = coef > 0 or cfg.router_z_loss_coef > 0
    if hasattr(model.config, "router_aux_loss_coef"):
        model.config.router_aux_loss_coef = coef
    if not experts_modules(model):
        raise FinetuneError(f"model: {cfg.model} has no fused MoE experts modules (transformers v5)")
    if cfg.moe8:
        import moe8

        if device.type == "cuda" and not moe8.cuda_available():
            log("moe8: built without CUDA kernels: the experts run on transformers' grouped_mm")
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                # "none": bf16 experts; every default fusion on (moe8.Config)
                hf.accelerate(model, fp8=cfg.fp8, fuse_attention=cfg.fuse_attention)
            if not hf.is_accelerated(model):
                why = "; ".join(str(w.message) for w in caught)
                if frozen:  # transformers' experts would read the FP8-only weights' zero placeholders
                    raise FinetuneError(
                        f"moe8: the FP8 base weights need the experts on moe8, left on transformers: {why}"
                    )
                log(f"moe8: experts left on transformers: {why}")
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    targets = lora_targets(model, cfg, log) if cfg.method == "lora" else []
    if cfg.method == "lora" and not cfg.moe8:
        return peft_lora(model, cfg, targets), coef
    if cfg.method == "lora":
        from moe8.lora import apply_lora

        try:
            model = apply_lora(
                model,
                r=cfg.lora_r,
                alpha=cfg.lora_alpha,
                targets=targets,
                dropout=cfg.lora_dropout,
                dtype=adapter_dtype(cfg),
            )
        except ValueError as e:
            raise FinetuneError(f"lora: {e}") from None
        if cfg.fp8 == "blockwise" and hf.is_accelerated(model):
            from moe8.lora import freeze_base_fp8

            # LoRA over FP8 base weights: those not quantised as the model was made, their bf16 copies freed
            n = frozen + freeze_base_fp8(model, cfg.fp8)
            if quantised and not frozen:
                log(
                    "lora: no base weight was quantised as the model loaded (transformers set none through "
                    "nn.Module's parameter registration): the load held the whole bf16 model"
                )
            adapters = {p.dtype for p in model.parameters() if p.requires_grad}
            log(
                f"lora: {n} frozen base weights held in FP8 (blockwise) only, the adapters in "
                f"{', '.join(sorted(dtype_name(d) for d in adapters))}"
            )
    return model, coef


def fp8_base_targets(cfg: Config, config, device) -> list[str]:
    """The LoRA targets whose base weights are quantised to FP8 while the model is built or loaded (fp8_load):
    for LoRA over FP8 bases (method lora, fp8 blockwise) with the experts on moe8, the condition build_model
    then calls freeze_base_fp8 under, judged on the model built on the meta device; [] otherwise."""
    if not (cfg.method == "lora" and cfg.fp8 == "blockwise" and cfg.moe8):
        return []
    from transformers import AutoModelForCausalLM

    import moe8

    if device.type == "cuda" and not moe8.cuda_available():
        return []
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    if hf.unsupported(model) is not None:
        return []
    return lora_targets(model, cfg)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def adapter_dtype(cfg: Config) -> torch.dtype | None:
    """lora_dtype as moe8.lora.apply_lora's dtype: None for "auto" (fp32 under a 16-bit model)."""
    return None if cfg.lora_dtype == "auto" else getattr(torch, cfg.lora_dtype)


def check_weights(path: Path) -> None:
    """FinetuneError naming a .safetensors file in `path` that is cut short or not safetensors at all (its
    header says how long it must be), before any weight is loaded."""
    for f in sorted(path.glob("*.safetensors")):
        try:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                head = fh.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
                if n is None or n > size - 8:
                    raise ValueError(f"{size:,} bytes, shorter than its header")
                meta = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
            if 8 + n + end != size:
                raise ValueError(f"{size:,} bytes where its header describes {8 + n + end:,}")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise FinetuneError(
                f"model: {f} is not a complete safetensors file ({e}): truncated or damaged; download or save it "
                "again"
            ) from None


@contextlib.contextmanager
def quiet_bars():
    """transformers' progress bars ("Loading weights", "Writing model shards") off, restored after."""
    from transformers.utils import logging

    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            logging.enable_progress_bar()


def lora_targets(model, cfg: Config, log=None) -> list[str]:
    """The LoRA targets of `model` (moe8.lora's rule: a Linear named t or ending in "." + t; "experts"):
    cfg.lora_targets, refused when one matches nothing (the message lists the model's names), or of the
    default targets those the model has (log names the others)."""
    import difflib

    from moe8.lora import TARGETS

    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    has_experts = bool(experts_modules(model))

    def matches(t: str) -> bool:
        return (t == "experts" and has_experts) or any(n == t or n.endswith("." + t) for n in linear)

    wanted = list(cfg.lora_targets or TARGETS)
    missing = [t for t in wanted if not matches(t)]
    names = sorted({n.rsplit(".", 1)[-1] for n in linear}) + (["experts"] if has_experts else [])
    if missing and cfg.lora_targets:
        hints = [
            f"{t} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(t, names, 1)) else t
            for t in missing
        ]
        raise FinetuneError(
            f"lora_targets: {', '.join(hints)} match no layer of {cfg.model}; its layers LoRA can adapt: "
            f"{', '.join(names)}"
        )
    if missing and log is not None:
        log(
            f"lora: the default targets {', '.join(missing)} are not in {cfg.model}; adapting {', '.join(t for t in wanted if t not in missing)}"
        )
    return [t for t in wanted if t not in missing]


def peft_lora(model, cfg: Config, targets: list[str] | None = None):
    """--method lora --no-moe8: the same LoRA through PEFT (target_modules for the attention projections,
    target_parameters for the fused experts: W + s·B·A formed per forward), the baseline moe8 is compared to.
    The adapters in lora_dtype: "auto" and "float32" are PEFT's default (fp32 under a 16-bit model); a 16-bit
    one keeps PEFT from casting them to fp32 (autocast_adapter_dtype=False) and casts them to it where the
    model's dtype differs. targets: lora_targets(model, cfg) when not given."""
    if targets is None:
        targets = lora_targets(model, cfg)
    try:
        import peft
    except ImportError:
        raise FinetuneError(
            "--no-moe8 with --method lora runs PEFT's LoRA (the comparison baseline): pip install 'peft>=0.17'"
        ) from None
    config = peft.LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=[t for t in targets if t != "experts"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        if "experts" in targets
        else None,
        bias="none",
    )
    dtype = adapter_dtype(cfg)
    if dtype in (None, torch.float32):
        return peft.get_peft_model(model, config)
    model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)  # adapters in the model's dtype
    for p in model.parameters():
        if p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def active_params(model) -> tuple[int, int]:
    """(all parameters, parameters a token goes through: without the input embedding, experts times k / E)."""
    total = sum(p.numel() for p in model.parameters())
    active = total - model.get_input_embeddings().weight.numel()
    if getattr(model.config, "tie_word_embeddings", False):
        active += model.get_input_embeddings().weight.numel()  # it is also the output projection
    k = getattr(model.config, "num_experts_per_tok", 1)
    for _, m in experts_modules(model):
        n = sum(p.numel() for p in m.parameters(recurse=False))  # gate_up, down (+ biases, LoRA factors)
        E = m.gate_up_proj.shape[0]
        active -= n - n * k // E
    return total, active


def peak_flops(cfg: Config, device) -> float | None:
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if "H100" in name or "H200" in name:
            return 989e12  # dense bf16
    return None


def attention_layers(config) -> list[tuple[int, int | None]]:
    """Per decoder layer (training FLOPs per attended key, sliding window or None): 3 passes x 2 FLOPs x
    heads x (qk head dim + v head dim), the QK^T and PV products of one query against one key."""
    heads = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    qk = getattr(config, "qk_head_dim", None) or hd
    v = getattr(config, "v_head_dim", None) or hd
    types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    out = []
    for i in range(config.num_hidden_layers):
        sliding = i < len(types) and types[i] == "sliding_attention" and window
        out.append((6 * heads * (qk + v), window if sliding else None))
    return out


def attention_flops(layers: list[tuple[int, int | None]], position_ids: torch.Tensor) -> float:
    """Training FLOPs of the attention products over a batch: per layer, its FLOPs per key times the keys each
    query attends to under the causal (per packed document) mask: position + 1, at most the window."""
    keys = position_ids.double() + 1
    total, cache = 0.0, {}
    for per_key, window in layers:
        if window not in cache:
            cache[window] = float((keys if window is None else keys.clamp(max=window)).sum())
        total += per_key * cache[window]
    return total
