"""The fuzzer's FP8 and routed-backward cases (tests/python/_fuzz_worker.py runs them): the FP8 expert
layers, the FP8 1x128 row quantisation fused with the permute, and the activation's backward with the
routing weights applied, each with indices out of range among its faults."""

from __future__ import annotations

import torch
from _fuzz_common import OK, Case, pick, randn

import moe8
from moe8 import fp8, fused
from moe8 import reference as ref


def fp8_case(rng, dev):
    T, H, I, E = pick(rng, 0, 1, 7, 33), pick(rng, 16, 128), pick(rng, 16, 64), pick(rng, 1, 4)
    x = randn(rng, (T, H), torch.bfloat16, dev)
    gu, dn = randn(rng, (E, 2 * I, H), torch.bfloat16, dev), randn(rng, (E, H, I), torch.bfloat16, dev)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    ids = torch.randint(0, E, (T, 1), generator=g).to(dev)
    w = torch.rand(T, 1, generator=g).to(dev)
    recipe = pick(rng, "blockwise", "rowwise", "tensorwise")
    fault, names = pick(rng, OK, OK, "ids_range", "x_dtype", "down_experts"), ()
    if fault == "ids_range" and T:
        ids = ids.clone()
        ids[0, 0] = E
        names = ("ids",)
    elif fault == "x_dtype":
        x, names = x.float(), ("x",)
    elif fault == "down_experts":
        dn, names = randn(rng, (E + 1, H, I), torch.bfloat16, dev), ("down",)
    else:
        fault = OK

    def close(out, want):
        assert out.shape == want.shape, f"shape {list(out.shape)}, expected {list(want.shape)}"
        if want.numel():
            rel = float((out.double().cpu() - want.double()).norm() / want.double().norm().clamp_min(1e-12))
            assert rel < 0.3, f"{recipe}: relative error {rel:.3f} against the bf16 reference"

    def reference():
        return ref.experts_forward(x.float().cpu(), ids.cpu(), w.cpu(), gu.float().cpu(), dn.float().cpu())

    return Case(f"experts_forward(fp8={recipe})", fault, lambda: moe8.experts_forward(x, ids, w, gu, dn, fp8=recipe),
                reference, names, check=close)  # fmt: skip


