"""Each CUDA kernel against the CPU reference on the same inputs: outputs poisoned (NaN / -1) first so
every element must be written; ids and plans must match exactly; two runs must be bitwise equal.
Skips, saying why, where no GPU is visible."""

import pytest
import torch

import moe8
from moe8.ops import _C

pytestmark = pytest.mark.skipif(
    not moe8.cuda_available(), reason="no CUDA device visible or moe8 built without CUDA"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def poison(shape, dtype, device):
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -7, dtype=dtype, device=device)


def close(a, b, dtype, what):
    assert torch.isfinite(a).all(), f"{what}: non-finite values (unwritten?)"
    a, b = a.double().cpu(), b.double().cpu()
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err < TOL[dtype], f"{what}: relative error {err:.3g}"


def run_both(fn, out_specs, *inputs):
    """Calls fn(*inputs, *outs) on CPU and CUDA with poisoned outputs; returns (cpu_outs, cuda_outs)."""
    res = []
    for dev in ("cpu", "cuda"):
        outs = [poison(s, d, dev) for s, d in out_specs]
        args = [x.to(dev) if torch.is_tensor(x) else x for x in inputs]
        fn(dev, *args, *outs)
        torch.cuda.synchronize()
        res.append(outs)
    return res


def route_inputs(T, E, scheme, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, E, generator=g) * 2).to(dtype)
    bias = (torch.randn(E, generator=g) * 0.1) if scheme == 1 else None
    return logits, bias


