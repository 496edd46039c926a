"""The benchmark scripts run end to end in their CPU smoke modes, so a broken script is found here and not
in scarce GPU time: bench_gemm.py --tiny, bench_lowrank.py --tiny, bench_lora_30b.py --tiny,
bench_fp8_refresh.py --tiny, bench_step_profile.py --tiny, bench_loss_parity.py --tiny, bench_block_peers.py
--tiny, finetune_compare.py; and the argument checks and pieces of scripts that cannot run here (ncu_gemm.py,
bench_clocks.py, bench_hf_train.py, scripts/carry_prebuilt.sh, bench_block_peers.py at its real shapes)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import moe8

ROOT = Path(__file__).resolve().parents[2]
ENV_PATH = str(Path(moe8.__file__).resolve().parents[1])  # the moe8 this test runs (installed or checkout)


def run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ENV_PATH, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def gemm_rows(out, args: str):
    """bench_gemm.py run with args (a string) writing its JSON to out: (the process, its rows)."""
    p = run("bench/bench_gemm.py", *args.split(), "--json", out)
    assert p.returncode == 0, p.stdout + p.stderr
    return p, json.loads(out.read_text())["gemms"]


def test_bench_gemm_bounds_tiny(tmp_path):
    """--bounds: each bf16 GEMM beside one dense GEMM of its FLOPs and, balanced, the batched GEMM of its groups."""
    out = tmp_path / "gemm.json"
    p, rows = gemm_rows(out, "--tiny --kinds fwd,dgrad,wgrad,fp8_fwd --iters 2 --warmup 0 --bounds")
    for r in rows:
        if r["kind"] == "fp8_fwd":
            assert "bounds_ms" not in r
            continue
        want = {"dense", "batched"} if r["routing"] == "balanced" else {"dense"}
        if r["kind"] == "wgrad" and r["rows"] % r["experts"]:
            want = set()
        assert set(r.get("bounds_ms", {})) == want, r
        assert all(ms > 0 for ms in r.get("bounds_ms", {}).values())
    assert "fwd moe8 / batched GEMM of the same FLOPs" in p.stdout
    assert "wgrad moe8 / dense GEMM of the same FLOPs" in p.stdout
    # --experts: the same rows and FLOPs over other expert counts (1: one dense GEMM through moe8's kernel)
    _, rows = gemm_rows(out, "--tiny --kinds fwd --routing balanced --iters 1 --experts 1,4")
    assert sorted({r["experts"] for r in rows}) == [1, 4] and len({r["rows"] for r in rows}) == 1
    bad = run("bench/bench_gemm.py", "--tiny", "--experts", "0")
    assert bad.returncode != 0 and "--experts: expected counts in 1..512, got [0]" in bad.stderr
    # --prepared: each GEMM with every descriptor rewritten by CUTLASS, made once per call or ragged (bf16: D, A and
    # B; FP8: D)
    _, rows = gemm_rows(out, "--tiny --kinds fwd,dgrad,wgrad,fp8_fwd --routing balanced --iters 1 --prepared")
    assert {r["kind"] for r in rows if "prepared_ms" in r} == {"fwd", "dgrad", "wgrad", "fp8_fwd"}
    bf16 = {"none", "D, A, B", "D acquired at the store, A, B", "D, A, B ragged", "D prepared, A, B ragged"}
    fp8 = {"none", "D", "D acquired at the store", "D ragged"}
    for r in rows:
        assert set(r["prepared_ms"]) == (fp8 if r["kind"].startswith("fp8") else bf16), r
    # --routing uniform: each token's experts drawn uniformly, the rows per expert rounded to 16 with the total kept
    _, rows = gemm_rows(out, "--tiny --kinds fwd --routing uniform --iters 1 --bounds")
    assert rows and all(r["routing"] == "uniform" and set(r["bounds_ms"]) == {"dense"} for r in rows)


def test_uniform_routing_counts():
    import torch

    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    from bench_gemm import counts_for

    gen = torch.Generator().manual_seed(0)
    for rows, experts, k in ((131072, 128, 8), (32768, 8, 2), (1000, 7, 3)):
        c = counts_for("uniform", rows, experts, 1.0, gen, k)
        assert int(c.sum()) == rows and len(c) == experts
        assert bool((c[1:] % 16 == 0).all())
    c = counts_for("uniform", 131072, 128, 1.0, gen, 8)
    assert 0.85 * 1024 < int(c.min()) <= int(c.max()) < 1.15 * 1024  # ragged by a few percent, not skewed


def test_bench_gemm_tiny(tmp_path):
    out = tmp_path / "gemm.json"
    p = run("bench/bench_gemm.py", "--tiny", "--iters", "1", "--warmup", "0", "--json", out)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["gemms"]
    kinds = {(r["routing"], r["gemm"], r["kind"]) for r in rows}
    assert len(kinds) == 2 * 2 * 5  # balanced/zipf x gate_up/down x fwd/dgrad/wgrad/fp8_fwd/fp8_wgrad
    assert all(r["moe8_ms"] > 0 for r in rows)
    bad = run("bench/bench_gemm.py", "--tiny", "--kinds", "fwd,nope")
    assert bad.returncode != 0 and "--kinds: unknown ['nope']" in bad.stderr
    # --tiles: each bf16 GEMM also timed with each forced tile (round-robin with moe8 and torch)
    p = run(
        *"bench/bench_gemm.py --tiny --kinds fwd,fp8_fwd --routing balanced --iters 2".split(),
        "--tiles",
        "large,pong128",
        "--fp8-tiles",
        "m2",
        "--json",
        out,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["gemms"]
    assert all(set(r["tiles_ms"]) == {"large", "pong128"} for r in rows if r["kind"] == "fwd")
    assert all(set(r["tiles_ms"]) == {"m2"} for r in rows if r["kind"] == "fp8_fwd")
    assert "best forced tile / torch" in p.stdout
    # --schedules: every GEMM also timed under each tile-scheduler order, with the total per kind
    p = run(
        *"bench/bench_gemm.py --tiny --kinds fwd,fp8_wgrad --routing zipf --iters 2 --schedules n8,m2".split(),
        "--json",
        out,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["gemms"]
    assert rows and all(set(r["schedules_ms"]) == {"n8", "m2"} for r in rows)
    assert "fp8_wgrad schedules, total time / default's (2 GEMMs): n8" in p.stdout
    bad = run("bench/bench_gemm.py", "--tiny", "--schedules", "n3")
    assert bad.returncode != 0 and "--schedules: unknown ['n3']" in bad.stderr
    # --fp8-promotions: the FP8 GEMMs also timed with each consumer promotion; the bf16 ones are not
    p = run(
        *"bench/bench_gemm.py --tiny --kinds fwd,fp8_fwd,fp8_wgrad --routing balanced --iters 2".split(),
        "--fp8-promotions",
        "serial,overlap",
        "--json",
        out,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["gemms"]
    fp8_rows = [r for r in rows if r["kind"].startswith("fp8_")]
    assert len(fp8_rows) == 4 and all(set(r["promotions_ms"]) == {"serial", "overlap"} for r in fp8_rows)
    assert all(ms > 0 for r in fp8_rows for ms in r["promotions_ms"].values())
    assert all("promotions_ms" not in r for r in rows if r["kind"] == "fwd")
    assert "promotions ms: serial" in p.stdout
    bad = run("bench/bench_gemm.py", "--tiny", "--fp8-promotions", "eager")
    assert bad.returncode != 0 and "--fp8-promotions: unknown ['eager']" in bad.stderr
    # --quant-cols: beside each FP8 weight gradient, its operands' column quantisation with each kernel
    p = run(
        *"bench/bench_gemm.py --tiny --kinds fwd,fp8_wgrad --routing balanced --iters 2".split(),
        "--quant-cols",
        "packed,staged",
        "--json",
        out,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["gemms"]
    wgrad_rows = [r for r in rows if r["kind"] == "fp8_wgrad"]
    assert len(wgrad_rows) == 2 and all(set(r["quant_cols_ms"]) == {"packed", "staged"} for r in wgrad_rows)
    assert all(g > 0 for r in wgrad_rows for g in r["quant_cols_gbps"].values())
    assert all("quant_cols_ms" not in r for r in rows if r["kind"] == "fwd")
    assert "column quantisation ms: packed" in p.stdout
    bad = run("bench/bench_gemm.py", "--tiny", "--quant-cols", "fast")
    assert bad.returncode != 0 and "--quant-cols: unknown ['fast']" in bad.stderr


def test_bench_fp8_refresh_tiny(tmp_path):
    out = tmp_path / "refresh.json"
    p = run("bench/bench_fp8_refresh.py", "--tiny", "--iters", "1", "--json", out)
    assert p.returncode == 0, p.stdout + p.stderr
    (row,) = json.loads(out.read_text())["rows"]
    forms = ("forward_only", "two_passes", "one_pass", "cache")
    assert row["weights"] == 3 * row["E"] * row["H"] * row["I"]
    assert all(row[f"{f}_ms"] > 0 for f in forms), row
    bad = run("bench/bench_fp8_refresh.py", "--shapes", "qwen3,nope")
    assert bad.returncode != 0 and "--shapes: unknown 'nope'" in bad.stderr


def test_bench_lowrank_tiny(tmp_path):
    out = tmp_path / "lowrank.json"
    p = run("bench/bench_lowrank.py", "--tiny", "--ranks", "4,16", "--iters", "1", "--json", out)
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(out.read_text())
    rows = got["results"]
    assert [(r["proj"], r["rank"]) for r in rows] == [
        ("gate_up", 4),
        ("down", 4),
        ("gate_up", 16),
        ("down", 16),
    ]
    # float32 on the CPU; bfloat16 on a GPU, where the fused add rounds once and the unfused reference's
    # GEMM term is rounded to bf16 before its add: two bf16 roundings (2^-8 each) of the largest value
    tol = 1e-5 if got["env"]["dtype"] == "float32" else 2**-6
    assert all(r["fused_vs_unfused_max_rel_err"] < tol and r["ms"]["add fused"] > 0 for r in rows), rows
    bad = run("bench/bench_lowrank.py", "--tiny", "--ranks", "x")
    assert bad.returncode != 0 and "--ranks: expected comma-separated integers" in bad.stderr


def test_bench_rmsnorm_tiny(tmp_path):
    out = tmp_path / "rmsnorm.json"
    p = run("bench/bench_rmsnorm.py", "--tiny", "--dtype", "float32", "--iters", "1", "--json", out)
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(out.read_text())
    rows = got["results"]
    assert got["env"]["dtype"] == "float32"
    assert [(r["shape"], r["pass"]) for r in rows[:2]] == [
        ("hidden [64, 256]", "forward"),
        ("hidden [64, 256]", "backward"),
    ]
    assert len(rows) == 6 and all(r["torch_ms"] > 0 and r["moe8_ms"] > 0 and r["moe8_GBps"] > 0 for r in rows)
    # y, dx, dw against torch's in float32, and dw the same bits on a second run
    assert all(max(r["moe8_max_rel_err"]) < 1e-5 for r in rows[::2]), rows
    assert all(r["moe8_dw_same_bits"] for r in rows[1::2])
    assert p.stdout.strip().splitlines()[-7].split()[:4] == [
        "shape",
        "pass",
        "torch",
        "ms",
    ]  # the table comes last


def test_bench_optim_tiny(tmp_path):
    out = tmp_path / "optim.json"
    p = run("bench/bench_optim.py", "--tiny", "--iters", "1", "--json", out)
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(out.read_text())
    (r,) = got["results"]
    assert r["model"] == "tiny" and r["tensors"] == 21 and r["params"] > 0
    assert all(r[f"{i}_ms"] > 0 for i in ("torch_fused", "torch_foreach", "moe8", "copy"))
    # on the CPU moe8.optim.AdamW steps with torch's AdamW: the same bits
    assert r["max_abs_diff_vs_torch_fused"] == 0 and r["tensors_same_bits_as_torch_fused"] == "21 of 21"
    assert p.stdout.strip().splitlines()[-2].split()[:3] == [
        "model",
        "params",
        "torch_fused",
    ]  # the table last
    bad = run("bench/bench_optim.py", "--models", "mixtral,gpt5")
    assert bad.returncode != 0 and "--models: expected names from" in bad.stderr and "'gpt5'" in bad.stderr


@pytest.mark.slow
def test_bench_lora_30b_tiny(tmp_path):
    pytest.importorskip("peft", minversion="0.17")
    out = tmp_path / "lora.json"
    p = run(  # the FP8-base variants: test_bench_fp8.py
        "bench/bench_lora_30b.py", "--tiny", "--steps", "1", "--warmup", "1", "--adapter-dtype", "bfloat16",
        "--peft-adapter-dtype", "float32", "--profile", "3", "--variants", "peft,moe8", "--json", out,
    )  # fmt: skip
    res = json.loads(out.read_text())
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    v = res["variants"]
    assert v["peft"]["adapter_dtypes"] == ["float32"] and v["moe8"]["adapter_dtypes"] == ["bfloat16"]
    assert res["same_base_weights"] and res["same_trainable"]
    assert len(v["moe8"]["profile_top"]) == 3 and v["moe8"]["loss"].startswith("moe8.loss")
    assert "profile:" in p.stdout


def test_finetune_compare(tmp_path):
    for run_name, tps in (("lora-moe8", 200.0), ("lora-no-moe8", 100.0)):
        d = tmp_path / run_name
        d.mkdir()
        lines = [dict(step=0, eval_loss=3.0)]
        lines += [
            dict(step=s, loss=3.0 - s / 10, tokens_per_s=tps, mfu=None, memory_gib=1.5) for s in (5, 10)
        ]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    p = run("bench/finetune_compare.py", tmp_path, "--json", tmp_path / "c.json")
    assert p.returncode == 1  # the full runs are missing, and it says so
    assert "| full-moe8 | - | - | - | - | missing | - |" in p.stdout
    res = json.loads((tmp_path / "c.json").read_text())
    assert res["moe8_over_transformers"]["lora"]["tokens_per_s"] == pytest.approx(2.0)


def test_gpu_gaps_of_a_trace(tmp_path):
    """bench/profiling.py: the GPU's idle intervals in a Chrome trace and the CPU ops running meanwhile,
    through its command line."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "moe8::plan", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 50, "dur": 30},
        {"ph": "X", "cat": "cpu_op", "name": "moe8::permute", "ts": 90, "dur": 40},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 120, "dur": 80},
        {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 190, "dur": 60},
        {"ph": "i", "cat": "marker", "name": "ignored", "ts": 10},
    ]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from profiling import gpu_gaps
    finally:
        sys.path.pop(0)
    g = gpu_gaps(json.loads(trace.read_text()))
    assert (g["span_us"], g["busy_us"], g["idle_us"]) == (250.0, 160.0, 90.0)
    assert [(x["at_us"], x["idle_us"]) for x in g["gaps"]] == [(0.0, 50.0), (80.0, 40.0)]
    assert g["gaps"][0]["cpu_ops"] == ["moe8::plan"]
    assert g["gaps"][1]["cpu_ops"] == ["moe8::plan", "moe8::permute"]
    # each interval's idle time goes to the op covering most of it: permute covers 30 of (80, 120), plan 20
    assert [(x["cpu_op"], x["idle_us"]) for x in g["idle_by_op"]] == [
        ("moe8::plan", 50.0),
        ("moe8::permute", 40.0),
    ]
    assert [(x["name"], x["calls"], x["us"]) for x in g["kernels"]] == [
        ("k2", 1, 80.0),
        ("copy", 1, 60.0),
        ("k1", 1, 30.0),
    ]
    p = run("bench/profiling.py", trace, "--top", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "idle 0.09 ms" in p.stdout and "50.0 us idle during ['moe8::plan']" in p.stdout


def test_host_profile_counts_functions_and_collections():
    """bench/profiling.py host_profile: one step under cProfile, its functions by own time, the garbage
    collections timed by generation."""
    import gc

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from profiling import host_profile
    finally:
        sys.path.pop(0)

    def busy():
        total = 0
        for i in range(20000):
            total += i * i
        return total

    def step():
        busy()
        gc.collect(0)  # one collection of generation 0 at least

    res = host_profile(step, 5)
    assert res["wall_s"] > 0 and len(res["top"]) <= 5
    assert any("busy" in name for name, *_ in res["top"])
    assert res["gc"][0][0] >= 1 and res["gc"][0][1] >= 0.0


def _classify(events, vocab=(1001, 1024)):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from profiling import classify_trace
    finally:
        sys.path.pop(0)
    return classify_trace({"traceEvents": events}, vocab)


def test_classify_trace_attributes_kernels():
    """bench/profiling.py classify_trace on a hand-made GPU trace: kernels reach their category through the
    CPU op that launched them (record_function regions, autograd sequence numbers for the backward, vocabulary
    dims for the LM head, torch's optimizer range); idle is the span minus the kernels' union."""
    ev = []

    def x(cat, name, ts, dur, tid=1, **args):
        ev.append(
            {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}
        )

    def launch(corr, ts, kernel, kts, kdur, tid=1):
        x("cuda_runtime", "cudaLaunchKernel", ts, 1, tid, correlation=corr)
        ev.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": kernel,
                "ts": kts,
                "dur": kdur,
                "pid": 1,
                "tid": 7,
                "args": {"correlation": corr},
            }
        )

    x("user_annotation", "step.experts", 0, 100)
    x("cpu_op", "moe8::experts_forward", 1, 90, **{"Sequence number": 7})
    launch(1, 2, "grouped_gemm_sm90_kernel", 10, 20)
    x("user_annotation", "step.attention", 100, 100)
    x("cpu_op", "aten::linear", 101, 10, **{"Sequence number": 8})
    x("cpu_op", "aten::addmm", 102, 5)
    launch(2, 103, "sm90_xmma_gemm_bf16", 105, 10)
    x("cpu_op", "aten::_scaled_dot_product_flash_attention", 120, 10)
    launch(3, 121, "flash_fwd_kernel", 125, 15)
    x("cpu_op", "moe8::rope", 135, 5)
    launch(4, 136, "rope_kernel", 145, 5)
    x("cpu_op", "aten::mm", 210, 10, **{"Input Dims": [[8, 64], [64, 1001]]})
    launch(5, 211, "gemm_align1", 215, 40)
    x("cpu_op", "aten::embedding_dense_backward", 230, 5, **{"Input Dims": [[8, 64], [8], [], [1001]]})
    launch(6, 231, "embedding_backward_kernel", 260, 3)
    x(
        "cpu_op",
        "autograd::engine::evaluate_function: ExpertsBackward",
        300,
        20,
        tid=2,
        **{"Sequence number": 7},
    )
    x("cpu_op", "ExpertsBackward", 301, 18, tid=2, **{"Sequence number": 7})
    launch(7, 302, "wgrad_kernel", 305, 25, tid=2)
    x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 335, 10, tid=2, **{"Sequence number": 99})
    x("cpu_op", "aten::mm", 336, 8, tid=2)
    launch(8, 337, "nvjet_gemm", 345, 8, tid=2)
    x(
        "cpu_op",
        "autograd::engine::evaluate_function: CombineBackward",
        350,
        5,
        tid=2,
        **{"Sequence number": 5},
    )
    launch(10, 351, "void moe8::cuda::(anonymous namespace)::combine_rows_kernel<float>", 355, 2, tid=2)
    x("user_annotation", "Optimizer.step#AdamW.step", 400, 30)
    x("cpu_op", "aten::_fused_adamw_", 401, 20)
    launch(9, 402, "multi_tensor_apply_kernel", 420, 30)
    got = _classify(ev)
    want = {
        "experts": 0.047,
        "dense GEMMs": 0.018,
        "attention": 0.015,
        "LM head + loss": 0.040,
        "optimizer": 0.030,
        "norms/rope/elementwise": 0.008,
    }
    for k, v in want.items():
        assert got[k] == pytest.approx(v), (k, got)
    assert got["span"] == pytest.approx(0.45) and got["busy"] == pytest.approx(0.158)
    assert got["idle"] == pytest.approx(0.45 - 0.158)
    assert _classify(ev, vocab=(4096,))["LM head + loss"] == 0  # another vocabulary: a dense GEMM then
    assert _classify(ev, vocab=(4096,))["dense GEMMs"] == pytest.approx(0.058)


