"""moe8.lora: expert LoRA through the grouped GEMM against weights with B·A folded in (the layer, and whole
tiny models of every family against transformers' own implementation), no gradient (no wgrad) for frozen
weights, apply_lora, save/load round trip, PEFT loading moe8's adapters and moe8 loading PEFT's, training."""

import json

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="moe8.lora needs transformers>=5")

from test_hf import build, rel, tokens, twin  # noqa: E402

from moe8 import hf, layer, ops  # noqa: E402
from moe8 import lora as lora_mod  # noqa: E402
from moe8 import reference as ref  # noqa: E402
from moe8.lora import LoraLinear, apply_lora, load_adapter, save_adapter  # noqa: E402

TOL = 1e-5
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")  # DeepSeek-V3 attention


def targets(family):
    return (*(MLA if family == "deepseek_v3" else ATTN), "experts")


@pytest.fixture(autouse=True)
def _restore():
    yield
    hf.disable()


# ------------------------------------------------------------------------------------------- the layer
def delta(A, B, kn):
    return A @ B if kn else B @ A  # [E, K, N] or [E, N, K], the layout of the base weight


CASES = [  # T, H, I, E, K, r, layout, activation, interleaved, bias
    (37, 20, 13, 6, 2, 4, "nk", "swiglu", False, False),
    (1, 16, 8, 4, 1, 3, "nk", "swiglu", False, False),  # one token: most experts get no rows
    (29, 18, 10, 5, 2, 2, "kn", "swiglu_clamped", True, True),  # GPT-OSS
    (16, 12, 7, 4, 2, 5, "nk", "gelu", False, False),  # ungated
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-r{c[5]}-{c[6]}-{c[7]}")
def test_experts_lora_matches_merged_weights(case):
    T, H, I, E, K, r, layout, act, inter, bias = case
    torch.manual_seed(T + r)
    kn, W = layout == "kn", 2 * I if act.startswith("swiglu") else I
    x = torch.randn(T, H, requires_grad=True)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    weights = torch.rand(T, K, requires_grad=True)
    gu = torch.randn((E, H, W) if kn else (E, W, H)) * H**-0.5  # frozen
    dn = torch.randn((E, I, H) if kn else (E, H, I)) * I**-0.5
    gb, db = (torch.randn(E, W) * 0.1, torch.randn(E, H) * 0.1) if bias else (None, None)
    lora = [
        torch.randn(s).mul_(0.3).requires_grad_()
        for s in (
            ((E, H, r), (E, r, W), (E, I, r), (E, r, H))
            if kn
            else ((E, r, H), (E, W, r), (E, r, I), (E, H, r))
        )
    ]
    s = 1.7
    kw = dict(layout=layout, activation=act, interleaved=inter, gate_up_bias=gb, down_bias=db)
    y = layer.experts_forward(x, ids, weights, gu, dn, lora=layer.ExpertLoRA(*lora, s), **kw)
    y_ref = ref.experts_forward(
        x, ids, weights, gu + s * delta(*lora[:2], kn), dn + s * delta(*lora[2:], kn), **kw
    )
    assert rel(y, y_ref) < TOL
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, weights, *lora], dy)
    grads_ref = torch.autograd.grad(y_ref, [x, weights, *lora], dy)
    for name, g, g_ref in zip(
        ["x", "weights", "gate_up_A", "gate_up_B", "down_A", "down_B"], grads, grads_ref
    ):
        assert rel(g, g_ref) < TOL, name


@pytest.mark.parametrize("base_trainable", [False, True])
def test_frozen_base_weights_skip_wgrad(monkeypatch, base_trainable):
    """Each grouped GEMM computes its weight gradient only when that weight requires grad: 4 wgrads for the
    LoRA factors with frozen experts, 6 with trainable ones."""
    wgrads = []
    inner = ops.grouped_gemm_wgrad
    monkeypatch.setattr(ops, "grouped_gemm_wgrad", lambda *a: wgrads.append(a[1].shape) or inner(*a))
    E, H, I, r = 4, 16, 8, 2
    gu = torch.randn(E, 2 * I, H, requires_grad=base_trainable)
    dn = torch.randn(E, H, I, requires_grad=base_trainable)
    lora = [torch.randn(s, requires_grad=True) for s in ((E, r, H), (E, 2 * I, r), (E, r, I), (E, H, r))]
    x = torch.randn(10, H)
    ids = torch.randint(0, E, (10, 2))
    y = layer.experts_forward(x, ids, torch.rand(10, 2), gu, dn, lora=layer.ExpertLoRA(*lora, 2.0))
    y.square().sum().backward()
    assert len(wgrads) == (6 if base_trainable else 4)
    assert all(p.grad is not None for p in lora)
    assert (gu.grad is not None) == base_trainable and (dn.grad is not None) == base_trainable


