"""Kernel-time profiles for the benchmarks: one more call under torch.profiler, its top kernels."""

from __future__ import annotations


def profile_step(step, rows):
    """One more step under torch.profiler: prints the `rows` kernels/ops with the most self device time and
    returns them as [name, self device ms, calls]."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
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


def export_trace(step, path):
    """One more step() under torch.profiler (CPU and CUDA activities), saved as a Chrome trace at path."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()  # warm: the profiled call must not pay first-call costs
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_gaps(trace: dict, top: int = 8) -> dict:
    """Where the GPU idles in a Chrome trace of one step: the span from the first CPU op to the last GPU
    event, the busy time (union of kernels, copies and sets), and the `top` longest idle intervals with the
    CPU ops running during each (outermost first)."""
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
    out = []
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        during = [e for e in cpu if float(e["ts"]) < b and float(e["ts"]) + float(e["dur"]) > a]
        during.sort(key=lambda e: (-float(e["dur"]), float(e["ts"])))
        out.append({"at_us": a - start, "idle_us": b - a, "cpu_ops": [e["name"] for e in during[:4]]})
    return {"span_us": t - start, "busy_us": busy, "idle_us": t - start - busy, "gaps": out}


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