def _plan_maps(rng, T, k, pad):
    """A consistent row_to_slot [T k + pad] and slot_to_row [T k] (a random permutation, -1 on padding)."""
    R = T * k + pad
    perm = torch.randperm(R, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    r2s = torch.where(perm < T * k, perm, -1).to(torch.int32)
    s2r = torch.full((T * k,), -1, dtype=torch.int32)
    s2r[r2s[r2s >= 0].long()] = torch.nonzero(r2s >= 0).view(-1).to(torch.int32)
    return r2s, s2r


def _index_fault(rng, fault, t, n):
    """t with entry 0 past [-1, n) (fault index_high / index_low); t itself when it is empty."""
    if not t.numel():
        return t
    t = t.clone()
    t[0] = pick(rng, n + 5, 2**31 - 1) if fault == "index_high" else pick(rng, -2, -(2**31))
    return t


def fp8_rows_case(rng, dev):
    """The FP8 1x128 row quantisation fused with the permute (row by row, or token-major with slot_to_row)."""
    T, K, k, pad = pick(rng, 0, 1, 7, 33), pick(rng, 1, 16, 130, 256), pick(rng, 1, 2, 3), pick(rng, 0, 3)
    x = randn(rng, (T, K), pick(rng, torch.float32, torch.bfloat16), dev)
    r2s, s2r = _plan_maps(rng, T, k, pad)
    token_major = rng.random() < 0.5
    fault = pick(rng, OK, OK, "index_high", "index_low", "x_dtype")
    names = ()
    if fault in ("index_high", "index_low") and T:
        if token_major and rng.random() < 0.5:
            s2r, names = _index_fault(rng, fault, s2r, T * k + pad), ("slot_to_row",)
        else:
            r2s, names = _index_fault(rng, fault, r2s, T * k), ("row_to_slot",)
    elif fault == "x_dtype":
        x, names = x.double(), ("x",)
    else:
        fault = OK
    if dev != "cpu" and names == ("row_to_slot",) and not token_major:
        names = ()  # unchecked on a GPU: the row-by-row kernel reads the slot as padding, as the reference does
    r2s_d, s2r_d = r2s.to(dev), s2r.to(dev) if token_major else None

    def close(out, want):
        q, sc = out
        assert q.shape == want.shape and sc.shape == (want.shape[0], (K + 127) // 128), "shapes"
        deq = q.cpu().view(torch.float8_e4m3fn).double() * sc.cpu().double().repeat_interleave(128, 1)[:, :K]
        blk = sc.cpu().double().repeat_interleave(128, 1)[:, :K]
        err = (deq - want).abs()  # e4m3: 3 mantissa bits (2^-4 relative), subnormals 2^-9 of the scale apart
        assert bool((err <= want.abs() / 16 + blk / 512 + 1e-30).all()), f"max error {float(err.max()):.3g}"
        pad_rows = (r2s < 0) | (r2s >= T * k)
        assert bool((q.cpu()[pad_rows] == 0).all()) and bool((sc.cpu()[pad_rows] == 1).all()), "padding rows"

    def reference():
        want = torch.zeros(r2s.numel(), K, dtype=torch.float64)
        for r, s in enumerate(r2s.tolist()):
            if 0 <= s < T * k:  # out of range: padding (what the CPU raises on, and a GPU kernel reads as -1)
                want[r] = x[s // k].double().cpu()
        return want

    return Case("quantize_rows_1x128", fault, lambda: fp8.quantize_rows_1x128(x, r2s_d, k, s2r_d), reference,
                names, either=bool(names) and dev != "cpu", check=close)  # fmt: skip


def routed_act_case(rng, dev):
    """The activation's backward with the routing weights applied (the routed down projection's dgrad)."""
    T, k, pad, I = pick(rng, 0, 1, 5, 16), pick(rng, 1, 2), pick(rng, 0, 3), pick(rng, 1, 3, 8)
    act = pick(rng, "swiglu", "silu")
    kind = moe8.ops.ACTIVATIONS[act]
    interleaved = act == "swiglu" and rng.random() < 0.3
    r2s, _ = _plan_maps(rng, T, k, pad)
    R, dt = r2s.numel(), pick(rng, torch.float32, torch.bfloat16)
    h = randn(rng, (R, 2 * I if act == "swiglu" else I), dt, dev)
    dout, w = (
        randn(rng, (R, I), dt, dev),
        torch.rand(T, k, generator=torch.Generator().manual_seed(rng.randrange(99))),
    )
    fault, names = pick(rng, OK, OK, "index_high", "index_low"), ()
    if fault != OK and R:
        r2s, names = _index_fault(rng, fault, r2s, T * k), ("row_to_slot",)
        names = names if dev == "cpu" else ()  # unchecked on a GPU: read as padding, as the reference does
    else:
        fault = OK
    r2s_d, w_d = r2s.to(dev), w.to(dev)

    def reference():
        hh = h.double().cpu().requires_grad_()
        a = ref.act(hh, act, interleaved)
        live = (r2s >= 0) & (r2s < T * k)
        wr = torch.cat([w.double().view(-1), torch.zeros(1, dtype=torch.float64)])[
            torch.where(live, r2s, T * k).long()
        ]
        (wr[:, None] * a * dout.double().cpu()).sum().backward()
        dw = torch.zeros(T * k, dtype=torch.float64)
        dw[r2s[live].long()] = (a * dout.double().cpu()).sum(-1)[live].detach()
        return hh.grad.to(dt), dw.view(T, k).float()

    def call():
        return fused.activation_backward_routed(h, dout.clone(), w_d, r2s_d, kind, interleaved, 1.702, 7.0)

    return Case("activation_backward_routed", fault, call, reference, names)
