"""Whole MoE layer forward+backward: moe8 vs transformers' `grouped_mm` experts on the same inputs, plus
the accuracy of moe8 against a pure-PyTorch float32 reference (output and every gradient).

    python bench/bench_layer.py --shapes qwen3,mixtral,deepseek --no-check --fp8 blockwise+dgrad --json bench/results/layer_h200.json

Prints a table last: shape, baseline ms, moe8 ms, ratio, TFLOP/s, % of the bf16 ceiling, peak extra memory
of forward + backward, and the memory a forward leaves held for its backward (its output included).
Each timed step starts with the gradients of x and the block's parameters set to None, as a training step
after optimizer.zero_grad() (accumulating into the previous step's gradients would add a read-add-write of
every weight gradient to both columns, 0.9 ms of 9.3 at the Qwen3 shape on an H200)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from run_info import run_info  # this folder is on sys.path

import moe8
from moe8 import reference as ref

CONFIG = {}  # {'config': moe8.Config} of the moe8 layer, from the command line (main)
SHAPES = {  # name: (hidden, intermediate, experts, top-k)
    "qwen3": (2048, 768, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
    "olmoe": (2048, 1024, 64, 8),
    "gptoss": (2880, 2880, 32, 4),
    # DeepSeek-V3's routed experts in the same Qwen3-MoE block (softmax top-k; no shared expert, no group
    # routing): ~45 GiB of bf16 weights and gradients, for the GEMM choices of many wide experts
    "deepseek": (7168, 2048, 256, 8),
}
BF16_CEILING = 780e12  # dense bf16 GEMM measured on an H200 with torch 2.11 (shared/data/baselines/h200.md)


def hf_block(H, I, E, K, device="cuda", dtype=torch.bfloat16):
    """transformers' Qwen3-MoE block (grouped_mm experts) built and initialised on `device` (the DeepSeek-V3
    shape's 11G parameters would take minutes to draw on the CPU)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True
    )
    cfg._experts_implementation = "grouped_mm"
    with torch.device(device):
        block = Qwen3MoeSparseMoeBlock(cfg).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, H**-0.5)
    return block


def one_ms(fn, device) -> float:
    """Milliseconds of one fn() call (CUDA events on a GPU, else wall time)."""
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b)
    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


def median_ms(fn, device, warmup=3, iters=10) -> float:
    """Median milliseconds of fn() over iters after warmup calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(one_ms(fn, device) for _ in range(iters))


def back_to_back_ms(fn, n: int) -> float:
    """Milliseconds per fn() over n calls queued back to back, one synchronisation at the end: the host runs
    ahead of the GPU as in a model of many layers, so the launch gaps that timing each call alone exposes
    (the GPU idle while the host issues the first kernels of the step) are hidden wherever the host keeps up."""
    fn()
    torch.cuda.synchronize()
    return one_ms(lambda: [fn() for _ in range(n)], torch.device("cuda")) / n


def timed(fn, warmup=3, iters=10):
    """Median ms of fn() over iters (CUDA events) and the peak extra memory (GiB) of one call."""
    ms = median_ms(fn, torch.device("cuda"), warmup, iters)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def held_gib(forward) -> float:
    """GiB allocated by forward() and still held when it returns (its output and what autograd saved for the
    backward): the activation memory a layer adds in a model of many layers."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = forward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    del out
    return held / 2**30


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def check_accuracy(block, x, K):
    """moe8 bf16 vs a float32 PyTorch reference on the same bf16 inputs, routing on moe8's expert ids."""
    params = [block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]
    xb = x.detach().requires_grad_()
    probe = torch.randn_like(x, dtype=torch.float32)
    y, r = moe8.moe_forward(xb, params[0], params[1], params[2], K, "softmax", True)
    g = torch.autograd.grad((y.float() * probe).sum(), [xb, *params])
    P = [t.detach().float().requires_grad_() for t in (xb, *params)]
    logits = P[0] @ P[1].t()
    w = ref.route_weights(logits, r.ids, "softmax", True)
    yr = ref.experts_forward(P[0], r.ids, w, P[2], P[3])
    gr = torch.autograd.grad((yr * probe).sum(), P)
    names = ["x", "router_weight", "gate_up_proj", "down_proj"]
    return {"output": rel(y, yr), **{f"grad_{n}": rel(a, b) for n, a, b in zip(names, g, gr)}}


