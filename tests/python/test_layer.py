"""The whole MoE layer and each differentiable op against the pure-PyTorch reference (float64 oracle):
outputs and every gradient, all routing schemes, both weight layouts, every activation, awkward shapes."""

import pytest
import torch
from conftest import devices

import moe8
from moe8 import build_info, layer
from moe8 import reference as ref

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(shape, dtype, device, scale=0.3, seed=None):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype).to(device).requires_grad_()


CASES = [  # T, H, I, E, K, scheme, layout, activation, interleaved, bias
    (37, 20, 13, 6, 2, "softmax", "nk", "swiglu", False, False),
    (1, 16, 8, 4, 1, "softmax", "nk", "swiglu", False, False),
    (64, 24, 40, 8, 3, "sigmoid_group", "nk", "swiglu", False, False),
    (29, 18, 10, 5, 2, "topk_softmax", "kn", "swiglu_clamped", True, True),
    (16, 12, 7, 4, 2, "softmax", "nk", "gelu", False, False),
    (21, 9, 11, 3, 2, "softmax", "kn", "silu", False, True),
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-{c[5]}-{c[6]}-{c[7]}")
def test_moe_layer_matches_reference(device, dtype, case):
    T, H, I, E, K, scheme, layout, act, inter, bias = case
    torch.manual_seed(T * 31 + E)
    W = 2 * I if act.startswith("swiglu") else I
    x, logits = make((T, H), dtype, device), make((T, E), dtype, device, 1.0)
    gu = make((E, W, H) if layout == "nk" else (E, H, W), dtype, device)
    dn = make((E, H, I) if layout == "nk" else (E, I, H), dtype, device)
    gb, db = (make((E, W), dtype, device), make((E, H), dtype, device)) if bias else (None, None)
    rkw = (
        dict(n_group=4, topk_group=2, scaling=2.5, bias=torch.randn(E, device=device) * 0.1)
        if scheme == "sigmoid_group"
        else {}
    )
    r = moe8.route(logits, K, scheme, True, **rkw)
    y = moe8.experts_forward(
        x,
        r.ids,
        r.weights,
        gu,
        dn,
        layout=layout,
        activation=act,
        interleaved=inter,
        gate_up_bias=gb,
        down_bias=db,
    )
    assert y.dtype == dtype and y.shape == (T, H)
    probe = torch.randn(T, H, dtype=torch.float64)
    loss = (y.double().cpu() * probe).sum() + moe8.load_balancing_loss(r).cpu() + moe8.z_loss(r).cpu()
    params = [p for p in (x, logits, gu, dn, gb, db) if p is not None]
    grads = torch.autograd.grad(loss, params)

    # float64 oracle on the same (rounded) inputs, routing with the ids moe8 chose
    P = [p.detach().double().cpu().requires_grad_() for p in params]
    xx, ll, gg, dd = P[:4]
    gbb, dbb = (P[4], P[5]) if bias else (None, None)
    rb = {k: (v.double().cpu() if torch.is_tensor(v) else v) for k, v in rkw.items()}
    if dtype == torch.float32:  # 16-bit logits tie often; ties go to the lower index in moe8
        assert torch.equal(ref.route(ll, K, scheme, True, **rb)[0], r.ids.long().cpu())
    ids = r.ids.long().cpu()
    w = ref.route_weights(ll, ids, scheme, True, rb.get("scaling", 1.0))
    yr = ref.experts_forward(
        xx, ids, w, gg, dd, layout=layout, activation=act, interleaved=inter, gate_up_bias=gbb, down_bias=dbb
    )
    frac = torch.zeros(E, dtype=torch.float64).index_add_(
        0, ids.flatten(), torch.ones(T * K, dtype=torch.float64)
    )
    pm = (ll.sigmoid() / ll.sigmoid().sum(-1, keepdim=True)) if scheme == "sigmoid_group" else ll.softmax(-1)
    lr = (yr * probe).sum() + E * (frac / (T * K) * pm.mean(0)).sum() + (torch.logsumexp(ll, -1) ** 2).mean()
    ref_grads = torch.autograd.grad(lr, P)
    tol = TOL[dtype]
    assert rel(y, yr) < tol
    for name, g, gr in zip(["x", "logits", "gate_up", "down", "gate_up_bias", "down_bias"], grads, ref_grads):
        assert g.dtype == dtype or name == "logits"
        assert rel(g, gr) < 4 * tol, name


@pytest.mark.parametrize("device", devices())
def test_expert_with_no_tokens_gets_zero_grad(device):
    torch.manual_seed(0)
    T, H, I, E = 10, 8, 6, 5
    x = make((T, H), torch.float32, device)
    gu, dn = make((E, 2 * I, H), torch.float32, device), make((E, H, I), torch.float32, device)
    ids = torch.tensor([[0, 2]] * T, dtype=torch.int32, device=device)  # experts 1, 3, 4 idle
    w = torch.full((T, 2), 0.5, device=device)
    y = moe8.experts_forward(x, ids, w, gu, dn)
    y.sum().backward()
    assert gu.grad[[1, 3, 4]].abs().max() == 0 and gu.grad[[0, 2]].abs().max() > 0
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("routed", [True, False])
def test_no_tokens_at_all(device, routed):
    """A batch of 0 tokens: empty output, zero weight gradients, through y.sum().backward() (whose gradient is
    an expanded [0, H] tensor, contiguous for torch and now for moe8's checks too)."""
    H, I, E = 8, 6, 4
    x = make((0, H), torch.float32, device)
    gu, dn = make((E, 2 * I, H), torch.float32, device), make((E, H, I), torch.float32, device)
    w = torch.rand(0, 2, device=device, requires_grad=True)
    ids = torch.zeros(0, 2, dtype=torch.int32, device=device)
    y = moe8.experts_forward(x, ids, w, gu, dn, config=moe8.Config(routed_down=routed))
    y.sum().backward()
    assert y.shape == (0, H) and x.grad.shape == (0, H) and w.grad.shape == (0, 2)
    assert gu.grad.abs().max() == 0 and dn.grad.abs().max() == 0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("k,pad", [(1, 1), (8, 16), (10, 1)])
def test_gather_rows_token_major_is_the_same(device, k, pad):
    """gather_rows with slot_to_row (on a GPU each token read once and stored to its rows, k <= 8): the same
    bits as the row-by-row gather, scaled or not, padding rows zero."""
    T, H, E = 33, 72, 12
    g = torch.Generator().manual_seed(k)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int().to(device)
    scale = torch.rand(T * k, generator=g).to(device)
    _, _, r2s, s2r = moe8.ops.plan(ids, E, pad)
    for sc in (None, scale):
        want = moe8.ops.gather_rows(x, r2s, k, sc)
        got = moe8.ops.gather_rows(x, r2s, k, sc, s2r)
        assert torch.equal(got, want)
        assert (got[r2s < 0] == 0).all()


@pytest.mark.parametrize("device", devices())
def test_deterministic(device):
    torch.manual_seed(1)
    layer = moe8.MoELayer(32, 24, 8, 2, device=device)
    x = torch.randn(100, 32, device=device)
    outs = []
    for _ in range(2):
        layer.zero_grad()
        y, r = layer(x)
        (y.square().sum() + moe8.load_balancing_loss(r)).backward()
        outs.append([y.detach().clone()] + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph():
    torch.manual_seed(2)
    layer = moe8.MoELayer(16, 12, 4, 2)
    x = torch.randn(20, 16, requires_grad=True)

    def step(x):
        y, r = layer(x)
        return y.square().sum() + moe8.load_balancing_loss(r) + moe8.z_loss(r)

    eager = step(x)
    g_eager = torch.autograd.grad(eager, [x, *layer.parameters()])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    g = torch.autograd.grad(out, [x, *layer.parameters()])
    assert torch.allclose(out, eager)
    for a, b in zip(g, g_eager):
        assert torch.allclose(a, b, atol=1e-6)


def test_opcheck():
    """torch.library's own consistency checks (schema, fake tensors, autograd registration)."""
    x = torch.randn(12, 8)
    logits = torch.randn(12, 4)
    ids = torch.randint(0, 4, (12, 2), dtype=torch.int32)
    ids[:, 1] = (ids[:, 0] + 1) % 4
    counts, offsets, r2s, s2r = moe8.ops.plan(ids, 4, 1)
    b = torch.randn(4, 6, 8)
    for op, args in [
        (moe8.ops.route, (logits, None, 0, 2, True, 1, 1, 1.0)),
        (moe8.ops.plan, (ids, 4, 1)),
        (moe8.ops.permute, (x, r2s, s2r, 2)),
        (moe8.ops.grouped_gemm, (torch.randn(24, 8), b, offsets, 0, None)),
        (moe8.ops.activation, (torch.randn(24, 12), 0, False, 1.702, 7.0)),
        (
            moe8.fused._expert_linear,
            (torch.randn(24, 8), b, None, None, None, offsets, 0, None, -1, None, None, 1, None),
        ),
        (
            moe8.fused._activation_linear,
            (torch.randn(24, 12), torch.randn(4, 8, 6), None, None, None, offsets, 0, None, -1)
            + (0, False, 1.702, 7.0, False),
        ),
        (moe8.ops.combine, (torch.randn(24, 8), torch.rand(12, 2), s2r, r2s)),
        (
            moe8.fused._activation_down_combine,
            (torch.randn(24, 12), torch.randn(4, 8, 6), None, None, None, offsets, 0, -1, torch.rand(12, 2))
            + (s2r, r2s, 0, False, 1.702, 7.0, False, True, False),
        ),
        *[
            (op, (torch.randn(24, 12), torch.randn(24, 6), torch.rand(12, 2), r2s, 0, False, 1.702, 7.0))
            for op in (
                moe8.fused.activation_backward_routed,
                moe8.fused.activation_backward_routed_codes,
                moe8.fused.activation_backward_routed_codes_,
            )
        ],
        *[
            (
                op,
                (
                    torch.randn(24, 8),
                    torch.randn(4, 8, 6),
                    offsets,
                    1,
                    torch.randn(24, 12),
                    torch.rand(12, 2),
                    r2s,
                )
                + (0, False, 1.702, 7.0),
            )
            for op in (moe8.fused.dgrad_activation_backward, moe8.fused.dgrad_activation_backward_)
        ],
        (
            moe8.ops.grouped_lowrank_add,
            (torch.randn(24, 8), torch.randn(24, 2), torch.randn(4, 8, 2), offsets, 0),
        ),
        (moe8.ops.gathered_grouped_gemm, (x, r2s, 2, s2r, b, offsets, 0)),
        (moe8.ops.grouped_gemm_swiglu, (torch.randn(24, 8), torch.randn(4, 6, 8), offsets)),
        (
            moe8.fused._gathered_linear,
            (x, b, None, None, None, offsets, 0, None, -1, r2s, 2, s2r, True, False),
        ),
    ]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_fp8_option_routes_to_the_fp8_experts():
    from moe8.precision import Fp8Gemms

    torch.manual_seed(3)
    T, H, I, E, K = 40, 256, 128, 4, 2
    x = torch.randn(T, H).bfloat16()
    gu, dn = (torch.randn(E, 2 * I, H) * 0.05).bfloat16(), (torch.randn(E, H, I) * 0.05).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K)
    y = moe8.experts_forward(x, ids, w, gu, dn, fp8="blockwise")
    assert torch.equal(y, moe8.experts_forward(x, ids, w, gu, dn, fp8=Fp8Gemms("blockwise", cache=None)))
    assert torch.equal(y, moe8.experts_forward(x, ids, w, gu, dn, config=moe8.Config(fp8="blockwise")))
    assert not torch.equal(y, moe8.experts_forward(x, ids, w, gu, dn))  # bf16 GEMMs differ from FP8's


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("kd,n", [(96, 16), (16, 136), (256, 32), (40, 8)], ids=lambda v: str(v))
def test_grouped_gemm_rank_sized_side(device, dtype, layout, kd, n):
    """The expert LoRA's GEMMs (a rank-sized N, or K): output, input gradient and weight gradient against
    float64 per group (on an H200 in bf16 these take the thin sm90 tile, and the weight gradient with a
    rank-sized N is computed in the other layout)."""
    torch.manual_seed(kd + n)
    offsets = torch.tensor([0, 300, 300, 429, 700], dtype=torch.int32, device=device)
    R, E = 703, 4  # rows 700.. in no group
    a0 = torch.randn(R, kd, device=device).to(dtype)
    b0 = torch.randn(*((E, n, kd) if layout == 0 else (E, kd, n)), device=device).to(dtype)
    g = torch.randn(R, n, device=device).to(dtype)
    a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    c = moe8.ops.grouped_gemm(a, b, offsets, layout, None)
    da, db = torch.autograd.grad(c, [a, b], g)
    want_c = torch.zeros(R, n, dtype=torch.float64)
    want_da = torch.zeros(R, kd, dtype=torch.float64)
    want_db = torch.zeros(b0.shape, dtype=torch.float64)
    for e in range(E):
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        be = b0[e].double().cpu()
        w = be.t() if layout == 0 else be  # [kd, n]
        ar, gr = a0[rows].double().cpu(), g[rows].double().cpu()
        want_c[rows] = ar @ w
        want_da[rows] = gr @ w.t()
        want_db[e] = (ar.t() @ gr).t() if layout == 0 else ar.t() @ gr
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, got, want in (("c", c, want_c), ("d a", da, want_da), ("d b", db, want_db)):
        err = ((got.double().cpu() - want).abs().max() / want.abs().max()).item()
        assert err < tol, f"{name}: max relative error {err:.2e}"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("layout", [0, 1])
def test_grouped_lowrank_add_is_add_of_the_gemm(device, layout):
    """grouped_lowrank_add(h, t, b) == h + t·op(b[e]) per group (float64 reference), rows in no group keep
    h, and its gradients are those of h + grouped_gemm(t, b)."""
    torch.manual_seed(5)
    R, N, r, E = 50, 24, 4, 3
    offsets = torch.tensor([0, 11, 11, 45], dtype=torch.int32, device=device)  # rows 45.. in no group
    h0 = torch.randn(R, N, device=device)
    t0 = torch.randn(R, r, device=device)
    b0 = torch.randn(*((E, N, r) if layout == 0 else (E, r, N)), device=device)
    want = h0.double().clone()
    for e in range(E):
        rows = slice(int(offsets[e]), int(offsets[e + 1]))
        be = b0[e].double().t() if layout == 0 else b0[e].double()
        want[rows] += t0[rows].double() @ be
    h, t, b = (x.clone().requires_grad_() for x in (h0, t0, b0))
    out = moe8.ops.grouped_lowrank_add(h, t, b, offsets, layout)
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 1e-6
    assert torch.equal(out[45:], h0[45:])
    g = torch.randn(R, N, device=device)
    got = torch.autograd.grad(out, [h, t, b], g)
    h, t, b = (x.clone().requires_grad_() for x in (h0, t0, b0))
    ref = h + moe8.ops.grouped_gemm(t, b, offsets, layout, None)
    for x, y in zip(got, torch.autograd.grad(ref, [h, t, b], g)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def small_experts_problem(device, seed, T=40, H=32, I=24, E=4, K=2, r=4):
    """x [T, H], (gate_up [E, 2I, H], down [E, H, I]), ids, weights and the expert LoRA factors
    (gate_up A, B, down A, B), fp32."""
    torch.manual_seed(seed)
    x = torch.randn(T, H, device=device)
    experts = (torch.randn(E, 2 * I, H, device=device) * 0.2, torch.randn(E, H, I, device=device) * 0.2)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int().to(device)
    w = torch.rand(T, K, device=device)
    factors = [torch.randn(*s, device=device) * 0.3 for s in ((E, r, H), (E, 2 * I, r), (E, r, I), (E, H, r))]
    return x, experts, ids, w, factors


@pytest.mark.parametrize("device", devices())
def test_expert_lora_fused_add_matches(device):
    """Config.fused_lora_add: the expert LoRA's B projection through grouped_lowrank_add gives the unfused
    result (fp32), forward and every gradient."""
    x0, (gu, dn), ids, w, factors = small_experts_problem(device, seed=6)

    def run(fused):
        x = x0.clone().requires_grad_()
        fs = [f.clone().requires_grad_() for f in factors]
        lora = layer.ExpertLoRA(*fs, scaling=2.0)
        y = moe8.experts_forward(x, ids, w, gu, dn, lora=lora, config=moe8.Config(fused_lora_add=fused))
        return [y, *torch.autograd.grad(y.square().sum(), [x, *fs])]

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("with_lora", [False, True])
def test_experts_consuming_gate_up_matches(device, with_lora):
    """Config.consume_gate_up (d h written over the gate_up output) gives the same bits, forward and every
    gradient, with and without the expert LoRA."""
    x0, weights, ids, w, factors = small_experts_problem(device, seed=8)

    def run(consume):
        x = x0.clone().requires_grad_()
        ws = [t.clone().requires_grad_() for t in weights]
        fs = [f.clone().requires_grad_() for f in factors] if with_lora else []
        lora = layer.ExpertLoRA(*fs, scaling=2.0) if with_lora else None
        y = moe8.experts_forward(x, ids, w, *ws, lora=lora, config=moe8.Config(consume_gate_up=consume))
        return [y, *torch.autograd.grad(y.square().sum(), [x, *ws, *fs])]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act, layout, bias", [("swiglu", "nk", False), ("swiglu_clamped", "kn", True)])
@pytest.mark.parametrize("routed", [True, False])
def test_experts_gathered_up_projection_matches_kept_rows(device, dtype, act, layout, bias, routed):
    """Config.keep_permuted=False (the default: the up projection's backward keeps x and gathers its rows again)
    gives the same bits as keeping the permuted rows, forward and every gradient (x, weights, biases, routing
    weights), with an expert that gets no token."""
    torch.manual_seed(11)
    T, H, I, E, K = 37, 32, 24, 5, 2
    x0 = torch.randn(T, H, device=device, dtype=dtype)
    shapes = ((E, 2 * I, H), (E, H, I)) if layout == "nk" else ((E, H, 2 * I), (E, I, H))
    weights = [(torch.randn(*s, device=device) * 0.2).to(dtype) for s in shapes]
    biases = [torch.randn(E, 2 * I, device=device).to(dtype), torch.randn(E, H, device=device).to(dtype)]
    ids = torch.stack([torch.randperm(E - 1)[:K] for _ in range(T)]).int().to(device)  # expert E-1: none
    w0 = torch.rand(T, K, device=device)
    cfg = dict(routed_down=routed)

    def run(keep):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        ws = [t.clone().requires_grad_() for t in weights]
        bs = [t.clone().requires_grad_() for t in biases] if bias else []
        extra = dict(gate_up_bias=bs[0], down_bias=bs[1]) if bias else {}
        config = moe8.Config(keep_permuted=keep, **cfg)
        y = moe8.experts_forward(x, ids, w, *ws, layout=layout, activation=act, config=config, **extra)
        return [y, *torch.autograd.grad(y.float().square().sum(), [x, w, *ws, *bs])]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def _gathered_problem(device, T, H, N, E, K, seed, dtype=torch.bfloat16, unmapped_every=0):
    """x [T, H], w [E, N, H], the plan's offsets / row_to_slot / slot_to_row for random top-k ids (an expert with
    no token), optionally every n-th row unmapped (slot -1, as a padding row)."""
    torch.manual_seed(seed)
    x = torch.randn(T, H, device=device).to(dtype)
    w = (torch.randn(E, N, H, device=device) * H**-0.5).to(dtype)
    ids = torch.stack([torch.randperm(E - 1)[:K] for _ in range(T)]).int().to(device)
    _, offsets, row_to_slot, slot_to_row = moe8.ops.plan(ids, E, 1, False)
    if unmapped_every:
        row_to_slot = row_to_slot.clone()
        row_to_slot[unmapped_every - 1 :: unmapped_every] = -1
    return x, w, offsets, row_to_slot, slot_to_row


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("T, H, N, E, K", [(37, 72, 136, 5, 2), (300, 128, 256, 8, 4), (1, 64, 64, 3, 1)])
def test_gathered_grouped_gemm_is_the_gemm_of_the_permuted_rows(device, T, H, N, E, K):
    """ops.gathered_grouped_gemm (x's rows read inside the GEMM: the sm_90a kernel on a Hopper GPU, the CPU
    reference on the CPU) against grouped_gemm of the rows gathered first: the same bits on the CPU, within
    bf16 rounding on a GPU (a kernel of another tile may run there), rows of slot -1 zero, every row written, and
    the same bits in two calls."""
    x, w, offsets, row_to_slot, slot_to_row = _gathered_problem(device, T, H, N, E, K, 3, unmapped_every=7)
    slot_to_row = torch.full_like(slot_to_row, -1)  # the unmapped rows have no slot: no inverse through them
    mapped = row_to_slot >= 0
    slot_to_row[row_to_slot[mapped].long()] = torch.arange(row_to_slot.numel(), device=device)[mapped].int()
    got = moe8.ops.gathered_grouped_gemm(x, row_to_slot, K, slot_to_row, w, offsets, 0)
    rows = moe8.ops.gather_rows(x, row_to_slot, K, None, None)
    want = moe8.ops.grouped_gemm(rows, w, offsets, 0, None)
    assert torch.equal(got, moe8.ops.gathered_grouped_gemm(x, row_to_slot, K, slot_to_row, w, offsets, 0))
    assert not got.isnan().any()
    assert torch.equal(got[~mapped], torch.zeros_like(got[~mapped]))
    if device == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    exact = torch.cat([(rows[offsets[e] : offsets[e + 1]].double() @ w[e].double().t()) for e in range(E)])
    torch.testing.assert_close(got.double(), exact, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "R, H, I, E", [(37, 72, 68, 5), (700, 128, 256, 6), (1500, 256, 384, 4), (0, 64, 128, 3)]
)
def test_grouped_gemm_swiglu_is_the_gemm_then_the_activation(device, R, H, I, E):
    """ops.grouped_gemm_swiglu (on a Hopper GPU with I a multiple of 128 the sm_90a kernel with SwiGLU in the
    GEMM's epilogue; elsewhere the two calls) against grouped_gemm then activation: the same bits for h and act,
    rows past offsets[E] zero, ragged groups with an empty one; the wrong b raises naming it."""
    g = torch.Generator().manual_seed(R + I)
    a = torch.randn(R, H, generator=g).bfloat16().to(device)
    w = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).bfloat16().to(device)
    cuts = sorted(torch.randint(0, max(R - 5, 0) + 1, (E - 1,), generator=g).tolist())
    cuts[0] = cuts[1] if E > 2 else cuts[0]  # an empty group
    offsets = torch.tensor([0, *cuts, max(R - 5, 0)], dtype=torch.int32, device=device)
    h, act = moe8.ops.grouped_gemm_swiglu(a, w, offsets)
    h_want = moe8.ops.grouped_gemm(a, w, offsets, 0, None)
    act_want = moe8.ops.activation(h_want, moe8.ops.ACTIVATIONS["swiglu"], False, 1.702, 7.0)
    assert torch.equal(h, h_want)
    assert torch.equal(act, act_want)
    tail = int(offsets[-1])
    assert torch.equal(act[tail:], torch.zeros_like(act[tail:]))
    with pytest.raises(ValueError, match="b: SwiGLU expects an even 2I"):
        moe8.ops.grouped_gemm_swiglu(a, w[:, :-1], offsets)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("I", [256, 96])
def test_fused_act_forward_gives_the_same_bits(monkeypatch, device, I):
    """Config(fused_act_forward=True) (the SwiGLU made in the up projection's epilogue and handed to the down
    projection: the sm_90a kernel where I is a multiple of 128, the two calls elsewhere) against the default: the
    output and every gradient the same bits, and nothing left handed over after the step."""
    from moe8.precision import HANDED_ACT

    T, H, E, K = 300, 128, 6, 4
    g = torch.Generator().manual_seed(I)
    x0 = torch.randn(T, H, generator=g).bfloat16().to(device)
    gu = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).bfloat16().to(device)
    dn = (torch.randn(E, H, I, generator=g) * I**-0.5).bfloat16().to(device)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int().to(device)
    w0 = torch.rand(T, K, generator=g).to(device)

    def run(fuse):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        ws = [gu.clone().requires_grad_(), dn.clone().requires_grad_()]
        y = moe8.experts_forward(x, ids, w, *ws, config=moe8.Config(fused_act_forward=fuse))
        return (y, *torch.autograd.grad(y.float().square().sum(), [x, w, *ws]))

    calls = []
    fused_op = moe8.ops.grouped_gemm_swiglu
    monkeypatch.setattr(moe8.ops, "grouped_gemm_swiglu", lambda *args: calls.append(1) or fused_op(*args))
    fused_run = run(True)
    assert calls == [1]  # the fused op made the activation
    plain = run(False)
    assert calls == [1]
    for name, a, b in zip(["y", "d x", "d weights", "d gate_up", "d down"], fused_run, plain):
        assert torch.equal(a, b), name
    assert HANDED_ACT.take(fused_run[0]) is None and HANDED_ACT._entry is None
    with pytest.raises(ValueError, match="fused_act_forward: expected True or False"):
        moe8.Config(fused_act_forward=1)


