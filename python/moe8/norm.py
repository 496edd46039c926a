"""moe8.norm — RMSNorm as one moe8 kernel per direction (torch.library custom ops on moe8._C, differentiable in x
and the weight): what the HF models' norms run with Config(norm_kernel="moe8"). Part of moe8.ops too
(moe8.ops.rms_norm)."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from . import _checks as _c
from ._core import C as _C
from ._core import make_direct as _make_direct
from ._core import scratch as _scratch
from ._core import stream as _stream


@functools.lru_cache(maxsize=256)
def _workspace_elems(rows: int, cols: int) -> int:
    """float32 elements of the backward's GPU workspace (its weight-gradient partials): a function of the shape."""
    return _C.rms_norm_workspace_elems(rows, cols, True)


# Config(norm_kernel="auto"): moe8's kernel where it measured faster than torch's on the H200 (bench_rmsnorm,
# docs/kernels.md): rows at most this wide, at least this many of them.
AUTO_MAX_COLS, AUTO_MIN_ROWS = 256, 65536


def moe8_norm_pays(rows: int, cols: int, on_cuda: bool) -> bool:
    """Whether norm_kernel="auto" runs moe8.ops.rms_norm on x [rows, cols]: on a GPU, for many narrow rows."""
    return on_cuda and cols <= AUTO_MAX_COLS and rows >= AUTO_MIN_ROWS


def _check(x: Tensor, weight: Tensor, eps: float) -> None:
    _c.tensor("x", x)
    _c.tensor("weight", weight, 1, "[H]")
    if x.dim() == 0:
        raise ValueError("x: expected a tensor [..., H] of at least 1 dimension, got a 0-d tensor")
    _c.floating("x", x)
    _c.same_dtype("weight", weight, "x", x)
    _c.one_device(("x", x), ("weight", weight))
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight: expected shape [{x.shape[-1]}] (x's last dim), got {list(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__} {eps!r}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps: expected a finite value >= 0, got {eps!r}")


def _rows(x: Tensor) -> Tensor:
    """x [..., H] as a contiguous [rows, H] (rows spelled out: -1 is ambiguous for H = 0)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).contiguous()


@torch.library.custom_op("moe8::rms_norm_forward", mutates_args=())
def rms_norm_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """y = x * rstd * weight with rstd = 1 / sqrt(mean(x^2 over the last dim) + eps): x [..., H], weight [H] of
    x's dtype -> y (x's shape and dtype), rstd [x.numel() // H] float32 (what the backward reads). fp32 math, y
    rounded once: torch.nn.functional.rms_norm(x, (H,), weight, eps)."""
    _check(x, weight, eps)
    x2 = _rows(x)  # [R, H]
    y = torch.empty_like(x2)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    _C.rms_norm_forward(x2, weight.contiguous(), float(eps), y, rstd, _stream(x))
    return y.view(x.shape), rstd


@rms_norm_forward.register_fake
def _(x, weight, eps):
    _c.one_device(("x", x), ("weight", weight))
    return x.new_empty(x.shape), x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)


@torch.library.custom_op("moe8::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * weight, xhat = x * rstd (fp32, over the last dim),
    and dweight = the sum over rows of dy * xhat (fp32, the same bits on every run): dy, x [..., H], weight [H],
    rstd from rms_norm_forward -> dx (x's shape), dweight (weight's shape and dtype)."""
    x2, dy2 = _rows(x), _rows(dy)
    dx = torch.empty_like(x2)
    dweight = torch.empty_like(weight)
    ws = None
    if x.is_cuda:
        ws = _scratch(x2, _workspace_elems(x2.shape[0], x2.shape[1]), torch.float32)
    _C.rms_norm_backward(dy2, x2, weight.contiguous(), rstd, dx, dweight, ws, _stream(x))
    return dx.view(x.shape), dweight


@rms_norm_backward.register_fake
def _(dy, x, weight, rstd):
    _c.one_device(("dy", dy), ("x", x), ("weight", weight), ("rstd", rstd))
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_backward(dy, x, weight, rstd)
    return dx, dweight, None


rms_norm_forward.register_autograd(_backward, setup_context=_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim, as torch.nn.functional.rms_norm(x, (H,), weight, eps): x [..., H] float32,
    float16 or bfloat16 (any strides: made contiguous), weight [H] of x's dtype -> [..., H] in x's dtype.
    Statistics and the weight in fp32, one rounding; differentiable in x and weight. A CPU tensor runs the CPU
    reference."""
    return rms_norm_forward(x, weight, eps)[0]


_make_direct(globals())  # last: after every op's registrations
