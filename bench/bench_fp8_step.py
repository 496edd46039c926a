"""FP8 in the Hugging Face training step, one table: transformers, moe8 in bf16, moe8 with FP8 experts, moe8 with
FP8 experts and dense layers, moe8 fp8="auto", and transformers with torchao's float8 training on its dense
layers. The slices of bench_hf_train.py (Qwen3-30B-A3B, 4 layers; Mixtral-8x7B, 2 layers; bf16, random init,
SDPA), its model building and step: forward + backward + fused AdamW, one micro-batch of 8 x 2048 tokens per
optimizer step, the same weights and batch in every row.

    pip install --no-deps --target /tmp/torchao torchao-0.18.0-*.whl     # torchao kept out of site-packages
    PYTHONPATH=/tmp/torchao:python python bench/bench_fp8_step.py --out DIR   # every row, one H200
    PYTHONPATH=python python bench/bench_fp8_step.py --out DIR        # without torchao: its row skipped, why said
    PYTHONPATH=python python bench/bench_fp8_step.py --tiny --out DIR # smoke test of every row, CPU is fine

Rows, per model:
    transformers      transformers' grouped_mm experts, bf16
    torchao           the same with torchao.float8.convert_to_float8_training (its default config: tensorwise
                      scales, eager, no torch.compile) on the layers dense_filter picks: the attention
                      projections and the dense / shared-expert MLPs; not the router, not the LM head (as
                      torchao's docs recommend); the experts stay transformers' grouped_mm. Needs a CUDA GPU of
                      sm_89+ (torch._scaled_mm); skipped elsewhere, the reason recorded
    moe8              moe8.accelerate(model), bf16
    moe8_fp8          moe8.accelerate(model, fp8=--fp8): the expert GEMMs in FP8 (blockwise + FP8 dgrad)
    moe8_fp8_dense    the same with fp8_dense=True: attention projections, shared experts and dense MLPs in FP8
                      too (moe8.fp8_linear, the same layers as the torchao row)
    moe8_fp8_both     moe8_fp8_dense with fp8_cache="both": the weights' FP8 copies (both layouts) kept from
                      one optimizer step to the next instead of made at every use (the default "frozen")
    moe8_auto         fp8="auto", fp8_dense=True: every GEMM, expert or dense, in FP8 only where
                      moe8.fp8_rules.fp8_pays says it pays, else bf16

Each row: tokens/s (median of --steps after --warmup), peak GiB (torch.cuda.max_memory_allocated, reset after
the row's model is built; the previous row's model, optimizer and FP8 copies freed first: `start_gib` records
what was still allocated), the first step's loss (before any update: every row should agree to FP8's error, a
broken row shows here), speed-up against moe8 bf16 and against transformers. DIR/fp8_step.json is rewritten
after every row.

Time on one H200 at the defaults (estimate; assumed: the bench_hf_train rates of bench/results/hf_train_h200.md,
~0.2 s a step for the Qwen3 slice and ~0.2 s for Mixtral, a few seconds to build and HF-initialise each model,
~1 s for torchao's first eager steps): 12 rows of 7 steps, about 2-3 minutes with the start-up."""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
from bench_hf_train import MODELS, build, measure  # this folder is on sys.path
from bench_layer import recipe_of
from run_info import run_info

import moe8

ROWS = ("transformers", "torchao", "moe8", "moe8_fp8", "moe8_fp8_dense", "moe8_fp8_both", "moe8_auto")
TINY = {  # the same families at toy sizes (multiples of 16, as FP8 GEMMs need): a CPU smoke test
    "qwen3": (
        "qwen3_moe",
        dict(
            hidden_size=64,
            moe_intermediate_size=32,
            intermediate_size=128,
            num_experts=4,
            num_experts_per_tok=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=512,
            norm_topk_prob=True,
        ),
        2,
    ),
    "mixtral": (
        "mixtral",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
        ),
        2,
    ),
}
DENSE_KINDS = ("attention", "shared_expert", "mlp")  # what torchao converts: moe8's fp8_dense=True layers