@pytest.mark.skipif(
    not (
        moe8.cuda_available()
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0)
        and build_info.read().cutlass_version
    ),
    reason="needs an sm_90 GPU and moe8's sm90a CUTLASS kernels",
)
@pytest.mark.parametrize(
    "T, H, N, E, K", [(37, 72, 136, 5, 2), (300, 128, 256, 8, 4), (1, 64, 64, 3, 1), (900, 256, 512, 6, 8)]
)
def test_gathered_grouped_gemm_two_load_warps_give_the_same_bits(monkeypatch, T, H, N, E, K):
    """MOE8_SM90_GATHER_WARPS=2 (the rows copied by two producer warps, gathered_rows_sm90.cuh): the sm_90a
    gathered kernel runs at every shape (H a multiple of 8), gives the one warp's bits, rows of slot -1 zero, two
    calls alike; a bad value raises naming the variable."""
    from moe8._core import C, sm90_workspace
    from moe8._core import stream as current_stream

    x, w, offsets, row_to_slot, _ = _gathered_problem("cuda", T, H, N, E, K, 5, unmapped_every=5)
    mapped = row_to_slot >= 0

    def run(warps):
        monkeypatch.setenv("MOE8_SM90_GATHER_WARPS", warps)
        C.reload_sm90_overrides()
        c = x.new_full((row_to_slot.shape[0], N), float("nan"))
        ran = C.gathered_grouped_gemm(
            x, row_to_slot, K, w, offsets, 0, c, current_stream(x), False, sm90_workspace(x, E)
        )
        torch.cuda.synchronize()
        assert ran, "the sm_90a gathered kernel did not take the call"
        return c

    try:
        one, two = run("1"), run("2")
        assert torch.equal(one, two)
        assert torch.equal(two, run("2"))
        assert not two.isnan().any()
        assert torch.equal(two[~mapped], torch.zeros_like(two[~mapped]))
        with pytest.raises(Exception, match="MOE8_SM90_GATHER_WARPS: expected one of 1, 2, got '3'"):
            run("3")
    finally:
        monkeypatch.delenv("MOE8_SM90_GATHER_WARPS")
        C.reload_sm90_overrides()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "T, H, N, E, K", [(37, 72, 136, 5, 2), (300, 128, 256, 8, 4), (1, 64, 64, 3, 1), (700, 512, 384, 6, 3)]
)
def test_gathered_wgrad_is_the_wgrad_of_the_permuted_rows(device, T, H, N, E, K):
    """ops.gathered_grouped_gemm_wgrad (x's rows read inside the weight gradient's GEMM: the sm_90a kernel on a
    Hopper GPU; the rows gathered first elsewhere) against grouped_gemm_wgrad of the rows gathered first: within
    bf16 rounding of it and of float64 (a kernel of another tile may run there), rows of slot -1 counting as
    zeros, the empty expert's gradient zero, the same bits in two calls."""
    x, _, offsets, row_to_slot, slot_to_row = _gathered_problem(device, T, H, N, E, K, 5, unmapped_every=7)
    slot_to_row = torch.full_like(slot_to_row, -1)
    mapped = row_to_slot >= 0
    slot_to_row[row_to_slot[mapped].long()] = torch.arange(row_to_slot.numel(), device=device)[mapped].int()
    dc = torch.randn(row_to_slot.numel(), N, device=device).to(torch.bfloat16)
    got = moe8.ops.gathered_grouped_gemm_wgrad(x, row_to_slot, K, slot_to_row, dc, offsets, 0, E)
    assert got.shape == (E, N, H) and not got.isnan().any()
    assert torch.equal(
        got, moe8.ops.gathered_grouped_gemm_wgrad(x, row_to_slot, K, slot_to_row, dc, offsets, 0, E)
    )
    rows = moe8.ops.gather_rows(x, row_to_slot, K, None, None)
    want = moe8.ops.grouped_gemm_wgrad(rows, dc, offsets, 0, E, False)[0]
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    exact = torch.stack(
        [
            dc[offsets[e] : offsets[e + 1]].double().t() @ rows[offsets[e] : offsets[e + 1]].double()
            for e in range(E)
        ]
    )
    torch.testing.assert_close(got.double(), exact, rtol=2e-2, atol=2e-2)
    assert torch.equal(got[E - 1], torch.zeros_like(got[E - 1]))  # _gathered_problem routes no row to E - 1
    kn = moe8.ops.gathered_grouped_gemm_wgrad(
        x, row_to_slot, K, slot_to_row, dc, offsets, 1, E
    )  # gathered first
    torch.testing.assert_close(kn.float(), want.float().transpose(1, 2), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="dc"):
        moe8.ops.gathered_grouped_gemm_wgrad(x, row_to_slot, K, slot_to_row, dc[:, 0], offsets, 0, E)


