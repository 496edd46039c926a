"""LoRA fine-tuning step speed of the full Qwen3-30B-A3B architecture on one GPU (48 layers, 30.5B parameters,
random init, bf16): transformers `grouped_mm` experts + PEFT LoRA (the baseline of
shared/data/baselines/h200.md) vs moe8.lora.apply_lora (expert LoRA through moe8's grouped GEMM, B·A never
formed). Same base weights, same batch, r=16, alpha=32, targets q,k,v,o + experts, gradient checkpointing
(non-reentrant), AdamW on the adapters only; median of --steps steps after --warmup.

    PYTHONPATH=python python bench/bench_lora_30b.py --adapter-dtype bfloat16 --peft-adapter-dtype float32 \
        --json bench/results/lora_30b_h200.json
    PYTHONPATH=python python bench/bench_lora_30b.py --layers 4 --steps 2     # quicker look on a GPU
    PYTHONPATH=python python bench/bench_lora_30b.py --tiny                   # smoke test, CPU is fine

Each variant runs in a child process of its own: it builds the model (no HF init, then a seeded in-place
normal_ fill, so every child gets bitwise the same base weights: their checksums are compared), adds LoRA,
trains, and rewrites its result file after every step. So at most one 61 GB model exists at a time, PEFT's
hooks and moe8's registration in transformers can't leak into the other variant, all GPU memory is returned
between them, and an OOM, crash or --timeout in one still leaves the other's numbers. The parent never
touches CUDA. --json is rewritten after each variant. Prints a table last: tokens/s, peak memory
(torch.cuda.max_memory_allocated over the training steps; load GiB: the peak while building and adding LoRA),
the ratio, and the targets (>= 2.0x the baseline, peak <= 64 GiB; the FP8 base: peak <= 40 GiB at >= 0.9x the
bf16 base's tokens/s).

Variants: peft (transformers grouped_mm + PEFT), moe8 (moe8.lora.apply_lora, bf16 base), moe8_fp8base (LoRA
over FP8 base weights: the frozen q,k,v,o and expert weights held as FP8 blockwise codes with 128x128 fp32
scales, the experts run with fp8="blockwise", the adapters in --adapter-dtype), moe8_fp8experts (the same with
only the expert weights in FP8 and q,k,v,o in bf16, 0.8 GiB more: what the FP8 dense GEMMs cost or save);
moe8_graphs and moe8_fp8base_graphs: moe8 and moe8_fp8base with each checkpointed layer's forward, and its
recomputation with its backward, replayed as CUDA graphs (moe8.graphs.capture_layers; the first step per layer
runs eagerly, the second captures). Per step the table's `issued` column is the host's time to issue the step
(up to the loss read) and `reserved` torch.cuda.max_memory_reserved, which counts the graphs' memory pool;
`step res` is the reserved peak of one more step after torch.cuda.empty_cache(): what a training step holds
from the device (with graphs, max_memory_allocated misses the memory a replay uses; the pool is reserved).
Per step the JSON also has `step_peak_gib`, the allocated peak within that step.

The FP8 base is quantised once, at load, a decoder layer at a time: the model is built on the meta device and
its parameters materialised on the GPU in the order, and from the seeded generator, that build() fills them
(so the weights are bitwise those of the other variants, checksums compared); as soon as a layer is filled its
LoRA-target weights are quantised (moe8.fp8.freeze_fp8) and their bf16 values freed. At most one layer
(~1.2 GiB) is ever held in bf16, so the load peaks near the FP8 model's ~29 GiB rather than at the bf16 model's
57 GiB (load GiB in the table); moe8.lora.freeze_base_fp8 after apply_lora then finds nothing left to quantise
(frozen_after_lora: 0). Expected training peak of moe8_fp8base on an H200 (an estimate: 27.0 GiB of expert
codes, 0.8 GiB of attention codes, 1.2 GiB of bf16 embeddings and LM head, 3.6 GiB of bf16 adapters and their
AdamW state, the 3.1 GiB above that steady state that the bf16 base measured, 63.7 against 60.5 GiB: the
adapters' gradients, checkpointed activations, one layer's recompute; ~0.6 GiB of transposed expert codes for
a layer's input gradient): about 36-37 GiB.

The first command above (four variants, --steps 3 after --warmup 2) takes about 3 minutes on one H200 (an
estimate from bench/results/lora_30b_h200.json: 54 s of wall time for the PEFT child, 32 s for moe8; each FP8
base ~35 s, its load quantising 29B values at ~3 TB/s, its steps assumed 0.7-0.9 s)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

VARIANTS = ("peft", "moe8", "moe8_fp8base", "moe8_fp8experts", "moe8_graphs", "moe8_fp8base_graphs")
GRAPHS = "_graphs"  # a variant with this suffix: its base variant with moe8.graphs.capture_layers
FP8_BASES = {"moe8_fp8base": True, "moe8_fp8experts": False}  # variant: attention in FP8 too
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # PEFT target_parameters
# Qwen3-30B-A3B's config.json (intermediate_size is unused: every layer is MoE)
QWEN3_30B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.001,
)
TINY = dict(
    QWEN3_30B,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)
GIB_COLUMNS = ("peak_gib", "load_peak_gib", "weights_gib", "steady_gib", "reserved_gib")
BASELINE = {"tokens_per_s": 5035, "peak_gib": 79.6}  # shared/data/baselines/h200.md (PEFT, q,k,v,o + experts)
TARGET_RATIO, TARGET_PEAK_GIB = 2.0, 64.0
FP8BASE_RATIO, FP8BASE_PEAK_GIB = 0.9, 40.0  # the FP8 base against the bf16 base's tokens/s; its peak
GiB = 2**30


# ------------------------------------------------------------------------------------------- child process
def build(args, device, dtype):
    """The model with uninitialised weights (HF's init skipped), then filled in place: normal(0, 0.02) for
    matrices (embeddings, projections, router, experts), ones for norms; seeded, so every build is the same."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    cfg = _config(args)
    with torch.device(device), no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    gen = torch.Generator(device).manual_seed(args.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, cfg.initializer_range, generator=gen)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
        sums = torch.stack([p.sum(dtype=torch.float32) for p in model.parameters()])
    model.train()
    return model, float(sums.double().sum()), hashlib.sha1(sums.cpu().numpy().tobytes()).hexdigest()[:16]


def _config(args):
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", num_hidden_layers=args.layers, **(TINY if args.tiny else QWEN3_30B)
    )
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"
    cfg.use_cache = False
    return cfg


