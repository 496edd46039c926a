"""Bad input never crashes and never yields garbage: each op raises ValueError naming the argument and
stating what was expected and what it got."""

import pytest
import torch

import moe8
from moe8 import reference
from moe8.ops import _C


def i32(*shape, fill=0):
    return torch.full(shape, fill, dtype=torch.int32)


def f32(*shape):
    return torch.zeros(*shape)


def raises(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


def test_route_errors():
    lg = torch.randn(8, 6)
    ok = dict(ids=i32(8, 2), weights=f32(8, 2), pm=f32(6), tf=f32(6), lse=f32(8))

    def call(logits=lg, bias=None, scheme=0, k=2, ng=1, tg=1, **kw):
        o = {**ok, **kw}
        _C.route_forward(
            logits, bias, scheme, k, True, ng, tg, 1.0, o["ids"], o["weights"], o["pm"], o["tf"], o["lse"], 0
        )

    call()  # the valid call passes
    raises(r"logits: expected dtype float32 or float16 or bfloat16, got int32", call, i32(8, 6))
    raises(r"logits: expected a 2-d tensor", call, torch.randn(8, 6, 1))
    raises(r"logits: expected a contiguous tensor", call, torch.randn(6, 8).t())
    raises(r"k: expected 1 <= k <= min\(num_experts=6", call, lg, None, 0, 7)
    raises(r"k: expected", call, lg, None, 0, 0)
    raises(r"ids: expected shape \[8, 2\], got \[8, 3\]", call, ids=i32(8, 3))
    raises(r"ids: expected dtype int32, got int64", call, ids=torch.zeros(8, 2, dtype=torch.long))
    raises(
        r"weights: expected dtype float32, got bfloat16",
        call,
        weights=torch.zeros(8, 2, dtype=torch.bfloat16),
    )
    raises(r"lse: expected shape \[8\]", call, lse=f32(7))
    raises(r"n_group: expected a divisor of num_experts=6, got 4", call, lg, None, 1, 2, 4, 1)
    raises(r"topk_group: expected 1..n_group=3, got 4", call, lg, None, 1, 2, 3, 4)
    raises(r"topk_group: the 1 chosen groups hold 2 experts, fewer than k=3", call, lg, None, 1, 3, 3, 1)
    raises(r"bias: expected shape \[6\], got \[5\]", call, lg, f32(5), 1, 2)
    raises(r"scheme: expected 0 \(softmax\)", call, lg, None, 7)
    with pytest.raises(ValueError, match=r"scheme: expected one of"):
        moe8.route(lg, 2, "sparsemax")


def test_route_backward_rejects_bad_ids():
    lg = torch.randn(4, 5)
    with pytest.raises(ValueError, match=r"ids: expected values in \[0, 5\), found 1 out of range"):
        _C.route_backward(
            lg,
            None,
            0,
            2,
            False,
            1,
            1,
            1.0,
            torch.tensor([[0, 1]] * 3 + [[0, 9]], dtype=torch.int32),
            f32(4, 2),
            None,
            None,
            f32(4, 5),
            0,
            True,
        )


def test_plan_errors():
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)

    def call(ids=ids, E=4, pad=1, counts=None, offsets=None, r2s=None, s2r=None):
        _C.build_dispatch_plan(
            ids,
            E,
            pad,
            i32(E) if counts is None else counts,
            i32(E + 1) if offsets is None else offsets,
            i32(_C.plan_max_rows(ids.numel(), E, pad)) if r2s is None else r2s,
            i32(ids.numel()) if s2r is None else s2r,
            None,
            0,
            True,
        )

    call()
    raises(r"ids: expected values in \[0, 3\), found 1 out of range", call, ids, 3)
    raises(
        r"ids: expected values in \[0, 4\), found 1 out of range",
        call,
        torch.tensor([[0, -1], [2, 3]], dtype=torch.int32),
    )
    raises(r"pad_multiple: expected >= 1, got 0", call, ids, 4, 0)
    raises(r"num_experts: expected 1..512, got 0", call, ids, 0)
    raises(r"offsets: expected shape \[5\], got \[4\]", call, offsets=i32(4))
    raises(r"row_to_slot: expected at least 4 rows", call, r2s=i32(3))
    raises(r"slot_to_row: expected dtype int32, got float32", call, s2r=f32(4))
    raises(r"ids: expected dtype int32, got int64", call, ids.long())
    with pytest.raises(ValueError, match=r"ids: expected expert ids in \[0, 4\).*found 1 out of range"):
        moe8.experts_forward(
            torch.randn(2, 8), ids + 1, torch.ones(2, 2), torch.randn(4, 6, 8), torch.randn(4, 8, 3)
        )


