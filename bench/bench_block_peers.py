"""The MoE block, forward + backward, beside its strongest open peer in one process on the same inputs:
transformers' Qwen3-MoE block (grouped_mm experts), moe8's block (moe8.moe_forward: the fused router and the
experts; one row per moe8.Config named with --moe8) and SonicMoE (its softmax top-k router and IO-aware
experts, when importable: bench/peers.py says what it needs; else its row records why).

    PYTHONPATH=$SONIC:$QUACK:$DSL/python_packages python bench/bench_block_peers.py \\
        --shapes qwen3,olmoe,mixtral --routing balanced,skewed --json bench/results/block_peers_h200.json

Per row: median ms of one forward + backward (CUDA events, after warm-ups; SonicMoE's first call, which
compiles its kernels, is timed apart), the expert GEMMs' TFLOP/s, and the activation memory above the inputs:
the peak of one forward + backward over what was allocated before it, every gradient set to None first (so
the weight gradients count, as in a training step after zero_grad()), and what a forward holds for its backward
(its output included). The routing is the same for every row: each routes with the block's router weights
(softmax, top-k, renormalised), and "skewed" draws each token's favourite expert from a Zipf law and tilts its
input towards that expert's router row. Prints a table last."""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_layer import BF16_CEILING, SHAPES, back_to_back_ms, hf_block, median_ms, rel  # on sys.path
from peers import SONICMOE, sonicmoe_block, sonicmoe_version
from run_info import run_info

import moe8

BLOCK_SHAPES = ("qwen3", "olmoe", "mixtral")
ROUTINGS = ("balanced", "skewed")


def block_inputs(block, T: int, routing: str, seed: int = 0):
    """x [T, H] bf16 (requires grad) and dy [T, H]; "skewed": x tilted towards a Zipf-drawn expert's router row
    per token (its favourite then takes the top slot for most tokens)."""
    gate = block.gate.weight.detach()  # [E, H]
    E, H = gate.shape
    g = torch.Generator(device=gate.device).manual_seed(seed)
    x = torch.randn(T, H, device=gate.device, generator=g)
    if routing == "skewed":
        ranks = torch.arange(1, E + 1, device=gate.device, dtype=torch.float32)
        fav = torch.multinomial(ranks.pow(-1.2), T, replacement=True, generator=g)  # Zipf(1.2) over experts
        w = gate.float()
        x = x + 3.0 * w[fav] / w[fav].norm(dim=1, keepdim=True)
    dy = torch.randn(T, H, device=gate.device, generator=g)
    return x.to(gate.dtype).requires_grad_(), dy.to(gate.dtype)


def rows_per_expert(block, x, K: int) -> tuple[int, float]:
    """(most rows any expert gets, the mean) under the block's routing."""
    with torch.no_grad():
        ids = (x @ block.gate.weight.t()).float().topk(K, dim=-1).indices
        counts = torch.bincount(ids.flatten(), minlength=block.gate.weight.shape[0])
    return int(counts.max()), counts.float().mean().item()