@pytest.mark.skipif(not torch.cuda.is_available() or not moe8.cuda_available(), reason="needs a CUDA GPU")
def test_gathered_up_projection_in_the_gemm_matches_on_cuda():
    """Config.gather_in_gemm at a Qwen3-like width on a GPU (1024 rows per expert: the plain path takes the same
    128x256 tile): output and every gradient the same bits as gathering the rows first, and deterministic."""
    T, H, I, E, K = 2048, 1024, 384, 16, 8
    x0, gu, offsets, _, _ = _gathered_problem("cuda", T, H, 2 * I, E, K, 5)
    dn = (torch.randn(E, H, I, device="cuda") * I**-0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]).int()
    w0 = torch.rand(T, K, device="cuda")

    def run(in_gemm):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        ws = [gu.clone().requires_grad_(), dn.clone().requires_grad_()]
        y = moe8.experts_forward(x, ids, w, *ws, config=moe8.Config(gather_in_gemm=in_gemm))
        return [y, *torch.autograd.grad(y.float().square().sum(), [x, w, *ws])]

    fused, again, plain = run(True), run(True), run(False)
    for a, b, c in zip(fused, again, plain):
        assert torch.equal(a, b)
        assert torch.equal(a, c)


def _saved_bytes(fn, inputs) -> int:
    """Bytes of the distinct tensors autograd saves for the backward while fn() runs, the inputs' own storage
    (held by the caller anyway) left out."""
    seen, theirs = {}, {t.untyped_storage().data_ptr() for t in inputs}

    def pack(t):
        if t.untyped_storage().data_ptr() not in theirs:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_experts_backward_keeps_no_permuted_rows():
    """The experts keep no [R, H] copy of x for the backward by default: what they save beyond their inputs is
    one [R, H] row block smaller than with Config(keep_permuted=True), and smaller than that block."""
    T, H, I, E, K = 64, 256, 16, 4, 4
    x = torch.randn(T, H, requires_grad=True)
    gu, dn = torch.randn(E, 2 * I, H, requires_grad=True), torch.randn(E, H, I, requires_grad=True)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K)

    def saved(keep):
        cfg = moe8.Config(keep_permuted=keep)
        return _saved_bytes(lambda: moe8.experts_forward(x, ids, w, gu, dn, config=cfg), [x, gu, dn, w])

    rows = T * K * H * x.element_size()
    assert saved(True) - saved(False) >= rows
    assert saved(False) < rows


