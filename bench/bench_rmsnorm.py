"""RMSNorm alone at Qwen3-30B-A3B's shapes (micro-batch 2 x 4096 tokens): the hidden norms [8192, 2048] and the
per-head q / k norms over head_dim 128 ([8192 x 32, 128], [8192 x 4, 128]). Times the forward and the backward
(torch.autograd.grad of x and the weight) of moe8.ops.rms_norm against torch.nn.functional.rms_norm, and Liger
Kernel's RMSNorm (casting_mode "gemma": fp32 math, one rounding, the same semantics) where it is installed; prints
ms, the ratio and GB/s of the bytes each pass must move (forward: x read, y written; backward: x and dy read, dx
written, plus the weight, its gradient and rstd), then the largest difference from torch's results.

    PYTHONPATH=python python bench/bench_rmsnorm.py --json bench/results/rmsnorm_h200.json
    PYTHONPATH=python python bench/bench_rmsnorm.py --tiny     # smoke test of the script, CPU is fine
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from bench_layer import median_ms  # this folder is on sys.path
from run_info import NOT_RECORDED, run_info

import moe8
from moe8 import ops

SHAPES = {
    "qwen3-30b": [("hidden", 8192, 2048), ("q_norm", 8192 * 32, 128), ("k_norm", 8192 * 4, 128)],
    "tiny": [("hidden", 64, 256), ("q_norm", 256, 128), ("odd", 7, 100)],
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EPS = 1e-6


def liger_norm():
    """Liger Kernel's RMSNorm as f(x, w) -> y, or None where it is not installed (it needs Triton and a GPU)."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "gemma", False)


def pass_bytes(rows: int, cols: int, elem: int) -> dict:
    """The bytes each pass must move at least."""
    return {
        "forward": 2 * rows * cols * elem + cols * elem + 4 * rows,
        "backward": 3 * rows * cols * elem + 2 * cols * elem + 4 * rows,
    }


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def time_impl(norm, x, w, dy, device, iters) -> tuple[dict, tuple]:
    """Median ms of norm's forward and of its backward, and its (y, dx, dw)."""
    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    y = norm(xg, wg)
    grads = torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)
    with torch.no_grad():
        fwd = median_ms(lambda: norm(x, w), device, iters=iters)
    bwd = median_ms(lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True), device, iters=iters)
    return {"forward": fwd, "backward": bwd}, (y.detach(), *grads)


def bench(name, rows, cols, device, dtype, iters, peers) -> list:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, cols, device=device, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(cols, device=device, generator=g)).to(dtype)
    dy = torch.randn(rows, cols, device=device, generator=g).to(dtype)
    impls = {
        "torch": lambda a, b: F.rms_norm(a, (cols,), b, EPS),
        "moe8": lambda a, b: ops.rms_norm(a, b, EPS),
    }
    impls.update(peers)
    ms, outs = {}, {}
    for impl, norm in impls.items():
        ms[impl], outs[impl] = time_impl(norm, x, w, dy, device, iters)
    nbytes = pass_bytes(rows, cols, x.element_size())
    rows_out = []
    for p in ("forward", "backward"):
        row = {"shape": f"{name} [{rows}, {cols}]", "pass": p, "bytes": nbytes[p]}
        for impl in impls:
            row[f"{impl}_ms"] = ms[impl][p]
            row[f"{impl}_GBps"] = nbytes[p] / (ms[impl][p] * 1e-3) / 1e9
        row["torch_over_moe8"] = ms["torch"][p] / ms["moe8"][p]
        rows_out.append(row)
    # the largest difference from torch's y, dx, dw, relative to torch's largest value
    for impl in impls:
        if impl != "torch":
            rows_out[0][f"{impl}_max_rel_err"] = [max_rel(a, b) for a, b in zip(outs[impl], outs["torch"])]
    # dw twice from the same inputs: moe8's sum runs in a fixed order
    again = time_impl(impls["moe8"], x, w, dy, device, 1)[1]
    rows_out[1]["moe8_dw_same_bits"] = bool(torch.equal(again[2], outs["moe8"][2]))
    return rows_out


def table(rows, peers) -> str:
    impls = ["torch", "moe8", *peers]
    head = f"{'shape':24} {'pass':8} " + " ".join(f"{i + ' ms':>10}" for i in impls)
    head += f" {'torch/moe8':>10} " + " ".join(f"{i + ' GB/s':>10}" for i in impls)
    lines = [head]
    for r in rows:
        line = f"{r['shape']:24} {r['pass']:8} " + " ".join(f"{r[i + '_ms']:10.3f}" for i in impls)
        line += f" {r['torch_over_moe8']:9.2f}x " + " ".join(f"{r[i + '_GBps']:10,.0f}" for i in impls)
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="default bfloat16")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per pass (default 20)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, on the CPU when no GPU")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and moe8.cuda_available()
    if not cuda and not args.tiny:
        print("bench_rmsnorm: needs a CUDA GPU with moe8's CUDA kernels (or --tiny)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype]
    peers = {}
    liger = liger_norm() if cuda else None
    if liger is not None:
        peers["liger"] = liger
    shape = "tiny" if args.tiny else "qwen3-30b"
    env = {
        **run_info(device),
        "dtype": args.dtype,
        "shape": shape,
        "eps": EPS,
        "iters": args.iters,
        "liger": _liger_version() if liger is not None else "not run (needs liger-kernel and a GPU)",
    }
    print(env)
    results = []
    for name, rows, cols in SHAPES[shape]:
        results += bench(name, rows, cols, device, dtype, args.iters, peers)
        r = results[-2]
        errs = {k: [f"{e:.1e}" for e in v] for k, v in r.items() if k.endswith("max_rel_err")}
        print(f"{r['shape']}: max rel err vs torch (y, dx, dw) {errs}; moe8 dw same bits twice: "
              f"{results[-1]['moe8_dw_same_bits']}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=1)
    print(table(results, list(peers)))
    return 0


def _liger_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return NOT_RECORDED


if __name__ == "__main__":
    sys.exit(main())