def test_row_movement_errors():
    x = torch.randn(4, 8)
    r2s = torch.arange(8, dtype=torch.int32)
    raises(
        r"row_to_slot: expected values in \[-1, 8\), found 1 out of range",
        _C.gather_rows,
        x,
        torch.tensor([0, 8], dtype=torch.int32),
        2,
        None,
        f32(2, 8),
        0,
        True,
    )
    raises(r"dst: expected shape \[8, 8\], got \[8, 7\]", _C.gather_rows, x, r2s, 2, None, f32(8, 7), 0, True)
    raises(
        r"dst: expected dtype float32 \(same as src\), got bfloat16",
        _C.gather_rows,
        x,
        r2s,
        2,
        None,
        torch.zeros(8, 8, dtype=torch.bfloat16),
        0,
        True,
    )
    raises(r"scale: expected 8 elements", _C.gather_rows, x, r2s, 2, f32(7), f32(8, 8), 0, True)
    rows = torch.randn(8, 8)
    s2r = torch.arange(8, dtype=torch.int32).view(4, 2)
    raises(
        r"slot_to_row: expected values in \[-1, 8\)", _C.combine_rows, rows, s2r + 1, None, f32(4, 8), 0, True
    )
    raises(
        r"weights: expected shape \[4, 2\], got \[4, 3\]",
        _C.combine_rows,
        rows,
        s2r,
        f32(4, 3),
        f32(4, 8),
        0,
        True,
    )
    raises(r"out: expected shape \[4, 8\]", _C.combine_rows, rows, s2r, None, f32(3, 8), 0, True)
    raises(
        r"d_weights: expected dtype float32",
        _C.combine_weights_grad,
        x,
        rows,
        s2r,
        torch.zeros(4, 2, dtype=torch.float16),
        0,
        True,
    )
    raises(
        r"rows: expected dtype float32 \(same as dy\)",
        _C.combine_weights_grad,
        x,
        rows.half(),
        s2r,
        f32(4, 2),
        0,
        True,
    )


def test_grouped_gemm_errors():
    a, b = torch.randn(10, 8), torch.randn(3, 6, 8)
    off = torch.tensor([0, 4, 4, 10], dtype=torch.int32)
    _C.grouped_gemm(a, b, off, 0, None, f32(10, 6), 0, True)
    raises(
        r"b: expected shape \[3, \*, 8\], got \[3, 6, 7\]",
        _C.grouped_gemm,
        a,
        torch.randn(3, 6, 7),
        off,
        0,
        None,
        f32(10, 6),
        0,
        True,
    )
    raises(r"b: expected shape \[3, 8, \*\]", _C.grouped_gemm, a, b, off, 1, None, f32(10, 6), 0, True)
    raises(
        r"b: expected dtype float32 \(same as a\), got bfloat16",
        _C.grouped_gemm,
        a,
        b.bfloat16(),
        off,
        0,
        None,
        f32(10, 6),
        0,
        True,
    )
    raises(
        r"offsets: expected nondecreasing values",
        _C.grouped_gemm,
        a,
        b,
        torch.tensor([0, 5, 4, 10], dtype=torch.int32),
        0,
        None,
        f32(10, 6),
        0,
        True,
    )
    raises(
        r"offsets: expected offsets\[E\] <= 10 rows, got 11",
        _C.grouped_gemm,
        a,
        b,
        torch.tensor([0, 4, 4, 11], dtype=torch.int32),
        0,
        None,
        f32(10, 6),
        0,
        True,
    )
    raises(
        r"offsets: expected offsets\[0\] == 0",
        _C.grouped_gemm,
        a,
        b,
        torch.tensor([1, 4, 4, 10], dtype=torch.int32),
        0,
        None,
        f32(10, 6),
        0,
        True,
    )
    raises(r"offsets: expected shape \[4\]", _C.grouped_gemm, a, b, off[:3], 0, None, f32(10, 6), 0, True)
    raises(r"bias: expected shape \[3, 6\]", _C.grouped_gemm, a, b, off, 0, f32(3, 5), f32(10, 6), 0, True)
    raises(r"c: expected shape \[10, 6\]", _C.grouped_gemm, a, b, off, 0, None, f32(10, 5), 0, True)
    raises(
        r"layout: expected 0 \(nk\) or 1 \(kn\), got 2",
        _C.grouped_gemm,
        a,
        b,
        off,
        2,
        None,
        f32(10, 6),
        0,
        True,
    )
    raises(
        r"db: expected shape \[3, 6, 8\], got \[3, 8, 6\]",
        _C.grouped_gemm_wgrad,
        a,
        f32(10, 6),
        off,
        0,
        f32(3, 8, 6),
        None,
        0,
        True,
    )
    raises(
        r"dbias: expected dtype float32 \(same as db\)",
        _C.grouped_gemm_wgrad,
        a,
        f32(10, 6),
        off,
        0,
        f32(3, 6, 8),
        torch.zeros(3, 6, dtype=torch.bfloat16),
        0,
        True,
    )
    raises(
        r"dc: expected shape \[10, \*\]",
        _C.grouped_gemm_wgrad,
        a,
        f32(9, 6),
        off,
        0,
        f32(3, 6, 8),
        None,
        0,
        True,
    )


