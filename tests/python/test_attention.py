"""moe8.attention.sink_attention (attention with per-head sinks through the fused SDPA kernels) against a
float64 reference that forms the scores, appends the sink logit to every row's softmax and drops its share:
the output and the gradients of q, k, v and the sinks. CPU (the flash kernel's CPU version, fp32); CUDA too
where a GPU is visible (the memory-efficient kernel, bf16)."""

import pytest
import torch
from conftest import _cuda, devices

from moe8.attention import sink_attention


def reference(q, k, v, sinks, mask, scale):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores + mask
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return probs @ v


def masks(kind, B, S, dtype):
    """An additive mask [B, 1, S, S] (None for "none"): causal, a causal sliding window of 5, or packed
    documents (causal within each, the second row split at position 7)."""
    if kind == "none":
        return None
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = (j <= i).expand(B, 1, S, S).clone()
    if kind == "sliding":
        allowed &= i - j < 5
    if kind == "documents":
        doc = (torch.arange(S) >= 7).long()
        allowed[1, 0] &= doc[:, None] == doc[None, :]
    return torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mask_kind", ["none", "causal", "sliding", "documents"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 37, 16), (2, 4, 4, 64, 64)], ids=["gqa-S37", "mha-S64"])
def test_sink_attention_matches_the_reference(device, mask_kind, shape):
    B, H, Hkv, S, D = shape
    torch.manual_seed(S + H)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    tol = 1e-5 if device == "cpu" else 2e-2
    q, k, v = (torch.randn(B, h, S, D, device=device, dtype=dt) for h in (H, Hkv, Hkv))
    sinks = torch.randn(H, device=device, dtype=dt) + 2  # sinks that take a good part of the weight
    mask = masks(mask_kind, B, S, dt)
    mask = None if mask is None else mask.to(device)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    out = sink_attention(*leaves, mask=mask, scale=D**-0.5)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref = reference(*ref_leaves, None if mask is None else mask.double(), D**-0.5)
    assert out.shape == (B, H, S, D) and out.dtype == dt
    assert rel(out, ref) < tol
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, leaves, g.to(dt))
    grads_ref = torch.autograd.grad(ref, ref_leaves, g)
    for name, a, b in zip(["q", "k", "v", "sinks"], grads, grads_ref):
        assert a.shape == b.shape and rel(a, b) < tol, name
    # the sinks matter: without them (sinks at -inf) the output is plain softmax attention, far from this
    plain = reference(
        *ref_leaves[:3],
        torch.full_like(ref_leaves[3], -1e9),
        None if mask is None else mask.double(),
        D**-0.5,
    )
    assert rel(plain, ref) > 5 * tol  # unmasked on an H200 (bf16): 0.175 and 0.178, against tol 0.02


def test_sink_attention_checks_its_arguments():
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 3, 8, 16)
    with pytest.raises(ValueError, match="k, sinks: expected a head count dividing q's 4"):
        sink_attention(q, k, k, torch.zeros(4))
    with pytest.raises(ValueError, match=r"sinks \[4\]"):
        sink_attention(q, q, q, torch.zeros(3))
    with pytest.raises(ValueError, match="q, k, v: expected"):
        sink_attention(q[0], q, q, torch.zeros(4))


def test_kernel_head_dim_follows_the_kernels_rules():
    """The rule that picks the fused kernel, the kernel with a zero-padded head dim, or the formula."""
    from moe8.attention import kernel_head_dim

    bf16, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    h200 = (9, 0)
    for d, want in ((8, 8), (12, 16), (20, 24), (64, 64), (72, 72), (1, 8), (129, 136)):
        assert kernel_head_dim("cuda", bf16, d, h200) == want
        assert kernel_head_dim("cuda", f16, d, h200) == want
    for d, want in ((4, 4), (6, 8), (12, 12), (13, 16)):
        assert kernel_head_dim("cuda", f32, d, h200) == want
    assert kernel_head_dim("cuda", bf16, 64, (7, 5)) is None  # no bf16 kernel before sm80
    assert kernel_head_dim("cuda", f16, 12, (7, 5)) == 16
    assert kernel_head_dim("cuda", f64, 64, h200) is None
    for dt in (bf16, f16, f32, f64):
        assert kernel_head_dim("cpu", dt, 12) == 12
    assert kernel_head_dim("cpu", torch.int32, 8) is None
    assert kernel_head_dim("meta", f32, 8) is None
    assert kernel_head_dim("cuda", bf16, 0, h200) is None


