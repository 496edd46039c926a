"""FP8 against bf16 for single GEMMs and for the memory of FP8 weights: the measurements behind
moe8.fp8_rules (fp8_pays's thresholds, dense_backend's choice).

    python bench/bench_fp8_dense.py --memory --out bench/results/fp8_dense   # H200: ~1 minute
    python bench/bench_fp8_dense.py --tiny --out /tmp/fp8_dense              # CPU smoke run

GEMMs: y = x [M, K] . w [N, K]^T, forward + backward (dgrad and wgrad), timed after the weight's FP8 copy is
made (the per-optimizer-step refresh is bench_fp8_refresh.py's), so every FP8 time includes the activation's
and the output gradient's quantisation. bf16: F.linear. FP8: moe8.fp8_linear.fp8_linear, each recipe with FP8
dgrad, through moe8's grouped GEMM with one group ("moe8") and, for rowwise / tensorwise, torch._scaled_mm.
Two times per GEMM on a GPU: one call as it comes (host time included: a lone small GEMM waits for its
launches) and its kernels alone ("gpu ..." keys, in brackets in the table: the call queued behind a sleep
kernel, as in a step whose host runs ahead of the GPU; "..._ahead" says in what share of the iterations the
host did stay ahead). `suggested_gpu`: the cut from the kernels alone.
Shapes: the dense layers of Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3 (attention projections, a shared
expert) at M = 16,384 tokens, and a sweep of M x (N, K) at the expert GEMMs' sizes for the rows rule.

Memory (--memory, CUDA only): one Qwen3-30B-A3B MoE layer's experts (16,384 tokens, top-8), forward +
backward: peak bytes above the inputs and the bytes the FP8 weight cache holds, for bf16 and FP8 blockwise +
FP8 dgrad with Config.fp8_cache "both" / "one" / "none".

Writes <out>/fp8_dense.json; prints the table last, then the thresholds the measurements suggest
(moe8.fp8_rules.fp8_pays(..., dense=True): DENSE_MIN_ROWS / DENSE_MIN_HARMONIC).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from run_info import run_info  # this folder is on sys.path

import moe8
from moe8 import fp8, fp8_rules
from moe8.fp8 import Float8Recipe
from moe8.fp8_linear import fp8_linear

DENSE = [  # name, N, K (M = tokens)
    ("qwen3 q_proj", 4096, 2048),
    ("qwen3 k_proj", 512, 2048),
    ("qwen3 o_proj", 2048, 4096),
    ("mixtral q_proj", 4096, 4096),
    ("mixtral k_proj", 1024, 4096),
    ("deepseek q_b_proj", 24576, 1536),
    ("deepseek o_proj", 7168, 16384),
    ("deepseek shared up", 2048, 7168),
    ("deepseek shared down", 7168, 2048),
]
SWEEP_M = [128, 256, 512, 1024, 4096]
SWEEP_NK = [(1536, 2048), (2048, 768), (4096, 7168), (7168, 2048), (28672, 4096), (4096, 14336)]
TINY_DENSE = [("tiny a", 256, 384), ("tiny b", 96, 160)]
TINY_M, TINY_NK = [64], [(256, 128)]


SLEEP_CYCLES = 10_000_000  # ~5 ms of an H200's clock: longer than the host takes to enqueue one step


def timed(fn, device, iters: int, warmup: int, queued: bool = False) -> tuple:
    """(median milliseconds of fn(), share of iterations the host stayed ahead): CUDA events on a GPU, wall
    time on the CPU. queued (CUDA): a sleep kernel enqueued before the first event keeps the GPU busy while
    the host enqueues fn, so the events time fn's kernels alone, not the host's launches between them; the
    share says in how many iterations the host had enqueued all of fn before the GPU reached it (1.0: pure
    GPU time; below 1, host time is in the figure). Not queued: what one isolated call costs, host included."""
    for _ in range(warmup):
        fn()
    times, ahead = [], 0
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queued:
                torch.cuda._sleep(SLEEP_CYCLES)
            a.record()
            fn()
            b.record()
            ahead += not a.query()  # the GPU had not reached fn when the host was done with it
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), (ahead / iters if device.type == "cuda" else 0.0)


def variants(device) -> list:
    """(label, recipe, backend) of the FP8 columns; None backend: dense_backend's choice."""
    out = [("blockwise moe8", "blockwise", "moe8")]
    for r in ("rowwise", "tensorwise"):
        out.append((f"{r} moe8", r, "moe8"))
        if device.type == "cuda":
            out.append((f"{r} scaled_mm", r, "scaled_mm"))
    return out


