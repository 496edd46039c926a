"""Sustained throughput of a grouped GEMM against the GPU's SM clock and power: each case runs back to back
for about --seconds while nvidia-smi samples clocks.sm and power.draw every 50 ms; prints ms per call,
TFLOP/s, the mean SM clock and power over the case, and TFLOP/s per GHz (a kernel limited only by the clock
keeps that last figure when the clock drops). For telling a power-lowered clock from a slower kernel.

    PYTHONPATH=python python bench/bench_clocks.py --json bench/results/clocks_h200.json

Shapes (--shape; the gate_up forward, balanced routing, 16,384 tokens):
  mixtral  Mixtral-8x7B, top-2: [32768, 4096] x 8 x [28672, 4096] (default)
  qwen3    Qwen3-30B-A3B, top-8: [131072, 2048] x 128 x [1536, 2048] (1,024 rows an expert)
Cases:
  fp8_blockwise  moe8's FP8 blockwise grouped GEMM (quantisation not timed)
  fp8_rowwise    torch._scaled_grouped_mm, rowwise scales, fast accumulation (as bench_gemm.py compares)
  bf16           moe8's bf16 grouped GEMM
  bf16_torch     torch._grouped_mm
  bf16_batched   cuBLAS, the same groups as one strided-batched GEMM (torch.bmm; bench_gemm.py --bounds)
  bf16_dense     cuBLAS, the same FLOPs as one dense GEMM (torch.mm)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch
from bench_gemm import balanced_cases, bound_cases  # this folder is on sys.path
from run_info import run_info

import moe8

CASES = ("fp8_blockwise", "fp8_rowwise", "bf16", "bf16_torch", "bf16_batched", "bf16_dense")
DEFAULT_CASES = CASES[:4]
SHAPES = {  # name: (rows R, K, N, experts E) of the gate_up forward
    "mixtral": (32768, 4096, 28672, 8),
    "qwen3": (131072, 2048, 1536, 128),
}


def make_cases(names, shape, device) -> dict:
    """{case: fn} from bench_gemm.py's fwd (moe8, torch) and fp8_fwd (moe8 blockwise, torch rowwise) GEMMs
    and its bounds (cuBLAS batched and dense) at shape (R, K, N, E)."""
    R, K, N, E = shape
    torch.manual_seed(0)
    c = balanced_cases(R, K, N, E, ["fwd", "fp8_fwd"], device)
    (bf16, bf16_torch, _, _), (fp8_blockwise, fp8_rowwise, _, _) = c["fwd"], c["fp8_fwd"]
    every = dict(fp8_blockwise=fp8_blockwise, fp8_rowwise=fp8_rowwise, bf16=bf16, bf16_torch=bf16_torch)
    if {"bf16_batched", "bf16_dense"} & set(names):
        a = torch.randn(R, K, device=device, dtype=torch.bfloat16)
        w = torch.randn(E, N, K, device=device, dtype=torch.bfloat16).mul_(K**-0.5)
        bound = bound_cases(a, w, None, E, ["fwd"])["fwd"]
        every |= dict(bf16_batched=bound["batched"], bf16_dense=bound["dense"])
    missing = [name for name in names if every[name] is None]
    if missing:
        raise SystemExit(f"bench_clocks: {missing} need torch._scaled_grouped_mm, which this torch lacks")
    return {name: every[name] for name in names}


def sample_clocks(seconds_idle: float):
    """nvidia-smi sampling every 50 ms in the background, started seconds_idle before returning."""
    cmd = [
        "nvidia-smi",
        "--query-gpu=clocks.sm,power.draw",
        "--format=csv,noheader,nounits",
        "-lms",
        "50",
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    time.sleep(seconds_idle)
    return p


def run_case(fn, seconds: float) -> dict:
    """Back-to-back calls for about `seconds`: the number of calls, the first call's ms, ms per call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    first_ms = a.elapsed_time(b)
    n = max(3, int(seconds * 1e3 / max(first_ms, 1e-3)))
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return dict(calls=n, first_call_ms=first_ms, ms=a.elapsed_time(b) / n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--cases",
        default=",".join(DEFAULT_CASES),
        help=f"comma-separated, from {CASES} (default: the first four)",
    )
    ap.add_argument(
        "--shape", default="mixtral", choices=sorted(SHAPES), help="the gate_up forward of this model"
    )
    ap.add_argument(
        "--seconds", type=float, default=3.0, help="seconds of back-to-back calls per case (default 3)"
    )
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    names = [c for c in args.cases.split(",") if c]
    bad = [c for c in names if c not in CASES]
    if bad:
        raise SystemExit(f"--cases: unknown {bad}, expected from {list(CASES)}")
    if args.seconds <= 0:
        raise SystemExit(f"--seconds: expected > 0, got {args.seconds}")
    if not (torch.cuda.is_available() and moe8.cuda_available()):
        raise SystemExit("bench_clocks: needs a CUDA GPU and moe8 built with CUDA")
    R, K, N, E = SHAPES[args.shape]
    fns = make_cases(names, SHAPES[args.shape], torch.device("cuda"))
    flops = 2 * R * K * N
    rows = []
    for name in names:
        time.sleep(2.0)  # let the clock recover between cases
        smi = sample_clocks(0.2)
        r = run_case(fns[name], args.seconds)
        smi.terminate()
        samples = []
        for line in smi.communicate()[0].splitlines():
            try:
                clock, power = (float(x) for x in line.split(","))
            except ValueError:
                continue
            samples.append((clock, power))
        # the sampler started 0.2 s before the calls: keep the samples of the busy part (the last ones)
        busy = samples[int(0.2 / 0.05) :] or samples
        clock = sum(s[0] for s in busy) / len(busy) / 1e3 if busy else float("nan")
        power = sum(s[1] for s in busy) / len(busy) if busy else float("nan")
        tflops = flops / r["ms"] / 1e9
        row = dict(
            case=name,
            calls=r["calls"],
            first_call_ms=r["first_call_ms"],
            ms=r["ms"],
            tflops=tflops,
            first_call_tflops=flops / r["first_call_ms"] / 1e9,
            sm_clock_ghz=clock,
            power_w=power,
            tflops_per_ghz=tflops / clock,
            samples=len(busy),
        )
        rows.append(row)
        print(
            f"{name:<14} {r['calls']:4d} calls  {r['ms']:7.3f} ms  {tflops:6.0f} TFLOP/s  (first call "
            f"{row['first_call_tflops']:.0f})  SM {clock:.2f} GHz  {power:.0f} W  {row['tflops_per_ghz']:.0f} "
            "TFLOP/s per GHz",
            flush=True,
        )
    if args.json:
        meta = dict(
            **run_info("cuda"),
            shape=dict(model=args.shape, rows=R, K=K, N=N, experts=E),
        )
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, cases=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
