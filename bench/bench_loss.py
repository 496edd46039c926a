"""The LM head and its cross-entropy alone, forward + backward, at the shapes of the HF step's micro-batch (4 x 2048
tokens): moe8.loss.chunked_cross_entropy against the unfused loss transformers computes (the full logits,
`logits.float()`, F.cross_entropy) and Liger Kernel's fused linear cross-entropy where it is installed. Prints ms
of loss + backward, the TFLOP/s of its three GEMMs (logits, d hidden, d weight: 6 N H V), the peak memory above
the inputs, the loss's and the gradients' difference from the unfused loss, and moe8's top kernels.

    PYTHONPATH=python:bench python bench/bench_loss.py --json bench/results/loss_h200.json
    PYTHONPATH=python:bench python bench/bench_loss.py --tiny     # smoke test of the script, CPU is fine
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from bench_layer import median_ms  # this folder is on sys.path
from profiling import profile_step
from run_info import run_info

import moe8
from moe8.loss import chunk_rows, chunked_cross_entropy

SHAPES = {  # name: (tokens, hidden, vocabulary)
    "qwen3": (8192, 2048, 151936),
    "qwen3-vocab151669": (8192, 2048, 151669),
    "olmoe": (8192, 2048, 50304),
    "mixtral": (8192, 4096, 32000),
}
TINY = {"tiny": (64, 32, 300), "tiny-odd": (37, 24, 129)}


def unfused(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t, ignore_index=-100, reduction="sum")


def liger_loss():
    """Liger Kernel's fused linear cross-entropy as f(h, w, t) -> summed loss, or None where not installed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")
    return lambda h, w, t: fn(w, h, t)


def run_once(loss_fn, h0, w0, t):
    h, w = h0.detach().requires_grad_(True), w0.detach().requires_grad_(True)
    loss = loss_fn(h, w, t)
    loss.backward()
    return loss.detach().float(), h.grad, w.grad


def peak_gib(fn, device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bench(name, n, hdim, vocab, device, dtype, iters, impls, profile_rows) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, hdim, device=device, generator=g).to(dtype)
    w = (torch.randn(vocab, hdim, device=device, generator=g) * hdim**-0.5).to(dtype)
    t = torch.randint(0, vocab, (n,), device=device, generator=g)
    t[::17] = -100
    flops = 6 * n * hdim * vocab
    row = {"shape": name, "tokens": n, "hidden": hdim, "vocab": vocab, "moe8_chunk_rows": chunk_rows(w)}
    ref = run_once(unfused, h, w, t)
    for impl, fn in impls.items():
        got = run_once(fn, h, w, t)
        ms = median_ms(lambda fn=fn: run_once(fn, h, w, t), device, warmup=2, iters=iters)
        row[f"{impl}_ms"] = ms
        row[f"{impl}_TFLOPs"] = flops / (ms * 1e-3) / 1e12
        row[f"{impl}_peak_GiB"] = peak_gib(lambda fn=fn: run_once(fn, h, w, t), device)
        if impl != "unfused":
            row[f"{impl}_loss_rel_diff"] = float((got[0] - ref[0]).abs() / ref[0].abs())
            row[f"{impl}_dh_rel_err"], row[f"{impl}_dw_rel_err"] = rel(got[1], ref[1]), rel(got[2], ref[2])
        del got
    if profile_rows:
        row["moe8_top_kernels"] = profile_step(lambda: run_once(impls["moe8"], h, w, t), profile_rows)
    return row


def table(rows, impls) -> str:
    head = f"{'shape':20} " + " ".join(f"{i + ' ms':>12} {'TFLOP/s':>8} {'GiB':>6}" for i in impls)
    lines = [head]
    for r in rows:
        cells = (f"{r[i + '_ms']:12.2f} {r[i + '_TFLOPs']:8.0f} {r[i + '_peak_GiB']:6.2f}" for i in impls)
        lines.append(f"{r['shape']:20} " + " ".join(cells))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes", default=",".join(SHAPES), help=f"comma-separated, from {list(SHAPES)} (--tiny: its own)"
    )
    ap.add_argument("--iters", type=int, default=10, help="timed calls per implementation (default 10)")
    ap.add_argument("--profile", type=int, default=10, help="moe8's top kernels to record (0: none)")
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 shapes, on the CPU when no GPU")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    shapes = TINY if args.tiny else SHAPES
    names = list(shapes) if args.tiny else args.shapes.split(",")
    bad = [s for s in names if s not in shapes]
    if bad:
        print(f"bench_loss: --shapes: unknown {bad}, expected some of {list(shapes)}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available() and moe8.cuda_available()
    if not cuda and not args.tiny:
        print("bench_loss: needs a CUDA GPU with moe8's CUDA kernels (or --tiny)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    impls = {"moe8": lambda h, w, t: chunked_cross_entropy(h, w, t, chunk=None), "unfused": unfused}
    liger = liger_loss() if cuda else None
    if liger is not None:
        impls["liger"] = liger
    env = {**run_info(device), "dtype": str(dtype), "iters": args.iters}
    env["liger"] = "run" if liger is not None else "not run (needs liger-kernel and a GPU)"
    print(env, flush=True)
    rows = []
    for name in names:
        rows.append(bench(name, *shapes[name], device, dtype, args.iters, impls, args.profile))
        r = rows[-1]
        print(f"{name}: moe8 loss rel diff {r['moe8_loss_rel_diff']:.1e}, d hidden {r['moe8_dh_rel_err']:.1e}, "
              f"d weight {r['moe8_dw_rel_err']:.1e} (vs unfused)", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": rows}, f, indent=1)
    print(table(rows, list(impls)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
