"""The FP8 benchmarks in their CPU smoke modes: bench_fp8_step.py --tiny (every row of the HF training-step
table, the torchao row skipped with its reason) and bench_lora_30b.py --tiny with the FP8-base variants; and the
module filter of the torchao row, which must convert exactly the dense layers (by name) of each family."""

import importlib
import json
import sys

import pytest
from test_bench import ROOT, run

sys.path.insert(0, str(ROOT / "bench"))


def _tiny_models():
    """(family, config overrides, names of the layers torchao should convert) for 2-layer toy models: Qwen3-MoE
    with a dense MLP in layer 0, Mixtral, Qwen2-MoE with shared experts (and their nn.Linear gate)."""
    attn = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]
    mlp = ["gate_proj", "up_proj", "down_proj"]
    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    return [
        (
            "qwen3_moe",
            dict(small, head_dim=16, moe_intermediate_size=32, intermediate_size=128, num_experts=4,
                 num_experts_per_tok=2, mlp_only_layers=[0]),
            attn + [f"model.layers.0.mlp.{p}" for p in mlp],
        ),
        ("mixtral", dict(small, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2), attn),
        (
            "qwen2_moe",
            dict(small, moe_intermediate_size=32, shared_expert_intermediate_size=64, intermediate_size=128,
                 num_experts=4, num_experts_per_tok=2),
            attn + [f"model.layers.{i}.mlp.shared_expert.{p}" for i in range(2) for p in mlp],
        ),
    ]  # fmt: skip


@pytest.mark.parametrize("family,over,expected", _tiny_models(), ids=[m[0] for m in _tiny_models()])
def test_torchao_filter_converts_the_dense_layers(family, over, expected):
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install --no-deps torchao)")
    transformers = pytest.importorskip("transformers", minversion="5.0")
    import torch

    step = importlib.import_module("bench_fp8_step")
    cfg = transformers.AutoConfig.for_model(family, num_hidden_layers=2, **over)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    linear = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert set(expected) < linear and "lm_head" in linear  # what is left out exists
    converted = step.convert_torchao(model)
    assert sorted(converted) == sorted(expected)
    from torchao.float8.float8_linear import Float8Linear

    assert type(model.lm_head) is torch.nn.Linear and not isinstance(model.lm_head, Float8Linear)


def test_torchao_filter_rules():
    import torch

    step = importlib.import_module("bench_fp8_step")
    lin = torch.nn.Linear(64, 64)
    assert step.dense_filter(lin, "model.layers.3.self_attn.q_proj")
    assert step.dense_filter(lin, "model.layers.3.mlp.shared_expert.down_proj")
    for name in (
        "lm_head",
        "model.layers.3.mlp.gate",
        "model.layers.3.mlp.shared_expert_gate",
        "model.embed",
    ):
        assert not step.dense_filter(lin, name), name
    assert not step.dense_filter(
        torch.nn.Linear(64, 24), "model.layers.0.self_attn.k_proj"
    )  # _scaled_mm: 16s
    assert not step.dense_filter(torch.nn.Embedding(8, 64), "model.layers.0.self_attn.q_proj")


