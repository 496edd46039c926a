"""Where a Hugging Face MoE training step's GPU time goes, per family: transformers (its default experts
implementation, `grouped_mm`) against moe8 (`moe8.accelerate(model, **fusions)`) and against peers, same process,
same weights, same batch: forward + backward + AdamW, bf16, random init. The optimizer is what transformers' Trainer
builds: torch's fused AdamW, and for the moe8 rows moe8.optim.AdamW (what moe8.enable() gives the Trainer;
--fusions fused_adamw=0 keeps torch's).

Each model is a slice of the real one: 2 decoder layers at the real hidden, expert, attention and vocabulary
sizes (attention through SDPA; GPT-OSS eager, its only built-in one for sinks); only DeepSeek-V3's expert count
is cut (256 -> 32 routed experts, 8 groups of 4, top-4 groups: one layer of 256 would be 11.3B parameters), and
its 2 layers are one dense (first_k_dense_replace) and one MoE. --fusions fuse_mlp=1 measures the fused dense
MLPs (off by default).

Rows per family: `transformers`, `moe8`, and the peers (--peers, bench/peers.py):
- `transformers (sonicmoe)`, `transformers (deepgemm)`: transformers' experts implementations that load a
  kernel from the Hugging Face Hub; a toy model is stepped once with each first, and when that raises (no
  `kernels` package, no Hub access) the row is "skipped" with the exception and why it cannot be installed.
- `transformers + Liger`: Liger Kernel's `apply_liger_kernel_to_<family>(model=model)` with its defaults
  (fused linear cross-entropy, RMSNorm, RoPE, SwiGLU / fused MoE experts where the family has them); Qwen2-MoE
  and OLMoE have no such function and get `_apply_liger_kernel_to_instance`, skipped when it changes nothing.
  These rows run after all others: Liger's patches also reassign names in the family's modeling module. On the
  CPU (--tiny) the patch is applied and the row skipped (its Triton kernels need a GPU).
Every row carries a status ("ran", "skipped" or "failed", with the reason) and, when it ran, tokens/s, peak
memory and both as ratios to the family's transformers row.

After the timed steps one more step runs under torch.profiler (shapes recorded); its kernels are classified
(bench/profiling.py classify_trace) into experts (router, moe8's plan / permute / grouped GEMM / combine, or
transformers' grouped_mm and its index ops), dense GEMMs (attention projections, shared experts, dense MLPs),
attention, LM head + loss, optimizer, norms/rope/elementwise, and idle (the profiled step's span minus its
kernel time).

    python bench/bench_step_profile.py --out bench/results            # six families with peers, ~4 min on an H200
    python bench/bench_step_profile.py --peers none --out /tmp/p      # transformers and moe8 only, ~2.5 min
    python bench/bench_step_profile.py --families qwen3 --fusions fuse_loss=0 --out /tmp/p
    python bench/bench_step_profile.py --families qwen3 --vocab 151669 --out /tmp/p   # an unaligned LM head
    python bench/bench_step_profile.py --tiny --out /tmp/p             # CPU smoke run: tiny configs, seconds

The Liger rows need `pip install liger-kernel==0.8.5` (pure Python and Triton). Writes step_profile_<gpu>.json
(run_info stamp, one row per family and implementation) to --out; prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hf_train import MODELS  # noqa: E402  (Qwen3-30B-A3B and Mixtral-8x7B shapes)
from peers import HUB_EXPERTS, LIGER, liger_version, prepare_liger, probe_experts  # noqa: E402
from profiling import CATEGORIES, profile_breakdown, region_hooks  # noqa: E402
from run_info import run_info  # noqa: E402

import moe8  # noqa: E402
from moe8 import hf  # noqa: E402
from moe8.config import fields  # noqa: E402
from moe8.loss import padded_vocab  # noqa: E402

FAMILIES = {  # name: (model_type, config at the real model's sizes; 2 layers)
    "qwen3": (MODELS["qwen3"][0], dict(MODELS["qwen3"][1], mlp_only_layers=[], decoder_sparse_step=1)),
    "mixtral": (MODELS["mixtral"][0], dict(MODELS["mixtral"][1])),
    "qwen2_moe": (  # Qwen1.5-MoE-A2.7B: 60 experts top-4 and a gated shared expert
        "qwen2_moe",
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            num_experts=60,
            num_experts_per_tok=4,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=151936,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=False,
        ),
    ),
    "olmoe": (  # OLMoE-1B-7B: 64 experts top-8
        "olmoe",
        dict(
            hidden_size=2048,
            intermediate_size=1024,
            num_experts=64,
            num_experts_per_tok=8,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=50304,
        ),
    ),
    "gpt_oss": (  # GPT-OSS-20B: 32 experts top-4, biases, sinks, a sliding-window and a full layer
        "gpt_oss",
        dict(
            hidden_size=2880,
            intermediate_size=2880,
            num_local_experts=32,
            num_experts_per_tok=4,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=201088,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "deepseek_v3": (  # DeepSeek-V3: MLA, a dense first layer, 1 shared expert; routed experts cut to 32
        "deepseek_v3",
        dict(
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            n_routed_experts=32,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            first_k_dense_replace=1,
            num_attention_heads=128,
            num_key_value_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            vocab_size=129280,
        ),
    ),
}

PEERS = ("liger", "sonicmoe", "deepgemm")  # --peers: Liger Kernel, transformers' hub-kernel experts

EAGER_ONLY = {
    "gpt_oss": "eager"
}  # transformers' GPT-OSS has no SDPA path (its sinks); FA3 needs a hub kernel

TINY = dict(  # --tiny: every family at toy sizes; an odd vocabulary takes the fused loss's padded path
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    vocab_size=1001,
    sliding_window=8,
)


def build(name, tiny, device, dtype, vocab=0, experts="grouped_mm"):
    import transformers

    family, over = FAMILIES[name]
    over = dict(over)
    if tiny:
        over.update(
            {k: v for k, v in TINY.items() if k in over or k == "head_dim" and family != "deepseek_v3"}
        )
        if family == "deepseek_v3":  # MLA: as many key / value heads as query heads
            over["num_key_value_heads"] = over["num_attention_heads"]
    if vocab:
        over["vocab_size"] = vocab
    cfg = transformers.AutoConfig.for_model(family, num_hidden_layers=2, max_position_embeddings=4096, **over)
    cfg._attn_implementation = "eager" if tiny else EAGER_ONLY.get(family, "sdpa")
    cfg._experts_implementation = (
        experts  # grouped_mm: transformers' default (get_correct_experts_implementation)
    )
    if hasattr(cfg, "output_router_logits"):
        cfg.output_router_logits = True  # the aux loss, as the Trainer trains these models
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model


def fusions_of(spec: str) -> dict:
    """--fusions: "default" (moe8.Config's), "none" (the experts alone) or field=0|1 pairs."""
    names = [
        f for f in fields() if f.startswith("fuse_") or f in ("routed_down", "fused_lora_add", "fused_adamw")
    ]
    if spec == "default":
        return {}
    if spec == "none":
        return {f: False for f in names if f.startswith("fuse_")}
    out = {}
    for item in spec.split(","):
        m = re.fullmatch(r"(\w+)=([01])", item.strip())
        if m is None or m.group(1) not in names:
            raise SystemExit(
                f"--fusions: expected default, none or FIELD=0|1 with FIELD from {names}, got {item!r}"
            )
        out[m.group(1)] = m.group(2) == "1"
    return out


def optimizer_for(model, device, moe8_adamw: bool):
    """What a Trainer would build for the model: moe8.optim.AdamW for a moe8 row (moe8.enable() gives it where
    Config.fused_adamw), else torch's AdamW, fused on CUDA."""
    cls = moe8.optim.AdamW if moe8_adamw else torch.optim.AdamW
    return cls(model.parameters(), lr=1e-5, fused=device.type == "cuda")


def measure(model, ids, steps, warmup, device, opt):
    """Median step seconds, peak GiB, losses, the profiled step's breakdown (ms per category), the peak per
    phase, and that step's GPU idle time by CPU op (the longest first), training with the optimizer opt."""
    model.train()

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(warmup + steps):
        sync()
        t = time.perf_counter()
        losses.append(step())
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    phases = phase_peaks(model, ids, opt) if device.type == "cuda" else {}
    vocab = model.config.vocab_size
    hooks = region_hooks(model)
    try:
        gaps = {}
        split = profile_breakdown(step, (vocab, padded_vocab(vocab)), gaps=gaps)
    finally:
        for h in hooks:
            h.remove()
    idle = gaps.get("idle_by_op", [])
    return statistics.median(times), peak, [float(x) for x in losses], split, phases, idle


def phase_peaks(model, ids, opt) -> dict:
    """One more step on CUDA, its peak GiB per phase (the allocator's peak reset before each): the forward
    (with the loss), the backward, the optimizer step; and what is allocated when the backward starts (the
    weights, optimizer state and the activations the backward will read)."""
    gib = 2**30
    out = {}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss = model(input_ids=ids, labels=ids).loss
    torch.cuda.synchronize()
    out["forward"] = torch.cuda.max_memory_allocated() / gib
    out["backward_start"] = torch.cuda.memory_allocated() / gib
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    out["backward"] = torch.cuda.max_memory_allocated() / gib
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    out["optimizer"] = torch.cuda.max_memory_allocated() / gib
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, from {list(FAMILIES)}")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per model (default 3)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--fusions",
        default="default",
        help="the moe8 column's Config fields: default, none (experts only) or e.g. fuse_loss=0,fuse_norm=1",
    )
    ap.add_argument(
        "--vocab",
        type=int,
        default=0,
        help="vocabulary size for every family (default: each model's own), e.g. 151669, Qwen3's tokenizer: "
        "the LM head's alignment at work",
    )
    ap.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"rows beside transformers and moe8: comma-separated from {list(PEERS)}, or none (default: all)",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: toy configs, fp32, batch 2 x 32")
    ap.add_argument("--out", required=True, help="directory for step_profile_<device>.json")
    a = ap.parse_args()
    names = a.families.split(",")
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise SystemExit(f"--families: unknown {unknown}, expected from {list(FAMILIES)}")
    if len(set(names)) != len(names):
        raise SystemExit(f"--families: each family once, got {names}")
    peers = set() if a.peers == "none" else set(a.peers.split(","))
    if peers - set(PEERS):
        raise SystemExit(
            f"--peers: unknown {sorted(peers - set(PEERS))}, expected from {list(PEERS)} or none"
        )
    for flag in ("batch", "seq", "steps"):
        if getattr(a, flag) < 1:
            raise SystemExit(f"--{flag}: expected >= 1, got {getattr(a, flag)}")
    if a.vocab < 0:
        raise SystemExit(f"--vocab: expected >= 1 (or 0: the models' own), got {a.vocab}")
    if a.warmup < 0:
        raise SystemExit(f"--warmup: expected >= 0, got {a.warmup}")
    fusions = fusions_of(a.fusions)
    if a.tiny:
        device, dtype, a.batch, a.seq = torch.device("cpu"), torch.float32, 2, 32
    else:
        if not moe8.cuda_available():
            raise SystemExit("bench_step_profile: needs a CUDA GPU and moe8 built with CUDA (or --tiny)")
        device, dtype = torch.device("cuda"), torch.bfloat16

    hub = [h for h in HUB_EXPERTS if HUB_EXPERTS[h][0] in peers]
    # Liger's rows come last: apply_liger_kernel_to_<family> reassigns names in the family's modeling module
    # (apply_rotary_pos_emb, the RMSNorm and experts classes), not only the instance's modules, so a
    # transformers or moe8 row built after it would run Liger's kernels. Each family's patch touches its own
    # modeling module only (cross_entropy stays off), so one family's Liger row leaves the others' alone.
    plan = [(n, i) for n in names for i in ("transformers", "moe8")] + [(n, h) for n in names for h in hub]
    plan += [(n, LIGER) for n in names if "liger" in peers]
    meta = {
        **run_info(device),
        "liger_kernel": liger_version() or "not installed",
        "dtype": str(dtype).replace("torch.", ""),
        "optimizer": "torch AdamW"
        + (" fused" if device.type == "cuda" else "")
        + "; moe8 rows: moe8.optim.AdamW where Config.fused_adamw (what moe8.enable() gives transformers' Trainer)",
        "batch": a.batch,
        "seq": a.seq,
        "steps": a.steps,
        "warmup": a.warmup,
        "fusions": fusions or "moe8.Config() defaults",
        "peers": sorted(peers),
        "tiny": a.tiny,
        "vocab": a.vocab or "each model's own",
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = "cpu" if device.type == "cpu" else re.sub(r"[^a-z0-9]+", "_", meta["gpu"].lower()).strip("_")
    path = out / f"step_profile_{gpu}.json"
    order = {i: k for k, i in enumerate(("transformers", "moe8", *hub, LIGER))}
    rows = []
    for k, (name, impl) in enumerate(plan):
        rows.append({**run_row(name, impl, a, device, dtype, fusions), "run_order": k})
        rows.sort(key=lambda r: (names.index(r["family"]), order[r["impl"]]))
        compare(rows)
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))  # each time: a crash keeps them
        moe8.disable()  # RoPE's fusion is process-wide: the next transformers column must not get it
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{meta}\nwrote {path}")
    report(rows, names, device)


