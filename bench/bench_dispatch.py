"""Expert-parallel dispatch + combine: GB/s per rank of moe8.parallel's transports against a plain
torch.distributed.all_to_all_single of the same rows (splits known in advance: no counts exchange, no plan,
no host read), at DeepEP's shape: 4096 tokens per rank, hidden 7168, top-8 of 256 experts, bf16 rows and
(--fp8) FP8 rows (e4m3 codes + 1x128 fp32 scales, what the transports send when the experts are FP8; the
baseline then moves uint8 rows of the same bytes, and dispatch includes the quantisation and the owner's
dequantisation).

    torchrun --nproc_per_node 8 bench/bench_dispatch.py --json bench/results/dispatch_h200.json
    torchrun --nproc_per_node 2 bench/bench_dispatch.py --tiny            # CPU / gloo smoke run

--shared-gpu: every rank on cuda:0 of one GPU (the `ipc` transport, its handles exchanged over gloo: NCCL
refuses two ranks on one GPU); the baseline is the one-GPU ceiling instead, a plain device-to-device copy
(dst.copy_(src)) of the same bytes per rank, every rank copying at once, timed the same way. The script is
its own launcher: it starts each world of --procs (fresh port, a gloo group from MASTER_ADDR / MASTER_PORT),
kills a world that runs past --timeout and records it as such, and with --mps runs the sweep again under the
CUDA MPS daemon (started with pipe and log folders under a temporary folder, stopped at the end):

    PYTHONPATH=python python bench/bench_dispatch.py --shared-gpu --procs 2,4,8 --tokens 128,1024,4096 --fp8 \
        --mps --json bench/results/dispatch_shared_h200.json --md bench/results/dispatch_shared_h200.md
    PYTHONPATH=python python bench/bench_dispatch.py --shared-gpu --tiny --procs 2   # CPU: gloo all_to_all

GB/s = bytes of the rows this rank sends (T * K rows of H elements, 2 bytes each in bf16, 1 + 4/128 in FP8,
itself included) / time, the slowest
rank's time (DeepEP's convention). Dispatch includes the plan, the counts all_to_all and its host read;
combine the return all_to_all (the weighted sum at the source is not timed). The fixed cost per layer
(--shared-gpu, at each of --tokens) is dispatch + combine in microseconds. Prints a table last and writes
JSON (rank 0; the launcher with --shared-gpu, which also writes --md)."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from run_info import run_info  # this folder is on sys.path

from moe8.parallel import make_transport

DEEPEP = dict(tokens=4096, hidden=7168, top_k=8, experts=256)
TINY = dict(tokens=64, hidden=256, top_k=4, experts=16)
# every process of a shared-GPU world: no NVLink multicast (NVLS) anywhere
CHILD_ENV = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
MPS_CONTROL = "nvidia-cuda-mps-control"


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


def row_bytes(hidden: int, fp8: bool, element_size: int = 2) -> int:
    """Bytes of one sent row: H codes + ceil(H / 128) fp32 scales in FP8, else H elements."""
    return hidden + 4 * -(-hidden // 128) if fp8 else hidden * element_size


def _row_head(name, x, ids, args, fp8, baseline) -> dict:
    T, K = ids.shape
    row = dict(transport=name, baseline=baseline, rows="fp8" if fp8 else str(x.dtype).split(".")[-1])
    row.update(world=dist.get_world_size(), tokens=T, hidden=x.shape[1], top_k=K, experts=args.experts)
    row["bytes"] = T * K * row_bytes(x.shape[1], fp8, x.element_size())
    return row


def _time_calls(row, calls, device, args) -> dict:
    """Times each call, with the bytes it moves: the sent rows for a dispatch, bf16 rows for a combine."""
    T, K, H = row["tokens"], row["top_k"], row["hidden"]
    for k, fn in calls.items():
        dt = timed(fn, device, args.warmup, args.iters)
        moved = T * K * H * 2 if k.endswith("combine") else row["bytes"]  # combine returns bf16 rows
        row[f"{k}_ms"], row[f"{k}_gbps"] = dt * 1e3, moved / dt / 1e9
    return row


def bench_transport(name, x, ids, w, args, device, fp8=False) -> dict:
    T, K = ids.shape
    H = x.shape[1]
    t = make_transport(name, None, args.experts)
    out, _, meta = t.dispatch(x, ids, w, fp8=fp8)
    send, recv = meta.send_splits, meta.recv_splits  # the baseline moves exactly these rows, splits given
    flat = (
        torch.zeros(T * K, row_bytes(H, True), dtype=torch.uint8, device=device)
        if fp8
        else x.repeat_interleave(K, 0)
    )
    buf = flat.new_empty(sum(recv), flat.shape[1])
    back = x.new_empty(T * K, H)
    calls = {
        "base_dispatch": lambda: dist.all_to_all_single(buf, flat, recv, send),
        "base_combine": lambda: dist.all_to_all_single(back, out, send, recv),
        "dispatch": lambda: t.dispatch(x, ids, w, check_ids=False, fp8=fp8),
        "combine": lambda: t.combine(out, meta),
    }
    return _time_calls(_row_head(name, x, ids, args, fp8, "all_to_all_single"), calls, device, args)


def inputs(T: int, s: dict, device, seed: int):
    """This rank's tokens x [T, H] bf16, ids [T, K] int32 (uniform random distinct experts: balanced), and
    weights [T, K]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, s["hidden"], generator=g).to(device, torch.bfloat16)
    ids = torch.argsort(torch.rand(T, s["experts"], generator=g), 1)[:, : s["top_k"]].to(device, torch.int32)
    w = torch.rand(T, s["top_k"], generator=g).to(device)
    return x, ids, w


