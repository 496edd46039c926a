"""The peak GPU memory of a `moe8 finetune` run, estimated from the config alone before any weight is loaded
(parameters counted on the meta device), and the check that refuses a run that cannot fit.

Per GPU, in bytes (w: 2 for bf16, 4 for fp32; a: the LoRA adapters' bytes, 4 for lora_dtype "auto" and
"float32", 2 for "bfloat16" and "float16"; T: trainable parameters held by the GPU; tokens = micro_batch x
seq_len), the larger of the backward peak and the optimizer-step peak:
  weights      (dense + experts / ep) x w (+ T x a with LoRA); LoRA with fp8 = "blockwise" holds the weights it
               adapts in FP8 only (a byte each, an fp32 scale per 128 x 128 block) instead
  master       full fine-tuning in bf16: T x 4 (fp32 copies the optimizer updates); LoRA adapters have none
  adamw        T x 8 (exp_avg, exp_avg_sq in fp32); LoRA: T x 2a (the states in the adapters' dtype)
  grads        backward: T x w (full) or T x a (LoRA); step: T x 4 (fp32; LoRA: T x a)
  activations  backward only: tokens x layers x per-token-per-layer bytes (see per_token_layer; eager
               attention adds its saved S x S probabilities, see attention_scores), or with
               activation checkpointing tokens x layers x hidden x w + one layer's tokens x per-layer bytes
  logits       backward only: 1024-row chunks x vocab x 4 x 2 (moe8's chunked cross-entropy)
  loss_grads   backward only: the gradients moe8's chunked cross-entropy computes in its forward and holds
               until the backward: tokens x hidden x w (d hidden) + when the head trains (full) padded vocab x
               hidden x 4 (d weight, fp32)
  attention_scores  backward only, eager attention (GPT-OSS): ~3 more S x S tensors while a layer runs
  fp8_transient backward only, LoRA over FP8 bases: the largest frozen weight dequantised (x w), which the
               input gradient's bf16 GEMM reads one weight at a time
  overhead     5% of the above (allocator rounding, workspaces)
The load is a third phase: the model's parameters (all its experts, before ep splits them), LoRA over FP8 bases
holding the weights it adapts in FP8 (quantised as the model is built or loaded, finetune/fp8_load.py) plus
fp8_load_layer: the adapted weights of the decoder layer that has the most, in bf16 (x w), at most what is held
before its FP8 copies replace them. It is the peak only when the training phases hold less (ep > 1).
The optimizer step adds nothing: the trainer's AdamW is fused on CUDA (torch's default there, foreach, would
take sqrt(exp_avg_sq) of every tensor at once: T x 4 more).
The check adds 1 GiB for the CUDA context and kernels' workspaces to the estimate."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from ..hf.families import SINK_FAMILIES
from ..loss import padded_vocab
from .config import Config, FinetuneError

GiB = 2**30
CONTEXT = 1 * GiB  # CUDA context, cuBLAS / moe8 workspaces: outside max_memory_allocated
LOSS_CHUNK = 1024  # rows per chunk of the chunked cross-entropy


class MemoryCheckError(FinetuneError):
    """The estimated peak does not fit the GPU: raised before anything is loaded or written."""


@dataclass(frozen=True)
class Counts:
    """Parameter counts of a model config: total, in the experts modules, LoRA factors for cfg's targets."""

    total: int
    experts: int
    lora: int
    # the weights LoRA adapts (frozen bases, held in FP8 with fp8 blockwise): (parameters, bytes of their
    # blockwise FP8 copies: a byte each and an fp32 scale per 128 x 128 block, how many), Linear and experts
    lora_base: tuple = (0, 0, 0)
    lora_base_experts: tuple = (0, 0, 0)
    # elements of the largest of those weights: (a Linear's, an experts matrix's)
    lora_base_largest: tuple = (0, 0)
    # elements of those weights in the decoder layer that has the most: what loading holds in bf16 at once
    # with fp8 blockwise (finetune.fp8_load)
    lora_base_layer: int = 0