def dense_filter(module: torch.nn.Module, fqn: str) -> bool:
    """torchao's module_filter_fn: the dense nn.Linear layers (attention projections, shared-expert and dense
    MLPs, by moe8.fp8_linear.module_kind: never a router, an embedding or the LM head) whose in and out
    features are multiples of 16 (torch._scaled_mm's requirement)."""
    from moe8.fp8_linear import module_kind

    return (
        isinstance(module, torch.nn.Linear)
        and module_kind(fqn) in DENSE_KINDS
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def convert_torchao(model) -> list:
    """torchao float8 training on the layers dense_filter picks; returns their names."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    convert_to_float8_training(model, module_filter_fn=dense_filter)
    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def torchao_unavailable(device: str):
    """Why the torchao row can't run here, or None."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        return f"torchao not importable ({e}); pip install --no-deps --target DIR torchao, PYTHONPATH=DIR"
    if device != "cuda":
        return f"torchao float8 needs a CUDA GPU of sm_89+ (torch._scaled_mm), the device is {device}"
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        return f"torchao float8 needs sm_89+ (torch._scaled_mm), the GPU is sm_{cap[0]}{cap[1]}"
    return None


def prepare(row: str, model, recipe, fuse_loss: bool) -> list:
    """Switch a freshly built model to the row's implementation; returns the names of its FP8 dense layers."""
    from moe8.fp8_linear import Float8Linear

    if row == "transformers":
        return []
    if row == "torchao":
        return convert_torchao(model)
    fp8 = {"moe8": "none", "moe8_auto": "auto"}.get(row, recipe)
    dense = row in ("moe8_fp8_dense", "moe8_fp8_both", "moe8_auto")
    cache = "both" if row == "moe8_fp8_both" else "frozen"
    moe8.accelerate(model, fp8=fp8, fp8_dense=dense, fp8_cache=cache, fuse_loss=fuse_loss)
    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def free() -> None:
    """Everything of the previous row goes: its Python objects, moe8's switches and FP8 copies, cached blocks."""
    moe8.disable()
    for cache in (moe8.fp8.default_cache, moe8.fp8.one_layout_cache, moe8.fp8.frozen_only_cache):
        cache.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ratios(rows: list) -> None:
    """speedup_vs_moe8 / speedup_vs_transformers of every row of a model that has both baselines' tokens/s."""
    by = {(r["model"], r["row"]): r for r in rows}
    for r in rows:
        for base, key in (("moe8", "speedup_vs_moe8"), ("transformers", "speedup_vs_transformers")):
            b = by.get((r["model"], base), {}).get("tokens_per_s")
            if b and r.get("tokens_per_s"):
                r[key] = r["tokens_per_s"] / b
        t = by.get((r["model"], "transformers"), {}).get("first_loss")
        if t is not None and r.get("first_loss") is not None:
            r["first_loss_diff"] = r["first_loss"] - t


def table(out: dict) -> None:
    print(f"\n{out['meta']}")
    s = out["setup"]
    print(
        f"batch {s['batch']} x {s['seq']}, {s['steps']} timed steps after {s['warmup']}, fp8 {s['fp8']}, "
        f"fused AdamW, one micro-batch per step"
    )
    print(
        f"{'model':<8} {'row':<15} {'tokens/s':>10} {'peak GiB':>8} {'vs moe8':>7} {'vs HF':>6} "
        f"{'first loss':>10} {'- HF':>9} {'fp8 dense':>9}  note"
    )

    def f(x, spec):
        return format(x, spec) if x is not None else "-"

    for r in out["rows"]:
        print(
            f"{r['model']:<8} {r['row']:<15} {f(r.get('tokens_per_s'), ',.0f'):>10} "
            f"{f(r.get('peak_gib'), '.1f'):>8} {f(r.get('speedup_vs_moe8'), '.2f'):>7} "
            f"{f(r.get('speedup_vs_transformers'), '.2f'):>6} {f(r.get('first_loss'), '.5f'):>10} "
            f"{f(r.get('first_loss_diff'), '+.1e'):>9} "
            f"{len(r.get('fp8_dense_layers', [])):>9}  {r.get('skipped') or r.get('error') or ''}"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3,mixtral", help=f"comma-separated, from {sorted(MODELS)}")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {ROWS}")
    ap.add_argument(
        "--layers", type=int, default=0, help="decoder layers (default: 4 for qwen3, 2 for mixtral)"
    )
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; --tiny: 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; --tiny: 32)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--fp8",
        default="blockwise+dgrad",
        metavar="RECIPE",
        help="the recipe of the moe8_fp8 and moe8_fp8_dense rows, as bench_hf_train.py --fp8 (default "
        "blockwise+dgrad, what fp8='auto' uses where FP8 pays)",
    )
    ap.add_argument("--fuse-loss", action="store_true", help="moe8 rows compute the loss without logits")
    ap.add_argument(
        "--tiny", action="store_true", help="toy sizes of both families, on the CPU without a GPU"
    )
    ap.add_argument("--out", required=True, help="directory for fp8_step.json (rewritten after every row)")
    args = ap.parse_args()
    recipe = recipe_of(args.fp8)
    rows_asked = args.rows.split(",")
    bad = sorted(set(rows_asked) - set(ROWS))
    if bad:
        raise SystemExit(f"--rows: unknown {bad}, expected from {ROWS}")
    models = TINY if args.tiny else MODELS
    names = args.models.split(",")
    bad = sorted(set(names) - set(models))
    if bad:
        raise SystemExit(f"--models: unknown {bad}, expected from {sorted(models)}")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"--steps >= 1 and --warmup >= 0 expected, got {args.steps} and {args.warmup}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not moe8.cuda_available():
        raise SystemExit("bench_fp8_step: moe8 is built without CUDA kernels (build it with nvcc first)")
    if device == "cpu" and not args.tiny:
        raise SystemExit("bench_fp8_step: needs a CUDA GPU; on the CPU use --tiny")
    batch, seq = args.batch or (2 if args.tiny else 8), args.seq or (32 if args.tiny else 2048)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "fp8_step.json")
    out = dict(
        meta={
            **run_info(device),
            "dtype": "bfloat16",
            "optimizer": "AdamW, fused on CUDA",
            "date": time.strftime("%Y-%m-%d"),
        },
        setup=dict(
            models=names,
            tiny=args.tiny,
            batch=batch,
            seq=seq,
            steps=args.steps,
            warmup=args.warmup,
            fp8=args.fp8,
            fuse_loss=args.fuse_loss,
            torchao_filter="attention, shared_expert, mlp (dense_filter)",
        ),  # fmt: skip
        rows=[],
    )
    no_torchao = torchao_unavailable(device)
    if no_torchao is None or not no_torchao.startswith("torchao not importable"):
        import torchao

        out["meta"]["torchao"] = torchao.__version__
    for name in names:
        for row in rows_asked:
            r = dict(model=name, row=row)
            out["rows"].append(r)
            if row == "torchao" and no_torchao:
                r["skipped"] = no_torchao
                print(f"[bench] {name} torchao: skipped, {no_torchao}", flush=True)
                continue
            free()
            r["start_gib"] = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else None
            try:
                model = build(name, args.layers, device=device, models=models)
                r["layers"] = model.config.num_hidden_layers
                r["fp8_dense_layers"] = prepare(row, model, recipe, args.fuse_loss)
                print(f"[bench] {name} {row}: {args.warmup + args.steps} steps", flush=True)
                tps, peak, losses, _ = measure(model, batch, seq, args.steps, args.warmup)
                r.update(tokens_per_s=tps, peak_gib=peak, first_loss=losses[0], losses=losses)
                print(
                    f"[bench] {name} {row}: {tps:,.0f} tokens/s, peak {peak if peak is None else round(peak, 1)} "
                    f"GiB, losses {losses}",
                    flush=True,
                )
            except Exception as e:  # one broken row leaves the others' numbers
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"[bench] {name} {row}: ERROR {r['error']}", flush=True)
            finally:
                model = None
            ratios(out["rows"])
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
    free()
    table(out)
    return 1 if any("error" in r for r in out["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