def bench(args, device) -> list:
    s = TINY if args.tiny else DEEPEP
    args.experts = s["experts"]
    precisions = [False, True] if args.fp8 else [False]
    rows = []
    for i, T in enumerate(args.tokens or [s["tokens"]]):
        x, ids, w = inputs(T, s, device, dist.get_rank() + 7919 * i)
        rows += [
            bench_transport(n, x, ids, w, args, device, fp8) for n in args.transports for fp8 in precisions
        ]
    return rows


# ------------------------------------------------------------------------------------------ one GPU, shared
def _gpu_used_gib(device) -> float:
    """Memory in use on the whole GPU (every process), GiB."""
    if device.type != "cuda":
        return 0.0
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30


def bench_shared_transport(t, x, ids, w, args, device, fp8, peak) -> dict:
    """One transport and precision on a shared GPU: dispatch and combine, then the copy ceiling of the same
    bytes (each buffer freed before the next is made, so the world's memory stays at the transport's)."""
    out, _, meta = t.dispatch(x, ids, w, fp8=fp8)
    row = _row_head(t.name, x, ids, args, fp8, "copy")
    calls = {
        "dispatch": lambda: t.dispatch(x, ids, w, check_ids=False, fp8=fp8),
        "combine": lambda: t.combine(out, meta),
    }
    _time_calls(row, calls, device, args)
    peak.append(_gpu_used_gib(device))
    out = meta = calls = None  # freed before the copies
    for k, n in (
        ("base_dispatch", row["bytes"]),
        ("base_combine", row["tokens"] * row["top_k"] * row["hidden"] * 2),
    ):
        src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 256)
        dst = torch.empty_like(src)
        _time_calls(row, {k: lambda dst=dst, src=src: dst.copy_(src)}, device, args)
        del src, dst
    row["layer_us"] = (row["dispatch_ms"] + row["combine_ms"]) * 1e3
    row["base_layer_us"] = (row["base_dispatch_ms"] + row["base_combine_ms"]) * 1e3
    return row


def bench_shared(args, device) -> tuple:
    """Every transport x precision x tokens of --tokens on this world; a transport per token count (its
    buffers fixed at that count: max_tokens), closed before the next. -> (rows, the GPU's peak GiB seen)."""
    s = TINY if args.tiny else DEEPEP
    args.experts = s["experts"]
    precisions = [False, True] if args.fp8 else [False]
    rows, peak = [], [_gpu_used_gib(device)]
    for i, T in enumerate(args.tokens or [s["tokens"]]):
        x, ids, w = inputs(T, s, device, dist.get_rank() + 7919 * i)
        for name in args.transports:
            t = make_transport(name, None, args.experts, timeout_s=args.ipc_timeout, max_tokens=T)
            rows += [bench_shared_transport(t, x, ids, w, args, device, fp8, peak) for fp8 in precisions]
            _sync(device)
            if hasattr(t, "close"):
                t.close()
            del t
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows, max(peak)