def test_activation_errors():
    h = torch.randn(5, 12)
    raises(
        r"h: a gated activation expects h.shape\[1\] == 2 \* out.shape\[1\] = 10, got 12",
        _C.activation_forward,
        h,
        0,
        False,
        1.702,
        7.0,
        f32(5, 5),
        0,
    )
    raises(r"h: an ungated activation expects", _C.activation_forward, h, 2, False, 1.702, 7.0, f32(5, 6), 0)
    raises(r"activation: expected 0 \(swiglu\)", _C.activation_forward, h, 9, False, 1.702, 7.0, f32(5, 6), 0)
    raises(
        r"dh: expected shape \[5, 12\]",
        _C.activation_backward,
        h,
        f32(5, 6),
        0,
        False,
        1.702,
        7.0,
        f32(5, 6),
        0,
    )
    raises(
        r"out: expected dtype float32 \(same as h\)",
        _C.activation_forward,
        h,
        0,
        False,
        1.702,
        7.0,
        torch.zeros(5, 6, dtype=torch.float16),
        0,
    )


def test_python_front_errors():
    with pytest.raises(ValueError, match=r"layout: expected one of \['kn', 'nk'\], got 'mk'"):
        moe8.experts_forward(
            torch.randn(2, 8),
            torch.zeros(2, 1, dtype=torch.int32),
            torch.ones(2, 1),
            torch.randn(2, 6, 8),
            torch.randn(2, 8, 3),
            layout="mk",
        )
    with pytest.raises(ValueError, match=r"weights: expected shape \[2, 1\] \(same as ids\), got \[2, 2\]"):
        moe8.experts_forward(
            torch.randn(2, 8),
            torch.zeros(2, 1, dtype=torch.int32),
            torch.ones(2, 2),
            torch.randn(2, 6, 8),
            torch.randn(2, 8, 3),
        )
    with pytest.raises(ValueError, match=r"x: expected a 2-d tensor"):
        moe8.experts_forward(
            torch.randn(8),
            torch.zeros(2, 1, dtype=torch.int32),
            torch.ones(2, 1),
            torch.randn(2, 6, 8),
            torch.randn(2, 8, 3),
        )
    with pytest.raises(
        ValueError, match=r"gate_up: expected x's hidden size H = 8 \(dim 2\), got shape \[2, 6, 7\]"
    ):
        moe8.experts_forward(
            torch.randn(2, 8),
            torch.zeros(2, 1, dtype=torch.int32),
            torch.ones(2, 1),
            torch.randn(2, 6, 7),
            torch.randn(2, 8, 3),
        )


