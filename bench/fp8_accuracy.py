"""FP8 error of each recipe: a whole MoE layer (moe8.moe_forward) with its forward expert GEMMs in FP8 vs the
same layer in bf16, on random bf16 data: the relative (Frobenius) error of the output and of the input
gradient for a random upstream gradient; then the floor e4m3 sets, the error of one GEMM of the same data
with its operands rounded through e4m3 in plain torch (no moe8 kernel). Runs on the CPU (whose quantisation bytes equal the GPU's) or a GPU.

    PYTHONPATH=python python bench/fp8_accuracy.py --json bench/results/fp8_accuracy_cpu.json
    PYTHONPATH=python python bench/fp8_accuracy.py --tokens 16384 --experts 128 --top-k 8 --device cuda
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_layer import rel  # the layer benchmark's relative error (this folder is on sys.path)
from run_info import run_info

import moe8

RECIPES = ("blockwise", "rowwise", "tensorwise")


def e4m3_1x128(t):
    """t rounded through e4m3 with a float32 scale per 1x128 block of its last dim (amax -> 448), in float32:
    the blockwise recipe's activation rounding, simulated in plain torch (the last dim zero-padded to 128)."""
    t = t.float()
    width = t.shape[-1]
    t = torch.nn.functional.pad(t, (0, -width % 128)).unflatten(-1, (-1, 128))
    scale = t.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448.0
    return ((t * (1.0 / scale)).to(torch.float8_e4m3fn).float() * scale).flatten(-2)[..., :width]


def e4m3_floor(x, w) -> dict:
    """The error e4m3 itself puts on one GEMM x @ w^T (float32 accumulation, pure torch, no moe8 kernel):
    both operands rounded through e4m3 with 1x128 scales, and the activations alone."""
    want = x.float() @ w.float().t()
    return {
        "one_gemm_both_operands": rel(e4m3_1x128(x) @ e4m3_1x128(w).t(), want),
        "one_gemm_activations_only": rel(e4m3_1x128(x) @ w.float().t(), want),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    T, H, I, E, K = args.tokens, args.hidden, args.intermediate, args.experts, args.top_k
    if min(T, H, I, E, K) < 1 or K > E:
        raise SystemExit(
            f"expected positive sizes and --top-k <= --experts, got T {T} H {H} I {I} E {E} k {K}"
        )
    if args.device not in ("cpu", "cuda"):
        raise SystemExit(f"--device: expected cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not (torch.cuda.is_available() and moe8.cuda_available()):
        raise SystemExit("--device cuda: needs a CUDA GPU and moe8 built with CUDA")
    torch.manual_seed(0)
    f = dict(device=args.device)
    x = torch.randn(T, H, **f).bfloat16()
    router = (torch.randn(E, H, **f) * H**-0.5).bfloat16()
    gate_up = (torch.randn(E, 2 * I, H, **f) * H**-0.5).bfloat16()
    down = (torch.randn(E, H, I, **f) * I**-0.5).bfloat16()
    dy = torch.randn(T, H, **f).bfloat16()

    def layer(recipe):
        xx = x.clone().requires_grad_()
        extra = {"fp8": recipe} if recipe else {}
        y, _ = moe8.moe_forward(xx, router, gate_up, down, K, "softmax", True, **extra)
        return y.detach(), torch.autograd.grad(y, xx, dy)[0]

    y16, g16 = layer(None)
    out = {
        "meta": dict(
            **run_info(args.device),
            shape=dict(T=T, H=H, I=I, E=E, K=K),
            note="forward expert GEMMs in FP8, backward bf16; relative Frobenius error vs the bf16 layer",
        )
    }
    for r in RECIPES:
        y8, g8 = layer(r)
        out[r] = {"output": rel(y8, y16), "grad_x": rel(g8, g16)}
        print(f"{r:<10} output {out[r]['output']:.2e}  input gradient {out[r]['grad_x']:.2e}", flush=True)
    out["e4m3_floor"] = floor = e4m3_floor(x, gate_up[0])
    print(
        f"e4m3 floor, one GEMM x @ gate_up[0]^T in plain torch: both operands {floor['one_gemm_both_operands']:.2e}, "
        f"activations only {floor['one_gemm_activations_only']:.2e}",
        flush=True,
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