def ipc_buffer_gib(world: int, tokens: int, s: dict, fp8: bool) -> float:
    """The ipc transport's buffers over a whole world (csrc/core/ipc_layout.h): per rank, per row width, a
    region of tokens x K rows per source + a return region + 16 bytes of metadata per received row."""
    H, cap = s["hidden"], tokens * s["top_k"]
    scales = 4 * -(-H // 128)  # an FP8 row: H codes, then its fp32 scales padded to 16 bytes
    strides = [H * 2] + ([H + -(-scales // 16) * 16] if fp8 else [])
    return world * sum((world + 1) * cap * st + 16 * world * cap for st in strides) / 2**30


def worker(args) -> None:
    """One rank of a shared-GPU world (started by launch): RANK / WORLD_SIZE / MASTER_* from the environment."""
    (timeout,) = args.timeout
    # a hung rank prints its stacks into its log (the launcher shows the tail) before the launcher kills it
    dump_at = args.started + timeout - min(10.0, timeout / 4)
    faulthandler.dump_traceback_later(max(0.5, dump_at - time.time()), exit=False)
    world = int(os.environ["WORLD_SIZE"])
    cuda = not args.tiny
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--shared-gpu needs a GPU (--tiny runs on CPU)")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    if args.stall_world == world:
        time.sleep(timeout * 10)  # the launcher's test: a world that never finishes
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    try:
        rows, peak = bench_shared(args, device)
        rank = dist.get_rank()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        info = dict(run_info(device), backend="gloo")
        Path(args.worker_out).write_text(json.dumps(dict(info=info, gpu_used_gib=peak, results=rows)))


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_world(world: int, timeout: float, args, env: dict, tmp: Path, tag: str) -> tuple:
    """Starts `world` ranks, waits at most `timeout` seconds, kills whatever is still running. -> (record,
    rows, rank 0's run info)."""
    out = tmp / f"{tag}_world{world}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--shared-gpu", "--worker-out", str(out)]
    cmd += ["--tokens", ",".join(map(str, args.tokens)), "--transports", ",".join(args.transports)]
    cmd += ["--warmup", str(args.warmup), "--iters", str(args.iters), "--timeout", str(timeout)]
    cmd += ["--ipc-timeout", str(args.ipc_timeout), "--stall-world", str(args.stall_world)]
    cmd += ["--started", str(time.time())]
    cmd += ["--fp8"] * args.fp8 + ["--tiny"] * args.tiny
    port, logs, procs = _free_port(), [tmp / f"{tag}_world{world}_rank{r}.log" for r in range(world)], []
    t0 = time.monotonic()
    status = "ok"
    try:
        for r in range(world):
            renv = dict(env, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            renv["MASTER_PORT"] = str(port)
            with open(logs[r], "w") as log:
                procs.append(subprocess.Popen(cmd, env=renv, stdout=log, stderr=subprocess.STDOUT))
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r, c = failed[0]
                status = f"failed: rank {r} exited with {c}"
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() - t0 > timeout:
                status = f"timeout: still running after {timeout:g} s, killed"
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
    rec = dict(world=world, status=status, wall_s=round(time.monotonic() - t0, 1))
    if status == "ok" and not out.exists():
        rec["status"] = status = "failed: rank 0 wrote no results"
    if status != "ok":
        rec["log_tail"] = {r: _tail(logs[r]) for r in range(world)}
        print(f"world {world} ({tag}): {status}", file=sys.stderr)
        for r, text in rec["log_tail"].items():
            print(f"--- rank {r}\n{text}", file=sys.stderr)
        return rec, [], None
    got = json.loads(out.read_text())
    rec["gpu_used_gib"] = round(got["gpu_used_gib"], 2)
    return rec, got["results"], got["info"]


def _mps(env: dict, *args: str, command: str = "") -> tuple:
    """nvidia-cuda-mps-control with args (-d: start the daemon) or a command on its stdin -> (ok, output).
    The output goes through a file, not a pipe: the daemon -d forks would hold a pipe open."""
    io = dict(stdin=subprocess.DEVNULL) if args else dict(input=command + "\n")
    try:
        with tempfile.TemporaryFile("w+") as out:
            p = subprocess.run(
                [MPS_CONTROL, *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=60,
                **io,
            )
            out.seek(0)
            said = out.read().strip()
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"{MPS_CONTROL} {' '.join(args) or command}: {e}"
    return p.returncode == 0, said


def launch(args) -> int:
    """The whole shared-GPU sweep: each world of --procs without MPS, then (--mps) with it. -> exit code."""
    s = TINY if args.tiny else DEEPEP
    args.tokens = args.tokens or [s["tokens"]]
    timeouts = args.timeout * len(args.procs) if len(args.timeout) == 1 else args.timeout
    mps_bin = shutil.which(MPS_CONTROL)
    states = [False] + ([True] if args.mps and mps_bin else [])
    tmp = Path(tempfile.mkdtemp(prefix="moe8-dispatch-"))
    base_env = dict(os.environ, **CHILD_ENV)
    worlds, rows, info = [], [], None
    start = time.monotonic()
    if "ipc" in args.transports:
        for n in args.procs:
            gib = ipc_buffer_gib(n, max(args.tokens), s, args.fp8)
            print(f"world {n}: the ipc buffers take {gib:.1f} GiB of the GPU at {max(args.tokens)} tokens")
    for mps in states:
        env = dict(base_env)
        if mps:
            env.update(
                CUDA_MPS_PIPE_DIRECTORY=str(tmp / "mps_pipe"), CUDA_MPS_LOG_DIRECTORY=str(tmp / "mps_log")
            )
            for d in ("mps_pipe", "mps_log"):
                (tmp / d).mkdir()
        try:
            if mps:
                started, said = _mps(env, "-d")
                if not started:
                    worlds.append(dict(mps=True, status=f"MPS daemon did not start: {said}"))
                    continue
            for n, timeout in zip(args.procs, timeouts):
                rec, got, meta = run_world(n, timeout, args, env, tmp, "mps" if mps else "plain")
                if mps:
                    rec["mps_servers"] = _mps(env, command="get_server_list")[1]  # a server pid: MPS was used
                worlds.append(dict(rec, mps=mps))
                rows += [dict(r, mps=mps) for r in got]
                info = info or meta
                print(f"world {n}{' (MPS)' if mps else ''}: {rec['status']}, {rec['wall_s']} s", flush=True)
        finally:
            if mps:
                print("MPS daemon stopped:", _mps(env, command="quit")[1] or "ok")
    if info is None:  # no world finished: what the launcher itself can say (no MPS daemon runs any more)
        info = run_info("cpu" if args.tiny else None)
    where = "on CPU (--tiny)" if args.tiny else "every rank on cuda:0"
    system_pipe = Path(
        "/tmp/nvidia-mps/control"
    ).exists()  # a system daemon that runs without --mps would use
    info.update(
        mode=f"shared-gpu: {where}, a gloo group, transports {', '.join(args.transports)}",
        baseline="dst.copy_(src) of the same bytes per rank, every rank at once",
        shape=dict(hidden=s["hidden"], top_k=s["top_k"], experts=s["experts"]),
        tokens=args.tokens,
        procs=args.procs,
        warmup=args.warmup,
        iters=args.iters,
        mps=states if mps_bin else "not available",
        mps_default_pipe_present=system_pipe,
        routing="uniform random top-k (balanced)",
        wall_s=round(time.monotonic() - start, 1),
        worlds=worlds,
    )
    if args.mps and not mps_bin:
        print(f"--mps: {MPS_CONTROL} is not on PATH; ran without MPS only")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(info, results=rows), indent=2))
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(markdown(info, rows))
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{info['gpu']}, torch {info['torch']}, commit {info['commit']}, {info['wall_s']} s")
    print_shared_table(rows)
    return 0 if all(w["status"] == "ok" for w in worlds) else 1


def print_shared_table(rows) -> None:
    head = (
        f"{'transport':>9} {'rows':>8} {'mps':>5} {'ranks':>5} {'tokens':>6} | {'copy disp':>9} {'disp':>9} "
    )
    head += f"{'ratio':>5} | {'copy comb':>9} {'comb':>9} {'ratio':>5} | {'layer us':>9} {'copy us':>8}"
    print(head + "   (GB/s per rank)")
    for r in rows:
        print(
            f"{r['transport']:>9} {r['rows']:>8} {str(r['mps']):>5} {r['world']:>5} {r['tokens']:>6} | "
            f"{r['base_dispatch_gbps']:9.2f} {r['dispatch_gbps']:9.2f} {r['dispatch_gbps'] / r['base_dispatch_gbps']:5.2f} | "
            f"{r['base_combine_gbps']:9.2f} {r['combine_gbps']:9.2f} {r['combine_gbps'] / r['base_combine_gbps']:5.2f} | "
            f"{r['layer_us']:9.1f} {r['base_layer_us']:8.1f}"
        )


def markdown(info: dict, rows: list) -> str:
    """The shared-GPU results as markdown: GB/s at the largest token count, the fixed cost per layer at every
    count, and each world's status."""
    sh = info["shape"]
    most = max(info["tokens"])
    out = [
        f"# Expert-parallel dispatch + combine, ranks sharing one GPU ({info['gpu']})",
        "",
        f"{info['date']}, commit `{info['commit']}`, torch {info['torch']}, CUDA {info['cuda']}, driver "
        f"{info['driver']}; {info['mode']}; MPS: {info['mps']}. Shape: tokens per rank {info['tokens']}, "
        f"H {sh['hidden']}, top-{sh['top_k']} of {sh['experts']} experts, {info['routing']}; "
        f"warmup {info['warmup']}, iters {info['iters']}. Baseline (the one-GPU ceiling): {info['baseline']}. "
        "GB/s per rank: the bytes a rank sends (bf16: 2 per element; FP8: 1 + 4/128) / the slowest rank's time.",
        "",
        f"## GB/s per rank at {most} tokens per rank",
        "",
        "| ranks | rows | MPS | copy dispatch | dispatch | ratio | copy combine | combine | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["tokens"] == most:
            out.append(
                f"| {r['world']} | {r['rows']} | {r['mps']} | {r['base_dispatch_gbps']:.1f} | {r['dispatch_gbps']:.1f} "
                f"| {r['dispatch_gbps'] / r['base_dispatch_gbps']:.2f} | {r['base_combine_gbps']:.1f} | "
                f"{r['combine_gbps']:.1f} | {r['combine_gbps'] / r['base_combine_gbps']:.2f} |"
            )
    toks = info["tokens"]
    out += ["", "## Fixed cost per layer: dispatch + combine, us (copy of the same bytes in brackets)", ""]
    out += ["| ranks | rows | MPS | " + " | ".join(f"{t} tokens" for t in toks) + " |"]
    out += ["| --- | --- | --- | " + " | ".join("---" for _ in toks) + " |"]
    keys = dict.fromkeys((r["world"], r["rows"], r["mps"]) for r in rows)
    for w, kind, mps in keys:
        got = {r["tokens"]: r for r in rows if (r["world"], r["rows"], r["mps"]) == (w, kind, mps)}
        cells = [
            f"{got[t]['layer_us']:,.0f} ({got[t]['base_layer_us']:,.0f})" if t in got else "-" for t in toks
        ]
        out.append(f"| {w} | {kind} | {mps} | " + " | ".join(cells) + " |")
    out += ["", "## Worlds", "", "| ranks | MPS | status | wall s | GPU GiB in use (peak seen) |"]
    out += ["| --- | --- | --- | --- | --- |"]
    for wd in info["worlds"]:
        out.append(
            f"| {wd.get('world', '-')} | {wd['mps']} | {wd['status']} | {wd.get('wall_s', '-')} | "
            f"{wd.get('gpu_used_gib', '-')} |"
        )
    return "\n".join(out) + "\n"


def _ints(text: str) -> list:
    return [int(v) for v in text.split(",") if v]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a small shape for CPU / gloo smoke runs")
    p.add_argument(
        "--transports", default=None, help="comma-separated: nccl, ipc (default nccl; --shared-gpu: ipc)"
    )
    p.add_argument("--fp8", action="store_true", help="also FP8 rows (e4m3 + 1x128 scales)")
    p.add_argument(
        "--tokens", type=_ints, default=None, help="tokens per rank, comma-separated (default 4096)"
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    g = p.add_argument_group("--shared-gpu: ranks sharing one GPU, this script launching them")
    g.add_argument("--shared-gpu", action="store_true", help="every rank on cuda:0, gloo, the copy ceiling")
    g.add_argument("--procs", type=_ints, default=[2, 4, 8], help="world sizes, comma-separated")
    g.add_argument(
        "--timeout",
        type=lambda v: [float(t) for t in v.split(",") if t],
        default=[240.0],
        help="seconds a world may run before it is killed: one for every world, or one per --procs entry",
    )
    g.add_argument(
        "--ipc-timeout", type=float, default=60.0, help="the ipc transport's GPU barrier timeout_s"
    )
    g.add_argument("--mps", action="store_true", help=f"run the sweep again under {MPS_CONTROL} -d")
    g.add_argument("--md", default=None, help="write a markdown table here")
    g.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)  # a rank started by the launcher
    g.add_argument("--stall-world", type=int, default=0, help=argparse.SUPPRESS)  # the launcher's test
    g.add_argument(
        "--started", type=float, default=0.0, help=argparse.SUPPRESS
    )  # when the launcher started it
    args = p.parse_args(argv)
    if len(args.timeout) not in (1, len(args.procs)):
        p.error(
            f"--timeout: expected one value or one per --procs entry ({len(args.procs)}), got {args.timeout}"
        )
    if args.shared_gpu:  # the launcher touches no GPU (an MPS daemon may start after it); --tiny runs on CPU
        default = "nccl" if args.tiny else "ipc"  # nccl over gloo: the CPU stand-in for ipc
        args.transports = [t for t in (args.transports or default).split(",") if t]
        if args.worker_out:
            return worker(args)
        sys.exit(launch(args))
    args.transports = [t for t in (args.transports or "nccl").split(",") if t]
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