def _moe_inputs(T=5, H=8, I=6, E=4, K=2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, ids, torch.rand(T, K, generator=g), gate_up, down


def test_composites_name_the_callers_argument():
    x, ids, w, gu, dn = _moe_inputs()
    E = gu.shape[0]

    def fwd(**kw):
        a = dict(x=x, ids=ids, weights=w, gate_up=gu, down=dn) | kw
        return moe8.experts_forward(a["x"], a["ids"], a["weights"], a["gate_up"], a["down"])

    with pytest.raises(
        ValueError, match=r"router_weight: expected gate_up's number of experts E = 4 \(dim 0\)"
    ):
        moe8.moe_forward(x, torch.randn(2 * E, 8), gu, dn, 2)
    with pytest.raises(ValueError, match=r"router_weight: expected x's hidden size H = 8"):
        moe8.moe_forward(x, torch.randn(E, 9), gu, dn, 2)
    for k in (-1, 0, E + 1):
        with pytest.raises(ValueError, match=rf"k: expected 1 <= k <= 4, got {k}"):
            moe8.moe_forward(x, torch.randn(E, 8), gu, dn, k)
    with pytest.raises(
        ValueError, match=r"down: expected gate_up's number of experts = 4 \(dim 0\), got shape \[3,"
    ):
        fwd(down=dn[:3])
    with pytest.raises(ValueError, match=r"down: expected x's hidden size H = 8 \(dim 1\)"):
        fwd(down=torch.randn(E, 9, 6))
    with pytest.raises(ValueError, match=r"down: expected gate_up's intermediate size I = 6 \(dim 2\)"):
        fwd(down=torch.randn(E, 8, 5))
    with pytest.raises(TypeError, match=r"x: expected dtype .*, got torch.int32"):
        fwd(x=x.int())
    with pytest.raises(TypeError, match=r"x: expected dtype .*, got torch.float64"):
        fwd(x=x.double())
    with pytest.raises(
        TypeError, match=r"x: expected dtype torch.float32 \(same as gate_up and down\), got torch.float16"
    ):
        fwd(x=x.half())
    with pytest.raises(TypeError, match=r"weights: expected a floating-point dtype, got torch.int64"):
        fwd(weights=torch.ones_like(ids))
    with pytest.raises(TypeError, match=r"ids: expected an integer dtype .*, got torch.float32"):
        fwd(ids=ids.float())


@pytest.mark.parametrize("check_ids", [True, False])
def test_ids_out_of_range_are_errors_on_the_cpu_whatever_check_ids(check_ids):
    x, ids, w, gu, dn = _moe_inputs()
    for bad in (4, -1, 2**32 + 1, 2**31):  # 2**32 + 1 would wrap to expert 1 if narrowed first
        bad_ids = ids.long().clone()
        bad_ids[2, 1] = bad
        with pytest.raises(ValueError, match=r"ids: expected expert ids in \[0, 4\).*found 1 out of range"):
            moe8.experts_forward(x, bad_ids, w, gu, dn, check_ids=check_ids)


def test_raw_ops_check_index_values_on_the_cpu():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"row_to_slot: expected values in \[-1, 8\), found 1 out of range"):
        moe8.ops.gather_rows(x, torch.tensor([0, 8], dtype=torch.int32), 2, None)
    with pytest.raises(ValueError, match=r"slot_to_row: expected values in \[-1, 4\), found 1 out of range"):
        moe8.ops.combine_rows(x, torch.tensor([[0, 4]], dtype=torch.int32), None)
    a, b = torch.randn(6, 3), torch.randn(2, 5, 3)
    with pytest.raises(ValueError, match=r"offsets: expected offsets\[E\] <= 6 rows, got 7"):
        moe8.ops.grouped_gemm(a, b, torch.tensor([0, 2, 7], dtype=torch.int32), 0, None)
    with pytest.raises(ValueError, match=r"offsets: expected nondecreasing values"):
        moe8.ops.grouped_gemm(a, b, torch.tensor([0, 4, 2], dtype=torch.int32), 0, None)
    with pytest.raises(ValueError, match=r"layout: expected 0 .* or 1"):
        moe8.ops.grouped_gemm(a, b, torch.tensor([0, 4, 6], dtype=torch.int32), 2, None)
    with pytest.raises(ValueError, match=r"k: expected 1 <= k <= 4, got -1"):
        moe8.route(torch.randn(3, 4), -1)


