"""Host time of one MoE layer step (forward + backward) with moe8's ops called through the torch.library
dispatcher (MOE8_EAGER_DIRECT=0) vs directly (moe8._core): a tiny layer, so the kernels take next to nothing
and the wall time per step is the Python and dispatch work that a GPU would wait for.

    PYTHONPATH=python python bench/bench_host.py                     # CPU, or the GPU when there is one
    PYTHONPATH=python python bench/bench_host.py --device cpu --json bench/results/eager_direct_cpu.json

Prints microseconds per step (median of --repeats blocks of --steps steps) for each way; each way runs in
a process of its own, since the environment variable is read once, at import.

--counts: what the host issues for one decoder layer of the LoRA fine-tuning of bench_lora_30b.py (its --tiny
Qwen3-30B-A3B: hidden 64, 4 experts, top-2; bf16; r 16 on q,k,v,o and the experts; gradient checkpointing as
that benchmark runs it), over the bf16 base (`moe8`) and over the FP8 base (`moe8_fp8base`: q,k,v,o and the
experts frozen as FP8 blockwise codes, build_fp8_base), on the CPU:

    PYTHONPATH=python python bench/bench_host.py --counts --json bench/results/host_calls_cpu.json

For each variant, in a process of its own: calls into the extension (moe8._C functions, by name), torch.empty
and the rest of its family called from Python (empty*, zeros*, ones*, full*, arange, Tensor.new_*), and the
workspace requests (moe8._core.sm90_workspace, the scratch of the Hopper GEMMs, and the dispatch plan's; the
CPU makes none), per layer: the same step on a model of 2 decoder layers minus the one of 1 layer, so the
embedding, LM head and loss cancel. Counted for a training step (forward, the forward again under checkpointing, backward) and for a
forward under torch.no_grad, with the host's time per layer (wall time, the fastest of --repeats; on the CPU
it includes the layer's arithmetic). Scaled to 48 layers: the 1-layer model's step plus 47 layers. Then the
same counts and the time a call for one LoRA linear layer (q_proj) and the experts on 2 tokens, where the
arithmetic is next to nothing: the host's own work per call."""

from __future__ import annotations

import argparse
import collections
import contextlib
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


# ------------------------------------------------------------------------------------ --counts (LoRA layer)
VARIANTS = ("moe8", "moe8_fp8base")  # bench_lora_30b.py's names: the bf16 base, the FP8 base
ALLOC_FUNCS = ("empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full")
ALLOC_FUNCS += ("full_like", "arange")
ALLOC_METHODS = ("new_empty", "new_zeros", "new_ones", "new_full")


class Counter:
    """Counts, while `on`, calls into moe8's extension, torch allocations made from Python and workspace
    requests (GEMMs, plans), and times the extension's calls while `timing`. install() patches them in this
    process (and is not undone): run it in a process of its own."""

    def __init__(self):
        self.on = self.timing = False
        self.ext, self.alloc = collections.Counter(), collections.Counter()
        self.workspace, self.ext_s = 0, 0.0

    def _count(self, table, name, fn):
        def counted(*args, **kwargs):
            if self.on:
                table[name] += 1
            return fn(*args, **kwargs)

        return counted

    def install(self) -> None:
        counter = self

        def timed(fn):  # the time spent inside the extension, while `timing`
            def call(*args):
                if not counter.timing:
                    return fn(*args)
                t = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    counter.ext_s += time.perf_counter() - t

            return call

        class CountingExt:  # what moe8._core.C reads its functions from
            def __init__(self, ext):
                self._ext = ext

            def __getattr__(self, name):
                fn = getattr(self._ext, name)
                if not callable(fn) or isinstance(fn, type):
                    return fn
                return counter._count(counter.ext, name, timed(fn))

        _core._ext = CountingExt(_core._ext)
        _core.C.__dict__.clear()  # the functions already bound: bound again, counted, at their next call
        for name in ALLOC_FUNCS:
            setattr(torch, name, self._count(self.alloc, "torch." + name, getattr(torch, name)))
        for name in ALLOC_METHODS:
            setattr(
                torch.Tensor, name, self._count(self.alloc, "Tensor." + name, getattr(torch.Tensor, name))
            )
        ws = _core.sm90_workspace

        def workspace(*args, **kwargs):
            if self.on:
                self.workspace += 1
            return ws(*args, **kwargs)

        for mod in list(sys.modules.values()):  # every moe8 module that imported it by name
            if getattr(mod, "__name__", "").startswith("moe8") and getattr(mod, "sm90_workspace", None) is ws:
                mod.sm90_workspace = workspace
        plan = moe8.ops.plan  # on a GPU each plan asks for an int32 workspace too (none on the CPU)

        def counted_plan(*args, **kwargs):
            if self.on:
                self.workspace += 1
            return plan(*args, **kwargs)

        moe8.ops.plan = counted_plan

    @contextlib.contextmanager
    def counting(self):
        self.ext.clear(), self.alloc.clear()
        self.workspace = 0
        self.on = True
        try:
            yield
        finally:
            self.on = False

    def snapshot(self) -> dict:
        return dict(
            ext_calls=sum(self.ext.values()),
            torch_empty=self.alloc["torch.empty"],
            allocs=sum(self.alloc.values()),
            workspace_requests=self.workspace,
            ext=dict(sorted(self.ext.items())),
            alloc=dict(sorted(self.alloc.items())),
        )


