"""moe8.loss: chunked cross-entropy against torch's cross_entropy of the full logits, values and gradients."""

import pytest
import torch
import torch.nn.functional as F
from conftest import _cuda, devices

from moe8.loss import chunked_cross_entropy, hidden_states_as_logits


def full(h, w, t, reduction):
    return F.cross_entropy((h @ w.t()).float(), t, ignore_index=-100, reduction=reduction)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_matches_full_logits(device, dtype, reduction, chunk):
    g = torch.Generator().manual_seed(chunk)
    n, hdim, vocab = 50, 24, 97
    h0 = torch.randn(n, hdim, generator=g).to(device, dtype)
    w0 = (torch.randn(vocab, hdim, generator=g) * 0.3).to(device, dtype)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::5] = -100  # ignored rows
    t = t.to(device)
    grads = []
    for fn in (full, lambda h, w, t, r: chunked_cross_entropy(h, w, t, chunk=chunk, reduction=r)):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fn(h, w, t, reduction)
        loss.backward()
        grads.append((loss.detach(), h.grad, w.grad))
    (la, ha, wa), (lb, hb, wb) = grads
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    assert lb.dtype == torch.float32
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)  # same logits rounding, fp32 sums
    torch.testing.assert_close(hb, ha, **tol)
    torch.testing.assert_close(wb, wa, **tol)
    assert not hb[::5].any() and hb[1::5].all(dim=1).any()  # ignored rows get no gradient


def _loss_grads(h0, w0, t, **kwargs):
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    loss = chunked_cross_entropy(h, w, t, **kwargs)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("vocab", [1, 7, 127, 128, 129, 1000, 1269])  # 1269 = 151669 mod 128 past 1152
def test_padded_vocabulary_is_the_unpadded_math(device, vocab, monkeypatch):
    """A vocabulary off a multiple of 128 runs its GEMMs at padded_vocab rows (zero rows, -inf logits): the
    same float32 loss and gradients as the unpadded computation up to the GEMMs' summation order (a BLAS may
    block a 1000- and a 1024-row GEMM differently: bitwise on one CPU, not on another), both as close to a
    float64 reference; bf16 close to torch's cross-entropy of the full logits."""
    import moe8.loss as loss_mod

    g = torch.Generator().manual_seed(vocab)
    n, hdim = 37, 40
    h0 = torch.randn(n, hdim, generator=g).to(device)
    w0 = (torch.randn(vocab, hdim, generator=g) * 0.3).to(device)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::4] = -100
    t = t.to(device)
    assert loss_mod.padded_vocab(vocab) % 128 == 0 and 0 <= loss_mod.padded_vocab(vocab) - vocab < 128
    got = _loss_grads(h0, w0, t, chunk=16)
    with monkeypatch.context() as m:
        m.setattr(loss_mod, "padded_vocab", lambda v: v)
        plain = _loss_grads(h0, w0, t, chunk=16)
    h, w = h0.double().requires_grad_(), w0.double().requires_grad_()
    ref = F.cross_entropy(h @ w.t(), t, reduction="sum")
    ref.backward()
    assert torch.isfinite(got[0])
    for a, b, r, name in zip(got, plain, (ref.detach(), h.grad, w.grad), ("loss", "d hidden", "d weight")):
        assert a.shape == b.shape == r.shape, name
        scale = r.abs().max().clamp_min(1e-30)
        err, err_plain = ((a.double() - r).abs().max() / scale), ((b.double() - r).abs().max() / scale)
        assert err < 2e-6 and err_plain < 2e-6, (name, err, err_plain)
        assert (a.double() - b.double()).abs().max() / scale < 2e-6, name  # padded vs unpadded, to that bound
    hb, wb = h0.bfloat16().requires_grad_(), w0.bfloat16().requires_grad_()
    full(hb, wb, t, "sum").backward()
    lb, dh, dw = _loss_grads(h0.bfloat16(), w0.bfloat16(), t, chunk=16)
    torch.testing.assert_close(lb, full(hb, wb, t, "sum").detach(), rtol=1e-5, atol=1e-4)
    for a, r in ((dh, hb.grad), (dw, wb.grad)):  # bf16 roundings, placed differently: close as a whole
        assert a.dtype == torch.bfloat16
        assert (a.double() - r.double()).norm() <= 1e-2 * r.double().norm() + 1e-6


