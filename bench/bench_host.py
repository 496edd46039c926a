"""Host time of one MoE layer step (forward + backward) with moe8's ops called through the torch.library
dispatcher (MOE8_EAGER_DIRECT=0) vs directly (moe8._core): a tiny layer, so the kernels take next to nothing
and the wall time per step is the Python and dispatch work that a GPU would wait for.

    PYTHONPATH=python python bench/bench_host.py                     # CPU, or the GPU when there is one
    PYTHONPATH=python python bench/bench_host.py --device cpu --json bench/results/eager_direct_cpu.json

Prints microseconds per step (median of --repeats blocks of --steps steps) for each way; each way runs in
a process of its own, since the environment variable is read once, at import."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from run_info import run_info  # this folder is on sys.path

import moe8
from moe8 import _core


def make_step(device, T, H, I, E, K):
    torch.manual_seed(0)
    x = torch.randn(T, H, device=device, requires_grad=True)
    params = [
        torch.randn(E, H, device=device).requires_grad_(),
        torch.randn(E, 2 * I, H, device=device).requires_grad_(),
        torch.randn(E, H, I, device=device).requires_grad_(),
    ]

    def step():
        for p in (x, *params):
            p.grad = None
        y, _ = moe8.moe_forward(x, *params, K, "softmax", True)
        y.sum().backward()

    return step


def us_per_step(step, steps, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when moe8 can use it)")
    ap.add_argument("--steps", type=int, default=200, help="steps per timed block (default 200)")
    ap.add_argument("--repeats", type=int, default=5, help="timed blocks per way (default 5)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--way", choices=("direct", "dispatcher"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 1 or args.repeats < 1:
        raise SystemExit(f"--steps, --repeats: expected >= 1, got {args.steps}, {args.repeats}")
    name = args.device or ("cuda" if torch.cuda.is_available() and moe8.cuda_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise SystemExit(f"--device: expected cpu or cuda, got {name!r}")
    if name == "cuda" and not (torch.cuda.is_available() and moe8.cuda_available()):
        raise SystemExit("--device cuda: needs a CUDA GPU and moe8 built with CUDA")
    device = torch.device(name)
    shape = dict(T=16, H=64, I=32, E=8, K=2)
    step = make_step(device, **shape)
    if args.way is not None:  # a child: this process's way only
        assert _core.EAGER_DIRECT == (args.way == "direct"), "MOE8_EAGER_DIRECT does not match --way"
        us_per_step(step, 20, device)  # warm
        print(json.dumps([us_per_step(step, args.steps, device) for _ in range(args.repeats)]))
        return 0
    times = {}
    for way in ("dispatcher", "direct"):
        env = dict(os.environ, MOE8_EAGER_DIRECT="1" if way == "direct" else "0")
        cmd = [sys.executable, __file__, "--device", name, "--steps", str(args.steps), "--way", way]
        cmd += ["--repeats", str(args.repeats)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True).stdout
        times[way] = json.loads(out.strip().splitlines()[-1])
    med = {way: statistics.median(t) for way, t in times.items()}
    meta = dict(
        **run_info(name),
        shape=shape,
        steps=args.steps,
        repeats=args.repeats,
    )
    print(meta)
    for way, us in med.items():
        print(f"{way:<10} {us:9.1f} us per layer step (blocks: {', '.join(f'{t:.0f}' for t in times[way])})")
    print(f"direct / dispatcher: {med['direct'] / med['dispatcher']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, us_per_step=med, blocks=times), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
