"""The down projection's input gradient with the routed activation backward in one call
(moe8.fused.dgrad_activation_backward, Config.fused_act_dgrad): against the GEMM and the separate pass it
replaces, on the CPU (where it is those two calls) and on an sm_90a GPU (one kernel, the activation backward in
the GEMM's epilogue: the same bits for d h and w * act(h), the routing weights' gradient summed in another
order)."""

import pytest
import torch
from conftest import devices

import moe8
from moe8._core import C, sm90_workspace
from moe8._core import stream as current_stream

ops, fused = moe8.ops, moe8.fused


def _on_sm90() -> bool:
    return (
        moe8.cuda_available() and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    )


def _problem(device, dtype, R, H, I, offsets, act, seed=3):
    """rows [R, H], down's dgrad operand [E, H, I] (layout 1), h, routing weights, a row_to_slot with padding
    rows (-1) inside the groups; offsets[E] may stop short of R (rows past it belong to no group)."""
    g = torch.Generator().manual_seed(seed)
    E = len(offsets) - 1
    width = I if act == "gelu" else 2 * I
    rows = torch.randn(R, H, generator=g).to(dtype)
    w = (torch.randn(E, H, I, generator=g) * H**-0.5).to(dtype)
    h = torch.randn(R, width, generator=g).to(dtype)
    slots = 2 * R
    weights = torch.rand(slots, generator=g)
    row_to_slot = torch.randperm(slots, generator=g)[:R].to(torch.int32)
    row_to_slot[torch.rand(R, generator=g) < 0.05] = -1
    offs = torch.tensor(offsets, dtype=torch.int32)
    return [t.to(device) for t in (rows, w, h, weights.view(-1, 2), row_to_slot, offs)]


def _separate(rows, w, offsets, h, weights, row_to_slot, act_args):
    """The two calls dgrad_activation_backward replaces: the plain dgrad, then the routed activation backward."""
    d_act = ops.grouped_gemm(rows, w, offsets, 1, None)
    dh, d_weights = fused.activation_backward_routed(h, d_act, weights, row_to_slot, *act_args)
    return d_act, dh, d_weights


def _close_sums(a, b):
    """Two float32 sums of the same products in different orders: within their rounding (measured on an H200:
    up to 1.6e-5 apart at 768 terms, where the largest sums are ~1-10)."""
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(b.abs().max().item(), 1.0))


ACTS = [("swiglu", False), ("swiglu", True), ("swiglu_clamped", True), ("gelu", False)]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act, interleaved", ACTS)
@pytest.mark.parametrize("consume", [False, True])
def test_dgrad_activation_backward_is_the_gemm_then_the_pass(device, act, interleaved, consume):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    R, H, I = 300, 64, 48
    rows, w, h, weights, row_to_slot, offsets = _problem(device, dtype, R, H, I, [0, 90, 90, 200, 280], act)
    act_args = (ops.ACTIVATIONS[act], interleaved, 1.702, 7.0)
    a_ref, dh_ref, dw_ref = _separate(rows, w, offsets, h, weights, row_to_slot, act_args)
    if consume:
        h2 = h.clone()
        a_w, d_weights = fused.dgrad_activation_backward_(
            rows, w, offsets, 1, h2, weights, row_to_slot, *act_args
        )
        dh = h2
    else:
        a_w, dh, d_weights = fused.dgrad_activation_backward(
            rows, w, offsets, 1, h, weights, row_to_slot, *act_args
        )
    assert torch.equal(a_w, a_ref)
    assert torch.equal(dh, dh_ref)
    torch.testing.assert_close(d_weights, dw_ref, rtol=1e-5, atol=1e-6)