def compare(rows):
    """Each row that ran against its family's transformers row: speed-up, peak ratio, first-step loss."""
    for r in rows:
        base = next((b for b in rows if b["family"] == r["family"] and b["impl"] == "transformers"), None)
        if r["status"] == "ran" and base is not None:
            r["speedup_vs_transformers"] = base["step_ms"] / r["step_ms"]
            r["peak_vs_transformers"] = r["peak_gib"] / base["peak_gib"] if base["peak_gib"] else None
            # same weights and batch: the first step's loss differs by rounding only (a wrong kernel shows here)
            r["first_loss_rel_diff"] = abs(r["losses"][0] - base["losses"][0]) / abs(base["losses"][0])


def run_row(name, impl, a, device, dtype, fusions) -> dict:
    """One row of the table: the family's model under `impl`, measured; or, for a peer that cannot run here,
    status "skipped" (or "failed") and the reason."""
    row = {"family": name, "model_type": FAMILIES[name][0], "impl": impl}
    experts, info = "grouped_mm", None
    if impl in HUB_EXPERTS:
        experts, why = HUB_EXPERTS[impl]
        error = probe_experts(lambda: build(name, True, device, torch.bfloat16, experts=experts), device)
        if error is not None:
            return {**row, "status": "skipped", "reason": f"{error} ({why})", "error": error, "why": why}
    try:
        model = build(name, a.tiny, device, dtype, a.vocab, experts)
        if impl == "moe8":
            moe8.accelerate(model, **fusions)
        if impl == LIGER:
            reason, info = prepare_liger(model, device)
            if reason is not None:
                return {**row, "status": "skipped", "reason": reason, "liger": info}
        ids = torch.randint(
            0, model.config.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0)
        )
        ids = ids.to(device)
        print(f"[bench] {name} {impl}: {a.warmup + a.steps} steps + 1 profiled", flush=True)
        cfg = hf.config_of(model) if impl == "moe8" else None
        opt = optimizer_for(model, device, cfg is not None and cfg.fused_adamw)
        sec, peak, losses, split, phases, idle = measure(model, ids, a.steps, a.warmup, device, opt)
    except Exception as e:  # noqa: BLE001  (a peer that fails is reported, the other rows still run)
        if impl in ("transformers", "moe8"):
            raise
        return {**row, "status": "failed", "reason": f"{type(e).__name__}: " + " ".join(str(e).split())}
    row.update(
        status="ran",
        optimizer=type(opt).__module__ + "." + type(opt).__name__,
        config={k: getattr(cfg, k) for k in fields() if k != "fp8"} if cfg else None,
        layers=model.config.num_hidden_layers,
        params=sum(p.numel() for p in model.parameters()),
        vocab=model.config.vocab_size,
        step_ms=sec * 1e3,
        tokens_per_s=a.batch * a.seq / sec,
        peak_gib=peak,
        peak_phases_gib=phases,  # CUDA: forward / backward_start / backward / optimizer (phase_peaks)
        losses=losses,
        profile_ms=split,
        idle_by_op=idle,  # the profiled step's GPU idle time by the CPU op covering it (profiling.gpu_gaps)
    )
    if info is not None:
        row["liger"] = info
    return row


