"""bench/model_ep_step.py, the model (a prediction) of the 8-GPU expert-parallel step: its arithmetic on a small
synthetic set of result files with hand-checkable numbers, and a run on the real bench/results files."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "model_ep_step.py"

spec = importlib.util.spec_from_file_location("model_ep_step", SCRIPT)
mod = importlib.util.module_from_spec(spec)
sys.modules["model_ep_step"] = mod  # dataclasses look their module up by name
spec.loader.exec_module(mod)

TINY = mod.Arch(
    layers=2, hidden=64, moe_inter=32, experts=8, top_k=2, q_heads=2, kv_heads=1, head_dim=32, vocab=1000
)
PROFILE = {  # ms of a 1-layer slice at 2 x 64 tokens
    "experts": 10.0,
    "dense GEMMs": 2.0,
    "attention": 4.0,
    "LM head + loss": 8.0,
    "optimizer": 7.0,
    "norms/rope/elementwise": 1.0,
    "idle": 3.0,
}


def write_results(folder: Path) -> None:
    """The five result files load_measured reads, in their real layout, with round numbers."""
    row = dict(family="qwen3", impl="moe8", layers=1, params=1_000_000, tokens_per_s=1.0, profile_ms=PROFILE)
    runs = {"vocab_151936": {"meta": {"batch": 2, "seq": 64}, "rows": [dict(row, impl="transformers"), row]}}
    (folder / "step_profile_vocab_8x2048_h200.json").write_text(json.dumps({"runs": runs}))
    gemms = [
        dict(shape="qwen3", routing=r, gemm=g, kind=k, rows=256, moe8_tflops=1.0 if r == "balanced" else 9.0)
        for r in ("balanced", "zipf")
        for g in ("gate_up", "down")
        for k in ("fwd", "dgrad", "wgrad")
    ]
    (folder / "gemm_h200.json").write_text(json.dumps({"gemms": gemms}))
    rows = [
        dict(impl="moe8", ms=9.0, held_gib=0.5),
        dict(impl="moe8 (keep_permuted=1)", ms=9.0, held_gib=1.0),
    ]
    blocks = [dict(shape="qwen3", routing="balanced", tokens=128, rows=rows)]
    (folder / "block_peers_h200.json").write_text(json.dumps({"blocks": blocks}))
    cases = [dict(case="bf16", tflops=1.0, first_call_tflops=2.0), dict(case="fp8_blockwise", tflops=5.0)]
    (folder / "clocks_h200.json").write_text(json.dumps({"cases": cases}))
    check = [dict(model="qwen3", row="moe8", layers=4, tokens_per_s=100.0)]
    (folder / "fp8_step_h200.json").write_text(json.dumps({"rows": check}))


@pytest.fixture
def measured(tmp_path):
    write_results(tmp_path)
    return mod.load_measured(tmp_path)


def test_shapes_by_hand():
    # one dispatch: T x k rows x H x 2 bytes, 7 / 8 of them off the rank
    assert mod.ep_pass_bytes(16384, 8, 2048, 8) == 16384 * 8 * 2048 * 2 * 7 / 8 == 469_762_048
    assert mod.ep_pass_bytes(128, 2, 64, 4) == 128 * 2 * 64 * 2 * 3 / 4 == 24_576
    assert mod.ep_pass_bytes(100, 2, 64, 1) == 0  # one rank: nothing leaves
    # Qwen3-30B-A3B: dense and expert parameters from the architecture
    p, a = mod.dense_params(mod.Arch()), mod.Arch()
    assert p["attention"] == 2048 * 4096 * 2 + 2048 * 512 * 2 == 18_874_368
    assert p["layer"] == 18_874_368 + 2 * 2048 + 2 * 128 + 2048 * 128 == 19_140_864
    assert p["root"] == 2 * 151_936 * 2048 + 2048 == 622_331_904
    assert p["total"] == 48 * 19_140_864 + 622_331_904 == 1_541_093_376
    assert mod.expert_params(a) == 48 * 128 * 3 * 2048 * 768 == 28_991_029_248
    assert p["total"] + mod.expert_params(a) == 30_532_122_624  # the model's 30.5B
    # the same count for the 2-layer slice the step profile measured (its params field)
    two = mod.Arch(layers=2)
    assert mod.dense_params(two)["total"] + mod.expert_params(two) == 1_868_573_184
    # FSDP2 over 4 ranks: 3 / 4 of bf16 all-gathers (all, then the layers again) and an fp32 reduce-scatter
    t = mod.dense_params(TINY)
    assert t["layer"] == 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 64 + 2 * 32 + 64 * 8 == 12_992
    f = mod.fsdp_bytes(TINY, 4)
    assert f["all_gather_forward"] == 0.75 * t["total"] * 2
    assert f["all_gather_backward"] == 0.75 * 2 * 12_992 * 2
    assert f["reduce_scatter"] == 0.75 * t["total"] * 4
    assert f["total"] == f["all_gather_forward"] + f["all_gather_backward"] + f["reduce_scatter"]


def test_overlap_by_hand():
    assert mod.exposed(6.0, 2.0, 1) == 6.0  # one part: nothing hides
    assert mod.exposed(6.0, 2.0, 2) == pytest.approx(5.0)  # link-bound: 6 + 2 / 2 - 2
    assert mod.exposed(1.0, 4.0, 2) == pytest.approx(0.5)  # compute-bound: the first / last half-part shows
    assert mod.exposed(1.0, 4.0, 1000) == pytest.approx(0.001)


def test_synthetic_step_by_hand(measured):
    inp = mod.Inputs(ep=4, batch=1, seq=128, ep_gbs=1e-3, fsdp_gbs=1e-3, checkpointing=False, sync_ms=0.5)
    r = mod.predict(measured, inp, TINY, overlap="none")
    T, lin, derate = 128, 128 / 128, 0.5  # profile 2 x 64 = 128 tokens; clocks 1.0 / 2.0 TFLOP/s
    # the expert GEMMs at 1 TFLOP/s: 3 x (gate_up 2 R H 2I + down 2 R I H) FLOPs, R = T k rows
    flops = 3 * (2 * 256 * 64 * 64 + 2 * 256 * 32 * 64)
    gemm_ms = flops / 1e12 * 1e3
    per = r["per_layer_ms"]
    assert per["expert_gemms"] == pytest.approx(gemm_ms / derate)
    assert per["experts_other"] == pytest.approx((10.0 - gemm_ms) * lin)
    assert per["attention"] == pytest.approx(4.0 * lin * 128 / 64 / derate)  # x S / S0: 2x at twice the seq
    assert per["dense_gemms"] == pytest.approx(2.0 * lin / derate)
    assert per["elementwise"] == pytest.approx(1.0 * lin)
    # 4 passes a layer, none hidden, 1 MB/s: bytes / 1e6 seconds
    dc = r["dispatch_combine"]
    assert dc["bytes_per_pass"] == 24_576 and dc["passes_per_layer"] == 4
    assert r["step_ms"]["dispatch_combine_exposed"] == pytest.approx(2 * 4 * 24_576 / 1e6 * 1e3)
    assert r["step_ms"]["fsdp_exposed"] == pytest.approx(mod.fsdp_bytes(TINY, 4)["total"] / 1e6 * 1e3)
    held = mod.expert_params(TINY) / 4 + mod.dense_params(TINY)["total"] / 4
    assert r["params"]["held_per_rank"] == held
    assert r["step_ms"]["optimizer"] == pytest.approx(7.0 * held / 1e6 * 28 / 14)
    assert r["step_ms"]["lm_head_loss"] == pytest.approx(8.0 * lin / derate)
    assert r["step_ms"]["host_gaps"] == pytest.approx(3.0 + 2 * 0.5)
    assert r["step_ms"]["recompute"] == 0
    assert r["total_ms"] == pytest.approx(sum(r["step_ms"].values()))
    assert r["tokens_per_s_per_gpu"] == pytest.approx(T / (r["total_ms"] / 1e3))
    # checkpointing: each layer's forward again, with its 2 passes
    ck = mod.predict(measured, mod.dataclasses.replace(inp, checkpointing=True), TINY, overlap="none")
    assert ck["dispatch_combine"]["passes_per_layer"] == 6
    assert ck["step_ms"]["recompute"] == pytest.approx(2 * sum(per.values()) / 3)
    assert ck["step_ms"]["dispatch_combine_exposed"] == pytest.approx(
        1.5 * r["step_ms"]["dispatch_combine_exposed"]
    )
    # overlap hides part of the passes, never adds; the backward's too with "both"
    fwd = mod.predict(measured, inp, TINY, overlap="forward")
    both = mod.predict(measured, inp, TINY, overlap="both")
    e = [x["step_ms"]["dispatch_combine_exposed"] for x in (r, fwd, both)]
    assert e[0] > e[1] > e[2] > 0
    experts = per["expert_gemms"] + per["experts_other"]
    one = 2 * 24_576 / 1e6 * 1e3  # a layer's two forward passes, ms
    assert fwd["step_ms"]["dispatch_combine_exposed"] == pytest.approx(
        2 * (mod.exposed(one, experts / 3, 2) + one)
    )
    with pytest.raises(ValueError, match="overlap"):
        mod.predict(measured, inp, TINY, overlap="sometimes")


def test_synthetic_memory_by_hand(measured):
    inp = mod.Inputs(ep=4, batch=1, seq=128, checkpointing=False)
    mem = mod.predict(measured, inp, TINY)["memory"]
    held = mod.expert_params(TINY) / 4 + mod.dense_params(TINY)["total"] / 4
    assert mem["backward_gib"]["states"] == pytest.approx(held * 16 / 2**30)
    assert mem["step_gib"]["states"] == pytest.approx(held * 18 / 2**30)
    attn = 2 * (2 * 64 + 2 * (64 + 2 * 32) + 64) + 4 * 2  # bytes a token, the attention's saved tensors
    layer = (
        attn * 128 + 1.0 * 2**30 * 128 / 128 + 128 * 2 * 64 * 2
    )  # + the kept rows (1 GiB measured) + returns
    assert mem["activations_per_layer_gib"] == pytest.approx(layer / 2**30)
    assert mem["backward_gib"]["activations"] == pytest.approx(2 * layer / 2**30)
    no_master = mod.predict(measured, mod.dataclasses.replace(inp, master=False), TINY)["memory"]
    assert no_master["backward_gib"]["states"] == pytest.approx(held * 12 / 2**30)


def test_real_results(tmp_path):
    out = tmp_path / "model.json"
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("A MODEL, NOT A MEASUREMENT")
    r = json.loads(out.read_text())
    assert "not a measurement" in r["what"]
    for v in r["measured"].values():  # every measured number names a result file that exists
        assert (ROOT / "bench" / "results" / v["source"].split(":")[0]).is_file(), v
    pred = r["prediction"]
    assert pred["tokens_per_rank"] == 4 * 4096
    assert pred["dispatch_combine"]["bytes_per_pass"] == 16384 * 8 * 2048 * 2 * 7 / 8
    assert pred["params"]["dense"] == 1_541_093_376
    assert 1_000 < pred["tokens_per_s_per_gpu"] < 50_000
    gbs = {s["ep_gbs"] for s in r["sweep"]}
    assert {100.0, 150.0, 300.0} <= gbs
    for g in gbs:  # faster links and more overlap never predict a slower step
        tps = [s["tokens_per_s_per_gpu"] for s in r["sweep"] if s["ep_gbs"] == g]
        assert tps == sorted(tps)
    assert 0.8 < r["check_one_gpu"]["ratio"] < 1.2  # the scaling reproduces the measured 4-layer slice
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--batch", "0"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert bad.returncode != 0 and "--batch: expected >= 1" in bad.stderr