def _freeze_layer(layer, attention=True):
    """Quantise a decoder layer's LoRA-target base weights (q,k,v,o and the experts, the ones
    moe8.lora.freeze_base_fp8 quantises after apply_lora; attention=False: the experts only) to FP8
    blockwise, dropping their bf16 values."""
    from moe8.lora import freeze_base_weights

    return freeze_base_weights(layer, (*ATTN, "experts") if attention else ("experts",))


def build_fp8_base(args, device, dtype, attention=True):
    """build()'s model with its LoRA-target weights stored in FP8 only, quantised a decoder layer at a time as
    the layer is filled (so no more than one layer is ever held in bf16). Built on the meta device, then each
    parameter materialised and filled in build()'s order from the same seeded generator (the same values);
    returns (model, checksum, fingerprint, weights quantised) with build()'s checksum of the bf16 values."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    cfg = _config(args)
    with torch.device("meta"), no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    gen = torch.Generator(device).manual_seed(args.seed)
    layers = model.model.layers
    names = [n for n, _ in model.named_parameters()]
    sums, frozen, current = [], 0, None
    with torch.no_grad():
        for name in names:
            owner, _, leaf = name.rpartition(".")
            mod = model.get_submodule(owner)
            i = int(name.split(".")[2]) if name.startswith("model.layers.") else None
            if current is not None and i != current:
                frozen += _freeze_layer(layers[current], attention)
            current = i
            meta = mod._parameters[leaf]
            p = torch.nn.Parameter(
                torch.empty(meta.shape, dtype=meta.dtype, device=device), meta.requires_grad
            )
            if p.dim() >= 2:
                p.normal_(0.0, cfg.initializer_range, generator=gen)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
            sums.append(p.sum(dtype=torch.float32))
            mod._parameters[leaf] = p
            del p, meta
        if current is not None:
            frozen += _freeze_layer(layers[current], attention)
    rotary = model.model.rotary_emb  # its buffers are computed at init: made again on the device
    with torch.device(device):
        model.model.rotary_emb = type(rotary)(config=cfg)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"build_fp8_base: still on the meta device: {left[:5]}")
    sums = torch.stack(sums)
    model.train()
    fingerprint = hashlib.sha1(sums.cpu().numpy().tobytes()).hexdigest()[:16]
    return model, float(sums.double().sum()), fingerprint, frozen


def add_peft(model, args):
    """PEFT LoRA as the baseline measured it: target_modules q,k,v,o; target_parameters on the fused experts
    (lora.ParamWrapper: W + s·B·A materialised per forward); adapters in fp32 (PEFT's autocast)."""
    import peft

    config = peft.LoraConfig(
        r=args.r,
        lora_alpha=args.alpha,
        lora_dropout=0.0,
        target_modules=list(ATTN),
        target_parameters=list(EXPERT_PARAMS),
        bias="none",
        task_type="CAUSAL_LM",
    )
    # checkpointing is already on: PEFT adds enable_input_require_grads(), as in any PEFT run
    return peft.get_peft_model(model, config)


def add_moe8(model, args, fp8=None):
    """moe8 LoRA; fp8="blockwise": the experts' base GEMMs in FP8 (the FP8 base's)."""
    import moe8
    from moe8.lora import apply_lora

    model = apply_lora(model, r=args.r, alpha=args.alpha, targets=(*ATTN, "experts"))
    fuse = set(args.moe8_fuse.split(",")) - {"none"}
    # as `moe8 finetune` runs it: routing, RMSNorms and RoPE fused too
    return moe8.accelerate(
        model,
        fp8=fp8 or "none",
        fuse_router="router" in fuse,
        fuse_norm=bool(fuse & {"norm", "norm_moe8", "norm_torch"}),
        # the fused norms on moe8.ops.rms_norm (norm_moe8), on torch's (norm_torch), or as the Config's "auto" picks
        norm_kernel="moe8" if "norm_moe8" in fuse else "torch" if "norm_torch" in fuse else "auto",
        fuse_rope="rope" in fuse,
        fused_lora_add="lora_add" in fuse,  # the expert LoRA's B projection added in one pass
        consume_gate_up="consume" in fuse,  # the experts' d h written over h
    )


def child(args):
    import torch

    v = args.only.removesuffix(GRAPHS)  # the base variant; the name in results and logs stays args.only
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    res = dict(
        variant=args.only, device=str(device), dtype=str(dtype).removeprefix("torch."), step_s=[], losses=[]
    )

    def save():
        with open(args.result, "w") as f:
            json.dump(res, f)

    def gib(x):
        return round(x / GiB, 2) if cuda else None

    def fold_peaks(res: dict) -> None:
        """peak_gib / reserved_gib: the largest max_memory_allocated / _reserved so far, over every span between
        two reset_peak_memory_stats (called before each reset and at the end)."""
        res["peak_gib"] = max(res.get("peak_gib", 0.0), gib(torch.cuda.max_memory_allocated()))
        res["reserved_gib"] = max(res.get("reserved_gib", 0.0), gib(torch.cuda.max_memory_reserved()))

    def log(msg):
        print(f"[{args.only}] {msg}", flush=True)

    try:
        from run_info import run_info  # bench/run_info.py (this folder is on sys.path)

        import moe8

        res["meta"] = dict(
            **run_info(device),
            moe8_cuda=moe8.cuda_available(),
        )
        if not cuda and not args.tiny and args.layers > 2:
            raise RuntimeError(
                "needs a CUDA GPU; on CPU use --tiny, or --layers 1 for a slow full-width check"
            )
        if v != "peft" and cuda and not moe8.cuda_available():
            raise RuntimeError("moe8 is built without CUDA kernels (build it with nvcc first)")
        t = time.perf_counter()
        if v in FP8_BASES:  # quantised a layer at a time as it is built: no whole bf16 model
            model, res["weights_sum"], res["weights_fingerprint"], res["frozen_at_load"] = build_fp8_base(
                args, device, dtype, FP8_BASES[v]
            )
        else:
            model, res["weights_sum"], res["weights_fingerprint"] = build(args, device, dtype)
        res["params"] = sum(p.numel() for p in model.parameters())
        res["build_s"], res["weights_gib"] = time.perf_counter() - t, gib(torch.cuda.memory_allocated())
        log(
            f"built {args.layers}-layer {'tiny ' if args.tiny else ''}Qwen3-30B-A3B: {res['params']:,} params, "
            f"{res['dtype']} on {device}, {res['build_s']:.1f} s, allocated {res['weights_gib']} GiB, "
            f"weights {res['weights_fingerprint']}"
        )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        t = time.perf_counter()
        if v == "peft":
            model = add_peft(model, args)
        elif v == "moe8":
            model = add_moe8(model, args)
        else:
            from moe8.lora import freeze_base_fp8

            model = add_moe8(model, args, fp8="blockwise")
            if FP8_BASES[v]:  # (it would quantise the attention of moe8_fp8experts)
                res["frozen_after_lora"] = freeze_base_fp8(model)  # 0: every target was quantised at load
        params = [p for p in model.parameters() if p.requires_grad]
        adapter_dtype = getattr(torch, args.peft_adapter_dtype if v == "peft" else args.adapter_dtype)
        with torch.no_grad():
            for p in params:
                p.data = p.data.to(adapter_dtype)
        res["trainable"] = sum(p.numel() for p in params)
        if v != "peft":
            from moe8.lora import base_nbytes

            # every parameter's bytes, the frozen base as bf16 or as FP8 codes and scales, adapters included
            res["base_bytes"] = base_nbytes(model)
        res["lora_s"] = time.perf_counter() - t
        res["adapter_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        res["with_lora_gib"] = gib(torch.cuda.memory_allocated())
        res["load_peak_gib"] = gib(torch.cuda.max_memory_allocated())  # building, quantising, adding LoRA
        base = model.get_base_model() if v == "peft" else model
        res["experts_implementation"] = base.config._experts_implementation
        res["gradient_checkpointing"] = base.is_gradient_checkpointing
        log(
            f"LoRA r={args.r} alpha={args.alpha}: {res['trainable']:,} trainable "
            f"({', '.join(res['adapter_dtypes'])}), {res['lora_s']:.1f} s, allocated {res['with_lora_gib']} GiB, "
            f"experts on {res['experts_implementation']}, checkpointing {res['gradient_checkpointing']}"
        )
        ids = torch.randint(
            0,
            model.config.vocab_size,
            (args.batch, args.seq),
            device=device,
            generator=torch.Generator(device).manual_seed(args.seed + 1),
        )
        if args.only.endswith(GRAPHS):  # each checkpointed layer's forward and backward as CUDA graphs
            import moe8.graphs

            res["graphed_layers"] = moe8.graphs.capture_layers(model)
        opt = torch.optim.AdamW(params, lr=args.lr, fused=cuda)
        chunked = v != "peft" and args.moe8_loss == "chunked"
        res["loss"] = "moe8.loss.chunked_cross_entropy" if chunked else "transformers (labels=)"
        if chunked:
            from moe8.loss import chunked_cross_entropy, hidden_states_as_logits

            target = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1).flatten()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        save()

        def step():
            if chunked:  # what `moe8 finetune` does: the LM head's logits a chunk at a time
                with hidden_states_as_logits(model) as head:
                    hidden = model(input_ids=ids).logits
                loss = chunked_cross_entropy(
                    hidden.flatten(0, 1), head.weight, target, chunk=args.ce_chunk, reduction="mean"
                )
                del hidden
            else:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()  # read after the step's time to issue is taken

        def allocator():  # cudaMalloc / cudaFree calls and allocation retries (which free the cache) so far
            m = torch.cuda.memory_stats()
            return [m.get("num_device_alloc", 0), m.get("num_device_free", 0), m.get("num_alloc_retries", 0)]

        res["allocator"] = []  # per step: [cudaMalloc calls, cudaFree calls, retries] during it
        res["issue_s"] = []  # per step: seconds until the host has issued it (step_s: until it is done)
        res["step_peak_gib"] = []  # per step: torch.cuda.max_memory_allocated during it
        for i in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize()
                before = allocator()
                fold_peaks(res)
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            loss = step()
            res["issue_s"].append(time.perf_counter() - t)  # the host's time to issue the step's work
            loss = loss.item()
            if cuda:
                torch.cuda.synchronize()
                res["allocator"].append([b - a for a, b in zip(before, allocator())])
            res["step_s"].append(time.perf_counter() - t)
            res["losses"].append(loss)
            if cuda:
                res["step_peak_gib"].append(gib(torch.cuda.max_memory_allocated()))
                fold_peaks(res)
            timed = res["step_s"][args.warmup :]
            if timed:
                res["tokens_per_s"] = args.batch * args.seq / statistics.median(timed)
            log(
                f"step {i} ({'warm-up' if i < args.warmup else 'timed'}): {res['step_s'][-1]:.3f} s, "
                f"loss {res['losses'][-1]:.5f}, peak {res.get('peak_gib')} GiB"
                + f" (issued in {res['issue_s'][-1]:.3f} s)"
                + (
                    ", cudaMalloc / cudaFree / retries {} / {} / {}".format(*res["allocator"][-1])
                    if cuda
                    else ""
                )
            )
            save()
        res["steady_gib"] = gib(torch.cuda.memory_allocated())  # weights + adapters + AdamW state
        if "graphed_layers" in res:
            import moe8.graphs

            res["graphs"] = moe8.graphs.stats(model)
            log(f"CUDA graphs: {res['graphs']}")
        # what a training step holds from the device once the cache has no leftovers of earlier steps
        if cuda:
            fold_peaks(res)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            step().item()
            res["step_reserved_gib"] = gib(torch.cuda.max_memory_reserved())
            res["step_allocated_gib"] = gib(torch.cuda.max_memory_allocated())
            log(
                f"one more step after emptying the cache: {res['step_reserved_gib']} GiB reserved at most, "
                f"{res['step_allocated_gib']} GiB allocated (graphs' pool: "
                f"{res.get('graphs', {}).get('pool_reserved_gib', 0.0)} GiB reserved)"
            )
            save()
        if args.profile:
            from profiling import profile_step  # bench/profiling.py (this folder is on sys.path)

            res["profile_top"] = profile_step(step, args.profile)
            save()
        # one more step with torch's synchronisation warnings: where the host waits for the GPU
        if args.sync_debug and cuda:
            import collections
            import warnings

            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step().item()
            torch.cuda.set_sync_debug_mode("default")
            where = collections.Counter(
                f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno} {str(w.message)[:80]}" for w in caught
            )
            res["syncs"] = where.most_common(12)
            log(f"synchronising calls in one step: {sum(where.values())} ({len(where)} places)")
            for place, n in res["syncs"]:
                log(f"  x{n:<5} {place}")
            save()
        if args.host_profile:
            from profiling import host_profile

            res["host_profile"] = host_profile(step, args.host_profile)
            save()
        if args.trace:  # a Chrome trace of one more step, and where its GPU idles
            from profiling import export_trace, gpu_gaps, print_gaps

            path = Path(args.trace) / f"lora_30b_{args.only}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            export_trace(step, path)
            res["gaps"] = gpu_gaps(json.loads(path.read_text()))
            print_gaps(f"[{args.only}] trace {path}", res["gaps"])
            save()
    except torch.cuda.OutOfMemoryError as e:
        res["error"] = "out of memory: " + str(e).split("\n")[0][:300]
        log(res["error"])
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        traceback.print_exc()
        log(res["error"])
    finally:
        if cuda:
            fold_peaks(res)
        save()