def test_experts_lora_bad_shapes():
    E, H, I = 4, 16, 8
    gu, dn = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    bad = layer.ExpertLoRA(
        torch.randn(E, 2, H), torch.randn(E, 2 * I, 3), torch.randn(E, 2, I), torch.randn(E, H, 2), 1.0
    )
    x, ids = torch.randn(3, H), torch.randint(0, E, (3, 2))
    with pytest.raises(ValueError, match="lora.gate_up_A, lora.gate_up_B: expected shapes"):
        layer.experts_forward(x, ids, torch.rand(3, 2), gu, dn, lora=bad)


# ------------------------------------------------------------------------------------------ HF models
def lora_model(family, r=4, seed=0, dtype=None):
    """(plain HF model, the same weights with random moe8 LoRA: every B nonzero; dtype: apply_lora's)."""
    plain = build(family, seed)
    model = apply_lora(twin(plain, accelerate=False), r=r, alpha=2 * r, targets=targets(family), dtype=dtype)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return plain, model


def merged(model):
    """Leaf copies of the LoRA parameters, and the LoRA'd weights with W + s·B·A folded in from them."""
    leaves = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters() if p.requires_grad}
    weights = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLinear):
            weights[f"{name}.weight"] = (
                m.weight + m.scaling * leaves[f"{name}.lora_B"] @ leaves[f"{name}.lora_A"]
            )
        elif hasattr(m, "gate_up_lora_A"):
            for w in ("gate_up", "down"):
                d = delta(leaves[f"{name}.{w}_lora_A"], leaves[f"{name}.{w}_lora_B"], m.is_transposed)
                weights[f"{name}.{w}_proj"] = getattr(m, f"{w}_proj") + m.lora_scaling * d
    return leaves, weights


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_lora_model_matches_merged_transformers(family):
    """Logits, loss and every LoRA gradient equal those of transformers' own model (its experts
    implementation, no moe8) with W + s·B·A folded into each weight; frozen weights get no gradient. apply_lora
    accelerates with moe8.Config()'s defaults, every fusion on: the training forward has no logits (fused
    loss), a forward without grad has transformers'."""
    plain, model = lora_model(family)
    assert hf.is_accelerated(model) and not hf.is_accelerated(plain)
    ids = tokens()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    leaves, weights = merged(model)
    out_ref = torch.func.functional_call(plain, weights, (), dict(input_ids=ids, labels=ids))
    grads_ref = dict(zip(leaves, torch.autograd.grad(out_ref.loss, list(leaves.values()))))
    assert hf.config_of(model).fuse_loss and out.logits is None and rel(out.loss, out_ref.loss) < TOL
    assert rel(logits(model, ids), out_ref.logits) < TOL
    n_experts = 0
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert rel(p.grad, grads_ref[name]) < TOL, name
            n_experts += name.endswith("gate_up_lora_A")
        else:
            assert not p.requires_grad and p.grad is None, name
    assert n_experts == sum(hasattr(m, "has_gate") for m in model.modules()) > 0


def test_apply_lora_starts_unchanged_and_trains_only_lora():
    plain = build("qwen3_moe")
    ids = tokens()
    before = logits(plain, ids)
    model = apply_lora(twin(plain, accelerate=False), r=8, alpha=16)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n.rsplit(".", 1)[-1] for n in trainable)
    assert {n.rsplit(".", 1)[-1] for n in trainable} == {
        "lora_A",
        "lora_B",
        "gate_up_lora_A",
        "gate_up_lora_B",
        "down_lora_A",
        "down_lora_B",
    }
    assert sum(isinstance(m, LoraLinear) for m in model.modules()) == 4 * model.config.num_hidden_layers
    assert set(plain.state_dict()) <= set(model.state_dict())  # HF's keys unchanged
    assert rel(logits(model, ids), before) < TOL  # B = 0