@pytest.mark.skipif(not torch.cuda.is_available() or not moe8.cuda_available(), reason="needs a CUDA GPU")
def test_experts_gathered_up_projection_lowers_the_peak():
    """Without the permuted rows kept (Config.keep_permuted=False) the experts hold one [R, H] block less after
    the forward, and forward + backward (weight gradients included) peak about that much lower."""
    T, H, I, E, K = 4096, 1024, 256, 16, 8
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gu = (torch.randn(E, 2 * I, H, device="cuda") * 0.03).to(torch.bfloat16).requires_grad_()
    dn = (torch.randn(E, H, I, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, device="cuda")
    g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def peak_and_held(keep):
        x.grad = gu.grad = dn.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y = moe8.experts_forward(x, ids, w, gu, dn, config=moe8.Config(keep_permuted=keep))
        held = torch.cuda.memory_allocated() - base
        y.backward(g)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, held

    peak_and_held(True), peak_and_held(False)  # warm the allocator and the workspaces
    (p_keep, h_keep), (p_new, h_new) = peak_and_held(True), peak_and_held(False)
    rows = T * K * H * 2
    assert h_keep - h_new >= 0.99 * rows, (h_keep, h_new)
    assert p_keep - p_new >= 0.75 * rows, (p_keep, p_new)  # the peak's other buffers move a little too


@pytest.mark.parametrize("device", devices())
def test_plan_check_ids(device):
    """check_ids=False gives the same plan for valid ids (no range check, no device sync); the check itself
    rejects ids out of range."""
    ids = torch.randint(0, 6, (33, 2), dtype=torch.int32, device=device)
    for a, b in zip(moe8.ops.plan(ids, 6, 16), moe8.ops.plan(ids, 6, 16, False)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"ids: expected values in \[0, 6\)"):
        moe8.ops.plan(torch.full((3, 2), 6, dtype=torch.int32, device=device), 6, 1)


@pytest.mark.skipif(not torch.cuda.is_available() or not moe8.cuda_available(), reason="needs a CUDA GPU")
def test_experts_forward_captures_in_a_cuda_graph():
    """With check_ids=False (as the HF integration calls it) the experts forward never syncs with the host,
    so it can be captured in a CUDA graph; the replay gives the eager result for new inputs."""
    torch.manual_seed(7)
    T, H, I, E, K = 64, 128, 64, 8, 2
    dev = dict(device="cuda", dtype=torch.bfloat16)
    gu, dn = torch.randn(E, 2 * I, H, **dev) * 0.05, torch.randn(E, H, I, **dev) * 0.05
    x = torch.randn(T, H, **dev)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int().cuda()
    w = torch.rand(T, K, device="cuda")
    with torch.no_grad():
        for _ in range(2):  # warm-up: workspaces and caches
            moe8.experts_forward(x, ids, w, gu, dn, check_ids=False)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = moe8.experts_forward(x, ids, w, gu, dn, check_ids=False)
        x.copy_(torch.randn(T, H, **dev))
        ids.copy_(torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int())
        graph.replay()
        assert torch.equal(y, moe8.experts_forward(x, ids, w, gu, dn))


def test_grouped_lowrank_add_errors():
    h, t, b = torch.randn(8, 6), torch.randn(8, 2), torch.randn(2, 6, 2)
    off = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"b: expected shape \[2, 6, 3\]"):
        moe8.ops.grouped_lowrank_add(h, torch.randn(8, 3), b, off, 0)
    with pytest.raises(ValueError, match="t: expected dtype"):
        moe8.ops.grouped_lowrank_add(h, t.double(), b, off, 0)
    with pytest.raises(ValueError, match="offsets"):
        moe8.ops._C.grouped_lowrank_add(
            h, t, b, torch.tensor([0, 9, 8], dtype=torch.int32), 0, h.clone(), 0, True
        )


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act, layout, bias", [("swiglu", "nk", False), ("swiglu_clamped", "kn", True)])
def test_activation_gemm_is_activation_then_gemm_keeping_less(device, act, layout, bias):
    """activation_grouped_gemm gives the bits of activation -> grouped_gemm, forward and every gradient,
    while keeping h but not the activations between forward and backward."""
    torch.manual_seed(4)
    R, I, H, E = 40, 24, 16, 3
    offsets = torch.tensor([0, 11, 11, 40], dtype=torch.int32, device=device)
    kind, lay = moe8.ops.ACTIVATIONS[act], moe8.ops.LAYOUTS[layout]
    h0 = torch.randn(R, 2 * I, device=device)
    b0 = torch.randn(*((E, H, I) if lay == 0 else (E, I, H)), device=device)
    c0 = torch.randn(E, H, device=device) if bias else None
    g = torch.randn(R, H, device=device)

    def run(fused):
        h, b = h0.clone().requires_grad_(), b0.clone().requires_grad_()
        c = c0.clone().requires_grad_() if bias else None
        kept = {}  # storage -> elements: h is saved by both nodes of the fused op, one tensor
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: (kept.setdefault(t.data_ptr(), t.numel()), t)[1], lambda t: t
        ):
            if fused:
                o = moe8.fused.activation_linear(h, b, offsets, lay, c, kind, False, 1.702, 7.0)
            else:
                a = moe8.ops.activation(h, kind, False, 1.702, 7.0)
                o = moe8.ops.grouped_gemm(a, b, offsets, lay, c)
        grads = torch.autograd.grad(o, [h, b] + ([c] if bias else []), g)
        return o, grads, sum(kept.values())

    (o1, g1, kept1), (o2, g2, kept2) = run(True), run(False)
    assert torch.equal(o1, o2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    assert kept2 - kept1 == R * I  # the activations [R, I]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act", ["swiglu", "swiglu_clamped", "silu"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_activation_gemm_consuming_h(device, act, interleaved):
    """consume_h=True: the same output and gradients, d h written over h (no new [R, 2I] buffer), and a
    second backward through the graph raises instead of reading the overwritten h."""
    if act == "silu" and interleaved:
        pytest.skip("interleaving is for gated activations")
    torch.manual_seed(6)
    R, I, H, E = 40, 24, 16, 3
    offsets = torch.tensor([0, 11, 11, 37], dtype=torch.int32, device=device)  # rows 37.. in no group
    kind = moe8.ops.ACTIVATIONS[act]
    width = 2 * I if act != "silu" else I
    x0 = torch.randn(R, 8, device=device)
    w0 = torch.randn(E, width, 8, device=device)
    b0 = torch.randn(E, H, I, device=device)
    g = torch.randn(R, H, device=device)

    def run(consume, retain=False):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        h = moe8.ops.grouped_gemm(x, w, offsets, 0, None)  # an intermediate, as in experts_forward
        o = moe8.fused.activation_linear(h, b, offsets, 0, None, kind, interleaved, 1.702, 7.0, consume)
        return o, torch.autograd.grad(o, [x, w, b], g, retain_graph=retain), h.detach(), (o, x)

    o1, g1, h1, _ = run(True)
    o2, g2, h2, _ = run(False)
    assert torch.equal(o1, o2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    # h now holds d h: the input gradient of h = x · w[e]^T is d h · w[e]
    assert torch.equal(moe8.ops.grouped_gemm(h1, w0, offsets, 1, None), g1[0])
    assert not torch.equal(h1, h2)
    _, _, _, (o, x) = run(True, retain=True)
    with pytest.raises(RuntimeError, match="consume_gate_up: a second backward through this graph"):
        torch.autograd.grad(o, [x], g)


@pytest.mark.skipif(not torch.cuda.is_available() or not moe8.cuda_available(), reason="needs a CUDA GPU")
def test_activation_gemm_consuming_h_lowers_the_peak():
    """consume_h=True: the backward's peak is one [R, 2I] buffer lower (d h is written over h)."""
    R, I, H, K, E = 8192, 512, 256, 64, 4
    offsets = torch.tensor([0, 3000, 3000, 6000, R], dtype=torch.int32, device="cuda")
    kind = moe8.ops.ACTIVATIONS["swiglu"]
    x = torch.randn(R, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(E, 2 * I, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)

    def peak(consume):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        h = moe8.ops.grouped_gemm(x, w, offsets, 0, None)
        o = moe8.fused.activation_linear(h, b, offsets, 0, None, kind, False, 1.702, 7.0, consume)
        del h
        o.backward(g)
        torch.cuda.synchronize()
        x.grad = w.grad = b.grad = None
        return torch.cuda.max_memory_allocated() - base

    peak(True), peak(False)  # warm the allocator and the workspaces
    saved = peak(False) - peak(True)
    assert saved >= 0.9 * R * 2 * I * 2, f"peak only {saved} bytes lower"


@pytest.mark.skipif(not torch.cuda.is_available() or not moe8.cuda_available(), reason="needs a CUDA GPU")
def test_activation_gemm_backward_peak_is_no_higher():
    """The recompute must not raise the peak memory of forward + backward above the unfused ops' (it did when
    one node held the recomputed activations, d activations and d h at once)."""
    R, I, H, E = 8192, 512, 256, 4
    offsets = torch.tensor([0, 3000, 3000, 6000, R], dtype=torch.int32, device="cuda")
    kind = moe8.ops.ACTIVATIONS["swiglu"]
    h0 = torch.randn(R, 2 * I, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(R, H, device="cuda", dtype=torch.bfloat16)

    def peak(fused):  # over forward and backward: the unfused ops hold the activations in between
        h = h0.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if fused:
            o = moe8.fused.activation_linear(h, b, offsets, 0, None, kind, False, 1.702, 7.0)
        else:
            o = moe8.ops.grouped_gemm(moe8.ops.activation(h, kind, False, 1.702, 7.0), b, offsets, 0, None)
        o.backward(g)
        torch.cuda.synchronize()
        b.grad = None
        return torch.cuda.max_memory_allocated() - base

    peak(True), peak(False)  # warm the allocator and the workspaces
    assert peak(True) <= peak(False)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("act", ["swiglu", "swiglu_clamped", "gelu"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("consume", [False, True])
@pytest.mark.parametrize("layout", [0, 1])
def test_activation_down_combine_matches_unfused(device, act, interleaved, consume, layout):
    """activation_down_combine (the routing weights applied after the down projection's dgrad, their
    gradient from d act, not from kept expert outputs) gives activation -> grouped_gemm -> combine's output
    and gradients (float32: up to rounding), with padding rows in the plan, while saving neither the
    activations [R, I] nor the expert outputs [R, H] for the backward."""
    if act == "gelu" and interleaved:
        pytest.skip("interleaving is for gated activations")
    torch.manual_seed(8)
    T, K, E, Hd, I, D = 23, 2, 4, 16, 12, 10  # D: the gate_up GEMM's input width
    ops = moe8.ops
    kind = ops.ACTIVATIONS[act]
    width = 2 * I if act != "gelu" else I
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(torch.int32).to(device)
    _, offsets, row_to_slot, slot_to_row = ops.plan(ids, E, 4, True)  # padded groups: rows with slot -1
    assert (row_to_slot < 0).any()
    xp0 = torch.randn(row_to_slot.shape[0], D, device=device)
    w10 = torch.randn(*((E, width, D) if layout == 0 else (E, D, width)), device=device) * 0.5
    w20 = torch.randn(*((E, Hd, I) if layout == 0 else (E, I, Hd)), device=device) * 0.5
    r0 = torch.rand(T, K, device=device)
    g = torch.randn(T, Hd, device=device)

    def run(fused):
        xp, w1, w2, r = (t.clone().requires_grad_() for t in (xp0, w10, w20, r0))
        kept = {}
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: (kept.setdefault(t.data_ptr(), t.shape), t)[1], lambda t: t
        ):
            h = ops.grouped_gemm(xp, w1, offsets, layout, None)
            args = (kind, interleaved, 1.702, 7.0)
            if fused:
                y = moe8.fused.activation_down_combine(
                    h, w2, offsets, layout, r, slot_to_row, row_to_slot, *args, consume
                )
            else:
                o = moe8.fused.activation_linear(h, w2, offsets, layout, None, *args, consume)
                y = ops.combine(o, r, slot_to_row, row_to_slot)
        return y, torch.autograd.grad(y, [xp, w1, w2, r], g), list(kept.values())

    (y1, g1, kept1), (y2, g2, kept2) = run(True), run(False)
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(["xp", "gate_up", "down", "weights"], g1, g2):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=lambda m, n=name: f"d {n}: {m}")
    R = row_to_slot.shape[0]
    assert torch.Size([R, Hd]) in kept2 and torch.Size([R, Hd]) not in kept1  # the expert outputs
    assert width == I or torch.Size([R, I]) not in kept1  # the activations (ungated: h has their shape)


@pytest.mark.skipif(not torch.cuda.is_available() or not moe8.cuda_available(), reason="needs a CUDA GPU")
def test_experts_peak_without_kept_expert_outputs():
    """The layer no longer holds the expert outputs o [R, H] into the backward (they were kept for the
    routing weights' gradient): forward + backward peak lower by about one [R, H] buffer (less the [R, I]
    d act the new backward holds at its peak) than with the separate activation_grouped_gemm and combine.
    Measured with the permuted rows kept (Config.keep_permuted), which puts the peak in the down projection's
    backward; without them the peak is the up projection's backward, the same for both."""
    T, K, E, Hd, I = 4096, 4, 8, 2048, 128
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(T, Hd, device=dev, dtype=bf, requires_grad=True)
    gu = (torch.randn(E, 2 * I, Hd, device=dev, dtype=bf) * Hd**-0.5).requires_grad_()
    dn = (torch.randn(E, Hd, I, device=dev, dtype=bf) * I**-0.5).requires_grad_()
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, device=dev, requires_grad=True)
    g = torch.randn(T, Hd, device=dev, dtype=bf)

    def peak(routed):  # routed_down False: activation_linear, then combine keeping o for its backward
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        cfg = moe8.Config(routed_down=routed, keep_permuted=True)
        y = layer.experts_forward(x, ids, w, gu, dn, check_ids=False, config=cfg)
        y.backward(g)
        torch.cuda.synchronize()
        x.grad = gu.grad = dn.grad = w.grad = None
        return torch.cuda.max_memory_allocated() - base

    peak(True), peak(False)  # warm the allocator and the workspaces
    saved = peak(False) - peak(True)
    assert saved >= 0.8 * T * K * Hd * 2, f"peak only {saved} bytes lower"
