"""The MoE block, forward + backward, beside its strongest open peers in one process on the same inputs:
transformers' Qwen3-MoE block (grouped_mm experts), moe8's block (moe8.moe_forward: the fused router and the
experts; one row per moe8.Config named with --moe8, and after each one row per FP8 recipe named with --fp8)
and SonicMoE (its softmax top-k router and IO-aware experts, when importable: bench/peers.py says what it
needs; else its row records why).

    PYTHONPATH=$SONIC:$QUACK:$DSL/python_packages python bench/bench_block_peers.py \\
        --shapes qwen3,olmoe,mixtral --routing balanced,skewed --json bench/results/block_peers_h200.json
    PYTHONPATH=python python bench/bench_block_peers.py --peers none --fp8 blockwise,blockwise+dgrad \\
        --json bench/results/block_fp8_h200.json --md bench/results/block_fp8_h200.md
    PYTHONPATH=python python bench/bench_block_peers.py --tiny --fp8 blockwise   # smoke run, CPU is fine

Per row: median ms of one forward + backward (CUDA events, after warm-ups; SonicMoE's first call, which
compiles its kernels, is timed apart), the expert GEMMs' TFLOP/s, and the activation memory above the inputs:
the peak of one forward + backward over what was allocated before it, every gradient set to None first (so
the weight gradients count, as in a training step after zero_grad()), and what a forward holds for its backward
(its output included). The routing is the same for every row: each routes with the block's router weights
(softmax, top-k, renormalised), and "skewed" draws each token's favourite expert from a Zipf law and tilts its
input towards that expert's router row.

FP8 rows (--fp8): the --moe8 row's Config with fp8 set (moe8.Config(fp8=...), what moe8.accelerate(model,
fp8=...) attaches to a model), on the same block and inputs, timed and measured the same way. The expert
weights train (requires_grad) and are quantised inside every step, as in training (fp8_cache="frozen", the
default: no FP8 copy of a trained weight is kept between calls; RECIPE@handoff: the dgrad's copy made in the
forward's pass and held to the backward). RECIPE@both or @one keep copies until an optimizer step, and none runs
here: those rows quantise the weights in their first step only (the bound of spreading that pass over many
micro-batches). Each FP8 row gives its speed-up over its bf16
row and the relative (Frobenius) error of its output and input gradient against that row's.
--peers none times moe8's rows only (transformers still builds the block and its weights; SonicMoE is not
imported).
Prints a table last; --json and --md write it too."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_layer import BF16_CEILING, SHAPES, back_to_back_ms, hf_block, median_ms, recipe_of, rel  # sys.path
from peers import SONICMOE, sonicmoe_block, sonicmoe_version
from run_info import run_info

import moe8

BLOCK_SHAPES = ("qwen3", "olmoe", "mixtral")
ROUTINGS = ("balanced", "skewed")
TRANSFORMERS = "transformers"
PEERS = (TRANSFORMERS, SONICMOE)
TINY = {"tiny": (256, 128, 8, 2)}  # --tiny: (hidden, intermediate, experts, top-k), 512 tokens
MODEL = {"qwen3": "Qwen3-30B-A3B", "olmoe": "OLMoE-1B-7B", "mixtral": "Mixtral-8x7B"}


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


def host_issue_ms(step, device, iters: int) -> float:
    """Median milliseconds the host takes to issue one step (from an idle GPU to the step's last call returning,
    before the GPU finishes): where it is close to the step's time, the GPU waits for the host."""
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def _cell(v, fmt: str, width: int = 0, unit: str = "") -> str:
    """v formatted (with unit after it), right-aligned to width; "-" where v is None."""
    return f"{f'{v:{fmt}}{unit}' if v is not None else '-':>{width}}"