def peak_and_held(forward, params, dy) -> tuple[float, float]:
    """GiB above what was allocated before one forward + backward (gradients None first: they count), and GiB
    the forward holds for its backward (its output included)."""
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = forward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    torch.autograd.backward(out, dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    for p in params:
        p.grad = None
    return peak / 2**30, held / 2**30


def measure(label, forward, params, dy, flops, reference=None, opts=None, warmup=3, iters=10) -> dict:
    """One row: ms, TFLOP/s, peak / held GiB, the output's and x's gradient's difference from `reference`
    (transformers' row, the same inputs); with opts (the command line): the top kernels of one more step
    (profile), its GPU busy and idle time from a trace (trace: a folder), ms per step queued back to back."""
    opts = opts or {}
    x = params[0]

    def step():
        for p in params:
            p.grad = None
        torch.autograd.backward(forward(), dy)

    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    ms = median_ms(step, torch.device("cuda"), warmup, iters)
    peak, held = peak_and_held(forward, params, dy)
    row = {"impl": label, "ms": ms, "first_call_s": first_s, "peak_extra_gib": peak, "held_gib": held}
    row["expert_tflops"] = flops / (ms * 1e-3) / 1e12
    row["pct_of_bf16_ceiling"] = 100 * row["expert_tflops"] * 1e12 / BF16_CEILING
    y = forward()
    (dx,) = torch.autograd.grad(y, x, dy)
    row["out"], row["dx"] = y.detach(), dx
    if reference is not None:
        row["output_rel_diff"] = rel(y, reference["out"])
        row["dx_rel_diff"] = rel(dx, reference["dx"])
    if opts.get("profile"):
        from profiling import profile_step

        print(f"  {label}:", flush=True)
        row["profile"] = profile_step(step, opts["profile"])
    if opts.get("trace"):  # where the GPU idles in one more step (bench/profiling.py)
        from pathlib import Path

        from profiling import export_trace, gpu_gaps, print_gaps

        path = Path(opts["trace"]) / f"{opts['tag']}_{label.split()[0]}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        export_trace(step, path)
        with open(path) as f:
            gaps = gpu_gaps(json.load(f))
        row["gpu_busy_ms"], row["gpu_idle_ms"] = gaps["busy_us"] / 1e3, gaps["idle_us"] / 1e3
        row["idle_by_op"] = gaps.get("idle_by_op", [])
        print_gaps(f"  {label} trace", gaps)
    if opts.get("back_to_back"):
        row["back_to_back_ms"] = back_to_back_ms(step, opts["back_to_back"])
    print(
        f"  {label:<28} {ms:8.3f} ms {row['expert_tflops']:6.0f} TF/s  peak {peak:6.2f} GiB  held {held:5.2f} GiB"
        f"  (first call {first_s:.1f} s)",
        flush=True,
    )
    return row


def moe8_config(spec: str):
    """ "default" or comma-free k=v pairs joined by '+', e.g. "keep_permuted=1+routed_down=0": (label, Config)."""
    if spec == "default":
        return "moe8", moe8.Config()
    fields = {}
    for part in spec.split("+"):
        name, _, value = part.partition("=")
        if value not in ("0", "1"):
            raise SystemExit(f"--moe8: expected NAME=0|1 joined by '+', got {part!r}")
        fields[name] = value == "1"
    try:
        return f"moe8 ({spec})", moe8.Config(**fields)
    except TypeError as e:
        raise SystemExit(f"--moe8: {e}") from None


def bench(name, routing, T, configs, peers, opts) -> dict:
    H, I, E, K = SHAPES[name]
    torch.manual_seed(0)
    block = hf_block(H, I, E, K)
    x, dy = block_inputs(block, T, routing)
    most, mean = rows_per_expert(block, x, K)
    print(f"[bench] {name} {routing}: {T} tokens, rows per expert max {most} / mean {mean:.0f}", flush=True)
    flops = 3 * 2 * T * K * (H * 2 * I + I * H)  # fwd + dgrad + wgrad of the two expert GEMMs
    gate, experts = block.gate, block.experts
    params = [x, *block.parameters()]
    rows = []
    opts = {**opts, "tag": f"{name}_{routing}"}
    ref = measure(
        "transformers (grouped_mm)", lambda: block(x.unsqueeze(0))[0], params, dy, flops, None, opts
    )
    rows.append(ref)
    for label, cfg in configs:

        def moe8_forward(cfg=cfg):
            y, _ = moe8.moe_forward(
                x, gate.weight, experts.gate_up_proj, experts.down_proj, K, "softmax", True, config=cfg
            )
            return y

        rows.append(measure(label, moe8_forward, params, dy, flops, ref, opts))
    if SONICMOE in peers:
        why, info = sonicmoe_version()
        if why is None:
            try:
                moe = sonicmoe_block(
                    gate.weight.detach(), experts.gate_up_proj.detach(), experts.down_proj.detach(), K
                )
                p = [x, *moe.parameters()]
                rows.append({**measure(SONICMOE, lambda: moe(x)[0], p, dy, flops, ref, opts), **info})
                del moe
            except Exception as e:  # noqa: BLE001  (a peer failing is recorded, the other rows are kept)
                why = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
        if why is not None:
            print(f"  {SONICMOE}: not run: {why}", flush=True)
            rows.append({"impl": SONICMOE, "skipped": why})
    for r in rows:
        r.pop("out", None), r.pop("dx", None)
        if "ms" in r:
            r["speedup_vs_transformers"] = ref["ms"] / r["ms"]
    shape = {"shape": name, "hidden": H, "intermediate": I, "experts": E, "top_k": K, "tokens": T}
    return {
        **shape,
        "routing": routing,
        "rows_per_expert_max": most,
        "rows_per_expert_mean": mean,
        "rows": rows,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes", default=",".join(BLOCK_SHAPES), help=f"comma-separated, from {sorted(SHAPES)}"
    )
    ap.add_argument("--routing", default=",".join(ROUTINGS), help=f"comma-separated, from {list(ROUTINGS)}")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per block call (default 16384)")
    ap.add_argument(
        "--moe8",
        default="default",
        help="comma-separated moe8 rows: 'default' or Config fields NAME=0|1 joined by '+' "
        "(e.g. default,keep_permuted=1)",
    )
    ap.add_argument(
        "--peers", default=SONICMOE, help=f"comma-separated peers to run beside moe8: {SONICMOE} or ''"
    )
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print each row's N top kernels")
    ap.add_argument("--trace", default=None, metavar="DIR", help="save a trace of one more step per row in DIR "
                    "and print where the GPU idles")  # fmt: skip
    ap.add_argument("--back-to-back", type=int, default=0, metavar="N", help="also time N steps queued back to "
                    "back per row (one synchronisation at the end)")  # fmt: skip
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if not moe8.cuda_available():
        raise SystemExit("bench_block_peers: needs a CUDA GPU and moe8 built with CUDA")
    shapes, routings = args.shapes.split(","), args.routing.split(",")
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {s!r}, expected from {sorted(SHAPES)}")
    for r in routings:
        if r not in ROUTINGS:
            raise SystemExit(f"--routing: unknown routing {r!r}, expected from {list(ROUTINGS)}")
    configs = [moe8_config(s) for s in args.moe8.split(",") if s]
    peers = [p for p in args.peers.split(",") if p]
    for p in peers:
        if p != SONICMOE:
            raise SystemExit(f"--peers: unknown peer {p!r}, expected {SONICMOE!r}")
    meta = {**run_info("cuda"), "moe8_rows": args.moe8, "peers": peers}
    results = []
    for s in shapes:
        for r in routings:
            opts = {"profile": args.profile, "trace": args.trace, "back_to_back": args.back_to_back}
            results.append(bench(s, r, args.tokens, configs, peers, opts))
            if args.json:  # after every shape: a later failure keeps what ran
                with open(args.json, "w") as f:
                    json.dump({"meta": meta, "blocks": results}, f, indent=1)
            torch.cuda.empty_cache()
    print(f"\n{meta}")
    print(
        f"{'shape':<8} {'routing':<9} {'impl':<28} {'ms':>8} {'vs HF':>6} {'TF/s':>5} {'peak GiB':>8} {'held':>6}"
        f" {'queued ms':>9} {'GPU busy':>8}"
    )
    for b in results:
        for r in b["rows"]:
            if "skipped" in r:
                print(f"{b['shape']:<8} {b['routing']:<9} {r['impl']:<28} not run: {r['skipped'][:80]}")
                continue
            print(
                f"{b['shape']:<8} {b['routing']:<9} {r['impl']:<28} {r['ms']:>8.3f} "
                f"{r['speedup_vs_transformers']:>5.2f}x {r['expert_tflops']:>5.0f} {r['peak_extra_gib']:>8.2f} "
                f"{r['held_gib']:>6.2f} {r.get('back_to_back_ms', float('nan')):>9.3f} "
                f"{r.get('gpu_busy_ms', float('nan')):>8.3f}"
            )


if __name__ == "__main__":
    main()
