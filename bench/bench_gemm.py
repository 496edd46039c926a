"""Expert grouped GEMMs alone, moe8 vs torch in the same run: BF16 forward (ragged M), dgrad and
wgrad (ragged K) against torch._grouped_mm, the FP8 e4m3 forward (moe8 blockwise: 1x128 activations,
128x128 weights; quantization not timed) against torch._scaled_grouped_mm rowwise, and the FP8 wgrad (1x128
blocks along the rows of both operands; no torch counterpart), on the expert shapes
of Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3 and GPT-OSS-20B with balanced and Zipf-skewed routing.
Prints TFLOP/s, % of the measured H200 ceilings (dense bf16 780, dense FP8 1418 TFLOP/s:
shared/data/baselines/h200.md) and moe8 / torch.

    PYTHONPATH=python python bench/bench_gemm.py --json bench/results/gemm_h200.json
    PYTHONPATH=python python bench/bench_gemm.py --shapes qwen3 --routing zipf --kinds fwd,fp8_fwd
    PYTHONPATH=python python bench/bench_gemm.py --tiny        # smoke test of the script, CPU is fine
    PYTHONPATH=python python bench/bench_gemm.py --kinds fwd,dgrad,wgrad --tiles large,m2,pong128,tall
    PYTHONPATH=python python bench/bench_gemm.py --schedules m1,m8,n1,n8

--tiles also times moe8's bf16 GEMMs with each sm_90a tile configuration forced (MOE8_SM90_TILE, see
csrc/cuda/grouped_gemm_sm90.cu) and prints the fastest per GEMM: the data behind the per-shape tile choice;
--fp8-tiles does the same for the FP8 forward and wgrad (MOE8_SM90_FP8_TILE, grouped_gemm_fp8_sm90.cu).
--schedules times every sm_90a GEMM (bf16 and FP8, default tiles) under each order of the persistent tile
scheduler: m|n (MOE8_SM90_RASTER: down M or along N first) followed by the swizzle 1|2|4|8
(MOE8_SM90_SWIZZLE), e.g. m1 (CUTLASS's grouped default) or n8; see sm90_util.cuh.
--fp8-promotions serial,overlap times the FP8 GEMMs with each consumer promotion (MOE8_SM90_FP8_PROMOTION: each
128-wide K tile promoted after its wgmma, or while the next tile's runs; blockwise_promotion_sm90.cuh).
--quant-cols packed,staged times, beside each FP8 weight gradient, the column quantisation of its two operands
(quantize_cols_1x128 of dc and a, what the FP8 wgrad reads) with each kernel (MOE8_QUANT_COLS, quant_cols.cu),
in ms and GB/s moved.
--prepared also times each GEMM with every TMA descriptor rewritten by CUTLASS at each group change
(MOE8_SM90_PREPARED_STORE=0 MOE8_SM90_PREPARED_LOADS=0), and with D's, A's and B's made once per call
(prepared_descriptors_sm90.cuh; D's acquired before the tile's mainloop or before its first store,
MOE8_SM90_PREPARED_ACQUIRE) or one ragged descriptor each for every group (=ragged, ragged_tma_sm90.cuh: bf16's
default), or D's prepared and A's and B's ragged; the FP8 GEMMs with D's only, each way (ragged: their default).
--bounds also times, beside each bf16 GEMM, what grouping costs it: cuBLAS on one dense GEMM of the same FLOPs
and output tiles (torch.mm: no group boundaries, one weight) and, with balanced routing, the strided-batched
GEMM of the same groups (torch.bmm: a weight per expert, every group the same size, no per-group descriptors).
--experts 1,8,128 runs each shape again with that many experts in place of its own (the same rows, widths and
FLOPs, R / E rows an expert): at 1 expert moe8's kernel computes one dense GEMM, so the sweep parts what the
groups cost from what the kernel's tiles cost at these widths.

Rows per expert: balanced = R / E each; uniform = each token's k experts drawn uniformly at random (the counts of
a well-balanced router: ragged by a few percent, so most experts end in a partial tile); zipf = proportional to
1 / rank^s (s = --zipf, experts in a random order); uniform and zipf rounded to multiples of 16 (torch's FP8
grouped GEMM wants aligned groups); R = tokens x k.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import torch
from bench_layer import one_ms  # the same timing as the layer benchmark (this folder is on sys.path)
from run_info import run_info

import moe8
from moe8 import fp8, ops

SHAPES = {  # name: (hidden, expert intermediate, experts, top-k)
    "qwen3": (2048, 768, 128, 8),
    "olmoe": (2048, 1024, 64, 8),
    "mixtral": (4096, 14336, 8, 2),
    "deepseek": (7168, 2048, 256, 8),
    "gptoss": (2880, 2880, 32, 4),
}
TINY = {"tiny": (256, 128, 8, 2)}
CEILING = {"bf16": 780e12, "fp8": 1418e12}
KINDS = ("fwd", "dgrad", "wgrad", "fp8_fwd", "fp8_wgrad")


def counts_for(
    routing: str, rows: int, experts: int, s: float, gen: torch.Generator, top_k: int = 1
) -> torch.Tensor:
    if routing == "balanced":
        c = torch.full((experts,), rows // experts, dtype=torch.long)
        c[: rows - int(c.sum())] += 1
        return c
    if routing == "uniform":  # each token's top_k experts drawn uniformly: a well-balanced router's counts
        ids = torch.rand(rows // top_k, experts, generator=gen).topk(top_k, dim=1).indices
        drawn = torch.bincount(ids.flatten(), minlength=experts)
        c = drawn // 16 * 16  # rounded to 16 by largest remainders, so the total stays R
        more = (rows - int(c.sum())) // 16
        c[torch.argsort(drawn % 16, descending=True, stable=True)[:more]] += 16
        c[0] += rows - int(c.sum())
        return c
    w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    c = (w / w.sum() * rows / 16).floor().long() * 16
    c[0] += rows - int(c.sum())  # the busiest expert takes the rest
    return c[torch.randperm(experts, generator=gen)]


def balanced_cases(R, kd, n, E, kinds, device):
    """cases() of one projection with balanced routing on fresh random operands: a [R, kd], w [E, n, kd],
    dc [R, n] (only for the backward kinds); for the tools that time or profile one GEMM (ncu_gemm.py,
    bench_clocks.py)."""
    ends = counts_for("balanced", R, E, 0.0, None).cumsum(0).to(device, torch.int32)
    offsets = torch.cat([ends.new_zeros(1), ends])
    bf16 = dict(device=device, dtype=torch.bfloat16)
    a, w = torch.randn(R, kd, **bf16), torch.randn(E, n, kd, **bf16).mul_(kd**-0.5)
    dc = torch.randn(R, n, **bf16) if {"dgrad", "wgrad", "fp8_wgrad"} & set(kinds) else None
    return cases(a, w, dc, offsets, ends, E, kinds)


def cases(a, w, dc, offsets, ends, E, kinds):
    """{kind: (moe8 fn, torch fn or None, flops, ceiling)}; a [R, K], w [E, N, K], dc [R, N]."""
    R, K = a.shape
    N = w.shape[1]
    flops = 2 * R * K * N
    out = {}
    if "fwd" in kinds:
        out["fwd"] = (
            lambda: ops.grouped_gemm(a, w, offsets, 0, None),
            lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=ends),
            flops,
            "bf16",
        )
    if "dgrad" in kinds:
        out["dgrad"] = (
            lambda: ops.grouped_gemm(dc, w, offsets, 1, None),
            lambda: torch._grouped_mm(dc, w, offs=ends),
            flops,
            "bf16",
        )
    if "wgrad" in kinds:
        out["wgrad"] = (
            lambda: ops.grouped_gemm_wgrad(a, dc, offsets, 0, E, False),
            lambda: torch._grouped_mm(dc.t(), a, offs=ends),
            flops,
            "bf16",
        )
    if "fp8_fwd" in kinds:
        aq, a_scale = fp8.quantize_rows_1x128(a, None, 1)
        wq, w_scale = fp8.quantize_weight_128x128(w)
        mine = lambda: fp8.grouped_gemm_fp8(aq, a_scale, wq, w_scale, offsets, a.dtype)  # noqa: E731
        theirs = None
        if a.is_cuda and hasattr(torch, "_scaled_grouped_mm"):
            ar, sa = fp8.quantize_rowwise(a)  # [R, K] e4m3 codes (uint8), [R] fp32
            wr, sw = fp8.quantize_rowwise(w)  # [E, N, K], [E, N]
            ar, wr = ar.view(torch.float8_e4m3fn), wr.view(torch.float8_e4m3fn)  # the dtype torch checks for
            theirs = lambda: torch._scaled_grouped_mm(  # noqa: E731
                ar, wr.transpose(1, 2), sa, sw, offs=ends, out_dtype=a.dtype, use_fast_accum=True
            )
        out["fp8_fwd"] = (mine, theirs, flops, "fp8")
    if "fp8_wgrad" in kinds:  # 1x128 blocks along the rows on both operands (transposed quantisations)
        dq, ds = fp8.quantize_cols_1x128(dc, offsets)
        aq2, as2 = fp8.quantize_cols_1x128(a, offsets)
        out["fp8_wgrad"] = (
            lambda: fp8.grouped_gemm_fp8_wgrad(dq, ds, aq2, as2, offsets, a.dtype, False),
            None,  # no torch FP8 grouped GEMM with ragged K and 1x128 scales to compare with
            flops,
            "fp8",
        )
    return out


def bound_cases(a, w, dc, E, kinds, batched: bool = True) -> dict:
    """{kind: {"dense": fn, "batched": fn}} for the bf16 kinds: the same FLOPs as one dense GEMM (fwd: [R, K] x
    [K, N]; dgrad: [R, N] x [N, K]; wgrad: the experts' [N, R / E] operands stacked along M, x [R / E, K]) and, when
    batched and the R rows split into E equal groups, as one strided-batched GEMM (the groups the GEMMs being timed
    have: balanced routing). Operands are laid out before timing."""
    R, K = a.shape
    N = w.shape[1]
    even = R % E == 0
    batched = batched and even
    g = R // E
    out = {}
    if "fwd" in kinds:
        wt = w[0].t()  # [K, N]
        out["fwd"] = {"dense": lambda: torch.mm(a, wt)}
        if batched:
            a3, w3 = a.view(E, g, K), w.transpose(1, 2)
            out["fwd"]["batched"] = lambda: torch.bmm(a3, w3)  # [E, g, N]
    if "dgrad" in kinds:
        w0 = w[0]  # [N, K]
        out["dgrad"] = {"dense": lambda: torch.mm(dc, w0)}
        if batched:
            dc3 = dc.view(E, g, N)
            out["dgrad"]["batched"] = lambda: torch.bmm(dc3, w)  # [E, g, K]
    if "wgrad" in kinds and even:
        dct = dc.view(E, g, N).transpose(1, 2)  # [E, N, g]
        dc_stacked = dct.reshape(E * N, g)  # a copy: the experts' operands one above the other
        a0 = a[:g]
        out["wgrad"] = {"dense": lambda: torch.mm(dc_stacked, a0)}  # [E * N, K]
        if batched:
            a3 = a.view(E, g, K)
            out["wgrad"]["batched"] = lambda: torch.bmm(dct, a3)  # [E, N, K]
    return out


def bench(shape, dims, routing, args, device, gen):
    H, I, E, k = dims
    R = args.tokens * k
    counts = counts_for(routing, R, E, args.zipf, gen, k)
    ends = counts.cumsum(0).to(device, torch.int32)
    offsets = torch.cat([ends.new_zeros(1), ends])
    rows = []
    # operands drawn on the device: the DeepSeek-V3 weights alone are 7.5G values (minutes on the CPU)
    dgen = torch.Generator(device).manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    for proj, kd, n in (("gate_up", H, 2 * I), ("down", I, H)):
        bf16 = dict(device=device, dtype=torch.bfloat16, generator=dgen)
        a = torch.randn(R, kd, **bf16)
        w = torch.randn(E, n, kd, **bf16).mul_(kd**-0.5)
        dc = torch.randn(R, n, **bf16)
        bounds = bound_cases(a, w, dc, E, args.kinds, routing == "balanced") if args.bounds else {}
        for kind, (mine, theirs, flops, ceil) in cases(a, w, dc, offsets, ends, E, args.kinds).items():
            row = dict(shape=shape, routing=routing, gemm=proj, kind=kind, rows=R, K=kd, N=n, experts=E)
            row["max_rows_per_expert"] = int(counts.max())
            cands = {"moe8": mine} | ({"torch": theirs} if theirs is not None else {})
            forced = args.tiles if ceil == "bf16" else args.fp8_tiles
            var = "MOE8_SM90_TILE" if ceil == "bf16" else "MOE8_SM90_FP8_TILE"
            cands |= {f"tile {t}": with_env(mine, {var: t}) for t in forced}
            cands |= {f"schedule {o}": with_env(mine, schedule_env(o)) for o in args.schedules}
            promotions = args.fp8_promotions if ceil != "bf16" else []
            cands |= {f"promotion {p}": with_env(mine, {"MOE8_SM90_FP8_PROMOTION": p}) for p in promotions}
            quant_cols = args.quant_cols if kind == "fp8_wgrad" else []
            quantise = functools.partial(quantize_wgrad_operands, dc, a, offsets)
            cands |= {f"quant_cols {q}": with_env(quantise, {"MOE8_QUANT_COLS": q}) for q in quant_cols}
            mixes = PREPARED_MIXES if ceil == "bf16" else FP8_PREPARED_MIXES
            if args.prepared:
                cands |= {
                    f"prepared {label}": with_env(
                        mine,
                        {
                            "MOE8_SM90_PREPARED_STORE": store,
                            "MOE8_SM90_PREPARED_LOADS": loads,
                            "MOE8_SM90_PREPARED_ACQUIRE": acquire,
                        },
                    )
                    for label, store, loads, acquire in mixes
                }
            cands |= {f"bound {b}": fn for b, fn in bounds.get(kind, {}).items()}
            ms = interleaved_ms(cands, device, args.warmup, args.iters)
            for who in ("moe8", "torch"):
                if isinstance(ms.get(who), str):  # one failing kernel must not lose the other rows
                    row[f"{who}_error"] = ms[who]
                elif who in ms:
                    row[f"{who}_ms"] = ms[who]
                    row[f"{who}_tflops"] = flops / ms[who] / 1e9
            if "moe8_ms" in row:
                row["moe8_pct_of_ceiling"] = 100 * row["moe8_tflops"] * 1e12 / CEILING[ceil]
            if forced:
                row["tiles_ms"] = {t: ms[f"tile {t}"] for t in forced}
            if args.schedules:
                row["schedules_ms"] = {o: ms[f"schedule {o}"] for o in args.schedules}
            if promotions:
                row["promotions_ms"] = {p: ms[f"promotion {p}"] for p in promotions}
            if quant_cols:
                row["quant_cols_ms"] = {q: ms[f"quant_cols {q}"] for q in quant_cols}
                moved = quant_cols_bytes(R, kd, n, E)
                row["quant_cols_gbps"] = {
                    q: moved / t / 1e6 for q, t in row["quant_cols_ms"].items() if isinstance(t, float)
                }
            if args.prepared:
                row["prepared_ms"] = {mix[0]: ms[f"prepared {mix[0]}"] for mix in mixes}
            if bounds.get(kind):
                row["bounds_ms"] = {b: ms[f"bound {b}"] for b in bounds[kind]}
            if "moe8_ms" in row and "torch_ms" in row:
                row["ratio"] = row["torch_ms"] / row["moe8_ms"]
            rows.append(row)
            print(line(row), flush=True)
        del a, w, dc
    return rows


TILES = ("large", "solo", "m2", "pong128", "tall", "epi64", "epi64solo")
FP8_TILES = ("large", "solo", "m2", "small")


SCHEDULES = tuple(r + z for r in "mn" for z in "1248")
FP8_PROMOTIONS = ("serial", "overlap")


QUANT_COLS = ("packed", "staged")
# --prepared: (label, MOE8_SM90_PREPARED_STORE, _LOADS, _ACQUIRE). bf16's default is "D, A, B ragged"; D's prepared
# or ragged with A's and B's left to CUTLASS's rewrite is refused (sm90_heuristics::prepared).
PREPARED_MIXES = (
    ("none", "0", "0", "mainloop"),
    ("D, A, B", "1", "1", "mainloop"),
    ("D acquired at the store, A, B", "1", "1", "store"),
    ("D, A, B ragged", "ragged", "ragged", "mainloop"),
    ("D prepared, A, B ragged", "1", "ragged", "mainloop"),
)
# the FP8 GEMMs (their loads are CUTLASS's): D's only; the default is "D ragged"
FP8_PREPARED_MIXES = (
    ("none", "0", "0", "mainloop"),
    ("D", "1", "0", "mainloop"),
    ("D acquired at the store", "1", "0", "store"),
    ("D ragged", "ragged", "0", "mainloop"),
)


def quantize_wgrad_operands(dc, a, offsets):
    """What the FP8 weight gradient reads besides its GEMM: both operands quantised down their rows."""
    return fp8.quantize_cols_1x128(dc, offsets), fp8.quantize_cols_1x128(a, offsets)


def quant_cols_bytes(R: int, K: int, N: int, E: int) -> int:
    """Bytes the two column quantisations of a weight gradient move: dc [R, N] and a [R, K] read as bf16, their
    codes written (a byte each) and their fp32 scales (one per 128-row block of an expert and column)."""
    blocks = -(-R // 128) + E
    return 3 * R * (N + K) + 4 * blocks * (N + K)


def schedule_env(order: str) -> dict:
    """The environment of a --schedules entry, e.g. n8: MOE8_SM90_RASTER=n, MOE8_SM90_SWIZZLE=8."""
    return {"MOE8_SM90_RASTER": order[0], "MOE8_SM90_SWIZZLE": order[1:]}


def with_env(fn, env: dict):
    """fn with the environment variables env set for each call (the kernels read them once per process:
    moe8._C.reload_sm90_overrides() makes them read them again, before and after the call)."""

    def call():
        old = {var: os.environ.get(var) for var in env}
        os.environ.update(env)
        ops._C.reload_sm90_overrides()
        try:
            return fn()
        finally:
            for var, value in old.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
            ops._C.reload_sm90_overrides()

    return call


def interleaved_ms(fns: dict, device, warmup: int, iters: int) -> dict:
    """{name: median ms} of each fn, timed round-robin with the order rotating every round, so that the
    GPU's clock changes under sustained load fall on all alike (timing each fn's iterations in a block
    favours whichever runs first: up to 20% on the same kernel on an H200); {name: error text} for a fn that
    raised."""
    out, live = {}, {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            live[name] = fn
        except Exception as e:
            out[name] = f"{type(e).__name__}: {str(e)[:200]}"
    times = {name: [] for name in live}
    for i in range(iters):
        names = list(live)
        if not names:
            break
        for name in names[i % len(names) :] + names[: i % len(names)]:
            try:
                times[name].append(one_ms(live[name], device))
            except Exception as e:
                out[name] = f"{type(e).__name__}: {str(e)[:200]}"
                live.pop(name)
                times.pop(name)
    out.update({name: statistics.median(t) for name, t in times.items()})
    return out


def best_tile(r, key="tiles_ms"):
    """(tile, ms) of the fastest forced tile (key="schedules_ms": scheduler order, "promotions_ms": FP8
    promotion) of row r, or None."""
    timed = [(ms, t) for t, ms in r.get(key, {}).items() if isinstance(ms, float)]
    return (min(timed)[1], min(timed)[0]) if timed else None


def line(r) -> str:
    def num(key, fmt):
        return format(r[key], fmt) if key in r else "-"

    err = "  " + "; ".join(r[k] for k in ("moe8_error", "torch_error") if k in r)
    return (
        f"{r['shape']:<9} E {r['experts']:<3} {r['routing']:<9} {r['gemm']:<8} {r['kind']:<8} "
        f"{num('moe8_ms', '8.3f')} ms {num('moe8_tflops', '6.0f')} TF/s {num('moe8_pct_of_ceiling', '4.0f')}% | "
        f"torch {num('torch_ms', '8.3f')} ms {num('torch_tflops', '6.0f')} TF/s | {num('ratio', '5.2f')}x"
        + (err if err.strip() else "")
        + tiles_text(r)
    )


def tiles_text(r) -> str:
    text = ""
    for key, label in (
        ("tiles_ms", "tiles"),
        ("schedules_ms", "schedules"),
        ("promotions_ms", "promotions"),
        ("quant_cols_ms", "column quantisation"),
        ("prepared_ms", "descriptors made per call"),
        ("bounds_ms", "same FLOPs"),
    ):
        if key not in r:
            continue
        parts = [f"{t} {ms:.3f}" if isinstance(ms, float) else f"{t} error" for t, ms in r[key].items()]
        best = best_tile(r, key)
        vs = f", best {best[0]}: {r['torch_ms'] / best[1]:.2f}x torch" if best and "torch_ms" in r else ""
        if key == "quant_cols_ms":
            vs = " (GB/s: " + ", ".join(f"{q} {g:.0f}" for q, g in r["quant_cols_gbps"].items()) + ")"
        if key == "bounds_ms":
            parts = [
                f"{b} {ms:.3f} ({2 * r['rows'] * r['K'] * r['N'] / ms / 1e9:.0f} TF/s)"
                if isinstance(ms, float)
                else f"{b} error"
                for b, ms in r[key].items()
            ]
            vs = ""
            if "moe8_ms" in r:
                vs = "; moe8 / " + ", ".join(
                    f"{b} {r['moe8_ms'] / ms:.2f}x" for b, ms in r[key].items() if isinstance(ms, float)
                )
        text += f"\n    {label} ms: " + ", ".join(parts) + vs
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {sorted(SHAPES)}")
    ap.add_argument(
        "--routing", default="balanced,zipf", help="comma-separated, from balanced, uniform, zipf"
    )
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from {KINDS}")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens (rows = tokens x top-k; default 16384)")
    ap.add_argument(
        "--zipf", type=float, default=1.0, help="Zipf exponent of the skewed routing (default 1.0)"
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--tiny", action="store_true", help="one tiny shape, 64 tokens: a smoke test, CPU is fine"
    )
    ap.add_argument(
        "--tiles",
        default="",
        help=f"comma-separated, from {TILES}: also time the bf16 GEMMs with each tile forced (MOE8_SM90_TILE)",
    )
    ap.add_argument(
        "--fp8-tiles",
        default="",
        help=f"comma-separated, from {FP8_TILES}: also time the FP8 GEMMs with each tile forced (MOE8_SM90_FP8_TILE)",
    )
    ap.add_argument(
        "--schedules",
        default="",
        help=f"comma-separated, from {SCHEDULES}: also time every sm_90a GEMM under each tile-scheduler order "
        "(raster m|n then swizzle: MOE8_SM90_RASTER, MOE8_SM90_SWIZZLE)",
    )
    ap.add_argument(
        "--fp8-promotions",
        default="",
        help=f"comma-separated, from {FP8_PROMOTIONS}: also time the FP8 GEMMs with each consumer promotion "
        "(MOE8_SM90_FP8_PROMOTION)",
    )
    ap.add_argument(
        "--quant-cols",
        default="",
        help=f"comma-separated, from {QUANT_COLS}: also time the FP8 weight gradient's column quantisation of "
        "both operands with each kernel (MOE8_QUANT_COLS)",
    )
    ap.add_argument(
        "--prepared",
        action="store_true",
        help="also time the GEMMs with every descriptor rewritten by CUTLASS, made once per call (D's acquired "
        "before the mainloop or the store) or ragged (MOE8_SM90_PREPARED_STORE=0|1|ragged, _LOADS=0|1|ragged, "
        "_ACQUIRE)",
    )
    ap.add_argument(
        "--bounds",
        action="store_true",
        help="also time each bf16 GEMM's FLOPs as one dense cuBLAS GEMM and, with balanced routing, as one "
        "strided-batched GEMM (what grouping costs)",
    )
    ap.add_argument(
        "--experts",
        default="",
        help="comma-separated expert counts: run each shape with each in place of its own (same rows and FLOPs)",
    )
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    args.tiles = [t for t in args.tiles.split(",") if t]
    args.fp8_tiles = [t for t in args.fp8_tiles.split(",") if t]
    args.schedules = [t for t in args.schedules.split(",") if t]
    args.fp8_promotions = [t for t in args.fp8_promotions.split(",") if t]
    args.quant_cols = [t for t in args.quant_cols.split(",") if t]
    try:
        args.experts = [int(e) for e in args.experts.split(",") if e]
    except ValueError:
        raise SystemExit(f"--experts: expected comma-separated integers, got {args.experts!r}") from None
    if any(not 1 <= e <= 512 for e in args.experts):
        raise SystemExit(f"--experts: expected counts in 1..512, got {args.experts}")
    shapes = TINY if args.tiny else SHAPES
    names = list(shapes) if args.tiny else args.shapes.split(",")
    args.kinds = args.kinds.split(",")
    routings = args.routing.split(",")
    for flag, given, allowed in (
        ("--shapes", names, shapes),
        ("--kinds", args.kinds, KINDS),
        ("--routing", routings, ("balanced", "uniform", "zipf")),
        ("--tiles", args.tiles, TILES),
        ("--fp8-tiles", args.fp8_tiles, FP8_TILES),
        ("--schedules", args.schedules, SCHEDULES),
        ("--fp8-promotions", args.fp8_promotions, FP8_PROMOTIONS),
        ("--quant-cols", args.quant_cols, QUANT_COLS),
    ):
        bad = [x for x in given if x not in allowed]
        if bad:
            raise SystemExit(f"{flag}: unknown {bad}, expected from {sorted(allowed)}")
    if args.tiny:
        args.tokens = 64
    cuda = torch.cuda.is_available() and moe8.cuda_available()
    if not cuda and not args.tiny:
        raise SystemExit(
            "bench_gemm: needs a CUDA GPU and moe8 built with CUDA (or --tiny for a CPU smoke test)"
        )
    device = torch.device("cuda" if cuda else "cpu")
    meta = dict(
        **run_info(device),
        tokens=args.tokens,
        zipf=args.zipf,
        ceilings_tflops={k: v / 1e12 for k, v in CEILING.items()},
    )
    print(meta, flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name in names:
        for routing in routings:
            H, I, E, k = shapes[name]
            for e in args.experts or [E]:
                rows += bench(name, (H, I, e, k), routing, args, device, gen)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(meta=meta, gemms=rows), f, indent=1)
    ratios = [r["ratio"] for r in rows if "ratio" in r and r["kind"] != "fp8_fwd"]
    if ratios:
        print(f"bf16 moe8 / torch: min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x")
    bf16 = [r for r in rows if r["kind"] in ("fwd", "dgrad", "wgrad")]
    best = [r["torch_ms"] / b[1] for r in bf16 if "torch_ms" in r and (b := best_tile(r))]
    if best:
        print(f"bf16 best forced tile / torch: min {min(best):.2f}x, median {statistics.median(best):.2f}x")
    for kind in ("fwd", "dgrad", "wgrad", "fp8_fwd", "fp8_wgrad"):  # each order's total time over the rows
        sched = [
            r
            for r in rows
            if r["kind"] == kind
            and "moe8_ms" in r
            and "schedules_ms" in r
            and all(isinstance(ms, float) for ms in r["schedules_ms"].values())
        ]
        if sched:
            base = sum(r["moe8_ms"] for r in sched)
            parts = ", ".join(
                f"{o} {sum(r['schedules_ms'][o] for r in sched) / base:.3f}" for o in args.schedules
            )
            print(f"{kind} schedules, total time / default's ({len(sched)} GEMMs): {parts}")
    for b in ("dense", "batched"):  # moe8's time over the bound's, per kind
        for kind in ("fwd", "dgrad", "wgrad"):
            over = [
                r["moe8_ms"] / r["bounds_ms"][b]
                for r in rows
                if r["kind"] == kind and "moe8_ms" in r and isinstance(r.get("bounds_ms", {}).get(b), float)
            ]
            if over:
                print(
                    f"{kind} moe8 / {b} GEMM of the same FLOPs: min {min(over):.2f}x, "
                    f"median {statistics.median(over):.2f}x, max {max(over):.2f}x ({len(over)} GEMMs)"
                )
    for kind in ("fp8_fwd", "fp8_wgrad"):
        tf = [
            2 * r["rows"] * r["K"] * r["N"] / b[1] / 1e9
            for r in rows
            if r["kind"] == kind and (b := best_tile(r))
        ]
        if tf:
            print(f"{kind} best forced tile: {min(tf):.0f} .. {max(tf):.0f} TFLOP/s")
    return 1 if any("moe8_error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