def measure(label, forward, params, dy, flops, opts) -> dict:
    """One row: ms, TFLOP/s, peak / held GiB (on a GPU; None on the CPU), and the output and x's gradient of
    one more step (row["out"], row["dx"]: the caller compares rows with them); with opts (the command line):
    the top kernels of one more step (profile), its GPU busy and idle time from a trace (trace: a folder), ms
    per step queued back to back."""
    x = params[0]

    def step():
        for p in params:
            p.grad = None
        torch.autograd.backward(forward(), dy)

    t0 = time.perf_counter()
    step()
    if x.is_cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    ms = median_ms(step, x.device, opts["warmup"], opts["iters"])
    peak, held = peak_and_held(forward, params, dy) if x.is_cuda else (None, None)
    row = {"impl": label, "ms": ms, "first_call_s": first_s, "peak_extra_gib": peak, "held_gib": held}
    row["host_issue_ms"] = host_issue_ms(step, x.device, opts["iters"])
    row["expert_tflops"] = flops / (ms * 1e-3) / 1e12
    row["pct_of_bf16_ceiling"] = 100 * row["expert_tflops"] * 1e12 / BF16_CEILING
    y = forward()
    (dx,) = torch.autograd.grad(y, x, dy)
    row["out"], row["dx"] = y.detach(), dx
    if opts.get("profile"):
        from profiling import profile_step

        print(f"  {label}:", flush=True)
        row["profile"] = profile_step(step, opts["profile"])
    if opts.get("trace"):  # where the GPU idles in one more step (bench/profiling.py)
        from profiling import export_trace, gpu_gaps, print_gaps

        name = re.sub(r"[^0-9A-Za-z+=.-]+", "_", label).strip("_")
        path = Path(opts["trace"]) / f"{opts['tag']}_{name}.json"
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
        f"  {label:<28} {ms:8.3f} ms {row['expert_tflops']:6.0f} TF/s  peak {_cell(peak, '.2f', 6)} GiB  held "
        f"{_cell(held, '.2f', 5)} GiB  host issues a step in {row['host_issue_ms']:.2f} ms  (first call {first_s:.1f} s)",
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


def fp8_recipe(spec: str):
    """An --fp8 entry as moe8.Config(fp8=...) takes it: "auto", or "blockwise" / "rowwise" / "tensorwise" with
    "+dgrad" and / or "+wgrad" (those backward GEMMs in FP8 too: bench_layer.recipe_of)."""
    if spec == "auto":
        return spec
    try:
        return recipe_of(spec)
    except ValueError as e:
        raise SystemExit(f"--fp8: {e}") from None


def fp8_row(spec: str):
    """An --fp8 entry, RECIPE or RECIPE@CACHE: (recipe, the Config.fp8_cache of the row; "frozen" by default)."""
    recipe, _, cache = spec.partition("@")
    cache = cache or "frozen"
    if cache not in moe8.fp8.CACHES:
        raise SystemExit(f"--fp8: {spec!r}: the cache after '@' must be one of {list(moe8.fp8.CACHES)}")
    return fp8_recipe(recipe), cache


def peer_list(text: str) -> list:
    """--peers: names from PEERS (any case), comma-separated; "" or "none": none."""
    names = {p.lower(): p for p in PEERS}
    given = [p for p in text.split(",") if p and p.lower() != "none"]
    bad = [p for p in given if p.lower() not in names]
    if bad:
        raise SystemExit(f"--peers: unknown {bad}, expected from {list(PEERS)} or 'none'")
    return [names[p.lower()] for p in given]


def versus_bf16(row: dict, bf16: dict) -> None:
    """An FP8 row against its bf16 row: the speed-up (alone and, where both have it, queued back to back) and
    the relative error of its output and input gradient."""
    row["speedup_vs_bf16"] = bf16["ms"] / row["ms"]
    if "back_to_back_ms" in row and "back_to_back_ms" in bf16:
        row["queued_speedup_vs_bf16"] = bf16["back_to_back_ms"] / row["back_to_back_ms"]
    row["output_rel_error_vs_bf16"] = rel(row["out"], bf16["out"])
    row["grad_x_rel_error_vs_bf16"] = rel(row["dx"], bf16["dx"])


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"


