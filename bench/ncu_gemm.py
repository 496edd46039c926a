"""One launch of a grouped GEMM or an FP8 quantisation (and torch's counterpart where there is one) between
cudaProfilerStart and cudaProfilerStop, after three warm-up calls, for Nsight Compute to profile without the
rest of a benchmark:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight python bench/ncu_gemm.py fp8_mixtral

--time N: no profiler; each call's median milliseconds over N launches (CUDA events), printed and, with --json,
written to a file. --cold: each timed launch after 256 MiB written elsewhere, so its inputs start outside L2
(as in a model's step, where other work ran in between).

Cases (balanced routing, 16,384 tokens):
  fp8_mixtral   Mixtral-8x7B gate_up forward, FP8 blockwise (moe8 only)
  dgrad_qwen3   Qwen3-30B-A3B down-projection dgrad, bf16: moe8, then torch._grouped_mm
  fwd_qwen3     Qwen3-30B-A3B up-projection forward, bf16: moe8, torch._grouped_mm, then cuBLAS on the same FLOPs
                as one strided-batched GEMM (torch.bmm) and as one dense GEMM (torch.mm): what grouping costs
  down_qwen3    Qwen3-30B-A3B down-projection forward (K = 768), bf16: the same four as fwd_qwen3
  swiglu_qwen3  Qwen3-30B-A3B up-projection forward with SwiGLU in the GEMM's epilogue (moe8.ops.grouped_gemm_swiglu),
                then the two calls it replaces (the GEMM, the activation) and each alone
  swiglu_olmoe  the same at OLMoE-1B-7B's shape (H 2048, I 1024, 64 experts, 2,048 rows an expert)
  act_dgrad_qwen3  Qwen3-30B-A3B down-projection dgrad with the routed activation backward in its epilogue
                (moe8.fused.dgrad_activation_backward, the sm_90a fused kernel), then the plain dgrad and the
                separate pass it replaces (activation_backward_routed)
  gathered_qwen3  Qwen3-30B-A3B up-projection forward with the rows read from x inside the GEMM
                (moe8.ops.gathered_grouped_gemm, the gathered-rows mainloop), then the gather and the plain GEMM
                it replaces
  gathered_wgrad_qwen3  Qwen3-30B-A3B up-projection weight gradient with the rows read from x inside the GEMM
                (moe8.ops.gathered_grouped_gemm_wgrad), then the gather and the plain weight gradient it replaces
  quant_deepseek  DeepSeek-V3's 1x128 row quantisations of an FP8 step (bench_layer.py: 3.4 ms of 57): the
                tokens gathered into expert order and quantised (x [16384, 7168], top-8), the same token-major
                (slot_to_row given: each token read and quantised once), d h [131072, 4096] quantised, then
                torch's gather of the same rows (index_select) as a bandwidth yardstick
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from bench_gemm import balanced_cases, bound_cases  # this folder is on sys.path

import moe8
from moe8 import ops

CASES = (
    "fp8_mixtral",
    "dgrad_qwen3",
    "fwd_qwen3",
    "down_qwen3",
    "swiglu_qwen3",
    "swiglu_olmoe",
    "act_dgrad_qwen3",
    "gathered_qwen3",
    "gathered_wgrad_qwen3",
    "quant_deepseek",
)


def calls(case: str, device) -> list:
    """The launches to profile: moe8's, then torch's where bench_gemm.py has one."""
    torch.manual_seed(0)
    if case == "fp8_mixtral":  # a [32768, 4096] . w[e] [28672, 4096]^T
        mine, _, _, _ = balanced_cases(32768, 4096, 28672, 8, ["fp8_fwd"], device)["fp8_fwd"]
        return [mine]
    if case == "quant_deepseek":
        from moe8 import fp8

        T, H, E, K = 16384, 7168, 256, 8
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
        ids = torch.randn(T, E, device=device).topk(K, dim=1).indices.int()
        _, _, row_to_slot, slot_to_row = ops.plan(ids, E, 1, False)
        dh = torch.randn(T * K, 4096, device=device, dtype=torch.bfloat16)
        token = (row_to_slot // K).long()
        return [
            lambda: fp8.quantize_rows_1x128(x, row_to_slot, K),
            lambda: fp8.quantize_rows_1x128(x, row_to_slot, K, slot_to_row),
            lambda: fp8.quantize_rows_1x128(dh, None, 1),
            lambda: torch.index_select(x, 0, token),
        ]
    if case == "act_dgrad_qwen3":  # rows [131072, 2048] . w[e] [2048, 768], h [131072, 1536]
        from moe8 import fused

        R, H, I, E, K = 131072, 2048, 768, 128, 8
        rows = torch.randn(R, H, device=device, dtype=torch.bfloat16)
        w = torch.randn(E, H, I, device=device, dtype=torch.bfloat16) * H**-0.5
        h = torch.randn(R, 2 * I, device=device, dtype=torch.bfloat16)
        offsets = torch.arange(0, R + 1, R // E, device=device, dtype=torch.int32)
        weights = torch.rand(R // K, K, device=device)
        row_to_slot = torch.randperm(R, device=device).int()
        act = (ops.ACTIVATIONS["swiglu"], False, 1.702, 7.0)
        d_act = ops.grouped_gemm(rows, w, offsets, 1, None)  # the pass writes w * act(h) over it: values only
        return [
            lambda: fused.dgrad_activation_backward(rows, w, offsets, 1, h, weights, row_to_slot, *act),
            lambda: ops.grouped_gemm(rows, w, offsets, 1, None),
            lambda: fused.activation_backward_routed(h, d_act, weights, row_to_slot, *act),
        ]
    if case == "gathered_qwen3":  # x [16384, 2048] gathered to [131072, 2048] . w[e] [1536, 2048]^T
        T, H, I, E, K = 16384, 2048, 768, 128, 8
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
        w = torch.randn(E, 2 * I, H, device=device, dtype=torch.bfloat16) * H**-0.5
        ids = torch.stack([torch.randperm(E, device=device)[:K] for _ in range(T)]).int()
        _, offsets, row_to_slot, slot_to_row = ops.plan(ids, E, 1, False)
        rows = ops.gather_rows(x, row_to_slot, K, None, slot_to_row.view(-1))
        return [
            lambda: ops.gathered_grouped_gemm(x, row_to_slot, K, slot_to_row, w, offsets, 0),
            lambda: ops.gather_rows(x, row_to_slot, K, None, slot_to_row.view(-1)),
            lambda: ops.grouped_gemm(rows, w, offsets, 0, None),
        ]
    if case == "gathered_wgrad_qwen3":  # dc [131072, 1536]^T . x [16384, 2048] gathered, per expert
        T, H, I, E, K = 16384, 2048, 768, 128, 8
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device=device)[:K] for _ in range(T)]).int()
        _, offsets, row_to_slot, slot_to_row = ops.plan(ids, E, 1, False)
        dc = torch.randn(T * K, 2 * I, device=device, dtype=torch.bfloat16)
        rows = ops.gather_rows(x, row_to_slot, K, None, slot_to_row.view(-1))
        return [
            lambda: ops.gathered_grouped_gemm_wgrad(x, row_to_slot, K, slot_to_row, dc, offsets, 0, E),
            lambda: ops.gather_rows(x, row_to_slot, K, None, slot_to_row.view(-1)),
            lambda: ops.grouped_gemm_wgrad(rows, dc, offsets, 0, E, False),
        ]
    if case in ("swiglu_qwen3", "swiglu_olmoe"):  # a [131072, 2048] . w[e] [2I, 2048]^T, then SwiGLU
        R, H, I, E = (131072, 2048, 768, 128) if case == "swiglu_qwen3" else (131072, 2048, 1024, 64)
        a = torch.randn(R, H, device=device, dtype=torch.bfloat16)
        w = torch.randn(E, 2 * I, H, device=device, dtype=torch.bfloat16) * H**-0.5
        offsets = torch.arange(0, R + 1, R // E, device=device, dtype=torch.int32)
        swiglu = (ops.ACTIVATIONS["swiglu"], False, 1.702, 7.0)
        h = ops.grouped_gemm(a, w, offsets, 0, None)

        def two_calls():
            ops.activation(ops.grouped_gemm(a, w, offsets, 0, None), *swiglu)

        return [
            lambda: ops.grouped_gemm_swiglu(a, w, offsets),
            two_calls,
            lambda: ops.grouped_gemm(a, w, offsets, 0, None),
            lambda: ops.activation(h, *swiglu),
        ]
    if case in ("fwd_qwen3", "down_qwen3"):  # a [131072, K] . w[e] [N, K]^T, 1,024 rows an expert
        R, H, N, E = (131072, 2048, 1536, 128) if case == "fwd_qwen3" else (131072, 768, 2048, 128)
        mine, theirs, _, _ = balanced_cases(R, H, N, E, ["fwd"], device)["fwd"]
        a = torch.randn(R, H, device=device, dtype=torch.bfloat16)
        w = torch.randn(E, N, H, device=device, dtype=torch.bfloat16) * H**-0.5
        bound = bound_cases(a, w, None, E, ["fwd"])["fwd"]
        return [mine, theirs, bound["batched"], bound["dense"]]
    # dgrad_qwen3: dc [131072, 2048] . w[e] [2048, 768] -> [131072, 768]
    mine, theirs, _, _ = balanced_cases(131072, 768, 2048, 128, ["dgrad"], device)["dgrad"]
    return [mine, theirs]


def timed_ms(fn, iters: int, cold: bool) -> float:
    """Median milliseconds of fn() over iters launches after 3 warm-ups (CUDA events around each); cold: 256 MiB
    written before each, outside the timing, so that L2 holds none of fn's inputs."""
    from bench_layer import median_ms

    if not cold:
        return median_ms(fn, torch.device("cuda"), 3, iters)
    flush = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        flush.fill_(1)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=CASES)
    ap.add_argument("--time", type=int, default=0, metavar="N", help="median ms of each call over N launches")
    ap.add_argument("--json", default=None, help="with --time: append {case, ms} as a JSON line to this file")
    ap.add_argument("--cold", action="store_true", help="with --time: L2 flushed before each timed launch")
    args = ap.parse_args()
    if args.time < 0:
        ap.error(f"--time: expected a count >= 0, got {args.time}")
    if not (torch.cuda.is_available() and moe8.cuda_available()):
        raise SystemExit("ncu_gemm: needs a CUDA GPU and moe8 built with CUDA")
    fns = calls(args.case, torch.device("cuda"))
    if args.time:
        ms = [timed_ms(f, args.time, args.cold) for f in fns]
        print(
            f"ncu_gemm: {args.case}{' (cold L2)' if args.cold else ''}: ms per call "
            + " ".join(f"{m:.3f}" for m in ms)
        )
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(
                    json.dumps({"case": args.case, "ms": ms, "iters": args.time, "cold": args.cold}) + "\n"
                )
        return 0
    for f in fns:
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for f in fns:
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"ncu_gemm: {args.case}: {len(fns)} call(s) profiled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