def count_params(config, cfg: Config) -> Counts:
    """Parameters of AutoModelForCausalLM.from_config(config) built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    from .routing import experts_modules

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if cfg.method == "lora":  # a target that matches nothing is refused here, before any weight is loaded
        from .model import lora_targets

        lora_targets(model, cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for _, m in experts_modules(model) for p in m.parameters())
    return Counts(total, experts, *lora_params(model, cfg))


def lora_params(model, cfg: Config) -> tuple[int, tuple, tuple, tuple, int]:
    """(LoRA factors moe8.lora adds: r x (in + out) per adapted Linear, E x r x (d1 + d2) per expert matrix;
    the Linear weights they adapt: (parameters, bytes in blockwise FP8, how many); the expert weights they
    adapt: the same; the largest of each: (elements, elements); the adapted elements of the decoder layer
    that has the most)."""
    from ..fp8 import Float8Recipe, fp8_nbytes, quantize_weight
    from ..lora import TARGETS
    from .fp8_load import decoder_layers
    from .routing import experts_modules

    layers = {name + ".": 0 for name, _ in decoder_layers(model)}  # decoder layer -> its adapted elements

    def add(acc, w, name: str) -> None:  # what freeze_fp8 keeps of w (on the meta device: shapes only)
        acc[0] += w.numel()
        acc[1] += fp8_nbytes(quantize_weight(w, 0, Float8Recipe("blockwise")))
        acc[2] += 1
        acc[3] = max(acc[3], w.numel())
        layer = next((p for p in layers if name.startswith(p)), None)
        if layer is not None:
            layers[layer] += w.numel()

    targets = set(cfg.lora_targets or TARGETS)
    r, n, base, experts = cfg.lora_r, 0, [0, 0, 0, 0], [0, 0, 0, 0]
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            n += r * (m.in_features + m.out_features)
            add(base, m.weight, name)
    if "experts" in targets:
        for name, m in experts_modules(model):
            for w in (m.gate_up_proj, m.down_proj):
                E, d1, d2 = w.shape
                n += E * r * (d1 + d2)
                add(experts, w, name)
    return n, tuple(base[:3]), tuple(experts[:3]), (base[3], experts[3]), max(layers.values(), default=0)


def adapter_bytes(cfg: Config) -> int:
    """Bytes of one LoRA adapter element (and of its gradient, and of each of its AdamW states): fp32 for
    lora_dtype "auto" (apply_lora's fp32 under a 16-bit model, the model's fp32 otherwise) and "float32"."""
    return 2 if cfg.lora_dtype in ("bfloat16", "float16") else 4


def eager_attention(config) -> bool:
    """Whether transformers runs this model's attention eagerly (S x S scores in memory): when the config
    says so, or when its CausalLM class has no SDPA path (GPT-OSS: its sinks) and so falls back to eager."""
    impl = getattr(config, "_attn_implementation", None)
    if impl:
        return impl == "eager"
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, ""), None)
    return cls is not None and not getattr(cls, "_supports_sdpa", True)


def attention_scores(config, cfg: Config, w: int) -> tuple[int, int]:
    """Eager attention's S x S tensors, (saved, transient) bytes: each layer saves its probabilities
    [micro_batch, heads, S, S (+1 with sinks)] for the backward (with activation checkpointing only the layer
    being recomputed); while a layer runs forward or backward about 3 more of that size exist (scores, the
    masked / shifted logits, their gradients). (0, 0) with SDPA / flash attention, and with moe8's fused
    attention (fuse_attention) for the families it covers."""
    if not eager_attention(config):
        return 0, 0
    if cfg.moe8 and cfg.fuse_attention and config.model_type in SINK_FAMILIES:  # moe8.attention: fused
        return 0, 0
    S = cfg.seq_len
    one = cfg.micro_batch * config.num_attention_heads * S * (S + 1) * w
    layers = 1 if cfg.activation_checkpointing else config.num_hidden_layers
    return layers * one, 3 * one


def per_token_layer(config, w: int) -> int:
    """Activation bytes one token leaves for the backward in one decoder layer (sdpa / flash attention: no
    S x S scores): attention 2H (norm in / out) + 2(q + 2kv) (projections before and after RoPE) + q (output)
    + 4 x heads (fp32 log-sum-exp); MoE 2H (norm) + k(H + 3I) (gathered rows, gate_up output, activation)
    + kH (expert outputs) + 8E (fp32 router logits and probabilities) + a shared expert's H + 3Is."""
    H = config.hidden_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or getattr(config, "qk_head_dim", None) or H // heads
    q, kvd = heads * hd, kv * hd
    attn = w * (2 * H + 2 * (q + 2 * kvd) + q) + 4 * heads
    k = getattr(config, "num_experts_per_tok", None) or getattr(config, "experts_per_token", 2)
    E = (
        getattr(config, "num_experts", None)
        or getattr(config, "num_local_experts", None)
        or getattr(config, "n_routed_experts", None)
        or 1
    )
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", None) or (
        (getattr(config, "n_shared_experts", None) or 0) * inter
    )
    moe = w * (2 * H + k * (H + 3 * inter) + k * H) + 8 * E + (w * (H + 3 * shared) if shared else 0)
    return attn + moe