def recipe_of(name: str):
    """ "blockwise", "rowwise" or "tensorwise", optionally with "+dgrad" and/or "+wgrad": those backward GEMMs
    in FP8 too (e.g. blockwise+dgrad+wgrad)."""
    from moe8.fp8 import Float8Recipe

    base, *extra = name.split("+")
    unknown = sorted(set(extra) - {"dgrad", "wgrad"})
    if unknown:
        raise SystemExit(f"--fp8: unknown suffix {unknown} in {name!r}, expected +dgrad and/or +wgrad")
    fp8 = lambda part: "fp8" if part in extra else "bf16"  # noqa: E731
    return Float8Recipe(base, dgrad=fp8("dgrad"), wgrad=fp8("wgrad"))


def bench_shape(name, T, check, dtype=torch.bfloat16, fp8=(), profile_top=0, trace_dir=None, back_to_back=0):
    H, I, E, K = SHAPES[name]
    torch.manual_seed(0)
    block = hf_block(H, I, E, K, "cuda", dtype)
    x = torch.randn(1, T, H, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(1, T, H, device="cuda", dtype=dtype)
    gate, experts = block.gate, block.experts

    params = [x, *block.parameters()]

    def fresh_grads():  # as a training step after optimizer.zero_grad(): no accumulation into old grads
        for p in params:
            p.grad = None

    def hf_step():
        fresh_grads()
        out = block(x)
        torch.autograd.backward(out, dy)

    def layer(recipe=None):
        """bf16, or the FP8 recipe's training path (under grad: not the fused inference path)."""
        extra = dict(CONFIG) if recipe is None else {"fp8": recipe_of(recipe), **CONFIG}
        y, _ = moe8.moe_forward(
            x.view(T, H), gate.weight, experts.gate_up_proj, experts.down_proj, K, "softmax", True, **extra
        )
        return y

    def moe8_step(recipe=None):
        fresh_grads()
        torch.autograd.backward(layer(recipe), dy.view(T, H))

    def out_and_dx(recipe=None):
        y = layer(recipe)
        return y.detach(), torch.autograd.grad(y, x, dy.view(T, H))[0]

    hf_ms, hf_mem = timed(hf_step)
    m_ms, m_mem = timed(moe8_step)
    fresh_grads()
    hf_held, m_held = held_gib(lambda: block(x)), held_gib(layer)
    fp8_rows = {}
    for recipe in fp8:
        try:
            f_ms, f_mem = timed(lambda r=recipe: moe8_step(r))
            (y16, g16), (y8, g8) = out_and_dx(), out_and_dx(recipe)
            fp8_rows[recipe] = {
                "ms": f_ms,
                "speedup_vs_hf": hf_ms / f_ms,
                "peak_extra_gib": f_mem,
                "output_rel_error_vs_bf16": rel(y8, y16),
                "grad_x_rel_error_vs_bf16": rel(g8, g16),
            }
        except Exception as e:  # report and go on: one recipe failing must not lose the others
            fp8_rows[recipe] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"  fp8 {recipe}: {fp8_rows[recipe]}", flush=True)
    queued = {}
    if back_to_back:  # ms per step with the steps queued back to back (back_to_back_ms)
        queued = {"steps": back_to_back, "hf_ms": back_to_back_ms(hf_step, back_to_back)}
        queued["moe8_ms"] = back_to_back_ms(moe8_step, back_to_back)
        for recipe in fp8:
            if "error" not in fp8_rows[recipe]:
                queued[f"moe8_{recipe}_ms"] = back_to_back_ms(lambda r=recipe: moe8_step(r), back_to_back)
        print(f"  back to back: {queued}", flush=True)
    profiles = {}
    if profile_top:  # one more call of each under torch.profiler: its top kernels
        from profiling import profile_step  # bench/profiling.py (this folder is on sys.path)

        profiles["moe8_bf16"] = profile_step(moe8_step, profile_top)
        for recipe in fp8:
            if "error" not in fp8_rows[recipe]:
                print(f"  fp8 {recipe}:", flush=True)
                profiles[f"moe8_{recipe}"] = profile_step(lambda r=recipe: moe8_step(r), profile_top)
    if trace_dir:  # Chrome traces of one more step each, and where their GPU idles
        from pathlib import Path

        from profiling import export_trace, gpu_gaps, print_gaps

        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        profiles["gaps"] = {}
        steps = [("hf", hf_step), ("moe8", moe8_step)]
        steps += [(f"moe8_{r}", lambda r=r: moe8_step(r)) for r in fp8 if "error" not in fp8_rows[r]]
        for who, step in steps:
            path = Path(trace_dir) / f"{name}_{who}.json"
            export_trace(step, path)
            with open(path) as f:
                profiles["gaps"][who] = gpu_gaps(json.load(f))
            print_gaps(f"  {who} trace {path}", profiles["gaps"][who])
    flops = 3 * 2 * T * K * (H * 2 * I + I * H)  # fwd + dgrad + wgrad of the two expert GEMMs
    row = {
        "shape": name,
        "tokens": T,
        "hidden": H,
        "intermediate": I,
        "experts": E,
        "top_k": K,
        "dtype": str(dtype).replace("torch.", ""),
        "routing": "softmax top-k, renormalised, random init",
        "hf_grouped_mm_ms": hf_ms,
        "moe8_ms": m_ms,
        "speedup": hf_ms / m_ms,
        "hf_peak_extra_gib": hf_mem,
        "moe8_peak_extra_gib": m_mem,
        "hf_held_after_forward_gib": hf_held,
        "moe8_held_after_forward_gib": m_held,
        "moe8_expert_tflops": flops / (m_ms * 1e-3) / 1e12,
        "hf_expert_tflops": flops / (hf_ms * 1e-3) / 1e12,
    }
    row["moe8_pct_of_bf16_ceiling"] = 100 * row["moe8_expert_tflops"] * 1e12 / BF16_CEILING
    if profiles:
        row["profile"] = profiles
    if queued:
        row["back_to_back"] = queued
    if fp8_rows:
        row["fp8"] = fp8_rows  # expert GEMM forwards in FP8, backward in bf16 (moe8.fp8)
    if check:
        row["accuracy_vs_fp32_reference"] = check_accuracy(block, x.view(T, H), K)
    return row


