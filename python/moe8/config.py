"""moe8.config — one frozen configuration per model: what moe8 does to it and how its layers run.

`moe8.enable(**fields)` sets the Config given to models built afterwards, `moe8.accelerate(model, **fields)`
attaches one to a model that exists; every MoE layer of the model reads its model's Config, so two models in
one process can differ. `moe8.experts_forward(..., config=Config(...))` takes one directly. Defaults that the
environment may change (moe8._env) are read once, at import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union

from ._env import ENV
from .fp8 import Float8Recipe, _recipe, cache_named
from .fp8_rules import dense_kinds

TRANSPORTS = ("auto", "nccl", "ipc")
NORM_KERNELS = ("auto", "torch", "moe8")


@dataclass(frozen=True)
class Config:
    """How moe8 runs a model's MoE layers (immutable; `replace(**changes)` gives a changed copy).

    fp8: None (expert GEMMs in the model's dtype) or an FP8 recipe for them: "blockwise" (1x128 / 128x128
        scales, the DeepSeek-V3 recipe), "rowwise", "tensorwise" or a moe8.fp8.Float8Recipe (dgrad / wgrad in
        FP8 too), or "auto" (blockwise with FP8 dgrad, only for the GEMMs whose shape makes FP8 pay,
        moe8.fp8_rules.fp8_pays). Experts with moe8 LoRA run their base GEMMs in it, the adapters' GEMMs in
        the model's dtype.
    routed_down: run the experts' activation, down projection and combine as one op
        (moe8.fused.activation_down_combine) when the down projection has no bias and no LoRA: neither the
        activations nor the expert outputs are kept for the backward (default on; MOE8_ROUTED_DOWN=0).
    consume_gate_up: the experts' backward writes d h over the gate_up output (one [R, 2I] buffer less at the
        backward's peak, the same bits); a second backward through the same graph (retain_graph=True) then
        raises, so set False for that.
    keep_permuted: the experts' up projection keeps its input rows in expert order ([R, H], R = tokens x top-k)
        from the forward for its weight gradient, as experts with LoRA always do; off by default: the backward
        keeps the tokens x ([T, H]) and gathers their rows again (one [R, H] buffer less held from the forward
        to the backward and at the backward's peak, for one more gather pass; the same bits).
    gather_in_gemm: without keep_permuted, the up projection's GEMM reads x's rows in expert order inside its
        operand load where a kernel does that (bf16 without a bias on sm_90a), so the forward writes no [R, H]
        copy of them (the same bits); off by default until that kernel is faster than the gather and the GEMM
        (docs/kernels.md).
    fused_act_dgrad: with routed_down in bf16, the down projection's input gradient runs the activation's backward
        and the routing weights' gradient in its GEMM's epilogue where a kernel does that (sm_90a, SwiGLU with h
        as [gate | up]), so d act [R, I] is never written and read back (the same bits for d h; the routing
        weights' gradient summed in another order); off by default until measured faster than the GEMM and the
        pass.
    fused_act_forward: with routed_down in bf16, the up projection's GEMM computes the activation in its epilogue
        where a kernel does that (sm_90a, SwiGLU with h as [gate | up], I a multiple of 128: ops.grouped_gemm_swiglu)
        and hands it to the down projection, so h is not read back (the same bits); off by default until measured
        faster than the GEMM and the activation pass (docs/kernels.md).
    fused_lora_add: the expert LoRA's B projection added to the base GEMM's output in one pass
        (ops.grouped_lowrank_add; 1.8-1.9x faster than the GEMM and the add at ranks 16 and 32 on the H200,
        bench/results/lowrank_h200.md); False runs the two.
    check_ids: range-check the expert ids on the device in the experts' plan (a host sync on CUDA, which also
        keeps the call out of CUDA graphs); the HF integration's ids come from a top-k, so it is off there.
        Off, ids out of range on a GPU join no expert (the kernels skip them: wrong numbers, never a read or
        write outside a tensor); on the CPU they are always checked (no sync there).
    The six fusions of the HF integration are on by default (each keeps transformers' results: < 1e-5 in
    fp32, tests/python/test_hf.py and test_attention.py); False opts out:
    fuse_router: route with moe8's fused top-k kernel (the router module is still called and still returns
        its logits, so hooks keep working).
    fuse_norm: each RMSNorm as one fused kernel, forward and backward (rounded once in 16-bit).
    norm_kernel: which kernel the fused RMSNorm runs: "torch" (torch.nn.functional.rms_norm), "moe8"
        (moe8.ops.rms_norm: the same semantics, fp32 statistics and one rounding; its weight gradient is summed
        in a fixed order, the same bits on every run) or "auto" (the default: moe8's where it measured faster,
        many narrow rows on a GPU such as Qwen3's per-head q_norm, moe8.norm.moe8_norm_pays; else torch's).
    fuse_rope: rotary embeddings with one fused kernel per tensor (process-wide while on: transformers'
        attention looks the function up in its modeling module; moe8.disable() restores it).
    fuse_loss: a causal LM's training loss from its final hidden states, a chunk of rows at a time, without
        [tokens, vocabulary] logits (outputs.logits is None in a training forward with labels; any vocabulary
        size runs aligned GEMMs, moe8.loss.padded_vocab).
    fuse_attention: attention with sinks (GPT-OSS, whose transformers attention is eager: S x S scores,
        probabilities and their gradients per layer) through PyTorch's fused SDPA kernels with the sinks
        applied from the log-sum-exp (moe8.attention; process-wide while on, as fuse_rope; no attention
        weights returned; a nonzero attention dropout runs transformers' eager path). On an H200 the
        GPT-OSS-20B slice's step ran 1.49x transformers' against 1.09x without it, at 23.5 GiB against 29.8
        (bench/results/step_profile_gptoss_h200.md).
    packed_attention: rows of packed documents through varlen flash attention when the caller gives the
        documents' offsets (transformers' flash-attention kwargs cu_seq_lens_q / _k and max_length_q / _k, from
        moe8.attention.packed_sequences or DataCollatorWithFlattening; moe8 finetune passes them): transformers'
        "sdpa" attention function becomes moe8.attention.packed_attention_forward (process-wide while on, as
        fuse_rope), which runs sdpa itself for any call without them. On an H200, one Qwen3-30B-A3B layer's
        attention over documents packed in 2 x 4096 tokens ran 1.65 ms forward and backward against 6.30 ms
        through the block-diagonal mask sdpa is given.
    fuse_mlp: the dense gated MLPs (shared experts, dense layers: gate_proj, up_proj, down_proj without
        bias) as one gate+up GEMM on the concatenated weights and moe8's SwiGLU kernel (off by default:
        measure it, bench/bench_step_profile.py --fusions fuse_mlp=1).
    fused_adamw: with enable(), transformers' Trainer builds moe8.optim.AdamW where its optim is "adamw_torch" or
        "adamw_torch_fused" (the default): the same update, its CUDA tensors stepped by moe8's kernel at the
        memory's rate (process-wide, until disable()).
    fp8_dense: the dense layers in FP8 too, with fp8's recipe (moe8.fp8_linear.convert_to_fp8): True (the
        attention projections, shared experts and dense MLPs), or the kinds to convert, a subset of
        ("attention", "shared_expert", "mlp"); routers, embeddings, norms and the LM head stay as they are.
        Needs fp8. fp8_dense_skip_first_last: the first and last decoder layers stay in the model's dtype.
    fp8_cache: what the FP8 weight copies cost between calls: "frozen" (the default: weights that train are
        quantised at every use, forward and FP8 dgrad, each in one pass, and nothing of them is held, so the
        FP8 step's peak is bf16's; frozen weights, LoRA bases, are cached in both layouts), "both" (every
        weight's forward and, with FP8 dgrad, backward layout, made in one pass and kept until the next
        optimizer step: one quantisation pass per step instead of two per micro-batch, for 1 byte per weight
        element of each layout on top of the peak), "one" (one layout kept, the other derived from it for each
        use: at most half the bf16 weights' bytes), "none" (quantised at every call, frozen weights too),
        "handoff" ("frozen", but a blockwise weight that trains gets its forward and FP8-dgrad copies from one
        pass in the forward, the dgrad's held to the backward: one weight pass per micro-batch instead of
        two, for half the bf16 weight's bytes held from the forward to the backward).
    transport: how tokens reach their experts' ranks under expert parallelism (moe8.parallel.parallelize,
        which takes the group sizes from its mesh): "nccl" (all-to-all), "ipc" (direct GPU-to-GPU writes
        within one node) or "auto" (ipc when the experts are on CUDA and the expert-parallel group is on one
        host, else nccl; see moe8.parallel.parallelize).
    fp8_dispatch: under expert parallelism with FP8 expert GEMMs (fp8 set), the tokens travel to their
        experts' ranks as e4m3 codes with 1x128 scales, about half the bytes of bf16 (default on; the
        combine and the backward stay in the model's dtype).
    ep_chunks: under expert parallelism over the nccl transport, the tokens of a layer go in this many parts,
        each part's expert GEMMs overlapping the next part's all_to_all (1: one part, no overlap; the outputs
        are the same bits either way, the expert weight gradients the same up to rounding).
    """

    fp8: Optional[Union[str, Float8Recipe]] = None
    routed_down: bool = field(default_factory=lambda: ENV["routed_down"])
    consume_gate_up: bool = True
    keep_permuted: bool = False
    gather_in_gemm: bool = False
    fused_act_dgrad: bool = False
    fused_act_forward: bool = False
    fused_lora_add: bool = True
    check_ids: bool = False
    fuse_router: bool = True
    fuse_norm: bool = True
    norm_kernel: str = "auto"
    fuse_rope: bool = True
    fuse_attention: bool = True
    packed_attention: bool = True
    fuse_loss: bool = True
    fuse_mlp: bool = False
    fused_adamw: bool = True
    transport: str = "auto"
    fp8_dispatch: bool = True
    ep_chunks: int = 1
    # FP8 for the dense layers (moe8.fp8_linear)
    fp8_dense: Union[bool, str, tuple] = False
    fp8_dense_skip_first_last: bool = False
    fp8_cache: str = "frozen"

    def __post_init__(self):
        fp8 = self.fp8
        if fp8 in ("none", "bf16"):  # the spellings of "off" in configs and flags
            fp8 = None
        if fp8 is not None and not isinstance(fp8, Float8Recipe):
            fp8 = _recipe(fp8)  # raises on an unknown recipe
        object.__setattr__(self, "fp8", fp8)
        for name in (
            "routed_down",
            "consume_gate_up",
            "keep_permuted",
            "gather_in_gemm",
            "fused_act_dgrad",
            "fused_act_forward",
            "fused_lora_add",
            "check_ids",
            "fuse_router",
            "fuse_norm",
            "fuse_rope",
            "fuse_attention",
            "packed_attention",
            "fuse_loss",
            "fp8_dispatch",
            "fuse_mlp",
            "fused_adamw",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if isinstance(self.ep_chunks, bool) or not isinstance(self.ep_chunks, int) or self.ep_chunks < 1:
            raise ValueError(f"ep_chunks: expected an integer >= 1, got {self.ep_chunks!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: expected one of {list(TRANSPORTS)}, got {self.transport!r}")
        if self.norm_kernel not in NORM_KERNELS:
            raise ValueError(f"norm_kernel: expected one of {list(NORM_KERNELS)}, got {self.norm_kernel!r}")
        self._check_fp8_dense()

    def _check_fp8_dense(self) -> None:
        kinds = dense_kinds(self.fp8_dense)
        object.__setattr__(self, "fp8_dense", kinds)  # normalised: () off, else the kinds converted
        if kinds and self.fp8 is None:
            raise ValueError(f"fp8_dense: {self.fp8_dense!r} needs an FP8 recipe in fp8, got fp8=None")
        cache_named(self.fp8_cache)  # raises on an unknown name
        if not isinstance(self.fp8_dense_skip_first_last, bool):
            raise ValueError(
                f"fp8_dense_skip_first_last: expected True or False, got {self.fp8_dense_skip_first_last!r}"
            )

    def replace(self, **changes) -> Config:
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"moe8.Config has no field(s) {unknown}; fields: {fields()}")
        return dataclasses.replace(self, **changes)


def fields() -> list:
    """The names of Config's fields."""
    return [f.name for f in dataclasses.fields(Config)]


DEFAULT = Config()