def _check_against_reference(q, k, v, sinks, mask, scale, tol):
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    out = sink_attention(*leaves, mask=mask, scale=scale)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref_mask = None if mask is None else masks_additive(mask).double()
    ref = reference(*ref_leaves, ref_mask, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel(out, ref) < tol
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, leaves, g.to(q.dtype))
    grads_ref = torch.autograd.grad(ref, ref_leaves, g)
    for name, a, b in zip(["q", "k", "v", "sinks"], grads, grads_ref):
        assert a.shape == b.shape and rel(a, b) < tol, name


def masks_additive(mask):
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape).masked_fill(~mask.cpu(), -1e30).to(mask.device)


@pytest.mark.parametrize("path", ["padded", "formula"])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool"])
def test_fallbacks_match_the_reference(monkeypatch, path, mask_kind):
    """The paths for inputs the fused kernel does not take, forced on the CPU: the kernel at a zero-padded head
    dim (as CUDA runs head dims off its alignment) and the formula (a dtype or device without a kernel)."""
    import moe8.attention as att

    monkeypatch.setattr(
        att, "kernel_head_dim", lambda dev, dt, d, cap=(0, 0): d + 5 if path == "padded" else None
    )
    B, H, Hkv, S, D = 3, 4, 2, 17, 12
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, h, S, D) for h in (H, Hkv, Hkv))
    sinks = torch.randn(H) + 2
    mask = masks("causal", B, S, torch.float32)
    if mask_kind == "none":
        mask = None
    elif mask_kind == "bool":
        mask = mask == 0
        mask[1, :, :, :4] = False  # a left-padded row
        mask[1, :, :4, 0] = True  # whose padded queries still see one key
    _check_against_reference(q, k, v, sinks, mask, D**-0.5, 1e-5)


def test_empty_sequences_run():
    q, k = torch.randn(2, 4, 0, 12), torch.randn(2, 2, 0, 12)
    assert sink_attention(q, k, k, torch.zeros(4)).shape == (2, 4, 0, 12)
    q = torch.randn(2, 4, 3, 12)
    out = sink_attention(q, k, k, torch.zeros(4))  # no keys: the sink takes all the weight
    assert out.shape == q.shape and not out.any()


def _gpt_oss_attention(head_dim, H=4, Hkv=2):
    """transformers' GPT-OSS attention function (the one moe8 replaces, if it has) and a module it reads."""
    import importlib

    transformers = pytest.importorskip("transformers", minversion="5.0")
    from moe8.hf.registry import registry

    mod = importlib.import_module("transformers.models.gpt_oss.modeling_gpt_oss")
    own = registry.module_patches.get((mod, "eager_attention_forward"), mod.eager_attention_forward)
    cfg = transformers.AutoConfig.for_model(
        "gpt_oss", hidden_size=32, num_attention_heads=H, num_key_value_heads=Hkv, head_dim=head_dim
    )
    return own, cfg


def _padding_mask(B, S, kind, dtype, device):
    """Additive [B, 1, S, S] as transformers builds it: causal, with row 1 left-padded by 5 when padded."""
    if kind == "none":
        return None
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = (j <= i).expand(B, 1, S, S).clone()
    if kind == "padded":
        allowed[1, :, :, :5] = False
    m = torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return m.to(device)