def test_apply_lora_needs_moe8_for_experts():
    plain = build("qwen3_moe", hidden_act="gelu")  # moe8 runs SiLU-gated experts only
    with pytest.raises(ValueError, match="'experts' is targeted but moe8 can't run"):
        apply_lora(twin(plain, accelerate=False))
    model = apply_lora(twin(plain, accelerate=False), targets=ATTN)  # attention only: fine
    assert not hf.is_accelerated(model) and any(isinstance(m, LoraLinear) for m in model.modules())
    _, model = lora_model("mixtral")
    hf.disable()  # expert LoRA would be ignored by transformers' experts: refuse to run
    with pytest.raises(RuntimeError, match="only moe8 runs"):
        model(input_ids=tokens())


def test_save_load_round_trip(tmp_path):
    plain, model = lora_model("gpt_oss")
    save_adapter(model, tmp_path)
    other = load_adapter(twin(plain, accelerate=False), tmp_path)
    assert hf.is_accelerated(other)
    ids = tokens()
    assert rel(logits(other, ids), logits(model, ids)) == 0
    sd = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(torch.equal(p, sd[n]) for n, p in other.named_parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="r=8"):
        load_adapter(apply_lora(twin(plain, accelerate=False), r=8, alpha=8), tmp_path)


@pytest.mark.parametrize("peft_version", ["0.18.0", "0.21.2"])
@pytest.mark.parametrize("transposed", [False, True])
def test_expert_factors_in_each_peft_layout(peft_version, transposed):
    """_to_peft writes the factors as that PEFT version's ParamWrapper reads them (its delta-weight einsum,
    restated here: up to 0.18 "o r e, e r i -> e i o"; from 0.19 on "e o i" for non-transposed weights)
    and _from_peft inverts it."""
    E, r, d1, d2 = 3, 2, 5, 7
    L, R = torch.randn(E, d1, r), torch.randn(E, r, d2)  # W[e] [d1, d2] + L[e]·R[e]
    experts = torch.nn.Module()
    experts.is_transposed = transposed
    swapped = lora_mod._swapped(experts, peft_version)
    assert swapped == (peft_version == "0.21.2" and not transposed)
    A, B = lora_mod._to_peft(L, R, swapped)
    A3, B3 = A.reshape(E, r, -1), B.reshape(B.shape[0], r, E)
    delta = torch.einsum("ore,eri->eoi" if swapped else "ore,eri->eio", B3, A3)
    torch.testing.assert_close(delta, L @ R)
    L2, R2 = lora_mod._from_peft(A, B, E, swapped)
    assert torch.equal(L2, L) and torch.equal(R2, R)


def test_adapter_in_the_old_peft_layout_loads(tmp_path, monkeypatch):
    """A file from peft < 0.19 (no swap of in/out for [E, out, in] experts) loads to the same model."""
    plain, model = lora_model("qwen3_moe")
    monkeypatch.setattr(lora_mod, "_peft_version", lambda: "0.18.0")
    save_adapter(model, tmp_path)
    monkeypatch.undo()
    assert json.loads((tmp_path / "adapter_config.json").read_text())["peft_version"] == "0.18.0"
    other = load_adapter(twin(plain, accelerate=False), tmp_path)
    ids = tokens()
    assert rel(logits(other, ids), logits(model, ids)) == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_peft_loads_moe8_adapter(tmp_path, family):
    """peft.PeftModel.from_pretrained on a plain HF model gives the moe8 LoRA model's logits: attention LoRA
    as target_modules, expert LoRA as target_parameters (ParamWrapper)."""
    peft = pytest.importorskip("peft", minversion="0.17", reason="LoRA target_parameters needs peft>=0.17")
    plain, model = lora_model(family)
    save_adapter(model, tmp_path)
    ids = tokens()
    expected = logits(model, ids)
    hf.disable()
    loaded = peft.PeftModel.from_pretrained(twin(plain, accelerate=False), tmp_path)
    assert not hf.is_accelerated(loaded.base_model.model)
    assert rel(logits(loaded, ids), expected) < TOL
    assert rel(logits(plain, ids), expected) > 1e-3  # the adapter does something


def test_moe8_loads_peft_adapter(tmp_path):
    peft = pytest.importorskip("peft", minversion="0.17", reason="LoRA target_parameters needs peft>=0.17")
    plain = build("qwen3_moe")
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=list(ATTN),
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,  # random A and B
    )
    torch.manual_seed(3)
    peft_model = peft.get_peft_model(twin(plain, accelerate=False), config)
    peft_model.save_pretrained(tmp_path)
    ids = tokens()
    expected = logits(peft_model, ids)
    model = load_adapter(twin(plain, accelerate=False), tmp_path)
    assert rel(logits(model, ids), expected) < TOL


