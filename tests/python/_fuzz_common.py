"""What the fuzzer's case generators share (tests/python/_fuzz_worker.py runs them): a case, the comparison
with its reference, and the random inputs."""

from __future__ import annotations

import torch

OK = "ok"  # the call must return the reference's result


class Case:
    def __init__(self, op, fault, call, reference, names=(), either=False, tol=None, check=None):
        self.op, self.fault, self.call, self.reference = op, fault, call, reference
        self.names = names  # a fault: the error must name one of these
        self.either = either  # the result or a named error are both right (unchecked values on a GPU)
        self.tol = tol  # (rtol, atol) for the comparison; None: from the output dtype
        self.check = check  # a custom comparison (out, reference) -> None, raising AssertionError


def _tol(dtype):
    return (1e-4, 1e-4) if dtype in (torch.float32, torch.float64) else (4e-2, 4e-2)


def compare(out, want, tol):
    if isinstance(want, (tuple, list)):
        assert len(out) == len(want), f"{len(out)} outputs, expected {len(want)}"
        for o, w in zip(out, want):
            compare(o, w, tol)
        return
    assert out.shape == want.shape, f"shape {list(out.shape)}, expected {list(want.shape)}"
    if not want.is_floating_point():
        assert torch.equal(out.cpu().long(), want.cpu().long()), "integer outputs differ"
        return
    rtol, atol = tol or _tol(out.dtype)
    scale = max(1.0, float(want.detach().float().abs().nan_to_num(0, 0, 0).max()) if want.numel() else 1.0)
    torch.testing.assert_close(
        out.detach().cpu().double(),
        want.detach().cpu().double(),
        rtol=rtol,
        atol=atol * scale,
        equal_nan=True,
    )


# --------------------------------------------------------------------------------------------- inputs
def pick(rng, *options):
    return options[rng.randrange(len(options))]


def size(rng, big=64):
    return pick(rng, 0, 1, 2, 3, 5, 7, 8, 16, big)


def randn(rng, shape, dtype, dev, noncontig=False, nan=False):
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    t = (torch.randn(*shape, generator=g) * 0.5).to(dtype)
    if nan and t.numel():
        t.view(-1)[rng.randrange(t.numel())] = float("nan")
    if noncontig and t.dim() == 2:  # the same values through a transposed copy: a strided view
        t = t.t().contiguous().t()
    return t.to(dev)


def bad_float(rng):
    return pick(rng, torch.float64, torch.int32, torch.int64)
