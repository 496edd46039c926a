"""LoRA over FP8 base weights (moe8.fp8.freeze_fp8, moe8.lora.freeze_base_fp8): frozen expert and dense
weights stored in FP8 only, adapters in their own dtype. Outputs and adapter / input gradients against a
float64 reference built from the dequantised FP8 weights, the bytes of the frozen base, the refusals of bf16
paths that would read the freed weights. CPU (moe8's reference kernels); CUDA too where a GPU is visible."""

import pytest
import torch
from conftest import devices

from moe8 import fp8, layer
from moe8 import reference as ref
from moe8.lora import LoraLinear

TOL = 0.1  # FP8 activations (1x128 e4m3, ~2.6% each GEMM) against exact ones; the weights are exact here


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def dequantized(w):
    """The float64 weight a frozen FP8 placeholder stands for, in the placeholder's own layout."""
    f = fp8.frozen_fp8(w)
    d = fp8.dequantize(f.value.q, f.value.scale, 128, 128, torch.float32).double()  # [E, N, K]
    d = d if f.layout == 0 else d.transpose(1, 2)
    return d if w.dim() == 3 else d[0]


CASES = [  # T, H, I, E, K, r, layout
    (96, 256, 128, 4, 2, 8, "nk"),
    (37, 160, 200, 5, 2, 4, "nk"),  # not multiples of 128, ragged experts
    (1, 128, 64, 4, 1, 3, "nk"),  # one token: most experts get no rows
    (29, 144, 96, 4, 2, 2, "kn"),  # GPT-OSS layout
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-H{c[1]}-{c[6]}")
@pytest.mark.parametrize("dgrad", ["bf16", "fp8"])
def test_experts_lora_over_fp8_base(case, device, dgrad):
    T, H, I, E, K, r, layout = case
    torch.manual_seed(T + H)
    kn = layout == "kn"
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(T, H, device=device, dtype=dt, requires_grad=True)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(device)
    weights = torch.rand(T, K, device=device)
    gu = torch.randn((E, H, 2 * I) if kn else (E, 2 * I, H), device=device, dtype=dt) * H**-0.5
    dn = torch.randn((E, I, H) if kn else (E, H, I), device=device, dtype=dt) * I**-0.5
    shapes = (
        ((E, H, r), (E, r, 2 * I), (E, I, r), (E, r, H))
        if kn
        else ((E, r, H), (E, 2 * I, r), (E, r, I), (E, H, r))
    )
    lora = [(torch.randn(s, device=device) * 0.3).requires_grad_() for s in shapes]
    s = 1.5
    fgu, fdn = fp8.freeze_fp8(gu, int(kn)), fp8.freeze_fp8(dn, int(kn))
    assert fgu.untyped_storage().nbytes() == gu.element_size()  # the bf16 values are not held
    recipe = fp8.Float8Recipe("blockwise", dgrad=dgrad)
    y = layer.experts_forward(
        x, ids, weights, fgu, fdn, layout=layout, lora=layer.ExpertLoRA(*lora, s), fp8=recipe
    )
    xd = x.detach().double().requires_grad_()
    ld = [t.detach().double().requires_grad_() for t in lora]

    def delta(A, B):
        return A @ B if kn else B @ A

    gu64, dn64 = dequantized(fgu), dequantized(fdn)
    y_ref = ref.experts_forward(
        xd, ids, weights.double(), gu64 + s * delta(*ld[:2]), dn64 + s * delta(*ld[2:]), layout=layout
    )
    no_lora = ref.experts_forward(xd, ids, weights.double(), gu64, dn64, layout=layout)
    assert rel(no_lora, y_ref) > 3 * TOL  # the adapters matter: dropping them would fail the test
    assert rel(y, y_ref) < TOL
    dy = torch.randn_like(y_ref)
    grads = torch.autograd.grad(y, [x, *lora], dy.to(y.dtype))
    grads_ref = torch.autograd.grad(y_ref, [xd, *ld], dy)
    for name, g, g_ref in zip(["x", "gate_up_A", "gate_up_B", "down_A", "down_B"], grads, grads_ref):
        assert rel(g, g_ref) < TOL, name


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("layout", [0, 1])
def test_frozen_weights_input_gradient(device, layout):
    """The input gradient GEMM of a weight stored in FP8 only: with the recipe's bf16 dgrad (the default) the
    dequantised weight times the exact output gradient (float32 on the CPU: ~1e-7 of float64), with an FP8
    dgrad the same blocks transposed times the gradient quantised 1x128 (FP8's ~3 %); in the weight's own
    layout and in the other one."""
    from moe8.precision import Fp8Gemms

    torch.manual_seed(layout)
    E, N, K, R = 3, 200, 136, 50
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    w = torch.randn((E, N, K) if layout == 0 else (E, K, N), device=device, dtype=dt)
    frozen = fp8.freeze_fp8(w, layout)
    g = torch.randn(R, N, device=device, dtype=dt)
    offsets = torch.tensor([0, 20, 20, R], device=device, dtype=torch.int32)
    d = dequantized(frozen)  # float64, the placeholder's layout
    nk = d if layout == 0 else d.transpose(1, 2)  # [E, N, K]: c = a . nk^T in the forward
    want = torch.cat([g[a:b].double() @ nk[e] for e, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))])
    exact = 1e-5 if device == "cpu" else 1e-2
    got = Fp8Gemms("blockwise").dgrad(g, frozen, offsets, layout)
    assert rel(got, want) < exact
    got_fp8 = Fp8Gemms(fp8.Float8Recipe("blockwise", dgrad="fp8")).dgrad(g, frozen, offsets, layout)
    assert 1e-3 < rel(got_fp8, want) < TOL  # the gradient's own quantisation shows
    # read in the other layout (the GEMM that takes the frozen copy transposed): its input gradient is
    # g' . nk^T for g' of width K
    g2 = torch.randn(R, K, device=device, dtype=dt)
    want2 = torch.cat(
        [g2[a:b].double() @ nk[e].t() for e, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))]
    )
    assert rel(Fp8Gemms("blockwise").dgrad(g2, frozen, offsets, 1 - layout), want2) < exact


