"""moe8.ops.rope (rotary position embedding, rotate_half form) and apply_rotary_pos_emb against a float64
pure-torch reference and against transformers' own formula: forward, backward, strided inputs, batch
broadcast of cos / sin, full writes, argument errors and torch.library's checks."""

import pytest
import torch
from conftest import devices

from moe8 import ops
from moe8.ops import _C

DTYPES = [torch.float32, torch.bfloat16]

# (B, S, H, D, cos batch): Qwen3 / Llama head dims, one head, one position, a half (D/2 = 5) that no
# vector width divides, and no positions at all.
SHAPES = [
    (2, 5, 4, 128, 2),
    (3, 7, 2, 64, 1),
    (2, 1, 3, 64, 2),
    (1, 9, 1, 128, 1),
    (2, 6, 3, 10, 2),
    (2, 0, 2, 64, 1),
]


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference(x, cos, sin):
    """The formula in float64: x [B, H, S, D], cos / sin [B|1, S, D]."""
    x, cos, sin = x.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def make_q(B, S, H, D, dtype, device, gen):
    """q as transformers builds it: proj(h).view(B, S, H, D).transpose(1, 2), a strided [B, H, S, D]."""
    flat = torch.randn(B, S, H * D, generator=gen).to(dtype=dtype, device=device)
    return flat.view(B, S, H, D).transpose(1, 2)


def make_table(Bc, S, D, dtype, device, gen):
    """Random cos / sin (not a real table, whose halves repeat and would hide a mixed-up index)."""
    cos = torch.rand(Bc, S, D, generator=gen) * 2 - 1
    sin = torch.rand(Bc, S, D, generator=gen) * 2 - 1
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)


def real_table(B, S, D, dtype, device, base=1e6):
    """cos / sin as transformers' rotary embedding builds them (positions offset per batch row)."""
    inv_freq = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    pos = torch.arange(S, dtype=torch.float64)[None, :] + 17 * torch.arange(B, dtype=torch.float64)[:, None]
    freqs = pos[..., None] * inv_freq  # [B, S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


def check_close(got, want, dtype):
    """fp32: within 1e-6; bf16: relative error below 1e-2 (one final rounding is 2^-9)."""
    assert torch.isfinite(got).all(), "non-finite output (unwritten?)"
    got = got.double().cpu()
    want = want.cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        err = (got - want).abs()
        bad = err > 1e-2 * want.abs() + 1e-5
        assert not bad.any(), f"{int(bad.sum())} elements off, max error {err.max().item():.3g}"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,H,D,Bc", SHAPES)
def test_forward_matches_reference(device, dtype, B, S, H, D, Bc):
    gen = torch.Generator().manual_seed(B * 1000 + S * 100 + H * 10 + D)
    q = make_q(B, S, H, D, dtype, device, gen)
    cos, sin = make_table(Bc, S, D, dtype, device, gen)
    out = ops.rope(q, cos, sin)
    assert out.shape == q.shape and out.dtype == dtype
    assert out.stride() == q.stride(), "the output keeps the [B, S, H, D] layout of q"
    check_close(out, reference(q, cos, sin), dtype)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,H,D,Bc", SHAPES)
def test_backward_matches_reference(device, dtype, B, S, H, D, Bc):
    gen = torch.Generator().manual_seed(7 + B * 1000 + S * 100 + H * 10 + D)
    q = make_q(B, S, H, D, dtype, device, gen).requires_grad_()
    cos, sin = make_table(Bc, S, D, dtype, device, gen)
    g = torch.randn(B, H, S, D, generator=gen).to(dtype=dtype, device=device)
    (dq,) = torch.autograd.grad(ops.rope(q, cos, sin), q, g)
    # The reference gradient is autograd's through the float64 formula, not the backward formula.
    q64 = q.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(reference(q64, cos, sin), q64, g.double())
    assert dq.shape == q.shape and dq.dtype == dtype
    check_close(dq, want, dtype)