def lora_model(variant: str, layers: int):
    """bench_lora_30b.py's --tiny model with `layers` decoder layers, LoRA added as that benchmark adds it
    (moe8.accelerate with its default fusions; the FP8 base built by its build_fp8_base), bf16, on the CPU."""
    import bench_lora_30b as lora_bench  # this folder is on sys.path

    args = argparse.Namespace(tiny=True, layers=layers, seed=0, r=16, alpha=32.0)
    args.moe8_fuse = "router,norm,rope,consume"
    device, dtype = torch.device("cpu"), torch.bfloat16
    if variant == "moe8_fp8base":
        from moe8.lora import freeze_base_fp8

        model = lora_bench.build_fp8_base(args, device, dtype)[0]
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = lora_bench.add_moe8(model, args, fp8="blockwise")
        freeze_base_fp8(model)
    else:
        model = lora_bench.build(args, device, dtype)[0]
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = lora_bench.add_moe8(model, args)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(dtype)
    return model


def _measure(model, ids, counter: Counter, repeats: int) -> dict:
    """Counts and host time of a training step and of a no_grad forward of `model` on `ids`."""

    def train():
        for p in model.parameters():
            p.grad = None
        model(input_ids=ids, labels=ids).loss.backward()

    def infer():
        with torch.no_grad():
            model(input_ids=ids, labels=ids)

    out = {}
    for name, fn in (("train", train), ("no_grad", infer)):
        fn(), fn()  # warm: the FP8 copies, the caches
        with counter.counting():
            fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[name] = dict(counter.snapshot(), us=1e6 * min(times))
    return out


def _per_call(model, counter: Counter, repeats: int, calls: int = 300) -> dict:
    """Counts and host time (us a call over blocks of `calls`) of one LoRA linear layer (layer 0's
    q_proj) and of the experts module on 2 tokens, where the GEMMs take next to nothing: forward under no_grad,
    and forward + backward. Times: the fastest of `repeats` blocks (the least disturbed by other work), and of
    that the part spent inside the extension's calls (its CPU kernels; timed in one more block) and the rest,
    the host's own work (host_us)."""
    layer = model.model.layers[0]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, layer.self_attn.q_proj.in_features, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, layer.mlp.experts.num_experts, (2, 2), generator=gen)
    w = torch.rand(2, 2, generator=gen).to(torch.bfloat16)
    xg = x.clone().requires_grad_()
    q, experts = layer.self_attn.q_proj, layer.mlp.experts

    def q_no_grad():
        with torch.no_grad():
            q(x)

    def q_train():
        q(xg).sum().backward()

    def experts_no_grad():
        with torch.no_grad():
            experts(x, ids, w)

    def experts_train():
        experts(xg, ids, w).sum().backward()

    out = {}
    cases = (("q_proj", q_no_grad), ("q_proj_train", q_train), ("experts", experts_no_grad))
    for name, fn in (*cases, ("experts_train", experts_train)):
        for _ in range(20):
            fn()
        with counter.counting():
            fn()
        blocks = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            blocks.append(1e6 * (time.perf_counter() - t) / calls)
        counter.timing, counter.ext_s = True, 0.0  # then the time spent inside the extension's calls
        for _ in range(calls):
            fn()
        counter.timing = False
        ext_us = 1e6 * counter.ext_s / calls
        out[name] = dict(counter.snapshot(), us=min(blocks), ext_us=ext_us, host_us=min(blocks) - ext_us)
    return out


