"""Kernel-time profiles for the benchmarks: one more call under torch.profiler, its top kernels; where a
training step's time goes by category (classify_trace, for bench_step_profile.py); GPU idle intervals."""

from __future__ import annotations

import re
from typing import Optional


def _sync() -> None:
    """Waits for the GPU's queued work, where there is a GPU."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _activities() -> list:
    """torch.profiler's activities here: the CPU, and CUDA where there is a GPU."""
    import torch
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def profile_step(step, rows):
    """One more step under torch.profiler: prints the `rows` kernels/ops with the most self device time and
    returns them as [name, self device ms, calls]."""
    import torch
    from torch.profiler import profile

    with profile(activities=_activities()) as prof:
        step()
        _sync()
    events = prof.key_averages()
    cuda = torch.cuda.is_available()

    def self_us(e):  # device time on a GPU (kernels, copies; ops' CPU time would mix in otherwise), else CPU
        if cuda:
            return getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0) or 0.0
        return getattr(e, "self_cpu_time_total", 0.0) or 0.0

    timed = [e for e in events if self_us(e) > 0]
    if cuda:  # kernels and copies only: an op's self device time is its kernels' again
        from torch.autograd import DeviceType

        timed = [e for e in timed if getattr(e, "device_type", None) == DeviceType.CUDA] or timed
    top = sorted(timed, key=self_us, reverse=True)[:rows]
    total = sum(self_us(e) for e in timed) or 1.0
    what = "GPU time (kernels and copies)" if cuda else "CPU self time"
    print(f"profile: {len(timed)} entries, {what} {total / 1e3:.1f} ms; top {rows}:", flush=True)
    out = []
    for e in top:
        out.append([e.key[:120], round(self_us(e) / 1e3, 3), e.count])
        print(
            f"  {self_us(e) / 1e3:9.2f} ms {100 * self_us(e) / total:5.1f}% x{e.count:<6} {e.key[:100]}",
            flush=True,
        )
    return out