def _gemm_cases(a, w, dc, off, offs_moe8, E):
    return {
        "fwd": (
            lambda: moe8.ops.grouped_gemm(a, w, offs_moe8, 0, None),
            lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=off),
        ),
        "dgrad": (
            lambda: moe8.ops.grouped_gemm(dc, w, offs_moe8, 1, None),
            lambda: torch._grouped_mm(dc, w, offs=off),
        ),
        "wgrad": (
            lambda: moe8.ops.grouped_gemm_wgrad(a, dc, offs_moe8, 0, E, False),
            lambda: torch._grouped_mm(dc.t(), a, offs=off),
        ),
    }


def bench_gemm(T=16384):
    """The grouped GEMMs alone at the Qwen3 shape: moe8 kernels vs torch._grouped_mm (balanced rows)."""
    H, I, E, K = SHAPES["qwen3"]
    R = T * K
    off = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (R // E)
    offs_moe8 = torch.cat([torch.zeros(1, device="cuda", dtype=torch.int32), off])
    rows = []
    for what, kd, n in (("gate_up", H, 2 * I), ("down", I, H)):
        a = torch.randn(R, kd, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, n, kd, device="cuda", dtype=torch.bfloat16) * kd**-0.5
        dc = torch.randn(R, n, device="cuda", dtype=torch.bfloat16)
        fl = 2 * R * kd * n
        tests = _gemm_cases(a, w, dc, off, offs_moe8, E)
        for kind, (mine, theirs) in tests.items():
            m_ms, _ = timed(mine)
            t_ms, _ = timed(theirs)
            rows.append(
                {
                    "gemm": f"qwen3 {what} {kind}",
                    "rows": R,
                    "K": kd,
                    "N": n,
                    "moe8_ms": m_ms,
                    "torch_ms": t_ms,
                    "moe8_tflops": fl / m_ms / 1e9,
                    "torch_tflops": fl / t_ms / 1e9,
                    "ratio": t_ms / m_ms,
                }
            )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes", default="qwen3", help=f"comma-separated, from {sorted(SHAPES)} (default qwen3)"
    )
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per layer call (default 16384)")
    ap.add_argument("--no-check", action="store_true", help="skip the fp32 accuracy check")
    ap.add_argument(
        "--gemm", action="store_true", help="also time the grouped GEMMs alone vs torch._grouped_mm"
    )
    ap.add_argument(
        "--fp8",
        default="",
        help="comma-separated FP8 recipes to time too (blockwise,rowwise,tensorwise; +dgrad / +wgrad: those "
        "backward GEMMs in FP8 too, e.g. blockwise+dgrad+wgrad): the layer with FP8 expert GEMMs, and its "
        "output's and input gradient's relative error vs the bf16 layer",
    )
    ap.add_argument(
        "--consume-gate-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="moe8.Config.consume_gate_up (default on): the experts' backward writes d h over the gate_up output",
    )
    ap.add_argument(
        "--routed-down",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="moe8.Config.routed_down (default on): activation, down projection and combine as one op whose "
        "backward applies the routing weights after the dgrad (the expert outputs are not kept)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile one more moe8 call per shape (and FP8 recipe) and print its N kernels with the most time",
    )
    ap.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="save a Chrome trace of one more HF, moe8 and moe8 FP8 (each --fp8 recipe) step per shape in DIR "
        "and print where the GPU idles",
    )
    ap.add_argument(
        "--back-to-back",
        type=int,
        default=0,
        metavar="N",
        help="also time N steps queued back to back (one synchronisation at the end) for HF, moe8 and each FP8 "
        "recipe: ms per step with the host running ahead, as in a model of many layers",
    )
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    CONFIG["config"] = moe8.Config(consume_gate_up=args.consume_gate_up, routed_down=args.routed_down)
    if not moe8.cuda_available():
        raise SystemExit("bench_layer: needs a CUDA GPU and moe8 built with CUDA")
    names = args.shapes.split(",")
    for n in names:
        if n not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {n!r}, expected from {sorted(SHAPES)}")

    meta = {
        **run_info("cuda"),
        "consume_gate_up": args.consume_gate_up,
        "routed_down": args.routed_down,
    }
    layers = []
    for n in names:
        print(f"[bench] {n} ...", flush=True)
        fp8 = [r for r in args.fp8.split(",") if r]
        for r in fp8:
            recipe_of(r)  # an unknown name fails before any timing
        layers.append(
            bench_shape(
                n,
                args.tokens,
                check=not args.no_check and n == "qwen3",
                fp8=fp8,
                profile_top=args.profile,
                trace_dir=args.trace,
                back_to_back=args.back_to_back,
            )
        )
        print(json.dumps(layers[-1]), flush=True)
    gemms = bench_gemm(args.tokens) if args.gemm else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "layers": layers, "gemms": gemms}, f, indent=1)
    print(f"\n{meta}")
    for g in gemms:
        print(
            f"{g['gemm']:<24} torch {g['torch_ms']:7.3f} ms {g['torch_tflops']:6.0f} TF/s | moe8 {g['moe8_ms']:7.3f} ms "
            f"{g['moe8_tflops']:6.0f} TF/s | ratio {g['ratio']:.2f}x"
        )
    print(
        f"{'shape':<8} {'tokens':>6} {'HF grouped_mm ms':>16} {'moe8 ms':>8} {'ratio':>6} {'TFLOP/s':>8} "
        f"{'% ceil':>6} {'HF GiB':>7} {'moe8 GiB':>8} {'held HF':>7} {'moe8':>5}"
    )
    for r in layers:
        print(
            f"{r['shape']:<8} {r['tokens']:>6} {r['hf_grouped_mm_ms']:>16.2f} {r['moe8_ms']:>8.2f} "
            f"{r['speedup']:>5.2f}x {r['moe8_expert_tflops']:>8.0f} {r['moe8_pct_of_bf16_ceiling']:>5.0f}% "
            f"{r['hf_peak_extra_gib']:>7.2f} {r['moe8_peak_extra_gib']:>8.2f} "
            f"{r['hf_held_after_forward_gib']:>7.2f} {r['moe8_held_after_forward_gib']:>5.2f}"
        )
        for recipe, f in r.get("fp8", {}).items():
            if "error" in f:
                print(f"  fp8 {recipe}: {f['error']}")
            else:
                print(
                    f"  fp8 {recipe:<10} {f['ms']:>8.2f} ms {f['speedup_vs_hf']:>5.2f}x vs HF, "
                    f"{f['peak_extra_gib']:.2f} GiB, vs bf16: output {f['output_rel_error_vs_bf16']:.2e}, "
                    f"grad x {f['grad_x_rel_error_vs_bf16']:.2e}"
                )
        if "back_to_back" in r:
            q = r["back_to_back"]
            steps = ", ".join(
                f"{k[:-3]} {v:.2f} ms ({q['hf_ms'] / v:.2f}x)"
                for k, v in q.items()
                if k.endswith("_ms") and k != "hf_ms"
            )
            print(f"  back to back ({q['steps']} steps): HF {q['hf_ms']:.2f} ms; {steps}")
        if "accuracy_vs_fp32_reference" in r:
            print("  accuracy vs fp32 reference (relative error):", r["accuracy_vs_fp32_reference"])


if __name__ == "__main__":
    main()