def bench(name, dims, routing, T, configs, fp8, peers, opts) -> dict:
    H, I, E, K = dims
    torch.manual_seed(0)
    block = hf_block(H, I, E, K, device=opts["device"])
    x, dy = block_inputs(block, T, routing)
    most, mean = rows_per_expert(block, x, K)
    print(f"[bench] {name} {routing}: {T} tokens, rows per expert max {most} / mean {mean:.0f}", flush=True)
    flops = 3 * 2 * T * K * (H * 2 * I + I * H)  # fwd + dgrad + wgrad of the two expert GEMMs
    gate, experts = block.gate, block.experts
    params = [x, *block.parameters()]  # every expert weight requires grad: FP8 quantises it in every step
    rows = []
    opts = {**opts, "tag": f"{name}_{routing}"}
    ref = None
    if TRANSFORMERS in peers:
        ref = measure("transformers (grouped_mm)", lambda: block(x.unsqueeze(0))[0], params, dy, flops, opts)
        rows.append(ref)

    def moe8_forward(cfg):
        y, _ = moe8.moe_forward(
            x, gate.weight, experts.gate_up_proj, experts.down_proj, K, "softmax", True, config=cfg
        )
        return y

    for label, cfg in configs:
        bf16 = measure(label, lambda cfg=cfg: moe8_forward(cfg), params, dy, flops, opts)
        rows.append(bf16)
        for spec, (recipe, cache) in fp8:
            fp8_label = f"{label} FP8 {spec}"
            try:
                fcfg = cfg.replace(fp8=recipe, fp8_cache=cache)
                row = measure(fp8_label, lambda fcfg=fcfg: moe8_forward(fcfg), params, dy, flops, opts)
            except Exception as e:  # noqa: BLE001  (one recipe failing is recorded, the other rows are kept)
                print(f"  {fp8_label}: failed: {_why(e)}", flush=True)
                rows.append({"impl": fp8_label, "error": _why(e)})
                continue
            row.update(fp8=spec, fp8_cache=fcfg.fp8_cache, bf16_row=label)
            versus_bf16(row, bf16)
            print(
                f"  {'':<28} {row['speedup_vs_bf16']:.2f}x bf16; vs bf16: output "
                f"{row['output_rel_error_vs_bf16']:.2e}, input gradient {row['grad_x_rel_error_vs_bf16']:.2e}",
                flush=True,
            )
            rows.append(row)
    if SONICMOE in peers:
        why, info = sonicmoe_version()
        if why is None:
            try:
                moe = sonicmoe_block(
                    gate.weight.detach(), experts.gate_up_proj.detach(), experts.down_proj.detach(), K
                )
                p = [x, *moe.parameters()]
                rows.append({**measure(SONICMOE, lambda: moe(x)[0], p, dy, flops, opts), **info})
                del moe
            except Exception as e:  # noqa: BLE001  (a peer failing is recorded, the other rows are kept)
                why = _why(e)
        if why is not None:
            print(f"  {SONICMOE}: not run: {why}", flush=True)
            rows.append({"impl": SONICMOE, "skipped": why})
    for r in rows:
        if ref is not None and "ms" in r:
            r["speedup_vs_transformers"] = ref["ms"] / r["ms"]
            if r is not ref:
                r["output_rel_diff"], r["dx_rel_diff"] = rel(r["out"], ref["out"]), rel(r["dx"], ref["dx"])
    for r in rows:
        r.pop("out", None), r.pop("dx", None)
    shape = {"shape": name, "hidden": H, "intermediate": I, "experts": E, "top_k": K, "tokens": T}
    return {
        **shape,
        "routing": routing,
        "rows_per_expert_max": most,
        "rows_per_expert_mean": mean,
        "rows": rows,
    }


def print_table(results: list) -> None:
    width = max([28] + [len(r["impl"]) for b in results for r in b["rows"]])
    print(
        f"{'shape':<8} {'routing':<9} {'impl':<{width}} {'ms':>8} {'vs HF':>6} {'vs bf16':>7} {'TF/s':>5} "
        f"{'peak GiB':>8} {'held':>6} {'queued ms':>9} {'GPU busy':>8} {'out err':>8} {'dx err':>8}"
    )
    for b in results:
        for r in b["rows"]:
            head = f"{b['shape']:<8} {b['routing']:<9} {r['impl']:<{width}}"
            if "ms" not in r:
                print(f"{head} not run: {(r.get('skipped') or r.get('error'))[:80]}")
                continue
            print(
                f"{head} {r['ms']:>8.3f} {_cell(r.get('speedup_vs_transformers'), '.2f', 6, 'x')} "
                f"{_cell(r.get('speedup_vs_bf16'), '.2f', 7, 'x')} {r['expert_tflops']:>5.0f} "
                f"{_cell(r['peak_extra_gib'], '.2f', 8)} {_cell(r['held_gib'], '.2f', 6)} "
                f"{_cell(r.get('back_to_back_ms'), '.3f', 9)} {_cell(r.get('gpu_busy_ms'), '.3f', 8)} "
                f"{_cell(r.get('output_rel_error_vs_bf16'), '.2e', 8)} "
                f"{_cell(r.get('grad_x_rel_error_vs_bf16'), '.2e', 8)}"
            )