def test_classify_trace_liger_kernels():
    """Liger Kernel's Triton kernels (launched through the driver, from Python autograd.Functions) in
    classify_trace: its fused MoE's backward kernels are experts without a region, its fused linear
    cross-entropy is the LM head and loss, its RMSNorm backward elementwise."""
    ev = []

    def op(cat, name, ts, dur, tid=1, **args):
        ev.append(
            {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}
        )

    def launch(corr, ts, kernel, kts, kdur, tid=1):
        op("cuda_driver", "cuLaunchKernelEx", ts, 1, tid, correlation=corr)
        ev.append({"ph": "X", "cat": "kernel", "name": kernel, "ts": kts, "dur": kdur, "pid": 1, "tid": 7})
        ev[-1]["args"] = {"correlation": corr}

    op("user_annotation", "step.experts", 0, 50)
    launch(1, 1, "_fused_up_proj_swiglu_kernel", 5, 20)  # forward: the experts region says so
    launch(2, 60, "_liger_cross_entropy_kernel", 60, 10)  # forward of the fused linear cross-entropy
    op("cpu_op", "autograd::engine::evaluate_function: LigerFusedMoEFunctionBackward", 100, 50, tid=2)
    launch(3, 101, "_moe_bwd_dW1_kernel", 110, 30, tid=2)
    launch(4, 102, "_token_gather_weighted_sum_kernel", 141, 4, tid=2)
    op("cpu_op", "autograd::engine::evaluate_function: LigerRMSNormFunctionBackward", 160, 10, tid=2)
    launch(5, 161, "_rms_norm_backward_kernel", 162, 6, tid=2)
    got = _classify(ev)
    assert got["experts"] == pytest.approx(0.054), got
    assert got["LM head + loss"] == pytest.approx(0.010), got
    assert got["norms/rope/elementwise"] == pytest.approx(0.006), got
    assert got["dense GEMMs"] == 0 and got["attention"] == 0