# ------------------------------------------------------------------------------------------ parent process
def run_variant(v, args, path):
    """Runs one variant in a child process (its output streams through); returns its result dict."""
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--only", v, "--result", path]
    t = time.perf_counter()
    try:
        rc = subprocess.run(cmd, timeout=args.timeout or None).returncode
        why = None if rc == 0 else f"child exited with {rc}"
    except subprocess.TimeoutExpired:
        why = f"timed out after {args.timeout} s (killed)"
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = dict(variant=v, step_s=[], losses=[])
    res["wall_s"] = time.perf_counter() - t
    if why and "error" not in res:
        res["error"] = why
    return res


def summary(args, results):
    peft, m8, f8, e8 = (results.get(v, {}) for v in VARIANTS[:4])
    meta = next((r["meta"] for r in results.values() if "meta" in r), {})
    out = dict(
        meta=dict(meta, date=time.strftime("%Y-%m-%d"), optimizer="AdamW (fused on CUDA), adapters only"),
        setup=dict(
            model="Qwen3-30B-A3B" + (" (tiny)" if args.tiny else ""),
            layers=args.layers,
            batch=args.batch,
            seq=args.seq,
            tokens_per_step=args.batch * args.seq,
            steps=args.steps,
            warmup=args.warmup,
            r=args.r,
            alpha=args.alpha,
            targets=[*ATTN, "experts"],
            adapter_dtype=args.adapter_dtype,
            peft_adapter_dtype=args.peft_adapter_dtype,
            moe8_loss=args.moe8_loss,
            moe8_fuse=args.moe8_fuse,
            ce_chunk=args.ce_chunk,
            gradient_checkpointing="non-reentrant",
            fp8_base="blockwise (1x128 activations, 128x128 weights), quantised per layer at load",
            lr=args.lr,
            seed=args.seed,
        ),
        variants=results,
        baseline_h200_md=BASELINE,
        targets=dict(
            ratio=TARGET_RATIO,
            peak_gib=TARGET_PEAK_GIB,
            fp8base_ratio_to_moe8=FP8BASE_RATIO,
            fp8base_peak_gib=FP8BASE_PEAK_GIB,
        ),
    )
    built = [r for r in results.values() if "weights_sum" in r]
    if len(built) > 1:
        out["same_base_weights"] = all(
            (r["weights_fingerprint"], r["weights_sum"])
            == (built[0]["weights_fingerprint"], built[0]["weights_sum"])
            for r in built
        )
    counts = [r["trainable"] for r in results.values() if "trainable" in r]
    if len(counts) > 1:
        out["same_trainable"] = len(set(counts)) == 1
    if peft.get("losses") and m8.get("losses"):
        out["step0_loss_diff"] = abs(peft["losses"][0] - m8["losses"][0])
    if f8.get("losses") and m8.get("losses"):
        out["fp8base_step0_loss_diff"] = abs(f8["losses"][0] - m8["losses"][0])
    if peft.get("tokens_per_s") and m8.get("tokens_per_s"):
        out["ratio"] = m8["tokens_per_s"] / peft["tokens_per_s"]
    if m8.get("tokens_per_s") and f8.get("tokens_per_s"):
        out["fp8base_ratio_to_moe8"] = f8["tokens_per_s"] / m8["tokens_per_s"]
    if peft.get("tokens_per_s") and f8.get("tokens_per_s"):
        out["fp8base_ratio_to_peft"] = f8["tokens_per_s"] / peft["tokens_per_s"]
    g8, gf8 = results.get("moe8_graphs", {}), results.get("moe8_fp8base_graphs", {})
    if m8.get("tokens_per_s") and gf8.get("tokens_per_s"):
        out["fp8base_graphs_ratio_to_moe8"] = gf8["tokens_per_s"] / m8["tokens_per_s"]
    if g8.get("tokens_per_s") and gf8.get("tokens_per_s"):
        out["fp8base_graphs_ratio_to_moe8_graphs"] = gf8["tokens_per_s"] / g8["tokens_per_s"]
    for name, r in (("moe8_graphs", g8), ("moe8_fp8base_graphs", gf8)):
        if peft.get("tokens_per_s") and r.get("tokens_per_s"):
            out[f"{name}_ratio_to_peft"] = r["tokens_per_s"] / peft["tokens_per_s"]
    if m8.get("tokens_per_s") and e8.get("tokens_per_s"):
        out["fp8experts_ratio_to_moe8"] = e8["tokens_per_s"] / m8["tokens_per_s"]
    return out