def markdown(meta: dict, results: list) -> str:
    """The run as markdown: what it ran on and how, then one line per row."""
    shapes = "; ".join(
        dict.fromkeys(
            f"{MODEL.get(b['shape'], b['shape'])} (H {b['hidden']}, I {b['intermediate']}, E {b['experts']}, "
            f"k {b['top_k']})"
            for b in results
        )
    )
    queued = (
        f"; queued: {meta['back_to_back']} steps back to back, one synchronisation"
        if meta["back_to_back"]
        else ""
    )
    out = [
        f"# The MoE block, forward + backward ({meta['gpu']})",
        "",
        "| | |",
        "| --- | --- |",
        f"| date | {meta['date']} |",
        f"| commit | `{meta['commit']}` |",
        f"| device | {meta['gpu']}, driver {meta['driver']}, CUDA {meta['cuda']} |",
        f"| versions | torch {meta['torch']}, transformers {meta['transformers']}, CUTLASS {meta['cutlass']}, "
        f"Python {meta['python']}, moe8 {meta['moe8']} |",
        f"| command | `{meta['command']}` |",
        f"| shapes | {meta['tokens']:,} tokens; {shapes}; bf16; softmax top-k renormalised, every row routed by the "
        "same router weights; skewed: each token tilted towards a Zipf(1.2)-drawn expert |",
        f"| timing | median of {meta['iters']} steps after {meta['warmup']} warm-up{'s' * (meta['warmup'] != 1)}, each step forward + backward "
        f"with the gradients None first{queued} |",
        "| memory | peak above what was allocated before the step, every gradient None first (the weight gradients "
        "count); held: what the forward leaves for its backward, its output included |",
        "| host issue | median time for the host to issue one step from an idle GPU (its last call returned, the GPU "
        "not yet done) |",
        "| FP8 rows | the bf16 row's Config with fp8 set (`moe8.Config(fp8=...)`); the expert weights train and are "
        'quantised inside every step (`fp8_cache="frozen"`, or the cache after `@` in the row\'s name; `@both` and '
        "`@one` keep the first step's copies: no optimizer step runs here); vs bf16: "
        "its bf16 row's ms / its ms; errors: "
        "relative Frobenius, output and input gradient vs the bf16 row's |",
    ]
    for r in (r for b in results for r in b["rows"]):
        if r["impl"] == SONICMOE and "commit" in r:
            out.append(f"| peer | SonicMoE at `{r['commit']}` ({r['path']}) |")
            break
    out += [
        "",
        "| shape | routing | rows per expert max / mean | row | ms | vs transformers | vs bf16 (queued) | TFLOP/s "
        "| peak GiB | held GiB | queued ms | host issue ms | FP8 error vs bf16: output / input gradient |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b in results:
        lead = (
            f"| {MODEL.get(b['shape'], b['shape'])} | {b['routing']} | "
            f"{b['rows_per_expert_max']:,} / {b['rows_per_expert_mean']:,.0f} | "
        )
        for r in b["rows"]:
            if "ms" not in r:
                why = (r.get("skipped") or r.get("error")).replace("|", "/")[:160]
                out.append(f"{lead}{r['impl']} | not run: {why} |" + " |" * 8)
                continue
            vs_bf16 = "" if "speedup_vs_bf16" not in r else f"{r['speedup_vs_bf16']:.2f}x"
            if "queued_speedup_vs_bf16" in r:
                vs_bf16 += f" ({r['queued_speedup_vs_bf16']:.2f}x)"
            err = ""
            if "output_rel_error_vs_bf16" in r:
                err = f"{r['output_rel_error_vs_bf16']:.2e} / {r['grad_x_rel_error_vs_bf16']:.2e}"
            cells = [
                r["impl"],
                f"{r['ms']:.3f}",
                _cell(r.get("speedup_vs_transformers"), ".2f", unit="x"),
                vs_bf16,
                f"{r['expert_tflops']:.0f}",
                _cell(r["peak_extra_gib"], ".2f"),
                _cell(r["held_gib"], ".2f"),
                _cell(r.get("back_to_back_ms"), ".3f"),
                _cell(r.get("host_issue_ms"), ".2f"),
                err,
            ]
            out.append(lead + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shapes", default=",".join(BLOCK_SHAPES), help=f"comma-separated, from {sorted(SHAPES)}"
    )
    ap.add_argument("--routing", default=",".join(ROUTINGS), help=f"comma-separated, from {list(ROUTINGS)}")
    ap.add_argument(
        "--tokens", type=int, default=None, help="tokens per block call (default 16384; --tiny 512)"
    )
    ap.add_argument(
        "--moe8",
        default="default",
        help="comma-separated moe8 rows: 'default' or Config fields NAME=0|1 joined by '+' "
        "(e.g. default,keep_permuted=1)",
    )
    ap.add_argument(
        "--fp8",
        default="",
        help="comma-separated FP8 recipes, a row each after every --moe8 row: blockwise, rowwise, tensorwise "
        "(+dgrad / +wgrad: those backward GEMMs in FP8 too, e.g. blockwise+dgrad) or auto, optionally "
        "@CACHE, a Config.fp8_cache (default frozen; e.g. blockwise+dgrad@handoff); the expert weights "
        "train and are quantised in every step; each row's speed-up and output and input-gradient error vs its "
        "bf16 row",
    )
    ap.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"comma-separated peers to run beside moe8, from {','.join(PEERS)} (default: both); 'none': "
        "moe8's rows only",
    )
    ap.add_argument("--tiny", action="store_true", help="one tiny shape (H 256, I 128, 8 experts, top-2), 1 "
                    "warm-up and 2 timed steps: a smoke run, CPU is fine (wall-clock times, no memory columns there)")  # fmt: skip
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print each row's N top kernels")
    ap.add_argument("--trace", default=None, metavar="DIR", help="save a trace of one more step per row in DIR "
                    "and print where the GPU idles")  # fmt: skip
    ap.add_argument("--back-to-back", type=int, default=0, metavar="N", help="also time N steps queued back to "
                    "back per row (one synchronisation at the end)")  # fmt: skip
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--md", default=None, help="write the table as markdown here")
    args = ap.parse_args()
    table = TINY if args.tiny else SHAPES
    shapes = list(TINY) if args.tiny else args.shapes.split(",")
    routings = args.routing.split(",")
    for s in shapes:
        if s not in table:
            raise SystemExit(f"--shapes: unknown shape {s!r}, expected from {sorted(table)}")
    for r in routings:
        if r not in ROUTINGS:
            raise SystemExit(f"--routing: unknown routing {r!r}, expected from {list(ROUTINGS)}")
    configs = [moe8_config(s) for s in args.moe8.split(",") if s]
    fp8 = [(s, fp8_row(s)) for s in args.fp8.split(",") if s]
    peers = peer_list(args.peers)
    if not configs and not peers:
        raise SystemExit("--moe8 and --peers: no rows to run")
    cuda = torch.cuda.is_available() and moe8.cuda_available()
    if not cuda and not args.tiny:
        raise SystemExit(
            "bench_block_peers: needs a CUDA GPU and moe8 built with CUDA (or --tiny for a CPU smoke run)"
        )
    if not cuda and (args.back_to_back or args.trace):
        raise SystemExit("--back-to-back and --trace time the GPU: they need a CUDA GPU")
    device = "cuda" if cuda else "cpu"
    tokens = args.tokens or (512 if args.tiny else 16384)
    warmup, iters = (1, 2) if args.tiny else (3, 10)
    meta = {
        **run_info(device),
        "command": shlex.join(["python", "bench/bench_block_peers.py", *sys.argv[1:]]),
        "tokens": tokens,
        "warmup": warmup,
        "iters": iters,
        "back_to_back": args.back_to_back,
        "moe8_rows": args.moe8,
        "fp8_rows": args.fp8,
        "peers": peers,
    }
    opts = {"device": device, "warmup": warmup, "iters": iters, "profile": args.profile, "trace": args.trace}
    opts["back_to_back"] = args.back_to_back
    results = []
    for s in shapes:
        for r in routings:
            results.append(bench(s, table[s], r, tokens, configs, fp8, peers, opts))
            # after every shape: a later failure keeps what ran
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"meta": meta, "blocks": results}, f, indent=1)
            if args.md:
                Path(args.md).write_text(markdown(meta, results))
            if cuda:
                torch.cuda.empty_cache()
    print(f"\n{meta}")
    print_table(results)


if __name__ == "__main__":
    main()
