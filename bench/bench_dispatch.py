"""Expert-parallel dispatch + combine: GB/s per rank of moe8.parallel's transports against a plain
torch.distributed.all_to_all_single of the same rows (splits known in advance: no counts exchange, no plan,
no host read), at DeepEP's shape: 4096 tokens per rank, hidden 7168, top-8 of 256 experts, bf16 rows and
(--fp8) FP8 rows (e4m3 codes + 1x128 fp32 scales, what the transports send when the experts are FP8; the
baseline then moves uint8 rows of the same bytes, and dispatch includes the quantisation and the owner's
dequantisation).

    torchrun --nproc_per_node 8 bench/bench_dispatch.py --json bench/results/dispatch_h200.json
    torchrun --nproc_per_node 2 bench/bench_dispatch.py --tiny            # CPU / gloo smoke run

GB/s = bytes of the rows this rank sends (T * K rows of H elements, 2 bytes each in bf16, 1 + 4/128 in FP8,
itself included) / time, the slowest
rank's time (DeepEP's convention). Dispatch includes the plan, the counts all_to_all and its host read;
combine the return all_to_all (the weighted sum at the source is not timed). Prints a table last and writes
JSON (rank 0)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moe8.parallel import make_transport

DEEPEP = dict(tokens=4096, hidden=7168, top_k=8, experts=256)
TINY = dict(tokens=64, hidden=256, top_k=4, experts=16)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, warmup, iters) -> float:
    """Seconds per call, the slowest rank's mean."""
    for _ in range(warmup):
        fn()
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def bench_transport(name, x, ids, w, args, device, fp8=False) -> dict:
    T, K = ids.shape
    H = x.shape[1]
    t = make_transport(name, None, args.experts)
    out, _, meta = t.dispatch(x, ids, w, fp8=fp8)
    send, recv = meta.send_splits, meta.recv_splits  # the baseline moves exactly these rows, splits given
    row_bytes = H + 4 * -(-H // 128) if fp8 else H * x.element_size()
    flat = (
        torch.zeros(T * K, row_bytes, dtype=torch.uint8, device=device) if fp8 else x.repeat_interleave(K, 0)
    )
    buf = flat.new_empty(sum(recv), flat.shape[1])
    back = x.new_empty(T * K, H)
    calls = {
        "base_dispatch": lambda: dist.all_to_all_single(buf, flat, recv, send),
        "base_combine": lambda: dist.all_to_all_single(back, out, send, recv),
        "dispatch": lambda: t.dispatch(x, ids, w, check_ids=False, fp8=fp8),
        "combine": lambda: t.combine(out, meta),
    }
    sent = T * K * row_bytes
    row = dict(
        transport=name, rows="fp8" if fp8 else str(x.dtype).split(".")[-1], world=dist.get_world_size()
    )
    row.update(tokens=T, hidden=H, top_k=K, experts=args.experts, bytes=sent)
    for k, fn in calls.items():
        dt = timed(fn, device, args.warmup, args.iters)
        moved = T * K * H * x.element_size() if k.endswith("combine") else sent  # combine returns bf16 rows
        row[f"{k}_ms"], row[f"{k}_gbps"] = dt * 1e3, moved / dt / 1e9
    return row


def bench(args, device) -> list:
    s = TINY if args.tiny else DEEPEP
    T, H, K, E = s["tokens"], s["hidden"], s["top_k"], s["experts"]
    args.experts = E
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    ids = torch.argsort(torch.rand(T, E, generator=g), 1)[:, :K].to(device, torch.int32)  # balanced routing
    w = torch.rand(T, K, generator=g).to(device)
    precisions = [False, True] if args.fp8 else [False]
    return [bench_transport(n, x, ids, w, args, device, fp8) for n in args.transports for fp8 in precisions]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a small shape for CPU / gloo smoke runs")
    p.add_argument("--transports", default="nccl", help="comma-separated: nccl, ipc")
    p.add_argument("--fp8", action="store_true", help="also FP8 rows (e4m3 + 1x128 scales)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    args = p.parse_args(argv)
    args.transports = [t for t in args.transports.split(",") if t]
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        rows = bench(args, device)
    finally:
        backend = dist.get_backend()
        rank = dist.get_rank()
        dist.destroy_process_group()
    if rank != 0:
        return
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        commit = ""
    info = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        commit=commit,
        device=torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        backend=backend,
        torch=torch.__version__,
        dtype="bfloat16 tokens" + (", rows also FP8 (e4m3 + 1x128 scales)" if args.fp8 else ""),
        routing="uniform random top-k (balanced)",
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(info, results=rows), indent=2))
    print(f"{info['device']}, {backend}, torch {info['torch']}, commit {commit}")
    head = (
        f"{'transport':>9} {'rows':>8} {'ranks':>5} {'T x H, top-k / E':>20} | {'a2a disp':>9} {'disp':>9} "
        f"{'ratio':>5} |"
    )
    head += f" {'a2a comb':>9} {'comb':>9} {'ratio':>5}   (GB/s per rank)"
    print(head)
    for r in rows:
        shape = f"{r['tokens']}x{r['hidden']}, {r['top_k']}/{r['experts']}"
        print(
            f"{r['transport']:>9} {r['rows']:>8} {r['world']:>5} {shape:>20} | {r['base_dispatch_gbps']:9.2f} "
            f"{r['dispatch_gbps']:9.2f} {r['dispatch_gbps'] / r['base_dispatch_gbps']:5.2f} | "
            f"{r['base_combine_gbps']:9.2f} {r['combine_gbps']:9.2f} {r['combine_gbps'] / r['base_combine_gbps']:5.2f}"
        )


if __name__ == "__main__":
    main()