def test_router_losses_of_zero_tokens_are_zero():
    r = moe8.route(torch.randn(0, 4, requires_grad=True), 2)
    assert moe8.z_loss(r).item() == 0.0 and moe8.load_balancing_loss(r).item() == 0.0
    with pytest.raises(TypeError, match=r"r: expected a moe8.RouteOut"):
        moe8.z_loss(torch.zeros(3))


def test_dtype_errors_name_the_tensor_that_differs():
    x, ids, w, gu, dn = _moe_inputs()
    cases = [
        (
            (x, gu.long(), dn),
            r"gate_up: expected dtype torch.float32 \(same as x and down\), got torch.int64",
        ),
        (
            (x, gu.bfloat16(), dn),
            r"gate_up: expected dtype torch.float32 \(same as x and down\), got torch.bfloat16",
        ),
        (
            (x, gu, dn.half()),
            r"down: expected dtype torch.float32 \(same as x and gate_up\), got torch.float16",
        ),
        (
            (x, gu.long(), dn.long()),
            r"gate_up: expected dtype torch.float32 or torch.float16 or torch.bfloat16, got torch.int64",
        ),
        (
            (x, gu.half(), dn.bfloat16()),
            r"x, gate_up, down: expected one dtype, got x torch.float32, gate_up",
        ),
    ]
    for (xx, g, d), match in cases:
        with pytest.raises(TypeError, match=match):
            moe8.experts_forward(xx, ids, w, g, d)
    with pytest.raises(TypeError, match=r"gate_up: expected dtype torch.float32 \(same as x and down\)"):
        moe8.moe_forward(x, torch.randn(4, 8), gu.bfloat16(), dn, 2)


def _views(base: torch.Tensor, how: str) -> torch.Tensor:
    """A weight of base's shape as a view of another leaf: the leaf (which gets the gradient) and the view."""
    if how == "transposed":
        leaf = base.transpose(1, 2).contiguous().requires_grad_()
        return leaf, leaf.transpose(1, 2)
    if how == "sliced":  # every other expert of a leaf twice as large, and a column stride of 2
        leaf = torch.zeros(2 * base.shape[0], base.shape[1], 2 * base.shape[2])
        leaf[::2, :, ::2] = base
        leaf.requires_grad_()
        return leaf, leaf[::2, :, ::2]
    leaf = base[:1].clone().requires_grad_()  # expanded: one expert's weights shared by all
    return leaf, leaf.expand_as(base)


@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("how", ["transposed", "sliced", "expanded"])
@pytest.mark.parametrize("which", ["gate_up", "down", "both"])
def test_weights_of_any_strides_run_forward_and_backward(layout, how, which):
    x, ids, w, gu, dn = _moe_inputs()
    if layout == "kn":
        gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
    if how == "expanded":
        gu, dn = gu[:1].expand_as(gu).contiguous(), dn[:1].expand_as(dn).contiguous()
    leaves, args = {}, {"gate_up": gu, "down": dn}
    for name in ("gate_up", "down"):
        if which in (name, "both"):
            leaves[name], args[name] = _views(args[name], how)
        else:
            leaves[name] = args[name] = args[name].clone().requires_grad_()
    assert not all(t.is_contiguous() for t in args.values())
    x = x.clone().requires_grad_()
    y = moe8.experts_forward(x, ids, w, args["gate_up"], args["down"], layout=layout)
    gy = torch.randn_like(y)
    (y * gy).sum().backward()
    # the reference: the same values, contiguous, in float64
    x64 = x.detach().double().requires_grad_()
    ref_args = {n: t.detach().double().contiguous().requires_grad_() for n, t in args.items()}
    y64 = reference.experts_forward(
        x64, ids, w.double(), ref_args["gate_up"], ref_args["down"], layout=layout
    )
    (y64 * gy.double()).sum().backward()
    torch.testing.assert_close(y.double(), y64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)
    for name, leaf in leaves.items():
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape, name
        got = leaf.grad.double()
        if which in (name, "both"):
            if how == "transposed":
                got = got.transpose(1, 2)
            elif how == "sliced":
                assert got[1::2].abs().max() == 0 and got[:, :, 1::2].abs().max() == 0
                got = got[::2, :, ::2]
            else:  # the expanded expert's gradient is the sum over the experts sharing it
                torch.testing.assert_close(
                    got, ref_args[name].grad.sum(0, keepdim=True), rtol=1e-4, atol=1e-4
                )
                continue
        torch.testing.assert_close(got, ref_args[name].grad, rtol=1e-4, atol=1e-4)


