"""moe8.fp8.quantize_grouped_gemm_fp8 (the 1x128 quantisation of the rows and the blockwise FP8 grouped GEMM in
one call into the core): bit for bit the two ops it replaces, at awkward shapes (no rows, one row, K not a
multiple of 128, an expert without rows, rows past the last group, rows gathered from tokens with padding),
against a plain-PyTorch simulation in float64, every output element written (poisoned first), its errors naming
the argument; the FP8 linear layer and the experts' FP8 GEMMs on it (the same bits, one extension call per
forward GEMM); and moe8._core's shape-keyed caches (one-group offsets, unit scales, workspaces): shared,
bounded, never handed out while a CUDA graph is captured, workspaces never shared by two streams."""

import pytest
import torch
from conftest import devices

from moe8 import _core, fp8, fp8_linear, ops, precision
from moe8.fp8 import Float8Recipe
from moe8.ops import _C

E4M3 = torch.float8_e4m3fn


def operands(device, R, K, N, counts, dtype=torch.bfloat16, seed=0):
    """x [R, K], the blockwise weight (q, scale) of E = len(counts) experts [E, N, K], offsets of counts (their
    sum <= R: rows past it belong to no expert)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, K, generator=g) * torch.logspace(-2, 2, K)[torch.randperm(K, generator=g)]).to(dtype)
    w = torch.randn(len(counts), N, K, generator=g).to(dtype)
    q, s = fp8.quantize_weight_128x128(w)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    return [t.to(device) for t in (x, q, s, offsets)]


def two_calls(x, row_to_slot, k, slot_to_row, q, s, offsets, dtype):
    a, a_s = fp8.quantize_rows_1x128(x, row_to_slot, k, slot_to_row)
    return fp8.grouped_gemm_fp8(a, a_s, q, s, offsets, dtype)


def same_bits(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))
    )


# (R rows, K, N, rows per expert)
SHAPES = [
    (0, 128, 64, [0]),
    (1, 128, 64, [1]),
    (5, 200, 72, [5]),  # K, N not multiples of 128
    (130, 256, 136, [64, 0, 60]),  # an expert without rows; 6 rows past offsets[E]
    (64, 16, 8, [30, 34]),
    (48, 384, 256, [48]),
]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"R{s[0]}K{s[1]}N{s[2]}E{len(s[3])}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_is_the_two_ops_bit_for_bit(device, shape, dtype):
    R, K, N, counts = shape
    x, q, s, offsets = operands(device, R, K, N, counts, dtype)
    out = torch.bfloat16 if dtype == torch.float32 else dtype
    got = fp8.quantize_grouped_gemm_fp8(x, None, 1, None, q, s, offsets, out)
    assert same_bits(got, two_calls(x, None, 1, None, q, s, offsets, out))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("k", [1, 2, 8])
def test_gathered_rows_are_the_two_ops_bit_for_bit(device, k):
    """Rows gathered from the tokens (row_to_slot, with padding rows of -1), with and without slot_to_row."""
    T, K, N, E = 37, 320, 96, 3
    g = torch.Generator().manual_seed(k)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16).to(device)
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32).to(device)
    _, offsets, row_to_slot, slot_to_row = ops.plan(ids, E, 16)
    w = torch.randn(E, N, K, generator=g).to(torch.bfloat16).to(device)
    q, s = fp8.quantize_weight_128x128(w)
    assert (row_to_slot < 0).any()  # padding rows
    for s2r in (None, slot_to_row):
        got = fp8.quantize_grouped_gemm_fp8(x, row_to_slot, k, s2r, q, s, offsets, torch.bfloat16)
        assert same_bits(got, two_calls(x, row_to_slot, k, s2r, q, s, offsets, torch.bfloat16))


def qdq(t, bm, bk):
    """Quantise-dequantise t [..., M, K] in bm x bk blocks with torch's float8_e4m3fn cast (float64 out)."""
    *lead, M, K = t.shape
    Mp, Kp = -(-M // bm) * bm, -(-K // bk) * bk
    tp = torch.zeros(*lead, Mp, Kp, dtype=torch.float64)
    tp[..., :M, :K] = t.double()
    b = tp.view(*lead, Mp // bm, bm, Kp // bk, bk)
    amax = b.abs().amax(dim=(-3, -1), keepdim=True)
    sc = torch.where(amax > 0, amax / 448, torch.ones_like(amax)).float().double()
    return ((b * (1.0 / sc)).float().to(E4M3).double() * sc).view(*lead, Mp, Kp)[..., :M, :K]


@pytest.mark.parametrize("device", devices())
def test_against_float64_simulation(device):
    R, K, N, counts = 130, 272, 136, [64, 0, 60]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(R, K, generator=g).to(torch.bfloat16)
    w = torch.randn(len(counts), N, K, generator=g).to(torch.bfloat16)
    q, s = fp8.quantize_weight_128x128(w)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    c = fp8.quantize_grouped_gemm_fp8(
        x.to(device), None, 1, None, q.to(device), s.to(device), offsets.to(device), torch.bfloat16
    ).cpu()
    xd, wd = qdq(x, 1, 128), qdq(w, 128, 128)
    want = torch.zeros(R, N, dtype=torch.float64)
    for e in range(len(counts)):
        r0, r1 = int(offsets[e]), int(offsets[e + 1])
        want[r0:r1] = xd[r0:r1] @ wd[e].t()
    assert torch.equal(c[int(offsets[-1]) :], torch.zeros(R - int(offsets[-1]), N, dtype=torch.bfloat16))
    rel = ((c.double() - want).norm() / want.norm()).item()
    assert rel < 4e-3, rel


@pytest.mark.parametrize("device", devices())
def test_writes_every_output_element(device):
    """The core call with c poisoned (NaN) and the scratch filled with 0xff: every element of c is written."""
    R, K, N, counts = 70, 200, 40, [30, 0, 20]  # 20 rows past offsets[E]: zeroed
    x, q, s, offsets = operands(device, R, K, N, counts)
    c = torch.full((R, N), float("nan"), dtype=torch.bfloat16, device=device)
    scratch = torch.full(
        (_C.quantize_grouped_gemm_fp8_scratch_bytes(R, K),), 255, dtype=torch.uint8, device=device
    )
    ws = fp8._fp8_workspace(x, q.shape[0])
    _C.quantize_grouped_gemm_fp8(x, None, 1, None, q, s, offsets, scratch, c, _core.stream(x), True, ws)
    assert not c.isnan().any()
    assert same_bits(c, two_calls(x, None, 1, None, q, s, offsets, torch.bfloat16))


def test_scratch_bytes():
    # scales [R, ceil(K/128)] f32 first, the codes from the next 256-byte boundary
    assert _C.quantize_grouped_gemm_fp8_scratch_bytes(0, 128) == 0
    assert _C.quantize_grouped_gemm_fp8_scratch_bytes(1, 128) == 256 + 128
    assert _C.quantize_grouped_gemm_fp8_scratch_bytes(64, 200) == 512 + 64 * 200
    with pytest.raises(ValueError, match="rows, cols: expected >= 0"):
        _C.quantize_grouped_gemm_fp8_scratch_bytes(-1, 128)


def test_errors_name_the_argument():
    x, q, s, offsets = operands("cpu", 8, 128, 64, [8])
    c = torch.empty(8, 64, dtype=torch.bfloat16)
    need = _C.quantize_grouped_gemm_fp8_scratch_bytes(8, 128)
    scratch = torch.empty(need, dtype=torch.uint8)

    def call(x=x, q=q, s=s, offsets=offsets, scratch=scratch, c=c, row_to_slot=None):
        _C.quantize_grouped_gemm_fp8(x, row_to_slot, 1, None, q, s, offsets, scratch, c, 0, True, None)

    call()
    with pytest.raises(ValueError, match="scratch: expected at least"):
        call(scratch=scratch[: need - 1])
    with pytest.raises(ValueError, match="scratch: expected a 16-byte aligned start"):
        call(scratch=torch.empty(need + 1, dtype=torch.uint8)[1:])
    with pytest.raises(ValueError, match="scratch"):
        call(scratch=torch.empty(need, dtype=torch.int32))
    with pytest.raises(ValueError, match="b: expected shape"):
        call(q=q[:, :, :64].contiguous())
    with pytest.raises(ValueError, match="b_scale"):
        call(s=s[:, :0])
    with pytest.raises(ValueError, match="offsets"):
        call(offsets=torch.tensor([0, 9], dtype=torch.int32))  # past the 8 rows
    with pytest.raises(ValueError, match="c: expected shape"):
        call(c=torch.empty(8, 63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x: expected"):
        call(x=x.t().contiguous().t())
    with pytest.raises(ValueError, match="row_to_slot"):
        call(row_to_slot=torch.tensor([0, 9] * 4, dtype=torch.int32))  # 9 >= T * k
    with pytest.raises(TypeError, match="dtype: expected"):
        fp8.quantize_grouped_gemm_fp8(x, None, 1, None, q, s, offsets, torch.int32)


def test_op_is_a_custom_op():
    x, q, s, offsets = operands("cpu", 12, 256, 64, [5, 7])
    torch.library.opcheck(fp8.quantize_grouped_gemm_fp8, (x, None, 1, None, q, s, offsets, torch.bfloat16))


# ------------------------------------------------------------------ the FP8 layers on the one call
@pytest.fixture
def ext_calls(monkeypatch):
    """The names of the extension's functions called while the test runs (moe8._core.C reads them through
    this stand-in for moe8._C; the functions C had bound are put back afterwards)."""
    calls, ext = [], _core._ext

    class Ext:
        def __getattr__(self, name):
            fn = getattr(ext, name)

            def counted(*args):
                calls.append(name)
                return fn(*args)

            return counted

    monkeypatch.setattr(_core, "_ext", Ext())
    bound = dict(_core.C.__dict__)
    _core.C.__dict__.clear()
    yield calls
    _core.C.__dict__.clear()
    _core.C.__dict__.update(bound)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("M", [0, 1, 33, 128])
def test_fp8_linear_of_a_frozen_weight_is_the_two_ops(device, M, ext_calls):
    """The FP8 linear layer over a weight stored in FP8 only: one extension call a forward, the bits of the
    quantisation and the one-group GEMM as two ops."""
    g = torch.Generator().manual_seed(M)
    w = torch.randn(96, 256, generator=g).to(torch.bfloat16).to(device)
    frozen = fp8.freeze_fp8(w, 0)
    x = torch.randn(M, 256, generator=g).to(torch.bfloat16).to(device)
    value = fp8.frozen_fp8(frozen).value
    offsets = torch.tensor([0, M], dtype=torch.int32, device=device)
    want = two_calls(x, None, 1, None, value.q, value.scale, offsets, torch.bfloat16)
    with torch.no_grad():
        fp8_linear.fp8_linear(x, frozen)  # warm: the shape's sizes are asked once
        ext_calls.clear()
        y = fp8_linear.fp8_linear(x, frozen)
    assert ext_calls == ["quantize_grouped_gemm_fp8"], ext_calls
    assert same_bits(y, want)


@pytest.mark.parametrize("device", devices())
def test_experts_fp8_gemms_are_the_two_ops(device):
    """Fp8Gemms.forward (rows given) and gathered_forward (rows gathered from x) give the two ops' bits."""
    T, H, N, E, k = 29, 256, 64, 4, 2
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32).to(device)
    _, offsets, row_to_slot, slot_to_row = ops.plan(ids, E, 16)
    w = torch.randn(E, N, H, generator=g).to(torch.bfloat16).to(device)
    prec = precision.Fp8Gemms("blockwise", cache=None)
    wq = prec.quantized(w, 0)
    rows = ops.gather_rows(x, row_to_slot, k, None, slot_to_row)
    want = two_calls(rows, None, 1, None, wq.q, wq.scale, offsets, torch.bfloat16)
    assert same_bits(prec.forward(rows, w, wq, offsets, 0), want)
    got = prec.gathered_forward(x, (row_to_slot, k, slot_to_row), w, wq, offsets, 0)
    assert same_bits(got, two_calls(x, row_to_slot, k, slot_to_row, wq.q, wq.scale, offsets, torch.bfloat16))
    assert same_bits(got, want)


# --------------------------------------------------------------------------- the shape-keyed caches
@pytest.mark.parametrize("device", devices())
def test_one_group_offsets_are_shared_and_right(device):
    like = torch.empty(0, device=device)
    for rows in (0, 1, 77):
        t = _core.one_group_offsets(rows, like)
        assert t.dtype == torch.int32 and t.device == like.device and t.tolist() == [0, rows]
        assert _core.one_group_offsets(rows, like) is t  # no allocation the second time


def test_caches_are_bounded():
    lru = _core._Lru(3, 100)
    for i in range(5):
        lru.put(i, torch.empty(8, dtype=torch.uint8))
    assert len(lru) == 3 and lru.get(0) is None and lru.get(4) is not None
    lru.put("big", torch.empty(101, dtype=torch.uint8))  # larger than the budget: not kept
    assert lru.get("big") is None
    for i in range(3):
        lru.put(("mid", i), torch.empty(40, dtype=torch.uint8))  # 120 bytes > 100: the oldest goes
    assert lru.nbytes <= 100 and lru.get(("mid", 0)) is None and lru.get(("mid", 2)) is not None
    like = torch.empty(0)
    for rows in range(200):
        _core.one_group_offsets(rows, like)
    assert len(_core._constants) <= _core._constants.size


def test_unit_scales_are_shared():
    w = torch.randn(2, 130, 256).to(torch.bfloat16)
    r = Float8Recipe("rowwise")
    a, b = fp8.quantize_weight(w, 0, r), fp8.quantize_weight(w, 0, r)
    assert a.scale is b.scale and torch.equal(a.scale, torch.ones(2, 2, 2))
    t = fp8.quantize_weight(w, 0, Float8Recipe("tensorwise"))
    assert t.scale is not a.scale  # ones * the tensor's scale: a tensor of its own


def test_nothing_is_kept_from_a_trace():
    """Under a fake mode (what torch.compile traces with) the caches make fresh tensors and keep none."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        like = mode.from_tensor(torch.empty(0, dtype=torch.int32))
        (
            _core.one_group_offsets(12345, like),
            _core.shared_arange(12345, like),
            _core.shared_ones((3, 12345), like),
        )
    cpu = torch.device("cpu")
    keys = (("one_group", cpu, 12345), ("arange", cpu, torch.int32, 12345), ("ones", cpu, (3, 12345)))
    assert all(_core._constants.get(key) is None for key in keys)
    assert _core.one_group_offsets(12345, torch.empty(0)).tolist() == [0, 12345]  # a real tensor again


def test_scratch_on_the_cpu_is_new_each_call():
    like = torch.empty(0)
    assert _core.scratch(like, 64) is not _core.scratch(like, 64)


cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and _C.cuda_available()), reason="no CUDA build or GPU"
)


@cuda
def test_workspaces_are_per_stream():
    like = torch.empty(0, device="cuda")
    a = _core.scratch(like, 4096)
    assert _core.scratch(like, 4096) is a  # one stream: shared
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        b = _core.scratch(like, 4096)
        assert b is not a and _core.scratch(like, 4096) is b
    assert _core.scratch(like, 4096, torch.int32) is not a
    import threading

    other = []
    thread = threading.Thread(target=lambda: other.append(_core.scratch(like, 4096)))
    thread.start(), thread.join()
    assert other[0] is not a  # two threads' launches on one stream could interleave: never one workspace


@cuda
def test_nothing_cached_is_handed_out_while_a_graph_is_captured():
    like = torch.empty(0, device="cuda")
    offsets, ws = _core.one_group_offsets(64, like), _core.scratch(like, 4096)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        assert _core.one_group_offsets(64, like) is not offsets
        assert _core.scratch(like, 4096) is not ws
    assert _core.one_group_offsets(64, like) is offsets


@cuda
@pytest.mark.parametrize("M", [1, 64, 200])
def test_fp8_linear_in_a_cuda_graph_is_the_eager_call(M):
    """A frozen FP8 linear layer's forward captured and replayed: the eager call's bits."""
    g = torch.Generator().manual_seed(M)
    frozen = fp8.freeze_fp8(torch.randn(256, 512, generator=g).to(torch.bfloat16).cuda(), 0)
    x = torch.randn(M, 512, generator=g).to(torch.bfloat16).cuda()
    with torch.no_grad():
        want = fp8_linear.fp8_linear(x, frozen)
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fp8_linear.fp8_linear(x, frozen)  # warm on the capture stream
            with torch.cuda.graph(graph, stream=side):
                y = fp8_linear.fp8_linear(x, frozen)
        torch.cuda.current_stream().wait_stream(side)
        graph.replay()
        torch.cuda.synchronize()
    assert same_bits(y, want)


def test_compiled_fp8_experts_forward_and_backward_are_eager():
    """torch.compile traces the experts' FP8 GEMMs (forward and the FP8 dgrad of the backward, which autograd
    traces too) through the op, not the core call: the eager bits."""
    T, H, I, E, k = 16, 128, 128, 4, 2
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(k, -1)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(torch.bfloat16)
    down = (torch.randn(E, H, I, generator=g) * 0.1).to(torch.bfloat16)
    prec = precision.Fp8Gemms(Float8Recipe("blockwise", dgrad="fp8"), cache=None)

    def step(x):
        import moe8

        return moe8.experts_forward(x, ids.int(), w, gate_up, down, fp8=prec, check_ids=False)

    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        xg = x.clone().requires_grad_()
        y = fn(xg)
        y.float().square().sum().backward()
        results.append((y.detach(), xg.grad))
    assert same_bits(results[0][0], results[1][0]) and same_bits(results[0][1], results[1][1])