@pytest.mark.parametrize("vocab", [7, 129])
def test_padded_vocabulary_keeps_out_of_range_ids_nan(vocab):
    """An id in [vocab, padded_vocab(vocab)) is still out of range: a NaN loss, as without padding."""
    h, w = torch.randn(3, 8), torch.randn(vocab, 8)
    assert torch.isnan(chunked_cross_entropy(h, w, torch.tensor([0, vocab, -100])))
    assert torch.isfinite(chunked_cross_entropy(h, w, torch.tensor([0, vocab - 1, -100])))


def test_ignored_rows_get_no_gradient():
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(11, 8)
    t = torch.tensor([1, -100, 3, -100, 5, 7])
    chunked_cross_entropy(h, w, t, chunk=4).backward()
    assert h.grad[[1, 3]].abs().sum() == 0 and h.grad[[0, 2, 4, 5]].abs().sum() > 0
    assert chunked_cross_entropy(h, w, torch.full((6,), -100), reduction="mean") == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hidden=torch.randn(4, 8), weight=torch.randn(10, 9)), "hidden, weight: expected"),
        (dict(weight=torch.randn(10, 8, dtype=torch.float64)), "weight: expected torch.float32"),
        (dict(target=torch.zeros(3, dtype=torch.long)), r"target: expected integer class ids of shape \[4\]"),
        (dict(target=torch.zeros(4)), "target: expected integer"),
        (dict(chunk=0), "chunk: expected a positive"),
        (dict(reduction="none"), "reduction: expected"),
    ],
)
def test_bad_input(kwargs, match):
    args = dict(hidden=torch.randn(4, 8), weight=torch.randn(10, 8), target=torch.zeros(4, dtype=torch.long))
    args.update(kwargs)
    h, w, t = args.pop("hidden"), args.pop("weight"), args.pop("target")
    with pytest.raises(ValueError, match=match):
        chunked_cross_entropy(h, w, t, **args)


def _tiny_causal_lm(seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def test_hidden_states_as_logits_on_a_transformers_model():
    model = _tiny_causal_lm()
    ids = torch.randint(0, 64, (2, 9))
    want = model(input_ids=ids, labels=ids).loss
    with hidden_states_as_logits(model) as head:
        h = model(input_ids=ids).logits
    assert h.shape == (2, 9, 32) and model.get_output_embeddings() is head
    target = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    got = chunked_cross_entropy(h.flatten(0, 1), head.weight, target.flatten(), chunk=5, reduction="mean")
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="output embeddings"):
        with hidden_states_as_logits(torch.nn.Module()):
            pass


