"""moe8.ops.rms_norm against a float64 pure-torch reference and against torch.nn.functional.rms_norm: forward,
the gradients of x and the weight through autograd, any leading shape and strides, awkward widths (1, 3, 100,
4100) and row counts (0, 1), fp32 / bf16 / fp16; argument errors and torch.library's checks; Config.norm_kernel
and the HF norm forward it switches (on the CPU; CUDA cases skip without a GPU)."""

import types

import pytest
import torch
import torch.nn.functional as F
from conftest import devices

import moe8
from moe8 import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6

# x's shape [..., H]: no rows, one row, widths no 16-byte pack divides, a head dim, hidden sizes, leading dims.
SHAPES = [
    (0, 128),
    (1, 1),
    (5, 3),
    (7, 100),
    (33, 128),
    (1, 2048),
    (9, 2048),
    (3, 4100),
    (2, 3, 5, 128),
    (128,),
]


def reference(x, w, eps):
    """RMSNorm in float64: x * rsqrt(mean(x^2) + eps) * w over the last dim."""
    x, w = x.double(), w.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def inputs(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(shape, generator=g) * 4 - 2).to(dtype=dtype, device=device)
    w = (torch.rand(shape[-1], generator=g) * 3 - 1.5).to(dtype=dtype, device=device)
    dy = (torch.rand(shape, generator=g) * 2 - 1).to(dtype=dtype, device=device)
    return x, w, dy