def report(rows, names, device):
    """The table (every row that ran: tokens/s, speed-up and peak memory against the family's transformers
    row, ms per category), the peers that did not run and why, and one line per family."""
    unit = "ms (CPU op time)" if device.type == "cpu" else "ms of GPU time in the profiled step"
    short = ["experts", "dense", "attn", "head+loss", "optim", "elementw", "idle"]
    print(
        f"{'family':<12} {'impl':<24} {'step ms':>8} {'tok/s':>9} {'vs HF':>6} {'GiB':>5} "
        + " ".join(f"{s:>9}" for s in short)
    )
    ran = [r for r in rows if r["status"] == "ran"]
    for r in ran:
        p = r["profile_ms"]
        cells = " ".join(f"{p[c]:>9.1f}" for c in (*CATEGORIES, "idle"))
        print(
            f"{r['family']:<12} {r['impl']:<24} {r['step_ms']:>8.1f} {r['tokens_per_s']:>9,.0f} "
            f"{r['speedup_vs_transformers']:>5.2f}x {r['peak_gib']:>5.1f} {cells}"
        )
    for impl in dict.fromkeys(r["impl"] for r in rows if r["status"] != "ran"):
        by_reason = {}
        for r in rows:
            if r["impl"] == impl and r["status"] != "ran":
                by_reason.setdefault((r["status"], r["reason"]), []).append(r["family"])
        for (status, reason), fams in by_reason.items():
            print(f"{impl} not run ({status}) for {', '.join(fams)}: {reason}")
    for name in names:
        fam = [r for r in ran if r["family"] == name and r["impl"] != "transformers"]
        ratios = ", ".join(f"{r['impl']} {r['speedup_vs_transformers']:.2f}x" for r in fam)
        print(f"{name}: {ratios} transformers' step ({unit} per category above)")


if __name__ == "__main__":
    main()
