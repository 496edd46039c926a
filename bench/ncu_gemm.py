"""One launch of a grouped GEMM (and torch's counterpart where there is one) between cudaProfilerStart and
cudaProfilerStop, after three warm-up calls, for Nsight Compute to profile without the rest of a benchmark:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight python bench/ncu_gemm.py fp8_mixtral

Cases (balanced routing, 16,384 tokens):
  fp8_mixtral   Mixtral-8x7B gate_up forward, FP8 blockwise (moe8 only)
  dgrad_qwen3   Qwen3-30B-A3B down-projection dgrad, bf16: moe8, then torch._grouped_mm
"""

from __future__ import annotations

import argparse

import torch

import moe8
from moe8 import fp8, ops

CASES = ("fp8_mixtral", "dgrad_qwen3")


def balanced_offsets(rows: int, experts: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets [E + 1], ends [E]) of rows spread evenly over the experts."""
    ends = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * (rows // experts)
    return torch.cat([ends.new_zeros(1), ends]), ends


def calls(case: str, device) -> list:
    torch.manual_seed(0)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    if case == "fp8_mixtral":  # a [R, 4096] . w[e] [28672, 4096]^T
        R, K, N, E = 32768, 4096, 28672, 8
        offsets, _ = balanced_offsets(R, E, device)
        aq, a_scale = fp8.quantize_rows_1x128(torch.randn(R, K, **bf16), None, 1)
        wq, w_scale = fp8.quantize_weight_128x128(torch.randn(E, N, K, **bf16) * K**-0.5)
        return [lambda: fp8.grouped_gemm_fp8(aq, a_scale, wq, w_scale, offsets, torch.bfloat16)]
    # dgrad_qwen3: dc [R, 2048] . w[e] [2048, 768] -> [R, 768]
    R, H, I, E = 131072, 2048, 768, 128
    offsets, ends = balanced_offsets(R, E, device)
    dc = torch.randn(R, H, **bf16)
    w = torch.randn(E, H, I, **bf16) * I**-0.5
    return [lambda: ops.grouped_gemm(dc, w, offsets, 1, None), lambda: torch._grouped_mm(dc, w, offs=ends)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=CASES)
    args = ap.parse_args()
    if not (torch.cuda.is_available() and moe8.cuda_available()):
        raise SystemExit("ncu_gemm: needs a CUDA GPU and moe8 built with CUDA")
    ops.set_index_validation(False)  # as in training: offsets come from moe8's own plan
    fns = calls(args.case, torch.device("cuda"))
    for f in fns:
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for f in fns:
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"ncu_gemm: {args.case}: {len(fns)} launch(es) profiled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
