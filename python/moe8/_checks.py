"""moe8._checks — argument checks at the public boundary, shared by every op and composite.

Each failure names the caller's argument and says what was expected and what came: TypeError for a wrong
dtype or kind of object, ValueError for a wrong shape, device or value. Nothing here synchronises a GPU:
values of index tensors are read only where they live on the host (a pass over memory), or where the caller
asked for it (check_ids / check_indices); the kernels skip or clamp out-of-range values otherwise, so an
unchecked wrong call gives wrong numbers, never a read or write outside a tensor. Imports torch only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # what the kernels compute in
_INT32_MAX = 2**31 - 1


def _shape(t: Tensor) -> list:
    return list(t.shape)


def tensor(name: str, t, ndim: Optional[int] = None, what: str = "") -> Tensor:
    """t is a torch.Tensor (of ndim dimensions when given; `what` describes the layout, e.g. "[T, H]")."""
    if not isinstance(t, Tensor):
        raise TypeError(
            f"{name}: expected a torch.Tensor{' ' + what if what else ''}, got {type(t).__name__}"
        )
    if ndim is not None and t.dim() != ndim:
        raise ValueError(
            f"{name}: expected a {ndim}-d tensor{' ' + what if what else ''}, got shape {_shape(t)}"
        )
    return t


def floating(name: str, t: Tensor, allowed=FLOATS) -> None:
    if t.dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{name}: expected dtype {names}, got {t.dtype}")


def any_floating(name: str, t: Tensor) -> None:
    """A floating dtype of any width (an argument whose cast to float32 is documented)."""
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point dtype, got {t.dtype}")


def same_dtype(name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(
            f"{name}: expected dtype {ref.dtype} (same as {ref_name}), got {t.dtype}; cast it first "
            f"(moe8 does not cast silently)"
        )


def one_dtype(*named: tuple) -> None:
    """(name, tensor) pairs that must share one dtype: a TypeError names the tensor that differs from the
    others (all of them when no dtype is shared by most)."""
    dtypes = [t.dtype for _, t in named]
    common = max(dtypes, key=dtypes.count)
    if dtypes.count(common) == len(dtypes):
        return
    if 2 * dtypes.count(common) > len(dtypes):
        others = " and ".join(n for n, t in named if t.dtype == common)
        for n, t in named:
            if t.dtype != common:
                raise TypeError(
                    f"{n}: expected dtype {common} (same as {others}), got {t.dtype}; cast it first "
                    f"(moe8 does not cast silently)"
                )
    got = ", ".join(f"{n} {t.dtype}" for n, t in named)
    raise TypeError(
        f"{', '.join(n for n, _ in named)}: expected one dtype, got {got}; cast them first "
        f"(moe8 does not cast silently)"
    )


def same_device(name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name}: expected device {ref.device} (same as {ref_name}), got {t.device}")


def one_device(*named: tuple) -> None:
    """(name, tensor or None) pairs on the first one's device (a meta tensor beside CPU ones included: the
    dispatcher would run the shape-only implementation and return a meta tensor without a word)."""
    ref_name, ref = named[0]
    for name, t in named[1:]:
        if t is not None:
            same_device(name, t, ref_name, ref)


def dim_is(name: str, t: Tensor, dim: int, expected: int, what: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(f"{name}: expected {what} = {expected} (dim {dim}), got shape {_shape(t)}")


def integer(name: str, value, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """A Python int (or integer 0-d tensor / numpy integer) in [lo, hi] where given."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    v = int(value.__index__())
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        want = " <= ".join(str(p) for p in (lo, name, hi) if p is not None)
        raise ValueError(f"{name}: expected {want}, got {v}")
    return v


def index_dtype(name: str, t: Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"{name}: expected an integer dtype (int32 or int64), got {t.dtype}")


def ids(name: str, t: Tensor, num_experts: int, check_values: bool) -> Tensor:
    """Expert ids of any integer dtype -> int32 contiguous ids, their values checked.

    On the host their values are checked here (no sync); on a GPU only when check_values (one sync, the one
    the plan's own check would take: the caller then skips that one); under torch.compile by the plan op
    instead (no data-dependent branch in a graph; the CPU core always checks). Unchecked int64 ids are clamped
    to [-1, num_experts] before the narrowing to int32 (one elementwise op, no sync), so an id above 2**31
    cannot wrap into a valid expert: the plan kernel skips what is out of range."""
    index_dtype(name, t)
    tracing = torch.compiler.is_compiling()  # no data-dependent branch in a graph: the core checks
    if t.numel() and not tracing and (not t.is_cuda or check_values):
        outside = (t < 0) | (t >= num_experts)
        if bool(outside.any()):  # the one read (a sync on a GPU); the details only for the message
            bad, lo, hi = int(outside.sum()), int(t.min()), int(t.max())
            raise ValueError(
                f"{name}: expected expert ids in [0, {num_experts}) (num_experts from gate_up's dim 0), found "
                f"{bad} out of range (min {lo}, max {hi})"
            )
    elif t.dtype == torch.int64:
        t = t.clamp(-1, num_experts)
    return t.to(torch.int32).contiguous()


def offsets(name: str, t: Tensor, num_experts: int, rows: int) -> None:
    """Group offsets [E+1] int32: 0, nondecreasing, at most rows. Values checked on the host only."""
    tensor(name, t, 1, "[E + 1]")
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if t.shape[0] != num_experts + 1:
        raise ValueError(f"{name}: expected {num_experts + 1} values (E + 1), got shape {_shape(t)}")
    if t.is_cuda:
        return
    if int(t[0]) != 0:
        raise ValueError(f"{name}: expected {name}[0] == 0, got {int(t[0])}")
    d = t[1:] - t[:-1]
    if d.numel() and int(d.min()) < 0:
        e = int((d < 0).nonzero()[0]) + 1
        raise ValueError(
            f"{name}: expected nondecreasing values, got {name}[{e}] = {int(t[e])} < {int(t[e - 1])}"
        )
    if int(t[-1]) > rows:
        raise ValueError(f"{name}: expected {name}[E] <= {rows} rows, got {int(t[-1])}")


def saved(ctx, consumed: bool, switch: str = "consume_gate_up") -> tuple:
    """ctx.saved_tensors, or, where a first backward wrote its gradient over a saved input (`consumed`), a
    RuntimeError naming the Config switch that made it so (autograd's own error names neither)."""
    try:
        return ctx.saved_tensors
    except RuntimeError as e:
        if not consumed or "inplace" not in str(e):
            raise
        raise RuntimeError(
            f"{switch}: a second backward through this graph reads the gate_up output that the first backward "
            f"overwrote with its gradient (moe8.Config({switch}=True)); use Config({switch}=False) to backward "
            "twice (retain_graph=True)"
        ) from e