def count_variant(variant: str, repeats: int, batch: int = 2, seq: int = 64) -> dict:
    """Per-layer counts and host time of `variant` (a child process's work: the counter is installed here)."""
    counter = Counter()
    counter.install()
    ids = torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(1))
    by_layers = {layers: _measure(lora_model(variant, layers), ids, counter, repeats) for layers in (1, 2)}
    per_call = _per_call(lora_model(variant, 1), counter, repeats)
    result = {}
    for name in ("train", "no_grad"):
        one, two = by_layers[1][name], by_layers[2][name]
        layer = {
            k: two[k] - one[k] for k in ("ext_calls", "torch_empty", "allocs", "workspace_requests", "us")
        }
        for table in ("ext", "alloc"):
            keys = set(one[table]) | set(two[table])
            diff = {k: two[table].get(k, 0) - one[table].get(k, 0) for k in sorted(keys)}
            layer[table] = {k: v for k, v in diff.items() if v}
        layer["us_per_ext_call"] = layer["us"] / max(layer["ext_calls"], 1)
        step48 = {
            k: one[k] + 47 * layer[k] for k in ("ext_calls", "torch_empty", "allocs", "workspace_requests")
        }
        result[name] = dict(per_layer=layer, model_1_layer=one, model_2_layers=two, step_48_layers=step48)
    result["per_call"] = per_call
    return result


def run_counts(args) -> int:
    if args.variant is not None:  # a child: this variant only
        print(json.dumps(count_variant(args.variant, args.repeats)))
        return 0
    results = {}
    for v in VARIANTS:
        cmd = [sys.executable, __file__, "--counts", "--variant", v, "--repeats", str(args.repeats)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if p.returncode != 0:
            raise SystemExit(f"--counts {v} failed:\n{p.stdout}{p.stderr}")
        results[v] = json.loads(p.stdout.strip().splitlines()[-1])
    meta = dict(
        **run_info("cpu"),
        model="bench_lora_30b.py --tiny (hidden 64, 4 experts, top-2, r 16), bf16, batch 2 x 64",
        method="per layer: a 2-layer model's counts minus a 1-layer model's; 48 layers: 1-layer step + 47 layers",
        repeats=args.repeats,
    )
    print(meta)
    print(
        f"{'variant':<14} {'pass':<8} {'ext calls':>9} {'torch.empty':>11} {'allocs':>7} {'workspaces':>10} "
        f"{'us':>8} {'us/call':>8}  | 48 layers: {'ext calls':>9} {'torch.empty':>11} {'allocs':>7}"
    )
    for v, r in results.items():
        for name in ("train", "no_grad"):
            layer, step = r[name]["per_layer"], r[name]["step_48_layers"]
            print(
                f"{v:<14} {name:<8} {layer['ext_calls']:>9} {layer['torch_empty']:>11} {layer['allocs']:>7} "
                f"{layer['workspace_requests']:>10} {layer['us']:>8.0f} {layer['us_per_ext_call']:>8.1f}  | "
                f"{'':>11}{step['ext_calls']:>9} {step['torch_empty']:>11} {step['allocs']:>7}"
            )
    print(
        f"\n{'variant':<14} {'call (2 tokens)':<16} {'ext calls':>9} {'torch.empty':>11} {'allocs':>7} {'us':>8}"
        f" {'in ext':>8} {'host':>8}"
    )
    for v, r in results.items():
        for name, c in r["per_call"].items():
            print(
                f"{v:<14} {name:<16} {c['ext_calls']:>9} {c['torch_empty']:>11} {c['allocs']:>7} {c['us']:>8.1f}"
                f" {c['ext_us']:>8.1f} {c['host_us']:>8.1f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when moe8 can use it)")
    ap.add_argument("--steps", type=int, default=200, help="steps per timed block (default 200)")
    ap.add_argument("--repeats", type=int, default=5, help="timed blocks per way (default 5)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--way", choices=("direct", "dispatcher"), default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--counts",
        action="store_true",
        help="count the extension calls and allocations of a LoRA decoder layer, bf16 and FP8 base (CPU)",
    )
    ap.add_argument("--variant", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 1 or args.repeats < 1:
        raise SystemExit(f"--steps, --repeats: expected >= 1, got {args.steps}, {args.repeats}")
    if args.counts:
        return run_counts(args)
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