def test_experts_in_bf16_refuse_fp8_only_weights():
    E, H, I = 4, 128, 64
    fgu, fdn = fp8.freeze_fp8(torch.randn(E, 2 * I, H)), fp8.freeze_fp8(torch.randn(E, H, I))
    x, ids = torch.randn(8, H), torch.randint(0, E, (8, 2))
    with pytest.raises(ValueError, match="stored in FP8 only"):
        layer.experts_forward(x, ids, torch.rand(8, 2), fgu, fdn)


def test_freeze_fp8_bad_input():
    with pytest.raises(ValueError, match="recipe: frozen FP8 weights are blockwise"):
        fp8.freeze_fp8(torch.randn(4, 8, 8), 0, "rowwise")
    with pytest.raises(ValueError, match="w: expected a 2-d or 3-d weight"):
        fp8.freeze_fp8(torch.randn(8))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape", [(64, 256, 384), (33, 200, 136)], ids=str)
@pytest.mark.parametrize("dgrad", ["bf16", "fp8"])
def test_lora_linear_over_fp8_base(shape, device, dgrad):
    M, N, K = shape
    torch.manual_seed(M)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    base = torch.nn.Linear(K, N, device=device, dtype=dt)
    m = LoraLinear(base, r=4, alpha=8)
    with torch.no_grad():
        m.lora_B.normal_(0, 0.3)
    m.requires_grad_(False)
    m.lora_A.requires_grad_(True), m.lora_B.requires_grad_(True)
    m.weight = fp8.freeze_fp8(m.weight.detach())
    m.fp8_recipe = fp8.Float8Recipe("blockwise", dgrad=dgrad)
    x = torch.randn(2, M, K, device=device, dtype=dt, requires_grad=True)
    y = m(x)
    xd = x.detach().double().requires_grad_()
    A, B = (t.detach().double().requires_grad_() for t in (m.lora_A, m.lora_B))
    y_ref = xd @ dequantized(m.weight).t() + m.bias.double() + m.scaling * (xd @ A.t()) @ B.t()
    assert rel(y, y_ref) < TOL
    dy = torch.randn_like(y_ref)
    grads = torch.autograd.grad(y, [x, m.lora_A, m.lora_B], dy.to(y.dtype))
    grads_ref = torch.autograd.grad(y_ref, [xd, A, B], dy)
    for name, g, g_ref in zip(["x", "lora_A", "lora_B"], grads, grads_ref):
        assert rel(g, g_ref) < TOL, name
    if dgrad == "bf16" and device == "cpu":  # dx = dy . (dequantised W + s B A): no FP8 in it, float32-exact
        assert rel(grads[0], grads_ref[0]) < 1e-5