def test_bench_step_profile_tiny(tmp_path):
    """bench_step_profile.py --tiny on CPU: both columns of two families (Qwen2-MoE: a shared expert;
    DeepSeek-V3: MLA, a dense first layer), an odd vocabulary, fusions changed by --fusions; every category in
    the JSON, the table last; the peer rows (transformers + Liger, transformers' sonicmoe and deepgemm experts)
    each with a status and its reason, the Liger rows run after every other; bad flags fail naming the flag."""
    args = ("bench/bench_step_profile.py", "--tiny", "--steps", "1", "--warmup", "0", "--out", tmp_path)
    fams = ("qwen2_moe", "deepseek_v3")
    p = run(
        *args,
        "--families",
        ",".join(fams),
        "--vocab",
        "517",
        "--fusions",
        "fuse_norm=0,fuse_mlp=1",
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((tmp_path / "step_profile_cpu.json").read_text())
    assert data["meta"]["tiny"] and data["meta"]["commit"] and data["meta"]["vocab"] == 517
    assert data["meta"]["peers"] == ["deepgemm", "liger", "sonicmoe"]
    impls = (
        "transformers",
        "moe8",
        "transformers (sonicmoe)",
        "transformers (deepgemm)",
        "transformers + Liger",
    )
    assert [(r["family"], r["impl"]) for r in data["rows"]] == [(f, i) for f in fams for i in impls]
    rows = [r for r in data["rows"] if r["status"] == "ran"]
    assert [(r["family"], r["impl"]) for r in rows] == [(f, i) for f in fams for i in impls[:2]]
    cats = ("experts", "dense GEMMs", "attention", "LM head + loss", "optimizer", "norms/rope/elementwise")
    for r in rows:
        prof = r["profile_ms"]
        assert all(prof[c] >= 0 for c in cats) and prof["idle"] >= 0
        assert prof["experts"] > 0 and prof["LM head + loss"] > 0 and prof["optimizer"] > 0
        assert sum(prof[c] for c in cats) == pytest.approx(prof["busy"], rel=1e-3)  # trace times: ~1e15 us
        assert r["step_ms"] > 0 and len(r["losses"]) == 1 and r["vocab"] == 517
        assert all(x["cpu_op"] and x["idle_us"] >= 0 for x in r["idle_by_op"])  # a CPU trace: maybe none
    for hf_row, m8 in zip(rows[0::2], rows[1::2]):
        assert hf_row["speedup_vs_transformers"] == 1.0
        assert m8["speedup_vs_transformers"] == pytest.approx(hf_row["step_ms"] / m8["step_ms"])
        assert m8["config"]["fuse_mlp"] and m8["config"]["fuse_loss"] and not m8["config"]["fuse_norm"]
        assert m8["first_loss_rel_diff"] < 1e-3  # same weights and batch: moe8 changes rounding only
        assert hf_row["optimizer"] == "torch.optim.adamw.AdamW" and m8["optimizer"] == "moe8.optim.AdamW"
    assert rows[0]["config"] is None
    # peers that cannot run here: skipped, with the exception of the real call and why
    skipped = [r for r in data["rows"] if r["status"] != "ran"]
    assert all(r["status"] == "skipped" and r["reason"] for r in skipped)
    for r in skipped:
        if r["impl"] != "transformers + Liger":  # the toy model's first step raised: recorded as such
            assert r["error"] and r["error"] in r["reason"] and r["why"] in r["reason"]
            assert "Hugging Face Hub" in r["why"]
    liger = {r["family"]: r for r in skipped if r["impl"] == "transformers + Liger"}
    if importlib.util.find_spec("liger_kernel") is None:
        assert all("liger-kernel is not installed" in r["reason"] for r in liger.values())
    else:  # no Liger function for Qwen2-MoE; DeepSeek-V3's applies, but its Triton kernels need a GPU
        assert "changed nothing" in liger["qwen2_moe"]["reason"]
        assert "need a CUDA GPU" in liger["deepseek_v3"]["reason"]
        assert liger["deepseek_v3"]["liger"]["function"] == "apply_liger_kernel_to_deepseek_v3"
        assert {"fused_linear_cross_entropy", "rms_norm", "swiglu"} <= set(
            liger["deepseek_v3"]["liger"]["kernels"]
        )
    last_plain = max(r["run_order"] for r in data["rows"] if r["impl"] in impls[:4])
    assert min(r["run_order"] for r in liger.values()) > last_plain  # Liger's module-global patches come last
    out = p.stdout.rstrip().splitlines()
    assert any(line.startswith("transformers + Liger not run (skipped) for qwen2_moe") for line in out)
    assert out[-1].startswith("deepseek_v3: moe8")
    bad = run(*args, "--fusions", "fuse_everything=1")
    assert bad.returncode != 0 and "--fusions: expected" in bad.stderr
    bad = run(*args, "--peers", "liger,unsloth")
    assert bad.returncode != 0 and "--peers: unknown ['unsloth']" in bad.stderr


def test_bench_host_runs(tmp_path):
    out = tmp_path / "host.json"
    p = run("bench/bench_host.py", "--device", "cpu", "--steps", "3", "--repeats", "2", "--json", out)
    assert p.returncode == 0, p.stdout + p.stderr
    v = json.loads(out.read_text())
    assert set(v["us_per_step"]) == {"dispatcher", "direct"} and all(x > 0 for x in v["us_per_step"].values())
    assert "direct / dispatcher" in p.stdout
    bad = run("bench/bench_host.py", "--device", "tpu")
    assert bad.returncode != 0 and "--device: expected cpu or cuda, got 'tpu'" in bad.stderr


def test_fp8_accuracy_runs(tmp_path):
    out = tmp_path / "acc.json"
    p = run(
        "bench/fp8_accuracy.py", "--tokens", "16", "--hidden", "256", "--intermediate", "128", "--json", out
    )
    assert p.returncode == 0, p.stdout + p.stderr
    v = json.loads(out.read_text())
    for r in ("blockwise", "rowwise", "tensorwise"):
        assert 0 < v[r]["output"] < 0.2 and 0 < v[r]["grad_x"] < 0.2
    floor = v["e4m3_floor"]  # one e4m3 GEMM: ~2.5% per operand, in quadrature
    assert 0.02 < floor["one_gemm_both_operands"] < 0.06
    assert 0.01 < floor["one_gemm_activations_only"] < floor["one_gemm_both_operands"]
    bad = run("bench/fp8_accuracy.py", "--experts", "2", "--top-k", "3")
    assert bad.returncode != 0 and "--top-k <= --experts" in bad.stderr


def test_ncu_gemm_arguments():
    p = run("bench/ncu_gemm.py", "--help")
    assert p.returncode == 0 and all(c in p.stdout for c in ("fp8_mixtral", "dgrad_qwen3", "quant_deepseek"))
    bad = run("bench/ncu_gemm.py", "nope")
    assert bad.returncode != 0 and "invalid choice: 'nope'" in bad.stderr


def test_bench_hf_train_arguments():
    p = run("bench/bench_hf_train.py", "--help")
    assert p.returncode == 0 and "--fp8 RECIPE" in p.stdout
    bad = run("bench/bench_hf_train.py", "--fp8", "blockwise+fast")
    assert bad.returncode != 0 and "--fp8: unknown suffix ['fast']" in bad.stderr
    bad = run("bench/bench_hf_train.py", "--accum", "0")
    assert bad.returncode != 0 and "--accum: expected >= 1, got 0" in bad.stderr
    bad = run("bench/bench_hf_train.py", "--profile", "-1")
    assert bad.returncode != 0 and "--profile: expected >= 0, got -1" in bad.stderr


def test_bench_clocks_arguments():
    p = run("bench/bench_clocks.py", "--help")
    assert p.returncode == 0 and "fp8_blockwise" in p.stdout
    bad = run("bench/bench_clocks.py", "--cases", "fp8_blockwise,nope")
    assert bad.returncode != 0 and "--cases: unknown ['nope']" in bad.stderr
    bad = run("bench/bench_clocks.py", "--seconds", "0")
    assert bad.returncode != 0 and "--seconds: expected > 0, got 0.0" in bad.stderr
    assert "bf16_batched" in p.stdout and "qwen3" in p.stdout
    bad = run("bench/bench_clocks.py", "--shape", "olmo")
    assert bad.returncode != 0 and "--shape: invalid choice: 'olmo'" in bad.stderr


def test_carry_prebuilt_arguments():
    """scripts/carry_prebuilt.sh (prepares .carry/ for a GPU machine): --help says what it does, and it refuses
    arguments without touching anything."""
    help_ = subprocess.run(
        ["bash", "scripts/carry_prebuilt.sh", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert help_.returncode == 0 and "py312.tgz" in help_.stdout and "PY312" in help_.stdout
    bad = subprocess.run(
        ["bash", "scripts/carry_prebuilt.sh", "now"], capture_output=True, text=True, cwd=ROOT
    )
    assert bad.returncode == 2 and "takes no arguments (got: now)" in bad.stderr


def test_bench_loss_parity_tiny(tmp_path):
    """bench_loss_parity.py --tiny on CPU for Qwen3-MoE (an aux loss) and DeepSeek-V3 (MLA, a dense first layer,
    no aux loss): both sides from the same initial weights on the same text, transformers' grouped_mm against
    moe8 with its fused loss. In fp32 the curves agree to 1e-5 relative at every step: measured at most 9e-7 in
    all six families over 8 steps in which the loss falls by ~0.4 (fp32 rounding, ~6e-8 an op, grown by the
    updates); a wrong kernel, a dropped aux loss (0.001 x ~2 of ~6.6: 3e-4) or different batches exceed it."""
    from moe8.finetune.data import shared

    if shared("tokenizers", "qwen3", "tokenizer.json") is None or shared("text", "sentences.txt") is None:
        pytest.skip("the shared corpus and Qwen3 tokenizer are absent (MOE8_SHARED_DATA)")
    pytest.importorskip("transformers", minversion="5.0", reason="the script builds transformers models")
    fams = ["qwen3", "deepseek_v3"]
    p = run("bench/bench_loss_parity.py", "--tiny", "--families", ",".join(fams), "--out", tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads((tmp_path / "loss_parity_cpu.json").read_text())
    assert data["tiny"] and data["commit"] and data["steps"] == 8 and data["dtype"] == "float32"
    assert data["vocab_size"] == 1001 and data["id_mapping"] == "ids % 1001"
    assert [r["family"] for r in data["families"]] == fams
    for r in data["families"]:
        ref, m8 = r["transformers"], r["moe8"]
        assert r["same_initial_weights"] and ref["experts"] == "grouped_mm" and m8["experts"] == "moe8"
        assert m8["logits_none"] and not ref["logits_none"]  # the fused loss ran on moe8's side only
        assert r["moe8_config"]["fuse_loss"] == "True" and r["moe8_config"]["fuse_router"] == "True"
        for side in (ref, m8):
            assert len(side["loss"]) == len(side["ce"]) == 8 and side["finite"] and side["tokens_per_s"] > 0
        # the aux loss reads the router logits, which moe8's fused router still returns
        assert m8["aux_coef"] == ref["aux_coef"] and m8["aux_loss"] == pytest.approx(
            ref["aux_loss"], rel=1e-5
        )
        assert sum(ref["ce"][-3:]) / 3 < ref["ce"][0] - 0.1  # it trained: the curves compared move
        for key in ("ce", "loss"):
            assert r[key]["max_step_rel_gap"] < 1e-5 and r[key]["last_rel_gap"] < 1e-5, r[key]
        assert r["verdict"] == "PASS" and r["last_steps"] == 8
    qwen3, deepseek = data["families"]
    assert qwen3["moe8"]["aux_coef"] == 0.001
    assert min(qwen3["moe8"]["aux_loss"]) > 1.0  # ~top_k (2) when balanced: a real aux loss, not zeros
    assert deepseek["transformers"]["aux_coef"] == 0.0
    assert "2 of 2 families within 1 %" in p.stdout and "verdict" in p.stdout
    missing = run("bench/bench_loss_parity.py", "--tiny", "--data-dir", tmp_path / "none", "--out", tmp_path)
    assert missing.returncode == 2 and str(tmp_path / "none") in missing.stderr
    bad = run("bench/bench_loss_parity.py", "--tiny", "--families", "qwen3,nope", "--out", tmp_path)
    assert bad.returncode != 0 and "--families: unknown ['nope']" in bad.stderr


def test_bench_loss_parity_verdict():
    """The verdict: either gap (cross-entropy or total) over the target fails, both below it pass; a non-finite
    side fails."""
    spec = importlib.util.spec_from_file_location(
        "bench_loss_parity", ROOT / "bench" / "bench_loss_parity.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ref = dict(ce=[10.0] * 5 + [5.0] * 10, loss=[10.0] * 5 + [5.0] * 10, finite=True)
    near = dict(ce=[10.0] * 5 + [5.04] * 10, loss=[10.0] * 5 + [5.04] * 10, finite=True)
    got = mod.compare(ref, near, 0.01)
    assert got["verdict"] == "PASS" and got["ce"]["last_rel_gap"] == pytest.approx(0.008)
    assert got["ce"]["first_step_rel_gap"] == 0 and got["last_steps"] == 10
    far = dict(near, ce=[10.0] * 5 + [5.06] * 10)  # the cross-entropy 1.2 % off, the total 0.8 %
    assert mod.compare(ref, far, 0.01)["verdict"] == "FAIL"
    assert mod.compare(ref, dict(near, finite=False), 0.01)["verdict"] == "FAIL"
    spike = dict(near, ce=near["ce"][:-1] + [6.0])
    assert mod.compare(ref, spike, 0.5)["ce"]["max_step_rel_gap"] == pytest.approx(0.2)


def test_bench_loss_parity_nudge_is_one_ulp():
    """--control's perturbation: every nonzero floating-point value moves to a neighbouring representable value
    (one ulp, up or down, both directions used), zeros and integer tensors stay, the original is untouched."""
    import torch

    spec = importlib.util.spec_from_file_location(
        "bench_loss_parity", ROOT / "bench" / "bench_loss_parity.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    w = torch.randn(64, 32).to(torch.bfloat16)
    w[0] = 0
    state = dict(w=w, f=torch.randn(100), ids=torch.arange(5))
    before = {k: v.clone() for k, v in state.items()}
    out = mod.nudged(state, 0)
    assert all(torch.equal(state[k], before[k]) for k in state)
    assert torch.equal(out["ids"], state["ids"]) and torch.equal(out["w"][0], w[0])
    for key, ints in (("w", torch.int16), ("f", torch.int32)):
        a, b = state[key], out[key]
        nz = a != 0
        step = b.view(ints).long() - a.view(ints).long()
        # bit patterns one apart: neighbouring values (same sign), nothing representable between them
        assert set(step[nz].unique().tolist()) == {-1, 1} and bool((b[nz] != a[nz]).all())
        assert bool((torch.sign(b[nz]) == torch.sign(a[nz])).all())


def _bench_module(name):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_bench_block_peers_pieces():
    """bench_block_peers.py needs a GPU; its routing, its --moe8 rows and its peer's absence are checked here:
    the skewed inputs give one expert several times the mean rows (same router for every row), the Config rows
    parse or fail naming --moe8, a SonicMoE that is not importable is a recorded reason, not an exception, and
    the script itself refuses to run without a GPU by name."""
    import torch

    b = _bench_module("bench_block_peers")
    peers = _bench_module("peers")
    block = b.hf_block(64, 32, 16, 2, device="cpu", dtype=torch.float32)
    x, dy = b.block_inputs(block, 2048, "balanced")
    most_balanced, mean = b.rows_per_expert(block, x, 2)
    xs, _ = b.block_inputs(block, 2048, "skewed")
    most_skewed, mean_skewed = b.rows_per_expert(block, xs, 2)
    assert mean == mean_skewed == 2048 * 2 / 16
    assert most_skewed > 2 * mean and most_skewed > most_balanced
    assert xs.requires_grad and xs.grad_fn is None and dy.shape == x.shape
    assert b.moe8_config("default") == ("moe8", moe8.Config())
    label, cfg = b.moe8_config("keep_permuted=1+gather_in_gemm=1")
    assert cfg.keep_permuted and cfg.gather_in_gemm and label == "moe8 (keep_permuted=1+gather_in_gemm=1)"
    for bad in ("keep_permuted=yes", "no_such_field=1"):
        with pytest.raises(SystemExit, match="--moe8"):
            b.moe8_config(bad)
    if importlib.util.find_spec("sonicmoe") is None:
        why, info = peers.sonicmoe_version()
        assert "sonicmoe is not importable" in why and info == {}
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists():  # a folder inside a checkout is not one: its commit is not the package's
        assert len(peers._git_commit(root)) == 40 and peers._git_commit(root / "bench") is None
    assert b.fp8_recipe("auto") == "auto"
    assert b.fp8_recipe("blockwise+dgrad") == moe8.fp8.Float8Recipe("blockwise", dgrad="fp8")
    for bad in ("blockwise+nope", "nope"):
        with pytest.raises(SystemExit, match="--fp8"):
            b.fp8_recipe(bad)
    assert b.fp8_row("blockwise+dgrad@handoff") == (b.fp8_recipe("blockwise+dgrad"), "handoff")
    assert b.fp8_row("blockwise") == (b.fp8_recipe("blockwise"), "frozen")
    with pytest.raises(SystemExit, match="--fp8: 'blockwise@all'"):
        b.fp8_row("blockwise@all")
    assert b.peer_list("none") == b.peer_list("") == []
    assert b.peer_list("sonicmoe,transformers") == [peers.SONICMOE, "transformers"]
    with pytest.raises(SystemExit, match="--peers: unknown"):
        b.peer_list("transformers,liger")
    help_text = " ".join(run("bench/bench_block_peers.py", "--help").stdout.split())
    assert all(
        flag in help_text for flag in ("--fp8", "--peers", "--tiny", "--md", "'none': moe8's rows only")
    )
    if not moe8.cuda_available():
        p = run("bench/bench_block_peers.py", "--shapes", "qwen3")
        assert p.returncode != 0 and "needs a CUDA GPU" in p.stderr
        p = run("bench/bench_block_peers.py", "--tiny", "--back-to-back", "2")
        assert p.returncode != 0 and "need a CUDA GPU" in p.stderr


def test_bench_block_peers_tiny(tmp_path):
    """--tiny runs the block bench end to end (on the CPU here). --peers none: moe8's bf16 row, then one FP8 row
    per recipe, its weights trained and quantised in the step (fp8_cache "frozen"), its speed-up over the bf16
    row and its output's and input gradient's error against it: nonzero (the FP8 GEMMs ran) and below e4m3's
    order (~6e-2 here), the same output with and without FP8 dgrad but a different input gradient; the same in
    the markdown. With the peers: transformers' row is the reference of every row's speed-up and difference, and
    a SonicMoE that is not importable is a row that says why."""
    out, md = tmp_path / "block.json", tmp_path / "block.md"
    fp8 = ("blockwise", "blockwise+dgrad", "blockwise+dgrad@handoff")
    p = run(*"bench/bench_block_peers.py --tiny --routing skewed --peers none --fp8".split(), ",".join(fp8),
            "--json", out, "--md", md)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    (block,) = json.loads(out.read_text())["blocks"]
    rows = {r["impl"]: r for r in block["rows"]}
    assert list(rows) == ["moe8", *(f"moe8 FP8 {s}" for s in fp8)]
    bf16, table = rows["moe8"], md.read_text()
    assert "speedup_vs_bf16" not in bf16 and "speedup_vs_transformers" not in bf16
    for spec in fp8:
        r = rows[f"moe8 FP8 {spec}"]
        assert r["fp8"] == spec and r["fp8_cache"] == (spec.partition("@")[2] or "frozen")
        assert r["bf16_row"] == "moe8"
        assert r["speedup_vs_bf16"] == pytest.approx(bf16["ms"] / r["ms"])
        assert 1e-3 < r["output_rel_error_vs_bf16"] < 0.15 and 1e-3 < r["grad_x_rel_error_vs_bf16"] < 0.15
        line = next(x for x in table.splitlines() if f"| moe8 FP8 {spec} |" in x)
        assert f"| {r['speedup_vs_bf16']:.2f}x |" in line and f"{r['grad_x_rel_error_vs_bf16']:.2e} |" in line
    plain, dgrad, handoff = (rows[f"moe8 FP8 {s}"] for s in fp8)
    assert plain["output_rel_error_vs_bf16"] == pytest.approx(dgrad["output_rel_error_vs_bf16"], rel=1e-6)
    assert plain["grad_x_rel_error_vs_bf16"] != pytest.approx(dgrad["grad_x_rel_error_vs_bf16"], rel=1e-3)
    for key in ("output_rel_error_vs_bf16", "grad_x_rel_error_vs_bf16"):  # the same bits as frozen's
        assert handoff[key] == dgrad[key]
    header = next(x for x in p.stdout.splitlines() if x.startswith("shape "))  # the table, printed last
    assert "vs bf16" in header and "out err" in header and "dx err" in header

    p = run(*"bench/bench_block_peers.py --tiny --routing balanced --fp8 blockwise --json".split(), out)
    assert p.returncode == 0, p.stdout + p.stderr
    (block,) = json.loads(out.read_text())["blocks"]
    rows = {r["impl"]: r for r in block["rows"]}
    assert list(rows)[:3] == ["transformers (grouped_mm)", "moe8", "moe8 FP8 blockwise"]
    assert all(rows[k]["speedup_vs_transformers"] > 0 for k in list(rows)[:3])
    assert rows["moe8"]["output_rel_diff"] < 1e-2 and rows["moe8"]["dx_rel_diff"] < 1e-2
    if importlib.util.find_spec("sonicmoe") is None:
        assert "sonicmoe is not importable" in rows[_bench_module("peers").SONICMOE]["skipped"]


def test_run_info_records_moe8_commit_when_set(monkeypatch):
    """A tree copied to a GPU machine records the commit it was copied from (MOE8_COMMIT), not the machine's
    git state; unset, the checkout's own commit."""
    spec = importlib.util.spec_from_file_location("run_info", ROOT / "bench" / "run_info.py")
    run_info = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_info)
    monkeypatch.setenv("MOE8_COMMIT", "0123abc+changes")
    assert run_info.commit() == "0123abc+changes"
    monkeypatch.delenv("MOE8_COMMIT")
    assert run_info.commit() != "0123abc+changes"


def test_bench_loss_tiny(tmp_path):
    out = tmp_path / "loss.json"
    p = run("bench/bench_loss.py", "--tiny", "--iters", "1", "--profile", "3", "--json", out)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["results"]
    assert [r["shape"] for r in rows] == ["tiny", "tiny-odd"]
    for r in rows:  # float32 on the CPU: the fused loss is the unfused one up to summation order
        assert (
            r["moe8_loss_rel_diff"] < 1e-5 and r["moe8_dh_rel_err"] < 1e-5 and r["moe8_dw_rel_err"] < 1e-5
        ), r
        assert r["moe8_ms"] > 0 and r["unfused_ms"] > 0 and len(r["moe8_top_kernels"]) == 3
    bad = run("bench/bench_loss.py", "--shapes", "qwen3,nope")
    assert bad.returncode == 2 and "--shapes: unknown ['nope']" in bad.stderr