def gemm_row(M, N, K, device, dtype, iters, warmup, name="") -> dict:
    x = torch.randn(M, K, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(N, K, device=device, dtype=dtype) * K**-0.5).requires_grad_()
    dy = torch.randn(M, N, device=device, dtype=dtype)

    def step(f):
        def run():
            x.grad = w.grad = None
            f().backward(dy)

        return run

    row = dict(name=name, M=M, N=N, K=K, harmonic=round(N * K / (N + K), 1))
    queue = device.type == "cuda"
    row["bf16_ms"], _ = timed(step(lambda: F.linear(x, w)), device, iters, warmup)
    if queue:
        row["gpu bf16_ms"], row["gpu bf16_ahead"] = timed(
            step(lambda: F.linear(x, w)), device, iters, 1, True
        )
    flops = 6 * M * N * K
    row["bf16_tflops"] = flops / row["bf16_ms"] / 1e9
    for label, r, backend in variants(device):
        recipe = Float8Recipe(r, dgrad="fp8")
        fp8.default_cache.clear()
        f = lambda recipe=recipe, backend=backend: fp8_linear(x, w, None, recipe, backend=backend)  # noqa: E731
        ms, _ = timed(step(f), device, iters, warmup)
        row[f"{label}_ms"] = ms
        row[f"{label}_speedup"] = row["bf16_ms"] / ms
        row[f"{label}_rule"] = fp8_rules.fp8_pays(M, N, K, r, dense=True)
        if queue:  # the kernels alone (what a step whose host runs ahead of the GPU sees)
            ms, share = timed(step(f), device, iters, 1, True)
            row[f"gpu {label}_ms"], row[f"gpu {label}_ahead"] = ms, share
            row[f"gpu {label}_speedup"] = row["gpu bf16_ms"] / ms
    fp8.default_cache.clear()
    return row


def memory_rows(device, tokens: int, iters: int) -> list:
    """Peak bytes of one Qwen3-30B-A3B MoE layer's experts forward + backward per precision / cache."""
    H, I, E, K = 2048, 768, 128, 8
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, H, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    ids = torch.stack([torch.randperm(E, device=device)[:K] for _ in range(tokens)]).int()
    w = torch.rand(tokens, K, device=device)
    gu = (torch.randn(E, 2 * I, H, device=device, dtype=torch.bfloat16) * H**-0.5).requires_grad_()
    dn = (torch.randn(E, H, I, device=device, dtype=torch.bfloat16) * I**-0.5).requires_grad_()
    rows = []
    for label, cfg in [
        ("bf16", moe8.Config()),
        *[
            (
                f"fp8 blockwise+dgrad, cache {c}",
                moe8.Config(fp8=Float8Recipe("blockwise", "fp8"), fp8_cache=c),
            )
            for c in fp8.CACHES
        ],
    ]:
        fp8.default_cache.clear(), fp8.one_layout_cache.clear()

        def run(cfg=cfg):
            x.grad = gu.grad = dn.grad = None
            moe8.experts_forward(x, ids, w, gu, dn, config=cfg).sum().backward()

        run()  # the weight copies made (as after an optimizer step's first micro-batch)
        x.grad = gu.grad = dn.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        held = fp8.default_cache.nbytes() + fp8.one_layout_cache.nbytes()
        ms, _ = timed(run, device, iters, 1)
        rows.append(dict(variant=label, peak_extra_gib=peak / 2**30, cache_gib=held / 2**30, ms=ms))
    fp8.default_cache.clear(), fp8.one_layout_cache.clear()
    return rows