def test_frozen_base_bytes_halve():
    """A bf16 weight's FP8 copy: 1 byte per value plus one fp32 scale per 128x128 block."""
    w = torch.randn(8, 512, 384, dtype=torch.bfloat16)
    f = fp8.freeze_fp8(w)
    held = f.untyped_storage().nbytes() + fp8.fp8_nbytes(fp8.frozen_fp8(f).value)
    assert held == 2 + 8 * 512 * 384 + 4 * 8 * 4 * 3
    assert held < 0.51 * w.untyped_storage().nbytes()


def test_experts_lora_over_fp8_without_grad():
    """In eval (no autograd) the LoRA branch still reads the permuted rows (the FP8 GEMM alone would not)."""
    torch.manual_seed(5)
    T, H, I, E, K, r = 40, 128, 64, 4, 2, 4
    x, ids, weights = torch.randn(T, H), torch.randint(0, E, (T, K)), torch.rand(T, K)
    gu, dn = torch.randn(E, 2 * I, H) * H**-0.5, torch.randn(E, H, I) * I**-0.5
    lora = [torch.randn(s) * 0.3 for s in ((E, r, H), (E, 2 * I, r), (E, r, I), (E, H, r))]
    fgu, fdn = fp8.freeze_fp8(gu), fp8.freeze_fp8(dn)
    with torch.no_grad():
        y = layer.experts_forward(
            x, ids, weights, fgu, fdn, lora=layer.ExpertLoRA(*lora, 1.0), fp8="blockwise"
        )
    d = [t.double() for t in lora]
    y_ref = ref.experts_forward(
        x.double(), ids, weights.double(), dequantized(fgu) + d[1] @ d[0], dequantized(fdn) + d[3] @ d[2]
    )
    assert rel(y, y_ref) < TOL


def test_hf_lora_over_fp8_base_halves_frozen_bytes(tmp_path):
    pytest.importorskip("transformers", minversion="5.0", reason="moe8.lora needs transformers>=5")
    from safetensors.torch import load_file
    from test_hf import build, tokens

    from moe8 import hf, lora

    model = build("qwen3_moe").to(torch.bfloat16)
    lora.apply_lora(model, r=4, alpha=8)
    hf.accelerate(model, fp8="blockwise")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ids = tokens()
    before_out = model(input_ids=ids).logits
    before = lora.base_nbytes(model)
    n = lora.freeze_base_fp8(model)
    linear = [m for m in model.modules() if isinstance(m, lora.LoraLinear)]
    experts = [m for m in model.modules() if hasattr(m, "gate_up_lora_A")]
    assert linear and experts and n == len(linear) + 2 * len(experts)
    assert lora.freeze_base_fp8(model) == 0  # already in FP8
    after = lora.base_nbytes(model)
    quantised = sum(
        m.weight.numel() if isinstance(m, lora.LoraLinear) else m.gate_up_proj.numel() + m.down_proj.numel()
        for m in model.modules()
        if isinstance(m, lora.LoraLinear) or hasattr(m, "gate_up_lora_A")
    )
    # each quantised bf16 value (2 bytes) now takes 1 byte (+ one fp32 scale per 128x128 block, 2-byte stand-in)
    saved = before - after
    assert quantised - 64 * n <= saved <= quantised
    after_out = model(input_ids=ids).logits
    assert ((after_out.float() - before_out.float()).norm() / before_out.float().norm()) < 0.1
    out = model(input_ids=ids, labels=ids)  # the fused loss (on by default): no logits in this forward
    out.loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    lora.save_adapter(model, tmp_path)
    keys = load_file(str(tmp_path / "adapter_model.safetensors")).keys()
    assert keys and all("lora_A" in k or "lora_B" in k for k in keys)