@dataclass(frozen=True)
class Estimate:
    parts: dict  # name -> bytes at the peak (the larger phase, plus overhead)
    total: int
    backward: dict = field(default_factory=dict)  # name -> bytes of the backward peak (no overhead)
    step: dict = field(default_factory=dict)  # name -> bytes of the optimizer-step peak (no overhead)
    load: dict = field(default_factory=dict)  # name -> bytes while the model is loaded (no overhead)

    def table(self) -> str:
        unit, div = ("GiB", GiB) if self.total >= GiB else ("MiB", 2**20)
        rows = [f"{k} {v / div:.2f}" for k, v in self.parts.items() if v]
        return f"{self.total / div:.2f} {unit} (" + ", ".join(rows) + ")"


def estimate(config, cfg: Config, counts: Counts, dtype: torch.dtype) -> Estimate:
    w = 2 if dtype in (torch.bfloat16, torch.float16) else 4
    ep = max(1, cfg.ep)
    held = counts.total - counts.experts + counts.experts // ep
    lora = cfg.method == "lora"
    a = adapter_bytes(cfg)
    T = counts.lora if lora else held
    weights = held * w + (counts.lora * a if lora else 0)
    loaded = counts.total * w  # the load: every rank holds all the experts until they are split over ep
    fp8_transient = fp8_load_layer = 0
    if lora and cfg.moe8 and cfg.fp8 == "blockwise":  # LoRA over FP8 bases: their bf16 values freed
        (n, q, c), (ne, qe, ce) = counts.lora_base, counts.lora_base_experts
        weights += q - (n - c) * w + (qe - (ne - ce) * w) // ep  # each keeps a one-element placeholder
        loaded += q - (n - c) * w + qe - (ne - ce) * w
        # the input gradient reads one frozen weight at a time dequantised: the largest (an expert matrix's
        # experts split over ep)
        largest_linear, largest_experts = counts.lora_base_largest
        fp8_transient = max(largest_linear, largest_experts // ep) * w
        fp8_load_layer = counts.lora_base_layer * w  # quantised as loaded: one layer in bf16 at most
    master = T * 4 if (not lora and w == 2) else 0
    adamw = T * 2 * a if lora else T * 8
    grads_bwd, grads_step = (T * a, T * a) if lora else (T * w, T * 4)
    tokens = cfg.micro_batch * cfg.seq_len
    L = config.num_hidden_layers
    per = per_token_layer(config, w)
    if cfg.activation_checkpointing:
        acts = tokens * L * config.hidden_size * w + tokens * per
    else:
        acts = tokens * L * per
    scores_saved, scores_transient = attention_scores(config, cfg, w)
    acts += scores_saved
    logits = min(LOSS_CHUNK, tokens) * config.vocab_size * 4 * 2
    H = config.hidden_size
    loss_grads = tokens * H * w + (0 if lora else padded_vocab(config.vocab_size) * H * 4)
    backward = dict(
        weights=weights,
        master=master,
        adamw=adamw,
        grads=grads_bwd,
        activations=acts,
        logits=logits,
        loss_grads=loss_grads,
        fp8_transient=fp8_transient,
        attention_scores=scores_transient,
    )
    step = dict(
        backward, grads=grads_step, activations=0, logits=0, loss_grads=0, fp8_transient=0, attention_scores=0
    )
    load = dict(weights=loaded, fp8_load_layer=fp8_load_layer)
    parts = max(backward, step, load, key=lambda d: sum(d.values()))
    parts = dict(parts, overhead=sum(parts.values()) // 20)
    return Estimate(parts, sum(parts.values()), backward, step, load)


def memory_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # peak: KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def device_memory(device: torch.device) -> int | None:
    """Bytes of the GPU, None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def check(est: Estimate, capacity: int | None, cfg: Config) -> None:
    """MemoryCheckError with the figures and hints when est + the CUDA context exceeds capacity."""
    if capacity is None or est.total + CONTEXT <= capacity:
        return
    hints = []
    if cfg.method != "lora":
        hints.append("--method lora (no gradients or optimizer state for the base weights)")
    if not cfg.activation_checkpointing:
        hints.append("--activation_checkpointing (keep one hidden state per layer)")
    if cfg.micro_batch > 1:
        hints.append(f"--micro_batch {max(1, cfg.micro_batch // 2)} --grad_accum {cfg.grad_accum * 2}")
    if cfg.method == "full":
        hints.append("--ep N under torchrun (the experts split over N GPUs)")
    hints.append("--no-memory-check (run anyway)")
    raise MemoryCheckError(
        f"memory: the estimated peak is {est.table()}, plus {CONTEXT / GiB:.0f} GiB CUDA context: more than "
        f"the GPU's {capacity / GiB:.1f} GiB. Try:\n  " + "\n  ".join(hints)
    )