def suggest(rows: list, prefix: str = "") -> dict:
    """Per recipe (its fastest backend): the smallest M and N·K/(N+K) from which every measured shape at or
    above both is at least 1.0x bf16; None where no cut holds. prefix "gpu ": from the queued (GPU-only)
    times."""
    out = {}
    for r in ("blockwise", "rowwise", "tensorwise"):
        labels = [
            k[: -len("_speedup")] for k in rows[0] if k.startswith(prefix + r) and k.endswith("_speedup")
        ]
        if not labels:
            continue

        def best(row, labels=labels):
            return max(row[f"{lab}_speedup"] for lab in labels)

        cut = None
        for m in sorted({row["M"] for row in rows}):
            for h in sorted({row["harmonic"] for row in rows}):
                above = [row for row in rows if row["M"] >= m and row["harmonic"] >= h]
                if above and all(best(row) >= 1.0 for row in above):
                    if cut is None or (m, h) < (cut["min_rows"], cut["min_harmonic"]):
                        cut = dict(min_rows=m, min_harmonic=h)
                    break
        backends = {lab: statistics.median(row[f"{lab}_speedup"] for row in rows) for lab in labels}
        out[r] = dict(cut=cut, median_speedup_by_backend=backends)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for fp8_dense.json")
    p.add_argument("--tokens", type=int, default=16384, help="M of the dense layers' GEMMs")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--memory", action="store_true", help="also the memory of FP8 weights (CUDA)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: two small shapes, one iteration")
    a = p.parse_args(argv)
    device = torch.device("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    if a.memory and device.type != "cuda":
        p.error("--memory: needs a CUDA GPU (peak memory is read from torch.cuda)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    iters, warmup = (1, 0) if a.tiny else (a.iters, a.warmup)
    tokens = 64 if a.tiny else a.tokens
    dense, ms_, nks = (TINY_DENSE, TINY_M, TINY_NK) if a.tiny else (DENSE, SWEEP_M, SWEEP_NK)
    rows = [gemm_row(tokens, N, K, device, dtype, iters, warmup, name) for name, N, K in dense]
    rows += [gemm_row(M, N, K, device, dtype, iters, warmup, "sweep") for M in ms_ for N, K in nks]
    result = dict(run_info(device), command="bench/bench_fp8_dense.py", tiny=a.tiny, gemms=rows)
    result["suggested"] = suggest(rows)
    if device.type == "cuda":
        result["suggested_gpu"] = suggest(rows, "gpu ")
    if a.memory:
        result["memory"] = memory_rows(device, a.tokens, iters)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_dense.json").write_text(json.dumps(result, indent=2) + "\n")

    labels = [lab for lab, _, _ in variants(device)]
    print(
        f"\nFP8 vs bf16, forward + backward (FP8 dgrad), {device}; speedup over bf16, one call with its host time"
        " (in brackets: the kernels alone, queued behind a sleep); * = fp8_pays(dense=True)"
    )
    print(f"| shape | M | N | K | bf16 ms | {' | '.join(labels)} |")
    print("| --- " * (5 + len(labels)) + "|")
    for row in rows:
        cells = [
            f"{row[f'{lab}_speedup']:.2f}x{'*' if row[f'{lab}_rule'] else ''}"
            + (f" ({row[f'gpu {lab}_speedup']:.2f}x)" if f"gpu {lab}_speedup" in row else "")
            for lab in labels
        ]
        print(
            f"| {row['name']} | {row['M']} | {row['N']} | {row['K']} | {row['bf16_ms']:.3f} | {' | '.join(cells)} |"
        )
    for row in result.get("memory", []):
        print(
            f"memory: {row['variant']}: peak extra {row['peak_extra_gib']:.2f} GiB, cache {row['cache_gib']:.2f} GiB, {row['ms']:.2f} ms"
        )
    print("suggested (moe8.fp8_rules DENSE_MIN_ROWS / DENSE_MIN_HARMONIC, fastest backend per recipe):")
    for r, s in result["suggested"].items():
        print(f"  {r}: {s['cut']}; median speedup {s['median_speedup_by_backend']}")
    for r, s in result.get("suggested_gpu", {}).items():
        print(f"  {r}, kernels alone: {s['cut']}; median speedup {s['median_speedup_by_backend']}")


if __name__ == "__main__":
    main()