def _count(n):
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _target(name, value, unit, op, bound):
    if value is None:
        return f"{name}: n/a (target {op} {bound}{unit}: NOT met)"
    met = value >= bound if op == ">=" else value <= bound
    return f"{name}: {value:.2f}{unit} (target {op} {bound}{unit}: {'met' if met else 'NOT met'})"


def table(out):
    s, res = out["setup"], out["variants"]
    print(f"\n{out['meta']}")
    print(
        f"{s['model']}, {s['layers']} layers, {s['batch']}x{s['seq']} tokens, LoRA r={s['r']} alpha={s['alpha']} "
        f"on q,k,v,o + experts (moe8 {s['adapter_dtype']}, peft {s['peft_adapter_dtype']} adapters), non-reentrant checkpointing, median of "
        f"{s['steps']} after {s['warmup']}"
    )
    print(
        f"{'variant':<19} {'trainable':>10} {'build s':>8} {'step s':>7} {'tokens/s':>9} {'peak GiB':>9} "
        f"{'load GiB':>8} {'weights':>8} {'steady':>7} {'reserved':>8} {'step res':>8} {'issued':>6}  losses / error"
    )
    for v, r in res.items():
        timed = r["step_s"][s["warmup"] :]
        cells = [
            _count(r["trainable"]) if "trainable" in r else "-",
            f"{r['build_s']:.1f}" if "build_s" in r else "-",
            f"{statistics.median(timed):.3f}" if timed else "-",
            f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-",
            *(f"{r[k]:.1f}" if r.get(k) is not None else "-" for k in (*GIB_COLUMNS, "step_reserved_gib")),
            f"{statistics.median(r['issue_s'][s['warmup'] :]):.3f}"
            if r.get("issue_s", [])[s["warmup"] :]
            else "-",
        ]
        shown = [f"{x:.4f}" for x in r["losses"]]
        if len(shown) > 8:
            shown = [*shown[:6], "...", shown[-1]]
        tail = ", ".join(shown) + (f"  ERROR {r['error']}" if "error" in r else "")
        print(
            f"{v:<19} {cells[0]:>10} {cells[1]:>8} {cells[2]:>7} {cells[3]:>9} {cells[4]:>9} {cells[5]:>8} "
            f"{cells[6]:>8} {cells[7]:>7} {cells[8]:>8} {cells[9]:>8} {cells[10]:>6}  {tail}"
        )
    b = out["baseline_h200_md"]
    print(f"baseline in shared/data/baselines/h200.md: {b['tokens_per_s']:,} tokens/s, {b['peak_gib']} GiB")
    if "same_base_weights" in out:
        print(f"same base weights in every variant: {out['same_base_weights']}")
    if "same_trainable" in out:
        print(f"same trainable parameter count in every variant: {out['same_trainable']}")
    if "step0_loss_diff" in out:
        print(f"step-0 loss |peft - moe8| = {out['step0_loss_diff']:.2e} (LoRA B starts at zero)")
    if "fp8base_step0_loss_diff" in out:
        print(
            f"step-0 loss |moe8_fp8base - moe8| = {out['fp8base_step0_loss_diff']:.2e} (the FP8 base's error)"
        )
    bf16_bytes = res.get("moe8", {}).get("base_bytes")  # the base in the model dtype
    for v in FP8_BASES:
        r = res.get(v)
        if not r:
            continue
        print(
            f"{v}: {r.get('frozen_at_load')} weights quantised at load, {r.get('frozen_after_lora', '-')} left for "
            f"freeze_base_fp8; parameters {r.get('base_bytes', 0) / GiB:.3f} GiB"
            + (f" (moe8: {bf16_bytes / GiB:.3f} GiB)" if bf16_bytes else "")
        )
    t = out["targets"]
    if "moe8" in res:
        print(
            _target("moe8 / peft tokens/s", out.get("ratio"), "x", ">=", t["ratio"])
            + "; "
            + _target("moe8 peak", res["moe8"].get("peak_gib"), " GiB", "<=", t["peak_gib"])
        )
    for v, key in (
        ("moe8_fp8base", "fp8base_ratio_to_moe8"),
        ("moe8_fp8experts", "fp8experts_ratio_to_moe8"),
        ("moe8_fp8base_graphs", "fp8base_graphs_ratio_to_moe8"),
    ):
        if v in res:
            print(
                _target(f"{v} / moe8 tokens/s", out.get(key), "x", ">=", t["fp8base_ratio_to_moe8"])
                + "; "
                + _target(f"{v} peak", res[v].get("peak_gib"), " GiB", "<=", t["fp8base_peak_gib"])
            )