@pytest.mark.skipif(not _cuda(), reason="no CUDA build or no GPU")
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padded"])
@pytest.mark.parametrize("S", [17, 33])
@pytest.mark.parametrize("head_dim", [12, 20, 72])
def test_head_dims_off_the_kernels_alignment_match_transformers(head_dim, S, mask_kind):
    """On CUDA in bf16, head dims that are not a multiple of 8 (the kernel at a padded head dim) and one that
    is, odd sequence lengths, with and without masks: moe8's attention_forward against transformers' GPT-OSS
    eager attention, the output and the gradients of q, k, v and the sinks."""
    from moe8.attention import attention_forward

    own, _ = _gpt_oss_attention(head_dim)
    B, H, Hkv, dt, dev = 3, 4, 2, torch.bfloat16, "cuda"
    torch.manual_seed(head_dim + S)
    q, k, v = (torch.randn(B, h, S, head_dim, device=dev, dtype=dt) for h in (H, Hkv, Hkv))
    mask = _padding_mask(B, S, mask_kind, dt, dev)

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.randn(H, device=dev, dtype=dt) + 2)
            self.num_key_value_groups = H // Hkv

    m = Module().eval()
    results = []
    for fn in (own, attention_forward):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        m.sinks.grad = None
        out = fn(m, *leaves, mask, head_dim**-0.5, 0.0)[0]  # [B, S, H, D]
        out.float().pow(2).sum().backward()
        results.append([out, *(t.grad for t in leaves), m.sinks.grad])
    # both against float64: moe8 within 2e-2, or no further off than transformers' own bf16 rounding allows
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, m.sinks)]
    ref = reference(*ref_leaves, None if mask is None else mask.double(), head_dim**-0.5).transpose(1, 2)
    ref.pow(2).sum().backward()
    want = [ref, *(t.grad for t in ref_leaves)]
    for name, theirs, ours, exact in zip(["out", "q", "k", "v", "sinks"], *results, want):
        assert ours.shape == theirs.shape == exact.shape, name
        assert rel(ours, exact) < max(2e-2, 1.5 * rel(theirs, exact)), (
            name,
            rel(ours, exact),
            rel(theirs, exact),
        )
        assert rel(ours, theirs) < 5e-2, name


@pytest.mark.skipif(not _cuda(), reason="no CUDA build or no GPU")
@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 12), ("float32", 10)])
def test_gpt_oss_with_an_unaligned_head_dim_accelerated_matches_transformers(dtype, head_dim):
    """A whole GPT-OSS on CUDA whose head dim is off the kernel's alignment (12 in bf16, 10 in fp32) through
    moe8.accelerate with its defaults, a 3 x 17 batch with a padding mask, forward and backward, against
    transformers. fp32: the loss and every gradient agree closely. bf16: the loss agrees and every
    gradient is finite (a router near a tie may pick another expert for a token when the attention rounds
    differently, so the experts' gradients are compared in fp32 only)."""
    import copy

    from transformers import AutoModelForCausalLM

    import moe8
    from moe8 import hf

    dt = getattr(torch, dtype)
    _, cfg = _gpt_oss_attention(head_dim)
    cfg.update(
        dict(vocab_size=128, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
             sliding_window=8, layer_types=["sliding_attention", "full_attention"], pad_token_id=0)
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).to("cuda", dt)
    acc = AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).to("cuda", dt)
    acc.load_state_dict(ref.state_dict())
    ids = torch.randint(3, 128, (3, 17), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :5] = 0

    def step(model):
        model.train()
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    out_r, grads_r = step(ref)
    acc = moe8.accelerate(acc)
    try:
        out_a, grads_a = step(acc)
    finally:
        hf.disable()
    assert grads_a.keys() == grads_r.keys() and grads_r
    if dt == torch.bfloat16:
        assert rel(out_a.loss, out_r.loss) < 2e-2
        assert all(torch.isfinite(g).all() for g in grads_a.values())
        return
    assert rel(out_a.loss, out_r.loss) < 2e-3  # (moe8's fused loss forms no logits)
    for name, g in grads_r.items():
        assert rel(grads_a[name], g) < 2e-3, name


def test_rows_aligned_decides_when_the_cuda_mask_is_copied():
    """What the CUDA kernel reads of a mask as it is (the rule, on CPU tensors): rows of a multiple of 16
    elements; a slice of a longer mask, or rows of 17, are copied into padded rows."""
    from moe8.attention import _rows_aligned

    assert _rows_aligned(torch.zeros(2, 1, 5, 32))
    assert _rows_aligned(torch.zeros(1, 1, 5, 16).expand(2, 4, 5, 16))
    assert not _rows_aligned(torch.zeros(2, 1, 5, 17))
    assert not _rows_aligned(torch.zeros(2, 1, 5, 40)[..., :32])  # rows 40 apart
    assert not _rows_aligned(torch.zeros(2, 1, 5, 33)[..., 1:])  # starts one element in
    assert not _rows_aligned(torch.zeros(2, 1, 32, 5).transpose(-1, -2))
