"""Direct calls (moe8._core): plain eager calls of moe8's ops skip the dispatcher and run the op's own
function (through an autograd.Function built from its registered backward), with the same bits as the
custom-op path; tracing, dispatch modes, meta tensors and keyword calls keep the custom op."""

import contextlib

import pytest
import torch
from conftest import devices

import moe8
from moe8 import _core, layer, ops


@pytest.fixture
def direct():
    """Yields a setter: direct(False) sends moe8's op calls through the dispatcher (moe8._core.dispatched())
    until direct(True)."""
    stack = contextlib.ExitStack()

    def set_direct(on: bool) -> None:
        if on:
            stack.close()
        else:
            stack.enter_context(_core.dispatched())

    yield set_direct
    stack.close()


def both_ways(direct, run):
    """run() with direct calls off, then on: the two results."""
    direct(False)
    a = run()
    direct(True)
    return a, run()


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def layer_step(device, scheme="softmax", fp8=None, lora=False, dtype=torch.float32, seed=0):
    """A whole MoE layer forward + backward: the output and every gradient."""
    torch.manual_seed(seed)
    T, H, I, E, K, r = 24, 128, 64, 4, 2, 4
    x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
    params = [
        (torch.randn(E, H, device=device) * H**-0.5).to(dtype).requires_grad_(),
        (torch.randn(E, 2 * I, H, device=device) * H**-0.5).to(dtype).requires_grad_(),
        (torch.randn(E, H, I, device=device) * I**-0.5).to(dtype).requires_grad_(),
    ]
    factors = [torch.randn(*s, device=device) * 0.3 for s in ((E, r, H), (E, 2 * I, r), (E, r, I), (E, H, r))]
    factors = [f.to(dtype).requires_grad_() for f in factors] if lora else []
    extra = {"fp8": fp8} if fp8 else {}
    if lora:
        extra["lora"] = layer.ExpertLoRA(*factors, scaling=2.0)
    bias = torch.randn(E, device=device) if scheme == "sigmoid_group" else None
    y, route = moe8.moe_forward(x, *params, K, scheme, True, bias, **extra)
    loss = y.float().square().sum() + moe8.load_balancing_loss(route)
    return [y.detach(), *torch.autograd.grad(loss, [x, *params, *factors])]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("scheme", ["softmax", "sigmoid_group", "topk_softmax"])
def test_layer_same_bits(device, scheme, direct):
    assert_same(*both_ways(direct, lambda: layer_step(device, scheme)))


@pytest.mark.parametrize("device", devices())
def test_lora_and_fp8_same_bits(device, direct):
    assert_same(*both_ways(direct, lambda: layer_step(device, lora=True)))
    bf16 = torch.bfloat16
    assert_same(*both_ways(direct, lambda: layer_step(device, fp8="blockwise", dtype=bf16)))


@pytest.mark.parametrize("device", devices())
def test_rope_and_consuming_activation_same_bits(device, direct):
    def run():
        torch.manual_seed(4)
        x = torch.randn(2, 5, 3, 16, device=device, requires_grad=True)
        cos, sin = torch.randn(2, 3, 16, device=device), torch.randn(2, 3, 16, device=device)
        h = torch.randn(10, 12, device=device, requires_grad=True)
        y = ops.rope(x, cos, sin)
        a = ops.activation_consuming(h * 1.0, 0, False, 1.702, 7.0)
        return [y.detach(), a.detach(), *torch.autograd.grad(y.sum() + a.square().sum(), [x, h])]

    assert_same(*both_ways(direct, run))