def test_dgrad_activation_backward_names_a_bad_partials():
    rows, w, h, weights, row_to_slot, offsets = _problem(
        "cpu", torch.float32, 40, 16, 8, [0, 20, 40], "swiglu"
    )
    a_w, d_weights = torch.empty(40, 8), torch.zeros_like(weights)
    with pytest.raises(ValueError, match="partials"):
        C.grouped_gemm_act_backward(
            rows,
            w,
            offsets,
            1,
            h,
            weights.view(-1),
            row_to_slot,
            0,
            False,
            1.702,
            7.0,
            h,
            a_w,
            torch.empty(40, 3),
            d_weights.view(-1),
            0,
            True,
            None,
        )


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU and moe8's CUDA kernels")
@pytest.mark.parametrize("H, I", [(512, 384), (256, 768)], ids=["I384-two-tiles", "I768-three-tiles"])
@pytest.mark.parametrize("act, interleaved", ACTS)
def test_fused_epilogue_on_sm90_is_the_same_bits(H, I, act, interleaved):
    """At ~250 rows per expert the dgrad takes the 128x256 tiles, so the fused kernel runs for SwiGLU with h as
    [gate | up] (the binding says so; the other activations take the two calls): w * act(h) and d h are the
    plain dgrad + pass's bits in the groups' rows and zero past them, the weights' gradient within float
    rounding of its other order, and run-to-run the same bits."""
    R = 1100
    rows, w, h, weights, row_to_slot, offsets = _problem(
        "cuda", torch.bfloat16, R, H, I, [0, 300, 300, 700, 1000], act, seed=11
    )
    act_args = (ops.ACTIVATIONS[act], interleaved, 1.702, 7.0)
    parts = C.grouped_gemm_act_backward_parts(I)

    def run():
        a_w, dh = torch.empty(R, I, device="cuda", dtype=torch.bfloat16), torch.full_like(h, float("nan"))
        partials = torch.empty(R, parts, device="cuda")
        d_weights = torch.zeros_like(weights)
        ran = C.grouped_gemm_act_backward(
            rows,
            w,
            offsets,
            1,
            h,
            weights.view(-1),
            row_to_slot,
            *act_args,
            dh,
            a_w,
            partials,
            d_weights.view(-1),
            current_stream(rows),
            True,
            sm90_workspace(rows, w.shape[0]),
        )
        return ran, a_w, dh, d_weights

    ran, a_w, dh, d_weights = run()
    fusable = act == "swiglu" and not interleaved
    assert ran == fusable, f"the fused kernel ran: {ran}, expected {fusable}"
    a_ref, dh_ref, dw_ref = _separate(rows, w, offsets, h, weights, row_to_slot, act_args)
    # rows past offsets[E] are in no group: the fused kernel writes zeros there, the separate pass w * act(h)
    end = int(offsets[-1]) if ran else len(a_w)
    assert torch.equal(a_w[:end], a_ref[:end]) and not a_w[end:].any()
    assert torch.equal(dh, dh_ref) and (not ran or not dh[end:].any())
    _close_sums(d_weights, dw_ref)
    _, a2, dh2, dw2 = run()
    assert torch.equal(a2, a_w) and torch.equal(dh2, dh) and torch.equal(dw2, d_weights)


@pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU and moe8's CUDA kernels")
@pytest.mark.parametrize("consume", [True, False])
def test_experts_with_the_fused_dgrad_match_on_sm90(consume):
    """The whole experts' forward and backward with Config.fused_act_dgrad on and off at a Qwen3-like width:
    the output and the input and weight gradients the same bits, the routing weights' gradient within rounding;
    the fused backward deterministic."""
    T, H, I, E, K = 2048, 1024, 384, 16, 8
    g = torch.Generator(device="cuda").manual_seed(2)
    x0 = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    gu = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H**-0.5).to(torch.bfloat16)
    dn = (torch.randn(E, H, I, device="cuda", generator=g) * I**-0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).int()
    w0 = torch.rand(T, K, device="cuda", generator=g)

    def run(fuse):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        ws = [gu.clone().requires_grad_(), dn.clone().requires_grad_()]
        cfg = moe8.Config(fused_act_dgrad=fuse, consume_gate_up=consume)
        y = moe8.experts_forward(x, ids, w, *ws, config=cfg)
        dx, dw, dgu, ddn = torch.autograd.grad(y.float().square().sum(), [x, w, *ws])
        return y, dx, dgu, ddn, dw

    fused_run, again, plain = run(True), run(True), run(False)
    for a, b in zip(fused_run, again):
        assert torch.equal(a, b)
    for name, a, b in zip(["y", "d x", "d gate_up", "d down"], fused_run[:4], plain[:4]):
        assert torch.equal(a, b), name
    _close_sums(fused_run[4], plain[4])