@pytest.mark.slow
def test_bench_fp8_step_tiny(tmp_path):
    pytest.importorskip("transformers", minversion="5.0")
    p = run(
        "bench/bench_fp8_step.py", "--tiny", "--steps", "1", "--warmup", "0", "--out", tmp_path, timeout=120
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads((tmp_path / "fp8_step.json").read_text())
    rows = {(r["model"], r["row"]): r for r in res["rows"]}
    for model in ("qwen3", "mixtral"):
        hf = rows[model, "transformers"]
        ao = rows[model, "torchao"]
        if "skipped" in ao:  # no GPU, or no torchao: why is recorded
            assert "torchao" in ao["skipped"] and "tokens_per_s" not in ao
        for row in ("moe8", "moe8_fp8", "moe8_fp8_dense", "moe8_auto"):
            r = rows[model, row]
            assert r["tokens_per_s"] > 0 and r["speedup_vs_transformers"] > 0 and "error" not in r, r
            # same weights and batch: bf16 rows agree closely, FP8 rows within FP8's error but not exactly
            assert abs(r["first_loss"] - hf["first_loss"]) < (1e-3 if row in ("moe8", "moe8_auto") else 2e-2)
        assert rows[model, "moe8"]["speedup_vs_moe8"] == pytest.approx(1.0)
        assert rows[model, "moe8_fp8"]["first_loss"] != rows[model, "moe8"]["first_loss"]  # FP8 really ran
        assert len(rows[model, "moe8_fp8_dense"]["fp8_dense_layers"]) == 8  # 2 layers x q,k,v,o
        assert rows[model, "moe8_fp8"]["fp8_dense_layers"] == []
        # toy shapes are far below fp8_pays' cut: "auto" keeps every GEMM in bf16
        assert rows[model, "moe8_auto"]["first_loss"] == pytest.approx(
            rows[model, "moe8"]["first_loss"], abs=1e-6
        )
    assert "torchao" in p.stdout and "vs moe8" in p.stdout


def test_bench_fp8_step_arguments(tmp_path):
    bad = run("bench/bench_fp8_step.py", "--tiny", "--rows", "moe8,nope", "--out", tmp_path)
    assert bad.returncode != 0 and "--rows: unknown ['nope']" in bad.stderr
    bad = run("bench/bench_fp8_step.py", "--tiny", "--fp8", "blockwise+fast", "--out", tmp_path)
    assert bad.returncode != 0 and "--fp8: unknown suffix ['fast']" in bad.stderr


@pytest.mark.slow
def test_bench_lora_30b_fp8_base_tiny(tmp_path):
    pytest.importorskip("transformers", minversion="5.0")
    out = tmp_path / "lora.json"
    p = run(
        "bench/bench_lora_30b.py", "--tiny", "--steps", "1", "--warmup", "1", "--adapter-dtype", "bfloat16",
        "--variants", "moe8,moe8_fp8base,moe8_fp8experts", "--json", out, timeout=150,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())
    v = res["variants"]
    m8, f8, e8 = v["moe8"], v["moe8_fp8base"], v["moe8_fp8experts"]
    assert res["same_base_weights"] and res["same_trainable"]  # bitwise the bf16 variant's weights
    assert f8["frozen_at_load"] == 2 * 6 and f8["frozen_after_lora"] == 0  # 2 layers x (q,k,v,o + 2 experts)
    assert e8["frozen_at_load"] == 2 * 2 and "frozen_after_lora" not in e8
    assert f8["adapter_dtypes"] == ["bfloat16"] and f8["experts_implementation"] == "moe8"
    # fp32 on the CPU: an FP8 value takes a quarter of the bytes (plus scales); the attention adds to the saving
    assert f8["base_bytes"] < e8["base_bytes"] < m8["base_bytes"]
    for r in (f8, e8):
        assert len(r["losses"]) == 2 and all(abs(x - y) < 2e-2 for x, y in zip(r["losses"], m8["losses"]))
        assert r["losses"][0] != m8["losses"][0]  # the base GEMMs really ran in FP8
    assert 0 < res["fp8base_step0_loss_diff"] < 2e-2
    assert "moe8_fp8base / moe8 tokens/s" in p.stdout


def test_fp8_base_is_quantised_a_layer_at_a_time(monkeypatch):
    """bench_lora_30b.build_fp8_base: when layer i is quantised, the earlier layers' targets are FP8 already
    and the later layers are not yet materialised, so at most one layer is held in bf16; the weights are
    build()'s, bitwise."""
    pytest.importorskip("transformers", minversion="5.0")
    import argparse

    import torch

    from moe8 import fp8
    from moe8.fp8 import frozen_fp8

    lora30 = importlib.import_module("bench_lora_30b")
    args = argparse.Namespace(tiny=True, layers=3, seed=0)
    seen = []
    freeze = lora30._freeze_layer

    def watch(layer, attention=True):
        model_layers = layer_list[0]
        i = next(j for j, m in enumerate(model_layers) if m is layer)
        experts = [m.mlp.experts for m in model_layers]
        state = [
            "fp8" if frozen_fp8(e.gate_up_proj) is not None else "meta" if e.gate_up_proj.is_meta else "real"
            for e in experts
        ]
        seen.append((i, state))
        return freeze(layer, attention)

    import transformers

    layer_list = []  # the decoder layers of the model being built
    orig_from_config = transformers.AutoModelForCausalLM.from_config

    def from_config(*a, **k):
        model = orig_from_config(*a, **k)
        layer_list.append(model.model.layers)
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", from_config)
    monkeypatch.setattr(lora30, "_freeze_layer", watch)
    model, total, fingerprint, n = lora30.build_fp8_base(args, torch.device("cpu"), torch.float32)
    monkeypatch.undo()
    assert seen == [
        (0, ["real", "meta", "meta"]),
        (1, ["fp8", "real", "meta"]),
        (2, ["fp8", "fp8", "real"]),
    ]
    assert n == 3 * 6
    ref, ref_total, ref_fingerprint = lora30.build(args, torch.device("cpu"), torch.float32)
    assert (total, fingerprint) == (ref_total, ref_fingerprint)
    # the frozen copies hold build()'s weights: dequantised, within e4m3's rounding of them
    f = frozen_fp8(model.model.layers[1].mlp.experts.down_proj)
    d = fp8.dequantize(f.value.q, f.value.scale, 128, 128, torch.float32)
    w = ref.model.layers[1].mlp.experts.down_proj.detach()
    assert ((d - w).norm() / w.norm()).item() < 0.05
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert torch.equal(
        model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq
    )  # made again on the device
