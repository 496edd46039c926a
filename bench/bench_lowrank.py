"""The expert LoRA's pieces alone, at the 30B LoRA step's shapes: per projection, the A projection
x·A[e] ([R, K] -> [R, r]: a grouped GEMM with N = r), then the B projection added to the base output h,
fused (`ops.grouped_lowrank_add`) against unfused (`h + ops.grouped_gemm(t, B)`), and the backward's
grouped GEMMs with a rank-sized side. Prints ms, and GB/s for the memory-bound add (bytes of h read and
out written).

    PYTHONPATH=python python bench/bench_lowrank.py --ranks 16,32 --json bench/results/lowrank_h200.json
    PYTHONPATH=python python bench/bench_lowrank.py --tiny     # smoke test of the script, CPU is fine

Rows per expert balanced (R = tokens x top-k); weights [E, N, K] as HF stores them (layout 0).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_layer import median_ms  # this folder is on sys.path
from run_info import run_info

import moe8
from moe8 import ops

# name: (tokens, top-k, experts, hidden, expert intermediate): Qwen3-30B-A3B at micro-batch 2 x 4096
SHAPES = {"qwen3-30b": (8192, 8, 128, 2048, 768), "tiny": (64, 2, 4, 64, 32)}


def time_pieces(x, h, A, B, t, offsets, device, iters) -> dict:
    """Median ms of each piece of one projection's expert LoRA (forward and backward GEMMs)."""
    E, dh = A.shape[0], torch.randn_like(h)
    pieces = {
        "A x": lambda: ops.grouped_gemm(x, A, offsets, 0, None),
        "add fused": lambda: ops.grouped_lowrank_add(h, t, B, offsets, 0),
        "add unfused": lambda: h + ops.grouped_gemm(t, B, offsets, 0, None),
        "d t = dh B": lambda: ops.grouped_gemm(dh, B, offsets, 1, None),
        "d B = dh^T t": lambda: ops.grouped_gemm_wgrad(t, dh, offsets, 0, E, False),
    }
    return {name: median_ms(fn, device, iters=iters) for name, fn in pieces.items()}


def bench(name, rank, device, dtype, iters):
    T, k, E, H, I = SHAPES[name]
    R = T * k
    g = torch.Generator(device=device).manual_seed(0)
    counts = torch.full((E,), R // E, dtype=torch.long)
    counts[: R - int(counts.sum())] += 1
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int().to(device)
    rows = []
    for proj, K, N in (("gate_up", H, 2 * I), ("down", I, H)):
        x = torch.randn(R, K, device=device, generator=g).to(dtype)
        h = torch.randn(R, N, device=device, generator=g).to(dtype)
        A = torch.randn(E, rank, K, device=device, generator=g).to(dtype) / K**0.5
        B = torch.randn(E, N, rank, device=device, generator=g).to(dtype) / rank**0.5
        t = ops.grouped_gemm(x, A, offsets, 0, None)
        fused = ops.grouped_lowrank_add(h, t, B, offsets, 0)
        ref = h.float() + ops.grouped_gemm(t, B, offsets, 0, None).float()
        err = float((fused.float() - ref).abs().max() / ref.abs().max())
        times = time_pieces(x, h, A, B, t, offsets, device, iters)
        gbs = 2 * h.numel() * h.element_size() / (times["add fused"] * 1e-3) / 1e9
        rows.append(
            {
                "proj": proj,
                "R": R,
                "K": K,
                "N": N,
                "rank": rank,
                "E": E,
                "ms": times,
                "fused_add_GBps": gbs,
                "fused_vs_unfused_max_rel_err": err,
            }
        )
        print(
            f"{proj:8} R={R} K={K} N={N} r={rank}: "
            + "  ".join(f"{a} {v:.3f} ms" for a, v in times.items())
            + f"  | fused add {gbs:,.0f} GB/s, {times['add unfused'] / times['add fused']:.2f}x unfused,"
            f" max rel err {err:.1e}",
            flush=True,
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b", choices=sorted(SHAPES), help="default qwen3-30b")
    ap.add_argument("--ranks", default="16", help="comma-separated LoRA ranks (default 16)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per case (default 20)")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape, float32 on CPU when no GPU")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and moe8.cuda_available()
    if not cuda and not args.tiny:
        print("bench_lowrank: needs a CUDA GPU with moe8's CUDA kernels (or --tiny)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        ap.error(f"--ranks: expected comma-separated integers, got {args.ranks!r}")
    shape = "tiny" if args.tiny else args.shape
    env = {
        **run_info(device),
        "dtype": str(dtype).replace("torch.", ""),
        "shape": shape,
    }
    print(env)
    results = [r for rank in ranks for r in bench(shape, rank, device, dtype, args.iters)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
