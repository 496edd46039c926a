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