def check_close(got, want, dtype, what, scale=None):
    """fp32: within 1e-5 of the float64 value (relative to scale, default |want|); 16-bit: within a rounding of
    the output plus fp32 error."""
    assert torch.isfinite(got).all(), f"{what}: non-finite values (unwritten?)"
    got, want = got.double().cpu(), want.double().cpu()
    scale = want.abs() if scale is None else scale.double().cpu()
    rel = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    err = (got - want).abs()
    bad = err > rel * (want.abs() + scale) + 1e-6
    assert not bad.any(), f"{what}: {int(bad.sum())} of {got.numel()} off, max error {err.max().item():.3g}"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_float64_reference(device, dtype, shape):
    """Forward and both gradients against autograd through the float64 formula."""
    x, w, dy = inputs(shape, dtype, device, seed=sum(shape) + len(shape))
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = ops.rms_norm(x, w, EPS)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert dx.shape == x.shape and dw.shape == w.shape and dw.dtype == dtype

    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    y64 = reference(x64, w64, EPS)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    check_close(y, y64.detach(), dtype, "y")
    # dx and dw sum over a row / over the rows: their error scales with the terms' magnitudes
    rstd = torch.rsqrt(x64.detach().pow(2).mean(-1, keepdim=True) + EPS)
    g = (dy.double() * w64.detach()).abs()
    dx_scale = rstd * (
        g + (x64.detach() * rstd).abs() * (g * (x64.detach() * rstd).abs()).mean(-1, keepdim=True)
    )
    check_close(dx, dx64, dtype, "dx", dx_scale)
    dw_scale = (dy.double() * x64.detach() * rstd).abs().reshape(-1, shape[-1]).sum(0)
    check_close(dw, dw64, dtype, "dweight", dw_scale)
    if x.numel() == 0:
        assert torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_rms_norm(device, dtype):
    """The semantics of torch.nn.functional.rms_norm (fp32 statistics, the weight applied in fp32, one
    rounding): fp32 within 1e-6, 16-bit within one rounding step."""
    x, w, dy = inputs((4, 6, 256), dtype, device, seed=1)
    y = ops.rms_norm(x, w, 1e-5)
    want = F.rms_norm(x, (256,), w, 1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    else:
        step = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
        assert ((y.float() - want.float()).abs() <= 2 * step * want.float().abs() + 1e-6).all()


@pytest.mark.parametrize("device", devices())
def test_strided_input_and_eps(device):
    """x through a transpose (made contiguous inside) gives the contiguous copy's result; eps is applied inside
    the square root (rows of zeros come out as zeros, rows of tiny values are damped by it)."""
    x, w, _ = inputs((16, 64), torch.float32, device, seed=2)
    strided = x.t().contiguous().t()
    assert not strided.is_contiguous()
    assert torch.equal(ops.rms_norm(strided, w, EPS), ops.rms_norm(x, w, EPS))
    tiny = torch.full((2, 64), 1e-4, device=device)
    tiny[1] = 0
    y = ops.rms_norm(tiny, w, 1e-4)
    torch.testing.assert_close(y[0], 1e-4 / (1e-8 + 1e-4) ** 0.5 * w)
    assert torch.equal(y[1], torch.zeros_like(w))


@pytest.mark.parametrize("device", devices())
def test_weight_gradient_is_the_same_bits_every_run(device):
    x, w, dy = inputs((8192 if device == "cuda" else 512, 128), torch.bfloat16, device, seed=3)
    _, rstd = ops.rms_norm_forward(x, w, EPS)
    first = ops.rms_norm_backward(dy, x, w, rstd)
    for _ in range(3):
        again = ops.rms_norm_backward(dy, x, w, rstd)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@pytest.mark.skipif(
    not (torch.cuda.is_available() and moe8.cuda_available()), reason="no CUDA build or no GPU"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape", [(8192, 2048), (8192 * 4, 128), (64, 7168), (16, 8192), (5, 20000), (3, 4101)]
)
def test_cuda_matches_cpu_at_model_shapes(dtype, shape):
    """The kernels at the shapes of Qwen3-30B-A3B's norms and past the register cache, against the CPU
    reference (outputs, rstd and both gradients)."""
    x, w, dy = inputs(shape, dtype, "cpu", seed=4)
    cpu_y, cpu_rstd = ops.rms_norm_forward(x, w, EPS)
    cpu_dx, cpu_dw = ops.rms_norm_backward(dy, x, w, cpu_rstd)
    xg, wg, dyg = x.cuda(), w.cuda(), dy.cuda()
    y, rstd = ops.rms_norm_forward(xg, wg, EPS)
    dx, dw = ops.rms_norm_backward(dyg, xg, wg, rstd)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(y.cpu(), cpu_y, **tol)
    torch.testing.assert_close(rstd.cpu(), cpu_rstd, rtol=1e-5, atol=0)
    torch.testing.assert_close(dx.cpu(), cpu_dx, **tol)
    torch.testing.assert_close(dw.float().cpu(), cpu_dw.float(), rtol=2**-7, atol=1e-2 * shape[0] ** 0.5)


def test_opcheck():
    x = torch.randn(4, 3, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    torch.library.opcheck(ops.rms_norm_forward, (x, w, 1e-5))
    _, rstd = ops.rms_norm_forward(x.detach(), w.detach(), 1e-5)
    torch.library.opcheck(ops.rms_norm_backward, (torch.randn(4, 3, 32), x.detach(), w.detach(), rstd))


def test_bad_arguments_name_the_argument():
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(TypeError, match=r"x: expected dtype"):
        ops.rms_norm(x.int(), w)
    with pytest.raises(TypeError, match=r"x: expected a torch.Tensor"):
        ops.rms_norm([1.0, 2.0], w)
    with pytest.raises(ValueError, match=r"weight: expected shape \[8\] \(x's last dim\), got \[7\]"):
        ops.rms_norm(x, torch.randn(7))
    with pytest.raises(ValueError, match=r"weight: expected a 1-d tensor"):
        ops.rms_norm(x, torch.randn(1, 8))
    with pytest.raises(TypeError, match=r"weight: expected dtype torch.float32 \(same as x\)"):
        ops.rms_norm(x, w.bfloat16())
    with pytest.raises(ValueError, match=r"x: expected a tensor \[\.\.\., H\] of at least 1 dimension"):
        ops.rms_norm(torch.tensor(1.0), torch.randn(1))
    with pytest.raises(ValueError, match=r"eps: expected a finite value >= 0, got -1"):
        ops.rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match=r"weight: expected device cpu \(same as x\), got meta"):
        ops.rms_norm(x, w.to("meta"))
    _, rstd = ops.rms_norm_forward(x, w, EPS)
    with pytest.raises(ValueError, match=r"dy: expected dtype float32 \(same as x\)"):
        ops.rms_norm_backward(x.half(), x, w, rstd)
    with pytest.raises(ValueError, match=r"rstd: expected shape \[4\]"):
        ops.rms_norm_backward(x, x, w, rstd[:3])


def test_config_norm_kernel():
    assert moe8.Config().norm_kernel == "auto"  # moe8's kernel where it measured faster
    assert moe8.Config(norm_kernel="moe8").norm_kernel == "moe8"
    with pytest.raises(
        ValueError, match=r"norm_kernel: expected one of \['auto', 'torch', 'moe8'\], got 'apex'"
    ):
        moe8.Config(norm_kernel="apex")
    with pytest.raises(ValueError, match=r"norm_kernel: expected one of"):
        moe8.Config().replace(norm_kernel=None)


def test_auto_norm_kernel_rule():
    """norm_kernel="auto" takes moe8's kernel on a GPU for many narrow rows only (Qwen3's per-head q_norm:
    262,144 rows of 128, where it measured 1.8x torch's), torch's elsewhere and always on the CPU."""
    from moe8.norm import moe8_norm_pays

    assert moe8_norm_pays(262144, 128, True)
    assert not moe8_norm_pays(32768, 128, True)  # k_norm's rows: slower there
    assert not moe8_norm_pays(8192, 2048, True)  # the hidden norms: slower there
    assert not moe8_norm_pays(262144, 128, False)


class TinyNorm(torch.nn.Module):
    """An HF-style RMSNorm (weight, variance_epsilon, transformers' formula) as moe8.hf fuses one: its own
    forward kept as _moe8_forward, the model's HF config in _moe8_config, its moe8.Config in _moe8."""

    def __init__(self, hidden, cfg):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(hidden) + 0.5)
        self.variance_epsilon = 1e-6
        self._moe8_config = types.SimpleNamespace(_experts_implementation="moe8")
        self._moe8 = cfg

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)

    _moe8_forward = forward


@pytest.mark.parametrize("kernel", ["torch", "moe8", "auto"])
def test_norm_forward_runs_the_configured_kernel(kernel, monkeypatch):
    """hf.norm_forward reads its module's Config: norm_kernel="moe8" runs moe8.ops.rms_norm (counted), "torch"
    runs F.rms_norm, and so does "auto" on the CPU; all match the module's own forward and give the weight its
    gradient."""
    from moe8 import hf

    counted = {"n": 0}
    inner = ops.rms_norm

    def rms_norm(*args):
        counted["n"] += 1
        return inner(*args)

    monkeypatch.setattr(ops, "rms_norm", rms_norm)
    m = TinyNorm(48, moe8.Config(norm_kernel=kernel))
    x = torch.randn(2, 5, 48, requires_grad=True)
    y = hf.norm_forward(m, x)
    assert counted["n"] == (kernel == "moe8")
    want = m.forward(x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, m.weight), dy)
    ref = torch.autograd.grad(want, (x, m.weight), dy)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if kernel == "moe8":
        assert torch.equal(y, inner(x, m.weight, m.variance_epsilon))
    else:
        assert torch.equal(y, F.rms_norm(x, (48,), m.weight, m.variance_epsilon))