def host_profile(step, rows):
    """One more step() under cProfile, with Python's garbage collections timed: prints the `rows` functions
    with the most own host time, and returns {"wall_s", "gc": {generation: [collections, seconds]}, "top":
    [[function, own s, cumulative s, calls]]}. Where a GPU step's wall time exceeds its GPU time, this says
    what the host was doing."""
    import cProfile
    import gc
    import pstats
    import time

    collections, started = {}, []

    def on_gc(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            n, sec = collections.get(info["generation"], (0, 0.0))
            collections[info["generation"]] = (n + 1, sec + time.perf_counter() - started.pop())

    _sync()
    gc.callbacks.append(on_gc)
    prof = cProfile.Profile()
    t = time.perf_counter()
    try:
        prof.enable()
        step()
        _sync()
        prof.disable()
    finally:
        gc.callbacks.remove(on_gc)
    wall = time.perf_counter() - t
    st = pstats.Stats(prof)
    # st.stats: (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    funcs = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:rows]
    gcs = {g: [n, round(sec, 4)] for g, (n, sec) in sorted(collections.items())}
    print(
        f"host profile: {wall:.3f} s under cProfile; garbage collections (generation: count, s): {gcs}",
        flush=True,
    )
    out = []
    for (file, line, name), (_, calls, own, cum, _) in funcs:
        where = f"{'/'.join(file.rsplit('/', 2)[-2:])}:{line}({name})"
        out.append([where[:120], round(own, 4), round(cum, 4), calls])
        print(f"  {own * 1e3:9.1f} ms own {cum * 1e3:9.1f} ms cum x{calls:<7} {where[:100]}", flush=True)
    return {"wall_s": wall, "gc": gcs, "top": out}


def export_trace(step, path):
    """One more step() under torch.profiler (CPU and, on a GPU, CUDA activities), saved as a Chrome trace at
    path."""
    from torch.profiler import profile

    step()  # warm: the profiled call must not pay first-call costs
    _sync()
    with profile(activities=_activities()) as prof:
        step()
        _sync()
    prof.export_chrome_trace(str(path))


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_gaps(trace: dict, top: int = 8) -> dict:
    """Where the GPU idles in a Chrome trace of one step: the span from the first CPU op to the last GPU
    event, the busy time (union of kernels, copies and sets), and the `top` longest idle intervals with the
    CPU ops running during each (outermost first), all idle time by the CPU op covering it, and the `top`
    kernels (and copies) by GPU time."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in GPU_CATS
    )
    cpu = [e for e in events if e.get("cat") == "cpu_op"]
    if not gpu:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": []}
    start = min([gpu[0][0]] + [float(e["ts"]) for e in cpu])
    busy, gaps, t = 0.0, [], start
    for a, b in gpu:
        if a > t:
            gaps.append((t, a))
        if b > t:
            busy += b - max(a, t)
            t = b
    cpu.sort(key=lambda e: float(e["ts"]))
    longest = set(sorted(range(len(gaps)), key=lambda i: gaps[i][0] - gaps[i][1])[:top])
    out, by_op, active, n = [], {}, [], 0
    for i, (a, b) in enumerate(gaps):  # in time order: a sweep over the CPU ops, those open during (a, b)
        while n < len(cpu) and float(cpu[n]["ts"]) < b:
            active.append(cpu[n])
            n += 1
        active = [e for e in active if float(e["ts"]) + float(e["dur"]) > a]
        if i in longest:
            during = sorted(active, key=lambda e: (-float(e["dur"]), float(e["ts"])))
            out.append({"at_us": a - start, "idle_us": b - a, "cpu_ops": [e["name"] for e in during[:4]]})
        # all idle time by the CPU op covering most of each interval (of equal covers the innermost): what
        # the host was doing then
        name = max(active, key=lambda e, a=a, b=b: _cover(e, a, b))["name"] if active else "(no CPU op)"
        by_op[name] = by_op.get(name, 0.0) + b - a
    out.sort(key=lambda x: -x["idle_us"])
    by_op = sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
    kernels = {}  # GPU time by kernel name, from the trace itself
    for e in events:
        if e.get("cat") in GPU_CATS:
            calls, us = kernels.get(e["name"], (0, 0.0))
            kernels[e["name"]] = (calls + 1, us + float(e["dur"]))
    kernels = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "span_us": t - start,
        "busy_us": busy,
        "idle_us": t - start - busy,
        "gaps": out,
        "idle_by_op": [{"cpu_op": k, "idle_us": v} for k, v in by_op],
        "kernels": [{"name": k[:160], "calls": calls, "us": us} for k, (calls, us) in kernels],
    }


def _cover(e: dict, a: float, b: float) -> tuple:
    """How much of (a, b) the trace event e covers, then its negated length (the shorter wins a tie)."""
    s = float(e["ts"])
    return (min(s + float(e["dur"]), b) - max(s, a), -float(e["dur"]))


def print_gaps(label: str, g: dict):
    print(
        f"{label}: {g['span_us'] / 1e3:.2f} ms from the first CPU op to the last GPU event, GPU busy "
        f"{g['busy_us'] / 1e3:.2f} ms, idle {g['idle_us'] / 1e3:.2f} ms; longest idle intervals:",
        flush=True,
    )
    for x in g["gaps"]:
        print(
            f"  at {x['at_us'] / 1e3:7.3f} ms: {x['idle_us']:7.1f} us idle during {x['cpu_ops']}", flush=True
        )
    if g.get("idle_by_op"):
        print(
            "  all idle time by the CPU op covering most of each interval (of those, the innermost):",
            flush=True,
        )
        for x in g["idle_by_op"]:
            print(f"  {x['idle_us'] / 1e3:9.2f} ms  {x['cpu_op'][:100]}", flush=True)
    if g.get("kernels"):
        print("  GPU time by kernel:", flush=True)
        for x in g["kernels"]:
            print(f"  {x['us'] / 1e3:9.2f} ms x{x['calls']:<5} {x['name'][:110]}", flush=True)


# ------------------------------------------------------------------------ where a training step's time goes
CATEGORIES = (
    "experts",
    "dense GEMMs",
    "attention",
    "LM head + loss",
    "optimizer",
    "norms/rope/elementwise",
)
REGION = "step."  # record_function labels that region_hooks puts around modules: step.<category>

_GEMM = re.compile(r"gemm|matmul|cutlass|xmma|nvjet|cublas|wgmma|aten::(mm|addmm|bmm|baddbmm|linear)$", re.I)
_ATTN = re.compile(r"flash|fmha|attention|softmax|aten::(bmm|baddbmm|matmul)$", re.I)
_ROPE = re.compile(r"rope|rotary", re.I)
# kernels / ops of the experts when no region says so: moe8's (its namespace is in every kernel name),
# torch's grouped GEMM that transformers' grouped_mm calls, and Liger Kernel's fused MoE (Triton: its
# backward kernels run outside any region, from a Python autograd.Function)
_EXPERTS = re.compile(
    r"moe8::|grouped_mm|GroupProblemShape|_moe_(router|bwd)_|_fused_(up_proj_swiglu|down_proj)_kernel"
    r"|_token_gather_weighted_sum_kernel|LigerFusedMoE",
    re.I,
)


def region_hooks(model, vocab_module=None):
    """Forward hooks that put each experts / router module under `step.experts`, each attention module under
    `step.attention` and each RMSNorm under `step.norm` (record_function ranges, visible in a trace); the
    backward inherits them through autograd's sequence numbers (classify_trace). Returns the handles."""
    from torch.profiler import record_function

    def label(m):
        name = type(m).__name__
        if hasattr(m, "has_gate") and hasattr(m, "is_transposed") or name.endswith(("Router", "TopkRouter")):
            return "experts"
        if name.endswith("Attention"):
            return "attention"
        if name.endswith("RMSNorm"):
            return "norm"
        return None

    handles = []
    for m in model.modules():
        what = label(m)
        if what is None:
            continue
        stack = []

        def pre(mod, args, _what=what, _stack=stack):
            r = record_function(REGION + _what)
            r.__enter__()
            _stack.append(r)

        def post(mod, args, out, _stack=stack):
            _stack.pop().__exit__(None, None, None)

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, always_call=True))
    return handles