ROUTE_CASES = [  # T, E, K, scheme, renorm, n_group, topk_group, scaling
    (4096, 128, 8, 0, True, 1, 1, 1.0),
    (333, 60, 4, 0, False, 1, 1, 1.0),
    (1, 8, 2, 0, True, 1, 1, 1.0),
    (2048, 256, 8, 1, True, 8, 4, 2.5),
    (517, 64, 6, 1, False, 4, 2, 1.0),
    (1000, 32, 4, 2, False, 1, 1, 1.0),
    (77, 7, 7, 2, False, 1, 1, 1.0),
    (0, 16, 2, 0, True, 1, 1, 1.0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROUTE_CASES)
def test_route_forward_backward(dtype, case):
    T, E, K, scheme, renorm, ng, tg, sc = case
    logits, bias = route_inputs(T, E, scheme, dtype, T + E)
    params = (scheme, K, renorm, ng, tg, sc)
    f32 = torch.float32
    specs = [((T, K), torch.int32), ((T, K), f32), ((E,), f32), ((E,), f32), ((T,), f32)]

    def fwd(dev, lg, b, *outs):
        _C.route_forward(lg, b, *params, *outs, torch.cuda.current_stream().cuda_stream)

    cpu, gpu = run_both(fwd, specs, logits, bias)
    assert torch.equal(cpu[0], gpu[0].cpu()), "ids differ"
    for name, a, b in zip(["weights", "prob_mean", "token_frac", "lse"], gpu[1:], cpu[1:]):
        if b.numel():
            close(a, b, torch.float32, name)
    gw = torch.randn(T, K)
    gpm, glse = torch.randn(E), torch.randn(T)

    def bwd(dev, lg, b, ids, g1, g2, g3, out):
        _C.route_backward(lg, b, *params, ids, g1, g2, g3, out, torch.cuda.current_stream().cuda_stream, True)

    cpu_b, gpu_b = run_both(bwd, [((T, E), dtype)], logits, bias, cpu[0], gw, gpm, glse)
    if T:
        close(gpu_b[0], cpu_b[0], dtype, "grad_logits")
    again = poison((T, E), dtype, "cuda")
    bwd(
        "cuda",
        logits.cuda(),
        None if bias is None else bias.cuda(),
        cpu[0].cuda(),
        gw.cuda(),
        gpm.cuda(),
        glse.cuda(),
        again,
    )
    assert torch.equal(again, gpu_b[0]) or T == 0, "route_backward is not deterministic"


PLAN_CASES = [(16384, 8, 128, 1), (1000, 2, 8, 16), (1, 1, 4, 1), (5000, 4, 512, 8), (3000, 8, 64, 1)]


@pytest.mark.parametrize("case", PLAN_CASES)
@pytest.mark.parametrize("skew", [False, True])
def test_plan(case, skew):
    T, K, E, pad = case
    g = torch.Generator().manual_seed(T + E)
    scores = torch.rand(T, E, generator=g)
    if skew:  # Zipf-like: low experts get most tokens, some experts none
        scores = scores * (1.0 / torch.arange(1, E + 1)) ** 2
    ids = scores.topk(K, dim=-1)[1].int()
    R = _C.plan_max_rows(T * K, E, pad)
    assert R >= T * K + E * (pad - 1) and R % pad == 0
    i32 = torch.int32
    specs = [((E,), i32), ((E + 1,), i32), ((R,), i32), ((T * K,), i32)]

    def fn(dev, ids, *outs):
        ws = None
        if dev == "cuda":
            ws = torch.empty(_C.plan_workspace_elems(T * K, E, True), dtype=i32, device=dev)
        _C.build_dispatch_plan(ids, E, pad, *outs, ws, torch.cuda.current_stream().cuda_stream, True)

    cpu, gpu = run_both(fn, specs, ids)
    for name, a, b in zip(["counts", "offsets", "row_to_slot", "slot_to_row"], gpu, cpu):
        assert torch.equal(a.cpu(), b), name


def plan_cpu(ids, E):
    return moe8.ops.plan(ids, E, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [2048, 20, 1, 7168])
def test_row_movement(dtype, H):
    T, K, E = 700, 4, 16
    g = torch.Generator().manual_seed(H)
    ids = torch.rand(T, E, generator=g).topk(K, dim=-1)[1].int()
    _, offsets, r2s, s2r = plan_cpu(ids, E)
    R = r2s.numel()
    x = torch.randn(T, H, generator=g).to(dtype)
    rows = torch.randn(R, H, generator=g).to(dtype)
    w = torch.rand(T, K, generator=g)
    s = torch.cuda.current_stream().cuda_stream
    for scale in (None, w.reshape(-1)):
        cpu, gpu = run_both(
            lambda dev, x, r, sc, out: _C.gather_rows(x, r, K, sc, out, s, True),
            [((R, H), dtype)],
            x,
            r2s,
            scale,
        )
        assert torch.equal(gpu[0].cpu(), cpu[0]) if scale is None else True
        close(gpu[0], cpu[0], dtype, "gather_rows")
    for wt in (None, w):
        cpu, gpu = run_both(
            lambda dev, r, m, wt, out: _C.combine_rows(r, m, wt, out, s, True),
            [((T, H), dtype)],
            rows,
            s2r.view(T, K),
            wt,
        )
        close(gpu[0], cpu[0], dtype, "combine_rows")
    cpu, gpu = run_both(
        lambda dev, dy, r, m, out: _C.combine_weights_grad(dy, r, m, out, s, True),
        [((T, K), torch.float32)],
        x,
        rows,
        s2r.view(T, K),
    )
    close(gpu[0], cpu[0], torch.float32 if dtype == torch.float32 else dtype, "combine_weights_grad")


GEMM_CASES = [  # rows per expert (list), Kd, N
    ([100, 0, 37, 300, 1], 64, 96),
    ([1000, 3, 0, 500, 250, 0, 7, 41], 256, 384),
    ([5, 9], 7, 13),
    ([0, 0, 0], 32, 32),
    ([513], 2048, 136),
    ([64] * 128, 128, 64),
]


LOWRANK_CASES = [  # rows per expert, rank, N (packs along N and along the rank, and not)
    ([100, 0, 37, 300, 1], 16, 96),
    ([5, 9], 7, 13),
    ([0, 0, 0], 16, 32),
    ([64] * 128, 16, 1536),
    ([513, 2], 64, 2048),
    ([1000, 24, 0, 700], 32, 200),  # [E, N, r] through registers: rank 17..32, N past the last 128 columns
    ([300, 0, 5, 61], 20, 520),
    ([3, 130, 1], 5, 64),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("case", LOWRANK_CASES, ids=lambda c: f"E{len(c[0])}-r{c[1]}-N{c[2]}")
def test_grouped_lowrank_add(dtype, layout, case):
    counts, rank, N = case
    E = len(counts)
    off = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).int()
    R = int(off[-1]) + 3  # rows past offsets[E] get h
    g = torch.Generator().manual_seed(rank * N + E)
    h, t = torch.randn(R, N, generator=g).to(dtype), torch.randn(R, rank, generator=g).to(dtype)
    b = torch.randn(*((E, N, rank) if layout == 0 else (E, rank, N)), generator=g).to(dtype)
    s = torch.cuda.current_stream().cuda_stream
    cpu, gpu = run_both(
        lambda dev, h, t, b, o, out: _C.grouped_lowrank_add(h, t, b, o, layout, out, s, True),
        [((R, N), dtype)],
        h,
        t,
        b,
        off,
    )
    close(gpu[0], cpu[0], dtype, "grouped_lowrank_add")
    assert torch.equal(gpu[0][int(off[-1]) :].cpu(), h[int(off[-1]) :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: f"E{len(c[0])}-K{c[1]}-N{c[2]}")
def test_grouped_gemm(dtype, layout, case):
    counts, Kd, N = case
    E = len(counts)
    off = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).int()
    R = int(off[-1]) + 3  # trailing rows past offsets[E] must be zeroed
    g = torch.Generator().manual_seed(Kd * N + E)
    a = torch.randn(R, Kd, generator=g).to(dtype)
    b = (torch.randn(E, N, Kd, generator=g) if layout == 0 else torch.randn(E, Kd, N, generator=g)).to(dtype)
    bias = torch.randn(E, N, generator=g).to(dtype)
    s = torch.cuda.current_stream().cuda_stream
    for bi in (None, bias, bias.float()):
        cpu, gpu = run_both(
            lambda dev, a, b, o, bi, c: _C.grouped_gemm(a, b, o, layout, bi, c, s, True),
            [((R, N), dtype)],
            a,
            b,
            off,
            bi,
        )
        close(gpu[0], cpu[0], dtype, "grouped_gemm")
        assert (gpu[0][int(off[-1]) :] == 0).all()
    dc = torch.randn(R, N, generator=g).to(dtype)
    dshape = (E, N, Kd) if layout == 0 else (E, Kd, N)
    for db_dtype in (dtype, torch.float32):
        cpu, gpu = run_both(
            lambda dev, a, dc, o, db, dbias: _C.grouped_gemm_wgrad(a, dc, o, layout, db, dbias, s, True),
            [(dshape, db_dtype), ((E, N), db_dtype)],
            a,
            dc,
            off,
        )
        close(gpu[0], cpu[0], dtype, "wgrad db")
        close(gpu[1], cpu[1], dtype, "wgrad dbias")
        again = [poison(dshape, db_dtype, "cuda"), poison((E, N), db_dtype, "cuda")]
        _C.grouped_gemm_wgrad(a.cuda(), dc.cuda(), off.cuda(), layout, *again, s, True)
        assert torch.equal(again[0], gpu[0]) and torch.equal(again[1], gpu[1]), "wgrad is not deterministic"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,inter", [(0, False), (0, True), (1, True), (1, False), (2, False), (3, False)])
def test_activation(dtype, kind, inter):
    R, I = 1001, 768 if kind < 2 else 333
    W = 2 * I if kind < 2 else I
    g = torch.Generator().manual_seed(kind)
    h = (torch.randn(R, W, generator=g) * 5).to(dtype)  # wide enough to hit the GPT-OSS clamps
    dout = torch.randn(R, I, generator=g).to(dtype)
    s = torch.cuda.current_stream().cuda_stream
    cpu, gpu = run_both(
        lambda dev, h, out: _C.activation_forward(h, kind, inter, 1.702, 7.0, out, s), [((R, I), dtype)], h
    )
    close(gpu[0], cpu[0], dtype, "activation")
    cpu, gpu = run_both(
        lambda dev, h, d, dh: _C.activation_backward(h, d, kind, inter, 1.702, 7.0, dh, s),
        [((R, W), dtype)],
        h,
        dout,
    )
    close(gpu[0], cpu[0], dtype, "activation_backward")


def test_layer_on_cuda_matches_cpu():
    torch.manual_seed(0)
    cpu_layer = moe8.MoELayer(256, 192, 16, 4)
    gpu_layer = moe8.MoELayer(256, 192, 16, 4, device="cuda")
    gpu_layer.load_state_dict(cpu_layer.state_dict())
    x = torch.randn(1000, 256)
    outs = []
    for layer, xx in ((cpu_layer, x), (gpu_layer, x.cuda())):
        y, r = layer(xx)
        (y.square().sum() + moe8.load_balancing_loss(r)).backward()
        outs.append([y] + [p.grad for p in layer.parameters()])
    for a, b in zip(outs[1], outs[0]):
        close(a, b, torch.float32, "layer")
