"""Rows of packed documents through varlen flash attention (moe8.attention.packed_attention_forward,
Config.packed_attention): the documents' offsets made from position_ids (packed_sequences, padded with empty
documents to a fixed count), enable() / disable() putting it in place of transformers' "sdpa" function and back,
and every call it cannot take running sdpa itself (the CPU: the same bits as without moe8). On a GPU: the
output and the q, k, v gradients against attention through the block-diagonal causal mask (grouped-query and
plain heads, padded offsets, a sliding window), a tiny Qwen3-MoE's loss and gradients with the offsets against
without them, and the same with its checkpointed layers replayed as CUDA graphs."""

import pytest
import torch
from conftest import _cuda

from moe8.attention import packed_attention_forward, packed_sequences, varlen_unsupported
from moe8.finetune.packing import longest_document, most_documents, positions

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
needs_cuda_build = pytest.mark.skipif(not _cuda(), reason="no CUDA build or no GPU")


def position_ids(lengths):
    """[B, S] positions of rows holding documents of these lengths (each row's lengths sum to S)."""
    S = sum(lengths[0])
    start = torch.zeros(len(lengths), S, dtype=torch.bool)
    for r, row in enumerate(lengths):
        assert sum(row) == S
        start[r, torch.tensor([0, *row[:-1]]).cumsum(0)] = True
    return positions(start).long()


def test_packed_sequences_gives_the_documents_offsets():
    pos = position_ids([[3, 5, 2], [10]])
    kw = packed_sequences(pos)
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 8, 10, 20] and kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"] and kw["max_length_q"] == kw["max_length_k"] == 10
    padded = packed_sequences(pos, max_sequences=6)["cu_seq_lens_q"]
    assert padded.tolist() == [0, 3, 8, 10, 20, 20, 20]  # two empty documents at the end
    with pytest.raises(ValueError, match="4 documents in the rows, more than max_sequences = 3"):
        packed_sequences(pos, max_sequences=3)
    with pytest.raises(ValueError, match=r"position_ids: expected \[B, S\] on the host, got \(20,\)"):
        packed_sequences(pos.flatten())
    # a row that starts inside a document (positions not restarting at 0) still starts a document
    assert packed_sequences(torch.tensor([[5, 6, 0, 1]]))["cu_seq_lens_q"].tolist() == [0, 2, 4]
    short = position_ids([[3, 5, 2], [4, 6]])
    assert packed_sequences(short)["max_length_q"] == 6  # the longest document, not S
    assert packed_sequences(short, max_length=8)["max_length_k"] == 8  # a bound for every batch
    assert packed_sequences(short, max_length=99)["max_length_q"] == 10  # at most S
    with pytest.raises(ValueError, match="a document of 6 tokens in the rows, longer than max_length = 5"):
        packed_sequences(short, max_length=5)


def test_most_and_longest_documents():
    pos = position_ids([[3, 5, 2], [10], [1, 1, 1, 7], [5, 5]])
    assert most_documents(pos, 1) == 4 and most_documents(pos, 2) == 7 and most_documents(pos, 9) == 10
    assert most_documents(pos[:0], 2) == 0
    assert longest_document(pos) == 10 and longest_document(pos[2:]) == 7 and longest_document(pos[:0]) == 0


class _Layer(torch.nn.Module):
    is_causal = True


def _qkv(B, H, Hkv, S, D, device, dtype, seed=0):
    g = torch.Generator(device).manual_seed(seed)
    return [torch.randn(B, h, S, D, device=device, dtype=dtype, generator=g) for h in (H, Hkv, Hkv)]


def test_calls_varlen_cannot_take_run_sdpa():
    q, k, v = _qkv(2, 4, 2, 10, 16, "cpu", torch.float32)
    kw = packed_sequences(position_ids([[3, 7], [10]]))
    layer = _Layer()
    assert "on cpu" in varlen_unsupported(layer, q, k, v, 0.0, None, kw)
    assert "no documents' offsets" in varlen_unsupported(layer, q, k, v, 0.0, None, {})
    pytest.importorskip("transformers", minversion="5.0")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer.num_key_value_groups = 2
    mask = torch.ones(2, 1, 10, 10, dtype=torch.bool).tril()
    out, _ = packed_attention_forward(layer, q, k, v, mask, scaling=0.25, **kw)
    ref, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.25)
    assert torch.equal(out, ref)


def test_enable_puts_it_in_place_of_sdpa_and_disable_restores():
    pytest.importorskip("transformers", minversion="5.0")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from moe8 import hf

    hf.disable()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    try:
        hf.enable(packed_attention=False)
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
        hf.disable()
        hf.enable()
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is packed_attention_forward
    finally:
        hf.disable()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


def _tiny(device, dtype, seed=0):
    from test_graphs import TINY
    from test_hf import build

    # output_router_logits off: transformers recording router logits keeps layers off CUDA graphs
    model = build("qwen3_moe", seed=seed, **TINY, output_router_logits=False).to(device, dtype)
    model.set_attn_implementation("sdpa")
    model.config.use_cache = False  # as training runs (with a cache transformers makes no per-document mask)
    return model