def _enclosing(events):
    """For each CPU-side event (cpu_op, user_annotation, runtime), the events that enclose it on its thread,
    outermost first (Chrome trace X events nest by time)."""
    by_tid, chains = {}, {}
    for e in events:
        by_tid.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack = []
        for e in evs:
            t = float(e["ts"])
            while stack and float(stack[-1]["ts"]) + float(stack[-1]["dur"]) <= t:
                stack.pop()
            chains[id(e)] = list(stack)
            stack.append(e)
    return chains


def _dims(e):
    out = set()
    for d in (e.get("args") or {}).get("Input Dims", []) or []:
        if isinstance(d, list):
            out.update(x for x in d if isinstance(x, int))
    return out


def classify_trace(trace: dict, vocab: tuple) -> dict:
    """Where one step's device time goes, from a Chrome trace of it (torch.profiler, record_shapes=True):
    {category: ms} over CATEGORIES, "idle" (the span from the first CPU event to the last event minus the
    union of kernel time), "span" and "busy". A GPU kernel is attributed through the CPU ops that launched it
    (a CPU-only trace: each innermost CPU op stands for a kernel). Rules, first match wins: the optimizer
    (torch's Optimizer.step range); the LM head and loss (an op with one of the `vocab` sizes among its input
    dims, or a cross-entropy op; embeddings excluded); the region (region_hooks) of the op, or in the backward
    of the forward op with the same autograd sequence number, or else moe8's kernels and torch's grouped_mm:
    experts (Liger's fused MoE kernels too); attention (its GEMMs are dense, its RoPE elementwise); norm; then any GEMM is dense and the rest
    elementwise."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")]
    chains = _enclosing(host)
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    cpu_ops = [e for e in host if e.get("cat") == "cpu_op"]
    if gpu:
        launches = {
            (e.get("args") or {}).get("correlation"): e
            for e in host
            if e.get("cat") in ("cuda_runtime", "cuda_driver")
        }
        kernels = [(k, launches.get((k.get("args") or {}).get("correlation"))) for k in gpu]
    else:  # CPU: the innermost CPU ops (no CPU op inside them) are the work
        inner = {id(p) for e in cpu_ops for p in chains[id(e)] if p.get("cat") == "cpu_op"}
        kernels = [(e, e) for e in cpu_ops if id(e) not in inner]

    def region_of(chain):
        names = [c["name"][len(REGION) :] for c in chain if c.get("cat") == "user_annotation"]
        names = [n for n in names if n in ("experts", "attention", "norm")]
        return names[-1] if names else None

    # the forward region of each autograd sequence number, for the backward ops that carry it
    seq_region = {}
    for e in cpu_ops:
        args = e.get("args") or {}
        seq = args.get("Sequence number")
        if seq is None or e["name"].startswith("autograd::engine"):
            continue
        r = region_of(chains[id(e)])
        if r is not None:
            seq_region.setdefault(seq, r)
    vocab = set(vocab)

    def category(kernel, launch):
        chain = (chains.get(id(launch), []) + [launch]) if launch is not None else []
        names = [c["name"] for c in chain] + [kernel["name"]]
        if any(n.startswith("Optimizer.") for n in names):
            return "optimizer"
        if not any("embedding" in n for n in names):
            if any(vocab & _dims(c) for c in chain) or any(
                "cross_entropy" in n or "nll_loss" in n for n in names
            ):
                return "LM head + loss"
        region = region_of(chain)
        if region is None:
            for c in reversed(chain):
                seq = (c.get("args") or {}).get("Sequence number")
                if c.get("cat") == "cpu_op" and seq is not None and seq in seq_region:
                    region = seq_region[seq]
                    break
        gemm = any(_GEMM.search(n) for n in names)
        if region is None and any(_EXPERTS.search(n) and not _ROPE.search(n) for n in names):
            region = "experts"
        if region == "experts":
            return "experts"
        if region == "attention":
            if any(_ROPE.search(n) for n in names):
                return "norms/rope/elementwise"
            if any(_ATTN.search(n) for n in names if not n.startswith(REGION)):
                return "attention"
            return "dense GEMMs" if gemm else "attention"
        if region == "norm":
            return "norms/rope/elementwise"
        return "dense GEMMs" if gemm else "norms/rope/elementwise"

    out = dict.fromkeys(CATEGORIES, 0.0)
    spans = []
    for k, launch in kernels:
        out[category(k, launch)] += float(k["dur"]) / 1e3
        spans.append((float(k["ts"]), float(k["ts"]) + float(k["dur"])))
    spans.sort()
    busy, t = 0.0, None
    for a, b in spans:
        if t is None or a > t:
            busy += b - a
            t = b
        elif b > t:
            busy += b - t
            t = b
    starts = [float(e["ts"]) for e in host] + [a for a, _ in spans]
    ends = [b for _, b in spans] + [float(e["ts"]) + float(e["dur"]) for e in host]
    span = (max(ends) - min(starts)) / 1e3 if starts else 0.0
    out["idle"] = max(0.0, span - busy / 1e3)
    out["span"], out["busy"] = span, busy / 1e3
    return out


def profile_breakdown(step, vocab: tuple, path=None, gaps: Optional[dict] = None) -> dict:
    """One more step() under torch.profiler (shapes recorded), classified by classify_trace; the Chrome trace
    is kept at path when given; `gaps` (a dict) is filled with gpu_gaps of the same trace."""
    import json
    import os
    import tempfile

    from torch.profiler import profile

    with profile(activities=_activities(), record_shapes=True) as prof:
        step()
        _sync()
    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(str(path or tmp))
        with open(path or tmp) as f:
            trace = json.load(f)
        if gaps is not None:
            gaps.update(gpu_gaps(trace, top=6))
        return classify_trace(trace, vocab)
    finally:
        os.unlink(tmp)


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="GPU idle intervals of Chrome traces (bench_layer.py --trace)")
    ap.add_argument("traces", nargs="+", help="Chrome trace JSON files")
    ap.add_argument("--top", type=int, default=8, help="idle intervals to list (default 8)")
    a = ap.parse_args()
    for p in a.traces:
        with open(p) as f:
            print_gaps(p, gpu_gaps(json.load(f), a.top))
