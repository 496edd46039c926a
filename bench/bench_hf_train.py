"""Training-step speed of Hugging Face MoE models: transformers' `grouped_mm` experts vs moe8 (`moe8.accelerate`),
same model, same weights, same batch: forward + backward + fused AdamW, bf16, random init.

    python bench/bench_hf_train.py --models qwen3,mixtral --json bench/results/hf_train.json

Prints a table last: model, layers, batch, HF tokens/s, moe8 tokens/s, ratio, peak memory of each."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

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


def build(name, layers, dtype=torch.bfloat16):
    import transformers

    family, over, default_layers = MODELS[name]
    cfg = transformers.AutoConfig.for_model(
        family, num_hidden_layers=layers or default_layers, max_position_embeddings=4096, **over
    )
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model


def measure(model, batch, seq, steps, warmup):
    ids = torch.randint(
        0,
        model.config.vocab_size,
        (batch, seq),
        device="cuda",
        generator=torch.Generator("cuda").manual_seed(0),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    times, losses = [], []
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
        losses.append(loss.item())
    del opt
    return batch * seq / statistics.median(times), torch.cuda.max_memory_allocated() / 2**30, losses


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
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not moe8.cuda_available():
        raise SystemExit("bench_hf_train: needs a CUDA GPU and moe8 built with CUDA")
    import transformers

    rows = []
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"--models: unknown {name!r}, expected from {sorted(MODELS)}")
        row = {"model": name, "batch": args.batch, "seq": args.seq}
        for impl in ("grouped_mm", "moe8"):
            model = build(name, args.layers)
            row["layers"] = model.config.num_hidden_layers
            if impl == "moe8":
                moe8.accelerate(model)
            tps, mem, losses = measure(model, args.batch, args.seq, args.steps, args.warmup)
            row[f"{impl}_tokens_per_s"], row[f"{impl}_peak_gib"], row[f"{impl}_losses"] = tps, mem, losses
            print(
                f"[bench] {name} {impl}: {tps:,.0f} tokens/s, peak {mem:.1f} GiB, losses {losses}", flush=True
            )
            del model
            torch.cuda.empty_cache()
        row["speedup"] = row["moe8_tokens_per_s"] / row["grouped_mm_tokens_per_s"]
        rows.append(row)
    meta = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "moe8": moe8.__version__,
        "dtype": "bfloat16",
        "optimizer": "AdamW fused",
        "date": time.strftime("%Y-%m-%d"),
    }
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


if __name__ == "__main__":
    main()