def _graphs_rows(out):
    for name in ("moe8_graphs", "moe8_fp8base_graphs"):
        r = out["variants"].get(name)
        if r and r.get("graphs"):
            g = r["graphs"]
            print(
                f"{name}: {g['layers']} layers graphed, {g['captured']} graphs captured, {g['replayed']} calls "
                f"replayed, {g['eager']} eager ({', '.join(f'{k}: {n}' for k, n in g['reasons'].items())}); "
                + _target("tokens/s / peft", out.get(f"{name}_ratio_to_peft"), "x", ">=", 2.5)
            )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 48; --tiny: 2)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per micro-batch (default 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 4096; --tiny: 64)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {VARIANTS}")
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32)
    ap.add_argument(
        "--adapter-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="moe8's LoRA parameters' (and so AdamW state's) dtype (default float32)",
    )
    ap.add_argument(
        "--peft-adapter-dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="the PEFT baseline's adapter dtype (default: --adapter-dtype); float32 is how PEFT keeps them "
        "(the baseline of shared/data/baselines/h200.md)",
    )
    ap.add_argument(
        "--moe8-loss",
        default="chunked",
        choices=("chunked", "hf"),
        help="moe8's loss: chunked (moe8.loss, as `moe8 finetune` runs it) or hf (the model's labels= loss)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after the timed steps, profile one more step and print the N ops with the most self device time",
    )
    ap.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="after the timed steps, run one more step under cProfile and print the N functions with the most "
        "own host time, and the garbage collections",
    )
    ap.add_argument(
        "--sync-debug",
        action="store_true",
        help="after the timed steps, run one more step with torch.cuda.set_sync_debug_mode('warn') and print "
        "where the host synchronises with the GPU",
    )
    ap.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="after the timed steps, save a Chrome trace of one more step in DIR and print where the GPU idles",
    )
    ap.add_argument(
        "--moe8-fuse",
        default="router,norm,rope,consume,lora_add",
        help="what moe8 fuses besides the experts, comma-separated from router, norm (on the Config's "
        '"auto" norm kernel; norm_moe8 / norm_torch: on moe8.Config.norm_kernel="moe8" / "torch"), rope, consume '
        "(moe8.Config.consume_gate_up) and lora_add (moe8.Config.fused_lora_add) (default: these five, as "
        "`moe8 finetune`), or none",
    )
    ap.add_argument(
        "--ce-chunk", type=int, default=1024, help="tokens per logits chunk of moe8's loss (default 1024)"
    )
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tiny", action="store_true", help="hidden 64, 4 experts, vocab 512: a smoke test, CPU ok"
    )
    ap.add_argument("--timeout", type=float, default=280, help="seconds per variant, 0: none")
    ap.add_argument("--json", default=None, help="write the results here (rewritten after each variant)")
    ap.add_argument("--only", default=None, help=argparse.SUPPRESS)  # child: run this variant
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)  # child: its result file
    args = ap.parse_args()
    args.layers = args.layers or (2 if args.tiny else 48)
    args.peft_adapter_dtype = args.peft_adapter_dtype or args.adapter_dtype
    args.batch = args.batch or 2
    args.seq = args.seq or (64 if args.tiny else 4096)
    if args.only:
        child(args)  # its outcome is in its result file, errors included
        return 0
    known = {"router", "norm", "norm_moe8", "norm_torch", "rope", "lora_add", "consume", "none"}
    bad = sorted(set(args.moe8_fuse.split(",")) - known)
    if bad:
        raise SystemExit(
            f"--moe8-fuse: unknown {bad}, expected from router, norm, norm_moe8, norm_torch, rope, lora_add, consume, or none"
        )
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}, expected from {VARIANTS}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            results[v] = run_variant(v, args, os.path.join(tmp, f"{v}.json"))
            out = summary(args, results)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)
    table(out)
    _graphs_rows(out)
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
