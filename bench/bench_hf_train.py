"""Training-step speed of Hugging Face MoE models: transformers' `grouped_mm` experts vs moe8 (`moe8.accelerate`),
same model, same weights, same batch: forward + backward + fused AdamW, bf16, random init. With --fp8 RECIPE
also moe8 with the expert GEMMs in FP8 (column moe8_fp8; the losses show how far FP8 training moves them);
with --fuse-loss the moe8 columns also compute the loss without logits (fuse_loss=True).

    python bench/bench_hf_train.py --models qwen3,mixtral --json bench/results/hf_train_h200.json

Prints a table last: model, layers, batch, HF tokens/s, moe8 tokens/s, ratio, peak memory of each (and the
FP8 column's tokens/s, ratio and peak)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_layer import recipe_of  # this folder is on sys.path
from run_info import run_info

import moe8

MODELS = {  # name: (family, config overrides, layers) — expert shapes of the real models, fewer layers
    "qwen3": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            moe_intermediate_size=768,
            intermediate_size=6144,
            num_experts=128,
            num_experts_per_tok=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            norm_topk_prob=True,
        ),
        4,
    ),
    "mixtral": (
        "mixtral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
        ),
        2,
    ),
}


def build(name, layers, dtype=torch.bfloat16, device="cuda", models=MODELS):
    """The model `name` of `models` (family, config overrides, default layers), HF's random init after
    torch.manual_seed(0): every build of a name gives the same weights."""
    import transformers

    family, over, default_layers = models[name]
    cfg = transformers.AutoConfig.for_model(
        family, num_hidden_layers=layers or default_layers, max_position_embeddings=4096, **over
    )
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model


def measure(model, batch, seq, steps, warmup, accum=1, profile_top=0):
    """tokens/s (median over steps), peak GiB and the loss of every step; each optimizer step takes accum
    micro-batches of batch x seq (the same tokens each time), their losses averaged. profile_top: one more
    optimizer step under torch.profiler, its kernels with the most GPU time printed (and returned). Runs on
    the model's device; on a CPU the peak is None and AdamW is not fused."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    ids = torch.randint(
        0,
        model.config.vocab_size,
        (batch, seq),
        device=device,
        generator=torch.Generator(device).manual_seed(0),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    times, losses = [], []

    def step():
        loss = 0.0
        for _ in range(accum):
            micro = model(input_ids=ids, labels=ids).loss / accum
            micro.backward()
            loss = loss + micro.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        sync()
        t = time.perf_counter()
        loss = step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    profile = None
    if profile_top:
        from profiling import profile_step  # bench/profiling.py (this folder is on sys.path)

        profile = profile_step(step, profile_top)
    return batch * seq * accum / statistics.median(times), peak, losses, profile


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3,mixtral", help=f"comma-separated, from {sorted(MODELS)}")
    ap.add_argument(
        "--layers", type=int, default=0, help="decoder layers (default: 4 for qwen3, 2 for mixtral)"
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--accum",
        type=int,
        default=1,
        help="micro-batches per optimizer step (gradient accumulation; FP8 weight copies are refreshed once per "
        "step, so this is what amortises them)",
    )
    ap.add_argument(
        "--fp8",
        default="",
        metavar="RECIPE",
        help="also run moe8 with this FP8 recipe for the expert GEMMs: blockwise, rowwise or tensorwise, with "
        "+dgrad / +wgrad for those backward GEMMs (as bench_layer.py --fp8), e.g. blockwise+dgrad",
    )
    ap.add_argument(
        "--fuse-loss",
        action="store_true",
        help="moe8 columns also compute the LM loss without logits (moe8.accelerate(..., fuse_loss=True))",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after the timed steps, one more step of each column under torch.profiler: its N kernels with the "
        "most GPU time",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    recipe = recipe_of(args.fp8) if args.fp8 else None  # an unknown name fails before any model is built
    if args.accum < 1:
        raise SystemExit(f"--accum: expected >= 1, got {args.accum}")
    if args.profile < 0:
        raise SystemExit(f"--profile: expected >= 0, got {args.profile}")
    if not moe8.cuda_available():
        raise SystemExit("bench_hf_train: needs a CUDA GPU and moe8 built with CUDA")

    rows = []
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"--models: unknown {name!r}, expected from {sorted(MODELS)}")
        row = {
            "model": name,
            "batch": args.batch,
            "seq": args.seq,
            "accum": args.accum,
            "fuse_loss": args.fuse_loss,
        }
        for impl in ("grouped_mm", "moe8") + (("moe8_fp8",) if recipe else ()):
            model = build(name, args.layers)
            row["layers"] = model.config.num_hidden_layers
            if impl != "grouped_mm":
                moe8.accelerate(model, fp8=recipe if impl == "moe8_fp8" else "none", fuse_loss=args.fuse_loss)
            print(f"[bench] {name} {impl}: {args.warmup + args.steps} steps", flush=True)
            tps, mem, losses, profile = measure(
                model, args.batch, args.seq, args.steps, args.warmup, args.accum, args.profile
            )
            row[f"{impl}_tokens_per_s"], row[f"{impl}_peak_gib"], row[f"{impl}_losses"] = tps, mem, losses
            if profile is not None:
                row[f"{impl}_profile"] = profile
            print(
                f"[bench] {name} {impl}: {tps:,.0f} tokens/s, peak {mem:.1f} GiB, losses {losses}", flush=True
            )
            del model
            torch.cuda.empty_cache()
        row["speedup"] = row["moe8_tokens_per_s"] / row["grouped_mm_tokens_per_s"]
        if recipe:
            row["fp8_recipe"] = args.fp8
            row["fp8_speedup"] = row["moe8_fp8_tokens_per_s"] / row["grouped_mm_tokens_per_s"]
        rows.append(row)
    meta = {**run_info("cuda"), "dtype": "bfloat16", "optimizer": "AdamW fused"}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{meta}")
    print(
        f"{'model':<8} {'layers':>6} {'batch':>9} {'HF tok/s':>10} {'moe8 tok/s':>10} {'ratio':>6} {'HF GiB':>7} {'moe8 GiB':>8}"
    )
    for r in rows:
        print(
            f"{r['model']:<8} {r['layers']:>6} {r['batch']:>4}x{r['seq']:<4} {r['grouped_mm_tokens_per_s']:>10,.0f} "
            f"{r['moe8_tokens_per_s']:>10,.0f} {r['speedup']:>5.2f}x {r['grouped_mm_peak_gib']:>7.1f} "
            f"{r['moe8_peak_gib']:>8.1f}"
        )
        if "fp8_recipe" in r:
            print(
                f"  fp8 {r['fp8_recipe']}: {r['moe8_fp8_tokens_per_s']:,.0f} tokens/s, {r['fp8_speedup']:.2f}x, "
                f"{r['moe8_fp8_peak_gib']:.1f} GiB"
            )


if __name__ == "__main__":
    main()