@pytest.mark.parametrize("device", devices())
def test_bf16_within_one_rounding_of_transformers(device):
    """transformers computes in bf16 (three roundings); rope rounds once. They may differ by one bf16 step of
    the terms' magnitude |x cos| + |rotate_half(x) sin| (2^-7 covers 3 half-steps of 2^-9)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb as hf_apply

    gen = torch.Generator().manual_seed(3)
    B, S, H, D = 2, 33, 4, 128
    q = make_q(B, S, H, D, torch.bfloat16, device, gen)
    k = make_q(B, S, 2, D, torch.bfloat16, device, gen)
    cos, sin = real_table(B, S, D, torch.bfloat16, device)
    for x, theirs in zip((q, k), hf_apply(q, k, cos, sin)):
        ours = ops.rope(x, cos, sin).double()
        x64, c64, s64 = x.double(), cos.double().unsqueeze(1), sin.double().unsqueeze(1)
        mag = (x64 * c64).abs() + (rotate_half(x64) * s64).abs()
        err = (ours - theirs.double()).abs()
        assert (err <= 2.0**-7 * mag + 1e-30).all(), f"max error / magnitude {(err / mag).max().item():.3g}"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_element_written(device, dtype):
    """Outputs poisoned with NaN (strided, as ops.rope allocates them) are fully overwritten, both ways."""
    gen = torch.Generator().manual_seed(11)
    B, S, H, D = 2, 5, 3, 64
    x = make_q(B, S, H, D, dtype, device, gen)
    cos, sin = make_table(1, S, D, dtype, device, gen)
    for backward in (False, True):
        out = torch.full((B, S, H, D), float("nan"), dtype=dtype, device=device).transpose(1, 2)
        _C.rope(x, cos, sin, out, backward, ops._stream(x))
        if device == "cuda":
            torch.cuda.synchronize()
        if backward:  # x is the upstream gradient; the formula is linear, so any point z will do
            z = torch.zeros(x.shape, dtype=torch.float64, device=device, requires_grad=True)
            (want,) = torch.autograd.grad(reference(z, cos, sin), z, x.double())
        else:
            want = reference(x, cos, sin)
        check_close(out, want, dtype)


@pytest.mark.parametrize("device", devices())
def test_strided_inputs(device):
    """q sliced out of a fused qkv projection (not dense: a contiguous output), a contiguous [B, H, S, D]
    x, and an expanded (stride 0) upstream gradient."""
    gen = torch.Generator().manual_seed(5)
    B, S, H, D = 2, 6, 4, 64
    qkv = torch.randn(B, S, 3 * H * D, generator=gen).to(device)
    q = qkv[..., : H * D].view(B, S, H, D).transpose(1, 2)
    cos, sin = make_table(B, S, D, torch.float32, device, gen)
    out = ops.rope(q, cos, sin)
    assert out.stride(-1) == 1
    check_close(out, reference(q, cos, sin), torch.float32)
    xc = q.contiguous()
    check_close(ops.rope(xc, cos, sin), reference(xc, cos, sin), torch.float32)
    xg = q.clone().requires_grad_()
    ops.rope(xg, cos, sin).sum().backward()  # grad of sum: ones expanded, stride 0
    x64 = q.double().requires_grad_()
    reference(x64, cos, sin).sum().backward()
    check_close(xg.grad, x64.grad, torch.float32)


def test_errors_name_the_argument():
    gen = torch.Generator().manual_seed(1)
    B, S, H, D = 2, 4, 3, 8
    x = make_q(B, S, H, D, torch.float32, "cpu", gen)
    cos, sin = make_table(1, S, D, torch.float32, "cpu", gen)

    def raises(match, *args):
        with pytest.raises((ValueError, RuntimeError), match=match):
            ops.rope(*args)

    ops.rope(x, cos, sin)  # the valid call passes
    x7 = make_q(B, S, H, 7, torch.float32, "cpu", gen)
    c7, s7 = make_table(1, S, 7, torch.float32, "cpu", gen)
    raises(r"x: expected an even head dim x.shape\[3\] >= 2 \(pairs i, i \+ D/2\), got 7", x7, c7, s7)
    want = r"cos: expected shape \[2 or 1, 4, 8\] \(x \[B, H, S, D\] = \[2, 3, 4, 8\]\), got \[1, 5, 8\]"
    raises(want, x, torch.zeros(1, 5, 8), sin)
    raises(r"cos: expected shape \[2 or 1, 4, 8\]", x, torch.zeros(3, 4, 8), sin)
    raises(r"sin: expected a 3-d tensor, got 2-d with shape \[4, 8\]", x, cos, torch.zeros(4, 8))
    raises(r"sin: expected shape \[1, 4, 8\] \(same as cos\), got \[2, 4, 8\]", x, cos, torch.zeros(2, 4, 8))
    raises(r"cos: expected dtype float32 \(same as x\), got bfloat16", x, cos.bfloat16(), sin)
    raises(r"sin: expected dtype float32 \(same as x\), got float64", x, cos, sin.double())
    raises(r"x: expected a 4-d tensor, got 3-d", x[0], cos, sin)
    raises(
        r"x: expected dtype float32 or float16 or bfloat16, got float64",
        x.double(),
        cos.double(),
        sin.double(),
    )
    out = torch.empty(B, H, S, D)
    with pytest.raises(ValueError, match=r"out: expected shape \[2, 3, 4, 8\], got \[2, 3, 4, 6\]"):
        _C.rope(x, cos, sin, torch.empty(B, H, S, 6), False, 0)
    with pytest.raises(
        ValueError, match=r"out: expected a contiguous last dim \(stride\(3\) == 1\), got stride"
    ):
        _C.rope(x, cos, sin, torch.empty(B, H, D, S).transpose(2, 3), False, 0)
    with pytest.raises(ValueError, match=r"out: expected non-overlapping strides"):
        _C.rope(x, cos, sin, torch.empty(B, 1, S, D).expand(B, H, S, D), False, 0)
    with pytest.raises(ValueError, match=r"x: expected a contiguous last dim"):
        _C.rope(torch.empty(B, H, D, S).transpose(2, 3), cos, sin, out, False, 0)
    with pytest.raises(ValueError, match=r"cos: expected a contiguous tensor"):
        _C.rope(x, torch.empty(1, D, S).transpose(1, 2), sin, out, False, 0)


def test_opcheck():
    """torch.library's consistency checks (schema, fake tensors) on strided and contiguous inputs."""
    gen = torch.Generator().manual_seed(2)
    B, S, H, D = 2, 5, 3, 16
    cos, sin = make_table(1, S, D, torch.float32, "cpu", gen)
    for x in (make_q(B, S, H, D, torch.float32, "cpu", gen), torch.randn(B, H, S, D, generator=gen)):
        for op in (ops.rope, ops.rope_backward):
            torch.library.opcheck(op, (x, cos, sin), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("device", devices())
def test_apply_rotary_pos_emb_matches_transformers(device, monkeypatch):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb as hf_apply

    from moe8 import rotary

    calls = []
    rope = rotary.rope
    monkeypatch.setattr(rotary, "rope", lambda *a: calls.append(a) or rope(*a))  # what it calls
    gen = torch.Generator().manual_seed(4)
    B, S, D = 2, 9, 128
    q = make_q(B, S, 4, D, torch.float32, device, gen)  # GQA: 4 query heads, 2 key heads
    k = make_q(B, S, 2, D, torch.float32, device, gen)
    cos, sin = real_table(B, S, D, torch.float32, device)
    got, want = ops.apply_rotary_pos_emb(q, k, cos, sin), hf_apply(q, k, cos, sin)
    assert len(calls) == 2, "fitting inputs take the fused op"
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)

    # [B, S, H, D] with unsqueeze_dim=2: transformers' formula, so the same bits.
    calls.clear()
    qs, ks = q.transpose(1, 2), k.transpose(1, 2)
    got, want = ops.apply_rotary_pos_emb(qs, ks, cos, sin, 2), hf_apply(qs, ks, cos, sin, 2)
    assert not calls, "unsqueeze_dim=2 falls back"
    for g, w in zip(got, want):
        assert torch.equal(g, w)

    # cos of another dtype, or cos that wants a gradient: the fallback too.
    got = ops.apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    assert not calls
    for g, w in zip(got, hf_apply(q, k, cos.double(), sin.double())):
        assert torch.equal(g, w)
    cg = cos.clone().requires_grad_()
    got = ops.apply_rotary_pos_emb(q, k, cg, sin)
    assert not calls and got[0].requires_grad