def test_training_reduces_loss():
    _, model = lora_model("qwen3_moe")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = tokens(seq=24)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_bf16_model_keeps_fp32_lora():
    plain = build("mixtral").to(torch.bfloat16)
    model = apply_lora(twin(plain, accelerate=False), r=4)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if p.requires_grad)
    ids = tokens()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(
        p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad
    )


LORA_NAMES = {"lora_A", "lora_B", "gate_up_lora_A", "gate_up_lora_B", "down_lora_A", "down_lora_B"}


def adapters(model) -> dict:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "model_dtype, dtype, want",
    [
        (torch.float32, None, torch.float32),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16, torch.float16),
    ],
)
def test_adapter_dtype_of_every_factor(model_dtype, dtype, want):
    """dtype: every factor, attention and experts, in it (None: fp32 here, as before); the base untouched."""
    plain = build("qwen3_moe").to(model_dtype)
    model = apply_lora(twin(plain, accelerate=False), r=4, dtype=dtype)
    lora = adapters(model)
    assert {n.rsplit(".", 1)[-1] for n in lora} == LORA_NAMES
    assert all(p.dtype == want for p in lora.values()), {n: p.dtype for n, p in lora.items()}
    assert all(p.dtype == model_dtype for p in model.parameters() if not p.requires_grad)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_bf16_adapters_match_fp32_ones_and_train(model_dtype):
    """bf16 factors give the logits of fp32 factors holding the same values (to bf16 rounding of the attention
    LoRA's GEMMs), bf16 gradients, and AdamW on them (bf16 states, no master copies) lowers the loss."""
    plain = build("qwen3_moe").to(model_dtype)
    model = apply_lora(twin(plain, accelerate=False), r=4, alpha=8, dtype=torch.bfloat16)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in adapters(model).items():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ref = apply_lora(twin(plain, accelerate=False), r=4, alpha=8, dtype=torch.float32)
    with torch.no_grad():
        for name, p in adapters(ref).items():
            p.copy_(adapters(model)[name])
    ids = tokens(seq=24)
    want = logits(ref, ids).float()
    tol = 1e-2 if model_dtype == torch.float32 else 6e-2  # a bf16 model: its own rounding, two layers deep
    assert rel(logits(model, ids).float(), want) < tol
    assert rel(logits(plain, ids).float(), want) > 10 * tol  # the adapters matter at that tolerance
    opt = torch.optim.AdamW(list(adapters(model).values()), lr=1e-2)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in adapters(model).values())
        opt.step()
        losses.append(loss.item())
    assert all(s.dtype == torch.bfloat16 for st in opt.state.values() for s in st.values() if s.dim())
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("bad", ["bf16", "bfloat16", torch.float64, torch.int32, 16])
def test_bad_adapter_dtype_is_refused_before_any_change(bad):
    model = twin(build("qwen3_moe"), accelerate=False)
    with pytest.raises(TypeError, match=r"dtype: expected None or one of torch\.float32, .*, got "):
        apply_lora(model, dtype=bad)
    assert not hasattr(model, "_moe8_lora") and not hf.is_accelerated(model)
    assert all(p.requires_grad for p in model.parameters())


def test_bf16_adapter_saves_loads_and_peft_loads_it(tmp_path):
    """A bf16 adapter is written in bf16; load_adapter(dtype=bf16) restores it bitwise, load_adapter's default
    (fp32 factors) and PEFT both read the same values: their logits agree."""
    from safetensors.torch import load_file

    plain, model = lora_model("qwen3_moe", dtype=torch.bfloat16)
    save_adapter(model, tmp_path)
    assert {t.dtype for t in load_file(str(tmp_path / "adapter_model.safetensors")).values()} == {
        torch.bfloat16
    }
    again = load_adapter(twin(plain, accelerate=False), tmp_path, dtype=torch.bfloat16)
    assert all(torch.equal(p, adapters(model)[n]) for n, p in adapters(again).items())
    ids = tokens()
    assert rel(logits(again, ids), logits(model, ids)) == 0
    fp32 = load_adapter(twin(plain, accelerate=False), tmp_path)
    assert all(p.dtype == torch.float32 for p in adapters(fp32).values())
    expected = logits(fp32, ids)
    assert rel(logits(model, ids), expected) < 1e-2
    peft = pytest.importorskip("peft", minversion="0.17", reason="LoRA target_parameters needs peft>=0.17")
    hf.disable()
    loaded = peft.PeftModel.from_pretrained(twin(plain, accelerate=False), tmp_path)
    assert rel(logits(loaded, ids), expected) < TOL
