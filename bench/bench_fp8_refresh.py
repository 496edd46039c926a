"""What the per-optimizer-step refresh of the FP8 expert weights costs (blockwise 128x128, both layouts: the
forward's copy and the FP8 dgrad's transposed one), for the expert weights of one MoE layer:

  forward only  quantize_weight_128x128 of gate_up and down (what a bf16-dgrad recipe pays)
  two passes    that, then the codes and scales transposed by torch (a second pass for the dgrad's layout)
  one pass      quantize_weight_128x128_pair: both layouts written by one kernel
  cache         Fp8WeightCache.get of both layouts, as a training step asks for them (one pass, plus Python)

    python bench/bench_fp8_refresh.py --shapes qwen3,mixtral,deepseek --json bench/results/fp8_refresh_h200.json

Prints ms per layer and the bytes moved per second (2 read + 1 written per weight, +1 for the second layout;
the two-pass form moves 2 more, but is credited only the same bytes)."""

from __future__ import annotations

import argparse
import json

import torch
from bench_gemm import SHAPES, TINY  # this folder is on sys.path
from bench_layer import median_ms
from run_info import run_info

import moe8
from moe8 import fp8


def forms(gate_up, down):
    """name -> (fn, bytes moved per call)."""
    ws = (gate_up, down)
    n = sum(w.numel() for w in ws)
    r = fp8.Float8Recipe(dgrad="fp8")

    def forward_only():
        return [fp8.quantize_weight_128x128(w) for w in ws]

    def two_passes():
        out = []
        for w in ws:
            q, s = fp8.quantize_weight_128x128(w)
            out.append((q, s, q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous()))
        return out

    def one_pass():
        return [fp8.quantize_weight_128x128_pair(w) for w in ws]

    def cache():
        c = fp8.Fp8WeightCache()
        return [(c.get(w, 0, r), c.get(w, 1, r)) for w in ws]

    return {
        "forward_only": (forward_only, 3 * n),
        "two_passes": (two_passes, 4 * n),
        "one_pass": (one_pass, 4 * n),
        "cache": (cache, 4 * n),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes", default="qwen3,mixtral,deepseek", help=f"comma-separated, from {sorted(SHAPES)}"
    )
    ap.add_argument("--tiny", action="store_true", help="one tiny shape (CPU smoke test)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shapes = TINY if args.tiny else SHAPES
    names = list(shapes) if args.tiny else args.shapes.split(",")
    for name in names:
        if name not in shapes:
            raise SystemExit(f"--shapes: unknown {name!r}, expected from {sorted(shapes)}")
    if args.iters < 1:
        raise SystemExit(f"--iters: expected >= 1, got {args.iters}")
    device = torch.device("cuda" if moe8.cuda_available() else "cpu")
    rows = []
    for name in names:
        H, I, E, _ = shapes[name]
        g = torch.Generator(device).manual_seed(0)
        bf16 = dict(
            device=device, generator=g, dtype=torch.bfloat16
        )  # no float32 copy: DeepSeek-V3's are 22 GB
        gate_up = torch.nn.Parameter(torch.randn(E, 2 * I, H, **bf16))
        down = torch.nn.Parameter(torch.randn(E, H, I, **bf16))
        row = {"shape": name, "E": E, "H": H, "I": I, "weights": gate_up.numel() + down.numel()}
        for form, (fn, nbytes) in forms(gate_up, down).items():
            ms = median_ms(fn, device, warmup=2, iters=args.iters)
            row[f"{form}_ms"], row[f"{form}_gbps"] = ms, nbytes / ms / 1e6
            print(f"[bench] {name} {form}: {ms:.3f} ms, {nbytes / ms / 1e6:,.0f} GB/s", flush=True)
        rows.append(row)
        del gate_up, down, fn
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta = {**run_info(device), "timing": f"CUDA events, median of {args.iters}"}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(
        f"\n{meta}\n{'shape':<9} {'weights':>8} {'fwd only':>9} {'2 passes':>9} {'1 pass':>9} {'cache':>9}  (ms/layer)"
    )
    for r in rows:
        print(
            f"{r['shape']:<9} {r['weights'] / 1e6:>7.0f}M {r['forward_only_ms']:>9.3f} {r['two_passes_ms']:>9.3f} "
            f"{r['one_pass_ms']:>9.3f} {r['cache_ms']:>9.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
