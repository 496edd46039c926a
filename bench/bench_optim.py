"""The AdamW step alone over a model's parameters: moe8.optim.AdamW against torch.optim.AdamW(fused=True) (what
transformers' Trainer builds by default) and torch's foreach AdamW, on the parameters of bench_step_profile's
2-layer slices (Mixtral-8x7B: 3.16B, Qwen3-30B-A3B: 1.9B; bf16 parameters, gradients and states, as the step
trains them). Prints ms per step, GB/s of the bytes the step must move (14 per bf16 parameter: the parameter,
its two states read and written, its gradient read) beside a copy's rate on the same GPU, and the largest
difference of moe8's parameters from torch fused's after the steps.

    PYTHONPATH=python python bench/bench_optim.py --models mixtral,qwen3 --json bench/results/optim_h200.json
    PYTHONPATH=python python bench/bench_optim.py --tiny     # smoke test of the script, CPU is fine
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_layer import median_ms  # this folder is on sys.path
from run_info import run_info

import moe8


def slice_shapes(hidden, inter, experts, vocab, heads, kv_heads, head_dim, layers=2) -> list:
    """The parameter shapes of a 2-layer MoE slice (experts fused as 3-D tensors, as transformers 5 holds them)."""
    per_layer = [
        (experts, 2 * inter, hidden),  # gate_up
        (experts, hidden, inter),  # down
        (experts, hidden),  # router
        (heads * head_dim, hidden),  # q
        (kv_heads * head_dim, hidden),  # k
        (kv_heads * head_dim, hidden),  # v
        (hidden, heads * head_dim),  # o
        (hidden,),  # input norm
        (hidden,),  # post-attention norm
    ]
    return per_layer * layers + [(vocab, hidden), (vocab, hidden), (hidden,)]


MODELS = {
    "mixtral": slice_shapes(4096, 14336, 8, 32000, 32, 8, 128),
    "qwen3": slice_shapes(2048, 768, 128, 151936, 32, 4, 128),
    "tiny": slice_shapes(64, 32, 4, 500, 4, 2, 16),
}
BYTES_PER_PARAM = 14  # bf16: the parameter and both states read and written, the gradient read


def make(shapes, device, dtype, seed=0) -> list:
    g = torch.Generator(device=device).manual_seed(seed)
    ps = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, device=device, generator=g) * 0.02).to(dtype))
        p.grad = (torch.randn(s, device=device, generator=g) * 1e-3).to(dtype)
        ps.append(p)
    return ps


def bench(name, device, dtype, iters) -> dict:
    shapes = MODELS[name]
    params = make(shapes, device, dtype)
    n = sum(p.numel() for p in params)
    nbytes = n * (7 * torch.finfo(dtype).bits // 8)
    impls = {
        "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-5, fused=device.type == "cuda"),
        "torch_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-5, foreach=True),
        "moe8": lambda ps: moe8.optim.AdamW(ps, lr=1e-5, fused=device.type == "cuda"),
    }
    row = {"model": name, "params": n, "tensors": len(shapes), "bytes": nbytes}
    finals = {}
    for impl, build in impls.items():
        ps = make(shapes, device, dtype)  # the same values for every implementation
        opt = build(ps)
        row[f"{impl}_ms"] = median_ms(opt.step, device, iters=iters)
        row[f"{impl}_GBps"] = nbytes / (row[f"{impl}_ms"] * 1e-3) / 1e9
        if impl != "torch_foreach":
            finals[impl] = [p.detach().clone() for p in ps]
        del opt, ps
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # after the same number of steps from the same start: moe8 against torch fused
    diffs = [
        (a.float() - b.float()).abs().max().item() for a, b in zip(finals["moe8"], finals["torch_fused"])
    ]
    row["max_abs_diff_vs_torch_fused"] = max(diffs)
    same = sum(torch.equal(a, b) for a, b in zip(finals["moe8"], finals["torch_fused"]))
    row["tensors_same_bits_as_torch_fused"] = f"{same} of {len(shapes)}"
    big = torch.empty(n, device=device, dtype=dtype)
    out = torch.empty_like(big)
    row["copy_ms"] = median_ms(lambda: out.copy_(big), device, iters=iters)
    row["copy_GBps"] = 2 * big.nbytes / (row["copy_ms"] * 1e-3) / 1e9
    row["torch_fused_over_moe8"] = row["torch_fused_ms"] / row["moe8_ms"]
    return row


def table(rows) -> str:
    cols = ["torch_fused", "torch_foreach", "moe8"]
    head = f"{'model':8} {'params':>8} " + " ".join(f"{c + ' ms':>17}" for c in cols)
    head += f" {'fused/moe8':>10} " + " ".join(f"{c + ' GB/s':>18}" for c in [*cols, "copy"])
    lines = [head]
    for r in rows:
        line = f"{r['model']:8} {r['params'] / 1e9:7.2f}B " + " ".join(f"{r[c + '_ms']:17.2f}" for c in cols)
        line += f" {r['torch_fused_over_moe8']:9.2f}x " + " ".join(
            f"{r[c + '_GBps']:18,.0f}" for c in [*cols, "copy"]
        )
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mixtral,qwen3", help=f"comma-separated, from {sorted(MODELS)}")
    ap.add_argument("--iters", type=int, default=5, help="timed steps per implementation (default 5)")
    ap.add_argument("--tiny", action="store_true", help="the tiny slice only, on the CPU when no GPU")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    names = ["tiny"] if args.tiny else args.models.split(",")
    for m in names:
        if m not in MODELS:
            raise SystemExit(f"--models: expected names from {sorted(MODELS)}, got {m!r}")
    cuda = torch.cuda.is_available() and moe8.cuda_available()
    if not cuda and not args.tiny:
        print("bench_optim: needs a CUDA GPU with moe8's CUDA kernels (or --tiny)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    env = {**run_info(device), "dtype": "bfloat16", "iters": args.iters, "lr": 1e-5, "weight_decay": 0.01}
    print(env)
    rows = []
    for m in names:
        rows.append(bench(m, device, torch.bfloat16, args.iters))
        r = rows[-1]
        print(f"{m}: max |moe8 - torch fused| after {args.iters + 3} steps {r['max_abs_diff_vs_torch_fused']:.2e}, "
              f"tensors with the same bits {r['tensors_same_bits_as_torch_fused']}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": rows}, f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