def _loss_and_grads(model, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    grads = {
        n: p.grad.clone() for n, p in model.named_parameters() if n in ("lm_head.weight", "model.norm.weight")
    }
    return out, grads


@pytest.mark.parametrize("accumulating", [False, True])
def test_fused_causal_lm_loss_matches_transformers(accumulating):
    """fuse_causal_lm_loss: the training loss and gradients of transformers' ForCausalLMLoss (ignored labels,
    num_items_in_batch as the Trainer passes it under gradient accumulation), no logits in the output;
    forwards without labels or grad keep transformers' logits; unfuse restores everything."""
    from moe8.loss import fuse_causal_lm_loss, unfuse_causal_lm_loss

    model = _tiny_causal_lm()
    ids = torch.randint(0, 64, (2, 9))
    labels = ids.clone()
    labels[0, :3] = -100
    extra = dict(num_items_in_batch=torch.tensor(40)) if accumulating else {}
    want, want_grads = _loss_and_grads(model, input_ids=ids, labels=labels, **extra)
    logits = model(input_ids=ids).logits
    assert fuse_causal_lm_loss(model, chunk=5) and fuse_causal_lm_loss(model)  # idempotent
    got, got_grads = _loss_and_grads(model, input_ids=ids, labels=labels, **extra)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert got.logits is None and got["logits"] is None
    torch.testing.assert_close(model(input_ids=ids).logits, logits)  # no labels: transformers' logits
    with torch.no_grad():  # evaluation with labels: transformers' loss and logits
        ev = model(input_ids=ids, labels=labels, **extra)
    torch.testing.assert_close(ev.loss, want.loss.detach())
    torch.testing.assert_close(ev.logits, logits)
    as_tuple = model(input_ids=ids, labels=labels, return_dict=False, **extra)  # transformers' own: a tuple
    torch.testing.assert_close(as_tuple[0], want.loss.detach())
    torch.testing.assert_close(as_tuple[1], logits)
    unfuse_causal_lm_loss(model)
    assert "forward" not in model.lm_head.__dict__ and "_loss_function" not in model.__dict__
    assert model(input_ids=ids, labels=labels).logits.shape == (2, 9, 64)


def test_fused_causal_lm_loss_refuses_what_it_cannot_take_apart():
    from moe8.loss import fuse_causal_lm_loss

    model = _tiny_causal_lm()
    assert not fuse_causal_lm_loss(model.model)  # the base model: no LM head
    with pytest.raises(ValueError, match="chunk"):
        fuse_causal_lm_loss(model, chunk=0)


def test_cross_entropy_rows_op():
    """The kernel op on its own: loss rows and the gradient written over the logits (as torch computes them
    in float32), its fake implementation, and chunk_rows' sizing."""
    from moe8.loss import chunk_rows, cross_entropy_rows

    logits = torch.randn(6, 50) * 3
    target = torch.tensor([0, 49, 7, -100, 3, 3])
    want_loss = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    want_grad = torch.softmax(logits, -1) - torch.nn.functional.one_hot(target.clamp_min(0), 50)
    want_grad[3] = 0
    d = logits.clone()
    torch.testing.assert_close(cross_entropy_rows(d, target, -100), want_loss)
    torch.testing.assert_close(d, want_grad)
    torch.library.opcheck(cross_entropy_rows, (logits.clone(), target, -100))
    assert chunk_rows(torch.empty(151936, 8, dtype=torch.bfloat16)) == 7040
    assert chunk_rows(torch.empty(10**7, 8, dtype=torch.float32)) == 1024


def test_chunks_are_the_fewest_of_equal_size():
    from moe8.loss import _chunks

    assert _chunks(8192, 7040) == [(0, 4096), (4096, 4096)]
    assert _chunks(8193, 7040) == [(0, 4224), (4224, 3969)]
    assert _chunks(1000, 1024) == [(0, 1000)]
    assert _chunks(50, 7) == [(s, 7) for s in range(0, 49, 7)] + [(49, 1)]
    assert _chunks(3, 1) == [(0, 1), (1, 1), (2, 1)] and _chunks(0, 64) == []
    for n, chunk in ((8192, 7040), (20000, 1024), (129, 128), (300, 200)):
        parts = _chunks(n, chunk)
        assert sum(r for _, r in parts) == n and all(r <= chunk for _, r in parts)
        assert len(parts) == -(-n // chunk) and [s for s, _ in parts] == [
            sum(r for _, r in parts[:i]) for i in range(len(parts))
        ]


@pytest.mark.skipif(not _cuda(), reason="no CUDA build or no GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [151936, 50304, 120007, 200000])
def test_cross_entropy_rows_long_rows_on_cuda(dtype, vocab):
    """Rows longer than the kernel stages in shared memory (Qwen3's 151,936 and 200,000 ids: part of the row
    read again from global memory), a row that fits (50,304 bf16), and one that is no whole number of
    16-byte packs (120,007: nothing staged): the loss and the gradient as torch computes them in float32."""
    from moe8.loss import cross_entropy_rows

    g = torch.Generator(device="cuda").manual_seed(vocab)
    logits = (torch.randn(9, vocab, device="cuda", generator=g) * 4).to(dtype)
    target = torch.randint(0, vocab, (9,), device="cuda", generator=g)
    target[2], target[5], target[7] = -100, vocab - 1, 0
    ref = logits.float()
    want_loss = F.cross_entropy(ref, target, reduction="none")
    want_grad = torch.softmax(ref, -1) - F.one_hot(target.clamp_min(0), vocab)
    want_grad[2] = 0
    d = logits.clone()
    torch.testing.assert_close(cross_entropy_rows(d, target, -100), want_loss, rtol=1e-5, atol=1e-5)
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-7)
    torch.testing.assert_close(d, want_grad.to(dtype), **tol)
    again = logits.clone()
    cross_entropy_rows(again, target, -100)
    assert torch.equal(again, d)  # run to run, bitwise
