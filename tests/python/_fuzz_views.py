"""Fuzzer cases (tests/python/_fuzz_worker.py runs them) for the weights a caller may pass as views, and for
tensors on different devices: moe8.experts_forward with transposed, strided and expanded expert weights,
forward and backward (the gradients reach the tensors the views were taken from, in their shapes), against
moe8.reference in float64; and a tensor on another device (meta beside CPU tensors, the CPU beside CUDA
ones), which must be a ValueError naming it."""

from __future__ import annotations

import torch
from _fuzz_common import OK, Case, pick, randn

from moe8 import experts_forward
from moe8 import reference as ref


def other_device(dev: str) -> str:
    """A device beside dev: the meta device beside the CPU, the CPU beside a GPU."""
    return "meta" if dev == "cpu" else "cpu"


def _view(rng, shape, how: str, dt, dev):
    """(leaf, view of the leaf with `shape`, the view as a function of a leaf)."""
    E, n, k = shape
    if how == "transposed":
        fn = lambda t: t.transpose(1, 2)  # noqa: E731
        leaf = randn(rng, (E, k, n), dt, dev)
    elif how == "strided":  # every other expert, every other column
        fn = lambda t: t[::2, :, ::2]  # noqa: E731
        leaf = randn(rng, (2 * E, n, 2 * k), dt, dev)
    elif how == "expanded":  # one expert's weights shared by all
        fn = lambda t: t.expand(E, n, k)  # noqa: E731
        leaf = randn(rng, (1, n, k), dt, dev)
    else:
        fn = lambda t: t  # noqa: E731
        leaf = randn(rng, shape, dt, dev)
    leaf.requires_grad_()
    return leaf, fn(leaf), fn


def _grads(y, inputs, dy):
    if not y.requires_grad:
        return [torch.zeros_like(t) for t in inputs]
    got = torch.autograd.grad(y, inputs, dy, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, got)]


def views_case(rng, dev):
    T, H, I, E = pick(rng, 0, 1, 3, 7, 16), pick(rng, 1, 3, 8), pick(rng, 1, 2, 5), pick(rng, 1, 2, 3, 8)
    K = min(E, pick(rng, 1, 2))
    dt = pick(rng, torch.float32, torch.float32, torch.bfloat16)
    layout, act = pick(rng, "nk", "kn"), pick(rng, "swiglu", "silu")
    n_up = 2 * I if act != "silu" else I
    gu_shape, dn_shape = ((E, n_up, H), (E, H, I)) if layout == "nk" else ((E, H, n_up), (E, I, H))
    views = ("contiguous", "transposed", "strided", "expanded")
    hows = pick(rng, *views), pick(rng, *views[1:])
    if rng.random() < 0.5:
        hows = hows[::-1]
    gu_leaf, gu, gu_fn = _view(rng, gu_shape, hows[0], dt, dev)
    dn_leaf, dn, dn_fn = _view(rng, dn_shape, hows[1], dt, dev)
    x = randn(rng, (T, H), dt, dev).requires_grad_()
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    ids = ids.long().to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    dy = randn(rng, (T, H), dt, dev)
    fault, names = pick(rng, OK, OK, OK, "device"), ()
    args = {"x": x, "ids": ids, "weights": w, "gate_up": gu, "down": dn}
    if fault == "device":
        moved = pick(rng, "ids", "weights", "gate_up", "down")
        args[moved] = args[moved].detach().to(other_device(dev))
        names = (moved,)
    kw = dict(layout=layout, activation=act)

    def call():
        y = experts_forward(args["x"], args["ids"], args["weights"], args["gate_up"], args["down"], **kw)
        return (y, *_grads(y, [x, gu_leaf, dn_leaf], dy))

    def reference():
        leaves = [t.detach().cpu().double().requires_grad_() for t in (x, gu_leaf, dn_leaf)]
        y = ref.experts_forward(
            leaves[0], ids.cpu(), w.cpu().double(), gu_fn(leaves[1]), dn_fn(leaves[2]), **kw
        )
        return (y.to(dt), *(t.to(dt) for t in _grads(y, leaves, dy.cpu().double())))

    tol = (5e-2, 5e-2) if dt != torch.float32 else (1e-4, 1e-4)
    return Case("experts_forward(views)", fault, call, reference, names, tol=tol)