def dispatched(fn) -> set:
    """Names of the moe8 ops that went through the dispatcher while fn ran (profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("moe8::")}


def test_direct_calls_skip_the_dispatcher(direct):
    direct(False)
    assert {
        "moe8::route",
        "moe8::plan",
        "moe8::gathered_linear",
        "moe8::activation_down_combine",
    } <= dispatched(lambda: layer_step("cpu"))
    direct(True)
    assert dispatched(lambda: layer_step("cpu")) == set()
    ids = torch.randint(0, 4, (6, 2), dtype=torch.int32)  # a keyword argument takes the custom op
    assert dispatched(lambda: ops.plan(ids, 4, 1, check_ids=False)) == {"moe8::plan"}
    h, d = torch.randn(5, 8), torch.randn(5, 4)  # an op writing its input h bumps h's version as the op would
    v = h._version
    assert dispatched(lambda: ops.activation_backward_(h, d, 0, False, 1.702, 7.0)) == set()
    assert h._version == v + 1


@pytest.mark.parametrize("use_direct", [False, True])
def test_second_backward_through_consumed_h_of_down_combine_raises(direct, use_direct):
    """activation_down_combine with consume_h: the backward writes d h over h (version bumped on both paths),
    so a second backward through the graph raises instead of reading d h as h."""
    direct(use_direct)
    torch.manual_seed(6)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1], [1, 0]], dtype=torch.int32)
    _, offsets, row_to_slot, slot_to_row = ops.plan(ids, 2, 1, True)
    x = torch.randn(12, 8, requires_grad=True)
    w, b = torch.randn(2, 16, 8, requires_grad=True), torch.randn(2, 6, 8, requires_grad=True)
    weights = torch.rand(6, 2, requires_grad=True)
    h = ops.grouped_gemm(x, w, offsets, 0, None)
    y = moe8.fused.activation_down_combine(
        h, b, offsets, 0, weights, slot_to_row, row_to_slot, 0, False, 1.702, 7.0, True
    )
    g = torch.randn_like(y)
    torch.autograd.grad(y, [x, weights], g, retain_graph=True)
    with pytest.raises(RuntimeError, match="consume_gate_up: a second backward through this graph"):
        torch.autograd.grad(y, [x], g)


def test_modes_and_meta_tensors_take_the_custom_op(direct):
    direct(True)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False):  # a TorchDispatchMode
        assert dispatched(lambda: layer_step("cpu")) >= {"moe8::route", "moe8::grouped_gemm"}
    x, b = torch.empty(12, 8, device="meta"), torch.empty(3, 6, 8, device="meta")
    offsets = torch.empty(4, dtype=torch.int32, device="meta")
    assert ops.grouped_gemm(x, b, offsets, 0, None).shape == (12, 6)  # the fake implementation


def test_second_backward_through_consumed_h_still_raises(direct):
    """The in-place activation backward bumps h's version counter on the direct path too, so a second
    backward through the consumed h fails loudly."""
    direct(True)
    torch.manual_seed(5)
    offsets = torch.tensor([0, 5, 12], dtype=torch.int32)
    x = torch.randn(12, 8, requires_grad=True)
    w, b = torch.randn(2, 16, 8, requires_grad=True), torch.randn(2, 6, 8, requires_grad=True)
    h = ops.grouped_gemm(x, w, offsets, 0, None)
    o = moe8.fused.activation_linear(h, b, offsets, 0, None, 0, False, 1.702, 7.0, True)
    g = torch.randn_like(o)
    torch.autograd.grad(o, [x], g, retain_graph=True)
    with pytest.raises(RuntimeError, match="consume_gate_up: a second backward through this graph"):
        torch.autograd.grad(o, [x], g)


def test_torch_compile_traces_the_custom_ops(direct):
    direct(True)
    torch.manual_seed(2)
    mod = moe8.MoELayer(16, 12, 4, 2)
    x = torch.randn(20, 16, requires_grad=True)

    def step(x):
        y, r = mod(x)
        return y.square().sum() + moe8.load_balancing_loss(r)

    eager = step(x)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager)
    g = torch.autograd.grad(compiled, [x, *mod.parameters()])
    g_eager = torch.autograd.grad(step(x), [x, *mod.parameters()])
    for a, b in zip(g, g_eager):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