def test_transposed_gate_up_runs_when_only_x_needs_a_gradient():
    x, ids, w, gu, dn = _moe_inputs()
    x = x.clone().requires_grad_()
    gu_t = gu.transpose(1, 2).contiguous().transpose(1, 2)
    moe8.experts_forward(x, ids, w, gu_t, dn).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    moe8.experts_forward(x2, ids, w, gu, dn).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    y, _ = moe8.moe_forward(
        x.detach(), torch.randn(4, 8), gu_t, dn.transpose(1, 2).contiguous().transpose(1, 2), 2
    )
    assert torch.isfinite(y).all()


def test_apply_rotary_pos_emb_names_cos_and_sin():
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    for c, s, name in (
        (torch.randn(1, 4, 8), sin, "cos"),
        (torch.randn(5, 8), torch.randn(5, 8), "cos"),
        (cos, torch.randn(1, 5, 6), "sin"),
        (cos.requires_grad_(), torch.randn(1, 5, 7), "sin"),  # the fallback formula's path
    ):
        with pytest.raises(
            ValueError, match=rf"{name}: expected a shape that broadcasts over q \[2, 3, 5, 8\]"
        ):
            moe8.ops.apply_rotary_pos_emb(q, k, c, s)
    with pytest.raises(ValueError, match=r"cos: expected a shape that broadcasts over k \[2, 1, 5, 6\]"):
        moe8.ops.apply_rotary_pos_emb(torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 6), cos, sin)


def test_ops_refuse_a_meta_tensor_beside_cpu_ones():
    meta = dict(device="meta")
    a, b, off = torch.randn(4, 8), torch.randn(2, 6, 8), torch.tensor([0, 2, 4], dtype=torch.int32)
    r2s = torch.arange(4, dtype=torch.int32)
    calls = [
        (
            r"b: expected device meta \(same as a\), got cpu",
            lambda: moe8.ops.grouped_gemm(a.to(**meta), b, off, 0, None),
        ),
        (
            r"b: expected device cpu \(same as a\), got meta",
            lambda: moe8.ops.grouped_gemm(a, b.to(**meta), off, 0, None),
        ),
        (
            r"offsets: expected device meta",
            lambda: moe8.ops.grouped_gemm(a.to(**meta), b.to(**meta), off, 0, None),
        ),
        (
            r"t: expected device cpu \(same as h\), got meta",
            lambda: moe8.ops.grouped_lowrank_add(
                torch.zeros(4, 6), torch.empty(4, 2, **meta), torch.zeros(2, 6, 2), off, 0
            ),
        ),
        (
            r"row_to_slot: expected device meta \(same as src\)",
            lambda: moe8.ops.gather_rows(torch.empty(4, 3, **meta), r2s, 1, None),
        ),
        (
            r"slot_to_row: expected device meta \(same as rows\)",
            lambda: moe8.ops.combine_rows(torch.empty(4, 3, **meta), r2s.view(4, 1), None),
        ),
        (
            r"row_to_slot: expected device meta \(same as x\)",
            lambda: moe8.ops.permute(torch.empty(4, 3, **meta), r2s, r2s, 1),
        ),
        (
            r"rows: expected device cpu \(same as dy\), got meta",
            lambda: moe8.ops.combine_weights_grad(
                torch.zeros(4, 3), torch.empty(4, 3, **meta), r2s.view(4, 1)
            ),
        ),
        (
            r"gate_up: expected device cpu \(same as x\), got meta",
            lambda: moe8.experts_forward(
                a, r2s.view(4, 1) % 2, torch.ones(4, 1), b.to(**meta), torch.zeros(2, 8, 3)
            ),
        ),
    ]
    for match, call in calls:
        with pytest.raises(ValueError, match=match):
            call()