def _loss_and_grads(model, ids, pos, kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, position_ids=pos, labels=ids, **kw)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_model_on_the_cpu_runs_the_same_with_the_offsets():
    pytest.importorskip("transformers", minversion="5.0")
    from moe8 import hf

    try:
        hf.enable()
        model = _tiny("cpu", torch.float32)
        pos = position_ids([[5, 20, 7], [32]])
        ids = torch.randint(3, 128, pos.shape, generator=torch.Generator().manual_seed(1))
        loss, grads = _loss_and_grads(model, ids, pos, {})
        loss_kw, grads_kw = _loss_and_grads(model, ids, pos, packed_sequences(pos, 8))
    finally:
        hf.disable()
    assert torch.equal(loss, loss_kw) and all(torch.equal(grads[n], grads_kw[n]) for n in grads)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _masked_reference(q, k, v, pos, scale, window):
    """fp32 attention through the block-diagonal causal mask transformers builds from position_ids."""
    from moe8.finetune.packing import document_ids

    B, H, S, D = q.shape
    doc = document_ids(pos).to(q.device)
    i, j = torch.arange(S, device=q.device)[:, None], torch.arange(S, device=q.device)[None, :]
    allowed = (doc[:, :, None] == doc[:, None, :]) & (j <= i)
    if window is not None:
        allowed &= i - j < window
    g = H // k.shape[1]
    kx, vx = (t.float().repeat_interleave(g, 1) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(
        q.float(), kx, vx, attn_mask=allowed[:, None], scale=scale
    ).transpose(1, 2)


@gpu
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize(
    "pad, window", [(None, None), (12, None), (12, 9)], ids=["exact", "padded", "sliding"]
)
def test_varlen_matches_the_masked_attention(heads, D, pad, window):
    H, Hkv = heads
    pos = position_ids([[40, 3, 60, 25], [1, 127], [128]])
    B, S = pos.shape
    leaves = [t.requires_grad_() for t in _qkv(B, H, Hkv, S, D, "cuda", torch.bfloat16, seed=D)]
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    kw = packed_sequences(pos, pad, "cuda")
    layer = _Layer()
    assert varlen_unsupported(layer, *leaves, 0.0, None, kw) is None
    out, _ = packed_attention_forward(layer, *leaves, None, scaling=D**-0.5, sliding_window=window, **kw)
    ref = _masked_reference(*ref_leaves, pos, D**-0.5, window)
    assert out.shape == (B, S, H, D) and out.dtype == torch.bfloat16
    assert rel(out, ref) < 1e-2
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.float())
    for a, b in zip(leaves, ref_leaves):
        assert rel(a.grad, b.grad) < 2e-2


@needs_cuda_build
def test_a_model_with_the_offsets_matches_the_masked_model(monkeypatch):
    """Every layer's attention runs varlen flash given the offsets; the first layer's attention output (before
    any routing, whose top-k a rounding can flip) matches the masked model's, and so do the loss and the
    gradients as a whole."""
    import moe8.attention as attention
    from moe8 import hf

    calls, varlen = [], attention._varlen()
    monkeypatch.setattr(attention, "_varlen", lambda: lambda *a, **k: calls.append(1) or varlen(*a, **k))
    try:
        hf.enable()
        model = _tiny("cuda", torch.bfloat16)
        seen = []
        model.model.layers[0].self_attn.register_forward_hook(lambda m, i, o: seen.append(o[0].detach()))
        pos = position_ids([[5, 60, 30, 33], [128]])
        ids = torch.randint(3, 128, pos.shape, generator=torch.Generator().manual_seed(1)).cuda()
        loss, grads = _loss_and_grads(model, ids, pos.cuda(), {})
        assert not calls
        loss_kw, grads_kw = _loss_and_grads(model, ids, pos.cuda(), packed_sequences(pos, 8, "cuda"))
        assert len(calls) == model.config.num_hidden_layers
    finally:
        hf.disable()
    assert rel(seen[1], seen[0]) < 1e-2
    assert abs(loss.item() - loss_kw.item()) < 1e-2 * abs(loss.item())
    flat = [torch.cat([g[n].float().flatten() for n in sorted(grads)]) for g in (grads_kw, grads)]
    assert rel(*flat) < 5e-2


@needs_cuda_build
def test_graphs_replay_layers_given_the_offsets():
    """Checkpointed layers captured as CUDA graphs with the offsets among their inputs: every call after the
    capture replays, documents that change from batch to batch (same padded count) included, and the losses are
    the eager run's."""
    from moe8 import graphs, hf

    rows = [[[5, 60, 30, 33], [128]], [[100, 28], [1, 2, 3, 122]], [[64, 64], [20, 108]]]
    try:
        hf.enable()
        losses = {}
        for graphed in (False, True):
            model = _tiny("cuda", torch.bfloat16)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            if graphed:
                graphs.capture_layers(model)
            losses[graphed] = []
            for step in range(4):
                pos = position_ids(rows[step % 3])
                ids = torch.randint(3, 128, pos.shape, generator=torch.Generator().manual_seed(step)).cuda()
                kw = packed_sequences(pos, 8, "cuda", max_length=128)  # the same for every batch
                loss, _ = _loss_and_grads(model, ids, pos.cuda(), kw)
                losses[graphed].append(loss.item())
            if graphed:
                stats = graphs.stats(model)
    finally:
        hf.disable()
    assert stats["eager"] == stats["layers"] and stats["replayed"] == 3 * stats["layers"], (
        stats
    )  # step 0 warms up
    assert stats["reasons"] == {"warming up": stats["layers"]}, stats
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)
